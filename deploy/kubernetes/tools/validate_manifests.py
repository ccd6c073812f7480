#!/usr/bin/env python3
"""Validates rendered orchestrator manifests offline (called by ../validate.sh).

    validate_manifests.py --crd CRD.yaml --k8s-version 1.33.0 NAME=RENDERED.yaml ...

Each RENDERED.yaml is the output of `kubectl kustomize` for the kustomization NAME, rendered
with `buildMetadata: [originAnnotations]` so that every object names its source file.

1. Every object that is not a LeaderWorkerSet goes to `kubernetes-validate --strict -k VERSION`
   (wrong types and unknown fields are errors; a kind it has no schema for is an error here too,
   since a misspelt apiVersion or kind would otherwise pass with a warning).
2. Every LeaderWorkerSet is validated against the vendored CRD's openAPIV3Schema, made strict
   the way the API server's field validation is (an object schema with properties and without
   x-kubernetes-preserve-unknown-fields admits no other field), its metadata against the
   bundled ObjectMeta, and its leader and worker pod templates against the bundled strict
   PodTemplateSpec of VERSION.
3. Cross-object checks: the values ConfigMap (tp, dp, workers = tp * dp, gpusPerWorker), the
   fields it is copied into, every Secret and ConfigMap a pod names exists with the keys it
   uses, no placeholder left in an image or a claim, probes and Service target ports name
   ports the pods declare, the probes ask the health services "" (readiness) and "liveness" on
   the plaintext --health-listen port (every other port speaks TLS), and the workers'
   --coordinator address names the coordinator's Service and port.

Errors name the kustomization, the source file, the object and the field, and the exit status
is 1 when any check fails.
"""

import argparse
import base64
import copy
import json
import os
import re
import subprocess
import sys
import tempfile

import jsonschema
import referencing
import referencing.jsonschema
import yaml

ORIGIN = "config.kubernetes.io/origin"
LWS_API = "leaderworkerset.x-k8s.io/v1"

errors = []
notes = []


def error(where, field, message):
    errors.append(f"ERROR {where}: {field}: {message}" if field else f"ERROR {where}: {message}")


def origin_of(obj):
    """The source file kustomize recorded, and the object without that annotation."""
    obj = copy.deepcopy(obj)
    ann = (obj.get("metadata") or {}).get("annotations") or {}
    src = "?"
    if ORIGIN in ann:
        o = yaml.safe_load(ann.pop(ORIGIN)) or {}
        src = o.get("path") or o.get("configuredIn") or "?"
        if not ann:
            obj["metadata"].pop("annotations")
    return src, obj


def ident(obj):
    return f"{obj.get('kind', '?').lower()}/{(obj.get('metadata') or {}).get('name', '?')}"


def path_str(parts):
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (("." if out else "") + str(p))
    return out or "(object)"


# ---------------------------------------------------------------------------------------------
# 1. kubernetes-validate on everything but LeaderWorkerSets.


def run_kubernetes_validate(name, objs, version):
    if not objs:
        return
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for i, (src, obj) in enumerate(objs):
            f = os.path.join(tmp, f"{i:03d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml")
            with open(f, "w") as fh:
                yaml.safe_dump(obj, fh, sort_keys=False)
            files[f] = (src, obj)
        p = subprocess.run(
            ["kubernetes-validate", "--strict", "-k", version, *files], capture_output=True, text=True
        )
        out = (p.stdout + p.stderr).splitlines()
        seen_error = False
        for line in out:
            for f, (src, obj) in files.items():
                if f in line:
                    line = line.replace(f, f"{name}: {src}")
            if line.startswith("INFO"):
                continue
            if line.startswith(("ERROR", "WARN", "FATAL")):
                seen_error = True
                errors.append(line if not line.startswith("WARN") else "ERROR (no schema) " + line[5:])
            elif line.strip():
                errors.append(f"ERROR {name}: kubernetes-validate: {line}")
                seen_error = True
        if p.returncode != 0 and not seen_error:
            errors.append(f"ERROR {name}: kubernetes-validate exited {p.returncode}")
        print(f"  kubernetes-validate --strict -k {version}: {len(objs)} objects" + ("" if not seen_error else " (errors below)"))


# ---------------------------------------------------------------------------------------------
# 2. LeaderWorkerSets against the CRD and the bundled PodTemplateSpec.


def strict_structural(schema):
    """OpenAPI v3 (structural, as in a CRD) -> JSON Schema 2020-12 with unknown fields refused."""
    if isinstance(schema, list):
        return [strict_structural(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    s = {k: strict_structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    for k in ("properties", "patternProperties"):
        if k in schema:
            s[k] = {name: strict_structural(sub) for name, sub in schema[k].items()}
    if schema.get("x-kubernetes-int-or-string"):
        s.pop("type", None)
        s["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable"):
        s.pop("nullable")
        if "type" in s:
            s["type"] = [s["type"], "null"]
    if (
        schema.get("type") == "object"
        and "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        s["additionalProperties"] = False
    for k in ("format",):  # OpenAPI formats (int32, int64, byte, ...) are not JSON Schema's
        s.pop(k, None)
    return s


class LwsValidator:
    def __init__(self, crd_path, version):
        with open(crd_path) as fh:
            crd = yaml.safe_load(fh)
        versions = {v["name"]: v for v in crd["spec"]["versions"]}
        group = crd["spec"]["group"]
        self.api_versions = {f"{group}/{name}": v["schema"]["openAPIV3Schema"] for name, v in versions.items()}
        import kubernetes_validate  # noqa: F401 (the bundled schemas live beside it)

        base = os.path.join(os.path.dirname(kubernetes_validate.__file__), "kubernetes-json-schema")
        mm = ".".join(version.split(".")[:2])
        dirs = sorted(
            (d for d in os.listdir(base) if d.endswith("-local-strict")),
            key=lambda d: tuple(int(x) for x in d[1:].split("-")[0].split(".")[:2]),
        )
        pick = [d for d in dirs if tuple(int(x) for x in d[1:].split("-")[0].split(".")[:2]) <= tuple(int(x) for x in mm.split("."))]
        if not pick:
            raise SystemExit(f"kubernetes-validate has no schemas for {version}")
        self.schema_dir = os.path.join(base, pick[-1])
        with open(os.path.join(self.schema_dir, "_definitions.json")) as fh:
            defs = json.load(fh)
        with open(os.path.join(self.schema_dir, "podtemplatespec-v1.json")) as fh:
            self.pod_template = json.load(fh)
        self.registry = Registry_with(self.pod_template, defs)
        self.object_meta = {"$ref": "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
        self.k8s_version = pick[-1].split("-")[0]

    def validate(self, name, src, obj):
        where = f"{name}: {src}: {ident(obj)}"
        api = obj.get("apiVersion")
        if api not in self.api_versions:
            error(where, "apiVersion", f"{api!r} is not served by the vendored CRD (serves {', '.join(self.api_versions)})")
            return
        schema = strict_structural(self.api_versions[api])
        # The API server validates metadata itself (the CRD leaves it open): use ObjectMeta.
        schema["properties"]["metadata"] = self.object_meta
        checks = [("", obj, schema)]
        lwt = (obj.get("spec") or {}).get("leaderWorkerTemplate") or {}
        for tmpl in ("workerTemplate", "leaderTemplate"):
            if isinstance(lwt.get(tmpl), dict):
                checks.append((f"spec.leaderWorkerTemplate.{tmpl}", lwt[tmpl], self.pod_template))
        for prefix, inst, sch in checks:
            v = jsonschema.Draft202012Validator(sch, registry=self.registry)
            for e in sorted(v.iter_errors(inst), key=lambda e: list(e.absolute_path)):
                field = path_str(list(e.absolute_path))
                if prefix:
                    field = prefix + ("" if field == "(object)" else ("." + field if not field.startswith("[") else field))
                label = "CRD schema" if not prefix else f"PodTemplateSpec {self.k8s_version}"
                error(where, field, f"{e.message} ({label})")


def Registry_with(pod_template, defs):
    res_pt = referencing.Resource.from_contents(pod_template, default_specification=referencing.jsonschema.DRAFT202012)
    res_defs = referencing.Resource.from_contents(defs, default_specification=referencing.jsonschema.DRAFT202012)
    return referencing.Registry().with_resources(
        [
            (pod_template.get("$id", "https://kubernetes.io/api/podtemplatespec/v1"), res_pt),
            ("https://kubernetes.io/api/_definitions.json", res_defs),
            (defs.get("$id", "https://kubernetes.io/api/_definitions.json"), res_defs),
        ]
    )


# ---------------------------------------------------------------------------------------------
# 3. Cross-object checks.


def pod_templates(obj):
    """(field path, PodTemplateSpec) of a workload."""
    kind = obj.get("kind")
    spec = obj.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        yield "spec.template", spec.get("template") or {}
    elif kind == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        for t in ("workerTemplate", "leaderTemplate"):
            if t in lwt:
                yield f"spec.leaderWorkerTemplate.{t}", lwt[t]
    elif kind == "Pod":
        yield "", obj


def positive_int(where, key, text):
    if not re.fullmatch(r"[1-9][0-9]*", str(text or "")):
        error(where, f"data.{key}", f"must be a positive integer, is {text!r}")
        return None
    return int(text)


def cross_checks(name, objs):
    by_kind = {}
    for src, o in objs:
        by_kind.setdefault(o["kind"], []).append((src, o))
    values = [(s, o) for s, o in by_kind.get("ConfigMap", []) if o["metadata"]["name"].startswith("orchestrator-values")]
    if len(values) != 1:
        error(name, "", f"expected one orchestrator-values ConfigMap, found {len(values)}")
        return
    vsrc, vobj = values[0]
    vwhere = f"{name}: {vsrc}: {ident(vobj)}"
    data = vobj.get("data") or {}
    for key in ("image", "tp", "dp", "workers", "checkpoint", "pvc", "gpusPerWorker"):
        if key not in data:
            error(vwhere, f"data.{key}", "missing")
    tp = positive_int(vwhere, "tp", data.get("tp"))
    dp = positive_int(vwhere, "dp", data.get("dp"))
    workers = positive_int(vwhere, "workers", data.get("workers"))
    gpus = positive_int(vwhere, "gpusPerWorker", data.get("gpusPerWorker"))
    if tp and dp and workers and workers != tp * dp:
        error(vwhere, "data.workers", f"must be tp * dp = {tp} * {dp} = {tp * dp}, is {workers}")
    if gpus and gpus != 1:
        notes.append(f"NOTE {vwhere}: gpusPerWorker={gpus}: each worker drives one GPU; the others stay idle")
    if not str(data.get("checkpoint", "")).startswith("/models/") and data.get("checkpoint") != "/models":
        error(vwhere, "data.checkpoint", f"must lie under /models (the model volume's mount), is {data.get('checkpoint')!r}")

    for src, o in by_kind.get("LeaderWorkerSet", []):
        where = f"{name}: {src}: {ident(o)}"
        spec = o.get("spec") or {}
        if dp and spec.get("replicas") != dp:
            error(where, "spec.replicas", f"must be dp = {dp}, is {spec.get('replicas')!r}")
        if tp and (spec.get("leaderWorkerTemplate") or {}).get("size") != tp:
            error(where, "spec.leaderWorkerTemplate.size", f"must be tp = {tp}, is {(spec.get('leaderWorkerTemplate') or {}).get('size')!r}")
        if spec.get("startupPolicy", "LeaderCreated") != "LeaderCreated":
            error(where, "spec.startupPolicy", "must be LeaderCreated: no worker is Ready before the whole cluster is verified")
    for src, o in by_kind.get("StatefulSet", []):
        where = f"{name}: {src}: {ident(o)}"
        spec = o.get("spec") or {}
        if workers and spec.get("replicas") != workers:
            error(where, "spec.replicas", f"must be workers = {workers}, is {spec.get('replicas')!r}")
        if spec.get("podManagementPolicy") != "Parallel":
            error(where, "spec.podManagementPolicy", "must be Parallel: no pod is Ready before the whole cluster is verified")
        svc = spec.get("serviceName")
        if not any(s[1]["metadata"]["name"] == svc for s in by_kind.get("Service", [])):
            error(where, "spec.serviceName", f"no Service {svc!r} in this kustomization")

    secrets = {o["metadata"]["name"]: o for _, o in by_kind.get("Secret", [])}
    configmaps = {o["metadata"]["name"]: o for _, o in by_kind.get("ConfigMap", [])}
    services = by_kind.get("Service", [])
    coordinator_svc = [o for _, o in services if o["metadata"]["name"] == "orchestrator-coordinator"]

    for sn, sec in secrets.items():
        placeholders = []
        for key, val in (sec.get("data") or {}).items():
            try:
                text = base64.b64decode(val).decode("utf-8", "replace")
            except ValueError:
                text = str(val)
            if "REPLACE ME" in text:
                placeholders.append(key)
        if placeholders:
            notes.append(f"NOTE {name}: secret/{sn}: {', '.join(sorted(placeholders))}: still the placeholders (generate them: deploy/README.md, Secrets)")

    for src, o in objs:
        where = f"{name}: {src}: {ident(o)}"
        for tpath, tmpl in pod_templates(o):
            pspec = tmpl.get("spec") or {}
            pre = (tpath + ".spec") if tpath else "spec"
            volumes = {v.get("name"): v for v in pspec.get("volumes") or []}
            for i, v in enumerate(pspec.get("volumes") or []):
                if "secret" in v:
                    sn = v["secret"].get("secretName")
                    if sn not in secrets:
                        error(where, f"{pre}.volumes[{i}].secret.secretName", f"no Secret {sn!r} in this kustomization")
                    else:
                        data = {**(secrets[sn].get("data") or {}), **(secrets[sn].get("stringData") or {})}
                        for item in v["secret"].get("items") or []:
                            if item.get("key") not in data:
                                error(where, f"{pre}.volumes[{i}].secret.items", f"Secret {sn} has no key {item.get('key')!r}")
                if "persistentVolumeClaim" in v:
                    cn = v["persistentVolumeClaim"].get("claimName", "")
                    if "set-in-kustomization" in cn or cn != data_get(values, "pvc"):
                        error(where, f"{pre}.volumes[{i}].persistentVolumeClaim.claimName", f"is {cn!r}, values say {data_get(values, 'pvc')!r}")
            for ci, c in enumerate(pspec.get("containers") or []):
                cpre = f"{pre}.containers[{ci}]"
                img = c.get("image", "")
                if "set-in-kustomization" in img or img != data_get(values, "image"):
                    error(where, f"{cpre}.image", f"is {img!r}, values say {data_get(values, 'image')!r}")
                names = {e.get("name") for e in c.get("env") or []}
                for ei, e in enumerate(c.get("env") or []):
                    ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
                    if ref:
                        cm = configmaps.get(ref.get("name"))
                        if cm is None:
                            error(where, f"{cpre}.env[{ei}].valueFrom.configMapKeyRef.name", f"no ConfigMap {ref.get('name')!r} in this kustomization")
                        elif ref.get("key") not in (cm.get("data") or {}):
                            error(where, f"{cpre}.env[{ei}].valueFrom.configMapKeyRef.key", f"ConfigMap {ref.get('name')} has no key {ref.get('key')!r}")
                    ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                    if ref and ref.get("name") not in secrets:
                        error(where, f"{cpre}.env[{ei}].valueFrom.secretKeyRef.name", f"no Secret {ref.get('name')!r} in this kustomization")
                for ai, a in enumerate((c.get("command") or []) + (c.get("args") or [])):
                    for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
                        if var not in names:
                            error(where, f"{cpre}.args", f"{a!r} uses $({var}), which the container's env does not define")
                for mi, m in enumerate(c.get("volumeMounts") or []):
                    if m.get("name") not in volumes:
                        error(where, f"{cpre}.volumeMounts[{mi}].name", f"no volume {m.get('name')!r}")
                ports = {p.get("containerPort") for p in c.get("ports") or []}
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    g = (c.get(probe) or {}).get("grpc")
                    if g and g.get("port") not in ports:
                        error(where, f"{cpre}.{probe}.grpc.port", f"{g.get('port')} is not a declared containerPort {sorted(ports)}")
                health_checks(where, cpre, c)
                for a in c.get("args") or []:
                    m = re.fullmatch(r"--coordinator=https?://([^:/]+):(\d+)", a)
                    if m:
                        host, port = m.group(1), int(m.group(2))
                        ok = [
                            s for s in coordinator_svc
                            if s["metadata"]["name"] == host.split(".")[0] and any(p.get("port") == port for p in s["spec"].get("ports") or [])
                        ]
                        if not ok:
                            error(where, f"{cpre}.args", f"{a!r}: no Service {host}:{port} in this kustomization")
                        if not a.startswith("--coordinator=https://"):
                            error(where, f"{cpre}.args", f"{a!r}: the workers must use TLS (https://)")

    # Every Service's selector selects a pod template, and its target ports name declared ports.
    for src, s in services:
        where = f"{name}: {src}: {ident(s)}"
        sel = (s.get("spec") or {}).get("selector") or {}
        matched = []
        for _, o in objs:
            for _, tmpl in pod_templates(o):
                labels = (tmpl.get("metadata") or {}).get("labels") or {}
                if sel and all(labels.get(k) == v for k, v in sel.items()):
                    matched.append(tmpl)
        if not matched:
            error(where, "spec.selector", f"selects no pod template in this kustomization ({sel})")
        for pi, p in enumerate((s.get("spec") or {}).get("ports") or []):
            tp_ = p.get("targetPort", p.get("port"))
            for tmpl in matched:
                declared = [
                    (pp.get("name"), pp.get("containerPort"))
                    for c in (tmpl.get("spec") or {}).get("containers") or []
                    for pp in c.get("ports") or []
                ]
                if not any(tp_ in d for d in declared):
                    error(where, f"spec.ports[{pi}].targetPort", f"{tp_!r} is not a port of the selected pods {declared}")
        if s["metadata"]["name"] == "orchestrator-coordinator" and not s["spec"].get("publishNotReadyAddresses"):
            error(where, "spec.publishNotReadyAddresses", "must be true: workers register before the coordinator is Ready")


# The orchestrator's grpc.health.v1 services: "" is readiness (SERVING only on verified
# weights), "liveness" is SERVING while the process runs.
PROBE_SERVICES = {"readinessProbe": "", "livenessProbe": "liveness"}


def health_checks(where, cpre, c):
    """With --tls-dir every orchestrator port speaks TLS only, and the kubelet's gRPC probe
    (Kubernetes <= 1.36) connects in plaintext: the probes must use the --health-listen port."""
    args = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
    if not any(a.endswith(("/orchestrator", "/orchestrator-worker")) or a in ("orchestrator", "orchestrator-worker") for a in args):
        return
    health_port = None
    for a in args:
        m = re.fullmatch(r"--health-listen=(?:\S*):(\d+)", a)
        if m:
            health_port = int(m.group(1))
    tls = any(a.startswith("--tls-dir") for a in args)
    for probe, service in PROBE_SERVICES.items():
        p = c.get(probe)
        if not p:
            error(where, f"{cpre}.{probe}", "missing: the orchestrator's readiness and liveness are gRPC health services")
            continue
        g = p.get("grpc")
        if not g:
            error(where, f"{cpre}.{probe}", "must be a grpc probe (grpc.health.v1)")
            continue
        if g.get("service", "") != service:
            error(where, f"{cpre}.{probe}.grpc.service", f"must be {service!r}, is {g.get('service', '')!r}")
        if tls and g.get("mode") != "TLS":
            if health_port is None:
                error(where, f"{cpre}.{probe}.grpc.port", "the container runs with --tls-dir (TLS only) and no --health-listen: a plaintext gRPC probe cannot pass (add --health-listen=0.0.0.0:8081 and probe that port)")
            elif g.get("port") != health_port:
                error(where, f"{cpre}.{probe}.grpc.port", f"{g.get('port')} speaks TLS only (--tls-dir); a plaintext gRPC probe must use the --health-listen port {health_port}")


def data_get(values, key):
    return (values[0][1].get("data") or {}).get(key)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--crd", required=True)
    ap.add_argument("--k8s-version", default="1.33.0")
    ap.add_argument("renders", nargs="+", help="NAME=FILE")
    args = ap.parse_args()
    lws = LwsValidator(args.crd, args.k8s_version)
    for item in args.renders:
        name, _, path = item.partition("=")
        with open(path) as fh:
            docs = [d for d in yaml.safe_load_all(fh) if d]
        objs = [origin_of(d) for d in docs]
        print(f"{name}: {len(objs)} objects: " + ", ".join(ident(o) for _, o in objs))
        others = [(s, o) for s, o in objs if not (o.get("kind") == "LeaderWorkerSet")]
        run_kubernetes_validate(name, others, args.k8s_version)
        n_lws = 0
        for s, o in objs:
            if o.get("kind") == "LeaderWorkerSet":
                lws.validate(name, s, o)
                n_lws += 1
        if n_lws:
            print(f"  LeaderWorkerSet CRD schema + strict PodTemplateSpec {lws.k8s_version}: {n_lws} objects")
        cross_checks(name, objs)
    for n in notes:
        print(n)
    for e in errors:
        print(e)
    if errors:
        print(f"FAILED: {len(errors)} error(s)")
        return 1
    print("OK: every object validated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
