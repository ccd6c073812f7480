//! Deliberate layout faults, for showing that the checks catch them: each reproduces a way the
//! reference PR's bug class corrupts what a kernel reads. They edit kernel-visible bytes
//! directly (host buffers), bypassing the typed pipeline on purpose.

use orchestrator_kernels::layout::{pack_ue8m0_mn_major, swizzle_128x4, unpack_ue8m0_mn_major, unswizzle_128x4};
use orchestrator_kernels::params::{KernelTensor, OPermutation, QPermutation, ScaleLayout};
use orchestrator_kernels::permutation::{Permutation, gather_runs};
use orchestrator_kernels::{Backend, CpuBackend, KernelError};

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
    let (heads, head_dim) = (weights.shard.n_local_heads, weights.identity.geometry.head_dim);
    for layer in &mut weights.layers {
        inject_layer(&mut layer.wq_b, &mut layer.wo_a, heads, head_dim, fault)?;
    }
    Ok(())
}

/// [`inject`] on any backend: each layer's `wq_b` and `wo_a` are copied to the host, edited
/// there, and written back (a GPU worker reproduces the same faults).
pub fn inject_on<B: Backend>(backend: &B, weights: &mut RankWeights<B>, fault: Fault) -> Result<(), KernelError> {
    let (heads, head_dim) = (weights.shard.n_local_heads, weights.identity.geometry.head_dim);
    let to_host = |t: &KernelTensor<B>| -> Result<KernelTensor<CpuBackend>, KernelError> {
        let (mut weight, mut scale) = (Vec::new(), Vec::new());
        backend.download(&t.weight, &mut weight)?;
        backend.download(&t.scale, &mut scale)?;
        Ok(KernelTensor { weight, weight_shape: t.weight_shape.clone(), scale, scale_layout: t.scale_layout })
    };
    for layer in &mut weights.layers {
        let (mut wq_b, mut wo_a) = (to_host(&layer.wq_b)?, to_host(&layer.wo_a)?);
        inject_layer(&mut wq_b, &mut wo_a, heads, head_dim, fault)?;
        for (dst, src) in [(&mut layer.wq_b, &wq_b), (&mut layer.wo_a, &wo_a)] {
            backend.upload(&src.weight, &mut dst.weight)?;
            backend.upload(&src.scale, &mut dst.scale)?;
        }
    }
    Ok(())
}

fn inject_layer(
    wq_b: &mut KernelTensor<CpuBackend>,
    wo_a: &mut KernelTensor<CpuBackend>,
    heads: usize,
    head_dim: usize,
    fault: Fault,
) -> Result<(), KernelError> {
    let q = QPermutation::new(heads, head_dim)?;
    let o = OPermutation::new(head_dim)?;
    match fault {
        Fault::SkipQPermutation => permute_linear_rows(wq_b, &q.rows().inverse())?,
        Fault::DoubleQPermutation => permute_linear_rows(wq_b, q.rows())?,
        Fault::SkipOScaleChunkPermutation => unpermute_packed_scale_chunks(wo_a, o.chunks())?,
        Fault::StaleReload => {
            permute_linear_rows(wq_b, &q.rows().inverse())?;
            unpermute_packed_scale_chunks(wo_a, o.chunks())?;
            let k = *wo_a.weight_shape.last().unwrap_or(&0);
            let mut w = Vec::new();
            gather_runs(&wo_a.weight, k, 32, &o.chunks().inverse(), &mut w)?;
            wo_a.weight = w;
        }
        Fault::SwapHeads(a, b) => {
            // In the fused layout, head h's dim d sits at row (d/16)*(H*16) + h*16 + d%16.
            let mut map: Vec<u32> = (0..(heads * head_dim) as u32).collect();
            for d in 0..head_dim {
                let row = |h: usize| (d / 16) * (heads * 16) + h * 16 + d % 16;
                map.swap(row(a), row(b));
            }
            permute_linear_rows(wq_b, &Permutation::from_map(map)?)?;
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
