//! MXFP8 GEMMs that read weights in their kernel layouts (spec sections 7 and 8).
//!
//! `out[t, n] = sum_k a[t, k] * w[n, k]`, where both operands are MXFP8 (E4M3 elements, one
//! UE8M0 scale per 32 elements along K) and are dequantized exactly to f32 (a power-of-two
//! scale times an E4M3 value), and every output accumulates its K products in f32, in
//! increasing `k`, one product at a time. That order is the same for every output element
//! wherever it sits, so a GEMM on row-permuted weights gives exactly (bit for bit) the
//! permuted output, and the plain triple loop [`gemm_reference`] gives exactly what the fast
//! [`gemm`] gives.
//!
//! Three implementations give those bits: `dot` (up to 16 rows, AVX-512 BF16), `fused` (up
//! to 8 rows, AVX-512 or AVX2 + F16C) and `tile` (any rows, any CPU); each tile of 32 weight
//! rows takes the first that can compute it exactly.
//!
//! The weight is read through a [`WeightView`]: its E4M3 bytes row-major `[N, K]` (the `[K, N]`
//! column-major view of the CuteDSL GEMM) and its scales in whichever layout the kernel reads
//! (F8_128x4 swizzled, DeepGEMM packed, or plain per-row for references). A wrong layout gives
//! a wrong result: nothing here un-permutes or un-swizzles on the side.

use rayon::prelude::*;

mod dot;
mod exact;
mod fused;
mod tile;

use crate::layout::swizzle_offset;
use crate::mxfp8::{self, BLOCK, ScaleRule};
use crate::{KernelError, e4m3, e8m0};

/// How a weight's per-row, per-32-column scales are stored.
#[derive(Clone, Copy, Debug)]
pub enum ScaleView<'a> {
    /// Plain row-major `[N, K/32]` (checkpoint-order references).
    RowMajor(&'a [u8]),
    /// F8_128x4 swizzle of `[N, K/32]` (`wq_b`, `wo_b`).
    Swizzled128x4(&'a [u8]),
    /// DeepGEMM packed UE8M0, MN-major, of one group: storage `[group][k4][row][4]` over
    /// `groups` groups of `rows_per_group` rows (`wo_a`).
    PackedUe8m0 { bytes: &'a [u8], group: usize, rows_per_group: usize },
}

/// An MXFP8 weight `[N, K]` as a kernel reads it.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    /// E4M3 bytes, row-major `[N, K]`.
    pub elements: &'a [u8],
    pub n: usize,
    pub k: usize,
    pub scales: ScaleView<'a>,
}

impl WeightView<'_> {
    /// The scale byte of row `n`, 32-column block `kb` (where [`WeightView::scale_run`] puts it).
    #[inline]
    pub fn scale(&self, n: usize, kb: usize) -> u8 {
        let (bytes, at, step) = self.scale_run(n & !15, kb);
        bytes[at + (n & 15) * step]
    }

    /// The scales of rows `n0 .. n0 + 16` of block `kb`, for `n0` a multiple of 16: the bytes
    /// they lie in, row `n0`'s offset and the step from one row to the next (every layout
    /// keeps 16 such rows evenly spaced). The one place each layout's addresses are written.
    #[inline]
    fn scale_run(&self, n0: usize, kb: usize) -> (&[u8], usize, usize) {
        debug_assert!(n0.is_multiple_of(16));
        let c = self.k / BLOCK;
        match self.scales {
            ScaleView::RowMajor(s) => (s, n0 * c + kb, c),
            // Rows i and i + 1 of one 32-row slice of a 128-row block are 16 bytes apart.
            ScaleView::Swizzled128x4(s) => (s, swizzle_offset(n0, kb, c), 16),
            ScaleView::PackedUe8m0 { bytes, group, rows_per_group } => {
                (bytes, ((group * (c / 4) + kb / 4) * rows_per_group + n0) * 4 + kb % 4, 4)
            }
        }
    }

    fn check(&self) -> Result<(), KernelError> {
        let c = self.k / BLOCK;
        let need = match self.scales {
            ScaleView::RowMajor(s) => (s.len(), self.n * c),
            ScaleView::Swizzled128x4(s) => (s.len(), crate::layout::swizzled_len(self.n, c)),
            ScaleView::PackedUe8m0 { bytes, group, rows_per_group } => {
                if rows_per_group != self.n || !c.is_multiple_of(4) {
                    return Err(KernelError::Shape(format!("packed scales of {rows_per_group} rows for a weight of {} rows", self.n)));
                }
                (bytes.len(), (group + 1) * rows_per_group * c)
            }
        };
        let short = match self.scales {
            ScaleView::PackedUe8m0 { .. } => need.0 < need.1,
            _ => need.0 != need.1,
        };
        if !self.k.is_multiple_of(BLOCK) || self.elements.len() != self.n * self.k || short {
            return Err(KernelError::Shape(format!(
                "weight view [{}, {}] has {} element bytes and {} scale bytes (need {})",
                self.n,
                self.k,
                self.elements.len(),
                need.0,
                need.1
            )));
        }
        Ok(())
    }
}

/// An MXFP8 activation matrix `[rows, k]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MxMatrix {
    pub elements: Vec<u8>,
    pub scales: Vec<u8>,
    pub rows: usize,
    pub k: usize,
}

impl MxMatrix {
    /// Quantizes f32 rows `[rows, k]` (finite values) with `rule`.
    pub fn quantize(values: &[f32], k: usize, rule: ScaleRule) -> Result<Self, KernelError> {
        let (mut elements, mut scales) = (Vec::new(), Vec::new());
        mxfp8::quantize_f32_rows(values, k, rule, &mut elements, &mut scales)?;
        Ok(Self { elements, scales, rows: values.len() / k.max(1), k })
    }

    /// The exact f32 values.
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize_rows(&self.elements, self.k, |r, kb| self.scales[r * (self.k / BLOCK) + kb])
    }
}

/// Exact f32 values of E4M3 rows `[rows, k]` with a scale per row and 32-column block.
fn dequantize_rows(elements: &[u8], k: usize, scale: impl Fn(usize, usize) -> u8) -> Vec<f32> {
    let mut out = Vec::with_capacity(elements.len());
    for (r, row) in elements.chunks_exact(k.max(1)).enumerate() {
        for (kb, block) in row.chunks_exact(BLOCK).enumerate() {
            let s = e8m0::to_f32(scale(r, kb));
            out.extend(block.iter().map(|&e| e4m3::to_f32(e) * s));
        }
    }
    out
}

/// Output columns per tile: each tile's weights are dequantized once, transposed to
/// `[K, TILE]`, and reused for every activation row; the inner loop runs across the tile's
/// outputs (independent accumulators, one per lane), so each output still sums in `k` order.
const TILE: usize = 32;

/// Whether [`gemm`] takes the BF16 dot-product path (`vdpbf16ps`: two rounded multiply-adds per
/// f32 lane and instruction) for `rows` activation rows on this CPU, where the operands allow it.
pub fn uses_bf16_dot(rows: usize) -> bool {
    (1..=dot::DOT_MAX_ROWS).contains(&rows) && dot::available()
}

/// `out[t, n] = sum_k a[t, k] * w[n, k]` (see the module docs for the exact arithmetic), on all
/// cores. Returns `[T, N]` row-major.
pub fn gemm(a: &MxMatrix, w: &WeightView<'_>) -> Result<Vec<f32>, KernelError> {
    w.check()?;
    if a.k != w.k {
        return Err(KernelError::Shape(format!("activations have K = {}, the weight has K = {}", a.k, w.k)));
    }
    let (t_rows, k, n) = (a.rows, w.k, w.n);
    // The exact f32 activations, made where a tile first needs them: not at all where every
    // tile takes the BF16 dot-product path, which reads its own copy.
    let a_deq = std::sync::OnceLock::new();
    let a_deq = || -> &[f32] { a_deq.get_or_init(|| a.dequantize()) };
    // A few rows take the BF16 dot-product path or the fused path, which hand back any tile
    // they cannot compute exactly.
    let dot = dot::Activations::from_mx(a);
    let few = dot.is_some() || (t_rows <= fused::FUSED_MAX_ROWS && fused::available());
    // Where a multiply and its add may be fused (`exact`).
    let a_scales = exact::ScaleRange::of_activations(a);
    if t_rows == 0 || n == 0 {
        return Ok(Vec::new());
    }
    // Column tiles in parallel, each into its own [T, TILE] block of one buffer (rather than a
    // buffer per tile), then the rows of the output from those blocks on this thread: a second
    // parallel pass, cheap inside the pool, costs a wake-up of its threads when called from
    // outside (`bench-gemm`, `wo_a` at T = 2 and 4: 0.8x).
    let block = t_rows * TILE;
    let mut tiled = vec![0f32; n.div_ceil(TILE) * block];
    tiled.par_chunks_mut(block).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(wt, scales): &mut (Vec<f32>, Vec<u8>), (tile, out)| {
            let n0 = tile * TILE;
            if few && let Some(weights) = TileWeights::gather(w, n0, scales) {
                let done =
                    dot.as_ref().is_some_and(|d| dot::tile(&weights, d, out)) || fused::tile(&weights, a_deq(), a_scales, t_rows, out);
                if done {
                    return;
                }
            }
            wt.resize(k * TILE, 0.0);
            let w_scales = tile::fill(w, n0, TILE.min(n - n0), wt);
            let fuse = a_scales.zip(w_scales).is_some_and(|(a, w)| a.exact_products(w));
            tile::accumulate(a_deq(), t_rows, k, wt, out, fuse);
        },
    );
    let mut out = vec![0f32; t_rows * n];
    out.chunks_exact_mut(n).enumerate().for_each(|(t, row)| {
        for (row, tile) in row.chunks_mut(TILE).zip(tiled.chunks_exact(block)) {
            row.copy_from_slice(&tile[t * TILE..][..row.len()]);
        }
    });
    Ok(out)
}

/// A whole tile of `TILE` weight rows as the few-row paths ([`dot`], [`fused`]) read it.
struct TileWeights<'a> {
    /// E4M3 bytes, `TILE` rows of `k`.
    elements: &'a [u8],
    /// The next tile's bytes (the one its thread usually takes next), for prefetching.
    next: &'a [u8],
    k: usize,
    /// Block-major: `scales[kb * TILE + j]` is row `j`'s scale of block `kb`.
    scales: &'a [u8],
    /// The smallest and largest scale byte.
    min_scale: u8,
    max_scale: u8,
}

impl<'a> TileWeights<'a> {
    /// The tile of rows `n0 .. n0 + TILE`, its scales gathered into `scratch`. None for a partial
    /// tile.
    fn gather(w: &WeightView<'a>, n0: usize, scratch: &'a mut Vec<u8>) -> Option<Self> {
        let (k, blocks) = (w.k, w.k / BLOCK);
        if n0 + TILE > w.n {
            return None;
        }
        scratch.resize(TILE * blocks, 0);
        // Four blocks at a time where each row's four scale bytes lie side by side (every
        // layout keeps them so, in groups of four blocks).
        let mut kb = 0;
        while kb < blocks {
            if kb + 4 <= blocks && quad::gather(w, n0, kb, &mut scratch[kb * TILE..(kb + 4) * TILE]) {
                kb += 4;
                continue;
            }
            for half in 0..TILE / 16 {
                let (bytes, at, step) = w.scale_run(n0 + half * 16, kb);
                let run = &bytes[at..=at + 15 * step];
                for (r, s) in scratch[kb * TILE + half * 16..][..16].iter_mut().enumerate() {
                    *s = run[r * step];
                }
            }
            kb += 1;
        }
        let exact::ScaleRange { min: min_scale, max: max_scale } = exact::ScaleRange::of(scratch);
        let elements: &'a [u8] = w.elements;
        let next = &elements[((n0 + TILE) * k).min(elements.len())..((n0 + 2 * TILE) * k).min(elements.len())];
        Some(Self { elements: &elements[n0 * k..(n0 + TILE) * k], next, k, scales: scratch, min_scale, max_scale })
    }

    fn scale_range(&self) -> exact::ScaleRange {
        exact::ScaleRange { min: self.min_scale, max: self.max_scale }
    }
}

/// A tile's scales four blocks at a time: each row's four bytes read as one word, and 4 x 4
/// bytes transposed in a register, where a byte at a time took about a tenth of the GEMM's
/// samples at T = 4 (Zen 5 VM, one thread: 1.06-1.11x the GEMM at T = 2 to 8). An AVX-512 gather
/// of 16 strided bytes was slower than the byte loop there (0.9x).
mod quad {
    use super::{TILE, WeightView};

    /// Block-major scales of rows `n0 .. n0 + TILE`, blocks `kb .. kb + 4` (`kb` a multiple of
    /// 4) into `out`: false, leaving `out` as it was, where this CPU or the layout cannot.
    pub fn gather(w: &WeightView<'_>, n0: usize, kb: usize, out: &mut [u8]) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let runs = [w.scale_run(n0, kb), w.scale_run(n0 + 16, kb)];
            // Each run's 16 rows of 4 bytes inside its bytes, and side by side (block kb + j of
            // a row at its offset + j: true of every layout for kb a multiple of 4).
            let fits = kb.is_multiple_of(4) && out.len() == 4 * TILE && runs.iter().all(|&(b, at, step)| at + 15 * step + 4 <= b.len());
            if fits
                && *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("ssse3") && std::arch::is_x86_feature_detected!("sse4.1"))
            {
                for (half, (bytes, at, step)) in runs.into_iter().enumerate() {
                    // SAFETY: the CPU has SSSE3 and SSE4.1, and the 4 bytes of each row lie inside `bytes` (checked).
                    unsafe { x86::run(bytes, at, step, &mut out[half * 16..]) };
                }
                return true;
            }
        }
        let _ = (w, n0, kb, out);
        false
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        use super::TILE;

        /// `out[j * TILE + r] = bytes[at + r * step + j]` for `r < 16`, `j < 4`.
        #[target_feature(enable = "ssse3,sse4.1")]
        pub unsafe fn run(bytes: &[u8], at: usize, step: usize, out: &mut [u8]) {
            debug_assert!(at + 15 * step + 4 <= bytes.len() && out.len() >= 3 * TILE + 16);
            // SAFETY: 4 bytes at at + r * step, r < 16 (the caller's bounds).
            let word = |r: usize| unsafe { bytes.as_ptr().add(at + r * step).cast::<i32>().read_unaligned() };
            // Four rows per register, then each register's 4 x 4 bytes transposed: block j of
            // its rows in dword j.
            let by_block = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            let y: [__m128i; 4] = std::array::from_fn(|q| {
                _mm_shuffle_epi8(_mm_setr_epi32(word(4 * q), word(4 * q + 1), word(4 * q + 2), word(4 * q + 3)), by_block)
            });
            let (t0, t1) = (_mm_unpacklo_epi32(y[0], y[1]), _mm_unpacklo_epi32(y[2], y[3]));
            let (t2, t3) = (_mm_unpackhi_epi32(y[0], y[1]), _mm_unpackhi_epi32(y[2], y[3]));
            let blocks = [_mm_unpacklo_epi64(t0, t1), _mm_unpackhi_epi64(t0, t1), _mm_unpacklo_epi64(t2, t3), _mm_unpackhi_epi64(t2, t3)];
            for (j, b) in blocks.into_iter().enumerate() {
                // SAFETY: 16 bytes at j * TILE <= 3 * TILE inside `out` (asserted above).
                unsafe { _mm_storeu_si128(out.as_mut_ptr().add(j * TILE).cast(), b) };
            }
        }
    }
}

/// The plain triple loop: the yardstick for [`gemm`] (bit-identical by construction) and the
/// naive baseline of the GEMM benchmark.
pub fn gemm_reference(a: &MxMatrix, w: &WeightView<'_>) -> Result<Vec<f32>, KernelError> {
    w.check()?;
    if a.k != w.k {
        return Err(KernelError::Shape(format!("activations have K = {}, the weight has K = {}", a.k, w.k)));
    }
    let a_deq = a.dequantize();
    let mut out = vec![0f32; a.rows * w.n];
    for t in 0..a.rows {
        for n in 0..w.n {
            let mut acc = 0f32;
            for kk in 0..w.k {
                let wv = e4m3::to_f32(w.elements[n * w.k + kk]) * e8m0::to_f32(w.scale(n, kk / BLOCK));
                acc += a_deq[t * w.k + kk] * wv;
            }
            out[t * w.n + n] = acc;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{pack_ue8m0_mn_major, swizzle_128x4};
    use crate::permutation::{Permutation, gather_runs};

    fn weight(n: usize, k: usize, seed: u32) -> (Vec<u8>, Vec<u8>) {
        let e = (0..n * k).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 9) as u8 & 0x7E).collect();
        let s = (0..n * k / 32).map(|i| 120 + ((i as u32 * 7 + seed) % 6) as u8).collect();
        (e, s)
    }

    fn acts(t: usize, k: usize) -> MxMatrix {
        let v: Vec<f32> = (0..t * k).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37).collect();
        MxMatrix::quantize(&v, k, ScaleRule::Rceil).unwrap()
    }

    #[test]
    fn fast_equals_reference_bit_for_bit_in_every_scale_layout() {
        let (n, k) = (40, 128);
        let (e, s) = weight(n, k, 3);
        let a = acts(5, k);
        let plain = WeightView { elements: &e, n, k, scales: ScaleView::RowMajor(&s) };
        let want = gemm_reference(&a, &plain).unwrap();
        assert_eq!(gemm(&a, &plain).unwrap(), want);
        let mut sw = Vec::new();
        swizzle_128x4(&s, n, k / 32, &mut sw).unwrap();
        let swz = WeightView { elements: &e, n, k, scales: ScaleView::Swizzled128x4(&sw) };
        assert_eq!(gemm(&a, &swz).unwrap(), want);
        // Packed: two groups of 20 rows; group 1 is rows 20..40.
        let mut packed = Vec::new();
        pack_ue8m0_mn_major(&s, 2, 20, k / 32, &mut packed).unwrap();
        let g1 = WeightView {
            elements: &e[20 * k..],
            n: 20,
            k,
            scales: ScaleView::PackedUe8m0 { bytes: &packed, group: 1, rows_per_group: 20 },
        };
        let got = gemm(&a, &g1).unwrap();
        for t in 0..5 {
            assert_eq!(&got[t * 20..(t + 1) * 20], &want[t * n + 20..t * n + 40]);
        }
        // Reading swizzled scales as if they were plain gives a different answer.
        let wrong = WeightView { elements: &e, n, k, scales: ScaleView::RowMajor(&sw[..n * k / 32]) };
        assert_ne!(gemm(&a, &wrong).unwrap(), want);
    }

    /// Every E4M3 byte against scales from tiny to huge, for every row count up to past the
    /// dot-product path's limit and in every scale layout: the same bits as the plain loop, over
    /// tiles at every position of a 128-row swizzle block, including the tiles the fast paths
    /// hand back (a NaN byte in rows 64..96, a scale above 246 in rows 160..192, tiny and huge
    /// scales in rows 0..160 for the dot-product path), whole tiles it takes (rows 192..288) and
    /// a partial last tile (rows 288..312).
    #[test]
    fn every_row_count_gives_the_plain_loops_bits_for_every_byte_and_scale() {
        let (n, k) = (312, 256);
        let c = k / 32;
        let nan_rows = 64..96;
        let e: Vec<u8> = (0..n * k)
            .map(|i| {
                let b = (i * 7 + i / k) as u8;
                if !nan_rows.contains(&(i / k)) && e4m3::is_nan(b) { b ^ 1 } else { b }
            })
            .collect();
        assert!(e[64 * k..96 * k].iter().any(|&b| e4m3::is_nan(b)));
        // Rows take scales of one kind each, so that most outputs stay finite and every weight
        // counts: ordinary (120..=134), tiny (0, 1, 3: subnormal products), huge (200, 246: the
        // largest that fold), or a spread (100, 127, 128).
        let s: Vec<u8> = (0..n * c)
            .map(|i| match (i / c, i % c) {
                (160..192, kb) => 247 + (kb % 8) as u8,
                // Whole tiles of ordinary scales, which the dot-product path takes.
                (192..288, kb) => 120 + ((kb * 5 + i / c) % 15) as u8,
                (row, kb) => match row % 4 {
                    0 => 120 + ((kb * 5 + row) % 15) as u8,
                    1 => [0u8, 1, 3][(kb + row) % 3],
                    2 => [200u8, 246][(kb + row) % 2],
                    _ => [100u8, 127, 128][(kb + row) % 3],
                },
            })
            .collect();
        let plain = WeightView { elements: &e, n, k, scales: ScaleView::RowMajor(&s) };
        let mut sw = Vec::new();
        swizzle_128x4(&s, n, c, &mut sw).unwrap();
        let swz = WeightView { elements: &e, n, k, scales: ScaleView::Swizzled128x4(&sw) };
        let mut packed = Vec::new();
        pack_ue8m0_mn_major(&s, 2, n / 2, c, &mut packed).unwrap();
        // Every bit of every number; a NaN as one value, since Rust leaves a NaN's sign and
        // payload to the compiler (LLVM commutes a multiply or an add, and x86 keeps the first
        // operand's NaN): on an AVX2-only CPU the plain loop's NaN outputs came out with the
        // other sign from the tiled path's, with the arithmetic of both unchanged.
        let bits = |v: &[f32]| v.iter().map(|x| if x.is_nan() { f32::NAN.to_bits() } else { x.to_bits() }).collect::<Vec<_>>();
        for rows in 1..=dot::DOT_MAX_ROWS + 1 {
            let a = acts(rows, k);
            let reference = gemm_reference(&a, &plain).unwrap();
            let finite = reference.iter().filter(|x| x.is_finite() && **x != 0.0).count();
            assert!(finite * 2 > reference.len(), "{finite} of {} outputs are finite and nonzero", reference.len());
            let want = bits(&reference);
            assert_eq!(bits(&gemm(&a, &plain).unwrap()), want, "{rows} rows, plain scales");
            assert_eq!(bits(&gemm(&a, &swz).unwrap()), want, "{rows} rows, swizzled scales");
            for group in 0..2 {
                let rows_of = group * n / 2..(group + 1) * n / 2;
                let g = WeightView {
                    elements: &e[rows_of.start * k..rows_of.end * k],
                    n: n / 2,
                    k,
                    scales: ScaleView::PackedUe8m0 { bytes: &packed, group, rows_per_group: n / 2 },
                };
                let got = bits(&gemm(&a, &g).unwrap());
                for t in 0..rows {
                    assert_eq!(
                        &got[t * n / 2..(t + 1) * n / 2],
                        &want[t * n + rows_of.start..t * n + rows_of.end],
                        "{rows} rows, packed group {group}"
                    );
                }
            }
        }
    }

    /// A tile's gathered scales (four blocks at a time where they can be) are each row's and
    /// block's scale as [`WeightView::scale`] reads it, in every layout, with a number of blocks
    /// that is and is not a multiple of 4.
    #[test]
    fn tile_scales_are_gathered_block_major_in_every_layout() {
        for k in [160, 256, 416] {
            let (n, c) = (320, k / 32);
            let s: Vec<u8> = (0..n * c).map(|i| (i * 31 + i / c * 7) as u8).collect();
            let e = vec![0u8; n * k];
            let mut sw = Vec::new();
            swizzle_128x4(&s, n, c, &mut sw).unwrap();
            let mut packed = Vec::new();
            let mut views = vec![
                WeightView { elements: &e, n, k, scales: ScaleView::RowMajor(&s) },
                WeightView { elements: &e, n, k, scales: ScaleView::Swizzled128x4(&sw) },
            ];
            if c.is_multiple_of(4) {
                pack_ue8m0_mn_major(&s, 1, n, c, &mut packed).unwrap();
                views.push(WeightView {
                    elements: &e,
                    n,
                    k,
                    scales: ScaleView::PackedUe8m0 { bytes: &packed, group: 0, rows_per_group: n },
                });
            }
            for w in &views {
                for n0 in (0..n - TILE + 1).step_by(TILE) {
                    let mut scratch = Vec::new();
                    let tile = TileWeights::gather(w, n0, &mut scratch).unwrap();
                    let want: Vec<u8> = (0..c).flat_map(|kb| (0..TILE).map(move |r| (kb, r))).map(|(kb, r)| w.scale(n0 + r, kb)).collect();
                    assert_eq!(tile.scales, want.as_slice(), "k {k}, {:?} rows {n0}..", std::mem::discriminant(&w.scales));
                    assert_eq!((tile.min_scale, tile.max_scale), (*want.iter().min().unwrap(), *want.iter().max().unwrap()));
                }
            }
        }
    }

    #[test]
    fn row_permuted_weight_gives_the_permuted_output_exactly() {
        let (n, k) = (8 * 512, 64);
        let (e, s) = weight(n, k, 9);
        let a = acts(3, k);
        let perm = Permutation::q_rows(8, 512).unwrap();
        let (mut pe, mut ps) = (Vec::new(), Vec::new());
        gather_runs(&e, n * k, k, &perm, &mut pe).unwrap();
        gather_runs(&s, n * 2, 2, &perm, &mut ps).unwrap();
        let std = gemm(&a, &WeightView { elements: &e, n, k, scales: ScaleView::RowMajor(&s) }).unwrap();
        let fused = gemm(&a, &WeightView { elements: &pe, n, k, scales: ScaleView::RowMajor(&ps) }).unwrap();
        for t in 0..3 {
            let row = &std[t * n..(t + 1) * n];
            assert_eq!(&fused[t * n..(t + 1) * n], perm.apply(row).as_slice());
        }
    }
}
