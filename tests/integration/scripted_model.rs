//! A scripted model provider, for the failures a real model server cannot be made to produce
//! on demand (malformed answers, 429s, 5xx, timeouts, a plan naming a tool it was not
//! offered). It speaks the two wire formats the planner uses — OpenAI Chat Completions
//! (`POST /v1/chat/completions`) and Anthropic Messages (`POST /v1/messages`) — answers from a
//! queue (then a default), and keeps every request it received.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::Notify;

/// One scripted answer.
#[derive(Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    /// Held before answering until notified (a call in flight).
    pub hold: Option<Arc<Notify>>,
    pub delay: Option<Duration>,
}

impl Reply {
    pub fn raw(status: u16, body: impl Into<Vec<u8>>) -> Reply {
        Reply { status, headers: Vec::new(), body: body.into(), hold: None, delay: None }
    }

    /// A Chat Completions answer whose message content is `content`.
    pub fn chat(content: &str) -> Reply {
        let body = json!({
            "id": "chatcmpl-scripted",
            "object": "chat.completion",
            "model": "scripted-model",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150},
        });
        Reply::raw(200, body.to_string())
    }

    /// A Chat Completions answer carrying `plan` as its content.
    pub fn plan(plan: Value) -> Reply {
        Reply::chat(&plan.to_string())
    }

    /// An Anthropic Messages answer whose forced tool call carries `plan`.
    pub fn anthropic(plan: Value) -> Reply {
        let body = json!({
            "id": "msg_scripted",
            "type": "message",
            "role": "assistant",
            "model": "scripted-claude",
            "stop_reason": "tool_use",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "submit_plan", "input": plan}],
            "usage": {"input_tokens": 200, "output_tokens": 40},
        });
        Reply::raw(200, body.to_string())
    }

    pub fn header(mut self, name: &'static str, value: &str) -> Reply {
        self.headers.push((name, value.to_string()));
        self
    }

    pub fn held(mut self, gate: Arc<Notify>) -> Reply {
        self.hold = Some(gate);
        self
    }

    pub fn delayed(mut self, d: Duration) -> Reply {
        self.delay = Some(d);
        self
    }
}

/// A request as received: its JSON body and headers.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    pub body: Value,
    pub headers: HeaderMap,
}

#[derive(Clone)]
struct State {
    queue: Arc<Mutex<VecDeque<Reply>>>,
    default: Arc<Mutex<Reply>>,
    received: Arc<Mutex<Vec<Received>>>,
}

pub struct ScriptedModel {
    /// The base URL for `[planner.model] base_url` (OpenAI: with `/v1`; Anthropic: without).
    pub base_url: String,
    state: State,
    _server: tokio::task::JoinHandle<()>,
}

impl ScriptedModel {
    pub async fn start(default: Reply) -> ScriptedModel {
        let state = State { queue: Arc::default(), default: Arc::new(Mutex::new(default)), received: Arc::default() };
        let s = state.clone();
        let handler = move |uri: axum::http::Uri, headers: HeaderMap, body: Bytes| {
            let s = s.clone();
            async move {
                let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                s.received.lock().expect("test data").push(Received { path: uri.path().to_string(), body, headers });
                let reply = s
                    .queue
                    .lock()
                    .expect("test data")
                    .pop_front()
                    .unwrap_or_else(|| s.default.lock().expect("test data").clone());
                if let Some(gate) = &reply.hold {
                    gate.notified().await;
                }
                if let Some(d) = reply.delay {
                    tokio::time::sleep(d).await;
                }
                let mut resp: Response =
                    (StatusCode::from_u16(reply.status).expect("test data"), reply.body).into_response();
                for (k, v) in reply.headers {
                    resp.headers_mut().insert(k, v.parse().expect("test data"));
                }
                resp
            }
        };
        let app = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(handler.clone()))
            .route("/v1/messages", axum::routing::post(handler));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("test data");
        let addr = listener.local_addr().expect("test data");
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        ScriptedModel { base_url: format!("http://{addr}"), state, _server: server }
    }

    pub fn push(&self, reply: Reply) {
        self.state.queue.lock().expect("test data").push_back(reply);
    }

    pub fn set_default(&self, reply: Reply) {
        *self.state.default.lock().expect("test data") = reply;
    }

    pub fn received(&self) -> Vec<Received> {
        self.state.received.lock().expect("test data").clone()
    }

    /// `[planner.model]` lines for an OpenAI-compatible provider at this server.
    pub fn openai_config(&self, extra: &str) -> String {
        format!(
            "[planner.model]\nprovider = \"openai\"\nbase_url = \"{}/v1\"\nmodel = \"scripted-model\"\ntimeout_secs = 5\nmax_retries = 3\n{extra}\n[planner.prices.scripted-model]\ninput_per_mtok = 2.0\noutput_per_mtok = 10.0\n",
            self.base_url
        )
    }
}
