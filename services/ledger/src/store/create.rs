//! A run's creation. A submission is first prepared in memory: its `run_submitted` (and
//! `run_started`), its first step decided against the run as it will be recorded, its head
//! signed. Then it is written, either on its own or together with the other submissions of
//! the moment. Together means one statement on PostgreSQL and one transaction on SQLite:
//! one commit for all of them, all or nothing. `crate::admit` queues submissions and decides
//! which ones go together.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use sqlx::Row as _;

use serde_json::Value;
use warden_core::chain::{ChainedEvent, EventBody, GENESIS_HASH, link};
use warden_core::events::{self, RunStatus};

use super::batch::{self, Query};
use super::{
    Backend, CreatedRun, FIRST_EVENT_TYPES, LedgerStore, NewRun, RUN_COLUMNS, RunRow, checks, hot, is_unique_violation,
};
use crate::error::LedgerError;

/// The `runs` columns a creation writes, in the order [`bind_run`] binds them.
const INSERT_RUN: &str = "INSERT INTO runs (run_id, tenant, status, reason, plan_json, goal, cancel_policy, submit_key, last_seq, head_hash, max_epoch,
                               created_at_ms, updated_at_ms, head_signature, head_key_id) VALUES";
const RUN_VALUES: usize = 15;
const EVENT_VALUES: usize = 10;

/// A submission ready to be written (see [`LedgerStore::prepare_run`]).
pub struct PreparedRun {
    run: RunRow,
    submit_key: Option<String>,
    /// `run_submitted`, `run_started` when the run was submitted leased, and its first step.
    chain: Vec<Arc<ChainedEvent>>,
    /// The run as memory holds it once written.
    state: hot::RunState,
    /// The first step's events as they will be recorded, or why they were refused.
    first: Result<Vec<Arc<ChainedEvent>>, LedgerError>,
    /// A child frame: the root run id it counts against (if it names one) and that root's
    /// limit. A frame is written on its own, in a transaction with its count.
    frame: Option<(Option<String>, u64)>,
}

impl PreparedRun {
    pub fn run_id(&self) -> &str {
        &self.run.run_id
    }

    pub fn is_frame(&self) -> bool {
        self.frame.is_some()
    }

    /// How many values writing it binds (PostgreSQL takes at most 65,535 in a statement).
    pub fn binds(&self) -> usize {
        RUN_VALUES + EVENT_VALUES * self.chain.len()
    }
}

impl LedgerStore {
    /// Prepares a submission in memory (no database access): its chain, its first step decided
    /// against the run as it will be recorded, its head signed.
    pub fn prepare_run(&self, new: NewRun<'_>) -> PreparedRun {
        let mut payload = events::submitted_payload(new.tenant, new.cancel_policy, new.plan, new.goal, new.agent);
        events::add_goal_fields(&mut payload, new.replay_policy, new.parent_run_id);
        let frame = new.frame.as_ref().map(|f| {
            let root = f.get("root_run_id").and_then(Value::as_str).map(str::to_string);
            (root, new.max_frames)
        });
        if let Some(frame) = &new.frame {
            payload["frame"] = frame.clone();
        }
        let submitted = link(
            EventBody {
                run_id: new.run_id.to_string(),
                seq: 1,
                event_type: events::RUN_SUBMITTED.to_string(),
                payload,
                step_id: String::new(),
                epoch: 0,
                idempotency_key: events::RUN_SUBMITTED.to_string(),
                timestamp_ms: new.now_ms,
            },
            GENESIS_HASH,
        );
        let mut chain = vec![Arc::new(submitted)];
        if let Some((executor, epoch)) = new.started_by {
            let started = link(
                EventBody {
                    run_id: new.run_id.to_string(),
                    seq: 2,
                    event_type: events::RUN_STARTED.to_string(),
                    payload: events::started_payload(executor, epoch),
                    step_id: String::new(),
                    epoch,
                    idempotency_key: format!("run_started:{epoch}"),
                    timestamp_ms: new.now_ms,
                },
                &chain[0].hash,
            );
            chain.push(Arc::new(started));
        }
        let status = if chain.len() == 2 { RunStatus::Active } else { RunStatus::Pending };
        let head = &chain[chain.len() - 1];
        let mut state = hot::RunState::new(
            checks::RunHead {
                run_id: new.run_id.to_string(),
                tenant: new.tenant.to_string(),
                status: status.as_str().to_string(),
                reason: String::new(),
                last_seq: head.body.seq,
                head_hash: head.hash.clone(),
                max_epoch: new.started_by.map(|(_, e)| e).unwrap_or(0),
                updated_at_ms: new.now_ms,
            },
            true,
        );
        for e in &chain {
            state.remember(Arc::clone(e));
        }
        // The first step's events, decided in memory against the run as it will be recorded
        // (as an append to it would be), then written with it: one commit for both.
        let mut first = Ok(Vec::new());
        if new.first.iter().any(|e| !FIRST_EVENT_TYPES.contains(&e.event_type.as_str())) {
            first = Err(LedgerError::Precondition("a run's first events are pins, decisions and requests only".into()));
        } else if !new.first.is_empty() {
            let run_id = new.run_id.to_string();
            let mut decided = batch::decide_groups(HashMap::from([(run_id.clone(), state.clone())]), &[new.first]);
            first = match (decided.results.pop(), decided.states.remove(&run_id)) {
                (Some(Ok(_)), Some(decided_state)) => {
                    state = decided_state;
                    chain.extend(decided.events.iter().cloned());
                    Ok(decided.events)
                }
                (Some(Err(e)), _) => Err(e),
                _ => Err(LedgerError::Internal("the first events were not decided".into())),
            };
        }
        let (last_seq, head_hash, max_epoch) =
            (state.head.last_seq, state.head.head_hash.clone(), state.head.max_epoch);
        let (head_signature, head_key_id) = self.sign_head(new.run_id, last_seq, &head_hash);
        PreparedRun {
            run: RunRow {
                run_id: new.run_id.to_string(),
                tenant: new.tenant.to_string(),
                status,
                reason: String::new(),
                plan_json: new.plan.map(warden_core::canonical_json).unwrap_or_default(),
                goal: new.goal.to_string(),
                cancel_policy: new.cancel_policy,
                last_seq,
                head_hash,
                max_epoch,
                created_at_ms: new.now_ms,
                updated_at_ms: new.now_ms,
                head_signature,
                head_key_id,
                head_proof: super::PROOF_HEAD.to_string(),
            },
            submit_key: (!new.idempotency_key.is_empty()).then(|| new.idempotency_key.to_string()),
            chain,
            state,
            first,
            frame,
        }
    }

    /// Creates a run with its first events, or returns the run an earlier submission with
    /// the same `(tenant, idempotency_key)` created (deduplicated).
    pub async fn create_run(&self, new: NewRun<'_>) -> Result<CreatedRun, LedgerError> {
        let prepared = self.prepare_run(new);
        self.write_run(prepared).await
    }

    /// Writes prepared submissions, answering each in order. Root runs are written together,
    /// in one commit:
    /// - Keys already on record are looked up first, in one read. A submission naming one is
    ///   answered with the earlier run (deduplicated), and a key named twice in the batch is
    ///   written once, its repeat after it.
    /// - If the write is refused as a whole, nothing is written. That happens when a key or run
    ///   id is taken meanwhile, or on a deadlock with another write of the same keys. Each run
    ///   is then written on its own.
    /// - Any other failure answers every run of the write with it.
    pub async fn create_runs(&self, runs: Vec<PreparedRun>) -> Vec<Result<CreatedRun, LedgerError>> {
        if runs.len() < 2 || runs.iter().any(PreparedRun::is_frame) {
            return self.write_each(runs).await;
        }
        let keys: Vec<(&str, &str)> =
            runs.iter().filter_map(|p| Some((p.run.tenant.as_str(), p.submit_key.as_deref()?))).collect();
        let recorded = match self.runs_by_submit_keys(&keys).await {
            Ok(recorded) => recorded,
            Err(e) => return runs.iter().map(|_| Err(e.clone_for_batch())).collect(),
        };
        let mut answers: Vec<Option<Result<CreatedRun, LedgerError>>> = runs.iter().map(|_| None).collect();
        let (mut together, mut after) = (Vec::new(), Vec::new());
        let mut named = HashSet::new();
        for (i, p) in runs.into_iter().enumerate() {
            let key = p.submit_key.as_ref().map(|k| (p.run.tenant.clone(), k.clone()));
            if let Some(run) = key.as_ref().and_then(|k| recorded.get(k)) {
                answers[i] = Some(Ok(CreatedRun { run: run.clone(), deduplicated: true, first: Ok(Vec::new()) }));
            } else if key.is_some_and(|k| !named.insert(k)) {
                after.push((i, p));
            } else {
                together.push((i, p));
            }
        }
        let (places, together): (Vec<usize>, Vec<PreparedRun>) = together.into_iter().unzip();
        let written = match together.len() {
            0 => Vec::new(),
            1 => self.write_each(together).await,
            _ => match self.write_together(&together).await {
                Ok(()) => together.into_iter().map(|p| Ok(self.created(p))).collect(),
                Err(e) if is_unique_violation(&e) || is_conflict(&e) => self.write_each(together).await,
                Err(e) => {
                    let e = LedgerError::from(e);
                    together.iter().map(|_| Err(e.clone_for_batch())).collect()
                }
            },
        };
        for (i, answer) in places.into_iter().zip(written) {
            answers[i] = Some(answer);
        }
        for (i, p) in after {
            answers[i] = Some(self.write_run(p).await);
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(LedgerError::Internal("a submission was not answered".into()))))
            .collect()
    }

    /// Writes each submission on its own, in order.
    async fn write_each(&self, runs: Vec<PreparedRun>) -> Vec<Result<CreatedRun, LedgerError>> {
        let mut answers = Vec::with_capacity(runs.len());
        for run in runs {
            answers.push(self.write_run(run).await);
        }
        answers
    }

    /// The written run, now held in memory.
    fn created(&self, p: PreparedRun) -> CreatedRun {
        self.hot.put_new(p.state);
        CreatedRun { run: p.run, deduplicated: false, first: p.first }
    }

    /// Writes one submission, or answers with the run an earlier one with its key created.
    async fn write_run(&self, p: PreparedRun) -> Result<CreatedRun, LedgerError> {
        let earlier = |run| CreatedRun { run, deduplicated: true, first: Ok(Vec::new()) };
        if let Some(key) = &p.submit_key
            && let Some(run) = self.run_by_submit_key(&p.run.tenant, key).await?
        {
            return Ok(earlier(run));
        }
        // A concurrent submission with the same key won the race: its run is the answer.
        let raced = async |e: sqlx::Error| -> Result<CreatedRun, LedgerError> {
            if let (Some(key), true) = (&p.submit_key, is_unique_violation(&e))
                && let Some(run) = self.run_by_submit_key(&p.run.tenant, key).await?
            {
                return Ok(earlier(run));
            }
            Err(e.into())
        };
        let Some((root, max_frames)) = &p.frame else {
            if let Err(e) = self.write_together(std::slice::from_ref(&p)).await {
                return raced(e).await;
            }
            return Ok(self.created(p));
        };
        // A child frame also counts against its root's limit: a transaction.
        let mut tx = self.pool.begin().await?;
        let sql = format!("{INSERT_RUN} {}", batch::marks(1, RUN_VALUES, 0));
        if let Err(e) = bind_run(sqlx::query(&sql), &p).execute(&mut *tx).await {
            drop(tx);
            return raced(e).await;
        }
        if let Some(root) = root {
            let counted = sqlx::query(
                "INSERT INTO frame_counts (root_run_id, opened) VALUES ($1, 1)
                 ON CONFLICT (root_run_id) DO UPDATE SET opened = frame_counts.opened + 1
                 WHERE frame_counts.opened < $2",
            )
            .bind(root)
            .bind((*max_frames).min(i64::MAX as u64) as i64)
            .execute(&mut *tx)
            .await?;
            if counted.rows_affected() == 0 || *max_frames == 0 {
                drop(tx);
                return Err(LedgerError::Precondition(format!(
                    "run tree '{root}' opened its {max_frames} child frames (ledger.max_frames_per_root): no more"
                )));
            }
        }
        batch::insert_events(&mut tx, &p.chain).await?;
        tx.commit().await?;
        Ok(self.created(p))
    }

    /// Writes root runs and their events in one commit, all or nothing. On PostgreSQL this is
    /// a single statement: the run rows and the events as one data-modifying CTE. On SQLite it
    /// is one transaction.
    async fn write_together(&self, runs: &[PreparedRun]) -> Result<(), sqlx::Error> {
        if self.backend == Backend::Postgres {
            let insert_runs = format!("{INSERT_RUN} {}", batch::marks(runs.len(), RUN_VALUES, 0));
            let events = runs.iter().map(|p| p.chain.len()).sum();
            let sql = format!(
                "WITH r AS ({insert_runs} RETURNING run_id) {}",
                batch::insert_events_sql(events, RUN_VALUES * runs.len())
            );
            let mut q = sqlx::query(&sql);
            for p in runs {
                q = bind_run(q, p);
            }
            for p in runs {
                q = batch::bind_events(q, &p.chain);
            }
            q.execute(&self.pool).await?;
            return Ok(());
        }
        let insert_runs = format!("{INSERT_RUN} {}", batch::anonymous_marks(runs.len(), RUN_VALUES));
        let mut tx = self.pool.begin().await?;
        let mut q = sqlx::query(&insert_runs);
        for p in runs {
            q = bind_run(q, p);
        }
        q.execute(&mut *tx).await?;
        let chain: Vec<&ChainedEvent> = runs.iter().flat_map(|p| p.chain.iter().map(|e| &**e)).collect();
        batch::insert_events(&mut tx, &chain).await?;
        tx.commit().await
    }

    /// The runs recorded under these `(tenant, key)` pairs, in one read.
    async fn runs_by_submit_keys(
        &self,
        keys: &[(&str, &str)],
    ) -> Result<HashMap<(String, String), RunRow>, LedgerError> {
        if keys.is_empty() {
            return Ok(HashMap::new());
        }
        let sql = format!(
            "SELECT {RUN_COLUMNS}, submit_key FROM runs WHERE (tenant, submit_key) IN (VALUES {})",
            batch::marks(keys.len(), 2, 0)
        );
        let mut q = sqlx::query(&sql);
        for (tenant, key) in keys {
            q = q.bind(*tenant).bind(*key);
        }
        let rows = q.fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                let run = super::run_from_row(r)?;
                let key: String = r.try_get("submit_key")?;
                Ok(((run.tenant.clone(), key), run))
            })
            .collect()
    }

    pub(super) async fn run_by_submit_key(&self, tenant: &str, key: &str) -> Result<Option<RunRow>, LedgerError> {
        let sql = format!("SELECT {RUN_COLUMNS} FROM runs WHERE tenant = $1 AND submit_key = $2");
        let row = sqlx::query(&sql).bind(tenant).bind(key).fetch_optional(&self.pool).await?;
        row.as_ref().map(super::run_from_row).transpose()
    }
}

/// `q` with a run row's fifteen values bound, in [`INSERT_RUN`]'s order.
/// A deadlock or serialization failure: the statement was rolled back, nothing written.
fn is_conflict(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("40P01" | "40001")))
}

fn bind_run<'q>(q: Query<'q>, p: &'q PreparedRun) -> Query<'q> {
    let r = &p.run;
    q.bind(r.run_id.as_str())
        .bind(r.tenant.as_str())
        .bind(r.status.as_str())
        .bind(r.reason.as_str())
        .bind(r.plan_json.as_str())
        .bind(r.goal.as_str())
        .bind(r.cancel_policy as i64)
        .bind(p.submit_key.as_deref())
        .bind(r.last_seq as i64)
        .bind(r.head_hash.as_str())
        .bind(r.max_epoch as i64)
        .bind(r.created_at_ms)
        .bind(r.updated_at_ms)
        .bind(r.head_signature.as_str())
        .bind(r.head_key_id.as_str())
}

#[cfg(test)]
mod tests {
    use ed25519_dalek::SigningKey;
    use serde_json::json;

    use super::*;
    use crate::store::{test_run as new_run, test_sqlite as sqlite};

    async fn postgres() -> LedgerStore {
        let url = warden_testkit::postgres().create_database().await.expect("database");
        LedgerStore::connect(&url, 4, SigningKey::from_bytes(&[7; 32])).await.expect("store")
    }

    /// What a run's log holds: its chain verifies, and the stored head is its last event.
    async fn whole(store: &LedgerStore, run_id: &str) -> Vec<String> {
        let events = store.events(run_id, 0, 100).await.expect("events");
        warden_core::chain::verify_chain(&events).expect("the chain verifies");
        let run = store.get_run(run_id).await.expect("read").expect("the run exists");
        let last = events.last().expect("an event");
        assert_eq!((run.last_seq, &run.head_hash), (last.body.seq, &last.hash), "the head is the last event");
        events.into_iter().map(|e| e.body.event_type).collect()
    }

    /// Each answer as (run id, deduplicated), or the refusal.
    fn answered(answers: Vec<Result<CreatedRun, LedgerError>>) -> Vec<Result<(String, bool), String>> {
        answers.into_iter().map(|r| r.map(|c| (c.run.run_id, c.deduplicated)).map_err(|e| e.to_string())).collect()
    }

    fn made(run_id: &str, deduplicated: bool) -> Result<(String, bool), String> {
        Ok((run_id.to_string(), deduplicated))
    }

    async fn runs_written_together_are_each_whole(store: LedgerStore) {
        let plan = json!({ "steps": [] });
        // Runs of different lengths in one write: a submitted without a lease (no run_started).
        let unleased = NewRun { started_by: None, ..new_run("a", "", &plan) };
        let first = vec![
            store.prepare_run(unleased),
            store.prepare_run(new_run("b", "kb", &plan)),
            store.prepare_run(new_run("c", "", &plan)),
        ];
        assert_eq!(answered(store.create_runs(first).await), [made("a", false), made("b", false), made("c", false)]);
        assert_eq!(whole(&store, "a").await, ["run_submitted"]);
        for run in ["b", "c"] {
            assert_eq!(whole(&store, run).await, ["run_submitted", "run_started"], "{run}");
        }

        // b2 repeats b's key, on record: answered with b. e2 repeats e's key in the same write:
        // e is written, then e2 answered with it. Neither repeat writes or keeps anything.
        let second = vec![
            store.prepare_run(new_run("d", "", &plan)),
            store.prepare_run(new_run("b2", "kb", &plan)),
            store.prepare_run(new_run("e", "ke", &plan)),
            store.prepare_run(new_run("e2", "ke", &plan)),
            store.prepare_run(new_run("f", "", &plan)),
        ];
        let expected = [made("d", false), made("b", true), made("e", false), made("e", true), made("f", false)];
        assert_eq!(answered(store.create_runs(second).await), expected);
        for run in ["b2", "e2"] {
            assert!(store.get_run(run).await.expect("read").is_none(), "{run} wrote no run");
            assert!(store.hot.take_present(&[run]).is_empty(), "{run} is not held in memory");
        }
        for run in ["d", "e", "f"] {
            assert_eq!(whole(&store, run).await, ["run_submitted", "run_started"], "{run}");
        }

        // A run id already taken refuses the whole write, which writes nothing: each run is then
        // written on its own, and only the one naming a's id is refused.
        let third = vec![store.prepare_run(new_run("g", "", &plan)), store.prepare_run(new_run("a", "", &plan))];
        let answers = answered(store.create_runs(third).await);
        assert_eq!(answers[0], made("g", false));
        assert!(answers[1].is_err(), "{answers:?}");
        assert_eq!(whole(&store, "a").await, ["run_submitted"], "a is as it was");
        assert_eq!(whole(&store, "g").await, ["run_submitted", "run_started"]);

        // Written runs are appended to as any other.
        let note = crate::store::OwnedEvent {
            tenant: "t".into(),
            run_id: "e".into(),
            epoch: 1,
            idempotency_key: "n1".into(),
            event_type: "run_started".into(),
            payload: json!({ "note": "n1" }),
            step_id: String::new(),
            now_ms: 2,
        };
        let appended = store.append_groups(vec![vec![note]]).await;
        assert!(matches!(&appended[..], [Ok(_)]), "appended");
        assert_eq!(whole(&store, "e").await.len(), 3);
    }

    #[tokio::test]
    async fn runs_written_together_are_each_whole_on_sqlite() {
        let (_dir, store) = sqlite().await;
        runs_written_together_are_each_whole(store).await;
    }

    #[tokio::test]
    async fn runs_written_together_are_each_whole_on_postgres() {
        runs_written_together_are_each_whole(postgres().await).await;
    }
}
