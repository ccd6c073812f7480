//! Who registered as which rank. A worker announces its rank (given by `launch`, by `--rank N`,
//! or read from the engine that started it), its address, host and process; the registry admits
//! it only when the rank fits this cluster, the engine's world size is the cluster's, it speaks
//! this protocol, and no other live process holds that rank. Refusals are [`RegisterError`]s
//! that name the rank and both hosts.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use orchestrator_ops::process::ProcessIdentity;
use orchestrator_proto::limits;
use orchestrator_proto::v1 as pb;

/// What a worker told the coordinator when it registered, and when it was last heard from.
#[derive(Clone, Debug)]
pub struct Registration {
    pub address: String,
    pub host: String,
    pub device: String,
    /// The process (pid, start time, boot, executable) as the worker reported it.
    pub process: ProcessIdentity,
    pub last_heartbeat: Instant,
    /// Where its rank number came from (`launch`, `slurm`, `lws`, ...).
    pub rank_source: String,
}

/// Why a registration was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegisterError {
    #[error("register: {0}")]
    BadRequest(String),
    #[error("rank {rank} on host {host} speaks protocol version {theirs}, this coordinator {ours}: run the same release of both binaries")]
    Protocol { rank: u32, host: String, theirs: u32, ours: u32 },
    #[error("rank {rank} ({engine}) on host {host} is out of range: this cluster has {world} ranks, 0 to {last} (dp-major)")]
    OutOfRange { rank: u32, host: String, engine: String, world: u32, last: u32 },
    #[error(
        "rank {rank} on host {host} was started in a world of {declared} tasks ({engine}), but this cluster is {world} ranks: \
         start as many workers as --tp x --dp"
    )]
    WorldMismatch { rank: u32, host: String, engine: String, declared: u32, world: u32 },
    #[error("rank {rank}: pid {pid} on host {host} ({address}) is refused: the rank is held by {holder}{why}")]
    Taken { rank: u32, host: String, pid: u32, address: String, holder: String, why: &'static str },
}

impl From<RegisterError> for tonic::Status {
    fn from(e: RegisterError) -> Self {
        let message = e.to_string();
        match e {
            RegisterError::BadRequest(_) | RegisterError::OutOfRange { .. } => tonic::Status::invalid_argument(message),
            RegisterError::Protocol { .. } | RegisterError::WorldMismatch { .. } => tonic::Status::failed_precondition(message),
            RegisterError::Taken { .. } => tonic::Status::already_exists(message),
        }
    }
}

/// Registrations by rank, shared with the Coordinator service.
#[derive(Default)]
pub struct Registry {
    workers: Mutex<HashMap<u32, Registration>>,
    /// The cluster's TP x DP (0: not known yet, any rank is taken as it comes).
    world: std::sync::atomic::AtomicU32,
    /// Set once the cluster is assembled: a rank is never handed to another process afterwards.
    assembled: AtomicBool,
}

impl Registry {
    /// A registry for a cluster of `world` ranks.
    pub fn for_world(world: u32) -> Self {
        let r = Self::default();
        r.world.store(world, Ordering::SeqCst);
        r
    }

    pub fn world(&self) -> u32 {
        self.world.load(Ordering::SeqCst)
    }

    /// Every rank has its process: from now on a rank's registration may only be renewed by the
    /// same process (after a coordinator restart), never taken over.
    pub fn assembled(&self) {
        self.assembled.store(true, Ordering::SeqCst);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Registration>> {
        self.workers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `r` as rank `id` unconditionally (a launcher's own children, adopted workers).
    pub fn register(&self, id: u32, r: Registration) {
        self.lock().insert(id, r);
    }

    /// Admits a worker's registration request, or says why not.
    pub fn admit(&self, r: pb::RegisterRequest) -> Result<(), RegisterError> {
        if r.address.is_empty() || r.address.len() > limits::MAX_PATH_BYTES || r.host.len() > limits::MAX_PATH_BYTES {
            return Err(RegisterError::BadRequest("address is empty, or address or host is longer than 4096 bytes".into()));
        }
        if r.device.len() > limits::MAX_PATH_BYTES || r.rank_source.len() > 64 || r.executable.len() > limits::MAX_PATH_BYTES {
            return Err(RegisterError::BadRequest("device, rank_source or executable is too long".into()));
        }
        let (rank, host) = (r.worker_id, r.host.clone());
        if r.protocol_version != orchestrator_proto::PROTOCOL_VERSION {
            return Err(RegisterError::Protocol { rank, host, theirs: r.protocol_version, ours: orchestrator_proto::PROTOCOL_VERSION });
        }
        let source = if r.rank_source.is_empty() { "launch".to_string() } else { r.rank_source.clone() };
        let world = self.world();
        if world > 0 && rank >= world {
            return Err(RegisterError::OutOfRange { rank, host, engine: source, world, last: world - 1 });
        }
        if world > 0 && r.world_size != 0 && r.world_size != world {
            return Err(RegisterError::WorldMismatch { rank, host, engine: source, declared: r.world_size, world });
        }
        let process = ProcessIdentity { pid: r.pid, start_ticks: r.start_ticks, boot_id: r.boot_id, executable: r.executable.into() };
        let new = Registration {
            address: r.address,
            host: r.host,
            device: r.device,
            process,
            last_heartbeat: Instant::now(),
            rank_source: source,
        };
        let mut workers = self.lock();
        if let Some(old) = workers.get(&rank) {
            let same = old.process.pid == new.process.pid
                && old.process.start_ticks == new.process.start_ticks
                && old.process.boot_id == new.process.boot_id
                && old.address == new.address;
            let live = old.last_heartbeat.elapsed() < limits::HEARTBEAT_TIMEOUT;
            let why = if same {
                None
            } else if self.assembled.load(Ordering::SeqCst) {
                Some(", and the cluster is running: a rank is not handed to a new process (restart the cluster, or `recover`)")
            } else if live {
                Some(", which is alive: two workers were started for one rank")
            } else {
                // A worker restarted before the cluster assembled: the new process takes over.
                None
            };
            if let Some(why) = why {
                return Err(RegisterError::Taken {
                    rank,
                    host: new.host,
                    pid: new.process.pid,
                    address: new.address,
                    holder: format!("pid {} on host {} ({})", old.process.pid, old.host, old.address),
                    why,
                });
            }
        }
        workers.insert(rank, new);
        Ok(())
    }

    pub fn heartbeat(&self, id: u32) -> bool {
        match self.lock().get_mut(&id) {
            Some(r) => {
                r.last_heartbeat = Instant::now();
                true
            }
            None => false,
        }
    }

    pub fn get(&self, id: u32) -> Option<Registration> {
        self.lock().get(&id).cloned()
    }

    /// The ranks of `0..world` that have registered, by host.
    pub fn by_host(&self, world: u32) -> std::collections::BTreeMap<String, Vec<u32>> {
        let mut hosts: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
        for (rank, r) in self.lock().iter().filter(|(rank, _)| **rank < world) {
            hosts.entry(r.host.clone()).or_default().push(*rank);
        }
        for ranks in hosts.values_mut() {
            ranks.sort_unstable();
        }
        hosts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(rank: u32, pid: u32, host: &str) -> pb::RegisterRequest {
        pb::RegisterRequest {
            worker_id: rank,
            address: format!("http://{host}:5000{pid}"),
            host: host.into(),
            device: "cpu".into(),
            pid,
            protocol_version: orchestrator_proto::PROTOCOL_VERSION,
            start_ticks: 100 + u64::from(pid),
            boot_id: "boot".into(),
            executable: "/bin/orchestrator-worker".into(),
            world_size: 4,
            rank_source: "slurm".into(),
            remote: true,
        }
    }

    #[test]
    fn admission_refuses_by_kind_and_names_rank_and_hosts() {
        let reg = Registry::for_world(4);
        reg.admit(req(0, 1, "n1")).unwrap();
        // The same process again (a coordinator restart, a lost answer): renewed.
        reg.admit(req(0, 1, "n1")).unwrap();
        // Another live process for rank 0.
        let e = reg.admit(req(0, 2, "n2")).unwrap_err();
        assert!(matches!(&e, RegisterError::Taken { rank: 0, pid: 2, .. }), "{e:?}");
        assert!(e.to_string().contains("pid 1 on host n1") && e.to_string().contains("host n2"), "{e}");
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::AlreadyExists);
        // Out of range, another world size, another protocol.
        assert!(matches!(reg.admit(req(4, 3, "n2")), Err(RegisterError::OutOfRange { rank: 4, world: 4, .. })));
        let mut other_world = req(1, 3, "n2");
        other_world.world_size = 8;
        let e = reg.admit(other_world).unwrap_err();
        assert!(matches!(e, RegisterError::WorldMismatch { rank: 1, declared: 8, world: 4, .. }));
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::FailedPrecondition);
        let mut old = req(1, 3, "n2");
        old.protocol_version = 1;
        assert!(matches!(reg.admit(old), Err(RegisterError::Protocol { rank: 1, theirs: 1, .. })));
        let mut empty = req(1, 3, "n2");
        empty.address.clear();
        assert_eq!(tonic::Status::from(reg.admit(empty).unwrap_err()).code(), tonic::Code::InvalidArgument);
        // The engine does not declare a world size: admitted on its rank alone.
        let mut undeclared = req(1, 3, "n2");
        undeclared.world_size = 0;
        reg.admit(undeclared).unwrap();
        assert_eq!(reg.by_host(4), [("n1".to_string(), vec![0]), ("n2".to_string(), vec![1])].into_iter().collect());
    }

    #[test]
    fn a_silent_rank_is_taken_over_only_before_the_cluster_assembles() {
        let reg = Registry::for_world(4);
        reg.admit(req(1, 1, "n1")).unwrap();
        reg.lock().get_mut(&1).unwrap().last_heartbeat = Instant::now() - limits::HEARTBEAT_TIMEOUT * 2;
        // A restarted worker, before the cluster formed: takes over.
        reg.admit(req(1, 2, "n1")).unwrap();
        assert_eq!(reg.get(1).unwrap().process.pid, 2);
        reg.assembled();
        reg.lock().get_mut(&1).unwrap().last_heartbeat = Instant::now() - limits::HEARTBEAT_TIMEOUT * 2;
        let e = reg.admit(req(1, 3, "n2")).unwrap_err();
        assert!(e.to_string().contains("cluster is running"), "{e}");
        // Its own process may still renew it.
        reg.admit(req(1, 2, "n1")).unwrap();
    }
}
