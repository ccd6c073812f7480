//! XXH3-64 with seed 0 (the only seed a digest uses) of inputs longer than [`SHORT_MAX`] bytes,
//! on AVX-512: the eight 64-bit accumulators live in one 512-bit register, so a 64-byte stripe is
//! one load, one multiply and one add into them. `twox-hash`, which every digest used alone
//! before, dispatches at run time to AVX2 at most (two registers and two chains per stripe), and
//! the crates with an AVX-512 path pick it when compiled (`xxhash-rust`), not when run; this
//! module is that path for the long inputs the loader and the round trip hash. Inputs of
//! [`SHORT_MAX`] bytes or fewer go to `twox-hash` from here too, and [`super::Digest`] to
//! `twox-hash` alone on CPUs without AVX-512.
//! The values are `twox-hash`'s, bit for bit (the tests compare them on every length around
//! the algorithm's boundaries and on random splits of a stream).
//!
//! The algorithm (XXH3 as its reference describes it for inputs over 240 bytes): the input is
//! cut in blocks of 16 stripes of 64 bytes; each stripe is accumulated with the secret's bytes
//! from `8 * stripe_in_block`, each full block (one that more bytes follow) ends with a
//! scramble of the accumulators; the last block's stripes but the last are accumulated, then
//! the input's last 64 bytes with the secret at [`LAST_STRIPE_SECRET`], and the accumulators
//! are merged with the length.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use twox_hash::XxHash3_64;

/// Inputs up to this long are hashed by XXH3's short-input algorithms (`twox-hash`'s).
pub const SHORT_MAX: usize = 240;

const STRIPE: usize = 64;
/// Half a stripe: the runs [`Stream::update_gathered_halves`] gathers.
const HALF: usize = STRIPE / 2;
/// XXH3's default secret.
#[rustfmt::skip]
const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];
/// How far ahead of the block it hashes [`blocks`] fetches.
const FETCH_AHEAD: usize = 4096;
const STRIPES_PER_BLOCK: usize = (SECRET.len() - STRIPE) / 8;
const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;
/// Where the secret of the scramble, of the input's last stripe and of the merge start.
const SCRAMBLE_SECRET: usize = SECRET.len() - STRIPE;
const LAST_STRIPE_SECRET: usize = SECRET.len() - STRIPE - 7;
const MERGE_SECRET: usize = 11;

const PRIME32_1: u64 = 0x9E3779B1;
const PRIME32_2: u64 = 0x85EBCA77;
const PRIME32_3: u64 = 0xC2B2AE3D;
const PRIME64_1: u64 = 0x9E3779B185EBCA87;
const PRIME64_2: u64 = 0xC2B2AE3D27D4EB4F;
const PRIME64_3: u64 = 0x165667B19E3779F9;
const PRIME64_4: u64 = 0x85EBCA77C2B2AE63;
const PRIME64_5: u64 = 0x27D4EB2F165667C5;
const PRIME_MX1: u64 = 0x165667919E3779F9;
const INITIAL: [u64; 8] = [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1];

pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// What one stripe adds to the accumulators: lane `i` gets the product of its key's 32-bit
/// halves (`stripe ^ secret`) and the stripe's lane `i ^ 1`.
#[inline(always)]
unsafe fn stripe_term(stripe: &[u8; STRIPE], secret: &[u8]) -> __m512i {
    // SAFETY: a 64-byte unaligned load of a 64-byte stripe; the caller has AVX-512 F.
    unsafe { term_of(_mm512_loadu_si512(stripe.as_ptr().cast()), secret) }
}

/// [`stripe_term`] of a stripe in a register.
#[inline(always)]
unsafe fn term_of(data: __m512i, secret: &[u8]) -> __m512i {
    debug_assert!(secret.len() >= STRIPE);
    // SAFETY: a 64-byte unaligned load of at least 64 secret bytes; the caller has AVX-512 F.
    unsafe {
        let key = _mm512_xor_si512(data, _mm512_loadu_si512(secret.as_ptr().cast()));
        let product = _mm512_mul_epu32(key, _mm512_srli_epi64::<32>(key));
        _mm512_add_epi64(product, _mm512_shuffle_epi32::<_MM_PERM_BADC>(data))
    }
}

/// One stripe into the accumulators.
#[inline(always)]
unsafe fn accumulate(acc: __m512i, stripe: &[u8; STRIPE], secret: &[u8]) -> __m512i {
    // SAFETY: the caller has AVX-512 F.
    unsafe { _mm512_add_epi64(acc, stripe_term(stripe, secret)) }
}

/// The end of a block: `acc = (acc ^ (acc >> 47) ^ secret) * PRIME32_1`, lane by lane.
#[inline(always)]
unsafe fn scramble(acc: __m512i) -> __m512i {
    // SAFETY: a 64-byte load of the secret's last 64 bytes; the caller has AVX-512 F.
    unsafe {
        let key = _mm512_loadu_si512(SECRET[SCRAMBLE_SECRET..].as_ptr().cast());
        let mixed = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64::<47>(acc)), key);
        let prime = _mm512_set1_epi64(PRIME32_1 as i64);
        let low = _mm512_mul_epu32(mixed, prime);
        let high = _mm512_mul_epu32(_mm512_srli_epi64::<32>(mixed), prime);
        _mm512_add_epi64(low, _mm512_slli_epi64::<32>(high))
    }
}

/// One whole block into the accumulators, then its scramble; `stripe(i)` loads stripe `i` of
/// the block (0 to 15). The adds are modulo 2^64 and nothing else touches the accumulators
/// before the scramble: four sums of four stripes each, instead of one chain of sixteen adds
/// (256 KiB in cache: 123 GB/s, against 59 as one chain and twox-hash's AVX2 54).
#[inline(always)]
unsafe fn block_into(v: __m512i, stripe: impl Fn(usize) -> __m512i) -> __m512i {
    // SAFETY: the caller has AVX-512 F.
    unsafe {
        let (mut s0, mut s1, mut s2, mut s3) =
            (_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512());
        for q in 0..STRIPES_PER_BLOCK / 4 {
            let secret = &SECRET[32 * q..];
            s0 = _mm512_add_epi64(s0, term_of(stripe(4 * q), secret));
            s1 = _mm512_add_epi64(s1, term_of(stripe(4 * q + 1), &secret[8..]));
            s2 = _mm512_add_epi64(s2, term_of(stripe(4 * q + 2), &secret[16..]));
            s3 = _mm512_add_epi64(s3, term_of(stripe(4 * q + 3), &secret[24..]));
        }
        let all = _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3));
        scramble(_mm512_add_epi64(v, all))
    }
}

/// Accumulates and scrambles whole blocks (`blocks.len()` a multiple of [`BLOCK`]).
#[target_feature(enable = "avx512f")]
unsafe fn blocks(acc: &mut [u64; 8], blocks: &[u8]) {
    debug_assert!(blocks.len().is_multiple_of(BLOCK));
    // SAFETY: `acc` is 64 bytes; AVX-512 F is this function's target feature.
    unsafe {
        let mut v = _mm512_loadu_si512(acc.as_ptr().cast());
        for (b, block) in blocks.as_chunks::<BLOCK>().0.iter().enumerate() {
            // Ask for the block `FETCH_AHEAD` bytes on (of these bytes only): one thread
            // hashing 128 MB from memory read 42 GB/s with it, 30 without (twox-hash 35).
            let ahead = b * BLOCK + FETCH_AHEAD;
            crate::simd::prefetch(blocks.get(ahead..blocks.len().min(ahead + BLOCK)).unwrap_or_default());
            let stripes = block.as_chunks::<STRIPE>().0;
            v = block_into(v, |i| _mm512_loadu_si512(stripes[i].as_ptr().cast()));
        }
        _mm512_storeu_si512(acc.as_mut_ptr().cast(), v);
    }
}

/// [`blocks`] of the bytes that gathering `runs` (32-byte runs, [`HALF`]) of `row` in order
/// would give, read where they lie (`runs.len()` a multiple of the runs of a block).
///
/// # Safety
/// AVX-512 F, and every run lies inside `row` (`HALF * (r + 1) <= row.len()`).
#[target_feature(enable = "avx512f")]
unsafe fn blocks_gathered(acc: &mut [u64; 8], row: &[u8], runs: &[u32]) {
    const RUNS_PER_BLOCK: usize = BLOCK / HALF;
    debug_assert!(runs.len().is_multiple_of(RUNS_PER_BLOCK));
    debug_assert!(runs.iter().all(|&r| (r as usize + 1) * HALF <= row.len()));
    let base = row.as_ptr();
    // SAFETY: `acc` is 64 bytes; every run lies inside `row` (the caller's contract), so each
    // 32-byte load reads inside it; AVX-512 F is this function's target feature.
    unsafe {
        let stripe = |a: u32, b: u32| {
            let (lo, hi) = (base.add(a as usize * HALF), base.add(b as usize * HALF));
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(lo.cast())), _mm256_loadu_si256(hi.cast()))
        };
        let mut v = _mm512_loadu_si512(acc.as_ptr().cast());
        for block in runs.as_chunks::<RUNS_PER_BLOCK>().0 {
            v = block_into(v, |i| stripe(block[2 * i], block[2 * i + 1]));
        }
        _mm512_storeu_si512(acc.as_mut_ptr().cast(), v);
    }
}

/// The last block's stripes but its last, the input's last stripe, then the merge.
/// `last_block` is 1 to [`BLOCK`] bytes, `len` the whole input's.
#[target_feature(enable = "avx512f")]
unsafe fn finish(acc: &[u64; 8], last_block: &[u8], last_stripe: &[u8; STRIPE], len: usize) -> u64 {
    debug_assert!(!last_block.is_empty() && last_block.len() <= BLOCK);
    let mut lanes = [0u64; 8];
    // SAFETY: `acc` and `lanes` are 64 bytes; AVX-512 F is this function's target feature.
    unsafe {
        let mut v = _mm512_loadu_si512(acc.as_ptr().cast());
        let stripes = (last_block.len() - 1) / STRIPE;
        for (i, stripe) in last_block.as_chunks::<STRIPE>().0[..stripes].iter().enumerate() {
            v = accumulate(v, stripe, &SECRET[8 * i..]);
        }
        v = accumulate(v, last_stripe, &SECRET[LAST_STRIPE_SECRET..]);
        _mm512_storeu_si512(lanes.as_mut_ptr().cast(), v);
    }
    let word = |i: usize| u64::from_le_bytes(SECRET[MERGE_SECRET + 8 * i..][..8].try_into().unwrap_or_default());
    let mut h = (len as u64).wrapping_mul(PRIME64_1);
    for i in 0..4 {
        let product = u128::from(lanes[2 * i] ^ word(2 * i)) * u128::from(lanes[2 * i + 1] ^ word(2 * i + 1));
        h = h.wrapping_add(product as u64 ^ (product >> 64) as u64);
    }
    h ^= h >> 37;
    h = h.wrapping_mul(PRIME_MX1);
    h ^ (h >> 32)
}

/// XXH3-64 of `input`.
///
/// # Safety
/// The CPU has AVX-512 F ([`available`]).
pub unsafe fn oneshot(input: &[u8]) -> u64 {
    if input.len() <= SHORT_MAX {
        return XxHash3_64::oneshot(input);
    }
    let mut acc = INITIAL;
    let full = (input.len() - 1) / BLOCK * BLOCK;
    let last_stripe = input.last_chunk::<STRIPE>().copied().unwrap_or([0; STRIPE]);
    // SAFETY: the caller has AVX-512 F.
    unsafe {
        blocks(&mut acc, &input[..full]);
        finish(&acc, &input[full..], &last_stripe, input.len())
    }
}

/// XXH3-64 fed piece by piece. Each block is accumulated once more bytes follow it (the last
/// block is treated differently), straight from the piece where it lies whole in one.
#[derive(Clone)]
pub struct Stream {
    acc: [u64; 8],
    /// The bytes of the current block so far (after the first update, 1 to [`BLOCK`]).
    pending: [u8; BLOCK],
    pending_len: usize,
    /// The last 64 bytes of the last block accumulated (the input's last stripe reaches back
    /// into them when fewer are pending).
    tail: [u8; STRIPE],
    total: usize,
}

impl Stream {
    /// # Safety
    /// The CPU has AVX-512 F ([`available`]); every method relies on it.
    pub unsafe fn new() -> Self {
        Stream { acc: INITIAL, pending: [0; BLOCK], pending_len: 0, tail: [0; STRIPE], total: 0 }
    }

    pub fn update(&mut self, mut input: &[u8]) {
        if input.is_empty() {
            return;
        }
        self.total += input.len();
        if self.pending_len > 0 {
            let take = (BLOCK - self.pending_len).min(input.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&input[..take]);
            self.pending_len += take;
            input = &input[take..];
            if input.is_empty() {
                return;
            }
            // SAFETY: a `Stream` exists only where the CPU has AVX-512 F (`new`).
            unsafe { blocks(&mut self.acc, &self.pending) };
            self.tail.copy_from_slice(&self.pending[BLOCK - STRIPE..]);
            self.pending_len = 0;
        }
        // The blocks more bytes follow, then the rest (1 to BLOCK bytes) pending.
        let full = (input.len() - 1) / BLOCK * BLOCK;
        if full > 0 {
            // SAFETY: as above.
            unsafe { blocks(&mut self.acc, &input[..full]) };
            self.tail.copy_from_slice(&input[full - STRIPE..full]);
        }
        let rest = &input[full..];
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    /// [`Stream::update`] with the bytes that gathering `runs` of `row` in order would give (run
    /// `r` is `row[HALF * r..HALF * (r + 1)]`), read where they lie but for the last block, when
    /// they are whole blocks and the stream is at a block's end (it is after whole blocks): the
    /// `wo_a` rows of a round trip, 32-byte chunks read back in checkpoint order, without first
    /// copying each chunk out. Returns false, having done nothing, where it cannot.
    pub fn update_gathered_halves(&mut self, row: &[u8], runs: &[u32]) -> bool {
        const RUNS_PER_BLOCK: usize = BLOCK / HALF;
        let n_blocks = runs.len() / RUNS_PER_BLOCK;
        if n_blocks == 0 || !runs.len().is_multiple_of(RUNS_PER_BLOCK) || !(self.pending_len == 0 || self.pending_len == BLOCK) {
            return false;
        }
        if runs.iter().any(|&r| (r as usize + 1) * HALF > row.len()) {
            return false;
        }
        self.total += runs.len() * HALF;
        if self.pending_len == BLOCK {
            // SAFETY: a `Stream` exists only where the CPU has AVX-512 F (`new`).
            unsafe { blocks(&mut self.acc, &self.pending) };
            self.tail.copy_from_slice(&self.pending[BLOCK - STRIPE..]);
        }
        let (body, last) = runs.split_at((n_blocks - 1) * RUNS_PER_BLOCK);
        if !body.is_empty() {
            // SAFETY: as above; every run lies inside `row` (checked above).
            unsafe { blocks_gathered(&mut self.acc, row, body) };
        }
        // The last block stays pending, as `update` keeps it. (`tail` is not kept: it is read
        // only while fewer than a stripe's bytes are pending, and a whole block is, until the
        // next update flushes it and sets `tail` from it.)
        for (d, &r) in self.pending.chunks_exact_mut(HALF).zip(last) {
            d.copy_from_slice(&row[r as usize * HALF..(r as usize + 1) * HALF]);
        }
        self.pending_len = BLOCK;
        true
    }

    /// The digest of the bytes so far.
    pub fn finish(&self) -> u64 {
        if self.total <= SHORT_MAX {
            // All of them are pending (no block was accumulated).
            return XxHash3_64::oneshot(&self.pending[..self.pending_len]);
        }
        let n = self.pending_len;
        let mut last_stripe = [0u8; STRIPE];
        if n >= STRIPE {
            last_stripe.copy_from_slice(&self.pending[n - STRIPE..n]);
        } else {
            last_stripe[..STRIPE - n].copy_from_slice(&self.tail[n..]);
            last_stripe[STRIPE - n..].copy_from_slice(&self.pending[..n]);
        }
        // SAFETY: as in `update`.
        unsafe { finish(&self.acc, &self.pending[..n], &last_stripe, self.total) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        crate::testdata::splitmix_bytes(n, seed)
    }

    /// Every length around the algorithm's boundaries: the short limit, stripes, blocks.
    #[test]
    fn oneshot_equals_twox_hash_at_every_boundary() {
        if !available() {
            return;
        }
        let data = bytes(4 * BLOCK + 3 * STRIPE, 7);
        let mut lens: Vec<usize> = (0..SHORT_MAX + 2 * STRIPE).collect();
        for k in 1..=4 {
            for d in 0..=2 * STRIPE {
                lens.extend([k * BLOCK + d, k * BLOCK - d]);
            }
        }
        for n in lens.into_iter().filter(|&n| n <= data.len()) {
            // SAFETY: checked just above.
            assert_eq!(unsafe { oneshot(&data[..n]) }, XxHash3_64::oneshot(&data[..n]), "{n} bytes");
        }
    }

    /// A stream fed in equal steps of every size around a stripe and a block (the pending block
    /// filled by many small updates, or flushed by large ones) gives `twox-hash`'s value, at
    /// every length around the block boundaries.
    #[test]
    fn a_stream_fed_in_steps_equals_twox_hash() {
        if !available() {
            return;
        }
        let data = bytes(3 * BLOCK + 2 * STRIPE, 11);
        let steps = [1, 2, 7, 31, 63, 64, 65, 127, 128, 129, 240, 241, 1000, 1023, 1024, 1025, 2048];
        let mut lens: Vec<usize> = vec![SHORT_MAX, SHORT_MAX + 1];
        for k in 1..=3 {
            for d in [0, 1, 2, 63, 64, 65] {
                lens.extend([k * BLOCK + d, k * BLOCK - d]);
            }
        }
        for n in lens.into_iter().filter(|&n| n <= data.len()) {
            for step in steps {
                // SAFETY: checked just above.
                let mut s = unsafe { Stream::new() };
                for piece in data[..n].chunks(step) {
                    s.update(piece);
                }
                assert_eq!(s.finish(), XxHash3_64::oneshot(&data[..n]), "{n} bytes in steps of {step}");
            }
        }
    }

    proptest::proptest! {
        /// Rows whose 32-byte runs are hashed where they lie, between plain updates of any
        /// length, give `twox-hash`'s value of the bytes gathered; a stream amid a block (after
        /// a plain update that is not whole blocks) refuses, changed in nothing.
        #[test]
        fn gathered_halves_equal_twox_hash_of_the_gathered_bytes(
            blocks in 1usize..4,
            rows in 1usize..4,
            before_blocks in 0usize..3,
            offset in 0usize..400,
            after in 0usize..300,
            seed: u64,
        ) {
            if !available() {
                return Ok(());
            }
            // Half the cases start at a block's end (where the runs are hashed where they lie),
            // half amid one (where the stream refuses).
            let before = before_blocks * BLOCK + offset.saturating_sub(200);
            let runs_per_row = blocks * BLOCK / HALF;
            let data = bytes(rows * runs_per_row * HALF + before + after, seed);
            let (head, rest) = data.split_at(before);
            let (body, tail) = rest.split_at(rows * runs_per_row * HALF);
            // A permutation of each row's runs that moves every run.
            let perm: Vec<u32> = (0..runs_per_row as u32).map(|i| (i * 7 + 3) % runs_per_row as u32).collect();
            let mut gathered = head.to_vec();
            // SAFETY: checked just above.
            let mut s = unsafe { Stream::new() };
            s.update(head);
            let at_block_end = before.is_multiple_of(BLOCK);
            for row in body.chunks_exact(runs_per_row * HALF) {
                let mut out = Vec::new();
                for &r in &perm {
                    out.extend_from_slice(&row[r as usize * HALF..][..HALF]);
                }
                let before_update = (s.total, s.pending_len);
                let took = s.update_gathered_halves(row, &perm);
                if !took {
                    proptest::prop_assert_eq!((s.total, s.pending_len), before_update, "a refusal changes nothing");
                    s.update(&out);
                }
                proptest::prop_assert!(took || !at_block_end, "refused at a block's end ({before} bytes before)");
                gathered.extend_from_slice(&out);
            }
            s.update(tail);
            gathered.extend_from_slice(tail);
            proptest::prop_assert_eq!(s.finish(), XxHash3_64::oneshot(&gathered));
        }

        /// A stream cut anywhere gives `twox-hash`'s value of the whole, long or short.
        #[test]
        fn a_stream_equals_twox_hash_wherever_it_is_cut(len in 0usize..5 * BLOCK, cuts in proptest::collection::vec(0usize..5 * BLOCK, 0..8), seed: u64) {
            if !available() {
                return Ok(());
            }
            let data = bytes(len, seed);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (len + 1)).collect();
            cuts.sort_unstable();
            // SAFETY: checked just above.
            let mut s = unsafe { Stream::new() };
            let mut at = 0;
            for c in cuts.into_iter().chain([len]) {
                s.update(&data[at..c]);
                at = c;
            }
            proptest::prop_assert_eq!(s.finish(), XxHash3_64::oneshot(&data));
        }
    }
}
