//! The console against a real mesh: its API's security answers (no browser), the approval
//! flow end to end in headless Chromium — a run waits for a person, the person sees it in the
//! inbox, approves it by keyboard, watches the run complete in the DAG view and verifies it —
//! and a goal run's planning round, with the model call it made, in the DAG view.
//! Screenshots of each page are saved under `target/console-screenshots/` for a person to look
//! at (they are not committed).

mod browser;
mod http;

use std::path::PathBuf;

use serde_json::json;
use warden_console::MeshEndpoints;
use warden_proto::v1 as pb;
use warden_proto::v1::approvals_client::ApprovalsClient;
use warden_testkit::{Mesh, MeshOptions};

use crate::scripted_model::{Reply, ScriptedModel};
use crate::*;

const OPS: &str = "ops-token-console-0123456789";
const ALICE: &str = "alice-token-console-0123456789";
const ACME: &str = "acme-token-console-0123456789";

/// A mesh with authentication on: an operator, acme's own token and alice, acme's approver of
/// `email.send`, who may also delegate `kv.*` capabilities.
fn options() -> MeshOptions {
    MeshOptions {
        auth_tokens: vec![(OPS.into(), "*".into()), (ALICE.into(), "acme@alice".into()), (ACME.into(), "acme".into())],
        service_token: OPS.into(),
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec!["alice".into()])],
        tenant_extra: vec![("acme".into(), "delegable_tools = [\"kv.*\"]".into())],
        ..MeshOptions::default()
    }
}

/// The console in this process, for `mesh`; answers its base URL.
async fn console_for(endpoints: MeshEndpoints) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the console");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(warden_console::serve(listener, endpoints, async {
        let _ = stopped.await;
    }));
    (url, stop)
}

fn endpoints(mesh: &Mesh) -> MeshEndpoints {
    MeshEndpoints {
        runs: mesh.executors[0].endpoint.clone(),
        ledger: mesh.ledger.endpoint.clone(),
        policy: mesh.policy.endpoint.clone(),
    }
}

fn screenshots() -> PathBuf {
    let target = warden_testkit::mesh::bin_dir().ok().and_then(|d| d.parent().map(PathBuf::from));
    target.unwrap_or_else(|| PathBuf::from("target")).join("console-screenshots")
}

async fn get(url: &str, token: &str) -> http::Reply {
    let auth = format!("Bearer {token}");
    let headers: Vec<(&str, &str)> = if token.is_empty() { vec![] } else { vec![("Authorization", auth.as_str())] };
    http::request("GET", url, &headers, "").await.expect("GET")
}

/// The console's security answers: every response carries the strict Content-Security-Policy;
/// a state-changing request without a bearer token, from a foreign origin, or with a form body
/// is refused before it reaches the mesh; a refused token is 401, another tenant 403, a bad id
/// 400 naming the field; and a mesh that is down is 503.
#[tokio::test]
async fn console_api_sends_a_strict_csp_and_refuses_unsafe_requests() {
    let mesh = mesh_with(Backend::Sqlite, MeshOptions { executors: 1, ..options() }).await;
    let (url, _stop) = console_for(endpoints(&mesh)).await;

    let page = get(&format!("{url}/"), "").await;
    assert_eq!(page.status, 200);
    assert_eq!(page.header("content-security-policy"), Some(warden_console::guard::CONTENT_SECURITY_POLICY));
    assert_eq!(page.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(page.header("referrer-policy"), Some("no-referrer"));
    assert!(page.body.contains("/app.js"), "the app is served");
    let script = get(&format!("{url}/app.js"), "").await;
    assert!(script.header("content-type").is_some_and(|t| t.starts_with("text/javascript")));

    let approve = format!("{url}/api/approvals/apr-0/approve");
    let origin = url.clone();
    let body = json!({"tenant": "acme", "reason": "ok"}).to_string();
    let bearer = format!("Bearer {ALICE}");
    let post = |headers: Vec<(&'static str, String)>| {
        let approve = approve.clone();
        let body = body.clone();
        async move {
            let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            http::request("POST", &approve, &h, &body).await.expect("POST")
        }
    };
    let json_type = ("Content-Type", "application/json".to_string());
    let no_token = post(vec![json_type.clone(), ("Origin", origin.clone())]).await;
    assert_eq!((no_token.status, no_token.json()["error"]["code"].clone()), (401, json!("unauthenticated")));
    assert!(no_token.header("content-security-policy").is_some(), "errors carry the policy too");
    let foreign =
        post(vec![json_type.clone(), ("Authorization", bearer.clone()), ("Origin", "http://evil.example".into())])
            .await;
    assert_eq!(foreign.status, 403, "{}", foreign.body);
    let cross =
        post(vec![json_type.clone(), ("Authorization", bearer.clone()), ("Sec-Fetch-Site", "cross-site".into())]).await;
    assert_eq!(cross.status, 403, "{}", cross.body);
    let form =
        post(vec![("Content-Type", "application/x-www-form-urlencoded".into()), ("Authorization", bearer.clone())])
            .await;
    assert_eq!(form.status, 415, "{}", form.body);
    let rebound = http::request(
        "GET",
        &format!("{url}/api/runs?tenant=acme"),
        &[("Host", "evil.example"), ("Authorization", &bearer)],
        "",
    )
    .await
    .expect("GET");
    assert_eq!(rebound.status, 403, "a foreign host name is refused: {}", rebound.body);
    // Same origin, a token and JSON: it reaches the mesh, which does not know the approval.
    let reached = post(vec![json_type, ("Authorization", bearer.clone()), ("Origin", origin)]).await;
    assert_eq!(reached.status, 404, "{}", reached.body);

    let refused = get(&format!("{url}/api/runs?tenant=acme"), "not-a-token").await;
    assert_eq!(refused.status, 401, "{}", refused.body);
    assert_eq!(get(&format!("{url}/api/runs?tenant=acme"), ALICE).await.status, 200);
    assert_eq!(get(&format!("{url}/api/runs?tenant=globex"), ALICE).await.status, 403, "another tenant");
    let bad = get(&format!("{url}/api/runs?tenant=..%2Fetc"), ALICE).await;
    assert_eq!((bad.status, bad.json()["error"]["field"].clone()), (400, json!("tenant")));
    let unknown = get(&format!("{url}/api/runs?tenant=acme&page_size=100000"), ALICE).await;
    assert_eq!((unknown.status, unknown.json()["error"]["field"].clone()), (400, json!("page_size")));

    // A mesh that is not there: 503, said plainly.
    let closed = format!("http://127.0.0.1:{}", warden_testkit::procs::free_port().expect("port"));
    let (down, _stop_down) = console_for(MeshEndpoints::single(&closed)).await;
    let unreachable = get(&format!("{down}/api/runs?tenant=acme"), ALICE).await;
    assert_eq!((unreachable.status, unreachable.json()["error"]["code"].clone()), (503, json!("unavailable")));
}

/// The scenario in a real browser: a run that needs approval appears in the inbox with
/// the exact arguments and their digest; alice approves it with the keyboard; the run page's
/// DAG shows it complete, live; "verify this run" says valid. A refused token shows the error
/// state. Screenshots of each page are saved.
#[tokio::test]
async fn console_in_a_browser_approves_a_waiting_run_and_verifies_it() {
    let mut mesh = mesh_with(Backend::Sqlite, options()).await;
    let (url, _stop) = console_for(endpoints(&mesh)).await;
    let shots = screenshots();
    let b = browser::Browser::start(&shots).await.expect("start headless Chromium");

    // Sign-in, and a token the mesh refuses.
    b.goto(&format!("{url}/")).await.expect("open the console");
    b.element("#token").await.expect("sign-in form");
    b.screenshot("01-sign-in.png").await.expect("screenshot");
    b.type_into("#token", "not-a-token").await.expect("type");
    b.clear("#tenant").await.expect("clear");
    b.type_into("#tenant", "acme").await.expect("tenant");
    b.type_into("#tenant", browser::ENTER).await.expect("submit with Enter");
    b.wait_text("#signin-error", "the refusal", |t| t.contains("refused")).await.expect("token refused");
    b.screenshot("02-token-refused.png").await.expect("screenshot");

    b.type_into("#token", ALICE).await.expect("type");
    b.clear("#tenant").await.expect("clear");
    b.type_into("#tenant", "acme").await.expect("tenant");
    b.click("#sign-in").await.expect("sign in");
    b.wait_text("main", "the empty runs list", |t| t.contains("No runs yet")).await.expect("runs page");
    b.screenshot("03-runs-empty.png").await.expect("screenshot");

    // A run that needs approval: greet, then a mail built from greet's output.
    let plan = plan(&[
        ("greet", "echo", json!({"message": "quarterly report"}), &[]),
        (
            "mail",
            "email.send",
            json!({"to": "ops@example.com", "subject": "s", "body": "{{greet.output.message}}"}),
            &["greet"],
        ),
    ]);
    let run_id = mesh
        .runs_as(ALICE)
        .submit_run(pb::SubmitRunRequest { tenant: "acme".into(), plan_json: plan, ..Default::default() })
        .await
        .expect("submit")
        .into_inner()
        .run_id;

    // The inbox shows it live, with the exact arguments and their digest.
    b.goto(&format!("{url}/#/approvals")).await.expect("inbox");
    let card = "#approvals article.pending";
    b.wait_text(card, "the arguments", |t| t.contains("ops@example.com") && t.contains("quarterly report"))
        .await
        .expect("the approval appears with its arguments");
    let mut approvals = ApprovalsClient::new(mesh.policy.channel_as(OPS));
    let pending = approvals
        .list(pb::ListApprovalsRequest {
            tenant: "acme".into(),
            state: pb::ApprovalState::Pending as i32,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
        .approvals;
    assert_eq!(pending.len(), 1);
    let shown = b.text(card).await.expect("card");
    assert!(shown.contains(&pending[0].args_sha256), "the card shows the digest: {shown}");
    assert!(shown.contains("hash to the digest"), "the arguments shown hash to it: {shown}");
    assert!(shown.contains("alice"), "who may approve: {shown}");
    b.screenshot("04-approval-inbox.png").await.expect("screenshot");

    // Approve with the keyboard: type the reason, then Enter on the focused Approve button.
    b.type_into(&format!("{card} textarea.reason"), "the report is due").await.expect("reason");
    b.type_into(&format!("{card} button.approve"), browser::ENTER).await.expect("approve by keyboard");
    b.wait_text("#approvals", "the inbox emptied", |t| t.contains("No approvals are waiting")).await.expect("resolved");
    let resolved = approvals
        .get(pb::GetApprovalRequest { tenant: "acme".into(), approval_id: pending[0].approval_id.clone() })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(
        (resolved.state(), resolved.approver.as_str()),
        (pb::ApprovalState::Approved, "alice"),
        "as the token's person"
    );
    assert_eq!(resolved.reason, "the report is due");

    // The run page: it completes live in the DAG view; each node opens its detail.
    b.goto(&format!("{url}/#/runs/{run_id}")).await.expect("run page");
    b.wait_text("#run-status", "completed", |t| t == "completed").await.expect("the run completes");
    b.element("[data-node=\"step:greet\"]").await.expect("greet drawn");
    b.click("[data-node=\"attempt:mail:1\"]").await.expect("open the mail attempt");
    let detail = b
        .wait_text("#node-detail", "the decision and receipt", |t| t.contains("approval_gate") && t.contains("Receipt"))
        .await
        .expect("detail");
    assert!(detail.contains("approved by alice"), "the decision's reason: {detail}");
    b.screenshot("05-run-dag.png").await.expect("screenshot");
    b.click("#verify").await.expect("verify");
    b.wait_text("#verify-result", "valid", |t| t.starts_with("valid")).await.expect("the run verifies");
    b.screenshot("06-run-verified.png").await.expect("screenshot");

    // Receipts, with verify there too.
    b.goto(&format!("{url}/#/runs/{run_id}/receipts")).await.expect("receipts");
    b.wait_text("#receipts-table", "two ok receipts", |t| t.matches("ok").count() >= 2).await.expect("receipts");
    b.click("#verify").await.expect("verify");
    b.wait_text("#verify-result", "valid", |t| t.starts_with("valid")).await.expect("valid");
    b.screenshot("07-receipts.png").await.expect("screenshot");

    // The runs list, filtered by status.
    b.goto(&format!("{url}/#/runs")).await.expect("runs");
    b.wait_text("#runs-table", "the run", |t| t.contains("completed")).await.expect("listed");
    b.screenshot("08-runs.png").await.expect("screenshot");

    // Capabilities: issue within alice's authority (kv.*), then revoke.
    b.goto(&format!("{url}/#/capabilities")).await.expect("capabilities");
    b.wait_text("main", "the empty list", |t| t.contains("No capabilities")).await.expect("empty");
    b.type_into("#cap-tools", "kv.*").await.expect("tools");
    b.type_into("#cap-tools", browser::ENTER).await.expect("issue");
    b.wait_text("#cap-handle", "the handle", |t| t.starts_with("wcap_")).await.expect("issued");
    b.wait_text("#caps-table", "the capability", |t| t.contains("kv.*")).await.expect("listed");
    b.screenshot("09-capabilities.png").await.expect("screenshot");
    b.type_into("#caps-table input", "no longer needed").await.expect("reason");
    b.click("#caps-table button.danger").await.expect("revoke");
    b.wait_text("#caps-table", "revoked", |t| t.contains("revoked")).await.expect("revoked");

    // A narrow screen: the run page stacks the DAG above its detail.
    b.resize(420, 800).await.expect("resize");
    b.goto(&format!("{url}/#/runs/{run_id}")).await.expect("run page");
    b.wait_text("#run-status", "completed", |t| t == "completed").await.expect("narrow run page");
    b.screenshot("10-run-narrow.png").await.expect("screenshot");
    let verified = verify(&mut mesh.ledger(), "acme", &run_id).await;
    assert!(verified.valid);

    // The mesh goes down: the page says so instead of showing nothing.
    b.resize(1280, 800).await.expect("resize");
    mesh.ledger.kill();
    b.goto(&format!("{url}/#/runs")).await.expect("runs");
    b.wait_text("main", "the outage", |t| t.contains("unreachable")).await.expect("mesh down is shown");
    b.screenshot("11-mesh-down.png").await.expect("screenshot");
}

/// Signs `b` in to the console at `url` as `token` for `tenant`, and waits for the runs page.
async fn sign_in(b: &browser::Browser, url: &str, token: &str, tenant: &str) {
    b.goto(&format!("{url}/")).await.expect("open the console");
    b.type_into("#token", token).await.expect("token");
    b.clear("#tenant").await.expect("clear");
    b.type_into("#tenant", tenant).await.expect("tenant");
    b.click("#sign-in").await.expect("sign in");
    b.wait_text("main", "the runs page", |t| t.contains("Runs")).await.expect("signed in");
}

/// A goal run planned through a scripted model (120 input and 30 output tokens, priced at 2 and
/// 10 per million): the run page shows the goal, draws the planning round as a node before the
/// steps with an edge to the root step, and the round's detail, opened with the keyboard, lists
/// the model call with its tokens and cost. The attempt's detail no longer claims a model.
#[tokio::test]
async fn console_in_a_browser_shows_a_goal_runs_planning_and_its_model_call() {
    let plan = json!({"reasoning": "echo it", "direct_response": null,
                      "steps": [{"id": "say", "tool": "echo", "params": {"text": "hello"}, "depends_on": []}]});
    let model = ScriptedModel::start(Reply::plan(plan)).await;
    let tools = ["echo", "kv.*", "email.send", "model.call"].map(String::from).to_vec();
    let opts =
        MeshOptions { tenants: vec![("acme".into(), tools)], planner_extra: model.openai_config(""), ..options() };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run_id = mesh
        .runs_as(ACME)
        .submit_run(pb::SubmitRunRequest { tenant: "acme".into(), goal: "Say hello.".into(), ..Default::default() })
        .await
        .unwrap_or_else(|s| panic!("submit failed: {s:?}\n{}", mesh.logs()))
        .into_inner()
        .run_id;
    let done = settled(&mesh, "acme", &run_id).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{done:?}\n{}", mesh.logs());
    assert_eq!(model.received().len(), 1, "the model was asked once");

    let (url, _stop) = console_for(endpoints(&mesh)).await;
    let b = browser::Browser::start(&screenshots()).await.expect("start headless Chromium");
    sign_in(&b, &url, ALICE, "acme").await;
    b.goto(&format!("{url}/#/runs/{run_id}")).await.expect("run page");
    b.wait_text("#run-status", "completed", |t| t == "completed").await.expect("the run is shown");
    b.wait_text("#run-goal", "the goal", |t| t == "Say hello.").await.expect("the goal is shown");
    let label = b
        .eval(
            "const e = document.querySelector(arguments[0]); return e ? e.getAttribute('aria-label') : ''",
            json!(["[data-node=\"plan:0\"]"]),
        )
        .await
        .expect("label");
    assert!(label.as_str().is_some_and(|l| l.starts_with("Planning: model")), "the round's label: {label}");
    b.element("[data-edge=\"plan:0->say\"]").await.expect("an edge from the planning round to the root step");
    let drawn = b.eval("return document.querySelector(arguments[0]).textContent", json!(["[data-node=\"plan:0\"]"]));
    let drawn = drawn.await.expect("the node's text");
    assert!(drawn.as_str().is_some_and(|t| t.contains("plan") && t.contains("model · 1 step")), "{drawn}");

    // Tab-and-Enter on the planning round opens its detail: the model call, tokens and cost.
    b.press("[data-node=\"plan:0\"]", browser::ENTER).await.expect("open the planning round by keyboard");
    let detail = b
        // The root frame's detail also totals the tokens: wait for the round's own (its step key).
        .wait_text("#node-detail", "the model call's tokens and cost", |t| {
            t.contains("plan:r0:a1") && t.contains("120 in · 30 out") && t.contains("0.00054")
        })
        .await
        .expect("the model call");
    for shown in ["Planning", "model", "plan:r0:a1", "openai / scripted-model", "ok", "ms", "never", "1 step: say"] {
        assert!(detail.contains(shown), "the detail shows {shown:?}: {detail}");
    }
    assert!(
        b.eval("return document.activeElement.getAttribute('data-node')", json!([])).await.expect("focus")
            == json!("plan:0"),
        "the focus stays on the node"
    );
    b.screenshot("12-goal-run-planning.png").await.expect("screenshot");

    // The step's attempt is a tool call; its detail says nothing of a model.
    b.click("[data-node=\"attempt:say:1\"]").await.expect("open the attempt");
    let attempt =
        b.wait_text("#node-detail", "the attempt", |t| t.contains("Attempt 1 of say")).await.expect("attempt");
    assert!(!attempt.contains("Model call"), "no model section on a tool attempt: {attempt}");
    b.press("[data-node=\"frame\"]", browser::ENTER).await.expect("open the frame");
    b.wait_text("#node-detail", "the run's model totals", |t| t.contains("Model calls") && t.contains("0.00054"))
        .await
        .expect("frame totals");

    // Narrow: the detail stacks below the DAG, which scrolls sideways.
    b.resize(420, 800).await.expect("resize");
    b.press("[data-node=\"plan:0\"]", browser::ENTER).await.expect("open the planning round");
    b.wait_text("#node-detail", "the model call", |t| t.contains("120 in · 30 out")).await.expect("narrow detail");
    b.screenshot("13-goal-run-planning-narrow.png").await.expect("screenshot");
}
