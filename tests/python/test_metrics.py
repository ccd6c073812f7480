"""/metrics of a served cluster, parsed by Prometheus' own Python parsers, before, during and
after a rolling update, and after a failed verification."""

import json
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus_text

from harness import eventually, synth


# Every series name the tests scraped (the dashboard test checks its queries against them), and
# the classic-format text of the last scrape after an update (the lint test reads it).
SCRAPED: set = set()
LAST_SCRAPE: list = []


def samples(text: str) -> dict:
    """name -> [(labels, value)], parsed strictly as OpenMetrics; the classic Prometheus text
    parser must read the same exposition too (a scraper may use either)."""
    out: dict = {}
    for family in parse_openmetrics(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    classic = {s.name for f in parse_prometheus_text(text) for s in f.samples}
    assert set(out) <= classic | {n for n in out if n.endswith("_created")}, set(out) - classic
    return out


def value(parsed: dict, name: str, **labels) -> float:
    matching = [v for l, v in parsed.get(name, []) if all(l.get(k) == str(w) for k, w in labels.items())]
    assert len(matching) == 1, f"{name}{labels}: {parsed.get(name)}"
    return matching[0]


def versions(parsed: dict) -> dict:
    return {l["replica"]: l["version"] for l, v in parsed.get("orchestrator_replica_version_info", []) if v == 1}


def test_the_version_gauge_moves_replica_by_replica_and_the_update_counts(tmp_path, served_factory):
    root = tmp_path / "root"
    a, b = synth(root / "A", 1), synth(root / "B", 2)
    # dp1's rank 0 stages slowly (a second per layer), so the scrapes see dp0 on B while dp1 is on A.
    cluster = served_factory("--tp", "2", "--dp", "2", "--probe", "2,16", "--checkpoint", str(a), "--allow-root", str(root),
                             "--inject-fault", "2:slow-stage")
    before = samples(cluster.scrape())
    assert value(before, "orchestrator_ranks_expected") == 4
    assert value(before, "orchestrator_ranks_registered") == 4
    old = versions(before)
    assert set(old) == {"0", "1"} and old["0"] == old["1"], old
    def up() -> dict:
        return {l["replica"]: v for l, v in samples(cluster.scrape()).get("orchestrator_ranks_up", [])}

    eventually("every rank up (the health loop's first round)", lambda: up() == {"0": 2, "1": 2})
    assert {l["path"] for l, _ in before["orchestrator_rank_load_seconds"]} == {"real"}

    probes = json.loads(cluster.cli("probe", "--rate", "5", "--duration", "1", "--json").stdout)
    after_probes = samples(cluster.scrape())
    served = sum(v for l, v in after_probes["orchestrator_routed_probes_total"] if l["outcome"] == "ok")
    assert served >= 3, after_probes["orchestrator_routed_probes_total"]
    assert {l["version"] for l, _ in after_probes["orchestrator_routed_probes_total"]} == {old["0"]}
    assert value(after_probes, "orchestrator_routed_probe_duration_seconds_count") == served, probes

    seen: list[dict] = []
    update = {}
    t = threading.Thread(target=lambda: update.setdefault("result", cluster.cli("update", "--checkpoint", str(b), "--json")))
    t.start()
    while t.is_alive():
        p = samples(cluster.scrape())
        seen.append({"versions": versions(p), "in_progress": value(p, "orchestrator_weight_update_in_progress"),
                     "done": value(p, "orchestrator_weight_update_replicas_done")})
        t.join(0.1)
    doc = json.loads(update["result"].stdout)
    assert doc["ok"], doc
    new = doc["update"]["new_version"]
    # Replica by replica: dp0 first, alone, then both; never dp1 ahead of dp0.
    states = [(s["versions"]["0"], s["versions"]["1"]) for s in seen]
    assert (new, old["1"]) in states, states
    assert (old["0"], new) not in states, states
    assert any(s["in_progress"] == 1 and s["done"] == 1 for s in seen), seen
    after = samples(cluster.scrape())
    assert versions(after) == {"0": new, "1": new}
    assert value(after, "orchestrator_weight_updates_total", outcome="ok") == 1
    assert value(after, "orchestrator_weight_update_duration_seconds_count") == 1
    assert value(after, "orchestrator_weight_update_replicas_done") == 2
    assert value(after, "orchestrator_weight_update_in_progress") == 0
    assert {l["path"] for l, _ in after["orchestrator_rank_load_seconds"]} == {"stage"}
    assert not any(l["rule"] for l, v in after.get("orchestrator_verification_failures_total", []) if v > 0)

    SCRAPED.update(set(before) | set(after_probes) | set(after))
    classic = cluster.scrape(openmetrics=False)
    assert {s.name for f in parse_prometheus_text(classic) for s in f.samples} == {
        s.name for f in parse_openmetrics(cluster.scrape()) for s in f.samples}
    LAST_SCRAPE.append(classic)


def test_a_failed_verification_counts_under_its_rule(tmp_path, served_factory):
    root = tmp_path / "root"
    a, b = synth(root / "A", 1), synth(root / "B", 2)
    # dp1's rank 0 skips the permutation in what it stages: dp1 differs from the verified dp0.
    cluster = served_factory("--tp", "2", "--dp", "2", "--probe", "2,16", "--checkpoint", str(a), "--allow-root", str(root),
                             "--inject-fault", "2:stage-skip-permute")
    result = cluster.cli("update", "--checkpoint", str(b), "--json", check=False)
    doc = json.loads(result.stdout)
    assert not doc["ok"], doc
    p = samples(cluster.scrape())
    assert value(p, "orchestrator_verification_failures_total", rule="replica_digests") == 1
    assert value(p, "orchestrator_weight_updates_total", outcome="failed") == 1
    v = versions(p)
    assert v["0"] != v["1"], v  # dp0 committed, dp1 kept the old version
    SCRAPED.update(p)


def test_every_dashboard_query_names_series_the_tests_scraped():
    """Runs after the two tests above (pytest keeps file order)."""
    assert "orchestrator_weight_updates_total" in SCRAPED and "orchestrator_verification_failures_total" in SCRAPED, SCRAPED
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana/orchestrator-dashboard.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(queries) >= 10
    named = {m for q in queries for m in re.findall(r"\borchestrator_[a-z0-9_]+", q)}
    assert named and named <= SCRAPED, named - SCRAPED


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (.ci/run installs it)")
def test_promtool_finds_nothing_to_lint_in_the_exposition():
    """Prometheus' own linter (`promtool check metrics`: names, units, _total suffixes, help)."""
    assert LAST_SCRAPE, "runs after the update test"
    r = subprocess.run(["promtool", "check", "metrics"], input=LAST_SCRAPE[-1], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
