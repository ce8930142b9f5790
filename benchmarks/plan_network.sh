#!/usr/bin/env bash
# The planner's network model checked on a network (the test cluster, tests/cluster/cluster.sh):
# at each link rate, `hpcdl plan --calibrate` across h1,h2 (one rank each) learns α and β into
# a machine file, then `hpcdl bench allreduce` measures MPICH's MPI_Allreduce (mpi) and hpcdl's
# ring at 2 and 3 hosts; predict_vs_measured.py sets the planner's times beside them.
#
#   export HPCDL_CLUSTER_DIR=/var/tmp/hpcdl-bench-cluster
#   tests/cluster/cluster.sh up 3
#   benchmarks/plan_network.sh OUT_DIR RATE...        # e.g. 2gbit 1gbit: the first calibrates
#
# The node's own figures are the shipped hpcdl/plan/machines/local.yaml (only the network is
# measured: γ, the reduction's cost, is < 3% of β at these rates).
set -euo pipefail
OUT=$1; shift
: "${HPCDL_CLUSTER_DIR:?export HPCDL_CLUSTER_DIR (tests/cluster/cluster.sh up 3 first)}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
across() {  # across N CMD...: CMD as N ranks, one on each of h1..hN
    local n=$1; shift
    "$here/tests/cluster/cluster.sh" exec h1 env PATH="$PATH" OMP_NUM_THREADS=1 bash -c \
      "cd $here && mpiexec -launcher ssh -launcher-exec $HPCDL_CLUSTER_DIR/bin/ssh \
       -hosts $(seq -s, -f h%g 1 "$n") -ppn 1 -n $n $*"
}
for rate in "$@"; do
  for h in h1 h2 h3; do "$here/tests/cluster/cluster.sh" shape "$h" "$rate"; done
  mkdir -p "$OUT/machines-$rate"
  cp "$here/hpcdl/plan/machines/local.yaml" "$OUT/machines-$rate/local.yaml"
  echo "== $(date -u +%FT%T) calibrate at $rate, load $(cut -d' ' -f1-3 /proc/loadavg)"
  across 2 python3 -m hpcdl.cli.main plan --calibrate --machines-dir "$OUT/machines-$rate"
  for n in 2 3; do
    echo "== $(date -u +%FT%T) allreduce, $n hosts at $rate, load $(cut -d' ' -f1-3 /proc/loadavg)"
    across "$n" python3 -m hpcdl.cli.main bench allreduce --backends mpi,ring \
      --sizes 25M,244M --repeats 5 --warmup 1 --only-listed \
      --json "$OUT/allreduce-${n}hosts-$rate.json"
  done
done
echo "== $(date -u +%FT%T) done, load $(cut -d' ' -f1-3 /proc/loadavg)"
