//! CUDA availability (behind the `cuda` feature). cudarc is built with `dynamic-loading`, so
//! the workspace compiles without CUDA; cudarc panics on first use when a library is missing,
//! so every entry point checks the libraries here first and turns absence into an error.
//!
//! [`CudaBackend`] implements [`crate::Backend`] on one GPU: buffers live in device memory,
//! uploads go through pinned staging memory, and every layout step runs as a CUDA C kernel
//! (`kernels.cu`, compiled at run time with NVRTC, once per backend). Digests (streamed through
//! pinned memory) and host views are computed on device-to-host copies with the CPU digest
//! code, so they are the CPU definition.

mod backend;
pub mod bench;
pub mod nccl;

pub use backend::{CudaBackend, DeviceBuffer, KERNELS_CU};

use crate::KernelError;

/// Whether this build has the CUDA backend (`cuda` feature; `cuda_dummy.rs` says false).
pub const BUILT_IN: bool = true;

pub use crate::cuda_libraries::CudaLibraries;

impl CudaLibraries {
    /// Probes the shared libraries without calling into them.
    pub fn probe() -> Self {
        // SAFETY: `is_culib_present` only tries to dlopen the library; it calls no CUDA API.
        unsafe {
            Self {
                driver: cudarc::driver::sys::is_culib_present(),
                nvrtc: cudarc::nvrtc::sys::is_culib_present(),
                nccl: cudarc::nccl::sys::is_culib_present(),
            }
        }
    }

    /// An error naming every missing library, or `Ok` when all are present.
    pub fn require_all(self) -> Result<(), KernelError> {
        let missing: Vec<&str> = [("libcuda (driver)", self.driver), ("libnvrtc", self.nvrtc), ("libnccl", self.nccl)]
            .into_iter()
            .filter(|(_, present)| !present)
            .map(|(name, _)| name)
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(KernelError::Device(format!("CUDA is not usable on this machine: cannot load {}", missing.join(", "))))
        }
    }
}
