//! What both binaries give an operator, apart from the wire (`orchestrator-net`): their logs,
//! as text or JSON, and the status lines beside them ([`logging`], [`status!`]); command output
//! and the exit code a script reads ([`output`]); the Prometheus endpoint and the pieces both
//! binaries' families are built from ([`metrics`]); and who a process is beyond its pid, so a
//! coordinator signals only the workers it started ([`process`]).

pub mod logging;
pub mod metrics;
pub mod output;
pub mod process;
