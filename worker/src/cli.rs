//! Command-line pieces both binaries share.

use clap::{Args, ValueEnum};
use orchestrator_model::{Generator, ModelConfig, ModelError, Preset};

use crate::source::LoadSource;

/// `serve`: the Worker gRPC server of one rank.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// Address to listen on (loopback by default; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: std::net::SocketAddr,
    /// Coordinator to register with (`http://host:port`).
    #[arg(long)]
    pub coordinator: Option<String>,
    /// This worker's id, given by the launcher.
    #[arg(long, default_value_t = 0)]
    pub worker_id: u32,
    /// The cluster's shared token: every Worker RPC must carry it (without one, none is checked).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<std::path::PathBuf>,
    /// A directory this worker may read checkpoints from (repeatable; none: no checkpoint is read).
    #[arg(long, value_name = "DIR")]
    pub allow_root: Vec<std::path::PathBuf>,
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
}

impl ServeArgs {
    /// Serves until shut down.
    pub fn run(self) -> anyhow::Result<()> {
        let tls = self.tls_dir.as_deref().map(crate::tls::TlsFiles::load).transpose()?;
        crate::tls::check_listen(self.listen, tls.as_ref(), self.insecure, "--listen").map_err(anyhow::Error::msg)?;
        crate::server::run(crate::server::ServeConfig {
            tls,
            listen: self.listen,
            coordinator: self.coordinator,
            worker_id: self.worker_id,
            token: self.token_file.as_deref().map(crate::auth::Token::read).transpose()?,
            roots: crate::auth::AllowedRoots::new(&self.allow_root)?,
            coordinator_grace: std::time::Duration::try_from_secs_f64(self.coordinator_grace)
                .map_err(|e| anyhow::anyhow!("--coordinator-grace {}: {e}", self.coordinator_grace))?,
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
