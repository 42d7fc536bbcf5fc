//! Ed25519 signing and verification for every signed thing in Warden (authorizations, decision
//! records, request and run acknowledgements, chain heads), with an optional memo of the
//! signatures this process made itself.
//!
//! In `warden dev` one process signs and verifies: the policy signs a decision record and an
//! authorization, the ledger verifies the record, the tool host verifies the authorization and
//! the ledger's acknowledgement. Verifying a signature that this very process made, with this
//! very key, over these very bytes can only succeed, so the memo answers such a verification
//! from a table of digests — SHA-256 of key, signature and message — instead of curve
//! arithmetic. The answer is the one [`VerifyingKey::verify`] would give: only [`sign`] adds
//! entries, each after signing, so a forged, altered or foreign signature never meets one and
//! is verified in full. The memo is off unless [`remember_own_signatures`] is called: in a
//! process whose signers and verifiers are apart (every production service) it would never
//! answer, and would cost a digest of every message signed.
//!
//! The memo holds the last [`MEMO_CAPACITY`] signatures; an older one is verified in full.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use sha2::{Digest, Sha256};

/// How many of this process's latest signatures the memo holds (32 bytes each, twice).
pub const MEMO_CAPACITY: usize = 8192;

static ON: AtomicBool = AtomicBool::new(false);
static MEMO: Mutex<Memo> = Mutex::new(Memo { known: None, order: VecDeque::new() });

struct Memo {
    known: Option<HashSet<[u8; 32]>>,
    order: VecDeque<[u8; 32]>,
}

/// Turns the memo on for the rest of the process's life: from now on, a signature this process
/// makes is recognised, without curve arithmetic, when this process verifies it.
pub fn remember_own_signatures() {
    ON.store(true, Ordering::Release);
}

fn digest(key: &VerifyingKey, message: &[u8], signature: &Signature) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(key.as_bytes());
    h.update(signature.to_bytes());
    h.update(message);
    h.finalize().into()
}

/// Signs `message` with `key`.
pub fn sign(key: &SigningKey, message: &[u8]) -> Signature {
    let signature = key.sign(message);
    if ON.load(Ordering::Acquire) {
        let d = digest(&key.verifying_key(), message, &signature);
        let mut memo = MEMO.lock().unwrap_or_else(|p| p.into_inner());
        let memo = &mut *memo;
        if memo.known.get_or_insert_with(HashSet::new).insert(d) {
            memo.order.push_back(d);
            if memo.order.len() > MEMO_CAPACITY
                && let Some(old) = memo.order.pop_front()
                && let Some(known) = memo.known.as_mut()
            {
                known.remove(&old);
            }
        }
    }
    signature
}

/// Whether `signature` is `key`'s over `message` ([`VerifyingKey::verify`]'s answer).
pub fn verify(key: &VerifyingKey, message: &[u8], signature: &Signature) -> bool {
    if ON.load(Ordering::Acquire) {
        let d = digest(key, message, signature);
        let memo = MEMO.lock().unwrap_or_else(|p| p.into_inner());
        if memo.known.as_ref().is_some_and(|k| k.contains(&d)) {
            return true;
        }
    }
    key.verify(message, signature).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memo_answers_only_what_this_process_signed_and_otherwise_verifies_in_full() {
        remember_own_signatures();
        let key = SigningKey::from_bytes(&[9; 32]);
        let vk = key.verifying_key();
        let sig = sign(&key, b"the message");
        assert!(verify(&vk, b"the message", &sig));
        // Altered message, another key, a signature made elsewhere: curve arithmetic decides.
        assert!(!verify(&vk, b"the messagE", &sig));
        let other = SigningKey::from_bytes(&[10; 32]);
        assert!(!verify(&other.verifying_key(), b"the message", &sig));
        let elsewhere = key.sign(b"made without the memo");
        assert!(verify(&vk, b"made without the memo", &elsewhere));
        let mut bytes = elsewhere.to_bytes();
        bytes[3] ^= 1;
        assert!(!verify(&vk, b"made without the memo", &Signature::from_bytes(&bytes)));
        // The memo holds only the latest signatures; an evicted one still verifies, in full.
        for i in 0..(MEMO_CAPACITY + 1) as u32 {
            sign(&key, &i.to_le_bytes());
        }
        assert!(verify(&vk, b"the message", &sig));
        assert!(MEMO.lock().unwrap().order.len() <= MEMO_CAPACITY);
    }
}
