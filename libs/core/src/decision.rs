//! Signed decision records: the policy service signs every `policy_decision` payload it
//! produces, so a decision can travel with the call — the executor appends it in the same
//! ledger transaction as the call's request — without anyone between the policy and the
//! ledger being able to forge or alter it. The ledger verifies the signature with the
//! policy's published keys before it records the event.
//!
//! The payload carries `key_id` (inside what is signed) and `signature` (hex Ed25519 over the
//! RFC 8785 JSON of the payload without `signature`).

use ed25519_dalek::{Signature, SigningKey, VerifyingKey};
use serde_json::Value;

use crate::auth::{AuthError, key_id};
use crate::canonical::canonical_value;

/// Signs a decision payload (an object): sets `key_id`, then adds `signature`.
pub fn sign_decision(mut payload: Value, key: &SigningKey) -> Value {
    let Some(obj) = payload.as_object_mut() else { return payload };
    obj.remove("signature");
    obj.insert("key_id".into(), Value::String(key_id(&key.verifying_key())));
    let signature = crate::signature::sign(key, canonical_value(&payload).as_bytes());
    if let Some(obj) = payload.as_object_mut() {
        obj.insert("signature".into(), Value::String(hex::encode(signature.to_bytes())));
    }
    payload
}

/// Verifies a decision payload's signature with the key its `key_id` names.
pub fn verify_decision(payload: &Value, keys: impl Fn(&str) -> Option<VerifyingKey>) -> Result<(), AuthError> {
    let s = decision_signature(payload, keys)?;
    if crate::signature::verify(&s.key, &s.message, &s.signature) { Ok(()) } else { Err(AuthError::BadSignature) }
}

/// The signature [`verify_decision`] checks, for the caller to check (alone, or with others:
/// `signature::verify_all`): by the key `key_id` names, over the payload without `signature`.
pub fn decision_signature(
    payload: &Value,
    keys: impl Fn(&str) -> Option<VerifyingKey>,
) -> Result<crate::signature::Signed, AuthError> {
    let obj = payload.as_object().ok_or_else(|| AuthError::Malformed("a decision is a JSON object".into()))?;
    let text = |k: &str| obj.get(k).and_then(Value::as_str);
    let (Some(kid), Some(sig_hex)) = (text("key_id"), text("signature")) else {
        return Err(AuthError::Missing);
    };
    let key = keys(kid).ok_or_else(|| AuthError::UnknownKey(kid.to_string()))?;
    let bytes = hex::decode(sig_hex).map_err(|_| AuthError::BadSignature)?;
    let signature = Signature::from_slice(&bytes).map_err(|_| AuthError::BadSignature)?;
    let mut signed = obj.clone();
    signed.remove("signature");
    Ok(crate::signature::Signed { key, message: canonical_value(&Value::Object(signed)).into_bytes(), signature })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_signed_decision_verifies_and_any_change_is_detected() {
        let key = crate::auth::TestKey::new(5);
        let (sk, lookup) = (&key.sk, key.lookup());
        let d = sign_decision(json!({"decision_id": "d", "outcome": "deny", "rule_id": "r", "reason": "no"}), sk);
        verify_decision(&d, lookup).expect("verifies");
        let mut flipped = d.clone();
        flipped["outcome"] = json!("allow");
        assert_eq!(verify_decision(&flipped, lookup), Err(AuthError::BadSignature));
        let mut unsigned = d.clone();
        unsigned.as_object_mut().unwrap().remove("signature");
        assert_eq!(verify_decision(&unsigned, lookup), Err(AuthError::Missing));
        let forged =
            sign_decision(json!({"decision_id": "d", "outcome": "allow"}), &SigningKey::from_bytes(&[6u8; 32]));
        assert!(matches!(verify_decision(&forged, lookup), Err(AuthError::UnknownKey(_))));
        assert!(verify_decision(&json!([1]), lookup).is_err());
    }
}
