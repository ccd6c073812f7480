#!/usr/bin/env bash
# Runs the Kubernetes manifests' pods on one machine with Podman (no cluster, no image pull),
# checks readiness the way the kubelet's probes would, gets the report the way deploy/README.md
# says, and tears everything down. One command for CI: exit status 0 only when every variant
# passed, and a final `PASS ...` line with the wall time.
#
#   deploy/kubernetes/podman-play.sh [--variant lws|statefulset|all] [--tp T] [--dp D]
#        [--bin-dir DIR] [--timeout SECS] [--keep] [--mode cluster]
#
#   --variant  which worker manifest to turn into pods: the LeaderWorkerSet (lws), the
#              StatefulSet, or both, one after the other (all, the default);
#   --tp/--dp  the play's geometry (default 2 x 2; the values file's is not used);
#   --bin-dir  where `orchestrator` and `orchestrator-worker` are (default target/debug;
#              copied first, so a rebuild during the run does not matter);
#   --timeout  seconds each variant's pods get to become ready (default 90);
#   --keep     leave the pods, network, image and work directory (one variant only);
#   --mode     `cluster`, the only mode (accepted for older command lines).
#
# What it does:
#   1. installs podman, runc, catatonit (pod infra), netavark and aardvark-dns (pod names in
#      DNS), iptables (netavark's rules), python3-yaml and iproute2 with apt-get when missing
#      (kubectl, for `kubectl kustomize`, must be there), and writes a containers.conf in a
#      temporary directory (runc, cgroupfs, file events logger, explicit ulimits, netavark),
#      used via CONTAINERS_CONF;
#   2. builds an image with `podman import` of a root filesystem holding the two binaries and
#      the shared libraries `ldd` names (no pull, no base image), and a throwaway token and TLS
#      directory (`orchestrator tls generate`) for this run;
#   then per variant:
#   3. renders the kustomization and turns its pod templates into Pod YAML
#      (tools/podman_pods.py): the env the controllers inject set explicitly, downward-API and
#      ConfigMap env resolved, one static IP per pod (POD_IP) on a podman network in
#      198.18.0.0/15, a node name per pod (NODE_NAME = play-node-N), the Secrets as read-only
#      directories, GPU requests dropped, a tiny dummy model on CPU (--dummy --preset tiny
#      --layers 1);
#   4. plays the coordinator and checks that it is live but NOT ready (readiness NOT_SERVING:
#      nothing is verified yet), plays the T*D workers, and waits until every pod is ready
#      (tools/wait_ready.py, with `orchestrator health`: the probes' services "" and
#      "liveness" in plaintext on the --health-listen port, and "" over TLS on the gRPC port);
#   5. runs `orchestrator health` and `orchestrator report` inside the coordinator's container
#      (as `kubectl exec deploy/orchestrator-coordinator -- orchestrator report ...` would, see
#      deploy/README.md) and requires SERVING and a report that ends in CONSISTENT with one row
#      per rank, each naming the node (NODE_NAME) of that rank's pod;
#   6. removes the variant's pods; at the end (also on failure or Ctrl-C) the network, the
#      image and the work directory.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
KUBECTL=${KUBECTL:-kubectl}
T_START=$EPOCHREALTIME

VARIANTS=all BIN_DIR=$REPO/target/debug TP=2 DP=2 TIMEOUT=90 KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) [ "${2:-}" = cluster ] || { echo "--mode: only 'cluster' is left" >&2; exit 2; }; shift 2 ;;
    --variant) VARIANTS=$2; shift 2 ;;
    --bin-dir) BIN_DIR=$2; shift 2 ;;
    --tp) TP=$2; shift 2 ;;
    --dp) DP=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$VARIANTS" in
  lws | statefulset) ;;
  all) VARIANTS="lws statefulset" ;;
  *) echo "--variant must be lws, statefulset or all" >&2; exit 2 ;;
esac
[[ "$TP" =~ ^[1-9][0-9]?$ && "$DP" =~ ^[1-9][0-9]?$ && $((TP * DP)) -le 64 ]] || { echo "--tp and --dp: small positive integers (at most 64 workers)" >&2; exit 2; }
if [ "$KEEP" = 1 ] && [ "$VARIANTS" != lws ] && [ "$VARIANTS" != statefulset ]; then
  echo "--keep needs one --variant (the variants' pods have the same names)" >&2; exit 2
fi

step() { echo; echo "== $*"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. what it needs -------------------------------------------------------------------------
step "prerequisites"
command -v "$KUBECTL" > /dev/null || fail "no $KUBECTL: install kubectl (1.27 or newer, for \`kubectl kustomize\` with components); Debian's kubernetes-client is too old"
need=()
command -v podman > /dev/null || need+=(podman)
command -v runc > /dev/null || need+=(runc)
command -v catatonit > /dev/null || [ -x /usr/libexec/podman/catatonit ] || need+=(catatonit)
[ -x /usr/lib/podman/netavark ] || [ -x /usr/libexec/podman/netavark ] || need+=(netavark)
[ -x /usr/lib/podman/aardvark-dns ] || [ -x /usr/libexec/podman/aardvark-dns ] || need+=(aardvark-dns)
command -v ip > /dev/null || need+=(iproute2)
# netavark writes the network's firewall and NAT rules with iptables: without it, starting a
# container fails with "netavark: No such file or directory (os error 2)".
command -v iptables > /dev/null || [ -x /usr/sbin/iptables ] || need+=(iptables)
PY=
for cand in /usr/bin/python3 python3; do
  if command -v "$cand" > /dev/null && "$cand" -c 'import yaml' 2> /dev/null; then PY=$(command -v "$cand"); break; fi
done
[ -n "$PY" ] || need+=(python3-yaml)
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || fail "missing ${need[*]}, and installing them needs root (apt-get)"
  echo "installing ${need[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" > /dev/null
  [ -n "$PY" ] || PY=/usr/bin/python3
fi
for b in orchestrator orchestrator-worker; do
  [ -x "$BIN_DIR/$b" ] || { echo "no $BIN_DIR/$b (build it, or give --bin-dir)" >&2; exit 2; }
done

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
echo "$(podman --version); $("$KUBECTL" version --client 2> /dev/null | grep -i kustomize); python $PY"
podman info --format 'runtime {{.Host.OCIRuntime.Name}}, cgroups {{.Host.CgroupManager}} {{.Host.CgroupsVersion}}, network {{.Host.NetworkBackend}}, events {{.Host.EventLogger}}'

ID=$$
IMAGE=localhost/orchestrator-play:$ID
NET=
PASSED=0
PLANS=()   # the plan.json of every variant played so far (what teardown removes)

pod_names() { for f in "$@"; do [ -e "$f" ] && "$PY" -c 'import json,sys; [print(p["name"]) for p in json.load(open(sys.argv[1]))]' "$f"; done; true; }
remove_pods() { # plan.json...
  local names
  names=$(pod_names "$@")
  [ -n "$names" ] || return 0
  # shellcheck disable=SC2086 # one name a word
  timeout 120 podman pod rm -f -t 1 $names > /dev/null 2>&1 || true
}

cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  if [ "$KEEP" = 1 ]; then
    echo; echo "kept: pods $(pod_names "${PLANS[@]}" | tr '\n' ' ')network $NET, image $IMAGE, CONTAINERS_CONF=$WORK/containers.conf"
    echo "remove: CONTAINERS_CONF=$WORK/containers.conf sh -c 'podman pod rm -f -t 1 $(pod_names "${PLANS[@]}" | tr '\n' ' ')&& podman network rm $NET && podman rmi $IMAGE' && rm -rf $WORK"
  else
    step "teardown"
    remove_pods "${PLANS[@]}"
    [ -n "$NET" ] && timeout 60 podman network rm -f "$NET" > /dev/null 2>&1
    timeout 60 podman rmi -f "$IMAGE" > /dev/null 2>&1
    rm -rf "$WORK"
    echo "removed the pods, network ${NET:-(none)}, image $IMAGE and $WORK"
  fi
  if [ $rc = 0 ] && [ "$PASSED" = 1 ]; then
    echo
    echo "PASS: podman-play TP $TP x DP $DP: $(printf '%s, ' "${TIMES[@]}" | sed 's/, $//'); wall time $(since "$T_START") s"
  else
    [ $rc != 0 ] || rc=1
    echo "FAIL: podman-play (exit $rc after $(since "$T_START") s)"
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Pods from an earlier run that was killed, or kept, would take the names.
for p in orchestrator-coordinator orchestrator-worker-0; do
  if podman pod exists "$p" 2> /dev/null; then
    fail "a pod named $p exists (another podman-play run, or one left by --keep or a kill -9): remove it (podman pod rm -f $p ...) first"
  fi
done

# 2. the image and the secrets ---------------------------------------------------------------
step "image $IMAGE from $BIN_DIR (podman import, no pull)"
ROOTFS=$WORK/rootfs
mkdir -p "$ROOTFS/usr/local/bin" "$ROOTFS/etc" "$ROOTFS/tmp" "$ROOTFS/models"
chmod 1777 "$ROOTFS/tmp"
for b in orchestrator orchestrator-worker; do cp "$BIN_DIR/$b" "$ROOTFS/usr/local/bin/$b"; done
ORCH=$ROOTFS/usr/local/bin/orchestrator   # the copy the host's health checks use too
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
tar -C "$ROOTFS" -c . | timeout 120 podman import --quiet --change 'WORKDIR=/tmp' --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' - "$IMAGE" > /dev/null
echo "$(du -sh "$ROOTFS" | cut -f1) root filesystem: $(cd "$ROOTFS" && find . -type f | sed 's|^\./|/|' | tr '\n' ' ')"

# A throwaway token and TLS files for this run (never the ones under secrets/).
SECRETS=$WORK/secrets
mkdir -p "$SECRETS/orchestrator-token" "$SECRETS/orchestrator-tls"
"$ORCH" tls generate --out "$WORK/tls-generated" > /dev/null
cp "$WORK/tls-generated/ca.pem" "$WORK/tls-generated/node.pem" "$WORK/tls-generated/node.key" "$SECRETS/orchestrator-tls/"
od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$SECRETS/orchestrator-token/token"   # 64 hex characters
# The pods run as uid 65532; the kubelet would give the files to the pod's fsGroup.
chmod 755 "$SECRETS"/*; chmod 444 "$SECRETS"/*/*
MODELS=$WORK/models
mkdir -p "$MODELS"

# The network: a /24 in the benchmarking range (198.18.0.0/15), the first free one from a
# per-run start.
for i in $(seq 0 9); do
  IP_PREFIX=198.18.$((100 + (ID + i) % 150))
  if timeout 60 podman network create --subnet "$IP_PREFIX.0/24" "orchestrator-play-$ID" > /dev/null 2>&1; then
    NET=orchestrator-play-$ID
    break
  fi
done
[ -n "$NET" ] || fail "podman network create: no free /24 in 198.18.100-249.0 (podman network ls)"
BRIDGE=$(podman network inspect "$NET" --format '{{.NetworkInterface}}')
echo "network $NET: $IP_PREFIX.0/24 on bridge $BRIDGE"

show_logs() { # plan.json
  local c
  for c in $("$PY" -c 'import json,sys; [print(p["name"] + "-" + c) for p in json.load(open(sys.argv[1])) for c in p["containers"]]' "$1"); do
    echo "--- logs of $c (last 30 lines)"
    podman logs --tail 30 "$c" 2>&1
  done
}

play() { # file ip
  local out
  if ! out=$(timeout 60 podman kube play --network "$NET" --ip "$2" "$1" 2>&1); then
    echo "$out" >&2
    return 1
  fi
}

# 3.-6. one variant ---------------------------------------------------------------------------
TIMES=()
run_variant() {
  local variant=$1 kdir dir plan t0 f ip report rc
  t0=$EPOCHREALTIME
  case "$variant" in lws) kdir=$HERE ;; statefulset) kdir=$HERE/statefulset ;; esac
  dir=$WORK/$variant
  plan=$dir/pods/plan.json
  mkdir -p "$dir"
  step "$variant: pods from $(realpath --relative-to="$REPO" "$kdir") (TP $TP x DP $DP)"
  "$KUBECTL" kustomize "$kdir" > "$dir/rendered.yaml" || fail "$variant: kubectl kustomize $kdir"
  "$PY" "$HERE/tools/podman_pods.py" --rendered "$dir/rendered.yaml" --out "$dir/pods" \
    --tp "$TP" --dp "$DP" --image "$IMAGE" --ip-prefix "$IP_PREFIX" --models "$MODELS" \
    --secret "orchestrator-token=$SECRETS/orchestrator-token" --secret "orchestrator-tls=$SECRETS/orchestrator-tls" ||
    fail "$variant: tools/podman_pods.py"
  PLANS+=("$plan")
  wait_ready() { "$PY" "$HERE/tools/wait_ready.py" --plan "$plan" --orchestrator "$ORCH" --tls-dir "$SECRETS/orchestrator-tls" --dev "$BRIDGE" "$@"; }
  entries() { "$PY" -c 'import json,sys; [print(p["file"], p["ip"]) for p in json.load(open(sys.argv[1])) if p["role"] == sys.argv[2]]' "$plan" "$1"; }

  step "$variant: the coordinator alone: live, not ready"
  while read -r f ip; do play "$f" "$ip" || { show_logs "$plan"; fail "$variant: podman kube play $f"; }; done < <(entries coordinator)
  wait_ready --roles coordinator --expect-not-ready --timeout 30 || { show_logs "$plan"; fail "$variant: the coordinator before its workers"; }

  step "$variant: $((TP * DP)) workers; readiness (orchestrator health: plaintext probes' port and TLS gRPC port)"
  while read -r f ip; do play "$f" "$ip" || { show_logs "$plan"; fail "$variant: podman kube play $f"; }; done < <(entries worker)
  wait_ready --roles coordinator,worker --timeout "$TIMEOUT" || { show_logs "$plan"; fail "$variant: not every pod became ready"; }

  step "$variant: orchestrator health and report, in the coordinator's container (as kubectl exec would run them)"
  report=$(timeout 30 podman exec orchestrator-coordinator-coordinator orchestrator health --address http://localhost:8081 2>&1) ||
    fail "$variant: orchestrator health --address http://localhost:8081 in the coordinator: $report"
  echo "orchestrator health --address http://localhost:8081: $report"
  set +e
  report=$(timeout 90 podman exec orchestrator-coordinator-coordinator orchestrator report \
    --coordinator https://localhost:50050 --token-file /etc/orchestrator/token/token --tls-dir /etc/orchestrator/tls 2>&1)
  rc=$?
  set -e
  echo "$report"
  if [ $rc != 0 ] || [ "$(tail -1 <<< "$report" | cut -d: -f1)" != CONSISTENT ]; then
    show_logs "$plan"
    fail "$variant: the report (exit $rc) does not end in CONSISTENT"
  fi
  # Every rank's row, and the node (NODE_NAME) of that rank's pod as its host.
  echo "$report" > "$dir/report.txt"
  "$PY" - "$plan" "$TP" "$DP" "$dir/report.txt" << 'EOF' || fail "$variant: the report's rank rows"
import json, re, sys
plan, tp, dp = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
want = {p["rank"]: p["node"] for p in plan if p["role"] == "worker"}
rows = {}
for line in open(sys.argv[4]).read().splitlines():
    m = re.match(r"(\d+)\s+(\d+)\s+(\S+)\s", line)
    if m:
        rows[int(m.group(1)) * tp + int(m.group(2))] = m.group(3)
bad = [f"rank {r}: host {rows.get(r)!r}, its pod's node is {n!r}" for r, n in sorted(want.items()) if rows.get(r) != n]
if len(rows) != tp * dp or bad:
    print(f"report: {len(rows)} rank rows for TP {tp} x DP {dp}; " + "; ".join(bad))
    sys.exit(1)
print(f"report: {len(rows)} rank rows, each host the NODE_NAME of its rank's pod")
EOF
  if [ "$KEEP" != 1 ]; then
    remove_pods "$plan"
  fi
  TIMES+=("$variant $(since "$t0") s")
  step "$variant: PASS in $(since "$t0") s (TP $TP x DP $DP: $((TP * DP)) workers and the coordinator ready, CONSISTENT)"
}

for v in $VARIANTS; do run_variant "$v"; done
PASSED=1   # the PASS line comes after the teardown (cleanup, on exit)
