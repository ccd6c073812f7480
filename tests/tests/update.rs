//! End to end: rolling weight updates on a `--serve` cluster with a probe load running
//! throughout, refused updates, and access control.

use std::path::Path;
use std::time::Duration;

use orchestrator_e2e::{Served, has_step, rank_digests, run, stderr, stdout, synth_tiny as synth, versions, wait_for_journal};
use serde_json::Value;

fn rolling_update_with_probes(tp: &str, dp: &str, max_unavailable: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("A"), tmp.path().join("B"));
    synth(&a, "1");
    synth(&b, "2");
    let cluster = Served::on_checkpoint(tp, dp, &a, tmp.path(), &[]);
    let before = cluster.report();
    let load = cluster.probe_load("20", "4");
    std::thread::sleep(Duration::from_millis(300));
    let o = cluster.cmd("update", &["--checkpoint", b.to_str().unwrap(), "--max-unavailable", max_unavailable, "--json"]);
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let update: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(update["ok"], true);
    // A lone replica swaps while it serves (there is nothing to drain it for); others leave
    // rotation for their swap.
    let swap = if dp == "1" { "the only replica: serving through the swap" } else { "out of rotation (its routed probes answered in" };
    // Back in rotation on the verification probe every rank kept of the weights it committed,
    // not on a probe computed again.
    let kept = "probed back in";
    let kept_by_every_rank = "(every rank answered with the verification probe it kept of the weights it committed)";
    for step in update["update"]["steps"].as_array().unwrap().iter().filter_map(|s| s.as_str()).filter(|s| s.starts_with("replica dp")) {
        assert!(step.contains(swap), "{step}");
        assert!(step.contains(kept) && step.contains(kept_by_every_rank), "{step}");
    }
    let probes = load.wait_with_output().unwrap();
    let probes: Value =
        serde_json::from_slice(&probes.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&probes.stdout)));
    assert_eq!(probes["failed"], 0, "probes failed during the update: {probes}");
    assert!(probes["served"].as_u64().unwrap() >= 40, "{probes}");
    // Every rank on B, with the digests of a fresh launch on B.
    let after = cluster.report();
    let new_version = update["update"]["new_version"].as_str().unwrap();
    assert!(versions(&after).iter().all(|v| v == new_version), "{after}");
    assert_ne!(versions(&before), versions(&after));
    // The update ended: no rank keeps the old version for a rollback any more.
    assert!(after["ranks"].as_array().unwrap().iter().all(|r| r.get("previous_version").is_none()), "{after}");
    let fresh = run("orchestrator", &["launch", "--json", "--no-probe", "--tp", tp, "--dp", dp, "--checkpoint", b.to_str().unwrap()]);
    let fresh: Value = serde_json::from_slice(&fresh.stdout).unwrap();
    assert_eq!(rank_digests(&after), rank_digests(&fresh));
    // Probes were served by B during the update.
    assert!(probes["by_version"][new_version]["served"].as_u64().unwrap() > 0, "{probes}");
}

#[test]
fn rolling_update_tp2_dp2_keeps_serving() {
    rolling_update_with_probes("2", "2", "1");
}

/// Two of three replicas at a time: still always one serving.
#[test]
fn rolling_update_two_replicas_at_a_time_keeps_serving() {
    rolling_update_with_probes("1", "3", "2");
}

#[test]
fn shadow_swap_with_one_replica_keeps_serving() {
    rolling_update_with_probes("2", "1", "1");
}

/// A truncated shard, a NaN scale, a wrong shape, a different geometry, a checkpoint outside
/// the allowed roots, or no token: refused before any swap; every rank stays on A.
#[test]
fn bad_updates_are_refused_and_change_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let a = root.join("A");
    synth(&a, "1");
    let cluster = Served::on_checkpoint("2", "2", &a, &root, &[]);
    let before = cluster.report();

    let damaged = |name: &str, damage: &dyn Fn(&Path)| {
        let dir = root.join(name);
        synth(&dir, "2");
        damage(&dir);
        dir
    };
    let shard = |dir: &Path| dir.join("model-00001-of-00001.safetensors");
    let truncated = damaged("truncated", &|d| {
        let f = shard(d);
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 10).unwrap();
    });
    let nan_scale = damaged("nan-scale", &|d| {
        let f = shard(d);
        let mut bytes = std::fs::read(&f).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let start = header["layers.1.attn.wq_b.scale"]["data_offsets"][0].as_u64().unwrap() as usize;
        bytes[8 + n + start + 3] = 0xFF;
        std::fs::write(&f, bytes).unwrap();
    });
    let other_geometry = root.join("other-geometry");
    let o = run("orchestrator", &["checkpoint", "synth", "--out", other_geometry.to_str().unwrap(), "--preset", "tiny", "--layers", "1"]);
    assert!(o.status.success());
    let outside_dir = tmp.path().join("outside");
    synth(&outside_dir, "2");

    for (what, dir, expect) in [
        ("truncated shard", &truncated, "truncated"),
        ("NaN scale", &nan_scale, "NaN scale"),
        ("other geometry", &other_geometry, "geometry"),
        ("outside the allowed roots", &outside_dir, "outside the allowed roots"),
    ] {
        let o = cluster.cmd("update", &["--checkpoint", dir.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{what}: {}\n{}", stdout(&o), stderr(&o));
        assert!(stdout(&o).contains(expect), "{what}: {}", stdout(&o));
        assert_eq!(versions(&cluster.report()), versions(&before), "{what}: nothing may change");
        assert_eq!(rank_digests(&cluster.report()), rank_digests(&before), "{what}");
    }
    // Without the token.
    let o = run("orchestrator", &["update", "--coordinator", &cluster.coordinator, "--checkpoint", a.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("missing or wrong token"), "{}", stderr(&o));
    assert_eq!(rank_digests(&cluster.report()), rank_digests(&before));
}

/// A checkpoint this coordinator hashed (the launched one, an update's) is not hashed again by a
/// later update while its files are the same ones, nor its values read again (the pass that
/// hashed them checked them); a file rewritten in place is hashed and inspected afresh, and
/// refused here for the NaN written into it.
#[test]
fn a_checkpoint_hashed_before_is_not_hashed_again_unless_its_files_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("A"), tmp.path().join("B"));
    synth(&a, "1");
    synth(&b, "2");
    // Claims are made only of files that settled before they were opened (RACY_MARGIN).
    std::thread::sleep(Duration::from_millis(2100));
    let cluster = Served::on_checkpoint("2", "1", &a, tmp.path(), &[]);
    let validated = |dir: &Path| -> (bool, String) {
        let o = cluster.cmd("update", &["--checkpoint", dir.to_str().unwrap(), "--json"]);
        let doc: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&o), stderr(&o)));
        let steps = doc["update"]["steps"].as_array().unwrap();
        (doc["ok"] == true, steps.iter().filter_map(|s| s.as_str()).collect::<Vec<_>>().join("\n"))
    };
    let adopted = "adopted from this coordinator's claim on the same files";
    let inspected = "whose every value it checked before";
    let (ok, steps) = validated(&b);
    assert!(ok && steps.starts_with("validated") && !steps.contains(adopted), "{steps}");
    // Back to the launched checkpoint: its version and its values' check from the launch's hash.
    let (ok, steps) = validated(&a);
    assert!(ok && steps.contains(adopted) && steps.contains(inspected), "{steps}");
    let (ok, steps) = validated(&b);
    assert!(ok && steps.contains(adopted) && steps.contains(inspected), "{steps}");
    let (ok, steps) = validated(&a);
    assert!(ok && steps.contains(inspected), "{steps}");
    let on_a = versions(&cluster.report());
    // B rewritten in place, one scale byte NaN: hashed and inspected again, and refused.
    let f = b.join("model-00001-of-00001.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header["layers.0.attn.wq_b.scale"]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + start] = 0xFF;
    std::fs::write(&f, bytes).unwrap();
    let (ok, steps) = validated(&b);
    assert!(!ok && steps.contains("NaN scale") && !steps.contains(adopted), "{steps}");
    assert_eq!(versions(&cluster.report()), on_a);
}

/// A worker SIGKILLed in the middle of staging: its group keeps version A (the other rank
/// aborts its staged copy), the update reports the failure by rank, and the other replica keeps
/// serving (on B).
/// An update whose client goes away while the update waits for its turn (another one runs)
/// never starts: only the running update is journaled, and every rank ends on its version
/// (before, the waiting update ran once the first ended, for a client long gone).
#[test]
fn an_update_whose_client_left_while_it_waited_for_its_turn_never_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c, state) = (tmp.path().join("A"), tmp.path().join("B"), tmp.path().join("C"), tmp.path().join("state"));
    // dp0/tp1 stages slowly (a second per layer: 3 s), which keeps the first update running.
    for (dir, seed) in [(&a, "1"), (&b, "2"), (&c, "3")] {
        orchestrator_e2e::synth_tiny_layers(dir, seed, 3);
    }
    let cluster =
        Served::on_checkpoint("2", "2", &a, tmp.path(), &["--state-dir", state.to_str().unwrap(), "--inject-fault", "1:slow-stage"]);
    let first = cluster.update_in_background(&["--checkpoint", b.to_str().unwrap(), "--json"]);
    wait_for_journal(&state, Duration::from_secs(60), |e| has_step(e, 0, "staging"));
    let mut second = cluster.update_in_background(&["--checkpoint", c.to_str().unwrap(), "--json"]);
    // Its request reaches the coordinator and waits there; then its client is gone.
    std::thread::sleep(Duration::from_millis(700));
    second.kill().unwrap();
    second.wait().unwrap();
    let o = first.wait_with_output().unwrap();
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let version_b = serde_json::from_slice::<Value>(&o.stdout).unwrap()["update"]["new_version"].as_str().unwrap().to_string();
    // Time for a waiting update to begin, had it been left waiting.
    std::thread::sleep(Duration::from_secs(2));
    let events = orchestrator_e2e::journal(&state);
    let begins: Vec<&Value> = events.iter().filter(|e| e["event"] == "update_begin").collect();
    assert_eq!(begins.len(), 1, "{events:#?}");
    assert!(versions(&cluster.report()).iter().all(|v| *v == version_b));
}

#[test]
fn a_worker_killed_mid_stage_leaves_its_group_on_the_old_version() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, state) = (tmp.path().join("A"), tmp.path().join("B"), tmp.path().join("state"));
    // Worker 3 (dp1/tp1) stages slowly (a second per layer: 5 s), so the kill lands mid-stage,
    // after dp0 (staging beside it) was verified and swapped.
    orchestrator_e2e::synth_tiny_layers(&a, "1", 5);
    orchestrator_e2e::synth_tiny_layers(&b, "2", 5);
    let cluster =
        Served::on_checkpoint("2", "2", &a, tmp.path(), &["--state-dir", state.to_str().unwrap(), "--inject-fault", "3:slow-stage"]);
    let before = cluster.report();
    let version_a = versions(&before)[0].clone();
    let load = cluster.probe_load("10", "6");
    let update = cluster.update_in_background(&["--checkpoint", b.to_str().unwrap(), "--json"]);
    // Every replica stages at once; dp0 is verified and swapped while dp1 still stages.
    let events = wait_for_journal(&state, Duration::from_secs(60), |e| has_step(e, 0, "committed") && has_step(e, 1, "staging"));
    assert!(!has_step(&events, 1, "verified"), "dp1 is still staging: {events:#?}");
    let at = |dp: u32, step: &str| events.iter().position(|e| e["event"] == "update_step" && e["dp"] == dp && e["step"] == step);
    assert!(at(1, "staging") < at(0, "verified"), "both replicas stage at once, dp1 before dp0 is verified: {events:#?}");
    // Mid-update (dp0 swapped to B, dp1 staging on A) the report is consistent and says why the
    // replicas differ.
    let mid = cluster.report();
    assert_eq!(mid["ok"], true, "{mid}");
    assert!(mid["notes"][0].as_str().is_some_and(|n| n.starts_with("an update is in flight")), "{mid}");
    let victim = events[0]["workers"].as_array().unwrap().iter().find(|w| w["id"] == 3).unwrap()["pid"].as_u64().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let killed = std::process::Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap();
    assert!(killed.success());

    let o = update.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}\n{}", stdout(&o), stderr(&o));
    let update: Value = serde_json::from_slice(&o.stdout).unwrap();
    let steps: Vec<&str> = update["update"]["steps"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let failed = steps.iter().find(|s| s.starts_with("replica dp1: FAILED")).unwrap_or_else(|| panic!("{steps:?}"));
    assert!(failed.contains("rank dp1/tp1") && failed.contains("exited") && failed.contains(&version_a), "{failed}");
    let version_b = update["update"]["new_version"].as_str().unwrap();
    assert_eq!(update["update"]["versions"]["0"], version_b);
    assert_eq!(update["update"]["versions"]["1"], version_a.as_str());
    // The surviving rank of dp1 still holds A, with nothing staged: never a mix with B.
    let after = cluster.report();
    let dp1_tp0 = after["ranks"].as_array().unwrap().iter().find(|r| r["dp"] == 1 && r["tp"] == 0).unwrap();
    assert_eq!(dp1_tp0["checkpoint_version"], version_a.as_str(), "{after}");
    // The journal closes the update as failed, dp1 aborted.
    let events = orchestrator_e2e::journal(&state);
    assert!(has_step(&events, 1, "aborted") && !has_step(&events, 1, "committed"), "{events:#?}");
    assert_eq!(events.last().unwrap()["event"], "update_end");
    assert_eq!(events.last().unwrap()["ok"], false);
    // Probes never failed while it happened (dp1 keeps serving while it stages; a probe that
    // meets its dying rank takes it out of rotation and is served by dp0), and the rest keep
    // serving: every later probe goes to dp0, on B.
    let probes = load.wait_with_output().unwrap();
    let probes: Value = serde_json::from_slice(&probes.stdout).unwrap();
    assert_eq!(probes["failed"], 0, "{probes}");
    let probes = cluster.probe_load("20", "1").wait_with_output().unwrap();
    let probes: Value = serde_json::from_slice(&probes.stdout).unwrap();
    assert_eq!(probes["failed"], 0, "{probes}");
    assert_eq!(probes["by_replica"]["dp0"]["served"].as_u64().unwrap(), probes["served"].as_u64().unwrap(), "{probes}");
    assert!(probes["by_version"][version_b]["served"].as_u64().unwrap() > 0, "{probes}");
}

/// A version is verified against the reference once per tp_rank: the first replica runs it,
/// the second is verified as byte-identical to the first (digests of every rank, the same y).
/// That is the same check, not a weaker one: a second replica whose staged bytes differ (a
/// rank that skipped the permutation while staging) is refused and keeps the old version.
#[test]
fn a_version_is_verified_against_the_reference_once_and_later_replicas_by_identity() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let (a, b, c) = (root.join("A"), root.join("B"), root.join("C"));
    synth(&a, "1");
    synth(&b, "2");
    synth(&c, "3");
    // Rank 2 (dp1/tp0) skips the permutation in whatever it stages.
    let cluster = Served::on_checkpoint("2", "2", &a, &root, &["--inject-fault", "2:stage-skip-permute"]);
    let doc = cluster.update_doc(&b);
    assert_eq!(doc["ok"], false, "{doc:#}");
    let steps: Vec<String> = doc["update"]["steps"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect();
    let dp0 = steps.iter().find(|s| s.starts_with("replica dp0:")).unwrap();
    assert!(dp0.contains("verified against the reference") && dp0.contains("swapped to"), "{steps:#?}");
    let dp1 = steps.iter().find(|s| s.starts_with("replica dp1:")).unwrap();
    assert!(
        dp1.contains("rank dp1/tp0: staged kernel/source digests") && dp1.contains("the verified replica dp0's tp0 holds"),
        "{steps:#?}"
    );
    let held = versions(&doc["report"]);
    assert_ne!(held[0], held[2], "dp1 kept the old version: {held:?}");
    assert_eq!(held[2], held[3], "dp1's ranks agree: {held:?}");
    drop(cluster);

    // Without the fault: dp1 is verified by identity to dp0, and both end on the new version.
    let cluster = Served::on_checkpoint("2", "2", &a, &root, &[]);
    let launched: Vec<f64> = cluster.report()["ranks"].as_array().unwrap().iter().map(|r| r["load_seconds"].as_f64().unwrap()).collect();
    let doc = cluster.update_doc(&c);
    assert_eq!(doc["ok"], true, "{doc:#}");
    assert!(doc["update"].get("failure").is_none(), "no failure when every replica took the version: {doc:#}");
    let steps = doc["update"]["steps"].to_string();
    assert!(steps.contains("replica dp0: staged in") && steps.contains("verified against the reference"), "{steps}");
    assert!(steps.contains("verified as byte-identical to dp0"), "{steps}");
    // Each replica is verified while it serves, and leaves rotation for its swap alone, once
    // the routed probes it was serving are answered.
    for dp in 0..2 {
        let step = doc["update"]["steps"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s.as_str())
            .find(|s| s.starts_with(&format!("replica dp{dp}:")))
            .unwrap();
        // dp0 runs the round trips; dp1 adopts their verdicts by its digests.
        let verified =
            if dp == 0 { ", in rotation (round trips" } else { ", in rotation (digests of every rank, so its round trips' verdicts" };
        assert!(step.contains(verified) && step.contains("; out of rotation (its routed probes answered in"), "{step}");
    }
    let v = versions(&doc["report"]);
    assert!(v.iter().all(|x| *x == v[0]), "{v:?}");
    // The report the update answers with stands on each replica's probe after its swap (the
    // same probe: against the kept reference on dp0, kernel pass and identity on dp1), and
    // says so; a later report probes again.
    let rows = doc["report"]["ranks"].as_array().unwrap();
    assert!(rows.iter().all(|r| r["probe"]["after_swap"] == true && r["probe"]["ok"] == true), "{:#}", doc["report"]);
    assert!(rows.iter().filter(|r| r["dp"] == 0).all(|r| r["probe"]["reference_seconds"].as_f64().unwrap() > 0.0), "{rows:#?}");
    assert!(rows.iter().filter(|r| r["dp"] == 1).all(|r| r["probe"]["verified_by_replica"] == 0), "{rows:#?}");
    let notes = doc["report"]["notes"].to_string();
    assert!(notes.contains("probed by the update right after their swap"), "{:#}", doc["report"]);
    // Its round trips are the ones each rank's stage ran on the weights it committed.
    assert!(notes.contains("round trip is the one its stage ran on the weights it committed"), "{notes}");
    assert!(rows.iter().all(|r| r["round_trip_ok"] == true), "{rows:#?}");
    for r in rows {
        let adopted = if r["dp"] == 0 { None } else { Some(format!("dp0/tp{}", r["tp"])) };
        assert_eq!(r["round_trip_identical_to"].as_str().map(String::from), adopted, "{r:#}");
    }
    assert!(doc["report"]["timings"].get("probe").is_none(), "{}", doc["report"]["timings"]);
    let again = cluster.cmd("report", &["--json"]);
    let again: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert!(again["ranks"].as_array().unwrap().iter().all(|r| r["probe"].get("after_swap").is_none()), "{again:#}");
    assert!(again["timings"]["probe"].as_f64().unwrap() > 0.0, "{}", again["timings"]);
    let ys = |r: &Value| -> Vec<String> { r["ranks"].as_array().unwrap().iter().map(|r| r["probe"]["y_digest"].to_string()).collect() };
    assert_eq!(ys(&doc["report"]), ys(&again));
    // After the update each rank reports its staging time, not the launch's load.
    let report = cluster.report();
    let load: Vec<f64> = report["ranks"].as_array().unwrap().iter().map(|r| r["load_seconds"].as_f64().unwrap()).collect();
    assert!(load.iter().all(|s| *s > 0.0), "{load:?}");
    assert!(load.iter().zip(&launched).all(|(after, before)| after != before), "staging times {load:?}, launch {launched:?}");
    // And the report's timings are the update's, with none of the launch's.
    let timings = &report["timings"];
    assert_eq!(timings["update"].as_f64(), doc["update"]["seconds"].as_f64(), "{timings}");
    assert!(timings.get("load").is_none() && timings.get("startup").is_none() && timings.get("total").is_none(), "{timings}");
}

/// The first replica's round trip runs while it stages (it is what verification reads): a rank
/// that staged wrong layouts fails it, and every rank keeps the old version.
#[test]
fn a_first_replica_that_staged_wrong_layouts_fails_its_staged_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let (a, b) = (root.join("A"), root.join("B"));
    synth(&a, "1");
    synth(&b, "2");
    let cluster = Served::on_checkpoint("2", "2", &a, &root, &["--inject-fault", "0:stage-skip-permute"]);
    let before = versions(&cluster.report());
    let doc = cluster.update_doc(&b);
    assert_eq!(doc["ok"], false, "{doc:#}");
    let steps: Vec<&str> = doc["update"]["steps"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let dp0 = steps.iter().find(|s| s.starts_with("replica dp0: FAILED")).unwrap_or_else(|| panic!("{steps:#?}"));
    assert!(dp0.contains("rank dp0/tp0: staged round trip failed"), "{dp0}");
    // The same as data: which check, which replica and rank, and the round trip's failures
    // tensor by tensor (a layer-0 tensor whose permutation was skipped among them).
    let failure = &doc["update"]["failure"];
    assert_eq!(failure["kind"], "round_trip", "{failure:#}");
    assert_eq!(failure["refused"], false, "{failure:#}");
    assert_eq!(failure["replicas"], serde_json::json!([0]), "{failure:#}");
    assert_eq!(failure["rank"], "dp0/tp0", "{failure:#}");
    let details = failure["round_trip"].as_array().unwrap();
    assert!(
        details.iter().any(|d| d["kind"] == "mismatch" && d["tensor"].as_str().is_some_and(|t| t.starts_with("layers.0.attn."))),
        "{failure:#}"
    );
    assert!(failure["why"].as_str().unwrap().contains("staged round trip failed"), "{failure:#}");
    assert_eq!(versions(&cluster.report()), before, "every rank keeps A");
}

/// `--keep-staging-buffers`: each rank prepares a spare set of buffers after the launch (in
/// the background) and keeps the buffers an update leaves, and every stage, the first one
/// included, reloads into them (`restage`), byte for byte what a fresh stage gives; without the
/// flag every stage gets fresh buffers.
#[test]
fn kept_staging_buffers_are_restaged_into_with_the_same_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let (a, b) = (root.join("A"), root.join("B"));
    synth(&a, "1");
    synth(&b, "2");
    let paths = |r: &Value| -> Vec<String> {
        r["ranks"].as_array().unwrap().iter().map(|r| r["load_path"].as_str().unwrap().to_string()).collect()
    };
    let spares = |r: &Value| -> Vec<bool> { r["ranks"].as_array().unwrap().iter().map(|r| r["spare_buffers"] == true).collect() };
    let update = |cluster: &Served, to: &Path| {
        let doc = cluster.update_doc(to);
        assert_eq!(doc["ok"], true, "{doc:#}");
        cluster.report()
    };
    let kept = Served::on_checkpoint("2", "2", &a, &root, &["--keep-staging-buffers"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let launched = loop {
        let r = kept.report();
        if spares(&r).iter().all(|s| *s) {
            break r;
        }
        assert!(std::time::Instant::now() < deadline, "the spare buffers were never prepared: {:?}", spares(&r));
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let on_b = update(&kept, &b);
    assert!(paths(&on_b).iter().all(|p| p == "restage"), "the first update restages into the spare: {:?}", paths(&on_b));
    assert!(spares(&on_b).iter().all(|s| *s), "the replaced version is the next spare: {:?}", spares(&on_b));
    let back = update(&kept, &a);
    assert!(paths(&back).iter().all(|p| p == "restage"), "{:?}", paths(&back));
    assert_eq!(rank_digests(&back), rank_digests(&launched), "restaged A is the launched A");
    let again = update(&kept, &b);
    assert_eq!(rank_digests(&again), rank_digests(&on_b), "restaged B is B again");
    assert_eq!(again["ok"], true, "{again:#}");
    drop(kept);

    let fresh = Served::on_checkpoint("2", "2", &a, &root, &[]);
    let fresh_b = update(&fresh, &b);
    assert!(paths(&fresh_b).iter().all(|p| p == "stage"), "{:?}", paths(&fresh_b));
    assert_eq!(rank_digests(&fresh_b), rank_digests(&on_b), "a fresh stage of B is the restaged B");
    let back = update(&fresh, &a);
    assert!(paths(&back).iter().all(|p| p == "stage"), "{:?}", paths(&back));
    assert!(spares(&back).iter().all(|s| !*s), "nothing is kept without the flag: {:?}", spares(&back));
}
