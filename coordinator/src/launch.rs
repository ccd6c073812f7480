//! `orchestrator launch` and `orchestrator coordinator`: validate the plan, start the
//! coordinator service, start one worker process per rank here (`launch`) or wait for the
//! workers an engine started to register (`coordinator`), assign shards, load in parallel,
//! probe, report, and stop (or keep serving).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use orchestrator_kernels::ScaleRule;
use orchestrator_model::inspect::inspect;
use orchestrator_model::synth::{DEFAULT_MAX_SHARD_BYTES, SynthOptions, write_checkpoint};
use orchestrator_model::{ModelConfig, Preset};
use orchestrator_net::auth::Token;
use orchestrator_proto::v1 as pb;
use orchestrator_worker::LoadSource;
use orchestrator_worker::golden::golden_kernel_digests;
use orchestrator_worker::probe::ProbeSpec;

pub use crate::cluster::WorkerDevice;
use crate::cluster::{Cluster, Failures};
use crate::consistency::{ConsistencyReport, RowFailure, evaluate, failed_row};
use crate::journal::{Event, Journal, PlanRecord, SourceRecord};
use crate::rotation::Rotation;
use crate::server::Endpoint;
use crate::session::{Session, SessionState};

/// Layers of the built-in default checkpoint.
pub const DEFAULT_LAYERS: usize = 4;

/// Everything a launch needs, validated.
pub struct LaunchPlan {
    pub tp: u32,
    pub dp: u32,
    /// Who starts the workers.
    pub workers: Workers,
    pub source: pb::LoadSource,
    /// The same source opened in the coordinator (golden verification, plan validation).
    pub local_source: Arc<LoadSource>,
    pub source_desc: String,
    pub scale_rule: ScaleRule,
    pub probe: Option<ProbeSpec>,
    pub fault: Option<(u32, pb::Fault)>,
    pub verify_golden: bool,
    pub listen: SocketAddr,
    /// Workers dump their kernel tensors under DIR/dp{D}/rank{R}.safetensors.
    pub dump_dir: Option<PathBuf>,
    /// Ranks keep the buffers an update leaves for the next stage (see the worker's `spare`).
    pub keep_staging_buffers: bool,
    /// The cluster's shared token, the file workers read it from, and whether this launch
    /// generated that file (then it is removed when the cluster stops).
    pub token: Token,
    pub token_file: PathBuf,
    pub token_generated: bool,
    /// Directories workers may read checkpoints from (and the same, checked by the coordinator
    /// before an update touches any replica).
    pub allow_roots: Vec<PathBuf>,
    pub roots: orchestrator_model::AllowedRoots,
    /// How long an update drives a decided commit to a silent rank before reporting it.
    pub commit_timeout: Duration,
    /// The journal of the plan, the workers and every update step (`--state-dir`).
    pub journal: Option<Arc<Journal>>,
    /// Run the control plane over TLS with these files.
    pub tls: Option<orchestrator_net::tls::TlsFiles>,
    /// Also serve the health statuses in plaintext here (Kubernetes probes).
    pub health_listen: Option<SocketAddr>,
    /// Serve Prometheus metrics at `http://ADDR/metrics`.
    pub metrics_listen: Option<SocketAddr>,
    /// Where to say, as JSON, how to call the cluster once it serves.
    pub ready_file: Option<PathBuf>,
}

/// Who starts a cluster's workers.
#[derive(Clone, Copy, Debug)]
pub enum Workers {
    /// `launch`: one worker process per rank on this host, on `device` (GPU workers: one GPU
    /// each), that keeps serving for `grace` while the coordinator is unreachable.
    Local { device: WorkerDevice, grace: Duration },
    /// `coordinator`: Slurm, Kubernetes or a user start them anywhere; wait up to `timeout` for
    /// every rank to register.
    Join { timeout: Duration },
}

/// Where the default checkpoint lives: `$ORCHESTRATOR_CACHE`, else `$XDG_CACHE_HOME/orchestrator`,
/// else `~/.cache/orchestrator`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ORCHESTRATOR_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("orchestrator");
    }
    std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/orchestrator"))
        .unwrap_or_else(|| std::env::temp_dir().join("orchestrator-cache"))
}

/// The built-in default: a dsv41-flash-geometry FP8 checkpoint of a few layers, synthesized
/// once into the cache directory.
pub fn default_checkpoint() -> anyhow::Result<PathBuf> {
    let dir = cache_dir().join(format!("dsv41-flash-{DEFAULT_LAYERS}layers-fp8-seed0"));
    if dir.join(orchestrator_model::checkpoint::INDEX_FILE).exists() {
        return Ok(dir);
    }
    eprintln!("synthesizing the default checkpoint (dsv41-flash, {DEFAULT_LAYERS} layers, FP8) into {} (once)", dir.display());
    let config = ModelConfig::from_preset(Preset::Dsv41Flash, Some(DEFAULT_LAYERS), false)?;
    let opts =
        SynthOptions { config, seed: 0, max_shard_bytes: DEFAULT_MAX_SHARD_BYTES, preset_name: Some(Preset::Dsv41Flash.name().into()) };
    match write_checkpoint(&dir, &opts) {
        Ok(_) => Ok(dir),
        // Another launch may have written it meanwhile.
        Err(_) if dir.join(orchestrator_model::checkpoint::INDEX_FILE).exists() => Ok(dir),
        Err(e) => Err(e.into()),
    }
}

/// A report for a launch that failed before every rank could report. A rank whose process
/// exited says so (its RPC error is only the symptom).
async fn failure_report(plan: &LaunchPlan, cluster: &Cluster, failures: Failures, timings: BTreeMap<String, f64>) -> ConsistencyReport {
    let mut f: BTreeMap<u32, RowFailure> = BTreeMap::new();
    for (id, e) in failures {
        let w = cluster.workers.iter().find(|w| w.id == id);
        let exited = match w {
            Some(w) if !e.says_it_exited() => w.process.exited().await.map(|how| (w.label(), how)),
            _ => None,
        };
        let failure = match exited {
            Some((rank, how)) => RowFailure { text: format!("{rank} {how}; {e}"), names_host: e.names_host() },
            None => (&e).into(),
        };
        f.insert(id, failure);
    }
    let mut rows: Vec<_> = cluster
        .workers
        .iter()
        .map(|w| failed_row(w.id, w.dp, w.tp, f.get(&w.id).cloned().unwrap_or_else(|| "stopped after another rank failed".into())))
        .collect();
    cluster.annotate(&mut rows);
    evaluate(plan.tp, plan.dp, plan.source_desc.clone(), rows, None, timings, false)
}

/// Removes a generated token file when dropped.
pub struct TokenFileGuard(pub Option<PathBuf>);

impl Drop for TokenFileGuard {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Runs a launch; returns the report and whether the cluster should keep serving.
pub async fn launch(plan: LaunchPlan, serve: bool, emit_report: impl Fn(&ConsistencyReport)) -> anyhow::Result<bool> {
    let start = Instant::now();
    // A token file this launch generated goes away with it, however the launch ends (a
    // coordinator killed outright leaves it for `recover`).
    let _token_file = TokenFileGuard(plan.token_generated.then(|| plan.token_file.clone()));
    let mut timings = BTreeMap::new();
    let endpoint = Endpoint::start(plan.listen, plan.token.clone(), plan.tls.as_ref(), plan.tp * plan.dp).await?;
    let address = endpoint.address;
    if let Some(h) = plan.health_listen {
        let at = endpoint.health.serve_plaintext(h).await?;
        orchestrator_ops::status!(; "health (plaintext, grpc.health.v1 only) on {at}");
    }
    if let Some(m) = plan.metrics_listen {
        let slot = endpoint.session.clone();
        let render = Arc::new(move || {
            let session = slot.read().unwrap_or_else(|p| p.into_inner()).clone();
            crate::metrics::metrics().render(session.as_deref())
        });
        let at = orchestrator_ops::metrics::serve(m, render).await.map_err(|e| anyhow::anyhow!("--metrics-listen {m}: {e}"))?;
        orchestrator_ops::status!(; "metrics on http://{at}/metrics");
    }
    let (mut cluster, join_deadline) = match plan.workers {
        Workers::Local { device, grace } => {
            orchestrator_ops::status!(; "coordinator listening on {address}; starting {} workers (TP {} x DP {})", plan.tp * plan.dp, plan.tp, plan.dp);
            let cluster = Cluster::spawn(
                device,
                plan.tp,
                plan.dp,
                &endpoint.url,
                endpoint.registry.clone(),
                crate::cluster::WorkerAccess {
                    token: plan.token.clone(),
                    token_file: &plan.token_file,
                    allow_roots: &plan.allow_roots,
                    dump_root: plan.dump_dir.as_deref(),
                    tls: plan.tls.clone(),
                },
                grace,
            )?;
            (cluster, Duration::from_secs(30))
        }
        Workers::Join { timeout } => {
            orchestrator_ops::status!(;
                "coordinator listening on {address} ({}); waiting up to {} s for {} workers to register (TP {} x DP {})",
                endpoint.public_url,
                timeout.as_secs(),
                plan.tp * plan.dp,
                plan.tp,
                plan.dp
            );
            let cluster = Cluster::remote(plan.tp, plan.dp, endpoint.registry.clone(), plan.token.clone(), plan.tls.clone());
            (cluster, timeout)
        }
    };
    let up = async {
        cluster.connect_all(join_deadline).await?;
        if matches!(plan.workers, Workers::Join { .. }) {
            let hosts: Vec<String> =
                cluster.registry.by_host(plan.tp * plan.dp).into_iter().map(|(h, r)| format!("{h} (ranks {r:?})")).collect();
            orchestrator_ops::status!(; "every rank registered: {}", hosts.join(", "));
        }
        cluster.assign(&plan.source, plan.scale_rule.name(), plan.fault, plan.dump_dir.as_deref(), plan.keep_staging_buffers).await
    };
    if let Err(f) = up.await {
        timings.insert("startup".into(), start.elapsed().as_secs_f64());
        let report = failure_report(&plan, &cluster, f, timings).await;
        cluster.kill_all().await;
        emit_report(&report);
        endpoint.stop().await;
        return Ok(false);
    }
    timings.insert("startup".into(), start.elapsed().as_secs_f64());

    // Golden digests, computed meanwhile from the checkpoint with the plain path.
    let golden = plan.verify_golden.then(|| {
        let source = plan.local_source.clone();
        let (tp, rule) = (plan.tp as usize, plan.scale_rule);
        tokio::task::spawn_blocking(move || -> anyhow::Result<BTreeMap<u32, BTreeMap<String, String>>> {
            (0..tp)
                .map(|r| {
                    let d = golden_kernel_digests(&source, tp, r, rule)?;
                    Ok((r as u32, d.into_iter().map(|(n, d)| (n, d.hex())).collect()))
                })
                .collect()
        })
    });

    let t = Instant::now();
    let loaded = cluster.load().await;
    timings.insert("load".into(), t.elapsed().as_secs_f64());
    let failures: Failures = loaded.iter().filter_map(|(id, r)| r.as_ref().err().map(|e| (*id, e.clone()))).collect();
    if !failures.is_empty() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let report = failure_report(&plan, &cluster, failures, timings).await;
        cluster.kill_all().await;
        emit_report(&report);
        endpoint.stop().await;
        return Ok(false);
    }
    let golden = match golden {
        Some(task) => Some(task.await??),
        None => None,
    };

    let version = plan.local_source.version();
    let current_source = SourceRecord::from_pb(&plan.source).ok_or_else(|| anyhow::anyhow!("the launch has no source"))?;
    if let Some(j) = &plan.journal {
        j.record(Event::Launched(PlanRecord {
            coordinator: address.to_string(),
            tp: plan.tp,
            dp: plan.dp,
            source: current_source.clone(),
            source_desc: plan.source_desc.clone(),
            scale_rule: plan.scale_rule.name().to_string(),
            probe: plan.probe.map(|p| (p.tokens as u32, p.latents as u32, p.seed)),
            token_file: plan.token_file.clone(),
            tls_dir: plan.tls.as_ref().map(|t| t.dir.clone()),
            workers: cluster.records(),
            version: version.clone(),
            allow_roots: plan.allow_roots.clone(),
            commit_timeout_ms: Some(plan.commit_timeout.as_millis() as u64),
        }))?;
    }
    let rotation = Arc::new(Rotation::new(vec![version; plan.dp as usize]));
    // The launched checkpoint was hashed here, its values checked in the same pass: a later
    // update back to it adopts that version, and its inspection stands where it found every
    // tensor valid (only the headers are read again for it).
    let known_claims = Arc::new(crate::update::KnownClaims::default());
    if let orchestrator_worker::LoadSource::Safetensors(c) = &*plan.local_source
        && let Some(claim) = c.content_claim()
    {
        let inspected = c.version_from() == orchestrator_model::checkpoint::VersionFrom::Hashed && inspect(c).valid;
        known_claims.put(c.dir().to_path_buf(), claim, inspected);
    }
    let session = Session {
        cluster: Arc::new(cluster),
        rotation,
        config: plan.local_source.config().clone(),
        probe: plan.probe,
        golden,
        journal: plan.journal.clone(),
        roots: plan.roots.clone(),
        commit_timeout: plan.commit_timeout,
        known_claims,
        updating: Default::default(),
        update_lock: Default::default(),
        state: std::sync::Mutex::new(SessionState { source_desc: plan.source_desc.clone(), current_source, last_update: 0, timings }),
    };
    let mut report = session.check(true).await;
    report.timings.insert("total".into(), start.elapsed().as_secs_f64());
    session.state().timings = report.timings.clone();
    emit_report(&report);

    if serve {
        endpoint.serve(Arc::new(session), &plan.token_file, plan.ready_file.as_deref()).await;
    } else {
        session.cluster.shutdown().await;
        if let Some(j) = &session.journal {
            j.note(Event::Shutdown);
        }
    }
    endpoint.stop().await;
    Ok(report.ok)
}
