//! FP8 E4M3 "fn" (finite, NaN-only) element format: 1 sign, 4 exponent (bias 7), 3 mantissa bits.
//! Max 448, no infinity, `0x7F` / `0xFF` are NaN (spec section 3).

/// Largest finite E4M3fn magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// The byte of +448 (saturation value).
pub const E4M3_MAX_BYTE: u8 = 0x7E;

/// True for the two NaN encodings.
#[inline]
pub const fn is_nan(byte: u8) -> bool {
    byte & 0x7F == 0x7F
}

/// Position of the first NaN byte (`0x7F` / `0xFF`). With AVX-512 BW, 256 bytes per step
/// ([`avx512::find_nan`]: 42 GB/s in L2 on the development VM, where the AVX2 scan below gives
/// 27 and bounds a warm FP8 reload with the digest); else eight bytes at a time, compiled for
/// AVX2 too and chosen at run time (see [`crate::simd`]).
pub fn find_nan(bytes: &[u8]) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // SAFETY: the CPU has AVX-512 F and BW (checked just above).
        return unsafe { avx512::find_nan(bytes) };
    }
    crate::simd::dispatch!(find_nan_impl(bytes))
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw")
    }

    /// A byte is NaN exactly when it is `0xFF` once its sign bit is set: the maximum of four
    /// registers of those finds whether a 256-byte group holds one, and the plain search then
    /// finds where.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn find_nan(bytes: &[u8]) -> Option<usize> {
        const GROUP: usize = 256;
        let (sign, ones) = (_mm512_set1_epi8(0x80u8 as i8), _mm512_set1_epi8(-1));
        let mut groups = bytes.chunks_exact(GROUP);
        let mut base = 0;
        for group in &mut groups {
            // SAFETY: four 64-byte loads inside the group's 256 bytes.
            let v: [__m512i; 4] =
                std::array::from_fn(|i| unsafe { _mm512_or_si512(_mm512_loadu_si512(group.as_ptr().add(64 * i).cast()), sign) });
            let max = _mm512_max_epu8(_mm512_max_epu8(v[0], v[1]), _mm512_max_epu8(v[2], v[3]));
            if _mm512_cmpeq_epi8_mask(max, ones) != 0 {
                return super::find_nan_impl(group).map(|i| base + i);
            }
            base += GROUP;
        }
        super::find_nan_impl(groups.remainder()).map(|i| base + i)
    }
}

/// The scan eight bytes at a time: a byte's low seven bits are all ones exactly when adding 1
/// to them sets bit 7.
#[inline(always)]
fn find_nan_impl(bytes: &[u8]) -> Option<usize> {
    const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut words = bytes.chunks_exact(64);
    let mut base = 0;
    for block in &mut words {
        let mut hit = 0u64;
        for w in block.chunks_exact(8) {
            let w = u64::from_le_bytes(w.try_into().expect("8-byte chunk"));
            hit |= ((w & LOW7) + ONES) & HIGH;
        }
        if hit != 0 {
            return block.iter().position(|&b| is_nan(b)).map(|i| base + i);
        }
        base += 64;
    }
    words.remainder().iter().position(|&b| is_nan(b)).map(|i| base + i)
}

/// XXH3-64 of E4M3 bytes, checking them for NaN in the same pass (2 KiB at a time, each step
/// digested from L1 just after it is checked, the step two on fetched meanwhile): the digest,
/// or the position of the first NaN byte. From memory on the AVX2 VM, one thread: 14.6-15.2
/// GB/s, the rate of the digest alone, against 10.3-12.5 in steps of 256 KiB (each checked from
/// memory, then digested from L2).
pub fn digest_nan_free(bytes: &[u8]) -> Result<crate::Digest, usize> {
    const STEP: usize = 2048;
    const STEPS_AHEAD: usize = 2;
    let mut hasher = crate::digest::DigestStream::new();
    for (i, step) in bytes.chunks(STEP).enumerate() {
        crate::simd::prefetch_row(bytes, STEP, i + STEPS_AHEAD);
        if let Some(at) = find_nan(step) {
            return Err(i * STEP + at);
        }
        hasher.update(step);
    }
    Ok(hasher.finish())
}

/// Decodes one E4M3fn byte exactly (NaN bytes decode to NaN).
#[inline]
pub fn to_f32(byte: u8) -> f32 {
    DECODE[byte as usize]
}

static DECODE: [f32; 256] = build_decode_table();

const fn build_decode_table() -> [f32; 256] {
    let mut table = [0f32; 256];
    let mut b = 0usize;
    while b < 256 {
        let exp = ((b >> 3) & 0xF) as i32;
        let man = (b & 0x7) as u32;
        // Build the f32 bit pattern directly so the table is exact and const.
        let magnitude_bits: u32 = if b & 0x7F == 0x7F {
            0x7FC0_0000
        } else if exp == 0 {
            // Subnormal: man * 2^-9, exact in f32 as a normal number.
            if man == 0 {
                0
            } else {
                let lead = 31 - man.leading_zeros(); // position of the leading one (0..=2)
                let e = lead as i32 - 9; // unbiased f32 exponent
                let frac = (man ^ (1 << lead)) << (23 - lead);
                (((e + 127) as u32) << 23) | frac
            }
        } else {
            let e = exp - 7;
            (((e + 127) as u32) << 23) | (man << 20)
        };
        let sign = if b & 0x80 != 0 { 0x8000_0000u32 } else { 0 };
        table[b] = f32::from_bits(sign | magnitude_bits);
        b += 1;
    }
    table
}

/// Rounds a finite f32 to E4M3fn: round-to-nearest-even, saturating to +-448.
/// The caller rejects NaN and infinity before calling (an infinite input saturates).
#[inline]
pub fn from_f32_saturating(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    // 448 = 0x43E0_0000; anything at or above it (including values that would round to 480,
    // which is NaN in this format) saturates.
    if abs >= 0x43E0_0000 {
        return sign | E4M3_MAX_BYTE;
    }
    // Below the smallest normal (2^-6 = 0x3C80_0000): subnormal grid of 2^-9.
    if abs < 0x3C80_0000 {
        // a * 2^9 is exact; round half to even onto 0..=8 (8 encodes the smallest normal).
        let q = (f32::from_bits(abs) * 512.0).round_ties_even() as u8;
        return sign | q;
    }
    let exp = (abs >> 23) as i32 - 127; // -6..=8
    let mant = abs & 0x7F_FFFF;
    let mut m3 = mant >> 20;
    let rest = mant & 0xF_FFFF;
    const HALF: u32 = 0x8_0000;
    if rest > HALF || (rest == HALF && (m3 & 1) == 1) {
        m3 += 1;
    }
    let mut biased = (exp + 7) as u32;
    if m3 == 8 {
        m3 = 0;
        biased += 1;
    }
    if biased > 15 || (biased == 15 && m3 == 7) {
        return sign | E4M3_MAX_BYTE;
    }
    sign | ((biased << 3) as u8) | m3 as u8
}

#[cfg(test)]
mod tests {
    /// The baseline scan and the dispatched one (AVX-512 or AVX2 where present) find the same
    /// first NaN: in a 256-byte group, at its edges, and in the remainder after the last one.
    #[test]
    fn baseline_and_dispatched_nan_scans_agree() {
        let mut bytes: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2654435761) >> 11) as u8 & 0x7E).collect();
        assert_eq!((find_nan(&bytes), find_nan_impl(&bytes)), (None, None));
        for at in [0, 7, 63, 64, 255, 256, 257, 1000, 4863, 4864, 4999] {
            for nan in [0x7F, 0xFF] {
                let keep = bytes[at];
                bytes[at] = nan;
                assert_eq!((find_nan(&bytes), find_nan_impl(&bytes)), (Some(at), Some(at)));
                bytes[at] = keep;
            }
        }
    }

    use super::*;

    #[test]
    fn decodes_known_bytes() {
        assert_eq!(to_f32(0x00), 0.0);
        assert_eq!(to_f32(0x01), 2f32.powi(-9));
        assert_eq!(to_f32(0x08), 2f32.powi(-6));
        assert_eq!(to_f32(0x38), 1.0);
        assert_eq!(to_f32(0x7E), 448.0);
        assert_eq!(to_f32(0xFE), -448.0);
        assert!(to_f32(0x7F).is_nan());
        assert!(to_f32(0xFF).is_nan());
    }

    #[test]
    fn finds_nan_bytes_anywhere() {
        for len in [0usize, 1, 7, 63, 64, 65, 200, 255, 256, 257, 511, 512, 1000] {
            let clean: Vec<u8> = (0..len).map(|i| (i % 127) as u8 & 0x7E).collect();
            assert_eq!(find_nan(&clean), None);
            for at in [0, len / 2, len.saturating_sub(1)] {
                if at < len {
                    for nan in [0x7Fu8, 0xFF] {
                        let mut v = clean.clone();
                        v[at] = nan;
                        assert_eq!(find_nan(&v), Some(at), "len {len} at {at}");
                    }
                }
            }
        }
    }

    #[test]
    fn digest_nan_free_matches_plain_digest_and_finds_nan() {
        let clean: Vec<u8> = (0..200_000u32).map(|i| (i % 120) as u8).collect();
        assert_eq!(digest_nan_free(&clean), Ok(crate::Digest::of(&clean)));
        let mut bad = clean.clone();
        bad[150_001] = 0xFF;
        assert_eq!(digest_nan_free(&bad), Err(150_001));
    }

    #[test]
    fn every_finite_byte_round_trips() {
        for b in 0..=255u8 {
            if is_nan(b) || b == 0x80 {
                continue;
            }
            assert_eq!(from_f32_saturating(to_f32(b)), b, "byte {b:#04x}");
        }
    }

    #[test]
    fn rounds_to_nearest_even_and_saturates() {
        assert_eq!(to_f32(from_f32_saturating(300.0)), 288.0);
        assert_eq!(to_f32(from_f32_saturating(230.0)), 224.0);
        assert_eq!(to_f32(from_f32_saturating(250.0)), 256.0);
        assert_eq!(to_f32(from_f32_saturating(262.144)), 256.0);
        // Ties: 1.0625 lies between 1.0 and 1.125 -> even mantissa (1.0).
        assert_eq!(to_f32(from_f32_saturating(1.0625)), 1.0);
        assert_eq!(to_f32(from_f32_saturating(1.1875)), 1.25);
        assert_eq!(from_f32_saturating(460.0), 0x7E);
        assert_eq!(from_f32_saturating(1e30), 0x7E);
        assert_eq!(from_f32_saturating(-1e30), 0xFE);
        // Subnormal ties: 2^-10 is halfway between 0 and 2^-9 -> 0.
        assert_eq!(from_f32_saturating(2f32.powi(-10)), 0);
        assert_eq!(from_f32_saturating(3.0 * 2f32.powi(-10)), 0x02);
        // Just below the smallest normal rounds up into it.
        assert_eq!(from_f32_saturating(2f32.powi(-6) - 2f32.powi(-12)), 0x08);
    }

    #[test]
    fn nearest_for_all_magnitudes_on_a_fine_grid() {
        // Brute force: the chosen byte is a nearest finite E4M3 value.
        let finite: Vec<f32> = (0..=0x7Eu8).map(to_f32).collect();
        let mut x = 0.0f32;
        while x < 500.0 {
            let got = to_f32(from_f32_saturating(x));
            let best = finite.iter().map(|v| (v - x.min(448.0)).abs()).fold(f32::INFINITY, f32::min);
            assert!((got - x.min(448.0)).abs() <= best, "x = {x}: got {got}");
            x += 0.013;
        }
    }
}
