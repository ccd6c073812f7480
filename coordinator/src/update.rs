//! Rolling weight updates (`orchestrator update`), routed probes, and bringing replicas back
//! into rotation: the I/O around the commit protocol of [`crate::rollout`].
//!
//! Every replica (TP group) of the update stages the new version at once, on every rank into
//! shadow buffers through the same loader pipeline, and verifies what it staged (round trips,
//! probes: the first batch against the reference, a later replica as byte-identical to the
//! first verified one as soon as that one proved the version), all while it keeps serving its
//! active weights in rotation. Then one batch at a time, in order: the batch must agree on `y`
//! with itself and with the replicas already updated, and the decision is journaled: abort (any
//! failure: every rank drops what it staged) or commit. A committed replica leaves probe
//! rotation (when another replica can serve) for the swap alone, once the routed probes it was
//! serving are answered; every rank is driven to the new version (an abort is never reported
//! after it), and the replica returns to rotation only once every rank confirmed one version
//! and a probe passed. An update that ends early aborts what the replicas it did not reach
//! staged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use orchestrator_model::AllowedRoots;
use orchestrator_model::checkpoint::{ContentClaim, VersionFrom};
use orchestrator_model::inspect::inspect;
use orchestrator_model::{Checkpoint, Geometry, ModelConfig, WeightFormat};
use orchestrator_proto::limits;
use orchestrator_proto::v1 as pb;
use orchestrator_worker::probe::ProbeSpec;
use serde::Serialize;

use crate::cluster::{Cluster, RankDown, RankError, RankResults};
use crate::journal::{Event, Journal, SourceRecord, Step};
use crate::rollout::{self, CommitStatus, Decision, RankView};
use crate::rotation::Rotation;

/// What a rolling update is asked to do.
pub struct UpdatePlan<'a> {
    /// The new checkpoint directory.
    pub dir: &'a Path,
    pub probe: ProbeSpec,
    pub max_unavailable: u32,
    /// Replicas staging at once (0: every replica of the update).
    pub max_staging: u32,
    /// The replicas to update (all when `None`).
    pub replicas: Option<Vec<u32>>,
    /// Where to journal the update's steps, and as what.
    pub journal: Option<Journaled<'a>>,
    /// The directories the workers may read: checked here before any replica is touched.
    pub roots: &'a AllowedRoots,
    /// How long a decided commit is driven to a rank that does not answer before it is reported
    /// (the replica then stays out with the commit pending).
    pub commit_timeout: std::time::Duration,
    /// The claims this coordinator made on checkpoints it hashed ([`KnownClaims`]); `None`
    /// hashes the new checkpoint whatever it is.
    pub known: Option<Arc<KnownClaims>>,
    /// The version the checkpoint must hold, where the update must roll out one version and no
    /// other (a recovery resolving an interrupted update: the version that update was rolling
    /// out, or the one a rollback returns to): refused before any replica is touched when the
    /// directory now holds another (rewritten in place since).
    pub expected_version: Option<&'a str>,
}

/// Where an update is journaled, and as what.
pub struct Journaled<'a> {
    pub journal: &'a Journal,
    /// The update's number.
    pub update: u64,
    /// The source it moves from.
    pub from: SourceRecord,
    /// The interrupted update a recovery's update resolves (closed by this one's begin).
    pub resumes: Option<u64>,
}

/// What is wrong with a replica's probe.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ProbeProblem {
    /// A rank did not answer.
    #[error("{0}")]
    Rank(RankError),
    #[error("a rank's probe is out of tolerance")]
    OutOfTolerance,
    /// The ranks probed different versions: each worker's.
    #[error("the group's ranks hold different versions ({})", .0.iter().map(|(id, v)| format!("worker {id}: {v}")).collect::<Vec<_>>().join(", "))]
    Versions(Vec<(u32, String)>),
    #[error("the group's ranks disagree on y")]
    YDisagrees,
    #[error("the replica has no ranks")]
    NoRanks,
}

/// Every problem of a replica's probe, in the order found (at least one).
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeProblems(pub Vec<ProbeProblem>);

impl std::fmt::Display for ProbeProblems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let all: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&all.join("; "))
    }
}

impl std::error::Error for ProbeProblems {}

/// One replica's probe, judged: every rank answered within tolerance, on one version, with one
/// `y`. The version and `y` when it passed; every problem otherwise.
pub fn judge_probe(results: &RankResults<pb::ProbeResult>) -> Result<(String, String), ProbeProblems> {
    let mut problems: Vec<ProbeProblem> = results.values().filter_map(|r| r.as_ref().err().cloned().map(ProbeProblem::Rank)).collect();
    let probes: Vec<(&u32, &pb::ProbeResult)> = results.iter().filter_map(|(id, r)| r.as_ref().ok().map(|p| (id, p))).collect();
    if probes.iter().any(|(_, p)| !p.ok) {
        problems.push(ProbeProblem::OutOfTolerance);
    }
    if probes.windows(2).any(|w| w[0].1.probed_version != w[1].1.probed_version) {
        problems.push(ProbeProblem::Versions(probes.iter().map(|(id, p)| (**id, p.probed_version.clone())).collect()));
    }
    if probes.windows(2).any(|w| w[0].1.y_digest != w[1].1.y_digest) {
        problems.push(ProbeProblem::YDisagrees);
    }
    if results.is_empty() {
        problems.push(ProbeProblem::NoRanks);
    }
    match (problems.is_empty(), probes.first()) {
        (true, Some((_, p))) => Ok((p.probed_version.clone(), p.y_digest.clone())),
        _ => Err(ProbeProblems(problems)),
    }
}

/// The error of a routed probe when no replica serves.
pub const NO_REPLICA: &str = "no replica in rotation";

/// One probe through the rotation. A probe whose ranks fail or disagree (on `y` or on the
/// version they hold) takes its replica out of rotation at once, even when an update owns the
/// replica (a replica keeps serving while it stages; the update, or else the health loop,
/// proves it again before it serves), and the probe is tried again on the next replica in
/// rotation, each replica at most once: it fails only when every replica it tried failed, with
/// every replica's reason. The version counted is the one the ranks said they probed.
pub async fn routed_probe(cluster: &Cluster, rotation: &Rotation, spec: ProbeSpec) -> pb::RoutedProbeResult {
    let mut tried: Vec<u32> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    while let Some(slot) = rotation.begin_probe(&tried) {
        let replica = slot.dp;
        tried.push(replica);
        let results = cluster.probe_in(Some(replica), (spec.tokens as u32, spec.latents as u32, spec.seed), false, true).await;
        // Answered: a swap waiting for this replica to drain may go on.
        drop(slot);
        match judge_probe(&results) {
            Ok((version, _)) => {
                rotation.observed_version(replica, &version);
                return pb::RoutedProbeResult { ok: true, replica, checkpoint_version: version, error: String::new() };
            }
            Err(why) => {
                rotation.pull(replica, &format!("a routed probe failed: {why}"));
                tracing::warn!(replica, "routed probe failed, replica out of rotation: {why}");
                errors.push(format!("replica dp{replica} (now out of rotation): {why}"));
            }
        }
    }
    let error = if errors.is_empty() { NO_REPLICA.to_string() } else { errors.join("; ") };
    pb::RoutedProbeResult { ok: false, replica: tried.last().copied().unwrap_or(0), checkpoint_version: String::new(), error }
}

/// How a replica out of rotation must prove itself before it serves again.
#[derive(Clone, Copy, Debug)]
pub enum Proof<'a> {
    /// A full probe against the checkpoint-order reference (q bit-exact, z within tolerance),
    /// the group agreeing on one version and one `y`: a replica that left rotation for a
    /// failure, or after an abort.
    Verified,
    /// Right after a commit of weights verified in shadow: a serving probe whose `y` must equal
    /// the one verified before the swap, on the committed version. `reference`: the replica
    /// verified the version against the reference, which its ranks keep ([`ReferenceCache`]),
    /// and checks against it again (without recomputing it), as a report's probe of the first
    /// replica of a version does; a replica verified as byte-identical to it runs only its
    /// kernel pass, as in a report.
    ///
    /// [`ReferenceCache`]: orchestrator_worker::probe::ReferenceCache
    SameAsStaged { version: &'a str, y: &'a str, reference: bool },
}

/// Probes a replica that is out of rotation on its active weights and puts it back when the
/// probe passes: the version its ranks agreed on, or why it stays out. `by_update`: the update
/// that owns the replica asks (see [`Rotation::reinstate`]).
pub async fn try_reinstate(
    cluster: &Cluster,
    rotation: &Rotation,
    dp: u32,
    spec: ProbeSpec,
    proof: Proof<'_>,
    by_update: bool,
) -> Result<String, ReinstateError> {
    reinstate(cluster, rotation, dp, spec, proof, by_update).await.map(|(version, _)| version)
}

/// Why a replica did not return to rotation.
#[derive(Debug, thiserror::Error)]
pub enum ReinstateError {
    #[error("{0}")]
    Probe(#[from] ProbeProblems),
    /// After a swap, the group probes another version or `y` than the one verified staged.
    #[error("after the swap the group probes version {version} with y {y}; verified before it: {verified} with y {verified_y}")]
    NotAsVerified { version: String, y: String, verified: String, verified_y: String },
    /// The probe passed, but the replica is not free to serve (a dead rank; an update owns it).
    #[error("probe passed on {version}, but the replica is not free to serve")]
    NotFree { version: String },
}

impl ReinstateError {
    /// Whether every answer that came shows weights other than those verified: another version
    /// or `y` than verified, a rank out of tolerance, ranks that disagree. A rank that did not
    /// answer (dead, stalled, a ring that failed) shows nothing about the weights.
    pub fn shows_other_weights(&self) -> bool {
        match self {
            Self::NotAsVerified { .. } => true,
            Self::Probe(problems) => {
                problems.0.iter().any(|p| matches!(p, ProbeProblem::OutOfTolerance | ProbeProblem::Versions(_) | ProbeProblem::YDisagrees))
            }
            Self::NotFree { .. } => false,
        }
    }
}

/// [`try_reinstate`], with the probe's answers by worker when it passed.
async fn reinstate(
    cluster: &Cluster,
    rotation: &Rotation,
    dp: u32,
    spec: ProbeSpec,
    proof: Proof<'_>,
    by_update: bool,
) -> Result<(String, RankResults<pb::ProbeResult>), ReinstateError> {
    let skip_reference = matches!(proof, Proof::SameAsStaged { reference: false, .. });
    let asked = (spec.tokens as u32, spec.latents as u32, spec.seed);
    // Right after a commit every rank answers from the verification probe it kept of the very
    // weights it committed (the same probe, judged the same way below); when any rank kept none
    // (it restarted, or restaged after the probe), the group computes the probe again.
    let kept = match proof {
        Proof::SameAsStaged { .. } => Some(cluster.probe_kept(dp, asked, skip_reference).await).filter(|r| r.values().all(Result::is_ok)),
        Proof::Verified => None,
    };
    let results = match kept {
        Some(results) => results,
        None => cluster.probe_in(Some(dp), asked, false, skip_reference).await,
    };
    let (version, y) = judge_probe(&results)?;
    rotation.observed_version(dp, &version);
    if let Proof::SameAsStaged { version: want, y: want_y, .. } = proof
        && (version != want || y != want_y)
    {
        return Err(ReinstateError::NotAsVerified { version, y, verified: want.to_string(), verified_y: want_y.to_string() });
    }
    if rotation.reinstate(dp, &version, by_update) { Ok((version, results)) } else { Err(ReinstateError::NotFree { version }) }
}

/// The probe that brought a replica back into rotation right after its swap: the same probe,
/// checked the same way, as a report run then would ask of it, so that the report after the
/// update can stand on it while its ranks still hold what it probed
/// ([`crate::session::Session::check_after_update`]).
#[derive(Clone, Debug)]
pub struct SwapProbe {
    pub spec: ProbeSpec,
    /// It checked against the reference (not only the kernel pass).
    pub reference: bool,
    /// Every rank's answer, by worker.
    pub results: BTreeMap<u32, pb::ProbeResult>,
}

/// Asks every rank of replica `dp` to swap to the decided `target`, again and again, until
/// every rank confirmed it or the commit is stuck (a rank dead, without the staged copy, or
/// silent past `limit`). Rank views come from the commit answers, and for a rank whose commit
/// failed, from its brief report.
pub async fn drive_commit(cluster: &Cluster, dp: u32, target: &str, limit: std::time::Duration) -> CommitStatus {
    let start = Instant::now();
    let ranks: Vec<&crate::cluster::WorkerHandle> = cluster.workers.iter().filter(|w| w.dp == dp).collect();
    loop {
        let answers = cluster.commit(dp, target).await;
        let mut views = Vec::new();
        for w in &ranks {
            let view = match answers.get(&w.id) {
                Some(Ok((active, staged))) => RankView::Holds { active: active.clone(), staged: staged.clone() },
                other => {
                    let why = match other {
                        Some(Err(e)) => e.to_string(),
                        _ => format!("{}: no answer", w.label()),
                    };
                    match cluster.health(w).await {
                        Some(down) if down.is_dead() => RankView::Dead { why: down.to_string() },
                        _ => match brief_versions(cluster, w.id).await {
                            Some((active, staged)) => RankView::Holds { active, staged },
                            None => RankView::Silent { for_: start.elapsed(), why },
                        },
                    }
                }
            };
            views.push(view);
        }
        match rollout::commit_status(target, &views, limit) {
            // The limit holds for the whole drive, not only for silent ranks: a rank that answers
            // but keeps failing its commit is stuck too.
            CommitStatus::Pending { ranks } if start.elapsed() > limit => {
                let why = format!("did not confirm the commit within {:.1} s", limit.as_secs_f64());
                return CommitStatus::Stuck { ranks: ranks.into_iter().map(|r| (r, why.clone())).collect() };
            }
            CommitStatus::Pending { .. } => tokio::time::sleep(limits::COMMIT_RETRY).await,
            done_or_stuck => return done_or_stuck,
        }
    }
}

/// The versions one rank holds and has staged, from its brief report.
async fn brief_versions(cluster: &Cluster, id: u32) -> Option<(String, String)> {
    let reports = cluster
        .fan_out_where(
            |w| w.id == id,
            |w, mut client| {
                let req = orchestrator_net::auth::request(
                    pb::ReportRequest { shadow: false, brief: true, kept_round_trip: false, identical_to: None },
                    limits::COMMIT_CALL_DEADLINE,
                    Some(&cluster.token),
                );
                let label = w.label();
                async move { client.report(req).await.map(|r| r.into_inner()).map_err(|s| RankError::call(label, "report", &s)) }
            },
        )
        .await;
    reports.get(&id)?.as_ref().ok().map(|r| (r.checkpoint_version.clone(), r.staged_version.clone()))
}

/// What an update did, step by step.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct UpdateOutcome {
    pub ok: bool,
    pub checkpoint: String,
    pub new_version: String,
    pub steps: Vec<String>,
    /// Replica -> the version its ranks last agreed on (empty: they do not agree, or did not
    /// answer).
    pub versions: BTreeMap<u32, String>,
    /// Replicas whose commit was decided but not confirmed by every rank (out of rotation until
    /// it is).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub pending_commits: BTreeMap<u32, String>,
    pub seconds: f64,
    /// Why the update did not finish with every replica on the new version, as data (the steps
    /// say it in words); absent when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<UpdateFailure>,
    /// Each swapped replica's passing probe after its swap (for the report after the update).
    #[serde(skip)]
    #[schemars(skip)]
    pub swap_probes: BTreeMap<u32, SwapProbe>,
}

/// Why an update did not finish with every replica on the new version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct UpdateFailure {
    pub kind: UpdateFailureKind,
    /// Nothing was touched: no replica staged anything (every rank serves what it served).
    pub refused: bool,
    /// The replicas it names: the one whose check failed, those whose commit is unconfirmed,
    /// those skipped for a dead rank (empty for a refusal).
    pub replicas: Vec<u32>,
    /// The rank whose check failed (`dp0/tp1`), where one rank's did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<String>,
    /// A staged round trip's failures, tensor by tensor (kind `round_trip`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub round_trip: Vec<crate::consistency::RoundTripFailure>,
    /// The same in words.
    pub why: String,
}

/// What stopped an update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum UpdateFailureKind {
    /// Refused: a replica has a decided commit that not every rank confirmed yet.
    PendingCommit,
    /// Refused: the checkpoint failed validation (unreadable, another geometry or format, a
    /// value that is not finite, a path outside the allowed roots).
    InvalidCheckpoint,
    /// Refused: the checkpoint holds another version than the one the update must roll out (a
    /// recovery's update, whose directory was rewritten since the update it resolves began).
    ChangedCheckpoint,
    /// The state journal could not be written.
    Journal,
    /// The coordinator failed inside (a task that panicked).
    Internal,
    /// A rank could not stage, report or probe.
    StagedRankUnreachable,
    /// A rank staged or probed another version than the update's.
    StagedVersion,
    /// A later replica's digests differ from the verified replica's.
    ReplicaDigests,
    /// A staged round trip failed (`round_trip` says where).
    RoundTrip,
    /// The staged probe is out of tolerance against the reference.
    ProbeTolerance,
    /// Ranks or replicas disagree on the staged `y`.
    ReplicaY,
    /// A rank of the replica was down at the commit decision.
    UnhealthyAtDecision,
    /// A decided commit that not every rank confirmed (the replica stays out of rotation
    /// until it is).
    CommitUnconfirmed,
    /// A replica every rank of which swapped failed its probe after the swap on what its ranks
    /// answered (another version or `y` than verified staged, out of tolerance, ranks that
    /// disagree): it stays out of rotation on the new version, and the update stops there. (A
    /// rank that does not answer that probe only takes its replica out; the update goes on.)
    ProbeAfterSwap,
    /// Every live replica took the version; replicas with a dead rank were skipped.
    RanksDead,
}

impl From<VerifyRule> for UpdateFailureKind {
    fn from(rule: VerifyRule) -> Self {
        match rule {
            VerifyRule::Unreachable => Self::StagedRankUnreachable,
            VerifyRule::Version => Self::StagedVersion,
            VerifyRule::ReplicaDigests => Self::ReplicaDigests,
            VerifyRule::RoundTrip => Self::RoundTrip,
            VerifyRule::ProbeTolerance => Self::ProbeTolerance,
            VerifyRule::YAgreement => Self::ReplicaY,
        }
    }
}

impl UpdateFailure {
    /// Refused before any replica was touched.
    fn refused(kind: UpdateFailureKind, why: String) -> Self {
        Self { kind, refused: true, replicas: Vec::new(), rank: None, round_trip: Vec::new(), why }
    }

    /// Of `replicas`, after some were touched.
    fn of(kind: UpdateFailureKind, replicas: Vec<u32>, why: String) -> Self {
        Self { kind, refused: false, replicas, rank: None, round_trip: Vec::new(), why }
    }
}

/// What `orchestrator update --json` prints: the outcome and the consistency report after it.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct UpdateDocument {
    /// The update finished and the report after it is consistent.
    pub ok: bool,
    pub update: UpdateOutcome,
    pub report: crate::consistency::ConsistencyReport,
}

/// The content claims this coordinator made on the checkpoints it hashed (the launched one,
/// each update's), by canonical directory, the last [`KnownClaims::CAPACITY`] of them. An update
/// to a directory whose files are still the very files hashed then (the same frame and file
/// identities, the rule by which a worker adopts the coordinator's claim) adopts the version
/// instead of hashing every tensor again, and when an update validated those same bytes before,
/// it does not read their values again either: a rollback, or a return to a checkpoint rolled out
/// before, reads no tensor twice. A claim is made only of files that had settled when they
/// were opened ([`orchestrator_model::checkpoint::RACY_MARGIN`]); any other change of a file
/// (a rewrite, a copy, a rename onto its path, a touch) changes its identity, and the update
/// hashes and inspects as before.
#[derive(Default)]
pub struct KnownClaims(std::sync::Mutex<std::collections::VecDeque<Known>>);

/// A claim [`KnownClaims`] keeps.
#[derive(Clone)]
struct Known {
    dir: PathBuf,
    claim: ContentClaim,
    /// An update's validation (or the launch, in the pass that hashed them) inspected every value
    /// of these bytes and found none invalid.
    inspected: bool,
}

impl KnownClaims {
    pub const CAPACITY: usize = 8;

    fn get(&self, dir: &Path) -> Option<Known> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|k| k.dir == dir).cloned()
    }

    /// Keeps `claim` on `dir` (the newest; the oldest beyond the capacity goes); `inspected`:
    /// every value of its bytes was checked.
    pub fn put(&self, dir: PathBuf, claim: ContentClaim, inspected: bool) {
        let mut known = self.0.lock().unwrap_or_else(|p| p.into_inner());
        known.retain(|k| k.dir != dir);
        known.push_back(Known { dir, claim, inspected });
        while known.len() > Self::CAPACITY {
            known.pop_front();
        }
    }
}

/// A new checkpoint that passed [`validate`].
pub struct Validated {
    pub version: String,
    /// The claim that lets each worker on this host adopt the version.
    pub claim: Option<pb::ContentClaim>,
    /// The version was adopted from a claim this coordinator made before (nothing hashed).
    pub adopted: bool,
    /// The values were not read again: an earlier update's validation inspected these bytes.
    pub inspected_before: bool,
}

/// Why a new checkpoint is refused before any replica is touched.
#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    /// The directory is not under the allowed roots.
    #[error("new checkpoint: {0}")]
    Roots(orchestrator_model::RootsError),
    /// It cannot be opened as a checkpoint (a file outside the roots, a missing or malformed
    /// file, a tensor of another shape or dtype).
    #[error("new checkpoint {}: {error}", dir.display())]
    Unreadable { dir: PathBuf, error: Box<orchestrator_model::ModelError> },
    /// Another geometry or weight format than the running plan's.
    #[error("new checkpoint {} has geometry {geometry:?} / {format:?}, the running plan {running_geometry:?} / {running_format:?}", dir.display())]
    OtherGeometry {
        dir: PathBuf,
        geometry: Box<Geometry>,
        format: WeightFormat,
        running_geometry: Box<Geometry>,
        running_format: WeightFormat,
    },
    /// Values the loader refuses (a NaN scale or element, a value that is not finite), as
    /// `checkpoint inspect` lists them.
    #[error("new checkpoint {} is invalid: {}", dir.display(), problems.join("; "))]
    Invalid { dir: PathBuf, problems: Vec<String> },
}

/// Validates the new checkpoint against the running plan and the allowed roots before any
/// replica is touched: the new version, and the claim on it that lets each worker on this host
/// adopt the version instead of hashing the checkpoint again. With `known`, a checkpoint this
/// coordinator hashed before adopts that version when its files are the same, and the claim
/// made here is kept for the next time.
pub fn validate(
    dir: &Path,
    running: &ModelConfig,
    roots: &AllowedRoots,
    known: Option<&KnownClaims>,
) -> Result<Validated, ValidationError> {
    let dir = roots.check(dir).map_err(ValidationError::Roots)?;
    let before = known.and_then(|k| k.get(&dir));
    let ck = Checkpoint::open_within_claimed(&dir, roots, before.as_ref().map(|k| &k.claim))
        .map_err(|e| ValidationError::Unreadable { dir: dir.clone(), error: Box::new(e) })?;
    if ck.config.geometry != running.geometry || ck.config.format != running.format {
        return Err(ValidationError::OtherGeometry {
            dir,
            geometry: Box::new(ck.config.geometry.clone()),
            format: ck.config.format,
            running_geometry: Box::new(running.geometry.clone()),
            running_format: running.format,
        });
    }
    let adopted = ck.version_from() == VersionFrom::Claim;
    // The same frame and files as bytes an earlier validation inspected: the same values.
    let inspected_before = adopted && before.is_some_and(|k| k.inspected);
    if !inspected_before {
        let report = inspect(&ck);
        if !report.valid {
            return Err(ValidationError::Invalid { dir, problems: report.problems });
        }
    }
    let claim = ck.content_claim();
    if let (Some(known), Some(c)) = (known, &claim) {
        known.put(dir.clone(), c.clone(), true);
    }
    let claim = claim.map(|c| orchestrator_worker::source::claim_to_pb(&c));
    Ok(Validated { version: ck.content_version().to_string(), claim, adopted, inspected_before })
}

/// Rolls `dir` across the replicas, at most `max_unavailable` at a time (never all of them
/// while more than one exists, so probes keep being served). A batch is staged and verified on
/// every replica in it before any commit is decided; a failure before the decision aborts the
/// whole batch, and a decided commit is driven to every rank.
pub async fn rolling_update(cluster: &Cluster, rotation: &Rotation, running: &ModelConfig, plan: UpdatePlan<'_>) -> UpdateOutcome {
    let outcome = roll(cluster, rotation, running, plan).await;
    // The update ended (its end is journaled): the versions kept for its rollback go.
    cluster.release().await;
    let label = match &outcome.failure {
        None => "ok",
        Some(f) if f.refused => "refused",
        Some(_) => "failed",
    };
    crate::metrics::metrics().update_ended(label, outcome.seconds);
    tracing::info!(outcome = label, version = %outcome.new_version, seconds = outcome.seconds, "rolling update ended");
    outcome
}

async fn roll(cluster: &Cluster, rotation: &Rotation, running: &ModelConfig, plan: UpdatePlan<'_>) -> UpdateOutcome {
    let UpdatePlan { dir, probe, max_unavailable, max_staging, replicas, journal, roots, commit_timeout, known, expected_version } = plan;
    let start = Instant::now();
    let mut steps = Vec::new();
    let mut pending_commits = BTreeMap::new();
    let swap_probes = std::sync::Mutex::new(BTreeMap::new());
    let finish =
        |new_version: String, steps: Vec<String>, pending_commits: BTreeMap<u32, String>, failure: Option<UpdateFailure>| UpdateOutcome {
            ok: failure.is_none(),
            checkpoint: dir.display().to_string(),
            new_version,
            steps,
            versions: (0..cluster.dp).map(|dp| (dp, rotation.version(dp))).collect(),
            pending_commits,
            seconds: start.elapsed().as_secs_f64(),
            failure,
            swap_probes: std::mem::take(&mut *swap_probes.lock().unwrap_or_else(|p| p.into_inner())),
        };
    // A replica with a dead rank can be neither updated nor ever confirm a commit: it is skipped
    // (and named). A live replica's unconfirmed commit must be finished first.
    let states = rotation.states();
    if let Some((dp, v)) = states.iter().enumerate().filter(|(_, s)| !s.dead).find_map(|(dp, s)| s.pending_commit.clone().map(|v| (dp, v)))
    {
        let why = format!(
            "refused before touching any replica: replica dp{dp} has a decided commit to {v} that not every rank confirmed yet \
             (it is finished when its ranks answer; `orchestrator report` shows them)"
        );
        let failure = UpdateFailure::refused(UpdateFailureKind::PendingCommit, why.clone());
        return finish(String::new(), vec![why], pending_commits, Some(failure));
    }
    let validate_started = Instant::now();
    let Validated { version: new_version, claim, adopted, inspected_before } = match tokio::task::spawn_blocking({
        let (dir, running, roots, known) = (dir.to_path_buf(), running.clone(), roots.clone(), known.clone());
        move || validate(&dir, &running, &roots, known.as_deref())
    })
    .await
    {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            let why = format!("refused before touching any replica: {e}");
            let failure = UpdateFailure::refused(UpdateFailureKind::InvalidCheckpoint, why.clone());
            return finish(String::new(), vec![why], pending_commits, Some(failure));
        }
        Err(e) => {
            let why = format!("refused before touching any replica: the validation task failed: {e}");
            let failure = UpdateFailure::refused(UpdateFailureKind::Internal, why.clone());
            return finish(String::new(), vec![why], pending_commits, Some(failure));
        }
    };
    if let Some(want) = expected_version
        && new_version != want
    {
        let why = format!(
            "refused before touching any replica: {} now holds version {new_version}, not {want}, the version this update must roll \
             out (the checkpoint was rewritten since)",
            dir.display()
        );
        let failure = UpdateFailure::refused(UpdateFailureKind::ChangedCheckpoint, why.clone());
        return finish(new_version, vec![why], pending_commits, Some(failure));
    }
    steps.push(format!(
        "validated {} (version {new_version}{}) against the running plan in {:.2} s",
        dir.display(),
        match (adopted, inspected_before) {
            (true, true) => ", adopted from this coordinator's claim on the same files, whose every value it checked before",
            (true, false) => ", adopted from this coordinator's claim on the same files",
            _ => "",
        },
        validate_started.elapsed().as_secs_f64()
    ));
    let target = SourceRecord::Checkpoint { dir: dir.to_path_buf() };
    let source = pb::LoadSource { content: claim, ..target.to_pb() };
    let roll = Roll {
        cluster,
        rotation,
        journal: journal.as_ref().map(|j| j.journal),
        update: journal.as_ref().map_or(0, |j| j.update),
        new_version: new_version.clone(),
        probe,
        commit_timeout,
    };
    if let Some(j) = &journal
        && let Err(e) = roll.record(Event::UpdateBegin {
            update: roll.update,
            from: j.from.clone(),
            resumes: j.resumes,
            to: target,
            new_version: new_version.clone(),
            max_unavailable,
        })
    {
        let why = format!("refused before touching any replica: {e}");
        let failure = UpdateFailure::refused(UpdateFailureKind::Journal, why.clone());
        return finish(new_version, vec![why], pending_commits, Some(failure));
    }
    let mut skipped = Vec::new();
    let replicas: Vec<u32> = replicas
        .unwrap_or_else(|| (0..cluster.dp).collect())
        .into_iter()
        .filter(|&dp| match states.get(dp as usize) {
            Some(s) if s.dead => {
                steps.push(format!("replica dp{dp}: skipped, a rank is dead: {}", s.out.as_deref().unwrap_or("dead")));
                skipped.push(dp);
                false
            }
            _ => true,
        })
        .collect();
    crate::metrics::metrics().update_started(replicas.len());
    let batches = rollout::batches(&replicas, max_unavailable, cluster.dp);
    // Each replica's stage is on disk before any of its ranks is asked to stage; a journal that
    // cannot be written refuses the update before any replica is touched.
    for &dp in &replicas {
        if let Err(e) = roll.record(Event::UpdateStep { update: roll.update, dp, step: Step::Staging }) {
            let why = format!("refused before touching any replica: {e}");
            roll.end(false, &why);
            let failure = UpdateFailure::refused(UpdateFailureKind::Journal, why.clone());
            return finish(new_version, vec![why], pending_commits, Some(failure));
        }
    }
    // Every replica stages at once (see `Roll::stage_all`) while the batches are verified and
    // swapped in order.
    let first_batch: Vec<u32> = batches.first().cloned().unwrap_or_default();
    let limit = if max_staging == 0 { replicas.len().max(1) } else { max_staging as usize };
    let stopping = AtomicBool::new(false);
    let (mut senders, mut receivers) = (Vec::new(), BTreeMap::new());
    for &dp in &replicas {
        let (tx, rx) = tokio::sync::oneshot::channel::<StageOutcome>();
        receivers.insert(dp, rx);
        senders.push((dp, tx));
    }
    // What the first verified replica proved, for the later ones to verify against.
    let (proof_tx, proof_rx) = tokio::sync::watch::channel(None::<VerifiedVersion>);
    let stager = roll.stage_all(&source, senders, &first_batch, limit, &stopping, proof_rx);
    let process = async {
        let proof_tx = proof_tx;
        let mut reference_y: Option<String> = None;
        // What the first verified replica proved; the later ones are checked against it.
        let mut verified: Option<VerifiedVersion> = None;
        let mut rest = batches.iter();
        let ended = 'batches: loop {
            let Some(group) = rest.next() else { break 'batches None };
            let staged = roll.staged_batch(group, &mut receivers).await;
            let (decided, failure) = roll.decide_batch(group, &staged, &mut reference_y, &mut verified).await;
            if proof_tx.borrow().is_none() && verified.is_some() {
                proof_tx.send_replace(verified.clone());
            }
            let undecided: Vec<u32> = group.iter().copied().filter(|dp| !decided.contains(dp)).collect();
            if let Some((failed, e)) = &failure {
                let (failed, e) = (*failed, e.why.clone());
                let why = |dp: u32| {
                    ("FAILED", if dp == failed { e.clone() } else { format!("aborted with its batch (replica dp{failed} failed)") })
                };
                roll.abort_replicas(&undecided, &why, &mut steps).await;
            }
            if decided.is_empty()
                && let Some((failed, mut f)) = failure
            {
                f.why = format!("replica dp{failed} failed: {}", f.why);
                break 'batches Some((failed, f));
            }
            let (stuck, probe_failed) = roll.commit_decided(group, &decided, &staged, &mut steps, &mut pending_commits, &swap_probes).await;
            // Where another failure names the batch, the steps and its words still name these.
            let also = match probe_failed.is_empty() {
                true => String::new(),
                false => format!("; replicas {probe_failed:?} swapped and their probe after the swap showed other weights than verified"),
            };
            if let Some((failed, mut f)) = failure {
                f.why = format!("replica dp{failed} failed: {}; replicas {decided:?} committed before it{also}", f.why);
                break 'batches Some((failed, f));
            }
            if !stuck.is_empty() {
                let why = format!("replicas {stuck:?}: commit decided, not confirmed by every rank{also}");
                break 'batches Some((stuck[0], UpdateFailure::of(UpdateFailureKind::CommitUnconfirmed, stuck, why)));
            }
            // What serves after a swap is not what was verified staged: no further replica swaps
            // to a version that fails there.
            if !probe_failed.is_empty() {
                let why = format!(
                    "replicas {probe_failed:?} swapped to {} and their probe after the swap showed other weights than verified",
                    roll.new_version
                );
                break 'batches Some((probe_failed[0], UpdateFailure::of(UpdateFailureKind::ProbeAfterSwap, probe_failed, why)));
            }
        };
        // Replicas still waiting for a proof learn that none will come.
        drop(proof_tx);
        if let Some((failed, _)) = &ended {
            stopping.store(true, Ordering::SeqCst);
            roll.drop_unreached(std::mem::take(&mut receivers), *failed, &mut steps).await;
        }
        ended
    };
    let (_, ended) = tokio::join!(stager, process);
    if let Some((_, failure)) = ended {
        roll.end(false, &failure.why);
        return finish(new_version, steps, pending_commits, Some(failure));
    }
    if !skipped.is_empty() {
        let why = format!("every live replica verified and swapped; replicas {skipped:?} skipped (a rank is dead)");
        roll.end(false, &why);
        return finish(new_version, steps, pending_commits, Some(UpdateFailure::of(UpdateFailureKind::RanksDead, skipped, why)));
    }
    roll.end(true, "every replica verified and swapped");
    finish(new_version, steps, pending_commits, None)
}

/// How long a replica taken out of rotation for its swap waits for the routed probes it was
/// serving (a probe still running then is caught if it meets the swap: its ranks disagree).
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How one replica's stage ended.
enum StageOutcome {
    /// The update ended before the replica's turn to stage came.
    NotStarted,
    /// What it staged and verified, or why staging or verification failed.
    Done(Result<Staged, VerifyFailure>),
}

/// One rolling update past its validation: what each of its steps needs.
struct Roll<'a> {
    cluster: &'a Cluster,
    rotation: &'a Rotation,
    journal: Option<&'a Journal>,
    /// The update's number in the journal (0 without one).
    update: u64,
    new_version: String,
    probe: ProbeSpec,
    commit_timeout: std::time::Duration,
}

impl Roll<'_> {
    /// Journals a step that must be on disk before the workers act on it (an error fails the
    /// update).
    fn record(&self, event: Event) -> Result<(), String> {
        match self.journal {
            Some(j) => j.record(event).map_err(|e| format!("journal: {e}")),
            None => Ok(()),
        }
    }

    /// Journals a step that happened whatever the journal says (a write failure is noted).
    fn note(&self, event: Event) {
        if let Some(j) = self.journal {
            j.note(event);
        }
    }

    fn end(&self, ok: bool, text: &str) {
        self.note(Event::UpdateEnd { update: self.update, ok, note: text.to_string() });
    }

    /// Stages every replica at once (at most `limit` at a time), beside its active weights and
    /// serving them: each rank's shadow lies beside its own active weights, so staging every
    /// replica together takes no more memory per rank than staging one at a time. Each replica
    /// then verifies what it staged, still serving: the first batch against the reference, a
    /// later replica against what `proof` brings (the first verified replica's digests; a
    /// closed channel: the update ended first). Each outcome goes to its replica's receiver;
    /// once `stopping` is set, no further stage starts.
    async fn stage_all(
        &self,
        source: &pb::LoadSource,
        replicas: Vec<(u32, tokio::sync::oneshot::Sender<StageOutcome>)>,
        first_batch: &[u32],
        limit: usize,
        stopping: &AtomicBool,
        proof: tokio::sync::watch::Receiver<Option<VerifiedVersion>>,
    ) {
        let permits = tokio::sync::Semaphore::new(limit);
        futures_util::future::join_all(replicas.into_iter().map(|(dp, tx)| {
            let permits = &permits;
            // The first batch prepares the reference and runs the round trips while it stages;
            // later ones are verified as byte-identical to what the first proved, and adopt its
            // round trips' verdicts rank by rank (see `verify_staged`).
            let first = first_batch.contains(&dp);
            let reference = first.then_some(self.probe);
            let mut proof = proof.clone();
            async move {
                let permit = permits.acquire().await;
                if stopping.load(Ordering::SeqCst) {
                    let _ = tx.send(StageOutcome::NotStarted);
                    return;
                }
                // Staged and verified beside its active weights, the replica keeps serving
                // them; it leaves rotation only to be swapped.
                self.rotation.take_for_update(dp, false);
                let staged = stage_replica(self.cluster, dp, source, &self.new_version, reference, !first).await;
                // The limit bounds staging; verifying (or waiting to) holds no permit.
                drop(permit);
                let outcome = match staged {
                    Err(e) => Err(e),
                    Ok(stage_s) => {
                        let against = if first { Against::Reference } else { Against::Proof(&mut proof) };
                        verify_staged(self.cluster, dp, &self.new_version, self.probe, against, stage_s).await
                    }
                };
                let _ = tx.send(StageOutcome::Done(outcome));
            }
        }))
        .await;
    }

    /// What each replica of `group` staged and verified (waiting for it to end).
    async fn staged_batch(
        &self,
        group: &[u32],
        receivers: &mut BTreeMap<u32, tokio::sync::oneshot::Receiver<StageOutcome>>,
    ) -> Vec<Result<Staged, VerifyFailure>> {
        let waits: Vec<_> = group.iter().map(|dp| receivers.remove(dp)).collect();
        futures_util::future::join_all(waits.into_iter().map(|rx| async move {
            match rx {
                Some(rx) => match rx.await {
                    Ok(StageOutcome::Done(r)) => r,
                    _ => Err(unreachable_rank("its stage did not run")),
                },
                None => Err(unreachable_rank("its stage did not run")),
            }
        }))
        .await
    }

    /// Every replica of the batch must verify, and all must agree on y with each other and with
    /// the replicas already updated; every rank must still be up at the decision. Then the
    /// commit decision of each replica goes on disk before any of its ranks is told to swap:
    /// once one is on disk that replica is committed, whatever happens to the rest of the batch
    /// (a failure to write the next one aborts only the replicas not yet decided). Returns the
    /// decided replicas and the first failure.
    async fn decide_batch(
        &self,
        group: &[u32],
        staged: &[Result<Staged, VerifyFailure>],
        reference_y: &mut Option<String>,
        verified: &mut Option<VerifiedVersion>,
    ) -> (Vec<u32>, Option<(u32, UpdateFailure)>) {
        let mut failure: Option<(u32, UpdateFailure)> = None;
        for (&dp, r) in group.iter().zip(staged) {
            let verification = match r {
                Err(e) => Err(e.clone()),
                Ok(staged) => match reference_y {
                    Some(r) if *r != staged.y => {
                        Err(fail(VerifyRule::YAgreement, format!("staged y {} differs from the already verified replicas' {r}", staged.y)))
                    }
                    _ => {
                        *reference_y = Some(staged.y.clone());
                        if verified.is_none() {
                            *verified = Some(staged.proof.clone());
                        }
                        Ok(())
                    }
                },
            };
            if let Err(e) = &verification {
                tracing::warn!(replica = dp, version = %self.new_version, rule = e.rule.label(), "staged version failed verification: {}", e.why);
                crate::metrics::metrics().verification_failed(e.rule.label());
            }
            let down: Vec<_> = self.cluster.down_in(dp).await.into_iter().flatten().collect();
            let f = match rollout::decide(verification, down) {
                Decision::Commit => continue,
                Decision::Failed(e) => UpdateFailure {
                    kind: e.rule.into(),
                    refused: false,
                    replicas: vec![dp],
                    rank: e.rank,
                    round_trip: e.round_trip,
                    why: e.why,
                },
                Decision::Unhealthy { ranks } => {
                    UpdateFailure::of(UpdateFailureKind::UnhealthyAtDecision, vec![dp], rollout::unhealthy_why(&ranks))
                }
            };
            failure.get_or_insert((dp, f));
        }
        let mut decided: Vec<u32> = Vec::new();
        if failure.is_none() {
            for &dp in group {
                self.note(Event::UpdateStep { update: self.update, dp, step: Step::Verified });
            }
            for &dp in group {
                match self.record(Event::UpdateStep { update: self.update, dp, step: Step::Decided }) {
                    Ok(()) => decided.push(dp),
                    Err(e) => {
                        failure.get_or_insert((dp, UpdateFailure::of(UpdateFailureKind::Journal, vec![dp], e)));
                        break;
                    }
                }
            }
        }
        (decided, failure)
    }

    /// Drives every rank of every decided replica to the new version, then probes each swapped
    /// replica back into rotation. Returns the replicas whose commit is stuck (decided, not
    /// confirmed by every rank: they stay out with the commit pending), and those that swapped
    /// and whose probe then showed other weights than verified (out of rotation on the new
    /// version; one whose probe a rank did not answer is out too, but not returned).
    async fn commit_decided(
        &self,
        group: &[u32],
        decided: &[u32],
        staged: &[Result<Staged, VerifyFailure>],
        steps: &mut Vec<String>,
        pending_commits: &mut BTreeMap<u32, String>,
        swap_probes: &std::sync::Mutex<BTreeMap<u32, SwapProbe>>,
    ) -> (Vec<u32>, Vec<u32>) {
        let (cluster, rotation, new_version) = (self.cluster, self.rotation, &self.new_version);
        // Out of rotation for the swap alone (when another replica can serve), once the routed
        // probes it was serving are answered, so that no routed probe spans the swap. A lone
        // replica swaps while it serves (its probes are never drained: new ones keep coming).
        let out_started = Instant::now();
        let out = cluster.dp > 1;
        for &dp in decided {
            rotation.take_for_update(dp, out);
        }
        let drained = match out {
            true => futures_util::future::join_all(decided.iter().map(|&dp| rotation.drain(dp, DRAIN_LIMIT))).await,
            false => vec![true; decided.len()],
        };
        let drain_s = out_started.elapsed().as_secs_f64();
        let commit_started = Instant::now();
        let statuses =
            futures_util::future::join_all(decided.iter().map(|&dp| drive_commit(cluster, dp, new_version, self.commit_timeout))).await;
        let commit_s = commit_started.elapsed().as_secs_f64();
        let (mut stuck, mut probe_failed) = (Vec::new(), Vec::new());
        for (&dp, status) in decided.iter().zip(statuses) {
            let r = &staged[group.iter().position(|g| *g == dp).unwrap_or(0)];
            let detail = r.as_ref().map(|s| s.detail.as_str()).unwrap_or_default();
            let drained = match (out, drained.get(decided.iter().position(|d| *d == dp).unwrap_or(0)).copied().unwrap_or(true)) {
                (false, _) => "the only replica: serving through the swap".to_string(),
                (true, true) => format!("out of rotation (its routed probes answered in {drain_s:.2} s)"),
                (true, false) => format!("out of rotation (routed probes still running after {drain_s:.2} s)"),
            };
            match status {
                CommitStatus::Done => {
                    crate::metrics::metrics().update_replica_done();
                    self.note(Event::UpdateStep { update: self.update, dp, step: Step::Committed });
                    rotation.observed_version(dp, new_version);
                    let y = r.as_ref().map(|s| s.y.as_str()).unwrap_or_default();
                    let reference = r.as_ref().is_ok_and(|s| s.against_reference);
                    let proof = Proof::SameAsStaged { version: new_version, y, reference };
                    let t = Instant::now();
                    let reinstated = reinstate(cluster, rotation, dp, self.probe, proof, true).await;
                    let reinstate_s = t.elapsed().as_secs_f64();
                    let back = match reinstated {
                        Ok((_, results)) => {
                            let results: BTreeMap<u32, pb::ProbeResult> =
                                results.into_iter().filter_map(|(id, r)| r.ok().map(|p| (id, p))).collect();
                            let answered_kept = results.values().all(|p| p.kept);
                            let kept = SwapProbe { spec: self.probe, reference, results };
                            swap_probes.lock().unwrap_or_else(|p| p.into_inner()).insert(dp, kept);
                            if answered_kept {
                                " (every rank answered with the verification probe it kept of the weights it committed)".to_string()
                            } else {
                                " (computed again: a rank had not kept its verification probe)".to_string()
                            }
                        }
                        Err(why) => {
                            rotation.pull(dp, &format!("its probe after the commit failed: {why}"));
                            if why.shows_other_weights() {
                                probe_failed.push(dp);
                            }
                            format!("; its probe after the commit failed, out of rotation: {why}")
                        }
                    };
                    tracing::info!(replica = dp, version = %new_version, commit_s, reinstate_s, "replica swapped to the new version");
                    steps.push(format!(
                        "replica dp{dp}: {detail}; {drained}, swapped to {new_version} in {commit_s:.2} s, probed back in {reinstate_s:.2} s{back}"
                    ));
                }
                CommitStatus::Stuck { ref ranks } => {
                    let labels: Vec<String> = ranks.iter().map(|(tp, why)| format!("rank dp{dp}/tp{tp} {why}")).collect();
                    let dead = status.has_dead_rank();
                    let why = format!("commit to {new_version} decided, not confirmed by every rank: {}", labels.join("; "));
                    if dead {
                        rotation.mark_dead(dp, &why);
                    } else {
                        rotation.pull(dp, &why);
                    }
                    rotation.set_pending_commit(dp, Some(new_version.clone()));
                    pending_commits.insert(dp, new_version.clone());
                    steps.push(format!("replica dp{dp}: {detail}; {why}; out of rotation until every rank confirms {new_version}"));
                    stuck.push(dp);
                }
                CommitStatus::Pending { .. } => unreachable!("drive_commit returns only done or stuck"),
            }
            rotation.release(dp);
        }
        (stuck, probe_failed)
    }

    /// An update that ended early (at replica `failed`) drops what the replicas it did not reach
    /// staged, each once its stage has ended, so that no stage lands after the abort.
    async fn drop_unreached(
        &self,
        receivers: BTreeMap<u32, tokio::sync::oneshot::Receiver<StageOutcome>>,
        failed: u32,
        steps: &mut Vec<String>,
    ) {
        for (dp, rx) in receivers {
            let why = format!("the update ended at replica dp{failed} before its turn");
            match rx.await {
                Ok(StageOutcome::NotStarted) | Err(_) => steps.push(format!("replica dp{dp}: not updated, {why}")),
                Ok(StageOutcome::Done(_)) => self.abort_replicas(&[dp], &|_| ("not updated", why.clone()), steps).await,
            }
        }
    }

    /// The abort decision for replicas (journaled before any rank is told), then every rank
    /// drops what it staged and each replica is probed back into rotation.
    async fn abort_replicas(&self, group: &[u32], why: &(dyn Fn(u32) -> (&'static str, String) + Sync), steps: &mut Vec<String>) {
        let (cluster, rotation) = (self.cluster, self.rotation);
        for &dp in group {
            // Dropping a staged copy is always safe: abort even when the journal cannot be written.
            if let Err(j) = self.record(Event::UpdateStep { update: self.update, dp, step: Step::Aborted }) {
                tracing::error!("{j}");
            }
            let answers = cluster.abort(dp).await;
            let held: Vec<&String> = answers.values().filter_map(|r| r.as_ref().ok()).collect();
            let kept = match held.first() {
                Some(v) if held.iter().all(|h| h == v) => {
                    if held.len() == answers.len() {
                        rotation.observed_version(dp, v);
                        format!("kept version {v}")
                    } else {
                        format!("kept version {v} on every rank that answered")
                    }
                }
                Some(_) => format!(
                    "its ranks answered the abort with different versions ({})",
                    held.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(", ")
                ),
                None => "no rank answered the abort".to_string(),
            };
            let down: Vec<RankDown> = cluster.down_in(dp).await.into_iter().flatten().collect();
            let out = if let Some(dead) = down.iter().find(|d| d.is_dead()) {
                rotation.mark_dead(dp, &dead.to_string());
                format!(" ({dead}: out of rotation)")
            } else if let Some(down) = down.first() {
                rotation.pull(dp, &down.to_string());
                format!(" ({down}: out of rotation)")
            } else {
                match try_reinstate(cluster, rotation, dp, self.probe, Proof::Verified, true).await {
                    Ok(_) => String::new(),
                    Err(why) => {
                        // A rank that died just before the abort may be known dead only now.
                        let dead = cluster.down_in(dp).await.into_iter().flatten().find(RankDown::is_dead).map(|d| d.to_string());
                        match dead {
                            Some(dead) => {
                                rotation.mark_dead(dp, &dead);
                                format!(" ({dead}: out of rotation; its probe after the abort failed: {why})")
                            }
                            None => {
                                rotation.pull(dp, &format!("its probe after the abort failed: {why}"));
                                format!(" (its probe after the abort failed: out of rotation: {why})")
                            }
                        }
                    }
                }
            };
            rotation.release(dp);
            let (headline, why) = why(dp);
            steps.push(format!("replica dp{dp}: {headline}, {kept}{out}: {why}"));
        }
    }
}

/// What the first replica to verify a version proved, per tp_rank: its kernel and source
/// digests (its `y` is the update's `reference_y`). A later replica of the same version is verified against it:
/// byte-identical digests on every rank (so its kernels read exactly the bytes that passed the
/// reference) and the same `y` from a probe of its own, the same check without recomputing the
/// reference.
#[derive(Clone, Debug, Default)]
pub struct VerifiedVersion {
    pub dp: u32,
    /// tp_rank -> (kernel rank digest, source rank digest).
    pub digests: BTreeMap<u32, (String, String)>,
}

/// Which check of a staged replica failed (the `rule` label of
/// `orchestrator_verification_failures_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyRule {
    /// A rank could not stage, report or probe (its error is the reason).
    Unreachable,
    /// A rank staged or probed another version than the update's.
    Version,
    /// A later replica's digests differ from the verified replica's.
    ReplicaDigests,
    RoundTrip,
    /// The probe against the reference is out of tolerance.
    ProbeTolerance,
    /// The ranks of the replica, or the replica and the verified ones, disagree on `y`.
    YAgreement,
}

impl VerifyRule {
    pub fn label(self) -> &'static str {
        match self {
            VerifyRule::Unreachable => "staged_rank_unreachable",
            VerifyRule::Version => "staged_version",
            VerifyRule::ReplicaDigests => "replica_digests",
            VerifyRule::RoundTrip => "round_trip",
            VerifyRule::ProbeTolerance => "probe_tolerance",
            VerifyRule::YAgreement => "replica_y",
        }
    }
}

/// A staged replica that failed verification: the rule, the rank where one rank failed it, a
/// round trip's failures, and the reason.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{why}")]
pub struct VerifyFailure {
    pub rule: VerifyRule,
    pub rank: Option<String>,
    pub round_trip: Vec<crate::consistency::RoundTripFailure>,
    pub why: String,
}

fn fail(rule: VerifyRule, why: impl Into<String>) -> VerifyFailure {
    VerifyFailure { rule, rank: None, round_trip: Vec::new(), why: why.into() }
}

impl VerifyFailure {
    fn at(self, dp: u32, tp: u32) -> Self {
        Self { rank: Some(format!("dp{dp}/tp{tp}")), ..self }
    }
}

fn unreachable_rank(why: impl std::fmt::Display) -> VerifyFailure {
    fail(VerifyRule::Unreachable, why.to_string())
}

/// A staged replica that passed: what the update says about it, its `y`, and what it proved.
struct Staged {
    detail: String,
    y: String,
    proof: VerifiedVersion,
    /// It was verified against the reference (the first replica of its version), not as
    /// byte-identical to a replica that was.
    against_reference: bool,
}

/// Stages replica `dp` while it serves its active weights: its seconds of staging. With
/// `reference`, its ranks prepare that probe's reference while they stage, so that the
/// verification probe afterwards runs only the kernel pass against it.
async fn stage_replica(
    cluster: &Cluster,
    dp: u32,
    source: &pb::LoadSource,
    new_version: &str,
    reference: Option<ProbeSpec>,
    defer_round_trip: bool,
) -> Result<f64, VerifyFailure> {
    let t = Instant::now();
    let staged = cluster.stage(dp, source, reference, defer_round_trip).await;
    for (&id, r) in &staged {
        let (_, version) = r.as_ref().map_err(|e| unreachable_rank(e).at(dp, id % cluster.tp))?;
        if version != new_version {
            return Err(
                fail(VerifyRule::Version, format!("worker {id} staged version {version}, expected {new_version}")).at(dp, id % cluster.tp)
            );
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

/// What a staged replica is verified against.
enum Against<'a> {
    /// The reference its ranks prepared while they staged (the first replicas of a version).
    Reference,
    /// What the first verified replica proved, once it has (a closed channel: the update ended
    /// first).
    Proof(&'a mut tokio::sync::watch::Receiver<Option<VerifiedVersion>>),
}

/// Verifies what replica `dp` staged, while it serves its active weights: against the
/// reference when it is the first of its version, else as byte-identical to the replica that
/// was.
async fn verify_staged(
    cluster: &Cluster,
    dp: u32,
    new_version: &str,
    probe: ProbeSpec,
    against: Against<'_>,
    stage_s: f64,
) -> Result<Staged, VerifyFailure> {
    use VerifyRule::*;
    // Verify the staged version: round trips and versions, then probes and agreement on y. The
    // reports and the probe are asked for at once (neither depends on the other), and judged in
    // that order whatever answered first. The first replica of a version runs the reference; a
    // later one, byte-identical to it, only its own kernel pass (its y must equal the verified
    // y: checked by the caller), which starts as soon as it staged: only its reports wait for
    // the proof they are compared with.
    let skip_reference = matches!(against, Against::Proof(_));
    let t = Instant::now();
    let reports = async {
        let verified = match against {
            Against::Reference => None,
            Against::Proof(proof) => match proof.wait_for(Option::is_some).await.map(|p| p.clone()) {
                Ok(p) => p,
                Err(_) => return Err(unreachable_rank("the update ended before the version was proved")),
            },
        };
        let waited = t.elapsed().as_secs_f64();
        let r = match &verified {
            None => cluster.reports_in(Some(dp), true).await,
            Some(v) => {
                let proof = |tp: u32| {
                    v.digests.get(&tp).map(|(kernel, source)| pb::RoundTripProof {
                        kernel_rank_digest: kernel.clone(),
                        source_rank_digest: source.clone(),
                        rank: format!("dp{}/tp{tp}", v.dp),
                    })
                };
                cluster.staged_reports_identical_to(dp, proof).await
            }
        };
        Ok((r, verified, waited, t.elapsed().as_secs_f64() - waited))
    };
    let probes = async {
        let p = cluster.probe_staged(dp, (probe.tokens as u32, probe.latents as u32, probe.seed), skip_reference).await;
        (p, t.elapsed().as_secs_f64())
    };
    let (reports, (probes, probe_s)) = tokio::join!(reports, probes);
    let (reports, verified, waited_s, report_s) = reports?;
    let verified = verified.as_ref();
    let seconds = t.elapsed().as_secs_f64();
    let mut digests = BTreeMap::new();
    for (&id, r) in &reports {
        let r = r.as_ref().map_err(|e| unreachable_rank(e).at(dp, id % cluster.tp))?;
        if r.staged_version != new_version {
            return Err(fail(Version, format!("rank dp{dp}/tp{} staged version {}, expected {new_version}", r.tp_rank, r.staged_version))
                .at(dp, r.tp_rank));
        }
        let mine = (r.kernel_rank_digest.clone(), r.source_rank_digest.clone());
        if let Some(v) = verified {
            match v.digests.get(&r.tp_rank) {
                Some(theirs) if *theirs == mine => {}
                theirs => {
                    return Err(fail(
                        ReplicaDigests,
                        format!(
                            "rank dp{dp}/tp{}: staged kernel/source digests {}/{}, the verified replica dp{}'s tp{} holds {}",
                            r.tp_rank,
                            mine.0,
                            mine.1,
                            v.dp,
                            r.tp_rank,
                            theirs.map(|(k, s)| format!("{k}/{s}")).unwrap_or_else(|| "nothing".into())
                        ),
                    )
                    .at(dp, r.tp_rank));
                }
            }
        }
        if !r.round_trip_ok {
            let failed =
                fail(RoundTrip, format!("rank dp{dp}/tp{}: staged round trip failed: {}", r.tp_rank, r.round_trip_failures.join("; ")));
            let details = r.round_trip_failure_details.iter().map(crate::consistency::RoundTripFailure::from).collect();
            return Err(VerifyFailure { round_trip: details, ..failed.at(dp, r.tp_rank) });
        }
        digests.insert(r.tp_rank, mine);
    }
    let mut ys = Vec::new();
    for (&id, p) in &probes {
        let tp = id % cluster.tp;
        let p = p.as_ref().map_err(|e| unreachable_rank(e).at(dp, tp))?;
        if !p.ok {
            return Err(fail(
                ProbeTolerance,
                format!(
                    "worker {id}: staged probe out of tolerance (q differs in {} values, z err {:.3e})",
                    p.q_mismatches, p.z_max_abs_err
                ),
            )
            .at(dp, tp));
        }
        if p.probed_version != new_version {
            return Err(fail(Version, format!("worker {id} probed version {}, expected {new_version}", p.probed_version)).at(dp, tp));
        }
        ys.push(p.y_digest.clone());
    }
    if ys.windows(2).any(|w| w[0] != w[1]) {
        return Err(fail(YAgreement, format!("the ranks of dp{dp} disagree on the staged y: {ys:?}")));
    }
    let y = ys.first().cloned().unwrap_or_default();
    let how = match verified {
        None => format!("verified against the reference prepared while staging, in rotation (round trips, probes, y {y})"),
        Some(v) => format!(
            "verified as byte-identical to dp{}, in rotation (digests of every rank, so its round trips' verdicts, and y {y})",
            v.dp
        ),
    };
    let waited = if verified.is_some() { format!(", the reports after {waited_s:.2} s waiting for the proof") } else { String::new() };
    Ok(Staged {
        detail: format!(
            "staged in {stage_s:.2} s, {how} in {seconds:.2} s (reports {report_s:.2} s, probe {probe_s:.2} s, at once{waited})"
        ),
        y: y.clone(),
        proof: VerifiedVersion { dp, digests },
        against_reference: verified.is_none(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(version: &str) -> ContentClaim {
        ContentClaim { version: version.into(), frame: "f".into(), files: BTreeMap::new() }
    }

    /// A failed verification has one name: the metric's `rule` label is the update JSON's
    /// failure `kind`.
    #[test]
    fn each_verification_rule_is_named_alike_in_the_metric_and_the_failure() {
        use VerifyRule::*;
        for rule in [Unreachable, Version, ReplicaDigests, RoundTrip, ProbeTolerance, YAgreement] {
            let kind = serde_json::to_value(UpdateFailureKind::from(rule)).unwrap();
            assert_eq!(kind, rule.label(), "{rule:?}");
        }
    }

    /// A replica's probe passes only when every rank answered within tolerance on one version
    /// with one `y`; otherwise every problem is named, in order, by kind.
    #[test]
    fn a_replicas_probe_is_judged_with_every_problem_by_kind() {
        let answer = |version: &str, y: &str, ok: bool| pb::ProbeResult {
            probed_version: version.into(),
            y_digest: y.into(),
            ok,
            ..Default::default()
        };
        let of = |answers: Vec<Result<pb::ProbeResult, RankError>>| -> RankResults<pb::ProbeResult> {
            answers.into_iter().enumerate().map(|(id, a)| (id as u32, a)).collect()
        };
        assert_eq!(judge_probe(&of(vec![Ok(answer("v", "y", true)), Ok(answer("v", "y", true))])), Ok(("v".into(), "y".into())));
        assert_eq!(judge_probe(&of(vec![])), Err(ProbeProblems(vec![ProbeProblem::NoRanks])));
        let unreachable = RankError::NotConnected { rank: "rank dp0/tp1 (worker 1)".into() };
        let problems =
            judge_probe(&of(vec![Ok(answer("v", "y", false)), Err(unreachable.clone()), Ok(answer("w", "z", true))])).unwrap_err();
        assert_eq!(
            problems,
            ProbeProblems(vec![
                ProbeProblem::Rank(unreachable),
                ProbeProblem::OutOfTolerance,
                ProbeProblem::Versions(vec![(0, "v".into()), (2, "w".into())]),
                ProbeProblem::YDisagrees,
            ])
        );
        assert_eq!(
            problems.to_string(),
            "rank dp0/tp1 (worker 1) is not connected; a rank's probe is out of tolerance; \
             the group's ranks hold different versions (worker 0: v, worker 2: w); the group's ranks disagree on y"
        );
    }

    /// A probe after a swap stops the update only on what the ranks answered about their
    /// weights; a rank that did not answer (dead, stalled, a failed ring) shows nothing of them,
    /// nor does a passing probe of a replica that is not free.
    #[test]
    fn only_answers_about_the_weights_show_other_weights_after_a_swap() {
        let unreachable = ProbeProblem::Rank(RankError::NotConnected { rank: "rank dp0/tp1 (worker 1)".into() });
        let probe = |problems: Vec<ProbeProblem>| ReinstateError::Probe(ProbeProblems(problems)).shows_other_weights();
        assert!(!probe(vec![unreachable.clone()]));
        assert!(!probe(vec![ProbeProblem::NoRanks]));
        for content in [ProbeProblem::OutOfTolerance, ProbeProblem::Versions(vec![(0, "v".into())]), ProbeProblem::YDisagrees] {
            assert!(probe(vec![content.clone()]), "{content}");
            assert!(probe(vec![unreachable.clone(), content.clone()]), "{content} beside a rank that did not answer");
        }
        let other = ReinstateError::NotAsVerified { version: "b".into(), y: "y1".into(), verified: "b".into(), verified_y: "y0".into() };
        assert!(other.shows_other_weights());
        assert!(!ReinstateError::NotFree { version: "b".into() }.shows_other_weights());
    }

    /// A new checkpoint is refused by kind: outside the roots, unreadable, another geometry;
    /// one that passes gives its content version.
    #[test]
    fn validation_refuses_by_kind_and_adopts_a_known_claim() {
        use orchestrator_model::Preset;
        use orchestrator_model::synth::{SynthOptions, write_checkpoint};
        let tmp = tempfile::tempdir().unwrap();
        let config = |layers| ModelConfig::from_preset(Preset::Tiny, Some(layers), false).unwrap();
        for (name, layers) in [("one", 1), ("two", 2)] {
            let opts = SynthOptions { config: config(layers), seed: 1, max_shard_bytes: 1 << 30, preset_name: None };
            write_checkpoint(&tmp.path().join(name), &opts).unwrap();
        }
        std::fs::create_dir(tmp.path().join("empty")).unwrap();
        let roots = AllowedRoots::new(&[tmp.path().to_path_buf()]).unwrap();
        let running = config(1);
        let known = KnownClaims::default();
        let check = |name: &str| validate(&tmp.path().join(name), &running, &roots, Some(&known));

        let e = validate(&tmp.path().join("one"), &running, &AllowedRoots::default(), None).err().unwrap();
        assert!(matches!(e, ValidationError::Roots(_)), "{e}");
        assert!(e.to_string().starts_with("new checkpoint: "), "{e}");
        let e = check("empty").err().unwrap();
        assert!(matches!(&e, ValidationError::Unreadable { dir, .. } if dir.ends_with("empty")), "{e}");
        let e = check("two").err().unwrap();
        assert!(matches!(&e, ValidationError::OtherGeometry { running_geometry, .. } if running_geometry.layers == 1), "{e}");
        assert!(e.to_string().contains("has geometry") && e.to_string().contains("the running plan"), "{e}");

        // Files written a moment ago get no claim (the e2e update tests adopt one).
        let passed = check("one").unwrap();
        let opened = Checkpoint::open(&tmp.path().join("one")).unwrap();
        assert_eq!(passed.version, opened.content_version());
        assert!(!passed.adopted && !passed.inspected_before);
    }

    #[test]
    fn known_claims_keep_the_newest_claim_per_directory_and_a_bounded_number() {
        let known = KnownClaims::default();
        known.put("/ck/a".into(), claim("1"), false);
        known.put("/ck/a".into(), claim("2"), true);
        let a = known.get(Path::new("/ck/a")).expect("kept");
        assert_eq!((a.claim.version.as_str(), a.inspected), ("2", true));
        for i in 0..KnownClaims::CAPACITY {
            known.put(format!("/ck/{i}").into(), claim("3"), false);
        }
        // The oldest went; the newest CAPACITY stay.
        assert!(known.get(Path::new("/ck/a")).is_none());
        assert!((0..KnownClaims::CAPACITY).all(|i| known.get(Path::new(&format!("/ck/{i}"))).is_some()));
        assert!(known.get(Path::new("/ck/b")).is_none());
    }
}
