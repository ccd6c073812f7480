//! End to end: `orchestrator coordinator` with workers it did not start, registering by rank
//! the way engines start them (`--rank auto` from Slurm's variables here; the real Slurm and
//! network-namespace runs are `slurm.rs` and `netns.rs`). Readiness follows verification; the
//! report names every rank's host; refusals and a join timeout name ranks and hosts.

use std::time::Duration;

use orchestrator_e2e::{Standalone, eventually, stderr, synth_tiny};
use serde_json::Value;

fn slurm_env(rank: u32, world: u32, host: &str) -> Vec<(&'static str, String)> {
    vec![
        ("SLURM_PROCID", rank.to_string()),
        ("SLURM_NTASKS", world.to_string()),
        ("SLURM_LOCALID", (rank % 2).to_string()),
        ("SLURMD_NODENAME", host.to_string()),
    ]
}

fn env_refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// A coordinator for a TP 2 dummy `tiny` cluster that waits `join_timeout` seconds for its ranks.
fn tiny_pair(dir: &std::path::Path, join_timeout: &str) -> Standalone {
    let args = ["--tp", "2", "--dp", "1", "--dummy", "--preset", "tiny", "--layers", "1", "--join-timeout", join_timeout];
    Standalone::start(&[], "127.0.0.1:0", &dir.join("token"), &args)
}

fn rank(report: &Value, dp: u64, tp: u64) -> &Value {
    report["ranks"].as_array().unwrap().iter().find(|r| r["dp"] == dp && r["tp"] == tp).unwrap()
}

/// TP 2 x DP 2 over two "hosts" (two ranks each, one TP group per host), started apart with
/// `--rank auto`: CONSISTENT, each rank on its host, readiness NOT_SERVING until verified and
/// SERVING after; an update takes a replica's ranks out of readiness mid-swap and back; a
/// killed worker is named by rank and host, its replica's peer drops out of readiness and the
/// coordinator stays ready on the other replica.
#[test]
fn workers_started_apart_join_verify_and_follow_rotation() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("ckpt/A"), tmp.path().join("ckpt/B"));
    synth_tiny(&a, "1");
    synth_tiny(&b, "2");
    let token = tmp.path().join("token");
    let root = tmp.path().join("ckpt");
    let mut c = Standalone::start(
        &[],
        "127.0.0.1:0",
        &token,
        &[
            "--tp",
            "2",
            "--dp",
            "2",
            "--checkpoint",
            a.to_str().unwrap(),
            "--allow-root",
            root.to_str().unwrap(),
            "--probe",
            "2,16",
            "--serve",
            "--json",
            "--inject-fault",
            "0:slow-commit",
        ],
    );
    // Nothing registered yet: the coordinator is alive but not ready.
    assert_eq!(c.health(&c.url, "", "0"), "NOT_SERVING");
    assert_eq!(c.health(&c.url, "liveness", "0"), "SERVING");
    for r in 0..4u32 {
        let env = slurm_env(r, 4, if r < 2 { "node-a" } else { "node-b" });
        let log = tmp.path().join(format!("w{r}.log"));
        // A grace long enough to outlive the stop below (a worker whose coordinator is silent
        // longer stops on its own).
        let args = ["--rank", "auto", "--allow-root", root.to_str().unwrap(), "--coordinator-grace", "60"];
        c.worker(&[], &env_refs(&env), &args, &log);
    }
    c.wait_serving(Duration::from_secs(60));
    assert_eq!(c.health(&c.url, "", "10"), "SERVING");
    let report = c.report();
    assert_eq!(report["ok"], true, "{report:#}");
    for r in report["ranks"].as_array().unwrap() {
        let want = if r["dp"] == 0 { "node-a" } else { "node-b" };
        assert_eq!(r["host"], want, "{r:#}");
        assert_eq!(r["started_by"], "slurm", "{r:#}");
        // Every worker is ready: its replica serves verified weights.
        assert_eq!(c.health(r["address"].as_str().unwrap(), "", "10"), "SERVING", "{r:#}");
    }
    let hosts = report["hosts"].as_array().unwrap();
    assert_eq!(hosts.len(), 2, "{report:#}");
    assert_eq!((hosts[0]["host"].as_str(), hosts[0]["ok"].as_u64(), hosts[0]["failed"].as_u64()), (Some("node-a"), Some(2), Some(0)));
    let rank0 = rank(&report, 0, 0)["address"].as_str().unwrap().to_string();

    // A rolling update: rank 0 holds its commit a second, and its replica is out of rotation (not
    // ready) from its verification to the swap and the probe after it.
    let update = std::process::Command::new(orchestrator_e2e::bin("orchestrator"))
        .args(["update", "--coordinator", &c.url, "--token-file", token.to_str().unwrap(), "--checkpoint", b.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    eventually(Duration::from_secs(30), "rank 0 to leave readiness during the update", || {
        (c.health(&rank0, "", "0") == "NOT_SERVING").then_some(())
    });
    let out = update.wait_with_output().unwrap();
    assert!(out.status.success(), "{}{}", orchestrator_e2e::stdout(&out), stderr(&out));
    assert_eq!(c.health(&rank0, "", "10"), "SERVING", "rank 0 is ready again on the verified new version");

    // Stop dp1/tp1 (node-b) past the silence after which a remote rank is presumed dead (12 s),
    // then let it go on: its replica, marked dead meanwhile, serves again once its probe passes
    // (before, dead was for good: the same processes answering again stayed out, and updates
    // skipped them).
    let victim = rank(&report, 1, 1)["pid"].as_u64().unwrap();
    let replica = |r: &Value| (r["replicas"][1]["serving"].as_bool().unwrap(), r["replicas"][1]["dead"].as_bool().unwrap());
    assert!(std::process::Command::new("kill").args(["-STOP", &victim.to_string()]).status().unwrap().success());
    eventually(Duration::from_secs(40), "dp1 presumed dead", || (replica(&c.report()) == (false, true)).then_some(()));
    assert!(std::process::Command::new("kill").args(["-CONT", &victim.to_string()]).status().unwrap().success());
    eventually(Duration::from_secs(30), "dp1 back in rotation", || (replica(&c.report()) == (true, false)).then_some(()));

    // Kill dp1/tp1 (node-b): named by rank and host; its peer leaves readiness; dp0 serves on.
    let peer = rank(&report, 1, 0)["address"].as_str().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap().success());
    let report = eventually(Duration::from_secs(30), "the killed rank in the report", || {
        let r = c.report();
        rank(&r, 1, 1)["failure"].as_str().is_some_and(|f| f.contains("dead")).then_some(r)
    });
    let failure = rank(&report, 1, 1)["failure"].as_str().unwrap();
    assert!(failure.contains("dp1/tp1") && failure.contains("host node-b"), "{failure}");
    let b_summary = report["hosts"].as_array().unwrap().iter().find(|h| h["host"] == "node-b").unwrap();
    assert!(b_summary["failed"].as_u64().unwrap() >= 1, "{report:#}");
    eventually(Duration::from_secs(20), "the dead rank's peer to leave readiness", || {
        (c.health(&peer, "", "0") == "NOT_SERVING").then_some(())
    });
    assert_eq!(c.health(&c.url, "", "0"), "SERVING", "the coordinator still serves on dp0");
}

/// Past `--join-timeout`, the coordinator names the missing ranks and the hosts that joined,
/// exits non-zero, and tells the workers that joined to stop.
#[test]
fn a_join_timeout_names_the_missing_ranks_and_the_hosts_that_joined() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_pair(tmp.path(), "3");
    let env = slurm_env(0, 2, "node-a");
    c.worker(&[], &env_refs(&env), &["--rank", "auto"], &tmp.path().join("w0.log"));
    let (status, out) = c.wait_exit(Duration::from_secs(30));
    assert!(!status.success());
    assert!(out.contains("rank 1 (dp0/tp1) did not register within 3 s (joined: node-a: ranks [0])"), "{out}");
    // The worker that joined was asked to stop.
    let mut w = c.workers.pop().unwrap();
    eventually(Duration::from_secs(15), "the joined worker to stop", || w.try_wait().unwrap());
}

/// A duplicate, out-of-range or other-world rank, or a worker that cannot find its rank, is
/// refused at once with a message naming the rank and host; the cluster then forms from the
/// right workers.
#[test]
fn bad_registrations_are_refused_naming_rank_and_host() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_pair(tmp.path(), "60");
    let mut first = slurm_env(0, 2, "node-a");
    first.push(("RUST_LOG", "info".into()));
    c.worker(&[], &env_refs(&first), &["--rank", "auto"], &tmp.path().join("w0.log"));
    // Let rank 0 register before its twin.
    eventually(Duration::from_secs(10), "rank 0 to register", || {
        std::fs::read_to_string(tmp.path().join("w0.log")).ok().filter(|l| l.contains("worker serving")).map(|_| ())
    });
    std::thread::sleep(Duration::from_millis(500));
    let refused = |env: Vec<(&'static str, String)>, args: &[&str], name: &str| {
        let log = tmp.path().join(format!("{name}.log"));
        let status = c.worker_command(&[], &env_refs(&env), args, &log).status().unwrap();
        assert!(!status.success(), "{name} was admitted");
        std::fs::read_to_string(&log).unwrap()
    };
    let twin = refused(slurm_env(0, 2, "node-b"), &["--rank", "auto"], "twin");
    assert!(
        twin.contains("rank 0") && twin.contains("host node-b") && twin.contains("held by pid") && twin.contains("host node-a"),
        "{twin}"
    );
    let far = refused(vec![("ORCHESTRATOR_NODE_NAME", "node-c".into())], &["--rank", "7"], "far");
    assert!(far.contains("rank 7 (flag) on host node-c is out of range: this cluster has 2 ranks, 0 to 1"), "{far}");
    let other_world = refused(slurm_env(1, 8, "node-b"), &["--rank", "auto"], "world");
    assert!(other_world.contains("rank 1 on host node-b was started in a world of 8 tasks"), "{other_world}");
    let lost = refused(vec![], &["--rank", "auto"], "lost");
    assert!(lost.contains("--rank auto: no engine variables found"), "{lost}");
    let second = slurm_env(1, 2, "node-b");
    c.worker(&[], &env_refs(&second), &["--rank", "auto"], &tmp.path().join("w1.log"));
    let (status, out) = c.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{out}");
    assert!(out.contains("CONSISTENT") && out.contains("host node-a: 1 rank (dp0/tp0), 1 ok"), "{out}");
}

/// A standalone coordinator killed outright is recovered from its state directory: the workers
/// an engine started (kept alive by their `--coordinator-grace`) are adopted as remote ranks,
/// still named by host, and the cluster serves CONSISTENT again; shutdown then stops them.
#[test]
fn a_standalone_coordinator_is_recovered_and_adopts_the_remote_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("token");
    let state = tmp.path().join("state");
    let mut c = Standalone::start(
        &[],
        "127.0.0.1:0",
        &token,
        &["--tp", "2", "--dp", "1", "--dummy", "--preset", "tiny", "--layers", "1", "--serve", "--state-dir", state.to_str().unwrap()],
    );
    for r in 0..2u32 {
        let env = slurm_env(r, 2, if r == 0 { "node-a" } else { "node-b" });
        c.worker(&[], &env_refs(&env), &["--rank", "auto", "--coordinator-grace", "60"], &tmp.path().join(format!("w{r}.log")));
    }
    c.wait_serving(Duration::from_secs(60));
    let _ = c.child.kill();
    let _ = c.child.wait();
    let recovered = orchestrator_e2e::Served::recover(&state, &[]);
    let report = recovered.report();
    assert_eq!(report["ok"], true, "{report:#}");
    assert_eq!(rank(&report, 0, 1)["host"], "node-b", "{report:#}");
    drop(recovered);
    // The recovered coordinator's shutdown stopped the adopted workers (over gRPC).
    for w in &mut c.workers {
        eventually(Duration::from_secs(15), "an adopted worker to stop", || w.try_wait().unwrap());
    }
}
