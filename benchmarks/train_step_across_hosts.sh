#!/usr/bin/env bash
# The training step across two hosts of the test cluster (tests/cluster/cluster.sh), links
# shaped with tbf: the no-comm ceiling, hpcdl's overlapped step (on the backend and buckets its
# timed trial picks, and on gloo), bf16 on the wire, DDP + gloo in fp32 and with its
# fp16_compress_hook, and Horovod where it imports, in ONE invocation per repeat.
#
#   export HPCDL_CLUSTER_DIR=/var/tmp/hpcdl-bench-cluster
#   tests/cluster/cluster.sh up 2
#   benchmarks/train_step_across_hosts.sh OUT_DIR RATE [REPEATS] [PYTHON]
#
# RATE is tc's (250mbit, 1gbit, ...), set on both directions of h1's and h2's links. PYTHON
# (default python3) may be a bench venv's with Horovod built in (docs/performance.md). Each
# repeat: AlexNet-BN 224 px, batch 32 per rank, 1 thread per rank, 1 warm-up + 6 timed steps
# per mode in 6 rotated rounds (one step each: a neighbour's load falls on every mode); the
# JSON records the hosts, each host's tc qdisc, the load average, and per mode the bytes each
# host's eth0 really sent and the CPU seconds per step.
set -euo pipefail
OUT=$1 RATE=$2 REPEATS=${3:-1} PY=${4:-python3}
: "${HPCDL_CLUSTER_DIR:?export HPCDL_CLUSTER_DIR (tests/cluster/cluster.sh up 2 first)}"
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
for h in h1 h2; do "$here/tests/cluster/cluster.sh" shape "$h" "$RATE"; done
# horovod is always asked for: where it does not import, the JSON's absent_modes says why.
MODES=no_comm,ours,ours@gloo,ours_bf16,ddp_gloo,ddp_gloo_fp16,horovod
for r in $(seq 1 "$REPEATS"); do
  echo "== $(date -u +%FT%T) $RATE run $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
  "$here/tests/cluster/cluster.sh" exec h1 env PATH="$PATH" OMP_NUM_THREADS=1 bash -c \
    "cd $here && mpiexec -launcher ssh -launcher-exec $HPCDL_CLUSTER_DIR/bin/ssh -hosts h1,h2 \
     -ppn 1 -n 2 $PY -m hpcdl.cli.main bench train --model alexnet_bn --image-size 224 \
     --batch 32 --synthetic --threads 1 --steps 6 --rounds 6 --warmup 1 --no-breakdown \
     --modes $MODES --json $OUT/step-$RATE-run$r.json"
done
