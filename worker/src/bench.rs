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
