//! `warden approvals list|approve|deny|watch`.

use serde_json::json;
use warden_proto::v1 as pb;
use warden_proto::v1::approvals_client::ApprovalsClient;

use crate::Target;
use crate::run::describe;

#[derive(clap::Subcommand)]
pub enum ApprovalsCommand {
    /// Approvals of the tenant: `id<TAB>state<TAB>run<TAB>step<TAB>tool<TAB>args_sha256`.
    List {
        /// pending, approved, denied or expired (default: all).
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Approve the exact call an approval is for.
    Approve {
        approval_id: String,
        /// Who decides; optional with a person's token (`tenant@person`), which names them.
        #[arg(long, env = "WARDEN_APPROVER", default_value = "")]
        approver: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Deny it (the step fails and is never retried).
    Deny {
        approval_id: String,
        /// Who decides; optional with a person's token (`tenant@person`), which names them.
        #[arg(long, env = "WARDEN_APPROVER", default_value = "")]
        approver: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Print every approval, then each change as it happens (Ctrl-C to stop).
    Watch {
        #[arg(long)]
        json: bool,
    },
}

fn state_name(s: i32) -> String {
    pb::ApprovalState::try_from(s)
        .map(|x| x.as_str_name().trim_start_matches("APPROVAL_STATE_").to_lowercase())
        .unwrap_or_default()
}

fn line(a: &pb::Approval, as_json: bool) -> String {
    if as_json {
        json!({"approval_id": a.approval_id, "tenant": a.tenant, "run_id": a.run_id, "step_id": a.step_id, "tool": a.tool,
               "args_sha256": a.args_sha256, "state": state_name(a.state), "approver": a.approver, "reason": a.reason,
               "created_at_ms": a.created_at_ms, "expires_at_ms": a.expires_at_ms})
        .to_string()
    } else {
        format!(
            "{}\t{}\t{}\t{}\t{}\t{}",
            a.approval_id,
            state_name(a.state),
            a.run_id,
            a.step_id,
            a.tool,
            a.args_sha256
        )
    }
}

pub async fn run(target: &Target, policy_endpoint: &str, cmd: ApprovalsCommand) -> anyhow::Result<i32> {
    let mut client = ApprovalsClient::new(warden_grpc::channel(policy_endpoint)?);
    let err = |s: tonic::Status| anyhow::anyhow!("{}", describe(&s));
    let resolve = |approval_id: String, approver: String, reason: String| pb::ResolveApprovalRequest {
        tenant: target.tenant.clone(),
        approval_id,
        approver,
        reason,
    };
    match cmd {
        ApprovalsCommand::List { state, json } => {
            let state = match state.as_deref() {
                None => pb::ApprovalState::Unspecified,
                Some(s) => pb::ApprovalState::from_str_name(&format!("APPROVAL_STATE_{}", s.to_uppercase()))
                    .ok_or_else(|| anyhow::anyhow!("unknown state '{s}'"))?,
            };
            let mut page_token = String::new();
            loop {
                let page = client
                    .list(pb::ListApprovalsRequest {
                        tenant: target.tenant.clone(),
                        state: state as i32,
                        page_size: 500,
                        page_token,
                    })
                    .await
                    .map_err(err)?
                    .into_inner();
                for a in &page.approvals {
                    println!("{}", line(a, json));
                }
                if page.next_page_token.is_empty() {
                    break;
                }
                page_token = page.next_page_token;
            }
        }
        ApprovalsCommand::Approve { approval_id, approver, reason } => {
            let a = client.approve(resolve(approval_id, approver, reason)).await.map_err(err)?.into_inner();
            println!("{}", line(&a, false));
        }
        ApprovalsCommand::Deny { approval_id, approver, reason } => {
            let a = client.deny(resolve(approval_id, approver, reason)).await.map_err(err)?.into_inner();
            println!("{}", line(&a, false));
        }
        ApprovalsCommand::Watch { json } => {
            let mut stream = client
                .watch(pb::WatchApprovalsRequest { tenant: target.tenant.clone() })
                .await
                .map_err(err)?
                .into_inner();
            while let Some(a) = stream.message().await.map_err(err)? {
                println!("{}", line(&a, json));
            }
        }
    }
    Ok(0)
}
