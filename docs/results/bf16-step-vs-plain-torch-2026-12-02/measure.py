"""hpcdl's compute-only bf16 step against the plain-torch step, same model, threads and
layout, the variants interleaved (the measurement behind the JSON files beside this one).

    OMP_NUM_THREADS=2 python3 measure.py MODEL SIZE BATCH VARIANTS ROUNDS STEPS [profile|noprof]
        [OUT.json]        # VARIANTS: a comma list of hpcdl_cl, plain_cl, hpcdl_c, plain_c
PREC=float32 in the environment measures float32 instead of bf16.
"""
import json
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from mpi4py import MPI

import hpcdl.comm
from hpcdl.bench import train as bench
from hpcdl.bench.baselines import plain_step, recipe_model
from hpcdl.cpus import retain_freed_memory
from hpcdl.optim import create_optimizer, create_schedule
from hpcdl.train.trainer import Trainer, TrainOptions

PREC = os.environ.get("PREC", "bfloat16")


def bench_args(model: str, size: int, batch: int, channels_last: bool) -> SimpleNamespace:
    return SimpleNamespace(model=model, num_classes=1000, image_size=size, workers=1,
                           batch=batch, backend="mpi", bucket_mb=25.0, shard_update=False,
                           memory_format="channels_last" if channels_last else "contiguous")


def stepper(variant: str, model: str, size: int, batch: int, comm, loader):
    channels_last = variant.endswith("_cl")
    config = bench.bench_config(bench_args(model, size, batch, channels_last), 1, PREC)
    if variant.startswith("hpcdl"):
        trainer = Trainer(config, None, tempfile.mkdtemp(), comm, train_loader=loader,
                          options=TrainOptions(no_comm=True, progress=False,
                                               handle_signals=False, write_files=False,
                                               evaluate=False))
        return lambda batch_: trainer.train_step([batch_])
    layout = torch.channels_last if channels_last else torch.contiguous_format
    net = recipe_model(config).to(memory_format=layout)
    schedule = create_schedule(config.schedule, 10 ** 6, 10 ** 6)
    optimizer = create_optimizer(config.optimizer, net, lr=schedule(0))
    return plain_step(net, optimizer, schedule, PREC == "bfloat16",
                      layout if channels_last else None)


def main() -> None:
    model, size, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    variants = sys.argv[4].split(",")
    rounds, per_round = int(sys.argv[5]), int(sys.argv[6])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    retain_freed_memory()
    comm = hpcdl.comm.init("mpi", MPI.COMM_WORLD)
    loader = bench.SyntheticImages(batch, size, 1000, 10 ** 6)
    batches = bench.endless(loader)
    steppers = {v: stepper(v, model, size, batch, comm, loader) for v in variants}
    for v in variants:   # warm-up
        for _ in range(2):
            steppers[v](next(batches))
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            for _ in range(per_round):
                images = next(batches)
                c0, t0 = time.process_time(), time.perf_counter()
                steppers[v](images)
                wall[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
    out = {"precision": PREC, "model": model, "image_size": size, "batch": batch,
           "threads": torch.get_num_threads(),
           "variants": {v: {"wall_s": wall[v], "cpu_s": cpu[v],
                            "median_wall_s": statistics.median(wall[v]),
                            "median_cpu_s": statistics.median(cpu[v]),
                            "images_per_s_median_wall": batch / statistics.median(wall[v])}
                        for v in variants}}
    print(json.dumps({v: round(d["images_per_s_median_wall"], 1)
                      for v, d in out["variants"].items()}))
    if len(sys.argv) > 7 and sys.argv[7] == "profile":
        from torch.profiler import ProfilerActivity, profile

        for v in variants:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                steppers[v](next(batches))
            print("=====", v)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
    if len(sys.argv) > 8:
        with open(sys.argv[8], "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
