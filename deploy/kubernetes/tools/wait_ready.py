#!/usr/bin/env python3
"""Waits until pods of a podman-play plan are ready, as the kubelet's probes would judge it,
using `orchestrator health` (the binary's own grpc.health.v1 client) from the host:

- each probe of the manifests (readiness: service "", liveness: service "liveness") on the
  port it names, in plaintext, as the kubelet's gRPC probe connects: the --health-listen port;
- and readiness ("") on the pod's TLS gRPC port too, verified against the cluster CA, so the
  plaintext listener is shown to tell what the main port tells.

A pod is ready when all three say SERVING. Fails early, naming the pod, when a container
exits; on time-out, names the pods that are not ready and what they answered.

    wait_ready.py --plan plan.json --orchestrator BIN --tls-dir DIR --dev BRIDGE --timeout 120
                  [--roles coordinator,worker]
    wait_ready.py ... --expect-not-ready   # instead: wait until liveness SERVING, then require
                                           # readiness NOT_SERVING on both ports (not verified yet)
"""

import argparse
import json
import subprocess
import sys
import time


def checks(p):
    """(label, orchestrator health arguments) for one pod."""
    out = []
    for probe, label in (("readinessProbe", "ready"), ("livenessProbe", "live")):
        pr = p["probes"][probe]
        out.append((f"{label}@{pr['port']}", ["--address", f"http://{p['ip']}:{pr['port']}", "--service", pr["service"]]))
    out.append((f"ready@{p['port']}/tls", ["--address", f"https://{p['ip']}:{p['port']}", "--service", ""]))
    return out


def ask_all(binary, tls_dir, jobs):
    """Runs every `orchestrator health` at once; returns their answers (SERVING, NOT_SERVING,
    UNREACHABLE, or the error)."""
    procs = []
    for args in jobs:
        cmd = [binary, "health", *args]
        if args[1].startswith("https://"):
            cmd += ["--tls-dir", tls_dir]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    answers = []
    for pr in procs:
        try:
            out, err = pr.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pr.kill()
            out, err = pr.communicate()
            answers.append("TIMEOUT")
            continue
        words = (out.strip() or err.strip() or f"exit {pr.returncode}").split()
        answers.append(words[0] if words else f"exit {pr.returncode}")
    return answers


def container_states(plan):
    names = [f"{p['name']}-{c}" for p in plan for c in p["containers"]]
    r = subprocess.run(["podman", "inspect", "--format", "{{.Name}} {{.State.Status}} {{.State.ExitCode}}", *names],
                       capture_output=True, text=True)
    states = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3:
            states[parts[0]] = (parts[1], int(parts[2]))
    return {n: states.get(n, ("missing", None)) for n in names}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--orchestrator", required=True, help="the orchestrator binary (its `health` command)")
    ap.add_argument("--tls-dir", required=True)
    ap.add_argument("--dev", required=True, help="the podman network's bridge: every pod IP must route there")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--roles", default="coordinator,worker")
    ap.add_argument("--expect-not-ready", action="store_true")
    a = ap.parse_args()
    roles = set(a.roles.split(","))
    with open(a.plan) as fh:
        plan = [p for p in json.load(fh) if p["role"] in roles]
    # Ask only addresses on a local network (the podman bridge): an address that the default
    # route would carry leaves the machine.
    for p in plan:
        r = subprocess.run(["ip", "-o", "route", "get", p["ip"]], capture_output=True, text=True)
        if r.returncode != 0 or " via " in r.stdout or f" dev {a.dev} " not in r.stdout:
            print(f"FAIL {p['name']}: {p['ip']} is not on the podman network's bridge {a.dev} ({r.stdout.strip() or r.stderr.strip()}); not probing it", flush=True)
            return 1
    start = time.monotonic()
    deadline = start + a.timeout
    last = {}
    while True:
        for name, (st, code) in container_states(plan).items():
            if st != "running":
                print(f"FAIL {name}: {st}" + ("" if code is None else f" (exit {code})") + " before it was ready", flush=True)
                return 1
        jobs, owners = [], []
        for p in plan:
            for label, args in checks(p):
                jobs.append(args)
                owners.append((p["name"], label))
        answers = ask_all(a.orchestrator, a.tls_dir, jobs)
        now = {}
        for (name, label), ans in zip(owners, answers):
            now.setdefault(name, []).append(f"{label}={ans}")
        pending = []
        for p in plan:
            parts = now[p["name"]]
            line = " ".join(parts)
            if last.get(p["name"]) != line:
                print(f"  {time.monotonic() - start:6.1f}s {p['name']}: {line}", flush=True)
                last[p["name"]] = line
            ans = {x.split("=")[0]: x.split("=")[1] for x in parts}
            if a.expect_not_ready:
                live = [v for k, v in ans.items() if k.startswith("live")]
                ready = [v for k, v in ans.items() if k.startswith("ready")]
                if all(v == "SERVING" for v in live):
                    if any(v != "NOT_SERVING" for v in ready):
                        print(f"FAIL {p['name']}: live but readiness is not NOT_SERVING before the cluster is verified: {line}", flush=True)
                        return 1
                else:
                    pending.append(p["name"])
            elif any(v != "SERVING" for v in ans.values()):
                pending.append(p["name"])
        if not pending:
            what = "live and NOT_SERVING (not verified yet)" if a.expect_not_ready else "ready (every health check SERVING)"
            print(f"{what}: {len(plan)} pod(s) after {time.monotonic() - start:.1f}s", flush=True)
            return 0
        if time.monotonic() > deadline:
            print(f"FAIL not ready after {a.timeout:.0f}s: " + "; ".join(f"{n}: {last[n]}" for n in sorted(set(pending))), flush=True)
            return 1
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
