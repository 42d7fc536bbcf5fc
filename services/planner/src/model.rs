//! Model providers (seed 004: cognition only — an answer is text to validate, never an
//! action). `openai` speaks OpenAI's Chat Completions with structured output (which OpenAI,
//! vLLM, llama.cpp's `llama-server` and Ollama accept), `anthropic` the Messages API with a
//! forced tool call carrying the plan schema. Both share the retry and body rules:
//! - 429, 5xx, timeouts and refused connections are retried with jittered exponential
//!   backoff, honouring `Retry-After` (seconds; at most 60), up to `max_retries`; then the
//!   call is `Unavailable`.
//! - Another 4xx is `Refused` (a bad key, an unknown model): asking again cannot help.
//! - A body over [`MAX_BODY_BYTES`], not UTF-8, not JSON, or without an answer is
//!   `Malformed`: recorded, and the planner repairs or falls back.
//!
//! API keys come from the environment or a file, are sent only in the provider's header and
//! never logged or recorded.

use std::time::Duration;

use serde_json::{Value, json};
use warden_config::ModelConfig;

/// Largest provider response read.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// A planning call: the conversation (first message the system prompt) and the answer's schema.
#[derive(Debug, Clone)]
pub struct ModelRequest {
    pub messages: Vec<Value>,
    pub schema: Value,
}

/// What the provider answered.
#[derive(Debug, Clone, Default)]
pub struct ModelReply {
    pub text: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub response_id: String,
    pub model: String,
    pub finish_reason: String,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ModelError {
    #[error("provider unavailable: {0}")]
    Unavailable(String),
    #[error("provider refused the request (HTTP {status}): {message}")]
    Refused { status: u16, message: String },
    #[error("unreadable answer: {0}")]
    Malformed(String),
}

impl ModelError {
    pub fn kind(&self) -> &'static str {
        match self {
            ModelError::Unavailable(_) => "unavailable",
            ModelError::Refused { .. } => "refused",
            ModelError::Malformed(_) => "malformed",
        }
    }
}

/// One configured provider.
#[derive(Clone)]
pub struct ModelClient {
    http: reqwest::Client,
    pub config: ModelConfig,
    api_key: Option<String>,
}

impl std::fmt::Debug for ModelClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("ModelClient")
            .field("provider", &self.config.provider)
            .field("model", &self.config.model)
            .finish()
    }
}

impl ModelClient {
    pub fn new(config: &ModelConfig) -> anyhow::Result<ModelClient> {
        // reqwest is built without a crypto provider of its own choosing: ring, installed once.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let api_key = if !config.api_key_file.is_empty() {
            let text = std::fs::read_to_string(&config.api_key_file)
                .map_err(|e| anyhow::anyhow!("planner model api_key_file '{}': {e}", config.api_key_file))?;
            Some(text.trim().to_string())
        } else if !config.api_key_env.is_empty() {
            std::env::var(&config.api_key_env).ok().filter(|k| !k.is_empty())
        } else {
            None
        };
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(config.timeout_secs))
            .connect_timeout(Duration::from_secs(config.timeout_secs.min(10)))
            .build()?;
        Ok(ModelClient { http, config: config.clone(), api_key })
    }

    /// The provider's name for the recorded `gen_ai.system` / `provider`.
    pub fn provider(&self) -> &str {
        &self.config.provider
    }

    /// `chat` (Chat Completions) or `messages` (Anthropic).
    pub fn api_mode(&self) -> &'static str {
        if self.config.provider == "anthropic" { "messages" } else { "chat" }
    }

    /// The options that shape an answer (recorded; drift in them is drift).
    pub fn options(&self) -> Value {
        json!({
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
            "response_format": if self.config.provider == "anthropic" { "tool_use" } else { self.config.response_format.as_str() },
        })
    }

    /// Asks once (with retries for what a retry can fix).
    pub async fn complete(&self, req: &ModelRequest) -> Result<ModelReply, ModelError> {
        let (url, body) = match self.config.provider.as_str() {
            "anthropic" => (join(&self.config.base_url, "v1/messages"), self.anthropic_body(req)),
            _ => (join(&self.config.base_url, "chat/completions"), self.openai_body(req)),
        };
        let mut failures = Vec::new();
        for attempt in 0..=self.config.max_retries {
            let wait = match self.send(&url, &body).await {
                Ok(v) => return self.reply(v),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry { why, after }) => {
                    failures.push(why);
                    after.unwrap_or_else(|| backoff(attempt))
                }
            };
            if attempt < self.config.max_retries {
                tokio::time::sleep(wait).await;
            }
        }
        Err(ModelError::Unavailable(format!(
            "{} attempts failed: {}",
            failures.len(),
            failures.last().cloned().unwrap_or_default()
        )))
    }

    async fn send(&self, url: &str, body: &Value) -> Result<Value, Attempt> {
        let mut trace = reqwest::header::HeaderMap::new();
        // W3C trace context of the model call's span (nothing when tracing is off).
        warden_telemetry::context::inject_http(&mut trace);
        let mut rb =
            self.http.post(url).headers(trace).header("content-type", "application/json").body(body.to_string());
        if let Some(key) = &self.api_key {
            rb = match self.config.provider.as_str() {
                "anthropic" => rb.header("x-api-key", key),
                _ => rb.header("authorization", format!("Bearer {key}")),
            };
        }
        if self.config.provider == "anthropic" {
            rb = rb.header("anthropic-version", "2023-06-01");
        }
        let mut resp = rb.send().await.map_err(|e| Attempt::Retry { why: describe(&e), after: None })?;
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|s| Duration::from_secs(s.min(60)));
        let mut bytes = Vec::new();
        loop {
            match resp.chunk().await {
                Ok(Some(chunk)) => {
                    if bytes.len() + chunk.len() > MAX_BODY_BYTES {
                        return Err(Attempt::Fatal(ModelError::Malformed(format!(
                            "response body over {MAX_BODY_BYTES} bytes (HTTP {})",
                            status.as_u16()
                        ))));
                    }
                    bytes.extend_from_slice(&chunk);
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(Attempt::Retry { why: format!("reading the response: {}", describe(&e)), after: None });
                }
            }
        }
        if status.as_u16() == 429 || status.is_server_error() {
            return Err(Attempt::Retry {
                why: format!("HTTP {}: {}", status.as_u16(), excerpt(&bytes)),
                after: retry_after,
            });
        }
        if !status.is_success() {
            return Err(Attempt::Fatal(ModelError::Refused { status: status.as_u16(), message: excerpt(&bytes) }));
        }
        let text = String::from_utf8(bytes)
            .map_err(|_| Attempt::Fatal(ModelError::Malformed("the body is not UTF-8".into())))?;
        if text.trim().is_empty() {
            return Err(Attempt::Fatal(ModelError::Malformed("the body is empty".into())));
        }
        serde_json::from_str(&text).map_err(|e| {
            Attempt::Fatal(ModelError::Malformed(format!("the body is not JSON ({e}): {}", excerpt(text.as_bytes()))))
        })
    }

    fn openai_body(&self, req: &ModelRequest) -> Value {
        let format = match self.config.response_format.as_str() {
            "json_object" => json!({"type": "json_object", "schema": req.schema}),
            _ => {
                json!({"type": "json_schema", "json_schema": {"name": "execution_plan", "strict": true, "schema": req.schema}})
            }
        };
        json!({
            "model": self.config.model,
            "messages": req.messages,
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
            "response_format": format,
        })
    }

    fn anthropic_body(&self, req: &ModelRequest) -> Value {
        let system = req.messages.first().filter(|m| m["role"] == "system").and_then(|m| m["content"].as_str());
        let rest: Vec<&Value> = req.messages.iter().filter(|m| m["role"] != "system").collect();
        json!({
            "model": self.config.model,
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
            "system": system.unwrap_or_default(),
            "messages": rest,
            "tools": [{"name": "submit_plan", "description": "Submit the execution plan for the goal.", "input_schema": req.schema}],
            "tool_choice": {"type": "tool", "name": "submit_plan"},
        })
    }

    fn reply(&self, v: Value) -> Result<ModelReply, ModelError> {
        let text_of = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        if self.config.provider == "anthropic" {
            let call = v
                .get("content")
                .and_then(Value::as_array)
                .and_then(|c| c.iter().find(|b| b["type"] == "tool_use" && b["name"] == "submit_plan"))
                .ok_or_else(|| ModelError::Malformed("no submit_plan tool call in the answer".into()))?;
            let input = call
                .get("input")
                .filter(|i| i.is_object())
                .ok_or_else(|| ModelError::Malformed("the tool call has no input object".into()))?;
            return Ok(ModelReply {
                text: input.to_string(),
                input_tokens: v["usage"]["input_tokens"].as_u64().unwrap_or_default(),
                output_tokens: v["usage"]["output_tokens"].as_u64().unwrap_or_default(),
                response_id: text_of(&v, "id"),
                model: text_of(&v, "model"),
                finish_reason: text_of(&v, "stop_reason"),
            });
        }
        let choice = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
            .ok_or_else(|| ModelError::Malformed("no choices in the answer".into()))?;
        let message = &choice["message"];
        if let Some(refusal) = message.get("refusal").and_then(Value::as_str) {
            return Err(ModelError::Malformed(format!("the model refused: {refusal}")));
        }
        let text = message
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::Malformed("the answer has no message content".into()))?;
        Ok(ModelReply {
            text: text.to_string(),
            input_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or_default(),
            output_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or_default(),
            response_id: text_of(&v, "id"),
            model: text_of(&v, "model"),
            finish_reason: text_of(choice, "finish_reason"),
        })
    }
}

enum Attempt {
    Retry { why: String, after: Option<Duration> },
    Fatal(ModelError),
}

fn join(base: &str, path: &str) -> String {
    format!("{}/{path}", base.trim_end_matches('/'))
}

/// 250 ms doubling to at most 8 s, with ±25 % jitter.
fn backoff(attempt: u32) -> Duration {
    let base = Duration::from_millis(250).saturating_mul(1 << attempt.min(5)).min(Duration::from_secs(8));
    let mut b = [0u8; 1];
    let _ = getrandom::getrandom(&mut b);
    base.mul_f64(0.75 + f64::from(b[0]) / 512.0)
}

fn describe(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out".into()
    } else if e.is_connect() {
        "connection refused or failed".into()
    } else {
        // reqwest's display names the URL, never a header.
        e.to_string()
    }
}

/// At most 300 characters of a body, lossily decoded, for an error message.
fn excerpt(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
    s.replace(|c: char| c.is_control(), " ")
}
