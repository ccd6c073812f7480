//! The `cuda` module of a build without the `cuda` feature: the same names as `cuda/` (as
//! candle's `dummy_cuda_backend` does), so that callers need no `cfg` of their own. Nothing here
//! can be constructed: [`CudaBackend::new`] and [`nccl::unique_id`] return an error, every type
//! that would hold a GPU resource is uninhabited, and [`BUILT_IN`] is false, so a caller can
//! refuse `--device cuda` with its own message before it tries.

use crate::KernelError;
use crate::backend::{Backend, BackendWeight};
use crate::digest::Digest;
use crate::gemm::MxMatrix;
use crate::mxfp8::ScaleRule;
use crate::permutation::Permutation;

/// Whether this build has the CUDA backend (`cuda` feature).
pub const BUILT_IN: bool = false;

fn not_built() -> KernelError {
    KernelError::Device("this binary was built without the `cuda` feature".into())
}

pub use crate::cuda_libraries::CudaLibraries;

/// In this build: none.
impl CudaLibraries {
    pub fn probe() -> Self {
        Self { driver: false, nvrtc: false, nccl: false }
    }

    pub fn require_all(self) -> Result<(), KernelError> {
        Err(not_built())
    }
}

/// A GPU: never constructed in this build.
pub enum CudaBackend {}

/// A device buffer: never constructed in this build.
pub enum DeviceBuffer {}

impl CudaBackend {
    pub fn new(_ordinal: usize) -> Result<Self, KernelError> {
        Err(not_built())
    }

    /// No GPU is usable from this build.
    pub fn device_count() -> usize {
        0
    }

    pub fn device_name(&self) -> String {
        match *self {}
    }
}

impl Backend for CudaBackend {
    type Buffer = DeviceBuffer;

    fn name(&self) -> String {
        match *self {}
    }
    fn empty(&self) -> DeviceBuffer {
        match *self {}
    }
    fn len(&self, _: &DeviceBuffer) -> usize {
        match *self {}
    }
    fn capacity(&self, _: &DeviceBuffer) -> usize {
        match *self {}
    }
    fn allocation_id(&self, _: &DeviceBuffer) -> usize {
        match *self {}
    }
    fn upload(&self, _: &[u8], _: &mut DeviceBuffer) -> Result<(), KernelError> {
        match *self {}
    }
    fn download(&self, _: &DeviceBuffer, _: &mut Vec<u8>) -> Result<(), KernelError> {
        match *self {}
    }
    fn digest(&self, _: &DeviceBuffer) -> Result<Digest, KernelError> {
        match *self {}
    }
    fn expand_block_scales(&self, _: &DeviceBuffer, _: usize, _: usize, _: [usize; 2], _: &mut DeviceBuffer) -> Result<(), KernelError> {
        match *self {}
    }
    fn quantize_bf16_rows(
        &self,
        _: &DeviceBuffer,
        _: usize,
        _: usize,
        _: ScaleRule,
        _: &mut DeviceBuffer,
        _: &mut DeviceBuffer,
    ) -> Result<(), KernelError> {
        match *self {}
    }
    fn gather_runs(&self, _: &DeviceBuffer, _: usize, _: usize, _: &Permutation, _: &mut DeviceBuffer) -> Result<(), KernelError> {
        match *self {}
    }
    fn swizzle_128x4(&self, _: &DeviceBuffer, _: usize, _: usize, _: &mut DeviceBuffer) -> Result<(), KernelError> {
        match *self {}
    }
    fn unswizzle_128x4(&self, _: &DeviceBuffer, _: usize, _: usize, _: &mut DeviceBuffer) -> Result<(), KernelError> {
        match *self {}
    }
    fn pack_ue8m0(&self, _: &DeviceBuffer, _: usize, _: usize, _: usize, _: &mut DeviceBuffer) -> Result<(), KernelError> {
        match *self {}
    }
    fn unpack_ue8m0(&self, _: &DeviceBuffer, _: usize, _: usize, _: usize, _: &mut DeviceBuffer) -> Result<(), KernelError> {
        match *self {}
    }
    fn mx_gemm(&self, _: &MxMatrix, _: &BackendWeight<'_, Self>) -> Result<Vec<f32>, KernelError> {
        match *self {}
    }
}

pub mod nccl {
    //! NCCL: unavailable in this build.

    use std::time::Duration;

    use super::{CudaBackend, not_built};
    use crate::KernelError;

    /// Bytes of an NCCL unique id.
    pub const UNIQUE_ID_BYTES: usize = 128;

    pub fn unique_id() -> Result<Vec<u8>, KernelError> {
        Err(not_built())
    }

    /// A communicator: never constructed in this build.
    pub enum NcclComm {}

    impl NcclComm {
        pub fn join(backend: &CudaBackend, _id: &[u8], _rank: usize, _world: usize, _timeout: Duration) -> Result<Self, KernelError> {
            match *backend {}
        }

        pub fn rank(&self) -> usize {
            match *self {}
        }

        pub fn world_size(&self) -> usize {
            match *self {}
        }

        pub fn all_gather_f32(&mut self, _data: &[f32], _timeout: Duration) -> Result<Vec<f32>, KernelError> {
            match *self {}
        }
    }
}

pub mod bench {
    //! The GPU benchmarks: unavailable in this build.

    use super::CudaBackend;
    use crate::KernelError;

    /// A measured figure: never constructed in this build.
    pub enum Figure {}

    pub fn run(backend: &CudaBackend, _iters: usize) -> Result<Vec<Figure>, KernelError> {
        match *backend {}
    }

    pub fn render(device: &str, figures: &[Figure]) -> String {
        match figures.first() {
            None => format!("GPU benchmarks on {device}\n"),
            Some(f) => match *f {},
        }
    }
}
