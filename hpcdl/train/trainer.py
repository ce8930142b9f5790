"""The distributed data-parallel training loop (You et al., "ImageNet Training in Minutes",
ICPP'18): one rank per socket, gradients averaged by the overlapped reducer, LARS on each
bucket's layers as soon as their allreduce lands, a schedule that is a pure function of the
step.

Read top to bottom like torchvision's reference: build (model, data, optimizer, schedule,
reducer), ``train()`` = ``train_one_epoch()`` per epoch + ``evaluate()``, checkpoints at step
boundaries. Other commands build on the pieces: ``hpcdl bench train`` (``no_comm=True`` for the
compute-only ceiling, ``max_steps``), LTFB (``state_dict``/``load_state_dict``, ``evaluate``).

Every decision that ends or changes the run (signal received, non-finite loss) is agreed by
all ranks with one small allreduce per step, and only the agreed value is acted on: a rank's own
signal (hpcdl/train/signals.py) just feeds the next agreement, so ranks that received it at
different moments still checkpoint and stop at the same step.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpcdl.comm.base import SumInFlight, sum_over
from hpcdl.comm.policy import create_policy
from hpcdl.cpus import memory_format_name
from hpcdl.debug.inject import injected_pause
from hpcdl.errors import BadInputError, agreed, mark_agreed
from hpcdl.models import channels_last_unsafe_layer
from hpcdl.optim.factory import set_learning_rate
from hpcdl.topology import node_path
from hpcdl.train import checkpoint as ckpt
from hpcdl.train import signals
from hpcdl.train.config import Config, elastic_batch, resolve_batch, write_resolved_config
from hpcdl.train.distributed import broadcast_parameters
from hpcdl.train.metrics import (
    MetricsWriter,
    params_sha256,
    read_summary,
    truncate_metrics,
    write_summary,
)
from hpcdl.train.precision import agreed_precision, describe

__all__ = ["Trainer", "TrainOptions", "NonFiniteLossError", "IpexUnavailableError",
           "EXIT_OK", "EXIT_NONFINITE_LOSS", "EXIT_STOPPED_BY_SIGNAL", "derive_seed",
           "recipe_model", "recipe_optimizer", "recipe_schedule", "require_ipex"]

log = logging.getLogger("hpcdl.train")

#: Exit codes of ``hpcdl train`` (docs/training.md). 75 is sysexits' EX_TEMPFAIL: "try again";
#: the Slurm templates requeue a job that exits with it.
EXIT_OK = 0
EXIT_NONFINITE_LOSS = 3
EXIT_STOPPED_BY_SIGNAL = 75

class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf on some rank; the run stops without stepping."""

    agreed = True  # raised on every rank at the same step: the collective teardown may run

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"non-finite loss ({loss}) at step {step}: stopping before the optimizer "
                         f"step; the last good checkpoint is kept (lower the learning rate or "
                         f"lengthen warm-up, then resume with --resume auto)")
        self.step, self.loss = step, loss


class IpexUnavailableError(BadInputError, RuntimeError):
    """--ipex was asked for but intel_extension_for_pytorch is not importable."""


@dataclass
class TrainOptions:
    """Switches of one invocation (the CLI flags), as opposed to the recipe's hyperparameters."""

    deterministic: bool = False
    no_comm: bool = False                # reducer disabled: the compute-only ceiling
    max_steps: int | None = None         # stop after this global step (tests, benches)
    checkpoint_every: int | None = None  # overrides train.checkpoint_every_steps
    ipex: bool = False
    progress: bool | None = None         # tqdm bar on rank 0; None: when stderr is a terminal
    handle_signals: bool = True          # SIGUSR1/SIGTERM -> checkpoint and stop
    write_files: bool = True             # metrics.jsonl, summary.json, config.yaml, checkpoints
    evaluate: bool = True                # eval at epoch ends and at the end
    verify_shards: bool = False          # sha256 of every shard read, before training


def derive_seed(seed: int, *position: int) -> int:
    """A seed from (seed, epoch, rank): distinct streams per rank and epoch, reproducible
    from the recipe alone; (seed, epoch, step, rank) when a run resumes at ``step`` on another
    rank count: a function of the run's position, so an elastic resume is itself repeatable."""
    mixed = np.random.SeedSequence([seed, *position]).generate_state(1, dtype=np.uint64)[0]
    return int(mixed & 0x7FFF_FFFF_FFFF_FFFF)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def recipe_model(config: Config) -> torch.nn.Module:
    """The recipe's model (``model.name`` and its keyword arguments), freshly initialised:
    what every trainer, tournament scratch model and bench baseline builds."""
    from hpcdl.models import create_model

    kw = {k: v for k, v in config.model.items() if k != "name"}
    return create_model(config.model["name"], **kw)


def recipe_schedule(config: Config, steps_per_epoch: int, total_steps: int):
    """The recipe's learning-rate schedule over ``total_steps`` (hpcdl/optim/schedule.py)."""
    from hpcdl.optim import create_schedule

    return create_schedule(config.schedule, steps_per_epoch, total_steps)


def recipe_optimizer(config: Config, model: torch.nn.Module, schedule) -> torch.optim.Optimizer:
    """The recipe's optimizer over ``model``, at the schedule's first learning rate."""
    from hpcdl.optim import create_optimizer

    return create_optimizer(config.optimizer, model, lr=schedule(0))


def require_ipex() -> Any:
    """Import IPEX or say exactly what is missing: IPEX asked for is never silently skipped."""
    try:
        import intel_extension_for_pytorch as ipex  # noqa: PLC0415
    except ImportError as exc:
        raise IpexUnavailableError(
            f"--ipex: intel_extension_for_pytorch is not importable ({exc}). Install the IPEX "
            f"build matching torch {torch.__version__} on the cluster (pip install "
            f"intel-extension-for-pytorch==<matching version>; docs/intel.md: IPEX 2.8 needs "
            f"torch 2.8 and gave about 1.0x on ResNet-50), or run without --ipex") from None
    return ipex


class Trainer:
    """Data-parallel training of one recipe on one communicator.

    ``Trainer(config, data_dir, run_dir, comm)`` builds everything from the recipe; tests and
    other commands may pass ``model``, ``optimizer``, ``schedule``, ``train_loader`` and
    ``val_loader`` built elsewhere (loaders follow hpcdl.data's contract: ``set_epoch``,
    ``len``, iteration over (uint8 or float NCHW images, int64 labels)).
    """

    def __init__(self, config: Config, data_dir: str | None, run_dir: str, comm, *,
                 options: TrainOptions | None = None, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, schedule=None,
                 train_loader=None, val_loader=None, timeline=None,
                 resume_layout: dict[str, int] | None = None) -> None:
        self.config, self.run_dir, self.comm = config, run_dir, comm
        # "{node}" in --data: this node's staging directory (hpcdl prep stage --to ...-{node})
        self.data_dir = node_path(data_dir, comm.node_index) if data_dir is not None else None
        self.options = options or TrainOptions()
        self.rank, self.size = comm.rank, comm.size
        self.timeline = timeline
        # A checkpoint of another rank count (a requeue onto other nodes) is resumed with the
        # same global batch: the per-rank batch and accumulation adapt, or this raises naming
        # the rank counts that would work -- before any loader exists.
        if resume_layout and resume_layout.get("world_size", self.size) != self.size:
            self.per_rank, self.accumulation = elastic_batch(config.batch, self.size,
                                                             resume_layout.get("per_rank"))
        else:
            self.per_rank, self.accumulation = resolve_batch(config.batch, self.size)
        self.global_batch = self.per_rank * self.size * self.accumulation
        if self.options.deterministic:
            # Bit-for-bit repeatable on the same rank count: deterministic kernels, seeds from
            # (seed, epoch, rank), the loader's order from (seed, epoch), fixed bucket order.
            torch.use_deterministic_algorithms(True)
        seed_everything(derive_seed(config.train.seed, 0, self.rank))

        self.model = model if model is not None else recipe_model(config)
        # the compute dtype first: train.channels_last: auto follows it
        self.precision = self._precision()
        self.autocast_dtype = torch.bfloat16 if self.precision == "bfloat16" else None
        self.memory_format = self._memory_format()
        self.model = self.model.to(memory_format=self.memory_format)
        self.train_loader = train_loader if train_loader is not None else \
            self._build_loader("train", self.per_rank)
        self.val_loader = val_loader if val_loader is not None or not self.options.evaluate \
            else self._build_loader("val", self.per_rank)
        self.steps_per_epoch = len(self.train_loader) // self.accumulation
        if self.steps_per_epoch == 0:
            raise ValueError(f"{data_dir}: the training split gives {len(self.train_loader)} "
                             f"batches of {self.per_rank} per rank, fewer than accumulation="
                             f"{self.accumulation}: use more data or a smaller batch")
        self.total_steps = self._total_steps()
        self._schedule_from_recipe = schedule is None
        self.schedule = schedule if schedule is not None else \
            recipe_schedule(config, self.steps_per_epoch, self.total_steps)
        self.optimizer = optimizer if optimizer is not None else \
            recipe_optimizer(config, self.model, self.schedule)
        if self.options.ipex:
            self._apply_ipex()
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=config.train.label_smoothing)
        self.broadcast_model()
        # On one rank the world's average is the rank's own gradient: nothing to reduce.
        # How replicas stay consistent (every step, every H steps, compressed) is the
        # policy's business (hpcdl/comm/policy.py); the loop only asks it.
        self.policy = create_policy(
            comm, list(self.model.named_parameters()), algorithm=config.comm.algorithm,
            local_steps=config.comm.local_steps, sync_warmup_steps=config.comm.sync_warmup_steps,
            powersgd_rank=config.comm.powersgd_rank, bucket_bytes=self._bucket_bytes(),
            enabled=not self.options.no_comm and comm.size > 1, seed=config.train.seed,
            shard_update=config.comm.shard_update)
        #: whether this rank steps only its slice of the weights (comm.shard_update, P > 1)
        self.shard_update = bool(getattr(self.policy.reducer, "reduce_scatter", False))
        if self.shard_update:
            from hpcdl.optim import ShardedOptimizer

            # Each rank steps its slice; checkpoints stay in the full layout (collective
            # state_dict, save_checkpoint) so they resume sharded or not, on any rank count.
            self.optimizer = ShardedOptimizer(self.optimizer, self.policy.reducer, comm)
        self.step = 0                 # optimizer steps completed (the schedule's argument)
        self.resumed_from: str | None = None
        self.last_eval: dict[str, Any] | None = None
        self._last_eval_step = -1
        self._last_checkpoint_step = -1
        # HPCDL_INJECT=RANK:checkpointN:sleep=S: the N-th checkpoint write pauses (fault tests)
        self._write_injection = injected_pause(self.rank, "checkpoint")
        self._writes = 0
        # rank 0: the line of checkpoints this run continues and the last write sequence
        # number in the run directory (hpcdl/train/checkpoint.py); set by resume
        self._line: str | None = None
        self._seq: int | None = None
        #: the signal every rank agreed to stop on (None: no agreed stop): only an agreement
        #: (_start_agreement, or request_stop called on every rank at the same step) sets it
        self._stop_agreed: int | None = None
        self._metrics: MetricsWriter | None = None
        self._images_this_run = 0
        self._train_time_s = 0.0          # training seconds of this invocation
        self._train_time_before_s = 0.0   # ... and of the invocations it resumed (checkpoint)
        self._window = _Window()
        self._progress = None
        #: callables ``hook(trainer)`` run after every optimizer step, before the checkpoint
        #: and stop decisions of that step (LTFB's tournaments, hpcdl/train/ltfb.py)
        self.after_step_hooks: list = []
        #: whether the optimizer steps only parameters the reducer's buckets hold (the
        #: overlapped update's precondition; checked at the first step)
        self._bucketed_params: bool | None = None
        #: the step's agreement left in flight by an error in backward (train_step)
        self._abandoned_agreement: SumInFlight | None = None

    def _bucket_bytes(self) -> int:
        """The recipe's ``comm.bucket_mb``, unless a start-up trial chose the communicator's
        layout (``comm.backend: auto``, hpcdl/comm/trial.py; not where the rule decided, and
        a communicator opened for another section keeps this recipe's)."""
        trial = getattr(self.comm, "trial", None)
        if trial is not None and trial.fallback is None:
            return trial.layout.bucket_bytes
        return self.config.comm.bucket_bytes

    @property
    def reducer(self):
        """What backward feeds this step: the policy's current gradient reducer."""
        return self.policy.reducer

    # -- building from the recipe ------------------------------------------------------------
    def _build_loader(self, split: str, batch_size: int):
        from hpcdl.data import ShardedImageNet

        if self.data_dir is None:
            raise ValueError("Trainer: data_dir is needed to build the loaders (--data SHARDS)")
        data = self.config.data
        # Collective: ranks of different nodes check different shards, and all must stop
        # together if any found a bad one (hpcdl/errors.py).
        with agreed(self.comm.mpi_comm):
            return ShardedImageNet.for_communicator(
                self.comm, self.data_dir, split, batch_size, image_size=data.image_size,
                seed=self.config.train.seed, workers=data.workers,
                rotate_shards=data.rotate_shards, min_scale=data.min_scale, crop=data.crop,
                resize=data.val_resize, verify_shards=self.options.verify_shards,
                num_classes=self.config.model.get("num_classes"))

    def _memory_format(self) -> torch.memory_format:
        """hpcdl.cpus.memory_format_name's rule (channels_last only with >= 2 threads and a
        model oneDNN can train in it; ``auto``: for a bfloat16 step), said when it overrules
        ``train.channels_last: true``."""
        threads = torch.get_num_threads()
        unsafe = channels_last_unsafe_layer(self.model)
        layout = memory_format_name(self.config.train.channels_last, threads, self.precision,
                                    unsafe)
        if layout == "channels_last":
            return torch.channels_last
        if self.config.train.channels_last is True:
            why = (f"oneDNN's channels_last backward of {unsafe} writes past its workspace "
                   f"(a crash, a hang or wrong gradients; hpcdl.models.channels_last)"
                   if unsafe is not None else
                   "channels_last needs >= 2 threads per rank (hpcdl.cpus.memory_format_name)")
            log.warning("train.channels_last: %s; training in contiguous format", why)
        return torch.contiguous_format

    def _precision(self) -> str:
        """train.precision as every rank of the communicator resolves it
        (hpcdl/train/precision.py): logged, and kept in summary.json and config.yaml."""
        requested = self.config.train.precision
        precision = agreed_precision(requested, self.comm.mpi_comm)
        if self.rank == 0:
            log.info("%s", describe(requested, precision))
        return precision

    @property
    def wire_dtype(self) -> str:
        """The gradients' dtype on the wire, as the communicator was built."""
        return "bfloat16" if getattr(self.comm, "wire_dtype", None) == torch.bfloat16 \
            else "float32"

    def _apply_ipex(self) -> None:
        ipex = require_ipex()
        self.model, self.optimizer = ipex.optimize(
            self.model, optimizer=self.optimizer,
            dtype=self.autocast_dtype or torch.float32)
        log.info("IPEX %s applied to model and optimizer", getattr(ipex, "__version__", "?"))

    # -- replicas ----------------------------------------------------------------------------
    def broadcast_model(self) -> None:
        """Every rank starts from rank 0's parameters and buffers."""
        broadcast_parameters(self.model, self.comm)

    def params_sha256(self) -> str:
        """sha256 of the parameters (summary.json): equal across runs iff bit-identical."""
        return params_sha256(self.model.named_parameters())

    def check_replicas(self) -> str:
        """Allgather a sha256 of the parameters; raise naming the ranks that differ. (BN
        running statistics are per rank by design: each rank's own batches update them.)"""
        mine = self.params_sha256()
        mpi = self.comm.mpi_comm
        # rank 0's hash to all and one flag back (O(1) a rank); every hash only on a mismatch
        differ = mpi.allreduce(int(mine != mpi.bcast(mine, root=0)))
        hashes = mpi.allgather(mine) if differ else [mine]
        if len(set(hashes)) > 1:
            odd = [r for r, h in enumerate(hashes) if h != hashes[0]]
            raise RuntimeError(f"model replicas differ after the broadcast: ranks {odd} hold "
                               f"other parameters than rank 0 (sha256 {hashes[0][:12]})")
        return mine

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train to ``epochs`` (or ``max_steps``), evaluating and checkpointing on the way.

        Returns the summary; ``summary["stopped"]`` is ``"completed"``, ``"max_steps"`` or
        ``"signal"`` (checkpointed, exit code :data:`EXIT_STOPPED_BY_SIGNAL`).
        Raises :class:`NonFiniteLossError` on every rank at the same step.
        """
        start = time.perf_counter()
        if self.policy.replicas_equal:  # (local SGD resumed between two averages: not yet)
            self.check_replicas()
        self._open_outputs()
        stopped = "completed"
        with signals.as_flag(self.options.handle_signals):
            try:
                while self.step < self._last_step():
                    epoch = self.step // self.steps_per_epoch
                    start_batch = (self.step % self.steps_per_epoch) * self.accumulation
                    stopped = self.train_one_epoch(epoch, start_batch)
                    if stopped != "completed":
                        break
                    self._end_of_epoch(epoch)
                if stopped == "completed" and self.step >= self._last_step() \
                        and self.step < self.total_steps:
                    stopped = "max_steps"
                if stopped != "signal" and self.options.evaluate and self.val_loader is not None \
                        and self._last_eval_step != self.step:
                    self.evaluate()
                if stopped != "signal" and self._last_checkpoint_step != self.step:
                    self.save_checkpoint()
            finally:
                self._close_outputs()
        summary = self.summary(stopped, time.perf_counter() - start)
        if self.rank == 0 and self.options.write_files:
            write_summary(os.path.join(self.run_dir, "summary.json"), summary)
        return summary

    def _total_steps(self) -> int:
        """``train.total_steps`` where the recipe gives it (a source's max_iter), else
        ``epochs`` × steps per epoch."""
        if self.config.train.total_steps is not None:
            return self.config.train.total_steps
        return max(1, math.ceil(self.config.epochs * self.steps_per_epoch))

    def _last_step(self) -> int:
        if self.options.max_steps is not None:
            return min(self.total_steps, self.options.max_steps)
        return self.total_steps

    def train_one_epoch(self, epoch: int, start_batch: int = 0) -> str:
        """Steps of ``epoch`` from batch ``start_batch``; returns why it ended: ``"completed"``,
        ``"max_steps"`` or ``"signal"``."""
        self.model.train()
        if start_batch == 0 and self.options.deterministic:
            seed_everything(derive_seed(self.config.train.seed, epoch, self.rank))
        self.train_loader.set_epoch(epoch, start_batch=start_batch)
        batches = iter(self.train_loader)
        end_of_epoch = (epoch + 1) * self.steps_per_epoch
        while self.step < min(end_of_epoch, self._last_step()):
            t0 = time.perf_counter()
            with self._span("data wait", "data"):
                micro_batches = [next(batches) for _ in range(self.accumulation)]
            data_wait = time.perf_counter() - t0
            loss = self.train_step(micro_batches)
            self._record_step(epoch, loss, data_wait, time.perf_counter() - t0)
            for hook in self.after_step_hooks:
                hook(self)
            if self._should_checkpoint():
                self.save_checkpoint()
            if self._stop_agreed is not None:  # agreed: every rank is here at this step
                if self._last_checkpoint_step != self.step:
                    self.save_checkpoint()
                log.warning("signal %s: checkpointed at step %d, stopping (exit %d)",
                            signals.name(self._stop_agreed), self.step, EXIT_STOPPED_BY_SIGNAL)
                signals.consume()
                return "signal"
        if self.step >= end_of_epoch or self.step >= self.total_steps:
            return "completed"  # (a fractional last epoch ends at total_steps)
        return "max_steps"

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step over ``accumulation`` micro-batches; returns the world's mean
        loss. Sets lr from the schedule first (a pure function of the step)."""
        set_learning_rate(self.optimizer, self.schedule(self.step))
        self.policy.before_step(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        local_loss = 0.0
        agreement: SumInFlight | None = None
        n = len(micro_batches)
        for i, (images, labels) in enumerate(micro_batches):
            self.reducer.arm(last=(i == n - 1))
            with self._span("forward", "compute"), self._autocast():
                loss = self.criterion(self.model(self._prepare(images)), labels) / n
            local_loss += float(loss.detach())
            if i == n - 1:  # the agreement travels while the last backward runs
                agreement = self._start_agreement(local_loss)
            with self._span("backward", "compute"):
                try:
                    loss.backward()
                except BaseException:
                    # Every rank started the agreement: keep its request and buffers alive,
                    # unread, rather than let them be freed while MPI may still write there.
                    self._abandoned_agreement = agreement
                    raise
        if agreement is None:  # no micro-batch: still one agreement per step
            agreement = self._start_agreement(local_loss)
        stop, nonfinite, loss_sum = self._agreed(agreement)
        if nonfinite:  # every rank raises here, at the same step, nothing left on the wire
            self.reducer.synchronize()
            raise NonFiniteLossError(self.step + 1, local_loss if not math.isfinite(local_loss)
                                     else math.nan)
        if stop and self._stop_agreed is None:  # this rank's signal or another's
            self.request_stop()
        if self.config.train.momentum_correction:
            from hpcdl.optim import apply_momentum_correction

            apply_momentum_correction(self.optimizer, self.schedule.momentum_correction(self.step))
        if self._overlap_update():
            self._update_bucket_by_bucket()
        else:
            with self._span("allreduce wait", "comm"):
                self.reducer.synchronize()
            with self._span("optimizer", "compute"):
                self.optimizer.step()
        self.step += 1
        with self._span("model average", "comm"):
            self.policy.after_step(self.step, last=self.step >= self._last_step())
        self._images_this_run += self.global_batch
        return loss_sum / self.size

    def _start_agreement(self, local_loss: float) -> SumInFlight:
        """One tiny allreduce per step, started once the loss is known: any rank signalled,
        any rank's loss non-finite, and the sum of losses. A signal reaching one rank only,
        or ranks at different moments, is acted on at the same step everywhere; one landing
        after this call waits for the next step's. (``handle_signals=False``: this trainer's
        stop is decided elsewhere -- LTFB's check across trainers -- or not at all, the
        benches.)"""
        nonfinite = not math.isfinite(local_loss)
        signalled = self.options.handle_signals and signals.pending() is not None
        return SumInFlight(self.comm.mpi_comm, [1.0 if signalled else 0.0,
                                                1.0 if nonfinite else 0.0,
                                                0.0 if nonfinite else local_loss])

    @staticmethod
    def _agreed(agreement: SumInFlight) -> tuple[bool, bool, float]:
        """(stop, non-finite, loss sum) of :meth:`_start_agreement`, the same on every rank."""
        total = agreement.result()
        return bool(total[0] > 0), bool(total[1] > 0), float(total[2])

    def _overlap_update(self) -> bool:
        """Whether this step updates bucket by bucket (``comm.overlap_update``): an optimizer
        whose step is per tensor, every parameter it steps in a bucket of the reducer that
        averages them whole (not the sharded update's, not PowerSGD's compressor)."""
        from hpcdl.comm.reducer import GradientReducer
        from hpcdl.optim import steps_tensor_by_tensor

        reducer = self.reducer
        if not (self.config.comm.overlap_update and isinstance(reducer, GradientReducer)
                and reducer.enabled and not reducer.reduce_scatter
                and steps_tensor_by_tensor(self.optimizer)):
            return False
        if self._bucketed_params is None:
            in_buckets = {id(p) for bucket in reducer.buckets for p in bucket.params}
            self._bucketed_params = all(id(p) in in_buckets
                                        for group in self.optimizer.param_groups
                                        for p in group["params"])
        return self._bucketed_params

    def _update_bucket_by_bucket(self) -> None:
        """Step each bucket's parameters as soon as their average arrives, the last layers'
        first, while the first layers' buckets are still on the wire: the wait after
        backward overlaps the update instead of preceding it. The same step as one
        ``optimizer.step()`` (hpcdl.optim.step_parameters)."""
        from hpcdl.optim import step_parameters

        with contextlib.closing(self.reducer.reduced_buckets()) as buckets:
            while True:
                with self._span("allreduce wait", "comm"):
                    params = next(buckets, None)
                if params is None:
                    return
                with self._span("optimizer", "compute"):
                    step_parameters(self.optimizer, params)

    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype == torch.uint8:
            from hpcdl.data import input_normalization, normalize

            data = self.config.data
            images = normalize(images, *input_normalization(data.normalize, data.input_scale))
        return images.contiguous(memory_format=self.memory_format)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.autocast_dtype)

    def _span(self, name: str, cat: str) -> contextlib.AbstractContextManager:
        return self.timeline.span(name, cat) if self.timeline is not None \
            else contextlib.nullcontext()

    def _end_of_epoch(self, epoch: int) -> None:
        every = self.config.train.eval_every_epochs
        if self.options.evaluate and self.val_loader is not None and every \
                and (epoch + 1) % every == 0:
            self.evaluate()
        if self._last_checkpoint_step != self.step:
            self.save_checkpoint()

    def _should_checkpoint(self) -> bool:
        every = self.options.checkpoint_every
        if every is None:
            every = self.config.train.checkpoint_every_steps
        return bool(every) and self.step % every == 0

    # -- evaluation --------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """Top-1/top-5 and loss on the validation split, each rank its part, summed over all
        ranks. BN running statistics are averaged first, so every rank evaluates one model."""
        self.average_bn_statistics()
        self.model.eval()
        sums = np.zeros(4, dtype=np.float64)  # loss·n, top-1 correct, top-5 correct, n
        with torch.no_grad(), self._span("evaluate", "eval"), self.policy.averaged():
            if hasattr(self.val_loader, "set_epoch"):
                self.val_loader.set_epoch(0)
            for images, labels in self.val_loader:
                with self._autocast():
                    logits = self.model(self._prepare(images))
                logits = logits.float()
                k = min(5, logits.shape[1])
                top = logits.topk(k, dim=1).indices
                hits = top.eq(labels.view(-1, 1))
                sums += [float(torch.nn.functional.cross_entropy(logits, labels,
                                                                 reduction="sum")),
                         float(hits[:, :1].sum()), float(hits.sum()), labels.numel()]
        total = sum_over(self.comm.mpi_comm, sums)
        self.model.train()
        count = max(total[3], 1.0)
        result = {"kind": "eval", "step": self.step,
                  "epoch": round(self.step / self.steps_per_epoch, 4),
                  "loss": total[0] / count, "top1": total[1] / count, "top5": total[2] / count,
                  "samples": int(total[3]), "time": time.time()}
        self.last_eval, self._last_eval_step = result, self.step
        self.write_metrics(result)
        log.info("eval step %d: top-1 %.4f top-5 %.4f loss %.4f (%d images)", self.step,
                 result["top1"], result["top5"], result["loss"], result["samples"])
        return result

    def average_bn_statistics(self) -> None:
        """Collective: every rank's BN running statistics replaced by their mean over the ranks
        (the model evaluated, or sent to an LTFB partner, is then one model)."""
        stats = [b for b in self.model.buffers() if b.is_floating_point() and b.numel() > 0]
        if stats and not self.options.no_comm:
            self.comm.allreduce_(stats, average=True)

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self, optimizer_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """What every rank shares: the run's position and layout (the manifest's scalars) and
        model, optimizer and policy state (``model.pt``); per-rank state is
        :meth:`_rank_state`. ``optimizer_state``: the optimizer's state_dict when already
        taken (collective for a sharded update, so save_checkpoint takes it on every rank)."""
        return {
            "format": ckpt.CHECKPOINT_FORMAT,
            "step": self.step,
            "epoch": self.step // self.steps_per_epoch,
            "batch_in_epoch": (self.step % self.steps_per_epoch) * self.accumulation,
            "steps_per_epoch": self.steps_per_epoch,
            "global_batch": self.global_batch,
            "world_size": self.size,
            "per_rank": self.per_rank,
            "accumulation": self.accumulation,
            "images_seen": self.images_seen,
            "images_in_epoch": self.images_in_epoch,
            "recipe": self.config.name,
            "model_config": dict(self.config.model),
            "model": self.model.state_dict(),
            "optimizer": optimizer_state if optimizer_state is not None
            else self.optimizer.state_dict(),
            "train_s_total": self.train_s_total,
            "consistency": self.policy.state_dict(),
        }

    @property
    def images_seen(self) -> int:
        """Training images consumed by the run (every rank, every invocation)."""
        return self.step * self.global_batch

    @property
    def images_in_epoch(self) -> int:
        """Images consumed in the current epoch: the loader's position, independent of the
        rank count (docs/training.md)."""
        return (self.step % self.steps_per_epoch) * self.global_batch

    @property
    def train_s_total(self) -> float:
        """Training seconds up to now, summed over every invocation of this run (resumes)."""
        return self._train_time_before_s + self._train_time_s

    def load_state_dict(self, state: dict[str, Any], source: str = "<state>",
                        rank_state: dict[str, Any] | None = None) -> None:
        """Restore model, optimizer, step and, at the same world size, this rank's own state
        (``rank_state``: its RNG states, BN statistics, policy state); at another world size,
        the elastic mapping (:meth:`_adopt_other_layout`)."""
        ckpt.check_compatible(state, source, recipe=self.config.name,
                              global_batch=self.global_batch, model_config=self.config.model,
                              model_state=self.model.state_dict())
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.policy.load_state_dict(state.get("consistency"), source)
        self._train_time_before_s = float(state.get("train_s_total", 0.0))
        if state.get("world_size") == self.size:
            if rank_state is not None:
                self._load_rank_state(rank_state)
        else:
            self._adopt_other_layout(state, source)
        self._last_checkpoint_step = self.step

    def _adopt_other_layout(self, state: dict[str, Any], source: str) -> None:
        """Elastic resume: a checkpoint of P ranks continued on P' != P (docs/training.md,
        "Resuming on another rank count"): the run's epoch length, BN statistics from their
        mean in ``model.pt``, RNG states reseeded from (seed, epoch, step, rank)."""
        saved_spe = int(state.get("steps_per_epoch", self.steps_per_epoch))
        if saved_spe != self.steps_per_epoch:
            self._set_steps_per_epoch(saved_spe, source)
        if "bn_mean" in state:
            self._load_mean_buffers([state["bn_mean"]])
        elif state.get("rng"):  # a single-file checkpoint holds every rank's statistics
            self._load_mean_buffers([r.get("buffers", {}) for r in state["rng"]])
        epoch = self.step // self.steps_per_epoch
        seed_everything(derive_seed(self.config.train.seed, epoch, self.step, self.rank))
        saved = int(state.get("world_size", 0))
        log.warning("%s was written by %d ranks (%s per rank × accumulation %s), this run has %d "
                    "(%d × %d), global batch %d: BN statistics averaged over the %d saved ranks, "
                    "RNG reseeded from (seed, epoch, step, rank); the run continues at step %d, "
                    "%d images into epoch %d", source, saved, state.get("per_rank", "?"),
                    state.get("accumulation", "?"), self.size, self.per_rank,
                    self.accumulation, self.global_batch, saved, self.step,
                    self.images_in_epoch, epoch)

    def _set_steps_per_epoch(self, steps: int, source: str) -> None:
        """Keep the run's epoch length (multi-node layouts can differ by a step or two)."""
        available = len(self.train_loader) // self.accumulation
        if steps > available:
            raise ckpt.CheckpointError(
                f"{source}: the run has {steps} steps per epoch but this layout ({self.size} "
                f"ranks on {self.comm.num_nodes} node(s)) gives only {available}: some node "
                f"holds too few images of its shards; resume on the previous node count")
        self.steps_per_epoch = steps
        self.total_steps = self._total_steps()
        if self._schedule_from_recipe:
            self.schedule = recipe_schedule(self.config, self.steps_per_epoch, self.total_steps)

    def _load_mean_buffers(self, per_rank: list[dict[str, torch.Tensor]]) -> None:
        """This rank's buffers set to their mean over ``per_rank`` (one: that state's own)."""
        own = dict(self.model.named_buffers())
        with torch.no_grad():
            for name in per_rank[0] if per_rank else ():
                if name in own and all(name in b for b in per_rank):
                    mean = torch.stack([b[name].double() for b in per_rank]).mean(0)
                    own[name].copy_(mean.to(own[name].dtype))

    def _float_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, b) for n, b in self.model.named_buffers() if b.is_floating_point()]

    def _rank_state(self) -> dict[str, Any]:
        buffers = {n: b.detach().clone() for n, b in self._float_buffers()}
        return {**ckpt.rng_state(), "buffers": buffers,
                "consistency": self.policy.rank_state(self.step, self.model, self.optimizer)}

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        ckpt.set_rng_state(state)
        self._load_mean_buffers([state.get("buffers", {})])
        self.policy.load_rank_state(state.get("consistency"), self.model, self.optimizer)

    def _mean_buffers(self) -> dict[str, torch.Tensor]:
        """Collective: the mean over the ranks of every floating BN buffer (float64 sums, one
        Allreduce of the buffers' size), what an elastic resume starts every rank from. The
        ranks' own buffers are not changed."""
        named = self._float_buffers()
        flat = np.concatenate([b.detach().double().reshape(-1).numpy() for _, b in named]) \
            if named else np.zeros(0)
        total = sum_over(self.comm.mpi_comm, flat) / self.size
        mean, offset = {}, 0
        for name, b in named:
            mean[name] = torch.from_numpy(total[offset:offset + b.numel()].copy()).reshape(
                b.shape).to(b.dtype)
            offset += b.numel()
        return mean

    def save_checkpoint(self) -> str | None:
        """Collective: every rank writes its own state, rank 0 the shared state and, once
        every part is complete, the manifest, and renames the checkpoint into place; then the
        current line's newest ``train.keep_checkpoints`` are kept (hpcdl/train/checkpoint.py).
        Returns the path (every rank); None without ``write_files``."""
        if not self.options.write_files:
            self._last_checkpoint_step = self.step
            return None
        # Every rank: a sharded update gathers its momentum slices here (collective).
        optimizer_state = self.optimizer.state_dict() if self.shard_update else None
        bn_mean = self._mean_buffers()
        path = ckpt.checkpoint_path(self.run_dir, self.step)
        with self._span("checkpoint", "io"):
            tmp, error = None, None
            if self.rank == 0:
                try:
                    tmp = ckpt.begin_write(path)
                except OSError as exc:
                    error = f"rank 0 could not write checkpoint {path}: {_os_message(exc)}"
            tmp, error = self.comm.mpi_comm.bcast((tmp, error), root=0)
            if not error:
                files, mine = self._write_parts(tmp, optimizer_state, bn_mean)
                gathered = self.comm.mpi_comm.gather((files, mine), root=0)
                pruned = []
                if self.rank == 0:
                    error, pruned = self._commit(tmp, path, gathered)
                error, pruned = self.comm.mpi_comm.bcast((error, pruned), root=0)
                if pruned:  # each rank removes its own file, then rank 0 the rest
                    ckpt.remove_pruned(pruned, rank=self.rank)
                    self.comm.mpi_comm.Barrier()
                    if self.rank == 0:
                        ckpt.remove_pruned(pruned)
        if error:
            raise mark_agreed(ckpt.CheckpointWriteError(
                f"{error}; {_previous_checkpoint(self.run_dir, path)}: free space there (or "
                f"lower train.keep_checkpoints), then resume with --resume auto"))
        if self.rank == 0:
            log.info("checkpoint %s", path)
        self._last_checkpoint_step = self.step
        return path

    def _write_parts(self, tmp: str, optimizer_state: dict[str, Any] | None,
                     bn_mean: dict[str, torch.Tensor]) -> tuple[dict[str, Any], str | None]:
        """This rank's file (and rank 0's ``model.pt``) in the temporary directory: their
        ``{name: {bytes, sha256}}`` and the error, if the write failed."""
        files: dict[str, Any] = {}
        try:
            if self.rank == 0:
                state = self.state_dict(optimizer_state)
                shared = {k: state[k] for k in ckpt.SHARED_KEYS if k in state}
                files[ckpt.SHARED] = ckpt.write_part(tmp, ckpt.SHARED,
                                                     {**shared, "bn_mean": bn_mean})
            name = ckpt.rank_file(self.rank)
            files[name] = ckpt.write_part(tmp, name, {"rank": self.rank, "step": self.step,
                                                      **self._rank_state()})
        except OSError as exc:
            return files, _os_message(exc)
        return files, None

    def _commit(self, tmp: str, path: str, gathered: list) -> tuple[str | None, list[str]]:
        """Rank 0: the manifest and the rename when every rank wrote its part, then the
        pruning; else the temporary removed and the first failure named."""
        failed = [(r, err) for r, (_, err) in enumerate(gathered) if err]
        if failed:
            ckpt.abandon(tmp)
            rank, err = failed[0]
            more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
            return f"rank {rank} could not write checkpoint {path}: {err}{more}", []
        files = {name: record for part, _ in gathered for name, record in part.items()}
        state = self.state_dict({})
        manifest = {k: v for k, v in state.items() if k not in ckpt.SHARED_KEYS}
        if self._line is None:
            self._line = ckpt.start_line(self.run_dir, None)
        if self._seq is None:
            self._seq = max((e.seq for e in ckpt.checkpoint_index(self.run_dir)
                             if e.seq is not None), default=-1)
        manifest.update(line=self._line, seq=self._seq + 1, time=time.time(), files=files)
        self._writes += 1
        nth, pause_s = self._write_injection
        try:
            replaced = ckpt.commit(tmp, path, manifest, pause_s if self._writes == nth else 0.0)
        except OSError as exc:
            ckpt.abandon(tmp)
            return f"rank 0 could not write checkpoint {path}: {_os_message(exc)}", []
        self._seq += 1
        ckpt.line_recorded(self.run_dir)
        pruned = ckpt.prune_checkpoints(self.run_dir, self.config.train.keep_checkpoints,
                                        self._line)
        return None, pruned + ([replaced] if replaced else [])

    def resume(self, spec: str = "auto") -> str | None:
        """``auto``: the newest valid checkpoint of the current line in RUN_DIR/checkpoints
        (none: start fresh); ``none``: start fresh; a path: that checkpoint. Collective.
        Returns the path used. Who reads what, and the fall-back to the previous checkpoint:
        docs/training.md, "Checkpoints and resume"."""
        start_io = _io_counters()
        candidates: list[str] = []
        if self.rank == 0 and self.options.write_files:
            ckpt.remove_stale_temporaries(self.run_dir)
        if self.rank == 0 and spec not in (None, "", "none"):
            candidates = [e.path for e in ckpt.resume_candidates(self.run_dir)] \
                if spec == "auto" else [spec]
        loaded, failures = None, []
        if spec not in (None, "", "none"):
            loaded, failures = self._load_first(candidates)
        if loaded is None:
            error = None
            if self.rank == 0 and failures and (spec != "auto" or
                                                any(t for _, t in failures)):
                error = self._unreadable(spec, failures)
            error = self.comm.mpi_comm.bcast(error, root=0)
            if error:
                raise mark_agreed(ckpt.CheckpointError(error))
            if self.rank == 0 and self.options.write_files:
                self._line = ckpt.start_line(self.run_dir, None)
            if spec not in (None, "", "none"):
                level = logging.WARNING if failures else logging.INFO
                log.log(level, "--resume %s: no %scheckpoint in %s; starting from step 0", spec,
                        "valid " if failures else "", ckpt.checkpoint_dir(self.run_dir))
            return None
        path, state, own = loaded
        self.load_state_dict(state, path, own)
        self.resumed_from = path
        self._note_backend_change()
        if self.rank == 0 and self.options.write_files:
            self._continue_line(spec, path)
            truncate_metrics(os.path.join(self.run_dir, "metrics.jsonl"), self.step)
        read = _io_counters() - start_io if start_io is not None else None
        log.info("resumed from %s at step %d (epoch %d)%s", path, self.step,
                 self.step // self.steps_per_epoch,
                 f"; this rank read {read} bytes (rchar)" if read is not None else "")
        return path

    def _note_backend_change(self) -> None:
        """Rank 0, after a resume: ``comm.backend: auto``'s trial ran again at this start (a
        requeue may land on other nodes), so the backend or buckets may differ from the run
        resumed; a change is logged as a warning, and summary.json's ``comm_trial`` keeps
        what the run before used (``previous``)."""
        trial = getattr(self.comm, "trial", None)
        if self.rank != 0 or trial is None:
            return
        try:
            before = read_summary(os.path.join(self.run_dir, "summary.json"))
        except (OSError, ValueError):
            return  # no summary of the run before (killed outright): nothing to compare
        used = (before.get("comm_trial") or {}).get("chosen") or {"backend": before.get("backend")}
        trial.previous = {**used, "steps": before.get("steps")}
        now = trial.record()["chosen"]
        if any(now.get(k) != v for k, v in used.items()):
            log.warning("comm.backend: auto: resumed at step %d on %s, %g MiB buckets, first "
                        "bucket %g MiB; the run resumed used %s (the trial runs at every start; "
                        "set comm.backend, comm.bucket_mb and comm.trial_buckets: false to keep "
                        "one)", self.step, now["backend"], now["bucket_mb"],
                        now["first_bucket_mb"], ", ".join(f"{k} {v}" for k, v in used.items()))

    def _load_first(self, candidates: list[str]) -> tuple[tuple | None, list]:
        """Collective: try rank 0's ``candidates`` in order until one loads on every rank.
        Returns ((path, shared state, this rank's own state or None), failures) where
        failures are rank 0's (message, transient) of those that did not."""
        failures: list[tuple[str, bool]] = []
        while True:
            header, data, entries = None, None, None
            if self.rank == 0:
                header, data, entries = self._next_readable(candidates, failures)
            header = self.comm.mpi_comm.bcast(header, root=0)
            if header is None:
                return None, failures
            data = self._broadcast_bytes(data, header["bytes"])
            # each rank gets its own file's record only: O(1) bytes, whatever the rank count
            entry = self.comm.mpi_comm.scatter(entries, root=0) \
                if header["format"] == ckpt.CHECKPOINT_FORMAT \
                and header["world_size"] == self.size else None
            result, error = None, None
            try:
                result = self._load_candidate(header, data, entry)
            except ckpt.CheckpointError as exc:
                error = (str(exc), exc.transient)
            del data
            errors = self.comm.mpi_comm.gather(error, root=0)
            if self.rank == 0:
                for message, transient in (e for e in errors if e):
                    log.error("%s; trying the previous checkpoint", message)
                    failures.append((message, transient))
            if not self.comm.mpi_comm.bcast(self.rank == 0 and any(errors), root=0):
                return result, failures

    def _next_readable(self, candidates: list[str], failures: list) -> tuple:
        """Rank 0: the next candidate whose manifest and shared file read and check, as
        (header, bytes, per-rank file records to scatter): the header carries what every
        rank needs (path, format, world size, byte count, the manifest's scalars)."""
        while candidates:
            path = candidates.pop(0)
            try:
                if not os.path.isdir(path):  # single file: every rank's state inside
                    data = ckpt.read_file(path)
                    state = ckpt.check_legacy(ckpt.load_part(data, path), path)
                    return {"path": path, "format": ckpt.LEGACY_FORMAT, "bytes": len(data),
                            "world_size": state["world_size"]}, data, None
                manifest = ckpt.read_manifest(path)
                data = ckpt.read_part(path, ckpt.SHARED, manifest["files"][ckpt.SHARED])
                ranks = [manifest["files"].get(ckpt.rank_file(r))
                         for r in range(self.size)] \
                    if manifest["world_size"] == self.size else None
                header = {"path": path, "format": ckpt.CHECKPOINT_FORMAT, "bytes": len(data),
                          "world_size": manifest["world_size"],
                          "manifest": ckpt.merge(manifest, {})}
                return header, data, ranks
            except ckpt.CheckpointError as exc:
                log.error("%s; trying the previous checkpoint", exc)
                failures.append((str(exc), exc.transient))
        return None, None, None

    def _broadcast_bytes(self, data: bytearray | None, size: int) -> bytearray:
        """``model.pt``'s bytes from rank 0 to every rank (one MPI_Bcast, no pickling)."""
        from mpi4py import MPI

        if self.rank != 0:
            data = bytearray(size)
        if self.size > 1:
            self.comm.mpi_comm.Bcast([data, MPI.BYTE], root=0)
        return data

    def _load_candidate(self, header: dict[str, Any], data: bytearray,
                        entry: dict[str, Any] | None) -> tuple:
        path = header["path"]
        if header["format"] == ckpt.LEGACY_FORMAT:
            state = ckpt.check_legacy(ckpt.load_part(data, path), path)
            same = state.get("world_size") == self.size
            return path, state, state["rng"][self.rank] if same else None
        state = ckpt.merge(header["manifest"], ckpt.load_part(
            data, os.path.join(path, ckpt.SHARED)))
        own = None
        if entry is not None or header["world_size"] == self.size:
            name = ckpt.rank_file(self.rank)
            if entry is None:
                raise ckpt.CheckpointError(f"checkpoint {path} is incomplete: its manifest "
                                           f"lists no {name}")
            own = ckpt.load_part(ckpt.read_part(path, name, entry), os.path.join(path, name))
        return path, state, own

    def _unreadable(self, spec: str, failures: list[tuple[str, bool]]) -> str:
        if spec != "auto":
            return failures[0][0]
        listed = "; ".join(message for message, _ in failures)
        return (f"--resume auto: no checkpoint in {ckpt.checkpoint_dir(self.run_dir)} could be "
                f"read, and some failed for a reason that may pass (a file system error, not "
                f"a damaged file), so the run does not start again from step 0: {listed}. "
                f"Rerun when the file system answers again (nothing was removed), or pass "
                f"--resume none to start over")

    def _continue_line(self, spec: str, path: str) -> None:
        """Rank 0 after loading ``path``: continue its line when it is the newest checkpoint
        written (auto, or that path given), else start a new line from it."""
        index = ckpt.checkpoint_index(self.run_dir)
        self._seq = max((e.seq for e in index if e.seq is not None), default=-1)
        mine = [e for e in index if os.path.realpath(e.path) == os.path.realpath(path)]
        line = ckpt.current_line(self.run_dir, index)
        if spec == "auto" and line is not None and line.get("from") == path:
            self._line = line["line"]  # the line started from there, continued
            return
        if mine and line is not None and mine[0].line == line["line"]:
            newest = [e for e in index if e.line == line["line"]][-1]
            if spec == "auto" or newest.path == mine[0].path:
                self._line = line["line"]
                return
        self._line = ckpt.start_line(self.run_dir, path)

    # -- metrics and output ------------------------------------------------------------------
    def _open_outputs(self) -> None:
        if self.rank != 0 or not self.options.write_files:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        # The run as it ran: the per-rank batch, the compute and wire dtypes this job
        # resolved (--recipe RUN_DIR/config.yaml repeats them on any CPU).
        config = copy.deepcopy(self.config)
        if config.batch.per_rank is None:
            config.batch.per_rank = self.per_rank
        config.train.precision, config.comm.wire_dtype = self.precision, self.wire_dtype
        write_resolved_config(config, self.run_dir)
        self._metrics = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"))
        show = self.options.progress
        if show or (show is None and sys.stderr.isatty()):
            from tqdm import tqdm

            self._progress = tqdm(total=self._last_step(), initial=self.step, unit="step",
                                  dynamic_ncols=True)

    def _close_outputs(self) -> None:
        """The progress bar and metrics.jsonl (nothing when they are closed already)."""
        for output in (self._progress, self._metrics):
            if output is not None:
                output.close()
        self._progress = self._metrics = None

    def request_stop(self, signum: int | None = None) -> None:
        """Checkpoint and stop at the end of the current step, as on ``signum`` (default: the
        signal this rank received, else SIGUSR1). An agreed decision: call it on every rank at
        the same step, from an after-step hook, after an agreement of your own (LTFB's stop
        check across trainers), or this rank checkpoints alone and the others wait."""
        self._stop_agreed = signum or signals.pending() or signal.SIGUSR1

    def write_metrics(self, record: dict[str, Any]) -> None:
        """Append a record to metrics.jsonl (rank 0; a no-op on the others)."""
        if self._metrics is not None:
            self._metrics.write(record)

    def _record_step(self, epoch: int, loss: float, data_wait: float, step_s: float) -> None:
        self._train_time_s += step_s
        w = self._window
        w.add(loss, data_wait, self.reducer.comm_wait_s, step_s)
        if self._progress is not None:
            self._progress.update(1)
        if self.step % self.config.train.log_every_steps and self.step != self._last_step():
            return
        record = {"kind": "train", "step": self.step, "epoch": epoch,
                  "loss": w.loss / w.steps, "lr": self.schedule(self.step - 1),
                  "images_per_s": self.global_batch * w.steps / max(w.step_s, 1e-9),
                  "step_s": w.step_s / w.steps, "data_wait_s": w.data_wait_s / w.steps,
                  "comm_wait_s": w.comm_wait_s / w.steps, "time": time.time()}
        self.write_metrics(record)
        if self._progress is not None:
            self._progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.3g}",
                                       img_s=f"{record['images_per_s']:.0f}")
        else:
            log.info("step %d/%d epoch %d loss %.4f lr %.4g %.1f img/s data-wait %.3fs "
                     "comm-wait %.3fs", self.step, self._last_step(), epoch, record["loss"],
                     record["lr"], record["images_per_s"], record["data_wait_s"],
                     record["comm_wait_s"])
        self._window = _Window()

    def summary(self, stopped: str, wall_s: float) -> dict[str, Any]:
        ev = self.last_eval or {}
        return {
            "name": self.config.name,
            "stopped": stopped,
            "top1": ev.get("top1"),
            "top5": ev.get("top5"),
            "eval_loss": ev.get("loss"),
            "epochs": round(self.step / self.steps_per_epoch, 4),
            "steps": self.step,
            "total_steps": self.total_steps,
            "global_batch": self.global_batch,
            "images_seen": self.images_seen,
            "images_in_epoch": self.images_in_epoch,
            "per_rank_batch": self.per_rank,
            "accumulation": self.accumulation,
            "ranks": self.size,
            "nodes": getattr(self.comm, "num_nodes", 1),
            "backend": getattr(self.comm, "backend", "?"),
            "comm_trial": trial.record() if (trial := getattr(self.comm, "trial", None))
            else None,
            "reducer": ("enabled" if self.policy.communicates else "disabled (no_comm)"
                        if self.options.no_comm else "not needed (1 rank)"),
            "shard_update": self.shard_update,
            "overlap_update": self._overlap_update(),
            "precision": self.precision,
            "wire_dtype": self.wire_dtype,
            "threads": torch.get_num_threads(),
            "wall_s": wall_s,
            "train_s": self._train_time_s,
            "train_s_total": self.train_s_total,
            "images_per_s": self._images_this_run / self._train_time_s
            if self._train_time_s > 0 else None,
            "comm_wait_s": self.reducer.total_comm_wait_s,
            "traffic": self.policy.traffic(),
            "resumed_from": self.resumed_from,
            "params_sha256": self.params_sha256(),
        }

    def close(self) -> None:
        """Stop the reducer's thread and remove its hooks."""
        self.policy.close()
        self._close_outputs()


def _os_message(exc: OSError) -> str:
    """'[Errno 28] No space left on device': the cause, without the temporary's name."""
    return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)


def _io_counters() -> int | None:
    """This process's ``rchar`` (bytes passed to read(), /proc/self/io), or None off Linux."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def _previous_checkpoint(run_dir: str, failed: str) -> str:
    kept = [p for p in ckpt.list_checkpoints(run_dir) if p != failed]
    return f"the previous checkpoint {kept[-1]} is intact" if kept else "no checkpoint was kept"


class _Window:
    """Sums over the steps since the last metrics record."""

    def __init__(self) -> None:
        self.steps, self.loss, self.data_wait_s, self.comm_wait_s, self.step_s = 0, 0.0, 0.0, \
            0.0, 0.0

    def add(self, loss: float, data_wait: float, comm_wait: float, step_s: float) -> None:
        self.steps += 1
        self.loss += loss
        self.data_wait_s += data_wait
        self.comm_wait_s += comm_wait
        self.step_s += step_s
