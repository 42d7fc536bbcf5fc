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
//!
//! [`verify_all`] checks many signatures at once (batch verification): a service that checks
//! the signatures of many concurrent requests together pays about a third of what checking
//! each alone costs. See its documentation for what it accepts.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use curve25519_dalek::constants::ED25519_BASEPOINT_POINT;
use curve25519_dalek::edwards::{CompressedEdwardsY, EdwardsPoint};
use curve25519_dalek::scalar::Scalar;
use curve25519_dalek::traits::{IsIdentity, VartimeMultiscalarMul};
use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use sha2::{Digest, Sha256, Sha512};

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
    remembered(key, message, signature) || key.verify(message, signature).is_ok()
}

/// Whether the memo holds this very signature as one this process made.
fn remembered(key: &VerifyingKey, message: &[u8], signature: &Signature) -> bool {
    if !ON.load(Ordering::Acquire) {
        return false;
    }
    let d = digest(key, message, signature);
    let memo = MEMO.lock().unwrap_or_else(|p| p.into_inner());
    memo.known.as_ref().is_some_and(|k| k.contains(&d))
}

/// A signature to check: whose, over what.
#[derive(Debug, Clone)]
pub struct Signed {
    pub key: VerifyingKey,
    pub message: Vec<u8>,
    pub signature: Signature,
}

/// Whether each signature is its key's over its message, in order: [`verify`]'s answer for
/// each, checked together.
///
/// Two or more signatures are first checked as a batch, with one multiscalar multiplication
/// instead of one per signature: for random 128-bit `z_i` the batch holds when
/// `-(Σ z_i·s_i)·B + Σ z_i·R_i + Σ_A (Σ_{i: A_i = A} z_i·h_i)·A` is the identity, where
/// `h_i = SHA-512(R_i ‖ A_i ‖ M_i)`. That is the equation of ed25519-dalek's own
/// `verify_batch`, with the terms of signatures by one key gathered into one (here most
/// signatures of a batch are by one or two keys: the policy's and the ledger's), which makes a
/// batch about twice as cheap as that function's. The `z_i` are derived from every signature
/// and its `h_i` (as `verify_batch` derives them, without a random generator): nobody can
/// choose signatures after seeing them. A batch that fails is checked again one signature at a
/// time, so each answer is [`verify`]'s for a signature that fails.
///
/// What a batch accepts: whatever [`verify`] accepts, and, beyond it, only signatures that
/// differ from a valid one by a point of small order, which only the holder of the signing
/// key can make (so a forged or altered signature is refused as by [`verify`]). Like
/// [`verify`], a batch refuses a non-canonical `s` and a non-canonical encoding of `R`.
pub fn verify_all(items: &[Signed]) -> Vec<bool> {
    let mut answers: Vec<Option<bool>> =
        items.iter().map(|i| remembered(&i.key, &i.message, &i.signature).then_some(true)).collect();
    let pending: Vec<usize> = (0..items.len()).filter(|&i| answers[i].is_none()).collect();
    if pending.len() >= 2 && batch_holds(pending.iter().map(|&i| &items[i])) {
        for &i in &pending {
            answers[i] = Some(true);
        }
    }
    answers
        .into_iter()
        .zip(items)
        .map(|(a, i)| a.unwrap_or_else(|| i.key.verify(&i.message, &i.signature).is_ok()))
        .collect()
}

/// The batch equation of [`verify_all`] over `items` (false for any malformed signature).
fn batch_holds<'a>(items: impl Iterator<Item = &'a Signed>) -> bool {
    let mut transcript = Sha512::new();
    transcript.update(b"warden ed25519 batch verification");
    let mut terms = Vec::new();
    for item in items {
        let (r_bytes, s_bytes) = (item.signature.r_bytes(), item.signature.s_bytes());
        let Some(s) = Option::<Scalar>::from(Scalar::from_canonical_bytes(*s_bytes)) else { return false };
        if !canonical_point_encoding(r_bytes) {
            return false;
        }
        let Some(r) = CompressedEdwardsY(*r_bytes).decompress() else { return false };
        let mut h = Sha512::new();
        h.update(r_bytes);
        h.update(item.key.as_bytes());
        h.update(&item.message);
        let hram: [u8; 64] = h.finalize().into();
        transcript.update(hram);
        transcript.update(s_bytes);
        terms.push((item, r, s, Scalar::from_bytes_mod_order_wide(&hram)));
    }
    let seed: [u8; 64] = transcript.finalize().into();
    let mut b_coefficient = Scalar::ZERO;
    let mut scalars = Vec::with_capacity(terms.len() + 3);
    let mut points = Vec::with_capacity(terms.len() + 3);
    // Each key once, with the sum of its signatures' coefficients.
    let mut keys: Vec<(&[u8; 32], EdwardsPoint, Scalar)> = Vec::new();
    for (n, (item, r, s, hram)) in terms.into_iter().enumerate() {
        let mut h = Sha512::new();
        h.update(seed);
        h.update((n as u64).to_le_bytes());
        let wide: [u8; 64] = h.finalize().into();
        let mut z = [0u8; 32];
        z[..16].copy_from_slice(&wide[..16]);
        let z = Scalar::from_bytes_mod_order(z);
        b_coefficient += z * s;
        scalars.push(z);
        points.push(r);
        let zh = z * hram;
        match keys.iter_mut().find(|(k, _, _)| *k == item.key.as_bytes()) {
            Some((_, _, c)) => *c += zh,
            None => keys.push((item.key.as_bytes(), item.key.to_edwards(), zh)),
        }
    }
    scalars.push(-b_coefficient);
    points.push(ED25519_BASEPOINT_POINT);
    for (_, point, c) in keys {
        scalars.push(c);
        points.push(point);
    }
    EdwardsPoint::vartime_multiscalar_mul(scalars, points).is_identity()
}

/// Whether 32 bytes are the one encoding of a point that [`CompressedEdwardsY::compress`]
/// would give, as far as `decompress` does not check it: `y` below the field's prime
/// `p = 2^255 - 19`, and no sign on `x = 0` (the points with `y = 1` and `y = p - 1`).
/// A single verification refuses any other encoding of `R` (it compares encodings).
fn canonical_point_encoding(bytes: &[u8; 32]) -> bool {
    let mut y = *bytes;
    let negative = y[31] & 0x80 != 0;
    y[31] &= 0x7f;
    // p - 1 = 2^255 - 20, little-endian.
    let mut p_minus_one = [0xffu8; 32];
    p_minus_one[0] = 0xec;
    p_minus_one[31] = 0x7f;
    let below_p = y.iter().rev().cmp(p_minus_one.iter().rev()) != std::cmp::Ordering::Greater;
    let mut one = [0u8; 32];
    one[0] = 1;
    below_p && !(negative && (y == one || y == p_minus_one))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Signatures by two keys over distinct messages, as [`Signed`].
    fn signed_by_two_keys(n: usize) -> Vec<Signed> {
        let keys = [SigningKey::from_bytes(&[21; 32]), SigningKey::from_bytes(&[22; 32])];
        (0..n)
            .map(|i| {
                let key = &keys[i % 2];
                let message = format!("{{\"claims\":{i}}}").into_bytes();
                Signed { key: key.verifying_key(), signature: key.sign(&message), message }
            })
            .collect()
    }

    fn with_signature(item: &Signed, f: impl FnOnce(&mut [u8; 64])) -> Signed {
        let mut bytes = item.signature.to_bytes();
        f(&mut bytes);
        Signed { signature: Signature::from_bytes(&bytes), ..item.clone() }
    }

    #[test]
    fn a_batch_answers_each_signature_as_a_single_verification_does() {
        let good = signed_by_two_keys(9);
        // Held as a batch, not answered one by one after a failed batch.
        assert!(batch_holds(good.iter()));
        assert!(batch_holds(good[..2].iter()));
        assert_eq!(verify_all(&good), vec![true; 9]);
        assert_eq!(verify_all(&good[..1]), vec![true]);
        assert!(verify_all(&[]).is_empty());
        // One bad signature among good ones is found, and refuses nothing else.
        let mut items = good.clone();
        items[3].message.push(b' ');
        items[5] = with_signature(&items[5], |b| b[0] ^= 1); // R
        items[7] = with_signature(&items[7], |b| b[40] ^= 1); // s
        items[8].key = good[7].key; // another key's signature
        let answers = verify_all(&items);
        let singles: Vec<bool> = items.iter().map(|i| verify(&i.key, &i.message, &i.signature)).collect();
        assert_eq!(answers, singles);
        assert_eq!(answers, [true, true, true, false, true, false, true, false, false]);
        // Every single-bit change of a signature, in a batch of good ones: as verify answers.
        for bit in (0..512).step_by(7) {
            let mut items = good[..3].to_vec();
            items[1] = with_signature(&items[1], |b| b[bit / 8] ^= 1 << (bit % 8));
            let singles: Vec<bool> = items.iter().map(|i| verify(&i.key, &i.message, &i.signature)).collect();
            assert_eq!(verify_all(&items), singles, "bit {bit}");
            assert!(!singles[1], "bit {bit}");
        }
    }

    #[test]
    fn a_batch_refuses_what_a_single_verification_refuses_for_its_encoding() {
        let good = signed_by_two_keys(2);
        // s + l: the same scalar, not in its one encoding.
        // The group's order l = 2^252 + 27742317777372353535851937790883648493, little-endian.
        let l: [u8; 32] = [
            0xed, 0xd3, 0xf5, 0x5c, 0x1a, 0x63, 0x12, 0x58, 0xd6, 0x9c, 0xf7, 0xa2, 0xde, 0xf9, 0xde, 0x14, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10,
        ];
        let unreduced = with_signature(&good[0], |b| {
            let mut carry = 0u16;
            for i in 0..32 {
                let sum = b[32 + i] as u16 + l[i] as u16 + carry;
                b[32 + i] = sum as u8;
                carry = sum >> 8;
            }
        });
        assert!(!verify(&unreduced.key, &unreduced.message, &unreduced.signature));
        assert!(!batch_holds([&unreduced, &good[1]].into_iter()));
        assert_eq!(verify_all(&[unreduced, good[1].clone()]), [false, true]);
        // R's encoding: y below p, and no sign on x = 0.
        let mut p = [0xffu8; 32];
        p[0] = 0xed;
        p[31] = 0x7f;
        let mut p_minus_one = p;
        p_minus_one[0] = 0xec;
        let mut one = [0u8; 32];
        one[0] = 1;
        let signed = |mut b: [u8; 32]| {
            b[31] |= 0x80;
            b
        };
        assert!(!canonical_point_encoding(&p));
        assert!(canonical_point_encoding(&p_minus_one));
        assert!(!canonical_point_encoding(&signed(p_minus_one)));
        assert!(canonical_point_encoding(&one));
        assert!(!canonical_point_encoding(&signed(one)));
        assert!(canonical_point_encoding(good[0].signature.r_bytes()));
        // Through a batch: a signer's signature with nonce 0 (R the identity, s = h·a) is
        // valid; the same with R's encoding given a sign on x = 0 is one the batch equation
        // would hold for, and a single verification refuses.
        let key = SigningKey::from_bytes(&[23; 32]);
        let by_nonce_zero = |r: [u8; 32]| {
            let message = b"nonce zero".to_vec();
            let mut h = Sha512::new();
            h.update(r);
            h.update(key.verifying_key().as_bytes());
            h.update(&message);
            let s = Scalar::from_bytes_mod_order_wide(&h.finalize().into()) * key.to_scalar();
            let mut bytes = [0u8; 64];
            bytes[..32].copy_from_slice(&r);
            bytes[32..].copy_from_slice(s.as_bytes());
            Signed { key: key.verifying_key(), message, signature: Signature::from_bytes(&bytes) }
        };
        let valid = by_nonce_zero(one);
        assert!(verify(&valid.key, &valid.message, &valid.signature));
        assert!(batch_holds([&valid, &good[1]].into_iter()));
        let unsigned_zero = by_nonce_zero(signed(one));
        assert!(!verify(&unsigned_zero.key, &unsigned_zero.message, &unsigned_zero.signature));
        assert!(!batch_holds([&unsigned_zero, &good[1]].into_iter()));
        assert_eq!(verify_all(&[unsigned_zero, good[1].clone()]), [false, true]);
        // y = p + 1: decompresses (as y = 1), which a single verification never matches.
        let mut p_plus_one = p;
        p_plus_one[0] = 0xee;
        assert!(!canonical_point_encoding(&p_plus_one));
    }

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
