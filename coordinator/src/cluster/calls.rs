//! Each operation on the ranks as a fan-out ([`Cluster::fan_out`]): its request, deadline and
//! the typed answer of every rank.

use super::*;

impl Cluster {
    /// Assigns `(dp, tp)` shards; records each rank's collective address.
    pub async fn assign(
        &mut self,
        source: &pb::LoadSource,
        scale_rule: &str,
        fault: Option<(u32, pb::Fault)>,
        dump_dir: Option<&std::path::Path>,
        keep_staging_buffers: bool,
    ) -> Result<(), Failures> {
        let dump_dir = dump_dir.map(|d| d.display().to_string()).unwrap_or_default();
        let (tp, dp) = (self.tp, self.dp);
        let results = self
            .fan_out(|w, mut client| {
                let req = orchestrator_net::auth::request(
                    pb::AssignRequest {
                        tp_size: tp,
                        tp_rank: w.tp,
                        dp_size: dp,
                        dp_rank: w.dp,
                        source: Some(source.clone()),
                        scale_rule: scale_rule.to_string(),
                        fault: fault.filter(|(rank, _)| *rank == w.id).map(|(_, f)| f as i32).unwrap_or(0),
                        dump_dir: dump_dir.clone(),
                        keep_staging_buffers,
                    },
                    ASSIGN_DEADLINE,
                    Some(&self.token),
                );
                let label = w.label();
                async move { client.assign(req).await.map(|r| r.into_inner()).map_err(|s| RankError::call(label, "assign", &s)) }
            })
            .await;
        let mut failures = Vec::new();
        for w in &mut self.workers {
            match results.get(&w.id) {
                Some(Ok(assigned)) => {
                    w.collective = assigned.collective_address.clone();
                    w.nccl_unique_id = assigned.nccl_unique_id.clone();
                }
                Some(Err(e)) => failures.push((w.id, e.clone())),
                None => failures.push((w.id, RankError::Incomplete { rank: w.label(), what: "assign did not complete" })),
            }
        }
        if failures.is_empty() { Ok(()) } else { Err(failures) }
    }

    /// Loads every rank in parallel, showing progress on stderr (a bar per rank on a terminal,
    /// a line per finished rank otherwise, an event per finished rank with `--log-format
    /// json`); load seconds by worker.
    pub async fn load(&self) -> RankResults<f64> {
        use orchestrator_ops::logging::{LogFormat, current};
        let json = current() == LogFormat::Json;
        let bars = (!json && std::io::stderr().is_terminal()).then(|| {
            let multi = indicatif::MultiProgress::new();
            let style = indicatif::ProgressStyle::with_template("{prefix:>9} [{bar:30}] {pos}/{len} layers {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> ");
            let bars: BTreeMap<u32, indicatif::ProgressBar> = self
                .workers
                .iter()
                .map(|w| {
                    let bar =
                        multi.add(indicatif::ProgressBar::new(0).with_style(style.clone()).with_prefix(format!("dp{}/tp{}", w.dp, w.tp)));
                    (w.id, bar)
                })
                .collect();
            (multi, bars)
        });
        let ranks: BTreeMap<u32, (u32, u32)> = self.workers.iter().map(|w| (w.id, (w.dp, w.tp))).collect();
        let show = move |id: u32, done: u32, total: u32, finished: Option<f64>| {
            let (dp, tp) = ranks[&id];
            match (&bars, finished) {
                (Some((_, bars)), _) => {
                    let bar = &bars[&id];
                    bar.set_length(total as u64);
                    bar.set_position(done as u64);
                    if let Some(s) = finished {
                        bar.finish_with_message(format!("{s:.2} s"));
                    }
                }
                (None, Some(s)) if json => tracing::info!(replica = dp, tp_rank = tp, layers = done, seconds = s, "rank loaded"),
                (None, Some(s)) => eprintln!("loaded rank dp{dp}/tp{tp} ({done} layers) in {s:.2} s"),
                (None, None) => {}
            }
        };
        let show = Arc::new(show);
        self.fan_out(|w, mut client| {
            let label = w.label();
            let id = w.id;
            let show = show.clone();
            let token = self.token.clone();
            async move {
                let req = orchestrator_net::auth::request(pb::LoadRequest {}, LOAD_DEADLINE, Some(&token));
                let mut stream = client.load(req).await.map_err(|s| RankError::call(label.clone(), "load", &s))?.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(p)) => {
                            show(id, p.layers_done, p.layers_total, p.finished.then_some(p.load_seconds));
                            if p.finished {
                                return Ok(p.load_seconds);
                            }
                        }
                        Ok(None) => return Err(RankError::Incomplete { rank: label, what: "load stream ended before the load finished" }),
                        Err(s) => return Err(RankError::call(label, "load", &s)),
                    }
                }
            }
        })
        .await
    }

    /// Runs the probe on the ranks of one replica (or all), on their active or staged weights.
    /// Each TP group all-reduces over its ring of the group's current epoch while holding its
    /// group lock (groups are probed concurrently, each under its own lock, so a probe of one
    /// replica never waits for another's); a group any of whose ranks failed gets a new ring
    /// epoch for its next probe.
    pub async fn probe_in(
        &self,
        group: Option<u32>,
        probe: (u32, u32, u64),
        shadow: bool,
        skip_reference: bool,
    ) -> RankResults<pb::ProbeResult> {
        self.probe_phase(group, probe, shadow, skip_reference, pb::ProbePhase::Whole, false).await
    }

    /// The probe of replica `dp` right after its commit, answered by each rank from the
    /// verification probe it kept of the staged weights it committed (see `kept` in the proto):
    /// nothing computed, no ring, no group lock. A rank that kept none refuses, at once.
    pub async fn probe_kept(&self, dp: u32, probe: (u32, u32, u64), skip_reference: bool) -> RankResults<pb::ProbeResult> {
        self.probe_phase(Some(dp), probe, false, skip_reference, pb::ProbePhase::Whole, true).await
    }

    /// The verification probe of what replica `dp` staged, in its two halves: every rank runs
    /// its passes below serving without the ring (and without the group lock), then the group
    /// all-reduces what they computed under its lock, held for that alone. The replica keeps
    /// serving meanwhile, and its routed probes never wait for a verification that computes
    /// below their priority.
    pub async fn probe_staged(&self, dp: u32, probe: (u32, u32, u64), skip_reference: bool) -> RankResults<pb::ProbeResult> {
        let computed = self.probe_phase(Some(dp), probe, true, skip_reference, pb::ProbePhase::Compute, false).await;
        if computed.values().any(Result::is_err) {
            return computed;
        }
        self.probe_phase(Some(dp), probe, true, skip_reference, pb::ProbePhase::Reduce, false).await
    }

    /// One phase of a probe on each group: a whole probe or a reduce holds the group lock and
    /// uses the ring of its epoch; a compute, or a kept probe, needs neither (the ring fields go
    /// unused).
    async fn probe_phase(
        &self,
        group: Option<u32>,
        (tokens, latents, seed): (u32, u32, u64),
        shadow: bool,
        skip_reference: bool,
        phase: pb::ProbePhase,
        kept: bool,
    ) -> RankResults<pb::ProbeResult> {
        let groups: Vec<u32> = (0..self.dp).filter(|dp| group.is_none_or(|g| g == *dp)).collect();
        let ring = phase != pb::ProbePhase::Compute && !kept;
        let per_group = groups.into_iter().map(|dp| async move {
            let _guard = if ring { Some(self.group_locks[dp as usize].lock().await) } else { None };
            let peers: Vec<String> = self.workers.iter().filter(|w| w.dp == dp).map(|w| w.collective.clone()).collect();
            // GPU groups: the NCCL unique id their rank 0 created, relayed to every rank.
            let nccl = self.workers.iter().find(|w| w.dp == dp && w.tp == 0).map(|w| w.nccl_unique_id.clone()).unwrap_or_default();
            let epoch = self.ring_epochs[dp as usize].load(Ordering::SeqCst);
            let results = self
                .fan_out_in(Some(dp), |w, mut client| {
                    let req = orchestrator_net::auth::request(
                        pb::ProbeRequest {
                            tokens,
                            latents,
                            seed,
                            group: u64::from(w.dp),
                            peers: peers.clone(),
                            timeout_ms: limits::RING_TIMEOUT.as_millis() as u32,
                            shadow,
                            skip_reference,
                            nccl_unique_id: nccl.clone(),
                            ring_epoch: epoch,
                            phase: phase.into(),
                            kept,
                        },
                        PROBE_DEADLINE,
                        Some(&self.token),
                    );
                    let label = w.label();
                    async move { client.probe(req).await.map(|r| r.into_inner()).map_err(|s| RankError::call(label, "probe", &s)) }
                })
                .await;
            if ring && results.values().any(Result::is_err) {
                // The ring may be broken on some ranks: the next probe starts a new epoch.
                let _ = self.ring_epochs[dp as usize].compare_exchange(epoch, epoch.wrapping_add(1), Ordering::SeqCst, Ordering::SeqCst);
            }
            results
        });
        futures_util::future::join_all(per_group).await.into_iter().flatten().collect()
    }

    /// Probes every replica of `plan` on its active weights, concurrently: a replica mapped to
    /// `None` checks against the reference, one mapped to another replica runs only its
    /// kernel pass ([`crate::consistency::reference_plan`]).
    pub async fn probe_planned(&self, probe: (u32, u32, u64), plan: &BTreeMap<u32, Option<u32>>) -> RankResults<pb::ProbeResult> {
        let groups = plan.iter().map(|(&dp, by)| self.probe_in(Some(dp), probe, false, by.is_some()));
        futures_util::future::join_all(groups).await.into_iter().flatten().collect()
    }

    /// Every rank's report.
    pub async fn reports(&self) -> RankResults<pb::RankReport> {
        self.reports_in(None, false).await
    }

    /// Every rank's report on its active weights, the ranks of the `swapped` replicas each with
    /// the round trip of the stage their weights were committed from, while they still hold
    /// that generation (the report an update answers with: see `kept_round_trip` in the proto).
    pub async fn reports_after_update(&self, swapped: &[u32]) -> RankResults<pb::RankReport> {
        let groups = (0..self.dp).map(|dp| self.reports_with(Some(dp), false, swapped.contains(&dp)));
        futures_util::future::join_all(groups).await.into_iter().flatten().collect()
    }

    /// The reports of one replica's ranks (or all), on their active or staged weights.
    pub async fn reports_in(&self, group: Option<u32>, shadow: bool) -> RankResults<pb::RankReport> {
        self.reports_with(group, shadow, false).await
    }

    async fn reports_with(&self, group: Option<u32>, shadow: bool, kept_round_trip: bool) -> RankResults<pb::RankReport> {
        self.reports_of(group, shadow, kept_round_trip, |_| None).await
    }

    /// Reports on what replica `dp` staged, whose stage deferred its round trip: each rank
    /// adopts the verdict of the rank `proof` names for its tp_rank when its own digests equal
    /// that rank's (and runs its own when they differ or none is named).
    pub async fn staged_reports_identical_to(
        &self,
        dp: u32,
        proof: impl Fn(u32) -> Option<pb::RoundTripProof>,
    ) -> RankResults<pb::RankReport> {
        self.reports_of(Some(dp), true, false, proof).await
    }

    async fn reports_of(
        &self,
        group: Option<u32>,
        shadow: bool,
        kept_round_trip: bool,
        proof: impl Fn(u32) -> Option<pb::RoundTripProof>,
    ) -> RankResults<pb::RankReport> {
        self.fan_out_in(group, |w, mut client| {
            let req = orchestrator_net::auth::request(
                pb::ReportRequest { shadow, brief: false, kept_round_trip, identical_to: proof(w.tp) },
                REPORT_DEADLINE,
                Some(&self.token),
            );
            let label = w.label();
            async move { client.report(req).await.map(|r| r.into_inner()).map_err(|s| RankError::call(label, "report", &s)) }
        })
        .await
    }

    /// Stages `source` on every rank of replica `dp` (shadow buffers; the active weights keep
    /// serving): seconds and the staged version, by worker. With `reference`, each rank also
    /// prepares that probe's reference for the staged version; with `defer_round_trip`, it runs
    /// no round trip (see [`Cluster::staged_reports_identical_to`]).
    pub async fn stage(
        &self,
        dp: u32,
        source: &pb::LoadSource,
        reference: Option<orchestrator_worker::probe::ProbeSpec>,
        defer_round_trip: bool,
    ) -> RankResults<(f64, String)> {
        let reference = reference.map(|p| pb::ReferenceProbe { tokens: p.tokens as u32, latents: p.latents as u32, seed: p.seed });
        self.fan_out_in(Some(dp), |w, mut client| {
            let label = w.label();
            let req = orchestrator_net::auth::request(
                pb::StageRequest { source: Some(source.clone()), reference, defer_round_trip },
                LOAD_DEADLINE,
                Some(&self.token),
            );
            async move {
                let mut stream = client.stage(req).await.map_err(|s| RankError::call(label.clone(), "stage", &s))?.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(p)) if p.finished => return Ok((p.load_seconds, p.version)),
                        Ok(Some(_)) => {}
                        Ok(None) => return Err(RankError::Incomplete { rank: label, what: "stage stream ended early" }),
                        Err(s) => return Err(RankError::call(label, "stage", &s)),
                    }
                }
            }
        })
        .await
    }

    /// Asks every rank of replica `dp` to swap to the decided version `expected` (a rank that
    /// already holds it answers at once): each rank's answer, `(active, staged)`.
    pub async fn commit(&self, dp: u32, expected: &str) -> RankResults<(String, String)> {
        let _guard = self.group_locks[dp as usize].lock().await;
        self.fan_out_in(Some(dp), |w, mut client| {
            let label = w.label();
            let req = orchestrator_net::auth::request(
                pb::CommitRequest { expected_version: expected.to_string() },
                limits::COMMIT_CALL_DEADLINE,
                Some(&self.token),
            );
            async move {
                client
                    .commit(req)
                    .await
                    .map(|r| {
                        let r = r.into_inner();
                        (r.checkpoint_version, r.staged_version)
                    })
                    .map_err(|s| RankError::call(label, "commit", &s))
            }
        })
        .await
    }

    /// Drops whatever replica `dp` staged: each rank's active version after it.
    pub async fn abort(&self, dp: u32) -> RankResults<String> {
        self.abort_with(dp, pb::AbortRequest { rollback: false, expected_version: String::new() }).await
    }

    /// Swaps every rank of replica `dp` back to the version its last commit replaced, which must
    /// be `expected` (only after that decision is journaled): each rank's active version after it.
    pub async fn rollback(&self, dp: u32, expected: &str) -> RankResults<String> {
        let _guard = self.group_locks[dp as usize].lock().await;
        self.abort_with(dp, pb::AbortRequest { rollback: true, expected_version: expected.to_string() }).await
    }

    /// Every rank drops the version it kept for a rollback (the update ended).
    pub async fn release(&self) {
        let _ = self
            .fan_out(|w, mut client| {
                let req = orchestrator_net::auth::request(pb::ReleaseRequest {}, ASSIGN_DEADLINE, Some(&self.token));
                let label = w.label();
                async move { client.release(req).await.map(|_| ()).map_err(|s| RankError::call(label, "release", &s)) }
            })
            .await;
    }

    async fn abort_with(&self, dp: u32, request: pb::AbortRequest) -> RankResults<String> {
        self.fan_out_in(Some(dp), |w, mut client| {
            let req = orchestrator_net::auth::request(request.clone(), ASSIGN_DEADLINE, Some(&self.token));
            let label = w.label();
            async move {
                client.abort(req).await.map(|r| r.into_inner().checkpoint_version).map_err(|s| RankError::call(label, "abort", &s))
            }
        })
        .await
    }

    /// Asks every worker to stop, then kills any that did not.
    pub async fn shutdown(&self) {
        for w in &self.workers {
            if let Some(mut client) = w.client.clone() {
                let req = orchestrator_net::auth::request(pb::ShutdownRequest {}, SHUTDOWN_DEADLINE, Some(&self.token));
                let _ = client.shutdown(req).await;
            }
        }
        for w in &self.workers {
            w.process.stop_within(SHUTDOWN_DEADLINE).await;
        }
    }

    /// Kills every worker at once (after a failure); workers this coordinator did not start are
    /// asked to stop instead (whether or not they were connected yet).
    pub async fn kill_all(&self) {
        for w in &self.workers {
            w.process.kill().await;
        }
        let remote = self.workers.iter().filter(|w| matches!(w.process, WorkerProcess::Remote)).filter_map(|w| {
            let reg = self.registry.get(w.id)?;
            let endpoint = orchestrator_net::tls::endpoint(&reg.address, self.tls.as_ref()).ok()?;
            let token = self.token.clone();
            Some(async move {
                let channel = endpoint.connect_timeout(SHUTDOWN_DEADLINE).connect().await.ok()?;
                let req = orchestrator_net::auth::request(pb::ShutdownRequest {}, SHUTDOWN_DEADLINE, Some(&token));
                WorkerClient::new(channel).shutdown(req).await.ok()
            })
        });
        futures_util::future::join_all(remote).await;
    }

    /// Fills in, from the registrations, where each row's rank runs: its host, device and pid
    /// when the rank could not say (it failed), its address, and who started it; a failed row's
    /// text names the host too.
    pub fn annotate(&self, rows: &mut [crate::consistency::RankRow]) {
        for row in rows {
            let Some(reg) = self.registry.get(row.worker) else { continue };
            if row.host.is_empty() {
                row.host = reg.host.clone();
            }
            if row.device.is_empty() {
                row.device = reg.device.clone();
            }
            if row.pid == 0 {
                row.pid = reg.process.pid;
            }
            // A failure names where the rank runs, whatever failed (an RPC error says only what).
            if let Some(f) = row.failure.as_mut()
                && !row.failure_names_host
            {
                f.push_str(&format!(" [on host {}, pid {}, {}]", reg.host, reg.process.pid, reg.address));
            }
            row.address = reg.address;
            row.started_by = reg.rank_source;
        }
    }

    /// Tells every rank of replica `dp` whether it serves verified weights (`version`), so its
    /// grpc.health.v1 readiness follows the rotation; true when every rank took it.
    pub async fn set_serving(&self, dp: u32, serving: bool, version: &str) -> bool {
        let results = self
            .fan_out_in(Some(dp), |w, mut client| {
                let req = orchestrator_net::auth::request(
                    pb::SetServingRequest { serving, version: version.to_string() },
                    READINESS_DEADLINE,
                    Some(&self.token),
                );
                let label = w.label();
                async move { client.set_serving(req).await.map(|_| ()).map_err(|s| RankError::call(label, "set serving", &s)) }
            })
            .await;
        results.values().all(Result::is_ok)
    }
}
