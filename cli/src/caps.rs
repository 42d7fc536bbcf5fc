//! `warden caps issue|revoke|list`: capability handles (served by the policy service).

use serde_json::json;
use warden_proto::v1 as pb;
use warden_proto::v1::capabilities_client::CapabilitiesClient;

use crate::Target;
use crate::run::describe;

#[derive(clap::Subcommand)]
pub enum CapsCommand {
    /// Issue a capability; prints its id and the handle (shown only this once).
    Issue {
        /// Tool patterns (exact, or ending in '*'); repeat for several.
        #[arg(long = "tool", required = true)]
        tools: Vec<String>,
        #[arg(long = "action")]
        actions: Vec<String>,
        #[arg(long = "resource")]
        resources: Vec<String>,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: u64,
        /// Bind it to one run: that run's calls use it without presenting the handle.
        #[arg(long)]
        run: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Revoke a capability by id.
    Revoke {
        capability_id: String,
        #[arg(long)]
        reason: String,
    },
    /// The tenant's capabilities: `id<TAB>state<TAB>expires_at_ms<TAB>tools`.
    List {
        #[arg(long)]
        json: bool,
    },
}

fn as_json(c: &pb::Capability) -> serde_json::Value {
    json!({"capability_id": c.capability_id, "tenant": c.tenant, "tool_patterns": c.tool_patterns,
           "action_patterns": c.action_patterns, "resource_patterns": c.resource_patterns,
           "issued_at_ms": c.issued_at_ms, "expires_at_ms": c.expires_at_ms, "revoked": c.revoked,
           "revoke_reason": c.revoke_reason, "handle": (!c.handle.is_empty()).then_some(&c.handle)})
}

pub async fn run(target: &Target, policy_endpoint: &str, cmd: CapsCommand) -> anyhow::Result<i32> {
    let mut client = CapabilitiesClient::new(warden_grpc::channel(policy_endpoint)?);
    let err = |s: tonic::Status| anyhow::anyhow!("{}", describe(&s));
    match cmd {
        CapsCommand::Issue { tools, actions, resources, ttl, run, json } => {
            let c = client
                .issue(pb::IssueCapabilityRequest {
                    tenant: target.tenant.clone(),
                    tool_patterns: tools,
                    action_patterns: actions,
                    resource_patterns: resources,
                    ttl_seconds: ttl,
                    run_id: run.unwrap_or_default(),
                })
                .await
                .map_err(err)?
                .into_inner();
            if json {
                println!("{}", as_json(&c));
            } else {
                println!(
                    "capability {}\nhandle     {}\n(the handle is shown only now; present it as capability_handle)",
                    c.capability_id, c.handle
                );
            }
        }
        CapsCommand::Revoke { capability_id, reason } => {
            let c = client
                .revoke(pb::RevokeCapabilityRequest { tenant: target.tenant.clone(), capability_id, reason })
                .await
                .map_err(err)?
                .into_inner();
            println!("revoked {}", c.capability_id);
        }
        CapsCommand::List { json } => {
            let mut token = String::new();
            loop {
                let page = client
                    .list(pb::ListCapabilitiesRequest {
                        tenant: target.tenant.clone(),
                        page_size: 500,
                        page_token: token,
                    })
                    .await
                    .map_err(err)?
                    .into_inner();
                for c in &page.capabilities {
                    if json {
                        println!("{}", as_json(c));
                    } else {
                        let state = if c.revoked {
                            "revoked"
                        } else if c.expires_at_ms <= warden_grpc::now_ms() {
                            "expired"
                        } else {
                            "active"
                        };
                        println!("{}\t{state}\t{}\t{}", c.capability_id, c.expires_at_ms, c.tool_patterns.join(","));
                    }
                }
                if page.next_page_token.is_empty() {
                    break;
                }
                token = page.next_page_token;
            }
        }
    }
    Ok(0)
}
