//! The consistency report as text: a line per rank, per host, per replica out of rotation, per
//! rule with its findings, then the verdict.

use std::fmt::Write as _;

use super::{ConsistencyReport, ProbeCell};

impl ConsistencyReport {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "consistency report: TP {} x DP {}, {}", self.tp_size, self.dp_size, self.source);
        let _ = writeln!(
            s,
            "{:<3} {:<3} {:<12} {:<6} {:<11} {:<16} {:<16} {:<10} {:<22} {:>7}  verdict",
            "dp", "tp", "host", "device", "format", "ckpt version", "rank digest", "round trip", "probe z err / q diff", "load s"
        );
        for r in &self.ranks {
            let probe = match &r.probe {
                Some(ProbeCell { verified_by_replica: Some(e), .. }) => format!("= dp{e} (identical)"),
                Some(p) => format!("{:.1e} / {}", p.z_max_abs_err, p.q_mismatches),
                None => "-".into(),
            };
            let _ = writeln!(
                s,
                "{:<3} {:<3} {:<12} {:<6} {:<11} {:<16} {:<16} {:<10} {:<22} {:>7.2}  {}{}{}",
                r.dp,
                r.tp,
                truncate(&r.host, 12),
                r.device,
                r.load_format,
                r.checkpoint_version,
                r.kernel_rank_digest,
                if r.failure.is_some() {
                    "-".to_string()
                } else if !r.round_trip_ok {
                    "FAILED".to_string()
                } else if r.round_trip_identical_to.is_empty() {
                    "ok".to_string()
                } else {
                    format!("= {}", r.round_trip_identical_to)
                },
                probe,
                r.load_seconds,
                r.verdict,
                if r.staged_version.is_empty() { String::new() } else { format!(" (staged {})", r.staged_version) },
                r.failure.as_ref().map(|f| format!(" ({f})")).unwrap_or_default()
            );
        }
        for h in &self.hosts {
            let ranks: Vec<String> = h.ranks.iter().map(|r| format!("dp{}/tp{}", r.dp, r.tp)).collect();
            let _ = writeln!(
                s,
                "host {}: {} rank{} ({}), {} ok, {} failed, load {:.2} s",
                h.host,
                h.ranks.len(),
                if h.ranks.len() == 1 { "" } else { "s" },
                ranks.join(" "),
                h.ok,
                h.failed,
                h.load_seconds
            );
        }
        for (dp, r) in self.replicas.iter().enumerate() {
            if let Some(out) = &r.out {
                let pending = r.pending_commit.as_ref().map(|v| format!(" (commit to {v} pending)")).unwrap_or_default();
                let _ = writeln!(s, "replica dp{dp}: out of rotation{pending}: {out}");
            }
        }
        for rule in &self.rules {
            let _ = writeln!(s, "[{}] {}", if rule.ok { " ok " } else { "FAIL" }, rule.rule);
            for f in &rule.findings {
                let _ = writeln!(s, "       {f}");
            }
        }
        for note in &self.notes {
            let _ = writeln!(s, "note: {note}");
        }
        if !self.timings.is_empty() {
            let parts: Vec<String> = self.timings.iter().map(|(k, v)| format!("{k} {v:.2} s")).collect();
            let _ = writeln!(s, "timings: {}", parts.join(", "));
        }
        let _ = writeln!(
            s,
            "{}",
            if self.ok { "CONSISTENT: every rank holds what its kernels expect" } else { "INCONSISTENT: see the failed rules above" }
        );
        s
    }
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}
