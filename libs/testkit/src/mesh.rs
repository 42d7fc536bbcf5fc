//! The Warden mesh as separate processes: ledger, policy, demo tool host, planner and one or
//! more executors, each a real binary on a free port, wired by the endpoints they announce.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use warden_grpc::auth::Ch;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_proto::v1::policy_client::PolicyClient;
use warden_proto::v1::runs_client::RunsClient;
use warden_proto::v1::tool_host_client::ToolHostClient;

use crate::procs::spawn_tied;

#[derive(Clone, Debug)]
pub struct MeshOptions {
    /// `sqlite://…` or `postgres://…`; empty means a SQLite file in the mesh's directory.
    pub database_url: String,
    /// Empty means in-process leases (one executor only).
    pub redis_url: String,
    /// `(tenant, allowed tool patterns)`.
    pub tenants: Vec<(String, Vec<String>)>,
    pub max_steps: usize,
    pub lease_ttl_ms: u64,
    pub sweep_interval_ms: u64,
    /// Executor replicas; 0 for tests that drive the ledger, policy and tools directly.
    pub executors: usize,
    /// Extra TOML lines for the `[policy]` section (keys, then `[[policy.…]]` tables).
    pub policy_extra: String,
    /// Appended to the `[tools]` section (e.g. `timeout_secs = { sleep = 1 }`).
    pub tools_extra: String,
    /// Appended to the `[executor]` section (e.g. `retry_backoff_base_ms = 10`).
    pub executor_extra: String,
    /// More TOML lines for the `[planner]` section (e.g. `[planner.model]` after it).
    pub planner_extra: String,
    /// The executors' `outage_grace_ms` (short by default, so tests of outages end quickly).
    pub outage_grace_ms: u64,
    /// `(tenant, extra TOML lines for its [policy.tenants.<tenant>] section)`.
    pub tenant_extra: Vec<(String, String)>,
    /// `(tenant, calls per minute)`.
    pub rate_rules: Vec<(String, u64)>,
    /// `(tenant, max calls per run, max cost per run)`.
    pub budget_rules: Vec<(String, u64, f64)>,
    /// `(tenant, tools needing approval, approvers)`.
    pub approval_rules: Vec<(String, Vec<String>, Vec<String>)>,
    /// Cedar policy directory for the policy service (empty: allowlists decide).
    pub policy_dir: String,
    /// Policy state database; empty means SQLite in the mesh's directory.
    pub policy_database_url: String,
    /// `(token, tenant or "*")`; empty: authentication off.
    pub auth_tokens: Vec<(String, String)>,
    /// The `*` token services present to each other (and the test's default client token).
    pub service_token: String,
    /// Tool hosts beyond the demo host (e.g. `warden-mcp`), served to the planner and the
    /// executors after it.
    pub extra_hosts: Vec<ExtraHost>,
    /// Environment every service process gets (e.g. `OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub env: Vec<(String, String)>,
    /// The services call each other over Unix domain sockets in the mesh's directory (each
    /// also listens on TCP, where the test's own clients reach it) instead of loopback TCP.
    pub unix_sockets: bool,
}

/// A tool host process beyond the demo host, started after the ledger and the policy.
#[derive(Clone, Debug)]
pub struct ExtraHost {
    pub name: &'static str,
    /// A binary of the workspace (next to the test binary).
    pub binary: String,
    /// Its environment (after the mesh's `WARDEN_CONFIG`, which it may replace). It must bind
    /// through a `…__LISTEN` variable set to `127.0.0.1:0`, and announce like every service.
    pub env: Vec<(String, String)>,
    /// The variables that tell it the policy's and the ledger's endpoints.
    pub policy_endpoint_var: String,
    pub ledger_endpoint_var: String,
}

impl Default for MeshOptions {
    fn default() -> Self {
        MeshOptions {
            database_url: String::new(),
            redis_url: String::new(),
            tenants: vec![(
                "acme".into(),
                vec!["echo".into(), "text.upper".into(), "kv.*".into(), "email.send".into(), "fail".into()],
            )],
            max_steps: 10,
            lease_ttl_ms: 2_000,
            sweep_interval_ms: 500,
            executors: 1,
            policy_database_url: String::new(),
            policy_dir: String::new(),
            approval_rules: Vec::new(),
            budget_rules: Vec::new(),
            rate_rules: Vec::new(),
            tenant_extra: Vec::new(),
            policy_extra: String::new(),
            tools_extra: String::new(),
            executor_extra: String::new(),
            planner_extra: String::new(),
            outage_grace_ms: 2_000,
            auth_tokens: Vec::new(),
            service_token: String::new(),
            extra_hosts: Vec::new(),
            env: Vec::new(),
            unix_sockets: false,
        }
    }
}

/// The directory of the workspace's built binaries (next to the running test binary).
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().context("test binary has no directory")?.to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    Ok(dir)
}

fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let p = bin_dir()?.join(name);
    anyhow::ensure!(p.is_file(), "{} is not built: run `cargo build --workspace --bins` first", p.display());
    Ok(p)
}

/// One service process.
pub struct ServiceProcess {
    pub name: &'static str,
    pub endpoint: String,
    /// Its Prometheus endpoint (`http://…/metrics`), as announced.
    pub metrics_url: String,
    bin: PathBuf,
    env: Vec<(String, String)>,
    child: Option<Child>,
    pub log: PathBuf,
}

impl ServiceProcess {
    fn start(
        name: &'static str,
        bin: PathBuf,
        env: Vec<(String, String)>,
        log: PathBuf,
    ) -> anyhow::Result<ServiceProcess> {
        let mut p =
            ServiceProcess { name, endpoint: String::new(), metrics_url: String::new(), bin, env, child: None, log };
        p.spawn()?;
        Ok(p)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut cmd = Command::new(&self.bin);
        cmd.envs(self.env.iter().cloned()).stdout(Stdio::piped()).stderr(log).stdin(Stdio::null());
        let mut child = spawn_tied(cmd, libc::SIGKILL).with_context(|| format!("spawning {}", self.bin.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let mut metrics = String::new();
            for line in lines.by_ref().map_while(Result::ok) {
                // The metrics endpoint is announced first, the gRPC address last.
                if let Some(rest) = line.strip_prefix("WARDEN_METRICS ") {
                    metrics = rest.split_whitespace().nth(1).unwrap_or_default().to_string();
                }
                if let Some(rest) = line.strip_prefix("WARDEN_LISTENING ") {
                    let _ = tx.send((rest.split_whitespace().nth(1).unwrap_or_default().to_string(), metrics));
                    break;
                }
            }
            // Keep draining so the child never blocks on a full pipe.
            for _ in lines {}
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok((endpoint, metrics)) => {
                self.endpoint = endpoint;
                self.metrics_url = metrics;
                self.child = Some(child);
                Ok(())
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                anyhow::bail!("{} did not start; its log:\n{log}", self.name)
            }
        }
    }

    /// The value of `key` in the process's environment as the mesh set it (last setting wins).
    pub fn env_var(&self, key: &str) -> Option<&str> {
        self.env.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Changes an environment variable for the next (re)start.
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_string(), value.to_string()));
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Asks the process to stop (SIGTERM) and waits for it to exit (at most 30 s, then kills
    /// it): a clean shutdown.
    pub fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            #[allow(unsafe_code)]
            // SAFETY: kill(2) on the pid of a child we own and have not reaped yet.
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the process at once (SIGKILL): a crash, not a shutdown.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the process again on the same address, so clients reconnect to it.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let addr = self.endpoint.trim_start_matches("http://").to_string();
        let key = self.env.iter().position(|(k, _)| k.ends_with("__LISTEN")).context("no listen variable")?;
        self.env[key].1 = addr;
        let mut last = None;
        for _ in 0..50 {
            match self.spawn() {
                Ok(()) => return Ok(()),
                // The old socket may linger for a moment.
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("restart failed")))
    }

    /// A channel presenting no token (authentication off, or probing that it is on).
    pub fn channel(&self) -> Ch {
        warden_grpc::channel(&self.endpoint).unwrap_or_else(|e| panic!("bad endpoint {}: {e}", self.endpoint))
    }

    /// A channel presenting `token` (none when empty).
    pub fn channel_as(&self, token: &str) -> Ch {
        if token.is_empty() {
            return self.channel();
        }
        warden_grpc::channel_with_token(&self.endpoint, token)
            .unwrap_or_else(|e| panic!("bad endpoint {}: {e}", self.endpoint))
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

pub struct Mesh {
    pub dir: tempfile::TempDir,
    /// Token the test's clients present by default.
    pub token: String,
    pub database_url: String,
    pub ledger: ServiceProcess,
    pub policy: ServiceProcess,
    pub tools: ServiceProcess,
    /// The [`MeshOptions::extra_hosts`], in order.
    pub extra_hosts: Vec<ServiceProcess>,
    pub planner: ServiceProcess,
    pub executors: Vec<ServiceProcess>,
}

fn toml_config(opts: &MeshOptions, dir: &Path, database_url: &str) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "[ledger]\ndatabase_url = \"{database_url}\"\nkey_file = \"{}\"\n\n",
        dir.join("ledger.key").display()
    ));
    let policy_db = if opts.policy_database_url.is_empty() {
        format!("sqlite://{}", dir.join("policy.db").display())
    } else {
        opts.policy_database_url.clone()
    };
    s.push_str(&format!(
        "[policy]\nkey_file = \"{}\"\ndatabase_url = \"{policy_db}\"\npolicy_dir = \"{}\"\nreload_interval_ms = 200\nredis_url = \"{}\"\n{}\n\n",
        dir.join("policy.key").display(),
        opts.policy_dir,
        opts.redis_url,
        opts.policy_extra
    ));
    for (tenant, tools) in &opts.tenants {
        let list: Vec<String> = tools.iter().map(|t| format!("\"{t}\"")).collect();
        let quoted = |v: &Vec<String>| v.iter().map(|t| format!("\"{t}\"")).collect::<Vec<_>>().join(", ");
        let (gated, approvers) = opts
            .approval_rules
            .iter()
            .find(|(t, _, _)| t == tenant)
            .map(|(_, g, a)| (quoted(g), quoted(a)))
            .unwrap_or_default();
        s.push_str(&format!(
            "[policy.tenants.{tenant}]\nallow_tools = [{}]\nrequire_approval = [{gated}]\napprovers = [{approvers}]\n",
            list.join(", ")
        ));
        if let Some((_, calls, cost)) = opts.budget_rules.iter().find(|(t, _, _)| t == tenant) {
            s.push_str(&format!("max_calls_per_run = {calls}\nmax_cost_per_run = {cost:?}\n"));
        }
        if let Some((_, per_minute)) = opts.rate_rules.iter().find(|(t, _)| t == tenant) {
            s.push_str(&format!("rate_limit_per_minute = {per_minute}\n"));
        }
        for (_, lines) in opts.tenant_extra.iter().filter(|(t, _)| t == tenant) {
            s.push_str(lines);
            s.push('\n');
        }
        s.push('\n');
    }
    s.push_str(&format!("[planner]\nmax_steps = {}\n{}\n\n", opts.max_steps, opts.planner_extra));
    s.push_str(&format!(
        "[executor]\nredis_url = \"{}\"\nlease_ttl_ms = {}\nsweep_interval_ms = {}\noutage_grace_ms = {}\n{}\n\n",
        opts.redis_url, opts.lease_ttl_ms, opts.sweep_interval_ms, opts.outage_grace_ms, opts.executor_extra
    ));
    s.push_str(&format!("[tools]\noutbox_path = \"{}\"\n{}\n\n", dir.join("outbox.jsonl").display(), opts.tools_extra));
    s.push_str(&format!("[auth]\ntoken = \"{}\"\n[auth.tokens]\n", opts.service_token));
    for (token, scope) in &opts.auth_tokens {
        s.push_str(&format!("\"{token}\" = \"{scope}\"\n"));
    }
    s
}

impl Mesh {
    pub async fn start(opts: MeshOptions) -> anyhow::Result<Mesh> {
        tokio::task::spawn_blocking(move || Mesh::start_blocking(opts)).await?
    }

    fn start_blocking(opts: MeshOptions) -> anyhow::Result<Mesh> {
        let dir = tempfile::Builder::new().prefix("warden-mesh-").tempdir()?;
        let database_url = if opts.database_url.is_empty() {
            format!("sqlite://{}", dir.path().join("ledger.db").display())
        } else {
            opts.database_url.clone()
        };
        let config = dir.path().join("warden.toml");
        std::fs::write(&config, toml_config(&opts, dir.path(), &database_url))?;
        let base = |extra: &[(&str, &str)]| {
            let mut env = vec![
                ("WARDEN_CONFIG".to_string(), config.display().to_string()),
                // Every process serves its metrics on a free port, announced on stdout.
                ("WARDEN_METRICS_LISTEN".to_string(), "127.0.0.1:0".to_string()),
                // One worker each, as `warden bench` runs the production shape on a small
                // machine: the services run on the current-thread runtime, which the tests
                // then hold to the contract too (the SDK's tests run them multi-threaded).
                ("TOKIO_WORKER_THREADS".to_string(), "1".to_string()),
            ];
            env.extend(opts.env.iter().cloned());
            env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            env
        };
        let log = |n: &str| dir.path().join(format!("{n}.log"));
        // With Unix sockets, each service also listens on `<dir>/<name>.sock`, known before it
        // starts, and the services name each other by it; otherwise by TCP address.
        let socket = |n: &str| dir.path().join(format!("{n}.sock")).display().to_string();
        let listen_unix = |n: &str| if opts.unix_sockets { socket(n) } else { String::new() };
        let peer = |n: &str, tcp: &str| if opts.unix_sockets { format!("unix:{}", socket(n)) } else { tcp.to_string() };
        // The ledger verifies decisions with the policy's keys and the policy records into the
        // ledger: the policy's address is chosen first so each can name the other. Another
        // process may take that free port before the policy binds it: then both start again on
        // another.
        // The planner's address is chosen now too: the policy asks it for the critic's reviews.
        let planner_addr = format!("127.0.0.1:{}", crate::procs::free_port()?);
        let (ledger, mut policy) = {
            let mut tries = 0;
            loop {
                tries += 1;
                let policy_addr = format!("127.0.0.1:{}", crate::procs::free_port()?);
                let mut ledger = ServiceProcess::start(
                    "ledger",
                    binary("warden-ledger")?,
                    base(&[
                        ("WARDEN_LEDGER__LISTEN", "127.0.0.1:0"),
                        ("WARDEN_LEDGER__LISTEN_UNIX", &listen_unix("ledger")),
                        ("WARDEN_LEDGER__POLICY_ENDPOINT", &peer("policy", &format!("http://{policy_addr}"))),
                    ]),
                    log("ledger"),
                )?;
                let policy = ServiceProcess::start(
                    "policy",
                    binary("warden-policy")?,
                    base(&[
                        ("WARDEN_POLICY__LISTEN", &policy_addr),
                        ("WARDEN_POLICY__LISTEN_UNIX", &listen_unix("policy")),
                        ("WARDEN_POLICY__LEDGER_ENDPOINT", &peer("ledger", &ledger.endpoint)),
                        ("WARDEN_POLICY__PLANNER_ENDPOINT", &peer("planner", &format!("http://{planner_addr}"))),
                    ]),
                    log("policy"),
                );
                match policy {
                    Ok(policy) => break (ledger, policy),
                    Err(e) if tries < 5 && e.to_string().contains("Address already in use") => ledger.kill(),
                    Err(e) => return Err(e),
                }
            }
        };
        let tools = ServiceProcess::start(
            "tools",
            binary("warden-tools")?,
            base(&[
                ("WARDEN_TOOLS__LISTEN", "127.0.0.1:0"),
                ("WARDEN_TOOLS__LISTEN_UNIX", &listen_unix("tools")),
                ("WARDEN_TOOLS__POLICY_ENDPOINT", &peer("policy", &policy.endpoint)),
                ("WARDEN_TOOLS__LEDGER_ENDPOINT", &peer("ledger", &ledger.endpoint)),
            ]),
            log("tools"),
        )?;
        let mut extra_hosts = Vec::new();
        for h in &opts.extra_hosts {
            let mut env = base(&[]);
            env.extend(h.env.iter().cloned());
            env.push((h.policy_endpoint_var.clone(), policy.endpoint.clone()));
            env.push((h.ledger_endpoint_var.clone(), ledger.endpoint.clone()));
            extra_hosts.push(ServiceProcess::start(h.name, binary(&h.binary)?, env, log(h.name))?);
        }
        let endpoints: Vec<String> = std::iter::once(peer("tools", &tools.endpoint))
            .chain(extra_hosts.iter().map(|p| p.endpoint.clone()))
            .map(|e| format!("\"{e}\""))
            .collect();
        let hosts = format!("[{}]", endpoints.join(", "));
        // Another process may have taken the planner's port since it was chosen: then the
        // planner takes another and the policy is started again knowing it.
        let mut planner_addr = planner_addr;
        let mut tries = 0;
        let planner = loop {
            tries += 1;
            let started = ServiceProcess::start(
                "planner",
                binary("warden-planner")?,
                base(&[
                    ("WARDEN_PLANNER__LISTEN", &planner_addr),
                    ("WARDEN_PLANNER__LISTEN_UNIX", &listen_unix("planner")),
                    ("WARDEN_PLANNER__TOOL_HOSTS", &hosts),
                    ("WARDEN_PLANNER__POLICY_ENDPOINT", &peer("policy", &policy.endpoint)),
                    ("WARDEN_PLANNER__LEDGER_ENDPOINT", &peer("ledger", &ledger.endpoint)),
                ]),
                log("planner"),
            );
            match started {
                Ok(planner) => break planner,
                Err(e) if tries < 5 && e.to_string().contains("Address already in use") => {
                    planner_addr = format!("127.0.0.1:{}", crate::procs::free_port()?);
                    policy.set_env(
                        "WARDEN_POLICY__PLANNER_ENDPOINT",
                        &peer("planner", &format!("http://{planner_addr}")),
                    );
                    policy.restart()?;
                }
                Err(e) => return Err(e),
            }
        };
        let mut executors = Vec::new();
        for i in 0..opts.executors {
            let id = format!("executor-{i}");
            executors.push(ServiceProcess::start(
                "executor",
                binary("warden-executor")?,
                base(&[
                    ("WARDEN_EXECUTOR__LISTEN", "127.0.0.1:0"),
                    ("WARDEN_EXECUTOR__LEDGER_ENDPOINT", &peer("ledger", &ledger.endpoint)),
                    ("WARDEN_EXECUTOR__POLICY_ENDPOINT", &peer("policy", &policy.endpoint)),
                    ("WARDEN_EXECUTOR__PLANNER_ENDPOINT", &peer("planner", &planner.endpoint)),
                    ("WARDEN_EXECUTOR__TOOL_HOSTS", &hosts),
                    ("WARDEN_EXECUTOR__EXECUTOR_ID", &id),
                ]),
                log(&id),
            )?);
        }
        Ok(Mesh {
            dir,
            token: opts.service_token.clone(),
            database_url,
            ledger,
            policy,
            tools,
            extra_hosts,
            planner,
            executors,
        })
    }

    /// Another ledger process on the same database and signing key (a replica, as behind a
    /// load balancer), on a port of its own.
    pub fn another_ledger(&self) -> anyhow::Result<ServiceProcess> {
        let mut env = self.ledger.env.clone();
        env.retain(|(k, _)| k != "WARDEN_LEDGER__LISTEN" && k != "WARDEN_LEDGER__LISTEN_UNIX");
        env.push(("WARDEN_LEDGER__LISTEN".into(), "127.0.0.1:0".into()));
        let log = self.ledger.log.with_file_name("ledger-replica.log");
        ServiceProcess::start("ledger-replica", self.ledger.bin.clone(), env, log)
    }

    /// The front door of the first executor that is still running.
    pub fn runs(&self) -> RunsClient<Ch> {
        self.runs_as(&self.token)
    }

    /// The front door of the first executor that is still running, presenting `token`.
    pub fn runs_as(&self, token: &str) -> RunsClient<Ch> {
        let live = self.executors.iter().find(|e| e.is_running()).expect("no executor is running");
        RunsClient::new(live.channel_as(token))
    }

    pub fn ledger(&self) -> LedgerClient<Ch> {
        self.ledger_as(&self.token)
    }

    pub fn ledger_as(&self, token: &str) -> LedgerClient<Ch> {
        LedgerClient::new(self.ledger.channel_as(token))
    }

    pub fn policy(&self) -> PolicyClient<Ch> {
        PolicyClient::new(self.policy.channel_as(&self.token))
    }

    pub fn tool_host(&self) -> ToolHostClient<Ch> {
        ToolHostClient::new(self.tools.channel())
    }

    /// Lines of the demo host's email outbox.
    pub fn outbox(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.path().join("outbox.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Every service's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut all = String::new();
        let services = [&self.ledger, &self.policy, &self.tools, &self.planner].into_iter();
        for p in services.chain(self.extra_hosts.iter()).chain(self.executors.iter()) {
            all.push_str(&format!("--- {} ---\n{}\n", p.name, std::fs::read_to_string(&p.log).unwrap_or_default()));
        }
        all
    }
}
