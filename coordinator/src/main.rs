//! `orchestrator`: the coordinator CLI: launch a cluster of workers and check it, report on
//! a served cluster, shut it down, and synthesize or inspect checkpoints.

mod cli;
mod cluster;
mod consistency;
mod journal;
mod launch;
mod metrics;
mod recover;
mod registry;
mod rollout;
mod rotation;
mod schemas;
mod server;
mod service;
mod session;
mod update;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use orchestrator_model::inspect::inspect;
use orchestrator_model::synth::{DEFAULT_MAX_SHARD_BYTES, SynthOptions, write_checkpoint};
use orchestrator_model::{Checkpoint, ModelConfig, Preset};
use orchestrator_net::tls::{describe_first_call, describe_status};
use orchestrator_worker::output::emit;

#[derive(Parser)]
#[command(
    name = "orchestrator",
    version,
    about = "Loads DeepSeek-V4.1 mega-attention weights across ranks and proves every rank holds what its kernels expect"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log events (stderr, filtered by RUST_LOG) as text or as JSON, one event per line.
    #[arg(long, global = true, value_enum, default_value_t, env = "ORCHESTRATOR_LOG_FORMAT")]
    log_format: orchestrator_worker::logging::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Start a coordinator and one worker process per rank, load, probe, and print the
    /// consistency report (exit code 0 only when every check agrees).
    Launch(cli::launch::LaunchArgs),
    /// The coordinator alone: wait for the TP x DP workers that Slurm, Kubernetes or a user
    /// start (`orchestrator-worker serve --coordinator URL --rank auto`) to register, then
    /// assign, load, probe and report as `launch` does (and with --serve, keep serving).
    Coordinator(cli::launch::CoordinatorArgs),
    /// Re-run the checks of a `launch --serve` cluster.
    Report(RemoteArgs),
    /// Stop a `launch --serve` cluster.
    Shutdown(RemoteArgs),
    /// Roll a new checkpoint (same geometry) across a `--serve` cluster, one replica at a time,
    /// each verified before an all-ranks swap.
    Update(UpdateArgs),
    /// A bounded probe load through the coordinator's rotation: counts per replica and version,
    /// latency percentiles.
    Probe(ProbeLoadArgs),
    /// Restart a coordinator that died from its `--state-dir`: adopt the running workers,
    /// finish (or `--rollback`) the update it left in flight, report, and serve.
    Recover(RecoverArgs),
    /// A server's grpc.health.v1 status (coordinator or worker; no token needed): exit code 0
    /// only when SERVING, i.e. ready on verified weights (a container healthcheck, a script).
    Health(HealthArgs),
    /// Benchmarks that run a served cluster as a user would.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Checkpoint tools.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Check dumped ranks of any engine (`rank{R}.safetensors` with the kernel tensors under
    /// their parameter names) against a manifest; a tensor that differs is named with its most
    /// likely cause (permutation skipped or doubled, scales not swizzled or packed, the other
    /// scale rule, another rank's shard). Exit code 0 only when every tensor matches.
    VerifyDump(cli::manifest::VerifyDumpArgs),
    /// The JSON Schema of a `--json` document (report, update, probe, manifest, verify-dump), or
    /// with --out every schema written into DIR.
    Schema(SchemaArgs),
    /// TLS for clusters that listen beyond loopback.
    #[command(subcommand)]
    Tls(TlsCommand),
    /// The worker server, built in (the launcher uses it when `orchestrator-worker` is not
    /// installed next to this binary).
    #[command(hide = true)]
    WorkerServe(orchestrator_worker::cli::ServeArgs),
}

#[derive(Subcommand)]
enum TlsCommand {
    /// Write a new cluster CA and node certificate (`ca.pem`, `ca.key`, `node.pem`, `node.key`)
    /// for `--tls-dir`.
    Generate {
        #[arg(long)]
        out: PathBuf,
        /// Another host name or IP address the node certificate names (repeatable).
        #[arg(long, value_name = "NAME")]
        name: Vec<String>,
    },
}

#[derive(Args)]
struct RecoverArgs {
    /// The state directory the dead coordinator journaled to.
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Return every replica to the version before the interrupted update instead of finishing it.
    #[arg(long)]
    rollback: bool,
    /// Print the report as one JSON document.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct UpdateArgs {
    #[command(flatten)]
    remote: RemoteArgs,
    /// The new checkpoint directory (must lie under the workers' allowed roots).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Replicas updated at once (never all of them while more than one exists).
    #[arg(long, default_value_t = 1)]
    max_unavailable: u32,
    /// Replicas staging at once (default: every replica). Each stages beside the weights it
    /// serves, so each rank holds two versions while it stages: on one host whose ranks share
    /// its memory, this bounds how many do at a time.
    #[arg(long)]
    max_staging: Option<u32>,
}

#[derive(Args)]
struct ProbeLoadArgs {
    #[command(flatten)]
    remote: RemoteArgs,
    /// Probes per second.
    #[arg(long)]
    rate: f64,
    /// Seconds to run.
    #[arg(long)]
    duration: f64,
    /// Probe size: T tokens, S latents, seed.
    #[arg(long, value_name = "T,S[,SEED]", default_value_t = orchestrator_worker::probe::ProbeSpec::SERVING)]
    size: orchestrator_worker::probe::ProbeSpec,
}

#[derive(Args)]
struct RemoteArgs {
    /// The coordinator, e.g. http://127.0.0.1:50051.
    #[arg(long)]
    coordinator: String,
    /// The cluster's token file (printed by `launch --serve`).
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    #[arg(long)]
    json: bool,
    /// Report without re-running the probes.
    #[arg(long)]
    no_probe: bool,
    /// The cluster's TLS directory (its `ca.pem`), for an `https://` coordinator.
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<PathBuf>,
}

#[derive(Args)]
struct HealthArgs {
    /// The server, e.g. http://10.0.0.5:50051 (https:// with --tls-dir).
    #[arg(long)]
    address: String,
    /// The health service to ask for: "" (readiness: serving verified weights) or `liveness`.
    #[arg(long, default_value = "")]
    service: String,
    /// The cluster's TLS directory (its `ca.pem`), for an `https://` server.
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<PathBuf>,
    /// Keep asking for up to SECS until the answer is SERVING.
    #[arg(long, value_name = "SECS", default_value_t = 0.0)]
    wait: f64,
}

fn health_cmd(a: HealthArgs) -> anyhow::Result<bool> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let wait = std::time::Duration::try_from_secs_f64(a.wait).map_err(|e| anyhow::anyhow!("--wait {}: {e}", a.wait))?;
    let tls = a.tls_dir.as_deref().map(orchestrator_net::tls::TlsFiles::load_client).transpose()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let start = std::time::Instant::now();
        loop {
            let answer = async {
                let channel = orchestrator_net::tls::connect(&a.address, tls.as_ref()).await?;
                let mut req = tonic::Request::new(HealthCheckRequest { service: a.service.clone() });
                req.set_timeout(std::time::Duration::from_secs(5));
                let r = HealthClient::new(channel).check(req).await.map_err(|s| anyhow::anyhow!("{}", describe_status(&s)))?;
                anyhow::Ok(r.into_inner().status())
            }
            .await;
            let serving = matches!(answer, Ok(ServingStatus::Serving));
            if serving || start.elapsed() >= wait {
                let what = match &answer {
                    Ok(s) => s.as_str_name().to_string(),
                    Err(e) => format!("UNREACHABLE ({e:#})"),
                };
                emit(&format!("{what}\n"));
                return Ok(serving);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
}

#[derive(Subcommand)]
enum BenchCommand {
    /// A rolling update of a served TP x DP cluster under a probe load at half its capacity:
    /// update / load, probe latency before and during, failed probes.
    Update(cli::bench::BenchUpdateArgs),
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Write a synthetic Hugging Face checkpoint (config.json, index, safetensors shards).
    Synth(SynthArgs),
    /// Print geometry, tensors and sizes, and validate every in-scope tensor.
    Inspect(InspectArgs),
    /// Every TP rank's expected kernel tensors (dtype, shape, XXH3-64), rank digests and layout
    /// identity, computed with the independent golden path, plus each tensor's digests in the
    /// known wrong layouts: what `verify-dump` checks an engine's ranks against.
    Manifest(cli::manifest::ManifestArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Dtype {
    Fp8,
    Bf16,
}

#[derive(Args)]
struct SynthArgs {
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value = "dsv41-flash")]
    preset: String,
    /// Number of layers (default: the preset's).
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long, value_enum, default_value = "fp8")]
    dtype: Dtype,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Largest shard file in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_SHARD_BYTES)]
    max_shard_bytes: usize,
}

#[derive(Args)]
struct SchemaArgs {
    /// report, update, probe, manifest or verify-dump (default: list them).
    name: Option<String>,
    /// Write every schema as DIR/NAME.schema.json.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

fn schema_cmd(a: SchemaArgs) -> anyhow::Result<bool> {
    let all = schemas::all();
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, _, schema) in &all {
            let path = dir.join(format!("{name}.schema.json"));
            std::fs::write(&path, schemas::text(schema)).with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(true);
    }
    match a.name {
        Some(name) => match all.iter().find(|(n, _, _)| *n == name) {
            Some((_, _, schema)) => emit(&schemas::text(schema)),
            None => anyhow::bail!("no schema `{name}`: one of {}", all.iter().map(|(n, _, _)| *n).collect::<Vec<_>>().join(", ")),
        },
        None => emit(&all.iter().map(|(n, by, _)| format!("{n:<12} {by}\n")).collect::<String>()),
    }
    Ok(true)
}

#[derive(Args)]
struct InspectArgs {
    dir: PathBuf,
    #[arg(long)]
    json: bool,
}

/// Appends a formatted line to a String.
macro_rules! outln {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

fn synth(a: SynthArgs) -> anyhow::Result<bool> {
    let preset: Preset = a.preset.parse()?;
    let config = ModelConfig::from_preset(preset, a.layers, matches!(a.dtype, Dtype::Bf16))?;
    let (layers, format) = (config.geometry.layers, config.format);
    let opts = SynthOptions { config, seed: a.seed, max_shard_bytes: a.max_shard_bytes, preset_name: Some(preset.name().to_string()) };
    let t = std::time::Instant::now();
    let s = write_checkpoint(&a.out, &opts).with_context(|| format!("synthesizing into {}", a.out.display()))?;
    emit(&format!(
        "wrote {} ({} {} layers, {}, seed {}): {} tensors, {:.1} MB in {} shard file(s), {:.2} s\n",
        s.dir.display(),
        preset.name(),
        layers,
        format.name(),
        a.seed,
        s.tensors,
        s.total_bytes as f64 / 1e6,
        s.shards.len(),
        t.elapsed().as_secs_f64()
    ));
    Ok(true)
}

fn inspect_cmd(a: InspectArgs) -> anyhow::Result<bool> {
    let ck = Checkpoint::open(&a.dir)?;
    let r = inspect(&ck);
    if a.json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
        return Ok(r.valid);
    }
    let mut out = String::new();
    let g = &r.geometry;
    outln!(out, "checkpoint {}", r.dir);
    outln!(
        out,
        "  family {}  hidden {}  layers {}  heads {} (kv {})  head_dim {}  rope {}  q_lora {}  o_lora {}  o_groups {}",
        r.family,
        g.hidden,
        g.layers,
        g.heads,
        g.kv_heads,
        g.head_dim,
        g.rope_dim,
        g.q_lora_rank,
        g.o_lora_rank,
        g.o_groups
    );
    outln!(out, "  weights: {}  valid TP sizes: {:?}", r.format, r.valid_tp_sizes);
    outln!(
        out,
        "  {} in-scope tensors, {:.1} MB; {} other tensors ignored",
        r.tensors.len(),
        r.in_scope_bytes as f64 / 1e6,
        r.other_tensors
    );
    for t in &r.tensors {
        outln!(
            out,
            "  {:<34} {:<8} {:<14} {:>12}  {:<36} {}",
            t.name,
            t.dtype,
            format!("{:?}", t.shape),
            t.bytes,
            t.file.as_deref().unwrap_or("-"),
            t.status
        );
    }
    if r.valid {
        outln!(out, "valid");
    } else {
        outln!(out, "INVALID: {} problem(s)", r.problems.len());
        for p in &r.problems {
            outln!(out, "  {p}");
        }
    }
    emit(&out);
    Ok(r.valid)
}

/// A channel to the coordinator `a` names (over TLS for `https://`).
async fn remote_channel(a: &RemoteArgs) -> anyhow::Result<tonic::transport::Channel> {
    let tls = a.tls_dir.as_deref().map(orchestrator_net::tls::TlsFiles::load_client).transpose()?;
    Ok(orchestrator_net::tls::connect(&a.coordinator, tls.as_ref()).await?)
}

fn tls_generate(out: PathBuf, names: Vec<String>) -> anyhow::Result<bool> {
    orchestrator_net::tls::generate(&out, &names)?;
    emit(&format!(
        "wrote {}: ca.pem, ca.key, node.pem, node.key (node certificate for {}, localhost, loopback{}{})\n",
        out.display(),
        orchestrator_net::tls::SERVER_NAME,
        if names.is_empty() { "" } else { ", " },
        names.join(", ")
    ));
    Ok(true)
}

fn recover_cmd(a: RecoverArgs) -> anyhow::Result<bool> {
    let dir = a.state_dir.canonicalize().with_context(|| format!("--state-dir {}", a.state_dir.display()))?;
    let how = if a.rollback { recover::Resolve::Rollback } else { recover::Resolve::Finish };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let json = a.json;
    runtime.block_on(recover::recover(&dir, how, |report| {
        if json {
            emit(&format!("{}\n", serde_json::to_string_pretty(report).unwrap_or_default()));
        } else {
            emit(&report.render());
        }
    }))
}

fn remote_cmd(a: RemoteArgs, shutdown: bool) -> anyhow::Result<bool> {
    use orchestrator_proto::v1 as pb;
    let token = a.token_file.as_deref().map(orchestrator_net::auth::Token::read).transpose()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let channel = remote_channel(&a).await?;
        let mut client = pb::coordinator_client::CoordinatorClient::new(channel).max_decoding_message_size(64 << 20);
        if shutdown {
            let req = orchestrator_net::auth::request(pb::ShutdownRequest {}, std::time::Duration::from_secs(10), token.as_ref());
            client.shutdown(req).await.map_err(|s| anyhow::anyhow!("shutdown: {}", describe_first_call(&s, &a.coordinator)))?;
            emit("shutdown requested\n");
            return Ok(true);
        }
        let req = orchestrator_net::auth::request(
            pb::ClusterReportRequest { probe: !a.no_probe },
            std::time::Duration::from_secs(1800),
            token.as_ref(),
        );
        let r = client.report(req).await.map_err(|s| anyhow::anyhow!("report: {}", describe_first_call(&s, &a.coordinator)))?.into_inner();
        emit(&if a.json { format!("{}\n", r.json) } else { r.text });
        Ok(r.ok)
    })
}

async fn coordinator_client(
    a: &RemoteArgs,
) -> anyhow::Result<(
    orchestrator_proto::v1::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
    Option<orchestrator_net::auth::Token>,
)> {
    let token = a.token_file.as_deref().map(orchestrator_net::auth::Token::read).transpose()?;
    let channel = remote_channel(a).await?;
    Ok((orchestrator_proto::v1::coordinator_client::CoordinatorClient::new(channel).max_decoding_message_size(64 << 20), token))
}

fn update_cmd(a: UpdateArgs) -> anyhow::Result<bool> {
    use orchestrator_proto::v1 as pb;
    anyhow::ensure!(a.max_unavailable >= 1, "--max-unavailable must be at least 1");
    anyhow::ensure!(a.max_staging != Some(0), "--max-staging must be at least 1");
    let dir = a.checkpoint.canonicalize().with_context(|| format!("--checkpoint {}", a.checkpoint.display()))?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let (mut client, token) = coordinator_client(&a.remote).await?;
        let req = orchestrator_net::auth::request(
            pb::UpdateRequest {
                checkpoint_dir: dir.display().to_string(),
                max_unavailable: a.max_unavailable,
                max_staging: a.max_staging.unwrap_or(0),
            },
            std::time::Duration::from_secs(3600),
            token.as_ref(),
        );
        // A terminal sees the update run (it answers once, at its end); logs and pipes do not.
        let spinner = (std::io::IsTerminal::is_terminal(&std::io::stderr())
            && orchestrator_worker::logging::current() == orchestrator_worker::logging::LogFormat::Text)
            .then(|| {
                let s = indicatif::ProgressBar::new_spinner().with_message(format!("rolling {} out, one replica at a time", dir.display()));
                s.set_style(
                    indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
                );
                s.enable_steady_tick(std::time::Duration::from_millis(120));
                s
            });
        let r = client.update(req).await;
        if let Some(s) = spinner {
            s.finish_and_clear();
        }
        let r = r
            .map_err(|s| match s.code() {
                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => anyhow::anyhow!(
                    "update: lost the coordinator mid-update ({}): every rank holds the old or the verified new version; if it ran with \
                     --state-dir, `orchestrator recover --state-dir DIR` finishes the update (or rolls it back with --rollback)",
                    describe_status(&s)
                ),
                _ => anyhow::anyhow!("update: {}", describe_first_call(&s, &a.remote.coordinator)),
            })?
            .into_inner();
        emit(&if a.remote.json { format!("{}\n", r.json) } else { r.text });
        Ok(r.ok)
    })
}

fn probe_cmd(a: ProbeLoadArgs) -> anyhow::Result<bool> {
    use cli::load::{ProbeDocument, at_rate};
    anyhow::ensure!(a.rate > 0.0 && a.rate <= 1000.0, "--rate must be in (0, 1000]");
    anyhow::ensure!(a.duration > 0.0 && a.duration <= 86_400.0, "--duration must be in (0, 86400] seconds");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let (client, token) = coordinator_client(&a.remote).await?;
        let start = std::time::Instant::now();
        let samples = at_rate(&client, token.as_ref(), a.size, a.rate, std::time::Duration::from_secs_f64(a.duration)).await;
        let doc = ProbeDocument::of(&samples, start.elapsed().as_secs_f64());
        if a.remote.json {
            emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
        } else {
            let l = &doc.latency_ms;
            let mut t = format!(
                "probes: {} served, {} failed in {:.1} s; latency p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms\n",
                doc.served, doc.failed, doc.seconds, l.p50, l.p90, l.p99
            );
            for (k, v) in &doc.by_replica {
                t.push_str(&format!("  replica {k}: {} served, {} failed\n", v.served, v.failed));
            }
            for (k, v) in &doc.by_version {
                t.push_str(&format!("  version {k}: {} served, {} failed\n", v.served, v.failed));
            }
            for e in &doc.errors {
                t.push_str(&format!("  error: {e}\n"));
            }
            emit(&t);
        }
        Ok(doc.ok)
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    orchestrator_worker::logging::init(cli.log_format);
    let result = match cli.command {
        Command::Launch(a) => cli::launch::launch_cmd(a),
        Command::Coordinator(a) => cli::launch::coordinator_cmd(a),
        Command::Report(a) => remote_cmd(a, false),
        Command::Shutdown(a) => remote_cmd(a, true),
        Command::Update(a) => update_cmd(a),
        Command::Probe(a) => probe_cmd(a),
        Command::Recover(a) => recover_cmd(a),
        Command::Health(a) => health_cmd(a),
        Command::Bench(BenchCommand::Update(a)) => cli::bench::bench_update(a),
        Command::Tls(TlsCommand::Generate { out, name }) => tls_generate(out, name),
        Command::WorkerServe(a) => a.run().map(|()| true),
        Command::Checkpoint(CheckpointCommand::Synth(a)) => synth(a),
        Command::Checkpoint(CheckpointCommand::Inspect(a)) => inspect_cmd(a),
        Command::Checkpoint(CheckpointCommand::Manifest(a)) => cli::manifest::manifest_cmd(a),
        Command::VerifyDump(a) => cli::manifest::verify_dump_cmd(a),
        Command::Schema(a) => schema_cmd(a),
    };
    orchestrator_worker::output::exit_code(result)
}
