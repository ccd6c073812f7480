//! `orchestrator-worker serve`: the worker as a gRPC server. It registers with the
//! coordinator, heartbeats, and serves the `Worker` service (assign, load with streamed
//! progress, report, probe with the TP all-reduce, reload, shutdown), plus grpc.health.v1 and
//! server reflection. Heavy work runs on blocking threads; the state sits behind a mutex.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use orchestrator_kernels::{Backend, Digest, ScaleRule};
use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::coordinator_client::CoordinatorClient;
use orchestrator_proto::v1::worker_server::{Worker, WorkerServer};
use tokio::sync::{Notify, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::collective::{Collective, LocalCollective, RingListener, TcpRing};
use crate::device::{AnyBackend, DeviceCollectives};
use crate::faults::{Fault, inject_on};
use crate::loader::{RankLoader, RankWeights};
use crate::probe::{ProbeSpec, probe_rank_with};
use crate::roundtrip::{RoundTripScratch, check_rank_with};
use crate::source::LoadSource;
use orchestrator_model::AllowedRoots;
use orchestrator_net::auth::Token;

/// Deadline of every call the worker makes to the coordinator.
pub const RPC_DEADLINE: Duration = Duration::from_secs(5);

/// What the coordinator assigned.
#[derive(Clone)]
struct Plan {
    tp_size: usize,
    tp_rank: usize,
    dp_size: usize,
    dp_rank: usize,
    source: Arc<LoadSource>,
    rule: ScaleRule,
    fault: pb::Fault,
    dump_dir: Option<std::path::PathBuf>,
    /// Keep the buffers an update leaves (the version it replaced, or a staged one it dropped)
    /// for the next stage to reload into, instead of freeing them (`--keep-staging-buffers`).
    keep_staging_buffers: bool,
}

/// Weights that probes and reports may read while the rank goes on.
type SharedWeights = Arc<RankWeights<AnyBackend>>;

#[derive(Default)]
struct State {
    plan: Option<Plan>,
    /// The active weights, shared with the probes and reports that read them: those hold the
    /// state lock only to take them and to answer, never while they compute.
    weights: Option<SharedWeights>,
    /// A staged version (rolling update): loaded beside the active weights, swapped in by Commit.
    shadow: Option<Staged>,
    /// Buffers kept for the next stage (with `keep_staging_buffers`): the weights of a version
    /// an update replaced or dropped, which the next stage reloads into (a reload reuses every
    /// buffer) instead of faulting in fresh memory. The rank then holds two sets of weights
    /// between updates, never more than two.
    spare: Option<RankWeights<AnyBackend>>,
    /// The version the last Commit replaced, kept so that an explicit, journaled abort of the
    /// update can swap it back; dropped (or kept as `spare`) by Release (the update ended) or the
    /// next Stage (so the rank never holds more than two versions).
    previous: Option<(SharedWeights, Arc<LoadSource>)>,
    /// Bumped by every Stage and Abort: a stage stores its result only if no later Stage or
    /// Abort came meanwhile (a stage abandoned by a coordinator that died can never land after
    /// its successor aborted or restaged).
    stage_epoch: u64,
    /// The collective listener, bound at Assign and kept for the rank's life: every ring epoch
    /// of its TP group is joined from it.
    listener: Option<RingListener>,
    /// The ring of the group, its id and epoch (a probe for another epoch replaces it).
    ring: Option<(u64, u32, TcpRing)>,
    /// The NCCL communicator of a GPU worker's TP group.
    device_collectives: DeviceCollectives,
    /// How long the active weights took to load (or, after a commit, to stage), and the same
    /// for the kept version.
    load_seconds: f64,
    previous_seconds: f64,
    /// How the active weights were loaded (`real`, `dummy`, `stage`, `restage`), and the kept
    /// version's.
    load_path: &'static str,
    previous_path: &'static str,
    /// The round trip of the stage the active weights were committed from, and their
    /// generation (a report asked for the kept verdict answers with it while the generation is
    /// the same).
    committed_round_trip: Option<(u64, crate::roundtrip::RoundTrip)>,
    /// The first half of a verification probe of the staged weights, for its second.
    computed: Option<Computed>,
    /// The last verification probe of the staged weights, reduced: for the probe right after
    /// their commit ([`pb::ProbeRequest::kept`]).
    verified_probe: Option<(std::sync::Weak<RankWeights<AnyBackend>>, KeptProbe)>,
    /// The verification probe of the staged weights the active ones were committed from, and
    /// their generation: it answers the probe after the commit while the generation is the same.
    committed_probe: Option<(u64, KeptProbe)>,
}

/// A version staged beside the active weights.
struct Staged {
    /// Shared with the first half of a verification probe while it computes (see
    /// [`pb::ProbePhase`]).
    weights: SharedWeights,
    source: Arc<LoadSource>,
    /// Its round trip, run by the stage on the background pool once the weights were in place
    /// (nothing writes them between the stage and the commit, so the verdict of a report on
    /// them is that one). `None`: the stage deferred it ([`StageOptions::defer_round_trip`]) and
    /// no report has given it yet.
    round_trip: Option<crate::roundtrip::RoundTrip>,
    /// `stage` (fresh buffers) or `restage` (kept ones), and how long it took.
    path: &'static str,
    seconds: f64,
}

/// What a stage does besides loading the new version beside the active one.
#[derive(Clone, Copy, Debug, Default)]
struct StageOptions {
    /// Also prepare this probe's reference for the staged version (beside serving, like the load).
    reference: Option<ProbeSpec>,
    /// Run no round trip: the replica is verified as byte-identical to one that ran it, whose
    /// verdict its verification report adopts (see [`adopt_round_trip`]).
    defer_round_trip: bool,
}

/// The verdict of a deferred round trip, taken from the verified rank `proof` names when the
/// staged weights `w` hold the same kernel and source bytes (a round trip reads those alone);
/// `None` when they differ (the rank then runs its own).
fn adopt_round_trip(w: &RankWeights<AnyBackend>, proof: &pb::RoundTripProof) -> Option<crate::roundtrip::RoundTrip> {
    let same = w.kernel_rank_digest().hex() == proof.kernel_rank_digest && w.source_rank_digest().hex() == proof.source_rank_digest;
    same.then(|| crate::roundtrip::RoundTrip { ok: true, identical_to: Some(proof.rank.clone()), ..Default::default() })
}

/// One rank's passes of a probe, before its all-reduce.
struct ComputedProbe {
    probe: crate::probe::RankProbe,
    version: String,
    generation: u64,
}

/// The first half of a staged version's probe ([`pb::ProbePhase::Compute`]), kept for its
/// second: of which staged weights (held weakly: a kept result never keeps weights alive),
/// which probe, with or without the reference.
struct Computed {
    weights: std::sync::Weak<RankWeights<AnyBackend>>,
    spec: ProbeSpec,
    check: bool,
    probe: ComputedProbe,
}

/// A verification probe of staged weights, all-reduced, kept by the rank so that the probe
/// right after their commit (the same probe of the very same weights, which nothing writes
/// between the two) is answered from it rather than computed again: which probe, with or
/// without the reference, this rank's passes and its group's `y`.
struct KeptProbe {
    spec: ProbeSpec,
    check: bool,
    probe: ComputedProbe,
    y_digest: String,
    allreduce_seconds: f64,
}

impl KeptProbe {
    /// The answer to a probe after the commit (`generation`: the committed weights').
    fn answer(&self, st: &State, generation: u64) -> pb::ProbeResult {
        pb::ProbeResult { generation, kept: true, ..answer_of(st, &self.probe, self.y_digest.clone(), self.allreduce_seconds) }
    }
}

/// Runs this rank's passes of `spec` on `w` (`check`: against the reference, kept in `cache`).
fn compute_probe(
    backend: &AnyBackend,
    plan: &Plan,
    w: &RankWeights<AnyBackend>,
    source: &LoadSource,
    spec: ProbeSpec,
    check: bool,
    cache: &Mutex<crate::probe::ReferenceCache>,
) -> Result<ComputedProbe, Status> {
    let loader =
        RankLoader::new(backend, source.config(), plan.tp_size, plan.tp_rank, plan.rule).map_err(|e| Status::internal(e.to_string()))?;
    let probe =
        probe_rank_with(&loader, w, source, spec, plan.rule, check, Some(cache)).map_err(|e| Status::internal(format!("probe: {e}")))?;
    let version = source.version();
    crate::metrics::worker().probed(plan.dp_rank, plan.tp_rank, &version, probe.ok, probe.kernel_s + probe.reference_s);
    Ok(ComputedProbe { probe, version, generation: w.generation })
}

/// The answer to a probe whose passes gave `c`, with its all-reduced `y` (empty: not reduced).
fn answer_of(st: &State, c: &ComputedProbe, y_digest: String, allreduce_seconds: f64) -> pb::ProbeResult {
    let p = &c.probe;
    let (checkpoint_version, staged_version) = versions_of(st);
    pb::ProbeResult {
        probed_version: c.version.clone(),
        checkpoint_version,
        staged_version,
        ok: p.ok,
        q_mismatches: p.layers.iter().map(|l| l.q_mismatches as u64).sum(),
        z_max_abs_err: p.z_max_abs_err,
        z_max_rel_err: p.z_max_rel_err,
        y_max_abs_err: p.y_max_abs_err,
        y_max_rel_err: p.y_max_rel_err,
        y_partial_digest: p.y_partial_digest.hex(),
        y_digest,
        kernel_seconds: p.kernel_s,
        reference_seconds: p.reference_s,
        allreduce_seconds,
        layers: p.layers.len() as u32,
        generation: c.generation,
        pid: std::process::id(),
        kept: false,
    }
}

/// The TP all-reduce of a probe's `y_partial` (in rank order) over the group's ring, or NCCL,
/// and the answer.
fn reduce_and_answer(st: &mut State, backend: &AnyBackend, r: &pb::ProbeRequest, c: &ComputedProbe) -> Result<pb::ProbeResult, Status> {
    let plan = st.plan.as_ref().ok_or_else(|| Status::failed_precondition("no shard assigned"))?;
    let (tp_rank, tp_size) = (plan.tp_rank, plan.tp_size);
    let started = Instant::now();
    let mut y = c.probe.y_partial.clone();
    let timeout = Duration::from_millis(if r.timeout_ms == 0 { 30_000 } else { r.timeout_ms as u64 });
    if !r.nccl_unique_id.is_empty() {
        // GPU workers: NCCL, with the id the group's rank 0 created (world size 1 included).
        backend
            .nccl_all_reduce(&mut st.device_collectives, r.group, &r.nccl_unique_id, tp_rank, tp_size, timeout, &mut y)
            .map_err(|e| Status::unavailable(format!("all-reduce: {e}")))?;
    } else if tp_size > 1 {
        if st.ring.as_ref().is_none_or(|(g, e, _)| (*g, *e) != (r.group, r.ring_epoch)) {
            // A new group or epoch (after a failure): drop the old ring, join the new one.
            st.ring = None;
            let peers: Vec<SocketAddr> = r.peers.iter().map(|a| resolve_peer(a)).collect::<Result<_, _>>()?;
            let listener = st.listener.as_ref().ok_or_else(|| Status::failed_precondition("no collective listener (call Assign first)"))?;
            let ring = listener
                .connect_epoch(r.group, r.ring_epoch, tp_rank, &peers, timeout)
                .map_err(|e| Status::unavailable(format!("collective (epoch {}): {e}", r.ring_epoch)))?;
            st.ring = Some((r.group, r.ring_epoch, ring));
        }
        let (_, _, ring) = st.ring.as_mut().expect("ring set above");
        if let Err(e) = ring.all_reduce_sum(&mut y) {
            // A failed ring is never reused: the next probe joins a ring again, whatever epoch it
            // names.
            st.ring = None;
            return Err(Status::unavailable(format!("all-reduce: {e}")));
        }
    } else {
        LocalCollective.all_reduce_sum(&mut y).map_err(|e| Status::internal(e.to_string()))?;
    }
    Ok(answer_of(st, c, Digest::of_f32(&y).hex(), started.elapsed().as_secs_f64()))
}

/// Keeps the reduced verification probe `c` (answered with `answer`) of the staged weights
/// `weights` for the probe after their commit.
fn keep_verified(
    st: &mut State,
    weights: std::sync::Weak<RankWeights<AnyBackend>>,
    spec: ProbeSpec,
    check: bool,
    c: ComputedProbe,
    answer: &pb::ProbeResult,
) {
    let kept = KeptProbe { spec, check, probe: c, y_digest: answer.y_digest.clone(), allreduce_seconds: answer.allreduce_seconds };
    st.verified_probe = Some((weights, kept));
}

/// The worker service.
#[derive(Clone)]
pub struct WorkerService {
    state: Arc<Mutex<State>>,
    shutdown: Arc<Notify>,
    host: String,
    roots: Arc<AllowedRoots>,
    /// The device this worker loads and probes on (the CPU unless started on a GPU).
    backend: Arc<AnyBackend>,
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

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

fn host_name() -> String {
    crate::placement::host_name(&|k| std::env::var(k).ok())
}

/// Builds the load source a request names ([`LoadSource::from_pb`]) as the gRPC status a
/// caller gets when it names nothing this worker may load.
fn source_from(pb_source: Option<&pb::LoadSource>, roots: &AllowedRoots) -> Result<LoadSource, Status> {
    Ok(LoadSource::from_pb(pb_source, roots)?)
}

/// Takes a set of weights out of the state (`take`) and keeps it as the next stage's buffers when
/// the plan says so and none are kept yet; otherwise it is freed.
fn keep_or_drop(st: &mut State, take: impl FnOnce(&mut State) -> Option<RankWeights<AnyBackend>>) {
    let weights = take(st);
    if st.spare.is_none() && st.plan.as_ref().is_some_and(|p| p.keep_staging_buffers) {
        st.spare = weights;
    }
}

/// With `--keep-staging-buffers`, prepares after a load the spare set of buffers that the next
/// stage reloads into: a second load of the active version, on the background pool below
/// serving, so that even the first update restages into memory already faulted in rather
/// than faulting in a whole set while the replica serves (the rank holds two sets from then
/// on, as it does after any update with the flag). A stage or abort that begins meanwhile
/// cancels it at the next layer, and it is kept only if no stage came: the rank never keeps
/// more than two sets.
fn prepare_spare(
    state: &Mutex<State>,
    backend: &AnyBackend,
    source: &LoadSource,
    (tp, rank, dp_rank): (usize, usize, usize),
    rule: ScaleRule,
    epoch: u64,
) {
    // No stage or abort since the load, and nothing staged or kept meanwhile.
    let wanted = |st: &State| st.stage_epoch == epoch && st.spare.is_none() && st.shadow.is_none();
    let started = Instant::now();
    let prepared = RankLoader::new(backend, source.config(), tp, rank, rule)
        .and_then(|loader| crate::background::run(|| loader.load_unless(source, &|| !wanted(&lock(state)))));
    match prepared {
        Ok(Some(w)) => {
            let mut st = lock(state);
            if wanted(&st) {
                st.spare = Some(w);
                drop(st);
                tracing::info!(tp_rank = rank, replica = dp_rank, seconds = started.elapsed().as_secs_f64(), "prepared the spare buffers");
                return;
            }
            tracing::info!(tp_rank = rank, replica = dp_rank, "spare buffers dropped: a stage began while they were prepared");
        }
        Ok(None) => tracing::info!(tp_rank = rank, replica = dp_rank, "spare buffers not prepared: a stage began first"),
        Err(e) => tracing::warn!(tp_rank = rank, replica = dp_rank, "spare buffers not prepared: {e}"),
    }
}

/// The active weights and their source, or the staged ones.
fn weights_of(st: &State, shadow: bool) -> Result<(&SharedWeights, &Arc<LoadSource>), Status> {
    if shadow {
        let staged = st.shadow.as_ref().ok_or_else(|| Status::failed_precondition("nothing staged"))?;
        Ok((&staged.weights, &staged.source))
    } else {
        let plan = st.plan.as_ref().ok_or_else(|| Status::failed_precondition("no shard assigned"))?;
        Ok((st.weights.as_ref().ok_or_else(|| Status::failed_precondition("not loaded"))?, &plan.source))
    }
}

/// What a probe or report computes on, taken under the state lock and read without it: the
/// plan, the active (or staged) weights and their source.
fn snapshot(st: &State, shadow: bool) -> Result<(Plan, SharedWeights, Arc<LoadSource>), Status> {
    let plan = st.plan.clone().ok_or_else(|| Status::failed_precondition("no shard assigned"))?;
    let (w, source) = weights_of(st, shadow)?;
    Ok((plan, w.clone(), source.clone()))
}

/// Whether `w` is still what the rank holds as active (or staged) weights.
fn still_holds(st: &State, shadow: bool, w: &SharedWeights) -> bool {
    weights_of(st, shadow).is_ok_and(|(now, _)| Arc::ptr_eq(now, w))
}

/// Owned weights out of shared ones, when nothing else reads them (else they are freed when the
/// last reader ends).
fn unshared(w: SharedWeights) -> Option<RankWeights<AnyBackend>> {
    Arc::try_unwrap(w).ok()
}

/// The versions a rank holds: active (empty before the first load) and staged (empty when
/// nothing is staged). Every answer that can change or depend on them carries both.
fn versions_of(st: &State) -> (String, String) {
    let active = match (&st.plan, &st.weights) {
        (Some(p), Some(_)) => p.source.version(),
        _ => String::new(),
    };
    (active, st.shadow.as_ref().map(|s| s.source.version()).unwrap_or_default())
}

/// A peer's advertised `host:port` (an IP, or a name such as a pod's DNS name).
fn resolve_peer(address: &str) -> Result<SocketAddr, Status> {
    if let Ok(a) = address.parse() {
        return Ok(a);
    }
    use std::net::ToSocketAddrs;
    address
        .to_socket_addrs()
        .map_err(|e| Status::invalid_argument(format!("peer address `{address}`: {e}")))?
        .next()
        .ok_or_else(|| Status::invalid_argument(format!("peer address `{address}` resolves to nothing")))
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
            let (active, staged) = versions_of(st);
            // Idempotent: a commit whose answer was lost is asked again, and finds its version in place.
            if st.shadow.is_none() && !expected.is_empty() && active == expected {
                let generation = st.weights.as_ref().map_or(0, |w| w.generation);
                return Ok(pb::CommitResponse { checkpoint_version: active, generation, staged_version: String::new() });
            }
            if st.shadow.is_none() {
                return Err(Status::failed_precondition(format!("commit: nothing staged (holding version {active})")));
            }
            if !expected.is_empty() && staged != expected {
                return Err(Status::failed_precondition(format!("commit: staged version {staged}, expected {expected}")));
            }
            let Staged { weights, source, path, seconds, round_trip } =
                st.shadow.take().ok_or_else(|| Status::failed_precondition("commit: nothing staged"))?;
            let staged_at = Arc::as_ptr(&weights);
            let mut w = match Arc::try_unwrap(weights) {
                Ok(w) => w,
                Err(weights) => {
                    // A verification probe still computes on them (asked again, the commit finds
                    // them free).
                    st.shadow = Some(Staged { weights, source, path, seconds, round_trip });
                    return Err(Status::unavailable("commit: the staged version is still being probed"));
                }
            };
            st.computed = None;
            w.generation = st.weights.as_ref().map_or(1, |old| old.generation + 1);
            st.committed_round_trip = round_trip.map(|rt| (w.generation, rt));
            // The verification probe kept for these very weights (a `Weak` keeps its allocation,
            // so no later weights can share the address) answers the probe after the commit.
            st.committed_probe =
                st.verified_probe.take().filter(|(kept, _)| std::ptr::eq(kept.as_ptr(), staged_at)).map(|(_, k)| (w.generation, k));
            let replaced = st.plan.as_mut().map(|p| std::mem::replace(&mut p.source, source));
            st.previous = st.weights.take().zip(replaced);
            st.weights = Some(Arc::new(w));
            st.previous_seconds = std::mem::replace(&mut st.load_seconds, seconds);
            st.previous_path = std::mem::replace(&mut st.load_path, path);
            if let Some(p) = &st.plan {
                crate::metrics::worker().serving(p.dp_rank, p.tp_rank, &staged);
                tracing::info!(tp_rank = p.tp_rank, replica = p.dp_rank, version = %staged, "committed the staged version");
            }
            Ok(pb::CommitResponse {
                checkpoint_version: staged,
                generation: st.weights.as_ref().map_or(0, |w| w.generation),
                staged_version: String::new(),
            })
        })
        .await
        .map(Response::new)
    }

    async fn abort(&self, request: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let pb::AbortRequest { rollback, expected_version } = request.into_inner();
        if rollback {
            self.not_ready().await;
        }
        self.with_state(move |st| {
            st.computed = None;
            st.verified_probe = None;
            // Weights a verification probe still computes on are freed when it ends, not kept.
            keep_or_drop(st, |st| st.shadow.take().and_then(|s| unshared(s.weights)));
            st.stage_epoch += 1;
            if rollback {
                let kept = st.previous.as_ref().map(|(_, s)| s.version());
                match kept {
                    None => return Err(Status::failed_precondition("abort: nothing kept to roll back to")),
                    Some(v) if !expected_version.is_empty() && v != expected_version => {
                        return Err(Status::failed_precondition(format!("abort: the kept version is {v}, expected {expected_version}")));
                    }
                    Some(_) => {}
                }
                let (kept, source) = st.previous.take().ok_or_else(|| Status::failed_precondition("abort: nothing kept"))?;
                let mut w = match Arc::try_unwrap(kept) {
                    Ok(w) => w,
                    Err(kept) => {
                        // A probe or report that began before the commit still reads them.
                        st.previous = Some((kept, source));
                        return Err(Status::unavailable("abort: the kept version is still being read (ask again)"));
                    }
                };
                w.generation = st.weights.as_ref().map_or(1, |cur| cur.generation + 1);
                st.committed_round_trip = None;
                st.committed_probe = None;
                if let Some(p) = st.plan.as_mut() {
                    p.source = source;
                }
                st.weights = Some(Arc::new(w));
                st.load_seconds = st.previous_seconds;
                st.load_path = st.previous_path;
                if let Some(p) = &st.plan {
                    crate::metrics::worker().serving(p.dp_rank, p.tp_rank, &p.source.version());
                }
            }
            Ok(pb::AbortResponse { checkpoint_version: versions_of(st).0 })
        })
        .await
        .map(Response::new)
    }

    async fn release(&self, _request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.with_state(|st| {
            keep_or_drop(st, |st| st.previous.take().and_then(|(w, _)| unshared(w)));
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

/// How a worker serves.
pub struct ServeConfig {
    /// Address to listen on (the TP-ring listener binds the same IP).
    pub listen: SocketAddr,
    /// The host peers and the coordinator reach this worker at (default: the listen address).
    pub advertise: Option<String>,
    /// Coordinator to register with and heartbeat to.
    pub coordinator: Option<String>,
    /// Which rank this is, where that came from, and the host's name.
    pub placement: crate::placement::Placement,
    /// How long to keep trying to reach a coordinator that is not up yet.
    pub join_timeout: Duration,
    /// With a token, every Worker RPC must carry it, and calls to the coordinator send it.
    pub token: Option<Token>,
    /// Only checkpoint directories under these are read.
    pub roots: AllowedRoots,
    /// How long the worker keeps serving while its coordinator is unreachable (a restarted
    /// coordinator finds it again within this time); then it stops.
    pub coordinator_grace: Duration,
    /// Serve (and call the coordinator) over TLS with these files.
    pub tls: Option<orchestrator_net::tls::TlsFiles>,
    /// Also serve the health statuses in plaintext here (Kubernetes probes).
    pub health_listen: Option<SocketAddr>,
    /// Serve Prometheus metrics at `http://ADDR/metrics`.
    pub metrics_listen: Option<SocketAddr>,
}

/// Registers with the coordinator at `coord`, retrying while it cannot be reached (an engine
/// starts the coordinator and the workers together) for up to `join_timeout`; a refusal (wrong
/// rank, protocol, token) ends the attempt at once with the coordinator's reason.
async fn register(
    coord: &str,
    tls: Option<&orchestrator_net::tls::TlsFiles>,
    token: Option<&Token>,
    registration: &pb::RegisterRequest,
    join_timeout: Duration,
) -> anyhow::Result<CoordinatorClient<tonic::transport::Channel>> {
    let started = Instant::now();
    let mut said = false;
    loop {
        let last = match orchestrator_net::tls::connect(coord, tls).await {
            Ok(channel) => {
                let mut client = CoordinatorClient::new(channel);
                match client.register(orchestrator_net::auth::request(registration.clone(), RPC_DEADLINE, token)).await {
                    Ok(_) => return Ok(client),
                    Err(s) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
                        orchestrator_net::tls::describe_status(&s)
                    }
                    Err(s) => anyhow::bail!("registering rank {} with {coord}: refused: {}", registration.worker_id, s.message()),
                }
            }
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= join_timeout {
            anyhow::bail!(
                "registering rank {} with {coord}: not reachable for {:.0} s (--join-timeout): {last}",
                registration.worker_id,
                started.elapsed().as_secs_f64()
            );
        }
        if !said {
            tracing::info!(rank = registration.worker_id, "waiting for the coordinator at {coord}: {last}");
            said = true;
        }
        tokio::time::sleep(orchestrator_proto::limits::REGISTER_RETRY).await;
    }
}

/// Serves the worker until shut down (by RPC, by the coordinator going away, or by a signal).
pub async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    let ServeConfig {
        listen,
        advertise,
        coordinator,
        placement,
        join_timeout,
        token,
        roots,
        coordinator_grace,
        tls,
        health_listen,
        metrics_listen,
    } = config;
    let shutdown = Arc::new(Notify::new());
    let signal = orchestrator_net::grpc::shutdown_signal();
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| anyhow::anyhow!("binding {listen}: {e}"))?;
    let address = listener.local_addr()?;
    let advertise = advertise.unwrap_or_else(|| address.ip().to_string());
    let (router, health) = orchestrator_net::grpc::standard_router::<WorkerServer<WorkerService>>(tls.as_ref()).await?;
    if let Some(h) = health_listen {
        let at = health.serve_plaintext(h).await?;
        tracing::info!(%at, "health (plaintext) listening");
    }
    if let Some(m) = metrics_listen {
        let at = orchestrator_ops::metrics::serve(m, Arc::new(|| crate::metrics::worker().render()))
            .await
            .map_err(|e| anyhow::anyhow!("--metrics-listen {m}: {e}"))?;
        tracing::info!(%at, "metrics listening at /metrics");
    }
    let service = WorkerService::with_backend(shutdown.clone(), roots, AnyBackend::from_env()?)
        .with_ring_address(address.ip(), advertise.clone())
        .with_health(health, placement.host.clone());
    let device = service.backend.name();
    let worker_id = placement.rank;
    let advertised =
        format!("{}://{}", orchestrator_net::tls::scheme(tls.as_ref()), crate::placement::join_host_port(&advertise, address.port()));
    tracing::info!(%address, %advertised, rank = worker_id, source = %placement.source, host = %placement.host, "worker serving");

    let mut registered = None;
    if let Some(coord) = coordinator.clone() {
        let me = orchestrator_ops::process::ProcessIdentity::of_self();
        let registration = pb::RegisterRequest {
            worker_id,
            address: advertised,
            host: placement.host.clone(),
            device,
            pid: std::process::id(),
            protocol_version: orchestrator_proto::PROTOCOL_VERSION,
            start_ticks: me.start_ticks,
            boot_id: me.boot_id,
            executable: me.executable.display().to_string(),
            world_size: placement.world_size.unwrap_or(0),
            rank_source: placement.source.name().into(),
            remote: placement.source != crate::placement::RankSource::Launch,
        };
        // Registration and heartbeats run on a runtime of their own, on their own thread: a
        // worker busy with loads and probes (whose state lock can be held for seconds) still
        // answers the question "are you alive" on time.
        let (registered_tx, registered_rx) = tokio::sync::oneshot::channel();
        let (token, tls, stop) = (token.clone(), tls.clone(), shutdown.clone());
        std::thread::Builder::new().name("heartbeats".into()).spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(r) => r,
                Err(e) => {
                    let _ = registered_tx.send(Err(anyhow::anyhow!("heartbeat runtime: {e}")));
                    return;
                }
            };
            runtime.block_on(async move {
                match register(&coord, tls.as_ref(), token.as_ref(), &registration, join_timeout).await {
                    Ok(client) => {
                        if registration.remote {
                            // One line for `kubectl logs` and Slurm's output (launched workers stay quiet).
                            eprintln!(
                                "orchestrator-worker: rank {} ({}) on host {} registered with {coord}; serving on {}",
                                registration.worker_id, registration.rank_source, registration.host, registration.address
                            );
                        }
                        let _ = registered_tx.send(Ok(()));
                        heartbeats(client, registration, token, coordinator_grace, stop).await;
                    }
                    Err(e) => {
                        let _ = registered_tx.send(Err(e));
                    }
                }
            });
        })?;
        registered = Some(registered_rx);
    }

    // The port answers from the start (health NOT_SERVING, liveness SERVING), also while the
    // worker waits for its coordinator.
    let incoming = orchestrator_net::grpc::incoming(listener);
    let server = tokio::spawn(
        router
            .add_service(tonic::service::interceptor::InterceptedService::new(
                WorkerServer::new(service).max_decoding_message_size(orchestrator_proto::limits::MAX_MESSAGE_BYTES),
                orchestrator_net::auth::interceptor(token.clone()),
            ))
            .serve_with_incoming_shutdown(incoming, async move {
                tokio::select! {
                    _ = shutdown.notified() => {}
                    _ = signal => {}
                }
            }),
    );
    let mut server = server;
    if let Some(registered) = registered {
        tokio::select! {
            outcome = registered => {
                if let Err(e) = outcome.unwrap_or_else(|_| Err(anyhow::anyhow!("the heartbeat thread ended before registering"))) {
                    server.abort();
                    return Err(e);
                }
            }
            // Stopped (a signal) while still waiting for the coordinator.
            ended = &mut server => return Ok(ended??),
        }
    }
    server.await??;
    Ok(())
}

/// Heartbeats to the coordinator every 500 ms. A coordinator that does not know this worker
/// (one restarted from its state directory) gets the registration again; one that stays
/// unreachable for `grace` ends this worker.
async fn heartbeats(
    mut client: CoordinatorClient<tonic::transport::Channel>,
    registration: pb::RegisterRequest,
    token: Option<Token>,
    grace: Duration,
    stop: Arc<Notify>,
) {
    let worker_id = registration.worker_id;
    let mut last_answer = Instant::now();
    let mut warned = false;
    loop {
        tokio::time::sleep(orchestrator_proto::limits::HEARTBEAT_INTERVAL).await;
        let req = orchestrator_net::auth::request(pb::HeartbeatRequest { worker_id }, Duration::from_secs(2), token.as_ref());
        let answered = match client.heartbeat(req).await {
            Ok(_) => true,
            Err(s) if s.code() == tonic::Code::NotFound => {
                let req = orchestrator_net::auth::request(registration.clone(), RPC_DEADLINE, token.as_ref());
                match client.register(req).await {
                    Ok(_) => {
                        tracing::info!(worker_id, "registered again with a restarted coordinator");
                        true
                    }
                    Err(e) => {
                        tracing::warn!(worker_id, "registering again: {}", e.message());
                        false
                    }
                }
            }
            Err(_) => false,
        };
        if answered {
            if warned {
                tracing::info!(worker_id, "coordinator reachable again");
            }
            last_answer = Instant::now();
            warned = false;
        } else if last_answer.elapsed() > grace {
            tracing::warn!(worker_id, "coordinator unreachable for {:.1} s: stopping", last_answer.elapsed().as_secs_f64());
            stop.notify_one();
            return;
        } else if !warned && last_answer.elapsed() > Duration::from_secs(2) {
            tracing::warn!(worker_id, "coordinator unreachable; serving on for up to {} s while it restarts", grace.as_secs());
            warned = true;
        }
    }
}

/// [`serve`] on its own runtime (the entry point of a worker process).
pub fn run(config: ServeConfig) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(serve(config))
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
