//! RFC 8785 (JCS) canonical JSON and SHA-256 digests of it.

use serde::Serialize;
use sha2::{Digest, Sha256};

/// RFC 8785 canonical JSON of any serializable value (sorted keys, ECMAScript number form).
///
/// Written here rather than with `serde_jcs`, which gives the same bytes (the tests below
/// check the two against each other) but buffers every object's members and re-parses each
/// key to sort it: every event hashed, decision signed and authorization checked goes through
/// this, and `serde_jcs` was a tenth of the ledger's CPU per append. The value is turned into
/// a `serde_json::Value` once and that tree written out in canonical form.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> String {
    // Fails only when the value cannot be represented as JSON (e.g. a non-string map key),
    // which none of Warden's types or `serde_json::Value` can produce.
    let value = serde_json::to_value(value).unwrap_or_else(|e| panic!("value is not representable as JSON: {e}"));
    let mut out = String::with_capacity(128);
    write_canonical(&mut out, &value);
    out
}

/// [`canonical_json`] of a value already parsed (no conversion).
pub fn canonical_value(value: &serde_json::Value) -> String {
    let mut out = String::with_capacity(128);
    write_canonical(&mut out, value);
    out
}

pub(crate) fn write_canonical(out: &mut String, value: &serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        // Every number in ECMAScript form, integers included (RFC 8785 §3.2.2.3): JSON
        // numbers are IEEE 754 doubles to whoever verifies, so 2^63 reads 9223372036854776000.
        Value::Number(n) => match (n.as_i64(), n.as_f64().filter(|f| f.is_finite())) {
            // An integer a double holds exactly is written as ECMAScript writes that double:
            // its decimal digits (what most numbers of a record are — seqs, attempts,
            // times — without the shortest-double search).
            (Some(i), _) if i.unsigned_abs() <= MAX_EXACT_INTEGER => {
                out.push_str(itoa::Buffer::new().format(i));
            }
            (_, Some(f)) => write_number(out, f),
            (_, None) => panic!("number {n} has no canonical JSON form"),
        },
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            // Members sorted by their names' UTF-16 code units (RFC 8785 §3.2.3). That is the
            // byte order a `Map` iterates in, except for names with characters past U+FFFF
            // against U+E000..U+FFFF; sorting settles both.
            // Names of ASCII alone (nearly every name) compare the same either way, and
            // bytewise is much cheaper than re-encoding both names for every comparison.
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            if members.iter().all(|(name, _)| name.is_ascii()) {
                members.sort_unstable_by(|a, b| a.0.cmp(b.0));
            } else {
                members.sort_unstable_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            }
            out.push('{');
            for (i, (name, item)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, name);
                out.push(':');
                write_canonical(out, item);
            }
            out.push('}');
        }
    }
}

/// 2^53: every integer up to it in magnitude is a double exactly, and ECMAScript writes such
/// a double as the integer's decimal digits (below 10^21, it never uses an exponent).
const MAX_EXACT_INTEGER: u64 = 1 << 53;

/// A finite number in ECMAScript form (RFC 8785 §3.2.2.3).
pub(crate) fn write_number(out: &mut String, f: f64) {
    out.push_str(ryu_js::Buffer::new().format_finite(f));
}

/// A JSON string as RFC 8785 §3.2.2.2 writes it: `"` and `\` escaped, control characters
/// as `\b \t \n \f \r` or `\u00xx` (lower-case hex), everything else as it is.
pub(crate) fn write_string(out: &mut String, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        let escape: &str = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0x08 => "\\b",
            0x09 => "\\t",
            0x0a => "\\n",
            0x0c => "\\f",
            0x0d => "\\r",
            0x00..=0x1f => "",
            _ => continue,
        };
        out.push_str(&s[start..i]);
        if escape.is_empty() {
            out.push_str("\\u00");
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 0xf) as usize] as char);
        } else {
            out.push_str(escape);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: impl AsRef<[u8]>) -> String {
    hex::encode(Sha256::digest(bytes.as_ref()))
}

/// Hex SHA-256 of the canonical JSON of `value`: the digest policy binds authorizations to.
pub fn args_digest(value: &serde_json::Value) -> String {
    sha256_hex(canonical_value(value))
}

/// SHA-256 of the deltas staged in a transaction, in staging order (RFC 8785 JSON array).
/// A commit is authorized for `{"tx_id": …, "deltas_sha256": …}`, so an approval of a commit
/// covers exactly these deltas: staging another changes the digest and needs a new decision.
pub fn staged_deltas_sha256(deltas: &[serde_json::Value]) -> String {
    sha256_hex(canonical_json(&deltas))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_sorted_and_whitespace_dropped() {
        let v = json!({"b": 1, "a": {"d": [1, 2], "c": "x"}});
        assert_eq!(canonical_json(&v), r#"{"a":{"c":"x","d":[1,2]},"b":1}"#);
    }

    #[test]
    fn numbers_use_ecmascript_form() {
        assert_eq!(canonical_json(&json!(1.0)), "1");
        assert_eq!(canonical_json(&json!(1e21)), "1e+21");
        assert_eq!(canonical_json(&json!(0.000001)), "0.000001");
    }

    #[test]
    fn strings_escape_minimally() {
        assert_eq!(canonical_json(&json!("é\n\u{1}")), "\"é\\n\\u0001\"");
    }

    /// The same bytes as `serde_jcs`, the reference implementation this replaces.
    #[test]
    fn matches_serde_jcs() {
        let cases = [
            json!(null),
            json!([true, false, 0, -0.0, 1.5, -2, 1e21, 1e-7, 123456789012345678u64, i64::MIN, u64::MAX, 0.1]),
            json!({"b": 1, "a": [{"z": null, "y": {}}, []], "": "", "A": "\u{7f}\u{0}\u{1f}\"\\/"}),
            // Names past U+FFFF sort before U+E000..U+FFFF in UTF-16, after them in UTF-8.
            json!({"\u{10000}": 1, "\u{e000}": 2, "\u{ffff}": 3, "\u{7f}": 4, "é": 5, "\u{1f600}x": 6}),
            json!({"text": "line\nbreak\ttab\r\u{8}\u{c}", "emoji": "😀", "nested": {"k": [1, {"b": 2, "a": 1}]}}),
            json!(["\u{2028}\u{2029}", "<script>", 4.35, 5e-324, 1.7976931348623157e308, 9007199254740993u64]),
            // Integers at and around the largest a double holds exactly, both signs.
            json!([9007199254740992u64, 9007199254740991u64, -9007199254740992i64, -9007199254740993i64, 0, -1]),
            json!([9007199254740994u64, 18014398509481984u64, -18014398509481985i64, 100000000000000000000.0]),
        ];
        for case in cases {
            assert_eq!(canonical_json(&case), serde_jcs::to_string(&case).expect("jcs"), "{case}");
            assert_eq!(canonical_value(&case), serde_jcs::to_string(&case).expect("jcs"), "{case}");
        }
        // A struct, through its `Serialize` (field order is not key order).
        #[derive(serde::Serialize)]
        struct Body {
            seq: u64,
            payload: serde_json::Value,
            event_type: &'static str,
            missing: Option<u8>,
        }
        let body = Body { seq: 7, payload: json!({"y": [1.0, "x"], "x": -1}), event_type: "t", missing: None };
        assert_eq!(canonical_json(&body), serde_jcs::to_string(&body).expect("jcs"));
    }

    /// Every string of one or two characters drawn from the edges of the escaping and
    /// ordering rules, as a value and as a member name, against `serde_jcs`.
    #[test]
    fn matches_serde_jcs_on_every_edge_character() {
        let chars: Vec<char> = (0u32..0x80)
            .chain([0x80, 0x7ff, 0x800, 0xd7ff, 0xe000, 0xfffd, 0xffff, 0x10000, 0x1f600, 0x10ffff])
            .filter_map(char::from_u32)
            .collect();
        let mut map = serde_json::Map::new();
        for a in &chars {
            for b in [None, Some('a'), Some('\u{10000}'), Some('\u{ffff}')] {
                let s: String = std::iter::once(*a).chain(b).collect();
                map.insert(s.clone(), json!(s));
            }
        }
        let value = serde_json::Value::Object(map);
        assert_eq!(canonical_value(&value), serde_jcs::to_string(&value).expect("jcs"));
    }

    #[test]
    fn digest_is_independent_of_key_order() {
        let a: serde_json::Value = serde_json::from_str(r#"{"x":1,"y":[true,null]}"#).unwrap();
        let b: serde_json::Value = serde_json::from_str(r#"{ "y":[true, null], "x":1.0 }"#).unwrap();
        assert_eq!(args_digest(&a), args_digest(&b));
        assert_eq!(args_digest(&a).len(), 64);
    }
}
