"""`--log-format json`: every stderr line of a launch (coordinator and workers) is one JSON
event, and the load events carry rank, replica and version fields."""

import json

from harness import run, synth


def test_json_logs_are_one_event_per_line_with_rank_replica_and_version(tmp_path):
    ck = synth(tmp_path / "A", 1)
    result = run("launch", "--tp", "2", "--probe", "2,16", "--checkpoint", str(ck), "--log-format", "json")
    events = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    assert events, result.stderr
    assert all({"timestamp", "level", "message"} <= set(e) for e in events), events
    loaded = [e for e in events if e["message"] == "loaded"]
    assert sorted(e["tp_rank"] for e in loaded) == [0, 1], events
    assert all(e["replica"] == 0 and len(e["version"]) == 16 and e["path"] == "real" for e in loaded), loaded
    # The report is the output, on stdout, untouched.
    assert "CONSISTENT" in result.stdout
