//! The demo tools and their declarations.

use std::collections::HashMap;
use std::io::Write;
use std::sync::Mutex;

use serde_json::{Value, json};
use warden_proto::v1 as pb;

pub struct ToolState {
    kv: Mutex<HashMap<String, Value>>,
    outbox: std::path::PathBuf,
    outbox_lock: Mutex<()>,
}

impl ToolState {
    pub fn new(outbox: &str) -> ToolState {
        ToolState { kv: Mutex::default(), outbox: outbox.into(), outbox_lock: Mutex::default() }
    }
}

pub struct CallContext<'a> {
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
            Tool::EmailSend => (
                "sends an email (appends it to the host's outbox file)",
                json!({"type": "object", "required": ["to", "subject", "body"], "properties": {
                    "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}}}),
                false,
                true,
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
            timeout_sec: 10,
            // Every demo tool dedupes by idempotency key, so re-invoking is safe.
            idempotent: true,
            consequential,
            read_only,
            version: "1".into(),
            retry_policy: match self {
                Tool::Flaky => pb::RetryPolicy::Standard,
                _ => pb::RetryPolicy::None,
            } as i32,
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
                let previous = state.kv.lock().unwrap_or_else(|p| p.into_inner()).insert(key.to_string(), value);
                Ok(json!({"key": key, "previous": previous}))
            }
            Tool::KvGet => {
                let key = string_arg(args, "key")?;
                let value = state.kv.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned();
                Ok(json!({"key": key, "found": value.is_some(), "value": value}))
            }
            Tool::EmailSend => {
                let (to, subject, body) =
                    (string_arg(args, "to")?, string_arg(args, "subject")?, string_arg(args, "body")?);
                let message_id = format!("msg-{}", &warden_core::sha256_hex(ctx.idempotency_key)[..16]);
                let line = json!({"message_id": message_id, "to": to, "subject": subject, "body": body,
                    "run_id": ctx.run_id, "step_id": ctx.step_id, "idempotency_key": ctx.idempotency_key});
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
