//! `--verify golden`: an independent, plainly written recomputation of every kernel-visible
//! tensor of one rank, straight from the spec's formulas (sections 3-7, 9), to catch a bug in
//! the fast pipeline.
//!
//! Nothing here calls the fast pipeline or its helpers (`params`, `permutation`, `layout`,
//! `backend`, [`crate::RankLoader`]): the rank's slices are read through
//! [`LoadSource::read`] with row and column ranges computed here from spec section 4, and
//! every index map (scale expansion, Q rows, O columns and scale chunks, F8_128x4 swizzle,
//! packed UE8M0) is written element by element as the spec states it. Only the decoding of
//! bytes ([`e4m3`], [`e8m0`]), the MXFP8 quantization of BF16 sources
//! ([`mxfp8::quantize_bf16_rows`]: quantization is not what this checks) and XXH3
//! ([`Digest::of`]) are shared.
//!
//! The golden path validates its inputs as the loader does (NaN scale bytes, NaN E4M3 bytes,
//! non-finite BF16 or `attn_sink` values, TP sizes mega attention refuses) and never panics on
//! bad input: it returns a [`LoadError`] naming the tensor and its absolute position.

use std::ops::Range;
use std::path::PathBuf;

use orchestrator_kernels::{Digest, KernelError, ScaleRule, e4m3, e8m0, mxfp8};
use orchestrator_model::{ModelConfig, Param, Part, RankShard, TensorSpec, WeightFormat};
use rayon::prelude::*;
use safetensors::Dtype;

use crate::loader::LoadError;
use crate::source::LoadSource;

/// Elements per MXFP8 block along K (spec section 6).
const MX_BLOCK: usize = 32;
/// Heads per `wo_a` group (spec section 2).
const HEADS_PER_GROUP: usize = 8;
/// Dims per Q chunk (spec section 5).
const Q_CHUNK: usize = 16;
/// Dims per O chunk (spec section 5).
const O_CHUNK: usize = 32;

/// One kernel-visible tensor as the golden path recomputed it: its bytes in storage order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoldenTensor {
    /// Kernel parameter name (`layers.{i}.attn.wq_b.weight_scale`, ...).
    pub name: String,
    /// Safetensors dtype name: `F8_E4M3`, `F8_E8M0`, `I32` or `F32`.
    pub dtype: &'static str,
    /// Shape in storage order.
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl GoldenTensor {
    /// XXH3-64 of the bytes (spec section 9).
    pub fn digest(&self) -> Digest {
        Digest::of(&self.bytes)
    }
}

/// A kernel tensor whose digest differs between the golden path and what was observed
/// (`None`: the tensor is missing on that side).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoldenMismatch {
    pub name: String,
    pub golden: Option<Digest>,
    pub observed: Option<Digest>,
}

impl std::fmt::Display for GoldenMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |d: Option<Digest>| d.map(|d| format!("{:016x}", d.0)).unwrap_or_else(|| "missing".to_string());
        write!(f, "{}: golden {}, observed {}", self.name, show(self.golden), show(self.observed))
    }
}

/// The kernel layout the golden path computes: the expected one, or one of the wrong layouts
/// that known loader bugs produce (what `verify-dump` compares a differing tensor with).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    Expected,
    /// `wq_b` rows and `wo_a` columns (and their scales) left in checkpoint order.
    PermutationSkipped,
    /// The permutations applied twice (a reload that permuted already permuted weights).
    PermutedTwice,
    /// `wq_b` / `wo_b` scales left as plain per-row `[M, K/32]` bytes, not F8_128x4.
    ScalesNotSwizzled,
    /// `wo_a` scales left as plain per-row `[g*1024, K/32]` bytes, not DeepGEMM packed UE8M0.
    ScalesNotPacked,
}

impl Layout {
    /// The wrong layouts, in the order a diagnosis tries them.
    pub const WRONG: [Layout; 4] = [Layout::PermutationSkipped, Layout::PermutedTwice, Layout::ScalesNotSwizzled, Layout::ScalesNotPacked];

    pub fn name(self) -> &'static str {
        match self {
            Layout::Expected => "expected",
            Layout::PermutationSkipped => "permutation_skipped",
            Layout::PermutedTwice => "permuted_twice",
            Layout::ScalesNotSwizzled => "scales_not_swizzled",
            Layout::ScalesNotPacked => "scales_not_packed",
        }
    }
}

/// One kernel tensor as the golden path computed it, without its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoldenDigest {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub digest: Digest,
}

/// Kernel-visible tensor digests of one rank, recomputed plainly: (kernel parameter name,
/// digest), sorted by name (byte order).
pub fn golden_kernel_digests(
    source: &LoadSource,
    tp_size: usize,
    rank: usize,
    rule: ScaleRule,
) -> Result<Vec<(String, Digest)>, LoadError> {
    Ok(golden_kernel_tensors_as(source, tp_size, rank, rule, Layout::Expected)?.into_iter().map(|t| (t.name, t.digest)).collect())
}

/// Every kernel-visible tensor of one rank in `layout`, sorted by name (byte order).
pub fn golden_kernel_tensors_as(
    source: &LoadSource,
    tp_size: usize,
    rank: usize,
    rule: ScaleRule,
    layout: Layout,
) -> Result<Vec<GoldenDigest>, LoadError> {
    let plan = RankPlan::new(source.config(), tp_size, rank)?;
    // Layers are independent; each keeps its bytes only until they are hashed.
    let per_layer: Vec<Vec<_>> = (0..plan.layers)
        .into_par_iter()
        .map(|layer| {
            Ok(plan
                .layer(source, layer, rule, layout)?
                .into_iter()
                .map(|t| GoldenDigest { digest: t.digest(), name: t.name, dtype: t.dtype, shape: t.shape })
                .collect())
        })
        .collect::<Result<_, LoadError>>()?;
    let mut all: Vec<GoldenDigest> = per_layer.into_iter().flatten().collect();
    all.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
    Ok(all)
}

/// The digests of the rank's slices of checkpoint bytes as stored (spec section 9's source
/// digests), by checkpoint tensor name, sorted by name.
pub fn golden_source_digests(source: &LoadSource, tp_size: usize, rank: usize) -> Result<Vec<(String, Digest)>, LoadError> {
    let plan = RankPlan::new(source.config(), tp_size, rank)?;
    let per_layer: Vec<Vec<(String, Digest)>> =
        (0..plan.layers).into_par_iter().map(|layer| plan.source_slices(source, layer)).collect::<Result<_, LoadError>>()?;
    let mut all: Vec<(String, Digest)> = per_layer.into_iter().flatten().collect();
    all.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    Ok(all)
}

/// Rank digest over the golden kernel digests (spec section 9).
pub fn golden_rank_digest(source: &LoadSource, tp_size: usize, rank: usize, rule: ScaleRule) -> Result<Digest, LoadError> {
    Ok(rank_digest_of(&golden_kernel_digests(source, tp_size, rank, rule)?))
}

/// One layer's kernel-visible tensors of one rank, recomputed plainly, sorted by name.
pub fn golden_layer_tensors(
    source: &LoadSource,
    tp_size: usize,
    rank: usize,
    layer: usize,
    rule: ScaleRule,
) -> Result<Vec<GoldenTensor>, LoadError> {
    let plan = RankPlan::new(source.config(), tp_size, rank)?;
    if layer >= plan.layers {
        return Err(LoadError::Config(format!("layer {layer} is outside 0..{}", plan.layers)));
    }
    plan.layer(source, layer, rule, Layout::Expected)
}

/// Spec section 9's rank digest, written out: XXH3-64 of the UTF-8 lines `"{name} {hex}\n"`
/// sorted by name (byte order), `hex` being 16 lowercase hex digits.
pub fn rank_digest_of(digests: &[(String, Digest)]) -> Digest {
    let mut lines: Vec<(&str, Digest)> = digests.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    lines.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut text = String::new();
    for (name, d) in lines {
        text.push_str(&format!("{name} {:016x}\n", d.0));
    }
    Digest::of(text.as_bytes())
}

/// Every tensor whose digest differs between `golden` and `observed`, or that only one side
/// has, sorted by name.
pub fn golden_mismatches(golden: &[(String, Digest)], observed: &[(String, Digest)]) -> Vec<GoldenMismatch> {
    let g: std::collections::BTreeMap<&str, Digest> = golden.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    let o: std::collections::BTreeMap<&str, Digest> = observed.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    let mut names: Vec<&str> = g.keys().chain(o.keys()).copied().collect();
    names.sort_unstable_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    names.dedup();
    names
        .into_iter()
        .filter_map(|n| {
            let (a, b) = (g.get(n).copied(), o.get(n).copied());
            (a != b).then(|| GoldenMismatch { name: n.to_string(), golden: a, observed: b })
        })
        .collect()
}

/// What one rank holds (spec section 4), computed from the geometry alone.
struct RankPlan {
    format: WeightFormat,
    layers: usize,
    /// All heads `H` and this rank's first head and head count.
    heads: usize,
    head0: usize,
    local_heads: usize,
    head_dim: usize,
    hidden: usize,
    q_lora: usize,
    o_lora: usize,
    groups: usize,
    group0: usize,
    local_groups: usize,
}

impl RankPlan {
    fn new(config: &ModelConfig, tp_size: usize, rank: usize) -> Result<Self, LoadError> {
        let g = &config.geometry;
        let bad = |why: String| Err(LoadError::Config(format!("golden: {why}")));
        // These checks keep every index map of this module in bounds on any config (a dummy
        // source's config is not validated by `config.json` parsing).
        if g.o_groups == 0 || g.o_groups.checked_mul(HEADS_PER_GROUP) != Some(g.heads) {
            return bad(format!("{} heads over {} groups is not {HEADS_PER_GROUP} heads per group", g.heads, g.o_groups));
        }
        // Mega attention's TP rule (spec section 4) and the rank's range, with the shared message
        // ("TP 16 leaves 4 heads per rank ...").
        RankShard::new(g, tp_size, rank)?;
        if g.head_dim == 0 || !g.head_dim.is_multiple_of(O_CHUNK) {
            return bad(format!("head_dim {} is not a positive multiple of {O_CHUNK}", g.head_dim));
        }
        for (what, v) in [("q_lora_rank", g.q_lora_rank), ("o_lora_rank", g.o_lora_rank), ("hidden_size", g.hidden)] {
            if v == 0 || !v.is_multiple_of(MX_BLOCK) {
                return bad(format!("{what} {v} is not a positive multiple of {MX_BLOCK}"));
            }
        }
        let sizes = [
            g.heads.checked_mul(g.head_dim).and_then(|n| n.checked_mul(g.q_lora_rank)),
            g.o_groups.checked_mul(g.o_lora_rank).and_then(|n| n.checked_mul(g.head_dim)).and_then(|n| n.checked_mul(HEADS_PER_GROUP)),
            g.o_groups.checked_mul(g.o_lora_rank).and_then(|n| n.checked_mul(g.hidden)),
        ];
        if sizes.iter().any(Option::is_none) {
            return bad("a tensor's element count overflows".to_string());
        }
        let (local_heads, local_groups) = (g.heads / tp_size, g.o_groups / tp_size);
        let plan = Self {
            format: config.format,
            layers: g.layers,
            heads: g.heads,
            head0: rank * local_heads,
            local_heads,
            head_dim: g.head_dim,
            hidden: g.hidden,
            q_lora: g.q_lora_rank,
            o_lora: g.o_lora_rank,
            groups: g.o_groups,
            group0: rank * local_groups,
            local_groups,
        };
        if local_heads != HEADS_PER_GROUP * local_groups {
            return bad(format!("{local_heads} local heads over {local_groups} local groups"));
        }
        if let WeightFormat::Fp8 { block: [bm, bk] } = plan.format {
            if bm == 0 || bk == 0 || !bk.is_multiple_of(MX_BLOCK) {
                return bad(format!("FP8 block [{bm}, {bk}]: both must be positive and {bk} a multiple of {MX_BLOCK}"));
            }
            // Every row range and column range the rank reads must cover whole blocks.
            let q_rows = plan.q_rows();
            let o_rows = plan.o_rows();
            for (what, r, d) in [
                ("wq_b rows", &q_rows, bm),
                ("wq_b columns", &(0..plan.q_lora), bk),
                ("wo_a rows", &o_rows, bm),
                ("wo_a columns", &(0..plan.o_cols()), bk),
                ("wo_b rows", &(0..plan.hidden), bm),
                ("wo_b columns", &o_rows, bk),
            ] {
                if !r.start.is_multiple_of(d) || !r.end.is_multiple_of(d) {
                    return bad(format!("the rank's {what} {r:?} do not cover whole FP8 blocks of {d}"));
                }
            }
        }
        Ok(plan)
    }

    /// The rank's `wq_b` rows: its heads times head_dim.
    fn q_rows(&self) -> Range<usize> {
        self.head0 * self.head_dim..(self.head0 + self.local_heads) * self.head_dim
    }
    /// The rank's `wo_a` rows (and `wo_b` columns): its groups times o_lora_rank.
    fn o_rows(&self) -> Range<usize> {
        self.group0 * self.o_lora..(self.group0 + self.local_groups) * self.o_lora
    }
    /// `wo_a` columns: 8 heads times head_dim.
    fn o_cols(&self) -> usize {
        HEADS_PER_GROUP * self.head_dim
    }

    /// The rank's slices of one layer's checkpoint tensors as stored, hashed: (checkpoint
    /// name, digest).
    fn source_slices(&self, source: &LoadSource, layer: usize) -> Result<Vec<(String, Digest)>, LoadError> {
        let mut out = Vec::new();
        let matrices = [
            (Param::WqB, "wq_b", [self.heads * self.head_dim, self.q_lora], self.q_rows(), 0..self.q_lora),
            (Param::WoA, "wo_a", [self.groups * self.o_lora, self.o_cols()], self.o_rows(), 0..self.o_cols()),
            (Param::WoB, "wo_b", [self.hidden, self.groups * self.o_lora], 0..self.hidden, self.o_rows()),
        ];
        for (param, short, shape, rows, cols) in matrices {
            let wname = format!("layers.{layer}.attn.{short}.weight");
            match self.format {
                WeightFormat::Fp8 { block: [bm, bk] } => {
                    let wspec = tensor_spec(wname.clone(), layer, param, Part::Weight, Dtype::F8_E4M3, shape.to_vec());
                    out.push((wname, Digest::of(&read_exact(source, &wspec, rows.clone(), cols.clone(), 1)?.0)));
                    let sname = format!("layers.{layer}.attn.{short}.scale");
                    let sspec = tensor_spec(sname.clone(), layer, param, Part::Scale, Dtype::F8_E8M0, vec![shape[0] / bm, shape[1] / bk]);
                    let (brows, bcols) = (rows.start / bm..rows.end / bm, cols.start / bk..cols.end / bk);
                    out.push((sname, Digest::of(&read_exact(source, &sspec, brows, bcols, 1)?.0)));
                }
                WeightFormat::Bf16 => {
                    let wspec = tensor_spec(wname.clone(), layer, param, Part::Weight, Dtype::BF16, shape.to_vec());
                    out.push((wname, Digest::of(&read_exact(source, &wspec, rows, cols, 2)?.0)));
                }
            }
        }
        let sink_name = format!("layers.{layer}.attn.attn_sink");
        let spec = tensor_spec(sink_name.clone(), layer, Param::AttnSink, Part::Weight, Dtype::F32, vec![self.heads]);
        out.push((sink_name, Digest::of(&read_exact(source, &spec, 0..1, self.head0..self.head0 + self.local_heads, 4)?.0)));
        Ok(out)
    }

    /// Every kernel tensor of one layer in `layout`, sorted by name.
    fn layer(&self, source: &LoadSource, layer: usize, rule: ScaleRule, layout: Layout) -> Result<Vec<GoldenTensor>, LoadError> {
        let name = |p: &str, part: &str| format!("layers.{layer}.attn.{p}.{part}");
        let mut out = Vec::with_capacity(7);

        // wq_b: per-row MXFP8 of the rank's rows, then the Q row permutation (weight and scale
        // rows alike), then the F8_128x4 swizzle of the scale.
        let (n, k) = (self.local_heads * self.head_dim, self.q_lora);
        let (w, s) = self.per_row(source, layer, Param::WqB, [self.heads * self.head_dim, k], self.q_rows(), 0..k, rule)?;
        let (fw, fs) = match layout {
            Layout::PermutationSkipped => (w, s),
            Layout::PermutedTwice => {
                let (w1, s1) = fuse_q(&w, &s, self.local_heads, self.head_dim, k);
                fuse_q(&w1, &s1, self.local_heads, self.head_dim, k)
            }
            _ => fuse_q(&w, &s, self.local_heads, self.head_dim, k),
        };
        let sw = if layout == Layout::ScalesNotSwizzled { fs } else { swizzle_128x4(&fs, n, k / MX_BLOCK) };
        out.push(GoldenTensor { name: name("wq_b", "weight"), dtype: "F8_E4M3", shape: vec![n, k], bytes: fw });
        out.push(GoldenTensor { name: name("wq_b", "weight_scale"), dtype: "F8_E8M0", shape: vec![sw.len()], bytes: sw });

        // wo_a: per-row MXFP8 of the rank's groups, then the O column permutation of every row
        // (and the chunk permutation of its per-32 scale columns), then the packed UE8M0.
        let (rows, k) = (self.local_groups * self.o_lora, self.o_cols());
        let (w, s) = self.per_row(source, layer, Param::WoA, [self.groups * self.o_lora, k], self.o_rows(), 0..k, rule)?;
        let (fw, fs) = match layout {
            Layout::PermutationSkipped => (w, s),
            Layout::PermutedTwice => {
                let (w1, s1) = fuse_o(&w, &s, rows, self.head_dim);
                fuse_o(&w1, &s1, rows, self.head_dim)
            }
            _ => fuse_o(&w, &s, rows, self.head_dim),
        };
        let c = k / MX_BLOCK;
        let packed = if layout == Layout::ScalesNotPacked { fs } else { pack_ue8m0(&fs, self.local_groups, self.o_lora, c) };
        out.push(GoldenTensor {
            name: name("wo_a", "weight"),
            dtype: "F8_E4M3",
            shape: vec![self.local_groups, self.o_lora, k],
            bytes: fw,
        });
        out.push(GoldenTensor {
            name: name("wo_a", "weight_scale"),
            dtype: "I32",
            shape: vec![self.local_groups, c / 4, self.o_lora],
            bytes: packed,
        });

        // wo_b: the rank's columns, unpermuted; the per-row scale swizzled.
        let k = self.local_groups * self.o_lora;
        let (w, s) =
            self.per_row(source, layer, Param::WoB, [self.hidden, self.groups * self.o_lora], 0..self.hidden, self.o_rows(), rule)?;
        let sw = if layout == Layout::ScalesNotSwizzled { s } else { swizzle_128x4(&s, self.hidden, k / MX_BLOCK) };
        out.push(GoldenTensor { name: name("wo_b", "weight"), dtype: "F8_E4M3", shape: vec![self.hidden, k], bytes: w });
        out.push(GoldenTensor { name: name("wo_b", "weight_scale"), dtype: "F8_E8M0", shape: vec![sw.len()], bytes: sw });

        // attn_sink: the rank's heads' f32 bytes as stored.
        let sink_name = format!("layers.{layer}.attn.attn_sink");
        let spec = tensor_spec(sink_name.clone(), layer, Param::AttnSink, Part::Weight, Dtype::F32, vec![self.heads]);
        let heads = self.head0..self.head0 + self.local_heads;
        let (bytes, file) = read_exact(source, &spec, 0..1, heads, 4)?;
        for (i, b) in bytes.chunks_exact(4).enumerate() {
            if !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite() {
                return Err(tensor_error(&sink_name, file, KernelError::NonFinite { row: 0, col: self.head0 + i }));
            }
        }
        out.push(GoldenTensor { name: sink_name, dtype: "F32", shape: vec![self.local_heads], bytes });

        out.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        Ok(out)
    }

    /// Rows `rows` x columns `cols` of a matrix parameter of checkpoint shape `shape`, as E4M3
    /// elements `[rows, cols]` with one UE8M0 scale per row and 32 columns `[rows, cols/32]`
    /// (FP8: block scales expanded; BF16: quantized with `rule`), in checkpoint order.
    #[allow(clippy::too_many_arguments)]
    fn per_row(
        &self,
        source: &LoadSource,
        layer: usize,
        param: Param,
        shape: [usize; 2],
        rows: Range<usize>,
        cols: Range<usize>,
        rule: ScaleRule,
    ) -> Result<(Vec<u8>, Vec<u8>), LoadError> {
        let short = match param {
            Param::WqB => "wq_b",
            Param::WoA => "wo_a",
            Param::WoB => "wo_b",
            Param::AttnSink => "attn_sink",
        };
        let wname = format!("layers.{layer}.attn.{short}.weight");
        let (n, k) = (rows.len(), cols.len());
        let c = k / MX_BLOCK;
        match self.format {
            WeightFormat::Fp8 { block: [bm, bk] } => {
                let wspec = tensor_spec(wname.clone(), layer, param, Part::Weight, Dtype::F8_E4M3, shape.to_vec());
                let (w, wfile) = read_exact(source, &wspec, rows.clone(), cols.clone(), 1)?;
                // The block scale `[N/bm, K/bk]`; the rank reads the blocks over its rows and columns.
                let sname = format!("layers.{layer}.attn.{short}.scale");
                let sspec = tensor_spec(sname.clone(), layer, param, Part::Scale, Dtype::F8_E8M0, vec![shape[0] / bm, shape[1] / bk]);
                let (brows, bcols) = (rows.start / bm..rows.end / bm, cols.start / bk..cols.end / bk);
                let (bs, sfile) = read_exact(source, &sspec, brows.clone(), bcols.clone(), 1)?;
                let bw = bcols.len();
                if let Some(at) = bs.iter().position(|&b| b == e8m0::NAN_BYTE) {
                    let pos = KernelError::NanScale { row: brows.start + at / bw, col: bcols.start + at % bw };
                    return Err(tensor_error(&sname, sfile, pos));
                }
                if let Some(at) = w.iter().position(|&b| e4m3::to_f32(b).is_nan()) {
                    return Err(tensor_error(&wname, wfile, KernelError::NonFinite { row: rows.start + at / k, col: cols.start + at % k }));
                }
                // Spec section 3: scale[r][j] = block_scale[r / bm][j * 32 / bk], in absolute
                // checkpoint rows and 32-column blocks, then relative to the slice read.
                let mut scale = vec![0u8; n * c];
                for r in 0..n {
                    let abs_row = rows.start + r;
                    for j in 0..c {
                        let abs_block = cols.start / MX_BLOCK + j;
                        let (bi, bj) = (abs_row / bm - brows.start, abs_block * MX_BLOCK / bk - bcols.start);
                        scale[r * c + j] = bs[bi * bw + bj];
                    }
                }
                Ok((w, scale))
            }
            WeightFormat::Bf16 => {
                let wspec = tensor_spec(wname.clone(), layer, param, Part::Weight, Dtype::BF16, shape.to_vec());
                let (w, wfile) = read_exact(source, &wspec, rows.clone(), cols.clone(), 2)?;
                let (mut elements, mut scales) = (Vec::new(), Vec::new());
                mxfp8::quantize_bf16_rows(&w, n, k, rule, &mut elements, &mut scales).map_err(|e| match e {
                    KernelError::NonFinite { row, col } => {
                        tensor_error(&wname, wfile.clone(), KernelError::NonFinite { row: rows.start + row, col: cols.start + col })
                    }
                    other => tensor_error(&wname, wfile.clone(), other),
                })?;
                Ok((elements, scales))
            }
        }
    }
}

/// Spec section 5, Q: standard row `s = h*D + d` moves to fused row
/// `f = (d/16)*(H*16) + h*16 + d%16`; its per-row scale row moves alike.
fn fuse_q(w: &[u8], s: &[u8], heads: usize, head_dim: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
    let c = k / MX_BLOCK;
    let (mut fw, mut fs) = (vec![0u8; w.len()], vec![0u8; s.len()]);
    for h in 0..heads {
        for d in 0..head_dim {
            let std_row = h * head_dim + d;
            let fused_row = (d / Q_CHUNK) * (heads * Q_CHUNK) + h * Q_CHUNK + d % Q_CHUNK;
            for x in 0..k {
                fw[fused_row * k + x] = w[std_row * k + x];
            }
            for j in 0..c {
                fs[fused_row * c + j] = s[std_row * c + j];
            }
        }
    }
    (fw, fs)
}

/// Spec section 5, O, on every row of `wo_a [rows, 8*D]`: standard column `s = h*D + c*32 + j`
/// moves to fused column `f = (c*8 + h)*32 + j`; the per-32 scale column (standard chunk
/// `h*(D/32) + c`) moves to fused chunk `c*8 + h`.
fn fuse_o(w: &[u8], s: &[u8], rows: usize, head_dim: usize) -> (Vec<u8>, Vec<u8>) {
    let k = HEADS_PER_GROUP * head_dim;
    let chunks = head_dim / O_CHUNK;
    let sc = k / MX_BLOCK;
    let (mut fw, mut fs) = (vec![0u8; w.len()], vec![0u8; s.len()]);
    for r in 0..rows {
        for h in 0..HEADS_PER_GROUP {
            for c in 0..chunks {
                for j in 0..O_CHUNK {
                    let std_col = h * head_dim + c * O_CHUNK + j;
                    let fused_col = (c * HEADS_PER_GROUP + h) * O_CHUNK + j;
                    fw[r * k + fused_col] = w[r * k + std_col];
                }
                fs[r * sc + c * HEADS_PER_GROUP + h] = s[r * sc + h * chunks + c];
            }
        }
    }
    (fw, fs)
}

/// Spec section 7, F8_128x4 swizzle of a row-major `[m, c]` scale: a zero-filled buffer of
/// `128*ceil(m/128) * 4*ceil(c/4)` bytes with byte `(i, j)` at
/// `((i/128)*ceil(c/4) + j/4)*512 + (i%32)*16 + ((i%128)/32)*4 + j%4`.
fn swizzle_128x4(s: &[u8], m: usize, c: usize) -> Vec<u8> {
    let col_tiles = c.div_ceil(4);
    let mut out = vec![0u8; 128 * m.div_ceil(128) * 4 * col_tiles];
    for i in 0..m {
        for j in 0..c {
            out[((i / 128) * col_tiles + j / 4) * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4 + j % 4] = s[i * c + j];
        }
    }
    out
}

/// Spec section 7, DeepGEMM packed UE8M0 (MN-major) of the fused per-row scale
/// `[groups*rows, c]`: `out[((g*(c/4) + k4)*rows + r)*4 + b] = scale[g*rows + r][k4*4 + b]`.
fn pack_ue8m0(s: &[u8], groups: usize, rows: usize, c: usize) -> Vec<u8> {
    let k4s = c / 4;
    let mut out = vec![0u8; groups * rows * c];
    for g in 0..groups {
        for r in 0..rows {
            for k4 in 0..k4s {
                for b in 0..4 {
                    out[((g * k4s + k4) * rows + r) * 4 + b] = s[(g * rows + r) * c + k4 * 4 + b];
                }
            }
        }
    }
    out
}

fn tensor_spec(name: String, layer: usize, param: Param, part: Part, dtype: Dtype, shape: Vec<usize>) -> TensorSpec {
    TensorSpec { name, layer, param, part, dtype, shape }
}

/// Reads rows x columns of a tensor and checks that exactly that many elements came back.
fn read_exact(
    source: &LoadSource,
    spec: &TensorSpec,
    rows: Range<usize>,
    cols: Range<usize>,
    element_bytes: usize,
) -> Result<(Vec<u8>, Option<PathBuf>), LoadError> {
    let want = rows.len() * cols.len() * element_bytes;
    let mut out = Vec::new();
    let file = source.read(spec, rows, cols, &mut out)?;
    if out.len() != want {
        return Err(tensor_error(&spec.name, file, KernelError::Shape(format!("read {} bytes, expected {want}", out.len()))));
    }
    Ok((out, file))
}

fn tensor_error(tensor: &str, file: Option<PathBuf>, source: KernelError) -> LoadError {
    LoadError::Tensor { tensor: tensor.to_string(), file, source }
}
