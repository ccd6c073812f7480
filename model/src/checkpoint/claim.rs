//! A checkpoint's content version computed once per host: the process that hashed every
//! in-scope tensor (the coordinator) hands its result to the others (the workers) as a claim,
//! and a process that opens the very same files adopts the version instead of hashing them
//! again. "The very same files" is decided the way `git` and `make` decide a file is unchanged,
//! from what `fstat` of the open file says: device, inode, size, and the modification and
//! change times to the nanosecond. A file on another host, a copy, a rewrite or a rename onto
//! the path has another identity, and that process hashes as before.

use std::collections::BTreeMap;
use std::fs::File;
use std::time::{Duration, SystemTime};

/// How long before it was opened a file must have last changed to be claimed. A write within
/// the clock tick that stamped the previous one leaves the times unchanged (git's "racily
/// clean" entries); file systems stamp at 1 ns to 2 s granularity, so a file changed less than
/// this before it was opened is hashed by everyone.
pub const RACY_MARGIN: Duration = Duration::from_secs(2);

/// What identifies a file's bytes without reading them (`fstat` of the open file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    /// Modification and status-change times, nanoseconds since the epoch.
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl FileIdentity {
    /// The identity of an open file (`None` where the platform has no inode numbers).
    pub fn of(file: &File) -> Option<Self> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            let m = file.metadata().ok()?;
            let ns = |s: i64, n: i64| s.checked_mul(1_000_000_000)?.checked_add(n);
            Some(Self {
                dev: m.dev(),
                ino: m.ino(),
                size: m.size(),
                mtime_ns: ns(m.mtime(), m.mtime_nsec())?,
                ctime_ns: ns(m.ctime(), m.ctime_nsec())?,
            })
        }
        #[cfg(not(unix))]
        {
            let _ = file;
            None
        }
    }

    /// Whether the file changed less than `margin` before `opened` (or after it, by its clock).
    pub fn racy(&self, opened: SystemTime, margin: Duration) -> bool {
        let Some(limit) = opened.checked_sub(margin).and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok()) else {
            return true;
        };
        let limit = i64::try_from(limit.as_nanos()).unwrap_or(i64::MAX);
        self.mtime_ns >= limit || self.ctime_ns >= limit
    }
}

/// A content version computed by a process that opened a checkpoint's files: the version, the
/// digest of its frame (geometry, format, and for each in-scope tensor its file, dtype, shape
/// and offsets: everything the version covers but the tensor bytes, read from the headers
/// alone), and the identity of every shard file the in-scope tensors lie in. A checkpoint
/// opened with a claim adopts its version when its own frame has the same digest and each of
/// its shard files has the claimed identity; otherwise it hashes every tensor itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContentClaim {
    pub version: String,
    pub frame: String,
    /// Shard file (as the index names it) -> identity.
    pub files: BTreeMap<String, FileIdentity>,
}

/// How a checkpoint got its content version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VersionFrom {
    /// Every in-scope tensor hashed by this process.
    Hashed,
    /// Adopted from a claim on the same files.
    Claim,
}
