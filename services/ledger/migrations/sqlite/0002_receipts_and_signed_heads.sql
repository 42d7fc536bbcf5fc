-- One receipt per tool call outcome, derived from the outcome event in the chain.
CREATE TABLE receipts (
    receipt_id      TEXT PRIMARY KEY,
    run_id          TEXT NOT NULL REFERENCES runs (run_id),
    step_id         TEXT NOT NULL,
    attempt         BIGINT NOT NULL,
    seq             BIGINT NOT NULL,
    body_json       TEXT NOT NULL,
    status          TEXT NOT NULL,
    hash            TEXT NOT NULL
);
-- receipt_id is derived from (run, step, attempt) or (run, tx): the primary key is the
-- "exactly one receipt per call" guarantee.
CREATE INDEX receipts_step ON receipts (run_id, step_id, attempt);
CREATE INDEX receipts_run_seq ON receipts (run_id, seq);

-- The ledger's signature over each run's latest {run_id, seq, hash}.
ALTER TABLE runs ADD COLUMN head_signature TEXT NOT NULL DEFAULT '';
ALTER TABLE runs ADD COLUMN head_key_id TEXT NOT NULL DEFAULT '';
