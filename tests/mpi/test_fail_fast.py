"""``hpcdl.comm.init()`` installs fail-fast by default and leaves the hooks alone with
``fail_fast=False`` (the job-level behaviour is tests/test_fail_fast.py's)."""
import sys
import threading

import pytest

import hpcdl.comm


@pytest.fixture
def original_hooks():
    saved = (sys.excepthook, threading.excepthook)
    sys.excepthook, threading.excepthook = sys.__excepthook__, threading.__excepthook__
    yield sys.__excepthook__, threading.__excepthook__
    sys.excepthook, threading.excepthook = saved


def test_init_installs_fail_fast_unless_told_not_to(world, original_hooks):
    comm = hpcdl.comm.init("mpi", world, fail_fast=False)
    comm.close()
    assert (sys.excepthook, threading.excepthook) == original_hooks
    comm = hpcdl.comm.init("mpi", world)
    comm.close()
    assert sys.excepthook is not original_hooks[0]
    assert threading.excepthook is not original_hooks[1]
