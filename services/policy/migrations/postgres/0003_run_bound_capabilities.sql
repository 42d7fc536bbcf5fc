-- A capability may be bound to one run: that run's calls use it without presenting the
-- handle (the explicit commitment a consequential tool needs, with no secret in the plan).
ALTER TABLE capabilities ADD COLUMN run_id TEXT NOT NULL DEFAULT '';
CREATE INDEX capabilities_run ON capabilities (tenant, run_id);
