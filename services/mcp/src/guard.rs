//! The two proofs every call needs before anything is forwarded to an MCP server: the policy's
//! signed authorization of exactly this call, and the ledger's signed acknowledgement that the
//! call's request is recorded. Keys are fetched from their publishers (`GetVerificationKeys`,
//! `GetLedgerKeys`) at start and again when an unknown key id shows up (a rotation).
//!
//! The same checks as the demo tool host's (`warden_tools::ToolHostService::verify`), kept
//! here rather than shared because sharing them would mean editing that host; they are small
//! and both call the same `warden_core` verifiers, which hold the logic that matters.

use tonic::Status;
use warden_core::ack::{AckedCall, verify_ack};
use warden_core::auth::{self, CallIdentity};
use warden_grpc::auth::Ch;
use warden_grpc::{keyfile, now_ms};
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_proto::v1::policy_client::PolicyClient;

#[derive(Clone)]
pub struct Guard {
    pub policy_keys: warden_grpc::keyfile::KeyRing,
    policy: PolicyClient<Ch>,
    pub ledger_keys: warden_grpc::keyfile::KeyRing,
    ledger: LedgerClient<Ch>,
}

impl Guard {
    pub fn new(policy_endpoint: &str, ledger_endpoint: &str) -> Result<Guard, Status> {
        Ok(Guard {
            policy_keys: Default::default(),
            policy: PolicyClient::new(warden_grpc::channel(policy_endpoint)?),
            ledger_keys: Default::default(),
            ledger: LedgerClient::new(warden_grpc::channel(ledger_endpoint)?),
        })
    }

    pub async fn refresh_policy_keys(&self) -> Result<(), Status> {
        self.policy_keys.install(keyfile::policy_keys(&self.policy).await?);
        Ok(())
    }

    pub async fn refresh_ledger_keys(&self) -> Result<(), Status> {
        self.ledger_keys.install(keyfile::ledger_keys(&self.ledger).await?);
        Ok(())
    }

    /// `PERMISSION_DENIED` unless the call carries policy's allow of exactly this call (tenant,
    /// run, step, attempt, tool, argument digest, idempotency key; unexpired) and the ledger's
    /// acknowledgement that its request, citing that allow, is recorded.
    pub async fn verify(&self, r: &pb::InvokeRequest, args_sha256: &str) -> Result<auth::AuthorizationClaims, Status> {
        let signed = warden_grpc::convert::claims_from_wire(r.authorization.as_ref());
        if !signed.key_id.is_empty() {
            // Possibly a rotated key: ask the policy (once for every call meeting it together).
            // Failure leaves the key unknown.
            let _ = self.policy_keys.learn(&signed.key_id, || keyfile::policy_keys(&self.policy)).await;
        }
        let call = CallIdentity {
            tenant: &r.tenant,
            run_id: &r.run_id,
            step_id: &r.step_id,
            attempt: r.attempt,
            tool: &r.tool,
            args_sha256,
            idempotency_key: &r.idempotency_key,
        };
        let refused = |e: auth::AuthError, what: &str| {
            tracing::warn!(run_id = %r.run_id, step_id = %r.step_id, tool = %r.tool, error = %e, "refused unauthorized call");
            Status::permission_denied(format!("refused: {what}{e}"))
        };
        let claims =
            auth::verify(&signed, |id| self.policy_keys.get(id), &call, now_ms()).map_err(|e| refused(e, ""))?;
        let ack = warden_grpc::convert::claims_from_wire(r.request_ack.as_ref());
        if !ack.key_id.is_empty() {
            let _ = self.ledger_keys.learn(&ack.key_id, || keyfile::ledger_keys(&self.ledger)).await;
        }
        let acked = AckedCall {
            tenant: &r.tenant,
            run_id: &r.run_id,
            step_id: &r.step_id,
            attempt: r.attempt,
            decision_id: &claims.decision_id,
            idempotency_key: &r.idempotency_key,
        };
        verify_ack(&ack, |id| self.ledger_keys.get(id), &acked)
            .map_err(|e| refused(e, "no ledger acknowledgement that the request is recorded: "))?;
        Ok(claims)
    }
}
