"""The CPU hpcdl's gloo backend burns per MiB it allreduces, by the size of one call: every
thread of the process (the caller's, gloo's loop and workers), from 1 MiB to 150 MiB (a
sampled trial round is a few MiB; AlexNet-BN's fc6 bucket is 151 MB). Collective; rank 0
writes OUT.json.

    mpiexec -n 2 python3 gloo_cpu_by_call_size.py OUT.json
"""
import sys
import time

import torch
from mpi4py import MPI

import hpcdl.comm
from hpcdl.results import bench_report, write_json

SIZES_MIB = ((1, 40), (4, 20), (8, 10), (25, 4), (64, 2), (150, 1))  # (MiB, calls)


def main(out: str) -> None:
    world = MPI.COMM_WORLD
    comm = hpcdl.comm.init("gloo", world)
    rows = []
    for mib, calls in SIZES_MIB:
        buffer = torch.ones(mib * 2 ** 20 // 4)
        comm.allreduce_flat_(buffer)  # connections and first touch: not timed
        world.Barrier()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            comm.allreduce_flat_(buffer)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        worst = world.allreduce(cpu / (calls * mib), op=MPI.MAX)
        rows.append({"call_mib": mib, "calls": calls, "wall_ms_per_mib": 1e3 * wall / (calls * mib),
                     "process_cpu_ms_per_mib": 1e3 * cpu / (calls * mib),
                     "process_cpu_ms_per_mib_max_over_ranks": 1e3 * worst})
    comm.close()
    if world.rank == 0:
        write_json(out, bench_report("gloo-cpu-by-call-size", rows, {}, ranks=world.size))


if __name__ == "__main__":
    main(sys.argv[1])
