//! The coordinator's gRPC endpoint (Coordinator service plus health and reflection, behind the
//! token) and the `--serve` loop shared by `launch` and `recover`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use orchestrator_net::auth::Token;
use orchestrator_net::tls::TlsFiles;
use orchestrator_proto::v1::coordinator_server::CoordinatorServer;
use tokio::sync::Notify;

use serde::{Deserialize, Serialize};

use crate::cluster::Registry;
use crate::journal::Event;
use crate::service::{CoordinatorService, SessionSlot};
use crate::session::{Session, health_loop};

/// A running Coordinator service.
pub struct Endpoint {
    pub address: SocketAddr,
    /// `http://ADDR`, or `https://ADDR` with TLS (what this host's own workers dial).
    pub url: String,
    /// The same with this host's name for an address bound to every interface (what the
    /// printed hints name).
    pub public_url: String,
    pub tls: Option<TlsFiles>,
    pub registry: Arc<Registry>,
    /// The session `report`, `update` and probes act on, once the cluster is up.
    pub session: SessionSlot,
    /// Notified by the Shutdown RPC.
    pub shutdown: Arc<Notify>,
    /// The coordinator's grpc.health.v1 readiness: SERVING only while it serves verified weights.
    pub health: orchestrator_net::grpc::Health,
    stop: Arc<Notify>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Endpoint {
    /// Binds `listen` and serves the Coordinator service for a cluster of `world` ranks,
    /// requiring `token` on every call.
    pub async fn start(listen: SocketAddr, token: Token, tls: Option<&TlsFiles>, world: u32) -> anyhow::Result<Self> {
        let registry = Arc::new(Registry::for_world(world));
        let session: SessionSlot = Default::default();
        let shutdown = Arc::new(Notify::new());
        let service = CoordinatorService { registry: registry.clone(), session: session.clone(), shutdown: shutdown.clone() };
        let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| anyhow::anyhow!("coordinator: binding {listen}: {e}"))?;
        let address = listener.local_addr()?;
        let (router, health) = orchestrator_net::grpc::standard_router::<CoordinatorServer<CoordinatorService>>(tls).await?;
        let stop = Arc::new(Notify::new());
        let task = {
            let stop = stop.clone();
            tokio::spawn(
                router
                    .add_service(tonic::service::interceptor::InterceptedService::new(
                        CoordinatorServer::new(service).max_decoding_message_size(orchestrator_proto::limits::MAX_MESSAGE_BYTES),
                        orchestrator_net::auth::interceptor(Some(token)),
                    ))
                    .serve_with_incoming_shutdown(orchestrator_net::grpc::incoming(listener), async move { stop.notified().await }),
            )
        };
        let url = format!("{}://{address}", orchestrator_net::tls::scheme(tls));
        // What others dial: a coordinator bound to every interface is reached by its host's name.
        let public_url = if address.ip().is_unspecified() {
            let host = orchestrator_worker::placement::host_name(&|k| std::env::var(k).ok());
            format!("{}://{}", orchestrator_net::tls::scheme(tls), orchestrator_worker::placement::join_host_port(&host, address.port()))
        } else {
            url.clone()
        };
        Ok(Self { address, url, public_url, tls: tls.cloned(), registry, session, shutdown, health, stop, task })
    }

    /// Serves `session` (with its health loop) until the Shutdown RPC, Ctrl-C or SIGTERM, then
    /// stops its workers (and records the shutdown in the journal). Shutdown waits for nothing a
    /// running report, update or probe holds.
    /// `ready_file`: written once it serves ([`Ready`]), removed when it stops.
    pub async fn serve(&self, session: Arc<Session>, token_file: &Path, ready_file: Option<&Path>) {
        let signal = orchestrator_net::grpc::shutdown_signal();
        let mut auth = format!("--coordinator {} --token-file {}", self.public_url, token_file.display());
        if let Some(t) = &self.tls {
            auth.push_str(&format!(" --tls-dir {}", t.dir.display()));
        }
        let health = tokio::spawn(health_loop(session.clone(), self.health.clone()));
        // The session first, then the line that tells users (and scripts) to call: a call made
        // as soon as it is printed finds the cluster serving.
        *self.session.write().unwrap_or_else(|p| p.into_inner()) = Some(session);
        orchestrator_ops::status!(; "serving: `orchestrator report {auth}` re-runs the checks; `orchestrator shutdown {auth}` stops");
        if let Some(path) = ready_file {
            let ready = Ready {
                coordinator: self.public_url.clone(),
                token_file: token_file.to_path_buf(),
                tls_dir: self.tls.as_ref().map(|t| t.dir.clone()),
                pid: std::process::id(),
            };
            if let Err(e) = ready.write(path) {
                tracing::error!("--ready-file {}: {e}", path.display());
                eprintln!("error: --ready-file {}: {e}", path.display());
            }
        }
        tokio::select! {
            _ = self.shutdown.notified() => {}
            _ = signal => {}
        }
        health.abort();
        self.health.set(false).await;
        if let Some(path) = ready_file {
            let _ = std::fs::remove_file(path);
        }
        let session = self.session.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(session) = session {
            session.cluster.shutdown().await;
            if let Some(j) = &session.journal {
                j.note(Event::Shutdown);
            }
        }
    }

    /// Stops serving.
    pub async fn stop(self) {
        self.stop.notify_one();
        let _ = self.task.await;
    }
}

/// What `--ready-file` holds while the cluster serves: how to call it, as the `serving:` line
/// says it, for scripts and tests that should not read the line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    /// The `--coordinator` URL to call.
    pub coordinator: String,
    /// The `--token-file` to call with.
    pub token_file: PathBuf,
    /// The `--tls-dir` to call with, when the control plane runs over TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_dir: Option<PathBuf>,
    /// The serving process.
    pub pid: u32,
}

impl Ready {
    /// Writes the file whole: a temporary file beside it, renamed over it, so a reader finds
    /// either no file or all of it.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let text = serde_json::to_string(self).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, text + "\n")?;
        std::fs::rename(&tmp, path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }

    /// Removes a ready file left by an earlier run, before this one starts (a script waiting for
    /// the file must not read a stale one): an error names the flag.
    pub fn clear(path: &Path) -> anyhow::Result<()> {
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => anyhow::bail!("--ready-file {}: {e}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ready_file_is_written_whole_and_read_back_and_a_stale_one_is_cleared() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("ready.json");
        Ready::clear(&path).unwrap();
        let ready = Ready { coordinator: "http://127.0.0.1:5".into(), token_file: "/t".into(), tls_dir: None, pid: 7 };
        ready.write(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "{\"coordinator\":\"http://127.0.0.1:5\",\"token_file\":\"/t\",\"pid\":7}\n");
        assert_eq!(serde_json::from_str::<Ready>(&text).unwrap(), ready);
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1, "no temporary file left");
        Ready::clear(&path).unwrap();
        assert!(!path.exists());
        let e = Ready::clear(tmp.path()).unwrap_err();
        assert!(e.to_string().starts_with("--ready-file "), "{e}");
    }
}
