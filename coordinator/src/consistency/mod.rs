//! The consistency report: one row per rank and a verdict per cross-rank rule. A disagreement
//! names the ranks, the tensor and the rule.
//!
//! - here: the report's types (rows, probe cells, failures, findings, rules, host summaries)
//!   and the rows built from the ranks' answers;
//! - `rules`: [`evaluate`], every cross-rank rule over the rows, as typed findings;
//! - `render`: the report as text (`--json` writes the same types with serde).

mod render;
mod rules;

pub use rules::evaluate;

use std::collections::BTreeMap;

use orchestrator_proto::v1 as pb;
use serde::Serialize;

/// One rank as the report sees it.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct RankRow {
    pub worker: u32,
    pub dp: u32,
    pub tp: u32,
    /// The host as the engine that started the worker knows it (`SLURMD_NODENAME`, the pod's
    /// node, else the host name).
    pub host: String,
    pub device: String,
    pub pid: u32,
    /// The worker's advertised gRPC address, and who gave it its rank (`launch`, `slurm`, `lws`...).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub address: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub started_by: String,
    pub load_format: String,
    pub checkpoint_version: String,
    /// The version staged beside the active one (a rolling update in flight), if any.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub staged_version: String,
    /// The version its last commit replaced, kept for a rollback until the update ends.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub previous_version: String,
    pub layout_identity: String,
    pub geometry_digest: String,
    pub kernel_rank_digest: String,
    pub round_trip_ok: bool,
    pub round_trip_failures: Vec<String>,
    /// The same failures as data, in the same order (empty from a worker that sends none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub round_trip_failure_details: Vec<RoundTripFailure>,
    /// The round trip's verdict is that of this verified rank (`dp0/tp1`), whose kernel and
    /// source bytes this rank's equal by digest (a later replica of an update); empty: run here.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub round_trip_identical_to: String,
    pub probe: Option<ProbeCell>,
    pub load_seconds: f64,
    /// How the rank's active weights were loaded: `real`, `dummy` or `stage` (empty: unknown).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub load_path: String,
    /// The rank holds a spare set of buffers its next stage reloads into
    /// (`--keep-staging-buffers`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub spare_buffers: bool,
    /// Tensor name -> digest (not printed in the table; used by the rules and `--json`).
    pub kernel_tensors: BTreeMap<String, String>,
    /// Set when the worker failed (exited, stopped answering, or an RPC failed).
    pub failure: Option<String>,
    /// The failure already says where the rank runs (a silent rank's names its host and pid),
    /// so [`crate::cluster::Cluster::annotate`] adds nothing to it. Not part of the report.
    #[serde(skip)]
    #[schemars(skip)]
    pub failure_names_host: bool,
    /// Set when the rank answered its report but its probe failed (itself, or its TP group).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_error: Option<String>,
    pub verdict: String,
}

#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct ProbeCell {
    pub ok: bool,
    pub q_mismatches: u64,
    pub z_max_abs_err: f32,
    pub z_max_rel_err: f32,
    pub y_max_abs_err: f32,
    pub y_partial_digest: String,
    pub y_digest: String,
    pub kernel_seconds: f64,
    pub reference_seconds: f64,
    pub allreduce_seconds: f64,
    /// Set when this probe ran only the kernel pass: the rank's replica holds byte for byte
    /// what the same tp_rank of this earlier replica holds (version, kernel and source
    /// digests, round trip), and that replica's probe ran the reference. Its verdict is that
    /// replica's, and its `y` must equal that replica's ("every DP replica has the same y").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verified_by_replica: Option<u32>,
    /// Set in the report an update answers with: this is the probe that brought the replica
    /// back into rotation right after its swap, the same probe checked the same way as this
    /// report's would be, and the rank still reports the pid, generation and version it
    /// answered on (so it was not run again).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub after_swap: bool,
}

impl From<&pb::ProbeResult> for ProbeCell {
    fn from(p: &pb::ProbeResult) -> Self {
        Self {
            ok: p.ok,
            q_mismatches: p.q_mismatches,
            z_max_abs_err: p.z_max_abs_err,
            z_max_rel_err: p.z_max_rel_err,
            y_max_abs_err: p.y_max_abs_err,
            y_partial_digest: p.y_partial_digest.clone(),
            y_digest: p.y_digest.clone(),
            kernel_seconds: p.kernel_seconds,
            reference_seconds: p.reference_seconds,
            allreduce_seconds: p.allreduce_seconds,
            verified_by_replica: None,
            after_swap: false,
        }
    }
}

/// Which replicas of a report run the checkpoint-order reference, and which are verified as
/// byte-identical to one that does (the rule an update applies, for the same reason: a version
/// is verified once per tp_rank). Replica `dp` maps to `None` (it runs the reference) or to the
/// earlier replica whose every tp_rank reported the same version, kernel digest and source
/// digest with a passing round trip. A replica with a rank that did not report, or whose round
/// trip failed, runs the reference.
pub fn reference_plan(tp_size: u32, dp_size: u32, reports: &[(u32, u32, &pb::RankReport)]) -> BTreeMap<u32, Option<u32>> {
    let key = |dp: u32| -> Option<Vec<(&str, &str, &str)>> {
        (0..tp_size)
            .map(|tp| {
                let (_, _, r) = reports.iter().find(|(d, t, _)| *d == dp && *t == tp)?;
                r.round_trip_ok.then_some((r.checkpoint_version.as_str(), r.kernel_rank_digest.as_str(), r.source_rank_digest.as_str()))
            })
            .collect()
    };
    let mut plan: BTreeMap<u32, Option<u32>> = BTreeMap::new();
    for dp in 0..dp_size {
        let mine = key(dp);
        let by = mine.as_ref().and_then(|k| plan.iter().find(|(e, by)| by.is_none() && key(**e).as_ref() == Some(k)).map(|(e, _)| *e));
        plan.insert(dp, by);
    }
    plan
}

/// Why a rank has no row from its report: the text, and whether it names the rank's host.
#[derive(Clone, Debug, PartialEq)]
pub struct RowFailure {
    pub text: String,
    pub names_host: bool,
}

impl From<String> for RowFailure {
    fn from(text: String) -> Self {
        Self { text, names_host: false }
    }
}

impl From<&str> for RowFailure {
    fn from(text: &str) -> Self {
        text.to_string().into()
    }
}

/// A rank that did not report (it failed).
pub fn failed_row(worker: u32, dp: u32, tp: u32, failure: impl Into<RowFailure>) -> RankRow {
    let RowFailure { text: failure, names_host } = failure.into();
    RankRow {
        worker,
        dp,
        tp,
        host: String::new(),
        device: String::new(),
        pid: 0,
        address: String::new(),
        started_by: String::new(),
        load_format: String::new(),
        checkpoint_version: String::new(),
        staged_version: String::new(),
        previous_version: String::new(),
        layout_identity: String::new(),
        geometry_digest: String::new(),
        kernel_rank_digest: String::new(),
        round_trip_ok: false,
        round_trip_failures: Vec::new(),
        round_trip_failure_details: Vec::new(),
        round_trip_identical_to: String::new(),
        probe: None,
        load_seconds: 0.0,
        load_path: String::new(),
        spare_buffers: false,
        kernel_tensors: BTreeMap::new(),
        failure: Some(failure),
        failure_names_host: names_host,
        probe_error: None,
        verdict: "FAILED".into(),
    }
}

/// A rank's row from its report (and probe, if one ran).
pub fn row(worker: u32, r: &pb::RankReport, probe: Option<&pb::ProbeResult>) -> RankRow {
    let id = r.identity.clone().unwrap_or_default();
    RankRow {
        worker,
        dp: r.dp_rank,
        tp: r.tp_rank,
        host: r.host.clone(),
        device: r.device.clone(),
        pid: r.pid,
        address: String::new(),
        started_by: String::new(),
        load_format: r.load_format.clone(),
        checkpoint_version: r.checkpoint_version.clone(),
        staged_version: r.staged_version.clone(),
        previous_version: r.previous_version.clone(),
        layout_identity: id.digest,
        geometry_digest: id.geometry_digest,
        kernel_rank_digest: r.kernel_rank_digest.clone(),
        round_trip_ok: r.round_trip_ok,
        round_trip_failures: r.round_trip_failures.clone(),
        round_trip_failure_details: r.round_trip_failure_details.iter().map(RoundTripFailure::from).collect(),
        round_trip_identical_to: r.round_trip_identical_to.clone(),
        probe: probe.map(ProbeCell::from),
        load_seconds: r.load_seconds,
        load_path: r.load_path.clone(),
        spare_buffers: r.spare_buffers,
        kernel_tensors: r.kernel_tensors.iter().map(|t| (t.name.clone(), t.digest.clone())).collect(),
        failure: None,
        failure_names_host: false,
        probe_error: None,
        verdict: String::new(),
    }
}

/// One failure of a rank's round trip, as its worker reported it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct RoundTripFailure {
    pub kind: RoundTripFailureKind,
    /// The tensor it names, with the part of a quantized one (`... (MXFP8 scales)`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor: Option<String>,
}

/// What failed in a round trip (`orchestrator.v1.RoundTripFailureKind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RoundTripFailureKind {
    /// The inverse hooks and permutation give other bytes than the checkpoint-order data.
    Mismatch,
    /// The load recorded no checkpoint-order digest to compare with.
    NoDigest,
    /// The block scales could not be recompressed from the kernel's per-row scales.
    BlockScales,
    /// The tensor is not one of the geometry's.
    UnknownTensor,
    /// Re-reading the checkpoint-order slice failed.
    Source,
    /// A layer could not be read back through the inverse hooks and permutations.
    Layer,
    /// The inverse permutations could not be built for the shard.
    Permutations,
    /// The weights name a scale rule the worker does not know.
    ScaleRule,
    /// A kind this coordinator does not know (a newer worker's).
    Unknown,
}

impl From<&pb::RoundTripFailure> for RoundTripFailure {
    fn from(f: &pb::RoundTripFailure) -> Self {
        use pb::RoundTripFailureKind as K;
        let kind = match K::try_from(f.kind) {
            Ok(K::Mismatch) => RoundTripFailureKind::Mismatch,
            Ok(K::NoDigest) => RoundTripFailureKind::NoDigest,
            Ok(K::BlockScales) => RoundTripFailureKind::BlockScales,
            Ok(K::UnknownTensor) => RoundTripFailureKind::UnknownTensor,
            Ok(K::Source) => RoundTripFailureKind::Source,
            Ok(K::Layer) => RoundTripFailureKind::Layer,
            Ok(K::Permutations) => RoundTripFailureKind::Permutations,
            Ok(K::ScaleRule) => RoundTripFailureKind::ScaleRule,
            Ok(K::Unspecified) | Err(_) => RoundTripFailureKind::Unknown,
        };
        Self { kind, tensor: Some(f.tensor.clone()).filter(|t| !t.is_empty()) }
    }
}

/// A rank, as findings name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, schemars::JsonSchema)]
pub struct RankId {
    pub dp: u32,
    pub tp: u32,
}

impl RankId {
    fn of(r: &RankRow) -> Self {
        Self { dp: r.dp, tp: r.tp }
    }
}

/// One disagreement, as data: the ranks it names, the tensor when one is involved, and the text.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
pub struct Finding {
    pub ranks: Vec<RankId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor: Option<String>,
    pub text: String,
}

impl Finding {
    fn new(text: String, ranks: impl IntoIterator<Item = RankId>) -> Self {
        Self { ranks: ranks.into_iter().collect(), tensor: None, text }
    }

    fn tensor(mut self, name: &str) -> Self {
        self.tensor = Some(name.to_string());
        self
    }
}

/// One cross-rank rule's verdict.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Rule {
    /// A short stable name (the `rule` label of `orchestrator_verification_failures_total`).
    pub id: String,
    pub rule: String,
    pub ok: bool,
    /// Each disagreement as text (ranks, tensor, what differs).
    pub findings: Vec<String>,
    /// The same findings as data; row verdicts are assigned from these, by rank identity.
    pub details: Vec<Finding>,
}

/// Everything the report says.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct ConsistencyReport {
    pub ok: bool,
    pub tp_size: u32,
    pub dp_size: u32,
    pub source: String,
    pub ranks: Vec<RankRow>,
    pub rules: Vec<Rule>,
    /// What the reader should know that is not a failure (replicas on different versions while
    /// an update is in flight).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    pub timings: BTreeMap<String, f64>,
    /// Each replica's place in the probe rotation, when the cluster is served.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<crate::rotation::ReplicaState>,
    /// Per host: its ranks, how many are ok, and its slowest load.
    pub hosts: Vec<HostSummary>,
}

/// One host's ranks in the report.
#[derive(Clone, Debug, Serialize, PartialEq, schemars::JsonSchema)]
pub struct HostSummary {
    pub host: String,
    pub ranks: Vec<RankId>,
    pub ok: usize,
    pub failed: usize,
    /// The slowest load of its ranks (they load in parallel).
    pub load_seconds: f64,
}

/// Groups the rows by host (a rank that never said where it runs is under `unknown`).
pub fn host_summaries(ranks: &[RankRow]) -> Vec<HostSummary> {
    let mut hosts: BTreeMap<String, HostSummary> = BTreeMap::new();
    for r in ranks {
        let name = if r.host.is_empty() { "unknown".to_string() } else { r.host.clone() };
        let h =
            hosts.entry(name.clone()).or_insert_with(|| HostSummary { host: name, ranks: Vec::new(), ok: 0, failed: 0, load_seconds: 0.0 });
        h.ranks.push(RankId::of(r));
        if r.verdict == "ok" {
            h.ok += 1;
        } else {
            h.failed += 1;
        }
        h.load_seconds = h.load_seconds.max(r.load_seconds);
    }
    hosts.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(dp: u32, version: &str, staged: &str) -> RankRow {
        let r = pb::RankReport {
            dp_rank: dp,
            tp_size: 1,
            dp_size: 2,
            checkpoint_version: version.into(),
            staged_version: staged.into(),
            round_trip_ok: true,
            kernel_rank_digest: "00000000000000aa".into(),
            ..Default::default()
        };
        row(dp, &r, None)
    }

    fn ranked(dp: u32, tp: u32, version: &str) -> RankRow {
        let r = pb::RankReport {
            dp_rank: dp,
            tp_rank: tp,
            tp_size: 2,
            dp_size: 2,
            checkpoint_version: version.into(),
            round_trip_ok: true,
            // Digest and y follow the version: equal within a version, different across.
            kernel_rank_digest: format!("{version}-tp{tp}"),
            ..Default::default()
        };
        let probe = pb::ProbeResult { ok: true, y_digest: format!("y-{version}"), ..Default::default() };
        row(dp * 2 + tp, &r, Some(&probe))
    }

    fn report(dp: u32, tp: u32, version: &str, kernel: &str, round_trip_ok: bool) -> pb::RankReport {
        pb::RankReport {
            dp_rank: dp,
            tp_rank: tp,
            checkpoint_version: version.into(),
            kernel_rank_digest: format!("{kernel}-tp{tp}"),
            source_rank_digest: format!("src-{version}-tp{tp}"),
            round_trip_ok,
            ..Default::default()
        }
    }

    /// A replica runs the reference unless an earlier replica that ran it holds, on every
    /// tp_rank, the same version, kernel digest and source digest with passing round trips.
    #[test]
    fn the_reference_runs_once_per_identical_set_of_ranks() {
        let reports = [
            report(0, 0, "va", "k", true),
            report(0, 1, "va", "k", true),
            report(1, 0, "va", "k", true),
            report(1, 1, "va", "k", true),
            // dp2: tp1 differs from dp0's (a stale reload, say).
            report(2, 0, "va", "k", true),
            report(2, 1, "va", "stale", true),
            // dp3: identical to dp0, but its round trip failed.
            report(3, 0, "va", "k", true),
            report(3, 1, "va", "k", false),
            // dp4: another version; dp5 the same as dp4; dp6 lacks its tp1 report.
            report(4, 0, "vb", "k", true),
            report(4, 1, "vb", "k", true),
            report(5, 0, "vb", "k", true),
            report(5, 1, "vb", "k", true),
            report(6, 0, "va", "k", true),
        ];
        let by_rank: Vec<(u32, u32, &pb::RankReport)> = reports.iter().map(|r| (r.dp_rank, r.tp_rank, r)).collect();
        let plan = reference_plan(2, 7, &by_rank);
        let want: BTreeMap<u32, Option<u32>> =
            [(0, None), (1, Some(0)), (2, None), (3, None), (4, None), (5, Some(4)), (6, None)].into_iter().collect();
        assert_eq!(plan, want);
    }

    /// A rank verified by identity passes the tolerance rule only when the same tp_rank of the
    /// replica it is identical to passed against the reference.
    #[test]
    fn an_identity_verified_rank_takes_the_verdict_of_the_replica_it_matches() {
        let rows = |dp0_ok: bool| {
            let mut rows = vec![ranked(0, 0, "va"), ranked(0, 1, "va"), ranked(1, 0, "va"), ranked(1, 1, "va")];
            for r in rows.iter_mut() {
                let p = r.probe.as_mut().expect("probed");
                if r.dp == 1 {
                    p.verified_by_replica = Some(0);
                } else if r.tp == 1 {
                    p.ok = dp0_ok;
                }
            }
            rows
        };
        let passing = evaluate(2, 2, "t".into(), rows(true), None, BTreeMap::new(), false);
        assert!(passing.ok, "{:?}", failed_rules(&passing));
        assert!(passing.render().contains("= dp0 (identical)"));
        // A round trip adopted by identity says whose it is, in the round-trip column.
        let mut adopted = rows(true);
        adopted[3].round_trip_identical_to = "dp0/tp1".into();
        let text = evaluate(2, 2, "t".into(), adopted, None, BTreeMap::new(), false).render();
        let line = text.lines().find(|l| l.starts_with("1   1 ")).expect("dp1/tp1's row");
        assert!(line.contains(" = dp0/tp1 "), "{text}");
        let failing = evaluate(2, 2, "t".into(), rows(false), None, BTreeMap::new(), false);
        let rule = failing.rules.iter().find(|r| r.id == "probe_tolerance").expect("the tolerance rule");
        let named = &rule.findings;
        assert_eq!(named.len(), 2, "{named:?}");
        assert!(named[0].starts_with("rank dp0/tp1: q differs"), "{named:?}");
        assert_eq!(named[1], "rank dp1/tp1: byte-identical to dp0/tp1, whose probe against the reference did not pass");
    }

    fn failed_rules(r: &ConsistencyReport) -> Vec<&str> {
        assert!(r.rules.iter().all(|rule| rule.id != "other"), "a rule without a short name: {:?}", r.rules);
        r.rules.iter().filter(|r| !r.ok).map(|r| r.rule.as_str()).collect()
    }

    /// Replicas on two versions: a failure naming every rank of the odd replica, unless an
    /// update is in flight (then a note, and replicas are compared only with their own version).
    #[test]
    fn replicas_on_two_versions_fail_unless_an_update_is_in_flight() {
        let rows = || vec![ranked(0, 0, "vb"), ranked(0, 1, "vb"), ranked(1, 0, "va"), ranked(1, 1, "va")];
        let settled = evaluate(2, 2, "t".into(), rows(), None, BTreeMap::new(), false);
        assert!(!settled.ok);
        assert_eq!(failed_rules(&settled), ["all layout identities agree on geometry and version"]);
        let verdicts: Vec<&str> = settled.ranks.iter().map(|r| r.verdict.as_str()).collect();
        assert_eq!(verdicts, ["ok", "ok", "FAIL", "FAIL"]);
        assert!(settled.notes.is_empty());

        let in_flight = evaluate(2, 2, "t".into(), rows(), None, BTreeMap::new(), true);
        assert!(in_flight.ok, "{}", in_flight.render());
        assert_eq!(in_flight.notes, ["an update is in flight: replica dp1 holds version va, replica dp0 holds vb"]);
        assert!(in_flight.render().contains("note: an update is in flight"));
    }

    /// A mix of versions inside one TP group fails even while an update is in flight, and so do
    /// different digests or y between replicas on the same version.
    #[test]
    fn a_mixed_group_or_a_diverging_replica_fails_even_in_flight() {
        let mixed = vec![ranked(0, 0, "va"), ranked(0, 1, "vb"), ranked(1, 0, "va"), ranked(1, 1, "va")];
        let r = evaluate(2, 2, "t".into(), mixed, None, BTreeMap::new(), true);
        assert!(failed_rules(&r).contains(&"all layout identities agree on geometry and version"), "{}", r.render());
        assert!(r.rules.iter().any(|rule| rule.findings.iter().any(|f| f.contains("rank dp0/tp1 holds checkpoint version vb"))));

        let mut diverging = vec![ranked(0, 0, "va"), ranked(0, 1, "va"), ranked(1, 0, "va"), ranked(1, 1, "va")];
        diverging[3].kernel_rank_digest = "other".into();
        for r in &mut diverging[2..] {
            if let Some(p) = r.probe.as_mut() {
                p.y_digest = "y-other".into();
            }
        }
        let r = evaluate(2, 2, "t".into(), diverging, None, BTreeMap::new(), true);
        let failed = failed_rules(&r);
        assert!(failed.contains(&"replicas with the same tp_rank hold identical kernel digests"), "{failed:?}");
        assert!(failed.contains(&"every DP replica has the same y"), "{failed:?}");
    }

    /// At TP 16, a finding about rank tp12 names tp12 alone: verdicts go by rank identity, so
    /// "rank dp0/tp1" is not a prefix match for "rank dp0/tp12" (a false alarm before).
    #[test]
    fn a_finding_marks_only_the_ranks_it_names() {
        let rows: Vec<RankRow> = (0..16)
            .map(|tp| {
                let r = pb::RankReport {
                    tp_rank: tp,
                    tp_size: 16,
                    dp_size: 1,
                    checkpoint_version: "va".into(),
                    round_trip_ok: tp != 12,
                    round_trip_failures: if tp == 12 { vec!["layers.0.attn.wq_b.weight differs".into()] } else { vec![] },
                    kernel_rank_digest: format!("tp{tp}"),
                    ..Default::default()
                };
                row(tp, &r, None)
            })
            .collect();
        let golden: BTreeMap<u32, BTreeMap<String, String>> = (0..16)
            .map(|tp| (tp, BTreeMap::from([("layers.0.attn.wq_b.weight".to_string(), if tp == 12 { "good".into() } else { "x".into() })])))
            .collect();
        let mut rows = rows;
        for r in &mut rows {
            r.kernel_tensors.insert("layers.0.attn.wq_b.weight".into(), "x".into());
        }
        let report = evaluate(16, 1, "t".into(), rows, Some(&golden), BTreeMap::new(), false);
        let failed: Vec<u32> = report.ranks.iter().filter(|r| r.verdict != "ok").map(|r| r.tp).collect();
        assert_eq!(failed, [12], "{}", report.render());
        let golden_rule = report.rules.iter().find(|r| r.rule.starts_with("kernel digests equal")).unwrap();
        assert_eq!(golden_rule.details.len(), 1);
        assert_eq!(golden_rule.details[0].ranks, [RankId { dp: 0, tp: 12 }]);
        assert_eq!(golden_rule.details[0].tensor.as_deref(), Some("layers.0.attn.wq_b.weight"));
    }

    /// A failed round trip is data on the rank's row (its kinds and tensors, as the worker sent
    /// them), and its finding names the tensor where every failure names the same one.
    #[test]
    fn round_trip_failures_are_data_and_the_finding_names_their_tensor() {
        use pb::RoundTripFailureKind as K;
        let failed = |dp: u32, details: Vec<(K, &str)>| {
            let r = pb::RankReport {
                dp_rank: dp,
                tp_size: 1,
                dp_size: 3,
                checkpoint_version: "va".into(),
                kernel_rank_digest: "00000000000000aa".into(),
                round_trip_ok: details.is_empty(),
                round_trip_failures: details.iter().map(|(_, t)| format!("{t}: differs")).collect(),
                round_trip_failure_details: details
                    .iter()
                    .map(|&(kind, tensor)| pb::RoundTripFailure { kind: kind.into(), tensor: tensor.into() })
                    .collect(),
                ..Default::default()
            };
            row(dp, &r, None)
        };
        let w = "layers.0.attn.wq_b.weight";
        let rows = vec![
            failed(0, vec![]),
            failed(1, vec![(K::Mismatch, w), (K::BlockScales, w)]),
            failed(2, vec![(K::Mismatch, w), (K::Layer, ""), (K::Unspecified, "x")]),
        ];
        let report = evaluate(1, 3, "test".into(), rows, None, BTreeMap::new(), false);
        let rule = report.rules.iter().find(|r| r.rule == "every round trip holds").unwrap();
        assert!(!rule.ok);
        let details: Vec<(Vec<RankId>, Option<&str>)> = rule.details.iter().map(|d| (d.ranks.clone(), d.tensor.as_deref())).collect();
        assert_eq!(details, [(vec![RankId { dp: 1, tp: 0 }], Some(w)), (vec![RankId { dp: 2, tp: 0 }], None)]);
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["ranks"][0].get("round_trip_failure_details").is_none());
        assert_eq!(
            json["ranks"][2]["round_trip_failure_details"],
            serde_json::json!([{ "kind": "mismatch", "tensor": w }, { "kind": "layer" }, { "kind": "unknown", "tensor": "x" }])
        );
    }

    /// A rank with a staged version says so on its row and in the JSON; one without does not.
    #[test]
    fn staged_versions_are_shown() {
        let report = evaluate(1, 2, "test".into(), vec![rank(0, "va", ""), rank(1, "va", "vb")], None, BTreeMap::new(), false);
        let text = report.render();
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("0 ") || l.starts_with("1 ")).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(!lines[0].contains("staged") && lines[1].ends_with("(staged vb)"), "{text}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["ranks"][1]["staged_version"], "vb");
        assert!(json["ranks"][0].get("staged_version").is_none());
    }
}
