//! The CPU collective over loopback TCP, with every rank on a thread of this process: the ring
//! all-reduce gives every rank the bit-identical rank-order sum, large vectors do not deadlock,
//! and dead, silent, never-joining, mismatched or stray peers become errors naming the peer
//! within the timeouts instead of hangs.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use orchestrator_worker::collective::{Collective, CollectiveError, LocalCollective, RingListener, TcpRing};

const GROUP: u64 = 0x5eed_0001;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest any test waits for a rank's thread: an implementation that hangs fails instead.
const WATCHDOG: Duration = Duration::from_secs(60);
const LARGE: usize = 1 << 20;

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Binds one listener per rank and returns them with the peer list.
fn listeners(n: usize) -> (Vec<RingListener>, Vec<SocketAddr>) {
    let listeners: Vec<RingListener> = (0..n).map(|_| RingListener::bind(loopback()).expect("bind loopback")).collect();
    let peers = listeners.iter().map(RingListener::local_addr).collect();
    (listeners, peers)
}

/// Runs `f(rank, item)` for every item on its own thread and returns the results in rank order,
/// failing the test (instead of hanging) if any thread takes longer than the watchdog.
fn on_threads<T: Send + 'static, R: Send + 'static>(items: Vec<T>, f: impl Fn(usize, T) -> R + Send + Clone + 'static) -> Vec<R> {
    let n = items.len();
    let (tx, rx) = mpsc::channel();
    for (rank, item) in items.into_iter().enumerate() {
        let (tx, f) = (tx.clone(), f.clone());
        thread::spawn(move || {
            let _ = tx.send((rank, f(rank, item)));
        });
    }
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let deadline = Instant::now() + WATCHDOG;
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        let (rank, r) = rx.recv_timeout(left).expect("a rank's thread hung past the watchdog");
        out[rank] = Some(r);
    }
    out.into_iter().map(|r| r.expect("every rank reported")).collect()
}

/// Connects a ring of `n` ranks in group `group`, with `op_timeout`.
fn ring(n: usize, op_timeout: Duration) -> Vec<TcpRing> {
    let (ls, peers) = listeners(n);
    on_threads(ls, move |rank, l| l.connect(GROUP, rank, &peers, CONNECT_TIMEOUT).expect("connect ring").with_timeout(op_timeout))
}

/// Deterministic values over many magnitudes and both signs, so that summing in another order
/// changes bits.
fn vector(seed: u64, len: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mantissa = (x >> 40) as f32 / (1u64 << 24) as f32 + 0.5;
            let exp = ((x >> 8) % 41) as i32 - 20;
            let sign = if x & 1 == 0 { 1.0 } else { -1.0 };
            sign * mantissa * 2f32.powi(exp)
        })
        .collect()
}

/// The in-process sum, in rank order, exactly as the trait documents it.
fn rank_order_sum(ds: &[Vec<f32>]) -> Vec<f32> {
    let mut y = ds[0].to_vec();
    for d in &ds[1..] {
        for (a, b) in y.iter_mut().zip(d) {
            *a += b;
        }
    }
    y
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// All-reduces `inputs[rank]` on every rank of `rings` at once and returns each rank's result.
fn all_reduce(rings: Vec<TcpRing>, inputs: Vec<Vec<f32>>) -> Vec<(TcpRing, Result<Vec<f32>, CollectiveError>)> {
    let items: Vec<(TcpRing, Vec<f32>)> = rings.into_iter().zip(inputs).collect();
    on_threads(items, |_, (mut ring, mut data)| {
        let r = ring.all_reduce_sum(&mut data).map(|()| data);
        (ring, r)
    })
}

/// Checks that every rank of an `n`-ring ends with the rank-order sum of `len`-value vectors,
/// bit for bit, and returns the rings for reuse.
fn check_sum(rings: Vec<TcpRing>, len: usize, seed: u64) -> Vec<TcpRing> {
    let n = rings.len();
    let mut inputs: Vec<Vec<f32>> = (0..n).map(|k| vector(seed + k as u64, len)).collect();
    if len > 0 {
        // 1 + 2^-24 rounds back to 1 (ties to even) however often it is repeated, but the small
        // terms summed first are 2^-23 and survive: only rank order gives exactly 1.
        for (k, d) in inputs.iter_mut().enumerate() {
            d[0] = if k == 0 { 1.0 } else { 2f32.powi(-24) };
        }
    }
    let expected = rank_order_sum(&inputs);
    if n >= 3 && len > 0 {
        // The check can fail: another summation order gives other bits on these inputs.
        let reversed: Vec<Vec<f32>> = inputs.iter().rev().cloned().collect();
        assert_ne!(bits(&rank_order_sum(&reversed)), bits(&expected), "inputs too tame to tell summation orders apart");
    }
    let mut out = Vec::new();
    for (rank, (ring, result)) in all_reduce(rings, inputs).into_iter().enumerate() {
        let y = result.unwrap_or_else(|e| panic!("rank {rank} of {n}: {e}"));
        assert_eq!(y.len(), len);
        assert!(bits(&y) == bits(&expected), "rank {rank} of {n} (len {len}): result differs from the in-process rank-order sum");
        out.push(ring);
    }
    out
}

#[test]
fn local_collective_leaves_data_alone() {
    let mut c = LocalCollective;
    assert_eq!((c.world_size(), c.rank()), (1, 0));
    let input = vec![1.5f32, -0.0, f32::NAN, f32::INFINITY, 3e-40];
    let mut data = input.clone();
    c.all_reduce_sum(&mut data).expect("local all-reduce");
    assert_eq!(bits(&data), bits(&rank_order_sum(&[input])));
}

#[test]
fn ring_of_one_leaves_data_alone() {
    let (ls, peers) = listeners(1);
    let mut ring = ls.into_iter().next().expect("one listener").connect(GROUP, 0, &peers, CONNECT_TIMEOUT).expect("ring of one");
    assert_eq!((ring.world_size(), ring.rank()), (1, 0));
    for len in [0, 5, LARGE] {
        let input = vector(1, len);
        let mut data = input.clone();
        ring.all_reduce_sum(&mut data).expect("all-reduce of one");
        assert!(bits(&data) == bits(&rank_order_sum(&[input])));
    }
}

#[test]
fn rings_report_their_place() {
    for (rank, ring) in ring(3, Duration::from_secs(10)).iter().enumerate() {
        assert_eq!((ring.world_size(), ring.rank(), ring.group()), (3, rank, GROUP));
        assert_eq!(ring.op_timeout(), Duration::from_secs(10));
    }
}

#[test]
fn small_vectors_sum_in_rank_order_on_every_rank() {
    for n in [2, 3, 4, 8] {
        let rings = ring(n, Duration::from_secs(10));
        let rings = check_sum(rings, 7, 100 * n as u64);
        check_sum(rings, 0, 1);
    }
}

#[test]
fn large_vectors_sum_in_rank_order_without_deadlock() {
    // 16 MB messages overflow the loopback socket buffers: a rank that sent before receiving
    // would wait on a peer doing the same, and fail with a timeout instead of summing.
    for (n, len) in [(2, 4 * LARGE), (2, LARGE), (3, LARGE), (4, LARGE), (8, LARGE)] {
        check_sum(ring(n, Duration::from_secs(5)), len, 1000 * n as u64);
    }
}

#[test]
fn one_ring_serves_repeated_all_reduces() {
    let mut rings = ring(3, Duration::from_secs(10));
    for (i, len) in [16, 1, 4096, 0, 300_000, 16].into_iter().enumerate() {
        rings = check_sum(rings, len, 7 * i as u64);
    }
}

/// Asserts that every result is an error blaming `culprit`, reached within `limit`.
fn assert_all_blame(results: Vec<(Result<(), CollectiveError>, Duration)>, culprit: usize, limit: Duration) {
    for (i, (r, took)) in results.into_iter().enumerate() {
        let e = r.expect_err("the all-reduce must fail");
        assert_eq!(e.peer(), Some(culprit), "survivor {i} blames the wrong rank: {e}");
        assert!(took < limit, "survivor {i} took {took:?} to fail: {e}");
    }
}

#[test]
fn a_peer_that_drops_its_ring_is_named_quickly() {
    for (n, dropped, len) in [(2, 1, 8), (4, 2, 8), (4, 0, LARGE), (3, 2, LARGE)] {
        let op_timeout = Duration::from_secs(1);
        let rings = ring(n, op_timeout);
        let items: Vec<(usize, TcpRing)> = rings.into_iter().enumerate().collect();
        let results = on_threads(items, move |_, (rank, mut ring)| {
            let t = Instant::now();
            if rank == dropped {
                // Leave the others mid-operation: they are already waiting on this rank.
                thread::sleep(Duration::from_millis(200));
                drop(ring);
                return None;
            }
            let mut data = vector(rank as u64, len);
            let r = ring.all_reduce_sum(&mut data);
            let took = t.elapsed();
            // The ring is unusable from then on, and says so at once.
            let again = ring.all_reduce_sum(&mut data);
            assert!(matches!(again, Err(CollectiveError::Broken { .. })), "rank {rank}: {again:?}");
            Some((r, took))
        });
        let survivors: Vec<_> = results.into_iter().flatten().collect();
        assert_eq!(survivors.len(), n - 1);
        assert_all_blame(survivors, dropped, Duration::from_secs(2));
    }
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let op_timeout = Duration::from_millis(300);
    let rings = ring(2, op_timeout);
    let items: Vec<(usize, TcpRing)> = rings.into_iter().enumerate().collect();
    let results = on_threads(items, move |_, (rank, mut ring)| {
        if rank == 1 {
            // Connected but never takes part; keeps its sockets open past the others' timeout.
            thread::sleep(Duration::from_secs(2));
            return None;
        }
        let t = Instant::now();
        let r = ring.all_reduce_sum(&mut [1.0, 2.0, 3.0]);
        Some((r, t.elapsed()))
    });
    let (r, took) = results.into_iter().flatten().next().expect("rank 0 reported");
    let e = r.expect_err("a silent peer must fail the all-reduce");
    assert!(matches!(e, CollectiveError::Timeout { peer: 1, .. }), "{e}");
    assert!(took >= op_timeout && took < Duration::from_secs(2), "took {took:?}");
}

#[test]
fn a_peer_that_never_joins_fails_connect_within_its_timeout() {
    let timeout = Duration::from_millis(500);
    // Rank 2's listener is up but it never connects: the others wait for it, then give up.
    let (mut ls, peers) = listeners(3);
    let _absent = ls.pop();
    let results = on_threads(ls, move |rank, l| {
        let t = Instant::now();
        (l.connect(GROUP, rank, &peers, timeout).map(|_| ()), t.elapsed())
    });
    for (rank, (r, took)) in results.into_iter().enumerate() {
        let e = r.expect_err("connect must fail without rank 2");
        assert!(matches!(e, CollectiveError::Timeout { peer: 2, .. }), "rank {rank}: {e}");
        assert!(took >= timeout && took < timeout + Duration::from_secs(1), "rank {rank} took {took:?}");
    }

    // Rank 1 has no listener at all: rank 0 retries until its timeout, then names it.
    let (mut ls, peers) = listeners(2);
    drop(ls.pop());
    let l = ls.pop().expect("rank 0's listener");
    let t = Instant::now();
    let e = l.connect(GROUP, 0, &peers, timeout).expect_err("connect must fail without rank 1");
    let took = t.elapsed();
    assert!(matches!(e, CollectiveError::Connect { peer: 1, .. }), "{e}");
    assert!(took >= timeout && took < timeout + Duration::from_secs(1), "took {took:?}");
}

#[test]
fn mismatched_lengths_are_refused() {
    let rings = ring(2, Duration::from_secs(2));
    let results = all_reduce(rings, vec![vector(1, 4), vector(2, 5)]);
    for (rank, (_, r)) in results.into_iter().enumerate() {
        let (expected, found) = if rank == 0 { (4, 5) } else { (5, 4) };
        match r {
            Err(CollectiveError::LengthMismatch { peer, expected: e, found: f }) => {
                assert_eq!((peer, e, f), (1 - rank, expected, found), "rank {rank}");
            }
            other => panic!("rank {rank}: expected a length mismatch, got {other:?}"),
        }
    }

    // In a larger ring every rank fails (some blame the odd rank directly, the rest are told).
    let rings = ring(4, Duration::from_secs(2));
    let lens = [LARGE, LARGE, LARGE + 1, LARGE];
    let t = Instant::now();
    let results = all_reduce(rings, lens.iter().enumerate().map(|(k, &len)| vector(k as u64, len)).collect());
    assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
    let mut mismatches = 0;
    for (rank, (_, r)) in results.into_iter().enumerate() {
        let e = r.expect_err("mismatched lengths must fail every rank");
        if let CollectiveError::LengthMismatch { .. } = e {
            mismatches += 1;
        }
        assert!(e.peer().is_some(), "rank {rank}: {e}");
    }
    assert!(mismatches >= 2, "the odd rank and its next rank see the mismatch directly");
}

#[test]
fn a_wrong_group_is_refused_in_the_handshake() {
    let (ls, peers) = listeners(2);
    let results = on_threads(ls, move |rank, l| l.connect(GROUP + rank as u64, rank, &peers, Duration::from_secs(5)).map(|_| ()));
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Err(CollectiveError::Handshake { peer, reason, .. }) => {
                assert_eq!(peer, 1 - rank);
                assert!(reason.contains("group"), "rank {rank}: {reason}");
            }
            other => panic!("rank {rank}: expected a handshake refusal, got {other:?}"),
        }
    }
}

#[test]
fn a_wrong_world_size_is_refused_in_the_handshake() {
    let (ls, peers) = listeners(3);
    let results = on_threads(ls, move |rank, l| {
        // Rank 0 believes the group has only ranks 0 and 1.
        let view = if rank == 0 { &peers[..2] } else { &peers[..] };
        l.connect(GROUP, rank, view, Duration::from_millis(800)).map(|_| ())
    });
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert!(results.iter().any(|r| matches!(r, Err(CollectiveError::Handshake { .. }))), "{results:?}");
}

#[test]
fn a_stray_connection_is_refused() {
    let (mut ls, peers) = listeners(2);
    let _rank1 = ls.pop();
    let rank0 = ls.pop().expect("rank 0's listener");
    let target = peers[0];
    let stray = thread::spawn(move || {
        let mut s = TcpStream::connect(target).expect("stray connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789abc").expect("stray write");
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        answer
    });
    let e = rank0.connect(GROUP, 0, &peers, Duration::from_secs(5)).expect_err("a stray must be refused");
    assert!(matches!(e, CollectiveError::Handshake { peer: 1, .. }), "{e}");
    // The stray was told it was refused (a handshake answer with a non-zero status), not left open.
    let answer = stray.join().expect("stray thread");
    assert_eq!(answer.len(), 40, "{answer:?}");
    assert_eq!(&answer[..8], b"orcring1");
    assert_ne!(&answer[8..12], &[0, 0, 0, 0]);
}

#[test]
fn bad_arguments_are_errors() {
    let (mut ls, peers) = listeners(2);
    let e = ls.pop().expect("listener").connect(GROUP, 2, &peers, CONNECT_TIMEOUT).expect_err("rank outside the group");
    assert!(matches!(e, CollectiveError::InvalidGroup { .. }), "{e}");
    let e = ls.pop().expect("listener").connect(GROUP, 0, &[], CONNECT_TIMEOUT).expect_err("no peers");
    assert!(matches!(e, CollectiveError::InvalidGroup { .. }), "{e}");
}

/// A ring that failed is replaced by a new epoch from the same listeners: the ranks meet again
/// and sum exactly, and a connection left over from the failed epoch is refused and skipped.
#[test]
fn a_new_epoch_rebuilds_a_failed_ring_from_the_same_listeners() {
    let n = 3;
    let (ls, peers) = listeners(n);
    let ls: Vec<std::sync::Arc<RingListener>> = ls.into_iter().map(std::sync::Arc::new).collect();
    let epoch0 = {
        let peers = peers.clone();
        on_threads(ls.clone(), move |rank, l| l.connect_epoch(GROUP, 0, rank, &peers, CONNECT_TIMEOUT).expect("epoch 0"))
    };
    // Rank 2 drops out mid-operation: epoch 0 breaks on every survivor.
    let items: Vec<(usize, TcpRing)> = epoch0.into_iter().enumerate().collect();
    let broken = on_threads(items, move |_, (rank, ring)| {
        if rank == 2 {
            thread::sleep(Duration::from_millis(100));
            return true;
        }
        let mut data = vector(rank as u64, 8);
        ring.with_timeout(Duration::from_secs(1)).all_reduce_sum(&mut data).is_err()
    });
    assert!(broken.iter().all(|b| *b), "{broken:?}");
    // A straggler of epoch 0 knocks on rank 0's listener before epoch 1 starts.
    let mut stale = TcpStream::connect(peers[0]).expect("stale connect");
    let mut hello = [0u8; 40];
    hello[..8].copy_from_slice(b"orcring1");
    hello[16..24].copy_from_slice(&GROUP.to_le_bytes());
    hello[24..32].copy_from_slice(&2u64.to_le_bytes());
    hello[32..40].copy_from_slice(&3u64.to_le_bytes());
    stale.write_all(&hello).expect("stale hello");
    let rings = {
        let peers = peers.clone();
        on_threads(ls, move |rank, l| l.connect_epoch(GROUP, 1, rank, &peers, CONNECT_TIMEOUT).expect("epoch 1"))
    };
    check_sum(rings, 1000, 7);
    // The straggler was told it belongs to an earlier epoch (status 5), not left waiting.
    stale.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut answer = [0u8; 40];
    stale.read_exact(&mut answer).expect("the straggler gets an answer");
    assert_eq!(u32::from_le_bytes(answer[8..12].try_into().unwrap()), 5);
}

/// A rank asked to join an epoch its peer has not reached fails naming the epochs.
#[test]
fn a_later_epoch_is_refused_in_the_handshake() {
    let (ls, peers) = listeners(2);
    let results = on_threads(ls, move |rank, l| l.connect_epoch(GROUP, 3 - rank as u32, rank, &peers, Duration::from_secs(3)).map(|_| ()));
    assert!(results.iter().any(|r| matches!(r, Err(CollectiveError::Handshake { reason, .. }) if reason.contains("epoch"))), "{results:?}");
}
