//! The round-trip check: inverse hooks, then inverse permutation, of the kernel tensors must
//! reproduce the rank's checkpoint-order data: for FP8 the stored slices themselves (weights,
//! and the block scales recompressed from the per-row scales), for BF16 the checkpoint-order
//! MXFP8 matrices recorded during load.

use orchestrator_kernels::params::{CheckpointOrder, Mx, OPermutation, QPermutation};
use orchestrator_kernels::{Backend, BufferPool, Digest, KernelError};
use orchestrator_model::names::checkpoint_name;
use orchestrator_model::{Param, Part, WeightFormat};
use serde::Serialize;

use crate::loader::{LayerWeights, RankWeights};

/// The verdict of a round trip.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct RoundTrip {
    pub ok: bool,
    pub checked: usize,
    /// One line per mismatch: tensor and what differed.
    pub failures: Vec<String>,
}

/// Runs the round trip for every layer of a rank.
pub fn check_rank<B: Backend>(backend: &B, weights: &RankWeights<B>, format: WeightFormat) -> RoundTrip {
    let g = &weights.identity.geometry;
    let mut out = RoundTrip { ok: true, ..Default::default() };
    let perms = QPermutation::new(weights.shard.n_local_heads, g.head_dim).and_then(|q| Ok((q, OPermutation::new(g.head_dim)?)));
    let (q, o) = match perms {
        Ok(p) => p,
        Err(e) => {
            out.ok = false;
            out.failures.push(format!("permutations: {e}"));
            return out;
        }
    };
    let mut pool = BufferPool::<B>::default();
    for layer in &weights.layers {
        if let Err(e) = check_layer(backend, layer, format, &q, &o, &mut pool, &mut out) {
            out.failures.push(format!("layer {}: {e}", layer.layer));
        }
    }
    out.ok = out.failures.is_empty();
    out
}

fn check_layer<B: Backend>(
    backend: &B,
    layer: &LayerWeights<B>,
    format: WeightFormat,
    q: &QPermutation,
    o: &OPermutation,
    pool: &mut BufferPool<B>,
    out: &mut RoundTrip,
) -> Result<(), KernelError> {
    let l = layer.layer;
    let wq_b = layer.wq_b.unhook_wq_b(backend, pool)?.unpermute(backend, q, pool)?;
    compare(backend, layer, Param::WqB, &wq_b, format, out)?;
    wq_b.recycle(pool);
    let wo_a = layer.wo_a.unhook_wo_a(backend, pool)?.unpermute(backend, o, pool)?;
    compare(backend, layer, Param::WoA, &wo_a, format, out)?;
    wo_a.recycle(pool);
    let wo_b = layer.wo_b.unhook_wo_b(backend, pool)?;
    compare(backend, layer, Param::WoB, &wo_b, format, out)?;
    wo_b.recycle(pool);
    let sink = checkpoint_name(l, Param::AttnSink, Part::Weight);
    let got = backend.digest(&layer.attn_sink)?;
    expect_digest(out, &sink, source_digest(layer, &sink), got);
    Ok(())
}

fn source_digest<B: Backend>(layer: &LayerWeights<B>, name: &str) -> Option<Digest> {
    layer.source.iter().find(|d| d.name == name).map(|d| d.digest)
}

fn expect_digest(out: &mut RoundTrip, what: &str, want: Option<Digest>, got: Digest) {
    out.checked += 1;
    match want {
        Some(w) if w == got => {}
        Some(w) => out.failures.push(format!("{what}: round trip gives {got}, the checkpoint-order data has {w}")),
        None => out.failures.push(format!("{what}: no checkpoint-order digest recorded")),
    }
}

fn compare<B: Backend, P>(
    backend: &B,
    layer: &LayerWeights<B>,
    param: Param,
    back: &Mx<B, P, CheckpointOrder>,
    format: WeightFormat,
    out: &mut RoundTrip,
) -> Result<(), KernelError> {
    let wname = checkpoint_name(layer.layer, param, Part::Weight);
    let (wd, sd) = back.digests(backend)?;
    match format {
        WeightFormat::Fp8 { block } => {
            expect_digest(out, &wname, source_digest(layer, &wname), wd);
            let sname = checkpoint_name(layer.layer, param, Part::Scale);
            match back.block_scales(backend, block) {
                Ok(bytes) => expect_digest(out, &sname, source_digest(layer, &sname), Digest::of(&bytes)),
                Err(e) => {
                    out.checked += 1;
                    out.failures.push(format!("{sname}: {e}"));
                }
            }
        }
        WeightFormat::Bf16 => {
            let recorded = layer.checkpoint_order.iter().find(|(p, _)| *p == param).map(|(_, d)| *d);
            expect_digest(out, &format!("{wname} (MXFP8 elements)"), recorded.map(|r| r.0), wd);
            expect_digest(out, &format!("{wname} (MXFP8 scales)"), recorded.map(|r| r.1), sd);
        }
    }
    Ok(())
}
