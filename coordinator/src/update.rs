//! Rolling weight updates (`orchestrator update`) and the probe rotation they keep serving.
//!
//! One replica (TP group) at a time: take it out of probe rotation (when another replica can
//! serve), stage the new version on every rank into shadow buffers through the same loader
//! pipeline, verify it (round trips, probes against the reference, the group agreeing on `y`,
//! and the same `y` as replicas already updated), swap every rank of the group at one barrier,
//! put it back. A failure aborts the staged version: the replica keeps its old one, and the
//! update stops with the reason.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use orchestrator_model::inspect::inspect;
use orchestrator_model::{Checkpoint, ModelConfig};
use orchestrator_proto::v1 as pb;
use orchestrator_worker::probe::ProbeSpec;
use serde::Serialize;

use crate::cluster::Cluster;
use crate::journal::{Event, Journal, SourceRecord, Step};

/// What a rolling update is asked to do.
pub struct UpdatePlan<'a> {
    /// The new checkpoint directory.
    pub dir: &'a Path,
    pub probe: ProbeSpec,
    pub max_unavailable: u32,
    /// The replicas to update (all when `None`).
    pub replicas: Option<Vec<u32>>,
    /// Where to journal the update's steps, its number, and the source it moves from.
    pub journal: Option<(&'a Journal, u64, SourceRecord)>,
}

/// Which replicas serve probes, and which version each holds.
pub struct Rotation {
    serving: Mutex<Vec<bool>>,
    versions: Mutex<Vec<String>>,
    next: AtomicUsize,
}

impl Rotation {
    pub fn new(versions: Vec<String>) -> Self {
        Self { serving: Mutex::new(vec![true; versions.len()]), versions: Mutex::new(versions), next: AtomicUsize::new(0) }
    }

    /// Rotation from observed versions: a replica serves only when its ranks agree.
    pub fn observed(versions: Vec<Option<String>>) -> Self {
        let serving = versions.iter().map(Option::is_some).collect();
        let versions = versions.into_iter().map(|v| v.unwrap_or_else(|| "mixed".into())).collect();
        Self { serving: Mutex::new(serving), versions: Mutex::new(versions), next: AtomicUsize::new(0) }
    }

    pub fn set(&self, replica: u32, serving: bool) {
        self.serving.lock().unwrap_or_else(|p| p.into_inner())[replica as usize] = serving;
    }

    pub fn version(&self, replica: u32) -> String {
        self.versions.lock().unwrap_or_else(|p| p.into_inner())[replica as usize].clone()
    }

    /// The next replica in rotation (round robin), if any serves.
    pub fn pick(&self) -> Option<u32> {
        let serving = self.serving.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let n = serving.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n).map(|i| (start + i) % n).find(|&r| serving[r]).map(|r| r as u32)
    }
}

/// One probe through the rotation.
pub async fn routed_probe(cluster: &Cluster, rotation: &Rotation, spec: ProbeSpec) -> pb::RoutedProbeResult {
    let Some(replica) = rotation.pick() else {
        return pb::RoutedProbeResult { ok: false, replica: 0, checkpoint_version: String::new(), error: "no replica in rotation".into() };
    };
    let version = rotation.version(replica);
    let result = cluster.probe_in(Some(replica), (spec.tokens as u32, spec.latents as u32, spec.seed), false, true).await;
    let error = match result {
        Err(failures) => Some(failures.into_iter().map(|(_, f)| f).collect::<Vec<_>>().join("; ")),
        Ok(results) => {
            let mut errors: Vec<String> = results.values().filter_map(|r| r.as_ref().err().cloned()).collect();
            let probes: Vec<&pb::ProbeResult> = results.values().filter_map(|r| r.as_ref().ok()).collect();
            if probes.iter().any(|p| !p.ok) {
                errors.push("a rank's probe is out of tolerance".into());
            }
            if probes.windows(2).any(|w| w[0].y_digest != w[1].y_digest) {
                errors.push("the group's ranks disagree on y".into());
            }
            (!errors.is_empty()).then(|| errors.join("; "))
        }
    };
    pb::RoutedProbeResult { ok: error.is_none(), replica, checkpoint_version: version, error: error.unwrap_or_default() }
}

/// What an update did, step by step.
#[derive(Clone, Debug, Serialize)]
pub struct UpdateOutcome {
    pub ok: bool,
    pub checkpoint: String,
    pub new_version: String,
    pub steps: Vec<String>,
    /// Replica -> version after the update.
    pub versions: BTreeMap<u32, String>,
    pub seconds: f64,
}

/// Validates the new checkpoint against the running plan before any replica is touched.
fn validate(dir: &Path, running: &ModelConfig) -> Result<String, String> {
    let ck = Checkpoint::open(dir).map_err(|e| format!("new checkpoint {}: {e}", dir.display()))?;
    if ck.config.geometry != running.geometry || ck.config.format != running.format {
        return Err(format!(
            "new checkpoint {} has geometry {:?} / {:?}, the running plan {:?} / {:?}",
            dir.display(),
            ck.config.geometry,
            ck.config.format,
            running.geometry,
            running.format
        ));
    }
    let report = inspect(&ck);
    if !report.valid {
        return Err(format!("new checkpoint {} is invalid: {}", dir.display(), report.problems.join("; ")));
    }
    Ok(orchestrator_worker::LoadSource::Safetensors(ck).version())
}

/// Rolls `dir` across every replica, at most `max_unavailable` replicas at a time (and never
/// all of them while more than one exists, so probes keep being served). A batch is staged and
/// verified on every replica in it before any of them swaps; a failure aborts the whole batch.
pub async fn rolling_update(cluster: &Cluster, rotation: &Rotation, running: &ModelConfig, plan: UpdatePlan<'_>) -> UpdateOutcome {
    let UpdatePlan { dir, probe, max_unavailable, replicas, journal } = plan;
    let start = Instant::now();
    let mut steps = Vec::new();
    let new_version = match tokio::task::spawn_blocking({
        let (dir, running) = (dir.to_path_buf(), running.clone());
        move || validate(&dir, &running)
    })
    .await
    {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            return finish(false, dir, String::new(), vec![format!("refused before touching any replica: {e}")], rotation, cluster, start);
        }
        Err(e) => return finish(false, dir, String::new(), vec![format!("validation task failed: {e}")], rotation, cluster, start),
    };
    steps.push(format!("validated {} (version {new_version}) against the running plan", dir.display()));
    let target = SourceRecord::Checkpoint { dir: dir.to_path_buf() };
    let source = target.to_pb();
    let record = |event: Event| {
        if let Some((j, _, _)) = &journal {
            j.note(event);
        }
    };
    let update = journal.as_ref().map_or(0, |(_, id, _)| *id);
    if let Some((_, _, from)) = &journal {
        record(Event::UpdateBegin { update, from: from.clone(), to: target, new_version: new_version.clone(), max_unavailable });
    }
    let step = |dp: u32, step: Step| record(Event::UpdateStep { update, dp, step });
    let end = |ok: bool, note: &str| record(Event::UpdateEnd { update, ok, note: note.to_string() });
    let batch = if cluster.dp == 1 { 1 } else { max_unavailable.clamp(1, cluster.dp - 1) } as usize;
    let replicas: Vec<u32> = replicas.unwrap_or_else(|| (0..cluster.dp).collect());
    let mut reference_y: Option<String> = None;
    for group in replicas.chunks(batch) {
        for &dp in group {
            step(dp, Step::Staging);
            if cluster.dp > 1 {
                rotation.set(dp, false);
            }
        }
        let staged =
            futures_util::future::join_all(group.iter().map(|&dp| stage_and_verify(cluster, dp, &source, &new_version, probe))).await;
        // Every replica of the batch must verify, and all must agree on y with each other and
        // with the replicas already updated.
        let mut failure = None;
        for (&dp, r) in group.iter().zip(&staged) {
            match r {
                Err(e) if failure.is_none() => failure = Some((dp, e.clone())),
                Ok((_, y)) if failure.is_none() => match &reference_y {
                    Some(r) if r != y => failure = Some((dp, format!("staged y {y} differs from the already verified replicas' {r}"))),
                    _ => reference_y = Some(y.clone()),
                },
                _ => {}
            }
        }
        if failure.is_none() {
            for &dp in group {
                step(dp, Step::Verified);
            }
        }
        let commits = if failure.is_none() {
            futures_util::future::join_all(group.iter().map(|&dp| cluster.commit(dp, &new_version))).await
        } else {
            Vec::new()
        };
        for (&dp, c) in group.iter().zip(&commits) {
            let err = match c {
                Err(f) => Some(f.iter().map(|(_, e)| e.clone()).collect::<Vec<_>>().join("; ")),
                Ok(results) => results.values().find_map(|r| r.as_ref().err().cloned()),
            };
            match (err, &failure) {
                (Some(e), None) => failure = Some((dp, format!("commit: {e}"))),
                (None, _) => step(dp, Step::Committed),
                (Some(_), Some(_)) => {}
            }
        }
        match failure {
            None => {
                for (&dp, r) in group.iter().zip(&staged) {
                    rotation.versions.lock().unwrap_or_else(|p| p.into_inner())[dp as usize] = new_version.clone();
                    rotation.set(dp, true);
                    let detail = r.as_ref().map(|(d, _)| d.as_str()).unwrap_or_default();
                    steps.push(format!("replica dp{dp}: {detail}; swapped to {new_version}"));
                }
            }
            Some((failed, e)) => {
                for &dp in group {
                    cluster.abort(dp).await;
                    step(dp, Step::Aborted);
                    // A replica with a dead rank cannot serve: it stays out of rotation.
                    let dead = cluster.dead_in_settled(dp).await;
                    rotation.set(dp, dead.is_empty());
                    let down = if dead.is_empty() { String::new() } else { format!(" ({}: out of rotation)", dead.join(", ")) };
                    let why = if dp == failed { e.clone() } else { format!("aborted with its batch (replica dp{failed} failed)") };
                    steps.push(format!("replica dp{dp}: FAILED, kept version {}{down}: {why}", rotation.version(dp)));
                }
                end(false, &format!("replica dp{failed} failed: {e}"));
                return finish(false, dir, new_version, steps, rotation, cluster, start);
            }
        }
    }
    end(true, "every replica verified and swapped");
    finish(true, dir, new_version, steps, rotation, cluster, start)
}

fn finish(
    ok: bool,
    dir: &Path,
    new_version: String,
    steps: Vec<String>,
    rotation: &Rotation,
    cluster: &Cluster,
    start: Instant,
) -> UpdateOutcome {
    let versions = (0..cluster.dp).map(|dp| (dp, rotation.version(dp))).collect();
    UpdateOutcome { ok, checkpoint: dir.display().to_string(), new_version, steps, versions, seconds: start.elapsed().as_secs_f64() }
}

/// Stages and verifies one replica: a description and the staged `y`.
async fn stage_and_verify(
    cluster: &Cluster,
    dp: u32,
    source: &pb::LoadSource,
    new_version: &str,
    probe: ProbeSpec,
) -> Result<(String, String), String> {
    let failed = |f: crate::cluster::Failures| f.into_iter().map(|(_, e)| e).collect::<Vec<_>>().join("; ");
    let t = Instant::now();
    let staged = cluster.stage(dp, source).await.map_err(failed)?;
    if let Some(e) = staged.values().find_map(|r| r.as_ref().err()) {
        return Err(e.clone());
    }
    let stage_s = t.elapsed().as_secs_f64();
    // Verify the staged version: round trips and versions, then probes and agreement on y.
    let reports = cluster.reports_in(Some(dp), true).await.map_err(failed)?;
    for r in reports.values() {
        let r = r.as_ref().map_err(Clone::clone)?;
        if !r.round_trip_ok {
            return Err(format!("rank dp{dp}/tp{}: staged round trip failed: {}", r.tp_rank, r.round_trip_failures.join("; ")));
        }
        if r.checkpoint_version != new_version {
            return Err(format!("rank dp{dp}/tp{} staged version {}, expected {new_version}", r.tp_rank, r.checkpoint_version));
        }
    }
    let probes = cluster.probe_in(Some(dp), (probe.tokens as u32, probe.latents as u32, probe.seed), true, false).await.map_err(failed)?;
    let mut ys = Vec::new();
    for (id, p) in &probes {
        let p = p.as_ref().map_err(Clone::clone)?;
        if !p.ok {
            return Err(format!(
                "worker {id}: staged probe out of tolerance (q differs in {} values, z err {:.3e})",
                p.q_mismatches, p.z_max_abs_err
            ));
        }
        ys.push(p.y_digest.clone());
    }
    if ys.windows(2).any(|w| w[0] != w[1]) {
        return Err(format!("the ranks of dp{dp} disagree on the staged y: {ys:?}"));
    }
    let y = ys.first().cloned().unwrap_or_default();
    Ok((format!("staged in {stage_s:.2} s, verified (round trips, probes, y {y})"), y))
}
