//! End to end across hosts: the coordinator and two worker hosts in network namespaces of their
//! own (created and removed by the test), joined by veth pairs to a bridge in a fourth, with
//! addresses from the 198.18.0.0/15 benchmarking range only. TLS and the token on every call;
//! TP 2 x DP 2 with each TP group spanning both hosts. Needs root: it runs only with
//! `ORCHESTRATOR_E2E_NETNS=1` (CI sets it) and says it skipped otherwise.

use std::process::Command;
use std::time::Duration;

use orchestrator_e2e::{Standalone, bin, eventually, stderr};
use serde_json::Value;

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(out.status.success(), "ip {}: {}", args.join(" "), stderr(&out));
}

/// Namespaces `{tag}-br` (the bridge) and one per host, each host's `eth0` on the bridge with
/// its address; removed (with their links) when dropped.
struct Hosts {
    names: Vec<String>,
}

impl Hosts {
    fn create(tag: &str, hosts: &[(&str, &str)]) -> Self {
        let bridge = format!("{tag}-br");
        let mut me = Self { names: vec![bridge.clone()] };
        ip(&["netns", "add", &bridge]);
        ip(&["-n", &bridge, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &bridge, "link", "set", "br0", "up"]);
        for (i, (name, addr)) in hosts.iter().enumerate() {
            let ns = format!("{tag}-{name}");
            ip(&["netns", "add", &ns]);
            me.names.push(ns.clone());
            let (inside, outside) = (format!("{tag}i{i}"), format!("{tag}o{i}"));
            // Created inside the host namespace, its peer moved straight into the bridge's:
            // no link ever exists in the test machine's own namespace.
            ip(&["-n", &ns, "link", "add", &inside, "type", "veth", "peer", "name", &outside, "netns", &bridge]);
            ip(&["-n", &ns, "link", "set", &inside, "name", "eth0"]);
            ip(&["-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&["-n", &bridge, "link", "set", &outside, "master", "br0"]);
            ip(&["-n", &bridge, "link", "set", &outside, "up"]);
        }
        me
    }

    fn prefix(tag: &str, host: &str) -> Vec<String> {
        ["ip", "netns", "exec"].iter().map(|s| s.to_string()).chain([format!("{tag}-{host}")]).collect()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in self.names.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn rank(report: &Value, dp: u64, tp: u64) -> &Value {
    report["ranks"].as_array().unwrap().iter().find(|r| r["dp"] == dp && r["tp"] == tp).unwrap()
}

#[test]
fn tp_groups_spanning_two_hosts_over_tls_are_consistent_and_a_lost_host_is_named() {
    if std::env::var("ORCHESTRATOR_E2E_NETNS").as_deref() != Ok("1") {
        eprintln!("skipped: set ORCHESTRATOR_E2E_NETNS=1 (needs root; creates network namespaces)");
        return;
    }
    let tag = format!("orch{}", std::process::id() % 100_000);
    let hosts = Hosts::create(&tag, &[("coord", "198.18.0.1"), ("a", "198.18.0.2"), ("b", "198.18.0.3")]);
    let tmp = tempfile::tempdir().unwrap();
    let (tls, token) = (tmp.path().join("tls"), tmp.path().join("token"));
    let out = Command::new(bin("orchestrator")).args(["tls", "generate", "--out", tls.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let coord = Hosts::prefix(&tag, "coord");
    let mut c = Standalone::start(
        &coord,
        "198.18.0.1:50050",
        &token,
        &[
            "--tp",
            "2",
            "--dp",
            "2",
            "--dummy",
            "--preset",
            "tiny",
            "--layers",
            "2",
            "--probe",
            "2,16",
            "--serve",
            "--tls-dir",
            tls.to_str().unwrap(),
        ],
    );
    assert!(c.url.starts_with("https://198.18.0.1:"), "{}", c.url);
    // Rank r on host a (even) or b (odd): each TP group's two ranks are on different hosts.
    for r in 0..4u32 {
        let (host, addr) = if r % 2 == 0 { ("a", "198.18.0.2") } else { ("b", "198.18.0.3") };
        let prefix = Hosts::prefix(&tag, host);
        let name = format!("host-{host}");
        let log = tmp.path().join(format!("w{r}.log"));
        c.worker(&prefix, &[("ORCHESTRATOR_NODE_NAME", name.as_str())], &["--rank", &r.to_string(), "--advertise", addr], &log);
    }
    c.wait_serving(Duration::from_secs(60));
    let report = c.report();
    assert_eq!(report["ok"], true, "{report:#}");
    for r in report["ranks"].as_array().unwrap() {
        let (host, addr) = if r["tp"] == 0 { ("host-a", "https://198.18.0.2:") } else { ("host-b", "https://198.18.0.3:") };
        assert_eq!(r["host"], host, "{r:#}");
        assert!(r["address"].as_str().unwrap().starts_with(addr), "{r:#}");
    }
    // The probes ran over each group's ring between the hosts.
    let probed = c.cmd("report", &["--json"]);
    let probed: Value = serde_json::from_slice(&probed.stdout).unwrap();
    assert_eq!(probed["ok"], true, "{probed:#}");
    assert!(probed["ranks"].as_array().unwrap().iter().all(|r| r["probe"]["ok"] == true), "{probed:#}");
    assert_eq!(c.health(&c.url, "", "10"), "SERVING");

    // Host b goes away: both its workers killed. Each is named by host and rank.
    for tp1 in [rank(&report, 0, 1), rank(&report, 1, 1)] {
        assert!(Command::new("kill").args(["-KILL", &tp1["pid"].to_string()]).status().unwrap().success());
    }
    let report = eventually(Duration::from_secs(30), "host b's ranks to be reported lost", || {
        let r = c.report();
        (rank(&r, 0, 1)["failure"].is_string() && rank(&r, 1, 1)["failure"].is_string()).then_some(r)
    });
    for dp in 0..2 {
        let f = rank(&report, dp, 1)["failure"].as_str().unwrap();
        assert!(f.contains(&format!("dp{dp}/tp1")) && f.contains("host host-b"), "{f}");
        assert_eq!(rank(&report, dp, 0)["failure"], Value::Null, "host a's ranks still answer: {report:#}");
    }
    let b = report["hosts"].as_array().unwrap().iter().find(|h| h["host"] == "host-b").unwrap();
    assert_eq!(b["failed"], 2, "{report:#}");
    // Nothing serves verified weights any more: the coordinator is not ready.
    eventually(Duration::from_secs(20), "the coordinator to leave readiness", || {
        (c.health(&c.url, "", "0") == "NOT_SERVING").then_some(())
    });
    drop(c);
    drop(hosts);
}
