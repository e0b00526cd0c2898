#!/usr/bin/env bash
# A single-node Slurm on this machine, for the tests (and for trying the Slurm recipe on one computer):
# Debian's slurm-wlm + munge, slurmctld and slurmd on localhost; also MPICH (Debian's mpich: mpiexec.mpich).
#
#   scripts/local-slurm.sh start    install what is missing (apt-get), configure, start; wait until the node is idle
#   scripts/local-slurm.sh stop     cancel this Slurm's jobs, stop the daemons this script started
#   scripts/local-slurm.sh status   exit 0 when this script's Slurm answers and its node is usable (any user; writes
#                                   nothing); else the reason on stderr, exit 3 for a Slurm this script did not set up
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
CONF=/etc/slurm/slurm.conf
MARKER="# written by shardlab scripts/local-slurm.sh"
CPUS_MIN=${SHARDLAB_SLURM_CPUS:-16}

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

write_conf() {
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc); [ "$cpus" -lt "$CPUS_MIN" ] && cpus=$CPUS_MIN
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    install -d -m 0755 /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    cat >"$CONF.tmp" <<EOF
$MARKER: a single-node Slurm for tests; \`scripts/local-slurm.sh stop\` stops it.
ClusterName=shardlab
SlurmctldHost=$host(127.0.0.1)
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
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

running() { [ -s "$STATE/$1.pid" ] && [ -d "/proc/$(cat "$STATE/$1.pid")" ]; }  # as any user (kill -0 needs root)

node_state() { sinfo -h -N -o %T 2>/dev/null | head -1; }

status() {
    if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF" 2>/dev/null; then
        log "$CONF was not written by this script: the tests do not submit jobs to that Slurm"; return 3
    fi
    running slurmctld && running slurmd || { log "no single-node Slurm (scripts/local-slurm.sh) is running"; return 1; }
    case "$(node_state)" in
        idle*|mixed*|allocated*|completing*) return 0 ;;
        *) log "its node is not usable: $(node_state || true)"; return 1 ;;
    esac
}

start() {
    [ "$(id -u)" -eq 0 ] || die 2 "needs root (writes $CONF and starts slurmctld/slurmd); run it as root, or skip the Slurm tests"
    if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
        die 3 "$CONF exists and was not written by this script: a Slurm is configured here already, so nothing is changed"
    fi
    install -d -m 0755 "$STATE"
    if status 2>/dev/null; then log "already running"; return 0; fi
    install_packages
    start_munge
    write_conf
    running slurmctld || daemon slurmctld
    running slurmd || daemon slurmd
    for _ in $(seq 100); do
        case "$(node_state)" in
            idle*|mixed*|allocated*) log "up: $(sinfo -h -N -o '%N %T %c CPUs')"; echo "${SHARDLAB_ORIGIN:-manual}" >"$STATE/started-by"; return 0 ;;
            down*|drain*) scontrol update NodeName="$(hostname -s)" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.3
    done
    die 1 "the node did not become idle within 30 s: see /var/log/slurm/slurmctld.log and slurmd.log"
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
    [ "$(id -u)" -eq 0 ] || die 2 "needs root"
    [ -d "$STATE" ] || { log "not running"; return 0; }
    if running slurmctld && grep -qF "$MARKER" "$CONF" 2>/dev/null; then
        # This Slurm runs only what was submitted to it on this machine: cancel it all, wait for the queue to empty.
        scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
        for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
    stop_pid slurmd
    stop_pid slurmctld
    stop_pid munged
    rm -f "$STATE/started-by"
    log "stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 64 ;;
esac
