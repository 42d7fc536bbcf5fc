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
//!   closes the connection (the next batch opens another); an open transaction never
//!   survives a batch (rusqlite rolls back one dropped unfinished).
//!
//! What is left on the caller's thread: the statements and SQLite's write of its WAL frames
//! (no fsync at commit with `synchronous=NORMAL`), and now and then SQLite's automatic
//! checkpoint, which copies the WAL into the database file and syncs it — a few
//! milliseconds every thousand pages (about 250 steps), as any connection that commits does.
//! An in-memory database (`sqlite::memory:`) is private to the connection that opened it,
//! and a URL with percent-escapes names a file only sqlx decodes: both keep the pooled path.

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use rusqlite::{Connection, ErrorCode, OpenFlags, TransactionBehavior, params};

use super::LedgerStore;
use super::batch::{Decided, UPDATE_HEAD_ANONYMOUS, moved};
use crate::error::LedgerError;

const INSERT_EVENT: &str = "INSERT INTO events (run_id, seq, event_type, payload_json, step_id, epoch, idempotency_key, timestamp_ms, prev_hash, hash)
 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";
const INSERT_RECEIPT: &str = "INSERT INTO receipts (receipt_id, run_id, step_id, attempt, seq, body_json, status, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?)";

/// The ledger's own connection to its SQLite file, for batches committed in place.
pub struct InPlace {
    path: PathBuf,
    conn: Mutex<Option<Connection>>,
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
    /// For the database of a SQLite URL as [`super::sqlite_url`] spells it, when it is a file
    /// this process can open by name.
    pub fn for_url(url: &str) -> Option<InPlace> {
        let rest = url.strip_prefix("sqlite://")?;
        let (file, query) = rest.split_once('?').unwrap_or((rest, ""));
        if file.is_empty() || file == ":memory:" || file.contains('%') || query.contains("mode=memory") {
            return None;
        }
        Some(InPlace {
            path: PathBuf::from(file),
            conn: Mutex::new(None),
            written: AtomicU64::new(0),
            deferred: AtomicU64::new(0),
        })
    }

    /// Batches committed in place, and batches that found the file's lock held and were
    /// written the pooled way, since start.
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
    /// [`Written`]). Heads are signed here, as the pooled path signs them.
    pub fn write(&self, store: &LedgerStore, d: &Decided) -> Result<Written, LedgerError> {
        let Ok(mut slot) = self.conn.try_lock() else {
            return Ok(self.defer());
        };
        if slot.is_none() {
            match self.open() {
                Ok(conn) => *slot = Some(conn),
                Err(e) => {
                    tracing::warn!(error = %e, path = %self.path.display(), "cannot open the ledger's file in place; writing through the pool");
                    return Ok(self.defer());
                }
            }
        }
        let Some(conn) = slot.as_mut() else { return Ok(self.defer()) };
        match commit(store, conn, d) {
            Ok(()) => {
                self.written.fetch_add(1, Ordering::Relaxed);
                Ok(Written::Done)
            }
            Err(Failed::Busy) => Ok(self.defer()),
            Err(Failed::Moved(run_id)) => Err(moved(&run_id)),
            Err(Failed::Db(e)) => {
                // Whatever state the connection is in, it is not used again.
                *slot = None;
                Err(storage(e))
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

/// A failure of the file itself: the same answers as the pooled path's (a full disk, a
/// constraint the checks in memory should have caught, a damaged file).
fn storage(e: rusqlite::Error) -> LedgerError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DiskFull | ErrorCode::SystemIoFailure | ErrorCode::CannotOpen | ErrorCode::ReadOnly) => {
            LedgerError::Unavailable(format!("ledger database: {e}"))
        }
        _ => LedgerError::Internal(format!("ledger database: {e}")),
    }
}

/// The transaction of [`InPlace::write`]. Dropped unfinished (any `?`), rusqlite rolls it back.
fn commit(store: &LedgerStore, conn: &mut Connection, d: &Decided) -> Result<(), Failed> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let mut head = tx.prepare_cached(UPDATE_HEAD_ANONYMOUS)?;
        for run in &d.touched {
            let Some(st) = d.states.get(run) else { continue };
            let h = &st.head;
            let (signature, key_id) = store.sign_head(&h.run_id, h.last_seq, &h.head_hash);
            let changed = head.execute(params![
                h.last_seq as i64,
                h.head_hash,
                h.max_epoch as i64,
                h.status,
                h.reason,
                h.updated_at_ms,
                signature,
                key_id,
                h.run_id,
                st.stored_seq as i64,
            ])?;
            if changed != 1 {
                return Err(Failed::Moved(h.run_id.clone()));
            }
        }
        let mut event = tx.prepare_cached(INSERT_EVENT)?;
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
        let mut receipt = tx.prepare_cached(INSERT_RECEIPT)?;
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
