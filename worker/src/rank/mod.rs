//! One rank of a served worker, apart from the wire: what it holds ([`state`]) and what it
//! does when asked: take an assignment, load, reload or stage a version (streaming per-layer
//! progress), commit, abort or release an update, report, probe ([`probing`]). Every refusal
//! and failure is a [`RankError`]; the gRPC service (`crate::server`) turns requests into these
//! calls, runs them on blocking threads, keeps the readiness status, and answers a
//! `RankError` as its `Status`.
//!
//! Every call here blocks (loads, round trips, probes, a ring's all-reduce): call it from a
//! blocking thread, never from the async runtime that sends the worker's heartbeats.

mod error;
pub(crate) mod probing;
pub(crate) mod state;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use orchestrator_kernels::{Backend, Digest, ScaleRule};
use orchestrator_model::AllowedRoots;
use orchestrator_proto::v1 as pb;
use tokio::sync::mpsc;

pub use error::RankError;
use probing::{Computed, adopt_round_trip, answer_of, compute_probe, keep_verified, peers_to_join, reduce};
use state::{InPlace, Plan, StageOptions, Staged, State, keep_or_drop, lock, prepare_spare, snapshot, still_holds, unshared, versions_of};

use crate::collective::RingListener;
use crate::device::AnyBackend;
use crate::faults::{Fault, inject_on};
use crate::loader::{RankLoader, RankWeights};
use crate::probe::ProbeSpec;
use crate::roundtrip::{RoundTripScratch, check_rank_with};
use crate::source::LoadSource;
use orchestrator_proto::limits::{MAX_NAME_BYTES, MAX_PATH_BYTES, check_len};

/// A load's, reload's or stage's per-layer progress, ending with its last message (`finished`)
/// or its error.
pub type Progress = mpsc::Receiver<Result<pb::LoadProgress, RankError>>;

/// A rank of a served worker: its state behind one lock, and what its loads and probes use.
pub struct Rank {
    pub(crate) state: Arc<Mutex<State>>,
    /// Its collectives, locked apart from its state (see [`state::Collectives`]).
    pub(crate) collectives: Arc<Mutex<state::Collectives>>,
    /// The host name its reports give.
    host: String,
    pub(crate) roots: AllowedRoots,
    /// The directory (canonical) under which an assignment's dumps may be written; none: no
    /// assignment may ask for dumps.
    dump_root: Option<Arc<crate::dump::DumpRoot>>,
    /// The device this rank loads and probes on (the CPU unless started on a GPU).
    pub(crate) backend: Arc<AnyBackend>,
    /// The IP the TP-ring listener binds and the host it is advertised as.
    ring_ip: std::net::IpAddr,
    advertise: String,
    /// What the reference computed for the versions and probes this rank was asked about
    /// (keyed by everything the reference depends on, so it outlives any one plan). Locked by
    /// a probe only to look up and to store, never while it holds the state lock.
    pub(crate) reference_cache: Arc<Mutex<crate::probe::ReferenceCache>>,
    /// The buffers every round trip of this rank (its loads' and stages') reuses.
    round_trip_scratch: Arc<RoundTripScratch<AnyBackend>>,
    /// How many changes of the active weights are under way ([`WeightsChange`]).
    changing: Arc<AtomicUsize>,
}

/// A change of the active weights under way (an assignment, load, reload, commit or rollback),
/// from before the change begins until it has ended, landed or not: while any is, the rank
/// refuses to be marked serving ([`Rank::check_serving`]), whatever version it still holds.
/// Ends when dropped (the call that changes the weights holds it to its end).
#[must_use = "the change ends when this is dropped"]
pub struct WeightsChange(Arc<AtomicUsize>);

impl Drop for WeightsChange {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An assignment checked and its collective listener bound, not yet installed
/// ([`Rank::prepare_assignment`], then [`Rank::assign`]).
pub struct Assignment {
    plan: Plan,
    listener: RingListener,
    address: String,
}

impl Rank {
    /// A rank with nothing assigned, on `backend`, reading checkpoints under `roots` only; its
    /// ring listener on loopback until [`Rank::with_ring_address`].
    pub fn new(roots: AllowedRoots, backend: AnyBackend, host: String) -> Self {
        Self {
            state: Arc::new(Mutex::new(State::default())),
            collectives: Default::default(),
            host,
            roots,
            dump_root: None,
            backend: Arc::new(backend),
            ring_ip: std::net::Ipv4Addr::LOCALHOST.into(),
            advertise: "127.0.0.1".into(),
            reference_cache: Default::default(),
            round_trip_scratch: Default::default(),
            changing: Default::default(),
        }
    }

    /// A change of the active weights begins ([`WeightsChange`]).
    pub fn begin_change(&self) -> WeightsChange {
        self.changing.fetch_add(1, Ordering::SeqCst);
        WeightsChange(self.changing.clone())
    }

    /// Binds TP-ring listeners on `ip`, advertised as `host` (what peers on other machines reach).
    pub fn with_ring_address(mut self, ip: std::net::IpAddr, host: String) -> Self {
        self.ring_ip = ip;
        self.advertise = host;
        self
    }

    /// Lets assignments ask for dumps beneath `root` (`--dump-root`).
    pub fn with_dump_root(mut self, root: Option<Arc<crate::dump::DumpRoot>>) -> Self {
        self.dump_root = root;
        self
    }

    /// Where an assignment's dumps go: `dir/dp{D}`, where `dir` (which must exist) resolves,
    /// symlinks and all, under this rank's dump root (and each write stays beneath it: see
    /// [`crate::dump`]). A rank without one writes no dumps.
    fn dump_dir_for(&self, dir: &str, dp_rank: u32) -> Result<Option<crate::dump::DumpDir>, RankError> {
        if dir.is_empty() {
            return Ok(None);
        }
        let refuse = |why: String| RankError::DumpDir { dir: dir.to_string(), why };
        let root =
            self.dump_root.as_ref().ok_or_else(|| refuse("this worker was started without --dump-root: it writes no dumps".into()))?;
        root.beneath(std::path::Path::new(dir), &format!("dp{dp_rank}")).map(Some).map_err(refuse)
    }

    /// The device's name (`cpu`, or the GPU's).
    pub fn device(&self) -> String {
        self.backend.name()
    }

    /// The versions this rank holds: active (empty before the first load) and staged (empty
    /// when nothing is staged).
    pub fn versions(&self) -> (String, String) {
        versions_of(&lock(&self.state))
    }

    /// The fault the assignment injects (none before one).
    pub fn fault(&self) -> pb::Fault {
        lock(&self.state).plan.as_ref().map_or(pb::Fault::None, |p| p.fault)
    }

    /// Checks an assignment (its source opened under the allowed roots, its scale rule, its
    /// shard of the source's geometry) and binds its collective listener.
    pub fn prepare_assignment(&self, r: &pb::AssignRequest) -> Result<Assignment, RankError> {
        let source = LoadSource::from_pb(r.source.as_ref(), &self.roots)?;
        let rule: ScaleRule = check_len("scale_rule", &r.scale_rule, MAX_NAME_BYTES)?.parse().map_err(RankError::ScaleRule)?;
        check_len("dump_dir", &r.dump_dir, MAX_PATH_BYTES)?;
        let max = orchestrator_model::limits::MAX_WORLD_SIZE;
        if r.dp_size == 0 || r.dp_size as usize > max || r.dp_rank >= r.dp_size {
            return Err(RankError::DpRank { dp_rank: r.dp_rank, dp_size: r.dp_size, max });
        }
        let dump_dir = self.dump_dir_for(&r.dump_dir, r.dp_rank)?;
        let (tp, rank) = (r.tp_size as usize, r.tp_rank as usize);
        orchestrator_model::RankShard::new(&source.config().geometry, tp, rank).map_err(|e| RankError::Shard(Box::new(e)))?;
        let listener = RingListener::bind(SocketAddr::new(self.ring_ip, 0)).map_err(|why| RankError::Listener { ip: self.ring_ip, why })?;
        let address = crate::placement::join_host_port(&self.advertise, listener.local_addr().port());
        let plan = Plan {
            tp_size: tp,
            tp_rank: rank,
            dp_size: r.dp_size as usize,
            dp_rank: r.dp_rank as usize,
            source: Arc::new(source),
            rule,
            fault: r.fault(),
            dump_dir,
            keep_staging_buffers: r.keep_staging_buffers,
        };
        Ok(Assignment { plan, listener, address })
    }

    /// Takes a prepared assignment: whatever the rank held is dropped, and every stage still
    /// running can no longer land. A GPU group's rank 0 creates the NCCL unique id the
    /// coordinator relays to its group.
    pub fn assign(&self, a: Assignment) -> Result<pb::AssignResponse, RankError> {
        let nccl_unique_id = if a.plan.tp_rank == 0 && self.backend.is_cuda() {
            self.backend.nccl_unique_id().map_err(RankError::NcclId)?
        } else {
            Vec::new()
        };
        let mut co = lock(&self.collectives);
        let mut st = lock(&self.state);
        let (stage_epoch, load_epoch) = (st.stage_epoch + 1, st.load_epoch + 1);
        *co = state::Collectives { tp_rank: a.plan.tp_rank, tp_size: a.plan.tp_size, listener: Some(a.listener), ..Default::default() };
        *st = State { plan: Some(a.plan), stage_epoch, load_epoch, ..State::default() };
        Ok(pb::AssignResponse { collective_address: a.address, nccl_unique_id })
    }

    /// The source a reload reads: the one named, or the assigned one opened again (its files
    /// still under the allowed roots).
    pub fn reload_source(&self, named: Option<&pb::LoadSource>) -> Result<LoadSource, RankError> {
        if named.is_some() {
            return Ok(LoadSource::from_pb(named, &self.roots)?);
        }
        // The assigned source, opened again (outside the state lock: opening hashes it).
        let assigned = lock(&self.state).plan.as_ref().map(|p| p.source.clone()).ok_or(RankError::NotAssigned)?;
        match assigned.as_ref() {
            LoadSource::Safetensors(c) => {
                LoadSource::open_checkpoint_within(c.dir(), &self.roots).map_err(|e| RankError::Reopen(Box::new(e)))
            }
            LoadSource::Dummy { config, generator } => Ok(LoadSource::Dummy { config: config.clone(), generator: *generator }),
        }
    }

    /// Loads the assigned version into the active weights; `change` ends with the load.
    pub fn load(&self, change: WeightsChange) -> Result<Progress, RankError> {
        self.start_load(None, Some(change), StageOptions::default())
    }

    /// Loads `source` (of the same geometry and format) into the active weights' buffers;
    /// `change` ends with the load.
    pub fn reload(&self, source: LoadSource, change: WeightsChange) -> Result<Progress, RankError> {
        self.start_load(Some(source), Some(change), StageOptions::default())
    }

    /// Stages the version a Stage request names beside the active weights (opening it hashes
    /// its content: background work, like the load), with its reference when asked.
    pub fn stage(&self, r: &pb::StageRequest) -> Result<Progress, RankError> {
        let s = r.source.as_ref().ok_or(RankError::StageWithoutSource)?;
        let reference = r
            .reference
            .map(|p| ProbeSpec::checked(p.tokens, p.latents, p.seed))
            .transpose()
            .map_err(|error| RankError::ProbeSize { context: "stage: reference", error })?;
        // What can be refused without opening the source is refused before the stage takes its
        // epoch: a bad request supersedes no stage in progress. The reference's memory is checked
        // on the running plan's geometry, which the staged version must have.
        LoadSource::check_pb(s)?;
        if let Some(spec) = reference {
            let st = lock(&self.state);
            let plan = st.plan.as_ref().ok_or(RankError::LoadBeforeAssign)?;
            let g = &plan.source.config().geometry;
            spec.check_on(g, g.layers, plan.tp_size).map_err(|error| RankError::ProbeSize { context: "stage: reference", error })?;
        }
        let epoch = self.begin_stage();
        let source = crate::background::run(|| LoadSource::from_pb(Some(s), &self.roots))?;
        self.start_load(Some(source), None, StageOptions { reference, defer_round_trip: r.defer_round_trip, epoch: Some(epoch) })
    }

    /// A stage's epoch, taken as its request arrives (once what can be refused without opening
    /// its source was), before its source is opened (hashing it can take long): an abort or a
    /// later stage meanwhile supersedes it, so a stage a coordinator gave up on never lands over
    /// what came after it.
    pub(crate) fn begin_stage(&self) -> u64 {
        let mut st = lock(&self.state);
        st.stage_epoch += 1;
        st.stage_epoch
    }

    /// The rest of [`Rank::stage`] once its source is open (tests: a stage given its epoch).
    #[cfg(test)]
    pub(crate) fn stage_opened(&self, source: LoadSource, options: StageOptions) -> Result<Progress, RankError> {
        self.start_load(Some(source), None, options)
    }

    /// Swaps the staged version in ([`State::commit`]).
    pub fn commit(&self, expected: &str) -> Result<pb::CommitResponse, RankError> {
        let expected = check_len("expected_version", expected, MAX_NAME_BYTES)?;
        let mut st = lock(&self.state);
        let before = st.weights.as_ref().map(|w| w.generation);
        let InPlace { version, generation } = st.commit(expected)?;
        if before != Some(generation) && st.plan.as_ref().is_some_and(|p| p.fault == pb::Fault::CommitSkipPermute) {
            Self::skip_permute_after_swap(&self.backend, &mut st)?;
        }
        Ok(pb::CommitResponse { checkpoint_version: version, generation, staged_version: String::new() })
    }

    /// The `commit-skip-permute` fault: the weights just swapped in get `wq_b` back in
    /// checkpoint order, so that what serves is not what was verified staged (nothing kept of
    /// the staged weights answers for them any more).
    fn skip_permute_after_swap(backend: &AnyBackend, st: &mut State) -> Result<(), RankError> {
        st.committed_probe = None;
        st.committed_round_trip = None;
        // Just swapped in under this lock: nothing else holds them yet.
        let Some(w) = st.weights.as_mut().and_then(Arc::get_mut) else { return Ok(()) };
        inject_on(backend, w, Fault::SkipQPermutation).map_err(RankError::FaultInjection)?;
        w.refresh_kernel_digests(backend).map_err(|e| RankError::Digests(Box::new(e)))
    }

    /// Drops what is staged and, with `rollback`, swaps the kept version back ([`State::abort`]).
    pub fn abort(&self, rollback: bool, expected: &str) -> Result<pb::AbortResponse, RankError> {
        let expected = check_len("expected_version", expected, MAX_NAME_BYTES)?;
        Ok(pb::AbortResponse { checkpoint_version: lock(&self.state).abort(rollback, expected)? })
    }

    /// Ends an update ([`State::release`]).
    pub fn release(&self) {
        lock(&self.state).release();
    }

    /// Whether the rank may be marked serving `version`: only when that is its active version
    /// and no change of its active weights is under way.
    pub fn check_serving(&self, version: &str) -> Result<(), RankError> {
        let version = check_len("version", version, MAX_NAME_BYTES)?;
        let changes = self.changing.load(Ordering::SeqCst);
        if changes > 0 {
            return Err(RankError::WeightsChanging { changes });
        }
        let (active, _) = self.versions();
        if active.is_empty() || active != version {
            return Err(RankError::NotVerified { active, version: version.to_string() });
        }
        Ok(())
    }

    /// Runs a load or reload on a blocking thread of its own, streaming per-layer progress.
    /// Without a `change` of the active weights (a staged update), loads `reload_from` into fresh
    /// shadow buffers beside the active weights instead of into the active ones, doing what
    /// `stage` asks besides; with one, the change ends with the load.
    fn start_load(
        &self,
        reload_from: Option<LoadSource>,
        change: Option<WeightsChange>,
        stage: StageOptions,
    ) -> Result<Progress, RankError> {
        let shadow = change.is_none();
        let ((source, tp, rank, dp_rank, rule, fault, total, dump_dir), epoch, spare) = {
            let mut st = lock(&self.state);
            if shadow && stage.epoch.is_some_and(|e| e != st.stage_epoch) {
                return Err(RankError::Superseded);
            }
            // Refusals first: a refused load or stage changes nothing (before, a refused stage
            // had already dropped the version kept for a rollback).
            let plan = st.plan.as_ref().ok_or(RankError::LoadBeforeAssign)?;
            if reload_from.is_some() && st.weights.is_none() {
                return Err(RankError::NothingToReload);
            }
            if let Some(new) = &reload_from {
                let (old, new) = (plan.source.config(), new.config());
                if old.geometry != new.geometry || old.format != new.format {
                    return Err(RankError::OtherGeometry {
                        new_geometry: Box::new(new.geometry.clone()),
                        new_format: new.format,
                        old_geometry: Box::new(old.geometry.clone()),
                        old_format: old.format,
                    });
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
            );
            // A stage lands only while no later stage, abort or assignment came; a load only
            // while no later load, commit, rollback or assignment did.
            let epoch = if shadow {
                if stage.epoch.is_none() {
                    st.stage_epoch += 1;
                }
                keep_or_drop(&mut st, |st| st.previous.take().and_then(|(w, _)| unshared(w)));
                st.stage_epoch
            } else {
                st.load_epoch += 1;
                st.load_epoch
            };
            // A stage reloads into the kept buffers, if any.
            let spare = if shadow { st.spare.take() } else { None };
            (values, epoch, spare)
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
            let result = (|| -> Result<(RankWeights<AnyBackend>, Option<crate::roundtrip::RoundTrip>), RankError> {
                let loader = RankLoader::new(backend, source.config(), tp, rank, rule).map_err(|e| RankError::LoadPlan(Box::new(e)))?;
                if shadow {
                    // Beside serving: on the background pool, below the probes' priority.
                    let mut w = crate::background::run(|| match spare {
                        Some(kept) => loader.reload_with_progress(kept, &source, &progress),
                        None => loader.load_with_progress(&source, &progress),
                    })
                    .map_err(|e| RankError::Stage(Box::new(e)))?;
                    if let Some(spec) = stage.reference {
                        reference_s = crate::background::run(|| crate::probe::prepare_reference(&loader, &source, spec, &reference_cache))
                            .map_err(|why| RankError::Reference { spec, why: Box::new(why) })?;
                    }
                    if fault == pb::Fault::StageSkipPermute {
                        inject_on(backend, &mut w, Fault::SkipQPermutation).map_err(RankError::FaultInjection)?;
                        w.refresh_kernel_digests(backend).map_err(|e| RankError::Digests(Box::new(e)))?;
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
                // Taken only while this load is still the latest: a commit or rollback that came
                // since holds weights this load must not reload over.
                let previous = {
                    let mut st = lock(&state);
                    if st.load_epoch != epoch {
                        return Err(RankError::LoadSuperseded);
                    }
                    st.weights.take()
                };
                let generation = previous.as_ref().map_or(0, |w| w.generation);
                let mut w = match previous.and_then(unshared) {
                    Some(old) => loader.reload_with_progress(old, &source, &progress),
                    None => loader.load_with_progress(&source, &progress),
                }
                .map_err(|e| RankError::Load(Box::new(e)))?;
                w.generation = generation + 1;
                let injected = match fault {
                    pb::Fault::SkipPermute => Some(Fault::SkipQPermutation),
                    pb::Fault::DoublePermute => Some(Fault::DoubleQPermutation),
                    pb::Fault::StaleReload => Some(Fault::StaleReload),
                    _ => None,
                };
                if let Some(f) = injected {
                    inject_on(backend, &mut w, f).map_err(RankError::FaultInjection)?;
                    w.refresh_kernel_digests(backend).map_err(|e| RankError::Digests(Box::new(e)))?;
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
                    let mut dump_from = None;
                    let mut st = lock(&state);
                    if shadow {
                        if st.stage_epoch != epoch {
                            drop(st);
                            let _ = tx.blocking_send(Err(RankError::Superseded));
                            return;
                        }
                        st.shadow = Some(Staged { weights: Arc::new(w), source, round_trip, path, seconds });
                    } else {
                        if st.load_epoch != epoch {
                            drop(st);
                            let _ = tx.blocking_send(Err(RankError::LoadSuperseded));
                            return;
                        }
                        let installed = Arc::new(w);
                        st.weights = Some(installed.clone());
                        dump_from = Some(installed);
                        crate::metrics::worker().serving(dp_rank, rank, &version);
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
                    // The weights are in place (before the answer says so, which a SetServing
                    // may follow at once).
                    drop(change);
                    // The dump of the weights now in place (a failure does not undo them; a
                    // load that did not land dumps nothing).
                    if let (Some(w), Some(dir)) = (dump_from, &dump_dir)
                        && let Err(e) = crate::dump::dump_rank(backend, &w, dir)
                    {
                        let _ = tx.blocking_send(Err(RankError::Dump(e)));
                        return;
                    }
                    let _ = tx.blocking_send(Ok(pb::LoadProgress {
                        layers_done: total as u32,
                        layers_total: total as u32,
                        finished: true,
                        load_seconds: seconds,
                        version,
                    }));
                }
                Err(status) => {
                    drop(change);
                    let _ = tx.blocking_send(Err(status));
                }
            }
            // The load's stream ends here; the spare buffers are prepared after it.
            drop(tx);
            if let Some((epoch, source)) = spare_after {
                prepare_spare(&state, backend, &source, (tp, rank, dp_rank), rule, epoch);
            }
        });
        Ok(rx)
    }

    /// The rank's report (`shadow`: of the staged weights), with its round trip: the one kept
    /// for these weights when there is one (a stage's, a commit's with `kept_round_trip`, or a
    /// deferred one adopted from the verified rank `identical_to` names), else run now without
    /// the state lock. `brief`: versions and generation only, nothing run.
    pub fn report(&self, request: pb::ReportRequest) -> Result<pb::RankReport, RankError> {
        let pb::ReportRequest { shadow, brief, kept_round_trip, identical_to } = request;
        let backend: &AnyBackend = &self.backend;
        let work = || -> Result<pb::RankReport, RankError> {
            let mut st = lock(&self.state);
            let plan = st.plan.as_ref().ok_or(RankError::NotAssigned)?;
            if brief {
                let (checkpoint_version, staged_version) = versions_of(&st);
                return Ok(pb::RankReport {
                    checkpoint_version,
                    staged_version,
                    previous_version: st.previous.as_ref().map(|(_, s)| s.version()).unwrap_or_default(),
                    generation: st.weights.as_ref().map_or(0, |w| w.generation),
                    round_trip_failures: vec!["not checked (brief report)".into()],
                    ..self.report_of(plan)
                });
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
                let rt = check_rank_with(backend, &w, &source, &self.round_trip_scratch);
                // A deferred round trip, once run, stands for the stage as the stage's own would.
                let mut st = lock(&self.state);
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
            Ok(pb::RankReport {
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
                ..self.report_of(&plan)
            })
        };
        // The round trip of a staged version is background work too.
        if shadow { crate::background::run(work) } else { work() }
    }

    /// Who the report is of: the rank's place in the cluster, its host, device and process.
    fn report_of(&self, plan: &Plan) -> pb::RankReport {
        pb::RankReport {
            tp_size: plan.tp_size as u32,
            tp_rank: plan.tp_rank as u32,
            dp_size: plan.dp_size as u32,
            dp_rank: plan.dp_rank as u32,
            host: self.host.clone(),
            device: self.backend.name(),
            pid: std::process::id(),
            ..Default::default()
        }
    }

    /// A probe of the active weights (`shadow`: of the staged ones), whole or in halves (a
    /// staged version's verification computes on every rank first, then reduces), or answered
    /// from the verification probe kept for the weights a commit swapped in (`kept`). The
    /// passes run without the state lock; a staged version's are background work.
    pub fn probe(&self, r: &pb::ProbeRequest) -> Result<pb::ProbeResult, RankError> {
        let phase = r.phase();
        if phase != pb::ProbePhase::Whole && !r.shadow {
            return Err(RankError::HalvesOfActive);
        }
        if r.kept && (phase != pb::ProbePhase::Whole || r.shadow) {
            return Err(RankError::KeptNotWhole);
        }
        // A probe that reduces over the ring names one peer per rank and a bounded deadline (the
        // rank's collectives are held while it joins the ring and reduces).
        let limit = orchestrator_proto::limits::MAX_RING_TIMEOUT;
        if u128::from(r.timeout_ms) > limit.as_millis() {
            return Err(RankError::RingTimeout { ms: r.timeout_ms, limit_ms: limit.as_millis() });
        }
        for peer in &r.peers {
            check_len("peers", peer, MAX_NAME_BYTES)?;
        }
        let tp_size = lock(&self.state).plan.as_ref().map_or(1, |p| p.tp_size);
        if phase != pb::ProbePhase::Compute && !r.kept && r.nccl_unique_id.is_empty() && tp_size > 1 && r.peers.len() != tp_size {
            return Err(RankError::Peers { got: r.peers.len(), tp_size });
        }
        let backend: &AnyBackend = &self.backend;
        let work = || {
            let spec = ProbeSpec::checked(r.tokens, r.latents, r.seed).map_err(|error| RankError::ProbeSize { context: "probe", error })?;
            let check = !r.skip_reference;
            if r.kept {
                // Nothing computed, no ring joined: answered from what the rank kept, or refused.
                let st = lock(&self.state);
                let generation = st.weights.as_ref().map(|w| w.generation);
                return match &st.committed_probe {
                    Some((g, k)) if Some(*g) == generation && k.spec == spec && k.check == check => Ok(k.answer(&st, *g)),
                    _ => Err(RankError::NoKeptProbe { generation: generation.unwrap_or(0) }),
                };
            }
            match phase {
                pb::ProbePhase::Whole | pb::ProbePhase::Compute => {
                    // The weights are shared, not borrowed: nothing is locked while they
                    // compute, so the rank's other probes, reports and updates go on.
                    let (plan, weights, source) = snapshot(&lock(&self.state), r.shadow)?;
                    spec.check_on(&weights.identity.geometry, weights.layers.len(), plan.tp_size)
                        .map_err(|error| RankError::ProbeSize { context: "probe", error })?;
                    let c = compute_probe(backend, &plan, &weights, &source, spec, check, &self.reference_cache)?;
                    if phase == pb::ProbePhase::Whole {
                        // The group's other ranks reduce with this one whatever happened to its
                        // weights meanwhile (one that left the ring would hold them up to the
                        // deadline); only the answer says whether they were replaced.
                        let peers = peers_to_join(&self.collectives, r)?;
                        let (y_digest, seconds) = reduce(&mut lock(&self.collectives), backend, r, &c, peers)?;
                        let mut st = lock(&self.state);
                        if !still_holds(&st, r.shadow, &weights) {
                            return Err(RankError::Replaced);
                        }
                        let answer = answer_of(&st, &c, y_digest, seconds);
                        if r.shadow {
                            keep_verified(&mut st, Arc::downgrade(&weights), spec, check, c, &answer);
                        }
                        return Ok(answer);
                    }
                    let mut st = lock(&self.state);
                    let holds = still_holds(&st, r.shadow, &weights);
                    let answer = answer_of(&st, &c, String::new(), 0.0);
                    // Kept only while it is of what the rank has staged.
                    if holds {
                        st.computed = Some(Computed { weights: Arc::downgrade(&weights), spec, check, probe: c });
                    }
                    Ok(answer)
                }
                pb::ProbePhase::Reduce => {
                    let kept = {
                        let mut st = lock(&self.state);
                        let staged = st.shadow.as_ref().map(|s| Arc::as_ptr(&s.weights));
                        st.computed.take().filter(|k| k.spec == spec && k.check == check && staged == Some(k.weights.as_ptr()))
                    };
                    let kept = kept.ok_or(RankError::NothingComputed)?;
                    let peers = peers_to_join(&self.collectives, r)?;
                    let (y_digest, seconds) = reduce(&mut lock(&self.collectives), backend, r, &kept.probe, peers)?;
                    let mut st = lock(&self.state);
                    // Answered, and kept, only for the weights still staged (an abort or a later
                    // stage may have come while it reduced).
                    if st.shadow.as_ref().map(|s| Arc::as_ptr(&s.weights)) != Some(kept.weights.as_ptr()) {
                        return Err(RankError::Replaced);
                    }
                    let answer = answer_of(&st, &kept.probe, y_digest, seconds);
                    keep_verified(&mut st, kept.weights, spec, check, kept.probe, &answer);
                    Ok(answer)
                }
            }
        };
        // Verifying a staged version is background work: below the serving probes' priority.
        if r.shadow { crate::background::run(work) } else { work() }
    }
}
