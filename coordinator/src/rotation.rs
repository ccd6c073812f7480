//! Which replicas serve routed probes, and what their ranks last said they hold.
//!
//! The version of a replica here is never the coordinator's own bookkeeping: it is set only
//! from what the replica's ranks answered (a probe, a commit, a report), and a replica serves
//! only while its ranks agreed on one version at their last answer. A replica leaves rotation
//! when a rank dies, stalls or fails a probe (with the reason), and returns only after a passing
//! probe; an update owns the replicas it works on and the health loop keeps its hands off them.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use serde::Serialize;

/// One replica's place in the rotation.
#[derive(Clone, Debug, Default, Serialize, schemars::JsonSchema)]
pub struct ReplicaState {
    pub serving: bool,
    /// The version every rank said it holds at their last agreeing answer (empty: unknown).
    pub version: String,
    /// Why it is out of rotation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out: Option<String>,
    /// An update is working on it (staging, verifying, committing).
    #[serde(skip)]
    pub owned_by_update: bool,
    /// A decided commit that not every rank has confirmed yet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending_commit: Option<String>,
    /// A rank is dead: out for good.
    pub dead: bool,
    #[serde(skip)]
    pub last_attempt: Option<Instant>,
    /// Routed probes sent to the replica and not yet answered (see [`Rotation::drain`]).
    #[serde(skip)]
    pub in_flight: u32,
}

/// A routed probe on replica `dp`, counted as in flight there until dropped.
pub struct ProbeSlot<'a> {
    rotation: &'a Rotation,
    pub dp: u32,
}

impl Drop for ProbeSlot<'_> {
    fn drop(&mut self) {
        self.rotation.with(|r| r[self.dp as usize].in_flight -= 1);
    }
}

pub struct Rotation {
    replicas: Mutex<Vec<ReplicaState>>,
    next: AtomicUsize,
}

impl Rotation {
    /// Every replica serving `version` (each rank just reported it after loading).
    pub fn new(versions: Vec<String>) -> Self {
        let replicas = versions.into_iter().map(|version| ReplicaState { serving: true, version, ..Default::default() }).collect();
        Self { replicas: Mutex::new(replicas), next: AtomicUsize::new(0) }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Vec<ReplicaState>) -> T) -> T {
        f(&mut self.replicas.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn state(&self, dp: u32) -> ReplicaState {
        self.with(|r| r[dp as usize].clone())
    }

    pub fn states(&self) -> Vec<ReplicaState> {
        self.with(|r| r.clone())
    }

    /// The version the replica's ranks last agreed on.
    pub fn version(&self, dp: u32) -> String {
        self.with(|r| r[dp as usize].version.clone())
    }

    /// The next replica in rotation (round robin) that is not in `tried`, if any serves (a probe
    /// begun and answered at once).
    #[cfg(test)]
    pub fn pick_except(&self, tried: &[u32]) -> Option<u32> {
        self.begin_probe(tried).map(|slot| slot.dp)
    }

    /// Picks the next replica in rotation (round robin) that is not in `tried`, and counts a
    /// routed probe on it until the returned slot is dropped: picked and counted under one lock,
    /// so that once [`Rotation::drain`] has seen no probe on a replica out of rotation, none
    /// starts there.
    pub fn begin_probe(&self, tried: &[u32]) -> Option<ProbeSlot<'_>> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let dp = self.with(|r| {
            let n = r.len();
            let dp = (0..n).map(|i| (start + i) % n).find(|&i| r[i].serving && !tried.contains(&(i as u32)))?;
            r[dp].in_flight += 1;
            Some(dp as u32)
        })?;
        Some(ProbeSlot { rotation: self, dp })
    }

    /// Waits until no routed probe runs on replica `dp` (taken out of rotation first, so that
    /// none starts), for at most `limit`: whether it drained. A probe that outlived the limit and
    /// meets a swap is still caught: its ranks disagree, and it is retried elsewhere.
    pub async fn drain(&self, dp: u32, limit: std::time::Duration) -> bool {
        let started = Instant::now();
        loop {
            if self.with(|r| r[dp as usize].in_flight) == 0 {
                return true;
            }
            if started.elapsed() >= limit {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }

    /// Takes a replica out of rotation, with why. Returns whether it was serving.
    pub fn pull(&self, dp: u32, why: &str) -> bool {
        self.with(|r| {
            let s = &mut r[dp as usize];
            let was = s.serving;
            s.serving = false;
            s.out = Some(why.to_string());
            was
        })
    }

    /// A replica marked dead whose every rank answers again, the same processes (a remote rank
    /// presumed dead after a long silence that was only stopped, frozen or cut off): no longer
    /// dead, still out of rotation until a probe passes. Returns whether it was dead.
    pub fn revive(&self, dp: u32) -> bool {
        self.with(|r| {
            let s = &mut r[dp as usize];
            let was = s.dead;
            if was {
                s.dead = false;
                s.out = Some("its ranks answer again after it was presumed dead".into());
            }
            was
        })
    }

    /// Marks a replica dead (a rank's process is gone): out for good.
    pub fn mark_dead(&self, dp: u32, why: &str) {
        self.with(|r| {
            let s = &mut r[dp as usize];
            s.serving = false;
            s.dead = true;
            s.out = Some(why.to_string());
        })
    }

    /// An update takes the replica (out of rotation when `out`: with one replica it keeps
    /// serving its active weights while the new ones are staged beside them).
    pub fn take_for_update(&self, dp: u32, out: bool) {
        self.with(|r| {
            let s = &mut r[dp as usize];
            s.owned_by_update = true;
            if out {
                s.serving = false;
                s.out = Some("updating".into());
            }
        })
    }

    /// The update is done with the replica (whatever it left is the health loop's).
    pub fn release(&self, dp: u32) {
        self.with(|r| r[dp as usize].owned_by_update = false)
    }

    /// Records a decided commit that is not yet confirmed by every rank (`None`: confirmed).
    pub fn set_pending_commit(&self, dp: u32, version: Option<String>) {
        self.with(|r| r[dp as usize].pending_commit = version)
    }

    /// Back into rotation, on the version its ranks just agreed on (after a passing probe).
    /// `by_update`: the update that owns the replica puts it back; otherwise (the health loop)
    /// a replica an update took meanwhile, or one with a dead rank or an unconfirmed commit,
    /// stays out. Returns whether it serves now.
    pub fn reinstate(&self, dp: u32, version: &str, by_update: bool) -> bool {
        self.with(|r| {
            let s = &mut r[dp as usize];
            if !by_update && (s.owned_by_update || s.dead || s.pending_commit.is_some()) {
                return false;
            }
            s.serving = true;
            s.out = None;
            s.version = version.to_string();
            true
        })
    }

    /// The version the ranks agreed on in an answer (their replica may still be out).
    pub fn observed_version(&self, dp: u32, version: &str) {
        self.with(|r| r[dp as usize].version = version.to_string())
    }

    /// Whether a reinstatement attempt is due (at most one per backoff), and marks it started.
    pub fn attempt_due(&self, dp: u32, backoff: std::time::Duration) -> bool {
        self.with(|r| {
            let s = &mut r[dp as usize];
            if s.last_attempt.is_some_and(|t| t.elapsed() < backoff) {
                return false;
            }
            s.last_attempt = Some(Instant::now());
            true
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pick_skips_replicas_out_of_rotation_and_reinstated_ones_return() {
        let r = Rotation::new(vec!["a".into(), "a".into(), "a".into()]);
        let picks: Vec<u32> = (0..3).filter_map(|_| r.pick_except(&[])).collect();
        assert_eq!(picks, [0, 1, 2]);
        assert!(r.pull(1, "rank dp1/tp0 stopped answering"));
        assert!(!r.pull(1, "again"), "already out");
        let picks: Vec<u32> = (0..4).filter_map(|_| r.pick_except(&[])).collect();
        assert!(!picks.contains(&1), "{picks:?}");
        assert!(r.reinstate(1, "b", false));
        assert_eq!((r.state(1).serving, r.version(1), r.state(1).out), (true, "b".to_string(), None));
        r.mark_dead(0, "exited");
        assert!(!r.reinstate(0, "b", false), "a replica with a dead rank stays out");
        r.take_for_update(2, true);
        assert!(!r.reinstate(2, "b", false), "the health loop leaves an update's replica alone");
        assert!(r.reinstate(2, "b", true));
        r.release(2);
        r.pull(2, "probe failed");
        assert_eq!(r.pick_except(&[]), Some(1));
        assert_eq!(r.pick_except(&[]), Some(1));
        r.pull(1, "x");
        assert_eq!(r.pick_except(&[]), None);
        // A retry skips the replicas it tried.
        let r = Rotation::new(vec!["a".into(), "a".into(), "a".into()]);
        r.pull(1, "x");
        let first = r.pick_except(&[]).unwrap();
        let second = r.pick_except(&[first]).unwrap();
        assert!(first != 1 && second != 1 && first != second, "{first} {second}");
        assert_eq!(r.pick_except(&[first, second]), None);
    }

    #[tokio::test]
    async fn a_replica_drains_once_its_routed_probes_are_answered() {
        let r = Rotation::new(vec!["a".into(), "a".into()]);
        let on_0 = r.begin_probe(&[1]).unwrap();
        let on_1 = r.begin_probe(&[0]).unwrap();
        assert_eq!((on_0.dp, on_1.dp, r.state(0).in_flight, r.state(1).in_flight), (0, 1, 1, 1));
        r.take_for_update(0, true);
        assert!(r.begin_probe(&[1]).is_none(), "no probe starts on a replica out of rotation");
        assert!(!r.drain(0, std::time::Duration::from_millis(20)).await, "a probe still runs on dp0");
        drop(on_0);
        assert!(r.drain(0, std::time::Duration::ZERO).await);
        assert_eq!(r.state(1).in_flight, 1, "dp1's probe is its own");
        drop(on_1);
        assert_eq!(r.state(1).in_flight, 0);
    }
}
