-- How many child frames each run tree opened (seed 001): counted in the transaction that
-- creates a frame, so a tree never opens more than `ledger.max_frames_per_root`.
CREATE TABLE frame_counts (
    root_run_id TEXT PRIMARY KEY,
    opened      BIGINT NOT NULL
);
