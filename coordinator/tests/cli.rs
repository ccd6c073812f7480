//! The `orchestrator checkpoint` commands as a user runs them.

use std::process::Command;

fn orchestrator(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_orchestrator")).args(args).output().unwrap()
}

#[test]
fn synth_then_inspect_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("v4pro");
    let o =
        orchestrator(&["checkpoint", "synth", "--out", dir.to_str().unwrap(), "--preset", "dsv4-pro", "--layers", "1", "--dtype", "bf16"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = orchestrator(&["checkpoint", "inspect", dir.to_str().unwrap(), "--json"]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["valid"], true);
    assert_eq!(v["family"], "V4");
    assert_eq!(v["geometry"]["heads"], 128);
    assert_eq!(v["valid_tp_sizes"], serde_json::json!([1, 2, 4, 8, 16]));
    assert_eq!(v["tensors"].as_array().unwrap().len(), 4);
    // Writing over an existing checkpoint is refused.
    let o = orchestrator(&["checkpoint", "synth", "--out", dir.to_str().unwrap(), "--preset", "tiny"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not empty"));
}

#[test]
fn unknown_preset_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let o = orchestrator(&["checkpoint", "synth", "--out", tmp.path().join("x").to_str().unwrap(), "--preset", "dsv9"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("unknown preset `dsv9`") && err.contains("dsv41-flash"), "{err}");
}
