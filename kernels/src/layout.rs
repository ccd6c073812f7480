//! Kernel layouts of the scale tensors (spec section 7): the F8_128x4 swizzle read by the
//! CuteDSL MXFP8 GEMM (`wq_b`, `wo_b`) and DeepGEMM's packed UE8M0, MN-major, read by the
//! `wo_a` BMM. Weights keep their bytes: only the view (shape, strides) changes.

use crate::KernelError;

/// Rows per swizzle tile.
pub const SWIZZLE_ROWS: usize = 128;
/// Scale columns per swizzle tile.
pub const SWIZZLE_COLS: usize = 4;

/// Bytes of the F8_128x4 swizzled form of an `[m, c]` scale.
pub fn swizzled_len(m: usize, c: usize) -> usize {
    m.div_ceil(SWIZZLE_ROWS) * SWIZZLE_ROWS * c.div_ceil(SWIZZLE_COLS) * SWIZZLE_COLS
}

/// The F8_128x4 offset of scale `(i, j)` in an `[m, c]` scale (padded to 128 x 4 tiles):
/// `((i/128)*ceil(c/4) + j/4)*512 + (i%32)*16 + ((i%128)/32)*4 + j%4`.
#[inline]
pub fn swizzle_offset(i: usize, j: usize, c: usize) -> usize {
    ((i / 128) * c.div_ceil(4) + j / 4) * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4 + j % 4
}

fn check_len(what: &str, got: usize, want: usize) -> Result<(), KernelError> {
    if got != want {
        return Err(KernelError::Shape(format!("{what}: {got} bytes, expected {want}")));
    }
    Ok(())
}

/// Offset of row `r` of a 128-row tile inside each 512-byte block of the tile (the block of
/// scale columns `4q .. 4q + 4`): `(r % 32) * 16 + (r / 32) * 4`, the row part of
/// [`swizzle_offset`]. A row's four bytes of one block are contiguous there.
#[inline]
fn row_in_block(r: usize) -> usize {
    (r % 32) * 16 + (r / 32) * 4
}

/// Bytes of one block of a swizzle tile: 128 rows x 4 scale columns.
const BLOCK_BYTES: usize = SWIZZLE_ROWS * SWIZZLE_COLS;

/// Bytes of one 128-row tile of a swizzled `[m, c]` scale: `ceil(c / 4)` blocks.
fn tile_bytes(c: usize) -> usize {
    c.div_ceil(SWIZZLE_COLS) * BLOCK_BYTES
}

/// Swizzles a row-major `[m, c]` scale into F8_128x4 order (padding is zero): each row's
/// columns `4q .. 4q + 4` move as one 4-byte piece to block `q` of the row's tile, at
/// [`row_in_block`] (so every byte lands at its [`swizzle_offset`]).
pub fn swizzle_128x4(scale: &[u8], m: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
    check_len("scale to swizzle", scale.len(), m * c)?;
    dst.clear();
    dst.resize(swizzled_len(m, c), 0);
    if c == 0 {
        return Ok(());
    }
    let full = c / SWIZZLE_COLS;
    for (tile, dst_tile) in scale.chunks(SWIZZLE_ROWS * c).zip(dst.chunks_exact_mut(tile_bytes(c))) {
        for (r, row) in tile.chunks_exact(c).enumerate() {
            let at = row_in_block(r);
            let quads = row.chunks_exact(SWIZZLE_COLS);
            let rest = quads.remainder();
            for (q, quad) in quads.enumerate() {
                dst_tile[q * BLOCK_BYTES + at..][..SWIZZLE_COLS].copy_from_slice(quad);
            }
            if !rest.is_empty() {
                dst_tile[full * BLOCK_BYTES + at..][..rest.len()].copy_from_slice(rest);
            }
        }
    }
    Ok(())
}

/// Inverse of [`swizzle_128x4`]: recovers the row-major `[m, c]` scale. Padding bytes must be
/// zero, otherwise the buffer was not produced by the swizzle.
pub fn unswizzle_128x4(swizzled: &[u8], m: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
    check_len("swizzled scale", swizzled.len(), swizzled_len(m, c))?;
    // Every byte is overwritten below: no need to clear first.
    dst.resize(m * c, 0);
    if c == 0 {
        return Ok(());
    }
    let full = c / SWIZZLE_COLS;
    for (tile, src_tile) in dst.chunks_mut(SWIZZLE_ROWS * c).zip(swizzled.chunks_exact(tile_bytes(c))) {
        for (r, row) in tile.chunks_exact_mut(c).enumerate() {
            let at = row_in_block(r);
            let mut quads = row.chunks_exact_mut(SWIZZLE_COLS);
            for (q, quad) in (&mut quads).enumerate() {
                quad.copy_from_slice(&src_tile[q * BLOCK_BYTES + at..][..SWIZZLE_COLS]);
            }
            let rest = quads.into_remainder();
            if !rest.is_empty() {
                let n = rest.len();
                rest.copy_from_slice(&src_tile[full * BLOCK_BYTES + at..][..n]);
            }
        }
    }
    // `dst` holds every byte the swizzle places, once: whatever else is non-zero is padding.
    // Counted in byte-wide lanes, 255 bytes at a time (a count per byte does not vectorize).
    let nonzero = |b: &[u8]| -> usize { b.chunks(255).map(|c| usize::from(c.iter().fold(0u8, |n, &x| n + u8::from(x != 0)))).sum() };
    let dirty = nonzero(swizzled) - nonzero(dst);
    if dirty != 0 {
        return Err(KernelError::Layout(format!("swizzled [{m}, {c}] scale has {dirty} non-zero padding bytes")));
    }
    Ok(())
}

/// Rows per pass of the packing's transpose: a pass reads `PACK_ROWS` scale rows (a few KiB)
/// and writes one 64-byte line per 4-byte column, instead of one line per word.
const PACK_ROWS: usize = 16;

/// Packs a chunk-permuted per-row scale `[groups * rows, c]` (c a multiple of 4) into
/// DeepGEMM's MN-major packed UE8M0: int32 `[groups, rows, c/4]` holding 4 consecutive scale
/// bytes along K little-endian, with stride 1 along rows, i.e. storage order
/// `[group][k4][row]` = `scale.reshape(g, rows, c/4, 4).transpose(0, 2, 1, 3)`.
pub fn pack_ue8m0_mn_major(scale: &[u8], groups: usize, rows: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
    if !c.is_multiple_of(4) || !rows.is_multiple_of(4) {
        return Err(KernelError::Shape(format!("packed UE8M0 needs scale columns ({c}) and rows ({rows}) that are multiples of 4")));
    }
    check_len("scale to pack", scale.len(), groups * rows * c)?;
    // Every byte is overwritten below: no need to clear first.
    dst.resize(scale.len(), 0);
    // Word (g, r, q) is at g0 + r * c + q * 4 in the scale and g0 + (q * rows + r) * 4 packed.
    let (k4, group) = (c / 4, rows * c);
    if group == 0 {
        return Ok(());
    }
    for g0 in (0..scale.len()).step_by(group) {
        for r0 in (0..rows).step_by(PACK_ROWS) {
            for q in 0..k4 {
                for r in r0..(r0 + PACK_ROWS).min(rows) {
                    let (from, to) = (g0 + r * c + q * 4, g0 + (q * rows + r) * 4);
                    dst[to..to + 4].copy_from_slice(&scale[from..from + 4]);
                }
            }
        }
    }
    Ok(())
}

/// Inverse of [`pack_ue8m0_mn_major`].
pub fn unpack_ue8m0_mn_major(packed: &[u8], groups: usize, rows: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
    check_len("packed scale", packed.len(), groups * rows * c)?;
    if !c.is_multiple_of(4) {
        return Err(KernelError::Shape(format!("packed UE8M0 needs columns ({c}) a multiple of 4")));
    }
    // Every byte is overwritten below: no need to clear first.
    dst.resize(packed.len(), 0);
    // Read in storage order (each column of words of a group in turn): sequential reads,
    // writes a scale row apart.
    let (k4, group) = (c / 4, rows * c);
    if group == 0 {
        return Ok(());
    }
    for g0 in (0..packed.len()).step_by(group) {
        for q in 0..k4 {
            for r in 0..rows {
                let (from, to) = (g0 + r * c + q * 4, g0 + (q * rows + r) * 4);
                dst[from..from + 4].copy_from_slice(&packed[to..to + 4]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v41_flash_tp4_wq_b_scale_is_327680_bytes() {
        // 8192 local rows (16 heads x 512), K = 1280 -> 40 scale columns.
        assert_eq!(swizzled_len(8192, 40), 327_680);
    }

    #[test]
    fn offsets_of_the_first_tile() {
        assert_eq!(swizzle_offset(0, 0, 40), 0);
        assert_eq!(swizzle_offset(0, 3, 40), 3);
        assert_eq!(swizzle_offset(1, 0, 40), 16);
        assert_eq!(swizzle_offset(32, 0, 40), 4);
        assert_eq!(swizzle_offset(0, 4, 40), 512);
        assert_eq!(swizzle_offset(128, 0, 40), 10 * 512);
    }

    #[test]
    fn pack_matches_reshape_transpose() {
        // g = 1, rows = 4, c = 8: element (r, k) = r*8 + k.
        let scale: Vec<u8> = (0..32).collect();
        let mut packed = Vec::new();
        pack_ue8m0_mn_major(&scale, 1, 4, 8, &mut packed).unwrap();
        // k4 = 0: rows 0..4 of bytes 0..4; then k4 = 1.
        assert_eq!(&packed[..8], &[0, 1, 2, 3, 8, 9, 10, 11]);
        assert_eq!(&packed[16..20], &[4, 5, 6, 7]);
        let word0 = i32::from_le_bytes(packed[..4].try_into().unwrap());
        assert_eq!(word0 & 0xFF, 0, "bits 0..8 hold the lowest chunk");
        let mut back = Vec::new();
        unpack_ue8m0_mn_major(&packed, 1, 4, 8, &mut back).unwrap();
        assert_eq!(back, scale);
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The swizzle puts every byte at its `swizzle_offset` and zeroes the rest, and the
        /// unswizzle inverts it, for every shape (partial tiles, columns not a multiple of 4).
        #[test]
        fn the_swizzle_places_every_byte_at_its_offset(m in 0usize..300, c in 0usize..11, seed: u64) {
            let scale = crate::testdata::splitmix_bytes(m * c, seed);
            let mut want = vec![0u8; swizzled_len(m, c)];
            for i in 0..m {
                for j in 0..c {
                    want[swizzle_offset(i, j, c)] = scale[i * c + j];
                }
            }
            let mut got = vec![0xEE; 3];
            swizzle_128x4(&scale, m, c, &mut got).unwrap();
            prop_assert_eq!(&got, &want);
            let mut back = vec![0xEE; 5];
            unswizzle_128x4(&got, m, c, &mut back).unwrap();
            prop_assert_eq!(back, scale);
        }

        /// Packing moves word `(g, r, q)` to `((g * c/4 + q) * rows + r) * 4` and unpacking
        /// inverts it, for row counts that are and are not multiples of the transpose's block.
        #[test]
        fn packing_moves_every_word_to_its_offset(groups in 0usize..4, rows4 in 0usize..12, c4 in 1usize..6, seed: u64) {
            let (rows, c) = (rows4 * 4, c4 * 4);
            let scale = crate::testdata::splitmix_bytes(groups * rows * c, seed);
            let mut want = vec![0u8; scale.len()];
            for g in 0..groups {
                for r in 0..rows {
                    for q in 0..c4 {
                        let (from, to) = ((g * rows + r) * c + q * 4, ((g * c4 + q) * rows + r) * 4);
                        want[to..to + 4].copy_from_slice(&scale[from..from + 4]);
                    }
                }
            }
            let mut got = vec![0xEE; 7];
            pack_ue8m0_mn_major(&scale, groups, rows, c, &mut got).unwrap();
            prop_assert_eq!(&got, &want);
            let mut back = Vec::new();
            unpack_ue8m0_mn_major(&got, groups, rows, c, &mut back).unwrap();
            prop_assert_eq!(back, scale);
        }
    }

    #[test]
    fn unswizzle_rejects_dirty_padding() {
        let scale = vec![7u8; 3 * 5];
        let mut sw = Vec::new();
        swizzle_128x4(&scale, 3, 5, &mut sw).unwrap();
        let mut back = Vec::new();
        unswizzle_128x4(&sw, 3, 5, &mut back).unwrap();
        assert_eq!(back, scale);
        let pad = (0..sw.len()).find(|&o| sw[o] == 0).unwrap();
        sw[pad] = 1;
        let e = unswizzle_128x4(&sw, 3, 5, &mut back).unwrap_err();
        assert!(matches!(&e, KernelError::Layout(m) if m.contains("1 non-zero padding bytes")), "{e}");
        let last = sw.len() - 1;
        sw[last] = 9;
        let e = unswizzle_128x4(&sw, 3, 5, &mut back).unwrap_err();
        assert!(matches!(&e, KernelError::Layout(m) if m.contains("2 non-zero padding bytes")), "{e}");
    }
}
