//! `recover`: restart a dead coordinator from its state directory.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use orchestrator_ops::output::emit;

use crate::recover;

#[derive(Args)]
pub struct RecoverArgs {
    /// The state directory the dead coordinator journaled to.
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,
    /// Return every replica to the version before the interrupted update instead of finishing it.
    #[arg(long)]
    rollback: bool,
    /// Print the report as one JSON document.
    #[arg(long)]
    json: bool,
    /// Once the cluster serves, write FILE: one JSON object with how to call it (`coordinator`,
    /// `token_file`, `tls_dir`, `pid`), written whole; removed when it stops.
    #[arg(long, value_name = "FILE")]
    ready_file: Option<PathBuf>,
    /// Debugging: the coordinator dies just before (crash-before) or after (crash-after) it
    /// writes line LINE of the journal, or that write fails once (fail); as `launch`'s.
    #[arg(long, value_name = "KIND:LINE")]
    journal_fault: Option<crate::journal::JournalFault>,
}

/// Takes the cluster over from the journal, finishing or rolling back its update, and serves:
/// true when the final report is clean.
pub fn recover_cmd(a: RecoverArgs) -> anyhow::Result<bool> {
    let dir = a.state_dir.canonicalize().with_context(|| format!("--state-dir {}", a.state_dir.display()))?;
    if let Some(f) = &a.ready_file {
        crate::server::Ready::clear(f)?;
    }
    let how = if a.rollback { recover::Resolve::Rollback } else { recover::Resolve::Finish };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let json = a.json;
    runtime.block_on(recover::recover(&dir, how, a.journal_fault, a.ready_file.as_deref(), |report| {
        if json {
            emit(&format!("{}\n", serde_json::to_string_pretty(report).unwrap_or_default()));
        } else {
            emit(&report.render());
        }
    }))
}
