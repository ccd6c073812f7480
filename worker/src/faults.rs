//! Deliberate layout faults, for showing that the checks catch them: each reproduces a way the
//! reference PR's bug class corrupts what a kernel reads. They edit kernel-visible bytes
//! directly (host buffers), bypassing the typed pipeline on purpose.

use orchestrator_kernels::layout::{pack_ue8m0_mn_major, swizzle_128x4, unpack_ue8m0_mn_major, unswizzle_128x4};
use orchestrator_kernels::params::{KernelTensor, OPermutation, QPermutation, ScaleLayout};
use orchestrator_kernels::permutation::{Permutation, gather_runs};
use orchestrator_kernels::{CpuBackend, KernelError};

use crate::loader::RankWeights;

/// A fault to inject into a loaded rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `wq_b` (weight and scale) left in checkpoint order under the kernel hook: the
    /// permutation was skipped (a stale reload, or a hook that ran first).
    SkipQPermutation,
    /// The Q permutation applied twice.
    DoubleQPermutation,
    /// `wo_a`'s weight permuted but its scales' 32-column chunks left in checkpoint order.
    SkipOScaleChunkPermutation,
    /// Two heads' `wq_b` rows swapped.
    SwapHeads(usize, usize),
    /// A reload wrote checkpoint-order `wq_b` and `wo_a` (weights and scales) under the kernel
    /// hooks: the vLLM reload bug that collapsed accuracy without an error.
    StaleReload,
}

impl std::str::FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "skip-permute" => Ok(Fault::SkipQPermutation),
            "double-permute" => Ok(Fault::DoubleQPermutation),
            "skip-o-scale-permute" => Ok(Fault::SkipOScaleChunkPermutation),
            "stale-reload" => Ok(Fault::StaleReload),
            other => Err(format!("unknown fault `{other}` (expected skip-permute, double-permute, skip-o-scale-permute or stale-reload)")),
        }
    }
}

/// Applies `fault` to every layer of a rank.
pub fn inject(weights: &mut RankWeights<CpuBackend>, fault: Fault) -> Result<(), KernelError> {
    let heads = weights.shard.n_local_heads;
    let head_dim = weights.identity.geometry.head_dim;
    let q = QPermutation::new(heads, head_dim)?;
    let o = OPermutation::new(head_dim)?;
    for layer in &mut weights.layers {
        match fault {
            Fault::SkipQPermutation => permute_linear_rows(&mut layer.wq_b, &q.rows().inverse())?,
            Fault::DoubleQPermutation => permute_linear_rows(&mut layer.wq_b, q.rows())?,
            Fault::SkipOScaleChunkPermutation => unpermute_packed_scale_chunks(&mut layer.wo_a, o.chunks())?,
            Fault::StaleReload => {
                permute_linear_rows(&mut layer.wq_b, &q.rows().inverse())?;
                unpermute_packed_scale_chunks(&mut layer.wo_a, o.chunks())?;
                let k = *layer.wo_a.weight_shape.last().unwrap_or(&0);
                let mut w = Vec::new();
                gather_runs(&layer.wo_a.weight, k, 32, &o.chunks().inverse(), &mut w)?;
                layer.wo_a.weight = w;
            }
            Fault::SwapHeads(a, b) => {
                // In the fused layout, head h's dim d sits at row (d/16)*(H*16) + h*16 + d%16.
                let mut map: Vec<u32> = (0..(heads * head_dim) as u32).collect();
                for d in 0..head_dim {
                    let row = |h: usize| (d / 16) * (heads * 16) + h * 16 + d % 16;
                    map.swap(row(a), row(b));
                }
                permute_linear_rows(&mut layer.wq_b, &Permutation::from_map(map)?)?;
            }
        }
    }
    Ok(())
}

/// Gathers the rows of a swizzled linear weight and its scale by `perm`.
fn permute_linear_rows(t: &mut KernelTensor<CpuBackend>, perm: &Permutation) -> Result<(), KernelError> {
    let ScaleLayout::Swizzled128x4 { rows, cols } = t.scale_layout else {
        return Err(KernelError::Layout("expected a swizzled linear weight".into()));
    };
    let k = t.weight.len() / rows.max(1);
    let mut w = Vec::new();
    gather_runs(&t.weight, rows * k, k, perm, &mut w)?;
    t.weight = w;
    let (mut plain, mut moved) = (Vec::new(), Vec::new());
    unswizzle_128x4(&t.scale, rows, cols, &mut plain)?;
    gather_runs(&plain, rows * cols, cols, perm, &mut moved)?;
    swizzle_128x4(&moved, rows, cols, &mut t.scale)
}

/// Undoes the chunk permutation of a packed `wo_a` scale (the weight keeps its permutation).
fn unpermute_packed_scale_chunks(t: &mut KernelTensor<CpuBackend>, chunks: &Permutation) -> Result<(), KernelError> {
    let ScaleLayout::PackedUe8m0 { groups, rows, cols } = t.scale_layout else {
        return Err(KernelError::Layout("expected a packed wo_a scale".into()));
    };
    let (mut plain, mut moved) = (Vec::new(), Vec::new());
    unpack_ue8m0_mn_major(&t.scale, groups, rows, cols, &mut plain)?;
    gather_runs(&plain, cols, 1, &chunks.inverse(), &mut moved)?;
    pack_ue8m0_mn_major(&moved, groups, rows, cols, &mut t.scale)
}
