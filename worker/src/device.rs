//! The device a served worker runs on, chosen at start-up: the CPU backend, or (in builds with
//! the `cuda` feature) one GPU. [`AnyBackend`] is a [`Backend`] that forwards to either, so the
//! server keeps one code path; [`DeviceCollectives`] holds the NCCL communicator of a GPU
//! worker's TP group.
//!
//! A launched worker learns its device from the environment the launcher gives it:
//! `ORCHESTRATOR_DEVICE=cuda` (default `cpu`), and `CUDA_VISIBLE_DEVICES` naming its one GPU
//! (the worker opens device 0 of what it sees).

use std::borrow::Cow;
use std::time::Duration;

use orchestrator_kernels::cuda::{self, CudaBackend, DeviceBuffer};
use orchestrator_kernels::gemm::MxMatrix;
use orchestrator_kernels::permutation::{BlockOrder, Permutation};
use orchestrator_kernels::{Backend, BackendWeight, CpuBackend, Digest, KernelError, ScaleRule};

use crate::collective::CollectiveError;

/// The environment variable that selects a served worker's device (`cpu` or `cuda`).
pub const DEVICE_ENV: &str = "ORCHESTRATOR_DEVICE";

/// A GPU worker started by an engine that runs one task per GPU on a node (Slurm without
/// `--gpus-per-task`): keeps only the node's GPU number `local_index` visible (of the
/// `CUDA_VISIBLE_DEVICES` list, or of every GPU), so the worker opens its own GPU as device 0.
/// Does nothing on the CPU, without a local index, or when exactly one GPU is visible already.
/// Call it before any thread starts (it sets an environment variable).
pub fn narrow_to_local_gpu(local_index: Option<u32>) {
    let (Some(i), Ok("cuda")) = (local_index, std::env::var(DEVICE_ENV).as_deref()) else { return };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let chosen = match visible.as_deref().map(|v| v.split(',').map(str::trim).filter(|s| !s.is_empty()).collect::<Vec<_>>()) {
        Some(list) if list.len() <= 1 => return,
        Some(list) => match list.get(i as usize) {
            Some(gpu) => gpu.to_string(),
            None => return,
        },
        None => i.to_string(),
    };
    // SAFETY: called from `main`'s thread before the runtime or any other thread exists.
    unsafe { std::env::set_var("CUDA_VISIBLE_DEVICES", chosen) };
}

/// The CPU backend or one GPU (a variant that cannot be built without the `cuda` feature: the
/// kernels crate's dummy `cuda` module).
pub enum AnyBackend {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

/// A buffer of an [`AnyBackend`].
pub enum AnyBuffer {
    Host(Vec<u8>),
    Device(DeviceBuffer),
}

impl AnyBackend {
    /// The device `name` names (`cpu` or `cuda`): a clear error when CUDA is not built in or not
    /// usable here.
    pub fn open(name: &str) -> Result<Self, KernelError> {
        match name {
            "" | "cpu" => Ok(AnyBackend::Cpu(CpuBackend)),
            "cuda" if !cuda::BUILT_IN => Err(KernelError::Device("device cuda: this binary was built without the `cuda` feature".into())),
            "cuda" => Ok(AnyBackend::Cuda(Box::new(CudaBackend::new(0)?))),
            other => Err(KernelError::Device(format!("unknown device `{other}` (expected cpu or cuda)"))),
        }
    }

    /// The device [`DEVICE_ENV`] names (CPU when unset).
    pub fn from_env() -> Result<Self, KernelError> {
        Self::open(&std::env::var(DEVICE_ENV).unwrap_or_default())
    }

    /// True on a GPU.
    pub fn is_cuda(&self) -> bool {
        !matches!(self, AnyBackend::Cpu(_))
    }

    /// A new NCCL unique id for a TP group whose rank 0 runs here (GPU workers only; CPU
    /// workers use the TCP ring and return an empty id).
    pub fn nccl_unique_id(&self) -> Result<Vec<u8>, CollectiveError> {
        match self {
            AnyBackend::Cpu(_) => Ok(Vec::new()),
            AnyBackend::Cuda(_) => crate::nccl::NcclCollective::unique_id(),
        }
    }

    /// The TP all-reduce of `y` over NCCL in group `group` (joined on first use with the id rank
    /// 0 created). An error on a CPU worker.
    #[allow(clippy::too_many_arguments)]
    pub fn nccl_all_reduce(
        &self,
        collectives: &mut DeviceCollectives,
        group: u64,
        id: &[u8],
        rank: usize,
        world: usize,
        timeout: Duration,
        y: &mut [f32],
    ) -> Result<(), CollectiveError> {
        match self {
            AnyBackend::Cpu(_) => Err(CollectiveError::InvalidGroup { reason: "NCCL was requested from a CPU worker".into() }),
            AnyBackend::Cuda(b) => {
                use crate::collective::Collective;
                if collectives.nccl.as_ref().is_none_or(|(g, _)| *g != group) {
                    collectives.nccl = None;
                    let joined = crate::nccl::NcclCollective::join(b, id, rank, world, timeout)?;
                    collectives.nccl = Some((group, joined));
                }
                let (_, c) = collectives.nccl.as_mut().expect("joined above");
                c.all_reduce_sum(y)
            }
        }
    }
}

/// The device collectives of one worker (an NCCL communicator per TP group, on GPU workers).
#[derive(Default)]
pub struct DeviceCollectives {
    nccl: Option<(u64, crate::nccl::NcclCollective)>,
}

fn mismatch() -> KernelError {
    KernelError::Device("a buffer of another device was passed to this backend".into())
}

macro_rules! host {
    ($b:expr) => {
        match $b {
            AnyBuffer::Host(v) => v,
            _ => return Err(mismatch()),
        }
    };
}

macro_rules! device {
    ($b:expr) => {
        match $b {
            AnyBuffer::Device(d) => d,
            _ => return Err(mismatch()),
        }
    };
}

/// Forwards one operation: `$cpu` on the CPU with host buffers, `$cuda` on the GPU with device
/// buffers (the closures' arguments are the backend and the unwrapped buffers).
macro_rules! forward {
    ($self:expr, |$b:ident| $cpu:expr, |$g:ident| $cuda:expr) => {
        match $self {
            AnyBackend::Cpu($b) => $cpu,
            AnyBackend::Cuda($g) => $cuda,
        }
    };
}

impl Backend for AnyBackend {
    type Buffer = AnyBuffer;

    fn name(&self) -> String {
        forward!(self, |b| b.name(), |g| g.name())
    }
    // Without the `cuda` feature the device buffer is uninhabited, and wrapping one unreachable.
    #[allow(unreachable_code)]
    fn empty(&self) -> AnyBuffer {
        forward!(self, |b| AnyBuffer::Host(b.empty()), |g| AnyBuffer::Device(g.empty()))
    }
    fn len(&self, buf: &AnyBuffer) -> usize {
        match buf {
            AnyBuffer::Host(v) => v.len(),
            AnyBuffer::Device(d) => match self {
                AnyBackend::Cuda(g) => g.len(d),
                AnyBackend::Cpu(_) => 0,
            },
        }
    }
    fn capacity(&self, buf: &AnyBuffer) -> usize {
        match buf {
            AnyBuffer::Host(v) => v.capacity(),
            AnyBuffer::Device(d) => match self {
                AnyBackend::Cuda(g) => g.capacity(d),
                AnyBackend::Cpu(_) => 0,
            },
        }
    }
    fn allocation_id(&self, buf: &AnyBuffer) -> usize {
        match buf {
            AnyBuffer::Host(v) => v.as_ptr() as usize,
            AnyBuffer::Device(d) => match self {
                AnyBackend::Cuda(g) => g.allocation_id(d),
                AnyBackend::Cpu(_) => 0,
            },
        }
    }
    fn upload(&self, host: &[u8], dst: &mut AnyBuffer) -> Result<(), KernelError> {
        forward!(self, |b| b.upload(host, host!(dst)), |g| g.upload(host, device!(dst)))
    }
    fn upload_staged(&self, host: &mut Vec<u8>, dst: &mut AnyBuffer) -> Result<(), KernelError> {
        forward!(self, |b| b.upload_staged(host, host!(dst)), |g| g.upload_staged(host, device!(dst)))
    }
    fn quantize_bf16_host(
        &self,
        bf16: &[u8],
        rows: usize,
        k: usize,
        rule: ScaleRule,
        order: BlockOrder<'_>,
        elements: &mut AnyBuffer,
        scales: &mut AnyBuffer,
    ) -> Result<Option<orchestrator_kernels::placement::Placed>, KernelError> {
        forward!(self, |b| b.quantize_bf16_host(bf16, rows, k, rule, order, host!(elements), host!(scales)), |g| g.quantize_bf16_host(
            bf16,
            rows,
            k,
            rule,
            order,
            device!(elements),
            device!(scales)
        ))
    }
    fn upload_gather_runs(
        &self,
        host: &[u8],
        row_bytes: usize,
        run_bytes: usize,
        perm: &Permutation,
        dst: &mut AnyBuffer,
    ) -> Result<(), KernelError> {
        forward!(self, |b| b.upload_gather_runs(host, row_bytes, run_bytes, perm, host!(dst)), |g| g.upload_gather_runs(
            host,
            row_bytes,
            run_bytes,
            perm,
            device!(dst)
        ))
    }
    fn upload_e4m3(
        &self,
        host: &[u8],
        rows: usize,
        k: usize,
        order: BlockOrder<'_>,
        dst: &mut AnyBuffer,
    ) -> Result<(Digest, Option<Digest>), KernelError> {
        forward!(self, |b| b.upload_e4m3(host, rows, k, order, host!(dst)), |g| g.upload_e4m3(host, rows, k, order, device!(dst)))
    }
    fn download(&self, src: &AnyBuffer, dst: &mut Vec<u8>) -> Result<(), KernelError> {
        forward!(self, |b| b.download(host!(src), dst), |g| g.download(device!(src), dst))
    }
    fn host_bytes<'a>(&self, buf: &'a AnyBuffer) -> Result<Cow<'a, [u8]>, KernelError> {
        forward!(self, |b| b.host_bytes(host!(buf)), |g| g.host_bytes(device!(buf)))
    }
    fn digest(&self, buf: &AnyBuffer) -> Result<Digest, KernelError> {
        forward!(self, |b| b.digest(host!(buf)), |g| g.digest(device!(buf)))
    }
    fn expand_block_scales(
        &self,
        block_scale: &AnyBuffer,
        rows: usize,
        k: usize,
        block: [usize; 2],
        dst: &mut AnyBuffer,
    ) -> Result<(), KernelError> {
        forward!(self, |b| b.expand_block_scales(host!(block_scale), rows, k, block, host!(dst)), |g| g.expand_block_scales(
            device!(block_scale),
            rows,
            k,
            block,
            device!(dst)
        ))
    }
    fn quantize_bf16_rows(
        &self,
        bf16: &AnyBuffer,
        rows: usize,
        k: usize,
        rule: ScaleRule,
        elements: &mut AnyBuffer,
        scales: &mut AnyBuffer,
    ) -> Result<(), KernelError> {
        forward!(self, |b| b.quantize_bf16_rows(host!(bf16), rows, k, rule, host!(elements), host!(scales)), |g| g.quantize_bf16_rows(
            device!(bf16),
            rows,
            k,
            rule,
            device!(elements),
            device!(scales)
        ))
    }
    fn gather_runs(
        &self,
        src: &AnyBuffer,
        row_bytes: usize,
        run_bytes: usize,
        perm: &Permutation,
        dst: &mut AnyBuffer,
    ) -> Result<(), KernelError> {
        forward!(self, |b| b.gather_runs(host!(src), row_bytes, run_bytes, perm, host!(dst)), |g| g.gather_runs(
            device!(src),
            row_bytes,
            run_bytes,
            perm,
            device!(dst)
        ))
    }
    fn digest_gathered_runs(&self, src: &AnyBuffer, row_bytes: usize, run_bytes: usize, perm: &Permutation) -> Result<Digest, KernelError> {
        forward!(self, |b| b.digest_gathered_runs(host!(src), row_bytes, run_bytes, perm), |g| g.digest_gathered_runs(
            device!(src),
            row_bytes,
            run_bytes,
            perm
        ))
    }
    fn swizzle_128x4(&self, src: &AnyBuffer, m: usize, c: usize, dst: &mut AnyBuffer) -> Result<(), KernelError> {
        forward!(self, |b| b.swizzle_128x4(host!(src), m, c, host!(dst)), |g| g.swizzle_128x4(device!(src), m, c, device!(dst)))
    }
    fn unswizzle_128x4(&self, src: &AnyBuffer, m: usize, c: usize, dst: &mut AnyBuffer) -> Result<(), KernelError> {
        forward!(self, |b| b.unswizzle_128x4(host!(src), m, c, host!(dst)), |g| g.unswizzle_128x4(device!(src), m, c, device!(dst)))
    }
    fn pack_ue8m0(&self, src: &AnyBuffer, groups: usize, rows: usize, c: usize, dst: &mut AnyBuffer) -> Result<(), KernelError> {
        forward!(self, |b| b.pack_ue8m0(host!(src), groups, rows, c, host!(dst)), |g| g.pack_ue8m0(
            device!(src),
            groups,
            rows,
            c,
            device!(dst)
        ))
    }
    fn unpack_ue8m0(&self, src: &AnyBuffer, groups: usize, rows: usize, c: usize, dst: &mut AnyBuffer) -> Result<(), KernelError> {
        forward!(self, |b| b.unpack_ue8m0(host!(src), groups, rows, c, host!(dst)), |g| g.unpack_ue8m0(
            device!(src),
            groups,
            rows,
            c,
            device!(dst)
        ))
    }
    fn mx_gemm(&self, a: &MxMatrix, w: &BackendWeight<'_, Self>) -> Result<Vec<f32>, KernelError> {
        let BackendWeight { elements, offset, n, k, scales, scales_layout } = *w;
        forward!(
            self,
            |b| b.mx_gemm(a, &BackendWeight { elements: host!(elements), offset, n, k, scales: host!(scales), scales_layout }),
            |g| g.mx_gemm(a, &BackendWeight { elements: device!(elements), offset, n, k, scales: device!(scales), scales_layout })
        )
    }
}
