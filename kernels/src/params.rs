//! The load pipeline of one attention parameter, with the layout state in the types.
//!
//! `Mx<B, P, S>` is an MXFP8 matrix `[rows, k]` with one UE8M0 scale per row and 32-column
//! block (`[rows, k/32]`), for parameter `P`, in layout state `S`:
//!
//! ```text
//! source --from_source--> Mx<P, CheckpointOrder> --permute--> Mx<P, Fused> --into_kernel--> kernel layout
//!          (expand 32x32 scales or quantize BF16)   (wq_b, wo_a only)        (swizzle / pack hooks)
//! ```
//!
//! Only checkpoint-order data can be permuted, and only permuted data reaches the `wq_b` and
//! `wo_a` kernel hooks, so the reference PR's failures (hooks before the permutation, a second
//! permutation, a reload that skips it) do not compile. The one legal order:
//!
//! ```
//! # use orchestrator_kernels::params::*;
//! # use orchestrator_kernels::backend::CpuBackend;
//! # fn f(m: Mx<CpuBackend, WqB, CheckpointOrder>, q: &QPermutation, pool: &mut orchestrator_kernels::BufferPool<CpuBackend>) -> Result<(), orchestrator_kernels::KernelError> {
//! let kernel = m.permute(&CpuBackend, q, pool)?.into_kernel(&CpuBackend, pool)?;
//! # Ok(()) }
//! ```
//!
//! and the ones that are refused:
//!
//! ```compile_fail
//! # use orchestrator_kernels::params::*;
//! # use orchestrator_kernels::backend::CpuBackend;
//! # fn f(m: Mx<CpuBackend, WqB, Fused>, q: &QPermutation, pool: &mut orchestrator_kernels::BufferPool<CpuBackend>) {
//! let twice = m.permute(&CpuBackend, q, pool); // a fused tensor cannot be permuted again
//! # }
//! ```
//!
//! ```compile_fail
//! # use orchestrator_kernels::params::*;
//! # use orchestrator_kernels::backend::CpuBackend;
//! # fn f(m: Mx<CpuBackend, WqB, CheckpointOrder>, pool: &mut orchestrator_kernels::BufferPool<CpuBackend>) {
//! let k = m.into_kernel(&CpuBackend, pool); // the hook needs the fused layout
//! # }
//! ```
//!
//! ```compile_fail
//! # use orchestrator_kernels::params::*;
//! # use orchestrator_kernels::backend::CpuBackend;
//! # fn f(m: Mx<CpuBackend, WoA, CheckpointOrder>, pool: &mut orchestrator_kernels::BufferPool<CpuBackend>) {
//! let k = m.into_kernel(&CpuBackend, 8, pool); // wo_a's BMM hook needs the fused layout too
//! # }
//! ```
//!
//! Permutations are built from geometry alone ([`QPermutation::new`] from local heads and
//! head_dim, [`OPermutation::new`] from head_dim), never from a tensor's current shape; a
//! permutation whose size disagrees with the tensor is an error, not a guess.

use std::marker::PhantomData;

use crate::backend::{Backend, BufferPool};
use crate::digest::Digest;
use crate::mxfp8::{BLOCK, ScaleRule};
use crate::permutation::{BlockOrder, O_CHUNK, Permutation};
use crate::{KernelError, e4m3, e8m0, layout};

/// Layout state: rows and columns in checkpoint order (scales already one per row).
pub struct CheckpointOrder;
/// Layout state: permuted into the mega-attention chunk-interleaved layout.
pub struct Fused;

/// `wq_b`: Q up-projection, rows permuted by heads and 16-dim chunks.
pub struct WqB;
/// `wo_a`: grouped O low-rank projection, columns permuted in 32-dim chunks.
pub struct WoA;
/// `wo_b`: O output projection, never permuted.
pub struct WoB;

/// Host bytes of a source tensor: borrowed (straight from a memory-mapped shard, say) or a
/// staging buffer the backend may take over (its contents are unspecified afterwards; the
/// host backend swaps allocations instead of copying).
#[derive(Debug)]
pub enum HostBytes<'a> {
    Borrowed(&'a [u8]),
    Staged(&'a mut Vec<u8>),
}

impl HostBytes<'_> {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            HostBytes::Borrowed(b) => b,
            HostBytes::Staged(v) => v,
        }
    }

    fn upload<B: Backend>(self, backend: &B, dst: &mut B::Buffer) -> Result<(), KernelError> {
        match self {
            HostBytes::Borrowed(b) => backend.upload(b, dst),
            HostBytes::Staged(v) => backend.upload_staged(v, dst),
        }
    }
}

/// Where a parameter's checkpoint-order bytes come from (host memory, row-major).
#[derive(Debug)]
pub enum WeightSource<'a> {
    /// E4M3 weight `[rows, k]` and its UE8M0 block scale `[rows/block[0], k/block[1]]`.
    Fp8 { weight: HostBytes<'a>, block_scale: &'a [u8], block: [usize; 2] },
    /// BF16 weight `[rows, k]`, little-endian, quantized to MXFP8 on load.
    Bf16 { weight: HostBytes<'a> },
}

/// Digests of the source bytes as stored (spec section 9's source digest), computed by the
/// source stage while it validates them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceDigests {
    pub weight: Digest,
    /// FP8 only: the block scale.
    pub block_scale: Option<Digest>,
    /// BF16 quantized into place on the host: the MXFP8 it gave, in checkpoint order.
    pub quantized: Option<crate::placement::QuantizedDigests>,
    /// The digest of the weight bytes as the source stage placed them (fused order), when it
    /// came for free on the way. The kernel hooks never change weight bytes, so this is the
    /// kernel weight's digest when the matrix goes straight to its hook.
    pub placed_weight: Option<Digest>,
}

/// The Q row permutation of one rank's `wq_b` shard.
#[derive(Clone, Debug)]
pub struct QPermutation {
    rows: Permutation,
    inverse: Permutation,
}

impl QPermutation {
    /// From the module's geometry: the rank's local heads and head_dim.
    pub fn new(n_local_heads: usize, head_dim: usize) -> Result<Self, KernelError> {
        let rows = Permutation::q_rows(n_local_heads, head_dim)?;
        Ok(Self { inverse: rows.inverse(), rows })
    }
    pub fn rows(&self) -> &Permutation {
        &self.rows
    }
    /// `rows().inverse()`, made once.
    pub fn rows_inverse(&self) -> &Permutation {
        &self.inverse
    }
}

/// The O column permutation of `wo_a` (the same for every group and rank) and its 32-column
/// chunk permutation, which also permutes the per-32 scale columns.
#[derive(Clone, Debug)]
pub struct OPermutation {
    columns: Permutation,
    chunks: Permutation,
    chunks_inverse: Permutation,
}

impl OPermutation {
    /// From head_dim (8 heads per group is mega attention's fixed group size).
    pub fn new(head_dim: usize) -> Result<Self, KernelError> {
        let columns = Permutation::o_columns(head_dim)?;
        let chunks = columns.of_chunks(O_CHUNK)?;
        Ok(Self { chunks_inverse: chunks.inverse(), columns, chunks })
    }
    pub fn columns(&self) -> &Permutation {
        &self.columns
    }
    pub fn chunks(&self) -> &Permutation {
        &self.chunks
    }
    /// `chunks().inverse()`, made once.
    pub fn chunks_inverse(&self) -> &Permutation {
        &self.chunks_inverse
    }
}

/// An MXFP8 matrix `[rows, k]` with per-row scales `[rows, k/32]` for parameter `P` in layout
/// state `S`. Built only by [`Mx::from_source`] (checkpoint order) and moved forward only by
/// the pipeline's transitions.
pub struct Mx<B: Backend, P, S> {
    weight: B::Buffer,
    scale: B::Buffer,
    rows: usize,
    k: usize,
    _layout: PhantomData<(P, S)>,
}

impl<B: Backend, P, S> Mx<B, P, S> {
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn k(&self) -> usize {
        self.k
    }
    /// Scale columns per row (`k / 32`).
    pub fn scale_cols(&self) -> usize {
        self.k / BLOCK
    }
    /// Host copies of the E4M3 bytes and per-row scales.
    pub fn to_host(&self, backend: &B) -> Result<(Vec<u8>, Vec<u8>), KernelError> {
        let (mut w, mut s) = (Vec::new(), Vec::new());
        self.to_host_into(backend, &mut w, &mut s)?;
        Ok((w, s))
    }
    /// [`Mx::to_host`] into vectors that keep their capacity from a previous call.
    pub fn to_host_into(&self, backend: &B, weight: &mut Vec<u8>, scale: &mut Vec<u8>) -> Result<(), KernelError> {
        backend.download(&self.weight, weight)?;
        backend.download(&self.scale, scale)
    }
    /// Returns the buffers to a pool.
    pub fn recycle(self, pool: &mut BufferPool<B>) {
        pool.give(self.weight);
        pool.give(self.scale);
    }
}

/// The block scale `[rows/bm, k/bk]` that per-row scales `[rows, k/32]` were expanded from; an
/// error if any block's rows or columns disagree (then they did not come from block scales).
pub fn block_scales_of(scale: &[u8], rows: usize, k: usize, block: [usize; 2]) -> Result<Vec<u8>, KernelError> {
    let [bm, bk] = block;
    let c = k / BLOCK;
    let per = bk / BLOCK;
    if bm == 0 || per == 0 || !rows.is_multiple_of(bm) || !c.is_multiple_of(per) || scale.len() != rows * c {
        return Err(KernelError::Shape(format!("[{rows}, {k}] has no {bm}x{bk} blocks")));
    }
    let (brows, bcols) = (rows / bm, c / per);
    let mut out = Vec::with_capacity(brows * bcols);
    // Each block row's first scale row must repeat every block's value `per` times; every other
    // row of the block must equal that first row (a memcmp).
    for (b, block) in scale.chunks_exact(bm * c).enumerate() {
        let first = &block[..c];
        for (jb, run) in first.chunks_exact(per).enumerate() {
            if let Some(i) = run.iter().position(|&v| v != run[0]) {
                let (r, j) = (b * bm, jb * per + i);
                return Err(KernelError::Layout(format!(
                    "per-row scale ({r}, {j}) = {} differs from its {bm}x{bk} block's {}",
                    run[i], run[0]
                )));
            }
            out.push(run[0]);
        }
        for (i, row) in block.chunks_exact(c).enumerate().skip(1) {
            if row != first {
                let j = row.iter().zip(first).position(|(a, b)| a != b).unwrap_or(0);
                let r = b * bm + i;
                return Err(KernelError::Layout(format!(
                    "per-row scale ({r}, {j}) = {} differs from its {bm}x{bk} block's {}",
                    row[j], first[j]
                )));
            }
        }
    }
    Ok(out)
}

/// A kernel tensor read back in checkpoint order, for the round trip: the digest of its weight
/// bytes as the inverse hooks and inverse permutation lay them out (computed through the
/// inverse index map, without writing them: [`Backend::digest_gathered_runs`]), and its per-row
/// scales `[rows, k/32]` in checkpoint order (host bytes, a thirty-second of the weight, in a
/// buffer the caller keeps for the next view).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointOrderView<'a> {
    pub weight: Digest,
    pub scale: &'a [u8],
    pub rows: usize,
    pub k: usize,
}

impl CheckpointOrderView<'_> {
    pub fn scale_digest(&self) -> Digest {
        Digest::of(self.scale)
    }
    /// The block scale the per-row scales were expanded from (FP8 checkpoints).
    pub fn block_scales(&self, block: [usize; 2]) -> Result<Vec<u8>, KernelError> {
        block_scales_of(self.scale, self.rows, self.k, block)
    }
}

/// Builds a matrix in a given state; private, so only this module's transitions can.
fn mx<B: Backend, P, S>(weight: B::Buffer, scale: B::Buffer, rows: usize, k: usize) -> Mx<B, P, S> {
    Mx { weight, scale, rows, k, _layout: PhantomData }
}

fn check_source_shape(what: &str, got: usize, want: usize) -> Result<(), KernelError> {
    if got != want {
        return Err(KernelError::Shape(format!("{what} has {got} bytes, expected {want}")));
    }
    Ok(())
}

impl<B: Backend, P> Mx<B, P, CheckpointOrder> {
    /// Reads checkpoint-order bytes into backend buffers from `pool`: an FP8 source has its
    /// block scales expanded to one per row; a BF16 source is MXFP8-quantized with `rule`.
    /// NaN scale bytes, NaN E4M3 bytes and non-finite BF16 values are errors with a position.
    pub fn from_source(
        backend: &B,
        source: WeightSource<'_>,
        rows: usize,
        k: usize,
        rule: ScaleRule,
        pool: &mut BufferPool<B>,
    ) -> Result<(Self, SourceDigests), KernelError> {
        let (w, s, d) = load_source(backend, source, rows, k, rule, BlockOrder::Identity, pool)?;
        Ok((mx(w, s, rows, k), d))
    }
}

impl<B: Backend> Mx<B, WqB, CheckpointOrder> {
    /// Gathers rows (weight and scale alike) into the fused Q layout.
    pub fn permute(self, backend: &B, q: &QPermutation, pool: &mut BufferPool<B>) -> Result<Mx<B, WqB, Fused>, KernelError> {
        let (w, s, rows, k) = gather_rows(backend, self.weight, self.scale, self.rows, self.k, q.rows(), pool)?;
        Ok(mx(w, s, rows, k))
    }
}

impl<B: Backend> Mx<B, WqB, Fused> {
    /// Reads a source straight into the fused Q layout: FP8 rows are gathered by the Q
    /// permutation on the way in, BF16 rows are quantized into their fused positions, so the
    /// checkpoint-order matrix is never materialized. Bit for bit the same as
    /// `Mx::from_source(..)?.permute(..)` (tested).
    pub fn from_source_permuted(
        backend: &B,
        source: WeightSource<'_>,
        rows: usize,
        k: usize,
        rule: ScaleRule,
        q: &QPermutation,
        pool: &mut BufferPool<B>,
    ) -> Result<(Self, SourceDigests), KernelError> {
        if q.rows().len() != rows {
            return Err(KernelError::Shape(format!("the Q permutation covers {} rows but the shard has {rows}", q.rows().len())));
        }
        let (w, s, d) = load_source(backend, source, rows, k, rule, BlockOrder::Rows(q.rows()), pool)?;
        Ok((mx(w, s, rows, k), d))
    }

    /// The CuteDSL MXFP8 linear hook: weight bytes stay `[N, K]` row-major (read as a `[K, N]`
    /// column-major view); the per-row scale is F8_128x4-swizzled.
    pub fn into_kernel(self, backend: &B, pool: &mut BufferPool<B>) -> Result<KernelTensor<B>, KernelError> {
        linear_hook(backend, self.weight, self.scale, self.rows, self.k, pool)
    }
}

impl<B: Backend> Mx<B, WoA, CheckpointOrder> {
    /// Gathers 32-column chunks of every row into the fused O layout, and the per-32 scale
    /// columns by the same chunk permutation.
    pub fn permute(self, backend: &B, o: &OPermutation, pool: &mut BufferPool<B>) -> Result<Mx<B, WoA, Fused>, KernelError> {
        let (w, s, rows, k) = gather_columns(backend, self.weight, self.scale, self.rows, self.k, o.chunks(), pool)?;
        Ok(mx(w, s, rows, k))
    }
}

impl<B: Backend> Mx<B, WoA, Fused> {
    /// Reads a source straight into the fused O layout (32-column chunks gathered, or
    /// quantized, into place). Bit for bit the same as `Mx::from_source(..)?.permute(..)`
    /// (tested).
    pub fn from_source_permuted(
        backend: &B,
        source: WeightSource<'_>,
        rows: usize,
        k: usize,
        rule: ScaleRule,
        o: &OPermutation,
        pool: &mut BufferPool<B>,
    ) -> Result<(Self, SourceDigests), KernelError> {
        if o.chunks().len() * O_CHUNK != k {
            return Err(KernelError::Shape(format!("the O permutation covers {} columns but wo_a has {k}", o.chunks().len() * O_CHUNK)));
        }
        let (w, s, d) = load_source(backend, source, rows, k, rule, BlockOrder::Chunks(o.chunks()), pool)?;
        Ok((mx(w, s, rows, k), d))
    }

    /// The `wo_a` BMM hook: weight viewed `[groups, rows/groups, k]`, scales packed as
    /// DeepGEMM MN-major UE8M0 int32 `[groups, k/128, rows/groups]` (storage order).
    pub fn into_kernel(self, backend: &B, groups: usize, pool: &mut BufferPool<B>) -> Result<KernelTensor<B>, KernelError> {
        if groups == 0 || !self.rows.is_multiple_of(groups) {
            return Err(KernelError::Shape(format!("{} wo_a rows do not split into {groups} groups", self.rows)));
        }
        let per_group = self.rows / groups;
        let c = self.scale_cols();
        let mut packed = pool.take(backend, self.rows * c);
        if let Err(e) = backend.pack_ue8m0(&self.scale, groups, per_group, c, &mut packed) {
            pool.give(packed);
            self.recycle(pool);
            return Err(e);
        }
        pool.give(self.scale);
        Ok(KernelTensor {
            weight: self.weight,
            weight_shape: vec![groups, per_group, self.k],
            scale: packed,
            scale_layout: ScaleLayout::PackedUe8m0 { groups, rows: per_group, cols: c },
        })
    }
}

impl<B: Backend> Mx<B, WoB, CheckpointOrder> {
    /// `wo_b` is not permuted: the same linear hook as `wq_b`, on checkpoint order.
    pub fn into_kernel(self, backend: &B, pool: &mut BufferPool<B>) -> Result<KernelTensor<B>, KernelError> {
        linear_hook(backend, self.weight, self.scale, self.rows, self.k, pool)
    }
}

/// The source stage of the pipeline: validate, upload (gathering if asked), expand or
/// quantize. Returns the weight and per-row scale buffers.
fn load_source<B: Backend>(
    backend: &B,
    source: WeightSource<'_>,
    rows: usize,
    k: usize,
    rule: ScaleRule,
    order: BlockOrder<'_>,
    pool: &mut BufferPool<B>,
) -> Result<(B::Buffer, B::Buffer, SourceDigests), KernelError> {
    if !k.is_multiple_of(BLOCK) {
        return Err(KernelError::Shape(format!("K = {k} is not a multiple of {BLOCK}")));
    }
    let c = k / BLOCK;
    match source {
        WeightSource::Fp8 { weight: w, block_scale, block } => {
            check_source_shape("E4M3 weight", w.as_slice().len(), rows * k)?;
            if let Some(at) = e8m0::find_nan(block_scale) {
                let cols = (k / block[1].max(1)).max(1);
                return Err(KernelError::NanScale { row: at / cols, col: at % cols });
            }
            let block_scale_digest = Some(Digest::of(block_scale));
            let mut weight = pool.take(backend, rows * k);
            let mut scale = pool.take(backend, rows * c);
            let mut staged = pool.take(backend, block_scale.len());
            let mut per_row = pool.take(backend, rows * c);
            let r = (|| {
                // Validated (no NaN E4M3), digested as stored, and placed in `order`, in as few
                // passes as the backend manages; a staged host copy in checkpoint order is moved,
                // not copied.
                let digests = match (order, w) {
                    (BlockOrder::Identity, host @ HostBytes::Staged(_)) => {
                        let d = e4m3::digest_nan_free(host.as_slice()).map_err(|at| KernelError::NonFinite { row: at / k, col: at % k })?;
                        host.upload(backend, &mut weight)?;
                        SourceDigests { weight: d, block_scale: block_scale_digest, quantized: None, placed_weight: Some(d) }
                    }
                    (order, w) => {
                        let (d, placed) = backend.upload_e4m3(w.as_slice(), rows, k, order, &mut weight)?;
                        SourceDigests { weight: d, block_scale: block_scale_digest, quantized: None, placed_weight: placed }
                    }
                };
                backend.upload(block_scale, &mut staged)?;
                match order {
                    BlockOrder::Identity => backend.expand_block_scales(&staged, rows, k, block, &mut scale),
                    BlockOrder::Rows(p) => {
                        backend.expand_block_scales(&staged, rows, k, block, &mut per_row)?;
                        backend.gather_runs(&per_row, rows * c, c, p, &mut scale)
                    }
                    BlockOrder::Chunks(p) => {
                        backend.expand_block_scales(&staged, rows, k, block, &mut per_row)?;
                        backend.gather_runs(&per_row, c, 1, p, &mut scale)
                    }
                }
                .map(|()| digests)
            })();
            pool.give(staged);
            pool.give(per_row);
            match r {
                Ok(digests) => Ok((weight, scale, digests)),
                Err(e) => {
                    pool.give(weight);
                    pool.give(scale);
                    Err(e)
                }
            }
        }
        WeightSource::Bf16 { weight: w } => {
            check_source_shape("BF16 weight", w.as_slice().len(), rows * k * 2)?;
            let mut weight = pool.take(backend, rows * k);
            let mut scale = pool.take(backend, rows * c);
            match backend.quantize_bf16_host(w.as_slice(), rows, k, rule, order, &mut weight, &mut scale) {
                Ok(Some(placed)) => Ok((
                    weight,
                    scale,
                    SourceDigests {
                        weight: placed.source,
                        block_scale: None,
                        quantized: placed.quantized,
                        placed_weight: Some(placed.placed),
                    },
                )),
                Ok(None) => Ok((
                    weight,
                    scale,
                    SourceDigests { weight: Digest::of(w.as_slice()), block_scale: None, quantized: None, placed_weight: None },
                )),
                Err(e) => {
                    pool.give(weight);
                    pool.give(scale);
                    Err(e)
                }
            }
        }
    }
}

fn gather_rows<B: Backend>(
    backend: &B,
    weight: B::Buffer,
    scale: B::Buffer,
    rows: usize,
    k: usize,
    perm: &Permutation,
    pool: &mut BufferPool<B>,
) -> Result<(B::Buffer, B::Buffer, usize, usize), KernelError> {
    if perm.len() != rows {
        pool.give(weight);
        pool.give(scale);
        return Err(KernelError::Shape(format!("the Q permutation covers {} rows but the shard has {rows}", perm.len())));
    }
    let c = k / BLOCK;
    permute_pair(
        backend,
        weight,
        scale,
        pool,
        |src, dst| backend.gather_runs(src, rows * k, k, perm, dst),
        |src, dst| backend.gather_runs(src, rows * c, c, perm, dst),
    )
    .map(|(w, s)| (w, s, rows, k))
}

fn gather_columns<B: Backend>(
    backend: &B,
    weight: B::Buffer,
    scale: B::Buffer,
    rows: usize,
    k: usize,
    chunks: &Permutation,
    pool: &mut BufferPool<B>,
) -> Result<(B::Buffer, B::Buffer, usize, usize), KernelError> {
    if chunks.len() * O_CHUNK != k {
        pool.give(weight);
        pool.give(scale);
        return Err(KernelError::Shape(format!("the O permutation covers {} columns but wo_a has {k}", chunks.len() * O_CHUNK)));
    }
    let c = k / BLOCK;
    permute_pair(
        backend,
        weight,
        scale,
        pool,
        |src, dst| backend.gather_runs(src, k, O_CHUNK, chunks, dst),
        |src, dst| backend.gather_runs(src, c, 1, chunks, dst),
    )
    .map(|(w, s)| (w, s, rows, k))
}

/// Applies two gathers into fresh pool buffers, returning the sources to the pool.
fn permute_pair<B: Backend>(
    backend: &B,
    weight: B::Buffer,
    scale: B::Buffer,
    pool: &mut BufferPool<B>,
    gather_weight: impl FnOnce(&B::Buffer, &mut B::Buffer) -> Result<(), KernelError>,
    gather_scale: impl FnOnce(&B::Buffer, &mut B::Buffer) -> Result<(), KernelError>,
) -> Result<(B::Buffer, B::Buffer), KernelError> {
    let mut w = pool.take(backend, backend.len(&weight));
    let mut s = pool.take(backend, backend.len(&scale));
    let r = gather_weight(&weight, &mut w).and_then(|()| gather_scale(&scale, &mut s));
    pool.give(weight);
    pool.give(scale);
    match r {
        Ok(()) => Ok((w, s)),
        Err(e) => {
            pool.give(w);
            pool.give(s);
            Err(e)
        }
    }
}

fn linear_hook<B: Backend>(
    backend: &B,
    weight: B::Buffer,
    scale: B::Buffer,
    rows: usize,
    k: usize,
    pool: &mut BufferPool<B>,
) -> Result<KernelTensor<B>, KernelError> {
    let c = k / BLOCK;
    let mut swizzled = pool.take(backend, layout::swizzled_len(rows, c));
    if let Err(e) = backend.swizzle_128x4(&scale, rows, c, &mut swizzled) {
        pool.give(swizzled);
        pool.give(weight);
        pool.give(scale);
        return Err(e);
    }
    pool.give(scale);
    Ok(KernelTensor { weight, weight_shape: vec![rows, k], scale: swizzled, scale_layout: ScaleLayout::Swizzled128x4 { rows, cols: c } })
}

/// How a kernel-visible scale is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleLayout {
    /// F8_128x4 swizzle of an `[rows, cols]` per-row scale; stored as 1-D UE8M0 bytes.
    Swizzled128x4 { rows: usize, cols: usize },
    /// DeepGEMM MN-major packed UE8M0 of `[groups*rows, cols]`: int32 `[groups, cols/4, rows]`
    /// in storage order.
    PackedUe8m0 { groups: usize, rows: usize, cols: usize },
}

impl ScaleLayout {
    /// Safetensors dtype name and shape of the stored scale.
    pub fn dtype_and_shape(&self) -> (&'static str, Vec<usize>) {
        match *self {
            ScaleLayout::Swizzled128x4 { rows, cols } => ("F8_E8M0", vec![layout::swizzled_len(rows, cols)]),
            ScaleLayout::PackedUe8m0 { groups, rows, cols } => ("I32", vec![groups, cols / 4, rows]),
        }
    }
}

/// A parameter as its kernel reads it: E4M3 weight bytes (shape as the kernel views the
/// storage) and the hooked scale.
pub struct KernelTensor<B: Backend> {
    pub weight: B::Buffer,
    pub weight_shape: Vec<usize>,
    pub scale: B::Buffer,
    pub scale_layout: ScaleLayout,
}

impl<B: Backend> KernelTensor<B> {
    /// Returns the buffers to a pool (a reload then writes into them again).
    pub fn recycle(self, pool: &mut BufferPool<B>) {
        pool.give(self.weight);
        pool.give(self.scale);
    }

    fn rows_and_k(&self) -> (usize, usize) {
        let rows: usize = self.weight_shape[..self.weight_shape.len().saturating_sub(1)].iter().product();
        (rows, *self.weight_shape.last().unwrap_or(&0))
    }

    /// The per-row scale `[rows, k/32]` the hook consumed, into a pool buffer.
    fn scale_per_row(&self, backend: &B, pool: &mut BufferPool<B>) -> Result<B::Buffer, KernelError> {
        let (rows, k) = self.rows_and_k();
        let mut scale = pool.take(backend, rows * (k / BLOCK));
        let r = match self.scale_layout {
            ScaleLayout::Swizzled128x4 { rows, cols } => backend.unswizzle_128x4(&self.scale, rows, cols, &mut scale),
            ScaleLayout::PackedUe8m0 { groups, rows, cols } => backend.unpack_ue8m0(&self.scale, groups, rows, cols, &mut scale),
        };
        match r {
            Ok(()) => Ok(scale),
            Err(e) => {
                pool.give(scale);
                Err(e)
            }
        }
    }

    /// The scale in checkpoint order through `(row, run, inv)` (runs of `run` bytes in rows of `row`), on
    /// the host in `host`, and the weight's digest through its own inverse the same way (`None`: as
    /// stored). Scratch comes from `pool` and goes back to it.
    fn view_through<'h>(
        &self,
        backend: &B,
        pool: &mut BufferPool<B>,
        host: &'h mut Vec<u8>,
        weight: Option<(usize, usize, &Permutation)>,
        scale: Option<(usize, usize, &Permutation)>,
    ) -> Result<CheckpointOrderView<'h>, KernelError> {
        let (rows, k) = self.rows_and_k();
        let per_row = self.scale_per_row(backend, pool)?;
        let ordered = match scale {
            Some((row, run, inv)) => {
                let mut out = pool.take(backend, rows * (k / BLOCK));
                let r = backend.gather_runs(&per_row, row, run, inv, &mut out);
                pool.give(per_row);
                if let Err(e) = r {
                    pool.give(out);
                    return Err(e);
                }
                out
            }
            None => per_row,
        };
        let downloaded = backend.download(&ordered, host);
        pool.give(ordered);
        downloaded?;
        let weight = match weight {
            Some((row, run, inv)) => backend.digest_gathered_runs(&self.weight, row, run, inv)?,
            None => backend.digest(&self.weight)?,
        };
        Ok(CheckpointOrderView { weight, scale: host, rows, k })
    }

    /// `wq_b` read back through the linear hook's inverse and the inverse Q row permutation.
    pub fn wq_b_in_checkpoint_order<'h>(
        &self,
        backend: &B,
        q: &QPermutation,
        pool: &mut BufferPool<B>,
        host: &'h mut Vec<u8>,
    ) -> Result<CheckpointOrderView<'h>, KernelError> {
        self.expect_layout(matches!(self.scale_layout, ScaleLayout::Swizzled128x4 { .. }), "wq_b")?;
        let (rows, k) = self.rows_and_k();
        let inv = q.rows_inverse();
        if inv.len() != rows {
            return Err(KernelError::Shape(format!("the Q permutation covers {} rows but the shard has {rows}", inv.len())));
        }
        let c = k / BLOCK;
        self.view_through(backend, pool, host, Some((rows * k, k, inv)), Some((rows * c, c, inv)))
    }

    /// `wo_a` read back through the BMM hook's inverse and the inverse O chunk permutation.
    pub fn wo_a_in_checkpoint_order<'h>(
        &self,
        backend: &B,
        o: &OPermutation,
        pool: &mut BufferPool<B>,
        host: &'h mut Vec<u8>,
    ) -> Result<CheckpointOrderView<'h>, KernelError> {
        self.expect_layout(matches!(self.scale_layout, ScaleLayout::PackedUe8m0 { .. }), "wo_a")?;
        let (_, k) = self.rows_and_k();
        let inv = o.chunks_inverse();
        if inv.len() * O_CHUNK != k {
            return Err(KernelError::Shape(format!("the O permutation covers {} columns but wo_a has {k}", inv.len() * O_CHUNK)));
        }
        let c = k / BLOCK;
        self.view_through(backend, pool, host, Some((k, O_CHUNK, inv)), Some((c, 1, inv)))
    }

    /// `wo_b` read back through the linear hook's inverse (it is never permuted).
    pub fn wo_b_in_checkpoint_order<'h>(
        &self,
        backend: &B,
        pool: &mut BufferPool<B>,
        host: &'h mut Vec<u8>,
    ) -> Result<CheckpointOrderView<'h>, KernelError> {
        self.expect_layout(matches!(self.scale_layout, ScaleLayout::Swizzled128x4 { .. }), "wo_b")?;
        self.view_through(backend, pool, host, None, None)
    }

    fn expect_layout(&self, ok: bool, what: &str) -> Result<(), KernelError> {
        if ok { Ok(()) } else { Err(KernelError::Layout(format!("{what} kernel tensor has scale layout {:?}", self.scale_layout))) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Recompressing expanded block scales gives the block scales back; changing any one
        /// per-row scale is an error naming that row and column.
        #[test]
        fn block_scales_invert_the_expansion(brows in 1usize..4, bcols in 1usize..4, bm_i in 0usize..3, bk_i in 0usize..3, seed: u8, at: usize) {
            let (bm, bk) = ([1usize, 32, 128][bm_i], [32usize, 64, 128][bk_i]);
            let (rows, k) = (brows * bm, bcols * bk);
            let blocks: Vec<u8> = (0..brows * bcols).map(|i| seed.wrapping_add(i as u8 * 3) % 250).collect();
            let mut per_row = Vec::new();
            crate::backend::expand_block_scales(&blocks, rows, k, [bm, bk], &mut per_row).unwrap();
            prop_assert_eq!(block_scales_of(&per_row, rows, k, [bm, bk]).unwrap(), blocks);
            let at = at % per_row.len();
            per_row[at] ^= 1;
            let (c, (r, j)) = (k / BLOCK, (at / (k / BLOCK), at % (k / BLOCK)));
            let e = block_scales_of(&per_row, rows, k, [bm, bk]);
            if bm == 1 && bk == BLOCK {
                prop_assert!(e.is_ok(), "every scale is its own block: {} columns", c); // nothing to disagree with
            } else {
                let msg = e.unwrap_err().to_string();
                let named = msg.contains(&format!("({r}, {j})"));
                // The first row and first column of a block define it: changing one of them shows
                // as a disagreement at another position of the same block.
                let defines = r % bm == 0 && j % (bk / BLOCK) == 0;
                prop_assert!(named || defines, "{}", msg);
            }
        }
    }

    #[test]
    fn block_scales_of_refuses_shapes_without_whole_blocks() {
        assert!(matches!(block_scales_of(&[0; 6], 3, 64, [2, 32]), Err(KernelError::Shape(_))));
        assert!(matches!(block_scales_of(&[0; 5], 2, 64, [2, 32]), Err(KernelError::Shape(_))));
    }
}
