-- Runs and their hash-chained event logs.
CREATE TABLE runs (
    run_id        TEXT PRIMARY KEY,
    tenant        TEXT NOT NULL,
    status        TEXT NOT NULL,
    reason        TEXT NOT NULL DEFAULT '',
    plan_json     TEXT NOT NULL DEFAULT '',
    goal          TEXT NOT NULL DEFAULT '',
    cancel_policy BIGINT NOT NULL DEFAULT 0,
    submit_key    TEXT,
    last_seq      BIGINT NOT NULL DEFAULT 0,
    head_hash     TEXT NOT NULL,
    max_epoch     BIGINT NOT NULL DEFAULT 0,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);
CREATE UNIQUE INDEX runs_submit_key ON runs (tenant, submit_key);
CREATE INDEX runs_tenant_status ON runs (tenant, status, run_id);
CREATE INDEX runs_status ON runs (status, run_id);

CREATE TABLE events (
    run_id          TEXT NOT NULL REFERENCES runs (run_id),
    seq             BIGINT NOT NULL,
    event_type      TEXT NOT NULL,
    payload_json    TEXT NOT NULL,
    step_id         TEXT NOT NULL,
    epoch           BIGINT NOT NULL,
    idempotency_key TEXT NOT NULL,
    timestamp_ms    BIGINT NOT NULL,
    prev_hash       TEXT NOT NULL,
    hash            TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE UNIQUE INDEX events_idempotency ON events (run_id, idempotency_key);
