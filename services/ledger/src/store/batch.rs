//! The batched append path: a whole group-commit batch of plain events (no derived effects).
//! Each run's state — head, events by key, receipts — comes from the ledger's memory
//! ([`super::hot`]) or is read under the run's row lock; every event is then decided in memory
//! in order, every refusal before the first write; then the heads (each on condition of the
//! stored `last_seq` it was decided against), the events and the receipts are written: one
//! statement on PostgreSQL when every run was in memory, a few in one transaction otherwise.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use sqlx::{Any, Row, Transaction};
use warden_core::chain::{ChainedEvent, EventBody, link};
use warden_core::events;
use warden_core::receipt::{Receipt, receipt_for, receipt_id};

use super::checks::{self, RunHead};
use super::hot::{self, RunState};
use super::{Backend, EVENT_COLUMNS, HeadProof, LedgerStore, OwnedEvent, event_from_row};
use crate::error::LedgerError;
use crate::group::GroupResult;

type Tx<'a> = Transaction<'a, Any>;

/// Rows per multi-row statement (10 parameters each stays under every backend's limit).
const ROWS: usize = 400;

pub fn marks(rows: usize, cols: usize, from: usize) -> String {
    (0..rows)
        .map(|r| {
            format!("({})", (1..=cols).map(|c| format!("${}", from + r * cols + c)).collect::<Vec<_>>().join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `(?, …, ?), …`: SQLite's anonymous marks for `rows` rows of `cols` values, bound in the
/// order they appear. SQLite takes `$n` as a *named* parameter: its parser looks each name up
/// among those seen before (a string comparison per earlier name) and sqlx's binder asks each
/// parameter's name back (another scan), so a statement of thousands of `$n` cost time
/// quadratic in its size — a tenth of `warden dev`'s CPU in a busy batch. Anonymous marks are
/// numbered as they are parsed and have no name to look up.
pub fn anonymous_marks(rows: usize, cols: usize) -> String {
    let row = format!("({})", vec!["?"; cols].join(", "));
    vec![row; rows].join(", ")
}

/// `$1, …, $n`: the list of an `IN (…)` over `n` bound values.
fn placeholders(n: usize) -> String {
    (1..=n).map(|i| format!("${i}")).collect::<Vec<_>>().join(", ")
}

/// `q` with each of `ids` bound, in order.
fn bind_ids<'q, S: AsRef<str>>(mut q: Query<'q>, ids: &'q [S]) -> Query<'q> {
    for id in ids {
        q = q.bind(id.as_ref());
    }
    q
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
        let list = placeholders(chunk.len());
        let lock = if store.backend == Backend::Postgres { " FOR UPDATE" } else { "" };
        let sql = format!(
            "SELECT run_id, tenant, status, reason, last_seq, head_hash, max_epoch, updated_at_ms FROM runs
             WHERE run_id IN ({list}) ORDER BY run_id{lock}"
        );
        for r in bind_ids(sqlx::query(&sql), chunk).fetch_all(&mut **tx).await? {
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
        let list = placeholders(chunk.len());
        let sql = format!("SELECT receipt_id FROM receipts WHERE receipt_id IN ({list})");
        for r in bind_ids(sqlx::query(&sql), chunk).fetch_all(&mut **tx).await? {
            found.insert(r.try_get::<String, _>(0)?);
        }
    }
    Ok(found)
}

pub type Query<'q> = sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>>;

/// An `events` row's ten values, in column order.
fn bind_event<'q>(q: Query<'q>, e: &'q ChainedEvent) -> Query<'q> {
    q.bind(&e.body.run_id)
        .bind(e.body.seq as i64)
        .bind(&e.body.event_type)
        .bind(warden_core::canonical::canonical_value(&e.body.payload))
        .bind(&e.body.step_id)
        .bind(e.body.epoch as i64)
        .bind(&e.body.idempotency_key)
        .bind(e.body.timestamp_ms)
        .bind(&e.prev_hash)
        .bind(&e.hash)
}

/// A `receipts` row's eight values, in column order.
fn bind_receipt<'q>(q: Query<'q>, r: &'q Receipt) -> Query<'q> {
    q.bind(&r.receipt_id)
        .bind(&r.run_id)
        .bind(&r.step_id)
        .bind(r.attempt as i64)
        .bind(r.seq as i64)
        .bind(warden_core::canonical_json(r))
        .bind(&r.status)
        .bind(&r.hash)
}

pub async fn insert_events<E: std::borrow::Borrow<ChainedEvent>>(
    tx: &mut Tx<'_>,
    events: &[E],
) -> Result<(), sqlx::Error> {
    for chunk in events.chunks(ROWS) {
        let sql = insert_events_sql(chunk.len(), 0);
        bind_events(sqlx::query(&sql), chunk).execute(&mut **tx).await?;
    }
    Ok(())
}

/// The `INSERT` of `rows` events, their values bound from `$from + 1` on (see [`bind_events`]).
pub fn insert_events_sql(rows: usize, from: usize) -> String {
    insert_events_with(&marks(rows, 10, from))
}

pub(super) fn insert_events_with(marks: &str) -> String {
    format!(
        "INSERT INTO events (run_id, seq, event_type, payload_json, step_id, epoch, idempotency_key, timestamp_ms, prev_hash, hash) VALUES {marks}"
    )
}

/// `q` with each event's ten values bound, in order.
pub fn bind_events<'q, E: std::borrow::Borrow<ChainedEvent>>(mut q: Query<'q>, events: &'q [E]) -> Query<'q> {
    for e in events {
        q = bind_event(q, e.borrow());
    }
    q
}

/// The `INSERT` of receipts whose values `marks` takes (see [`bind_receipt`]).
pub(super) fn insert_receipts_with(marks: &str) -> String {
    format!("INSERT INTO receipts (receipt_id, run_id, step_id, attempt, seq, body_json, status, hash) VALUES {marks}")
}

pub async fn insert_receipts(tx: &mut Tx<'_>, receipts: &[Receipt]) -> Result<(), LedgerError> {
    for chunk in receipts.chunks(ROWS) {
        let sql = insert_receipts_with(&marks(chunk.len(), 8, 0));
        let mut q = sqlx::query(&sql);
        for r in chunk {
            q = bind_receipt(q, r);
        }
        // Checked before writing; a violation here is a race the database caught, and the
        // transaction is unusable: storage trouble, never a refusal.
        q.execute(&mut **tx).await?;
    }
    Ok(())
}

/// Writes a run's new head with its proof (one for however many events the batch added), on
/// condition that the stored head is still the one the batch was decided against.
pub async fn write_head(tx: &mut Tx<'_>, st: &RunState, proof: HeadProof) -> Result<(), LedgerError> {
    let written = bind_head(
        sqlx::query(
            "UPDATE runs SET last_seq = $2, head_hash = $3, max_epoch = $4, status = $5, reason = $6, updated_at_ms = $7,
                 head_signature = $8, head_key_id = $9, head_proof = $10
             WHERE run_id = $1 AND last_seq = $11",
        ),
        st,
        proof,
    )
    .execute(&mut **tx)
    .await?;
    if written.rows_affected() != 1 {
        return Err(moved(&st.head.run_id));
    }
    Ok(())
}

/// A head write's eleven values in the order of [`write_head`]'s statement: run id, the new
/// head's columns and proof, then the stored `last_seq` it is conditional on.
fn bind_head<'q>(q: Query<'q>, st: &'q RunState, proof: HeadProof) -> Query<'q> {
    bind_head_columns(q.bind(&st.head.run_id), st, proof).bind(st.stored_seq as i64)
}

/// A head write's eleven values with the run last: the new head's columns and proof, the run
/// id, then the stored `last_seq` it is conditional on ([`UPDATE_HEAD_ANONYMOUS`] and
/// [`ONE_RUN_STATEMENT`] take them in this order).
fn bind_head_then_run<'q>(q: Query<'q>, st: &'q RunState, proof: HeadProof) -> Query<'q> {
    bind_head_columns(q, st, proof).bind(&st.head.run_id).bind(st.stored_seq as i64)
}

/// The new head's nine columns with its proof, in the order `UPDATE runs SET` lists them.
fn bind_head_columns<'q>(q: Query<'q>, st: &'q RunState, proof: HeadProof) -> Query<'q> {
    let h = &st.head;
    q.bind(h.last_seq as i64)
        .bind(&h.head_hash)
        .bind(h.max_epoch as i64)
        .bind(&h.status)
        .bind(&h.reason)
        .bind(h.updated_at_ms)
        .bind(proof.signature)
        .bind(proof.key_id)
        .bind(proof.kind)
}

/// The head write of [`write_one_query`], with anonymous marks: the new head's columns, then
/// the run id and the stored `last_seq` it is conditional on, in that order.
pub(super) const UPDATE_HEAD_ANONYMOUS: &str =
    "UPDATE runs SET last_seq = ?, head_hash = ?, max_epoch = ?, status = ?, reason = ?,
     updated_at_ms = ?, head_signature = ?, head_key_id = ?, head_proof = ?
 WHERE run_id = ? AND last_seq = ?";

pub(super) fn moved(run_id: &str) -> LedgerError {
    LedgerError::Moved(format!("run '{run_id}' moved on under another writer; append again"))
}

/// The distinct runs of a batch.
pub fn runs_of<G: AsRef<[OwnedEvent]>>(groups: &[G]) -> Vec<&str> {
    let mut ids: Vec<&str> = events_of(groups).map(|e| e.run_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Every event of a batch's groups, in order.
fn events_of<G: AsRef<[OwnedEvent]>>(groups: &[G]) -> impl Iterator<Item = &OwnedEvent> {
    groups.iter().flat_map(|g| g.as_ref().iter())
}

/// Takes out the states of runs the batch only repeats events of (other than policy decisions
/// alone, below), and returns them: a repeat
/// writes nothing, so with nothing new for the run no conditional head write would catch a
/// state another writer moved past, and the repeat's answer (a request's acknowledgement
/// included) must be decided on the stored head ([`still_current`] tells whether memory is
/// that head). A run with something new in the batch stays: its head write is conditional on
/// the state the repeats were answered from, so a state moved past fails the whole
/// transaction, answers included.
///
/// A run the batch only repeats policy decisions of stays too: a decision is a fact whoever
/// repeats it (the policy records each one itself unless an executor did first), memory holds
/// only events that committed, and an event never changes, so the answer — this decision, at
/// this seq — is the stored one whatever else was appended since; no acknowledgement or other
/// authority rides on it. Under load the policy's own records often meet the executor's
/// append of the same decision in one lane; each such repeat would otherwise send its whole
/// batch the way that reads heads under their row lock and writes every run's head by itself.
/// A state left behind so (another replica appended) is put back as it was, its `stored_seq`
/// still the old head's: the run's next new event finds its head moved, and that batch is
/// decided again on stored heads — the cost of a stale memory moves to that batch, and only
/// where replicas share a database.
pub fn take_repeats<G: AsRef<[OwnedEvent]>>(
    states: &mut HashMap<String, RunState>,
    groups: &[G],
) -> HashMap<String, RunState> {
    let known = |e: &OwnedEvent| states.get(&e.run_id).map(|s| s.events.contains_key(&e.idempotency_key));
    let repeated: HashSet<&str> =
        events_of(groups).filter(|e| known(e) == Some(true)).map(|e| e.run_id.as_str()).collect();
    if repeated.is_empty() {
        // The common case: nothing to look at twice, nothing allocated.
        return HashMap::new();
    }
    // Of the runs with a repeat: whether the batch has something new of it, and whether it
    // repeats anything other than a decision.
    let mut seen: HashMap<&str, (bool, bool)> = HashMap::new();
    for e in events_of(groups).filter(|e| repeated.contains(e.run_id.as_str())) {
        let (new, other) = seen.entry(e.run_id.as_str()).or_default();
        if known(e) == Some(false) {
            *new = true;
        } else if e.event_type != events::POLICY_DECISION {
            *other = true;
        }
    }
    seen.into_iter()
        .filter(|(_, (new, other))| !new && *other)
        .filter_map(|(run, _)| states.remove_entry(run))
        .collect()
}

/// Of the `states` of runs a batch only repeats events of, those whose stored head (`heads`,
/// read under the row lock) is the one memory holds: nothing was appended to them since (the
/// same seq and hash; every change to what a state holds is an event), nor was a writer fenced
/// out or the run ended meanwhile. The others are dropped, to be read whole.
pub fn still_current(states: HashMap<String, RunState>, heads: &HashMap<String, RunHead>) -> HashMap<String, RunState> {
    states
        .into_iter()
        .filter(|(id, st)| {
            heads.get(id).is_some_and(|h| {
                h.last_seq == st.head.last_seq
                    && h.head_hash == st.head.head_hash
                    && h.max_epoch == st.head.max_epoch
                    && h.status == st.head.status
                    && h.tenant == st.head.tenant
            })
        })
        .collect()
}

/// Reads the states of the batch's runs under their row lock: a run short enough is read
/// whole (and can be kept in memory after the commit), a longer one only for the keys and
/// receipts this batch needs.
pub async fn load_states<G: AsRef<[OwnedEvent]>>(
    store: &LedgerStore,
    tx: &mut Tx<'_>,
    groups: &[G],
) -> Result<HashMap<String, RunState>, LedgerError> {
    let mut states = HashMap::new();
    let runs: Vec<String> = runs_of(groups).into_iter().map(str::to_string).collect();
    let heads = lock_heads(store, tx, &runs).await?;
    store.count_runs_read(heads.len());
    let (mut short, mut long): (Vec<RunHead>, Vec<RunHead>) =
        heads.into_values().partition(|h| h.last_seq <= hot::MAX_RUN_EVENTS && !store.hot.is_unkept(&h.run_id));
    // Read whole only what fits in memory: the payloads' size first (a run of few but large
    // events is looked up by key, and marked so its next appends do not ask again).
    if !short.is_empty() {
        let sizes = payload_sizes(tx, &short.iter().map(|h| h.run_id.clone()).collect::<Vec<_>>()).await?;
        let (fits, large): (Vec<RunHead>, Vec<RunHead>) = short
            .into_iter()
            .partition(|h| sizes.get(&h.run_id).copied().unwrap_or(0) <= (hot::MAX_RUN_BYTES / 4) as i64);
        for h in &large {
            store.hot.mark_unkept(&h.run_id);
        }
        short = fits;
        long.extend(large);
    }
    let short_ids: Vec<String> = short.iter().map(|h| h.run_id.clone()).collect();
    for h in short {
        states.insert(h.run_id.clone(), RunState::new(h, true));
    }
    for h in long {
        states.insert(h.run_id.clone(), RunState::new(h, false));
    }
    for chunk in short_ids.chunks(ROWS) {
        let list = placeholders(chunk.len());
        let sql = format!("SELECT {EVENT_COLUMNS} FROM events WHERE run_id IN ({list})");
        for r in bind_ids(sqlx::query(&sql), chunk).fetch_all(&mut **tx).await? {
            let e = event_from_row(&r)?;
            if let Some(st) = states.get_mut(&e.body.run_id) {
                st.remember(e);
            }
        }
        let sql = format!("SELECT run_id, receipt_id FROM receipts WHERE run_id IN ({list})");
        for r in bind_ids(sqlx::query(&sql), chunk).fetch_all(&mut **tx).await? {
            let run: String = r.try_get(0)?;
            if let Some(st) = states.get_mut(&run) {
                st.receipts.insert(r.try_get(1)?);
            }
        }
    }
    // Long runs: the keys and receipts this batch needs, as before runs were kept in memory.
    let mut keys = Vec::new();
    let mut receipt_ids = Vec::new();
    for e in events_of(groups).filter(|e| states.get(&e.run_id).is_some_and(|s| !s.whole)) {
        keys.push((e.run_id.clone(), e.idempotency_key.clone()));
        if let Ok(Some(k)) = checks::cited_decision_key(&e.borrowed()) {
            keys.push((e.run_id.clone(), k));
        }
        receipt_ids.extend(receipt_id(&e.run_id, &e.event_type, &e.step_id, &e.payload));
    }
    for (_, e) in find_events(tx, &keys).await? {
        if let Some(st) = states.get_mut(&e.body.run_id) {
            st.remember(e);
        }
    }
    let taken = existing_receipts(tx, &receipt_ids).await?;
    for e in events_of(groups) {
        if let (Some(id), Some(st)) =
            (receipt_id(&e.run_id, &e.event_type, &e.step_id, &e.payload), states.get_mut(&e.run_id))
            && taken.contains(&id)
        {
            st.receipts.insert(id);
        }
    }
    Ok(states)
}

/// The size of each run's stored payloads, in characters.
async fn payload_sizes(tx: &mut Tx<'_>, run_ids: &[String]) -> Result<HashMap<String, i64>, LedgerError> {
    let mut sizes = HashMap::new();
    for chunk in run_ids.chunks(ROWS) {
        let list = placeholders(chunk.len());
        let sql = format!(
            "SELECT run_id, CAST(COALESCE(SUM(LENGTH(payload_json)), 0) AS BIGINT) FROM events
             WHERE run_id IN ({list}) GROUP BY run_id"
        );
        for r in bind_ids(sqlx::query(&sql), chunk).fetch_all(&mut **tx).await? {
            sizes.insert(r.try_get::<String, _>(0)?, r.try_get::<i64, _>(1)?);
        }
    }
    Ok(sizes)
}

/// What a batch decided, before anything is written.
pub struct Decided {
    /// The answer for each group, in order.
    pub results: Vec<GroupResult>,
    pub events: Vec<Arc<ChainedEvent>>,
    pub receipts: Vec<Receipt>,
    /// The batch's runs as they stand once it is written.
    pub states: HashMap<String, RunState>,
    /// Runs whose head moves.
    pub touched: Vec<String>,
}

/// Decides every group in memory against the runs' states, each group all or nothing: a
/// refused event leaves its whole group out (and the states as they were before the group),
/// and the other groups go on.
pub fn decide_groups<G: AsRef<[OwnedEvent]>>(mut states: HashMap<String, RunState>, groups: &[G]) -> Decided {
    let mut results = Vec::with_capacity(groups.len());
    let (mut new_events, mut new_receipts, mut touched) = (Vec::new(), Vec::new(), Vec::<String>::new());
    for group in groups.iter().map(AsRef::as_ref) {
        // Heads before the group, to put back if one of its events is refused.
        let saved_heads: HashMap<String, RunHead> =
            group.iter().filter_map(|e| states.get(&e.run_id).map(|s| (e.run_id.clone(), s.head.clone()))).collect();
        let (mut added, mut appended, mut refused) = (Vec::new(), Vec::new(), None);
        for e in group {
            match decide(&mut states, e) {
                Ok((event, true, _)) => appended.push((event, true)),
                Ok((event, false, capability_id)) => {
                    let receipt = receipt_for(&event, &capability_id);
                    if let Some(st) = states.get_mut(&e.run_id) {
                        if let Some(r) = &receipt {
                            st.receipts.insert(r.receipt_id.clone());
                        }
                        st.remember(Arc::clone(&event));
                    }
                    added.push((Arc::clone(&event), receipt));
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
                    if let Some(st) = states.get_mut(&event.body.run_id) {
                        st.forget(&event.body.idempotency_key);
                        if let Some(r) = receipt {
                            st.receipts.remove(&r.receipt_id);
                        }
                    }
                }
                for (run, head) in saved_heads {
                    if let Some(st) = states.get_mut(&run) {
                        st.head = head;
                    }
                }
                results.push(Err(err));
            }
        }
    }
    Decided { results, events: new_events, receipts: new_receipts, states, touched }
}

/// Writes what a batch decided inside `tx`.
pub async fn write(store: &LedgerStore, tx: &mut Tx<'_>, d: &Decided) -> Result<(), LedgerError> {
    if store.backend() == Backend::Sqlite && d.fits_one_query() {
        return write_one_query(store, tx, d).await;
    }
    // Heads first: a head another writer moved refuses the batch before anything is written.
    for run in &d.touched {
        if let Some(st) = d.states.get(run) {
            write_head(tx, st, store.prove_head(st)).await?;
        }
    }
    insert_events(tx, &d.events).await?;
    insert_receipts(tx, &d.receipts).await
}

/// The most parameters one whole-batch query may bind (SQLite: 32,766 per statement).
const MAX_STATEMENT_PARAMS: usize = 30_000;

impl Decided {
    /// The states of the runs whose heads the batch moves, in `touched` order.
    fn moved_states(&self) -> Vec<&RunState> {
        self.touched.iter().filter_map(|r| self.states.get(r)).collect()
    }

    fn params(&self) -> usize {
        self.touched.len() * 11 + self.events.len() * 10 + self.receipts.len() * 8
    }

    /// Whether [`write_one_query`] can take the batch (each `INSERT` within [`ROWS`] rows, as
    /// the statement-by-statement path chunks them).
    pub(crate) fn fits_one_query(&self) -> bool {
        self.params() <= MAX_STATEMENT_PARAMS && self.events.len() <= ROWS && self.receipts.len() <= ROWS
    }
}

/// SQLite: the batch's statements — each run's conditional head write, then the events, then
/// the receipts — sent as ONE query inside `tx`. sqlx runs every SQLite statement on the
/// connection's worker thread, a hand-over and a wake-up each way per query; one query for
/// the lot is one hand-over where there were one per head plus two. The statements' anonymous
/// marks take the query's bound values in order, across statements, and each reports
/// its own changes: a head write that changed no row means another writer moved the head,
/// and the transaction is rolled back (dropped) unwritten as with [`write_head`].
async fn write_one_query(store: &LedgerStore, tx: &mut Tx<'_>, d: &Decided) -> Result<(), LedgerError> {
    let heads = d.moved_states();
    let (sql, _) = one_query_sql(&heads, d, false);
    if sql.is_empty() {
        return Ok(());
    }
    let (changes, failed) = run_one_query(store, tx, &sql, &heads, d).await;
    // Each statement reports its changes in order: the heads' are the first `heads.len()`.
    one_query_outcome(&heads, &changes, 0, 1, failed)
}

/// SQLite, a batch decided wholly from memory that [`Decided::fits_one_query`]: the whole
/// transaction — `BEGIN IMMEDIATE`, the statements of [`write_one_query`], `COMMIT` — as ONE
/// query on `conn`, so one hand-over to sqlx's worker thread per commit where `BEGIN`, the
/// statements and `COMMIT` took three (each a wake-up of that thread and one of the caller's).
///
/// Nothing may commit when a head write changed no row (another writer moved the head, or the
/// row is gone), so each head write is followed by a guard statement that fails the query
/// unless the write changed exactly one row: `json()` of text that is not JSON is an error
/// in SQLite, and `changes()` is the row count of the statement just before. A failed
/// statement ends the query before `COMMIT`; the transaction is then rolled back here. The
/// connection is closed instead of given back whenever that cannot be done: the rollback
/// failed, or this future was dropped before the query settled. A query whose answers stop
/// short of `COMMIT`'s without an error counts as failed.
pub async fn write_committed(
    store: &LedgerStore,
    conn: &mut sqlx::pool::PoolConnection<Any>,
    d: &Decided,
) -> Result<(), LedgerError> {
    let heads = d.moved_states();
    let (sql, statements) = one_query_sql(&heads, d, true);
    // sqlx does not know of a transaction begun by a query: should this future be dropped
    // half-way (the connection's worker then stops at its next answer, the transaction
    // open), the connection is closed, never given back to the pool still in it.
    let mut guard = CloseUnlessSettled { conn, settled: false };
    let (changes, failed) = run_one_query(store, guard.conn, &sql, &heads, d).await;
    let (first, stride) = COMMITTED_HEAD_REPORTS;
    let mut outcome = one_query_outcome(&heads, &changes, first, stride, failed);
    // Every statement must have reported, COMMIT last: a query whose answers stopped without
    // an error (its worker gone) committed nothing anyone saw.
    if outcome.is_ok() && changes.len() != statements {
        outcome = Err(LedgerError::Internal(format!(
            "the batch's query answered {} of its {statements} statements",
            changes.len()
        )));
    }
    if outcome.is_err() {
        // Whatever ended the query, no transaction may stay open on the connection. (After a
        // failed COMMIT, SQLite may have rolled back already: "no transaction is active".)
        let active = sqlx::query("ROLLBACK").execute(&mut **guard.conn).await;
        if let Err(e) = active
            && !e.to_string().contains("no transaction is active")
        {
            tracing::warn!(error = %e, "rolling back a failed batch failed; closing its connection");
            return outcome;
        }
    }
    guard.settled = true;
    outcome
}

/// Where [`write_committed`]'s query reports head i's write: at `first + i * stride` (BEGIN
/// reports first; then each head its write and its guard).
const COMMITTED_HEAD_REPORTS: (usize, usize) = (1, 2);

/// Closes its connection when it is dropped unless `settled` (see [`write_committed`]).
struct CloseUnlessSettled<'a> {
    conn: &'a mut sqlx::pool::PoolConnection<Any>,
    settled: bool,
}

impl Drop for CloseUnlessSettled<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.conn.close_on_drop();
        }
    }
}

/// Fails the query unless the statement before it changed exactly one row (see
/// [`write_committed`]).
const EXACTLY_ONE_CHANGE: &str = "SELECT json(CASE changes() WHEN 1 THEN '1' ELSE 'head moved' END)";

/// The text of [`write_one_query`]'s query, or with `committed` of [`write_committed`]'s, and
/// how many statements it holds.
fn one_query_sql(heads: &[&RunState], d: &Decided, committed: bool) -> (String, usize) {
    let (mut sql, mut statements) = (String::new(), 0);
    let mut push = |statement: &str| {
        sql.push_str(statement);
        sql.push_str(";\n");
        statements += 1;
    };
    if committed {
        push("BEGIN IMMEDIATE");
    }
    for _ in heads {
        push(UPDATE_HEAD_ANONYMOUS);
        if committed {
            push(EXACTLY_ONE_CHANGE);
        }
    }
    if !d.events.is_empty() {
        push(&insert_events_with(&anonymous_marks(d.events.len(), 10)));
    }
    if !d.receipts.is_empty() {
        push(&insert_receipts_with(&anonymous_marks(d.receipts.len(), 8)));
    }
    if committed {
        push("COMMIT");
    }
    (sql, statements)
}

/// Runs a one-query batch on `conn`: each statement's changes, in order, up to the first that
/// failed, and that failure.
async fn run_one_query(
    store: &LedgerStore,
    conn: &mut sqlx::AnyConnection,
    sql: &str,
    heads: &[&RunState],
    d: &Decided,
) -> (Vec<u64>, Option<sqlx::Error>) {
    use futures::TryStreamExt as _;
    // The text depends on how many runs, events and receipts the batch holds. A chain's
    // few shapes stay prepared; the many of a busy batch would only push them out of the
    // connection's statement cache, so those are prepared for the one use.
    let usual = heads.len() <= 2 && d.events.len() <= 8 && d.receipts.len() <= 2;
    let mut q = sqlx::query(sql).persistent(usual);
    for st in heads {
        q = bind_head_then_run(q, st, store.prove_head(st));
    }
    q = bind_events(q, &d.events);
    for r in &d.receipts {
        q = bind_receipt(q, r);
    }
    let mut changes = Vec::with_capacity(2 * heads.len() + 4);
    let mut failed = None;
    // sqlx 0.8 deprecates several statements in one query (only its SQLite driver takes
    // them), pointing at `raw_sql`, which binds nothing; until a successor binds, this is the
    // one way to one hand-over. Should it go, `fits_one_query` false is the old path.
    #[allow(deprecated)]
    let mut steps = q.fetch_many(conn);
    loop {
        match steps.try_next().await {
            Ok(Some(step)) => changes.extend(step.left().map(|done| done.rows_affected())),
            Ok(None) => break,
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    (changes, failed)
}

/// What a one-query batch came to, from its statements' `changes` (the i-th head's write
/// reported at `first + i * stride`) and the failure that ended it, if any. A head that
/// changed nothing is the answer even when a later statement failed: its guard, or that
/// run's first new event meeting the one the other writer stored at its seq.
fn one_query_outcome(
    heads: &[&RunState],
    changes: &[u64],
    first: usize,
    stride: usize,
    failed: Option<sqlx::Error>,
) -> Result<(), LedgerError> {
    let head_changes = |i: usize| changes.get(first + i * stride).copied();
    if let Some(st) = heads.iter().enumerate().find_map(|(i, st)| head_changes(i).is_some_and(|n| n != 1).then_some(st))
    {
        return Err(moved(&st.head.run_id));
    }
    if let Some(e) = failed {
        return Err(e.into());
    }
    if (0..heads.len()).any(|i| head_changes(i).is_none()) {
        return Err(LedgerError::Internal("a head write went unreported".into()));
    }
    Ok(())
}

/// PostgreSQL, all runs' states in memory: the whole batch in ONE statement, committed on its
/// own (no BEGIN, no COMMIT round trips). Data-modifying CTEs: `l` locks, in run id order (no
/// deadlock with `lock_heads` or another replica), the heads whose stored `last_seq` is still
/// the one the batch was decided against; only if every head is there are they updated (`u`),
/// and only if every head was updated are the events and receipts inserted. So a head another
/// writer moved writes nothing at all, for any run of the batch (`Moved`). Unique keys on
/// `(run_id, seq)`, `(run_id, idempotency_key)` and `receipt_id` still hold: a violation fails
/// the statement whole. A batch that moves one run's head is written by
/// [`ONE_RUN_STATEMENT`] instead: its update locks the one row itself, so it needs neither `l`
/// nor the count.
///
/// The rows travel as three JSON arrays (`json_to_recordset`), not as one mark per value: the
/// statement's text is then the same for every batch, so each connection prepares it (and
/// PostgreSQL parses it) once. With a mark per value its text differed with every batch's
/// count of runs, events and receipts: a busy batch's many shapes missed the connection's
/// statement cache, and each paid a preparing round trip and PostgreSQL's parsing and
/// planning of thousands of marks.
pub async fn write_one_statement(store: &LedgerStore, d: &Decided) -> Result<(), LedgerError> {
    if d.touched.is_empty() {
        return Ok(());
    }
    let states = d.moved_states();
    if states.len() != d.touched.len() {
        // Every run a batch moves was decided on a state it holds; a head missing here would
        // have the statements write events for a head they do not move.
        return Err(LedgerError::Internal(format!(
            "a batch moves {} runs' heads and holds the state of {}",
            d.touched.len(),
            states.len()
        )));
    }
    let events: Vec<EventRow<'_>> = d.events.iter().map(|e| EventRow::of(e)).collect();
    let receipts: Vec<ReceiptRow<'_>> = d.receipts.iter().map(ReceiptRow::of).collect();
    let (events, receipts) = (rows_json(&events)?, rows_json(&receipts)?);
    let q = match states.as_slice() {
        [st] => {
            bind_head_then_run(sqlx::query(ONE_RUN_STATEMENT), st, store.prove_head(st)).bind(events).bind(receipts)
        }
        _ => {
            let heads: Vec<HeadRow<'_>> = states.iter().map(|st| HeadRow::of(st, store.prove_head(st))).collect();
            sqlx::query(ONE_STATEMENT).bind(rows_json(&heads)?).bind(events).bind(receipts).bind(heads.len() as i64)
        }
    };
    let mut conn = store.write_conn().await?;
    let whole: bool = q.fetch_one(&mut *conn).await?.try_get(0)?;
    store.keep(conn);
    if !whole {
        return Err(moved(&d.touched.join(", ")));
    }
    Ok(())
}

/// Rows as one JSON array for `json_to_recordset`.
fn rows_json<T: serde::Serialize>(rows: &[T]) -> Result<String, LedgerError> {
    serde_json::to_string(rows).map_err(|e| LedgerError::Internal(format!("a batch's rows as JSON: {e}")))
}

/// [`write_one_statement`]'s statement: `$1` the heads, `$2` the events, `$3` the receipts (JSON
/// arrays of objects named as the columns), `$4` how many heads.
const ONE_STATEMENT: &str = "\
WITH h AS (SELECT * FROM json_to_recordset($1::json) AS x (run_id text, prev_seq bigint, last_seq bigint, \
             head_hash text, max_epoch bigint, status text, reason text, updated_at_ms bigint, head_signature text, \
             head_key_id text, head_proof text)),
     l AS (SELECT r.run_id FROM runs AS r JOIN h ON r.run_id = h.run_id AND r.last_seq = h.prev_seq
           ORDER BY r.run_id FOR UPDATE OF r),
     ok AS (SELECT count(*) = $4::bigint AS whole FROM l),
     u AS (UPDATE runs AS r SET last_seq = h.last_seq, head_hash = h.head_hash, max_epoch = h.max_epoch,
             status = h.status, reason = h.reason, updated_at_ms = h.updated_at_ms,
             head_signature = h.head_signature, head_key_id = h.head_key_id, head_proof = h.head_proof
           FROM h WHERE r.run_id = h.run_id AND r.last_seq = h.prev_seq AND (SELECT whole FROM ok)
           RETURNING r.run_id),
     e AS (INSERT INTO events (run_id, seq, event_type, payload_json, step_id, epoch, idempotency_key, timestamp_ms, \
             prev_hash, hash)
           SELECT x.* FROM json_to_recordset($2::json) AS x (run_id text, seq bigint, event_type text, \
             payload_json text, step_id text, epoch bigint, idempotency_key text, timestamp_ms bigint, prev_hash text, \
             hash text)
           WHERE (SELECT count(*) FROM u) = $4::bigint),
     rc AS (INSERT INTO receipts (receipt_id, run_id, step_id, attempt, seq, body_json, status, hash)
           SELECT x.* FROM json_to_recordset($3::json) AS x (receipt_id text, run_id text, step_id text, \
             attempt bigint, seq bigint, body_json text, status text, hash text)
           WHERE (SELECT count(*) FROM u) = $4::bigint)
SELECT count(*) = $4::bigint FROM u";

/// [`ONE_STATEMENT`] for a batch that moves one run's head — a chain's every append, and most
/// appends but under load: the head is updated on condition of the stored `last_seq`
/// (`$11`), and the events (`$12`) and receipts (`$13`, JSON arrays as above) are written
/// only if it was. One row is locked, by the update itself, so there is no order to keep and
/// no separate lock: the general statement locks its rows first (`FOR UPDATE`, in key order,
/// so that two batches never wait on each other's rows) and then updates them, which on
/// PostgreSQL writes each row's lock to the WAL as well as its new version. For one run that
/// was about a third of the statement's execution time (EXPLAIN ANALYZE, three events and a
/// receipt: 0.32 → 0.23 ms median on a 2 vCPU machine).
const ONE_RUN_STATEMENT: &str = "\
WITH u AS (UPDATE runs SET last_seq = $1, head_hash = $2, max_epoch = $3, status = $4, reason = $5, \
             updated_at_ms = $6, head_signature = $7, head_key_id = $8, head_proof = $9
           WHERE run_id = $10 AND last_seq = $11
           RETURNING run_id),
     e AS (INSERT INTO events (run_id, seq, event_type, payload_json, step_id, epoch, idempotency_key, timestamp_ms, \
             prev_hash, hash)
           SELECT x.* FROM json_to_recordset($12::json) AS x (run_id text, seq bigint, event_type text, \
             payload_json text, step_id text, epoch bigint, idempotency_key text, timestamp_ms bigint, prev_hash text, \
             hash text)
           WHERE EXISTS (SELECT FROM u)),
     rc AS (INSERT INTO receipts (receipt_id, run_id, step_id, attempt, seq, body_json, status, hash)
           SELECT x.* FROM json_to_recordset($13::json) AS x (receipt_id text, run_id text, step_id text, \
             attempt bigint, seq bigint, body_json text, status text, hash text)
           WHERE EXISTS (SELECT FROM u))
SELECT count(*) = 1 FROM u";

/// A `runs` head as [`ONE_STATEMENT`] reads it.
#[derive(serde::Serialize)]
struct HeadRow<'a> {
    run_id: &'a str,
    prev_seq: i64,
    last_seq: i64,
    head_hash: &'a str,
    max_epoch: i64,
    status: &'a str,
    reason: &'a str,
    updated_at_ms: i64,
    head_signature: String,
    head_key_id: String,
    head_proof: &'static str,
}

impl<'a> HeadRow<'a> {
    fn of(st: &'a RunState, proof: HeadProof) -> Self {
        let h = &st.head;
        HeadRow {
            run_id: &h.run_id,
            prev_seq: st.stored_seq as i64,
            last_seq: h.last_seq as i64,
            head_hash: &h.head_hash,
            max_epoch: h.max_epoch as i64,
            status: &h.status,
            reason: &h.reason,
            updated_at_ms: h.updated_at_ms,
            head_signature: proof.signature,
            head_key_id: proof.key_id,
            head_proof: proof.kind,
        }
    }
}

/// An `events` row as [`ONE_STATEMENT`] reads it.
#[derive(serde::Serialize)]
struct EventRow<'a> {
    run_id: &'a str,
    seq: i64,
    event_type: &'a str,
    payload_json: String,
    step_id: &'a str,
    epoch: i64,
    idempotency_key: &'a str,
    timestamp_ms: i64,
    prev_hash: &'a str,
    hash: &'a str,
}

impl<'a> EventRow<'a> {
    fn of(e: &'a ChainedEvent) -> Self {
        EventRow {
            run_id: &e.body.run_id,
            seq: e.body.seq as i64,
            event_type: &e.body.event_type,
            payload_json: warden_core::canonical::canonical_value(&e.body.payload),
            step_id: &e.body.step_id,
            epoch: e.body.epoch as i64,
            idempotency_key: &e.body.idempotency_key,
            timestamp_ms: e.body.timestamp_ms,
            prev_hash: &e.prev_hash,
            hash: &e.hash,
        }
    }
}

/// A `receipts` row as [`ONE_STATEMENT`] reads it.
#[derive(serde::Serialize)]
struct ReceiptRow<'a> {
    receipt_id: &'a str,
    run_id: &'a str,
    step_id: &'a str,
    attempt: i64,
    seq: i64,
    body_json: String,
    status: &'a str,
    hash: &'a str,
}

impl<'a> ReceiptRow<'a> {
    fn of(r: &'a Receipt) -> Self {
        ReceiptRow {
            receipt_id: &r.receipt_id,
            run_id: &r.run_id,
            step_id: &r.step_id,
            attempt: r.attempt as i64,
            seq: r.seq as i64,
            body_json: warden_core::canonical_json(r),
            status: &r.status,
            hash: &r.hash,
        }
    }
}

/// One event against its run's state: the existing event of its key (a retry), or the new
/// event chained onto the run's head (advanced), with the capability of the allow it cites.
fn decide(
    states: &mut HashMap<String, RunState>,
    e: &OwnedEvent,
) -> Result<(Arc<ChainedEvent>, bool, String), LedgerError> {
    let new = e.borrowed();
    let st = states.get_mut(&e.run_id).ok_or_else(|| LedgerError::NotFound(format!("run '{}'", e.run_id)))?;
    checks::check_tenant(&st.head, &new)?;
    if let Some(existing) = st.events.get(&e.idempotency_key) {
        checks::check_duplicate(existing, &new)?;
        checks::check_stale_repeat(&st.head, &new)?;
        return Ok((Arc::clone(existing), true, String::new()));
    }
    checks::check_writable(&st.head, &new)?;
    let capability_id = match checks::cited_decision_key(&new)? {
        Some(k) => checks::check_allow(st.events.get(&k).map(|e| &**e), &new)?,
        None => String::new(),
    };
    if let Some(id) = receipt_id(&e.run_id, &e.event_type, &e.step_id, &e.payload)
        && st.receipts.contains(&id)
    {
        return Err(LedgerError::Precondition(format!(
            "step '{}' already has an outcome for this attempt (receipt {id})",
            e.step_id
        )));
    }
    let event = Arc::new(link(
        EventBody {
            run_id: e.run_id.clone(),
            seq: st.head.last_seq + 1,
            event_type: e.event_type.clone(),
            payload: new.payload,
            step_id: e.step_id.clone(),
            epoch: e.epoch,
            idempotency_key: e.idempotency_key.clone(),
            timestamp_ms: e.now_ms,
        },
        &st.head.head_hash,
    ));
    st.head.advance(&event);
    Ok((event, false, capability_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(run_id: &str) -> RunState {
        RunState::new(
            RunHead {
                run_id: run_id.into(),
                tenant: "t".into(),
                status: "running".into(),
                reason: String::new(),
                last_seq: 3,
                head_hash: String::new(),
                max_epoch: 1,
                updated_at_ms: 0,
            },
            false,
        )
    }

    /// Which head a one-query batch's answers say moved: in [`write_committed`]'s query head
    /// i reports at 1 + 2i (after BEGIN, and each earlier head's write and guard).
    #[test]
    fn a_committed_batch_names_the_head_that_moved() {
        let (a, b) = (state("a"), state("b"));
        let heads = [&a, &b];
        let failed = || Some(sqlx::Error::Protocol("malformed JSON".into()));
        // The query's statements, in order: head i's write where its answer is looked for.
        let d = Decided {
            results: Vec::new(),
            events: Vec::new(),
            receipts: Vec::new(),
            states: HashMap::new(),
            touched: Vec::new(),
        };
        let (sql, statements) = one_query_sql(&heads, &d, true);
        assert_eq!(statements, 6, "BEGIN, two writes and their guards, COMMIT: {sql}");
        let writes: Vec<usize> = (sql.split(";\n").enumerate())
            .filter_map(|(n, statement)| statement.trim_start().starts_with("UPDATE runs").then_some(n))
            .collect();
        let (first, stride) = COMMITTED_HEAD_REPORTS;
        assert_eq!(writes, [first, first + stride], "{sql}");
        // BEGIN, a's write (1 row), a's guard, b's write (0 rows); b's guard failed.
        let moved = one_query_outcome(&heads, &[0, 1, 1, 0], first, stride, failed());
        assert!(matches!(&moved, Err(LedgerError::Moved(m)) if m.contains("'b'")), "{moved:?}");
        // Stopped before b's write reported: the failure itself, not a moved head.
        let broken = one_query_outcome(&heads, &[0, 1, 1], 1, 2, failed());
        assert!(matches!(&broken, Err(e) if !matches!(e, LedgerError::Moved(_))), "{broken:?}");
        // Every head wrote its row.
        assert!(one_query_outcome(&heads, &[0, 1, 1, 1, 1, 3, 1, 0], first, stride, None).is_ok());
        // The form without BEGIN and guards: head i at i.
        let moved = one_query_outcome(&heads, &[1, 0], 0, 1, failed());
        assert!(matches!(&moved, Err(LedgerError::Moved(m)) if m.contains("'b'")), "{moved:?}");
    }
}
