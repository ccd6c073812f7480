//! Which CUDA libraries this process can load: one type for both `cuda` modules (the real one
//! probes the shared libraries; the one of a build without the `cuda` feature finds none), each
//! of which implements its `probe` and `require_all`.

/// Which CUDA libraries this process can load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaLibraries {
    pub driver: bool,
    pub nvrtc: bool,
    pub nccl: bool,
}
