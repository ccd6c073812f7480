//! The commit protocol of a rolling update, as pure decisions (no I/O), in the way raft-rs keeps
//! its protocol core apart from storage and transport: the driver in `update.rs` (and `recover`,
//! and the health loop) asks these functions what to do next and does it.
//!
//! Per TP group (replica):
//! 1. **Staging and verification.** Every rank stages the new version beside the active one and
//!    the group is verified. Any failure here decides *abort*: the decision is journaled, then
//!    every rank drops what it staged. No rank has swapped, so the group is on its old version.
//! 2. **The decision.** When verification passed and every rank is healthy, *commit* is decided
//!    and journaled (fsynced) before any rank is told to swap. From then on the group's version
//!    is the new one and an abort is never reported.
//! 3. **Driving the commit.** Every rank is asked to swap to the decided version, again and again
//!    (a commit is idempotent), until every rank confirms it. A rank that exited can never
//!    confirm: it is dead, named, and its replica stays out of rotation. A rank that does not
//!    answer within the drive limit leaves the commit pending: the replica stays out of
//!    rotation and the coordinator (or `recover`, from the journal) finishes it when the rank
//!    answers again. A replica serves again only after every rank confirmed one version and a
//!    probe passed.

use std::time::Duration;

/// What one rank of a group said (or what its process shows) while a commit is driven.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankView {
    /// It answered: the version it holds and the one it has staged (empty: nothing).
    Holds { active: String, staged: String },
    /// It did not answer (a call failed or timed out, its heartbeats stopped) for this long.
    Silent { for_: Duration, why: String },
    /// Its process is gone.
    Dead { why: String },
}

/// Where a decided commit stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommitStatus {
    /// Every rank holds the decided version.
    Done,
    /// These ranks still need the commit (they have it staged, or did not answer yet).
    Pending { ranks: Vec<usize> },
    /// The commit cannot finish now: these ranks are dead, lost their staged copy, or stayed
    /// silent past the limit. The replica stays out of rotation with the commit pending.
    Stuck { ranks: Vec<(usize, String)> },
}

impl CommitStatus {
    /// Stuck on a rank that is dead: the commit can never finish, and its replica is out for good.
    pub fn has_dead_rank(&self) -> bool {
        matches!(self, CommitStatus::Stuck { ranks } if ranks.iter().any(|(_, why)| why.starts_with(DEAD)))
    }
}

/// How a stuck commit's reason begins for a dead rank.
const DEAD: &str = "dead: ";

/// Decides where a commit to `target` stands from every rank's view; a rank silent longer than
/// `limit` makes the commit stuck.
pub fn commit_status(target: &str, ranks: &[RankView], limit: Duration) -> CommitStatus {
    let mut pending = Vec::new();
    let mut stuck = Vec::new();
    for (rank, view) in ranks.iter().enumerate() {
        match view {
            RankView::Holds { active, .. } if active == target => {}
            RankView::Holds { staged, .. } if staged == target => pending.push(rank),
            RankView::Holds { active, staged } => stuck.push((
                rank,
                format!(
                    "holds {active} with {} staged: it lost the decided version {target} (restarted?)",
                    if staged.is_empty() { "nothing" } else { staged }
                ),
            )),
            RankView::Silent { for_, why } if *for_ > limit => {
                stuck.push((rank, format!("did not answer for {:.1} s: {why}", for_.as_secs_f64())))
            }
            RankView::Silent { .. } => pending.push(rank),
            RankView::Dead { why } => stuck.push((rank, format!("{DEAD}{why}"))),
        }
    }
    if !stuck.is_empty() {
        CommitStatus::Stuck { ranks: stuck }
    } else if pending.is_empty() {
        CommitStatus::Done
    } else {
        CommitStatus::Pending { ranks: pending }
    }
}

/// What verification concluded for a group: commit, or abort for the verification's failure
/// `F`, or abort for the ranks found down at the decision point.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision<F> {
    Commit,
    /// Verification failed: abort, for its reason.
    Failed(F),
    /// Verification passed, but these ranks were down when the commit was to be decided.
    Unhealthy {
        ranks: Vec<crate::cluster::RankDown>,
    },
}

/// The decision after staging and verification: commit only when verification passed and every
/// rank is still healthy at the decision point (a rank that stalls now would only delay the
/// swap, but one already known to be down would leave the commit pending for nothing).
pub fn decide<F>(verification: Result<(), F>, down: Vec<crate::cluster::RankDown>) -> Decision<F> {
    match verification {
        Err(why) => Decision::Failed(why),
        Ok(()) if !down.is_empty() => Decision::Unhealthy { ranks: down },
        Ok(()) => Decision::Commit,
    }
}

/// Why the ranks down at the decision point ([`Decision::Unhealthy`]) abort it, as the update's
/// report says it.
pub fn unhealthy_why(ranks: &[crate::cluster::RankDown]) -> String {
    let ranks: Vec<String> = ranks.iter().map(ToString::to_string).collect();
    format!("before the commit decision: {}", ranks.join("; "))
}

/// The batches of a rolling update: at most `max_unavailable` replicas at a time, and never all
/// of them while more than one exists (so probes keep being served).
pub fn batches(replicas: &[u32], max_unavailable: u32, dp: u32) -> Vec<Vec<u32>> {
    let size = if dp <= 1 { 1 } else { max_unavailable.clamp(1, dp - 1) } as usize;
    replicas.chunks(size).map(<[u32]>::to_vec).collect()
}

/// How a restarted coordinator treats a replica the journal left mid-update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Commit was decided: drive every rank to that version (never abort).
    FinishCommit { version: String },
    /// No decision was journaled (or abort was): drop whatever is staged.
    AbortStaged,
}

/// The recovery of one replica, from whether the journal holds a commit decision for it that no
/// confirmation followed.
pub fn recovery(decided: Option<&str>) -> Recovery {
    match decided {
        Some(v) => Recovery::FinishCommit { version: v.to_string() },
        None => Recovery::AbortStaged,
    }
}

/// A rank's health: `None` while it runs and heartbeats; else whether it is dead (its process
/// is gone) and why.
pub type RankHealth = Option<crate::cluster::RankDown>;

/// What the health loop does with a replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HealthAction {
    /// Serving and healthy, or owned by an update (unless it serves with a rank down): nothing.
    Keep,
    /// Take it out of rotation (a rank died or stalled), with why.
    Pull { why: String },
    /// Out of rotation, every rank healthy again: finish a pending commit first, if any, then
    /// probe it; it returns to rotation only when the probe passes.
    TryReinstate { finish_commit: Option<String> },
    /// Out of rotation for good: a rank is dead.
    StayOut,
}

/// The health loop's rule for one replica: `serving`, whether an update owns it, the health of
/// each rank (`None`: healthy; `Some(down)`: why not), and a pending commit.
pub fn health_action(serving: bool, owned_by_update: bool, ranks: &[RankHealth], pending_commit: Option<&str>) -> HealthAction {
    let down: Vec<&crate::cluster::RankDown> = ranks.iter().flatten().collect();
    // An update owns the replica: the loop keeps its hands off, but for pulling one that still
    // serves (it stages while it serves) when a rank is down, as a failed routed probe does;
    // the update, or else this loop, proves it again before it serves.
    if owned_by_update && (!serving || down.is_empty()) {
        return HealthAction::Keep;
    }
    match (serving, down.is_empty()) {
        (true, true) => HealthAction::Keep,
        (true, false) => HealthAction::Pull { why: down.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ") },
        (false, _) if down.iter().any(|d| d.is_dead()) => HealthAction::StayOut,
        (false, false) => HealthAction::Keep,
        (false, true) => HealthAction::TryReinstate { finish_commit: pending_commit.map(str::to_string) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holds(active: &str, staged: &str) -> RankView {
        RankView::Holds { active: active.into(), staged: staged.into() }
    }
    fn silent(secs: u64) -> RankView {
        RankView::Silent { for_: Duration::from_secs(secs), why: "deadline exceeded".into() }
    }
    fn dead() -> RankView {
        RankView::Dead { why: "exited (signal 9)".into() }
    }

    /// Every combination of rank views a commit to B can meet, and where it stands.
    #[test]
    fn commit_status_from_a_table_of_rank_views() {
        let limit = Duration::from_secs(20);
        let table: Vec<(Vec<RankView>, CommitStatus)> = vec![
            (vec![holds("B", ""), holds("B", "")], CommitStatus::Done),
            (vec![holds("B", ""), holds("A", "B")], CommitStatus::Pending { ranks: vec![1] }),
            (vec![holds("A", "B"), holds("A", "B")], CommitStatus::Pending { ranks: vec![0, 1] }),
            // SIGSTOPped at the barrier: pending while within the limit, stuck past it.
            (vec![holds("B", ""), silent(3)], CommitStatus::Pending { ranks: vec![1] }),
            (
                vec![holds("B", ""), silent(25)],
                CommitStatus::Stuck { ranks: vec![(1, "did not answer for 25.0 s: deadline exceeded".into())] },
            ),
            (vec![dead(), holds("B", "")], CommitStatus::Stuck { ranks: vec![(0, "dead: exited (signal 9)".into())] }),
            // A rank that lost its staged copy can never reach B.
            (
                vec![holds("B", ""), holds("A", "")],
                CommitStatus::Stuck { ranks: vec![(1, "holds A with nothing staged: it lost the decided version B (restarted?)".into())] },
            ),
            (
                vec![holds("A", "C"), holds("B", "")],
                CommitStatus::Stuck { ranks: vec![(0, "holds A with C staged: it lost the decided version B (restarted?)".into())] },
            ),
        ];
        for (views, want) in table {
            assert_eq!(commit_status("B", &views, limit), want, "{views:?}");
        }
    }

    #[test]
    fn commit_is_decided_only_after_verification_with_every_rank_healthy() {
        let exited = crate::cluster::RankDown::Exited { rank: "rank dp0/tp1".into(), how: "exited (exit status: 1)".into() };
        assert_eq!(decide::<&str>(Ok(()), vec![]), Decision::Commit);
        assert_eq!(decide(Err("probe out of tolerance"), vec![]), Decision::Failed("probe out of tolerance"));
        // A failed verification is the reason even where a rank is down as well.
        assert_eq!(decide(Err("probe out of tolerance"), vec![exited.clone()]), Decision::Failed("probe out of tolerance"));
        assert_eq!(decide::<&str>(Ok(()), vec![exited.clone()]), Decision::Unhealthy { ranks: vec![exited.clone()] });
        assert_eq!(unhealthy_why(&[exited]), "before the commit decision: rank dp0/tp1 exited (exit status: 1)");
    }

    #[test]
    fn batches_never_take_every_replica_at_once() {
        type Case = (Vec<u32>, u32, u32, Vec<Vec<u32>>);
        let table: Vec<Case> = vec![
            (vec![0, 1], 1, 2, vec![vec![0], vec![1]]),
            (vec![0, 1], 5, 2, vec![vec![0], vec![1]]),
            (vec![0, 1, 2], 2, 3, vec![vec![0, 1], vec![2]]),
            (vec![0], 1, 1, vec![vec![0]]),
            (vec![1, 3], 2, 4, vec![vec![1, 3]]),
            (vec![], 1, 2, vec![]),
        ];
        for (replicas, max, dp, want) in table {
            assert_eq!(batches(&replicas, max, dp), want, "{replicas:?} max {max} dp {dp}");
        }
    }

    #[test]
    fn recovery_finishes_a_decided_commit_and_aborts_the_rest() {
        assert_eq!(recovery(Some("B")), Recovery::FinishCommit { version: "B".into() });
        assert_eq!(recovery(None), Recovery::AbortStaged);
    }

    /// Event sequences for one replica through the health loop's rule.
    #[test]
    fn health_drives_rotation() {
        use crate::cluster::RankDown;
        let silent = |presumed_dead| {
            Some(RankDown::Silent {
                rank: "rank dp0/tp1 (worker 1)".into(),
                pid: 7,
                host: "n1".into(),
                device: "cpu".into(),
                silent_s: 4.5,
                presumed_dead,
            })
        };
        let stalled = silent(false);
        let killed = Some(RankDown::Exited { rank: "rank dp0/tp0 (worker 0)".into(), how: "exited (signal 9)".into() });
        let (stalled_why, killed_why) = (
            "rank dp0/tp1 (worker 1) (pid 7 on host n1, cpu) stopped answering: no heartbeat for 4.5 s",
            "rank dp0/tp0 (worker 0) exited (signal 9)",
        );
        type Case<'a> = (bool, bool, Vec<RankHealth>, Option<&'a str>, HealthAction);
        let table: Vec<Case> = vec![
            (true, false, vec![None, None], None, HealthAction::Keep),
            (true, false, vec![None, stalled.clone()], None, HealthAction::Pull { why: stalled_why.into() }),
            (true, false, vec![killed.clone(), None], None, HealthAction::Pull { why: killed_why.into() }),
            // Out and still stalled: wait. Out with a dead rank: out for good.
            (false, false, vec![None, stalled.clone()], None, HealthAction::Keep),
            (false, false, vec![killed.clone(), stalled.clone()], None, HealthAction::StayOut),
            // A remote rank silent long enough to be presumed dead counts as dead.
            (false, false, vec![silent(true), None], None, HealthAction::StayOut),
            // Out and healthy again: a probe decides (finishing a pending commit first).
            (false, false, vec![None, None], None, HealthAction::TryReinstate { finish_commit: None }),
            (false, false, vec![None, None], Some("B"), HealthAction::TryReinstate { finish_commit: Some("B".into()) }),
            // An update owns the replica: the loop keeps its hands off, but for pulling one that
            // still serves (it stages while it serves) with a rank down.
            (false, true, vec![None, killed.clone()], None, HealthAction::Keep),
            (true, true, vec![None, None], None, HealthAction::Keep),
            (true, true, vec![None, killed], None, HealthAction::Pull { why: killed_why.into() }),
            (true, true, vec![stalled, None], None, HealthAction::Pull { why: stalled_why.into() }),
        ];
        for (serving, owned, ranks, pending, want) in table {
            assert_eq!(health_action(serving, owned, &ranks, pending), want, "{serving} {owned} {ranks:?} {pending:?}");
        }
    }
}
