//! SQLite (`warden dev` and single-node ledgers): a batch decided wholly from memory is
//! committed on the calling thread, through a connection of the ledger's own (rusqlite),
//! instead of being handed to sqlx's worker thread.
//!
//! sqlx runs every SQLite query on its connection's worker thread: even the whole batch sent
//! as one query ([`super::batch::write_committed`]) is a hand-over to that thread and a
//! wake-up back, two thread switches on every step's path (BENCHMARKS.md, 2026-12-02 "in
//! place"). Here the same statements — each run's conditional head write, the events, the
//! receipts — run in one `BEGIN IMMEDIATE` transaction where the batch was decided.
//!
//! Why this cannot make the ledger wrong or hold others up:
//! - **Same statements, same file, same durability.** The head write is the one of the pooled
//!   path (conditional on the stored `last_seq`; a head that changed no row is `Moved`, and
//!   the transaction is rolled back unwritten). The connection uses WAL and
//!   `synchronous=NORMAL`, as the pool's connections do.
//! - **Never waits on another writer.** The connection's busy timeout is zero: when another
//!   connection (the pool's, another ledger on the file) holds SQLite's write lock, `BEGIN
//!   IMMEDIATE` fails at once, nothing is written, and the batch takes the pooled path, which
//!   waits for the lock on sqlx's thread. Inside the transaction the lock is already held.
//! - **One writer at a time.** The connection sits behind a mutex taken without waiting (a
//!   SQLite ledger has one write lane, so it is free); a batch that finds it taken goes the
//!   pooled way.
//! - **A connection in doubt is dropped.** Any failure other than a moved head or a busy lock
//!   closes the connection (the next batch opens another), and so does one still inside a
//!   transaction after either (rusqlite rolls back a transaction dropped unfinished, but does
//!   not report a rollback that failed): an open transaction never survives a batch.
//!
//! What is left on the caller's thread: the statements and SQLite's write of its WAL frames
//! (no fsync at commit with `synchronous=NORMAL`), and now and then SQLite's automatic
//! checkpoint, which copies the WAL into the database file and syncs it — a few
//! milliseconds every thousand pages (about 250 steps), as any connection that commits does.
//! Which file: the one the pool has open, as SQLite names it (`pragma_database_list`, an
//! absolute path), so the two connections cannot differ on how a URL spells it. The pooled
//! path stays the only one for an in-memory database (private to each connection, or shared
//! only under its URI name), and for a URL with options beyond `mode=rw`/`rwc` (`mode=ro`,
//! `immutable`, `vfs`, …), which a plain read-write open would not honour.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, TryLockError};

use rusqlite::{Connection, ErrorCode, OpenFlags, TransactionBehavior, params};

use super::LedgerStore;
use super::batch::{Decided, UPDATE_HEAD_ANONYMOUS, anonymous_marks, insert_events_with, insert_receipts_with, moved};
use crate::error::LedgerError;

/// The pooled path's `INSERT`s of one row each, prepared once per connection (the values are
/// bound in the order of `batch::bind_event` and `batch::bind_receipt`).
static INSERT_EVENT: LazyLock<String> = LazyLock::new(|| insert_events_with(&anonymous_marks(1, 10)));
static INSERT_RECEIPT: LazyLock<String> = LazyLock::new(|| insert_receipts_with(&anonymous_marks(1, 8)));

/// The ledger's own connection to its SQLite file, for batches committed in place.
pub struct InPlace {
    path: PathBuf,
    conn: Mutex<Option<Connection>>,
    /// Set when the file could not be opened in place: the pool writes from then on (one
    /// warning, not one per batch).
    unopenable: AtomicBool,
    written: AtomicU64,
    deferred: AtomicU64,
}

/// What an in-place write came to.
pub enum Written {
    /// Committed (or refused: the error is the batch's answer).
    Done,
    /// Nothing was written: another writer holds the lock, or the connection is busy or could
    /// not be opened. The batch is to be written the pooled way.
    Deferred,
}

impl InPlace {
    /// Whether a SQLite URL, as [`super::sqlite_url`] spells it, may be written in place:
    /// no options but the read-write mode (see the module's doc).
    pub fn eligible(url: &str) -> bool {
        let Some(rest) = url.strip_prefix("sqlite://") else { return false };
        let (file, query) = rest.split_once('?').unwrap_or((rest, ""));
        !file.is_empty()
            && !file.starts_with("file:")
            && file != ":memory:"
            && query.split('&').filter(|o| !o.is_empty()).all(|o| o == "mode=rw" || o == "mode=rwc")
    }

    /// For the database file SQLite names `file` (the pool's `main` database); none for an
    /// in-memory or temporary one (an empty name).
    pub fn at(file: &str) -> Option<InPlace> {
        (!file.is_empty()).then(|| InPlace {
            path: PathBuf::from(file),
            conn: Mutex::new(None),
            unopenable: AtomicBool::new(false),
            written: AtomicU64::new(0),
            deferred: AtomicU64::new(0),
        })
    }

    /// Batches committed in place, and batches written the pooled way instead (the file's
    /// lock held, SQLite busy, the connection unavailable), since start.
    pub fn counts(&self) -> (u64, u64) {
        (self.written.load(Ordering::Relaxed), self.deferred.load(Ordering::Relaxed))
    }

    fn open(&self) -> rusqlite::Result<Connection> {
        // The file exists: the pool created it and ran the migrations before any append.
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(std::time::Duration::ZERO)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        Ok(conn)
    }

    /// Writes what `d` decided in one transaction on this thread, or defers it (see
    /// [`Written`]). Heads are proven here (their MACs), as the pooled path proves them.
    pub fn write(&self, store: &LedgerStore, d: &Decided) -> Result<Written, LedgerError> {
        if self.unopenable.load(Ordering::Relaxed) {
            return Ok(self.defer());
        }
        let mut slot = match self.conn.try_lock() {
            Ok(slot) => slot,
            Err(TryLockError::WouldBlock) => return Ok(self.defer()),
            // A batch panicked holding it: its transaction was rolled back as it unwound, but
            // the connection is not trusted again.
            Err(TryLockError::Poisoned(p)) => {
                let mut slot = p.into_inner();
                *slot = None;
                self.conn.clear_poison();
                slot
            }
        };
        let conn = match &mut *slot {
            Some(conn) => conn,
            empty => match self.open() {
                Ok(conn) => empty.insert(conn),
                Err(e) => {
                    self.unopenable.store(true, Ordering::Relaxed);
                    tracing::warn!(error = %e, path = %self.path.display(), "cannot open the ledger's file in place; writing through the pool");
                    return Ok(self.defer());
                }
            },
        };
        let outcome = commit(store, conn, d);
        if outcome.is_err() && !conn.is_autocommit() {
            // Its rollback failed (rusqlite ignores that when a transaction is dropped): the
            // connection may still hold the file's lock. Closing it lets go of both.
            *slot = None;
        }
        match outcome {
            Ok(()) => {
                self.written.fetch_add(1, Ordering::Relaxed);
                Ok(Written::Done)
            }
            Err(Failed::Busy) => Ok(self.defer()),
            Err(Failed::Moved(run_id)) => Err(moved(&run_id)),
            Err(Failed::Db(e)) => {
                // Whatever state the connection is in, it is not used again. Answered as the
                // pooled path answers a failure of the file (a full disk, a damaged file, a
                // constraint the checks in memory should have caught): internal.
                *slot = None;
                Err(LedgerError::Internal(format!("ledger database: {e}")))
            }
        }
    }

    fn defer(&self) -> Written {
        self.deferred.fetch_add(1, Ordering::Relaxed);
        Written::Deferred
    }
}

enum Failed {
    /// The lock was held by another writer (or SQLite answered busy later in the
    /// transaction): nothing was written.
    Busy,
    /// This run's head changed no row: another writer moved it. Rolled back.
    Moved(String),
    Db(rusqlite::Error),
}

impl From<rusqlite::Error> for Failed {
    /// A busy or locked answer at any point of the transaction (SQLite may give one while it
    /// recovers a WAL another process left) commits nothing: the transaction is rolled back
    /// when dropped, and the batch is written the pooled way.
    fn from(e: rusqlite::Error) -> Failed {
        if is_busy(&e) { Failed::Busy } else { Failed::Db(e) }
    }
}

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(e.sqlite_error_code(), Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked))
}

/// The transaction of [`InPlace::write`]. Dropped unfinished (any `?`), rusqlite rolls it back.
fn commit(store: &LedgerStore, conn: &mut Connection, d: &Decided) -> Result<(), Failed> {
    // Heads proven before the file's lock is taken, so that it is held only for the writes.
    let heads: Vec<_> =
        d.touched.iter().filter_map(|run| d.states.get(run)).map(|st| (st, store.prove_head(st))).collect();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        // In the order of `batch::bind_head_columns`, then the run and its stored seq.
        let mut head = tx.prepare_cached(UPDATE_HEAD_ANONYMOUS)?;
        for (st, proof) in &heads {
            let h = &st.head;
            let changed = head.execute(params![
                h.last_seq as i64,
                h.head_hash,
                h.max_epoch as i64,
                h.status,
                h.reason,
                h.updated_at_ms,
                proof.signature,
                proof.key_id,
                proof.kind,
                h.run_id,
                st.stored_seq as i64,
            ])?;
            if changed != 1 {
                return Err(Failed::Moved(h.run_id.clone()));
            }
        }
        let mut event = tx.prepare_cached(&INSERT_EVENT)?;
        for e in &d.events {
            event.execute(params![
                e.body.run_id,
                e.body.seq as i64,
                e.body.event_type,
                warden_core::canonical::canonical_value(&e.body.payload),
                e.body.step_id,
                e.body.epoch as i64,
                e.body.idempotency_key,
                e.body.timestamp_ms,
                e.prev_hash,
                e.hash,
            ])?;
        }
        let mut receipt = tx.prepare_cached(&INSERT_RECEIPT)?;
        for r in &d.receipts {
            receipt.execute(params![
                r.receipt_id,
                r.run_id,
                r.step_id,
                r.attempt as i64,
                r.seq as i64,
                warden_core::canonical_json(r),
                r.status,
                r.hash,
            ])?;
        }
    }
    tx.commit()?;
    Ok(())
}
