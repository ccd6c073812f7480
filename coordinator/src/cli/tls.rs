//! `tls generate`: a cluster CA and node certificate for `--tls-dir`.

use std::path::PathBuf;

use clap::Subcommand;
use orchestrator_ops::output::emit;

#[derive(Subcommand)]
pub enum TlsCommand {
    /// Write a new cluster CA and node certificate (`ca.pem`, `ca.key`, `node.pem`, `node.key`)
    /// for `--tls-dir`.
    Generate {
        #[arg(long)]
        out: PathBuf,
        /// Another host name or IP address the node certificate names (repeatable).
        #[arg(long, value_name = "NAME")]
        name: Vec<String>,
    },
}

/// Writes the CA and node certificate into `out` and says what the certificate names.
pub fn generate(out: PathBuf, names: Vec<String>) -> anyhow::Result<bool> {
    orchestrator_net::tls::generate(&out, &names)?;
    emit(&format!(
        "wrote {}: ca.pem, ca.key, node.pem, node.key (node certificate for {}, localhost, loopback{}{})\n",
        out.display(),
        orchestrator_net::tls::SERVER_NAME,
        if names.is_empty() { "" } else { ", " },
        names.join(", ")
    ));
    Ok(true)
}
