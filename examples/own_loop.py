"""Your own model, your own data, your own loop: data-parallel over MPI with hpcdl.

    mpiexec -n 2 python examples/own_loop.py                      # LARS, 2 epochs, ~1 min
    mpiexec -n 4 python examples/own_loop.py --optimizer adamw --lr 0.005 --out run

No recipe, no shards, no trainer: a plain PyTorch loop on the Fashion-MNIST subset shipped with
hpcdl (6,000 training and 1,000 test images, read straight from its idx files), with the four
lines that make it distributed (marked ``# hpcdl``). docs/own_loop.md maps each line from
Horovod and from DDP.

The global batch is fixed (``--global-batch``) and split over the ranks, as in hpcdl's recipes:
the same hyperparameters give the same training on 1, 2 or 4 ranks, up to rounding. (Horovod's
examples instead keep the per-rank batch and scale the learning rate by the rank count.)
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import hpcdl
from hpcdl.io import atomic_write, atomic_write_text
from hpcdl.optim import LARS, param_groups

DEMO_DATA = Path(hpcdl.__file__).parent / "demo_data"   # Xiao et al. 2017, MIT licence


def load_fashion_mnist(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float N×1×28×28 in [0, 1], labels int64 N) from the shipped idx files."""
    prefix = "train" if split == "train" else "t10k"

    def idx(name: str, header_bytes: int) -> np.ndarray:
        with gzip.open(DEMO_DATA / f"{prefix}-{name}-ubyte.gz") as f:
            return np.frombuffer(f.read(), dtype=np.uint8, offset=header_bytes)

    images = idx("images-idx3", 16).reshape(-1, 1, 28, 28).astype(np.float32) / 255
    labels = idx("labels-idx1", 8).astype(np.int64)
    return torch.from_numpy(images), torch.from_numpy(labels)


class SmallCNN(torch.nn.Module):
    """Two conv layers and a classifier; no BatchNorm, so every rank's model is the same
    function and the distributed run equals one process on the whole batch."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def make_optimizer(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Any torch optimizer works; LARS (You et al., arXiv:1708.03888) with the MLPerf skip list
    (no trust ratio or weight decay for biases) is hpcdl's."""
    if name == "lars":
        return LARS(param_groups(model, weight_decay=5e-4), lr=lr, momentum=0.9,
                    trust_coefficient=0.01)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    raise ValueError(f"--optimizer {name!r}: choose lars, sgd or adamw")


def global_batches(num_images: int, global_batch: int, steps: int,
                   seed: int) -> list[torch.Tensor]:
    """The indices of each step's global batch: one shuffle per epoch from ``seed`` and the
    epoch, the same on every rank (each rank then takes its own slice)."""
    per_epoch = num_images // global_batch
    batches = []
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(num_images, generator=torch.Generator().manual_seed(seed + epoch))
        batches.append(order[i * global_batch:(i + 1) * global_batch])
    return batches


def warmup_then_decay(step: int, warmup_steps: int, steps: int) -> float:
    """The factor on the peak rate at ``step``: linear up over ``warmup_steps``, then linear
    down to 0 at ``steps``."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    return max(0.0, (steps - step) / max(1, steps - warmup_steps))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          images: torch.Tensor, labels: torch.Tensor, comm, steps: int, global_batch: int,
          seed: int = 0, warmup_steps: int = 0, log=None) -> list[float]:
    """The loop: each rank runs forward and backward on its slice of the global batch; the
    wrapped optimizer steps on the world's average gradient. The rate warms up linearly for
    ``warmup_steps`` (Goyal et al., arXiv:1706.02677) and then decays linearly to 0. Returns
    the world's mean loss of each step."""
    if global_batch % comm.size:
        raise ValueError(f"--global-batch {global_batch} is not a multiple of the "
                         f"{comm.size} ranks")
    per_rank = global_batch // comm.size
    # torch's schedulers accept the wrapped optimizer.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_then_decay(
        step, warmup_steps, steps))
    losses = []
    for step, batch in enumerate(global_batches(len(images), global_batch, steps, seed)):
        mine = batch[comm.rank * per_rank:(comm.rank + 1) * per_rank]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images[mine]), labels[mine])
        loss.backward()           # the reducer averages buckets while backward runs
        optimizer.step()          # waits for the average, then LARS/SGD/AdamW steps
        schedule.step()
        world_loss = loss.detach().reshape(1).clone()
        comm.allreduce_(world_loss)                  # the mean over ranks, for the log
        losses.append(float(world_loss))
        if log is not None and (step % 20 == 0 or step == steps - 1):
            log.info("step %d/%d  loss %.4f  lr %.4g", step + 1, steps, losses[-1],
                     schedule.get_last_lr()[0])
    return losses


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, comm) -> float:
    """Top-1 over the whole test set: each rank counts its share, one allreduce sums."""
    mine = torch.arange(comm.rank, len(images), comm.size)
    correct = (model(images[mine]).argmax(1) == labels[mine]).sum()
    counts = torch.stack([correct, torch.tensor(len(mine))]).to(torch.int64)
    comm.allreduce_(counts, average=False)
    return float(counts[0]) / float(counts[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", default="lars", help="lars (default), sgd or adamw")
    parser.add_argument("--lr", type=float, default=2.0,
                        help="peak rate (LARS: 2; SGD: 0.1; AdamW: 0.005)")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=None, help="stop after N steps")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write model.pt and summary.json here")
    args = parser.parse_args(argv)

    comm = hpcdl.comm.init()                                       # hpcdl
    log = hpcdl.setup_logging(comm, run_dir=args.out, name="own_loop")
    torch.manual_seed(args.seed + comm.rank)  # different on purpose: the broadcast fixes it
    images, labels = load_fashion_mnist("train")
    model = SmallCNN()
    optimizer = make_optimizer(args.optimizer, model, args.lr)
    optimizer = hpcdl.DistributedOptimizer(optimizer, model, comm)  # hpcdl
    hpcdl.broadcast_parameters(model, comm)                         # hpcdl
    hpcdl.broadcast_optimizer_state(optimizer, comm)                # hpcdl

    steps = args.steps or math.ceil(args.epochs * (len(images) // args.global_batch))
    log.info("%d ranks, global batch %d (%d per rank), %d steps of %s",
             comm.size, args.global_batch, args.global_batch // comm.size, steps, args.optimizer)
    losses = train(model, optimizer, images, labels, comm, steps, args.global_batch,
                   seed=args.seed, warmup_steps=steps // 10, log=log)
    top1 = evaluate(model, *load_fashion_mnist("test"), comm)
    log.info("top-1 %.1f%% on the 1,000 test images", 100 * top1)
    if args.out is not None and comm.rank == 0:   # every rank holds the same parameters
        atomic_write(os.path.join(args.out, "model.pt"),
                     lambda f: torch.save(model.state_dict(), f))
        summary = {"ranks": comm.size, "steps": steps, "optimizer": args.optimizer,
                   "first_loss": losses[0], "last_loss": losses[-1], "top1": top1}
        atomic_write_text(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=1))
    optimizer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
