//! The load pipeline against independent expectations: checkpoints written by Python's
//! `safetensors` with kernel layouts computed by an independent numpy implementation of the
//! spec (`scripts/make_python_fixture.py`), dummy == real loads, reloads into the same buffers,
//! and the spec's sizes on the real DeepSeek-V4.1-Flash geometry.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use orchestrator_kernels::{CpuBackend, Digest, ScaleRule};
use orchestrator_model::synth::{SynthOptions, write_checkpoint};
use orchestrator_model::{Generator, ModelConfig, Preset, WeightFormat};
use orchestrator_worker::dump::{DumpDir, dump_rank};
use orchestrator_worker::roundtrip::{RoundTripFailure, check_rank};
use orchestrator_worker::{LoadSource, RankLoader, RankWeights};

use common::fixture_cases;

fn load(source: &LoadSource, tp: usize, rank: usize, rule: ScaleRule) -> RankWeights<CpuBackend> {
    RankLoader::new(&CpuBackend, source.config(), tp, rank, rule).unwrap().load(source).unwrap()
}

fn digests_by_name(w: &RankWeights<CpuBackend>) -> BTreeMap<String, (String, Vec<usize>, String)> {
    w.kernel_digests().into_iter().map(|d| (d.name.clone(), (d.dtype.clone(), d.shape.clone(), d.digest.hex()))).collect()
}

/// Every case of a Python fixture: kernel tensors (dtype, shape, XXH3 of bytes), rank digests
/// and source digests agree exactly, and the dump holds exactly those bytes.
fn check_python_fixture(name: &str) {
    let (source, cases) = fixture_cases(name);
    for case in cases {
        let (rank, what, want) = (case.rank, &case.what, &case.kernel);
        let w = load(&source, case.tp, rank, case.rule);
        assert_eq!(&digests_by_name(&w), want, "{what}: kernel tensors");
        assert_eq!(w.kernel_rank_digest().hex(), case.kernel_rank_digest, "{what}");
        let src: BTreeMap<String, String> = w.source_digests().into_iter().map(|d| (d.name.clone(), d.digest.hex())).collect();
        assert_eq!(src, case.source, "{what}: source digests");
        assert_eq!(w.source_rank_digest().hex(), case.source_rank_digest, "{what}");
        assert!(check_rank(&CpuBackend, &w, &source).ok, "{what}: round trip");

        // The dump holds exactly the kernel bytes, dtypes and shapes.
        let out = tempfile::tempdir().unwrap();
        let path = dump_rank(&CpuBackend, &w, &DumpDir::create(out.path()).unwrap()).unwrap();
        assert_eq!(path.file_name().unwrap().to_str().unwrap(), format!("rank{rank}.safetensors"));
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let dumped: BTreeMap<String, (String, Vec<usize>, String)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, (format!("{:?}", v.dtype()), v.shape().to_vec(), Digest::of(v.data()).hex())))
            .collect();
        assert_eq!(&dumped, want, "{what}: dump");
    }
}

#[test]
fn python_written_fp8_checkpoint_matches_the_independent_reference() {
    check_python_fixture("python-v41-micro-fp8");
}

#[test]
fn python_written_bf16_checkpoint_matches_the_independent_reference_for_both_rules() {
    check_python_fixture("python-v41-micro-bf16");
}

fn tiny_config(format: WeightFormat, layers: usize) -> ModelConfig {
    let mut geometry = Preset::Tiny.geometry();
    geometry.layers = layers;
    ModelConfig { family: Preset::Tiny.family(), geometry, format }
}

fn synth(dir: &Path, config: &ModelConfig, seed: u64) {
    write_checkpoint(dir, &SynthOptions { config: config.clone(), seed, max_shard_bytes: 1 << 21, preset_name: Some("tiny".into()) })
        .unwrap();
}

/// A dummy load with seed S is byte-identical to a real load of the checkpoint synthesized
/// with seed S, at every TP size, for FP8 and BF16.
#[test]
fn dummy_load_equals_real_load_at_every_tp_size() {
    for format in [WeightFormat::Fp8 { block: [32, 32] }, WeightFormat::Bf16] {
        let config = tiny_config(format, 2);
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        synth(&dir, &config, 42);
        let real = LoadSource::open_checkpoint(&dir).unwrap();
        let dummy = LoadSource::Dummy { config: config.clone(), generator: Generator::new(42) };
        for tp in [1, 2, 4, 8] {
            for rank in 0..tp {
                let a = load(&real, tp, rank, ScaleRule::Rceil);
                let b = load(&dummy, tp, rank, ScaleRule::Rceil);
                assert_eq!(digests_by_name(&a), digests_by_name(&b), "{format:?} tp {tp} rank {rank}");
                assert_eq!(a.source_rank_digest(), b.source_rank_digest());
                assert_eq!(a.identity, b.identity);
                assert!(check_rank(&CpuBackend, &a, &real).ok);
            }
        }
        // Different seeds give different weights.
        let other = LoadSource::Dummy { config, generator: Generator::new(43) };
        assert_ne!(load(&real, 2, 0, ScaleRule::Rceil).kernel_rank_digest(), load(&other, 2, 0, ScaleRule::Rceil).kernel_rank_digest());
    }
}

/// A reload replays the pipeline into the existing buffers (no new allocations) and permutes
/// the new version again: its digests equal a fresh load of the new version, never the
/// checkpoint-order bytes (the reference PR's silent reload bug).
#[test]
fn reload_permutes_again_into_the_same_buffers() {
    let config = tiny_config(WeightFormat::Fp8 { block: [32, 32] }, 2);
    let v1 = LoadSource::Dummy { config: config.clone(), generator: Generator::new(1) };
    let v2 = LoadSource::Dummy { config, generator: Generator::new(2) };
    let loader = RankLoader::new(&CpuBackend, v1.config(), 4, 3, ScaleRule::Rceil).unwrap();
    let w = loader.load(&v1).unwrap();
    let before: HashSet<usize> =
        w.layers.iter().flat_map(|l| l.allocation_ids(&CpuBackend).into_iter().chain(l.scratch_allocation_ids(&CpuBackend))).collect();
    let w = loader.reload(w, &v2).unwrap();
    assert_eq!(w.generation, 2);
    for l in &w.layers {
        for id in l.allocation_ids(&CpuBackend) {
            assert!(
                before.contains(&id),
                "layer {}: reload allocated a new kernel buffer (#{} of {:?})",
                l.layer,
                l.allocation_ids(&CpuBackend).iter().position(|x| *x == id).unwrap(),
                l.allocation_ids(&CpuBackend)
            );
        }
    }
    let fresh = loader.load(&v2).unwrap();
    assert_eq!(digests_by_name(&w), digests_by_name(&fresh));
    assert!(check_rank(&CpuBackend, &w, &v2).ok);
    // Reloading version 1 again gives version 1's digests back.
    let again = loader.reload(w, &v1).unwrap();
    assert_eq!(again.kernel_rank_digest(), loader.load(&v1).unwrap().kernel_rank_digest());
}

/// The spec's shapes and sizes on the real DeepSeek-V4.1-Flash geometry at TP 4.
#[test]
fn dsv41_flash_tp4_kernel_shapes() {
    let mut geometry = Preset::Dsv41Flash.geometry();
    geometry.layers = 1;
    let config = ModelConfig { family: Preset::Dsv41Flash.family(), geometry, format: WeightFormat::Fp8 { block: [32, 32] } };
    let source = LoadSource::Dummy { config, generator: Generator::new(0) };
    let w = load(&source, 4, 1, ScaleRule::Rceil);
    let d = digests_by_name(&w);
    let shape = |n: &str| (d[n].0.as_str(), d[n].1.clone());
    assert_eq!(shape("layers.0.attn.wq_b.weight"), ("F8_E4M3", vec![8192, 1280]));
    assert_eq!(shape("layers.0.attn.wq_b.weight_scale"), ("F8_E8M0", vec![327_680]));
    assert_eq!(shape("layers.0.attn.wo_a.weight"), ("F8_E4M3", vec![2, 1024, 4096]));
    assert_eq!(shape("layers.0.attn.wo_a.weight_scale"), ("I32", vec![2, 32, 1024]));
    assert_eq!(shape("layers.0.attn.wo_b.weight"), ("F8_E4M3", vec![5120, 2048]));
    assert_eq!(shape("layers.0.attn.wo_b.weight_scale"), ("F8_E8M0", vec![5120 * 64]));
    assert_eq!(shape("layers.0.attn.attn_sink"), ("F32", vec![16]));
    assert!(check_rank(&CpuBackend, &w, &source).ok);
}

/// The round trip (kernel tensors read back through the inverse hooks and permutations, hashed
/// without copying them out) fails on every injected layout fault, naming the tensor, on FP8
/// and BF16 sources; it passes on the same weights without the fault.
#[test]
fn the_round_trip_catches_every_injected_fault() {
    use orchestrator_worker::faults::{Fault, inject_on};
    for bf16 in [false, true] {
        let config = ModelConfig::from_preset(Preset::Tiny, Some(2), bf16).unwrap();
        let source = LoadSource::Dummy { config, generator: Generator::new(5) };
        // BF16: against the quantization the load recorded in checkpoint order, and (with that
        // record dropped, as on a device quantizer) against the source quantized afresh.
        for recorded in [true, false] {
            let forget = |w: &mut orchestrator_worker::RankWeights<CpuBackend>| {
                assert_eq!(w.layers.iter().all(|l| !l.quantized.is_empty()), bf16, "the load records BF16 quantizations only");
                if !recorded {
                    w.layers.iter_mut().for_each(|l| l.quantized.clear());
                }
            };
            if !bf16 && !recorded {
                continue;
            }
            let mut intact = load(&source, 2, 1, ScaleRule::Rceil);
            forget(&mut intact);
            assert!(check_rank(&CpuBackend, &intact, &source).ok);
            for (fault, tensor) in [
                (Fault::SkipQPermutation, "wq_b"),
                (Fault::DoubleQPermutation, "wq_b"),
                (Fault::SkipOScaleChunkPermutation, "wo_a"),
                (Fault::SwapHeads(0, 1), "wq_b"),
                (Fault::StaleReload, "wo_a"),
            ] {
                let mut w = load(&source, 2, 1, ScaleRule::Rceil);
                forget(&mut w);
                inject_on(&CpuBackend, &mut w, fault).unwrap();
                let rt = check_rank(&CpuBackend, &w, &source);
                assert!(!rt.ok, "{fault:?} (bf16 {bf16}, recorded {recorded}) passed the round trip");
                // Every failure names a tensor, none of them wo_b; the faulted one's bytes mismatch.
                let named: Vec<&str> = rt.failures.iter().filter_map(|f| f.tensor()).collect();
                assert_eq!(named.len(), rt.failures.len(), "{fault:?}: {:?}", rt.failures);
                assert!(named.iter().all(|t| !t.contains("wo_b")), "{fault:?}: {:?}", rt.failures);
                let faulted = format!("attn.{tensor}");
                assert!(
                    rt.failures.iter().any(|f| matches!(f, RoundTripFailure::Mismatch { what, .. } if what.contains(&faulted))),
                    "{fault:?}: {:?}",
                    rt.failures
                );
            }
        }
    }
}
