#!/usr/bin/env bash
# Runs the Kubernetes manifests' pods on one machine with Podman (no cluster, no image pull),
# checks readiness the way the probes would, gets the report, and tears everything down.
#
#   deploy/kubernetes/podman-play.sh [--mode cluster|smoke] [--variant lws|statefulset]
#        [--bin-dir DIR] [--tp T] [--dp D] [--timeout SECS] [--keep]
#
#   --mode cluster  (default) the coordinator pod and T*D worker pods from the rendered
#                   manifests (`orchestrator coordinator`, `orchestrator-worker serve --rank
#                   auto`), a tiny dummy model on CPU (--dummy --preset tiny --layers 1);
#   --mode smoke    what today's binaries run: the coordinator pod template running
#                   `orchestrator launch --tp 1 --dummy ... --serve` (its workers inside), one
#                   pod of the worker template running `orchestrator-worker --help`, and one
#                   running `orchestrator report` against the coordinator by name;
#   --variant       which worker manifest to turn into pods (default lws);
#   --bin-dir       where `orchestrator` and `orchestrator-worker` are (default target/debug;
#                   copied first, so a rebuild during the run does not matter);
#   --tp/--dp       the play's geometry (default 2 x 1; the values file is not used for it);
#   --keep          leave the pods, network, image and work directory (prints how to remove).
#
# What it does:
#   1. installs podman, runc, catatonit (pod infra), netavark and aardvark-dns (pod names in
#      DNS) with apt-get when missing, and writes a containers.conf in a temporary directory
#      (runc, cgroupfs, file events logger, explicit ulimits, netavark), used via CONTAINERS_CONF;
#   2. builds an image with `podman import` of a root filesystem holding the two binaries and
#      the shared libraries `ldd` names (no pull, no base image);
#   3. renders the kustomization and turns its pod templates into Pod YAML
#      (tools/podman_pods.py): the env the controllers inject set explicitly, downward-API and
#      ConfigMap env resolved, one static IP per pod (POD_IP) on a podman network in
#      198.18.0.0/15, the Secrets as read-only directories holding a throwaway token and TLS
#      files made for this run, GPU requests dropped;
#   4. `podman kube play`s each pod, waits until every pod is ready (grpc.health.v1 over TLS:
#      "" and "liveness" SERVING; tools/wait_ready.py), runs `orchestrator report` in a
#      container on the network and checks that it says CONSISTENT;
#   5. tears everything down (pods, network, image, files), also on failure or Ctrl-C.
# Exit status 0 only when every pod became ready and the report said CONSISTENT.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${K8S_VALIDATE_VENV:-$REPO/target/venv-k8s}
KUBECTL=${KUBECTL:-kubectl}

MODE=cluster VARIANT=lws BIN_DIR=$REPO/target/debug TP=2 DP=1 TIMEOUT=180 KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) MODE=$2; shift 2 ;;
    --variant) VARIANT=$2; shift 2 ;;
    --bin-dir) BIN_DIR=$2; shift 2 ;;
    --tp) TP=$2; shift 2 ;;
    --dp) DP=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h | --help) sed -n '2,36p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$MODE" in cluster | smoke) ;; *) echo "--mode must be cluster or smoke" >&2; exit 2 ;; esac
case "$VARIANT" in lws) KDIR=$HERE ;; statefulset) KDIR=$HERE/statefulset ;; *) echo "--variant must be lws or statefulset" >&2; exit 2 ;; esac

step() { echo; echo "== $*"; }

# 1. podman and its configuration ----------------------------------------------------------
step "podman"
need=()
command -v podman > /dev/null || need+=(podman)
command -v runc > /dev/null || need+=(runc)
command -v catatonit > /dev/null || [ -x /usr/libexec/podman/catatonit ] || need+=(catatonit)
[ -x /usr/lib/podman/netavark ] || [ -x /usr/libexec/podman/netavark ] || need+=(netavark)
[ -x /usr/lib/podman/aardvark-dns ] || [ -x /usr/libexec/podman/aardvark-dns ] || need+=(aardvark-dns)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" > /dev/null
fi
WORK=$(mktemp -d /tmp/orchestrator-podman.XXXXXX)
chmod 755 "$WORK"
cat > "$WORK/containers.conf" << 'EOF'
[containers]
# The defaults fail here with `setrlimit ... Operation not permitted`.
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
[engine]
# crun refuses this kind of VM's hybrid cgroups; no systemd.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
# netavark + aardvark-dns: pods on a network resolve each other by name (Debian's default,
# CNI, needs the dnsname plugin for that).
network_backend = "netavark"
EOF
export CONTAINERS_CONF=$WORK/containers.conf
podman --version
podman info --format 'runtime {{.Host.OCIRuntime.Name}}, cgroups {{.Host.CgroupManager}} {{.Host.CgroupsVersion}}, network {{.Host.NetworkBackend}}, events {{.Host.EventLogger}}'

ID=$$
IMAGE=localhost/orchestrator-play:$ID
NET=orchestrator-play-$ID
# A /24 in the benchmarking range (198.18.0.0/15), picked per run.
IP_PREFIX=198.18.$((100 + ID % 150))
PODS_DIR=$WORK/pods

cleanup() {
  local rc=$?
  set +e
  if [ "$KEEP" = 1 ]; then
    echo; echo "kept: pods in $PODS_DIR, network $NET, image $IMAGE, CONTAINERS_CONF=$WORK/containers.conf"
    echo "remove: for f in $PODS_DIR/*.yaml; do podman kube down \$f; done; podman network rm $NET; podman rmi $IMAGE; rm -rf $WORK"
    exit $rc
  fi
  step "teardown"
  if [ -d "$PODS_DIR" ]; then
    for f in "$PODS_DIR"/*.yaml; do
      [ -e "$f" ] && podman kube down "$f" > /dev/null 2>&1
    done
  fi
  # Whatever kube down left (a pod whose file was never played is not there: no error).
  for p in $(python3 -c "import json; [print(p['name']) for p in json.load(open('$PODS_DIR/plan.json'))]" 2> /dev/null); do
    podman pod exists "$p" 2> /dev/null && podman pod rm -f "$p" > /dev/null 2>&1
  done
  podman network rm -f "$NET" > /dev/null 2>&1
  podman rmi -f "$IMAGE" > /dev/null 2>&1
  rm -rf "$WORK"
  echo "removed the pods, network $NET, image $IMAGE and $WORK"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

show_logs() {
  python3 -c "import json; [print(p['name'] + '-' + c) for p in json.load(open('$PODS_DIR/plan.json')) for c in p['containers']]" 2> /dev/null |
    while read -r c; do
      echo "--- logs of $c (last 30 lines)"
      podman logs "$c" 2>&1 | tail -30
    done
}

# Python with pyyaml and grpcio (the health checks), in the same venv as validate.sh.
if ! "$VENV/bin/python" -c 'import yaml, grpc, grpc_health.v1' 2> /dev/null; then
  step "python venv $VENV (pyyaml, grpcio, grpcio-health-checking)"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check pyyaml grpcio grpcio-health-checking
fi
PY=$VENV/bin/python

# 2. the image -----------------------------------------------------------------------------
step "image $IMAGE from $BIN_DIR (podman import, no pull)"
ROOTFS=$WORK/rootfs
mkdir -p "$ROOTFS/usr/local/bin" "$ROOTFS/etc" "$ROOTFS/tmp" "$ROOTFS/models"
chmod 1777 "$ROOTFS/tmp"
for b in orchestrator orchestrator-worker; do
  [ -x "$BIN_DIR/$b" ] || { echo "no $BIN_DIR/$b (build it, or give --bin-dir)" >&2; exit 2; }
  cp "$BIN_DIR/$b" "$ROOTFS/usr/local/bin/$b"
done
# The shared libraries the binaries link (and the dynamic loader), at their host paths.
for lib in $(ldd "$ROOTFS/usr/local/bin/orchestrator" "$ROOTFS/usr/local/bin/orchestrator-worker" | awk '/=> \//{print $3} /^[ \t]*\/[^ ]+ \(/{print $1}' | sort -u); do
  mkdir -p "$ROOTFS$(dirname "$lib")"
  cp -L "$lib" "$ROOTFS$lib"
done
# Debian's merged /usr: /lib and /lib64 are links into /usr.
for d in lib lib64; do
  if [ -L "/$d" ] && [ ! -e "$ROOTFS/$d" ]; then ln -s "$(readlink "/$d")" "$ROOTFS/$d"; fi
done
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\norchestrator:x:65532:65532::/tmp:/usr/sbin/nologin\n' > "$ROOTFS/etc/passwd"
printf 'root:x:0:\norchestrator:x:65532:\n' > "$ROOTFS/etc/group"
tar -C "$ROOTFS" -c . | podman import --quiet --change 'WORKDIR=/tmp' - "$IMAGE" > /dev/null
echo "$(du -sh "$ROOTFS" | cut -f1) root filesystem: $(cd "$ROOTFS" && find . -type f | sed 's|^\./|/|' | tr '\n' ' ')"
podman run --rm --user 65532:65532 "$IMAGE" /usr/local/bin/orchestrator-worker --help | head -1

# A throwaway token and TLS files for this run (never the ones under secrets/).
SECRETS=$WORK/secrets
mkdir -p "$SECRETS/orchestrator-token" "$SECRETS/orchestrator-tls"
"$ROOTFS/usr/local/bin/orchestrator" tls generate --out "$WORK/tls-generated" > /dev/null
cp "$WORK/tls-generated/ca.pem" "$WORK/tls-generated/node.pem" "$WORK/tls-generated/node.key" "$SECRETS/orchestrator-tls/"
"$PY" -c 'import secrets; print(secrets.token_hex(32), end="")' > "$SECRETS/orchestrator-token/token"
# The pods run as uid 65532; the kubelet would give the files to the pod's fsGroup.
chmod 755 "$SECRETS"/*; chmod 444 "$SECRETS"/*/*
MODELS=$WORK/models
mkdir -p "$MODELS"

# 3. Pod YAML from the rendered manifests ----------------------------------------------------
GEOMETRY="TP $TP x DP $DP"
[ "$MODE" = smoke ] && GEOMETRY="launch --tp 1"
step "pods from $(realpath --relative-to="$REPO" "$KDIR") (mode $MODE, $GEOMETRY, network $NET $IP_PREFIX.0/24)"
"$KUBECTL" kustomize "$KDIR" > "$WORK/rendered.yaml"
"$PY" "$HERE/tools/podman_pods.py" --rendered "$WORK/rendered.yaml" --out "$PODS_DIR" --mode "$MODE" \
  --tp "$TP" --dp "$DP" --image "$IMAGE" --ip-prefix "$IP_PREFIX" --models "$MODELS" \
  --secret "orchestrator-token=$SECRETS/orchestrator-token" --secret "orchestrator-tls=$SECRETS/orchestrator-tls"

podman network create --subnet "$IP_PREFIX.0/24" "$NET" > /dev/null

# 4. play, wait, report ----------------------------------------------------------------------
step "podman kube play"
play() { # file ip
  if ! out=$(podman kube play --network "$NET" --ip "$2" "$1" 2>&1); then
    echo "$out" >&2
    echo "FAIL: podman kube play $1" >&2
    exit 1
  fi
  echo "  $(basename "$1" .yaml) at $2"
}
plan() { "$PY" -c "import json,sys; [print(p['file'], p['ip']) for p in json.load(open('$PODS_DIR/plan.json')) if p['role'] in sys.argv[1].split(',')]" "$1"; }
while read -r f ip; do play "$f" "$ip"; done < <(plan coordinator,worker,oneshot)

step "readiness (grpc.health.v1 over TLS, as orchestrator.cluster)"
LIVENESS=()
# Today's `launch` coordinator registers no "liveness" service; the new binaries do.
[ "$MODE" = smoke ] && LIVENESS=(--no-liveness)
if ! "$PY" "$HERE/tools/wait_ready.py" --plan "$PODS_DIR/plan.json" --ca "$SECRETS/orchestrator-tls/ca.pem" \
  --timeout "$TIMEOUT" --roles coordinator,worker,oneshot "${LIVENESS[@]}"; then
  show_logs
  exit 1
fi

if [ "$MODE" = smoke ]; then
  step "a pod of the worker template reaches the coordinator by name (orchestrator report)"
  while read -r f ip; do play "$f" "$ip"; done < <(plan oneshot-after-ready)
  if ! "$PY" "$HERE/tools/wait_ready.py" --plan "$PODS_DIR/plan.json" --ca "$SECRETS/orchestrator-tls/ca.pem" \
    --timeout 60 --roles oneshot-after-ready; then
    show_logs
    exit 1
  fi
  podman logs orchestrator-report-worker 2>&1 | tail -3
  podman logs orchestrator-worker-0-worker 2>&1 | sed -n '1s/^/  orchestrator-worker --help: /p'
fi

step "orchestrator report (a container on $NET, coordinator by name)"
set +e
REPORT=$(podman run --rm --network "$NET" --user 65532:65532 --read-only \
  -v "$SECRETS/orchestrator-token:/etc/orchestrator/token:ro" -v "$SECRETS/orchestrator-tls:/etc/orchestrator/tls:ro" \
  "$IMAGE" /usr/local/bin/orchestrator report --coordinator https://orchestrator-coordinator:50050 \
  --token-file /etc/orchestrator/token/token --tls-dir /etc/orchestrator/tls 2>&1)
RC=$?
set -e
echo "$REPORT"
if [ $RC != 0 ] || ! grep -q '^CONSISTENT' <<< "$REPORT"; then
  echo "FAIL: the report (exit $RC) does not say CONSISTENT"
  show_logs
  exit 1
fi
rows=$(grep -cE '^[0-9]+ +[0-9]+ ' <<< "$REPORT" || true)
want=$([ "$MODE" = smoke ] && echo 1 || echo $((TP * DP)))
if [ "$rows" != "$want" ]; then
  echo "FAIL: the report has $rows rank rows, expected $want"
  exit 1
fi
step "PASS: $MODE, $VARIANT, $want rank(s) ready and CONSISTENT"
