//! Decisions about runs that were never created. An executor asks for a run's first decision
//! while the run is being created (docs/write-path.md); when the creation then fails — the
//! submission was a repeat, the ledger refused it, the executor died — the policy's own copy
//! of the decision finds no run to be recorded in. It is kept here instead, so that every
//! decision the policy signed is in the ledger (K03).

use sqlx::Row;

use super::LedgerStore;
use crate::error::LedgerError;

/// One decision kept apart from every chain.
#[derive(Debug, Clone, PartialEq)]
pub struct UnboundDecision {
    /// Its place in the order decisions were kept (0 before it is kept).
    pub seq: u64,
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub decision_id: String,
    pub payload_json: String,
    pub recorded_at_ms: i64,
}

impl LedgerStore {
    /// Keeps `d` (its signature already verified); keeping it again changes nothing.
    pub async fn put_unbound_decision(&self, d: &UnboundDecision) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO unbound_decisions (decision_id, tenant, run_id, step_id, payload_json, recorded_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (decision_id) DO NOTHING",
        )
        .bind(&d.decision_id)
        .bind(&d.tenant)
        .bind(&d.run_id)
        .bind(&d.step_id)
        .bind(&d.payload_json)
        .bind(d.recorded_at_ms)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Up to `limit` of a tenant's unbound decisions (every tenant's for `None`), in the order
    /// they were kept, after `after_seq`.
    pub async fn unbound_decisions(
        &self,
        tenant: Option<&str>,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<UnboundDecision>, LedgerError> {
        let sql = format!(
            "SELECT seq, tenant, run_id, step_id, decision_id, payload_json, recorded_at_ms FROM unbound_decisions
             WHERE seq > $1 {} ORDER BY seq LIMIT {limit}",
            if tenant.is_some() { "AND tenant = $2" } else { "" }
        );
        let after = i64::try_from(after_seq).unwrap_or(i64::MAX);
        let rows = self
            .reading(|| {
                let q = sqlx::query(&sql).bind(after);
                let q = match tenant {
                    Some(t) => q.bind(t),
                    None => q,
                };
                q.fetch_all(self.pool())
            })
            .await?;
        rows.iter()
            .map(|r| {
                Ok(UnboundDecision {
                    seq: r.try_get::<i64, _>(0)?.max(0) as u64,
                    tenant: r.try_get(1)?,
                    run_id: r.try_get(2)?,
                    step_id: r.try_get(3)?,
                    decision_id: r.try_get(4)?,
                    payload_json: r.try_get(5)?,
                    recorded_at_ms: r.try_get(6)?,
                })
            })
            .collect()
    }
}
