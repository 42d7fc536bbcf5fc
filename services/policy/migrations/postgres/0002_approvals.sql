-- Durable approvals, bound to the exact argument digest of the call they approve.
CREATE TABLE approvals (
    approval_id    TEXT PRIMARY KEY,
    tenant         TEXT NOT NULL,
    run_id         TEXT NOT NULL,
    step_id        TEXT NOT NULL,
    tool           TEXT NOT NULL,
    args_sha256    TEXT NOT NULL,
    state          TEXT NOT NULL,
    approver       TEXT NOT NULL DEFAULT '',
    reason         TEXT NOT NULL DEFAULT '',
    created_at_ms  BIGINT NOT NULL,
    expires_at_ms  BIGINT NOT NULL,
    resolved_at_ms BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX approvals_tenant_state ON approvals (tenant, state, approval_id);
