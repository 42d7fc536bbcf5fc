//! Per-tenant rate windows: fixed one-minute windows counted with `INCR` in Redis, so every
//! policy replica shares them (in-process counters when no Redis is configured). A limiter
//! that cannot count fails closed: the call is denied.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use redis::aio::ConnectionManager;

#[derive(Clone)]
pub enum RateLimiter {
    Redis(ConnectionManager),
    Memory(Arc<Mutex<HashMap<(String, i64), u64>>>),
}

impl RateLimiter {
    pub async fn connect(redis_url: &str) -> anyhow::Result<RateLimiter> {
        if redis_url.is_empty() {
            return Ok(RateLimiter::Memory(Arc::default()));
        }
        let client = redis::Client::open(redis_url)?;
        Ok(RateLimiter::Redis(ConnectionManager::new(client).await?))
    }

    /// Counts one call of `tenant` in the current minute; returns the count including it.
    pub async fn hit(&self, tenant: &str, now_ms: i64) -> Result<u64, String> {
        let minute = now_ms.div_euclid(60_000);
        match self {
            RateLimiter::Redis(conn) => {
                let key = format!("warden:rate:{tenant}:{minute}");
                let mut c = conn.clone();
                let (count,): (u64,) = redis::pipe()
                    .atomic()
                    .incr(&key, 1u64)
                    .expire(&key, 120)
                    .ignore()
                    .query_async(&mut c)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(count)
            }
            RateLimiter::Memory(m) => {
                let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
                m.retain(|(_, w), _| *w >= minute - 1);
                let c = m.entry((tenant.to_string(), minute)).or_default();
                *c += 1;
                Ok(*c)
            }
        }
    }
}
