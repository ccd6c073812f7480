"""A worker's own /metrics (`orchestrator-worker serve --metrics-listen`), as Slurm or
Kubernetes run it beside a standalone coordinator: its load by path, the version it serves and
its probes, before and after a rolling update."""

import re
import subprocess
import threading
import time

import harness
from harness import bin_path, eventually, free_port, run, synth
from test_metrics import samples


def scrape(port: int) -> dict:
    return samples(harness.scrape(port))


def test_each_worker_exposes_its_loads_version_and_probes(tmp_path):
    root = tmp_path / "root"
    a, b = synth(root / "A", 1), synth(root / "B", 2)
    token, port = tmp_path / "token", free_port()
    coordinator = subprocess.Popen(
        [bin_path("orchestrator"), "coordinator", "--tp", "2", "--probe", "2,16", "--checkpoint", str(a), "--allow-root", str(root),
         "--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--serve", "--join-timeout", "60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers, metrics = [], [free_port(), free_port()]
    try:
        eventually("the coordinator writes the token", token.exists)
        for rank, m in enumerate(metrics):
            workers.append(subprocess.Popen(
                [bin_path("orchestrator-worker"), "serve", "--coordinator", f"http://127.0.0.1:{port}", "--rank", str(rank),
                 "--token-file", str(token), "--allow-root", str(root), "--metrics-listen", f"127.0.0.1:{m}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        lines = []
        for line in coordinator.stderr:
            lines.append(line)
            if line.startswith("serving:"):
                break
        else:
            raise AssertionError("".join(lines))
        threading.Thread(target=lambda: [None for _ in coordinator.stderr], daemon=True).start()
        before = [scrape(m) for m in metrics]
        for tp, p in enumerate(before):
            (labels, seconds), = p["orchestrator_worker_load_seconds"]
            assert labels == {"replica": "0", "tp_rank": str(tp), "path": "real"} and seconds > 0, p
            (_, loaded), = p["orchestrator_worker_load_bytes_total"]
            assert loaded > 0
            (labels, one), = p["orchestrator_worker_version_info"]
            assert one == 1 and re.fullmatch(r"[0-9a-f]{16}", labels["version"])
            assert sum(v for _, v in p["orchestrator_worker_probes_total"]) >= 1  # the launch's probe
        old = before[0]["orchestrator_worker_version_info"][0][0]["version"]

        remote = ["--coordinator", f"http://127.0.0.1:{port}", "--token-file", str(token)]
        run("update", *remote, "--checkpoint", str(b))
        after = [scrape(m) for m in metrics]
        for p in after:
            paths = {l["path"]: v for l, v in p["orchestrator_worker_load_seconds"]}
            assert set(paths) == {"real", "stage"}, paths
            (labels, _), = p["orchestrator_worker_version_info"]
            assert labels["version"] != old
            assert {l["version"] for l, _ in p["orchestrator_worker_probes_total"]} == {old, labels["version"]}
        run("shutdown", *remote)
        assert coordinator.wait(timeout=60) == 0
    finally:
        for p in [coordinator, *workers]:
            if p.poll() is None:
                p.kill()
        time.sleep(0.1)
