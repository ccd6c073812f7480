//! The probe forward pass of one rank (spec section 8), run directly on the kernel-visible
//! tensors, and the same mathematics on checkpoint-order weights as the yardstick.
//!
//! 1. `q = qr @ wq_b^T` on the rank's heads (fused Q layout when the weight is fused);
//! 2. RoPE on the last 64 dims of each head (interleaved pairs, theta 10000), token `t` at
//!    position `t`;
//! 3. attention of every head over the shared latent `kv [S, 512]` (K = V, MQA), scale
//!    `head_dim^-0.5`, with the head's sink in the softmax denominator;
//! 4. inverse RoPE on the output's last 64 dims;
//! 5. per group, `o [T, 8*512]` (fused O layout when fused), MXFP8-quantized in 32-blocks,
//!    `z[t, g] = o[t, g] @ wo_a[g]^T`;
//! 6. `z [T, g*o_lora]` MXFP8-quantized, `y_partial = z @ wo_b_local^T` `[T, hidden]`.

use crate::KernelError;
use crate::attention::{Latents, attend_latents, rope};
use crate::gemm::{MxMatrix, WeightView, gemm};
use crate::mxfp8::ScaleRule;
use crate::permutation::{HEADS_PER_GROUP, Permutation, Q_CHUNK};
use rayon::prelude::*;

/// The rank-local dims of one probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeShape {
    pub heads: usize,
    pub groups: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora: usize,
    pub o_lora: usize,
    pub hidden: usize,
}

/// The probe's inputs: MXFP8 `qr [T, q_lora]` and the dequantized MXFP8 latent `kv [S, d]`.
#[derive(Clone, Debug)]
pub struct ProbeInputs {
    pub qr: MxMatrix,
    pub kv: Vec<f32>,
    pub latents: usize,
}

/// One layer's weights as the pass reads them.
pub struct LayerWeightsView<'a> {
    /// `[heads*head_dim, q_lora]`.
    pub wq_b: WeightView<'a>,
    /// One view per local group, each `[o_lora, 8*head_dim]`.
    pub wo_a: Vec<WeightView<'a>>,
    /// `[hidden, groups*o_lora]`.
    pub wo_b: WeightView<'a>,
    pub attn_sink: &'a [f32],
}

/// Which layouts a [`LayerWeightsView`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layouts {
    /// Kernel layouts: fused Q rows, fused O columns; the fast GEMM.
    Kernel,
    /// Checkpoint order; the plain reference GEMM.
    Reference,
}

/// What one layer's pass produced.
#[derive(Clone, Debug)]
pub struct ProbeOutput {
    /// `[T, heads*head_dim]`, in the weight's row order (fused or standard).
    pub q: Vec<f32>,
    /// `[T, groups*o_lora]`.
    pub z: Vec<f32>,
    /// `[T, hidden]`.
    pub y_partial: Vec<f32>,
}

/// Column of `q` holding head `h`, dim `d`.
#[inline]
pub fn q_column(layouts: Layouts, heads: usize, head_dim: usize, h: usize, d: usize) -> usize {
    match layouts {
        Layouts::Kernel => (d / Q_CHUNK) * (heads * Q_CHUNK) + h * Q_CHUNK + d % Q_CHUNK,
        Layouts::Reference => h * head_dim + d,
    }
}

/// Which GEMM of the pass [`forward_with`] asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerGemm {
    /// `qr @ wq_b^T`.
    WqB,
    /// `o[g] @ wo_a[g]^T` for local group `g`.
    WoA(usize),
    /// `z @ wo_b^T`.
    WoB,
}

/// Runs one layer.
pub fn forward(
    shape: &ProbeShape,
    inputs: &ProbeInputs,
    w: &LayerWeightsView<'_>,
    layouts: Layouts,
    rule: ScaleRule,
) -> Result<ProbeOutput, KernelError> {
    // Both layouts run the tiled GEMM (bit-identical to the plain triple loop, a unit test
    // says so): it sums every output in increasing k, which is what lets the fused q be
    // compared with the reference q bit for bit. A BLAS-style crate reorders that sum, so the
    // reference would then agree only within a tolerance. What keeps the reference independent
    // of the kernel layouts is its input: standard-order weights with row-major scales.
    forward_with(shape, inputs, w.attn_sink, w.wo_a.len(), layouts, rule, |which, a| match which {
        LayerGemm::WqB => gemm(a, &w.wq_b),
        LayerGemm::WoA(g) => gemm(a, &w.wo_a[g]),
        LayerGemm::WoB => gemm(a, &w.wo_b),
    })
}

/// Runs one layer with the GEMMs done by `gemm` (the weights may live anywhere, a GPU say); the
/// rest of the pass (RoPE, attention, activation quantization) is this module's host code, so
/// a `gemm` bit-identical to [`gemm`] gives an output bit-identical to [`forward`]'s.
pub fn forward_with(
    shape: &ProbeShape,
    inputs: &ProbeInputs,
    attn_sink: &[f32],
    wo_a_groups: usize,
    layouts: Layouts,
    rule: ScaleRule,
    gemm_fn: impl Fn(LayerGemm, &MxMatrix) -> Result<Vec<f32>, KernelError>,
) -> Result<ProbeOutput, KernelError> {
    let ProbeShape { heads, groups, head_dim, rope_dim, o_lora, hidden, .. } = *shape;
    if wo_a_groups != groups || heads != groups * HEADS_PER_GROUP || attn_sink.len() != heads {
        return Err(KernelError::Shape(format!(
            "probe shape {heads} heads / {groups} groups does not match {wo_a_groups} wo_a groups and {} sinks",
            attn_sink.len()
        )));
    }
    let t_rows = inputs.qr.rows;
    let n_q = heads * head_dim;
    let q = gemm_fn(LayerGemm::WqB, &inputs.qr)?;
    if q.len() != t_rows * n_q {
        return Err(KernelError::Shape(format!("q has {} values, expected [{t_rows}, {n_q}]", q.len())));
    }

    // Attention per (token, head) on the standard head view of q.
    let scale = (head_dim as f32).powf(-0.5);
    // Each (token, head) writes its own slice of `o`, so they run on all cores with the same bits.
    let mut o = vec![0f32; t_rows * n_q]; // standard layout [T, heads, head_dim]
    let latents = Latents::new(&inputs.kv, head_dim);
    o.par_chunks_mut(head_dim.max(1)).enumerate().for_each(|(i, out)| {
        let (t, h) = (i / heads, i % heads);
        let mut qh: Vec<f32> = (0..head_dim).map(|d| q[t * n_q + q_column(layouts, heads, head_dim, h, d)]).collect();
        rope(&mut qh[head_dim - rope_dim..], t, false);
        let mut oh = attend_latents(&qh, &latents, scale, attn_sink[h]);
        rope(&mut oh[head_dim - rope_dim..], t, true);
        out.copy_from_slice(&oh);
    });

    // wo_a per group, on O in the layout its weight expects.
    let group_cols = HEADS_PER_GROUP * head_dim;
    let o_perm = Permutation::o_columns(head_dim)?;
    let mut z = vec![0f32; t_rows * groups * o_lora];
    for g in 0..groups {
        let og: Vec<f32> = (0..t_rows)
            .flat_map(|t| {
                let row = &o[t * n_q + g * group_cols..t * n_q + (g + 1) * group_cols];
                match layouts {
                    Layouts::Kernel => o_perm.apply(row),
                    Layouts::Reference => row.to_vec(),
                }
            })
            .collect();
        let og = MxMatrix::quantize(&og, group_cols, rule)?;
        let zg = gemm_fn(LayerGemm::WoA(g), &og)?;
        if zg.len() != t_rows * o_lora {
            return Err(KernelError::Shape(format!("z of group {g} has {} values, expected [{t_rows}, {o_lora}]", zg.len())));
        }
        for t in 0..t_rows {
            z[t * groups * o_lora + g * o_lora..t * groups * o_lora + (g + 1) * o_lora].copy_from_slice(&zg[t * o_lora..(t + 1) * o_lora]);
        }
    }

    let zq = MxMatrix::quantize(&z, groups * o_lora, rule)?;
    let y_partial = gemm_fn(LayerGemm::WoB, &zq)?;
    if y_partial.len() != t_rows * hidden {
        return Err(KernelError::Shape(format!("y_partial has {} values, expected [{t_rows}, {hidden}]", y_partial.len())));
    }
    Ok(ProbeOutput { q, z, y_partial })
}

/// Largest absolute and relative differences of `got` from `want` (relative error counts only
/// where `|want|` exceeds `floor`), and whether every element is within
/// `atol + rtol * |want|`.
pub fn compare(got: &[f32], want: &[f32], rtol: f32, atol: f32) -> (f32, f32, bool) {
    let mut max_abs = 0f32;
    let mut max_rel = 0f32;
    let mut within = got.len() == want.len();
    for (&g, &w) in got.iter().zip(want) {
        let d = (g - w).abs();
        if d.is_nan() || d > atol + rtol * w.abs() {
            within = false;
        }
        max_abs = max_abs.max(if d.is_nan() { f32::INFINITY } else { d });
        if w.abs() > atol {
            max_rel = max_rel.max(d / w.abs());
        }
    }
    (max_abs, max_rel, within)
}
