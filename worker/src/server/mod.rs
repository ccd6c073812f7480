//! `orchestrator-worker serve`: the worker as a gRPC server. It registers with the
//! coordinator, heartbeats, and serves the `Worker` service (assign, load with streamed
//! progress, report, probe with the TP all-reduce, reload, shutdown), plus grpc.health.v1 and
//! server reflection.
//!
//! - [`serve`] (here): the process: listeners, registration and heartbeats on a thread of their
//!   own, the server until shutdown.
//! - `service`: [`WorkerService`], the `Worker` RPCs as calls on a [`crate::rank::Rank`] (the
//!   rank's state and what it does, apart from the wire), run on blocking threads, with the
//!   readiness status and each `RankError` answered as its `Status`.

mod service;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::coordinator_client::CoordinatorClient;
use orchestrator_proto::v1::worker_server::WorkerServer;
use tokio::sync::Notify;

use crate::device::AnyBackend;
use crate::rank::Rank;
use orchestrator_model::AllowedRoots;
use orchestrator_net::auth::Token;

pub use service::WorkerService;

/// Deadline of every call the worker makes to the coordinator.
pub const RPC_DEADLINE: Duration = Duration::from_secs(5);

/// How a worker serves.
pub struct ServeConfig {
    /// Address to listen on (the TP-ring listener binds the same IP).
    pub listen: SocketAddr,
    /// The host peers and the coordinator reach this worker at (default: the listen address).
    pub advertise: Option<String>,
    /// Coordinator to register with and heartbeat to.
    pub coordinator: Option<String>,
    /// Which rank this is, where that came from, and the host's name.
    pub placement: crate::placement::Placement,
    /// How long to keep trying to reach a coordinator that is not up yet.
    pub join_timeout: Duration,
    /// With a token, every Worker RPC must carry it, and calls to the coordinator send it.
    pub token: Option<Token>,
    /// Only checkpoint directories under these are read.
    pub roots: AllowedRoots,
    /// Dumps an assignment asks for are written beneath this directory (held open) only.
    pub dump_root: Option<std::sync::Arc<crate::dump::DumpRoot>>,
    /// How long the worker keeps serving while its coordinator is unreachable (a restarted
    /// coordinator finds it again within this time); then it stops.
    pub coordinator_grace: Duration,
    /// Serve (and call the coordinator) over TLS with these files.
    pub tls: Option<orchestrator_net::tls::TlsFiles>,
    /// Also serve the health statuses in plaintext here (Kubernetes probes).
    pub health_listen: Option<SocketAddr>,
    /// Serve Prometheus metrics at `http://ADDR/metrics`.
    pub metrics_listen: Option<SocketAddr>,
}

/// Registers with the coordinator at `coord`, retrying while it cannot be reached (an engine
/// starts the coordinator and the workers together) for up to `join_timeout`; a refusal (wrong
/// rank, protocol, token) ends the attempt at once with the coordinator's reason.
async fn register(
    coord: &str,
    tls: Option<&orchestrator_net::tls::TlsFiles>,
    token: Option<&Token>,
    registration: &pb::RegisterRequest,
    join_timeout: Duration,
) -> anyhow::Result<CoordinatorClient<tonic::transport::Channel>> {
    let started = Instant::now();
    let mut said = false;
    loop {
        let last = match orchestrator_net::tls::connect(coord, tls).await {
            Ok(channel) => {
                let mut client = CoordinatorClient::new(channel);
                match client.register(orchestrator_net::auth::request(registration.clone(), RPC_DEADLINE, token)).await {
                    Ok(_) => return Ok(client),
                    Err(s) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
                        orchestrator_net::tls::describe_status(&s)
                    }
                    Err(s) => anyhow::bail!("registering rank {} with {coord}: refused: {}", registration.worker_id, s.message()),
                }
            }
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= join_timeout {
            anyhow::bail!(
                "registering rank {} with {coord}: not reachable for {:.0} s (--join-timeout): {last}",
                registration.worker_id,
                started.elapsed().as_secs_f64()
            );
        }
        if !said {
            tracing::info!(rank = registration.worker_id, "waiting for the coordinator at {coord}: {last}");
            said = true;
        }
        tokio::time::sleep(orchestrator_proto::limits::REGISTER_RETRY).await;
    }
}

/// Serves the worker until shut down (by RPC, by the coordinator going away, or by a signal).
pub async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    let ServeConfig {
        listen,
        advertise,
        coordinator,
        placement,
        join_timeout,
        token,
        roots,
        dump_root,
        coordinator_grace,
        tls,
        health_listen,
        metrics_listen,
    } = config;
    let shutdown = Arc::new(Notify::new());
    let signal = orchestrator_net::grpc::shutdown_signal();
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| anyhow::anyhow!("binding {listen}: {e}"))?;
    let address = listener.local_addr()?;
    let advertise = advertise.unwrap_or_else(|| address.ip().to_string());
    let (router, health) = orchestrator_net::grpc::standard_router::<WorkerServer<WorkerService>>(tls.as_ref()).await?;
    if let Some(h) = health_listen {
        let at = health.serve_plaintext(h).await?;
        tracing::info!(%at, "health (plaintext) listening");
    }
    if let Some(m) = metrics_listen {
        let at = orchestrator_ops::metrics::serve(m, Arc::new(|| crate::metrics::worker().render()))
            .await
            .map_err(|e| anyhow::anyhow!("--metrics-listen {m}: {e}"))?;
        tracing::info!(%at, "metrics listening at /metrics");
    }
    let rank = Rank::new(roots, AnyBackend::from_env()?, placement.host.clone())
        .with_ring_address(address.ip(), advertise.clone())
        .with_dump_root(dump_root);
    let service = WorkerService::serving(shutdown.clone(), rank).with_health(health);
    let device = service.device();
    let worker_id = placement.rank;
    let advertised =
        format!("{}://{}", orchestrator_net::tls::scheme(tls.as_ref()), crate::placement::join_host_port(&advertise, address.port()));
    tracing::info!(%address, %advertised, rank = worker_id, source = %placement.source, host = %placement.host, "worker serving");

    let mut registered = None;
    if let Some(coord) = coordinator.clone() {
        let me = orchestrator_ops::process::ProcessIdentity::of_self();
        let registration = pb::RegisterRequest {
            worker_id,
            address: advertised,
            host: placement.host.clone(),
            device,
            pid: std::process::id(),
            protocol_version: orchestrator_proto::PROTOCOL_VERSION,
            start_ticks: me.start_ticks,
            boot_id: me.boot_id,
            executable: me.executable.display().to_string(),
            world_size: placement.world_size.unwrap_or(0),
            rank_source: placement.source.name().into(),
            remote: placement.source != crate::placement::RankSource::Launch,
        };
        // Registration and heartbeats run on a runtime of their own, on their own thread: a
        // worker busy with loads and probes (whose state lock can be held for seconds) still
        // answers the question "are you alive" on time.
        let (registered_tx, registered_rx) = tokio::sync::oneshot::channel();
        let (token, tls, stop) = (token.clone(), tls.clone(), shutdown.clone());
        std::thread::Builder::new().name("heartbeats".into()).spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(r) => r,
                Err(e) => {
                    let _ = registered_tx.send(Err(anyhow::anyhow!("heartbeat runtime: {e}")));
                    return;
                }
            };
            runtime.block_on(async move {
                match register(&coord, tls.as_ref(), token.as_ref(), &registration, join_timeout).await {
                    Ok(client) => {
                        if registration.remote {
                            // One line for `kubectl logs` and Slurm's output (launched workers stay quiet).
                            eprintln!(
                                "orchestrator-worker: rank {} ({}) on host {} registered with {coord}; serving on {}",
                                registration.worker_id, registration.rank_source, registration.host, registration.address
                            );
                        }
                        let _ = registered_tx.send(Ok(()));
                        heartbeats(client, registration, token, coordinator_grace, stop).await;
                    }
                    Err(e) => {
                        let _ = registered_tx.send(Err(e));
                    }
                }
            });
        })?;
        registered = Some(registered_rx);
    }

    // The port answers from the start (health NOT_SERVING, liveness SERVING), also while the
    // worker waits for its coordinator.
    let incoming = orchestrator_net::grpc::incoming(listener);
    let server = tokio::spawn(
        router
            .add_service(tonic::service::interceptor::InterceptedService::new(
                WorkerServer::new(service).max_decoding_message_size(orchestrator_proto::limits::MAX_MESSAGE_BYTES),
                orchestrator_net::auth::interceptor(token.clone()),
            ))
            .serve_with_incoming_shutdown(incoming, async move {
                tokio::select! {
                    _ = shutdown.notified() => {}
                    _ = signal => {}
                }
            }),
    );
    let mut server = server;
    if let Some(registered) = registered {
        tokio::select! {
            outcome = registered => {
                if let Err(e) = outcome.unwrap_or_else(|_| Err(anyhow::anyhow!("the heartbeat thread ended before registering"))) {
                    server.abort();
                    return Err(e);
                }
            }
            // Stopped (a signal) while still waiting for the coordinator.
            ended = &mut server => return Ok(ended??),
        }
    }
    server.await??;
    Ok(())
}

/// Heartbeats to the coordinator every 500 ms. A coordinator that does not know this worker
/// (one restarted from its state directory) gets the registration again; one that stays
/// unreachable for `grace` ends this worker.
async fn heartbeats(
    mut client: CoordinatorClient<tonic::transport::Channel>,
    registration: pb::RegisterRequest,
    token: Option<Token>,
    grace: Duration,
    stop: Arc<Notify>,
) {
    let worker_id = registration.worker_id;
    let mut last_answer = Instant::now();
    let mut warned = false;
    loop {
        tokio::time::sleep(orchestrator_proto::limits::HEARTBEAT_INTERVAL).await;
        let req = orchestrator_net::auth::request(pb::HeartbeatRequest { worker_id }, Duration::from_secs(2), token.as_ref());
        let answered = match client.heartbeat(req).await {
            Ok(_) => true,
            Err(s) if s.code() == tonic::Code::NotFound => {
                let req = orchestrator_net::auth::request(registration.clone(), RPC_DEADLINE, token.as_ref());
                match client.register(req).await {
                    Ok(_) => {
                        tracing::info!(worker_id, "registered again with a restarted coordinator");
                        true
                    }
                    Err(e) => {
                        tracing::warn!(worker_id, "registering again: {}", e.message());
                        false
                    }
                }
            }
            Err(_) => false,
        };
        if answered {
            if warned {
                tracing::info!(worker_id, "coordinator reachable again");
            }
            last_answer = Instant::now();
            warned = false;
        } else if last_answer.elapsed() > grace {
            tracing::warn!(worker_id, "coordinator unreachable for {:.1} s: stopping", last_answer.elapsed().as_secs_f64());
            stop.notify_one();
            return;
        } else if !warned && last_answer.elapsed() > Duration::from_secs(2) {
            tracing::warn!(worker_id, "coordinator unreachable; serving on for up to {} s while it restarts", grace.as_secs());
            warned = true;
        }
    }
}

/// [`serve`] on its own runtime (the entry point of a worker process).
pub fn run(config: ServeConfig) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(serve(config))
}
