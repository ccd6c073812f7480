#!/usr/bin/env python3
"""Waits until every pod of a podman-play plan is ready, as the kubelet's probes would judge
it: grpc.health.v1 service "" SERVING (readiness) and, unless --no-liveness, "liveness"
SERVING, over TLS with the cluster CA, verifying the server as `orchestrator.cluster`.
One-shot pods must exit 0 instead. Fails early, naming the pod, when a container exits.

    wait_ready.py --plan plan.json --ca ca.pem --timeout 180 [--no-liveness] [--roles coordinator,worker,oneshot]
"""

import argparse
import json
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVER_NAME = "orchestrator.cluster"
EMPTY = '""'


def status(stub, service):
    try:
        r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    except grpc.RpcError as e:
        return f"{e.code().name}"


def container_state(pod, container):
    name = f"{pod}-{container}"
    p = subprocess.run(["podman", "inspect", name, "--format", "{{.State.Status}} {{.State.ExitCode}}"], capture_output=True, text=True)
    if p.returncode != 0:
        return "missing", None
    st, code = p.stdout.split()
    return st, int(code)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--ca", required=True)
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--no-liveness", action="store_true")
    ap.add_argument("--roles", default="coordinator,worker,oneshot")
    a = ap.parse_args()
    roles = set(a.roles.split(","))
    with open(a.plan) as fh:
        plan = [p for p in json.load(fh) if p["role"] in roles]
    creds = grpc.ssl_channel_credentials(root_certificates=open(a.ca, "rb").read())
    stubs = {}
    for p in plan:
        if p["port"]:
            ch = grpc.secure_channel(f"{p['ip']}:{p['port']}", creds, options=[("grpc.ssl_target_name_override", SERVER_NAME)])
            stubs[p["name"]] = health_pb2_grpc.HealthStub(ch)
    services = [""] + ([] if a.no_liveness else ["liveness"])
    last = {}
    deadline = time.monotonic() + a.timeout
    start = time.monotonic()
    while True:
        pending = []
        for p in plan:
            for c in p["containers"]:
                st, code = container_state(p["name"], c)
                if p["role"].startswith("oneshot"):
                    if st == "exited" and code == 0:
                        now = "exited 0"
                    elif st == "exited":
                        print(f"FAIL {p['name']}/{c}: exited {code}", flush=True)
                        return 1
                    else:
                        now = st
                        pending.append(p["name"])
                else:
                    if st != "running":
                        print(f"FAIL {p['name']}/{c}: {st} (exit {code}) before it was ready", flush=True)
                        return 1
                    now = " ".join(f"{s or EMPTY}={status(stubs[p['name']], s)}" for s in services)
                    if any(not part.endswith("=SERVING") for part in now.split()):
                        pending.append(p["name"])
                if last.get((p["name"], c)) != now:
                    print(f"  {time.monotonic() - start:6.1f}s {p['name']}/{c}: {now}", flush=True)
                    last[(p["name"], c)] = now
        if not pending:
            print(f"ready: {len(plan)} pods after {time.monotonic() - start:.1f}s", flush=True)
            return 0
        if time.monotonic() > deadline:
            print(f"FAIL not ready after {a.timeout:.0f}s: {', '.join(sorted(set(pending)))}", flush=True)
            return 1
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
