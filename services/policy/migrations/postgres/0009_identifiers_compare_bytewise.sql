-- Every identifier the policy service indexes compares byte by byte (COLLATE "C"), whatever
-- locale the database was created with: ids, digests, scopes and state words are never text a
-- person sorts, and a linguistic collation (en_US.UTF-8, the default of most packaged
-- clusters) puts strcoll in every index comparison. It also orders them as SQLite does. See
-- the ledger's migration of the same name: rewrites no rows, rebuilds the indexes with every
-- table below locked until the last is done, and analyzes the tables again.
ALTER TABLE capabilities
    ALTER COLUMN capability_id TYPE TEXT COLLATE "C",
    ALTER COLUMN handle_sha256 TYPE TEXT COLLATE "C",
    ALTER COLUMN tenant TYPE TEXT COLLATE "C",
    ALTER COLUMN run_id TYPE TEXT COLLATE "C";
ALTER TABLE approvals
    ALTER COLUMN approval_id TYPE TEXT COLLATE "C",
    ALTER COLUMN tenant TYPE TEXT COLLATE "C",
    ALTER COLUMN state TYPE TEXT COLLATE "C";
ALTER TABLE budgets
    ALTER COLUMN scope TYPE TEXT COLLATE "C";
ALTER TABLE cost_records
    ALTER COLUMN record_key TYPE TEXT COLLATE "C";
ALTER TABLE semantic_keys
    ALTER COLUMN tenant TYPE TEXT COLLATE "C",
    ALTER COLUMN semantic_key TYPE TEXT COLLATE "C";
ALTER TABLE run_capabilities
    ALTER COLUMN run_id TYPE TEXT COLLATE "C",
    ALTER COLUMN capability_id TYPE TEXT COLLATE "C";
ANALYZE capabilities, approvals, budgets, cost_records, semantic_keys, run_capabilities;
