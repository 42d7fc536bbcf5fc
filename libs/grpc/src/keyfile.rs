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
    /// Held while asking the publisher (see [`KeyRing::learn`]).
    fetching: std::sync::Arc<tokio::sync::Mutex<()>>,
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

    /// Learns `key_id` from its publisher: unless the ring knows it by then, runs `fetch` and
    /// installs the keys it returns. One fetch at a time per ring: callers that meet an unknown
    /// id together (after a rotation, every request in flight at once) wait for the fetch
    /// under way and find the key installed, instead of each asking the publisher.
    pub async fn learn<E, Fut>(&self, key_id: &str, fetch: impl FnOnce() -> Fut) -> Result<(), E>
    where
        Fut: std::future::Future<Output = Result<Vec<(String, Vec<u8>)>, E>>,
    {
        if self.get(key_id).is_some() {
            return Ok(());
        }
        let _one_at_a_time = self.fetching.lock().await;
        if self.get(key_id).is_some() {
            return Ok(());
        }
        self.install(fetch().await?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use ed25519_dalek::SigningKey;

    use super::KeyRing;

    /// Two hundred requests meet a rotated key at once: the publisher is asked once, and each
    /// request finds the key. An id the publisher does not have is asked for again each time.
    #[tokio::test]
    async fn requests_meeting_an_unknown_key_together_ask_the_publisher_once() {
        let ring = KeyRing::default();
        let asked = Arc::new(AtomicUsize::new(0));
        let public = SigningKey::from_bytes(&[7; 32]).verifying_key().to_bytes().to_vec();
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                let (ring, asked, public) = (ring.clone(), asked.clone(), public.clone());
                tokio::spawn(async move {
                    ring.learn("k2", || async move {
                        asked.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        Ok::<_, ()>(vec![("k2".to_string(), public)])
                    })
                    .await
                    .expect("fetched");
                    ring.get("k2").is_some()
                })
            })
            .collect();
        for t in tasks {
            assert!(t.await.expect("task"), "the key is installed for every waiter");
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1);

        for _ in 0..2 {
            let r = ring.learn("forged", || async { Ok::<_, ()>(vec![("k2".to_string(), public.clone())]) }).await;
            assert!(r.is_ok() && ring.get("forged").is_none());
        }
        let failed = ring.learn("k3", || async { Err::<Vec<(String, Vec<u8>)>, _>("publisher down") }).await;
        assert_eq!(failed, Err("publisher down"));
    }
}
