//! [`WorkerService`]: the `Worker` RPCs over the rank's state ([`super::state`]). Loads, stages
//! and reloads stream their progress from blocking threads; stages, verification probes and
//! reports of staged weights run on the background pool, below serving.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use orchestrator_kernels::{Backend, Digest, ScaleRule};
use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::worker_server::Worker;
use tokio::sync::{Notify, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::probing::{Computed, adopt_round_trip, answer_of, compute_probe, keep_verified, reduce_and_answer};
use super::state::{
    InPlace, Plan, StageOptions, Staged, State, keep_or_drop, lock, prepare_spare, snapshot, still_holds, unshared, versions_of,
};
use crate::collective::RingListener;
use crate::device::AnyBackend;
use crate::faults::{Fault, inject_on};
use crate::loader::{RankLoader, RankWeights};
use crate::probe::ProbeSpec;
use crate::roundtrip::{RoundTripScratch, check_rank_with};
use crate::source::LoadSource;
use orchestrator_model::AllowedRoots;

/// The worker service.
#[derive(Clone)]
pub struct WorkerService {
    state: Arc<Mutex<State>>,
    shutdown: Arc<Notify>,
    host: String,
    roots: Arc<AllowedRoots>,
    /// The device this worker loads and probes on (the CPU unless started on a GPU).
    pub(super) backend: Arc<AnyBackend>,
    /// The IP the TP-ring listener binds and the host it is advertised as.
    ring_ip: std::net::IpAddr,
    advertise: String,
    /// grpc.health.v1 readiness: SERVING only while the coordinator says the replica is in
    /// rotation on this rank's active version (none in in-process tests).
    health: Option<orchestrator_net::grpc::Health>,
    /// What the reference computed for the versions and probes this rank was asked about
    /// (keyed by everything the reference depends on, so it outlives any one plan). Locked by
    /// a probe only to look up and to store, never while it holds the state lock.
    reference_cache: Arc<Mutex<crate::probe::ReferenceCache>>,
    /// The buffers every round trip of this rank (its loads' and stages') reuses.
    round_trip_scratch: Arc<RoundTripScratch<AnyBackend>>,
}

fn host_name() -> String {
    crate::placement::host_name(&|k| std::env::var(k).ok())
}

/// Builds the load source a request names ([`LoadSource::from_pb`]) as the gRPC status a
/// caller gets when it names nothing this worker may load.
fn source_from(pb_source: Option<&pb::LoadSource>, roots: &AllowedRoots) -> Result<LoadSource, Status> {
    Ok(LoadSource::from_pb(pb_source, roots)?)
}

type ProgressStream = Pin<Box<dyn Stream<Item = Result<pb::LoadProgress, Status>> + Send>>;

impl WorkerService {
    pub fn new(shutdown: Arc<Notify>, roots: AllowedRoots) -> Self {
        Self::with_backend(shutdown, roots, AnyBackend::Cpu(orchestrator_kernels::CpuBackend))
    }

    /// A worker on `backend` (a GPU, say).
    pub fn with_backend(shutdown: Arc<Notify>, roots: AllowedRoots, backend: AnyBackend) -> Self {
        Self {
            state: Arc::new(Mutex::new(State::default())),
            shutdown,
            host: host_name(),
            roots: Arc::new(roots),
            backend: Arc::new(backend),
            ring_ip: std::net::Ipv4Addr::LOCALHOST.into(),
            advertise: "127.0.0.1".into(),
            health: None,
            reference_cache: Default::default(),
            round_trip_scratch: Default::default(),
        }
    }

    /// Binds TP-ring listeners on `ip`, advertised as `host` (what peers on other machines reach).
    pub fn with_ring_address(mut self, ip: std::net::IpAddr, host: String) -> Self {
        self.ring_ip = ip;
        self.advertise = host;
        self
    }

    /// Reports readiness through `health`, under the host name `host`.
    pub fn with_health(mut self, health: orchestrator_net::grpc::Health, host: String) -> Self {
        self.health = Some(health);
        self.host = host;
        self
    }

    /// Not ready: the active weights are changing or are not verified (yet, or any more).
    async fn not_ready(&self) {
        if let Some(h) = &self.health {
            h.set(false).await;
        }
    }

    /// Runs `f` on the rank's state on a blocking thread: the state lock can be held for seconds
    /// by a probe's ring all-reduce (waiting on its peers), and waiting for it must never block
    /// the runtime that sends this worker's heartbeats.
    async fn with_state<T: Send + 'static>(&self, f: impl FnOnce(&mut State) -> Result<T, Status> + Send + 'static) -> Result<T, Status> {
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || f(&mut lock(&state))).await.map_err(|e| Status::internal(e.to_string()))?
    }

    /// [`WorkerService::load_stream`] started from a blocking thread (it takes the state lock).
    async fn load_stream_blocking(
        &self,
        reload_from: Option<LoadSource>,
        shadow: bool,
        stage: StageOptions,
    ) -> Result<ProgressStream, Status> {
        let service = self.clone();
        tokio::task::spawn_blocking(move || service.load_stream(reload_from, shadow, stage))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
    }

    /// Runs a load or reload on a blocking thread, streaming per-layer progress.
    /// `shadow`: load `reload_from` into fresh shadow buffers beside the active weights
    /// (a staged update) instead of into the active ones, doing what `stage` asks besides.
    fn load_stream(&self, reload_from: Option<LoadSource>, shadow: bool, stage: StageOptions) -> Result<ProgressStream, Status> {
        let ((source, tp, rank, dp_rank, rule, fault, total, dump_dir, epoch), spare) = {
            let mut st = lock(&self.state);
            if shadow {
                st.stage_epoch += 1;
                keep_or_drop(&mut st, |st| st.previous.take().and_then(|(w, _)| unshared(w)));
            }
            let epoch = st.stage_epoch;
            let plan = st.plan.as_ref().ok_or_else(|| Status::failed_precondition("no shard assigned yet (call Assign first)"))?;
            if reload_from.is_some() && st.weights.is_none() {
                return Err(Status::failed_precondition("nothing loaded to reload into"));
            }
            if let Some(new) = &reload_from {
                let (old, new) = (plan.source.config(), new.config());
                if old.geometry != new.geometry || old.format != new.format {
                    return Err(Status::failed_precondition(format!(
                        "the new version has geometry {:?} / {:?}, the running plan {:?} / {:?}",
                        new.geometry, new.format, old.geometry, old.format
                    )));
                }
            }
            let values = (
                plan.source.clone(),
                plan.tp_size,
                plan.tp_rank,
                plan.dp_rank,
                plan.rule,
                plan.fault,
                plan.source.config().geometry.layers,
                plan.dump_dir.clone(),
                epoch,
            );
            // A stage reloads into the kept buffers, if any.
            let spare = if shadow { st.spare.take() } else { None };
            (values, spare)
        };
        let reused = spare.is_some();
        let source = match reload_from {
            Some(s) => Arc::new(s),
            None => source,
        };
        let (tx, rx) = mpsc::channel(total + 2);
        let state = self.state.clone();
        let backend = self.backend.clone();
        let reference_cache = self.reference_cache.clone();
        let round_trip_scratch = self.round_trip_scratch.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let (mut reference_s, mut round_trip_s) = (0.0, 0.0);
            // Set when this load should be followed by preparing the spare buffers: the stage
            // epoch it saw, and its source.
            let mut spare_after = None;
            let done = std::sync::atomic::AtomicUsize::new(0);
            let progress = |_layer: usize| {
                let n = done.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                if fault == pb::Fault::CrashDuringLoad || (shadow && fault == pb::Fault::CrashDuringStage) {
                    eprintln!("worker rank {rank}: injected fault crash-during-load: exiting mid-load");
                    std::process::exit(101);
                }
                if shadow && fault == pb::Fault::SlowStage {
                    std::thread::sleep(Duration::from_secs(1));
                }
                let _ = tx.blocking_send(Ok(pb::LoadProgress {
                    layers_done: n as u32,
                    layers_total: total as u32,
                    finished: false,
                    load_seconds: 0.0,
                    version: String::new(),
                }));
            };
            let backend = &*backend;
            let result = (|| -> Result<(RankWeights<AnyBackend>, Option<crate::roundtrip::RoundTrip>), Status> {
                let loader =
                    RankLoader::new(backend, source.config(), tp, rank, rule).map_err(|e| Status::invalid_argument(e.to_string()))?;
                if shadow {
                    // Beside serving: on the background pool, below the probes' priority.
                    let mut w = crate::background::run(|| match spare {
                        Some(kept) => loader.reload_with_progress(kept, &source, &progress),
                        None => loader.load_with_progress(&source, &progress),
                    })
                    .map_err(|e| Status::internal(format!("stage: {e:#}")))?;
                    if let Some(spec) = stage.reference {
                        reference_s = crate::background::run(|| crate::probe::prepare_reference(&loader, &source, spec, &reference_cache))
                            .map_err(|e| Status::internal(format!("stage: the reference of probe {spec}: {e:#}")))?;
                    }
                    if fault == pb::Fault::StageSkipPermute {
                        inject_on(backend, &mut w, Fault::SkipQPermutation)
                            .map_err(|e| Status::internal(format!("fault injection: {e}")))?;
                        w.refresh_kernel_digests(backend).map_err(|e| Status::internal(e.to_string()))?;
                    }
                    // The round trip of the weights as they will serve, while the replica still
                    // serves the active ones (verification out of rotation only reads it).
                    if stage.defer_round_trip {
                        return Ok((w, None));
                    }
                    let t = Instant::now();
                    let rt = crate::background::run(|| check_rank_with(backend, &w, &source, &round_trip_scratch));
                    round_trip_s = t.elapsed().as_secs_f64();
                    return Ok((w, Some(rt)));
                }
                // The active weights' buffers are reloaded in place, unless a probe or report still
                // reads them (it finds them gone when it answers): then into fresh ones.
                let previous = lock(&state).weights.take();
                let generation = previous.as_ref().map_or(0, |w| w.generation);
                let mut w = match previous.and_then(unshared) {
                    Some(old) => loader.reload_with_progress(old, &source, &progress),
                    None => loader.load_with_progress(&source, &progress),
                }
                .map_err(|e| Status::internal(format!("load: {e:#}")))?;
                w.generation = generation + 1;
                let injected = match fault {
                    pb::Fault::SkipPermute => Some(Fault::SkipQPermutation),
                    pb::Fault::DoublePermute => Some(Fault::DoubleQPermutation),
                    pb::Fault::StaleReload => Some(Fault::StaleReload),
                    _ => None,
                };
                if let Some(f) = injected {
                    inject_on(backend, &mut w, f).map_err(|e| Status::internal(format!("fault injection: {e}")))?;
                    w.refresh_kernel_digests(backend).map_err(|e| Status::internal(e.to_string()))?;
                }
                if let Some(dir) = &dump_dir {
                    crate::dump::dump_rank(backend, &w, dir).map_err(|e| Status::internal(format!("dump: {e}")))?;
                }
                Ok((w, None))
            })();
            // The load alone (a prepared reference and the round trip are not part of it).
            let seconds = started.elapsed().as_secs_f64() - reference_s - round_trip_s;
            if reference_s > 0.0 {
                tracing::info!(tp_rank = rank, replica = dp_rank, seconds = reference_s, "prepared the staged version's reference");
            }
            if round_trip_s > 0.0 {
                tracing::info!(tp_rank = rank, replica = dp_rank, seconds = round_trip_s, "ran the staged version's round trip");
            }
            match result {
                Ok((w, round_trip)) => {
                    let version = source.version();
                    let path = match (shadow, &*source) {
                        (true, _) if reused => "restage",
                        (true, _) => "stage",
                        (false, LoadSource::Dummy { .. }) => "dummy",
                        (false, _) => "real",
                    };
                    crate::metrics::worker().loaded(dp_rank, rank, path, seconds, w.source_bytes());
                    tracing::info!(tp_rank = rank, replica = dp_rank, version = %version, path, seconds, bytes = w.source_bytes(), "loaded");
                    if !shadow {
                        crate::metrics::worker().serving(dp_rank, rank, &version);
                    }
                    let mut st = lock(&state);
                    if shadow {
                        if st.stage_epoch != epoch {
                            drop(st);
                            let _ = tx.blocking_send(Err(Status::aborted("stage: superseded by a later stage or abort")));
                            return;
                        }
                        st.shadow = Some(Staged { weights: Arc::new(w), source, round_trip, path, seconds });
                    } else {
                        st.weights = Some(Arc::new(w));
                        st.committed_round_trip = None;
                        st.committed_probe = None;
                        st.load_seconds = seconds;
                        st.load_path = path;
                        if let Some(p) = st.plan.as_mut() {
                            p.source = source.clone();
                        }
                        if st.spare.is_none() && st.plan.as_ref().is_some_and(|p| p.keep_staging_buffers) {
                            spare_after = Some((st.stage_epoch, source.clone()));
                        }
                    }
                    drop(st);
                    let _ = tx.blocking_send(Ok(pb::LoadProgress {
                        layers_done: total as u32,
                        layers_total: total as u32,
                        finished: true,
                        load_seconds: seconds,
                        version,
                    }));
                }
                Err(status) => {
                    let _ = tx.blocking_send(Err(status));
                }
            }
            // The load's stream ends here; the spare buffers are prepared after it.
            drop(tx);
            if let Some((epoch, source)) = spare_after {
                prepare_spare(&state, backend, &source, (tp, rank, dp_rank), rule, epoch);
            }
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn assign(&self, request: Request<pb::AssignRequest>) -> Result<Response<pb::AssignResponse>, Status> {
        let r = request.into_inner();
        let source = tokio::task::spawn_blocking({
            let s = r.source.clone();
            let roots = self.roots.clone();
            move || source_from(s.as_ref(), &roots)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
        let rule: ScaleRule = r.scale_rule.parse().map_err(Status::invalid_argument)?;
        let (tp, rank) = (r.tp_size as usize, r.tp_rank as usize);
        orchestrator_model::RankShard::new(&source.config().geometry, tp, rank).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let listener = RingListener::bind(SocketAddr::new(self.ring_ip, 0))
            .map_err(|e| Status::internal(format!("collective listener on {}: {e}", self.ring_ip)))?;
        let address = crate::placement::join_host_port(&self.advertise, listener.local_addr().port());
        self.not_ready().await;
        // A GPU group's rank 0 creates the NCCL unique id; the coordinator relays it to the group.
        let nccl_unique_id = if rank == 0 && self.backend.is_cuda() {
            self.backend.nccl_unique_id().map_err(|e| Status::internal(format!("NCCL unique id: {e}")))?
        } else {
            Vec::new()
        };
        let mut st = lock(&self.state);
        let stage_epoch = st.stage_epoch + 1;
        *st = State {
            plan: Some(Plan {
                tp_size: tp,
                tp_rank: rank,
                dp_size: r.dp_size as usize,
                dp_rank: r.dp_rank as usize,
                source: Arc::new(source),
                rule,
                fault: r.fault(),
                dump_dir: (!r.dump_dir.is_empty()).then(|| std::path::PathBuf::from(&r.dump_dir).join(format!("dp{}", r.dp_rank))),
                keep_staging_buffers: r.keep_staging_buffers,
            }),
            listener: Some(listener),
            stage_epoch,
            ..State::default()
        };
        Ok(Response::new(pb::AssignResponse { collective_address: address, nccl_unique_id }))
    }

    type LoadStream = ProgressStream;

    async fn load(&self, _request: Request<pb::LoadRequest>) -> Result<Response<Self::LoadStream>, Status> {
        self.not_ready().await;
        self.load_stream_blocking(None, false, StageOptions::default()).await.map(Response::new)
    }

    type ReloadStream = ProgressStream;

    async fn reload(&self, request: Request<pb::ReloadRequest>) -> Result<Response<Self::ReloadStream>, Status> {
        let r = request.into_inner();
        let source = match r.source {
            Some(s) => {
                let roots = self.roots.clone();
                Some(
                    tokio::task::spawn_blocking(move || source_from(Some(&s), &roots))
                        .await
                        .map_err(|e| Status::internal(e.to_string()))??,
                )
            }
            None => {
                // The assigned source, opened again (outside the state lock: opening hashes it).
                let assigned = self.with_state(|st| Ok(st.plan.as_ref().map(|p| p.source.clone()))).await?;
                let assigned = assigned.ok_or_else(|| Status::failed_precondition("no shard assigned"))?;
                let roots = self.roots.clone();
                Some(
                    tokio::task::spawn_blocking(move || match assigned.as_ref() {
                        LoadSource::Safetensors(c) => {
                            LoadSource::open_checkpoint_within(c.dir(), &roots).map_err(|e| Status::permission_denied(e.to_string()))
                        }
                        LoadSource::Dummy { config, generator } => Ok(LoadSource::Dummy { config: config.clone(), generator: *generator }),
                    })
                    .await
                    .map_err(|e| Status::internal(e.to_string()))??,
                )
            }
        };
        self.not_ready().await;
        self.load_stream_blocking(source, false, StageOptions::default()).await.map(Response::new)
    }

    type StageStream = ProgressStream;

    async fn stage(&self, request: Request<pb::StageRequest>) -> Result<Response<Self::StageStream>, Status> {
        let r = request.into_inner();
        let s = r.source.ok_or_else(|| Status::invalid_argument("stage: source is missing"))?;
        let reference = match r.reference {
            Some(p) => {
                let spec = ProbeSpec { tokens: p.tokens as usize, latents: p.latents as usize, seed: p.seed };
                orchestrator_model::limits::check_probe(spec.tokens, spec.latents)
                    .map_err(|e| Status::invalid_argument(format!("stage: reference: {e}")))?;
                Some(spec)
            }
            None => None,
        };
        let roots = self.roots.clone();
        // Opening the new version hashes its content: background work too, off the serving pool.
        let source = tokio::task::spawn_blocking(move || crate::background::run(|| source_from(Some(&s), &roots)))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        let options = StageOptions { reference, defer_round_trip: r.defer_round_trip };
        self.load_stream_blocking(Some(source), true, options).await.map(Response::new)
    }

    async fn commit(&self, request: Request<pb::CommitRequest>) -> Result<Response<pb::CommitResponse>, Status> {
        let expected = request.into_inner().expected_version;
        let slow = self.with_state(|st| Ok(st.plan.as_ref().is_some_and(|p| p.fault == pb::Fault::SlowCommit))).await?;
        if slow {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        // Mid-swap, and the new version is verified in rotation only after the swap.
        self.not_ready().await;
        self.with_state(move |st| {
            let InPlace { version, generation } = st.commit(&expected)?;
            Ok(pb::CommitResponse { checkpoint_version: version, generation, staged_version: String::new() })
        })
        .await
        .map(Response::new)
    }

    async fn abort(&self, request: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let pb::AbortRequest { rollback, expected_version } = request.into_inner();
        if rollback {
            self.not_ready().await;
        }
        self.with_state(move |st| Ok(pb::AbortResponse { checkpoint_version: st.abort(rollback, &expected_version)? }))
            .await
            .map(Response::new)
    }

    async fn release(&self, _request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.with_state(|st| {
            st.release();
            Ok(pb::ReleaseResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn report(&self, request: Request<pb::ReportRequest>) -> Result<Response<pb::RankReport>, Status> {
        let pb::ReportRequest { shadow, brief, kept_round_trip, identical_to } = request.into_inner();
        let state = self.state.clone();
        let host = self.host.clone();
        let backend = self.backend.clone();
        let round_trip_scratch = self.round_trip_scratch.clone();
        tokio::task::spawn_blocking(move || {
            let work = move || {
                let mut st = lock(&state);
                let plan = st.plan.as_ref().ok_or_else(|| Status::failed_precondition("no shard assigned"))?;
                if brief {
                    let (checkpoint_version, staged_version) = versions_of(&st);
                    return Ok(Response::new(pb::RankReport {
                        tp_size: plan.tp_size as u32,
                        tp_rank: plan.tp_rank as u32,
                        dp_size: plan.dp_size as u32,
                        dp_rank: plan.dp_rank as u32,
                        host: host.clone(),
                        device: backend.name(),
                        pid: std::process::id(),
                        checkpoint_version,
                        staged_version,
                        previous_version: st.previous.as_ref().map(|(_, s)| s.version()).unwrap_or_default(),
                        generation: st.weights.as_ref().map_or(0, |w| w.generation),
                        round_trip_failures: vec!["not checked (brief report)".into()],
                        ..Default::default()
                    }));
                }
                // What the report says of the rank, as it is now; the round trip, where one runs,
                // reads the weights without the state lock (probes go on meanwhile).
                let (plan, w, source) = snapshot(&st, shadow)?;
                // A stage that deferred its round trip takes the verdict of the verified rank
                // whose bytes its own equal, and keeps it for the commit.
                if let (true, Some(staged), Some(proof)) = (shadow, st.shadow.as_mut(), identical_to.as_ref())
                    && staged.round_trip.is_none()
                {
                    staged.round_trip = adopt_round_trip(&w, proof);
                }
                let kept = match (&st.shadow, shadow, &st.committed_round_trip) {
                    (Some(staged), true, _) => staged.round_trip.clone(),
                    (_, false, Some((generation, rt))) if kept_round_trip && *generation == w.generation => Some(rt.clone()),
                    _ => None,
                };
                let (load_seconds, staged_version, spare_buffers) = (st.load_seconds, versions_of(&st).1, st.spare.is_some());
                let previous_version = st.previous.as_ref().map(|(_, s)| s.version()).unwrap_or_default();
                let load_path = match (&st.shadow, shadow) {
                    (Some(staged), true) => staged.path,
                    _ => st.load_path,
                };
                drop(st);
                let rt = kept.unwrap_or_else(|| {
                    let rt = check_rank_with(&*backend, &w, &source, &round_trip_scratch);
                    // A deferred round trip, once run, stands for the stage as the stage's own would.
                    let mut st = lock(&state);
                    if let (true, Some(staged)) = (shadow, st.shadow.as_mut())
                        && Arc::ptr_eq(&staged.weights, &w)
                        && staged.round_trip.is_none()
                    {
                        staged.round_trip = Some(rt.clone());
                    }
                    rt
                });
                let id = &w.identity;
                let canonical = id.canonical_text();
                let geometry_text: String = canonical.lines().filter(|l| !l.starts_with("rank=")).map(|l| format!("{l}\n")).collect();
                Ok(Response::new(pb::RankReport {
                    tp_size: plan.tp_size as u32,
                    tp_rank: plan.tp_rank as u32,
                    dp_size: plan.dp_size as u32,
                    dp_rank: plan.dp_rank as u32,
                    host,
                    device: backend.name(),
                    pid: std::process::id(),
                    load_format: w.load_format.to_string(),
                    source: w.source.clone(),
                    checkpoint_version: source.version(),
                    identity: Some(pb::LayoutIdentity {
                        layout_version: id.layout_version,
                        digest: id.digest.clone(),
                        canonical_text: canonical,
                        tp_size: id.tp_size as u32,
                        rank: id.rank as u32,
                        weight_format: id.weight_format.clone(),
                        scale_rule: id.scale_rule.clone(),
                        geometry_digest: Digest::of(geometry_text.as_bytes()).hex(),
                    }),
                    kernel_rank_digest: w.kernel_rank_digest().hex(),
                    source_rank_digest: w.source_rank_digest().hex(),
                    kernel_tensors: w
                        .kernel_digests()
                        .into_iter()
                        .map(|d| pb::TensorDigest {
                            name: d.name.clone(),
                            dtype: d.dtype.clone(),
                            shape: d.shape.iter().map(|&x| x as u64).collect(),
                            bytes: d.bytes as u64,
                            digest: d.digest.hex(),
                        })
                        .collect(),
                    round_trip_ok: rt.ok,
                    round_trip_failures: rt.failures.iter().map(ToString::to_string).collect(),
                    round_trip_failure_details: rt.failures.iter().map(Into::into).collect(),
                    round_trip_identical_to: rt.identical_to.unwrap_or_default(),
                    load_seconds,
                    generation: w.generation,
                    staged_version,
                    previous_version,
                    load_path: load_path.into(),
                    spare_buffers,
                }))
            };
            // The round trip of a staged version is background work too.
            if shadow { crate::background::run(work) } else { work() }
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
    }

    async fn probe(&self, request: Request<pb::ProbeRequest>) -> Result<Response<pb::ProbeResult>, Status> {
        let r = request.into_inner();
        let state = self.state.clone();
        let backend = self.backend.clone();
        let reference_cache = self.reference_cache.clone();
        let phase = r.phase();
        if phase != pb::ProbePhase::Whole && !r.shadow {
            return Err(Status::invalid_argument("probe: a probe in halves is of the staged version (shadow) only"));
        }
        if r.kept && (phase != pb::ProbePhase::Whole || r.shadow) {
            return Err(Status::invalid_argument("probe: a kept probe answers a whole probe of the active weights only"));
        }
        // Verifying a staged version is background work: below the serving probes' priority.
        let background = r.shadow;
        tokio::task::spawn_blocking(move || {
            let work = move || {
                let spec = ProbeSpec { tokens: r.tokens as usize, latents: r.latents as usize, seed: r.seed };
                orchestrator_model::limits::check_probe(spec.tokens, spec.latents)
                    .map_err(|e| Status::invalid_argument(format!("probe: {e}")))?;
                let check = !r.skip_reference;
                if r.kept {
                    // Nothing computed, no ring joined: answered from what the rank kept, or refused.
                    let st = lock(&state);
                    let generation = st.weights.as_ref().map(|w| w.generation);
                    return match &st.committed_probe {
                        Some((g, k)) if Some(*g) == generation && k.spec == spec && k.check == check => {
                            Ok(Response::new(k.answer(&st, *g)))
                        }
                        _ => Err(Status::failed_precondition(format!(
                            "probe: no kept verification probe of the active weights (generation {}) for this probe",
                            generation.unwrap_or(0)
                        ))),
                    };
                }
                match phase {
                    pb::ProbePhase::Whole | pb::ProbePhase::Compute => {
                        // The weights are shared, not borrowed: nothing is locked while they
                        // compute, so the rank's other probes, reports and updates go on.
                        let (plan, weights, source) = snapshot(&lock(&state), r.shadow)?;
                        let c = compute_probe(&backend, &plan, &weights, &source, spec, check, &reference_cache)?;
                        let mut st = lock(&state);
                        let holds = still_holds(&st, r.shadow, &weights);
                        if phase == pb::ProbePhase::Whole {
                            if !holds {
                                return Err(Status::aborted("probe: the weights it computed on were replaced meanwhile (ask again)"));
                            }
                            let answer = reduce_and_answer(&mut st, &backend, &r, &c)?;
                            if r.shadow {
                                keep_verified(&mut st, Arc::downgrade(&weights), spec, check, c, &answer);
                            }
                            return Ok(Response::new(answer));
                        }
                        let answer = answer_of(&st, &c, String::new(), 0.0);
                        // Kept only while it is of what the rank has staged.
                        if holds {
                            st.computed = Some(Computed { weights: Arc::downgrade(&weights), spec, check, probe: c });
                        }
                        Ok(Response::new(answer))
                    }
                    pb::ProbePhase::Reduce => {
                        let mut st = lock(&state);
                        let staged = st.shadow.as_ref().map(|s| Arc::as_ptr(&s.weights));
                        let kept = st.computed.take().filter(|k| k.spec == spec && k.check == check && staged == Some(k.weights.as_ptr()));
                        let kept = kept.ok_or_else(|| {
                            Status::failed_precondition("probe: nothing computed to reduce for this probe of the staged version")
                        })?;
                        let answer = reduce_and_answer(&mut st, &backend, &r, &kept.probe)?;
                        keep_verified(&mut st, kept.weights, spec, check, kept.probe, &answer);
                        Ok(Response::new(answer))
                    }
                }
            };
            if background { crate::background::run(work) } else { work() }
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
    }

    async fn set_serving(&self, request: Request<pb::SetServingRequest>) -> Result<Response<pb::SetServingResponse>, Status> {
        let pb::SetServingRequest { serving, version } = request.into_inner();
        if serving {
            let (active, _) = self.with_state(|st| Ok(versions_of(st))).await?;
            if active.is_empty() || active != version {
                self.not_ready().await;
                return Err(Status::failed_precondition(format!(
                    "set serving: this rank holds version `{active}`, not the verified `{version}`"
                )));
            }
        }
        if let Some(h) = &self.health {
            h.set(serving).await;
        }
        Ok(Response::new(pb::SetServingResponse {}))
    }

    async fn shutdown(&self, _request: Request<pb::ShutdownRequest>) -> Result<Response<pb::ShutdownResponse>, Status> {
        self.shutdown.notify_one();
        Ok(Response::new(pb::ShutdownResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orchestrator_model::ModelConfig;
    use orchestrator_model::synth::{SynthOptions, write_checkpoint};
    use orchestrator_proto::v1::load_source::Kind;

    #[test]
    fn checkpoints_outside_the_allowed_roots_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, other) = (tmp.path().join("allowed"), tmp.path().join("other"));
        let config = ModelConfig::from_preset(orchestrator_model::Preset::Tiny, Some(1), false).unwrap();
        for dir in [root.join("ckpt"), other.join("ckpt")] {
            write_checkpoint(&dir, &SynthOptions { config: config.clone(), seed: 1, max_shard_bytes: 1 << 30, preset_name: None }).unwrap();
        }
        let roots = AllowedRoots::new(std::slice::from_ref(&root)).unwrap();
        let src = |p: &std::path::Path| pb::LoadSource { kind: Some(Kind::CheckpointDir(p.display().to_string())), content: None };
        assert!(source_from(Some(&src(&root.join("ckpt"))), &roots).is_ok());
        for bad in [other.join("ckpt"), root.join("ckpt/../../other/ckpt")] {
            let e = source_from(Some(&src(&bad)), &roots).err().unwrap();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{bad:?}");
            assert!(e.message().contains(&bad.display().to_string()), "{}", e.message());
        }
        #[cfg(unix)]
        {
            let link = root.join("escape");
            std::os::unix::fs::symlink(other.join("ckpt"), &link).unwrap();
            assert_eq!(source_from(Some(&src(&link)), &roots).err().unwrap().code(), tonic::Code::PermissionDenied);
        }
        // No roots: no checkpoint directory at all; dummy sources need none.
        assert!(source_from(Some(&src(&root.join("ckpt"))), &AllowedRoots::default()).is_err());
        let dummy = pb::LoadSource {
            content: None,
            kind: Some(Kind::Dummy(pb::DummySource { preset: "tiny".into(), layers: 1, seed: 0, bf16: false })),
        };
        assert!(source_from(Some(&dummy), &AllowedRoots::default()).is_ok());
    }

    /// Runs a load, reload or stage stream to its end.
    async fn drain(stream: Result<Response<ProgressStream>, Status>) {
        use tokio_stream::StreamExt;
        let mut stream = stream.unwrap().into_inner();
        while let Some(p) = stream.next().await {
            p.unwrap();
        }
    }

    async fn round_trip_ok(svc: &WorkerService, kept_round_trip: bool) -> bool {
        let req = Request::new(pb::ReportRequest { kept_round_trip, ..Default::default() });
        svc.report(req).await.unwrap().into_inner().round_trip_ok
    }

    /// A TP 1 worker on tiny checkpoint `A` (loaded), with `B` and `C` beside it to stage.
    async fn loaded_worker(tmp: &std::path::Path) -> (WorkerService, impl Fn(&str) -> pb::LoadSource) {
        let config = ModelConfig::from_preset(orchestrator_model::Preset::Tiny, Some(1), false).unwrap();
        for (name, seed) in [("A", 1), ("B", 2), ("C", 3)] {
            let opts = SynthOptions { config: config.clone(), seed, max_shard_bytes: 1 << 30, preset_name: None };
            write_checkpoint(&tmp.join(name), &opts).unwrap();
        }
        let dir = tmp.to_path_buf();
        let src = move |name: &str| pb::LoadSource { kind: Some(Kind::CheckpointDir(dir.join(name).display().to_string())), content: None };
        let svc = WorkerService::new(Arc::new(Notify::new()), AllowedRoots::new(&[tmp.to_path_buf()]).unwrap());
        let assign = pb::AssignRequest { tp_size: 1, dp_size: 1, source: Some(src("A")), scale_rule: "rceil".into(), ..Default::default() };
        svc.assign(Request::new(assign)).await.unwrap();
        drain(svc.load(Request::new(pb::LoadRequest {})).await).await;
        (svc, src)
    }

    async fn stage(svc: &WorkerService, source: pb::LoadSource) {
        stage_with(svc, source, false).await
    }

    async fn stage_with(svc: &WorkerService, source: pb::LoadSource, defer_round_trip: bool) {
        drain(svc.stage(Request::new(pb::StageRequest { source: Some(source), reference: None, defer_round_trip })).await).await;
    }

    /// A later replica's stage defers its round trip: its verification report adopts the
    /// verdict of the verified rank whose digests its own equal, says whose it is, and keeps it
    /// for the commit. A proof of other bytes is not adopted: the rank runs its own round trip
    /// (which here catches staged weights damaged in memory).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deferred_round_trip_is_adopted_only_from_a_rank_of_the_same_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let staged_report = async |identical_to: Option<pb::RoundTripProof>| {
            let req = pb::ReportRequest { shadow: true, identical_to, ..Default::default() };
            svc.report(Request::new(req)).await.unwrap().into_inner()
        };
        // The first replica's stage runs its round trip: what it reports is a later one's proof.
        stage(&svc, src("B")).await;
        let first = staged_report(None).await;
        assert!(first.round_trip_ok && first.round_trip_identical_to.is_empty());
        let proof = pb::RoundTripProof {
            kernel_rank_digest: first.kernel_rank_digest.clone(),
            source_rank_digest: first.source_rank_digest.clone(),
            rank: "dp0/tp0".into(),
        };
        // The same bytes: adopted, and kept for the commit.
        stage_with(&svc, src("B"), true).await;
        assert!(lock(&svc.state).shadow.as_ref().unwrap().round_trip.is_none(), "the stage ran no round trip");
        let adopted = staged_report(Some(proof.clone())).await;
        assert!(adopted.round_trip_ok);
        assert_eq!(adopted.round_trip_identical_to, "dp0/tp0");
        svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() })).await.unwrap();
        let req = pb::ReportRequest { kept_round_trip: true, ..Default::default() };
        let committed = svc.report(Request::new(req)).await.unwrap().into_inner();
        assert!(committed.round_trip_ok);
        assert_eq!(committed.round_trip_identical_to, "dp0/tp0");
        // A proof of other bytes (version A's): the rank runs its own round trip, which passes.
        stage_with(&svc, src("A"), true).await;
        let own = staged_report(Some(proof.clone())).await;
        assert!(own.round_trip_ok && own.round_trip_identical_to.is_empty());
        // Staged B damaged in memory (its digests taken again): not the proof's bytes, so the
        // rank's own round trip runs, and fails.
        stage_with(&svc, src("B"), true).await;
        {
            let mut st = lock(&svc.state);
            let w = Arc::get_mut(&mut st.shadow.as_mut().unwrap().weights).unwrap();
            crate::faults::inject_on(&*svc.backend, w, Fault::SkipQPermutation).unwrap();
            w.refresh_kernel_digests(&*svc.backend).unwrap();
        }
        let damaged = staged_report(Some(proof)).await;
        assert!(!damaged.round_trip_ok, "{:?}", damaged.round_trip_failures);
        assert!(damaged.round_trip_identical_to.is_empty());
        assert!(
            lock(&svc.state).shadow.as_ref().unwrap().round_trip.as_ref().is_some_and(|rt| !rt.ok),
            "the stage keeps the verdict it ran"
        );
    }

    /// A report asked for the kept round trip answers with the one the stage ran on the weights
    /// it committed, only while the rank holds that generation; any other report runs it again
    /// (here it catches weights damaged in memory after the commit).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_round_trip_stands_only_for_the_generation_it_was_run_on() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        // Loaded, never committed: nothing kept, the round trip runs.
        assert!(round_trip_ok(&svc, true).await);
        stage(&svc, src("B")).await;
        svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() })).await.unwrap();
        // The committed weights damaged in place (wq_b back in checkpoint order).
        {
            let mut st = lock(&svc.state);
            let w = Arc::get_mut(st.weights.as_mut().unwrap()).unwrap();
            crate::faults::inject_on(&*svc.backend, w, Fault::SkipQPermutation).unwrap();
        }
        assert!(!round_trip_ok(&svc, false).await, "a fresh round trip reads what the rank holds");
        assert!(round_trip_ok(&svc, true).await, "the kept verdict is the stage's");
        // Another generation of weights: the kept verdict no longer answers.
        Arc::get_mut(lock(&svc.state).weights.as_mut().unwrap()).unwrap().generation += 1;
        assert!(!round_trip_ok(&svc, true).await);
    }

    async fn probe(svc: &WorkerService, phase: pb::ProbePhase, shadow: bool, seed: u64) -> Result<pb::ProbeResult, Status> {
        let req = pb::ProbeRequest { tokens: 2, latents: 16, seed, shadow, phase: phase.into(), ..Default::default() };
        svc.probe(Request::new(req)).await.map(Response::into_inner)
    }

    /// A staged version's probe in halves gives what the whole probe gives; its second half
    /// reduces only what the first computed on the weights staged now, for the same probe; and
    /// staged weights a first half still computes on are not swapped in.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_in_halves_reduces_only_what_its_first_half_computed_on_the_staged_weights() {
        use pb::ProbePhase::{Compute, Reduce, Whole};
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        assert_eq!(probe(&svc, Compute, false, 0).await.unwrap_err().code(), tonic::Code::InvalidArgument, "the active weights");
        stage(&svc, src("B")).await;
        let whole = probe(&svc, Whole, true, 0).await.unwrap();
        assert!(!whole.y_digest.is_empty() && whole.ok);
        assert_eq!(probe(&svc, Reduce, true, 0).await.unwrap_err().code(), tonic::Code::FailedPrecondition, "nothing computed");
        let first = probe(&svc, Compute, true, 0).await.unwrap();
        assert!(first.y_digest.is_empty() && first.ok);
        assert_eq!((&first.y_partial_digest, &first.probed_version), (&whole.y_partial_digest, &whole.probed_version));
        let reduced = probe(&svc, Reduce, true, 0).await.unwrap();
        assert_eq!((reduced.y_digest.as_str(), reduced.ok), (whole.y_digest.as_str(), true));
        // Reduced once: the kept half is gone.
        assert_eq!(probe(&svc, Reduce, true, 0).await.unwrap_err().code(), tonic::Code::FailedPrecondition);
        // Another probe, or another stage since the first half: refused.
        probe(&svc, Compute, true, 0).await.unwrap();
        assert_eq!(probe(&svc, Reduce, true, 1).await.unwrap_err().code(), tonic::Code::FailedPrecondition, "another seed");
        probe(&svc, Compute, true, 0).await.unwrap();
        stage(&svc, src("C")).await;
        assert_eq!(probe(&svc, Reduce, true, 0).await.unwrap_err().code(), tonic::Code::FailedPrecondition, "restaged");
        // Staged weights still shared with a computation are not swapped in until it lets go.
        let computing = lock(&svc.state).shadow.as_ref().unwrap().weights.clone();
        let commit = || svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() }));
        assert_eq!(commit().await.unwrap_err().code(), tonic::Code::Unavailable);
        assert!(lock(&svc.state).shadow.is_some(), "still staged");
        drop(computing);
        commit().await.unwrap();
        assert!(lock(&svc.state).shadow.is_none());
    }

    /// The probe right after a commit is answered from the verification probe the rank kept of
    /// the very weights it committed (its answer, on their new generation), for that probe with
    /// the same reference check, while the rank holds that generation; anything else is refused
    /// without computing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_probe_after_a_commit_answers_from_the_verification_probe_kept_of_those_weights() {
        use pb::ProbePhase::{Compute, Reduce, Whole};
        use tonic::Code::{FailedPrecondition, InvalidArgument};
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let kept = |seed: u64, skip_reference: bool, shadow: bool| {
            let req = pb::ProbeRequest { tokens: 2, latents: 16, seed, kept: true, skip_reference, shadow, ..Default::default() };
            svc.probe(Request::new(req))
        };
        let commit = || svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() }));
        let refused = |r: Result<Response<pb::ProbeResult>, Status>| r.unwrap_err().code();
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "loaded, nothing verified");
        stage(&svc, src("B")).await;
        assert_eq!(refused(kept(0, false, true).await), InvalidArgument, "of the staged weights");
        probe(&svc, Compute, true, 0).await.unwrap();
        let verified = probe(&svc, Reduce, true, 0).await.unwrap();
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "verified, not committed");
        commit().await.unwrap();
        let generation = lock(&svc.state).weights.as_ref().unwrap().generation;
        let answer = kept(0, false, false).await.unwrap().into_inner();
        assert!(answer.kept && answer.ok);
        assert_eq!(answer.generation, generation);
        assert_ne!(answer.generation, verified.generation, "the committed weights' generation");
        assert_eq!(answer.checkpoint_version, verified.probed_version);
        assert_eq!(
            (&answer.y_digest, &answer.y_partial_digest, &answer.probed_version, answer.q_mismatches, answer.z_max_abs_err),
            (&verified.y_digest, &verified.y_partial_digest, &verified.probed_version, verified.q_mismatches, verified.z_max_abs_err)
        );
        // Computing the same probe on the committed weights gives the same answer.
        let computed = probe(&svc, Whole, false, 0).await.unwrap();
        assert!(!computed.kept);
        assert_eq!((&computed.y_digest, computed.generation), (&answer.y_digest, generation));
        // Another probe, or the kernel pass alone where the reference was checked: refused.
        assert_eq!(refused(kept(1, false, false).await), FailedPrecondition, "another seed");
        assert_eq!(refused(kept(0, true, false).await), FailedPrecondition, "without the reference");
        // Weights of another generation: refused.
        Arc::get_mut(lock(&svc.state).weights.as_mut().unwrap()).unwrap().generation += 1;
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "another generation");
        // Verified, then restaged before the commit: the committed weights were never probed.
        stage(&svc, src("C")).await;
        probe(&svc, Whole, true, 0).await.unwrap();
        stage(&svc, src("B")).await;
        commit().await.unwrap();
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "restaged after the probe");
        // A whole probe of the staged weights is kept as the halves are; an abort drops it.
        stage(&svc, src("C")).await;
        let whole = probe(&svc, Whole, true, 0).await.unwrap();
        commit().await.unwrap();
        assert_eq!(kept(0, false, false).await.unwrap().into_inner().y_digest, whole.y_digest);
        stage(&svc, src("B")).await;
        probe(&svc, Whole, true, 0).await.unwrap();
        svc.abort(Request::new(pb::AbortRequest { rollback: false, expected_version: String::new() })).await.unwrap();
        stage(&svc, src("B")).await;
        commit().await.unwrap();
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "aborted after the probe");
    }

    /// A probe computes on the active weights without the state lock: while one is held up in
    /// its computation (here at the reference cache, which a thread of the test holds), a full report with
    /// its round trip, a release and a reload of the rank all answer; the probe then answers
    /// nothing for weights the rank no longer holds, and the next probe reads the new ones.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_computes_without_the_state_lock_and_answers_only_for_the_weights_it_read() {
        use std::time::Duration;
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        // The cache is held by a thread of its own until `release` is dropped (also on a panic).
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (locked, is_locked) = std::sync::mpsc::channel();
        let cache = svc.reference_cache.clone();
        let holder = std::thread::spawn(move || {
            let _held = cache.lock().unwrap();
            locked.send(()).unwrap();
            let _ = released.recv();
        });
        is_locked.recv().unwrap();
        let probing = tokio::spawn({
            let svc = svc.clone();
            async move { probe(&svc, pb::ProbePhase::Whole, false, 0).await }
        });
        // The probe took the weights (a second reference to them), then waits for the cache,
        // leaving the state lock free (tried, never waited for: a probe that kept it would
        // hold it until the test lets the cache go).
        let active = || lock(&svc.state).weights.clone().unwrap();
        let mut waited = 0;
        while !svc.state.try_lock().is_ok_and(|st| st.weights.as_ref().is_some_and(|w| Arc::strong_count(w) == 2)) {
            assert!(waited < 10_000, "the probe never took the weights, or kept the state lock");
            tokio::time::sleep(Duration::from_millis(1)).await;
            waited += 1;
        }
        let before = active().generation;
        async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
            tokio::time::timeout(Duration::from_secs(30), f).await.unwrap_or_else(|_| panic!("{what} waited for the probe"))
        }
        assert!(within("a report", round_trip_ok(&svc, false)).await);
        within("a release", svc.release(Request::new(pb::ReleaseRequest {}))).await.unwrap();
        let reload = svc.reload(Request::new(pb::ReloadRequest { source: Some(src("B")) }));
        within("a reload", async { drain(reload.await).await }).await;
        assert_eq!(active().generation, before + 1, "reloaded (into fresh buffers: the probe still reads the old ones)");
        drop(release);
        holder.join().unwrap();
        assert_eq!(probing.await.unwrap().unwrap_err().code(), tonic::Code::Aborted, "the weights it read were replaced");
        let fresh = probe(&svc, pb::ProbePhase::Whole, false, 0).await.unwrap();
        assert!(fresh.ok && fresh.generation == before + 1);
    }

    /// A rollback swaps the kept version back only when nothing reads it any more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rollback_waits_for_readers_of_the_kept_version() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let a = lock(&svc.state).plan.as_ref().unwrap().source.version();
        stage(&svc, src("B")).await;
        svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() })).await.unwrap();
        let reading = lock(&svc.state).previous.as_ref().unwrap().0.clone();
        let rollback = || svc.abort(Request::new(pb::AbortRequest { rollback: true, expected_version: a.clone() }));
        assert_eq!(rollback().await.unwrap_err().code(), tonic::Code::Unavailable);
        assert!(lock(&svc.state).previous.is_some(), "still kept");
        drop(reading);
        assert_eq!(rollback().await.unwrap().into_inner().checkpoint_version, a);
    }
}
