-- Tool outputs too large to record inline, content-addressed per run: a step's
-- `tool_completed` cites one by the SHA-256 of its canonical JSON (`output_ref`), so the
-- hash chain commits to it while the event log stays small.
CREATE TABLE outputs (
    run_id        TEXT NOT NULL,
    sha256        TEXT NOT NULL,
    tenant        TEXT NOT NULL,
    bytes         BIGINT NOT NULL,
    output_json   TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, sha256)
);
