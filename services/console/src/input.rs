//! Every input the API takes — query strings, path ids and JSON bodies — is checked here, and a
//! refusal names the field. The mesh checks again; the console refuses early so a person sees
//! which box is wrong, and so nothing malformed is forwarded.

use std::collections::BTreeMap;

use serde_json::{Map, Value};
use warden_core::ids::check_id;

use crate::error::ApiError;

/// Longest reason a person may give (approvals, revocations), as the policy service allows.
pub const MAX_REASON_BYTES: usize = 4096;
/// Most patterns in one capability scope list.
pub const MAX_PATTERNS: usize = 64;
/// Longest pattern.
pub const MAX_PATTERN_BYTES: usize = 256;

/// An identifier (tenant, run, approval, capability): Warden's id rules.
pub fn id(field: &str, value: &str) -> Result<(), ApiError> {
    check_id(value).map_err(|e| ApiError::invalid(field, e))
}

/// Free text a person typed: bounded, and no control characters but newline and tab.
pub fn text(field: &str, value: &str, max: usize) -> Result<(), ApiError> {
    if value.len() > max {
        return Err(ApiError::invalid(field, format!("must be at most {max} bytes")));
    }
    if value.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Err(ApiError::invalid(field, "must not contain control characters"));
    }
    Ok(())
}

/// A query string's parameters: each known at most once, unknown ones refused.
#[derive(Debug, Default)]
pub struct Query(BTreeMap<String, String>);

impl Query {
    pub fn parse(raw: Option<&str>, known: &[&str]) -> Result<Query, ApiError> {
        let mut params = BTreeMap::new();
        for (k, v) in form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
            if !known.contains(&k.as_ref()) {
                return Err(ApiError::invalid(k.as_ref(), format!("unknown parameter (known: {})", known.join(", "))));
            }
            if params.insert(k.to_string(), v.to_string()).is_some() {
                return Err(ApiError::invalid(k.as_ref(), "given more than once"));
            }
        }
        Ok(Query(params))
    }

    /// The value, or empty when absent.
    pub fn get(&self, key: &str) -> &str {
        self.0.get(key).map(String::as_str).unwrap_or_default()
    }

    /// A required tenant.
    pub fn tenant(&self) -> Result<String, ApiError> {
        let t = self.get("tenant");
        id("tenant", t)?;
        Ok(t.to_string())
    }

    /// An optional id (empty when absent).
    pub fn optional_id(&self, key: &str) -> Result<String, ApiError> {
        let v = self.get(key);
        if !v.is_empty() {
            id(key, v)?;
        }
        Ok(v.to_string())
    }

    /// A page size in `1..=max`, `default` when absent.
    pub fn page_size(&self, default: u32, max: u32) -> Result<u32, ApiError> {
        self.number("page_size", default as u64, 1, max as u64).map(|n| n as u32)
    }

    /// A whole number in `min..=max`, `default` when absent.
    pub fn number(&self, key: &str, default: u64, min: u64, max: u64) -> Result<u64, ApiError> {
        match self.get(key) {
            "" => Ok(default),
            v => match v.parse::<u64>() {
                Ok(n) if (min..=max).contains(&n) => Ok(n),
                _ => Err(ApiError::invalid(key, format!("must be a whole number from {min} to {max}"))),
            },
        }
    }

    /// A page token: opaque to the console, but bounded and printable.
    pub fn page_token(&self) -> Result<String, ApiError> {
        let v = self.get("page_token");
        if v.len() > 512 || v.chars().any(|c| c.is_control()) {
            return Err(ApiError::invalid("page_token", "not a page token this API gave"));
        }
        Ok(v.to_string())
    }
}

/// A JSON object body: fields read by name, unknown fields refused.
#[derive(Debug)]
pub struct Body(Map<String, Value>);

impl Body {
    pub fn parse(bytes: &[u8], known: &[&str]) -> Result<Body, ApiError> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| ApiError::invalid("body", format!("not JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(ApiError::invalid("body", "must be a JSON object"));
        };
        if let Some(k) = map.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(ApiError::invalid(k.clone(), format!("unknown field (known: {})", known.join(", "))));
        }
        Ok(Body(map))
    }

    /// A string field (empty when absent or null).
    pub fn string(&self, key: &str) -> Result<String, ApiError> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(ApiError::invalid(key, "must be a string")),
        }
    }

    /// A required tenant.
    pub fn tenant(&self) -> Result<String, ApiError> {
        let t = self.string("tenant")?;
        id("tenant", &t)?;
        Ok(t)
    }

    /// Free text (a reason), bounded.
    pub fn text(&self, key: &str, max: usize) -> Result<String, ApiError> {
        let s = self.string(key)?;
        text(key, &s, max)?;
        Ok(s)
    }

    /// A list of patterns (tool, action or resource): strings, bounded in count and length.
    pub fn patterns(&self, key: &str) -> Result<Vec<String>, ApiError> {
        let items = match self.0.get(key) {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Array(items)) => items,
            Some(_) => return Err(ApiError::invalid(key, "must be a list of strings")),
        };
        if items.len() > MAX_PATTERNS {
            return Err(ApiError::invalid(key, format!("at most {MAX_PATTERNS} patterns")));
        }
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let field = format!("{key}[{i}]");
                let s = v.as_str().ok_or_else(|| ApiError::invalid(&field, "must be a string"))?;
                if s.trim().is_empty() {
                    return Err(ApiError::invalid(&field, "must not be empty"));
                }
                text(&field, s, MAX_PATTERN_BYTES)?;
                Ok(s.trim().to_string())
            })
            .collect()
    }

    /// A whole number in `min..=max` (`default` when absent).
    pub fn number(&self, key: &str, default: u64, min: u64, max: u64) -> Result<u64, ApiError> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => match v.as_u64() {
                Some(n) if (min..=max).contains(&n) => Ok(n),
                _ => Err(ApiError::invalid(key, format!("must be a whole number from {min} to {max}"))),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_refuse_unknown_repeated_and_out_of_range_parameters() {
        let q = Query::parse(Some("tenant=acme&page_size=5"), &["tenant", "page_size"]).expect("valid");
        assert_eq!((q.tenant().expect("tenant"), q.page_size(25, 100).expect("size")), ("acme".into(), 5));
        let e = Query::parse(Some("nope=1"), &["tenant"]).expect_err("unknown");
        assert_eq!(e.field.as_deref(), Some("nope"));
        let e = Query::parse(Some("tenant=a&tenant=b"), &["tenant"]).expect_err("twice");
        assert_eq!(e.field.as_deref(), Some("tenant"));
        let q = Query::parse(Some("page_size=0"), &["page_size"]).expect("parsed");
        assert_eq!(q.page_size(25, 100).expect_err("zero").field.as_deref(), Some("page_size"));
        let q = Query::parse(Some("page_size=-1"), &["page_size"]).expect("parsed");
        assert!(q.page_size(25, 100).is_err());
        let q = Query::parse(Some("tenant=..%2F"), &["tenant"]).expect("parsed");
        assert_eq!(q.tenant().expect_err("bad id").field.as_deref(), Some("tenant"));
    }

    #[test]
    fn bodies_name_the_field_at_fault() {
        let known = ["tenant", "reason", "tool_patterns", "ttl_seconds"];
        assert_eq!(Body::parse(b"[]", &known).expect_err("array").field.as_deref(), Some("body"));
        assert_eq!(Body::parse(b"{", &known).expect_err("broken").field.as_deref(), Some("body"));
        assert_eq!(Body::parse(br#"{"x":1}"#, &known).expect_err("unknown").field.as_deref(), Some("x"));
        let b = Body::parse(br#"{"tenant":"acme","reason":"ok\u0007","tool_patterns":["kv.*", 3]}"#, &known)
            .expect("object");
        assert_eq!(b.tenant().expect("tenant"), "acme");
        assert_eq!(b.text("reason", 10).expect_err("bell").field.as_deref(), Some("reason"));
        assert_eq!(b.patterns("tool_patterns").expect_err("number").field.as_deref(), Some("tool_patterns[1]"));
        let b = Body::parse(br#"{"ttl_seconds": 1e3}"#, &known).expect("object");
        assert!(b.number("ttl_seconds", 0, 1, 10).is_err());
    }
}
