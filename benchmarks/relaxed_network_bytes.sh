#!/usr/bin/env bash
# What crosses the network for each consistency policy, on the test cluster: 2 hosts x 2 ranks,
# one `hpcdl bench relaxed --runs RUN` per policy, each host's eth0 counters read before and
# after (tests/cluster/cluster.sh bytes). Counts everything on the wire (TCP/IP headers, the
# launcher's and the data loader's traffic included), which is what a fabric carries; the
# call-site counts of the bench's own JSON stay beside it for comparison.
#
#   export HPCDL_CLUSTER_DIR=/var/tmp/hpcdl-relaxed-cluster
#   benchmarks/relaxed_network_bytes.sh OUT_DIR [RUNS] [EPOCHS]    # default sync,hierarchical,ddp_sync 2
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "$1" && cd "$1" && pwd)
runs=${2:-sync,hierarchical,ddp_sync}
epochs=${3:-2}
cluster=$repo/tests/cluster/cluster.sh
dir=${HPCDL_CLUSTER_DIR:?set HPCDL_CLUSTER_DIR to a cluster directory}
"$cluster" up 2 >/dev/null
data=$dir/shared/relaxed-data
for run in ${runs//,/ }; do
    read -r rx1a tx1a < <("$cluster" bytes h1)
    read -r rx2a tx2a < <("$cluster" bytes h2)
    "$cluster" exec h1 env PATH="$PATH" OMP_NUM_THREADS=1 bash -c "cd $repo && mpiexec -launcher ssh \
        -launcher-exec $dir/bin/ssh -hosts h1,h2 -ppn 2 -n 4 hpcdl bench relaxed --runs $run \
        --epochs $epochs --ranks-per-node 2 --data $data --out $dir/shared/relaxed-runs \
        --json $out/relaxed-$run.json" >"$out/relaxed-$run.log" 2>&1
    read -r rx1b tx1b < <("$cluster" bytes h1)
    read -r rx2b tx2b < <("$cluster" bytes h2)
    printf '{"run": "%s", "h1": {"tx": %d, "rx": %d}, "h2": {"tx": %d, "rx": %d}, "load": "%s", "cpu": "%s"}\n' \
        "$run" $((tx1b - tx1a)) $((rx1b - rx1a)) $((tx2b - tx2a)) $((rx2b - rx2a)) \
        "$(cut -d' ' -f1-3 /proc/loadavg)" "$(lscpu | sed -n 's/^Model name: *//p')" \
        | tee -a "$out/eth0-bytes.jsonl"
done
