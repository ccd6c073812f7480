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

/// `dst.copy_from_slice(src)` with non-temporal stores where the CPU has AVX-512 F or AVX (see
/// [`Copier::streaming`]), fenced before it returns. Panics where the lengths differ, as
/// `copy_from_slice` does.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    Copier::streaming().copy(dst, src);
}

/// Copies a pass makes, through the caches or past them, with the fence that non-temporal
/// stores need taken once, when the copier is dropped, instead of after every copy: an
/// `sfence` waits for every store in flight, and a pass that copies 2 KiB at a time between
/// its checks fenced after each one ran at half the speed (a checkpoint-order placement from
/// memory: 4.8 GB/s copying 4 KiB per fence, 7.3 GB/s unfenced, on the AVX2 VM).
pub struct Copier {
    how: How,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum How {
    Cached,
    #[cfg(target_arch = "x86_64")]
    Stream256,
    #[cfg(target_arch = "x86_64")]
    Stream512,
}

impl Copier {
    /// Plain copies (`copy_from_slice`): for a destination read again soon, or a fresh one (the
    /// kernel zeroes each fresh page on the first store, which leaves its lines in cache).
    pub fn cached() -> Self {
        Self { how: How::Cached }
    }

    /// Non-temporal stores where the CPU has AVX-512 F or AVX (the ends of each copy through the
    /// cache), plain copies elsewhere: a destination line is written without first being read
    /// for ownership, so a placement copy moves the bytes of a large `memcpy` (which glibc
    /// makes non-temporal past its threshold) instead of half as many again. The stores are
    /// ordered before whatever the thread does after the copier is dropped (a rayon join, a
    /// lock release).
    pub fn streaming() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Self { how: How::Stream512 };
            }
            if std::arch::is_x86_feature_detected!("avx") {
                return Self { how: How::Stream256 };
            }
        }
        Self::cached()
    }

    /// [`Self::streaming`] when `stream`, else [`Self::cached`].
    pub fn streaming_if(stream: bool) -> Self {
        if stream { Self::streaming() } else { Self::cached() }
    }

    /// `dst.copy_from_slice(src)`; panics where the lengths differ, as that does.
    pub fn copy(&mut self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "Copier::copy: lengths differ");
        match self.how {
            How::Cached => dst.copy_from_slice(src),
            // SAFETY: the CPU has AVX (`streaming`); the lengths agree.
            #[cfg(target_arch = "x86_64")]
            How::Stream256 => unsafe { streaming::copy256(dst, src) },
            // SAFETY: the CPU has AVX-512 F (`streaming`); the lengths agree.
            #[cfg(target_arch = "x86_64")]
            How::Stream512 => unsafe { streaming::copy512(dst, src) },
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if self.how != How::Cached {
            // SAFETY: SSE is baseline on x86-64.
            unsafe { std::arch::x86_64::_mm_sfence() };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod streaming {
    use std::arch::x86_64::*;

    /// Cache line bytes.
    const LINE: usize = 64;

    /// Copies `src` to `dst` with `store` (non-temporal) on the whole cache lines of `dst`,
    /// `copy_from_slice` on the ends (no fence: [`super::Copier`] takes it). So no line is
    /// written both ways, by one copy or by two that meet inside it: a line written in part
    /// through the cache and in part streamed is written to memory twice. A checkpoint-order
    /// placement from memory (copies of 2 KiB) into a destination 16 bytes off a line ran at
    /// 3.0-3.1 GB/s streamed from each copy's first 32-byte boundary, 5.0-5.1 through the
    /// cache, and 9.4-10.3 streamed by whole lines (10.7-11.5 into an aligned destination), on
    /// the AVX2 VM. `load` and `store` move one vector of `WIDTH` bytes, `N` to a line (`store`
    /// to an address aligned to `WIDTH`).
    #[inline(always)]
    unsafe fn copy_with<V: Copy, const WIDTH: usize, const N: usize>(
        dst: &mut [u8],
        src: &[u8],
        load: impl Fn(*const u8) -> V,
        store: impl Fn(*mut u8, V),
    ) {
        const { assert!(WIDTH * N == LINE) };
        let head = dst.as_ptr().align_offset(LINE).min(dst.len());
        let body = (dst.len() - head) / LINE * LINE;
        dst[..head].copy_from_slice(&src[..head]);
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        for at in (0..body).step_by(LINE) {
            // SAFETY: `at + LINE <= body`: inside both slices past `head`; `d + at + WIDTH * j`
            // is aligned to `WIDTH` (`head`).
            unsafe {
                let v: [V; N] = std::array::from_fn(|j| load(s.add(at + WIDTH * j)));
                for (j, v) in v.into_iter().enumerate() {
                    store(d.add(at + WIDTH * j), v);
                }
            }
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn copy512(dst: &mut [u8], src: &[u8]) {
        // SAFETY: the loads and stores are those `copy_with` bounds and aligns.
        unsafe {
            copy_with::<_, 64, 1>(dst, src, |p| _mm512_loadu_si512(p.cast()), |p, v| _mm512_stream_si512(p.cast(), v));
        }
    }

    #[target_feature(enable = "avx")]
    pub unsafe fn copy256(dst: &mut [u8], src: &[u8]) {
        // SAFETY: as in `copy512`.
        unsafe {
            copy_with::<_, 32, 2>(dst, src, |p| _mm256_loadu_si256(p.cast()), |p, v| _mm256_stream_si256(p.cast(), v));
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

    /// One copier of each kind, many copies of pieces that end anywhere: the bytes of one
    /// `copy_from_slice`.
    #[test]
    fn a_copier_copies_piece_by_piece() {
        let src = crate::testdata::splitmix_bytes(20_000, 5);
        for stream in [false, true] {
            let mut dst = vec![0u8; src.len()];
            let mut out = Copier::streaming_if(stream);
            let mut at = 0;
            for len in (0..200).cycle() {
                let end = src.len().min(at + len * 7 + 1);
                out.copy(&mut dst[at..end], &src[at..end]);
                at = end;
                if at == src.len() {
                    break;
                }
            }
            drop(out);
            assert!(dst == src, "streaming {stream}");
        }
    }
}
