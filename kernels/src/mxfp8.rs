//! MXFP8 quantization (spec section 6): 32-element blocks along K, one UE8M0 scale per block,
//! E4M3fn elements with round-to-nearest-even and saturation. Both scale rules, computed
//! exactly from the f32 bit patterns (never with a floating-point `log2`).

use crate::backend::resize_for_overwrite;
use crate::permutation::BlockOrder;
use crate::{KernelError, e4m3, e8m0};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// Elements per scale block along K.
pub const BLOCK: usize = 32;

/// How a block's shared scale exponent is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleRule {
    /// `2^ceil(log2(amax / 448))` (cuBLAS, TransformerEngine, DeepGEMM `ceil_to_ue8m0`):
    /// elements never exceed 448. The default: SM100 kernels use it.
    Rceil,
    /// `2^(floor(log2(amax)) - 8)` (OCP MX v1.0, torchao's default): elements clamped to 448.
    Floor,
}

impl ScaleRule {
    pub fn name(self) -> &'static str {
        match self {
            ScaleRule::Rceil => "rceil",
            ScaleRule::Floor => "floor",
        }
    }
}

impl std::str::FromStr for ScaleRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "rceil" => Ok(ScaleRule::Rceil),
            "floor" => Ok(ScaleRule::Floor),
            other => Err(format!("unknown scale rule `{other}` (expected `rceil` or `floor`)")),
        }
    }
}

impl std::fmt::Display for ScaleRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The true binary exponent `floor(log2(x))` of a positive finite f32, subnormals included.
#[inline]
fn binary_exponent(bits: u32) -> i32 {
    let biased = (bits >> 23) as i32;
    if biased != 0 {
        biased - 127
    } else {
        // Subnormal: value = mantissa * 2^-149.
        let mant = bits & 0x7F_FFFF;
        (31 - mant.leading_zeros() as i32) - 149
    }
}

/// True when a positive finite f32 is an exact power of two.
#[inline]
fn is_power_of_two(bits: u32) -> bool {
    if bits >> 23 != 0 { bits & 0x7F_FFFF == 0 } else { (bits & 0x7F_FFFF).is_power_of_two() }
}

/// The scale exponent of a block whose largest magnitude is `amax` (finite, > 0), clamped to
/// `[-127, 127]`.
#[inline]
pub fn scale_exponent(amax: f32, rule: ScaleRule) -> i32 {
    debug_assert!(amax.is_finite() && amax > 0.0);
    let e = match rule {
        ScaleRule::Rceil => {
            let s = amax / e4m3::E4M3_MAX; // an f32 division, as DeepGEMM does
            let sb = s.to_bits();
            if sb == 0 {
                // amax / 448 underflowed: its true exponent is below the clamp anyway.
                -127
            } else {
                binary_exponent(sb) + i32::from(!is_power_of_two(sb))
            }
        }
        ScaleRule::Floor => binary_exponent(amax.to_bits()) - 8,
    };
    e.clamp(-127, 127)
}

/// [`scale_exponent`] of a block whose largest magnitude is the BF16 `amax` (bits, finite and
/// nonzero), without the division where its exponent field is 10 or more: `amax / 448` has
/// amax's exponent less 8 where its 7 mantissa bits `f` are at least 96 (1 + f / 128 >= 1.75),
/// else less 9, and is a power of two only at `f = 96` (1.75 / 1.75), so RCEIL's exponent is
/// amax's less 8, plus 1 where `f > 96`; no clamp bites. The AVX-512 quantizer computes the same
/// (`(f + 31) >> 7`); `bf16_scale_exponent_is_the_divisions` checks every magnitude.
#[inline(always)]
fn bf16_scale_exponent(amax: u16, rule: ScaleRule) -> i32 {
    let biased = i32::from(amax >> 7);
    if biased < 10 {
        return scale_exponent(f32::from_bits(u32::from(amax) << 16), rule);
    }
    let up = match rule {
        ScaleRule::Rceil => i32::from(amax & 0x7F > 96),
        ScaleRule::Floor => 0,
    };
    biased - 127 - 8 + up
}

/// Quantizes one block of at most 32 values: returns the scale byte and writes the elements.
/// `values` must be finite (checked by the callers, which know the tensor and row).
#[inline]
pub fn quantize_block(values: &[f32], rule: ScaleRule, out: &mut [u8]) -> u8 {
    debug_assert_eq!(values.len(), out.len());
    let amax_bits = values.iter().map(|v| v.to_bits() & 0x7FFF_FFFF).max().unwrap_or(0);
    if amax_bits == 0 {
        out.fill(0);
        return 0;
    }
    let e = scale_exponent(f32::from_bits(amax_bits), rule);
    let inv = e8m0::pow2(-e); // exact: -e is within [-127, 127]
    for (o, &v) in out.iter_mut().zip(values) {
        *o = e4m3::from_f32_saturating(v * inv);
    }
    (e + e8m0::BIAS) as u8
}

/// Where a non-finite value sits in a row-major `[rows, k]` matrix.
fn non_finite_at(index: usize, k: usize) -> KernelError {
    KernelError::NonFinite { row: index / k, col: index % k }
}

/// MXFP8-quantizes a row-major BF16 matrix `[rows, k]` (little-endian bytes) along K:
/// `elements` gets `[rows, k]` E4M3 bytes, `scales` gets `[rows, k/32]` UE8M0 bytes.
/// NaN or infinity is an error naming the row and column. Bit-identical to
/// [`quantize_f32_rows`] on the same values.
pub fn quantize_bf16_rows(
    bf16: &[u8],
    rows: usize,
    k: usize,
    rule: ScaleRule,
    elements: &mut Vec<u8>,
    scales: &mut Vec<u8>,
) -> Result<(), KernelError> {
    quantize_bf16_ordered(bf16, rows, k, rule, BlockOrder::Identity, elements, scales)
}

/// [`quantize_bf16_rows`] writing straight into a permuted layout: block by block, each
/// destination block quantizes the source block `order` names. Because permutations move
/// whole 32-element blocks, this equals quantizing, then permuting, bit for bit. Errors name
/// the source (checkpoint-order) row and column.
pub fn quantize_bf16_ordered(
    bf16: &[u8],
    rows: usize,
    k: usize,
    rule: ScaleRule,
    order: BlockOrder<'_>,
    elements: &mut Vec<u8>,
    scales: &mut Vec<u8>,
) -> Result<(), KernelError> {
    quantize_rows_with(bf16, rows, k, rule, order, elements, scales, |_, _, _| {})
}

/// [`quantize_bf16_ordered`], also returning the digests of the BF16 bytes as stored, of the
/// E4M3 bytes as placed, and of the quantization in checkpoint order (elements and scales),
/// taken row by row while each row is in cache. Rows are quantized in checkpoint order; when
/// rows move (`Rows`), the placed bytes are digested in a pass of their own.
pub fn quantize_bf16_placed(
    bf16: &[u8],
    rows: usize,
    k: usize,
    rule: ScaleRule,
    order: BlockOrder<'_>,
    elements: &mut Vec<u8>,
    scales: &mut Vec<u8>,
) -> Result<crate::placement::Placed, KernelError> {
    use crate::digest::DigestStream;
    let rows_move = matches!(order, BlockOrder::Rows(_));
    // Chunks: checkpoint block `s` of a row sits at destination block `at[s]`.
    let at = match order {
        BlockOrder::Chunks(p) => Some(p.inverse_map()),
        _ => None,
    };
    let (mut source, mut placed) = (DigestStream::new(), DigestStream::new());
    let (mut ck_elements, mut ck_scales) = (DigestStream::new(), DigestStream::new());
    let (mut row_buf, mut scale_buf) = (Vec::new(), Vec::new());
    quantize_rows_with(bf16, rows, k, rule, order, elements, scales, |src_row, dst_row, scale_row| {
        source.update(src_row);
        if !rows_move {
            placed.update(dst_row);
        }
        match &at {
            Some(at) => {
                row_buf.clear();
                scale_buf.clear();
                for &j in *at {
                    let j = j as usize;
                    row_buf.extend_from_slice(&dst_row[j * BLOCK..(j + 1) * BLOCK]);
                    scale_buf.push(scale_row[j]);
                }
                ck_elements.update(&row_buf);
                ck_scales.update(&scale_buf);
            }
            None => {
                // In checkpoint order the placed bytes are the checkpoint-order bytes.
                if rows_move {
                    ck_elements.update(dst_row);
                }
                ck_scales.update(scale_row);
            }
        }
    })?;
    let placed = if rows_move { crate::Digest::of(elements) } else { placed.finish() };
    let ck_elements = if at.is_some() || rows_move { ck_elements.finish() } else { placed };
    let quantized = crate::placement::QuantizedDigests { elements: ck_elements, scales: ck_scales.finish() };
    Ok(crate::placement::Placed { source: source.finish(), placed, quantized: Some(quantized) })
}

/// The quantization loop, in checkpoint (source) row order: source row `s` goes to destination
/// row `s`, or for `Rows(p)` to the row `f` with `p[f] = s`; `after_row(source row bytes,
/// destination row, its scales)` runs after each row is written.
#[allow(clippy::too_many_arguments)]
fn quantize_rows_with(
    bf16: &[u8],
    rows: usize,
    k: usize,
    rule: ScaleRule,
    order: BlockOrder<'_>,
    elements: &mut Vec<u8>,
    scales: &mut Vec<u8>,
    after_row: impl FnMut(&[u8], &[u8], &[u8]),
) -> Result<(), KernelError> {
    if !k.is_multiple_of(BLOCK) || bf16.len() != rows * k * 2 {
        return Err(KernelError::Shape(format!("BF16 matrix of {} bytes is not [{rows}, {k}] with K a multiple of {BLOCK}", bf16.len())));
    }
    let blocks = k / BLOCK;
    match order {
        BlockOrder::Rows(p) if p.len() != rows => {
            return Err(KernelError::Shape(format!("row permutation of {} rows applied to {rows}", p.len())));
        }
        BlockOrder::Chunks(p) if p.len() != blocks => {
            return Err(KernelError::Shape(format!("block permutation of {} blocks applied to {blocks} per row", p.len())));
        }
        _ => {}
    }
    // Every byte is overwritten below: no need to clear first.
    resize_for_overwrite(elements, rows * k);
    resize_for_overwrite(scales, rows * blocks);
    if k == 0 {
        return Ok(());
    }
    let dst_of = match order {
        BlockOrder::Rows(p) => Some(p.inverse_map()),
        _ => None,
    };
    let src = Rows { bf16, k, rule, order, dst_of };
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // Blocks four at a time where a row's groups allow, else one by one. SAFETY: the CPU
        // has the instructions (checked just above), and `one` and `four` run inside
        // `with_instructions`.
        return unsafe {
            avx512::with_instructions(|| {
                quantize_rows_body(
                    src,
                    elements,
                    scales,
                    after_row,
                    |src, rule, dst| avx512::one(src, rule, dst),
                    |src, rule, dst| avx512::four(src, rule, dst),
                )
            })
        };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // Blocks four at a time by `avx2::four` where it takes them, else one by one by the
        // plain loop, all compiled with AVX2: the plain loop called through a closure defined
        // in that code (handed to the loop as a function item, as `simd::dispatch!` did, it was
        // called through a `Fn::call` shim compiled for the baseline, SSE2: about a third of a
        // warm BF16 reload's samples on an AVX2-only CPU). SAFETY: the CPU has AVX2 (checked
        // just above), and `four` runs inside `with_instructions`.
        return unsafe {
            avx2::with_instructions(|| {
                let one = |src: &[u8; BLOCK * 2], rule, dst: &mut [u8]| quantize_bf16_block(src, rule, dst);
                quantize_rows_body(src, elements, scales, after_row, one, |src, rule, dst| avx2::four(src, rule, dst))
            })
        };
    }
    quantize_rows_body(src, elements, scales, after_row, quantize_bf16_block, |_, _, _| None)
}

/// The validated source of [`quantize_rows_body`]: `[rows, k]` BF16 bytes, the scale rule, the
/// block order and, where rows move, the destination row of each source row.
#[derive(Clone, Copy)]
struct Rows<'a> {
    bf16: &'a [u8],
    k: usize,
    rule: ScaleRule,
    order: BlockOrder<'a>,
    dst_of: Option<&'a [u32]>,
}

/// The loop of [`quantize_rows_with`] on validated, sized buffers, blocks quantized four at a
/// time by `four` where it takes them (it may decline with `None`), else one at a time by
/// `one`; both must give [`quantize_bf16_block`]'s bytes.
#[inline(always)]
fn quantize_rows_body(
    Rows { bf16, k, rule, order, dst_of }: Rows<'_>,
    elements: &mut [u8],
    scales: &mut [u8],
    mut after_row: impl FnMut(&[u8], &[u8], &[u8]),
    one: impl Fn(&[u8; BLOCK * 2], ScaleRule, &mut [u8]) -> Result<u8, usize>,
    four: impl Fn([&[u8; BLOCK * 2]; 4], ScaleRule, &mut [u8]) -> Option<[u8; 4]>,
) -> Result<(), KernelError> {
    let blocks = k / BLOCK;
    let chunks = match order {
        BlockOrder::Chunks(p) => Some(p.as_slice()),
        _ => None,
    };
    let row_bytes = k * 2;
    for (src_row, src_row_bytes) in bf16.chunks_exact(row_bytes).enumerate() {
        // The next source row is asked for while this one is quantized, a step's worth at a
        // time: a row read in chunk order (`wo_a`) jumps around its 8 KiB, and any row crosses
        // 4 KiB pages, where the hardware's streams stop.
        let next_row = bf16.get((src_row + 1) * row_bytes..(src_row + 2) * row_bytes);
        let row = dst_of.map_or(src_row, |d| d[src_row] as usize);
        let dst_row = &mut elements[row * k..(row + 1) * k];
        let scale_row = &mut scales[row * blocks..(row + 1) * blocks];
        let source_blocks = src_row_bytes.as_chunks::<{ BLOCK * 2 }>().0;
        let source = |j: usize| &source_blocks[chunks.map_or(j, |p| p[j] as usize)];
        let mut j = 0;
        while j < blocks {
            // Four blocks at once where `four` takes them, else one by one up to the next four.
            let end = (j + 4).min(blocks);
            if let Some(next) = next_row {
                crate::simd::prefetch(&next[j * BLOCK * 2..end * BLOCK * 2]);
            }
            if end == j + 4
                && let Some(s) = four(std::array::from_fn(|i| source(j + i)), rule, &mut dst_row[j * BLOCK..end * BLOCK])
            {
                scale_row[j..end].copy_from_slice(&s);
                j = end;
                continue;
            }
            for jj in j..end {
                let src_j = chunks.map_or(jj, |p| p[jj] as usize);
                scale_row[jj] = one(&source_blocks[src_j], rule, &mut dst_row[jj * BLOCK..(jj + 1) * BLOCK])
                    .map_err(|at| KernelError::NonFinite { row: src_row, col: src_j * BLOCK + at })?;
            }
            j = end;
        }
        after_row(src_row_bytes, dst_row, scale_row);
    }
    Ok(())
}

/// Quantizes one block of 32 BF16 values; returns its scale byte, or the index of a NaN or
/// infinite value.
#[inline(always)]
pub(crate) fn quantize_bf16_block(src: &[u8; BLOCK * 2], rule: ScaleRule, dst: &mut [u8]) -> Result<u8, usize> {
    let mut block = [0u16; BLOCK];
    for (i, slot) in block.iter_mut().enumerate() {
        *slot = u16::from_le_bytes([src[2 * i], src[2 * i + 1]]);
    }
    let amax = block.iter().fold(0u16, |m, &h| m.max(h & 0x7FFF));
    if amax >= 0x7F80 {
        return Err(block.iter().position(|h| h & 0x7F80 == 0x7F80).unwrap_or(0));
    }
    if amax == 0 {
        dst.fill(0);
        return Ok(0);
    }
    let e = bf16_scale_exponent(amax, rule);
    // Scaled exponent t = E - 127 - e of each element. For t >= -6 the result is an E4M3
    // normal: exponent t + 7 and the 7 mantissa bits rounded to 3 (nearest even; a carry
    // bumps the exponent), saturated at 0x7E. This runs on 16-bit lanes without branches.
    let bias_e = (127 + e) as i16;
    let mut needs_exact = false;
    for (o, &h) in dst.iter_mut().zip(&block) {
        let mag = (h & 0x7FFF) as i16;
        let t = (mag >> 7) - bias_e;
        needs_exact |= (mag >> 7 == 0) | (t < -6);
        // All in i16 (x <= 16 << 7 | 127), so SSE2 has every operation.
        let x = ((t.clamp(-6, 9) + 7) << 7) | (h & 0x7F) as i16;
        let (q, rem) = (x >> 4, x & 0xF);
        let up = ((rem > 8) | ((rem == 8) & (q & 1 == 1))) as i16;
        *o = ((q + up).min(0x7E) as u8) | ((h >> 8) & 0x80) as u8;
    }
    if needs_exact {
        // Zeros, subnormal inputs or results below E4M3's normal range: convert exactly.
        let inv = e8m0::pow2(-e);
        for (o, &h) in dst.iter_mut().zip(&block) {
            *o = e4m3::from_f32_saturating(f32::from_bits((h as u32) << 16) * inv);
        }
    }
    Ok((e + e8m0::BIAS) as u8)
}

/// MXFP8-quantizes a row-major f32 matrix `[rows, k]` along K (activations, references).
pub fn quantize_f32_rows(
    values: &[f32],
    k: usize,
    rule: ScaleRule,
    elements: &mut Vec<u8>,
    scales: &mut Vec<u8>,
) -> Result<(), KernelError> {
    if !k.is_multiple_of(BLOCK) || !values.len().is_multiple_of(k) {
        return Err(KernelError::Shape(format!(
            "f32 matrix of {} values has no row length {k} that is a multiple of {BLOCK}",
            values.len()
        )));
    }
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(non_finite_at(at, k));
    }
    elements.clear();
    elements.resize(values.len(), 0);
    scales.clear();
    scales.extend(values.chunks_exact(BLOCK).zip(elements.chunks_exact_mut(BLOCK)).map(|(src, dst)| quantize_block(src, rule, dst)));
    Ok(())
}

/// Dequantizes one MXFP8 element.
#[inline]
pub fn dequantize(element: u8, scale: u8) -> f32 {
    e4m3::to_f32(element) * e8m0::to_f32(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loop compiled for the baseline and the one the CPU takes (AVX-512's four blocks at a
    /// time, or the AVX2 copy `simd::dispatch!` picks) write the same bytes, in every order, for
    /// both rules, on every bit pattern class (random finite BF16, including subnormals and
    /// values that saturate), with rows of whole groups of four blocks and with a remainder.
    #[test]
    fn baseline_and_dispatched_quantization_agree() {
        for k in [128, 192] {
            baseline_and_dispatched_quantization_agree_at(k);
        }
    }

    fn baseline_and_dispatched_quantization_agree_at(k: usize) {
        use crate::permutation::Permutation;
        let rows = 64;
        let q = Permutation::q_rows(2, 32).unwrap();
        let o = Permutation::from_map((0..(k / BLOCK) as u32).rev().collect()).unwrap();
        let mut x = 0x1234_5678_9ABC_DEF1u64;
        let bf16: Vec<u8> = (0..rows * k)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let h = (x >> 40) as u16;
                (if h & 0x7F80 == 0x7F80 { h & !0x0100 } else { h }).to_le_bytes()
            })
            .collect();
        for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
            for order in [BlockOrder::Identity, BlockOrder::Rows(&q), BlockOrder::Chunks(&o)] {
                let (mut e, mut s) = (Vec::new(), Vec::new());
                quantize_bf16_ordered(&bf16, rows, k, rule, order, &mut e, &mut s).unwrap();
                let (mut be, mut bs) = (vec![0u8; rows * k], vec![0u8; rows * k / BLOCK]);
                let dst_of = match order {
                    BlockOrder::Rows(p) => Some(p.inverse_map()),
                    _ => None,
                };
                quantize_rows_body(
                    Rows { bf16: &bf16, k, rule, order, dst_of },
                    &mut be,
                    &mut bs,
                    |_, _, _| {},
                    quantize_bf16_block,
                    |_, _, _| None,
                )
                .unwrap();
                assert_eq!((&e, &s), (&be, &bs), "{rule:?} {order:?}");
            }
        }
    }

    fn block_of(amax: f32) -> Vec<f32> {
        let mut v = vec![amax * 0.25; BLOCK];
        v[7] = -amax;
        v
    }

    /// The spec's table (section 6): block amax -> (scale byte, element of amax) per rule.
    #[test]
    fn spec_quantization_table() {
        let tricky = 448.0 * 2f32.powi(-18) * (1.0 + 2f32.powi(-20));
        type Expect = (u8, f32);
        let rows: [(f32, Expect, Expect); 7] = [
            (300.0, (127, 288.0), (127, 288.0)),
            (448.0, (127, 448.0), (127, 448.0)),
            (460.0, (128, 224.0), (127, 448.0)),
            (500.0, (128, 256.0), (127, 448.0)),
            (1.0, (119, 256.0), (119, 256.0)),
            (0.001, (109, 256.0), (109, 256.0)),
            (tricky, (110, 224.0), (109, 448.0)),
        ];
        for (amax, rceil, floor) in rows {
            for (rule, (byte, elem)) in [(ScaleRule::Rceil, rceil), (ScaleRule::Floor, floor)] {
                let values = block_of(amax);
                let mut out = [0u8; BLOCK];
                let scale = quantize_block(&values, rule, &mut out);
                assert_eq!(scale, byte, "amax {amax} rule {rule}");
                assert_eq!(e4m3::to_f32(out[7]), -elem, "amax {amax} rule {rule}");
            }
        }
        // 0.001 "all equal".
        let mut out = [0u8; BLOCK];
        assert_eq!(quantize_block(&[0.001; BLOCK], ScaleRule::Rceil, &mut out), 109);
        assert!(out.iter().all(|&b| e4m3::to_f32(b) == 256.0));
        // All zero.
        for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
            let mut out = [1u8; BLOCK];
            assert_eq!(quantize_block(&[0.0; BLOCK], rule, &mut out), 0);
            assert_eq!(out, [0u8; BLOCK]);
        }
    }

    #[test]
    fn bf16_scale_exponent_is_the_divisions() {
        for amax in 1..0x7F80u16 {
            for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
                let want = scale_exponent(f32::from_bits(u32::from(amax) << 16), rule);
                assert_eq!(bf16_scale_exponent(amax, rule), want, "amax {amax:#06x}, {rule:?}");
            }
        }
    }

    #[test]
    fn subnormal_amax_uses_true_exponent() {
        // amax = 2^-140 (f32 subnormal): floor -> -148 clamped to -127.
        let tiny = e8m0::pow2(-140);
        assert_eq!(scale_exponent(tiny, ScaleRule::Floor), -127);
        assert_eq!(scale_exponent(tiny, ScaleRule::Rceil), -127);
        // amax just under 448 * 2^-126 keeps s subnormal: 0.75 * 2^-126 -> ceil = -126.
        let s_sub = 448.0f32 * (0.75 * 2f32.powi(-126));
        assert_eq!(scale_exponent(s_sub, ScaleRule::Rceil), -126);
    }

    #[test]
    fn non_finite_is_an_error_naming_row_and_column() {
        // Rows of 6 blocks (a group of four, then two) of ones; an infinity or a NaN in the
        // group, or after it, is named where it is.
        let k = 192;
        for (col, bits) in [(33, 0x7F80u16), (97, 0xFFC0), (161, 0x7F80), (191, 0xFF81)] {
            let mut bf16: Vec<u8> = std::iter::repeat_n(0x3F80u16.to_le_bytes(), 2 * k).flatten().collect();
            let at = (k + col) * 2;
            bf16[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            let (mut e, mut s) = (Vec::new(), Vec::new());
            let err = quantize_bf16_rows(&bf16, 2, k, ScaleRule::Rceil, &mut e, &mut s).unwrap_err();
            assert!(matches!(err, KernelError::NonFinite { row: 1, col: c } if c == col), "{col}: {err:?}");
        }
    }

    /// The table path equals the exact f32 path on every kind of BF16 input: all binades,
    /// subnormals, zeros of both signs, values that saturate under `floor`.
    #[test]
    fn bf16_table_path_matches_f32_path_on_random_bit_patterns() {
        let mut z = 0x1234_5678_9ABC_DEF0u64;
        for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
            for _ in 0..2000 {
                let mut vals = Vec::with_capacity(64);
                // Two blocks: a random exponent window per block, so scales vary widely.
                for _ in 0..2 {
                    z = z.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let center = (z >> 33) % 256;
                    for _ in 0..BLOCK {
                        z = z.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        let r = z >> 24;
                        let exp = (center as i64 + (r % 24) as i64 - 12).clamp(0, 254) as u16;
                        let bits = (((r >> 8) & 1) as u16) << 15 | exp << 7 | ((r >> 9) & 0x7F) as u16;
                        let bits = if r.is_multiple_of(29) { bits & 0x8000 } else { bits };
                        vals.push(bits);
                    }
                }
                let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
                let floats: Vec<f32> = vals.iter().map(|&v| f32::from_bits((v as u32) << 16)).collect();
                let (mut e1, mut s1, mut e2, mut s2) = (vec![], vec![], vec![], vec![]);
                quantize_bf16_rows(&bytes, 1, 64, rule, &mut e1, &mut s1).unwrap();
                quantize_f32_rows(&floats, 64, rule, &mut e2, &mut s2).unwrap();
                assert_eq!((&e1, &s1), (&e2, &s2), "{rule} {vals:04x?}");
            }
        }
    }

    #[test]
    fn bf16_path_matches_f32_path() {
        let vals: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let bf16: Vec<u8> = vals.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
        let truncated: Vec<f32> = vals.iter().map(|v| f32::from_bits(v.to_bits() & 0xFFFF_0000)).collect();
        let (mut e1, mut s1, mut e2, mut s2) = (vec![], vec![], vec![], vec![]);
        quantize_bf16_rows(&bf16, 4, 64, ScaleRule::Floor, &mut e1, &mut s1).unwrap();
        quantize_f32_rows(&truncated, 64, ScaleRule::Floor, &mut e2, &mut s2).unwrap();
        assert_eq!((e1, s1), (e2, s2));
    }

    // The checks of the vector quantizers (`avx512`, `avx2`), each given a version's entry points.

    /// A xorshift64 sequence from `x`.
    fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    /// Groups of four blocks, each of its own scale (some of them handed back): what `four`
    /// takes, it writes and scales as the plain loop does each block, in its place.
    pub(super) fn four_blocks_match_the_plain_loop(four: impl Fn([&[u8; BLOCK * 2]; 4], ScaleRule, &mut [u8]) -> Option<[u8; 4]>) {
        let mut next = xorshift(0x2545_F491_4F6C_DD1Du64);
        let mut taken = 0;
        for round in 0..20_000 {
            let blocks: [[u8; BLOCK * 2]; 4] = std::array::from_fn(|_| {
                let (base, spread) = (1 + next() % 253, if next().is_multiple_of(50) { 40 } else { 4 });
                let mut src = [0u8; BLOCK * 2];
                for i in 0..BLOCK {
                    let v = next();
                    let h = ((v >> 63) as u16) << 15 | ((base + (v >> 20) % spread).min(254) as u16) << 7 | (v as u16 & 0x7F);
                    src[2 * i..2 * i + 2].copy_from_slice(&h.to_le_bytes());
                }
                src
            });
            for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
                let mut got = [0xA5u8; 4 * BLOCK];
                let Some(scales) = four(std::array::from_fn(|i| &blocks[i]), rule, &mut got) else {
                    continue;
                };
                taken += 1;
                for (i, block) in blocks.iter().enumerate() {
                    let mut want = [0u8; BLOCK];
                    assert_eq!(Ok(scales[i]), quantize_bf16_block(block, rule, &mut want), "round {round} block {i} {rule:?}");
                    assert_eq!(got[i * BLOCK..(i + 1) * BLOCK], want, "round {round} block {i} {rule:?}");
                }
            }
        }
        assert!(taken > 20_000, "four took {taken} of 40000 groups");
    }

    /// Every block class the plain loop distinguishes, both rules: the same bytes and scale, the
    /// same error.
    pub(super) fn blocks_match_the_plain_loop(quantize_block: impl Fn(&[u8; BLOCK * 2], ScaleRule, &mut [u8]) -> Result<u8, usize>) {
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15u64);
        for round in 0..200_000 {
            let mut src = [0u8; BLOCK * 2];
            let r = next();
            // Narrow exponent spreads make normal blocks; wide ones subnormal results.
            let spread = [2u64, 6, 12, 255][(r % 4) as usize];
            let base = 1 + (r >> 8) % 250;
            for i in 0..BLOCK {
                let v = next();
                let exponent = (base + (v >> 20) % spread).min(255) as u16;
                let mut h = ((v >> 60) as u16 & 1) << 15 | exponent << 7 | (v as u16 & 0x7F);
                match (round % 97, i) {
                    (0, 3) => h = 0x7F80,   // +inf
                    (1, 5) => h = 0xFFC1,   // NaN
                    (2, _) => h &= 0x8000,  // all (signed) zeros
                    (3, 9) => h = 0x0001,   // a subnormal input
                    (4, 11) => h &= 0x8000, // one zero
                    _ => {}
                }
                src[2 * i..2 * i + 2].copy_from_slice(&h.to_le_bytes());
            }
            for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
                let (mut want, mut got) = ([0u8; BLOCK], [0xA5u8; BLOCK]);
                let expected = quantize_bf16_block(&src, rule, &mut want);
                let result = quantize_block(&src, rule, &mut got);
                assert_eq!(result, expected, "round {round} {rule:?}");
                if expected.is_ok() {
                    assert_eq!(got, want, "round {round} {rule:?}");
                }
            }
        }
    }

    /// Every positive finite BF16 magnitude as a block's maximum, with both signs, both rules:
    /// the scale byte without a division is the plain loop's, and so are the bytes.
    pub(super) fn blocks_match_the_plain_loop_at_every_magnitude(
        quantize_block: impl Fn(&[u8; BLOCK * 2], ScaleRule, &mut [u8]) -> Result<u8, usize>,
    ) {
        for amax in 1..0x7F80u16 {
            let mut src = [0u8; BLOCK * 2];
            for i in 0..BLOCK {
                // Smaller elements spread over the next few binades, some negative.
                let below = (i as u16 % 5) << 7 | (i as u16 * 37) & 0x7F;
                let h = if i == 13 { amax } else { amax.saturating_sub(below).max(1) } | (u16::from((i as u16).is_multiple_of(3))) << 15;
                src[2 * i..2 * i + 2].copy_from_slice(&h.to_le_bytes());
            }
            for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
                let (mut want, mut got) = ([0u8; BLOCK], [0xA5u8; BLOCK]);
                assert_eq!(quantize_block(&src, rule, &mut got), quantize_bf16_block(&src, rule, &mut want), "amax {amax:#06x} {rule:?}");
                assert_eq!(got, want, "amax {amax:#06x} {rule:?}");
            }
        }
    }
}
