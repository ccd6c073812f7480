//! End to end: the coordinator SIGKILLed in the middle of a rolling update, then restarted
//! from its state directory (`orchestrator recover`): it finds the workers again and finishes
//! the update, or rolls it back; no rank is left on an unknown or mixed version.

use std::path::Path;
use std::time::Duration;

use orchestrator_e2e::{Served, has_step, journal, rank_digests, run, stderr, stdout, synth_tiny_layers, versions, wait_for_journal};
use serde_json::Value;

/// Launches TP 2 x DP 2 on A with a state directory, starts an update to B, and kills the
/// coordinator once dp0 swapped to B and dp1 is mid-stage. Returns the (dead) cluster and the
/// versions of A and B.
fn kill_coordinator_mid_update(tmp: &Path) -> (Served, String, Value, Vec<Value>) {
    let (a, b, state) = (tmp.join("A"), tmp.join("B"), tmp.join("state"));
    // dp1/tp1 stages slowly (a second per layer: 5 s): the kill lands while dp1 is staging,
    // after dp0 (staging beside it) was verified and swapped.
    synth_tiny_layers(&a, "1", 5);
    synth_tiny_layers(&b, "2", 5);
    let mut cluster = Served::on_checkpoint("2", "2", &a, tmp, &["--state-dir", state.to_str().unwrap(), "--inject-fault", "3:slow-stage"]);
    let before = cluster.report();
    let update = cluster.update_in_background(&["--checkpoint", b.to_str().unwrap()]);
    let events = wait_for_journal(&state, Duration::from_secs(60), |e| has_step(e, 0, "committed") && has_step(e, 1, "staging"));
    cluster.kill_coordinator();
    assert!(!events.iter().any(|e| e["event"] == "update_end"), "the kill must land mid-update: {events:#?}");
    let o = update.wait_with_output().unwrap();
    assert!(!o.status.success(), "the update client must see its coordinator die: {}", stdout(&o));
    (cluster, versions(&before)[0].clone(), before, events)
}

#[test]
fn a_restarted_coordinator_finishes_the_interrupted_update() {
    let tmp = tempfile::tempdir().unwrap();
    let (_dead, version_a, _, _) = kill_coordinator_mid_update(tmp.path());
    let state = tmp.path().join("state");
    // The workers kept serving meanwhile; the new coordinator adopts them and finishes.
    let cluster = Served::recover(&state, &[]);
    let after = cluster.report();
    let events = journal(&state);
    let begins: Vec<&Value> = events.iter().filter(|e| e["event"] == "update_begin").collect();
    assert_eq!(begins.len(), 2, "the interrupted update and the one finishing it: {events:#?}");
    let version_b = begins[0]["new_version"].as_str().unwrap();
    assert_ne!(version_b, version_a);
    assert!(versions(&after).iter().all(|v| v == version_b), "{after}");
    assert_eq!(after["ok"], true, "{after}");
    assert!(events.iter().any(|e| e["event"] == "recovered"));
    let last = events.last().unwrap();
    assert_eq!((&last["event"], &last["ok"], &last["update"]), (&Value::from("update_end"), &Value::from(true), &Value::from(2)));
    // Only dp1 had to be redone.
    assert!(events.iter().any(|e| e["event"] == "update_step" && e["update"] == 2 && e["dp"] == 1 && e["step"] == "committed"));
    assert!(!events.iter().any(|e| e["event"] == "update_step" && e["update"] == 2 && e["dp"] == 0));
    // The digests of a fresh launch on B.
    let fresh = run(
        "orchestrator",
        &["launch", "--json", "--no-probe", "--tp", "2", "--dp", "2", "--checkpoint", tmp.path().join("B").to_str().unwrap()],
    );
    let fresh: Value = serde_json::from_slice(&fresh.stdout).unwrap();
    assert_eq!(rank_digests(&after), rank_digests(&fresh));
    // It serves: probes through the recovered coordinator, all on B.
    let probes = cluster.probe_load("20", "1").wait_with_output().unwrap();
    let probes: Value = serde_json::from_slice(&probes.stdout).unwrap();
    assert_eq!(probes["failed"], 0, "{probes}");
    assert_eq!(probes["by_version"][version_b]["served"], probes["served"], "{probes}");
    // A clean shutdown closes the journal; there is nothing left to recover.
    let o = cluster.cmd("shutdown", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    wait_for_journal(&state, Duration::from_secs(20), |e| e.last().is_some_and(|l| l["event"] == "shutdown"));
    let o = run("orchestrator", &["recover", "--state-dir", state.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("was shut down; nothing to recover"), "{}", stderr(&o));
}

#[test]
fn a_restarted_coordinator_rolls_the_interrupted_update_back() {
    let tmp = tempfile::tempdir().unwrap();
    let (_dead, version_a, before, _) = kill_coordinator_mid_update(tmp.path());
    let state = tmp.path().join("state");
    let cluster = Served::recover(&state, &["--rollback"]);
    let after = cluster.report();
    assert!(versions(&after).iter().all(|v| *v == version_a), "{after}");
    assert_eq!(after["ok"], true, "{after}");
    // Bit for bit what the cluster held before the update.
    assert_eq!(rank_digests(&after), rank_digests(&before));
    let events = journal(&state);
    // dp0 (already on B) swapped back to the A every rank kept since its commit, after the
    // journaled rollback decision, without restaging; dp1 never swapped.
    let rolled = events.iter().position(|e| e["event"] == "update_step" && e["update"] == 1 && e["dp"] == 0 && e["step"] == "rolled_back");
    let recovered = events.iter().position(|e| e["event"] == "recovered");
    assert!(rolled.is_some() && rolled > recovered, "{events:#?}");
    assert!(
        !events.iter().any(|e| e["event"] == "update_step" && e["dp"] == 0 && e["step"] == "staging" && e["update"] == 2),
        "{events:#?}"
    );
    assert!(!events.iter().any(|e| e["event"] == "update_step" && e["dp"] == 1 && e["step"] == "committed"), "{events:#?}");
    // The interrupted update is closed as not applied; nothing is kept for a rollback any more.
    let end = events.iter().rev().find(|e| e["event"] == "update_end").unwrap();
    assert_eq!(end["ok"], false, "{events:#?}");
    let full = cluster.cmd("report", &["--json", "--no-probe"]);
    let full: Value = serde_json::from_slice(&full.stdout).unwrap();
    assert_eq!(full["ok"], true, "{full:#}");
}

/// The coordinator and a worker of the replica being staged both die: the restarted
/// coordinator adopts the rest, names the dead rank, keeps its replica out of rotation, and
/// serves on the replica already on B.
#[test]
fn a_restarted_coordinator_names_a_worker_that_died_meanwhile_and_serves_on() {
    let tmp = tempfile::tempdir().unwrap();
    let (_dead, version_a, _, events) = kill_coordinator_mid_update(tmp.path());
    let state = tmp.path().join("state");
    let victim = events[0]["workers"].as_array().unwrap().iter().find(|w| w["id"] == 3).unwrap()["pid"].as_u64().unwrap();
    assert!(std::process::Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap().success());
    std::thread::sleep(Duration::from_millis(200));
    let cluster = Served::recover(&state, &[]);
    let version_b = events.iter().find(|e| e["event"] == "update_begin").unwrap()["new_version"].as_str().unwrap().to_string();
    assert_ne!(version_a, version_b);
    // dp0 (already swapped) serves B; dp1 is out of rotation.
    let probes = cluster.probe_load("20", "1").wait_with_output().unwrap();
    let probes: Value = serde_json::from_slice(&probes.stdout).unwrap();
    assert_eq!(probes["failed"], 0, "{probes}");
    assert_eq!(probes["by_replica"]["dp0"]["served"], probes["served"], "{probes}");
    assert_eq!(probes["by_version"][version_b.as_str()]["served"], probes["served"], "{probes}");
    // The report names the dead rank; the update is closed as not finished.
    let o = cluster.cmd("report", &["--json", "--no-probe"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("dp1/tp1"), "{}", stdout(&o));
    let events = journal(&state);
    let end = events.iter().rev().find(|e| e["event"] == "update_end").unwrap();
    assert_eq!(end["ok"], false, "{events:#?}");
    assert!(!has_step(&events[events.iter().position(|e| e["event"] == "recovered").unwrap()..], 1, "committed"));
}

/// The coordinator killed right after a replica's commit was decided, while its ranks swap
/// (dp0/tp1 commits a second late, so dp0 is split between the versions when it dies): the
/// restarted coordinator drives that decided commit to every rank (never an abort), finishes
/// the update, and no rank is left on a mixed version.
#[test]
fn a_commit_decided_before_the_coordinator_died_is_finished_by_recover() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, state) = (tmp.path().join("A"), tmp.path().join("B"), tmp.path().join("state"));
    synth_tiny_layers(&a, "1", 2);
    synth_tiny_layers(&b, "2", 2);
    let mut cluster =
        Served::on_checkpoint("2", "2", &a, tmp.path(), &["--state-dir", state.to_str().unwrap(), "--inject-fault", "1:slow-commit"]);
    let update = cluster.update_in_background(&["--checkpoint", b.to_str().unwrap()]);
    wait_for_journal(&state, Duration::from_secs(60), |e| has_step(e, 0, "decided"));
    cluster.kill_coordinator();
    // What the journal holds once the coordinator is dead (dp0/tp1 commits a second late).
    let events = journal(&state);
    assert!(!has_step(&events, 0, "committed"), "the kill must land before dp0's commit is confirmed: {events:#?}");
    let o = update.wait_with_output().unwrap();
    assert!(!o.status.success(), "{}", stdout(&o));
    let version_b = events.iter().find(|e| e["event"] == "update_begin").unwrap()["new_version"].as_str().unwrap().to_string();
    let recovered = Served::recover(&state, &[]);
    let after = recovered.report();
    assert_eq!(after["ok"], true, "{after:#}");
    assert!(versions(&after).iter().all(|v| *v == version_b), "{after:#}");
    // dp0's decided commit was finished (no abort of it anywhere), then dp1 went through.
    let events = journal(&state);
    assert!(!events.iter().any(|e| e["event"] == "update_step" && e["dp"] == 0 && e["step"] == "aborted"), "{events:#?}");
    let recovered_at = events.iter().position(|e| e["event"] == "recovered").unwrap();
    assert!(
        events[recovered_at..].iter().any(|e| (e["event"] == "commit_confirmed" || e["step"] == "committed") && e["dp"] == 0),
        "{events:#?}"
    );
    let o = recovered.cmd("shutdown", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A tmpfs of `size` mounted on `dir` for as long as it lives (`None` where this process may
/// not mount: not root).
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Self> {
        let o = std::process::Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(dir).output().ok()?;
        o.status.success().then(|| Self(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// The state directory's disk full (a real one: a small tmpfs, filled up) while updates run:
/// each update that meets it fails or is refused and leaves every TP group on one version; once
/// there is room again an update succeeds, and a coordinator killed then is recovered from its
/// journal (before, an update's end lost to the full disk left the journal unreplayable as soon
/// as the next update began).
#[test]
fn a_full_state_disk_fails_updates_cleanly_and_the_journal_stays_recoverable() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, state) = (tmp.path().join("A"), tmp.path().join("B"), tmp.path().join("state"));
    std::fs::create_dir(&state).unwrap();
    let Some(_disk) = Tmpfs::mount(&state, "256k") else {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    };
    synth_tiny_layers(&a, "1", 2);
    synth_tiny_layers(&b, "2", 2);
    let mut cluster = Served::on_checkpoint("2", "2", &a, tmp.path(), &["--state-dir", state.to_str().unwrap()]);
    // Fill the disk: only the journal's last page has room left.
    let filler = state.join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    while std::io::Write::write_all(&mut f, &[0u8; 4096]).is_ok() {}
    drop(f);
    let one_version_per_group = |report: &Value| {
        let ranks = report["ranks"].as_array().unwrap();
        for dp in 0..2 {
            let held: std::collections::BTreeSet<&str> =
                ranks.iter().filter(|r| r["dp"] == dp).map(|r| r["checkpoint_version"].as_str().unwrap()).collect();
            assert_eq!(held.len(), 1, "replica dp{dp} holds {held:?}: {report:#}");
        }
    };
    let mut failed = None;
    for (i, target) in [&b, &a, &b, &a, &b, &a].into_iter().enumerate() {
        let doc = cluster.update_doc(target);
        one_version_per_group(&cluster.report());
        if doc["update"]["ok"] != true {
            failed = Some((i, doc));
            break;
        }
    }
    let (i, doc) = failed.expect("an update met the full disk");
    assert!(doc["update"]["steps"].to_string().contains("journal"), "update {i}: {doc:#}");
    // Room again: an update to B succeeds, on every replica.
    std::fs::remove_file(&filler).unwrap();
    let doc = cluster.update_doc(&b);
    assert_eq!(doc["update"]["ok"], true, "{doc:#}");
    let version_b = doc["update"]["new_version"].as_str().unwrap().to_string();
    assert!(versions(&cluster.report()).iter().all(|v| *v == version_b));
    // The journal replays: a coordinator killed now is recovered, on B.
    cluster.kill_coordinator();
    let recovered = Served::recover(&state, &[]);
    let after = recovered.report();
    assert_eq!(after["ok"], true, "{after:#}");
    assert!(versions(&after).iter().all(|v| *v == version_b), "{after:#}");
    let o = recovered.cmd("shutdown", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}
