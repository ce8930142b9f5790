"""The MPI harness itself: the launcher really started several ranks of one world."""
import pytest
from mpi4py import MPI


@pytest.mark.min_ranks(2)
def test_ranks_form_one_world(world):
    ranks = world.allgather(world.rank)
    assert ranks == list(range(world.size))


def test_thread_level_allows_a_communication_thread():
    # The reducer calls MPI from its own thread (one communication thread owns its collectives).
    assert MPI.Query_thread() >= MPI.THREAD_SERIALIZED
