//! A cluster that is up (after `launch` or `recover`), what is needed to check it again, and the
//! health loop that keeps its rotation true.
//!
//! A session is shared (`Arc`) by the Coordinator service's calls: a report, an update, routed
//! probes and shutdown never wait for one another's locks, only for the group locks of the
//! replicas they probe (each held for one probe of one replica).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use orchestrator_model::AllowedRoots;
use orchestrator_proto::limits;
use orchestrator_proto::v1 as pb;
use orchestrator_worker::probe::ProbeSpec;

use crate::cluster::Cluster;
use crate::consistency::{ConsistencyReport, evaluate, failed_row, row};
use crate::journal::{Event, Journal, SourceRecord};
use crate::rollout::{CommitStatus, HealthAction, health_action};
use crate::rotation::Rotation;
use crate::update::{Proof, SwapProbe, drive_commit, judge_probe, try_reinstate};

/// What changes while a session runs (behind its own short lock).
pub struct SessionState {
    pub source_desc: String,
    /// The source every replica serves (outside updates), and the last update's number.
    pub current_source: SourceRecord,
    pub last_update: u64,
    pub timings: BTreeMap<String, f64>,
}

impl SessionState {
    /// Every replica serves `source` now (nothing changes where it already did). Returns
    /// whether it changed.
    pub fn serves(&mut self, source: SourceRecord) -> bool {
        if source == self.current_source {
            return false;
        }
        if let SourceRecord::Checkpoint { dir } = &source {
            self.source_desc = format!("checkpoint {} (rolled out)", dir.display());
        }
        self.current_source = source;
        true
    }
}

impl Session {
    /// Follows the journal's account of what every replica serves (its replay's rules, which
    /// a recovery reads too, kept by the writer line by line): after an update, and after a
    /// late commit confirmation. Without a journal, or while its update's end is still owed (a
    /// failed write), `applied` (an update's target, where it was applied) is taken as is.
    /// Returns whether the source changed.
    pub fn follow_journal(&self, applied: Option<SourceRecord>) -> bool {
        let source = match &self.journal {
            Some(j) if j.open_update().is_none() => j.serving().map(|(source, _)| source),
            _ => applied,
        };
        source.is_some_and(|s| self.state().serves(s))
    }
}

pub struct Session {
    pub cluster: Arc<Cluster>,
    /// Which replicas serve routed probes, and the versions their ranks last agreed on.
    pub rotation: Arc<Rotation>,
    /// The running plan's configuration (an update must match it).
    pub config: orchestrator_model::ModelConfig,
    pub probe: Option<ProbeSpec>,
    pub golden: Option<BTreeMap<u32, BTreeMap<String, String>>>,
    /// Where updates are journaled (`--state-dir`).
    pub journal: Option<Arc<Journal>>,
    /// The directories the workers read checkpoints from (an update is checked against them
    /// before any replica leaves rotation).
    pub roots: AllowedRoots,
    /// How long an update drives a decided commit to a silent rank before reporting it.
    pub commit_timeout: std::time::Duration,
    /// The claims this coordinator made on the checkpoints it hashed (the launched one first).
    pub known_claims: Arc<crate::update::KnownClaims>,
    /// Set while a rolling update runs (replicas may then hold different versions).
    pub updating: Arc<AtomicBool>,
    /// Updates run one at a time.
    pub update_lock: Arc<tokio::sync::Mutex<()>>,
    pub state: Mutex<SessionState>,
}

impl Session {
    pub fn state(&self) -> std::sync::MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The probe updates verify with (and the health loop reinstates with): the cluster's
    /// `--probe`, else the serving-sized one.
    pub fn update_probe(&self) -> ProbeSpec {
        self.probe.unwrap_or(ProbeSpec::SERVING)
    }

    /// Probes (when configured and asked) and collects every rank's report, then applies the
    /// cross-rank rules. Each rank's row stands on its own answer: a dead or silent rank is a
    /// failed row naming why, and the other ranks' rows show what they hold. A replica whose
    /// probe fails leaves rotation (the health loop brings it back after a passing probe).
    pub async fn check(&self, probe: bool) -> ConsistencyReport {
        self.check_after_update(probe, &BTreeMap::new()).await
    }

    /// [`Session::check`] right after an update: a replica whose probe after its swap
    /// (`swap_probes`) is the probe this report would run (the same spec, against the
    /// reference where the report's plan runs it) is not probed again while every one of its
    /// ranks still reports the pid, generation and version that probe answered on: the
    /// weights it probed are the ones the rank holds, and a probe is a function of them.
    pub async fn check_after_update(&self, probe: bool, swap_probes: &BTreeMap<u32, SwapProbe>) -> ConsistencyReport {
        let mut probe_errors: BTreeMap<u32, String> = BTreeMap::new();
        let mut probes = BTreeMap::new();
        let mut timings = self.state().timings.clone();
        // Reports first: which replicas are byte-identical to an earlier one decides which run
        // the reference.
        let t = Instant::now();
        let swapped: Vec<u32> = swap_probes.keys().copied().collect();
        let reports = if swapped.is_empty() { self.cluster.reports().await } else { self.cluster.reports_after_update(&swapped).await };
        let report_s = t.elapsed().as_secs_f64();
        let by_rank: Vec<(u32, u32, &pb::RankReport)> =
            self.cluster.workers.iter().filter_map(|w| reports.get(&w.id).and_then(|r| r.as_ref().ok()).map(|r| (w.dp, w.tp, r))).collect();
        let plan = crate::consistency::reference_plan(self.cluster.tp, self.cluster.dp, &by_rank);
        let mut reused = Vec::new();
        let t = Instant::now();
        if let (Some(spec), true) = (self.probe, probe) {
            let mut results = crate::cluster::RankResults::new();
            for (&dp, by) in &plan {
                let workers: Vec<u32> = self.cluster.workers.iter().filter(|w| w.dp == dp).map(|w| w.id).collect();
                let ranks: Vec<(u32, &pb::RankReport)> =
                    workers.iter().filter_map(|id| reports.get(id).and_then(|r| r.as_ref().ok()).map(|r| (*id, r))).collect();
                if let Some(kept) = swap_probes.get(&dp)
                    && stands_for_report(kept, spec, by.is_none(), &ranks, workers.len())
                {
                    results.extend(kept.results.iter().map(|(id, p)| (*id, Ok(p.clone()))));
                    reused.push(dp);
                }
            }
            let rest: BTreeMap<u32, Option<u32>> = plan.iter().filter(|(dp, _)| !reused.contains(dp)).map(|(dp, by)| (*dp, *by)).collect();
            if !rest.is_empty() {
                results.extend(self.cluster.probe_planned((spec.tokens as u32, spec.latents as u32, spec.seed), &rest).await);
            }
            for dp in 0..self.cluster.dp {
                let group: crate::cluster::RankResults<_> = self
                    .cluster
                    .workers
                    .iter()
                    .filter(|w| w.dp == dp)
                    .filter_map(|w| results.get(&w.id).map(|r| (w.id, r.clone())))
                    .collect();
                if let Err(why) = judge_probe(&group)
                    && !self.rotation.state(dp).owned_by_update
                    && self.rotation.pull(dp, &format!("a report's probe failed: {why}"))
                {
                    tracing::warn!(dp, "report probe failed, replica out of rotation: {why}");
                }
            }
            for (id, r) in results {
                match r {
                    Ok(p) => {
                        probes.insert(id, p);
                    }
                    Err(e) => {
                        probe_errors.insert(id, e.to_string());
                    }
                }
            }
            if reused.len() < plan.len() {
                timings.insert("probe".into(), t.elapsed().as_secs_f64());
            }
        }
        let t = Instant::now();
        let mut rows = Vec::new();
        for w in &self.cluster.workers {
            let dead = self
                .cluster
                .health(w)
                .await
                .filter(|d| d.is_dead())
                .map(|why| crate::consistency::RowFailure { text: format!("dead: {why}"), names_host: why.names_host() });
            match (reports.get(&w.id), dead) {
                (_, Some(dead)) => rows.push(failed_row(w.id, w.dp, w.tp, dead)),
                (Some(Ok(r)), None) => {
                    // The rank's own load time: of the version it serves (after an update, its
                    // staging), not the launch's.
                    let mut rr = row(w.id, r, probes.get(&w.id));
                    if let Some(p) = rr.probe.as_mut() {
                        p.verified_by_replica = plan.get(&w.dp).copied().flatten();
                        p.after_swap = reused.contains(&w.dp);
                    }
                    rr.probe_error = probe_errors.get(&w.id).cloned();
                    rows.push(rr);
                }
                (Some(Err(e)), None) => rows.push(failed_row(w.id, w.dp, w.tp, e)),
                (None, None) => rows.push(failed_row(w.id, w.dp, w.tp, "no report")),
            }
        }
        timings.insert("report".into(), report_s + t.elapsed().as_secs_f64());
        self.state().timings = timings.clone();
        self.cluster.annotate(&mut rows);
        let mut report = evaluate(
            self.cluster.tp,
            self.cluster.dp,
            self.state().source_desc.clone(),
            rows,
            self.golden.as_ref(),
            timings,
            self.updating.load(Ordering::SeqCst),
        );
        let names = |dps: &[u32]| dps.iter().map(|dp| format!("dp{dp}")).collect::<Vec<_>>().join(", ");
        if !swapped.is_empty() {
            report.notes.push(format!(
                "replicas {}: each rank's round trip is the one its stage ran on the weights it committed, or, on a later replica \
                 of the version, the verdict of the verified rank whose kernel and source digests its own equal (`= dpN/tpM`; \
                 nothing writes the weights since; a rank that holds other weights ran it again)",
                names(&swapped)
            ));
        }
        if !reused.is_empty() {
            report.notes.push(format!(
                "replicas {}: probed by the update right after their swap (the same probe; every rank still holds the weights it probed), not again",
                names(&reused)
            ));
        }
        report.replicas = self.rotation.states();
        let metrics = crate::metrics::metrics();
        metrics.rows(&report.ranks);
        for rule in report.rules.iter().filter(|r| !r.ok) {
            metrics.verification_failed(&rule.id);
        }
        report
    }
}

/// Whether a replica's probe after its swap stands for the probe a report would run now: the
/// same spec, the reference checked where the report's plan checks it (`reference`), and an
/// answer from each of its `ranks` workers that still reports the pid, generation and version
/// the answer came from.
fn stands_for_report(kept: &SwapProbe, spec: ProbeSpec, reference: bool, ranks: &[(u32, &pb::RankReport)], workers: usize) -> bool {
    kept.spec == spec
        && (kept.reference || !reference)
        && ranks.len() == workers
        && kept.results.len() == workers
        && ranks.iter().all(|(id, r)| {
            kept.results.get(id).is_some_and(|p| {
                p.pid == r.pid && p.generation == r.generation && p.probed_version == r.checkpoint_version && !p.probed_version.is_empty()
            })
        })
}

/// How often readiness is told to every rank again even when nothing changed (a rank that
/// dropped to NOT_SERVING by itself, mid-swap say, hears where it stands within this time).
const READINESS_REFRESH: std::time::Duration = std::time::Duration::from_secs(2);

/// What each replica's ranks were last told about their readiness, and when.
#[derive(Default)]
struct Readiness {
    told: std::collections::BTreeMap<u32, ((bool, String), std::time::Instant)>,
}

impl Readiness {
    /// Makes every rank's grpc.health.v1 readiness follow the rotation (SERVING only while its
    /// replica is in rotation on verified weights), and the coordinator's own: SERVING while any
    /// replica serves. The live ranks of a dead replica hear NOT_SERVING too (its dead rank,
    /// which cannot, answers at once as down, and the others are told again at each refresh).
    async fn sync(&mut self, session: &Session, coordinator: &orchestrator_net::grpc::Health) {
        let states = session.rotation.states();
        let due = states.iter().enumerate().filter_map(|(dp, st)| {
            let (dp, want) = (dp as u32, (st.serving, st.version.clone()));
            let fresh = self.told.get(&dp).is_some_and(|(told, at)| *told == want && at.elapsed() < READINESS_REFRESH);
            (!fresh).then_some((dp, want, st.dead))
        });
        let told = futures_util::future::join_all(due.map(|(dp, want, dead)| async move {
            let ok = session.cluster.set_serving(dp, want.0, &want.1).await;
            (dp, want, ok || dead)
        }))
        .await;
        for (dp, want, ok) in told {
            if ok {
                self.told.insert(dp, (want, std::time::Instant::now()));
            }
        }
        coordinator.set(states.iter().any(|s| s.serving)).await;
    }
}

/// Keeps the rotation true until the session ends: a replica leaves it when a rank dies or stops
/// heartbeating, and one that is out while every rank is up is brought back (its pending
/// commit finished first, journaled) once a probe passes. Replicas an update owns are the
/// update's, but for pulling one that still serves with a rank down. Each replica's attempt to
/// come back runs on a task of its own, ended with the loop. Every rank's readiness (and the coordinator's, `health`) follows the rotation.
pub async fn health_loop(session: Arc<Session>, health: orchestrator_net::grpc::Health) {
    let cluster = &session.cluster;
    let rotation = &session.rotation;
    let mut readiness = Readiness::default();
    // Aborted when dropped: the attempts end with the loop (a stopping cluster drives no commit
    // and reinstates nothing after its shutdown).
    let mut reinstating: std::collections::BTreeMap<u32, AbortOnDrop> = Default::default();
    loop {
        readiness.sync(&session, &health).await;
        tokio::time::sleep(limits::HEALTH_INTERVAL).await;
        for dp in 0..cluster.dp {
            let down = cluster.down_in(dp).await;
            // Dead is for good only where a process is gone: a remote rank presumed dead after a
            // long silence whose heartbeats come back (the same process: a restarted one is a
            // stranger to the registry) is alive, and its replica may return after a probe.
            if down.iter().all(Option::is_none) && rotation.revive(dp) {
                tracing::warn!(dp, "replica's ranks answer again after it was presumed dead");
                orchestrator_ops::status!(replica = dp; "replica dp{dp}: every rank answers again after it was presumed dead; probing it");
            }
            let st = rotation.state(dp);
            crate::metrics::metrics().set_up(dp, down.iter().filter(|d| d.is_none()).count());
            match health_action(st.serving, st.owned_by_update, &down, st.pending_commit.as_deref()) {
                HealthAction::Keep => {}
                HealthAction::Pull { why } => {
                    if down.iter().flatten().any(|d| d.is_dead()) {
                        rotation.mark_dead(dp, &why);
                    } else {
                        rotation.pull(dp, &why);
                    }
                    tracing::warn!(dp, "replica out of rotation: {why}");
                    orchestrator_ops::status!(replica = dp; "replica dp{dp}: out of rotation: {why}");
                }
                HealthAction::StayOut => {
                    if !st.dead {
                        let why: Vec<String> = down.iter().flatten().filter(|d| d.is_dead()).map(ToString::to_string).collect();
                        rotation.mark_dead(dp, &why.join("; "));
                    }
                }
                HealthAction::TryReinstate { finish_commit } => {
                    // One attempt per replica at a time, each on a task of its own: a replica whose
                    // commit or probe hangs holds up neither the others' attempts nor the pulls.
                    if reinstating.get(&dp).is_some_and(|t| !t.0.is_finished()) || !rotation.attempt_due(dp, limits::REINSTATE_BACKOFF) {
                        continue;
                    }
                    reinstating.insert(dp, AbortOnDrop(tokio::spawn(reinstate_replica(session.clone(), dp, finish_commit))));
                }
            }
        }
    }
}

/// A task aborted when its handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The health loop's attempt to bring replica `dp` back: finish its pending commit first (if
/// any), then probe it; it serves again only when the probe passes.
async fn reinstate_replica(session: Arc<Session>, dp: u32, finish_commit: Option<String>) {
    let (cluster, rotation) = (&session.cluster, &session.rotation);
    if let Some(version) = finish_commit {
        match drive_commit(cluster, dp, &version, limits::COMMIT_CALL_DEADLINE).await {
            CommitStatus::Done => {
                if let Some(j) = &session.journal {
                    j.note(Event::CommitConfirmed { dp, version: version.clone() });
                }
                rotation.set_pending_commit(dp, None);
                rotation.observed_version(dp, &version);
                // The last commit an update left unconfirmed: its target is what every replica
                // serves now.
                if session.follow_journal(None) {
                    orchestrator_ops::status!(version = version.as_str(); "every replica serves {version} now");
                }
                orchestrator_ops::status!(replica = dp, version = version.as_str(); "replica dp{dp}: every rank confirmed the decided commit to {version}");
            }
            other => {
                tracing::info!(dp, "pending commit to {version} not finished yet: {other:?}");
                return;
            }
        }
    }
    let attempt = try_reinstate(cluster, rotation, dp, session.update_probe(), Proof::Verified, false);
    match tokio::time::timeout(limits::REINSTATE_TIMEOUT, attempt).await {
        Ok(Ok(v)) => {
            orchestrator_ops::status!(replica = dp, version = v.as_str(); "replica dp{dp}: back in rotation on {v} after a passing probe")
        }
        Ok(Err(why)) => tracing::info!(dp, "replica stays out of rotation: {why}"),
        Err(_) => tracing::warn!(dp, "replica stays out of rotation: its probe took over {:?}", limits::REINSTATE_TIMEOUT),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: ProbeSpec = ProbeSpec::SERVING;

    fn rank(pid: u32, generation: u64, version: &str) -> pb::RankReport {
        pb::RankReport { pid, generation, checkpoint_version: version.into(), ..Default::default() }
    }

    /// Workers 4 and 5 answered the probe after the swap on generation 2 of version `b`.
    fn kept(reference: bool) -> SwapProbe {
        let answer = |pid| pb::ProbeResult { ok: true, pid, generation: 2, probed_version: "b".into(), ..Default::default() };
        SwapProbe { spec: SPEC, reference, results: [(4, answer(40)), (5, answer(50))].into() }
    }

    /// A probe after the swap stands for the report's only while every rank still holds what
    /// it probed (same pid, generation, version), for the same spec, with the reference checked
    /// where the report's plan checks it.
    #[test]
    fn a_probe_after_the_swap_stands_for_the_report_only_on_the_same_weights() {
        let (r4, r5) = (rank(40, 2, "b"), rank(50, 2, "b"));
        let ranks = [(4, &r4), (5, &r5)];
        assert!(stands_for_report(&kept(true), SPEC, true, &ranks, 2));
        assert!(stands_for_report(&kept(true), SPEC, false, &ranks, 2));
        assert!(stands_for_report(&kept(false), SPEC, false, &ranks, 2));
        // The report's plan runs the reference on this replica; the kept probe did not.
        assert!(!stands_for_report(&kept(false), SPEC, true, &ranks, 2));
        // Another probe.
        assert!(!stands_for_report(&kept(true), ProbeSpec { seed: 1, ..SPEC }, true, &ranks, 2));
        // A rank reloaded (another generation), restarted (another pid), or holds another version.
        for changed in [rank(40, 3, "b"), rank(41, 2, "b"), rank(40, 2, "c")] {
            assert!(!stands_for_report(&kept(true), SPEC, true, &[(4, &changed), (5, &r5)], 2), "{changed:?}");
        }
        // A rank that did not report, or a probe without an answer from every rank.
        assert!(!stands_for_report(&kept(true), SPEC, true, &ranks[..1], 2));
        let mut short = kept(true);
        short.results.remove(&5);
        assert!(!stands_for_report(&short, SPEC, true, &ranks, 2));
        // Answers from other workers than the replica's.
        assert!(!stands_for_report(&kept(true), SPEC, true, &[(4, &r4), (6, &r5)], 2));
    }
}
