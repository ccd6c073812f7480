//! The probe forward pass: intact ranks pass at every TP size (tiny and the real
//! DeepSeek-V4.1-Flash geometry), the partial outputs of a TP group sum to the TP 1 output,
//! and every deliberate layout fault fails the probe by far more than the tolerance.

use orchestrator_kernels::forward::compare;
use orchestrator_kernels::{CpuBackend, ScaleRule};
use orchestrator_model::synth::{SynthOptions, write_checkpoint};
use orchestrator_model::{Generator, ModelConfig, Preset};
use orchestrator_worker::faults::{Fault, inject};
use orchestrator_worker::probe::{ProbeSpec, RankProbe, Z_TOLERANCE, probe_rank, sum_partials};
use orchestrator_worker::{LoadSource, RankLoader};

fn dummy(preset: Preset, layers: usize, bf16: bool, seed: u64) -> LoadSource {
    LoadSource::Dummy { config: ModelConfig::from_preset(preset, Some(layers), bf16).unwrap(), generator: Generator::new(seed) }
}

fn probe(source: &LoadSource, tp: usize, rank: usize, spec: ProbeSpec) -> RankProbe {
    let loader = RankLoader::new(&CpuBackend, source.config(), tp, rank, ScaleRule::Rceil).unwrap();
    let w = loader.load(source).unwrap();
    probe_rank(&loader, &w, source, spec, ScaleRule::Rceil).unwrap()
}

fn assert_passes(p: &RankProbe, what: &str) {
    assert!(p.ok, "{what}: {p:?}");
    assert!(p.layers.iter().all(|l| l.q_mismatches == 0), "{what}: fused q must equal the permuted reference bit for bit");
    assert!(p.z_max_abs_err <= Z_TOLERANCE, "{what}: z err {}", p.z_max_abs_err);
}

/// Intact ranks pass at TP 1, 2, 4, 8; the partials of each group sum (in rank order) to the
/// TP 1 output within 1e-3.
fn intact_at_every_tp(preset: Preset, layers: usize, spec: ProbeSpec) {
    let source = dummy(preset, layers, false, 11);
    let whole = probe(&source, 1, 0, spec);
    assert_passes(&whole, &format!("{} tp 1", preset.name()));
    for tp in [2, 4, 8] {
        let probes: Vec<RankProbe> = (0..tp).map(|r| probe(&source, tp, r, spec)).collect();
        for (r, p) in probes.iter().enumerate() {
            assert_passes(p, &format!("{} tp {tp} rank {r}", preset.name()));
        }
        let y = sum_partials(&probes.iter().map(|p| p.y_partial.as_slice()).collect::<Vec<_>>());
        let (abs, rel, within) = compare(&y, &whole.y_partial, 1e-3, 1e-3);
        assert!(within, "{} tp {tp}: sum of partials differs from tp 1 by {abs} abs / {rel} rel", preset.name());
    }
}

#[test]
fn intact_tiny_ranks_pass_and_sum_to_tp1() {
    intact_at_every_tp(Preset::Tiny, 2, ProbeSpec { tokens: 4, latents: 16, seed: 3 });
}

#[test]
fn intact_dsv41_flash_ranks_pass_and_sum_to_tp1() {
    intact_at_every_tp(Preset::Dsv41Flash, 1, ProbeSpec { tokens: 2, latents: 8, seed: 5 });
}

/// A fault makes the probe fail, with errors far above tolerance.
fn faulted(fault: Fault) -> RankProbe {
    let source = dummy(Preset::Tiny, 1, false, 21);
    let loader = RankLoader::new(&CpuBackend, source.config(), 2, 1, ScaleRule::Rceil).unwrap();
    let mut w = loader.load(&source).unwrap();
    let spec = ProbeSpec { tokens: 4, latents: 16, seed: 1 };
    assert!(probe_rank(&loader, &w, &source, spec, ScaleRule::Rceil).unwrap().ok, "intact first");
    inject(&mut w, fault).unwrap();
    probe_rank(&loader, &w, &source, spec, ScaleRule::Rceil).unwrap()
}

#[test]
fn skipped_q_permutation_fails_the_probe() {
    let p = faulted(Fault::SkipQPermutation);
    assert!(!p.ok);
    assert!(p.layers[0].q_mismatches > p.q_values / 2, "{p:?}");
    assert!(p.z_max_rel_err > 100.0 * Z_TOLERANCE, "{p:?}");
}

#[test]
fn double_q_permutation_fails_the_probe() {
    let p = faulted(Fault::DoubleQPermutation);
    assert!(!p.ok);
    assert!(p.layers[0].q_mismatches > p.q_values / 2, "{p:?}");
    assert!(p.z_max_rel_err > 100.0 * Z_TOLERANCE, "{p:?}");
}

#[test]
fn skipped_o_scale_chunk_permutation_fails_the_probe() {
    let p = faulted(Fault::SkipOScaleChunkPermutation);
    assert!(!p.ok);
    // Q is untouched; the wo_a scales are wrong.
    assert_eq!(p.layers[0].q_mismatches, 0, "{p:?}");
    assert!(p.z_max_rel_err > 100.0 * Z_TOLERANCE, "{p:?}");
}

#[test]
fn swapped_heads_fail_the_probe() {
    let p = faulted(Fault::SwapHeads(0, 1));
    assert!(!p.ok);
    // Exactly the two heads' q values move: 2 heads x 512 dims x 4 tokens (minus equal values).
    assert!(p.layers[0].q_mismatches > 3500 && p.layers[0].q_mismatches <= 2 * 512 * 4, "{p:?}");
    assert!(p.z_max_rel_err > 100.0 * Z_TOLERANCE, "{p:?}");
}

/// A BF16 checkpoint quantized with `floor` on the kernel side but `rceil` in the reference.
#[test]
fn floor_rule_on_one_side_only_fails_the_probe() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bf16");
    let config = ModelConfig::from_preset(Preset::Tiny, Some(1), true).unwrap();
    write_checkpoint(&dir, &SynthOptions { config, seed: 8, max_shard_bytes: 1 << 30, preset_name: None }).unwrap();
    let source = LoadSource::open_checkpoint(&dir).unwrap();
    let spec = ProbeSpec { tokens: 4, latents: 16, seed: 2 };
    let floor = RankLoader::new(&CpuBackend, source.config(), 2, 0, ScaleRule::Floor).unwrap();
    let rceil = RankLoader::new(&CpuBackend, source.config(), 2, 0, ScaleRule::Rceil).unwrap();
    let w = floor.load(&source).unwrap();
    // Same rule on both sides passes.
    assert!(probe_rank(&floor, &w, &source, spec, ScaleRule::Floor).unwrap().ok);
    let p = probe_rank(&rceil, &w, &source, spec, ScaleRule::Floor).unwrap();
    assert!(!p.ok, "{p:?}");
    assert!(p.z_max_rel_err > 10.0 * Z_TOLERANCE, "{p:?}");
}

#[test]
fn probe_spec_parses_and_rejects() {
    assert_eq!("16,128".parse::<ProbeSpec>().unwrap(), ProbeSpec { tokens: 16, latents: 128, seed: 0 });
    assert_eq!("1, 2, 9".parse::<ProbeSpec>().unwrap(), ProbeSpec { tokens: 1, latents: 2, seed: 9 });
    for bad in ["16", "0,4", "4,x", "1,2,3,4", ""] {
        assert!(bad.parse::<ProbeSpec>().is_err(), "{bad}");
    }
}

/// A kept reference answers exactly as recomputing it would (the same verdict and errors, bit
/// for bit), is keyed by version and probe (another probe or version recomputes), and checks
/// as strictly: a fault injected after the reference was kept fails against the kept entry.
#[test]
fn a_kept_reference_gives_the_same_verdict_and_still_catches_a_fault() {
    use orchestrator_worker::probe::{ReferenceCache, probe_rank_with};
    let source = dummy(Preset::Tiny, 2, false, 31);
    let loader = RankLoader::new(&CpuBackend, source.config(), 2, 0, ScaleRule::Rceil).unwrap();
    let mut w = loader.load(&source).unwrap();
    let spec = ProbeSpec { tokens: 4, latents: 16, seed: 2 };
    let cache = std::sync::Mutex::new(ReferenceCache::default());
    let fresh = probe_rank_with(&loader, &w, &source, spec, ScaleRule::Rceil, true, Some(&cache)).unwrap();
    let kept = probe_rank_with(&loader, &w, &source, spec, ScaleRule::Rceil, true, Some(&cache)).unwrap();
    assert_eq!(
        {
            let c = cache.lock().unwrap();
            (c.misses, c.hits)
        },
        (1, 1)
    );
    assert!(fresh.ok && kept.ok);
    assert_eq!(fresh.y_partial_digest, kept.y_partial_digest);
    assert_eq!(fresh.z_max_abs_err.to_bits(), kept.z_max_abs_err.to_bits());
    assert_eq!(fresh.y_max_abs_err.to_bits(), kept.y_max_abs_err.to_bits());
    // Another probe is another question.
    let other = ProbeSpec { seed: 3, ..spec };
    probe_rank_with(&loader, &w, &source, other, ScaleRule::Rceil, true, Some(&cache)).unwrap();
    assert_eq!(
        {
            let c = cache.lock().unwrap();
            (c.misses, c.hits)
        },
        (2, 1)
    );
    // Serving probes (no check) neither read nor fill it.
    probe_rank_with(&loader, &w, &source, spec, ScaleRule::Rceil, false, Some(&cache)).unwrap();
    assert_eq!(
        {
            let c = cache.lock().unwrap();
            (c.misses, c.hits)
        },
        (2, 1)
    );
    // The weights go wrong after the reference was kept: the kept reference catches it.
    inject(&mut w, Fault::SkipQPermutation).unwrap();
    let caught = probe_rank_with(&loader, &w, &source, spec, ScaleRule::Rceil, true, Some(&cache)).unwrap();
    assert_eq!(cache.lock().unwrap().hits, 2);
    assert!(!caught.ok && caught.layers.iter().all(|l| l.q_mismatches > 0), "{caught:?}");
    // Bounded: only the last few entries are kept.
    for seed in 10..10 + ReferenceCache::CAPACITY as u64 + 2 {
        probe_rank_with(&loader, &w, &source, ProbeSpec { seed, ..spec }, ScaleRule::Rceil, true, Some(&cache)).unwrap();
    }
    let misses = cache.lock().unwrap().misses;
    probe_rank_with(&loader, &w, &source, spec, ScaleRule::Rceil, true, Some(&cache)).unwrap();
    assert_eq!(cache.lock().unwrap().misses, misses + 1, "the oldest entry was dropped");
}

/// A reference prepared before any weights are loaded (as a stage prepares it beside its load)
/// is the one a checked probe then uses: the probe hits it, gives bit for bit the verdict of a
/// probe that computed its own, and a fault injected afterwards still fails against it.
/// Preparing twice computes once.
#[test]
fn a_prepared_reference_is_what_the_probe_checks_against() {
    use orchestrator_worker::probe::{ReferenceCache, prepare_reference, probe_rank_with};
    let source = dummy(Preset::Tiny, 2, false, 33);
    let loader = RankLoader::new(&CpuBackend, source.config(), 2, 1, ScaleRule::Rceil).unwrap();
    let spec = ProbeSpec { tokens: 3, latents: 16, seed: 5 };
    let cache = std::sync::Mutex::new(ReferenceCache::default());
    let first = prepare_reference(&loader, &source, spec, &cache).unwrap();
    assert!(first > 0.0);
    assert_eq!(prepare_reference(&loader, &source, spec, &cache).unwrap(), 0.0, "kept already");
    let mut w = loader.load(&source).unwrap();
    let prepared = probe_rank_with(&loader, &w, &source, spec, ScaleRule::Rceil, true, Some(&cache)).unwrap();
    assert_eq!(
        {
            let c = cache.lock().unwrap();
            (c.misses, c.hits)
        },
        (0, 1)
    );
    let computed = probe_rank_with(&loader, &w, &source, spec, ScaleRule::Rceil, true, None).unwrap();
    assert!(prepared.ok && computed.ok);
    assert_eq!(prepared.y_partial_digest, computed.y_partial_digest);
    assert_eq!(prepared.z_max_abs_err.to_bits(), computed.z_max_abs_err.to_bits());
    assert_eq!(prepared.y_max_abs_err.to_bits(), computed.y_max_abs_err.to_bits());
    inject(&mut w, Fault::SkipQPermutation).unwrap();
    let caught = probe_rank_with(&loader, &w, &source, spec, ScaleRule::Rceil, true, Some(&cache)).unwrap();
    assert!(!caught.ok && caught.layers.iter().all(|l| l.q_mismatches > 0), "{caught:?}");
}

/// A reference read layer after layer into the same buffers gives each layer exactly what a
/// fresh read of that layer gives (nothing of the previous layer stays behind), FP8 and BF16.
#[test]
fn reference_layers_read_into_kept_buffers_equal_fresh_reads() {
    for bf16 in [false, true] {
        let source = dummy(Preset::Tiny, 3, bf16, 21);
        let loader = RankLoader::new(&CpuBackend, source.config(), 2, 1, ScaleRule::Rceil).unwrap();
        let mut kept = orchestrator_worker::reference::ReferenceScratch::default();
        for layer in [2, 0, 1] {
            let fresh = loader.reference_layer(&source, layer).unwrap();
            let into = loader.reference_layer_into(&source, layer, &mut kept).unwrap();
            for (a, b) in [(&fresh.wq_b, &into.wq_b), (&fresh.wo_a, &into.wo_a), (&fresh.wo_b, &into.wo_b)] {
                assert!(a == b, "bf16 {bf16} layer {layer}");
            }
            assert_eq!(fresh.attn_sink, into.attn_sink, "bf16 {bf16} layer {layer}");
        }
        // Layers differ, so the comparison above could fail.
        let (l0, l1) = (loader.reference_layer(&source, 0).unwrap(), loader.reference_layer(&source, 1).unwrap());
        assert!(l0.wq_b != l1.wq_b);
    }
}

/// A reference read from a safetensors checkpoint gives the bytes a reference of the same
/// generated checkpoint gives, layer after layer into the same buffers: FP8 slices of whole
/// rows (`wq_b`, `wo_a`) read in place in the file's mapping, a slice of some columns (`wo_b` at
/// TP 2) copied out, BF16 quantized; and a probe checked against it passes.
#[test]
fn a_reference_read_in_place_from_the_checkpoint_equals_the_generated_one() {
    for bf16 in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        let config = ModelConfig::from_preset(Preset::Tiny, Some(3), bf16).unwrap();
        write_checkpoint(&dir, &SynthOptions { config, seed: 31, max_shard_bytes: 1 << 30, preset_name: None }).unwrap();
        let (file, generated) = (LoadSource::open_checkpoint(&dir).unwrap(), dummy(Preset::Tiny, 3, bf16, 31));
        for (tp, rank) in [(1, 0), (2, 1)] {
            let loader = RankLoader::new(&CpuBackend, file.config(), tp, rank, ScaleRule::Rceil).unwrap();
            let mut kept = orchestrator_worker::reference::ReferenceScratch::default();
            for layer in [1, 0, 2] {
                let want = loader.reference_layer(&generated, layer).unwrap();
                let got = loader.reference_layer_into(&file, layer, &mut kept).unwrap();
                let what = format!("bf16 {bf16} tp {tp} rank {rank} layer {layer}");
                for (name, a, b) in [("wq_b", &want.wq_b, &got.wq_b), ("wo_a", &want.wo_a, &got.wo_a), ("wo_b", &want.wo_b, &got.wo_b)] {
                    assert!(a == b, "{what}: {name}");
                }
                assert_eq!(want.attn_sink, got.attn_sink, "{what}");
                assert_eq!(got.wq_b.0.is_mapped(), !bf16, "{what}: wq_b rows are read in place");
                assert_eq!(got.wo_a.0.is_mapped(), !bf16, "{what}: wo_a rows are read in place");
                assert_eq!(got.wo_b.0.is_mapped(), !bf16 && tp == 1, "{what}: wo_b is whole rows only at TP 1");
            }
            let w = loader.load(&file).unwrap();
            assert_passes(
                &probe_rank(&loader, &w, &file, ProbeSpec { tokens: 2, latents: 16, seed: 3 }, ScaleRule::Rceil).unwrap(),
                "in place",
            );
        }
    }
}

/// The host buffers a reference leaves for the next (kept by the cache, so that a copied-out
/// slice lands in memory already faulted in) hold no mapping of the checkpoint but keep the
/// copied slice's memory; a reference of another version computed on them is, bit for bit,
/// the one computed afresh.
#[test]
fn a_reference_on_the_buffers_another_left_is_the_fresh_one() {
    use orchestrator_worker::probe::{ReferenceCache, prepare_reference, probe_rank_with};
    let tmp = tempfile::tempdir().unwrap();
    let config = ModelConfig::from_preset(Preset::Tiny, Some(2), false).unwrap();
    let open = |name: &str, seed| {
        let dir = tmp.path().join(name);
        write_checkpoint(&dir, &SynthOptions { config: config.clone(), seed, max_shard_bytes: 1 << 30, preset_name: None }).unwrap();
        LoadSource::open_checkpoint(&dir).unwrap()
    };
    let (a, b) = (open("a", 41), open("b", 42));
    // TP 2: wo_b is a slice of some columns, copied out; wq_b and wo_a are read in place.
    let loader = RankLoader::new(&CpuBackend, a.config(), 2, 1, ScaleRule::Rceil).unwrap();
    let mut scratch = orchestrator_worker::reference::ReferenceScratch::default();
    assert!(loader.reference_layer_into(&a, 0, &mut scratch).unwrap().wq_b.0.is_mapped());
    let kept = scratch.into_kept();
    assert!([&kept.wq_b, &kept.wo_a, &kept.wo_b].iter().all(|(w, _)| !w.is_mapped()), "no mapping is kept");
    assert!(!kept.wo_b.0.as_slice().is_empty(), "the copied-out slice's buffer is kept");
    let spec = ProbeSpec { tokens: 2, latents: 16, seed: 7 };
    let cache = std::sync::Mutex::new(ReferenceCache::default());
    assert!(prepare_reference(&loader, &a, spec, &cache).unwrap() > 0.0);
    // B's reference on the buffers A's left.
    assert!(prepare_reference(&loader, &b, spec, &cache).unwrap() > 0.0);
    let w = loader.load(&b).unwrap();
    let prepared = probe_rank_with(&loader, &w, &b, spec, ScaleRule::Rceil, true, Some(&cache)).unwrap();
    assert_eq!(cache.lock().unwrap().hits, 1);
    let fresh = probe_rank_with(&loader, &w, &b, spec, ScaleRule::Rceil, true, None).unwrap();
    assert!(prepared.ok && fresh.ok);
    assert_eq!(prepared.y_partial_digest, fresh.y_partial_digest);
    assert_eq!(prepared.z_max_abs_err.to_bits(), fresh.z_max_abs_err.to_bits());
    assert_eq!(prepared.y_max_abs_err.to_bits(), fresh.y_max_abs_err.to_bits());
}

/// `load_unless` (the spare buffers a rank prepares after its launch): the same weights as a
/// load while nothing cancels it, and nothing once something does, asked before every layer.
#[test]
fn a_cancellable_load_gives_the_loads_weights_or_nothing() {
    let source = dummy(Preset::Tiny, 3, false, 22);
    let loader = RankLoader::new(&CpuBackend, source.config(), 2, 0, ScaleRule::Rceil).unwrap();
    let whole = loader.load(&source).unwrap();
    let asked = std::sync::atomic::AtomicUsize::new(0);
    let spare = loader.load_unless(&source, &|| asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == usize::MAX).unwrap().unwrap();
    assert_eq!(asked.into_inner(), 3, "asked before each of the 3 layers");
    assert_eq!(spare.kernel_rank_digest(), whole.kernel_rank_digest());
    assert_eq!(spare.source_rank_digest(), whole.source_rank_digest());
    let asked = std::sync::atomic::AtomicUsize::new(0);
    let cancelled = loader.load_unless(&source, &|| asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1).unwrap();
    assert!(cancelled.is_none(), "cancelled before layer 1");
    assert_eq!(asked.into_inner(), 2);
}
