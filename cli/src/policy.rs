//! `warden policy validate DIR` (offline) and `warden policy check --request FILE` (a dry run
//! against the policy service: the decision, rule and reason, nothing recorded or signed).

use std::path::PathBuf;

use anyhow::Context;
use serde_json::{Value, json};
use warden_proto::v1 as pb;
use warden_proto::v1::policy_client::PolicyClient;

use crate::Target;
use crate::run::describe;

#[derive(clap::Subcommand)]
pub enum PolicyCommand {
    /// Validate a Cedar policy directory (schema.cedarschema + *.cedar): `valid` (exit 0) or
    /// one `file:line: reason` per problem (exit 1).
    Validate { dir: PathBuf },
    /// Dry-run a request: JSON {"tool", "args", optional "tenant", "agent", "run_id", "step_id",
    /// "capability_handle"}; prints outcome, rule and reason.
    Check {
        #[arg(long)]
        request: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(target: &Target, policy_endpoint: &str, cmd: PolicyCommand) -> anyhow::Result<i32> {
    match cmd {
        PolicyCommand::Validate { dir } => match warden_policy::cedar::load_dir(&dir) {
            Ok(p) => {
                println!("valid: {} policies", p.count);
                Ok(0)
            }
            Err(errors) => {
                for e in errors {
                    println!("{e}");
                }
                Ok(1)
            }
        },
        PolicyCommand::Check { request, json: as_json } => {
            let text = std::fs::read_to_string(&request).with_context(|| format!("reading {}", request.display()))?;
            let r: Value = serde_json::from_str(&text).context("the request file is not JSON")?;
            let s = |k: &str, d: &str| r.get(k).and_then(Value::as_str).unwrap_or(d).to_string();
            let req = pb::AuthorizeRequest {
                tenant: s("tenant", &target.tenant),
                run_id: s("run_id", "dry-run"),
                step_id: s("step_id", "check"),
                attempt: 1,
                tool: s("tool", ""),
                args_json: r.get("args").cloned().unwrap_or_else(|| json!({})).to_string(),
                capability_handle: s("capability_handle", ""),
                idempotency_key: "dry-run:check:1".into(),
                epoch: 0,
                agent: s("agent", ""),
                retry_of: String::new(),
                caller_records: false,
                base_rules_only: false,
                ..Default::default()
            };
            let d = PolicyClient::new(warden_grpc::channel(policy_endpoint)?)
                .check(req)
                .await
                .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
                .into_inner();
            let outcome = pb::Outcome::try_from(d.outcome)
                .map(|o| o.as_str_name().trim_start_matches("OUTCOME_").to_lowercase())
                .unwrap_or_default();
            if as_json {
                println!(
                    "{}",
                    json!({"outcome": outcome, "rule_id": d.rule_id, "reason": d.reason, "args_sha256": d.args_sha256})
                );
            } else {
                println!("{outcome}\nrule   {}\nreason {}", d.rule_id, d.reason);
            }
            Ok(if outcome == "allow" { 0 } else { 1 })
        }
    }
}
