//! End to end: the control plane over TLS (rustls): a served cluster with `--tls-dir`, clients
//! that must trust its CA, and the refusal to listen beyond loopback without TLS.

use orchestrator_e2e::{Served, run, stderr, stdout};
use serde_json::Value;

fn generate(dir: &std::path::Path) {
    let o = run("orchestrator", &["tls", "generate", "--out", dir.to_str().unwrap(), "--name", "node-1.example"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("node-1.example"));
}

#[test]
fn a_cluster_over_tls_serves_only_clients_that_trust_its_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let (tls, other) = (tmp.path().join("tls"), tmp.path().join("other-ca"));
    generate(&tls);
    generate(&other);
    // Beyond loopback, with TLS: coordinator and workers speak https.
    let cluster = Served::start(&[
        "--tp",
        "2",
        "--dummy",
        "--preset",
        "tiny",
        "--layers",
        "1",
        "--listen",
        "0.0.0.0:0",
        "--tls-dir",
        tls.to_str().unwrap(),
    ]);
    assert!(cluster.coordinator.starts_with("https://"), "{}", cluster.coordinator);
    let report = cluster.cmd("report", &["--json"]);
    assert!(report.status.success(), "{}", stderr(&report));
    let report: Value = serde_json::from_slice(&report.stdout).unwrap();
    assert_eq!(report["ok"], true, "{report}");

    let plain = cluster.coordinator.replace("https://", "http://");
    let with = |coordinator: &str, tls_dir: Option<&std::path::Path>| {
        let mut args = vec!["report", "--coordinator", coordinator, "--token-file", cluster.token.as_str(), "--no-probe"];
        if let Some(d) = tls_dir {
            args.extend(["--tls-dir", d.to_str().unwrap()]);
        }
        run("orchestrator", &args)
    };
    // Plain text to a TLS port, a CA the server is not from, or https without a CA: refused.
    for (what, o) in [
        ("plain http", with(&plain, None)),
        ("another CA", with(&cluster.coordinator, Some(&other))),
        ("no CA", with(&cluster.coordinator, None)),
    ] {
        assert_eq!(o.status.code(), Some(2), "{what}: {}", stdout(&o));
        assert!(!stdout(&o).contains("CONSISTENT"), "{what}");
    }
    let o = with(&cluster.coordinator, Some(&other));
    assert!(stderr(&o).to_lowercase().contains("certificate"), "{}", stderr(&o));
    let o = with(&cluster.coordinator, None);
    assert!(stderr(&o).contains("--tls-dir"), "{}", stderr(&o));
}

/// A rolling update and a probe load over TLS: every command and every worker call is https.
#[test]
fn rolling_updates_and_probes_work_over_tls() {
    let tmp = tempfile::tempdir().unwrap();
    let (tls, a, b) = (tmp.path().join("tls"), tmp.path().join("A"), tmp.path().join("B"));
    generate(&tls);
    orchestrator_e2e::synth_tiny(&a, "1");
    orchestrator_e2e::synth_tiny(&b, "2");
    let cluster = Served::on_checkpoint("1", "2", &a, tmp.path(), &["--tls-dir", tls.to_str().unwrap()]);
    assert!(cluster.coordinator.starts_with("https://"));
    let load = cluster.probe_load("10", "2");
    let o = cluster.cmd("update", &["--checkpoint", b.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let update: Value = serde_json::from_slice(&o.stdout).unwrap();
    let new_version = update["update"]["new_version"].as_str().unwrap();
    assert!(orchestrator_e2e::versions(&cluster.report()).iter().all(|v| v == new_version));
    let probes = load.wait_with_output().unwrap();
    let probes: Value = serde_json::from_slice(&probes.stdout).unwrap();
    assert_eq!(probes["failed"], 0, "{probes}");
    assert!(probes["served"].as_u64().unwrap() >= 15, "{probes}");
}

/// A coordinator restarted from its state directory serves over TLS again, and its workers
/// (which re-register over TLS) answer it.
#[test]
fn a_recovered_coordinator_keeps_tls() {
    let tmp = tempfile::tempdir().unwrap();
    let (tls, state) = (tmp.path().join("tls"), tmp.path().join("state"));
    generate(&tls);
    let args = ["--tp", "2", "--dummy", "--preset", "tiny", "--layers", "1", "--tls-dir", tls.to_str().unwrap(), "--state-dir"];
    let mut args = args.to_vec();
    args.push(state.to_str().unwrap());
    let mut first = Served::start(&args);
    let before = first.report();
    first.kill_coordinator();
    let cluster = Served::recover(&state, &[]);
    assert!(cluster.coordinator.starts_with("https://") && cluster.coordinator == first.coordinator, "{}", cluster.coordinator);
    let after = cluster.report();
    assert_eq!(after["ok"], true, "{after}");
    assert_eq!(orchestrator_e2e::rank_digests(&after), orchestrator_e2e::rank_digests(&before));
    assert_eq!(
        after["ranks"].as_array().unwrap().iter().map(|r| &r["pid"]).collect::<Vec<_>>(),
        before["ranks"].as_array().unwrap().iter().map(|r| &r["pid"]).collect::<Vec<_>>(),
        "the same worker processes"
    );
}

#[test]
fn listening_beyond_loopback_needs_tls() {
    let o = run("orchestrator", &["launch", "--tp", "1", "--dummy", "--preset", "tiny", "--layers", "1", "--listen", "0.0.0.0:0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not a loopback address") && stderr(&o).contains("--tls-dir"), "{}", stderr(&o));
    let tmp = tempfile::tempdir().unwrap();
    let o = run(
        "orchestrator",
        &["launch", "--tp", "1", "--dummy", "--preset", "tiny", "--layers", "1", "--tls-dir", tmp.path().to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("ca.pem"), "{}", stderr(&o));
}
