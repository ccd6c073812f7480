"""Every --json document validates against its committed schema in docs/schemas (draft 2020-12,
checked by the `jsonschema` package, not by our code)."""

import json
import subprocess
import sys

import jsonschema
import pytest

from harness import ROOT, run, synth

SCHEMAS = ROOT / "docs" / "schemas"


def check(name: str, text: str) -> dict:
    doc = json.loads(text)
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)
    return doc


def test_report_update_and_probe_documents(tmp_path, served_factory):
    root = tmp_path / "root"
    a, b = synth(root / "A", 1), synth(root / "B", 2)
    launched = run("launch", "--tp", "2", "--probe", "2,16", "--checkpoint", str(a), "--json")
    assert check("report", launched.stdout)["ok"]
    cluster = served_factory("--tp", "2", "--dp", "2", "--probe", "2,16", "--checkpoint", str(a), "--allow-root", str(root))
    assert check("report", cluster.cli("report", "--json").stdout)["replicas"]
    assert check("update", cluster.cli("update", "--checkpoint", str(b), "--json").stdout)["ok"]
    refused = cluster.cli("update", "--checkpoint", str(tmp_path), "--json", check=False)
    assert not check("update", refused.stdout)["ok"]
    assert check("probe", cluster.cli("probe", "--rate", "4", "--duration", "1", "--json").stdout)["served"] == 4


def test_manifest_and_verify_dump_documents(tmp_path):
    fixture = ROOT / "tests" / "fixtures" / "python-v41-micro-fp8"
    out = tmp_path / "m.json"
    manifest = check("manifest", run("checkpoint", "manifest", str(fixture), "--tp", "2", "--json", "--out", str(out)).stdout)
    assert manifest == json.loads(out.read_text())
    for layout in ("expected", "permutation_skipped"):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_python_fixture.py"), "--dump", str(tmp_path / layout),
                        "--checkpoint", str(fixture), "--tp", "2", "--rank", "1", "--layout", layout], check=True, capture_output=True)
        r = run("verify-dump", str(tmp_path / layout), "--manifest", str(out), "--json", check=False)
        assert check("verify-dump", r.stdout)["ok"] == (layout == "expected")


@pytest.mark.parametrize("name", ["report", "update", "probe", "manifest", "verify-dump"])
def test_the_cli_prints_the_committed_schema(name):
    assert run("schema", name).stdout == (SCHEMAS / f"{name}.schema.json").read_text()
