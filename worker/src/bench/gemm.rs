//! MXFP8 GEMM throughput on the dsv41-flash TP 4 shapes (`orchestrator-worker bench-gemm`,
//! `cargo bench -p orchestrator-worker --bench gemm`): from memory against the read roof timed
//! next to each GEMM, in cache, against the arithmetic roof and the naive loop; then one probe.

use std::path::Path;
use std::time::Instant;

use orchestrator_kernels::{CpuBackend, ScaleRule};
use orchestrator_model::{Preset, WeightFormat};
use serde::Serialize;

use super::roofs::{ReadRoof, bf16_dot_peak, multiply_add_peak};
use super::synth;
use crate::loader::RankLoader;
use crate::source::LoadSource;

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
            // The GEMMs are called from a thread of the pool they run on, as a probe calls them
            // (`probe::probe_rank_with`).
            for _ in 0..3 {
                read = read.min(reader.once());
                fast = fast.min(crate::background::on_a_pool_thread(|| {
                    time_best(1, || {
                        for w in &views {
                            std::hint::black_box(gemm(&a, w).expect("shapes agree"));
                        }
                    })
                }));
            }
            let fast = fast / copies as f64;
            let roof = reader.gb_per_s(read);
            let in_cache = crate::background::on_a_pool_thread(|| {
                time_best(IN_CACHE_RUNS, || {
                    std::hint::black_box(gemm(&a, &views[0]).expect("shapes agree"));
                })
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
