//! `update`: roll a new checkpoint across a served cluster, one replica at a time.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use orchestrator_net::tls::{describe_first_call, describe_status};
use orchestrator_ops::output::emit;

use super::remote::{RemoteArgs, coordinator_client};

#[derive(Args)]
pub struct UpdateArgs {
    #[command(flatten)]
    remote: RemoteArgs,
    /// The new checkpoint directory (must lie under the workers' allowed roots).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Replicas updated at once (never all of them while more than one exists).
    #[arg(long, default_value_t = 1)]
    max_unavailable: u32,
    /// Replicas staging at once (default: every replica). Each stages beside the weights it
    /// serves, so each rank holds two versions while it stages: on one host whose ranks share
    /// its memory, this bounds how many do at a time.
    #[arg(long)]
    max_staging: Option<u32>,
}

/// Asks the coordinator for the rolling update and prints its steps and final report: true
/// when the update succeeded and the report agrees.
pub fn update_cmd(a: UpdateArgs) -> anyhow::Result<bool> {
    use orchestrator_proto::v1 as pb;
    anyhow::ensure!(a.max_unavailable >= 1, "--max-unavailable must be at least 1");
    anyhow::ensure!(a.max_staging != Some(0), "--max-staging must be at least 1");
    let dir = a.checkpoint.canonicalize().with_context(|| format!("--checkpoint {}", a.checkpoint.display()))?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let (mut client, token) = coordinator_client(&a.remote).await?;
        let req = orchestrator_net::auth::request(
            pb::UpdateRequest {
                checkpoint_dir: dir.display().to_string(),
                max_unavailable: a.max_unavailable,
                max_staging: a.max_staging.unwrap_or(0),
            },
            orchestrator_proto::limits::UPDATE_DEADLINE,
            token.as_ref(),
        );
        // A terminal sees the update run (it answers once, at its end); logs and pipes do not.
        let spinner = (std::io::IsTerminal::is_terminal(&std::io::stderr())
            && orchestrator_ops::logging::current() == orchestrator_ops::logging::LogFormat::Text)
            .then(|| {
                let s = indicatif::ProgressBar::new_spinner().with_message(format!("rolling {} out, one replica at a time", dir.display()));
                s.set_style(
                    indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
                );
                s.enable_steady_tick(std::time::Duration::from_millis(120));
                s
            });
        let r = client.update(req).await;
        if let Some(s) = spinner {
            s.finish_and_clear();
        }
        let r = r
            .map_err(|s| match s.code() {
                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => anyhow::anyhow!(
                    "update: lost the coordinator mid-update ({}): every rank holds the old or the verified new version; if it ran with \
                     --state-dir, `orchestrator recover --state-dir DIR` finishes the update (or rolls it back with --rollback)",
                    describe_status(&s)
                ),
                _ => anyhow::anyhow!("update: {}", describe_first_call(&s, &a.remote.coordinator)),
            })?
            .into_inner();
        emit(&if a.remote.json { format!("{}\n", r.json) } else { r.text });
        Ok(r.ok)
    })
}
