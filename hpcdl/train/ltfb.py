"""LTFB: Livermore Tournament Fast Batch training (Jacobs, Dryden, Van Essen et al., "Towards
Scalable Parallel Training of Deep Neural Networks", MLHPC'17), on top of the data-parallel
:class:`~hpcdl.train.trainer.Trainer`.

K trainers, each an ordinary Trainer on its own communicator and shard partition; every
``interval`` steps seeded pairs swap models over the peer communicators, each scores both on
its held-out tournament samples and keeps the winner (its own on ties). Between rounds only a
one-integer stop check crosses trainers, every ``stop_check_steps`` steps.

    ltfb = LTFB(config, shards, run_dir, MPI.COMM_WORLD, LTFBOptions(trainers=2, interval=100))
    ltfb.resume("auto"); summary = ltfb.train(); ltfb.close()

Run directory (``RUN_DIR/trainer-TT/`` per trainer; K = 1 is the plain trainer): docs/ltfb.md.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from mpi4py import MPI

from hpcdl.comm.base import sum_over
from hpcdl.debug.monitor import watch_region
from hpcdl.train import checkpoint as ckpt
from hpcdl.train import signals
from hpcdl.train.config import Config, resolve_batch
from hpcdl.train.metrics import read_metrics, write_summary
from hpcdl.train.session import open_communicator, recipe_gradients
from hpcdl.train.tournament import (
    PartitionLoader,
    TrainerLayout,
    better,
    exchange_flat,
    flatten_state,
    load_flat_state,
    partition_samples,
    score_model,
    split_world,
    state_tensors,
    tournament_partners,
)
from hpcdl.train.trainer import Trainer, TrainOptions, recipe_model

__all__ = ["LTFB", "LTFBOptions", "METRICS", "EXCHANGES", "trainer_run_dir"]

log = logging.getLogger("hpcdl.train")

METRICS = ("top1", "loss")
EXCHANGES = ("weights", "weights+optimizer")


@dataclass
class LTFBOptions:
    """The tournament's knobs (``hpcdl train --algorithm ltfb`` flags)."""

    trainers: int = 1
    interval: int = 100                  # a tournament round every this many steps
    metric: str = "top1"                 # top1 (higher wins) or loss (lower wins)
    exchange: str = "weights"            # or "weights+optimizer" (the winner's momentum too)
    holdout_fraction: float = 0.05       # of each trainer's training samples, never trained on
    stop_check_steps: int = 10           # world-wide agreement on a stop signal (at most
                                         # every ``interval`` steps)

    def validate(self) -> None:
        if self.trainers < 1:
            raise ValueError(f"--trainers {self.trainers}: need at least 1")
        if self.interval < 1:
            raise ValueError(f"--tournament-interval {self.interval}: need at least 1 step")
        if self.metric not in METRICS:
            raise ValueError(f"--tournament-metric {self.metric!r}: use {' or '.join(METRICS)}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"--exchange {self.exchange!r}: use {' or '.join(EXCHANGES)}")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"--tournament-holdout {self.holdout_fraction}: use 0 < f < 1")
        if self.stop_check_steps < 1:
            raise ValueError(f"stop_check_steps {self.stop_check_steps}: need at least 1")


def trainer_run_dir(run_dir: str, index: int, trainers: int) -> str:
    """Trainer ``index``'s run directory: RUN_DIR itself when there is one trainer."""
    return run_dir if trainers == 1 else os.path.join(run_dir, f"trainer-{index:02d}")


class LTFB:
    """K data-parallel trainers and their tournaments. Collective over ``world``."""

    def __init__(self, config: Config, data_dir: str, run_dir: str, world: MPI.Intracomm,
                 ltfb: LTFBOptions, options: TrainOptions | None = None, *,
                 backend: str | None = None, timeline=None) -> None:
        ltfb.validate()
        if ltfb.trainers > 1 and config.comm.shard_update:
            from hpcdl.train.config import RecipeError

            # A tournament exchanges whole optimizer states; a sharded one holds a slice.
            raise RecipeError(f"{config.path or config.name}: comm.shard_update: true is not "
                              f"supported with LTFB (--trainers {ltfb.trainers}); set "
                              f"comm.shard_update: false or train one trainer")
        self.ltfb, self.world, self.run_dir = ltfb, world, run_dir
        self.options = options or TrainOptions()
        self.seed = config.train.seed
        self.layout: TrainerLayout = split_world(world, ltfb.trainers)
        self.index, self.trainers = self.layout.index, ltfb.trainers
        # Every rank's host, so a stall in a world-level exchange names the partner's hosts
        # (the stall watchdog watches it on the trainer's communicator, which lacks them).
        self.hosts: list[str] = world.allgather(socket.gethostname()) if ltfb.trainers > 1 \
            else []
        self._stop_check = f"LTFB stop check ({self._where()})" if self.hosts else ""
        # comm.backend: auto: each trainer times its own communicator (hpcdl/comm/trial.py)
        self.comm = open_communicator(config.comm, self.layout.trainer_comm, backend,
                                      precision=config.train.precision,
                                      gradients=recipe_gradients(config),
                                      deterministic=self.options.deterministic)
        self.rounds: list[dict[str, Any]] = []
        self._scratch: torch.nn.Module | None = None
        self.tournament_loader = None
        try:
            self.trainer = self._build_trainer(config, data_dir, timeline)
        except BaseException:
            self.comm.close()
            self.layout.free()
            raise
        if self.trainers > 1:
            self.trainer.after_step_hooks.append(self._after_step)

    # -- building ----------------------------------------------------------------------------
    def _build_trainer(self, config: Config, data_dir: str, timeline) -> Trainer:
        run_dir = trainer_run_dir(self.run_dir, self.index, self.trainers)
        if self.trainers == 1:  # exactly the ordinary trainer (tested: same params_sha256)
            return Trainer(config, data_dir, run_dir, self.comm, options=self.options,
                           timeline=timeline)
        config = copy.deepcopy(config)
        # A population, not K copies: each trainer starts from its own initialisation.
        config.train.seed = self.seed + self.index
        if config.data.rotate_shards:
            log.warning("data.rotate_shards is ignored by LTFB: each trainer keeps its own "
                        "partition of the shards")
            config.data.rotate_shards = False
        train_loader, self.tournament_loader = self._build_loaders(config, data_dir)
        # Signals are agreed across the whole world here (_after_step), not per trainer: a
        # trainer that stopped alone would leave its partner waiting in the next exchange.
        options = replace(self.options, handle_signals=False)
        return Trainer(config, data_dir, run_dir, self.comm, options=options,
                       train_loader=train_loader, timeline=timeline)

    def _build_loaders(self, config: Config, data_dir: str):
        """This trainer's training partition and its tournament set (docs/ltfb.md: Data)."""
        from hpcdl.data.format import read_manifest, split_shards

        per_rank, _ = resolve_batch(config.batch, self.layout.trainer_size)
        counts = [e["num_samples"] for e in split_shards(read_manifest(data_dir), "train")]
        parts = partition_samples(counts, self.trainers, self.ltfb.holdout_fraction, self.seed,
                                  min_holdout=self.layout.trainer_size)
        # The same batches per epoch in every trainer: they meet at the same steps.
        batches = min(len(train) // self.layout.trainer_size // per_rank for train, _ in parts)
        if batches == 0:
            smallest = min(len(train) for train, _ in parts)
            raise ValueError(f"{data_dir}: the smallest trainer partition has {smallest} "
                             f"training samples, too few for {self.layout.trainer_size} ranks x "
                             f"batch {per_rank}: use fewer trainers or a smaller batch.per_rank")
        train, held = parts[self.index]
        common = {"image_size": config.data.image_size, "seed": self.seed,
                  "workers": config.data.workers, "min_scale": config.data.min_scale}
        train_loader = PartitionLoader(data_dir, train, self.index, self.layout.trainer_rank,
                                       self.layout.trainer_size, per_rank, train=True,
                                       batches=batches, **common)
        tournament_loader = PartitionLoader(data_dir, held, self.index,
                                            self.layout.trainer_rank, self.layout.trainer_size,
                                            per_rank, train=False, **common)
        log.info("LTFB trainer %d/%d: %d training samples, %d tournament samples, %d batches "
                 "per epoch", self.index, self.trainers, len(train), len(held), batches)
        return train_loader, tournament_loader

    # -- the run -----------------------------------------------------------------------------
    def resume(self, spec: str = "auto") -> str | None:
        """``auto``: the newest step every trainer has a checkpoint of (none: start fresh);
        ``none``: start fresh. With one trainer, also a checkpoint path. Collective."""
        if self.trainers == 1:
            return self.trainer.resume(spec)
        if spec in (None, "", "none"):
            return None
        if spec != "auto":
            raise ValueError(f"--resume {spec}: with {self.trainers} LTFB trainers use auto or "
                             f"none (all trainers resume from one common step)")
        mine = None
        if self.layout.trainer_rank == 0:
            mine = {ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(self.trainer.run_dir)}
        found = [s for s in self.world.allgather(mine) if s is not None]
        common = set.intersection(*found) if found else set()
        if not common:
            log.info("--resume auto: no step checkpointed by all %d trainers; starting fresh",
                     self.trainers)
            return None
        step, error, path = max(common), None, None
        try:
            path = self.trainer.resume(ckpt.checkpoint_path(self.trainer.run_dir, step))
        except ckpt.CheckpointError as exc:
            error = str(exc)
        errors = [e for e in self.world.allgather(error) if e]
        if errors:  # every rank raises, so no trainer waits for one that could not resume
            raise ckpt.CheckpointError(f"LTFB resume from step {step}: {errors[0]}; move that "
                                       f"step's checkpoints away (every trainer's) to resume "
                                       f"from the previous common step, or --resume none")
        return path

    def train(self) -> dict[str, Any]:
        """Train every trainer to the end (or ``max_steps``) with a tournament every
        ``interval`` steps. Returns the run summary (every rank)."""
        start = time.perf_counter()
        with signals.as_flag(self.trainers > 1 and self.options.handle_signals):
            summary = self.trainer.train()
        return self._run_summary(summary, time.perf_counter() - start)

    def close(self) -> None:
        self.trainer.close()
        for loader in (self.trainer.train_loader, self.trainer.val_loader,
                       self.tournament_loader):
            if hasattr(loader, "close"):
                loader.close()
        self.comm.close()
        self.layout.free()

    # -- tournaments -------------------------------------------------------------------------
    def _after_step(self, trainer: Trainer) -> None:
        if trainer.step % self.ltfb.interval == 0:
            self.play_round(trainer.step // self.ltfb.interval)
        every = min(self.ltfb.stop_check_steps, self.ltfb.interval)
        if trainer.step % every == 0 and self._agree_stop():
            # agreed over the world: every rank of every trainer stops at this step
            trainer.request_stop()

    def _agree_stop(self) -> bool:
        """One integer summed over the world: has any rank been signalled? (A signal that
        lands after this check waits for the next one.)"""
        signalled = self.options.handle_signals and signals.pending() is not None
        # the stall watchdog sees it; its name says where the ranks it waits for run
        with watch_region(self.comm, self._stop_check):
            total = sum_over(self.world, [1 if signalled else 0])
        return bool(total[0])

    def _where(self, trainer: int | None = None) -> str:
        """``world ranks 4-7 on c401-002,c401-003``: where trainer ``trainer``'s ranks run
        (None: every rank of the world)."""
        size = self.layout.trainer_size
        first, last = (0, len(self.hosts) - 1) if trainer is None else \
            (trainer * size, (trainer + 1) * size - 1)
        hosts = sorted(set(self.hosts[first:last + 1]))
        ranks = f"world rank {first}" if first == last else f"world ranks {first}-{last}"
        shown = ",".join(hosts[:4]) + (f",... ({len(hosts)} hosts)" if len(hosts) > 4 else "")
        return f"{ranks} on {shown}"

    def play_round(self, round_index: int) -> dict[str, Any]:
        """Round ``round_index``: meet the partner, swap, score both models on the local
        tournament set, keep the winner. Collective over this trainer and its partner."""
        trainer, t0 = self.trainer, time.perf_counter()
        partner = tournament_partners(self.seed, round_index, self.trainers)[self.index]
        metric = self.ltfb.metric
        record: dict[str, Any] = {"kind": "tournament", "step": trainer.step,
                                  "round": round_index, "trainer": self.index,
                                  "partner": partner, "metric": metric,
                                  "exchange": self.ltfb.exchange}
        if partner is None:  # the odd trainer out keeps its model this round
            record.update(local_score=None, partner_score=None, winner=self.index,
                          replaced=False)
        else:
            trainer.average_bn_statistics()  # one model per trainer before it is sent
            model_tensors = state_tensors(trainer.model)
            tensors = state_tensors(trainer.model, trainer.optimizer) \
                if self.ltfb.exchange == "weights+optimizer" else model_tensors
            with watch_region(self.comm, f"LTFB exchange with trainer {partner} "
                              f"({self._where(partner)})"):
                theirs = exchange_flat(flatten_state(tensors), self.layout, partner)
            mine = score_model(trainer.model, self.tournament_loader,
                               self.layout.trainer_comm, trainer.memory_format)
            scratch = self._scratch_model()
            model_bytes = sum(t.numel() * t.element_size() for t in model_tensors)
            load_flat_state(state_tensors(scratch), theirs[:model_bytes])
            rival = score_model(scratch, self.tournament_loader, self.layout.trainer_comm,
                                trainer.memory_format)
            replaced = better(metric, rival[metric], mine[metric])
            if replaced:
                load_flat_state(tensors, theirs)
            record.update(local_score=mine[metric], partner_score=rival[metric],
                          winner=partner if replaced else self.index, replaced=replaced,
                          samples=mine["samples"])
        record.update(tournament_s=time.perf_counter() - t0, time=time.time())
        self.rounds.append(record)
        trainer.write_metrics(record)
        log.info("tournament round %d step %d: trainer %d vs %s: %s %s vs %s -> winner %d",
                 round_index, trainer.step, self.index, partner, metric,
                 record["local_score"], record["partner_score"], record["winner"])
        return record

    def _scratch_model(self) -> torch.nn.Module:
        """A second model of the same architecture to hold the partner's (built once)."""
        if self._scratch is None:
            model = recipe_model(self.trainer.config)
            self._scratch = model.to(memory_format=self.trainer.memory_format)
        return self._scratch

    # -- the record --------------------------------------------------------------------------
    def _all_rounds(self) -> list[dict[str, Any]]:
        """Every tournament record of every trainer, from their metrics.jsonl (so rounds
        before a resume are included), by (round, trainer). Meaningful on world rank 0."""
        roots = self.world.gather(self.rounds if self.layout.trainer_rank == 0 else None)
        if self.world.rank != 0:
            return []
        records: list[dict[str, Any]] = []
        if self.options.write_files:
            for t in range(self.trainers):
                path = os.path.join(trainer_run_dir(self.run_dir, t, self.trainers),
                                    "metrics.jsonl")
                if os.path.exists(path):
                    records += [r for r in read_metrics(path) if r.get("kind") == "tournament"]
        else:
            records = [r for rounds in roots if rounds for r in rounds]
        return sorted(records, key=lambda r: (r["round"], r["trainer"]))

    def _run_summary(self, summary: dict[str, Any], wall_s: float) -> dict[str, Any]:
        ltfb = {"algorithm": "ltfb", "trainers": self.trainers,
                "trainer_size": self.layout.trainer_size, "world_ranks": self.world.size,
                "tournament_interval": self.ltfb.interval,
                "tournament_metric": self.ltfb.metric, "exchange": self.ltfb.exchange,
                "holdout_fraction": self.ltfb.holdout_fraction}
        if self.trainers == 1:
            run = {**summary, **ltfb, "rounds": []}
        else:
            gathered = self.world.gather(summary if self.layout.trainer_rank == 0 else None)
            rounds = self._all_rounds()
            run = (self._combine([s for s in gathered if s is not None], rounds, ltfb,
                                 wall_s) if self.world.rank == 0 else None)
            run = self.world.bcast(run, root=0)
        if self.world.rank == 0 and self.options.write_files:
            write_summary(os.path.join(self.run_dir, "summary.json"), run)
            if self.trainers > 1:
                from hpcdl.io import atomic_write_text

                atomic_write_text(os.path.join(self.run_dir, "metrics.jsonl"),
                                  "".join(json.dumps(r) + "\n" for r in run["rounds"]))
        return run

    @staticmethod
    def _combine(summaries: list[dict[str, Any]], rounds: list[dict[str, Any]],
                 ltfb: dict[str, Any], wall_s: float) -> dict[str, Any]:
        """The run summary: the best trainer's numbers up front, every trainer's beside."""
        best = max(range(len(summaries)), key=lambda t: -1.0 if summaries[t].get("top1") is None
                   else summaries[t]["top1"])
        top = summaries[best]
        return {
            "name": top["name"], **ltfb, "stopped": top["stopped"], "best_trainer": best,
            "top1": top["top1"], "top5": top["top5"], "eval_loss": top["eval_loss"],
            "epochs": top["epochs"], "steps": top["steps"], "total_steps": top["total_steps"],
            "global_batch_per_trainer": top["global_batch"], "wall_s": wall_s,
            "images_per_s": sum(s["images_per_s"] or 0.0 for s in summaries),
            "resumed_from": [s["resumed_from"] for s in summaries],
            "params_sha256": top["params_sha256"],
            "trainer_params_sha256": [s["params_sha256"] for s in summaries],
            "trainer_top1": [s["top1"] for s in summaries],
            "rounds": rounds,
            "trainer_summaries": summaries,
        }
