//! The cross-rank rules: each a verdict over every rank's row, its findings naming the ranks,
//! the tensor and what differs.

use std::collections::BTreeMap;

use super::{ConsistencyReport, Finding, RankId, RankRow, Rule, host_summaries};

fn label(r: &RankRow) -> String {
    format!("rank dp{}/tp{}", r.dp, r.tp)
}

/// Tensors whose digests differ between two ranks.
fn differing_tensors(a: &RankRow, b: &RankRow) -> Vec<String> {
    a.kernel_tensors.iter().filter(|(n, d)| b.kernel_tensors.get(*n) != Some(d)).map(|(n, _)| n.clone()).collect()
}

/// Each rule's short name, by its sentence.
const RULE_IDS: [(&str, &str); 9] = [
    ("every rank answered", "ranks_answered"),
    ("replicas with the same tp_rank hold identical kernel digests", "replica_digests"),
    ("all layout identities agree on geometry and version", "layout_identity"),
    ("every round trip holds", "round_trip"),
    ("every probe is within tolerance (q bit-exact, z within 1e-3)", "probe_tolerance"),
    ("every rank of a TP group has the same y", "group_y"),
    ("every DP replica has the same y", "replica_y"),
    ("kernel digests equal the coordinator's golden recomputation", "golden"),
    ("every probe ran", "probes_ran"),
];

fn rule(name: &str, details: Vec<Finding>) -> Rule {
    let id = RULE_IDS.iter().find(|(n, _)| *n == name).map_or("other", |(_, id)| id);
    Rule {
        id: id.to_string(),
        rule: name.to_string(),
        ok: details.is_empty(),
        findings: details.iter().map(|f| f.text.clone()).collect(),
        details,
    }
}

/// Applies the cross-rank rules and sets every row's verdict. `golden` holds, per tp rank, the
/// tensor digests the coordinator recomputed from the checkpoint (`--verify golden`). With
/// `update_in_flight`, replicas may hold different versions (a rolling update is between
/// them): replicas are compared with those on the same version, and the versions are a note.
/// A mix of versions inside a TP group is a failure either way.
pub fn evaluate(
    tp_size: u32,
    dp_size: u32,
    source: String,
    mut ranks: Vec<RankRow>,
    golden: Option<&BTreeMap<u32, BTreeMap<String, String>>>,
    timings: BTreeMap<String, f64>,
    update_in_flight: bool,
) -> ConsistencyReport {
    ranks.sort_by_key(|r| (r.dp, r.tp));
    let live: Vec<&RankRow> = ranks.iter().filter(|r| r.failure.is_none()).collect();
    let mut rules = Vec::new();

    rules.push(rule(
        "every rank answered",
        ranks.iter().filter_map(|r| r.failure.as_ref().map(|f| Finding::new(format!("{}: {f}", label(r)), [RankId::of(r)]))).collect(),
    ));

    // Replicas with the same tp_rank (on the same version) hold identical kernel digests.
    let mut f = Vec::new();
    for tp in 0..tp_size {
        let replicas: Vec<&&RankRow> = live.iter().filter(|r| r.tp == tp).collect();
        for (i, first) in replicas.iter().enumerate() {
            if replicas[..i].iter().any(|r| r.checkpoint_version == first.checkpoint_version) {
                continue;
            }
            for other in replicas[i + 1..].iter().filter(|r| r.checkpoint_version == first.checkpoint_version) {
                if other.kernel_rank_digest != first.kernel_rank_digest {
                    let tensors = differing_tensors(first, other);
                    let finding = Finding::new(
                        format!("{} and {} differ in {}", label(first), label(other), tensors.join(", ")),
                        [RankId::of(first), RankId::of(other)],
                    );
                    f.push(match tensors.as_slice() {
                        [one] => finding.tensor(one),
                        _ => finding,
                    });
                }
            }
        }
    }
    rules.push(rule("replicas with the same tp_rank hold identical kernel digests", f));

    // All layout identities agree on geometry and version; all ranks load the same checkpoint
    // (replicas may differ while an update is in flight; the ranks of a group never may).
    let mut f = Vec::new();
    let mut notes = Vec::new();
    if let Some(first) = live.first() {
        for other in &live[1..] {
            if other.geometry_digest != first.geometry_digest {
                f.push(Finding::new(
                    format!("{} and {} have different layout identities (geometry/format/rule/version)", label(first), label(other)),
                    [RankId::of(first), RankId::of(other)],
                ));
            }
        }
    }
    let mut replica_versions: BTreeMap<u32, &str> = BTreeMap::new();
    for dp in 0..dp_size {
        let members: Vec<&&RankRow> = live.iter().filter(|r| r.dp == dp).collect();
        if let Some(first) = members.first() {
            replica_versions.insert(dp, &first.checkpoint_version);
            for other in members.iter().filter(|r| r.checkpoint_version != first.checkpoint_version) {
                f.push(Finding::new(
                    format!(
                        "{} holds checkpoint version {} but {} of its TP group holds {}",
                        label(other),
                        other.checkpoint_version,
                        label(first),
                        first.checkpoint_version
                    ),
                    [RankId::of(other), RankId::of(first)],
                ));
            }
        }
    }
    if let Some((&dp0, &v0)) = replica_versions.iter().next() {
        for (dp, v) in replica_versions.iter().skip(1).filter(|(_, v)| **v != v0) {
            if update_in_flight {
                notes.push(format!("an update is in flight: replica dp{dp} holds version {v}, replica dp{dp0} holds {v0}"));
            } else {
                for r in live.iter().filter(|r| r.dp == *dp) {
                    f.push(Finding::new(
                        format!("{} holds checkpoint version {} but replica dp{dp0} holds {v0}", label(r), r.checkpoint_version),
                        [RankId::of(r)],
                    ));
                }
            }
        }
    }
    rules.push(rule("all layout identities agree on geometry and version", f));

    rules.push(rule(
        "every round trip holds",
        live.iter()
            .filter(|r| !r.round_trip_ok)
            .map(|r| {
                let finding = Finding::new(format!("{}: {}", label(r), r.round_trip_failures.join("; ")), [RankId::of(r)]);
                // The tensor, where every failure names the same one.
                let mut tensors = r.round_trip_failure_details.iter().map(|f| f.tensor.as_deref());
                match tensors.next() {
                    Some(Some(first)) if tensors.all(|t| t == Some(first)) => finding.tensor(first),
                    _ => finding,
                }
            })
            .collect(),
    ));

    let probed: Vec<&&RankRow> = live.iter().filter(|r| r.probe.is_some()).collect();
    if !probed.is_empty() {
        rules.push(rule(
            "every probe is within tolerance (q bit-exact, z within 1e-3)",
            probed
                .iter()
                .filter_map(|r| {
                    let p = r.probe.as_ref()?;
                    if let Some(e) = p.verified_by_replica {
                        let theirs = probed.iter().find(|o| o.dp == e && o.tp == r.tp).and_then(|o| o.probe.as_ref());
                        return match theirs {
                            Some(t) if t.ok && t.verified_by_replica.is_none() => None,
                            _ => Some(Finding::new(
                                format!("{}: byte-identical to dp{e}/tp{}, whose probe against the reference did not pass", label(r), r.tp),
                                [RankId::of(r)],
                            )),
                        };
                    }
                    (!p.ok).then(|| {
                        Finding::new(
                            format!(
                                "{}: q differs in {} values, z max err {:.3e} abs / {:.3e} rel",
                                label(r),
                                p.q_mismatches,
                                p.z_max_abs_err,
                                p.z_max_rel_err
                            ),
                            [RankId::of(r)],
                        )
                    })
                })
                .collect(),
        ));
        let mut f = Vec::new();
        let mut group_y: BTreeMap<u32, (String, Vec<RankId>)> = BTreeMap::new();
        for dp in 0..dp_size {
            let members: Vec<&&&RankRow> = probed.iter().filter(|r| r.dp == dp).collect();
            if let Some(first) = members.first() {
                let y = &first.probe.as_ref().expect("probed").y_digest;
                group_y.insert(dp, (y.clone(), members.iter().map(|r| RankId::of(r)).collect()));
                for other in &members[1..] {
                    let oy = &other.probe.as_ref().expect("probed").y_digest;
                    if oy != y {
                        f.push(Finding::new(
                            format!("{} has y {} but {} has y {}", label(other), oy, label(first), y),
                            [RankId::of(other), RankId::of(first)],
                        ));
                    }
                }
            }
        }
        rules.push(rule("every rank of a TP group has the same y", f));
        // Replicas on the same version compute the same y (different weights give different y).
        let mut f = Vec::new();
        for (i, (dp0, (y0, _))) in group_y.iter().enumerate() {
            let v0 = replica_versions.get(dp0);
            if group_y.iter().take(i).any(|(dp, _)| replica_versions.get(dp) == v0) {
                continue;
            }
            for (dp, (y, members)) in group_y.iter().skip(i + 1).filter(|(dp, _)| replica_versions.get(dp) == v0) {
                if y != y0 {
                    f.push(Finding::new(format!("replica dp{dp} has y {y} but replica dp{dp0} has y {y0}"), members.iter().copied()));
                }
            }
        }
        rules.push(rule("every DP replica has the same y", f));
    }

    if let Some(golden) = golden {
        let mut f = Vec::new();
        for r in &live {
            let Some(want) = golden.get(&r.tp) else { continue };
            for (name, d) in want {
                match r.kernel_tensors.get(name) {
                    Some(got) if got == d => {}
                    Some(got) => f.push(
                        Finding::new(format!("{}: tensor {name} has {got}, the golden recomputation gives {d}", label(r)), [RankId::of(r)])
                            .tensor(name),
                    ),
                    None => f.push(Finding::new(format!("{}: tensor {name} missing", label(r)), [RankId::of(r)]).tensor(name)),
                }
            }
        }
        rules.push(rule("kernel digests equal the coordinator's golden recomputation", f));
    }

    // A rank whose report came but whose probe did not.
    rules.push(rule(
        "every probe ran",
        live.iter().filter_map(|r| r.probe_error.as_ref().map(|e| Finding::new(format!("{}: {e}", label(r)), [RankId::of(r)]))).collect(),
    ));

    // Row verdicts: a rank fails when it failed, its round trip or probe failed, or a finding
    // names it (by identity, never by matching text).
    for r in &mut ranks {
        let id = RankId::of(r);
        let named = rules.iter().any(|rule| rule.details.iter().any(|f| f.ranks.contains(&id)));
        let bad = r.failure.is_some() || !r.round_trip_ok || r.probe.as_ref().is_some_and(|p| !p.ok) || r.probe_error.is_some() || named;
        r.verdict = if bad { "FAIL".into() } else { "ok".into() };
    }
    let ok = rules.iter().all(|r| r.ok) && ranks.iter().all(|r| r.verdict == "ok");
    let hosts = host_summaries(&ranks);
    ConsistencyReport { ok, tp_size, dp_size, source, ranks, rules, notes, timings, replicas: Vec::new(), hosts }
}
