//! End to end: a rank that stalls (SIGSTOP, then SIGCONT) or dies (SIGKILL) at each journaled
//! step of a rolling update, or at any moment under a probe load. After each: no routed probe
//! was served by a TP group whose ranks held two versions, the report's versions are what each
//! rank says, the update's own account is true, and the cluster converges (a stalled replica
//! comes back after a passing probe; a dead one stays out and the rest serve).

use std::path::Path;
use std::time::{Duration, Instant};

use orchestrator_e2e::{
    Served, assert_no_mixed_group, has_step, journal, rank_versions, signal, stderr, stdout, synth_tiny as synth, wait_for_journal,
    worker_pid,
};
use serde_json::Value;

/// Polls the report until `ready` holds (panics after `limit`).
fn wait_for_report(cluster: &Served, limit: Duration, ready: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let report = cluster.report();
        if ready(&report) {
            return report;
        }
        assert!(start.elapsed() < limit, "the cluster never converged: {report:#}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// What the update says it did to replica `dp` (its steps).
fn steps_of(update: &Value, dp: u32) -> String {
    let prefix = format!("replica dp{dp}:");
    let steps = update["update"]["steps"].as_array().map(Vec::as_slice).unwrap_or_default();
    steps.iter().filter_map(Value::as_str).filter(|s| s.starts_with(&prefix)).collect::<Vec<_>>().join("\n")
}

fn serving(report: &Value, dp: usize) -> bool {
    report["replicas"][dp]["serving"] == true
}

/// Every probe a load served was served on version A or B (a group with two versions never
/// serves: its probe fails and the replica is pulled).
fn assert_served_only_whole_versions(probes: &Value, allowed: &[&str]) {
    for (version, counts) in probes["by_version"].as_object().unwrap() {
        if counts["served"].as_u64().unwrap() > 0 {
            assert!(allowed.contains(&version.as_str()), "probes served on version `{version}`: {probes:#}");
        }
    }
}

/// The steps of an update at which rank dp0/tp1 is signalled, and the fault that holds it at
/// that step long enough for the signal to land there: a slow stage for the steps before the
/// commit decision; a slow commit (its peer dp0/tp0 has already swapped, it has not) for
/// `decided`. At `committed` every rank of dp0 has swapped and dp1 is being updated.
const STEPS: [(&str, &str); 4] =
    [("staging", "1:slow-stage"), ("verified", "1:slow-stage"), ("decided", "1:slow-commit"), ("committed", "1:slow-stage")];

fn start(tmp: &Path, state: &Path) -> (Served, String, String) {
    start_with(tmp, state, &["--inject-fault", "1:slow-stage"])
}

fn start_with(tmp: &Path, state: &Path, extra: &[&str]) -> (Served, String, String) {
    let (a, b) = (tmp.join("A"), tmp.join("B"));
    if !a.exists() {
        synth(&a, "1");
        synth(&b, "2");
    }
    let mut args = vec!["--state-dir", state.to_str().unwrap()];
    args.extend_from_slice(extra);
    let cluster = Served::on_checkpoint("2", "2", &a, tmp, &args);
    let version_a = cluster.report()["ranks"][0]["checkpoint_version"].as_str().unwrap().to_string();
    (cluster, version_a, b.display().to_string())
}

/// SIGSTOP dp0/tp1 the moment `step` is journaled for dp0, SIGCONT it 3 s later: the update
/// finishes on every replica (a stall shorter than the commit drive limit only delays it), the
/// group never mixes versions, and every replica serves again.
#[test]
fn a_rank_stalled_at_each_step_of_an_update_never_mixes_its_group() {
    let tmp = tempfile::tempdir().unwrap();
    let dp = 0;
    for (step, fault) in STEPS {
        let state = tmp.path().join(format!("state-stop-{step}"));
        let (cluster, version_a, b) = start_with(tmp.path(), &state, &["--inject-fault", fault]);
        let victim = worker_pid(&state, dp, 1);
        let load = cluster.probe_load("5", "14");
        let update = cluster.update_in_background(&["--checkpoint", &b, "--json"]);
        wait_for_journal(&state, Duration::from_secs(60), |e| has_step(e, dp, step));
        signal(victim, "STOP");
        std::thread::sleep(Duration::from_secs(3));
        signal(victim, "CONT");
        let o = update.wait_with_output().unwrap();
        let out: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{step}: {e}: {}\n{}", stdout(&o), stderr(&o)));
        let version_b = out["update"]["new_version"].as_str().unwrap().to_string();
        // The update's own account: done everywhere, or failed before any commit decision with
        // the group that failed still on A.
        let after = wait_for_report(&cluster, Duration::from_secs(30), |r| serving(r, 0) && serving(r, 1));
        assert_no_mixed_group(&after);
        let events = journal(&state);
        eprintln!("outcome: SIGSTOP 3 s at {step}: update ok={} steps={}", out["update"]["ok"], out["update"]["steps"]);
        if out["update"]["ok"] == true {
            assert!(rank_versions(&after).iter().all(|(_, _, v)| *v == version_b), "{step}: {after:#}");
        } else {
            assert!(!has_step(&events, dp, "decided"), "{step}: an abort after a commit decision: {out:#}");
            assert!(rank_versions(&after).iter().filter(|(d, _, _)| *d == dp).all(|(_, _, v)| *v == version_a), "{step}: {after:#}");
        }
        // What the update says each replica holds is what its ranks say.
        for (d, _, v) in rank_versions(&after) {
            assert_eq!(out["update"]["versions"][d.to_string()], v.as_str(), "{step}: {out:#}\n{after:#}");
        }
        let probes = load.wait_with_output().unwrap();
        let probes: Value = serde_json::from_slice(&probes.stdout).unwrap();
        assert_served_only_whole_versions(&probes, &[&version_a, &version_b]);
        // Converged: a new probe load is served in full.
        let probes: Value = serde_json::from_slice(&cluster.probe_load("10", "1").wait_with_output().unwrap().stdout).unwrap();
        assert_eq!(probes["failed"], 0, "{step}: {probes:#}");
    }
}

/// SIGKILL dp0/tp1 the moment `step` is journaled for dp0: before the commit decision dp0 aborts
/// and keeps A; after it dp0's surviving rank holds B and the commit stays pending on the dead
/// rank. Either way dp0 is out of rotation for good, never reported as serving a mix, the rest
/// serve, and a restarted coordinator (`recover`) converges on the same picture.
#[test]
fn a_rank_killed_at_each_step_of_an_update_leaves_its_group_out_and_the_rest_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let dp = 0;
    for (step, fault) in STEPS {
        let state = tmp.path().join(format!("state-kill-{step}"));
        let (mut cluster, version_a, b) = start_with(tmp.path(), &state, &["--inject-fault", fault]);
        let victim = worker_pid(&state, dp, 1);
        let load = cluster.probe_load("5", "8");
        let update = cluster.update_in_background(&["--checkpoint", &b, "--json"]);
        wait_for_journal(&state, Duration::from_secs(60), |e| has_step(e, dp, step));
        signal(victim, "KILL");
        let o = update.wait_with_output().unwrap();
        let out: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{step}: {e}: {}\n{}", stdout(&o), stderr(&o)));
        let version_b = out["update"]["new_version"].as_str().unwrap().to_string();
        let events = journal(&state);
        let decided = has_step(&events, dp, "decided");
        eprintln!("outcome: SIGKILL at {step}: decided={decided} update ok={} steps={}", out["update"]["ok"], out["update"]["steps"]);
        let after = wait_for_report(&cluster, Duration::from_secs(20), |r| !serving(r, 0));
        assert_no_mixed_group(&after);
        let dead = after["ranks"].as_array().unwrap().iter().find(|r| r["dp"] == 0 && r["tp"] == 1).unwrap();
        assert!(dead["failure"].as_str().unwrap().starts_with("dead"), "{step}: {dead:#}");
        let survivor = rank_versions(&after).into_iter().find(|(d, t, _)| (*d, *t) == (0, 0)).unwrap().2;
        // Why, as data: the replica it stopped at, and a kind that says where it was (a kill
        // that lands once every rank confirmed its commit fails nothing: a probe after the swap
        // that the dead rank cannot answer takes its replica out and the update goes on).
        let failure = &out["update"]["failure"];
        if out["update"]["ok"] == true {
            assert!(failure.is_null(), "{step}: {out:#}");
        } else {
            assert_eq!((failure["refused"].as_bool(), &failure["replicas"]), (Some(false), &serde_json::json!([0])), "{step}: {failure:#}");
            let kinds: &[&str] = if decided { &["commit_unconfirmed"] } else { &["staged_rank_unreachable", "unhealthy_at_decision"] };
            assert!(kinds.contains(&failure["kind"].as_str().unwrap_or_default()), "{step}: {failure:#}");
        }
        if decided {
            assert_eq!(survivor, version_b, "{step}: after the decision the survivor holds B");
            assert!(!steps_of(&out, 0).contains("kept version"), "{step}: no abort after a decision: {out:#}");
        } else {
            assert_eq!(survivor, version_a, "{step}: before the decision the group keeps A");
        }
        let probes = load.wait_with_output().unwrap();
        let probes: Value = serde_json::from_slice(&probes.stdout).unwrap();
        assert_served_only_whole_versions(&probes, &[&version_a, &version_b]);
        let probes: Value = serde_json::from_slice(&cluster.probe_load("10", "1").wait_with_output().unwrap().stdout).unwrap();
        assert_eq!(probes["failed"], 0, "{step}: {probes:#}");
        assert_eq!(probes["by_replica"]["dp1"]["served"], probes["served"], "{step}: {probes:#}");
        if step == "decided" {
            // A coordinator restarted from the journal finds the same: dp0 out, dp1 serving.
            cluster.kill_coordinator();
            let recovered = Served::recover(&state, &[]);
            let report = wait_for_report(&recovered, Duration::from_secs(20), |r| serving(r, 1));
            assert!(!serving(&report, 0), "{report:#}");
            assert_no_mixed_group(&report);
        }
    }
}

/// A rank stalled for longer than the heartbeat timeout in the middle of a report: its replica
/// leaves rotation, the TP ring is rebuilt on a new epoch once it answers again, and the replica
/// serves again after a passing probe (instead of every later probe failing on a broken ring).
#[test]
fn a_stall_mid_report_breaks_no_ring_for_good() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let (cluster, _, _) = start(tmp.path(), &state);
    let victim = worker_pid(&state, 1, 0);
    let report = {
        let (coordinator, token) = (cluster.coordinator.clone(), cluster.token.clone());
        std::thread::spawn(move || {
            orchestrator_e2e::run("orchestrator", &["report", "--coordinator", &coordinator, "--token-file", &token, "--json"])
        })
    };
    std::thread::sleep(Duration::from_millis(700));
    signal(victim, "STOP");
    std::thread::sleep(Duration::from_secs(6));
    signal(victim, "CONT");
    let _ = report.join().unwrap();
    let healed = wait_for_report(&cluster, Duration::from_secs(30), |r| serving(r, 0) && serving(r, 1));
    assert_eq!(healed["ok"], true, "{healed:#}");
    // Full reports with probes pass again, and every probe of a load is served.
    let o = cluster.cmd("report", &["--json"]);
    let full: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(full["ok"], true, "{full:#}");
    let probes: Value = serde_json::from_slice(&cluster.probe_load("10", "2").wait_with_output().unwrap().stdout).unwrap();
    assert_eq!(probes["failed"], 0, "{probes:#}");
    assert!(probes["by_replica"]["dp1"]["served"].as_u64().unwrap() > 0, "{probes:#}");
}

/// `kill -9` of one dp0 worker under a probe load: the probes in flight may fail (loudly), then
/// dp0 is out of rotation and every later probe is served by dp1; the report shows dp1's rows as
/// they are and the dead rank as dead.
#[test]
fn a_dead_replica_leaves_rotation_and_the_report_shows_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let (cluster, version_a, _) = start(tmp.path(), &state);
    let load = cluster.probe_load("20", "3");
    std::thread::sleep(Duration::from_millis(800));
    signal(worker_pid(&state, 0, 1), "KILL");
    let probes: Value = serde_json::from_slice(&load.wait_with_output().unwrap().stdout).unwrap();
    // Only probes in flight at the kill, or sent to dp0 before its first failure pulled it
    // (a few at 20/s), may fail; before the fix 39 of 120 failed and later loads failed half.
    assert!(probes["failed"].as_u64().unwrap() <= 6, "only probes in flight at the kill may fail: {probes:#}");
    let probes: Value = serde_json::from_slice(&cluster.probe_load("20", "2").wait_with_output().unwrap().stdout).unwrap();
    assert_eq!(probes["failed"], 0, "{probes:#}");
    assert_eq!(probes["by_replica"]["dp1"]["served"], probes["served"], "{probes:#}");
    let report = cluster.report();
    let ranks = report["ranks"].as_array().unwrap();
    for r in ranks.iter().filter(|r| r["dp"] == 1) {
        assert_eq!(r["verdict"], "ok", "{report:#}");
        assert_eq!(r["checkpoint_version"], version_a.as_str());
    }
    let dead = ranks.iter().find(|r| r["dp"] == 0 && r["tp"] == 1).unwrap();
    assert!(dead["failure"].as_str().unwrap().starts_with("dead"), "{dead:#}");
    let alive = ranks.iter().find(|r| r["dp"] == 0 && r["tp"] == 0).unwrap();
    assert_eq!(alive["checkpoint_version"], version_a.as_str(), "{alive:#}");
    assert_eq!(report["replicas"][0]["serving"], false);
    assert_eq!(report["replicas"][0]["dead"], true);
    // Readiness follows: the dead replica's live rank says NOT_SERVING (before, it stayed
    // SERVING for good: a dead replica's ranks were never told), dp1's ranks SERVING.
    let readiness = |r: &Value| {
        let o = orchestrator_e2e::run("orchestrator", &["health", "--address", r["address"].as_str().unwrap(), "--wait", "0"]);
        stdout(&o).split_whitespace().next().unwrap_or("").to_string()
    };
    orchestrator_e2e::eventually(Duration::from_secs(10), "dp0's live rank NOT_SERVING", || {
        (readiness(alive) == "NOT_SERVING").then_some(())
    });
    for r in ranks.iter().filter(|r| r["dp"] == 1) {
        assert_eq!(readiness(r), "SERVING", "{r:#}");
    }
}

/// A rank stalled at the commit decision for longer than `--commit-timeout`: the update reports
/// the rank (never an abort), its replica stays out with the commit pending, and once the rank
/// answers again the coordinator finishes the commit (journaled) and the replica serves B.
#[test]
fn a_commit_pending_on_a_stalled_rank_is_finished_when_it_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let (cluster, version_a, b) = start_with(tmp.path(), &state, &["--commit-timeout", "2", "--inject-fault", "1:slow-commit"]);
    let victim = worker_pid(&state, 0, 1);
    let update = cluster.update_in_background(&["--checkpoint", &b, "--json"]);
    wait_for_journal(&state, Duration::from_secs(60), |e| has_step(e, 0, "decided"));
    signal(victim, "STOP");
    let o = update.wait_with_output().unwrap();
    let out: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&o), stderr(&o)));
    let version_b = out["update"]["new_version"].as_str().unwrap().to_string();
    let steps = steps_of(&out, 0);
    if has_step(&journal(&state), 0, "committed") {
        // The stop landed after every rank had confirmed: nothing is pending.
        signal(victim, "CONT");
        assert_eq!(out["update"]["ok"], true, "{out:#}");
        return;
    }
    assert_eq!(out["update"]["ok"], false, "{out:#}");
    assert_eq!(out["update"]["pending_commits"]["0"], version_b.as_str(), "{out:#}");
    assert_eq!(out["update"]["failure"]["kind"], "commit_unconfirmed", "{out:#}");
    assert_eq!(out["update"]["failure"]["replicas"], serde_json::json!([0]), "{out:#}");
    assert!(steps.contains("rank dp0/tp1") && !steps.contains("kept version"), "{steps}");
    let mid = cluster.report();
    assert!(!serving(&mid, 0), "{mid:#}");
    assert_eq!(mid["replicas"][0]["pending_commit"], version_b.as_str(), "{mid:#}");
    assert_no_mixed_group(&mid);
    signal(victim, "CONT");
    dp0_heals_onto(&cluster, &state, &version_b, &version_a);
    // Rolling out B again completes the cluster.
    let o = cluster.cmd("update", &["--checkpoint", &b, "--json"]);
    assert!(o.status.success(), "{}", stdout(&o));
}

/// A rank hung in its Commit call while it heartbeats on (alive, not stopped: the health loop
/// sees nothing wrong with it), past `--commit-timeout`: the update reports the rank (never an
/// abort), its replica stays out with the commit pending, and the health loop, finding every
/// rank healthy, drives the decided commit again, which the rank answers; the replica serves B.
#[test]
fn a_decided_commit_to_a_rank_hung_in_the_call_is_driven_again_until_it_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let (cluster, version_a, b) = start_with(tmp.path(), &state, &["--commit-timeout", "2", "--inject-fault", "1:hung-commit"]);
    let o = cluster.cmd("update", &["--checkpoint", &b, "--json"]);
    let out: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&o), stderr(&o)));
    let version_b = out["update"]["new_version"].as_str().unwrap().to_string();
    assert_eq!(out["update"]["ok"], false, "{out:#}");
    assert_eq!(out["update"]["pending_commits"]["0"], version_b.as_str(), "{out:#}");
    assert_eq!(out["update"]["failure"]["kind"], "commit_unconfirmed", "{out:#}");
    let steps = steps_of(&out, 0);
    assert!(steps.contains("rank dp0/tp1") && !steps.contains("kept version"), "{steps}");
    assert!(!has_step(&journal(&state), 0, "aborted"), "a decided commit is never aborted: {:#?}", journal(&state));
    // No signal, no restart: the loop drives the commit again and the rank answers it.
    dp0_heals_onto(&cluster, &state, &version_b, &version_a);
}

/// An update whose last replica's commit hangs on one rank past `--commit-timeout` ends not
/// applied with every replica committed (dp0) or decided (dp1); once the health loop confirms the
/// last commit, every replica serves B and so does the cluster's account of it: the report names B
/// as its source, and a coordinator restarted from the journal says B too (before, both kept A,
/// the next update journaled A as what it moved from, and a `recover --rollback` of it went
/// back to A, two versions back).
#[test]
fn an_update_short_only_of_a_confirmation_settles_on_its_target_once_confirmed() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let (mut cluster, _, b) = start_with(tmp.path(), &state, &["--commit-timeout", "2", "--inject-fault", "3:hung-commit"]);
    let o = cluster.cmd("update", &["--checkpoint", &b, "--json"]);
    let out: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&o), stderr(&o)));
    assert_eq!(out["update"]["failure"]["kind"], "commit_unconfirmed", "{out:#}");
    let healed = wait_for_report(&cluster, Duration::from_secs(30), |r| serving(r, 0) && serving(r, 1));
    assert_no_mixed_group(&healed);
    assert!(healed["source"].as_str().unwrap().contains(b.as_str()), "{healed:#}");
    cluster.kill_coordinator();
    let recovered = Served::recover(&state, &[]);
    let report = recovered.report();
    assert!(report["source"].as_str().unwrap().contains(b.as_str()), "{report:#}");
}

/// A replica whose ranks all swapped but whose probe after the swap fails (dp0/tp0 writes
/// `wq_b` back in checkpoint order at its commit, so that what serves is not what was verified
/// staged): the update stops there and says so by kind (before, it pulled the replica, went on
/// to the next and reported success). dp0 stays out on B, one version in its group; dp1, never
/// swapped, serves A; the journal ends the update not applied.
#[test]
fn a_replica_failing_its_probe_after_the_swap_stops_the_update() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let (cluster, version_a, b) = start_with(tmp.path(), &state, &["--inject-fault", "0:commit-skip-permute"]);
    let o = cluster.cmd("update", &["--checkpoint", &b, "--json"]);
    let out: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&o), stderr(&o)));
    assert!(!o.status.success(), "{out:#}");
    let version_b = out["update"]["new_version"].as_str().unwrap().to_string();
    assert_eq!(out["update"]["ok"], false, "{out:#}");
    assert_eq!(out["update"]["failure"]["kind"], "probe_after_swap", "{out:#}");
    assert_eq!(out["update"]["failure"]["replicas"], serde_json::json!([0]), "{out:#}");
    assert!(steps_of(&out, 0).contains("probe after the commit failed"), "{out:#}");
    assert!(steps_of(&out, 1).contains("not updated"), "{out:#}");
    let report = wait_for_report(&cluster, Duration::from_secs(10), |r| serving(r, 1));
    assert!(!serving(&report, 0), "{report:#}");
    assert_no_mixed_group(&report);
    let versions = rank_versions(&report);
    assert!(versions.iter().all(|(dp, _, v)| v == if *dp == 0 { &version_b } else { &version_a }), "{report:#}");
    let events = journal(&state);
    assert!(has_step(&events, 0, "committed") && !has_step(&events, 1, "committed"), "{events:#?}");
    assert!(events.iter().any(|e| e["event"] == "update_end" && e["ok"] == false), "{events:#?}");
}

/// Waits until dp0, out with its commit to `version_b` pending, serves again: both its ranks on
/// `version_b`, the confirmation journaled, no group mixed; dp1, which the stopped update never
/// reached, still on `version_a`.
fn dp0_heals_onto(cluster: &Served, state: &Path, version_b: &str, version_a: &str) {
    let healed = wait_for_report(cluster, Duration::from_secs(30), |r| serving(r, 0));
    assert_no_mixed_group(&healed);
    let dp0: Vec<String> = rank_versions(&healed).into_iter().filter(|(d, _, _)| *d == 0).map(|(_, _, v)| v).collect();
    assert_eq!(dp0, [version_b, version_b], "{healed:#}");
    assert!(journal(state).iter().any(|e| e["event"] == "commit_confirmed" && e["dp"] == 0), "{:#?}", journal(state));
    assert!(rank_versions(&healed).iter().filter(|(d, _, _)| *d == 1).all(|(_, _, v)| v == version_a), "{healed:#}");
}

/// Stalls and a kill at random moments (the seed is printed) under a probe load and an update:
/// whatever lands where, no group serves two versions and the cluster converges.
#[test]
fn stalls_and_a_kill_at_random_moments_under_load_converge() {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    eprintln!("random moments: seed {seed}");
    let mut x = seed | 1;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let (cluster, version_a, b) = start(tmp.path(), &state);
    let load = cluster.probe_load("8", "16");
    let update = cluster.update_in_background(&["--checkpoint", &b, "--json"]);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(200 + next(1500)));
        let (dp, tp) = (next(2), next(2));
        let pid = worker_pid(&state, dp, tp);
        let stall = 500 + next(5000);
        eprintln!("random moments: SIGSTOP dp{dp}/tp{tp} for {stall} ms");
        signal(pid, "STOP");
        std::thread::sleep(Duration::from_millis(stall));
        signal(pid, "CONT");
    }
    let o = update.wait_with_output().unwrap();
    let out: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&o), stderr(&o)));
    let version_b = out["update"]["new_version"].as_str().unwrap().to_string();
    let after = wait_for_report(&cluster, Duration::from_secs(40), |r| serving(r, 0) && serving(r, 1));
    assert_no_mixed_group(&after);
    let (dp, tp) = (next(2), next(2));
    eprintln!("random moments: SIGKILL dp{dp}/tp{tp}");
    signal(worker_pid(&state, dp, tp), "KILL");
    let probes: Value = serde_json::from_slice(&load.wait_with_output().unwrap().stdout).unwrap();
    assert_served_only_whole_versions(&probes, &[&version_a, &version_b]);
    let after = wait_for_report(&cluster, Duration::from_secs(20), |r| !serving(r, dp as usize));
    assert_no_mixed_group(&after);
    let probes: Value = serde_json::from_slice(&cluster.probe_load("10", "1").wait_with_output().unwrap().stdout).unwrap();
    assert_eq!(probes["failed"], 0, "{probes:#}");
    assert_eq!(probes["by_replica"][format!("dp{}", 1 - dp)]["served"], probes["served"], "{probes:#}");
}
