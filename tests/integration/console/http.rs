//! A small HTTP/1.1 client for the tests: one request per connection (`Connection: close`),
//! enough for the console's API and for chromedriver's WebDriver endpoint.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// `method url` with `headers` and `body`; the bound only guards against a hang.
pub async fn request(method: &str, url: &str, headers: &[(&str, &str)], body: &str) -> anyhow::Result<Reply> {
    let rest = url.strip_prefix("http://").ok_or_else(|| anyhow::anyhow!("not an http url: {url}"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    // A test may name another host (to see it refused); otherwise the one dialled.
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {authority}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(authority).await?;
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        // Read until the body is complete: some servers (chromedriver) keep the connection
        // open whatever `Connection: close` asks.
        let mut raw = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            if complete(&raw) {
                break;
            }
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            raw.extend_from_slice(&buf[..n]);
        }
        anyhow::Ok(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(120), exchange).await??;
    parse(&raw)
}

/// Whether `raw` holds a whole response: headers, then `Content-Length` bytes or the last chunk.
fn complete(raw: &[u8]) -> bool {
    let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let body = &raw[split + 4..];
    if let Some(len) =
        head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse::<usize>().ok())
    {
        return body.len() >= len;
    }
    if head.contains("transfer-encoding: chunked") {
        return body.ends_with(b"0\r\n\r\n");
    }
    false
}

fn parse(raw: &[u8]) -> anyhow::Result<Reply> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| anyhow::anyhow!("no header end"))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers: Vec<(String, String)> =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_string(), v.trim().to_string())).collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked =
        headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked"));
    if chunked {
        body = dechunk(&body)?;
    }
    Ok(Reply { status, headers, body: String::from_utf8_lossy(&body).to_string() })
}

fn dechunk(mut rest: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").ok_or_else(|| anyhow::anyhow!("bad chunk"))?;
        let size_text = String::from_utf8_lossy(&rest[..eol]).to_string();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("0").trim(), 16)?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        anyhow::ensure!(rest.len() >= size + 2, "short chunk");
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}
