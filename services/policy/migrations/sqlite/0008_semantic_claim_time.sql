-- When a call claimed its semantic key: a claim whose call was never requested in the ledger
-- within an authorization's lifetime can no longer act, so it frees the key.
ALTER TABLE semantic_keys ADD COLUMN claimed_at_ms BIGINT NOT NULL DEFAULT 0;
