//! The Coordinator gRPC service: registrations and heartbeats from workers, and the `report`
//! and `shutdown` operations of a `--serve` cluster.

use std::sync::Arc;
use std::time::Instant;

use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::coordinator_server::Coordinator;
use tokio::sync::Notify;
use tonic::{Request, Response, Status};

use crate::cluster::{Registration, Registry};
use crate::launch::Session;

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
    /// The running session, once the cluster is up (`report` needs it).
    pub session: Arc<tokio::sync::Mutex<Option<Session>>>,
    pub shutdown: Arc<Notify>,
    /// Updates run one at a time.
    pub update_lock: tokio::sync::Mutex<()>,
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn register(&self, request: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        let r = request.into_inner();
        if r.address.is_empty() {
            return Err(Status::invalid_argument("register: address is empty"));
        }
        if r.protocol_version != orchestrator_proto::PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "worker {} speaks protocol version {}, this coordinator {}: rebuild the workspace so both binaries match",
                r.worker_id,
                r.protocol_version,
                orchestrator_proto::PROTOCOL_VERSION
            )));
        }
        self.registry.register(
            r.worker_id,
            Registration { address: r.address, host: r.host, device: r.device, pid: r.pid, last_heartbeat: Instant::now() },
        );
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
        let mut guard = self.session.lock().await;
        let session = guard.as_mut().ok_or_else(|| Status::unavailable("the cluster is not up yet"))?;
        let report = session.check(probe).await;
        let json = serde_json::to_string_pretty(&report).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(pb::ClusterReport { ok: report.ok, json, text: report.render() }))
    }

    async fn update(&self, request: Request<pb::UpdateRequest>) -> Result<Response<pb::UpdateResponse>, Status> {
        let r = request.into_inner();
        if r.checkpoint_dir.is_empty() {
            return Err(Status::invalid_argument("update: checkpoint_dir is empty"));
        }
        let _one_update_at_a_time = self.update_lock.lock().await;
        let (cluster, rotation, config, probe, journal, update, from, updating) = {
            let mut guard = self.session.lock().await;
            let s = guard.as_mut().ok_or_else(|| Status::unavailable("the cluster is not up yet"))?;
            s.last_update += 1;
            (
                s.cluster.clone(),
                s.rotation.clone(),
                s.config.clone(),
                s.probe.unwrap_or(orchestrator_worker::probe::ProbeSpec { tokens: 2, latents: 16, seed: 0 }),
                s.journal.clone(),
                s.last_update,
                s.current_source.clone(),
                s.updating.clone(),
            )
        };
        let dir = std::path::Path::new(&r.checkpoint_dir);
        let plan = crate::update::UpdatePlan {
            dir,
            probe,
            max_unavailable: r.max_unavailable.max(1),
            replicas: None,
            journal: journal.as_deref().map(|j| (j, update, from)),
        };
        let outcome = {
            // Reports meanwhile see replicas on different versions as an update in flight.
            let _in_flight = InFlight::set(&updating);
            crate::update::rolling_update(&cluster, &rotation, &config, plan).await
        };
        // The consistency report after the update (versions included).
        let report = {
            let mut guard = self.session.lock().await;
            match guard.as_mut() {
                Some(s) => {
                    if outcome.ok {
                        s.source_desc = format!("checkpoint {} (rolled out)", outcome.checkpoint);
                        s.current_source = crate::journal::SourceRecord::Checkpoint { dir: dir.to_path_buf() };
                    }
                    Some(s.check(true).await)
                }
                None => None,
            }
        };
        let ok = outcome.ok && report.as_ref().is_some_and(|r| r.ok);
        let mut text = String::new();
        for step in &outcome.steps {
            text.push_str(step);
            text.push('\n');
        }
        text.push_str(&format!("update {} in {:.2} s\n", if outcome.ok { "done" } else { "FAILED" }, outcome.seconds));
        if let Some(r) = &report {
            text.push_str(&r.render());
        }
        let json = serde_json::json!({ "ok": ok, "update": outcome, "report": report });
        Ok(Response::new(pb::UpdateResponse {
            ok,
            json: serde_json::to_string_pretty(&json).map_err(|e| Status::internal(e.to_string()))?,
            text,
        }))
    }

    async fn routed_probe(&self, request: Request<pb::RoutedProbeRequest>) -> Result<Response<pb::RoutedProbeResult>, Status> {
        let r = request.into_inner();
        if r.tokens == 0 || r.latents == 0 {
            return Err(Status::invalid_argument("probe: tokens and latents must be at least 1"));
        }
        let (cluster, rotation) = {
            let guard = self.session.lock().await;
            let s = guard.as_ref().ok_or_else(|| Status::unavailable("the cluster is not up yet"))?;
            (s.cluster.clone(), s.rotation.clone())
        };
        let spec = orchestrator_worker::probe::ProbeSpec { tokens: r.tokens as usize, latents: r.latents as usize, seed: r.seed };
        Ok(Response::new(crate::update::routed_probe(&cluster, &rotation, spec).await))
    }

    async fn shutdown(&self, _request: Request<pb::ShutdownRequest>) -> Result<Response<pb::ShutdownResponse>, Status> {
        self.shutdown.notify_one();
        Ok(Response::new(pb::ShutdownResponse {}))
    }
}
