//! Run-time selection of wider vector code for the host loops that bound load speed (the NaN
//! scan, BF16 quantization). The loops are written once, as plain Rust the compiler
//! vectorizes; [`dispatch!`] compiles a call site a second time with AVX2 enabled and takes that
//! copy when the CPU has AVX2, so one binary runs on every x86-64 CPU and uses the wider
//! registers where they exist. The results are bit for bit the same: only integer and exactly
//! rounded float operations are involved, and no fused multiply-add is enabled.

/// Whether the AVX2 copies may run (cached by std after the first check).
#[inline]
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Asks for `bytes` to be brought into the caches ahead of their use (a hint: nothing where the
/// target has no prefetch instruction; bytes never fault).
#[inline(always)]
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch reads nothing the program sees and never faults; SSE, which has
        // it, is part of every x86-64 CPU.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// [`prefetch`] of row `i` of `rows` (rows of `row_bytes`), where there is one: the rows a
/// pass will read next, where each row is a 4 KiB page or more apart from the last (the
/// hardware's streams stop at each page) or is read out of order.
#[inline(always)]
pub fn prefetch_row(rows: &[u8], row_bytes: usize, i: usize) {
    let at = i.saturating_mul(row_bytes);
    prefetch(rows.get(at..rows.len().min(at.saturating_add(row_bytes))).unwrap_or_default());
}

/// `dispatch!(f(args..))`: calls `f` (an `#[inline(always)]` function) compiled with AVX2 when
/// the CPU has it, else compiled for the baseline.
macro_rules! dispatch {
    ($f:ident($($arg:expr),* $(,)?)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2")]
            fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            if $crate::simd::has_avx2() {
                // SAFETY: the CPU has AVX2 (checked just above).
                unsafe { with_avx2(|| $f($($arg),*)) }
            } else {
                $f($($arg),*)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $f($($arg),*)
        }
    }};
}
pub(crate) use dispatch;

/// Tensors at least this large are placed with [`copy_streaming`]: they exceed what the caches
/// could keep for the next reader anyway, and smaller ones (tests, small presets) stay in cache.
pub const STREAMING_MIN_BYTES: usize = 4 << 20;

/// `dst.copy_from_slice(src)` with non-temporal stores where the CPU has AVX-512 F or AVX (the
/// ends through the cache): a destination line is written without first being read for
/// ownership, so a placement copy moves the bytes of a large `memcpy` (which glibc makes
/// non-temporal past its threshold) instead of half as many again. Ends with `sfence`, so the
/// stores are ordered before whatever this thread does next (a rayon join, a lock release).
/// Panics where the lengths differ, as `copy_from_slice` does.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked just above); the lengths agree.
            return unsafe { streaming::copy512(dst, src) };
        }
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the CPU has AVX (checked just above); the lengths agree.
            return unsafe { streaming::copy256(dst, src) };
        }
    }
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
mod streaming {
    use std::arch::x86_64::*;

    /// Copies `src` to `dst` with `store` (non-temporal) on the whole `4 * WIDTH`-byte steps
    /// between `dst`'s first `WIDTH`-byte boundary and its end, `copy_from_slice` on the ends,
    /// then `sfence`. `load` and `store` move one vector of `WIDTH` bytes (`store` to an
    /// address aligned to `WIDTH`).
    #[inline(always)]
    unsafe fn copy_with<V: Copy, const WIDTH: usize>(
        dst: &mut [u8],
        src: &[u8],
        load: impl Fn(*const u8) -> V,
        store: impl Fn(*mut u8, V),
    ) {
        let step = 4 * WIDTH;
        let head = dst.as_ptr().align_offset(WIDTH).min(dst.len());
        let body = (dst.len() - head) / step * step;
        dst[..head].copy_from_slice(&src[..head]);
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        for at in (0..body).step_by(step) {
            // SAFETY: `at + step <= body`: inside both slices past `head`; `d + at + WIDTH * j`
            // is aligned to `WIDTH` (`head`).
            unsafe {
                let v: [V; 4] = std::array::from_fn(|j| load(s.add(at + WIDTH * j)));
                for (j, v) in v.into_iter().enumerate() {
                    store(d.add(at + WIDTH * j), v);
                }
            }
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
        // SAFETY: SSE is baseline on x86-64.
        unsafe { _mm_sfence() };
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn copy512(dst: &mut [u8], src: &[u8]) {
        // SAFETY: the loads and stores are those `copy_with` bounds and aligns.
        unsafe {
            copy_with::<_, 64>(dst, src, |p| _mm512_loadu_si512(p.cast()), |p, v| _mm512_stream_si512(p.cast(), v));
        }
    }

    #[target_feature(enable = "avx")]
    pub unsafe fn copy256(dst: &mut [u8], src: &[u8]) {
        // SAFETY: as in `copy512`.
        unsafe {
            copy_with::<_, 32>(dst, src, |p| _mm256_loadu_si256(p.cast()), |p, v| _mm256_stream_si256(p.cast(), v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every offset and length around the vector steps, both ends unaligned: the bytes of
    /// `copy_from_slice`, and nothing written past the destination.
    #[test]
    fn streaming_copy_is_a_copy() {
        let src = crate::testdata::splitmix_bytes(4096, 3);
        for offset in 0..70 {
            for len in (0..600).chain([1023, 1024, 1025, 4096 - 70]) {
                let mut dst = vec![0xA5u8; 4096 + 64];
                copy_streaming(&mut dst[offset..offset + len], &src[..len]);
                assert_eq!(&dst[offset..offset + len], &src[..len], "offset {offset}, len {len}");
                assert!(dst[..offset].iter().chain(&dst[offset + len..]).all(|&b| b == 0xA5), "offset {offset}, len {len}");
            }
        }
    }
}
