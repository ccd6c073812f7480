//! Every deadline, interval and message bound of the control plane, named once and used by both
//! sides of each call, and the bounds on the files it reads (token, TLS, journal). (Sizes of
//! models, clusters and probes are in `orchestrator_model::limits`.)

use std::io::Read;
use std::path::Path;
use std::time::Duration;

/// How often a worker heartbeats to its coordinator.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);
/// A worker that misses heartbeats this long has stalled: its replica leaves rotation.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(4);
/// The deadline of every socket read and write of a probe's TP ring (and of joining it).
pub const RING_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest ring deadline a probe may ask for (a rank holds its state while it joins and
/// reduces, so a longer one would let a probe hold up everything else the rank does).
pub const MAX_RING_TIMEOUT: Duration = Duration::from_secs(120);
/// The deadline of one Commit call; a decided commit is asked again until it is confirmed.
pub const COMMIT_CALL_DEADLINE: Duration = Duration::from_secs(5);
/// How long an update drives a decided commit before it reports the ranks that did not confirm
/// (the replica then stays out of rotation and the commit is finished when they answer).
pub const COMMIT_DRIVE_LIMIT: Duration = Duration::from_secs(20);
/// Pause between attempts to drive a decided commit.
pub const COMMIT_RETRY: Duration = Duration::from_millis(200);
/// How often the coordinator's health loop looks at every replica.
pub const HEALTH_INTERVAL: Duration = Duration::from_millis(250);
/// The longest a health-loop probe of a replica out of rotation may take (a replica whose probe
/// hangs stays out and is tried again; the loop goes on with the others).
pub const REINSTATE_TIMEOUT: Duration = Duration::from_secs(30);
/// The least time between two attempts to bring a replica back into rotation.
pub const REINSTATE_BACKOFF: Duration = Duration::from_secs(1);
/// The largest gRPC request a server decodes.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;
/// The largest gRPC response a client decodes (a worker's rank report, the coordinator's
/// cluster report of every rank as JSON and text).
pub const MAX_RESPONSE_BYTES: usize = 64 << 20;
/// The deadline of an `Update` call: it answers once, when the whole rolling update has ended.
pub const UPDATE_DEADLINE: Duration = Duration::from_secs(3600);
/// The deadline of a `Report` call that runs the cluster's probes again.
pub const REPORT_DEADLINE: Duration = Duration::from_secs(1800);
/// The deadline of a `Shutdown` call (it answers as soon as the shutdown is under way).
pub const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);
/// The largest path a request may name (Linux's PATH_MAX).
pub const MAX_PATH_BYTES: usize = 4096;
/// How long a coordinator waits for every rank to register (`--join-timeout`), and how long a
/// worker started by an engine keeps trying to reach a coordinator that is not up yet.
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(300);
/// Pause between a worker's attempts to register with a coordinator it cannot reach yet.
pub const REGISTER_RETRY: Duration = Duration::from_millis(500);
/// A worker this coordinator did not start (another host's) that is silent this long is presumed
/// dead: its replica is out for good, as for a local worker whose process exited.
pub const REMOTE_PRESUMED_DEAD: Duration = Duration::from_secs(12);
/// The largest name a request may give: a version, a scale rule, a preset (real ones: a few
/// dozen bytes).
pub const MAX_NAME_BYTES: usize = 1024;

/// A request's string field over its limit (the field named, the value not echoed).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {bytes} bytes, over the limit of {limit}")]
pub struct TooLong {
    pub field: &'static str,
    pub bytes: usize,
    pub limit: usize,
}

/// `value` where it has at most `limit` bytes, else [`TooLong`] naming `field`.
pub fn check_len<'a>(field: &'static str, value: &'a str, limit: usize) -> Result<&'a str, TooLong> {
    if value.len() > limit { Err(TooLong { field, bytes: value.len(), limit }) } else { Ok(value) }
}

/// The largest token file read (a token is 16 to a few hundred characters).
pub const MAX_TOKEN_FILE_BYTES: u64 = 64 << 10;
/// The largest PEM file read (a certificate chain or a key: a few KiB).
pub const MAX_PEM_BYTES: u64 = 1 << 20;
/// The largest journal replayed (a line of a few hundred bytes per launch, update step and
/// recovery: millions of updates).
pub const MAX_JOURNAL_BYTES: u64 = 1 << 30;

/// `path`'s bytes where it holds at most `limit`; else an `InvalidData` error saying so, having
/// read at most `limit + 1` bytes (a device or a pipe that never ends included).
pub fn read_bounded(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("more than {limit} bytes")));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_checked_against_their_limit() {
        assert_eq!(check_len("version", "abc", 3), Ok("abc"));
        let e = check_len("version", "abcd", 3).unwrap_err();
        assert_eq!(e, TooLong { field: "version", bytes: 4, limit: 3 });
        assert_eq!(e.to_string(), "version: 4 bytes, over the limit of 3");
    }

    #[test]
    fn files_are_read_up_to_their_limit() {
        let tmp = std::env::temp_dir().join(format!("orchestrator-limits-{}", std::process::id()));
        std::fs::write(&tmp, b"0123456789").unwrap();
        assert_eq!(read_bounded(&tmp, 10).unwrap(), b"0123456789");
        let e = read_bounded(&tmp, 9).unwrap_err();
        assert_eq!((e.kind(), e.to_string()), (std::io::ErrorKind::InvalidData, "more than 9 bytes".to_string()));
        std::fs::remove_file(&tmp).unwrap();
        // A device that never ends: refused after limit + 1 bytes.
        let e = read_bounded(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert_eq!(read_bounded(Path::new("/nonexistent/x"), 1).unwrap_err().kind(), std::io::ErrorKind::NotFound);
    }
}
