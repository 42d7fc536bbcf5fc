-- Typed run summaries (checkpoints, artifacts, progress, …), derived from run_summary events.
CREATE TABLE summaries (
    run_id       TEXT NOT NULL REFERENCES runs (run_id),
    seq          BIGINT NOT NULL,
    summary_type TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    step_id      TEXT NOT NULL,
    timestamp_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE INDEX summaries_type ON summaries (run_id, summary_type, seq);

-- SPEC-KERN-01 §3 transactions: staged deltas become committed state only through CommitTx.
CREATE TABLE transactions (
    run_id  TEXT NOT NULL REFERENCES runs (run_id),
    tx_id   TEXT NOT NULL,
    tenant  TEXT NOT NULL,
    status  TEXT NOT NULL,
    reason  TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run_id, tx_id)
);

CREATE TABLE tx_staged (
    run_id     TEXT NOT NULL,
    tx_id      TEXT NOT NULL,
    seq        BIGINT NOT NULL,
    delta_json TEXT NOT NULL,
    PRIMARY KEY (run_id, tx_id, seq)
);

CREATE TABLE state (
    tenant     TEXT NOT NULL,
    state_key  TEXT NOT NULL,
    value_json TEXT NOT NULL,
    version    BIGINT NOT NULL,
    run_id     TEXT NOT NULL,
    tx_id      TEXT NOT NULL,
    -- Deletes keep a tombstone: versions only ever increase.
    deleted    BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, state_key)
);
