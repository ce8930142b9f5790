"""The first run: real Fashion-MNIST through the whole ImageNet pipeline on a laptop.

``mpiexec -n 2 hpcdl demo``: rank 0 writes the shipped Fashion-MNIST subset (Xiao et al. 2017)
as an ImageNet-shaped JPEG tree and shards it (``data_prep``); every rank trains the demo
recipe (``recipes/demo_fmnist.yaml``: a small ResNet, LARS, You et al. ICPP'18); rank 0 prints
top-1 on the held-out images, recorded in ``RUN_DIR/summary.json``. The run directory is
``--out DIR`` (kept) or a temporary one removed at the end.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DemoOptions", "demo_recipe_path", "prepare_demo_data", "run_demo", "DEMO_RECIPE"]

DEMO_RECIPE = "demo_fmnist.yaml"
#: What the README promises for the full demo on 2 cores (measured in docs/performance.md).
TOP1_GOAL = 0.85
TIME_GOAL_S = 300.0


@dataclass
class DemoOptions:
    """One ``hpcdl demo`` invocation."""

    out: str | None = None                  # run directory to keep; None: a temporary one
    recipe: str | None = None               # default: the shipped demo recipe
    overrides: Sequence[str] = ()           # recipe key=value overrides
    epochs: float | None = None             # shorthand for the override epochs=E
    max_steps: int | None = None            # stop after this global step (tests)
    source: str = "demo"                    # Fashion-MNIST: demo (shipped), debian, or a folder
    shards: int = 4                         # train shards (each node needs >= 1)
    backend: str | None = None              # comm backend; default: the recipe's
    progress: bool | None = None
    log_level: str = "info"

    def all_overrides(self) -> list[str]:
        items = list(self.overrides)
        if self.epochs is not None:
            items.append(f"epochs={self.epochs}")
        return items


def demo_recipe_path() -> str:
    """The demo recipe, shipped as package data (``hpcdl.recipes``; ``recipes/`` in the
    repository), so a wheel install finds it as well as a source checkout."""
    from hpcdl.train.config import resolve_recipe

    return resolve_recipe(DEMO_RECIPE)


def prepare_demo_data(data_dir: str, source: str = "demo", shards: int = 4) -> dict[str, Any]:
    """Fashion-MNIST -> ``data_dir/tree`` (JPEG, ImageNet layout) -> ``data_dir/shards``, on one
    rank (7,000 images of 28×28); returns what was written and how long it took."""
    from hpcdl.data_prep.fashion_mnist import write_tree
    from hpcdl.data_prep.shard import shard_tree

    start = time.perf_counter()
    tree = os.path.join(data_dir, "tree")
    counts = write_tree(tree, source=source)
    tree_s = time.perf_counter() - start
    shard_dir = os.path.join(data_dir, "shards")
    # resize=0: keep 28 px (the recipe's image_size); the sharder stores RGB JPEGs.
    manifest = shard_tree(tree, shard_dir, shards, resize=0, comm=None)
    return {"shard_dir": shard_dir, "tree": tree, "counts": counts,
            "splits": {s: i["num_samples"] for s, i in manifest["splits"].items()},
            "tree_s": tree_s, "prepare_s": time.perf_counter() - start}


def _prepare_on_rank0(world, run_dir: str, options: DemoOptions, comm) -> dict[str, Any]:
    """Rank 0 prepares the data; the others wait at the broadcast of the result or the error
    (every rank ends with rank 0's message), a region the stall watchdog watches."""
    from hpcdl.debug import note_activity, watch_region

    result: dict[str, Any] | None = None
    error: str | None = None
    if world.rank == 0:
        note_activity(comm, "preparing Fashion-MNIST")
        try:
            result = prepare_demo_data(os.path.join(run_dir, "data"), options.source,
                                       options.shards)
        except (OSError, ValueError, RuntimeError) as exc:
            error = f"preparing Fashion-MNIST ({options.source}) in {run_dir}/data: {exc}"
        note_activity(comm, "")
    with watch_region(comm, "wait for rank 0's data preparation"):
        result, error = world.bcast((result, error), root=0)
    if error:
        raise RuntimeError(error)
    return result


def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Prepare, train, evaluate; returns the run's summary (every rank): the trainer's plus
    a ``demo`` section (preparation and total time, the goal). Collective over COMM_WORLD."""
    from mpi4py import MPI

    from hpcdl.debug import watch_region
    from hpcdl.io import atomic_write_text
    from hpcdl.train.config import load_recipe
    from hpcdl.train.session import RunSession, recipe_gradients, run_directory
    from hpcdl.train.trainer import Trainer, TrainOptions

    start = time.perf_counter()
    world = MPI.COMM_WORLD
    recipe = options.recipe or demo_recipe_path()
    config = load_recipe(recipe, options.all_overrides())  # every rank: a bad key fails early
    log = logging.getLogger("hpcdl.demo")
    # The session first, so its stall watchdog (heartbeats and stall dumps in
    # RUN_DIR/logs/heartbeat) covers every phase: rank 0's data preparation (the others wait
    # at its broadcast), training, and the final barrier.
    with run_directory(world, options.out, "hpcdl-demo-") as run_dir, \
            RunSession(world, config.comm, run_dir=run_dir, backend=options.backend,
                       log_level=options.log_level, precision=config.train.precision,
                       gradients=recipe_gradients(config)) as session:
        def final_barrier() -> None:  # every rank is done with the files before removal
            with watch_region(session.comm, "final barrier"):
                world.Barrier()

        session.at_close(final_barrier)
        log.info("hpcdl demo: %d rank(s), run directory %s", world.size, run_dir)
        data = _prepare_on_rank0(world, run_dir, options, session.comm)
        log.info("Fashion-MNIST (%s): %s images as JPEG tree + shards in %.1f s",
                 options.source, data["splits"], data["prepare_s"])
        train_options = TrainOptions(max_steps=options.max_steps, progress=options.progress)
        trainer = session.own(Trainer(config, data["shard_dir"], run_dir, session.comm,
                                      options=train_options))
        trainer.resume("auto")  # --out of an interrupted demo continues it
        summary = trainer.train()
        summary["demo"] = {
            "recipe": recipe, "source": options.source, "images": data["splits"],
            "prepare_s": data["prepare_s"], "total_s": time.perf_counter() - start,
            "goal": {"top1": TOP1_GOAL, "seconds": TIME_GOAL_S, "ranks": 2},
        }
        if world.rank == 0:
            atomic_write_text(os.path.join(run_dir, "summary.json"),
                              json.dumps(summary, indent=2) + "\n")
        summary["run_dir"] = run_dir
        return summary


def format_result(summary: dict[str, Any], kept: bool) -> str:
    """The closing lines the user reads."""
    demo = summary["demo"]
    top1 = summary.get("top1")
    held_out = demo["images"].get("val", 0)
    lines = [f"hpcdl demo: top-1 {100 * top1:.1f}% on {held_out} held-out Fashion-MNIST test "
             f"images" if top1 is not None else "hpcdl demo: no evaluation ran",
             f"  {summary['steps']} steps ({summary['epochs']:g} epochs) of global batch "
             f"{summary['global_batch']} on {summary['ranks']} ranks, backend "
             f"{summary['backend']}; {demo['total_s']:.0f} s in all (data "
             f"{demo['prepare_s']:.0f} s, training {summary['train_s']:.0f} s)"]
    if kept:
        lines.append(f"  run directory: {summary['run_dir']} (summary.json, metrics.jsonl, "
                     f"logs/, checkpoints/)")
    return "\n".join(lines)
