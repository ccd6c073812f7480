//! The round-trip check: inverse hooks, then inverse permutation, of the kernel tensors must
//! reproduce the rank's checkpoint-order data: for FP8 the stored slices themselves (weights,
//! and the block scales recompressed from the per-row scales), for BF16 the MXFP8
//! quantization of the stored slices in checkpoint order: as the load's quantizer produced it
//! (digested in checkpoint order before its blocks were placed), or, where the load did not
//! record that (a device quantizer), recomputed here with the plain (unpermuted) quantizer.

use std::sync::{Arc, Mutex};

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
    /// What failed, tensor by tensor (serialized as the lines the reports print).
    pub failures: Vec<RoundTripFailure>,
    /// Not run here: the verdict of the verified rank (`dp0/tp1`) whose kernel and source bytes
    /// this rank's equal, by digest (a later replica of a version, see the worker's reports).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identical_to: Option<String>,
}

/// One way a round trip failed, as data: which tensor, and what the check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RoundTripFailure {
    /// The inverse permutations could not be built for this shard.
    Permutations(String),
    /// The weights name a scale rule this build does not know.
    ScaleRule(String),
    /// Reading a layer back through the inverse hooks and permutations failed.
    Layer { layer: usize, error: String },
    /// The inverse gives other bytes than the checkpoint-order data (`what`: the tensor, or
    /// which part of a quantized one).
    Mismatch { what: String, got: Digest, want: Digest },
    /// The load recorded no checkpoint-order digest to compare with.
    NoDigest { what: String },
    /// The block scales could not be recompressed from the kernel's per-row scales.
    BlockScales { tensor: String, error: String },
    /// The tensor is not one of this geometry's.
    UnknownTensor { tensor: String },
    /// Re-reading the checkpoint-order slice to quantize it again failed.
    Source { tensor: String, error: String },
}

impl RoundTripFailure {
    /// The tensor it names (with the part of a quantized one, as in `... (MXFP8 scales)`), where
    /// it names one.
    pub fn tensor(&self) -> Option<&str> {
        match self {
            Self::Permutations(_) | Self::ScaleRule(_) | Self::Layer { .. } => None,
            Self::Mismatch { what, .. } | Self::NoDigest { what } => Some(what),
            Self::BlockScales { tensor, .. } | Self::UnknownTensor { tensor } | Self::Source { tensor, .. } => Some(tensor),
        }
    }
}

impl From<&RoundTripFailure> for orchestrator_proto::v1::RoundTripFailure {
    /// What a rank report carries beside the failure's line.
    fn from(f: &RoundTripFailure) -> Self {
        use orchestrator_proto::v1::RoundTripFailureKind as Kind;
        let kind = match f {
            RoundTripFailure::Permutations(_) => Kind::Permutations,
            RoundTripFailure::ScaleRule(_) => Kind::ScaleRule,
            RoundTripFailure::Layer { .. } => Kind::Layer,
            RoundTripFailure::Mismatch { .. } => Kind::Mismatch,
            RoundTripFailure::NoDigest { .. } => Kind::NoDigest,
            RoundTripFailure::BlockScales { .. } => Kind::BlockScales,
            RoundTripFailure::UnknownTensor { .. } => Kind::UnknownTensor,
            RoundTripFailure::Source { .. } => Kind::Source,
        };
        Self { kind: kind.into(), tensor: f.tensor().unwrap_or_default().to_string() }
    }
}

/// The line a report prints (and a rank report carries over gRPC).
impl std::fmt::Display for RoundTripFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Permutations(e) => write!(f, "permutations: {e}"),
            Self::ScaleRule(e) => write!(f, "{e}"),
            Self::Layer { layer, error } => write!(f, "layer {layer}: {error}"),
            Self::Mismatch { what, got, want } => write!(f, "{what}: round trip gives {got}, the checkpoint-order data has {want}"),
            Self::NoDigest { what } => write!(f, "{what}: no checkpoint-order digest recorded"),
            Self::BlockScales { tensor, error } => write!(f, "{tensor}: {error}"),
            Self::UnknownTensor { tensor } => write!(f, "{tensor}: not a tensor of this geometry"),
            Self::Source { tensor, error } => write!(f, "{tensor}: re-reading the source: {error}"),
        }
    }
}

/// As its line, so that `load --json` reads as before.
impl Serialize for RoundTripFailure {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
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
    B::Buffer: Send + Sync,
{
    check_rank_with(backend, weights, source, &RoundTripScratch::default())
}

/// Scratch buffers that round trips keep for the next one: a worker's round trips (its load's,
/// then each stage's) find the buffers the one before faulted in, instead of mapping and zeroing
/// fresh ones on every layer of every check (on a VM whose host reclaims free guest memory, each
/// such page fault is also a host fault). Holds one set per layer checked at once: at most the
/// threads of the pools that run round trips.
pub struct RoundTripScratch<B: Backend> {
    free: Mutex<Vec<LayerCheckScratch<B>>>,
    /// The Q and O permutations of the last shape checked (local heads, head_dim).
    permutations: Mutex<Option<Permutations>>,
}

type Permutations = Arc<((usize, usize), QPermutation, OPermutation)>;

/// What one layer's check needs: backend buffers for the inverse hooks and permutations, and
/// the host buffer each view's scales are downloaded into.
struct LayerCheckScratch<B: Backend> {
    pool: BufferPool<B>,
    host: Vec<u8>,
}

impl<B: Backend> Default for RoundTripScratch<B> {
    fn default() -> Self {
        Self { free: Mutex::new(Vec::new()), permutations: Mutex::new(None) }
    }
}

impl<B: Backend> RoundTripScratch<B> {
    fn take(&self) -> LayerCheckScratch<B> {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_else(|| LayerCheckScratch { pool: BufferPool::default(), host: Vec::new() })
    }

    fn give(&self, scratch: LayerCheckScratch<B>) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).push(scratch);
    }

    /// The permutations of `n_local_heads` heads of `head_dim`: the kept ones when they are of
    /// that shape, else made (and kept).
    fn permutations(&self, n_local_heads: usize, head_dim: usize) -> Result<Permutations, KernelError> {
        let shape = (n_local_heads, head_dim);
        let mut kept = self.permutations.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = kept.as_ref().filter(|p| p.0 == shape) {
            return Ok(p.clone());
        }
        let made = Arc::new((shape, QPermutation::new(n_local_heads, head_dim)?, OPermutation::new(head_dim)?));
        *kept = Some(made.clone());
        Ok(made)
    }
}

/// [`check_rank`] on buffers kept in `scratch` (and left there for the next check).
pub fn check_rank_with<B: Backend + Sync>(
    backend: &B,
    weights: &RankWeights<B>,
    source: &LoadSource,
    scratch: &RoundTripScratch<B>,
) -> RoundTrip
where
    B::Buffer: Send + Sync,
{
    use rayon::prelude::*;
    let format = source.config().format;
    let g = &weights.identity.geometry;
    let mut out = RoundTrip { ok: true, ..Default::default() };
    let perms = match scratch.permutations(weights.shard.n_local_heads, g.head_dim) {
        Ok(p) => p,
        Err(e) => {
            out.ok = false;
            out.failures.push(RoundTripFailure::Permutations(e.to_string()));
            return out;
        }
    };
    let rule: ScaleRule = match weights.identity.scale_rule.parse() {
        Ok(r) => r,
        Err(e) => {
            out.ok = false;
            out.failures.push(RoundTripFailure::ScaleRule(e));
            return out;
        }
    };
    let ctx = Context { backend, weights, source, format, rule };
    let (_, q, o) = &*perms;
    let layers: Vec<RoundTrip> = weights
        .layers
        .par_iter()
        .map(|layer| {
            let mut one = RoundTrip::default();
            let mut kept = scratch.take();
            if let Err(e) = check_layer(&ctx, layer, q, o, &mut kept, &mut one) {
                one.failures.push(RoundTripFailure::Layer { layer: layer.layer, error: e.to_string() });
            }
            scratch.give(kept);
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
    scratch: &mut LayerCheckScratch<B>,
    out: &mut RoundTrip,
) -> Result<(), KernelError> {
    let (l, backend) = (layer.layer, ctx.backend);
    let LayerCheckScratch { pool, host } = scratch;
    compare(ctx, layer, Param::WqB, &layer.wq_b.wq_b_in_checkpoint_order(backend, q, pool, host)?, out)?;
    compare(ctx, layer, Param::WoA, &layer.wo_a.wo_a_in_checkpoint_order(backend, o, pool, host)?, out)?;
    compare(ctx, layer, Param::WoB, &layer.wo_b.wo_b_in_checkpoint_order(backend, pool, host)?, out)?;
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
        Some(want) => out.failures.push(RoundTripFailure::Mismatch { what: what.to_string(), got, want }),
        None => out.failures.push(RoundTripFailure::NoDigest { what: what.to_string() }),
    }
}

fn compare<B: Backend>(
    ctx: &Context<'_, B>,
    layer: &LayerWeights<B>,
    param: Param,
    back: &CheckpointOrderView<'_>,
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
                    out.failures.push(RoundTripFailure::BlockScales { tensor: sname, error: e.to_string() });
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
                out.failures.push(RoundTripFailure::UnknownTensor { tensor: wname });
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
                Err(e) => out.failures.push(RoundTripFailure::Source { tensor: wname, error: e.to_string() }),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_data_that_reads_and_serializes_as_the_line_reports_print() {
        let mismatch = RoundTripFailure::Mismatch { what: "layers.3.attn.wq_b.weight".into(), got: Digest(0xab), want: Digest(0xcd) };
        let failures = vec![
            mismatch.clone(),
            RoundTripFailure::NoDigest { what: "layers.0.attn.attn_sink".into() },
            RoundTripFailure::Layer { layer: 2, error: "shape".into() },
        ];
        assert_eq!(mismatch.tensor(), Some("layers.3.attn.wq_b.weight"));
        assert_eq!(failures[2].tensor(), None);
        let rt = RoundTrip { ok: false, checked: 7, failures, identical_to: None };
        assert_eq!(
            serde_json::to_value(&rt).unwrap(),
            serde_json::json!({
                "ok": false,
                "checked": 7,
                "failures": [
                    "layers.3.attn.wq_b.weight: round trip gives 00000000000000ab, the checkpoint-order data has 00000000000000cd",
                    "layers.0.attn.attn_sink: no checkpoint-order digest recorded",
                    "layer 2: shape",
                ],
            })
        );
    }

    /// What a rank report carries of each failure: its kind and the tensor it names.
    #[test]
    fn a_failure_goes_over_grpc_as_its_kind_and_tensor() {
        use orchestrator_proto::v1::{RoundTripFailure as Pb, RoundTripFailureKind as Kind};
        let t = || "layers.1.attn.wo_a.scale".to_string();
        let cases = [
            (RoundTripFailure::Mismatch { what: t(), got: Digest(1), want: Digest(2) }, Kind::Mismatch, t()),
            (RoundTripFailure::NoDigest { what: t() }, Kind::NoDigest, t()),
            (RoundTripFailure::BlockScales { tensor: t(), error: "e".into() }, Kind::BlockScales, t()),
            (RoundTripFailure::UnknownTensor { tensor: t() }, Kind::UnknownTensor, t()),
            (RoundTripFailure::Source { tensor: t(), error: "e".into() }, Kind::Source, t()),
            (RoundTripFailure::Layer { layer: 1, error: "e".into() }, Kind::Layer, String::new()),
            (RoundTripFailure::Permutations("e".into()), Kind::Permutations, String::new()),
            (RoundTripFailure::ScaleRule("e".into()), Kind::ScaleRule, String::new()),
        ];
        for (failure, kind, tensor) in cases {
            assert_eq!(Pb::from(&failure), Pb { kind: kind.into(), tensor }, "{failure}");
        }
    }
}
