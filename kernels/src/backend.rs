//! The compute seam. Every layout step of the load pipeline is a [`Backend`] operation on
//! backend-owned byte buffers, so the pipeline (and its callers) stay the same whether the
//! bytes live in host memory ([`CpuBackend`]) or on a GPU (a CUDA backend behind the `cuda`
//! feature). A backend value is not required to be `Send`: a GPU context and its NCCL
//! communicator are owned by one OS thread, and so is its backend.

use crate::digest::Digest;
use crate::gemm::{self, MxMatrix, ScaleView, WeightView};
use crate::mxfp8::{self, ScaleRule};
use crate::permutation::{self, BlockOrder, Permutation};
use crate::{KernelError, layout};

/// Operations the load pipeline needs, on buffers the backend owns.
pub trait Backend {
    /// A byte buffer in the backend's memory.
    type Buffer: Send;

    /// Short name for reports ("cpu", "cuda:0").
    fn name(&self) -> String;
    /// An empty buffer (no allocation).
    fn empty(&self) -> Self::Buffer;
    /// Bytes held.
    fn len(&self, buf: &Self::Buffer) -> usize;
    /// Bytes the buffer can hold without growing.
    fn capacity(&self, buf: &Self::Buffer) -> usize;
    /// An identity for the allocation behind the buffer (to show reuse across reloads).
    fn allocation_id(&self, buf: &Self::Buffer) -> usize;
    /// Copies host bytes into `dst`, reusing its allocation when large enough.
    fn upload(&self, host: &[u8], dst: &mut Self::Buffer) -> Result<(), KernelError>;
    /// Moves a host staging buffer's bytes into `dst`. `host` is left with unspecified
    /// contents (the host backend swaps allocations instead of copying). The default copies.
    fn upload_staged(&self, host: &mut Vec<u8>, dst: &mut Self::Buffer) -> Result<(), KernelError> {
        self.upload(host, dst)
    }
    /// MXFP8-quantizes host BF16 bytes into backend buffers, writing the blocks in `order`.
    /// Returns the digests of the BF16 bytes as stored and of the E4M3 bytes as placed when they
    /// came for free on the way (the host backend), else `None`. The default uploads, quantizes
    /// on the device, then gathers.
    #[allow(clippy::too_many_arguments)]
    fn quantize_bf16_host(
        &self,
        bf16: &[u8],
        rows: usize,
        k: usize,
        rule: ScaleRule,
        order: BlockOrder<'_>,
        elements: &mut Self::Buffer,
        scales: &mut Self::Buffer,
    ) -> Result<Option<crate::placement::Placed>, KernelError> {
        let (mut staged, mut e, mut s) = (self.empty(), self.empty(), self.empty());
        self.upload(bf16, &mut staged)?;
        let c = k / mxfp8::BLOCK;
        match order {
            BlockOrder::Identity => self.quantize_bf16_rows(&staged, rows, k, rule, elements, scales)?,
            BlockOrder::Rows(p) => {
                self.quantize_bf16_rows(&staged, rows, k, rule, &mut e, &mut s)?;
                self.gather_runs(&e, rows * k, k, p, elements)?;
                self.gather_runs(&s, rows * c, c, p, scales)?
            }
            BlockOrder::Chunks(p) => {
                self.quantize_bf16_rows(&staged, rows, k, rule, &mut e, &mut s)?;
                self.gather_runs(&e, k, mxfp8::BLOCK, p, elements)?;
                self.gather_runs(&s, c, 1, p, scales)?
            }
        }
        Ok(None)
    }
    /// Uploads host bytes while gathering runs (see [`permutation::gather_runs`]): the
    /// permutation applied on the way in. The default uploads, then gathers on the device.
    fn upload_gather_runs(
        &self,
        host: &[u8],
        row_bytes: usize,
        run_bytes: usize,
        perm: &Permutation,
        dst: &mut Self::Buffer,
    ) -> Result<(), KernelError> {
        let mut staged = self.empty();
        self.upload(host, &mut staged)?;
        self.gather_runs(&staged, row_bytes, run_bytes, perm, dst)
    }
    /// Validates FP8 E4M3 host bytes `[rows, k]` (a NaN is [`KernelError::NonFinite`] at its
    /// source position), digests them as stored, and uploads them in `order` (`Rows`: whole
    /// rows; `Chunks`: 32-byte blocks of each row). Returns the source digest and, when it came
    /// for free, the digest of the uploaded bytes. The default checks and digests in one pass,
    /// then uploads; the host backend does it all in one or two passes
    /// ([`crate::placement::place_e4m3`]).
    fn upload_e4m3(
        &self,
        host: &[u8],
        rows: usize,
        k: usize,
        order: BlockOrder<'_>,
        dst: &mut Self::Buffer,
    ) -> Result<(Digest, Option<Digest>), KernelError> {
        let k_checked = k.max(1);
        let source =
            crate::e4m3::digest_nan_free(host).map_err(|at| KernelError::NonFinite { row: at / k_checked, col: at % k_checked })?;
        match order {
            BlockOrder::Identity => {
                self.upload(host, dst)?;
                // The uploaded bytes are the stored bytes.
                Ok((source, Some(source)))
            }
            BlockOrder::Rows(p) => self.upload_gather_runs(host, rows * k, k, p, dst).map(|()| (source, None)),
            BlockOrder::Chunks(p) => self.upload_gather_runs(host, k, permutation::O_CHUNK, p, dst).map(|()| (source, None)),
        }
    }
    /// Copies the buffer's bytes to host memory.
    fn download(&self, src: &Self::Buffer, dst: &mut Vec<u8>) -> Result<(), KernelError>;
    /// The buffer's bytes on the host: borrowed where they already live there (CPU), copied
    /// otherwise.
    fn host_bytes<'a>(&self, buf: &'a Self::Buffer) -> Result<std::borrow::Cow<'a, [u8]>, KernelError> {
        let mut v = Vec::new();
        self.download(buf, &mut v)?;
        Ok(std::borrow::Cow::Owned(v))
    }
    /// Digest of the buffer's bytes in storage order (computed on host bytes, so every backend
    /// agrees with the CPU definition).
    fn digest(&self, buf: &Self::Buffer) -> Result<Digest, KernelError>;

    /// Expands a block scale `[rows/block_rows, k/block_k]` to one scale per row and 32-column
    /// block: `[rows, k/32]`.
    fn expand_block_scales(
        &self,
        block_scale: &Self::Buffer,
        rows: usize,
        k: usize,
        block: [usize; 2],
        dst: &mut Self::Buffer,
    ) -> Result<(), KernelError>;
    /// MXFP8-quantizes a row-major BF16 `[rows, k]` along K.
    fn quantize_bf16_rows(
        &self,
        bf16: &Self::Buffer,
        rows: usize,
        k: usize,
        rule: ScaleRule,
        elements: &mut Self::Buffer,
        scales: &mut Self::Buffer,
    ) -> Result<(), KernelError>;
    /// `dst[row][f] = src[row][perm[f]]` over runs of `run_bytes` (see [`permutation::gather_runs`]).
    fn gather_runs(
        &self,
        src: &Self::Buffer,
        row_bytes: usize,
        run_bytes: usize,
        perm: &Permutation,
        dst: &mut Self::Buffer,
    ) -> Result<(), KernelError>;
    /// The digest of what [`Backend::gather_runs`] would write, without a destination of the
    /// tensor's size. The default gathers into a scratch buffer, then digests.
    fn digest_gathered_runs(
        &self,
        src: &Self::Buffer,
        row_bytes: usize,
        run_bytes: usize,
        perm: &Permutation,
    ) -> Result<Digest, KernelError> {
        let mut dst = self.empty();
        self.gather_runs(src, row_bytes, run_bytes, perm, &mut dst)?;
        self.digest(&dst)
    }
    /// F8_128x4 swizzle of an `[m, c]` scale.
    fn swizzle_128x4(&self, src: &Self::Buffer, m: usize, c: usize, dst: &mut Self::Buffer) -> Result<(), KernelError>;
    /// Inverse of the swizzle.
    fn unswizzle_128x4(&self, src: &Self::Buffer, m: usize, c: usize, dst: &mut Self::Buffer) -> Result<(), KernelError>;
    /// DeepGEMM packed UE8M0, MN-major.
    fn pack_ue8m0(&self, src: &Self::Buffer, groups: usize, rows: usize, c: usize, dst: &mut Self::Buffer) -> Result<(), KernelError>;
    /// Inverse of the packing.
    fn unpack_ue8m0(&self, src: &Self::Buffer, groups: usize, rows: usize, c: usize, dst: &mut Self::Buffer) -> Result<(), KernelError>;

    /// The probe's MXFP8 GEMM `out[t, n] = sum_k a[t, k] * w[n, k]` on a weight held in backend
    /// buffers, read in its kernel layout ([`crate::gemm::gemm`]'s exact arithmetic). Returns
    /// `[T, n]` on the host. The default runs [`crate::gemm::gemm`] on the buffers' host bytes
    /// (borrowed on the CPU backend).
    fn mx_gemm(&self, a: &MxMatrix, w: &BackendWeight<'_, Self>) -> Result<Vec<f32>, KernelError>
    where
        Self: Sized,
    {
        let elements = self.host_bytes(w.elements)?;
        let scales = self.host_bytes(w.scales)?;
        let elements = elements
            .get(w.offset..w.offset + w.n * w.k)
            .ok_or_else(|| KernelError::Shape(format!("a [{}, {}] weight at byte {} of {} bytes", w.n, w.k, w.offset, elements.len())))?;
        let scales = match w.scales_layout {
            ScaleKind::RowMajor => ScaleView::RowMajor(&scales),
            ScaleKind::Swizzled128x4 => ScaleView::Swizzled128x4(&scales),
            ScaleKind::PackedUe8m0 { group, rows_per_group } => ScaleView::PackedUe8m0 { bytes: &scales, group, rows_per_group },
        };
        gemm::gemm(a, &WeightView { elements, n: w.n, k: w.k, scales })
    }
}

/// How a weight's per-row, per-32-column scales are stored (see [`crate::gemm::ScaleView`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleKind {
    /// Plain row-major `[N, K/32]`.
    RowMajor,
    /// F8_128x4 swizzle of `[N, K/32]`.
    Swizzled128x4,
    /// DeepGEMM packed UE8M0 (MN-major), group `group` of `rows_per_group` rows.
    PackedUe8m0 { group: usize, rows_per_group: usize },
}

/// An MXFP8 weight `[n, k]` held in backend buffers: E4M3 bytes row-major at byte `offset` of
/// `elements`, scales in `scales_layout`.
pub struct BackendWeight<'a, B: Backend> {
    pub elements: &'a B::Buffer,
    pub offset: usize,
    pub n: usize,
    pub k: usize,
    pub scales: &'a B::Buffer,
    pub scales_layout: ScaleKind,
}

/// The host backend: buffers are `Vec<u8>`, operations run on the calling thread.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    type Buffer = Vec<u8>;

    fn name(&self) -> String {
        "cpu".to_string()
    }
    fn empty(&self) -> Vec<u8> {
        Vec::new()
    }
    fn len(&self, buf: &Vec<u8>) -> usize {
        buf.len()
    }
    fn capacity(&self, buf: &Vec<u8>) -> usize {
        buf.capacity()
    }
    fn allocation_id(&self, buf: &Vec<u8>) -> usize {
        buf.as_ptr() as usize
    }
    fn upload(&self, host: &[u8], dst: &mut Vec<u8>) -> Result<(), KernelError> {
        dst.clear();
        dst.extend_from_slice(host);
        Ok(())
    }
    fn upload_staged(&self, host: &mut Vec<u8>, dst: &mut Vec<u8>) -> Result<(), KernelError> {
        // Swap allocations when `dst` can hold the next read of this size (so neither side ever
        // needs a new allocation on a reload); otherwise copy.
        if dst.capacity() >= host.len() {
            std::mem::swap(host, dst);
            Ok(())
        } else {
            self.upload(host, dst)
        }
    }
    fn quantize_bf16_host(
        &self,
        bf16: &[u8],
        rows: usize,
        k: usize,
        rule: ScaleRule,
        order: BlockOrder<'_>,
        elements: &mut Vec<u8>,
        scales: &mut Vec<u8>,
    ) -> Result<Option<crate::placement::Placed>, KernelError> {
        mxfp8::quantize_bf16_placed(bf16, rows, k, rule, order, elements, scales).map(Some)
    }
    fn upload_gather_runs(
        &self,
        host: &[u8],
        row_bytes: usize,
        run_bytes: usize,
        perm: &Permutation,
        dst: &mut Vec<u8>,
    ) -> Result<(), KernelError> {
        permutation::gather_runs(host, row_bytes, run_bytes, perm, dst)
    }
    fn upload_e4m3(
        &self,
        host: &[u8],
        rows: usize,
        k: usize,
        order: BlockOrder<'_>,
        dst: &mut Vec<u8>,
    ) -> Result<(Digest, Option<Digest>), KernelError> {
        let placed = crate::placement::place_e4m3(host, rows, k, order, dst)?;
        Ok((placed.source, Some(placed.placed)))
    }
    fn host_bytes<'a>(&self, buf: &'a Vec<u8>) -> Result<std::borrow::Cow<'a, [u8]>, KernelError> {
        Ok(std::borrow::Cow::Borrowed(buf))
    }
    fn download(&self, src: &Vec<u8>, dst: &mut Vec<u8>) -> Result<(), KernelError> {
        dst.clear();
        dst.extend_from_slice(src);
        Ok(())
    }
    fn digest(&self, buf: &Vec<u8>) -> Result<Digest, KernelError> {
        Ok(Digest::of(buf))
    }
    fn expand_block_scales(
        &self,
        block_scale: &Vec<u8>,
        rows: usize,
        k: usize,
        block: [usize; 2],
        dst: &mut Vec<u8>,
    ) -> Result<(), KernelError> {
        expand_block_scales(block_scale, rows, k, block, dst)
    }
    fn quantize_bf16_rows(
        &self,
        bf16: &Vec<u8>,
        rows: usize,
        k: usize,
        rule: ScaleRule,
        elements: &mut Vec<u8>,
        scales: &mut Vec<u8>,
    ) -> Result<(), KernelError> {
        mxfp8::quantize_bf16_rows(bf16, rows, k, rule, elements, scales)
    }
    fn gather_runs(
        &self,
        src: &Vec<u8>,
        row_bytes: usize,
        run_bytes: usize,
        perm: &Permutation,
        dst: &mut Vec<u8>,
    ) -> Result<(), KernelError> {
        permutation::gather_runs(src, row_bytes, run_bytes, perm, dst)
    }
    fn digest_gathered_runs(&self, src: &Vec<u8>, row_bytes: usize, run_bytes: usize, perm: &Permutation) -> Result<Digest, KernelError> {
        permutation::digest_gathered_runs(src, row_bytes, run_bytes, perm)
    }
    fn swizzle_128x4(&self, src: &Vec<u8>, m: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
        layout::swizzle_128x4(src, m, c, dst)
    }
    fn unswizzle_128x4(&self, src: &Vec<u8>, m: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
        layout::unswizzle_128x4(src, m, c, dst)
    }
    fn pack_ue8m0(&self, src: &Vec<u8>, groups: usize, rows: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
        layout::pack_ue8m0_mn_major(src, groups, rows, c, dst)
    }
    fn unpack_ue8m0(&self, src: &Vec<u8>, groups: usize, rows: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
        layout::unpack_ue8m0_mn_major(src, groups, rows, c, dst)
    }
}

/// Expands a block scale `[rows/bm, k/bk]` to per-row MXFP8 scales `[rows, k/32]`
/// (spec section 3: each 32x32 scale row repeated 32 times; a 128x128 block also covers four
/// 32-column blocks).
pub fn expand_block_scales(block_scale: &[u8], rows: usize, k: usize, block: [usize; 2], dst: &mut Vec<u8>) -> Result<(), KernelError> {
    let [bm, bk] = block;
    if bm == 0 || bk == 0 || bk % mxfp8::BLOCK != 0 || !rows.is_multiple_of(bm) || !k.is_multiple_of(bk) {
        return Err(KernelError::Shape(format!("cannot expand {bm}x{bk} block scales over [{rows}, {k}]")));
    }
    let (block_rows, block_cols) = (rows / bm, k / bk);
    if block_scale.len() != block_rows * block_cols {
        return Err(KernelError::Shape(format!("block scale has {} bytes, expected [{block_rows}, {block_cols}]", block_scale.len())));
    }
    let c = k / mxfp8::BLOCK;
    let per_block = bk / mxfp8::BLOCK;
    // Every byte is overwritten below: no need to clear first.
    dst.resize(rows * c, 0);
    if c == 0 {
        return Ok(());
    }
    // The first row of each block row, then the block's other rows copied from it.
    for (br, rows_of_block) in dst.chunks_exact_mut(bm * c).enumerate() {
        let (first, rest) = rows_of_block.split_at_mut(c);
        for (out, &b) in first.chunks_exact_mut(per_block).zip(&block_scale[br * block_cols..][..block_cols]) {
            out.fill(b);
        }
        for row in rest.chunks_exact_mut(c) {
            row.copy_from_slice(first);
        }
    }
    Ok(())
}

/// Makes `dst` `n` bytes long for a writer that then overwrites every byte. A buffer that must
/// grow is replaced by a zeroed allocation instead of being grown and filled with zeros: large
/// zeroed blocks come straight from the kernel, zero already (the worker's allocator), so a
/// fresh buffer's bytes are written once, by the writer. A buffer that fits keeps its
/// allocation (a reload allocates nothing).
pub fn resize_for_overwrite(dst: &mut Vec<u8>, n: usize) {
    if dst.capacity() < n {
        *dst = vec![0u8; n];
    } else {
        dst.resize(n, 0);
    }
}

/// Buffers a loader reuses across tensors and reloads. `take` hands out the free buffer that
/// fits best, so a reload of the same shapes allocates nothing new.
pub struct BufferPool<B: Backend> {
    free: Vec<B::Buffer>,
}

impl<B: Backend> Default for BufferPool<B> {
    fn default() -> Self {
        Self { free: Vec::new() }
    }
}

impl<B: Backend> BufferPool<B> {
    /// The smallest free buffer that can hold `bytes` without growing, or a new empty one.
    /// (Never a smaller free buffer to grow: that would take it from a later request of its
    /// own size, and a reload would then allocate.)
    pub fn take(&mut self, backend: &B, bytes: usize) -> B::Buffer {
        let fitting = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| backend.capacity(b) >= bytes)
            .min_by_key(|(_, b)| backend.capacity(b))
            .map(|(i, _)| i);
        match fitting {
            Some(i) => self.free.swap_remove(i),
            None => backend.empty(),
        }
    }

    pub fn give(&mut self, buf: B::Buffer) {
        self.free.push(buf);
    }

    pub fn len(&self) -> usize {
        self.free.len()
    }

    /// Allocation identities of the free buffers.
    pub fn allocation_ids(&self, backend: &B) -> Vec<usize> {
        self.free.iter().map(|b| backend.allocation_id(b)).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.free.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_32x32_and_128x128() {
        // [64, 64] with 32x32 blocks: scale [2, 2] -> per-row [64, 2].
        let mut out = Vec::new();
        expand_block_scales(&[1, 2, 3, 4], 64, 64, [32, 32], &mut out).unwrap();
        assert_eq!(&out[..2], &[1, 2]);
        assert_eq!(&out[31 * 2..32 * 2], &[1, 2]);
        assert_eq!(&out[32 * 2..33 * 2], &[3, 4]);
        // [128, 256] with 128x128 blocks: scale [1, 2] -> per-row [128, 8].
        expand_block_scales(&[5, 6], 128, 256, [128, 128], &mut out).unwrap();
        assert_eq!(&out[..8], &[5, 5, 5, 5, 6, 6, 6, 6]);
        assert!(expand_block_scales(&[1], 30, 64, [32, 32], &mut out).is_err());
    }

    #[test]
    fn pool_reuses_best_fit() {
        let cpu = CpuBackend;
        let mut pool = BufferPool::<CpuBackend>::default();
        let big = Vec::with_capacity(1000);
        let small = Vec::with_capacity(10);
        let (big_id, small_id) = (big.as_ptr() as usize, small.as_ptr() as usize);
        pool.give(big);
        pool.give(small);
        assert_eq!(cpu.allocation_id(&pool.take(&cpu, 8)), small_id);
        // Nothing left fits 2000: a new buffer, the big one stays for a request it fits.
        assert_eq!(cpu.capacity(&pool.take(&cpu, 2000)), 0);
        assert_eq!(cpu.allocation_id(&pool.take(&cpu, 8)), big_id);
        assert_eq!(cpu.capacity(&pool.take(&cpu, 8)), 0);
    }

    /// Block scales expand to the spec's definition (row r, 32-column block j takes the scale
    /// of block (r / bm, j * 32 / bk)) for square and oblong blocks; shapes that do not tile
    /// are refused.
    #[test]
    fn block_scales_expand_to_one_scale_per_row_and_32_columns() {
        for (rows, k, block) in [(256, 512, [128, 128]), (96, 64, [32, 32]), (128, 256, [64, 128]), (64, 96, [32, 96])] {
            let [bm, bk] = block;
            let (br, bc) = (rows / bm, k / bk);
            let src: Vec<u8> = (0..br * bc).map(|i| (i * 37 + 11) as u8).collect();
            let mut got = vec![7u8; 3];
            expand_block_scales(&src, rows, k, block, &mut got).unwrap();
            let c = k / 32;
            let want: Vec<u8> = (0..rows * c).map(|i| src[(i / c) / bm * bc + (i % c) * 32 / bk]).collect();
            assert_eq!(got, want, "[{rows}, {k}] in {bm}x{bk} blocks");
        }
        assert!(expand_block_scales(&[1], 30, 64, [32, 32], &mut Vec::new()).is_err());
        assert!(expand_block_scales(&[1, 2], 32, 64, [32, 32], &mut Vec::new()).is_ok());
        assert!(expand_block_scales(&[1], 32, 64, [32, 32], &mut Vec::new()).is_err());
    }
}
