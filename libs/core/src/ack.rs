//! Request acknowledgements: the ledger's Ed25519-signed statement that one exact tool call's
//! `tool_requested` event is durably recorded in a run's chain.
//!
//! An authorization proves that policy allowed a call; it does not prove that anybody recorded
//! the call. A tool host that acted on an authorization alone would let a caller holding one
//! (a tenant asking policy directly, say) produce an effect with no request, outcome or
//! receipt in the ledger. So a host acts only when the call also carries an acknowledgement
//! naming the same run, step, attempt, decision and idempotency key: the ledger signs one only
//! after the `tool_requested` event — which itself must cite the recorded allow for exactly
//! these arguments — is committed. Only the mesh appends `tool_requested`, so only the mesh can
//! obtain one.
//!
//! The ledger signs with the key that signs chain heads; the claims carry `kind` so a head
//! signature can never be read as an acknowledgement or the reverse (their JSON differs and
//! both are parsed strictly).

use ed25519_dalek::{SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::auth::{AuthError, SignedClaims, key_id};
use crate::canonical::canonical_json;

/// The only `kind` there is today.
pub const KIND_TOOL_REQUESTED: &str = "tool_requested";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestAckClaims {
    pub v: u32,
    pub kind: String,
    pub key_id: String,
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub attempt: u32,
    pub decision_id: String,
    pub idempotency_key: String,
    /// Where the request sits in the run's chain, and its hash.
    pub seq: u64,
    pub event_hash: String,
}

/// What the call in hand claims; compared field by field with the acknowledgement.
pub struct AckedCall<'a> {
    pub tenant: &'a str,
    pub run_id: &'a str,
    pub step_id: &'a str,
    pub attempt: u32,
    pub decision_id: &'a str,
    pub idempotency_key: &'a str,
}

/// Signs `claims` (whose `key_id` and `kind` are set here).
pub fn sign_ack(mut claims: RequestAckClaims, key: &SigningKey) -> SignedClaims {
    claims.key_id = key_id(&key.verifying_key());
    claims.kind = KIND_TOOL_REQUESTED.to_string();
    signed(&claims, claims.key_id.clone(), key)
}

/// `claims` as RFC 8785 JSON, signed.
fn signed(claims: &impl Serialize, key_id: String, key: &SigningKey) -> SignedClaims {
    let claims_json = canonical_json(claims).into_bytes();
    let signature = crate::signature::sign(key, &claims_json).to_bytes().to_vec();
    SignedClaims { claims_json, signature, key_id }
}

/// The claims of `signed` once its signature verifies with the key it names, parsed strictly.
fn verified<T: serde::de::DeserializeOwned>(
    signed: &SignedClaims,
    keys: impl Fn(&str) -> Option<VerifyingKey>,
) -> Result<T, AuthError> {
    crate::auth::check_signature(signed, keys)?;
    serde_json::from_slice(&signed.claims_json).map_err(|e| AuthError::Malformed(e.to_string()))
}

/// Verifies the signature and that the acknowledgement is for `call`. Acknowledgements do not
/// expire: what is recorded stays recorded (the authorization they accompany does expire).
pub fn verify_ack(
    signed: &SignedClaims,
    keys: impl Fn(&str) -> Option<VerifyingKey>,
    call: &AckedCall<'_>,
) -> Result<RequestAckClaims, AuthError> {
    crate::auth::check_signature(signed, keys)?;
    check_signed_ack(signed, call)
}

/// What [`verify_ack`] checks once the signature (`auth::signature_of`) verified: the claims,
/// their key id and that they acknowledge `call`.
pub fn check_signed_ack(signed: &SignedClaims, call: &AckedCall<'_>) -> Result<RequestAckClaims, AuthError> {
    let claims: RequestAckClaims =
        serde_json::from_slice(&signed.claims_json).map_err(|e| AuthError::Malformed(e.to_string()))?;
    if claims.key_id != signed.key_id {
        return Err(AuthError::Mismatch { field: "key_id" });
    }
    let checks: [(&'static str, bool); 7] = [
        ("kind", claims.kind == KIND_TOOL_REQUESTED),
        ("tenant", claims.tenant == call.tenant),
        ("run_id", claims.run_id == call.run_id),
        ("step_id", claims.step_id == call.step_id),
        ("attempt", claims.attempt == call.attempt),
        ("decision_id", claims.decision_id == call.decision_id),
        ("idempotency_key", claims.idempotency_key == call.idempotency_key),
    ];
    if let Some((field, _)) = checks.iter().find(|(_, ok)| !ok) {
        return Err(AuthError::Mismatch { field });
    }
    Ok(claims)
}

/// `kind` of a run acknowledgement.
pub const KIND_RUN_CREATED: &str = "run_created";

/// The ledger's statement that a run is recorded with a plan of this digest: what the policy
/// needs of a run to sign only calls of its recorded plan, handed over by the executor so the
/// policy need not read the plan back on the run's first call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunAckClaims {
    pub v: u32,
    pub kind: String,
    pub key_id: String,
    pub tenant: String,
    pub run_id: String,
    /// Hex SHA-256 of the plan's RFC 8785 JSON, as recorded.
    pub plan_sha256: String,
}

/// Signs that run `run_id` of `tenant` is recorded with the plan whose canonical JSON is
/// `plan_json`.
pub fn sign_run_ack(tenant: &str, run_id: &str, plan_json: &str, key: &SigningKey) -> SignedClaims {
    let claims = RunAckClaims {
        v: 1,
        kind: KIND_RUN_CREATED.to_string(),
        key_id: key_id(&key.verifying_key()),
        tenant: tenant.to_string(),
        run_id: run_id.to_string(),
        plan_sha256: crate::canonical::sha256_hex(plan_json.as_bytes()),
    };
    signed(&claims, claims.key_id.clone(), key)
}

/// Verifies a run acknowledgement's signature and that it names `tenant` and `run_id`;
/// returns the plan digest it vouches for.
pub fn verify_run_ack(
    signed: &SignedClaims,
    keys: impl Fn(&str) -> Option<VerifyingKey>,
    tenant: &str,
    run_id: &str,
) -> Result<RunAckClaims, AuthError> {
    let claims: RunAckClaims = verified(signed, keys)?;
    let checks: [(&'static str, bool); 5] = [
        ("v", claims.v == 1),
        ("key_id", claims.key_id == signed.key_id),
        ("kind", claims.kind == KIND_RUN_CREATED),
        ("tenant", claims.tenant == tenant),
        ("run_id", claims.run_id == run_id),
    ];
    if let Some((field, _)) = checks.iter().find(|(_, ok)| !ok) {
        return Err(AuthError::Mismatch { field });
    }
    Ok(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ack_verifies_only_for_its_run_and_key_and_is_no_request_ack() {
        let key = crate::auth::TestKey::new(3);
        let (sk, lookup) = (&key.sk, key.lookup());
        let plan = r#"{"steps":[]}"#;
        let s = sign_run_ack("t", "r", plan, sk);
        let acked = verify_run_ack(&s, lookup, "t", "r").unwrap();
        assert_eq!(acked.plan_sha256, crate::canonical::sha256_hex(plan.as_bytes()));
        assert_eq!(verify_run_ack(&s, lookup, "t", "other").unwrap_err(), AuthError::Mismatch { field: "run_id" });
        assert_eq!(verify_run_ack(&s, lookup, "u", "r").unwrap_err(), AuthError::Mismatch { field: "tenant" });
        let forged = sign_run_ack("t", "r", plan, &SigningKey::from_bytes(&[4u8; 32]));
        assert!(matches!(verify_run_ack(&forged, lookup, "t", "r").unwrap_err(), AuthError::UnknownKey(_)));
        let mut altered = s.clone();
        altered.claims_json = String::from_utf8(altered.claims_json).unwrap().replace("\"r\"", "\"x\"").into_bytes();
        assert_eq!(verify_run_ack(&altered, lookup, "t", "x").unwrap_err(), AuthError::BadSignature);
        // Neither kind of acknowledgement passes for the other.
        assert!(matches!(verify_ack(&s, lookup, &call()).unwrap_err(), AuthError::Malformed(_)));
        let request = sign_ack(claims(), sk);
        assert!(matches!(verify_run_ack(&request, lookup, "t", "r").unwrap_err(), AuthError::Malformed(_)));
    }

    fn claims() -> RequestAckClaims {
        RequestAckClaims {
            v: 1,
            kind: String::new(),
            key_id: String::new(),
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: "s".into(),
            attempt: 1,
            decision_id: "d".into(),
            idempotency_key: "k".into(),
            seq: 4,
            event_hash: "ab".into(),
        }
    }

    fn call() -> AckedCall<'static> {
        AckedCall { tenant: "t", run_id: "r", step_id: "s", attempt: 1, decision_id: "d", idempotency_key: "k" }
    }

    #[test]
    fn request_ack_verifies_only_for_its_exact_call_and_key() {
        let key = crate::auth::TestKey::new(3);
        let (sk, lookup) = (&key.sk, key.lookup());
        let s = sign_ack(claims(), sk);
        assert_eq!(verify_ack(&s, lookup, &call()).unwrap().seq, 4);
        let other = AckedCall { decision_id: "e", ..call() };
        assert_eq!(verify_ack(&s, lookup, &other).unwrap_err(), AuthError::Mismatch { field: "decision_id" });
        let other = AckedCall { attempt: 2, ..call() };
        assert_eq!(verify_ack(&s, lookup, &other).unwrap_err(), AuthError::Mismatch { field: "attempt" });
        let forged = sign_ack(claims(), &SigningKey::from_bytes(&[4u8; 32]));
        assert!(matches!(verify_ack(&forged, lookup, &call()).unwrap_err(), AuthError::UnknownKey(_)));
        let empty = SignedClaims { claims_json: vec![], signature: vec![], key_id: String::new() };
        assert_eq!(verify_ack(&empty, lookup, &call()).unwrap_err(), AuthError::Missing);
        // A chain-head signature by the same key is not an acknowledgement.
        let head = crate::head::Head { run_id: "r".into(), seq: 4, hash: "ab".into() };
        let (sig, key_id) = head.sign(sk);
        let as_ack = SignedClaims { claims_json: canonical_json(&head).into_bytes(), signature: sig, key_id };
        assert!(matches!(verify_ack(&as_ack, lookup, &call()).unwrap_err(), AuthError::Malformed(_)));
    }
}
