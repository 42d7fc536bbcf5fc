//! `warden bench --suite policy`: decision cost in process (50 Cedar policies, every built-in
//! invariant on) and `Policy.Authorize` over loopback gRPC in the dev shape (each decision is
//! appended to the ledger before it is answered, as in production).

use std::time::Instant;

use hdrhistogram::Histogram;
use serde_json::json;
use warden_config::{InvariantConfig, TenantPolicy, WardenConfig};
use warden_policy::invariants;
use warden_proto::v1 as pb;

const TOOLS: usize = 50;

fn schema() -> String {
    let mut s = String::from("entity Tenant;\nentity Agent in [Tenant];\nentity Tool;\n");
    for i in 0..TOOLS {
        s.push_str(&format!(
            "action \"tool{i}\" appliesTo {{ principal: [Tenant, Agent], resource: [Tool], context: {{ to: String, amount: Long, approved: Bool, code?: String }} }};\n"
        ));
    }
    s
}

/// 50 policies: permits per tool for one tenant, forbids with conditions on the context.
fn policies() -> String {
    let mut s = String::new();
    for i in 0..TOOLS {
        if i % 2 == 0 {
            s.push_str(&format!("@id(\"p{i}\") permit(principal in Tenant::\"acme\", action == Action::\"tool{i}\", resource) when {{ context.amount < 1000 }};\n"));
        } else {
            s.push_str(&format!("@id(\"f{i}\") forbid(principal, action == Action::\"tool{i}\", resource) unless {{ context.to like \"*@example.com\" && context.approved }};\n"));
        }
    }
    s
}

fn invariants_all() -> Vec<InvariantConfig> {
    vec![
        InvariantConfig::RequiredArgTrue { tool: "tool*".into(), field: "approved".into() },
        InvariantConfig::EmailDomainAllowlist {
            tool: "tool*".into(),
            field: "to".into(),
            domains: vec!["example.com".into()],
            allow_multiple: false,
        },
        InvariantConfig::RecipientMustBeVerified {
            tool: "tool*".into(),
            field: "to".into(),
            verified: vec!["ops@example.com".into()],
        },
        InvariantConfig::CustomJsonRule {
            tool: "tool*".into(),
            field: "amount".into(),
            op: "lte".into(),
            value: json!(1000),
        },
    ]
}

/// The Python invariants too, on a realistic snippet (see [`SNIPPET`]).
fn invariants_with_python() -> Vec<InvariantConfig> {
    let mut all = invariants_all();
    all.push(InvariantConfig::AstValidationPassed { tool: "tool*".into(), field: "code".into() });
    all.push(InvariantConfig::LinterPassed {
        tool: "tool*".into(),
        field: "code".into(),
        select: vec![],
        max_line_length: 120,
    });
    all
}

/// 16 lines of the kind of code an agent hands a sandboxed interpreter.
const SNIPPET: &str = r#"import csv
import statistics


def summarize(path, column):
    """Mean and spread of one numeric column."""
    values = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                values.append(float(row[column]))
            except (KeyError, ValueError):
                continue
    if not values:
        return None
    return {"mean": statistics.mean(values), "stdev": statistics.pstdev(values)}
"#;

/// Decision latency for `invs` over `n` calls: (histogram, decisions per second).
async fn decisions(
    cedar: &warden_policy::cedar::CedarPolicies,
    agent: &str,
    invs: &[InvariantConfig],
    args: &serde_json::Value,
    n: usize,
) -> anyhow::Result<(Histogram<u64>, f64)> {
    let mut h = Histogram::<u64>::new(3)?;
    let started = Instant::now();
    for i in 0..n {
        let tool = format!("tool{}", i % TOOLS);
        let t = Instant::now();
        let d = invariants::check(invs, &tool, args, cedar.decide("acme", agent, &tool, args)).await;
        std::hint::black_box(d);
        h.record(t.elapsed().as_nanos() as u64)?;
    }
    Ok((h, n as f64 / started.elapsed().as_secs_f64()))
}

fn us(h: &Histogram<u64>, q: f64) -> String {
    format!("{:.1}µs", h.value_at_quantile(q) as f64 / 1000.0)
}

pub async fn run() -> anyhow::Result<()> {
    // In process.
    let dir = std::env::temp_dir().join(format!("warden-bench-policy-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(warden_policy::cedar::SCHEMA_FILE), schema())?;
    std::fs::write(dir.join("bench.cedar"), policies())?;
    let cedar = warden_policy::cedar::load_dir(&dir).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let args = json!({"to": "ops@example.com", "amount": 250, "approved": true});
    let (h, rate) = decisions(&cedar, "", &invariants_all(), &args, 20_000).await?;
    println!(
        "policy  in-process decision ({} Cedar policies + 4 argument invariants): p50 {}  p99 {}  {rate:.0} decisions/s (one core)",
        cedar.count,
        us(&h, 0.5),
        us(&h, 0.99),
    );
    let (h, rate) = decisions(&cedar, "billing-bot", &invariants_all(), &args, 20_000).await?;
    println!(
        "policy  in-process decision, agent principal (Agent in Tenant entities per request): p50 {}  p99 {}  {rate:.0} decisions/s",
        us(&h, 0.5),
        us(&h, 0.99),
    );
    let args = json!({"to": "ops@example.com", "amount": 250, "approved": true, "code": SNIPPET});
    let (h, rate) = decisions(&cedar, "", &invariants_with_python(), &args, 5_000).await?;
    println!(
        "policy  in-process decision, all 6 invariants (+ Python parse and lint of a {}-byte snippet): p50 {}  p99 {}  {rate:.0} decisions/s",
        SNIPPET.len(),
        us(&h, 0.5),
        us(&h, 0.99),
    );
    let _ = std::fs::remove_dir_all(&dir);

    // Over loopback, through a dev mesh (the decision is recorded in the ledger first).
    let state = std::env::temp_dir().join(format!("warden-bench-policy-mesh-{}", std::process::id()));
    let listener = warden_grpc::bind("127.0.0.1:0").await?;
    let endpoint = warden_grpc::endpoint_of(listener.local_addr()?);
    let mut base = WardenConfig::default();
    base.policy
        .tenants
        .insert("default".into(), TenantPolicy { allow_tools: vec!["echo".into()], ..Default::default() });
    let config = crate::dev::dev_config(base, &state, &endpoint);
    // Ledger and policy only: no executor sweeping the bench's run.
    let ledger_service = warden_ledger::open(&config.ledger).await?;
    let policy_service = warden_policy::build(&config.policy).await?;
    let tokens = warden_grpc::auth::Tokens::default();
    let mut routes = tonic::service::Routes::builder();
    warden_ledger::add_routes(&mut routes, ledger_service, &tokens);
    warden_policy::add_routes(&mut routes, policy_service, &tokens);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(warden_grpc::serve(listener, routes.routes(), &[], async {
        let _ = stopped.await;
    }));
    let mut ledger = crate::run::ledger_client(&endpoint).await?;
    // Policy signs only calls of a run's recorded plan: one step per request below.
    let steps: Vec<serde_json::Value> =
        (0..1000).chain(10_000..13_200).map(|i| json!({"id": format!("s{i}"), "tool": "echo"})).collect();
    let run_id = ledger
        .create_run(pb::CreateRunRequest {
            tenant: "default".into(),
            plan_json: json!({ "steps": steps }).to_string(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .run
        .map(|r| r.run_id)
        .unwrap_or_default();
    let policy = warden_proto::v1::policy_client::PolicyClient::new(warden_grpc::channel(&endpoint)?);
    let request = |i: usize| pb::AuthorizeRequest {
        tenant: "default".into(),
        run_id: run_id.clone(),
        step_id: format!("s{i}"),
        attempt: 1,
        tool: "echo".into(),
        args_json: json!({"i": i}).to_string(),
        capability_handle: String::new(),
        idempotency_key: format!("{run_id}:s{i}:1"),
        epoch: 0,
        agent: String::new(),
        retry_of: String::new(),
        caller_records: false,
        base_rules_only: false,
        ..Default::default()
    };
    let mut h = Histogram::<u64>::new(3)?;
    let mut p = policy.clone();
    for i in 0..1000 {
        let t = Instant::now();
        p.authorize(request(i)).await?;
        h.record(t.elapsed().as_nanos() as u64)?;
    }
    println!("policy  Authorize over loopback (dev shape, recorded): p50 {}  p99 {}", us(&h, 0.5), us(&h, 0.99));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..32 {
        let (mut p, reqs): (_, Vec<_>) = (policy.clone(), (0..100).map(|k| request(10_000 + w * 100 + k)).collect());
        tasks.push(tokio::spawn(async move {
            for r in reqs {
                p.authorize(r).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    println!("policy  Authorize, 32 concurrent callers: {:.0} decisions/s", 3200.0 / started.elapsed().as_secs_f64());
    let _ = stop.send(());
    let _ = served.await;
    let _ = std::fs::remove_dir_all(&state);
    Ok(())
}
