//! `orchestrator bench update`: what a rolling update costs a served cluster, measured as a user
//! would see it, every ratio against figures of the same run. It synthesizes two versions of a
//! real-geometry checkpoint (once), launches a served TP x DP cluster on the first, measures the
//! rotation's probe capacity and latency, rolls the second version out under a probe load at
//! half that capacity, and prints update / load, the latency percentiles before and during the
//! update, and the failed probes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use orchestrator_model::synth::{DEFAULT_MAX_SHARD_BYTES, SynthOptions, write_checkpoint};
use orchestrator_model::{ModelConfig, Preset};
use orchestrator_ops::output::emit;
use orchestrator_proto::v1 as pb;
use orchestrator_worker::probe::ProbeSpec;
use serde::Serialize;

use super::load::{Sample, at_rate, at_rate_until, capacity, percentile};

#[derive(Args)]
pub struct BenchUpdateArgs {
    #[arg(long, default_value = "dsv41-flash")]
    preset: String,
    #[arg(long, default_value_t = 8)]
    layers: usize,
    #[arg(long, default_value_t = 2)]
    tp: u32,
    #[arg(long, default_value_t = 2)]
    dp: u32,
    /// The probe size of the load and of the update's verification.
    #[arg(long, value_name = "T,S[,SEED]", default_value_t = ProbeSpec::SERVING)]
    probe: ProbeSpec,
    /// Seconds of each measurement before the update (capacity, then latency).
    #[arg(long, default_value_t = 4.0)]
    seconds: f64,
    /// Fresh launches whose fastest load the update is divided by (the served launch is the
    /// first; the rest load, report and exit). One launch's load varies several times over on a
    /// VM whose host reclaims free guest memory (free page reporting: a page first touched after
    /// a reclaim costs a host fault), and two of three launches were slowed so in one run (2.82,
    /// 6.87 and 0.31 s: a median of 2.82 s made an update of 1.27 s 0.45x the load), so the best
    /// is the yardstick, as for the worker bench's fresh processes.
    #[arg(long, default_value_t = 3)]
    launches: usize,
    /// Launch with `--keep-staging-buffers` (every update, the first included, stages into a
    /// spare set of buffers; the bench waits for the ranks to prepare it after the launch).
    #[arg(long)]
    keep_staging_buffers: bool,
    /// Where the two checkpoints are synthesized (kept for later runs).
    #[arg(long, default_value = "target/bench-update")]
    dir: PathBuf,
    #[arg(long)]
    json: bool,
}

/// The machine's CPU time so far, from the first line of `/proc/stat`, in clock ticks: busy
/// (user, nice, system, irq, softirq) and all of it (those, idle, iowait and steal).
#[derive(Clone, Copy, Debug)]
struct CpuTimes {
    busy: u64,
    all: u64,
}

impl CpuTimes {
    /// `None` where there is no `/proc/stat` or its first line is not the one Linux writes.
    fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().next()?.strip_prefix("cpu ")?;
        let t: Vec<u64> = line.split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let [user, nice, system, idle, iowait, irq, softirq, steal] = *t.get(..8)? else { return None };
        let busy = user + nice + system + irq + softirq;
        Some(Self { busy, all: busy + idle + iowait + steal })
    }

    /// The busy share of the machine's CPU time between `earlier` and `self`.
    fn busy_since(self, earlier: Option<Self>) -> Option<f64> {
        let earlier = earlier?;
        let all = self.all.checked_sub(earlier.all).filter(|&a| a > 0)?;
        Some(self.busy.saturating_sub(earlier.busy) as f64 / all as f64)
    }
}

/// What the CPU did during an update, against the probes alone before it: the update's own
/// work (in core-seconds), and the least wall time that work takes in the cores the probes leave,
/// however it is scheduled.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CpuUse {
    pub cores: usize,
    /// Busy share of all cores during the latency phase before the updates (the probes alone).
    pub busy_before: f64,
    /// Busy share during the update call.
    pub busy_during: f64,
    /// `(busy_during - busy_before) * cores * update_s`: the update's own CPU time, taking the
    /// probes to cost what they cost before.
    pub work_core_s: f64,
    /// `work_core_s / ((1 - busy_before) * cores)`: its wall time with every cycle the probes
    /// leave, and nothing else.
    pub floor_s: f64,
    pub floor_over_load: f64,
}

impl CpuUse {
    fn of(cores: usize, busy_before: Option<f64>, busy_during: Option<f64>, update_s: f64, load_s: f64) -> Option<Self> {
        let (before, during) = (busy_before?, busy_during?);
        let work_core_s = (during - before).max(0.0) * cores as f64 * update_s;
        let floor_s = work_core_s / ((1.0 - before).max(1e-3) * cores as f64);
        Some(Self { cores, busy_before: before, busy_during: during, work_core_s, floor_s, floor_over_load: floor_s / load_s })
    }

    fn render(&self, load_s: f64) -> String {
        format!(
            "busy {:.0}% with the probes alone, {:.0}% during the update: its own work {:.2} core-s ({:.1}x the {:.2} core-s that {} cores could spend on the load); \
             with every cycle the probes leave it takes >= {:.2} s ({:.2}x the load)",
            self.busy_before * 100.0,
            self.busy_during * 100.0,
            self.work_core_s,
            self.work_core_s / (self.cores as f64 * load_s),
            self.cores as f64 * load_s,
            self.cores,
            self.floor_s,
            self.floor_over_load
        )
    }
}

/// CPU time of one process so far, in seconds: all its threads (`/proc/PID/stat`'s user and
/// system time, threads that ended included), and its background pool's (the `background-*`
/// threads that stage, prepare references, run round trips and the staged verification passes;
/// each one's `schedstat`, in nanoseconds: they live as long as the process).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct ProcessCpu {
    all: f64,
    background: f64,
}

impl ProcessCpu {
    /// `None` where `/proc` does not have the process (it ended, or this is not Linux).
    fn of(pid: u32) -> Option<Self> {
        let all = Self::parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)?;
        let mut background = 0.0;
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.starts_with("background-") {
                let sched = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
                background += sched.split_whitespace().next().and_then(|ns| ns.parse::<f64>().ok()).unwrap_or(0.0) / 1e9;
            }
        }
        Some(Self { all, background })
    }

    /// User plus system seconds from a `/proc/PID/stat` line (its command name, in parentheses,
    /// may hold spaces and parentheses: the fields are counted after the last `)`).
    fn parse_stat(stat: &str) -> Option<f64> {
        let rest: Vec<&str> = stat.get(stat.rfind(')')? + 1..)?.split_whitespace().collect();
        // Fields 14 and 15 of the line; `rest` starts at field 3.
        let (utime, stime): (u64, u64) = (rest.get(11)?.parse().ok()?, rest.get(12)?.parse().ok()?);
        // SAFETY: sysconf reads a constant of the system.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        (hz > 0).then(|| (utime + stime) as f64 / hz as f64)
    }
}

/// Where the machine's CPU went during an update, by process (core-seconds).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct CpuByProcess {
    /// The ranks' background pools: staging, references, round trips, the staged verification
    /// passes (below serving).
    pub ranks_background_s: f64,
    /// The ranks' other threads: routed probes, the probes after the swaps, reports, RPCs.
    pub ranks_serving_s: f64,
    /// The coordinator (the served launch's process).
    pub coordinator_s: f64,
    /// This bench: the probe client.
    pub client_s: f64,
}

/// The processes whose CPU an update's breakdown counts: the ranks, the coordinator, this bench.
struct Processes {
    ranks: Vec<u32>,
    coordinator: u32,
}

impl Processes {
    fn sample(&self) -> Vec<Option<ProcessCpu>> {
        self.ranks.iter().chain([&self.coordinator, &std::process::id()]).map(|&p| ProcessCpu::of(p)).collect()
    }

    /// What each group of processes spent between two samples (`None` where a process could not
    /// be read in either).
    fn spent(&self, before: &[Option<ProcessCpu>], after: &[Option<ProcessCpu>]) -> Option<CpuByProcess> {
        let d: Vec<ProcessCpu> = before
            .iter()
            .zip(after)
            .map(|(b, a)| {
                Some(ProcessCpu { all: a.as_ref()?.all - b.as_ref()?.all, background: a.as_ref()?.background - b.as_ref()?.background })
            })
            .collect::<Option<_>>()?;
        let n = self.ranks.len();
        let background: f64 = d[..n].iter().map(|c| c.background).sum();
        Some(CpuByProcess {
            ranks_background_s: background,
            ranks_serving_s: d[..n].iter().map(|c| c.all).sum::<f64>() - background,
            coordinator_s: d[n].all,
            client_s: d[n + 1].all,
        })
    }
}

impl CpuByProcess {
    fn per_second(self, seconds: f64) -> Self {
        let f = 1.0 / seconds.max(1e-9);
        Self {
            ranks_background_s: self.ranks_background_s * f,
            ranks_serving_s: self.ranks_serving_s * f,
            coordinator_s: self.coordinator_s * f,
            client_s: self.client_s * f,
        }
    }

    fn render(&self) -> String {
        format!(
            "the ranks' background pools {:.2} core-s (staging, references, round trips, staged verification passes), their other threads {:.2} (routed probes, probes after the swaps, reports), the coordinator {:.2}, this bench's probe client {:.2}",
            self.ranks_background_s, self.ranks_serving_s, self.coordinator_s, self.client_s
        )
    }
}

/// Latency percentiles of a phase, in seconds.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Latency {
    pub probes: usize,
    pub failed: usize,
    pub p50_s: f64,
    pub p99_s: f64,
}

impl Latency {
    fn of(samples: &[Sample]) -> Self {
        let ms: Vec<f64> = samples.iter().map(|s| s.ms).collect();
        Self {
            probes: samples.len(),
            failed: samples.iter().filter(|s| !s.ok).count(),
            p50_s: percentile(&ms, 0.5) / 1e3,
            p99_s: percentile(&ms, 0.99) / 1e3,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct UpdateBench {
    pub cluster: String,
    /// The fastest load of the fresh launches (`loads_s`).
    pub load_s: f64,
    pub loads_s: Vec<f64>,
    /// The update call as a client sees it: the rolling update, then the consistency report it
    /// answers with.
    pub update_s: f64,
    /// The rolling update alone (validate, then stage, verify and swap every replica).
    pub roll_s: f64,
    pub update_over_load: f64,
    pub roll_over_load: f64,
    pub capacity_per_s: f64,
    pub load_rate_per_s: f64,
    pub before: Latency,
    pub during: Latency,
    pub p99_during_over_before: f64,
    pub update_ok: bool,
    /// The machine's CPU during the update against the probes alone (absent without `/proc/stat`).
    pub cpu: Option<CpuUse>,
    pub cpu_by_process: Option<CpuByProcess>,
    /// The same, per second, with the probes alone (the latency phase before the update).
    pub cpu_by_process_before_per_s: Option<CpuByProcess>,
    /// The slowest probes during the update: when each was sent (seconds after the update
    /// began), its latency, and the replica and version that answered.
    pub slowest_during: Vec<SlowProbe>,
    pub steps: Vec<String>,
    pub errors: Vec<String>,
    /// The update back to the first version right after, under the same load (with
    /// `--keep-staging-buffers` it stages into the buffers the first update left).
    pub back: Back,
}

/// The second update of the benchmark, back to the first version.
#[derive(Debug, Serialize)]
pub struct Back {
    pub update_s: f64,
    pub roll_s: f64,
    pub roll_over_load: f64,
    pub during: Latency,
    pub p99_during_over_before: f64,
    pub update_ok: bool,
    pub cpu: Option<CpuUse>,
    pub cpu_by_process: Option<CpuByProcess>,
    pub steps: Vec<String>,
}

/// One update under a probe load at `rate` (the load stops when the update ends).
struct Rolled {
    update_s: f64,
    roll_s: f64,
    ok: bool,
    during: Vec<Sample>,
    steps: Vec<String>,
    /// The busy share of the machine's CPU during the update call.
    busy: Option<f64>,
    by_process: Option<CpuByProcess>,
}

async fn roll_under_load(
    client: &pb::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
    token: &orchestrator_net::auth::Token,
    probe: ProbeSpec,
    rate: f64,
    to: &Path,
    processes: &Processes,
) -> anyhow::Result<Rolled> {
    let stop = AtomicBool::new(false);
    let update = async {
        let (t, cpu, by_process) = (Instant::now(), CpuTimes::now(), processes.sample());
        let mut c = client.clone();
        let req = orchestrator_net::auth::request(
            pb::UpdateRequest { checkpoint_dir: to.display().to_string(), max_unavailable: 1, max_staging: 0 },
            orchestrator_proto::limits::UPDATE_DEADLINE,
            Some(token),
        );
        let r = c.update(req).await;
        stop.store(true, Ordering::SeqCst);
        let busy = CpuTimes::now().and_then(|now| now.busy_since(cpu));
        let by_process = processes.spent(&by_process, &processes.sample());
        (t.elapsed().as_secs_f64(), busy, by_process, r)
    };
    let load = at_rate_until(client, Some(token), probe, rate, Duration::from_secs(3600), Some(&stop));
    let ((update_s, busy, by_process, response), during) = tokio::join!(update, load);
    let response = response.map_err(|s| anyhow::anyhow!("update: {}", s.message()))?.into_inner();
    let doc: serde_json::Value = serde_json::from_str(&response.json)?;
    let roll_s = doc["update"]["seconds"].as_f64().context("the update document has no seconds")?;
    let steps =
        doc["update"]["steps"].as_array().map(|v| v.iter().filter_map(|s| s.as_str().map(String::from)).collect()).unwrap_or_default();
    Ok(Rolled { update_s, roll_s, ok: response.ok, during, steps, busy, by_process })
}

#[derive(Debug, Serialize)]
pub struct SlowProbe {
    pub sent_s: f64,
    pub latency_s: f64,
    pub replica: String,
    pub version: String,
}

fn slowest(samples: &[Sample], n: usize) -> Vec<SlowProbe> {
    let mut by_latency: Vec<&Sample> = samples.iter().collect();
    by_latency.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    by_latency
        .into_iter()
        .take(n)
        .map(|s| SlowProbe { sent_s: s.sent.as_secs_f64(), latency_s: s.ms / 1e3, replica: s.replica.clone(), version: s.version.clone() })
        .collect()
}

fn checkpoint(dir: &Path, preset: Preset, layers: usize, seed: u64) -> anyhow::Result<PathBuf> {
    let out = dir.join(format!("{}-{layers}layers-seed{seed}", preset.name()));
    if !out.join(orchestrator_model::checkpoint::INDEX_FILE).exists() {
        eprintln!("synthesizing {} (once)", out.display());
        let config = ModelConfig::from_preset(preset, Some(layers), false)?;
        write_checkpoint(
            &out,
            &SynthOptions { config, seed, max_shard_bytes: DEFAULT_MAX_SHARD_BYTES, preset_name: Some(preset.name().into()) },
        )?;
    }
    Ok(out.canonicalize()?)
}

/// A served cluster started by this benchmark: shut down (or killed) when dropped.
struct Cluster {
    child: std::process::Child,
    url: String,
    token: PathBuf,
}

impl Cluster {
    /// `log`: where the launch's log (its workers' included) goes. Serving once it wrote its
    /// ready file (`--ready-file`, beside the log).
    fn launch(args: &[String], log: &Path) -> anyhow::Result<Self> {
        let ready_file = log.with_extension("ready.json");
        crate::server::Ready::clear(&ready_file)?;
        let stderr = std::fs::File::create(log).with_context(|| format!("creating the served launch's log {}", log.display()))?;
        let mut child = Command::new(std::env::current_exe()?)
            .arg("launch")
            .args(args)
            .arg("--ready-file")
            .arg(&ready_file)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()?;
        // The launch's own report goes to stdout: drained, so that it never blocks on a full pipe.
        let mut stdout = child.stdout.take().context("launch stdout")?;
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let ready = loop {
            if let Ok(text) = std::fs::read_to_string(&ready_file) {
                break serde_json::from_str::<crate::server::Ready>(&text).with_context(|| format!("{}", ready_file.display()))?;
            }
            if let Some(status) = child.try_wait()? {
                let said = std::fs::read_to_string(log).unwrap_or_default();
                anyhow::bail!("the launch ended ({status}) before serving:\n{said}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Ok(Self { child, url: ready.coordinator, token: ready.token_file })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(std::env::current_exe().unwrap_or_default())
            .args(["shutdown", "--coordinator", &self.url, "--token-file"])
            .arg(&self.token)
            .stdout(Stdio::null())
            .status();
        let start = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) && start.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The load time of a fresh launch that loads, reports (without probes) and exits.
fn launch_load(args: &[String]) -> anyhow::Result<f64> {
    let out = Command::new(std::env::current_exe()?).arg("launch").args(args).arg("--no-probe").stderr(Stdio::null()).output()?;
    let doc: serde_json::Value =
        serde_json::from_slice(&out.stdout).with_context(|| format!("a fresh launch ended with {} and no report", out.status))?;
    doc["timings"]["load"].as_f64().context("a fresh launch's report has no load time")
}

pub fn bench_update(a: BenchUpdateArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(a.seconds > 0.0 && a.seconds <= 600.0, "--seconds must be in (0, 600]");
    anyhow::ensure!((1..=20).contains(&a.launches), "--launches must be in 1..=20");
    let preset: Preset = a.preset.parse()?;
    std::fs::create_dir_all(&a.dir).with_context(|| format!("--dir {}", a.dir.display()))?;
    let (ck_a, ck_b) = (checkpoint(&a.dir, preset, a.layers, 1)?, checkpoint(&a.dir, preset, a.layers, 2)?);
    // Both versions from the page cache, so that the launch's load and the update's staging
    // read the same way (a checkpoint evicted since it was written would charge the disk to one).
    for ck in [&ck_a, &ck_b] {
        let gbps = orchestrator_worker::bench::page_cache_read_rate(ck)?;
        eprintln!("{} in the page cache (read at {gbps:.1} GB/s)", ck.display());
    }
    let root = a.dir.canonicalize()?;
    let probe = format!("{},{},{}", a.probe.tokens, a.probe.latents, a.probe.seed);
    let launch_args: Vec<String> = ["--json", "--tp", &a.tp.to_string(), "--dp", &a.dp.to_string(), "--probe", &probe, "--checkpoint"]
        .iter()
        .map(|s| s.to_string())
        .chain([ck_a.display().to_string(), "--allow-root".into(), root.display().to_string()])
        .collect();
    let mut loads = (1..a.launches).map(|_| launch_load(&launch_args)).collect::<anyhow::Result<Vec<f64>>>()?;
    let kept = a.keep_staging_buffers.then(|| "--keep-staging-buffers".to_string());
    let served: Vec<String> = std::iter::once("--serve".to_string()).chain(launch_args.iter().cloned()).chain(kept).collect();
    let started = Instant::now();
    let log = a.dir.join("served-launch.log");
    let cluster = Cluster::launch(&served, &log)?;
    let launch_s = started.elapsed().as_secs_f64();
    eprintln!("the served launch's log (its workers' included): {}", log.display());
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = runtime.block_on(async {
        let token = orchestrator_net::auth::Token::read(&cluster.token)?;
        let channel = orchestrator_net::tls::connect(&cluster.url, None).await?;
        let client = pb::coordinator_client::CoordinatorClient::new(channel)
            .max_decoding_message_size(orchestrator_proto::limits::MAX_RESPONSE_BYTES);
        // The load time of this fresh launch, from its own report.
        let report = {
            let mut c = client.clone();
            let req = orchestrator_net::auth::request(pb::ClusterReportRequest { probe: false }, Duration::from_secs(600), Some(&token));
            let r = c.report(req).await?.into_inner();
            serde_json::from_str::<serde_json::Value>(&r.json)?
        };
        loads.insert(0, report["timings"]["load"].as_f64().context("the launch report has no load time")?);
        // With kept buffers, every rank prepares its spare set after the launch, below serving:
        // wait for it, as an operator would, so that the first update restages too.
        if a.keep_staging_buffers {
            let waited = Instant::now();
            loop {
                let mut c = client.clone();
                let req = orchestrator_net::auth::request(pb::ClusterReportRequest { probe: false }, Duration::from_secs(60), Some(&token));
                let r: serde_json::Value = serde_json::from_str(&c.report(req).await?.into_inner().json)?;
                let ranks = r["ranks"].as_array().context("the report has no ranks")?;
                if ranks.iter().all(|r| r["spare_buffers"] == true) {
                    eprintln!("every rank prepared its spare buffers {:.2} s after the launch", waited.elapsed().as_secs_f64());
                    break;
                }
                anyhow::ensure!(waited.elapsed() < Duration::from_secs(120), "the ranks' spare buffers were not prepared within 120 s");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let load_s = loads.iter().copied().fold(f64::INFINITY, f64::min);
        let phase = Duration::from_secs_f64(a.seconds);
        let cap = capacity(&client, Some(&token), a.probe, a.dp as usize, phase).await;
        anyhow::ensure!(cap > 0.0, "no routed probe was served while measuring capacity");
        let rate = cap / 2.0;
        let processes = Processes {
            ranks: report["ranks"]
                .as_array()
                .context("the launch report has no ranks")?
                .iter()
                .filter_map(|r| r["pid"].as_u64())
                .map(|p| p as u32)
                .collect(),
            coordinator: cluster.child.id(),
        };
        let (cpu_before, by_process_before, t) = (CpuTimes::now(), processes.sample(), Instant::now());
        let before = at_rate(&client, Some(&token), a.probe, rate, phase).await;
        let busy_before = CpuTimes::now().and_then(|now| now.busy_since(cpu_before));
        let by_process_before = processes.spent(&by_process_before, &processes.sample()).map(|c| c.per_second(t.elapsed().as_secs_f64()));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // The update under the same load; then back to the first version.
        let Rolled { update_s, roll_s, ok, during, steps, busy, by_process } =
            roll_under_load(&client, &token, a.probe, rate, &ck_b, &processes).await?;
        let second = roll_under_load(&client, &token, a.probe, rate, &ck_a, &processes).await?;
        let errors = during.iter().chain(&before).chain(&second.during).filter(|s| !s.ok).take(5).map(|s| s.error.clone()).collect();
        let slowest_during = slowest(&during, 3);
        let (before, during_l) = (Latency::of(&before), Latency::of(&during));
        let second_during = Latency::of(&second.during);
        let back = Back {
            update_s: second.update_s,
            roll_s: second.roll_s,
            roll_over_load: second.roll_s / load_s,
            during: second_during,
            p99_during_over_before: second_during.p99_s / before.p99_s.max(1e-9),
            update_ok: second.ok,
            cpu: CpuUse::of(cores, busy_before, second.busy, second.update_s, load_s),
            cpu_by_process: second.by_process,
            steps: second.steps,
        };
        anyhow::Ok(UpdateBench {
            cluster: format!(
                "{} x {} layers, TP {} x DP {}, probe T={} S={}",
                preset.name(),
                a.layers,
                a.tp,
                a.dp,
                a.probe.tokens,
                a.probe.latents
            ),
            load_s,
            loads_s: loads.clone(),
            update_s,
            roll_s,
            update_over_load: update_s / load_s,
            roll_over_load: roll_s / load_s,
            capacity_per_s: cap,
            load_rate_per_s: rate,
            before,
            during: during_l,
            p99_during_over_before: during_l.p99_s / before.p99_s.max(1e-9),
            update_ok: ok,
            cpu: CpuUse::of(cores, busy_before, busy, update_s, load_s),
            cpu_by_process: by_process,
            cpu_by_process_before_per_s: by_process_before,
            slowest_during,
            steps,
            errors,
            back,
        })
    });
    drop(cluster);
    let b = result?;
    if a.json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&b)?));
    } else {
        emit(&render(&b, launch_s));
    }
    Ok(b.update_ok && b.back.update_ok && b.during.failed == 0 && b.before.failed == 0 && b.back.during.failed == 0)
}

fn render(b: &UpdateBench, launch_s: f64) -> String {
    let mut s = format!("update bench: {} ({} cores)\n", b.cluster, std::thread::available_parallelism().map_or(1, |n| n.get()));
    let loads: Vec<String> = b.loads_s.iter().map(|l| format!("{l:.2}")).collect();
    s.push_str(&format!(
        "  load at launch     {:>7.2} s   best of {} fresh launches ({} s; the served one until serving took {launch_s:.2} s)\n",
        b.load_s,
        b.loads_s.len(),
        loads.join(", ")
    ));
    s.push_str(&format!(
        "  update A -> B      {:>7.2} s   {:.2}x the load (goal <= 1.5x), {}\n",
        b.update_s,
        b.update_over_load,
        if b.update_ok { "ok" } else { "FAILED" }
    ));
    s.push_str(&format!(
        "    of which the roll {:>6.2} s   {:.2}x the load (then the consistency report it answers with)\n",
        b.roll_s, b.roll_over_load
    ));
    s.push_str(&format!("  probe capacity     {:>7.2} /s  (load at {:.2} /s, half)\n", b.capacity_per_s, b.load_rate_per_s));
    s.push_str(&format!(
        "  probe latency      before p50 {:.3} s p99 {:.3} s ({} probes); during p50 {:.3} s p99 {:.3} s ({} probes)\n",
        b.before.p50_s, b.before.p99_s, b.before.probes, b.during.p50_s, b.during.p99_s, b.during.probes
    ));
    s.push_str(&format!(
        "  p99 during / before {:>6.2}x (goal <= 3x); failed probes {} before, {} during (goal 0)\n",
        b.p99_during_over_before, b.before.failed, b.during.failed
    ));
    if let Some(c) = &b.cpu {
        s.push_str(&format!("  CPU                {}\n", c.render(b.load_s)));
    }
    if let Some(c) = &b.cpu_by_process_before_per_s {
        s.push_str(&format!("    per s before     {}\n", c.render()));
    }
    if let Some(c) = &b.cpu_by_process {
        s.push_str(&format!("    in the update    {}\n", c.render()));
    }
    for p in &b.slowest_during {
        s.push_str(&format!(
            "  slow probe: sent {:.2} s into the update, {:.3} s, replica {} on {}\n",
            p.sent_s, p.latency_s, p.replica, p.version
        ));
    }
    for step in &b.steps {
        s.push_str(&format!("  step: {step}\n"));
    }
    let k = &b.back;
    s.push_str(&format!(
        "  then back to A    {:>7.2} s   the roll {:.2} s, {:.2}x the load{}; during p50 {:.3} s p99 {:.3} s ({} probes, {} failed), p99 / before {:.2}x\n",
        k.update_s,
        k.roll_s,
        k.roll_over_load,
        if k.update_ok { "" } else { ", FAILED" },
        k.during.p50_s,
        k.during.p99_s,
        k.during.probes,
        k.during.failed,
        k.p99_during_over_before
    ));
    if let Some(c) = &k.cpu {
        s.push_str(&format!("    CPU              {}\n", c.render(b.load_s)));
    }
    if let Some(c) = &k.cpu_by_process {
        s.push_str(&format!("      in the update  {}\n", c.render()));
    }
    for step in &k.steps {
        s.push_str(&format!("    step: {step}\n"));
    }
    for e in &b.errors {
        s.push_str(&format!("  error: {e}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_parses_into_busy_and_all_ticks() {
        let stat = "cpu  100 5 20 800 10 2 3 7 40 0\ncpu0 50 2 10 400 5 1 1 3 20 0\nintr 1 2\n";
        let t = CpuTimes::parse(stat).expect("Linux's first line");
        assert_eq!((t.busy, t.all), (100 + 5 + 20 + 2 + 3, 130 + 800 + 10 + 7));
        let later = CpuTimes { busy: t.busy + 30, all: t.all + 40 };
        assert_eq!(later.busy_since(Some(t)), Some(0.75));
        // No time passed, an earlier sample missing, or lines that are not /proc/stat's.
        assert_eq!(t.busy_since(Some(t)), None);
        assert_eq!(later.busy_since(None), None);
        for bad in ["", "cpu0 1 2 3 4 5 6 7 8\n", "cpu  1 2 3 4 5 6 7\n", "cpu  1 2 x 4 5 6 7 8\n"] {
            assert!(CpuTimes::parse(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn proc_pid_stat_gives_user_plus_system_seconds_past_any_command_name() {
        // SAFETY: sysconf reads a constant of the system.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        // Fields 14 and 15 (utime 250, stime 50), after a command name with spaces and ')'.
        let line = "4242 (tokio (rt) worker) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0 123 456 789\n";
        assert_eq!(ProcessCpu::parse_stat(line), Some(300.0 / hz));
        for bad in ["", "4242 tokio S 1 2 3", "4242 (x) S 1 2 3 4 5 6 7 8 9 10 x 0", "4242 (x) S 1 2 3 4 5 6 7 8 9 10 250"] {
            assert_eq!(ProcessCpu::parse_stat(bad), None, "{bad:?}");
        }
        // This process, read as the bench reads its ranks: nothing in a background pool.
        let me = ProcessCpu::of(std::process::id()).expect("Linux's /proc");
        assert!(me.all >= 0.0 && me.background == 0.0, "{me:?}");
        // Differences by group: ranks first, then the coordinator and this bench.
        let p = Processes { ranks: vec![1, 2], coordinator: 3 };
        let at = |all, background| Some(ProcessCpu { all, background });
        let spent =
            p.spent(&[at(1.0, 0.5), at(2.0, 0.0), at(0.1, 0.0), at(0.2, 0.0)], &[at(2.0, 1.0), at(3.5, 0.25), at(0.4, 0.0), at(0.2, 0.0)]);
        let s = spent.expect("every process read twice");
        assert_eq!((s.ranks_background_s, s.ranks_serving_s, s.coordinator_s, s.client_s), (0.75, 1.75, 0.30000000000000004, 0.0));
        assert!(
            p.spent(&[at(1.0, 0.0), None, at(0.0, 0.0), at(0.0, 0.0)], &[at(1.0, 0.0); 4]).is_none(),
            "a process that could not be read"
        );
    }

    #[test]
    fn the_floor_is_the_updates_own_work_in_the_cores_the_probes_leave() {
        // 2 cores, half busy before, fully busy for a 2 s update: 2 core-s of its own work, which
        // the one core the probes leave does in 2 s, 4x a 0.5 s load.
        let c = CpuUse::of(2, Some(0.5), Some(1.0), 2.0, 0.5).expect("both shares");
        assert_eq!((c.work_core_s, c.floor_s, c.floor_over_load), (2.0, 2.0, 4.0));
        // Busier before than during (noise) is no negative work.
        assert_eq!(CpuUse::of(2, Some(0.6), Some(0.5), 2.0, 0.5).map(|c| c.work_core_s), Some(0.0));
        assert!(CpuUse::of(2, None, Some(1.0), 2.0, 0.5).is_none());
    }
}
