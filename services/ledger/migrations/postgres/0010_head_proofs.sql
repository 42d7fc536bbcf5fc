-- Which proof `head_signature` holds: '' a signature of the head's {run_id, seq, hash}, as
-- every head written before had; 'ack' the acknowledgement of the head event, a
-- `tool_requested`, which signs the head's seq and hash with the call's ids. A batch that ends
-- a run's part with a request stores that request's acknowledgement instead of signing the
-- head a second time (docs/write-path.md, "Heads proven by their request's acknowledgement").
ALTER TABLE runs ADD COLUMN head_proof TEXT NOT NULL DEFAULT '';
