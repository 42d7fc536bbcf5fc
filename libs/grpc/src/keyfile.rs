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
pub struct KeyRing(std::sync::Arc<std::sync::RwLock<std::collections::HashMap<String, VerifyingKey>>>);

impl KeyRing {
    pub fn get(&self, key_id: &str) -> Option<VerifyingKey> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).get(key_id).copied()
    }

    /// Adds `(key id, raw 32-byte public key)` pairs; malformed keys are skipped.
    pub fn install(&self, keys: impl IntoIterator<Item = (String, Vec<u8>)>) {
        let mut map = self.0.write().unwrap_or_else(|p| p.into_inner());
        for (id, bytes) in keys {
            if let Ok(bytes) = <[u8; 32]>::try_from(bytes.as_slice())
                && let Ok(vk) = VerifyingKey::from_bytes(&bytes)
            {
                map.insert(id, vk);
            }
        }
    }
}
