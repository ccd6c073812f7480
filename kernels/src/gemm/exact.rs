//! Where a multiply and an add give the bits of one fused multiply-add: where the product is
//! exact in f32, the fused operation's one rounding is the add's. Both operands of a GEMM are
//! MXFP8, so whether every product of two matrices is exact follows from their scale bytes.
//!
//! An MXFP8 value with scale byte `s` is a multiple of `2^(s - 127 - 9)` (E4M3's least subnormal
//! is `2^-9`) with at most 4 significant bits and below `448 * 2^(s - 127)`. A product of an
//! activation (scale byte `sa`) and a weight (`sw`) has at most 8 significant bits and is a
//! multiple of `2^(sa + sw - 272)`: f32 holds it exactly down to `2^-149`, so from
//! `sa + sw >= 123`; it is below `448^2 * 2^(sa + sw - 254) < 2^(sa + sw - 236)`, and with 8
//! significant bits finite (and exact) below `2^128`, so up to `sa + sw <= 364`. Each operand
//! must itself be finite: scale bytes up to 246 (`448 * 2^119 < 2^128`).
//!
//! Where every product is exact, a sum may also be kept divided by a power of two `D` (the
//! fused kernel's `256 * scale` of each weight block, `2^(sw - 119)`) and multiplied back at the
//! block's end, with the same bits: rounding to f32 commutes with scaling by a power of two
//! wherever neither side rounds below `2^-126` or overflows. Every value of a GEMM (product,
//! partial sum, rounded or not) is a multiple of `q = 2^(sa_min + sw_min - 272)`, and of `q / D`
//! once divided; a multiple of `2^-149` below `2^-126` is a subnormal f32 exactly, so rounds
//! nowhere (and, having at most 23 significant bits, is exact on the other side too). So from
//! `sa_min + sw_min - sw_max >= 4` (`q / D >= 2^-149` for the largest `D`) nothing rounds in the
//! subnormal range on either side. A partial sum of `k` products stays below
//! `2k * 2^(sa_max + sw_max - 236)` (each rounding adds at most `2^-24` of it, and
//! `(1 + 2^-24)^k <= 2` for `k` up to `2^23`), and below that
//! over `D`: finite on both sides up to `sa_max + sw_max + log2(2k) <= 363` and
//! `sa_max + sw_max - sw_min + log2(2k) <= 244`. `1 / D` must be a normal f32 for the kernel to
//! build it from its exponent: scale bytes up to 245.

use super::MxMatrix;
use crate::{e4m3, e8m0};

/// The least sum of an activation's and a weight's scale bytes whose products are exact.
const MIN_EXACT_SCALE_SUM: u16 = 123;
/// The largest such sum.
const MAX_EXACT_SCALE_SUM: u16 = 364;
/// The largest scale byte whose every MXFP8 value is finite.
const MAX_FINITE_SCALE: u8 = 246;
/// The least `sa_min + sw_min - sw_max` at which sums divided by a weight block's `256 * scale`
/// never round below `2^-126`.
const MIN_UNSCALED_QUANTUM: i32 = 4;
/// The largest weight scale byte whose `1 / (256 * scale)` is a normal f32 (`2^-126`).
const MAX_UNSCALED_SCALE: u8 = 245;
/// The deepest GEMM whose roundings grow a sum by at most 2x (`(1 + 2^-24)^k <= 2`).
const MAX_UNSCALED_DEPTH: usize = 1 << 23;

/// The least and largest of a matrix's scale bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ScaleRange {
    pub min: u8,
    pub max: u8,
}

impl ScaleRange {
    /// The range of no bytes (what [`Self::with`] starts from).
    pub const EMPTY: Self = Self { min: u8::MAX, max: 0 };

    pub fn of(bytes: &[u8]) -> Self {
        Self::EMPTY.with(bytes)
    }

    /// This range widened to take in `bytes`.
    pub fn with(self, bytes: &[u8]) -> Self {
        // A fold (which vectorizes) rather than `min` and `max` (two passes).
        let (min, max) = bytes.iter().fold((self.min, self.max), |(lo, hi), &s| (lo.min(s), hi.max(s)));
        Self { min, max }
    }

    /// The activations' range; None where one is NaN or not finite (a NaN element or scale
    /// byte, a scale byte above 246): which NaN a sum ends with would depend on the order of
    /// the operations.
    pub fn of_activations(a: &MxMatrix) -> Option<Self> {
        let range = Self::of(&a.scales);
        let nan = a.elements.iter().fold(false, |nan, &b| nan | e4m3::is_nan(b));
        (!nan && range.max <= MAX_FINITE_SCALE && range.max != e8m0::NAN_BYTE).then_some(range)
    }

    /// Whether every product of activations in this range (from [`Self::of_activations`]) with
    /// weights in range `w` (NaN-free) is exact in f32.
    pub fn exact_products(self, w: ScaleRange) -> bool {
        w.max <= MAX_FINITE_SCALE
            && u16::from(self.min) + u16::from(w.min) >= MIN_EXACT_SCALE_SUM
            && u16::from(self.max) + u16::from(w.max) <= MAX_EXACT_SCALE_SUM
    }

    /// Whether, besides [`Self::exact_products`], the sums of a GEMM of depth `k` over these
    /// activations and weights in range `w` keep their bits when each weight block's sums are
    /// kept divided by its `256 * scale` (module docs): then each weight is decoded without
    /// its multiply by the scale, and each sum is scaled twice per block instead.
    pub fn exact_unscaled(self, w: ScaleRange, k: usize) -> bool {
        let (a_min, a_max, w_min, w_max) = (i32::from(self.min), i32::from(self.max), i32::from(w.min), i32::from(w.max));
        // log2(2k), rounded up.
        let k_bits = (2 * k.max(1)).next_power_of_two().trailing_zeros() as i32;
        self.exact_products(w)
            && k <= MAX_UNSCALED_DEPTH
            && w.max <= MAX_UNSCALED_SCALE
            && a_min + w_min - w_max >= MIN_UNSCALED_QUANTUM
            && a_max + w_max + k_bits <= 363
            && a_max + w_max - w_min + k_bits <= 244
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Activations that are NaN or not finite never fuse.
    #[test]
    fn activation_ranges_exclude_nan_and_infinite_activations() {
        let a = |elements: Vec<u8>, scales: Vec<u8>| MxMatrix { rows: 1, k: elements.len(), elements, scales };
        let range = |min, max| Some(ScaleRange { min, max });
        assert_eq!(ScaleRange::of_activations(&a(vec![1; 64], vec![200, 3])), range(3, 200));
        assert_eq!(ScaleRange::of_activations(&a(vec![1; 64], vec![0, MAX_FINITE_SCALE])), range(0, 246));
        assert_eq!(ScaleRange::of_activations(&a(vec![1; 64], vec![127, MAX_FINITE_SCALE + 1])), None, "values above f32's range");
        assert_eq!(ScaleRange::of_activations(&a(vec![1; 64], vec![127, e8m0::NAN_BYTE])), None, "a NaN scale");
        for nan in [0x7F, 0xFF] {
            let mut elements = vec![1; 64];
            elements[40] = nan;
            assert_eq!(ScaleRange::of_activations(&a(elements, vec![127, 127])), None, "a NaN element {nan:#x}");
        }
    }

    /// The bounds, on both sides, and weights that are not finite.
    #[test]
    fn products_are_exact_between_the_bounds() {
        let r = |min, max| ScaleRange { min, max };
        assert!(r(61, 127).exact_products(r(62, 127)));
        assert!(!r(61, 127).exact_products(r(61, 127)), "a sum of 122");
        assert!(r(100, 118).exact_products(r(100, 246)));
        assert!(!r(100, 119).exact_products(r(100, 246)), "a sum of 365");
        assert!(!r(0, 0).exact_products(r(123, 247)), "weights above f32's range");
    }

    /// Each bound of [`ScaleRange::exact_unscaled`], on both sides.
    #[test]
    fn sums_keep_their_bits_unscaled_between_the_bounds() {
        let r = |min, max| ScaleRange { min, max };
        // The quantum: sa_min + sw_min - sw_max >= 4.
        assert!(r(14, 127).exact_unscaled(r(110, 120), 256));
        assert!(!r(13, 127).exact_unscaled(r(110, 120), 256), "a quantum of 2^-150 once divided");
        assert!(!r(14, 127).exact_unscaled(r(110, 121), 256), "a quantum of 2^-150 once divided");
        assert!(r(4, 127).exact_unscaled(r(119, 119), 256));
        assert!(!r(3, 127).exact_unscaled(r(120, 120), 256), "a quantum of 2^-150 once divided");
        assert!(!r(0, 0).exact_unscaled(r(122, 122), 1), "products that are not exact");
        // Undivided sums below 2^128: sa_max + sw_max + log2(2k) <= 363 (k = 256: 9 bits).
        assert!(r(200, 200).exact_unscaled(r(154, 154), 256));
        assert!(!r(200, 201).exact_unscaled(r(154, 154), 256));
        assert!(!r(200, 200).exact_unscaled(r(154, 154), 257), "one more bit of depth");
        assert!(r(200, 200).exact_unscaled(r(155, 155), 128));
        // Divided sums below 2^128: sa_max + sw_max - sw_min + log2(2k) <= 244.
        assert!(r(100, 243).exact_unscaled(r(100, 100), 1));
        assert!(!r(100, 244).exact_unscaled(r(100, 100), 1));
        assert!(r(100, 200).exact_unscaled(r(100, 143), 1));
        assert!(!r(100, 200).exact_unscaled(r(100, 144), 1));
        // 1 / (256 * scale) normal: weight scale bytes up to 245.
        assert!(r(20, 20).exact_unscaled(r(245, 245), 256));
        assert!(!r(20, 20).exact_unscaled(r(246, 246), 256));
        // Roundings grow a sum by at most 2x: depths up to 2^23.
        assert!(r(127, 127).exact_unscaled(r(127, 127), 1 << 23));
        assert!(!r(127, 127).exact_unscaled(r(127, 127), (1 << 23) + 1));
    }
}
