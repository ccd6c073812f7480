"""The client against a real served cluster (`orchestrator launch --serve`, real workers)."""

import json
import os
import signal

import pytest
from harness import eventually, run, synth

from orchestrator_client import Cluster, OrchestratorError, RankLost, Report, Unauthenticated, UpdateOutcome, UpdateRefused


@pytest.fixture
def checkpoints(tmp_path):
    root = tmp_path / "root"
    return root, synth(root / "A", 1), synth(root / "B", 2)


def serve(served_factory, root, a):
    return served_factory("--tp", "2", "--dp", "2", "--probe", "2,16", "--checkpoint", str(a), "--allow-root", str(root))


def test_report_update_probe_and_shutdown(checkpoints, served_factory):
    root, a, b = checkpoints
    served = serve(served_factory, root, a)
    client = Cluster(served.coordinator, served.token_file)
    report = client.report()
    assert isinstance(report, Report) and report.ok, report.text
    assert (report.tp_size, report.dp_size, len(report.ranks)) == (2, 2, 4)
    old = report.versions
    assert len(set(old.values())) == 1 and "" not in old.values(), old
    # The same content as the CLI's --json.
    cli = json.loads(served.cli("report", "--json").stdout)
    assert set(report.raw) == set(cli)
    assert [(r.label, r.kernel_rank_digest, r.checkpoint_version) for r in report.ranks] == [
        (f"dp{r['dp']}/tp{r['tp']}", r["kernel_rank_digest"], r["checkpoint_version"]) for r in cli["ranks"]]
    assert {r.id for r in report.rules} >= {"replica_digests", "layout_identity", "round_trip"}

    outcome = client.update(b)
    assert isinstance(outcome, UpdateOutcome) and outcome.ok, outcome.text
    assert outcome.new_version and outcome.new_version != old[0]
    assert outcome.versions == {0: outcome.new_version, 1: outcome.new_version}
    assert outcome.report.ok and outcome.report.versions == outcome.versions
    assert any(s.startswith("replica dp1:") and "verified as byte-identical to dp0" in s for s in outcome.steps), outcome.steps
    # dp1's ranks adopted dp0's round-trip verdicts by their digests; dp0's ran their own.
    assert {r.label: r.round_trip_identical_to for r in outcome.report.ranks} == {
        "dp0/tp0": "", "dp0/tp1": "", "dp1/tp0": "dp0/tp0", "dp1/tp1": "dp0/tp1"}, outcome.text

    load = client.probe(rate=5, duration=1)
    assert (load.ok, load.served, load.failed) == (True, 5, 0), load
    assert load.by_version == {outcome.new_version: {"served": 5, "failed": 0}}
    assert set(load.by_replica) <= {"dp0", "dp1"} and 0 < load.latency_ms["p50"] <= load.latency_ms["p99"] <= load.latency_ms["max"]

    # Back to A, one replica staging at a time.
    with pytest.raises(OrchestratorError):
        client.update(a, max_staging=0)
    back = client.update(a, max_staging=1)
    assert back.ok and back.versions == {0: old[0], 1: old[0]}, back.text

    client.shutdown()
    assert served.proc.wait(timeout=60) == 0


def test_typed_errors_for_a_wrong_token_a_refused_update_and_a_lost_rank(checkpoints, served_factory, tmp_path):
    root, a, b = checkpoints
    served = serve(served_factory, root, a)
    wrong = tmp_path / "wrong.token"
    wrong.write_text("x" * 32)
    with pytest.raises(Unauthenticated) as e:
        Cluster(served.coordinator, wrong).report(probe=False)
    assert e.value.code == "UNAUTHENTICATED"

    client = Cluster(served.coordinator, served.token_file)
    other = root / "C"
    run("checkpoint", "synth", "--out", str(other), "--preset", "tiny", "--layers", "3", "--seed", "3")
    with pytest.raises(UpdateRefused) as e:
        client.update(other)
    assert e.value.outcome.steps[0].startswith("refused before touching any replica"), e.value.outcome.steps
    failure = e.value.outcome.failure
    assert failure is not None and failure.kind == "invalid_checkpoint" and failure.refused, failure
    assert failure.replicas == [] and failure.why.startswith("refused before touching any replica"), failure
    assert len(set(client.report(probe=False).versions.values())) == 1

    victim = next(r for r in client.report(probe=False).ranks if r.label == "dp1/tp0")
    os.kill(victim.pid, signal.SIGKILL)
    eventually("the coordinator sees dp1/tp0 die", lambda: [r.label for r in client.report(probe=False).lost] == ["dp1/tp0"])
    with pytest.raises(RankLost) as e:
        client.update(b)
    assert e.value.ranks == ["dp1/tp0"], e.value
    failure = e.value.outcome.failure
    # Skipped when the coordinator knew the rank dead at the start, else its stage failed.
    assert failure is not None and failure.replicas == [1] and not failure.refused, failure
    assert failure.kind == "ranks_dead" or (failure.kind, failure.rank) == ("staged_rank_unreachable", "dp1/tp0"), failure
    # dp0 took the new version; dp1 (its rank dead) was skipped: each TP group on one version.
    versions = e.value.outcome.versions
    assert versions[0] == e.value.outcome.new_version and versions[1] != versions[0], versions
