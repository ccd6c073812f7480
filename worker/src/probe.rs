//! Probes: the mega-attention forward pass run on a rank's kernel-visible tensors, checked
//! against the same mathematics on its checkpoint-order weights (spec section 8).

use std::time::Instant;

use orchestrator_kernels::forward::{
    LayerGemm, LayerWeightsView, Layouts, ProbeInputs, ProbeOutput, ProbeShape, compare, forward, forward_with, q_column,
};
use orchestrator_kernels::gemm::{MxMatrix, ScaleView, WeightView};
use orchestrator_kernels::params::{KernelTensor, ScaleLayout};
use orchestrator_kernels::{Backend, BackendWeight, Digest, KernelError, ScaleKind, ScaleRule};
use orchestrator_model::limits::LimitError;
use orchestrator_model::{Generator, Geometry};
use serde::Serialize;

use crate::loader::{LoadError, RankLoader, RankWeights, serialize_hex};
use crate::reference::{ReferenceBytes, ReferenceLayer, ReferenceScratch};
use crate::source::LoadSource;

/// Tolerance of `z` against the reference (the PR's test: rtol = atol = 1e-3).
pub const Z_TOLERANCE: f32 = 1e-3;

/// `T,S[,SEED]`: tokens, latents, input seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct ProbeSpec {
    pub tokens: usize,
    pub latents: usize,
    pub seed: u64,
}

/// As it is written on the command line: `T,S,SEED`.
impl std::fmt::Display for ProbeSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{},{},{}", self.tokens, self.latents, self.seed)
    }
}

impl std::str::FromStr for ProbeSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let num = |i: usize, what: &str| -> Result<u64, String> {
            parts
                .get(i)
                .ok_or_else(|| format!("probe `{s}`: missing {what}"))?
                .parse::<u64>()
                .map_err(|e| format!("probe `{s}`: {what}: {e}"))
        };
        if !(2..=3).contains(&parts.len()) {
            return Err(format!("probe `{s}`: expected T,S or T,S,SEED"));
        }
        let (tokens, latents) = (num(0, "T (tokens)")? as usize, num(1, "S (latents)")? as usize);
        if tokens == 0 || latents == 0 {
            return Err(format!("probe `{s}`: T and S must be at least 1"));
        }
        orchestrator_model::limits::check_probe(tokens, latents).map_err(|e| format!("probe `{s}`: {e}"))?;
        let seed = if parts.len() == 3 { num(2, "SEED")? } else { 0 };
        Ok(Self { tokens, latents, seed })
    }
}

impl ProbeSpec {
    /// The serving-sized probe (T = 2, S = 16, seed 0): what an update verifies with and the
    /// health loop reinstates with where the cluster has no `--probe` of its own, the default
    /// of the load generator and of `bench update`.
    pub const SERVING: ProbeSpec = ProbeSpec { tokens: 2, latents: 16, seed: 0 };

    /// A probe of the size a request, a journal or a flag gives, within the limits
    /// ([`orchestrator_model::limits::check_probe`]: at least one token and latent, at most
    /// the largest sizes a rank computes).
    pub fn checked(tokens: u32, latents: u32, seed: u64) -> Result<ProbeSpec, LimitError> {
        let spec = ProbeSpec { tokens: tokens as usize, latents: latents as usize, seed };
        orchestrator_model::limits::check_probe(spec.tokens, spec.latents)?;
        Ok(spec)
    }

    /// Whether this probe stays within the limits on a rank of TP size `tp` holding `layers`
    /// layers of `g`: its sizes, and the memory it holds there
    /// ([`orchestrator_model::limits::check_probe_on`]). Returns that memory in bytes.
    pub fn check_on(&self, g: &Geometry, layers: usize, tp: usize) -> Result<usize, LimitError> {
        orchestrator_model::limits::check_probe_on(g, layers, tp, self.tokens, self.latents)
    }

    /// The inputs every rank builds identically: `qr [T, q_lora]` and `kv [S, head_dim]`,
    /// ~N(0, 1) from the counter-based generator keyed by the seed, MXFP8-quantized (rceil).
    pub fn inputs(&self, g: &Geometry) -> Result<ProbeInputs, KernelError> {
        let generator = Generator::new(self.seed);
        let qr = generator.normal_f32("probe.qr", self.tokens * g.q_lora_rank);
        let kv = generator.normal_f32("probe.kv", self.latents * g.head_dim);
        let qr = MxMatrix::quantize(&qr, g.q_lora_rank, ScaleRule::Rceil)?;
        let kv = MxMatrix::quantize(&kv, g.head_dim, ScaleRule::Rceil)?.dequantize();
        Ok(ProbeInputs { qr, kv, latents: self.latents })
    }
}

/// What the reference computed for a rank, kept so that the same question is not recomputed:
/// each layer's plain-path output for one (content version, TP size and rank, scale rule,
/// probe). The reference is a pure function of those, so a probe checked against a kept entry
/// is checked against exactly what recomputing would give. Holds the last few entries.
#[derive(Default)]
pub struct ReferenceCache {
    entries: std::collections::VecDeque<(ReferenceKey, std::sync::Arc<Vec<ProbeOutput>>)>,
    /// The host buffers of the last reference computed, for the next one to reuse (taken while
    /// one computes: a concurrent one allocates its own).
    kept_buffers: Option<ReferenceLayer>,
    /// Probes answered from the cache, and computed afresh (for reports and tests).
    pub hits: u64,
    pub misses: u64,
}

/// What a kept reference answers: the content version, the TP size and rank, the rule, the probe.
type ReferenceKey = (String, usize, usize, ScaleRule, ProbeSpec);

impl ReferenceCache {
    /// How many (version, probe) entries are kept (a rank holds at most two versions; probes
    /// of reports, updates and the health loop may differ).
    pub const CAPACITY: usize = 4;

    fn get(&mut self, key: &ReferenceKey) -> Option<std::sync::Arc<Vec<ProbeOutput>>> {
        let found = self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        if found.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        found
    }

    fn contains(&self, key: &ReferenceKey) -> bool {
        self.entries.iter().any(|(k, _)| k == key)
    }

    /// A scratch for computing a reference, on the kept buffers when no other reference holds them.
    fn scratch<B: Backend>(cache: Option<&std::sync::Mutex<Self>>) -> ReferenceScratch<B> {
        let kept = cache.and_then(|c| c.lock().unwrap_or_else(|p| p.into_inner()).kept_buffers.take());
        ReferenceScratch::reusing(kept.unwrap_or_default())
    }

    /// Keeps `scratch`'s buffers for the next reference.
    fn keep<B: Backend>(cache: Option<&std::sync::Mutex<Self>>, scratch: ReferenceScratch<B>) {
        if let Some(c) = cache {
            c.lock().unwrap_or_else(|p| p.into_inner()).kept_buffers = Some(scratch.into_kept());
        }
    }

    fn put(&mut self, key: ReferenceKey, outputs: Vec<ProbeOutput>) {
        self.entries.retain(|(k, _)| k != &key);
        if self.entries.len() == Self::CAPACITY {
            self.entries.pop_front();
        }
        self.entries.push_back((key, std::sync::Arc::new(outputs)));
    }
}

/// The probe verdict of one layer.
#[derive(Clone, Debug, Serialize)]
pub struct LayerProbe {
    pub layer: usize,
    /// Values of the fused `q` that differ (bitwise) from the permuted reference `q`.
    pub q_mismatches: usize,
    pub z_max_abs_err: f32,
    pub z_max_rel_err: f32,
    pub z_within_tolerance: bool,
    pub y_max_abs_err: f32,
    pub y_max_rel_err: f32,
    pub ok: bool,
}

/// The probe verdict of one rank.
#[derive(Clone, Debug, Serialize)]
pub struct RankProbe {
    pub spec: ProbeSpec,
    pub layers: Vec<LayerProbe>,
    /// XXH3-64 of `y_partial [layers, T, hidden]` as little-endian f32.
    #[serde(serialize_with = "serialize_hex")]
    pub y_partial_digest: Digest,
    pub q_values: usize,
    pub z_max_abs_err: f32,
    pub z_max_rel_err: f32,
    pub y_max_abs_err: f32,
    pub y_max_rel_err: f32,
    pub ok: bool,
    pub kernel_s: f64,
    pub reference_s: f64,
    #[serde(skip)]
    pub y_partial: Vec<f32>,
}

fn shape_of(g: &Geometry, shard: &orchestrator_model::RankShard) -> ProbeShape {
    ProbeShape {
        heads: shard.n_local_heads,
        groups: shard.n_local_groups,
        head_dim: g.head_dim,
        rope_dim: g.rope_dim,
        q_lora: g.q_lora_rank,
        o_lora: g.o_lora_rank,
        hidden: g.hidden,
    }
}

/// A linear (`[N, K]`, swizzled scales) kernel tensor as a GEMM operand.
fn linear_weight<'a, B: Backend>(t: &'a KernelTensor<B>) -> Result<BackendWeight<'a, B>, KernelError> {
    match (t.scale_layout, t.weight_shape.as_slice()) {
        (ScaleLayout::Swizzled128x4 { .. }, &[n, k]) => {
            Ok(BackendWeight { elements: &t.weight, offset: 0, n, k, scales: &t.scale, scales_layout: ScaleKind::Swizzled128x4 })
        }
        (layout, shape) => Err(KernelError::Layout(format!("expected a swizzled [N, K] linear weight, found {layout:?} {shape:?}"))),
    }
}

/// Runs the probe on every layer of a loaded rank and checks it against the reference.
pub fn probe_rank<B: Backend + Sync>(
    loader: &RankLoader<'_, B>,
    weights: &RankWeights<B>,
    source: &LoadSource,
    spec: ProbeSpec,
    rule: ScaleRule,
) -> Result<RankProbe, LoadError>
where
    B::Buffer: Sync,
{
    probe_rank_with(loader, weights, source, spec, rule, true, None)
}

/// [`probe_rank`]; without `check`, only the kernel pass runs (serving traffic: the output,
/// not the yardstick), and every layer counts as unchecked-but-served. With a `cache`, the
/// reference outputs for this version and probe are taken from it when it has them, and kept
/// in it when computed.
pub fn probe_rank_with<B: Backend + Sync>(
    loader: &RankLoader<'_, B>,
    weights: &RankWeights<B>,
    source: &LoadSource,
    spec: ProbeSpec,
    rule: ScaleRule,
    check: bool,
    cache: Option<&std::sync::Mutex<ReferenceCache>>,
) -> Result<RankProbe, LoadError>
where
    B::Buffer: Sync,
{
    // On a thread of the pool the GEMMs run on (`background::on_a_pool_thread`).
    crate::background::on_a_pool_thread(|| {
        let backend = loader.backend();
        let g = &weights.identity.geometry;
        spec.check_on(g, weights.layers.len(), weights.identity.tp_size).map_err(|error| LoadError::ProbeSize { spec, error })?;
        let shape = shape_of(g, &weights.shard);
        let inputs = spec.inputs(g).map_err(|e| LoadError::Config(format!("probe inputs: {e}")))?;
        let key: ReferenceKey = (source.version(), weights.identity.tp_size, weights.identity.rank, rule, spec);
        // The cache is locked only to look up and to store, never while computing: a probe that
        // runs below serving never holds up one that serves.
        let kept = match (check, cache) {
            (true, Some(c)) => c.lock().unwrap_or_else(|p| p.into_inner()).get(&key),
            _ => None,
        };
        // A checked probe that found no kept reference computes it: it borrows the cache's scratch
        // buffers, and gives them back and keeps what it computed at the end.
        let computes_reference = check && kept.is_none();
        let mut computed = Vec::new();
        let mut scratch = if computes_reference { ReferenceCache::scratch(cache) } else { ReferenceScratch::default() };
        let mut layers = Vec::new();
        let mut y_partial = Vec::new();
        let (mut kernel_s, mut reference_s) = (0.0, 0.0);
        for (i, layer) in weights.layers.iter().enumerate() {
            let bad = |e: KernelError| LoadError::Config(format!("probe of layer {}: {e}", layer.layer));
            let t = Instant::now();
            let mut sink_bytes = Vec::new();
            backend.download(&layer.attn_sink, &mut sink_bytes).map_err(bad)?;
            let sink: Vec<f32> = sink_bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let kernel = run_kernel(backend, &shape, &inputs, [&layer.wq_b, &layer.wo_a, &layer.wo_b], &sink, rule).map_err(bad)?;
            kernel_s += t.elapsed().as_secs_f64();
            if check {
                let t = Instant::now();
                match kept.as_ref().and_then(|k| k.get(i)) {
                    Some(want) => layers.push(check_layer(layer.layer, &shape, &kernel, want)),
                    None => {
                        let want = reference_output(loader, source, &shape, &inputs, layer.layer, rule, &mut scratch)?;
                        layers.push(check_layer(layer.layer, &shape, &kernel, &want));
                        computed.push(want);
                    }
                }
                reference_s += t.elapsed().as_secs_f64();
            } else {
                layers.push(LayerProbe {
                    layer: layer.layer,
                    q_mismatches: 0,
                    z_max_abs_err: 0.0,
                    z_max_rel_err: 0.0,
                    z_within_tolerance: true,
                    y_max_abs_err: 0.0,
                    y_max_rel_err: 0.0,
                    ok: true,
                });
            }
            y_partial.extend_from_slice(&kernel.y_partial);
        }
        if computes_reference {
            ReferenceCache::keep(cache, scratch);
        }
        if let Some(c) = cache
            && computes_reference
            && computed.len() == weights.layers.len()
        {
            c.lock().unwrap_or_else(|p| p.into_inner()).put(key, computed);
        }
        let max = |f: fn(&LayerProbe) -> f32| layers.iter().map(f).fold(0f32, f32::max);
        Ok(RankProbe {
            spec,
            q_values: spec.tokens * shape.heads * shape.head_dim,
            z_max_abs_err: max(|l| l.z_max_abs_err),
            z_max_rel_err: max(|l| l.z_max_rel_err),
            y_max_abs_err: max(|l| l.y_max_abs_err),
            y_max_rel_err: max(|l| l.y_max_rel_err),
            ok: layers.iter().all(|l| l.ok),
            layers,
            y_partial_digest: Digest::of_f32(&y_partial),
            kernel_s,
            reference_s,
            y_partial,
        })
    })
}

/// The plain path's output of one layer: its checkpoint-order weights re-read and dequantized,
/// then the reference GEMMs (independent of every kernel layout).
#[allow(clippy::too_many_arguments)]
fn reference_output<B: Backend + Sync>(
    loader: &RankLoader<'_, B>,
    source: &LoadSource,
    shape: &ProbeShape,
    inputs: &ProbeInputs,
    layer: usize,
    rule: ScaleRule,
    scratch: &mut ReferenceScratch<B>,
) -> Result<ProbeOutput, LoadError> {
    let reference = loader.reference_layer_into(source, layer, scratch)?;
    run_reference(shape, inputs, reference, rule).map_err(|e| LoadError::Config(format!("probe of layer {layer}: {e}")))
}

/// Computes the reference of `spec` for every layer of `source` on this rank and keeps it in
/// `cache` (unless it is there already), so that a later checked probe of a version loaded from
/// `source` runs only its kernel pass and compares against exactly what the reference gives.
/// It needs no loaded weights (the reference reads the checkpoint), so a stage runs it beside
/// its load; the cache is locked only to look up and to store, never while computing.
/// Returns the seconds the reference took (0 when it was kept already).
pub fn prepare_reference<B: Backend + Sync>(
    loader: &RankLoader<'_, B>,
    source: &LoadSource,
    spec: ProbeSpec,
    cache: &std::sync::Mutex<ReferenceCache>,
) -> Result<f64, LoadError> {
    let rule = loader.rule();
    let shard = loader.shard();
    let key: ReferenceKey = (source.version(), shard.tp_size, shard.rank, rule, spec);
    if cache.lock().unwrap_or_else(|p| p.into_inner()).contains(&key) {
        return Ok(0.0);
    }
    let t = Instant::now();
    let g = &source.config().geometry;
    spec.check_on(g, g.layers, shard.tp_size).map_err(|error| LoadError::ProbeSize { spec, error })?;
    let shape = shape_of(g, shard);
    let inputs = spec.inputs(g).map_err(|e| LoadError::Config(format!("probe inputs: {e}")))?;
    let mut scratch = ReferenceCache::scratch(Some(cache));
    let outputs: Result<Vec<_>, _> =
        (0..g.layers).map(|layer| reference_output(loader, source, &shape, &inputs, layer, rule, &mut scratch)).collect();
    ReferenceCache::keep(Some(cache), scratch);
    let outputs = outputs?;
    cache.lock().unwrap_or_else(|p| p.into_inner()).put(key, outputs);
    Ok(t.elapsed().as_secs_f64())
}

/// The pass on the kernel tensors where they live: every GEMM runs on the backend
/// ([`Backend::mx_gemm`]: on the device for CUDA), the attention core on the host.
fn run_kernel<B: Backend>(
    backend: &B,
    shape: &ProbeShape,
    inputs: &ProbeInputs,
    [wq_b, wo_a, wo_b]: [&KernelTensor<B>; 3],
    sink: &[f32],
    rule: ScaleRule,
) -> Result<ProbeOutput, KernelError> {
    let (groups, rows_per_group, k) = match (wo_a.scale_layout, wo_a.weight_shape.as_slice()) {
        (ScaleLayout::PackedUe8m0 { .. }, &[g, r, k]) => (g, r, k),
        (layout, s) => return Err(KernelError::Layout(format!("expected a packed [g, rows, K] wo_a, found {layout:?} {s:?}"))),
    };
    let (wq_b, wo_b) = (linear_weight(wq_b)?, linear_weight(wo_b)?);
    let wo_a_group = |g: usize| BackendWeight {
        elements: &wo_a.weight,
        offset: g * rows_per_group * k,
        n: rows_per_group,
        k,
        scales: &wo_a.scale,
        scales_layout: ScaleKind::PackedUe8m0 { group: g, rows_per_group },
    };
    forward_with(shape, inputs, sink, groups, Layouts::Kernel, rule, |which, a| match which {
        LayerGemm::WqB => backend.mx_gemm(a, &wq_b),
        LayerGemm::WoA(g) => backend.mx_gemm(a, &wo_a_group(g)),
        LayerGemm::WoB => backend.mx_gemm(a, &wo_b),
    })
}

fn row_major_view((e, s): &(ReferenceBytes, Vec<u8>), n: usize) -> WeightView<'_> {
    let e = e.as_slice();
    WeightView { elements: e, n, k: e.len() / n.max(1), scales: ScaleView::RowMajor(s) }
}

fn run_reference(shape: &ProbeShape, inputs: &ProbeInputs, r: &ReferenceLayer, rule: ScaleRule) -> Result<ProbeOutput, KernelError> {
    let group_rows = shape.o_lora;
    let (wo_a_e, wo_a_s) = (r.wo_a.0.as_slice(), &r.wo_a.1);
    let k_o = wo_a_e.len() / (shape.groups * group_rows).max(1);
    let c_o = k_o / 32;
    let wo_a = (0..shape.groups)
        .map(|g| WeightView {
            elements: &wo_a_e[g * group_rows * k_o..(g + 1) * group_rows * k_o],
            n: group_rows,
            k: k_o,
            scales: ScaleView::RowMajor(&wo_a_s[g * group_rows * c_o..(g + 1) * group_rows * c_o]),
        })
        .collect();
    let views = LayerWeightsView {
        wq_b: row_major_view(&r.wq_b, shape.heads * shape.head_dim),
        wo_a,
        wo_b: row_major_view(&r.wo_b, shape.hidden),
        attn_sink: &r.attn_sink,
    };
    forward(shape, inputs, &views, Layouts::Reference, rule)
}

fn check_layer(layer: usize, shape: &ProbeShape, got: &ProbeOutput, want: &ProbeOutput) -> LayerProbe {
    let n_q = shape.heads * shape.head_dim;
    let t_rows = got.q.len() / n_q.max(1);
    let mut q_mismatches = 0;
    for t in 0..t_rows {
        for h in 0..shape.heads {
            for d in 0..shape.head_dim {
                let fused = got.q[t * n_q + q_column(Layouts::Kernel, shape.heads, shape.head_dim, h, d)];
                let standard = want.q[t * n_q + q_column(Layouts::Reference, shape.heads, shape.head_dim, h, d)];
                q_mismatches += usize::from(fused.to_bits() != standard.to_bits());
            }
        }
    }
    let (z_abs, z_rel, z_ok) = compare(&got.z, &want.z, Z_TOLERANCE, Z_TOLERANCE);
    let (y_abs, y_rel, _) = compare(&got.y_partial, &want.y_partial, Z_TOLERANCE, Z_TOLERANCE);
    LayerProbe {
        layer,
        q_mismatches,
        z_max_abs_err: z_abs,
        z_max_rel_err: z_rel,
        z_within_tolerance: z_ok,
        y_max_abs_err: y_abs,
        y_max_rel_err: y_rel,
        ok: q_mismatches == 0 && z_ok,
    }
}

/// `y`: the partials of every rank of a TP group summed in rank order (deterministic).
pub fn sum_partials(partials: &[&[f32]]) -> Vec<f32> {
    let mut y = partials.first().map(|p| p.to_vec()).unwrap_or_default();
    for p in &partials[1.min(partials.len())..] {
        for (a, b) in y.iter_mut().zip(p.iter()) {
            *a += b;
        }
    }
    y
}
