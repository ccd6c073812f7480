//! FP8 source placement on the host in as few passes over memory as the order allows: validate
//! the stored E4M3 bytes (a NaN is an error at its source index), digest them as stored (the
//! source digest), copy them into their fused order, and digest the placed bytes (the kernel
//! weight digest: the kernel hooks never change weight bytes, only the scale layout).
//!
//! - Checkpoint order: one pass (the placed bytes are the stored bytes, so one digest is both).
//! - Chunk order (`wo_a`): one pass, row by row: each row is checked and digested, gathered
//!   into a row in cache, digested there and placed.
//! - Row order (`wq_b`): the rows move across the whole tensor, so the stored bytes are checked
//!   and digested in one pass, and gathered in a second, which digests each gathered run of
//!   rows as it copies it (the destination is written, never read).
//!
//! A tensor of [`STREAMING_MIN_BYTES`] or more placed into a reused buffer (a reload) is written
//! with non-temporal stores ([`Copier::streaming`]): nothing reads it back soon, and each
//! destination line is then written without being read first.
//!
//! The digests are the XXH3-64 of the bytes in storage order, exactly [`Digest::of`].

use crate::backend::resize_for_overwrite;
use crate::digest::{Digest, DigestStream};
use crate::e4m3::{digest_nan_free, find_nan};
use crate::permutation::{BlockOrder, O_CHUNK};
use crate::simd::{Copier, STREAMING_MIN_BYTES};
use crate::{KernelError, permutation};

/// The digests of one placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Of the source bytes as stored.
    pub source: Digest,
    /// Of the bytes as placed in the destination.
    pub placed: Digest,
    /// BF16 quantized into place: the MXFP8 it produced, in checkpoint order (what a round trip
    /// of the placed tensor must give back). `None` for FP8 (the source digest is that).
    pub quantized: Option<QuantizedDigests>,
}

/// Digests of an MXFP8 quantization in checkpoint order: the E4M3 elements `[rows, k]` and the
/// per-row scales `[rows, k/32]`, as [`crate::mxfp8::quantize_bf16_rows`] writes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantizedDigests {
    pub elements: Digest,
    pub scales: Digest,
}

/// Bytes per step of the checkpoint-order pass: a step stays in L1 between its check, digest
/// and copy, and the step [`STEPS_AHEAD`] on is fetched meanwhile. From memory on the AVX2 VM,
/// one thread, streamed: 10.7-12.6 GB/s (9.5-10.3 unfetched), against 6.5-7.9 in steps of
/// 128 KiB, each checked from memory, then digested and copied from L2 (and fenced).
const STEP: usize = 2048;
/// How many steps ahead the checkpoint-order pass fetches.
const STEPS_AHEAD: usize = 2;

fn nan_at(at: usize, k: usize) -> KernelError {
    KernelError::NonFinite { row: at / k, col: at % k }
}

/// Places E4M3 `[rows, k]` from `src` into `dst` in `order` (`Rows`: destination row `f` reads
/// source row `perm[f]`; `Chunks`: destination 32-byte block `j` of each row reads block
/// `perm[j]`). `dst` keeps its allocation when large enough.
pub fn place_e4m3(src: &[u8], rows: usize, k: usize, order: BlockOrder<'_>, dst: &mut Vec<u8>) -> Result<Placed, KernelError> {
    if k == 0 || src.len() != rows * k {
        return Err(KernelError::Shape(format!("E4M3 weight has {} bytes, expected [{rows}, {k}]", src.len())));
    }
    // A large tensor placed into a reused buffer is written past the caches (no reader soon,
    // and no read for ownership of each destination line). A fresh buffer is not: the kernel
    // zeroes each of its pages on the first store, which leaves the page's lines in cache.
    let mut out = Copier::streaming_if(src.len() >= STREAMING_MIN_BYTES && dst.capacity() >= src.len());
    match order {
        BlockOrder::Identity => {
            // Every byte is overwritten below (a reused buffer of this size is not touched).
            resize_for_overwrite(dst, src.len());
            let mut h = DigestStream::new();
            for (i, (s, d)) in src.chunks(STEP).zip(dst.chunks_mut(STEP)).enumerate() {
                crate::simd::prefetch_row(src, STEP, i + STEPS_AHEAD);
                if let Some(at) = find_nan(s) {
                    return Err(nan_at(i * STEP + at, k));
                }
                h.update(s);
                out.copy(d, s);
            }
            let d = h.finish();
            Ok(Placed { source: d, placed: d, quantized: None })
        }
        BlockOrder::Chunks(perm) => {
            if perm.len() * O_CHUNK != k {
                return Err(KernelError::Shape(format!(
                    "the chunk permutation covers {} columns, the rows have {k}",
                    perm.len() * O_CHUNK
                )));
            }
            resize_for_overwrite(dst, src.len());
            let (mut hs, mut hd) = (DigestStream::new(), DigestStream::new());
            // Each row is gathered in cache, digested there, then placed; rows are fetched
            // ahead (a `wo_a` row is a 4 KiB page: warm FP8 reloads 0.0113-0.0116 s against
            // 0.0117-0.0120 s in a fast-memory phase, 3 runs each, the same in a slow one).
            let mut row = vec![0u8; k];
            for (r, (s, d)) in src.chunks_exact(k).zip(dst.chunks_exact_mut(k)).enumerate() {
                crate::simd::prefetch_row(src, k, r + permutation::ROWS_AHEAD);
                if let Some(at) = find_nan(s) {
                    return Err(nan_at(r * k + at, k));
                }
                hs.update(s);
                for (run, &from) in row.chunks_exact_mut(O_CHUNK).zip(perm.as_slice()) {
                    let at = from as usize * O_CHUNK;
                    run.copy_from_slice(&s[at..at + O_CHUNK]);
                }
                hd.update(&row);
                out.copy(d, &row);
            }
            Ok(Placed { source: hs.finish(), placed: hd.finish(), quantized: None })
        }
        BlockOrder::Rows(perm) => {
            if perm.len() != rows {
                return Err(KernelError::Shape(format!("the row permutation covers {} rows, the weight has {rows}", perm.len())));
            }
            let source = digest_nan_free(src).map_err(|at| nan_at(at, k))?;
            resize_for_overwrite(dst, src.len());
            // Each run of rows that are consecutive in the source too (16 at a time in the Q
            // permutation) is copied and digested in one piece: the placed digest reads the
            // bytes the copy just read, so the destination is never read back.
            let mut h = DigestStream::new();
            let mut f = 0;
            for piece in permutation::gathered_pieces(src, k, perm.as_slice()) {
                out.copy(&mut dst[f..f + piece.len()], piece);
                h.update(piece);
                f += piece.len();
            }
            Ok(Placed { source, placed: h.finish(), quantized: None })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::permutation::Permutation;
    use proptest::prelude::*;

    fn reference(src: &[u8], rows: usize, k: usize, order: BlockOrder<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        match order {
            BlockOrder::Identity => out.extend_from_slice(src),
            BlockOrder::Rows(p) => permutation::gather_runs(src, rows * k, k, p, &mut out).unwrap(),
            BlockOrder::Chunks(p) => permutation::gather_runs(src, k, O_CHUNK, p, &mut out).unwrap(),
        }
        out
    }

    /// Bytes without NaN (0x7F / 0xFF) from a seed.
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        crate::testdata::splitmix_bytes(n, seed).into_iter().map(|b| if b & 0x7F == 0x7F { b ^ 1 } else { b }).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Every order places the same bytes as the plain gather, and both digests are
        /// `Digest::of` of the stored and the placed bytes; a reused buffer of any prior content
        /// makes no difference.
        #[test]
        fn placement_equals_gather_and_digests(heads in 1usize..5, chunks in 1usize..5, rows_per in 1usize..9, seed: u64, stale: u8) {
            let q = Permutation::q_rows(heads, 16 * chunks).unwrap();
            let o = Permutation::o_columns(O_CHUNK * chunks).unwrap().of_chunks(O_CHUNK).unwrap();
            let cases: [(usize, usize, BlockOrder<'_>); 3] = [
                (rows_per * 3, 96, BlockOrder::Identity),
                (q.len(), 64, BlockOrder::Rows(&q)),
                (rows_per, o.len() * O_CHUNK, BlockOrder::Chunks(&o)),
            ];
            for (rows, k, order) in cases {
                let src = bytes(rows * k, seed);
                let mut dst = vec![stale; rows * k + (seed % 7) as usize];
                let placed = place_e4m3(&src, rows, k, order, &mut dst).unwrap();
                let want = reference(&src, rows, k, order);
                prop_assert_eq!(&dst, &want);
                prop_assert_eq!(placed.source, Digest::of(&src));
                prop_assert_eq!(placed.placed, Digest::of(&want));
            }
        }
    }

    /// Tensors past [`STREAMING_MIN_BYTES`] placed into a reused buffer take non-temporal
    /// stores: the same bytes and digests in every order, into a reused buffer of stale bytes
    /// and into a fresh one (unaligned ends: `simd`'s tests).
    #[test]
    fn large_placements_stream_the_same_bytes() {
        let q = Permutation::q_rows(64, 64).unwrap();
        let o = Permutation::o_columns(512).unwrap().of_chunks(O_CHUNK).unwrap();
        let cases: [(usize, usize, BlockOrder<'_>); 3] =
            [(1025, 4096, BlockOrder::Identity), (q.len(), 1280, BlockOrder::Rows(&q)), (1100, o.len() * O_CHUNK, BlockOrder::Chunks(&o))];
        for (rows, k, order) in cases {
            assert!(rows * k >= STREAMING_MIN_BYTES);
            let src = bytes(rows * k, rows as u64);
            let want = reference(&src, rows, k, order);
            for mut dst in [vec![0x3Cu8; rows * k], Vec::new()] {
                let placed = place_e4m3(&src, rows, k, order, &mut dst).unwrap();
                assert!(dst == want, "{rows} x {k}");
                assert_eq!((placed.source, placed.placed), (Digest::of(&src), Digest::of(&want)), "{rows} x {k}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The BF16 path: the same elements and scales as `quantize_bf16_ordered`, the digest
        /// of the stored BF16 bytes and of the placed E4M3 bytes, in every order.
        #[test]
        fn bf16_placement_equals_quantization_and_digests(heads in 1usize..4, chunks in 1usize..4, rows_per in 1usize..6, seed: u64) {
            use crate::mxfp8::{ScaleRule, quantize_bf16_ordered, quantize_bf16_placed};
            let q = Permutation::q_rows(heads, 16 * chunks).unwrap();
            let o = Permutation::o_columns(O_CHUNK * chunks).unwrap().of_chunks(O_CHUNK).unwrap();
            let cases: [(usize, usize, BlockOrder<'_>); 3] = [
                (rows_per * 3, 96, BlockOrder::Identity),
                (q.len(), 64, BlockOrder::Rows(&q)),
                (rows_per, o.len() * O_CHUNK, BlockOrder::Chunks(&o)),
            ];
            for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
                for (rows, k, order) in cases {
                    // Finite BF16: clear one exponent bit where all eight are set.
                    let src: Vec<u8> = bytes(rows * k * 2, seed)
                        .chunks_exact(2)
                        .flat_map(|b| {
                            let h = u16::from_le_bytes([b[0], b[1]]);
                            (if h & 0x7F80 == 0x7F80 { h & !0x0080 } else { h }).to_le_bytes()
                        })
                        .collect();
                    let (mut e, mut s) = (Vec::new(), Vec::new());
                    quantize_bf16_ordered(&src, rows, k, rule, order, &mut e, &mut s).unwrap();
                    let (mut pe, mut ps) = (vec![9u8; 3], Vec::new());
                    let placed = quantize_bf16_placed(&src, rows, k, rule, order, &mut pe, &mut ps).unwrap();
                    prop_assert_eq!(&pe, &e);
                    prop_assert_eq!(&ps, &s);
                    prop_assert_eq!(placed.source, Digest::of(&src));
                    prop_assert_eq!(placed.placed, Digest::of(&e));
                    // The quantization in checkpoint order, as the plain quantizer gives it.
                    let (mut ce, mut cs) = (Vec::new(), Vec::new());
                    crate::mxfp8::quantize_bf16_rows(&src, rows, k, rule, &mut ce, &mut cs).unwrap();
                    let want = crate::placement::QuantizedDigests { elements: Digest::of(&ce), scales: Digest::of(&cs) };
                    prop_assert_eq!(placed.quantized, Some(want));
                }
            }
        }
    }

    #[test]
    fn a_nan_is_reported_at_its_source_position_in_every_order() {
        let q = Permutation::q_rows(2, 32).unwrap();
        let o = Permutation::o_columns(64).unwrap().of_chunks(O_CHUNK).unwrap();
        let k_o = o.len() * O_CHUNK;
        for (rows, k, order) in [(5, 64, BlockOrder::Identity), (64, 64, BlockOrder::Rows(&q)), (3, k_o, BlockOrder::Chunks(&o))] {
            let mut src = bytes(rows * k, 3);
            let (r, c) = (rows - 1, k / 2 + 1);
            src[r * k + c] = 0xFF;
            // A second NaN later in source order is not the one named.
            src[rows * k - 1] = 0x7F;
            match place_e4m3(&src, rows, k, order, &mut Vec::new()) {
                Err(KernelError::NonFinite { row, col }) => assert_eq!((row, col), (r, c)),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(place_e4m3(&[0; 10], 3, 4, BlockOrder::Identity, &mut Vec::new()), Err(KernelError::Shape(_))));
        assert!(matches!(place_e4m3(&[0; 64], 1, 64, BlockOrder::Chunks(&o), &mut Vec::new()), Err(KernelError::Shape(_))));
        assert!(matches!(place_e4m3(&[0; 64], 2, 32, BlockOrder::Rows(&q), &mut Vec::new()), Err(KernelError::Shape(_))));
    }
}
