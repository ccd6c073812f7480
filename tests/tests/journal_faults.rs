//! End to end: the coordinator dies just before and just after each line a rolling update
//! writes to its journal (`--journal-fault crash-before:N`, `crash-after:N`: SIGKILL, at the one
//! moment a test with a timer cannot hit), and each of those writes fails once as on a full
//! disk (`fail:N`). After each: no TP group holds two versions; `orchestrator recover` takes
//! the cluster over, finishing (or with `--rollback` undoing) exactly what the journal says was
//! in flight; every rank holds the digests a fresh launch of its version holds; both replicas
//! serve routed probes; and the next update goes through.
//!
//! The lines are counted from a run without a fault, so a protocol that writes more (or fewer)
//! lines is walked whole without editing this file.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

use orchestrator_e2e::{
    Served, assert_no_mixed_group, copy_checkpoint, journal, rank_versions, run, signal, stderr, stdout, synth_tiny, worker_pid,
};
use serde_json::Value;

/// A TP 2 x DP 2 cluster's two checkpoints and what a fresh launch of each holds.
struct Fixture {
    root: tempfile::TempDir,
    a: PathBuf,
    b: PathBuf,
    version_a: String,
    version_b: String,
    /// version -> (dp, tp) -> kernel rank digest, from a fresh launch.
    fresh: BTreeMap<String, BTreeMap<(u64, u64), String>>,
    /// The journal lines an update from A to B writes: `first..=last`.
    lines: std::ops::RangeInclusive<u64>,
    /// The lines recording dp0's commit decision, and its commit, in that update.
    dp0_decided: u64,
    dp0_committed: u64,
    /// More arguments for every launch, and for every update.
    launch_args: &'static [&'static str],
    update_args: &'static [&'static str],
}

impl Fixture {
    fn new() -> Self {
        Self::with(&[], &[])
    }

    /// A fixture whose launches and updates take these arguments too.
    fn with(launch_args: &'static [&'static str], update_args: &'static [&'static str]) -> Self {
        let root = tempfile::tempdir().unwrap();
        let (a, b) = (root.path().join("A"), root.path().join("B"));
        synth_tiny(&a, "1");
        synth_tiny(&b, "2");
        let mut fresh = BTreeMap::new();
        let mut version = |dir: &Path| {
            let o =
                run("orchestrator", &["launch", "--json", "--no-probe", "--tp", "2", "--dp", "2", "--checkpoint", dir.to_str().unwrap()]);
            let report: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(&o)));
            let v = rank_versions(&report)[0].2.clone();
            let digests = report["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| ((r["dp"].as_u64().unwrap(), r["tp"].as_u64().unwrap()), r["kernel_rank_digest"].as_str().unwrap().to_string()))
                .collect();
            fresh.insert(v.clone(), digests);
            v
        };
        let (version_a, version_b) = (version(&a), version(&b));
        assert_ne!(version_a, version_b);
        // The lines of an update without a fault.
        let state = root.path().join("clean");
        let mut args = vec!["--state-dir", state.to_str().unwrap()];
        args.extend_from_slice(launch_args);
        let cluster = Served::on_checkpoint("2", "2", &a, root.path(), &args);
        let update = cluster.update_doc_with(&b, update_args);
        assert_eq!(update["ok"], true, "{update:#}");
        let events = journal(&state);
        let seqs: Vec<u64> = events.iter().filter(|e| e["update"] == 1).map(|e| e["seq"].as_u64().unwrap()).collect();
        let step = |name: &str| events.iter().find(|e| e["dp"] == 0 && e["step"] == name).unwrap()["seq"].as_u64().unwrap();
        let (dp0_decided, dp0_committed) = (step("decided"), step("committed"));
        drop(cluster);
        let lines = seqs[0]..=*seqs.last().unwrap();
        assert!(lines.clone().count() >= 8, "an update of two replicas writes a begin, four steps each and an end: {seqs:?}");
        Self { root, a, b, version_a, version_b, fresh, lines, dp0_decided, dp0_committed, launch_args, update_args }
    }

    /// A served cluster on A journaling to a fresh state directory, with `fault`.
    fn launch(&self, fault: &str) -> (Served, PathBuf) {
        let state = tempfile::Builder::new().prefix("state").tempdir_in(self.root.path()).unwrap().keep();
        let mut args = vec!["--state-dir", state.to_str().unwrap(), "--journal-fault", fault];
        args.extend_from_slice(self.launch_args);
        (Served::on_checkpoint("2", "2", &self.a, self.root.path(), &args), state)
    }

    /// Every rank answers, no group mixes versions, and every rank holds the digests a fresh
    /// launch of its version holds; every rule of the report holds but, where the replicas are
    /// on two versions (an update that failed after a replica's commit), the one that says so.
    /// Returns each replica's version.
    fn assert_whole(&self, report: &Value, what: &str) -> Vec<String> {
        assert_no_mixed_group(report);
        let mut by_replica = vec![String::new(); 2];
        for r in report["ranks"].as_array().unwrap() {
            let (dp, tp) = (r["dp"].as_u64().unwrap(), r["tp"].as_u64().unwrap());
            let version = r["checkpoint_version"].as_str().unwrap();
            let fresh = self.fresh.get(version).unwrap_or_else(|| panic!("{what}: dp{dp}/tp{tp} holds an unknown version {version}"));
            assert_eq!(r["kernel_rank_digest"].as_str(), Some(fresh[&(dp, tp)].as_str()), "{what}: dp{dp}/tp{tp} on {version}");
            by_replica[dp as usize] = version.to_string();
        }
        let one_version = by_replica.iter().all(|v| *v == by_replica[0]);
        for rule in report["rules"].as_array().unwrap() {
            let allowed = !one_version && rule["id"] == "layout_identity";
            assert!(rule["ok"] == true || allowed, "{what}: {report:#}");
        }
        assert!(report["ok"] == true || !one_version, "{what}: {report:#}");
        by_replica
    }

    /// The recovered (or surviving) cluster serves: a probe load is answered by both replicas,
    /// on the versions the report gave them, without a failure; then an update to the other
    /// checkpoint goes through on every replica.
    fn assert_serves_and_updates(&self, cluster: &Served, by_replica: &[String], what: &str) {
        let probes = cluster.probe_load("40", "0.4").wait_with_output().unwrap();
        let probes: Value = serde_json::from_slice(&probes.stdout).unwrap_or_else(|e| panic!("{what}: {e}: {}", stdout(&probes)));
        assert_eq!(probes["failed"], 0, "{what}: {probes:#}");
        for (dp, version) in by_replica.iter().enumerate() {
            let served = &probes["by_replica"][format!("dp{dp}")]["served"];
            assert!(served.as_u64().is_some_and(|n| n > 0), "{what}: dp{dp} served no probe: {probes:#}");
            assert!(probes["by_version"][version]["served"].as_u64().is_some_and(|n| n > 0), "{what}: {probes:#}");
        }
        let target = if by_replica.iter().all(|v| *v == self.version_b) { &self.a } else { &self.b };
        let update = cluster.update_doc_with(target, self.update_args);
        assert_eq!(update["ok"], true, "{what}: the next update: {update:#}");
        let after = self.assert_whole(&cluster.report(), what);
        let expected = if *target == self.a { &self.version_a } else { &self.version_b };
        assert!(after.iter().all(|v| v == expected), "{what}: after the next update: {after:?}");
    }

    /// The coordinator dies at `line` (before or after writing it) during an update from A to B;
    /// `recover` (finishing, or rolling back) takes over.
    fn crash(&self, kind: &str, line: u64, rollback: bool) {
        let what = format!("{kind}:{line}{}", if rollback { ", recover --rollback" } else { "" });
        let state = self.update_killed_by(&format!("{kind}:{line}"));
        let events = journal(&state);
        let written = if kind == "crash-before" { line - 1 } else { line };
        assert_eq!(events.last().and_then(|e| e["seq"].as_u64()), Some(written), "{what}: {events:#?}");
        let began = events.iter().any(|e| e["event"] == "update_begin");
        let ended = events.iter().any(|e| e["event"] == "update_end");
        let recovered = Served::recover(&state, if rollback { &["--rollback"] } else { &[] });
        let report = recovered.report();
        let by_replica = self.assert_whole(&report, &what);
        // What the journal said was in flight is finished, or undone; an update not begun (or
        // ended) is left as it was.
        let expected = match (began, ended, rollback) {
            (false, _, _) => &self.version_a,
            (true, true, _) | (true, false, false) => &self.version_b,
            (true, false, true) => &self.version_a,
        };
        assert!(by_replica.iter().all(|v| v == expected), "{what}: expected every replica on {expected}: {report:#}");
        let events = journal(&state);
        let recovered_at = events.iter().position(|e| e["event"] == "recovered").unwrap_or_else(|| panic!("{what}: {events:#?}"));
        if began && !ended {
            assert!(events[recovered_at..].iter().any(|e| e["event"] == "update_end"), "{what}: recover closes the update: {events:#?}");
        }
        self.assert_serves_and_updates(&recovered, &by_replica, &what);
    }

    /// [`Self::crash`] before and after every line of the update.
    fn crash_at_every_line(&self, rollback: bool) {
        for line in self.lines.clone() {
            for kind in ["crash-before", "crash-after"] {
                self.crash(kind, line, rollback);
            }
        }
    }

    /// A cluster launched with the crash `fault` runs an update from A to B, and its
    /// coordinator dies of the fault (the update's client sees it die); returns the state
    /// directory.
    fn update_killed_by(&self, fault: &str) -> PathBuf {
        self.update_to_killed_by(&self.b, fault)
    }

    /// [`Self::update_killed_by`], the update going to `target`.
    fn update_to_killed_by(&self, target: &Path, fault: &str) -> PathBuf {
        let (mut cluster, state) = self.launch(fault);
        let mut args = vec!["--checkpoint", target.to_str().unwrap()];
        args.extend_from_slice(self.update_args);
        let update = cluster.cmd("update", &args);
        assert!(!update.status.success(), "{fault}: the update's client must see its coordinator die: {}", stdout(&update));
        let status = cluster.child.wait().unwrap();
        assert_eq!(status.signal(), Some(9), "{fault}: the coordinator must die of the fault: {status}");
        state
    }

    /// [`Self::crash_before_dp0_committed`], the update going to a copy of B, which `change`
    /// then gets (removed, rewritten) before anything recovers; returns the state directory.
    fn killed_at_dp0_commit_then(&self, change: impl FnOnce(&Path)) -> PathBuf {
        let target = tempfile::Builder::new().prefix("B-copy").tempdir_in(self.root.path()).unwrap().keep();
        copy_checkpoint(&self.b, &target, |_| false);
        let state = self.update_to_killed_by(&target, &format!("crash-before:{}", self.dp0_committed));
        change(&target);
        state
    }

    /// The coordinator dies just before it journals dp0's commit (every rank of dp0 has swapped
    /// to B, dp1 has not); returns the state directory.
    fn crash_before_dp0_committed(&self) -> PathBuf {
        self.update_killed_by(&format!("crash-before:{}", self.dp0_committed))
    }

    /// `recover` itself dies at `line` (`kind`), or that write fails once, while it resolves an
    /// update interrupted after dp0 swapped (it finishes dp0's decided commit, then updates dp1,
    /// or rolls dp0 back); a second `recover` in the same mode takes over from what the first one
    /// journaled (a first one that served is killed first).
    fn crash_in_recovery(&self, kind: &str, line: u64, rollback: bool) {
        let what = format!("recover{} --journal-fault {kind}:{line}", if rollback { " --rollback" } else { "" });
        let state = self.crash_before_dp0_committed();
        let fault = format!("{kind}:{line}");
        let mut args = vec!["--journal-fault", fault.as_str()];
        if rollback {
            args.push("--rollback");
        }
        // What the second recovery must leave: every replica on the version the mode resolves
        // to while the journal holds an update in flight; what a first one that served held
        // once its own resolution failed and ended, as a failed update does.
        let held = match Served::try_recover(&state, &args) {
            Err((status, said)) if kind == "fail" => {
                assert!(status.code().is_some_and(|c| c != 0), "{what}: {status}\n{said}");
                assert!(said.contains("no storage space"), "{what}: {said}");
                None
            }
            Err((status, said)) => {
                assert_eq!(status.signal(), Some(9), "{what}: recover must die of the fault: {status}\n{said}");
                None
            }
            Ok(mut served) => {
                // Only a failed write lets a recovery serve; what it serves is whole.
                assert_eq!(kind, "fail", "{what}: recover served");
                let held = self.assert_whole(&served.report(), &what);
                served.kill_coordinator();
                Some(held)
            }
        };
        let in_flight = update_in_flight(&journal(&state));
        let recovered = Served::recover(&state, if rollback { &["--rollback"] } else { &[] });
        let report = recovered.report();
        let by_replica = self.assert_whole(&report, &what);
        let expected = if rollback { &self.version_a } else { &self.version_b };
        match held.filter(|_| !in_flight) {
            Some(held) => assert_eq!(by_replica, held, "{what}: the second recovery changed what the first one served"),
            None => assert!(by_replica.iter().all(|v| v == expected), "{what}: expected every replica on {expected}: {report:#}"),
        }
        assert_every_update_closed(&journal(&state), &what);
        self.assert_serves_and_updates(&recovered, &by_replica, &what);
    }

    /// The lines a `recover` (in `rollback` mode or not) of [`Self::crash_before_dp0_committed`]
    /// writes, from a run without a fault.
    fn recovery_lines(&self, rollback: bool) -> std::ops::RangeInclusive<u64> {
        let state = self.crash_before_dp0_committed();
        let first = journal(&state).last().unwrap()["seq"].as_u64().unwrap() + 1;
        let recovered = Served::recover(&state, if rollback { &["--rollback"] } else { &[] });
        drop(recovered);
        let last = journal(&state).iter().rev().find(|e| e["event"] == "update_end").unwrap()["seq"].as_u64().unwrap();
        assert!(last > first, "{:#?}", journal(&state));
        first..=last
    }

    /// The write of `line` fails once, as on a full disk: the update fails or goes on, never
    /// leaving a group mixed; the same coordinator serves and updates on; and the journal stays
    /// replayable (killed afterwards, it is recovered onto what the cluster held).
    fn fail(&self, line: u64) {
        let what = format!("fail:{line}");
        let (mut cluster, state) = self.launch(&what);
        let update = cluster.update_doc_with(&self.b, self.update_args);
        let report = cluster.report();
        let by_replica = self.assert_whole(&report, &format!("{what}, after an update that said {}", update["ok"]));
        if update["ok"] == true {
            assert!(by_replica.iter().all(|v| *v == self.version_b), "{what}: {update:#}\n{report:#}");
        }
        self.assert_serves_and_updates(&cluster, &by_replica, &what);
        let held = self.assert_whole(&cluster.report(), &what);
        cluster.kill_coordinator();
        drop(cluster);
        let recovered = Served::recover(&state, &[]);
        let after = self.assert_whole(&recovered.report(), &format!("{what}, recovered"));
        assert_eq!(after, held, "{what}: recover changed what the cluster held");
        let events = journal(&state);
        assert_every_update_closed(&events, &what);
        assert!(events.iter().any(|e| e["event"] == "update_end"), "{what}: {events:#?}");
        self.assert_serves_and_updates(&recovered, &after, &what);
    }
}

/// Every update the journal begins is closed: by its end, or by the begin of a recovery's
/// update that resolves it (`resumes`).
fn assert_every_update_closed(events: &[Value], what: &str) {
    assert!(!update_in_flight(events), "{what}: every update begun is closed: {events:#?}");
}

/// Whether the journal holds an update begun and not closed.
fn update_in_flight(events: &[Value]) -> bool {
    let count = |f: &dyn Fn(&Value) -> bool| events.iter().filter(|e| f(e)).count();
    let begins = count(&|e| e["event"] == "update_begin");
    let closed = count(&|e| e["event"] == "update_end" || (e["event"] == "update_begin" && !e["resumes"].is_null()));
    begins > closed
}

#[test]
fn the_coordinator_killed_at_each_line_of_an_update_is_recovered_and_finishes_it() {
    Fixture::new().crash_at_every_line(false);
}

#[test]
fn the_coordinator_killed_at_each_line_of_an_update_is_recovered_and_rolls_it_back() {
    Fixture::new().crash_at_every_line(true);
}

#[test]
fn each_journal_write_of_an_update_failing_once_leaves_whole_groups_and_a_replayable_journal() {
    let f = Fixture::new();
    for line in f.lines.clone() {
        f.fail(line);
    }
}

#[test]
fn a_recovery_killed_or_failing_to_write_at_each_of_its_lines_is_recovered_again() {
    let f = Fixture::new();
    for rollback in [false, true] {
        for line in f.recovery_lines(rollback) {
            for kind in ["crash-before", "crash-after", "fail"] {
                f.crash_in_recovery(kind, line, rollback);
            }
        }
    }
}

/// The same walk with each rank keeping the buffers an update leaves (stages reload into them,
/// a rollback swaps back to them) and both replicas updated in one batch (their steps
/// interleave): killed before and after each line, then recovered (finishing the update).
#[test]
fn the_coordinator_killed_at_each_line_of_a_one_batch_update_with_kept_buffers_is_recovered() {
    Fixture::with(&["--keep-staging-buffers"], &["--max-unavailable", "2"]).crash_at_every_line(false);
}

/// A recovery whose resolving update is refused before it begins (the checkpoint the
/// interrupted update was moving to is gone) closes the interrupted update as not applied: the
/// cluster serves whole replicas (dp0's decided commit finished, dp1 left as it was), the next
/// update goes through, and the journal stays replayable (before, the interrupted update stayed
/// open and the next update's begin made every later `recover` refuse the journal).
#[test]
fn a_recovery_whose_update_is_refused_closes_the_interrupted_one() {
    let f = Fixture::new();
    let state = f.killed_at_dp0_commit_then(|target| std::fs::remove_dir_all(target).unwrap());
    let mut recovered = Served::recover(&state, &[]);
    let by_replica = f.assert_whole(&recovered.report(), "recovered");
    assert_eq!(by_replica, [f.version_b.clone(), f.version_a.clone()]);
    assert_every_update_closed(&journal(&state), "recovered");
    f.assert_serves_and_updates(&recovered, &by_replica, "after a refused recovery");
    recovered.kill_coordinator();
    let again = Served::recover(&state, &[]);
    let after = f.assert_whole(&again.report(), "recovered again");
    assert!(after.iter().all(|v| *v == f.version_b), "{after:?}");
}

/// A recovery finishes the version the interrupted update was rolling out, never what its
/// directory holds by then: the checkpoint rewritten in place between the kill and `recover`
/// (another version) refuses the resolving update before it touches a replica, and the
/// interrupted update is closed as not applied (dp0's decided commit to B finished, dp1 left on
/// A). Before, dp1 was updated to the rewritten checkpoint: a version no replica had verified
/// against B, under a journal that said B was rolled out.
#[test]
fn a_recovery_refuses_a_checkpoint_rewritten_since_the_update_it_resolves() {
    let f = Fixture::new();
    let state = f.killed_at_dp0_commit_then(|target| {
        std::fs::remove_dir_all(target).unwrap();
        synth_tiny(target, "3");
    });
    let recovered = Served::recover(&state, &[]);
    let by_replica = f.assert_whole(&recovered.report(), "recovered");
    assert_eq!(by_replica, [f.version_b.clone(), f.version_a.clone()]);
    let events = journal(&state);
    assert_every_update_closed(&events, "recovered");
    let ended = events.iter().rev().find(|e| e["event"] == "update_end").unwrap();
    assert_eq!(ended["ok"], false, "{events:#?}");
    f.assert_serves_and_updates(&recovered, &by_replica, "after a recovery refused a rewritten checkpoint");
}

/// A decided commit that a dead rank can never confirm does not hold the rest of the cluster
/// back: `recover` finishes it on dp0's live rank, marks dp0 dead (out for good, as a live
/// update does) and finishes the interrupted update on dp1. Before, dp0's commit stayed
/// pending on a replica not marked dead, which refused the resolving update, and dp1 stayed on
/// A.
#[test]
fn a_recovery_is_not_held_back_by_a_commit_a_dead_rank_cannot_confirm() {
    let f = Fixture::new();
    let state = f.update_killed_by(&format!("crash-after:{}", f.dp0_decided));
    signal(worker_pid(&state, 0, 1), "KILL");
    let recovered = Served::recover(&state, &[]);
    let report = recovered.report();
    assert_no_mixed_group(&report);
    let versions = rank_versions(&report);
    assert_eq!(
        versions.iter().filter(|(dp, _, _)| *dp == 1).map(|(_, _, v)| v.as_str()).collect::<Vec<_>>(),
        [f.version_b.as_str(), f.version_b.as_str()],
        "{report:#}"
    );
    assert_eq!(report["replicas"][0]["dead"], true, "{report:#}");
    assert_eq!(report["replicas"][1]["serving"], true, "{report:#}");
    assert_every_update_closed(&journal(&state), "recovered");
}
