//! Signed chain heads: the ledger signs `{run_id, seq, hash}` of a run's latest event, so an
//! exported run can be checked offline against the ledger's public key.

use ed25519_dalek::{Signature, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::canonical::canonical_json;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    pub run_id: String,
    pub seq: u64,
    pub hash: String,
}

impl Head {
    fn message(&self) -> Vec<u8> {
        canonical_json(self).into_bytes()
    }

    /// Signs the head; returns the signature and the signing key's id.
    pub fn sign(&self, key: &SigningKey) -> (Vec<u8>, String) {
        (crate::signature::sign(key, &self.message()).to_bytes().to_vec(), crate::auth::key_id(&key.verifying_key()))
    }

    pub fn verify(&self, signature: &[u8], key: &VerifyingKey) -> bool {
        Signature::from_slice(signature).is_ok_and(|s| crate::signature::verify(key, &self.message(), &s))
    }
}
