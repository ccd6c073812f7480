//! Deterministic test data shared by the unit tests, the GPU tests and the host check's vector
//! generator (not part of the numeric API).

/// `n` bytes of the splitmix64 stream from `seed`.
pub fn splitmix_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut z = seed;
    (0..n)
        .map(|_| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (x ^ (x >> 31)) as u8
        })
        .collect()
}
