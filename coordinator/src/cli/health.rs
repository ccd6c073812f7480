//! `health`: a server's grpc.health.v1 status, for container healthchecks and scripts.

use std::path::PathBuf;

use clap::Args;
use orchestrator_net::tls::describe_status;
use orchestrator_ops::output::emit;

#[derive(Args)]
pub struct HealthArgs {
    /// The server, e.g. http://10.0.0.5:50051 (https:// with --tls-dir).
    #[arg(long)]
    address: String,
    /// The health service to ask for: "" (readiness: serving verified weights) or `liveness`.
    #[arg(long, default_value = "")]
    service: String,
    /// The cluster's TLS directory (its `ca.pem`), for an `https://` server.
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<PathBuf>,
    /// Keep asking for up to SECS until the answer is SERVING.
    #[arg(long, value_name = "SECS", default_value_t = 0.0)]
    wait: f64,
}

/// Prints the server's status: true when it is SERVING (within `--wait`).
pub fn health_cmd(a: HealthArgs) -> anyhow::Result<bool> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let wait = std::time::Duration::try_from_secs_f64(a.wait).map_err(|e| anyhow::anyhow!("--wait {}: {e}", a.wait))?;
    let tls = a.tls_dir.as_deref().map(orchestrator_net::tls::TlsFiles::load_client).transpose()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let start = std::time::Instant::now();
        loop {
            let answer = async {
                let channel = orchestrator_net::tls::connect(&a.address, tls.as_ref()).await?;
                let mut req = tonic::Request::new(HealthCheckRequest { service: a.service.clone() });
                req.set_timeout(std::time::Duration::from_secs(5));
                let r = HealthClient::new(channel).check(req).await.map_err(|s| anyhow::anyhow!("{}", describe_status(&s)))?;
                anyhow::Ok(r.into_inner().status())
            }
            .await;
            let serving = matches!(answer, Ok(ServingStatus::Serving));
            if serving || start.elapsed() >= wait {
                let what = match &answer {
                    Ok(s) => s.as_str_name().to_string(),
                    Err(e) => format!("UNREACHABLE ({})", orchestrator_ops::output::error_text(e)),
                };
                emit(&format!("{what}\n"));
                return Ok(serving);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
}
