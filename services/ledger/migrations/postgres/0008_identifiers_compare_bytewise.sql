-- Every identifier the ledger indexes compares byte by byte (COLLATE "C"), whatever locale the
-- database was created with. They are ids, keys, digests and status words, never text a person
-- sorts; under a linguistic collation (en_US.UTF-8, the default of most packaged and container
-- PostgreSQL clusters) each comparison in an index goes through strcoll, and an index insert
-- makes a score of them. Measured on one en_US.UTF-8 cluster: inserting rows into a table keyed
-- like `events` took 15-40 % less time with the keys in "C", run to run (BENCHMARKS.md,
-- 2026-12-02).
-- It also makes PostgreSQL order these columns as SQLite does (BINARY), so a page boundary or a
-- lock order is the same on both backends.
--
-- Changing a text column's collation rewrites no rows; the indexes on it are rebuilt. The
-- migration is one transaction, so every table below stays locked (ACCESS EXCLUSIVE: no reads,
-- no writes, other replicas wait) until the last index is rebuilt; on a large ledger, run the
-- upgrade in a quiet window. A view of the operator's own on one of these columns makes it
-- fail (drop it first). The altered columns lose their planner statistics: ANALYZE below.
ALTER TABLE runs
    ALTER COLUMN run_id TYPE TEXT COLLATE "C",
    ALTER COLUMN tenant TYPE TEXT COLLATE "C",
    ALTER COLUMN status TYPE TEXT COLLATE "C",
    ALTER COLUMN submit_key TYPE TEXT COLLATE "C";
ALTER TABLE events
    ALTER COLUMN run_id TYPE TEXT COLLATE "C",
    ALTER COLUMN idempotency_key TYPE TEXT COLLATE "C";
ALTER TABLE receipts
    ALTER COLUMN receipt_id TYPE TEXT COLLATE "C",
    ALTER COLUMN run_id TYPE TEXT COLLATE "C",
    ALTER COLUMN step_id TYPE TEXT COLLATE "C";
ALTER TABLE summaries
    ALTER COLUMN run_id TYPE TEXT COLLATE "C",
    ALTER COLUMN summary_type TYPE TEXT COLLATE "C";
ALTER TABLE transactions
    ALTER COLUMN run_id TYPE TEXT COLLATE "C",
    ALTER COLUMN tx_id TYPE TEXT COLLATE "C";
ALTER TABLE tx_staged
    ALTER COLUMN run_id TYPE TEXT COLLATE "C",
    ALTER COLUMN tx_id TYPE TEXT COLLATE "C";
ALTER TABLE state
    ALTER COLUMN tenant TYPE TEXT COLLATE "C",
    ALTER COLUMN state_key TYPE TEXT COLLATE "C";
ALTER TABLE outputs
    ALTER COLUMN run_id TYPE TEXT COLLATE "C",
    ALTER COLUMN sha256 TYPE TEXT COLLATE "C";
ALTER TABLE frame_counts
    ALTER COLUMN root_run_id TYPE TEXT COLLATE "C";
ALTER TABLE unbound_decisions
    ALTER COLUMN decision_id TYPE TEXT COLLATE "C",
    ALTER COLUMN tenant TYPE TEXT COLLATE "C";
ANALYZE runs, events, receipts, summaries, transactions, tx_staged, state, outputs, frame_counts,
    unbound_decisions;
