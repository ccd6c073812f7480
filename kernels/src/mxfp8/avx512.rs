//! BF16 quantization with AVX-512 BW: a block's 32 BF16 values fill one register as 16-bit
//! lanes, so the elements' exponents, their round to nearest even and their saturation are one
//! instruction each for the whole block. The plain loop ([`super::quantize_bf16_block`],
//! compiled for AVX2 by `simd::dispatch!`) ran these per element and bound a BF16 load
//! (`orchestrator-worker bench`: 46% of a warm BF16 reload's samples).
//!
//! What costs most here is each block's magnitude maximum, a reduction across the register
//! that everything else waits on: four blocks are reduced together (their halves, then their
//! quarters, side by side in one register), and their scales computed at once, without the
//! division (see [`scales_of`]).
//!
//! The arithmetic is the plain loop's, lane for lane. A block it does not take exactly (a NaN or
//! an infinity, a maximum below 2^-117, a subnormal input, an element whose result is an E4M3
//! subnormal or zero) is handed to the plain loop whole, as the plain loop hands such blocks to
//! its exact path.

use std::arch::x86_64::*;

#[cfg(doc)]
use super::quantize_rows_body;
use super::{BLOCK, ScaleRule, quantize_bf16_block};

/// Whether this CPU has the instructions.
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw")
}

/// Runs `f` compiled with AVX-512 F and BW (as `simd::dispatch!` does for AVX2): the
/// [`quantize_rows_body`] it calls with [`one`] and [`four`] is inlined into it, and their
/// intrinsics with it.
///
/// # Safety
/// The CPU must have AVX-512 F and BW ([`available`]).
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn with_instructions<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// [`quantize_bf16_block`] of one block. Inlined into its caller, whose target features its
/// intrinsics then take (a call per block cost as much as the block).
///
/// # Safety
/// Only for code compiled with AVX-512 F and BW enabled ([`with_instructions`]).
#[inline(always)]
pub(super) unsafe fn one(src: &[u8; BLOCK * 2], rule: ScaleRule, dst: &mut [u8]) -> Result<u8, usize> {
    assert_eq!(dst.len(), BLOCK, "a block's elements");
    // SAFETY: the caller's code has the instructions; `src` holds 64 bytes, the register's
    // width, and `dst` 32 (asserted above).
    unsafe {
        let h = _mm512_loadu_si512(src.as_ptr().cast());
        let magnitude = _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF));
        let m = _mm512_max_epu16(magnitude, _mm512_shuffle_i64x2::<0b01_00_11_10>(magnitude, magnitude));
        let m = _mm512_max_epu16(m, _mm512_shuffle_i64x2::<0b10_11_00_01>(m, m));
        let (scale, outside) = scales_of(m, rule);
        if outside != 0 {
            return plain(src, rule, dst);
        }
        let (words, outside) = words_of(h, magnitude, scale);
        if outside != 0 {
            return plain(src, rule, dst);
        }
        _mm256_storeu_si256(dst.as_mut_ptr().cast(), _mm512_castsi512_si256(bytes_of(words, words)));
        Ok(_mm_cvtsi128_si32(_mm512_castsi512_si128(scale)) as u8)
    }
}

/// Four blocks at once: their scale bytes, or `None` (nothing written) when one of them must go
/// through [`one`].
///
/// # Safety
/// As [`one`].
#[inline(always)]
pub(super) unsafe fn four(src: [&[u8; BLOCK * 2]; 4], rule: ScaleRule, dst: &mut [u8]) -> Option<[u8; 4]> {
    assert_eq!(dst.len(), 4 * BLOCK, "four blocks' elements");
    // SAFETY: as in `one`; `dst` holds 128 bytes (asserted above).
    unsafe {
        let h = src.map(|s| _mm512_loadu_si512(s.as_ptr().cast()));
        let magnitude = h.map(|h| _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF)));
        // The halves' maxima of blocks 0 and 1, then of 2 and 3, side by side; then the
        // quarters' maxima of all four, block i in 128-bit lane i.
        let pair = |a, b| _mm512_max_epu16(_mm512_shuffle_i64x2::<0b01_00_01_00>(a, b), _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b));
        let (low, high) = (pair(magnitude[0], magnitude[1]), pair(magnitude[2], magnitude[3]));
        let m = _mm512_max_epu16(_mm512_shuffle_i64x2::<0b10_00_10_00>(low, high), _mm512_shuffle_i64x2::<0b11_01_11_01>(low, high));
        let (scale, outside) = scales_of(m, rule);
        if outside != 0 {
            return None;
        }
        let lane = [
            _mm512_shuffle_i64x2::<0b00_00_00_00>(scale, scale),
            _mm512_shuffle_i64x2::<0b01_01_01_01>(scale, scale),
            _mm512_shuffle_i64x2::<0b10_10_10_10>(scale, scale),
            _mm512_shuffle_i64x2::<0b11_11_11_11>(scale, scale),
        ];
        // Written out rather than mapped: a closure is not compiled with the instructions.
        let (w0, o0) = words_of(h[0], magnitude[0], lane[0]);
        let (w1, o1) = words_of(h[1], magnitude[1], lane[1]);
        let (w2, o2) = words_of(h[2], magnitude[2], lane[2]);
        let (w3, o3) = words_of(h[3], magnitude[3], lane[3]);
        if o0 | o1 | o2 | o3 != 0 {
            return None;
        }
        let out = dst.as_mut_ptr();
        _mm512_storeu_si512(out.cast(), bytes_of(w0, w1));
        _mm512_storeu_si512(out.add(2 * BLOCK).cast(), bytes_of(w2, w3));
        let mut words = [0u16; 32];
        _mm512_storeu_si512(words.as_mut_ptr().cast(), scale);
        Some([words[0] as u8, words[8] as u8, words[16] as u8, words[24] as u8])
    }
}

/// From each 128-bit lane's maxima of its block (eight words, before the last three steps of
/// the reduction): the block's scale byte in every word of the lane, and the lanes whose block
/// must be handed back (a nonzero mask) because its maximum is zero, below 2^-117 (E < 10), or
/// a NaN or an infinity.
///
/// The scale without the division: with the maximum's biased exponent E >= 10 and mantissa f,
/// amax / 448 = (128 + f) / 7 * 2^(E - 140) is an f32 normal, in [16, 32) * 2^(E - 140) for
/// f < 96, exactly 32 * 2^(E - 140) for f = 96 and in (32, 37) * 2^(E - 140) above. So rceil's
/// exponent is E - 135, plus 1 for f > 96, floor's is E - 135, both within the clamp, and the
/// byte adds 127. `blocks_match_the_plain_loop_at_every_magnitude` checks every E and f.
///
/// # Safety
/// As [`one`].
#[inline(always)]
unsafe fn scales_of(m: __m512i, rule: ScaleRule) -> (__m512i, u32) {
    // SAFETY: the caller's code has the instructions.
    unsafe {
        let m = _mm512_max_epu16(m, _mm512_shuffle_epi32::<0b01_00_11_10>(m));
        let m = _mm512_max_epu16(m, _mm512_shuffle_epi32::<0b10_11_00_01>(m));
        let amax = _mm512_max_epu16(m, _mm512_rol_epi32::<16>(m));
        let amax_exponent = _mm512_srli_epi16::<7>(amax);
        let rounds_up = match rule {
            ScaleRule::Rceil => {
                _mm512_srli_epi16::<7>(_mm512_add_epi16(_mm512_and_si512(amax, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(31)))
            }
            ScaleRule::Floor => _mm512_setzero_si512(),
        };
        let scale = _mm512_add_epi16(_mm512_sub_epi16(amax_exponent, _mm512_set1_epi16(8)), rounds_up);
        let outside =
            _mm512_cmplt_epu16_mask(amax_exponent, _mm512_set1_epi16(10)) | _mm512_cmpeq_epi16_mask(amax_exponent, _mm512_set1_epi16(0xFF));
        (scale, outside)
    }
}

/// The 32 E4M3 bytes of the block `h` (its `magnitude`s) with the scale byte `scale` in every
/// word, one per word, and the elements that are zero, a subnormal or below E4M3's normals after
/// scaling (a nonzero mask: the block must be handed back).
///
/// Each element's scaled exponent is t = E - 127 - e (the scale byte is e + 127), and its E4M3
/// byte before rounding x = (t + 7) << 7 | its 7 mantissa bits, which is the magnitude's bits
/// plus (7 - scale byte) << 7 (the mantissa bits do not carry into the exponent): one add. t >= -6
/// gives an E4M3 normal; t <= 8 always, because the scale is the block maximum's (its t is 8,
/// or 7 where rceil rounded the scale up), and above that the saturation at 0x7E would give the
/// plain loop's byte anyway (its clamp of t at 9 saturates too).
///
/// # Safety
/// As [`one`].
#[inline(always)]
unsafe fn words_of(h: __m512i, magnitude: __m512i, scale: __m512i) -> (__m512i, u32) {
    // SAFETY: the caller's code has the instructions.
    unsafe {
        let x = _mm512_add_epi16(magnitude, _mm512_slli_epi16::<7>(_mm512_sub_epi16(_mm512_set1_epi16(7), scale)));
        // A zero or subnormal element (exponent field 0), or t < -6 (x < 1 << 7, as i16).
        let outside = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(1 << 7)) | _mm512_cmplt_epi16_mask(x, _mm512_set1_epi16(1 << 7));
        // Rounded to nearest even from 7 mantissa bits to 3: (x + 7 + ((x >> 4) & 1)) >> 4,
        // saturated at 0x7E, and the sign put back: min(rounded, 0x7E) | ((h >> 8) & 0x80).
        let odd = _mm512_and_si512(_mm512_srli_epi16::<4>(x), _mm512_set1_epi16(1));
        let rounded = _mm512_srli_epi16::<4>(_mm512_add_epi16(x, _mm512_add_epi16(odd, _mm512_set1_epi16(7))));
        let words = _mm512_ternarylogic_epi32::<0xF8>(
            _mm512_min_epu16(rounded, _mm512_set1_epi16(0x7E)),
            _mm512_srli_epi16::<8>(h),
            _mm512_set1_epi16(0x80),
        );
        (words, outside)
    }
}

/// The bytes of two blocks' words ([`words_of`]), in order: packed within each 128-bit lane
/// (`a`'s eight bytes, then `b`'s), then the lanes gathered (LLVM's truncating store, `vpmovwb`,
/// is slow).
///
/// # Safety
/// As [`one`].
#[inline(always)]
unsafe fn bytes_of(a: __m512i, b: __m512i) -> __m512i {
    // SAFETY: the caller's code has the instructions.
    unsafe { _mm512_permutexvar_epi64(_mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0), _mm512_packus_epi16(a, b)) }
}

/// The plain loop, for the blocks [`one`] hands back: kept out of line, so that its scalar
/// loads are not scheduled on the vector path.
#[cold]
#[inline(never)]
fn plain(src: &[u8; BLOCK * 2], rule: ScaleRule, dst: &mut [u8]) -> Result<u8, usize> {
    quantize_bf16_block(src, rule, dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[target_feature(enable = "avx512f,avx512bw")]
    fn with_instructions(src: &[u8; BLOCK * 2], rule: ScaleRule, dst: &mut [u8]) -> Result<u8, usize> {
        // SAFETY: compiled with the instructions.
        unsafe { one(src, rule, dst) }
    }

    fn quantize_block(src: &[u8; BLOCK * 2], rule: ScaleRule, dst: &mut [u8]) -> Result<u8, usize> {
        // SAFETY: the tests call this only where `available` holds.
        unsafe { with_instructions(src, rule, dst) }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    fn four_with_instructions(src: [&[u8; BLOCK * 2]; 4], rule: ScaleRule, dst: &mut [u8]) -> Option<[u8; 4]> {
        // SAFETY: compiled with the instructions.
        unsafe { four(src, rule, dst) }
    }

    fn four_blocks(src: [&[u8; BLOCK * 2]; 4], rule: ScaleRule, dst: &mut [u8]) -> Option<[u8; 4]> {
        // SAFETY: the tests call this only where `available` holds.
        unsafe { four_with_instructions(src, rule, dst) }
    }

    #[test]
    fn four_blocks_match_the_plain_loop() {
        if available() {
            super::super::tests::four_blocks_match_the_plain_loop(four_blocks);
        }
    }

    #[test]
    fn blocks_match_the_plain_loop() {
        if available() {
            super::super::tests::blocks_match_the_plain_loop(quantize_block);
        }
    }

    #[test]
    fn blocks_match_the_plain_loop_at_every_magnitude() {
        if available() {
            super::super::tests::blocks_match_the_plain_loop_at_every_magnitude(quantize_block);
        }
    }
}
