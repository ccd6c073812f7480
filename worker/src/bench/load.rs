//! Load-pipeline throughput against this machine's memcpy bandwidth, measured in the same run
//! (`orchestrator-worker bench`, and `cargo bench -p orchestrator-worker`).
//!
//! A checkpoint of the requested geometry is synthesized into a scratch directory (so it sits
//! in the page cache), then one rank is loaded repeatedly from it: page cache to kernel
//! layout, source and kernel digests included. Throughput counts checkpoint bytes read; each
//! reload is timed next to a memcpy on the same threads, and the ratio is the best of each.

use anyhow::Context;
use std::path::{Path, PathBuf};
use std::time::Instant;

use orchestrator_kernels::{CpuBackend, ScaleRule};
use orchestrator_model::{Preset, WeightFormat};
use serde::Serialize;

use super::roofs::Memcpy;
use super::synth;
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
    /// An `orchestrator-worker` binary to time a fresh worker process's load with (skipped
    /// when `None`).
    pub worker_exe: Option<PathBuf>,
}

/// A fresh worker process loading the rank (`orchestrator-worker load --json`), next to the
/// page-cache read rate of the checkpoint's files measured in the same run.
#[derive(Clone, Debug, Serialize)]
pub struct FreshLoad {
    pub source_bytes: usize,
    /// Page cache to kernel layouts and digests (the report's `load_wall_s`), the best of
    /// [`FRESH_RUNS`] fresh processes (`loads_s`, in order).
    pub load_s: f64,
    pub loads_s: Vec<f64>,
    pub load_gb_per_s: f64,
    pub round_trip_s: f64,
    /// `read()` of the checkpoint's shard files, page cache to a reused buffer.
    pub read_gb_per_s: f64,
    /// `load_gb_per_s / read_gb_per_s` (goal >= 0.5).
    pub load_to_read: f64,
    /// `round_trip_s / load_s` (goal <= 0.5).
    pub round_trip_to_load: f64,
    /// The rank's kernel-layout bytes, all of them written into memory fresh to the process.
    pub kernel_bytes: usize,
    /// Fresh memory of that size faulted in (one write per 4 KiB page, as the allocator maps a
    /// rank's weights), the best of [`FRESH_RUNS`]: the kernel zero-fills every page, and on a
    /// VM whose host reclaimed free guest memory the host faults it in first.
    pub first_touch_gb_per_s: f64,
}

/// Fresh processes (and fresh-memory passes) per format: their speed moves several times over
/// between runs on a VM whose host reclaims free guest memory.
pub const FRESH_RUNS: usize = 3;

/// The best rate at which `bytes` of memory fresh to this process are faulted in.
fn first_touch_rate(bytes: usize) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..FRESH_RUNS {
        // A zeroed block of this size is a fresh mapping (`crate::alloc`), as a load's is.
        let mut v = vec![0u8; bytes.max(1)];
        let t = Instant::now();
        for i in (0..v.len()).step_by(4096) {
            // SAFETY: i < v.len(); a volatile write, so that every page is touched.
            unsafe { std::ptr::write_volatile(v.as_mut_ptr().add(i), 1) };
        }
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&v);
    }
    bytes as f64 / best / 1e9
}

#[derive(Clone, Debug, Serialize)]
pub struct PathResult {
    pub format: String,
    pub scale_rule: String,
    pub source_bytes: usize,
    pub best_s: f64,
    pub gb_per_s: f64,
    /// memcpy on the same threads, timed between the reloads (the best of as many copies).
    pub memcpy_gb_per_s: f64,
    pub ratio_to_memcpy: f64,
    pub goal: f64,
    pub fresh: Option<FreshLoad>,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub threads: usize,
    pub memcpy_1t_gb_per_s: f64,
    pub memcpy_gb_per_s: f64,
    pub paths: Vec<PathResult>,
}

/// Best-of-3 rate of reading every `*.safetensors` file of `dir` into one reused buffer.
pub fn page_cache_read_rate(dir: &Path) -> anyhow::Result<f64> {
    use std::io::Read;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let mut buf = vec![0u8; 8 << 20];
    let (mut best, mut bytes) = (f64::INFINITY, 0usize);
    for _ in 0..3 {
        let t = Instant::now();
        bytes = 0;
        for f in &files {
            let mut file = std::fs::File::open(f)?;
            loop {
                let n = file.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                bytes += n;
            }
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(bytes as f64 / best / 1e9)
}

/// Times [`FRESH_RUNS`] fresh `exe load` processes on one rank of `dir` (their own JSON
/// timings) and keeps the fastest, next to the first-touch rate of as much fresh memory.
fn fresh_load(exe: &Path, dir: &Path, tp: usize, rank: usize, read_gb_per_s: f64) -> anyhow::Result<FreshLoad> {
    let mut runs = Vec::with_capacity(FRESH_RUNS);
    for _ in 0..FRESH_RUNS {
        runs.push(fresh_process(exe, dir, tp, rank)?);
    }
    let loads_s: Vec<f64> = runs.iter().map(|r| r.load_s).collect();
    let FreshRun { load_s, round_trip_s, source_bytes, kernel_bytes } =
        runs.into_iter().min_by(|a, b| a.load_s.total_cmp(&b.load_s)).context("no fresh process ran")?;
    let load_gb_per_s = source_bytes as f64 / load_s / 1e9;
    Ok(FreshLoad {
        source_bytes,
        load_s,
        loads_s,
        load_gb_per_s,
        round_trip_s,
        read_gb_per_s,
        load_to_read: load_gb_per_s / read_gb_per_s,
        round_trip_to_load: round_trip_s / load_s,
        kernel_bytes,
        first_touch_gb_per_s: first_touch_rate(kernel_bytes),
    })
}

/// What one fresh `exe load` process reported.
struct FreshRun {
    load_s: f64,
    round_trip_s: f64,
    source_bytes: usize,
    kernel_bytes: usize,
}

/// One fresh `exe load` process on one rank of `dir`.
fn fresh_process(exe: &Path, dir: &Path, tp: usize, rank: usize) -> anyhow::Result<FreshRun> {
    let out = std::process::Command::new(exe)
        .args(["load", "--brief", "--json", "--tp", &tp.to_string(), "--rank", &rank.to_string(), "--checkpoint"])
        .arg(dir)
        .output()?;
    anyhow::ensure!(out.status.success(), "{} load failed: {}", exe.display(), String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let rank = &doc["ranks"][0];
    let field = |v: &serde_json::Value, name: &str| v.as_f64().ok_or_else(|| anyhow::anyhow!("load --json has no {name}"));
    let bytes = |name: &str| rank[name].as_u64().ok_or_else(|| anyhow::anyhow!("load --json has no {name}"));
    Ok(FreshRun {
        load_s: field(&rank["timings"]["load_wall_s"], "timings.load_wall_s")?,
        round_trip_s: field(&rank["timings"]["round_trip_s"], "timings.round_trip_s")?,
        source_bytes: bytes("source_bytes")? as usize,
        kernel_bytes: bytes("kernel_bytes")? as usize,
    })
}

/// Runs the benchmark.
pub fn run(opts: &BenchOptions) -> anyhow::Result<BenchReport> {
    // The same buffers time the copy at the start and the copies between the reloads.
    let mut memcpy = Memcpy::new(512 << 20);
    let (one, all) = memcpy.bandwidth(5);
    let mut paths = Vec::new();
    let cases =
        [(WeightFormat::Fp8 { block: opts.preset.fp8_block() }, ScaleRule::Rceil, 0.5), (WeightFormat::Bf16, ScaleRule::Rceil, 0.35)];
    for (format, rule, goal) in cases {
        if !opts.formats.iter().any(|f| f == format.name()) {
            continue;
        }
        let dir = opts.dir.join(format!("{}-{}x{}", opts.preset.name(), format.name(), opts.layers));
        synth(&dir, opts.preset, opts.layers, format)?;
        // A fresh process first, then the warm reloads in this one.
        let fresh = match &opts.worker_exe {
            Some(exe) => Some(fresh_load(exe, &dir, opts.tp_size, opts.rank, page_cache_read_rate(&dir)?)?),
            None => None,
        };
        let source = LoadSource::open_checkpoint(&dir)?;
        let backend = CpuBackend;
        let loader = RankLoader::new(&backend, source.config(), opts.tp_size, opts.rank, rule)?;
        // Warm the page cache and the buffers once.
        let mut weights = loader.load(&source)?;
        let bytes = weights.source_bytes();
        // Each reload next to a memcpy on the same threads, the best of each: this VM's memory
        // bandwidth drifts by 2x within a minute, so a memcpy timed once at the start is not the
        // yardstick of reloads timed later.
        let (mut best, mut best_memcpy) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..opts.iters.max(1) {
            best_memcpy = best_memcpy.min(memcpy.all_threads());
            let t = Instant::now();
            weights = loader.reload(weights, &source)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let gbps = bytes as f64 / best / 1e9;
        let memcpy_gbps = memcpy.gb_per_s(best_memcpy);
        paths.push(PathResult {
            format: format.name().to_string(),
            scale_rule: rule.name().to_string(),
            source_bytes: bytes,
            best_s: best,
            gb_per_s: gbps,
            memcpy_gb_per_s: memcpy_gbps,
            ratio_to_memcpy: gbps / memcpy_gbps,
            goal,
            fresh,
        });
    }
    Ok(BenchReport { threads: rayon::current_num_threads(), memcpy_1t_gb_per_s: one, memcpy_gb_per_s: all, paths })
}

impl BenchReport {
    pub fn render(&self, opts: &BenchOptions) -> String {
        let mut s = format!(
            "load pipeline (warm reloads), {} x {} layers, TP {} rank {}, {} threads\nmemcpy: {:.2} GB/s on {} threads ({:.2} GB/s on one)\n",
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
                "{:<5} ({}): {:>8.1} MB in {:.4} s = {:.2} GB/s = {:.2}x memcpy timed between the reloads ({:.2} GB/s) (goal {:.2}x) {}\n",
                p.format,
                p.scale_rule,
                p.source_bytes as f64 / 1e6,
                p.best_s,
                p.gb_per_s,
                p.ratio_to_memcpy,
                p.memcpy_gb_per_s,
                p.goal,
                if p.ratio_to_memcpy >= p.goal { "met" } else { "NOT met" }
            ));
            if let Some(f) = &p.fresh {
                let met = |ok: bool| if ok { "met" } else { "NOT met" };
                let loads: Vec<String> = f.loads_s.iter().map(|l| format!("{l:.3}")).collect();
                s.push_str(&format!(
                    "      fresh process: load {:.3} s (best of {} s) = {:.2} GB/s = {:.2}x the page-cache read rate {:.2} GB/s (goal >= 0.5x) {}; \
                     round trip {:.3} s = {:.2}x the load (goal <= 0.5x) {}\n",
                    f.load_s,
                    loads.join(", "),
                    f.load_gb_per_s,
                    f.load_to_read,
                    f.read_gb_per_s,
                    met(f.load_to_read >= 0.5),
                    f.round_trip_s,
                    f.round_trip_to_load,
                    met(f.round_trip_to_load <= 0.5)
                ));
                let touch_s = f.kernel_bytes as f64 / f.first_touch_gb_per_s / 1e9;
                s.push_str(&format!(
                    "      fresh memory faults in at {:.2} GB/s here: the layouts' {:.1} MB take {:.3} s of it ({:.0}% of the load)\n",
                    f.first_touch_gb_per_s,
                    f.kernel_bytes as f64 / 1e6,
                    touch_s,
                    100.0 * touch_s / f.load_s
                ));
            }
        }
        s
    }
}
