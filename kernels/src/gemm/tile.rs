//! The two inner steps of [`super::gemm`], each with a portable version and two x86-64
//! versions (AVX2 + F16C, and the same with 512-bit registers where the CPU has AVX-512F;
//! chosen at run time) that give the same bits:
//!
//! - [`fill`]: dequantize a tile of `TILE` weight rows and transpose it to `[K, TILE]` f32.
//!   The x86 version decodes eight E4M3 bytes at a time without a table: the byte's low seven
//!   bits shifted left by 7 (and its sign) are an IEEE half whose value is the E4M3 value / 256
//!   (normals and subnormals alike), so `cvtph2ps` then `* (256 * scale)` gives the E4M3 value
//!   times its scale rounded once, as the portable code computes it; then an 8 x 8 register
//!   transpose. Tiles with NaN bytes (which loads refuse) take the portable code.
//! - [`accumulate`]: `out[t, j] = sum_k a[t, k] * wt[k, j]` over the tile, in increasing `k`,
//!   a multiply then an add, so every output sums exactly as the plain loop does. The AVX2
//!   version fuses the two where every product is exact ([`super::exact`]: the same bits).

use super::exact::ScaleRange;
use super::{TILE, WeightView};
use crate::mxfp8::BLOCK;
use crate::{e4m3, e8m0};

/// Rows `n0 .. n0 + width` of `w`, dequantized, into `wt[k * TILE + j]` (`wt` holds
/// `w.k * TILE` values; columns at or past `width` are zero). Returns the range of the tile's
/// scale bytes where it is whole and has no NaN byte (what [`ScaleRange::exact_products`]
/// needs), None otherwise.
pub(super) fn fill(w: &WeightView<'_>, n0: usize, width: usize, wt: &mut [f32]) -> Option<ScaleRange> {
    #[cfg(target_arch = "x86_64")]
    if width == TILE && x86::available() && e4m3::find_nan(&w.elements[n0 * w.k..(n0 + TILE) * w.k]).is_none() {
        if x86_512::available() {
            // SAFETY: the CPU has AVX-512F, AVX2 and F16C (checked just above); `fill` checks
            // the bounds.
            return Some(unsafe { x86_512::fill(w, n0, wt) });
        }
        // SAFETY: the CPU has AVX2 and F16C (checked just above); `fill` checks the bounds.
        return Some(unsafe { x86::fill(w, n0, wt) });
    }
    fill_portable(w, n0, width, wt);
    None
}

fn fill_portable(w: &WeightView<'_>, n0: usize, width: usize, wt: &mut [f32]) {
    let k = w.k;
    wt.fill(0.0);
    for j in 0..width {
        let row = &w.elements[(n0 + j) * k..(n0 + j + 1) * k];
        for (kb, block) in row.chunks_exact(BLOCK).enumerate() {
            let s = e8m0::to_f32(w.scale(n0 + j, kb));
            for (i, &e) in block.iter().enumerate() {
                wt[(kb * BLOCK + i) * TILE + j] = e4m3::to_f32(e) * s;
            }
        }
    }
}

/// `out[t * TILE + j] = sum_kk a[t * k + kk] * wt[kk * TILE + j]` for `t < rows`; `fuse`:
/// whether the AVX2 version may fuse each multiply with its add (every product exact:
/// [`ScaleRange::exact_products`]).
pub(super) fn accumulate(a: &[f32], rows: usize, k: usize, wt: &[f32], out: &mut [f32], fuse: bool) {
    #[cfg(target_arch = "x86_64")]
    if x86_512::available() {
        // SAFETY: the CPU has AVX-512F (checked just above); `accumulate` checks the bounds.
        unsafe { x86_512::accumulate(a, rows, k, wt, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above); `accumulate` checks the bounds.
        unsafe {
            if fuse {
                x86::accumulate::<true>(a, rows, k, wt, out);
            } else {
                x86::accumulate::<false>(a, rows, k, wt, out);
            }
        }
        return;
    }
    let _ = fuse;
    accumulate_portable(a, rows, k, wt, out);
}

fn accumulate_portable(a: &[f32], rows: usize, k: usize, wt: &[f32], out: &mut [f32]) {
    for t in 0..rows {
        let a_row = &a[t * k..(t + 1) * k];
        let mut acc = [0f32; TILE];
        for (kk, &av) in a_row.iter().enumerate() {
            let wrow: &[f32; TILE] = wt[kk * TILE..(kk + 1) * TILE].try_into().expect("tile row");
            for j in 0..TILE {
                acc[j] += av * wrow[j];
            }
        }
        out[t * TILE..(t + 1) * TILE].copy_from_slice(&acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BLOCK, ScaleRange, TILE, WeightView};
    use crate::e8m0;

    /// AVX2 with F16C and FMA (every CPU with AVX2 has both).
    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("fma")
    }

    /// Eight E4M3 bytes at `p` (none of them NaN) as exact f32 values divided by 256: the
    /// byte sign-extended to 16 bits and shifted left by 7 keeps the sign in bit 15 and the low
    /// seven bits in bits 7..14 once bit 14 (a copy of the sign) is cleared, and that is the half
    /// whose value is the E4M3 value / 256.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn decode8_over_256(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bytes at `p` (an unaligned load).
        let v = unsafe { _mm_cvtepi8_epi16(_mm_loadl_epi64(p.cast())) };
        let half = _mm_and_si128(_mm_slli_epi16::<7>(v), _mm_set1_epi16(0xBF80u16 as i16));
        _mm256_cvtph_ps(half)
    }

    /// Rows of `r` become columns.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ]
    }

    /// A full tile (`TILE` rows from `n0`) without NaN bytes; returns the range of its scale
    /// bytes.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn fill(w: &WeightView<'_>, n0: usize, wt: &mut [f32]) -> ScaleRange {
        let k = w.k;
        assert!(w.elements.len() >= (n0 + TILE) * k && wt.len() >= k * TILE && k.is_multiple_of(BLOCK));
        let base = w.elements.as_ptr();
        let out = wt.as_mut_ptr();
        let mut range = ScaleRange::EMPTY;
        for g in 0..TILE / 8 {
            for kb in 0..k / BLOCK {
                let bytes: [u8; 8] = std::array::from_fn(|r| w.scale(n0 + g * 8 + r, kb));
                range = range.with(&bytes);
                // (value / 256) * (scale * 256) is value * scale rounded once, as the portable
                // code computes it, while scale * 256 stays finite (scale bytes up to 246).
                let folded = bytes.iter().all(|&b| b <= 246);
                let scales: [__m256; 8] = std::array::from_fn(|r| {
                    let s = e8m0::to_f32(bytes[r]);
                    _mm256_set1_ps(if folded { s * 256.0 } else { s })
                });
                for c in 0..BLOCK / 8 {
                    let kk = kb * BLOCK + c * 8;
                    // SAFETY: row n0 + g*8 + r < n0 + TILE and kk + 8 <= k (asserted above).
                    let rows: [__m256; 8] = std::array::from_fn(|r| {
                        let x = unsafe { decode8_over_256(base.add((n0 + g * 8 + r) * k + kk)) };
                        if folded { _mm256_mul_ps(x, scales[r]) } else { _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(256.0)), scales[r]) }
                    });
                    let cols = transpose8(rows);
                    for (i, col) in cols.into_iter().enumerate() {
                        // SAFETY: (kk + i) * TILE + g * 8 + 8 <= k * TILE.
                        unsafe { _mm256_storeu_ps(out.add((kk + i) * TILE + g * 8), col) };
                    }
                }
            }
        }
        range
    }

    /// `FUSE`: each multiply and its add as one `vfmadd` (the caller knows every product to be
    /// exact).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn accumulate<const FUSE: bool>(a: &[f32], rows: usize, k: usize, wt: &[f32], out: &mut [f32]) {
        assert!(a.len() >= rows * k && wt.len() >= k * TILE && out.len() >= rows * TILE);
        let w = wt.as_ptr();
        // Two activation rows at a time share each load of the tile.
        let mut t = 0;
        while t + 2 <= rows {
            let mut acc = [_mm256_setzero_ps(); 8];
            for kk in 0..k {
                let a0 = _mm256_set1_ps(a[t * k + kk]);
                let a1 = _mm256_set1_ps(a[(t + 1) * k + kk]);
                for q in 0..4 {
                    // SAFETY: kk * TILE + q * 8 + 8 <= k * TILE.
                    let wv = unsafe { _mm256_loadu_ps(w.add(kk * TILE + q * 8)) };
                    acc[q] = multiply_add::<FUSE>(a0, wv, acc[q]);
                    acc[4 + q] = multiply_add::<FUSE>(a1, wv, acc[4 + q]);
                }
            }
            for q in 0..4 {
                // SAFETY: (t + 1) * TILE + q * 8 + 8 <= rows * TILE.
                unsafe {
                    _mm256_storeu_ps(out.as_mut_ptr().add(t * TILE + q * 8), acc[q]);
                    _mm256_storeu_ps(out.as_mut_ptr().add((t + 1) * TILE + q * 8), acc[4 + q]);
                }
            }
            t += 2;
        }
        if t < rows {
            let mut acc = [_mm256_setzero_ps(); 4];
            for kk in 0..k {
                let a0 = _mm256_set1_ps(a[t * k + kk]);
                for (q, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: as above.
                    let wv = unsafe { _mm256_loadu_ps(w.add(kk * TILE + q * 8)) };
                    *acc = multiply_add::<FUSE>(a0, wv, *acc);
                }
            }
            for (q, acc) in acc.into_iter().enumerate() {
                // SAFETY: t * TILE + q * 8 + 8 <= rows * TILE.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(t * TILE + q * 8), acc) };
            }
        }
    }

    /// `acc + a * w`: one rounding where `FUSE`, else two.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn multiply_add<const FUSE: bool>(a: __m256, w: __m256, acc: __m256) -> __m256 {
        if FUSE { _mm256_fmadd_ps(a, w, acc) } else { _mm256_add_ps(acc, _mm256_mul_ps(a, w)) }
    }
}

/// The same two steps with 512-bit registers (AVX-512F, plus AVX2 and F16C): sixteen rows
/// decoded sixteen bytes at a time and a 16 x 16 register transpose, and accumulators of
/// sixteen outputs. Every value goes through the same operations as in [`x86`] (the half
/// trick, one multiply by the folded scale, a multiply then an add per product in increasing
/// `k`), so the bits are the same.
#[cfg(target_arch = "x86_64")]
mod x86_512 {
    use std::arch::x86_64::*;

    use super::{BLOCK, ScaleRange, TILE, WeightView};
    use crate::e8m0;

    pub fn available() -> bool {
        super::x86::available() && std::arch::is_x86_feature_detected!("avx512f")
    }

    /// Sixteen E4M3 bytes at `p` (none of them NaN) as exact f32 values divided by 256 (see
    /// `x86::decode8_over_256`).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    unsafe fn decode16_over_256(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bytes at `p` (an unaligned load).
        let v = unsafe { _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast())) };
        let half = _mm256_and_si256(_mm256_slli_epi16::<7>(v), _mm256_set1_epi16(0xBF80u16 as i16));
        _mm512_cvtph_ps(half)
    }

    /// Rows of `r` become columns: `out[j][i] = r[i][j]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: &[__m512; 16]) -> [__m512; 16] {
        // Within each 128-bit lane L: pairs, then quads of rows, at k = 4L + q.
        let a: [__m512; 16] = std::array::from_fn(|i| {
            let (x, y) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
            if i % 2 == 0 { _mm512_unpacklo_ps(x, y) } else { _mm512_unpackhi_ps(x, y) }
        });
        // b[m * 4 + q]: lane L holds rows 4m .. 4m + 3 at k = 4L + q.
        let b: [__m512; 16] = std::array::from_fn(|i| {
            let (m, q) = (i / 4, i % 4);
            let (x, y) = (_mm512_castps_pd(a[4 * m + q / 2]), _mm512_castps_pd(a[4 * m + q / 2 + 2]));
            _mm512_castpd_ps(if q % 2 == 0 { _mm512_unpacklo_pd(x, y) } else { _mm512_unpackhi_pd(x, y) })
        });
        // A 4 x 4 transpose of 128-bit lanes across b[0..4][q]: column 4L + q.
        let mut out = [_mm512_setzero_ps(); 16];
        for q in 0..4 {
            let (b0, b1, b2, b3) = (b[q], b[4 + q], b[8 + q], b[12 + q]);
            let e0 = _mm512_shuffle_f32x4::<0x44>(b0, b1);
            let e1 = _mm512_shuffle_f32x4::<0xEE>(b0, b1);
            let e2 = _mm512_shuffle_f32x4::<0x44>(b2, b3);
            let e3 = _mm512_shuffle_f32x4::<0xEE>(b2, b3);
            out[q] = _mm512_shuffle_f32x4::<0x88>(e0, e2);
            out[4 + q] = _mm512_shuffle_f32x4::<0xDD>(e0, e2);
            out[8 + q] = _mm512_shuffle_f32x4::<0x88>(e1, e3);
            out[12 + q] = _mm512_shuffle_f32x4::<0xDD>(e1, e3);
        }
        out
    }

    /// A full tile (`TILE` rows from `n0`) without NaN bytes; returns the range of its scale
    /// bytes.
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub unsafe fn fill(w: &WeightView<'_>, n0: usize, wt: &mut [f32]) -> ScaleRange {
        let k = w.k;
        assert!(w.elements.len() >= (n0 + TILE) * k && wt.len() >= k * TILE && k.is_multiple_of(BLOCK));
        let base = w.elements.as_ptr();
        let out = wt.as_mut_ptr();
        let mut range = ScaleRange::EMPTY;
        for g in 0..TILE / 16 {
            for kb in 0..k / BLOCK {
                let bytes: [u8; 16] = std::array::from_fn(|r| w.scale(n0 + g * 16 + r, kb));
                range = range.with(&bytes);
                // As in `x86::fill`: (value / 256) * (scale * 256) while scale * 256 is finite.
                let folded = bytes.iter().all(|&b| b <= 246);
                let scales: [__m512; 16] = std::array::from_fn(|r| {
                    let s = e8m0::to_f32(bytes[r]);
                    _mm512_set1_ps(if folded { s * 256.0 } else { s })
                });
                for c in 0..BLOCK / 16 {
                    let kk = kb * BLOCK + c * 16;
                    // SAFETY: row n0 + g*16 + r < n0 + TILE and kk + 16 <= k (asserted above).
                    let rows: [__m512; 16] = std::array::from_fn(|r| {
                        let x = unsafe { decode16_over_256(base.add((n0 + g * 16 + r) * k + kk)) };
                        if folded { _mm512_mul_ps(x, scales[r]) } else { _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(256.0)), scales[r]) }
                    });
                    let cols = transpose16(&rows);
                    for (i, col) in cols.into_iter().enumerate() {
                        // SAFETY: (kk + i) * TILE + g * 16 + 16 <= k * TILE.
                        unsafe { _mm512_storeu_ps(out.add((kk + i) * TILE + g * 16), col) };
                    }
                }
            }
        }
        range
    }

    /// `out[t * TILE + j] = sum_kk a[t * k + kk] * wt[kk * TILE + j]`: a multiply then an add
    /// per product, in increasing `kk`, four activation rows at a time sharing each tile load.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn accumulate(a: &[f32], rows: usize, k: usize, wt: &[f32], out: &mut [f32]) {
        assert!(a.len() >= rows * k && wt.len() >= k * TILE && out.len() >= rows * TILE);
        let w = wt.as_ptr();
        let mut t = 0;
        while t < rows {
            let n = (rows - t).min(4);
            let mut acc = [[_mm512_setzero_ps(); 2]; 4];
            for kk in 0..k {
                // SAFETY: kk * TILE + 32 <= k * TILE.
                let (w0, w1) = unsafe { (_mm512_loadu_ps(w.add(kk * TILE)), _mm512_loadu_ps(w.add(kk * TILE + 16))) };
                for (r, acc) in acc.iter_mut().enumerate().take(n) {
                    let av = _mm512_set1_ps(a[(t + r) * k + kk]);
                    acc[0] = _mm512_add_ps(acc[0], _mm512_mul_ps(av, w0));
                    acc[1] = _mm512_add_ps(acc[1], _mm512_mul_ps(av, w1));
                }
            }
            for (r, acc) in acc.iter().enumerate().take(n) {
                // SAFETY: (t + r) * TILE + 32 <= rows * TILE.
                unsafe {
                    _mm512_storeu_ps(out.as_mut_ptr().add((t + r) * TILE), acc[0]);
                    _mm512_storeu_ps(out.as_mut_ptr().add((t + r) * TILE + 16), acc[1]);
                }
            }
            t += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::ScaleView;

    #[test]
    fn both_versions_give_the_same_bits_for_every_byte_and_scale() {
        // Every E4M3 byte against scales from tiny to huge, 64 rows x 256 k: rows 0..32 hold
        // every finite byte (the x86 tile), rows 32..64 NaNs too (the portable fallback).
        // (A NaN scale never reaches a GEMM: loads refuse the byte 0xFF.)
        let (n, k) = (64, 256);
        let elements: Vec<u8> = (0..n * k)
            .map(|i| (i * 7 + i / k) as u8)
            .enumerate()
            .map(|(i, b)| if i < 32 * k && e4m3::is_nan(b) { b ^ 1 } else { b })
            .collect();
        assert!(elements[..32 * k].iter().all(|&b| !e4m3::is_nan(b)) && elements[32 * k..].iter().any(|&b| e4m3::is_nan(b)));
        let scales: Vec<u8> = (0..n * k / BLOCK).map(|i| [0u8, 1, 100, 127, 128, 200, 246, 247, 254, 253][i % 10]).collect();
        let w = WeightView { elements: &elements, n, k, scales: ScaleView::RowMajor(&scales) };
        for n0 in [0, 32] {
            let (mut fast, mut plain) = (vec![1f32; k * TILE], vec![2f32; k * TILE]);
            let range = fill(&w, n0, TILE, &mut fast);
            // The tile's scale range where it has no NaN byte (and the CPU decodes it with x86
            // code): the scales cycle through all ten values in any tile.
            let x86 = cfg!(target_arch = "x86_64") && x86::available();
            assert_eq!(range, (n0 == 0 && x86).then_some(ScaleRange { min: 0, max: 254 }), "tile at row {n0}");
            fill_portable(&w, n0, TILE, &mut plain);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let differ = bits(&fast).iter().zip(bits(&plain)).position(|(a, b)| *a != b);
            assert_eq!(differ, None, "tile at row {n0}");
            let a: Vec<f32> = (0..5 * k).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.125).collect();
            let finite: Vec<f32> = plain.iter().map(|x| if x.is_finite() { *x } else { 0.5 }).collect();
            let (mut got, mut want) = (vec![0f32; 5 * TILE], vec![0f32; 5 * TILE]);
            accumulate(&a, 5, k, &finite, &mut got, false);
            accumulate_portable(&a, 5, k, &finite, &mut want);
            assert_eq!(bits(&got), bits(&want), "accumulate at row {n0}");
        }
        assert_eq!(fill(&w, 0, TILE - 1, &mut vec![0f32; k * TILE]), None, "a partial tile");
    }

    /// Each x86 version the CPU has, called directly (the dispatch picks only the widest):
    /// the same bits as the portable code for every finite byte and scale, and for row counts
    /// that leave remainders in the accumulators.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_x86_version_gives_the_portable_bits() {
        let (n, k) = (32, 256);
        let elements: Vec<u8> = (0..n * k).map(|i| (i * 7 + i / k) as u8).map(|b| if e4m3::is_nan(b) { b ^ 1 } else { b }).collect();
        let scales: Vec<u8> = (0..n * k / BLOCK).map(|i| [0u8, 1, 100, 127, 128, 200, 246, 247, 254, 253][i % 10]).collect();
        let w = WeightView { elements: &elements, n, k, scales: ScaleView::RowMajor(&scales) };
        let mut plain = vec![0f32; k * TILE];
        fill_portable(&w, 0, TILE, &mut plain);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let finite: Vec<f32> = plain.iter().map(|x| if x.is_finite() { *x } else { 0.5 }).collect();
        let a: Vec<f32> = (0..7 * k).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.125).collect();
        let want = |rows: usize| {
            let mut want = vec![0f32; rows * TILE];
            accumulate_portable(&a, rows, k, &finite, &mut want);
            bits(&want)
        };
        if x86::available() {
            let mut wt = vec![1f32; k * TILE];
            // SAFETY: the CPU has AVX2 and F16C (checked above).
            unsafe { x86::fill(&w, 0, &mut wt) };
            assert_eq!(bits(&wt), bits(&plain), "AVX2 fill");
            for rows in 1..=7 {
                let mut got = vec![0f32; rows * TILE];
                // SAFETY: as above.
                unsafe { x86::accumulate::<false>(&a, rows, k, &finite, &mut got) };
                assert_eq!(bits(&got), want(rows), "AVX2 accumulate, {rows} rows");
            }
            // Fused multiply-adds where every product is exact: the activations are multiples of
            // 2^-3 with at most 4 significant bits (MXFP8 values), the weights' scale bytes 100 to
            // 200, so every product is a multiple of 2^-39 (well inside f32's range).
            let scales: Vec<u8> = (0..n * k / BLOCK).map(|i| 100 + (i * 37 % 101) as u8).collect();
            let w = WeightView { elements: &elements, n, k, scales: ScaleView::RowMajor(&scales) };
            let mut exact = vec![0f32; k * TILE];
            fill_portable(&w, 0, TILE, &mut exact);
            for rows in 1..=7 {
                let (mut got, mut want) = (vec![0f32; rows * TILE], vec![0f32; rows * TILE]);
                accumulate_portable(&a, rows, k, &exact, &mut want);
                // SAFETY: as above.
                unsafe { x86::accumulate::<true>(&a, rows, k, &exact, &mut got) };
                assert_eq!(bits(&got), bits(&want), "AVX2 accumulate, fused, {rows} rows");
            }
        }
        if x86_512::available() {
            let mut wt = vec![1f32; k * TILE];
            // SAFETY: the CPU has AVX-512F, AVX2 and F16C (checked above).
            unsafe { x86_512::fill(&w, 0, &mut wt) };
            assert_eq!(bits(&wt), bits(&plain), "AVX-512 fill");
            for rows in 1..=7 {
                let mut got = vec![0f32; rows * TILE];
                // SAFETY: as above.
                unsafe { x86_512::accumulate(&a, rows, k, &finite, &mut got) };
                assert_eq!(bits(&got), want(rows), "AVX-512 accumulate, {rows} rows");
            }
        }
    }
}
