//! The GEMM for a few activation rows (`T <= FUSED_MAX_ROWS`, probes and decode steps), where
//! [`super::tile`]'s dequantize-to-memory-then-accumulate spends most of its time writing and
//! re-reading f32 tiles: here a tile's E4M3 bytes are transposed as bytes in registers,
//! decoded, scaled and accumulated straight into the outputs, and nothing is stored but the
//! outputs. Where the CPU has AVX-512 BF16, [`super::dot`] takes these tiles first; this path
//! computes those it hands back and serves CPUs without it.
//!
//! The arithmetic is that of [`super::tile`], value for value: each weight is the E4M3 byte as
//! a half (the value / 256), widened to f32 and multiplied once by `256 * scale`; each output
//! sums `a * w` (a multiply, then an add) in increasing `k`. So the bits are those of every
//! other path, and a tile this path cannot take exactly (a NaN byte, a scale byte above 246) is
//! handed back to [`super::tile`]. The AVX2 version fuses each multiply with its add (one
//! `vfmadd` where two operations were) where every product is exact in f32, which
//! [`ScaleRange::exact_products`] decides from the scale bytes alone: then the fused
//! operation's one rounding is the add's, and the bits are the same. Where moreover no sum
//! rounds below `2^-126` or overflows once divided by a weight block's `256 * scale`
//! ([`ScaleRange::exact_unscaled`]), it keeps each block's sums so divided and multiplies them
//! back at the block's end, so that each weight is decoded without its multiply by the scale
//! (rounding commutes with a power of two there: the same bits again).
//!
//! While a tile is computed, the next one (the one its thread usually takes next) is
//! prefetched a block at a time: a tile reads 32 rows at once, more streams than the hardware
//! prefetchers follow, and without this the loads wait on memory (`bench-gemm` at T = 1: 10 GB/s
//! of weights without it, 23 GB/s with it, on the 2-core development VM).
//!
//! Two versions, chosen at run time on x86-64: AVX-512 F, BW and VBMI (and F16C) compute the
//! whole tile's 32 rows in two registers; AVX2 and F16C alone (AMD Zen 2 and 3, older Intel)
//! compute it 8 rows to a register, as many groups of 8 at once as leave registers for the
//! accumulators, each block's 8 x 32 bytes transposed in registers and put aside in L1 so that
//! a column's 8 bytes are one sign-extending load. Elsewhere [`tile`] declines every tile.

use super::exact::ScaleRange;
use super::{TILE, TileWeights};
use crate::mxfp8::BLOCK;

/// Activation rows up to which [`super::gemm`] takes this path: beyond it the tiled path's
/// dequantized tile is reused by enough rows to pay for itself (`bench-gemm` measures both).
pub(super) const FUSED_MAX_ROWS: usize = 8;

/// The largest scale byte whose `256 * scale` is a finite f32 (`2^(246 - 127 + 8) = 2^127`).
const MAX_FOLDED_SCALE: u8 = 246;

/// The versions of this path, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Version {
    /// AVX-512 F, BW and VBMI (and F16C): the tile's 32 rows in two registers.
    Avx512,
    /// AVX2 and F16C: 8 rows to a register.
    Avx2,
}

impl Version {
    const ALL: [Version; 2] = [Version::Avx512, Version::Avx2];

    /// Whether this CPU runs this version.
    pub(super) fn runs_here(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Version::Avx512 => avx512::available(),
                Version::Avx2 => avx2::available(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
    }

    /// The fastest version this CPU runs.
    pub(super) fn best() -> Option<Version> {
        Self::ALL.into_iter().find(|v| v.runs_here())
    }
}

/// Whether this CPU runs the fused path.
pub(super) fn available() -> bool {
    Version::best().is_some()
}

/// `out[t * TILE + j] = sum_k a[t * k + kk] * w[j, kk]` for `t < rows` over the tile `w`, where
/// `a` holds the exact values of activations whose scales lie in `a_scales`
/// ([`ScaleRange::of_activations`]). Returns false, leaving `out` unspecified, when this path cannot
/// give the exact result: no fused path on this CPU, `rows` outside `1..=FUSED_MAX_ROWS`, a NaN
/// byte or a scale byte above 246 in the tile.
pub(super) fn tile(w: &TileWeights<'_>, a: &[f32], a_scales: Option<ScaleRange>, rows: usize, out: &mut [f32]) -> bool {
    let arithmetic = match a_scales {
        Some(s) if s.exact_unscaled(w.scale_range(), w.k) => Arithmetic::Unscaled,
        Some(s) if s.exact_products(w.scale_range()) => Arithmetic::Fused,
        _ => Arithmetic::Plain,
    };
    Version::best().is_some_and(|v| tile_with(v, w, a, arithmetic, rows, out))
}

/// How the AVX2 version computes a tile (the AVX-512 version always as [`Arithmetic::Plain`]).
/// Each gives the plain loop's bits where the scale bytes allow it (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arithmetic {
    /// Each weight times its `256 * scale`, then each product, then each add.
    Plain,
    /// Each multiply and its add as one fused multiply-add: where every product is exact
    /// ([`ScaleRange::exact_products`]).
    Fused,
    /// Fused, and each block's sums kept divided by its `256 * scale`
    /// ([`ScaleRange::exact_unscaled`]).
    Unscaled,
}

/// [`tile`] with the given version and arithmetic, which declines everything where this CPU
/// does not run the version (the caller knows the arithmetic to give the plain loop's bits).
pub(super) fn tile_with(version: Version, w: &TileWeights<'_>, a: &[f32], arithmetic: Arithmetic, rows: usize, out: &mut [f32]) -> bool {
    let (e, next, k, scales) = (w.elements, w.next, w.k, w.scales);
    let fits = (1..=FUSED_MAX_ROWS).contains(&rows)
        && k.is_multiple_of(BLOCK)
        && e.len() == TILE * k
        && a.len() >= rows * k
        && out.len() >= rows * TILE
        && scales.len() == TILE * (k / BLOCK);
    if !fits || !version.runs_here() || w.max_scale > MAX_FOLDED_SCALE {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    match version {
        // SAFETY: the CPU has AVX2, FMA and F16C (`runs_here` above), and the bounds `accumulate`
        // relies on were checked above (`fits`).
        Version::Avx2 => unsafe {
            match arithmetic {
                Arithmetic::Plain => avx2::accumulate_rows::<false, false>(rows, e, next, k, scales, a, out),
                Arithmetic::Fused => avx2::accumulate_rows::<true, false>(rows, e, next, k, scales, a, out),
                Arithmetic::Unscaled => avx2::accumulate_rows::<true, true>(rows, e, next, k, scales, a, out),
            }
        },
        // SAFETY: the CPU has AVX-512 F/BW/VBMI, AVX2 and F16C (`runs_here` above), and the
        // bounds `accumulate` relies on were checked above (`fits`).
        Version::Avx512 => unsafe {
            match rows {
                1 => avx512::accumulate::<1>(e, next, k, scales, a, out),
                2 => avx512::accumulate::<2>(e, next, k, scales, a, out),
                3 => avx512::accumulate::<3>(e, next, k, scales, a, out),
                4 => avx512::accumulate::<4>(e, next, k, scales, a, out),
                5 => avx512::accumulate::<5>(e, next, k, scales, a, out),
                6 => avx512::accumulate::<6>(e, next, k, scales, a, out),
                7 => avx512::accumulate::<7>(e, next, k, scales, a, out),
                _ => avx512::accumulate::<8>(e, next, k, scales, a, out),
            }
        },
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = next;
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{BLOCK, FUSED_MAX_ROWS, TILE};

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vbmi")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("avx2")
    }

    /// Transposes sixteen 16 x 16 byte matrices, one per 128-bit lane: on return, lane `L` of
    /// `r[j]` holds byte `j` of lane `L` of every input, input `i` at byte `i`. Four rounds of
    /// unpacks (bytes, words, dwords, qwords), each pairing inputs that differ in one bit of
    /// their index, so output `j` ends as column `j` (worked through in the module tests).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn transpose_lanes(r: &mut [__m512i; 16]) {
        let a: [__m512i; 16] = std::array::from_fn(|i| {
            let (p, h) = (i / 2, i % 2);
            let (x, y) = (r[2 * p], r[2 * p + 1]);
            if h == 0 { _mm512_unpacklo_epi8(x, y) } else { _mm512_unpackhi_epi8(x, y) }
        });
        // a[2p + h]: word w holds rows 2p, 2p+1 at column 8h + w.
        let b: [__m512i; 16] = std::array::from_fn(|i| {
            let (q, h, g) = (i / 4, (i / 2) % 2, i % 2);
            let (x, y) = (a[4 * q + h], a[4 * q + 2 + h]);
            if g == 0 { _mm512_unpacklo_epi16(x, y) } else { _mm512_unpackhi_epi16(x, y) }
        });
        // b[4q + 2h + g]: dword d holds rows 4q .. 4q+3 at column 8h + 4g + d.
        let c: [__m512i; 16] = std::array::from_fn(|i| {
            let (m, hg, f) = (i / 8, (i / 2) % 4, i % 2);
            let (x, y) = (b[8 * m + hg], b[8 * m + 4 + hg]);
            if f == 0 { _mm512_unpacklo_epi32(x, y) } else { _mm512_unpackhi_epi32(x, y) }
        });
        // c[8m + 4h + 2g + f]: qword e holds rows 8m .. 8m+7 at column 8h + 4g + 2f + e.
        *r = std::array::from_fn(|i| {
            let (hgf, e) = (i / 2, i % 2);
            let (x, y) = (c[hgf], c[8 + hgf]);
            if e == 0 { _mm512_unpacklo_epi64(x, y) } else { _mm512_unpackhi_epi64(x, y) }
        });
    }

    /// `vpermb` indices that put byte `lane0 * 16 + i` in the high byte of word `i` and byte
    /// `lane1 * 16 + i` in the high byte of word `16 + i` (low bytes are zeroed by the mask).
    fn spread(lane0: usize, lane1: usize) -> [u8; 64] {
        std::array::from_fn(|p| {
            let word = p / 2;
            if word < 16 { (lane0 * 16 + word) as u8 } else { (lane1 * 16 + word - 16) as u8 }
        })
    }

    /// The tile: `e` is `TILE` rows of `k` E4M3 bytes, `scales` block-major (`[k / 32][TILE]`,
    /// every byte at most 246). False when a byte of the tile is NaN.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,f16c")]
    pub unsafe fn accumulate<const ROWS: usize>(e: &[u8], next: &[u8], k: usize, scales: &[u8], a: &[f32], out: &mut [f32]) -> bool {
        assert!(
            e.len() == TILE * k
                && scales.len() == TILE * (k / BLOCK)
                && (1..=FUSED_MAX_ROWS).contains(&ROWS)
                && a.len() >= ROWS * k
                && out.len() >= ROWS * TILE
        );
        const HALF: usize = TILE / 2;
        // SAFETY (loads below): row r + HALF < TILE and kb * BLOCK + 32 <= k, so every 32-byte
        // load lies in `e`; scale loads read 16 bytes at kb * TILE (+ 16) < scales.len().
        let ep = e.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        let mut nan = _mm512_setzero_si512();
        let high = _mm512_set1_epi8(0x80u8 as i8);
        let odd_bytes: __mmask64 = 0xAAAA_AAAA_AAAA_AAAA;
        // Half h of a block: columns 16h .. 16h + 15, in lanes h (rows 0..16) and 2 + h (rows 16..32).
        let idx = [spread(0, 2), spread(1, 3)].map(|s| unsafe { _mm512_loadu_si512(s.as_ptr().cast()) });
        let half_bits = _mm512_set1_epi16(0xBF80u16 as i16);
        let fold = _mm512_set1_epi32(8);
        for kb in 0..k / BLOCK {
            // One block's worth of the next tile (TILE * BLOCK bytes) per block of this one.
            if let Some(lines) = next.get(kb * TILE * BLOCK..(kb + 1) * TILE * BLOCK) {
                for line in lines.chunks(64) {
                    _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
                }
            }
            // r[i]: lanes 0, 1 = row i, columns 0..32 of the block; lanes 2, 3 = row i + 16.
            let mut r: [__m512i; 16] = std::array::from_fn(|i| unsafe {
                let lo = _mm256_loadu_si256(ep.add(i * k + kb * BLOCK).cast());
                let hi = _mm256_loadu_si256(ep.add((i + HALF) * k + kb * BLOCK).cast());
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
            });
            for x in &r {
                // A byte is NaN exactly when it is 0xFF once its sign bit is set.
                nan = _mm512_max_epu8(nan, _mm512_or_si512(*x, high));
            }
            transpose_lanes(&mut r);
            // 256 * scale as f32 bits: the exponent field is the scale byte + 8 (every byte <= 246,
            // byte 0 included: 2^-127 * 256 = 2^-119).
            let s: [__m512; 2] = std::array::from_fn(|g| unsafe {
                let bytes = _mm_loadu_si128(scales.as_ptr().add(kb * TILE + g * HALF).cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtepu8_epi32(bytes), fold)))
            });
            for (h, idx) in idx.iter().enumerate() {
                for (j, col) in r.iter().enumerate() {
                    // Each byte b in a word's high byte, then shifted right by one (sign copied):
                    // bits 13..7 hold b's low seven bits and bit 15 its sign, as `tile`'s
                    // sign-extend and shift left by 7 give, once bit 14 is cleared.
                    let spread = _mm512_maskz_permutexvar_epi8(odd_bytes, *idx, *col);
                    let halfs = _mm512_and_si512(_mm512_srai_epi16::<1>(spread), half_bits);
                    let w0 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(halfs)), s[0]);
                    let w1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(halfs)), s[1]);
                    let kk = kb * BLOCK + h * 16 + j;
                    for (t, acc) in acc.iter_mut().enumerate() {
                        // SAFETY: t * k + kk < ROWS * k <= a.len().
                        let av = _mm512_set1_ps(unsafe { *a.get_unchecked(t * k + kk) });
                        acc[0] = _mm512_add_ps(acc[0], _mm512_mul_ps(av, w0));
                        acc[1] = _mm512_add_ps(acc[1], _mm512_mul_ps(av, w1));
                    }
                }
            }
        }
        if _mm512_cmpeq_epi8_mask(nan, _mm512_set1_epi8(-1)) != 0 {
            return false;
        }
        for (t, acc) in acc.iter().enumerate() {
            // SAFETY: t * TILE + 32 <= ROWS * TILE <= out.len().
            unsafe {
                _mm512_storeu_ps(out.as_mut_ptr().add(t * TILE), acc[0]);
                _mm512_storeu_ps(out.as_mut_ptr().add(t * TILE + HALF), acc[1]);
            }
        }
        true
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn lanes_transpose_to_columns() {
            if !available() {
                return;
            }
            let input: [[u8; 64]; 16] = std::array::from_fn(|i| std::array::from_fn(|b| (i * 64 + b) as u8 ^ 0x5A));
            // SAFETY: the CPU has AVX-512 F and BW (checked above).
            let got = unsafe {
                let mut r = input.map(|row| _mm512_loadu_si512(row.as_ptr().cast()));
                transpose_lanes(&mut r);
                r.map(|v| {
                    let mut bytes = [0u8; 64];
                    _mm512_storeu_si512(bytes.as_mut_ptr().cast(), v);
                    bytes
                })
            };
            for (j, row) in got.iter().enumerate() {
                for lane in 0..4 {
                    for i in 0..16 {
                        assert_eq!(row[lane * 16 + i], input[i][lane * 16 + j], "output {j}, lane {lane}, byte {i}");
                    }
                }
            }
        }
    }
}

/// The fused path with AVX2 and F16C alone: 8 rows of the tile to a register of f32 lanes.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BLOCK, FUSED_MAX_ROWS, TILE};

    /// Rows of the tile in one register.
    const GROUP: usize = 8;

    /// AVX2 with F16C and FMA: every CPU with AVX2 has both (Intel from Haswell, AMD from Zen).
    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("fma")
    }

    /// One block of 8 rows once transposed: column `c`'s 8 bytes (row `i` at byte `i`) at
    /// [`column_at`]`(c)`.
    #[repr(C, align(32))]
    pub(super) struct Columns([u8; GROUP * BLOCK]);

    /// Where [`transpose`] leaves column `c`: three rounds of unpacks within each 128-bit lane
    /// (columns `16 L ..` of lane `L`) leave register `(c % 16) / 2` holding, in lane `L`, the
    /// columns `16 L + 2 ((c % 16) / 2)` and the one after it, one per 8 bytes.
    #[inline(always)]
    pub(super) const fn column_at(c: usize) -> usize {
        32 * ((c % 16) / 2) + 16 * (c / 16) + 8 * (c % 2)
    }

    /// The 8 x 32 bytes of `r` (row `i` in `r[i]`) into `out`, column by column.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn transpose(r: &[__m256i; GROUP], out: &mut Columns) {
        // a[2p + h]: word w holds rows 2p, 2p + 1 at column 16 L + 8h + w.
        let a: [__m256i; 8] = std::array::from_fn(|i| {
            let (p, h) = (i / 2, i % 2);
            if h == 0 { _mm256_unpacklo_epi8(r[2 * p], r[2 * p + 1]) } else { _mm256_unpackhi_epi8(r[2 * p], r[2 * p + 1]) }
        });
        // b[4q + 2h + g]: dword d holds rows 4q .. 4q + 3 at column 16 L + 8h + 4g + d.
        let b: [__m256i; 8] = std::array::from_fn(|i| {
            let (q, h, g) = (i / 4, (i / 2) % 2, i % 2);
            let (x, y) = (a[4 * q + h], a[4 * q + 2 + h]);
            if g == 0 { _mm256_unpacklo_epi16(x, y) } else { _mm256_unpackhi_epi16(x, y) }
        });
        // c[4h + 2g + f]: qword e holds rows 0 .. 7 at column 16 L + 8h + 4g + 2f + e.
        for i in 0..8 {
            let (hg, f) = (i / 2, i % 2);
            let (x, y) = (b[hg], b[4 + hg]);
            let c = if f == 0 { _mm256_unpacklo_epi32(x, y) } else { _mm256_unpackhi_epi32(x, y) };
            // SAFETY: 32 bytes at 32 i < 256, aligned (`Columns` is).
            unsafe { _mm256_store_si256(out.0.as_mut_ptr().add(32 * i).cast(), c) };
        }
    }

    /// [`accumulate`] for `rows` activation rows (1 to 8), as many groups of 8 weight rows at
    /// once as leave the accumulators (`rows x G` registers of 16) and the weights room.
    ///
    /// # Safety
    /// As [`accumulate`].
    pub unsafe fn accumulate_rows<const FUSE: bool, const UNSCALED: bool>(
        rows: usize,
        e: &[u8],
        next: &[u8],
        k: usize,
        scales: &[u8],
        a: &[f32],
        out: &mut [f32],
    ) -> bool {
        // SAFETY: the caller's.
        unsafe {
            match rows {
                1 => accumulate::<1, 4, FUSE, UNSCALED>(e, next, k, scales, a, out),
                2 => accumulate::<2, 2, FUSE, UNSCALED>(e, next, k, scales, a, out),
                // Unscaled, no scale stays in a register through a block's columns: room for
                // the sums of two groups at T = 3 to 5 (`bench-gemm`, the AVX2 VM, 5 or 6
                // interleaved runs each, medians: T = 3 7.0-9.0 -> 8.0-11.1 GB/s, T = 4
                // 6.7-8.9 -> 6.9-10.2, T = 5 5.3-7.7 -> 7.5-9.1; at T = 2, four groups
                // instead of two gained nothing).
                3 if UNSCALED => accumulate::<3, 2, FUSE, UNSCALED>(e, next, k, scales, a, out),
                4 if UNSCALED => accumulate::<4, 2, FUSE, UNSCALED>(e, next, k, scales, a, out),
                5 if UNSCALED => accumulate::<5, 2, FUSE, UNSCALED>(e, next, k, scales, a, out),
                3 => accumulate::<3, 1, FUSE, UNSCALED>(e, next, k, scales, a, out),
                4 => accumulate::<4, 1, FUSE, UNSCALED>(e, next, k, scales, a, out),
                5 => accumulate::<5, 1, FUSE, UNSCALED>(e, next, k, scales, a, out),
                6 => accumulate::<6, 1, FUSE, UNSCALED>(e, next, k, scales, a, out),
                7 => accumulate::<7, 1, FUSE, UNSCALED>(e, next, k, scales, a, out),
                _ => accumulate::<8, 1, FUSE, UNSCALED>(e, next, k, scales, a, out),
            }
        }
    }

    /// The tile: `e` is `TILE` rows of `k` E4M3 bytes, `scales` block-major (`[k / 32][TILE]`,
    /// every byte at most 246), `G` groups of 8 rows at a time; `FUSE`: each multiply and its
    /// add as one `vfmadd` (the caller knows every product to be exact); `UNSCALED` (with
    /// `FUSE`): each block's sums kept divided by its `256 * scale` (the caller knows them to
    /// keep their bits, and every scale byte to be at most 245). False when a byte of the tile
    /// is NaN.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub unsafe fn accumulate<const ROWS: usize, const G: usize, const FUSE: bool, const UNSCALED: bool>(
        e: &[u8],
        next: &[u8],
        k: usize,
        scales: &[u8],
        a: &[f32],
        out: &mut [f32],
    ) -> bool {
        assert!(
            e.len() == TILE * k
                && scales.len() == TILE * (k / BLOCK)
                && (1..=FUSED_MAX_ROWS).contains(&ROWS)
                && TILE.is_multiple_of(G * GROUP)
                && a.len() >= ROWS * k
                && out.len() >= ROWS * TILE
        );
        // SAFETY (loads below): row < TILE and kb * BLOCK + 32 <= k, so every 32-byte load lies
        // in `e`; scale loads read 8 bytes at kb * TILE + row0 + 8g < scales.len().
        let ep = e.as_ptr();
        let mut nan = _mm256_setzero_si256();
        let high = _mm256_set1_epi8(0x80u8 as i8);
        let half_bits = _mm256_set1_epi16(0xBF80u16 as i16);
        let fold = _mm256_set1_epi32(8);
        let unfold = _mm256_set1_epi32(246);
        let mut columns: [Columns; G] = std::array::from_fn(|_| Columns([0; GROUP * BLOCK]));
        for row0 in (0..TILE).step_by(G * GROUP) {
            let mut acc = [[_mm256_setzero_ps(); G]; ROWS];
            for kb in 0..k / BLOCK {
                // The next tile's lines of these rows at this block (two blocks to a line).
                if kb % 2 == 0 {
                    for row in row0..row0 + G * GROUP {
                        if let Some(byte) = next.get(row * k + kb * BLOCK) {
                            _mm_prefetch::<_MM_HINT_T1>(std::ptr::from_ref(byte).cast());
                        }
                    }
                }
                for (g, columns) in columns.iter_mut().enumerate() {
                    let r: [__m256i; GROUP] =
                        std::array::from_fn(|i| unsafe { _mm256_loadu_si256(ep.add((row0 + g * GROUP + i) * k + kb * BLOCK).cast()) });
                    for x in &r {
                        // A byte is NaN exactly when it is 0xFF once its sign bit is set.
                        nan = _mm256_max_epu8(nan, _mm256_or_si256(*x, high));
                    }
                    transpose(&r, columns);
                }
                // The block's scale bytes, one per row, and 256 * scale as f32 bits (see the
                // AVX-512 version).
                let bytes =
                    |g: usize| unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(scales.as_ptr().add(kb * TILE + row0 + g * GROUP).cast())) };
                let s: [__m256; G] =
                    std::array::from_fn(|g| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(bytes(g), fold))));
                if UNSCALED {
                    // The sums divided by 256 * scale = 2^(s - 119): times 2^(119 - s), whose
                    // exponent field is 246 - s (a normal f32 for s <= 245).
                    for g in 0..G {
                        let inverse = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_sub_epi32(unfold, bytes(g))));
                        for acc in acc.iter_mut() {
                            acc[g] = _mm256_mul_ps(acc[g], inverse);
                        }
                    }
                }
                // Two columns at a time (an even column and the next lie side by side): their
                // 16 bytes widened, shifted and masked at once, then a half each.
                for c in (0..BLOCK).step_by(2) {
                    let at = column_at(c);
                    let pair: [__m256i; G] = std::array::from_fn(|g| unsafe {
                        let v = _mm256_cvtepi8_epi16(_mm_load_si128(columns[g].0.as_ptr().add(at).cast()));
                        _mm256_and_si256(_mm256_slli_epi16::<7>(v), half_bits)
                    });
                    for (i, kk) in [(0, kb * BLOCK + c), (1, kb * BLOCK + c + 1)] {
                        // The E4M3 bytes as halves of value / 256 (see `tile`'s x86 decode), times
                        // 256 * scale (unscaled, not: the sums are divided by it).
                        let w: [__m256; G] = std::array::from_fn(|g| {
                            let halves = if i == 0 { _mm256_castsi256_si128(pair[g]) } else { _mm256_extracti128_si256::<1>(pair[g]) };
                            if UNSCALED { _mm256_cvtph_ps(halves) } else { _mm256_mul_ps(_mm256_cvtph_ps(halves), s[g]) }
                        });
                        for (t, acc) in acc.iter_mut().enumerate() {
                            // SAFETY: t * k + kk < ROWS * k <= a.len().
                            let av = _mm256_set1_ps(unsafe { *a.get_unchecked(t * k + kk) });
                            for (acc, w) in acc.iter_mut().zip(&w) {
                                *acc = if FUSE { _mm256_fmadd_ps(av, *w, *acc) } else { _mm256_add_ps(*acc, _mm256_mul_ps(av, *w)) };
                            }
                        }
                    }
                }
                if UNSCALED {
                    // Back to the sums themselves.
                    for acc in acc.iter_mut() {
                        for (acc, s) in acc.iter_mut().zip(&s) {
                            *acc = _mm256_mul_ps(*acc, *s);
                        }
                    }
                }
            }
            for (t, acc) in acc.iter().enumerate() {
                for (g, acc) in acc.iter().enumerate() {
                    // SAFETY: t * TILE + row0 + 8 (g + 1) <= ROWS * TILE <= out.len().
                    unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(t * TILE + row0 + g * GROUP), *acc) };
                }
            }
        }
        _mm256_movemask_epi8(_mm256_cmpeq_epi8(nan, _mm256_set1_epi8(-1))) == 0
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn blocks_transpose_to_columns() {
            if !available() {
                return;
            }
            let input: [[u8; 32]; GROUP] = std::array::from_fn(|i| std::array::from_fn(|b| (i * 32 + b) as u8 ^ 0x5A));
            let mut out = Columns([0; GROUP * BLOCK]);
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { transpose(&input.map(|row| _mm256_loadu_si256(row.as_ptr().cast())), &mut out) };
            for c in 0..BLOCK {
                for (i, row) in input.iter().enumerate() {
                    assert_eq!(out.0[column_at(c) + i], row[c], "column {c}, row {i}");
                }
            }
            // Every column has a place of its own.
            let mut at: Vec<usize> = (0..BLOCK).map(column_at).collect();
            at.sort_unstable();
            assert_eq!(at, (0..BLOCK).map(|c| 8 * c).collect::<Vec<_>>());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::{MxMatrix, ScaleView, WeightView};

    /// Every version this CPU runs (not only the one [`tile`] picks: on a CPU with AVX-512 the
    /// AVX2 version runs nowhere else), for every row count, every E4M3 byte but NaN and scales
    /// from subnormal products to the largest that fold: the plain loop's bits, tile by tile.
    #[test]
    fn every_version_gives_the_plain_loops_bits() {
        let (n, k) = (96, 256);
        let c = k / BLOCK;
        let e: Vec<u8> = (0..n * k)
            .map(|i| {
                let b = (i * 7 + i / k) as u8;
                if crate::e4m3::is_nan(b) { b ^ 1 } else { b }
            })
            .collect();
        // Tile 0 ordinary scales, tile 1 a mix of tiny, huge and ordinary ones, tile 2 tiny.
        let s: Vec<u8> = (0..n * c)
            .map(|i| match (i / c / TILE, i / c, i % c) {
                (0, row, kb) => 120 + ((kb * 5 + row) % 15) as u8,
                (1, row, kb) => [0u8, 1, 3, 127, 200, 246, 100, 128][(kb + row) % 8],
                (_, row, kb) => [0u8, 1, 3][(kb + row) % 3],
            })
            .collect();
        let w = WeightView { elements: &e, n, k, scales: ScaleView::RowMajor(&s) };
        let versions: Vec<Version> = Version::ALL.into_iter().filter(|v| v.runs_here()).collect();
        let (mut scratch, mut out) = (Vec::new(), vec![0f32; FUSED_MAX_ROWS * TILE]);
        let (mut fused_tiles, mut unscaled_tiles) = (0, 0);
        for rows in 1..=FUSED_MAX_ROWS {
            let v: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37).collect();
            let a = MxMatrix::quantize(&v, k, crate::mxfp8::ScaleRule::Rceil).unwrap();
            let want = bits(&crate::gemm::gemm_reference(&a, &w).unwrap());
            let a_scales = ScaleRange::of_activations(&a).expect("finite activations");
            let a = a.dequantize();
            for n0 in (0..n).step_by(TILE) {
                for &version in &versions {
                    let t = TileWeights::gather(&w, n0, &mut scratch).unwrap();
                    // Fused multiply-adds only where the products are exact, unscaled sums only
                    // where they keep their bits (tiles 0 and 2 here, both).
                    let (fused, unscaled) = (a_scales.exact_products(t.scale_range()), a_scales.exact_unscaled(t.scale_range(), k));
                    let arithmetics = [(Arithmetic::Plain, true), (Arithmetic::Fused, fused), (Arithmetic::Unscaled, unscaled)];
                    for arithmetic in arithmetics.into_iter().filter_map(|(a, allowed)| allowed.then_some(a)) {
                        fused_tiles += usize::from(arithmetic == Arithmetic::Fused);
                        unscaled_tiles += usize::from(arithmetic == Arithmetic::Unscaled);
                        assert!(tile_with(version, &t, &a, arithmetic, rows, &mut out), "{version:?} took no tile at {n0}, {rows} rows");
                        for r in 0..rows {
                            assert_eq!(
                                bits(&out[r * TILE..][..TILE]),
                                want[r * n + n0..][..TILE],
                                "{version:?}, {arithmetic:?}, {rows} rows, tile at {n0}, row {r}"
                            );
                        }
                    }
                }
            }
        }
        assert_eq!(
            fused_tiles,
            2 * FUSED_MAX_ROWS * versions.len(),
            "tiles 0 and 2 fuse, tile 1 (a product could pass f32's range) does not"
        );
        assert_eq!(unscaled_tiles, 2 * FUSED_MAX_ROWS * versions.len(), "tiles 0 and 2 keep their sums unscaled, tile 1 does not");
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| if x.is_nan() { f32::NAN.to_bits() } else { x.to_bits() }).collect()
    }

    /// One activation row `a` at scale byte `sa` against a tile whose every row is `w` at scale
    /// bytes `sw` (one per block, in turn), row `j` rotated by `3 j` and its every fifth byte
    /// negated: whether `arithmetic` is allowed there ([`ScaleRange::exact_products`] or
    /// [`ScaleRange::exact_unscaled`]), what the plain loop gives and what the AVX2 version
    /// gives with it (None where the CPU has no AVX2).
    fn computed_at(arithmetic: Arithmetic, a: &[u8], sa: u8, w: &[u8], sw: &[u8]) -> (bool, Vec<u32>, Option<Vec<u32>>) {
        let k = a.len();
        let e: Vec<u8> = (0..TILE * k).map(|i| w[(i % k + i / k * 3) % k] | u8::from(i % 5 == 4) << 7).collect();
        let scales: Vec<u8> = sw.iter().copied().cycle().take(TILE * k / BLOCK).collect();
        let w = WeightView { elements: &e, n: TILE, k, scales: ScaleView::RowMajor(&scales) };
        let a = MxMatrix { elements: a.to_vec(), scales: vec![sa; k / BLOCK], rows: 1, k };
        let want = bits(&crate::gemm::gemm_reference(&a, &w).unwrap());
        let mut scratch = Vec::new();
        let t = TileWeights::gather(&w, 0, &mut scratch).unwrap();
        let a_scales = ScaleRange::of_activations(&a).unwrap();
        let allowed = match arithmetic {
            Arithmetic::Plain => true,
            Arithmetic::Fused => a_scales.exact_products(t.scale_range()),
            Arithmetic::Unscaled => a_scales.exact_unscaled(t.scale_range(), k),
        };
        let mut out = vec![0f32; TILE];
        let got = Version::Avx2.runs_here().then(|| {
            assert!(tile_with(Version::Avx2, &t, &a.dequantize(), arithmetic, 1, &mut out));
            bits(&out)
        });
        (allowed, want, got)
    }

    /// Asserts that `arithmetic` is allowed at these scale bytes and gives the plain loop's bits
    /// there (where the CPU has AVX2).
    fn assert_exact_at(arithmetic: Arithmetic, a: &[u8], sa: u8, w: &[u8], sw: &[u8]) {
        let (allowed, want, got) = computed_at(arithmetic, a, sa, w, sw);
        assert!(allowed, "{arithmetic:?} at scale bytes {sa}, {sw:?}");
        if let Some(got) = got {
            assert_eq!(got, want, "{arithmetic:?} at scale bytes {sa}, {sw:?}");
        }
    }

    /// Asserts that `arithmetic` is not allowed at these scale bytes and would give other bits
    /// than the plain loop there (where the CPU has AVX2).
    fn assert_inexact_at(arithmetic: Arithmetic, a: &[u8], sa: u8, w: &[u8], sw: &[u8]) {
        let (allowed, want, got) = computed_at(arithmetic, a, sa, w, sw);
        assert!(!allowed, "{arithmetic:?} at scale bytes {sa}, {sw:?}");
        if let Some(got) = got {
            assert_ne!(got, want, "{arithmetic:?} at scale bytes {sa}, {sw:?} rounds where the plain loop does not");
        }
    }

    /// Every non-NaN E4M3 byte (256 activations) and every magnitude twice (256 weights, each
    /// also negated in some rows by [`computed_at`]).
    fn every_byte() -> (Vec<u8>, Vec<u8>) {
        let every: Vec<u8> = (0..=255u8).filter(|&b| !crate::e4m3::is_nan(b)).chain([0, 0]).collect();
        let magnitudes: Vec<u8> = (0..0x7F).chain([0]).collect();
        assert_eq!((every.len(), magnitudes.len()), (256, 128));
        (every, magnitudes.iter().cycle().take(256).copied().collect())
    }

    /// Two activations at E4M3's least subnormal `2^-9` against weights `2^-8` and `2^-9` (the
    /// rest zero): two products a factor of two apart at the bottom of the range.
    fn two_least_products() -> (Vec<u8>, Vec<u8>) {
        let (mut a, mut w) = (vec![0u8; 32], vec![0u8; 32]);
        a[..2].copy_from_slice(&[0x01, 0x01]);
        w[..2].copy_from_slice(&[0x02, 0x01]);
        (a, w)
    }

    /// The bounds of [`ScaleRange::exact_products`]: at scale sums of 123 and 364 every
    /// E4M3 byte times every other (but NaN) gives the plain loop's bits with fused
    /// multiply-adds; at 122 a product of `2^-150` rounds to 0 on its own, while the fused
    /// operation adds it to `2^-149` and rounds the tie up to `2^-148`.
    #[test]
    fn fused_multiply_adds_give_the_plain_loops_bits_exactly_where_products_are_exact() {
        // Every non-NaN byte as an activation, against every weight byte at some column.
        let (every, weights) = every_byte();
        for (sa, sw) in [(0, 123), (123, 0), (61, 62), (118, 246), (246, 118), (182, 182), (127, 127)] {
            assert_exact_at(Arithmetic::Fused, &every, sa, &weights, &[sw]);
        }
        // At scales summing to 122, 2^-9 * 2^-8 is 2^-149 and 2^-9 * 2^-9 2^-150.
        let (a, w) = two_least_products();
        assert_inexact_at(Arithmetic::Fused, &a, 61, &w, &[61]);
        assert_exact_at(Arithmetic::Fused, &a, 61, &w, &[62]);
        // Above 364 a product can pass f32's largest value.
        assert!(!computed_at(Arithmetic::Fused, &every, 246, &weights, &[119]).0, "scale bytes 246 + 119");
    }

    /// The bounds of [`ScaleRange::exact_unscaled`]: at `sa_min + sw_min - sw_max = 4` (one
    /// weight scale, and scales that differ block by block), at the largest scale byte and sums
    /// it allows (each bound of the sums met), every E4M3 byte times every other gives the
    /// plain loop's bits with sums kept divided by `256 * scale`; at 3 a sum `2^-149 + 2^-150`
    /// rounds (to `2^-148`) once divided where the plain loop's `2^-148 + 2^-149` is exact; and
    /// far past the bound of the divided sums, they overflow where the plain loop's do not.
    #[test]
    fn unscaled_sums_give_the_plain_loops_bits_exactly_where_they_keep_them() {
        let (every, weights) = every_byte();
        let cases: [(u8, &[u8]); 7] = [
            (4, &[119]),
            (14, &[110, 120]),
            (14, &[120, 110, 115, 120]),
            (127, &[127]),
            (20, &[245]),
            (109, &[245, 148]),
            (200, &[135, 100]),
        ];
        for (sa, sw) in cases {
            assert_exact_at(Arithmetic::Unscaled, &every, sa, &weights, sw);
        }
        // Activations 2^-133 (scale byte 3), weights 2^-15 and 2^-16 (scale byte 120): the
        // plain loop's products are 2^-148 and 2^-149, divided by 256 * scale = 2 they are
        // 2^-149 and 2^-150.
        let (a, w) = two_least_products();
        assert_inexact_at(Arithmetic::Unscaled, &a, 3, &w, &[120]);
        assert_exact_at(Arithmetic::Fused, &a, 3, &w, &[120]);
        assert_exact_at(Arithmetic::Unscaled, &a, 4, &w, &[119]);
        // Weights at 246: 1 / (256 * scale) is below f32's normal range.
        assert!(!computed_at(Arithmetic::Unscaled, &every, 20, &weights, &[246]).0);
        // The largest activations (448 * 2^119) against the least scale of weights (2^-127):
        // products of 2^9.6, but 2^128.6 once divided by 256 * scale = 2^-119, past f32.
        let largest = vec![0x7Eu8; 256];
        assert_inexact_at(Arithmetic::Unscaled, &largest, 246, &largest, &[0]);
        assert_exact_at(Arithmetic::Fused, &largest, 246, &largest, &[0]);
    }

    /// What the fused path declines, it declines whole: a NaN byte anywhere in the tile, a scale
    /// byte above 246, a partial tile, or more rows than it takes (the tiled path computes
    /// those). What it takes, it computes.
    #[test]
    fn the_fused_path_declines_exactly_the_tiles_it_cannot_compute_exactly() {
        let (n, k) = (64, 128);
        let e: Vec<u8> = (0..n * k).map(|i| (i * 5 % 0x7E) as u8).collect();
        let s = vec![127u8; n * k / BLOCK];
        let a = vec![0.5f32; FUSED_MAX_ROWS * 2 * k];
        let (mut scratch, mut out) = (Vec::new(), vec![0f32; 2 * FUSED_MAX_ROWS * TILE]);
        let mut takes = |e: &[u8], s: &[u8], rows: usize, n0: usize, n: usize| {
            let w = WeightView { elements: &e[..n * k], n, k, scales: ScaleView::RowMajor(&s[..n * k / BLOCK]) };
            TileWeights::gather(&w, n0, &mut scratch).is_some_and(|t| tile(&t, &a, None, rows, &mut out))
        };
        for rows in 1..=FUSED_MAX_ROWS {
            assert_eq!(takes(&e, &s, rows, 32, n), available(), "{rows} rows");
            let mut nan = e.clone();
            nan[32 * k + 5] = 0x7F;
            assert!(!takes(&nan, &s, rows, 32, n), "{rows} rows, a NaN byte");
        }
        assert!(!takes(&e, &s, FUSED_MAX_ROWS + 1, 0, n), "too many rows");
        assert!(!takes(&e, &s, 0, 0, n), "no rows");
        assert!(!takes(&e, &s, 1, 32, 48), "a partial tile");
        for (at, byte) in [(32 * k + 5, 0x7Fu8), (63 * k + k - 1, 0xFF)] {
            let mut nan = e.clone();
            nan[at] = byte;
            assert!(!takes(&nan, &s, 1, 32, n), "NaN {byte:#x} at {at}");
            assert_eq!(takes(&nan, &s, 1, 0, n), available(), "the other tile has no NaN");
        }
        let mut big = s.clone();
        big[(32 + 7) * (k / BLOCK) + 3] = MAX_FOLDED_SCALE + 1;
        assert!(!takes(&e, &big, 1, 32, n), "a scale above 246");
        big[(32 + 7) * (k / BLOCK) + 3] = MAX_FOLDED_SCALE;
        assert_eq!(takes(&e, &big, 1, 32, n), available(), "246 folds");
    }
}
