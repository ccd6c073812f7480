//! Who started this worker, which rank it is, what its host is called and where its peers reach
//! it. A worker started by `orchestrator launch` is told its rank; one started by an engine
//! (`--rank auto`) reads it from the variables that engine sets:
//!
//! | engine | rank | world size | host |
//! |---|---|---|---|
//! | Slurm (`srun`) | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURMD_NODENAME` |
//! | LeaderWorkerSet | `LWS_GROUP_INDEX` x `LWS_GROUP_SIZE` + `LWS_WORKER_INDEX` | - | `NODE_NAME` |
//! | Indexed Job | `JOB_COMPLETION_INDEX` | - | `NODE_NAME` |
//! | StatefulSet | the ordinal of `POD_NAME` (or of `HOSTNAME` inside Kubernetes) | - | `NODE_NAME` |
//!
//! `LWS_GROUP_INDEX` is not injected by LWS itself: the manifests set it from the pod label
//! `leaderworkerset.sigs.k8s.io/group-index` through the downward API, and `NODE_NAME` from
//! `spec.nodeName`. `ORCHESTRATOR_WORLD_SIZE` declares the world size where the engine does not.
//! The rank maps to `(dp, tp)` dp-major: `dp = rank / tp_size`, `tp = rank % tp_size`.

use std::fmt;
use std::str::FromStr;

/// `--rank`: a number, or `auto` (from the engine's environment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankArg {
    Auto,
    Fixed(u32),
}

impl FromStr for RankArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            n => n.parse().map(Self::Fixed).map_err(|_| format!("`{n}`: expected `auto` or a rank number")),
        }
    }
}

/// Where a rank number came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankSource {
    /// `orchestrator launch` started the worker.
    Launch,
    /// `--rank N`.
    Flag,
    Slurm,
    Lws,
    StatefulSet,
    IndexedJob,
}

impl RankSource {
    pub fn name(self) -> &'static str {
        match self {
            Self::Launch => "launch",
            Self::Flag => "flag",
            Self::Slurm => "slurm",
            Self::Lws => "lws",
            Self::StatefulSet => "statefulset",
            Self::IndexedJob => "indexed-job",
        }
    }
}

impl fmt::Display for RankSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a rank could not be found.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlacementError {
    #[error(
        "--rank auto: no engine variables found (SLURM_PROCID; LWS_WORKER_INDEX with LWS_GROUP_SIZE and LWS_GROUP_INDEX; \
         JOB_COMPLETION_INDEX; or POD_NAME ending in -N); pass --rank N"
    )]
    NoEngine,
    #[error("--rank auto: {var}=`{value}`: {why}")]
    BadVariable { var: &'static str, value: String, why: String },
    #[error("--rank auto: {engine} sets {var} but not {missing}")]
    Missing { engine: RankSource, var: &'static str, missing: &'static str },
    #[error("--rank auto: rank {rank} (from {engine}) is not below the world size {world}")]
    OutOfRange { engine: RankSource, rank: u32, world: u32 },
}

/// Who this worker is, as its engine knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub rank: u32,
    /// The world size the engine declares (`None`: it does not say).
    pub world_size: Option<u32>,
    /// The task's index on its node (`SLURM_LOCALID`): which of the node's GPUs is this worker's.
    pub local_index: Option<u32>,
    pub source: RankSource,
    /// The host's name as the engine knows it.
    pub host: String,
    /// The address peers reach this worker at, when the engine says (`POD_IP`).
    pub advertise: Option<String>,
}

fn number(env: &dyn Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<u32>, PlacementError> {
    match env(var) {
        None => Ok(None),
        Some(v) => v.trim().parse::<u32>().map(Some).map_err(|e| PlacementError::BadVariable { var, value: v, why: e.to_string() }),
    }
}

/// The ordinal a StatefulSet gives its pod: the number after the name's last `-`.
fn ordinal(name: &str) -> Option<u32> {
    let (_, n) = name.rsplit_once('-')?;
    (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then(|| n.parse().ok())?
}

/// The host name reports show: `ORCHESTRATOR_NODE_NAME`, `SLURMD_NODENAME`, `NODE_NAME` (the
/// pod's node through the downward API), else the kernel's host name.
pub fn host_name(env: &dyn Fn(&str) -> Option<String>) -> String {
    ["ORCHESTRATOR_NODE_NAME", "SLURMD_NODENAME", "NODE_NAME"]
        .into_iter()
        .find_map(|v| env(v).filter(|s| !s.trim().is_empty()))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "localhost".into())
        })
}

/// Resolves `--rank` against the environment `env` gives (a function, so tests pass tables).
pub fn resolve(arg: RankArg, launched: bool, env: &dyn Fn(&str) -> Option<String>) -> Result<Placement, PlacementError> {
    let declared = number(env, "ORCHESTRATOR_WORLD_SIZE")?;
    let (rank, world_size, source) = match arg {
        RankArg::Fixed(n) => (n, declared, if launched { RankSource::Launch } else { RankSource::Flag }),
        RankArg::Auto => {
            if let Some(rank) = number(env, "SLURM_PROCID")? {
                let world = number(env, "SLURM_NTASKS")?.ok_or(PlacementError::Missing {
                    engine: RankSource::Slurm,
                    var: "SLURM_PROCID",
                    missing: "SLURM_NTASKS",
                })?;
                (rank, Some(world), RankSource::Slurm)
            } else if let Some(index) = number(env, "LWS_WORKER_INDEX")? {
                let missing = |m| PlacementError::Missing { engine: RankSource::Lws, var: "LWS_WORKER_INDEX", missing: m };
                let size = number(env, "LWS_GROUP_SIZE")?.ok_or(missing("LWS_GROUP_SIZE"))?;
                let group = number(env, "LWS_GROUP_INDEX")?.ok_or(missing("LWS_GROUP_INDEX"))?;
                if index >= size {
                    return Err(PlacementError::OutOfRange { engine: RankSource::Lws, rank: index, world: size });
                }
                let rank = group.checked_mul(size).and_then(|r| r.checked_add(index)).ok_or_else(|| PlacementError::BadVariable {
                    var: "LWS_GROUP_INDEX",
                    value: group.to_string(),
                    why: format!("group {group} x size {size} overflows"),
                })?;
                (rank, declared, RankSource::Lws)
            } else if let Some(index) = number(env, "JOB_COMPLETION_INDEX")? {
                (index, declared, RankSource::IndexedJob)
            } else {
                let name = env("POD_NAME").or_else(|| env("KUBERNETES_SERVICE_HOST").and_then(|_| env("HOSTNAME")));
                match name {
                    Some(n) => {
                        let rank = ordinal(&n).ok_or_else(|| PlacementError::BadVariable {
                            var: "POD_NAME",
                            value: n.clone(),
                            why: "a StatefulSet pod's name ends in -ORDINAL".into(),
                        })?;
                        (rank, declared, RankSource::StatefulSet)
                    }
                    None => return Err(PlacementError::NoEngine),
                }
            }
        }
    };
    if let Some(world) = world_size
        && rank >= world
    {
        return Err(PlacementError::OutOfRange { engine: source, rank, world });
    }
    Ok(Placement {
        rank,
        world_size,
        local_index: number(env, "SLURM_LOCALID")?,
        source,
        host: host_name(env),
        advertise: env("POD_IP").map(|s| s.trim().to_string()).filter(|s| !s.is_empty()),
    })
}

/// `host:port` with an IPv6 host in brackets.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| map.get(k).cloned()
    }

    #[test]
    fn engines_give_rank_world_and_host() {
        type Case<'a> = (&'a [(&'a str, &'a str)], u32, Option<u32>, RankSource, &'a str);
        let cases: &[Case] = &[
            (
                &[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "1"), ("SLURMD_NODENAME", "n2")],
                3,
                Some(4),
                RankSource::Slurm,
                "n2",
            ),
            (
                &[("LWS_WORKER_INDEX", "1"), ("LWS_GROUP_SIZE", "2"), ("LWS_GROUP_INDEX", "3"), ("NODE_NAME", "gpu-7")],
                7,
                None,
                RankSource::Lws,
                "gpu-7",
            ),
            (
                &[("JOB_COMPLETION_INDEX", "5"), ("ORCHESTRATOR_WORLD_SIZE", "8"), ("NODE_NAME", "a")],
                5,
                Some(8),
                RankSource::IndexedJob,
                "a",
            ),
            (&[("POD_NAME", "orchestrator-worker-12"), ("NODE_NAME", "b")], 12, None, RankSource::StatefulSet, "b"),
            (&[("KUBERNETES_SERVICE_HOST", "10.0.0.1"), ("HOSTNAME", "w-0"), ("NODE_NAME", "c")], 0, None, RankSource::StatefulSet, "c"),
            // Slurm wins over a pod name, and the override names the host.
            (
                &[
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "1"),
                    ("POD_NAME", "x-3"),
                    ("ORCHESTRATOR_NODE_NAME", "h1"),
                    ("SLURMD_NODENAME", "n1"),
                ],
                0,
                Some(1),
                RankSource::Slurm,
                "h1",
            ),
        ];
        for (env, rank, world, source, host) in cases {
            let p = resolve(RankArg::Auto, false, &env_of(env)).unwrap();
            assert_eq!((p.rank, p.world_size, p.source, p.host.as_str()), (*rank, *world, *source, *host), "{env:?}");
        }
        let p = resolve(RankArg::Auto, false, &env_of(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "1")])).unwrap();
        assert_eq!(p.local_index, Some(1));
        let p = resolve(RankArg::Fixed(2), false, &env_of(&[("POD_IP", "10.1.2.3")])).unwrap();
        assert_eq!((p.rank, p.source, p.advertise.as_deref()), (2, RankSource::Flag, Some("10.1.2.3")));
    }

    #[test]
    fn bad_environments_are_refused_by_kind() {
        let cases: &[(&[(&str, &str)], PlacementError)] = &[
            (&[], PlacementError::NoEngine),
            (&[("HOSTNAME", "laptop-3")], PlacementError::NoEngine),
            (&[("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4")], PlacementError::OutOfRange { engine: RankSource::Slurm, rank: 4, world: 4 }),
            (&[("SLURM_PROCID", "0")], PlacementError::Missing { engine: RankSource::Slurm, var: "SLURM_PROCID", missing: "SLURM_NTASKS" }),
            (
                &[("LWS_WORKER_INDEX", "0"), ("LWS_GROUP_SIZE", "2")],
                PlacementError::Missing { engine: RankSource::Lws, var: "LWS_WORKER_INDEX", missing: "LWS_GROUP_INDEX" },
            ),
            (
                &[("LWS_WORKER_INDEX", "2"), ("LWS_GROUP_SIZE", "2"), ("LWS_GROUP_INDEX", "0")],
                PlacementError::OutOfRange { engine: RankSource::Lws, rank: 2, world: 2 },
            ),
        ];
        for (env, want) in cases {
            assert_eq!(&resolve(RankArg::Auto, false, &env_of(env)).unwrap_err(), want, "{env:?}");
        }
        for (var, value) in [("SLURM_PROCID", "-1"), ("SLURM_PROCID", "x"), ("POD_NAME", "worker"), ("POD_NAME", "w-1a")] {
            let mut env = vec![(var, value)];
            if var == "SLURM_PROCID" {
                env.push(("SLURM_NTASKS", "2"));
            }
            assert!(matches!(resolve(RankArg::Auto, false, &env_of(&env)), Err(PlacementError::BadVariable { .. })), "{var}={value}");
        }
        assert_eq!(
            resolve(RankArg::Fixed(8), false, &env_of(&[("ORCHESTRATOR_WORLD_SIZE", "8")])).unwrap_err(),
            PlacementError::OutOfRange { engine: RankSource::Flag, rank: 8, world: 8 }
        );
        assert_eq!("auto".parse::<RankArg>(), Ok(RankArg::Auto));
        assert_eq!("7".parse::<RankArg>(), Ok(RankArg::Fixed(7)));
        assert!("seven".parse::<RankArg>().is_err());
        assert_eq!(join_host_port("::1", 5), "[::1]:5");
        assert_eq!(join_host_port("10.0.0.1", 5), "10.0.0.1:5");
    }
}
