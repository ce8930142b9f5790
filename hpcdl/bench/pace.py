"""Does the loader keep pace with the bf16 step? ``hpcdl bench loader --pace STEP.json ...``
measures how fast one decode thread turns real JPEG shards into 224-px batches, then runs
ranks that consume batches at a measured bf16 step rate and times what they wait for data
(docs/data.md, "Decode threads per compute core").

Each choice, and why:

- **Real shards.** JPEG shards written by ``prep shard`` and decoded by ShardedImageNet's own
  path (simplejpeg at the smallest DCT scale, torch's uint8 resize), not the in-memory tensors
  of ``hpcdl bench train``: the decode is the cost being sized.
- **The step rate is read, never typed.** It comes from a raw file of the bf16 step (the
  ``variants`` JSON of ``docs/results/bf16-step-vs-plain-torch-*``) as images per CPU-second
  of the step: per core, the unit a core-hour buys, and steadier than wall time on a shared
  machine.
- **The consumer's compute is CPU work, not a sleep.** Each step runs a fixed number of
  single-threaded matrix products (they release the GIL, as the real step's kernels do),
  calibrated in CPU seconds of the rank's own core: a core shared with decode threads then
  stretches the step, as in training, instead of hiding the decode inside a wall-clock sleep.
  So a run reports both the wait for data and the rate delivered against the step's.
- **One rank per core.** ``shared``: every core runs one rank bound to it, its decode threads
  on the same core (a layout that reserves nothing for decode). ``reserved``: one rank
  computes on the first core and its decode threads run on the others, the layout the sbatch
  templates make by giving each rank ``data.workers`` cores beside its compute threads
  (docs/slurm.md).
- **Decode threads per compute core** = step images/s per core ÷ decode images/s per thread
  (:func:`pace_ratios`); what a rank of the templates needs follows from it
  (``hpcdl.figures.tables.pace_decode_threads``, the docs' table).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

from hpcdl.errors import BadInputError

#: The bf16 step measured by hpcdl's trainer in channels_last, the faster layout (so the
#: decode is sized for the more demanding step).
DEFAULT_VARIANT = "hpcdl_cl"
#: Matrix side of the calibrated compute: ~34 MFLOP a product, long enough that the Python
#: loop around it holds the GIL for a negligible share of the step.
MATMUL_SIDE = 256
#: Steps each paced rank runs at least, whatever ``seconds`` says (the first batch, which
#: opens the files and starts the threads, and the first step are not counted).
MIN_STEPS = 3


def step_rate(path: str, variant: str = DEFAULT_VARIANT) -> dict[str, Any]:
    """The bf16 step of one raw step file: model, image size, batch and images per
    CPU-second (per core) of ``variant``'s median step."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInputError(f"--pace {path}: cannot read it ({exc})") from None
    try:
        precision, measured = report["precision"], report["variants"][variant]
        batch, cpu_s = int(report["batch"]), float(measured["median_cpu_s"])
        model, image_size = report["model"], int(report["image_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInputError(f"--pace {path}: not a step file with variant {variant!r} "
                            f"(missing {exc}); expected docs/results/bf16-step-vs-plain-torch-*"
                            f"/MODEL.json") from None
    if precision != "bfloat16":
        raise BadInputError(f"--pace {path}: precision {precision!r}; the pace is the bf16 "
                            f"step's, give a bfloat16 step file")
    return {"model": model, "source": path, "variant": variant, "precision": precision,
            "image_size": image_size, "batch": batch, "step_threads": report.get("threads"),
            "median_cpu_s": cpu_s, "images_per_s_per_core": batch / cpu_s}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def decode_rate(shard_dir: str, batch: int, image_size: int, workers: int,
                seconds: float) -> dict[str, Any]:
    """Batches pulled as fast as they come from ``workers`` decode threads (0: inline), the
    first one excluded: images per wall second and per CPU-second of the process."""
    from hpcdl.bench.train import endless
    from hpcdl.data import ShardedImageNet

    loader = ShardedImageNet(shard_dir, "train", batch_size=batch, image_size=image_size,
                             workers=workers)
    before = load_average()
    batches = endless(loader)
    next(batches)  # warm-up: files opened, threads started
    images, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        images += len(next(batches)[0])
    wall, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    batches.close()
    loader.close()
    return {"kind": "decode", "workers": workers, "batch": batch, "image_size": image_size,
            "images": images, "wall_s": wall, "cpu_s": cpu_s, "images_per_s": images / wall,
            "images_per_cpu_s": images / cpu_s,
            "images_per_s_per_worker": images / wall / max(workers, 1),
            "load_average_before": before, "load_average_after": load_average()}


def matmul_rate(seconds: float = 0.3) -> float:
    """Products of two MATMUL_SIDE² float32 matrices per CPU-second of this thread."""
    import torch

    a, b = torch.randn(MATMUL_SIDE, MATMUL_SIDE), torch.randn(MATMUL_SIDE, MATMUL_SIDE)
    out = torch.empty_like(a)
    done, start = 0, time.thread_time()
    while time.thread_time() - start < seconds:
        torch.mm(a, b, out=out)
        done += 1
    return done / (time.thread_time() - start)


def compute(products: int) -> None:
    import torch

    a, b = torch.randn(MATMUL_SIDE, MATMUL_SIDE), torch.randn(MATMUL_SIDE, MATMUL_SIDE)
    out = torch.empty_like(a)
    for _ in range(products):
        torch.mm(a, b, out=out)


def _pinned(loader, decode_cpus: set[int] | None, compute_cpus: set[int]) -> Iterator:
    """The loader's batches over epochs; with ``decode_cpus`` its threads run there and the
    consumer on ``compute_cpus``. A thread inherits the mask of the thread that creates it,
    and the pool creates every thread before the first batch, so the consumer narrows its own
    mask once the first batch of each epoch is in (sched_setaffinity(0): the calling thread)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        if decode_cpus:
            os.sched_setaffinity(0, decode_cpus)
        batches = iter(loader)
        first = next(batches)
        os.sched_setaffinity(0, compute_cpus)
        yield first
        yield from batches
        epoch += 1


def paced_rank(task: dict[str, Any], results) -> None:
    """One rank (a spawned process): bound to its core, it consumes batches at the step rate
    for ``task["seconds"]`` and puts its timings on ``results``."""
    import torch

    from hpcdl.data import ShardedImageNet

    torch.set_num_threads(1)
    compute_cpus = set(task["compute_cpus"])
    os.sched_setaffinity(0, compute_cpus)
    products = round(matmul_rate() * task["batch"] / task["step_images_per_s_per_core"])
    loader = ShardedImageNet(task["shards"], "train", local_rank=task["local_rank"],
                             local_size=task["local_size"], batch_size=task["batch"],
                             image_size=task["image_size"], workers=task["workers"])
    decode_cpus = set(task["decode_cpus"]) if task["decode_cpus"] else None
    batches = _pinned(loader, decode_cpus, compute_cpus)
    # Warm-up, not counted: the first batch (files opened, threads started) and one step, so
    # the threads' prefetch is full when the clock starts, as after a training run's first step.
    next(batches)
    compute(products)
    steps = images = 0
    wait = busy = 0.0
    start, cpu = time.perf_counter(), time.process_time()
    while steps < MIN_STEPS or time.perf_counter() - start < task["seconds"]:
        t0 = time.perf_counter()
        images += len(next(batches)[0])
        t1 = time.perf_counter()
        compute(products)
        wait, busy, steps = wait + t1 - t0, busy + time.perf_counter() - t1, steps + 1
    wall = time.perf_counter() - start
    batches.close()
    loader.close()
    results.put({"local_rank": task["local_rank"], "steps": steps, "images": images,
                 "wall_s": wall, "data_wait_s": wait, "compute_s": busy,
                 "cpu_s": time.process_time() - cpu, "products_per_step": products})


def layout_cpus(layout: str, cores: Sequence[int], workers: int
                ) -> list[tuple[list[int], list[int]]]:
    """(compute cpus, decode cpus) of each rank: ``shared``, one rank per core with its
    decode threads on it; ``reserved``, one rank on the first core, decode on the rest."""
    if layout == "shared":
        return [([c], []) for c in cores]
    if layout == "reserved":
        if len(cores) < 2 or workers < 1:
            raise BadInputError(f"layout reserved needs >= 2 cores and >= 1 worker "
                                f"(have {len(cores)} cores, {workers} workers)")
        return [([cores[0]], list(cores[1:]))]
    raise BadInputError(f"layout {layout!r}: shared or reserved")


def paced(shard_dir: str, step: dict[str, Any], workers: int, layout: str, seconds: float,
          image_size: int) -> dict[str, Any]:
    """Every rank of ``layout`` at once, consuming at ``step``'s rate: the data wait as a
    share of wall time, the images/s delivered against the step's own (wall: on a loaded
    machine other work lowers it too) and images per CPU-second of the ranks' processes
    (compute and decode: the cost of an image in core time)."""
    import multiprocessing

    cores = sorted(os.sched_getaffinity(0))
    ranks = layout_cpus(layout, cores, workers)
    context = multiprocessing.get_context("spawn")  # nothing forks a process that has torch
    results = context.Queue()
    tasks = [{"shards": shard_dir, "local_rank": i, "local_size": len(ranks),
              "batch": step["batch"], "image_size": image_size, "workers": workers,
              "step_images_per_s_per_core": step["images_per_s_per_core"],
              "compute_cpus": compute_cpus, "decode_cpus": decode_cpus, "seconds": seconds}
             for i, (compute_cpus, decode_cpus) in enumerate(ranks)]
    before = load_average()
    processes = [context.Process(target=paced_rank, args=(t, results)) for t in tasks]
    for p in processes:
        p.start()
    per_rank = sorted((results.get(timeout=600) for _ in processes),
                      key=lambda r: r["local_rank"])
    for p in processes:
        p.join()
    wall = sum(r["wall_s"] for r in per_rank)
    delivered = sum(r["images"] / r["wall_s"] for r in per_rank) / len(per_rank)
    # compute and decode CPU of every rank process: what an image costs in core-seconds
    per_cpu_s = sum(r["images"] for r in per_rank) / sum(r["cpu_s"] for r in per_rank)
    return {"kind": "paced", "model": step["model"], "layout": layout, "workers": workers,
            "ranks": len(ranks), "compute_cpus": [c for c, _ in ranks],
            "decode_cpus": [d for _, d in ranks], "batch": step["batch"],
            "image_size": image_size, "step_images_per_s_per_core": step["images_per_s_per_core"],
            "data_wait_fraction": sum(r["data_wait_s"] for r in per_rank) / wall,
            "delivered_images_per_s_per_rank": delivered,
            "delivered_vs_step": delivered / step["images_per_s_per_core"],
            "images_per_cpu_s": per_cpu_s,
            "cpu_vs_step": per_cpu_s / step["images_per_s_per_core"],
            "per_rank": per_rank, "load_average_before": before,
            "load_average_after": load_average()}


def pace_ratios(records: Sequence[dict[str, Any]], steps: Sequence[dict[str, Any]]
                ) -> dict[str, float]:
    """Decode images per CPU-second of one thread (the median of the workers=1 decode
    records), and per model the decode threads one compute core needs (step ÷ decode) and its
    inverse, the compute cores one decode thread feeds."""
    ones = [r["images_per_cpu_s"] for r in records
            if r["kind"] == "decode" and r["workers"] == 1]
    if not ones:
        raise BadInputError("--pace-workers must include 1: the rate of one decode thread "
                            "is what sizes the rest")
    per_worker = statistics.median(ones)
    ratios = {"decode_images_per_cpu_s_per_worker": per_worker}
    for step in steps:
        need = step["images_per_s_per_core"] / per_worker
        ratios[f"{step['model']}_decode_threads_per_compute_core"] = need
        ratios[f"{step['model']}_compute_cores_per_decode_thread"] = 1 / need
    return ratios


def rotated(items: Sequence[int], by: int) -> list[int]:
    """``items`` starting at index ``by``: each repeat runs the configurations in another
    order, so a burst of load on the shared machine does not always fall on the same one."""
    by %= len(items)
    return [*items[by:], *items[:by]]


def measure(shard_dir: str, steps: Sequence[dict[str, Any]], workers: Sequence[int],
            seconds: float, decode_batch: int, image_size: int, repeats: int = 1
            ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """(records, ratios): per repeat, the decode sweep, then each step's rate (``step_rate``)
    paced in both layouts with each worker count (``reserved`` only with workers and >= 2
    cores)."""
    if 1 not in workers:
        raise BadInputError(f"--pace-workers {','.join(map(str, workers))} must include 1: "
                            f"the rate of one decode thread is what sizes the rest")
    multi_core = len(os.sched_getaffinity(0)) >= 2
    records = []
    for repeat in range(repeats):
        for w in rotated(workers, repeat):
            records.append({"repeat": repeat,
                            **decode_rate(shard_dir, decode_batch, image_size, w, seconds)})
            print(f"decode, {w} worker(s): {records[-1]['images_per_cpu_s']:.0f} img/s per "
                  f"CPU-second", flush=True)
        for step in steps:
            for layout in ("shared", "reserved"):
                for w in rotated(workers, repeat):
                    if layout == "reserved" and (w < 1 or not multi_core):
                        continue
                    r = paced(shard_dir, step, w, layout, seconds, image_size)
                    records.append({"repeat": repeat, **r})
                    print(f"{step['model']} {layout}, {w} worker(s): data wait "
                          f"{100 * r['data_wait_fraction']:.1f}%, delivered "
                          f"{r['delivered_vs_step']:.3f} of the step's rate", flush=True)
    return records, pace_ratios(records, steps)
