//! Digests (spec section 9): XXH3-64 of exact bytes in storage order, written as 16 lowercase
//! hex digits; a rank digest is XXH3-64 of the lines `"{name} {hex}\n"` sorted by name.

use std::fmt;
use std::hash::Hasher as _;

use twox_hash::XxHash3_64;

#[cfg(target_arch = "x86_64")]
mod xxh3_avx512;

/// An XXH3-64 digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub u64);

impl Digest {
    /// Digest of bytes in storage order.
    pub fn of(bytes: &[u8]) -> Self {
        #[cfg(target_arch = "x86_64")]
        if xxh3_avx512::available() {
            // SAFETY: the CPU has AVX-512 F (checked just above).
            return Digest(unsafe { xxh3_avx512::oneshot(bytes) });
        }
        Digest(XxHash3_64::oneshot(bytes))
    }

    /// Digest of several byte runs, as if they were concatenated.
    pub fn of_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut h = DigestStream::new();
        for p in parts {
            h.update(p);
        }
        h.finish()
    }

    /// Digest of little-endian f32 values (probe outputs).
    pub fn of_f32(values: &[f32]) -> Self {
        let mut h = DigestStream::new();
        for chunk in values.chunks(1024) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
            h.update(&bytes);
        }
        h.finish()
    }

    pub fn hex(self) -> String {
        format!("{:016x}", self.0)
    }

    /// Parses 16 hex digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        (s.len() == 16).then(|| u64::from_str_radix(s, 16).ok().map(Digest)).flatten()
    }
}

/// How many bytes [`DigestStream::update_fetching_ahead`] hashes for each stretch it fetches:
/// small enough that the fetches keep ahead of a piece of a few KiB, large enough that the
/// hasher's work per call stays small. The round trip's `wq_b` (20 KiB pieces of 16 rows, 1.3 MB
/// apart) hashed in 1.3-1.4 ms with 2 KiB steps, 1.5-1.7 ms with 8 KiB, 2.5-2.7 ms without.
pub const FETCH_STEP: usize = 2048;

/// A [`Digest`] computed piece by piece: the same value as [`Digest::of`] of the pieces
/// concatenated.
pub struct DigestStream(Hasher);

/// XXH3-64 on AVX-512 where the CPU has it ([`xxh3_avx512`]), else `twox-hash`'s.
enum Hasher {
    #[cfg(target_arch = "x86_64")]
    Avx512(Box<xxh3_avx512::Stream>),
    Twox(Box<XxHash3_64>),
}

impl DigestStream {
    pub fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        if xxh3_avx512::available() {
            // SAFETY: the CPU has AVX-512 F (checked just above).
            return Self(Hasher::Avx512(Box::new(unsafe { xxh3_avx512::Stream::new() })));
        }
        Self(Hasher::Twox(Box::new(XxHash3_64::with_seed(0))))
    }
    pub fn update(&mut self, bytes: &[u8]) {
        match &mut self.0 {
            #[cfg(target_arch = "x86_64")]
            Hasher::Avx512(s) => s.update(bytes),
            Hasher::Twox(h) => h.write(bytes),
        }
    }
    /// [`update`](Self::update) with `bytes`, asking for `next` (what will be hashed after it,
    /// somewhere else in memory) to be brought into the caches meanwhile: each
    /// [`FETCH_STEP`] of `bytes` hashed fetches the same stretch of `next`. Where the next bytes
    /// lie far away (a tensor read through a row permutation), the hardware's prefetchers would
    /// start on them only once they are read; the same value as plain updates.
    pub fn update_fetching_ahead(&mut self, bytes: &[u8], next: &[u8]) {
        for (i, step) in bytes.chunks(FETCH_STEP).enumerate() {
            crate::simd::prefetch(next.get(i * FETCH_STEP..next.len().min((i + 1) * FETCH_STEP)).unwrap_or_default());
            self.update(step);
        }
    }
    /// [`update`](Self::update) with the bytes that gathering `runs` of `row` in order would
    /// give, run `r` being `row[32 * r..32 * (r + 1)]`, read where they lie, where the AVX-512
    /// stream can take them ([`xxh3_avx512::Stream::update_gathered_halves`]). Returns false,
    /// having done nothing, where it cannot (the caller gathers them and updates).
    pub fn try_update_gathered_32(&mut self, row: &[u8], runs: &[u32]) -> bool {
        match &mut self.0 {
            #[cfg(target_arch = "x86_64")]
            Hasher::Avx512(s) => s.update_gathered_halves(row, runs),
            Hasher::Twox(_) => false,
        }
    }
    pub fn finish(&self) -> Digest {
        Digest(match &self.0 {
            #[cfg(target_arch = "x86_64")]
            Hasher::Avx512(s) => s.finish(),
            Hasher::Twox(h) => h.finish(),
        })
    }
}

impl Default for DigestStream {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The text a rank digest hashes: lines `"{name} {hex}\n"` sorted by name (byte order).
pub fn rank_digest_text<'a>(entries: impl IntoIterator<Item = (&'a str, Digest)>) -> String {
    let mut lines: Vec<(&str, Digest)> = entries.into_iter().collect();
    lines.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut text = String::with_capacity(lines.len() * 64);
    for (name, d) in lines {
        text.push_str(name);
        text.push(' ');
        text.push_str(&d.hex());
        text.push('\n');
    }
    text
}

/// XXH3-64 of [`rank_digest_text`].
pub fn rank_digest<'a>(entries: impl IntoIterator<Item = (&'a str, Digest)>) -> Digest {
    Digest::of(rank_digest_text(entries).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // XXH3-64 of the empty input with seed 0 (reference value of the algorithm).
        assert_eq!(Digest::of(b"").hex(), "2d06800538d394c2");
        assert_eq!(Digest::of_parts([&b"ab"[..], &b"c"[..]]), Digest::of(b"abc"));
        assert_eq!(Digest::from_hex("2d06800538d394c2"), Some(Digest::of(b"")));
        assert_eq!(Digest::from_hex("xyz"), None);
    }

    #[test]
    fn rank_digest_sorts_by_name() {
        let a = Digest(1);
        let b = Digest(0xabc);
        let text = rank_digest_text([("z.w", a), ("a.w", b)]);
        assert_eq!(text, "a.w 0000000000000abc\nz.w 0000000000000001\n");
        assert_eq!(rank_digest([("z.w", a), ("a.w", b)]), Digest::of(text.as_bytes()));
    }

    proptest::proptest! {
        /// Hashing pieces while fetching the next gives the digest of the pieces concatenated,
        /// whatever the pieces' lengths against [`FETCH_STEP`] and whatever is fetched.
        #[test]
        fn fetching_ahead_changes_no_digest(lens in proptest::collection::vec(0usize..3 * FETCH_STEP, 0..6), seed: u8) {
            let all: Vec<u8> = (0..lens.iter().sum::<usize>()).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
            let mut pieces = Vec::new();
            let mut rest = &all[..];
            for &n in &lens {
                let (piece, tail) = rest.split_at(n);
                pieces.push(piece);
                rest = tail;
            }
            let mut h = DigestStream::new();
            for (i, piece) in pieces.iter().enumerate() {
                // The next piece, or (for the last) the first: either way only fetched.
                h.update_fetching_ahead(piece, pieces.get(i + 1).or(pieces.first()).copied().unwrap_or_default());
            }
            proptest::prop_assert_eq!(h.finish(), Digest::of(&all));
        }
    }
}
