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

pub struct CoordinatorService {
    pub registry: Arc<Registry>,
    /// The running session, once the cluster is up (`report` needs it).
    pub session: Arc<tokio::sync::Mutex<Option<Session>>>,
    pub shutdown: Arc<Notify>,
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

    async fn shutdown(&self, _request: Request<pb::ShutdownRequest>) -> Result<Response<pb::ShutdownResponse>, Status> {
        self.shutdown.notify_one();
        Ok(Response::new(pb::ShutdownResponse {}))
    }
}
