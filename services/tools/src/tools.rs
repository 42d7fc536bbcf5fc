//! The demo tools, their declarations and the host's durable state.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension as _, TransactionBehavior, params};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use warden_proto::v1 as pb;

/// Why the host's durable state could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("tool host state '{path}' cannot be used: {reason}")]
    Open { path: String, reason: String },
    #[error("tool host state is unavailable: {0}")]
    Db(#[from] rusqlite::Error),
    #[error("a stored outcome is unreadable: {0}")]
    Corrupt(String),
}

/// The tables, created when missing. Every row is keyed by tenant first: nothing a call
/// reads or writes can belong to another tenant.
const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS outcomes (
        tenant TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        tool TEXT NOT NULL,
        args_sha256 TEXT NOT NULL,
        outcome_json TEXT NOT NULL,
        recorded_at_ms INTEGER NOT NULL,
        PRIMARY KEY (tenant, idempotency_key)
    ) WITHOUT ROWID;
    -- Calls of non-idempotent tools, marked before they act (see `ToolState::mark_started`).
    CREATE TABLE IF NOT EXISTS started (
        tenant TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        started_at_ms INTEGER NOT NULL,
        PRIMARY KEY (tenant, idempotency_key)
    ) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS kv (
        tenant TEXT NOT NULL,
        key TEXT NOT NULL,
        value_json TEXT NOT NULL,
        PRIMARY KEY (tenant, key)
    ) WITHOUT ROWID;";

/// How long a statement waits for another process's write lock on the state file before the
/// call fails (retryable). The host owns its file; another writer is an operator's tool.
const BUSY_TIMEOUT: Duration = Duration::from_secs(2);
/// The first outcome of one (tenant, idempotency key), as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// The call that produced it (a later call with the key must be the same call).
    pub tool: String,
    pub args_sha256: String,
    pub outcome: pb::invoke_response::Outcome,
}

/// The stored form of an outcome (the protobuf types have no serde).
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

/// Everything the tools keep: the SQLite state file (outcomes and `kv`) and the outbox.
///
/// One host process owns a state file. Two processes over one file stay correct for the
/// `kv` store, but their in-flight guards do not see each other, so concurrent calls with
/// one key on two hosts could both act (the second outcome is then discarded, see
/// [`ToolState::record_outcome`]).
///
/// The file is used through one SQLite connection, called on the calling task's own thread:
/// a statement here takes microseconds (WAL, no sync on an outcome's commit), less than
/// handing it to a worker thread and waking the task again would (two hand-overs per call).
///
/// What may wait — the first open, a started mark's sync, a `kv` transaction, another
/// process's write lock (at most [`BUSY_TIMEOUT`]), the connection being in use by another
/// call — runs in [`tokio::task::block_in_place`] instead, so the runtime's other tasks move
/// to another thread meanwhile. In `warden dev` the same runtime serves the ledger, the policy
/// service and the executor, which a tool host waiting on its disk must not stall. The fast
/// path runs with no busy timeout: a statement that meets another writer's lock fails at
/// once (nothing written) and is run again on the waiting path.
pub struct ToolState {
    db: Mutex<Option<Connection>>,
    /// Calls on the waiting path, holding the connection or queued for it.
    waiting: AtomicUsize,
    /// How long the waiting path waits for another connection's write lock.
    busy_timeout: Duration,
    path: PathBuf,
    outbox: PathBuf,
    outbox_lock: Mutex<()>,
}

impl ToolState {
    /// Opens (lazily: the first use connects and creates the tables) the state file at
    /// `state`, creating its directory.
    pub fn new(outbox: &str, state: &Path) -> Result<ToolState, StateError> {
        let open_error = |reason: String| StateError::Open { path: state.display().to_string(), reason };
        if let Some(dir) = state.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| open_error(e.to_string()))?;
        }
        Ok(ToolState {
            db: Mutex::default(),
            waiting: AtomicUsize::new(0),
            busy_timeout: BUSY_TIMEOUT,
            path: state.to_path_buf(),
            outbox: outbox.into(),
            outbox_lock: Mutex::default(),
        })
    }

    /// Opens the file with its tables.
    ///
    /// WAL with synchronous=NORMAL, as the ledger: a committed outcome survives the host
    /// process dying (the restart the replay guards against); an OS crash may lose the last
    /// commits, which then read as unknown outcomes (see `ToolHostService::invoke`).
    fn open(&self) -> Result<Connection, StateError> {
        let open_error =
            |e: rusqlite::Error| StateError::Open { path: self.path.display().to_string(), reason: e.to_string() };
        let conn = Connection::open(&self.path).map_err(open_error)?;
        conn.busy_timeout(self.busy_timeout).map_err(open_error)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(open_error)?;
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(open_error)?;
        conn.execute_batch(SCHEMA).map_err(open_error)?;
        Ok(conn)
    }

    /// Runs `f` on the connection in place when it is open, free and `f` finds no other
    /// writer's lock; otherwise (and always when `may_wait`) on the waiting path, see
    /// [`ToolState`]. `f` must leave nothing written when it fails on a busy lock (one
    /// statement, or a transaction that rolls back when dropped): it may run twice.
    fn with<T>(
        &self,
        may_wait: bool,
        mut f: impl FnMut(&mut Connection) -> Result<T, StateError>,
    ) -> Result<T, StateError> {
        if !may_wait {
            // Busy with another in-place call (microseconds): wait for it here. Busy with a
            // call on the waiting path: wait there too. (A waiting call that takes the lock
            // between the check and `lock` is waited for here: rare, and only slower.)
            let db = match self.db.try_lock() {
                Ok(db) => Some(db),
                Err(std::sync::TryLockError::WouldBlock) if self.waiting.load(Ordering::Acquire) == 0 => {
                    self.db.lock().ok()
                }
                // A poisoned lock is recovered on the waiting path.
                Err(_) => None,
            };
            if let Some(mut db) = db
                && let Some(conn) = db.as_mut()
            {
                match f(conn) {
                    Err(StateError::Db(e)) if is_busy(&e) => {}
                    done => return done,
                }
            }
        }
        off_the_runtime(|| {
            self.waiting.fetch_add(1, Ordering::AcqRel);
            let _waited = Waiting(&self.waiting);
            let mut db = self.db.lock().unwrap_or_else(|p| p.into_inner());
            let mut conn = match db.take() {
                Some(conn) => conn,
                None => self.open()?,
            };
            let waits = conn.busy_timeout(self.busy_timeout).map_err(StateError::Db);
            let result = waits.and_then(|()| f(&mut conn));
            // Back to failing fast for the in-place path; a connection that cannot be set
            // back is dropped (the next call opens a new one).
            if conn.busy_timeout(Duration::ZERO).is_ok() {
                *db = Some(conn);
            }
            result
        })
    }

    /// Connects and creates the tables now (a server checks its state file at start).
    pub async fn ready(&self) -> Result<(), StateError> {
        self.with(true, |_| Ok(()))
    }

    /// The outcome first recorded for `key` of `tenant`, if any.
    pub async fn outcome(&self, tenant: &str, key: &str) -> Result<Option<Recorded>, StateError> {
        self.read_outcome(tenant, key)
    }

    fn read_outcome(&self, tenant: &str, key: &str) -> Result<Option<Recorded>, StateError> {
        let row: Option<(String, String, String)> = self.with(false, |c| {
            let mut q = c.prepare_cached(
                "SELECT tool, args_sha256, outcome_json FROM outcomes WHERE tenant = ?1 AND idempotency_key = ?2",
            )?;
            Ok(q.query_row(params![tenant, key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).optional()?)
        })?;
        row.map(|(tool, args_sha256, json)| {
            let stored: StoredOutcome =
                serde_json::from_str(&json).map_err(|e| StateError::Corrupt(format!("outcome of key '{key}': {e}")))?;
            Ok(Recorded { tool, args_sha256, outcome: stored.into() })
        })
        .transpose()
    }

    /// Marks a call of `key` started, durably, before a tool that is not idempotent acts;
    /// `false` when it was marked before — by a call of this host that then could not record
    /// its outcome, or by a host process that stopped mid-call: that call may have acted, and
    /// nobody knows whether it did.
    ///
    /// Unlike outcomes, the mark is synced to disk before this returns (`synchronous=FULL`
    /// for its commit): lost to an OS crash, it would let a repeat act a second time, where a
    /// lost outcome only leaves the call in doubt.
    pub async fn mark_started(&self, tenant: &str, key: &str, now_ms: i64) -> Result<bool, StateError> {
        self.with(true, |c| {
            c.pragma_update(None, "synchronous", "FULL")?;
            let inserted = c
                .prepare_cached(
                    "INSERT INTO started (tenant, idempotency_key, started_at_ms) VALUES (?1, ?2, ?3)
                     ON CONFLICT (tenant, idempotency_key) DO NOTHING",
                )
                .and_then(|mut q| q.execute(params![tenant, key, now_ms]));
            // Back to the setting for outcomes (a connection left on FULL is only slower).
            let _ = c.pragma_update(None, "synchronous", "NORMAL");
            Ok(inserted? == 1)
        })
    }

    /// Records `recorded` as the outcome of `key` unless one is there already, and returns
    /// the stored one with whether it is this one. The first outcome always wins, so a host
    /// that somehow acted twice still answers every call with one outcome.
    pub async fn record_outcome(
        &self,
        tenant: &str,
        key: &str,
        recorded: &Recorded,
        now_ms: i64,
    ) -> Result<(Recorded, bool), StateError> {
        let json = serde_json::to_string(&StoredOutcome::from(&recorded.outcome))
            .map_err(|e| StateError::Corrupt(e.to_string()))?;
        let inserted = self.with(false, |c| {
            let mut q = c.prepare_cached(
                "INSERT INTO outcomes (tenant, idempotency_key, tool, args_sha256, outcome_json, recorded_at_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (tenant, idempotency_key) DO NOTHING",
            )?;
            Ok(q.execute(params![tenant, key, recorded.tool, recorded.args_sha256, json, now_ms])? == 1)
        })?;
        if inserted {
            return Ok((recorded.clone(), true));
        }
        let first = self
            .read_outcome(tenant, key)?
            .ok_or_else(|| StateError::Corrupt(format!("outcome of key '{key}' vanished after a conflict")))?;
        Ok((first, false))
    }

    async fn kv_put(&self, tenant: &str, key: &str, value: &Value) -> Result<Option<Value>, StateError> {
        let previous: Option<String> = self.with(true, |c| {
            // IMMEDIATE takes the write lock up front: read-then-write never races another writer.
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let previous = tx
                .prepare_cached("SELECT value_json FROM kv WHERE tenant = ?1 AND key = ?2")?
                .query_row(params![tenant, key], |r| r.get(0))
                .optional()?;
            tx.prepare_cached(
                "INSERT INTO kv (tenant, key, value_json) VALUES (?1, ?2, ?3)
                 ON CONFLICT (tenant, key) DO UPDATE SET value_json = excluded.value_json",
            )?
            .execute(params![tenant, key, value.to_string()])?;
            tx.commit()?;
            Ok(previous)
        })?;
        previous.map(|json| parse_kv(key, &json)).transpose()
    }

    async fn kv_get(&self, tenant: &str, key: &str) -> Result<Option<Value>, StateError> {
        let row: Option<String> = self.with(false, |c| {
            Ok(c.prepare_cached("SELECT value_json FROM kv WHERE tenant = ?1 AND key = ?2")?
                .query_row(params![tenant, key], |r| r.get(0))
                .optional()?)
        })?;
        row.map(|json| parse_kv(key, &json)).transpose()
    }
}

/// Counts a call off [`ToolState::waiting`] when it leaves the waiting path, however it leaves.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether a statement failed only because another connection holds the write lock.
fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(e.sqlite_error_code(), Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked))
}

/// Runs `f`, which may wait on the disk or a lock, so that the runtime's other tasks are not
/// held up meanwhile: in `block_in_place` on a multi-threaded Tokio runtime. A current-thread
/// runtime (or none) has no other thread to give them, so `f` runs as it is there.
fn off_the_runtime<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) if rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

fn parse_kv(key: &str, json: &str) -> Result<Value, StateError> {
    serde_json::from_str(json).map_err(|e| StateError::Corrupt(format!("kv value of '{key}': {e}")))
}

/// What a tool knows about the call beyond its arguments. `tenant` comes from the request
/// and is bound into the verified authorization, so state keyed by it cannot be reached
/// from another tenant's call.
pub struct CallContext<'a> {
    pub tenant: &'a str,
    pub run_id: &'a str,
    pub step_id: &'a str,
    pub attempt: u32,
    pub idempotency_key: &'a str,
}

#[derive(Clone, Copy)]
pub enum Tool {
    Echo,
    Upper,
    KvPut,
    KvGet,
    EmailSend,
    Fail,
    Sleep,
    Flaky,
}

const ALL: [Tool; 8] =
    [Tool::Echo, Tool::Upper, Tool::KvPut, Tool::KvGet, Tool::EmailSend, Tool::Fail, Tool::Sleep, Tool::Flaky];

/// Longest `sleep` the demo host accepts.
const MAX_SLEEP_MS: u64 = 60_000;

fn tool_error(code: &str, message: impl Into<String>, retryable: bool) -> pb::ToolError {
    pb::ToolError { code: code.into(), message: message.into(), retryable }
}

fn string_arg<'a>(args: &'a Value, name: &str) -> Result<&'a str, pb::ToolError> {
    args.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| tool_error("invalid_arguments", format!("'{name}' must be a string"), false))
}

impl Tool {
    pub fn name(self) -> &'static str {
        match self {
            Tool::Echo => "echo",
            Tool::Upper => "text.upper",
            Tool::KvPut => "kv.put",
            Tool::KvGet => "kv.get",
            Tool::EmailSend => "email.send",
            Tool::Fail => "fail",
            Tool::Sleep => "sleep",
            Tool::Flaky => "flaky",
        }
    }

    fn spec(self) -> pb::ToolSpec {
        let (description, schema, read_only, consequential) = match self {
            Tool::Echo => ("returns its arguments", json!({"type": "object"}), true, false),
            Tool::Upper => (
                "upper-cases `text`",
                json!({"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}),
                true,
                false,
            ),
            Tool::KvPut => (
                "stores `value` under `key` in the host's store",
                json!({"type": "object", "required": ["key", "value"], "properties": {"key": {"type": "string"}}}),
                false,
                false,
            ),
            Tool::KvGet => (
                "reads `key` from the host's store",
                json!({"type": "object", "required": ["key"], "properties": {"key": {"type": "string"}}}),
                true,
                false,
            ),
            // External, not consequential: the demo's mail needs no commitment unless the
            // host's operator declares it so (`[tools] effects`) or the policy lists it.
            Tool::EmailSend => (
                "sends an email (appends it to the host's outbox file)",
                json!({"type": "object", "required": ["to", "subject", "body"], "properties": {
                    "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}}}),
                false,
                false,
            ),
            Tool::Fail => ("always fails with `message`", json!({"type": "object"}), true, false),
            Tool::Flaky => (
                "fails with a retryable error until attempt `succeed_on_attempt` (declares STANDARD retries)",
                json!({"type": "object", "required": ["succeed_on_attempt"], "properties": {
                    "succeed_on_attempt": {"type": "integer", "minimum": 1}}}),
                true,
                false,
            ),
            Tool::Sleep => (
                "waits `ms` milliseconds (at most 60000), then returns them",
                json!({"type": "object", "required": ["ms"], "properties": {"ms": {"type": "integer", "minimum": 0, "maximum": MAX_SLEEP_MS}}}),
                true,
                false,
            ),
        };
        pb::ToolSpec {
            name: self.name().into(),
            description: description.into(),
            input_schema_json: schema.to_string(),
            output_schema_json: self.output_schema().map(|s| s.to_string()).unwrap_or_default(),
            effect: match (self, read_only, consequential) {
                (_, _, true) => pb::Effect::Consequential,
                (Tool::EmailSend, _, _) => pb::Effect::External,
                (_, true, false) => pb::Effect::ReadOnly,
                (_, false, false) => pb::Effect::Mutating,
            } as i32,
            risk_level: match self {
                Tool::EmailSend => pb::RiskLevel::High,
                Tool::KvPut => pb::RiskLevel::Medium,
                _ => pb::RiskLevel::Low,
            } as i32,
            timeout_sec: 10,
            idempotent: self.idempotent(),
            // Non-idempotent calls are marked started before they act (`ToolState::mark_started`).
            detects_in_doubt: true,
            consequential,
            read_only,
            version: "1".into(),
            retry_policy: match self {
                Tool::Flaky => pb::RetryPolicy::Standard,
                _ => pb::RetryPolicy::None,
            } as i32,
        }
    }

    /// The output schema the tool declares where its output has a fixed shape (`echo` returns
    /// whatever it is given, `fail` returns nothing).
    fn output_schema(self) -> Option<Value> {
        let object = |required: &[&str], properties: Value| json!({"type": "object", "required": required, "properties": properties, "additionalProperties": false});
        match self {
            Tool::Echo | Tool::Fail => None,
            Tool::Upper => Some(object(&["text"], json!({"text": {"type": "string"}}))),
            Tool::KvPut => Some(object(&["key", "previous"], json!({"key": {"type": "string"}, "previous": {}}))),
            Tool::KvGet => Some(object(
                &["key", "found", "value"],
                json!({"key": {"type": "string"}, "found": {"type": "boolean"}, "value": {}}),
            )),
            Tool::EmailSend => {
                Some(object(&["message_id", "to"], json!({"message_id": {"type": "string"}, "to": {"type": "string"}})))
            }
            Tool::Sleep => Some(object(&["slept_ms"], json!({"slept_ms": {"type": "integer", "minimum": 0}}))),
            Tool::Flaky => Some(object(
                &["succeeded_on_attempt"],
                json!({"succeeded_on_attempt": {"type": "integer", "minimum": 1}}),
            )),
        }
    }

    /// Whether running the call again (after an outcome was lost: the host died before it
    /// recorded one) has no further effect. The host's replay of recorded outcomes does not
    /// make a tool idempotent: a call in flight when the host dies has no recorded outcome,
    /// and the executor re-invokes a tool declaring itself idempotent, which then acts again.
    /// So only tools whose effect is the same however often they run say so: `kv.put` sets a
    /// key to a value; `flaky` and the others have no effect and answer as a function of
    /// their arguments and attempt. `email.send` appends a message each time it runs: an
    /// unknown outcome of it goes to an operator (requires_reconciliation) instead.
    pub fn idempotent(self) -> bool {
        match self {
            Tool::Echo | Tool::Upper | Tool::KvPut | Tool::KvGet | Tool::Fail | Tool::Sleep | Tool::Flaky => true,
            Tool::EmailSend => false,
        }
    }

    /// Whether the tool answers at once as a function of its arguments and attempt alone,
    /// with no effect and nothing read: run again for a repeated key, it gives the outcome it
    /// gave the first time. Such a call is simply run: its outcome is neither looked up nor
    /// stored (see `ToolHostService::invoke`).
    pub fn pure(self) -> bool {
        match self {
            Tool::Echo | Tool::Upper | Tool::Fail | Tool::Flaky => true,
            // `kv.get` reads state that may have changed; `sleep` takes time.
            Tool::KvPut | Tool::KvGet | Tool::EmailSend | Tool::Sleep => false,
        }
    }

    pub async fn run(self, state: &ToolState, args: &Value, ctx: &CallContext<'_>) -> Result<Value, pb::ToolError> {
        match self {
            Tool::Echo => Ok(args.clone()),
            Tool::Upper => Ok(json!({"text": string_arg(args, "text")?.to_uppercase()})),
            Tool::KvPut => {
                let key = string_arg(args, "key")?;
                let value = args
                    .get("value")
                    .cloned()
                    .ok_or_else(|| tool_error("invalid_arguments", "'value' is required", false))?;
                let previous = state.kv_put(ctx.tenant, key, &value).await.map_err(state_error)?;
                Ok(json!({"key": key, "previous": previous}))
            }
            Tool::KvGet => {
                let key = string_arg(args, "key")?;
                let value = state.kv_get(ctx.tenant, key).await.map_err(state_error)?;
                Ok(json!({"key": key, "found": value.is_some(), "value": value}))
            }
            Tool::EmailSend => {
                let (to, subject, body) =
                    (string_arg(args, "to")?, string_arg(args, "subject")?, string_arg(args, "body")?);
                let id_material = format!("{}\u{0}{}", ctx.tenant, ctx.idempotency_key);
                let message_id = format!("msg-{}", &warden_core::sha256_hex(id_material)[..16]);
                let line = json!({"message_id": message_id, "to": to, "subject": subject, "body": body,
                    "tenant": ctx.tenant, "run_id": ctx.run_id, "step_id": ctx.step_id,
                    "idempotency_key": ctx.idempotency_key});
                // The append is synced before the tool answers: it waits on the disk.
                off_the_runtime(|| {
                    let _guard = state.outbox_lock.lock().unwrap_or_else(|p| p.into_inner());
                    append_line(&state.outbox, &line.to_string())
                })
                .map_err(|e| tool_error("outbox_unavailable", e.to_string(), true))?;
                Ok(json!({"message_id": message_id, "to": to}))
            }
            Tool::Sleep => {
                let ms = args.get("ms").and_then(Value::as_u64).filter(|ms| *ms <= MAX_SLEEP_MS);
                let ms = ms.ok_or_else(|| {
                    tool_error("invalid_arguments", format!("'ms' must be an integer from 0 to {MAX_SLEEP_MS}"), false)
                })?;
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                Ok(json!({"slept_ms": ms}))
            }
            Tool::Flaky => {
                let on = args.get("succeed_on_attempt").and_then(Value::as_u64).ok_or_else(|| {
                    tool_error("invalid_arguments", "'succeed_on_attempt' must be a positive integer", false)
                })?;
                if u64::from(ctx.attempt) < on {
                    let why = format!("attempt {} failed; attempt {on} will succeed", ctx.attempt);
                    return Err(tool_error("transient", why, true));
                }
                Ok(json!({"succeeded_on_attempt": ctx.attempt}))
            }
            Tool::Fail => Err(tool_error(
                "requested_failure",
                args.get("message").and_then(Value::as_str).unwrap_or("failed as asked"),
                false,
            )),
        }
    }
}

/// The state store failing is transient from the caller's side: asking again may work.
fn state_error(e: StateError) -> pb::ToolError {
    tool_error("state_unavailable", e.to_string(), true)
}

fn append_line(path: &std::path::Path, line: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    writeln!(f, "{line}")?;
    f.sync_data()
}

pub fn specs() -> Vec<pb::ToolSpec> {
    ALL.iter().map(|t| t.spec()).collect()
}

pub fn find(name: &str) -> Option<Tool> {
    ALL.iter().copied().find(|t| t.name() == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state file with a second connection holding its write lock, as an operator's
    /// `sqlite3` session might; the host waits for it (up to a minute here) rather than fail.
    fn held_state() -> (tempfile::TempDir, std::sync::Arc<ToolState>, Connection) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tools.db");
        let mut state = ToolState::new(dir.path().join("outbox").to_str().unwrap(), &path).unwrap();
        state.busy_timeout = Duration::from_secs(60);
        state.with(true, |_| Ok(())).unwrap();
        let other = Connection::open(&path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE; INSERT INTO kv VALUES ('t', 'other', '1');").unwrap();
        (dir, std::sync::Arc::new(state), other)
    }

    /// Waits (on the test's own thread, not a runtime worker) until a call is on the
    /// waiting path.
    fn until_waiting(state: &ToolState) {
        while state.waiting.load(Ordering::Acquire) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_call_waiting_on_another_writer_leaves_the_runtime_to_other_tasks() {
        let (_dir, state, other) = held_state();
        let put = tokio::spawn({
            let state = state.clone();
            async move { state.kv_put("t", "k", &json!(1)).await }
        });
        until_waiting(&state);
        // The runtime's only worker ran the waiting call; another task still runs.
        let other_task = tokio::spawn(async { "ran" });
        assert_eq!(other_task.await.unwrap(), "ran");
        assert!(!put.is_finished(), "the call waits for the other writer");
        other.execute_batch("COMMIT").unwrap();
        assert_eq!(put.await.unwrap().unwrap(), None);
        assert_eq!(state.kv_get("t", "k").await.unwrap(), Some(json!(1)));
        assert_eq!(state.kv_get("t", "other").await.unwrap(), Some(json!(1)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn an_outcome_meeting_another_writer_waits_for_it_and_is_recorded_once() {
        let (_dir, state, other) = held_state();
        let recorded = Recorded {
            tool: "echo".into(),
            args_sha256: "00".into(),
            outcome: pb::invoke_response::Outcome::OutputJson("{}".into()),
        };
        let record = tokio::spawn({
            let (state, recorded) = (state.clone(), recorded.clone());
            async move { state.record_outcome("t", "key", &recorded, 1).await }
        });
        // The in-place attempt failed on the lock at once and went to the waiting path.
        until_waiting(&state);
        assert_eq!(tokio::spawn(async { 7 }).await.unwrap(), 7);
        other.execute_batch("COMMIT").unwrap();
        assert_eq!(record.await.unwrap().unwrap(), (recorded.clone(), true));
        assert_eq!(state.outcome("t", "key").await.unwrap(), Some(recorded.clone()));
        let again = Recorded { args_sha256: "11".into(), ..recorded.clone() };
        assert_eq!(state.record_outcome("t", "key", &again, 2).await.unwrap(), (recorded, false));
    }
}
