//! UE8M0 scale bytes: byte `b` means `2^(b - 127)`; `0xFF` is NaN (spec section 3).

/// The NaN encoding, rejected wherever a scale is read.
pub const NAN_BYTE: u8 = 0xFF;
/// Exponent bias.
pub const BIAS: i32 = 127;

/// Decodes a scale byte exactly (`2^-127` is an f32 subnormal, still exact); NaN for `0xFF`.
#[inline]
pub fn to_f32(byte: u8) -> f32 {
    if byte == NAN_BYTE {
        return f32::NAN;
    }
    pow2(byte as i32 - BIAS)
}

/// `2^e` for `e` in `[-149, 127]`, exactly.
#[inline]
pub fn pow2(e: i32) -> f32 {
    debug_assert!((-149..=127).contains(&e));
    if e >= -126 { f32::from_bits(((e + 127) as u32) << 23) } else { f32::from_bits(1u32 << (e + 149)) }
}

/// Position of the first NaN scale byte, if any.
pub fn find_nan(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == NAN_BYTE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes() {
        assert_eq!(to_f32(127), 1.0);
        assert_eq!(to_f32(128), 2.0);
        assert_eq!(to_f32(119), 2f32.powi(-8));
        assert_eq!(to_f32(0), 2f32.powi(-127));
        assert_eq!(to_f32(254), 2f32.powi(127));
        assert!(to_f32(0xFF).is_nan());
    }
}
