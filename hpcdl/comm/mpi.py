"""``mpi``: the MPI library's own MPI_Allreduce, in place, on numpy views of torch memory.

The baseline a user would otherwise pick; on a cluster it is the vendor's tuned algorithm
(MPICH/Intel MPI pick recursive doubling, Rabenseifner or ring by message size).
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from hpcdl.comm.base import Communicator, numpy_view, scale_


class MPICommunicator(Communicator):
    backend = "mpi"

    def _allreduce(self, buffer: torch.Tensor, average: bool) -> None:
        array = numpy_view(buffer)
        self._call(self._comm, "Allreduce", MPI.IN_PLACE, array, op=MPI.SUM)
        if average:
            scale_(array, self.size)
