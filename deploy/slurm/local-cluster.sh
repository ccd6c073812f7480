#!/usr/bin/env bash
# local-cluster.sh: a real, throw-away Slurm cluster on this one machine, for tests.
#
#   local-cluster.sh start DIR [NODES]   start NODES (default 3) emulated nodes n1..nNODES
#   local-cluster.sh stop DIR            stop the cluster started in DIR
#
# `start` installs Debian's Slurm and munge packages when `slurmctld` is missing (root,
# apt-get), starts munged when it is not running, writes DIR/slurm.conf, starts slurmctld and
# one slurmd per node (`slurmd -f DIR/slurm.conf -N nK`, needs a Slurm built with
# MULTIPLE_SLURMD, as Debian's is), waits until every node is idle, and prints
#
#   export SLURM_CONF=DIR/slurm.conf
#
# as its only (hence last) line on stdout; progress and errors go to stderr. So:
#
#   eval "$(deploy/slurm/local-cluster.sh start /tmp/slurm 3)"
#   srun -N2 --ntasks-per-node=1 hostname
#   deploy/slurm/local-cluster.sh stop /tmp/slurm
#
# Node nK has NodeHostname=localhost, NodeAddr=127.0.0.K and slurmd port NODE_PORT+K-1, so the
# nodes have distinct addresses (all on loopback) but share the machine's processes and files.
# Node names are not in DNS: ask `scontrol show node nK` for NodeAddr.
#
# `start` on a DIR whose cluster still runs refuses (exit 2) and changes nothing: run `stop`
# first. A DIR left by a stopped (or crashed) cluster is reused: its slurm.conf is rewritten
# and slurmctld starts with a clear state (`-c`: no jobs from earlier runs). If `start` fails it
# stops whatever it started, prints the tails of the logs and exits non-zero.
#
# `stop` cancels the cluster's jobs, runs `scontrol shutdown`, then ends every daemon `start`
# recorded (SIGTERM, SIGKILL a few seconds later) and any slurmstepd these daemons left; it
# stops munged only if `start` started it. Every wait is bounded: `stop` never hangs. It
# removes DIR's runtime files (pid files, state and spool directories) and keeps slurm.conf and
# the logs (*.log, *.out) for post-mortems. `stop` on a DIR with nothing running is a no-op.
#
# Environment (all optional):
#   LOCAL_SLURM_CTLD_PORT   slurmctld's port (default 6817)
#   LOCAL_SLURM_NODE_PORT   slurmd port of n1; nK uses NODE_PORT+K-1 (default 6818)
#   LOCAL_SLURM_CPUS        CPUs each emulated node declares (default 4; more than the machine
#                           has is fine: SlurmdParameters=config_overrides)
#   LOCAL_SLURM_TIMEOUT     seconds `start` waits for every node to be idle (default 30)
#   LOCAL_SLURM_CLUSTER     ClusterName (default localcluster)
#
# Needs root (daemons run as root: SlurmUser=root). No systemd is needed or used.
# munged is shared by the machine: stopping a cluster whose `start` started munged stops it
# even if another local cluster (another DIR) started later uses it too.

set -euo pipefail

readonly CTLD_PORT="${LOCAL_SLURM_CTLD_PORT:-6817}"
readonly NODE_PORT="${LOCAL_SLURM_NODE_PORT:-6818}"
readonly NODE_CPUS="${LOCAL_SLURM_CPUS:-4}"
readonly START_TIMEOUT="${LOCAL_SLURM_TIMEOUT:-30}"
readonly CLUSTER_NAME="${LOCAL_SLURM_CLUSTER:-localcluster}"
# The environment variable every daemon of a cluster carries (its DIR): `stop` finds the
# slurmstepd processes its slurmd left behind by it.
readonly MARK_VAR=LOCAL_SLURM_CLUSTER_DIR

for v in LOCAL_SLURM_CTLD_PORT LOCAL_SLURM_NODE_PORT LOCAL_SLURM_CPUS LOCAL_SLURM_TIMEOUT; do
    if [[ -n "${!v:-}" && ! "${!v}" =~ ^[0-9]+$ ]]; then
        printf 'local-cluster: error: %s must be a number, not "%s"\n' "$v" "${!v}" >&2
        exit 64
    fi
done

log() { printf 'local-cluster: %s\n' "$*" >&2; }
die() {
    printf 'local-cluster: error: %s\n' "$*" >&2
    exit 1
}

usage() {
    cat >&2 <<'EOF'
usage: local-cluster.sh start DIR [NODES]   (NODES: 1..254, default 3)
       local-cluster.sh stop DIR
EOF
    exit 64
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# alive PID: the process exists and is no zombie (init may take a while to reap orphans).
alive() {
    local st
    st=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ -n "$st" && "$st" != Z* ]]
}

# descendants PID...: every live descendant of PIDs (not PIDs themselves), one per line.
descendants() {
    (($# > 0)) || return 0
    ps -eo pid=,ppid= | awk -v roots="$*" '
        BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) { mark[r[i]] = 1; root[r[i]] = 1 } }
        { parent[$1] = $2 }
        END {
            do { changed = 0
                 for (p in parent) if (!(p in mark) && (parent[p] in mark)) { mark[p] = 1; changed = 1 }
            } while (changed)
            for (p in mark) if (!(p in root)) print p
        }'
}

# cmdline_has PID TEXT: the process's command line or environment names TEXT (guards against
# acting on a recycled pid).
cmdline_has() {
    local pid=$1 text=$2
    { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | grep -qF -- "$text"
}

# wait_gone SECONDS PID...: waits until none of PIDs exists; returns 1 on timeout.
wait_gone() {
    local secs=$1 pid left
    shift
    local deadline=$((SECONDS + secs))
    while :; do
        left=0
        for pid in "$@"; do
            if alive "$pid"; then left=1; fi
        done
        ((left == 0)) && return 0
        ((SECONDS >= deadline)) && return 1
        sleep 0.2
    done
}

# end_pids NAME PID...: SIGTERM, then SIGKILL after 5 s for whatever is left.
end_pids() {
    local name=$1 pid
    shift
    (($# == 0)) && return 0
    ENDED_PIDS+=("$@")
    kill -TERM "$@" 2>/dev/null || true
    if ! wait_gone 5 "$@"; then
        for pid in "$@"; do
            if alive "$pid"; then
                log "$name (pid $pid) ignored SIGTERM: SIGKILL"
                kill -KILL "$pid" 2>/dev/null || true
            fi
        done
        wait_gone 3 "$@" || log "warning: $name: pid(s) $* still exist after SIGKILL"
    fi
}

# Every pid end_pids signalled: `stop` waits until they are gone from /proc altogether (init
# reaps orphaned zombies only every few seconds here, and `pgrep slurm` lists zombies too).
ENDED_PIDS=()
wait_reaped() {
    local secs=$1 pid left deadline=$((SECONDS + $1))
    while :; do
        left=0
        for pid in "${ENDED_PIDS[@]}"; do
            if [[ -e "/proc/$pid" ]]; then left=1; fi
        done
        ((left == 0)) && return 0
        ((SECONDS >= deadline)) && return 1
        sleep 0.2
    done
}

# abs_dir DIR: creates DIR if needed and prints its absolute physical path.
abs_dir() {
    mkdir -p -- "$1"
    (cd -- "$1" && pwd -P)
}

# recorded_pids DIR: the live pids in DIR/pids that still belong to this cluster.
recorded_pids() {
    local dir=$1 _name pid
    [[ -f "$dir/pids" ]] || return 0
    while read -r _name pid; do
        [[ -n "${pid:-}" ]] || continue
        if alive "$pid" && cmdline_has "$pid" "$dir/slurm.conf"; then
            echo "$pid"
        fi
    done <"$dir/pids"
}

# stepd_pids DIR: slurmstepd processes started by this cluster's slurmd (they carry MARK_VAR).
stepd_pids() {
    local dir=$1 pid
    for pid in $(pgrep -x slurmstepd 2>/dev/null || true); do
        if { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qxF -- "$MARK_VAR=$dir"; then
            echo "$pid"
        fi
    done
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sinfo >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    ((EUID == 0)) || die "Slurm is not installed and installing it needs root"
    log "installing slurmctld slurmd slurm-client munge (apt-get)"
    # The packages' maintainer scripts start no service here (no systemd, policy-rc.d).
    {
        apt-get update &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
                slurmctld slurmd slurm-client munge
    } >&2 || die "apt-get failed"
}

# start_munge DIR: starts munged unless munge already works; records a munged it started in
# DIR/munged.ours so that `stop` stops it again.
start_munge() {
    local dir=$1 pid
    if munge_works; then
        log "munged is already running: leaving it alone"
        return 0
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        mungekey --create --keyfile=/etc/munge/munge.key --force
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    log "starting munged"
    # munged daemonizes and writes its pid to /run/munge/munged.pid.
    runuser -u munge -- /usr/sbin/munged >&2
    local deadline=$((SECONDS + 10))
    until munge_works; do
        ((SECONDS < deadline)) || die "munged did not come up (see /var/log/munge/munged.log)"
        sleep 0.2
    done
    pid=$(cat /run/munge/munged.pid 2>/dev/null || true)
    if is_uint "${pid:-x}"; then
        echo "$pid" >"$dir/munged.ours"
    else
        log "warning: munged started but /run/munge/munged.pid is unreadable; 'stop' will leave it running"
    fi
}

stop_munge() {
    local dir=$1 pid
    [[ -f "$dir/munged.ours" ]] || return 0
    pid=$(cat "$dir/munged.ours")
    rm -f -- "$dir/munged.ours"
    if is_uint "$pid" && alive "$pid" && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == munged ]]; then
        log "stopping munged (pid $pid), which start started"
        end_pids munged "$pid"
    fi
}

port_in_use() {
    ss -Hltn "sport = :$1" 2>/dev/null | grep -q .
}

write_conf() {
    local dir=$1 nodes=$2 k
    {
        cat <<EOF
# Written by deploy/slurm/local-cluster.sh: $nodes emulated nodes on this machine.
ClusterName=$CLUSTER_NAME
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$NODE_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Lets the nodes declare more CPUs than the machine has.
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
# Short timeouts: tests cancel jobs and stop the cluster often.
KillWait=5
InactiveLimit=0
MinJobAge=300
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
EOF
        for ((k = 1; k <= nodes; k++)); do
            echo "NodeName=n$k NodeHostname=localhost NodeAddr=127.0.0.$k Port=$((NODE_PORT + k - 1)) CPUs=$NODE_CPUS State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=n[1-$nodes] Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP"
    } >"$dir/slurm.conf.tmp"
    mv -f -- "$dir/slurm.conf.tmp" "$dir/slurm.conf"
}

# spawn DIR NAME LOG CMD...: starts a daemon in the foreground mode (-D) of its own session,
# detached from our stdio (so `$(local-cluster.sh start ...)` returns), and records its pid.
spawn() {
    local dir=$1 name=$2 out=$3
    shift 3
    # setsid does not fork here (a background job is no process-group leader), so $! is the
    # daemon itself.
    env "$MARK_VAR=$dir" setsid "$@" </dev/null >>"$out" 2>&1 &
    echo "$name $!" >>"$dir/pids"
}

log_tails() {
    local dir=$1 f
    for f in "$dir"/slurmctld.log "$dir"/slurmd-*.log "$dir"/*.out; do
        [[ -f "$f" ]] || continue
        printf '==> %s (last 15 lines) <==\n' "$f" >&2
        tail -n 15 -- "$f" >&2
    done
}

# start_failed DIR MESSAGE: stops what start started, shows the logs, fails.
start_failed() {
    local dir=$1 msg=$2
    printf 'local-cluster: error: %s\n' "$msg" >&2
    log_tails "$dir"
    log "stopping what was started"
    do_stop "$dir" >&2 || true
    exit 1
}

do_start() {
    local dir=$1 nodes=$2 k pid running
    [[ "$dir" != *[[:space:]]* ]] || die "DIR must not contain whitespace: $dir"
    running=$(recorded_pids "$dir")
    if [[ -n "$running" ]]; then
        printf 'local-cluster: error: a cluster is already running in %s (pids %s): run "%s stop %s" first\n' \
            "$dir" "$(echo "$running" | tr '\n' ' ' | sed 's/ $//')" "$0" "$dir" >&2
        exit 2
    fi
    rm -f -- "$dir/pids"

    install_packages
    for port in "$CTLD_PORT" $(seq "$NODE_PORT" $((NODE_PORT + nodes - 1))); do
        if port_in_use "$port"; then
            die "TCP port $port is in use (set LOCAL_SLURM_CTLD_PORT / LOCAL_SLURM_NODE_PORT)"
        fi
    done
    start_munge "$dir"

    write_conf "$dir" "$nodes"
    rm -rf -- "$dir/state" "$dir"/spool-n*
    mkdir -p -- "$dir/state"
    for ((k = 1; k <= nodes; k++)); do mkdir -p -- "$dir/spool-n$k"; done
    export SLURM_CONF="$dir/slurm.conf"

    log "starting slurmctld (port $CTLD_PORT) and $nodes slurmd (n1..n$nodes, ports $NODE_PORT..$((NODE_PORT + nodes - 1)))"
    # -c: start from a clear state (no jobs of an earlier run in this DIR).
    spawn "$dir" slurmctld "$dir/slurmctld.out" slurmctld -D -c -f "$SLURM_CONF"
    for ((k = 1; k <= nodes; k++)); do
        spawn "$dir" "slurmd:n$k" "$dir/slurmd-n$k.out" slurmd -D -f "$SLURM_CONF" -N "n$k"
    done

    # Wait until every node is idle; fail early if a daemon died.
    local deadline=$((SECONDS + START_TIMEOUT)) idle states
    while :; do
        while read -r name pid; do
            alive "$pid" || start_failed "$dir" "$name (pid $pid) exited during start-up"
        done <"$dir/pids"
        states=$(timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null || true)
        idle=$(awk '$2 == "idle"' <<<"$states" | wc -l)
        ((idle == nodes)) && break
        if ((SECONDS >= deadline)); then
            start_failed "$dir" "not every node is idle after ${START_TIMEOUT}s; sinfo says: $(tr '\n' ';' <<<"$states")"
        fi
        sleep 0.5
    done
    log "cluster up in $dir: $nodes nodes idle"
    echo "export SLURM_CONF=$dir/slurm.conf"
}

do_stop() {
    local dir=$1 pids jobs ctld
    if [[ ! -f "$dir/pids" && ! -f "$dir/munged.ours" ]]; then
        log "nothing recorded in $dir: nothing to stop"
        return 0
    fi
    export SLURM_CONF="$dir/slurm.conf"
    pids=$(recorded_pids "$dir")
    ctld=$(awk '$1 == "slurmctld" { print $2 }' "$dir/pids" 2>/dev/null || true)
    # The Slurm way first, while slurmctld is there to answer.
    if [[ -n "$ctld" ]] && alive "$ctld" && cmdline_has "$ctld" "$SLURM_CONF"; then
        # Cancel the jobs first, so that their processes end the Slurm way (KillWait=5).
        jobs=$(timeout 5 squeue -h -o '%i' 2>/dev/null || true)
        if [[ -n "$jobs" ]]; then
            log "cancelling jobs: $(echo "$jobs" | tr '\n' ' ')"
            # shellcheck disable=SC2086 # one word per job id
            timeout 5 scancel $jobs 2>/dev/null || true
            local deadline=$((SECONDS + 15))
            while [[ -n "$(timeout 5 squeue -h -o '%i' 2>/dev/null || true)" ]] && ((SECONDS < deadline)); do
                sleep 0.5
            done
        fi
        log "scontrol shutdown"
        timeout 10 scontrol shutdown >/dev/null 2>&1 || log "scontrol shutdown failed (ignored)"
        # shellcheck disable=SC2086 # one word per pid
        wait_gone 5 $pids || true
    fi
    local -a daemons kids stepds
    mapfile -t daemons < <(recorded_pids "$dir")
    if ((${#daemons[@]} > 0)); then
        mapfile -t kids < <(descendants "${daemons[@]}")
        end_pids "slurm daemon" "${daemons[@]}" "${kids[@]}"
    fi
    # Steps whose slurmd is gone (slurmctld was unreachable, or a daemon crashed): end their
    # slurmstepd and every process under them (the job's tasks and batch scripts).
    mapfile -t stepds < <(stepd_pids "$dir")
    if ((${#stepds[@]} > 0)); then
        mapfile -t kids < <(descendants "${stepds[@]}")
        log "ending leftover slurmstepd ${stepds[*]} and the processes under them: ${kids[*]}"
        end_pids "leftover step process" "${kids[@]}" "${stepds[@]}"
    fi
    stop_munge "$dir"
    # The daemons that exited by `scontrol shutdown` are orphans too: wait for all of them.
    mapfile -t -O "${#ENDED_PIDS[@]}" ENDED_PIDS < <(awk '{ print $2 }' "$dir/pids" 2>/dev/null || true)
    wait_reaped 10 || log "note: some ended processes are still zombies waiting for init to reap them"
    rm -rf -- "$dir/pids" "$dir"/slurmctld.pid "$dir"/slurmd-*.pid "$dir/state" "$dir"/spool-n* "$dir/slurm.conf.tmp"
    log "stopped the cluster in $dir"
}

main() {
    (($# >= 2)) || usage
    local cmd=$1 dir
    case "$cmd" in
    start)
        (($# <= 3)) || usage
        local nodes=${3:-3}
        if ! is_uint "$nodes" || ((nodes < 1 || nodes > 254)); then usage; fi
        dir=$(abs_dir "$2")
        do_start "$dir" "$nodes"
        ;;
    stop)
        (($# == 2)) || usage
        [[ -d "$2" ]] || {
            log "no directory $2: nothing to stop"
            return 0
        }
        dir=$(cd -- "$2" && pwd -P)
        do_stop "$dir"
        ;;
    *) usage ;;
    esac
}

main "$@"
