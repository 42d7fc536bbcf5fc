//! The model critic (seed 002's critic approvals): asked by the policy service, while it
//! decides a call that a tenant's `require_approval` gates under `approval_mode = "critic"`,
//! whether the call may go ahead.
//!
//! The critic's model call is an effect like planning's: decided by the policy (`model.call`
//! under the step id `critic-<hex>` of the call it reviews), recorded before it is made
//! (`model_requested`, with the signed decision, in one ledger transaction) and after
//! (`model_completed` with the verdict, or `model_failed`), its cost recorded. Its step key is
//! deterministic — `critic::<tool>::<step>::<attempt>::<16 hex of the arguments' digest>` —
//! so when the same call is decided again (a retried `Authorize`, a run driven again after a
//! crash) the recorded verdict is replayed and nothing is asked.

use serde_json::{Value, json};
use tonic::Status;
use warden_core::canonical::{args_digest, sha256_hex};
use warden_core::events;
use warden_core::plan::critic_step;
use warden_proto::v1 as pb;

use crate::model::{ModelClient, ModelRequest};

/// Largest answer kept in `model_completed` (a verdict is a short object).
const MAX_RECORDED_ANSWER: usize = 8 * 1024;
/// Largest call arguments shown to the critic (the rest is elided; the digest names them all).
const MAX_SHOWN_ARGS: usize = 8 * 1024;

/// The services the critic talks to.
pub struct Critic<'a> {
    pub ledger: &'a warden_proto::v1::ledger_client::LedgerClient<warden_grpc::auth::Ch>,
    pub policy: &'a warden_proto::v1::policy_client::PolicyClient<warden_grpc::auth::Ch>,
    pub model: &'a ModelClient,
    pub prices: &'a std::collections::BTreeMap<String, warden_config::ModelPrice>,
}

/// The JSON Schema a verdict answers under.
fn verdict_schema() -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["verdict", "reason"],
        "properties": {
            "verdict": {"type": "string", "enum": ["approve", "deny"]},
            "reason": {"type": "string", "maxLength": 500},
        },
    })
}

/// The verdict in a model's answer: `("approve" | "deny", reason)`, or why it is not one.
pub fn parse_verdict(text: &str) -> Result<(String, String), String> {
    let v: Value = serde_json::from_str(text.trim()).map_err(|e| format!("the answer is not valid JSON: {e}"))?;
    let verdict = v.get("verdict").and_then(Value::as_str).unwrap_or_default();
    if !matches!(verdict, "approve" | "deny") {
        return Err("verdict: must be \"approve\" or \"deny\"".into());
    }
    let reason = v.get("reason").and_then(Value::as_str).unwrap_or_default();
    let reason: String = reason.chars().take(500).collect();
    Ok((verdict.to_string(), reason))
}

fn messages(tool: &str, description: &str, args: &Value) -> Vec<Value> {
    let mut shown = args.to_string();
    if shown.len() > MAX_SHOWN_ARGS {
        let cut = shown.floor_char_boundary(MAX_SHOWN_ARGS);
        shown = format!("{}… ({} bytes elided)", &shown[..cut], shown.len() - cut);
    }
    vec![
        json!({"role": "system", "content": "You are the safety critic of an agent runtime. A tool call is about to \
              run; approve it only if it is safe, within what the tool is for, and leaks nothing it should not. \
              Answer with a JSON object {\"verdict\": \"approve\" or \"deny\", \"reason\": a short reason} only."}),
        json!({"role": "user", "content": format!("Tool: {tool}\nWhat it does: {description}\nArguments: {shown}")}),
    ]
}

impl Critic<'_> {
    /// Reviews one call (see the module doc).
    pub async fn critique(&self, r: &pb::CritiqueRequest, description: &str) -> Result<pb::CritiqueResponse, Status> {
        let args: Value = serde_json::from_str(&r.args_json)
            .map_err(|e| warden_grpc::invalid_field("args_json", format!("not valid JSON: {e}")))?;
        let digest = args_digest(&args);
        let step_key = format!("critic::{}::{}::{}::{}", r.tool, r.step_id, r.attempt, &digest[..16]);
        // Ledger keys are bounded: the step key (up to two ids long) goes in by its digest.
        let key = format!("critic:{}", &sha256_hex(step_key.as_bytes())[..24]);
        let step_id = critic_step(&r.step_id);
        let answer = |verdict: &str, reason: String, replayed: bool| pb::CritiqueResponse {
            verdict: verdict.into(),
            reason,
            step_key: step_key.clone(),
            replayed,
        };
        if let Some((seq, verdict, reason)) = self.recorded(r, &step_key).await? {
            let payload = json!({"step_key": step_key, "of_seq": seq});
            let replayed = pb::EventInput {
                idempotency_key: format!("model_replayed:{key}:{}", r.epoch),
                event_type: events::MODEL_REPLAYED.into(),
                payload_json: payload.to_string(),
                step_id: step_id.clone(),
            };
            self.append(r, vec![replayed]).await?;
            return Ok(answer(&verdict, reason, true));
        }
        let messages = messages(&r.tool, description, &args);
        let messages_value = Value::Array(messages.clone());
        let model_args = json!({
            "resource": format!("{}/{}", self.model.provider(), self.model.config.model),
            "provider": self.model.provider(),
            "model": self.model.config.model,
            "step_key": step_key,
            "messages_sha256": args_digest(&messages_value),
        });
        let idempotency_key = format!("{}:{key}", r.run_id);
        let decided = self
            .policy
            .clone()
            .authorize(pb::AuthorizeRequest {
                tenant: r.tenant.clone(),
                run_id: r.run_id.clone(),
                step_id: step_id.clone(),
                attempt: 1,
                tool: events::MODEL_CALL_TOOL.into(),
                args_json: model_args.to_string(),
                idempotency_key: idempotency_key.clone(),
                epoch: r.epoch,
                agent: r.agent.clone(),
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
                event_type: events::POLICY_DECISION.into(),
                payload_json: decided.decision_event_json.clone(),
                step_id: step_id.clone(),
            });
        }
        if decision.outcome() != pb::Outcome::Allow {
            if !batch.is_empty() {
                self.append(r, batch).await?;
            }
            let why = format!("the critic's model call was not allowed: {} ({})", decision.reason, decision.rule_id);
            return Ok(answer("unavailable", why, false));
        }
        let request = json!({
            "step_key": step_key,
            "attempt": 1,
            "provider": self.model.provider(),
            "model": self.model.config.model,
            "api_mode": self.model.api_mode(),
            "options": self.model.options(),
            "messages": messages_value,
            "messages_sha256": args_digest(&messages_value),
            "decision_id": decision.decision_id,
            "tool": events::MODEL_CALL_TOOL,
            "idempotency_key": idempotency_key,
            "args": model_args,
        });
        batch.push(pb::EventInput {
            idempotency_key: format!("model_requested:{key}"),
            event_type: events::MODEL_REQUESTED.into(),
            payload_json: request.to_string(),
            step_id: step_id.clone(),
        });
        self.append(r, batch).await?;
        let started = std::time::Instant::now();
        let call = ModelRequest { messages, schema: verdict_schema() };
        let reply = self.model.complete(&call).await;
        let latency_ms = started.elapsed().as_millis() as u64;
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                let failed =
                    json!({"step_key": step_key, "attempt": 1, "error": e.to_string(), "latency_ms": latency_ms});
                let event = pb::EventInput {
                    idempotency_key: format!("model_failed:{key}"),
                    event_type: events::MODEL_FAILED.into(),
                    payload_json: failed.to_string(),
                    step_id: step_id.clone(),
                };
                self.append(r, vec![event]).await?;
                return Ok(answer("unavailable", format!("the critic did not answer: {e}"), false));
            }
        };
        let price = self.prices.get(&self.model.config.model).cloned().unwrap_or_default();
        let cost = (reply.input_tokens as f64 * price.input_per_mtok
            + reply.output_tokens as f64 * price.output_per_mtok)
            / 1e6;
        let text = &reply.text[..reply.text.floor_char_boundary(MAX_RECORDED_ANSWER)];
        let parsed = parse_verdict(&reply.text);
        let mut payload = json!({
            "step_key": step_key,
            "attempt": 1,
            "raw_output": text,
            "raw_output_sha256": sha256_hex(reply.text.as_bytes()),
            "usage": {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens},
            "cost": cost,
            "response_model": reply.model,
            "latency_ms": latency_ms,
        });
        match &parsed {
            Ok((verdict, reason)) => {
                payload["verdict"] = json!(verdict);
                payload["reason"] = json!(reason);
            }
            Err(e) => payload["validation_error"] = json!(e),
        }
        let completed = pb::EventInput {
            idempotency_key: format!("model_completed:{key}"),
            event_type: events::MODEL_COMPLETED.into(),
            payload_json: payload.to_string(),
            step_id: step_id.clone(),
        };
        self.append(r, vec![completed]).await?;
        let cost_record = pb::RecordCostRequest {
            tenant: r.tenant.clone(),
            run_id: r.run_id.clone(),
            step_id,
            cost: cost.clamp(0.0, 1e9),
            attempt: 1,
        };
        if let Err(e) = self.policy.clone().record_cost(cost_record).await {
            tracing::warn!(run_id = %r.run_id, error = %e, "critic cost not recorded");
        }
        Ok(match parsed {
            Ok((verdict, reason)) => answer(&verdict, reason, false),
            Err(e) => answer("unavailable", format!("the critic's answer is not a verdict: {e}"), false),
        })
    }

    /// The verdict the run recorded for `step_key`: (seq, verdict, reason).
    async fn recorded(&self, r: &pb::CritiqueRequest, step_key: &str) -> Result<Option<(u64, String, String)>, Status> {
        let mut stream = self
            .ledger
            .clone()
            .stream_events(pb::StreamEventsRequest {
                tenant: r.tenant.clone(),
                run_id: r.run_id.clone(),
                since_seq: 0,
                follow: false,
            })
            .await?
            .into_inner();
        while let Some(e) = stream.message().await? {
            if e.event_type != events::MODEL_COMPLETED {
                continue;
            }
            let p: Value = serde_json::from_str(&e.payload_json).unwrap_or_default();
            if p.get("step_key").and_then(Value::as_str) != Some(step_key) {
                continue;
            }
            if let Some(verdict) = p.get("verdict").and_then(Value::as_str) {
                let reason = p.get("reason").and_then(Value::as_str).unwrap_or_default().to_string();
                return Ok(Some((e.seq, verdict.to_string(), reason)));
            }
        }
        Ok(None)
    }

    async fn append(&self, r: &pb::CritiqueRequest, events: Vec<pb::EventInput>) -> Result<(), Status> {
        let req = pb::AppendEventsRequest {
            tenant: r.tenant.clone(),
            run_id: r.run_id.clone(),
            epoch: r.epoch,
            events,
            brief: true,
        };
        self.ledger.clone().append_events(req).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_approve_or_a_deny_is_a_verdict() {
        assert_eq!(parse_verdict(r#"{"verdict": "approve", "reason": "fine"}"#), Ok(("approve".into(), "fine".into())));
        assert_eq!(parse_verdict(r#" {"verdict": "deny"} "#), Ok(("deny".into(), String::new())));
        assert!(parse_verdict(r#"{"verdict": "maybe"}"#).is_err());
        assert!(parse_verdict("approve").is_err());
        assert!(parse_verdict("[]").is_err());
    }
}
