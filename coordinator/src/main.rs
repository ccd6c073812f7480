//! `orchestrator`: the coordinator CLI: launch a cluster of workers and check it, report on
//! a served cluster, shut it down, and synthesize or inspect checkpoints (all of it in the
//! `orchestrator_coordinator` library; this is its command line).

fn main() -> std::process::ExitCode {
    orchestrator_coordinator::cli::main()
}
