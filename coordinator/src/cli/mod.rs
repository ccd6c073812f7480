//! The `orchestrator` command line: [`Cli`] parsed by clap, [`main`] dispatching each command
//! to the module that runs it, one module per command or command family.

pub mod bench;
pub mod checkpoint;
pub mod health;
pub mod launch;
pub mod load;
pub mod manifest;
pub mod probe;
pub mod recover;
pub mod remote;
pub mod schema;
pub mod tls;
pub mod update;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "orchestrator",
    version,
    about = "Loads DeepSeek-V4.1 mega-attention weights across ranks and proves every rank holds what its kernels expect"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log events (stderr, filtered by RUST_LOG) as text or as JSON, one event per line.
    #[arg(long, global = true, value_enum, default_value_t, env = "ORCHESTRATOR_LOG_FORMAT")]
    pub log_format: orchestrator_ops::logging::LogFormat,
}

#[derive(Subcommand)]
pub enum Command {
    /// Start a coordinator and one worker process per rank, load, probe, and print the
    /// consistency report (exit code 0 only when every check agrees).
    Launch(launch::LaunchArgs),
    /// The coordinator alone: wait for the TP x DP workers that Slurm, Kubernetes or a user
    /// start (`orchestrator-worker serve --coordinator URL --rank auto`) to register, then
    /// assign, load, probe and report as `launch` does (and with --serve, keep serving).
    Coordinator(launch::CoordinatorArgs),
    /// Re-run the checks of a `launch --serve` cluster.
    Report(remote::RemoteArgs),
    /// Stop a `launch --serve` cluster.
    Shutdown(remote::RemoteArgs),
    /// Roll a new checkpoint (same geometry) across a `--serve` cluster, one replica at a time,
    /// each verified before an all-ranks swap.
    Update(update::UpdateArgs),
    /// A bounded probe load through the coordinator's rotation: counts per replica and version,
    /// latency percentiles.
    Probe(probe::ProbeLoadArgs),
    /// Restart a coordinator that died from its `--state-dir`: adopt the running workers,
    /// finish (or `--rollback`) the update it left in flight, report, and serve.
    Recover(recover::RecoverArgs),
    /// A server's grpc.health.v1 status (coordinator or worker; no token needed): exit code 0
    /// only when SERVING, i.e. ready on verified weights (a container healthcheck, a script).
    Health(health::HealthArgs),
    /// Benchmarks that run a served cluster as a user would.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Checkpoint tools.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Check dumped ranks of any engine (`rank{R}.safetensors` with the kernel tensors under
    /// their parameter names) against a manifest; a tensor that differs is named with its most
    /// likely cause (permutation skipped or doubled, scales not swizzled or packed, the other
    /// scale rule, another rank's shard). Exit code 0 only when every tensor matches.
    VerifyDump(manifest::VerifyDumpArgs),
    /// The JSON Schema of a `--json` document (report, update, probe, manifest, verify-dump), or
    /// with --out every schema written into DIR.
    Schema(schema::SchemaArgs),
    /// TLS for clusters that listen beyond loopback.
    #[command(subcommand)]
    Tls(tls::TlsCommand),
    /// The worker server, built in (the launcher uses it when `orchestrator-worker` is not
    /// installed next to this binary).
    #[command(hide = true)]
    WorkerServe(orchestrator_worker::cli::ServeArgs),
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// A rolling update of a served TP x DP cluster under a probe load at half its capacity:
    /// update / load, probe latency before and during, failed probes.
    Update(bench::BenchUpdateArgs),
}

#[derive(Subcommand)]
pub enum CheckpointCommand {
    /// Write a synthetic Hugging Face checkpoint (config.json, index, safetensors shards).
    Synth(checkpoint::SynthArgs),
    /// Print geometry, tensors and sizes, and validate every in-scope tensor.
    Inspect(checkpoint::InspectArgs),
    /// Every TP rank's expected kernel tensors (dtype, shape, XXH3-64), rank digests and layout
    /// identity, computed with the independent golden path, plus each tensor's digests in the
    /// known wrong layouts: what `verify-dump` checks an engine's ranks against.
    Manifest(manifest::ManifestArgs),
}

/// Parses the command line, sets up logging, runs the command, and maps its outcome to the
/// exit code (0 only when it succeeded and every check it ran agreed).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    orchestrator_ops::logging::init(cli.log_format);
    let result = match cli.command {
        Command::Launch(a) => launch::launch_cmd(a),
        Command::Coordinator(a) => launch::coordinator_cmd(a),
        Command::Report(a) => remote::remote_cmd(a, false),
        Command::Shutdown(a) => remote::remote_cmd(a, true),
        Command::Update(a) => update::update_cmd(a),
        Command::Probe(a) => probe::probe_cmd(a),
        Command::Recover(a) => recover::recover_cmd(a),
        Command::Health(a) => health::health_cmd(a),
        Command::Bench(BenchCommand::Update(a)) => bench::bench_update(a),
        Command::Tls(tls::TlsCommand::Generate { out, name }) => tls::generate(out, name),
        Command::WorkerServe(a) => a.run().map(|()| true),
        Command::Checkpoint(CheckpointCommand::Synth(a)) => checkpoint::synth(a),
        Command::Checkpoint(CheckpointCommand::Inspect(a)) => checkpoint::inspect_cmd(a),
        Command::Checkpoint(CheckpointCommand::Manifest(a)) => manifest::manifest_cmd(a),
        Command::VerifyDump(a) => manifest::verify_dump_cmd(a),
        Command::Schema(a) => schema::schema_cmd(a),
    };
    orchestrator_ops::output::exit_code(result)
}
