//! The batched append path: a whole group-commit batch of plain events (no derived effects)
//! in a handful of statements — lock the batch's runs, read every idempotency key and cited
//! decision at once, decide each event in memory in order, then write all events, all
//! receipts and each run's new head. Every refusal is decided before the first write.

use std::collections::{HashMap, HashSet};

use sqlx::{Any, Row, Transaction};
use warden_core::chain::{ChainedEvent, EventBody, link};
use warden_core::receipt::{Receipt, receipt_for, receipt_id};

use super::checks::{self, RunHead};
use super::{Backend, EVENT_COLUMNS, LedgerStore, OwnedEvent, event_from_row};
use crate::error::LedgerError;
use crate::group::GroupResult;

type Tx<'a> = Transaction<'a, Any>;

/// Rows per multi-row statement (10 parameters each stays under every backend's limit).
const ROWS: usize = 400;

fn marks(rows: usize, cols: usize, from: usize) -> String {
    (0..rows)
        .map(|r| {
            format!("({})", (1..=cols).map(|c| format!("${}", from + r * cols + c)).collect::<Vec<_>>().join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Locks the runs (in id order, so concurrent batches cannot deadlock) and reads their heads.
pub async fn lock_heads(
    store: &LedgerStore,
    tx: &mut Tx<'_>,
    run_ids: &[String],
) -> Result<HashMap<String, RunHead>, LedgerError> {
    let mut ids: Vec<&String> = run_ids.iter().collect();
    ids.sort();
    ids.dedup();
    let mut heads = HashMap::new();
    for chunk in ids.chunks(ROWS) {
        let list = (1..=chunk.len()).map(|i| format!("${i}")).collect::<Vec<_>>().join(", ");
        let lock = if store.backend == Backend::Postgres { " FOR UPDATE" } else { "" };
        let sql = format!(
            "SELECT run_id, tenant, status, reason, last_seq, head_hash, max_epoch, updated_at_ms FROM runs
             WHERE run_id IN ({list}) ORDER BY run_id{lock}"
        );
        let mut q = sqlx::query(&sql);
        for id in chunk {
            q = q.bind(id.as_str());
        }
        for r in q.fetch_all(&mut **tx).await? {
            let head = RunHead {
                run_id: r.try_get("run_id")?,
                tenant: r.try_get("tenant")?,
                status: r.try_get("status")?,
                reason: r.try_get("reason")?,
                last_seq: r.try_get::<i64, _>("last_seq")? as u64,
                head_hash: r.try_get("head_hash")?,
                max_epoch: r.try_get::<i64, _>("max_epoch")? as u64,
                updated_at_ms: r.try_get("updated_at_ms")?,
            };
            heads.insert(head.run_id.clone(), head);
        }
    }
    Ok(heads)
}

/// Events by `(run_id, idempotency_key)`.
pub async fn find_events(
    tx: &mut Tx<'_>,
    keys: &[(String, String)],
) -> Result<HashMap<(String, String), ChainedEvent>, LedgerError> {
    let mut found = HashMap::new();
    for chunk in keys.chunks(ROWS) {
        let pairs = marks(chunk.len(), 2, 0);
        let sql = format!("SELECT {EVENT_COLUMNS} FROM events WHERE (run_id, idempotency_key) IN ({pairs})");
        let mut q = sqlx::query(&sql);
        for (run, key) in chunk {
            q = q.bind(run.as_str()).bind(key.as_str());
        }
        for r in q.fetch_all(&mut **tx).await? {
            let e = event_from_row(&r)?;
            found.insert((e.body.run_id.clone(), e.body.idempotency_key.clone()), e);
        }
    }
    Ok(found)
}

/// Which of these receipt ids exist already.
pub async fn existing_receipts(tx: &mut Tx<'_>, ids: &[String]) -> Result<HashSet<String>, LedgerError> {
    let mut found = HashSet::new();
    for chunk in ids.chunks(ROWS) {
        let list = (1..=chunk.len()).map(|i| format!("${i}")).collect::<Vec<_>>().join(", ");
        let sql = format!("SELECT receipt_id FROM receipts WHERE receipt_id IN ({list})");
        let mut q = sqlx::query(&sql);
        for id in chunk {
            q = q.bind(id.as_str());
        }
        for r in q.fetch_all(&mut **tx).await? {
            found.insert(r.try_get::<String, _>(0)?);
        }
    }
    Ok(found)
}

pub async fn insert_events(tx: &mut Tx<'_>, events: &[ChainedEvent]) -> Result<(), LedgerError> {
    for chunk in events.chunks(ROWS) {
        let sql = format!(
            "INSERT INTO events (run_id, seq, event_type, payload_json, step_id, epoch, idempotency_key, timestamp_ms, prev_hash, hash) VALUES {}",
            marks(chunk.len(), 10, 0)
        );
        let mut q = sqlx::query(&sql);
        for e in chunk {
            q = q
                .bind(&e.body.run_id)
                .bind(e.body.seq as i64)
                .bind(&e.body.event_type)
                .bind(warden_core::canonical_json(&e.body.payload))
                .bind(&e.body.step_id)
                .bind(e.body.epoch as i64)
                .bind(&e.body.idempotency_key)
                .bind(e.body.timestamp_ms)
                .bind(&e.prev_hash)
                .bind(&e.hash);
        }
        q.execute(&mut **tx).await?;
    }
    Ok(())
}

pub async fn insert_receipts(tx: &mut Tx<'_>, receipts: &[Receipt]) -> Result<(), LedgerError> {
    for chunk in receipts.chunks(ROWS) {
        let sql = format!(
            "INSERT INTO receipts (receipt_id, run_id, step_id, attempt, seq, body_json, status, hash) VALUES {}",
            marks(chunk.len(), 8, 0)
        );
        let mut q = sqlx::query(&sql);
        for r in chunk {
            q = q
                .bind(&r.receipt_id)
                .bind(&r.run_id)
                .bind(&r.step_id)
                .bind(r.attempt as i64)
                .bind(r.seq as i64)
                .bind(warden_core::canonical_json(r))
                .bind(&r.status)
                .bind(&r.hash);
        }
        // Checked before writing; a violation here is a race the database caught, and the
        // transaction is unusable: storage trouble, never a refusal.
        q.execute(&mut **tx).await?;
    }
    Ok(())
}

/// Writes a run's new head, signed once for however many events the batch added.
pub async fn write_head(store: &LedgerStore, tx: &mut Tx<'_>, h: &RunHead) -> Result<(), LedgerError> {
    let (signature, key_id) = store.sign_head(&h.run_id, h.last_seq, &h.head_hash);
    sqlx::query(
        "UPDATE runs SET last_seq = $2, head_hash = $3, max_epoch = $4, status = $5, reason = $6, updated_at_ms = $7,
             head_signature = $8, head_key_id = $9
         WHERE run_id = $1",
    )
    .bind(&h.run_id)
    .bind(h.last_seq as i64)
    .bind(&h.head_hash)
    .bind(h.max_epoch as i64)
    .bind(&h.status)
    .bind(&h.reason)
    .bind(h.updated_at_ms)
    .bind(&signature)
    .bind(&key_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Appends groups of events without derived effects, each group all or nothing: a refused
/// event leaves its whole group out (and the in-memory state as it was before the group), and
/// the other groups go on. `Err` only for storage trouble.
pub async fn append_plain(
    store: &LedgerStore,
    tx: &mut Tx<'_>,
    groups: &[Vec<OwnedEvent>],
) -> Result<Vec<GroupResult>, LedgerError> {
    let run_ids: Vec<String> = groups.iter().flatten().map(|e| e.run_id.clone()).collect();
    let mut heads = lock_heads(store, tx, &run_ids).await?;
    let mut keys = Vec::new();
    let mut receipt_ids = Vec::new();
    for e in groups.iter().flatten() {
        keys.push((e.run_id.clone(), e.idempotency_key.clone()));
        if let Ok(Some(k)) = checks::cited_decision_key(&e.borrowed()) {
            keys.push((e.run_id.clone(), k));
        }
        receipt_ids.extend(receipt_id(&e.run_id, &e.event_type, &e.step_id, &e.payload));
    }
    let mut known = find_events(tx, &keys).await?;
    let mut receipts_taken = existing_receipts(tx, &receipt_ids).await?;
    let mut results = Vec::with_capacity(groups.len());
    let (mut new_events, mut new_receipts, mut touched) = (Vec::new(), Vec::new(), Vec::<String>::new());
    for group in groups {
        // What this group added, to undo if one of its events is refused.
        let saved_heads: HashMap<String, RunHead> =
            group.iter().filter_map(|e| heads.get(&e.run_id).map(|h| (e.run_id.clone(), h.clone()))).collect();
        let (mut added, mut appended, mut refused) = (Vec::new(), Vec::new(), None);
        for e in group {
            match decide(&mut heads, &known, &receipts_taken, e) {
                Ok((event, true, _)) => appended.push((event, true)),
                Ok((event, false, capability_id)) => {
                    let receipt = receipt_for(&event, &capability_id);
                    if let Some(r) = &receipt {
                        receipts_taken.insert(r.receipt_id.clone());
                    }
                    known.insert((event.body.run_id.clone(), event.body.idempotency_key.clone()), event.clone());
                    added.push((event.clone(), receipt));
                    appended.push((event, false));
                }
                Err(err) => {
                    refused = Some(err);
                    break;
                }
            }
        }
        match refused {
            None => {
                for (event, receipt) in added {
                    if !touched.contains(&event.body.run_id) {
                        touched.push(event.body.run_id.clone());
                    }
                    new_receipts.extend(receipt);
                    new_events.push(event);
                }
                results.push(Ok(appended));
            }
            Some(err) => {
                for (event, receipt) in added {
                    known.remove(&(event.body.run_id.clone(), event.body.idempotency_key.clone()));
                    if let Some(r) = receipt {
                        receipts_taken.remove(&r.receipt_id);
                    }
                }
                heads.extend(saved_heads);
                results.push(Err(err));
            }
        }
    }
    insert_events(tx, &new_events).await?;
    insert_receipts(tx, &new_receipts).await?;
    for run in &touched {
        if let Some(h) = heads.get(run) {
            write_head(store, tx, h).await?;
        }
    }
    Ok(results)
}

/// One event against the heads and what is known so far: the existing event of its key (a
/// retry), or the new event chained onto its run's head (advanced), with the capability of the
/// allow it cites.
fn decide(
    heads: &mut HashMap<String, RunHead>,
    known: &HashMap<(String, String), ChainedEvent>,
    receipts_taken: &HashSet<String>,
    e: &OwnedEvent,
) -> Result<(ChainedEvent, bool, String), LedgerError> {
    let new = e.borrowed();
    let head = heads.get_mut(&e.run_id).ok_or_else(|| LedgerError::NotFound(format!("run '{}'", e.run_id)))?;
    checks::check_tenant(head, &new)?;
    if let Some(existing) = known.get(&(e.run_id.clone(), e.idempotency_key.clone())) {
        checks::check_duplicate(existing, &new)?;
        checks::check_stale_repeat(head, &new)?;
        return Ok((existing.clone(), true, String::new()));
    }
    checks::check_writable(head, &new)?;
    let capability_id = match checks::cited_decision_key(&new)? {
        Some(k) => checks::check_allow(known.get(&(e.run_id.clone(), k)), &new)?,
        None => String::new(),
    };
    if let Some(id) = receipt_id(&e.run_id, &e.event_type, &e.step_id, &e.payload)
        && receipts_taken.contains(&id)
    {
        return Err(LedgerError::Precondition(format!(
            "step '{}' already has an outcome for this attempt (receipt {id})",
            e.step_id
        )));
    }
    let event = link(
        EventBody {
            run_id: e.run_id.clone(),
            seq: head.last_seq + 1,
            event_type: e.event_type.clone(),
            payload: e.payload.clone(),
            step_id: e.step_id.clone(),
            epoch: e.epoch,
            idempotency_key: e.idempotency_key.clone(),
            timestamp_ms: e.now_ms,
        },
        &head.head_hash,
    );
    head.advance(&event);
    Ok((event, false, capability_id))
}
