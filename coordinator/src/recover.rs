//! `orchestrator recover --state-dir DIR`: a coordinator restarted after the previous one died
//! (killed, crashed, its host rebooted) takes the cluster over from the journal.
//!
//! It binds the address the workers heartbeat to (they keep serving for their grace period),
//! adopts them by address and pid, asks every rank which version it holds and which it has
//! staged, and resolves an update that was in flight: by default it finishes it (every replica
//! not yet on the new version is staged, verified and swapped, as in any update), or with
//! `--rollback` it returns every replica to the version before the update the same way.
//! Whatever was staged when the coordinator died is aborted first, so nothing unverified can
//! be swapped in. Then it reports and serves like `launch --serve`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use orchestrator_net::auth::Token;
use orchestrator_worker::probe::ProbeSpec;

use crate::cluster::Cluster;
use crate::consistency::ConsistencyReport;
use crate::journal::{Event, Journal, JournalFault, Replayed, SourceRecord, Step};
use crate::launch::TokenFileGuard;
use crate::rollout::CommitStatus;
use crate::rotation::Rotation;
use crate::server::Endpoint;
use crate::session::{Session, SessionState};
use crate::update::{Journaled, Proof, UpdatePlan, drive_commit, rolling_update, try_reinstate};
use orchestrator_model::AllowedRoots;

/// How a recovery resolves an interrupted update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolve {
    Finish,
    Rollback,
}

/// The load source of a journal record, opened in the coordinator the way a worker opens it.
fn open_source(s: &SourceRecord) -> anyhow::Result<orchestrator_worker::LoadSource> {
    let roots = match s {
        SourceRecord::Checkpoint { dir } => AllowedRoots::for_checkpoint(dir)?,
        SourceRecord::Dummy { .. } => Default::default(),
    };
    orchestrator_worker::LoadSource::from_pb(Some(&s.to_pb()), &roots).map_err(|e| anyhow::anyhow!("the journal's source: {e}"))
}

/// What the adopted ranks hold.
struct Observed {
    /// Each replica's version when all its ranks answer and hold the same one.
    versions: Vec<Option<String>>,
    /// Each replica's version kept for a rollback, when all its ranks keep the same one.
    previous: Vec<Option<String>>,
    /// Replicas with a rank that did not answer (dead or unreachable), with why.
    unreachable: BTreeMap<u32, String>,
    /// A line per rank.
    lines: Vec<String>,
}

async fn observe(cluster: &Cluster) -> Observed {
    let mut o = Observed { versions: Vec::new(), previous: Vec::new(), unreachable: BTreeMap::new(), lines: Vec::new() };
    let reports = cluster.reports().await;
    for dp in 0..cluster.dp {
        let mut seen: Vec<String> = Vec::new();
        let mut kept: Vec<String> = Vec::new();
        for w in cluster.workers.iter().filter(|w| w.dp == dp) {
            match reports.get(&w.id) {
                Some(Ok(r)) => {
                    let staged = if r.staged_version.is_empty() { String::new() } else { format!(", staged {}", r.staged_version) };
                    let previous = if r.previous_version.is_empty() {
                        String::new()
                    } else {
                        format!(", keeps {} for a rollback", r.previous_version)
                    };
                    o.lines.push(format!("{}: version {}{staged}{previous}", w.label(), r.checkpoint_version));
                    seen.push(r.checkpoint_version.clone());
                    kept.push(r.previous_version.clone());
                }
                Some(Err(e)) => {
                    o.lines.push(format!("{}: {e}", w.label()));
                    o.unreachable.insert(dp, e.to_string());
                }
                None => {
                    o.lines.push(format!("{}: no report", w.label()));
                    o.unreachable.insert(dp, format!("{}: no report", w.label()));
                }
            }
        }
        let whole = !o.unreachable.contains_key(&dp) && seen.windows(2).all(|w| w[0] == w[1]);
        o.versions.push(whole.then(|| seen.first().cloned()).flatten());
        let kept_whole = whole && kept.windows(2).all(|w| w[0] == w[1]);
        o.previous.push(kept_whole.then(|| kept.first().cloned()).flatten().filter(|v| !v.is_empty()));
    }
    o
}

/// The plan's `--commit-timeout` (journals written before it existed: the default).
fn commit_timeout(plan: &crate::journal::PlanRecord) -> std::time::Duration {
    plan.commit_timeout_ms.map_or(orchestrator_proto::limits::COMMIT_DRIVE_LIMIT, std::time::Duration::from_millis)
}

/// Finishes every commit the journal shows decided and unconfirmed (never aborting one), and
/// drops whatever else the dead coordinator staged, so nothing unverified can be swapped in.
async fn settle_decisions(cluster: &Cluster, rotation: &Rotation, journal: &Journal, replayed: &Replayed, steps: &mut Vec<String>) {
    for dp in 0..cluster.dp {
        match crate::rollout::recovery(replayed.decided.get(&dp).map(String::as_str)) {
            crate::rollout::Recovery::AbortStaged => {
                cluster.abort(dp).await;
            }
            crate::rollout::Recovery::FinishCommit { version } => {
                match drive_commit(cluster, dp, &version, commit_timeout(&replayed.plan)).await {
                    CommitStatus::Done => {
                        let in_pending = replayed.pending.as_ref().is_some_and(|p| p.steps.get(&dp) == Some(&Step::Decided));
                        let event = match &replayed.pending {
                            Some(p) if in_pending => Event::UpdateStep { update: p.update, dp, step: Step::Committed },
                            _ => Event::CommitConfirmed { dp, version: version.clone() },
                        };
                        journal.note(event);
                        steps.push(format!("replica dp{dp}: finished the decided commit to {version} on every rank"));
                    }
                    other => {
                        let why = format!("the decided commit to {version} cannot finish now: {other:?}");
                        // A dead rank never confirms: its replica is out for good, and the
                        // resolving update skips it (as a live update does) instead of refusing.
                        if other.has_dead_rank() {
                            rotation.mark_dead(dp, &why);
                        } else {
                            rotation.pull(dp, &why);
                        }
                        rotation.set_pending_commit(dp, Some(version.clone()));
                        steps.push(format!("replica dp{dp}: {why}; out of rotation until every rank confirms it"));
                    }
                }
            }
        }
    }
}

/// Resolves the update the journal left in flight: whether it resolved, the source every
/// replica now serves, the last update number, and the steps taken.
#[allow(clippy::too_many_arguments)]
async fn resolve(
    cluster: &Cluster,
    rotation: &Rotation,
    journal: &Journal,
    replayed: &Replayed,
    config: &orchestrator_model::ModelConfig,
    probe: ProbeSpec,
    how: Resolve,
    observed: &Observed,
    roots: &AllowedRoots,
    mut steps: Vec<String>,
) -> anyhow::Result<(bool, SourceRecord, u64, Vec<String>)> {
    let Some(pending) = &replayed.pending else {
        // No update in flight: nothing may be rolled back to any more.
        cluster.release().await;
        if how == Resolve::Rollback {
            steps.push("no update was in flight: nothing to roll back".into());
        }
        return Ok((true, replayed.current.clone(), replayed.last_update, steps));
    };
    // Rolling back returns to what every replica served before the interrupted update (for an
    // update a recovery began to resolve another, before that one: rolling back a rollback
    // finishes it).
    let (target, target_version) = match how {
        Resolve::Finish => (pending.to.clone(), pending.new_version.clone()),
        Resolve::Rollback => (replayed.current.clone(), replayed.current_version.clone()),
    };
    let verb = if how == Resolve::Finish { "finishing" } else { "rolling back" };
    steps.push(format!(
        "update {} ({} -> version {}) was interrupted; last steps: {}; {verb} it",
        pending.update,
        replayed.current_version,
        pending.new_version,
        if pending.steps.is_empty() {
            "none".to_string()
        } else {
            pending.steps.iter().map(|(dp, s)| format!("dp{dp} {s:?}")).collect::<Vec<_>>().join(", ")
        }
    ));
    // A replica with a rank that does not answer cannot be staged: it stays out of rotation.
    for (dp, why) in &observed.unreachable {
        steps.push(format!("replica dp{dp}: left out of rotation, a rank does not answer: {why}"));
    }
    // Rolling back: a replica whose commit in this update completed keeps, on every rank, the
    // version that commit replaced. The explicit rollback decision is journaled, then every rank
    // swaps back to it (no restaging); the replica serves again after a passing probe.
    let mut rolled = Vec::new();
    if how == Resolve::Rollback {
        for dp in 0..cluster.dp {
            let on_new = observed.versions[dp as usize].as_deref() == Some(pending.new_version.as_str());
            let kept = observed.previous[dp as usize].as_deref() == Some(target_version.as_str());
            if observed.unreachable.contains_key(&dp) || !on_new || !kept || rotation.state(dp).pending_commit.is_some() {
                continue;
            }
            rotation.pull(dp, "rolling back");
            journal.record(Event::UpdateStep { update: pending.update, dp, step: Step::RolledBack })?;
            let answers = cluster.rollback(dp, &target_version).await;
            let ranks = cluster.workers.iter().filter(|w| w.dp == dp).count();
            if answers.len() == ranks && answers.values().all(|r| r.as_deref() == Ok(target_version.as_str())) {
                let back = match try_reinstate(cluster, rotation, dp, probe, Proof::Verified, true).await {
                    Ok(_) => String::new(),
                    Err(why) => format!("; its probe failed, out of rotation: {why}"),
                };
                steps.push(format!("replica dp{dp}: rolled back to {target_version} from the copy every rank kept since its commit{back}"));
                rolled.push(dp);
            } else {
                let errors: Vec<String> = answers.values().filter_map(|r| r.as_ref().err().map(ToString::to_string)).collect();
                steps.push(format!(
                    "replica dp{dp}: the rollback from the kept copy did not finish ({}); restaging {target_version}",
                    errors.join("; ")
                ));
            }
        }
    }
    let complete = observed.unreachable.is_empty() && rotation.states().iter().all(|s| s.pending_commit.is_none());
    let behind: Vec<u32> = (0..cluster.dp)
        .filter(|dp| !rolled.contains(dp))
        .filter(|dp| !observed.unreachable.contains_key(dp))
        .filter(|&dp| rotation.state(dp).pending_commit.is_none())
        .filter(|&dp| observed.versions[dp as usize].as_deref() != Some(target_version.as_str()))
        .collect();
    if behind.is_empty() {
        let ok = how == Resolve::Finish && complete;
        journal.record(Event::UpdateEnd {
            update: pending.update,
            ok,
            note: format!("resolved after a coordinator restart: every replica already on {target_version}"),
        })?;
        steps.push(format!("every answering replica already holds {target_version}"));
        cluster.release().await;
        // The source the session serves is the journal's: the target only where its end says
        // the update was applied (a later update then journals the source it moves from as a
        // recovery would read it).
        let current = if ok { target } else { replayed.current.clone() };
        return Ok((complete, current, pending.update, steps));
    }
    let SourceRecord::Checkpoint { dir } = &target else {
        anyhow::bail!("cannot {verb} update {}: its target is a dummy source, not a checkpoint directory", pending.update);
    };
    // The interrupted update is closed (not applied) by the begin of the one resolving it, in
    // one line: a recovery killed in between would otherwise leave nothing in flight to resolve.
    let from = if how == Resolve::Finish { pending.from.clone() } else { pending.to.clone() };
    let plan = UpdatePlan {
        dir,
        probe,
        max_unavailable: pending.max_unavailable,
        max_staging: 0,
        replicas: Some(behind.clone()),
        journal: Some(Journaled { journal, update: pending.update + 1, from, resumes: Some(pending.update) }),
        roots,
        commit_timeout: commit_timeout(&replayed.plan),
        known: None,
        // The version the interrupted update was rolling out (or the one every replica served
        // before it), not whatever the directory holds now.
        expected_version: Some(&target_version),
    };
    let outcome = rolling_update(cluster, rotation, config, plan).await;
    // Refused before its begin was written (its checkpoint no longer validates, a replica's
    // commit is pending): the interrupted update is closed here, not applied, so that no later
    // update begins over it.
    if journal.open_update() == Some(pending.update) {
        journal.record(Event::UpdateEnd {
            update: pending.update,
            ok: false,
            note: format!("interrupted by a coordinator restart; update {}, to {verb} it, was refused before it began", pending.update + 1),
        })?;
    }
    steps.push(format!("update {}: replicas {behind:?} to {} ({verb})", pending.update + 1, dir.display()));
    steps.extend(outcome.steps.iter().cloned());
    Ok((outcome.ok && complete, if outcome.ok { target } else { replayed.current.clone() }, pending.update + 1, steps))
}

/// Runs a recovery, then serves; returns whether the final report is clean. A state directory
/// whose coordinator is alive is refused before anything is touched (its lock is held); the
/// token file is taken over only once this coordinator listens where the old one did.
pub async fn recover(
    state_dir: &Path,
    how: Resolve,
    fault: Option<JournalFault>,
    ready_file: Option<&Path>,
    emit_report: impl Fn(&ConsistencyReport),
) -> anyhow::Result<bool> {
    let start = Instant::now();
    let (journal, replayed) = Journal::open(state_dir)?;
    anyhow::ensure!(
        !replayed.shut_down,
        "{}: the cluster it records was shut down; nothing to recover (start one with `orchestrator launch`)",
        journal.path().display()
    );
    if let Some(f) = fault {
        journal.inject_fault(f);
    }
    let journal = Arc::new(journal);
    let plan = replayed.plan.clone();
    let token = Token::read(&plan.token_file)?;
    let listen =
        plan.coordinator.parse().with_context(|| format!("{}: coordinator address {}", journal.path().display(), plan.coordinator))?;
    let tls = plan.tls_dir.as_deref().map(orchestrator_net::tls::TlsFiles::load).transpose()?;
    let roots = AllowedRoots::new(&plan.allow_roots)?;
    // Everything that can fail without the workers is checked before anything is touched: the
    // model configuration comes from the source every replica serves (or, when that is gone,
    // the one an interrupted update was moving to).
    let config = match open_source(&replayed.current) {
        Ok(s) => s.config().clone(),
        Err(e) => match &replayed.pending {
            Some(p) => open_source(&p.to).with_context(|| orchestrator_ops::output::error_text(&e))?.config().clone(),
            None => return Err(e),
        },
    };
    // Its sizes were checked with the plan (`Journal::open`); here the memory it holds on a rank
    // of this model (which checks the sizes too).
    let probe = plan.probe.map(|(t, s, seed)| ProbeSpec { tokens: t as usize, latents: s as usize, seed });
    if let Some(p) = probe {
        let g = &config.geometry;
        p.check_on(g, g.layers, plan.tp as usize).with_context(|| format!("{}: the plan's probe {p}", journal.path().display()))?;
    }
    let endpoint = Endpoint::start(listen, token.clone(), tls.as_ref(), plan.tp * plan.dp).await?;
    eprintln!("coordinator recovered from {} on {}; adopting {} workers", journal.path().display(), endpoint.address, plan.workers.len());
    let cluster = match Cluster::adopt(plan.tp, plan.dp, &plan.workers, endpoint.registry.clone(), token, tls).await {
        Ok(c) => c,
        Err(f) => {
            endpoint.stop().await;
            anyhow::bail!(
                "cannot adopt the cluster's workers (they stop on their own once their grace period passes): {}",
                f.into_iter().map(|(_, e)| e.to_string()).collect::<Vec<_>>().join("; ")
            );
        }
    };
    journal.record(Event::Recovered { note: format!("coordinator pid {} took over", std::process::id()) })?;
    // Every replica is out of rotation until it has proved itself with a probe.
    let rotation = Arc::new(Rotation::new(vec![String::new(); plan.dp as usize]));
    for dp in 0..plan.dp {
        rotation.pull(dp, "recovering");
    }
    let update_probe = probe.unwrap_or(ProbeSpec::SERVING);
    let mut steps = Vec::new();
    settle_decisions(&cluster, &rotation, &journal, &replayed, &mut steps).await;
    // What the confirmations it journaled settle (the last commit an ended update left
    // unconfirmed makes its target the current source).
    let replayed = crate::journal::replay(journal.path())?.unwrap_or(replayed);
    let observed = observe(&cluster).await;
    for line in &observed.lines {
        eprintln!("  {line}");
    }
    for (dp, v) in observed.versions.iter().enumerate() {
        let dp = dp as u32;
        match v {
            Some(_) if rotation.state(dp).pending_commit.is_none() => {
                if let Err(why) = try_reinstate(&cluster, &rotation, dp, update_probe, Proof::Verified, true).await {
                    rotation.pull(dp, &format!("its probe failed: {why}"));
                }
            }
            Some(_) => {}
            None => {
                rotation.pull(dp, "its ranks did not agree on one version");
            }
        }
    }
    let (resolved, resolved_source, last_update, steps) =
        resolve(&cluster, &rotation, &journal, &replayed, &config, update_probe, how, &observed, &roots, steps).await?;
    // The journal's account of what every replica serves now, and of an update that ended
    // short of confirmations only (the same rules a live session keeps).
    let current_source = journal.serving().map_or(resolved_source, |(source, _)| source);
    for step in &steps {
        eprintln!("recover: {step}");
    }
    let source_desc = match &current_source {
        SourceRecord::Checkpoint { dir } => format!("checkpoint {}", dir.display()),
        SourceRecord::Dummy { .. } => plan.source_desc.clone(),
    };
    let session = Session {
        cluster: Arc::new(cluster),
        rotation,
        config,
        probe,
        golden: None,
        journal: Some(journal),
        roots,
        commit_timeout: commit_timeout(&plan),
        known_claims: Default::default(),
        updating: Default::default(),
        update_lock: Default::default(),
        state: std::sync::Mutex::new(SessionState { source_desc, current_source, last_update, timings: BTreeMap::new() }),
    };
    let mut report = session.check(true).await;
    report.timings.insert("recover".into(), start.elapsed().as_secs_f64());
    emit_report(&report);
    if !resolved {
        eprintln!("recover: the interrupted update could not be resolved (see above); the cluster serves what each replica holds");
    }
    // From here the cluster is this coordinator's: a token file the launch generated in the state
    // directory goes when it shuts down (before, a failed recovery leaves it for a retry).
    let _token_file = TokenFileGuard(plan.token_file.starts_with(state_dir).then(|| plan.token_file.clone()));
    endpoint.serve(Arc::new(session), &plan.token_file, ready_file).await;
    endpoint.stop().await;
    Ok(resolved && report.ok)
}
