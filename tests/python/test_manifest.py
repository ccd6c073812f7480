"""`orchestrator checkpoint manifest` against the independent Python reference
(scripts/make_python_fixture.py's expected.json), and `orchestrator verify-dump` on dumps that
Python writes in the expected layout and in every known wrong one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT, bin_path, run

FIXTURES = ROOT / "tests" / "fixtures"
FP8 = FIXTURES / "python-v41-micro-fp8"
BF16 = FIXTURES / "python-v41-micro-bf16"


def manifest(tmp_path: Path, checkpoint: Path, tp: int, rule: str = "rceil") -> tuple[Path, dict]:
    out = tmp_path / f"manifest-{checkpoint.name}-tp{tp}-{rule}.json"
    run("checkpoint", "manifest", str(checkpoint), "--tp", str(tp), "--scale-rule", rule, "--out", str(out))
    return out, json.loads(out.read_text())


def python_dump(out: Path, checkpoint: Path, tp: int, rank: int, layout: str = "expected", rule: str = "rceil",
                as_rank: int | None = None) -> Path:
    cmd = [sys.executable, str(ROOT / "scripts" / "make_python_fixture.py"), "--dump", str(out), "--checkpoint", str(checkpoint),
           "--tp", str(tp), "--rank", str(rank), "--layout", layout, "--rules", rule]
    if as_rank is not None:
        cmd += ["--as-rank", str(as_rank)]
    subprocess.run(cmd, check=True, capture_output=True)
    return out / f"rank{rank}.safetensors"


def verify(dump: Path, manifest_file: Path) -> tuple[int, dict]:
    r = run("verify-dump", str(dump), "--manifest", str(manifest_file), "--json", check=False)
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize("checkpoint", [FP8, BF16], ids=["fp8", "bf16"])
def test_the_manifest_equals_the_python_reference(tmp_path, checkpoint):
    expected = json.loads((checkpoint / "expected.json").read_text())["cases"]
    cases = {(c["tp"], c["scale_rule"]) for c in expected}
    assert len(cases) >= 2
    for tp, rule in sorted(cases):
        _, m = manifest(tmp_path, checkpoint, tp, rule)
        assert m["tp_size"] == tp and [r["tp_rank"] for r in m["ranks"]] == list(range(tp))
        for c in (c for c in expected if c["tp"] == tp and c["scale_rule"] == rule):
            r = m["ranks"][c["rank"]]
            ours = {n: {k: t[k] for k in ("dtype", "shape", "xxh3")} for n, t in r["kernel"].items()}
            assert ours == c["kernel"], (tp, rule, c["rank"])
            assert r["kernel_rank_digest"] == c["kernel_rank_digest"]
            assert r["source"] == c["source"] and r["source_rank_digest"] == c["source_rank_digest"]
            assert r["layout_identity"]["tp_size"] == tp and r["layout_identity"]["scale_rule"] == rule


CAUSES = [
    ("permutation_skipped", {"layers.0.attn.wq_b.weight", "layers.0.attn.wo_a.weight"}),
    ("permuted_twice", {"layers.0.attn.wq_b.weight", "layers.0.attn.wo_a.weight"}),
    ("scales_not_swizzled", {"layers.0.attn.wq_b.weight_scale", "layers.0.attn.wo_b.weight_scale"}),
    ("scales_not_packed", {"layers.0.attn.wo_a.weight_scale"}),
]


@pytest.mark.parametrize("layout,must_name", CAUSES, ids=[c[0] for c in CAUSES])
def test_verify_dump_names_each_wrong_layout(tmp_path, layout, must_name):
    mfile, _ = manifest(tmp_path, FP8, 2)
    dump = python_dump(tmp_path / layout, FP8, 2, 1, layout)
    code, v = verify(dump, mfile)
    assert code == 1 and not v["ok"], v
    findings = v["ranks"][0]["findings"]
    assert v["ranks"][0]["tp_rank"] == 1
    assert must_name <= {f["tensor"] for f in findings}, findings
    for f in findings:
        assert f["verdict"] == "differs" and f["cause"] == {"kind": "wrong_layout", "layout": layout}, f
    # The tensors the bug does not touch still match.
    assert v["ranks"][0]["matching"] == v["ranks"][0]["checked"] - len(findings) > 0


def test_verify_dump_names_another_ranks_shard_and_the_other_scale_rule(tmp_path):
    mfile, _ = manifest(tmp_path, FP8, 2)
    code, v = verify(python_dump(tmp_path / "swapped", FP8, 2, 0, as_rank=1), mfile)
    assert code == 1
    assert {json.dumps(f["cause"], sort_keys=True) for f in v["ranks"][0]["findings"]} == {
        json.dumps({"kind": "other_rank", "rank": 1, "layout": "expected"}, sort_keys=True)}
    # BF16 quantized with rceil where the engine was meant to use floor.
    mfile, _ = manifest(tmp_path, BF16, 2, "floor")
    code, v = verify(python_dump(tmp_path / "rule", BF16, 2, 1, rule="rceil"), mfile)
    assert code == 1
    causes = {f["cause"]["layout"] for f in v["ranks"][0]["findings"]}
    assert causes == {"other_scale_rule"}, v


def test_dumps_in_the_expected_layout_pass_from_python_and_from_our_loader(tmp_path):
    mfile, _ = manifest(tmp_path, FP8, 2)
    for rank in (0, 1):
        python_dump(tmp_path / "py", FP8, 2, rank)
    code, v = verify(tmp_path / "py", mfile)
    assert code == 0 and v["ok"] and [r["tp_rank"] for r in v["ranks"]] == [0, 1], v
    subprocess.run([bin_path("orchestrator-worker"), "load", "--checkpoint", str(FP8), "--tp", "2",
                    "--dump", str(tmp_path / "ours"), "--brief"], check=True, capture_output=True)
    code, v = verify(tmp_path / "ours", mfile)
    assert code == 0 and v["ok"], v


def test_bad_dumps_get_clear_errors(tmp_path):
    mfile, _ = manifest(tmp_path, FP8, 2)
    bad = tmp_path / "rank0.safetensors"
    bad.write_bytes(b"\xff" * 64)
    r = run("verify-dump", str(bad), "--manifest", str(mfile), check=False)
    assert r.returncode != 0 and "rank0.safetensors: not a safetensors file" in r.stderr, r.stderr
    odd = tmp_path / "weights.safetensors"
    odd.write_bytes(b"")
    r = run("verify-dump", str(odd), "--manifest", str(mfile), check=False)
    assert r.returncode != 0 and "expected a file named rank{R}.safetensors" in r.stderr, r.stderr
    far = python_dump(tmp_path / "far", FP8, 2, 0)
    far.rename(far.with_name("rank7.safetensors"))
    r = run("verify-dump", str(tmp_path / "far"), "--manifest", str(mfile), check=False)
    assert r.returncode != 0 and "rank 7 is not a rank of the manifest (TP 2)" in r.stderr, r.stderr
    r = run("verify-dump", str(tmp_path / "far"), "--manifest", str(bad), check=False)
    assert r.returncode != 0 and "not a manifest" in r.stderr, r.stderr


def test_an_engines_own_parameter_shapes_are_noted_not_failed(tmp_path):
    """Same bytes, another shape (an engine keeps wq_b's swizzled scale as 2-D): a match, noted."""
    import struct

    mfile, _ = manifest(tmp_path, FP8, 2)
    dump = python_dump(tmp_path / "engine", FP8, 2, 0)
    raw = dump.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    entry = header["layers.0.attn.wq_b.weight_scale"]
    entry["shape"] = [entry["shape"][0] // 512, 512]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    dump.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    code, v = verify(dump, mfile)
    assert code == 0 and v["ok"], v
    (note,) = v["ranks"][0]["notes"]
    assert note.startswith("layers.0.attn.wq_b.weight_scale: bytes as expected, stored as F8_E8M0 [") and "[16384]" in note, note
