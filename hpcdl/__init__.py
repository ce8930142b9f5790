"""hpcdl: large-batch ImageNet training on CPU supercomputers with MPI."""
from hpcdl.mpi_library import set_wheel_mpi_root

__version__ = "0.1.0"

# Before anything imports mpi4py.MPI: the Intel MPI wheel needs I_MPI_ROOT under srun.
set_wheel_mpi_root()
