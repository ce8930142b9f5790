"""``ccl``: Intel oneCCL through torch.distributed, when its bindings are installed.

oneCCL is the collective library the Intel CPU clusters of You et al.'s era (Xeon + Omni-Path)
are tuned for. Its PyTorch bindings (``oneccl_bindings_for_pytorch``, pip ``oneccl_bind_pt``)
are optional, archived upstream, and have no wheel for torch 2.13, so hpcdl detects them and
never fakes them: asking for ``ccl`` without them raises :class:`CCLUnavailableError` saying
how to get them.
"""
from __future__ import annotations

import importlib

import torch.distributed as dist

from hpcdl.comm.gloo import GlooCommunicator
from hpcdl.errors import BadInputError

INSTALL_HINT = (
    "the 'ccl' backend needs Intel's oneCCL bindings for PyTorch (import name "
    "oneccl_bindings_for_pytorch, pip package oneccl_bind_pt), which are not installed. They "
    "are optional and archived upstream (github.com/intel/torch-ccl), with no wheel for "
    "torch 2.13. On a cluster: load the site oneAPI/oneCCL module, then build the bindings "
    "matching your torch from source (git clone https://github.com/intel/torch-ccl; "
    "git checkout the tag for your torch; COMPUTE_BACKEND=cpu python setup.py install), or "
    "pip install oneccl_bind_pt from Intel's wheel index for an older torch. Otherwise use "
    "backend 'shm' (single node), 'mpi' or 'auto', which need nothing extra."
)


class CCLUnavailableError(BadInputError, ImportError):
    """The optional oneCCL bindings are missing (bad input: ``hpcdl train`` exits 2)."""


def load_oneccl() -> None:
    """Import the bindings (they register the 'ccl' torch.distributed backend)."""
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
    except ImportError as exc:
        raise CCLUnavailableError(f"{INSTALL_HINT} (import failed: {exc})") from exc


class CCLCommunicator(GlooCommunicator):
    """Same rendezvous as ``gloo``; the process group is oneCCL's."""

    backend = "ccl"

    def __init__(self, *args, **kwargs) -> None:
        load_oneccl()  # before any collective, so every rank fails the same way
        super().__init__(*args, **kwargs)

    def _make_group(self, group_class):
        group_class = getattr(dist, "ProcessGroupCCL", None)
        if group_class is None:
            raise CCLUnavailableError(f"{INSTALL_HINT} (oneccl_bindings_for_pytorch imported "
                                      f"but registered no ProcessGroupCCL)")
        return super()._make_group(group_class)
