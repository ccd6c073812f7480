//! TLS for the control plane (rustls through tonic), for clusters whose coordinator or workers
//! listen on non-loopback addresses.
//!
//! A TLS directory holds the cluster CA (`ca.pem`) and one node certificate and key
//! (`node.pem`, `node.key`) that the coordinator and every worker present. Clients trust only
//! `ca.pem` and verify the server as [`SERVER_NAME`] (a name in the node certificate), so the
//! same files serve every host and address. `orchestrator tls generate` writes such a
//! directory; any CA can issue the files instead. The shared token still authenticates every
//! call: TLS keeps it and the traffic private and proves the server is the cluster's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// The name clients verify every orchestrator server certificate against.
pub const SERVER_NAME: &str = "orchestrator.cluster";
pub const CA_FILE: &str = "ca.pem";
pub const CA_KEY_FILE: &str = "ca.key";
pub const CERT_FILE: &str = "node.pem";
pub const KEY_FILE: &str = "node.key";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("TLS file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("writing TLS file {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("generating certificates: {0}")]
    Generate(String),
    #[error("{url}: {message}")]
    Connect { url: String, message: String },
}

/// The PEM files of a TLS directory.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub dir: PathBuf,
    ca: String,
    cert: String,
    key: String,
}

fn read_pem(path: PathBuf, marker: &str) -> Result<String, TlsError> {
    let bytes = orchestrator_proto::limits::read_bounded(&path, orchestrator_proto::limits::MAX_PEM_BYTES)
        .map_err(|source| TlsError::Read { path: path.clone(), source })?;
    let text =
        String::from_utf8(bytes).map_err(|_| TlsError::Invalid { path: path.clone(), message: "not UTF-8: not a PEM file".into() })?;
    if !text.contains(marker) {
        return Err(TlsError::Invalid { path, message: format!("no `{marker}` block: not a PEM file of the expected kind") });
    }
    Ok(text)
}

impl TlsFiles {
    /// Reads `ca.pem`, `node.pem` and `node.key` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            dir: dir.to_path_buf(),
            ca: read_pem(dir.join(CA_FILE), "-----BEGIN CERTIFICATE-----")?,
            cert: read_pem(dir.join(CERT_FILE), "-----BEGIN CERTIFICATE-----")?,
            key: read_pem(dir.join(KEY_FILE), "PRIVATE KEY-----")?,
        })
    }

    /// Only the CA (a client needs nothing else).
    pub fn load_client(dir: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            dir: dir.to_path_buf(),
            ca: read_pem(dir.join(CA_FILE), "-----BEGIN CERTIFICATE-----")?,
            cert: String::new(),
            key: String::new(),
        })
    }

    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(&self.cert, &self.key))
    }

    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca)).domain_name(SERVER_NAME)
    }
}

/// The URL scheme of a server with or without TLS.
pub fn scheme(tls: Option<&TlsFiles>) -> &'static str {
    if tls.is_some() { "https" } else { "http" }
}

/// An endpoint for `url` (`http://` or, with `tls`, `https://`), not yet connected.
pub fn endpoint(url: &str, tls: Option<&TlsFiles>) -> Result<Endpoint, TlsError> {
    let connect_err = |message: String| TlsError::Connect { url: url.to_string(), message };
    let mut ep = Endpoint::from_shared(url.to_string()).map_err(|e| connect_err(format!("bad address: {e}")))?;
    match (tls, url.starts_with("https://")) {
        (Some(t), true) => ep = ep.tls_config(t.client_config()).map_err(|e| connect_err(format!("TLS: {e}")))?,
        (None, true) => return Err(connect_err("an https address needs the cluster's TLS directory (--tls-dir)".into())),
        (Some(_), false) => return Err(connect_err("with --tls-dir the address must be https://".into())),
        (None, false) => {}
    }
    Ok(ep.connect_timeout(Duration::from_secs(5)))
}

/// Connects to `url` (see [`endpoint`]).
pub async fn connect(url: &str, tls: Option<&TlsFiles>) -> Result<Channel, TlsError> {
    let ep = endpoint(url, tls)?;
    ep.connect().await.map_err(|e| TlsError::Connect { url: url.to_string(), message: format!("connecting: {}", chain(&e)) })
}

/// An error and its causes on one line, each said once (tonic's transport errors hide the cause:
/// a rejected certificate, a refused connection, a plain-text peer).
pub fn chain(e: &dyn std::error::Error) -> String {
    with_causes(e.to_string(), e.source())
}

fn with_causes(mut message: String, mut source: Option<&dyn std::error::Error>) -> String {
    while let Some(s) = source {
        let s_text = s.to_string();
        if !message.contains(&s_text) {
            message = format!("{message}: {s_text}");
        }
        source = s.source();
    }
    message
}

/// A failed call's status with its causes.
pub fn describe_status(s: &tonic::Status) -> String {
    with_causes(s.message().to_string(), std::error::Error::source(s))
}

/// [`describe_status`] for a connection's first call, with a hint when a plain-text client may
/// have met a TLS server (the connection breaks at the first request).
pub fn describe_first_call(s: &tonic::Status, url: &str) -> String {
    let text = describe_status(s);
    let transport = matches!(s.code(), tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Unavailable);
    if transport && url.starts_with("http://") {
        format!("{text} (if the cluster runs over TLS, use https:// and --tls-dir)")
    } else {
        text
    }
}

/// Refuses to listen on a non-loopback address without TLS (unless explicitly allowed).
pub fn check_listen(addr: std::net::SocketAddr, tls: Option<&TlsFiles>, insecure: bool, flag: &str) -> Result<(), String> {
    if addr.ip().is_loopback() || tls.is_some() || insecure {
        Ok(())
    } else {
        Err(format!(
            "{flag} {addr} is not a loopback address: give the cluster's TLS directory (--tls-dir, see `orchestrator tls generate`) \
             or, on a network you trust, --insecure"
        ))
    }
}

fn this_year() -> i32 {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    1970 + (secs / 31_556_952) as i32
}

fn write_file(path: PathBuf, text: &str, private: bool) -> Result<(), TlsError> {
    let err = |source| TlsError::Write { path: path.clone(), source };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut file = opts.open(&path).map_err(err)?;
    // `mode` applies only to a file this call creates: one written over keeps its mode, so a
    // private key is narrowed to 0600 explicitly before any byte of it is written.
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    let _ = private;
    std::io::Write::write_all(&mut file, text.as_bytes()).map_err(err)
}

/// Writes a new cluster CA and a node certificate for [`SERVER_NAME`], `localhost`, loopback
/// and `extra_names` (host names or IP addresses), valid until January 1 two years on.
/// Private keys are written with mode 0600.
pub fn generate(dir: &Path, extra_names: &[String]) -> Result<(), TlsError> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let g = |e: rcgen::Error| TlsError::Generate(e.to_string());
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Write { path: dir.to_path_buf(), source })?;
    let year = this_year();
    let (not_before, not_after) = (rcgen::date_time_ymd(year, 1, 1), rcgen::date_time_ymd(year + 2, 1, 1));

    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(g)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name.push(DnType::CommonName, "orchestrator cluster CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    (ca.not_before, ca.not_after) = (not_before, not_after);
    let ca_key = KeyPair::generate().map_err(g)?;
    let ca_cert = ca.self_signed(&ca_key).map_err(g)?;

    let mut names = vec![SERVER_NAME.to_string(), "localhost".into(), "127.0.0.1".into(), "::1".into()];
    names.extend(extra_names.iter().cloned());
    let mut node = CertificateParams::new(names).map_err(g)?;
    node.distinguished_name.push(DnType::CommonName, SERVER_NAME);
    node.use_authority_key_identifier_extension = true;
    node.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    node.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    (node.not_before, node.not_after) = (not_before, not_after);
    let node_key = KeyPair::generate().map_err(g)?;
    let issuer = Issuer::new(ca, ca_key);
    let node_cert = node.signed_by(&node_key, &issuer).map_err(g)?;

    write_file(dir.join(CA_FILE), &ca_cert.pem(), false)?;
    write_file(dir.join(CA_KEY_FILE), &issuer_key_pem(&issuer), true)?;
    write_file(dir.join(CERT_FILE), &node_cert.pem(), false)?;
    write_file(dir.join(KEY_FILE), &node_key.serialize_pem(), true)
}

fn issuer_key_pem(issuer: &rcgen::Issuer<'_, rcgen::KeyPair>) -> String {
    issuer.key().serialize_pem()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_files_load_and_name_what_is_wrong() {
        let tmp = tempfile::tempdir().unwrap();
        // A world-readable file in the way of a private key is narrowed, not kept as it was.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::write(tmp.path().join(KEY_FILE), "placeholder").unwrap();
            std::fs::set_permissions(tmp.path().join(KEY_FILE), std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        generate(tmp.path(), &["node-7.example".into(), "10.0.0.7".into()]).unwrap();
        let t = TlsFiles::load(tmp.path()).unwrap();
        assert!(t.ca.starts_with("-----BEGIN CERTIFICATE-----"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            for key in [KEY_FILE, CA_KEY_FILE] {
                assert_eq!(std::fs::metadata(tmp.path().join(key)).unwrap().permissions().mode() & 0o777, 0o600, "{key}");
            }
        }
        std::fs::write(tmp.path().join(CERT_FILE), "not a certificate").unwrap();
        match TlsFiles::load(tmp.path()) {
            Err(TlsError::Invalid { path, .. }) => assert_eq!(path, tmp.path().join(CERT_FILE)),
            other => panic!("{other:?}"),
        }
        std::fs::remove_file(tmp.path().join(CERT_FILE)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", tmp.path().join(CERT_FILE)).unwrap();
        match TlsFiles::load(tmp.path()) {
            Err(TlsError::Read { path, source }) => {
                assert_eq!((path, source.to_string()), (tmp.path().join(CERT_FILE), "more than 1048576 bytes".to_string()))
            }
            other => panic!("{other:?}"),
        }
        std::fs::remove_file(tmp.path().join(CA_FILE)).unwrap();
        assert!(matches!(TlsFiles::load_client(tmp.path()), Err(TlsError::Read { .. })));
    }

    #[test]
    fn schemes_must_match_the_tls_setting() {
        let tmp = tempfile::tempdir().unwrap();
        generate(tmp.path(), &[]).unwrap();
        let t = TlsFiles::load_client(tmp.path()).unwrap();
        assert!(endpoint("https://127.0.0.1:1", Some(&t)).is_ok());
        assert!(endpoint("http://127.0.0.1:1", None).is_ok());
        for (url, tls) in [("https://127.0.0.1:1", None), ("http://127.0.0.1:1", Some(&t))] {
            assert!(matches!(endpoint(url, tls), Err(TlsError::Connect { .. })), "{url}");
        }
        let any: std::net::SocketAddr = "0.0.0.0:9".parse().unwrap();
        assert!(check_listen(any, None, false, "--listen").unwrap_err().contains("not a loopback address"));
        assert!(check_listen(any, Some(&t), false, "--listen").is_ok());
        assert!(check_listen(any, None, true, "--listen").is_ok());
        assert!(check_listen("127.0.0.1:9".parse().unwrap(), None, false, "--listen").is_ok());
    }
}
