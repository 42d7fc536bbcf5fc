//! One configured MCP server, seen from the host: a connection made when first needed and made
//! again after it broke (the server crashed, or broke the protocol), its last tool listing, and
//! calls forwarded to it with a deadline.
//!
//! A stdio server's stdout is read by the host, not handed to the MCP client as it is: every
//! line must be a JSON-RPC message (the MCP stdio transport allows nothing else). A line that
//! is not — garbage, or a response the client could not read — ends the connection at once,
//! with that as the reason, instead of leaving the call it answered waiting for its deadline.
//! Its stderr goes to the host's log, and its last lines into the reason a call failed.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation};
use rmcp::service::{RoleClient, RunningService, ServiceError};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use warden_proto::v1 as pb;

use crate::config::McpServerConfig;
use crate::tools::{self, McpTool};

/// Longest line a stdio server may write (one JSON-RPC message), as rmcp's own default.
const MAX_LINE_BYTES: usize = 16 << 20;
/// Stderr lines kept for failure reasons.
const STDERR_TAIL: usize = 5;

type Client = RunningService<RoleClient, ClientConfig>;

/// Why a call did not produce a result, as the outcome recorded for it.
fn failure(code: &str, message: String, retryable: bool) -> pb::ToolError {
    pb::ToolError { code: code.into(), message, retryable }
}

/// What the host knows about how a connection ended, and the server's last words.
#[derive(Default)]
struct Diagnosis {
    ended: Mutex<Option<String>>,
    stderr: Mutex<VecDeque<String>>,
}

impl Diagnosis {
    /// Keeps the first reason: later ones are consequences of it.
    fn end(&self, why: String) {
        self.ended.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(why);
    }

    fn ended(&self) -> Option<String> {
        self.ended.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn note_stderr(&self, line: String) {
        let mut tail = self.stderr.lock().unwrap_or_else(|p| p.into_inner());
        if tail.len() == STDERR_TAIL {
            tail.pop_front();
        }
        tail.push_back(line);
    }

    fn stderr_tail(&self) -> String {
        let tail = self.stderr.lock().unwrap_or_else(|p| p.into_inner());
        if tail.is_empty() {
            String::new()
        } else {
            format!("; its last stderr: {}", Vec::from(tail.clone()).join(" | "))
        }
    }
}

/// A live connection.
struct Connection {
    client: Client,
    diagnosis: Arc<Diagnosis>,
    /// Stops a stdio server's supervisor, which kills the process.
    stop: CancellationToken,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Connection {
    fn is_closed(&self) -> bool {
        self.client.is_closed() || self.diagnosis.ended().is_some()
    }
}

/// The last tool listing of a server.
struct Listing {
    at: Instant,
    tools: Arc<Vec<McpTool>>,
}

pub struct Upstream {
    pub config: McpServerConfig,
    connect_timeout: Duration,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
    listing: RwLock<Option<Listing>>,
    /// One listing at a time (a background refresh, or a call looking for a tool).
    listing_turn: tokio::sync::Mutex<()>,
    /// A background refresh is under way: `ListTools` starts no second one.
    refreshing: AtomicBool,
}

impl Upstream {
    pub fn new(config: McpServerConfig, connect_timeout: Duration) -> Upstream {
        Upstream {
            config,
            connect_timeout,
            connection: tokio::sync::Mutex::new(None),
            listing: RwLock::new(None),
            listing_turn: tokio::sync::Mutex::new(()),
            refreshing: AtomicBool::new(false),
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The tools of the last listing (none before the first), and whether it is older than
    /// `ttl` (or missing).
    pub fn tools(&self, ttl: Duration) -> (Arc<Vec<McpTool>>, bool) {
        match self.listing.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(l) => (l.tools.clone(), l.at.elapsed() >= ttl),
            None => (Arc::new(Vec::new()), true),
        }
    }

    /// Refreshes the listing on a task of its own, unless one is under way: a server slow to
    /// answer never holds up `ListTools`, nor piles up refreshes.
    pub fn refresh_in_background(self: &Arc<Self>) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let upstream = self.clone();
        tokio::spawn(async move {
            let _ = upstream.refresh().await;
            upstream.refreshing.store(false, Ordering::Release);
        });
    }

    /// Lists the server's tools now (connecting first if needed) and keeps the listing. A
    /// failed listing keeps the previous one: a server that is down keeps its tools in the
    /// catalog, so calls of them fail recorded, with the reason.
    pub async fn refresh(&self) -> Result<Arc<Vec<McpTool>>, String> {
        let _turn = self.listing_turn.lock().await;
        let listed = async {
            let connection = self.connection().await.map_err(|e| e.message)?;
            let tools = tokio::time::timeout(self.connect_timeout, connection.client.peer().list_all_tools())
                .await
                .map_err(|_| {
                    let within = self.connect_timeout.as_millis();
                    format!("MCP server '{}' did not answer tools/list within {within} ms", self.config.name)
                })?
                .map_err(|e| self.explain(&connection, &e))?;
            Ok::<_, String>(tools)
        };
        match listed.await {
            Ok(tools) => {
                let mut seen = std::collections::HashSet::new();
                let tools: Vec<McpTool> = tools
                    .iter()
                    .filter(|t| seen.insert(t.name.to_string()))
                    .filter_map(|t| tools::from_mcp(&self.config, t))
                    .collect();
                let tools = Arc::new(tools);
                *self.listing.write().unwrap_or_else(|p| p.into_inner()) =
                    Some(Listing { at: Instant::now(), tools: tools.clone() });
                Ok(tools)
            }
            Err(e) => {
                tracing::warn!(server = %self.config.name, error = %e, "MCP server did not list its tools");
                Err(e)
            }
        }
    }

    /// The live connection, made (again) if there is none or it broke. Connecting is one at a
    /// time, so concurrent calls never start a server twice.
    async fn connection(&self) -> Result<Arc<Connection>, pb::ToolError> {
        let mut slot = self.connection.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        if let Some(old) = slot.take() {
            tracing::info!(server = %self.config.name, reason = %old.diagnosis.ended().unwrap_or_else(|| "closed".into()), "reconnecting to MCP server");
        }
        let unavailable = |why: String| {
            failure(
                "mcp_server_unavailable",
                format!("MCP server '{}' could not be reached: {why}; nothing was sent to it", self.config.name),
                true,
            )
        };
        let connected = tokio::time::timeout(self.connect_timeout, self.connect()).await;
        let connection = match connected {
            Ok(Ok(c)) => Arc::new(c),
            Ok(Err(why)) => return Err(unavailable(why)),
            Err(_) => {
                return Err(unavailable(format!("no MCP handshake within {} ms", self.connect_timeout.as_millis())));
            }
        };
        *slot = Some(connection.clone());
        Ok(connection)
    }

    async fn connect(&self) -> Result<Connection, String> {
        let info = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("warden-mcp", env!("CARGO_PKG_VERSION")),
        );
        let diagnosis = Arc::new(Diagnosis::default());
        // A server that fails the handshake, or does not finish it in time (this future is
        // then dropped), is stopped — killed — rather than left running unused.
        let stop = CancellationToken::new();
        let unused = stop.clone().drop_guard();
        let client = if self.config.url.is_empty() {
            let (read, write) = self.spawn(diagnosis.clone(), stop.clone())?;
            let handshake = info.serve((read, write)).await;
            handshake.map_err(|e| format!("{e}{}", diagnosis.ended().map(|w| format!(" ({w})")).unwrap_or_default()))?
        } else {
            use rmcp::transport::StreamableHttpClientTransport;
            use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
            let mut config = StreamableHttpClientTransportConfig::with_uri(self.config.url.as_str());
            if !self.config.bearer_token.is_empty() {
                config = config.auth_header(self.config.bearer_token.clone());
            }
            info.serve(StreamableHttpClientTransport::from_config(config)).await.map_err(|e| e.to_string())?
        };
        unused.disarm();
        Ok(Connection { client, diagnosis, stop })
    }

    /// Starts a stdio server and its supervisor; returns what the MCP client reads (the
    /// server's checked stdout) and writes (its stdin).
    fn spawn(
        &self,
        diagnosis: Arc<Diagnosis>,
        stop: CancellationToken,
    ) -> Result<(tokio::io::DuplexStream, tokio::process::ChildStdin), String> {
        let argv = &self.config.command;
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .envs(&self.config.env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if !self.config.cwd.is_empty() {
            cmd.current_dir(&self.config.cwd);
        }
        let mut child = cmd.spawn().map_err(|e| format!("cannot start {:?}: {e}", argv[0]))?;
        let (Some(stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err("the server's stdio could not be attached".into());
        };
        let name = self.config.name.clone();
        let stderr = {
            let (diagnosis, name) = (diagnosis.clone(), name.clone());
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::info!(server = %name, "{line}");
                    diagnosis.note_stderr(line);
                }
            })
        };
        let (to_client, from_server) = tokio::io::duplex(64 << 10);
        let server = Supervised { name, child, stdout, stderr, to_client, diagnosis, stop };
        tokio::spawn(server.supervise());
        Ok((from_server, stdin))
    }

    /// The host's wait for one call, connecting included (`call_timeout_secs`).
    pub fn call_timeout(&self) -> Duration {
        Duration::from_secs(self.config.call_timeout_secs.into())
    }

    /// Forwards one call, connecting first if needed, all by `deadline`; `Err` is the failure
    /// to record.
    pub async fn call(
        &self,
        tool: &str,
        args: serde_json::Map<String, Value>,
        deadline: tokio::time::Instant,
    ) -> Result<Value, pb::ToolError> {
        let wait = self.config.call_timeout_secs;
        let server = &self.config.name;
        let connection = tokio::time::timeout_at(deadline, self.connection()).await.map_err(|_| {
            let why = format!(
                "MCP server '{server}' was not reachable within {wait}s (call_timeout_secs); nothing was sent to it"
            );
            failure("mcp_server_unavailable", why, true)
        })??;
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args);
        // Dropping the call at the deadline sends the server `notifications/cancelled`.
        let answered = tokio::time::timeout_at(deadline, connection.client.peer().call_tool(params)).await;
        match answered {
            Err(_) => Err(failure(
                "mcp_timeout",
                format!(
                    "MCP server '{server}' did not answer within {wait}s (call_timeout_secs); the call was cancelled, \
                     whether it acted is unknown{}",
                    connection.diagnosis.stderr_tail()
                ),
                false,
            )),
            Ok(Err(e)) => Err(failure("mcp_server_failed", self.explain(&connection, &e), false)),
            Ok(Ok(result)) if result.is_error == Some(true) => {
                Err(failure("mcp_tool_error", format!("tool '{tool}' failed: {}", tools::error_text(&result)), false))
            }
            Ok(Ok(result)) => Ok(tools::output_of(&result)),
        }
    }

    /// Why a request on `connection` failed, in words for the record.
    fn explain(&self, connection: &Connection, e: &ServiceError) -> String {
        let server = &self.config.name;
        match e {
            ServiceError::McpError(err) => {
                format!("MCP server '{server}' answered with JSON-RPC error {}: {}", err.code.0, err.message)
            }
            ServiceError::UnexpectedResponse => {
                format!("MCP server '{server}' answered with something that is not a result of the request")
            }
            ServiceError::TransportClosed | ServiceError::TransportSend(_) => {
                // The supervisor notes why the stream ended; give it a moment to do so.
                let why = connection.diagnosis.ended().unwrap_or_else(|| format!("the connection broke ({e})"));
                format!(
                    "MCP server '{server}' {why}; the call broke off, whether it acted is unknown{}",
                    connection.diagnosis.stderr_tail()
                )
            }
            other => format!("MCP server '{server}': {other}"),
        }
    }
}

/// A running stdio server and what the host holds of it.
struct Supervised {
    name: String,
    child: tokio::process::Child,
    stdout: tokio::process::ChildStdout,
    /// The task copying its stderr to the log (and the diagnosis).
    stderr: tokio::task::JoinHandle<()>,
    to_client: tokio::io::DuplexStream,
    diagnosis: Arc<Diagnosis>,
    stop: CancellationToken,
}

impl Supervised {
    /// Reads the server's stdout line by line, passing on only JSON-RPC messages the MCP
    /// client can read; anything else ends the connection with that reason. Kills the server
    /// when told to stop or when it broke the protocol. How it ended — and its last stderr —
    /// is noted before the client sees the end, so a call it broke off can say why.
    async fn supervise(self) {
        let Supervised { name, mut child, stdout, stderr, mut to_client, diagnosis, stop } = self;
        let mut reader = tokio::io::BufReader::new(stdout);
        let mut line = Vec::new();
        let kill = loop {
            line.clear();
            let mut bounded = (&mut reader).take(MAX_LINE_BYTES as u64 + 1);
            let read = tokio::select! {
                _ = stop.cancelled() => break true,
                read = bounded.read_until(b'\n', &mut line) => read,
            };
            match read {
                Ok(0) => break false,
                Ok(_) if line.len() > MAX_LINE_BYTES => {
                    diagnosis.end(format!("broke the protocol: wrote a line longer than {MAX_LINE_BYTES} bytes"));
                    break true;
                }
                Ok(_) => {}
                Err(e) => {
                    diagnosis.end(format!("could not be read ({e})"));
                    break true;
                }
            }
            let text = line.strip_suffix(b"\n").unwrap_or(&line);
            let text = text.strip_suffix(b"\r").unwrap_or(text);
            if text.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if let Err(why) = check_message(text) {
                tracing::warn!(server = %name, problem = %why, "MCP server broke the protocol; closing its connection");
                diagnosis.end(format!("broke the protocol: {why}"));
                break true;
            }
            let forwarded = async {
                to_client.write_all(text).await?;
                to_client.write_all(b"\n").await
            };
            if forwarded.await.is_err() {
                // The client is gone (the connection was dropped).
                break true;
            }
        };
        if kill {
            let _ = child.start_kill();
        }
        let how = match tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
            Ok(Ok(s)) => format!("exited ({s})"),
            Ok(Err(e)) => format!("ended ({e})"),
            Err(_) => {
                let _ = child.kill().await;
                "closed its stdout and was killed".into()
            }
        };
        // Its stderr closes with it: its last lines are read before anyone asks for them.
        let _ = tokio::time::timeout(Duration::from_secs(1), stderr).await;
        if !stop.is_cancelled() {
            tracing::warn!(server = %name, how = %how, "MCP server connection ended");
        }
        diagnosis.end(how);
        // Only now EOF for the client: its pending requests end, and the reason is known.
        drop(to_client);
    }
}

/// Whether one stdout line is a JSON-RPC message the MCP client can read.
fn check_message(line: &[u8]) -> Result<(), String> {
    let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
    let shown = || {
        let s = String::from_utf8_lossy(line);
        if s.chars().count() > 120 { format!("{}…", s.chars().take(120).collect::<String>()) } else { s.into_owned() }
    };
    let value: Value =
        serde_json::from_slice(line).map_err(|e| format!("wrote a line that is not JSON ({e}): {}", shown()))?;
    if value.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(format!("wrote JSON that is not a JSON-RPC 2.0 message: {}", shown()));
    }
    // A notification the client does not know is the client's to ignore.
    if value.get("id").is_none() && value.get("method").is_some() {
        return Ok(());
    }
    serde_json::from_value::<rmcp::model::ServerJsonRpcMessage>(value)
        .map(|_| ())
        .map_err(|e| format!("wrote a malformed JSON-RPC message ({e}): {}", shown()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_json_rpc_messages_pass() {
        let ok = [
            br#"{"jsonrpc":"2.0","id":1,"result":{}}"#.as_slice(),
            br#"{"jsonrpc":"2.0","id":2,"error":{"code":-32601,"message":"no"}}"#,
            br#"{"jsonrpc":"2.0","method":"notifications/whatever","params":{}}"#,
            b"\xEF\xBB\xBF{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}",
        ];
        for line in ok {
            assert_eq!(check_message(line), Ok(()), "{}", String::from_utf8_lossy(line));
        }
        let bad = [
            (b"Server started on stdio".as_slice(), "not JSON"),
            (br#"{"hello":"world"}"#, "not a JSON-RPC 2.0 message"),
            (br#"[1,2,3]"#, "not a JSON-RPC 2.0 message"),
            (br#"{"jsonrpc":"2.0","id":1}"#, "malformed JSON-RPC"),
        ];
        for (line, why) in bad {
            let e = check_message(line).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
    }
}
