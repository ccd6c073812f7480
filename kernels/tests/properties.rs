//! Property tests: the permutations are bijections that invert; MXFP8 quantization commutes
//! with both permutations bit for bit; swizzle and pack invert.

use orchestrator_kernels::layout::{pack_ue8m0_mn_major, swizzle_128x4, swizzled_len, unpack_ue8m0_mn_major, unswizzle_128x4};
use orchestrator_kernels::mxfp8::{ScaleRule, quantize_f32_rows};
use orchestrator_kernels::permutation::{O_CHUNK, Permutation, gather_runs};
use proptest::prelude::*;

fn rule() -> impl Strategy<Value = ScaleRule> {
    prop_oneof![Just(ScaleRule::Rceil), Just(ScaleRule::Floor)]
}

/// Finite f32 values spanning many binades (zeros and subnormals included), from a seed:
/// cheap to generate in the sizes the permutations need.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut z = seed;
    (0..n)
        .map(|_| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^= x >> 31;
            match x % 8 {
                0 => 0.0,
                1 => f32::from_bits((x >> 8) as u32 & 0x007F_FFFF | 1),
                _ => {
                    // Random sign, exponent in [-40, 40], random mantissa.
                    let exp = ((x >> 8) % 81) as u32 + 127 - 40;
                    f32::from_bits(((x >> 40) as u32 & 0x8000_0000) | (exp << 23) | ((x >> 16) as u32 & 0x007F_FFFF))
                }
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn q_permutation_is_a_bijection_that_inverts(h in 1usize..=16) {
        let p = Permutation::q_rows(h * 8, 512).unwrap();
        prop_assert!(Permutation::from_map(p.as_slice().to_vec()).is_ok());
        let inv = p.inverse();
        let items: Vec<u32> = (0..p.len() as u32).collect();
        prop_assert_eq!(inv.apply(&p.apply(&items)), items.clone());
        prop_assert_eq!(p.apply(&inv.apply(&items)), items);
    }

    #[test]
    fn o_permutation_is_a_bijection_that_inverts(_x in 0u8..1) {
        let p = Permutation::o_columns(512).unwrap();
        prop_assert!(Permutation::from_map(p.as_slice().to_vec()).is_ok());
        let items: Vec<u32> = (0..4096).collect();
        prop_assert_eq!(p.inverse().apply(&p.apply(&items)), items);
        let c = p.of_chunks(O_CHUNK).unwrap();
        prop_assert_eq!(c.inverse().apply(&c.apply(&(0..128u32).collect::<Vec<_>>())), (0..128u32).collect::<Vec<_>>());
    }

    /// Quantizing then permuting Q rows equals permuting then quantizing, bit for bit.
    #[test]
    fn quantization_commutes_with_the_q_permutation(seed in any::<u64>(), rule in rule()) {
        let vals = values(8 * 512 * 64, seed);
        let (rows, k) = (8 * 512, 64);
        let perm = Permutation::q_rows(8, 512).unwrap();
        let (mut e, mut s) = (Vec::new(), Vec::new());
        quantize_f32_rows(&vals, k, rule, &mut e, &mut s).unwrap();
        let (mut pe, mut ps) = (Vec::new(), Vec::new());
        gather_runs(&e, rows * k, k, &perm, &mut pe).unwrap();
        gather_runs(&s, rows * 2, 2, &perm, &mut ps).unwrap();
        let permuted: Vec<f32> = perm.as_slice().iter().flat_map(|&r| vals[r as usize * k..(r as usize + 1) * k].iter().copied()).collect();
        let (mut qe, mut qs) = (Vec::new(), Vec::new());
        quantize_f32_rows(&permuted, k, rule, &mut qe, &mut qs).unwrap();
        prop_assert_eq!(pe, qe);
        prop_assert_eq!(ps, qs);
    }

    /// Quantizing then permuting O columns (and scale chunks) equals permuting then quantizing.
    #[test]
    fn quantization_commutes_with_the_o_permutation(seed in any::<u64>(), rule in rule()) {
        let vals = values(3 * 4096, seed);
        let k = 4096;
        let cols = Permutation::o_columns(512).unwrap();
        let chunks = cols.of_chunks(O_CHUNK).unwrap();
        let (mut e, mut s) = (Vec::new(), Vec::new());
        quantize_f32_rows(&vals, k, rule, &mut e, &mut s).unwrap();
        let (mut pe, mut ps) = (Vec::new(), Vec::new());
        gather_runs(&e, k, O_CHUNK, &chunks, &mut pe).unwrap();
        gather_runs(&s, k / 32, 1, &chunks, &mut ps).unwrap();
        let permuted: Vec<f32> = vals.chunks(k).flat_map(|row| cols.apply(row)).collect();
        let (mut qe, mut qs) = (Vec::new(), Vec::new());
        quantize_f32_rows(&permuted, k, rule, &mut qe, &mut qs).unwrap();
        prop_assert_eq!(pe, qe);
        prop_assert_eq!(ps, qs);
    }

    #[test]
    fn swizzle_inverts(m in 1usize..400, c in 1usize..50, seed in any::<u64>()) {
        let scale: Vec<u8> = (0..m * c).map(|i| ((i as u64).wrapping_mul(seed | 1) >> 7) as u8 | 1).collect();
        let mut sw = Vec::new();
        swizzle_128x4(&scale, m, c, &mut sw).unwrap();
        prop_assert_eq!(sw.len(), swizzled_len(m, c));
        // Every input byte lands on its own offset.
        prop_assert_eq!(sw.iter().filter(|&&b| b != 0).count(), m * c);
        let mut back = Vec::new();
        unswizzle_128x4(&sw, m, c, &mut back).unwrap();
        prop_assert_eq!(back, scale);
    }

    #[test]
    fn pack_inverts(groups in 1usize..4, rows4 in 1usize..40, c4 in 1usize..40, seed in any::<u64>()) {
        let (rows, c) = (rows4 * 4, c4 * 4);
        let scale: Vec<u8> = (0..groups * rows * c).map(|i| ((i as u64).wrapping_mul(seed | 1) >> 9) as u8).collect();
        let mut packed = Vec::new();
        pack_ue8m0_mn_major(&scale, groups, rows, c, &mut packed).unwrap();
        // Storage order [g][k4][row][4]: spot-check against the reshape/transpose definition.
        let (g, r, q) = (groups - 1, rows - 1, c4 - 1);
        let at = ((g * c4 + q) * rows + r) * 4;
        prop_assert_eq!(&packed[at..at + 4], &scale[(g * rows + r) * c + q * 4..][..4]);
        let mut back = Vec::new();
        unpack_ue8m0_mn_major(&packed, groups, rows, c, &mut back).unwrap();
        prop_assert_eq!(back, scale);
    }
}

mod fused_load {
    use orchestrator_kernels::params::{CheckpointOrder, Fused, HostBytes, Mx, OPermutation, QPermutation, WeightSource, WoA, WqB};
    use orchestrator_kernels::{BufferPool, CpuBackend, ScaleRule};
    use proptest::prelude::*;

    fn bytes(n: usize, seed: u64, f: impl Fn(u64) -> u8) -> Vec<u8> {
        (0..n as u64).map(|i| f((i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40)).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]

        /// Gathering straight from the source equals loading in checkpoint order, then permuting.
        #[test]
        fn from_source_permuted_equals_from_source_then_permute(seed in any::<u64>(), heads8 in 1usize..3) {
            let cpu = CpuBackend;
            let mut pool = BufferPool::<CpuBackend>::default();
            let e4m3 = |x: u64| (x as u8) & 0x7E; // never NaN
            // wq_b: [heads*512, 64] with 32x32 block scales.
            let (rows, k) = (heads8 * 8 * 512, 64);
            let w = bytes(rows * k, seed, e4m3);
            let s = bytes(rows / 32 * 2, seed, |x| 110 + (x % 8) as u8);
            let q = QPermutation::new(heads8 * 8, 512).unwrap();
            let src = || WeightSource::Fp8 { weight: HostBytes::Borrowed(&w), block_scale: &s, block: [32, 32] };
            let a = Mx::<CpuBackend, WqB, Fused>::from_source_permuted(&cpu, src(), rows, k, ScaleRule::Rceil, &q, &mut pool).unwrap().0;
            let b = Mx::<CpuBackend, WqB, CheckpointOrder>::from_source(&cpu, src(), rows, k, ScaleRule::Rceil, &mut pool).unwrap().0.permute(&cpu, &q, &mut pool).unwrap();
            prop_assert_eq!(a.to_host(&cpu).unwrap(), b.to_host(&cpu).unwrap());
            // wo_a: [64, 4096].
            let (rows, k) = (64, 4096);
            let w = bytes(rows * k, seed ^ 1, e4m3);
            let s = bytes(rows / 32 * 128, seed ^ 1, |x| 110 + (x % 8) as u8);
            let o = OPermutation::new(512).unwrap();
            let src = || WeightSource::Fp8 { weight: HostBytes::Borrowed(&w), block_scale: &s, block: [32, 32] };
            let a = Mx::<CpuBackend, WoA, Fused>::from_source_permuted(&cpu, src(), rows, k, ScaleRule::Rceil, &o, &mut pool).unwrap().0;
            let b = Mx::<CpuBackend, WoA, CheckpointOrder>::from_source(&cpu, src(), rows, k, ScaleRule::Rceil, &mut pool).unwrap().0.permute(&cpu, &o, &mut pool).unwrap();
            prop_assert_eq!(a.to_host(&cpu).unwrap(), b.to_host(&cpu).unwrap());
        }
    }
}
