//! The Coordinator gRPC service: registrations and heartbeats from workers, and the `report`
//! and `shutdown` operations of a `--serve` cluster.

use std::sync::Arc;

use orchestrator_proto::limits;
use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::coordinator_server::Coordinator;
use tokio::sync::Notify;
use tonic::{Request, Response, Status};

use crate::cluster::Registry;
use crate::session::Session;

/// Marks an update in flight until dropped (also when the update's future is cancelled).
struct InFlight<'a>(&'a std::sync::atomic::AtomicBool);

impl<'a> InFlight<'a> {
    fn set(flag: &'a std::sync::atomic::AtomicBool) -> Self {
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        Self(flag)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

pub struct CoordinatorService {
    pub registry: Arc<Registry>,
    /// The running session, once the cluster is up. Calls clone the `Arc` and let go of the
    /// lock at once: a long report never holds up an update, a routed probe or shutdown.
    pub session: SessionSlot,
    pub shutdown: Arc<Notify>,
}

/// Where the service finds the session (empty while the cluster is launching or recovering).
pub type SessionSlot = Arc<std::sync::RwLock<Option<Arc<Session>>>>;

impl CoordinatorService {
    fn session(&self) -> Result<Arc<Session>, Status> {
        self.session.read().unwrap_or_else(|p| p.into_inner()).clone().ok_or_else(|| {
            Status::failed_precondition(
                "the cluster is not serving yet (it is still launching or recovering): nothing was started; try again",
            )
        })
    }
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn register(&self, request: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        self.registry.admit(request.into_inner())?;
        Ok(Response::new(pb::RegisterResponse {}))
    }

    async fn heartbeat(&self, request: Request<pb::HeartbeatRequest>) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let id = request.into_inner().worker_id;
        if self.registry.heartbeat(id) {
            Ok(Response::new(pb::HeartbeatResponse {}))
        } else {
            Err(Status::not_found(format!("worker {id} is not registered")))
        }
    }

    async fn report(&self, request: Request<pb::ClusterReportRequest>) -> Result<Response<pb::ClusterReport>, Status> {
        let probe = request.into_inner().probe;
        let session = self.session()?;
        let report = session.check(probe).await;
        let json = serde_json::to_string_pretty(&report).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(pb::ClusterReport { ok: report.ok, json, text: report.render() }))
    }

    async fn update(&self, request: Request<pb::UpdateRequest>) -> Result<Response<pb::UpdateResponse>, Status> {
        let r = request.into_inner();
        if r.checkpoint_dir.is_empty() {
            return Err(Status::invalid_argument("update: checkpoint_dir is empty"));
        }
        if r.checkpoint_dir.len() > limits::MAX_PATH_BYTES {
            return Err(Status::invalid_argument(format!(
                "update: checkpoint_dir is {} bytes, longer than a path can be ({} bytes)",
                r.checkpoint_dir.len(),
                limits::MAX_PATH_BYTES
            )));
        }
        let session = self.session()?;
        // One update at a time. A client that goes away (Ctrl-C, a lost connection, its
        // deadline) while its update waits for its turn cancels it: it never starts.
        let turn = session.update_lock.clone().lock_owned().await;
        // Once started, the update runs on a task of its own: a client that goes away cancels
        // only its wait for the answer, never the protocol halfway (a replica left owned, a
        // decision not driven, an update without its end).
        let dir = std::path::PathBuf::from(&r.checkpoint_dir);
        let (max_unavailable, max_staging) = (r.max_unavailable.max(1), r.max_staging);
        tokio::spawn(async move { run_update(&session, turn, &dir, max_unavailable, max_staging).await })
            .await
            .map_err(|e| Status::internal(format!("update task: {e}")))?
            .map(Response::new)
    }

    async fn routed_probe(&self, request: Request<pb::RoutedProbeRequest>) -> Result<Response<pb::RoutedProbeResult>, Status> {
        let r = request.into_inner();
        let spec = orchestrator_worker::probe::ProbeSpec::checked(r.tokens, r.latents, r.seed)
            .map_err(|e| Status::invalid_argument(format!("probe: {e}")))?;
        let session = self.session()?;
        // A probe too large for the ranks is the caller's error: refused here, it takes no
        // replica out of rotation.
        let g = &session.config.geometry;
        spec.check_on(g, g.layers, session.cluster.tp as usize).map_err(|e| Status::invalid_argument(format!("probe {spec}: {e}")))?;
        // On a task of its own, so a client that goes away cannot cut it off between a failure
        // and pulling the replica (or the ring epoch that failure starts).
        let started = std::time::Instant::now();
        let rotation = session.rotation.clone();
        let result = tokio::spawn(async move { crate::update::routed_probe(&session.cluster, &session.rotation, spec).await })
            .await
            .map_err(|e| Status::internal(format!("probe task: {e}")))?;
        // A failed probe counts against the version its replica was serving.
        let replica = (result.ok || result.error != crate::update::NO_REPLICA).then_some(result.replica);
        let version =
            if result.ok { result.checkpoint_version.clone() } else { replica.map(|dp| rotation.version(dp)).unwrap_or_default() };
        crate::metrics::metrics().routed_probe(replica, &version, result.ok, started.elapsed().as_secs_f64());
        Ok(Response::new(result))
    }

    async fn shutdown(&self, _request: Request<pb::ShutdownRequest>) -> Result<Response<pb::ShutdownResponse>, Status> {
        self.shutdown.notify_one();
        Ok(Response::new(pb::ShutdownResponse {}))
    }
}

/// One rolling update to `dir` and the consistency report after it, in its `_turn` (held to
/// its end: one update at a time).
async fn run_update(
    session: &Session,
    _turn: tokio::sync::OwnedMutexGuard<()>,
    dir: &std::path::Path,
    max_unavailable: u32,
    max_staging: u32,
) -> Result<pb::UpdateResponse, Status> {
    let (update, from) = {
        let mut st = session.state();
        st.last_update += 1;
        (st.last_update, st.current_source.clone())
    };
    let plan = crate::update::UpdatePlan {
        dir,
        probe: session.update_probe(),
        max_unavailable,
        max_staging,
        replicas: None,
        journal: session.journal.as_deref().map(|journal| crate::update::Journaled { journal, update, from, resumes: None }),
        roots: &session.roots,
        commit_timeout: session.commit_timeout,
        known: Some(session.known_claims.clone()),
        expected_version: None,
    };
    let outcome = {
        // Reports meanwhile see replicas on different versions as an update in flight.
        let _in_flight = InFlight::set(&session.updating);
        crate::update::rolling_update(&session.cluster, &session.rotation, &session.config, plan).await
    };
    // What every replica serves after it, by the journal's account: the target where the
    // update was applied, or where every replica it reached took it (replicas with a dead rank
    // skipped), or later, once the health loop confirms the last commit it left unconfirmed.
    let applied = outcome.ok.then(|| crate::journal::SourceRecord::Checkpoint { dir: dir.to_path_buf() });
    if session.follow_journal(applied) || outcome.ok {
        // From now on the report's timings are the update's: the launch's load no longer
        // describes what serves (each rank's row shows its own staging).
        session.state().timings = [("update".to_string(), outcome.seconds)].into();
    }
    // The consistency report after the update (versions included).
    let report = session.check_after_update(true, &outcome.swap_probes).await;
    let ok = outcome.ok && report.ok;
    let mut text = String::new();
    for step in &outcome.steps {
        text.push_str(step);
        text.push('\n');
    }
    text.push_str(&format!("update {} in {:.2} s\n", if outcome.ok { "done" } else { "FAILED" }, outcome.seconds));
    text.push_str(&report.render());
    let doc = crate::update::UpdateDocument { ok, update: outcome, report };
    Ok(pb::UpdateResponse { ok, json: serde_json::to_string_pretty(&doc).map_err(|e| Status::internal(e.to_string()))?, text })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service() -> CoordinatorService {
        CoordinatorService { registry: Default::default(), session: Default::default(), shutdown: Arc::new(Notify::new()) }
    }

    /// An update naming a 15 MB path is refused with a short answer (not one that echoes it).
    #[tokio::test]
    async fn an_oversized_update_request_gets_a_short_refusal() {
        let req = Request::new(pb::UpdateRequest { checkpoint_dir: "x".repeat(15 << 20), max_unavailable: 1, max_staging: 0 });
        let e = service().update(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().len() < 200, "{} bytes", e.message().len());
    }

    /// Before the cluster serves (launching, recovering), calls say so and that nothing started,
    /// with a code the update client does not take for a lost coordinator.
    #[tokio::test]
    async fn calls_before_the_cluster_serves_say_nothing_started() {
        let req = Request::new(pb::UpdateRequest { checkpoint_dir: "/ck/B".into(), max_unavailable: 1, max_staging: 0 });
        let e = service().update(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("nothing was started"), "{}", e.message());
        let probe = Request::new(pb::RoutedProbeRequest { tokens: 100_000, latents: 1, seed: 0 });
        assert_eq!(service().routed_probe(probe).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    }
}
