//! Helpers for end-to-end tests that run the real `orchestrator` and `orchestrator-worker`
//! binaries. `cargo test --workspace` builds both (their packages have integration tests), and
//! the binaries sit next to this test's `deps/` directory.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

/// Path of a workspace binary in the target directory this test runs from.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>/deps/..");
    let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(path.exists(), "{} is not built: run `cargo test --workspace` (or `cargo build --workspace`) first", path.display());
    path
}

/// Runs a binary to completion.
pub fn run(name: &str, args: &[&str]) -> Output {
    Command::new(bin(name)).args(args).output().unwrap_or_else(|e| panic!("running {name}: {e}"))
}

/// stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `(dp, tp, kernel rank digest)` of every rank of a consistency report (`--json`).
pub fn rank_digests(report: &serde_json::Value) -> Vec<(u64, u64, String)> {
    report["ranks"]
        .as_array()
        .expect("a report has ranks")
        .iter()
        .map(|r| (r["dp"].as_u64().unwrap_or(0), r["tp"].as_u64().unwrap_or(0), r["kernel_rank_digest"].as_str().unwrap_or("").to_string()))
        .collect()
}

/// A served cluster, killed (with its workers) if the test fails midway.
pub struct Served {
    pub child: Child,
    pub coordinator: String,
    pub token: String,
    /// `--tls-dir DIR` when the cluster runs over TLS.
    pub tls: Vec<String>,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.cmd("shutdown", &[]);
        // Let it stop its workers (adopted ones are not its children) before killing it.
        let start = std::time::Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) && start.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Served {
    /// `orchestrator launch --serve ARGS`, once it announces its address and token file.
    pub fn start(args: &[&str]) -> Self {
        let mut full = vec!["launch", "--serve"];
        full.extend_from_slice(args);
        Self::announced(&full)
    }

    /// `launch --serve --probe 2,16 --tp TP --dp DP --checkpoint DIR --allow-root ROOT EXTRA..`:
    /// the served cluster the update and recovery tests start from.
    pub fn on_checkpoint(tp: &str, dp: &str, checkpoint: &std::path::Path, root: &std::path::Path, extra: &[&str]) -> Self {
        let (checkpoint, root) = (checkpoint.to_str().unwrap(), root.to_str().unwrap());
        let mut args = vec!["--probe", "2,16", "--tp", tp, "--dp", dp, "--checkpoint", checkpoint, "--allow-root", root];
        args.extend_from_slice(extra);
        Self::start(&args)
    }

    /// `orchestrator recover --state-dir DIR ARGS`, once it serves.
    pub fn recover(state_dir: &std::path::Path, args: &[&str]) -> Self {
        let mut full = vec!["recover", "--state-dir", state_dir.to_str().unwrap()];
        full.extend_from_slice(args);
        Self::announced(&full)
    }

    /// Runs `orchestrator ARGS` until it announces the served cluster (stderr is drained on).
    fn announced(args: &[&str]) -> Self {
        let mut child = Command::new(bin("orchestrator")).args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut announced = None;
        let mut seen = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(rest) = line.strip_prefix("serving: `orchestrator report --coordinator ") {
                announced = Some(rest.split('`').next().unwrap().to_string());
                break;
            }
            seen.push(line);
        }
        std::thread::spawn(move || for _ in lines {});
        let announced = announced.unwrap_or_else(|| panic!("`orchestrator {}` did not come up:\n{}", args.join(" "), seen.join("\n")));
        let (coordinator, rest) = announced.split_once(" --token-file ").unwrap();
        let (token, tls) = match rest.split_once(" --tls-dir ") {
            Some((token, dir)) => (token, vec!["--tls-dir".to_string(), dir.to_string()]),
            None => (rest, Vec::new()),
        };
        Self { child, coordinator: coordinator.into(), token: token.into(), tls }
    }

    /// Kills the coordinator process outright (its workers stay up).
    pub fn kill_coordinator(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `orchestrator update ARGS` in the background.
    pub fn update_in_background(&self, extra: &[&str]) -> Child {
        let mut args = vec!["update", "--coordinator", self.coordinator.as_str(), "--token-file", self.token.as_str()];
        args.extend(self.tls.iter().map(String::as_str));
        args.extend_from_slice(extra);
        Command::new(bin("orchestrator")).args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    }

    pub fn cmd(&self, command: &str, extra: &[&str]) -> std::process::Output {
        let mut args = vec![command, "--coordinator", self.coordinator.as_str(), "--token-file", self.token.as_str()];
        args.extend(self.tls.iter().map(String::as_str));
        args.extend_from_slice(extra);
        run("orchestrator", &args)
    }

    pub fn report(&self) -> serde_json::Value {
        let o = self.cmd("report", &["--json", "--no-probe"]);
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)))
    }

    /// Starts a probe load in the background.
    pub fn probe_load(&self, rate: &str, seconds: &str) -> Child {
        Command::new(bin("orchestrator"))
            .args([
                "probe",
                "--coordinator",
                &self.coordinator,
                "--token-file",
                &self.token,
                "--rate",
                rate,
                "--duration",
                seconds,
                "--json",
            ])
            .args(&self.tls)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

/// The events of a coordinator journal (`--state-dir`), one JSON object per line.
pub fn journal(state_dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(state_dir.join("journal.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Polls the journal until `ready` holds for its events (panics after `limit`).
pub fn wait_for_journal(
    state_dir: &std::path::Path,
    limit: std::time::Duration,
    ready: impl Fn(&[serde_json::Value]) -> bool,
) -> Vec<serde_json::Value> {
    let start = std::time::Instant::now();
    loop {
        let events = journal(state_dir);
        if ready(&events) {
            return events;
        }
        assert!(start.elapsed() < limit, "the journal never reached the expected state: {events:#?}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether the journal records `step` for replica `dp` of some update.
pub fn has_step(events: &[serde_json::Value], dp: u64, step: &str) -> bool {
    events.iter().any(|e| e["event"] == "update_step" && e["dp"] == dp && e["step"] == step)
}

/// `orchestrator checkpoint synth`: a 2-layer `tiny` checkpoint with `seed`.
pub fn synth_tiny(dir: &std::path::Path, seed: &str) {
    let o =
        run("orchestrator", &["checkpoint", "synth", "--out", dir.to_str().unwrap(), "--preset", "tiny", "--layers", "2", "--seed", seed]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Every rank's checkpoint version in a report (`--json`), in report order.
pub fn versions(report: &serde_json::Value) -> Vec<String> {
    report["ranks"].as_array().unwrap().iter().map(|r| r["checkpoint_version"].as_str().unwrap().to_string()).collect()
}

/// Copies the files of checkpoint `src` into `dst` (created), except those `link` picks, which
/// become symlinks to the originals.
pub fn copy_checkpoint(src: &std::path::Path, dst: &std::path::Path, link: impl Fn(&std::path::Path) -> bool) {
    std::fs::create_dir_all(dst).unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap().path();
        let to = dst.join(f.file_name().unwrap());
        if link(&f) {
            std::os::unix::fs::symlink(&f, &to).unwrap();
        } else {
            std::fs::copy(&f, &to).unwrap();
        }
    }
}
