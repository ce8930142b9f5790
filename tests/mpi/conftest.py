"""Harness for tests that run under a real ``mpiexec -n P python -m pytest tests/mpi``.

Every rank runs the same tests in the same order. Three rules keep a failing test from hanging
the whole suite:
- ranks meet at a barrier after each test, so they stay in lock-step;
- a watchdog (faulthandler) writes every thread's stack and exits a rank that is stuck in one
  test longer than HPCDL_TEST_TIMEOUT seconds, which makes mpiexec end the others. It writes
  to ``<junit file>.rank<r>.hang.txt`` (pytest captures stderr, and a killed rank's captured
  output is lost), headed by the test's name; tests/run.sh prints those files;
- ``@pytest.mark.min_ranks(n)`` / ``max_ranks(n)`` skip at collection time, identically on
  every rank, so no rank waits for a test another rank skipped.
"""
from __future__ import annotations

import faulthandler
import os
import tempfile

import pytest
from mpi4py import MPI

TEST_TIMEOUT_S = float(os.environ.get("HPCDL_TEST_TIMEOUT", "240"))
_hang_file = None  # where the watchdog writes (pytest_configure opens it)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "min_ranks(n): needs at least n MPI ranks")
    config.addinivalue_line("markers", "max_ranks(n): needs at most n MPI ranks")
    rank = MPI.COMM_WORLD.rank
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath:  # one JUnit file per rank; tests/summarize.py reads rank 0's
        root, ext = os.path.splitext(xmlpath)
        config.option.xmlpath = f"{root}.rank{rank}{ext}"
    else:
        root = os.path.join(tempfile.gettempdir(), f"hpcdl-mpi-tests-{os.getpid()}")
    global _hang_file
    _hang_file = open(f"{root}.rank{rank}.hang.txt", "w")  # noqa: SIM115 - open for the session
    if rank != 0:  # the other ranks report failures only, so the terminal stays readable
        config.option.verbose = -1
        config.option.reportchars = "fE"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    size = MPI.COMM_WORLD.size
    for item in items:
        low = item.get_closest_marker("min_ranks")
        high = item.get_closest_marker("max_ranks")
        if low and size < low.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs >= {low.args[0]} ranks, have {size}"))
        if high and size > high.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs <= {high.args[0]} ranks, have {size}"))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _hang_file is not None:  # reached only when no watchdog fired: nothing to keep
        _hang_file.close()
        os.unlink(_hang_file.name)


@pytest.fixture(autouse=True)
def _lockstep_and_watchdog(request: pytest.FixtureRequest):
    _hang_file.seek(0)
    _hang_file.truncate()
    _hang_file.write(f"rank {MPI.COMM_WORLD.rank}: {request.node.nodeid} ran longer than "
                     f"{TEST_TIMEOUT_S:g} s (HPCDL_TEST_TIMEOUT); every thread's stack:\n")
    _hang_file.flush()
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=_hang_file)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        MPI.COMM_WORLD.Barrier()


@pytest.fixture
def world() -> MPI.Intracomm:
    return MPI.COMM_WORLD


@pytest.fixture
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One temporary directory that every rank sees (rank 0 creates it, broadcasts the path)."""
    comm = MPI.COMM_WORLD
    path = str(tmp_path_factory.mktemp("shared")) if comm.rank == 0 else None
    return comm.bcast(path, root=0)


@pytest.fixture(scope="module")
def comm():
    """An ``mpi``-backend communicator over the world, one per test module (a module that
    needs another backend or set-up defines its own ``comm``)."""
    import hpcdl.comm

    communicator = hpcdl.comm.init("mpi", MPI.COMM_WORLD)
    yield communicator
    communicator.close()


@pytest.fixture(scope="module")
def make_tiny_shards(tmp_path_factory: pytest.TempPathFactory):
    """``make(train_per_class=16, val_per_class=4, shards=4)``: a 3-class synthetic ImageNet
    tree of 24×20 JPEGs sharded at 20 px by rank 0; every rank gets the shard directory."""

    def make(train_per_class: int = 16, val_per_class: int = 4, shards: int = 4) -> str:
        world = MPI.COMM_WORLD
        path = None
        if world.rank == 0:
            from hpcdl.data_prep.shard import shard_tree
            from hpcdl.data_prep.synthetic import make_imagenet_tree

            root = tmp_path_factory.mktemp("data")
            make_imagenet_tree(str(root / "tree"), num_classes=3,
                               train_per_class=train_per_class, val_per_class=val_per_class,
                               size=(24, 20))
            shard_tree(str(root / "tree"), str(root / "shards"), shards=shards, resize=20)
            path = str(root / "shards")
        return world.bcast(path, root=0)

    return make
