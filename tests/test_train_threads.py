"""Compute threads per rank: the cores of its mask shared by the ranks bound to that mask."""
from hpcdl.train.threads import threads_per_rank

SOCKET0 = frozenset(range(0, 24))
SOCKET1 = frozenset(range(24, 48))


def test_one_rank_per_socket_uses_the_socket():
    assert threads_per_rank(SOCKET0, [SOCKET0, SOCKET1]) == (24, False)


def test_unbound_ranks_divide_the_node():
    node = SOCKET0 | SOCKET1
    assert threads_per_rank(node, [node, node]) == (24, False)


def test_two_ranks_bound_to_one_socket_share_it():
    assert threads_per_rank(SOCKET0, [SOCKET0, SOCKET0, SOCKET1, SOCKET1]) == (12, False)


def test_omp_num_threads_can_only_lower_the_count():
    assert threads_per_rank(SOCKET0, [SOCKET0, SOCKET1], env_limit=4) == (4, False)
    assert threads_per_rank(SOCKET0, [SOCKET0, SOCKET1], env_limit=99) == (24, False)


def test_more_ranks_than_cores_is_oversubscribed_with_one_thread_each():
    two = frozenset({0, 1})
    assert threads_per_rank(two, [two] * 4) == (1, True)
