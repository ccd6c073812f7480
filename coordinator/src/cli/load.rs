//! Routed-probe load through a served cluster's rotation: a fixed rate for a fixed time (the
//! `probe` command and the update benchmark), back-to-back probes to measure capacity, and
//! the percentiles both report.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use orchestrator_net::auth::Token;
use orchestrator_proto::v1 as pb;
use orchestrator_proto::v1::coordinator_client::CoordinatorClient;
use orchestrator_worker::probe::ProbeSpec;
use tonic::transport::Channel;

/// Served and failed probes of one replica or version.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
pub struct Counts {
    pub served: u64,
    pub failed: u64,
}

/// Latency percentiles in milliseconds (nearest rank).
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// What `orchestrator probe --json` prints.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
pub struct ProbeDocument {
    /// No probe failed.
    pub ok: bool,
    pub served: u64,
    pub failed: u64,
    pub seconds: f64,
    pub latency_ms: Latency,
    /// By replica (`dp0`, ...; `-` when the call itself failed).
    pub by_replica: BTreeMap<String, Counts>,
    /// By the version the replica's ranks probed (`-` when the call itself failed).
    pub by_version: BTreeMap<String, Counts>,
    /// The first ten errors.
    pub errors: Vec<String>,
}

impl ProbeDocument {
    pub fn of(samples: &[Sample], seconds: f64) -> Self {
        let latencies: Vec<f64> = samples.iter().map(|s| s.ms).collect();
        let to_counts =
            |m: BTreeMap<String, (u64, u64)>| m.into_iter().map(|(k, (served, failed))| (k, Counts { served, failed })).collect();
        let by_replica: BTreeMap<String, Counts> = to_counts(counts(samples, |s| s.replica.clone()));
        let failed = by_replica.values().map(|c| c.failed).sum();
        let served = by_replica.values().map(|c| c.served).sum();
        let pct = |q| percentile(&latencies, q);
        Self {
            ok: failed == 0,
            served,
            failed,
            seconds,
            latency_ms: Latency { p50: pct(0.5), p90: pct(0.9), p99: pct(0.99), max: pct(1.0) },
            by_replica,
            by_version: to_counts(counts(samples, |s| s.version.clone())),
            errors: samples.iter().filter(|s| !s.ok).take(10).map(|s| s.error.clone()).collect(),
        }
    }
}

/// One routed probe as the client saw it.
#[derive(Clone, Debug)]
pub struct Sample {
    /// When it was sent, from the start of the load.
    pub sent: Duration,
    pub ms: f64,
    pub ok: bool,
    pub replica: String,
    pub version: String,
    pub error: String,
}

fn request(spec: ProbeSpec, token: Option<&Token>) -> tonic::Request<pb::RoutedProbeRequest> {
    orchestrator_net::auth::request(
        pb::RoutedProbeRequest { tokens: spec.tokens as u32, latents: spec.latents as u32, seed: spec.seed },
        Duration::from_secs(60),
        token,
    )
}

async fn one(mut client: CoordinatorClient<Channel>, spec: ProbeSpec, token: Option<Token>, sent: Duration) -> Sample {
    let t = Instant::now();
    let r = client.routed_probe(request(spec, token.as_ref())).await;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    match r {
        Ok(p) => {
            let p = p.into_inner();
            Sample { sent, ms, ok: p.ok, replica: format!("dp{}", p.replica), version: p.checkpoint_version, error: p.error }
        }
        Err(s) => Sample { sent, ms, ok: false, replica: "-".into(), version: "-".into(), error: s.message().to_string() },
    }
}

/// `rate` probes a second for `duration`, each sent on time whatever the others are doing.
pub async fn at_rate(
    client: &CoordinatorClient<Channel>,
    token: Option<&Token>,
    spec: ProbeSpec,
    rate: f64,
    duration: Duration,
) -> Vec<Sample> {
    at_rate_until(client, token, spec, rate, duration, None).await
}

/// [`at_rate`], sending no more once `stop` is set (the probes in flight are awaited).
pub async fn at_rate_until(
    client: &CoordinatorClient<Channel>,
    token: Option<&Token>,
    spec: ProbeSpec,
    rate: f64,
    duration: Duration,
    stop: Option<&std::sync::atomic::AtomicBool>,
) -> Vec<Sample> {
    let count = (rate * duration.as_secs_f64()).ceil() as usize;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..count {
        tokio::time::sleep_until(start + interval * i as u32).await;
        if stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst)) {
            break;
        }
        tasks.spawn(one(client.clone(), spec, token.cloned(), start.elapsed()));
    }
    let mut samples = Vec::new();
    while let Some(s) = tasks.join_next().await {
        if let Ok(s) = s {
            samples.push(s);
        }
    }
    samples.sort_by_key(|s| s.sent);
    samples
}

/// Probes served per second with `concurrency` probes always in flight, over `duration`.
pub async fn capacity(
    client: &CoordinatorClient<Channel>,
    token: Option<&Token>,
    spec: ProbeSpec,
    concurrency: usize,
    duration: Duration,
) -> f64 {
    let start = Instant::now();
    let workers = (0..concurrency.max(1)).map(|_| {
        let (client, token) = (client.clone(), token.cloned());
        async move {
            let mut served = 0u64;
            while start.elapsed() < duration {
                if one(client.clone(), spec, token.clone(), start.elapsed()).await.ok {
                    served += 1;
                }
            }
            served
        }
    });
    let served: u64 = futures_util::future::join_all(workers).await.into_iter().sum();
    served as f64 / start.elapsed().as_secs_f64()
}

/// The `q` quantile of `values` (nearest rank; 0 when empty).
pub fn percentile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Served and failed counts by a key of each sample.
pub fn counts(samples: &[Sample], key: impl Fn(&Sample) -> String) -> BTreeMap<String, (u64, u64)> {
    let mut m: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for s in samples {
        let e = m.entry(key(s)).or_default();
        if s.ok {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!((percentile(&v, 0.5), percentile(&v, 0.99), percentile(&v, 1.0)), (50.0, 99.0, 100.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[7.0], 0.01), 7.0);
    }
}
