"""A user's own training loop on `hpcdl.comm.init`, nothing else of hpcdl: the stall watchdog
must be there by default (tests/cluster/test_faults.py cuts a host off under it).

``own_loop.py STEPS``: STEPS allreduces of a gradient-sized buffer, a short sleep between them
as a step's compute."""
from __future__ import annotations

import sys
import time

import torch

import hpcdl.comm


def main(steps: int) -> int:
    comm = hpcdl.comm.init("mpi")          # the watchdog is on by default
    grads = torch.ones(1 << 18)            # 1 MiB of fp32, a small model's gradients
    for _ in range(steps):
        comm.allreduce_(grads)
        time.sleep(0.02)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000))
