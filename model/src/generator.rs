//! The counter-based generator behind synthetic checkpoints and dummy loads. Every value is a
//! pure function of (seed, tensor name, element index), so any slice of any tensor can be
//! generated alone, and a dummy load with seed S is byte-identical to a real load of a
//! checkpoint synthesized with seed S.
//!
//! Distributions: E4M3 weights are a symmetric triangular distribution spanning +-448
//! (never NaN); UE8M0 block scales lie in 112..=118 (2^-15..2^-9, the range real FP8
//! checkpoints show for weights of std ~0.02); BF16 weights are ~N(0, 0.02) (Irwin-Hall of four
//! uniforms); F32 `attn_sink` values are ~N(0, 1).

use safetensors::Dtype;

use std::sync::OnceLock;

use crate::names::{Part, TensorSpec};
use orchestrator_kernels::e4m3;

/// E4M3 bytes of the triangular distribution: the sum `s` of two uniform bytes maps to
/// `(s - 255) * 448 / 255`, rounded to E4M3 (never NaN).
fn triangular_e4m3() -> &'static [u8; 511] {
    static TABLE: OnceLock<[u8; 511]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [0u8; 511];
        for (s, slot) in t.iter_mut().enumerate() {
            *slot = e4m3::from_f32_saturating((s as f32 - 255.0) * (448.0 / 255.0));
        }
        t
    })
}

/// Lowest and highest generated scale byte.
pub const SCALE_BYTE_RANGE: (u8, u8) = (112, 118);

/// The generator for one seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Generator {
    pub seed: u64,
}

/// SplitMix64's output function at counter `i` of stream `key`: a counter-based generator.
#[inline]
fn mix(key: u64, i: u64) -> u64 {
    let mut z = key.wrapping_add(i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Standard deviation of the sum of four uniform u16 values.
const IRWIN_HALL4_U16_STD: f32 = 37_837.23;
const IRWIN_HALL4_U16_MEAN: i64 = 2 * 65_535;

#[inline]
fn irwin_hall4(word: u64) -> f32 {
    let s = (word & 0xFFFF) + ((word >> 16) & 0xFFFF) + ((word >> 32) & 0xFFFF) + (word >> 48);
    (s as i64 - IRWIN_HALL4_U16_MEAN) as f32 / IRWIN_HALL4_U16_STD
}

/// f32 -> BF16 bits, round to nearest even (inputs are finite).
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let round = 0x7FFF + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

impl Generator {
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// The stream key of one tensor.
    pub fn key(&self, tensor_name: &str) -> u64 {
        twox_hash::XxHash3_64::oneshot_with_seed(self.seed, tensor_name.as_bytes())
    }

    /// Writes elements `start .. start + n` of `spec` (row-major element indices) as stored
    /// bytes into `out` (`n * element size` bytes).
    pub fn fill(&self, spec: &TensorSpec, start: usize, out: &mut [u8]) {
        let key = self.key(&spec.name);
        match (spec.dtype, spec.part) {
            (Dtype::F8_E4M3, _) => {
                let table = triangular_e4m3();
                fill_bytes(key, start, out, |bits| table[((bits & 0xFF) + (bits >> 8)) as usize])
            }
            (Dtype::F8_E8M0, _) | (_, Part::Scale) => {
                let span = (SCALE_BYTE_RANGE.1 - SCALE_BYTE_RANGE.0 + 1) as u16;
                fill_bytes(key, start, out, |pair| SCALE_BYTE_RANGE.0 + ((pair % span) as u8))
            }
            (Dtype::BF16, _) => {
                for (j, slot) in out.chunks_exact_mut(2).enumerate() {
                    let v = irwin_hall4(mix(key, (start + j) as u64)) * 0.02;
                    slot.copy_from_slice(&f32_to_bf16_bits(v).to_le_bytes());
                }
            }
            _ => {
                // F32 (attn_sink) and anything else 4 bytes wide.
                for (j, slot) in out.chunks_exact_mut(4).enumerate() {
                    let v = irwin_hall4(mix(key, (start + j) as u64));
                    slot.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }

    /// `n` values ~N(0, 1) of the stream `name` (probe inputs).
    pub fn normal_f32(&self, name: &str, n: usize) -> Vec<f32> {
        let key = self.key(name);
        (0..n).map(|i| irwin_hall4(mix(key, i as u64))).collect()
    }

    /// The whole tensor.
    pub fn tensor(&self, spec: &TensorSpec) -> Vec<u8> {
        let mut out = vec![0u8; spec.bytes()];
        self.fill(spec, 0, &mut out);
        out
    }

    /// Rows `rows` and columns `cols` of a 2-D tensor (1-D tensors: one row), row-major.
    pub fn slice(&self, spec: &TensorSpec, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>, out: &mut Vec<u8>) {
        let width = spec.cols();
        let es = spec.element_bytes();
        let seg = cols.len() * es;
        out.clear();
        out.resize(rows.len() * seg, 0);
        if cols.start == 0 && cols.end == width {
            self.fill(spec, rows.start * width, out);
            return;
        }
        for (i, r) in rows.enumerate() {
            self.fill(spec, r * width + cols.start, &mut out[i * seg..(i + 1) * seg]);
        }
    }
}

/// Byte-valued elements: element `i` uses 16 random bits, bits `16*(i%4)..` of word `i/4`.
#[inline]
fn fill_bytes(key: u64, start: usize, out: &mut [u8], f: impl Fn(u16) -> u8) {
    let mut i = start;
    let mut o = 0;
    while o < out.len() {
        let word = mix(key, (i / 4) as u64);
        let lane = i % 4;
        let take = (4 - lane).min(out.len() - o);
        for l in 0..take {
            let bits = (word >> (16 * (lane + l))) as u16;
            out[o + l] = f(bits);
        }
        i += take;
        o += take;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Preset, WeightFormat};
    use crate::names::layer_tensors;
    use proptest::prelude::*;

    fn specs(format: WeightFormat) -> Vec<TensorSpec> {
        layer_tensors(&Preset::Tiny.geometry(), format, 1)
    }

    #[test]
    fn values_have_the_promised_ranges() {
        let g = Generator::new(7);
        for spec in specs(WeightFormat::Fp8 { block: [32, 32] }) {
            let bytes = g.tensor(&spec);
            match spec.dtype {
                Dtype::F8_E4M3 => assert!(bytes.iter().all(|&b| b & 0x7F != 0x7F), "{}", spec.name),
                Dtype::F8_E8M0 => assert!(bytes.iter().all(|&b| (112..=118).contains(&b)), "{}", spec.name),
                _ => {}
            }
        }
        let bf = specs(WeightFormat::Bf16).into_iter().find(|s| s.dtype == Dtype::BF16).unwrap();
        let bytes = g.tensor(&bf);
        let vals: Vec<f32> = bytes.chunks_exact(2).map(|p| f32::from_bits((u16::from_le_bytes([p[0], p[1]]) as u32) << 16)).collect();
        let n = vals.len() as f32;
        let mean = vals.iter().sum::<f32>() / n;
        let std = (vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n).sqrt();
        assert!(mean.abs() < 0.001, "mean {mean}");
        assert!((std - 0.02).abs() < 0.001, "std {std}");
    }

    #[test]
    fn seeds_and_names_give_different_streams() {
        let spec = &specs(WeightFormat::Fp8 { block: [32, 32] })[0];
        assert_ne!(Generator::new(1).tensor(spec), Generator::new(2).tensor(spec));
        let other = TensorSpec { name: "layers.9.attn.wq_b.weight".into(), ..spec.clone() };
        assert_ne!(Generator::new(1).tensor(spec), Generator::new(1).tensor(&other));
    }

    proptest! {
        /// Any slice of a generated tensor equals the same slice of the whole tensor.
        #[test]
        fn slices_equal_slices_of_the_whole(
            which in 0usize..7, r0 in 0usize..64, rl in 1usize..64, c0 in 0usize..64, cl in 1usize..64, seed in any::<u64>(),
            bf16 in any::<bool>(),
        ) {
            let format = if bf16 { WeightFormat::Bf16 } else { WeightFormat::Fp8 { block: [32, 32] } };
            let all = specs(format);
            let spec = &all[which % all.len()];
            let g = Generator::new(seed);
            let whole = g.tensor(spec);
            let (rows_total, width) = if spec.shape.len() == 2 { (spec.shape[0], spec.shape[1]) } else { (1, spec.shape[0]) };
            let r0 = r0 % rows_total;
            let rows = r0..(r0 + rl).min(rows_total);
            let c0 = c0 % width;
            let cols = c0..(c0 + cl).min(width);
            let mut got = Vec::new();
            g.slice(spec, rows.clone(), cols.clone(), &mut got);
            let es = spec.element_bytes();
            let mut want = Vec::new();
            for r in rows {
                want.extend_from_slice(&whole[(r * width + cols.start) * es..(r * width + cols.end) * es]);
            }
            prop_assert_eq!(got, want);
        }
    }
}
