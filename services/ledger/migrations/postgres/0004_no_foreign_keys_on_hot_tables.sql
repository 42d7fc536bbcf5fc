-- Events and receipts are written on every step; a foreign-key check per inserted row costs a
-- lookup and a row lock on `runs` that the append already holds. The ledger writes a run's
-- events and receipts only in the statement or transaction that moves the run's head (an
-- UPDATE that matched the run's row), so a row for a missing run cannot be written.
ALTER TABLE events DROP CONSTRAINT IF EXISTS events_run_id_fkey;
ALTER TABLE receipts DROP CONSTRAINT IF EXISTS receipts_run_id_fkey;
