//! The CUDA backend against the CPU backend, byte for byte, on random data: every layout
//! operation, both scale rules, the ordered (permuted) quantization, the errors, the pinned
//! upload of more than one staging slot (and of more uploads at once than there are slots),
//! and the probe GEMM in all three scale layouts.
//! Compiled with `--features cuda`; without a GPU (or without the CUDA libraries) every test
//! prints why it skipped and passes.
#![cfg(feature = "cuda")]

use orchestrator_kernels::cuda::CudaBackend;
use orchestrator_kernels::gemm::MxMatrix;
use orchestrator_kernels::permutation::{BlockOrder, O_CHUNK, Permutation};
use orchestrator_kernels::{Backend, BackendWeight, CpuBackend, KernelError, ScaleKind, ScaleRule, layout};

fn gpu() -> Option<CudaBackend> {
    if CudaBackend::device_count() == 0 {
        eprintln!("skipped: no CUDA driver/NVRTC/NCCL or no GPU on this machine");
        return None;
    }
    // Libraries and a device are present: from here on a failure is a real failure.
    Some(CudaBackend::new(0).expect("CUDA backend on device 0"))
}

use orchestrator_kernels::testdata::{gemm_edge_scales, gemm_edge_weights, splitmix_bytes as bytes};

/// Random BF16 values over every binade (zeros, subnormals, values that saturate under floor),
/// with a random exponent window per 32-block so that scales vary widely.
fn bf16_values(rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let r = bytes(rows * k * 4, seed);
    let mut out = Vec::with_capacity(rows * k * 2);
    for (i, chunk) in r.chunks_exact(4).enumerate() {
        let block = i / 32;
        let center = bytes(1, seed ^ (block as u64 + 1).wrapping_mul(0x9E37))[0] as i32;
        let exp = (center + (chunk[0] % 24) as i32 - 12).clamp(0, 254) as u16;
        let mut h = (u16::from(chunk[1] & 1) << 15) | (exp << 7) | u16::from(chunk[2] & 0x7F);
        if chunk[3] % 29 == 0 {
            h &= 0x8000;
        }
        out.extend_from_slice(&h.to_le_bytes());
    }
    out
}

fn up(b: &CudaBackend, host: &[u8]) -> <CudaBackend as Backend>::Buffer {
    let mut d = b.empty();
    b.upload(host, &mut d).unwrap();
    d
}

fn down(b: &CudaBackend, d: &<CudaBackend as Backend>::Buffer) -> Vec<u8> {
    let mut h = Vec::new();
    b.download(d, &mut h).unwrap();
    h
}

#[test]
fn upload_download_and_digest_across_staging_slots() {
    let Some(g) = gpu() else { return };
    for n in [0usize, 1, 4095, (8 << 20) + 17, (20 << 20) + 3] {
        let host = bytes(n, n as u64);
        let d = up(&g, &host);
        assert_eq!(g.len(&d), n);
        assert_eq!(down(&g, &d), host, "{n} bytes");
        assert_eq!(g.digest(&d).unwrap(), CpuBackend.digest(&host).unwrap());
    }
    // A reload into a large enough buffer keeps its allocation.
    let mut d = up(&g, &bytes(1000, 1));
    let id = g.allocation_id(&d);
    g.upload(&bytes(600, 2), &mut d).unwrap();
    assert_eq!(g.allocation_id(&d), id);
    assert_eq!(down(&g, &d), bytes(600, 2));
}

#[test]
fn concurrent_uploads_and_digests_share_the_staging_slots() {
    let Some(g) = gpu() else { return };
    // Twelve uploads at once, each split over three threads of its own: more fillers than the
    // pool has slots, so each waits for slots the others return, and every buffer lands whole.
    let hosts: Vec<Vec<u8>> = (0..12).map(|i| bytes((33 << 20) + i * 4099, 100 + i as u64)).collect();
    // Each then digests its buffer (two slots at once, streamed) while the others upload.
    let uploaded: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = hosts
            .iter()
            .map(|h| {
                s.spawn(|| {
                    let d = up(&g, h);
                    let digest = g.digest(&d).unwrap();
                    (d, digest)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("an upload thread panicked")).collect()
    });
    for (i, (host, (d, digest))) in hosts.iter().zip(&uploaded).enumerate() {
        assert!(down(&g, d) == *host, "upload {i} of {} bytes", host.len());
        assert_eq!(*digest, CpuBackend.digest(host).unwrap(), "digest of upload {i}");
    }
}

#[test]
fn gather_runs_matches_cpu() {
    let Some(g) = gpu() else { return };
    let q = Permutation::q_rows(8, 512).unwrap();
    let o = Permutation::o_columns(512).unwrap().of_chunks(O_CHUNK).unwrap();
    let odd = Permutation::from_map(vec![2, 0, 1]).unwrap();
    // (perm, row_bytes, run_bytes, rows): the Q row gather (16-byte words and bytes), the O
    // chunk gather of weights and of scales, and runs of 3 bytes.
    let cases: [(&Permutation, usize, usize, usize); 5] =
        [(&q, 4096 * 64, 64, 1), (&q, 4096 * 2, 2, 1), (&o, 4096, 32, 5), (&o, 128, 1, 7), (&odd, 9, 3, 4)];
    for (i, (p, row_bytes, run, rows)) in cases.into_iter().enumerate() {
        let src = bytes(row_bytes * rows, i as u64);
        let (mut want, mut got) = (Vec::new(), g.empty());
        CpuBackend.gather_runs(&src, row_bytes, run, p, &mut want).unwrap();
        g.gather_runs(&up(&g, &src), row_bytes, run, p, &mut got).unwrap();
        assert_eq!(down(&g, &got), want, "case {i}");
        // The same through upload_gather_runs.
        let mut got2 = g.empty();
        g.upload_gather_runs(&src, row_bytes, run, p, &mut got2).unwrap();
        assert_eq!(down(&g, &got2), want, "case {i} (upload)");
    }
    // Bad shapes are the CPU's errors.
    let mut out = g.empty();
    let e = g.gather_runs(&up(&g, &[0u8; 10]), 9, 3, &odd, &mut out).unwrap_err();
    let c = CpuBackend.gather_runs(&vec![0u8; 10], 9, 3, &odd, &mut Vec::new()).unwrap_err();
    assert_eq!(e.to_string(), c.to_string());
}

#[test]
fn expand_block_scales_matches_cpu() {
    let Some(g) = gpu() else { return };
    for (rows, k, block) in [(256usize, 1280usize, [32usize, 32usize]), (384, 1024, [128, 128]), (64, 64, [32, 32])] {
        let src = bytes((rows / block[0]) * (k / block[1]), rows as u64);
        let (mut want, mut got) = (Vec::new(), g.empty());
        CpuBackend.expand_block_scales(&src, rows, k, block, &mut want).unwrap();
        g.expand_block_scales(&up(&g, &src), rows, k, block, &mut got).unwrap();
        assert_eq!(down(&g, &got), want, "{rows}x{k} {block:?}");
    }
    assert!(g.expand_block_scales(&up(&g, &[1]), 30, 64, [32, 32], &mut g.empty()).is_err());
}

#[test]
fn quantize_matches_cpu_bit_for_bit_with_both_rules_and_orders() {
    let Some(g) = gpu() else { return };
    let (rows, k) = (8 * 512, 256);
    let host = bf16_values(rows, k, 7);
    let q = Permutation::q_rows(8, 512).unwrap();
    let chunks = Permutation::from_map((0..(k / 32) as u32).rev().collect()).unwrap();
    for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
        let (mut we, mut ws) = (Vec::new(), Vec::new());
        CpuBackend.quantize_bf16_rows(&host, rows, k, rule, &mut we, &mut ws).unwrap();
        let (mut ge, mut gs) = (g.empty(), g.empty());
        g.quantize_bf16_rows(&up(&g, &host), rows, k, rule, &mut ge, &mut gs).unwrap();
        assert_eq!(down(&g, &ge), we, "{rule} elements");
        assert_eq!(down(&g, &gs), ws, "{rule} scales");
        for order in [BlockOrder::Identity, BlockOrder::Rows(&q), BlockOrder::Chunks(&chunks)] {
            let (mut we, mut ws) = (Vec::new(), Vec::new());
            CpuBackend.quantize_bf16_host(&host, rows, k, rule, order, &mut we, &mut ws).unwrap();
            let (mut ge, mut gs) = (g.empty(), g.empty());
            g.quantize_bf16_host(&host, rows, k, rule, order, &mut ge, &mut gs).unwrap();
            assert_eq!(down(&g, &ge), we, "{rule} {order:?} elements");
            assert_eq!(down(&g, &gs), ws, "{rule} {order:?} scales");
        }
    }
    // The spec's tricky amax values, one block each.
    let tricky = 448.0 * 2f32.powi(-18) * (1.0 + 2f32.powi(-20));
    for amax in [300.0f32, 448.0, 460.0, 500.0, 1.0, 0.001, tricky, 0.0] {
        let vals: Vec<u8> =
            (0..32).flat_map(|i| (((if i == 7 { -amax } else { amax * 0.25 }).to_bits() >> 16) as u16).to_le_bytes()).collect();
        for rule in [ScaleRule::Rceil, ScaleRule::Floor] {
            let (mut we, mut ws) = (Vec::new(), Vec::new());
            CpuBackend.quantize_bf16_rows(&vals, 1, 32, rule, &mut we, &mut ws).unwrap();
            let (mut ge, mut gs) = (g.empty(), g.empty());
            g.quantize_bf16_rows(&up(&g, &vals), 1, 32, rule, &mut ge, &mut gs).unwrap();
            assert_eq!((down(&g, &ge), down(&g, &gs)), (we, ws), "amax {amax} {rule}");
        }
    }
}

#[test]
fn non_finite_input_is_the_cpu_error() {
    let Some(g) = gpu() else { return };
    let (rows, k) = (64, 128);
    let mut host = bf16_values(rows, k, 3);
    for (at, bits) in [((17 * k + 70) * 2, 0x7F80u16), ((40 * k + 3) * 2, 0xFFC1)] {
        host[at..at + 2].copy_from_slice(&bits.to_le_bytes());
    }
    let q = Permutation::from_map((0..rows as u32).rev().collect()).unwrap();
    let chunks = Permutation::from_map(vec![3, 2, 1, 0]).unwrap();
    for order in [BlockOrder::Identity, BlockOrder::Rows(&q), BlockOrder::Chunks(&chunks)] {
        let cpu = CpuBackend.quantize_bf16_host(&host, rows, k, ScaleRule::Rceil, order, &mut Vec::new(), &mut Vec::new()).unwrap_err();
        let gpu = g.quantize_bf16_host(&host, rows, k, ScaleRule::Rceil, order, &mut g.empty(), &mut g.empty()).unwrap_err();
        assert!(matches!(gpu, KernelError::NonFinite { .. }), "{gpu:?}");
        assert_eq!(gpu.to_string(), cpu.to_string(), "{order:?}");
    }
}

#[test]
fn swizzle_and_pack_match_cpu_and_invert() {
    let Some(g) = gpu() else { return };
    for (m, c) in [(8192usize, 40usize), (300, 41), (3, 5), (128, 4)] {
        let src = bytes(m * c, (m * c) as u64);
        let (mut want, mut got) = (Vec::new(), g.empty());
        CpuBackend.swizzle_128x4(&src, m, c, &mut want).unwrap();
        g.swizzle_128x4(&up(&g, &src), m, c, &mut got).unwrap();
        assert_eq!(down(&g, &got), want, "swizzle [{m}, {c}]");
        assert_eq!(want.len(), layout::swizzled_len(m, c));
        let mut back = g.empty();
        g.unswizzle_128x4(&got, m, c, &mut back).unwrap();
        assert_eq!(down(&g, &back), src);
        // Dirty padding is the CPU's error.
        if let Some(pad) = (0..want.len()).find(|&o| want[o] == 0 && !(0..m).any(|i| (0..c).any(|j| layout::swizzle_offset(i, j, c) == o)))
        {
            let mut dirty = want.clone();
            dirty[pad] = 1;
            let cpu = CpuBackend.unswizzle_128x4(&dirty, m, c, &mut Vec::new()).unwrap_err();
            let gpu = g.unswizzle_128x4(&up(&g, &dirty), m, c, &mut g.empty()).unwrap_err();
            assert_eq!(gpu.to_string(), cpu.to_string());
        }
    }
    for (groups, rows, c) in [(2usize, 1024usize, 128usize), (1, 4, 8), (3, 20, 12)] {
        let src = bytes(groups * rows * c, 99);
        let (mut want, mut got) = (Vec::new(), g.empty());
        CpuBackend.pack_ue8m0(&src, groups, rows, c, &mut want).unwrap();
        g.pack_ue8m0(&up(&g, &src), groups, rows, c, &mut got).unwrap();
        assert_eq!(down(&g, &got), want, "pack {groups}x{rows}x{c}");
        let mut back = g.empty();
        g.unpack_ue8m0(&got, groups, rows, c, &mut back).unwrap();
        assert_eq!(down(&g, &back), src);
    }
    assert!(g.pack_ue8m0(&up(&g, &[0u8; 30]), 1, 5, 6, &mut g.empty()).is_err());
}

#[test]
fn gemm_matches_cpu_bit_for_bit_in_every_scale_layout() {
    let Some(g) = gpu() else { return };
    let (n, k) = (300usize, 512usize);
    let elements: Vec<u8> = bytes(n * k, 5).into_iter().map(|b| b & 0x7E | (b & 0x80)).collect();
    let scales: Vec<u8> = bytes(n * k / 32, 6).into_iter().map(|b| 115 + b % 20).collect();
    let values: Vec<f32> = bytes(17 * k, 8).iter().map(|&b| (b as f32 - 127.5) * 0.173).collect();
    let (mut sw, mut packed) = (Vec::new(), Vec::new());
    CpuBackend.swizzle_128x4(&scales, n, k / 32, &mut sw).unwrap();
    let (groups, per) = (3usize, 100usize);
    CpuBackend.pack_ue8m0(&scales, groups, per, k / 32, &mut packed).unwrap();
    let (ge, gs, gsw, gp) = (up(&g, &elements), up(&g, &scales), up(&g, &sw), up(&g, &packed));
    let layouts = [
        (ScaleKind::RowMajor, &scales, &gs, 0, n),
        (ScaleKind::Swizzled128x4, &sw, &gsw, 0, n),
        (ScaleKind::PackedUe8m0 { group: 2, rows_per_group: per }, &packed, &gp, 2 * per * k, per),
    ];
    // Every kernel variant (1, 2, 4 and 8 tokens per thread), with and without a partial group.
    for t in [1usize, 2, 3, 4, 5, 8, 9, 16, 17] {
        let a = MxMatrix::quantize(&values[..t * k], k, ScaleRule::Rceil).unwrap();
        for (kind, host_scales, dev_scales, offset, rows) in layouts {
            let cw = BackendWeight::<CpuBackend> { elements: &elements, offset, n: rows, k, scales: host_scales, scales_layout: kind };
            let dw = BackendWeight::<CudaBackend> { elements: &ge, offset, n: rows, k, scales: dev_scales, scales_layout: kind };
            let want = CpuBackend.mx_gemm(&a, &cw).unwrap();
            let got = g.mx_gemm(&a, &dw).unwrap();
            assert_eq!(got.len(), want.len());
            let diff = got.iter().zip(&want).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            assert_eq!(diff, 0, "T = {t}, {kind:?}: {diff} outputs differ");
        }
    }
}

/// Every weight byte (NaN, subnormal, both zeros) and every scale byte (tiny, above 2^7 where
/// the kernel takes two products, the NaN scale), K blocks that are not a multiple of the four a
/// thread loads at once, and a row count that is not a multiple of a warp. A NaN compares equal
/// to any NaN (the CPU's and the GPU's float units give NaNs different bits).
#[test]
fn gemm_matches_cpu_on_every_weight_and_scale_byte() {
    let Some(g) = gpu() else { return };
    for (n, k, t) in [(70usize, 224usize, 5usize), (70, 416, 3), (68, 384, 16), (70, 224, 1)] {
        let c = k / 32;
        let elements = gemm_edge_weights(n, k);
        let scales = gemm_edge_scales(n, c);
        let values: Vec<f32> = bytes(t * k, 40).iter().map(|&b| (b as f32 - 127.5) * 0.0173).collect();
        let a = MxMatrix::quantize(&values, k, ScaleRule::Rceil).unwrap();
        let (mut sw, mut packed) = (Vec::new(), Vec::new());
        CpuBackend.swizzle_128x4(&scales, n, c, &mut sw).unwrap();
        let mut layouts = vec![(ScaleKind::RowMajor, scales.clone()), (ScaleKind::Swizzled128x4, sw)];
        if c.is_multiple_of(4) {
            CpuBackend.pack_ue8m0(&scales, 1, n, c, &mut packed).unwrap();
            layouts.push((ScaleKind::PackedUe8m0 { group: 0, rows_per_group: n }, packed));
        }
        let ge = up(&g, &elements);
        for (kind, host_scales) in layouts {
            let gs = up(&g, &host_scales);
            let cw = BackendWeight::<CpuBackend> { elements: &elements, offset: 0, n, k, scales: &host_scales, scales_layout: kind };
            let dw = BackendWeight::<CudaBackend> { elements: &ge, offset: 0, n, k, scales: &gs, scales_layout: kind };
            let want = CpuBackend.mx_gemm(&a, &cw).unwrap();
            let got = g.mx_gemm(&a, &dw).unwrap();
            assert_eq!(got.len(), want.len());
            let nans = want.iter().filter(|x| x.is_nan()).count();
            assert!(nans > 0 && nans < want.len() / 2, "the case holds some NaN outputs and more others ({nans} of {})", want.len());
            let diff = got.iter().zip(&want).filter(|(x, y)| x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan())).count();
            assert_eq!(diff, 0, "[{n}, {k}], T = {t}, {kind:?}: {diff} outputs differ");
        }
    }
}
