//! Ledger errors and their gRPC codes.

use tonic::Status;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("{0} not found")]
    NotFound(String),
    #[error("{field}: {reason}")]
    InvalidArgument { field: String, reason: String },
    #[error("stale fencing epoch {epoch}: the run has seen epoch {max_epoch}")]
    Fenced { epoch: u64, max_epoch: u64 },
    #[error("{0}")]
    Precondition(String),
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    /// A batch decided on a run state another writer had moved past: it wrote nothing, and is
    /// appended again from the stored heads (answered UNAVAILABLE, retryable, if it escapes).
    #[error("{0}")]
    Moved(String),
    /// The database connection broke (the database restarted, or a peer dropped the socket):
    /// the pool lets the connection go, and an append or a read is tried again on another.
    #[error("storage unavailable: {0}")]
    Disconnected(String),
    /// Too many submissions are waiting already: refused before anything was written.
    #[error("{0}")]
    Busy(String),
    /// What is stored does not hold together (a head whose proof does not verify): altered
    /// outside the ledger, or lost.
    #[error("{0}")]
    DataLoss(String),
    #[error("internal ledger error: {0}")]
    Internal(String),
}

impl LedgerError {
    /// A refusal of the request itself (as opposed to storage trouble).
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            LedgerError::NotFound(_)
                | LedgerError::InvalidArgument { .. }
                | LedgerError::Fenced { .. }
                | LedgerError::Precondition(_)
                | LedgerError::Busy(_)
        )
    }

    /// The same error for every member of a failed batch.
    pub fn clone_for_batch(&self) -> LedgerError {
        match self {
            LedgerError::NotFound(m) => LedgerError::NotFound(m.clone()),
            LedgerError::InvalidArgument { field, reason } => {
                LedgerError::InvalidArgument { field: field.clone(), reason: reason.clone() }
            }
            LedgerError::Fenced { epoch, max_epoch } => LedgerError::Fenced { epoch: *epoch, max_epoch: *max_epoch },
            LedgerError::Precondition(m) => LedgerError::Precondition(m.clone()),
            LedgerError::Unavailable(m) => LedgerError::Unavailable(m.clone()),
            LedgerError::Moved(m) => LedgerError::Moved(m.clone()),
            LedgerError::Disconnected(m) => LedgerError::Disconnected(m.clone()),
            LedgerError::Busy(m) => LedgerError::Busy(m.clone()),
            LedgerError::DataLoss(m) => LedgerError::DataLoss(m.clone()),
            LedgerError::Internal(m) => LedgerError::Internal(m.clone()),
        }
    }

    pub fn invalid(field: &str, reason: impl Into<String>) -> LedgerError {
        LedgerError::InvalidArgument { field: field.to_string(), reason: reason.into() }
    }
}

impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> LedgerError {
        match &e {
            sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) => {
                LedgerError::Disconnected(e.to_string())
            }
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => {
                LedgerError::Unavailable(e.to_string())
            }
            sqlx::Error::Database(d) => {
                let code = d.code().unwrap_or_default();
                // 08xxx connection exceptions and 57P01–57P03 (the server shut down or is
                // restarting): this connection is gone. Other 57xxx operator intervention,
                // 40001/40P01 serialization and deadlock (retryable), SQLite 5/6 busy/locked.
                if code.starts_with("08") || code.starts_with("57P") {
                    LedgerError::Disconnected(e.to_string())
                } else if code.starts_with("57") || code == "40001" || code == "40P01" || sqlite_busy(&code) {
                    LedgerError::Unavailable(e.to_string())
                } else {
                    LedgerError::Internal(e.to_string())
                }
            }
            _ => LedgerError::Internal(e.to_string()),
        }
    }
}

impl From<LedgerError> for Status {
    fn from(e: LedgerError) -> Status {
        match e {
            LedgerError::NotFound(_) => Status::not_found(e.to_string()),
            LedgerError::InvalidArgument { field, reason } => warden_grpc::invalid_field(field, reason),
            LedgerError::Fenced { .. } => {
                warden_telemetry::metrics::fencing_refused();
                warden_grpc::fenced(e.to_string())
            }
            LedgerError::Precondition(_) => Status::failed_precondition(e.to_string()),
            LedgerError::Unavailable(_) | LedgerError::Moved(_) | LedgerError::Disconnected(_) => {
                Status::unavailable(e.to_string())
            }
            LedgerError::Busy(m) => warden_grpc::busy(m, std::time::Duration::from_millis(RETRY_AFTER_BUSY_MS)),
            LedgerError::DataLoss(_) => Status::data_loss(e.to_string()),
            LedgerError::Internal(_) => Status::internal(e.to_string()),
        }
    }
}

/// When a submission refused as [`LedgerError::Busy`] is told to try again: about the time a
/// full queue of creations takes to drain.
pub const RETRY_AFTER_BUSY_MS: u64 = 200;

/// SQLite's BUSY (5) and LOCKED (6), including their extended codes (5 + 256·n, …).
fn sqlite_busy(code: &str) -> bool {
    code.parse::<u32>().is_ok_and(|c| matches!(c & 0xff, 5 | 6))
}
