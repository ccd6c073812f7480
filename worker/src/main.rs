//! `orchestrator-worker`: one rank's loader.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use orchestrator_kernels::{Backend, CpuBackend, ScaleRule};
use orchestrator_ops::output::emit;
use orchestrator_worker::bench::{self, BenchOptions};
use orchestrator_worker::cli::DummyArgs;
use orchestrator_worker::{LoadSource, RankReport, load_and_report};

/// Large buffers in huge pages (see the module): a fresh worker faults its weights in 2 MiB at a time.
#[global_allocator]
static ALLOC: orchestrator_worker::alloc::HugePageAlloc = orchestrator_worker::alloc::HugePageAlloc;

#[derive(Parser)]
#[command(name = "orchestrator-worker", version, about = "Loads DeepSeek-V4.1 attention shards into mega-attention kernel layouts")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log events (stderr, filtered by RUST_LOG) as text or as JSON, one event per line.
    #[arg(long, global = true, value_enum, default_value_t, env = "ORCHESTRATOR_LOG_FORMAT")]
    log_format: orchestrator_ops::logging::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Load one rank (or every rank) of a TP group and report digests, layout identity and
    /// the round-trip verdict.
    Load(LoadArgs),
    /// Pipeline throughput as a ratio to memcpy bandwidth measured in the same run.
    Bench(BenchArgs),
    /// MXFP8 GEMM GFLOP/s on the dsv41-flash TP 4 shapes next to a naive loop and the peak,
    /// and the time of one probe.
    BenchGemm(BenchGemmArgs),
    /// GPU benchmarks (builds with `--features cuda`): H2D GB/s against the pinned-copy
    /// bandwidth, layout kernels against a device-to-device copy, MXFP8 GEMM TFLOP/s.
    BenchCuda(BenchCudaArgs),
    /// Serve the Worker gRPC service (started by `orchestrator launch`, one per rank).
    Serve(orchestrator_worker::cli::ServeArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Device {
    Cpu,
    Cuda,
}

#[derive(Args)]
struct LoadArgs {
    /// Hugging Face checkpoint directory (config.json, index, shards).
    #[arg(long, conflicts_with = "dummy", required_unless_present = "dummy")]
    checkpoint: Option<PathBuf>,
    #[command(flatten)]
    dummy: DummyArgs,
    /// Tensor-parallel size.
    #[arg(long)]
    tp: usize,
    /// Load only this rank (default: every rank, one after another).
    #[arg(long)]
    rank: Option<usize>,
    /// MXFP8 scale rule for quantizing BF16 weights.
    #[arg(long, default_value = "rceil")]
    scale_rule: ScaleRule,
    /// Write OUT/rank{R}.safetensors with every kernel-visible tensor.
    #[arg(long, value_name = "OUT")]
    dump: Option<PathBuf>,
    /// Print one JSON document instead of text.
    #[arg(long)]
    json: bool,
    /// Run probes after loading: T tokens, S latents, input seed (default 0). Every rank runs
    /// the mega-attention forward pass on its kernel tensors and checks it against the
    /// checkpoint-order reference; in the all-ranks mode the partial outputs are summed.
    #[arg(long, value_name = "T,S[,SEED]")]
    probe: Option<orchestrator_worker::probe::ProbeSpec>,
    /// Leave the per-tensor digests out of the text report.
    #[arg(long)]
    brief: bool,
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
}

#[derive(Args)]
struct BenchArgs {
    #[arg(long, default_value = "dsv41-flash")]
    preset: String,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 1)]
    tp: usize,
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// Warm reloads per format, each next to a memcpy (the best of each is kept).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Storage formats to measure.
    #[arg(long, value_delimiter = ',', default_value = "fp8,bf16")]
    formats: Vec<String>,
    /// Where the benchmark checkpoints are synthesized (kept for later runs).
    #[arg(long, default_value = "target/bench-ckpt")]
    dir: PathBuf,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchGemmArgs {
    /// Token counts (GEMM M).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,128")]
    tokens: Vec<usize>,
    /// Where the probe's one-layer checkpoint is synthesized (kept for later runs).
    #[arg(long, default_value = "target/bench-ckpt")]
    dir: PathBuf,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchCudaArgs {
    /// Timed iterations per figure.
    #[arg(long, default_value_t = 10)]
    iters: usize,
}

fn bench_cuda(args: &BenchCudaArgs) -> anyhow::Result<bool> {
    if !orchestrator_kernels::cuda::BUILT_IN {
        bail!("bench-cuda: this binary was built without the `cuda` feature (rebuild with `--features cuda`)")
    }
    let backend = orchestrator_kernels::cuda::CudaBackend::new(0)?;
    let figures = orchestrator_kernels::cuda::bench::run(&backend, args.iters)?;
    emit(&orchestrator_kernels::cuda::bench::render(&format!("{} ({})", backend.device_name(), backend.name()), &figures));
    Ok(true)
}

fn source_of(args: &LoadArgs) -> anyhow::Result<LoadSource> {
    if let Some(dir) = &args.checkpoint {
        return LoadSource::open_checkpoint(dir).with_context(|| format!("opening checkpoint {}", dir.display()));
    }
    Ok(args.dummy.source()?)
}

/// Fails early, with one clear error, when `--device cuda` cannot work in this process.
fn check_device(device: Device) -> anyhow::Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda if !orchestrator_kernels::cuda::BUILT_IN => {
            bail!("--device cuda: this binary was built without the `cuda` feature (rebuild with `--features cuda`)")
        }
        Device::Cuda => Ok(orchestrator_kernels::cuda::CudaLibraries::probe().require_all()?),
    }
}

fn load(args: LoadArgs) -> anyhow::Result<bool> {
    check_device(args.device)?;
    let source = source_of(&args)?;
    let geometry = &source.config().geometry;
    orchestrator_model::plan::validate_tp(geometry, args.tp)?;
    match args.device {
        Device::Cpu => load_on(&CpuBackend, &args, &source),
        // Refused by `check_device` above in a build without the `cuda` feature.
        Device::Cuda => {
            // One OS thread opens the GPU (device 0 of what `CUDA_VISIBLE_DEVICES` leaves visible),
            // owns its context and stream, and drives the whole load from there.
            std::thread::scope(|s| {
                s.spawn(|| {
                    let backend = orchestrator_kernels::cuda::CudaBackend::new(0)?;
                    load_on(&backend, &args, &source)
                })
                .join()
                .map_err(|_| anyhow::anyhow!("the CUDA thread panicked"))?
            })
        }
    }
}

fn load_on<B: Backend + Sync>(backend: &B, args: &LoadArgs, source: &LoadSource) -> anyhow::Result<bool>
where
    B::Buffer: Sync,
{
    let ranks: Vec<usize> = match args.rank {
        Some(r) => vec![r],
        None => (0..args.tp).collect(),
    };
    let mut reports: Vec<RankReport> = Vec::new();
    for r in ranks {
        let report = load_and_report(backend, source, args.tp, r, args.scale_rule, args.dump.as_deref(), args.probe)
            .with_context(|| format!("rank {r} of TP {} on {}", args.tp, backend.name()))?;
        if !args.json {
            emit(&report.render(!args.brief));
        }
        reports.push(report);
    }
    let ok = reports.iter().all(RankReport::ok);
    // All ranks of the group: y = the partials summed in rank order.
    let partials: Vec<&[f32]> = reports.iter().filter_map(|r| r.probe.as_ref().map(|p| p.y_partial.as_slice())).collect();
    let y_digest = (args.rank.is_none() && partials.len() == args.tp && !partials.is_empty())
        .then(|| orchestrator_kernels::Digest::of_f32(&orchestrator_worker::probe::sum_partials(&partials)).hex());
    if let (Some(d), false) = (&y_digest, args.json) {
        emit(&format!("y (sum of {} partials in rank order) digest {d}\n", partials.len()));
    }
    if args.json {
        let doc = serde_json::json!({ "ok": ok, "tp_size": args.tp, "y_digest": y_digest, "ranks": reports });
        emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
    } else {
        emit(if ok {
            if args.probe.is_some() { "all ranks: round trip ok, probes pass\n" } else { "all ranks: round trip ok\n" }
        } else {
            "FAILED: a round trip or a probe did not match (see above)\n"
        });
    }
    Ok(ok)
}

fn main() -> ExitCode {
    // A refusal keeps glibc's defaults (correct, only slower).
    let _ = orchestrator_worker::alloc::tune_system_allocator();
    let cli = Cli::parse();
    orchestrator_ops::logging::init(cli.log_format);
    let result = match cli.command {
        Command::Load(args) => load(args),
        Command::Serve(args) => args.run().map(|()| true),
        Command::BenchCuda(args) => bench_cuda(&args),
        Command::BenchGemm(args) => (|| {
            let report = bench::run_gemm(&args.tokens, &args.dir)?;
            if args.json {
                emit(&format!("{}\n", serde_json::to_string_pretty(&report)?));
            } else {
                emit(&report.render());
            }
            Ok(true)
        })(),
        Command::Bench(args) => (|| {
            let opts = BenchOptions {
                preset: args.preset.parse()?,
                layers: args.layers,
                tp_size: args.tp,
                rank: args.rank,
                iters: args.iters,
                dir: args.dir.clone(),
                formats: args.formats.clone(),
                worker_exe: std::env::current_exe().ok(),
            };
            let report = bench::run(&opts)?;
            if args.json {
                emit(&format!("{}\n", serde_json::to_string_pretty(&report)?));
            } else {
                emit(&report.render(&opts));
            }
            Ok(true)
        })(),
    };
    orchestrator_ops::output::exit_code(result)
}
