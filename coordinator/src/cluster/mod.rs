//! The cluster as the coordinator runs it: worker processes started next to this binary (as
//! TGI's launcher starts its shards), their registrations and heartbeats, and the operations
//! fanned out to every rank (assign, load, probe, report, shutdown) under a watchdog that turns
//! a worker that exits or stops answering into a failure named by rank within seconds.
//!
//! - here: the cluster (its workers, registry, token, group locks and ring epochs), how it
//!   starts, adopts or finds its workers, their health, and the fan-out of a call to its ranks;
//! - `calls`: each operation on the ranks (assign, load, probe, report, stage, commit, abort,
//!   release, shutdown, readiness) as a fan-out with typed per-rank results;
//! - `process`: a worker's process (started, adopted or remote), the worker command, its
//!   threads and GPUs;
//! - `rank_error`: why a rank has no answer.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use orchestrator_net::auth::Token;
use orchestrator_net::tls::TlsFiles;
use orchestrator_proto::limits;
use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::worker_client::WorkerClient;
use tokio::process::Command;
use tonic::transport::Channel;

/// A worker that misses heartbeats this long has stopped answering.
pub const HEARTBEAT_TIMEOUT: Duration = limits::HEARTBEAT_TIMEOUT;
/// Deadlines of the calls to workers.
pub const ASSIGN_DEADLINE: Duration = Duration::from_secs(60);
pub const LOAD_DEADLINE: Duration = Duration::from_secs(1800);
pub const PROBE_DEADLINE: Duration = Duration::from_secs(1800);
pub const REPORT_DEADLINE: Duration = Duration::from_secs(300);
pub const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);
pub const READINESS_DEADLINE: Duration = Duration::from_secs(1);

pub use crate::registry::{Registration, Registry};

/// One rank's worker process.
pub struct WorkerHandle {
    pub id: u32,
    pub dp: u32,
    pub tp: u32,
    pub process: WorkerProcess,
    pub client: Option<WorkerClient<Channel>>,
    pub collective: String,
    /// GPU workers: the NCCL unique id a group's rank 0 created at Assign (empty otherwise).
    pub nccl_unique_id: Vec<u8>,
}

impl WorkerHandle {
    pub fn label(&self) -> String {
        format!("rank dp{}/tp{} (worker {})", self.dp, self.tp, self.id)
    }
}

/// The running cluster.
pub struct Cluster {
    pub tp: u32,
    pub dp: u32,
    pub workers: Vec<WorkerHandle>,
    pub registry: Arc<Registry>,
    /// The cluster's shared secret, sent with every call.
    pub token: Token,
    /// One lock per TP group (replica): calls that use the group's ring (probes) or change its
    /// version (staging, commit) hold it, so they never interleave.
    pub group_locks: Vec<tokio::sync::Mutex<()>>,
    /// The cluster's TLS files, when the control plane runs over TLS.
    pub tls: Option<TlsFiles>,
    /// Each TP group's ring epoch: bumped after any failed probe of the group, so the next
    /// probe's ranks build a new ring instead of reusing a broken one.
    pub ring_epochs: Vec<AtomicU32>,
}

/// Where the workers of a cluster run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerDevice {
    Cpu,
    /// One GPU per worker.
    Cuda,
}

mod calls;
mod process;
mod rank_error;

pub use process::WorkerProcess;
use process::{RAYON_THREADS_ENV, gpu_list, threads_per_worker, worker_command};
pub use rank_error::{RankDown, RankError};

/// A failure named by rank.
pub type Failures = Vec<(u32, RankError)>;

/// Each rank's answer (or why it has none), by worker id.
pub type RankResults<T> = BTreeMap<u32, Result<T, RankError>>;

/// How the workers a launch starts authenticate, what they may read and where they may write.
pub struct WorkerAccess<'a> {
    pub token: Token,
    /// The file holding `token`, which each worker reads.
    pub token_file: &'a Path,
    /// Checkpoints are read only under these.
    pub allow_roots: &'a [PathBuf],
    /// Dumps are written only under this (`launch --dump`).
    pub dump_root: Option<&'a Path>,
    pub tls: Option<TlsFiles>,
}

impl Cluster {
    /// Starts `tp * dp` worker processes on `device` that register with `coordinator`,
    /// with `access` (token, checkpoint roots, dump root, TLS), and keep serving for `grace`
    /// while the coordinator is unreachable. GPU workers get
    /// `ORCHESTRATOR_DEVICE=cuda` and one GPU each through `CUDA_VISIBLE_DEVICES` (worker `i`
    /// gets GPU `i mod gpus`, `gpus` from the launcher's own `CUDA_VISIBLE_DEVICES` list, or
    /// `ORCHESTRATOR_GPUS`, or the GPUs it sees). Each worker's thread pool gets an equal share
    /// of this host's cores among a replica's ranks ([`threads_per_worker`]) unless
    /// `RAYON_NUM_THREADS` is set.
    pub fn spawn(
        device: WorkerDevice,
        tp: u32,
        dp: u32,
        coordinator: &str,
        registry: Arc<Registry>,
        access: WorkerAccess<'_>,
        grace: Duration,
    ) -> anyhow::Result<Self> {
        let WorkerAccess { token, token_file, allow_roots, dump_root, tls } = access;
        let (bin, leading) = worker_command()?;
        let gpus = gpu_list()?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = threads_per_worker(cores, tp, std::env::var_os(RAYON_THREADS_ENV).as_deref());
        let mut workers = Vec::new();
        for id in 0..tp * dp {
            let mut command = Command::new(&bin);
            if device == WorkerDevice::Cuda {
                command.env(orchestrator_worker::device::DEVICE_ENV, "cuda").env("CUDA_VISIBLE_DEVICES", &gpus[id as usize % gpus.len()]);
            }
            if let Some(threads) = threads {
                command.env(RAYON_THREADS_ENV, threads.to_string());
            }
            let child = command
                .args(&leading)
                .args(["--coordinator", coordinator, "--worker-id", &id.to_string()])
                .arg("--token-file")
                .arg(token_file)
                .args(allow_roots.iter().flat_map(|r| [std::ffi::OsStr::new("--allow-root"), r.as_os_str()]))
                .args(dump_root.iter().flat_map(|d| [std::ffi::OsStr::new("--dump-root"), d.as_os_str()]))
                .args(["--coordinator-grace", &grace.as_secs_f64().to_string()])
                .args(tls.iter().flat_map(|t| [std::ffi::OsStr::new("--tls-dir"), t.dir.as_os_str()]))
                .env(orchestrator_ops::logging::LOG_FORMAT_ENV, orchestrator_ops::logging::current().name())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| anyhow::anyhow!("starting {}: {e}", bin.display()))?;
            workers.push(WorkerHandle {
                id,
                dp: id / tp,
                tp: id % tp,
                process: WorkerProcess::Child(Box::new(tokio::sync::Mutex::new(child))),
                client: None,
                collective: String::new(),
                nccl_unique_id: Vec::new(),
            });
        }
        Ok(Self::of(tp, dp, workers, registry, token, tls, 0))
    }

    /// The cluster of `tp * dp` workers that engines or users start and that register by rank
    /// (see [`Cluster::connect_all`] for waiting on them).
    pub fn remote(tp: u32, dp: u32, registry: Arc<Registry>, token: Token, tls: Option<TlsFiles>) -> Self {
        let workers = (0..tp * dp)
            .map(|id| WorkerHandle {
                id,
                dp: id / tp,
                tp: id % tp,
                process: WorkerProcess::Remote,
                client: None,
                collective: String::new(),
                nccl_unique_id: Vec::new(),
            })
            .collect();
        Self::of(tp, dp, workers, registry, token, tls, 0)
    }

    /// A cluster of `workers`, one group lock per replica, every ring starting at `epoch`.
    fn of(tp: u32, dp: u32, workers: Vec<WorkerHandle>, registry: Arc<Registry>, token: Token, tls: Option<TlsFiles>, epoch: u32) -> Self {
        let group_locks = (0..dp).map(|_| tokio::sync::Mutex::new(())).collect();
        let ring_epochs = (0..dp).map(|_| AtomicU32::new(epoch)).collect();
        Self { tp, dp, workers, registry, token, group_locks, tls, ring_epochs }
    }

    /// Takes over the workers a previous coordinator started (from its journal): registers
    /// them as just heard from, and connects to each.
    pub async fn adopt(
        tp: u32,
        dp: u32,
        records: &[crate::journal::WorkerRecord],
        registry: Arc<Registry>,
        token: Token,
        tls: Option<TlsFiles>,
    ) -> Result<Self, Failures> {
        let mut workers = Vec::new();
        for r in records {
            let identity = r.identity();
            registry.register(
                r.id,
                Registration {
                    address: r.address.clone(),
                    host: r.host.clone(),
                    device: String::new(),
                    process: identity.clone(),
                    last_heartbeat: Instant::now(),
                    rank_source: String::new(),
                },
            );
            workers.push(WorkerHandle {
                id: r.id,
                dp: r.dp,
                tp: r.tp,
                process: if r.remote { WorkerProcess::Remote } else { WorkerProcess::Adopted { identity } },
                client: None,
                collective: r.collective.clone(),
                nccl_unique_id: crate::journal::from_hex(&r.nccl_unique_id).unwrap_or_default(),
            });
        }
        // A new coordinator starts every ring on an epoch the old one cannot have used (it counted
        // up from 0 by failures; this one starts from the clock), as the rings the old one built
        // may have broken meanwhile.
        let base = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_secs() as u32).max(1);
        registry.assembled();
        let mut cluster = Self::of(tp, dp, workers, registry, token, tls, base);
        // Lazily: a worker that died meanwhile fails its calls (and is named), it does not stop
        // the others from being adopted.
        cluster.connect_registered(true).await?;
        Ok(cluster)
    }

    /// What the journal records about each worker.
    pub fn records(&self) -> Vec<crate::journal::WorkerRecord> {
        self.workers
            .iter()
            .map(|w| {
                let reg = self.registry.get(w.id);
                let process = reg.as_ref().map(|r| r.process.clone()).unwrap_or_default();
                crate::journal::WorkerRecord {
                    id: w.id,
                    dp: w.dp,
                    tp: w.tp,
                    address: reg.as_ref().map(|r| r.address.clone()).unwrap_or_default(),
                    pid: process.pid,
                    start_ticks: process.start_ticks,
                    boot_id: process.boot_id,
                    executable: process.executable,
                    collective: w.collective.clone(),
                    nccl_unique_id: crate::journal::to_hex(&w.nccl_unique_id),
                    remote: matches!(w.process, WorkerProcess::Remote),
                    host: reg.as_ref().map(|r| r.host.clone()).unwrap_or_default(),
                }
            })
            .collect()
    }

    /// Whether a rank is down: `None` while it runs and heartbeats; else whether it is dead
    /// (its process is gone) and why.
    pub async fn health(&self, w: &WorkerHandle) -> crate::rollout::RankHealth {
        if let Some(how) = w.process.exited().await {
            return Some(RankDown::Exited { rank: w.label(), how });
        }
        let r = self.registry.get(w.id)?;
        let silent = r.last_heartbeat.elapsed();
        // A worker on another host cannot be watched exited: one silent this long is presumed
        // dead (its own coordinator grace has long ended it, if it still runs).
        let presumed_dead = matches!(w.process, WorkerProcess::Remote) && silent > limits::REMOTE_PRESUMED_DEAD;
        (silent > HEARTBEAT_TIMEOUT).then(|| RankDown::Silent {
            rank: w.label(),
            pid: r.process.pid,
            host: r.host,
            device: r.device,
            silent_s: silent.as_secs_f64(),
            presumed_dead,
        })
    }

    /// The ranks of replica `dp` that are down, each with whether it is dead and why.
    pub async fn down_in(&self, dp: u32) -> Vec<crate::rollout::RankHealth> {
        let mut out = Vec::new();
        for w in self.workers.iter().filter(|w| w.dp == dp) {
            out.push(self.health(w).await);
        }
        out
    }

    /// Resolves once rank `w` is down (checked every 100 ms), with why; never while it is up.
    async fn rank_down(&self, w: &WorkerHandle) -> RankDown {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let Some(down) = self.health(w).await {
                return down;
            }
        }
    }

    /// Waits until every worker registered (or one exits, or the deadline passes), then
    /// connects to each.
    pub async fn connect_all(&mut self, deadline: Duration) -> Result<(), Failures> {
        let start = Instant::now();
        loop {
            let missing: Vec<u32> = self.workers.iter().filter(|w| self.registry.get(w.id).is_none()).map(|w| w.id).collect();
            if missing.is_empty() {
                break;
            }
            for w in &self.workers {
                if let Some(how) = w.process.exited().await {
                    return Err(vec![(w.id, RankError::ExitedBeforeRegistering { rank: w.label(), how })]);
                }
            }
            if start.elapsed() > deadline {
                let joined: Vec<String> =
                    self.registry.by_host(self.tp * self.dp).into_iter().map(|(host, ranks)| format!("{host}: ranks {ranks:?}")).collect();
                let joined = if joined.is_empty() { "no host joined".to_string() } else { format!("joined: {}", joined.join("; ")) };
                return Err(missing
                    .into_iter()
                    .map(|id| {
                        let (dp, tp) = (id / self.tp, id % self.tp);
                        (id, RankError::NotRegistered { id, dp, tp, within_s: deadline.as_secs(), joined: joined.clone() })
                    })
                    .collect());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.registry.assembled();
        self.connect_registered(false).await
    }

    /// Connects to every registered worker (`lazy`: on first use).
    async fn connect_registered(&mut self, lazy: bool) -> Result<(), Failures> {
        for w in &mut self.workers {
            let reg = self.registry.get(w.id).ok_or_else(|| vec![(w.id, RankError::Unregistered { rank: w.label() })])?;
            let endpoint = orchestrator_net::tls::endpoint(&reg.address, self.tls.as_ref())
                .map_err(|e| vec![(w.id, RankError::Connect { rank: w.label(), address: None, message: e.to_string() })])?;
            let channel = if lazy {
                endpoint.connect_lazy()
            } else {
                endpoint.connect().await.map_err(|e| {
                    vec![(w.id, RankError::Connect { rank: w.label(), address: Some(reg.address.clone()), message: e.to_string() })]
                })?
            };
            w.client = Some(WorkerClient::new(channel).max_decoding_message_size(orchestrator_proto::limits::MAX_RESPONSE_BYTES));
        }
        Ok(())
    }

    /// Calls `op` on every worker concurrently; results by worker id. Each rank's call is cut
    /// short when that rank goes down (exits or stops heartbeating), so one failed rank fails
    /// only its own call (and whatever its peers' calls depend on it), never the others'.
    pub async fn fan_out<T, F, Fut>(&self, op: F) -> RankResults<T>
    where
        F: Fn(&WorkerHandle, WorkerClient<Channel>) -> Fut,
        Fut: Future<Output = Result<T, RankError>>,
    {
        self.fan_out_in(None, op).await
    }

    /// [`Cluster::fan_out`] on the ranks of one replica (`Some(dp)`) or of all.
    pub async fn fan_out_in<T, F, Fut>(&self, group: Option<u32>, op: F) -> RankResults<T>
    where
        F: Fn(&WorkerHandle, WorkerClient<Channel>) -> Fut,
        Fut: Future<Output = Result<T, RankError>>,
    {
        self.fan_out_where(|w| group.is_none_or(|g| w.dp == g), op).await
    }

    /// [`Cluster::fan_out`] on the ranks `which` picks.
    pub async fn fan_out_where<T, F, Fut>(&self, which: impl Fn(&WorkerHandle) -> bool, op: F) -> RankResults<T>
    where
        F: Fn(&WorkerHandle, WorkerClient<Channel>) -> Fut,
        Fut: Future<Output = Result<T, RankError>>,
    {
        let calls = self.workers.iter().filter(|w| which(w)).map(|w| {
            let call = w.client.clone().map(|client| op(w, client));
            async move {
                let result = match call {
                    None => Err(RankError::NotConnected { rank: w.label() }),
                    Some(call) => tokio::select! {
                        r = call => r,
                        down = self.rank_down(w) => Err(down.into()),
                    },
                };
                (w.id, result)
            }
        });
        futures_util::future::join_all(calls).await.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consistency::failed_row;
    use crate::registry::Registration;
    use orchestrator_ops::process::ProcessIdentity;

    /// A failed row names where its rank runs once: from the registry, unless its failure says
    /// so already (a silent rank's).
    #[test]
    fn a_failed_row_names_its_host_once() {
        let dir = tempfile::tempdir().unwrap();
        let token = Token::generate(&dir.path().join("token")).unwrap();
        let registry = Arc::new(Registry::for_world(2));
        for id in 0..2 {
            registry.register(
                id,
                Registration {
                    address: format!("10.0.0.{id}:7000"),
                    host: format!("n{id}"),
                    device: "cpu".into(),
                    process: ProcessIdentity { pid: 40 + id, start_ticks: 1, boot_id: "b".into(), executable: "/bin/w".into() },
                    last_heartbeat: Instant::now(),
                    rank_source: "launch".into(),
                },
            );
        }
        let cluster = Cluster::remote(2, 1, registry, token, None);
        let refused = RankError::call(cluster.workers[0].label(), "report", &tonic::Status::internal("boom"));
        let silent = RankError::from(RankDown::Silent {
            rank: cluster.workers[1].label(),
            pid: 41,
            host: "n1".into(),
            device: "cpu".into(),
            silent_s: 5.0,
            presumed_dead: false,
        });
        let mut rows = vec![failed_row(0, 0, 0, &refused), failed_row(1, 0, 1, &silent)];
        cluster.annotate(&mut rows);
        assert_eq!(rows[0].failure.as_deref(), Some("rank dp0/tp0 (worker 0): report: boom [on host n0, pid 40, 10.0.0.0:7000]"));
        assert_eq!(rows[1].failure, Some(silent.to_string()));
        assert_eq!((rows[1].host.as_str(), rows[1].pid), ("n1", 41));
    }

    #[test]
    fn a_replicas_ranks_share_the_hosts_cores_unless_the_user_sized_their_pools() {
        // An equal share of the cores among a replica's TP ranks, at least one thread each.
        assert_eq!(threads_per_worker(2, 4, None), Some(1));
        assert_eq!(threads_per_worker(2, 2, None), Some(1));
        assert_eq!(threads_per_worker(2, 1, None), Some(2));
        assert_eq!(threads_per_worker(64, 8, None), Some(8));
        assert_eq!(threads_per_worker(64, 6, None), Some(10));
        assert_eq!(threads_per_worker(1, 0, None), Some(1));
        // The user's own RAYON_NUM_THREADS (even empty, which rayon reads as its default) is
        // what the workers inherit.
        assert_eq!(threads_per_worker(64, 8, Some(std::ffi::OsStr::new("3"))), None);
        assert_eq!(threads_per_worker(64, 8, Some(std::ffi::OsStr::new(""))), None);
    }
}
