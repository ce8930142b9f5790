#!/usr/bin/env bash
# The training step with weight-update sharding (`hpcdl bench train --shard-update`) against the
# same Trainer's allreduce step, the no-comm ceiling and DDP+gloo, repeated for a spread.
#
#   benchmarks/train_step_shard_update.sh [OUT_DIR] [REPEATS]
#
# Each `hpcdl bench train --shard-update` run times, taking turns on ONE Trainer, ours
# (sharded: reduce-scatter, LARS on each rank's slice, allgather), ours_allreduce (the same
# Trainer unsharded: today's step), no_comm (the ceiling, whole optimizer on every rank) and
# DDP+gloo. AlexNet-BN 224 px batch 32 and ResNet-50 112 px batch 16 at -n 2, alternating,
# REPEATS (default 3) times: about 11 minutes on the quiet 2-core VM. Prints one table with
# every run and the median [min-max] of each ratio; the JSON of every run stays in OUT_DIR.
set -euo pipefail
OUT=${1:-docs/results/shard-update-$(date -u +%F)}
REPEATS=${2:-3}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
HPCDL=$(command -v hpcdl)   # the active environment's, whatever mpiexec puts first on PATH
COMMON=(--synthetic --steps 8 --rounds 4 --warmup 2 --no-breakdown --shard-update)
for r in $(seq 1 "$REPEATS"); do
  mpiexec -n 2 "$HPCDL" bench train --model alexnet_bn --image-size 224 --batch 32 "${COMMON[@]}" \
    --json "$OUT/alexnet_bn-224-b32-np2-run$r.json"
  mpiexec -n 2 "$HPCDL" bench train --model resnet50 --image-size 112 --batch 16 "${COMMON[@]}" \
    --json "$OUT/resnet50-112-b16-np2-run$r.json"
done
"$(dirname "$HPCDL")/python" "$(dirname "$0")/summarize_train.py" "$OUT"/*.json | tee "$OUT/summary.md"
