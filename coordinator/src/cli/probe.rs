//! `probe`: a bounded probe load through a served cluster's rotation, with its percentiles.

use clap::Args;
use orchestrator_ops::output::emit;

use super::remote::{RemoteArgs, coordinator_client};

#[derive(Args)]
pub struct ProbeLoadArgs {
    #[command(flatten)]
    remote: RemoteArgs,
    /// Probes per second.
    #[arg(long)]
    rate: f64,
    /// Seconds to run.
    #[arg(long)]
    duration: f64,
    /// Probe size: T tokens, S latents, seed.
    #[arg(long, value_name = "T,S[,SEED]", default_value_t = orchestrator_worker::probe::ProbeSpec::SERVING)]
    size: orchestrator_worker::probe::ProbeSpec,
}

/// Runs the probe load and prints its counts and percentiles: true when no probe failed.
pub fn probe_cmd(a: ProbeLoadArgs) -> anyhow::Result<bool> {
    use super::load::{ProbeDocument, at_rate};
    anyhow::ensure!(a.rate > 0.0 && a.rate <= 1000.0, "--rate must be in (0, 1000]");
    anyhow::ensure!(a.duration > 0.0 && a.duration <= 86_400.0, "--duration must be in (0, 86400] seconds");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let (client, token) = coordinator_client(&a.remote).await?;
        let start = std::time::Instant::now();
        let samples = at_rate(&client, token.as_ref(), a.size, a.rate, std::time::Duration::from_secs_f64(a.duration)).await;
        let doc = ProbeDocument::of(&samples, start.elapsed().as_secs_f64());
        if a.remote.json {
            emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
        } else {
            let l = &doc.latency_ms;
            let mut t = format!(
                "probes: {} served, {} failed in {:.1} s; latency p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms\n",
                doc.served, doc.failed, doc.seconds, l.p50, l.p90, l.p99
            );
            for (k, v) in &doc.by_replica {
                t.push_str(&format!("  replica {k}: {} served, {} failed\n", v.served, v.failed));
            }
            for (k, v) in &doc.by_version {
                t.push_str(&format!("  version {k}: {} served, {} failed\n", v.served, v.failed));
            }
            for e in &doc.errors {
                t.push_str(&format!("  error: {e}\n"));
            }
            emit(&t);
        }
        Ok(doc.ok)
    })
}
