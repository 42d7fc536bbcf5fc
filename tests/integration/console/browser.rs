//! Headless Chromium driven over W3C WebDriver (Debian's `chromium` and `chromium-driver`,
//! installed with apt-get when missing, as the harness installs Redis and PostgreSQL).
//!
//! Every wait is on an event: Chromium and chromedriver say when they listen, and the page
//! waits are scripts that resolve on the DOM mutation that meets their condition (a
//! MutationObserver), bounded by WebDriver's script timeout as a guard against a hang.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Context;
use base64::Engine;
use serde_json::{Value, json};
use warden_testkit::procs::{apt_install, find_binary, free_port, spawn_tied};

use super::http;

/// How long one wait may take at most: a guard against a hang, not a latency bound.
const HANG_GUARD: Duration = Duration::from_secs(45);
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// WebDriver's key code for Enter.
pub const ENTER: &str = "\u{E007}";

/// `/usr/bin/chromium` and `chromedriver`, installed once per test process when missing.
fn binaries() -> anyhow::Result<(PathBuf, PathBuf)> {
    static FOUND: OnceLock<Result<(PathBuf, PathBuf), String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let find = || Some((find_binary("chromium", &[])?, find_binary("chromedriver", &[])?));
            if let Some(found) = find() {
                return Ok(found);
            }
            apt_install(&["chromium", "chromium-driver"]).map_err(|e| format!("{e:#}"))?;
            find().ok_or_else(|| "chromium or chromedriver still missing after apt-get install".to_string())
        })
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

pub struct Browser {
    chromium: Child,
    driver: Child,
    base: String,
    session: String,
    _profile: tempfile::TempDir,
    shots: PathBuf,
}

/// Which of a child's output streams says it is ready.
#[derive(Clone, Copy)]
enum Says {
    Stdout,
    Stderr,
}

/// Spawns `cmd` tied to this process (so it cannot outlive a test that is killed) and waits
/// for the line of `stream` containing `ready`; the rest of the stream is drained so the
/// child never blocks on a full pipe. `false` when the stream ended (or the guard passed)
/// without it.
async fn spawn_until(mut cmd: Command, what: &str, stream: Says, ready: &'static str) -> anyhow::Result<(Child, bool)> {
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).stdin(Stdio::null());
    match stream {
        Says::Stdout => cmd.stdout(Stdio::piped()),
        Says::Stderr => cmd.stderr(Stdio::piped()),
    };
    let mut child = spawn_tied(cmd, libc::SIGKILL).with_context(|| format!("starting {what}"))?;
    let out: Box<dyn std::io::Read + Send> = match stream {
        Says::Stdout => Box::new(child.stdout.take().context("no stdout")?),
        Says::Stderr => Box::new(child.stderr.take().context("no stderr")?),
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if line.contains(ready)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(());
            }
        }
    });
    let said = matches!(tokio::time::timeout(HANG_GUARD, rx).await, Ok(Ok(())));
    Ok((child, said))
}

fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

impl Browser {
    /// A fresh headless Chromium (its own profile) at 1280×800, and a chromedriver attached to
    /// it; screenshots go to `shots`. The test starts Chromium itself (rather than letting
    /// chromedriver start it) so both die with the test process, whatever ends it.
    pub async fn start(shots: &Path) -> anyhow::Result<Browser> {
        let (chromium_bin, chromedriver) = binaries()?;
        let profile = tempfile::Builder::new().prefix("warden-chromium-").tempdir()?;
        let mut last = None;
        for _ in 0..5 {
            let debug_port = free_port()?;
            let mut cmd = Command::new(&chromium_bin);
            cmd.args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                "--window-size=1280,800",
                &format!("--remote-debugging-port={debug_port}"),
                &format!("--user-data-dir={}", profile.path().display()),
                "about:blank",
            ]);
            let (mut chromium, up) = spawn_until(cmd, "chromium", Says::Stderr, "DevTools listening on").await?;
            if !up {
                stop(&mut chromium);
                last = Some(anyhow::anyhow!("chromium did not open its debugging port {debug_port}"));
                continue;
            }
            let port = free_port()?;
            let mut cmd = Command::new(&chromedriver);
            cmd.arg(format!("--port={port}"));
            let (mut driver, ready) =
                spawn_until(cmd, "chromedriver", Says::Stdout, "was started successfully").await?;
            let base = format!("http://127.0.0.1:{port}");
            if !ready {
                stop(&mut driver);
                stop(&mut chromium);
                last = Some(anyhow::anyhow!("chromedriver did not become ready on port {port}"));
                continue;
            }
            let caps = json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"debuggerAddress": format!("127.0.0.1:{debug_port}")},
            }}});
            match call(&base, "POST", "/session", &caps).await {
                Ok(v) => {
                    let session = v["sessionId"].as_str().context("no session id")?.to_string();
                    std::fs::create_dir_all(shots)?;
                    let b = Browser { chromium, driver, base, session, _profile: profile, shots: shots.to_path_buf() };
                    // The page waits are scripts; this bounds each (a guard against a hang).
                    b.cmd("POST", "/timeouts", json!({"script": HANG_GUARD.as_millis() as u64})).await?;
                    // The viewport itself is 1280×800 (a headless window's size includes its frame).
                    b.resize(1280, 800).await?;
                    return Ok(b);
                }
                Err(e) => {
                    stop(&mut driver);
                    stop(&mut chromium);
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("chromium and chromedriver did not start")))
    }

    async fn cmd(&self, method: &str, path: &str, body: Value) -> anyhow::Result<Value> {
        // Boxed: the waits below nest many commands, and a test's future lives on its stack.
        Box::pin(call(&self.base, method, &format!("/session/{}{path}", self.session), &body)).await
    }

    pub async fn goto(&self, url: &str) -> anyhow::Result<()> {
        self.cmd("POST", "/url", json!({"url": url})).await.map(|_| ())
    }

    /// Sets the page's viewport (a narrow phone, the default 1280×800), through DevTools:
    /// headless windows of an attached browser keep their size.
    pub async fn resize(&self, width: u32, height: u32) -> anyhow::Result<()> {
        let params = json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600});
        let body = json!({"cmd": "Emulation.setDeviceMetricsOverride", "params": params});
        self.cmd("POST", "/goog/cdp/execute", body).await.map(|_| ())
    }

    /// Runs `script` (a function body; `arguments` are `args`) in the page and returns its value.
    pub async fn eval(&self, script: &str, args: Value) -> anyhow::Result<Value> {
        self.cmd("POST", "/execute/sync", json!({"script": script, "args": args})).await
    }

    async fn find(&self, css: &str) -> anyhow::Result<Option<String>> {
        let found = self.cmd("POST", "/elements", json!({"using": "css selector", "value": css})).await?;
        Ok(found.as_array().and_then(|a| a.first()).and_then(|e| e[ELEMENT].as_str()).map(str::to_string))
    }

    /// Waits in the page until `condition` (a JavaScript expression over `arg`) holds: checked
    /// at once, then on every DOM mutation. `false` when the page went away under the wait (a
    /// navigation); an error when the script timeout passed.
    async fn until(&self, condition: &str, arg: Value) -> anyhow::Result<bool> {
        let script = format!(
            "const arg = arguments[0], done = arguments[arguments.length - 1]; \
             const holds = () => {{ try {{ return !!({condition}); }} catch (e) {{ return false; }} }}; \
             if (holds()) return done(true); \
             const seen = new MutationObserver(() => {{ if (holds()) {{ seen.disconnect(); done(true); }} }}); \
             seen.observe(document, {{subtree: true, childList: true, characterData: true, attributes: true}});"
        );
        match self.cmd("POST", "/execute/async", json!({"script": script, "args": [arg]})).await {
            Ok(v) => Ok(v.as_bool() == Some(true)),
            Err(e) if e.to_string().contains("script timeout") => Err(e),
            // The document was replaced under the script: the caller looks again.
            Err(_) => Ok(false),
        }
    }

    /// Waits for an element matching `css` and returns its id.
    pub async fn element(&self, css: &str) -> anyhow::Result<String> {
        let guard = tokio::time::Instant::now() + HANG_GUARD;
        loop {
            if let Some(id) = self.find(css).await? {
                return Ok(id);
            }
            let appeared = self.until("document.querySelector(arg)", json!(css)).await;
            anyhow::ensure!(
                appeared.is_ok() && tokio::time::Instant::now() < guard,
                "no element '{css}' appeared\n{}",
                self.page_text().await
            );
        }
    }

    /// Does `what` to the element matching `css`, finding it again if the page redrew it in
    /// between (the live views do).
    async fn act(&self, css: &str, what: &str, body: Value) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + HANG_GUARD;
        loop {
            let id = self.element(css).await?;
            match self.cmd("POST", &format!("/element/{id}/{what}"), body.clone()).await {
                Ok(_) => return Ok(()),
                Err(e) if e.to_string().contains("stale element") && tokio::time::Instant::now() < deadline => {}
                Err(e) => return Err(e),
            }
        }
    }

    pub async fn click(&self, css: &str) -> anyhow::Result<()> {
        self.act(css, "click", json!({})).await
    }

    /// Types `text` into the element (it gets the keyboard focus first, as a person's Tab would).
    pub async fn type_into(&self, css: &str, text: &str) -> anyhow::Result<()> {
        self.act(css, "value", json!({"text": text})).await
    }

    /// Gives the element matching `css` the keyboard focus (as Tab would) and presses `key` on
    /// it, as a person's keyboard does: for elements that take no text, such as the DAG's nodes.
    pub async fn press(&self, css: &str, key: &str) -> anyhow::Result<()> {
        // The page may redraw between finding and focusing: the focus is given in the page,
        // again on every mutation, until it holds.
        let focused = "(() => { const e = document.querySelector(arg); if (!e) return false; \
                       e.focus(); return document.activeElement === e; })()";
        let deadline = tokio::time::Instant::now() + HANG_GUARD;
        loop {
            self.element(css).await?;
            if self.until(focused, json!(css)).await? {
                break;
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "'{css}' never took the focus");
        }
        let keys = json!({"actions": [{"type": "key", "id": "keyboard", "actions": [
            {"type": "keyDown", "value": key}, {"type": "keyUp", "value": key},
        ]}]});
        self.cmd("POST", "/actions", keys).await?;
        self.cmd("DELETE", "/actions", Value::Null).await.map(|_| ())
    }

    pub async fn clear(&self, css: &str) -> anyhow::Result<()> {
        self.act(css, "clear", json!({})).await
    }

    /// The visible text of the first element matching `css` (empty when there is none), read in
    /// one step so a redraw cannot come between finding and reading.
    pub async fn text(&self, css: &str) -> anyhow::Result<String> {
        let script = "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';";
        Ok(self.eval(script, json!([css])).await?.as_str().unwrap_or_default().to_string())
    }

    /// Waits until the text of `css` satisfies `want`; returns that text.
    /// Each time the text is not yet what is wanted, waits in the page for it to change.
    pub async fn wait_text(&self, css: &str, what: &str, want: impl Fn(&str) -> bool) -> anyhow::Result<String> {
        let deadline = tokio::time::Instant::now() + HANG_GUARD;
        let changed = "(() => { const e = document.querySelector(arg[0]); \
                       return (e ? e.innerText : '') !== arg[1]; })()";
        loop {
            let t = self.text(css).await?;
            if want(&t) {
                return Ok(t);
            }
            let moved = self.until(changed, json!([css, t])).await;
            anyhow::ensure!(
                moved.is_ok() && tokio::time::Instant::now() < deadline,
                "'{css}' never showed {what}; it shows {t:?}\n{}",
                self.page_text().await
            );
        }
    }

    /// The whole page's text, for failure messages.
    pub async fn page_text(&self) -> String {
        self.eval("return document.body ? document.body.innerText : ''", json!([]))
            .await
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }

    /// Saves a PNG of the viewport as `name` in the screenshot directory.
    pub async fn screenshot(&self, name: &str) -> anyhow::Result<PathBuf> {
        let data = self.cmd("GET", "/screenshot", Value::Null).await?;
        let png = base64::engine::general_purpose::STANDARD.decode(data.as_str().context("no screenshot data")?)?;
        let path = self.shots.join(name);
        std::fs::write(&path, png)?;
        Ok(path)
    }
}

impl Drop for Browser {
    /// Ends the session, then stops the driver and Chromium. Blocking, since it also runs while
    /// a failed test unwinds.
    fn drop(&mut self) {
        use std::io::{Read, Write};
        let authority = self.base.trim_start_matches("http://").to_string();
        let request = format!(
            "DELETE /session/{} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            self.session
        );
        if let Ok(mut s) = std::net::TcpStream::connect(&authority) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(20)));
            if s.write_all(request.as_bytes()).is_ok() {
                let _ = s.read_to_end(&mut Vec::new());
            }
        }
        stop(&mut self.driver);
        stop(&mut self.chromium);
    }
}

async fn call(base: &str, method: &str, path: &str, body: &Value) -> anyhow::Result<Value> {
    let text = if body.is_null() { String::new() } else { body.to_string() };
    let headers: &[(&str, &str)] = if body.is_null() { &[] } else { &[("Content-Type", "application/json")] };
    let reply = http::request(method, &format!("{base}{path}"), headers, &text).await?;
    let v: Value = serde_json::from_str(&reply.body).with_context(|| format!("webdriver {path}: {}", reply.body))?;
    if reply.status != 200 {
        anyhow::bail!("webdriver {method} {path}: {} {}", reply.status, v["value"]["message"]);
    }
    Ok(v["value"].clone())
}
