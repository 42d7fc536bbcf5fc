//! Run leases with fencing epochs.
//!
//! A run is driven by at most one executor at a time: the one holding its lease. Acquiring
//! a lease increments the run's **fencing epoch**; every ledger write carries it and the
//! ledger refuses writes below the highest epoch it has seen, so a holder that paused past
//! its lease and woke up after a takeover cannot write (Kleppmann's fencing token).
//!
//! In Redis: `SET lease NX PX ttl` plus an `INCR`ed epoch in one Lua script; renewal is a
//! compare-and-pexpire, release a compare-and-delete. The in-process store has the same
//! semantics for a single executor (`warden dev`).
//!
//! Liveness: each executor also keeps a short-lived key of its own alive (refreshed several
//! times a second, see [`LeaseStore::heartbeat`]). A lease whose holder's liveness key is gone
//! counts as free — its holder died — so a successor takes the run over within the liveness
//! TTL instead of waiting out the lease TTL. A holder that was only paused loses nothing it
//! should keep: the takeover raises the epoch, so its late writes are fenced off.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Script;
use redis::aio::ConnectionManager;

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("lease store unavailable: {0}")]
    Unavailable(#[from] redis::RedisError),
}

/// A held lease: the proof of ownership used to renew and release it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunLease {
    pub run_id: String,
    pub owner: String,
    pub epoch: u64,
    token: String,
}

impl RunLease {
    fn new(run_id: &str, owner: &str, epoch: u64) -> RunLease {
        RunLease { run_id: run_id.into(), owner: owner.into(), epoch, token: format!("{owner}|{epoch}") }
    }
}

#[derive(Clone)]
pub enum LeaseStore {
    Redis(RedisLeases),
    Memory(MemoryLeases),
}

impl LeaseStore {
    /// Connects to Redis; an empty URL selects the in-process store.
    pub async fn connect(redis_url: &str) -> Result<LeaseStore, LeaseError> {
        if redis_url.is_empty() {
            return Ok(LeaseStore::Memory(MemoryLeases::default()));
        }
        Ok(LeaseStore::Redis(RedisLeases::connect(redis_url, "warden").await?))
    }

    /// Takes the lease if nobody holds it. The new epoch is above both every earlier epoch
    /// of this store and `min_epoch` (the highest epoch the ledger has seen), so fencing
    /// holds even if the store lost its counters.
    pub async fn acquire(
        &self,
        run_id: &str,
        owner: &str,
        ttl: Duration,
        min_epoch: u64,
    ) -> Result<Option<RunLease>, LeaseError> {
        match self {
            LeaseStore::Redis(r) => r.acquire(run_id, owner, ttl, min_epoch).await,
            LeaseStore::Memory(m) => Ok(m.acquire(run_id, owner, ttl, min_epoch)),
        }
    }

    /// Extends the lease; `false` means it was lost and the holder must stop.
    pub async fn renew(&self, lease: &RunLease, ttl: Duration) -> Result<bool, LeaseError> {
        match self {
            LeaseStore::Redis(r) => r.renew(lease, ttl).await,
            LeaseStore::Memory(m) => Ok(m.renew(lease, ttl)),
        }
    }

    /// Gives the lease up if still held by `lease`.
    pub async fn release(&self, lease: &RunLease) -> Result<(), LeaseError> {
        match self {
            LeaseStore::Redis(r) => r.release(lease).await,
            LeaseStore::Memory(m) => {
                m.release(lease);
                Ok(())
            }
        }
    }

    /// Whether someone currently holds the run's lease.
    pub async fn is_held(&self, run_id: &str) -> Result<bool, LeaseError> {
        match self {
            LeaseStore::Redis(r) => r.is_held(run_id).await,
            LeaseStore::Memory(m) => Ok(m.is_held(run_id)),
        }
    }

    /// Keeps `owner` alive for `ttl` (call every third of it). The in-process store needs no
    /// liveness: its only executor is the process itself.
    pub async fn heartbeat(&self, owner: &str, ttl: Duration) -> Result<(), LeaseError> {
        match self {
            LeaseStore::Redis(r) => r.heartbeat(owner, ttl).await,
            LeaseStore::Memory(_) => Ok(()),
        }
    }

    /// Whether other holders' missing liveness may free their leases (see [`RedisLeases`]).
    pub fn trust_liveness(&self, trusted: bool) {
        if let LeaseStore::Redis(r) = self {
            r.trust_liveness.store(trusted, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Says `owner` is gone at once (a clean shutdown), so nothing waits for its liveness.
    pub async fn depart(&self, owner: &str) -> Result<(), LeaseError> {
        match self {
            LeaseStore::Redis(r) => r.depart(owner).await,
            LeaseStore::Memory(_) => Ok(()),
        }
    }

    /// Tells whichever executor drives the run that it is to be cancelled or paused (the
    /// ledger's `run_cancel_requested` / `run_pause_requested` event is the durable record;
    /// this is the fast signal).
    pub async fn signal(&self, run_id: &str, signal: RunSignal) -> Result<(), LeaseError> {
        match self {
            LeaseStore::Redis(r) => r.signal(run_id, signal).await,
            LeaseStore::Memory(m) => {
                m.lock().signals.insert((run_id.to_string(), signal));
                Ok(())
            }
        }
    }

    /// Withdraws a signal (a paused run resumed: its driver is not to pause again).
    pub async fn clear_signal(&self, run_id: &str, signal: RunSignal) -> Result<(), LeaseError> {
        match self {
            LeaseStore::Redis(r) => r.clear_signal(run_id, signal).await,
            LeaseStore::Memory(m) => {
                m.lock().signals.remove(&(run_id.to_string(), signal));
                Ok(())
            }
        }
    }

    /// The signals standing for the run (one round trip).
    pub async fn signals(&self, run_id: &str) -> Result<Signals, LeaseError> {
        match self {
            LeaseStore::Redis(r) => r.signals(run_id).await,
            LeaseStore::Memory(m) => {
                let state = m.lock();
                let has = |s| state.signals.contains(&(run_id.to_string(), s));
                Ok(Signals { cancel: has(RunSignal::Cancel), pause: has(RunSignal::Pause) })
            }
        }
    }
}

/// What a run's driver may be told from elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunSignal {
    Cancel,
    Pause,
}

impl RunSignal {
    fn name(self) -> &'static str {
        match self {
            RunSignal::Cancel => "cancel",
            RunSignal::Pause => "pause",
        }
    }
}

/// The signals standing for a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Signals {
    pub cancel: bool,
    pub pause: bool,
}

/// How long a signal stays in Redis (the ledger keeps the request for good).
const SIGNAL_SECS: u64 = 7 * 24 * 3600;

/// A lease is free when missing, or when its holder's liveness key is gone (ARGV[4] is the
/// liveness key prefix, empty while liveness is not to be trusted; the holder is the lease
/// value before '|').
const ACQUIRE: &str = r"
local held = redis.call('GET', KEYS[1])
if held then
  if ARGV[4] == '' then return false end
  local holder = string.match(held, '^(.*)|')
  if holder and redis.call('EXISTS', ARGV[4] .. holder) == 1 then return false end
end
local epoch = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if epoch <= floor then
  epoch = floor + 1
  redis.call('SET', KEYS[2], epoch)
end
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. epoch, 'PX', ARGV[2])
return epoch
";

/// Whether a live holder has the lease.
const IS_HELD: &str = r"
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
if ARGV[1] == '' then return 1 end
local holder = string.match(held, '^(.*)|')
if holder and redis.call('EXISTS', ARGV[1] .. holder) == 1 then return 1 end
return 0
";

const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

#[derive(Clone)]
pub struct RedisLeases {
    conn: ConnectionManager,
    prefix: String,
    acquire: Arc<Script>,
    renew: Arc<Script>,
    release: Arc<Script>,
    is_held: Arc<Script>,
    /// Whether a missing liveness key may be read as a dead holder: only once this process's
    /// own heartbeats have gone through for a whole liveness TTL (after a Redis outage every
    /// key has lapsed, live holders' included, until they heartbeat again).
    trust_liveness: Arc<std::sync::atomic::AtomicBool>,
}

impl RedisLeases {
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisLeases, LeaseError> {
        let client = redis::Client::open(url)?;
        let conn = ConnectionManager::new(client).await?;
        Ok(RedisLeases {
            conn,
            prefix: prefix.to_string(),
            acquire: Arc::new(Script::new(ACQUIRE)),
            renew: Arc::new(Script::new(RENEW)),
            release: Arc::new(Script::new(RELEASE)),
            is_held: Arc::new(Script::new(IS_HELD)),
            trust_liveness: Arc::default(),
        })
    }

    fn alive_prefix(&self) -> String {
        format!("{}:alive:", self.prefix)
    }

    /// The liveness prefix the scripts look at, or "" (leases free only when gone) while
    /// liveness is not trusted.
    fn liveness_arg(&self) -> String {
        if self.trust_liveness.load(std::sync::atomic::Ordering::Relaxed) { self.alive_prefix() } else { String::new() }
    }

    async fn heartbeat(&self, owner: &str, ttl: Duration) -> Result<(), LeaseError> {
        let mut conn = self.conn.clone();
        let key = format!("{}{owner}", self.alive_prefix());
        let _: () =
            redis::cmd("SET").arg(key).arg(1).arg("PX").arg(ttl.as_millis() as u64).query_async(&mut conn).await?;
        Ok(())
    }

    async fn depart(&self, owner: &str) -> Result<(), LeaseError> {
        let mut conn = self.conn.clone();
        let _: i64 = redis::cmd("DEL").arg(format!("{}{owner}", self.alive_prefix())).query_async(&mut conn).await?;
        Ok(())
    }

    fn lease_key(&self, run_id: &str) -> String {
        format!("{}:lease:{run_id}", self.prefix)
    }

    fn epoch_key(&self, run_id: &str) -> String {
        format!("{}:epoch:{run_id}", self.prefix)
    }

    async fn acquire(
        &self,
        run_id: &str,
        owner: &str,
        ttl: Duration,
        min_epoch: u64,
    ) -> Result<Option<RunLease>, LeaseError> {
        let mut conn = self.conn.clone();
        let epoch: Option<u64> = self
            .acquire
            .key(self.lease_key(run_id))
            .key(self.epoch_key(run_id))
            .arg(owner)
            .arg(ttl.as_millis() as u64)
            .arg(min_epoch)
            .arg(self.liveness_arg())
            .invoke_async(&mut conn)
            .await?;
        Ok(epoch.map(|e| RunLease::new(run_id, owner, e)))
    }

    async fn renew(&self, lease: &RunLease, ttl: Duration) -> Result<bool, LeaseError> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .renew
            .key(self.lease_key(&lease.run_id))
            .arg(&lease.token)
            .arg(ttl.as_millis() as u64)
            .invoke_async(&mut conn)
            .await?;
        Ok(n == 1)
    }

    async fn release(&self, lease: &RunLease) -> Result<(), LeaseError> {
        let mut conn = self.conn.clone();
        let _: i64 = self.release.key(self.lease_key(&lease.run_id)).arg(&lease.token).invoke_async(&mut conn).await?;
        Ok(())
    }

    async fn is_held(&self, run_id: &str) -> Result<bool, LeaseError> {
        let mut conn = self.conn.clone();
        let n: i64 = self.is_held.key(self.lease_key(run_id)).arg(self.alive_prefix()).invoke_async(&mut conn).await?;
        Ok(n == 1)
    }

    fn signal_key(&self, run_id: &str, signal: RunSignal) -> String {
        format!("{}:{}:{run_id}", self.prefix, signal.name())
    }

    async fn signal(&self, run_id: &str, signal: RunSignal) -> Result<(), LeaseError> {
        let mut conn = self.conn.clone();
        let key = self.signal_key(run_id, signal);
        let _: () = redis::cmd("SET").arg(key).arg(1).arg("EX").arg(SIGNAL_SECS).query_async(&mut conn).await?;
        Ok(())
    }

    async fn clear_signal(&self, run_id: &str, signal: RunSignal) -> Result<(), LeaseError> {
        let mut conn = self.conn.clone();
        let _: i64 = redis::cmd("DEL").arg(self.signal_key(run_id, signal)).query_async(&mut conn).await?;
        Ok(())
    }

    async fn signals(&self, run_id: &str) -> Result<Signals, LeaseError> {
        let mut conn = self.conn.clone();
        let keys = [self.signal_key(run_id, RunSignal::Cancel), self.signal_key(run_id, RunSignal::Pause)];
        let got: Vec<Option<String>> = redis::cmd("MGET").arg(&keys[..]).query_async(&mut conn).await?;
        let set = |i: usize| got.get(i).is_some_and(Option::is_some);
        Ok(Signals { cancel: set(0), pause: set(1) })
    }
}

#[derive(Default)]
struct MemoryState {
    leases: HashMap<String, (String, Instant)>,
    epochs: HashMap<String, u64>,
    signals: std::collections::HashSet<(String, RunSignal)>,
}

/// In-process leases for a single executor (`warden dev`); same semantics as Redis.
#[derive(Clone, Default)]
pub struct MemoryLeases {
    state: Arc<Mutex<MemoryState>>,
}

impl MemoryLeases {
    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn acquire(&self, run_id: &str, owner: &str, ttl: Duration, min_epoch: u64) -> Option<RunLease> {
        let mut s = self.lock();
        let now = Instant::now();
        if s.leases.get(run_id).is_some_and(|(_, until)| *until > now) {
            return None;
        }
        let e = s.epochs.entry(run_id.to_string()).or_default();
        *e = e.saturating_add(1).max(min_epoch.saturating_add(1));
        let lease = RunLease::new(run_id, owner, *e);
        s.leases.insert(run_id.to_string(), (lease.token.clone(), now + ttl));
        Some(lease)
    }

    fn renew(&self, lease: &RunLease, ttl: Duration) -> bool {
        let mut s = self.lock();
        let now = Instant::now();
        match s.leases.get_mut(&lease.run_id) {
            Some((token, until)) if *token == lease.token && *until > now => {
                *until = now + ttl;
                true
            }
            _ => false,
        }
    }

    fn release(&self, lease: &RunLease) {
        let mut s = self.lock();
        if s.leases.get(&lease.run_id).is_some_and(|(t, _)| *t == lease.token) {
            s.leases.remove(&lease.run_id);
        }
    }

    fn is_held(&self, run_id: &str) -> bool {
        self.lock().leases.get(run_id).is_some_and(|(_, until)| *until > Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_lease_is_exclusive_and_epochs_increase() {
        let store = LeaseStore::Memory(MemoryLeases::default());
        let ttl = Duration::from_millis(200);
        let a = store.acquire("r", "a", ttl, 0).await.unwrap().unwrap();
        assert_eq!(a.epoch, 1);
        assert!(store.acquire("r", "b", ttl, 0).await.unwrap().is_none());
        store.release(&a).await.unwrap();
        let b = store.acquire("r", "b", ttl, 5).await.unwrap().unwrap();
        assert_eq!(b.epoch, 6, "epoch must exceed the ledger's highest");
        assert!(!store.renew(&a, ttl).await.unwrap(), "a released lease cannot be renewed");
        assert!(store.renew(&b, ttl).await.unwrap());
    }
}
