// Each test crate that includes this module uses a different part of it.
#![allow(dead_code)]

//! Shared by the worker's integration tests: the Python-written fixtures and their expected
//! cases (`tests/fixtures/*/expected.json`, from `scripts/make_python_fixture.py`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use orchestrator_kernels::ScaleRule;
use orchestrator_worker::LoadSource;
use serde_json::Value;

/// A committed fixture directory.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
}

/// One expected rank of a fixture.
pub struct Case {
    pub tp: usize,
    pub rank: usize,
    pub rule: ScaleRule,
    /// "fixture tp T rank R rule", for messages.
    pub what: String,
    /// Kernel tensor name -> (dtype, shape, XXH3 hex).
    pub kernel: BTreeMap<String, (String, Vec<usize>, String)>,
    pub kernel_rank_digest: String,
    /// Checkpoint tensor name -> XXH3 hex of the rank's slice.
    pub source: BTreeMap<String, String>,
    pub source_rank_digest: String,
}

/// The fixture's checkpoint and its expected cases (at least one).
pub fn fixture_cases(name: &str) -> (LoadSource, Vec<Case>) {
    let dir = fixture(name);
    let expected: Value = serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let source = LoadSource::open_checkpoint(&dir).unwrap();
    let cases: Vec<Case> = expected["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            let tp = case["tp"].as_u64().unwrap() as usize;
            let rank = case["rank"].as_u64().unwrap() as usize;
            let rule: ScaleRule = case["scale_rule"].as_str().unwrap().parse().unwrap();
            let kernel = case["kernel"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| {
                    let shape = v["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
                    (k.clone(), (v["dtype"].as_str().unwrap().to_string(), shape, v["xxh3"].as_str().unwrap().to_string()))
                })
                .collect();
            let source = case["source"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string())).collect();
            Case {
                tp,
                rank,
                rule,
                what: format!("{name} tp {tp} rank {rank} {rule}"),
                kernel,
                kernel_rank_digest: case["kernel_rank_digest"].as_str().unwrap().to_string(),
                source,
                source_rank_digest: case["source_rank_digest"].as_str().unwrap().to_string(),
            }
        })
        .collect();
    assert!(!cases.is_empty(), "{name} has no cases");
    (source, cases)
}
