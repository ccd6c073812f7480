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

use orchestrator_proto::limits;
use orchestrator_proto::v1 as pb;
use orchestrator_worker::auth::AllowedRoots;
use orchestrator_worker::probe::ProbeSpec;

use crate::cluster::Cluster;
use crate::consistency::{ConsistencyReport, evaluate, failed_row, row};
use crate::journal::{Event, Journal, SourceRecord};
use crate::rollout::{CommitStatus, HealthAction, health_action};
use crate::rotation::Rotation;
use crate::update::{Proof, drive_commit, judge_probe, try_reinstate};

/// The probe an update verifies with (and the health loop reinstates with) when the cluster has
/// no `--probe` of its own.
pub const DEFAULT_UPDATE_PROBE: ProbeSpec = ProbeSpec { tokens: 2, latents: 16, seed: 0 };

/// What changes while a session runs (behind its own short lock).
pub struct SessionState {
    pub source_desc: String,
    /// The source every replica serves (outside updates), and the last update's number.
    pub current_source: SourceRecord,
    pub last_update: u64,
    pub timings: BTreeMap<String, f64>,
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
    /// Set while a rolling update runs (replicas may then hold different versions).
    pub updating: Arc<AtomicBool>,
    /// Updates run one at a time.
    pub update_lock: tokio::sync::Mutex<()>,
    pub state: Mutex<SessionState>,
}

impl Session {
    pub fn state(&self) -> std::sync::MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The probe updates verify with.
    pub fn update_probe(&self) -> ProbeSpec {
        self.probe.unwrap_or(DEFAULT_UPDATE_PROBE)
    }

    /// Probes (when configured and asked) and collects every rank's report, then applies the
    /// cross-rank rules. Each rank's row stands on its own answer: a dead or silent rank is a
    /// failed row naming why, and the other ranks' rows show what they hold. A replica whose
    /// probe fails leaves rotation (the health loop brings it back after a passing probe).
    pub async fn check(&self, probe: bool) -> ConsistencyReport {
        let mut probe_errors: BTreeMap<u32, String> = BTreeMap::new();
        let mut probes = BTreeMap::new();
        let mut timings = self.state().timings.clone();
        // Reports first: which replicas are byte-identical to an earlier one decides which run
        // the reference.
        let t = Instant::now();
        let reports = self.cluster.reports().await;
        let report_s = t.elapsed().as_secs_f64();
        let by_rank: Vec<(u32, u32, &pb::RankReport)> =
            self.cluster.workers.iter().filter_map(|w| reports.get(&w.id).and_then(|r| r.as_ref().ok()).map(|r| (w.dp, w.tp, r))).collect();
        let plan = crate::consistency::reference_plan(self.cluster.tp, self.cluster.dp, &by_rank);
        let t = Instant::now();
        if let (Some(spec), true) = (self.probe, probe) {
            let results = self.cluster.probe_planned((spec.tokens as u32, spec.latents as u32, spec.seed), &plan).await;
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
                        probe_errors.insert(id, e);
                    }
                }
            }
            timings.insert("probe".into(), t.elapsed().as_secs_f64());
        }
        let t = Instant::now();
        let mut rows = Vec::new();
        for w in &self.cluster.workers {
            let dead = self.cluster.health(w).await.filter(|(dead, _)| *dead).map(|(_, why)| format!("dead: {why}"));
            match (reports.get(&w.id), dead) {
                (_, Some(dead)) => rows.push(failed_row(w.id, w.dp, w.tp, dead)),
                (Some(Ok(r)), None) => {
                    // The rank's own load time: of the version it serves (after an update, its
                    // staging), not the launch's.
                    let mut rr = row(w.id, r, probes.get(&w.id));
                    if let Some(p) = rr.probe.as_mut() {
                        p.verified_by_replica = plan.get(&w.dp).copied().flatten();
                    }
                    rr.probe_error = probe_errors.get(&w.id).cloned();
                    rows.push(rr);
                }
                (Some(Err(e)), None) => rows.push(failed_row(w.id, w.dp, w.tp, e.clone())),
                (None, None) => rows.push(failed_row(w.id, w.dp, w.tp, "no report".into())),
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
        report.replicas = self.rotation.states();
        let metrics = crate::metrics::metrics();
        metrics.rows(&report.ranks);
        for rule in report.rules.iter().filter(|r| !r.ok) {
            metrics.verification_failed(&rule.id);
        }
        report
    }
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
    /// replica serves.
    async fn sync(&mut self, session: &Session, coordinator: &orchestrator_worker::grpc::Health) {
        let states = session.rotation.states();
        let due = states.iter().enumerate().filter_map(|(dp, st)| {
            let (dp, want) = (dp as u32, (st.serving, st.version.clone()));
            let fresh = self.told.get(&dp).is_some_and(|(told, at)| *told == want && at.elapsed() < READINESS_REFRESH);
            // A dead replica's ranks cannot hear it (and are out for good).
            (!fresh && !st.dead).then_some((dp, want))
        });
        let told = futures_util::future::join_all(due.map(|(dp, want)| async move {
            let ok = session.cluster.set_serving(dp, want.0, &want.1).await;
            (dp, want, ok)
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
/// update's. Every rank's readiness (and the coordinator's, `health`) follows the rotation.
pub async fn health_loop(session: Arc<Session>, health: orchestrator_worker::grpc::Health) {
    let cluster = &session.cluster;
    let rotation = &session.rotation;
    let mut readiness = Readiness::default();
    loop {
        readiness.sync(&session, &health).await;
        tokio::time::sleep(limits::HEALTH_INTERVAL).await;
        for dp in 0..cluster.dp {
            let st = rotation.state(dp);
            let down = cluster.down_in(dp).await;
            crate::metrics::metrics().set_up(dp, down.iter().filter(|d| d.is_none()).count());
            match health_action(st.serving, st.owned_by_update, &down, st.pending_commit.as_deref()) {
                HealthAction::Keep => {}
                HealthAction::Pull { why } => {
                    if down.iter().flatten().any(|(dead, _)| *dead) {
                        rotation.mark_dead(dp, &why);
                    } else {
                        rotation.pull(dp, &why);
                    }
                    tracing::warn!(dp, "replica out of rotation: {why}");
                    orchestrator_worker::status!(replica = dp; "replica dp{dp}: out of rotation: {why}");
                }
                HealthAction::StayOut => {
                    if !st.dead {
                        let why: Vec<String> = down.iter().flatten().filter(|(d, _)| *d).map(|(_, w)| w.clone()).collect();
                        rotation.mark_dead(dp, &why.join("; "));
                    }
                }
                HealthAction::TryReinstate { finish_commit } => {
                    if !rotation.attempt_due(dp, limits::REINSTATE_BACKOFF) {
                        continue;
                    }
                    if let Some(version) = finish_commit {
                        match drive_commit(cluster, dp, &version, limits::COMMIT_CALL_DEADLINE).await {
                            CommitStatus::Done => {
                                if let Some(j) = &session.journal {
                                    j.note(Event::CommitConfirmed { dp, version: version.clone() });
                                }
                                rotation.set_pending_commit(dp, None);
                                rotation.observed_version(dp, &version);
                                orchestrator_worker::status!(replica = dp, version = version.as_str(); "replica dp{dp}: every rank confirmed the decided commit to {version}");
                            }
                            other => {
                                tracing::info!(dp, "pending commit to {version} not finished yet: {other:?}");
                                continue;
                            }
                        }
                    }
                    let attempt = try_reinstate(cluster, rotation, dp, session.update_probe(), Proof::Verified, false);
                    match tokio::time::timeout(limits::REINSTATE_TIMEOUT, attempt).await {
                        Ok(Ok(v)) => {
                            orchestrator_worker::status!(replica = dp, version = v.as_str(); "replica dp{dp}: back in rotation on {v} after a passing probe")
                        }
                        Ok(Err(why)) => tracing::info!(dp, "replica stays out of rotation: {why}"),
                        Err(_) => tracing::warn!(dp, "replica stays out of rotation: its probe took over {:?}", limits::REINSTATE_TIMEOUT),
                    }
                }
            }
        }
    }
}
