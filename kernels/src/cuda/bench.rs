//! GPU benchmarks (`orchestrator-worker bench-cuda`): each figure comes with the yardstick
//! measured in the same run on the same GPU.
//!
//! - host-to-device: the backend's `upload` (pageable source -> pinned staging -> device) against
//!   a plain copy from one large pinned buffer;
//! - a device buffer's digest against XXH3-64 of the same bytes in host memory;
//! - layout kernels: bytes moved per second against a device-to-device copy of the same bytes;
//! - the MXFP8 GEMM on the dsv41-flash TP 4 shapes: the kernel's weight bytes per second
//!   against DRAM's copy rate, and the whole call's TFLOP/s.

use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;

use crate::KernelError;
use crate::backend::{Backend, BackendWeight, ScaleKind};
use crate::cuda::CudaBackend;
use crate::digest::Digest;
use crate::gemm::MxMatrix;
use crate::layout;
use crate::mxfp8::ScaleRule;
use crate::permutation::{O_CHUNK, Permutation};

/// One measured figure.
#[derive(Clone, Debug)]
pub struct Figure {
    pub name: String,
    /// GB/s or TFLOP/s.
    pub value: f64,
    pub unit: &'static str,
    /// The same-run yardstick (GB/s) and the ratio to it, where there is one.
    pub baseline: Option<(String, f64)>,
}

impl Figure {
    pub fn ratio(&self) -> Option<f64> {
        self.baseline.as_ref().map(|(_, b)| self.value / b)
    }
}

fn dev(e: cudarc::driver::DriverError) -> KernelError {
    KernelError::Device(format!("CUDA: {e}"))
}

/// Seconds per call of `f` (after one warm-up call), synchronizing the stream.
fn time(b: &CudaBackend, iters: usize, mut f: impl FnMut() -> Result<(), KernelError>) -> Result<f64, KernelError> {
    f()?;
    b.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    b.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters.max(1) as f64)
}

fn gbps(bytes: usize, s: f64) -> f64 {
    bytes as f64 / s / 1e9
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed).collect()
}

/// Runs every benchmark (dsv41-flash shapes, TP 1 for the layouts, TP 4 for the GEMMs).
pub fn run(b: &CudaBackend, iters: usize) -> Result<Vec<Figure>, KernelError> {
    let mut out = Vec::new();
    let iters = iters.max(1);

    // Host to device: 256 MiB.
    let n = 256usize << 20;
    let host = pattern(n, 1);
    let mut d = b.empty();
    b.upload(&host, &mut d)?;
    let pinned_gbps = {
        let ctx = b.context();
        // SAFETY: filled below before it is read.
        let mut pinned = unsafe { ctx.alloc_pinned::<u8>(n) }.map_err(dev)?;
        pinned.as_mut_slice().map_err(dev)?.copy_from_slice(&host);
        let mut dst = b.stream().alloc_zeros::<u8>(n).map_err(dev)?;
        gbps(n, time(b, iters, || b.stream().memcpy_htod(&pinned, &mut dst).map_err(dev))?)
    };
    let upload = gbps(n, time(b, iters, || b.upload(&host, &mut d))?);
    out.push(Figure {
        name: "H2D upload (pageable -> pinned staging -> device)".into(),
        value: upload,
        unit: "GB/s",
        baseline: Some(("pinned copy".into(), pinned_gbps)),
    });
    out.push(Figure { name: "H2D pinned copy".into(), value: pinned_gbps, unit: "GB/s", baseline: None });
    // A device buffer's digest (device -> pinned slots -> XXH3-64, streamed) against hashing the
    // same bytes where they already lie in host memory.
    let host_hash = gbps(
        n,
        time(b, iters, || {
            std::hint::black_box(Digest::of(&host));
            Ok(())
        })?,
    );
    let digest = gbps(n, time(b, iters, || b.digest(&d).map(|_| ()))?);
    out.push(Figure {
        name: "digest of a device buffer (D2H through pinned slots, XXH3-64 streamed)".into(),
        value: digest,
        unit: "GB/s",
        baseline: Some(("XXH3-64 of host bytes".into(), host_hash)),
    });

    // Layout kernels on the dsv41-flash TP 1 shapes; yardstick: a device copy of the same bytes.
    let copy_gbps = |bytes: usize| -> Result<f64, KernelError> {
        let mut src = b.empty();
        b.upload(&pattern(bytes, 2), &mut src)?;
        let mut dst = b.empty();
        Ok(gbps(2 * bytes, time(b, iters, || b.copy(&src, &mut dst))?))
    };
    let (rows, k) = (64 * 512, 1280);
    let q = Permutation::q_rows(64, 512)?;
    let o = Permutation::o_columns(512)?.of_chunks(O_CHUNK)?;
    let mut src = b.empty();
    let mut dst = b.empty();
    b.upload(&pattern(rows * k, 3), &mut src)?;
    let base = copy_gbps(rows * k)?;
    let s = time(b, iters, || b.gather_runs(&src, rows * k, k, &q, &mut dst))?;
    out.push(Figure {
        name: "Q row gather, wq_b [32768, 1280]".into(),
        value: gbps(2 * rows * k, s),
        unit: "GB/s",
        baseline: Some(("D2D copy".into(), base)),
    });
    let (o_rows, o_k) = (8 * 1024, 4096);
    b.upload(&pattern(o_rows * o_k, 4), &mut src)?;
    let base = copy_gbps(o_rows * o_k)?;
    let s = time(b, iters, || b.gather_runs(&src, o_k, O_CHUNK, &o, &mut dst))?;
    out.push(Figure {
        name: "O chunk gather, wo_a [8192, 4096]".into(),
        value: gbps(2 * o_rows * o_k, s),
        unit: "GB/s",
        baseline: Some(("D2D copy".into(), base)),
    });
    // BF16 quantization straight into the fused Q layout: reads 2 bytes, writes 1 + 1/32.
    let bf16: Vec<u8> = (0..rows * k).flat_map(|i| (((i as f32 * 0.001).sin().to_bits() >> 16) as u16).to_le_bytes()).collect();
    let mut staged = b.empty();
    b.upload(&bf16, &mut staged)?;
    let (mut e, mut sc) = (b.empty(), b.empty());
    let moved = rows * k * 2 + rows * k + rows * k / 32;
    let base = copy_gbps(moved / 2)?;
    let s = time(b, iters, || b.quantize_bf16_rows(&staged, rows, k, ScaleRule::Rceil, &mut e, &mut sc))?;
    out.push(Figure {
        name: "BF16 -> MXFP8 quantize (rceil), [32768, 1280]".into(),
        value: gbps(moved, s),
        unit: "GB/s",
        baseline: Some(("D2D copy".into(), base)),
    });
    let c = k / 32;
    b.upload(&pattern(rows * c, 5), &mut src)?;
    let base = copy_gbps(rows * c)?;
    let s = time(b, iters, || b.swizzle_128x4(&src, rows, c, &mut dst))?;
    out.push(Figure {
        name: "F8_128x4 swizzle, scale [32768, 40]".into(),
        value: gbps(rows * c + layout::swizzled_len(rows, c), s),
        unit: "GB/s",
        baseline: Some(("D2D copy".into(), base)),
    });
    b.upload(&pattern(o_rows * 128, 6), &mut src)?;
    let base = copy_gbps(o_rows * 128)?;
    let s = time(b, iters, || b.pack_ue8m0(&src, 8, 1024, 128, &mut dst))?;
    out.push(Figure {
        name: "packed UE8M0, scale [8192, 128]".into(),
        value: gbps(2 * o_rows * 128, s),
        unit: "GB/s",
        baseline: Some(("D2D copy".into(), base)),
    });

    // GEMMs, dsv41-flash TP 4: wq_b [8192, 1280], one wo_a group [1024, 4096], wo_b [5120, 2048].
    // Two figures per shape and T:
    // - the kernel alone, from events around each launch: weight bytes per second against a
    //   device-to-device copy of 256 MiB (far past the H200's 60 MB L2, so DRAM's rate). Each launch
    //   reads the next of copies of the weight that together span 128 MiB, so that, like a
    //   probe walking the layers, it finds its weight in DRAM rather than in L2;
    // - the whole `mx_gemm` call (activation upload, launch, output download): TFLOP/s.
    let dram = copy_gbps(256 << 20)?;
    for (name, n, k) in [("wq_b", 8192usize, 1280usize), ("wo_a group", 1024, 4096), ("wo_b", 5120, 2048)] {
        let elements: Vec<u8> = pattern(n * k, 7).into_iter().map(|x| x & 0x7E | (x & 0x80)).collect();
        let scales: Vec<u8> = pattern(n * k / 32, 8).into_iter().map(|x| 118 + x % 10).collect();
        let mut sw = Vec::new();
        layout::swizzle_128x4(&scales, n, k / 32, &mut sw)?;
        let copies = (128usize << 20).div_ceil(n * k).max(2);
        let mut weights = Vec::with_capacity(copies);
        for _ in 0..copies {
            let (mut de, mut ds) = (b.empty(), b.empty());
            b.upload(&elements, &mut de)?;
            b.upload(&sw, &mut ds)?;
            weights.push((de, ds));
        }
        let weight = |i: usize| {
            let (de, ds) = &weights[i % copies];
            BackendWeight::<CudaBackend> { elements: de, offset: 0, n, k, scales: ds, scales_layout: ScaleKind::Swizzled128x4 }
        };
        for t in [1usize, 2, 4, 8, 16, 128] {
            let vals: Vec<f32> = (0..t * k).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01).collect();
            let a = MxMatrix::quantize(&vals, k, ScaleRule::Rceil)?;
            let a_d = b.stream().clone_htod(&a.dequantize()).map_err(dev)?;
            let mut y = b.stream().alloc_zeros::<f32>(t * n).map_err(dev)?;
            // One warm-up launch per copy, then `iters` timed ones (at least one per copy).
            let launches = iters.max(copies);
            let mut kernel_s = 0.0;
            for i in 0..copies + launches {
                let start = b.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev)?;
                b.launch_gemm(&a_d, t, &weight(i), &mut y)?;
                let end = b.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev)?;
                if i >= copies {
                    end.synchronize().map_err(dev)?;
                    kernel_s += f64::from(start.elapsed_ms(&end).map_err(dev)?) / 1e3;
                }
            }
            out.push(Figure {
                name: format!("MXFP8 GEMM kernel {name} [{n}, {k}], T = {t}: weight bytes from DRAM"),
                value: gbps(n * k, kernel_s / launches as f64),
                unit: "GB/s",
                baseline: Some(("DRAM copy".into(), dram)),
            });
            let s = time(b, iters, || b.mx_gemm(&a, &weight(0)).map(|_| ()))?;
            out.push(Figure {
                name: format!("MXFP8 GEMM {name} [{n}, {k}], T = {t} (incl. activation upload, output download)"),
                value: 2.0 * (t * n * k) as f64 / s / 1e12,
                unit: "TFLOP/s",
                baseline: None,
            });
        }
    }
    Ok(out)
}

/// The report as text.
pub fn render(device: &str, figures: &[Figure]) -> String {
    let mut s = format!("GPU benchmarks on {device}\n");
    for f in figures {
        s.push_str(&format!("  {:<78} {:>9.3} {:<7}", f.name, f.value, f.unit));
        if let (Some((what, base)), Some(r)) = (&f.baseline, f.ratio()) {
            s.push_str(&format!("  {r:.2}x {what} ({base:.1} GB/s)"));
        }
        s.push('\n');
    }
    s
}
