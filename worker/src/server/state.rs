//! What a rank holds, behind the service's lock: its plan, its active weights (shared with the
//! probes and reports that read them), a staged version, the version a commit replaced, spare
//! buffers for the next stage, the stage epoch, its collectives and the verdicts it keeps.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use orchestrator_kernels::ScaleRule;
use orchestrator_proto::v1 as pb;
use tonic::Status;

use super::probing::{Computed, KeptProbe};
use crate::collective::{RingListener, TcpRing};
use crate::device::{AnyBackend, DeviceCollectives};
use crate::loader::{RankLoader, RankWeights};
use crate::probe::ProbeSpec;
use crate::source::LoadSource;

/// What the coordinator assigned.
#[derive(Clone)]
pub(super) struct Plan {
    pub(super) tp_size: usize,
    pub(super) tp_rank: usize,
    pub(super) dp_size: usize,
    pub(super) dp_rank: usize,
    pub(super) source: Arc<LoadSource>,
    pub(super) rule: ScaleRule,
    pub(super) fault: pb::Fault,
    pub(super) dump_dir: Option<std::path::PathBuf>,
    /// Keep the buffers an update leaves (the version it replaced, or a staged one it dropped)
    /// for the next stage to reload into, instead of freeing them (`--keep-staging-buffers`).
    pub(super) keep_staging_buffers: bool,
}

/// Weights that probes and reports may read while the rank goes on.
pub(super) type SharedWeights = Arc<RankWeights<AnyBackend>>;

#[derive(Default)]
pub(super) struct State {
    pub(super) plan: Option<Plan>,
    /// The active weights, shared with the probes and reports that read them: those hold the
    /// state lock only to take them and to answer, never while they compute.
    pub(super) weights: Option<SharedWeights>,
    /// A staged version (rolling update): loaded beside the active weights, swapped in by Commit.
    pub(super) shadow: Option<Staged>,
    /// Buffers kept for the next stage (with `keep_staging_buffers`): the weights of a version
    /// an update replaced or dropped, which the next stage reloads into (a reload reuses every
    /// buffer) instead of faulting in fresh memory. The rank then holds two sets of weights
    /// between updates, never more than two.
    pub(super) spare: Option<RankWeights<AnyBackend>>,
    /// The version the last Commit replaced, kept so that an explicit, journaled abort of the
    /// update can swap it back; dropped (or kept as `spare`) by Release (the update ended) or the
    /// next Stage (so the rank never holds more than two versions).
    pub(super) previous: Option<(SharedWeights, Arc<LoadSource>)>,
    /// Bumped by every Stage and Abort: a stage stores its result only if no later Stage or
    /// Abort came meanwhile (a stage abandoned by a coordinator that died can never land after
    /// its successor aborted or restaged).
    pub(super) stage_epoch: u64,
    /// The collective listener, bound at Assign and kept for the rank's life: every ring epoch
    /// of its TP group is joined from it.
    pub(super) listener: Option<RingListener>,
    /// The ring of the group, its id and epoch (a probe for another epoch replaces it).
    pub(super) ring: Option<(u64, u32, TcpRing)>,
    /// The NCCL communicator of a GPU worker's TP group.
    pub(super) device_collectives: DeviceCollectives,
    /// How long the active weights took to load (or, after a commit, to stage), and the same
    /// for the kept version.
    pub(super) load_seconds: f64,
    pub(super) previous_seconds: f64,
    /// How the active weights were loaded (`real`, `dummy`, `stage`, `restage`), and the kept
    /// version's.
    pub(super) load_path: &'static str,
    pub(super) previous_path: &'static str,
    /// The round trip of the stage the active weights were committed from, and their
    /// generation (a report asked for the kept verdict answers with it while the generation is
    /// the same).
    pub(super) committed_round_trip: Option<(u64, crate::roundtrip::RoundTrip)>,
    /// The first half of a verification probe of the staged weights, for its second.
    pub(super) computed: Option<Computed>,
    /// The last verification probe of the staged weights, reduced: for the probe right after
    /// their commit ([`pb::ProbeRequest::kept`]).
    pub(super) verified_probe: Option<(std::sync::Weak<RankWeights<AnyBackend>>, KeptProbe)>,
    /// The verification probe of the staged weights the active ones were committed from, and
    /// their generation: it answers the probe after the commit while the generation is the same.
    pub(super) committed_probe: Option<(u64, KeptProbe)>,
}

/// A version staged beside the active weights.
pub(super) struct Staged {
    /// Shared with the first half of a verification probe while it computes (see
    /// [`pb::ProbePhase`]).
    pub(super) weights: SharedWeights,
    pub(super) source: Arc<LoadSource>,
    /// Its round trip, run by the stage on the background pool once the weights were in place
    /// (nothing writes them between the stage and the commit, so the verdict of a report on
    /// them is that one). `None`: the stage deferred it ([`StageOptions::defer_round_trip`]) and
    /// no report has given it yet.
    pub(super) round_trip: Option<crate::roundtrip::RoundTrip>,
    /// `stage` (fresh buffers) or `restage` (kept ones), and how long it took.
    pub(super) path: &'static str,
    pub(super) seconds: f64,
}

/// What a stage does besides loading the new version beside the active one.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct StageOptions {
    /// Also prepare this probe's reference for the staged version (beside serving, like the load).
    pub(super) reference: Option<ProbeSpec>,
    /// Run no round trip: the replica is verified as byte-identical to one that ran it, whose
    /// verdict its verification report adopts (see [`adopt_round_trip`]).
    pub(super) defer_round_trip: bool,
}

pub(super) fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Takes a set of weights out of the state (`take`) and keeps it as the next stage's buffers when
/// the plan says so and none are kept yet; otherwise it is freed.
pub(super) fn keep_or_drop(st: &mut State, take: impl FnOnce(&mut State) -> Option<RankWeights<AnyBackend>>) {
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
pub(super) fn prepare_spare(
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
pub(super) fn weights_of(st: &State, shadow: bool) -> Result<(&SharedWeights, &Arc<LoadSource>), Status> {
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
pub(super) fn snapshot(st: &State, shadow: bool) -> Result<(Plan, SharedWeights, Arc<LoadSource>), Status> {
    let plan = st.plan.clone().ok_or_else(|| Status::failed_precondition("no shard assigned"))?;
    let (w, source) = weights_of(st, shadow)?;
    Ok((plan, w.clone(), source.clone()))
}

/// Whether `w` is still what the rank holds as active (or staged) weights.
pub(super) fn still_holds(st: &State, shadow: bool, w: &SharedWeights) -> bool {
    weights_of(st, shadow).is_ok_and(|(now, _)| Arc::ptr_eq(now, w))
}

/// Owned weights out of shared ones, when nothing else reads them (else they are freed when the
/// last reader ends).
pub(super) fn unshared(w: SharedWeights) -> Option<RankWeights<AnyBackend>> {
    Arc::try_unwrap(w).ok()
}

/// The versions a rank holds: active (empty before the first load) and staged (empty when
/// nothing is staged). Every answer that can change or depend on them carries both.
pub(super) fn versions_of(st: &State) -> (String, String) {
    let active = match (&st.plan, &st.weights) {
        (Some(p), Some(_)) => p.source.version(),
        _ => String::new(),
    };
    (active, st.shadow.as_ref().map(|s| s.source.version()).unwrap_or_default())
}
