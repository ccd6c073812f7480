//! End to end: `orchestrator launch` with real worker processes on loopback.

use std::process::Command;
use std::time::{Duration, Instant};

use orchestrator_e2e::{Served, rank_digests, run, stderr, stdout};
use serde_json::Value;

fn launch_json(args: &[&str]) -> (Option<i32>, Value, String) {
    let mut full = vec!["launch", "--json"];
    full.extend_from_slice(args);
    let o = run("orchestrator", &full);
    let doc: Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("launch {args:?}: not JSON ({e}): {}\n{}", stdout(&o), stderr(&o)));
    (o.status.code(), doc, stderr(&o))
}

fn rule<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"].as_str().unwrap().starts_with(name))
        .unwrap_or_else(|| panic!("no rule {name}: {doc}"))
}

#[test]
fn consistent_at_every_tp_size_and_with_dp_2() {
    for (tp, dp) in [("1", "1"), ("2", "1"), ("4", "1"), ("8", "1"), ("2", "2")] {
        let (code, doc, err) = launch_json(&["--tp", tp, "--dp", dp, "--dummy", "--preset", "tiny", "--layers", "1", "--probe", "2,8"]);
        assert_eq!(code, Some(0), "tp {tp} dp {dp}: {doc}\n{err}");
        assert_eq!(doc["ok"], true);
        let n = tp.parse::<usize>().unwrap() * dp.parse::<usize>().unwrap();
        let ranks = doc["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), n, "--json carries every rank");
        for r in ranks {
            assert_eq!(r["verdict"], "ok");
            assert_eq!(r["round_trip_ok"], true);
            assert_eq!(r["probe"]["ok"], true);
            assert_eq!(r["kernel_tensors"].as_object().unwrap().len(), 7);
        }
        // The whole group shares one y (the all-reduce), and replicas agree.
        let ys: std::collections::BTreeSet<&str> = ranks.iter().map(|r| r["probe"]["y_digest"].as_str().unwrap()).collect();
        assert_eq!(ys.len(), 1, "tp {tp} dp {dp}: {ys:?}");
        for name in [
            "every rank answered",
            "replicas with the same tp_rank",
            "all layout identities",
            "every round trip",
            "every probe",
            "every rank of a TP group",
            "every DP replica",
        ] {
            assert_eq!(rule(&doc, name)["ok"], true, "{name}");
        }
    }
}

#[test]
fn dummy_and_real_loads_of_the_same_seed_agree_across_processes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let o =
        run("orchestrator", &["checkpoint", "synth", "--out", dir.to_str().unwrap(), "--preset", "tiny", "--layers", "2", "--seed", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let dump = tmp.path().join("dump");
    let (c1, real, e1) = launch_json(&[
        "--tp",
        "4",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--verify",
        "golden",
        "--probe",
        "2,8,1",
        "--dump",
        dump.to_str().unwrap(),
    ]);
    let (c2, dummy, e2) = launch_json(&["--tp", "4", "--dummy", "--preset", "tiny", "--layers", "2", "--seed", "4", "--probe", "2,8,1"]);
    assert_eq!((c1, c2), (Some(0), Some(0)), "{e1}\n{e2}");
    assert_eq!(rank_digests(&real), rank_digests(&dummy));
    assert_eq!(real["ranks"][0]["probe"]["y_digest"], dummy["ranks"][0]["probe"]["y_digest"]);
    assert_eq!(rule(&real, "kernel digests equal the coordinator's golden")["ok"], true);
    // Each worker's dump holds exactly the bytes its report describes.
    for r in real["ranks"].as_array().unwrap() {
        let path = dump.join(format!("dp{}/rank{}.safetensors", r["dp"], r["tp"]));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, digest) in r["kernel_tensors"].as_object().unwrap() {
            assert_eq!(&orchestrator_kernels::Digest::of(st.tensor(name).unwrap().data()).hex(), digest.as_str().unwrap(), "{name}");
        }
    }
}

/// Each injected fault fails the launch, and the report names the rank, the tensor and the rule.
#[test]
fn injected_faults_are_caught_and_named() {
    for kind in ["skip-permute", "double-permute", "stale-reload"] {
        let fault = format!("3:{kind}");
        let (code, doc, err) = launch_json(&[
            "--tp",
            "2",
            "--dp",
            "2",
            "--dummy",
            "--preset",
            "tiny",
            "--layers",
            "1",
            "--probe",
            "2,8",
            "--verify",
            "golden",
            "--inject-fault",
            &fault,
        ]);
        assert_eq!(code, Some(1), "{kind}: {doc}\n{err}");
        assert_eq!(doc["ok"], false);
        let bad = doc["ranks"].as_array().unwrap().iter().find(|r| r["dp"] == 1 && r["tp"] == 1).unwrap();
        assert_eq!(bad["verdict"], "FAIL", "{kind}");
        assert_eq!(bad["round_trip_ok"], false, "{kind}");
        // Its failures as data too, one per line, at least one a mismatch of a layer-0 tensor.
        let (lines, details) = (bad["round_trip_failures"].as_array().unwrap(), bad["round_trip_failure_details"].as_array().unwrap());
        assert_eq!(lines.len(), details.len(), "{kind}: {bad}");
        assert!(
            details.iter().any(|d| d["kind"] == "mismatch" && d["tensor"].as_str().is_some_and(|t| t.starts_with("layers.0.attn."))),
            "{kind}: {bad}"
        );
        assert_eq!(bad["probe"]["ok"], false, "{kind}");
        let healthy = doc["ranks"].as_array().unwrap().iter().find(|r| r["dp"] == 0 && r["tp"] == 0).unwrap();
        assert_eq!(healthy["verdict"], "ok", "{kind}");
        let replicas = rule(&doc, "replicas with the same tp_rank");
        assert_eq!(replicas["ok"], false);
        let finding = replicas["findings"][0].as_str().unwrap();
        assert!(finding.contains("rank dp0/tp1 and rank dp1/tp1") && finding.contains("layers.0.attn.wq_b.weight"), "{kind}: {finding}");
        let golden = rule(&doc, "kernel digests equal the coordinator's golden");
        assert!(golden["findings"].as_array().unwrap().iter().all(|f| f.as_str().unwrap().starts_with("rank dp1/tp1")), "{kind}: {golden}");
        let rt = rule(&doc, "every round trip");
        assert!(rt["findings"][0].as_str().unwrap().contains("wq_b"), "{kind}: {rt}");
        assert_eq!(rule(&doc, "every DP replica")["ok"], false, "{kind}");
    }
}

#[test]
fn a_worker_that_dies_during_load_is_reported_by_rank_without_hanging() {
    let start = Instant::now();
    let (code, doc, err) =
        launch_json(&["--tp", "4", "--dummy", "--preset", "tiny", "--layers", "2", "--inject-fault", "2:crash-during-load"]);
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    assert_eq!(code, Some(1), "{doc}\n{err}");
    let dead = doc["ranks"].as_array().unwrap().iter().find(|r| r["tp"] == 2).unwrap();
    let failure = dead["failure"].as_str().unwrap();
    assert!(failure.contains("rank dp0/tp2") && failure.contains("exited"), "{failure}");
    assert_eq!(rule(&doc, "every rank answered")["ok"], false);
}

#[test]
fn tp_16_on_64_heads_is_refused_before_any_process_starts() {
    let o = run("orchestrator", &["launch", "--tp", "16", "--dummy", "--preset", "tiny"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("leaves 4 heads per rank; mega attention needs 8 per group"), "{err}");
    assert!(!err.contains("coordinator listening") && !err.contains("starting"), "nothing may start: {err}");
}

/// `--serve` keeps the cluster up; `report` re-runs the checks; a worker killed with SIGKILL is
/// reported by rank within seconds; `shutdown` stops everything.
#[test]
fn serve_report_kill_and_shutdown() {
    let mut cluster = Served::start(&["--tp", "2", "--dummy", "--preset", "tiny", "--layers", "1", "--probe", "2,8", "--json"]);
    let (coordinator, token) = (cluster.coordinator.clone(), cluster.token.clone());

    // Without the token, or with a wrong one, control requests are refused and change nothing.
    let wrong = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(wrong.path(), "0123456789abcdef0123456789abcdef").unwrap();
    for extra in [vec![], vec!["--token-file", wrong.path().to_str().unwrap()]] {
        for command in ["report", "shutdown"] {
            let mut args = vec![command, "--coordinator", coordinator.as_str()];
            args.extend(&extra);
            let o = run("orchestrator", &args);
            assert_eq!(o.status.code(), Some(2), "{command} {extra:?}: {}", stdout(&o));
            assert!(stderr(&o).contains("missing or wrong token"), "{}", stderr(&o));
        }
    }
    let report = run("orchestrator", &["report", "--coordinator", &coordinator, "--token-file", &token, "--json"]);
    assert!(report.status.success(), "{}", stderr(&report));
    let doc: Value = serde_json::from_slice(&report.stdout).unwrap();
    assert_eq!(doc["ok"], true);
    let pid = doc["ranks"][1]["pid"].as_u64().unwrap();
    // Kill rank tp1's worker.
    let killed = Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    assert!(killed.success());
    let start = Instant::now();
    let report = run("orchestrator", &["report", "--coordinator", &coordinator, "--token-file", &token, "--json"]);
    assert!(start.elapsed() < Duration::from_secs(20), "report hung for {:?}", start.elapsed());
    assert_eq!(report.status.code(), Some(1), "{}", stdout(&report));
    let doc: Value = serde_json::from_slice(&report.stdout).unwrap();
    let dead = doc["ranks"].as_array().unwrap().iter().find(|r| r["tp"] == 1).unwrap();
    assert!(dead["failure"].as_str().unwrap().contains("rank dp0/tp1"), "{dead}");
    let shut = run("orchestrator", &["shutdown", "--coordinator", &coordinator, "--token-file", &token]);
    assert!(shut.status.success(), "{}", stderr(&shut));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if cluster.child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "the coordinator did not stop");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM (what Kubernetes and Slurm send) stops a served cluster gracefully: the workers are
/// shut down, the generated token file is removed, and the coordinator exits.
#[test]
fn sigterm_stops_a_served_cluster_and_its_workers() {
    let mut cluster = Served::start(&["--tp", "2", "--dummy", "--preset", "tiny", "--layers", "1", "--no-probe"]);
    let doc = cluster.report();
    let pids: Vec<u64> = doc["ranks"].as_array().unwrap().iter().map(|r| r["pid"].as_u64().unwrap()).collect();
    assert_eq!(pids.len(), 2);
    let term = Command::new("kill").args(["-TERM", &cluster.child.id().to_string()]).status().unwrap();
    assert!(term.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = cluster.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the coordinator did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0));
    for pid in pids {
        let alive = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.rsplit_once(") ").unwrap().1.starts_with('Z'));
        assert!(!alive, "worker {pid} outlived its coordinator");
    }
    assert!(!std::path::Path::new(&cluster.token).exists(), "the generated token file {} was left behind", cluster.token);
}

/// `--ready-file`: a stale file is replaced (a waiter tells the launch's own by its pid); once
/// the cluster serves the file says, as JSON, how to call it (a report through those values
/// passes), and it is gone once the cluster shut down.
#[test]
fn a_served_launch_writes_its_ready_file_and_removes_it_when_it_stops() {
    let tmp = tempfile::tempdir().unwrap();
    let ready_file = tmp.path().join("ready.json");
    std::fs::write(&ready_file, "stale").unwrap();
    let mut child = Command::new(orchestrator_e2e::bin("orchestrator"))
        .args(["launch", "--serve", "--dummy", "--preset", "tiny", "--layers", "1", "--tp", "2", "--ready-file"])
        .arg(&ready_file)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let ready: Value = loop {
        let read = std::fs::read_to_string(&ready_file).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok());
        if let Some(ready) = read.filter(|r| r["pid"].as_u64() == Some(child.id() as u64)) {
            break ready;
        }
        assert!(child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(60), "the launch never served");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(ready.get("tls_dir").is_none(), "{ready}");
    let (url, token) = (ready["coordinator"].as_str().unwrap(), ready["token_file"].as_str().unwrap());
    let report = run("orchestrator", &["report", "--coordinator", url, "--token-file", token]);
    assert!(report.status.success() && stdout(&report).contains("CONSISTENT"), "{}{}", stdout(&report), stderr(&report));
    let stop = run("orchestrator", &["shutdown", "--coordinator", url, "--token-file", token]);
    assert!(stop.status.success(), "{}", stderr(&stop));
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(30), "the launch did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!ready_file.exists(), "the ready file outlived the cluster");
}
