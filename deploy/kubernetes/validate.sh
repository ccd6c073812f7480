#!/usr/bin/env bash
# Offline validation of the Kubernetes manifests (no cluster needed):
#   1. renders both kustomizations (deploy/kubernetes: LWS workers; .../statefulset) with
#      `kubectl kustomize`;
#   2. validates every object but the LeaderWorkerSet with `kubernetes-validate --strict -k
#      $K8S_VERSION` (unknown fields and wrong types are errors);
#   3. validates the LeaderWorkerSet against the vendored LWS CRD (schemas/) and its pod
#      templates against kubernetes-validate's strict PodTemplateSpec;
#   4. cross-checks the values (workers = tp * dp, ...), references and ports.
# Errors name the kustomization, the source file, the object and the field; exit status 1.
#
#   deploy/kubernetes/validate.sh [DIR]       DIR: a copy of deploy/kubernetes (default: this one)
#   deploy/kubernetes/validate.sh --self-test also shows that broken copies fail, field named
#
# Environment: K8S_VALIDATE_VENV (default: <repo>/target/venv-k8s; created with kubernetes-validate
# and jsonschema from PyPI when missing), K8S_VERSION (default 1.33.0), KUBECTL (default kubectl).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${K8S_VALIDATE_VENV:-$REPO/target/venv-k8s}
K8S_VERSION=${K8S_VERSION:-1.33.0}
KUBECTL=${KUBECTL:-kubectl}

ensure_venv() {
  if [ -x "$VENV/bin/kubernetes-validate" ] && "$VENV/bin/python" -c 'import jsonschema, referencing, yaml' 2> /dev/null; then
    return
  fi
  echo "== installing kubernetes-validate and jsonschema into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check 'kubernetes-validate>=1.33,<2' 'jsonschema>=4.18' pyyaml
}

# Renders kustomization DIR/SUB into OUT with origin annotations (in a scratch copy, so that
# errors can name the source file of each object).
render() {
  local src=$1 sub=$2 out=$3 scratch
  scratch=$(mktemp -d)
  cp -r "$src/." "$scratch/"
  printf '\nbuildMetadata: [originAnnotations]\n' >> "$scratch/$sub/kustomization.yaml"
  if ! "$KUBECTL" kustomize "$scratch/$sub" > "$out" 2> "$out.err"; then
    echo "ERROR kubectl kustomize ${sub:-.} failed:" >&2
    sed "s|$scratch/|$src/|g" "$out.err" >&2
    rm -rf "$scratch"
    return 1
  fi
  rm -rf "$scratch"
}

validate_dir() {
  local dir work status=0
  dir=$(cd "$1" && pwd)
  work=$(mktemp -d)
  echo "== kubectl kustomize ($("$KUBECTL" version --client 2> /dev/null | grep -i kustomize || echo kustomize))"
  render "$dir" "." "$work/lws.yaml" || status=1
  render "$dir" "statefulset" "$work/statefulset.yaml" || status=1
  if [ "$status" = 0 ]; then
    # shellcheck disable=SC2016 # the backquotes are Markdown, not an expansion
    echo "== validating (Kubernetes $K8S_VERSION schemas, LWS CRD $(sed -n 's/.*at tag `\(v[^`]*\)`.*/\1/p;T;q' "$HERE/schemas/README.md"))"
    PATH="$VENV/bin:$PATH" "$VENV/bin/python" "$HERE/tools/validate_manifests.py" \
      --crd "$HERE/schemas/leaderworkerset.x-k8s.io_leaderworkersets.yaml" --k8s-version "$K8S_VERSION" \
      "deploy/kubernetes=$work/lws.yaml" "deploy/kubernetes/statefulset=$work/statefulset.yaml" || status=1
  fi
  rm -rf "$work"
  return $status
}

# Each case: a sed on one file of a scratch copy, and the text the failure must name.
self_test() {
  local cases=(
    "workers-lws.yaml|s/imagePullPolicy: IfNotPresent/imagePullPolicyy: IfNotPresent/|spec.leaderWorkerTemplate.workerTemplate.spec.containers[0]: Additional properties are not allowed ('imagePullPolicyy'"
    "workers-lws.yaml|s/startupPolicy: LeaderCreated/startupPolicy: LeaderCreatedd/|spec.startupPolicy: 'LeaderCreatedd' is not one of"
    "workers-lws.yaml|s/^    restartPolicy: RecreateGroupOnPodRestart/    restartPolice: RecreateGroupOnPodRestart/|spec.leaderWorkerTemplate: Additional properties are not allowed ('restartPolice'"
    "workers-lws.yaml|s/containerPort: 50051/containerPort: \"50051\"/|spec.leaderWorkerTemplate.workerTemplate.spec.containers[0].ports[0].containerPort: '50051' is not of type 'integer'"
    "base/coordinator.yaml|0,/apiVersion: apps\/v1/s//apiVersion: apps\/v1beta9/|Couldn't find schema for kind Deployment with api version apps/v1beta9"
    "base/coordinator.yaml|s/readOnlyRootFilesystem: true/readOnlyRootFilesystem: \"yes\"/|readOnlyRootFilesystem: 'yes' is not of type 'boolean'"
    "statefulset/workers-statefulset.yaml|s/podManagementPolicy: Parallel/podManagmentPolicy: Parallel/|Additional properties are not allowed ('podManagmentPolicy'"
    "values/kustomization.yaml|s/workers=8/workers=6/|data.workers: must be tp * dp"
    "workers-lws.yaml|/--health-listen=/d|readinessProbe.grpc.port: the container runs with --tls-dir (TLS only) and no --health-listen"
    "statefulset/workers-statefulset.yaml|/readinessProbe:/,/failureThreshold/s/port: 8081/port: 50051/|spec.template.spec.containers[0].readinessProbe.grpc.port: 50051 speaks TLS only"
    "base/coordinator.yaml|s/service: liveness/service: livenes/|livenessProbe.grpc.service: must be 'liveness', is 'livenes'"
  )
  local c file expr want scratch out failed=0
  echo "== validate.sh on this directory"
  validate_dir "$HERE" > /dev/null || { echo "FAIL: the unmodified manifests do not validate"; validate_dir "$HERE"; return 1; }
  echo "ok: the manifests validate"
  for c in "${cases[@]}"; do
    IFS='|' read -r file expr want <<< "$c"
    scratch=$(mktemp -d)
    cp -r "$HERE/." "$scratch/"
    sed -i "$expr" "$scratch/$file"
    if cmp -s "$HERE/$file" "$scratch/$file"; then
      echo "FAIL: '$expr' changed nothing in $file"; failed=1; rm -rf "$scratch"; continue
    fi
    if out=$(validate_dir "$scratch" 2>&1); then
      echo "FAIL: broken $file ($expr) validated"; failed=1
    elif grep -qF -- "$want" <<< "$out"; then
      echo "ok: broken $file ($expr) fails:"
      grep -F -- "$want" <<< "$out" | head -2 | sed "s|$scratch|deploy/kubernetes|g; s/^/      /"
    else
      echo "FAIL: broken $file ($expr) failed without naming '$want':"; echo "$out" | tail -5; failed=1
    fi
    rm -rf "$scratch"
  done
  return $failed
}

ensure_venv
case "${1:-}" in
  --self-test) self_test ;;
  -h | --help) sed -n '2,18p' "$0" ;;
  *) validate_dir "${1:-$HERE}" ;;
esac
