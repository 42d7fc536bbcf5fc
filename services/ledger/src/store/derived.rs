//! Tables derived from events inside the append's database transaction: summaries (for
//! typed queries) and SPEC-KERN-01 transactions (staged deltas, committed state). A refused
//! step — a commit whose preconditions no longer hold, a rollback of a committed
//! transaction — fails the whole append, so nothing is written.

use serde_json::Value;
use sqlx::{Any, Row, Transaction};
use warden_core::chain::ChainedEvent;
use warden_core::events::{self, RunStatus};

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
            | events::RUN_PAUSED
            | events::RUN_BLOCKED
            | events::FRAME_CLOSED
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
        events::RUN_PAUSED | events::RUN_BLOCKED => not_cancelled(tx, e).await.map(|_| String::new()),
        events::FRAME_CLOSED => frame_closed(tx, e).await.map(|_| String::new()),
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
/// a goal run's plan is revised: it had one from planning already. The ledger holds a round
/// to what replanning is (seed 000 §12), whoever appends it:
/// - rounds come in order (`round` is one more than the rounds recorded);
/// - every step that completed is kept, unchanged (it is never run again, nor rewritten);
/// - every other step of the revised plan is new: its id was never used in the run, by an
///   event or an earlier plan (a proposed step taking a used id is renamed `<id>_r<N>` by the
///   planner), and `steps` lists exactly those (by id).
async fn plan_revised(tx: &mut Tx<'_>, e: &ChainedEvent) -> Result<(), LedgerError> {
    use warden_core::plan::Plan;
    let payload = &e.body.payload;
    let plan = payload.get("plan").ok_or_else(|| LedgerError::invalid("payload_json.plan", "missing"))?;
    let text = warden_core::canonical_json(plan);
    let revised = Plan::parse(&text).map_err(|err| LedgerError::invalid("payload_json.plan", err.to_string()))?;
    let run_id = &e.body.run_id;
    let row = sqlx::query("SELECT plan_json FROM runs WHERE run_id = $1 AND plan_json <> '' AND goal <> ''")
        .bind(run_id)
        .fetch_optional(&mut **tx)
        .await?;
    let Some(row) = row else {
        return Err(LedgerError::Precondition(format!("run '{run_id}' is not a planned goal run")));
    };
    let current = Plan::parse(&row.try_get::<String, _>(0)?)
        .map_err(|err| LedgerError::Internal(format!("run '{run_id}' has a plan that does not parse: {err}")))?;
    let rounds: i64 = sqlx::query("SELECT COUNT(*) FROM events WHERE run_id = $1 AND event_type = $2")
        .bind(run_id)
        .bind(events::PLAN_REVISED)
        .fetch_one(&mut **tx)
        .await?
        .try_get(0)?;
    let round = payload.get("round").and_then(Value::as_i64).unwrap_or_default();
    if round != rounds + 1 {
        return Err(LedgerError::invalid(
            "payload_json.round",
            format!("is {round}; the run has recorded {rounds} replanning rounds, so this one is {}", rounds + 1),
        ));
    }
    let ids = |event_type: Option<&str>| {
        let sql = match event_type {
            Some(_) => "SELECT DISTINCT step_id FROM events WHERE run_id = $1 AND event_type = $2",
            None => "SELECT DISTINCT step_id FROM events WHERE run_id = $1 AND step_id <> $2",
        };
        sqlx::query(sql).bind(run_id.clone()).bind(event_type.unwrap_or("").to_string())
    };
    let completed: std::collections::HashSet<String> = ids(Some(events::TOOL_COMPLETED))
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(|r| r.try_get::<String, _>(0))
        .collect::<Result<_, _>>()?;
    let mut used: std::collections::HashSet<String> =
        ids(None).fetch_all(&mut **tx).await?.iter().map(|r| r.try_get::<String, _>(0)).collect::<Result<_, _>>()?;
    // And every step of every earlier plan, run or not.
    let plans = sqlx::query("SELECT payload_json FROM events WHERE run_id = $1 AND event_type IN ($2, $3)")
        .bind(run_id)
        .bind(events::PLAN_CREATED)
        .bind(events::PLAN_REVISED)
        .fetch_all(&mut **tx)
        .await?;
    for row in plans {
        let recorded: Value = serde_json::from_str(&row.try_get::<String, _>(0)?).unwrap_or_default();
        if let Some(steps) = recorded.pointer("/plan/steps").and_then(Value::as_array) {
            used.extend(steps.iter().filter_map(|s| s.get("id").and_then(Value::as_str)).map(str::to_string));
        }
    }
    for step in current.steps.iter().filter(|s| completed.contains(&s.id)) {
        match revised.steps.iter().find(|r| r.id == step.id) {
            Some(kept) if kept == step => {}
            Some(_) => {
                let why = format!("rewrites step '{}', which completed (a completed step is kept as it was)", step.id);
                return Err(LedgerError::invalid("payload_json.plan", why));
            }
            None => {
                let why = format!("drops step '{}', which completed (a completed step is kept)", step.id);
                return Err(LedgerError::invalid("payload_json.plan", why));
            }
        }
    }
    let kept: std::collections::HashSet<&str> =
        current.steps.iter().filter(|s| completed.contains(&s.id)).map(|s| s.id.as_str()).collect();
    let new: Vec<&str> = revised.steps.iter().map(|s| s.id.as_str()).filter(|id| !kept.contains(id)).collect();
    if let Some(id) = new.iter().find(|id| used.contains(**id) || current.steps.iter().any(|s| s.id == **id)) {
        let why = format!("step '{id}' takes an id the run used before; a new step needs a new id");
        return Err(LedgerError::invalid("payload_json.plan", why));
    }
    let listed: Vec<&str> = payload
        .get("steps")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if listed != new {
        return Err(LedgerError::invalid("payload_json.steps", "must list exactly the plan's new steps, in order"));
    }
    sqlx::query("UPDATE runs SET plan_json = $2 WHERE run_id = $1").bind(run_id).bind(&text).execute(&mut **tx).await?;
    Ok(())
}

/// A child frame's end is recorded on its parent's step only as it is: the child run is the
/// frame that step opened (its `run_submitted` names this run and step) and ended with the
/// status the event says. A step's result cannot be made up without its frame's record.
async fn frame_closed(tx: &mut Tx<'_>, e: &ChainedEvent) -> Result<(), LedgerError> {
    let child = text(&e.body.payload, "child_run_id");
    let said = text(&e.body.payload, "status");
    let row = sqlx::query("SELECT r.status, ev.payload_json FROM runs r JOIN events ev ON ev.run_id = r.run_id AND ev.seq = 1 WHERE r.run_id = $1")
        .bind(child)
        .fetch_optional(&mut **tx)
        .await?;
    let Some(row) = row else {
        return Err(LedgerError::invalid("payload_json.child_run_id", format!("no run '{child}'")));
    };
    let status: String = row.try_get(0)?;
    let submitted: Value = serde_json::from_str(&row.try_get::<String, _>(1)?).unwrap_or_default();
    let frame = submitted.get("frame").cloned().unwrap_or_default();
    if text(&frame, "parent_run_id") != e.body.run_id || text(&frame, "step_id") != e.body.step_id {
        return Err(LedgerError::invalid(
            "payload_json.child_run_id",
            format!("run '{child}' is not the frame step '{}' of this run opened", e.body.step_id),
        ));
    }
    let ended = RunStatus::parse(&status).is_some_and(RunStatus::is_terminal);
    if !ended || status != said {
        return Err(LedgerError::Precondition(format!("frame run '{child}' is {status}, not {said}")));
    }
    Ok(())
}

/// A run whose cancellation was requested is not paused nor blocked: `Runs.CancelRun` resumes
/// a paused or blocked run to cancel it, and a pause or block recorded after its request would
/// leave the request behind it for good.
async fn not_cancelled(tx: &mut Tx<'_>, e: &ChainedEvent) -> Result<(), LedgerError> {
    let requested = sqlx::query("SELECT seq FROM events WHERE run_id = $1 AND event_type = $2 LIMIT 1")
        .bind(&e.body.run_id)
        .bind(events::RUN_CANCEL_REQUESTED)
        .fetch_optional(&mut **tx)
        .await?;
    if requested.is_some() {
        return Err(LedgerError::Precondition(format!(
            "run '{}' has a cancellation requested; it is cancelled, not paused or blocked",
            e.body.run_id
        )));
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
