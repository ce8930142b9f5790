#!/usr/bin/env bash
# The papers' two runs on paper: every `hpcdl plan` figure quoted in docs/planner.md,
# docs/reproduce.md and docs/performance.md (Planner, Relaxed consistency), regenerated from the
# code and the spec machine files (skx, knl). No measurement: a few seconds per plan.
#
#   bash benchmarks/plan_papers.sh [OUT_DIR]      # default docs/results/plan-spec-machines-DATE
#
# Writes one JSON per plan (its "command" field is the exact command) and prints a summary line
# per plan. The sensitivity rows scale a class group of a copy of the spec file (dense
# convolution/linear fractions, memory-pass fractions, per-layer overhead to ~0) under a
# temporary --machines-dir; the JSON's "machine" block records the scaled figures.
set -euo pipefail
OUT=${1:-docs/results/plan-spec-machines-$(date -u +%F)}
mkdir -p "$OUT"
SCALED=$(mktemp -d)
trap 'rm -rf "$SCALED"' EXIT
ALEX=(--recipe recipes/alexnet_bn_lars_32k.yaml --procs 2048 --machine skx)
RES=(--recipe recipes/resnet50_lars_32k.yaml --procs 2048 --machine knl)
RES_SKX=(--recipe recipes/resnet50_lars_32k.yaml --procs 2048 --machine skx)
plan() { local name=$1; shift; hpcdl plan "$@" --json "$OUT/$name.json" >/dev/null; }

plan alexnet_bn_32k-skx "${ALEX[@]}" --sweep 256,512,1024,2048,4096
plan resnet50_32k-knl "${RES[@]}" --sweep 256,512,1024,2048,4096
plan alexnet_bn_32k-skx-rab "${ALEX[@]}" --allreduce rabenseifner
plan alexnet_bn_32k-skx-hier "${ALEX[@]}" --allreduce hierarchical
plan alexnet_bn_32k-skx-noov "${ALEX[@]}" --no-overlap
plan resnet50_32k-knl-rab "${RES[@]}" --allreduce rabenseifner

python - "$SCALED" <<'PY'
import pathlib, sys
import yaml
from hpcdl.plan import machine as _machine  # noqa: F401  (the package's machine files)
src = pathlib.Path(_machine.__file__).parent / "machines"
dense = ["conv_large", "conv_1x1", "conv_3x3", "conv_grouped", "linear"]
passes = ["batch_norm", "relu", "add", "pool", "dropout", "lrn"]
variants = {"dense08": (dense, 0.8), "dense125": (dense, 1.25), "mem08": (passes, 0.8),
            "mem125": (passes, 1.25), "nooverhead": (["layer_overhead_s"], 1e-7)}
for tag, (keys, factor) in variants.items():
    out = pathlib.Path(sys.argv[1]) / tag
    out.mkdir(parents=True)
    for name in ("skx", "knl"):
        d = yaml.safe_load((src / f"{name}.yaml").read_text())
        for k in keys:
            d["compute"][k]["value"] *= factor
            d["compute"][k]["source"] = f"x {factor} of the shipped figure (sensitivity)"
        (out / f"{name}.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
PY
for tag in dense08 dense125 mem08 mem125 nooverhead; do
  plan "alexnet_bn_32k-skx-$tag" "${ALEX[@]}" --machines-dir "$SCALED/$tag"
  plan "resnet50_32k-knl-$tag" "${RES[@]}" --machines-dir "$SCALED/$tag"
done

# Relaxed consistency, both models on skx; the synchronous warm-up = each recipe's lr warm-up
# (AlexNet-BN 400 iterations, ResNet-50 25 epochs = 975 iterations).
for m in alexnet_bn resnet50; do
  if [ $m = alexnet_bn ]; then R=(--recipe recipes/alexnet_bn_lars_32k.yaml --procs 2048 --machine skx); W=400
  else R=("${RES_SKX[@]}"); W=975; fi
  plan "relaxed-${m}_32k-skx-sync" "${R[@]}"
  plan "relaxed-${m}_32k-skx-local" "${R[@]}" --local-steps 8 --sync-warmup-steps $W
  plan "relaxed-${m}_32k-skx-hier" "${R[@]}" --local-steps 8 --hierarchical-local --sync-warmup-steps $W
  plan "relaxed-${m}_32k-skx-psgd2" "${R[@]}" --powersgd-rank 2 --sync-warmup-steps $W
  plan "relaxed-${m}_32k-skx-psgd4" "${R[@]}" --powersgd-rank 4 --sync-warmup-steps $W
done

python - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    it = d["per_iteration"]
    print(f"{f.stem:36s} {d['total_s'] / 60:6.2f} min  iteration {it['iteration_s'] * 1e3:6.1f} ms"
          f"  compute {it['compute_s'] * 1e3:6.1f}  exposed comm {it['comm_exposed_s'] * 1e3:6.1f}"
          f"  {d['dominant']}")
PY
