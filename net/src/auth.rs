//! Access control: a shared token on every control RPC (compared in constant time; a request
//! without it, or with a wrong one, is refused with `Unauthenticated`). The directories a worker
//! may read checkpoints from are the model crate's `AllowedRoots`, which checks every file of a
//! checkpoint against them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use subtle::ConstantTimeEq;
use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

/// Why a token file was refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("token file {path}: {why}")]
    TokenFile { path: PathBuf, why: String },
}

/// The shared secret of a cluster.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// Reads a token file (surrounding whitespace ignored; at least 16 characters).
    pub fn read(path: &Path) -> Result<Self, AuthError> {
        let err = |why: String| AuthError::TokenFile { path: path.to_path_buf(), why };
        let bytes = orchestrator_proto::limits::read_bounded(path, orchestrator_proto::limits::MAX_TOKEN_FILE_BYTES)
            .map_err(|e| err(e.to_string()))?;
        let text = String::from_utf8(bytes).map_err(|_| err("the token must be printable ASCII without spaces".into()))?;
        let token = text.trim();
        if token.len() < 16 {
            return Err(err(format!("the token has {} characters; use at least 16", token.len())));
        }
        if !token.chars().all(|c| c.is_ascii_graphic()) {
            return Err(err("the token must be printable ASCII without spaces".into()));
        }
        Ok(Self(token.into()))
    }

    /// A fresh random token (32 bytes from the OS, hex), written to `path` readable by the
    /// owner only.
    pub fn generate(path: &Path) -> Result<Self, AuthError> {
        let err = |why: String| AuthError::TokenFile { path: path.to_path_buf(), why };
        let mut bytes = [0u8; 32];
        use std::io::Read as _;
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|e| err(format!("reading /dev/urandom: {e}")))?;
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
        }
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        use std::io::Write as _;
        options.open(path).and_then(|mut f| f.write_all(token.as_bytes())).map_err(|e| err(e.to_string()))?;
        Ok(Self(token.into()))
    }

    fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// True when a request carries this token (constant-time comparison).
    pub fn admits<T>(&self, request: &Request<T>) -> bool {
        let Some(value) = request.metadata().get("authorization") else { return false };
        let got = value.as_bytes();
        let want = self.bearer();
        got.len() == want.len() && bool::from(got.ct_eq(want.as_bytes()))
    }
}

/// A server-side check for every RPC of a service: refuse without the token.
pub fn interceptor(token: Option<Token>) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |request: Request<()>| match &token {
        Some(t) if !t.admits(&request) => Err(Status::unauthenticated("missing or wrong token (pass the cluster's --token-file)")),
        _ => Ok(request),
    }
}

/// A client request with a deadline and, when there is one, the token.
pub fn request<T>(message: T, deadline: Duration, token: Option<&Token>) -> Request<T> {
    let mut r = Request::new(message);
    r.set_timeout(deadline);
    if let Some(t) = token
        && let Ok(v) = MetadataValue::try_from(t.bearer())
    {
        r.metadata_mut().insert("authorization", v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_checks_are_exact() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        let token = Token::generate(&path).unwrap();
        let again = Token::read(&path).unwrap();
        let mut ok = request((), Duration::from_secs(1), Some(&again));
        assert!(token.admits(&ok));
        assert!(!token.admits(&Request::new(())));
        ok.metadata_mut().insert("authorization", MetadataValue::try_from("Bearer x").unwrap());
        assert!(!token.admits(&ok));
        std::fs::write(&path, "short").unwrap();
        assert!(matches!(Token::read(&path), Err(AuthError::TokenFile { .. })));
        // A file that never ends (or one of any other size past the limit) is refused after the
        // limit, not read into memory.
        let e = Token::read(Path::new("/dev/zero")).unwrap_err();
        assert!(matches!(&e, AuthError::TokenFile { why, .. } if why == "more than 65536 bytes"), "{e}");
        std::fs::write(&path, [0xffu8; 20]).unwrap();
        let e = Token::read(&path).unwrap_err();
        assert!(matches!(&e, AuthError::TokenFile { why, .. } if why.contains("printable ASCII")), "{e}");
        let mut check = interceptor(Some(token));
        assert_eq!(check(Request::new(())).unwrap_err().code(), tonic::Code::Unauthenticated);
        assert!(check(request((), Duration::from_secs(1), Some(&again))).is_ok());
    }
}
