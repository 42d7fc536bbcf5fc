//! The demo tools, their declarations and the host's durable state.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
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
/// What does wait on the disk — a started mark's sync, a WAL checkpoint every thousand pages,
/// another process's write lock (at most [`BUSY_TIMEOUT`]) — holds the host's thread for that
/// long, as the outbox's own sync does.
pub struct ToolState {
    db: Mutex<Option<Connection>>,
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
        conn.busy_timeout(BUSY_TIMEOUT).map_err(open_error)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(open_error)?;
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(open_error)?;
        conn.execute_batch(SCHEMA).map_err(open_error)?;
        Ok(conn)
    }

    /// Runs `f` on the connection, opening it first if it is not open (a failed open is tried
    /// again on the next call).
    fn with<T>(&self, f: impl FnOnce(&mut Connection) -> Result<T, StateError>) -> Result<T, StateError> {
        let mut db = self.db.lock().unwrap_or_else(|p| p.into_inner());
        let mut conn = match db.take() {
            Some(conn) => conn,
            None => self.open()?,
        };
        let result = f(&mut conn);
        *db = Some(conn);
        result
    }

    /// Connects and creates the tables now (a server checks its state file at start).
    pub async fn ready(&self) -> Result<(), StateError> {
        self.with(|_| Ok(()))
    }

    /// The outcome first recorded for `key` of `tenant`, if any.
    pub async fn outcome(&self, tenant: &str, key: &str) -> Result<Option<Recorded>, StateError> {
        self.read_outcome(tenant, key)
    }

    fn read_outcome(&self, tenant: &str, key: &str) -> Result<Option<Recorded>, StateError> {
        let row: Option<(String, String, String)> = self.with(|c| {
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
        self.with(|c| {
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
        let inserted = self.with(|c| {
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
        let previous: Option<String> = self.with(|c| {
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
        let row: Option<String> = self.with(|c| {
            Ok(c.prepare_cached("SELECT value_json FROM kv WHERE tenant = ?1 AND key = ?2")?
                .query_row(params![tenant, key], |r| r.get(0))
                .optional()?)
        })?;
        row.map(|json| parse_kv(key, &json)).transpose()
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
                let _guard = state.outbox_lock.lock().unwrap_or_else(|p| p.into_inner());
                append_line(&state.outbox, &line.to_string())
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
