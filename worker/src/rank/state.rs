//! What a rank holds, behind the service's lock: its plan, its active weights (shared with the
//! probes and reports that read them), a staged version, the version a commit replaced, spare
//! buffers for the next stage, the stage epoch and the verdicts it keeps; and, behind a lock of
//! their own, its collectives.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use orchestrator_kernels::ScaleRule;
use orchestrator_proto::v1 as pb;

use super::RankError;
use super::probing::{Computed, KeptProbe};
use crate::collective::{RingListener, TcpRing};
use crate::device::{AnyBackend, DeviceCollectives};
use crate::loader::{RankLoader, RankWeights};
use crate::probe::ProbeSpec;
use crate::source::LoadSource;

/// A version in place after a commit or abort, and the generation of its weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct InPlace {
    pub(crate) version: String,
    pub(crate) generation: u64,
}

/// What the coordinator assigned.
#[derive(Clone)]
pub(crate) struct Plan {
    pub(crate) tp_size: usize,
    pub(crate) tp_rank: usize,
    pub(crate) dp_size: usize,
    pub(crate) dp_rank: usize,
    pub(crate) source: Arc<LoadSource>,
    pub(crate) rule: ScaleRule,
    pub(crate) fault: pb::Fault,
    pub(crate) dump_dir: Option<crate::dump::DumpDir>,
    /// Keep the buffers an update leaves (the version it replaced, or a staged one it dropped)
    /// for the next stage to reload into, instead of freeing them (`--keep-staging-buffers`).
    pub(crate) keep_staging_buffers: bool,
}

/// A rank's collectives: its place in its TP group, its ring listener, the group's ring and its
/// NCCL communicator. Behind a lock of their own: a ring join or all-reduce waits on the group's
/// other ranks (up to the probe's deadline) without holding the rank's [`State`], so its
/// reports, stages, commits and aborts go on meanwhile. Lock order: collectives, then state.
#[derive(Default)]
pub(crate) struct Collectives {
    pub(crate) tp_rank: usize,
    pub(crate) tp_size: usize,
    /// The collective listener, bound at Assign and kept for the rank's life: every ring epoch
    /// of its TP group is joined from it.
    pub(crate) listener: Option<RingListener>,
    /// The ring of the group, its id and epoch (a probe for another epoch replaces it).
    pub(crate) ring: Option<(u64, u32, TcpRing)>,
    /// The NCCL communicator of a GPU worker's TP group.
    pub(crate) device: DeviceCollectives,
}

/// Weights that probes and reports may read while the rank goes on.
pub(crate) type SharedWeights = Arc<RankWeights<AnyBackend>>;

#[derive(Default)]
pub(crate) struct State {
    pub(crate) plan: Option<Plan>,
    /// The active weights, shared with the probes and reports that read them: those hold the
    /// state lock only to take them and to answer, never while they compute.
    pub(crate) weights: Option<SharedWeights>,
    /// A staged version (rolling update): loaded beside the active weights, swapped in by Commit.
    pub(crate) shadow: Option<Staged>,
    /// Buffers kept for the next stage (with `keep_staging_buffers`): the weights of a version
    /// an update replaced or dropped, which the next stage reloads into (a reload reuses every
    /// buffer) instead of faulting in fresh memory. The rank then holds two sets of weights
    /// between updates, never more than two.
    pub(crate) spare: Option<RankWeights<AnyBackend>>,
    /// The version the last Commit replaced, kept so that an explicit, journaled abort of the
    /// update can swap it back; dropped (or kept as `spare`) by Release (the update ended) or the
    /// next Stage (so the rank never holds more than two versions).
    pub(crate) previous: Option<(SharedWeights, Arc<LoadSource>)>,
    /// Bumped by every Stage and Abort: a stage stores its result only if no later Stage or
    /// Abort came meanwhile (a stage abandoned by a coordinator that died can never land after
    /// its successor aborted or restaged).
    pub(crate) stage_epoch: u64,
    /// Bumped by every Load (and Reload), Commit, rollback and Assign: a load installs its
    /// weights only if none of them came meanwhile (a load that outlived its assignment, or a
    /// commit's swap, never lands over what came after it).
    pub(crate) load_epoch: u64,
    /// How long the active weights took to load (or, after a commit, to stage), and the same
    /// for the kept version.
    pub(crate) load_seconds: f64,
    pub(crate) previous_seconds: f64,
    /// How the active weights were loaded (`real`, `dummy`, `stage`, `restage`), and the kept
    /// version's.
    pub(crate) load_path: &'static str,
    pub(crate) previous_path: &'static str,
    /// The round trip of the stage the active weights were committed from, and their
    /// generation (a report asked for the kept verdict answers with it while the generation is
    /// the same).
    pub(crate) committed_round_trip: Option<(u64, crate::roundtrip::RoundTrip)>,
    /// The first half of a verification probe of the staged weights, for its second.
    pub(crate) computed: Option<Computed>,
    /// The last verification probe of the staged weights, reduced: for the probe right after
    /// their commit ([`pb::ProbeRequest::kept`]).
    pub(crate) verified_probe: Option<(std::sync::Weak<RankWeights<AnyBackend>>, KeptProbe)>,
    /// The verification probe of the staged weights the active ones were committed from, and
    /// their generation: it answers the probe after the commit while the generation is the same.
    pub(crate) committed_probe: Option<(u64, KeptProbe)>,
}

/// A version staged beside the active weights.
pub(crate) struct Staged {
    /// Shared with the first half of a verification probe while it computes (see
    /// [`pb::ProbePhase`]).
    pub(crate) weights: SharedWeights,
    pub(crate) source: Arc<LoadSource>,
    /// Its round trip, run by the stage on the background pool once the weights were in place
    /// (nothing writes them between the stage and the commit, so the verdict of a report on
    /// them is that one). `None`: the stage deferred it ([`StageOptions::defer_round_trip`]) and
    /// no report has given it yet.
    pub(crate) round_trip: Option<crate::roundtrip::RoundTrip>,
    /// `stage` (fresh buffers) or `restage` (kept ones), and how long it took.
    pub(crate) path: &'static str,
    pub(crate) seconds: f64,
}

/// What a stage does besides loading the new version beside the active one.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StageOptions {
    /// Also prepare this probe's reference for the staged version (beside serving, like the load).
    pub(crate) reference: Option<ProbeSpec>,
    /// Run no round trip: the replica is verified as byte-identical to one that ran it, whose
    /// verdict its verification report adopts (see [`adopt_round_trip`]).
    pub(crate) defer_round_trip: bool,
    /// The stage epoch the Stage request took as it arrived ([`super::Rank::begin_stage`]): a
    /// later stage or abort, even one while its source was still being opened, supersedes it.
    pub(crate) epoch: Option<u64>,
}

/// Locks a rank's state (or its collectives), whatever a panicking holder left.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Takes a set of weights out of the state (`take`) and keeps it as the next stage's buffers when
/// the plan says so and none are kept yet; otherwise it is freed.
pub(crate) fn keep_or_drop(st: &mut State, take: impl FnOnce(&mut State) -> Option<RankWeights<AnyBackend>>) {
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
pub(crate) fn prepare_spare(
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
pub(crate) fn weights_of(st: &State, shadow: bool) -> Result<(&SharedWeights, &Arc<LoadSource>), RankError> {
    if shadow {
        let staged = st.shadow.as_ref().ok_or(RankError::NoStage)?;
        Ok((&staged.weights, &staged.source))
    } else {
        let plan = st.plan.as_ref().ok_or(RankError::NotAssigned)?;
        Ok((st.weights.as_ref().ok_or(RankError::NotLoaded)?, &plan.source))
    }
}

/// What a probe or report computes on, taken under the state lock and read without it: the
/// plan, the active (or staged) weights and their source.
pub(crate) fn snapshot(st: &State, shadow: bool) -> Result<(Plan, SharedWeights, Arc<LoadSource>), RankError> {
    let plan = st.plan.clone().ok_or(RankError::NotAssigned)?;
    let (w, source) = weights_of(st, shadow)?;
    Ok((plan, w.clone(), source.clone()))
}

/// Whether `w` is still what the rank holds as active (or staged) weights.
pub(crate) fn still_holds(st: &State, shadow: bool, w: &SharedWeights) -> bool {
    weights_of(st, shadow).is_ok_and(|(now, _)| Arc::ptr_eq(now, w))
}

/// Owned weights out of shared ones, when nothing else reads them (else they are freed when the
/// last reader ends).
pub(crate) fn unshared(w: SharedWeights) -> Option<RankWeights<AnyBackend>> {
    Arc::try_unwrap(w).ok()
}

/// The versions a rank holds: active (empty before the first load) and staged (empty when
/// nothing is staged). Every answer that can change or depend on them carries both.
pub(crate) fn versions_of(st: &State) -> (String, String) {
    let active = match (&st.plan, &st.weights) {
        (Some(p), Some(_)) => p.source.version(),
        _ => String::new(),
    };
    (active, st.shadow.as_ref().map(|s| s.source.version()).unwrap_or_default())
}

impl State {
    /// Swaps the staged version in (Commit): the active weights become the kept version (for
    /// an abort's rollback). Idempotent: a commit whose answer was lost, asked again, finds
    /// `expected` in place. An empty `expected` commits whatever is staged.
    pub(crate) fn commit(&mut self, expected: &str) -> Result<InPlace, RankError> {
        let (active, staged) = versions_of(self);
        if self.shadow.is_none() && !expected.is_empty() && active == expected {
            return Ok(InPlace { version: active, generation: self.weights.as_ref().map_or(0, |w| w.generation) });
        }
        let Some(Staged { weights, source, path, seconds, round_trip }) = self.shadow.take() else {
            return Err(RankError::CommitNothingStaged { active });
        };
        if !expected.is_empty() && staged != expected {
            self.shadow = Some(Staged { weights, source, path, seconds, round_trip });
            return Err(RankError::CommitOtherVersion { staged, expected: expected.to_string() });
        }
        let staged_at = Arc::as_ptr(&weights);
        let mut w = match Arc::try_unwrap(weights) {
            Ok(w) => w,
            Err(weights) => {
                // A verification probe still computes on them (asked again, the commit finds
                // them free).
                self.shadow = Some(Staged { weights, source, path, seconds, round_trip });
                return Err(RankError::StagedInUse);
            }
        };
        self.computed = None;
        w.generation = self.weights.as_ref().map_or(1, |old| old.generation + 1);
        self.committed_round_trip = round_trip.map(|rt| (w.generation, rt));
        // The verification probe kept for these very weights (a `Weak` keeps its allocation,
        // so no later weights can share the address) answers the probe after the commit.
        self.committed_probe =
            self.verified_probe.take().filter(|(kept, _)| std::ptr::eq(kept.as_ptr(), staged_at)).map(|(_, k)| (w.generation, k));
        let replaced = self.plan.as_mut().map(|p| std::mem::replace(&mut p.source, source));
        self.load_epoch += 1;
        self.previous = self.weights.take().zip(replaced);
        let generation = w.generation;
        self.weights = Some(Arc::new(w));
        self.previous_seconds = std::mem::replace(&mut self.load_seconds, seconds);
        self.previous_path = std::mem::replace(&mut self.load_path, path);
        if let Some(p) = &self.plan {
            crate::metrics::worker().serving(p.dp_rank, p.tp_rank, &staged);
            tracing::info!(tp_rank = p.tp_rank, replica = p.dp_rank, version = %staged, "committed the staged version");
        }
        Ok(InPlace { version: staged, generation })
    }

    /// Drops what is staged (Abort) and, with `rollback`, swaps the kept version back in (when
    /// it is `expected`, or whatever it is for an empty `expected`). Every abort bumps the stage
    /// epoch, so a stage still running can no longer land. Answers the active version.
    pub(crate) fn abort(&mut self, rollback: bool, expected: &str) -> Result<String, RankError> {
        self.computed = None;
        self.verified_probe = None;
        // Weights a verification probe still computes on are freed when it ends, not kept.
        keep_or_drop(self, |st| st.shadow.take().and_then(|s| unshared(s.weights)));
        self.stage_epoch += 1;
        if rollback {
            // Asked again after a rollback whose answer was lost: the rank is already on the
            // version asked for, with nothing kept; it says so, as a commit asked again does.
            let active = versions_of(self).0;
            if self.previous.is_none() && !expected.is_empty() && active == expected {
                return Ok(active);
            }
            let (kept, source) = self.previous.take().ok_or(RankError::NothingKept)?;
            let version = source.version();
            if !expected.is_empty() && version != expected {
                self.previous = Some((kept, source));
                return Err(RankError::KeptOtherVersion { kept: version, expected: expected.to_string() });
            }
            let mut w = match Arc::try_unwrap(kept) {
                Ok(w) => w,
                Err(kept) => {
                    // A probe or report that began before the commit still reads them.
                    self.previous = Some((kept, source));
                    return Err(RankError::KeptInUse);
                }
            };
            w.generation = self.weights.as_ref().map_or(1, |cur| cur.generation + 1);
            self.load_epoch += 1;
            self.committed_round_trip = None;
            self.committed_probe = None;
            if let Some(p) = self.plan.as_mut() {
                p.source = source;
            }
            self.weights = Some(Arc::new(w));
            self.load_seconds = self.previous_seconds;
            self.load_path = self.previous_path;
            if let Some(p) = &self.plan {
                crate::metrics::worker().serving(p.dp_rank, p.tp_rank, &p.source.version());
            }
        }
        Ok(versions_of(self).0)
    }

    /// Ends an update (Release): the kept version is freed, or kept as the next stage's buffers.
    pub(crate) fn release(&mut self) {
        keep_or_drop(self, |st| st.previous.take().and_then(|(w, _)| unshared(w)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orchestrator_model::{Generator, ModelConfig, Preset};

    /// A tiny dummy version (`seed`) loaded on the CPU.
    fn version(seed: u64) -> (Arc<LoadSource>, RankWeights<AnyBackend>) {
        let config = ModelConfig::from_preset(Preset::Tiny, Some(1), false).unwrap();
        let source = LoadSource::Dummy { config, generator: Generator::new(seed) };
        let backend = AnyBackend::Cpu(orchestrator_kernels::CpuBackend);
        let w = RankLoader::new(&backend, source.config(), 1, 0, ScaleRule::Rceil).unwrap().load(&source).unwrap();
        (Arc::new(source), w)
    }

    fn loaded(seed: u64) -> State {
        let (source, mut w) = version(seed);
        w.generation = 1;
        let plan = Plan {
            tp_size: 1,
            tp_rank: 0,
            dp_size: 1,
            dp_rank: 0,
            source,
            rule: ScaleRule::Rceil,
            fault: pb::Fault::None,
            dump_dir: None,
            keep_staging_buffers: false,
        };
        State { plan: Some(plan), weights: Some(Arc::new(w)), load_path: "real", load_seconds: 1.0, ..State::default() }
    }

    fn stage(st: &mut State, seed: u64) -> SharedWeights {
        let (source, w) = version(seed);
        let weights = Arc::new(w);
        st.shadow = Some(Staged { weights: weights.clone(), source, round_trip: None, path: "stage", seconds: 0.5 });
        weights
    }

    /// Commit and abort, event by event: what each answers or refuses (by kind, and the gRPC
    /// code it becomes), and what the rank holds after it.
    #[test]
    fn commits_and_aborts_answer_or_refuse_by_kind_and_leave_one_version_active() {
        use RankError::*;
        let code = |e: RankError| tonic::Status::from(e).code();
        let mut empty = State::default();
        assert!(matches!(empty.commit(""), Err(CommitNothingStaged { active }) if active.is_empty()));
        assert!(matches!(empty.abort(true, ""), Err(NothingKept)));
        assert_eq!(empty.abort(false, "").unwrap(), "");

        let mut st = loaded(1);
        let (a, b, c) = (version(1).0.version(), version(2).0.version(), version(3).0.version());
        // Nothing staged: only the version in place is confirmed (a commit asked again).
        assert!(matches!(st.commit(&b), Err(CommitNothingStaged { active }) if active == a));
        assert_eq!(st.commit(&a).unwrap(), InPlace { version: a.clone(), generation: 1 });

        let staged = stage(&mut st, 2);
        let refused = st.commit(&c).unwrap_err();
        assert!(matches!(&refused, CommitOtherVersion { staged, expected } if *staged == b && *expected == c), "{refused:?}");
        assert_eq!(code(refused), tonic::Code::FailedPrecondition);
        // A verification probe still reads the staged weights: ask again; nothing moved.
        assert!(matches!(st.commit(&b), Err(StagedInUse)));
        assert_eq!(code(StagedInUse), tonic::Code::Unavailable);
        assert_eq!(versions_of(&st), (a.clone(), b.clone()));
        drop(staged);
        assert_eq!(st.commit(&b).unwrap(), InPlace { version: b.clone(), generation: 2 });
        assert_eq!(versions_of(&st), (b.clone(), String::new()));
        assert_eq!((st.load_path, st.load_seconds, st.previous_path, st.previous_seconds), ("stage", 0.5, "real", 1.0));
        assert_eq!(st.commit(&b).unwrap(), InPlace { version: b.clone(), generation: 2 }, "a commit asked again");

        // Roll back: only to the kept version, and not while a reader holds it.
        let epoch = st.stage_epoch;
        assert!(matches!(st.abort(true, &c), Err(KeptOtherVersion { kept, expected }) if kept == a && expected == c));
        let reader = st.previous.as_ref().map(|(w, _)| w.clone()).unwrap();
        assert!(matches!(st.abort(true, &a), Err(KeptInUse)));
        assert_eq!(code(KeptInUse), tonic::Code::Unavailable);
        assert_eq!(versions_of(&st).0, b, "a refused rollback leaves the committed version");
        drop(reader);
        assert_eq!(st.abort(true, &a).unwrap(), a);
        assert_eq!(st.stage_epoch, epoch + 3, "every abort bumps the stage epoch");
        assert_eq!((st.weights.as_ref().unwrap().generation, st.load_path, st.load_seconds), (3, "real", 1.0));
        assert!(matches!(st.abort(true, ""), Err(NothingKept)));
        // A rollback asked again (its answer lost): already on that version, nothing moves.
        assert_eq!(st.abort(true, &a).unwrap(), a);
        assert_eq!((versions_of(&st).0, st.weights.as_ref().unwrap().generation), (a.clone(), 3));
        assert!(matches!(st.abort(true, &b), Err(NothingKept)), "not to another version");

        // A plain abort drops what is staged and keeps the active version.
        stage(&mut st, 3);
        assert_eq!(st.abort(false, "").unwrap(), a);
        assert_eq!(versions_of(&st), (a.clone(), String::new()));
        assert!(matches!(st.commit(&c), Err(CommitNothingStaged { active }) if active == a));
    }

    #[test]
    fn release_frees_the_kept_version_or_keeps_it_as_spare_buffers() {
        for keep in [false, true] {
            let mut st = loaded(1);
            st.plan.as_mut().unwrap().keep_staging_buffers = keep;
            stage(&mut st, 2);
            st.commit("").unwrap();
            assert!(st.previous.is_some());
            st.release();
            assert!(st.previous.is_none());
            assert_eq!(st.spare.is_some(), keep);
            assert!(matches!(st.abort(true, ""), Err(RankError::NothingKept)), "nothing to roll back to after a release");
        }
    }
}
