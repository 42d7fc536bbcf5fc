-- Expired approvals are found across tenants by the expiry sweeper, which marks each one
-- 'expired' (once, whichever replica gets there first) and resumes its run.
CREATE INDEX approvals_state_expiry ON approvals (state, expires_at_ms);
