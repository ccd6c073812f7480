//! BF16 quantization with AVX2 alone (CPUs without AVX-512 BW): [`super::avx512`]'s arithmetic
//! on 256-bit registers, a block's 32 BF16 values in two registers of 16-bit lanes. Four blocks
//! at a time, their maxima reduced side by side (block `i`'s in 64-bit lane `2 (i % 2) + i / 2`
//! of one register), their scales computed without the division; a group with a block the
//! vector path does not take exactly goes through the plain loop block by block.
//!
//! The plain loop compiled for AVX2 was 31% of a warm BF16 reload's samples on the AVX2 VM
//! (2026-12-07), against 9% for the digests of the same bytes.
//!
//! AVX2 has no unsigned 16-bit comparison: every value compared here fits in 15 bits (a
//! magnitude, an exponent, a scaled byte before rounding), so the signed ones give the same
//! answer, and one test runs every BF16 magnitude through both paths.

use std::arch::x86_64::*;

use super::{BLOCK, ScaleRule};

/// Whether this CPU has the instructions.
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// Runs `f` compiled with AVX2 (as [`super::avx512::with_instructions`] does with AVX-512): the
/// quantization loop it calls with [`four`] is inlined into it, and the intrinsics with it.
///
/// # Safety
/// The CPU must have AVX2 ([`available`]).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn with_instructions<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Four blocks at once: their scale bytes, or `None` (nothing written) when one of them must go
/// through the plain loop (a NaN or an infinity, a zero block or a maximum below 2^-117, a zero
/// or subnormal element, a result below E4M3's normals).
///
/// # Safety
/// Only for code compiled with AVX2 enabled ([`with_instructions`]).
#[inline(always)]
pub(super) unsafe fn four(src: [&[u8; BLOCK * 2]; 4], rule: ScaleRule, dst: &mut [u8]) -> Option<[u8; 4]> {
    assert_eq!(dst.len(), 4 * BLOCK, "four blocks' elements");
    // SAFETY: the caller's code has the instructions; each block is 64 bytes, two registers,
    // and `dst` holds 128 bytes (asserted above).
    unsafe {
        // Loops, not closures: a closure is not compiled with the caller's instructions, and
        // each intrinsic in one became a call.
        let low15 = _mm256_set1_epi16(0x7FFF);
        let mut h = [[_mm256_setzero_si256(); 2]; 4];
        let mut magnitude = h;
        let mut m = [_mm256_setzero_si256(); 4];
        for b in 0..4 {
            for half in 0..2 {
                h[b][half] = _mm256_loadu_si256(src[b].as_ptr().add(32 * half).cast());
                magnitude[b][half] = _mm256_and_si256(h[b][half], low15);
            }
            m[b] = _mm256_max_epu16(magnitude[b][0], magnitude[b][1]);
        }
        // Each block's two 128-bit halves, blocks 0 and 1 side by side, then 2 and 3.
        let low = _mm256_max_epu16(_mm256_permute2x128_si256::<0x20>(m[0], m[1]), _mm256_permute2x128_si256::<0x31>(m[0], m[1]));
        let high = _mm256_max_epu16(_mm256_permute2x128_si256::<0x20>(m[2], m[3]), _mm256_permute2x128_si256::<0x31>(m[2], m[3]));
        // Their quarters: 64-bit lane 0 holds block 0's, 1 block 2's, 2 block 1's, 3 block 3's.
        let m = _mm256_max_epu16(_mm256_unpacklo_epi64(low, high), _mm256_unpackhi_epi64(low, high));
        let (scale, outside) = scales_of(m, rule);
        if outside != 0 {
            return None;
        }
        // Block i's scale in every word (64-bit lane 2 (i % 2) + i / 2 of `scale`).
        let lane = [
            _mm256_permute4x64_epi64::<0b00_00_00_00>(scale),
            _mm256_permute4x64_epi64::<0b10_10_10_10>(scale),
            _mm256_permute4x64_epi64::<0b01_01_01_01>(scale),
            _mm256_permute4x64_epi64::<0b11_11_11_11>(scale),
        ];
        let mut words = [[_mm256_setzero_si256(); 2]; 4];
        let mut outside = _mm256_setzero_si256();
        for b in 0..4 {
            for half in 0..2 {
                let (w, o) = words_of(h[b][half], magnitude[b][half], lane[b]);
                words[b][half] = w;
                outside = _mm256_or_si256(outside, o);
            }
        }
        if _mm256_movemask_epi8(outside) != 0 {
            return None;
        }
        let out = dst.as_mut_ptr();
        for (b, [first, second]) in words.iter().enumerate() {
            // Packed within each 128-bit lane (the first half's eight bytes, then the
            // second's), then the quarters put in order.
            let bytes = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(*first, *second));
            _mm256_storeu_si256(out.add(b * BLOCK).cast(), bytes);
        }
        let mut scale_words = [0u16; 16];
        _mm256_storeu_si256(scale_words.as_mut_ptr().cast(), scale);
        Some([scale_words[0] as u8, scale_words[8] as u8, scale_words[4] as u8, scale_words[12] as u8])
    }
}

/// From each 64-bit lane's maxima of its block (four words, before the last two steps of the
/// reduction): the block's scale byte in every word of the lane, and whether a block must be
/// handed back (a nonzero movemask) because its maximum is zero, below 2^-117 (E < 10), or a
/// NaN or an infinity. The arithmetic is [`super::avx512`]'s `scales_of`.
///
/// # Safety
/// As [`four`].
#[inline(always)]
unsafe fn scales_of(m: __m256i, rule: ScaleRule) -> (__m256i, i32) {
    // SAFETY: the caller's code has the instructions.
    unsafe {
        let m = _mm256_max_epu16(m, _mm256_shuffle_epi32::<0b10_11_00_01>(m));
        let amax = _mm256_max_epu16(m, _mm256_or_si256(_mm256_slli_epi32::<16>(m), _mm256_srli_epi32::<16>(m)));
        let amax_exponent = _mm256_srli_epi16::<7>(amax);
        let rounds_up = match rule {
            ScaleRule::Rceil => {
                _mm256_srli_epi16::<7>(_mm256_add_epi16(_mm256_and_si256(amax, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(31)))
            }
            ScaleRule::Floor => _mm256_setzero_si256(),
        };
        let scale = _mm256_add_epi16(_mm256_sub_epi16(amax_exponent, _mm256_set1_epi16(8)), rounds_up);
        // The exponent is at most 0xFF: the signed comparisons are the unsigned ones.
        let outside = _mm256_or_si256(
            _mm256_cmpgt_epi16(_mm256_set1_epi16(10), amax_exponent),
            _mm256_cmpeq_epi16(amax_exponent, _mm256_set1_epi16(0xFF)),
        );
        (scale, _mm256_movemask_epi8(outside))
    }
}

/// The E4M3 bytes of 16 elements `h` (their `magnitude`s) with the scale byte `scale` in every
/// word, one per word, and the elements that are zero, a subnormal or below E4M3's normals after
/// scaling (nonzero words: the block must be handed back). The arithmetic is
/// [`super::avx512`]'s `words_of`.
///
/// # Safety
/// As [`four`].
#[inline(always)]
unsafe fn words_of(h: __m256i, magnitude: __m256i, scale: __m256i) -> (__m256i, __m256i) {
    // SAFETY: the caller's code has the instructions.
    unsafe {
        let x = _mm256_add_epi16(magnitude, _mm256_slli_epi16::<7>(_mm256_sub_epi16(_mm256_set1_epi16(7), scale)));
        // A zero or subnormal element (a magnitude below 1 << 7, at most 0x7FFF), or t < -6
        // (x < 1 << 7 as i16, as the AVX-512 path compares it).
        let limit = _mm256_set1_epi16(1 << 7);
        let outside = _mm256_or_si256(_mm256_cmpgt_epi16(limit, magnitude), _mm256_cmpgt_epi16(limit, x));
        let odd = _mm256_and_si256(_mm256_srli_epi16::<4>(x), _mm256_set1_epi16(1));
        let rounded = _mm256_srli_epi16::<4>(_mm256_add_epi16(x, _mm256_add_epi16(odd, _mm256_set1_epi16(7))));
        let sign = _mm256_and_si256(_mm256_srli_epi16::<8>(h), _mm256_set1_epi16(0x80));
        (_mm256_or_si256(_mm256_min_epu16(rounded, _mm256_set1_epi16(0x7E)), sign), outside)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::super::quantize_bf16_block;
    use super::*;

    #[target_feature(enable = "avx2")]
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

    /// One block through [`four`] (four copies of it), the plain loop where `four` declines;
    /// `taken` counts the blocks `four` took.
    fn one_block(src: &[u8; BLOCK * 2], rule: ScaleRule, dst: &mut [u8], taken: &Cell<usize>) -> Result<u8, usize> {
        let mut out = [0u8; 4 * BLOCK];
        match four_blocks([src; 4], rule, &mut out) {
            Some(scales) => {
                taken.set(taken.get() + 1);
                assert!(scales.iter().all(|&s| s == scales[0]), "one block, four scales {scales:?}");
                assert!(out.chunks(BLOCK).all(|c| c == &out[..BLOCK]), "one block, four results");
                dst.copy_from_slice(&out[..BLOCK]);
                Ok(scales[0])
            }
            None => quantize_bf16_block(src, rule, dst),
        }
    }

    /// How many blocks [`four`] took while a shared test ran its blocks one at a time through
    /// [`one_block`] (the test fails on any result that is not the plain loop's).
    fn blocks_taken(test: impl FnOnce(&dyn Fn(&[u8; BLOCK * 2], ScaleRule, &mut [u8]) -> Result<u8, usize>)) -> usize {
        let taken = Cell::new(0);
        test(&|src, rule, dst| one_block(src, rule, dst, &taken));
        taken.get()
    }

    #[test]
    fn blocks_match_the_plain_loop() {
        if available() {
            let taken = blocks_taken(|block| super::super::tests::blocks_match_the_plain_loop(block));
            // Of the 400000 blocks, the 277860 without a special value or a result below E4M3's
            // normals.
            assert!(taken > 250_000, "four took {taken} blocks");
        }
    }

    #[test]
    fn blocks_match_the_plain_loop_at_every_magnitude() {
        if available() {
            let taken = blocks_taken(|block| super::super::tests::blocks_match_the_plain_loop_at_every_magnitude(block));
            // Of the 65280, all but those whose maximum is below 2^-117 or whose elements are
            // subnormal after scaling (62720).
            assert!(taken > 60_000, "four took {taken} blocks");
        }
    }
}
