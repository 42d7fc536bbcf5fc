//! `{{step_id.output}}` references inside step parameters (seed 000 §4.2).
//!
//! - a string that is exactly one reference becomes the referenced value, typed;
//! - references inside a longer string interpolate: strings as they are, everything else as
//!   JSON (never a debug rendering);
//! - objects and arrays are resolved recursively;
//! - an unresolved or malformed reference is an error (the seed's text let it stay literal;
//!   Warden refuses, so a typo never reaches a tool).
//!
//! Resolution is a lookup in a map of step outputs: nothing is evaluated, so a template can
//! never execute code (K10).

use std::collections::HashMap;

use serde_json::Value;

/// One parsed `{{step.output.a.b}}` reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub step_id: String,
    pub path: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("malformed template '{text}': expected {{{{step_id.output}}}} or {{{{step_id.output.field}}}}")]
    Malformed { text: String },
    #[error("unresolved reference '{text}': step '{step_id}' has no output")]
    UnknownStep { text: String, step_id: String },
    #[error("unresolved reference '{text}': no value at '{at}'")]
    MissingPath { text: String, at: String },
}

enum Piece<'a> {
    Literal(&'a str),
    Ref(Reference, &'a str),
}

fn parse_reference(inner: &str, text: &str) -> Result<Reference, TemplateError> {
    let malformed = || TemplateError::Malformed { text: text.to_string() };
    let mut parts = inner.trim().split('.');
    let step_id = parts.next().filter(|s| crate::ids::check_step_id(s).is_ok()).ok_or_else(malformed)?;
    if parts.next() != Some("output") {
        return Err(malformed());
    }
    let path = parts
        .map(|seg| {
            let ok = !seg.is_empty() && seg.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            ok.then(|| seg.to_string()).ok_or_else(malformed)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Reference { step_id: step_id.to_string(), path })
}

fn pieces(s: &str) -> Result<Vec<Piece<'_>>, TemplateError> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find("{{") {
        if start > 0 {
            out.push(Piece::Literal(&rest[..start]));
        }
        let after = &rest[start + 2..];
        let end = after.find("}}").ok_or_else(|| TemplateError::Malformed { text: rest[start..].to_string() })?;
        let text = &rest[start..start + 2 + end + 2];
        out.push(Piece::Ref(parse_reference(&after[..end], text)?, text));
        rest = &after[end + 2..];
    }
    if !rest.is_empty() {
        out.push(Piece::Literal(rest));
    }
    Ok(out)
}

/// Every reference in `params`, in document order; fails on a malformed one.
pub fn references(params: &Value) -> Result<Vec<Reference>, TemplateError> {
    let mut refs = Vec::new();
    collect(params, &mut refs)?;
    Ok(refs)
}

fn collect(v: &Value, refs: &mut Vec<Reference>) -> Result<(), TemplateError> {
    match v {
        Value::String(s) => {
            for p in pieces(s)? {
                if let Piece::Ref(r, _) = p {
                    refs.push(r);
                }
            }
        }
        Value::Array(items) => items.iter().try_for_each(|i| collect(i, refs))?,
        Value::Object(map) => map.values().try_for_each(|i| collect(i, refs))?,
        _ => {}
    }
    Ok(())
}

fn lookup<'v>(r: &Reference, text: &str, outputs: &'v HashMap<String, Value>) -> Result<&'v Value, TemplateError> {
    let mut v = outputs
        .get(&r.step_id)
        .ok_or_else(|| TemplateError::UnknownStep { text: text.to_string(), step_id: r.step_id.clone() })?;
    let mut at = format!("{}.output", r.step_id);
    for seg in &r.path {
        at.push('.');
        at.push_str(seg);
        v = match v {
            Value::Object(m) => m.get(seg),
            Value::Array(a) => seg.parse::<usize>().ok().and_then(|i| a.get(i)),
            _ => None,
        }
        .ok_or_else(|| TemplateError::MissingPath { text: text.to_string(), at: at.clone() })?;
    }
    Ok(v)
}

/// Resolves every reference in `params` against the outputs of finished steps.
pub fn resolve(params: &Value, outputs: &HashMap<String, Value>) -> Result<Value, TemplateError> {
    Ok(match params {
        Value::String(s) => {
            let ps = pieces(s)?;
            match ps.as_slice() {
                [Piece::Ref(r, text)] => lookup(r, text, outputs)?.clone(),
                _ => {
                    let mut out = String::with_capacity(s.len());
                    for p in ps {
                        match p {
                            Piece::Literal(l) => out.push_str(l),
                            Piece::Ref(r, text) => match lookup(&r, text, outputs)? {
                                Value::String(v) => out.push_str(v),
                                other => out.push_str(&other.to_string()),
                            },
                        }
                    }
                    Value::String(out)
                }
            }
        }
        Value::Array(items) => Value::Array(items.iter().map(|i| resolve(i, outputs)).collect::<Result<_, _>>()?),
        Value::Object(map) => Value::Object(
            map.iter().map(|(k, v)| Ok((k.clone(), resolve(v, outputs)?))).collect::<Result<_, TemplateError>>()?,
        ),
        other => other.clone(),
    })
}

/// `params` with every reference to a step in `renamed` pointing at its new id instead (a
/// replanning round's steps renamed to avoid ids the run has used; see `plan::revise`).
pub fn rename(params: &Value, renamed: &HashMap<String, String>) -> Result<Value, TemplateError> {
    Ok(match params {
        Value::String(s) if s.contains("{{") => {
            let mut out = String::with_capacity(s.len());
            for p in pieces(s)? {
                match p {
                    Piece::Literal(l) => out.push_str(l),
                    Piece::Ref(r, text) => match renamed.get(&r.step_id) {
                        Some(to) => {
                            out.push_str("{{");
                            out.push_str(to);
                            out.push_str(".output");
                            for seg in &r.path {
                                out.push('.');
                                out.push_str(seg);
                            }
                            out.push_str("}}");
                        }
                        None => out.push_str(text),
                    },
                }
            }
            Value::String(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(|i| rename(i, renamed)).collect::<Result<_, _>>()?),
        Value::Object(map) => Value::Object(
            map.iter().map(|(k, v)| Ok((k.clone(), rename(v, renamed)?))).collect::<Result<_, TemplateError>>()?,
        ),
        other => other.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn outputs() -> HashMap<String, Value> {
        HashMap::from([
            ("a".to_string(), json!({"text": "hi", "n": 3, "list": [10, {"x": true}]})),
            ("b".to_string(), json!("plain")),
        ])
    }

    #[test]
    fn whole_reference_keeps_the_typed_value() {
        assert_eq!(resolve(&json!("{{a.output.n}}"), &outputs()).unwrap(), json!(3));
        assert_eq!(resolve(&json!("{{ a.output }}"), &outputs()).unwrap(), outputs()["a"]);
        assert_eq!(resolve(&json!("{{a.output.list.1.x}}"), &outputs()).unwrap(), json!(true));
    }

    #[test]
    fn interpolation_renders_strings_raw_and_values_as_json() {
        let v = resolve(&json!("say {{b.output}} {{a.output.text}} {{a.output.list}}!"), &outputs()).unwrap();
        assert_eq!(v, json!("say plain hi [10,{\"x\":true}]!"));
    }

    #[test]
    fn nested_structures_resolve_recursively() {
        let v = resolve(&json!({"k": ["{{a.output.n}}", {"deep": "{{b.output}}"}], "n": 1}), &outputs()).unwrap();
        assert_eq!(v, json!({"k": [3, {"deep": "plain"}], "n": 1}));
    }

    #[test]
    fn k10_unresolved_references_are_rejected() {
        assert!(matches!(resolve(&json!("{{zz.output}}"), &outputs()), Err(TemplateError::UnknownStep { .. })));
        let e = resolve(&json!("x {{a.output.missing}}"), &outputs()).unwrap_err();
        assert_eq!(
            e,
            TemplateError::MissingPath { text: "{{a.output.missing}}".into(), at: "a.output.missing".into() }
        );
    }

    #[test]
    fn k10_templates_never_execute_code() {
        for t in [
            "{{ 1 + 1 }}",
            "{{a.output | shell}}",
            "{{__import__('os')}}",
            "{{a.outputs}}",
            "{{a}}",
            "{{a.output.}}",
            "open {{a.output",
        ] {
            assert!(matches!(resolve(&json!(t), &outputs()), Err(TemplateError::Malformed { .. })), "{t}");
        }
    }

    #[test]
    fn renaming_rewrites_only_the_renamed_steps_references() {
        let renamed = HashMap::from([("a".to_string(), "a_r1".to_string())]);
        let v = rename(&json!({"x": ["{{a.output.n}} and {{ b.output }}", "{{a.output}}"], "n": 1}), &renamed).unwrap();
        assert_eq!(v, json!({"x": ["{{a_r1.output.n}} and {{ b.output }}", "{{a_r1.output}}"], "n": 1}));
        assert!(rename(&json!("{{a.outputs}}"), &renamed).is_err());
    }

    #[test]
    fn references_are_listed() {
        let refs = references(&json!({"x": "{{a.output.n}} and {{b.output}}"})).unwrap();
        assert_eq!(refs.iter().map(|r| r.step_id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    }
}
