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
    /// Holds the cluster's `--ready-file`.
    _ready: tempfile::TempDir,
}

/// Waits for `child` to write its `--ready-file` at `path` and reads it, or for the child to
/// exit first (its status); panics with `why()` after `limit`.
fn await_ready_file(
    path: &std::path::Path,
    child: &mut Child,
    limit: Option<std::time::Duration>,
    why: impl FnOnce() -> String,
) -> Result<serde_json::Value, std::process::ExitStatus> {
    let start = std::time::Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return Ok(serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display())));
        }
        if let Some(status) = child.try_wait().unwrap() {
            return Err(status);
        }
        if limit.is_some_and(|l| start.elapsed() > l) {
            panic!("(after {:?}) {}", start.elapsed(), why());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Gives a coordinator asked to shut down up to 10 s to stop its workers (adopted and remote
/// ones are not its children), then kills it.
fn stop_coordinator(child: &mut Child) {
    let start = std::time::Instant::now();
    while matches!(child.try_wait(), Ok(None)) && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.cmd("shutdown", &[]);
        stop_coordinator(&mut self.child);
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

    /// [`Served::recover`], or how it exited before it served (its status and stderr).
    pub fn try_recover(state_dir: &std::path::Path, args: &[&str]) -> Result<Self, (std::process::ExitStatus, String)> {
        let mut full = vec!["recover", "--state-dir", state_dir.to_str().unwrap()];
        full.extend_from_slice(args);
        Self::try_announced(&full)
    }

    /// Runs `orchestrator ARGS --ready-file FILE` until it writes the file, which says how to
    /// call the served cluster (panics with its stderr if it exits first).
    fn announced(args: &[&str]) -> Self {
        Self::try_announced(args)
            .unwrap_or_else(|(status, said)| panic!("({status}) `orchestrator {}` did not come up:\n{said}", args.join(" ")))
    }

    /// [`Served::announced`], or how the process exited before it served.
    fn try_announced(args: &[&str]) -> Result<Self, (std::process::ExitStatus, String)> {
        let dir = tempfile::tempdir().unwrap();
        let ready_file = dir.path().join("ready.json");
        let mut child = Command::new(bin("orchestrator"))
            .args(args)
            .arg("--ready-file")
            .arg(&ready_file)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let said = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stderr = child.stderr.take().unwrap();
        let (read_all, all_read) = std::sync::mpsc::channel();
        std::thread::spawn({
            let said = said.clone();
            move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    said.lock().unwrap().push(line);
                }
                let _ = read_all.send(());
            }
        });
        let ready = match await_ready_file(&ready_file, &mut child, None, String::new) {
            Ok(ready) => ready,
            Err(status) => {
                // Its stderr to the end (workers it started may still hold the pipe open: then
                // what was read within a few seconds).
                let _ = all_read.recv_timeout(std::time::Duration::from_secs(5));
                return Err((status, said.lock().unwrap().join("\n")));
            }
        };
        let field = |name: &str| ready[name].as_str().unwrap_or_else(|| panic!("the ready file has no {name}: {ready}")).to_string();
        let tls = ready["tls_dir"].as_str().map(|d| vec!["--tls-dir".to_string(), d.to_string()]).unwrap_or_default();
        Ok(Self { child, coordinator: field("coordinator"), token: field("token_file"), tls, _ready: dir })
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

    /// `orchestrator update --checkpoint DIR --json`: its document, whatever its outcome.
    pub fn update_doc(&self, checkpoint: &std::path::Path) -> serde_json::Value {
        self.update_doc_with(checkpoint, &[])
    }

    /// [`Served::update_doc`] with more arguments.
    pub fn update_doc_with(&self, checkpoint: &std::path::Path, args: &[&str]) -> serde_json::Value {
        let mut full = vec!["--checkpoint", checkpoint.to_str().unwrap(), "--json"];
        full.extend_from_slice(args);
        let o = self.cmd("update", &full);
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&o), stderr(&o)))
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
    synth_tiny_layers(dir, seed, 2);
}

/// [`synth_tiny`] with `layers` layers (a `slow-stage` rank stages for a second per layer).
pub fn synth_tiny_layers(dir: &std::path::Path, seed: &str, layers: u32) {
    let layers = layers.to_string();
    let o = run(
        "orchestrator",
        &["checkpoint", "synth", "--out", dir.to_str().unwrap(), "--preset", "tiny", "--layers", &layers, "--seed", seed],
    );
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `(dp, tp) -> version` of every rank that answered a report.
pub fn rank_versions(report: &serde_json::Value) -> Vec<(u64, u64, String)> {
    report["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["failure"].is_null())
        .map(|r| (r["dp"].as_u64().unwrap(), r["tp"].as_u64().unwrap(), r["checkpoint_version"].as_str().unwrap().to_string()))
        .collect()
}

/// No TP group's answering ranks hold two versions.
pub fn assert_no_mixed_group(report: &serde_json::Value) {
    let ranks = rank_versions(report);
    for (dp, _, v) in &ranks {
        for (dp2, tp2, v2) in &ranks {
            assert!(dp != dp2 || v == v2, "replica dp{dp} mixes versions {v} and {v2} (tp{tp2}): {report:#}");
        }
    }
}

/// Sends `sig` (`KILL`, `STOP`, `CONT`...) to process `pid`.
pub fn signal(pid: u64, sig: &str) {
    let ok = Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]).status().unwrap();
    assert!(ok.success(), "kill -{sig} {pid}");
}

/// The pid of worker (dp, tp), from the launch record of the journal in `state`.
pub fn worker_pid(state: &std::path::Path, dp: u64, tp: u64) -> u64 {
    let events = journal(state);
    let workers = events[0]["workers"].as_array().unwrap();
    workers.iter().find(|w| w["dp"] == dp && w["tp"] == tp).unwrap()["pid"].as_u64().unwrap()
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

/// A command for binary `name`, run inside `prefix` (e.g. `ip netns exec NS`) when one is given.
pub fn command_in(prefix: &[String], name: &str) -> Command {
    match prefix.split_first() {
        None => Command::new(bin(name)),
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(bin(name));
            c
        }
    }
}

/// `orchestrator coordinator` on its own, with the workers the test starts itself (as Slurm or
/// Kubernetes would), each killed if the test fails midway.
pub struct Standalone {
    pub child: Child,
    /// `http://ADDR` or `https://ADDR`.
    pub url: String,
    pub token: PathBuf,
    /// `--tls-dir DIR` when the cluster runs over TLS.
    pub tls: Vec<String>,
    /// The coordinator's stderr, line by line.
    pub lines: std::sync::mpsc::Receiver<String>,
    /// Everything read from `lines` so far.
    pub seen: Vec<String>,
    pub workers: Vec<Child>,
    /// What coordinator commands run inside.
    pub prefix: Vec<String>,
    /// The coordinator's `--ready-file` (in a folder of its own), written once it serves.
    ready: (tempfile::TempDir, PathBuf),
}

impl Drop for Standalone {
    fn drop(&mut self) {
        let _ = self.cmd("shutdown", &[]);
        stop_coordinator(&mut self.child);
        for w in &mut self.workers {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

impl Standalone {
    /// Starts `orchestrator coordinator --listen LISTEN --token-file TOKEN ARGS` (inside
    /// `prefix`) and waits until it listens.
    pub fn start(prefix: &[String], listen: &str, token: &std::path::Path, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ready_file = dir.path().join("ready.json");
        let mut child = command_in(prefix, "orchestrator")
            .args(["coordinator", "--listen", listen, "--token-file", token.to_str().unwrap()])
            .arg("--ready-file")
            .arg(&ready_file)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let tls = match args.iter().position(|a| *a == "--tls-dir") {
            Some(i) => vec!["--tls-dir".to_string(), args[i + 1].to_string()],
            None => Vec::new(),
        };
        let mut s = Self {
            child,
            url: String::new(),
            token: token.to_path_buf(),
            tls,
            lines,
            seen: Vec::new(),
            workers: Vec::new(),
            prefix: prefix.to_vec(),
            ready: (dir, ready_file),
        };
        let line = s.wait_for("coordinator listening on ", std::time::Duration::from_secs(30));
        s.url = line.split(" (").nth(1).and_then(|r| r.split(')').next()).unwrap().to_string();
        s
    }

    /// Waits until the coordinator serves: its ready file names this coordinator's address and
    /// process (panics with its stderr after `limit`, or when it exits first). The ready file.
    pub fn wait_serving(&mut self, limit: std::time::Duration) -> serde_json::Value {
        let (lines, seen) = (&self.lines, &mut self.seen);
        let mut why = || {
            seen.extend(lines.try_iter());
            format!("the coordinator did not come to serve:\n{}", seen.join("\n"))
        };
        let ready =
            await_ready_file(&self.ready.1, &mut self.child, Some(limit), &mut why).unwrap_or_else(|status| panic!("({status}) {}", why()));
        assert_eq!(ready["pid"], self.child.id(), "{ready}");
        assert_eq!(ready["coordinator"], self.url.as_str(), "{ready}");
        ready
    }

    /// Waits for a stderr line containing `needle` (panics with what it saw after `limit`).
    pub fn wait_for(&mut self, needle: &str, limit: std::time::Duration) -> String {
        let deadline = std::time::Instant::now() + limit;
        if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => panic!("the coordinator never said `{needle}`:\n{}", self.seen.join("\n")),
            }
        }
    }

    /// `orchestrator-worker serve --coordinator URL --token-file TOKEN ARGS` with `env`, inside
    /// `prefix`, its stderr into `log`.
    pub fn worker_command(&self, prefix: &[String], env: &[(&str, &str)], args: &[&str], log: &std::path::Path) -> Command {
        let mut c = command_in(prefix, "orchestrator-worker");
        c.args(["serve", "--coordinator", &self.url, "--token-file", self.token.to_str().unwrap()])
            .args(&self.tls)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap());
        c
    }

    /// Starts a worker (see [`Standalone::worker_command`]) that the test keeps.
    pub fn worker(&mut self, prefix: &[String], env: &[(&str, &str)], args: &[&str], log: &std::path::Path) {
        let child = self.worker_command(prefix, env, args, log).spawn().unwrap();
        self.workers.push(child);
    }

    /// `orchestrator COMMAND --coordinator URL --token-file TOKEN EXTRA` (inside the prefix).
    pub fn cmd(&self, command: &str, extra: &[&str]) -> Output {
        command_in(&self.prefix, "orchestrator")
            .args([command, "--coordinator", &self.url, "--token-file", self.token.to_str().unwrap()])
            .args(&self.tls)
            .args(extra)
            .output()
            .unwrap()
    }

    pub fn report(&self) -> serde_json::Value {
        let o = self.cmd("report", &["--json", "--no-probe"]);
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}{}", stdout(&o), stderr(&o)))
    }

    /// `orchestrator health --address ADDRESS [--service S] [--wait SECS]`: the answer's first word.
    pub fn health(&self, address: &str, service: &str, wait: &str) -> String {
        let o = command_in(&self.prefix, "orchestrator")
            .args(["health", "--address", address, "--service", service, "--wait", wait])
            .args(&self.tls)
            .output()
            .unwrap();
        stdout(&o).split_whitespace().next().unwrap_or("").to_string()
    }

    /// Waits for the coordinator to exit; its status and stdout.
    pub fn wait_exit(&mut self, limit: std::time::Duration) -> (std::process::ExitStatus, String) {
        let start = std::time::Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let mut out = String::new();
                use std::io::Read;
                self.child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
                while let Ok(l) = self.lines.recv_timeout(std::time::Duration::from_millis(200)) {
                    self.seen.push(l);
                }
                return (status, out);
            }
            assert!(start.elapsed() < limit, "the coordinator did not exit:\n{}", self.seen.join("\n"));
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

/// Polls `f` until it returns `Some` (panics with `what` after `limit`).
pub fn eventually<T>(limit: std::time::Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
