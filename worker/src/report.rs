//! What a load reports, per rank: per-tensor kernel and source digests, rank digests, the
//! layout identity, the round-trip verdict and timings, as text or JSON.

use std::fmt::Write as _;
use std::path::PathBuf;

use orchestrator_kernels::Backend;
use serde::Serialize;

use crate::identity::LayoutIdentity;
use crate::loader::{RankWeights, StageTimes, TensorDigest, serialize_hex};
use crate::probe::RankProbe;
use crate::roundtrip::RoundTrip;
use orchestrator_kernels::Digest;

#[derive(Clone, Debug, Serialize)]
pub struct Timings {
    /// Wall time of the load (all layers, in parallel).
    pub load_wall_s: f64,
    /// Per-stage time summed over threads.
    pub stages: StageTimes,
    pub round_trip_s: f64,
    /// Checkpoint bytes read per second of load wall time.
    pub source_gb_per_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct RankReport {
    pub tp_size: usize,
    pub rank: usize,
    pub n_local_heads: usize,
    pub n_local_groups: usize,
    pub device: String,
    pub load_format: String,
    pub source: String,
    pub layout_identity: LayoutIdentity,
    #[serde(serialize_with = "serialize_hex")]
    pub kernel_rank_digest: Digest,
    #[serde(serialize_with = "serialize_hex")]
    pub source_rank_digest: Digest,
    pub kernel_tensors: Vec<TensorDigest>,
    pub source_tensors: Vec<TensorDigest>,
    pub source_bytes: usize,
    pub kernel_bytes: usize,
    pub round_trip: RoundTrip,
    pub timings: Timings,
    pub dump: Option<PathBuf>,
    pub probe: Option<RankProbe>,
}

impl RankReport {
    pub fn new<B: Backend>(
        backend: &B,
        w: &RankWeights<B>,
        round_trip: RoundTrip,
        round_trip_s: f64,
        dump: Option<PathBuf>,
        probe: Option<RankProbe>,
    ) -> Self {
        let wall = w.wall.as_secs_f64();
        Self {
            tp_size: w.shard.tp_size,
            rank: w.shard.rank,
            n_local_heads: w.shard.n_local_heads,
            n_local_groups: w.shard.n_local_groups,
            device: backend.name(),
            load_format: w.load_format.to_string(),
            source: w.source.clone(),
            layout_identity: w.identity.clone(),
            kernel_rank_digest: w.kernel_rank_digest(),
            source_rank_digest: w.source_rank_digest(),
            kernel_tensors: w.kernel_digests().into_iter().cloned().collect(),
            source_tensors: w.source_digests().into_iter().cloned().collect(),
            source_bytes: w.source_bytes(),
            kernel_bytes: w.kernel_bytes(),
            round_trip,
            timings: Timings {
                load_wall_s: wall,
                stages: w.times,
                round_trip_s,
                source_gb_per_s: if wall > 0.0 { w.source_bytes() as f64 / wall / 1e9 } else { 0.0 },
            },
            dump,
            probe,
        }
    }

    /// Round trip holds and, when a probe ran, it passed.
    pub fn ok(&self) -> bool {
        self.round_trip.ok && self.probe.as_ref().is_none_or(|p| p.ok)
    }

    /// Human-readable report.
    pub fn render(&self, verbose_tensors: bool) -> String {
        let mut s = String::new();
        let id = &self.layout_identity;
        let _ = writeln!(
            s,
            "rank {}/{}  heads {}  groups {}  device {}  load {} from {}",
            self.rank, self.tp_size, self.n_local_heads, self.n_local_groups, self.device, self.load_format, self.source
        );
        let _ = writeln!(
            s,
            "  layout identity {}  (layout v{}, {} heads x {} dims, q_lora {}, o_lora {}, {} layers, {}, scale rule {})",
            id.digest,
            id.layout_version,
            id.geometry.heads,
            id.geometry.head_dim,
            id.geometry.q_lora_rank,
            id.geometry.o_lora_rank,
            id.geometry.layers,
            id.weight_format,
            id.scale_rule
        );
        if verbose_tensors {
            for t in &self.kernel_tensors {
                let _ = writeln!(s, "  {:<42} {:<8} {:<20} {}", t.name, t.dtype, format!("{:?}", t.shape), t.digest);
            }
        }
        let _ = writeln!(s, "  kernel digest {}   source digest {}", self.kernel_rank_digest, self.source_rank_digest);
        let rt = if self.round_trip.ok {
            format!("ok ({} tensors reproduce the checkpoint-order slice)", self.round_trip.checked)
        } else {
            format!("FAILED ({} of {} tensors)", self.round_trip.failures.len(), self.round_trip.checked)
        };
        let _ = writeln!(s, "  round trip: {rt}");
        for f in &self.round_trip.failures {
            let _ = writeln!(s, "    {f}");
        }
        let t = &self.timings;
        let _ = writeln!(
            s,
            "  timings: load {:.3} s wall ({:.2} GB/s of checkpoint slice; thread time read {:.3} s, pipeline {:.3} s, digests {:.3} s), round trip {:.3} s",
            t.load_wall_s, t.source_gb_per_s, t.stages.read_s, t.stages.pipeline_s, t.stages.digest_s, t.round_trip_s
        );
        if let Some(p) = &self.probe {
            let s_ = &mut s;
            let _ = writeln!(
                s_,
                "  probe T={} S={} seed={}: {} ({} layers; q {} of {} values differ from the permuted reference; z max err {:.3e} abs, {:.3e} rel, tolerance {:e}; y_partial max err {:.3e} abs, {:.3e} rel)",
                p.spec.tokens,
                p.spec.latents,
                p.spec.seed,
                if p.ok { "PASS" } else { "FAIL" },
                p.layers.len(),
                p.layers.iter().map(|l| l.q_mismatches).sum::<usize>(),
                p.q_values * p.layers.len(),
                p.z_max_abs_err,
                p.z_max_rel_err,
                crate::probe::Z_TOLERANCE,
                p.y_max_abs_err,
                p.y_max_rel_err
            );
            let _ = writeln!(
                s_,
                "  probe y_partial digest {}  (kernel pass {:.3} s, reference {:.3} s)",
                p.y_partial_digest, p.kernel_s, p.reference_s
            );
            for l in p.layers.iter().filter(|l| !l.ok) {
                let _ = writeln!(
                    s_,
                    "    layer {}: q mismatches {}, z max err {:.3e} abs / {:.3e} rel",
                    l.layer, l.q_mismatches, l.z_max_abs_err, l.z_max_rel_err
                );
            }
        }
        if let Some(d) = &self.dump {
            let _ = writeln!(s, "  dump: {}", d.display());
        }
        s
    }
}
