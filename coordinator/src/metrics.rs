//! The coordinator's Prometheus families (`--metrics-listen ADDR` on `launch` and
//! `coordinator`): ranks registered and up, the version each replica serves, rolling updates
//! and their progress, verification failures by rule, routed probes and their latency, and
//! every rank's last load time as its reports give it.
//!
//! Events (an update ending, a routed probe, a failed verification) count where they happen;
//! what is state (versions, rotation, registrations) is read from the session at each scrape,
//! so a scrape never shows a version a replica no longer serves.

use std::sync::OnceLock;

use orchestrator_ops::metrics::{FloatGauge, encode, seconds_histogram};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::consistency::RankRow;
use crate::session::Session;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabels {
    pub replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaVersionLabels {
    pub replica: String,
    pub version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankLabels {
    pub replica: String,
    pub tp_rank: String,
    pub host: String,
    pub path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabels {
    pub rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeLabels {
    pub replica: String,
    pub version: String,
    pub outcome: String,
}

/// The coordinator's families.
pub struct Metrics {
    registry: Registry,
    pub ranks_expected: Gauge,
    pub ranks_registered: Gauge,
    pub ranks_up: Family<ReplicaLabels, Gauge>,
    pub replica_version: Family<ReplicaVersionLabels, Gauge>,
    pub replica_in_rotation: Family<ReplicaLabels, Gauge>,
    pub rank_load_seconds: Family<RankLabels, FloatGauge>,
    pub updates: Family<OutcomeLabels, Counter>,
    pub update_duration: Histogram,
    pub update_in_progress: Gauge,
    pub update_replicas_total: Gauge,
    pub update_replicas_done: Gauge,
    pub verification_failures: Family<RuleLabels, Counter>,
    pub routed_probes: Family<ProbeLabels, Counter>,
    pub routed_probe_latency: Histogram,
}

impl Metrics {
    fn new() -> Self {
        let mut r = Registry::with_prefix("orchestrator");
        let m = Self {
            registry: Registry::default(),
            ranks_expected: Gauge::default(),
            ranks_registered: Gauge::default(),
            ranks_up: Family::default(),
            replica_version: Family::default(),
            replica_in_rotation: Family::default(),
            rank_load_seconds: Family::default(),
            updates: Family::default(),
            // Updates take seconds to hours: 0.25 s doubling to about 4.5 h.
            update_duration: Histogram::new(exponential_buckets(0.25, 2.0, 17)),
            update_in_progress: Gauge::default(),
            update_replicas_total: Gauge::default(),
            update_replicas_done: Gauge::default(),
            verification_failures: Family::default(),
            routed_probes: Family::default(),
            routed_probe_latency: seconds_histogram(),
        };
        r.register("ranks_expected", "Ranks the plan has (TP x DP)", m.ranks_expected.clone());
        r.register("ranks_registered", "Ranks whose worker registered", m.ranks_registered.clone());
        r.register("ranks_up", "Ranks answering their heartbeats, per replica", m.ranks_up.clone());
        r.register("replica_version_info", "1 for the checkpoint version each replica's ranks agree on", m.replica_version.clone());
        r.register("replica_in_rotation", "1 while the replica serves routed probes", m.replica_in_rotation.clone());
        r.register("rank_load_seconds", "Each rank's last load (or staged load) as its report gives it", m.rank_load_seconds.clone());
        r.register("weight_updates", "Rolling weight updates by outcome (ok, failed, refused)", m.updates.clone());
        r.register("weight_update_duration_seconds", "Wall seconds of rolling weight updates", m.update_duration.clone());
        r.register("weight_update_in_progress", "1 while a rolling weight update runs", m.update_in_progress.clone());
        r.register("weight_update_replicas", "Replicas the running (or last) update rolls", m.update_replicas_total.clone());
        r.register(
            "weight_update_replicas_done",
            "Replicas the running (or last) update swapped to its new version",
            m.update_replicas_done.clone(),
        );
        r.register(
            "verification_failures",
            "Failed verifications of staged versions and reports, by rule",
            m.verification_failures.clone(),
        );
        r.register("routed_probes", "Routed probes by replica, version and outcome (ok, failed)", m.routed_probes.clone());
        r.register("routed_probe_duration_seconds", "Latency of routed probes, end to end", m.routed_probe_latency.clone());
        Self { registry: r, ..m }
    }

    /// Reads what is state from the session, then encodes every family.
    pub fn render(&self, session: Option<&Session>) -> String {
        if let Some(s) = session {
            self.refresh(s);
        }
        encode(&self.registry)
    }

    fn refresh(&self, session: &Session) {
        let cluster = &session.cluster;
        let world = cluster.tp * cluster.dp;
        self.ranks_expected.set(world as i64);
        self.ranks_registered.set((0..world).filter(|&id| cluster.registry.get(id).is_some()).count() as i64);
        self.replica_version.clear();
        for (dp, st) in session.rotation.states().iter().enumerate() {
            let replica = dp.to_string();
            if !st.version.is_empty() {
                self.replica_version.get_or_create(&ReplicaVersionLabels { replica: replica.clone(), version: st.version.clone() }).set(1);
            }
            self.replica_in_rotation.get_or_create(&ReplicaLabels { replica }).set(st.serving as i64);
        }
    }

    /// The health loop's count of the ranks of `dp` that are up.
    pub fn set_up(&self, dp: u32, up: usize) {
        self.ranks_up.get_or_create(&ReplicaLabels { replica: dp.to_string() }).set(up as i64);
    }

    /// Every rank's load time from a report's rows.
    pub fn rows(&self, rows: &[RankRow]) {
        self.rank_load_seconds.clear();
        for r in rows.iter().filter(|r| r.failure.is_none()) {
            let labels =
                RankLabels { replica: r.dp.to_string(), tp_rank: r.tp.to_string(), host: r.host.clone(), path: r.load_path.clone() };
            self.rank_load_seconds.get_or_create(&labels).set(r.load_seconds);
        }
    }

    pub fn verification_failed(&self, rule: &str) {
        self.verification_failures.get_or_create(&RuleLabels { rule: rule.to_string() }).inc();
    }

    pub fn update_started(&self, replicas: usize) {
        self.update_in_progress.set(1);
        self.update_replicas_total.set(replicas as i64);
        self.update_replicas_done.set(0);
    }

    pub fn update_replica_done(&self) {
        self.update_replicas_done.inc();
    }

    pub fn update_ended(&self, outcome: &str, seconds: f64) {
        self.update_in_progress.set(0);
        self.updates.get_or_create(&OutcomeLabels { outcome: outcome.to_string() }).inc();
        self.update_duration.observe(seconds);
    }

    pub fn routed_probe(&self, replica: Option<u32>, version: &str, ok: bool, seconds: f64) {
        let labels = ProbeLabels {
            replica: replica.map_or_else(|| "none".to_string(), |dp| dp.to_string()),
            version: version.to_string(),
            outcome: if ok { "ok" } else { "failed" }.to_string(),
        };
        self.routed_probes.get_or_create(&labels).inc();
        self.routed_probe_latency.observe(seconds);
    }
}

/// The process's coordinator families.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_families_encode_with_ecosystem_names() {
        let m = Metrics::new();
        m.update_started(2);
        m.update_replica_done();
        m.update_ended("ok", 3.0);
        m.verification_failed("replica_digests");
        m.routed_probe(Some(1), "abc", true, 0.02);
        m.routed_probe(None, "", false, 0.001);
        let text = m.render(None);
        for line in [
            "orchestrator_weight_updates_total{outcome=\"ok\"} 1",
            "orchestrator_weight_update_duration_seconds_count 1",
            "orchestrator_weight_update_replicas_done 1",
            "orchestrator_verification_failures_total{rule=\"replica_digests\"} 1",
            "orchestrator_routed_probes_total{replica=\"1\",version=\"abc\",outcome=\"ok\"} 1",
            "orchestrator_routed_probes_total{replica=\"none\",version=\"\",outcome=\"failed\"} 1",
            "orchestrator_routed_probe_duration_seconds_count 2",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line} in\n{text}");
        }
    }
}
