//! The CUDA [`Backend`]: device buffers, pinned uploads, and the NVRTC-compiled layout kernels.
//!
//! Every operation checks its arguments exactly as the CPU function it mirrors (same errors,
//! same messages) before anything is launched, so bad input is an error, never a device fault
//! or a panic. All work of a backend runs in order on one CUDA stream; buffers are reused by
//! the loader's pools, and reuse is safe because the stream orders every read before the next
//! write.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileError, CompileOptions, compile_ptx_with_opts};

use crate::backend::{Backend, BackendWeight, ScaleKind};
use crate::digest::{Digest, DigestStream};
use crate::gemm::MxMatrix;
use crate::layout;
use crate::mxfp8::{self, ScaleRule};
use crate::permutation::{BlockOrder, Permutation};
use crate::{KernelError, cuda::CudaLibraries};

/// The CUDA C source of every kernel.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// Bytes per pinned staging slot.
const STAGING_BYTES: usize = 8 << 20;
/// Host threads that fill staging slots for one large upload (at most; one per
/// [`PART_BYTES`]): one thread copies pageable memory at about a sixth of what the DMA engine
/// takes from pinned memory (9.2 against 55.4 GB/s on an H200 host).
const MAX_UPLOAD_THREADS: usize = 8;
/// Bytes of an upload below which one thread fills the slots.
const PART_BYTES: usize = 16 << 20;
/// Pinned slots at most: two per filling thread, so each thread fills one while the DMA engine
/// copies its other.
const MAX_SLOTS: usize = 2 * MAX_UPLOAD_THREADS;
/// Threads per block of the elementwise kernels.
const THREADS: u32 = 256;
/// Outputs per block of the `mx_gemm_t*` kernels along N (`GEMM_ROWS` in kernels.cu): one warp,
/// so that even a small N (a 1024-row `wo_a` group) spreads over as many SMs as it has warps.
const GEMM_THREADS: u32 = 32;
/// The `mx_gemm_t*` kernels by tokens per thread (`TT` in kernels.cu).
const GEMM_TOKENS: [usize; 4] = [1, 2, 4, 8];

/// Tokens per thread for `t` tokens and `n` weight rows on a GPU of `sms` multiprocessors: the
/// most of [`GEMM_TOKENS`] (no more than `t` rounded up to a power of two) that still gives at
/// least two warps per multiprocessor, else 1. More tokens per thread decode each weight once for
/// more of them; fewer give more warps, and with one warp per scheduler or less the GPU mostly
/// waits. Each output's sum is sequential, so warps come only from rows and token groups. On an
/// H200 (132 SMs) this picked the fastest or within 7% of it for every dsv41-flash TP 4 shape at
/// T = 1 to 16.
fn gemm_tokens(t: usize, n: usize, sms: usize) -> usize {
    let warps = |tokens: usize| n.div_ceil(GEMM_THREADS as usize) * t.div_ceil(tokens);
    GEMM_TOKENS.iter().rev().copied().find(|&tt| tt <= t.next_power_of_two() && warps(tt) >= 2 * sms).unwrap_or(1)
}

/// A weight's scale layout as the `mx_gemm_t*` kernels take it, after checking the weight's
/// sizes against its buffers.
struct GemmArgs {
    /// 0 row-major, 1 F8_128x4 swizzled, 2 DeepGEMM packed UE8M0.
    mode: i32,
    group: u64,
    rows_per_group: u64,
}

impl GemmArgs {
    fn of(w: &BackendWeight<'_, CudaBackend>) -> Result<Self, KernelError> {
        let BackendWeight { elements, offset, n, k, scales, scales_layout } = *w;
        let c = k / mxfp8::BLOCK;
        if !k.is_multiple_of(mxfp8::BLOCK) || offset + n * k > elements.len || !offset.is_multiple_of(16) {
            return Err(KernelError::Shape(format!("device GEMM with a [{n}, {k}] weight at byte {offset} of {}", elements.len)));
        }
        let (mode, group, rows_per_group, need) = match scales_layout {
            ScaleKind::RowMajor => (0, 0, 0, n * c),
            ScaleKind::Swizzled128x4 => (1, 0, 0, layout::swizzled_len(n, c)),
            ScaleKind::PackedUe8m0 { group, rows_per_group } => {
                if rows_per_group != n || !c.is_multiple_of(4) {
                    return Err(KernelError::Shape(format!("packed scales of {rows_per_group} rows for a weight of {n} rows")));
                }
                (2, group, rows_per_group, (group + 1) * rows_per_group * c)
            }
        };
        if scales.len < need {
            return Err(KernelError::Shape(format!("device GEMM scales hold {} bytes, need {need}", scales.len)));
        }
        Ok(Self { mode, group: group as u64, rows_per_group: rows_per_group as u64 })
    }
}

/// A byte buffer in device memory: an allocation (reused while large enough) and the bytes in
/// use.
pub struct DeviceBuffer {
    mem: Option<CudaSlice<u8>>,
    len: usize,
}

impl DeviceBuffer {
    fn capacity(&self) -> usize {
        self.mem.as_ref().map_or(0, |m| m.len())
    }
}

/// Turns a driver error into the numeric layer's device error.
fn dev(what: &str) -> impl FnOnce(DriverError) -> KernelError + '_ {
    move |e| KernelError::Device(format!("CUDA {what}: {e}"))
}

/// The kernels of one context.
struct Kernels {
    gather_runs: CudaFunction,
    gather_runs_v16: CudaFunction,
    expand_block_scales: CudaFunction,
    quantize_bf16: CudaFunction,
    swizzle_128x4: CudaFunction,
    unswizzle_128x4: CudaFunction,
    pack_ue8m0: CudaFunction,
    unpack_ue8m0: CudaFunction,
    /// `mx_gemm_t{TT}` for each TT of [`GEMM_TOKENS`], in that order.
    mx_gemm: [CudaFunction; 4],
}

/// Page-locked host memory for one staging slot, with the event of the last copy from it.
struct PinnedSlot {
    ptr: *mut u8,
    len: usize,
    done: CudaEvent,
}

// SAFETY: the pointer is page-locked host memory owned by this slot; only the thread that took
// the slot out of the pool touches it.
unsafe impl Send for PinnedSlot {}

impl Drop for PinnedSlot {
    fn drop(&mut self) {
        // Wait for the last copy out of this slot before freeing it.
        let _ = self.done.synchronize();
        // SAFETY: `ptr` came from `malloc_host` and is freed once.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

/// The pinned slots not in use, oldest returned first (its copy most likely done), and how
/// many exist.
struct Staging {
    free: VecDeque<PinnedSlot>,
    allocated: usize,
}

/// One GPU as a [`Backend`].
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// Every kernel, download and allocation.
    stream: Arc<CudaStream>,
    /// Host-to-device copies, so that they overlap the kernels of other tensors. cudarc's
    /// per-buffer event tracking (on whenever a context has its own streams) orders each copy
    /// after the earlier uses of its destination and each kernel after the copy of its inputs.
    copy_stream: Arc<CudaStream>,
    /// Device-to-host copies of the digests (the other copy engine), ordered after the writes of
    /// the buffer they read in the same way.
    d2h_stream: Arc<CudaStream>,
    kernels: Kernels,
    staging: Mutex<Staging>,
    /// Signalled when a slot goes back to `staging`.
    slot_returned: Condvar,
    ordinal: usize,
    /// Streaming multiprocessors (how many warps the GEMM launches aim for).
    multiprocessors: usize,
}

impl CudaBackend {
    /// Opens GPU `ordinal` (after checking that the CUDA libraries are loadable), compiles the
    /// kernels with NVRTC and allocates the pinned staging memory. Every failure, including a
    /// panic inside cudarc (a driver without a symbol it expects), is a [`KernelError::Device`].
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        CudaLibraries::probe().require_all()?;
        match catch_unwind(AssertUnwindSafe(|| Self::open(ordinal))) {
            Ok(r) => r,
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown panic");
                Err(KernelError::Device(format!("CUDA initialization of device {ordinal} failed: {msg}")))
            }
        }
    }

    /// How many GPUs this process sees: 0 when the CUDA libraries are missing or the driver has
    /// no device (never a panic). GPU tests skip when this is 0.
    pub fn device_count() -> usize {
        if CudaLibraries::probe().require_all().is_err() {
            return 0;
        }
        catch_unwind(|| CudaContext::device_count().ok()).ok().flatten().map_or(0, |n| n.max(0) as usize)
    }

    fn open(ordinal: usize) -> Result<Self, KernelError> {
        let count = CudaContext::device_count().map_err(dev("device count"))?;
        if ordinal >= count.max(0) as usize {
            return Err(KernelError::Device(format!("CUDA device {ordinal} does not exist ({count} visible)")));
        }
        let ctx = CudaContext::new(ordinal).map_err(dev("context"))?;
        let stream = ctx.new_stream().map_err(dev("stream"))?;
        let copy_stream = ctx.new_stream().map_err(dev("stream"))?;
        let d2h_stream = ctx.new_stream().map_err(dev("stream"))?;
        let (major, minor) = ctx.compute_capability().map_err(dev("compute capability"))?;
        let multiprocessors = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(dev("multiprocessor count"))?
            .max(1) as usize;
        let kernels = compile(&ctx, major, minor)?;
        let free = [new_slot(&ctx)?, new_slot(&ctx)?].into();
        Ok(Self {
            ctx,
            stream,
            copy_stream,
            d2h_stream,
            kernels,
            staging: Mutex::new(Staging { free, allocated: 2 }),
            slot_returned: Condvar::new(),
            ordinal,
            multiprocessors,
        })
    }

    /// The device's name (for reports and benchmarks).
    pub fn device_name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }

    /// Waits for all work queued on the backend's streams (copies and kernels).
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.copy_stream.synchronize().map_err(dev("synchronize"))?;
        self.d2h_stream.synchronize().map_err(dev("synchronize"))?;
        self.stream.synchronize().map_err(dev("synchronize"))
    }

    /// The backend's stream (NCCL runs its collectives on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The backend's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes `buf` hold `bytes` bytes, reusing its allocation when large enough. The contents
    /// are unspecified.
    fn ensure(&self, buf: &mut DeviceBuffer, bytes: usize) -> Result<(), KernelError> {
        if buf.capacity() < bytes || buf.mem.is_none() {
            // SAFETY: every caller writes the bytes it then reads.
            let mem = unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(dev("allocation"))?;
            // The allocation is ordered on the compute stream; the copy stream may write it only
            // after that point.
            let allocated = self.stream.record_event(None).map_err(dev("event"))?;
            self.copy_stream.wait(&allocated).map_err(dev("stream wait"))?;
            buf.mem = Some(mem);
        }
        buf.len = bytes;
        Ok(())
    }

    /// A device buffer holding `host` (small uploads: permutations, activations).
    fn upload_new<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, KernelError> {
        if host.is_empty() {
            // SAFETY: a one-element allocation nothing reads.
            return unsafe { self.stream.alloc::<T>(1) }.map_err(dev("allocation"));
        }
        self.stream.clone_htod(host).map_err(dev("upload"))
    }

    /// Copies `host` to `dst` through the pinned staging slots on the copy stream: the host fills
    /// one slot while the DMA engine copies another, and the copies overlap the kernels of other
    /// tensors queued on the compute stream. A large upload is split into parts that as many
    /// threads fill at once (one thread's copy into pinned memory is far slower than the DMA
    /// engine); concurrent uploads (the loader's layers) each take their own slots.
    fn h2d(&self, host: &[u8], dst: &mut CudaSlice<u8>) -> Result<(), KernelError> {
        if host.len() > dst.len() {
            return Err(KernelError::Device(format!("upload of {} bytes into {} bytes", host.len(), dst.len())));
        }
        // Waits for earlier uses of `dst`; records the write when `_written` drops, after every
        // part's copies are queued.
        let (base, _written) = dst.device_ptr_mut(&self.copy_stream);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let parts = host.len().div_ceil(PART_BYTES).clamp(1, threads.clamp(1, MAX_UPLOAD_THREADS));
        if parts == 1 {
            return self.h2d_part(host, base);
        }
        // Whole slots per part, so that every copy but the last is a full slot.
        let part_bytes = host.len().div_ceil(parts).div_ceil(STAGING_BYTES) * STAGING_BYTES;
        std::thread::scope(|scope| {
            let handles: Vec<_> = host
                .chunks(part_bytes)
                .enumerate()
                .map(|(i, part)| scope.spawn(move || self.h2d_part(part, base + (i * part_bytes) as u64)))
                .collect();
            handles.into_iter().try_for_each(|h| h.join().unwrap_or_else(|_| Err(KernelError::Device("an upload thread panicked".into()))))
        })
    }

    /// Copies `host` to device address `dst` (which holds at least `host.len()` bytes) through
    /// staging slots, on the calling thread.
    fn h2d_part(&self, host: &[u8], dst: u64) -> Result<(), KernelError> {
        self.ctx.bind_to_thread().map_err(dev("bind"))?;
        for (i, chunk) in host.chunks(STAGING_BYTES).enumerate() {
            let slot = self.take_slot()?;
            let copied = (|| {
                // The previous copy out of this slot must finish before it is overwritten.
                slot.done.synchronize().map_err(dev("staging event"))?;
                // SAFETY: the slot holds `slot.len >= chunk.len()` bytes of page-locked memory
                // that no copy is reading (synchronized above) and no other thread holds.
                let pinned = unsafe { std::slice::from_raw_parts_mut(slot.ptr, slot.len) };
                pinned[..chunk.len()].copy_from_slice(chunk);
                // SAFETY: `dst + offset .. + chunk.len()` lies inside the destination (checked by
                // the caller); the pinned bytes stay untouched until `done` completes.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        dst + (i * STAGING_BYTES) as u64,
                        &pinned[..chunk.len()],
                        self.copy_stream.cu_stream(),
                    )
                }
                .map_err(dev("host-to-device copy"))?;
                slot.done.record(&self.copy_stream).map_err(dev("staging event"))
            })();
            self.return_slot(slot)?;
            copied?;
        }
        Ok(())
    }

    /// A staging slot: the free one returned longest ago, else a new one while fewer than
    /// [`MAX_SLOTS`] exist, else the next one returned.
    fn take_slot(&self) -> Result<PinnedSlot, KernelError> {
        Ok(self.take_slots(1)?.pop().expect("one slot"))
    }

    /// `n` staging slots at once (the oldest returned first, then new ones while fewer than
    /// [`MAX_SLOTS`] exist), waiting until that many can be had. A caller that holds slots never
    /// waits for more, so slots cannot deadlock.
    fn take_slots(&self, n: usize) -> Result<Vec<PinnedSlot>, KernelError> {
        debug_assert!(n <= MAX_SLOTS);
        let mut staging = self.staging.lock().map_err(poisoned)?;
        while staging.free.len() + (MAX_SLOTS - staging.allocated) < n {
            staging = self.slot_returned.wait(staging).map_err(poisoned)?;
        }
        let pooled = n.min(staging.free.len());
        let mut slots: Vec<PinnedSlot> = staging.free.drain(..pooled).collect();
        let fresh = n - slots.len();
        staging.allocated += fresh;
        drop(staging);
        for made in 0..fresh {
            match new_slot(&self.ctx) {
                Ok(slot) => slots.push(slot),
                Err(e) => {
                    // The slots not made are not counted; those taken go back.
                    self.staging.lock().map_err(poisoned)?.allocated -= fresh - made;
                    for slot in slots {
                        self.return_slot(slot)?;
                    }
                    return Err(e);
                }
            }
        }
        Ok(slots)
    }

    fn return_slot(&self, slot: PinnedSlot) -> Result<(), KernelError> {
        self.staging.lock().map_err(poisoned)?.free.push_back(slot);
        // Every waiter: one that needs two slots may not be able to go on with one.
        self.slot_returned.notify_all();
        Ok(())
    }

    /// The digest of `buf`, its bytes streamed through two pinned slots on the download stream:
    /// the DMA engine copies the next chunk while the host hashes the last. The same digest as
    /// hashing a download (the same bytes in the same order, [`DigestStream`]), without a
    /// pageable copy of the whole buffer first.
    fn digest_streamed(&self, buf: &DeviceBuffer) -> Result<Digest, KernelError> {
        let mut hash = DigestStream::new();
        if buf.len == 0 {
            return Ok(hash.finish());
        }
        let src = self.mem(buf, "digest")?;
        self.ctx.bind_to_thread().map_err(dev("bind"))?;
        let slots = self.take_slots(2)?;
        let n = buf.len;
        let chunk_len = |i: usize| STAGING_BYTES.min(n - i * STAGING_BYTES);
        let hashed = (|| {
            // Earlier copies out of these slots (uploads) must finish before they are written.
            for slot in &slots {
                slot.done.synchronize().map_err(dev("staging event"))?;
            }
            // Waits for the writes of `buf`; records this read when `_read` drops, after the
            // last copy is queued.
            let (base, _read) = src.device_ptr(&self.d2h_stream);
            let copy = |i: usize| -> Result<(), KernelError> {
                let slot = &slots[i % 2];
                // SAFETY: `chunk_len(i) <= slot.len` bytes of page-locked memory that the host is
                // not reading (its chunk was hashed) and no copy is writing (synchronized).
                let pinned = unsafe { std::slice::from_raw_parts_mut(slot.ptr, chunk_len(i)) };
                // SAFETY: `base + i * STAGING_BYTES .. + chunk_len(i)` lies inside `buf`.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(pinned, base + (i * STAGING_BYTES) as u64, self.d2h_stream.cu_stream())
                }
                .map_err(dev("device-to-host copy"))?;
                slot.done.record(&self.d2h_stream).map_err(dev("staging event"))
            };
            let chunks = n.div_ceil(STAGING_BYTES);
            copy(0)?;
            for i in 0..chunks {
                if i + 1 < chunks {
                    copy(i + 1)?;
                }
                let slot = &slots[i % 2];
                slot.done.synchronize().map_err(dev("staging event"))?;
                // SAFETY: chunk i, copied into the slot (synchronized above).
                hash.update(unsafe { std::slice::from_raw_parts(slot.ptr, chunk_len(i)) });
            }
            Ok(hash.finish())
        })();
        for slot in slots {
            self.return_slot(slot)?;
        }
        hashed
    }

    fn mem<'a>(&self, buf: &'a DeviceBuffer, what: &str) -> Result<&'a CudaSlice<u8>, KernelError> {
        buf.mem.as_ref().ok_or_else(|| KernelError::Device(format!("{what}: the buffer holds no device memory")))
    }

    fn grid(&self, n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_535 * 8) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
    }

    /// Reads back a device flag/counter of type T after the stream drains.
    fn read_back<T: cudarc::driver::DeviceRepr + Default + Clone>(&self, v: &CudaSlice<T>) -> Result<T, KernelError> {
        let host = self.stream.clone_dtoh(v).map_err(dev("device-to-host copy"))?;
        self.synchronize()?;
        Ok(host.first().cloned().unwrap_or_default())
    }

    /// `mode` 0/1/2 as in `quantize_bf16` of kernels.cu.
    #[allow(clippy::too_many_arguments)]
    fn quantize_on_device(
        &self,
        bf16: &CudaSlice<u8>,
        rows: usize,
        k: usize,
        rule: ScaleRule,
        order: BlockOrder<'_>,
        elements: &mut DeviceBuffer,
        scales: &mut DeviceBuffer,
    ) -> Result<(), KernelError> {
        let blocks = k / mxfp8::BLOCK;
        let (mode, perm): (i32, &[u32]) = match order {
            BlockOrder::Identity => (0, &[]),
            BlockOrder::Rows(p) => (1, p.as_slice()),
            BlockOrder::Chunks(p) => (2, p.as_slice()),
        };
        self.ensure(elements, rows * k)?;
        self.ensure(scales, rows * blocks)?;
        if rows * blocks == 0 {
            return Ok(());
        }
        let perm_d = self.upload_new(perm)?;
        let err = self.upload_new(&[u64::MAX])?;
        let rule_i: i32 = match rule {
            ScaleRule::Rceil => 0,
            ScaleRule::Floor => 1,
        };
        let (rows_u, k_u) = (rows as u64, k as u64);
        let e = elements.mem.as_mut().expect("ensured");
        let s = scales.mem.as_mut().expect("ensured");
        let mut launch = self.stream.launch_builder(&self.kernels.quantize_bf16);
        launch.arg(bf16).arg(e).arg(s).arg(&rows_u).arg(&k_u).arg(&rule_i).arg(&mode).arg(&perm_d).arg(&err);
        // SAFETY: the argument list matches `quantize_bf16` in kernels.cu; every buffer holds the
        // bytes the kernel indexes (checked by the caller and `ensure`).
        unsafe { launch.launch(self.grid(rows * blocks)) }.map_err(dev("quantize_bf16 launch"))?;
        let at = self.read_back(&err)?;
        if at != u64::MAX {
            // The source row and the destination column (see `quantize_bf16` in kernels.cu):
            // map the column back to the source (checkpoint-order) column.
            let (src_row, col) = ((at / k_u) as usize, (at % k_u) as usize);
            let src_col = match order {
                BlockOrder::Identity | BlockOrder::Rows(_) => col,
                BlockOrder::Chunks(p) => p.as_slice()[col / mxfp8::BLOCK] as usize * mxfp8::BLOCK + col % mxfp8::BLOCK,
            };
            return Err(KernelError::NonFinite { row: src_row, col: src_col });
        }
        Ok(())
    }

    /// `out[t, n] = sum_k a[t, k] * w[n, k]` on the device, bit-identical to [`crate::gemm::gemm`]
    /// (see kernels.cu). Returns `[T, n]` row-major on the host.
    fn device_gemm(&self, a: &MxMatrix, w: &BackendWeight<'_, Self>) -> Result<Vec<f32>, KernelError> {
        if a.k != w.k {
            return Err(KernelError::Shape(format!("device GEMM of [{}, {}] activations with a [{}, {}] weight", a.rows, a.k, w.n, w.k)));
        }
        GemmArgs::of(w)?;
        if a.rows == 0 || w.n == 0 {
            return Ok(vec![0f32; a.rows * w.n]);
        }
        let a_d = self.upload_new(&a.dequantize())?;
        // SAFETY: fully written by the kernel before it is read.
        let mut out = unsafe { self.stream.alloc::<f32>(a.rows * w.n) }.map_err(dev("allocation"))?;
        self.launch_gemm(&a_d, a.rows, w, &mut out)?;
        let host = self.stream.clone_dtoh(&out).map_err(dev("device-to-host copy"))?;
        self.synchronize()?;
        Ok(host)
    }

    /// Queues the GEMM of `t` dequantized activation rows already on the device into `out`
    /// (`[t, n]` f32) on the compute stream; checks every size first.
    pub(crate) fn launch_gemm(
        &self,
        a: &CudaSlice<f32>,
        t: usize,
        w: &BackendWeight<'_, Self>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let GemmArgs { mode, group, rows_per_group } = GemmArgs::of(w)?;
        let BackendWeight { elements, offset, n, k, scales, .. } = *w;
        if a.len() < t * k || out.len() < t * n {
            return Err(KernelError::Shape(format!(
                "device GEMM of [{t}, {k}] activations ({} floats on the device) into {} floats for a [{n}, {k}] weight",
                a.len(),
                out.len()
            )));
        }
        if t == 0 || n == 0 {
            return Ok(());
        }
        let tokens = gemm_tokens(t, n, self.multiprocessors);
        let Some(groups) = u32::try_from(t.div_ceil(tokens)).ok().filter(|&g| g <= 65_535) else {
            return Err(KernelError::Shape(format!("device GEMM of {t} tokens: at most {} in one launch", 65_535 * tokens)));
        };
        let kernel = &self.kernels.mx_gemm[GEMM_TOKENS.iter().position(|&x| x == tokens).expect("gemm_tokens picks one of them")];
        let w_mem = self.mem(elements, "GEMM weight")?;
        let w_view = w_mem.try_slice(offset..).ok_or_else(|| KernelError::Shape(format!("weight offset {offset} out of range")))?;
        let s = self.mem(scales, "GEMM scales")?;
        let (t_u, n_u, k_u) = (t as u64, n as u64, k as u64);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(GEMM_THREADS as usize) as u32, groups, 1),
            block_dim: (GEMM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(kernel);
        launch.arg(a).arg(&t_u).arg(&w_view).arg(s).arg(&n_u).arg(&k_u).arg(&mode).arg(&group).arg(&rows_per_group).arg(out);
        // SAFETY: matches `mx_gemm_t*` in kernels.cu; sizes checked above.
        unsafe { launch.launch(cfg) }.map_err(dev("mx_gemm launch"))?;
        Ok(())
    }

    /// Device-to-device copy of `src` into `dst` (the bandwidth yardstick of the benchmarks).
    pub fn copy(&self, src: &DeviceBuffer, dst: &mut DeviceBuffer) -> Result<(), KernelError> {
        self.ensure(dst, src.len)?;
        if src.len == 0 {
            return Ok(());
        }
        let s = self.mem(src, "copy source")?.slice(..src.len);
        let d = dst.mem.as_mut().expect("ensured");
        let mut d = d.slice_mut(..src.len);
        self.stream.memcpy_dtod(&s, &mut d).map_err(dev("device-to-device copy"))
    }
}

fn poisoned<T>(_: T) -> KernelError {
    KernelError::Device("the staging lock is poisoned".into())
}

/// A pinned staging slot of [`STAGING_BYTES`] with its event.
fn new_slot(ctx: &Arc<CudaContext>) -> Result<PinnedSlot, KernelError> {
    // SAFETY: a plain page-locked allocation; freed by `PinnedSlot::drop`.
    let ptr = unsafe { cudarc::driver::result::malloc_host(STAGING_BYTES, 0) }.map_err(dev("pinned allocation"))?;
    let done = ctx.new_event(None).map_err(dev("event"))?;
    Ok(PinnedSlot { ptr: ptr.cast(), len: STAGING_BYTES, done })
}

fn compile(ctx: &Arc<CudaContext>, major: i32, minor: i32) -> Result<Kernels, KernelError> {
    let opts = CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        name: Some("orchestrator_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(KERNELS_CU, opts).map_err(|e| match e {
        CompileError::CompileError { nvrtc, log, .. } => {
            KernelError::Device(format!("NVRTC could not compile kernels.cu ({nvrtc:?}):\n{}", log.to_string_lossy()))
        }
        other => KernelError::Device(format!("NVRTC: {other}")),
    })?;
    let module = ctx.load_module(ptx).map_err(dev("module load"))?;
    let f = |name: &str| module.load_function(name).map_err(|e| KernelError::Device(format!("CUDA kernel `{name}`: {e}")));
    Ok(Kernels {
        gather_runs: f("gather_runs")?,
        gather_runs_v16: f("gather_runs_v16")?,
        expand_block_scales: f("expand_block_scales")?,
        quantize_bf16: f("quantize_bf16")?,
        swizzle_128x4: f("swizzle_128x4")?,
        unswizzle_128x4: f("unswizzle_128x4")?,
        pack_ue8m0: f("pack_ue8m0")?,
        unpack_ue8m0: f("unpack_ue8m0")?,
        mx_gemm: [f("mx_gemm_t1")?, f("mx_gemm_t2")?, f("mx_gemm_t4")?, f("mx_gemm_t8")?],
    })
}

impl Backend for CudaBackend {
    type Buffer = DeviceBuffer;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }
    fn empty(&self) -> DeviceBuffer {
        DeviceBuffer { mem: None, len: 0 }
    }
    fn len(&self, buf: &DeviceBuffer) -> usize {
        buf.len
    }
    fn capacity(&self, buf: &DeviceBuffer) -> usize {
        buf.capacity()
    }
    fn allocation_id(&self, buf: &DeviceBuffer) -> usize {
        buf.mem.as_ref().map_or(0, |m| m.device_ptr(&self.stream).0 as usize)
    }
    fn upload(&self, host: &[u8], dst: &mut DeviceBuffer) -> Result<(), KernelError> {
        self.ensure(dst, host.len())?;
        if host.is_empty() {
            return Ok(());
        }
        let mem = dst.mem.as_mut().expect("ensured");
        self.h2d(host, mem)
    }
    fn quantize_bf16_host(
        &self,
        bf16: &[u8],
        rows: usize,
        k: usize,
        rule: ScaleRule,
        order: BlockOrder<'_>,
        elements: &mut DeviceBuffer,
        scales: &mut DeviceBuffer,
    ) -> Result<Option<crate::placement::Placed>, KernelError> {
        check_bf16(bf16.len(), rows, k, order)?;
        let mut staged = self.empty();
        self.upload(bf16, &mut staged)?;
        let src = self.mem(&staged, "BF16 source")?;
        self.quantize_on_device(src, rows, k, rule, order, elements, scales).map(|()| None)
    }
    fn download(&self, src: &DeviceBuffer, dst: &mut Vec<u8>) -> Result<(), KernelError> {
        dst.clear();
        dst.resize(src.len, 0);
        if src.len == 0 {
            return Ok(());
        }
        let view = self.mem(src, "download")?.slice(..src.len);
        self.stream.memcpy_dtoh(&view, dst.as_mut_slice()).map_err(dev("device-to-host copy"))?;
        self.synchronize()
    }
    fn digest(&self, buf: &DeviceBuffer) -> Result<Digest, KernelError> {
        self.digest_streamed(buf)
    }
    fn expand_block_scales(
        &self,
        block_scale: &DeviceBuffer,
        rows: usize,
        k: usize,
        block: [usize; 2],
        dst: &mut DeviceBuffer,
    ) -> Result<(), KernelError> {
        let [bm, bk] = block;
        if bm == 0 || bk == 0 || bk % mxfp8::BLOCK != 0 || !rows.is_multiple_of(bm) || !k.is_multiple_of(bk) {
            return Err(KernelError::Shape(format!("cannot expand {bm}x{bk} block scales over [{rows}, {k}]")));
        }
        let (block_rows, block_cols) = (rows / bm, k / bk);
        if block_scale.len != block_rows * block_cols {
            return Err(KernelError::Shape(format!("block scale has {} bytes, expected [{block_rows}, {block_cols}]", block_scale.len)));
        }
        let c = k / mxfp8::BLOCK;
        self.ensure(dst, rows * c)?;
        if rows * c == 0 {
            return Ok(());
        }
        let src = self.mem(block_scale, "block scale")?;
        let d = dst.mem.as_mut().expect("ensured");
        let args = [rows as u64, c as u64, bm as u64, block_cols as u64, (bk / mxfp8::BLOCK) as u64];
        let mut launch = self.stream.launch_builder(&self.kernels.expand_block_scales);
        launch.arg(src).arg(d);
        for a in &args {
            launch.arg(a);
        }
        // SAFETY: matches `expand_block_scales` in kernels.cu; sizes checked above.
        unsafe { launch.launch(self.grid(rows * c)) }.map_err(dev("expand_block_scales launch"))?;
        Ok(())
    }
    fn quantize_bf16_rows(
        &self,
        bf16: &DeviceBuffer,
        rows: usize,
        k: usize,
        rule: ScaleRule,
        elements: &mut DeviceBuffer,
        scales: &mut DeviceBuffer,
    ) -> Result<(), KernelError> {
        check_bf16(bf16.len, rows, k, BlockOrder::Identity)?;
        if rows * k == 0 {
            self.ensure(elements, 0)?;
            return self.ensure(scales, 0);
        }
        let src = self.mem(bf16, "BF16 source")?;
        self.quantize_on_device(src, rows, k, rule, BlockOrder::Identity, elements, scales)
    }
    fn gather_runs(
        &self,
        src: &DeviceBuffer,
        row_bytes: usize,
        run_bytes: usize,
        perm: &Permutation,
        dst: &mut DeviceBuffer,
    ) -> Result<(), KernelError> {
        if run_bytes == 0 || row_bytes != perm.len() * run_bytes || !src.len.is_multiple_of(row_bytes.max(1)) {
            return Err(KernelError::Shape(format!(
                "cannot gather {} runs of {run_bytes} bytes from rows of {row_bytes} bytes ({} bytes in all)",
                perm.len(),
                src.len
            )));
        }
        self.ensure(dst, src.len)?;
        if src.len == 0 {
            return Ok(());
        }
        let perm_d = self.upload_new(perm.as_slice())?;
        let s = self.mem(src, "gather source")?;
        let d = dst.mem.as_mut().expect("ensured");
        let n_runs = perm.len() as u64;
        let (f, total, run) = if run_bytes.is_multiple_of(16) {
            (&self.kernels.gather_runs_v16, src.len / 16, run_bytes / 16)
        } else {
            (&self.kernels.gather_runs, src.len, run_bytes)
        };
        let (total_u, run_u) = (total as u64, run as u64);
        let mut launch = self.stream.launch_builder(f);
        launch.arg(s).arg(d).arg(&perm_d).arg(&total_u).arg(&n_runs).arg(&run_u);
        // SAFETY: matches `gather_runs` / `gather_runs_v16`; every index is inside `src` (perm is a
        // bijection on 0..n_runs and src holds whole rows); device allocations are 256-byte
        // aligned, so 16-byte words are aligned.
        unsafe { launch.launch(self.grid(total)) }.map_err(dev("gather_runs launch"))?;
        Ok(())
    }
    fn swizzle_128x4(&self, src: &DeviceBuffer, m: usize, c: usize, dst: &mut DeviceBuffer) -> Result<(), KernelError> {
        check_len("scale to swizzle", src.len, m * c)?;
        let total = layout::swizzled_len(m, c);
        self.ensure(dst, total)?;
        if total == 0 {
            return Ok(());
        }
        let d = dst.mem.as_mut().expect("ensured");
        let empty;
        let s = match src.mem.as_ref() {
            Some(s) => s,
            None => {
                empty = self.upload_new(&[0u8])?;
                &empty
            }
        };
        let (m_u, c_u, t_u) = (m as u64, c as u64, total as u64);
        let mut launch = self.stream.launch_builder(&self.kernels.swizzle_128x4);
        launch.arg(s).arg(d).arg(&m_u).arg(&c_u).arg(&t_u);
        // SAFETY: matches `swizzle_128x4`; reads only (i < m, j < c).
        unsafe { launch.launch(self.grid(total)) }.map_err(dev("swizzle_128x4 launch"))?;
        Ok(())
    }
    fn unswizzle_128x4(&self, src: &DeviceBuffer, m: usize, c: usize, dst: &mut DeviceBuffer) -> Result<(), KernelError> {
        check_len("swizzled scale", src.len, layout::swizzled_len(m, c))?;
        self.ensure(dst, m * c)?;
        if src.len == 0 {
            return Ok(());
        }
        let bad = self.upload_new(&[0u32])?;
        let s = self.mem(src, "swizzled scale")?;
        let d = dst.mem.as_mut().expect("ensured");
        let (m_u, c_u, t_u) = (m as u64, c as u64, src.len as u64);
        let mut launch = self.stream.launch_builder(&self.kernels.unswizzle_128x4);
        launch.arg(s).arg(d).arg(&m_u).arg(&c_u).arg(&t_u).arg(&bad);
        // SAFETY: matches `unswizzle_128x4`; sizes checked above.
        unsafe { launch.launch(self.grid(src.len)) }.map_err(dev("unswizzle_128x4 launch"))?;
        let nonzero = self.read_back(&bad)?;
        if nonzero != 0 {
            return Err(KernelError::Layout(format!("swizzled [{m}, {c}] scale has {nonzero} non-zero padding bytes")));
        }
        Ok(())
    }
    fn pack_ue8m0(&self, src: &DeviceBuffer, groups: usize, rows: usize, c: usize, dst: &mut DeviceBuffer) -> Result<(), KernelError> {
        if !c.is_multiple_of(4) || !rows.is_multiple_of(4) {
            return Err(KernelError::Shape(format!("packed UE8M0 needs scale columns ({c}) and rows ({rows}) that are multiples of 4")));
        }
        check_len("scale to pack", src.len, groups * rows * c)?;
        self.launch_pack(&self.kernels.pack_ue8m0, src, groups, rows, c, dst)
    }
    fn unpack_ue8m0(&self, src: &DeviceBuffer, groups: usize, rows: usize, c: usize, dst: &mut DeviceBuffer) -> Result<(), KernelError> {
        check_len("packed scale", src.len, groups * rows * c)?;
        if !c.is_multiple_of(4) {
            return Err(KernelError::Shape(format!("packed UE8M0 needs columns ({c}) a multiple of 4")));
        }
        self.launch_pack(&self.kernels.unpack_ue8m0, src, groups, rows, c, dst)
    }
    fn mx_gemm(&self, a: &MxMatrix, w: &BackendWeight<'_, Self>) -> Result<Vec<f32>, KernelError> {
        self.device_gemm(a, w)
    }
}

impl CudaBackend {
    fn launch_pack(
        &self,
        f: &CudaFunction,
        src: &DeviceBuffer,
        groups: usize,
        rows: usize,
        c: usize,
        dst: &mut DeviceBuffer,
    ) -> Result<(), KernelError> {
        self.ensure(dst, src.len)?;
        let words = src.len / 4;
        if words == 0 {
            return Ok(());
        }
        let s = self.mem(src, "scale")?;
        let d = dst.mem.as_mut().expect("ensured");
        let (g_u, r_u, k4_u) = (groups as u64, rows as u64, (c / 4) as u64);
        let mut launch = self.stream.launch_builder(f);
        launch.arg(s).arg(d).arg(&g_u).arg(&r_u).arg(&k4_u);
        // SAFETY: matches `pack_ue8m0` / `unpack_ue8m0`; `src` holds groups*rows*c bytes.
        unsafe { launch.launch(self.grid(words)) }.map_err(dev("pack launch"))?;
        Ok(())
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<(), KernelError> {
    if got != want {
        return Err(KernelError::Shape(format!("{what}: {got} bytes, expected {want}")));
    }
    Ok(())
}

/// The argument checks of [`mxfp8::quantize_bf16_ordered`], with its messages.
fn check_bf16(bytes: usize, rows: usize, k: usize, order: BlockOrder<'_>) -> Result<(), KernelError> {
    if !k.is_multiple_of(mxfp8::BLOCK) || bytes != rows * k * 2 {
        return Err(KernelError::Shape(format!("BF16 matrix of {bytes} bytes is not [{rows}, {k}] with K a multiple of {}", mxfp8::BLOCK)));
    }
    let blocks = k / mxfp8::BLOCK;
    match order {
        BlockOrder::Rows(p) if p.len() != rows => Err(KernelError::Shape(format!("row permutation of {} rows applied to {rows}", p.len()))),
        BlockOrder::Chunks(p) if p.len() != blocks => {
            Err(KernelError::Shape(format!("block permutation of {} blocks applied to {blocks} per row", p.len())))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::gemm_tokens;

    /// The picks on an H200 (132 SMs) for the dsv41-flash TP 4 shapes (wq_b 8192 rows, a wo_a
    /// group 1024, wo_b 5120): at T = 1 to 16 each the fastest or within 7% of it in the kernel's
    /// timings there; T = 128 was not timed against the other variants.
    #[test]
    fn gemm_tokens_keep_two_warps_per_multiprocessor() {
        let pick = |t, n| gemm_tokens(t, n, 132);
        assert_eq!([1, 2, 4, 8, 16, 128].map(|t| pick(t, 8192)), [1, 1, 2, 4, 8, 8]);
        assert_eq!([1, 2, 4, 8, 16, 128].map(|t| pick(t, 1024)), [1, 1, 1, 1, 1, 8]);
        assert_eq!([1, 2, 4, 8, 16, 128].map(|t| pick(t, 5120)), [1, 1, 2, 4, 8, 8]);
        // Never more tokens per thread than T rounded up to a power of two; 1 when nothing gives
        // enough warps, and for no tokens at all.
        assert_eq!([3, 5, 9].map(|t| pick(t, 1 << 20)), [4, 8, 8]);
        assert_eq!(pick(1, 32), 1);
        assert_eq!(pick(0, 8192), 1);
    }
}
