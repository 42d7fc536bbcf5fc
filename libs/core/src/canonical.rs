//! RFC 8785 (JCS) canonical JSON and SHA-256 digests of it.

use serde::Serialize;
use sha2::{Digest, Sha256};

/// RFC 8785 canonical JSON of any serializable value (sorted keys, ECMAScript number form).
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> String {
    // serde_jcs only fails when the value cannot be represented as JSON (e.g. a non-string
    // map key), which none of Warden's types or `serde_json::Value` can produce.
    serde_jcs::to_string(value).unwrap_or_else(|e| panic!("value is not representable as JSON: {e}"))
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: impl AsRef<[u8]>) -> String {
    hex::encode(Sha256::digest(bytes.as_ref()))
}

/// Hex SHA-256 of the canonical JSON of `value`: the digest policy binds authorizations to.
pub fn args_digest(value: &serde_json::Value) -> String {
    sha256_hex(canonical_json(value))
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

    #[test]
    fn digest_is_independent_of_key_order() {
        let a: serde_json::Value = serde_json::from_str(r#"{"x":1,"y":[true,null]}"#).unwrap();
        let b: serde_json::Value = serde_json::from_str(r#"{ "y":[true, null], "x":1.0 }"#).unwrap();
        assert_eq!(args_digest(&a), args_digest(&b));
        assert_eq!(args_digest(&a).len(), 64);
    }
}
