//! Authorizations: the policy service's Ed25519-signed statement that one exact tool call is
//! allowed. The claims bind tenant, run, step, attempt, tool, the SHA-256 of the canonical
//! arguments, the idempotency key and an expiry; the signature covers their RFC 8785 bytes.
//! Tool hosts verify before acting, so a buggy executor cannot run what policy did not allow.

use ed25519_dalek::{Signature, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::canonical::canonical_json;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthorizationClaims {
    pub v: u32,
    pub key_id: String,
    pub decision_id: String,
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub attempt: u32,
    pub tool: String,
    pub args_sha256: String,
    pub idempotency_key: String,
    pub capability_id: String,
    pub issued_at_ms: i64,
    pub expires_at_ms: i64,
    /// The tool's declaration the run pinned (its version, the SHA-256 of the whole
    /// declaration, its effect class), when the caller named one: a host whose own declaration
    /// differs refuses the call ([`check_declaration`]). Absent from claims that name none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tool_version: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tool_sha256: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub effect: String,
}

/// A host's check that the authorization was decided for the tool it declares now.
///
/// - claims that name a declaration (`tool_sha256`) must name this host's (`declared_sha256`),
///   so a call decided under another class, version or schema is refused;
/// - claims that name an effect class must name the declared one (`declared_effect`, as
///   `warden_grpc::catalog::effect_name` spells it): the policy decided under the class it was
///   told, and a caller that told it a milder class than the tool's gets no call;
/// - a `consequential` tool refuses claims that name no declaration: the policy asks such a
///   tool for a commitment only when it knows the class, so an authorization decided without
///   it could have skipped the commitment.
pub fn check_declaration(
    claims: &AuthorizationClaims,
    declared_sha256: &str,
    declared_effect: &str,
) -> Result<(), AuthError> {
    if !claims.tool_sha256.is_empty() && claims.tool_sha256 != declared_sha256 {
        return Err(AuthError::Mismatch { field: "tool_sha256" });
    }
    if !claims.effect.is_empty() && claims.effect != declared_effect {
        return Err(AuthError::Mismatch { field: "effect" });
    }
    if declared_effect == CONSEQUENTIAL && (claims.tool_sha256.is_empty() || claims.effect.is_empty()) {
        return Err(AuthError::Undeclared);
    }
    Ok(())
}

/// The effect class that needs a commitment (SPEC-KERN-01 §4).
pub const CONSEQUENTIAL: &str = "consequential";

/// Claims bytes plus signature, as carried on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedClaims {
    pub claims_json: Vec<u8>,
    pub signature: Vec<u8>,
    pub key_id: String,
}

/// The identifier of a verification key: the first 16 hex chars of SHA-256(public key).
pub fn key_id(key: &VerifyingKey) -> String {
    crate::sha256_hex(key.as_bytes())[..16].to_string()
}

/// Signs `claims` (whose `key_id` is set to the signer's).
pub fn sign(mut claims: AuthorizationClaims, key: &SigningKey) -> SignedClaims {
    claims.key_id = key_id(&key.verifying_key());
    let claims_json = canonical_json(&claims).into_bytes();
    let signature = crate::signature::sign(key, &claims_json).to_bytes().to_vec();
    SignedClaims { claims_json, signature, key_id: claims.key_id }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("authorization is missing")]
    Missing,
    #[error("authorization is signed by unknown key '{0}'")]
    UnknownKey(String),
    #[error("authorization signature does not verify")]
    BadSignature,
    #[error("authorization claims are malformed: {0}")]
    Malformed(String),
    #[error("authorization expired at {expired_at_ms} (now {now_ms})")]
    Expired { expired_at_ms: i64, now_ms: i64 },
    #[error("authorization is for another call: {field} does not match")]
    Mismatch { field: &'static str },
    #[error("authorization names no tool declaration, and the tool is consequential")]
    Undeclared,
}

/// What the call in hand claims to be; compared field by field with the signed claims.
pub struct CallIdentity<'a> {
    pub tenant: &'a str,
    pub run_id: &'a str,
    pub step_id: &'a str,
    pub attempt: u32,
    pub tool: &'a str,
    pub args_sha256: &'a str,
    pub idempotency_key: &'a str,
}

/// The deterministic id of the decision about `call`: a retried authorization of the same
/// call gets the same id, so the ledger records the decision once.
pub fn decision_id(call: &CallIdentity<'_>, capability_id: &str) -> String {
    let material = canonical_json(&serde_json::json!([
        call.tenant,
        call.run_id,
        call.step_id,
        call.attempt,
        call.tool,
        call.args_sha256,
        call.idempotency_key,
        capability_id
    ]));
    crate::sha256_hex(material)[..32].to_string()
}

/// Verifies signature, expiry and binding. `keys` looks up a verifying key by id.
pub fn verify(
    signed: &SignedClaims,
    keys: impl Fn(&str) -> Option<VerifyingKey>,
    call: &CallIdentity<'_>,
    now_ms: i64,
) -> Result<AuthorizationClaims, AuthError> {
    check_signature(signed, keys)?;
    check_signed(signed, call, now_ms)
}

/// The signature of [`signature_of`], checked alone.
pub(crate) fn check_signature(
    signed: &SignedClaims,
    keys: impl Fn(&str) -> Option<VerifyingKey>,
) -> Result<(), AuthError> {
    let s = signature_of(signed, keys)?;
    if !crate::signature::verify(&s.key, &s.message, &s.signature) {
        return Err(AuthError::BadSignature);
    }
    Ok(())
}

/// What [`verify`] checks first: the signature `signed` carries, by the key it names, over its
/// claims, for the caller to check (alone, or with others: `signature::verify_all`).
pub fn signature_of(
    signed: &SignedClaims,
    keys: impl Fn(&str) -> Option<VerifyingKey>,
) -> Result<crate::signature::Signed, AuthError> {
    if signed.claims_json.is_empty() && signed.signature.is_empty() {
        return Err(AuthError::Missing);
    }
    let key = keys(&signed.key_id).ok_or_else(|| AuthError::UnknownKey(signed.key_id.clone()))?;
    let signature = Signature::from_slice(&signed.signature).map_err(|_| AuthError::BadSignature)?;
    Ok(crate::signature::Signed { key, message: signed.claims_json.clone(), signature })
}

/// What [`verify`] checks once the signature of [`signature_of`] verified: the claims, their
/// key id, expiry and binding to `call`.
pub fn check_signed(
    signed: &SignedClaims,
    call: &CallIdentity<'_>,
    now_ms: i64,
) -> Result<AuthorizationClaims, AuthError> {
    let claims: AuthorizationClaims =
        serde_json::from_slice(&signed.claims_json).map_err(|e| AuthError::Malformed(e.to_string()))?;
    if claims.key_id != signed.key_id {
        return Err(AuthError::Mismatch { field: "key_id" });
    }
    if now_ms >= claims.expires_at_ms {
        return Err(AuthError::Expired { expired_at_ms: claims.expires_at_ms, now_ms });
    }
    let checks: [(&'static str, bool); 7] = [
        ("tenant", claims.tenant == call.tenant),
        ("run_id", claims.run_id == call.run_id),
        ("step_id", claims.step_id == call.step_id),
        ("attempt", claims.attempt == call.attempt),
        ("tool", claims.tool == call.tool),
        ("args_sha256", claims.args_sha256 == call.args_sha256),
        ("idempotency_key", claims.idempotency_key == call.idempotency_key),
    ];
    if let Some((field, _)) = checks.iter().find(|(_, ok)| !ok) {
        return Err(AuthError::Mismatch { field });
    }
    Ok(claims)
}

/// A signing key and the lookup a verifier holding only its public half would use (tests).
#[cfg(test)]
pub(crate) struct TestKey {
    pub(crate) sk: SigningKey,
    vk: VerifyingKey,
    kid: String,
}

#[cfg(test)]
impl TestKey {
    pub(crate) fn new(seed: u8) -> TestKey {
        let sk = SigningKey::from_bytes(&[seed; 32]);
        let vk = sk.verifying_key();
        TestKey { kid: key_id(&vk), sk, vk }
    }

    /// Finds this key by its id, and no other.
    pub(crate) fn lookup(&self) -> impl Fn(&str) -> Option<VerifyingKey> + Copy + '_ {
        move |id: &str| (id == self.kid).then_some(self.vk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> AuthorizationClaims {
        AuthorizationClaims {
            v: 1,
            key_id: String::new(),
            decision_id: "d1".into(),
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: "s".into(),
            attempt: 1,
            tool: "echo".into(),
            args_sha256: "ab".into(),
            idempotency_key: "k".into(),
            capability_id: String::new(),
            issued_at_ms: 1_000,
            expires_at_ms: 2_000,
            ..AuthorizationClaims::default()
        }
    }

    fn call() -> CallIdentity<'static> {
        CallIdentity {
            tenant: "t",
            run_id: "r",
            step_id: "s",
            attempt: 1,
            tool: "echo",
            args_sha256: "ab",
            idempotency_key: "k",
        }
    }

    #[test]
    fn k01_signed_authorization_verifies_only_for_its_exact_call() {
        let key = crate::auth::TestKey::new(7);
        let (sk, lookup) = (&key.sk, key.lookup());
        let s = sign(claims(), sk);
        assert!(verify(&s, lookup, &call(), 1_500).is_ok());
        assert_eq!(
            verify(&s, lookup, &call(), 2_000).unwrap_err(),
            AuthError::Expired { expired_at_ms: 2_000, now_ms: 2_000 }
        );
        let other = CallIdentity { args_sha256: "cd", ..call() };
        assert_eq!(verify(&s, lookup, &other, 1_500).unwrap_err(), AuthError::Mismatch { field: "args_sha256" });
        let retry = CallIdentity { attempt: 2, ..call() };
        assert_eq!(verify(&s, lookup, &retry, 1_500).unwrap_err(), AuthError::Mismatch { field: "attempt" });
        let mut tampered = s.clone();
        tampered.claims_json = String::from_utf8(s.claims_json.clone()).unwrap().replace("echo", "ecxo").into_bytes();
        assert_eq!(verify(&tampered, lookup, &call(), 1_500).unwrap_err(), AuthError::BadSignature);
        let forged = sign(claims(), &SigningKey::from_bytes(&[9u8; 32]));
        assert!(matches!(verify(&forged, lookup, &call(), 1_500).unwrap_err(), AuthError::UnknownKey(_)));
        let empty = SignedClaims { claims_json: vec![], signature: vec![], key_id: String::new() };
        assert_eq!(verify(&empty, lookup, &call(), 1_500).unwrap_err(), AuthError::Missing);
    }

    #[test]
    fn a_host_refuses_a_milder_class_than_it_declares() {
        let named = |sha: &str, effect: &str| AuthorizationClaims {
            tool_sha256: sha.into(),
            effect: effect.into(),
            ..claims()
        };
        // As declared, or naming no declaration for a tool that needs no commitment.
        assert_eq!(check_declaration(&named("d1", "mutating"), "d1", "mutating"), Ok(()));
        assert_eq!(check_declaration(&named("", ""), "d1", "mutating"), Ok(()));
        assert_eq!(check_declaration(&named("d1", "consequential"), "d1", "consequential"), Ok(()));
        // Another declaration, another class, or a consequential tool's call decided blind.
        assert_eq!(
            check_declaration(&named("d0", "mutating"), "d1", "mutating"),
            Err(AuthError::Mismatch { field: "tool_sha256" })
        );
        assert_eq!(
            check_declaration(&named("d1", "mutating"), "d1", "consequential"),
            Err(AuthError::Mismatch { field: "effect" })
        );
        assert_eq!(check_declaration(&named("", ""), "d1", "consequential"), Err(AuthError::Undeclared));
        assert_eq!(check_declaration(&named("d1", ""), "d1", "consequential"), Err(AuthError::Undeclared));
        assert_eq!(check_declaration(&named("", "consequential"), "d1", "consequential"), Err(AuthError::Undeclared));
    }
}
