"""The baselines ``hpcdl bench train`` times hpcdl's step against: the same model, LARS and
schedule written the way a PyTorch user would (``DistributedDataParallel`` on gloo), the way a
Horovod user would (``hvd.DistributedOptimizer``), and plain torch with no wrapper at all (the
``torch`` mode: the reference hpcdl's compute-only step is held to), all around one plain
torch step in the precision and memory format the recipe resolves to.

Each baseline is a "stepper" (:data:`Stepper`): a function that takes one batch, runs one
optimizer step, and returns the seconds it waited for communication, or None where that wait
happens inside ``backward()``/``step()`` and cannot be told apart from compute (DDP and
Horovod both). Horovod is a baseline, never a dependency of hpcdl.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from hpcdl.cpus import memory_format_name

#: One optimizer step on one batch -> seconds waited for communication (None: not separable).
Stepper = Callable[[Any], "float | None"]


def plain_step(forward: Callable, optimizer, schedule, bf16: bool,
               memory_format=None) -> Stepper:
    """One torch step as its user writes it: the scheduled learning rate, zeroed gradients,
    ``forward`` on the normalised batch (in ``memory_format`` when given) under bf16 autocast
    when ``bf16``, cross-entropy, backward, ``optimizer.step()``. Returns None: a wrapper's
    allreduces (DDP's inside backward, Horovod's inside step) are not separable from compute."""
    import torch

    from hpcdl.data import normalize
    from hpcdl.optim import set_learning_rate

    criterion = torch.nn.CrossEntropyLoss()
    steps = itertools.count()

    def step(batch) -> None:
        images, labels = batch
        set_learning_rate(optimizer, schedule(next(steps)))
        optimizer.zero_grad(set_to_none=True)
        inputs = normalize(images)
        if memory_format is not None:
            inputs = inputs.contiguous(memory_format=memory_format)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = criterion(forward(inputs), labels)
        loss.backward()
        optimizer.step()
        return None

    return step


def recipe_memory_format(config, threads: int, model):
    """The torch memory format of ``config``'s ``train.channels_last`` on ``threads`` threads
    for its (resolved) ``train.precision`` and ``model``: hpcdl.cpus.memory_format_name's
    rule, which the Trainer follows too."""
    import torch

    from hpcdl.models import channels_last_unsafe_layer

    name = memory_format_name(config.train.channels_last, threads, config.train.precision,
                              channels_last_unsafe_layer(model))
    return torch.channels_last if name == "channels_last" else torch.contiguous_format


@contextlib.contextmanager
def torch_stepper(config, total_steps: int) -> Iterator[Stepper]:
    """The same model, LARS, schedule, precision and memory format as the Trainer's step,
    written as plain torch on one process: what hpcdl's compute-only step (``no_comm``) is
    compared with (``vs_torch``). ``config.train.precision`` is already resolved."""
    import torch

    from hpcdl.train.trainer import recipe_model, recipe_optimizer, recipe_schedule

    model = recipe_model(config)
    memory_format = recipe_memory_format(config, torch.get_num_threads(), model)
    model = model.to(memory_format=memory_format)
    schedule = recipe_schedule(config, total_steps, total_steps)
    optimizer = recipe_optimizer(config, model, schedule)
    yield plain_step(model, optimizer, schedule, config.train.precision == "bfloat16",
                     memory_format)


@contextlib.contextmanager
def ddp_stepper(mpi_comm, config, total_steps: int,
                fp16_wire: bool = False) -> Iterator[Stepper]:
    """The same step written the way a PyTorch user would: DDP(model) on gloo, LARS. With
    ``fp16_wire``, DDP's ``fp16_compress_hook``: the 16-bit wire DDP offers on CPU (its
    ``bf16_compress_hook`` asks for CUDA and NCCL, or XPU)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpcdl.comm.gloo import init_process_group_over_mpi
    from hpcdl.train.trainer import recipe_model, recipe_optimizer, recipe_schedule

    # Both DDP modes share torch's one default group: the first to open it closes it last.
    store = None if dist.is_initialized() else init_process_group_over_mpi(mpi_comm)
    try:
        model = recipe_model(config)
        memory_format = recipe_memory_format(config, torch.get_num_threads(), model)
        model = model.to(memory_format=memory_format)
        # Held in a dict so it can be dropped before its process group is destroyed.
        held = {"ddp": DistributedDataParallel(model, bucket_cap_mb=config.comm.bucket_mb)}
        if fp16_wire:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            held["ddp"].register_comm_hook(None, default_hooks.fp16_compress_hook)
        schedule = recipe_schedule(config, total_steps, total_steps)
        optimizer = recipe_optimizer(config, model, schedule)
        yield plain_step(lambda inputs: held["ddp"](inputs), optimizer, schedule,
                         config.train.precision == "bfloat16", memory_format)
        held.clear()
    finally:
        if store is not None:
            dist.destroy_process_group()
            mpi_comm.Barrier()  # rank 0's store outlives every peer's last use of it
            del store


def horovod_missing() -> str | None:
    """Why the ``horovod`` mode cannot run here, or None. Horovod is a baseline of the bench,
    never a dependency of hpcdl: it is built from source into a bench environment."""
    try:
        import horovod.torch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a build that fails to load
        return (f"horovod.torch not importable ({type(exc).__name__}: {exc}); build it into a "
                "bench venv: docs/performance.md, 'Training step across hosts'")
    return None


@contextlib.contextmanager
def horovod_stepper(config, total_steps: int) -> Iterator[Stepper]:
    """The same step the way a Horovod user writes it (Sergeev & Del Balso 2018):
    ``hvd.DistributedOptimizer`` around LARS, Horovod's own defaults (fusion buffer, cycle
    time, MPI underneath), parameters broadcast from rank 0."""
    import horovod.torch as hvd

    from hpcdl.train.trainer import recipe_model, recipe_optimizer, recipe_schedule

    hvd.init()
    try:
        model = recipe_model(config)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        schedule = recipe_schedule(config, total_steps, total_steps)
        optimizer = hvd.DistributedOptimizer(
            recipe_optimizer(config, model, schedule),
            named_parameters=model.named_parameters())
        yield plain_step(model, optimizer, schedule, config.train.precision == "bfloat16")
    finally:
        hvd.shutdown()
