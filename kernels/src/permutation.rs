//! The mega-attention permutations (spec section 5), with the convention `fused = standard[perm]`.
//! They are computed from geometry (local heads, head_dim), never from a tensor's shape.

use crate::KernelError;

/// Dims per Q chunk: each token's Q becomes `head_dim / 16` chunks of `[H heads x 16 dims]`.
pub const Q_CHUNK: usize = 16;
/// Dims per O chunk.
pub const O_CHUNK: usize = 32;
/// Heads per `wo_a` group (mega attention's fixed group size).
pub const HEADS_PER_GROUP: usize = 8;

/// The most positions a permutation may have: its entries are `u32` indices.
pub const MAX_PERMUTATION_LEN: usize = 1 << 32;

/// `a * b` positions, refused (not panicking, not allocating) when the product overflows or
/// exceeds [`MAX_PERMUTATION_LEN`].
fn checked_len(what: &str, a: usize, b: usize) -> Result<usize, KernelError> {
    match a.checked_mul(b) {
        Some(n) if n <= MAX_PERMUTATION_LEN => Ok(n),
        Some(n) => Err(KernelError::Shape(format!("{what} of {a} x {b} = {n} positions exceeds u32 indices ({MAX_PERMUTATION_LEN})"))),
        None => Err(KernelError::Shape(format!("{what} of {a} x {b} positions overflows"))),
    }
}

/// A bijection on `0..len`: `perm[f]` is the standard index read into fused position `f`.
/// The inverse is kept beside it (made once, with the map), so that walking in standard order
/// allocates nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permutation {
    map: Vec<u32>,
    inv: Vec<u32>,
}

impl Permutation {
    /// From a map already known to be a bijection.
    fn of_bijection(map: Vec<u32>) -> Self {
        let mut inv = vec![0u32; map.len()];
        for (f, &s) in map.iter().enumerate() {
            inv[s as usize] = f as u32;
        }
        Self { map, inv }
    }

    /// Wraps a map, checking that it is a bijection.
    pub fn from_map(map: Vec<u32>) -> Result<Self, KernelError> {
        let mut seen = vec![false; map.len()];
        for (f, &s) in map.iter().enumerate() {
            let slot = seen
                .get_mut(s as usize)
                .ok_or_else(|| KernelError::Shape(format!("permutation sends {f} to {s}, outside 0..{}", map.len())))?;
            if std::mem::replace(slot, true) {
                return Err(KernelError::Shape(format!("permutation repeats index {s}")));
            }
        }
        Ok(Self::of_bijection(map))
    }

    /// The Q permutation of `wq_b` rows for `n_local_heads` heads of `head_dim` dims:
    /// standard row `s = h*D + d` goes to fused row `f = (d/16)*(H*16) + h*16 + d%16`.
    pub fn q_rows(n_local_heads: usize, head_dim: usize) -> Result<Self, KernelError> {
        if n_local_heads == 0 || head_dim == 0 || !head_dim.is_multiple_of(Q_CHUNK) {
            return Err(KernelError::Shape(format!(
                "Q permutation needs heads > 0 and head_dim a multiple of {Q_CHUNK} (heads {n_local_heads}, head_dim {head_dim})"
            )));
        }
        let h_count = n_local_heads;
        let len = checked_len("Q permutation", h_count, head_dim)?;
        let mut map = vec![0u32; len];
        for h in 0..h_count {
            for d in 0..head_dim {
                let s = h * head_dim + d;
                let f = (d / Q_CHUNK) * (h_count * Q_CHUNK) + h * Q_CHUNK + d % Q_CHUNK;
                map[f] = s as u32;
            }
        }
        Ok(Self::of_bijection(map))
    }

    /// The O permutation of `wo_a` columns (one group of 8 heads):
    /// standard column `s = h*D + c*32 + j` goes to fused column `f = (c*8 + h)*32 + j`.
    pub fn o_columns(head_dim: usize) -> Result<Self, KernelError> {
        if head_dim == 0 || !head_dim.is_multiple_of(O_CHUNK) {
            return Err(KernelError::Shape(format!("O permutation needs head_dim a positive multiple of {O_CHUNK} (got {head_dim})")));
        }
        let chunks = head_dim / O_CHUNK;
        let mut map = vec![0u32; checked_len("O permutation", HEADS_PER_GROUP, head_dim)?];
        for h in 0..HEADS_PER_GROUP {
            for c in 0..chunks {
                for j in 0..O_CHUNK {
                    let s = h * head_dim + c * O_CHUNK + j;
                    let f = (c * HEADS_PER_GROUP + h) * O_CHUNK + j;
                    map[f] = s as u32;
                }
            }
        }
        Ok(Self::of_bijection(map))
    }

    /// The permutation of `chunk`-sized runs, `perm[::chunk] / chunk`, checking that every run
    /// of `chunk` fused positions reads one aligned run of standard positions (so the
    /// permutation moves whole blocks and block quantization commutes with it).
    pub fn of_chunks(&self, chunk: usize) -> Result<Self, KernelError> {
        if chunk == 0 || !self.map.len().is_multiple_of(chunk) {
            return Err(KernelError::Shape(format!("{} is not a multiple of chunk {chunk}", self.map.len())));
        }
        let mut map = Vec::with_capacity(self.map.len() / chunk);
        for run in self.map.chunks_exact(chunk) {
            let start = run[0] as usize;
            let aligned = start.is_multiple_of(chunk);
            let contiguous = run.iter().enumerate().all(|(i, &s)| s as usize == start + i);
            if !aligned || !contiguous {
                return Err(KernelError::Shape(format!(
                    "permutation does not move aligned runs of {chunk} (run starting at standard {start})"
                )));
            }
            map.push((start / chunk) as u32);
        }
        Ok(Self::of_bijection(map))
    }

    /// The inverse bijection: `inverse[perm[f]] = f`.
    pub fn inverse(&self) -> Self {
        Self { map: self.inv.clone(), inv: self.map.clone() }
    }

    /// The inverse's map: `inverse_map()[perm[f]] = f` (the fused position of each standard
    /// index), without a copy.
    pub fn inverse_map(&self) -> &[u32] {
        &self.inv
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn as_slice(&self) -> &[u32] {
        &self.map
    }

    /// Applies the permutation to a slice of items: `out[f] = items[perm[f]]`.
    pub fn apply<T: Copy>(&self, items: &[T]) -> Vec<T> {
        self.map.iter().map(|&s| items[s as usize]).collect()
    }
}

/// A permutation applied while writing a row-major matrix: which source row (or which
/// 32-element block of the same row) each destination position reads.
#[derive(Clone, Copy, Debug)]
pub enum BlockOrder<'p> {
    /// Checkpoint order: nothing moves.
    Identity,
    /// Destination row `f` reads source row `perm[f]` (the Q permutation).
    Rows(&'p Permutation),
    /// Destination block `j` of every row reads block `perm[j]` of that row (the O chunk
    /// permutation; its per-block scales move the same way).
    Chunks(&'p Permutation),
}

/// Gathers runs of `run_bytes` bytes inside each row of `row_bytes` bytes:
/// `dst[row][f] = src[row][perm[f]]` where indices count runs. A row gather is the case of one
/// "row" spanning the whole buffer; a column gather has `row_bytes` = one matrix row.
pub fn gather_runs(src: &[u8], row_bytes: usize, run_bytes: usize, perm: &Permutation, dst: &mut Vec<u8>) -> Result<(), KernelError> {
    check_runs(src, row_bytes, run_bytes, perm)?;
    // Every byte is overwritten below: no need to clear first.
    crate::backend::resize_for_overwrite(dst, src.len());
    for (src_row, dst_row) in src.chunks_exact(row_bytes).zip(dst.chunks_exact_mut(row_bytes)) {
        gather_row(src_row, dst_row, run_bytes, perm.as_slice());
    }
    Ok(())
}

/// One row of [`gather_runs`]: `dst_row`'s run `f` is `src_row`'s run `perm[f]`. The run
/// lengths the layouts use (single scale bytes, 32-byte `wo_a` chunks) get copies of a size
/// known when compiled; a copy of a length known only at run time is a call per run.
#[inline]
fn gather_row(src_row: &[u8], dst_row: &mut [u8], run_bytes: usize, perm: &[u32]) {
    #[inline(always)]
    fn fixed<const R: usize>(src_row: &[u8], dst_row: &mut [u8], perm: &[u32]) {
        for (d, &s) in dst_row.chunks_exact_mut(R).zip(perm) {
            let at = s as usize * R;
            d.copy_from_slice(&src_row[at..at + R]);
        }
    }
    match run_bytes {
        1 => {
            for (d, &s) in dst_row.iter_mut().zip(perm) {
                *d = src_row[s as usize];
            }
        }
        O_CHUNK => fixed::<O_CHUNK>(src_row, dst_row, perm),
        _ => {
            for (d, &s) in dst_row.chunks_exact_mut(run_bytes).zip(perm) {
                let at = s as usize * run_bytes;
                d.copy_from_slice(&src_row[at..at + run_bytes]);
            }
        }
    }
}

fn check_runs(src: &[u8], row_bytes: usize, run_bytes: usize, perm: &Permutation) -> Result<(), KernelError> {
    if run_bytes == 0 || row_bytes != perm.len() * run_bytes || !src.len().is_multiple_of(row_bytes.max(1)) {
        return Err(KernelError::Shape(format!(
            "cannot gather {} runs of {run_bytes} bytes from rows of {row_bytes} bytes ({} bytes in all)",
            perm.len(),
            src.len()
        )));
    }
    Ok(())
}

/// What [`gather_runs`] writes into one row, in order, as slices of `src_row`: each stretch of
/// runs that are consecutive in `src_row` too ([`consecutive_runs`]) is one piece, to copy or
/// digest as one (the Q permutation moves 16 consecutive rows at a time).
pub fn gathered_pieces<'a>(src_row: &'a [u8], run_bytes: usize, perm: &'a [u32]) -> impl Iterator<Item = &'a [u8]> + 'a {
    consecutive_runs(perm).map(move |r| &src_row[r.start as usize * run_bytes..r.end as usize * run_bytes])
}

/// `perm` cut into its stretches of consecutive values (`5, 6, 7, 2, 3` gives `5..8, 2..4`).
fn consecutive_runs(perm: &[u32]) -> impl Iterator<Item = std::ops::Range<u32>> + '_ {
    let mut rest = perm;
    std::iter::from_fn(move || {
        let &first = rest.first()?;
        let len = 1 + rest.windows(2).take_while(|w| w[0].checked_add(1) == Some(w[1])).count();
        rest = &rest[len..];
        Some(first..first + len as u32)
    })
}

/// Runs at least this long are hashed where they lie; shorter ones are gathered a row at a time
/// into a scratch row first (a hasher fed 32-byte pieces spends more on the calls than on the
/// bytes).
const HASH_IN_PLACE_RUN: usize = 256;

/// How many rows ahead [`digest_gathered_runs`] and the chunk-order placement
/// ([`crate::placement::place_e4m3`]) fetch the rows they gather runs from.
pub(crate) const ROWS_AHEAD: usize = 2;

/// The most bytes [`digest_gathered_runs`] gathers before hashing them (runs shorter than
/// [`HASH_IN_PLACE_RUN`]): a fraction of L1, and no copy the size of a tensor.
const GATHER_PIECE: usize = 32 << 10;

/// The digest of what [`gather_runs`] would write, without writing it (the same checks, the
/// same value): the round trip reads kernel tensors back through the inverse permutation this
/// way, with no buffer the size of the tensor.
pub fn digest_gathered_runs(src: &[u8], row_bytes: usize, run_bytes: usize, perm: &Permutation) -> Result<crate::Digest, KernelError> {
    check_runs(src, row_bytes, run_bytes, perm)?;
    let mut h = crate::digest::DigestStream::new();
    if run_bytes >= HASH_IN_PLACE_RUN {
        for src_row in src.chunks_exact(row_bytes) {
            // Each piece (16 `wq_b` rows) lies far from the one before: fetched while that one
            // is hashed.
            let mut pieces = gathered_pieces(src_row, run_bytes, perm.as_slice()).peekable();
            while let Some(piece) = pieces.next() {
                h.update_fetching_ahead(piece, pieces.peek().copied().unwrap_or_default());
            }
        }
    } else {
        // Gathered a piece of at most GATHER_PIECE bytes at a time (a whole row where rows are
        // that short): a row of short runs can be a whole tensor, which is never copied.
        let runs_per_piece = (GATHER_PIECE / run_bytes).clamp(1, perm.len().max(1));
        let mut piece = vec![0u8; runs_per_piece * run_bytes];
        for (i, src_row) in src.chunks_exact(row_bytes).enumerate() {
            // Runs picked out of a row in permuted order each wait on memory, and the
            // prefetchers stop at each 4 KiB page (a `wo_a` row): rows are fetched
            // `ROWS_AHEAD` ahead. The round trip's `wo_a` of a TP 1 dsv41-flash layer hashed in
            // 1.7-1.8 ms, against 2.0-2.1 ms when each row was first copied out in order
            // (fetched the same way) and 3.4-3.7 ms copied out and not fetched.
            crate::simd::prefetch_row(src, row_bytes, i + ROWS_AHEAD);
            for runs in perm.as_slice().chunks(runs_per_piece) {
                // Hashed where they lie (two runs to a stripe of the hash) where the hasher
                // can: a TP 1 dsv41-flash layer's `wo_a` (32 MB from memory, one thread) in
                // 2.2-2.4 ms, against 2.6-2.8 ms gathering each row first (below).
                if run_bytes == 32 && h.try_update_gathered_32(src_row, runs) {
                    continue;
                }
                let out = &mut piece[..runs.len() * run_bytes];
                gather_row(src_row, out, run_bytes, runs);
                h.update(out);
            }
        }
    }
    Ok(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gathered_digest_equals_the_digest_of_the_gathered_bytes() {
        let src: Vec<u8> = (0..4 * 512 * 3).map(|i| (i * 7 + i / 13) as u8).collect();
        let mut dst = Vec::new();
        // Rows of runs (wq_b rows, 512-byte runs; runs longer than a fetch step), short runs
        // (wo_a chunks), single bytes (scale columns).
        // 32-byte runs in rows of whole hash blocks (1 KiB) are hashed where they lie.
        for (row_bytes, run_bytes) in
            [(src.len(), 512), (src.len(), 3072), (1536, 32), (1024, 32), (2048, 32), (src.len(), 32), (512, 1), (src.len(), 3)]
        {
            let n = row_bytes / run_bytes;
            let perm = Permutation::from_map((0..n as u32).map(|i| (i * 5 + 3) % n as u32).collect())
                .unwrap_or_else(|_| Permutation::from_map((0..n as u32).rev().collect()).unwrap());
            gather_runs(&src, row_bytes, run_bytes, &perm, &mut dst).unwrap();
            assert_eq!(
                digest_gathered_runs(&src, row_bytes, run_bytes, &perm).unwrap(),
                crate::Digest::of(&dst),
                "{row_bytes}/{run_bytes}"
            );
        }
        // Rows of short runs longer than one gathered piece (hashed a piece at a time).
        let long: Vec<u8> = (0..2 * 40_008).map(|i| (i * 11 + i / 7) as u8).collect();
        for (row_bytes, run_bytes) in [(40_008, 8), (40_008, 3), (long.len(), 1)] {
            assert!(row_bytes > GATHER_PIECE);
            let n = row_bytes / run_bytes;
            let perm = Permutation::from_map((0..n as u32).rev().collect()).unwrap();
            gather_runs(&long, row_bytes, run_bytes, &perm, &mut dst).unwrap();
            assert_eq!(
                digest_gathered_runs(&long, row_bytes, run_bytes, &perm).unwrap(),
                crate::Digest::of(&dst),
                "{row_bytes}/{run_bytes}"
            );
        }
        let perm = Permutation::from_map(vec![1, 0]).unwrap();
        assert!(matches!(digest_gathered_runs(&src, 10, 3, &perm), Err(KernelError::Shape(_))));
    }

    #[test]
    fn consecutive_runs_cut_where_the_values_jump() {
        let cut = |p: &[u32]| consecutive_runs(p).collect::<Vec<_>>();
        assert_eq!(cut(&[5, 6, 7, 2, 3]), vec![5..8, 2..4]);
        assert_eq!(cut(&[]), Vec::<std::ops::Range<u32>>::new());
        assert_eq!(cut(&[3, 2, 1]), vec![3..4, 2..3, 1..2]);
        assert_eq!(cut(&[0, 1, 2, 3]), vec![0..4]);
        // The inverse Q permutation for 2 heads of 32 dims reads 16 consecutive rows at a time.
        let inv = Permutation::q_rows(2, 32).unwrap().inverse();
        assert_eq!(cut(inv.as_slice()), vec![0..16, 32..48, 16..32, 48..64]);
        // The pieces, one after another, are what the gather writes: 64 rows of 3 bytes in 4 pieces.
        let src: Vec<u8> = (0..64 * 3).map(|i| i as u8).collect();
        let mut want = Vec::new();
        gather_runs(&src, src.len(), 3, &inv, &mut want).unwrap();
        let pieces: Vec<&[u8]> = gathered_pieces(&src, 3, inv.as_slice()).collect();
        assert_eq!(pieces.len(), 4);
        assert_eq!(pieces.concat(), want);
    }

    #[test]
    fn q_worked_examples() {
        let p = Permutation::q_rows(8, 512).unwrap();
        assert_eq!(&p.as_slice()[0..4], &[0, 1, 2, 3]);
        assert_eq!(&p.as_slice()[16..20], &[512, 513, 514, 515]);
        assert_eq!(&p.as_slice()[128..132], &[16, 17, 18, 19]);
    }

    #[test]
    fn o_worked_examples() {
        let p = Permutation::o_columns(512).unwrap();
        assert_eq!(&p.as_slice()[0..3], &[0, 1, 2]);
        assert_eq!(&p.as_slice()[32..35], &[512, 513, 514]);
        assert_eq!(&p.as_slice()[256..259], &[32, 33, 34]);
        let chunks = p.of_chunks(O_CHUNK).unwrap();
        assert_eq!(chunks.len(), 128);
        assert_eq!(&chunks.as_slice()[..10], &[0, 16, 32, 48, 64, 80, 96, 112, 1, 17]);
    }

    #[test]
    fn q_moves_whole_scale_blocks_only_along_rows() {
        // Rows move whole; the 32-element K blocks of every row stay put.
        let p = Permutation::q_rows(16, 512).unwrap();
        assert!(Permutation::from_map(p.as_slice().to_vec()).is_ok());
        assert!(p.of_chunks(Q_CHUNK).is_ok());
    }

    #[test]
    fn absurd_sizes_are_refused_not_panicking() {
        for (heads, head_dim) in [(8usize << 58, 512), (usize::MAX, 16), (1 << 28, 512), (8, 0), (0, 512)] {
            assert!(matches!(Permutation::q_rows(heads, head_dim), Err(KernelError::Shape(_))), "{heads} x {head_dim}");
        }
        for head_dim in [0, usize::MAX - 31, 1 << 62] {
            assert!(matches!(Permutation::o_columns(head_dim), Err(KernelError::Shape(_))), "{head_dim}");
        }
    }

    #[test]
    fn rejects_non_bijections() {
        assert!(Permutation::from_map(vec![0, 0, 1]).is_err());
        assert!(Permutation::from_map(vec![0, 3]).is_err());
    }

    #[test]
    fn gather_rows_and_columns() {
        let perm = Permutation::from_map(vec![2, 0, 1]).unwrap();
        let src: Vec<u8> = (0..6).collect(); // 3 rows of 2 bytes
        let mut dst = Vec::new();
        gather_runs(&src, 6, 2, &perm, &mut dst).unwrap();
        assert_eq!(dst, vec![4, 5, 0, 1, 2, 3]);
        // Columns: 2 rows of 3 bytes.
        gather_runs(&src, 3, 1, &perm, &mut dst).unwrap();
        assert_eq!(dst, vec![2, 0, 1, 5, 3, 4]);
    }
}
