//! Ed25519 signing keys kept in files (the policy's authorization key, the ledger's head key):
//! a hex seed, loaded from the configured path or created there with mode 0600 on first start.

use std::io::Write;
use std::path::Path;

use ed25519_dalek::{SigningKey, VerifyingKey};

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("key file {path}: {reason}")]
    File { path: String, reason: String },
}

fn file_err(path: &Path, reason: impl ToString) -> KeyError {
    KeyError::File { path: path.display().to_string(), reason: reason.to_string() }
}

/// Loads the key at `path`, creating it when the file does not exist.
pub fn load_or_create(path: &Path) -> Result<SigningKey, KeyError> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let bytes = hex::decode(text.trim()).map_err(|e| file_err(path, format!("not hex: {e}")))?;
            let seed: [u8; 32] = bytes.try_into().map_err(|_| file_err(path, "must hold a 32-byte hex seed"))?;
            Ok(SigningKey::from_bytes(&seed))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut seed = [0u8; 32];
            getrandom::getrandom(&mut seed).map_err(|e| file_err(path, e))?;
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(|e| file_err(path, e))?;
            }
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
            match opts.open(path) {
                Ok(mut f) => {
                    f.write_all(hex::encode(seed).as_bytes()).map_err(|e| file_err(path, e))?;
                    Ok(SigningKey::from_bytes(&seed))
                }
                // Another process created it first: use theirs.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => load_or_create(path),
                Err(e) => Err(file_err(path, e)),
            }
        }
        Err(e) => Err(file_err(path, e)),
    }
}

/// Loads a key that must exist (a rotated-out key is never created).
pub fn load_existing(path: &Path) -> Result<SigningKey, KeyError> {
    if !path.exists() {
        return Err(file_err(path, "does not exist"));
    }
    load_or_create(path)
}

/// A verifying key with its id, as served by `GetVerificationKeys`.
#[derive(Debug, Clone)]
pub struct PublishedKey {
    pub key_id: String,
    pub key: VerifyingKey,
    pub current: bool,
}

/// Verifying keys another service publishes (the policy's, the ledger's), by key id. Looked
/// up on every verification; refreshed from the publisher when an unknown id shows up, so a
/// rotated key is learned without a restart.
#[derive(Clone, Default)]
pub struct KeyRing {
    keys: std::sync::Arc<std::sync::RwLock<std::collections::HashMap<String, VerifyingKey>>>,
    /// Held while asking the publisher; whether the last fetch failed (see [`KeyRing::learn`]).
    fetching: std::sync::Arc<tokio::sync::Mutex<bool>>,
    /// Fetches started so far (counted under `fetching`).
    started: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// The policy's published verification keys, as [`KeyRing::install`] takes them.
pub async fn policy_keys(
    policy: &warden_proto::v1::policy_client::PolicyClient<crate::auth::Ch>,
) -> Result<Vec<(String, Vec<u8>)>, tonic::Status> {
    let ask = warden_proto::v1::GetVerificationKeysRequest {};
    let keys = policy.clone().get_verification_keys(ask).await?.into_inner().keys;
    Ok(keys.into_iter().map(|k| (k.key_id, k.public_key)).collect())
}

/// The ledger's published keys (they sign chain heads and request acknowledgements), as
/// [`KeyRing::install`] takes them.
pub async fn ledger_keys(
    ledger: &warden_proto::v1::ledger_client::LedgerClient<crate::auth::Ch>,
) -> Result<Vec<(String, Vec<u8>)>, tonic::Status> {
    let keys = ledger.clone().get_ledger_keys(warden_proto::v1::GetLedgerKeysRequest {}).await?.into_inner().keys;
    Ok(keys.into_iter().map(|k| (k.key_id, k.public_key)).collect())
}

/// How long [`KeyRing::learn`] waits for the publisher's answer.
pub const KEY_FETCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Why [`KeyRing::learn`] could not ask the publisher.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum LearnError<E> {
    #[error("{0}")]
    Fetch(E),
    #[error("the publisher did not answer within {KEY_FETCH_TIMEOUT:?}")]
    TimedOut,
    #[error("the publisher could not be asked (a fetch shared with other requests failed)")]
    SharedFetchFailed,
}

impl KeyRing {
    pub fn get(&self, key_id: &str) -> Option<VerifyingKey> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).get(key_id).copied()
    }

    /// Adds `(key id, raw 32-byte public key)` pairs; malformed keys are skipped.
    pub fn install(&self, keys: impl IntoIterator<Item = (String, Vec<u8>)>) {
        let mut map = self.keys.write().unwrap_or_else(|p| p.into_inner());
        for (id, bytes) in keys {
            if let Ok(bytes) = <[u8; 32]>::try_from(bytes.as_slice())
                && let Ok(vk) = VerifyingKey::from_bytes(&bytes)
            {
                map.insert(id, vk);
            }
        }
    }

    /// Learns `key_id` from its publisher unless the ring knows it: runs `fetch` (for at most
    /// [`KEY_FETCH_TIMEOUT`]) and installs the keys it returns. `Ok` says the publisher was
    /// asked, not that it knew the id.
    ///
    /// One fetch at a time per ring, and shared: a request that waited while a fetch ran which
    /// began after the request arrived takes that fetch's answer (the publisher published every
    /// key it signed the request with before that fetch asked) instead of asking again. So a
    /// wave of requests meeting a rotated key — or a wave of forged key ids — costs the
    /// publisher one or two calls, not one per request.
    pub async fn learn<E, Fut>(&self, key_id: &str, fetch: impl FnOnce() -> Fut) -> Result<(), LearnError<E>>
    where
        Fut: std::future::Future<Output = Result<Vec<(String, Vec<u8>)>, E>>,
    {
        use std::sync::atomic::Ordering::SeqCst;
        if self.get(key_id).is_some() {
            return Ok(());
        }
        let arrived = self.started.load(SeqCst);
        let mut last_failed = self.fetching.lock().await;
        if self.get(key_id).is_some() {
            return Ok(());
        }
        if self.started.load(SeqCst) > arrived {
            return if *last_failed { Err(LearnError::SharedFetchFailed) } else { Ok(()) };
        }
        self.started.fetch_add(1, SeqCst);
        *last_failed = true;
        let keys = tokio::time::timeout(KEY_FETCH_TIMEOUT, fetch())
            .await
            .map_err(|_| LearnError::TimedOut)?
            .map_err(LearnError::Fetch)?;
        self.install(keys);
        *last_failed = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use ed25519_dalek::SigningKey;
    use tokio::sync::{mpsc, watch};

    use super::{KeyRing, LearnError};

    type Keys = Vec<(String, Vec<u8>)>;

    /// `n` requests meet `id(i)` at once; each fetch holds until every request has arrived (a
    /// request says so, then asks in the same poll of this single-threaded runtime, so it has
    /// looked at the ring before the test opens the gate). Returns each request's answer and
    /// how often the publisher was asked.
    async fn wave<T: Send + 'static>(
        ring: &KeyRing,
        n: usize,
        id: impl Fn(usize) -> String,
        answer: Result<Keys, &'static str>,
        seen: impl Fn(&KeyRing, &str, Result<(), LearnError<&'static str>>) -> T + Clone + Send + 'static,
    ) -> (Vec<T>, usize) {
        let asked = Arc::new(AtomicUsize::new(0));
        let (open, gate) = watch::channel(false);
        let (arrive, mut arrivals) = mpsc::unbounded_channel();
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let (ring, asked, gate, arrive, seen) =
                    (ring.clone(), asked.clone(), gate.clone(), arrive.clone(), seen.clone());
                let (id, answer) = (id(i), answer.clone());
                tokio::spawn(async move {
                    let _ = arrive.send(());
                    let r = ring
                        .learn(&id, || async move {
                            asked.fetch_add(1, Ordering::SeqCst);
                            let mut gate = gate;
                            let _ = gate.wait_for(|open| *open).await;
                            answer
                        })
                        .await;
                    seen(&ring, &id, r)
                })
            })
            .collect();
        for _ in 0..n {
            arrivals.recv().await.expect("a request arrives");
        }
        let _ = open.send(true);
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.expect("task"));
        }
        (answers, asked.load(Ordering::SeqCst))
    }

    /// Two hundred requests meet a rotated key at once: the publisher is asked once, and each
    /// request finds the key.
    #[tokio::test]
    async fn requests_meeting_an_unknown_key_together_ask_the_publisher_once() {
        let ring = KeyRing::default();
        let public = SigningKey::from_bytes(&[7; 32]).verifying_key().to_bytes().to_vec();
        let (found, asked) = wave(
            &ring,
            200,
            |_| "k2".into(),
            Ok(vec![("k2".to_string(), public)]),
            |ring, id, r| r.is_ok() && ring.get(id).is_some(),
        )
        .await;
        assert!(found.iter().all(|f| *f), "the key is installed for every waiter");
        assert_eq!(asked, 1);
    }

    /// Forged key ids, many at once: they share fetches (at most one running and one waiting
    /// per wave), each is answered, and none is installed.
    #[tokio::test]
    async fn forged_key_ids_share_the_publishers_answers() {
        let ring = KeyRing::default();
        let (unknown, asked) =
            wave(&ring, 100, |i| format!("forged-{i}"), Ok(vec![]), |ring, id, r| r.is_ok() && ring.get(id).is_none())
                .await;
        assert!(unknown.iter().all(|u| *u), "a forged id is answered and never installed");
        assert!(asked <= 2, "asked {asked} times");
    }

    /// A failed fetch fails the requests that shared it (the key stays unknown: try again), and
    /// a publisher that never answers is given up on.
    #[tokio::test]
    async fn a_failed_or_hung_fetch_is_an_error_for_everyone_who_waited_on_it() {
        let ring = KeyRing::default();
        let (answers, _) = wave(&ring, 10, |_| "k3".into(), Err("publisher down"), |_, _, r| r).await;
        assert!(answers.contains(&Err(LearnError::Fetch("publisher down"))), "{answers:?}");
        assert!(
            answers.iter().all(|a| matches!(a, Err(LearnError::Fetch(_) | LearnError::SharedFetchFailed))),
            "{answers:?}"
        );
        assert!(ring.get("k3").is_none());

        let hung = ring.learn("k4", std::future::pending::<Result<Keys, ()>>).await;
        assert_eq!(hung, Err(LearnError::TimedOut));
    }
}
