//! Prometheus metrics: the `/metrics` endpoint (`--metrics-listen ADDR`, OpenMetrics text) and
//! this worker's own families.
//!
//! The families are built with `prometheus-client` (the Prometheus project's Rust client:
//! typed label sets, an explicit registry, OpenMetrics encoding). A worker's families carry
//! its replica and tp_rank as labels, so the series of every rank stay apart however the
//! scrape is configured; the coordinator's families (cluster-wide: ranks, versions, updates,
//! routed probes) are in the `orchestrator` binary and use [`serve`] too.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The content type of OpenMetrics text (what Prometheus asks for).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The classic Prometheus text format, for scrapers that do not ask for OpenMetrics.
pub const CLASSIC_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// OpenMetrics text as the classic Prometheus text format (0.0.4): a counter family `x` is
/// named by its sample `x_total` in `# HELP` and `# TYPE`, and there is no `# EOF` (nor
/// `# UNIT`). Everything else is the same in both.
pub fn to_classic(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Encodes a registry as OpenMetrics text.
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, registry);
    text
}

/// Binds `addr` and serves `GET /metrics` with what `render` returns at each scrape (OpenMetrics
/// when the scraper's `Accept` asks for it, as Prometheus does, else the classic text format),
/// until the process ends. Returns the bound address (`:0` picks a port).
pub async fn serve(addr: SocketAddr, render: Arc<dyn Fn() -> String + Send + Sync>) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let render = render.clone();
            async move {
                let wants_openmetrics = headers
                    .get_all(axum::http::header::ACCEPT)
                    .iter()
                    .any(|v| v.to_str().is_ok_and(|v| v.contains("application/openmetrics-text")));
                let text = render();
                if wants_openmetrics {
                    ([(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)], text)
                } else {
                    ([(axum::http::header::CONTENT_TYPE, CLASSIC_CONTENT_TYPE)], to_classic(&text))
                }
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(%bound, "metrics listener ended: {e}");
        }
    });
    Ok(bound)
}

/// Seconds buckets from 1 ms to about 65 s (doubling), for probe and load times.
pub fn seconds_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 17)
}

/// A histogram over [`seconds_buckets`].
pub fn seconds_histogram() -> Histogram {
    Histogram::new(seconds_buckets())
}

/// A float gauge.
pub type FloatGauge = Gauge<f64, AtomicU64>;

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
