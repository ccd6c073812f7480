//! A probe on this rank: its passes (kernel layouts, and the reference when asked), the TP
//! all-reduce of its partial `y` over the group's ring or NCCL, the answer, and the
//! verification probe of staged weights kept for the probe right after their commit.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use orchestrator_kernels::Digest;
use orchestrator_proto::v1 as pb;

use super::RankError;
use super::state::{Collectives, Plan, State, versions_of};
use crate::collective::{Collective, LocalCollective};
use crate::device::AnyBackend;
use crate::loader::{RankLoader, RankWeights};
use crate::probe::{ProbeSpec, probe_rank_with};
use crate::source::LoadSource;

/// The verdict of a deferred round trip, taken from the verified rank `proof` names when the
/// staged weights `w` hold the same kernel and source bytes (a round trip reads those alone);
/// `None` when they differ (the rank then runs its own).
pub(crate) fn adopt_round_trip(w: &RankWeights<AnyBackend>, proof: &pb::RoundTripProof) -> Option<crate::roundtrip::RoundTrip> {
    let same = w.kernel_rank_digest().hex() == proof.kernel_rank_digest && w.source_rank_digest().hex() == proof.source_rank_digest;
    same.then(|| crate::roundtrip::RoundTrip { ok: true, identical_to: Some(proof.rank.clone()), ..Default::default() })
}

/// One rank's passes of a probe, before its all-reduce.
pub(crate) struct ComputedProbe {
    pub(crate) probe: crate::probe::RankProbe,
    pub(crate) version: String,
    pub(crate) generation: u64,
}

/// The first half of a staged version's probe ([`pb::ProbePhase::Compute`]), kept for its
/// second: of which staged weights (held weakly: a kept result never keeps weights alive),
/// which probe, with or without the reference.
pub(crate) struct Computed {
    pub(crate) weights: std::sync::Weak<RankWeights<AnyBackend>>,
    pub(crate) spec: ProbeSpec,
    pub(crate) check: bool,
    pub(crate) probe: ComputedProbe,
}

/// A verification probe of staged weights, all-reduced, kept by the rank so that the probe
/// right after their commit (the same probe of the very same weights, which nothing writes
/// between the two) is answered from it rather than computed again: which probe, with or
/// without the reference, this rank's passes and its group's `y`.
pub(crate) struct KeptProbe {
    pub(crate) spec: ProbeSpec,
    pub(crate) check: bool,
    pub(crate) probe: ComputedProbe,
    pub(crate) y_digest: String,
    pub(crate) allreduce_seconds: f64,
}

impl KeptProbe {
    /// The answer to a probe after the commit (`generation`: the committed weights').
    pub(crate) fn answer(&self, st: &State, generation: u64) -> pb::ProbeResult {
        pb::ProbeResult { generation, kept: true, ..answer_of(st, &self.probe, self.y_digest.clone(), self.allreduce_seconds) }
    }
}

/// Runs this rank's passes of `spec` on `w` (`check`: against the reference, kept in `cache`).
pub(crate) fn compute_probe(
    backend: &AnyBackend,
    plan: &Plan,
    w: &RankWeights<AnyBackend>,
    source: &LoadSource,
    spec: ProbeSpec,
    check: bool,
    cache: &Mutex<crate::probe::ReferenceCache>,
) -> Result<ComputedProbe, RankError> {
    let loader =
        RankLoader::new(backend, source.config(), plan.tp_size, plan.tp_rank, plan.rule).map_err(|e| RankError::ProbePlan(Box::new(e)))?;
    let probe = probe_rank_with(&loader, w, source, spec, plan.rule, check, Some(cache)).map_err(|e| RankError::Probe(Box::new(e)))?;
    let version = source.version();
    crate::metrics::worker().probed(plan.dp_rank, plan.tp_rank, &version, probe.ok, probe.kernel_s + probe.reference_s);
    Ok(ComputedProbe { probe, version, generation: w.generation })
}

/// The answer to a probe whose passes gave `c`, with its all-reduced `y` (empty: not reduced).
pub(crate) fn answer_of(st: &State, c: &ComputedProbe, y_digest: String, allreduce_seconds: f64) -> pb::ProbeResult {
    let p = &c.probe;
    let (checkpoint_version, staged_version) = versions_of(st);
    pb::ProbeResult {
        probed_version: c.version.clone(),
        checkpoint_version,
        staged_version,
        ok: p.ok,
        q_mismatches: p.layers.iter().map(|l| l.q_mismatches as u64).sum(),
        z_max_abs_err: p.z_max_abs_err,
        z_max_rel_err: p.z_max_rel_err,
        y_max_abs_err: p.y_max_abs_err,
        y_max_rel_err: p.y_max_rel_err,
        y_partial_digest: p.y_partial_digest.hex(),
        y_digest,
        kernel_seconds: p.kernel_s,
        reference_seconds: p.reference_s,
        allreduce_seconds,
        layers: p.layers.len() as u32,
        generation: c.generation,
        pid: std::process::id(),
        kept: false,
    }
}

/// The peers of the ring a reduce for `r` joins, resolved (a name may wait on DNS) without the
/// collectives held: `None` where it joins none (a GPU group, TP 1) or the rank is already in
/// that ring. Held only to look.
pub(crate) fn peers_to_join(collectives: &Mutex<Collectives>, r: &pb::ProbeRequest) -> Result<Option<Vec<SocketAddr>>, RankError> {
    {
        let co = super::state::lock(collectives);
        let joined = co.ring.as_ref().is_some_and(|(g, e, _)| (*g, *e) == (r.group, r.ring_epoch));
        if !r.nccl_unique_id.is_empty() || co.tp_size <= 1 || joined {
            return Ok(None);
        }
    }
    resolve_peers(&r.peers).map(Some)
}

/// Every peer address of a ring, resolved ([`resolve_peer`]).
fn resolve_peers(peers: &[String]) -> Result<Vec<SocketAddr>, RankError> {
    peers.iter().map(|a| resolve_peer(a)).collect()
}

/// The TP all-reduce of a probe's `y_partial` (in rank order) over the group's ring, or NCCL:
/// the reduced `y`'s digest and the seconds the reduce took. Only the rank's collectives are
/// held (its state is not: see [`Collectives`]).
/// `peers`: the ring's, resolved beforehand ([`peers_to_join`]); resolved here where the rank
/// must join a ring it was not given them for (another probe's ring went away meanwhile).
pub(crate) fn reduce(
    co: &mut Collectives,
    backend: &AnyBackend,
    r: &pb::ProbeRequest,
    c: &ComputedProbe,
    peers: Option<Vec<SocketAddr>>,
) -> Result<(String, f64), RankError> {
    let (tp_rank, tp_size) = (co.tp_rank, co.tp_size);
    if co.listener.is_none() {
        return Err(RankError::NotAssigned);
    }
    let started = Instant::now();
    let mut y = c.probe.y_partial.clone();
    let timeout = Duration::from_millis(if r.timeout_ms == 0 { 30_000 } else { r.timeout_ms as u64 });
    if !r.nccl_unique_id.is_empty() {
        // GPU workers: NCCL, with the id the group's rank 0 created (world size 1 included).
        backend
            .nccl_all_reduce(&mut co.device, r.group, &r.nccl_unique_id, tp_rank, tp_size, timeout, &mut y)
            .map_err(RankError::AllReduce)?;
    } else if tp_size > 1 {
        if co.ring.as_ref().is_none_or(|(g, e, _)| (*g, *e) != (r.group, r.ring_epoch)) {
            // A new group or epoch (after a failure): drop the old ring, join the new one.
            co.ring = None;
            let peers: Vec<SocketAddr> = match peers {
                Some(p) => p,
                None => resolve_peers(&r.peers)?,
            };
            let listener = co.listener.as_ref().ok_or(RankError::NoListener)?;
            let ring = listener
                .connect_epoch(r.group, r.ring_epoch, tp_rank, &peers, timeout)
                .map_err(|why| RankError::Ring { epoch: r.ring_epoch, why })?;
            co.ring = Some((r.group, r.ring_epoch, ring));
        }
        let (_, _, ring) = co.ring.as_mut().expect("ring set above");
        if let Err(e) = ring.all_reduce_sum(&mut y) {
            // A failed ring is never reused: the next probe joins a ring again, whatever epoch it
            // names.
            co.ring = None;
            return Err(RankError::AllReduce(e));
        }
    } else {
        LocalCollective.all_reduce_sum(&mut y).map_err(RankError::LocalReduce)?;
    }
    Ok((Digest::of_f32(&y).hex(), started.elapsed().as_secs_f64()))
}

/// Keeps the reduced verification probe `c` (answered with `answer`) of the staged weights
/// `weights` for the probe after their commit.
pub(crate) fn keep_verified(
    st: &mut State,
    weights: std::sync::Weak<RankWeights<AnyBackend>>,
    spec: ProbeSpec,
    check: bool,
    c: ComputedProbe,
    answer: &pb::ProbeResult,
) {
    let kept = KeptProbe { spec, check, probe: c, y_digest: answer.y_digest.clone(), allreduce_seconds: answer.allreduce_seconds };
    st.verified_probe = Some((weights, kept));
}

/// A peer's advertised `host:port` (an IP, or a name such as a pod's DNS name).
pub(crate) fn resolve_peer(address: &str) -> Result<SocketAddr, RankError> {
    if let Ok(a) = address.parse() {
        return Ok(a);
    }
    use std::net::ToSocketAddrs;
    address
        .to_socket_addrs()
        .map_err(|e| RankError::PeerAddress { address: address.to_string(), why: e.to_string() })?
        .next()
        .ok_or_else(|| RankError::PeerUnresolved { address: address.to_string() })
}
