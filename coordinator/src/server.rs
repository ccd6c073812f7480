//! The coordinator's gRPC endpoint (Coordinator service plus health and reflection, behind the
//! token) and the `--serve` loop shared by `launch` and `recover`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use orchestrator_proto::v1::coordinator_server::CoordinatorServer;
use orchestrator_worker::auth::Token;
use orchestrator_worker::tls::TlsFiles;
use tokio::sync::Notify;

use crate::cluster::Registry;
use crate::journal::Event;
use crate::launch::Session;
use crate::service::CoordinatorService;

/// A running Coordinator service.
pub struct Endpoint {
    pub address: SocketAddr,
    /// `http://ADDR`, or `https://ADDR` with TLS.
    pub url: String,
    pub tls: Option<TlsFiles>,
    pub registry: Arc<Registry>,
    /// The session `report`, `update` and probes act on, once the cluster is up.
    pub session: Arc<tokio::sync::Mutex<Option<Session>>>,
    /// Notified by the Shutdown RPC.
    pub shutdown: Arc<Notify>,
    stop: Arc<Notify>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Endpoint {
    /// Binds `listen` and serves the Coordinator service, requiring `token` on every call.
    pub async fn start(listen: SocketAddr, token: Token, tls: Option<&TlsFiles>) -> anyhow::Result<Self> {
        let registry = Arc::new(Registry::default());
        let session = Arc::new(tokio::sync::Mutex::new(None));
        let shutdown = Arc::new(Notify::new());
        let service = CoordinatorService {
            registry: registry.clone(),
            session: session.clone(),
            shutdown: shutdown.clone(),
            update_lock: Default::default(),
        };
        let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| anyhow::anyhow!("coordinator: binding {listen}: {e}"))?;
        let address = listener.local_addr()?;
        let router = orchestrator_worker::grpc::standard_router::<CoordinatorServer<CoordinatorService>>(tls).await?;
        let stop = Arc::new(Notify::new());
        let task = {
            let stop = stop.clone();
            tokio::spawn(
                router
                    .add_service(tonic::service::interceptor::InterceptedService::new(
                        CoordinatorServer::new(service).max_decoding_message_size(16 << 20),
                        orchestrator_worker::auth::interceptor(Some(token)),
                    ))
                    .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async move {
                        stop.notified().await
                    }),
            )
        };
        let url = format!("{}://{address}", orchestrator_worker::tls::scheme(tls));
        Ok(Self { address, url, tls: tls.cloned(), registry, session, shutdown, stop, task })
    }

    /// Serves `session` until the Shutdown RPC, Ctrl-C or SIGTERM, then stops its workers (and records
    /// the shutdown in the journal).
    pub async fn serve(&self, session: Session, token_file: &Path) {
        let signal = orchestrator_worker::grpc::shutdown_signal();
        let mut auth = format!("--coordinator {} --token-file {}", self.url, token_file.display());
        if let Some(t) = &self.tls {
            auth.push_str(&format!(" --tls-dir {}", t.dir.display()));
        }
        eprintln!("serving: `orchestrator report {auth}` re-runs the checks; `orchestrator shutdown {auth}` stops");
        *self.session.lock().await = Some(session);
        tokio::select! {
            _ = self.shutdown.notified() => {}
            _ = signal => {}
        }
        if let Some(session) = self.session.lock().await.take() {
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
