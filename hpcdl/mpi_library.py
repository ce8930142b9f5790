"""Which MPI implementation mpi4py loaded, and which launcher started this process.

The collectives never branch on it; the doctor's pinning advice, the sbatch templates' launcher
and the matrix tests do (docs/mpi.md). Both answers need no MPI initialisation:
``MPI_Get_library_version`` (MPI-3.0 §8.1.1) names the library, the launcher's environment
(Hydra's ``MPI_LOCALNRANKS``, PRRTE's ``PRTE_*``, Slurm's ``SLURM_STEP_ID``) the launcher.
"""
from __future__ import annotations

import glob
import os
import re
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = ["FLAVORS", "NETMOD_SETTINGS", "RANK_ENV", "WORLD_SIZE_ENV", "MpiLibrary", "identify",
           "launched_rank", "launched_world_size", "launcher_of", "loaded_library",
           "mpich_netmod_for_slurm_pmi1", "set_wheel_mpi_root"]

#: flavor -> name as users say it. "mpich" covers MPICH-derived builds we do not single out.
FLAVORS = {"impi": "Intel MPI", "openmpi": "Open MPI", "mpich": "MPICH",
           "mvapich": "MVAPICH", "cray-mpich": "Cray MPICH", "unknown": "unknown MPI"}

# (flavor, pattern with the version as group 1), most specific first: Intel MPI, MVAPICH and
# Cray MPICH derive from MPICH and some of their strings say "MPICH" too.
_PATTERNS = (
    ("impi", r"Intel\(R\) MPI Library (\S+)"),
    ("cray-mpich", r"CRAY MPICH version (\S+)"),
    ("mvapich", r"MVAPICH2? Version\s*:?\s*(\S+)"),
    ("openmpi", r"Open MPI v(\S+?),?\s"),
    ("mpich", r"MPICH Version:\s*(\S+)"),
)


@dataclass(frozen=True)
class MpiLibrary:
    """``flavor``: a key of :data:`FLAVORS`; ``version`` as the library prints it."""

    flavor: str
    version: str
    text: str  # the first line of MPI_Get_library_version, whitespace collapsed

    @property
    def name(self) -> str:
        return FLAVORS[self.flavor]

    def __str__(self) -> str:
        return f"{self.name} {self.version}".rstrip()


def identify(library_version: str) -> MpiLibrary:
    """Parse ``MPI.Get_library_version()`` ('Intel(R) MPI Library 2021.13 for Linux* OS',
    'Open MPI v5.0.11, package: ...', 'MPICH Version:      5.0.2 ...')."""
    library_version = library_version.replace("\x00", "")  # Open MPI's ends in a NUL
    text = " ".join(library_version.split())
    first = " ".join(library_version.strip().splitlines()[0].split()) if text else ""
    for flavor, pattern in _PATTERNS:
        match = re.search(pattern, text, re.IGNORECASE)
        if match:
            return MpiLibrary(flavor, match.group(1).rstrip(","), first)
    return MpiLibrary("unknown", "", first)


def loaded_library(initialize: bool = True) -> MpiLibrary:
    """The library mpi4py is linked to. ``initialize=False`` (a process that names the library
    and exits: ``hpcdl doctor --mpi-flavor``) imports mpi4py.MPI without MPI_Init."""
    import mpi4py

    if not initialize and "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from mpi4py import MPI

    return identify(MPI.Get_library_version())


#: The world size and the rank each launcher gives its ranks (PMI: Hydra and srun --mpi=pmi2;
#: Open MPI; PMIx; MVAPICH; Cray PALS). Slurm's SLURM_NTASKS is not one: a batch script
#: outside any launch has it too.
WORLD_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE",
                  "PALS_SIZE")
RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
            "PALS_RANKID")


def _first_number(env: Mapping[str, str], keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        value = env.get(key, "")
        if value.isdigit():
            return int(value)
    return default


def launched_world_size(env: Mapping[str, str] = os.environ) -> int:
    """Ranks the launcher started (1 when run without one), with no MPI initialisation."""
    return _first_number(env, WORLD_SIZE_ENV, 1)


def launched_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank as its launcher says (0 when run without one)."""
    return _first_number(env, RANK_ENV, 0)


def launcher_of(env: Mapping[str, str]) -> str:
    """What started this rank, from the environment a launcher gives its ranks:
    "hydra" (MPICH's / Intel MPI's mpiexec), "prterun" (Open MPI 5's mpirun), "srun",
    "ompi-mpirun" (Open MPI 4's orterun) or "unknown". The MPI launchers' own variables are
    asked first: inside Slurm their proxies start with srun, so ranks carry Slurm's too."""
    if "MPI_LOCALNRANKS" in env:
        return "hydra"
    if any(key.startswith("PRTE_") for key in env):
        return "prterun"
    if "OMPI_COMM_WORLD_SIZE" in env and "ORTE_HNP_URI" not in env and any(
            key.startswith("OMPI_MCA_orte_") for key in env):
        return "ompi-mpirun"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return "srun"
    return "unknown"


def set_wheel_mpi_root(env: MutableMapping[str, str] = os.environ,
                       prefix: str = sys.prefix) -> str | None:
    """Point Intel MPI at the tuning files of the ``impi-rt`` wheel in this environment.

    Intel MPI reads its tuning tables from ``$I_MPI_ROOT``, which nothing sets under ``srun``
    (MPI_Init then spins forever: docs/mpi.md). Called before mpi4py starts MPI; a value the
    user set is kept. Returns the value it set, if any.
    """
    if env.get("I_MPI_ROOT") or not glob.glob(os.path.join(prefix, "opt", "mpi", "etc",
                                                              "tuning_*.dat")):
        return None
    env["I_MPI_ROOT"] = prefix
    return prefix


#: The most bytes of one PMI-1 request Slurm's ``--mpi=pmi2`` plugin takes: it reads a request
#: with one read() of this size and parses the rest as a new request.
SLURM_PMI1_READ_BYTES = 1024
#: The environment variables that choose MPICH's network module, in the order MPICH reads them
NETMOD_SETTINGS = ("MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD", "MPIR_PARAM_CH4_NETMOD")


def mpich_netmod_for_slurm_pmi1(library_version: str,
                                env: MutableMapping[str, str] = os.environ) -> str | None:
    """Under ``srun --mpi=pmi2``, set MPICH's network module to ``ofi`` when it was built with
    both ``ucx`` and ``ofi`` and nobody chose one; return what it set, if anything.

    MPICH speaks the PMI-1 wire protocol to Slurm, whose plugin reads at most
    :data:`SLURM_PMI1_READ_BYTES` of a request. MPICH's UCX module publishes a 4,096-byte
    address in 511-byte segments, hex-encoded with runs of zero bytes shortened, so a segment
    with few zero bytes (what the address's unused bytes hold decides) makes a request longer
    than that: MPI_Init hangs in some jobs and not others (seen on the test cluster's hosts).
    The OFI module's address is 16 bytes. Hydra's ``mpiexec`` reads whole lines and needs
    none of this; a build with UCX only has no way out under srun but Hydra.
    """
    if identify(library_version).flavor != "mpich" or launcher_of(env) != "srun":
        return None
    if env.get("SLURM_MPI_TYPE") != "pmi2" or any(key in env for key in NETMOD_SETTINGS):
        return None
    device = re.search(r"MPICH Device:\s*(.*)", library_version)
    netmods = set(re.findall(r"\w+", device.group(1))) if device else set()
    if not {"ucx", "ofi"} <= netmods:
        return None
    env["MPIR_CVAR_CH4_NETMOD"] = "ofi"
    return "ofi"
