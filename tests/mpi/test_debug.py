"""hpcdl.debug on a real world (run by tests/run.sh under mpiexec -n 2, 3 and 4)."""
import json
import os
import socket
import time

import pytest
import torch

import hpcdl.comm
from hpcdl.debug import (
    Timeline,
    note_activity,
    setup_rank_logging,
    unwatch_collectives,
    watch_collectives,
)


@pytest.fixture
def comm(world):
    communicator = hpcdl.comm.init("mpi", world)
    yield communicator
    unwatch_collectives(communicator)
    communicator.close()


def test_every_rank_writes_its_own_prefixed_log(world, shared_tmp):
    log = setup_rank_logging(shared_tmp, world.rank, world.size, "info")
    log.info("hello from here")
    world.Barrier()
    setup_rank_logging(None, world.rank, world.size, "warning")
    for rank in range(world.size):
        text = open(os.path.join(shared_tmp, "logs", f"rank-{rank:04d}.log")).read()
        assert f"[rank {rank}/{world.size} " in text and "hello from here" in text
    assert socket.gethostname() in text


def test_timeline_gathers_every_rank_into_one_trace(world, shared_tmp):
    path = os.path.join(shared_tmp, "timeline.json")
    timeline = Timeline(path, world.rank, world)
    with timeline.span("forward", "compute"):
        pass
    written = timeline.save()
    assert written == (path if world.rank == 0 else None)
    world.Barrier()
    events = json.load(open(path))["traceEvents"]
    assert sorted({e["pid"] for e in events if e["ph"] == "X"}) == list(range(world.size))


def test_recorded_collectives_agree_across_ranks(world, comm):
    monitor = watch_collectives(comm, None, record=True, warn_s=0, abort_s=0)
    for bucket in range(3):
        comm.allreduce_flat_(torch.ones(8 + bucket), bucket=bucket)
    comm.barrier()
    mine = [(r["seq"], r["name"], r["bucket"], r["bytes"]) for r in monitor.records]
    reductions = [(bucket, nbytes) for _, name, bucket, nbytes in mine if name == "allreduce"]
    assert reductions == [(0, 32), (1, 36), (2, 40)] and mine[-1][1] == "barrier"
    assert world.allgather(mine) == [mine] * world.size


def test_waiting_ranks_report_the_rank_that_sleeps(world, comm, shared_tmp):
    late = world.size - 1
    monitor = watch_collectives(comm, shared_tmp, warn_s=0.5, abort_s=0)
    comm.barrier()
    if world.rank == late:
        note_activity(comm, "decoding a slow shard")
        time.sleep(2.0)
    comm.barrier()
    reports = list(monitor.watchdog.reports)
    unwatch_collectives(comm)
    if world.rank != late:
        assert reports, "no stall report after waiting 4x the warn threshold"
        assert f"have not arrived: {late}" in reports[0]
    else:
        assert reports == []  # the sleeping rank was never waiting in a collective


def test_a_region_around_a_direct_mpi_call_counts_as_a_collective(world, comm):
    from mpi4py import MPI

    from hpcdl.debug import watch_region

    monitor = watch_collectives(comm, None, record=True, warn_s=0, abort_s=0)
    with watch_region(comm, "agree on loss"):
        total = world.allreduce(1, op=MPI.SUM)
    assert total == world.size
    assert [(r["seq"], r["name"]) for r in monitor.records] == [(1, "agree on loss")]
