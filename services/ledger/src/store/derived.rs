//! Tables derived from events inside the append's database transaction: summaries (for
//! typed queries) and SPEC-KERN-01 transactions (staged deltas, committed state). A refused
//! step — a commit whose preconditions no longer hold, a rollback of a committed
//! transaction — fails the whole append, so nothing is written.

use serde_json::Value;
use sqlx::{Any, Row, Transaction};
use warden_core::chain::ChainedEvent;
use warden_core::events;

use super::Backend;
use crate::error::LedgerError;

/// The tool a decision allowing a commit names (its arguments: `{"tx_id": …, "deltas_sha256": …}`).
pub const COMMIT_TOOL: &str = "commit_tx";

type Tx<'a> = Transaction<'a, Any>;

/// Whether events of this type change derived tables.
pub fn has_effects(event_type: &str) -> bool {
    matches!(
        event_type,
        events::RUN_SUMMARY
            | events::TX_PROPOSED
            | events::TX_COMMITTED
            | events::TX_ROLLED_BACK
            | events::PLAN_CREATED
            | events::PLAN_REVISED
    )
}

/// Applies `e`'s derived effects; returns the capability a commit's decision named.
pub async fn apply(tx: &mut Tx<'_>, backend: Backend, tenant: &str, e: &ChainedEvent) -> Result<String, LedgerError> {
    match e.body.event_type.as_str() {
        events::RUN_SUMMARY => summary(tx, e).await.map(|_| String::new()),
        events::TX_PROPOSED => propose(tx, tenant, e).await.map(|_| String::new()),
        events::TX_COMMITTED => commit(tx, backend, tenant, e).await,
        events::TX_ROLLED_BACK => rollback(tx, e).await.map(|_| String::new()),
        events::PLAN_CREATED => plan_created(tx, e).await.map(|_| String::new()),
        events::PLAN_REVISED => plan_revised(tx, e).await.map(|_| String::new()),
        _ => Ok(String::new()),
    }
}

/// A goal run's plan becomes the run's plan (what `GetRun` answers and the policy signs steps
/// of) in the same transaction that records it — once: a run that has a plan takes no other.
async fn plan_created(tx: &mut Tx<'_>, e: &ChainedEvent) -> Result<(), LedgerError> {
    let plan = e.body.payload.get("plan").ok_or_else(|| LedgerError::invalid("payload_json.plan", "missing"))?;
    let text = warden_core::canonical_json(plan);
    warden_core::plan::Plan::parse(&text).map_err(|err| LedgerError::invalid("payload_json.plan", err.to_string()))?;
    let updated = sqlx::query("UPDATE runs SET plan_json = $2 WHERE run_id = $1 AND plan_json = ''")
        .bind(&e.body.run_id)
        .bind(&text)
        .execute(&mut **tx)
        .await?;
    if updated.rows_affected() != 1 {
        return Err(LedgerError::Precondition(format!("run '{}' already has a plan", e.body.run_id)));
    }
    Ok(())
}

/// A replanning round's plan becomes the run's plan (the policy signs only steps of it). Only
/// a goal run's plan is revised: it had one from planning already.
async fn plan_revised(tx: &mut Tx<'_>, e: &ChainedEvent) -> Result<(), LedgerError> {
    let plan = e.body.payload.get("plan").ok_or_else(|| LedgerError::invalid("payload_json.plan", "missing"))?;
    let text = warden_core::canonical_json(plan);
    warden_core::plan::Plan::parse(&text).map_err(|err| LedgerError::invalid("payload_json.plan", err.to_string()))?;
    let updated = sqlx::query("UPDATE runs SET plan_json = $2 WHERE run_id = $1 AND plan_json <> '' AND goal <> ''")
        .bind(&e.body.run_id)
        .bind(&text)
        .execute(&mut **tx)
        .await?;
    if updated.rows_affected() != 1 {
        return Err(LedgerError::Precondition(format!("run '{}' is not a planned goal run", e.body.run_id)));
    }
    Ok(())
}

fn text<'a>(p: &'a Value, k: &str) -> &'a str {
    p.get(k).and_then(Value::as_str).unwrap_or_default()
}

async fn summary(tx: &mut Tx<'_>, e: &ChainedEvent) -> Result<(), LedgerError> {
    let p = &e.body.payload;
    sqlx::query(
        "INSERT INTO summaries (run_id, seq, summary_type, payload_json, step_id, timestamp_ms) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&e.body.run_id)
    .bind(e.body.seq as i64)
    .bind(text(p, "summary_type"))
    .bind(warden_core::canonical_json(p.get("payload").unwrap_or(&Value::Null)))
    .bind(&e.body.step_id)
    .bind(e.body.timestamp_ms)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn tx_status(tx: &mut Tx<'_>, run_id: &str, tx_id: &str) -> Result<Option<String>, LedgerError> {
    let row = sqlx::query("SELECT status FROM transactions WHERE run_id = $1 AND tx_id = $2")
        .bind(run_id)
        .bind(tx_id)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(row.map(|r| r.try_get::<String, _>(0)).transpose()?)
}

fn not_open(tx_id: &str, status: &str) -> LedgerError {
    LedgerError::Precondition(format!("transaction '{tx_id}' is {status}, not open"))
}

async fn propose(tx: &mut Tx<'_>, tenant: &str, e: &ChainedEvent) -> Result<(), LedgerError> {
    let tx_id = text(&e.body.payload, "tx_id");
    match tx_status(tx, &e.body.run_id, tx_id).await?.as_deref() {
        None => {
            sqlx::query(
                "INSERT INTO transactions (run_id, tx_id, tenant, status, reason) VALUES ($1, $2, $3, 'open', '')",
            )
            .bind(&e.body.run_id)
            .bind(tx_id)
            .bind(tenant)
            .execute(&mut **tx)
            .await?;
        }
        Some("open") => {}
        Some(other) => return Err(not_open(tx_id, other)),
    }
    sqlx::query("INSERT INTO tx_staged (run_id, tx_id, seq, delta_json) VALUES ($1, $2, $3, $4)")
        .bind(&e.body.run_id)
        .bind(tx_id)
        .bind(e.body.seq as i64)
        .bind(warden_core::canonical_json(e.body.payload.get("delta").unwrap_or(&Value::Null)))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn version(tx: &mut Tx<'_>, tenant: &str, key: &str) -> Result<i64, LedgerError> {
    let row = sqlx::query("SELECT version FROM state WHERE tenant = $1 AND state_key = $2")
        .bind(tenant)
        .bind(key)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(row.map(|r| r.try_get::<i64, _>(0)).transpose()?.unwrap_or(0))
}

async fn commit(tx: &mut Tx<'_>, backend: Backend, tenant: &str, e: &ChainedEvent) -> Result<String, LedgerError> {
    let (run_id, p) = (&e.body.run_id, &e.body.payload);
    let tx_id = text(p, "tx_id");
    match tx_status(tx, run_id, tx_id).await?.as_deref() {
        Some("open") => {}
        Some(other) => return Err(not_open(tx_id, other)),
        None => return Err(LedgerError::NotFound(format!("transaction '{tx_id}'"))),
    }
    let staged = sqlx::query("SELECT delta_json FROM tx_staged WHERE run_id = $1 AND tx_id = $2 ORDER BY seq")
        .bind(run_id)
        .bind(tx_id)
        .fetch_all(&mut **tx)
        .await?;
    let deltas: Vec<Value> = staged
        .iter()
        .map(|r| serde_json::from_str(&r.try_get::<String, _>(0).unwrap_or_default()).unwrap_or_default())
        .collect();
    let deltas_sha256 = warden_core::canonical::staged_deltas_sha256(&deltas);
    // Commit applies staged effects only on a recorded allow of this very commit: tool
    // `commit_tx` with arguments {"tx_id", "deltas_sha256"} naming exactly the deltas staged
    // now, in this run. A delta staged after the decision (or its approval) changes the digest:
    // the commit then needs a new decision.
    let decision_id = text(p, "decision_id");
    let decision =
        sqlx::query("SELECT event_type, payload_json FROM events WHERE run_id = $1 AND idempotency_key = $2")
            .bind(run_id)
            .bind(events::decision_key(decision_id))
            .fetch_optional(&mut **tx)
            .await?;
    let expected_args =
        warden_core::canonical::args_digest(&serde_json::json!({ "tx_id": tx_id, "deltas_sha256": deltas_sha256 }));
    let capability = decision.and_then(|r| {
        let (t, body): (String, String) = (r.try_get(0).unwrap_or_default(), r.try_get(1).unwrap_or_default());
        let body: Value = serde_json::from_str(&body).unwrap_or_default();
        let allowed = t == events::POLICY_DECISION
            && text(&body, "outcome") == "allow"
            && text(&body, "tool") == COMMIT_TOOL
            && text(&body, "args_sha256") == expected_args;
        allowed.then(|| text(&body, "capability_id").to_string())
    });
    let Some(capability) = capability else {
        return Err(LedgerError::Precondition(format!(
            "commit of transaction '{tx_id}' cites decision '{decision_id}', which is not a recorded allow of \
             '{COMMIT_TOOL}' for this transaction's staged deltas (deltas_sha256 {deltas_sha256}) in this run"
        )));
    };
    // Commits of one tenant may run in other write lanes: on PostgreSQL, lock every key this
    // commit touches (sorted, so two commits cannot deadlock) before reading any version.
    if backend == Backend::Postgres {
        let mut keys: Vec<String> = Vec::new();
        for d in &deltas {
            for field in ["expect", "set"] {
                keys.extend(d.get(field).and_then(Value::as_object).into_iter().flat_map(|m| m.keys().cloned()));
            }
            keys.extend(
                d.get("delete")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .map(str::to_string),
            );
        }
        keys.sort_unstable();
        keys.dedup();
        for key in keys {
            sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
                .bind(format!("{tenant}\u{1f}{key}"))
                .execute(&mut **tx)
                .await?;
        }
    }
    // Preconditions are checked against committed state as it is now, all before any change.
    for d in &deltas {
        for (key, want) in d.get("expect").and_then(Value::as_object).into_iter().flatten() {
            let have = version(tx, tenant, key).await?;
            if Some(have) != want.as_i64() {
                return Err(LedgerError::Precondition(format!(
                    "transaction '{tx_id}' expected '{key}' at version {want}, it is at version {have}"
                )));
            }
        }
    }
    for d in &deltas {
        for (key, value) in d.get("set").and_then(Value::as_object).into_iter().flatten() {
            sqlx::query(
                "INSERT INTO state (tenant, state_key, value_json, version, run_id, tx_id, deleted) VALUES ($1, $2, $3, 1, $4, $5, 0)
                 ON CONFLICT (tenant, state_key) DO UPDATE SET value_json = excluded.value_json,
                     version = state.version + 1, run_id = excluded.run_id, tx_id = excluded.tx_id, deleted = 0",
            )
            .bind(tenant)
            .bind(key)
            .bind(warden_core::canonical_json(value))
            .bind(run_id)
            .bind(tx_id)
            .execute(&mut **tx)
            .await?;
        }
        // A delete leaves a tombstone whose version keeps counting, so an old expectation
        // can never match a key that was deleted and written again.
        for key in d.get("delete").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str) {
            sqlx::query(
                "INSERT INTO state (tenant, state_key, value_json, version, run_id, tx_id, deleted) VALUES ($1, $2, 'null', 1, $3, $4, 1)
                 ON CONFLICT (tenant, state_key) DO UPDATE SET value_json = 'null', version = state.version + 1,
                     run_id = excluded.run_id, tx_id = excluded.tx_id, deleted = 1",
            )
            .bind(tenant)
            .bind(key)
            .bind(run_id)
            .bind(tx_id)
            .execute(&mut **tx)
            .await?;
        }
    }
    finish(tx, run_id, tx_id, "committed", "").await?;
    Ok(capability)
}

async fn rollback(tx: &mut Tx<'_>, e: &ChainedEvent) -> Result<(), LedgerError> {
    let (run_id, p) = (&e.body.run_id, &e.body.payload);
    let tx_id = text(p, "tx_id");
    match tx_status(tx, run_id, tx_id).await?.as_deref() {
        Some("open") => {}
        Some(other) => return Err(not_open(tx_id, other)),
        None => return Err(LedgerError::NotFound(format!("transaction '{tx_id}'"))),
    }
    finish(tx, run_id, tx_id, "rolled_back", text(p, "reason")).await
}

async fn finish(tx: &mut Tx<'_>, run_id: &str, tx_id: &str, status: &str, reason: &str) -> Result<(), LedgerError> {
    sqlx::query("DELETE FROM tx_staged WHERE run_id = $1 AND tx_id = $2")
        .bind(run_id)
        .bind(tx_id)
        .execute(&mut **tx)
        .await?;
    sqlx::query("UPDATE transactions SET status = $3, reason = $4 WHERE run_id = $1 AND tx_id = $2")
        .bind(run_id)
        .bind(tx_id)
        .bind(status)
        .bind(reason)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
