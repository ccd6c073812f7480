//! `report` and `shutdown`: a served cluster's checks re-run, or its end; and the client every
//! command that talks to a running coordinator opens (`update`, `probe`).

use std::path::PathBuf;

use clap::Args;
use orchestrator_net::tls::describe_first_call;
use orchestrator_ops::output::emit;

#[derive(Args)]
pub struct RemoteArgs {
    /// The coordinator, e.g. http://127.0.0.1:50051.
    #[arg(long)]
    pub coordinator: String,
    /// The cluster's token file (printed by `launch --serve`).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
    /// Report without re-running the probes.
    #[arg(long)]
    pub no_probe: bool,
    /// The cluster's TLS directory (its `ca.pem`), for an `https://` coordinator.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
}

/// `report` (`shutdown` false) or `shutdown`: true when the report agrees or the shutdown was asked.
pub fn remote_cmd(a: RemoteArgs, shutdown: bool) -> anyhow::Result<bool> {
    use orchestrator_proto::v1 as pb;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let (mut client, token) = coordinator_client(&a).await?;
        if shutdown {
            let req =
                orchestrator_net::auth::request(pb::ShutdownRequest {}, orchestrator_proto::limits::SHUTDOWN_DEADLINE, token.as_ref());
            client.shutdown(req).await.map_err(|s| anyhow::anyhow!("shutdown: {}", describe_first_call(&s, &a.coordinator)))?;
            emit("shutdown requested\n");
            return Ok(true);
        }
        let req = orchestrator_net::auth::request(
            pb::ClusterReportRequest { probe: !a.no_probe },
            orchestrator_proto::limits::REPORT_DEADLINE,
            token.as_ref(),
        );
        let r = client.report(req).await.map_err(|s| anyhow::anyhow!("report: {}", describe_first_call(&s, &a.coordinator)))?.into_inner();
        emit(&if a.json { format!("{}\n", r.json) } else { r.text });
        Ok(r.ok)
    })
}

/// A client of the coordinator `a` names (over TLS for `https://`), and the token its calls carry.
pub async fn coordinator_client(
    a: &RemoteArgs,
) -> anyhow::Result<(
    orchestrator_proto::v1::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
    Option<orchestrator_net::auth::Token>,
)> {
    let token = a.token_file.as_deref().map(orchestrator_net::auth::Token::read).transpose()?;
    let tls = a.tls_dir.as_deref().map(orchestrator_net::tls::TlsFiles::load_client).transpose()?;
    let channel = orchestrator_net::tls::connect(&a.coordinator, tls.as_ref()).await?;
    Ok((
        orchestrator_proto::v1::coordinator_client::CoordinatorClient::new(channel)
            .max_decoding_message_size(orchestrator_proto::limits::MAX_RESPONSE_BYTES),
        token,
    ))
}
