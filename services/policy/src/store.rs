//! Durable policy state through sqlx (PostgreSQL in production, SQLite embedded), with its own
//! migrations: capabilities now; approvals, budgets and rate windows build on the same store.

use std::str::FromStr;
use std::time::Duration;

use serde_json::Value;
use sqlx::ConnectOptions as _;
use sqlx::any::{AnyConnectOptions, AnyPoolOptions, AnyRow};
use sqlx::migrate::Migrator;
use sqlx::{AnyPool, Row};

static POSTGRES_MIGRATIONS: Migrator = sqlx::migrate!("migrations/postgres");
static SQLITE_MIGRATIONS: Migrator = sqlx::migrate!("migrations/sqlite");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("policy store unavailable: {0}")]
    Unavailable(String),
    #[error("policy store: {0}")]
    Internal(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> StoreError {
        match &e {
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Protocol(_) => StoreError::Unavailable(e.to_string()),
            sqlx::Error::Database(d) => {
                // As the ledger reads them: 08xxx connection exceptions, 57xxx operator
                // intervention (shutdown, starting up), serialization failures and deadlocks,
                // SQLite busy/locked — a blip, not an answer.
                let code = d.code().unwrap_or_default();
                let busy = code.parse::<u32>().is_ok_and(|c| matches!(c & 0xff, 5 | 6));
                if code.starts_with("08") || code.starts_with("57") || code == "40001" || code == "40P01" || busy {
                    StoreError::Unavailable(e.to_string())
                } else {
                    StoreError::Internal(e.to_string())
                }
            }
            _ => StoreError::Internal(e.to_string()),
        }
    }
}

impl From<StoreError> for tonic::Status {
    fn from(e: StoreError) -> tonic::Status {
        match e {
            StoreError::Unavailable(_) => tonic::Status::unavailable(e.to_string()),
            StoreError::Internal(_) => tonic::Status::internal(e.to_string()),
        }
    }
}

/// A stored capability (never its handle).
#[derive(Debug, Clone, PartialEq)]
pub struct CapabilityRow {
    pub capability_id: String,
    pub tenant: String,
    pub tool_patterns: Vec<String>,
    pub action_patterns: Vec<String>,
    pub resource_patterns: Vec<String>,
    pub issued_at_ms: i64,
    pub expires_at_ms: i64,
    pub revoked: bool,
    pub revoke_reason: String,
    /// The run it is bound to ('' for a bearer capability).
    pub run_id: String,
}

#[derive(Clone)]
pub struct PolicyStore {
    pool: AnyPool,
}

const COLUMNS: &str = "capability_id, tenant, tool_patterns, action_patterns, resource_patterns, issued_at_ms, expires_at_ms, revoked, revoke_reason, run_id";

fn list(v: &str) -> Vec<String> {
    serde_json::from_str::<Vec<String>>(v).unwrap_or_default()
}

fn row(r: &AnyRow) -> Result<CapabilityRow, StoreError> {
    Ok(CapabilityRow {
        capability_id: r.try_get("capability_id")?,
        tenant: r.try_get("tenant")?,
        tool_patterns: list(&r.try_get::<String, _>("tool_patterns")?),
        action_patterns: list(&r.try_get::<String, _>("action_patterns")?),
        resource_patterns: list(&r.try_get::<String, _>("resource_patterns")?),
        issued_at_ms: r.try_get("issued_at_ms")?,
        expires_at_ms: r.try_get("expires_at_ms")?,
        revoked: r.try_get::<i64, _>("revoked")? != 0,
        revoke_reason: r.try_get("revoke_reason")?,
        run_id: r.try_get("run_id")?,
    })
}

impl PolicyStore {
    pub async fn connect(url: &str) -> Result<PolicyStore, StoreError> {
        sqlx::any::install_default_drivers();
        let sqlite = url.starts_with("sqlite:");
        let url = if sqlite {
            let path = url.trim_start_matches("sqlite://").trim_start_matches("sqlite:");
            let file = path.split('?').next().unwrap_or_default();
            if let Some(dir) = std::path::Path::new(file).parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .map_err(|e| StoreError::Unavailable(format!("cannot create {}: {e}", dir.display())))?;
            }
            if path.contains('?') { format!("sqlite://{path}") } else { format!("sqlite://{path}?mode=rwc") }
        } else {
            url.to_string()
        };
        let options = AnyConnectOptions::from_str(&url)
            .map_err(|e| StoreError::Unavailable(format!("policy.database_url: {e}")))?
            // A statement or more per request: not logged one by one (slow ones still are).
            .log_statements(log::LevelFilter::Off);
        let pool = AnyPoolOptions::new()
            // A SQLite connection is a file handle in this process: nothing to ping.
            .test_before_acquire(!sqlite)
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await?;
        let migrator = if sqlite { &SQLITE_MIGRATIONS } else { &POSTGRES_MIGRATIONS };
        migrator.run(&pool).await.map_err(|e| StoreError::Unavailable(format!("policy migrations failed: {e}")))?;
        Ok(PolicyStore { pool })
    }

    pub async fn insert_capability(&self, c: &CapabilityRow, handle_sha256: &str) -> Result<(), StoreError> {
        let json = |v: &Vec<String>| Value::from(v.clone()).to_string();
        sqlx::query(&format!(
            "INSERT INTO capabilities ({COLUMNS}, handle_sha256) VALUES ($1, $2, $3, $4, $5, $6, $7, 0, '', $8, $9)"
        ))
        .bind(&c.capability_id)
        .bind(&c.tenant)
        .bind(json(&c.tool_patterns))
        .bind(json(&c.action_patterns))
        .bind(json(&c.resource_patterns))
        .bind(c.issued_at_ms)
        .bind(c.expires_at_ms)
        .bind(&c.run_id)
        .bind(handle_sha256)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn capability(&self, capability_id: &str) -> Result<Option<CapabilityRow>, StoreError> {
        let r = sqlx::query(&format!("SELECT {COLUMNS} FROM capabilities WHERE capability_id = $1"))
            .bind(capability_id)
            .fetch_optional(&self.pool)
            .await?;
        r.as_ref().map(row).transpose()
    }

    /// The capability a handle stands for (looked up by the handle's SHA-256).
    pub async fn by_handle(&self, handle_sha256: &str) -> Result<Option<CapabilityRow>, StoreError> {
        let r = sqlx::query(&format!("SELECT {COLUMNS} FROM capabilities WHERE handle_sha256 = $1"))
            .bind(handle_sha256)
            .fetch_optional(&self.pool)
            .await?;
        r.as_ref().map(row).transpose()
    }

    /// Live capabilities bound to a run.
    pub async fn bound_to_run(
        &self,
        tenant: &str,
        run_id: &str,
        now_ms: i64,
    ) -> Result<Vec<CapabilityRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM capabilities
             WHERE tenant = $1 AND revoked = 0 AND expires_at_ms > $3
               AND (run_id = $2
                    OR capability_id IN (SELECT capability_id FROM run_capabilities WHERE run_id = $2 AND tenant = $1))
             ORDER BY capability_id"
        ))
        .bind(tenant)
        .bind(run_id)
        .bind(now_ms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(row).collect()
    }

    /// Attaches a capability to a run (idempotently).
    pub async fn attach(&self, tenant: &str, run_id: &str, capability_id: &str, now_ms: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO run_capabilities (run_id, capability_id, tenant, attached_at_ms) VALUES ($1, $2, $3, $4)
             ON CONFLICT (run_id, capability_id) DO NOTHING",
        )
        .bind(run_id)
        .bind(capability_id)
        .bind(tenant)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Revokes (idempotently: the first reason stays).
    pub async fn revoke(&self, capability_id: &str, reason: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE capabilities SET revoked = 1, revoke_reason = $2 WHERE capability_id = $1 AND revoked = 0")
            .bind(capability_id)
            .bind(reason)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn list(&self, tenant: &str, after: &str, limit: u32) -> Result<Vec<CapabilityRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM capabilities WHERE tenant = $1 AND capability_id > $2 ORDER BY capability_id LIMIT {limit}"
        ))
        .bind(tenant)
        .bind(after)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(row).collect()
    }
}

/// A durable approval.
#[derive(Debug, Clone, PartialEq)]
pub struct ApprovalRow {
    pub approval_id: String,
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub tool: String,
    pub args_sha256: String,
    /// `pending`, `approved`, `denied` (expiry is computed from `expires_at_ms`).
    pub state: String,
    pub approver: String,
    pub reason: String,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
}

const APPROVAL_COLUMNS: &str =
    "approval_id, tenant, run_id, step_id, tool, args_sha256, state, approver, reason, created_at_ms, expires_at_ms";

fn approval(r: &AnyRow) -> Result<ApprovalRow, StoreError> {
    Ok(ApprovalRow {
        approval_id: r.try_get("approval_id")?,
        tenant: r.try_get("tenant")?,
        run_id: r.try_get("run_id")?,
        step_id: r.try_get("step_id")?,
        tool: r.try_get("tool")?,
        args_sha256: r.try_get("args_sha256")?,
        state: r.try_get("state")?,
        approver: r.try_get("approver")?,
        reason: r.try_get("reason")?,
        created_at_ms: r.try_get("created_at_ms")?,
        expires_at_ms: r.try_get("expires_at_ms")?,
    })
}

impl PolicyStore {
    pub async fn approval(&self, approval_id: &str) -> Result<Option<ApprovalRow>, StoreError> {
        let r = sqlx::query(&format!("SELECT {APPROVAL_COLUMNS} FROM approvals WHERE approval_id = $1"))
            .bind(approval_id)
            .fetch_optional(&self.pool)
            .await?;
        r.as_ref().map(approval).transpose()
    }

    /// Creates the approval unless it exists (a repeated request finds the first one).
    pub async fn ensure_approval(&self, a: &ApprovalRow) -> Result<ApprovalRow, StoreError> {
        sqlx::query(&format!(
            "INSERT INTO approvals ({APPROVAL_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, 'pending', '', '', $7, $8)
             ON CONFLICT (approval_id) DO NOTHING"
        ))
        .bind(&a.approval_id)
        .bind(&a.tenant)
        .bind(&a.run_id)
        .bind(&a.step_id)
        .bind(&a.tool)
        .bind(&a.args_sha256)
        .bind(a.created_at_ms)
        .bind(a.expires_at_ms)
        .execute(&self.pool)
        .await?;
        self.approval(&a.approval_id).await?.ok_or_else(|| StoreError::Internal("approval vanished".into()))
    }

    /// Resolves a pending approval; returns whether this call changed it (a second approve
    /// of the same approval changes nothing and writes nothing).
    pub async fn resolve_approval(
        &self,
        approval_id: &str,
        state: &str,
        approver: &str,
        reason: &str,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE approvals SET state = $2, approver = $3, reason = $4, resolved_at_ms = $5
             WHERE approval_id = $1 AND state = 'pending' AND expires_at_ms > $5",
        )
        .bind(approval_id)
        .bind(state)
        .bind(approver)
        .bind(reason)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Pending approvals whose time ran out, oldest expiry first.
    pub async fn expired_pending(&self, now_ms: i64, limit: u32) -> Result<Vec<ApprovalRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE state = 'pending' AND expires_at_ms <= $1
             ORDER BY expires_at_ms LIMIT {limit}"
        ))
        .bind(now_ms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(approval).collect()
    }

    /// How many approvals wait for a human, every tenant's (the `warden_approvals_pending` gauge).
    pub async fn pending_count(&self) -> Result<u64, StoreError> {
        let n: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM approvals WHERE state = 'pending'").fetch_one(&self.pool).await?;
        Ok(n.max(0) as u64)
    }

    /// Marks a pending approval whose time ran out `expired`; whether this call did (replicas
    /// race for it, one wins).
    pub async fn mark_expired(&self, approval_id: &str, now_ms: i64) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE approvals SET state = 'expired', reason = 'expired unanswered', resolved_at_ms = $2
             WHERE approval_id = $1 AND state = 'pending' AND expires_at_ms <= $2",
        )
        .bind(approval_id)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    pub async fn approvals(
        &self,
        tenant: &str,
        state: Option<&str>,
        after: &str,
        limit: u32,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        let rows = match state {
            Some(st) => {
                sqlx::query(&format!(
                    "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant = $1 AND state = $2 AND approval_id > $3 ORDER BY approval_id LIMIT {limit}"
                ))
                .bind(tenant)
                .bind(st)
                .bind(after)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(&format!(
                    "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant = $1 AND approval_id > $2 ORDER BY approval_id LIMIT {limit}"
                ))
                .bind(tenant)
                .bind(after)
                .fetch_all(&self.pool)
                .await?
            }
        };
        rows.iter().map(approval).collect()
    }

    /// The tenant's approvals created, resolved or expired at or after `since_ms` (expiry up to
    /// `now_ms`): what a watcher has to look at again.
    pub async fn approvals_touched_since(
        &self,
        tenant: &str,
        since_ms: i64,
        now_ms: i64,
        after: &str,
        limit: u32,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM approvals
             WHERE tenant = $1 AND approval_id > $4
               AND (created_at_ms >= $2 OR resolved_at_ms >= $2
                    OR (state = 'pending' AND expires_at_ms >= $2 AND expires_at_ms <= $3))
             ORDER BY approval_id LIMIT {limit}"
        ))
        .bind(tenant)
        .bind(since_ms)
        .bind(now_ms)
        .bind(after)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(approval).collect()
    }
}

/// Usage of a budget scope (`run:<id>` or `tenant:<name>`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub calls: u64,
    pub cost: f64,
}

impl PolicyStore {
    pub async fn usage(&self, scope: &str) -> Result<Usage, StoreError> {
        let r = sqlx::query("SELECT calls, cost FROM budgets WHERE scope = $1")
            .bind(scope)
            .fetch_optional(&self.pool)
            .await?;
        Ok(match r {
            Some(r) => Usage { calls: r.try_get::<i64, _>(0)? as u64, cost: r.try_get(1)? },
            None => Usage::default(),
        })
    }

    async fn add(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        scope: &str,
        calls: i64,
        cost: f64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO budgets (scope, calls, cost) VALUES ($1, $2, $3)
             ON CONFLICT (scope) DO UPDATE SET calls = budgets.calls + excluded.calls, cost = budgets.cost + excluded.cost",
        )
        .bind(scope)
        .bind(calls)
        .bind(cost)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// Counts one allowed call against the run and the tenant.
    /// Counts an allowed call once per decision: a retried `Authorize` of the same call (same
    /// decision id) finds it counted and changes nothing.
    pub async fn count_call(&self, tenant: &str, run_id: &str, decision_id: &str) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let first = sqlx::query(
            "INSERT INTO cost_records (record_key, cost) VALUES ($1, 0) ON CONFLICT (record_key) DO NOTHING",
        )
        .bind(format!("call:{decision_id}"))
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if first {
            self.add(&mut tx, &format!("run:{run_id}"), 1, 0.0).await?;
            self.add(&mut tx, &format!("tenant:{tenant}"), 1, 0.0).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records a cost once per `record_key`; returns whether it was new.
    pub async fn record_cost(
        &self,
        tenant: &str,
        run_id: &str,
        record_key: &str,
        cost: f64,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO cost_records (record_key, cost) VALUES ($1, $2) ON CONFLICT (record_key) DO NOTHING",
        )
        .bind(record_key)
        .bind(cost)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if inserted {
            self.add(&mut tx, &format!("run:{run_id}"), 0, cost).await?;
            self.add(&mut tx, &format!("tenant:{tenant}"), 0, cost).await?;
        }
        tx.commit().await?;
        Ok(inserted)
    }
}

/// The call holding a semantic key: a step of a run (every attempt of it is the same call).
#[derive(Debug, Clone, PartialEq)]
pub struct SemanticClaim {
    pub run_id: String,
    pub step_id: String,
    pub decision_id: String,
    pub claimed_at_ms: i64,
}

impl PolicyStore {
    pub async fn semantic_claim(&self, tenant: &str, key: &str) -> Result<Option<SemanticClaim>, StoreError> {
        let r = sqlx::query(
            "SELECT run_id, step_id, decision_id, claimed_at_ms FROM semantic_keys WHERE tenant = $1 AND semantic_key = $2",
        )
        .bind(tenant)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        r.map(|r| {
            Ok(SemanticClaim {
                run_id: r.try_get(0)?,
                step_id: r.try_get(1)?,
                decision_id: r.try_get(2)?,
                claimed_at_ms: r.try_get(3)?,
            })
        })
        .transpose()
    }

    /// Points the key at this call, atomically: when it is free (`replacing` None), or still
    /// held by the call judged finished (`replacing`). False when another call got there first
    /// (two calls with one key never both hold it).
    pub async fn claim_semantic(
        &self,
        tenant: &str,
        key: &str,
        c: &SemanticClaim,
        replacing: Option<&SemanticClaim>,
    ) -> Result<bool, StoreError> {
        let done = match replacing {
            None => {
                sqlx::query(
                    "INSERT INTO semantic_keys (tenant, semantic_key, run_id, step_id, decision_id, claimed_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tenant, semantic_key) DO NOTHING",
                )
                .bind(tenant)
                .bind(key)
                .bind(&c.run_id)
                .bind(&c.step_id)
                .bind(&c.decision_id)
                .bind(c.claimed_at_ms)
                .execute(&self.pool)
                .await?
            }
            Some(held) => {
                sqlx::query(
                    "UPDATE semantic_keys SET run_id = $3, step_id = $4, decision_id = $5, claimed_at_ms = $6
                 WHERE tenant = $1 AND semantic_key = $2 AND run_id = $7 AND step_id = $8 AND decision_id = $9",
                )
                .bind(tenant)
                .bind(key)
                .bind(&c.run_id)
                .bind(&c.step_id)
                .bind(&c.decision_id)
                .bind(c.claimed_at_ms)
                .bind(&held.run_id)
                .bind(&held.step_id)
                .bind(&held.decision_id)
                .execute(&self.pool)
                .await?
            }
        };
        Ok(done.rows_affected() == 1)
    }

    /// Gives a key back when the call that claimed it was refused before anything could act.
    pub async fn release_semantic(&self, tenant: &str, key: &str, c: &SemanticClaim) -> Result<(), StoreError> {
        sqlx::query(
            "DELETE FROM semantic_keys
             WHERE tenant = $1 AND semantic_key = $2 AND run_id = $3 AND step_id = $4 AND decision_id = $5",
        )
        .bind(tenant)
        .bind(key)
        .bind(&c.run_id)
        .bind(&c.step_id)
        .bind(&c.decision_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}
