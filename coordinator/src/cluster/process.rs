//! A worker's process as the coordinator knows it: a child it started, one adopted from the
//! state directory, or one started elsewhere (an engine, a user); the worker command, the
//! threads of each worker's pool and the GPUs workers are spread over.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use orchestrator_ops::process::ProcessIdentity;
use tokio::process::Child;

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
pub(super) fn kill_adopted(identity: &ProcessIdentity) {
    if !identity.alive() {
        return;
    }
    if let Err(e) = identity.kill() {
        tracing::warn!("not signalling adopted worker: {e}");
        eprintln!("warning: not signalling pid {}: {e}", identity.pid);
    }
}

/// The most GPUs `ORCHESTRATOR_GPUS` may name (hosts have 8 or 16).
const MAX_GPUS: usize = 1024;

/// The GPUs workers are spread over: the launcher's `CUDA_VISIBLE_DEVICES` entries, or
/// `0..ORCHESTRATOR_GPUS`, or every GPU this process sees (at least one).
pub(super) fn gpu_list() -> anyhow::Result<Vec<String>> {
    let env = |name: &str| std::env::var(name).ok();
    gpus_from(env("CUDA_VISIBLE_DEVICES").as_deref(), env("ORCHESTRATOR_GPUS").as_deref(), visible_gpus).map_err(anyhow::Error::msg)
}

/// [`gpu_list`] from the two variables' values; `ORCHESTRATOR_GPUS` must be a count from 1 to
/// [`MAX_GPUS`] where it is set and not empty (a typo is an error, not every GPU the process
/// sees).
fn gpus_from(cuda_visible: Option<&str>, count: Option<&str>, visible: impl FnOnce() -> usize) -> Result<Vec<String>, String> {
    if let Some(v) = cuda_visible {
        let list: Vec<String> = v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
        if !list.is_empty() {
            return Ok(list);
        }
    }
    let n = match count.filter(|v| !v.trim().is_empty()) {
        Some(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_GPUS).contains(n))
            .ok_or_else(|| format!("ORCHESTRATOR_GPUS={v:.40}: must be a number of GPUs from 1 to {MAX_GPUS}"))?,
        None => visible(),
    };
    Ok((0..n).map(|i| i.to_string()).collect())
}

/// The GPUs this process sees (one where it sees none, or in a build without the `cuda`
/// feature, whose dummy CUDA module counts none).
pub(super) fn visible_gpus() -> usize {
    orchestrator_kernels::cuda::CudaBackend::device_count().max(1)
}

/// The worker command: the `orchestrator-worker` binary next to this executable (as TGI's
/// launcher finds its shards), or, when it is not there (`cargo run --bin orchestrator` builds
/// only this binary), this executable's own built-in worker.
pub(super) fn worker_command() -> anyhow::Result<(PathBuf, Vec<String>)> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().ok_or_else(|| anyhow::anyhow!("{} has no parent directory", exe.display()))?;
    let path = dir.join(format!("orchestrator-worker{}", std::env::consts::EXE_SUFFIX));
    if path.exists() { Ok((path, vec!["serve".into()])) } else { Ok((exe, vec!["worker-serve".into()])) }
}

/// The variable that sizes a worker's thread pool (rayon's own).
pub(super) const RAYON_THREADS_ENV: &str = "RAYON_NUM_THREADS";

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
pub(super) fn threads_per_worker(cores: usize, tp: u32, inherited: Option<&std::ffi::OsStr>) -> Option<usize> {
    match inherited {
        Some(_) => None,
        None => Some((cores / tp.max(1) as usize).max(1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_come_from_the_launchers_list_then_the_count_then_the_devices() {
        let none = || panic!("the devices are counted only where nothing names the GPUs");
        assert_eq!(gpus_from(Some("3, 5,"), Some("8"), none), Ok(vec!["3".to_string(), "5".to_string()]));
        assert_eq!(gpus_from(Some(""), Some(" 2 "), none), Ok(vec!["0".to_string(), "1".to_string()]));
        assert_eq!(gpus_from(None, None, || 3), Ok(vec!["0".to_string(), "1".to_string(), "2".to_string()]));
        assert_eq!(gpus_from(None, Some(" "), || 1), Ok(vec!["0".to_string()]), "empty is unset");
        for bad in ["0", "1025", "18446744073709551615", "eight"] {
            let e = gpus_from(None, Some(bad), none).unwrap_err();
            assert!(e.starts_with(&format!("ORCHESTRATOR_GPUS={bad}: must be a number of GPUs from 1 to 1024")), "{e}");
        }
    }
}
