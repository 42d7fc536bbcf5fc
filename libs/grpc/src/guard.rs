//! The two proofs every tool call needs before a host acts on it: the policy's signed
//! authorization of exactly this call, and the ledger's signed acknowledgement that the call's
//! request is recorded, citing that allow. Both hosts of the mesh — the demo tool host and the
//! MCP gateway — check a call here, so they refuse the same calls in the same order.
//!
//! Keys are fetched from their publishers (`GetVerificationKeys`, `GetLedgerKeys`) at start
//! and again when an unknown key id shows up (a rotation). The two signatures of a call are
//! checked together, and with those of other calls arriving meanwhile (see
//! [`crate::verify`]); what is refused, and in what order, is as if each were checked alone
//! (`auth::verify`, then `ack::verify_ack`).

use std::sync::Arc;

use tonic::Status;
use warden_core::ack::{AckedCall, check_signed_ack};
use warden_core::auth::{self, AuthorizationClaims, CallIdentity};
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_proto::v1::policy_client::PolicyClient;

use crate::auth::Ch;
use crate::keyfile::{self, KeyRing};
use crate::verify::Verifier;

#[derive(Clone)]
pub struct Guard {
    /// The policy's keys: they verify authorizations.
    pub policy_keys: KeyRing,
    policy: PolicyClient<Ch>,
    /// The ledger's keys: they verify the acknowledgement that a call's request is recorded.
    pub ledger_keys: KeyRing,
    ledger: LedgerClient<Ch>,
    /// Checks the signatures of concurrent calls together.
    verifier: Arc<Verifier>,
}

impl Guard {
    /// Channels to the key publishers are opened lazily. Must be called within a Tokio runtime.
    pub fn new(policy_endpoint: &str, ledger_endpoint: &str) -> Result<Guard, Status> {
        Ok(Guard {
            policy_keys: Default::default(),
            policy: PolicyClient::new(crate::channel(policy_endpoint)?),
            ledger_keys: Default::default(),
            ledger: LedgerClient::new(crate::channel(ledger_endpoint)?),
            verifier: Default::default(),
        })
    }

    /// Fetches the policy's verification keys (on start).
    pub async fn refresh_policy_keys(&self) -> Result<(), Status> {
        self.policy_keys.install(keyfile::policy_keys(&self.policy).await?);
        Ok(())
    }

    /// Fetches the ledger's keys (on start).
    pub async fn refresh_ledger_keys(&self) -> Result<(), Status> {
        self.ledger_keys.install(keyfile::ledger_keys(&self.ledger).await?);
        Ok(())
    }

    /// `PERMISSION_DENIED` unless the call carries the policy's allow of exactly this call
    /// (tenant, run, step, attempt, tool, argument digest, idempotency key; unexpired) and the
    /// ledger's acknowledgement that its request, citing that allow, is recorded. With
    /// `declared` (the tool's declaration digest and effect class as this host declares it
    /// now), the allow must also have been decided for that declaration; that is checked
    /// after the authorization and before the acknowledgement.
    pub async fn verify(
        &self,
        r: &pb::InvokeRequest,
        args_sha256: &str,
        declared: Option<(&str, &str)>,
    ) -> Result<AuthorizationClaims, Status> {
        let signed = crate::convert::claims_from_wire(r.authorization.as_ref());
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
        let not_acked = "no ledger acknowledgement that the request is recorded: ";
        // Expiry is judged when the call arrived, not after its turn in the batch.
        let now = crate::now_ms();
        let authorization = auth::signature_of(&signed, |id| self.policy_keys.get(id)).map_err(|e| refused(e, ""))?;
        let ack = crate::convert::claims_from_wire(r.request_ack.as_ref());
        // The acknowledgement's signature goes with the authorization's when its key is known
        // already; a key to learn is learnt only for a call whose authorization holds.
        let known = ack.key_id.is_empty() || self.ledger_keys.get(&ack.key_id).is_some();
        let mut items = vec![authorization];
        // What became of the acknowledgement's signature: None when its key is still to learn.
        let ack_signature =
            known.then(|| auth::signature_of(&ack, |id| self.ledger_keys.get(id)).map(|s| items.push(s)));
        let answers = self.verifier.verify(items).await;
        if answers.first() != Some(&true) {
            return Err(refused(auth::AuthError::BadSignature, ""));
        }
        let claims = auth::check_signed(&signed, &call, now).map_err(|e| refused(e, ""))?;
        if let Some((digest, effect)) = declared {
            auth::check_declaration(&claims, digest, effect)
                .map_err(|e| refused(e, "decided for another declaration of the tool: "))?;
        }
        let acked = AckedCall {
            tenant: &r.tenant,
            run_id: &r.run_id,
            step_id: &r.step_id,
            attempt: r.attempt,
            decision_id: &claims.decision_id,
            idempotency_key: &r.idempotency_key,
        };
        match ack_signature {
            Some(Err(e)) => return Err(refused(e, not_acked)),
            Some(Ok(_)) if answers.get(1) != Some(&true) => {
                return Err(refused(auth::AuthError::BadSignature, not_acked));
            }
            Some(Ok(_)) => {}
            None => {
                let _ = self.ledger_keys.learn(&ack.key_id, || keyfile::ledger_keys(&self.ledger)).await;
                let s = auth::signature_of(&ack, |id| self.ledger_keys.get(id)).map_err(|e| refused(e, not_acked))?;
                if self.verifier.verify(vec![s]).await.first() != Some(&true) {
                    return Err(refused(auth::AuthError::BadSignature, not_acked));
                }
            }
        }
        check_signed_ack(&ack, &acked).map_err(|e| refused(e, not_acked))?;
        Ok(claims)
    }
}
