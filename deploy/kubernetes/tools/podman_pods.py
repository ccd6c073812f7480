#!/usr/bin/env python3
"""Turns rendered orchestrator manifests into Pod YAML for `podman kube play` (called by
../podman-play.sh): the pods the controllers would create, with what they would inject set
explicitly.

    podman_pods.py --rendered R.yaml --out DIR --tp T --dp D --image IMG --ip-prefix 198.18.77
                   --secret orchestrator-token=DIR --secret orchestrator-tls=DIR --models DIR [--gpu]

- coordinator: the Deployment's pod template, named after the Service (orchestrator-coordinator)
  so the workers' https://orchestrator-coordinator:50050 resolves on the podman network;
- workers: T*D pods from the LeaderWorkerSet's worker template (pods NAME-G and NAME-G-W with
  LWS_WORKER_INDEX, LWS_GROUP_SIZE, LWS_LEADER_ADDRESS and the group-index label) or from the
  StatefulSet's template (pods NAME-N).

Env from the downward API (metadata.name, metadata.labels[...], spec.nodeName, status.podIP)
and from the values ConfigMap is resolved to literal values (kube play supports neither), and
$(VAR) in command/args is expanded as the kubelet does. Each pod gets a static IP (POD_IP) and
a node name of its own (spec.nodeName: play-node-N, never the pod's host name), so the report
shows whether the hosts come from NODE_NAME. A CPU run (no --gpu) drops the GPU request,
ORCHESTRATOR_DEVICE and the other resources, and uses the dummy geometry (--dummy --preset
tiny --layers 1) instead of --checkpoint. Probes are dropped (podman 4.3 cannot run gRPC
probes; wait_ready.py asks the same health services), and so are containerPorts (kube play 4.3
would publish each on the host, where the pods' equal ports collide; the host reaches the pod
IPs directly). Secrets become read-only host directories, the model PVC a host directory, each
emptyDir a directory per pod (podman would share a named volume between pods).

Writes DIR/NN-NAME.yaml per pod and DIR/plan.json (per pod: name, file, ip, role, rank, node,
containers, the gRPC port and the plaintext --health-listen port, and the probes' services).
"""

import argparse
import copy
import json
import os
import re
import sys

import yaml

DUMMY = ["--dummy", "--preset", "tiny", "--layers", "1"]


def load(path):
    with open(path) as fh:
        return [d for d in yaml.safe_load_all(fh) if d]


def find(objs, kind, name=None):
    out = [o for o in objs if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]
    return out


def expand(s, env):
    """$(VAR) as the kubelet expands it; $$(VAR) stays literal."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), s)


def resolve_env(container, pod_meta, node_name, pod_ip, configmaps, extra):
    """Literal env: the controller's injected vars first (as LWS does), then the container's."""
    out = []
    values = {}
    for k, v in extra:
        out.append({"name": k, "value": str(v)})
        values[k] = str(v)
    for e in container.get("env") or []:
        name = e["name"]
        if "value" in e:
            val = expand(str(e["value"]), values)
        else:
            vf = e.get("valueFrom") or {}
            if "fieldRef" in vf:
                fp = vf["fieldRef"]["fieldPath"]
                m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", fp)
                if fp == "metadata.name":
                    val = pod_meta["name"]
                elif fp == "metadata.namespace":
                    val = pod_meta.get("namespace", "default")
                elif m:
                    val = (pod_meta.get("labels") or {}).get(m.group(1), "")
                elif fp == "spec.nodeName":
                    val = node_name
                elif fp in ("status.podIP", "status.hostIP"):
                    val = pod_ip
                else:
                    raise SystemExit(f"{container['name']}: env {name}: fieldRef {fp} is not supported here")
            elif "configMapKeyRef" in vf:
                ref = vf["configMapKeyRef"]
                cm = configmaps.get(ref["name"])
                if cm is None or ref["key"] not in (cm.get("data") or {}):
                    raise SystemExit(f"{container['name']}: env {name}: no ConfigMap {ref['name']} key {ref['key']}")
                val = cm["data"][ref["key"]]
            else:
                raise SystemExit(f"{container['name']}: env {name}: {list(vf)} is not supported here")
        out.append({"name": name, "value": str(val)})
        values[name] = str(val)
    return out, values


def pod_from_template(template, name, labels, args_fn, env_extra, ip, node_name, configmaps, secret_dirs, models, gpu, restart):
    emptydir_root = os.path.join(os.path.dirname(models), "emptydir")
    tmpl = copy.deepcopy(template)
    meta = {"name": name, "labels": {**((tmpl.get("metadata") or {}).get("labels") or {}), **labels}}
    spec = tmpl["spec"]
    # Fields podman kube play does not use or a one-host run cannot honour.
    for k in ("tolerations", "affinity", "nodeSelector", "topologySpreadConstraints", "automountServiceAccountToken", "enableServiceLinks", "serviceAccountName"):
        spec.pop(k, None)
    spec["restartPolicy"] = restart
    spec["hostname"] = name
    for c in spec["containers"]:
        env, values = resolve_env(c, meta, node_name, ip, configmaps, env_extra)
        if not gpu:
            env = [e for e in env if e["name"] != "ORCHESTRATOR_DEVICE"]
            values.pop("ORCHESTRATOR_DEVICE", None)
        c["env"] = env
        c["command"] = [expand(a, values) for a in c.get("command") or []]
        c["args"] = [expand(a, values) for a in args_fn(c.get("args") or [], values)]
        for p in ("readinessProbe", "livenessProbe", "startupProbe"):
            c.pop(p, None)
        c.pop("ports", None)
        if gpu:
            lim = (c.get("resources") or {}).get("limits") or {}
            c["resources"] = {"limits": {k: v for k, v in lim.items() if k == "nvidia.com/gpu"}}
        else:
            c.pop("resources", None)
    vols = []
    for v in spec.get("volumes") or []:
        if "secret" in v:
            sn = v["secret"]["secretName"]
            base = next((b for b in secret_dirs if sn == b or re.fullmatch(re.escape(b) + r"-[a-z0-9]{10}", sn)), None)
            if base is None:
                raise SystemExit(f"{name}: secret volume {v['name']}: no directory for Secret {sn} (--secret NAME=DIR)")
            vols.append({"name": v["name"], "hostPath": {"path": secret_dirs[base], "type": "Directory"}})
        elif "persistentVolumeClaim" in v:
            vols.append({"name": v["name"], "hostPath": {"path": models, "type": "Directory"}})
        elif "emptyDir" in v:
            # kube play (4.3) turns an emptyDir into a named volume shared by every pod that
            # uses the name; a directory per pod and volume is what the kubelet gives.
            d = os.path.join(emptydir_root, name, v["name"])
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o1777)
            vols.append({"name": v["name"], "hostPath": {"path": d, "type": "Directory"}})
        else:
            vols.append(v)
    spec["volumes"] = vols
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def probe_info(container):
    """The gRPC port, the --health-listen port and the probes' (port, service), as declared."""
    grpc_port = next((p["containerPort"] for p in container.get("ports") or [] if p.get("name") == "grpc"), None)
    health_port = None
    for x in container.get("args") or []:
        m = re.fullmatch(r"--health-listen=\S*:(\d+)", str(x))
        if m:
            health_port = int(m.group(1))
    probes = {}
    for p in ("readinessProbe", "livenessProbe"):
        g = (container.get(p) or {}).get("grpc")
        if g:
            probes[p] = {"port": g.get("port"), "service": g.get("service", "")}
    return grpc_port, health_port, probes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rendered", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--image", required=True)
    ap.add_argument("--ip-prefix", required=True, help="first three octets of the podman network's /24")
    ap.add_argument("--secret", action="append", default=[], help="NAME=DIR")
    ap.add_argument("--models", required=True)
    ap.add_argument("--gpu", action="store_true")
    a = ap.parse_args()

    objs = load(a.rendered)
    secret_dirs = dict(s.split("=", 1) for s in a.secret)
    configmaps = {o["metadata"]["name"]: copy.deepcopy(o) for o in find(objs, "ConfigMap")}
    # The play's geometry replaces the values' (a CPU run of a tiny dummy model).
    for cm in configmaps.values():
        if cm["metadata"]["name"].startswith("orchestrator-values"):
            cm["data"].update({"tp": str(a.tp), "dp": str(a.dp), "workers": str(a.tp * a.dp)})
    deploy = find(objs, "Deployment", "orchestrator-coordinator")
    svc = find(objs, "Service", "orchestrator-coordinator")
    lws = find(objs, "LeaderWorkerSet", "orchestrator-worker")
    sts = find(objs, "StatefulSet", "orchestrator-worker")
    if len(deploy) != 1 or len(svc) != 1 or len(lws) + len(sts) != 1:
        raise SystemExit("expected the coordinator Deployment and Service and one worker LeaderWorkerSet or StatefulSet")

    def image(pod):
        for c in pod["spec"]["containers"]:
            c["image"] = a.image
            c["imagePullPolicy"] = "Never"
        return pod

    pods = []  # (pod, role, rank, node, template container)
    ip_n = [10]

    def next_ip():
        ip = f"{a.ip_prefix}.{ip_n[0]}"
        ip_n[0] += 1
        return ip

    ctmpl = deploy[0]["spec"]["template"]

    def coord_args(args, values):
        out = []
        for x in args:
            if x.startswith("--checkpoint"):
                out += DUMMY
            else:
                out.append(x)
        return out

    cip = next_ip()
    node = "play-node-0"
    pod = pod_from_template(ctmpl, "orchestrator-coordinator", {}, coord_args, [], cip, node, configmaps, secret_dirs, a.models, a.gpu, "Never")
    pods.append((image(pod), "coordinator", None, node, cip, ctmpl["spec"]["containers"][0]))

    wtmpl = lws[0]["spec"]["leaderWorkerTemplate"]["workerTemplate"] if lws else sts[0]["spec"]["template"]
    for rank in range(a.tp * a.dp):
        g, w = divmod(rank, a.tp)
        ip = next_ip()
        node = f"play-node-{rank + 1}"
        if lws:
            name = f"orchestrator-worker-{g}" + (f"-{w}" if w else "")
            labels = {
                "leaderworkerset.sigs.k8s.io/name": "orchestrator-worker",
                "leaderworkerset.sigs.k8s.io/group-index": str(g),
                "leaderworkerset.sigs.k8s.io/worker-index": str(w),
            }
            extra = [("LWS_LEADER_ADDRESS", f"orchestrator-worker-{g}"), ("LWS_GROUP_SIZE", a.tp), ("LWS_WORKER_INDEX", w)]
        else:
            name = f"orchestrator-worker-{rank}"
            labels = {"statefulset.kubernetes.io/pod-name": name, "apps.kubernetes.io/pod-index": str(rank)}
            extra = []
        pod = pod_from_template(wtmpl, name, labels, lambda args, values: args, extra, ip, node, configmaps, secret_dirs, a.models, a.gpu, "Never")
        pods.append((image(pod), "worker", rank, node, ip, wtmpl["spec"]["containers"][0]))

    os.makedirs(a.out, exist_ok=True)
    plan = []
    for i, (pod, role, rank, node, ip, tc) in enumerate(pods):
        f = os.path.join(a.out, f"{i:02d}-{pod['metadata']['name']}.yaml")
        with open(f, "w") as fh:
            yaml.safe_dump(pod, fh, sort_keys=False)
        grpc_port, health_port, probes = probe_info(tc)
        if grpc_port is None or health_port is None or set(probes) != {"readinessProbe", "livenessProbe"}:
            raise SystemExit(f"{pod['metadata']['name']}: the template needs a `grpc` port, --health-listen and gRPC readiness and liveness probes")
        plan.append({"name": pod["metadata"]["name"], "file": f, "ip": ip, "role": role, "rank": rank, "node": node,
                     "port": grpc_port, "health_port": health_port, "probes": probes,
                     "containers": [c["name"] for c in pod["spec"]["containers"]]})
    with open(os.path.join(a.out, "plan.json"), "w") as fh:
        json.dump(plan, fh, indent=1)
    for p in plan:
        rank = "" if p["rank"] is None else f"rank {p['rank']}"
        print(f"  {p['name']:26} {p['ip']:15} {p['node']:12} {p['role']:11} {rank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
