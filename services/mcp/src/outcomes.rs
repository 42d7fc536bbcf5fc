//! The host's durable memory: the first outcome of every (tenant, idempotency key), written to
//! SQLite before the call is answered, so a repeated key — concurrent, retried, or after the
//! host restarted — gets that outcome back instead of reaching the MCP server twice. Calls with
//! one key take turns through an in-memory guard that lives only while such a call runs.
//!
//! The same scheme (and table) as the demo tool host's outcome store, kept here rather than
//! shared because sharing it would mean editing that host.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use warden_proto::v1 as pb;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("outcome store '{path}' cannot be used: {reason}")]
    Open { path: String, reason: String },
    #[error("outcome store is unavailable: {0}")]
    Db(#[from] sqlx::Error),
    #[error("a stored outcome is unreadable: {0}")]
    Corrupt(String),
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS outcomes (
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    tool TEXT NOT NULL,
    args_sha256 TEXT NOT NULL,
    outcome_json TEXT NOT NULL,
    recorded_at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, idempotency_key)
) WITHOUT ROWID";

/// The first outcome of one (tenant, idempotency key) and the call that produced it.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub tool: String,
    pub args_sha256: String,
    pub outcome: pb::invoke_response::Outcome,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum StoredOutcome {
    Output(String),
    Error { code: String, message: String, retryable: bool },
}

impl From<&pb::invoke_response::Outcome> for StoredOutcome {
    fn from(o: &pb::invoke_response::Outcome) -> Self {
        match o {
            pb::invoke_response::Outcome::OutputJson(out) => StoredOutcome::Output(out.clone()),
            pb::invoke_response::Outcome::Error(e) => {
                StoredOutcome::Error { code: e.code.clone(), message: e.message.clone(), retryable: e.retryable }
            }
        }
    }
}

impl From<StoredOutcome> for pb::invoke_response::Outcome {
    fn from(o: StoredOutcome) -> Self {
        match o {
            StoredOutcome::Output(out) => pb::invoke_response::Outcome::OutputJson(out),
            StoredOutcome::Error { code, message, retryable } => {
                pb::invoke_response::Outcome::Error(pb::ToolError { code, message, retryable })
            }
        }
    }
}

pub struct OutcomeStore {
    pool: SqlitePool,
    path: PathBuf,
    schema: tokio::sync::OnceCell<()>,
}

impl OutcomeStore {
    /// Opens lazily (the first use connects and creates the table). Within a Tokio runtime.
    pub fn new(path: &Path) -> Result<OutcomeStore, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| StoreError::Open { path: path.display().to_string(), reason: e.to_string() })?;
        }
        // WAL with synchronous=NORMAL, as the ledger and the demo host: a committed outcome
        // survives the host process dying, which is what replay guards against.
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10));
        // No ping before each use: a SQLite connection is a file handle in this process.
        let pool = SqlitePoolOptions::new()
            .test_before_acquire(false)
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(options);
        Ok(OutcomeStore { pool, path: path.to_path_buf(), schema: tokio::sync::OnceCell::new() })
    }

    async fn db(&self) -> Result<&SqlitePool, StoreError> {
        self.schema
            .get_or_try_init(|| async {
                sqlx::query(SCHEMA)
                    .execute(&self.pool)
                    .await
                    .map_err(|e| StoreError::Open { path: self.path.display().to_string(), reason: e.to_string() })?;
                Ok::<(), StoreError>(())
            })
            .await?;
        Ok(&self.pool)
    }

    /// Connects and creates the table now, so a bad `state_path` stops the host at start.
    pub async fn ready(&self) -> Result<(), StoreError> {
        self.db().await.map(|_| ())
    }

    pub async fn outcome(&self, tenant: &str, key: &str) -> Result<Option<Recorded>, StoreError> {
        let row: Option<(String, String, String)> = sqlx::query_as(
            "SELECT tool, args_sha256, outcome_json FROM outcomes WHERE tenant = ? AND idempotency_key = ?",
        )
        .bind(tenant)
        .bind(key)
        .fetch_optional(self.db().await?)
        .await?;
        row.map(|(tool, args_sha256, json)| {
            let stored: StoredOutcome =
                serde_json::from_str(&json).map_err(|e| StoreError::Corrupt(format!("outcome of key '{key}': {e}")))?;
            Ok(Recorded { tool, args_sha256, outcome: stored.into() })
        })
        .transpose()
    }

    /// Records `recorded` unless the key has an outcome already; returns the stored outcome
    /// and whether it is this one (the first outcome always wins).
    pub async fn record(
        &self,
        tenant: &str,
        key: &str,
        recorded: &Recorded,
        now_ms: i64,
    ) -> Result<(Recorded, bool), StoreError> {
        let json = serde_json::to_string(&StoredOutcome::from(&recorded.outcome))
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let inserted = sqlx::query(
            "INSERT INTO outcomes (tenant, idempotency_key, tool, args_sha256, outcome_json, recorded_at_ms)
             VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, idempotency_key) DO NOTHING",
        )
        .bind(tenant)
        .bind(key)
        .bind(&recorded.tool)
        .bind(&recorded.args_sha256)
        .bind(json)
        .bind(now_ms)
        .execute(self.db().await?)
        .await?
        .rows_affected()
            == 1;
        if inserted {
            return Ok((recorded.clone(), true));
        }
        let first = self
            .outcome(tenant, key)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("outcome of key '{key}' vanished after a conflict")))?;
        Ok((first, false))
    }
}

/// (tenant, idempotency key).
type Key = (String, String);

/// Calls in flight by key; an entry lives while some call holds a [`Ticket`] for it.
#[derive(Default)]
pub struct InFlight {
    by_key: Mutex<HashMap<Key, Arc<tokio::sync::Mutex<()>>>>,
}

impl InFlight {
    pub fn ticket(self: &Arc<Self>, key: Key) -> Ticket {
        let mut map = self.by_key.lock().unwrap_or_else(|p| p.into_inner());
        let slot = map.entry(key.clone()).or_default().clone();
        Ticket { in_flight: self.clone(), key, slot }
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.by_key.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }
}

pub struct Ticket {
    in_flight: Arc<InFlight>,
    key: Key,
    slot: Arc<tokio::sync::Mutex<()>>,
}

impl Ticket {
    /// Waits until no other call with the key runs; the turn lasts while the guard lives.
    pub async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.slot.lock().await
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut map = self.in_flight.by_key.lock().unwrap_or_else(|p| p.into_inner());
        // Held by the map and this ticket only; clones are made under the map lock.
        if Arc::strong_count(&self.slot) == 2 {
            map.remove(&self.key);
        }
    }
}
