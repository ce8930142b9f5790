#!/usr/bin/env bash
# A cluster of real hosts inside one machine: each host is a network + UTS + mount namespace
# with its own hostname, eth0 (10.99.0.N on a bridge), node-local /tmp, /dev/shm, /etc/hosts,
# sysfs and boot id; one directory is shared by every host (the "parallel file system").
#
#   tests/cluster/cluster.sh up N [--rate R]   # N hosts h1..hN; R shapes every link (tbf), e.g. 1gbit
#   tests/cluster/cluster.sh down              # every process started here ended by PID, namespaces gone
#   tests/cluster/cluster.sh exec HOST CMD...  # run CMD on HOST (the launchers' ssh stand-in: bin/ssh)
#   tests/cluster/cluster.sh shape HOST R|off  # (re)shape one host's link both ways
#   tests/cluster/cluster.sh link HOST up|down # the host's eth0 up or down (a fault)
#   tests/cluster/cluster.sh bytes HOST        # "RX TX" bytes of the host's eth0
#   tests/cluster/cluster.sh pids HOST         # every process in the host's network namespace
#   tests/cluster/cluster.sh slurm up|down     # munged + slurmctld on h1 + slurmd on every host
#   tests/cluster/cluster.sh env               # the variables a shell needs (HPCDL_CLUSTER_DIR, SLURM_CONF...)
#
# Why each piece (docs/architecture.md, "The test cluster"): MPI libraries decide "same node"
# from the hostname and from /proc/sys/kernel/random/boot_id (MPICH's UCX layer), and fall back
# to shared memory when both match, so each host gets its own of both, or "cross-host" traffic
# never reaches eth0. `ip netns exec` remounts /sys and loses /sys/fs/cgroup (slurmd then fails),
# so each host mounts a fresh sysfs (its own /sys/class/net) and moves the cgroup tree back on
# top. Hosts are entered with `nsenter -t PID` on one long-lived holder process per host: namespace
# files pinned with `unshare --mount=FILE` cannot be entered from inside another host's mount
# namespace, which is where a launcher runs. The bridge lives in a namespace of its own: nothing
# is added to the root namespace's links, and traffic only ever goes to 10.99.0.0/24 here.
#
# State: $HPCDL_CLUSTER_DIR (default /var/tmp/hpcdl-cluster; not under /tmp, which every host
# replaces with its own). A checkout or interpreter under /tmp stays visible on every host, at
# its own path (bind-mounted into the host's /tmp). Needs root, iproute2 (ip, tc), util-linux (unshare, nsenter).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${HPCDL_CLUSTER_DIR:-/var/tmp/hpcdl-cluster}
net=10.99.0

die() { echo "cluster.sh: $*" >&2; exit 2; }

need_tools() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces, mounts)"
    for t in ip tc unshare nsenter; do
        command -v "$t" >/dev/null || die "$t not found (apt-get install iproute2 util-linux)"
    done
}

holder() {  # holder NAME: PID of a namespace's long-lived process, if it is alive
    local f=$dir/run/$1.pid pid
    [ -s "$f" ] || return 1
    pid=$(cat "$f")
    [ -e "/proc/$pid/ns/net" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = sleep ] || return 1
    echo "$pid"
}

host_pid() { holder "$1" || die "no host '$1' is up (tests/cluster/cluster.sh up N)"; }

in_switch() { nsenter -t "$(holder switch)" --net "$@"; }

in_host() {  # in_host HOST CMD...: CMD in every namespace of HOST
    local pid
    pid=$(host_pid "$1"); shift
    nsenter -t "$pid" --net --uts --mount "$@"
}

start_holder() {  # start_holder NAME UNSHARE-OPTIONS...: a sleep in new namespaces, PID recorded
    local name=$1; shift
    # setsid: the holder outlives this script, in a session of its own (no terminal signals).
    setsid unshare "$@" sleep infinity </dev/null >/dev/null 2>&1 &
    echo $! >"$dir/run/$name.pid"
    for _ in $(seq 50); do holder "$name" >/dev/null && \
        [ "$(readlink "/proc/$!/ns/net")" != "$(readlink /proc/self/ns/net)" ] && return 0
        sleep 0.05
    done
    die "the namespace holder of $name did not start"
}

write_etc_hosts() {
    local n=$1 i
    {
        echo "127.0.0.1 localhost"
        for i in $(seq 1 "$n"); do echo "$net.$i h$i"; done
    } >"$dir/etc-hosts"
}

kept_under_tmp() {  # the checkout and the interpreter, where they lie under /tmp (one a line)
    # Every host replaces /tmp; a clone or a virtual environment there is common, and a host
    # that cannot `cd` into the checkout or run its python fails every job.
    local p kept=()
    for p in "$here/../.." $(python3 -c 'import sys; print(sys.prefix, sys.base_prefix)' 2>/dev/null); do
        p=$(realpath -e "$p" 2>/dev/null) || continue
        [[ $p == /tmp/* ]] && kept+=("$p")
    done
    [ ${#kept[@]} -gt 0 ] || return 0
    # a path inside another one comes with it
    printf '%s\n' "${kept[@]}" | sort -u | awk 'prev == "" || index($0, prev "/") != 1 { print; prev = $0 }'
}

mount_host_files() {  # mount_host_files HOST: node-local /tmp, /dev/shm, /etc/hosts, sysfs, boot id
    local h=$1 hd=$dir/hosts/$1 p binds=""
    mkdir -p "$hd/tmp" "$hd/cgroup" && chmod 1777 "$hd/tmp"
    cat /proc/sys/kernel/random/uuid >"$hd/boot_id"
    echo "$h" >"$hd/hostname"
    # The checkout and the interpreter stay visible at their own paths inside the host's /tmp
    # (bind mounts in the host's private mount namespace: the root namespace sees empty
    # directories under $hd/tmp, which `down` removes without touching what they stood for).
    while IFS= read -r p; do
        [ -n "$p" ] || continue
        mkdir -p "$hd/tmp/${p#/tmp/}"
        binds+="mount --bind '$p' '$hd/tmp/${p#/tmp/}'"$'\n'
    done < <(kept_under_tmp)
    in_host "$h" sh -ec "
        hostname $h
        mount --make-rprivate /
        $binds
        mount --rbind '$hd/tmp' /tmp
        mount -t tmpfs -o size=1g,mode=1777 shm /dev/shm
        mount --bind '$dir/etc-hosts' /etc/hosts
        mount --bind '$hd/hostname' /etc/hostname
        mount --bind '$hd/boot_id' /proc/sys/kernel/random/boot_id
        mount --rbind /sys/fs/cgroup '$hd/cgroup'
        mount -t sysfs sysfs /sys
        mount --move '$hd/cgroup' /sys/fs/cgroup
    "
}

wire_host() {  # wire_host I: veth from the switch's bridge to host hI's eth0, address 10.99.0.I
    local i=$1 h=h$1
    in_switch ip link add "$h" type veth peer name eth0 netns "$(host_pid "$h")"
    in_switch ip link set "$h" master br0 up
    in_host "$h" ip addr add "$net.$i/24" dev eth0
    in_host "$h" ip link set lo up
    in_host "$h" ip link set eth0 up
}

shape() {  # shape HOST RATE|off: tbf on both directions of the host's link
    local h=$1 rate=$2
    in_host "$h" tc qdisc del dev eth0 root 2>/dev/null || true
    in_switch tc qdisc del dev "$h" root 2>/dev/null || true
    [ "$rate" = off ] && return 0
    # burst: at least one MTU and ~1 ms of the rate; latency bounds the queue (drops past it).
    in_host "$h" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 400ms
    in_switch tc qdisc add dev "$h" root tbf rate "$rate" burst 256kb latency 400ms
}

hosts_up() {  # the names of the hosts that are up
    local f
    for f in "$dir"/run/h*.pid; do
        [ -e "$f" ] || continue
        f=${f##*/}; holder "${f%.pid}" >/dev/null && echo "${f%.pid}"
    done | sort -V
}

up() {
    local n=$1 rate=$2 i
    need_tools
    [[ $n =~ ^[1-9][0-9]?$ ]] && [ "$n" -le 32 ] || die "up: N must be 1..32, got '$n'"
    if holder switch >/dev/null && [ "$(hosts_up | wc -l)" -eq "$n" ]; then
        for i in $(seq 1 "$n"); do in_host "h$i" ip link set eth0 up; shape "h$i" "$rate"; done
        echo "cluster.sh: $n hosts already up ($dir), links ${rate/off/unshaped}"
        return 0
    fi
    down quiet
    mkdir -p "$dir"/{run,hosts,shared,bin,log}
    chmod 1777 "$dir/shared"
    write_etc_hosts "$n"
    start_holder switch --net
    in_switch ip link set lo up
    in_switch ip link add br0 type bridge
    in_switch ip link set br0 up
    for i in $(seq 1 "$n"); do
        start_holder "h$i" --net --uts --mount --propagation private
        mount_host_files "h$i"
        wire_host "$i"
        shape "h$i" "$rate"
    done
    # The launchers' ssh: `ssh [options] HOST COMMAND` runs COMMAND on HOST through this script.
    printf '#!/usr/bin/env bash\nexec %q/cluster.sh ssh "$@"\n' "$here" >"$dir/bin/ssh"
    chmod +x "$dir/bin/ssh"
    echo "$n" >"$dir/run/size"
    echo "cluster.sh: $n hosts up ($dir): $(hosts_up | tr '\n' ' ')links ${rate/off/unshaped}"
}

kill_namespace_processes() {  # every process whose network namespace is NAME's
    local pid=$1 ns p
    ns=$(readlink "/proc/$pid/ns/net") || return 0
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/net" 2>/dev/null)" = "$ns" ] || continue
        kill -9 "${p#/proc/}" 2>/dev/null || true
    done
}

down() {
    local f name pid
    need_tools
    [ -d "$dir/run" ] || { [ "${1:-}" = quiet ] || echo "cluster.sh: no cluster in $dir"; return 0; }
    [ -s "$dir/run/slurm.conf" ] && slurm_down
    for f in "$dir"/run/*.pid; do
        [ -e "$f" ] || continue
        name=${f##*/}; name=${name%.pid}
        if pid=$(holder "$name"); then
            kill -CONT -- $(pids_of "$pid") 2>/dev/null || true   # a frozen host's processes too
            kill_namespace_processes "$pid"
        fi
        rm -f "$f"
    done
    rm -rf "$dir/run" "$dir/hosts"
    [ "${1:-}" = quiet ] || echo "cluster.sh: down ($dir)"
}

pids_of() {  # pids_of HOLDER_PID: every process in that holder's network namespace
    local ns p
    ns=$(readlink "/proc/$1/ns/net") || return 0
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/net" 2>/dev/null)" = "$ns" ] && echo "${p#/proc/}"
    done
    return 0  # the loop's status is its last test's, not an error
}

host_of() {  # host_of NAME|ADDRESS: the host's name (h2 for h2, 10.99.0.2 or h2.local)
    local h=${1%%.*}
    [[ $1 =~ ^$net\.([0-9]+)$ ]] && h=h${BASH_REMATCH[1]}
    echo "$h"
}

ssh_standin() {  # ssh [-x -q -o OPT -p PORT ...] HOST COMMAND...
    while [ $# -gt 0 ]; do
        case $1 in
            -o|-p|-l|-i|-F) shift 2 ;;
            -*) shift ;;
            *) break ;;
        esac
    done
    [ $# -ge 1 ] || die "ssh: no host"
    local h
    h=$(host_of "$1"); shift
    # A remote shell starts in the home directory and runs the command line through a shell.
    in_host "$h" sh -c "cd \"\${HOME:-/}\" 2>/dev/null; $*"
}

slurm_conf() {  # slurm_conf N: slurm.conf for hosts h1..hN, controller on h1
    local n=$1 port1 port2
    port1=$((6800 + RANDOM % 100)); port2=$((6900 + RANDOM % 100))
    cat >"$dir/run/slurm.conf" <<EOF
# The test cluster's Slurm (tests/cluster/cluster.sh slurm up): controller on h1, slurmd per host.
ClusterName=hpcdlcluster
SlurmctldHost=h1($net.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$port1
SlurmdPort=$port2
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s);
# also a job step's credential lifetime, which 30 s leaves ample for a local launch.
AuthInfo=socket=$dir/run/munge/munge.socket,cred_expire=30
StateSaveLocation=$dir/run/slurm-state
SlurmdSpoolDir=$dir/run/slurmd-%n
SlurmctldPidFile=$dir/run/slurmctld.pid.slurm
SlurmdPidFile=$dir/run/slurmd-%n.pid.slurm
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmi2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=3600
FirstJobId=$((1000 + RANDOM * 100))
JobRequeue=1
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
KillWait=5
SlurmdTimeout=30
SlurmdParameters=config_overrides
NodeName=h[1-$n] NodeAddr=$net.[1-$n] CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=h[1-$n] Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...
    local limit=$1 what=$2; shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || die "timed out after ${limit}s waiting for $what (logs: $dir/log)"
        sleep 0.2
    done
}

# Slurm's clients run inside a host: the controller's address exists only on the cluster's
# bridge, and from the root namespace 10.99.0.1 would be routed off the machine.
on_h1() { in_host h1 env SLURM_CONF="$dir/run/slurm.conf" "$@"; }

nodes_idle() { [ "$(on_h1 sinfo -h -N -o %T | sort -u)" = idle ]; }

slurm_up() {
    local n h
    for b in munged slurmctld slurmd sbatch; do
        command -v "$b" >/dev/null || die "$b not found (apt-get install munge slurmctld slurmd slurm-client)"
    done
    [ -s "$dir/run/size" ] || die "slurm up: no cluster (tests/cluster/cluster.sh up N first)"
    n=$(cat "$dir/run/size")
    export SLURM_CONF=$dir/run/slurm.conf
    if [ -s "$SLURM_CONF" ] && on_h1 sinfo -h >/dev/null 2>&1; then echo "SLURM_CONF=$SLURM_CONF"; return 0; fi
    mkdir -p "$dir/run/munge" "$dir/run/slurm-state" && chmod 755 "$dir/run/munge"
    # munged in the root namespace: its socket is a file in the shared state directory, which
    # every host's mount namespace sees (a unix socket crosses network namespaces).
    dd if=/dev/urandom of="$dir/run/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/run/munge/munge.key"
    munged --force --socket="$dir/run/munge/munge.socket" --key-file="$dir/run/munge/munge.key" \
        --pid-file="$dir/run/munged.pid.slurm" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/run/munge/munged.seed"
    wait_for 10 munged munge --socket="$dir/run/munge/munge.socket" -n
    slurm_conf "$n"
    in_host h1 env SLURM_CONF="$SLURM_CONF" slurmctld -f "$SLURM_CONF"
    for h in $(hosts_up); do
        in_host "$h" env SLURM_CONF="$SLURM_CONF" slurmd -f "$SLURM_CONF"
    done
    wait_for 60 "every node idle" nodes_idle
    echo "SLURM_CONF=$SLURM_CONF"
}

slurm_down() {
    local f pid
    export SLURM_CONF=$dir/run/slurm.conf
    if [ -s "$SLURM_CONF" ]; then
        holder h1 >/dev/null && { on_h1 timeout 10 scancel --user=root 2>/dev/null || true; }
    fi
    for f in "$dir"/run/*.pid.slurm; do
        [ -s "$f" ] || continue
        pid=$(cat "$f")
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$f"
    done
    rm -f "$SLURM_CONF"
}

[ $# -ge 1 ] || die "usage: cluster.sh up N [--rate R] | down | exec HOST CMD... | shape HOST R|off | link HOST up|down | bytes HOST | pids HOST | slurm up|down | env"
action=$1; shift
case $action in
    up)
        [ $# -ge 1 ] || die "usage: cluster.sh up N [--rate R]"
        n=$1 rate=off; shift
        while [ $# -gt 0 ]; do
            case $1 in
                --rate) [ $# -ge 2 ] || die "--rate needs a value (e.g. 1gbit)"; rate=$2; shift 2 ;;
                *) die "up: unknown option '$1'" ;;
            esac
        done
        up "$n" "$rate" ;;
    down) down ;;
    exec) [ $# -ge 2 ] || die "usage: cluster.sh exec HOST CMD..."; h=$(host_of "$1"); shift; in_host "$h" "$@" ;;
    ssh) ssh_standin "$@" ;;
    shape) [ $# -eq 2 ] || die "usage: cluster.sh shape HOST RATE|off"; shape "$(host_of "$1")" "$2" ;;
    link)
        [ $# -eq 2 ] && [[ $2 =~ ^(up|down)$ ]] || die "usage: cluster.sh link HOST up|down"
        in_host "$(host_of "$1")" ip link set eth0 "$2" ;;
    bytes) [ $# -eq 1 ] || die "usage: cluster.sh bytes HOST"
        in_host "$(host_of "$1")" cat /sys/class/net/eth0/statistics/rx_bytes \
            /sys/class/net/eth0/statistics/tx_bytes | paste -sd' ' ;;
    pids) [ $# -eq 1 ] || die "usage: cluster.sh pids HOST"; pids_of "$(host_pid "$(host_of "$1")")" ;;
    hosts) hosts_up ;;
    slurm)
        case ${1:-} in
            up) slurm_up ;;
            down) slurm_down ;;
            *) die "usage: cluster.sh slurm up|down" ;;
        esac ;;
    env) echo "HPCDL_CLUSTER_DIR=$dir"; [ -s "$dir/run/slurm.conf" ] && echo "SLURM_CONF=$dir/run/slurm.conf"; true ;;
    *) die "unknown action '$action'" ;;
esac
