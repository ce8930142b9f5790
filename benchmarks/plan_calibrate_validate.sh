#!/usr/bin/env bash
# The planner checked on this machine: calibrate it (`hpcdl plan --calibrate`), predict and measure
# the training step of workloads the calibration never ran (`hpcdl plan --validate`), re-run the
# papers' comparison, and record everything (docs/planner.md, docs/performance.md#planner).
#
#   source VENV/bin/activate && cd REPO && bash benchmarks/plan_calibrate_validate.sh
#
# Run on a QUIET machine (nothing else running): about 10 minutes on 2 cores (calibration
# ~1 min; 9 validation rows x 3 repeats of `hpcdl bench train`, 1 warm-up + 2 timed steps of 8
# images per rank; the papers' plans take seconds). It writes
#   docs/results/plan-calibrate-DATE.yaml               the calibration (= the new local.yaml)
#   docs/results/plan-validate-DATE.json                predicted / measured per row
#   docs/results/plan-papers-DATE-{skx,knl}.json        the papers' runs, with breakdowns
#   docs/results/plan-validate-DATE.log                 everything printed, with load averages
#   hpcdl/plan/machines/local.yaml                      replaced by this calibration
# Overrides (for a plumbing check under load): OUT_DIR, LOCAL_YAML (where the calibration is
# copied; "-" = nowhere), WORKLOADS (MODEL@SIZE,...), PROCS (1,2,4), REPEATS (3), STEPS (2),
# PRECISION (float32; bfloat16 calibrates and validates the bf16 rates, only on a CPU with
# native bf16),
# BUDGET_S (690: the whole script's seconds; validation starts no bench run that would end
# past them, measures rows in rounds so every row is measured once before any twice, and
# lists rows it never reached under "not_measured" in its JSON).
set -euo pipefail
export OMP_NUM_THREADS=1          # each rank sets its own threads (cores / ranks)
STAMP=$(date -u +%Y-%m-%d)
OUT_DIR=${OUT_DIR:-docs/results}
LOCAL_YAML=${LOCAL_YAML:-hpcdl/plan/machines/local.yaml}
WORKLOADS=${WORKLOADS:-alexnet_bn@224,resnet50@112,resnet50@224}
PROCS=${PROCS:-1,2,4}
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-2}
BUDGET_S=${BUDGET_S:-690}
PRECISION=${PRECISION:-float32}
mkdir -p "$OUT_DIR"
CAL_DIR=$(mktemp -d)
LOG="$OUT_DIR/plan-validate-$STAMP.log"
exec > >(tee "$LOG") 2>&1
start=$SECONDS

echo "== $(date -u +%FT%TZ) $(uptime)"
echo "== CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1); torch capability:" \
     "$(python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())'); cores: $(nproc --all)"

echo "== calibrate (class rates in $PRECISION on 1 thread and on all cores, allreduce, decode)"
hpcdl plan --calibrate --precision "$PRECISION" --machines-dir "$CAL_DIR"
cp "$CAL_DIR/local.yaml" "$OUT_DIR/plan-calibrate-$STAMP.yaml"
echo "== $(date -u +%FT%TZ) calibrated in $((SECONDS - start)) s; $(uptime)"

LEFT=$((BUDGET_S - (SECONDS - start) - 20))   # 20 s for the papers' plans and the copies
echo "== validate: $WORKLOADS at np $PROCS, $REPEATS repeats of $STEPS steps, $LEFT s budget" \
     "(bf16: see the line below)"
hpcdl plan --validate --machine local --machines-dir "$CAL_DIR" --precision "$PRECISION" \
    --validate-workloads "$WORKLOADS" --validate-procs "$PROCS" \
    --repeats "$REPEATS" --steps "$STEPS" --validate-timeout 300 --validate-budget "$LEFT" \
    --json "$OUT_DIR/plan-validate-$STAMP.json"
echo "== $(date -u +%FT%TZ) validated at $((SECONDS - start)) s; $(uptime)"

echo "== the papers' runs with this model (spec machine files; no measurement)"
hpcdl plan --recipe recipes/alexnet_bn_lars_32k.yaml --procs 2048 --machine skx \
    --json "$OUT_DIR/plan-papers-$STAMP-skx.json"
hpcdl plan --recipe recipes/resnet50_lars_32k.yaml --procs 2048 --machine knl \
    --json "$OUT_DIR/plan-papers-$STAMP-knl.json"

if [ "$LOCAL_YAML" != "-" ]; then
    cp "$CAL_DIR/local.yaml" "$LOCAL_YAML"
    echo "== wrote $LOCAL_YAML (this calibration)"
fi
rm -rf "$CAL_DIR"
echo "== done in $((SECONDS - start)) s; $(uptime)"
