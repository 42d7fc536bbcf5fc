//! Headless Chromium driven over W3C WebDriver (Debian's `chromium` and `chromium-driver`,
//! installed with apt-get when missing, as the harness installs Redis and PostgreSQL).
//!
//! Every wait polls the page for a condition under one overall deadline — never a fixed sleep.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Context;
use base64::Engine;
use serde_json::{Value, json};
use warden_testkit::procs::{apt_install, find_binary, free_port, spawn_tied};

use super::http;

/// How long one wait for the page may take at most: a guard against a hang, not a latency bound.
pub const DEADLINE: Duration = Duration::from_secs(45);
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
    driver: Child,
    base: String,
    session: String,
    _profile: tempfile::TempDir,
    shots: PathBuf,
}

impl Browser {
    /// A fresh headless Chromium (its own profile) at 1280×800; screenshots go to `shots`.
    pub async fn start(shots: &Path) -> anyhow::Result<Browser> {
        let (chromium, chromedriver) = binaries()?;
        let profile = tempfile::Builder::new().prefix("warden-chromium-").tempdir()?;
        let mut last = None;
        for _ in 0..5 {
            let port = free_port()?;
            let mut cmd = Command::new(&chromedriver);
            cmd.arg(format!("--port={port}")).stdout(Stdio::null()).stderr(Stdio::null()).stdin(Stdio::null());
            let mut driver = spawn_tied(cmd, libc::SIGKILL).context("starting chromedriver")?;
            let base = format!("http://127.0.0.1:{port}");
            let ready = warden_testkit::eventually(Duration::from_secs(20), || {
                let url = format!("{base}/status");
                async move {
                    let r = http::request("GET", &url, &[], "").await.ok()?;
                    r.json()["value"]["ready"].as_bool().filter(|r| *r)
                }
            })
            .await;
            if ready.is_none() || !matches!(driver.try_wait(), Ok(None)) {
                let _ = driver.kill();
                let _ = driver.wait();
                last = Some(anyhow::anyhow!("chromedriver did not become ready on port {port}"));
                continue;
            }
            let caps = json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": chromium.display().to_string(),
                    "args": [
                        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        "--disable-dev-shm-usage", "--window-size=1280,800",
                        format!("--user-data-dir={}", profile.path().display()),
                    ],
                },
            }}});
            let created = call(&base, "POST", "/session", &caps).await;
            match created {
                Ok(v) => {
                    let session = v["sessionId"].as_str().context("no session id")?.to_string();
                    std::fs::create_dir_all(shots)?;
                    let b = Browser { driver, base, session, _profile: profile, shots: shots.to_path_buf() };
                    b.cmd("POST", "/window/rect", json!({"width": 1280, "height": 800})).await?;
                    return Ok(b);
                }
                Err(e) => {
                    let _ = driver.kill();
                    let _ = driver.wait();
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("chromedriver did not start")))
    }

    async fn cmd(&self, method: &str, path: &str, body: Value) -> anyhow::Result<Value> {
        call(&self.base, method, &format!("/session/{}{path}", self.session), &body).await
    }

    pub async fn goto(&self, url: &str) -> anyhow::Result<()> {
        self.cmd("POST", "/url", json!({"url": url})).await.map(|_| ())
    }

    pub async fn resize(&self, width: u32, height: u32) -> anyhow::Result<()> {
        self.cmd("POST", "/window/rect", json!({"width": width, "height": height})).await.map(|_| ())
    }

    /// Runs `script` (a function body; `arguments` are `args`) in the page and returns its value.
    pub async fn eval(&self, script: &str, args: Value) -> anyhow::Result<Value> {
        self.cmd("POST", "/execute/sync", json!({"script": script, "args": args})).await
    }

    async fn find(&self, css: &str) -> anyhow::Result<Option<String>> {
        let found = self.cmd("POST", "/elements", json!({"using": "css selector", "value": css})).await?;
        Ok(found.as_array().and_then(|a| a.first()).and_then(|e| e[ELEMENT].as_str()).map(str::to_string))
    }

    /// Waits for an element matching `css` and returns its id.
    pub async fn element(&self, css: &str) -> anyhow::Result<String> {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            if let Some(id) = self.find(css).await? {
                return Ok(id);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "no element '{css}' appeared\n{}",
                self.page_text().await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn click(&self, css: &str) -> anyhow::Result<()> {
        let id = self.element(css).await?;
        self.cmd("POST", &format!("/element/{id}/click"), json!({})).await.map(|_| ())
    }

    /// Types `text` into the element (it gets the keyboard focus first, as a person's Tab would).
    pub async fn type_into(&self, css: &str, text: &str) -> anyhow::Result<()> {
        let id = self.element(css).await?;
        self.cmd("POST", &format!("/element/{id}/value"), json!({"text": text})).await.map(|_| ())
    }

    pub async fn clear(&self, css: &str) -> anyhow::Result<()> {
        let id = self.element(css).await?;
        self.cmd("POST", &format!("/element/{id}/clear"), json!({})).await.map(|_| ())
    }

    /// The visible text of the first element matching `css` (empty when there is none).
    pub async fn text(&self, css: &str) -> anyhow::Result<String> {
        match self.find(css).await? {
            Some(id) => Ok(self
                .cmd("GET", &format!("/element/{id}/text"), Value::Null)
                .await?
                .as_str()
                .unwrap_or_default()
                .to_string()),
            None => Ok(String::new()),
        }
    }

    /// Waits until the text of `css` satisfies `want`; returns that text.
    pub async fn wait_text(&self, css: &str, what: &str, want: impl Fn(&str) -> bool) -> anyhow::Result<String> {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let t = self.text(css).await?;
            if want(&t) {
                return Ok(t);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "'{css}' never showed {what}; it shows {t:?}\n{}",
                self.page_text().await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
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
    /// Ends the session first (chromedriver then closes its Chromium, which would outlive a
    /// killed driver), then stops the driver. Blocking, since it also runs while a failed test
    /// unwinds.
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
        let _ = self.driver.kill();
        let _ = self.driver.wait();
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
