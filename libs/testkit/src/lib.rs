//! Test support: throwaway Redis and PostgreSQL servers, and the Warden mesh as separate
//! processes on free ports.
//!
//! `REDIS_URL` / `DATABASE_URL`, when set, name servers to use instead. Otherwise a
//! `redis-server` and a PostgreSQL cluster (`initdb` in a temp dir, run as the `postgres`
//! user when we are root, since PostgreSQL refuses root) are started on free ports, once
//! per test process, and installed with `apt-get` first if missing. Every child process is
//! tied to this process's lifetime (`PR_SET_PDEATHSIG`), so nothing outlives a test run.

#![allow(unsafe_code)] // pre_exec/prctl and getuid, below, are the only unsafe code.

pub mod mesh;
pub mod model;
pub mod otlp;
pub mod procs;
pub mod servers;

pub use mesh::{ExtraHost, Mesh, MeshOptions, ServiceProcess};
pub use servers::{Postgres, Redis, postgres, redis};

/// Polls `probe` every 50 ms until it returns `Some`, for at most `limit`.
pub async fn eventually<T, F, Fut>(limit: std::time::Duration, mut probe: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = probe().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
