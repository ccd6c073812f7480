//! `orchestrator`: the coordinator CLI: launch a cluster of workers and check it, report on
//! a served cluster, shut it down, and synthesize or inspect checkpoints.

mod cluster;
mod consistency;
mod journal;
mod launch;
mod recover;
mod rollout;
mod rotation;
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
use orchestrator_worker::output::emit;
use orchestrator_worker::tls::{describe_first_call, describe_status};

#[derive(Parser)]
#[command(
    name = "orchestrator",
    version,
    about = "Loads DeepSeek-V4.1 mega-attention weights across ranks and proves every rank holds what its kernels expect"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a coordinator and one worker process per rank, load, probe, and print the
    /// consistency report (exit code 0 only when every check agrees).
    Launch(LaunchArgs),
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
    /// Checkpoint tools.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// TLS for clusters that listen beyond loopback.
    #[command(subcommand)]
    Tls(TlsCommand),
    /// The worker server, built in (the launcher uses it when `orchestrator-worker` is not
    /// installed next to this binary).
    #[command(hide = true)]
    WorkerServe(orchestrator_worker::cli::ServeArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Device {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Verify {
    Golden,
}

#[derive(Args)]
struct LaunchArgs {
    /// Tensor-parallel size.
    #[arg(long)]
    tp: u32,
    /// Data-parallel replicas (each a whole TP group).
    #[arg(long, default_value_t = 1)]
    dp: u32,
    /// Hugging Face checkpoint directory (default: a built-in dsv41-flash checkpoint, synthesized once into the cache).
    #[arg(long, conflicts_with = "dummy")]
    checkpoint: Option<PathBuf>,
    /// Every worker generates its weights instead of reading a checkpoint.
    #[command(flatten)]
    dummy: orchestrator_worker::cli::DummyArgs,
    #[arg(long, default_value = "rceil")]
    scale_rule: orchestrator_kernels::ScaleRule,
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Probe every rank: T tokens, S latents, seed.
    #[arg(long, value_name = "T,S[,SEED]", default_value = "4,64")]
    probe: orchestrator_worker::probe::ProbeSpec,
    /// Skip the probes.
    #[arg(long)]
    no_probe: bool,
    /// Also recompute every rank's kernel digests in the coordinator with the plain reference path.
    #[arg(long, value_enum)]
    verify: Option<Verify>,
    /// Debugging: make worker RANK (0..tp*dp, dp-major) reproduce a bug: skip-permute,
    /// double-permute, stale-reload, crash-during-load, crash-during-stage, slow-stage, slow-commit.
    #[arg(long, value_name = "RANK:KIND")]
    inject_fault: Option<String>,
    /// Every worker writes its kernel-visible tensors to DIR/dp{D}/rank{R}.safetensors.
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// Print the report as one JSON document.
    #[arg(long)]
    json: bool,
    /// Keep the cluster up after the report (see `orchestrator report` and `shutdown`).
    #[arg(long)]
    serve: bool,
    /// Coordinator address (loopback by default).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: std::net::SocketAddr,
    /// The cluster's shared token (default: a fresh random one, written under the cache
    /// directory for the launch's lifetime; `--serve` prints its path).
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// More directories workers may read checkpoints from (the launched checkpoint's is always allowed).
    #[arg(long, value_name = "DIR")]
    allow_root: Vec<PathBuf>,
    /// Journal the plan, the workers and every update step here, so that a coordinator killed
    /// mid-update can be restarted with `orchestrator recover --state-dir DIR`. Without
    /// `--token-file`, the generated token is kept here too.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Seconds workers keep serving while the coordinator is unreachable (default: 3, or 60
    /// with --state-dir so that `recover` can find them).
    #[arg(long, value_name = "SECS")]
    worker_grace: Option<f64>,
    /// Seconds an update keeps driving a decided commit to a rank that does not answer before
    /// it reports the rank and leaves the commit pending (finished when the rank answers);
    /// default 20.
    #[arg(long, value_name = "SECS")]
    commit_timeout: Option<f64>,
    /// Run the control plane (coordinator and workers) over TLS with the cluster's files in DIR
    /// (`ca.pem`, `node.pem`, `node.key`; see `orchestrator tls generate`). Needed for a
    /// non-loopback --listen.
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<PathBuf>,
    /// Allow a non-loopback --listen without TLS.
    #[arg(long)]
    insecure: bool,
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
    #[arg(long, value_name = "T,S[,SEED]", default_value = "2,16")]
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

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Write a synthetic Hugging Face checkpoint (config.json, index, safetensors shards).
    Synth(SynthArgs),
    /// Print geometry, tensors and sizes, and validate every in-scope tensor.
    Inspect(InspectArgs),
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

fn parse_fault(s: &str, workers: u32) -> anyhow::Result<(u32, orchestrator_proto::v1::Fault)> {
    use orchestrator_proto::v1::Fault;
    let (rank, kind) = s.split_once(':').ok_or_else(|| anyhow::anyhow!("--inject-fault `{s}`: expected RANK:KIND"))?;
    let rank: u32 = rank.parse().map_err(|e| anyhow::anyhow!("--inject-fault `{s}`: rank: {e}"))?;
    anyhow::ensure!(rank < workers, "--inject-fault `{s}`: rank {rank} is outside 0..{workers}");
    let kind = match kind {
        "skip-permute" => Fault::SkipPermute,
        "double-permute" => Fault::DoublePermute,
        "stale-reload" => Fault::StaleReload,
        "crash-during-load" => Fault::CrashDuringLoad,
        "crash-during-stage" => Fault::CrashDuringStage,
        "slow-stage" => Fault::SlowStage,
        "slow-commit" => Fault::SlowCommit,
        other => {
            anyhow::bail!(
                "--inject-fault `{s}`: unknown kind `{other}` (skip-permute, double-permute, stale-reload, crash-during-load, crash-during-stage, slow-stage, slow-commit)"
            )
        }
    };
    Ok((rank, kind))
}

fn launch_cmd(a: LaunchArgs) -> anyhow::Result<bool> {
    use orchestrator_proto::v1 as pb;
    // Every size is checked before anything is opened, allocated or started.
    orchestrator_model::limits::check_cluster(a.tp as usize, a.dp as usize, true)
        .map_err(|e| anyhow::anyhow!("--tp {} --dp {}: {e}", a.tp, a.dp))?;
    let device = match a.device {
        Device::Cpu => launch::WorkerDevice::Cpu,
        // Fail before starting anything when CUDA cannot work here.
        #[cfg(feature = "cuda")]
        Device::Cuda => {
            orchestrator_kernels::cuda::CudaLibraries::probe().require_all()?;
            launch::WorkerDevice::Cuda
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => anyhow::bail!("--device cuda: this binary was built without the `cuda` feature (rebuild with `--features cuda`)"),
    };
    // Resolve and validate the plan before starting anything.
    let (source, local, desc) = if a.dummy.dummy {
        let d = &a.dummy;
        let (preset, local) = (d.preset()?, d.source()?);
        let layers = local.config().geometry.layers;
        let bf16 = d.dtype == orchestrator_worker::cli::DummyDtype::Bf16;
        let src = pb::LoadSource {
            kind: Some(pb::load_source::Kind::Dummy(pb::DummySource {
                preset: preset.name().into(),
                layers: layers as u32,
                seed: d.seed,
                bf16,
            })),
        };
        (src, local, format!("dummy {} x {layers} layers, seed {}", preset.name(), d.seed))
    } else {
        let dir = match &a.checkpoint {
            Some(d) => d.clone(),
            None => launch::default_checkpoint()?,
        };
        let dir = dir.canonicalize().with_context(|| format!("checkpoint {}", dir.display()))?;
        // The checkpoint's own folder (for a Hugging Face hub snapshot: its repo folder, where
        // the snapshot's symlinks point) is allowed; every file must lie under it.
        let own = orchestrator_worker::auth::AllowedRoots::for_checkpoint(&dir)?;
        let local = orchestrator_worker::LoadSource::open_checkpoint_within(&dir, &own)
            .with_context(|| format!("opening checkpoint {}", dir.display()))?;
        let src = pb::LoadSource { kind: Some(pb::load_source::Kind::CheckpointDir(dir.display().to_string())) };
        (src, local, format!("checkpoint {}", dir.display()))
    };
    orchestrator_model::plan::validate_tp(&local.config().geometry, a.tp as usize)?;
    let fault = a.inject_fault.as_deref().map(|s| parse_fault(s, a.tp * a.dp)).transpose()?;
    let mut allow_roots = a
        .allow_root
        .iter()
        .map(|r| r.canonicalize().with_context(|| format!("--allow-root {}", r.display())))
        .collect::<Result<Vec<_>, _>>()?;
    if let orchestrator_worker::LoadSource::Safetensors(c) = &local {
        allow_roots.extend(orchestrator_worker::auth::AllowedRoots::for_checkpoint(c.dir())?.roots().iter().cloned());
    }
    let tls = match &a.tls_dir {
        Some(d) => {
            Some(orchestrator_worker::tls::TlsFiles::load(&d.canonicalize().with_context(|| format!("--tls-dir {}", d.display()))?)?)
        }
        None => None,
    };
    orchestrator_worker::tls::check_listen(a.listen, tls.as_ref(), a.insecure, "--listen").map_err(anyhow::Error::msg)?;
    let state_dir = match &a.state_dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("--state-dir {}", d.display()))?;
            Some(d.canonicalize().with_context(|| format!("--state-dir {}", d.display()))?)
        }
        None => None,
    };
    // Everything that can be refused is checked before the journal and the token file are made,
    // so a refused launch leaves neither behind.
    let grace = a.worker_grace.unwrap_or(if state_dir.is_some() { 60.0 } else { 3.0 });
    let worker_grace = std::time::Duration::try_from_secs_f64(grace).map_err(|e| anyhow::anyhow!("--worker-grace {grace}: {e}"))?;
    let roots = orchestrator_worker::auth::AllowedRoots::new(&allow_roots)?;
    let commit_timeout = a.commit_timeout.unwrap_or(orchestrator_proto::limits::COMMIT_DRIVE_LIMIT.as_secs_f64());
    let commit_timeout = std::time::Duration::try_from_secs_f64(commit_timeout)
        .ok()
        .filter(|d| !d.is_zero() && d.as_secs() <= 3600)
        .ok_or_else(|| anyhow::anyhow!("--commit-timeout {commit_timeout}: must be in (0, 3600] seconds"))?;
    let dump_dir = match &a.dump {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("--dump {}", d.display()))?;
            Some(d.canonicalize()?)
        }
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let journal = state_dir.as_deref().map(journal::Journal::create).transpose()?.map(std::sync::Arc::new);
    let (token, token_file, token_generated) = match (&a.token_file, &state_dir) {
        (Some(p), _) => (orchestrator_worker::auth::Token::read(p)?, p.canonicalize()?, false),
        (None, dir) => {
            let p = match dir {
                Some(d) => d.join(journal::TOKEN_FILE),
                None => launch::cache_dir().join("run").join(format!("coordinator-{}.token", std::process::id())),
            };
            (orchestrator_worker::auth::Token::generate(&p)?, p, true)
        }
    };
    let plan = launch::LaunchPlan {
        tp: a.tp,
        dp: a.dp,
        device,
        source,
        local_source: std::sync::Arc::new(local),
        source_desc: desc,
        scale_rule: a.scale_rule,
        probe: (!a.no_probe).then_some(a.probe),
        fault,
        verify_golden: a.verify == Some(Verify::Golden),
        listen: a.listen,
        token,
        token_file,
        token_generated,
        roots,
        commit_timeout,
        allow_roots,
        journal,
        worker_grace,
        tls,
        dump_dir,
    };
    let (json, serve) = (a.json, a.serve);
    runtime.block_on(async move {
        let run = launch::launch(plan, serve, |report| {
            if json {
                emit(&format!("{}\n", serde_json::to_string_pretty(report).unwrap_or_default()));
            } else {
                emit(&report.render());
            }
        });
        if serve {
            // A served cluster stops gracefully on a signal by itself.
            return run.await;
        }
        // Interrupted: dropping the launch kills its workers and removes its token file.
        let signal = orchestrator_worker::grpc::shutdown_signal();
        tokio::select! {
            r = run => r,
            _ = signal => anyhow::bail!("interrupted: the workers were stopped and the launch's token file removed"),
        }
    })
}

/// A channel to the coordinator `a` names (over TLS for `https://`).
async fn remote_channel(a: &RemoteArgs) -> anyhow::Result<tonic::transport::Channel> {
    let tls = a.tls_dir.as_deref().map(orchestrator_worker::tls::TlsFiles::load_client).transpose()?;
    Ok(orchestrator_worker::tls::connect(&a.coordinator, tls.as_ref()).await?)
}

fn tls_generate(out: PathBuf, names: Vec<String>) -> anyhow::Result<bool> {
    orchestrator_worker::tls::generate(&out, &names)?;
    emit(&format!(
        "wrote {}: ca.pem, ca.key, node.pem, node.key (node certificate for {}, localhost, loopback{}{})\n",
        out.display(),
        orchestrator_worker::tls::SERVER_NAME,
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
    let token = a.token_file.as_deref().map(orchestrator_worker::auth::Token::read).transpose()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let channel = remote_channel(&a).await?;
        let mut client = pb::coordinator_client::CoordinatorClient::new(channel).max_decoding_message_size(64 << 20);
        if shutdown {
            let req = orchestrator_worker::auth::request(pb::ShutdownRequest {}, std::time::Duration::from_secs(10), token.as_ref());
            client.shutdown(req).await.map_err(|s| anyhow::anyhow!("shutdown: {}", describe_first_call(&s, &a.coordinator)))?;
            emit("shutdown requested\n");
            return Ok(true);
        }
        let req = orchestrator_worker::auth::request(
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
    Option<orchestrator_worker::auth::Token>,
)> {
    let token = a.token_file.as_deref().map(orchestrator_worker::auth::Token::read).transpose()?;
    let channel = remote_channel(a).await?;
    Ok((orchestrator_proto::v1::coordinator_client::CoordinatorClient::new(channel).max_decoding_message_size(64 << 20), token))
}

fn update_cmd(a: UpdateArgs) -> anyhow::Result<bool> {
    use orchestrator_proto::v1 as pb;
    anyhow::ensure!(a.max_unavailable >= 1, "--max-unavailable must be at least 1");
    let dir = a.checkpoint.canonicalize().with_context(|| format!("--checkpoint {}", a.checkpoint.display()))?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let (mut client, token) = coordinator_client(&a.remote).await?;
        let req = orchestrator_worker::auth::request(
            pb::UpdateRequest { checkpoint_dir: dir.display().to_string(), max_unavailable: a.max_unavailable },
            std::time::Duration::from_secs(3600),
            token.as_ref(),
        );
        let r = client
            .update(req)
            .await
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
    use orchestrator_proto::v1 as pb;
    use std::collections::BTreeMap;
    anyhow::ensure!(a.rate > 0.0 && a.rate <= 1000.0, "--rate must be in (0, 1000]");
    anyhow::ensure!(a.duration > 0.0 && a.duration <= 86_400.0, "--duration must be in (0, 86400] seconds");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let (client, token) = coordinator_client(&a.remote).await?;
        let count = (a.rate * a.duration).ceil() as usize;
        let interval = std::time::Duration::from_secs_f64(1.0 / a.rate);
        let start = tokio::time::Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..count {
            tokio::time::sleep_until(start + interval * i as u32).await;
            let mut client = client.clone();
            let req = orchestrator_worker::auth::request(
                pb::RoutedProbeRequest { tokens: a.size.tokens as u32, latents: a.size.latents as u32, seed: a.size.seed },
                std::time::Duration::from_secs(60),
                token.as_ref(),
            );
            tasks.spawn(async move {
                let t = std::time::Instant::now();
                let r = client.routed_probe(req).await;
                (t.elapsed().as_secs_f64() * 1e3, r.map(|r| r.into_inner()).map_err(|s| s.message().to_string()))
            });
        }
        let mut latencies = Vec::new();
        let mut by_replica: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut by_version: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut errors = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            let (ms, r) = joined?;
            latencies.push(ms);
            let (replica, version, ok, err) = match r {
                Ok(p) => (format!("dp{}", p.replica), p.checkpoint_version, p.ok, p.error),
                Err(e) => ("-".into(), "-".into(), false, e),
            };
            let slot = |m: &mut BTreeMap<String, (u64, u64)>, k: String| {
                let e = m.entry(k).or_default();
                if ok { e.0 += 1 } else { e.1 += 1 }
            };
            slot(&mut by_replica, replica);
            slot(&mut by_version, version);
            if !ok && errors.len() < 10 {
                errors.push(err);
            }
        }
        latencies.sort_by(f64::total_cmp);
        let pct = |q: f64| latencies.get(((latencies.len() as f64 * q).ceil() as usize).saturating_sub(1).min(latencies.len().saturating_sub(1))).copied().unwrap_or(0.0);
        let failed: u64 = by_replica.values().map(|v| v.1).sum();
        let served: u64 = by_replica.values().map(|v| v.0).sum();
        let doc = serde_json::json!({
            "ok": failed == 0, "served": served, "failed": failed,
            "seconds": start.elapsed().as_secs_f64(),
            "latency_ms": { "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": latencies.last().copied().unwrap_or(0.0) },
            "by_replica": by_replica.iter().map(|(k, v)| (k.clone(), serde_json::json!({"served": v.0, "failed": v.1}))).collect::<serde_json::Map<_, _>>(),
            "by_version": by_version.iter().map(|(k, v)| (k.clone(), serde_json::json!({"served": v.0, "failed": v.1}))).collect::<serde_json::Map<_, _>>(),
            "errors": errors,
        });
        if a.remote.json {
            emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
        } else {
            let mut t = format!("probes: {served} served, {failed} failed in {:.1} s; latency p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms\n", start.elapsed().as_secs_f64(), pct(0.5), pct(0.9), pct(0.99));
            for (k, v) in &by_replica {
                t.push_str(&format!("  replica {k}: {} served, {} failed\n", v.0, v.1));
            }
            for (k, v) in &by_version {
                t.push_str(&format!("  version {k}: {} served, {} failed\n", v.0, v.1));
            }
            for e in &errors {
                t.push_str(&format!("  error: {e}\n"));
            }
            emit(&t);
        }
        Ok(failed == 0)
    })
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Launch(a) => launch_cmd(a),
        Command::Report(a) => remote_cmd(a, false),
        Command::Shutdown(a) => remote_cmd(a, true),
        Command::Update(a) => update_cmd(a),
        Command::Probe(a) => probe_cmd(a),
        Command::Recover(a) => recover_cmd(a),
        Command::Tls(TlsCommand::Generate { out, name }) => tls_generate(out, name),
        Command::WorkerServe(a) => a.run().map(|()| true),
        Command::Checkpoint(CheckpointCommand::Synth(a)) => synth(a),
        Command::Checkpoint(CheckpointCommand::Inspect(a)) => inspect_cmd(a),
    };
    orchestrator_worker::output::exit_code(result)
}
