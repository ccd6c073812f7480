//! Prometheus exposition shared by both binaries: the `/metrics` endpoint (`--metrics-listen
//! ADDR`, OpenMetrics text, or the classic text format for scrapers that do not ask for it), the
//! encoding of a registry, and the building blocks both binaries' families use (seconds buckets, a
//! float gauge). The families themselves are each binary's own (the worker's per rank, the
//! coordinator's cluster-wide), built with `prometheus-client` (the Prometheus project's Rust
//! client: typed label sets, an explicit registry, OpenMetrics encoding).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

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
