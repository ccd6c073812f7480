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
