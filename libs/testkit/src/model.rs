//! A real model server for the planner's tests: llama.cpp's OpenAI-compatible `llama-server`
//! serving SmolLM2-135M-Instruct, both installed (once, cached outside the repository) by
//! `scripts/ensure-model-server.sh`, on a free port. `LLAMA_SERVER_URL` names a running one
//! instead (its `/v1` base URL).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::procs::{free_port, spawn_tied};

pub struct ModelServer {
    /// The OpenAI-compatible base URL (`http://127.0.0.1:<port>/v1`).
    pub base_url: String,
    /// The model name to ask for (llama-server answers with whatever it loaded).
    pub model: String,
    _child: Option<Mutex<Child>>,
}

/// The process-wide model server (started on first use; installing it the first time takes
/// minutes: llama.cpp is compiled).
pub fn model_server() -> &'static ModelServer {
    static M: OnceLock<ModelServer> = OnceLock::new();
    M.get_or_init(|| start_model_server().unwrap_or_else(|e| panic!("no model server for the tests: {e:#}")))
}

pub fn start_model_server() -> anyhow::Result<ModelServer> {
    if let Ok(url) = std::env::var("LLAMA_SERVER_URL") {
        return Ok(ModelServer { base_url: url, model: "smollm2-135m-instruct".into(), _child: None });
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ensure-model-server.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        anyhow::bail!("{} failed ({})", script.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |k: &str| text.lines().find_map(|l| l.strip_prefix(&format!("{k}="))).map(str::to_string);
    let server = field("server").context("the install script named no server")?;
    let model = field("model").context("the install script named no model")?;
    let mut last = String::new();
    for _ in 0..3 {
        let port = free_port()?;
        let mut cmd = Command::new(&server);
        // The shared libraries the server loads sit beside it.
        if let Some(dir) = std::path::Path::new(&server).parent() {
            cmd.env("LD_LIBRARY_PATH", dir);
        }
        cmd.args([
            "-m",
            &model,
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "-c",
            "4096",
            "-t",
            "2",
            "--parallel",
            "1",
            "--no-webui",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        let mut child = spawn_tied(cmd, libc::SIGTERM)?;
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                last = format!("llama-server exited with {status}");
                break;
            }
            if health(port) {
                return Ok(ModelServer {
                    base_url: format!("http://127.0.0.1:{port}/v1"),
                    model: "smollm2-135m-instruct".into(),
                    _child: Some(Mutex::new(child)),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = child.kill();
        if last.is_empty() {
            last = "llama-server did not become healthy within 120 s".into();
        }
    }
    anyhow::bail!("{last}")
}

/// `GET /health` answers 200 once the model is loaded.
fn health(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap_or(0);
    let head = String::from_utf8_lossy(&buf[..n]);
    head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200")
}
