//! Load-pipeline throughput against this machine's memcpy bandwidth, measured in the same run
//! (`orchestrator-worker bench`, and `cargo bench -p orchestrator-worker`).
//!
//! A checkpoint of the requested geometry is synthesized into a scratch directory (so it sits
//! in the page cache), then one rank is loaded repeatedly from it: page cache to kernel
//! layout, source and kernel digests included. Throughput counts checkpoint bytes read.

use std::path::{Path, PathBuf};
use std::time::Instant;

use orchestrator_kernels::{CpuBackend, ScaleRule};
use orchestrator_model::synth::{DEFAULT_MAX_SHARD_BYTES, SynthOptions, write_checkpoint};
use orchestrator_model::{ModelConfig, Preset, WeightFormat};
use rayon::prelude::*;
use serde::Serialize;

use crate::loader::RankLoader;
use crate::source::LoadSource;

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub preset: Preset,
    pub layers: usize,
    pub tp_size: usize,
    pub rank: usize,
    pub iters: usize,
    pub dir: PathBuf,
    /// Which storage formats to measure (`fp8`, `bf16`).
    pub formats: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PathResult {
    pub format: String,
    pub scale_rule: String,
    pub source_bytes: usize,
    pub best_s: f64,
    pub gb_per_s: f64,
    pub ratio_to_memcpy: f64,
    pub goal: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub threads: usize,
    pub memcpy_1t_gb_per_s: f64,
    pub memcpy_gb_per_s: f64,
    pub paths: Vec<PathResult>,
}

/// Best-of-N bandwidth of copying a buffer larger than the caches, on all rayon threads
/// (each copies its own part), and on one thread.
pub fn memcpy_bandwidth(bytes: usize, iters: usize) -> (f64, f64) {
    let src: Vec<u8> = (0..bytes).map(|i| (i * 31) as u8).collect();
    let mut dst = vec![0u8; bytes];
    let threads = rayon::current_num_threads().max(1);
    let part = bytes.div_ceil(threads);
    let mut best_all = f64::INFINITY;
    let mut best_one = f64::INFINITY;
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        dst.par_chunks_mut(part).zip(src.par_chunks(part)).for_each(|(d, s)| d.copy_from_slice(s));
        best_all = best_all.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        dst.copy_from_slice(&src);
        best_one = best_one.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    (bytes as f64 / best_one / 1e9, bytes as f64 / best_all / 1e9)
}

fn synth(dir: &Path, preset: Preset, layers: usize, format: WeightFormat) -> anyhow::Result<()> {
    if dir.join("config.json").exists() {
        return Ok(());
    }
    let opts = SynthOptions {
        config: ModelConfig::from_preset(preset, Some(layers), format == WeightFormat::Bf16)?,
        seed: 1,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        preset_name: Some(preset.name().to_string()),
    };
    write_checkpoint(dir, &opts)?;
    Ok(())
}

/// Runs the benchmark.
pub fn run(opts: &BenchOptions) -> anyhow::Result<BenchReport> {
    let (one, all) = memcpy_bandwidth(512 << 20, 5);
    let mut paths = Vec::new();
    let cases =
        [(WeightFormat::Fp8 { block: opts.preset.fp8_block() }, ScaleRule::Rceil, 0.5), (WeightFormat::Bf16, ScaleRule::Rceil, 0.25)];
    for (format, rule, goal) in cases {
        if !opts.formats.iter().any(|f| f == format.name()) {
            continue;
        }
        let dir = opts.dir.join(format!("{}-{}x{}", opts.preset.name(), format.name(), opts.layers));
        synth(&dir, opts.preset, opts.layers, format)?;
        let source = LoadSource::open_checkpoint(&dir)?;
        let backend = CpuBackend;
        let loader = RankLoader::new(&backend, source.config(), opts.tp_size, opts.rank, rule)?;
        // Warm the page cache and the buffers once.
        let mut weights = loader.load(&source)?;
        let bytes = weights.source_bytes();
        let mut best = f64::INFINITY;
        for _ in 0..opts.iters.max(1) {
            let t = Instant::now();
            weights = loader.reload(weights, &source)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let gbps = bytes as f64 / best / 1e9;
        paths.push(PathResult {
            format: format.name().to_string(),
            scale_rule: rule.name().to_string(),
            source_bytes: bytes,
            best_s: best,
            gb_per_s: gbps,
            ratio_to_memcpy: gbps / all,
            goal,
        });
    }
    Ok(BenchReport { threads: rayon::current_num_threads(), memcpy_1t_gb_per_s: one, memcpy_gb_per_s: all, paths })
}

impl BenchReport {
    pub fn render(&self, opts: &BenchOptions) -> String {
        let mut s = format!(
            "load pipeline, {} x {} layers, TP {} rank {}, {} threads\nmemcpy: {:.2} GB/s on {} threads ({:.2} GB/s on one)\n",
            opts.preset.name(),
            opts.layers,
            opts.tp_size,
            opts.rank,
            self.threads,
            self.memcpy_gb_per_s,
            self.threads,
            self.memcpy_1t_gb_per_s
        );
        for p in &self.paths {
            s.push_str(&format!(
                "{:<5} ({}): {:>8.1} MB in {:.4} s = {:.2} GB/s = {:.2}x memcpy (goal {:.2}x) {}\n",
                p.format,
                p.scale_rule,
                p.source_bytes as f64 / 1e6,
                p.best_s,
                p.gb_per_s,
                p.ratio_to_memcpy,
                p.goal,
                if p.ratio_to_memcpy >= p.goal { "met" } else { "NOT met" }
            ));
        }
        s
    }
}

/// One GEMM shape's figures.
#[derive(Clone, Debug, Serialize)]
pub struct GemmResult {
    pub name: String,
    pub tokens: usize,
    pub n: usize,
    pub k: usize,
    pub gflops: f64,
    pub naive_gflops: f64,
    pub fraction_of_peak: f64,
}

/// GEMM and probe figures.
#[derive(Clone, Debug, Serialize)]
pub struct GemmReport {
    pub threads: usize,
    pub peak_gflops: f64,
    pub gemms: Vec<GemmResult>,
    /// Per rank of TP 4 on one dsv41-flash layer, T = 16, S = 128: the kernel-layout pass and
    /// the plain reference.
    pub probe_kernel_s: f64,
    pub probe_reference_s: f64,
}

/// The compute roof of the GEMM's inner loop on this machine: the same multiply-add across 32
/// independent output lanes, on data that stays in L1, on all rayon threads. (The machine's
/// vector width and FMA availability are whatever this build targets; this measures what the
/// code can reach, the yardstick for how close the GEMM gets.)
pub fn peak_gflops() -> f64 {
    const LANES: usize = 32;
    const DEPTH: usize = 128;
    const REPS: usize = 100_000;
    let threads = rayon::current_num_threads().max(1);
    let t = Instant::now();
    let sink: f32 = (0..threads)
        .into_par_iter()
        .map(|i| {
            let w: Vec<f32> = (0..LANES * DEPTH).map(|x| 1e-3 * (x % 7) as f32 + i as f32 * 1e-6).collect();
            let a: Vec<f32> = (0..DEPTH).map(|x| 1e-3 * (x % 5) as f32).collect();
            let mut total = 0f32;
            for _ in 0..REPS {
                let mut acc = [0f32; LANES];
                for (kk, &av) in std::hint::black_box(&a).iter().enumerate() {
                    let row: &[f32; LANES] = w[kk * LANES..(kk + 1) * LANES].try_into().expect("lane row");
                    for j in 0..LANES {
                        acc[j] += av * row[j];
                    }
                }
                total += acc.iter().sum::<f32>();
            }
            total
        })
        .sum();
    std::hint::black_box(sink);
    (2 * LANES * DEPTH * REPS * threads) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn time_best(iters: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// GEMM throughput on the dsv41-flash TP 4 shapes for each token count, next to the naive
/// triple loop (on a slice of the rows, scaled) and the peak; then one probe per rank.
pub fn run_gemm(tokens: &[usize]) -> anyhow::Result<GemmReport> {
    use orchestrator_kernels::gemm::{MxMatrix, ScaleView, WeightView, gemm, gemm_reference};
    use orchestrator_model::Generator;

    let peak = peak_gflops();
    let g = Preset::Dsv41Flash.geometry();
    let generator = Generator::new(1);
    // (name, N, K) of one rank at TP 4: wq_b, one wo_a group, wo_b.
    let shapes = [("wq_b", g.q_rows() / 4, g.q_lora_rank), ("wo_a[g]", g.o_lora_rank, g.o_cols()), ("wo_b", g.hidden, g.o_rows() / 4)];
    let mut gemms = Vec::new();
    for (name, n, k) in shapes {
        let elements: Vec<u8> = generator
            .normal_f32(&format!("bench.{name}.w"), n * k)
            .iter()
            .map(|v| orchestrator_kernels::e4m3::from_f32_saturating(v * 64.0))
            .collect();
        let scales: Vec<u8> = (0..n * k / 32).map(|i| 115 + (i % 3) as u8).collect();
        let w = WeightView { elements: &elements, n, k, scales: ScaleView::RowMajor(&scales) };
        let naive_rows = n.min(256);
        let w_naive = WeightView {
            elements: &elements[..naive_rows * k],
            n: naive_rows,
            k,
            scales: ScaleView::RowMajor(&scales[..naive_rows * k / 32]),
        };
        for &t in tokens {
            let a = MxMatrix::quantize(&generator.normal_f32(&format!("bench.{name}.a"), t * k), k, ScaleRule::Rceil)?;
            let flops = 2.0 * (t * n * k) as f64;
            let fast = time_best(3, || {
                std::hint::black_box(gemm(&a, &w).expect("shapes agree"));
            });
            let naive = time_best(1, || {
                std::hint::black_box(gemm_reference(&a, &w_naive).expect("shapes agree"));
            }) * (n as f64 / naive_rows as f64);
            gemms.push(GemmResult {
                name: name.to_string(),
                tokens: t,
                n,
                k,
                gflops: flops / fast / 1e9,
                naive_gflops: flops / naive / 1e9,
                fraction_of_peak: flops / fast / 1e9 / peak,
            });
        }
    }
    // One probe per rank (T = 16, S = 128) on one dsv41-flash layer at TP 4.
    let source = LoadSource::Dummy { config: ModelConfig::from_preset(Preset::Dsv41Flash, Some(1), false)?, generator: Generator::new(3) };
    let backend = CpuBackend;
    let loader = RankLoader::new(&backend, source.config(), 4, 0, ScaleRule::Rceil)?;
    let weights = loader.load(&source)?;
    let spec = crate::probe::ProbeSpec { tokens: 16, latents: 128, seed: 0 };
    let p = crate::probe::probe_rank(&loader, &weights, &source, spec, ScaleRule::Rceil)?;
    anyhow::ensure!(p.ok, "the benchmark probe failed its own check: {p:?}");
    Ok(GemmReport {
        threads: rayon::current_num_threads(),
        peak_gflops: peak,
        gemms,
        probe_kernel_s: p.kernel_s,
        probe_reference_s: p.reference_s,
    })
}

impl GemmReport {
    pub fn render(&self) -> String {
        let mut s = format!(
            "MXFP8 GEMM, dsv41-flash TP 4 shapes, {} threads; peak estimate {:.1} GFLOP/s (the inner loop on L1-resident data, same run)\n",
            self.threads, self.peak_gflops
        );
        for g in &self.gemms {
            s.push_str(&format!(
                "{:<8} T={:<4} N={:<5} K={:<5} {:>7.2} GFLOP/s = {:.2}x peak; naive triple loop {:>6.3} GFLOP/s ({:.0}x slower)\n",
                g.name,
                g.tokens,
                g.n,
                g.k,
                g.gflops,
                g.fraction_of_peak,
                g.naive_gflops,
                g.gflops / g.naive_gflops
            ));
        }
        s.push_str(&format!(
            "probe T=16 S=128, one dsv41-flash layer, TP 4 rank 0: kernel-layout pass {:.3} s, plain reference {:.3} s\n",
            self.probe_kernel_s, self.probe_reference_s
        ));
        s
    }
}
