-- Which proof `head_signature` holds: '' a signature of the head's {run_id, seq, hash}, as
-- every head written before had; 'mac' the ledger's HMAC-SHA-256 of it, keyed from the
-- ledger's signing key. A stored head is checked only by the ledger, which signs it when a
-- client asks (`GetSignedHead`); a MAC costs a microsecond where a signature costs 15-25
-- (docs/write-path.md, "Heads proven by the ledger's MAC").
ALTER TABLE runs ADD COLUMN head_proof TEXT NOT NULL DEFAULT '';
