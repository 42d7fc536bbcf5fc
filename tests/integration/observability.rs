//! Seeing inside the mesh: every process exports its spans over OTLP to a real receiver, one
//! trace per run crosses the executor, policy, ledger and tool host with W3C context on every
//! hop, receipts cite the tool call's span, and every server's `/metrics` parses as Prometheus
//! text with Warden's metrics moving.

use std::collections::{BTreeSet, HashMap};

use warden_testkit::otlp::{OtlpReceiver, ReceivedSpan};

use crate::*;

/// The variables that point every process at `receiver` and export quickly (the batch
/// exporter's delay is shortened, never waited on: the test waits for the spans themselves).
fn otel_env(receiver: &OtlpReceiver, protocol: &str) -> Vec<(String, String)> {
    let endpoint = if protocol == "grpc" { &receiver.grpc_endpoint } else { &receiver.http_endpoint };
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", "1.0"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

const SERVICES: [&str; 4] = ["warden-executor", "warden-policy", "warden-ledger", "warden-tools"];

fn services_in(spans: &[ReceivedSpan], trace_id: &str) -> BTreeSet<String> {
    spans.iter().filter(|s| s.trace_id == trace_id).map(|s| s.service.clone()).collect()
}

fn by_id<'a>(spans: &'a [ReceivedSpan], span_id: &str) -> Option<&'a ReceivedSpan> {
    spans.iter().find(|s| s.span_id == span_id)
}

/// Asserts every server span of `service` named `rpc_path` in the trace has a parent named
/// `parent_name` in the calling process.
#[track_caller]
fn served_under(spans: &[ReceivedSpan], trace_id: &str, rpc_path: &str, parent_name: &str, caller: &str) {
    let served: Vec<&ReceivedSpan> =
        spans.iter().filter(|s| s.trace_id == trace_id && s.name == rpc_path && s.kind == 2).collect();
    assert!(!served.is_empty(), "no {rpc_path} server span in the trace");
    for s in served {
        let parent = by_id(spans, &s.parent_span_id).unwrap_or_else(|| panic!("{rpc_path}: parent not received"));
        assert_eq!((parent.name.as_str(), parent.service.as_str()), (parent_name, caller), "{rpc_path}'s parent");
    }
}

/// `GET /metrics` over plain HTTP/1.1, parsed as Prometheus text.
pub(crate) async fn scrape(url: &str) -> prometheus_parse::Scrape {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").expect("an http:// metrics url");
    let (addr, path) = rest.split_once('/').map(|(a, p)| (a, format!("/{p}"))).expect("host:port/path");
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect to metrics");
    let ask = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(ask.as_bytes()).await.expect("send");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.expect("read");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"), "{head}");
    // axum answers in chunks when it does not know the length up front.
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.into() };
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("Prometheus text format")
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

/// The sum of the samples of `metric` whose labels include `labels` (a histogram counts its
/// observations).
pub(crate) fn value(scrape: &prometheus_parse::Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            prometheus_parse::Value::Histogram(buckets) => {
                buckets.iter().find(|b| b.less_than.is_infinite()).map_or(0.0, |b| b.count)
            }
            prometheus_parse::Value::Summary(_) => 0.0,
        })
        .sum()
}

/// A client's `traceparent` on `SubmitRun` is the run's parent; the run is one trace across
/// four processes whose spans nest as the calls did; each receipt cites its tool call's span;
/// every server's metrics parse and moved, with no run id in any label.
#[tokio::test]
async fn a_run_is_one_trace_across_the_mesh_and_its_receipts_cite_it() {
    let receiver = OtlpReceiver::start().await.expect("OTLP receiver");
    let opts = MeshOptions { env: otel_env(&receiver, "grpc"), ..MeshOptions::default() };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let before = scrape(&mesh.policy.metrics_url).await;

    // The client's own trace: its span is the parent of the run's.
    let (client_trace, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let plan = plan(&[
        ("greet", "echo", serde_json::json!({"message": "hi"}), &[]),
        ("shout", "text.upper", serde_json::json!({"text": "{{greet.output.message}}"}), &["greet"]),
    ]);
    let mut request =
        tonic::Request::new(pb::SubmitRunRequest { tenant: "acme".into(), plan_json: plan, ..Default::default() });
    let traceparent = format!("00-{client_trace}-{client_span}-01");
    request.metadata_mut().insert("traceparent", traceparent.parse().expect("header"));
    let run_id = mesh.runs().submit_run(request).await.expect("submit").into_inner().run_id;
    assert_eq!(settled(&mesh, "acme", &run_id).await.status(), pb::RunStatus::Completed);
    let receipts = receipts_of(&mesh, "acme", &run_id, "").await;
    assert_eq!(receipts.len(), 2);

    // Wait (bounded) until every process's spans of this trace, and both calls' spans, are in.
    let spans = receiver
        .wait_for(Duration::from_secs(60), |spans| {
            let services = services_in(spans, client_trace);
            SERVICES.iter().all(|s| services.contains(*s))
                && receipts.iter().all(|r| by_id(spans, &r.span_id).is_some())
                && spans.iter().any(|s| s.name == "run" && s.attr("run.status") == Some("completed"))
                // Each process exports in batches: the remote calls' spans and their callers'
                // may come in a later batch than the process's first span of the trace.
                && ["/warden.v1.Policy/Authorize", "/warden.v1.ToolHost/Invoke", "/warden.v1.Ledger/AppendEvents"]
                    .iter()
                    .all(|rpc| {
                        let served: Vec<&ReceivedSpan> =
                            spans.iter().filter(|s| s.trace_id == client_trace && s.name == *rpc && s.kind == 2).collect();
                        !served.is_empty() && served.iter().all(|s| by_id(spans, &s.parent_span_id).is_some())
                    })
                // A span ends (and is exported) before the one it hangs off: a batch commit's
                // parent request span may come in a later batch than the commit's own.
                && spans
                    .iter()
                    .filter(|s| s.trace_id == client_trace)
                    .all(|s| s.parent_span_id == client_span || by_id(spans, &s.parent_span_id).is_some())
        })
        .await;
    let in_trace: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.trace_id == client_trace).collect();
    let services = services_in(&spans, client_trace);
    for s in SERVICES {
        assert!(services.contains(s), "{s} exported no span of the run's trace: {services:?}\n{}", mesh.logs());
    }

    // The incoming traceparent is the parent of the SubmitRun span, which parents the run.
    let submit = in_trace
        .iter()
        .find(|s| s.name == "/warden.v1.Runs/SubmitRun")
        .unwrap_or_else(|| panic!("no SubmitRun span: {in_trace:#?}"));
    assert_eq!((submit.service.as_str(), submit.parent_span_id.as_str()), ("warden-executor", client_span));
    assert_eq!(submit.attr("rpc.system"), Some("grpc"));
    let run: Vec<&&ReceivedSpan> = in_trace.iter().filter(|s| s.name == "run").collect();
    assert_eq!(run.len(), 1, "one run span");
    assert_eq!(run[0].parent_span_id, submit.span_id);
    assert_eq!(run[0].attr("run_id"), Some(run_id.as_str()));
    // One trace per run: every span naming the run is in it.
    for s in spans.iter().filter(|s| s.attr("run_id") == Some(run_id.as_str())) {
        assert_eq!(s.trace_id, client_trace, "{} ({}) is in another trace", s.name, s.service);
    }

    // Parent and child, as the calls went: run → step → attempt → policy.authorize / tool.invoke,
    // and each remote span under the executor span that called it.
    let steps: Vec<&&ReceivedSpan> = in_trace.iter().filter(|s| s.name == "step").collect();
    assert_eq!(steps.len(), 2);
    assert!(steps.iter().all(|s| s.parent_span_id == run[0].span_id));
    for name in ["policy.authorize", "tool.invoke"] {
        for s in in_trace.iter().filter(|s| s.name == name) {
            let attempt = by_id(&spans, &s.parent_span_id).expect("parent");
            assert_eq!(attempt.name, "attempt", "{name}'s parent");
            let step = by_id(&spans, &attempt.parent_span_id).expect("step");
            assert_eq!(step.name, "step");
        }
    }
    served_under(&spans, client_trace, "/warden.v1.Policy/Authorize", "policy.authorize", "warden-executor");
    served_under(&spans, client_trace, "/warden.v1.ToolHost/Invoke", "tool.invoke", "warden-executor");
    served_under(&spans, client_trace, "/warden.v1.Ledger/AppendEvents", "ledger.append", "warden-executor");
    // The policy's decision span names the rule and the outcome.
    let decided = in_trace.iter().find(|s| s.name == "authorize" && s.service == "warden-policy").expect("authorize");
    assert_eq!(decided.attr("outcome"), Some("allow"));
    assert!(decided.attr("rule_id").is_some_and(|r| !r.is_empty()));
    // The ledger commits in batches traced under the request that brought them.
    assert!(in_trace.iter().any(|s| s.name == "ledger.batch_commit" && s.service == "warden-ledger"));
    // Every span of the trace hangs off another one, or off the client's.
    for s in &in_trace {
        assert!(
            s.parent_span_id == client_span || by_id(&spans, &s.parent_span_id).is_some(),
            "{} ({}) has an unknown parent",
            s.name,
            s.service
        );
    }
    // The resource comes from the standard variables, the service name from the binary.
    assert!(in_trace.iter().all(|s| SERVICES.contains(&s.service.as_str()) || s.service == "warden-planner"));

    // Receipts cite the tool call's span: an auditor goes from a receipt to its trace.
    for r in &receipts {
        assert_eq!(r.trace_id, client_trace, "receipt {}", r.receipt_id);
        let call = by_id(&spans, &r.span_id).expect("the receipt's span was exported");
        assert_eq!((call.name.as_str(), call.service.as_str()), ("tool.invoke", "warden-executor"));
        assert_eq!(call.trace_id, r.trace_id);
    }
    // Still a valid ledger: the cited ids are part of the hashed events and the receipts.
    assert!(verify(&mut mesh.ledger(), "acme", &run_id).await.valid);

    // Metrics: every server's endpoint parses, carries its metrics, and they moved.
    let after = scrape(&mesh.policy.metrics_url).await;
    let allowed = [("outcome", "allow")];
    assert!(
        value(&after, "warden_policy_decisions_total", &allowed)
            >= value(&before, "warden_policy_decisions_total", &allowed) + 2.0,
        "two allow decisions counted"
    );
    let authorize = [("service", "warden.v1.Policy"), ("method", "Authorize"), ("code", "OK")];
    assert!(value(&after, "warden_grpc_server_requests_total", &authorize) >= 2.0);
    assert!(value(&after, "warden_grpc_server_request_duration_seconds", &authorize[..2]) >= 2.0);
    let executor = scrape(&mesh.executors[0].metrics_url).await;
    assert!(value(&executor, "warden_runs_total", &[("status", "completed")]) >= 1.0);
    assert!(value(&executor, "warden_runs_submitted_total", &[]) >= 1.0);
    assert!(value(&executor, "warden_steps_total", &[("outcome", "completed")]) >= 2.0);
    assert!(value(&executor, "warden_attempts_total", &[("outcome", "completed")]) >= 2.0);
    assert!(value(&executor, "warden_lease_acquisitions_total", &[("kind", "fresh")]) >= 1.0);
    let ledger = scrape(&mesh.ledger.metrics_url).await;
    assert!(value(&ledger, "warden_ledger_append_duration_seconds", &[]) >= 1.0);
    assert!(value(&ledger, "warden_ledger_batch_events", &[]) >= 1.0);
    let appends = [("service", "warden.v1.Ledger"), ("method", "AppendEvents"), ("code", "OK")];
    assert!(value(&ledger, "warden_grpc_server_requests_total", &appends) >= 1.0);
    let tools = scrape(&mesh.tools.metrics_url).await;
    let invokes = [("service", "warden.v1.ToolHost"), ("method", "Invoke"), ("code", "OK")];
    assert!(value(&tools, "warden_grpc_server_requests_total", &invokes) >= 2.0);
    let planner = scrape(&mesh.planner.metrics_url).await;
    assert!(value(&planner, "warden_grpc_server_requests_total", &[("method", "ValidatePlan")]) >= 1.0);
    // Labels are bounded: no run id, no step id anywhere.
    for (name, s) in [("policy", &after), ("executor", &executor), ("ledger", &ledger), ("tools", &tools)] {
        for sample in &s.samples {
            let labels: HashMap<String, String> =
                ["service", "method", "code", "status", "outcome", "rule", "kind", "tenant", "model", "type"]
                    .iter()
                    .filter_map(|k| sample.labels.get(k).map(|v| (k.to_string(), v.to_string())))
                    .collect();
            assert!(!labels.values().any(|v| v == &run_id), "{name}: {} carries the run id", sample.metric);
        }
        assert!(s.docs.keys().all(|m| m.starts_with("warden_")), "{name}: {:?}", s.docs.keys());
    }
}

/// OTLP over HTTP/protobuf reaches the receiver too, and a run without a client context is a
/// trace of its own rooted at the SubmitRun request.
#[tokio::test]
async fn spans_reach_an_http_protobuf_receiver() {
    let receiver = OtlpReceiver::start().await.expect("OTLP receiver");
    let opts = MeshOptions { env: otel_env(&receiver, "http/protobuf"), ..MeshOptions::default() };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run_id = submit(&mesh, "acme", &plan(&[("greet", "echo", serde_json::json!({}), &[])])).await;
    assert_eq!(settled(&mesh, "acme", &run_id).await.status(), pb::RunStatus::Completed);
    let receipt = receipts_of(&mesh, "acme", &run_id, "").await.pop().expect("a receipt");
    let spans = receiver
        .wait_for(Duration::from_secs(60), |spans| {
            let services = services_in(spans, &receipt.trace_id);
            // The SubmitRun span ends (and is exported) after its answer: waited for too.
            let submitted =
                spans.iter().any(|s| s.trace_id == receipt.trace_id && s.name == "/warden.v1.Runs/SubmitRun");
            SERVICES.iter().all(|s| services.contains(*s)) && submitted
        })
        .await;
    let services = services_in(&spans, &receipt.trace_id);
    assert!(SERVICES.iter().all(|s| services.contains(*s)), "{services:?}\n{}", mesh.logs());
    let submit = spans
        .iter()
        .find(|s| s.trace_id == receipt.trace_id && s.name == "/warden.v1.Runs/SubmitRun")
        .expect("the SubmitRun span");
    assert!(submit.parent_span_id.is_empty(), "the run's trace starts at SubmitRun");
}

/// A service asked to stop (SIGTERM) exports the spans still queued before it exits, over gRPC
/// too, whose export runs on the service's own runtime: with one worker, that runtime has one
/// thread, which must not be the one waiting for the export.
// Multi-threaded: the receiver's tasks run here while the stop is waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_service_exports_its_last_spans_over_grpc() {
    let receiver = OtlpReceiver::start().await.expect("OTLP receiver");
    let mut env = otel_env(&receiver, "grpc");
    // Nothing goes out on the exporter's schedule: only the stop exports.
    env.retain(|(k, _)| k != "OTEL_BSP_SCHEDULE_DELAY");
    env.push(("OTEL_BSP_SCHEDULE_DELAY".into(), "3600000".into()));
    let mut mesh = mesh_with(Backend::Sqlite, MeshOptions { env, ..MeshOptions::default() }).await;
    assert_eq!(mesh.policy.env_var("TOKIO_WORKER_THREADS"), Some("1"), "the one-thread runtime is under test");
    let run_id = submit(&mesh, "acme", &plan(&[("greet", "echo", serde_json::json!({}), &[])])).await;
    assert_eq!(settled(&mesh, "acme", &run_id).await.status(), pb::RunStatus::Completed);
    let receipt = receipts_of(&mesh, "acme", &run_id, "").await.pop().expect("a receipt");
    let authorized = |spans: &[ReceivedSpan]| {
        spans.iter().any(|s| {
            s.service == "warden-policy" && s.trace_id == receipt.trace_id && s.name == "/warden.v1.Policy/Authorize"
        })
    };
    tokio::task::block_in_place(|| mesh.policy.terminate());
    let spans = receiver.wait_for(Duration::from_secs(60), authorized).await;
    assert!(authorized(&spans), "the policy's Authorize span never arrived\n{}", mesh.logs());
}

/// A goal run's model call is a span of the run's trace with the OpenTelemetry GenAI
/// attributes, exported by the planner, and the provider receives its W3C context.
#[tokio::test]
async fn a_model_call_is_a_genai_span_of_the_runs_trace() {
    use crate::scripted_model::{Reply, ScriptedModel};
    let model = ScriptedModel::start(Reply::plan(serde_json::json!({"reasoning": "r", "direct_response": null,
        "steps": [{"id": "say", "tool": "echo", "params": {"text": "hi"}, "depends_on": []}]})))
    .await;
    let receiver = OtlpReceiver::start().await.expect("OTLP receiver");
    let tools = ["echo", "model.call"].iter().map(|s| s.to_string()).collect();
    let opts = MeshOptions {
        env: otel_env(&receiver, "grpc"),
        tenants: vec![("acme".into(), tools)],
        planner_extra: model.openai_config(""),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = mesh
        .runs()
        .submit_run(pb::SubmitRunRequest { tenant: "acme".into(), goal: "Say hi.".into(), ..Default::default() })
        .await
        .expect("submit")
        .into_inner()
        .run_id;
    assert_eq!(settled(&mesh, "acme", &run).await.status(), pb::RunStatus::Completed, "{}", mesh.logs());
    // The executor exports its spans of the trace in its own batches: wait for them too.
    let spans = receiver
        .wait_for(Duration::from_secs(30), |spans| {
            spans
                .iter()
                .find(|s| s.attr("gen_ai.system").is_some())
                .is_some_and(|call| services_in(spans, &call.trace_id).contains("warden-executor"))
        })
        .await;
    let call = spans.iter().find(|s| s.attr("gen_ai.system").is_some()).expect("a GenAI span");
    assert_eq!(call.service, "warden-planner");
    assert_eq!(call.attr("gen_ai.system"), Some("openai"));
    assert_eq!(call.attr("gen_ai.request.model"), Some("scripted-model"));
    assert_eq!(call.attr("gen_ai.usage.input_tokens"), Some("120"));
    assert_eq!(call.attr("gen_ai.usage.output_tokens"), Some("30"));
    let services = services_in(&spans, &call.trace_id);
    assert!(services.contains("warden-executor"), "the model call is in the run's trace: {services:?}");
    let sent = model.received()[0].headers.get("traceparent").map(|v| v.to_str().unwrap_or_default().to_string());
    assert!(sent.is_some_and(|t| t.contains(&call.trace_id)), "the provider gets the call's context");
}
