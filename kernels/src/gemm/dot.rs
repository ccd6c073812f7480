//! The GEMM for up to 16 activation rows on CPUs with AVX-512 BF16, where [`super::fused`]'s
//! multiply and add per weight and row leaves the cores short of arithmetic (`bench-gemm`: T = 8
//! at 0.17x the read roof): here one `vdpbf16ps` does the work of 32 of those pairs.
//!
//! Why the bits do not change. Both operands are MXFP8: an E4M3 value (4 significant bits)
//! times a power of two. Each is therefore exactly a BF16 number (8 significant bits) when it is
//! a normal one, and the product of two is exact in f32 (8 significant bits). `vdpbf16ps` adds
//! the two products of a pair of BF16 lanes to its f32 accumulator one after the other, the high
//! lane's first, each add rounded to nearest even: the same sequence of f32 adds of exact products
//! that the plain loop performs (a multiply, rounded but exact, then an add), as long as the high
//! lane holds `k` and the low lane `k + 1`.
//!
//! The weights go into the instruction without their block scales: each E4M3 value as BF16, and
//! the sums of a block kept divided by its scale, per row (lane): entering block `b` multiplies
//! them by `2^(s[b-1] - s[b])`, and after the last block by `2^(s[last] - 127)`. A power of two
//! moves every partial sum and every rounding by the same exponent, so the bits come out the
//! plain loop's as long as no value, in either scaling, leaves the normal range; and what the
//! instruction does differently (inputs and results below the normal range read and written as
//! zero) then cannot happen either. With `m`, `M` the smallest and largest scale byte of the
//! tile, `e`, `E` the unbiased exponents of the smallest and largest nonzero activation
//! magnitude, and `2^l >= k`, the tile must satisfy:
//!
//! - `10 <= m`, `M <= 246`, and no activation is subnormal;
//! - `m + e >= 13`: the finest step of any product, `2^(m - 136) * 2^(e - 3)` (E4M3's finest step
//!   is `2^-9`, an MXFP8 activation has 4 significant bits), is at least `2^-126`, so every
//!   partial sum, a multiple of it, is zero or normal;
//! - `m - M + e >= -114`: the same step divided by the largest scale (a block's domain) is too;
//! - `M + E + l <= 243`: each product is below `2^(M - 118 + E)` (E4M3 magnitudes are below
//!   `2^9`), so every partial sum stays below `2^126`;
//! - `M - m + E + l <= 116`: and below `2^126` when divided by the smallest scale.
//!
//! The factors themselves are then normal powers of two, and every sum finite. The scales
//! cost two multiplies per row and block, where adding each scale to the weights' exponents cost
//! four operations per decoded pair of columns (single thread, weights in cache: 1.07-1.23x at
//! T = 1 and 2, 0.92-1.13x at T = 4 to 16, within the noise).
//!
//! A tile outside those bounds, with a NaN byte, or with an output that is not finite, is handed
//! back to the other paths. On top of the CPU flag, the instruction's order and rounding are
//! checked once per process against the scalar sequence ([`available`]): a CPU that rounds the
//! pair once, or adds the low lane first, never takes this path.
//!
//! Decoding a block of a 32-row tile (32 columns): the rows' bytes are loaded as 16 registers,
//! the two bytes of each column pair swapped (so that `k` lands in the high lane), transposed as
//! 16-bit pairs in two 8 x 8 word transposes, and regrouped so that each register holds one pair
//! of columns of all 32 rows. Two 128-entry byte tables (`vpermi2b`) give the low and the high
//! byte of each E4M3 magnitude as BF16, and the sign is put back (the scales: above). The NaN bytes are the only ones whose low table byte
//! is `0xFF`, which one maximum per register finds. For one or two activation rows each pair is
//! added to the sums as it is decoded, in increasing `k` (the sums stay in registers). For more,
//! a block's pairs are kept, and added, in increasing `k`, one beside each pair of the next block
//! being decoded (the decode and the dot products overlap), to the sums of up to eight rows
//! in registers; further rows add the kept pairs after.

use super::{TILE, TileWeights};
use crate::mxfp8::BLOCK;

/// Activation rows up to which [`super::gemm`] takes this path.
pub(super) const DOT_MAX_ROWS: usize = 16;

/// Whether this CPU has the instructions and rounds `vdpbf16ps` as the plain loop does.
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static CHECKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *CHECKED.get_or_init(|| avx512::has_instructions() && avx512::rounds_as_the_plain_loop())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The activations as BF16 pairs, `pairs[t * k / 2 + i]` holding column `2i` in its high half and
/// `2i + 1` in its low half, with the range of their exponents.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Activations {
    pairs: Vec<u32>,
    rows: usize,
    k: usize,
    /// Unbiased exponents of the smallest and the largest nonzero magnitude.
    min_exp: i32,
    max_exp: i32,
}

impl Activations {
    /// `None` when the rows cannot take this path: more than [`DOT_MAX_ROWS`] of them, an odd
    /// `k`, or a value that is not exactly a normal BF16 number or zero. The plain definition
    /// that [`Activations::from_mx`] is checked against.
    #[cfg(test)]
    pub(super) fn new(a: &[f32], rows: usize, k: usize) -> Option<Self> {
        if !Self::takes(rows, k) || a.len() < rows * k {
            return None;
        }
        let (mut min_exp, mut max_exp) = (i32::MAX, i32::MIN);
        let mut pairs = Vec::with_capacity(rows * k / 2);
        for pair in a[..rows * k].chunks_exact(2) {
            for x in pair {
                let bits = x.to_bits();
                let field = (bits >> 23) & 0xFF;
                if bits & 0x7FFF_FFFF == 0 {
                    continue;
                }
                if bits & 0xFFFF != 0 || field == 0 || field == 0xFF {
                    return None;
                }
                min_exp = min_exp.min(field as i32 - 127);
                max_exp = max_exp.max(field as i32 - 127);
            }
            pairs.push((pair[0].to_bits() & 0xFFFF_0000) | (pair[1].to_bits() >> 16));
        }
        if min_exp > max_exp {
            // All zero: any scale in range gives exact zero products.
            (min_exp, max_exp) = (0, 0);
        }
        Some(Self { pairs, rows, k, min_exp, max_exp })
    }

    /// What [`Activations::new`] gives on the exact values of `a`, made from its MXFP8 bytes a
    /// block at a time in registers (with 16 rows of `wo_a`'s 4096 columns, dequantizing to a
    /// copy and checking it value by value took a tenth of the GEMM on one thread, and a scalar
    /// loop over the bytes 15%).
    pub(super) fn from_mx(a: &super::MxMatrix) -> Option<Self> {
        let (rows, k) = (a.rows, a.k);
        if !Self::takes(rows, k) || a.elements.len() < rows * k || a.scales.len() < rows * k / BLOCK {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let mut pairs = vec![0u32; rows * k / 2];
            // SAFETY: `takes` checked `available` (the CPU has the instructions); the lengths
            // were checked above.
            let (min_field, max_field, usable) =
                unsafe { avx512::pack(&a.elements[..rows * k], &a.scales[..rows * k / BLOCK], &mut pairs) };
            if !usable {
                return None;
            }
            // All zero: any scale in range gives exact zero products.
            let (min_exp, max_exp) = if min_field > max_field { (0, 0) } else { (min_field as i32 - 127, max_field as i32 - 127) };
            Some(Self { pairs, rows, k, min_exp, max_exp })
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            None
        }
    }

    fn takes(rows: usize, k: usize) -> bool {
        (1..=DOT_MAX_ROWS).contains(&rows) && k.is_multiple_of(BLOCK) && available()
    }

    /// Whether weight scales `min ..= max` keep every product and partial sum normal and finite,
    /// both as the plain loop sums them and divided by any block's scale (module docs).
    fn admits(&self, min_scale: u8, max_scale: u8) -> bool {
        let (min, max) = (i32::from(min_scale), i32::from(max_scale));
        // Partial sums are below k times the largest product: 2^log2_k of them.
        let log2_k = (usize::BITS - self.k.saturating_sub(1).leading_zeros()) as i32;
        (10..=246).contains(&min)
            && max <= 246
            && min + self.min_exp >= 13
            && min - max + self.min_exp >= -114
            && max + self.max_exp + log2_k <= 243
            && max - min + self.max_exp + log2_k <= 116
    }
}

/// `out[t * TILE + j] = sum_k a[t, k] * w[j, k]` over the tile `w`. False, leaving `out`
/// unspecified, when this path cannot give the plain loop's bits (module docs).
pub(super) fn tile(w: &TileWeights<'_>, a: &Activations, out: &mut [f32]) -> bool {
    let k = a.k;
    let fits = w.k == k && w.elements.len() == TILE * k && w.scales.len() == TILE * (k / BLOCK) && out.len() >= a.rows * TILE;
    if !fits || !a.admits(w.min_scale, w.max_scale) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `Activations` exist only where `available` holds (the CPU has the
        // instructions), and the bounds `accumulate` relies on were checked above.
        unsafe { avx512::accumulate(w.elements, w.next, w.scales, a, out) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Activations, BLOCK, TILE};
    use crate::e4m3;

    pub fn has_instructions() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vbmi")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }

    /// Output rows of the accumulator lanes: a decoded register's dword `d` is row `LOW_ROWS[d]`
    /// (the first one of a pair of registers) or `HIGH_ROWS[d]` (the second), as the regrouping
    /// in [`decode_block`] leaves them.
    const LOW_ROWS: [usize; 16] = [0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27];
    const HIGH_ROWS: [usize; 16] = [4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31];

    /// For each output row, its lane in the two accumulator registers taken as one of 32 lanes
    /// (`vpermt2ps` indices): lane `d` of the low register, or `16 + d` of the high one.
    const ROW_LANES: [i32; TILE] = {
        let mut lanes = [0i32; TILE];
        let mut d = 0;
        while d < 16 {
            lanes[LOW_ROWS[d]] = d as i32;
            lanes[HIGH_ROWS[d]] = 16 + d as i32;
            d += 1;
        }
        lanes
    };

    /// The byte constants of a decode, made once per process rather than once per tile.
    struct Bytes {
        /// The BF16 bits of each E4M3 magnitude (index: the byte's low seven bits), low bytes
        /// and high bytes; the NaN magnitude `0x7F` gets low byte `0xFF`, which no value's has
        /// (a value's BF16 mantissa has at most its top three bits set).
        low: [u8; 128],
        high: [u8; 128],
        /// `vpshufb` indices swapping the two bytes of each 16-bit word.
        swap: [u8; 64],
        /// `vpermb` indices putting the scale byte of the row of each dword of a low (high)
        /// register in its bytes (the lowest one is kept).
        scale_index: [[u8; 64]; 2],
    }

    fn bytes() -> &'static Bytes {
        static BYTES: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
        BYTES.get_or_init(|| {
            let (mut low, mut high) = ([0u8; 128], [0u8; 128]);
            for b in 0..128u8 {
                let bits = if e4m3::is_nan(b) { 0x00FF } else { (e4m3::to_f32(b).to_bits() >> 16) as u16 };
                low[b as usize] = bits as u8;
                high[b as usize] = (bits >> 8) as u8;
            }
            Bytes {
                low,
                high,
                swap: std::array::from_fn(|b| (b ^ 1) as u8),
                scale_index: [LOW_ROWS, HIGH_ROWS].map(|rows| std::array::from_fn(|b| rows[b / 4] as u8)),
            }
        })
    }

    /// Each 32-byte block of `elements` times its scale byte in `scales`, as BF16 pairs into
    /// `pairs` (16 per block): the smallest and largest exponent field of a nonzero value, and
    /// whether every value is zero or a normal BF16 number (no NaN byte, no product outside the
    /// normal range). The products are those of the plain dequantization (an E4M3 value as f32
    /// times the scale as f32, one rounding, here exact or caught by the range check).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub unsafe fn pack(elements: &[u8], scales: &[u8], pairs: &mut [u32]) -> (u32, u32, bool) {
        assert!(elements.len() == scales.len() * BLOCK && pairs.len() == elements.len() / 2);
        let b = bytes();
        // SAFETY: each slice holds 64 bytes.
        let load = |t: &[u8]| unsafe { _mm512_loadu_si512(t[..64].as_ptr().cast()) };
        let (low, high) = ([load(&b.low[..64]), load(&b.low[64..])], [load(&b.high[..64]), load(&b.high[64..])]);
        // Byte 2j of a word takes low byte j, byte 2j + 1 high byte j (from the second table).
        let words = _mm512_set_epi8(
            95, 31, 94, 30, 93, 29, 92, 28, 91, 27, 90, 26, 89, 25, 88, 24, 87, 23, 86, 22, 85, 21, 84, 20, 83, 19, 82, 18, 81, 17, 80, 16,
            79, 15, 78, 14, 77, 13, 76, 12, 75, 11, 74, 10, 73, 9, 72, 8, 71, 7, 70, 6, 69, 5, 68, 4, 67, 3, 66, 2, 65, 1, 64, 0,
        );
        // Pair i: its low word the high word of value 2i + 1 (word 4i + 3 of the two registers
        // of f32 values), its high word that of value 2i (word 4i + 1).
        let pair_words: [u16; 32] = std::array::from_fn(|w| if w % 2 == 0 { (2 * w + 3) as u16 } else { (2 * w - 1) as u16 });
        // SAFETY: 32 words.
        let pair_words = unsafe { _mm512_loadu_si512(pair_words.as_ptr().cast()) };
        let (sign, magnitude) = (_mm512_set1_epi8(0x80u8 as i8), _mm512_set1_epi8(0x7F));
        let (low16, abs, field_mask, one, top) = (
            _mm512_set1_epi32(0xFFFF),
            _mm512_set1_epi32(0x7FFF_FFFF),
            _mm512_set1_epi32(0xFF),
            _mm512_set1_epi32(1),
            _mm512_set1_epi32(253),
        );
        let (mut min, mut max) = (_mm512_set1_epi32(-1), _mm512_setzero_si512());
        let mut unusable = false;
        for ((block, &scale), out) in elements.chunks_exact(BLOCK).zip(scales).zip(pairs.chunks_exact_mut(BLOCK / 2)) {
            // SAFETY: 32 bytes.
            let x = unsafe { _mm256_loadu_si256(block.as_ptr().cast()) };
            let x = _mm512_zextsi256_si512(x);
            // NaN bytes (the upper half, zero, has none).
            unusable |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(x, magnitude), magnitude) != 0;
            let lo = _mm512_permutex2var_epi8(low[0], x, low[1]);
            let hi = _mm512_ternarylogic_epi32::<0xF8>(_mm512_permutex2var_epi8(high[0], x, high[1]), x, sign);
            let bf16 = _mm512_permutex2var_epi8(lo, words, hi);
            let scale = _mm512_set1_ps(crate::e8m0::to_f32(scale));
            // (A loop rather than `map` over the halves: the closure was not inlined.)
            let halves = [_mm512_castsi512_si256(bf16), _mm512_extracti64x4_epi64::<1>(bf16)];
            let mut values = [_mm512_setzero_si512(); 2];
            for (v, half) in values.iter_mut().zip(halves) {
                let widened = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half));
                *v = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(widened), scale));
                let nonzero = _mm512_test_epi32_mask(*v, abs);
                let field = _mm512_and_si512(_mm512_srli_epi32::<23>(*v), field_mask);
                // Low mantissa bits, or an exponent field of 0 or 255 (field - 1 above 253).
                let off = _mm512_test_epi32_mask(*v, low16) | _mm512_cmpgt_epu32_mask(_mm512_sub_epi32(field, one), top);
                unusable |= nonzero & off != 0;
                min = _mm512_mask_min_epu32(min, nonzero, min, field);
                max = _mm512_mask_max_epu32(max, nonzero, max, field);
            }
            // SAFETY: 16 dwords.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), _mm512_permutex2var_epi16(values[0], pair_words, values[1])) };
        }
        (_mm512_reduce_min_epu32(min), _mm512_reduce_max_epu32(max), !unusable)
    }

    /// Runs `vdpbf16ps` on lanes whose exact products make its order and rounding visible
    /// (sums that round differently when both products are added at once, or the low lane
    /// first), and compares with the scalar sequence.
    pub fn rounds_as_the_plain_loop() -> bool {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut value = |scale: i32| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            e4m3::to_f32(state as u8 & 0xFE) * crate::e8m0::pow2(scale)
        };
        let bf16 = |x: f32| x.to_bits() >> 16;
        for round in 0..64 {
            let (sw, sx) = (round % 24 - 12, (round * 7) % 24 - 12);
            let mut lanes = [(0f32, 0u32, 0u32, 0f32); 16];
            for lane in &mut lanes {
                let (start, w_hi, w_lo, x_hi, x_lo) = (value(sw + sx + 2), value(sw), value(sw), value(sx), value(sx));
                let want = (start + x_hi * w_hi) + x_lo * w_lo;
                *lane = (start, (bf16(w_hi) << 16) | bf16(w_lo), (bf16(x_hi) << 16) | bf16(x_lo), want);
            }
            // SAFETY: the caller checked `has_instructions` first (`available`).
            let got = unsafe { dot_once(lanes.map(|l| l.0), lanes.map(|l| l.1), lanes.map(|l| l.2)) };
            if got.map(f32::to_bits) != lanes.map(|l| l.3.to_bits()) {
                return false;
            }
        }
        true
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dot_once(starts: [f32; 16], w: [u32; 16], x: [u32; 16]) -> [f32; 16] {
        let mut out = [0f32; 16];
        // SAFETY: each array holds 16 lanes of 4 bytes.
        unsafe {
            let acc = _mm512_loadu_ps(starts.as_ptr());
            let w: __m512bh = std::mem::transmute(_mm512_loadu_si512(w.as_ptr().cast()));
            let x: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.as_ptr().cast()));
            _mm512_storeu_ps(out.as_mut_ptr(), _mm512_dpbf16_ps(acc, w, x));
        }
        out
    }

    /// An 8 x 8 transpose of 16-bit words in each 128-bit lane: on return, lane `L` of `x[p]`
    /// holds word `p` of lane `L` of every input, input `i` at word `i`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn transpose_words(x: &mut [__m512i; 8]) {
        let a: [__m512i; 8] = std::array::from_fn(|i| {
            let (m, h) = (i / 2, i % 2);
            if h == 0 { _mm512_unpacklo_epi16(x[2 * m], x[2 * m + 1]) } else { _mm512_unpackhi_epi16(x[2 * m], x[2 * m + 1]) }
        });
        // a[2m + h]: dword d holds inputs 2m, 2m+1 at word 4h + d.
        let b: [__m512i; 8] = std::array::from_fn(|i| {
            let (q, h, g) = (i / 4, (i / 2) % 2, i % 2);
            let (u, v) = (a[4 * q + h], a[4 * q + 2 + h]);
            if g == 0 { _mm512_unpacklo_epi32(u, v) } else { _mm512_unpackhi_epi32(u, v) }
        });
        // b[4q + 2h + g]: qword e holds inputs 4q .. 4q+3 at word 4h + 2g + e.
        *x = std::array::from_fn(|i| {
            let (hg, e) = (i / 2, i % 2);
            if e == 0 { _mm512_unpacklo_epi64(b[hg], b[4 + hg]) } else { _mm512_unpackhi_epi64(b[hg], b[4 + hg]) }
        });
    }

    /// The constants of a decode.
    struct Decoder {
        low: [__m512i; 2],
        high: [__m512i; 2],
        sign: __m512i,
        swap: __m512i,
        scale_index: [__m512i; 2],
    }

    impl Decoder {
        /// The scale byte of each accumulator lane's row in block `scales` (its 32 rows' bytes,
        /// in row order), one per dword: the low register's rows, then the high one's.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
        unsafe fn lane_scales(&self, scales: *const u8) -> [__m512i; 2] {
            // SAFETY: 32 scale bytes at `scales` (the caller's bounds).
            let s = unsafe { _mm512_castsi256_si512(_mm256_loadu_si256(scales.cast())) };
            const BYTE_0: u64 = 0x1111_1111_1111_1111;
            [_mm512_maskz_permutexvar_epi8(BYTE_0, self.scale_index[0], s), _mm512_maskz_permutexvar_epi8(BYTE_0, self.scale_index[1], s)]
        }

        #[target_feature(enable = "avx512f,avx512bw")]
        fn new() -> Self {
            let b = bytes();
            // SAFETY: each slice holds 64 bytes.
            let load = |t: &[u8]| unsafe { _mm512_loadu_si512(t[..64].as_ptr().cast()) };
            Self {
                low: [load(&b.low[..64]), load(&b.low[64..])],
                high: [load(&b.high[..64]), load(&b.high[64..])],
                sign: _mm512_set1_epi8(0x80u8 as i8),
                swap: load(&b.swap),
                scale_index: [load(&b.scale_index[0]), load(&b.scale_index[1])],
            }
        }

        /// The 16 column pairs of the block whose 32 bytes of row `i` lie at `ep + i * stride`,
        /// as BF16 E4M3 values without their scales: `pair(i, lo, hi)` gets pair `i` (columns
        /// `2i`, `2i + 1`: `k` in each dword's high half) of the rows [`LOW_ROWS`] (`lo`) and
        /// [`HIGH_ROWS`] (`hi`). Returns `nan` raised to `0xFF` in some byte when the block has a
        /// NaN byte.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
        unsafe fn block<const IN_ORDER: bool>(
            &self,
            ep: *const u8,
            stride: usize,
            mut pair: impl FnMut(usize, __m512i, __m512i),
            mut nan: __m512i,
        ) -> __m512i {
            const HALF: usize = TILE / 2;
            // r[i]: lanes 0, 1 = row i, columns 0..32 of the block; lanes 2, 3 = row i + 16; the
            // bytes of each column pair swapped. SAFETY: 32 readable bytes at each row (the
            // caller's bounds).
            let r: [__m512i; 16] = std::array::from_fn(|i| unsafe {
                let lo = _mm256_loadu_si256(ep.add(i * stride).cast());
                let hi = _mm256_loadu_si256(ep.add((i + HALF) * stride).cast());
                _mm512_shuffle_epi8(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi), self.swap)
            });
            // Group a: rows 0..8 and 16..24; group b: rows 8..16 and 24..32. After the
            // transposes, lane 0 of a[p] holds pair p of rows 0..8, lane 1 pair 8 + p, lane 2
            // pair p of rows 16..24, lane 3 pair 8 + p of them.
            let mut a: [__m512i; 8] = std::array::from_fn(|i| r[i]);
            let mut b: [__m512i; 8] = std::array::from_fn(|i| r[8 + i]);
            transpose_words(&mut a);
            transpose_words(&mut b);
            // Pairs in increasing `k`: pair p of all 32 rows (lanes: rows 0..8, 16..24, 8..16,
            // 24..32) is in lanes 0 and 2 of a[p] and b[p], pair 8 + p in lanes 1 and 3.
            let mut decode = |half: usize, p: usize| {
                let x = match half {
                    0 => _mm512_shuffle_i64x2::<0x88>(a[p], b[p]),
                    _ => _mm512_shuffle_i64x2::<0xDD>(a[p], b[p]),
                };
                let low = _mm512_permutex2var_epi8(self.low[0], x, self.low[1]);
                nan = _mm512_max_epu8(nan, low);
                // The magnitude's high byte with the sign put back: high | (x & 0x80).
                let high = _mm512_ternarylogic_epi32::<0xF8>(_mm512_permutex2var_epi8(self.high[0], x, self.high[1]), x, self.sign);
                pair(8 * half + p, _mm512_unpacklo_epi8(low, high), _mm512_unpackhi_epi8(low, high));
            };
            // In `k` order, or each of a[p], b[p] used up at once (fewer live registers). Two
            // nested loops of constant bounds, which the compiler unrolls.
            if IN_ORDER {
                for half in 0..2 {
                    for p in 0..8 {
                        decode(half, p);
                    }
                }
            } else {
                for p in 0..8 {
                    for half in 0..2 {
                        decode(half, p);
                    }
                }
            }
            nan
        }
    }

    /// Each row's 16 pairs of block `kb`, rows `t0 .. t0 + ROWS` (slices of a known length: no
    /// bounds checks where they are read).
    #[inline]
    fn block_rows<const ROWS: usize>(a: &Activations, t0: usize, kb: usize) -> [&[u32; 16]; ROWS] {
        let per_row = a.k / 2;
        std::array::from_fn(|t| a.pairs[(t0 + t) * per_row + kb * (BLOCK / 2)..][..16].try_into().expect("16 pairs"))
    }

    /// Adds decoded pair `i` of a block (`lo`, `hi`: its 32 rows) times the rows `x` to `sums`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn add_pair<const ROWS: usize>(sums: &mut [[__m512; 2]; ROWS], x: &[&[u32; 16]; ROWS], i: usize, lo: __m512i, hi: __m512i) {
        // SAFETY: the same size and bits; `__m512bh` is 32 BF16 lanes.
        let (lo, hi): (__m512bh, __m512bh) =
            unsafe { (std::mem::transmute::<__m512i, __m512bh>(lo), std::mem::transmute::<__m512i, __m512bh>(hi)) };
        for (sum, x) in sums.iter_mut().zip(x) {
            // SAFETY: as above.
            let x: __m512bh = unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(x[i] as i32)) };
            sum[0] = _mm512_dpbf16_ps(sum[0], lo, x);
            sum[1] = _mm512_dpbf16_ps(sum[1], hi, x);
        }
    }

    /// Multiplies `acc[t0..t0 + ROWS]` by `by` (into block `kb`'s scales: [`Scale`]) and adds
    /// the block's 16 decoded pairs times rows `t0 .. t0 + ROWS` of the activations, pair by
    /// pair in increasing `k`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn add_block<const ROWS: usize>(acc: &mut [[__m512; 2]], w: &[__m512i; 32], a: &Activations, t0: usize, kb: usize, by: [__m512; 2]) {
        let mut sums = [[_mm512_setzero_ps(); 2]; ROWS];
        for (sum, from) in sums.iter_mut().zip(&acc[t0..t0 + ROWS]) {
            *sum = [_mm512_mul_ps(from[0], by[0]), _mm512_mul_ps(from[1], by[1])];
        }
        let x = block_rows::<ROWS>(a, t0, kb);
        for (i, pair) in w.chunks_exact(2).enumerate() {
            add_pair(&mut sums, &x, i, pair[0], pair[1]);
        }
        acc[t0..t0 + ROWS].copy_from_slice(&sums);
    }

    /// The tile (bounds checked by the caller): false when a byte is NaN or an output is not
    /// finite.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bf16")]
    pub unsafe fn accumulate(e: &[u8], next: &[u8], scales: &[u8], a: &Activations, out: &mut [f32]) -> bool {
        assert!(
            e.len() == TILE * a.k
                && scales.len() == TILE * (a.k / BLOCK)
                && out.len() >= a.rows * TILE
                && a.pairs.len() == a.rows * a.k / 2
        );
        let tile = Tile { e, next, scales, k: a.k };
        // One row or two add each pair as it is decoded (interleaved runs on the Zen 4 VM, one
        // thread: 1.1-1.4x a loop that kept each block's pairs, then added them, at T = 1, 1.1-1.2x
        // at T = 2; at T = 3 the same, slower from T = 4 on, where the sums and the decode no
        // longer fit the registers). More rows add a block's pairs while the next block is
        // decoded (Zen 5 VM, one thread, weights in L3, both kernels in one binary: 1.25-1.4x
        // that loop at T = 3 to 8, 1.1x at T = 16).
        match a.rows {
            1 => fused::<1>(&tile, a, out),
            2 => fused::<2>(&tile, a, out),
            3 => pipelined::<3>(&tile, a, out),
            4 => pipelined::<4>(&tile, a, out),
            5 => pipelined::<5>(&tile, a, out),
            6 => pipelined::<6>(&tile, a, out),
            7 => pipelined::<7>(&tile, a, out),
            _ => pipelined::<8>(&tile, a, out),
        }
    }

    /// A tile's weights: `TILE` rows of `k` E4M3 bytes, their block-major scales, and the next
    /// tile's bytes to prefetch.
    struct Tile<'a> {
        e: &'a [u8],
        next: &'a [u8],
        scales: &'a [u8],
        k: usize,
    }

    /// Where block `kb` of each row lies and the stride between rows. Prefetches one block's
    /// worth of the next tile (as the `gemm::fused` kernel does), into L1 (`bench-gemm`, one
    /// binary switched between the hints, 3 runs of each in a phase where the read roof measured
    /// 45-50 GB/s: at T = 1 `wo_a` 27-28 -> 31-33 GB/s, at T = 2 `wq_b` 31-33 -> 34-35 and `wo_b`
    /// 25-33 -> 34-35, T = 4 to 16 the same or a little faster; in one run each where it
    /// measured 62-65, at T = 2, 4 and 8 `wq_b` 26 / 27 / 15 -> 34 / 30 / 22 GB/s; the binary
    /// built with it against the one before, 2 interleaved runs each at a roof of 47-51 GB/s:
    /// T = 4 `wq_b` 20 -> 34-35, `wo_b` 25-26 -> 34-35, `wo_a` 23-24 -> 27 GB/s, the other T
    /// the same; into L2 before). Fetching two tiles ahead was slower everywhere.
    ///
    /// Two blocks of each row (one cache line) are copied into `lines` together, 32 lines
    /// loaded back to back, and both blocks decoded from there: each line is read from memory
    /// once, and the loads of a tile's lines are in flight together rather than one half-line
    /// at a time inside the decode.
    /// Where rows lie a multiple of 1 KiB apart (`wo_a`'s 4096 columns, `wo_b`'s 2048), 32 rows
    /// share a few L1 sets (the set repeats every 4 KiB), and the second block of each row would
    /// otherwise read lines that the first block's evicted. Elsewhere (`wq_b`'s 1280 columns)
    /// the copy costs some speed in cache and wins from memory (`bench-gemm`, Zen 5 VM, 3
    /// interleaved runs of each binary, `wq_b` from memory: at T = 1 0.51-0.58x the read roof
    /// against 0.36-0.37x, at T = 2 0.49-0.51x against 0.27x, T = 4 and 8 within the runs'
    /// spread, in a phase where the read roof measured 65-70 GB/s; 0.70-0.76x against 0.62-0.72x
    /// at T = 1 and 2 where it measured 50). Rows of an odd number of blocks are read where they
    /// lie.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn rows_of_block(t: &Tile<'_>, kb: usize, lines: &mut [__m512i; TILE]) -> (*const u8, usize) {
        crate::simd::prefetch(t.next.get(kb * TILE * BLOCK..(kb + 1) * TILE * BLOCK).unwrap_or_default());
        let k = t.k;
        if !k.is_multiple_of(2 * BLOCK) {
            // SAFETY: within `e` (the bounds the caller asserted).
            (unsafe { t.e.as_ptr().add(kb * BLOCK) }, k)
        } else if kb.is_multiple_of(2) {
            for (i, line) in lines.iter_mut().enumerate() {
                // SAFETY: row i < TILE and k is a multiple of 2 * BLOCK: 64 bytes inside `e`.
                *line = unsafe { _mm512_loadu_si512(t.e.as_ptr().add(i * k + kb * BLOCK).cast()) };
            }
            (lines.as_ptr().cast::<u8>(), 64)
        } else {
            // SAFETY: the second half of each copied line.
            (unsafe { lines.as_ptr().cast::<u8>().add(BLOCK) }, 64)
        }
    }

    /// The sums of a block are kept divided by its weight scales (module docs): entering a
    /// block multiplies them by `2^(previous scale - its scale)` per lane, leaving the last one
    /// by `2^(its scale - 127)`. Exact within the bounds [`super::Activations::admits`] checks.
    struct Scale {
        /// Each lane's scale byte in the block the sums are in (127 before the first: the
        /// sums are zero then, so any finite factor leaves them so).
        now: [__m512i; 2],
    }

    impl Scale {
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn new() -> Self {
            Self { now: [_mm512_set1_epi32(127); 2] }
        }

        /// `2^(from - to)` per lane (its exponent field `from - to + 127`).
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn pow2_of_difference(from: __m512i, to: __m512i) -> __m512 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_sub_epi32(from, to), _mm512_set1_epi32(127))))
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        fn multiply(sums: &mut [[__m512; 2]], by: [__m512; 2]) {
            for sum in sums {
                sum[0] = _mm512_mul_ps(sum[0], by[0]);
                sum[1] = _mm512_mul_ps(sum[1], by[1]);
            }
        }

        /// Into the block whose lane scales are `next`: what to multiply the sums by.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn enter(&mut self, next: [__m512i; 2]) -> [__m512; 2] {
            let by = [Self::pow2_of_difference(self.now[0], next[0]), Self::pow2_of_difference(self.now[1], next[1])];
            self.now = next;
            by
        }

        /// Back to the weights' own scale after the last block.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn leave(&self, sums: &mut [[__m512; 2]]) {
            let unit = _mm512_set1_epi32(127);
            Self::multiply(sums, [Self::pow2_of_difference(self.now[0], unit), Self::pow2_of_difference(self.now[1], unit)]);
        }
    }

    /// One activation row or two: each decoded pair goes straight into the sums,
    /// which stay in registers.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bf16")]
    fn fused<const ROWS: usize>(t: &Tile<'_>, a: &Activations, out: &mut [f32]) -> bool {
        let decoder = Decoder::new();
        let mut sums = [[_mm512_setzero_ps(); 2]; ROWS];
        let mut nan = _mm512_setzero_si512();
        let mut lines = [_mm512_setzero_si512(); TILE];
        let mut scale = Scale::new();
        for kb in 0..a.k / BLOCK {
            let (from, stride) = rows_of_block(t, kb, &mut lines);
            // SAFETY: 32 scale bytes per block.
            Scale::multiply(&mut sums, scale.enter(unsafe { decoder.lane_scales(t.scales.as_ptr().add(kb * TILE)) }));
            let x = block_rows::<ROWS>(a, 0, kb);
            let add = |i: usize, lo: __m512i, hi: __m512i| add_pair(&mut sums, &x, i, lo, hi);
            // SAFETY: 32 bytes at each of the TILE rows of `from`.
            nan = unsafe { decoder.block::<true>(from, stride, add, nan) };
        }
        scale.leave(&mut sums);
        finish(nan, &sums, out)
    }

    /// Three rows or more: each block is decoded while the previous one's pairs are added to the
    /// sums of the first `ROWS` rows (kept in registers), one decoded pair of the next block
    /// beside one pair of the sums, so that the decode's shuffles and the dot products run side
    /// by side (the unpacks and the dot products use different pipes; on the Zen 5 VM the
    /// cross-lane shuffles and `vdpbf16ps` share some). Each sum still takes the block's
    /// multiply by its scale, then its pairs in increasing `k`. Rows past `ROWS` (at most 8 in
    /// registers) add the kept pairs of the block once it is decoded ([`add_block`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bf16")]
    fn pipelined<const ROWS: usize>(t: &Tile<'_>, a: &Activations, out: &mut [f32]) -> bool {
        let decoder = Decoder::new();
        let blocks = a.k / BLOCK;
        let mut sums = [[_mm512_setzero_ps(); 2]; ROWS];
        let mut acc = [[_mm512_setzero_ps(); 2]; super::DOT_MAX_ROWS];
        // Decoded pairs of the block being added and of the next one.
        let mut pairs = [[_mm512_setzero_si512(); 32]; 2];
        let mut nan = _mm512_setzero_si512();
        let mut lines = [_mm512_setzero_si512(); TILE];
        let mut scale = Scale::new();
        let put = |w: &mut [__m512i; 32], i: usize, lo: __m512i, hi: __m512i| {
            w[2 * i] = lo;
            w[2 * i + 1] = hi;
        };
        let (from, stride) = rows_of_block(t, 0, &mut lines);
        let first = &mut pairs[0];
        // SAFETY: 32 bytes at each of the TILE rows of `from`.
        nan = unsafe { decoder.block::<false>(from, stride, |i, lo, hi| put(first, i, lo, hi), nan) };
        for kb in 0..blocks {
            // SAFETY: 32 scale bytes per block.
            let by = scale.enter(unsafe { decoder.lane_scales(t.scales.as_ptr().add(kb * TILE)) });
            Scale::multiply(&mut sums, by);
            let x = block_rows::<ROWS>(a, 0, kb);
            let (first, second) = pairs.split_at_mut(1);
            let (cur, next) = if kb % 2 == 0 { (&first[0], &mut second[0]) } else { (&second[0], &mut first[0]) };
            if kb + 1 < blocks {
                let (from, stride) = rows_of_block(t, kb + 1, &mut lines);
                let mut step = 0;
                let interleave = |i: usize, lo: __m512i, hi: __m512i| {
                    put(next, i, lo, hi);
                    add_pair(&mut sums, &x, step, cur[2 * step], cur[2 * step + 1]);
                    step += 1;
                };
                // SAFETY: 32 bytes at each of the TILE rows of `from`.
                nan = unsafe { decoder.block::<false>(from, stride, interleave, nan) };
            } else {
                for (i, pair) in cur.chunks_exact(2).enumerate() {
                    add_pair(&mut sums, &x, i, pair[0], pair[1]);
                }
            }
            let mut t0 = ROWS;
            while t0 < a.rows {
                let rows = (a.rows - t0).min(8);
                match rows {
                    1 => add_block::<1>(&mut acc, cur, a, t0, kb, by),
                    2 => add_block::<2>(&mut acc, cur, a, t0, kb, by),
                    3 => add_block::<3>(&mut acc, cur, a, t0, kb, by),
                    4 => add_block::<4>(&mut acc, cur, a, t0, kb, by),
                    5 => add_block::<5>(&mut acc, cur, a, t0, kb, by),
                    6 => add_block::<6>(&mut acc, cur, a, t0, kb, by),
                    7 => add_block::<7>(&mut acc, cur, a, t0, kb, by),
                    _ => add_block::<8>(&mut acc, cur, a, t0, kb, by),
                }
                t0 += rows;
            }
        }
        acc[..ROWS].copy_from_slice(&sums);
        scale.leave(&mut acc[..a.rows]);
        finish(nan, &acc[..a.rows], out)
    }

    /// Writes the sums of each activation row to `out` (row `t` at `t * TILE`): false when a
    /// byte was NaN or a sum is not finite.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn finish(nan: __m512i, sums: &[[__m512; 2]], out: &mut [f32]) -> bool {
        if _mm512_cmpeq_epi8_mask(nan, _mm512_set1_epi8(-1)) != 0 {
            return false;
        }
        // SAFETY: 16 lanes of 4 bytes each.
        let index = unsafe { [_mm512_loadu_si512(ROW_LANES.as_ptr().cast()), _mm512_loadu_si512(ROW_LANES[16..].as_ptr().cast())] };
        let exponent = _mm512_set1_epi32(0x7F80_0000);
        for (sums, out) in sums.iter().zip(out.chunks_exact_mut(TILE)) {
            for (half, out) in index.iter().zip(out.chunks_exact_mut(16)) {
                let rows = _mm512_permutex2var_ps(sums[0], *half, sums[1]);
                // Not finite: every exponent bit set.
                if _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(rows), exponent), exponent) != 0 {
                    return false;
                }
                // SAFETY: 16 lanes of 4 bytes.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), rows) };
            }
        }
        true
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn words_transpose_to_columns() {
            if !has_instructions() {
                return;
            }
            let input: [[u16; 32]; 8] = std::array::from_fn(|i| std::array::from_fn(|w| (i * 32 + w) as u16 ^ 0x5A5A));
            // SAFETY: the CPU has AVX-512 F and BW (checked above).
            let got = unsafe {
                let mut x = input.map(|row| _mm512_loadu_si512(row.as_ptr().cast()));
                transpose_words(&mut x);
                x.map(|v| {
                    let mut words = [0u16; 32];
                    _mm512_storeu_si512(words.as_mut_ptr().cast(), v);
                    words
                })
            };
            for (p, row) in got.iter().enumerate() {
                for lane in 0..4 {
                    for i in 0..8 {
                        assert_eq!(row[lane * 8 + i], input[i][lane * 8 + p], "output {p}, lane {lane}, word {i}");
                    }
                }
            }
        }

        #[test]
        fn this_cpu_rounds_the_pairs_in_order_or_the_path_is_off() {
            if has_instructions() {
                // The development machines so far (AMD Zen 5, then an Intel Xeon with AMX) round
                // as the plain loop does; a CPU that does not must fail this check, never the
                // GEMM's bits.
                assert_eq!(super::super::available(), rounds_as_the_plain_loop());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::e4m3;
    use crate::gemm::{MxMatrix, ScaleView, WeightView, gemm_reference};
    use crate::mxfp8::ScaleRule;

    /// Two tiles, every E4M3 byte but NaN (signed zeros and a zero row among them), against
    /// activations spanning 2^-10 .. 2^5; scales exactly at the bounds of the module docs.
    struct Case {
        e: Vec<u8>,
        n: usize,
        k: usize,
    }

    impl Case {
        fn new() -> Self {
            Self::with_k(256)
        }

        /// With `k` columns.
        fn with_k(k: usize) -> Self {
            let n = 2 * TILE;
            let mut e: Vec<u8> = (0..n * k).map(|i| (i * 7 + i / k * 3) as u8).map(|b| if e4m3::is_nan(b) { 0x80 } else { b }).collect();
            e[5 * k..6 * k].fill(0);
            Self { e, n, k }
        }

        fn acts(&self, rows: usize) -> (MxMatrix, Activations) {
            let v: Vec<f32> =
                (0..rows * self.k).map(|i| ((i * 37 % 101) as f32 - 50.0) * crate::e8m0::pow2((i % 16) as i32 - 10)).collect();
            let m = MxMatrix::quantize(&v, self.k, ScaleRule::Rceil).unwrap();
            let a = Activations::new(&m.dequantize(), rows, self.k).expect("MXFP8 values are BF16 values");
            (m, a)
        }

        /// `tile`'s output for tile `which` with scale bytes `scale(row, block)`, next to the plain
        /// loop's, as bits; None when the path declines it.
        fn run(&self, rows: usize, which: usize, scale: impl Fn(usize, usize) -> u8) -> Option<(Vec<u32>, Vec<u32>)> {
            let c = self.k / BLOCK;
            let s: Vec<u8> = (0..self.n * c).map(|i| scale(i / c, i % c)).collect();
            let w = WeightView { elements: &self.e, n: self.n, k: self.k, scales: ScaleView::RowMajor(&s) };
            let (m, a) = self.acts(rows);
            let mut scratch = Vec::new();
            let weights = TileWeights::gather(&w, which * TILE, &mut scratch).unwrap();
            let mut out = vec![0f32; rows * TILE];
            if !tile(&weights, &a, &mut out) {
                return None;
            }
            let want = gemm_reference(&m, &w).unwrap();
            let want = (0..rows).flat_map(|t| want[t * self.n + which * TILE..][..TILE].to_vec()).map(f32::to_bits).collect();
            Some((out.into_iter().map(f32::to_bits).collect(), want))
        }
    }

    #[test]
    fn the_dot_path_gives_the_plain_loops_bits_up_to_the_edges_of_its_range() {
        if !available() {
            return;
        }
        // Rows copied a cache line at a time (256 columns; 1024, a multiple of 1 KiB apart), and
        // rows of an odd number of blocks, read where they lie (160).
        for case in [Case::new(), Case::with_k(160), Case::with_k(1024)] {
            edges(&case);
        }
    }

    /// `log2(k)` rounded up, as [`Activations::admits`] bounds the partial sums.
    fn log2_k(k: usize) -> i32 {
        (usize::BITS - (k - 1).leading_zeros()) as i32
    }

    fn edges(case: &Case) {
        let log2_k = log2_k(case.k);
        for rows in 1..=DOT_MAX_ROWS {
            let a = case.acts(rows).1;
            // The smallest weight scale the bounds admit, in some blocks of each row.
            let low = (13 - a.min_exp).max(10) as u8;
            let (got, want) = case.run(rows, 0, |r, kb| low + ((r + kb) % 3) as u8).expect("in range");
            assert_eq!(got, want, "{rows} rows, smallest scales");
            assert!(got.iter().filter(|&&b| b & 0x7FFF_FFFF != 0).count() > got.len() / 2);
            // The largest.
            let high = (243 - a.max_exp - log2_k).min(246) as u8;
            let (got, want) = case.run(rows, 1, |r, kb| high - ((r * 5 + kb) % 4) as u8).expect("in range");
            assert_eq!(got, want, "{rows} rows, largest scales");
            // The widest spread of scales in one tile: one row's block far above the rest, so
            // that its sums are divided by a scale far from the blocks before and after it.
            let spread = (116 - a.max_exp - log2_k).min(a.min_exp + 114) as u8;
            let (got, want) = case.run(rows, 0, |r, kb| if (r, kb) == (7, 3) { low + spread } else { low }).expect("the widest spread");
            assert_eq!(got, want, "{rows} rows, scales {low} and {}", low + spread);
            // One past each bound is declined.
            assert!(case.run(rows, 0, |r, kb| if (r, kb) == (40, 3) { low - 1 } else { low }).is_some(), "another tile");
            assert!(case.run(rows, 1, |r, kb| if (r, kb) == (40, 3) { low - 1 } else { low }).is_none(), "below the range");
            assert!(case.run(rows, 1, |r, kb| if (r, kb) == (33, 4) { high + 1 } else { high }).is_none(), "above the range");
            assert!(case.run(rows, 1, |r, kb| if (r, kb) == (39, 3) { low + spread + 1 } else { low }).is_none(), "too wide a spread");
        }
    }

    proptest::proptest! {
        /// The activations made from the MXFP8 bytes are those made from their exact values:
        /// the same pairs and exponent range, declined for the same inputs (NaN bytes, NaN
        /// scales, products that leave the normal range, all-zero rows).
        #[test]
        fn activations_from_the_mxfp8_bytes_are_those_of_their_values(
            rows in 1..=DOT_MAX_ROWS + 1,
            blocks in 1usize..5,
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), DOT_MAX_ROWS * 4 * BLOCK + 4 * BLOCK),
            scales in proptest::collection::vec(proptest::prop_oneof![110u8..145, 0u8..10, 245u8..=255], DOT_MAX_ROWS * 4 + 4),
            zero_bytes in proptest::prelude::any::<bool>(),
            clean_bytes in proptest::prelude::any::<bool>(),
        ) {
            let k = blocks * BLOCK;
            let mut elements = bytes[..rows * k].to_vec();
            if clean_bytes {
                elements.iter_mut().filter(|b| e4m3::is_nan(**b)).for_each(|b| *b = 0x38);
            }
            if zero_bytes {
                elements.fill(0x80);
            }
            let m = MxMatrix { elements, scales: scales[..rows * blocks].to_vec(), rows, k };
            proptest::prop_assert_eq!(Activations::from_mx(&m), Activations::new(&m.dequantize(), rows, k));
        }
    }

    #[test]
    fn the_dot_path_declines_nan_bytes_sums_that_could_overflow_and_values_that_are_not_bf16() {
        if !available() {
            return;
        }
        let mut case = Case::new();
        assert!(case.run(3, 0, |_, _| 120).is_some());
        case.e[7 * case.k + 100] = 0x7F;
        assert!(case.run(3, 0, |_, _| 120).is_none(), "a NaN byte");
        assert!(case.run(3, 1, |_, _| 120).is_some(), "the other tile");
        case.e[7 * case.k + 100] = 0xFF;
        assert!(case.run(3, 0, |_, _| 120).is_none(), "a negative NaN byte");
        // The largest weights, with the signs of the activations: at the largest scale the
        // bounds admit their sums stay finite and exact; one above (where a sum could reach
        // f32's largest values) the tile is declined.
        let mut huge = Case::new();
        let (m, a) = huge.acts(1);
        let x = m.dequantize();
        huge.e = (0..huge.n * huge.k).map(|i| if x[i % huge.k] < 0.0 { 0xFE } else { 0x7E }).collect();
        let top = (243 - a.max_exp - log2_k(huge.k)) as u8;
        let (got, want) = huge.run(1, 0, |_, _| top).expect("in range");
        assert_eq!(got, want, "the largest sums admitted");
        assert!(got.iter().all(|&b| f32::from_bits(b).is_finite() && b & 0x7FFF_FFFF != 0));
        assert!(huge.run(1, 0, |_, _| top + 1).is_none(), "sums that could overflow");
        // Values that are not BF16 numbers, subnormal values, too many rows.
        let k = 64;
        assert!(Activations::new(&vec![1.0 + f32::EPSILON; k], 1, k).is_none());
        assert!(Activations::new(&vec![f32::MIN_POSITIVE / 2.0; k], 1, k).is_none());
        assert!(Activations::new(&vec![f32::INFINITY; k], 1, k).is_none());
        assert!(Activations::new(&vec![1.5; k * (DOT_MAX_ROWS + 1)], DOT_MAX_ROWS + 1, k).is_none());
        assert!(Activations::new(&vec![-0.0; k], 1, k).is_some());
    }
}
