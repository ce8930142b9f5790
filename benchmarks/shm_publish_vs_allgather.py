"""Lever "fewer passes over memory" (measured: docs/results/notebook-training-step-2026.md):
the shm allgather into the bucket then
an unpack into the parameters, against one sync and a copy straight from the peers' window
regions (``publish_flat_``, what ShardedOptimizer does now). One AlexNet-BN-sized bucket
(61.1 M floats), the two variants interleaved:

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/shm_publish_vs_allgather.py
"""
import statistics
import time

import torch
from mpi4py import MPI

import hpcdl.comm

NUMEL = 61_110_184
REPEATS = 6


def unpack(param: torch.Tensor, sources: list[torch.Tensor], bounds: list[int], me: int) -> None:
    for k, source in enumerate(sources):
        if k != me:
            param[bounds[k]:bounds[k + 1]].copy_(source[bounds[k]:bounds[k + 1]])


def main() -> None:
    torch.set_num_threads(1)
    comm = hpcdl.comm.init("shm", MPI.COMM_WORLD)
    bucket, param = comm.empty(NUMEL), torch.randn(NUMEL)
    bounds, me = comm.shard_bounds(NUMEL), comm.rank
    times: dict[str, list[float]] = {"allgather + unpack": [], "publish + direct copy": []}
    for _ in range(REPEATS):
        for variant, seconds in times.items():
            MPI.COMM_WORLD.Barrier()
            start = time.perf_counter()
            bucket[bounds[me]:bounds[me + 1]].copy_(param[bounds[me]:bounds[me + 1]])
            if variant == "allgather + unpack":
                comm.allgather_flat_(bucket)
                unpack(param, [bucket] * comm.size, bounds, me)
            else:
                unpack(param, comm.publish_flat_(bucket), bounds, me)
                comm.release_flat_(bucket)
            seconds.append(time.perf_counter() - start)
    if me == 0:
        for variant, seconds in times.items():
            print(f"{variant}: median {statistics.median(seconds[1:]):.3f} s (first dropped), "
                  f"runs {[round(s, 3) for s in seconds]}")
    comm.close()


if __name__ == "__main__":
    main()
