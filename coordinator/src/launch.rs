//! `orchestrator launch`: validate the plan, start the coordinator service and one worker
//! process per rank, assign shards, load in parallel, probe, report, and stop (or keep
//! serving).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use orchestrator_kernels::ScaleRule;
use orchestrator_model::synth::{DEFAULT_MAX_SHARD_BYTES, SynthOptions, write_checkpoint};
use orchestrator_model::{ModelConfig, Preset};
use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::coordinator_server::CoordinatorServer;
use orchestrator_worker::LoadSource;
use orchestrator_worker::auth::Token;
use orchestrator_worker::golden::golden_kernel_digests;
use orchestrator_worker::probe::ProbeSpec;
use tokio::sync::Notify;

pub use crate::cluster::WorkerDevice;
use crate::cluster::{Cluster, Failures, Registry};
use crate::consistency::{ConsistencyReport, evaluate, failed_row, row};
use crate::service::CoordinatorService;

/// Layers of the built-in default checkpoint.
pub const DEFAULT_LAYERS: usize = 4;

/// Everything a launch needs, validated.
pub struct LaunchPlan {
    pub tp: u32,
    pub dp: u32,
    /// Where the workers run (GPU workers: one GPU each).
    pub device: WorkerDevice,
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
    /// The cluster's shared token, the file workers read it from, and whether this launch
    /// generated that file (then it is removed when the cluster stops).
    pub token: Token,
    pub token_file: PathBuf,
    pub token_generated: bool,
    /// Directories workers may read checkpoints from.
    pub allow_roots: Vec<PathBuf>,
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

/// A cluster that is up, and what is needed to check it again.
pub struct Session {
    pub cluster: Arc<Cluster>,
    /// Which replicas serve routed probes, and their versions.
    pub rotation: Arc<crate::update::Rotation>,
    /// The running plan's configuration (an update must match it).
    pub config: orchestrator_model::ModelConfig,
    pub source_desc: String,
    pub probe: Option<ProbeSpec>,
    pub golden: Option<BTreeMap<u32, BTreeMap<String, String>>>,
    pub load_seconds: BTreeMap<u32, f64>,
    pub timings: BTreeMap<String, f64>,
}

impl Session {
    /// Probes (when configured and asked) and collects every rank's report, then applies the
    /// cross-rank rules. A failed worker becomes a failed row naming it.
    pub async fn check(&mut self, probe: bool) -> ConsistencyReport {
        let mut failures: BTreeMap<u32, String> = BTreeMap::new();
        let mut probes = BTreeMap::new();
        let t = Instant::now();
        if let (Some(spec), true) = (self.probe, probe) {
            match self.cluster.probe(spec.tokens as u32, spec.latents as u32, spec.seed).await {
                Ok(results) => {
                    for (id, r) in results {
                        match r {
                            Ok(p) => {
                                probes.insert(id, p);
                            }
                            Err(e) => {
                                failures.insert(id, e);
                            }
                        }
                    }
                }
                Err(f) => failures.extend(f),
            }
            self.timings.insert("probe".into(), t.elapsed().as_secs_f64());
        }
        let t = Instant::now();
        let mut rows = Vec::new();
        match self.cluster.reports().await {
            Ok(results) => {
                for w in &self.cluster.workers {
                    match (results.get(&w.id), failures.get(&w.id)) {
                        (_, Some(f)) => rows.push(failed_row(w.id, w.dp, w.tp, f.clone())),
                        (Some(Ok(r)), None) => {
                            let mut rr = row(w.id, r, probes.get(&w.id));
                            if let Some(s) = self.load_seconds.get(&w.id) {
                                rr.load_seconds = *s;
                            }
                            rows.push(rr);
                        }
                        (Some(Err(e)), None) => rows.push(failed_row(w.id, w.dp, w.tp, e.clone())),
                        (None, None) => rows.push(failed_row(w.id, w.dp, w.tp, "no report".into())),
                    }
                }
            }
            Err(f) => {
                let f: BTreeMap<u32, String> = f.into_iter().collect();
                for w in &self.cluster.workers {
                    rows.push(failed_row(
                        w.id,
                        w.dp,
                        w.tp,
                        f.get(&w.id).cloned().unwrap_or_else(|| "report interrupted by another rank's failure".into()),
                    ));
                }
            }
        }
        self.timings.insert("report".into(), t.elapsed().as_secs_f64());
        evaluate(self.cluster.tp, self.cluster.dp, self.source_desc.clone(), rows, self.golden.as_ref(), self.timings.clone())
    }
}

/// A report for a launch that failed before every rank could report. A rank whose process
/// exited says so (its RPC error is only the symptom).
async fn failure_report(plan: &LaunchPlan, cluster: &Cluster, failures: Failures, timings: BTreeMap<String, f64>) -> ConsistencyReport {
    let mut f: BTreeMap<u32, String> = failures.into_iter().collect();
    for w in &cluster.workers {
        if let (Some(msg), Ok(Some(status))) = (f.get_mut(&w.id), w.child.lock().await.try_wait())
            && !msg.contains("exited")
        {
            *msg = format!("{} exited ({status}); {msg}", w.label());
        }
    }
    let rows = cluster
        .workers
        .iter()
        .map(|w| failed_row(w.id, w.dp, w.tp, f.get(&w.id).cloned().unwrap_or_else(|| "stopped after another rank failed".into())))
        .collect();
    evaluate(plan.tp, plan.dp, plan.source_desc.clone(), rows, None, timings)
}

struct TokenFileGuard(Option<PathBuf>);

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
    // A token file this launch generated goes away with it, however the launch ends.
    let _token_file = TokenFileGuard(plan.token_generated.then(|| plan.token_file.clone()));
    let mut timings = BTreeMap::new();
    let registry = Arc::new(Registry::default());
    let session_slot = Arc::new(tokio::sync::Mutex::new(None));
    let shutdown = Arc::new(Notify::new());
    let service = CoordinatorService {
        registry: registry.clone(),
        session: session_slot.clone(),
        shutdown: shutdown.clone(),
        update_lock: Default::default(),
    };

    let listener = tokio::net::TcpListener::bind(plan.listen).await?;
    let address = listener.local_addr()?;
    let router = orchestrator_worker::grpc::standard_router::<CoordinatorServer<CoordinatorService>>().await?;
    let server_stop = Arc::new(Notify::new());
    let server = {
        let stop = server_stop.clone();
        tokio::spawn(
            router
                .add_service(tonic::service::interceptor::InterceptedService::new(
                    CoordinatorServer::new(service).max_decoding_message_size(16 << 20),
                    orchestrator_worker::auth::interceptor(Some(plan.token.clone())),
                ))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async move { stop.notified().await },
                ),
        )
    };
    eprintln!("coordinator listening on {address}; starting {} workers (TP {} x DP {})", plan.tp * plan.dp, plan.tp, plan.dp);

    let mut cluster = Cluster::spawn(
        plan.device,
        plan.tp,
        plan.dp,
        &format!("http://{address}"),
        registry,
        plan.token.clone(),
        &plan.token_file,
        &plan.allow_roots,
    )?;
    let up = async {
        cluster.connect_all(Duration::from_secs(30)).await?;
        cluster.assign(&plan.source, plan.scale_rule.name(), plan.fault, plan.dump_dir.as_deref()).await
    };
    if let Err(f) = up.await {
        timings.insert("startup".into(), start.elapsed().as_secs_f64());
        let report = failure_report(&plan, &cluster, f, timings).await;
        cluster.kill_all().await;
        emit_report(&report);
        server_stop.notify_one();
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
    let load_seconds = match loaded {
        Ok(results) => {
            let mut failures = Vec::new();
            let mut seconds = BTreeMap::new();
            for (id, r) in results {
                match r {
                    Ok(s) => {
                        seconds.insert(id, s);
                    }
                    Err(e) => failures.push((id, e)),
                }
            }
            if !failures.is_empty() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let report = failure_report(&plan, &cluster, failures, timings).await;
                cluster.kill_all().await;
                emit_report(&report);
                server_stop.notify_one();
                return Ok(false);
            }
            seconds
        }
        Err(f) => {
            let report = failure_report(&plan, &cluster, f, timings).await;
            cluster.kill_all().await;
            emit_report(&report);
            server_stop.notify_one();
            return Ok(false);
        }
    };
    let golden = match golden {
        Some(task) => Some(task.await??),
        None => None,
    };

    let rotation = Arc::new(crate::update::Rotation::new(vec![plan.local_source.version(); plan.dp as usize]));
    let mut session = Session {
        cluster: Arc::new(cluster),
        rotation,
        config: plan.local_source.config().clone(),
        source_desc: plan.source_desc.clone(),
        probe: plan.probe,
        golden,
        load_seconds,
        timings,
    };
    let report = session.check(true).await;
    session.timings.insert("total".into(), start.elapsed().as_secs_f64());
    let mut report = report;
    report.timings = session.timings.clone();
    emit_report(&report);

    if serve {
        let auth = format!("--coordinator http://{address} --token-file {}", plan.token_file.display());
        eprintln!("serving: `orchestrator report {auth}` re-runs the checks; `orchestrator shutdown {auth}` stops");
        *session_slot.lock().await = Some(session);
        tokio::select! {
            _ = shutdown.notified() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        if let Some(session) = session_slot.lock().await.take() {
            session.cluster.shutdown().await;
        }
    } else {
        session.cluster.shutdown().await;
    }
    server_stop.notify_one();
    let _ = server.await;
    Ok(report.ok)
}
