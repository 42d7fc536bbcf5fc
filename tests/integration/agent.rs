//! The agent layer: goal runs planned by a model, every model call decided by the policy and
//! recorded in the run's chain, replayed (never asked again) when planning runs again, and
//! model output that never triggers execution by itself (K17).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Notify;
use tonic::Code;
use warden_proto::v1 as pb;
use warden_testkit::{Mesh, MeshOptions};

use crate::scripted_model::{Reply, ScriptedModel};
use crate::{Backend, assert_field_violation, events, mesh_with, payload, settled, verify};

/// Tools the test tenant may call, model calls included.
fn tools(extra: &[&str]) -> Vec<String> {
    ["echo", "kv.*", "email.send", "model.call"].iter().chain(extra).map(|s| s.to_string()).collect()
}

async fn agent_mesh(backend: Backend, planner: String, tenant_tools: Vec<String>, policy_extra: &str) -> Mesh {
    let opts = MeshOptions {
        tenants: vec![("acme".into(), tenant_tools)],
        planner_extra: planner,
        policy_extra: policy_extra.into(),
        ..MeshOptions::default()
    };
    mesh_with(backend, opts).await
}

async fn submit_goal(mesh: &Mesh, goal: &str, policy: pb::ReplayPolicy) -> String {
    mesh.runs()
        .submit_run(pb::SubmitRunRequest {
            tenant: "acme".into(),
            goal: goal.into(),
            replay_policy: policy as i32,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|s| panic!("submit failed: {s:?}\n{}", mesh.logs()))
        .into_inner()
        .run_id
}

async fn run_events(mesh: &Mesh, run: &str) -> Vec<pb::Event> {
    events(&mut mesh.ledger(), "acme", run).await
}

fn of_type<'a>(evs: &'a [pb::Event], t: &str) -> Vec<&'a pb::Event> {
    evs.iter().filter(|e| e.event_type == t).collect()
}

async fn trace(mesh: &Mesh, run: &str) -> Value {
    let t = mesh
        .runs()
        .get_trace(pb::GetRunRequest { tenant: "acme".into(), run_id: run.into() })
        .await
        .expect("trace")
        .into_inner();
    serde_json::from_str(&t.trace_json).expect("trace json")
}

/// Every recorded model call cites a recorded allow for `model.call` that precedes it.
fn assert_calls_were_allowed(evs: &[pb::Event]) {
    for req in of_type(evs, "model_requested") {
        let p = payload(req);
        let decision = evs
            .iter()
            .find(|e| e.event_type == "policy_decision" && payload(e)["decision_id"] == p["decision_id"])
            .unwrap_or_else(|| panic!("model_requested at seq {} cites no recorded decision", req.seq));
        assert!(decision.seq < req.seq, "the decision is recorded before the call");
        let d = payload(decision);
        assert_eq!((d["outcome"].as_str(), d["tool"].as_str()), (Some("allow"), Some("model.call")));
    }
}

fn echo_plan(text: &str) -> Value {
    json!({"reasoning": "echo it", "direct_response": null,
           "steps": [{"id": "say", "tool": "echo", "params": {"text": text}, "depends_on": []}]})
}

/// A goal run against llama.cpp's `llama-server` with SmolLM2-135M-Instruct: the model is
/// asked under the strict plan schema; whatever it answers, every call is decided, recorded
/// (with usage and cost), and nothing runs that is not a validated step of the offer.
#[tokio::test]
async fn a_goal_run_plans_with_a_real_model_and_records_every_call() {
    let server = tokio::task::spawn_blocking(warden_testkit::model::model_server).await.expect("model server");
    let planner = format!(
        "[planner.model]\nprovider = \"openai\"\nbase_url = \"{}\"\nmodel = \"{}\"\ntimeout_secs = 120\nmax_tokens = 256\n\
         [planner.prices.{}]\ninput_per_mtok = 0.5\noutput_per_mtok = 1.5\n",
        server.base_url, server.model, server.model
    );
    let mesh = agent_mesh(Backend::Sqlite, planner, tools(&[]), "").await;
    let run = submit_goal(&mesh, "Echo the word hello.", pb::ReplayPolicy::Strict).await;
    let done = crate::ended(&mesh, "acme", &run).await;
    let evs = run_events(&mesh, &run).await;
    let requested = of_type(&evs, "model_requested");
    let answered = of_type(&evs, "model_completed");
    assert!(!requested.is_empty(), "the model was asked\n{}", mesh.logs());
    assert!(requested.len() <= 3, "at most 1 + repair_attempts (2) calls");
    assert_calls_were_allowed(&evs);
    assert_eq!(answered.len() + of_type(&evs, "model_failed").len(), requested.len(), "every call has an outcome");
    for a in &answered {
        let p = payload(a);
        assert!(p["usage"]["input_tokens"].as_u64().unwrap_or(0) > 0, "usage recorded: {p}");
        assert!(p["cost"].as_f64().unwrap_or(0.0) > 0.0, "cost from the price table: {p}");
        assert!(p["raw_output"].is_string());
    }
    let first = payload(requested[0]);
    assert_eq!(first["allowed_tools"], json!(["echo", "email.send", "kv.get", "kv.put"]), "the tenant's offer");
    assert_eq!(first["messages"][1]["content"], "Echo the word hello.");
    assert!(first["context_version"]["system_prompt_hash"].is_string());
    let created = of_type(&evs, "plan_created");
    assert_eq!(created.len(), 1, "one plan");
    let plan = payload(created[0]);
    let source = plan["source"].as_str().unwrap_or_default().to_string();
    eprintln!("the model planned ({source}): {}", plan["plan"]);
    assert!(matches!(source.as_str(), "model" | "fallback"), "{plan}");
    let planned: Vec<&str> = plan["plan"]["steps"]
        .as_array()
        .map(|s| s.iter().filter_map(|s| s["tool"].as_str()).collect())
        .unwrap_or_default();
    for r in of_type(&evs, "tool_requested") {
        let tool = payload(r)["tool"].as_str().unwrap_or_default().to_string();
        assert!(planned.contains(&tool.as_str()), "only planned tools run: {tool}");
    }
    if source == "fallback" || plan["plan"]["direct_response"].is_string() {
        assert!(of_type(&evs, "tool_requested").is_empty(), "a direct response runs nothing");
        assert_eq!(done.status(), pb::RunStatus::Completed);
    }
    let t = trace(&mesh, &run).await;
    assert_eq!(t["llm_calls"].as_array().map(Vec::len), Some(requested.len()), "{t}");
    assert_eq!(t["plan_rounds"][0]["source"], source.as_str());
    assert!(verify(&mut mesh.ledger(), "acme", &run).await.valid);
}

/// A valid plan is executed; replaying the finished run asks nothing (strict: exact match);
/// drift is refused by strict, replayed and recorded by allow_prompt_drift, and forked by
/// fork_on_drift into a new run that asks the model again.
#[tokio::test]
async fn goal_runs_execute_and_replay_under_each_policy() {
    let model = ScriptedModel::start(Reply::plan(echo_plan("hello"))).await;
    let mut mesh = agent_mesh(Backend::Sqlite, model.openai_config("temperature = 0.0"), tools(&[]), "").await;
    let run = submit_goal(&mesh, "Say hello.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{done:?}\n{}", mesh.logs());
    assert_eq!(done.steps[0].output_json, r#"{"text":"hello"}"#);
    assert_eq!(model.received().len(), 1);
    let sent = &model.received()[0].body;
    assert_eq!(sent["response_format"]["type"], "json_schema");
    assert_eq!(sent["response_format"]["json_schema"]["strict"], true);
    let evs = run_events(&mesh, &run).await;
    let costed = payload(of_type(&evs, "model_completed")[0]);
    assert_eq!(costed["cost"], json!((120.0 * 2.0 + 30.0 * 10.0) / 1e6), "usage × price");

    let runs = mesh.runs();
    let replay = |policy: pb::ReplayPolicy| {
        let mut runs = runs.clone();
        let run = run.clone();
        async move {
            runs.replay_run(pb::ReplayRunRequest { tenant: "acme".into(), run_id: run, policy: policy as i32 }).await
        }
    };
    let same = replay(pb::ReplayPolicy::Strict).await.expect("strict replay").into_inner();
    assert_eq!((same.outcome.as_str(), same.replayed_calls), ("replayed", 1));
    assert_eq!(serde_json::from_str::<Value>(&same.plan_json).expect("test data")["steps"][0]["tool"], "echo");
    assert_eq!(model.received().len(), 1, "a recorded call is never asked again");
    assert_eq!(trace(&mesh, &run).await["llm_calls"][0]["replayed"], 1);

    // The planner now asks with other options: drift.
    let config = mesh.dir.path().join("warden.toml");
    let text = std::fs::read_to_string(&config).expect("test data").replace("temperature = 0.0", "temperature = 0.7");
    std::fs::write(&config, text).expect("test data");
    // The restart returns once the new planner announced its address (it has no store).
    mesh.planner.restart().expect("restart planner");
    let refused = replay(pb::ReplayPolicy::Strict).await.expect_err("strict refuses drift");
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains("options"), "names the difference: {}", refused.message());

    let drift = replay(pb::ReplayPolicy::AllowPromptDrift).await.expect("drift replay").into_inner();
    assert_eq!(drift.outcome, "replayed_with_drift");
    assert!(drift.differences.iter().any(|d| d.starts_with("options")), "{:?}", drift.differences);
    assert_eq!(model.received().len(), 1, "still not asked");
    let evs = run_events(&mesh, &run).await;
    assert_eq!(of_type(&evs, "replayed_with_drift").len(), 1, "the drift is recorded");

    let fork = replay(pb::ReplayPolicy::ForkOnDrift).await.expect("fork").into_inner();
    assert_eq!(fork.outcome, "forked");
    assert!(fork.forked_run_id.starts_with(&format!("{run}::fork::")), "{}", fork.forked_run_id);
    let forked = settled(&mesh, "acme", &fork.forked_run_id).await;
    assert_eq!(forked.status(), pb::RunStatus::Completed, "{}", mesh.logs());
    assert_eq!(model.received().len(), 2, "the fork asked the model");
    let fevs = run_events(&mesh, &fork.forked_run_id).await;
    assert_eq!(payload(&fevs[0])["parent_run_id"], run.as_str(), "linked to its parent");
    assert!(verify(&mut mesh.ledger(), "acme", &run).await.valid);
}

/// A run driven again after its executor died mid-planning replays what was recorded and
/// asks only for the call that has no answer.
#[tokio::test]
async fn planning_resumed_after_a_crash_never_asks_again_for_a_recorded_call() {
    let model = ScriptedModel::start(Reply::plan(echo_plan("again"))).await;
    let gate = Arc::new(Notify::new());
    model.push(Reply::chat("this is not a plan"));
    model.push(Reply::plan(echo_plan("again")).held(gate.clone()));
    let opts = MeshOptions {
        tenants: vec![("acme".into(), tools(&[]))],
        planner_extra: model.openai_config(""),
        executors: 2,
        ..MeshOptions::default()
    };
    let mut mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = submit_goal(&mesh, "Say again.", pb::ReplayPolicy::Strict).await;
    // The repair pass is in flight (held): followed until its request is recorded.
    let mut ledger = mesh.ledger();
    let follow = pb::StreamEventsRequest { tenant: "acme".into(), run_id: run.clone(), since_seq: 0, follow: true };
    let mut stream = ledger.stream_events(follow).await.expect("follow the run").into_inner();
    let mut requested = 0;
    while requested < 2 {
        let e = stream.message().await.expect("stream").expect("the run goes on until the repair is asked");
        requested += usize::from(e.event_type == "model_requested");
    }
    drop(stream);
    let driver = run_events(&mesh, &run)
        .await
        .iter()
        .find(|e| e.event_type == "run_started")
        .map(|e| payload(e)["executor"].clone())
        .expect("test data");
    let i = if driver == "executor-0" { 0 } else { 1 };
    mesh.executors[i].kill();
    let done = settled(&mesh, "acme", &run).await;
    gate.notify_waiters();
    assert_eq!(done.status(), pb::RunStatus::Completed, "{done:?}\n{}", mesh.logs());
    let firsts = model.received().iter().filter(|r| r.body["messages"].as_array().map(Vec::len) == Some(2)).count();
    assert_eq!(firsts, 1, "the recorded first answer was replayed, not asked again");
    let evs = events(&mut ledger, "acme", &run).await;
    assert!(!of_type(&evs, "model_replayed").is_empty(), "the replay is recorded");
    assert_eq!(of_type(&evs, "plan_created").len(), 1);
    assert!(verify(&mut ledger, "acme", &run).await.valid);
}

/// Answers that are no plan are shown their exact error and asked again; after the repair
/// passes, the fallback is a direct response — never a tool call. Garbage, an empty body,
/// invalid UTF-8 and a 10 MB body are each a recorded `model_failed`.
#[tokio::test]
async fn bad_answers_are_repaired_then_fall_back_to_a_direct_response() {
    let model = ScriptedModel::start(Reply::chat("still not a plan")).await;
    model.push(Reply::chat("{\"steps\": [ oops"));
    model.push(Reply::raw(200, ""));
    model.push(Reply::raw(200, vec![0xff, 0xfe, 0x00, 0x7b]));
    model.push(Reply::raw(200, vec![b' '; 10 << 20]));
    let mesh = agent_mesh(Backend::Sqlite, model.openai_config("repair_attempts = 3"), tools(&[]), "").await;
    let run = submit_goal(&mesh, "Do something.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}", mesh.logs());
    assert!(done.direct_response.starts_with("No safe plan was produced"), "{}", done.direct_response);
    let evs = run_events(&mesh, &run).await;
    assert_eq!(of_type(&evs, "model_requested").len(), 4);
    assert_eq!(of_type(&evs, "model_completed").len(), 1);
    let failed: Vec<Value> = of_type(&evs, "model_failed").iter().map(|e| payload(e)).collect();
    assert_eq!(failed.len(), 3);
    assert!(failed.iter().all(|f| f["kind"] == "malformed"), "{failed:?}");
    assert!(failed[0]["error"].as_str().expect("test data").contains("empty"));
    assert!(failed[1]["error"].as_str().expect("test data").contains("UTF-8"));
    assert!(failed[2]["error"].as_str().expect("test data").contains("bytes"));
    assert!(of_type(&evs, "tool_requested").is_empty(), "no tool call");
    let second = &model.received()[1].body["messages"];
    let repair =
        second.as_array().expect("test data").last().expect("test data")["content"].as_str().expect("test data");
    assert!(repair.contains("not valid JSON"), "the model is shown the exact error: {repair}");
    assert_eq!(payload(of_type(&evs, "plan_created")[0])["source"], "fallback");
    // Replaying walks the same repair passes from the record: exact, nothing asked.
    let replayed = mesh
        .runs()
        .replay_run(pb::ReplayRunRequest { tenant: "acme".into(), run_id: run.clone(), policy: 1 })
        .await
        .expect("strict replay of repaired planning")
        .into_inner();
    assert_eq!((replayed.outcome.as_str(), replayed.replayed_calls), ("replayed", 4));
    assert_eq!(model.received().len(), 4, "nothing asked again");
}

/// 429 (with Retry-After), 5xx and timeouts are retried; a provider that stays down fails the
/// run `planner_unavailable` with the failure recorded.
#[tokio::test]
async fn a_provider_blip_is_retried_and_an_outage_fails_the_run_planner_unavailable() {
    let model = ScriptedModel::start(Reply::plan(echo_plan("up"))).await;
    model.push(Reply::plan(echo_plan("late")).delayed(Duration::from_secs(3)));
    model.push(Reply::raw(429, "slow down").header("retry-after", "1"));
    model.push(Reply::raw(503, "busy"));
    let config = model.openai_config("").replace("timeout_secs = 5", "timeout_secs = 1");
    let mesh = agent_mesh(Backend::Sqlite, config, tools(&[]), "").await;
    let run = submit_goal(&mesh, "Say up.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}", mesh.logs());
    assert_eq!(done.steps[0].output_json, r#"{"text":"up"}"#, "the answer after the retries");
    assert_eq!(model.received().len(), 4);

    model.set_default(Reply::raw(500, "down"));
    let run = submit_goal(&mesh, "Say down.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed);
    assert!(done.reason.starts_with("planner_unavailable"), "{}", done.reason);
    let evs = run_events(&mesh, &run).await;
    let failed = payload(of_type(&evs, "model_failed")[0]);
    assert_eq!(failed["kind"], "unavailable");
    assert!(of_type(&evs, "tool_requested").is_empty());
}

/// K17: model output alone never triggers execution. The model proposes a tool outside the
/// tenant's catalog, then a tool the tenant's policy denies, then arguments an invariant
/// refuses: each refusal is recorded, and nothing runs that the policy did not allow.
async fn k17(backend: Backend) {
    let model = ScriptedModel::start(Reply::chat("unused")).await;
    let step =
        |id: &str, tool: &str, params: Value| json!({"id": id, "tool": tool, "params": params, "depends_on": []});
    model.push(Reply::plan(json!({"reasoning": "r", "direct_response": null, "steps": [step("x", "shell.exec", json!({"cmd": "rm -rf /"}))]})));
    model.push(Reply::plan(
        json!({"reasoning": "r", "direct_response": null, "steps": [step("u", "text.upper", json!({"text": "a"}))]}),
    ));
    model.push(Reply::plan(json!({"reasoning": "r", "direct_response": null, "steps": [
        step("mail", "email.send", json!({"to": "victim@attacker.example", "subject": "s", "body": "b"})),
        step("ok", "echo", json!({"text": "fine"})),
    ]})));
    let invariant = "[[policy.invariants]]\nkind = \"email_domain_allowlist\"\ntool = \"email.send\"\nfield = \"to\"\ndomains = [\"example.com\"]\n";
    let mesh = agent_mesh(backend, model.openai_config(""), tools(&[]), invariant).await;
    let run = submit_goal(&mesh, "Clean up and mail the report.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    let evs = run_events(&mesh, &run).await;
    // The first plan's answers (its replanning round, after the denied mail, gets only
    // unreadable answers and gives up: no plan from it runs either).
    let refusals: Vec<String> = of_type(&evs, "model_completed")
        .iter()
        .filter(|e| e.step_id == "plan-r0")
        .filter_map(|e| payload(e)["validation_error"].as_str().map(str::to_string))
        .collect();
    assert_eq!(refusals.len(), 2, "{refusals:?}");
    assert!(of_type(&evs, "plan_revised").is_empty(), "no replanned plan was recorded");
    assert!(refusals[0].contains("shell.exec"), "outside the catalog: {}", refusals[0]);
    assert!(refusals[1].contains("text.upper"), "a tool the tenant's policy denies: {}", refusals[1]);
    let offered = payload(of_type(&evs, "model_requested")[0])["allowed_tools"].clone();
    assert!(!offered.as_array().expect("test data").contains(&json!("text.upper")), "never offered: {offered}");
    let denied: Vec<Value> =
        of_type(&evs, "policy_decision").iter().map(|e| payload(e)).filter(|d| d["tool"] == "email.send").collect();
    assert_eq!(denied.len(), 1);
    assert_eq!(denied[0]["outcome"], "deny", "the invariant refused the arguments: {}", denied[0]);
    let ran: Vec<String> = of_type(&evs, "tool_requested")
        .iter()
        .map(|e| payload(e)["tool"].as_str().expect("test data").to_string())
        .collect();
    assert_eq!(ran, vec!["echo"], "only what the policy allowed ran");
    assert_ne!(done.status(), pb::RunStatus::Completed, "a denied step fails the run: {done:?}");
    let outbox = std::fs::read_to_string(mesh.dir.path().join("outbox.jsonl")).unwrap_or_default();
    assert!(!outbox.contains("attacker"), "no mail left");
    assert!(verify(&mut mesh.ledger(), "acme", &run).await.valid);
}

#[tokio::test]
async fn k17_model_output_alone_never_triggers_execution_sqlite() {
    k17(Backend::Sqlite).await;
}

#[tokio::test]
async fn k17_model_output_alone_never_triggers_execution_postgres() {
    k17(Backend::Postgres).await;
}

/// A model call is an effect the policy decides: a tenant not permitted `model.call` has its
/// goal run fail with the rule, and the provider is never asked.
#[tokio::test]
async fn a_denied_model_call_fails_the_run_with_the_rule_and_asks_nothing() {
    let model = ScriptedModel::start(Reply::plan(echo_plan("x"))).await;
    let mesh = agent_mesh(Backend::Sqlite, model.openai_config(""), vec!["echo".into()], "").await;
    let run = submit_goal(&mesh, "Say x.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed);
    assert!(done.reason.starts_with("model call denied by default_deny: "), "{}", done.reason);
    assert!(model.received().is_empty(), "nothing was sent out");
    let evs = run_events(&mesh, &run).await;
    let d = payload(of_type(&evs, "policy_decision")[0]);
    assert_eq!((d["tool"].as_str(), d["outcome"].as_str()), (Some("model.call"), Some("deny")));
    assert!(of_type(&evs, "model_requested").is_empty());
}

/// The Anthropic Messages API: the plan comes back as a forced tool call; the key is sent in
/// its header and recorded nowhere.
#[tokio::test]
async fn anthropic_plans_through_a_forced_tool_call_and_the_key_stays_secret() {
    let model = ScriptedModel::start(Reply::anthropic(echo_plan("claude"))).await;
    let key_file = tempfile::NamedTempFile::new().expect("test data");
    std::fs::write(key_file.path(), "sk-ant-test-0123456789abcdef\n").expect("test data");
    let config = format!(
        "[planner.model]\nprovider = \"anthropic\"\nbase_url = \"{}\"\nmodel = \"claude-test\"\napi_key_file = \"{}\"\n",
        model.base_url,
        key_file.path().display()
    );
    let mesh = agent_mesh(Backend::Sqlite, config, tools(&[]), "").await;
    let run = submit_goal(&mesh, "Say claude.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}", mesh.logs());
    let got = &model.received()[0];
    assert_eq!(got.path, "/v1/messages");
    assert_eq!(got.headers["x-api-key"], "sk-ant-test-0123456789abcdef");
    assert_eq!(got.body["tool_choice"], json!({"type": "tool", "name": "submit_plan"}));
    assert!(got.body["system"].as_str().expect("test data").contains("echo"));
    let evs = run_events(&mesh, &run).await;
    assert!(evs.iter().all(|e| !e.payload_json.contains("sk-ant-test")), "the key is recorded nowhere");
    assert!(!mesh.logs().contains("sk-ant-test"), "nor logged");
}

/// Goals are checked before anything is written: empty, over the limit, no model configured;
/// secrets and personal data are redacted before they are recorded or sent. Planning is the
/// mesh's: tenants cannot call CreatePlan or authorize model calls themselves.
#[tokio::test]
async fn goals_are_checked_and_redacted_and_planning_is_the_meshs() {
    let model = ScriptedModel::start(Reply::plan(echo_plan("ok"))).await;
    let opts = MeshOptions {
        tenants: vec![("acme".into(), tools(&[])), ("other".into(), tools(&[]))],
        planner_extra: format!("max_goal_bytes = 64\n{}", model.openai_config("")),
        auth_tokens: vec![
            ("ops-token-0123456789ab".into(), "*".into()),
            ("acme-token-0123456789".into(), "acme".into()),
            ("other-token-0123456789".into(), "other".into()),
            ("bot-token-0123456789ab".into(), "acme/bot".into()),
        ],
        service_token: "ops-token-0123456789ab".into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let mut runs = mesh.runs();
    let goal = |g: &str| pb::SubmitRunRequest { tenant: "acme".into(), goal: g.into(), ..Default::default() };
    for bad in ["  ", &"x".repeat(65)] {
        let e = runs.submit_run(goal(bad)).await.expect_err("refused");
        assert_field_violation(&e, "goal");
    }
    assert_field_violation(&runs.submit_run(goal("")).await.expect_err("neither plan nor goal"), "plan_json");
    let both = pb::SubmitRunRequest { plan_json: "{\"steps\":[]}".into(), ..goal("hi") };
    assert_field_violation(&runs.submit_run(both).await.expect_err("refused"), "plan_json");
    let bad_policy = pb::SubmitRunRequest { replay_policy: 9, ..goal("hi") };
    assert_field_violation(&runs.submit_run(bad_policy).await.expect_err("refused"), "replay_policy");

    let run = runs
        .submit_run(goal("mail bob@corp.example key sk-abcdefghijklmnop1234"))
        .await
        .expect("submit")
        .into_inner()
        .run_id;
    settled(&mesh, "acme", &run).await;
    let evs = run_events(&mesh, &run).await;
    let recorded = payload(&evs[0])["goal"].as_str().expect("test data").to_string();
    assert_eq!(recorded, "mail [redacted:email] key [redacted:openai_key]");
    let sent = model.received()[0].body.to_string();
    assert!(!sent.contains("bob@corp") && !sent.contains("sk-abcdef"), "nothing secret left Warden");

    let mut planner = warden_proto::v1::planner_client::PlannerClient::new(
        warden_grpc::channel_with_token(&mesh.planner.endpoint, "acme-token-0123456789").expect("test data"),
    );
    let e = planner
        .create_plan(pb::CreatePlanRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            goal: "x".into(),
            epoch: 1,
            ..Default::default()
        })
        .await
        .expect_err("tenants do not plan");
    assert_eq!(e.code(), Code::PermissionDenied);
    let mut policy = warden_proto::v1::policy_client::PolicyClient::new(
        warden_grpc::channel_with_token(&mesh.policy.endpoint, "acme-token-0123456789").expect("test data"),
    );
    let e = policy
        .authorize(pb::AuthorizeRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            step_id: "plan-r0".into(),
            attempt: 1,
            tool: "model.call".into(),
            args_json: "{}".into(),
            idempotency_key: "k".into(),
            ..Default::default()
        })
        .await
        .expect_err("tenants do not authorize model calls");
    assert_eq!(e.code(), Code::PermissionDenied);
    let mut other = mesh.runs_as("other-token-0123456789");
    let e = other
        .replay_run(pb::ReplayRunRequest { tenant: "other".into(), run_id: run.clone(), policy: 1 })
        .await
        .expect_err("another tenant's run does not exist for it");
    assert_eq!(e.code(), Code::NotFound);
    let e = mesh
        .runs_as("bot-token-0123456789ab")
        .replay_run(pb::ReplayRunRequest { tenant: "acme".into(), run_id: run.clone(), policy: 1 })
        .await
        .expect_err("an agent replays only its own agent's runs");
    assert_eq!(e.code(), Code::PermissionDenied);
    // A plan step may not take the planner's step ids.
    let planner_id = crate::plan(&[("plan-r0", "echo", json!({"text": "x"}), &[])]);
    let e = runs
        .submit_run(pb::SubmitRunRequest { tenant: "acme".into(), plan_json: planner_id, ..Default::default() })
        .await;
    assert_eq!(e.expect_err("reserved").code(), Code::InvalidArgument);
}

/// With no model configured, a goal run is refused up front, saying how to configure one.
#[tokio::test]
async fn without_a_model_a_goal_run_says_how_to_configure_one() {
    let mesh = agent_mesh(Backend::Sqlite, String::new(), tools(&[]), "").await;
    let e = mesh
        .runs()
        .submit_run(pb::SubmitRunRequest { tenant: "acme".into(), goal: "anything".into(), ..Default::default() })
        .await
        .expect_err("no model");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("[planner.model]"), "{}", e.message());
    let listed = mesh
        .ledger()
        .list_runs(pb::ListLedgerRunsRequest { tenant: "acme".into(), ..Default::default() })
        .await
        .expect("test data");
    assert!(listed.into_inner().runs.is_empty(), "nothing written");
}

fn plan_of(steps: Value) -> Value {
    json!({"reasoning": "scripted", "direct_response": null, "steps": steps})
}

/// A scripted model whose every answer (once its queue is empty) is one fetch: `echo` of
/// `{"v": "data"}` — what a child frame plans in these tests.
async fn fetching_model() -> ScriptedModel {
    ScriptedModel::start(Reply::plan(plan_of(json!([
        {"id": "fetch", "tool": "echo", "params": {"v": "data"}, "depends_on": []},
    ]))))
    .await
}

fn replan_mesh_options(model: &ScriptedModel, executor_extra: &str, budget: Option<u64>) -> MeshOptions {
    MeshOptions {
        tenants: vec![("acme".into(), tools(&["fail"]))],
        planner_extra: model.openai_config(""),
        executor_extra: executor_extra.into(),
        budget_rules: budget.map(|calls| vec![("acme".into(), calls, 1_000.0)]).unwrap_or_default(),
        ..MeshOptions::default()
    }
}

/// Seed 000 §12: a goal run whose plan ends with a failed step is planned again with the goal,
/// the completed steps' outputs and the failure. The completed step is kept and never run
/// again; the new step whose id collides runs as `<id>_r1` and templates from the kept step's
/// output; the round is its own recorded plan (`plan_revised`), decided and recorded like the
/// first, and replays exactly. The trace shows the round and what it replaced.
async fn replan(backend: Backend) {
    let model = ScriptedModel::start(Reply::chat("unused")).await;
    model.push(Reply::plan(plan_of(json!([
        {"id": "fetch", "tool": "echo", "params": {"v": "data"}, "depends_on": []},
        {"id": "send", "tool": "fail", "params": {"message": "smtp down"}, "depends_on": ["fetch"]},
    ]))));
    model.push(Reply::plan(plan_of(json!([
        {"id": "send", "tool": "echo", "params": {"text": "{{fetch.output.v}}"}, "depends_on": ["fetch"]},
    ]))));
    let mesh = mesh_with(backend, replan_mesh_options(&model, "", None)).await;
    let run = submit_goal(&mesh, "Fetch the data and send it.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}\n{}", done.reason, mesh.logs());
    let step = |id: &str| done.steps.iter().find(|s| s.id == id).unwrap_or_else(|| panic!("step {id}")).clone();
    assert_eq!(step("fetch").status(), pb::StepStatus::Completed);
    assert_eq!(step("send").status(), pb::StepStatus::Failed, "the failure stays on record");
    assert_eq!(step("send_r1").output_json, r#"{"text":"data"}"#, "templated from the kept step");

    let evs = run_events(&mesh, &run).await;
    let fetches = evs.iter().filter(|e| e.event_type == "tool_requested" && e.step_id == "fetch").count();
    assert_eq!(fetches, 1, "the completed step was not run again");
    let revised = of_type(&evs, "plan_revised");
    assert_eq!(revised.len(), 1);
    let r = payload(revised[0]);
    assert_eq!(
        (r["round"].clone(), r["steps"].clone(), r["replaces"].clone()),
        (json!(1), json!(["send_r1"]), json!(["send"]))
    );
    assert_eq!(r["renamed"], json!({"send": "send_r1"}));
    let ids: Vec<&str> =
        r["plan"]["steps"].as_array().expect("steps").iter().map(|s| s["id"].as_str().unwrap_or("")).collect();
    assert_eq!(ids, ["fetch", "send_r1"], "the run's plan from here on");
    assert_calls_were_allowed(&evs);
    let round_calls = of_type(&evs, "model_requested").into_iter().filter(|e| e.step_id == "plan-r1").count();
    assert_eq!(round_calls, 1, "the round's model call is decided and recorded under plan-r1");

    let asked = &model.received()[1].body["messages"];
    let told = asked.as_array().expect("messages").last().expect("last")["content"].as_str().unwrap_or("").to_string();
    assert!(told.contains("Replanning round 1") && told.contains("smtp down") && told.contains("\"data\""), "{told}");

    let t = trace(&mesh, &run).await;
    assert_eq!(t["plan_rounds"].as_array().map(Vec::len), Some(2));
    let node = t["steps"].as_array().expect("nodes").iter().find(|n| n["step_id"] == "send_r1").cloned();
    assert_eq!(node.expect("send_r1 node")["round"], 1);
    let edge = json!({"from": "send", "to": "send_r1", "kind": "replanned_as"});
    assert!(t["edges"].as_array().expect("edges").contains(&edge), "{}", t["edges"]);

    let replayed = mesh
        .runs()
        .replay_run(pb::ReplayRunRequest { tenant: "acme".into(), run_id: run.clone(), policy: 1 })
        .await
        .expect("strict replay of both rounds")
        .into_inner();
    assert_eq!((replayed.outcome.as_str(), replayed.replayed_calls), ("replayed", 2));
    let replayed_plan: Value = serde_json::from_str(&replayed.plan_json).expect("plan");
    assert_eq!(replayed_plan["steps"][1]["id"], "send_r1", "the last round's plan, as it ran");
    assert_eq!(model.received().len(), 2, "nothing asked again");
    assert!(verify(&mut mesh.ledger(), "acme", &run).await.valid);
}

#[tokio::test]
async fn a_failed_plan_is_replanned_keeping_what_completed_on_sqlite() {
    replan(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_failed_plan_is_replanned_keeping_what_completed_on_postgres() {
    replan(Backend::Postgres).await;
}

/// Replanning is bounded: past `executor.max_replan_rounds` the run fails saying so; a round
/// that gives up (a direct response) fails the run with its words; and when the budget is
/// spent the round's model call is denied and the run says so, asking nothing.
#[tokio::test]
async fn replanning_stops_at_its_rounds_a_direct_response_or_the_budget() {
    let failing =
        || Reply::plan(plan_of(json!([{"id": "try", "tool": "fail", "params": {"message": "no"}, "depends_on": []}])));
    // Rounds run out.
    let model = ScriptedModel::start(failing()).await;
    let mesh = mesh_with(Backend::Sqlite, replan_mesh_options(&model, "max_replan_rounds = 1", None)).await;
    let run = submit_goal(&mesh, "Try.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed);
    assert!(done.reason.contains("used its 1 replanning rounds"), "{}", done.reason);
    assert!(done.steps.iter().any(|s| s.id == "try_r1"), "round 1 ran");
    assert_eq!(model.received().len(), 2);
    // Failure memory: round 1 proposed the call that failed again; it is not attempted again.
    let again = done.steps.iter().find(|s| s.id == "try_r1").expect("try_r1");
    assert_eq!(again.status(), pb::StepStatus::Failed);
    assert!(again.error.contains("already failed in this run as step 'try'"), "{}", again.error);
    let evs = run_events(&mesh, &run).await;
    let asked = |sid: &str| {
        evs.iter()
            .filter(|e| e.step_id == sid && matches!(e.event_type.as_str(), "policy_decision" | "tool_requested"))
            .count()
    };
    assert_eq!((asked("try"), asked("try_r1")), (2, 0), "decided and requested once, never again");

    // A round that gives up.
    let model = ScriptedModel::start(failing()).await;
    model.push(failing());
    model.push(Reply::plan(json!({"reasoning": "x", "steps": [], "direct_response": "cannot be done safely"})));
    let mesh = mesh_with(Backend::Sqlite, replan_mesh_options(&model, "", None)).await;
    let run = submit_goal(&mesh, "Try.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed);
    assert!(done.reason.contains("replanning round 1 gave up: cannot be done safely"), "{}", done.reason);

    // The budget is spent: one model call and one tool call of a three-call budget... the
    // round's model call is the third, and a fourth is denied.
    let model = ScriptedModel::start(failing()).await;
    model.push(Reply::plan(plan_of(json!([
        {"id": "a", "tool": "echo", "params": {}, "depends_on": []},
        {"id": "b", "tool": "fail", "params": {"message": "no"}, "depends_on": ["a"]},
    ]))));
    let mesh = mesh_with(Backend::Sqlite, replan_mesh_options(&model, "", Some(3))).await;
    let run = submit_goal(&mesh, "Try.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed);
    assert!(done.reason.contains("replanning round 1: model call denied by"), "{}", done.reason);
    assert_eq!(model.received().len(), 1, "the round asked nothing");
    let evs = run_events(&mesh, &run).await;
    assert!(of_type(&evs, "plan_revised").is_empty());
}

/// Seed 002 critic approvals: under `approval_mode = "critic"` a gated call is reviewed by a
/// model critic instead of a person. The critic's model call is decided (`model.call` under a
/// `critic-…` step) and recorded in the run under its deterministic step key; an approval lets
/// the call run (`critic_approved`), a denial is `critic_denied` — recorded, never retried, the
/// tool never called; deciding the same call again replays the recorded verdict, asking nothing.
#[tokio::test]
async fn a_critic_reviews_gated_calls_and_its_verdicts_are_recorded_and_replayed() {
    let model = ScriptedModel::start(Reply::chat(r#"{"verdict": "deny", "reason": "unscripted"}"#)).await;
    model.push(Reply::chat(r#"{"verdict": "approve", "reason": "an internal address"}"#));
    model.push(Reply::chat(r#"{"verdict": "deny", "reason": "mail to an outsider"}"#));
    let opts = MeshOptions {
        tenants: vec![("acme".into(), tools(&[]))],
        planner_extra: model.openai_config(""),
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec![])],
        tenant_extra: vec![("acme".into(), "approval_mode = \"critic\"".into())],
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let mail = |to: &str| {
        json!({"steps": [{"id": "mail", "tool": "email.send", "params": {"to": to, "subject": "s", "body": "b"}}]})
            .to_string()
    };
    let submit = |plan: String| {
        let mut runs = mesh.runs();
        async move {
            let req = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: plan, ..Default::default() };
            runs.submit_run(req).await.expect("submit").into_inner().run_id
        }
    };
    let approved = submit(mail("ops@example.com")).await;
    let done = settled(&mesh, "acme", &approved).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}\n{}", done.reason, mesh.logs());
    let evs = run_events(&mesh, &approved).await;
    let rules: Vec<String> = of_type(&evs, "policy_decision")
        .iter()
        .filter(|e| e.step_id == "mail")
        .map(|e| payload(e)["rule_id"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(rules, ["critic_approved"]);
    let asked = of_type(&evs, "model_requested");
    assert_eq!(asked.len(), 1);
    assert!(asked[0].step_id.starts_with("critic-"), "{}", asked[0].step_id);
    let step_key = payload(asked[0])["step_key"].as_str().unwrap_or("").to_string();
    assert!(step_key.starts_with("critic::email.send::mail::1::"), "{step_key}");
    assert_calls_were_allowed(&evs);
    assert_eq!(payload(of_type(&evs, "model_completed")[0])["verdict"], "approve");

    let refused = submit(mail("someone@elsewhere.example")).await;
    let done = settled(&mesh, "acme", &refused).await;
    assert_eq!(done.status(), pb::RunStatus::Failed);
    assert!(done.reason.contains("critic_denied") && done.reason.contains("mail to an outsider"), "{}", done.reason);
    assert_eq!(done.steps[0].status(), pb::StepStatus::Denied);
    let evs = run_events(&mesh, &refused).await;
    let decisions = of_type(&evs, "policy_decision").into_iter().filter(|e| e.step_id == "mail").count();
    assert_eq!(decisions, 1, "a denial is never retried");
    assert!(of_type(&evs, "tool_requested").is_empty(), "the tool was never called");
    assert_eq!(mesh.outbox().len(), 1, "only the approved mail went out");
    assert_eq!(model.received().len(), 2);

    // The same call decided again: the recorded verdict is replayed.
    let get = pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: refused.clone(), with_events: false };
    let epoch = mesh.ledger().get_run(get).await.expect("run").into_inner().max_epoch;
    let args = json!({"to": "someone@elsewhere.example", "subject": "s", "body": "b"});
    let again = mesh
        .policy()
        .authorize(pb::AuthorizeRequest {
            tenant: "acme".into(),
            run_id: refused.clone(),
            step_id: "mail".into(),
            attempt: 1,
            tool: "email.send".into(),
            args_json: args.to_string(),
            idempotency_key: format!("{refused}:mail:1"),
            epoch,
            ..Default::default()
        })
        .await
        .expect("authorize")
        .into_inner()
        .decision
        .expect("decision");
    assert_eq!((again.outcome(), again.rule_id.as_str()), (pb::Outcome::Deny, "critic_denied"));
    assert_eq!(model.received().len(), 2, "nothing asked again");
    assert_eq!(of_type(&run_events(&mesh, &refused).await, "model_replayed").len(), 1);
    assert!(verify(&mut mesh.ledger(), "acme", &refused).await.valid);
}

/// Seed 001 child frames: a step with a `subgoal` opens a frame of its own — a goal run whose
/// `run_submitted` names its parent run and step, planned by the model for the sub-goal — and
/// completes with the frame's outputs, which later steps template from. `frame_opened` and
/// `frame_closed` are on the step; the DAG shows the child frame under the root. The frame
/// spends the root run's budget: with three calls for the whole tree, the child's model call
/// and tool call leave the parent one, and a second spends it. Bad sub-goals and depths are
/// refused naming the field; the ledger refuses a frame position that does not follow from
/// its parent's, and a `frame_closed` citing a run that is not the step's frame.
async fn child_frames(backend: Backend) {
    let model = fetching_model().await;
    let mut opts = replan_mesh_options(&model, "", Some(4));
    opts.tenants[0].1.push("sleep".into());
    let mesh = mesh_with(backend, opts).await;
    let work = json!({"max_depth": 1, "steps": [
        {"id": "research", "subgoal": "Find the data"},
        {"id": "report", "tool": "echo", "params": {"found": "{{research.output.outputs.fetch.v}}"}, "depends_on": ["research"]},
    ]});
    let run = crate::submit(&mesh, "acme", &work.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}\n{}", done.reason, mesh.logs());
    let report = done.steps.iter().find(|s| s.id == "report").expect("report");
    assert_eq!(report.output_json, json!({"found": "data"}).to_string(), "templated from the frame's output");

    let evs = run_events(&mesh, &run).await;
    let opened = payload(of_type(&evs, "frame_opened")[0]);
    let child = opened["child_run_id"].as_str().expect("child").to_string();
    assert_eq!((opened["subgoal"].clone(), opened["depth"].clone()), (json!("Find the data"), json!(1)));
    let closed = payload(of_type(&evs, "frame_closed")[0]);
    assert_eq!(closed["status"], "completed");
    let child_evs = run_events(&mesh, &child).await;
    let submitted = payload(&child_evs[0]);
    assert_eq!(submitted["goal"], "Find the data");
    assert_eq!(submitted["parent_run_id"], json!(run));
    assert_eq!(
        (
            submitted["frame"]["depth"].clone(),
            submitted["frame"]["root_run_id"].clone(),
            submitted["frame"]["step_id"].clone()
        ),
        (json!(1), json!(run), json!("research"))
    );
    assert_eq!(of_type(&child_evs, "model_requested").len(), 1, "the frame was planned by the model");
    assert!(
        verify(&mut mesh.ledger(), "acme", &run).await.valid && verify(&mut mesh.ledger(), "acme", &child).await.valid
    );

    let t = trace(&mesh, &run).await;
    let node = t["dag"]["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["id"] == json!(format!("frame:{child}")))
        .cloned();
    let node = node.expect("the child frame's node");
    assert_eq!(
        (node["kind"].clone(), node["parent_frame_id"].clone(), node["status"].clone()),
        (json!("frame"), json!("frame:root"), json!("completed"))
    );
    let opens = json!({"from": "step:research", "to": format!("frame:{child}"), "kind": "opens"});
    assert!(t["dag"]["edges"].as_array().expect("edges").contains(&opens));
    // The frame's own DAG is nested inside it.
    let fetch = t["dag"]["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["id"] == json!(format!("{child}/step:fetch")))
        .cloned();
    assert_eq!(fetch.expect("the child's step, nested")["frame_id"], json!(format!("frame:{child}")));

    // One budget for the tree: 4 calls; the child's model call and echo, the parent's echo
    // (3 in all) fit; a second tree's child spends 2 of its own 4 — budgets are per root.
    // Here a root whose two frames would need 4 calls plus its own step is refused its step.
    let work = json!({"steps": [
        {"id": "one", "subgoal": "Find one"},
        {"id": "two", "subgoal": "Find two", "depends_on": ["one"]},
        {"id": "last", "tool": "echo", "params": {}, "depends_on": ["two"]},
    ]});
    let run = crate::submit(&mesh, "acme", &work.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed, "{}", done.reason);
    let last = done.steps.iter().find(|s| s.id == "last").expect("last");
    assert_eq!(last.status(), pb::StepStatus::Denied, "{}", last.error);
    assert!(last.error.contains("run_call_limit"), "the root's budget was spent by its frames: {}", last.error);

    // Cancelling a run cancels the frame it waits on.
    model.push(Reply::plan(plan_of(json!([{"id": "nap", "tool": "sleep", "params": {"ms": 5000}, "depends_on": []}]))));
    let work = json!({"steps": [{"id": "slow", "subgoal": "Take a nap"}]});
    let parent = crate::submit(&mesh, "acme", &work.to_string()).await;
    let opened = crate::first_event(&mesh, "acme", &parent, |e| e.event_type == "frame_opened").await;
    let nap = payload(&opened)["child_run_id"].as_str().expect("child").to_string();
    crate::first_event(&mesh, "acme", &nap, |e| e.event_type == "tool_requested").await;
    // A person asks the frame itself to end first (the nap settles before it does); the
    // parent's own request follows under a key of its own — no conflict with the person's.
    let person = pb::CancelRunRequest { tenant: "acme".into(), run_id: nap.clone(), reason: "stop it".into() };
    mesh.runs().cancel_run(person).await.expect("cancel the frame");
    let cancel = pb::CancelRunRequest { tenant: "acme".into(), run_id: parent.clone(), reason: "enough".into() };
    mesh.runs().cancel_run(cancel).await.expect("cancel");
    let done = settled(&mesh, "acme", &parent).await;
    assert_eq!(done.status(), pb::RunStatus::Cancelled, "{}\n{}", done.reason, mesh.logs());
    let child_run = settled(&mesh, "acme", &nap).await;
    assert_eq!(child_run.status(), pb::RunStatus::Cancelled, "the frame ended with its parent: {}", child_run.reason);
    let asked = run_events(&mesh, &nap).await;
    let reasons: Vec<Value> =
        of_type(&asked, "run_cancel_requested").iter().map(|e| payload(e)["reason"].clone()).collect();
    let parents = json!(format!("its parent run {parent} was cancelled"));
    assert!(reasons.contains(&json!("stop it")) && reasons.contains(&parents), "{reasons:?}");

    // Bad input.
    for (plan_json, field) in [
        (json!({"max_depth": 0, "steps": [{"id": "a", "subgoal": "x"}]}), "plan_json.max_depth"),
        (json!({"max_depth": 99, "steps": [{"id": "a", "subgoal": "x"}]}), "plan_json.max_depth"),
        (json!({"steps": [{"id": "a", "subgoal": ""}]}), "plan_json.steps[a].subgoal"),
        (json!({"steps": [{"id": "a", "subgoal": "x", "tool": "echo"}]}), "plan_json.steps[a].subgoal"),
        (json!({"steps": [{"id": "a", "subgoal": "y".repeat(3000)}]}), "plan_json.steps[a].subgoal"),
        (json!({"steps": [{"id": "a", "subgoal": "{{b.output"}]}), "plan_json.steps[a].subgoal"),
    ] {
        let req =
            pb::SubmitRunRequest { tenant: "acme".into(), plan_json: plan_json.to_string(), ..Default::default() };
        let e = mesh.runs().submit_run(req).await.expect_err(field);
        assert_field_violation(&e, field);
    }
    let mut ledger = mesh.ledger();
    let live = crate::empty_run(&mut ledger, "acme").await;
    let frame = |depth: u32, parent: &str| pb::CreateRunRequest {
        tenant: "acme".into(),
        goal: "Find the data".into(),
        parent_run_id: parent.to_string(),
        frame_json: json!({"depth": depth, "max_depth": 2, "goals": vec!["0".repeat(64); depth as usize],
                           "root_run_id": parent, "parent_run_id": parent, "step_id": "one"})
        .to_string(),
        ..Default::default()
    };
    let e = ledger.create_run(frame(2, &live)).await.expect_err("a position not its parent's");
    assert_field_violation(&e, "frame_json");
    let huge =
        pb::CreateRunRequest { frame_json: format!("{{\"goals\": [{}]}}", "\"x\",".repeat(2000)), ..frame(1, &live) };
    assert_field_violation(&ledger.create_run(huge).await.expect_err("an oversized position"), "frame_json");
    let e = ledger.create_run(frame(1, &run)).await.expect_err("an ended parent");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    // A live run citing another run's frame as its step's: refused, nothing written.
    let close = pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: live.clone(),
        epoch: 1,
        idempotency_key: "forged-close".into(),
        event_type: "frame_closed".into(),
        payload_json: json!({"child_run_id": child, "status": "completed", "output": {}}).to_string(),
        step_id: "research".into(),
    };
    let e = ledger.append_event(close).await.expect_err("not this step's frame");
    assert_field_violation(&e, "payload_json.child_run_id");
    assert_eq!(events(&mut ledger, "acme", &live).await.len(), 1, "nothing written");
    // A frame's key is the mesh's: a submission may not take it.
    let req = pb::SubmitRunRequest {
        tenant: "acme".into(),
        goal: "x".into(),
        idempotency_key: format!("frame:{live}:a"),
        ..Default::default()
    };
    assert_field_violation(&mesh.runs().submit_run(req).await.expect_err("reserved key"), "idempotency_key");
}

#[tokio::test]
async fn a_subgoal_opens_a_child_frame_that_shares_the_budget_on_sqlite() {
    child_frames(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_subgoal_opens_a_child_frame_that_shares_the_budget_on_postgres() {
    child_frames(Backend::Postgres).await;
}

/// Seed 001's time budget: a run tree has `max_run_ms` from its root's submission, and a
/// child frame has what is left of it. Past it every further call is denied `run_time_limit`
/// — the root's own next step, and the model call that would plan its child frame, which is
/// never asked.
#[tokio::test]
async fn a_frame_inherits_what_is_left_of_its_roots_time_budget() {
    let model = fetching_model().await;
    let mut opts = replan_mesh_options(&model, "", None);
    opts.tenants[0].1.push("sleep".into());
    opts.tenant_extra = vec![("acme".into(), "max_run_ms = 1500".into())];
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let work = json!({"steps": [
        {"id": "nap", "tool": "sleep", "params": {"ms": 1700}},
        {"id": "after", "tool": "echo", "params": {}, "depends_on": ["nap"]},
        {"id": "research", "subgoal": "Find the data", "depends_on": ["nap"]},
    ]});
    let run = crate::submit(&mesh, "acme", &work.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed, "{}\n{}", done.reason, mesh.logs());
    let step = |id: &str| done.steps.iter().find(|s| s.id == id).expect("step").clone();
    assert_eq!(step("nap").status(), pb::StepStatus::Completed, "in time: {}", step("nap").error);
    assert_eq!(step("after").status(), pb::StepStatus::Denied, "{}", step("after").error);
    assert!(step("after").error.contains("run_time_limit"), "{}", step("after").error);
    let research = step("research");
    assert_eq!(research.status(), pb::StepStatus::Failed, "{}", research.error);
    let evs = run_events(&mesh, &run).await;
    let opened = of_type(&evs, "frame_opened");
    let child =
        payload(opened.first().expect("the frame was opened"))["child_run_id"].as_str().expect("child").to_string();
    let child_run = settled(&mesh, "acme", &child).await;
    assert_eq!(child_run.status(), pb::RunStatus::Failed, "{}", child_run.reason);
    assert!(child_run.reason.contains("run_time_limit"), "the frame had no time left: {}", child_run.reason);
    assert!(model.received().is_empty(), "the frame's model call was denied before it was made");
}

/// The model plans branches and decompositions itself: the strict schema offers each step
/// `alternatives` and a `subgoal` step kind. A goal run whose model answer names an
/// alternative for a failing call and a sub-goal completes: the call moves to its alternative
/// (`step_branched`), the sub-goal opens a child frame planned by the model in turn, and a
/// later step templates from the frame's output. A frame the model opens at the depth limit
/// fails `frame_depth_exhausted` — recorded, never an unbounded recursion.
#[tokio::test]
async fn the_model_plans_alternatives_and_subgoals() {
    // Asked first: the root's plan; every later answer (the frame's): one fetch.
    let model = ScriptedModel::start(Reply::plan(plan_of(json!([
        {"id": "fetch", "tool": "echo", "params": {"v": "data"}, "depends_on": [], "alternatives": []},
    ]))))
    .await;
    model.push(Reply::plan(plan_of(json!([
        {"id": "send", "tool": "fail", "params": {"message": "smtp down"}, "depends_on": [],
         "alternatives": [{"tool": "echo", "params": {"sent": "by echo"}}]},
        {"id": "research", "subgoal": "Find the data", "depends_on": []},
        {"id": "report", "tool": "echo", "params": {"found": "{{research.output.outputs.fetch.v}}"},
         "depends_on": ["research", "send"], "alternatives": []},
    ]))));
    let mesh = mesh_with(Backend::Sqlite, replan_mesh_options(&model, "", None)).await;
    let run = submit_goal(&mesh, "Send the data and report it.", pb::ReplayPolicy::Strict).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}\n{}", done.reason, mesh.logs());
    let step = |id: &str| done.steps.iter().find(|s| s.id == id).unwrap_or_else(|| panic!("{id}")).clone();
    assert_eq!(step("send").output_json, json!({"sent": "by echo"}).to_string());
    assert_eq!(step("report").output_json, json!({"found": "data"}).to_string());
    let schema = &model.received()[0].body["response_format"]["json_schema"]["schema"];
    let kinds = schema["properties"]["steps"]["items"]["anyOf"].as_array().expect("kinds");
    assert!(kinds.iter().any(|k| k["required"] == json!(["id", "subgoal", "depends_on"])), "{schema}");
    let evs = run_events(&mesh, &run).await;
    assert_eq!(of_type(&evs, "step_branched").len(), 1);
    let child = payload(of_type(&evs, "frame_opened")[0])["child_run_id"].as_str().expect("child").to_string();
    assert_eq!(of_type(&run_events(&mesh, &child).await, "model_requested").len(), 1, "the frame was planned");

    // A frame that would open below the depth limit (max_depth 1: the root's frame may not
    // open one of its own) fails its step, structured; the frame's replanning sees it (and
    // here completes with the fetch it is answered next).
    model.push(Reply::plan(plan_of(json!([{"id": "deeper", "subgoal": "Go deeper", "depends_on": []}]))));
    let work = json!({"max_depth": 1, "steps": [{"id": "dive", "subgoal": "Dive"}]});
    let root = crate::submit(&mesh, "acme", &work.to_string()).await;
    settled(&mesh, "acme", &root).await;
    let evs = run_events(&mesh, &root).await;
    let frame = payload(of_type(&evs, "frame_opened")[0])["child_run_id"].as_str().expect("child").to_string();
    let frame_evs = run_events(&mesh, &frame).await;
    let failed = of_type(&frame_evs, "step_failed");
    let kinds: Vec<Value> = failed.iter().map(|e| payload(e)["kind"].clone()).collect();
    assert!(kinds.contains(&json!("frame_depth_exhausted")), "{kinds:?}\n{}", mesh.logs());
    assert!(of_type(&frame_evs, "frame_opened").is_empty(), "nothing opened past the limit");
}

/// The number of frames a run tree opens is bounded too (`ledger.max_frames_per_root`), so a
/// plan whose frames open frames cannot fan out without end. The count is the whole tree's:
/// with a limit of 2, the root's first frame and the frame it opens in turn spend it, and the
/// root's second frame is refused (FAILED_PRECONDITION, nothing written) — its step fails
/// `frame_refused`.
async fn frame_limit(backend: Backend) {
    let model = fetching_model().await;
    // The first frame's plan opens a frame of its own; every later answer is one fetch.
    model.push(Reply::plan(plan_of(json!([
        {"id": "deeper", "subgoal": "Go deeper", "depends_on": []},
    ]))));
    let mut opts = replan_mesh_options(&model, "", None);
    opts.env.push(("WARDEN_LEDGER__MAX_FRAMES_PER_ROOT".into(), "2".into()));
    let mesh = mesh_with(backend, opts).await;
    let work = json!({"max_depth": 2, "steps": [
        {"id": "one", "subgoal": "Find one"},
        {"id": "two", "subgoal": "Find two", "depends_on": ["one"]},
    ]});
    let run = crate::submit(&mesh, "acme", &work.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed, "{}\n{}", done.reason, mesh.logs());
    let step = |id: &str| done.steps.iter().find(|s| s.id == id).expect("step").clone();
    assert_eq!(step("one").status(), pb::StepStatus::Completed, "{}", step("one").error);
    assert_eq!(step("two").status(), pb::StepStatus::Failed);
    assert!(step("two").error.contains("max_frames_per_root"), "{}", step("two").error);
    let evs = run_events(&mesh, &run).await;
    assert_eq!(of_type(&evs, "frame_opened").len(), 1, "the root's second frame was refused");
    let failed = of_type(&evs, "step_failed");
    assert!(failed.iter().any(|e| payload(e)["kind"] == "frame_refused"), "structured");
    let child = payload(of_type(&evs, "frame_opened")[0])["child_run_id"].as_str().expect("child").to_string();
    let nested = of_type(&run_events(&mesh, &child).await, "frame_opened").len();
    assert_eq!(nested, 1, "the first frame opened one of its own, counted against the root");
    let all = mesh.runs().list_runs(pb::ListRunsRequest { tenant: "acme".into(), ..Default::default() }).await;
    assert_eq!(all.expect("list").into_inner().runs.len(), 3, "the root and its two frames: nothing else written");
}

#[tokio::test]
async fn a_run_tree_opens_at_most_its_frame_limit_on_sqlite() {
    frame_limit(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_run_tree_opens_at_most_its_frame_limit_on_postgres() {
    frame_limit(Backend::Postgres).await;
}
