#!/usr/bin/env bash
# A single-node Slurm cluster in a private directory, for the Slurm tests and for trying the
# sbatch templates by hand (docs/slurm.md).
#
#   tests/slurm/cluster.sh start DIR    # munged + slurmctld + slurmd; prints SLURM_CONF=...
#   export SLURM_CONF=DIR/slurm.conf    # then sbatch/squeue/scontrol talk to this cluster
#   tests/slurm/cluster.sh stop DIR     # cancels its jobs, stops the daemons by their PID files
#
# Needs the Debian packages munge slurmctld slurmd slurm-client and root (slurmd starts jobs
# as the submitting user). No systemd: the daemons are started by hand, every state directory,
# log, socket and the munge key live under DIR, and the ports are free ones picked at start.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

die() { echo "cluster.sh: $*" >&2; exit 1; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

first_job_id() {  # random, below Slurm's default MaxJobId (67043328), room for many jobs
    python3 -c 'import random; print(random.randrange(1000, 60_000_000))'
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
    local limit=$1 what=$2; shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || die "timed out after ${limit}s waiting for $what (logs: $dir/log)"
        sleep 0.2
    done
}

start_munge() {
    # munged checks that its socket directory is world-readable (mode 755) and that the key
    # is private (mode 400) and owned by the daemon's user.
    mkdir -p "$dir/munge" && chmod 755 "$dir/munge"
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    wait_for 10 munged munge --socket="$dir/munge/munge.socket" -n
}

write_slurm_conf() {
    local host cpus
    host=$(hostname -s)
    # Four CPUs however many the machine has (SlurmdParameters=config_overrides lets slurmd
    # accept it), so tests can oversubscribe a 2-core VM with 4 ranks as the MPI tests do.
    cpus=${HPCDL_TEST_SLURM_CPUS:-4}
    sed -e "s|@DIR@|$dir|g" -e "s|@HOST@|$host|g" -e "s|@USER@|$(id -un)|g" \
        -e "s|@CPUS@|$cpus|g" -e "s|@CTLD_PORT@|$(free_port)|g" \
        -e "s|@SLURMD_PORT@|$(free_port)|g" -e "s|@FIRST_JOB_ID@|$(first_job_id)|g" \
        "$here/slurm.conf.in" >"$dir/slurm.conf"
}

node_idle() {
    [ "$(sinfo -h -o %T 2>/dev/null | head -1)" = idle ]
}

start() {
    for b in munged slurmctld slurmd sbatch scontrol; do
        command -v "$b" >/dev/null || die "$b not found (apt-get install munge slurmctld slurmd slurm-client)"
    done
    [ "$(id -u)" -eq 0 ] || die "must run as root (slurmd starts jobs as the submitting user)"
    mkdir -p "$dir"/{run,log,state,spool}
    start_munge
    write_slurm_conf
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    wait_for 30 "the node to become idle" node_idle
    echo "SLURM_CONF=$SLURM_CONF"
}

stop_pidfile() {  # stop_pidfile FILE: TERM the daemon named by FILE, wait, then KILL
    local file=$1 pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

stop() {
    export SLURM_CONF=$dir/slurm.conf
    if [ -f "$SLURM_CONF" ] && [ -s "$dir/run/slurmctld.pid" ]; then
        # Cancel this cluster's jobs first so that no job step outlives its slurmd.
        scancel --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 50); do
            [ -z "$(squeue -h -t running,completing -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    stop_pidfile "$dir/run/slurmd.pid"
    stop_pidfile "$dir/run/slurmctld.pid"
    stop_pidfile "$dir/run/munged.pid"
}

[ $# -eq 2 ] || die "usage: cluster.sh start|stop DIR"
dir=$(mkdir -p "$2" && cd "$2" && pwd)
case $1 in
    start) start ;;
    stop) stop ;;
    *) die "unknown action '$1' (start|stop)" ;;
esac
