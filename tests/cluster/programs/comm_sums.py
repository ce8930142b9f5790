"""Every comm backend's sums across hosts, and the bytes each host's eth0 carried for them.

Run under an MPI launcher across the test cluster's hosts (tests/cluster/test_cluster_mpi.py).
Each rank reads its own host's eth0 counters (every host has its own sysfs), so the bytes are
what really crossed that host's link. Rank 0 prints one JSON object:
``{"ranks": [{"rank", "host", "local_size"}...], "backends": {name: {"ok", "max_err",
"bytes": [{"host", "tx", "rx"}...]}}}``.
"""
from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import hpcdl.comm

#: Odd sizes cross every segment and chunk boundary unevenly (segment_bounds, ring chunks).
SIZES = (1, 7, 1001, 65_537, 1_000_003)
#: The buffer whose bytes are counted: large against the collectives' own small messages.
COUNTED_NUMEL = 4 * 2**20  # 16 MiB of float32


def eth0_bytes() -> tuple[int, int]:
    stats = Path("/sys/class/net/eth0/statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def check_sums(comm, world: MPI.Intracomm) -> float:
    """Largest error of an allreduce sum against the float64 sum of every rank's input."""
    worst = 0.0
    for numel in SIZES:
        index = np.arange(numel, dtype=np.float64)
        mine = torch.from_numpy(((index % 97) * (world.rank + 1) / 7).astype(np.float32))
        expected = (index % 97) / 7 * sum(r + 1 for r in range(world.size))
        comm.allreduce_(mine, average=False)
        worst = max(worst, float(np.max(np.abs(mine.numpy() - expected) / (1 + expected))))
    return worst


def counted_allreduce_bytes(comm, world: MPI.Intracomm) -> dict:
    buffer = comm.empty(COUNTED_NUMEL)
    buffer.fill_(1.0)
    comm.allreduce_flat_(buffer, average=False)  # warm: windows, connections, rendezvous
    world.Barrier()
    tx0, rx0 = eth0_bytes()
    comm.allreduce_flat_(buffer, average=False)
    world.Barrier()
    tx1, rx1 = eth0_bytes()
    return {"host": socket.gethostname(), "tx": tx1 - tx0, "rx": rx1 - rx0}


def main(backends: list[str]) -> None:
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    me = {"rank": world.rank, "host": socket.gethostname(), "local_size": node.size,
          "processor": MPI.Get_processor_name()}
    report = {"ranks": world.gather(me, root=0), "backends": {}}
    for name in backends:
        comm = hpcdl.comm.init(name, world=world)
        try:
            worst = world.allreduce(check_sums(comm, world), op=MPI.MAX)
            counted = world.gather(counted_allreduce_bytes(comm, world), root=0)
        finally:
            comm.close()
        # float32 sums of at most 4 ranks' exact multiples of 1/7: a few ulps of the result.
        report["backends"][name] = {"ok": worst < 1e-6, "max_err": worst, "bytes": counted,
                                    "counted_bytes": COUNTED_NUMEL * 4}
    if world.rank == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["mpi", "ring", "shm", "gloo"])
