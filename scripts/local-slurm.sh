#!/usr/bin/env bash
# A single-node Slurm on this machine, for the tests (and for trying the Slurm recipe on one computer):
# Debian's slurm-wlm + munge, slurmctld and slurmd on localhost; also MPICH (Debian's mpich: mpiexec.mpich).
#
#   scripts/local-slurm.sh start    install what is missing (apt-get), configure, start; wait until the node is idle
#   scripts/local-slurm.sh start --nodes 2
#                                   two compute nodes instead, node1 and node2 (below); this machine is the login node
#   scripts/local-slurm.sh stop     cancel this Slurm's jobs, stop the daemons this script started; in the two-node
#                                   mode also every process on the nodes, their namespaces, interfaces and folders
#   scripts/local-slurm.sh status [--nodes 2]
#                                   exit 0 when this script's Slurm answers and its node (both nodes) is usable (any
#                                   user; writes nothing; the two-node mode prints its shared folder on stdout); else
#                                   the reason on stderr, exit 3 for a Slurm this script did not set up
#   scripts/local-slurm.sh down node2
#                                   a node dies: its link goes down, every process on it is killed at once; the
#                                   next `start --nodes 2` brings it back
#
# The two-node mode: each node is a slurmd (-N node1, -N node2) in network, UTS and mount namespaces of its own, which
# is all Slurm, MPI, ipyparallel and torch.distributed can tell of a machine: its own address (10.213.0.11 and .12,
# on a bridge whose host end, 10.213.0.1, is where slurmctld listens), its own host name, and its own /tmp (a folder
# of $STATE bound over it, empty at start). The rest of the file system is the login node's, as a cluster's shared
# home and project folders are; $SHARED (mode 1777) is the shared folder the tests give SHARDLAB_SHARED_DIR. munged
# is the login node's, reached through its socket. The namespaces and interfaces it makes are listed in $STATE/made,
# and `stop` removes exactly those; it refuses to start over a namespace or interface of the same name that it did
# not make.
#
# Only `make slurm-start` and `make test-system` (SHARDLAB_SYSTEM_SETUP=1) start it; a plain `make test` asks `status`
# and uses a Slurm that is already up, nothing more.
#
# start/stop need root (they write /etc/slurm/slurm.conf and the munge key, and start daemons). Idempotent: `start` on a
# running Slurm only checks it. It never touches a Slurm it did not set up: if /etc/slurm/slurm.conf exists
# without this script's marker line, `start` stops with exit code 3 and changes nothing.
#
# The node declares at least SHARDLAB_SLURM_CPUS CPUs (default 16; SlurmdParameters=config_overrides), so two
# test jobs of 4 tasks fit side by side on a 2-core machine, as oversubscribed MPI ranks do: results are
# unaffected, timings say nothing about real hardware. A real cluster needs none of this.
#
# Exit codes: 0 ok; 2 cannot run here (not root, no apt-get and nothing installed); 3 a foreign Slurm is
# configured; 1 anything else. The reason is the last line on stderr.
set -euo pipefail

STATE=/run/shardlab-slurm            # pid files, logs, and who started it
ROOT=$(cd "$(dirname "$0")/.." && pwd)  # the checkout
CONF=/etc/slurm/slurm.conf
MARKER="# written by shardlab scripts/local-slurm.sh"
CPUS_MIN=${SHARDLAB_SLURM_CPUS:-16}
NET=10.213.0                         # the two-node mode's private /24: .1 the login node, .11 and .12 the nodes
BRIDGE=shardlab-br0
NODES=(node1 node2)
SHARED=$STATE/shared

die() { echo "local-slurm: $2" >&2; exit "$1"; }
log() { echo "local-slurm: $*" >&2; }
# Daemons start with a clean environment: they are not part of whatever test session or kernel ran this script.
daemon() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

have_slurm() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; }

install_packages() {
    local want=()
    have_slurm || want+=(slurm-wlm munge)
    command -v mpiexec.mpich >/dev/null || want+=(mpich)
    [ ${#want[@]} -eq 0 ] && return 0
    command -v apt-get >/dev/null || { have_slurm && return 0; die 2 "slurm-wlm is not installed and there is no apt-get to install it"; }
    log "installing ${want[*]} (apt-get, about 30-45 s)"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q "${want[@]}" >"$STATE/apt.log" 2>&1; then
        apt-get update -q >>"$STATE/apt.log" 2>&1 || true
        # Slurm first; MPICH is optional for Slurm (its tests skip without it).
        apt-get install -y -q "${want[@]}" >>"$STATE/apt.log" 2>&1 \
            || { have_slurm || apt-get install -y -q slurm-wlm munge >>"$STATE/apt.log" 2>&1; } \
            || die 1 "apt-get install ${want[*]} failed: see $STATE/apt.log"
    fi
    have_slurm || die 1 "slurm-wlm was installed but slurmctld/slurmd/munged are not on PATH"
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi   # a munged already answers
    if [ ! -s /etc/munge/munge.key ]; then
        install -d -o munge -g munge -m 0700 /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge
    [ -d /var/log/munge ] || install -d -m 0700 /var/log/munge
    # As root, munged warns that munge's own log folder is not root's: harmless, kept out of the way.
    daemon munged --force --pid-file="$STATE/munged.pid" 2>>"$STATE/munged.log"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.1; done
    die 1 "munged did not answer (munge -n | unmunge)"
}

write_conf() {  # $1: 1 (this machine is the node) or 2 (node1 and node2)
    local host cpus mem nodes controller partition
    host=$(hostname -s)
    cpus=$(nproc); [ "$cpus" -lt "$CPUS_MIN" ] && cpus=$CPUS_MIN
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    partition="PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    if [ "$1" = 2 ]; then
        # Two CPUs a node, a node of two GPUs in miniature: a job of 4 tasks takes both nodes, 2 tasks on each, as
        # it would on such a cluster; each CPU may be shared by 4 jobs, so the tests' jobs still run side by side.
        # A node that stops answering is declared down after 60 s (SlurmdTimeout, 300 s by default), after the
        # series' 30 s collective time-out, so the ranks left say what they waited for before Slurm ends the job.
        mem=$((mem / 2))
        nodes="NodeName=node1 NodeAddr=$NET.11 CPUs=2 RealMemory=$mem State=UNKNOWN
NodeName=node2 NodeAddr=$NET.12 CPUs=2 RealMemory=$mem State=UNKNOWN"
        partition="$partition OverSubscribe=FORCE:4"
        controller="$NET.1"
    else
        nodes="NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN"
        controller=127.0.0.1
    fi
    install -d -m 0755 /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    cat >"$CONF.tmp" <<CONFEND
$MARKER: a $1-node Slurm for tests; \`scripts/local-slurm.sh stop\` stops it.
ClusterName=shardlab
SlurmctldHost=$host($controller)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=5
MinJobAge=30
SlurmdTimeout=60
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
$nodes
$partition
CONFEND
    mv "$CONF.tmp" "$CONF"
}

# -- the two-node mode's nodes -------------------------------------------------------------------------------------

made() { [ -s "$STATE/made" ] && grep -qxF "$1" "$STATE/made"; }
remember() { echo "$1" >>"$STATE/made"; }

make_nodes() {
    local i=0 node ns
    for node in "${NODES[@]}"; do  # refuse, changing nothing, where a name is taken by something not ours
        ns=shardlab-$node
        if ip netns list | grep -qw "^$ns" && ! made "netns $ns"; then
            die 3 "a network namespace $ns exists that this script did not make: nothing is changed"
        fi
        if ip link show "sh-$node" >/dev/null 2>&1 && ! made "link sh-$node"; then
            die 3 "an interface sh-$node exists that this script did not make: nothing is changed"
        fi
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1 && ! made "link $BRIDGE"; then
        die 3 "an interface $BRIDGE exists that this script did not make: nothing is changed"
    fi
    if ! made "link $BRIDGE" && [ -n "$(ip -4 route show to match "$NET.1" | grep -v '^default')" ]; then
        die 3 "$NET.0/24 is already routed here ($(ip -4 route show to match "$NET.1" | grep -v '^default' | head -1)): nothing is changed"
    fi
    if ! made "link $BRIDGE"; then
        ip link add "$BRIDGE" type bridge && remember "link $BRIDGE"
        ip addr add "$NET.1/24" dev "$BRIDGE"
        ip link set "$BRIDGE" up
    fi
    install -d -m 1777 "$SHARED"
    printf '127.0.0.1 localhost\n%s.1 %s login\n%s.11 node1\n%s.12 node2\n' "$NET" "$(hostname -s)" "$NET" "$NET" \
        >"$STATE/hosts"
    for node in "${NODES[@]}"; do
        i=$((i + 1)); ns=shardlab-$node
        if made "netns $ns"; then
            ip link set "sh-$node" up  # a node taken down (`down`) comes back, its /tmp as it was left
            continue
        fi
        ip netns add "$ns" && remember "netns $ns"
        ip link add "sh-$node" type veth peer name eth0 netns "$ns" && remember "link sh-$node"
        ip link set "sh-$node" master "$BRIDGE" up
        ip -n "$ns" addr add "$NET.1$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" route add default via "$NET.1"
        rm -rf "${STATE:?}/$node/tmp"; install -d -m 1777 "$STATE/$node/tmp"
    done
}

start_node() {  # slurmd in its namespaces: its own address, host name, /tmp and /etc/hosts; /run/munge is shared
    local checkout=""
    install -d -m 0755 "/var/spool/slurmd/$1"
    # A checkout in this machine's /tmp (a fresh clone to test) stays visible on the node, as a project folder on a
    # cluster's shared file system is: bound into the node's /tmp before that hides this one.
    case "$ROOT" in
        /tmp/*) install -d "$STATE/$1/tmp/${ROOT#/tmp/}"
                checkout="mount --bind $ROOT $STATE/$1/tmp/${ROOT#/tmp/} && " ;;
    esac
    # nsenter, not `ip netns exec`, which mounts a /sys of its own without the cgroup file system slurmd reads.
    daemon nsenter --net="/run/netns/shardlab-$1" unshare --uts --mount --propagation private -- sh -c \
        "hostname $1 && ${checkout}mount --rbind $STATE/$1/tmp /tmp && mount --bind $STATE/hosts /etc/hosts && exec slurmd -N $1"
}

on_node() { ip netns pids "shardlab-$1" 2>/dev/null || true; }  # every process on that node: slurmd and its jobs

kill_node() {  # every process on the node, at once (no SIGTERM first: a node that loses power says nothing)
    local pid
    for _ in $(seq 20); do
        [ -z "$(on_node "$1")" ] && return 0
        for pid in $(on_node "$1"); do kill -9 "$pid" 2>/dev/null || true; done
        sleep 0.1
    done
}

down() {  # a node dies: its link goes down and every process on it is killed; `start --nodes 2` brings it back
    [ "$(id -u)" -eq 0 ] || die 2 "needs root"
    case "${1:-}" in node1|node2) ;; *) die 64 "usage: $0 down node1|node2" ;; esac
    made "netns shardlab-$1" || die 1 "$1 is not a node of this script's two-node Slurm"
    ip link set "sh-$1" down
    kill_node "$1"
    rm -f "$STATE/slurmd-$1.pid"
    log "$1 is down: its processes were killed and its link is down"
}

remove_nodes() {
    local node pid what
    for node in "${NODES[@]}"; do
        made "netns shardlab-$node" || continue
        for pid in $(on_node "$node"); do kill "$pid" 2>/dev/null || true; done
        for _ in $(seq 50); do [ -z "$(on_node "$node")" ] && break; sleep 0.1; done
        kill_node "$node"
    done
    if [ -s "$STATE/made" ]; then
        tac "$STATE/made" | while read -r what; do  # the reverse of the order they were made in
            case "$what" in
                "netns "*) ip netns del "${what#netns }" 2>/dev/null || true ;;
                "link "*) ip link del "${what#link }" 2>/dev/null || true ;;
            esac
        done
    fi
    rm -f "$STATE/made" "$STATE/hosts"
    for node in "${NODES[@]}"; do  # never through a mount: the node's bound checkout lived in its namespace only
        if [ -z "$(on_node "$node")" ]; then rm -rf --one-file-system "${STATE:?}/$node"; fi
    done
    rm -rf "$SHARED"
}

running() { [ -s "$STATE/$1.pid" ] && [ -d "/proc/$(cat "$STATE/$1.pid")" ]; }  # as any user (kill -0 needs root)

nodes_up() { if [ -s "$STATE/nodes" ]; then cat "$STATE/nodes"; else echo 1; fi; }
# slurmd names its pid file by SlurmdPidFile's %n, the node's name: the host's own in the one-node mode.
slurmds() { if [ "$(nodes_up)" = 2 ]; then echo slurmd-node1 slurmd-node2; else echo "slurmd-$(hostname -s)"; fi; }

status() {  # $1: the number of nodes asked for
    local daemon state
    if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF" 2>/dev/null; then
        log "$CONF was not written by this script: the tests do not submit jobs to that Slurm"; return 3
    fi
    running slurmctld || { log "no Slurm of scripts/local-slurm.sh is running"; return 1; }
    if [ "$1" != "$(nodes_up)" ]; then
        log "the Slurm of scripts/local-slurm.sh that is up has $(nodes_up) node(s), not $1"; return 1
    fi
    for daemon in $(slurmds); do running "$daemon" || { log "its $daemon is not running"; return 1; }; done
    for state in $(sinfo -h -N -o %T 2>/dev/null || echo none); do
        case "$state" in
            *"*") log "a node does not answer slurmctld yet: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')"; return 1 ;;
            idle*|mixed*|allocated*|completing*) ;;
            *) log "a node is not usable: $(sinfo -h -N -o '%N %T' 2>/dev/null | tr '\n' ' ')"; return 1 ;;
        esac
    done
    if [ "$1" = 2 ]; then echo "$SHARED"; fi
}

start() {  # $1: the number of nodes
    local node
    [ "$(id -u)" -eq 0 ] || die 2 "needs root (writes $CONF and starts slurmctld/slurmd); run it as root, or skip the Slurm tests"
    if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
        die 3 "$CONF exists and was not written by this script: a Slurm is configured here already, so nothing is changed"
    fi
    install -d -m 0755 "$STATE"
    if status "$1" >/dev/null 2>&1; then log "already running"; return 0; fi
    if running slurmctld && [ "$(nodes_up)" != "$1" ]; then
        die 1 "a $(nodes_up)-node Slurm of this script is up: \`scripts/local-slurm.sh stop\` it first"
    fi
    install_packages
    if [ "$1" = 2 ]; then
        command -v ip >/dev/null && command -v unshare >/dev/null \
            || die 2 "the two-node mode needs ip (iproute2) and unshare (util-linux)"
        make_nodes
    fi
    start_munge
    if ! running slurmctld; then  # else only what is missing starts again: a node taken down (`down`)
        write_conf "$1"
        echo "$1" >"$STATE/nodes"
        echo "${SHARDLAB_ORIGIN:-manual}" >"$STATE/started-by"  # who stops it (a test run stops what it started)
        daemon slurmctld -c  # -c: none of an earlier run's state (its nodes, its jobs)
    fi
    if [ "$1" = 2 ]; then
        for node in "${NODES[@]}"; do running "slurmd-$node" || start_node "$node"; done
    else
        running "slurmd-$(hostname -s)" || daemon slurmd
    fi
    for _ in $(seq 100); do
        if status "$1" >/dev/null 2>&1; then
            log "up: $(sinfo -h -N -o '%N %T %c CPUs' | tr '\n' ' ')"; return 0
        fi
        for node in $(sinfo -h -N -t down,drain -o %N 2>/dev/null); do
            scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
        done
        sleep 0.3
    done
    die 1 "the node(s) did not become idle within 30 s: see /var/log/slurm/slurmctld.log and slurmd*.log"
}

stop_pid() {  # the daemon whose pid file this script's configuration names, and nothing else
    local file="$STATE/$1.pid" pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

stop() {
    local daemon
    [ "$(id -u)" -eq 0 ] || die 2 "needs root"
    [ -d "$STATE" ] || { log "not running"; return 0; }
    if running slurmctld && grep -qF "$MARKER" "$CONF" 2>/dev/null; then
        # This Slurm runs only what was submitted to it on this machine: cancel it all, wait for the queue to empty.
        scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
        for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
    for daemon in "slurmd-$(hostname -s)" slurmd-node1 slurmd-node2; do stop_pid "$daemon"; done
    remove_nodes
    stop_pid slurmctld
    stop_pid munged
    rm -f "$STATE/started-by" "$STATE/nodes"
    log "stopped"
}

NODES_ASKED=1
if [ "${2:-}" = "--nodes" ]; then
    case "${3:-}" in
        1|2) NODES_ASKED=$3 ;;
        *) echo "usage: $0 start|status [--nodes 1|2]" >&2; exit 64 ;;
    esac
fi

case "${1:-}" in
    start) start "$NODES_ASKED" ;;
    stop) stop ;;
    status) status "$NODES_ASKED" ;;
    down) down "${2:-}" ;;
    *) echo "usage: $0 start|stop|status [--nodes 1|2] | down node1|node2" >&2; exit 64 ;;
esac
