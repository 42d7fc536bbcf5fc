//! Planning a goal run: one round of model calls (the first ask, then up to
//! `repair_attempts` repair passes), each one an effect like a tool call:
//!
//! 1. decided by the policy (`model.call`, resource `<provider>/<model>`, under the planner's
//!    step id `plan-r<round>`; budgets and rate limits apply);
//! 2. recorded before it is made (`model_requested`, in one ledger transaction with the
//!    signed decision it cites) and after (`model_completed` with the raw output, the parsed
//!    plan or why it was refused, usage and cost — or `model_failed`);
//! 3. its cost recorded with the policy (`RecordCost`).
//!
//! A call the run has already recorded is never made again: the recorded completion is
//! replayed under the run's replay policy (seed 002). The loop is deterministic given the
//! goal, the offer and the answers, so replaying walks the same calls. After the repair
//! passes, the deterministic fallback is a direct response saying why no safe plan was
//! produced — never a tool call (seed 004).

use std::collections::HashMap;

use serde_json::{Value, json};
use tonic::Status;
use warden_core::canonical::{args_digest, canonical_json, sha256_hex};
use warden_core::events;
use warden_core::plan::{Plan, planner_step};
use warden_proto::v1 as pb;

use crate::model::{ModelClient, ModelError, ModelReply, ModelRequest};
use crate::prompt;
use crate::schema::{Offer, Validators};

/// Largest raw answer kept in `model_completed` (the digest always covers all of it).
const MAX_RECORDED_OUTPUT: usize = 64 * 1024;

/// What the caller asked for.
pub struct Ask<'a> {
    pub tenant: &'a str,
    pub run_id: &'a str,
    pub agent: &'a str,
    pub goal: &'a str,
    pub epoch: u64,
    pub policy: pb::ReplayPolicy,
    pub replay_only: bool,
}

/// How planning ended.
#[derive(Debug, Default)]
pub struct Outcome {
    pub source: &'static str,
    pub plan: Option<Plan>,
    pub rule_id: String,
    pub reason: String,
    pub model_calls: u32,
    pub replayed_calls: u32,
    pub differences: Vec<String>,
    pub fork_hash: String,
}

/// A call the run recorded: its request and what came of it.
#[derive(Debug, Default, Clone)]
struct Recorded {
    request: Option<Value>,
    /// `model_completed`'s payload, or a `model_failed` with an unreadable answer.
    answer: Option<Value>,
    requests: u32,
    seq: u64,
}

/// The services planning talks to, and its settings.
pub struct Planning<'a> {
    pub ledger: &'a warden_proto::v1::ledger_client::LedgerClient<warden_grpc::auth::Ch>,
    pub policy: &'a warden_proto::v1::policy_client::PolicyClient<warden_grpc::auth::Ch>,
    pub model: &'a ModelClient,
    pub prices: &'a std::collections::BTreeMap<String, warden_config::ModelPrice>,
    pub max_steps: usize,
    pub round: u32,
    /// A replanning round's context (round > 0).
    pub context: Option<&'a warden_core::replan::ReplanContext>,
    /// Tenants configuration names (metric labels; any other is "other").
    pub known_tenants: &'a std::collections::BTreeSet<String>,
}

impl Planning<'_> {
    pub async fn run(&self, ask: &Ask<'_>, offer: &Offer) -> Result<Outcome, Status> {
        let recorded = self.recorded(ask).await?;
        let validators = Validators::new(offer);
        let system = prompt::system_prompt(offer, self.max_steps);
        let mut messages = match self.context {
            Some(context) if self.round > 0 => prompt::replan(&system, ask.goal, self.round, context),
            _ => prompt::initial(&system, ask.goal),
        };
        let mut out = Outcome::default();
        let mut last_error = String::new();
        let attempts = 1 + self.model.config.repair_attempts;
        for attempt in 1..=attempts {
            let step_key = format!("plan:r{}:a{attempt}", self.round);
            let request = self.request_record(&step_key, attempt, &messages, offer, &system);
            let answer = match recorded.get(&step_key).and_then(|r| r.answer.clone().map(|a| (r, a))) {
                Some((rec, answer)) => {
                    let before = rec.request.clone().unwrap_or_default();
                    let differences = differences(&before, &request);
                    if !differences.is_empty() {
                        let same_call = ["provider", "model", "step_key", "allowed_tools_hash"]
                            .iter()
                            .all(|k| same(before.get(*k), request.get(*k)));
                        match ask.policy {
                            pb::ReplayPolicy::AllowPromptDrift if same_call => {
                                let payload =
                                    json!({"step_key": step_key, "of_seq": rec.seq, "differences": differences});
                                let key = format!(
                                    "replayed_with_drift:{step_key}:{}",
                                    &sha256_hex(canonical_json(&request))[..16]
                                );
                                self.append(ask, events::REPLAYED_WITH_DRIFT, payload, &key).await?;
                                out.differences.extend(differences);
                            }
                            pb::ReplayPolicy::ForkOnDrift => {
                                out.source = "fork";
                                out.fork_hash = sha256_hex(canonical_json(&request))[..16].to_string();
                                out.differences = differences;
                                return Ok(out);
                            }
                            _ => {
                                let why = if same_call {
                                    ""
                                } else {
                                    " (model, step_key or tool signatures changed: no policy replays that)"
                                };
                                return Err(Status::failed_precondition(format!(
                                    "replay of {step_key} refused{why}: the request differs from the recorded one in {}",
                                    differences.join("; ")
                                )));
                            }
                        }
                    } else {
                        let payload = json!({"step_key": step_key, "of_seq": rec.seq});
                        let key = format!("model_replayed:{step_key}:{}", ask.epoch);
                        self.append(ask, events::MODEL_REPLAYED, payload, &key).await?;
                    }
                    out.replayed_calls += 1;
                    Recalled::from_record(&answer)
                }
                None if ask.replay_only => {
                    if ask.policy == pb::ReplayPolicy::ForkOnDrift {
                        out.source = "fork";
                        out.fork_hash = sha256_hex(canonical_json(&request))[..16].to_string();
                        out.differences = vec![format!("{step_key}: not recorded (planning took another path)")];
                        return Ok(out);
                    }
                    return Err(Status::failed_precondition(format!(
                        "replay of {step_key} refused: the run recorded no completion for it (planning took another path)"
                    )));
                }
                None => {
                    let tries = recorded.get(&step_key).map(|r| r.requests).unwrap_or(0);
                    match self.live(ask, &step_key, attempt, tries + 1, request, &messages, offer, &validators).await? {
                        Live::Answer(r) => {
                            out.model_calls += 1;
                            r
                        }
                        Live::Denied { rule_id, reason } => {
                            out.source = "denied";
                            out.rule_id = rule_id;
                            out.reason = reason;
                            return Ok(out);
                        }
                        Live::Unavailable(reason) => {
                            out.model_calls += 1;
                            out.source = "unavailable";
                            out.reason = reason;
                            return Ok(out);
                        }
                    }
                }
            };
            match answer {
                Recalled::Plan(plan) => {
                    out.source = if out.model_calls == 0 && out.replayed_calls > 0 {
                        if out.differences.is_empty() { "replay" } else { "replayed_with_drift" }
                    } else {
                        "model"
                    };
                    out.plan = Some(plan);
                    return Ok(out);
                }
                Recalled::Refused { raw, error } => {
                    last_error = error.clone();
                    prompt::repair(&mut messages, &raw, &error);
                }
            }
        }
        out.source = "fallback";
        out.reason = format!("no safe plan after {attempts} model calls: {last_error}");
        out.plan = Some(Plan {
            steps: Vec::new(),
            reasoning: Some("planning produced no valid plan; nothing is executed".into()),
            direct_response: Some(format!("No safe plan was produced for this goal. {}", out.reason)),
            max_depth: None,
        });
        Ok(out)
    }

    /// The `model_requested` payload (without the decision fields), seed 002's fields.
    fn request_record(&self, step_key: &str, attempt: u32, messages: &[Value], offer: &Offer, system: &str) -> Value {
        let messages = Value::Array(messages.to_vec());
        json!({
            "step_key": step_key,
            "attempt": attempt,
            "provider": self.model.provider(),
            "model": self.model.config.model,
            "api_mode": self.model.api_mode(),
            "options": self.model.options(),
            "messages": messages,
            "messages_sha256": args_digest(&messages),
            "allowed_tools": offer.names(),
            "allowed_tool_signatures": offer.signatures(),
            "allowed_tools_hash": offer.signatures_hash(),
            "context_version": prompt::context_version(system),
        })
    }

    /// Asks the model: decided, recorded, asked, recorded, costed.
    #[allow(clippy::too_many_arguments)]
    async fn live(
        &self,
        ask: &Ask<'_>,
        step_key: &str,
        attempt: u32,
        try_no: u32,
        mut request: Value,
        messages: &[Value],
        offer: &Offer,
        validators: &Validators,
    ) -> Result<Live, Status> {
        let step_id = planner_step(self.round);
        let resource = format!("{}/{}", self.model.provider(), self.model.config.model);
        let args = json!({
            "resource": resource,
            "provider": self.model.provider(),
            "model": self.model.config.model,
            "step_key": step_key,
            "messages_sha256": request["messages_sha256"],
            "allowed_tools_hash": request["allowed_tools_hash"],
        });
        let idempotency_key = format!("{}:{step_key}", ask.run_id);
        let decided = self
            .policy
            .clone()
            .authorize(pb::AuthorizeRequest {
                tenant: ask.tenant.to_string(),
                run_id: ask.run_id.to_string(),
                step_id: step_id.clone(),
                attempt,
                tool: events::MODEL_CALL_TOOL.to_string(),
                args_json: args.to_string(),
                idempotency_key: idempotency_key.clone(),
                epoch: ask.epoch,
                agent: ask.agent.to_string(),
                caller_records: true,
                ..Default::default()
            })
            .await?
            .into_inner();
        let decision = decided.decision.unwrap_or_default();
        let mut batch = Vec::new();
        if !decided.decision_event_json.is_empty() {
            batch.push(pb::EventInput {
                idempotency_key: events::decision_key(&decision.decision_id),
                event_type: events::POLICY_DECISION.to_string(),
                payload_json: decided.decision_event_json.clone(),
                step_id: step_id.clone(),
            });
        }
        if decision.outcome() != pb::Outcome::Allow {
            if !batch.is_empty() {
                self.append_batch(ask, batch).await?;
            }
            let reason = if decision.outcome() == pb::Outcome::ApprovalRequired {
                format!("{} (model calls cannot wait for an approval)", decision.reason)
            } else {
                decision.reason
            };
            return Ok(Live::Denied { rule_id: decision.rule_id, reason });
        }
        request["decision_id"] = json!(decision.decision_id);
        request["tool"] = json!(events::MODEL_CALL_TOOL);
        request["idempotency_key"] = json!(idempotency_key);
        request["args"] = args;
        batch.push(pb::EventInput {
            idempotency_key: format!("model_requested:{step_key}:{try_no}"),
            event_type: events::MODEL_REQUESTED.to_string(),
            payload_json: request.to_string(),
            step_id: step_id.clone(),
        });
        self.append_batch(ask, batch).await?;
        let started = std::time::Instant::now();
        let span = warden_telemetry::genai::model_call_span(self.model.provider(), &self.model.config.model);
        let call = ModelRequest { messages: messages.to_vec(), schema: offer.response_schema(self.max_steps) };
        let reply = tracing::Instrument::instrument(self.model.complete(&call), span.clone()).await;
        let latency_ms = started.elapsed().as_millis() as u64;
        match reply {
            Ok(reply) => {
                warden_telemetry::genai::record_response(
                    &span,
                    &reply.model,
                    &reply.response_id,
                    reply.input_tokens,
                    reply.output_tokens,
                );
                let cost = self.cost(&reply);
                // Labels stay bounded: a tenant or model configuration does not name is "other".
                let tenant = warden_telemetry::metrics::bounded(ask.tenant, |t| self.known_tenants.contains(t));
                let model =
                    warden_telemetry::metrics::bounded(&self.model.config.model, |m| m == self.model.config.model);
                warden_telemetry::metrics::model_usage(tenant, model, reply.input_tokens, reply.output_tokens, cost);
                // An answer too long to record is refused unread (no plan is that long), and
                // errors are bounded: everything shown to the model again is on the record.
                let validated = if reply.text.len() > MAX_RECORDED_OUTPUT {
                    Err(format!(
                        "the answer is {} bytes, over the {MAX_RECORDED_OUTPUT} bytes a plan may take",
                        reply.text.len()
                    ))
                } else {
                    let round = self.context.filter(|_| self.round > 0).map(|c| (self.round, c));
                    crate::schema::parse_and_validate(&reply.text, offer, validators, self.max_steps, round)
                        .map_err(|e| prefix(&e, MAX_ERROR_BYTES).to_string())
                };
                let mut payload = json!({
                    "step_key": step_key,
                    "attempt": attempt,
                    "raw_output": truncate(&reply.text),
                    "raw_output_sha256": sha256_hex(reply.text.as_bytes()),
                    "usage": {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens},
                    "cost": cost,
                    "api_mode_used": self.model.api_mode(),
                    "response_id": reply.response_id,
                    "response_model": reply.model,
                    "finish_reason": reply.finish_reason,
                    "latency_ms": latency_ms,
                });
                if reply.text.len() > MAX_RECORDED_OUTPUT {
                    payload["raw_output_truncated"] = json!(true);
                }
                match &validated {
                    Ok(plan) => payload["parsed_plan"] = serde_json::to_value(plan).unwrap_or_default(),
                    Err(e) => payload["validation_error"] = json!(e),
                }
                self.append(ask, events::MODEL_COMPLETED, payload, &format!("model_completed:{step_key}:{try_no}"))
                    .await?;
                self.record_cost(ask, &step_id, attempt, cost).await;
                Ok(Live::Answer(match validated {
                    Ok(plan) => Recalled::Plan(plan),
                    Err(error) => Recalled::Refused { raw: truncate(&reply.text).to_string(), error },
                }))
            }
            Err(e) => {
                warden_telemetry::genai::record_error(&span, e.kind());
                let repair_error = match &e {
                    ModelError::Malformed(why) => format!("the provider's answer could not be read: {why}"),
                    _ => String::new(),
                };
                let mut payload = json!({
                    "step_key": step_key,
                    "attempt": attempt,
                    "kind": e.kind(),
                    "error": prefix(&e.to_string(), MAX_ERROR_BYTES),
                    "latency_ms": latency_ms,
                });
                if !repair_error.is_empty() {
                    payload["repair_error"] = json!(prefix(&repair_error, MAX_ERROR_BYTES));
                }
                self.append(ask, events::MODEL_FAILED, payload, &format!("model_failed:{step_key}:{try_no}")).await?;
                Ok(match e {
                    ModelError::Malformed(_) => Live::Answer(Recalled::Refused {
                        raw: NO_READABLE_ANSWER.to_string(),
                        error: prefix(&repair_error, MAX_ERROR_BYTES).to_string(),
                    }),
                    other => Live::Unavailable(other.to_string()),
                })
            }
        }
    }

    fn cost(&self, reply: &ModelReply) -> f64 {
        let price = self.prices.get(&self.model.config.model).cloned().unwrap_or_default();
        (reply.input_tokens as f64 * price.input_per_mtok + reply.output_tokens as f64 * price.output_per_mtok) / 1e6
    }

    async fn record_cost(&self, ask: &Ask<'_>, step_id: &str, attempt: u32, cost: f64) {
        let req = pb::RecordCostRequest {
            tenant: ask.tenant.to_string(),
            run_id: ask.run_id.to_string(),
            step_id: step_id.to_string(),
            cost: cost.clamp(0.0, 1e9),
            attempt,
        };
        if let Err(e) = self.policy.clone().record_cost(req).await {
            tracing::warn!(run_id = %ask.run_id, error = %e, "model call cost not recorded");
        }
    }

    /// The run's recorded model calls, by step key.
    async fn recorded(&self, ask: &Ask<'_>) -> Result<HashMap<String, Recorded>, Status> {
        let mut stream = self
            .ledger
            .clone()
            .stream_events(pb::StreamEventsRequest {
                tenant: ask.tenant.to_string(),
                run_id: ask.run_id.to_string(),
                since_seq: 0,
                follow: false,
            })
            .await?
            .into_inner();
        let mut out: HashMap<String, Recorded> = HashMap::new();
        while let Some(e) = stream.message().await? {
            if !matches!(
                e.event_type.as_str(),
                events::MODEL_REQUESTED | events::MODEL_COMPLETED | events::MODEL_FAILED
            ) {
                continue;
            }
            let p: Value = serde_json::from_str(&e.payload_json).unwrap_or_default();
            let Some(key) = p.get("step_key").and_then(Value::as_str) else { continue };
            let r = out.entry(key.to_string()).or_default();
            match e.event_type.as_str() {
                events::MODEL_REQUESTED => {
                    r.requests += 1;
                    r.request = Some(p);
                }
                events::MODEL_COMPLETED => {
                    r.answer = Some(p);
                    r.seq = e.seq;
                }
                // An unreadable answer is an answer (it is repaired); a provider that could
                // not be reached answered nothing: asked again.
                _ if p["kind"] == "malformed" => {
                    r.answer = Some(p);
                    r.seq = e.seq;
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// Appends one model event under the round's planner step id.
    async fn append(&self, ask: &Ask<'_>, event_type: &str, payload: Value, key: &str) -> Result<(), Status> {
        self.append_batch(
            ask,
            vec![pb::EventInput {
                idempotency_key: key.to_string(),
                event_type: event_type.to_string(),
                payload_json: payload.to_string(),
                step_id: planner_step(self.round),
            }],
        )
        .await
    }

    async fn append_batch(&self, ask: &Ask<'_>, events: Vec<pb::EventInput>) -> Result<(), Status> {
        self.ledger
            .clone()
            .append_events(pb::AppendEventsRequest {
                tenant: ask.tenant.to_string(),
                run_id: ask.run_id.to_string(),
                epoch: ask.epoch,
                events,
                brief: true,
            })
            .await?;
        Ok(())
    }
}

enum Live {
    Answer(Recalled),
    Denied { rule_id: String, reason: String },
    Unavailable(String),
}

/// An answer, live or from the record, as planning reads it.
enum Recalled {
    Plan(Plan),
    Refused { raw: String, error: String },
}

impl Recalled {
    /// A recorded answer is read again exactly as it was recorded: its plan, or its refusal.
    fn from_record(answer: &Value) -> Recalled {
        let text = |k: &str| answer.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        if let Some(plan) = answer.get("parsed_plan").and_then(|p| serde_json::from_value::<Plan>(p.clone()).ok()) {
            return Recalled::Plan(plan);
        }
        // Exactly what the live call showed the model: its (bounded) answer and error.
        match answer.get("validation_error").and_then(Value::as_str) {
            Some(e) => Recalled::Refused { raw: text("raw_output"), error: e.to_string() },
            None => Recalled::Refused { raw: NO_READABLE_ANSWER.to_string(), error: text("repair_error") },
        }
    }
}

/// Equal as recorded: compared in canonical form (a recorded `0.0` reads back as `0`).
fn same(a: Option<&Value>, b: Option<&Value>) -> bool {
    a.map(canonical_json) == b.map(canonical_json)
}

/// What differs between a recorded request and the one planning would make now.
fn differences(before: &Value, now: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for key in [
        "provider",
        "model",
        "api_mode",
        "step_key",
        "options",
        "allowed_tools_hash",
        "context_version",
        "messages_sha256",
    ] {
        let (b, n) = (before.get(key).cloned().unwrap_or(Value::Null), now.get(key).cloned().unwrap_or(Value::Null));
        if !same(Some(&b), Some(&n)) {
            let show = |v: &Value| {
                let s = canonical_json(v);
                if s.len() > 120 { format!("{}…", prefix(&s, 117)) } else { s }
            };
            out.push(format!("{key}: recorded {} ≠ now {}", show(&b), show(&n)));
        }
    }
    out
}

fn truncate(s: &str) -> &str {
    prefix(s, MAX_RECORDED_OUTPUT)
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn prefix(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// What stands in the conversation for an answer that could not be read.
const NO_READABLE_ANSWER: &str = "(no readable answer)";

/// Longest error shown to the model and recorded.
const MAX_ERROR_BYTES: usize = 2048;
