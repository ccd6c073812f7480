//! [`WorkerService`]: the `Worker` gRPC service over a [`Rank`]. Each RPC runs the rank's call
//! on a blocking thread (loads, probes and a ring's all-reduce block; the runtime also sends
//! the worker's heartbeats), streams a load's progress, answers a [`RankError`] as its
//! `Status`, and keeps grpc.health.v1 readiness: not ready while the active weights change or
//! are not verified, ready only when the coordinator says the replica serves the rank's
//! active version.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::worker_server::Worker;
use tokio::sync::Notify;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::device::AnyBackend;
use crate::rank::{Progress, Rank, RankError, WeightsChange};
use orchestrator_model::AllowedRoots;

/// The worker service.
#[derive(Clone)]
pub struct WorkerService {
    pub(crate) rank: Arc<Rank>,
    shutdown: Arc<Notify>,
    /// grpc.health.v1 readiness: SERVING only while the coordinator says the replica is in
    /// rotation on this rank's active version (none in in-process tests).
    health: Option<orchestrator_net::grpc::Health>,
    /// Held while readiness is set: a SetServing's check of the rank and its SERVING are one
    /// step against a change of the weights beginning (which sets NOT_SERVING), so that no
    /// SERVING checked before a change lands after it.
    readiness: Arc<tokio::sync::Mutex<()>>,
    /// The `hung-commit` fault has hung a Commit already (it hangs the first only).
    hung_once: Arc<std::sync::atomic::AtomicBool>,
}

fn host_name() -> String {
    crate::placement::host_name(&|k| std::env::var(k).ok())
}

type ProgressStream = Pin<Box<dyn Stream<Item = Result<pb::LoadProgress, Status>> + Send>>;

fn stream(progress: Progress) -> ProgressStream {
    Box::pin(ReceiverStream::new(progress).map(|p| p.map_err(Status::from)))
}

impl WorkerService {
    /// A CPU worker reading checkpoints under `roots`, its ring on loopback (in-process tests).
    pub fn new(shutdown: Arc<Notify>, roots: AllowedRoots) -> Self {
        Self::serving(shutdown, Rank::new(roots, AnyBackend::Cpu(orchestrator_kernels::CpuBackend), host_name()))
    }

    /// The service of `rank`; `shutdown` is notified by the Shutdown RPC.
    pub fn serving(shutdown: Arc<Notify>, rank: Rank) -> Self {
        Self { rank: Arc::new(rank), shutdown, health: None, readiness: Default::default(), hung_once: Default::default() }
    }

    /// Reports readiness through `health`.
    pub fn with_health(self, health: orchestrator_net::grpc::Health) -> Self {
        Self { health: Some(health), ..self }
    }

    /// The device's name.
    pub fn device(&self) -> String {
        self.rank.device()
    }

    /// A change of the active weights begins: not ready until the coordinator verifies them
    /// and says so, which the rank refuses while the returned change is held (hold it until the
    /// change has ended).
    async fn begin_change(&self) -> WeightsChange {
        let _readiness = self.readiness.lock().await;
        let change = self.rank.begin_change();
        if let Some(h) = &self.health {
            h.set(false).await;
        }
        change
    }

    /// Runs `f` on the rank on a blocking thread: the rank's calls block (loads, round trips, a
    /// probe's ring all-reduce waiting on its peers, which an Assign waits for), and waiting must
    /// never block the runtime that sends this worker's heartbeats.
    async fn blocking<T: Send + 'static>(&self, f: impl FnOnce(&Rank) -> Result<T, RankError> + Send + 'static) -> Result<T, Status> {
        let rank = self.rank.clone();
        tokio::task::spawn_blocking(move || f(&rank)).await.map_err(|e| Status::internal(e.to_string()))?.map_err(Status::from)
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn assign(&self, request: Request<pb::AssignRequest>) -> Result<Response<pb::AssignResponse>, Status> {
        let r = request.into_inner();
        let assignment = self.blocking(move |rank| rank.prepare_assignment(&r)).await?;
        let change = self.begin_change().await;
        self.blocking(move |rank| {
            let _change = change;
            rank.assign(assignment)
        })
        .await
        .map(Response::new)
    }

    type LoadStream = ProgressStream;

    async fn load(&self, _request: Request<pb::LoadRequest>) -> Result<Response<Self::LoadStream>, Status> {
        let change = self.begin_change().await;
        self.blocking(move |rank| rank.load(change)).await.map(|p| Response::new(stream(p)))
    }

    type ReloadStream = ProgressStream;

    async fn reload(&self, request: Request<pb::ReloadRequest>) -> Result<Response<Self::ReloadStream>, Status> {
        let named = request.into_inner().source;
        let source = self.blocking(move |rank| rank.reload_source(named.as_ref())).await?;
        let change = self.begin_change().await;
        self.blocking(move |rank| rank.reload(source, change)).await.map(|p| Response::new(stream(p)))
    }

    type StageStream = ProgressStream;

    async fn stage(&self, request: Request<pb::StageRequest>) -> Result<Response<Self::StageStream>, Status> {
        let r = request.into_inner();
        self.blocking(move |rank| rank.stage(&r)).await.map(|p| Response::new(stream(p)))
    }

    async fn commit(&self, request: Request<pb::CommitRequest>) -> Result<Response<pb::CommitResponse>, Status> {
        let expected = request.into_inner().expected_version;
        match self.blocking(|rank| Ok(rank.fault())).await? {
            pb::Fault::SlowCommit => tokio::time::sleep(Duration::from_secs(1)).await,
            // Hung in the call (the caller's deadline ends it, which cancels the swap), once.
            pb::Fault::HungCommit if !self.hung_once.swap(true, std::sync::atomic::Ordering::SeqCst) => {
                tokio::time::sleep(Duration::from_secs(30)).await
            }
            _ => {}
        }
        // Mid-swap, and the new version is verified in rotation only after the swap.
        let change = self.begin_change().await;
        self.blocking(move |rank| {
            let _change = change;
            rank.commit(&expected)
        })
        .await
        .map(Response::new)
    }

    async fn abort(&self, request: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let pb::AbortRequest { rollback, expected_version } = request.into_inner();
        let change = match rollback {
            true => Some(self.begin_change().await),
            false => None,
        };
        self.blocking(move |rank| {
            let _change = change;
            rank.abort(rollback, &expected_version)
        })
        .await
        .map(Response::new)
    }

    async fn release(&self, _request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.blocking(|rank| {
            rank.release();
            Ok(pb::ReleaseResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn report(&self, request: Request<pb::ReportRequest>) -> Result<Response<pb::RankReport>, Status> {
        let r = request.into_inner();
        self.blocking(move |rank| rank.report(r)).await.map(Response::new)
    }

    async fn probe(&self, request: Request<pb::ProbeRequest>) -> Result<Response<pb::ProbeResult>, Status> {
        let r = request.into_inner();
        self.blocking(move |rank| rank.probe(&r)).await.map(Response::new)
    }

    async fn set_serving(&self, request: Request<pb::SetServingRequest>) -> Result<Response<pb::SetServingResponse>, Status> {
        let pb::SetServingRequest { serving, version } = request.into_inner();
        let _readiness = self.readiness.lock().await;
        let checked = match serving {
            true => self.blocking(move |rank| rank.check_serving(&version)).await,
            false => Ok(()),
        };
        if let Some(h) = &self.health {
            h.set(serving && checked.is_ok()).await;
        }
        checked.map(|()| Response::new(pb::SetServingResponse {}))
    }

    async fn shutdown(&self, _request: Request<pb::ShutdownRequest>) -> Result<Response<pb::ShutdownResponse>, Status> {
        self.shutdown.notify_one();
        Ok(Response::new(pb::ShutdownResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::Fault;
    use crate::rank::state::lock;
    use orchestrator_model::ModelConfig;
    use orchestrator_model::synth::{SynthOptions, write_checkpoint};
    use orchestrator_proto::v1::load_source::Kind;

    /// Runs a load, reload or stage stream to its end.
    async fn drain(stream: Result<Response<ProgressStream>, Status>) {
        use tokio_stream::StreamExt;
        let mut stream = stream.unwrap().into_inner();
        while let Some(p) = stream.next().await {
            p.unwrap();
        }
    }

    /// `f`, which must not wait for a probe held up meanwhile (it panics after 30 s).
    async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(std::time::Duration::from_secs(30), f).await.unwrap_or_else(|_| panic!("{what} waited for the probe"))
    }

    async fn round_trip_ok(svc: &WorkerService, kept_round_trip: bool) -> bool {
        let req = Request::new(pb::ReportRequest { kept_round_trip, ..Default::default() });
        svc.report(req).await.unwrap().into_inner().round_trip_ok
    }

    /// A TP 1 worker on tiny checkpoint `A` (loaded), with `B` and `C` beside it to stage.
    async fn loaded_worker(tmp: &std::path::Path) -> (WorkerService, impl Fn(&str) -> pb::LoadSource) {
        loaded_worker_of(tmp, 1).await
    }

    /// [`loaded_worker`] with `layers` layers.
    async fn loaded_worker_of(tmp: &std::path::Path, layers: usize) -> (WorkerService, impl Fn(&str) -> pb::LoadSource) {
        let config = ModelConfig::from_preset(orchestrator_model::Preset::Tiny, Some(layers), false).unwrap();
        for (name, seed) in [("A", 1), ("B", 2), ("C", 3)] {
            let opts = SynthOptions { config: config.clone(), seed, max_shard_bytes: 1 << 30, preset_name: None };
            write_checkpoint(&tmp.join(name), &opts).unwrap();
        }
        let dir = tmp.to_path_buf();
        let src = move |name: &str| pb::LoadSource { kind: Some(Kind::CheckpointDir(dir.join(name).display().to_string())), content: None };
        let svc = WorkerService::new(Arc::new(Notify::new()), AllowedRoots::new(&[tmp.to_path_buf()]).unwrap());
        let assign = pb::AssignRequest { tp_size: 1, dp_size: 1, source: Some(src("A")), scale_rule: "rceil".into(), ..Default::default() };
        svc.assign(Request::new(assign)).await.unwrap();
        drain(svc.load(Request::new(pb::LoadRequest {})).await).await;
        (svc, src)
    }

    /// `svc` reporting its readiness, and that readiness.
    async fn with_health(svc: WorkerService) -> (WorkerService, orchestrator_net::grpc::Health) {
        type Server = orchestrator_proto::v1::worker_server::WorkerServer<WorkerService>;
        let (_, health) = orchestrator_net::grpc::standard_router::<Server>(None).await.unwrap();
        (svc.with_health(health.clone()), health)
    }

    async fn set_serving(svc: &WorkerService, serving: bool, version: &str) -> Result<(), Status> {
        svc.set_serving(Request::new(pb::SetServingRequest { serving, version: version.into() })).await.map(drop)
    }

    /// A rank refuses to be marked serving while a change of its active weights is under way,
    /// even on the version it still holds (before, a SetServing checked just before a commit's
    /// swap marked the rank SERVING on the weights swapped in), and is marked so once it ended.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serving_is_refused_while_the_active_weights_change() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, health) = with_health(loaded_worker(tmp.path()).await.0).await;
        let version = svc.rank.versions().0;
        set_serving(&svc, true, &version).await.unwrap();
        assert!(health.is_serving());
        let change = svc.rank.begin_change();
        let refused = set_serving(&svc, true, &version).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused}");
        assert!(!health.is_serving(), "a refused SetServing leaves the rank not ready");
        drop(change);
        set_serving(&svc, true, &version).await.unwrap();
        assert!(health.is_serving());
    }

    /// A change of the weights waits for a SetServing under way (it holds the readiness gate
    /// from its check to its SERVING), then marks the rank not ready: no SERVING checked before
    /// a swap lands after it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_commit_waits_for_a_set_serving_under_way_and_leaves_the_rank_not_ready() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let (svc, health) = with_health(svc).await;
        let version_a = svc.rank.versions().0;
        stage(&svc, src("B")).await;
        set_serving(&svc, true, &version_a).await.unwrap();
        // As a SetServing between its check and its SERVING.
        let gate = svc.readiness.clone().lock_owned().await;
        let commit = tokio::spawn({
            let svc = svc.clone();
            async move { svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() })).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(!commit.is_finished(), "the commit did not wait for the SetServing");
        assert_eq!(svc.rank.versions().0, version_a, "swapped while a SetServing was under way");
        assert!(health.is_serving());
        drop(gate);
        let committed = commit.await.unwrap().unwrap().into_inner().checkpoint_version;
        assert_ne!(committed, version_a);
        assert!(!health.is_serving(), "serving the swapped weights before anyone verified them");
        set_serving(&svc, true, &committed).await.unwrap();
        assert!(health.is_serving());
    }

    async fn stage(svc: &WorkerService, source: pb::LoadSource) {
        stage_with(svc, source, false).await
    }

    async fn stage_with(svc: &WorkerService, source: pb::LoadSource, defer_round_trip: bool) {
        drain(svc.stage(Request::new(pb::StageRequest { source: Some(source), reference: None, defer_round_trip })).await).await;
    }

    /// A later replica's stage defers its round trip: its verification report adopts the
    /// verdict of the verified rank whose digests its own equal, says whose it is, and keeps it
    /// for the commit. A proof of other bytes is not adopted: the rank runs its own round trip
    /// (which here catches staged weights damaged in memory).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deferred_round_trip_is_adopted_only_from_a_rank_of_the_same_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let staged_report = async |identical_to: Option<pb::RoundTripProof>| {
            let req = pb::ReportRequest { shadow: true, identical_to, ..Default::default() };
            svc.report(Request::new(req)).await.unwrap().into_inner()
        };
        // The first replica's stage runs its round trip: what it reports is a later one's proof.
        stage(&svc, src("B")).await;
        let first = staged_report(None).await;
        assert!(first.round_trip_ok && first.round_trip_identical_to.is_empty());
        let proof = pb::RoundTripProof {
            kernel_rank_digest: first.kernel_rank_digest.clone(),
            source_rank_digest: first.source_rank_digest.clone(),
            rank: "dp0/tp0".into(),
        };
        // The same bytes: adopted, and kept for the commit.
        stage_with(&svc, src("B"), true).await;
        assert!(lock(&svc.rank.state).shadow.as_ref().unwrap().round_trip.is_none(), "the stage ran no round trip");
        let adopted = staged_report(Some(proof.clone())).await;
        assert!(adopted.round_trip_ok);
        assert_eq!(adopted.round_trip_identical_to, "dp0/tp0");
        svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() })).await.unwrap();
        let req = pb::ReportRequest { kept_round_trip: true, ..Default::default() };
        let committed = svc.report(Request::new(req)).await.unwrap().into_inner();
        assert!(committed.round_trip_ok);
        assert_eq!(committed.round_trip_identical_to, "dp0/tp0");
        // A proof of other bytes (version A's): the rank runs its own round trip, which passes.
        stage_with(&svc, src("A"), true).await;
        let own = staged_report(Some(proof.clone())).await;
        assert!(own.round_trip_ok && own.round_trip_identical_to.is_empty());
        // Staged B damaged in memory (its digests taken again): not the proof's bytes, so the
        // rank's own round trip runs, and fails.
        stage_with(&svc, src("B"), true).await;
        {
            let mut st = lock(&svc.rank.state);
            let w = Arc::get_mut(&mut st.shadow.as_mut().unwrap().weights).unwrap();
            crate::faults::inject_on(&*svc.rank.backend, w, Fault::SkipQPermutation).unwrap();
            w.refresh_kernel_digests(&*svc.rank.backend).unwrap();
        }
        let damaged = staged_report(Some(proof)).await;
        assert!(!damaged.round_trip_ok, "{:?}", damaged.round_trip_failures);
        assert!(damaged.round_trip_identical_to.is_empty());
        assert!(
            lock(&svc.rank.state).shadow.as_ref().unwrap().round_trip.as_ref().is_some_and(|rt| !rt.ok),
            "the stage keeps the verdict it ran"
        );
    }

    /// A report asked for the kept round trip answers with the one the stage ran on the weights
    /// it committed, only while the rank holds that generation; any other report runs it again
    /// (here it catches weights damaged in memory after the commit).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_round_trip_stands_only_for_the_generation_it_was_run_on() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        // Loaded, never committed: nothing kept, the round trip runs.
        assert!(round_trip_ok(&svc, true).await);
        stage(&svc, src("B")).await;
        svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() })).await.unwrap();
        // The committed weights damaged in place (wq_b back in checkpoint order).
        {
            let mut st = lock(&svc.rank.state);
            let w = Arc::get_mut(st.weights.as_mut().unwrap()).unwrap();
            crate::faults::inject_on(&*svc.rank.backend, w, Fault::SkipQPermutation).unwrap();
        }
        assert!(!round_trip_ok(&svc, false).await, "a fresh round trip reads what the rank holds");
        assert!(round_trip_ok(&svc, true).await, "the kept verdict is the stage's");
        // Another generation of weights: the kept verdict no longer answers.
        Arc::get_mut(lock(&svc.rank.state).weights.as_mut().unwrap()).unwrap().generation += 1;
        assert!(!round_trip_ok(&svc, true).await);
    }

    /// A probe within the size limits whose working set on these weights would pass the
    /// memory limit (tiny, 8 layers, T = 4096: about 6.6 GB of f32 values) is refused as a bad
    /// request before anything is computed, as a probe, as a stage's reference, and through
    /// the loader's own probe; the rank probes, stages and serves on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_too_large_for_the_ranks_memory_is_refused_as_a_bad_request() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker_of(tmp.path(), 8).await;
        let big = pb::ProbeRequest { tokens: 4096, latents: 1, ..Default::default() };
        let e = svc.probe(Request::new(big)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("probe working set"), "{}", e.message());
        let request = pb::StageRequest {
            source: Some(src("B")),
            reference: Some(pb::ReferenceProbe { tokens: 4096, latents: 1, seed: 0 }),
            defer_round_trip: false,
        };
        let e = svc.stage(Request::new(request)).await.err().expect("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("stage: reference") && e.message().contains("probe working set"), "{}", e.message());
        assert!(lock(&svc.rank.state).shadow.is_none(), "nothing was staged");
        let (plan, weights, source) = crate::rank::state::snapshot(&lock(&svc.rank.state), false).unwrap();
        let loader = crate::loader::RankLoader::new(&*svc.rank.backend, source.config(), plan.tp_size, plan.tp_rank, plan.rule).unwrap();
        let spec = crate::probe::ProbeSpec { tokens: 4096, latents: 1, seed: 0 };
        let Err(e) = crate::probe::probe_rank(&loader, &weights, &source, spec, plan.rule) else { panic!("the loader's probe ran") };
        assert!(matches!(e, crate::loader::LoadError::ProbeSize { spec: s, .. } if s == spec), "{e}");
        // The rank probes (a serving-sized probe, checked against the reference) and stages on.
        let fits = pb::ProbeRequest { tokens: 2, latents: 16, ..Default::default() };
        assert!(svc.probe(Request::new(fits)).await.unwrap().into_inner().ok);
        stage(&svc, src("B")).await;
        assert!(lock(&svc.rank.state).shadow.is_some());
    }

    /// A probe asking for a ring deadline over the limit is refused before anything is
    /// computed or joined; the bounded one probes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_with_an_unbounded_ring_deadline_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, _) = loaded_worker(tmp.path()).await;
        let at = |timeout_ms| pb::ProbeRequest { tokens: 2, latents: 16, timeout_ms, ..Default::default() };
        let e = svc.probe(Request::new(at(u32::MAX))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), "probe: timeout_ms 4294967295 is over the limit of 120000");
        assert!(svc.probe(Request::new(at(120_000))).await.unwrap().into_inner().ok);
    }

    /// A TP 2 rank refuses a probe that would reduce over a ring of other than two peers
    /// (before: any number, each resolved while the rank's state was held); a first half, which
    /// joins no ring, is not checked for peers (here it is refused for what it is: nothing is
    /// staged to compute on).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_names_one_peer_per_rank_of_its_group() {
        let tmp = tempfile::tempdir().unwrap();
        let config = ModelConfig::from_preset(orchestrator_model::Preset::Tiny, Some(1), false).unwrap();
        let opts = SynthOptions { config, seed: 1, max_shard_bytes: 1 << 30, preset_name: None };
        write_checkpoint(&tmp.path().join("A"), &opts).unwrap();
        let svc = WorkerService::new(Arc::new(Notify::new()), AllowedRoots::new(&[tmp.path().to_path_buf()]).unwrap());
        let source = pb::LoadSource { kind: Some(Kind::CheckpointDir(tmp.path().join("A").display().to_string())), content: None };
        let assign = pb::AssignRequest { tp_size: 2, dp_size: 1, source: Some(source), scale_rule: "rceil".into(), ..Default::default() };
        svc.assign(Request::new(assign)).await.unwrap();
        drain(svc.load(Request::new(pb::LoadRequest {})).await).await;
        for peers in [vec![], vec!["127.0.0.1:1".to_string()], vec!["127.0.0.1:1".to_string(); 100_000]] {
            let got = peers.len();
            let req = pb::ProbeRequest { tokens: 2, latents: 16, peers, ..Default::default() };
            let e = svc.probe(Request::new(req)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert_eq!(e.message(), format!("probe: {got} peer addresses for a TP group of 2"));
        }
        let compute =
            pb::ProbeRequest { tokens: 2, latents: 16, shadow: true, phase: pb::ProbePhase::Compute.into(), ..Default::default() };
        let e = svc.probe(Request::new(compute)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "nothing staged to compute on, and no peers asked for: {e:?}");
    }

    /// Every name or path a request gives is bounded: a value of megabytes is refused with the
    /// field named in a short message (before: echoed back whole, past what a gRPC status
    /// carries), as is a DP rank outside its DP size, and nothing changes on the rank.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_oversized_name_or_path_gets_a_short_refusal_naming_its_field() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let before = svc.rank.versions();
        let huge = "x".repeat(2 << 20);
        let dir = |d: &str| pb::LoadSource { kind: Some(Kind::CheckpointDir(d.into())), content: None };
        let dummy =
            pb::LoadSource { kind: Some(Kind::Dummy(pb::DummySource { preset: huge.clone(), ..Default::default() })), content: None };
        let assign = |source, scale_rule: &str, dump_dir: &str| pb::AssignRequest {
            tp_size: 1,
            dp_size: 1,
            source: Some(source),
            scale_rule: scale_rule.into(),
            dump_dir: dump_dir.into(),
            ..Default::default()
        };
        let stage = |source| pb::StageRequest { source: Some(source), reference: None, defer_round_trip: false };
        let cases: Vec<(Result<(), Status>, &str)> = vec![
            (svc.assign(Request::new(assign(dir(&huge), "rceil", ""))).await.map(drop), "source.checkpoint_dir"),
            (svc.assign(Request::new(assign(src("A"), &huge, ""))).await.map(drop), "scale_rule"),
            (svc.assign(Request::new(assign(src("A"), "rceil", &huge))).await.map(drop), "dump_dir"),
            (svc.stage(Request::new(stage(dummy))).await.map(drop), "source.dummy.preset"),
            (svc.commit(Request::new(pb::CommitRequest { expected_version: huge.clone() })).await.map(drop), "expected_version"),
            (
                svc.abort(Request::new(pb::AbortRequest { rollback: true, expected_version: huge.clone() })).await.map(drop),
                "expected_version",
            ),
            (svc.set_serving(Request::new(pb::SetServingRequest { serving: true, version: huge.clone() })).await.map(drop), "version"),
            (
                svc.probe(Request::new(pb::ProbeRequest { tokens: 2, latents: 16, peers: vec![huge.clone()], ..Default::default() }))
                    .await
                    .map(drop),
                "peers",
            ),
        ];
        for (dp_rank, dp_size) in [(0, 0), (1, 1), (0, u32::MAX)] {
            let r = pb::AssignRequest { dp_rank, dp_size, ..assign(src("A"), "rceil", "") };
            let e = svc.assign(Request::new(r)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with(&format!("assign: dp_rank {dp_rank} of dp_size {dp_size}")), "{}", e.message());
        }
        for (result, field) in cases {
            let e = result.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{field}: {e:?}");
            assert!(e.message().starts_with(&format!("{field}: {} bytes, over the limit of", huge.len())), "{}", e.message());
        }
        assert_eq!(svc.rank.versions(), before, "the rank holds what it held");
    }

    /// `tmp/dumps/run` and `tmp/elsewhere`, made, and a worker reading checkpoints under `tmp`
    /// whose dump root is `tmp/dumps`.
    fn with_dump_root(tmp: &std::path::Path) -> (WorkerService, std::path::PathBuf, std::path::PathBuf) {
        let (dumps, elsewhere) = (tmp.join("dumps"), tmp.join("elsewhere"));
        std::fs::create_dir_all(dumps.join("run")).unwrap();
        std::fs::create_dir(&elsewhere).unwrap();
        let rank =
            Rank::new(AllowedRoots::new(&[tmp.to_path_buf()]).unwrap(), AnyBackend::Cpu(orchestrator_kernels::CpuBackend), "h".into())
                .with_dump_root(Some(crate::dump::DumpRoot::open(&dumps).unwrap()));
        (WorkerService::serving(Arc::new(Notify::new()), rank), dumps, elsewhere)
    }

    /// An assignment's dump directory must resolve, symlinks and all, under the worker's
    /// `--dump-root` (the worker writes `DIR/dp{D}` there); a worker without one writes no
    /// dumps. Refusals are PERMISSION_DENIED and name the directory.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dumps_go_under_the_dump_root_only() {
        let tmp = tempfile::tempdir().unwrap();
        let (without, src) = loaded_worker(tmp.path()).await;
        let (svc, dumps, elsewhere) = with_dump_root(tmp.path());
        std::os::unix::fs::symlink(&elsewhere, dumps.join("link")).unwrap();
        let assign = |dir: &std::path::Path| {
            Request::new(pb::AssignRequest {
                tp_size: 1,
                dp_size: 2,
                dp_rank: 1,
                source: Some(src("A")),
                scale_rule: "rceil".into(),
                dump_dir: dir.display().to_string(),
                ..Default::default()
            })
        };
        let refused = |e: Status, why: &str| {
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
            assert!(e.message().starts_with("assign: dump_dir `") && e.message().contains(why), "{}", e.message());
        };
        refused(without.assign(assign(&dumps.join("run"))).await.unwrap_err(), "started without --dump-root");
        refused(svc.assign(assign(&elsewhere)).await.unwrap_err(), "outside --dump-root");
        refused(svc.assign(assign(&dumps.join("link"))).await.unwrap_err(), "outside --dump-root");
        refused(svc.assign(assign(&dumps.join("run/../../elsewhere"))).await.unwrap_err(), "outside --dump-root");
        refused(svc.assign(assign(&dumps.join("missing"))).await.unwrap_err(), "No such file");
        svc.assign(assign(&dumps.join("run"))).await.unwrap();
        let planned = lock(&svc.rank.state).plan.as_ref().unwrap().dump_dir.as_ref().map(|d| d.path());
        assert_eq!(planned, Some(dumps.canonicalize().unwrap().join("run/dp1")));
    }

    /// Each dump is written beneath the held root, its directory resolved again there at the
    /// write: a directory replaced after the assignment's check by a symlink out of the root
    /// fails the load, naming the file, and nothing is written outside; a symlink that stays
    /// beneath the root is followed; a symlink planted where the file goes is replaced, not
    /// followed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dumps_stay_beneath_the_root_whatever_is_planted_after_the_check() {
        use tokio_stream::StreamExt;
        let tmp = tempfile::tempdir().unwrap();
        let (_, src) = loaded_worker(tmp.path()).await;
        let (svc, dumps, elsewhere) = with_dump_root(tmp.path());
        let assign = pb::AssignRequest {
            tp_size: 1,
            dp_size: 1,
            source: Some(src("A")),
            scale_rule: "rceil".into(),
            dump_dir: dumps.join("run").display().to_string(),
            ..Default::default()
        };
        svc.assign(Request::new(assign)).await.unwrap();
        let load = || async {
            let mut stream = svc.load(Request::new(pb::LoadRequest {})).await?.into_inner();
            while let Some(p) = stream.next().await {
                p?;
            }
            Ok::<(), Status>(())
        };
        // `run` moved away and a symlink out of the root put in its place.
        std::fs::rename(dumps.join("run"), dumps.join("kept")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dumps.join("run")).unwrap();
        let e = load().await.unwrap_err();
        let held = svc.rank.versions().0;
        assert!(!held.is_empty(), "a failed dump keeps the weights it was to dump");
        let file = dumps.canonicalize().unwrap().join("run/dp0/rank0.safetensors");
        let root = dumps.canonicalize().unwrap();
        let why = format!("writing {}: opening run/dp0 beneath the dump root {}: ", file.display(), root.display());
        assert!(e.message().contains(&why), "{}", e.message());
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "nothing written outside the root");
        // A symlink that stays beneath the root is followed.
        std::fs::remove_file(dumps.join("run")).unwrap();
        std::os::unix::fs::symlink("kept", dumps.join("run")).unwrap();
        load().await.unwrap();
        assert_eq!(svc.rank.versions().0, held, "the same version loaded again");
        let dumped = dumps.join("kept/dp0/rank0.safetensors");
        safetensors::SafeTensors::deserialize(&std::fs::read(&dumped).unwrap()).unwrap();
        // A symlink planted where the file goes is replaced by the file.
        let victim = elsewhere.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::fs::remove_file(&dumped).unwrap();
        std::os::unix::fs::symlink(&victim, &dumped).unwrap();
        load().await.unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert!(std::fs::symlink_metadata(&dumped).unwrap().is_file());
    }

    /// A stage the rank refuses (another geometry) changes nothing: the version the last commit
    /// replaced is still kept, and a journaled rollback to it still goes through (before, the
    /// refused stage had already dropped it, and the rollback failed with nothing kept).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_stage_keeps_the_version_a_rollback_needs() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let a = svc.rank.versions().0;
        stage(&svc, src("B")).await;
        svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() })).await.unwrap();
        let config = ModelConfig::from_preset(orchestrator_model::Preset::Tiny, Some(2), false).unwrap();
        write_checkpoint(&tmp.path().join("D"), &SynthOptions { config, seed: 4, max_shard_bytes: 1 << 30, preset_name: None }).unwrap();
        let refused = svc.stage(Request::new(pb::StageRequest { source: Some(src("D")), reference: None, defer_round_trip: false })).await;
        assert_eq!(refused.err().map(|e| e.code()), Some(tonic::Code::FailedPrecondition));
        let back = svc.abort(Request::new(pb::AbortRequest { rollback: true, expected_version: a.clone() })).await.unwrap();
        assert_eq!(back.into_inner().checkpoint_version, a);
    }

    /// A load that a later load, or an assignment, overtakes while it runs never lands: it
    /// answers ABORTED and the rank holds what came after it (before, the last load to finish
    /// installed its weights, and its source, under whatever plan was current then). Each
    /// load here is 3 layers of dsv41-flash at TP 2, and the later call comes after the first
    /// layer's progress, so the first load is still running.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_load_overtaken_by_a_later_load_or_an_assignment_never_lands() {
        use tokio_stream::StreamExt;
        let svc = WorkerService::new(Arc::new(Notify::new()), AllowedRoots::default());
        let dummy = |seed| pb::LoadSource {
            kind: Some(Kind::Dummy(pb::DummySource { preset: "dsv41-flash".into(), layers: 3, seed, bf16: false })),
            content: None,
        };
        let assign = |seed| pb::AssignRequest {
            tp_size: 2,
            dp_size: 1,
            source: Some(dummy(seed)),
            scale_rule: "rceil".into(),
            ..Default::default()
        };
        // The rest of a load, once its first layer is done.
        async fn after_first_layer(svc: &WorkerService) -> ProgressStream {
            let mut stream = svc.load(Request::new(pb::LoadRequest {})).await.unwrap().into_inner();
            let first = stream.next().await.unwrap().unwrap();
            assert!(!first.finished && first.layers_done >= 1, "{first:?}");
            stream
        }
        async fn outcome(mut stream: ProgressStream) -> Result<String, Status> {
            let mut version = String::new();
            while let Some(p) = stream.next().await {
                version = p?.version;
            }
            Ok(version)
        }
        svc.assign(Request::new(assign(1))).await.unwrap();
        let first = after_first_layer(&svc).await;
        let second = svc.load(Request::new(pb::LoadRequest {})).await.unwrap().into_inner();
        let (first, second) = (outcome(first).await, outcome(second).await.unwrap());
        assert_eq!(first.unwrap_err().code(), tonic::Code::Aborted, "the overtaken load");
        assert_eq!(svc.rank.versions().0, second, "the later load's weights");
        // A load of assignment 1 overtaken by assignment 2: the rank holds nothing (assignment 2
        // loaded nothing yet), and its plan is assignment 2's.
        let stale = after_first_layer(&svc).await;
        svc.assign(Request::new(assign(2))).await.unwrap();
        assert_eq!(outcome(stale).await.unwrap_err().code(), tonic::Code::Aborted);
        assert_eq!(svc.rank.versions().0, "", "nothing loaded under assignment 2");
        let planned = lock(&svc.rank.state).plan.as_ref().map(|p| p.source.version());
        let loaded = outcome(svc.load(Request::new(pb::LoadRequest {})).await.unwrap().into_inner()).await.unwrap();
        assert_eq!(planned.as_deref(), Some(loaded.as_str()), "assignment 2's source is the plan's");
        assert_ne!(loaded, second, "assignment 2 is another version");
    }

    /// A stage takes its epoch as its request arrives: an abort that comes while its source is
    /// still being opened (hashed) supersedes it, and it never lands (before, it took its epoch
    /// only once the source was open, and landed over whatever came after it). Without the
    /// abort, the same stage lands.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abort_while_a_stage_opens_its_source_supersedes_it() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let open = || crate::source::LoadSource::from_pb(Some(&src("B")), &svc.rank.roots).unwrap();
        let options = |epoch| crate::rank::state::StageOptions { epoch: Some(epoch), ..Default::default() };
        let epoch = svc.rank.begin_stage();
        svc.rank.abort(false, "").unwrap();
        assert!(matches!(svc.rank.stage_opened(open(), options(epoch)), Err(RankError::Superseded)));
        assert!(lock(&svc.rank.state).shadow.is_none(), "nothing staged");
        // A later stage's epoch supersedes an earlier one's the same way.
        let (first, second) = (svc.rank.begin_stage(), svc.rank.begin_stage());
        assert!(matches!(svc.rank.stage_opened(open(), options(first)), Err(RankError::Superseded)));
        drain(svc.rank.stage_opened(open(), options(second)).map(|p| Response::new(stream(p))).map_err(Status::from)).await;
        assert!(lock(&svc.rank.state).shadow.is_some(), "the latest stage lands");
    }

    async fn probe(svc: &WorkerService, phase: pb::ProbePhase, shadow: bool, seed: u64) -> Result<pb::ProbeResult, Status> {
        let req = pb::ProbeRequest { tokens: 2, latents: 16, seed, shadow, phase: phase.into(), ..Default::default() };
        svc.probe(Request::new(req)).await.map(Response::into_inner)
    }

    /// A staged version's probe in halves gives what the whole probe gives; its second half
    /// reduces only what the first computed on the weights staged now, for the same probe; and
    /// staged weights a first half still computes on are not swapped in.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_in_halves_reduces_only_what_its_first_half_computed_on_the_staged_weights() {
        use pb::ProbePhase::{Compute, Reduce, Whole};
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        assert_eq!(probe(&svc, Compute, false, 0).await.unwrap_err().code(), tonic::Code::InvalidArgument, "the active weights");
        stage(&svc, src("B")).await;
        let whole = probe(&svc, Whole, true, 0).await.unwrap();
        assert!(!whole.y_digest.is_empty() && whole.ok);
        assert_eq!(probe(&svc, Reduce, true, 0).await.unwrap_err().code(), tonic::Code::FailedPrecondition, "nothing computed");
        let first = probe(&svc, Compute, true, 0).await.unwrap();
        assert!(first.y_digest.is_empty() && first.ok);
        assert_eq!((&first.y_partial_digest, &first.probed_version), (&whole.y_partial_digest, &whole.probed_version));
        let reduced = probe(&svc, Reduce, true, 0).await.unwrap();
        assert_eq!((reduced.y_digest.as_str(), reduced.ok), (whole.y_digest.as_str(), true));
        // Reduced once: the kept half is gone.
        assert_eq!(probe(&svc, Reduce, true, 0).await.unwrap_err().code(), tonic::Code::FailedPrecondition);
        // Another probe, or another stage since the first half: refused.
        probe(&svc, Compute, true, 0).await.unwrap();
        assert_eq!(probe(&svc, Reduce, true, 1).await.unwrap_err().code(), tonic::Code::FailedPrecondition, "another seed");
        probe(&svc, Compute, true, 0).await.unwrap();
        stage(&svc, src("C")).await;
        assert_eq!(probe(&svc, Reduce, true, 0).await.unwrap_err().code(), tonic::Code::FailedPrecondition, "restaged");
        // Staged weights still shared with a computation are not swapped in until it lets go.
        let computing = lock(&svc.rank.state).shadow.as_ref().unwrap().weights.clone();
        let commit = || svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() }));
        assert_eq!(commit().await.unwrap_err().code(), tonic::Code::Unavailable);
        assert!(lock(&svc.rank.state).shadow.is_some(), "still staged");
        drop(computing);
        commit().await.unwrap();
        assert!(lock(&svc.rank.state).shadow.is_none());
    }

    /// The probe right after a commit is answered from the verification probe the rank kept of
    /// the very weights it committed (its answer, on their new generation), for that probe with
    /// the same reference check, while the rank holds that generation; anything else is refused
    /// without computing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_probe_after_a_commit_answers_from_the_verification_probe_kept_of_those_weights() {
        use pb::ProbePhase::{Compute, Reduce, Whole};
        use tonic::Code::{FailedPrecondition, InvalidArgument};
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let kept = |seed: u64, skip_reference: bool, shadow: bool| {
            let req = pb::ProbeRequest { tokens: 2, latents: 16, seed, kept: true, skip_reference, shadow, ..Default::default() };
            svc.probe(Request::new(req))
        };
        let commit = || svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() }));
        let refused = |r: Result<Response<pb::ProbeResult>, Status>| r.unwrap_err().code();
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "loaded, nothing verified");
        stage(&svc, src("B")).await;
        assert_eq!(refused(kept(0, false, true).await), InvalidArgument, "of the staged weights");
        probe(&svc, Compute, true, 0).await.unwrap();
        let verified = probe(&svc, Reduce, true, 0).await.unwrap();
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "verified, not committed");
        commit().await.unwrap();
        let generation = lock(&svc.rank.state).weights.as_ref().unwrap().generation;
        let answer = kept(0, false, false).await.unwrap().into_inner();
        assert!(answer.kept && answer.ok);
        assert_eq!(answer.generation, generation);
        assert_ne!(answer.generation, verified.generation, "the committed weights' generation");
        assert_eq!(answer.checkpoint_version, verified.probed_version);
        assert_eq!(
            (&answer.y_digest, &answer.y_partial_digest, &answer.probed_version, answer.q_mismatches, answer.z_max_abs_err),
            (&verified.y_digest, &verified.y_partial_digest, &verified.probed_version, verified.q_mismatches, verified.z_max_abs_err)
        );
        // Computing the same probe on the committed weights gives the same answer.
        let computed = probe(&svc, Whole, false, 0).await.unwrap();
        assert!(!computed.kept);
        assert_eq!((&computed.y_digest, computed.generation), (&answer.y_digest, generation));
        // Another probe, or the kernel pass alone where the reference was checked: refused.
        assert_eq!(refused(kept(1, false, false).await), FailedPrecondition, "another seed");
        assert_eq!(refused(kept(0, true, false).await), FailedPrecondition, "without the reference");
        // Weights of another generation: refused.
        Arc::get_mut(lock(&svc.rank.state).weights.as_mut().unwrap()).unwrap().generation += 1;
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "another generation");
        // Verified, then restaged before the commit: the committed weights were never probed.
        stage(&svc, src("C")).await;
        probe(&svc, Whole, true, 0).await.unwrap();
        stage(&svc, src("B")).await;
        commit().await.unwrap();
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "restaged after the probe");
        // A whole probe of the staged weights is kept as the halves are; an abort drops it.
        stage(&svc, src("C")).await;
        let whole = probe(&svc, Whole, true, 0).await.unwrap();
        commit().await.unwrap();
        assert_eq!(kept(0, false, false).await.unwrap().into_inner().y_digest, whole.y_digest);
        stage(&svc, src("B")).await;
        probe(&svc, Whole, true, 0).await.unwrap();
        svc.abort(Request::new(pb::AbortRequest { rollback: false, expected_version: String::new() })).await.unwrap();
        stage(&svc, src("B")).await;
        commit().await.unwrap();
        assert_eq!(refused(kept(0, false, false).await), FailedPrecondition, "aborted after the probe");
    }

    /// A probe computes on the active weights without the state lock: while one is held up in
    /// its computation (here at the reference cache, which a thread of the test holds), a full report with
    /// its round trip, a release and a reload of the rank all answer; the probe then answers
    /// nothing for weights the rank no longer holds, and the next probe reads the new ones.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_computes_without_the_state_lock_and_answers_only_for_the_weights_it_read() {
        use std::time::Duration;
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        // The cache is held by a thread of its own until `release` is dropped (also on a panic).
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (locked, is_locked) = std::sync::mpsc::channel();
        let cache = svc.rank.reference_cache.clone();
        let holder = std::thread::spawn(move || {
            let _held = cache.lock().unwrap();
            locked.send(()).unwrap();
            let _ = released.recv();
        });
        is_locked.recv().unwrap();
        let probing = tokio::spawn({
            let svc = svc.clone();
            async move { probe(&svc, pb::ProbePhase::Whole, false, 0).await }
        });
        // The probe took the weights (a second reference to them), then waits for the cache,
        // leaving the state lock free (tried, never waited for: a probe that kept it would
        // hold it until the test lets the cache go).
        let active = || lock(&svc.rank.state).weights.clone().unwrap();
        let mut waited = 0;
        while !svc.rank.state.try_lock().is_ok_and(|st| st.weights.as_ref().is_some_and(|w| Arc::strong_count(w) == 2)) {
            assert!(waited < 10_000, "the probe never took the weights, or kept the state lock");
            tokio::time::sleep(Duration::from_millis(1)).await;
            waited += 1;
        }
        let before = active().generation;
        assert!(within("a report", round_trip_ok(&svc, false)).await);
        within("a release", svc.release(Request::new(pb::ReleaseRequest {}))).await.unwrap();
        let reload = svc.reload(Request::new(pb::ReloadRequest { source: Some(src("B")) }));
        within("a reload", async { drain(reload.await).await }).await;
        assert_eq!(active().generation, before + 1, "reloaded (into fresh buffers: the probe still reads the old ones)");
        drop(release);
        holder.join().unwrap();
        assert_eq!(probing.await.unwrap().unwrap_err().code(), tonic::Code::Aborted, "the weights it read were replaced");
        let fresh = probe(&svc, pb::ProbePhase::Whole, false, 0).await.unwrap();
        assert!(fresh.ok && fresh.generation == before + 1);
    }

    /// A probe waiting on its ring (the group's other rank has not joined yet) holds the rank's
    /// collectives, not its state: a report with its round trip, a stage, an abort and a release
    /// of the rank all answer meanwhile (before, each waited for the ring, up to the probe's
    /// deadline). Once the other rank joins, both answer the same reduced `y`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rank_waiting_on_its_ring_answers_everything_else() {
        let tmp = tempfile::tempdir().unwrap();
        let config = ModelConfig::from_preset(orchestrator_model::Preset::Tiny, Some(1), false).unwrap();
        for (name, seed) in [("A", 1), ("B", 2)] {
            let opts = SynthOptions { config: config.clone(), seed, max_shard_bytes: 1 << 30, preset_name: None };
            write_checkpoint(&tmp.path().join(name), &opts).unwrap();
        }
        let src =
            |name: &str| pb::LoadSource { kind: Some(Kind::CheckpointDir(tmp.path().join(name).display().to_string())), content: None };
        let mut ranks = Vec::new();
        for tp_rank in 0..2 {
            let svc = WorkerService::new(Arc::new(Notify::new()), AllowedRoots::new(&[tmp.path().to_path_buf()]).unwrap());
            let assign = pb::AssignRequest {
                tp_size: 2,
                tp_rank,
                dp_size: 1,
                source: Some(src("A")),
                scale_rule: "rceil".into(),
                ..Default::default()
            };
            let address = svc.assign(Request::new(assign)).await.unwrap().into_inner().collective_address;
            drain(svc.load(Request::new(pb::LoadRequest {})).await).await;
            ranks.push((svc, address));
        }
        let peers = ranks.iter().map(|(_, a)| a.clone()).collect();
        let req = pb::ProbeRequest { tokens: 2, latents: 16, peers, group: 7, ring_epoch: 1, timeout_ms: 60_000, ..Default::default() };
        let (rank0, rank1) = (ranks[0].0.clone(), ranks[1].0.clone());
        let first = tokio::spawn({
            let (rank0, req) = (rank0.clone(), req.clone());
            async move { rank0.probe(Request::new(req)).await }
        });
        let mut waited = 0;
        while rank0.rank.collectives.try_lock().is_ok() {
            assert!(waited < 10_000, "the probe never went to join its ring");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            waited += 1;
        }
        assert!(within("a report", round_trip_ok(&rank0, false)).await);
        let stage = rank0.stage(Request::new(pb::StageRequest { source: Some(src("B")), reference: None, defer_round_trip: false }));
        within("a stage", async { drain(stage.await).await }).await;
        within("an abort", rank0.abort(Request::new(pb::AbortRequest { rollback: false, expected_version: String::new() }))).await.unwrap();
        within("a release", rank0.release(Request::new(pb::ReleaseRequest {}))).await.unwrap();
        assert!(!first.is_finished(), "the probe still waits for its ring");
        let second = rank1.probe(Request::new(req)).await.unwrap().into_inner();
        let first = first.await.unwrap().unwrap().into_inner();
        assert!(first.ok && second.ok, "{first:?}\n{second:?}");
        assert!(!first.y_digest.is_empty());
        assert_eq!(first.y_digest, second.y_digest);
    }

    /// A rollback swaps the kept version back only when nothing reads it any more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rollback_waits_for_readers_of_the_kept_version() {
        let tmp = tempfile::tempdir().unwrap();
        let (svc, src) = loaded_worker(tmp.path()).await;
        let a = lock(&svc.rank.state).plan.as_ref().unwrap().source.version();
        stage(&svc, src("B")).await;
        svc.commit(Request::new(pb::CommitRequest { expected_version: String::new() })).await.unwrap();
        let reading = lock(&svc.rank.state).previous.as_ref().unwrap().0.clone();
        let rollback = || svc.abort(Request::new(pb::AbortRequest { rollback: true, expected_version: a.clone() }));
        assert_eq!(rollback().await.unwrap_err().code(), tonic::Code::Unavailable);
        assert!(lock(&svc.rank.state).previous.is_some(), "still kept");
        drop(reading);
        assert_eq!(rollback().await.unwrap().into_inner().checkpoint_version, a);
    }
}
