//! Helpers for end-to-end tests that run the real `orchestrator` and `orchestrator-worker`
//! binaries. `cargo test --workspace` builds both (their packages have integration tests), and
//! the binaries sit next to this test's `deps/` directory.

use std::path::PathBuf;
use std::process::{Command, Output};

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
