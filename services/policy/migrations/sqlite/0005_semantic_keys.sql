-- Semantic idempotency (Artana): the call that first claimed a semantic key.
CREATE TABLE semantic_keys (
    tenant       TEXT NOT NULL,
    semantic_key TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    step_id      TEXT NOT NULL,
    decision_id  TEXT NOT NULL,
    PRIMARY KEY (tenant, semantic_key)
);
