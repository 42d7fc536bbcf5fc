-- Capabilities attached to a run by their holder (SubmitRun.capability_handles): the run's
-- calls are authorized under them as if they had been issued for that run.
CREATE TABLE run_capabilities (
    run_id         TEXT NOT NULL,
    capability_id  TEXT NOT NULL,
    tenant         TEXT NOT NULL,
    attached_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, capability_id)
);
