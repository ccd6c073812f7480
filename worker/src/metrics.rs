//! This worker's Prometheus families, served at `/metrics` (`--metrics-listen ADDR`) by
//! `orchestrator_ops::metrics::serve`.
//!
//! A worker's families carry its replica and tp_rank as labels, so the series of every rank
//! stay apart however the scrape is configured; the coordinator's families (cluster-wide: ranks,
//! versions, updates, routed probes) are the coordinator's own.

use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use orchestrator_ops::metrics::{FloatGauge, encode, seconds_histogram};

/// Where a load's bytes came from: `real` (a checkpoint), `dummy` (generated), `stage` (a
/// rolling update's new version, loaded beside the serving one).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoadLabels {
    pub replica: String,
    pub tp_rank: String,
    pub path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeLabels {
    pub replica: String,
    pub tp_rank: String,
    pub version: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VersionLabels {
    pub replica: String,
    pub tp_rank: String,
    pub version: String,
}

/// This worker's families.
pub struct WorkerMetrics {
    registry: Registry,
    /// Wall seconds of the last load, by path.
    pub load_seconds: Family<LoadLabels, FloatGauge>,
    pub load_bytes: Family<LoadLabels, Counter>,
    pub loads: Family<LoadLabels, Counter>,
    /// Probes this rank ran (kernel pass and, when asked, the reference), by outcome.
    pub probes: Family<ProbeLabels, Counter>,
    pub probe_seconds: Histogram,
    /// 1 for the version this rank serves.
    pub version: Family<VersionLabels, Gauge>,
}

impl WorkerMetrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("orchestrator_worker");
        let m = Self {
            registry: Registry::default(),
            load_seconds: Family::default(),
            load_bytes: Family::default(),
            loads: Family::default(),
            probes: Family::default(),
            probe_seconds: seconds_histogram(),
            version: Family::default(),
        };
        registry.register("load_seconds", "Wall seconds of this rank's last load, by load path", m.load_seconds.clone());
        registry.register("load_bytes", "Checkpoint bytes this rank loaded, by load path", m.load_bytes.clone());
        registry.register("loads", "Loads this rank finished, by load path", m.loads.clone());
        registry.register("probes", "Probes this rank ran, by version and outcome (ok, failed)", m.probes.clone());
        registry.register("probe_duration_seconds", "Seconds of this rank's probe passes", m.probe_seconds.clone());
        registry.register("version_info", "1 for the checkpoint version this rank serves", m.version.clone());
        Self { registry, ..m }
    }

    /// Records a finished load.
    pub fn loaded(&self, replica: usize, tp_rank: usize, path: &str, seconds: f64, bytes: usize) {
        let labels = LoadLabels { replica: replica.to_string(), tp_rank: tp_rank.to_string(), path: path.to_string() };
        self.load_seconds.get_or_create(&labels).set(seconds);
        self.load_bytes.get_or_create(&labels).inc_by(bytes as u64);
        self.loads.get_or_create(&labels).inc();
    }

    /// Sets the version this rank serves (the one series of the info gauge).
    pub fn serving(&self, replica: usize, tp_rank: usize, version: &str) {
        self.version.clear();
        let labels = VersionLabels { replica: replica.to_string(), tp_rank: tp_rank.to_string(), version: version.to_string() };
        self.version.get_or_create(&labels).set(1);
    }

    pub fn probed(&self, replica: usize, tp_rank: usize, version: &str, ok: bool, seconds: f64) {
        let labels = ProbeLabels {
            replica: replica.to_string(),
            tp_rank: tp_rank.to_string(),
            version: version.to_string(),
            outcome: if ok { "ok" } else { "failed" }.to_string(),
        };
        self.probes.get_or_create(&labels).inc();
        self.probe_seconds.observe(seconds);
    }

    pub fn render(&self) -> String {
        encode(&self.registry)
    }
}

/// The process's worker families.
pub fn worker() -> &'static WorkerMetrics {
    static METRICS: OnceLock<WorkerMetrics> = OnceLock::new();
    METRICS.get_or_init(WorkerMetrics::new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use orchestrator_ops::metrics::to_classic;

    #[test]
    fn the_worker_families_encode_with_their_labels() {
        let m = WorkerMetrics::new();
        m.loaded(1, 0, "stage", 0.25, 1000);
        m.serving(1, 0, "v1");
        m.serving(1, 0, "v2");
        m.probed(1, 0, "v2", true, 0.01);
        let text = m.render();
        assert!(text.contains("orchestrator_worker_load_seconds{replica=\"1\",tp_rank=\"0\",path=\"stage\"} 0.25"), "{text}");
        assert!(text.contains("orchestrator_worker_load_bytes_total{replica=\"1\",tp_rank=\"0\",path=\"stage\"} 1000"), "{text}");
        // Only the served version has a series.
        assert!(text.contains("orchestrator_worker_version_info{replica=\"1\",tp_rank=\"0\",version=\"v2\"} 1"), "{text}");
        assert!(!text.contains("version=\"v1\""), "{text}");
        assert!(text.contains("orchestrator_worker_probe_duration_seconds_count 1"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        let classic = to_classic(&text);
        assert!(classic.contains("# TYPE orchestrator_worker_load_bytes_total counter\n"), "{classic}");
        assert!(classic.contains("# HELP orchestrator_worker_load_bytes_total Checkpoint bytes"), "{classic}");
        assert!(classic.contains("# TYPE orchestrator_worker_load_seconds gauge\n"), "{classic}");
        assert!(!classic.contains("# EOF"), "{classic}");
        // Only the comment lines change.
        let samples = |t: &str| t.lines().filter(|l| !l.starts_with('#')).map(String::from).collect::<Vec<_>>();
        assert_eq!(samples(&classic), samples(&text));
    }
}
