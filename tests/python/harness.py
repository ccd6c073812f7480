"""The harness of the Python tests (tests/python and python/tests): helpers that run the real binaries: a served cluster started with `orchestrator launch
--serve`, scraped and driven as an operator would. `ORCHESTRATOR_BIN_DIR` names the directory
of `orchestrator` and `orchestrator-worker` (default: the workspace's target/debug)."""

import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("ORCHESTRATOR_BIN_DIR", ROOT / "target" / "debug"))


def bin_path(name: str) -> str:
    path = BIN_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build the workspace first (cargo build --workspace)")
    return str(path)


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([bin_path("orchestrator"), *args], capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"orchestrator {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def synth(out: Path, seed: int) -> Path:
    run("checkpoint", "synth", "--out", str(out), "--preset", "tiny", "--layers", "2", "--seed", str(seed))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OPENMETRICS = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"


def scrape(port: int, openmetrics: bool = True) -> str:
    headers = {"Accept": OPENMETRICS} if openmetrics else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        kind = r.headers["Content-Type"]
        assert kind.startswith("application/openmetrics-text" if openmetrics else "text/plain; version=0.0.4"), kind
        return r.read().decode()


class Served:
    """`orchestrator launch --serve ...` until its `--ready-file` says how to call the cluster;
    stopped on close."""

    def __init__(self, *args: str):
        self.metrics_port = free_port()
        self.ready_dir = tempfile.TemporaryDirectory()
        ready_file = Path(self.ready_dir.name) / "ready.json"
        cmd = [
            bin_path("orchestrator"), "launch", "--serve", "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
            "--ready-file", str(ready_file), *args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: [self.stderr.append(line) for line in self.proc.stderr], daemon=True).start()
        deadline = time.monotonic() + 120
        while not ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError("the cluster did not come up:\n" + "".join(self.stderr))
            time.sleep(0.02)
        ready = json.loads(ready_file.read_text())
        assert ready["pid"] == self.proc.pid, ready
        self.coordinator, self.token_file = ready["coordinator"], ready["token_file"]

    def cli(self, verb: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run(verb, "--coordinator", self.coordinator, "--token-file", self.token_file, *args, check=check)

    def scrape(self, openmetrics: bool = True) -> str:
        """/metrics as Prometheus asks for it (OpenMetrics), or as a classic scraper does."""
        return scrape(self.metrics_port, openmetrics)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.cli("shutdown", check=False)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.ready_dir.cleanup()


@pytest.fixture
def served_factory():
    """Starts served clusters; shuts them down after the test."""
    clusters: list[Served] = []

    def start(*args: str) -> Served:
        c = Served(*args)
        clusters.append(c)
        return c

    yield start
    for c in clusters:
        c.close()


def eventually(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
