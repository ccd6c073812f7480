//! Writes test vectors for `scripts/check_kernels_on_host.sh`: inputs of every CUDA kernel in
//! `src/cuda/kernels.cu` and the CPU backend's outputs for them. The script compiles the CUDA C
//! source for the host (a thin shim for the CUDA built-ins, one thread per block) and checks that
//! each kernel reproduces the CPU bytes: the kernels' index arithmetic and bit manipulation,
//! checked on machines without a GPU. (It cannot check what only a GPU does: NVRTC, launches,
//! the GPU's float units.)
//!
//! Usage: `cargo run -p orchestrator-kernels --example kernel_vectors -- OUTDIR`

use std::fs;
use std::path::Path;

use orchestrator_kernels::gemm::{MxMatrix, ScaleView, WeightView, gemm};
use orchestrator_kernels::permutation::{BlockOrder, O_CHUNK, Permutation, gather_runs};
use orchestrator_kernels::{KernelError, ScaleRule, backend, layout, mxfp8};

use orchestrator_kernels::testdata::{gemm_edge_scales, gemm_edge_weights, splitmix_bytes as bytes};

fn bf16_values(rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let r = bytes(rows * k * 4, seed);
    let centers = bytes(rows * k / 32, seed ^ 0x55);
    let mut out = Vec::with_capacity(rows * k * 2);
    for (i, chunk) in r.chunks_exact(4).enumerate() {
        let exp = (centers[i / 32] as i32 + (chunk[0] % 24) as i32 - 12).clamp(0, 254) as u16;
        let mut h = (u16::from(chunk[1] & 1) << 15) | (exp << 7) | u16::from(chunk[2] & 0x7F);
        if chunk[3] % 29 == 0 {
            h &= 0x8000;
        }
        out.extend_from_slice(&h.to_le_bytes());
    }
    out
}

fn u32s(p: &[u32]) -> Vec<u8> {
    p.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(p: &[f32]) -> Vec<u8> {
    p.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// One case: `args.txt` (kernel name, then integers), inputs `in{i}.bin`, expected `out{i}.bin`.
fn case(dir: &Path, name: &str, kernel: &str, ints: &[u64], inputs: &[&[u8]], outputs: &[&[u8]]) {
    let d = dir.join(name);
    fs::create_dir_all(&d).unwrap();
    let ints: Vec<String> = ints.iter().map(u64::to_string).collect();
    fs::write(d.join("args.txt"), format!("{kernel}\n{}\n", ints.join(" "))).unwrap();
    for (i, b) in inputs.iter().enumerate() {
        fs::write(d.join(format!("in{i}.bin")), b).unwrap();
    }
    for (i, b) in outputs.iter().enumerate() {
        fs::write(d.join(format!("out{i}.bin")), b).unwrap();
    }
}

fn main() {
    let dir = std::env::args().nth(1).expect("usage: kernel_vectors OUTDIR");
    let dir = Path::new(&dir);

    // gather_runs: (perm, row_bytes, run_bytes, rows)
    let q = Permutation::q_rows(8, 512).unwrap();
    let o = Permutation::o_columns(512).unwrap().of_chunks(O_CHUNK).unwrap();
    let odd = Permutation::from_map(vec![2, 0, 1]).unwrap();
    for (i, (p, row_bytes, run, rows)) in
        [(&q, 4096 * 64, 64usize, 1usize), (&q, 4096 * 2, 2, 1), (&o, 4096, 32, 5), (&o, 128, 1, 7), (&odd, 9, 3, 4)]
            .into_iter()
            .enumerate()
    {
        let src = bytes(row_bytes * rows, i as u64);
        let mut want = Vec::new();
        gather_runs(&src, row_bytes, run, p, &mut want).unwrap();
        let (kernel, unit) = if run % 16 == 0 { ("gather_runs_v16", 16) } else { ("gather_runs", 1) };
        let ints = [(src.len() / unit) as u64, p.len() as u64, (run / unit) as u64];
        case(dir, &format!("gather{i}"), kernel, &ints, &[&src, &u32s(p.as_slice())], &[&want]);
    }

    // expand_block_scales
    for (i, (rows, k, block)) in [(256usize, 1280usize, [32usize, 32usize]), (384, 1024, [128, 128])].into_iter().enumerate() {
        let src = bytes((rows / block[0]) * (k / block[1]), i as u64 + 10);
        let mut want = Vec::new();
        backend::expand_block_scales(&src, rows, k, block, &mut want).unwrap();
        let c = k / 32;
        let ints = [rows as u64, c as u64, block[0] as u64, (k / block[1]) as u64, (block[1] / 32) as u64];
        case(dir, &format!("expand{i}"), "expand_block_scales", &ints, &[&src], &[&want]);
    }

    // quantize_bf16: every rule and order; and a NaN case (expected: the error index).
    let (rows, k) = (8 * 512, 256);
    let host = bf16_values(rows, k, 7);
    let chunks = Permutation::from_map((0..(k / 32) as u32).rev().collect()).unwrap();
    for (ri, rule) in [ScaleRule::Rceil, ScaleRule::Floor].into_iter().enumerate() {
        for (mode, order) in [BlockOrder::Identity, BlockOrder::Rows(&q), BlockOrder::Chunks(&chunks)].into_iter().enumerate() {
            let (mut e, mut s) = (Vec::new(), Vec::new());
            mxfp8::quantize_bf16_ordered(&host, rows, k, rule, order, &mut e, &mut s).unwrap();
            let perm: Vec<u32> = match order {
                BlockOrder::Identity => vec![0],
                BlockOrder::Rows(p) | BlockOrder::Chunks(p) => p.as_slice().to_vec(),
            };
            let ints = [rows as u64, k as u64, ri as u64, mode as u64];
            case(
                dir,
                &format!("quantize_r{ri}_m{mode}"),
                "quantize_bf16",
                &ints,
                &[&host, &u32s(&perm)],
                &[&e, &s, &u64::MAX.to_le_bytes()],
            );
        }
    }
    // The spec's table, one block per row.
    let tricky = 448.0 * 2f32.powi(-18) * (1.0 + 2f32.powi(-20));
    let table: Vec<u8> = [300.0f32, 448.0, 460.0, 500.0, 1.0, 0.001, tricky, 0.0, 2f32.powi(-140)]
        .iter()
        .flat_map(|&amax| (0..32).flat_map(move |i| (((if i == 7 { -amax } else { amax * 0.25 }).to_bits() >> 16) as u16).to_le_bytes()))
        .collect();
    for (ri, rule) in [ScaleRule::Rceil, ScaleRule::Floor].into_iter().enumerate() {
        let (mut e, mut s) = (Vec::new(), Vec::new());
        mxfp8::quantize_bf16_rows(&table, 9, 32, rule, &mut e, &mut s).unwrap();
        case(
            dir,
            &format!("quantize_table_r{ri}"),
            "quantize_bf16",
            &[9, 32, ri as u64, 0],
            &[&table, &u32s(&[0])],
            &[&e, &s, &u64::MAX.to_le_bytes()],
        );
    }
    let mut bad = bf16_values(64, 128, 3);
    for (at, bits) in [((17 * 128 + 70) * 2, 0x7F80u16), ((40 * 128 + 3) * 2, 0xFFC1)] {
        bad[at..at + 2].copy_from_slice(&bits.to_le_bytes());
    }
    // The expected key is the CPU error's source row and destination column (kernels.cu): with
    // rows reversed, source row 17 still comes first although its destination row (46) is
    // after row 40's (23); with blocks reversed, column 70 (block 2) lands in block 1.
    let reversed = Permutation::from_map((0..64u32).rev().collect()).unwrap();
    let blocks = Permutation::from_map(vec![3, 2, 1, 0]).unwrap();
    for (mode, order) in [BlockOrder::Identity, BlockOrder::Rows(&reversed), BlockOrder::Chunks(&blocks)].into_iter().enumerate() {
        let err = mxfp8::quantize_bf16_ordered(&bad, 64, 128, ScaleRule::Rceil, order, &mut Vec::new(), &mut Vec::new()).unwrap_err();
        let KernelError::NonFinite { row, col } = err else { panic!("{err:?}") };
        let dst_col = match order {
            BlockOrder::Chunks(p) => p.inverse_map()[col / 32] as usize * 32 + col % 32,
            _ => col,
        };
        let perm: Vec<u32> = match order {
            BlockOrder::Identity => vec![0],
            BlockOrder::Rows(p) | BlockOrder::Chunks(p) => p.as_slice().to_vec(),
        };
        let key = (row * 128 + dst_col) as u64;
        case(
            dir,
            &format!("quantize_nan_m{mode}"),
            "quantize_bf16",
            &[64, 128, 0, mode as u64],
            &[&bad, &u32s(&perm)],
            &[&[], &[], &key.to_le_bytes()],
        );
    }

    // swizzle / unswizzle
    for (i, (m, c)) in [(8192usize, 40usize), (300, 41), (3, 5)].into_iter().enumerate() {
        let src = bytes(m * c, i as u64 + 20);
        let mut want = Vec::new();
        layout::swizzle_128x4(&src, m, c, &mut want).unwrap();
        let t = want.len() as u64;
        case(dir, &format!("swizzle{i}"), "swizzle_128x4", &[m as u64, c as u64, t], &[&src], &[&want]);
        case(dir, &format!("unswizzle{i}"), "unswizzle_128x4", &[m as u64, c as u64, t], &[&want], &[&src, &0u32.to_le_bytes()]);
    }
    // pack / unpack
    for (i, (g, rows, c)) in [(2usize, 1024usize, 128usize), (3, 20, 12)].into_iter().enumerate() {
        let src = bytes(g * rows * c, i as u64 + 30);
        let mut want = Vec::new();
        layout::pack_ue8m0_mn_major(&src, g, rows, c, &mut want).unwrap();
        let ints = [g as u64, rows as u64, (c / 4) as u64];
        case(dir, &format!("pack{i}"), "pack_ue8m0", &ints, &[&src], &[&want]);
        case(dir, &format!("unpack{i}"), "unpack_ue8m0", &ints, &[&want], &[&src]);
    }

    // mx_gemm in the three scale layouts.
    let (n, k) = (300usize, 512usize);
    let elements: Vec<u8> = bytes(n * k, 5).into_iter().map(|b| b & 0x7E | (b & 0x80)).collect();
    let scales: Vec<u8> = bytes(n * k / 32, 6).into_iter().map(|b| 115 + b % 20).collect();
    let values: Vec<f32> = bytes(17 * k, 8).iter().map(|&b| (b as f32 - 127.5) * 0.173).collect();
    let a = MxMatrix::quantize(&values, k, ScaleRule::Rceil).unwrap();
    let a_deq = f32s(&a.dequantize());
    let (mut sw, mut packed) = (Vec::new(), Vec::new());
    layout::swizzle_128x4(&scales, n, k / 32, &mut sw).unwrap();
    layout::pack_ue8m0_mn_major(&scales, 3, 100, k / 32, &mut packed).unwrap();
    let views = [
        (0u64, WeightView { elements: &elements, n, k, scales: ScaleView::RowMajor(&scales) }, &scales, 0usize),
        (1, WeightView { elements: &elements, n, k, scales: ScaleView::Swizzled128x4(&sw) }, &sw, 0),
        (
            2,
            WeightView {
                elements: &elements[200 * k..],
                n: 100,
                k,
                scales: ScaleView::PackedUe8m0 { bytes: &packed, group: 2, rows_per_group: 100 },
            },
            &packed,
            2,
        ),
    ];
    for (mode, view, scale_bytes, group) in views {
        let want = gemm(&a, &view).unwrap();
        let ints = [a.rows as u64, view.n as u64, k as u64, mode, group as u64, if mode == 2 { 100 } else { 0 }];
        case(dir, &format!("gemm_m{mode}"), "mx_gemm", &ints, &[&a_deq, view.elements, scale_bytes], &[&f32s(&want)]);
    }

    // mx_gemm on every weight byte (NaN, subnormal, both zeros) and every scale byte (0 to
    // 2^-127, above 2^7 where the kernel takes two products, 0xFF a NaN), with a row count that
    // is not a multiple of a warp, and K blocks (7, 13) that are not a multiple of the four a
    // thread loads at once (the packed layout needs multiples of 4: 68 rows, 12 blocks).
    for (mode, n, k, t) in [(0u64, 70usize, 224usize, 5usize), (1, 70, 416, 3), (2, 68, 384, 6)] {
        let c = k / 32;
        let elements = gemm_edge_weights(n, k);
        let scales = gemm_edge_scales(n, c);
        let values: Vec<f32> = bytes(t * k, 40 + mode).iter().map(|&b| (b as f32 - 127.5) * 0.0173).collect();
        let a = MxMatrix::quantize(&values, k, ScaleRule::Rceil).unwrap();
        let mut layout_bytes = Vec::new();
        let scale_view = match mode {
            0 => ScaleView::RowMajor(&scales),
            1 => {
                layout::swizzle_128x4(&scales, n, c, &mut layout_bytes).unwrap();
                ScaleView::Swizzled128x4(&layout_bytes)
            }
            _ => {
                layout::pack_ue8m0_mn_major(&scales, 1, n, c, &mut layout_bytes).unwrap();
                ScaleView::PackedUe8m0 { bytes: &layout_bytes, group: 0, rows_per_group: n }
            }
        };
        let scale_bytes = if mode == 0 { &scales } else { &layout_bytes };
        let view = WeightView { elements: &elements, n, k, scales: scale_view };
        let want = gemm(&a, &view).unwrap();
        let ints = [t as u64, n as u64, k as u64, mode, 0, if mode == 2 { n as u64 } else { 0 }];
        case(dir, &format!("gemm_edge_m{mode}"), "mx_gemm", &ints, &[&f32s(&a.dequantize()), &elements, scale_bytes], &[&f32s(&want)]);
    }
}
