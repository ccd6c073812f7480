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

/// A buffer larger than the caches and its copy, for timing memcpy.
pub struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Memcpy {
    pub fn new(bytes: usize) -> Self {
        Self { src: (0..bytes).map(|i| (i * 31) as u8).collect(), dst: vec![0u8; bytes] }
    }

    /// Seconds of one copy on all rayon threads (each copies its own part).
    pub fn all_threads(&mut self) -> f64 {
        let part = self.src.len().div_ceil(rayon::current_num_threads().max(1));
        let t = Instant::now();
        self.dst.par_chunks_mut(part).zip(self.src.par_chunks(part)).for_each(|(d, s)| d.copy_from_slice(s));
        std::hint::black_box(&self.dst);
        t.elapsed().as_secs_f64()
    }

    /// Seconds of one copy on this thread.
    fn one_thread(&mut self) -> f64 {
        let t = Instant::now();
        self.dst.copy_from_slice(&self.src);
        std::hint::black_box(&self.dst);
        t.elapsed().as_secs_f64()
    }

    fn gb_per_s(&self, seconds: f64) -> f64 {
        self.src.len() as f64 / seconds / 1e9
    }

    /// Best-of-`iters` bandwidth on one thread and on all rayon threads (each copies its own
    /// part).
    pub fn bandwidth(&mut self, iters: usize) -> (f64, f64) {
        let (mut best_all, mut best_one) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..iters.max(1) {
            best_all = best_all.min(self.all_threads());
            best_one = best_one.min(self.one_thread());
        }
        (self.gb_per_s(best_one), self.gb_per_s(best_all))
    }
}

/// Reading a buffer larger than the caches (summing its words) on all rayon threads: the roof
/// of a kernel that streams its weights once.
pub struct ReadRoof {
    words: Vec<u64>,
}

impl ReadRoof {
    pub fn new(bytes: usize) -> Self {
        Self { words: (0..bytes / 8).map(|i| i as u64 * 0x9E37_79B9).collect() }
    }

    /// Seconds of one read of the whole buffer.
    pub fn once(&self) -> f64 {
        let part = self.words.len().div_ceil(rayon::current_num_threads().max(1));
        let t = Instant::now();
        let sum: u64 = self.words.par_chunks(part).map(|c| c.iter().fold(0u64, |a, &w| a.wrapping_add(w))).sum();
        std::hint::black_box(sum);
        t.elapsed().as_secs_f64()
    }

    pub fn gb_per_s(&self, seconds: f64) -> f64 {
        (self.words.len() * 8) as f64 / seconds / 1e9
    }

    /// Best-of-`iters` bandwidth.
    pub fn bandwidth(&self, iters: usize) -> f64 {
        self.gb_per_s((0..iters.max(1)).map(|_| self.once()).fold(f64::INFINITY, f64::min))
    }
}

/// Best-of-3 rate of f32 multiply-adds, vector lanes per second summed over all rayon threads
/// running at once (so two hardware threads of one core count as the one core they are): the
/// arithmetic roof of a GEMM bound to the plain loop's bits, where each output adds one rounded
/// product per weight in `k` order, so that `T` activation rows cost `T` multiply-adds per
/// weight. `None` where it is not measured (no AVX-512 F, no AVX2 with FMA).
pub fn multiply_add_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let lanes = peak::lanes()?;
        Some(best_rate(|iters| peak::run(lanes, iters), lanes))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// The same for `vdpbf16ps`, which does two of those multiply-adds per f32 lane in one
/// instruction (each rounded, in order: the plain loop's bits): the arithmetic roof where the
/// GEMM takes its BF16 dot-product path ([`orchestrator_kernels::gemm::uses_bf16_dot`]), in
/// multiply-adds per second. `None` where that path is not taken.
pub fn bf16_dot_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if !orchestrator_kernels::gemm::uses_bf16_dot(1) {
            return None;
        }
        // SAFETY: the dot path runs only where the CPU has AVX-512 F and BF16.
        Some(best_rate(|iters| unsafe { peak::run_bf16(iters) }, 32))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Best of 3: multiply-adds per second of `run` (`per_op` per instruction, `peak::ACCUMULATORS`
/// chains) on every rayon thread at once.
#[cfg(target_arch = "x86_64")]
fn best_rate(run: impl Fn(usize) -> f32 + Sync, per_op: usize) -> f64 {
    const ITERS: usize = 1 << 21;
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let sums = rayon::broadcast(|_| run(ITERS));
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(sums);
        best = best.max((rayon::current_num_threads() * ITERS * peak::ACCUMULATORS * per_op) as f64 / s);
    }
    best
}

#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;

    /// Independent chains, enough to cover the latency of two pipes.
    pub const ACCUMULATORS: usize = 16;

    pub fn lanes() -> Option<usize> {
        if is_x86_feature_detected!("avx512f") {
            Some(16)
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            Some(8)
        } else {
            None
        }
    }

    /// The chains on the vectors `lanes` chose (16 or 8 lanes).
    pub fn run(lanes: usize, iters: usize) -> f32 {
        // SAFETY: `lanes` returned 16 only where AVX-512 F is, 8 only where AVX2 and FMA are.
        unsafe { if lanes == 16 { run512(iters) } else { run256(iters) } }
    }

    /// `ACCUMULATORS` independent chains of `iters` multiply-adds each, in whatever vector
    /// type the caller's instructions take.
    #[inline(always)]
    fn chains<V: Copy>(iters: usize, one: V, fma: impl Fn(V) -> V) -> [V; ACCUMULATORS] {
        let mut acc = [one; ACCUMULATORS];
        for _ in 0..iters {
            for a in &mut acc {
                *a = fma(*a);
            }
        }
        acc
    }

    /// `ACCUMULATORS` chains of `iters` `vdpbf16ps` each.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn run_bf16(iters: usize) -> f32 {
        // SAFETY: the same size and bits; 32 BF16 lanes of 0.5 and of 1e-7's top half.
        let (x, y): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x3F00)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x33D6)),
            )
        };
        let acc = chains(iters, _mm512_set1_ps(1.0), |a| _mm512_dpbf16_ps(a, x, y));
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }

    #[target_feature(enable = "avx512f")]
    fn run512(iters: usize) -> f32 {
        let (x, y) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let acc = chains(iters, _mm512_set1_ps(1.0), |a| _mm512_fmadd_ps(a, x, y));
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    fn run256(iters: usize) -> f32 {
        let (x, y) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let acc = chains(iters, _mm256_set1_ps(1.0), |a| _mm256_fmadd_ps(a, x, y));
        let mut lanes = [0f32; 8];
        acc.iter().fold(0.0, |sum, &a| {
            // SAFETY: eight lanes of four bytes.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
            sum + lanes.iter().sum::<f32>()
        })
    }
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

/// One GEMM shape's figures.
#[derive(Clone, Debug, Serialize)]
pub struct GemmResult {
    pub name: String,
    pub tokens: usize,
    pub n: usize,
    pub k: usize,
    pub gflops: f64,
    pub naive_gflops: f64,
    /// E4M3 weight bytes (plus scales) read per second.
    pub weight_gb_per_s: f64,
    /// The read roof timed next to this GEMM (the best of the reads interleaved with its runs).
    pub read_roof_gb_per_s: f64,
    /// `weight_gb_per_s` over `read_roof_gb_per_s`.
    pub fraction_of_roof: f64,
    /// The same GEMM on one copy of its weight, run again and again: the kernel's own rate,
    /// which no memory system lifts it above, where the weight (10.5 MB at most) fits the
    /// last-level cache (32 MiB on the Zen 5 VM; on a smaller one the figure is partly memory's).
    pub in_cache_gb_per_s: f64,
    /// The weight bytes per second at which `T` multiply-adds per weight take the measured
    /// peak of the instructions this `T` runs on ([`bf16_dot_peak`] where the GEMM takes its BF16
    /// dot-product path, else [`multiply_add_peak`]); none where the peak is not measured.
    pub arithmetic_roof_gb_per_s: Option<f64>,
}

/// GEMM and probe figures.
#[derive(Clone, Debug, Serialize)]
pub struct GemmReport {
    pub threads: usize,
    /// Streaming read bandwidth of this machine at the start of the run (each GEMM is divided
    /// by its own, timed next to it).
    pub read_roof_gb_per_s: f64,
    /// f32 multiply-add lanes per second on all threads at once, same run.
    pub multiply_add_peak_per_s: Option<f64>,
    /// `vdpbf16ps` multiply-adds per second on all threads at once, same run (where the GEMM
    /// takes that path).
    pub bf16_dot_peak_per_s: Option<f64>,
    pub gemms: Vec<GemmResult>,
    /// Per rank of TP 4 on one dsv41-flash layer, T = 16, S = 128: the kernel-layout pass and
    /// the plain reference.
    pub probe_kernel_s: f64,
    pub probe_reference_s: f64,
}

/// Runs of a GEMM on one copy of its weight, the first of which brings it into the cache.
const IN_CACHE_RUNS: usize = 8;

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
/// triple loop (on a slice of the rows, scaled) and the read roof over the weight bytes; then
/// one probe per rank. Each GEMM cycles through copies of its weight that together exceed the
/// last-level cache, as a probe over every layer does, so the weights come from memory. Each
/// run of a GEMM follows a read of the roof's buffer on the same threads and is divided by the
/// best of those reads: this VM's memory bandwidth moves by up to 1.6x within a minute, so a
/// roof timed once at the start is not the yardstick of GEMMs timed later.
pub fn run_gemm(tokens: &[usize], dir: &Path) -> anyhow::Result<GemmReport> {
    use orchestrator_kernels::gemm::{MxMatrix, ScaleView, WeightView, gemm, gemm_reference};
    use orchestrator_model::Generator;

    let reader = ReadRoof::new(512 << 20);
    let roof = reader.bandwidth(5);
    let peak = multiply_add_peak();
    let dot_peak = bf16_dot_peak();
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
        let weight_bytes = elements.len() + scales.len();
        let copies = (256usize << 20).div_ceil(weight_bytes);
        let stored: Vec<(Vec<u8>, Vec<u8>)> = (0..copies).map(|_| (elements.clone(), scales.clone())).collect();
        let views: Vec<WeightView<'_>> =
            stored.iter().map(|(e, s)| WeightView { elements: e, n, k, scales: ScaleView::RowMajor(s) }).collect();
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
            let (mut fast, mut read) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..3 {
                read = read.min(reader.once());
                fast = fast.min(time_best(1, || {
                    for w in &views {
                        std::hint::black_box(gemm(&a, w).expect("shapes agree"));
                    }
                }));
            }
            let fast = fast / copies as f64;
            let roof = reader.gb_per_s(read);
            let in_cache = time_best(IN_CACHE_RUNS, || {
                std::hint::black_box(gemm(&a, &views[0]).expect("shapes agree"));
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
                weight_gb_per_s: weight_bytes as f64 / fast / 1e9,
                read_roof_gb_per_s: roof,
                fraction_of_roof: weight_bytes as f64 / fast / 1e9 / roof,
                in_cache_gb_per_s: weight_bytes as f64 / in_cache / 1e9,
                arithmetic_roof_gb_per_s: (if orchestrator_kernels::gemm::uses_bf16_dot(t) { dot_peak.or(peak) } else { peak })
                    .map(|p| p / t as f64 * (weight_bytes as f64 / (n * k) as f64) / 1e9),
            });
        }
    }
    // One probe per rank (T = 16, S = 128) on one dsv41-flash layer at TP 4, from a checkpoint
    // in the page cache (the reference re-reads its checkpoint-order slices from it, as a
    // serving rank's does).
    let ckpt = dir.join(format!("{}-fp8x1", Preset::Dsv41Flash.name()));
    synth(&ckpt, Preset::Dsv41Flash, 1, WeightFormat::Fp8 { block: Preset::Dsv41Flash.fp8_block() })?;
    let source = LoadSource::open_checkpoint(&ckpt)?;
    let backend = CpuBackend;
    let loader = RankLoader::new(&backend, source.config(), 4, 0, ScaleRule::Rceil)?;
    let weights = loader.load(&source)?;
    let spec = crate::probe::ProbeSpec { tokens: 16, latents: 128, seed: 0 };
    let p = crate::probe::probe_rank(&loader, &weights, &source, spec, ScaleRule::Rceil)?;
    anyhow::ensure!(p.ok, "the benchmark probe failed its own check: {p:?}");
    Ok(GemmReport {
        threads: rayon::current_num_threads(),
        read_roof_gb_per_s: roof,
        multiply_add_peak_per_s: peak,
        bf16_dot_peak_per_s: dot_peak,
        gemms,
        probe_kernel_s: p.kernel_s,
        probe_reference_s: p.reference_s,
    })
}

impl GemmReport {
    pub fn render(&self) -> String {
        let mut peak = self.multiply_add_peak_per_s.map_or(String::new(), |p| {
            format!(", f32 multiply-add peak {:.1} G lanes/s on all threads at once (the arithmetic roof: T per weight)", p / 1e9)
        });
        if let Some(d) = self.bf16_dot_peak_per_s {
            peak.push_str(&format!(", vdpbf16ps {:.1} G multiply-adds/s (the roof where T takes the BF16 dot-product path)", d / 1e9));
        }
        let mut s = format!(
            "MXFP8 GEMM, dsv41-flash TP 4 shapes, {} threads, weights from memory; read roof {:.1} GB/s at the start, each GEMM divided by its own (timed next to it){peak}; in cache: the same GEMM again and again on one copy of its weight, the kernel's own rate (same run)\n",
            self.threads, self.read_roof_gb_per_s
        );
        for g in &self.gemms {
            let arithmetic =
                g.arithmetic_roof_gb_per_s.map_or(String::new(), |a| format!(", {:.2}x arithmetic roof", g.weight_gb_per_s / a));
            let goal = if g.tokens <= 16 {
                let needs = 0.5 * g.read_roof_gb_per_s;
                let met = g.fraction_of_roof >= 0.5;
                let beyond = match g.arithmetic_roof_gb_per_s {
                    Some(a) if a < needs => {
                        format!(", beyond this machine: 0.5x the read roof is {needs:.1} GB/s, the arithmetic roof {a:.1} GB/s")
                    }
                    // Short of it: whether the kernel's own rate or the memory system is.
                    _ if !met && g.in_cache_gb_per_s < needs => format!(", held by the kernel: below {needs:.1} GB/s even in cache"),
                    _ if !met => format!(", held by the memory system: in cache it reaches {needs:.1} GB/s"),
                    _ => String::new(),
                };
                format!(" (goal >= 0.5x at T <= 16: {}{beyond})", if met { "met" } else { "NOT met" })
            } else {
                String::new()
            };
            s.push_str(&format!(
                "{:<8} T={:<4} N={:<5} K={:<5} {:>7.2} GFLOP/s, weights at {:>5.2} GB/s = {:.2}x read roof ({:.1} GB/s){arithmetic}{goal}; \
                 in cache {:.2} GB/s (from memory {:.2}x that); naive loop {:.0}x slower\n",
                g.name,
                g.tokens,
                g.n,
                g.k,
                g.gflops,
                g.weight_gb_per_s,
                g.fraction_of_roof,
                g.read_roof_gb_per_s,
                g.in_cache_gb_per_s,
                g.weight_gb_per_s / g.in_cache_gb_per_s,
                g.gflops / g.naive_gflops
            ));
        }
        s.push_str(&format!(
            "probe T=16 S=128, one dsv41-flash layer (checkpoint in the page cache), TP 4 rank 0: kernel-layout pass {:.3} s, plain reference {:.3} s ({:.1}x; goal <= 3x)\n",
            self.probe_kernel_s,
            self.probe_reference_s,
            self.probe_reference_s / self.probe_kernel_s
        ));
        s
    }
}
