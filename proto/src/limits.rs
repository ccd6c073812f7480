//! Every deadline, interval and message bound of the control plane, named once and used by both
//! sides of each call. (Sizes of models, clusters and probes are in `orchestrator_model::limits`.)

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
