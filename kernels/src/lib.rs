//! The numeric heart of orchestrator: MXFP8 formats and quantization, the mega-attention
//! permutations, the kernel layouts of scales, digests, and the typed per-parameter load
//! pipeline, over a [`Backend`] seam (CPU here; CUDA behind the `cuda` feature).

pub mod attention;
pub mod backend;
pub mod bf16;
#[cfg(feature = "cuda")]
pub mod cuda;
/// Without the `cuda` feature, the same names with nothing behind them (the one `cfg`).
#[cfg(not(feature = "cuda"))]
#[path = "cuda_dummy.rs"]
pub mod cuda;
mod cuda_libraries;
pub mod digest;
pub mod e4m3;
pub mod e8m0;
pub mod forward;
pub mod gemm;
pub mod layout;
pub mod mxfp8;
pub mod params;
pub mod permutation;
pub mod placement;
pub mod simd;
#[doc(hidden)]
pub mod testdata;

pub use backend::{Backend, BackendWeight, BufferPool, CpuBackend, ScaleKind, resize_for_overwrite};
pub use digest::Digest;
pub use mxfp8::ScaleRule;

/// Errors of the numeric layer. Positions are relative to the tensor at hand; callers add the
/// tensor's name.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("non-finite value at row {row}, column {col}")]
    NonFinite { row: usize, col: usize },
    #[error("NaN scale byte 0xFF at scale row {row}, column {col}")]
    NanScale { row: usize, col: usize },
    #[error("layout check failed: {0}")]
    Layout(String),
    #[error("device error: {0}")]
    Device(String),
}
