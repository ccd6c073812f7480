//! BF16 values as a checkpoint stores them: little-endian 16-bit words, 1 sign, 8 exponent and
//! 7 mantissa bits.

/// Whether the little-endian BF16 word is a NaN or an infinity (all exponent bits set).
#[inline]
pub const fn is_non_finite(bits: u16) -> bool {
    bits & 0x7F80 == 0x7F80
}

/// Index (in elements) of the first NaN or infinite value among the little-endian BF16 words
/// of `bytes` (an odd last byte is not an element). 32 elements per step, four to a 64-bit
/// word, compiled for AVX2 too and chosen at run time (see [`crate::simd`]): a search that
/// stops at each element does not vectorize, and ran at a third of the rate the checkpoint's
/// digest reads it at.
pub fn find_non_finite(bytes: &[u8]) -> Option<usize> {
    crate::simd::dispatch!(find_non_finite_impl(bytes))
}

/// An element's exponent bits are all ones exactly when adding `0x0080` to them (alone in
/// their 16-bit lane) sets bit 15; no lane carries into the next.
#[inline(always)]
fn find_non_finite_impl(bytes: &[u8]) -> Option<usize> {
    const EXPONENT: u64 = 0x7F80_7F80_7F80_7F80;
    const ONE: u64 = 0x0080_0080_0080_0080;
    const TOP: u64 = 0x8000_8000_8000_8000;
    let first = |block: &[u8]| block.chunks_exact(2).position(|p| is_non_finite(u16::from_le_bytes([p[0], p[1]])));
    let mut blocks = bytes.chunks_exact(64);
    let mut base = 0;
    for block in &mut blocks {
        let mut hit = 0u64;
        for w in block.chunks_exact(8) {
            let w = u64::from_le_bytes(w.try_into().expect("8-byte chunk"));
            hit |= ((w & EXPONENT) + ONE) & TOP;
        }
        if hit != 0 {
            return first(block).map(|i| base + i);
        }
        base += 32;
    }
    first(blocks.remainder()).map(|i| base + i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The first non-finite element, one element at a time.
    fn plain(bytes: &[u8]) -> Option<usize> {
        bytes.chunks_exact(2).position(|p| is_non_finite(u16::from_le_bytes([p[0], p[1]])))
    }

    #[test]
    fn knows_the_non_finite_words() {
        for (bits, non_finite) in [
            (0x7F80u16, true), // +inf
            (0xFF80, true),    // -inf
            (0x7FC0, true),    // NaN
            (0xFFFF, true),    // NaN
            (0x7F81, true),    // NaN
            (0x7F7F, false),   // largest finite
            (0xFF7F, false),   // its negative
            (0x0000, false),   // +0
            (0x8000, false),   // -0
            (0x0001, false),   // smallest subnormal
            (0x3F80, false),   // 1.0
            (0x7F00, false),   // exponent 0xFE
        ] {
            assert_eq!(is_non_finite(bits), non_finite, "{bits:#06x}");
            assert_eq!(f32::from_bits(u32::from(bits) << 16).is_finite(), !non_finite, "{bits:#06x}");
            let mut bytes = vec![0u8; 200];
            bytes[130..132].copy_from_slice(&bits.to_le_bytes());
            assert_eq!(find_non_finite(&bytes), non_finite.then_some(65), "{bits:#06x}");
        }
    }

    proptest! {
        /// The word-at-a-time scan (and its AVX2 copy) finds the element the plain search finds:
        /// anywhere in a 64-byte block, in the remainder, with an odd last byte, among finite
        /// values of every exponent.
        #[test]
        fn finds_the_first_non_finite_element_as_the_plain_search_does(
            mut words in proptest::collection::vec(any::<u16>().prop_map(|w| if is_non_finite(w) { w & !0x0080 } else { w }), 0..300),
            bad in proptest::collection::vec((any::<prop::sample::Index>(), 0x7F80u16..=0x7FFF, any::<bool>()), 0..3),
            odd in any::<Option<u8>>(),
        ) {
            if !words.is_empty() {
                for (at, w, negative) in bad {
                    let i = at.index(words.len());
                    words[i] = if negative { w | 0x8000 } else { w };
                }
            }
            let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            bytes.extend(odd);
            prop_assert_eq!(find_non_finite(&bytes), plain(&bytes));
            prop_assert_eq!(find_non_finite_impl(&bytes), plain(&bytes));
        }
    }
}
