//! End to end on a real Slurm cluster: Debian's slurmctld and three slurmd emulating nodes
//! n1..n3 on 127.0.0.1..3 (`deploy/slurm/local-cluster.sh`), and the user's batch script
//! (`deploy/slurm/orchestrator.sbatch`) submitted with `sbatch` over two nodes. Needs root and
//! Debian's Slurm packages (the script installs them): it runs only with
//! `ORCHESTRATOR_E2E_SLURM=1` (CI sets it) and says it skipped otherwise.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use orchestrator_e2e::{bin, eventually, stderr, stdout, synth_tiny};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A local Slurm cluster, stopped (by pid) when dropped.
struct LocalSlurm {
    dir: PathBuf,
    conf: String,
}

impl LocalSlurm {
    fn start(dir: &Path) -> Self {
        let out = Command::new(repo().join("deploy/slurm/local-cluster.sh")).arg("start").arg(dir).arg("3").output().unwrap();
        assert!(out.status.success(), "local-cluster.sh start:\n{}{}", stdout(&out), stderr(&out));
        let conf = stdout(&out).lines().last().and_then(|l| l.strip_prefix("export SLURM_CONF=")).unwrap().trim().to_string();
        Self { dir: dir.to_path_buf(), conf }
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// `sbatch --parsable ARGS` from `workdir`: the job id.
    fn submit(&self, workdir: &Path, args: &[&str]) -> String {
        let out = self
            .cmd("sbatch")
            .current_dir(workdir)
            .env("ORCHESTRATOR_BIN_DIR", bin("orchestrator").parent().unwrap())
            .arg("--parsable")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "sbatch: {}", stderr(&out));
        stdout(&out).trim().split(';').next().unwrap().to_string()
    }

    /// The job's state (`COMPLETED`, `RUNNING`, ...).
    fn state(&self, job: &str) -> String {
        let out = self.cmd("scontrol").args(["-o", "show", "job", job]).output().unwrap();
        stdout(&out).split_whitespace().find_map(|w| w.strip_prefix("JobState=")).unwrap_or("GONE").to_string()
    }

    fn wait_done(&self, job: &str, limit: Duration) -> String {
        eventually(limit, &format!("job {job} to end"), || {
            let s = self.state(job);
            (!matches!(s.as_str(), "PENDING" | "RUNNING" | "COMPLETING" | "CONFIGURING")).then_some(s)
        })
    }
}

impl Drop for LocalSlurm {
    fn drop(&mut self) {
        let _ = Command::new(repo().join("deploy/slurm/local-cluster.sh")).arg("stop").arg(&self.dir).status();
    }
}

/// Processes of `job` of the cluster `slurm` still running: any whose environment names both
/// (job ids start again at 1 on every new cluster).
fn job_processes(slurm: &LocalSlurm, job: &str) -> Vec<String> {
    let needles = [format!("SLURM_JOB_ID={job}\0"), format!("SLURM_CONF={}\0", slurm.conf)];
    let mut left = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        if needles.iter().all(|n| environ.windows(n.len()).any(|w| w == n.as_bytes())) {
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            // Zombies waiting for init are gone already.
            if stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')) {
                continue;
            }
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            left.push(format!("{}: {}", entry.file_name().to_string_lossy(), String::from_utf8_lossy(&cmdline).replace('\0', " ")));
        }
    }
    left
}

/// KEY=VALUE lines of the env file the batch script writes.
fn env_file(path: &Path) -> Option<std::collections::BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).ok()?;
    let map: std::collections::BTreeMap<String, String> =
        text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    map.contains_key("COORDINATOR").then_some(map)
}

fn orchestrator(args: &[&str]) -> std::process::Output {
    Command::new(bin("orchestrator")).args(args).output().unwrap()
}

#[test]
fn a_batch_job_over_two_nodes_is_consistent_updates_under_load_names_a_killed_worker_and_leaves_nothing() {
    if std::env::var("ORCHESTRATOR_E2E_SLURM").as_deref() != Ok("1") {
        eprintln!("skipped: set ORCHESTRATOR_E2E_SLURM=1 (needs root; installs and starts a local Slurm cluster)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let slurm = LocalSlurm::start(&tmp.path().join("slurm"));
    let (root, work) = (tmp.path().join("ckpt"), tmp.path().join("work"));
    std::fs::create_dir_all(&work).unwrap();
    let (a, b) = (root.join("A"), root.join("B"));
    synth_tiny(&a, "1");
    synth_tiny(&b, "2");
    let script = repo().join("deploy/slurm/orchestrator.sbatch");
    let script = script.to_str().unwrap();
    let (a_s, b_s, root_s) = (a.to_str().unwrap(), b.to_str().unwrap(), root.to_str().unwrap());

    // 1. A batch job: the report ends the output, every rank on its node, CONSISTENT.
    let job = slurm
        .submit(&work, &["--nodes=2", "--ntasks-per-node=2", script, "--tp", "2", "--dp", "2", "--checkpoint", a_s, "--probe", "2,16"]);
    assert_eq!(slurm.wait_done(&job, Duration::from_secs(120)), "COMPLETED");
    let out = std::fs::read_to_string(work.join(format!("orchestrator-{job}.out"))).unwrap();
    assert!(out.trim_end().ends_with("CONSISTENT: every rank holds what its kernels expect"), "{out}");
    assert!(out.contains("host n1: 2 ranks (dp0/tp0 dp0/tp1), 2 ok, 0 failed"), "{out}");
    assert!(out.contains("host n2: 2 ranks (dp1/tp0 dp1/tp1), 2 ok, 0 failed"), "{out}");
    assert!(job_processes(&slurm, &job).is_empty(), "{:?}", job_processes(&slurm, &job));

    // 2. Served: an update rolls through under a probe load with no failed probe.
    let job = slurm.submit(
        &work,
        &[
            "--nodes=2",
            "--ntasks-per-node=2",
            script,
            "--tp",
            "2",
            "--dp",
            "2",
            "--checkpoint",
            a_s,
            "--allow-root",
            root_s,
            "--probe",
            "2,16",
            "--serve",
            "--json",
        ],
    );
    let env = eventually(Duration::from_secs(60), "the job's env file", || env_file(&work.join(format!("orchestrator-{job}.env"))));
    let (url, token) = (env["COORDINATOR"].clone(), env["TOKEN_FILE"].clone());
    let health = orchestrator(&["health", "--address", &url, "--wait", "60"]);
    assert!(health.status.success(), "the coordinator never became ready: {}", stdout(&health));
    let remote = ["--coordinator", url.as_str(), "--token-file", token.as_str()];
    let load = Command::new(bin("orchestrator"))
        .args(["probe"])
        .args(remote)
        .args(["--rate", "4", "--duration", "8", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let update = orchestrator(&[&["update"], &remote[..], &["--checkpoint", b_s, "--json"]].concat());
    assert!(update.status.success(), "{}{}", stdout(&update), stderr(&update));
    let load = load.wait_with_output().unwrap();
    let probes: Value = serde_json::from_slice(&load.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(&load)));
    assert_eq!(probes["failed"], 0, "{probes:#}");
    assert!(probes["served"].as_u64().unwrap() >= 30, "{probes:#}");
    let report: Value = serde_json::from_slice(&orchestrator(&[&["report"], &remote[..], &["--json"]].concat()).stdout).unwrap();
    assert_eq!(report["ok"], true, "{report:#}");
    let b_version = report["ranks"][0]["checkpoint_version"].clone();
    assert!(report["ranks"].as_array().unwrap().iter().all(|r| r["checkpoint_version"] == b_version), "{report:#}");

    // 3. A worker killed outright: named by rank and node.
    let victim = report["ranks"].as_array().unwrap().iter().find(|r| r["dp"] == 1 && r["tp"] == 0).unwrap();
    assert_eq!(victim["host"], "n2");
    assert!(Command::new("kill").args(["-KILL", &victim["pid"].to_string()]).status().unwrap().success());
    let failure = eventually(Duration::from_secs(30), "the killed worker in the report", || {
        let o = orchestrator(&[&["report"], &remote[..], &["--json", "--no-probe"]].concat());
        let r: Value = serde_json::from_slice(&o.stdout).ok()?;
        let row = r["ranks"].as_array()?.iter().find(|r| r["dp"] == 1 && r["tp"] == 0)?.clone();
        row["failure"].as_str().map(String::from)
    });
    assert!(failure.contains("dp1/tp0") && failure.contains("host n2"), "{failure}");

    // 4. Cancelling the job leaves no process behind.
    assert!(slurm.cmd("scancel").arg(&job).status().unwrap().success());
    slurm.wait_done(&job, Duration::from_secs(60));
    eventually(Duration::from_secs(30), "every process of the job to end", || job_processes(&slurm, &job).is_empty().then_some(()));
}
