"""torch.compile (inductor, CPU) on the training step's model against eager, the same plain
torch step (hpcdl.bench.baselines.plain_step: LARS, the bench's schedule, bf16 autocast),
ResNet-50 at 112 px, batch 32, channels_last, the two variants taking turns.

    OMP_NUM_THREADS=2 python3 measure.py ROUNDS STEPS_PER_ROUND OUT.json [MODE]

MODE: torch.compile's mode (default "default"). Records the compile time (the first
compiled step, forward and backward graphs both) and each variant's wall and CPU seconds
per step.
"""
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from hpcdl.bench import train as bench
from hpcdl.bench.baselines import plain_step
from hpcdl.cpus import cpu_capability, cpu_model_name, retain_freed_memory
from hpcdl.train.trainer import recipe_model, recipe_optimizer, recipe_schedule

MODEL, SIZE, BATCH = "resnet50", 112, 32


def stepper(compiled: bool, mode: str):
    args = SimpleNamespace(model=MODEL, num_classes=1000, image_size=SIZE, workers=1,
                           batch=BATCH, backend="mpi", bucket_mb=25.0, shard_update=False,
                           memory_format="channels_last")
    config = bench.bench_config(args, 1, "bfloat16")
    net = recipe_model(config).to(memory_format=torch.channels_last)
    schedule = recipe_schedule(config, 10 ** 6, 10 ** 6)
    optimizer = recipe_optimizer(config, net, schedule)
    forward = torch.compile(net, mode=mode) if compiled else net
    return plain_step(forward, optimizer, schedule, True, torch.channels_last)


def timed(step, batch) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    step(batch)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    rounds, per_round, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mode = sys.argv[4] if len(sys.argv) > 4 else "default"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    retain_freed_memory()
    load_before = os.getloadavg()
    batches = bench.endless(bench.SyntheticImages(BATCH, SIZE, 1000, 10 ** 6))
    steppers = {"eager": stepper(False, mode), "compiled": stepper(True, mode)}
    first = {v: timed(steppers[v], next(batches)) for v in ("eager", "compiled")}
    print(f"first step: {first}", flush=True)
    for v in steppers:   # one more untimed step each (the compiled one may recompile once)
        timed(steppers[v], next(batches))
    wall: dict[str, list[float]] = {v: [] for v in steppers}
    cpu: dict[str, list[float]] = {v: [] for v in steppers}
    names = list(steppers)
    for r in range(rounds):
        for v in names[r % 2:] + names[:r % 2]:
            for _ in range(per_round):
                w, c = timed(steppers[v], next(batches))
                wall[v].append(w)
                cpu[v].append(c)
    med = {v: statistics.median(wall[v]) for v in names}
    report = {
        "command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} python3 measure.py "
                   + " ".join(sys.argv[1:]),
        "model": MODEL, "image_size": SIZE, "batch": BATCH, "precision": "bfloat16",
        "memory_format": "channels_last", "threads": torch.get_num_threads(),
        "compile_mode": mode, "torch": torch.__version__,
        "cpu": cpu_model_name(), "cpu_capability": cpu_capability(),
        "first_step_s": {v: first[v][0] for v in names},
        "compile_s": first["compiled"][0] - first["eager"][0],
        "variants": {v: {"wall_s": wall[v], "cpu_s": cpu[v], "median_wall_s": med[v],
                         "median_cpu_s": statistics.median(cpu[v]),
                         "images_per_s_median_wall": BATCH / med[v]} for v in names},
        "compiled_vs_eager": med["eager"] / med["compiled"],
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
    }
    print(json.dumps({k: report[k] for k in ("compile_s", "compiled_vs_eager")}), flush=True)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
