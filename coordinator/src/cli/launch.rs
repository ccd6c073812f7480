//! `orchestrator launch` (a cluster on this host: the coordinator plus one worker process per
//! rank) and `orchestrator coordinator` (the coordinator alone: the workers are started by
//! Slurm, Kubernetes or a user, anywhere, and register by rank). Both resolve the same plan and
//! run the same [`launch::launch`].

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use orchestrator_ops::output::emit;
use orchestrator_proto::v1 as pb;

use crate::journal;
use crate::launch::{self, Workers};

#[derive(Clone, Copy, ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Verify {
    Golden,
}

/// What both commands take: the cluster, its source and checks, and how it serves.
#[derive(Args)]
pub struct PlanArgs {
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
    /// double-permute, stale-reload, crash-during-load, crash-during-stage, slow-stage, slow-commit,
    /// hung-commit, stage-skip-permute, commit-skip-permute.
    #[arg(long, value_name = "RANK:KIND")]
    inject_fault: Option<String>,
    /// Debugging (needs --state-dir): the coordinator dies just before (crash-before) or just
    /// after (crash-after) it writes line LINE of its journal, or that write fails once as on a
    /// full disk (fail); the plan is line 1.
    #[arg(long, value_name = "KIND:LINE")]
    journal_fault: Option<journal::JournalFault>,
    /// Every worker writes its kernel-visible tensors to DIR/dp{D}/rank{R}.safetensors.
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// Every rank prepares a spare set of buffers after its load (in the background) and keeps
    /// the buffers an update leaves (the version it replaced), for every update, the first one
    /// included, to stage into instead of faulting in fresh memory: each rank then holds a
    /// second set of weights from the launch on.
    #[arg(long)]
    keep_staging_buffers: bool,
    /// Print the report as one JSON document.
    #[arg(long)]
    json: bool,
    /// Keep the cluster up after the report (see `orchestrator report` and `shutdown`).
    #[arg(long)]
    serve: bool,
    /// More directories workers may read checkpoints from (the launched checkpoint's is always allowed).
    #[arg(long, value_name = "DIR")]
    allow_root: Vec<PathBuf>,
    /// Journal the plan, the workers and every update step here, so that a coordinator killed
    /// mid-update can be restarted with `orchestrator recover --state-dir DIR`.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
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
    /// Also serve grpc.health.v1 (readiness and liveness only) in plaintext on ADDR, for
    /// Kubernetes' native gRPC probes, which cannot speak TLS.
    #[arg(long, value_name = "ADDR")]
    health_listen: Option<std::net::SocketAddr>,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics: ranks registered
    /// and up, each replica's version, updates, verification failures, routed probes.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Once the cluster serves, write FILE: one JSON object with how to call it (`coordinator`,
    /// `token_file`, `tls_dir`, `pid`), written whole; removed when it stops. A script waits for
    /// the file instead of reading the `serving:` line.
    #[arg(long, value_name = "FILE")]
    ready_file: Option<PathBuf>,
}

#[derive(Args)]
pub struct LaunchArgs {
    #[command(flatten)]
    plan: PlanArgs,
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Coordinator address (loopback by default).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: std::net::SocketAddr,
    /// The cluster's shared token (default: a fresh random one, written under the cache
    /// directory for the launch's lifetime, or into --state-dir; `--serve` prints its path).
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Seconds workers keep serving while the coordinator is unreachable (default: 3, or 60
    /// with --state-dir so that `recover` can find them).
    #[arg(long, value_name = "SECS")]
    worker_grace: Option<f64>,
}

#[derive(Args)]
pub struct CoordinatorArgs {
    #[command(flatten)]
    plan: PlanArgs,
    /// Address the workers and clients reach the coordinator at (e.g. 0.0.0.0:50050).
    #[arg(long)]
    listen: std::net::SocketAddr,
    /// The cluster's shared token, read by every worker too (created, mode 0600, when missing).
    #[arg(long, value_name = "FILE")]
    token_file: PathBuf,
    /// Seconds to wait for every rank to register (default 300); past it, the missing ranks and
    /// the hosts that did join are named and the coordinator stops.
    #[arg(long, value_name = "SECS")]
    join_timeout: Option<f64>,
}

fn parse_fault(s: &str, workers: u32) -> anyhow::Result<(u32, pb::Fault)> {
    use pb::Fault;
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
        "hung-commit" => Fault::HungCommit,
        "stage-skip-permute" => Fault::StageSkipPermute,
        "commit-skip-permute" => Fault::CommitSkipPermute,
        other => {
            anyhow::bail!(
                "--inject-fault `{s}`: unknown kind `{other}` (skip-permute, double-permute, stale-reload, crash-during-load, crash-during-stage, slow-stage, slow-commit, hung-commit, stage-skip-permute, commit-skip-permute)"
            )
        }
    };
    Ok((rank, kind))
}

fn seconds(v: f64, flag: &str) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v).map_err(|e| anyhow::anyhow!("{flag} {v}: {e}"))
}

/// The token: read from `file`, or generated into it (`generated` says whether it goes away
/// with the cluster).
struct TokenChoice {
    token: orchestrator_net::auth::Token,
    file: PathBuf,
    generated: bool,
}

/// Resolves and validates everything before anything is started (and before the journal and
/// a token file are made, so a refused plan leaves neither behind); `token` is called last.
fn resolve(
    a: &PlanArgs,
    listen: std::net::SocketAddr,
    workers: Workers,
    token: impl FnOnce(Option<&std::path::Path>) -> anyhow::Result<TokenChoice>,
) -> anyhow::Result<launch::LaunchPlan> {
    // Every size is checked before anything is opened, allocated or started.
    orchestrator_model::limits::check_cluster(a.tp as usize, a.dp as usize, true)
        .map_err(|e| anyhow::anyhow!("--tp {} --dp {}: {e}", a.tp, a.dp))?;
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
            content: None,
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
        let own = orchestrator_model::AllowedRoots::for_checkpoint(&dir)?;
        let local = orchestrator_worker::LoadSource::open_checkpoint_within(&dir, &own)
            .with_context(|| format!("opening checkpoint {}", dir.display()))?;
        // Hashed once here: a worker that opens the same files adopts the version.
        let content = local.content_claim().map(|c| orchestrator_worker::source::claim_to_pb(&c));
        let src = pb::LoadSource { kind: Some(pb::load_source::Kind::CheckpointDir(dir.display().to_string())), content };
        (src, local, format!("checkpoint {}", dir.display()))
    };
    orchestrator_model::plan::validate_tp(&local.config().geometry, a.tp as usize)?;
    if !a.no_probe {
        let g = &local.config().geometry;
        a.probe.check_on(g, g.layers, a.tp as usize).map_err(|e| anyhow::anyhow!("--probe {}: {e}", a.probe))?;
    }
    let fault = a.inject_fault.as_deref().map(|s| parse_fault(s, a.tp * a.dp)).transpose()?;
    let mut allow_roots = a
        .allow_root
        .iter()
        .map(|r| r.canonicalize().with_context(|| format!("--allow-root {}", r.display())))
        .collect::<Result<Vec<_>, _>>()?;
    if let orchestrator_worker::LoadSource::Safetensors(c) = &local {
        allow_roots.extend(orchestrator_model::AllowedRoots::for_checkpoint(c.dir())?.roots().iter().cloned());
    }
    let tls = match &a.tls_dir {
        Some(d) => Some(orchestrator_net::tls::TlsFiles::load(&d.canonicalize().with_context(|| format!("--tls-dir {}", d.display()))?)?),
        None => None,
    };
    orchestrator_net::tls::check_listen(listen, tls.as_ref(), a.insecure, "--listen").map_err(anyhow::Error::msg)?;
    let state_dir = match &a.state_dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("--state-dir {}", d.display()))?;
            Some(d.canonicalize().with_context(|| format!("--state-dir {}", d.display()))?)
        }
        None => None,
    };
    let roots = orchestrator_model::AllowedRoots::new(&allow_roots)?;
    let commit_timeout = a.commit_timeout.unwrap_or(orchestrator_proto::limits::COMMIT_DRIVE_LIMIT.as_secs_f64());
    let commit_timeout = Duration::try_from_secs_f64(commit_timeout)
        .ok()
        .filter(|d| (1..=3_600_000).contains(&d.as_millis()))
        .ok_or_else(|| anyhow::anyhow!("--commit-timeout {commit_timeout}: must be from 0.001 to 3600 seconds"))?;
    let dump_dir = match &a.dump {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("--dump {}", d.display()))?;
            Some(d.canonicalize()?)
        }
        None => None,
    };
    if let Some(f) = &a.ready_file {
        crate::server::Ready::clear(f)?;
    }
    anyhow::ensure!(a.journal_fault.is_none() || state_dir.is_some(), "--journal-fault needs --state-dir");
    let journal = state_dir.as_deref().map(journal::Journal::create).transpose()?.map(std::sync::Arc::new);
    if let (Some(j), Some(f)) = (&journal, a.journal_fault) {
        j.inject_fault(f);
    }
    let TokenChoice { token, file: token_file, generated: token_generated } = token(state_dir.as_deref())?;
    Ok(launch::LaunchPlan {
        tp: a.tp,
        dp: a.dp,
        workers,
        source,
        local_source: std::sync::Arc::new(local),
        source_desc: desc,
        scale_rule: a.scale_rule,
        probe: (!a.no_probe).then_some(a.probe),
        fault,
        verify_golden: a.verify == Some(Verify::Golden),
        listen,
        token,
        token_file,
        token_generated,
        roots,
        commit_timeout,
        allow_roots,
        journal,
        tls,
        dump_dir,
        keep_staging_buffers: a.keep_staging_buffers,
        health_listen: a.health_listen,
        metrics_listen: a.metrics_listen,
        ready_file: a.ready_file.clone(),
    })
}

/// Runs a resolved plan: prints the report (text or JSON); its verdict is the exit code.
fn run(plan: launch::LaunchPlan, json: bool, serve: bool) -> anyhow::Result<bool> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
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
        let signal = orchestrator_net::grpc::shutdown_signal();
        tokio::select! {
            r = run => r,
            _ = signal => anyhow::bail!("interrupted: the workers were stopped and the launch's token file removed"),
        }
    })
}

pub fn launch_cmd(a: LaunchArgs) -> anyhow::Result<bool> {
    let device = match a.device {
        Device::Cpu => launch::WorkerDevice::Cpu,
        // Fail before starting anything when CUDA cannot work here.
        Device::Cuda if !orchestrator_kernels::cuda::BUILT_IN => {
            anyhow::bail!("--device cuda: this binary was built without the `cuda` feature (rebuild with `--features cuda`)")
        }
        Device::Cuda => {
            orchestrator_kernels::cuda::CudaLibraries::probe().require_all()?;
            launch::WorkerDevice::Cuda
        }
    };
    let grace = a.worker_grace.unwrap_or(if a.plan.state_dir.is_some() { 60.0 } else { 3.0 });
    let workers = Workers::Local { device, grace: seconds(grace, "--worker-grace")? };
    let plan = resolve(&a.plan, a.listen, workers, |state_dir| {
        Ok(match (&a.token_file, state_dir) {
            (Some(p), _) => TokenChoice { token: orchestrator_net::auth::Token::read(p)?, file: p.canonicalize()?, generated: false },
            (None, dir) => {
                let p = match dir {
                    Some(d) => d.join(journal::TOKEN_FILE),
                    None => launch::cache_dir().join("run").join(format!("coordinator-{}.token", std::process::id())),
                };
                TokenChoice { token: orchestrator_net::auth::Token::generate(&p)?, file: p, generated: true }
            }
        })
    })?;
    run(plan, a.plan.json, a.plan.serve)
}

pub fn coordinator_cmd(a: CoordinatorArgs) -> anyhow::Result<bool> {
    let timeout = seconds(a.join_timeout.unwrap_or(orchestrator_proto::limits::JOIN_TIMEOUT.as_secs_f64()), "--join-timeout")?;
    let plan = resolve(&a.plan, a.listen, Workers::Join { timeout }, |_| {
        let p = &a.token_file;
        let token = if p.exists() {
            orchestrator_net::auth::Token::read(p)?
        } else {
            let t = orchestrator_net::auth::Token::generate(p)?;
            eprintln!("wrote a new cluster token to {} (give the workers the same file)", p.display());
            t
        };
        // The workers read this file too: it stays when the coordinator stops.
        Ok(TokenChoice { token, file: p.canonicalize()?, generated: false })
    })?;
    run(plan, a.plan.json, a.plan.serve)
}
