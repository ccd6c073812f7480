//! NCCL for the probe's tensor-parallel all-reduce, with deadlines.
//!
//! Rank 0 of a TP group creates a unique id ([`unique_id`]); the coordinator relays its 128
//! bytes to every rank of the group; each rank joins with [`NcclComm::join`] on the thread
//! that owns its GPU. Nothing here waits without a deadline: joining runs
//! `ncclCommInitRank` on a helper thread and gives up after the timeout (a peer that never
//! joins), and every collective is polled (its completion event and `ncclCommGetAsyncError`)
//! until the deadline, after which the communicator is aborted (`ncclCommAbort`, which also
//! releases the kernels waiting on a dead peer) and stays unusable.
//!
//! The all-reduce is an all-gather followed by a sum in rank order on the host, so every rank
//! gets the bit-identical result the CPU collectives define (NCCL's own reduction order is not
//! specified).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;

use crate::KernelError;
use crate::cuda::{CudaBackend, CudaLibraries};

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// How often a pending collective is polled.
const POLL: Duration = Duration::from_micros(200);

fn nccl_error(what: &str, r: sys::ncclResult_t) -> KernelError {
    KernelError::Device(format!("NCCL {what}: {r:?}"))
}

fn check(what: &str, r: sys::ncclResult_t) -> Result<(), KernelError> {
    if r == sys::ncclResult_t::ncclSuccess { Ok(()) } else { Err(nccl_error(what, r)) }
}

/// Runs `f`, turning a panic inside cudarc (a library without a symbol it expects) into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, KernelError>) -> Result<T, KernelError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let msg = panic.downcast_ref::<String>().map(String::as_str).or_else(|| panic.downcast_ref::<&str>().copied()).unwrap_or("panic");
        Err(KernelError::Device(format!("NCCL {what}: {msg}")))
    })
}

/// A new NCCL unique id (rank 0 of a group creates it; every rank joins with it).
pub fn unique_id() -> Result<Vec<u8>, KernelError> {
    CudaLibraries::probe().require_all()?;
    guarded("unique id", || {
        let mut id = sys::ncclUniqueId { internal: [0; UNIQUE_ID_BYTES] };
        // SAFETY: writes the 128-byte id.
        check("ncclGetUniqueId", unsafe { sys::ncclGetUniqueId(&mut id) })?;
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    })
}

/// The raw communicator handle, sent from the helper thread that created it.
struct RawComm(sys::ncclComm_t);
// SAFETY: an NCCL communicator may be used from any thread, one at a time; it is only moved.
unsafe impl Send for RawComm {}

/// One rank's NCCL communicator, on the stream of its [`CudaBackend`].
pub struct NcclComm {
    comm: sys::ncclComm_t,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    /// Set once the communicator was aborted (a timeout or an asynchronous error).
    broken: Option<String>,
}

// SAFETY: see `RawComm`; the owner uses it from one thread at a time (`&mut self`).
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins the group `id` as `rank` of `world`, on `backend`'s GPU and stream. Fails when the
    /// id is malformed, NCCL refuses, or the group does not form within `timeout` (a peer that
    /// never joins): then the helper thread is left behind, blocked in NCCL, and the error says
    /// so.
    pub fn join(backend: &CudaBackend, id: &[u8], rank: usize, world: usize, timeout: Duration) -> Result<Self, KernelError> {
        CudaLibraries::probe().require_all()?;
        if id.len() != UNIQUE_ID_BYTES {
            return Err(KernelError::Device(format!("an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {}", id.len())));
        }
        if world == 0 || rank >= world || i32::try_from(world).is_err() {
            return Err(KernelError::Device(format!("NCCL rank {rank} of a group of {world}")));
        }
        let mut nccl_id = sys::ncclUniqueId { internal: [0; UNIQUE_ID_BYTES] };
        for (d, &s) in nccl_id.internal.iter_mut().zip(id) {
            *d = s as _;
        }
        let ctx = backend.context().clone();
        let (tx, rx) = mpsc::channel();
        let init_ctx = ctx.clone();
        std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let r = guarded("init", || {
                    init_ctx.bind_to_thread().map_err(|e| KernelError::Device(format!("CUDA bind: {e}")))?;
                    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `comm` receives the new communicator; the id is 128 bytes.
                    check("ncclCommInitRank", unsafe { sys::ncclCommInitRank(&mut comm, world as i32, nccl_id, rank as i32) })?;
                    Ok(RawComm(comm))
                });
                let _ = tx.send(r);
            })
            .map_err(|e| KernelError::Device(format!("cannot start the NCCL init thread: {e}")))?;
        let comm = match rx.recv_timeout(timeout) {
            Ok(r) => r?.0,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(KernelError::Device(format!(
                    "NCCL group of {world} ranks did not form within {timeout:?} (rank {rank} waited; a peer never joined)"
                )));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(KernelError::Device("the NCCL init thread died".into())),
        };
        Ok(Self { comm, ctx, stream: backend.stream().clone(), rank, world, broken: None })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Every rank's `data` (all the same length), concatenated in rank order: `[world * n]`.
    /// Waits at most `timeout`; on a timeout or an asynchronous NCCL error the communicator is
    /// aborted and every later call fails.
    pub fn all_gather_f32(&mut self, data: &[f32], timeout: Duration) -> Result<Vec<f32>, KernelError> {
        if let Some(reason) = &self.broken {
            return Err(KernelError::Device(format!("the NCCL communicator is unusable after an earlier failure: {reason}")));
        }
        let r = guarded("all-gather", || self.all_gather_inner(data, timeout));
        if let Err(e) = &r {
            self.abort(e.to_string());
        }
        r
    }

    fn all_gather_inner(&mut self, data: &[f32], timeout: Duration) -> Result<Vec<f32>, KernelError> {
        let deadline = Instant::now() + timeout;
        let cuda = |what: &'static str| move |e: cudarc::driver::DriverError| KernelError::Device(format!("CUDA {what}: {e}"));
        if data.is_empty() {
            return Ok(Vec::new());
        }
        self.ctx.bind_to_thread().map_err(cuda("bind"))?;
        let send = self.stream.clone_htod(data).map_err(cuda("upload"))?;
        let mut recv = self.stream.alloc_zeros::<f32>(data.len() * self.world).map_err(cuda("allocation"))?;
        {
            let (src, _s) = send.device_ptr(&self.stream);
            let (dst, _d) = recv.device_ptr_mut(&self.stream);
            // SAFETY: `send` holds n floats and `recv` world * n, both on this communicator's GPU
            // and stream.
            let r = unsafe {
                sys::ncclAllGather(
                    src as *const _,
                    dst as *mut _,
                    data.len(),
                    sys::ncclDataType_t::ncclFloat32,
                    self.comm,
                    self.stream.cu_stream() as _,
                )
            };
            check("ncclAllGather", r)?;
        }
        let done = self.ctx.new_event(None).map_err(cuda("event"))?;
        done.record(&self.stream).map_err(cuda("event"))?;
        loop {
            if done.try_is_complete().map_err(cuda("event query"))? {
                break;
            }
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: queries the communicator's asynchronous error state.
            check("ncclCommGetAsyncError", unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) })?;
            let failure = if state != sys::ncclResult_t::ncclSuccess && state != sys::ncclResult_t::ncclInProgress {
                Some(nccl_error("all-gather failed on a peer", state))
            } else if Instant::now() >= deadline {
                Some(KernelError::Device(format!(
                    "NCCL all-gather of rank {} of {} did not complete within {timeout:?} (a peer is dead or stalled)",
                    self.rank, self.world
                )))
            } else {
                None
            };
            if let Some(e) = failure {
                // Abort while the buffers still exist: it releases the kernel that waits on the
                // peer, so freeing them afterwards cannot block.
                self.abort(e.to_string());
                return Err(e);
            }
            std::thread::sleep(POLL);
        }
        let host = self.stream.clone_dtoh(&recv).map_err(cuda("download"))?;
        self.stream.synchronize().map_err(cuda("synchronize"))?;
        Ok(host)
    }

    /// Aborts the communicator (releasing kernels that wait on a dead peer) and marks it broken.
    fn abort(&mut self, reason: String) {
        if self.broken.is_none() && !self.comm.is_null() {
            // SAFETY: aborts this communicator once; it is never used again.
            let _ = catch_unwind(AssertUnwindSafe(|| unsafe { sys::ncclCommAbort(self.comm) }));
            self.comm = std::ptr::null_mut();
        }
        self.broken.get_or_insert(reason);
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // Abort rather than destroy: destroying waits for peers that may be gone.
            // SAFETY: the communicator is released once.
            let _ = catch_unwind(AssertUnwindSafe(|| unsafe { sys::ncclCommAbort(self.comm) }));
        }
    }
}
