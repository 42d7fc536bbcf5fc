//! `warden bench` itself: what it reports is read off real runs (the `warden dev` shape here,
//! which needs no servers; the production shape is the same code over other endpoints).

/// What `warden bench` with `args` printed; fails the test when it failed.
fn bench(args: &[&str]) -> String {
    let warden = warden_testkit::mesh::bin_dir().expect("binaries").join("warden");
    let dir = tempfile::tempdir().expect("dir");
    let out = std::process::Command::new(warden).current_dir(dir.path()).arg("bench").args(args).output().expect("run");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
    said
}

/// The per-step figures come from following each run's events, for the chain and for every
/// run of the batch: one interval per step, leaving out those that start at one of a run's
/// first two requests (which a follower may receive as it catches up).
#[test]
fn the_bench_reports_per_step_percentiles_from_followed_runs() {
    let said = bench(&[
        "--suite",
        "steps",
        "--shape",
        "dev",
        "--steps",
        "6",
        "--sequential-runs",
        "2",
        "--fixed-runs",
        "1",
        "--batch-runs",
        "3",
        "--batch-steps",
        "4",
    ]);
    let per_step: Vec<&str> = said.lines().filter(|l| l.contains("per step, ")).collect();
    // Chain: 6 requests per run, 5 intervals, the first two left out: 3 per run, 2 runs.
    // Batch: 4 requests per run, 3 intervals, the first two left out: 1 per run, 3 runs.
    assert_eq!(per_step.len(), 2, "{said}");
    assert!(per_step[0].contains("2 runs followed") && per_step[0].ends_with("(6 steps)"), "{said}");
    assert!(per_step[1].contains("3 runs followed") && per_step[1].ends_with("(3 steps)"), "{said}");
    for line in per_step {
        let p50 = line.split("p50 ").nth(1).and_then(|r| r.split("ms").next()).expect("p50");
        assert!(p50.trim().parse::<f64>().expect("a figure") > 0.0, "{line}");
    }
}

/// The ledger suite writes what the ledger records — decisions as the policy signed them —
/// and reports appends, latencies and a verified long run (it failed on its first append
/// once the ledger began refusing unsigned decisions, and `--suite all` with it).
#[test]
fn the_ledger_suite_appends_signed_decisions_and_verifies_a_long_run() {
    let said = bench(&["--suite", "ledger", "--runs", "3", "--appends", "4", "--verify-events", "200"]);
    assert!(said.contains("3 runs x 4 = 12 appends"), "{said}");
    assert!(said.contains("sequential appends, one run: 1000"), "{said}");
    assert!(said.contains("200 events: import"), "{said}");
}
