//! The round-trip check: inverse hooks, then inverse permutation, of the kernel tensors must
//! reproduce the rank's checkpoint-order data: for FP8 the stored slices themselves (weights,
//! and the block scales recompressed from the per-row scales), for BF16 the MXFP8
//! quantization of the stored slices in checkpoint order: as the load's quantizer produced it
//! (digested in checkpoint order before its blocks were placed), or, where the load did not
//! record that (a device quantizer), recomputed here with the plain (unpermuted) quantizer.

use orchestrator_kernels::mxfp8::quantize_bf16_rows;
use orchestrator_kernels::params::{CheckpointOrderView, OPermutation, QPermutation};
use orchestrator_kernels::{Backend, BufferPool, Digest, KernelError, ScaleRule};
use orchestrator_model::names::{checkpoint_name, layer_tensors};
use orchestrator_model::{Param, Part, WeightFormat};
use serde::Serialize;

use crate::loader::{LayerWeights, RankWeights, rank_slice};
use crate::source::LoadSource;

/// The verdict of a round trip.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct RoundTrip {
    pub ok: bool,
    pub checked: usize,
    /// One line per mismatch: tensor and what differed.
    pub failures: Vec<String>,
    /// Not run here: the verdict of the verified rank (`dp0/tp1`) whose kernel and source bytes
    /// this rank's equal, by digest (a later replica of a version, see the worker's reports).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identical_to: Option<String>,
}

/// Runs the round trip for every layer of a rank against the source it was loaded from, the
/// layers in parallel (the verdict lists them in layer order).
///
/// Each kernel tensor is read back through the inverse hooks and the inverse permutation: its
/// scales into checkpoint order (small), its weight bytes hashed through the inverse index map
/// ([`orchestrator_kernels::Backend::digest_gathered_runs`]) instead of copied back out, so the
/// check costs about one read of the rank's bytes and allocates nothing the size of a tensor.
pub fn check_rank<B: Backend + Sync>(backend: &B, weights: &RankWeights<B>, source: &LoadSource) -> RoundTrip
where
    B::Buffer: Sync,
{
    use rayon::prelude::*;
    let format = source.config().format;
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
    let rule: ScaleRule = match weights.identity.scale_rule.parse() {
        Ok(r) => r,
        Err(e) => {
            out.ok = false;
            out.failures.push(e);
            return out;
        }
    };
    let ctx = Context { backend, weights, source, format, rule };
    let layers: Vec<RoundTrip> = weights
        .layers
        .par_iter()
        .map_init(BufferPool::<B>::default, |pool, layer| {
            let mut one = RoundTrip::default();
            if let Err(e) = check_layer(&ctx, layer, &q, &o, pool, &mut one) {
                one.failures.push(format!("layer {}: {e}", layer.layer));
            }
            one
        })
        .collect();
    for one in layers {
        out.checked += one.checked;
        out.failures.extend(one.failures);
    }
    out.ok = out.failures.is_empty();
    out
}

struct Context<'a, B: Backend> {
    backend: &'a B,
    weights: &'a RankWeights<B>,
    source: &'a LoadSource,
    format: WeightFormat,
    rule: ScaleRule,
}

fn check_layer<B: Backend>(
    ctx: &Context<'_, B>,
    layer: &LayerWeights<B>,
    q: &QPermutation,
    o: &OPermutation,
    pool: &mut BufferPool<B>,
    out: &mut RoundTrip,
) -> Result<(), KernelError> {
    let (l, backend) = (layer.layer, ctx.backend);
    compare(ctx, layer, Param::WqB, &layer.wq_b.wq_b_in_checkpoint_order(backend, q, pool)?, out)?;
    compare(ctx, layer, Param::WoA, &layer.wo_a.wo_a_in_checkpoint_order(backend, o, pool)?, out)?;
    compare(ctx, layer, Param::WoB, &layer.wo_b.wo_b_in_checkpoint_order(backend, pool)?, out)?;
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

fn compare<B: Backend>(
    ctx: &Context<'_, B>,
    layer: &LayerWeights<B>,
    param: Param,
    back: &CheckpointOrderView,
    out: &mut RoundTrip,
) -> Result<(), KernelError> {
    let wname = checkpoint_name(layer.layer, param, Part::Weight);
    let (wd, sd) = (back.weight, back.scale_digest());
    match ctx.format {
        WeightFormat::Fp8 { block } => {
            expect_digest(out, &wname, source_digest(layer, &wname), wd);
            let sname = checkpoint_name(layer.layer, param, Part::Scale);
            match back.block_scales(block) {
                Ok(bytes) => expect_digest(out, &sname, source_digest(layer, &sname), Digest::of(&bytes)),
                Err(e) => {
                    out.checked += 1;
                    out.failures.push(format!("{sname}: {e}"));
                }
            }
        }
        WeightFormat::Bf16 => {
            if let Some((_, q)) = layer.quantized.iter().find(|(name, _)| *name == wname) {
                expect_digest(out, &format!("{wname} (MXFP8 elements)"), Some(q.elements), wd);
                expect_digest(out, &format!("{wname} (MXFP8 scales)"), Some(q.scales), sd);
                return Ok(());
            }
            // Re-read the slice and quantize it plainly, in checkpoint order.
            let g = &ctx.weights.identity.geometry;
            let spec = layer_tensors(g, ctx.format, layer.layer).into_iter().find(|s| s.param == param && s.part == Part::Weight);
            let Some(spec) = spec else {
                out.failures.push(format!("{wname}: not a tensor of this geometry"));
                return Ok(());
            };
            let (rows, cols) = rank_slice(g, ctx.format, &ctx.weights.shard, &spec);
            let (n_rows, n_cols) = (rows.len(), cols.len());
            let mut staging = Vec::new();
            let want = ctx.source.fetch(&spec, rows, cols, &mut staging).map_err(|e| KernelError::Layout(e.to_string())).and_then(|f| {
                let (mut e, mut s) = (Vec::new(), Vec::new());
                quantize_bf16_rows(f.bytes(&staging), n_rows, n_cols, ctx.rule, &mut e, &mut s)?;
                Ok((Digest::of(&e), Digest::of(&s)))
            });
            match want {
                Ok((we, ws)) => {
                    expect_digest(out, &format!("{wname} (MXFP8 elements)"), Some(we), wd);
                    expect_digest(out, &format!("{wname} (MXFP8 scales)"), Some(ws), sd);
                }
                Err(e) => out.failures.push(format!("{wname}: re-reading the source: {e}")),
            }
        }
    }
    Ok(())
}
