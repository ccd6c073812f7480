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

/// Swizzles a row-major `[m, c]` scale into F8_128x4 order (padding is zero).
pub fn swizzle_128x4(scale: &[u8], m: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
    check_len("scale to swizzle", scale.len(), m * c)?;
    dst.clear();
    dst.resize(swizzled_len(m, c), 0);
    for (i, row) in scale.chunks_exact(c.max(1)).enumerate().take(m) {
        for (j, &b) in row.iter().enumerate() {
            dst[swizzle_offset(i, j, c)] = b;
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
    let mut covered = 0usize;
    for i in 0..m {
        for j in 0..c {
            let at = swizzle_offset(i, j, c);
            dst[i * c + j] = swizzled[at];
            covered += usize::from(swizzled[at] != 0);
        }
    }
    let nonzero = swizzled.iter().filter(|&&b| b != 0).count();
    if nonzero != covered {
        return Err(KernelError::Layout(format!("swizzled [{m}, {c}] scale has {} non-zero padding bytes", nonzero - covered)));
    }
    Ok(())
}

/// Packs a chunk-permuted per-row scale `[groups * rows, c]` (c a multiple of 4) into
/// DeepGEMM's MN-major packed UE8M0: int32 `[groups, rows, c/4]` holding 4 consecutive scale
/// bytes along K little-endian, with stride 1 along rows, i.e. storage order
/// `[group][k4][row]` = `scale.reshape(g, rows, c/4, 4).transpose(0, 2, 1, 3)`.
pub fn pack_ue8m0_mn_major(scale: &[u8], groups: usize, rows: usize, c: usize, dst: &mut Vec<u8>) -> Result<(), KernelError> {
    if !c.is_multiple_of(4) || !rows.is_multiple_of(4) {
        return Err(KernelError::Shape(format!("packed UE8M0 needs scale columns ({c}) and rows ({rows}) that are multiples of 4")));
    }
    check_len("scale to pack", scale.len(), groups * rows * c)?;
    let k4 = c / 4;
    // Every byte is overwritten below: no need to clear first.
    dst.resize(scale.len(), 0);
    for g in 0..groups {
        for r in 0..rows {
            let src_row = &scale[(g * rows + r) * c..][..c];
            for (q, word) in src_row.chunks_exact(4).enumerate() {
                let at = ((g * k4 + q) * rows + r) * 4;
                dst[at..at + 4].copy_from_slice(word);
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
    let k4 = c / 4;
    // Every byte is overwritten below: no need to clear first.
    dst.resize(packed.len(), 0);
    for g in 0..groups {
        for q in 0..k4 {
            for r in 0..rows {
                let at = ((g * k4 + q) * rows + r) * 4;
                let to = (g * rows + r) * c + q * 4;
                dst[to..to + 4].copy_from_slice(&packed[at..at + 4]);
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
        assert!(unswizzle_128x4(&sw, 3, 5, &mut back).is_err());
    }
}
