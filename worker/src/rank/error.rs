//! Why a rank refuses or fails a request: one enum, by kind, each answered as one gRPC status
//! ([`From<RankError> for Status`]):
//!
//! | kind | status |
//! |---|---|
//! | the request does not fit what the rank holds (nothing assigned, loaded, staged, kept or computed; another version or geometry) | `FAILED_PRECONDITION` |
//! | the weights it needs are still read by a probe or report; its active weights are changing; the collective failed | `UNAVAILABLE` (ask again) |
//! | a later stage, abort or load overtook it | `ABORTED` |
//! | the request itself is wrong (its source, scale rule, shard, probe size, peer address) | `INVALID_ARGUMENT` (a source outside the allowed roots, a dump directory outside the dump root: `PERMISSION_DENIED`) |
//! | loading, staging, probing, dumping or binding failed on this rank | `INTERNAL` |

use orchestrator_model::limits::LimitError;
use orchestrator_model::{Geometry, ModelError, WeightFormat};
use tonic::Status;

use crate::loader::LoadError;
use crate::probe::ProbeSpec;
use crate::source::SourceError;

#[derive(Debug, thiserror::Error)]
pub enum RankError {
    #[error("no shard assigned")]
    NotAssigned,
    #[error("no shard assigned yet (call Assign first)")]
    LoadBeforeAssign,
    #[error("not loaded")]
    NotLoaded,
    #[error("nothing loaded to reload into")]
    NothingToReload,
    #[error("the new version has geometry {new_geometry:?} / {new_format:?}, the running plan {old_geometry:?} / {old_format:?}")]
    OtherGeometry { new_geometry: Box<Geometry>, new_format: WeightFormat, old_geometry: Box<Geometry>, old_format: WeightFormat },
    #[error("nothing staged")]
    NoStage,
    /// A commit with nothing staged that does not find its version in place either.
    #[error("commit: nothing staged (holding version {active})")]
    CommitNothingStaged { active: String },
    #[error("commit: staged version {staged}, expected {expected}")]
    CommitOtherVersion { staged: String, expected: String },
    #[error("abort: nothing kept to roll back to")]
    NothingKept,
    #[error("abort: the kept version is {kept}, expected {expected}")]
    KeptOtherVersion { kept: String, expected: String },
    #[error("probe: no kept verification probe of the active weights (generation {generation}) for this probe")]
    NoKeptProbe { generation: u64 },
    #[error("probe: nothing computed to reduce for this probe of the staged version")]
    NothingComputed,
    #[error("no collective listener (call Assign first)")]
    NoListener,
    #[error("set serving: this rank holds version `{active}`, not the verified `{version}`")]
    NotVerified { active: String, version: String },
    /// A change of the active weights is under way (an assignment, load, commit or rollback).
    #[error("set serving: {changes} change(s) of the active weights under way")]
    WeightsChanging { changes: usize },

    #[error("commit: the staged version is still being probed")]
    StagedInUse,
    #[error("abort: the kept version is still being read (ask again)")]
    KeptInUse,
    #[error("collective (epoch {epoch}): {why}")]
    Ring { epoch: u32, why: crate::collective::CollectiveError },
    #[error("all-reduce: {0}")]
    AllReduce(crate::collective::CollectiveError),

    #[error("stage: superseded by a later stage or abort")]
    Superseded,
    #[error("load: superseded by a later load, commit, rollback or assignment (its weights were dropped)")]
    LoadSuperseded,
    #[error("probe: the weights it computed on were replaced meanwhile (ask again)")]
    Replaced,

    #[error(transparent)]
    Source(Box<SourceError>),
    /// An assignment's dump directory that this worker may not write to.
    #[error("assign: dump_dir `{dir}`: {why}")]
    DumpDir { dir: String, why: String },
    /// The assigned checkpoint, opened again for a reload, is no longer readable here.
    #[error("{0}")]
    Reopen(Box<ModelError>),
    #[error("{0}")]
    ScaleRule(String),
    /// A name or path longer than any real one (not echoed back).
    #[error(transparent)]
    TooLong(#[from] orchestrator_proto::limits::TooLong),
    #[error("{0}")]
    Shard(Box<ModelError>),
    #[error("stage: source is missing")]
    StageWithoutSource,
    /// A probe (or a stage's reference) of a size over the limits (`context`: `probe`,
    /// `stage: reference`).
    #[error("{context}: {error}")]
    ProbeSize { context: &'static str, error: LimitError },
    #[error("probe: a probe in halves is of the staged version (shadow) only")]
    HalvesOfActive,
    #[error("probe: a kept probe answers a whole probe of the active weights only")]
    KeptNotWhole,
    #[error("assign: dp_rank {dp_rank} of dp_size {dp_size} (dp_rank below dp_size, dp_size 1 to {max})")]
    DpRank { dp_rank: u32, dp_size: u32, max: usize },
    #[error("probe: {got} peer addresses for a TP group of {tp_size}")]
    Peers { got: usize, tp_size: usize },
    #[error("probe: timeout_ms {ms} is over the limit of {limit_ms}")]
    RingTimeout { ms: u32, limit_ms: u128 },
    #[error("peer address `{address}`: {why}")]
    PeerAddress { address: String, why: String },
    #[error("peer address `{address}` resolves to nothing")]
    PeerUnresolved { address: String },
    /// The plan of a load (the shard of this geometry).
    #[error("{0}")]
    LoadPlan(Box<LoadError>),

    #[error("load: {0}")]
    Load(Box<LoadError>),
    #[error("stage: {0}")]
    Stage(Box<LoadError>),
    #[error("stage: the reference of probe {spec}: {why}")]
    Reference { spec: ProbeSpec, why: Box<LoadError> },
    #[error("fault injection: {0}")]
    FaultInjection(orchestrator_kernels::KernelError),
    /// Refreshing the kernel digests after a fault was injected.
    #[error("{0}")]
    Digests(Box<LoadError>),
    #[error("dump: {0}")]
    Dump(crate::dump::DumpError),
    /// The plan of a probe.
    #[error("{0}")]
    ProbePlan(Box<LoadError>),
    #[error("probe: {0}")]
    Probe(Box<LoadError>),
    /// The all-reduce of a TP group of one.
    #[error("{0}")]
    LocalReduce(crate::collective::CollectiveError),
    #[error("collective listener on {ip}: {why}")]
    Listener { ip: std::net::IpAddr, why: crate::collective::CollectiveError },
    #[error("NCCL unique id: {0}")]
    NcclId(crate::collective::CollectiveError),
}

impl From<SourceError> for RankError {
    fn from(e: SourceError) -> Self {
        RankError::Source(Box::new(e))
    }
}

impl From<RankError> for Status {
    fn from(e: RankError) -> Self {
        use RankError::*;
        let message = e.to_string();
        match e {
            Source(e) => (*e).into(),
            NotAssigned
            | LoadBeforeAssign
            | NotLoaded
            | NothingToReload
            | OtherGeometry { .. }
            | NoStage
            | CommitNothingStaged { .. }
            | CommitOtherVersion { .. }
            | NothingKept
            | KeptOtherVersion { .. }
            | NoKeptProbe { .. }
            | NothingComputed
            | NoListener
            | NotVerified { .. } => Status::failed_precondition(message),
            StagedInUse | KeptInUse | WeightsChanging { .. } | Ring { .. } | AllReduce(_) => Status::unavailable(message),
            Superseded | LoadSuperseded | Replaced => Status::aborted(message),
            Reopen(_) | DumpDir { .. } => Status::permission_denied(message),
            ScaleRule(_)
            | TooLong(_)
            | Shard(_)
            | StageWithoutSource
            | ProbeSize { .. }
            | HalvesOfActive
            | KeptNotWhole
            | DpRank { .. }
            | Peers { .. }
            | RingTimeout { .. }
            | PeerAddress { .. }
            | PeerUnresolved { .. }
            | LoadPlan(_) => Status::invalid_argument(message),
            Load(_)
            | Stage(_)
            | Reference { .. }
            | FaultInjection(_)
            | Digests(_)
            | Dump(_)
            | ProbePlan(_)
            | Probe(_)
            | LocalReduce(_)
            | Listener { .. }
            | NcclId(_) => Status::internal(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    /// Each kind's status code, and its message exactly as the gRPC answer carries it.
    #[test]
    fn every_kind_is_answered_with_its_code_and_message() {
        let ring = || crate::collective::CollectiveError::InvalidGroup { reason: "no peers".into() };
        let model = || ModelError::UnknownPreset { name: "x".into(), known: "tiny".into() };
        let load = || Box::new(LoadError::Config("bad".into()));
        let cases: Vec<(RankError, Code, &str)> = vec![
            (RankError::NotAssigned, Code::FailedPrecondition, "no shard assigned"),
            (RankError::LoadBeforeAssign, Code::FailedPrecondition, "no shard assigned yet (call Assign first)"),
            (RankError::NothingToReload, Code::FailedPrecondition, "nothing loaded to reload into"),
            (
                RankError::NoKeptProbe { generation: 4 },
                Code::FailedPrecondition,
                "probe: no kept verification probe of the active weights (generation 4) for this probe",
            ),
            (
                RankError::NothingComputed,
                Code::FailedPrecondition,
                "probe: nothing computed to reduce for this probe of the staged version",
            ),
            (
                RankError::NotVerified { active: "a".into(), version: "b".into() },
                Code::FailedPrecondition,
                "set serving: this rank holds version `a`, not the verified `b`",
            ),
            (RankError::StagedInUse, Code::Unavailable, "commit: the staged version is still being probed"),
            (RankError::Ring { epoch: 3, why: ring() }, Code::Unavailable, "collective (epoch 3): invalid ring: no peers"),
            (RankError::AllReduce(ring()), Code::Unavailable, "all-reduce: invalid ring: no peers"),
            (RankError::Superseded, Code::Aborted, "stage: superseded by a later stage or abort"),
            (
                RankError::LoadSuperseded,
                Code::Aborted,
                "load: superseded by a later load, commit, rollback or assignment (its weights were dropped)",
            ),
            (RankError::Replaced, Code::Aborted, "probe: the weights it computed on were replaced meanwhile (ask again)"),
            (SourceError::Missing.into(), Code::InvalidArgument, "source: missing (checkpoint_dir or dummy)"),
            (RankError::Reopen(Box::new(model())), Code::PermissionDenied, ""),
            (RankError::ScaleRule("unknown scale rule `x`".into()), Code::InvalidArgument, "unknown scale rule `x`"),
            (
                RankError::TooLong(orchestrator_proto::limits::TooLong { field: "version", bytes: 2000, limit: 1024 }),
                Code::InvalidArgument,
                "version: 2000 bytes, over the limit of 1024",
            ),
            (RankError::StageWithoutSource, Code::InvalidArgument, "stage: source is missing"),
            (
                RankError::ProbeSize { context: "stage: reference", error: LimitError::Zero { what: "probe tokens" } },
                Code::InvalidArgument,
                "stage: reference: ",
            ),
            (RankError::HalvesOfActive, Code::InvalidArgument, "probe: a probe in halves is of the staged version (shadow) only"),
            (RankError::PeerUnresolved { address: "h:1".into() }, Code::InvalidArgument, "peer address `h:1` resolves to nothing"),
            (
                RankError::DpRank { dp_rank: 2, dp_size: 2, max: 4096 },
                Code::InvalidArgument,
                "assign: dp_rank 2 of dp_size 2 (dp_rank below dp_size, dp_size 1 to 4096)",
            ),
            (RankError::Peers { got: 100_000, tp_size: 2 }, Code::InvalidArgument, "probe: 100000 peer addresses for a TP group of 2"),
            (
                RankError::RingTimeout { ms: u32::MAX, limit_ms: 120_000 },
                Code::InvalidArgument,
                "probe: timeout_ms 4294967295 is over the limit of 120000",
            ),
            (RankError::LoadPlan(load()), Code::InvalidArgument, "bad"),
            (RankError::Load(load()), Code::Internal, "load: bad"),
            (RankError::Stage(load()), Code::Internal, "stage: bad"),
            (
                RankError::Reference { spec: ProbeSpec { tokens: 2, latents: 16, seed: 0 }, why: load() },
                Code::Internal,
                "stage: the reference of probe ",
            ),
            (RankError::Probe(load()), Code::Internal, "probe: bad"),
            (RankError::NcclId(ring()), Code::Internal, "NCCL unique id: invalid ring: no peers"),
        ];
        for (e, code, message) in cases {
            let status = Status::from(e);
            assert_eq!(status.code(), code, "{}", status.message());
            assert!(status.message().starts_with(message), "{:?} does not start with {message:?}", status.message());
        }
    }
}
