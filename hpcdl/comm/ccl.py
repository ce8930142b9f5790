"""``ccl``: Intel oneCCL's allreduce, called through its C API with ctypes.

oneCCL 2022+, on tensors' memory: nothing compiled, no torch version tied, and the GIL
dropped during each call so the communication thread overlaps autograd. Loading,
rendezvous, the one-host defaults, summing then scaling by 1/p (the CPU plugin rejects
``onecclAvg``), and what goes through MPI instead: docs/comm.md, "oneCCL on a cluster".
"""
from __future__ import annotations

import ctypes
import os
import socket
from pathlib import Path

import torch

from hpcdl.comm.base import Communicator, numpy_view, scale_
from hpcdl.errors import BadInputError, agree_on, mark_agreed

#: oneCCL's C API library (oneapi/ccl.h). libccl.so.1 is the engine its CPU plugin runs on.
C_API_LIBRARY = "libccl.so.2"
#: sizeof(onecclUniqueId), ONECCL_UNIQUE_ID_BYTES in oneapi/ccl/v2/types.h
UNIQUE_ID_BYTES = 4096
#: onecclDataType_t (oneapi/ccl/v2/types.h)
DATATYPES = {torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
             torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
ONECCL_SUM = 0          # onecclRedOp_t onecclSum
ONECCL_SUCCESS = 0      # onecclResult_t onecclSuccess
#: Set when every rank is on one host and the user did not set them (module docstring).
ONE_HOST_DEFAULTS = {"CCL_KVS_IFACE": "lo", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo",
                     "CCL_ATL_SHM": "1"}

INSTALL_HINT = (
    "load your site's oneCCL (module load ccl, or source oneAPI's setvars.sh: they set "
    "CCL_ROOT), or assemble oneCCL 2022.2 from PyPI with tests/ccl_env.sh and eval its output "
    "(docs/comm.md, 'oneCCL on a cluster'); otherwise use backend 'shm' (one node), 'mpi' or "
    "'auto', which need nothing extra"
)


class CCLUnavailableError(BadInputError, ImportError):
    """oneCCL's C API library is missing or unusable (bad input: ``hpcdl train`` exits 2)."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("data", ctypes.c_char * UNIQUE_ID_BYTES)]


def unique_id_to_bytes(uid: _UniqueId) -> bytes:
    """All ``UNIQUE_ID_BYTES`` of ``uid``. Not ``uid.data``: ctypes reads a ``c_char`` array
    field as a C string, cut at its first NUL byte, and an id is binary."""
    return bytes(uid)


def unique_id_from_bytes(raw: bytes) -> _UniqueId:
    """The id rank 0 sent, after checking that all of it arrived (a short buffer would be
    read past its end by a copy of ``UNIQUE_ID_BYTES``)."""
    if len(raw) != ctypes.sizeof(_UniqueId):
        raise RuntimeError(f"ccl: received a oneCCL unique id of {len(raw)} bytes, expected "
                           f"{ctypes.sizeof(_UniqueId)} (ranks run different oneCCL builds?)")
    return _UniqueId.from_buffer_copy(raw)


def library_path() -> str:
    """Where ``libccl.so.2`` is opened from: ``$CCL_ROOT/lib`` when CCL_ROOT is set, else the
    bare name, which the dynamic loader looks up on ``LD_LIBRARY_PATH`` and ld.so's cache."""
    root = os.environ.get("CCL_ROOT")
    if not root:
        return C_API_LIBRARY
    path = Path(root) / "lib" / C_API_LIBRARY
    if not path.is_file():
        raise CCLUnavailableError(
            f"the 'ccl' backend needs oneCCL's C API library {C_API_LIBRARY}, which is not in "
            f"CCL_ROOT={root} (no {path}; oneCCL 2022 or later has it); {INSTALL_HINT}")
    return str(path)


def find_library() -> str | None:
    """Where ``libccl.so.2`` would be opened from, without opening it (opening reads oneCCL's
    environment for good): ``$CCL_ROOT/lib``, else a directory on ``LD_LIBRARY_PATH``."""
    root = os.environ.get("CCL_ROOT")
    dirs = [Path(root) / "lib"] if root else [
        Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for directory in dirs:
        if (directory / C_API_LIBRARY).is_file():
            return str(directory / C_API_LIBRARY)
    return None


def missing_reason() -> str | None:
    """None when :func:`find_library` finds oneCCL, else one line saying what is missing and
    how to get it (for the bench, the doctor and tests that skip)."""
    if find_library() is not None:
        return None
    root = os.environ.get("CCL_ROOT")
    where = f"not in CCL_ROOT={root}/lib" if root else "CCL_ROOT is unset and it is not on " \
                                                        "LD_LIBRARY_PATH"
    return (f"oneCCL's {C_API_LIBRARY} not found ({where}): module load ccl, or "
            f"eval \"$(tests/ccl_env.sh)\" to assemble it from PyPI (docs/comm.md)")


_library: ctypes.CDLL | None = None


def load_oneccl() -> ctypes.CDLL:
    """Open oneCCL's C API once per process and declare the functions hpcdl calls. A loader
    without its CPU plugin (``libccl_legacy_cpu.so``) or transport opens fine and answers
    ``onecclGetVersion``; that shows at ``onecclGetUniqueId``, reported the same way."""
    global _library
    if _library is not None:
        return _library
    path = library_path()
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # first, global: see docstring
    except OSError as exc:
        where = ("CCL_ROOT is not set and it is not on LD_LIBRARY_PATH"
                 if path == C_API_LIBRARY else "opening it failed")
        raise CCLUnavailableError(
            f"the 'ccl' backend needs oneCCL's C API library {C_API_LIBRARY}: {where} "
            f"({exc}); {INSTALL_HINT}") from exc
    _declare(lib)
    version = ctypes.c_int()
    _check(lib, lib.onecclGetVersion(ctypes.byref(version)), "onecclGetVersion", unusable=True)
    _library = lib
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types from oneapi/ccl.h, so ctypes passes size_t and pointers at full width."""
    ptr, size_t, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    lib.onecclGetVersion.argtypes = [ctypes.POINTER(c_int)]
    lib.onecclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
    lib.onecclCommInitRank.argtypes = [ctypes.POINTER(ptr), size_t, _UniqueId, c_int]
    lib.onecclAllReduce.argtypes = [ptr, ptr, size_t, c_int, c_int, ptr, ptr]
    lib.onecclBroadcast.argtypes = [ptr, ptr, size_t, c_int, c_int, ptr, ptr]
    lib.onecclCommFinalize.argtypes = [ptr]
    lib.onecclCommDestroy.argtypes = [ptr]
    lib.onecclGetErrorString.argtypes = [c_int]
    lib.onecclGetErrorString.restype = ctypes.c_char_p
    for name in ("onecclGetVersion", "onecclGetUniqueId", "onecclCommInitRank",
                 "onecclAllReduce", "onecclBroadcast", "onecclCommFinalize",
                 "onecclCommDestroy"):
        getattr(lib, name).restype = c_int


def oneccl_version() -> str:
    """``2022.2.0`` for the loaded library (onecclGetVersion's code is MAJOR*10000+MINOR*100
    +PATCH)."""
    lib, code = load_oneccl(), ctypes.c_int()
    _check(lib, lib.onecclGetVersion(ctypes.byref(code)), "onecclGetVersion")
    major, rest = divmod(code.value, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _check(lib: ctypes.CDLL, result: int, call: str, unusable: bool = False) -> None:
    if result == ONECCL_SUCCESS:
        return
    text = (lib.onecclGetErrorString(result) or b"?").decode(errors="replace")
    if unusable:  # the library opened but cannot work: the user's install, not our call
        raise CCLUnavailableError(
            f"oneCCL's {C_API_LIBRARY} opened but {call} failed ({result}: {text}): it could "
            f"not load its CPU plugin (libccl_legacy_cpu.so and libccl.so.1 belong beside "
            f"it) or its transport (CCL_ATL_TRANSPORT=ofi needs libfabric.so.1 on "
            f"LD_LIBRARY_PATH, e.g. the MPI's lib directory; or set CCL_ATL_TRANSPORT=mpi); "
            f"CCL_LOG_LEVEL=info shows what it tried; {INSTALL_HINT}")
    raise RuntimeError(f"oneCCL {call} failed: {result} ({text}); rerun with "
                       f"CCL_LOG_LEVEL=info for oneCCL's own account")


def set_one_host_defaults() -> dict[str, str]:
    """Keep one host's oneCCL traffic on loopback and shared memory (module docstring);
    returns what was set. Must run before the library is first loaded."""
    applied = {k: v for k, v in ONE_HOST_DEFAULTS.items() if k not in os.environ}
    os.environ.update(applied)
    return applied


class CCLCommunicator(Communicator):
    """oneCCL's allreduce and broadcast on flat CPU buffers; topology and checks from MPI."""

    backend = "ccl"
    sends_bf16 = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ccl_comm = ctypes.c_void_p()
        self._wire: torch.Tensor | None = None
        try:
            self._lib = self._load_on_every_rank()
            self._ccl_comm = self._init_oneccl_comm()
        except BaseException:
            super().close()  # frees the MPI duplicates; collective like the load above
            raise

    def _load_on_every_rank(self) -> ctypes.CDLL:
        """Load on each rank, then agree: a rank whose host lacks oneCCL fails every rank
        with its message (hpcdl.errors.agree_on), instead of leaving them in CommInitRank."""
        hosts = self._comm.allgather(socket.gethostname())
        applied = (set_one_host_defaults() if _library is None and len(set(hosts)) == 1
                   else {})
        error, lib = None, None
        try:
            lib = load_oneccl()
        except CCLUnavailableError as exc:
            error = exc
            for key in applied:  # no oneCCL: leave the environment as it was
                os.environ.pop(key, None)
        try:
            agree_on(self._comm, error)
        except CCLUnavailableError:
            raise
        except BadInputError as exc:  # another rank's message: still a missing oneCCL here
            raise mark_agreed(CCLUnavailableError(str(exc))) from exc
        return lib

    def _init_oneccl_comm(self) -> ctypes.c_void_p:
        uid = _UniqueId()
        result = ONECCL_SUCCESS
        if self.rank == 0:
            result = self._lib.onecclGetUniqueId(ctypes.byref(uid))
        result, raw = self._comm.bcast((result, unique_id_to_bytes(uid)), root=0)
        _check(self._lib, result, "onecclGetUniqueId", unusable=True)  # same on every rank
        uid = unique_id_from_bytes(raw)
        comm = ctypes.c_void_p()
        _check(self._lib, self._lib.onecclCommInitRank(ctypes.byref(comm), self.size, uid,
                                                       self.rank), "onecclCommInitRank")
        return comm

    # -- the algorithm (oneCCL's) -------------------------------------------------------------
    def _allreduce(self, buffer: torch.Tensor, average: bool) -> None:
        if self.wire_dtype is not None and buffer.dtype == torch.float32:
            wire = self._wire_buffer(buffer.numel())
            wire.copy_(buffer)  # round to bf16 once; oneCCL sums bf16 pairwise
            self._allreduce_in_place(wire)
            buffer.copy_(wire)
        else:
            self._allreduce_in_place(buffer)
        if average:
            scale_(numpy_view(buffer), self.size)

    def _allreduce_in_place(self, buffer: torch.Tensor) -> None:
        address = buffer.data_ptr()
        _check(self._lib, self._lib.onecclAllReduce(
            address, address, buffer.numel(), DATATYPES[buffer.dtype], ONECCL_SUM,
            self._ccl_comm, None), "onecclAllReduce")

    def _broadcast(self, buffer: torch.Tensor, root: int) -> None:
        address = buffer.data_ptr()
        _check(self._lib, self._lib.onecclBroadcast(
            address, address, buffer.numel(), DATATYPES[buffer.dtype], root, self._ccl_comm,
            None), "onecclBroadcast")

    def barrier(self) -> None:
        """A one-element oneCCL allreduce: no rank returns before every rank has entered
        (the C API has no barrier, like NCCL's)."""
        token = torch.zeros(1, dtype=torch.int32)
        self._collective("barrier", {}, lambda: self._allreduce_in_place(token))

    def _wire_buffer(self, numel: int) -> torch.Tensor:
        if self._wire is None or self._wire.numel() < numel:
            self._wire = torch.empty(numel, dtype=torch.bfloat16)
        return self._wire[:numel]

    def _close_backend(self) -> None:
        if self._ccl_comm.value:
            _check(self._lib, self._lib.onecclCommFinalize(self._ccl_comm), "onecclCommFinalize")
            _check(self._lib, self._lib.onecclCommDestroy(self._ccl_comm), "onecclCommDestroy")
        self._ccl_comm = ctypes.c_void_p()
        self._wire = None
