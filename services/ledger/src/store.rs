//! Persistence of runs and events through sqlx's `Any` driver: PostgreSQL in production,
//! SQLite embedded, one migration folder per backend and the same SQL for both.
//!
//! Appends to one run serialize on the run row (`UPDATE … RETURNING` takes its lock in
//! PostgreSQL and the write lock in SQLite), so `seq` is contiguous under concurrent writers
//! and the idempotency and fencing checks see every committed event.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use ed25519_dalek::SigningKey;
use serde_json::Value;
use sqlx::ConnectOptions as _;
use sqlx::any::{AnyConnectOptions, AnyPoolOptions, AnyRow};
use sqlx::migrate::Migrator;
use sqlx::{AnyPool, Row};
use warden_core::chain::{ChainedEvent, EventBody, link};
use warden_core::events::{self, RunStatus};
use warden_core::head::Head;
use warden_core::receipt::{Receipt, receipt_for, receipt_id};

use crate::error::LedgerError;

mod batch;
mod checks;
mod create;
pub mod derived;
mod hot;
mod inplace;
mod unbound;

pub use create::PreparedRun;
pub use unbound::UnboundDecision;

static POSTGRES_MIGRATIONS: Migrator = sqlx::migrate!("migrations/postgres");
static SQLITE_MIGRATIONS: Migrator = sqlx::migrate!("migrations/sqlite");

/// Version of the schema contract, reported by `GetSchemaInfo`.
pub const SCHEMA_VERSION: &str = "3";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunRow {
    pub run_id: String,
    pub tenant: String,
    pub status: RunStatus,
    pub reason: String,
    pub plan_json: String,
    pub goal: String,
    pub cancel_policy: i32,
    pub last_seq: u64,
    pub head_hash: String,
    pub max_epoch: u64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub head_signature: String,
    pub head_key_id: String,
    /// Which proof `head_signature` is ([`PROOF_HEAD`] or [`PROOF_MAC`]).
    pub head_proof: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SummaryRow {
    pub seq: u64,
    pub summary_type: String,
    pub payload_json: String,
    pub step_id: String,
    pub timestamp_ms: i64,
}

/// [`NewEvent`] with owned fields, for queues.
#[derive(Debug, Clone)]
pub struct OwnedEvent {
    pub tenant: String,
    pub run_id: String,
    pub epoch: u64,
    pub idempotency_key: String,
    pub event_type: String,
    pub payload: Value,
    pub step_id: String,
    pub now_ms: i64,
}

impl OwnedEvent {
    pub fn borrowed(&self) -> NewEvent<'_> {
        NewEvent {
            tenant: &self.tenant,
            run_id: &self.run_id,
            epoch: self.epoch,
            idempotency_key: &self.idempotency_key,
            event_type: &self.event_type,
            payload: self.payload.clone(),
            step_id: &self.step_id,
            now_ms: self.now_ms,
        }
    }
}

/// A run to create with its `run_submitted` event.
pub struct NewRun<'a> {
    pub run_id: &'a str,
    pub tenant: &'a str,
    /// Empty: the run acts for the tenant itself.
    pub agent: &'a str,
    pub plan: Option<&'a Value>,
    pub goal: &'a str,
    pub idempotency_key: &'a str,
    pub cancel_policy: i32,
    pub now_ms: i64,
    /// The executor already holding the run's lease, and its epoch: `run_started` is then
    /// recorded in the same transaction (a fresh run costs one commit, not two).
    pub started_by: Option<(&'a str, u64)>,
    /// A goal run's replay policy (proto enum number) and, for a fork, its parent.
    pub replay_policy: i32,
    pub parent_run_id: &'a str,
    /// A child frame's place among frames (recorded as `frame`), already checked.
    pub frame: Option<Value>,
    /// Most frames the frame's run tree opens: counted with the run's creation, all or nothing.
    pub max_frames: u64,
    /// The run's first step (its decision and request), decided against the run as created
    /// and recorded in the same transaction, or — refused — not at all (see [`CreatedRun`]).
    pub first: Vec<OwnedEvent>,
}

/// What a run's creation may record of its first step (`NewRun::first`): the tools it pinned,
/// its decision and its request. Outcomes carry receipts and end steps: never among them.
pub const FIRST_EVENT_TYPES: [&str; 3] = [events::TOOLS_PINNED, events::POLICY_DECISION, events::TOOL_REQUESTED];

/// What [`LedgerStore::create_run`] did.
pub struct CreatedRun {
    pub run: RunRow,
    /// An earlier submission's run, with the same `(tenant, idempotency_key)`.
    pub deduplicated: bool,
    /// The first events as recorded with the run (none for a deduplicated run), or why they
    /// were refused: the run is then created without them.
    pub first: Result<Vec<Arc<ChainedEvent>>, LedgerError>,
}

/// One event to append.
pub struct NewEvent<'a> {
    pub tenant: &'a str,
    pub run_id: &'a str,
    pub epoch: u64,
    pub idempotency_key: &'a str,
    pub event_type: &'a str,
    pub payload: Value,
    pub step_id: &'a str,
    pub now_ms: i64,
}

#[derive(Clone)]
pub struct LedgerStore {
    pool: AnyPool,
    backend: Backend,
    /// Signs acknowledgements, and chain heads when they are asked for (`signed_head`).
    key: Arc<SigningKey>,
    /// The key of the MACs that prove stored heads ([`Self::head_mac`]), derived from `key`.
    mac_key: Arc<[u8; 32]>,
    /// `key`'s id, stored with each head.
    key_id: String,
    /// Runs appended to lately, whole, so their appends read nothing.
    hot: Arc<hot::HotRuns>,
    /// Connections kept for the one-statement append between uses (see [`Self::write_conn`]),
    /// with when each was last used.
    kept: Arc<std::sync::Mutex<Vec<KeptConnection>>>,
    /// How many connections may be kept: at most 4 (about one per write lane) and never more
    /// than a quarter of the pool, so readers and the slow path always find connections.
    keep_at_most: usize,
    /// Runs read from the database to decide an append, since start (see [`Self::runs_read`]).
    runs_read: Arc<std::sync::atomic::AtomicU64>,
    /// Reads in flight at once (see [`Self::reading`]): half the pool, so that the writers
    /// (the write lanes, the run writer) always find connections.
    reads: Arc<tokio::sync::Semaphore>,
    /// Request acknowledgements signed while their batch was being written, for the answer to
    /// take (see [`Self::acknowledge`]).
    presigned: Arc<std::sync::Mutex<HashMap<(String, u64), Presigned>>>,
    /// SQLite: the connection that commits batches decided from memory in place (see
    /// [`inplace`]); none on PostgreSQL or for a database only sqlx can open.
    in_place: Option<Arc<inplace::InPlace>>,
}

/// An acknowledgement signed ahead, with what it was signed for: the tenant and the event's
/// hash must match the committed event it is taken for.
struct Presigned {
    tenant: String,
    hash: String,
    ack: warden_core::auth::SignedClaims,
}

/// At most this many acknowledgements wait to be taken. Each is taken by the answer of the
/// request that wrote it; one whose caller went away is never taken, and the map is emptied
/// when it reaches this bound (the next answers then sign their own).
const MAX_PRESIGNED: usize = 4_096;

/// Past this many requests in a batch, none is signed ahead (see [`LedgerStore::presign`]).
const MAX_PRESIGNED_PER_BATCH: usize = 8;

/// How long a read waits for its turn behind others before it is answered UNAVAILABLE: far
/// past a busy moment, so that only a database that stopped answering ends the wait.
const READ_TURN_WAIT: Duration = Duration::from_secs(30);

/// A connection kept for appends, with when it was last used.
type KeptConnection = (sqlx::pool::PoolConnection<sqlx::Any>, std::time::Instant);

/// A kept connection idle longer than this goes back to the pool (whose test before use
/// pings connections idle this long) instead of being used.
const KEPT_IDLE: Duration = Duration::from_secs(30);

const RUN_COLUMNS: &str = "run_id, tenant, status, reason, plan_json, goal, cancel_policy, last_seq, head_hash, max_epoch, created_at_ms, updated_at_ms, head_signature, head_key_id, head_proof";

/// `runs.head_proof` of a head whose `head_signature` signs `{run_id, seq, hash}`.
pub const PROOF_HEAD: &str = "";
/// `runs.head_proof` of a head whose `head_signature` is the ledger's HMAC-SHA-256 of
/// `{run_id, seq, hash}` (see [`LedgerStore::head_mac`]).
pub const PROOF_MAC: &str = "mac";

/// What proves a stored head: a signature or MAC (hex), the ledger key's id, and which of the
/// two it is ([`PROOF_HEAD`], [`PROOF_MAC`]).
#[derive(Debug, Clone)]
pub(crate) struct HeadProof {
    pub signature: String,
    pub key_id: String,
    pub kind: &'static str,
}

/// HMAC-SHA-256 keyed for stored heads.
type HeadMac = hmac::Hmac<sha2::Sha256>;

/// The key of stored heads' MACs: SHA-256 of a label and the ledger's signing key, so it is
/// never the signing key itself and nobody without the key file has it.
fn head_mac_key(key: &SigningKey) -> [u8; 32] {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update(b"warden ledger: stored head MAC v1\0");
    h.update(key.to_bytes());
    h.finalize().into()
}

pub(crate) const EVENT_COLUMNS: &str =
    "run_id, seq, event_type, payload_json, step_id, epoch, idempotency_key, timestamp_ms, prev_hash, hash";

fn run_from_row(r: &AnyRow) -> Result<RunRow, LedgerError> {
    let status: String = r.try_get("status")?;
    Ok(RunRow {
        run_id: r.try_get("run_id")?,
        tenant: r.try_get("tenant")?,
        status: RunStatus::parse(&status)
            .ok_or_else(|| LedgerError::Internal(format!("unknown stored status '{status}'")))?,
        reason: r.try_get("reason")?,
        plan_json: r.try_get("plan_json")?,
        goal: r.try_get("goal")?,
        cancel_policy: r.try_get::<i64, _>("cancel_policy")? as i32,
        last_seq: r.try_get::<i64, _>("last_seq")? as u64,
        head_hash: r.try_get("head_hash")?,
        max_epoch: r.try_get::<i64, _>("max_epoch")? as u64,
        created_at_ms: r.try_get("created_at_ms")?,
        updated_at_ms: r.try_get("updated_at_ms")?,
        head_signature: r.try_get("head_signature")?,
        head_key_id: r.try_get("head_key_id")?,
        head_proof: r.try_get("head_proof")?,
    })
}

/// Decodes a stored event. A payload that is not JSON any more (tampering) decodes as a
/// string so verification reports the bad seq instead of failing the whole read.
pub fn event_from_row(r: &AnyRow) -> Result<ChainedEvent, LedgerError> {
    let payload_json: String = r.try_get("payload_json")?;
    let payload = serde_json::from_str(&payload_json).unwrap_or(Value::String(payload_json));
    Ok(ChainedEvent {
        body: EventBody {
            run_id: r.try_get("run_id")?,
            seq: r.try_get::<i64, _>("seq")? as u64,
            event_type: r.try_get("event_type")?,
            payload,
            step_id: r.try_get("step_id")?,
            epoch: r.try_get::<i64, _>("epoch")? as u64,
            idempotency_key: r.try_get("idempotency_key")?,
            timestamp_ms: r.try_get("timestamp_ms")?,
        },
        prev_hash: r.try_get("prev_hash")?,
        hash: r.try_get("hash")?,
    })
}

fn sqlite_url(url: &str) -> Result<String, LedgerError> {
    let path = url.trim_start_matches("sqlite://").trim_start_matches("sqlite:");
    let file = path.split('?').next().unwrap_or_default();
    if file.is_empty() {
        return Err(LedgerError::invalid("ledger.database_url", "sqlite URL has no file path"));
    }
    if file != ":memory:"
        && let Some(dir) = std::path::Path::new(file).parent().filter(|d| !d.as_os_str().is_empty())
    {
        std::fs::create_dir_all(dir)
            .map_err(|e| LedgerError::Unavailable(format!("cannot create {}: {e}", dir.display())))?;
    }
    Ok(if path.contains("mode=") {
        format!("sqlite://{path}")
    } else if path.contains('?') {
        format!("sqlite://{path}&mode=rwc")
    } else {
        format!("sqlite://{path}?mode=rwc")
    })
}

impl LedgerStore {
    /// Connects and runs the embedded migrations of the URL's backend.
    pub async fn connect(url: &str, max_connections: u32, key: SigningKey) -> Result<LedgerStore, LedgerError> {
        sqlx::any::install_default_drivers();
        let (backend, url) = if url.starts_with("sqlite:") {
            (Backend::Sqlite, sqlite_url(url)?)
        } else {
            (Backend::Postgres, url.to_string())
        };
        let options = AnyConnectOptions::from_str(&url)
            .map_err(|e| LedgerError::invalid("ledger.database_url", e.to_string()))?
            // A statement or more per request: not logged one by one (slow ones still are).
            .log_statements(log::LevelFilter::Off);
        let pool = AnyPoolOptions::new()
            // No round trip to ping the database before every statement, only before using a
            // connection idle long enough for the database or a proxy to have closed it. One
            // that died anyway (a database restart) fails its statement with a connection
            // error and is let go; appends and reads are tried again on another
            // (`try_groups_again`, `reading`).
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > Duration::from_secs(30) {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if backend == Backend::Sqlite {
                        // WAL lets readers (streams, verification) run beside the writer;
                        // NORMAL keeps every commit durable against process crashes.
                        sqlx::Executor::execute(
                            &mut *conn,
                            "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=10000; PRAGMA foreign_keys=ON;",
                        )
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options)
            .await?;
        let migrator = match backend {
            Backend::Sqlite => &SQLITE_MIGRATIONS,
            Backend::Postgres => &POSTGRES_MIGRATIONS,
        };
        migrator.run(&pool).await.map_err(|e| LedgerError::Unavailable(format!("migrations failed: {e}")))?;
        let in_place = if backend == Backend::Sqlite && inplace::InPlace::eligible(&url) {
            // The file as SQLite names the pool's database, however the URL spelled it.
            let file: String = sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
                .fetch_one(&pool)
                .await?;
            inplace::InPlace::at(&file).map(Arc::new)
        } else {
            None
        };
        Ok(LedgerStore {
            pool,
            backend,
            mac_key: Arc::new(head_mac_key(&key)),
            key_id: warden_core::auth::key_id(&key.verifying_key()),
            key: Arc::new(key),
            hot: Default::default(),
            kept: Default::default(),
            keep_at_most: (max_connections as usize / 4).min(4),
            runs_read: Default::default(),
            reads: Arc::new(tokio::sync::Semaphore::new((max_connections as usize / 2).max(1))),
            presigned: Default::default(),
            in_place,
        })
    }

    /// How many times a run was read from the database to decide an append, since start:
    /// whole, or only what a batch needs of a run too large to keep (see `store::hot`).
    pub fn runs_read(&self) -> u64 {
        self.runs_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// SQLite: batches committed in place, and batches that found the file's write lock held
    /// and were written through the pool instead, since start (see [`inplace`]).
    pub fn in_place_counts(&self) -> (u64, u64) {
        self.in_place.as_ref().map(|p| p.counts()).unwrap_or_default()
    }

    pub(crate) fn count_runs_read(&self, n: usize) {
        self.runs_read.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        warden_telemetry::metrics::ledger_runs_read(n);
    }

    pub fn verifying_key(&self) -> ed25519_dalek::VerifyingKey {
        self.key.verifying_key()
    }

    pub(crate) fn sign_head(&self, run_id: &str, seq: u64, hash: &str) -> (String, String) {
        let (sig, key_id) = Head { run_id: run_id.to_string(), seq, hash: hash.to_string() }.sign(&self.key);
        (hex::encode(sig), key_id)
    }

    /// The signed acknowledgement that `event` — a `tool_requested` — is recorded (see
    /// `warden_core::ack`). Only called for events that are committed. One signed while the
    /// event's batch was being written is taken when it was signed for this tenant and this
    /// exact event (run, seq and hash).
    pub fn acknowledge(&self, tenant: &str, event: &ChainedEvent) -> warden_core::auth::SignedClaims {
        let ahead = {
            let mut kept = self.presigned.lock().unwrap_or_else(|p| p.into_inner());
            // Taken out whether or not it matches: one that does not is of no use to anyone.
            if kept.is_empty() { None } else { kept.remove(&(event.body.run_id.clone(), event.body.seq)) }
        };
        match ahead {
            Some(p) if p.tenant == tenant && p.hash == event.hash => p.ack,
            _ => self.sign_ack(tenant, event),
        }
    }

    /// Signs the acknowledgements of `decided`'s requests, to be taken by [`Self::acknowledge`]
    /// once the batch is committed: done while the batch's statement is in flight, the signing
    /// costs a chain's step no time. Kept only after the write succeeded (`keep`).
    fn presign(&self, decided: &batch::Decided) -> Vec<((String, u64), Presigned)> {
        let requests = || decided.events.iter().filter(|e| e.body.event_type == events::TOOL_REQUESTED);
        // A busy batch is left to its answers: its statement waits on a busy database, and
        // signing many here would hold its commit back (nothing is gained when the cores are
        // full anyway). A chain's batch holds one request.
        if requests().count() > MAX_PRESIGNED_PER_BATCH {
            return Vec::new();
        }
        requests()
            .filter_map(|e| {
                let tenant = &decided.states.get(&e.body.run_id)?.head.tenant;
                let ack = self.sign_ack(tenant, e);
                let p = Presigned { tenant: tenant.clone(), hash: e.hash.clone(), ack };
                Some(((e.body.run_id.clone(), e.body.seq), p))
            })
            .collect()
    }

    fn keep_presigned(&self, signed: Vec<((String, u64), Presigned)>) {
        if signed.is_empty() {
            return;
        }
        let mut kept = self.presigned.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() + signed.len() > MAX_PRESIGNED {
            kept.clear();
        }
        kept.extend(signed);
    }

    fn sign_ack(&self, tenant: &str, event: &ChainedEvent) -> warden_core::auth::SignedClaims {
        let p = &event.body.payload;
        let text = |k: &str| p.get(k).and_then(serde_json::Value::as_str).unwrap_or_default().to_string();
        let claims = warden_core::ack::RequestAckClaims {
            v: 1,
            kind: String::new(),
            key_id: String::new(),
            tenant: tenant.to_string(),
            run_id: event.body.run_id.clone(),
            step_id: event.body.step_id.clone(),
            attempt: p.get("attempt").and_then(serde_json::Value::as_u64).unwrap_or(0).min(u32::MAX as u64) as u32,
            decision_id: text("decision_id"),
            idempotency_key: text("idempotency_key"),
            seq: event.body.seq,
            event_hash: event.hash.clone(),
        };
        warden_core::ack::sign_ack(claims, &self.key)
    }

    /// The proof stored with the head `st` moves to: the ledger's MAC of it
    /// ([`Self::head_mac`]), not a signature — a stored head is only ever checked by the ledger
    /// itself, which signs it when asked (`signed_head`).
    pub(crate) fn prove_head(&self, st: &hot::RunState) -> HeadProof {
        let h = &st.head;
        HeadProof {
            signature: self.head_mac(&h.run_id, h.last_seq, &h.head_hash),
            key_id: self.key_id.clone(),
            kind: PROOF_MAC,
        }
    }

    /// HMAC-SHA-256 (hex) of the head `{run_id, seq, hash}` as RFC 8785 JSON, keyed by
    /// SHA-256 of a label and the ledger's signing key: every replica sharing the key file
    /// computes the same, nobody without it can. A microsecond where a signature costs 15–25.
    pub(crate) fn head_mac(&self, run_id: &str, seq: u64, hash: &str) -> String {
        use hmac::Mac as _;
        hex::encode(self.mac_of(run_id, seq, hash).finalize().into_bytes())
    }

    /// The MAC state over a head, ready to finalize or to compare.
    fn mac_of(&self, run_id: &str, seq: u64, hash: &str) -> HeadMac {
        use hmac::Mac as _;
        let message = warden_core::canonical_json(&Head { run_id: run_id.to_string(), seq, hash: hash.to_string() });
        // HMAC takes a key of any length: this cannot fail.
        let mut mac = HeadMac::new_from_slice(self.mac_key.as_slice()).expect("an HMAC key of any length");
        mac.update(message.as_bytes());
        mac
    }

    /// Whether `run`'s stored head proof is this ledger's, for the head `run` records. A row
    /// marked as a MAC whose check fails is also taken with a head signature: a ledger of an
    /// earlier version, still running beside this one, writes signatures without setting the
    /// column (a MAC and a signature differ in length, so one never passes for the other).
    pub fn head_proof_verifies(&self, run: &RunRow) -> bool {
        let Ok(proof) = hex::decode(&run.head_signature) else { return false };
        match run.head_proof.as_str() {
            PROOF_HEAD => self.head_signature_verifies(run, &proof),
            PROOF_MAC => self.mac_verifies(run, &proof) || self.head_signature_verifies(run, &proof),
            _ => false,
        }
    }

    /// Whether `proof` is the ledger's signature of `run`'s head.
    fn head_signature_verifies(&self, run: &RunRow, proof: &[u8]) -> bool {
        Head { run_id: run.run_id.clone(), seq: run.last_seq, hash: run.head_hash.clone() }
            .verify(proof, &self.key.verifying_key())
    }

    /// Whether `proof` is the ledger's MAC of `run`'s head (compared in constant time).
    fn mac_verifies(&self, run: &RunRow, proof: &[u8]) -> bool {
        use hmac::Mac as _;
        self.mac_of(&run.run_id, run.last_seq, &run.head_hash).verify_slice(proof).is_ok()
    }

    /// `run`'s head signed as `{run_id, seq, hash}` (what `GetSignedHead` hands out): a stored
    /// head signature as it was written (whoever receives it checks it), or, for a head stored
    /// with the ledger's MAC, a signature made now once the MAC verified — so a head moved in
    /// the store without the ledger's key is never signed.
    pub fn signed_head(&self, run: &RunRow) -> Result<(String, String), LedgerError> {
        let stored = || Ok((run.head_signature.clone(), run.head_key_id.clone()));
        if run.head_proof == PROOF_HEAD {
            return stored();
        }
        if run.head_proof == PROOF_MAC
            && let Ok(proof) = hex::decode(&run.head_signature)
        {
            if self.mac_verifies(run, &proof) {
                return Ok(self.sign_head(&run.run_id, run.last_seq, &run.head_hash));
            }
            // A signature an earlier version wrote under the MAC's mark (see above).
            if self.head_signature_verifies(run, &proof) {
                return stored();
            }
        }
        Err(LedgerError::DataLoss(format!("run '{}': the chain head's proof does not verify", run.run_id)))
    }

    /// The run acknowledgement of a run recorded with `plan_json` (its stored canonical JSON):
    /// what the policy takes instead of reading the plan back (`warden_core::ack`).
    pub fn acknowledge_run(&self, tenant: &str, run_id: &str, plan_json: &str) -> warden_core::auth::SignedClaims {
        warden_core::ack::sign_run_ack(tenant, run_id, plan_json, &self.key)
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Imports a whole run (for restores, migrations and benchmarks): the chain is verified
    /// first, then the run, its events and receipts are written in one transaction, and the
    /// head is signed by this ledger. Refused when the run id exists.
    pub async fn import(&self, tenant: &str, events: &[ChainedEvent]) -> Result<RunRow, LedgerError> {
        let first =
            events.first().ok_or_else(|| LedgerError::invalid("events", "an import needs at least one event"))?;
        if first.body.event_type != events::RUN_SUBMITTED {
            return Err(LedgerError::invalid("events", "a run starts with run_submitted"));
        }
        warden_core::chain::verify_chain(events).map_err(|b| LedgerError::invalid("events", b.to_string()))?;
        let run_id = &first.body.run_id;
        let last = events.last().unwrap_or(first);
        let mut view = warden_core::run::RunView::default();
        let mut max_epoch = 0;
        for e in events {
            view.apply(e.body.seq, &e.body.event_type, &e.body.step_id, &e.body.payload);
            max_epoch = max_epoch.max(e.body.epoch);
        }
        // A goal run's plan is the one its `plan_created` recorded.
        let created = events.iter().find(|e| e.body.event_type == events::PLAN_CREATED);
        let plan_json = first
            .body
            .payload
            .get("plan")
            .or_else(|| created.and_then(|e| e.body.payload.get("plan")))
            .map(warden_core::canonical_json)
            .unwrap_or_default();
        let (signature, key_id) = self.sign_head(run_id, last.body.seq, &last.hash);
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO runs (run_id, tenant, status, reason, plan_json, goal, cancel_policy, submit_key, last_seq, head_hash, max_epoch,
                               created_at_ms, updated_at_ms, head_signature, head_key_id)
             VALUES ($1, $2, $3, $4, $5, '', 0, NULL, $6, $7, $8, $9, $10, $11, $12)",
        )
        .bind(run_id)
        .bind(tenant)
        .bind(view.status.as_str())
        .bind(&view.reason)
        .bind(&plan_json)
        .bind(last.body.seq as i64)
        .bind(&last.hash)
        .bind(max_epoch as i64)
        .bind(first.body.timestamp_ms)
        .bind(last.body.timestamp_ms)
        .bind(&signature)
        .bind(&key_id)
        .execute(&mut *tx)
        .await
        .map_err(|e| if is_unique_violation(&e) { LedgerError::Precondition(format!("run '{run_id}' already exists")) } else { e.into() })?;
        batch::insert_events(&mut tx, events).await?;
        let receipts: Vec<Receipt> = events.iter().filter_map(|e| receipt_for(e, "")).collect();
        batch::insert_receipts(&mut tx, &receipts).await?;
        for e in events.iter().filter(|e| e.body.event_type == events::RUN_SUMMARY) {
            derived::apply(&mut tx, self.backend, tenant, e).await?;
        }
        tx.commit().await?;
        self.get_run(run_id).await?.ok_or_else(|| LedgerError::Internal("imported run vanished".into()))
    }

    pub async fn get_run(&self, run_id: &str) -> Result<Option<RunRow>, LedgerError> {
        let sql = format!("SELECT {RUN_COLUMNS} FROM runs WHERE run_id = $1");
        let row = self.reading(|| sqlx::query(&sql).bind(run_id).fetch_optional(&self.pool)).await?;
        row.as_ref().map(run_from_row).transpose()
    }

    /// How many dropped connections one statement is tried again past: each fails once and
    /// is let go by the pool, so after as many as the pool holds the next one is new.
    fn dropped_connections_tolerated(&self) -> u32 {
        self.pool.options().get_max_connections()
    }

    /// A read, asked again on another connection while the one it got was dropped by the
    /// database (it restarted; the pool lets each such connection go, so at most as many
    /// times as the pool holds, plus one), as appends are: a read changes nothing, and its
    /// caller would otherwise be answered UNAVAILABLE once per dead pooled connection.
    ///
    /// Reads take turns: at most half the pool's connections read at once, and the others
    /// wait here. Without turns, a burst of reads (thousands of runs ending at once, each
    /// answered from the ledger) queued in the pool, and those past its 5 s acquire timeout —
    /// meant for a database that does not answer — failed UNAVAILABLE.
    async fn reading<T, F, Fut>(&self, mut read: F) -> Result<T, LedgerError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        let _turn = match tokio::time::timeout(READ_TURN_WAIT, self.reads.acquire()).await {
            Ok(Ok(turn)) => turn,
            _ => {
                let waited = READ_TURN_WAIT.as_secs();
                return Err(LedgerError::Unavailable(format!("a read waited {waited} s for its turn behind others")));
            }
        };
        let mut dropped = 0;
        loop {
            match read().await.map_err(LedgerError::from) {
                Err(LedgerError::Disconnected(why)) if dropped <= self.dropped_connections_tolerated() => {
                    tracing::debug!(%why, "reading again on another connection");
                    dropped += 1;
                }
                r => return r,
            }
        }
    }

    /// Runs ordered by id, after `after` (exclusive), optionally for one tenant and statuses.
    pub async fn list_runs(
        &self,
        tenant: Option<&str>,
        statuses: &[RunStatus],
        after: &str,
        limit: u32,
    ) -> Result<Vec<RunRow>, LedgerError> {
        let mut sql = format!("SELECT {RUN_COLUMNS} FROM runs WHERE run_id > $1");
        let mut n = 1;
        if tenant.is_some() {
            n += 1;
            sql.push_str(&format!(" AND tenant = ${n}"));
        }
        if !statuses.is_empty() {
            let marks: Vec<String> = (0..statuses.len()).map(|i| format!("${}", n + 1 + i)).collect();
            sql.push_str(&format!(" AND status IN ({})", marks.join(", ")));
        }
        sql.push_str(&format!(" ORDER BY run_id LIMIT {limit}"));
        let rows = self
            .reading(|| {
                let mut q = sqlx::query(&sql).bind(after);
                if let Some(t) = tenant {
                    q = q.bind(t);
                }
                for s in statuses {
                    q = q.bind(s.as_str());
                }
                q.fetch_all(&self.pool)
            })
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    /// Events with `seq > since_seq`, at most `limit`, in order.
    pub async fn events(&self, run_id: &str, since_seq: u64, limit: u32) -> Result<Vec<ChainedEvent>, LedgerError> {
        let sql =
            format!("SELECT {EVENT_COLUMNS} FROM events WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT {limit}");
        let since = since_seq.min(i64::MAX as u64) as i64;
        let rows = self.reading(|| sqlx::query(&sql).bind(run_id).bind(since).fetch_all(&self.pool)).await?;
        rows.iter().map(event_from_row).collect()
    }

    /// A connection for the one-statement append. sqlx tests every connection given back to
    /// its pool with a ping — a database round trip, and a wake-up of the database, per
    /// statement — so the append's connections are kept apart between appends instead
    /// ([`Self::keep`]): at most a quarter of the pool, and one idle over 30 s is given back
    /// (the pool pings it before its next use). A kept connection the database dropped
    /// meanwhile fails its statement and is let go (given back to the pool, whose ping closes
    /// it); the append is tried again on another (`try_groups_again`).
    pub(crate) async fn write_conn(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Any>, sqlx::Error> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner()).pop();
        if let Some((conn, used)) = kept {
            if used.elapsed() < KEPT_IDLE {
                return Ok(conn);
            }
            // Back to the pool, which pings it before handing it out again.
            drop(conn);
        }
        self.pool.acquire().await
    }

    /// Keeps a connection whose statement succeeded for the next append (or gives it back).
    pub(crate) fn keep(&self, conn: sqlx::pool::PoolConnection<sqlx::Any>) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < self.keep_at_most {
            kept.push((conn, std::time::Instant::now()));
        }
    }

    /// A write transaction. SQLite's starts IMMEDIATE: it reads before it writes, and a
    /// deferred transaction could not upgrade after another writer committed.
    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>, sqlx::Error> {
        match self.backend {
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await,
            Backend::Postgres => self.pool.begin().await,
        }
    }

    /// [`Self::begin_write`] on a connection the caller holds (a kept one).
    async fn begin_write_on<'c>(
        &self,
        conn: &'c mut sqlx::AnyConnection,
    ) -> Result<sqlx::Transaction<'c, sqlx::Any>, sqlx::Error> {
        match self.backend {
            Backend::Sqlite => sqlx::Connection::begin_with(conn, "BEGIN IMMEDIATE").await,
            Backend::Postgres => sqlx::Connection::begin(conn).await,
        }
    }

    /// Appends one event in its own transaction; returns it and whether it was a duplicate.
    pub async fn append(&self, new: NewEvent<'_>) -> Result<(ChainedEvent, bool), LedgerError> {
        self.hot.forget(new.run_id);
        let mut tx = self.begin_write().await?;
        let appended = self.append_in(&mut tx, new).await?;
        tx.commit().await?;
        Ok(appended)
    }

    /// Appends groups of events in one database transaction (group commit), one commit for
    /// all; each group is all or nothing (a refused event wrote nothing: every check precedes
    /// the writes), and the other groups go on. A batch decided on a run state another writer
    /// had moved past wrote nothing and runs again, reading its runs under their lock. If the
    /// transaction itself fails (storage trouble, or an event the database will not take),
    /// every group is appended again on its own, so each gets its own answer — refusals
    /// included, since they may have depended on events of the failed transaction.
    pub async fn append_groups(&self, groups: Vec<Vec<OwnedEvent>>) -> Vec<crate::group::GroupResult> {
        match self.try_groups_again(&groups).await {
            Ok(results) => results,
            Err(e) if groups.len() == 1 => vec![Err(e)],
            Err(e) => {
                tracing::warn!(groups = groups.len(), error = %e, "batch failed; appending its groups one by one");
                let mut results = Vec::with_capacity(groups.len());
                for g in &groups {
                    let one = match self.try_groups_again(std::slice::from_ref(g)).await {
                        Ok(mut r) => r.pop().unwrap_or_else(|| Err(LedgerError::Internal("no answer".into()))),
                        Err(e) => Err(e),
                    };
                    results.push(one);
                }
                results
            }
        }
    }

    /// Whether [`Self::append_in_place_now`] can ever commit here (SQLite, written in place).
    pub fn commits_in_place(&self) -> bool {
        self.in_place.is_some()
    }

    /// One group of plain events appended on the calling thread with no await in between, or
    /// given back unwritten (`Err`) for a write lane to append. The lane's fast path when it is
    /// idle ([`crate::group::GroupCommit`]): a chain's append is then decided and committed in
    /// the caller's task instead of being handed to the lane's task and answered back, two
    /// hand-overs that in `warden dev` each wake the runtime's other worker.
    ///
    /// Only what [`Self::try_groups`] would decide wholly from memory and commit in place
    /// (SQLite) is taken: a run memory holds, nothing repeated, every event accepted, a batch
    /// the pooled path would send as one query, the file's lock free. Anything else is given
    /// back, and what memory held of the run is dropped when it was decided on already (a
    /// refusal, a lock held, any failure), so the lane decides it on the stored head, as
    /// [`Self::try_groups`] does after a refusal or an error. A lock held by another writer
    /// costs more here than on the lane's way, which writes the batch it decided through the
    /// pool and keeps the run in memory: the lane reads the run back. Since nothing here
    /// awaits, a caller that goes away cannot leave it half done.
    pub fn append_in_place_now(&self, events: Vec<OwnedEvent>) -> Result<crate::group::GroupResult, Vec<OwnedEvent>> {
        let groups = [events];
        let committed = 'commit: {
            let Some(in_place) = &self.in_place else { break 'commit None };
            let Some(run) = groups[0].first().map(|e| e.run_id.as_str()) else { break 'commit None };
            if groups[0].iter().any(|e| e.run_id != run || derived::has_effects(&e.event_type)) {
                break 'commit None;
            }
            let mut states = self.hot.take_present(&[run]);
            if states.is_empty() {
                break 'commit None;
            }
            let repeated = batch::take_repeats(&mut states, &groups);
            if !repeated.is_empty() {
                // Put back as it was: the lane looks at the repeat with the stored head.
                self.hot.put(repeated.into_values().chain(states.into_values()));
                break 'commit None;
            }
            let mut decided = batch::decide_groups(states, &groups);
            // Nothing to write when no head moves (the answers are memory's), as in
            // `write_decided_now`.
            let written = decided.results.iter().all(Result::is_ok)
                && (decided.touched.is_empty()
                    || decided.fits_one_query()
                        && matches!(in_place.write(self, &decided), Ok(inplace::Written::Done)));
            if !written {
                // Decided on but not written (or refused): memory's state of the run is not the
                // stored one any more, so the lane reads it.
                break 'commit None;
            }
            self.hot.put(std::mem::take(&mut decided.states).into_values());
            Some(
                decided
                    .results
                    .pop()
                    .unwrap_or_else(|| Err(LedgerError::Internal("the batch answered no group".into()))),
            )
        };
        committed.ok_or_else(|| {
            let [events] = groups;
            events
        })
    }

    /// [`Self::try_groups`], again while the answer is that it must be: a batch decided on a
    /// head another writer moved (it wrote nothing; decided again on stored heads), or a
    /// connection the database dropped, e.g. when it restarted (the pool lets each such
    /// connection go, so at most as many times as the pool holds, plus one). Whatever a broken
    /// attempt committed or not, the retry's idempotency keys find out.
    async fn try_groups_again(
        &self,
        groups: &[Vec<OwnedEvent>],
    ) -> Result<Vec<crate::group::GroupResult>, LedgerError> {
        let (mut moved, mut dropped) = (false, 0);
        loop {
            match self.try_groups(groups).await {
                Err(LedgerError::Moved(why)) if !moved => {
                    tracing::debug!(%why, "appending again from the stored heads");
                    moved = true;
                }
                Err(LedgerError::Disconnected(why)) if dropped <= self.dropped_connections_tolerated() => {
                    tracing::debug!(%why, "appending again on another connection");
                    dropped += 1;
                }
                r => return r,
            }
        }
    }

    /// A batch's states are taken out of memory for its length and put back only once it
    /// committed: on any error they are dropped, and the runs' next appends read them.
    ///
    /// The runs memory holds are decided from memory; the others are read under their row
    /// lock in the same transaction — whole if memory does not hold them, only their head if
    /// the batch only repeats their events (see [`batch::take_repeats`]). So one run that must
    /// be read costs its own read, not every run's of the batch.
    async fn try_groups(&self, groups: &[Vec<OwnedEvent>]) -> Result<Vec<crate::group::GroupResult>, LedgerError> {
        let derived_alone = |g: &Vec<OwnedEvent>| g.len() == 1 && derived::has_effects(&g[0].event_type);
        // Only plain events are decided from memory; the rest goes the way below (which
        // refuses a group mixing derived events with others).
        if !groups.iter().flatten().any(|e| derived::has_effects(&e.event_type)) {
            let mut states = self.hot.take_present(&batch::runs_of(groups));
            let repeated = batch::take_repeats(&mut states, groups);
            if !states.is_empty() || !repeated.is_empty() {
                let (held, read): (Vec<&[OwnedEvent]>, Vec<&[OwnedEvent]>) = groups
                    .iter()
                    .map(Vec::as_slice)
                    .partition(|g| g.first().is_some_and(|e| states.contains_key(&e.run_id)));
                let decided = batch::decide_groups(states, &held);
                // A refusal writes nothing that a moved head could refuse in turn, so it is
                // decided again on the stored heads below (what memory held is dropped).
                if decided.results.iter().all(Result::is_ok) {
                    if read.is_empty() {
                        self.write_decided(&decided).await?;
                        self.hot.put(decided.states.into_values());
                        return Ok(decided.results);
                    }
                    return self.write_with_read(groups, decided, repeated, &read).await;
                }
            }
        }
        let mut tx = self.begin_write().await?;
        let mut results = Vec::with_capacity(groups.len());
        let mut states_after: HashMap<String, hot::RunState> = HashMap::new();
        let mut derived_runs = Vec::new();
        let mut i = 0;
        while i < groups.len() {
            if derived_alone(&groups[i]) {
                // Summaries and transactions read state that earlier events may change: each
                // is appended on its own, reading as it goes.
                let run = groups[i][0].run_id.as_str();
                self.hot.forget(run);
                derived_runs.push(run);
                match self.append_in(&mut tx, groups[i][0].borrowed()).await {
                    Err(e) if !e.is_refusal() => return Err(e),
                    r => results.push(r.map(|(e, repeat)| vec![(Arc::new(e), repeat)])),
                }
                i += 1;
                continue;
            }
            let end = (i..groups.len()).find(|&k| derived_alone(&groups[k])).unwrap_or(groups.len());
            let segment = &groups[i..end];
            if segment.iter().flatten().any(|e| derived::has_effects(&e.event_type)) {
                // The RPCs never form these; refuse rather than skip their effects.
                return Err(LedgerError::invalid("events", "summaries and transactions are appended on their own"));
            }
            // Everything here is decided on heads read under their row lock (what memory
            // held of these runs is dropped): a run an earlier segment of this transaction
            // wrote is read with those writes.
            for run in batch::runs_of(segment) {
                self.hot.forget(run);
            }
            let states = batch::load_states(self, &mut tx, segment).await?;
            let decided = batch::decide_groups(states, segment);
            batch::write(self, &mut tx, &decided).await?;
            results.extend(decided.results);
            states_after.extend(decided.states);
            i = end;
        }
        tx.commit().await?;
        for run in derived_runs {
            states_after.remove(run);
        }
        self.hot.put(states_after.into_values());
        Ok(results)
    }

    /// Writes a batch decided wholly from memory: one statement on PostgreSQL, one transaction
    /// on SQLite.
    async fn write_decided(&self, decided: &batch::Decided) -> Result<(), LedgerError> {
        // The requests' acknowledgements are signed while the statement is in flight (the
        // database works on another core meanwhile), and kept only once it committed.
        let presign = async {
            // Polled again only after the write's first poll has sent the statement.
            tokio::task::yield_now().await;
            self.presign(decided)
        };
        let (written, signed) = tokio::join!(self.write_decided_now(decided), presign);
        written?;
        self.keep_presigned(signed);
        Ok(())
    }

    async fn write_decided_now(&self, decided: &batch::Decided) -> Result<(), LedgerError> {
        if self.backend == Backend::Postgres {
            batch::write_one_statement(self, decided).await?;
        } else if !decided.touched.is_empty() {
            // In place when the batch is one the pooled path would send as one query: the
            // caller's thread is not held by a batch larger than that.
            if let Some(in_place) = &self.in_place
                && decided.fits_one_query()
                && let inplace::Written::Done = in_place.write(self, decided)?
            {
                return Ok(());
            }
            // On a kept connection, as the one statement above: SQLite's pool would otherwise
            // ping the connection on its worker thread after every batch.
            let mut conn = self.write_conn().await?;
            if decided.fits_one_query() {
                // The transaction and its statements in one query (one hand-over).
                batch::write_committed(self, &mut conn, decided).await?;
            } else {
                let mut tx = self.begin_write_on(&mut conn).await?;
                batch::write(self, &mut tx, decided).await?;
                tx.commit().await?;
            }
            self.keep(conn);
        }
        Ok(())
    }

    /// Writes what memory decided (`held`) and decides the groups of the other runs (`read`)
    /// on their stored heads, in one transaction; answers every group of `groups` in order.
    /// `repeated` holds what memory knew of runs the batch only repeats events of: used when
    /// their stored heads show it is still current, else read whole like the rest.
    async fn write_with_read(
        &self,
        groups: &[Vec<OwnedEvent>],
        held: batch::Decided,
        repeated: HashMap<String, hot::RunState>,
        read: &[&[OwnedEvent]],
    ) -> Result<Vec<crate::group::GroupResult>, LedgerError> {
        let mut tx = self.begin_write().await?;
        // Every run of the batch locked first, in id order as the database path locks them:
        // the writes and reads below then wait on no lock another batch could hold while it
        // waits on one of these (locking a row again in the transaction is free).
        let all: Vec<String> = batch::runs_of(groups).into_iter().map(str::to_string).collect();
        let heads = batch::lock_heads(self, &mut tx, &all).await?;
        batch::write(self, &mut tx, &held).await?;
        // The runs read are not in memory: never held, or taken out by this batch.
        let mut states = batch::still_current(repeated, &heads);
        let unread: Vec<&[OwnedEvent]> =
            read.iter().copied().filter(|g| g.first().is_some_and(|e| !states.contains_key(&e.run_id))).collect();
        states.extend(batch::load_states(self, &mut tx, &unread).await?);
        let decided = batch::decide_groups(states, read);
        batch::write(self, &mut tx, &decided).await?;
        tx.commit().await?;
        // Back in the order asked: each group went one way, by its run.
        let (mut from_memory, mut from_reads) = (held.results.into_iter(), decided.results.into_iter());
        let results = groups
            .iter()
            .map(|g| {
                let was_held = g.first().is_some_and(|e| held.states.contains_key(&e.run_id));
                let next = if was_held { from_memory.next() } else { from_reads.next() };
                next.unwrap_or_else(|| Err(LedgerError::Internal("a group went unanswered".into())))
            })
            .collect();
        self.hot.put(held.states.into_values().chain(decided.states.into_values()));
        Ok(results)
    }

    /// One event inside `tx`, reading what it needs as it goes. The caller commits.
    async fn append_in(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        new: NewEvent<'_>,
    ) -> Result<(ChainedEvent, bool), LedgerError> {
        let mut heads = batch::lock_heads(self, tx, &[new.run_id.to_string()]).await?;
        let Some(head) = heads.remove(new.run_id) else {
            return Err(LedgerError::NotFound(format!("run '{}'", new.run_id)));
        };
        let mut state = hot::RunState::new(head, false);
        let head = &state.head;
        checks::check_tenant(head, &new)?;
        let own_key = (new.run_id.to_string(), new.idempotency_key.to_string());
        let mut keys = vec![own_key.clone()];
        let cited = checks::cited_decision_key(&new)?;
        if let Some(k) = &cited {
            keys.push((new.run_id.to_string(), k.clone()));
        }
        let found = batch::find_events(tx, &keys).await?;
        if let Some(existing) = found.get(&own_key) {
            checks::check_duplicate(existing, &new)?;
            checks::check_stale_repeat(head, &new)?;
            return Ok((existing.clone(), true));
        }
        checks::check_writable(head, &new)?;
        let capability_id = match cited {
            Some(k) => checks::check_allow(found.get(&(new.run_id.to_string(), k)), &new)?,
            None => String::new(),
        };
        if let Some(id) = receipt_id(new.run_id, new.event_type, new.step_id, &new.payload)
            && !batch::existing_receipts(tx, std::slice::from_ref(&id)).await?.is_empty()
        {
            return Err(LedgerError::Precondition(format!(
                "step '{}' already has an outcome for this attempt (receipt {id})",
                new.step_id
            )));
        }
        let event = link(
            EventBody {
                run_id: new.run_id.to_string(),
                seq: head.last_seq + 1,
                event_type: new.event_type.to_string(),
                payload: new.payload,
                step_id: new.step_id.to_string(),
                epoch: new.epoch,
                idempotency_key: new.idempotency_key.to_string(),
                timestamp_ms: new.now_ms,
            },
            &head.head_hash,
        );
        // Derived state checks before it writes: a refused transaction step leaves nothing.
        let committed_with = derived::apply(tx, self.backend, &head.tenant, &event).await?;
        let capability_id = if committed_with.is_empty() { capability_id } else { committed_with };
        batch::insert_events(tx, std::slice::from_ref(&event)).await?;
        if let Some(r) = receipt_for(&event, &capability_id) {
            batch::insert_receipts(tx, &[r]).await?;
        }
        state.head.advance(&event);
        batch::write_head(tx, &state, self.prove_head(&state)).await?;
        Ok((event, false))
    }

    /// Summaries of a run, newest first; `kind` filters by exact type, `prefix` by type prefix.
    pub async fn summaries(
        &self,
        run_id: &str,
        kind: Option<&str>,
        prefix: Option<&str>,
        limit: u32,
    ) -> Result<Vec<SummaryRow>, LedgerError> {
        let base = "SELECT seq, summary_type, payload_json, step_id, timestamp_ms FROM summaries WHERE run_id = $1";
        let rows = match (kind, prefix) {
            (Some(k), _) => {
                let sql = format!("{base} AND summary_type = $2 ORDER BY seq DESC LIMIT {limit}");
                self.reading(|| sqlx::query(&sql).bind(run_id).bind(k).fetch_all(&self.pool)).await?
            }
            (None, Some(p)) => {
                // substr, not LIKE (no escaping of '_' or '%') nor a range (PostgreSQL's
                // collation may not order bytewise).
                let sql = format!(
                    "{base} AND substr(summary_type, 1, CAST($3 AS INTEGER)) = $2 ORDER BY seq DESC LIMIT {limit}"
                );
                let n = p.chars().count() as i64;
                self.reading(|| sqlx::query(&sql).bind(run_id).bind(p).bind(n).fetch_all(&self.pool)).await?
            }
            (None, None) => {
                let sql = format!("{base} ORDER BY seq DESC LIMIT {limit}");
                self.reading(|| sqlx::query(&sql).bind(run_id).fetch_all(&self.pool)).await?
            }
        };
        rows.iter()
            .map(|r| {
                Ok(SummaryRow {
                    seq: r.try_get::<i64, _>(0)? as u64,
                    summary_type: r.try_get(1)?,
                    payload_json: r.try_get(2)?,
                    step_id: r.try_get(3)?,
                    timestamp_ms: r.try_get(4)?,
                })
            })
            .collect()
    }

    /// The deltas staged in a transaction so far, in staging order.
    pub async fn staged_deltas(&self, run_id: &str, tx_id: &str) -> Result<Vec<serde_json::Value>, LedgerError> {
        let sql = "SELECT delta_json FROM tx_staged WHERE run_id = $1 AND tx_id = $2 ORDER BY seq";
        let rows = self.reading(|| sqlx::query(sql).bind(run_id).bind(tx_id).fetch_all(&self.pool)).await?;
        rows.iter()
            .map(|r| {
                let text: String = r.try_get(0)?;
                serde_json::from_str(&text).map_err(|e| LedgerError::Internal(format!("staged delta: {e}")))
            })
            .collect()
    }

    /// Stores a run's output by its digest (`sha256` of `output_json`, which is canonical);
    /// storing it again changes nothing.
    pub async fn put_output(
        &self,
        tenant: &str,
        run_id: &str,
        sha256: &str,
        output_json: &str,
        now_ms: i64,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO outputs (run_id, sha256, tenant, bytes, output_json, created_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (run_id, sha256) DO NOTHING",
        )
        .bind(run_id)
        .bind(sha256)
        .bind(tenant)
        .bind(output_json.len() as i64)
        .bind(output_json)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// A run's stored output by its digest.
    pub async fn output(&self, run_id: &str, sha256: &str) -> Result<Option<String>, LedgerError> {
        let sql = "SELECT output_json FROM outputs WHERE run_id = $1 AND sha256 = $2";
        let row = self.reading(|| sqlx::query(sql).bind(run_id).bind(sha256).fetch_optional(&self.pool)).await?;
        row.map(|r| Ok(r.try_get(0)?)).transpose()
    }

    /// A tenant's committed state under `key`: (value JSON, version, tx id).
    pub async fn state(&self, tenant: &str, key: &str) -> Result<Option<(String, u64, String)>, LedgerError> {
        let sql = "SELECT value_json, version, tx_id FROM state WHERE tenant = $1 AND state_key = $2 AND deleted = 0";
        let row = self.reading(|| sqlx::query(sql).bind(tenant).bind(key).fetch_optional(&self.pool)).await?;
        row.map(|r| Ok((r.try_get(0)?, r.try_get::<i64, _>(1)? as u64, r.try_get(2)?))).transpose()
    }

    /// Receipts of a run (of one step when `step_id` is given) after `after_seq`, in seq order.
    pub async fn receipts(
        &self,
        run_id: &str,
        step_id: Option<&str>,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<Receipt>, LedgerError> {
        let after = after_seq.min(i64::MAX as u64) as i64;
        let rows = match step_id {
            Some(step) => {
                let sql = format!(
                    "SELECT body_json, seq FROM receipts WHERE run_id = $1 AND step_id = $2 AND seq > $3 ORDER BY seq LIMIT {limit}"
                );
                self.reading(|| sqlx::query(&sql).bind(run_id).bind(step).bind(after).fetch_all(&self.pool)).await?
            }
            None => {
                let sql = format!(
                    "SELECT body_json, seq FROM receipts WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT {limit}"
                );
                self.reading(|| sqlx::query(&sql).bind(run_id).bind(after).fetch_all(&self.pool)).await?
            }
        };
        rows.iter()
            .map(|r| {
                let body: String = r.try_get(0)?;
                let seq = r.try_get::<i64, _>(1)? as u64;
                // A body that no longer parses, or whose seq is not its row's, was edited in
                // the database: it keeps the row's seq (paging goes on) and fails verification.
                let mut receipt: Receipt = serde_json::from_str(&body)
                    .unwrap_or_else(|_| Receipt { receipt_id: body, ..empty_receipt(run_id) });
                if receipt.seq != seq {
                    receipt.seq = seq;
                    receipt.hash = String::from("edited: seq differs from its row");
                }
                Ok(receipt)
            })
            .collect()
    }
}

fn empty_receipt(run_id: &str) -> Receipt {
    Receipt {
        receipt_id: String::new(),
        run_id: run_id.to_string(),
        step_id: String::new(),
        attempt: 0,
        seq: 0,
        trace_id: String::new(),
        span_id: String::new(),
        job_id: String::new(),
        tx_id: String::new(),
        capability_id: String::new(),
        policy_decision: String::new(),
        action_type: String::new(),
        timestamp_ms: 0,
        status: String::new(),
        reason: String::new(),
        event_hash: String::new(),
        hash: String::new(),
    }
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
}

/// A root run of tenant `t`, started by an executor at epoch 1, submitted with `key` (empty:
/// none).
#[cfg(test)]
pub(crate) fn test_run<'a>(run_id: &'a str, key: &'a str, plan: &'a Value) -> NewRun<'a> {
    NewRun {
        run_id,
        tenant: "t",
        agent: "",
        plan: Some(plan),
        goal: "",
        idempotency_key: key,
        cancel_policy: 0,
        now_ms: 1,
        started_by: Some(("executor", 1)),
        replay_policy: 0,
        parent_run_id: "",
        frame: None,
        max_frames: 0,
        first: Vec::new(),
    }
}

/// A store on a fresh SQLite file, kept while the returned directory lives.
#[cfg(test)]
pub(crate) async fn test_sqlite() -> (tempfile::TempDir, LedgerStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/ledger.db", dir.path().display());
    (dir, LedgerStore::connect(&url, 4, SigningKey::from_bytes(&[7; 32])).await.expect("store"))
}

/// A plain event of run `run` (tenant `t`, epoch 1) with idempotency key `key`.
#[cfg(test)]
pub(crate) fn test_note(run: &str, key: &str) -> OwnedEvent {
    OwnedEvent {
        tenant: "t".into(),
        run_id: run.into(),
        epoch: 1,
        idempotency_key: key.into(),
        event_type: "run_started".into(),
        payload: serde_json::json!({ "note": key }),
        step_id: String::new(),
        now_ms: 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    use super::test_note as note;

    /// A stored head's MAC is keyed by the ledger's key: another key's MAC, or an unkeyed
    /// digest, of the same head does not verify, and nothing is signed on it.
    #[tokio::test]
    async fn a_heads_mac_is_the_ledgers_own() {
        let (_dir, store) = test_sqlite().await;
        let (_other_dir, other) = {
            let dir = tempfile::tempdir().expect("temp dir");
            let url = format!("sqlite://{}/ledger.db", dir.path().display());
            (dir, LedgerStore::connect(&url, 4, SigningKey::from_bytes(&[8; 32])).await.expect("store"))
        };
        let mut run = RunRow {
            run_id: "r".into(),
            tenant: "t".into(),
            status: RunStatus::Active,
            reason: String::new(),
            plan_json: String::new(),
            goal: String::new(),
            cancel_policy: 0,
            last_seq: 3,
            head_hash: "ab".repeat(32),
            max_epoch: 1,
            created_at_ms: 1,
            updated_at_ms: 1,
            head_signature: store.head_mac("r", 3, &"ab".repeat(32)),
            head_key_id: store.key_id.clone(),
            head_proof: PROOF_MAC.into(),
        };
        assert!(store.head_proof_verifies(&run));
        let (signature, _) = store.signed_head(&run).expect("signed");
        let head = Head { run_id: "r".into(), seq: 3, hash: "ab".repeat(32) };
        assert!(head.verify(&hex::decode(signature).expect("hex"), &store.verifying_key()));
        let unkeyed = warden_core::canonical::sha256_hex(warden_core::canonical_json(&head).as_bytes());
        for forged in [other.head_mac("r", 3, &"ab".repeat(32)), unkeyed, "zz".into()] {
            run.head_signature = forged;
            assert!(!store.head_proof_verifies(&run), "{}", run.head_signature);
            assert!(matches!(store.signed_head(&run), Err(LedgerError::DataLoss(_))));
        }
        run.head_signature = store.head_mac("r", 4, &"ab".repeat(32));
        assert!(!store.head_proof_verifies(&run), "the MAC of another head");
        run.head_proof = "other".into();
        run.head_signature = store.head_mac("r", 3, &"ab".repeat(32));
        assert!(!store.head_proof_verifies(&run) && store.signed_head(&run).is_err(), "an unknown mark");
    }

    /// A root run of tenant `t`, started by an executor at epoch 1.
    fn new_run<'a>(run_id: &'a str, plan: &'a serde_json::Value) -> NewRun<'a> {
        test_run(run_id, "", plan)
    }

    /// Whether each event of each group was a repeat, or the group's refusal.
    fn repeats(results: Vec<crate::group::GroupResult>) -> Vec<Result<Vec<bool>, String>> {
        results
            .into_iter()
            .map(|r| r.map(|g| g.into_iter().map(|(_, dup)| dup).collect()).map_err(|e| e.to_string()))
            .collect()
    }

    /// SQLite commits a batch decided from memory in place; a batch that finds another
    /// writer holding the file's lock writes nothing in place, and is written whole through the
    /// pool once the lock is free; the next batch is in place again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_batches_commit_in_place_and_wait_behind_another_writer() {
        let (dir, store) = test_sqlite().await;
        let plan = json!({ "steps": [] });
        store.create_run(new_run("a", &plan)).await.expect("created");
        assert_eq!(repeats(store.append_groups(vec![vec![note("a", "n1")]]).await), [Ok(vec![false])]);
        let (written, deferred) = store.in_place_counts();
        assert_eq!((written, deferred), (1, 0), "the append was committed in place");

        // Another process's writer holds SQLite's write lock.
        let other = rusqlite::Connection::open(dir.path().join("ledger.db")).expect("second connection");
        other.execute_batch("BEGIN IMMEDIATE").expect("the lock");
        let appending = {
            let store = store.clone();
            tokio::spawn(async move { store.append_groups(vec![vec![note("a", "n2")]]).await })
        };
        let waited = std::time::Instant::now();
        while store.in_place_counts().1 == 0 {
            assert!(waited.elapsed() < Duration::from_secs(30), "the append never found the lock held");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(!appending.is_finished(), "written while another writer held the lock");
        other.execute_batch("COMMIT").expect("released");
        assert_eq!(repeats(appending.await.expect("joined")), [Ok(vec![false])]);
        assert_eq!(store.in_place_counts(), (1, 1), "written through the pool");

        assert_eq!(repeats(store.append_groups(vec![vec![note("a", "n3")]]).await), [Ok(vec![false])]);
        assert_eq!(store.in_place_counts(), (2, 1), "in place again");
        // One chain, each event once, in order, linked.
        let events = store.events("a", 0, 100).await.expect("events");
        let keys: Vec<&str> = events.iter().map(|e| e.body.idempotency_key.as_str()).collect();
        assert_eq!(keys.iter().filter(|k| k.starts_with('n')).copied().collect::<Vec<_>>(), ["n1", "n2", "n3"]);
        for (i, pair) in events.windows(2).enumerate() {
            assert_eq!(pair[1].body.seq, pair[0].body.seq + 1, "contiguous at {i}");
            assert_eq!(pair[1].prev_hash, pair[0].hash, "linked at {i}");
        }
        // The stored head is the last event's, signed as the pooled path signs it.
        let head = store.get_run("a").await.expect("read").expect("the run");
        assert_eq!(
            (head.last_seq, head.head_hash.as_str()),
            (events.last().expect("events").body.seq, events.last().expect("events").hash.as_str())
        );
    }

    /// Only a database file opened read-write with no other option is written in place, and
    /// it is the file the pool has open, named as SQLite names it, whatever the URL's spelling.
    #[tokio::test]
    async fn only_a_file_opened_plainly_is_written_in_place() {
        for url in [
            "sqlite::memory:",
            "sqlite://file::memory:?cache=shared",
            "sqlite://x.db?mode=ro",
            "sqlite://x.db?mode=rwc&immutable=1",
            "sqlite://x.db?mode=rwc&vfs=unix-dotfile",
        ] {
            assert!(!inplace::InPlace::eligible(&sqlite_url(url).expect("url")), "{url}");
        }
        let dir = tempfile::tempdir().expect("temp dir");
        for url in [
            format!("sqlite://{}/a.db", dir.path().display()),
            format!("sqlite:{}/b.db?mode=rwc", dir.path().display()),
        ] {
            assert!(inplace::InPlace::eligible(&sqlite_url(&url).expect("url")), "{url}");
            let store = LedgerStore::connect(&url, 2, SigningKey::from_bytes(&[7; 32])).await.expect("store");
            let plan = json!({ "steps": [] });
            store.create_run(new_run("r", &plan)).await.expect("created");
            assert_eq!(repeats(store.append_groups(vec![vec![note("r", "n1")]]).await), [Ok(vec![false])]);
            assert_eq!(store.in_place_counts(), (1, 0), "{url}: in place");
        }
    }

    #[tokio::test]
    async fn a_batch_reads_only_the_runs_memory_cannot_answer() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}/ledger.db", dir.path().display());
        let store = LedgerStore::connect(&url, 4, SigningKey::from_bytes(&[7; 32])).await.expect("store");
        let plan = json!({ "steps": [] });
        for run_id in ["a", "b", "c"] {
            store.create_run(new_run(run_id, &plan)).await.expect("created");
        }
        let batch = store.append_groups(vec![vec![note("a", "n1")], vec![note("b", "n1")]]).await;
        assert_eq!(repeats(batch), [Ok(vec![false]), Ok(vec![false])]);
        assert_eq!(store.runs_read(), 0, "runs just created are in memory");

        // A run the batch only repeats an event of is checked against its stored head (nothing
        // new of it is written to check memory against); the other run is decided from memory.
        let batch = store.append_groups(vec![vec![note("a", "n1")], vec![note("b", "n2")]]).await;
        assert_eq!(repeats(batch), [Ok(vec![true]), Ok(vec![false])]);
        // A repeat beside something new of the same run is answered from memory: the new
        // event's head write is conditional on the state the repeat was answered from.
        let batch = store.append_groups(vec![vec![note("a", "n1"), note("a", "n3")], vec![note("b", "n2")]]).await;
        assert_eq!(repeats(batch), [Ok(vec![true, false]), Ok(vec![true])]);
        assert_eq!(store.runs_read(), 0, "every stored head was the one memory held");

        // Another replica appends to a: this one's memory of a is behind. A batch only
        // repeating an event of a reads a whole, and its next append follows the other's.
        let replica = LedgerStore::connect(&url, 4, SigningKey::from_bytes(&[7; 32])).await.expect("replica");
        let batch = replica.append_groups(vec![vec![note("a", "n6")]]).await;
        assert_eq!(repeats(batch), [Ok(vec![false])]);
        let batch = store.append_groups(vec![vec![note("a", "n3")], vec![note("b", "n7")]]).await;
        assert_eq!(repeats(batch), [Ok(vec![true]), Ok(vec![false])]);
        assert_eq!(store.runs_read(), 1, "a, moved on under the replica, was read; b was not");
        let batch = store.append_groups(vec![vec![note("a", "n8")]]).await;
        assert_eq!(repeats(batch), [Ok(vec![false])]);
        assert_eq!(store.runs_read(), 1, "a is in memory again, with the replica's event");

        // A refusal sends the whole batch to the stored heads: every group still gets its
        // own answer, and nothing of the refused group is written.
        let mut other_tenant = note("b", "n4");
        other_tenant.tenant = "u".into();
        let batch = store.append_groups(vec![vec![note("a", "n5")], vec![note("b", "n5"), other_tenant]]).await;
        let answers = repeats(batch);
        assert_eq!(answers[0], Ok(vec![false]));
        assert!(answers[1].is_err(), "another tenant's event refuses its group: {answers:?}");

        // A request repeated by an executor another replica fenced out gets no answer: memory
        // here still says epoch 1, the stored head says 2, and the repeat is decided on it.
        let digest = warden_core::canonical::args_digest(&json!({}));
        let call = json!({ "attempt": 1, "tool": "echo", "idempotency_key": "k1" });
        let mut decision = note("a", "decision:d1");
        decision.event_type = "policy_decision".into();
        decision.step_id = "s1".into();
        decision.payload = json!({ "decision_id": "d1", "outcome": "allow", "args_sha256": digest });
        let mut request = note("a", "request:s1:1");
        request.event_type = "tool_requested".into();
        request.step_id = "s1".into();
        request.payload = json!({ "decision_id": "d1", "args": {} });
        for e in [&mut decision, &mut request] {
            for (k, v) in call.as_object().expect("object") {
                e.payload[k] = v.clone();
            }
        }
        let batch = store.append_groups(vec![vec![decision, request.clone()]]).await;
        assert_eq!(repeats(batch), [Ok(vec![false, false])]);
        let mut takeover = note("a", "n9");
        takeover.epoch = 2;
        assert_eq!(repeats(replica.append_groups(vec![vec![takeover]]).await), [Ok(vec![false])]);
        let answers = repeats(store.append_groups(vec![vec![request]]).await);
        assert!(
            matches!(&answers[..], [Err(e)] if e.contains("epoch")),
            "a stale repeat of a request is fenced: {answers:?}"
        );

        // The replica appends to b, and this one, its memory of b behind, appends something
        // new: its head write finds b moved on, writes nothing, and the append is decided
        // again on b's stored head, after the replica's event.
        assert_eq!(repeats(replica.append_groups(vec![vec![note("b", "n10")]]).await), [Ok(vec![false])]);
        let read_before = store.runs_read();
        assert_eq!(repeats(store.append_groups(vec![vec![note("b", "n11")]]).await), [Ok(vec![false])]);
        assert_eq!(store.runs_read(), read_before + 1, "b was read again after its head moved");

        // Two runs in one batch, only the second moved on under the replica: the first run's
        // head and event, written before the second's head write found nothing to change,
        // are rolled back with it, and the batch decided again writes each once.
        assert_eq!(repeats(replica.append_groups(vec![vec![note("b", "n12")]]).await), [Ok(vec![false])]);
        let read_before = store.runs_read();
        let batch = store.append_groups(vec![vec![note("c", "n1")], vec![note("b", "n13")]]).await;
        assert_eq!(repeats(batch), [Ok(vec![false]), Ok(vec![false])]);
        assert!(store.runs_read() > read_before, "b was read again after its head moved");

        let a_keys = vec!["n1", "n3", "n6", "n8", "n5", "decision:d1", "request:s1:1", "n9"];
        let b_keys = vec!["n1", "n2", "n7", "n10", "n11", "n12", "n13"];
        for (run, keys) in [("a", a_keys), ("b", b_keys), ("c", vec!["n1"])] {
            let events = store.events(run, 0, 100).await.expect("events");
            let notes: Vec<&str> = events.iter().skip(2).map(|e| e.body.idempotency_key.as_str()).collect();
            assert_eq!(notes, keys, "run {run}: each note once, in order");
            for (i, e) in events.iter().enumerate() {
                assert_eq!(e.body.seq, i as u64 + 1, "run {run}: contiguous");
            }
            for pair in events.windows(2) {
                assert_eq!(pair[1].prev_hash, pair[0].hash, "run {run}: chained");
            }
        }
    }

    /// A batch that only repeats a run's policy decisions answers them from memory even when
    /// memory is behind the stored head: a recorded decision is the same event whatever was
    /// appended since, and no authority rides on its answer (a request's repeat, which
    /// carries an acknowledgement, is still checked against the stored head, above).
    #[tokio::test]
    async fn a_batch_repeating_only_decisions_is_answered_from_memory() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}/ledger.db", dir.path().display());
        let store = LedgerStore::connect(&url, 4, SigningKey::from_bytes(&[7; 32])).await.expect("store");
        let plan = json!({ "steps": [] });
        for run_id in ["a", "b"] {
            store.create_run(new_run(run_id, &plan)).await.expect("created");
        }
        let mut decision = note("a", "decision:d1");
        decision.event_type = "policy_decision".into();
        decision.step_id = "s1".into();
        decision.payload = json!({ "decision_id": "d1", "outcome": "deny", "attempt": 1, "tool": "echo" });
        let first = store.append_groups(vec![vec![decision.clone()]]).await.remove(0).expect("recorded");
        // Another replica appends to a, at a later epoch: memory here is behind.
        let replica = LedgerStore::connect(&url, 4, SigningKey::from_bytes(&[7; 32])).await.expect("replica");
        let mut takeover = note("a", "n1");
        takeover.epoch = 2;
        assert_eq!(repeats(replica.append_groups(vec![vec![takeover]]).await), [Ok(vec![false])]);

        let read_before = store.runs_read();
        let mut batch = store.append_groups(vec![vec![decision.clone()], vec![note("b", "n1")]]).await;
        let answered = batch.remove(0).expect("the repeat answered");
        assert!(answered[0].1, "as a repeat");
        assert_eq!(answered[0].0, first[0].0, "the recorded decision, as stored");
        assert_eq!(repeats(batch), [Ok(vec![false])]);
        assert_eq!(store.runs_read(), read_before, "a was not read to answer it");
        // The same decision with other content is still refused.
        let mut altered = decision;
        altered.payload["outcome"] = json!("allow");
        let answers = repeats(store.append_groups(vec![vec![altered]]).await);
        assert!(matches!(&answers[..], [Err(_)]), "{answers:?}");
        let keys: Vec<String> =
            store.events("a", 0, 100).await.expect("events").into_iter().map(|e| e.body.idempotency_key).collect();
        assert_eq!(keys.iter().filter(|k| *k == "decision:d1").count(), 1, "{keys:?}");

        // Memory of a, still behind (epoch 1), is caught by a's next new event: its head write
        // finds the head moved, and it is decided again on the stored head — where epoch 1 is
        // fenced out and epoch 2 appends after the replica's event.
        let answers = repeats(store.append_groups(vec![vec![note("a", "stale")]]).await);
        assert!(matches!(&answers[..], [Err(e)] if e.contains("epoch")), "{answers:?}");
        assert!(store.runs_read() > read_before, "a was read once its head was found moved");
        let mut current = note("a", "n2");
        current.epoch = 2;
        assert_eq!(repeats(store.append_groups(vec![vec![current]]).await), [Ok(vec![false])]);
        let events = store.events("a", 0, 100).await.expect("events");
        let tail: Vec<&str> = events.iter().skip(2).map(|e| e.body.idempotency_key.as_str()).collect();
        assert_eq!(tail, ["decision:d1", "n1", "n2"]);
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e.body.seq, i as u64 + 1, "contiguous");
        }
        for pair in events.windows(2) {
            assert_eq!(pair[1].prev_hash, pair[0].hash, "chained");
        }
    }

    /// An acknowledgement signed ahead is handed out only for the tenant and the exact event
    /// it was signed for, once; any other answer is signed afresh.
    #[tokio::test]
    async fn an_acknowledgement_signed_ahead_is_taken_only_for_its_own_event() {
        let (_dir, store) = test_sqlite().await;
        let request = |hash: &str| ChainedEvent {
            body: EventBody {
                run_id: "r".into(),
                seq: 3,
                event_type: events::TOOL_REQUESTED.into(),
                payload: json!({"decision_id": "d", "attempt": 1, "idempotency_key": "r:s:1"}),
                step_id: "s".into(),
                epoch: 1,
                idempotency_key: "r:s:1:requested".into(),
                timestamp_ms: 2,
            },
            prev_hash: "p".into(),
            hash: hash.into(),
        };
        let (ours, other) = (request("h1"), request("h2"));
        let ahead = |tenant: &str, e: &ChainedEvent| {
            let p = Presigned { tenant: tenant.into(), hash: e.hash.clone(), ack: store.sign_ack(tenant, e) };
            store.keep_presigned(vec![(("r".into(), 3), p)]);
        };
        // Signed ahead for another event at the same place (a write that did not commit).
        ahead("t", &other);
        assert_eq!(store.acknowledge("t", &ours), store.sign_ack("t", &ours));
        // Signed ahead for another tenant.
        ahead("u", &ours);
        let taken = store.acknowledge("t", &ours);
        assert_eq!(taken, store.sign_ack("t", &ours));
        assert_ne!(taken, store.sign_ack("u", &ours));
        // Its own: taken once, then gone.
        ahead("t", &ours);
        assert_eq!(store.presigned.lock().expect("lock").len(), 1);
        assert_eq!(store.acknowledge("t", &ours), store.sign_ack("t", &ours));
        assert!(store.presigned.lock().expect("lock").is_empty());
    }

    /// SQLite commits a batch decided from memory in the same query as its writes; a head
    /// that moved under it must stop that query before `COMMIT` even when nothing else would
    /// fail (here the head moved without an event at the seq the batch writes), and leave no
    /// transaction open.
    #[tokio::test]
    async fn a_batch_whose_head_moved_commits_nothing() {
        let (_dir, store) = test_sqlite().await;
        let plan = json!({ "steps": [] });
        store.create_run(new_run("a", &plan)).await.expect("created");
        assert_eq!(repeats(store.append_groups(vec![vec![note("a", "n1")]]).await), [Ok(vec![false])]);
        let before = store.events("a", 0, 100).await.expect("events");
        // Another writer moved the stored head on (memory here still holds the old one).
        sqlx::query("UPDATE runs SET last_seq = last_seq + 5 WHERE run_id = 'a'")
            .execute(store.pool())
            .await
            .expect("moved");
        let read_before = store.runs_read();
        assert_eq!(repeats(store.append_groups(vec![vec![note("a", "n2")]]).await), [Ok(vec![false])]);
        assert_eq!(store.runs_read(), read_before + 1, "decided again on the stored head");
        let events = store.events("a", 0, 100).await.expect("events");
        let n2: Vec<u64> = events.iter().filter(|e| e.body.idempotency_key == "n2").map(|e| e.body.seq).collect();
        let last = before.last().expect("an event").body.seq;
        assert_eq!(n2, [last + 6], "written once, after the moved head; nothing at {}", last + 1);
        assert_eq!(events.len(), before.len() + 1);
        // No transaction was left open: the next batch commits.
        assert_eq!(repeats(store.append_groups(vec![vec![note("a", "n3")]]).await), [Ok(vec![false])]);
        let events = store.events("a", 0, 100).await.expect("events");
        assert_eq!(events.last().expect("an event").body.seq, last + 7);

        // Two runs in one batch, the second's head moved: the first's write and guard pass,
        // the second's guard stops the query, and neither run's event is committed by it.
        store.create_run(new_run("b", &plan)).await.expect("created");
        assert_eq!(repeats(store.append_groups(vec![vec![note("b", "n1")]]).await), [Ok(vec![false])]);
        let b_last = store.events("b", 0, 100).await.expect("events").last().expect("an event").body.seq;
        sqlx::query("UPDATE runs SET last_seq = last_seq + 5 WHERE run_id = 'b'")
            .execute(store.pool())
            .await
            .expect("moved");
        let read_before = store.runs_read();
        let batch = store.append_groups(vec![vec![note("a", "n4")], vec![note("b", "n2")]]).await;
        assert_eq!(repeats(batch), [Ok(vec![false]), Ok(vec![false])]);
        assert!(store.runs_read() > read_before, "decided again on the stored heads");
        let seq_of = |events: &[ChainedEvent], key: &str| -> Vec<u64> {
            events.iter().filter(|e| e.body.idempotency_key == key).map(|e| e.body.seq).collect()
        };
        assert_eq!(seq_of(&store.events("a", 0, 100).await.expect("events"), "n4"), [last + 8], "a: once, next");
        assert_eq!(seq_of(&store.events("b", 0, 100).await.expect("events"), "n2"), [b_last + 6], "b: once, after");
    }

    #[test]
    fn sqlite_urls_get_create_mode() {
        let dir = std::env::temp_dir().join(format!("warden-url-{}", std::process::id()));
        let url = format!("sqlite://{}/x.db", dir.display());
        assert!(sqlite_url(&url).unwrap().ends_with("x.db?mode=rwc"));
        assert!(sqlite_url("sqlite::memory:").unwrap().contains("mode=rwc"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
