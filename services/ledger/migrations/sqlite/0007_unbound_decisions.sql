-- Decisions the policy signed that no run's chain may hold: a run's first decision is asked
-- for while the run is being created, and when the creation fails (or records another plan)
-- there is no chain for it. Kept here, verified like any decision record, so that every
-- decision is in the ledger (K03). `seq` orders them for listing.
CREATE TABLE unbound_decisions (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    decision_id    TEXT NOT NULL UNIQUE,
    tenant         TEXT NOT NULL,
    run_id         TEXT NOT NULL,
    step_id        TEXT NOT NULL,
    payload_json   TEXT NOT NULL,
    recorded_at_ms BIGINT NOT NULL
);
CREATE INDEX unbound_decisions_by_tenant ON unbound_decisions (tenant, seq);
