-- Monotonic budgets: calls and cost per run and per tenant. Costs are recorded once per
-- (run, step, attempt); counters only ever grow.
CREATE TABLE budgets (
    scope TEXT PRIMARY KEY,
    calls BIGINT NOT NULL DEFAULT 0,
    cost  DOUBLE PRECISION NOT NULL DEFAULT 0
);
CREATE TABLE cost_records (
    record_key TEXT PRIMARY KEY,
    cost       DOUBLE PRECISION NOT NULL
);
