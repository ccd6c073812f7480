//! End to end: synthesize a checkpoint with `orchestrator`, load it with `orchestrator-worker`
//! in separate processes, and compare real and dummy loads, dumps and errors.

use std::path::Path;

use orchestrator_e2e::{run, stderr, stdout};
use orchestrator_kernels::Digest;
use serde_json::Value;

fn synth(dir: &Path, dtype: &str, seed: &str) {
    let o = run(
        "orchestrator",
        &[
            "checkpoint",
            "synth",
            "--out",
            dir.to_str().unwrap(),
            "--preset",
            "tiny",
            "--layers",
            "2",
            "--dtype",
            dtype,
            "--seed",
            seed,
            "--max-shard-bytes",
            "3000000",
        ],
    );
    assert!(o.status.success(), "synth failed: {}", stderr(&o));
    assert!(stdout(&o).contains("shard file(s)"), "{}", stdout(&o));
}

fn load_json(args: &[&str]) -> Value {
    let o = run("orchestrator-worker", args);
    assert!(o.status.success(), "load {args:?} failed ({:?}): {}", o.status, stderr(&o));
    serde_json::from_slice(&o.stdout).expect("--json prints one JSON document")
}

fn rank_digests(doc: &Value) -> Vec<(String, String)> {
    doc["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["kernel_rank_digest"].as_str().unwrap().to_string(), r["source_rank_digest"].as_str().unwrap().to_string()))
        .collect()
}

#[test]
fn real_and_dummy_loads_agree_across_processes() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in ["fp8", "bf16"] {
        let dir = tmp.path().join(dtype);
        synth(&dir, dtype, "9");
        let inspect = run("orchestrator", &["checkpoint", "inspect", dir.to_str().unwrap()]);
        assert!(inspect.status.success(), "{}", stdout(&inspect));
        assert!(stdout(&inspect).contains("valid"));
        for tp in ["1", "2", "4", "8"] {
            let real = load_json(&["load", "--checkpoint", dir.to_str().unwrap(), "--tp", tp, "--json"]);
            let dummy =
                load_json(&["load", "--dummy", "--seed", "9", "--preset", "tiny", "--layers", "2", "--dtype", dtype, "--tp", tp, "--json"]);
            assert_eq!(real["ok"], Value::Bool(true));
            assert_eq!(real["ranks"].as_array().unwrap().len(), tp.parse::<usize>().unwrap());
            assert_eq!(rank_digests(&real), rank_digests(&dummy), "{dtype} tp {tp}");
            // Every rank of a TP group holds different heads, so different bytes.
            let mut kernel: Vec<String> = rank_digests(&real).into_iter().map(|d| d.0).collect();
            kernel.dedup();
            assert_eq!(kernel.len(), tp.parse::<usize>().unwrap());
        }
    }
}

#[test]
fn dump_holds_the_reported_digests() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dump");
    let doc = load_json(&[
        "load",
        "--dummy",
        "--preset",
        "tiny",
        "--layers",
        "1",
        "--tp",
        "2",
        "--rank",
        "1",
        "--dump",
        out.to_str().unwrap(),
        "--json",
    ]);
    let rank = &doc["ranks"][0];
    let bytes = std::fs::read(out.join("rank1.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors = rank["kernel_tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 7);
    let mut lines = Vec::new();
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        let v = st.tensor(name).unwrap();
        assert_eq!(format!("{:?}", v.dtype()), t["dtype"].as_str().unwrap(), "{name}");
        let digest = Digest::of(v.data());
        assert_eq!(digest.hex(), t["digest"].as_str().unwrap(), "{name}");
        lines.push((name.to_string(), digest));
    }
    // The rank digest is recomputable from the dump alone (spec section 9).
    let rank_digest = orchestrator_kernels::digest::rank_digest(lines.iter().map(|(n, d)| (n.as_str(), *d)));
    assert_eq!(rank_digest.hex(), rank["kernel_rank_digest"].as_str().unwrap());
}

#[test]
fn impossible_tp_is_refused_with_the_reason() {
    let o = run("orchestrator-worker", &["load", "--dummy", "--preset", "dsv41-flash", "--layers", "1", "--tp", "16"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("leaves 4 heads per rank; mega attention needs 8 per group"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A tiny FP8 checkpoint (seed 3) in `dir`, and its last shard (in name order).
fn synth_fp8_with_its_last_shard(dir: &Path) -> std::path::PathBuf {
    synth(dir, "fp8", "3");
    let shards = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path());
    shards.filter(|p| p.extension().is_some_and(|e| e == "safetensors")).max().unwrap()
}

#[test]
fn corrupt_checkpoint_fails_inspect_and_load_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let last = synth_fp8_with_its_last_shard(&dir);
    // Truncate the last shard: its last tensor's data is cut.
    let len = std::fs::metadata(&last).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&last).unwrap().set_len(len - 100).unwrap();
    let inspect = run("orchestrator", &["checkpoint", "inspect", dir.to_str().unwrap()]);
    assert_eq!(inspect.status.code(), Some(1), "{}", stdout(&inspect));
    assert!(stdout(&inspect).contains("INVALID") && stdout(&inspect).contains("truncated"), "{}", stdout(&inspect));
    let load = run("orchestrator-worker", &["load", "--checkpoint", dir.to_str().unwrap(), "--tp", "2"]);
    assert_eq!(load.status.code(), Some(2));
    let err = stderr(&load);
    assert!(err.contains("truncated") && err.contains("layers.1.attn."), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A shard or a config that is a pipe (or a directory) is refused by name at once: opening a
/// pipe waited for a writer forever, inside a load or a stage.
#[test]
fn a_checkpoint_file_that_is_a_pipe_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let last = synth_fp8_with_its_last_shard(&dir);
    std::fs::remove_file(&last).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(&last).status().unwrap().success());
    let want = format!("{} is not a regular file (a pipe)", last.display());
    for (bin, args) in [
        ("orchestrator-worker", vec!["load", "--checkpoint", dir.to_str().unwrap(), "--tp", "2"]),
        ("orchestrator", vec!["checkpoint", "inspect", dir.to_str().unwrap()]),
    ] {
        let t = std::time::Instant::now();
        let o = run(bin, &args);
        assert!(!o.status.success(), "{bin} {args:?}");
        let text = format!("{}{}", stdout(&o), stderr(&o));
        assert!(text.contains(&want), "{bin} {args:?}: {text}");
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "{bin} {args:?} took {:?}", t.elapsed());
    }
    std::fs::remove_file(dir.join("config.json")).unwrap();
    std::fs::create_dir(dir.join("config.json")).unwrap();
    let o = run("orchestrator-worker", &["load", "--checkpoint", dir.to_str().unwrap(), "--tp", "2"]);
    assert!(stderr(&o).contains("config.json is not a regular file (a directory)"), "{}", stderr(&o));
}

#[test]
fn probe_from_the_command_line_passes_and_is_deterministic() {
    let args = ["load", "--dummy", "--preset", "tiny", "--layers", "1", "--tp", "2", "--probe", "4,16,5", "--json"];
    let a = load_json(&args);
    let b = load_json(&args);
    assert_eq!(a["ok"], Value::Bool(true));
    let y = a["y_digest"].as_str().expect("all-ranks mode sums the partials");
    assert_eq!(y.len(), 16);
    assert_eq!(a["y_digest"], b["y_digest"], "every run builds the same inputs and sums in rank order");
    for r in a["ranks"].as_array().unwrap() {
        let p = &r["probe"];
        assert_eq!(p["ok"], Value::Bool(true), "{p}");
        assert_eq!(p["layers"][0]["q_mismatches"], 0);
        assert!(p["z_max_abs_err"].as_f64().unwrap() <= 1e-3);
        assert_eq!(p["y_partial_digest"].as_str().unwrap().len(), 16);
    }
    // Text mode prints the verdict and y's digest.
    let o = run("orchestrator-worker", &args[..args.len() - 1]);
    assert!(o.status.success());
    let text = stdout(&o);
    assert!(text.contains("probe T=4 S=16 seed=5: PASS") && text.contains(&format!("digest {y}")), "{text}");
}
