//! Throwaway Redis and PostgreSQL servers (or the ones `REDIS_URL` / `DATABASE_URL` name).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::Connection;

use crate::procs::{apt_install, find_binary, free_port, is_root, spawn_tied};

pub struct Redis {
    pub url: String,
    _child: Option<Mutex<Child>>,
    /// The binary and port of a server this process started (to start it again).
    launch: Option<(PathBuf, u16)>,
}

pub struct Postgres {
    /// A URL of the server's maintenance database (used to create test databases).
    pub admin_url: String,
    /// Where a throwaway cluster lives (None for `DATABASE_URL`).
    pub data_dir: Option<PathBuf>,
    _child: Option<Mutex<Child>>,
    launch: Option<Launch>,
}

/// The process-wide Redis (started on first use).
pub fn redis() -> &'static Redis {
    static R: OnceLock<Redis> = OnceLock::new();
    R.get_or_init(|| start_redis().unwrap_or_else(|e| panic!("no Redis for the tests: {e:#}")))
}

/// The process-wide PostgreSQL (started on first use, tuned for tests: no fsync).
pub fn postgres() -> &'static Postgres {
    static P: OnceLock<Postgres> = OnceLock::new();
    P.get_or_init(|| start_postgres(true).unwrap_or_else(|e| panic!("no PostgreSQL for the tests: {e:#}")))
}

pub fn start_redis() -> anyhow::Result<Redis> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        return Ok(Redis { url, _child: None, launch: None });
    }
    start_private_redis()
}

/// Always a Redis of our own (never `REDIS_URL`): for tests that kill and restart it.
pub fn start_private_redis() -> anyhow::Result<Redis> {
    let bin = match find_binary("redis-server", &[]) {
        Some(b) => b,
        None => {
            apt_install(&["redis-server"])?;
            find_binary("redis-server", &[]).context("redis-server still missing after apt-get install")?
        }
    };
    let mut last = None;
    for _ in 0..5 {
        let port = free_port()?;
        match spawn_redis(&bin, port) {
            Ok(child) => {
                return Ok(Redis {
                    url: format!("redis://127.0.0.1:{port}"),
                    _child: Some(Mutex::new(child)),
                    launch: Some((bin, port)),
                });
            }
            Err(e) => last = Some(e),
        }
    }
    anyhow::bail!("redis-server did not start: {:#}", last.unwrap_or_else(|| anyhow::anyhow!("timed out")))
}

/// A `redis-server` on `port` that keeps nothing on disk, once it answers.
fn spawn_redis(bin: &Path, port: u16) -> anyhow::Result<Child> {
    let mut cmd = Command::new(bin);
    cmd.args([
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--protected-mode",
        "no",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let mut child = spawn_tied(cmd, libc::SIGTERM)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        // Alive after the ping: the answer came from our server, not one that won the port.
        if redis_ping(port) && matches!(child.try_wait(), Ok(None)) {
            return Ok(child);
        }
        if let Ok(Some(status)) = child.try_wait() {
            anyhow::bail!("redis-server exited with {status}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    anyhow::bail!("redis-server did not answer on port {port}")
}

impl Redis {
    /// The server's process, when this process started it.
    pub fn pid(&self) -> Option<u32> {
        self._child.as_ref().map(|c| c.lock().unwrap_or_else(|p| p.into_inner()).id())
    }

    /// Kills the server (SIGKILL: every key is gone, as Redis keeps nothing on disk here),
    /// leaves it down for `down`, and starts it again on the same port. Only for a server
    /// this process started.
    pub fn restart(&self, down: Duration) -> anyhow::Result<()> {
        let (Some(child), Some((bin, port))) = (&self._child, &self.launch) else {
            anyhow::bail!("only a private Redis can be restarted");
        };
        let mut child = child.lock().unwrap_or_else(|p| p.into_inner());
        let _ = child.kill();
        let _ = child.wait();
        std::thread::sleep(down);
        *child = spawn_redis(bin, *port)?;
        Ok(())
    }
}

fn redis_ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read(&mut buf).is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}

fn postgres_bindir() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> =
        std::fs::read_dir("/usr/lib/postgresql").ok()?.filter_map(|e| e.ok()).map(|e| e.path().join("bin")).collect();
    versions.sort_by_key(|p| {
        std::cmp::Reverse(
            p.parent()
                .and_then(|v| v.file_name())
                .and_then(|v| v.to_str())
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(0),
        )
    });
    let initdb = find_binary("initdb", &versions)?;
    let dir = initdb.canonicalize().ok()?.parent()?.to_path_buf();
    dir.join("postgres").is_file().then_some(dir)
}

fn postgres_user() -> anyhow::Result<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    let line = passwd
        .lines()
        .find(|l| l.starts_with("postgres:"))
        .context("there is no 'postgres' user to run PostgreSQL as")?;
    let f: Vec<&str> = line.split(':').collect();
    Ok((f[2].parse()?, f[3].parse()?))
}

/// Removes clusters left by test processes that no longer exist.
fn remove_stale_clusters() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(pid) =
            name.strip_prefix("warden-pg-").and_then(|r| r.split('-').next()).and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Starts a throwaway PostgreSQL cluster (or returns `DATABASE_URL`'s server). `fast`
/// turns fsync off, for tests; benchmarks keep PostgreSQL's durable defaults.
pub fn start_postgres(fast: bool) -> anyhow::Result<Postgres> {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        return Ok(Postgres { admin_url: url, data_dir: None, _child: None, launch: None });
    }
    start_private_postgres(fast)
}

/// What it takes to start (and restart) one cluster.
struct Launch {
    bindir: PathBuf,
    base: PathBuf,
    owner: Option<(u32, u32)>,
    fast: bool,
    port: u16,
}

impl Launch {
    fn as_owner(&self, cmd: &mut Command) {
        if let Some((uid, gid)) = self.owner {
            std::os::unix::process::CommandExt::uid(cmd, uid);
            std::os::unix::process::CommandExt::gid(cmd, gid);
        }
    }

    fn spawn(&self) -> anyhow::Result<Child> {
        let log_path = self.base.join("postgres.log");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
        if let Some((uid, gid)) = self.owner {
            std::os::unix::fs::chown(&log_path, Some(uid), Some(gid))?;
        }
        let mut cmd = Command::new(self.bindir.join("postgres"));
        cmd.arg("-D").arg(self.base.join("data")).arg("-k").arg(&self.base).args([
            "-p",
            &self.port.to_string(),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "max_connections=400",
        ]);
        if self.fast {
            cmd.args(["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]);
        } else if self.bindir.join("../lib/pg_stat_statements.so").exists() {
            // Benchmarks count statements per step.
            cmd.args(["-c", "shared_preload_libraries=pg_stat_statements"]);
        }
        cmd.current_dir(&self.base).stdout(Stdio::null()).stderr(log);
        self.as_owner(&mut cmd);
        // SIGQUIT: immediate shutdown when the test process goes away.
        Ok(spawn_tied(cmd, libc::SIGQUIT)?)
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

/// Always a new cluster of our own (never `DATABASE_URL`): for tests that stop and start it.
pub fn start_private_postgres(fast: bool) -> anyhow::Result<Postgres> {
    let bindir = match postgres_bindir() {
        Some(d) => d,
        None => {
            apt_install(&["postgresql"])?;
            postgres_bindir().context("PostgreSQL binaries still missing after apt-get install")?
        }
    };
    remove_stale_clusters();
    let base = tempfile::Builder::new().prefix(&format!("warden-pg-{}-", std::process::id())).tempdir()?.keep();
    let owner = if is_root() { Some(postgres_user()?) } else { None };
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&base, Some(uid), Some(gid))?;
    }
    let mut launch = Launch { bindir, base: base.clone(), owner, fast, port: 0 };
    let mut initdb = Command::new(launch.bindir.join("initdb"));
    initdb
        .arg("-D")
        .arg(base.join("data"))
        .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
        .arg(format!("--locale={}", cluster_locale()?))
        .current_dir(&base);
    launch.as_owner(&mut initdb);
    let out = initdb.output().context("running initdb")?;
    anyhow::ensure!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
    for _ in 0..5 {
        launch.port = free_port()?;
        let mut child = launch.spawn()?;
        let admin_url = launch.url();
        if wait_for_postgres(&admin_url, &mut child)? {
            return Ok(Postgres {
                admin_url,
                data_dir: Some(base),
                _child: Some(Mutex::new(child)),
                launch: Some(launch),
            });
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    let log = std::fs::read_to_string(base.join("postgres.log")).unwrap_or_default();
    anyhow::bail!("postgres did not start:\n{log}")
}

/// The locale a cluster started here is created with: `C` unless `WARDEN_TEST_PG_LOCALE`
/// names another (`en_US.UTF-8`, the default of most packaged clusters, to measure what a
/// linguistic locale costs; the locale must be installed, see `locale -a`).
fn cluster_locale() -> anyhow::Result<String> {
    let locale = std::env::var("WARDEN_TEST_PG_LOCALE").unwrap_or_default();
    if locale.is_empty() {
        return Ok("C".into());
    }
    anyhow::ensure!(
        locale.len() <= 64 && locale.chars().all(|c| c.is_ascii_alphanumeric() || "._@-".contains(c)),
        "WARDEN_TEST_PG_LOCALE must be a locale name such as en_US.UTF-8, not {locale:?}"
    );
    Ok(locale)
}

fn wait_for_postgres(url: &str, child: &mut Child) -> anyhow::Result<bool> {
    let url = url.to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return Ok(false);
        }
        let u = url.clone();
        let ok = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            rt.block_on(async { sqlx::PgConnection::connect(&u).await.ok().map(|_| ()) })
        })
        .join()
        .ok()
        .flatten()
        .is_some();
        if ok && matches!(child.try_wait(), Ok(None)) {
            return Ok(true);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(false)
}

/// `url` with its database name replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (url, String::new()),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_part = match base[scheme_end..].find('/') {
        Some(i) => &base[..scheme_end + i],
        None => base,
    };
    format!("{host_part}/{db}{query}")
}

impl Postgres {
    /// Stops the server (fast shutdown: clients are disconnected, as in a real restart) and
    /// starts it again on the same port and data. Only for clusters this process started.
    pub fn restart(&self) -> anyhow::Result<()> {
        let (Some(child), Some(launch)) = (&self._child, &self.launch) else {
            anyhow::bail!("only a private cluster can be restarted");
        };
        let mut child = child.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGINT);
        }
        let _ = child.wait();
        let mut fresh = launch.spawn()?;
        anyhow::ensure!(wait_for_postgres(&launch.url(), &mut fresh)?, "postgres did not come back");
        *child = fresh;
        Ok(())
    }

    /// Creates an empty database for one test and returns its URL.
    /// The postmaster's process id (None for `DATABASE_URL`): its children are the backends.
    pub fn pid(&self) -> Option<u32> {
        self._child.as_ref().map(|c| c.lock().unwrap_or_else(|p| p.into_inner()).id())
    }

    pub async fn create_database(&self) -> anyhow::Result<String> {
        let name = format!("warden_{}", uuid_simple());
        let mut conn = sqlx::PgConnection::connect(&self.admin_url).await.context("connecting to PostgreSQL")?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.context("CREATE DATABASE")?;
        Ok(with_database(&self.admin_url, &name))
    }
}

fn uuid_simple() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
    format!("{}_{}_{}", std::process::id(), t % 1_000_000_000_000, N.fetch_add(1, Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls() {
        assert_eq!(with_database("postgres://u@h:1/postgres", "x"), "postgres://u@h:1/x");
        assert_eq!(
            with_database("postgres://u@h:1/postgres?sslmode=disable", "x"),
            "postgres://u@h:1/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://u@h:1", "x"), "postgres://u@h:1/x");
    }
}
