//! Command-line pieces both binaries share.

use clap::{Args, ValueEnum};
use orchestrator_model::{Generator, ModelConfig, ModelError, Preset};

use crate::source::LoadSource;

/// `serve`: the Worker gRPC server of one rank.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks a free one). Default: the --advertise address when it
    /// is an IP, every interface when it is a name, else loopback. The TP-ring listener binds
    /// the same IP.
    #[arg(long)]
    pub listen: Option<std::net::SocketAddr>,
    /// Coordinator to register with (`http://host:port`, or `https://` with --tls-dir).
    #[arg(long)]
    pub coordinator: Option<String>,
    /// This worker's rank (dp-major: dp x tp_size + tp), or `auto`: from the engine that started
    /// it (Slurm, LeaderWorkerSet, StatefulSet, Indexed Job; see the placement module).
    #[arg(long, value_name = "auto|N", conflicts_with = "worker_id")]
    pub rank: Option<crate::placement::RankArg>,
    /// The rank, given by `orchestrator launch`.
    #[arg(long, hide = true)]
    pub worker_id: Option<u32>,
    /// The host (name or IP) peers and the coordinator reach this worker at: advertised for its
    /// gRPC and TP-ring ports. Default: `POD_IP`, else the listen address.
    #[arg(long, value_name = "HOST")]
    pub advertise: Option<String>,
    /// Seconds to keep trying to register while the coordinator is not reachable yet (engines
    /// start workers and coordinator together); a refusal ends the worker at once.
    #[arg(long, value_name = "SECS")]
    pub join_timeout: Option<f64>,
    /// The cluster's shared token: every Worker RPC must carry it (without one, none is checked).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<std::path::PathBuf>,
    /// A directory this worker may read checkpoints from (repeatable; none: no checkpoint is read).
    #[arg(long, value_name = "DIR")]
    pub allow_root: Vec<std::path::PathBuf>,
    /// A directory under which this worker may write the dumps an assignment asks for
    /// (`launch --dump DIR` starts its workers with DIR); without it, such an assignment is
    /// refused (a token holder cannot make workers write anywhere else).
    #[arg(long, value_name = "DIR")]
    pub dump_root: Option<std::path::PathBuf>,
    /// Seconds to keep serving while the coordinator is unreachable (a coordinator restarted
    /// from its state directory finds the worker again meanwhile).
    #[arg(long, default_value_t = 3.0, value_name = "SECS")]
    pub coordinator_grace: f64,
    /// Serve over TLS with the cluster's files in DIR (`ca.pem`, `node.pem`, `node.key`); the
    /// coordinator address is then `https://`.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<std::path::PathBuf>,
    /// Allow a non-loopback --listen address without TLS.
    #[arg(long)]
    pub insecure: bool,
    /// Also serve grpc.health.v1 (readiness and liveness only) in plaintext on ADDR, for
    /// Kubernetes' native gRPC probes, which cannot speak TLS.
    #[arg(long, value_name = "ADDR")]
    pub health_listen: Option<std::net::SocketAddr>,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics: this rank's load
    /// seconds and bytes by load path, the version it serves, its probes.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

impl ServeArgs {
    /// Serves until shut down.
    pub fn run(self) -> anyhow::Result<()> {
        use crate::placement::{RankArg, resolve};
        let tls = self.tls_dir.as_deref().map(orchestrator_net::tls::TlsFiles::load).transpose()?;
        let env = |k: &str| std::env::var(k).ok();
        let placement = match (self.worker_id, self.rank) {
            (Some(id), _) => resolve(RankArg::Fixed(id), true, &env)?,
            (None, Some(arg)) => resolve(arg, false, &env)?,
            (None, None) => resolve(RankArg::Fixed(0), false, &env)?,
        };
        let advertise = self.advertise.clone().or_else(|| placement.advertise.clone());
        let listen = match (self.listen, advertise.as_deref().map(str::parse::<std::net::IpAddr>)) {
            (Some(l), _) => l,
            (None, Some(Ok(ip))) => std::net::SocketAddr::new(ip, 0),
            (None, Some(Err(_))) => std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
            (None, None) => std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        if listen.ip().is_unspecified() && advertise.is_none() {
            anyhow::bail!("--listen {listen} binds every interface: say which address peers reach this worker at with --advertise HOST");
        }
        orchestrator_net::tls::check_listen(listen, tls.as_ref(), self.insecure, "--listen").map_err(anyhow::Error::msg)?;
        crate::device::narrow_to_local_gpu(placement.local_index);
        let secs = |v: f64, flag: &str| std::time::Duration::try_from_secs_f64(v).map_err(|e| anyhow::anyhow!("{flag} {v}: {e}"));
        crate::server::run(crate::server::ServeConfig {
            tls,
            listen,
            advertise,
            coordinator: self.coordinator,
            placement,
            join_timeout: match self.join_timeout {
                Some(v) => secs(v, "--join-timeout")?,
                None => orchestrator_proto::limits::JOIN_TIMEOUT,
            },
            token: self.token_file.as_deref().map(orchestrator_net::auth::Token::read).transpose()?,
            roots: orchestrator_model::AllowedRoots::new(&self.allow_root)?,
            dump_root: self
                .dump_root
                .as_deref()
                .map(|d| crate::dump::DumpRoot::open(d).map_err(|e| anyhow::anyhow!("--dump-root {}: {e}", d.display())))
                .transpose()?,
            coordinator_grace: secs(self.coordinator_grace, "--coordinator-grace")?,
            health_listen: self.health_listen,
            metrics_listen: self.metrics_listen,
        })
    }
}

/// Storage format of generated weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DummyDtype {
    Fp8,
    Bf16,
}

/// `--dummy [--seed S] [--preset P] [--layers N] [--dtype fp8|bf16]`.
#[derive(Args, Clone, Debug)]
pub struct DummyArgs {
    /// Generate the weights instead of reading a checkpoint (byte-identical to
    /// `orchestrator checkpoint synth` with the same seed).
    #[arg(long)]
    pub dummy: bool,
    /// Generator seed for --dummy.
    #[arg(long, default_value_t = 0, requires = "dummy")]
    pub seed: u64,
    /// Geometry for --dummy.
    #[arg(long, default_value = "dsv41-flash", requires = "dummy")]
    pub preset: String,
    /// Layers for --dummy (default: the preset's).
    #[arg(long, requires = "dummy")]
    pub layers: Option<usize>,
    /// Storage format for --dummy.
    #[arg(long, value_enum, default_value = "fp8", requires = "dummy")]
    pub dtype: DummyDtype,
}

impl DummyArgs {
    pub fn preset(&self) -> Result<Preset, ModelError> {
        self.preset.parse()
    }

    /// The validated configuration these options describe.
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        ModelConfig::from_preset(self.preset()?, self.layers, self.dtype == DummyDtype::Bf16)
    }

    /// The dummy load source.
    pub fn source(&self) -> Result<LoadSource, ModelError> {
        Ok(LoadSource::Dummy { config: self.config()?, generator: Generator::new(self.seed) })
    }
}
