//! The golden path (`--verify golden`): a plain recomputation of every kernel-visible tensor
//! from the spec's formulas agrees with the fast pipeline on every rank of every TP size
//! (FP8 with 32x32 and 128x128 blocks, BF16 with both scale rules), with the Python-written
//! fixtures' expected digests, refuses the same bad inputs, and notices a corrupted kernel
//! tensor or any of the deliberate layout faults.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

mod common;

use common::fixture_cases;

use orchestrator_kernels::{CpuBackend, Digest, KernelError, ScaleRule};
use orchestrator_model::synth::{SynthOptions, write_checkpoint};
use orchestrator_model::{Family, Generator, ModelConfig, Preset, WeightFormat};
use orchestrator_worker::dump::{DumpDir, dump_rank};
use orchestrator_worker::faults::{Fault, inject};
use orchestrator_worker::golden::{golden_kernel_digests, golden_layer_tensors, golden_mismatches, golden_rank_digest, rank_digest_of};
use orchestrator_worker::{LoadError, LoadSource, RankLoader, RankWeights};

const RULES: [ScaleRule; 2] = [ScaleRule::Rceil, ScaleRule::Floor];

fn dummy(layers: usize, bf16: bool, seed: u64) -> LoadSource {
    LoadSource::Dummy { config: ModelConfig::from_preset(Preset::Tiny, Some(layers), bf16).unwrap(), generator: Generator::new(seed) }
}

fn load(source: &LoadSource, tp: usize, rank: usize, rule: ScaleRule) -> RankWeights<CpuBackend> {
    RankLoader::new(&CpuBackend, source.config(), tp, rank, rule).unwrap().load(source).unwrap()
}

/// The fast pipeline's kernel digests: (name, digest), sorted by name.
fn fast_digests(w: &RankWeights<CpuBackend>) -> Vec<(String, Digest)> {
    w.kernel_digests().into_iter().map(|d| (d.name.clone(), d.digest)).collect()
}

/// Golden == fast on every rank of TP 1, 2, 4, 8: tensor digests and rank digests.
fn golden_equals_fast_at_every_tp(source: &LoadSource, rules: &[ScaleRule], what: &str) {
    for &rule in rules {
        for tp in [1, 2, 4, 8] {
            for rank in 0..tp {
                let what = format!("{what} {rule} tp {tp} rank {rank}");
                let fast = load(source, tp, rank, rule);
                let golden = golden_kernel_digests(source, tp, rank, rule).unwrap();
                assert_eq!(golden.len(), 7 * source.config().geometry.layers, "{what}");
                assert_eq!(golden, fast_digests(&fast), "{what}: {:?}", golden_mismatches(&golden, &fast_digests(&fast)));
                let rank_digest = golden_rank_digest(source, tp, rank, rule).unwrap();
                assert_eq!(rank_digest, fast.kernel_rank_digest(), "{what}: rank digest");
                assert_eq!(rank_digest_of(&golden), rank_digest, "{what}");
            }
        }
    }
}

#[test]
fn golden_equals_fast_pipeline_fp8_tiny_every_rank() {
    // FP8 needs no quantization; the rule must not change a byte.
    golden_equals_fast_at_every_tp(&dummy(2, false, 7), &RULES, "tiny fp8");
}

#[test]
fn golden_equals_fast_pipeline_bf16_tiny_every_rank_both_rules() {
    golden_equals_fast_at_every_tp(&dummy(1, true, 9), &RULES, "tiny bf16");
}

/// The V4 family's 128x128 blocks: each block scale covers 4 scale columns per row
/// (`j * 32 / 128`) and 128 rows. A small geometry with V4.1's layouts and 128-multiple ranks.
#[test]
fn golden_equals_fast_pipeline_fp8_128x128_blocks_every_rank() {
    let mut geometry = Preset::Tiny.geometry();
    geometry.layers = 1;
    geometry.q_lora_rank = 128;
    geometry.o_lora_rank = 128;
    geometry.hidden = 256;
    let format = WeightFormat::Fp8 { block: [128, 128] };
    geometry.validate(format.block()).unwrap();
    let source = LoadSource::Dummy { config: ModelConfig { family: Family::V4, geometry, format }, generator: Generator::new(5) };
    golden_equals_fast_at_every_tp(&source, &[ScaleRule::Rceil], "128x128 fp8");
}

/// The golden tensors' dtypes, shapes and byte counts are the fast pipeline's (and the
/// weights hold one byte per element).
#[test]
fn golden_dtypes_and_shapes_match_the_fast_pipeline() {
    for bf16 in [false, true] {
        let source = dummy(2, bf16, 3);
        for (tp, rank) in [(1, 0), (4, 3), (8, 5)] {
            let fast = load(&source, tp, rank, ScaleRule::Rceil);
            let fast: BTreeMap<String, (String, Vec<usize>, usize, Digest)> = fast
                .kernel_digests()
                .into_iter()
                .map(|d| (d.name.clone(), (d.dtype.clone(), d.shape.clone(), d.bytes, d.digest)))
                .collect();
            let mut golden = BTreeMap::new();
            for layer in 0..2 {
                for t in golden_layer_tensors(&source, tp, rank, layer, ScaleRule::Rceil).unwrap() {
                    golden.insert(t.name.clone(), (t.dtype.to_string(), t.shape.clone(), t.bytes.len(), t.digest()));
                }
            }
            assert_eq!(golden, fast, "bf16 {bf16} tp {tp} rank {rank}");
        }
    }
}

/// Every case of a Python-written fixture: the golden digests, dtypes and shapes are the
/// independent numpy implementation's, and so is the rank digest.
fn golden_matches_python_fixture(name: &str) {
    let (source, cases) = fixture_cases(name);
    for case in cases {
        let (tp, rank, rule, what) = (case.tp, case.rank, case.rule, &case.what);
        let mut want: Vec<(String, Digest)> = case.kernel.iter().map(|(k, v)| (k.clone(), Digest::from_hex(&v.2).unwrap())).collect();
        want.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let golden = golden_kernel_digests(&source, tp, rank, rule).unwrap();
        assert_eq!(golden, want, "{what}: {:?}", golden_mismatches(&golden, &want));
        assert_eq!(golden_rank_digest(&source, tp, rank, rule).unwrap().hex(), case.kernel_rank_digest, "{what}");
        for layer in 0..source.config().geometry.layers {
            for t in golden_layer_tensors(&source, tp, rank, layer, rule).unwrap() {
                let (dtype, shape, _) = &case.kernel[&t.name];
                assert_eq!((t.dtype, &t.shape), (dtype.as_str(), shape), "{what}: {}", t.name);
            }
        }
    }
}

#[test]
fn golden_matches_python_fp8_fixture() {
    golden_matches_python_fixture("python-v41-micro-fp8");
}

#[test]
fn golden_matches_python_bf16_fixture_both_rules() {
    golden_matches_python_fixture("python-v41-micro-bf16");
}

/// Digests of a rank's `--dump` (what the fast path's kernels would read), sorted by name.
fn dump_digests(w: &RankWeights<CpuBackend>, corrupt: Option<(&str, usize)>) -> Vec<(String, Digest)> {
    let out = tempfile::tempdir().unwrap();
    let path = dump_rank(&CpuBackend, w, &DumpDir::create(out.path()).unwrap()).unwrap();
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Digest)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            let mut data = t.data().to_vec();
            if let Some((name, at)) = corrupt
                && name == n
            {
                data[at] ^= 0x01;
            }
            (n, Digest::of(&data))
        })
        .collect();
    v.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    v
}

/// One flipped bit in the fast path's `wq_b` weight: the golden path names exactly that tensor,
/// and the rank digests differ.
#[test]
fn golden_notices_a_corrupted_kernel_tensor() {
    let source = dummy(1, false, 13);
    let (tp, rank) = (2, 1);
    let w = load(&source, tp, rank, ScaleRule::Rceil);
    let golden = golden_kernel_digests(&source, tp, rank, ScaleRule::Rceil).unwrap();
    let intact = dump_digests(&w, None);
    assert_eq!(golden, intact, "the intact dump agrees");
    assert!(golden_mismatches(&golden, &intact).is_empty());

    let name = "layers.0.attn.wq_b.weight";
    let bad = dump_digests(&w, Some((name, 12_345)));
    let m = golden_mismatches(&golden, &bad);
    assert_eq!(m.len(), 1, "{m:?}");
    assert_eq!(m[0].name, name);
    assert_eq!(m[0].golden, golden.iter().find(|(n, _)| n == name).map(|(_, d)| *d));
    assert_ne!(m[0].golden, m[0].observed);
    assert!(m[0].to_string().starts_with("layers.0.attn.wq_b.weight: golden "), "{}", m[0]);
    assert_ne!(rank_digest_of(&bad), golden_rank_digest(&source, tp, rank, ScaleRule::Rceil).unwrap());

    // A tensor missing on one side is a mismatch too.
    let m = golden_mismatches(&golden, &intact[1..]);
    assert_eq!(m.len(), 1);
    assert_eq!((m[0].name.as_str(), m[0].observed), (intact[0].0.as_str(), None));
}

/// The reference PR's failure class, injected into a loaded rank: the golden path flags exactly
/// the tensors each fault corrupts.
#[test]
fn golden_notices_every_layout_fault() {
    let source = dummy(1, false, 21);
    let (tp, rank) = (2, 1);
    let golden = golden_kernel_digests(&source, tp, rank, ScaleRule::Rceil).unwrap();
    let q = ["layers.0.attn.wq_b.weight", "layers.0.attn.wq_b.weight_scale"];
    let o = ["layers.0.attn.wo_a.weight", "layers.0.attn.wo_a.weight_scale"];
    // (fault, tensors that must be flagged, tensors that may also be flagged)
    for (fault, must, may) in [
        (Fault::SkipQPermutation, vec![q[0], q[1]], vec![]),
        (Fault::DoubleQPermutation, vec![q[0], q[1]], vec![]),
        (Fault::SkipOScaleChunkPermutation, vec![o[1]], vec![]),
        // A reload that wrote checkpoint order under the hooks (spec section 1's silent failure).
        (Fault::StaleReload, vec![q[0], q[1], o[0], o[1]], vec![]),
        // Swapping two heads moves their weight rows; their scales may or may not coincide.
        (Fault::SwapHeads(0, 1), vec![q[0]], vec![q[1]]),
    ] {
        let mut w = load(&source, tp, rank, ScaleRule::Rceil);
        inject(&mut w, fault).unwrap();
        let flagged: Vec<String> = golden_mismatches(&golden, &dump_digests(&w, None)).into_iter().map(|m| m.name).collect();
        assert!(must.iter().all(|n| flagged.iter().any(|f| f == n)), "{fault:?}: flagged {flagged:?}");
        assert!(flagged.iter().all(|f| must.contains(&f.as_str()) || may.contains(&f.as_str())), "{fault:?}: flagged {flagged:?}");
    }
}

/// Refused TP sizes and ranks, and configs whose layouts are undefined, are errors (no panic).
#[test]
fn golden_refuses_bad_plans() {
    let source = dummy(1, false, 1);
    let err = golden_kernel_digests(&source, 16, 0, ScaleRule::Rceil).unwrap_err().to_string();
    assert!(err.contains("leaves 4 heads per rank; mega attention needs 8 per group"), "{err}");
    for (tp, rank) in [(0, 0), (3, 0), (4, 4)] {
        assert!(golden_kernel_digests(&source, tp, rank, ScaleRule::Rceil).is_err(), "tp {tp} rank {rank}");
        assert!(golden_rank_digest(&source, tp, rank, ScaleRule::Rceil).is_err(), "tp {tp} rank {rank}");
    }
    assert!(matches!(golden_layer_tensors(&source, 1, 0, 1, ScaleRule::Rceil), Err(LoadError::Config(_))));

    // Hand-built dummy configs skip `config.json` validation.
    let base = ModelConfig::from_preset(Preset::Tiny, Some(1), false).unwrap();
    type Edit = fn(&mut ModelConfig);
    let edits: [(&str, Edit); 6] = [
        ("no groups", |c| c.geometry.o_groups = 0),
        ("4 heads per group", |c| c.geometry.heads = 32),
        ("head_dim 500", |c| c.geometry.head_dim = 500),
        ("q_lora 40", |c| c.geometry.q_lora_rank = 40),
        ("block 32x48", |c| c.format = WeightFormat::Fp8 { block: [32, 48] }),
        ("block 0x32", |c| c.format = WeightFormat::Fp8 { block: [0, 32] }),
    ];
    for (what, edit) in edits {
        let mut config = base.clone();
        edit(&mut config);
        let source = LoadSource::Dummy { config, generator: Generator::new(1) };
        for tp in [1, 2] {
            assert!(golden_kernel_digests(&source, tp, 0, ScaleRule::Rceil).is_err(), "{what} tp {tp}");
        }
    }
}

fn synth(dir: &Path, bf16: bool) -> LoadSource {
    let config = ModelConfig::from_preset(Preset::Tiny, Some(1), bf16).unwrap();
    write_checkpoint(dir, &SynthOptions { config, seed: 4, max_shard_bytes: 1 << 30, preset_name: Some("tiny".into()) }).unwrap();
    LoadSource::open_checkpoint(dir).unwrap()
}

/// Overwrites the bytes of element `index` of a tensor in a synthesized checkpoint.
fn poke(dir: &Path, tensor: &str, index: usize, bytes: &[u8]) {
    let index_json: Value = serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let file = dir.join(index_json["weight_map"][tensor].as_str().unwrap());
    let mut data = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
    let start = 8 + n + header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    let at = start + index * bytes.len();
    data[at..at + bytes.len()].copy_from_slice(bytes);
    std::fs::write(&file, data).unwrap();
}

/// Damaged inputs: the golden path refuses what the fast path refuses, naming the same tensor
/// and the same absolute position.
#[test]
fn golden_refuses_the_damaged_inputs_the_fast_path_refuses() {
    let g = Preset::Tiny.geometry();
    let wo_b_cols = g.o_groups * g.o_lora_rank;
    let wo_b_scale_cols = wo_b_cols / 32;
    // (bf16, tensor, element index, bytes); TP 2 rank 1 holds the second half of wq_b rows,
    // wo_b columns and heads.
    let cases: [(bool, &str, usize, Vec<u8>); 5] = [
        (false, "layers.0.attn.wo_b.scale", 3 * wo_b_scale_cols + wo_b_scale_cols - 1, vec![0xFF]),
        (false, "layers.0.attn.wq_b.weight", (g.heads * g.head_dim - 1) * g.q_lora_rank + 5, vec![0x7F]),
        (false, "layers.0.attn.attn_sink", g.heads - 1, f32::NAN.to_le_bytes().to_vec()),
        (true, "layers.0.attn.wo_b.weight", 2 * wo_b_cols + wo_b_cols - 2, 0x7F80u16.to_le_bytes().to_vec()),
        (true, "layers.0.attn.wq_b.weight", g.heads * g.head_dim / 2 * g.q_lora_rank + 33, 0xFFC0u16.to_le_bytes().to_vec()),
    ];
    for (bf16, tensor, index, bytes) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        drop(synth(&dir, bf16));
        poke(&dir, tensor, index, &bytes);
        let source = LoadSource::open_checkpoint(&dir).unwrap();
        // Rank 0 does not read the damaged element.
        assert_eq!(
            golden_kernel_digests(&source, 2, 0, ScaleRule::Rceil).unwrap(),
            fast_digests(&load(&source, 2, 0, ScaleRule::Rceil)),
            "{tensor}: rank 0 is intact"
        );
        let golden = golden_kernel_digests(&source, 2, 1, ScaleRule::Rceil).unwrap_err();
        let fast = RankLoader::new(&CpuBackend, source.config(), 2, 1, ScaleRule::Rceil).unwrap().load(&source).err().unwrap();
        assert_eq!(golden.tensor(), Some(tensor), "{golden}");
        assert_eq!(fast.tensor(), Some(tensor), "{fast}");
        let position = |e: &LoadError| match e {
            LoadError::Tensor { source: KernelError::NanScale { row, col } | KernelError::NonFinite { row, col }, .. } => {
                Some((*row, *col))
            }
            _ => None,
        };
        assert!(position(&golden).is_some(), "{golden}");
        assert_eq!(position(&golden), position(&fast), "{tensor}: golden `{golden}`, fast `{fast}`");
        assert!(golden.to_string().contains(".safetensors: tensor"), "names the file: {golden}");
    }
}
