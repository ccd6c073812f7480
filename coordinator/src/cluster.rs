//! The cluster as the coordinator runs it: worker processes started next to this binary (as
//! TGI's launcher starts its shards), their registrations and heartbeats, and the operations
//! fanned out to every rank (assign, load, probe, report, shutdown) under a watchdog that turns
//! a worker that exits or stops answering into a failure named by rank within seconds.

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
use orchestrator_ops::process::ProcessIdentity;
use orchestrator_proto::limits;
use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::worker_client::WorkerClient;
use tokio::process::{Child, Command};
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

/// A worker's process: a child this coordinator started, one a previous coordinator started
/// and this one adopted from the state directory (known by its recorded identity only, and
/// signalled only after proving it is still that process), or one an engine (Slurm,
/// Kubernetes) or a user started, possibly on another host: known by its heartbeats only,
/// asked to stop over gRPC and never signalled.
pub enum WorkerProcess {
    Child(Box<tokio::sync::Mutex<Child>>),
    Adopted { identity: ProcessIdentity },
    Remote,
}

impl WorkerProcess {
    /// How the process ended, or `None` while it runs.
    pub async fn exited(&self) -> Option<String> {
        match self {
            Self::Child(child) => match child.lock().await.try_wait() {
                Ok(None) => None,
                Ok(Some(status)) => Some(format!("exited ({status})")),
                Err(e) => Some(format!("cannot be waited on: {e}")),
            },
            Self::Adopted { identity } => (!identity.alive()).then(|| format!("exited (pid {} is gone)", identity.pid)),
            Self::Remote => None,
        }
    }

    /// Waits up to `limit` for the process to end, then kills it (an adopted one only when it
    /// is provably still the worker the journal names).
    pub async fn stop_within(&self, limit: Duration) {
        match self {
            Self::Child(child) => {
                let mut child = child.lock().await;
                if tokio::time::timeout(limit, child.wait()).await.is_err() {
                    let _ = child.kill().await;
                }
            }
            Self::Adopted { identity } => {
                let start = Instant::now();
                while identity.alive() && start.elapsed() < limit {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                kill_adopted(identity);
            }
            Self::Remote => {}
        }
    }

    pub async fn kill(&self) {
        match self {
            Self::Child(child) => {
                let _ = child.lock().await.kill().await;
            }
            Self::Adopted { identity } => kill_adopted(identity),
            // Not ours to signal: [`Cluster::kill_all`] asks it to stop.
            Self::Remote => {}
        }
    }
}

/// SIGKILL to an adopted worker, through a pidfd, only after its identity checked out.
fn kill_adopted(identity: &ProcessIdentity) {
    if !identity.alive() {
        return;
    }
    if let Err(e) = identity.kill() {
        tracing::warn!("not signalling adopted worker: {e}");
        eprintln!("warning: not signalling pid {}: {e}", identity.pid);
    }
}

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

/// The GPUs workers are spread over: the launcher's `CUDA_VISIBLE_DEVICES` entries, or
/// `0..ORCHESTRATOR_GPUS`, or every GPU this process sees (at least one).
fn gpu_list() -> Vec<String> {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        let list: Vec<String> = v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
        if !list.is_empty() {
            return list;
        }
    }
    let n = std::env::var("ORCHESTRATOR_GPUS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or_else(visible_gpus);
    (0..n).map(|i| i.to_string()).collect()
}

/// The GPUs this process sees (one where it sees none, or in a build without the `cuda`
/// feature, whose dummy CUDA module counts none).
fn visible_gpus() -> usize {
    orchestrator_kernels::cuda::CudaBackend::device_count().max(1)
}

mod rank_error;

pub use rank_error::{RankDown, RankError};

/// A failure named by rank.
pub type Failures = Vec<(u32, RankError)>;

/// Each rank's answer (or why it has none), by worker id.
pub type RankResults<T> = BTreeMap<u32, Result<T, RankError>>;

/// The worker command: the `orchestrator-worker` binary next to this executable (as TGI's
/// launcher finds its shards), or, when it is not there (`cargo run --bin orchestrator` builds
/// only this binary), this executable's own built-in worker.
fn worker_command() -> anyhow::Result<(PathBuf, Vec<String>)> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().ok_or_else(|| anyhow::anyhow!("{} has no parent directory", exe.display()))?;
    let path = dir.join(format!("orchestrator-worker{}", std::env::consts::EXE_SUFFIX));
    if path.exists() { Ok((path, vec!["serve".into()])) } else { Ok((exe, vec!["worker-serve".into()])) }
}

/// The variable that sizes a worker's thread pool (rayon's own).
const RAYON_THREADS_ENV: &str = "RAYON_NUM_THREADS";

/// The threads of each worker's pool where the `tp` ranks of a replica share this host's
/// `cores`: an equal share, at least one, so that a probe's ranks, which compute together, run
/// one thread per core between them rather than each one per core (they ran twice as many
/// threads as cores on the 2-core VM at TP 2, and each parallel pass waited on threads that the
/// other rank's had preempted: `bench update`, TP 2 x DP 2, probe capacity 27.9-29.8 ->
/// 29.4-31.2 per s, 2 interleaved runs each; the update within its spread). Replicas are not
/// counted: they serve different probes, and one probed while the others idle keeps every core
/// (torchrun sets `OMP_NUM_THREADS=1` per rank for the same reason). None where the user set
/// the variable (`inherited`): the workers inherit theirs. The background pool (staging, below
/// serving) keeps a thread per core: it runs only on cycles that serving leaves idle.
fn threads_per_worker(cores: usize, tp: u32, inherited: Option<&std::ffi::OsStr>) -> Option<usize> {
    match inherited {
        Some(_) => None,
        None => Some((cores / tp.max(1) as usize).max(1)),
    }
}

impl Cluster {
    /// Starts `tp * dp` worker processes on `device` that register with `coordinator`,
    /// authenticate with the token in `token_file`, read checkpoints only under `allow_roots`,
    /// and keep serving for `grace` while the coordinator is unreachable. GPU workers get
    /// `ORCHESTRATOR_DEVICE=cuda` and one GPU each through `CUDA_VISIBLE_DEVICES` (worker `i`
    /// gets GPU `i mod gpus`, `gpus` from the launcher's own `CUDA_VISIBLE_DEVICES` list, or
    /// `ORCHESTRATOR_GPUS`, or the GPUs it sees). Each worker's thread pool gets an equal share
    /// of this host's cores among a replica's ranks ([`threads_per_worker`]) unless
    /// `RAYON_NUM_THREADS` is set.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn(
        device: WorkerDevice,
        tp: u32,
        dp: u32,
        coordinator: &str,
        registry: Arc<Registry>,
        token: Token,
        token_file: &Path,
        allow_roots: &[PathBuf],
        grace: Duration,
        tls: Option<TlsFiles>,
    ) -> anyhow::Result<Self> {
        let (bin, leading) = worker_command()?;
        let gpus = gpu_list();
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

    /// Assigns `(dp, tp)` shards; records each rank's collective address.
    pub async fn assign(
        &mut self,
        source: &pb::LoadSource,
        scale_rule: &str,
        fault: Option<(u32, pb::Fault)>,
        dump_dir: Option<&std::path::Path>,
        keep_staging_buffers: bool,
    ) -> Result<(), Failures> {
        let dump_dir = dump_dir.map(|d| d.display().to_string()).unwrap_or_default();
        let (tp, dp) = (self.tp, self.dp);
        let results = self
            .fan_out(|w, mut client| {
                let req = orchestrator_net::auth::request(
                    pb::AssignRequest {
                        tp_size: tp,
                        tp_rank: w.tp,
                        dp_size: dp,
                        dp_rank: w.dp,
                        source: Some(source.clone()),
                        scale_rule: scale_rule.to_string(),
                        fault: fault.filter(|(rank, _)| *rank == w.id).map(|(_, f)| f as i32).unwrap_or(0),
                        dump_dir: dump_dir.clone(),
                        keep_staging_buffers,
                    },
                    ASSIGN_DEADLINE,
                    Some(&self.token),
                );
                let label = w.label();
                async move { client.assign(req).await.map(|r| r.into_inner()).map_err(|s| RankError::call(label, "assign", &s)) }
            })
            .await;
        let mut failures = Vec::new();
        for w in &mut self.workers {
            match results.get(&w.id) {
                Some(Ok(assigned)) => {
                    w.collective = assigned.collective_address.clone();
                    w.nccl_unique_id = assigned.nccl_unique_id.clone();
                }
                Some(Err(e)) => failures.push((w.id, e.clone())),
                None => failures.push((w.id, RankError::Incomplete { rank: w.label(), what: "assign did not complete" })),
            }
        }
        if failures.is_empty() { Ok(()) } else { Err(failures) }
    }

    /// Loads every rank in parallel, showing progress on stderr (a bar per rank on a terminal,
    /// a line per finished rank otherwise, an event per finished rank with `--log-format
    /// json`); load seconds by worker.
    pub async fn load(&self) -> RankResults<f64> {
        use orchestrator_ops::logging::{LogFormat, current};
        let json = current() == LogFormat::Json;
        let bars = (!json && std::io::stderr().is_terminal()).then(|| {
            let multi = indicatif::MultiProgress::new();
            let style = indicatif::ProgressStyle::with_template("{prefix:>9} [{bar:30}] {pos}/{len} layers {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> ");
            let bars: BTreeMap<u32, indicatif::ProgressBar> = self
                .workers
                .iter()
                .map(|w| {
                    let bar =
                        multi.add(indicatif::ProgressBar::new(0).with_style(style.clone()).with_prefix(format!("dp{}/tp{}", w.dp, w.tp)));
                    (w.id, bar)
                })
                .collect();
            (multi, bars)
        });
        let ranks: BTreeMap<u32, (u32, u32)> = self.workers.iter().map(|w| (w.id, (w.dp, w.tp))).collect();
        let show = move |id: u32, done: u32, total: u32, finished: Option<f64>| {
            let (dp, tp) = ranks[&id];
            match (&bars, finished) {
                (Some((_, bars)), _) => {
                    let bar = &bars[&id];
                    bar.set_length(total as u64);
                    bar.set_position(done as u64);
                    if let Some(s) = finished {
                        bar.finish_with_message(format!("{s:.2} s"));
                    }
                }
                (None, Some(s)) if json => tracing::info!(replica = dp, tp_rank = tp, layers = done, seconds = s, "rank loaded"),
                (None, Some(s)) => eprintln!("loaded rank dp{dp}/tp{tp} ({done} layers) in {s:.2} s"),
                (None, None) => {}
            }
        };
        let show = Arc::new(show);
        self.fan_out(|w, mut client| {
            let label = w.label();
            let id = w.id;
            let show = show.clone();
            let token = self.token.clone();
            async move {
                let req = orchestrator_net::auth::request(pb::LoadRequest {}, LOAD_DEADLINE, Some(&token));
                let mut stream = client.load(req).await.map_err(|s| RankError::call(label.clone(), "load", &s))?.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(p)) => {
                            show(id, p.layers_done, p.layers_total, p.finished.then_some(p.load_seconds));
                            if p.finished {
                                return Ok(p.load_seconds);
                            }
                        }
                        Ok(None) => return Err(RankError::Incomplete { rank: label, what: "load stream ended before the load finished" }),
                        Err(s) => return Err(RankError::call(label, "load", &s)),
                    }
                }
            }
        })
        .await
    }

    /// Runs the probe on the ranks of one replica (or all), on their active or staged weights.
    /// Each TP group all-reduces over its ring of the group's current epoch while holding its
    /// group lock (groups are probed concurrently, each under its own lock, so a probe of one
    /// replica never waits for another's); a group any of whose ranks failed gets a new ring
    /// epoch for its next probe.
    pub async fn probe_in(
        &self,
        group: Option<u32>,
        probe: (u32, u32, u64),
        shadow: bool,
        skip_reference: bool,
    ) -> RankResults<pb::ProbeResult> {
        self.probe_phase(group, probe, shadow, skip_reference, pb::ProbePhase::Whole, false).await
    }

    /// The probe of replica `dp` right after its commit, answered by each rank from the
    /// verification probe it kept of the staged weights it committed (see `kept` in the proto):
    /// nothing computed, no ring, no group lock. A rank that kept none refuses, at once.
    pub async fn probe_kept(&self, dp: u32, probe: (u32, u32, u64), skip_reference: bool) -> RankResults<pb::ProbeResult> {
        self.probe_phase(Some(dp), probe, false, skip_reference, pb::ProbePhase::Whole, true).await
    }

    /// The verification probe of what replica `dp` staged, in its two halves: every rank runs
    /// its passes below serving without the ring (and without the group lock), then the group
    /// all-reduces what they computed under its lock, held for that alone. The replica keeps
    /// serving meanwhile, and its routed probes never wait for a verification that computes
    /// below their priority.
    pub async fn probe_staged(&self, dp: u32, probe: (u32, u32, u64), skip_reference: bool) -> RankResults<pb::ProbeResult> {
        let computed = self.probe_phase(Some(dp), probe, true, skip_reference, pb::ProbePhase::Compute, false).await;
        if computed.values().any(Result::is_err) {
            return computed;
        }
        self.probe_phase(Some(dp), probe, true, skip_reference, pb::ProbePhase::Reduce, false).await
    }

    /// One phase of a probe on each group: a whole probe or a reduce holds the group lock and
    /// uses the ring of its epoch; a compute, or a kept probe, needs neither (the ring fields go
    /// unused).
    async fn probe_phase(
        &self,
        group: Option<u32>,
        (tokens, latents, seed): (u32, u32, u64),
        shadow: bool,
        skip_reference: bool,
        phase: pb::ProbePhase,
        kept: bool,
    ) -> RankResults<pb::ProbeResult> {
        let groups: Vec<u32> = (0..self.dp).filter(|dp| group.is_none_or(|g| g == *dp)).collect();
        let ring = phase != pb::ProbePhase::Compute && !kept;
        let per_group = groups.into_iter().map(|dp| async move {
            let _guard = if ring { Some(self.group_locks[dp as usize].lock().await) } else { None };
            let peers: Vec<String> = self.workers.iter().filter(|w| w.dp == dp).map(|w| w.collective.clone()).collect();
            // GPU groups: the NCCL unique id their rank 0 created, relayed to every rank.
            let nccl = self.workers.iter().find(|w| w.dp == dp && w.tp == 0).map(|w| w.nccl_unique_id.clone()).unwrap_or_default();
            let epoch = self.ring_epochs[dp as usize].load(Ordering::SeqCst);
            let results = self
                .fan_out_in(Some(dp), |w, mut client| {
                    let req = orchestrator_net::auth::request(
                        pb::ProbeRequest {
                            tokens,
                            latents,
                            seed,
                            group: u64::from(w.dp),
                            peers: peers.clone(),
                            timeout_ms: limits::RING_TIMEOUT.as_millis() as u32,
                            shadow,
                            skip_reference,
                            nccl_unique_id: nccl.clone(),
                            ring_epoch: epoch,
                            phase: phase.into(),
                            kept,
                        },
                        PROBE_DEADLINE,
                        Some(&self.token),
                    );
                    let label = w.label();
                    async move { client.probe(req).await.map(|r| r.into_inner()).map_err(|s| RankError::call(label, "probe", &s)) }
                })
                .await;
            if ring && results.values().any(Result::is_err) {
                // The ring may be broken on some ranks: the next probe starts a new epoch.
                let _ = self.ring_epochs[dp as usize].compare_exchange(epoch, epoch.wrapping_add(1), Ordering::SeqCst, Ordering::SeqCst);
            }
            results
        });
        futures_util::future::join_all(per_group).await.into_iter().flatten().collect()
    }

    /// Probes every replica of `plan` on its active weights, concurrently: a replica mapped to
    /// `None` checks against the reference, one mapped to another replica runs only its
    /// kernel pass ([`crate::consistency::reference_plan`]).
    pub async fn probe_planned(&self, probe: (u32, u32, u64), plan: &BTreeMap<u32, Option<u32>>) -> RankResults<pb::ProbeResult> {
        let groups = plan.iter().map(|(&dp, by)| self.probe_in(Some(dp), probe, false, by.is_some()));
        futures_util::future::join_all(groups).await.into_iter().flatten().collect()
    }

    /// Every rank's report.
    pub async fn reports(&self) -> RankResults<pb::RankReport> {
        self.reports_in(None, false).await
    }

    /// Every rank's report on its active weights, the ranks of the `swapped` replicas each with
    /// the round trip of the stage their weights were committed from, while they still hold
    /// that generation (the report an update answers with: see `kept_round_trip` in the proto).
    pub async fn reports_after_update(&self, swapped: &[u32]) -> RankResults<pb::RankReport> {
        let groups = (0..self.dp).map(|dp| self.reports_with(Some(dp), false, swapped.contains(&dp)));
        futures_util::future::join_all(groups).await.into_iter().flatten().collect()
    }

    /// The reports of one replica's ranks (or all), on their active or staged weights.
    pub async fn reports_in(&self, group: Option<u32>, shadow: bool) -> RankResults<pb::RankReport> {
        self.reports_with(group, shadow, false).await
    }

    async fn reports_with(&self, group: Option<u32>, shadow: bool, kept_round_trip: bool) -> RankResults<pb::RankReport> {
        self.reports_of(group, shadow, kept_round_trip, |_| None).await
    }

    /// Reports on what replica `dp` staged, whose stage deferred its round trip: each rank
    /// adopts the verdict of the rank `proof` names for its tp_rank when its own digests equal
    /// that rank's (and runs its own when they differ or none is named).
    pub async fn staged_reports_identical_to(
        &self,
        dp: u32,
        proof: impl Fn(u32) -> Option<pb::RoundTripProof>,
    ) -> RankResults<pb::RankReport> {
        self.reports_of(Some(dp), true, false, proof).await
    }

    async fn reports_of(
        &self,
        group: Option<u32>,
        shadow: bool,
        kept_round_trip: bool,
        proof: impl Fn(u32) -> Option<pb::RoundTripProof>,
    ) -> RankResults<pb::RankReport> {
        self.fan_out_in(group, |w, mut client| {
            let req = orchestrator_net::auth::request(
                pb::ReportRequest { shadow, brief: false, kept_round_trip, identical_to: proof(w.tp) },
                REPORT_DEADLINE,
                Some(&self.token),
            );
            let label = w.label();
            async move { client.report(req).await.map(|r| r.into_inner()).map_err(|s| RankError::call(label, "report", &s)) }
        })
        .await
    }

    /// Stages `source` on every rank of replica `dp` (shadow buffers; the active weights keep
    /// serving): seconds and the staged version, by worker. With `reference`, each rank also
    /// prepares that probe's reference for the staged version; with `defer_round_trip`, it runs
    /// no round trip (see [`Cluster::staged_reports_identical_to`]).
    pub async fn stage(
        &self,
        dp: u32,
        source: &pb::LoadSource,
        reference: Option<orchestrator_worker::probe::ProbeSpec>,
        defer_round_trip: bool,
    ) -> RankResults<(f64, String)> {
        let reference = reference.map(|p| pb::ReferenceProbe { tokens: p.tokens as u32, latents: p.latents as u32, seed: p.seed });
        self.fan_out_in(Some(dp), |w, mut client| {
            let label = w.label();
            let req = orchestrator_net::auth::request(
                pb::StageRequest { source: Some(source.clone()), reference, defer_round_trip },
                LOAD_DEADLINE,
                Some(&self.token),
            );
            async move {
                let mut stream = client.stage(req).await.map_err(|s| RankError::call(label.clone(), "stage", &s))?.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(p)) if p.finished => return Ok((p.load_seconds, p.version)),
                        Ok(Some(_)) => {}
                        Ok(None) => return Err(RankError::Incomplete { rank: label, what: "stage stream ended early" }),
                        Err(s) => return Err(RankError::call(label, "stage", &s)),
                    }
                }
            }
        })
        .await
    }

    /// Asks every rank of replica `dp` to swap to the decided version `expected` (a rank that
    /// already holds it answers at once): each rank's answer, `(active, staged)`.
    pub async fn commit(&self, dp: u32, expected: &str) -> RankResults<(String, String)> {
        let _guard = self.group_locks[dp as usize].lock().await;
        self.fan_out_in(Some(dp), |w, mut client| {
            let label = w.label();
            let req = orchestrator_net::auth::request(
                pb::CommitRequest { expected_version: expected.to_string() },
                limits::COMMIT_CALL_DEADLINE,
                Some(&self.token),
            );
            async move {
                client
                    .commit(req)
                    .await
                    .map(|r| {
                        let r = r.into_inner();
                        (r.checkpoint_version, r.staged_version)
                    })
                    .map_err(|s| RankError::call(label, "commit", &s))
            }
        })
        .await
    }

    /// Drops whatever replica `dp` staged: each rank's active version after it.
    pub async fn abort(&self, dp: u32) -> RankResults<String> {
        self.abort_with(dp, pb::AbortRequest { rollback: false, expected_version: String::new() }).await
    }

    /// Swaps every rank of replica `dp` back to the version its last commit replaced, which must
    /// be `expected` (only after that decision is journaled): each rank's active version after it.
    pub async fn rollback(&self, dp: u32, expected: &str) -> RankResults<String> {
        let _guard = self.group_locks[dp as usize].lock().await;
        self.abort_with(dp, pb::AbortRequest { rollback: true, expected_version: expected.to_string() }).await
    }

    /// Every rank drops the version it kept for a rollback (the update ended).
    pub async fn release(&self) {
        let _ = self
            .fan_out(|w, mut client| {
                let req = orchestrator_net::auth::request(pb::ReleaseRequest {}, ASSIGN_DEADLINE, Some(&self.token));
                let label = w.label();
                async move { client.release(req).await.map(|_| ()).map_err(|s| RankError::call(label, "release", &s)) }
            })
            .await;
    }

    async fn abort_with(&self, dp: u32, request: pb::AbortRequest) -> RankResults<String> {
        self.fan_out_in(Some(dp), |w, mut client| {
            let req = orchestrator_net::auth::request(request.clone(), ASSIGN_DEADLINE, Some(&self.token));
            let label = w.label();
            async move {
                client.abort(req).await.map(|r| r.into_inner().checkpoint_version).map_err(|s| RankError::call(label, "abort", &s))
            }
        })
        .await
    }

    /// Asks every worker to stop, then kills any that did not.
    pub async fn shutdown(&self) {
        for w in &self.workers {
            if let Some(mut client) = w.client.clone() {
                let req = orchestrator_net::auth::request(pb::ShutdownRequest {}, SHUTDOWN_DEADLINE, Some(&self.token));
                let _ = client.shutdown(req).await;
            }
        }
        for w in &self.workers {
            w.process.stop_within(SHUTDOWN_DEADLINE).await;
        }
    }

    /// Kills every worker at once (after a failure); workers this coordinator did not start are
    /// asked to stop instead (whether or not they were connected yet).
    pub async fn kill_all(&self) {
        for w in &self.workers {
            w.process.kill().await;
        }
        let remote = self.workers.iter().filter(|w| matches!(w.process, WorkerProcess::Remote)).filter_map(|w| {
            let reg = self.registry.get(w.id)?;
            let endpoint = orchestrator_net::tls::endpoint(&reg.address, self.tls.as_ref()).ok()?;
            let token = self.token.clone();
            Some(async move {
                let channel = endpoint.connect_timeout(SHUTDOWN_DEADLINE).connect().await.ok()?;
                let req = orchestrator_net::auth::request(pb::ShutdownRequest {}, SHUTDOWN_DEADLINE, Some(&token));
                WorkerClient::new(channel).shutdown(req).await.ok()
            })
        });
        futures_util::future::join_all(remote).await;
    }

    /// Fills in, from the registrations, where each row's rank runs: its host, device and pid
    /// when the rank could not say (it failed), its address, and who started it; a failed row's
    /// text names the host too.
    pub fn annotate(&self, rows: &mut [crate::consistency::RankRow]) {
        for row in rows {
            let Some(reg) = self.registry.get(row.worker) else { continue };
            if row.host.is_empty() {
                row.host = reg.host.clone();
            }
            if row.device.is_empty() {
                row.device = reg.device.clone();
            }
            if row.pid == 0 {
                row.pid = reg.process.pid;
            }
            // A failure names where the rank runs, whatever failed (an RPC error says only what).
            if let Some(f) = row.failure.as_mut()
                && !row.failure_names_host
            {
                f.push_str(&format!(" [on host {}, pid {}, {}]", reg.host, reg.process.pid, reg.address));
            }
            row.address = reg.address;
            row.started_by = reg.rank_source;
        }
    }

    /// Tells every rank of replica `dp` whether it serves verified weights (`version`), so its
    /// grpc.health.v1 readiness follows the rotation; true when every rank took it.
    pub async fn set_serving(&self, dp: u32, serving: bool, version: &str) -> bool {
        let results = self
            .fan_out_in(Some(dp), |w, mut client| {
                let req = orchestrator_net::auth::request(
                    pb::SetServingRequest { serving, version: version.to_string() },
                    READINESS_DEADLINE,
                    Some(&self.token),
                );
                let label = w.label();
                async move { client.set_serving(req).await.map(|_| ()).map_err(|s| RankError::call(label, "set serving", &s)) }
            })
            .await;
        results.values().all(Result::is_ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consistency::failed_row;
    use crate::registry::Registration;

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
