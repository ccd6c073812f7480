//! The collective the probe's tensor-parallel all-reduce runs on: every rank of a TP group ends
//! with the sum of all ranks' partial outputs, summed in rank order so that the result is
//! bit-identical on every rank and equal to the in-process sum.
//!
//! [`LocalCollective`] is the world-size-1 case. [`TcpRing`] joins worker processes over TCP: each
//! rank binds a [`RingListener`] before the peer list is known (like an NCCL unique-id bootstrap),
//! publishes its address, and [`RingListener::connect`]s once every address is known. A NCCL
//! implementation fills the same [`Collective`] interface on GPUs.
//!
//! The ring all-reduce is an all-gather followed by a fixed rank-order summation: in step `s` of
//! `n - 1`, rank `r` sends rank `(r - s) mod n`'s vector to the next rank while it receives rank
//! `(r - s - 1) mod n`'s vector from the previous one; then every rank computes
//! `d_0 + d_1 + ... + d_{n-1}` in that order. Every message carries a header (group, operation,
//! step, source rank, sender, kind, length) that the receiver checks, values travel as
//! little-endian `f32` bytes, and every socket read and write has a deadline, so a dead, silent
//! or confused peer becomes an error naming that peer rather than a hang.
//!
//! When a rank's all-reduce fails it tells the next rank (an abort message naming the rank it
//! blames) and closes its sockets, so the failure travels around the ring instead of leaving the
//! other ranks to wait out their timeouts; a ring that failed once refuses further operations.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

/// A collective over the ranks of one TP group.
pub trait Collective {
    /// The number of ranks in the group.
    fn world_size(&self) -> usize;
    /// This rank's index in the group, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Every rank ends with y = d_0 + d_1 + ... + d_{n-1}, summed in rank order exactly as
    /// `let mut y = d_0.to_vec(); for d in rest { for (a, b) in y.iter_mut().zip(d) { *a += b } }`
    /// so the result is bit-identical on every rank (and equal to the in-process sum).
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError>;
}

/// What went wrong in a collective. Variants about another rank name it in `peer`
/// (see [`CollectiveError::peer`]).
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The arguments do not describe a ring (no peers, a rank outside the group, ...).
    #[error("invalid ring: {reason}")]
    InvalidGroup { reason: String },
    /// The next rank's listener could not be reached before the connect timeout.
    #[error("could not connect to rank {peer} at {addr} within {timeout:?}: {source}")]
    Connect { peer: usize, addr: SocketAddr, timeout: Duration, source: io::Error },
    /// A peer sent or accepted nothing within the deadline.
    #[error("rank {peer} did not respond within {timeout:?} while {during}")]
    Timeout { peer: usize, timeout: Duration, during: &'static str },
    /// A peer's connection closed or broke.
    #[error("lost rank {peer} while {during}: {source}")]
    PeerLost { peer: usize, during: &'static str, source: io::Error },
    /// A connection's handshake did not match this ring (a stray connection, another group, another
    /// world size, or a rank that is not the expected neighbour), so it was refused.
    #[error("handshake with rank {peer} (connection {addr}) refused: {reason}")]
    Handshake { peer: usize, addr: SocketAddr, reason: String },
    /// A peer's vector has a different length than this rank's.
    #[error("rank {peer}'s vector has {found} values but this rank's has {expected}")]
    LengthMismatch { peer: usize, expected: usize, found: usize },
    /// A peer sent a message that does not fit the protocol (wrong group, operation, step or rank).
    #[error("malformed message from rank {peer}: {reason}")]
    Protocol { peer: usize, reason: String },
    /// Another rank failed this all-reduce and blamed `peer`; `reason` is its error.
    #[error("the all-reduce was aborted because of rank {peer}: {reason}")]
    Aborted { peer: usize, reason: String },
    /// The ring failed in an earlier operation; its connections are closed.
    #[error("the ring is unusable after an earlier failure: {reason}")]
    Broken { reason: String },
    /// A local socket operation failed (bind, address, socket options).
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    /// The device collective (NCCL) failed, timed out or was aborted.
    #[error("device collective: {reason}")]
    Device { reason: String },
}

impl CollectiveError {
    /// The rank this error blames, when it blames one.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Self::Connect { peer, .. }
            | Self::Timeout { peer, .. }
            | Self::PeerLost { peer, .. }
            | Self::Handshake { peer, .. }
            | Self::LengthMismatch { peer, .. }
            | Self::Protocol { peer, .. }
            | Self::Aborted { peer, .. } => Some(*peer),
            Self::InvalidGroup { .. } | Self::Broken { .. } | Self::Io(_) | Self::Device { .. } => None,
        }
    }
}

/// The collective of a group of one rank: `all_reduce_sum` leaves the data as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalCollective;

impl Collective for LocalCollective {
    fn world_size(&self) -> usize {
        1
    }

    fn rank(&self) -> usize {
        0
    }

    fn all_reduce_sum(&mut self, _data: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }
}

/// The default deadline of every socket read and write of a [`TcpRing`].
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(10);

/// The shortest deadline a socket accepts; shorter ones (zero) are raised to it.
const MIN_TIMEOUT: Duration = Duration::from_millis(1);
/// Pause between attempts to reach a listener that is not up yet.
const CONNECT_RETRY: Duration = Duration::from_millis(20);
/// Pause between polls of the listener for the previous rank's connection.
const ACCEPT_POLL: Duration = Duration::from_millis(2);
/// How long a failed step waits for its send to finish, so that an abort can follow it.
const ABORT_GRACE: Duration = Duration::from_millis(250);
/// The deadline for writing an abort message.
const ABORT_WRITE_TIMEOUT: Duration = Duration::from_millis(250);
/// The longest reason an abort message carries.
const MAX_REASON_BYTES: usize = 1024;

/// A listening socket for one rank, bound before the peer list is known.
#[derive(Debug)]
pub struct RingListener {
    listener: TcpListener,
    addr: SocketAddr,
}

impl RingListener {
    /// Binds `addr` (port 0 picks a free port, e.g. `127.0.0.1:0`).
    pub fn bind(addr: SocketAddr) -> Result<Self, CollectiveError> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        Ok(Self { listener, addr })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Joins the ring: connects to the next rank's listener (retrying until `timeout`), accepts
    /// the previous rank's connection, and checks a handshake (group id, rank, world size) so a
    /// stray connection or a mismatched group is refused with an error.
    ///
    /// `peers[i]` is rank `i`'s listener address; `peers.len()` is the world size. The whole call
    /// finishes within about `timeout`. The first connection this listener accepts must be the
    /// previous rank's: anything else is refused (the connecting side is told why) and fails the
    /// call. A ring of one rank makes no connections. The listener stays usable: a ring that
    /// failed is replaced by joining a new epoch ([`RingListener::connect_epoch`]).
    pub fn connect(&self, group: u64, rank: usize, peers: &[SocketAddr], timeout: Duration) -> Result<TcpRing, CollectiveError> {
        self.connect_epoch(group, 0, rank, peers, timeout)
    }

    /// [`RingListener::connect`] for ring epoch `epoch` of `group`. A connection left over from an
    /// earlier epoch (a peer that gave up on a ring that failed) is refused and skipped, so the
    /// ranks of a group meet again on a new epoch after any failure; one from a later epoch, or
    /// from another group, fails the call as any mismatch does.
    pub fn connect_epoch(
        &self,
        group: u64,
        epoch: u32,
        rank: usize,
        peers: &[SocketAddr],
        timeout: Duration,
    ) -> Result<TcpRing, CollectiveError> {
        let world = peers.len();
        if world == 0 {
            return Err(CollectiveError::InvalidGroup { reason: "the peer list is empty".into() });
        }
        if rank >= world {
            return Err(CollectiveError::InvalidGroup { reason: format!("rank {rank} is outside a group of {world}") });
        }
        if u32::try_from(world).is_err() {
            return Err(CollectiveError::InvalidGroup { reason: format!("a group of {world} ranks is too large") });
        }
        let mut ring = TcpRing { group, rank, world, links: None, op_timeout: DEFAULT_OP_TIMEOUT, op: 0, broken: None };
        if world == 1 {
            return Ok(ring);
        }
        let deadline = Instant::now() + timeout;
        let me = Hello { status: STATUS_OK, epoch, group, rank: rank as u64, world: world as u64 };
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);

        // Connect first and send the hello: the previous rank's connect completes in our
        // listener's backlog, so no rank waits on another's accept here.
        let next_stream = connect_retrying(next, peers[next], timeout, deadline)?;
        configure(&next_stream)?;
        next_stream.set_write_timeout(Some(remaining(deadline)))?;
        (&next_stream).write_all(&me.encode()).map_err(|e| io_to_error(e, next, timeout, "sending the handshake"))?;

        let mut buf = [0u8; HELLO_BYTES];
        let prev_stream = loop {
            let (prev_stream, prev_addr) = accept_before(&self.listener, prev, timeout, deadline)?;
            configure(&prev_stream)?;
            prev_stream.set_read_timeout(Some(remaining(deadline)))?;
            prev_stream.set_write_timeout(Some(remaining(deadline)))?;
            (&prev_stream).read_exact(&mut buf).map_err(|e| match io_to_error(e, prev, timeout, "receiving the handshake") {
                CollectiveError::PeerLost { source, .. } => {
                    CollectiveError::Handshake { peer: prev, addr: prev_addr, reason: format!("no complete handshake arrived: {source}") }
                }
                other => other,
            })?;
            let refusal = match Hello::decode(&buf) {
                None => Some((STATUS_MALFORMED, "it is not a ring handshake".to_string())),
                Some(h) if h.group != group => {
                    Some((STATUS_GROUP, format!("it is for group {:#x}, this ring is group {group:#x}", h.group)))
                }
                Some(h) if h.epoch < epoch => {
                    // Left over from an earlier epoch: tell it, and wait for the current one.
                    let _ = (&prev_stream).write_all(&Hello { status: STATUS_STALE, ..me }.encode());
                    let _ = prev_stream.shutdown(Shutdown::Both);
                    continue;
                }
                Some(h) if h.epoch != epoch => {
                    Some((STATUS_EPOCH, format!("it is for ring epoch {}, this ring is epoch {epoch}", h.epoch)))
                }
                Some(h) if h.world != world as u64 => {
                    Some((STATUS_WORLD, format!("it is for a world of {} ranks, this ring has {world}", h.world)))
                }
                Some(h) if h.rank != prev as u64 => Some((STATUS_RANK, format!("it comes from rank {}, expected rank {prev}", h.rank))),
                Some(_) => None,
            };
            if let Some((status, reason)) = refusal {
                // Tell the other side why, best effort, before failing.
                let _ = (&prev_stream).write_all(&Hello { status, ..me }.encode());
                let _ = prev_stream.shutdown(Shutdown::Both);
                return Err(CollectiveError::Handshake { peer: prev, addr: prev_addr, reason });
            }
            break prev_stream;
        };
        (&prev_stream).write_all(&me.encode()).map_err(|e| io_to_error(e, prev, timeout, "answering the handshake"))?;

        next_stream.set_read_timeout(Some(remaining(deadline)))?;
        (&next_stream).read_exact(&mut buf).map_err(|e| io_to_error(e, next, timeout, "waiting for the handshake answer"))?;
        let handshake = |reason: String| CollectiveError::Handshake { peer: next, addr: peers[next], reason };
        let reply = Hello::decode(&buf).ok_or_else(|| handshake("the answer is not a ring handshake".into()))?;
        if reply.status != STATUS_OK {
            return Err(handshake(format!("the listener refused this rank: {}", status_text(reply.status))));
        }
        if reply.group != group || reply.epoch != epoch || reply.world != world as u64 || reply.rank != next as u64 {
            return Err(handshake(format!(
                "the listener is rank {} of {} in group {:#x} epoch {}, expected rank {next} of {world} in group {group:#x} epoch {epoch}",
                reply.rank, reply.world, reply.group, reply.epoch
            )));
        }
        ring.links = Some(Links { next: next_stream, prev: prev_stream });
        Ok(ring)
    }
}

/// The two connections of a rank in a ring of two or more.
#[derive(Debug)]
struct Links {
    /// To the next rank, `(rank + 1) % world`: this rank only writes to it.
    next: TcpStream,
    /// From the previous rank, `(rank - 1) % world`: this rank only reads from it.
    prev: TcpStream,
}

/// One rank's place in a ring of TCP connections; implements [`Collective`].
#[derive(Debug)]
pub struct TcpRing {
    group: u64,
    rank: usize,
    world: usize,
    /// `None` in a ring of one rank.
    links: Option<Links>,
    op_timeout: Duration,
    /// The number of all-reduces started so far; messages carry it.
    op: u64,
    /// Why the ring is unusable, once an operation failed.
    broken: Option<String>,
}

impl TcpRing {
    /// Sets the deadline of every socket read and write of later operations (default
    /// [`DEFAULT_OP_TIMEOUT`]; zero is raised to 1 ms).
    pub fn with_timeout(mut self, op_timeout: Duration) -> Self {
        self.op_timeout = op_timeout.max(MIN_TIMEOUT);
        self
    }

    /// The deadline of every socket read and write.
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// The group id every message of this ring carries.
    pub fn group(&self) -> u64 {
        self.group
    }

    /// The next rank, `(rank + 1) % world`.
    fn next_rank(&self) -> usize {
        (self.rank + 1) % self.world
    }

    /// The previous rank, `(rank - 1) % world`.
    fn prev_rank(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Marks the ring unusable: tells the next rank whom to blame (when its last message went out
    /// whole, so the abort starts at a message boundary) and closes both connections, so peers
    /// still sending to this rank fail at once instead of waiting out their timeouts.
    fn fail(&mut self, err: CollectiveError, send_abort: bool) -> CollectiveError {
        if let Some(links) = self.links.take() {
            if send_abort {
                let (peer, reason) = match &err {
                    CollectiveError::Aborted { peer, reason } => (*peer, reason.clone()),
                    other => (other.peer().unwrap_or(self.rank), format!("rank {}: {other}", self.rank)),
                };
                let mut reason = reason.into_bytes();
                reason.truncate(MAX_REASON_BYTES);
                let header = Header {
                    group: self.group,
                    op: self.op,
                    step: 0,
                    source: peer as u32,
                    sender: self.rank as u32,
                    kind: KIND_ABORT,
                    len: reason.len() as u64,
                };
                let _ = links.next.set_write_timeout(Some(ABORT_WRITE_TIMEOUT.min(self.op_timeout)));
                let _ = write_frame(&links.next, &header.encode(), &reason);
            }
            let _ = links.next.shutdown(Shutdown::Both);
            let _ = links.prev.shutdown(Shutdown::Both);
            drop(links);
        }
        self.broken = Some(err.to_string());
        err
    }
}

impl Collective for TcpRing {
    fn world_size(&self) -> usize {
        self.world
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        if let Some(reason) = &self.broken {
            return Err(CollectiveError::Broken { reason: reason.clone() });
        }
        if self.links.is_none() {
            return Ok(());
        }
        self.op += 1;
        let (n, r, len, timeout, op) = (self.world, self.rank, data.len(), self.op_timeout, self.op);
        let (next, prev) = (self.next_rank(), self.prev_rank());
        let Some(links) = &self.links else { return Ok(()) };
        let set = links
            .next
            .set_write_timeout(Some(timeout))
            .and_then(|()| links.prev.set_read_timeout(Some(timeout)))
            .and_then(|()| links.prev.set_write_timeout(Some(timeout)));
        if let Err(e) = set {
            return Err(self.fail(CollectiveError::Io(e), false));
        }

        // slots[k]: rank k's vector as little-endian bytes, once it has arrived.
        let mut slots: Vec<Vec<u8>> = vec![Vec::new(); n];
        slots[r] = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let expect = Expect { group: self.group, op, world: n, prev, len };
        for step in 0..n - 1 {
            let send_src = (r + n - step) % n;
            let recv_src = (r + 2 * n - step - 1) % n;
            let header = Header {
                group: self.group,
                op,
                step: step as u32,
                source: send_src as u32,
                sender: r as u32,
                kind: KIND_DATA,
                len: len as u64,
            }
            .encode();
            let body = &slots[send_src];
            // Send on a scoped thread while receiving here: with both directions in flight no
            // rank blocks on a full socket buffer waiting for a peer that is itself sending.
            let (received, sent, shut_down) = thread::scope(|scope| {
                let writer = scope.spawn(|| write_frame(&links.next, &header, body));
                let received = read_data_frame(&links.prev, &expect, step, recv_src, timeout);
                let mut shut_down = false;
                if received.is_err() {
                    // Let the send finish its message (normally moments away) so an abort can
                    // follow it; if it is stuck, unblock it by closing the connection.
                    let grace = Instant::now() + ABORT_GRACE.min(timeout);
                    while !writer.is_finished() && Instant::now() < grace {
                        thread::sleep(Duration::from_millis(1));
                    }
                    if !writer.is_finished() {
                        let _ = links.next.shutdown(Shutdown::Both);
                        shut_down = true;
                    }
                }
                let sent = writer.join().unwrap_or_else(|_| Err(io::Error::other("the send thread panicked")));
                (received, sent, shut_down)
            });
            let sent_whole = sent.is_ok() && !shut_down;
            let err = match (received, sent) {
                (Ok(bytes), Ok(())) => {
                    slots[recv_src] = bytes;
                    continue;
                }
                // A verdict about what arrived beats a broken send, which beats an I/O failure
                // of the receive (which may only echo another rank's failure).
                (Err(e), Err(s)) if !is_verdict(&e) && !shut_down => io_to_error(s, next, timeout, "sending"),
                (Err(e), _) => e,
                (Ok(_), Err(s)) => io_to_error(s, next, timeout, "sending"),
            };
            return Err(self.fail(err, sent_whole));
        }

        // The fixed rank-order sum, identical on every rank.
        for (k, bytes) in slots.iter().enumerate() {
            let (values, _) = bytes.as_chunks::<4>();
            if k == 0 {
                for (y, b) in data.iter_mut().zip(values) {
                    *y = f32::from_le_bytes(*b);
                }
            } else {
                for (y, b) in data.iter_mut().zip(values) {
                    *y += f32::from_le_bytes(*b);
                }
            }
        }
        Ok(())
    }
}

/// Whether a receive error is a definite verdict about what arrived (rather than an I/O failure).
fn is_verdict(e: &CollectiveError) -> bool {
    matches!(e, CollectiveError::Aborted { .. } | CollectiveError::LengthMismatch { .. } | CollectiveError::Protocol { .. })
}

/// What a data message of this operation must look like.
struct Expect {
    group: u64,
    op: u64,
    world: usize,
    prev: usize,
    len: usize,
}

/// Reads the message of `step` from the previous rank: rank `source`'s vector of `len` values.
fn read_data_frame(stream: &TcpStream, expect: &Expect, step: usize, source: usize, timeout: Duration) -> Result<Vec<u8>, CollectiveError> {
    let prev = expect.prev;
    let mut raw = [0u8; HEADER_BYTES];
    (&*stream).read_exact(&mut raw).map_err(|e| io_to_error(e, prev, timeout, "receiving"))?;
    let h = Header::decode(&raw);
    let protocol = |reason: String| CollectiveError::Protocol { peer: prev, reason };
    if h.group != expect.group {
        return Err(protocol(format!("message for group {:#x}, this ring is group {:#x}", h.group, expect.group)));
    }
    if h.sender as usize != prev {
        return Err(protocol(format!("message claims to come from rank {}, expected rank {prev}", h.sender)));
    }
    match h.kind {
        KIND_DATA => {}
        KIND_ABORT => {
            if h.source as usize >= expect.world {
                return Err(protocol(format!("abort blames rank {}, outside a group of {}", h.source, expect.world)));
            }
            let n = usize::try_from(h.len).unwrap_or(usize::MAX);
            if n > MAX_REASON_BYTES {
                return Err(protocol(format!("abort reason of {n} bytes (at most {MAX_REASON_BYTES})")));
            }
            let mut reason = vec![0u8; n];
            (&*stream).read_exact(&mut reason).map_err(|e| io_to_error(e, prev, timeout, "receiving an abort"))?;
            return Err(CollectiveError::Aborted { peer: h.source as usize, reason: String::from_utf8_lossy(&reason).into_owned() });
        }
        other => return Err(protocol(format!("unknown message kind {other}"))),
    }
    if h.op != expect.op || h.step as usize != step || h.source as usize != source {
        return Err(protocol(format!(
            "message for operation {} step {} carrying rank {}'s data, expected operation {} step {step} carrying rank {source}'s",
            h.op, h.step, h.source, expect.op
        )));
    }
    if h.len != expect.len as u64 {
        let found = usize::try_from(h.len).unwrap_or(usize::MAX);
        return Err(CollectiveError::LengthMismatch { peer: source, expected: expect.len, found });
    }
    let mut body = vec![0u8; expect.len * 4];
    (&*stream).read_exact(&mut body).map_err(|e| io_to_error(e, prev, timeout, "receiving"))?;
    Ok(body)
}

/// Writes one message (header and body) and flushes it.
fn write_frame(stream: &TcpStream, header: &[u8; HEADER_BYTES], body: &[u8]) -> io::Result<()> {
    let mut w = stream;
    w.write_all(header)?;
    w.write_all(body)?;
    w.flush()
}

/// Maps a socket error talking to `peer` to the error that names it.
fn io_to_error(e: io::Error, peer: usize, timeout: Duration, during: &'static str) -> CollectiveError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CollectiveError::Timeout { peer, timeout, during },
        _ => CollectiveError::PeerLost { peer, during, source: e },
    }
}

/// The time left before `deadline`, at least [`MIN_TIMEOUT`] (sockets refuse a zero timeout).
fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(MIN_TIMEOUT)
}

/// Sets the options every ring connection uses.
fn configure(stream: &TcpStream) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)
}

/// Connects to rank `peer`'s listener, retrying (it may not be up yet) until `deadline`.
fn connect_retrying(peer: usize, addr: SocketAddr, timeout: Duration, deadline: Instant) -> Result<TcpStream, CollectiveError> {
    loop {
        match TcpStream::connect_timeout(&addr, remaining(deadline)) {
            Ok(s) => return Ok(s),
            Err(source) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(CollectiveError::Connect { peer, addr, timeout, source });
                }
                thread::sleep(CONNECT_RETRY.min(deadline - now));
            }
        }
    }
}

/// Accepts the first connection to `listener` before `deadline`; `peer` is the rank expected.
fn accept_before(
    listener: &TcpListener,
    peer: usize,
    timeout: Duration,
    deadline: Instant,
) -> Result<(TcpStream, SocketAddr), CollectiveError> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok(accepted) => return Ok(accepted),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(CollectiveError::Timeout { peer, timeout, during: "waiting for it to connect" });
                }
                thread::sleep(ACCEPT_POLL.min(deadline - now));
            }
            Err(e) => return Err(CollectiveError::Io(e)),
        }
    }
}

/// The bytes that open a handshake.
const MAGIC: [u8; 8] = *b"orcring1";
const HELLO_BYTES: usize = 40;
const STATUS_OK: u32 = 0;
const STATUS_MALFORMED: u32 = 1;
const STATUS_GROUP: u32 = 2;
const STATUS_WORLD: u32 = 3;
const STATUS_RANK: u32 = 4;
const STATUS_STALE: u32 = 5;
const STATUS_EPOCH: u32 = 6;

fn status_text(status: u32) -> &'static str {
    match status {
        STATUS_MALFORMED => "malformed handshake",
        STATUS_GROUP => "different group id",
        STATUS_WORLD => "different world size",
        STATUS_RANK => "not the rank it expects",
        STATUS_STALE => "an earlier ring epoch",
        STATUS_EPOCH => "a different ring epoch",
        _ => "unknown reason",
    }
}

/// A handshake: `magic | status u32 | epoch u32 | group u64 | rank u64 | world u64`, little-endian.
/// The connecting rank sends one; the listening rank answers with its own, whose status says
/// whether it accepted the connection.
#[derive(Clone, Copy, Debug)]
struct Hello {
    status: u32,
    /// The ring epoch (a new ring of the same group after a failure).
    epoch: u32,
    group: u64,
    rank: u64,
    world: u64,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut b = [0u8; HELLO_BYTES];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.status.to_le_bytes());
        b[12..16].copy_from_slice(&self.epoch.to_le_bytes());
        b[16..24].copy_from_slice(&self.group.to_le_bytes());
        b[24..32].copy_from_slice(&self.rank.to_le_bytes());
        b[32..40].copy_from_slice(&self.world.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HELLO_BYTES]) -> Option<Self> {
        if b[0..8] != MAGIC {
            return None;
        }
        Some(Self { status: u32_at(b, 8), epoch: u32_at(b, 12), group: u64_at(b, 16), rank: u64_at(b, 24), world: u64_at(b, 32) })
    }
}

const HEADER_BYTES: usize = 40;
const KIND_DATA: u32 = 0;
const KIND_ABORT: u32 = 1;

/// A message header: `group u64 | op u64 | step u32 | source u32 | sender u32 | kind u32 |
/// len u64`, little-endian. A data message's body is rank `source`'s `len` values as
/// little-endian `f32`; an abort's body is `len` bytes of UTF-8 reason and `source` is the rank
/// it blames.
#[derive(Clone, Copy, Debug)]
struct Header {
    group: u64,
    op: u64,
    step: u32,
    source: u32,
    sender: u32,
    kind: u32,
    len: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(&self.group.to_le_bytes());
        b[8..16].copy_from_slice(&self.op.to_le_bytes());
        b[16..20].copy_from_slice(&self.step.to_le_bytes());
        b[20..24].copy_from_slice(&self.source.to_le_bytes());
        b[24..28].copy_from_slice(&self.sender.to_le_bytes());
        b[28..32].copy_from_slice(&self.kind.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HEADER_BYTES]) -> Self {
        Self {
            group: u64_at(b, 0),
            op: u64_at(b, 8),
            step: u32_at(b, 16),
            source: u32_at(b, 20),
            sender: u32_at(b, 24),
            kind: u32_at(b, 28),
            len: u64_at(b, 32),
        }
    }
}

fn u32_at(b: &[u8; 40], at: usize) -> u32 {
    let mut v = [0u8; 4];
    v.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(v)
}

fn u64_at(b: &[u8; 40], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}
