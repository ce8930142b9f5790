"""Every comm backend's sums across real hosts, under each MPI with its own launcher, and the
bytes on each host's eth0 checked against what the algorithm must send (docs/mpi.md, "Several
hosts"). A layout that silently used shared memory between "hosts" sends 0 bytes and fails.
"""
from __future__ import annotations

import pytest
from cluster_hosts import parse_result, require_mpi

MPIS = ["mpich", "impi", "openmpi"]
LAYOUTS = [(2, 1), (2, 2)]  # hosts x ranks per host
BACKENDS = ["mpi", "ring", "shm", "gloo"]
#: Headers on top of the payload: Ethernet + IPv4 + TCP is 66 B per 1,448 B segment when the
#: link segments (4.6%), and the ACKs for what the host receives, 66 B per two segments (2.3%).
HEADER_FRACTION = 0.07
#: The collectives' own small messages (barriers, rendezvous, signatures) around the counted one.
SMALL_MESSAGES = 2**20


def lower_bound(size: int, hosts: int) -> float:
    """Bytes any allreduce must move out of a host: 2(H-1)/H of the buffer (Patarasuk & Yuan
    2009, the bound the ring meets), H hosts each holding the whole buffer."""
    return 2 * (hosts - 1) / hosts * size


def exact_bytes(backend: str, size: int, hosts: int, per_host: int) -> float | None:
    """What ``backend`` sends out of each host, where its algorithm fixes it; None where the
    MPI library chooses (``mpi``, ``gloo``, and ``shm``'s inter-node MPI_Allreduce)."""
    ranks = hosts * per_host
    if backend == "ring":
        # Ranks in order around the ring, hosts contiguous: one ring edge leaves each host,
        # and every edge carries 2(P-1)/P of the buffer.
        return 2 * (ranks - 1) / ranks * size
    if backend == "shm" and per_host > 1:
        # One slice per local rank crosses the network: together one buffer's worth per host,
        # reduced across the H hosts (docs/comm.md, the hierarchical allreduce).
        return lower_bound(size, hosts)
    return None


def host_bytes(entries: list[dict]) -> dict[str, dict]:
    """One counter per host: every rank of a host reads the same eth0."""
    return {e["host"]: e for e in entries}


@pytest.mark.parametrize("hosts,per_host", LAYOUTS, ids=["2x1", "2x2"])
@pytest.mark.parametrize("mpi", MPIS)
def test_backends_sum_right_and_send_what_their_algorithm_must(cluster, mpi, hosts, per_host):
    require_mpi(mpi)
    names = cluster.hosts[:hosts]
    done = cluster.mpirun(mpi, names, per_host, f"{cluster.python(mpi)} "
                          f"tests/cluster/programs/comm_sums.py {','.join(BACKENDS)}")
    result = parse_result(done.stdout)
    assert [r["host"] for r in result["ranks"]] == [h for h in names for _ in range(per_host)]
    assert [r["processor"] for r in result["ranks"]] == [r["host"] for r in result["ranks"]]
    assert {r["local_size"] for r in result["ranks"]} == {per_host}
    for backend in BACKENDS:
        outcome = result["backends"][backend]
        assert outcome["ok"], f"{backend}: max relative error {outcome['max_err']}"
        size = outcome["counted_bytes"]
        exact = exact_bytes(backend, size, hosts, per_host)
        for host, counted in host_bytes(outcome["bytes"]).items():
            sent = counted["tx"]
            assert sent >= lower_bound(size, hosts), f"{backend} on {host}: {sent} B sent"
            if exact is not None:
                assert exact <= sent <= exact * (1 + HEADER_FRACTION) + SMALL_MESSAGES, \
                    f"{backend} on {host}: sent {sent} B, the algorithm sends {exact:.0f} B"
