//! The string check every request goes through, and the helpers the generated walks
//! (`OUT_DIR/warden_checks.rs`, written by build.rs) are made of.
//!
//! Only NUL is refused: PostgreSQL TEXT cannot store U+0000 (SQLite can, so the two ledger
//! backends would otherwise disagree), and prost already refuses strings that are not UTF-8.
//! Nothing else is refused generically — JSON payload fields legitimately carry any text.

use std::fmt::{Debug, Write as _};

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, FieldViolation, StatusExt};

/// What a refused string is told.
const NUL: &str = "must not contain a NUL character (U+0000)";

/// A message whose strings can be checked; implemented by build.rs for every generated message.
pub trait CheckStrings {
    /// Whether [`crate::codec::CheckedCodec`] checks this message when decoding it: true for
    /// RPC inputs only, so that servers check requests and clients never refuse a response.
    const CHECK_ON_DECODE: bool = false;

    /// The first string (fields in declaration order, then oneof members) that cannot be stored, as a violation naming it from
    /// the request's root (`steps[2].name`, `parent.child`, `labels["k"]`). `path` is this
    /// message's own path — empty for the request — and is left as it was given.
    ///
    /// Messages no request carries have a no-op implementation.
    fn check_strings(&self, path: &mut String) -> Result<(), FieldViolation>;
}

/// prost boxes recursive message fields; they are checked like the message itself.
impl<T: CheckStrings> CheckStrings for Box<T> {
    fn check_strings(&self, path: &mut String) -> Result<(), FieldViolation> {
        (**self).check_strings(path)
    }
}

/// The status a refused request is answered with: `INVALID_ARGUMENT`, the field in the
/// message and as a BadRequest field violation — the same shape as `warden_grpc::invalid_field`.
pub fn violation_status(violation: FieldViolation) -> Status {
    let message = format!("{}: {}", violation.field, violation.description);
    Status::with_error_details(Code::InvalidArgument, message, ErrorDetails::with_bad_request(vec![violation]))
}

/// Checks a whole request, as the server codec does.
pub fn check_request<T: CheckStrings>(message: &T) -> Result<(), Status> {
    message.check_strings(&mut String::new()).map_err(violation_status)
}

/// `path.field`, or `field` at the root.
fn joined(path: &str, field: &str) -> String {
    if path.is_empty() { field.to_string() } else { format!("{path}.{field}") }
}

/// Appends `.field` (or `field` at the root) to `path`; returns the length to truncate back to.
fn enter(path: &mut String, field: &str) -> usize {
    let len = path.len();
    if len > 0 {
        path.push('.');
    }
    path.push_str(field);
    len
}

fn refused(value: &str) -> bool {
    value.contains('\0')
}

/// A `string` field.
pub(crate) fn string(path: &str, field: &str, value: &str) -> Result<(), FieldViolation> {
    if refused(value) { Err(FieldViolation::new(joined(path, field), NUL)) } else { Ok(()) }
}

/// A `repeated string` field: the violation names the element, `field[i]`.
pub(crate) fn strings(path: &str, field: &str, values: &[String]) -> Result<(), FieldViolation> {
    match values.iter().position(|v| refused(v)) {
        Some(i) => Err(FieldViolation::new(format!("{}[{i}]", joined(path, field)), NUL)),
        None => Ok(()),
    }
}

/// A singular message field (or oneof member).
pub(crate) fn message<T: CheckStrings>(path: &mut String, field: &str, value: &T) -> Result<(), FieldViolation> {
    let len = enter(path, field);
    let checked = value.check_strings(path);
    path.truncate(len);
    checked
}

/// A `repeated` message field: element paths are `field[i]`.
#[cfg_attr(not(test), allow(dead_code, reason = "no warden.v1 request has one yet; the fixture tests it"))]
pub(crate) fn messages<T: CheckStrings>(path: &mut String, field: &str, values: &[T]) -> Result<(), FieldViolation> {
    for (i, value) in values.iter().enumerate() {
        let len = enter(path, field);
        let _ = write!(path, "[{i}]");
        let checked = value.check_strings(path);
        path.truncate(len);
        checked?;
    }
    Ok(())
}

/// A `map<string, …>` key: the violation names the map (the key itself cannot be shown).
#[cfg_attr(not(test), allow(dead_code, reason = "no warden.v1 request has a map yet; the fixture tests it"))]
pub(crate) fn map_key(path: &str, field: &str, key: &str) -> Result<(), FieldViolation> {
    if refused(key) { Err(FieldViolation::new(joined(path, field), format!("keys {NUL}"))) } else { Ok(()) }
}

/// A `map<…, string>` value: the violation names the entry, `field["key"]` (keys quoted and
/// escaped as Rust debug strings, numbers as they are).
#[cfg_attr(not(test), allow(dead_code, reason = "no warden.v1 request has a map yet; the fixture tests it"))]
pub(crate) fn map_string<K: Debug>(path: &str, field: &str, key: &K, value: &str) -> Result<(), FieldViolation> {
    if refused(value) { Err(FieldViolation::new(format!("{}[{key:?}]", joined(path, field)), NUL)) } else { Ok(()) }
}

/// A `map<…, Message>` value: paths below it start `field["key"]`.
#[cfg_attr(not(test), allow(dead_code, reason = "no warden.v1 request has a map yet; the fixture tests it"))]
pub(crate) fn map_message<K: Debug, T: CheckStrings>(
    path: &mut String,
    field: &str,
    key: &K,
    value: &T,
) -> Result<(), FieldViolation> {
    let len = enter(path, field);
    let _ = write!(path, "[{key:?}]");
    let checked = value.check_strings(path);
    path.truncate(len);
    checked
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use tonic_types::StatusExt;

    use super::*;
    use crate::check_fixture::pb;
    use crate::v1;

    fn field_of<T: CheckStrings>(message: &T) -> Option<String> {
        let mut path = String::new();
        let result = message.check_strings(&mut path);
        assert!(path.is_empty(), "the walk leaves the path as it found it: {path:?}");
        result.err().map(|v| v.field)
    }

    fn inner(child: &str) -> pb::outer::Inner {
        pb::outer::Inner { child: child.into(), ..Default::default() }
    }

    fn clean() -> pb::Outer {
        pb::Outer {
            name: "n".into(),
            tags: vec!["a".into(), "b".into()],
            labels: HashMap::from([("k".into(), "v".into())]),
            inners: HashMap::from([("i".into(), inner("c"))]),
            numbered: HashMap::from([(3, "three".into())]),
            parent: Some(inner("p")),
            steps: vec![inner("s0"), inner("s1"), inner("s2")],
            choice: Some(pb::outer::Choice::Text("t".into())),
            maybe: Some("m".into()),
            r#type: "t".into(),
            raw: vec![0, 0, 0],
            counts: Some(pb::Counts { n: 0 }),
        }
    }

    #[test]
    fn generated_walk_names_every_kind_of_string_field_holding_a_nul() {
        assert_eq!(field_of(&clean()), None, "bytes may hold NUL; clean strings pass");
        let deep = pb::outer::Inner {
            again: Some(Box::new(pb::outer::Inner {
                leaves: vec![pb::Leaf { value: "ok".into() }, pb::Leaf { value: "x\0".into() }],
                ..Default::default()
            })),
            ..inner("p")
        };
        let cases: Vec<(pb::Outer, &str)> = vec![
            (pb::Outer { name: "a\0b".into(), ..clean() }, "name"),
            (pb::Outer { tags: vec!["a".into(), "\0".into()], ..clean() }, "tags[1]"),
            (pb::Outer { labels: HashMap::from([("k\0".into(), "v".into())]), ..clean() }, "labels"),
            (pb::Outer { labels: HashMap::from([("k".into(), "v\0".into())]), ..clean() }, "labels[\"k\"]"),
            (pb::Outer { inners: HashMap::from([("i".into(), inner("\0"))]), ..clean() }, "inners[\"i\"].child"),
            (pb::Outer { numbered: HashMap::from([(3, "\0".into())]), ..clean() }, "numbered[3]"),
            (pb::Outer { parent: Some(inner("\0")), ..clean() }, "parent.child"),
            (pb::Outer { parent: Some(deep), ..clean() }, "parent.again.leaves[1].value"),
            (pb::Outer { steps: vec![inner("a"), inner("b"), inner("\0")], ..clean() }, "steps[2].child"),
            (pb::Outer { choice: Some(pb::outer::Choice::Text("\0".into())), ..clean() }, "text"),
            (pb::Outer { choice: Some(pb::outer::Choice::Nested(inner("\0"))), ..clean() }, "nested.child"),
            (pb::Outer { maybe: Some("\0".into()), ..clean() }, "maybe"),
            (pb::Outer { r#type: "\0".into(), ..clean() }, "type"),
        ];
        for (message, field) in cases {
            assert_eq!(field_of(&message).as_deref(), Some(field), "{message:?}");
        }
        assert_eq!(field_of(&pb::Outer { choice: Some(pb::outer::Choice::Number(0)), ..clean() }), None);
        // Another RPC input, checked as a root of its own.
        assert_eq!(field_of(&pb::Leaf { value: "\0".into() }).as_deref(), Some("value"));
    }

    /// Through a function, so the assertions below test the generated constants at run time.
    fn on_decode<T: CheckStrings>() -> bool {
        T::CHECK_ON_DECODE
    }

    #[test]
    fn only_rpc_inputs_are_checked_on_decode_and_responses_never_refused() {
        assert!(on_decode::<pb::Outer>() && on_decode::<pb::Leaf>());
        assert!(!on_decode::<pb::Reply>());
        assert!(!on_decode::<pb::outer::Inner>(), "checked through its request");
        // A response type walks nothing, even holding a request's message type.
        let reply = pb::Reply { text: "\0".into(), leaf: Some(pb::Leaf { value: "\0".into() }) };
        assert_eq!(field_of(&reply), None);
        assert!(!on_decode::<v1::Summary>() && !on_decode::<v1::Event>() && !on_decode::<v1::Approval>());
        assert!(on_decode::<v1::AuthorizeRequest>() && on_decode::<v1::GetStateRequest>());
    }

    #[test]
    fn warden_requests_with_a_nul_are_invalid_argument_naming_the_field() {
        fn refused_field<T: CheckStrings>(message: &T) -> String {
            let status = check_request(message).expect_err("refused");
            assert_eq!(status.code(), Code::InvalidArgument);
            let details = status.get_details_bad_request().expect("BadRequest details");
            assert_eq!(details.field_violations.len(), 1);
            let field = details.field_violations[0].field.clone();
            assert_eq!(status.message(), format!("{field}: {NUL}"));
            field
        }
        let summaries = v1::ListSummariesRequest { summary_type: "tool\0".into(), ..Default::default() };
        assert_eq!(refused_field(&summaries), "summary_type");
        assert_eq!(refused_field(&v1::GetStateRequest { key: "\0".into(), ..Default::default() }), "key");
        let submit = v1::SubmitRunRequest { capability_handles: vec!["h\0".into()], ..Default::default() };
        assert_eq!(refused_field(&submit), "capability_handles[0]");
        let auth = v1::SignedAuthorization { key_id: "\0".into(), claims_json: vec![0], ..Default::default() };
        let invoke = v1::InvokeRequest { authorization: Some(auth), ..Default::default() };
        assert_eq!(refused_field(&invoke), "authorization.key_id");
        // JSON payloads may carry anything valid UTF-8 but NUL.
        let append =
            v1::AppendEventRequest { payload_json: r#"{"t":"\u0000 ☃ \u{1F600}"}"#.into(), ..Default::default() };
        assert!(check_request(&append).is_ok());
        assert!(check_request(&v1::AppendEventRequest { payload_json: "{\0}".into(), ..Default::default() }).is_err());
    }
}
