//! The cluster as the coordinator runs it: worker processes started next to this binary (as
//! TGI's launcher starts its shards), their registrations and heartbeats, and the operations
//! fanned out to every rank (assign, load, probe, report, shutdown) under a watchdog that turns
//! a worker that exits or stops answering into a failure named by rank within seconds.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::worker_client::WorkerClient;
use orchestrator_worker::auth::Token;
use orchestrator_worker::tls::TlsFiles;
use tokio::process::{Child, Command};
use tokio::task::JoinSet;
use tonic::transport::Channel;

/// A worker that misses heartbeats this long has stopped answering.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(4);
/// Deadlines of the calls to workers.
pub const ASSIGN_DEADLINE: Duration = Duration::from_secs(60);
pub const LOAD_DEADLINE: Duration = Duration::from_secs(1800);
pub const PROBE_DEADLINE: Duration = Duration::from_secs(1800);
pub const REPORT_DEADLINE: Duration = Duration::from_secs(300);
pub const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);

/// What a worker told the coordinator when it registered, and when it was last heard from.
#[derive(Clone, Debug)]
pub struct Registration {
    pub address: String,
    pub host: String,
    pub device: String,
    pub pid: u32,
    pub last_heartbeat: Instant,
}

/// Registrations by worker id, shared with the Coordinator service.
#[derive(Default)]
pub struct Registry {
    pub workers: Mutex<HashMap<u32, Registration>>,
}

impl Registry {
    pub fn register(&self, id: u32, r: Registration) {
        self.workers.lock().unwrap_or_else(|p| p.into_inner()).insert(id, r);
    }
    pub fn heartbeat(&self, id: u32) -> bool {
        match self.workers.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&id) {
            Some(r) => {
                r.last_heartbeat = Instant::now();
                true
            }
            None => false,
        }
    }
    pub fn get(&self, id: u32) -> Option<Registration> {
        self.workers.lock().unwrap_or_else(|p| p.into_inner()).get(&id).cloned()
    }
}

/// A worker's process: a child this coordinator started, or one a previous coordinator
/// started and this one adopted from the state directory (known by pid only).
pub enum WorkerProcess {
    Child(Box<tokio::sync::Mutex<Child>>),
    Adopted { pid: u32 },
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
            Self::Adopted { pid } => (!pid_alive(*pid)).then(|| format!("exited (pid {pid} is gone)")),
        }
    }

    /// Waits up to `limit` for the process to end, then kills it.
    pub async fn stop_within(&self, limit: Duration) {
        match self {
            Self::Child(child) => {
                let mut child = child.lock().await;
                if tokio::time::timeout(limit, child.wait()).await.is_err() {
                    let _ = child.kill().await;
                }
            }
            Self::Adopted { pid } => {
                let start = Instant::now();
                while pid_alive(*pid) && start.elapsed() < limit {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                kill_pid(*pid);
            }
        }
    }

    pub async fn kill(&self) {
        match self {
            Self::Child(child) => {
                let _ = child.lock().await.kill().await;
            }
            Self::Adopted { pid } => kill_pid(*pid),
        }
    }
}

/// Whether a process with this pid exists (and is not a zombie).
fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state field follows the parenthesized command name.
        return stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'));
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

fn kill_pid(pid: u32) {
    if let Ok(pid) = libc::pid_t::try_from(pid)
        && pid > 0
        && pid_alive(pid as u32)
    {
        // SAFETY: SIGKILL to a single positive pid this cluster's journal names as its worker.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
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

#[cfg(feature = "cuda")]
fn visible_gpus() -> usize {
    orchestrator_kernels::cuda::CudaBackend::device_count().max(1)
}

#[cfg(not(feature = "cuda"))]
fn visible_gpus() -> usize {
    1
}

/// A failure named by rank.
pub type Failures = Vec<(u32, String)>;

/// The worker command: the `orchestrator-worker` binary next to this executable (as TGI's
/// launcher finds its shards), or, when it is not there (`cargo run --bin orchestrator` builds
/// only this binary), this executable's own built-in worker.
fn worker_command() -> anyhow::Result<(PathBuf, Vec<String>)> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().ok_or_else(|| anyhow::anyhow!("{} has no parent directory", exe.display()))?;
    let path = dir.join(format!("orchestrator-worker{}", std::env::consts::EXE_SUFFIX));
    if path.exists() { Ok((path, vec!["serve".into()])) } else { Ok((exe, vec!["worker-serve".into()])) }
}

impl Cluster {
    /// Starts `tp * dp` worker processes on `device` that register with `coordinator`,
    /// authenticate with the token in `token_file`, read checkpoints only under `allow_roots`,
    /// and keep serving for `grace` while the coordinator is unreachable. GPU workers get
    /// `ORCHESTRATOR_DEVICE=cuda` and one GPU each through `CUDA_VISIBLE_DEVICES` (worker `i`
    /// gets GPU `i mod gpus`, `gpus` from the launcher's own `CUDA_VISIBLE_DEVICES` list, or
    /// `ORCHESTRATOR_GPUS`, or the GPUs it sees).
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
        let mut workers = Vec::new();
        for id in 0..tp * dp {
            let mut command = Command::new(&bin);
            if device == WorkerDevice::Cuda {
                command.env(orchestrator_worker::device::DEVICE_ENV, "cuda").env("CUDA_VISIBLE_DEVICES", &gpus[id as usize % gpus.len()]);
            }
            let child = command
                .args(&leading)
                .args(["--coordinator", coordinator, "--worker-id", &id.to_string()])
                .arg("--token-file")
                .arg(token_file)
                .args(allow_roots.iter().flat_map(|r| [std::ffi::OsStr::new("--allow-root"), r.as_os_str()]))
                .args(["--coordinator-grace", &grace.as_secs_f64().to_string()])
                .args(tls.iter().flat_map(|t| [std::ffi::OsStr::new("--tls-dir"), t.dir.as_os_str()]))
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
        let group_locks = (0..dp).map(|_| tokio::sync::Mutex::new(())).collect();
        Ok(Self { tp, dp, workers, registry, token, group_locks, tls })
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
            registry.register(
                r.id,
                Registration {
                    address: r.address.clone(),
                    host: String::new(),
                    device: String::new(),
                    pid: r.pid,
                    last_heartbeat: Instant::now(),
                },
            );
            workers.push(WorkerHandle {
                id: r.id,
                dp: r.dp,
                tp: r.tp,
                process: WorkerProcess::Adopted { pid: r.pid },
                client: None,
                collective: r.collective.clone(),
                nccl_unique_id: crate::journal::from_hex(&r.nccl_unique_id).unwrap_or_default(),
            });
        }
        let group_locks = (0..dp).map(|_| tokio::sync::Mutex::new(())).collect();
        let mut cluster = Self { tp, dp, workers, registry, token, group_locks, tls };
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
                crate::journal::WorkerRecord {
                    id: w.id,
                    dp: w.dp,
                    tp: w.tp,
                    address: reg.as_ref().map(|r| r.address.clone()).unwrap_or_default(),
                    pid: reg.map_or(0, |r| r.pid),
                    collective: w.collective.clone(),
                    nccl_unique_id: crate::journal::to_hex(&w.nccl_unique_id),
                }
            })
            .collect()
    }

    /// The first worker (of replica `group`, or of all) that exited or stopped answering,
    /// checked every 100 ms; never returns while they are healthy.
    pub async fn watchdog(&self, group: Option<u32>) -> Failures {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut failures = Vec::new();
            for w in self.workers.iter().filter(|w| group.is_none_or(|g| w.dp == g)) {
                if let Some(how) = w.process.exited().await {
                    failures.push((w.id, format!("{} {how}", w.label())));
                    continue;
                }
                if let Some(r) = self.registry.get(w.id) {
                    let silent = r.last_heartbeat.elapsed();
                    if silent > HEARTBEAT_TIMEOUT {
                        failures.push((
                            w.id,
                            format!(
                                "{} (pid {} on {}, {}) stopped answering: no heartbeat for {:.1} s",
                                w.label(),
                                r.pid,
                                r.host,
                                r.device,
                                silent.as_secs_f64()
                            ),
                        ));
                    }
                }
            }
            if !failures.is_empty() {
                return failures;
            }
        }
    }

    /// Runs `fut` unless a worker (of `group`, or any) fails first.
    pub async fn guarded<T>(&self, group: Option<u32>, fut: impl Future<Output = T>) -> Result<T, Failures> {
        tokio::select! {
            out = fut => Ok(out),
            failures = self.watchdog(group) => Err(failures),
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
                    return Err(vec![(w.id, format!("{} {how} before registering", w.label()))]);
                }
            }
            if start.elapsed() > deadline {
                return Err(missing
                    .into_iter()
                    .map(|id| (id, format!("worker {id} did not register within {} s", deadline.as_secs())))
                    .collect());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.connect_registered(false).await
    }

    /// Connects to every registered worker (`lazy`: on first use).
    async fn connect_registered(&mut self, lazy: bool) -> Result<(), Failures> {
        for w in &mut self.workers {
            let reg = self.registry.get(w.id).ok_or_else(|| vec![(w.id, format!("{} is not registered", w.label()))])?;
            let endpoint = orchestrator_worker::tls::endpoint(&reg.address, self.tls.as_ref())
                .map_err(|e| vec![(w.id, format!("{}: {e}", w.label()))])?;
            let channel = if lazy {
                endpoint.connect_lazy()
            } else {
                endpoint.connect().await.map_err(|e| vec![(w.id, format!("{}: connecting to {}: {e}", w.label(), reg.address))])?
            };
            w.client = Some(WorkerClient::new(channel).max_decoding_message_size(64 << 20));
        }
        Ok(())
    }

    /// Calls `op` on every worker concurrently, under the watchdog; results by worker id.
    pub async fn fan_out<T, F, Fut>(&self, op: F) -> Result<BTreeMap<u32, Result<T, String>>, Failures>
    where
        T: Send + 'static,
        F: Fn(&WorkerHandle, WorkerClient<Channel>) -> Fut,
        Fut: Future<Output = Result<T, String>> + Send + 'static,
    {
        self.fan_out_in(None, op).await
    }

    /// [`Cluster::fan_out`] on the ranks of one replica (`Some(dp)`) or of all.
    pub async fn fan_out_in<T, F, Fut>(&self, group: Option<u32>, op: F) -> Result<BTreeMap<u32, Result<T, String>>, Failures>
    where
        T: Send + 'static,
        F: Fn(&WorkerHandle, WorkerClient<Channel>) -> Fut,
        Fut: Future<Output = Result<T, String>> + Send + 'static,
    {
        let mut set = JoinSet::new();
        for w in self.workers.iter().filter(|w| group.is_none_or(|g| w.dp == g)) {
            let Some(client) = w.client.clone() else { continue };
            let id = w.id;
            let fut = op(w, client);
            set.spawn(async move { (id, fut.await) });
        }
        self.guarded(group, async move {
            let mut out = BTreeMap::new();
            while let Some(joined) = set.join_next().await {
                if let Ok((id, r)) = joined {
                    out.insert(id, r);
                }
            }
            out
        })
        .await
    }

    /// Assigns `(dp, tp)` shards; records each rank's collective address.
    pub async fn assign(
        &mut self,
        source: &pb::LoadSource,
        scale_rule: &str,
        fault: Option<(u32, pb::Fault)>,
        dump_dir: Option<&std::path::Path>,
    ) -> Result<(), Failures> {
        let dump_dir = dump_dir.map(|d| d.display().to_string()).unwrap_or_default();
        let (tp, dp) = (self.tp, self.dp);
        let results = self
            .fan_out(|w, mut client| {
                let req = orchestrator_worker::auth::request(
                    pb::AssignRequest {
                        tp_size: tp,
                        tp_rank: w.tp,
                        dp_size: dp,
                        dp_rank: w.dp,
                        source: Some(source.clone()),
                        scale_rule: scale_rule.to_string(),
                        fault: fault.filter(|(rank, _)| *rank == w.id).map(|(_, f)| f as i32).unwrap_or(0),
                        dump_dir: dump_dir.clone(),
                    },
                    ASSIGN_DEADLINE,
                    Some(&self.token),
                );
                let label = w.label();
                async move { client.assign(req).await.map(|r| r.into_inner()).map_err(|s| format!("{label}: assign: {}", s.message())) }
            })
            .await?;
        let mut failures = Vec::new();
        for w in &mut self.workers {
            match results.get(&w.id) {
                Some(Ok(assigned)) => {
                    w.collective = assigned.collective_address.clone();
                    w.nccl_unique_id = assigned.nccl_unique_id.clone();
                }
                Some(Err(e)) => failures.push((w.id, e.clone())),
                None => failures.push((w.id, format!("{}: assign did not complete", w.label()))),
            }
        }
        if failures.is_empty() { Ok(()) } else { Err(failures) }
    }

    /// Loads every rank in parallel, showing progress on stderr; load seconds by worker.
    pub async fn load(&self) -> Result<BTreeMap<u32, Result<f64, String>>, Failures> {
        let progress: Arc<Mutex<BTreeMap<u32, (u32, u32)>>> = Arc::new(Mutex::new(BTreeMap::new()));
        let terminal = std::io::stderr().is_terminal();
        let labels: BTreeMap<u32, String> = self.workers.iter().map(|w| (w.id, format!("dp{}/tp{}", w.dp, w.tp))).collect();
        let show = {
            let progress = progress.clone();
            let labels = labels.clone();
            move |id: u32, done: u32, total: u32, finished: Option<f64>| {
                let mut p = progress.lock().unwrap_or_else(|e| e.into_inner());
                p.insert(id, (done, total));
                if terminal {
                    let line: Vec<String> = p.iter().map(|(i, (d, t))| format!("{} {d}/{t}", labels[i])).collect();
                    eprint!("\rloading: {}   ", line.join("  "));
                } else if let Some(s) = finished {
                    eprintln!("loaded rank {} ({done} layers) in {s:.2} s", labels[&id]);
                }
            }
        };
        let show = Arc::new(show);
        let result = self
            .fan_out(|w, mut client| {
                let label = w.label();
                let id = w.id;
                let show = show.clone();
                let token = self.token.clone();
                async move {
                    let req = orchestrator_worker::auth::request(pb::LoadRequest {}, LOAD_DEADLINE, Some(&token));
                    let mut stream = client.load(req).await.map_err(|s| format!("{label}: load: {}", s.message()))?.into_inner();
                    loop {
                        match stream.message().await {
                            Ok(Some(p)) => {
                                show(id, p.layers_done, p.layers_total, p.finished.then_some(p.load_seconds));
                                if p.finished {
                                    return Ok(p.load_seconds);
                                }
                            }
                            Ok(None) => return Err(format!("{label}: load stream ended before the load finished")),
                            Err(s) => return Err(format!("{label}: load: {}", s.message())),
                        }
                    }
                }
            })
            .await;
        if terminal {
            eprintln!();
        }
        result
    }

    /// Runs the probe on the ranks of one replica (or all), on their active or staged weights;
    /// each TP group all-reduces over its ring (set up on the first probe, reused after) while
    /// holding its group lock.
    pub async fn probe_in(
        &self,
        group: Option<u32>,
        (tokens, latents, seed): (u32, u32, u64),
        shadow: bool,
        skip_reference: bool,
    ) -> Result<BTreeMap<u32, Result<pb::ProbeResult, String>>, Failures> {
        let mut guards = Vec::new();
        for (dp, lock) in self.group_locks.iter().enumerate() {
            if group.is_none_or(|g| g as usize == dp) {
                guards.push(lock.lock().await);
            }
        }
        let peers: BTreeMap<u32, Vec<String>> =
            (0..self.dp).map(|dp| (dp, self.workers.iter().filter(|w| w.dp == dp).map(|w| w.collective.clone()).collect())).collect();
        // GPU groups: the NCCL unique id their rank 0 created, relayed to every rank.
        let nccl_ids: BTreeMap<u32, Vec<u8>> =
            self.workers.iter().filter(|w| w.tp == 0).map(|w| (w.dp, w.nccl_unique_id.clone())).collect();
        self.fan_out_in(group, |w, mut client| {
            let req = orchestrator_worker::auth::request(
                pb::ProbeRequest {
                    tokens,
                    latents,
                    seed,
                    group: u64::from(w.dp),
                    peers: peers[&w.dp].clone(),
                    timeout_ms: 15_000,
                    shadow,
                    skip_reference,
                    nccl_unique_id: nccl_ids.get(&w.dp).cloned().unwrap_or_default(),
                },
                PROBE_DEADLINE,
                Some(&self.token),
            );
            let label = w.label();
            async move { client.probe(req).await.map(|r| r.into_inner()).map_err(|s| format!("{label}: probe: {}", s.message())) }
        })
        .await
    }

    /// Runs the probe on every rank's active weights.
    pub async fn probe(&self, tokens: u32, latents: u32, seed: u64) -> Result<BTreeMap<u32, Result<pb::ProbeResult, String>>, Failures> {
        self.probe_in(None, (tokens, latents, seed), false, false).await
    }

    /// Every rank's report.
    pub async fn reports(&self) -> Result<BTreeMap<u32, Result<pb::RankReport, String>>, Failures> {
        self.reports_in(None, false).await
    }

    /// The reports of one replica's ranks (or all), on their active or staged weights.
    pub async fn reports_in(&self, group: Option<u32>, shadow: bool) -> Result<BTreeMap<u32, Result<pb::RankReport, String>>, Failures> {
        self.fan_out_in(group, |w, mut client| {
            let req = orchestrator_worker::auth::request(pb::ReportRequest { shadow }, REPORT_DEADLINE, Some(&self.token));
            let label = w.label();
            async move { client.report(req).await.map(|r| r.into_inner()).map_err(|s| format!("{label}: report: {}", s.message())) }
        })
        .await
    }

    /// Stages `source` on every rank of replica `dp` (shadow buffers; the active weights keep
    /// serving): seconds by worker.
    pub async fn stage(&self, dp: u32, source: &pb::LoadSource) -> Result<BTreeMap<u32, Result<f64, String>>, Failures> {
        self.fan_out_in(Some(dp), |w, mut client| {
            let label = w.label();
            let req =
                orchestrator_worker::auth::request(pb::StageRequest { source: Some(source.clone()) }, LOAD_DEADLINE, Some(&self.token));
            async move {
                let mut stream = client.stage(req).await.map_err(|s| format!("{label}: stage: {}", s.message()))?.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(p)) if p.finished => return Ok(p.load_seconds),
                        Ok(Some(_)) => {}
                        Ok(None) => return Err(format!("{label}: stage stream ended early")),
                        Err(s) => return Err(format!("{label}: stage: {}", s.message())),
                    }
                }
            }
        })
        .await
    }

    /// Swaps the staged version in on every rank of replica `dp`, holding its group lock
    /// (the barrier); a rank whose staged version is not `expected` refuses. Checkpoint
    /// version by worker.
    pub async fn commit(&self, dp: u32, expected: &str) -> Result<BTreeMap<u32, Result<String, String>>, Failures> {
        let _guard = self.group_locks[dp as usize].lock().await;
        self.fan_out_in(Some(dp), |w, mut client| {
            let label = w.label();
            let req = orchestrator_worker::auth::request(
                pb::CommitRequest { expected_version: expected.to_string() },
                ASSIGN_DEADLINE,
                Some(&self.token),
            );
            async move {
                client.commit(req).await.map(|r| r.into_inner().checkpoint_version).map_err(|s| format!("{label}: commit: {}", s.message()))
            }
        })
        .await
    }

    /// Drops whatever replica `dp` staged.
    pub async fn abort(&self, dp: u32) {
        let _ = self
            .fan_out_in(Some(dp), |w, mut client| {
                let req = orchestrator_worker::auth::request(pb::AbortRequest {}, ASSIGN_DEADLINE, Some(&self.token));
                let _ = w;
                async move { client.abort(req).await.map(|_| ()).map_err(|s| s.message().to_string()) }
            })
            .await;
    }

    /// Asks every worker to stop, then kills any that did not.
    pub async fn shutdown(&self) {
        for w in &self.workers {
            if let Some(mut client) = w.client.clone() {
                let req = orchestrator_worker::auth::request(pb::ShutdownRequest {}, SHUTDOWN_DEADLINE, Some(&self.token));
                let _ = client.shutdown(req).await;
            }
        }
        for w in &self.workers {
            w.process.stop_within(SHUTDOWN_DEADLINE).await;
        }
    }

    /// The ranks of replica `dp` whose process is gone, each with how it ended.
    pub async fn dead_in(&self, dp: u32) -> Vec<String> {
        let mut dead = Vec::new();
        for w in self.workers.iter().filter(|w| w.dp == dp) {
            if let Some(how) = w.process.exited().await {
                dead.push(format!("{} {how}", w.label()));
            }
        }
        dead
    }

    /// [`Cluster::dead_in`] after giving a failing process up to a second to finish exiting
    /// (its connection can break a moment before it is gone).
    pub async fn dead_in_settled(&self, dp: u32) -> Vec<String> {
        for _ in 0..20 {
            let dead = self.dead_in(dp).await;
            if !dead.is_empty() {
                return dead;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.dead_in(dp).await
    }

    /// Kills every worker at once (after a failure).
    pub async fn kill_all(&self) {
        for w in &self.workers {
            w.process.kill().await;
        }
    }
}
