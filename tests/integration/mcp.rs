//! MCP through Warden, against real MCP servers and a real MCP client:
//!
//! - `warden-mcp` in front of the reference filesystem server (`@modelcontextprotocol/server-
//!   filesystem`, npm) over stdio and a server written with the official `mcp` Python SDK over
//!   streamable HTTP: runs call their tools authorized, recorded and receipted; a call without
//!   both proofs, or from a tenant the server does not serve, reaches nothing.
//! - A misbehaving server (crashes, hangs, malformed JSON-RPC, a schema that is not JSON
//!   Schema): each call fails recorded with the reason and the host keeps serving.
//! - `warden mcp serve` driven by the official Python MCP client over stdio and streamable
//!   HTTP: governed tools listed, calls answered with their run's outcome, denials with rule
//!   and reason, approvals with the approval id, bearer tokens mapped to tenants.
//! - Reflection v1alpha, which grpcurl, grpcui, Postman and evans ask, next to v1.
//!
//! What is missing is installed once into `~/.cache/warden-test` (`WARDEN_TEST_CACHE`): a
//! virtualenv with the `mcp` package and the npm filesystem server (`apt-get` supplies
//! `python3-venv` or `npm` if the machine lacks them).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};
use tonic::Code;
use warden_proto::v1 as pb;
use warden_proto::v1::tool_host_client::ToolHostClient;
use warden_testkit::procs::{apt_install, find_binary, spawn_tied};
use warden_testkit::{ExtraHost, Mesh, MeshOptions};

use crate::*;

/// The versions the tests pin (the official Python SDK, the reference filesystem server).
const PY_MCP: &str = "mcp==2.3.0";
const NPM_FILESYSTEM: &str = "@modelcontextprotocol/server-filesystem@2026.8.31";

fn cache_dir() -> PathBuf {
    let dir = std::env::var_os("WARDEN_TEST_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into())).join(".cache/warden-test")
    });
    std::fs::create_dir_all(&dir).expect("test cache directory");
    dir
}

/// Runs `f` holding an exclusive lock shared with every other test process using the cache.
fn under_lock<T>(name: &str, f: impl FnOnce() -> T) -> T {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(cache_dir().join(format!("{name}.lock")))
        .expect("lock file");
    #[allow(unsafe_code)]
    // SAFETY: flock(2) on a descriptor this function owns; released when `file` closes.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(locked, 0, "cannot lock {name}");
    let out = f();
    drop(file);
    out
}

fn run_ok(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A Python with the official `mcp` SDK (a virtualenv of the test cache, made once).
fn mcp_python() -> &'static Path {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        under_lock("venv-mcp", || {
            let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
            let version = Command::new(&python)
                .args(["-c", "import sys; assert sys.version_info >= (3, 10); print('%d.%d' % sys.version_info[:2])"])
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .unwrap_or_else(|| {
                    apt_install(&["python3", "python3-venv"]).expect("install python3");
                    "3".into()
                });
            let venv = cache_dir().join(format!("venv-mcp-py{version}"));
            let py = venv.join("bin/python");
            let stamp = venv.join(".warden-stamp");
            if std::fs::read_to_string(&stamp).ok().as_deref() == Some(PY_MCP) && py.is_file() {
                return py;
            }
            eprintln!("mcp tests: installing {PY_MCP} into {}", venv.display());
            if !py.is_file()
                && !Command::new(&python).args(["-m", "venv"]).arg(&venv).status().is_ok_and(|s| s.success())
            {
                apt_install(&["python3-venv"]).expect("install python3-venv");
                run_ok(Command::new(&python).args(["-m", "venv"]).arg(&venv), "python3 -m venv");
            }
            run_ok(
                Command::new(&py).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", PY_MCP]),
                "pip install mcp",
            );
            std::fs::write(&stamp, PY_MCP).expect("stamp");
            py
        })
    })
}

/// The reference filesystem MCP server's entry point (installed from npm once) and `node`.
fn filesystem_server() -> &'static (PathBuf, PathBuf) {
    static FS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    FS.get_or_init(|| {
        under_lock("npm-mcp", || {
            if find_binary("npm", &[]).is_none() || find_binary("node", &[]).is_none() {
                apt_install(&["nodejs", "npm"]).expect("install node and npm");
            }
            let prefix = cache_dir().join("mcp-npm");
            let entry = prefix.join("node_modules/@modelcontextprotocol/server-filesystem/dist/index.js");
            let stamp = prefix.join(".warden-stamp");
            if !(entry.is_file() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(NPM_FILESYSTEM)) {
                eprintln!("mcp tests: installing {NPM_FILESYSTEM} into {}", prefix.display());
                std::fs::create_dir_all(&prefix).expect("npm prefix");
                run_ok(
                    Command::new("npm")
                        .args(["install", "--no-audit", "--no-fund", "--silent", "--prefix"])
                        .arg(&prefix)
                        .arg(NPM_FILESYSTEM),
                    "npm install",
                );
                std::fs::write(&stamp, NPM_FILESYSTEM).expect("stamp");
            }
            (find_binary("node", &[]).expect("node"), entry)
        })
    })
}

/// A fixture of `tests/integration/mcp/`.
fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("integration/mcp").join(name).display().to_string()
}

fn toml_list(items: &[String]) -> String {
    format!("[{}]", items.iter().map(|s| Value::String(s.clone()).to_string()).collect::<Vec<_>>().join(", "))
}

/// A mesh whose executors also use a `warden-mcp` host serving `servers` (TOML of
/// `[[mcp.servers]]` tables). Its config and state live in `dir`.
async fn mcp_mesh(mut opts: MeshOptions, dir: &Path, servers: &str) -> Mesh {
    let config = dir.join("mcp.toml");
    let text = format!(
        "[auth]\ntoken = \"{}\"\n\n[mcp]\nstate_path = \"{}\"\nlist_ttl_ms = 500\nconnect_timeout_ms = 30000\n\n{servers}",
        opts.service_token,
        dir.join("mcp.db").display()
    );
    std::fs::write(&config, text).expect("mcp config");
    opts.extra_hosts.push(ExtraHost {
        name: "mcp",
        binary: "warden-mcp".into(),
        env: vec![
            ("WARDEN_CONFIG".into(), config.display().to_string()),
            ("WARDEN_MCP__LISTEN".into(), "127.0.0.1:0".into()),
        ],
        policy_endpoint_var: "WARDEN_MCP__POLICY_ENDPOINT".into(),
        ledger_endpoint_var: "WARDEN_MCP__LEDGER_ENDPOINT".into(),
    });
    mesh_with(Backend::Sqlite, opts).await
}

fn mcp_host(mesh: &Mesh) -> ToolHostClient<warden_grpc::auth::Ch> {
    ToolHostClient::new(mesh.extra_hosts[0].channel())
}

/// Submits `plan` for `tenant` and waits for the run to settle.
async fn run_plan(mesh: &Mesh, tenant: &str, plan: &str) -> (String, pb::Run) {
    let id = submit(mesh, tenant, plan).await;
    let run = settled(mesh, tenant, &id).await;
    (id, run)
}

fn step<'a>(run: &'a pb::Run, id: &str) -> &'a pb::StepState {
    run.steps.iter().find(|s| s.id == id).unwrap_or_else(|| panic!("no step {id} in {run:?}"))
}

fn output(s: &pb::StepState) -> Value {
    serde_json::from_str(&s.output_json).unwrap_or_else(|e| panic!("step {} output {:?}: {e}", s.id, s.output_json))
}

/// The payload of the step's recorded failure (`tool_failed` or `step_failed`).
async fn failure_of(mesh: &Mesh, tenant: &str, run_id: &str, step_id: &str) -> Value {
    let evs = events(&mut mesh.ledger(), tenant, run_id).await;
    let failed = evs
        .iter()
        .find(|e| e.step_id == step_id && (e.event_type == "tool_failed" || e.event_type == "step_failed"))
        .unwrap_or_else(|| panic!("step {step_id} of {run_id} recorded no failure"));
    payload(failed)
}

/// Reflection v1alpha and v1 both list `service` on `process`.
async fn both_reflections_list(process: &warden_testkit::ServiceProcess, service: &str) {
    use tonic_reflection::pb::{v1, v1alpha};
    let mut alpha = v1alpha::server_reflection_client::ServerReflectionClient::new(process.channel());
    let ask = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1alpha::server_reflection_request::MessageRequest::ListServices(String::new())),
    };
    let mut answers = alpha.server_reflection_info(tokio_stream::iter([ask])).await.expect("v1alpha").into_inner();
    let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        answers.message().await.expect("answer").and_then(|r| r.message_response)
    else {
        panic!("{} answered v1alpha with no service list", process.name);
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.iter().any(|n| n == service), "{} lists {names:?} over v1alpha", process.name);
    let mut v1 = v1::server_reflection_client::ServerReflectionClient::new(process.channel());
    let ask = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(String::new())),
    };
    let mut answers = v1.server_reflection_info(tokio_stream::iter([ask])).await.expect("v1").into_inner();
    assert!(answers.message().await.expect("answer").is_some(), "{} answers v1 too", process.name);
}

/// The reference filesystem server over stdio: a run writes a file and reads it back through
/// Warden; each call authorized, recorded and receipted. Its annotations became effect classes.
/// A tenant the server does not serve reaches nothing, even with policy's allow; a call without
/// both proofs reaches nothing either. Every server also answers reflection v1alpha.
#[tokio::test]
async fn an_mcp_server_over_stdio_runs_calls_authorized_recorded_and_receipted() {
    let (node, entry) = filesystem_server().clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).expect("files dir");
    let files = files.canonicalize().expect("canonical files dir");
    let servers = format!(
        "[[mcp.servers]]\nname = \"fs\"\ncommand = {}\ntenants = [\"acme\"]\n",
        toml_list(&[node.display().to_string(), entry.display().to_string(), files.display().to_string()])
    );
    let opts = MeshOptions {
        tenants: vec![("acme".into(), vec!["mcp.*".into()]), ("globex".into(), vec!["mcp.*".into()])],
        ..MeshOptions::default()
    };
    let mesh = mcp_mesh(opts, dir.path(), &servers).await;

    // The catalog: name-spaced tools, schemas carried over, hints as effect classes.
    let listed = mcp_host(&mesh).list_tools(pb::ListToolsRequest::default()).await.expect("list").into_inner().tools;
    let spec = |n: &str| {
        listed
            .iter()
            .find(|t| t.name == n)
            .unwrap_or_else(|| panic!("{n} not in {:?}", listed.iter().map(|t| &t.name).collect::<Vec<_>>()))
    };
    let read = spec("mcp.fs.read_text_file");
    assert!(read.read_only && read.idempotent && !read.consequential, "{read:?}");
    let write = spec("mcp.fs.write_file");
    assert!(!write.read_only && !write.idempotent, "{write:?}");
    let schema: Value = serde_json::from_str(&write.input_schema_json).expect("schema");
    assert!(schema["properties"]["path"].is_object() && schema["properties"]["content"].is_object(), "{schema}");
    let globex = pb::ListToolsRequest { tenant: "globex".into() };
    let for_globex = mcp_host(&mesh).list_tools(globex).await.expect("list").into_inner().tools;
    assert!(for_globex.is_empty(), "the server serves acme only: {for_globex:?}");

    let target = files.join("hello.txt").display().to_string();
    let work = plan(&[
        ("write", "mcp.fs.write_file", json!({"path": target, "content": "hello from warden"}), &[]),
        ("read", "mcp.fs.read_text_file", json!({"path": target}), &["write"]),
    ]);
    // `write_file` is destructive by the server's hints, so consequential: the run commits to it
    // with a capability (without one, policy denies `missing_commitment`).
    let uncommitted = run_plan(&mesh, "acme", &work).await.1;
    assert!(uncommitted.reason.contains("missing_commitment"), "{}", uncommitted.reason);
    assert!(!std::path::Path::new(&target).exists(), "nothing was written without the commitment");
    let mut caps = warden_proto::v1::capabilities_client::CapabilitiesClient::new(mesh.policy.channel());
    let issue = pb::IssueCapabilityRequest {
        tenant: "acme".into(),
        tool_patterns: vec!["mcp.fs.write_file".into()],
        ttl_seconds: 600,
        ..Default::default()
    };
    let handle = caps.issue(issue).await.expect("issue").into_inner().handle;
    let req = pb::SubmitRunRequest {
        tenant: "acme".into(),
        plan_json: work.clone(),
        capability_handles: vec![handle],
        ..Default::default()
    };
    let id = mesh.runs().submit_run(req).await.expect("submit").into_inner().run_id;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{} {:?}\n{}", run.reason, run.steps, mesh.logs());
    assert_eq!(std::fs::read_to_string(&target).expect("written"), "hello from warden");
    assert!(output(step(&run, "read"))["text"].as_str().expect("text").contains("hello from warden"));
    let receipts = receipts_of(&mesh, "acme", &id, "").await;
    assert_eq!(receipts.len(), 2, "{receipts:?}");
    assert!(receipts.iter().all(|r| r.status == "ok" && !r.policy_decision.is_empty()), "{receipts:?}");
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);

    // Policy allows globex `mcp.*`, but the host's fence keeps it off acme's server.
    let sneaky = files.join("globex.txt").display().to_string();
    let work = plan(&[("write", "mcp.fs.write_file", json!({"path": sneaky, "content": "x"}), &[])]);
    let issue = pb::IssueCapabilityRequest {
        tenant: "globex".into(),
        tool_patterns: vec!["mcp.fs.write_file".into()],
        ttl_seconds: 600,
        ..Default::default()
    };
    let handle = caps.issue(issue).await.expect("issue").into_inner().handle;
    let req = pb::SubmitRunRequest {
        tenant: "globex".into(),
        plan_json: work,
        capability_handles: vec![handle],
        ..Default::default()
    };
    let id = mesh.runs().submit_run(req).await.expect("submit").into_inner().run_id;
    let run = settled(&mesh, "globex", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    let failed = failure_of(&mesh, "globex", &id, "write").await;
    assert_eq!(failed["kind"], "authorization_refused", "{failed}");
    assert!(failed["reason"].as_str().unwrap_or_default().contains("does not serve tenant 'globex'"), "{failed}");
    assert!(!Path::new(&sneaky).exists(), "nothing was written");

    // A call carrying no proofs (or an authorization without the ledger's acknowledgement).
    let args = json!({"path": files.join("forged.txt").display().to_string(), "content": "x"});
    let forged = pb::InvokeRequest {
        tenant: "acme".into(),
        run_id: id.clone(),
        step_id: "write".into(),
        attempt: 1,
        tool: "mcp.fs.write_file".into(),
        args_json: warden_core::canonical_json(&args),
        idempotency_key: "forged-1".into(),
        ..Default::default()
    };
    let refused = mcp_host(&mesh).invoke(forged).await.expect_err("refused");
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(!files.join("forged.txt").exists(), "nothing ran unauthorized");

    both_reflections_list(&mesh.extra_hosts[0], "warden.v1.ToolHost").await;
    both_reflections_list(&mesh.executors[0], "warden.v1.Runs").await;
}

/// A child process killed when the test ends (it also dies with the test process).
struct Spawned(std::process::Child);

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the Python SDK fixture over streamable HTTP; returns it and its URL.
fn http_fixture(notes: &Path) -> (Spawned, String) {
    let mut cmd = Command::new(mcp_python());
    cmd.arg(fixture("fixture_server.py"))
        .arg("--http")
        .env("NOTES_FILE", notes)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = spawn_tied(cmd, libc::SIGKILL).expect("start the HTTP fixture");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(url) = line.strip_prefix("LISTENING ") {
                let _ = tx.send(url.to_string());
            }
        }
    });
    let url = rx.recv_timeout(Duration::from_secs(60)).expect("the HTTP fixture announced its URL");
    (Spawned(child), url)
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_string).collect()
}

/// A server written with the official Python SDK, over streamable HTTP: a run's calls go
/// through Warden. Directly at the host: policy's allow alone does nothing (no ledger
/// acknowledgement), with both proofs the call acts once, and the same key again is answered
/// with the first outcome — durably, after the host restarted — without reaching the server.
#[tokio::test]
async fn an_mcp_server_over_streamable_http_acts_once_per_key_and_only_with_both_proofs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notes = dir.path().join("notes.txt");
    let (_server, url) = http_fixture(&notes);
    let servers = format!("[[mcp.servers]]\nname = \"py\"\nurl = \"{url}\"\ntenants = [\"*\"]\n");
    let opts = MeshOptions {
        tenants: vec![("acme".into(), vec!["mcp.py.*".into()])],
        // Runs created straight in the ledger below are driven by the test, not by a sweep.
        sweep_interval_ms: 600_000,
        ..MeshOptions::default()
    };
    let mut mesh = mcp_mesh(opts, dir.path(), &servers).await;

    let listed = mcp_host(&mesh).list_tools(pb::ListToolsRequest::default()).await.expect("list").into_inner().tools;
    let names: Vec<&str> = listed.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["mcp.py.greet", "mcp.py.note", "mcp.py.wipe"]);
    let class = |n: &str| listed.iter().find(|t| t.name == n).map(|t| (t.read_only, t.idempotent, t.consequential));
    assert_eq!(class("mcp.py.greet"), Some((true, true, false)), "readOnlyHint");
    assert_eq!(class("mcp.py.note"), Some((false, false, false)), "destructiveHint: false");
    assert_eq!(class("mcp.py.wipe"), Some((false, false, true)), "no hints: MCP's default, destructive");

    let work = plan(&[
        ("hi", "mcp.py.greet", json!({"name": "ada"}), &[]),
        ("keep", "mcp.py.note", json!({"text": "{{hi.output.text}}"}), &["hi"]),
    ]);
    let (id, run) = run_plan(&mesh, "acme", &work).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{} {:?}\n{}", run.reason, run.steps, mesh.logs());
    assert_eq!(output(step(&run, "hi"))["text"], "hello, ada");
    assert_eq!(lines(&notes), ["hello, ada"]);
    let receipts = receipts_of(&mesh, "acme", &id, "").await;
    assert_eq!(receipts.iter().filter(|r| r.status == "ok").count(), 2, "{receipts:?}");

    // The host, asked directly with policy's allow of a planned call.
    let run_id = planned_run(&mesh, "acme", &[("n1", "mcp.py.note")]).await;
    let args = json!({"text": "once"});
    let decide = pb::AuthorizeRequest {
        tenant: "acme".into(),
        run_id: run_id.clone(),
        step_id: "n1".into(),
        attempt: 1,
        tool: "mcp.py.note".into(),
        args_json: args.to_string(),
        idempotency_key: format!("{run_id}:n1:1"),
        ..Default::default()
    };
    let granted = mesh.policy().authorize(decide).await.expect("authorize").into_inner();
    let decision = granted.decision.clone().expect("decision");
    assert_eq!(decision.outcome(), pb::Outcome::Allow, "{decision:?}");
    let call = pb::InvokeRequest {
        tenant: "acme".into(),
        run_id: run_id.clone(),
        step_id: "n1".into(),
        attempt: 1,
        tool: "mcp.py.note".into(),
        args_json: warden_core::canonical_json(&args),
        idempotency_key: format!("{run_id}:n1:1"),
        authorization: granted.authorization.clone(),
        request_ack: None,
    };
    let e = mcp_host(&mesh).invoke(call.clone()).await.expect_err("no acknowledgement");
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(e.message().contains("acknowledgement"), "{e:?}");
    assert_eq!(lines(&notes).len(), 1, "policy's allow alone reached nothing");

    let ack = acknowledged(&mesh, "acme", &run_id, "n1", 1, "mcp.py.note", &args, &decision.decision_id).await;
    let call = pb::InvokeRequest { request_ack: Some(ack), ..call };
    let first = mcp_host(&mesh).invoke(call.clone()).await.expect("invoke").into_inner();
    assert!(!first.replayed);
    assert_eq!(lines(&notes), ["hello, ada", "once"]);
    let again = mcp_host(&mesh).invoke(call.clone()).await.expect("invoke").into_inner();
    assert!(again.replayed && again.outcome == first.outcome);
    mesh.extra_hosts[0].restart().expect("restart the MCP host");
    let after_restart = mcp_host(&mesh).invoke(call.clone()).await.expect("invoke").into_inner();
    assert!(after_restart.replayed && after_restart.outcome == first.outcome, "{after_restart:?}");
    assert_eq!(lines(&notes), ["hello, ada", "once"], "the server acted once for the key");
    // The key with other arguments is not answered with another call's outcome.
    let other = pb::InvokeRequest { args_json: json!({"text": "twice"}).to_string(), ..call };
    assert_ne!(mcp_host(&mesh).invoke(other).await.map(|_| ()).expect_err("refused").code(), Code::Ok);
    assert_eq!(lines(&notes).len(), 2);
}

/// A server that crashes, hangs, writes malformed JSON-RPC, lists a schema that is not JSON
/// Schema or reports a tool error: each call fails, recorded with the reason (and receipted),
/// and the host keeps serving — the crashed server is started again for the next call.
#[tokio::test]
async fn a_misbehaving_mcp_server_fails_calls_recorded_with_the_reason_and_the_host_keeps_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let calls = dir.path().join("calls.txt");
    let servers = format!(
        // The operator's word on the classes (unannotated, they would be consequential and each
        // call would need a commitment first; these cases are about failures).
        "[[mcp.servers]]\nname = \"bad\"\ncommand = {}\ntenants = [\"acme\"]\ncall_timeout_secs = 2\nenv = {{ CALLS_FILE = {} }}\n\
         effects = {{ crash = \"write\", garbage = \"write\", hang = \"write\", odd_schema = \"write\", fail = \"write\" }}\n",
        toml_list(&[mcp_python().display().to_string(), fixture("bad_server.py")]),
        Value::String(calls.display().to_string())
    );
    let opts = MeshOptions { tenants: vec![("acme".into(), vec!["mcp.bad.*".into()])], ..MeshOptions::default() };
    let mesh = mcp_mesh(opts, dir.path(), &servers).await;

    let one = |tool: &str| plan(&[("s", tool, json!({}), &[])]);
    let cases = [
        ("mcp.bad.crash", "mcp_server_failed", "exited (exit status: 3)"),
        ("mcp.bad.garbage", "mcp_server_failed", "broke the protocol"),
        ("mcp.bad.hang", "mcp_timeout", "did not answer within 2s"),
        ("mcp.bad.odd_schema", "mcp_invalid_schema", "not JSON Schema"),
        ("mcp.bad.fail", "mcp_tool_error", "it did not work"),
    ];
    for (tool, code, why) in cases {
        let (id, run) = run_plan(&mesh, "acme", &one(tool)).await;
        assert_eq!(run.status(), pb::RunStatus::Failed, "{tool}: {run:?}\n{}", mesh.logs());
        let failed = failure_of(&mesh, "acme", &id, "s").await;
        assert_eq!(failed["kind"], "tool_error", "{tool}: {failed}");
        assert_eq!(failed["code"], code, "{tool}: {failed}");
        let reason = failed["reason"].as_str().unwrap_or_default();
        assert!(reason.contains(why), "{tool}: '{reason}' should say '{why}'");
        if tool == "mcp.bad.crash" {
            assert!(reason.contains("boom, crashing on purpose"), "the server's last stderr: {reason}");
        }
        let receipts = receipts_of(&mesh, "acme", &id, "s").await;
        assert_eq!(receipts.len(), 1, "{tool}: {receipts:?}");
        assert_eq!(receipts[0].status, "error", "{tool}");
        assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
        // After each failure the host still serves, starting the server again if it died.
        let (_, ok) = run_plan(&mesh, "acme", &one("mcp.bad.ok")).await;
        assert_eq!(ok.status(), pb::RunStatus::Completed, "after {tool}: {ok:?}\n{}", mesh.logs());
        assert_eq!(output(step(&ok, "s"))["text"], "fine");
    }
    assert!(!lines(&calls).iter().any(|c| c == "odd_schema"), "a tool whose schema is broken is never called");
}

const OPS: &str = "mcp-ops-token-0123456789abcdef";
const ACME: &str = "mcp-acme-token-0123456789abcdef";
const GLOBEX: &str = "mcp-globex-token-0123456789abcdef";

/// The `warden` binary next to the test binary.
fn warden_bin() -> PathBuf {
    warden_testkit::mesh::bin_dir().expect("bin dir").join("warden")
}

/// The environment through which `warden mcp serve` reaches `mesh`.
fn cli_env(mesh: &Mesh) -> Vec<(String, String)> {
    vec![
        ("WARDEN_ENDPOINT".into(), mesh.executors[0].endpoint.clone()),
        ("WARDEN_LEDGER_ENDPOINT".into(), mesh.ledger.endpoint.clone()),
        ("WARDEN_POLICY_ENDPOINT".into(), mesh.policy.endpoint.clone()),
        ("WARDEN_PLANNER_ENDPOINT".into(), mesh.planner.endpoint.clone()),
    ]
}

/// Runs the official Python MCP client (`client.py`) with `args`, making `calls`.
fn python_client(args: &[&str], env: &[(String, String)], calls: &Value) -> Value {
    let out = Command::new(mcp_python())
        .arg(fixture("client.py"))
        .args(args)
        .envs(env.iter().cloned())
        .env("CALLS", calls.to_string())
        .env_remove("WARDEN_CONFIG")
        .stdin(Stdio::null())
        .output()
        .expect("run the MCP client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("client printed no JSON ({e}):\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr)))
}

/// The status line (and headers) a bare MCP `initialize` POST to `url` gets with `token`.
fn http_status(url: &str, token: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http url");
    let (authority, path) = rest.split_once('/').expect("path");
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "probe", "version": "1"}}})
    .to_string();
    let auth = if token.is_empty() { String::new() } else { format!("Authorization: Bearer {token}\r\n") };
    let request = format!(
        "POST /{path} HTTP/1.1\r\nHost: {authority}\r\n{auth}Content-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = std::net::TcpStream::connect(authority).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    stream.write_all(request.as_bytes()).expect("send");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

fn tool_names(session: &Value) -> Vec<String> {
    let mut names: Vec<String> = session["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("no tools in {session}"))
        .iter()
        .map(|t| t["name"].as_str().unwrap_or_default().to_string())
        .collect();
    names.sort();
    names
}

fn text(result: &Value) -> String {
    result["content"].as_array().into_iter().flatten().filter_map(|c| c["text"].as_str()).collect::<Vec<_>>().join("\n")
}

/// `warden mcp serve`, driven by the official Python MCP client. Over stdio (as acme, by
/// `--tenant`/`--token`): the tenant's governed tools are listed — an MCP server's tools behind
/// `warden-mcp` among them, annotated with their effect class — and each call is a one-step run
/// answered with its outcome, run and receipt; a denial names rule and reason; a gated call
/// answers "approval required" with the approval id. Over streamable HTTP, a bearer token maps
/// to its tenant as in the gRPC API, and an unknown one is refused before anything happens.
#[tokio::test]
async fn warden_mcp_serve_offers_governed_tools_to_an_mcp_client_and_runs_each_call() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notes = dir.path().join("notes.txt");
    let servers = format!(
        "[[mcp.servers]]\nname = \"py\"\ncommand = {}\ntenants = [\"acme\"]\nenv = {{ NOTES_FILE = {} }}\n",
        toml_list(&[mcp_python().display().to_string(), fixture("fixture_server.py")]),
        Value::String(notes.display().to_string())
    );
    let opts = MeshOptions {
        tenants: vec![
            ("acme".into(), vec!["echo".into(), "email.send".into(), "mcp.py.*".into()]),
            ("globex".into(), vec!["echo".into()]),
        ],
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec![])],
        auth_tokens: vec![(OPS.into(), "*".into()), (ACME.into(), "acme".into()), (GLOBEX.into(), "globex".into())],
        service_token: OPS.into(),
        ..MeshOptions::default()
    };
    let mesh = mcp_mesh(opts, dir.path(), &servers).await;

    // Over stdio, as acme.
    let mut env = cli_env(&mesh);
    env.push(("WARDEN_TENANT".into(), "acme".into()));
    env.push(("WARDEN_TOKEN".into(), ACME.into()));
    let calls = json!([
        ["echo", {"message": "hi"}],
        ["mcp.py.greet", {"name": "ada"}],
        ["kv.put", {"key": "k", "value": 1}],
        ["email.send", {"to": "ops@example.com", "subject": "s", "body": "b"}],
        ["no.such.tool", {}],
    ]);
    let bin = warden_bin().display().to_string();
    let session = python_client(&["stdio", &bin], &env, &calls);
    assert_eq!(
        tool_names(&session),
        ["echo", "email.send", "mcp.py.greet", "mcp.py.note", "mcp.py.wipe"],
        "acme's governed tools, not the whole catalog: {session}"
    );
    let tool = |n: &str| session["tools"].as_array().and_then(|ts| ts.iter().find(|t| t["name"] == n)).cloned();
    let greet = tool("mcp.py.greet").expect("greet");
    assert_eq!(greet["annotations"]["readOnlyHint"], true, "{greet}");
    assert_eq!(greet["inputSchema"]["properties"]["name"]["type"], "string", "schema carried through: {greet}");
    assert_eq!(tool("email.send").expect("email.send")["annotations"]["destructiveHint"], true);

    let [echo, greeted, denied, gated, unknown] =
        session["calls"].as_array().cloned().expect("calls").try_into().expect("5 calls");
    assert_ne!(echo["isError"], true, "{echo}");
    assert_eq!(echo["structuredContent"], json!({"message": "hi"}), "{echo}");
    let run = &echo["_meta"]["warden/run"];
    assert_eq!((run["status"].as_str(), run["receipt_status"].as_str()), (Some("completed"), Some("ok")), "{echo}");
    let echo_run = run["run_id"].as_str().expect("run id").to_string();
    let receipts = receipts_of(&mesh, "acme", &echo_run, "call").await;
    assert_eq!(receipts.len(), 1);
    assert_eq!(run["receipt_id"], receipts[0].receipt_id.as_str(), "the result names the run's receipt");
    assert!(verify(&mut mesh.ledger(), "acme", &echo_run).await.valid);

    assert_eq!(text(&greeted), "hello, ada", "an MCP server's content, through both hops: {greeted}");

    assert_eq!(denied["isError"], true);
    assert_eq!(denied["structuredContent"]["status"], "denied", "{denied}");
    assert_eq!(denied["structuredContent"]["rule_id"], "default_deny", "{denied}");
    assert!(
        text(&denied).contains("denied by policy rule 'default_deny': no rule allows tenant 'acme' to call 'kv.put'"),
        "{denied}"
    );
    let denied_run = denied["_meta"]["warden/run"]["run_id"].as_str().expect("run id").to_string();
    let receipts = receipts_of(&mesh, "acme", &denied_run, "call").await;
    assert_eq!(
        receipts.iter().map(|r| r.status.as_str()).collect::<Vec<_>>(),
        ["denied"],
        "the denial is receipted too"
    );

    assert_eq!(gated["isError"], true);
    assert_eq!(gated["structuredContent"]["status"], "approval_required", "{gated}");
    let approval_id = gated["structuredContent"]["approval_id"].as_str().expect("approval id").to_string();
    assert!(text(&gated).contains(&approval_id), "{gated}");
    let pending = warden_proto::v1::approvals_client::ApprovalsClient::new(mesh.policy.channel_as(OPS))
        .list(pb::ListApprovalsRequest { tenant: "acme".into(), ..Default::default() })
        .await
        .expect("approvals")
        .into_inner()
        .approvals;
    let gated_run = gated["_meta"]["warden/run"]["run_id"].as_str().expect("run id");
    assert!(pending.iter().any(|a| a.approval_id == approval_id && a.run_id == gated_run), "{pending:?}");
    assert!(mesh.outbox().is_empty(), "nothing was sent before a human approves");

    assert_eq!(unknown["isError"], true);
    assert!(text(&unknown).contains("no.such.tool"), "{unknown}");

    // Over streamable HTTP: the bearer token decides the tenant.
    let mut cmd = Command::new(warden_bin());
    cmd.args(["mcp", "serve", "--http", "127.0.0.1:0", "--config"])
        .arg(mesh.dir.path().join("warden.toml"))
        .envs(cli_env(&mesh))
        .env("WARDEN_TOKEN", OPS)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = spawn_tied(cmd, libc::SIGKILL).expect("start warden mcp serve --http");
    let stdout = child.stdout.take().expect("stdout");
    let _served = Spawned(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(url) = line.strip_prefix("WARDEN_MCP_LISTENING ") {
                let _ = tx.send(url.to_string());
            }
        }
    });
    let url = rx.recv_timeout(Duration::from_secs(30)).expect("warden mcp serve --http announced its URL");

    let calls = json!([["echo", {"message": "from globex"}], ["mcp.py.greet", {"name": "x"}]]);
    let session = python_client(&["http", &url, GLOBEX], &[], &calls);
    assert_eq!(tool_names(&session), ["echo"], "globex's tools: {session}");
    let [echo, greet] = session["calls"].as_array().cloned().expect("calls").try_into().expect("2 calls");
    assert_eq!(echo["structuredContent"], json!({"message": "from globex"}), "{echo}");
    let run_id = echo["_meta"]["warden/run"]["run_id"].as_str().expect("run id");
    let run = mesh.runs().get_run(pb::GetRunRequest { tenant: "globex".into(), run_id: run_id.into() }).await;
    assert_eq!(run.expect("globex's run").into_inner().tenant, "globex");
    assert_eq!(greet["structuredContent"]["rule_id"], "default_deny", "{greet}");
    assert!(lines(&notes).is_empty());

    for token in ["not-a-token-0123456789", ""] {
        let refused = python_client(&["http", &url, token], &[], &json!([["echo", {"message": "x"}]]));
        assert!(refused.get("error").is_some(), "token '{token}': no session: {refused}");
        let status = http_status(&url, token);
        assert!(status.starts_with("HTTP/1.1 401"), "token '{token}': {status}");
        assert!(status.to_ascii_lowercase().contains("www-authenticate: bearer"), "{status}");
    }
    let ran = mesh.runs().list_runs(pb::ListRunsRequest { tenant: "globex".into(), ..Default::default() }).await;
    assert_eq!(ran.expect("runs").into_inner().runs.len(), 2, "globex's two calls; refused callers ran nothing");
}
