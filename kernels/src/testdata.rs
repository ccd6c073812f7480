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

/// E4M3 weights `[n, k]` that cover every byte (NaN, subnormals, both zeros) for the GEMM's edge
/// cases, with the NaN bytes (low seven bits all set) only in rows 3, 13, 23, ... so that the
/// other rows' outputs can stay finite.
pub fn gemm_edge_weights(n: usize, k: usize) -> Vec<u8> {
    (0..n * k)
        .map(|i| match (i * 113 + i / k) as u8 {
            b if b & 0x7F == 0x7F && (i / k) % 10 != 3 => b - 1,
            b => b,
        })
        .collect()
}

/// UE8M0 scales `[n, c]`, row-major, for the same rows: every byte in rows 7, 17, 27, ... (the
/// NaN scale 0xFF and scales large enough to overflow a sum), below 236 (2^108) elsewhere.
pub fn gemm_edge_scales(n: usize, c: usize) -> Vec<u8> {
    (0..n * c).map(|i| if (i / c) % 10 == 7 { (i * 97 + 5) as u8 } else { (i * 97 + 5) as u8 % 236 }).collect()
}
