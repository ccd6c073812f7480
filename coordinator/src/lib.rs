//! The coordinator of `orchestrator`: it assigns TP x DP shards to per-GPU workers, checks
//! that every rank holds what its kernels expect, rolls weight updates across a served
//! cluster, and reports. The `orchestrator` binary is [`cli::main`].
//!
//! - [`cli`]: the command line, one module per command.
//! - `launch`: starting a cluster (the plan validated, its workers started here or awaited,
//!   shards assigned and loaded); `session`: a cluster that is up, what checks it again, and
//!   the health loop that keeps its rotation true.
//! - `server`, `service`: the coordinator's gRPC endpoint and its Coordinator service.
//! - `cluster`, `registry`: worker processes, their registrations and heartbeats, and the
//!   operations fanned out to every rank; who registered as which rank.
//! - `update`, `rollout`, `rotation`: rolling updates (the batches, commits and aborts) and
//!   the rotation that routes probes around the replicas out of it.
//! - `journal`, `recover`: the update's write-ahead journal, and a dead coordinator's restart
//!   from it.
//! - `consistency`: the per-rank consistency report: its types and rows, the cross-rank rules
//!   (`rules`) and the text (`render`).
//! - `metrics`, `schemas`: Prometheus metrics and the JSON Schemas of the `--json` documents.

pub mod cli;
mod cluster;
mod consistency;
mod journal;
mod launch;
mod metrics;
mod recover;
mod registry;
mod rollout;
mod rotation;
mod schemas;
mod server;
mod service;
mod session;
mod update;
