"""What `hpcdl doctor` checks across hosts before a job spends its allocation; both probes
bounded in time, so a broken fabric is reported instead of hanging.

- Reach: MPI opens inter-host connections lazily, so a partitioned fabric hangs only at the
  first allreduce. Each host's first rank exchanges one small message with every other host's,
  point-to-point only, polled to a deadline (a collective might route through the broken pair);
  rank 0 learns the hosts (a star) and tells the first ranks their peers. Names unreachable hosts.
- Clocks: after a barrier each rank's wall-clock offset to rank 0 bounds the skew between hosts
  (logs and stall reports compare timestamps across hosts). Run only once every pair answered.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

#: How long each phase of the reach probe waits before naming who did not answer.
REACH_TIMEOUT_S = 20.0
TAG_HOST, TAG_LEADERS, TAG_PROBE, TAG_REPORT = 7301, 7302, 7303, 7304


def poll(requests: dict[Any, Any], timeout_s: float) -> dict[Any, Any]:
    """Wait for mpi4py object requests up to ``timeout_s``: key -> received value (or True
    for a send); keys whose request did not complete are absent."""
    done: dict[Any, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(requests) and time.monotonic() < deadline:
        for key, request in requests.items():
            if key not in done:
                finished, value = request.test()
                if finished:
                    done[key] = True if value is None else value
        time.sleep(0.005)
    return done


def probe_peers(mpi_comm: Any, peers: dict[str, int], timeout_s: float) -> list[str]:
    """Exchange one message with each peer host's first rank; the hosts that did not answer."""
    receives = {host: mpi_comm.irecv(source=rank, tag=TAG_PROBE) for host, rank in peers.items()}
    sends = [mpi_comm.isend(socket.gethostname(), dest=rank, tag=TAG_PROBE)
             for rank in peers.values()]
    answered = poll(receives, timeout_s)
    # Sends to a peer that cannot be reached stay pending; the doctor aborts after reporting.
    del sends
    return sorted(set(peers) - set(answered))


def reach_problems(mpi_comm: Any, timeout_s: float = REACH_TIMEOUT_S,
                   on_unreachable_root: Callable[[str], None] | None = None
                   ) -> dict[str, list[str]] | None:
    """Rank 0: host -> hosts it could not reach (empty when every pair answered). Other ranks:
    None. A rank that cannot hear from rank 0 calls ``on_unreachable_root(message)``."""
    me, size = socket.gethostname(), mpi_comm.size
    if mpi_comm.rank == 0:
        hosts = poll({r: mpi_comm.irecv(source=r, tag=TAG_HOST) for r in range(1, size)},
                     timeout_s)
        hosts[0] = me
        leaders: dict[str, int] = {}
        for rank in sorted(hosts):
            leaders.setdefault(hosts[rank], rank)
        problems = {me: [f"rank {r}" for r in range(size) if r not in hosts]}
        first_ranks = set(leaders.values())
        for rank in range(1, size):
            if rank in hosts:  # the peer list to a host's first rank; to the others, that
                # rank 0 heard them (a list to every rank would be O(P x hosts) from rank 0)
                mpi_comm.isend(leaders if rank in first_ranks else {}, dest=rank,
                               tag=TAG_LEADERS)
        peers = {h: r for h, r in leaders.items() if h != me}
        problems[me] += probe_peers(mpi_comm, peers, timeout_s)
        reports = poll({h: mpi_comm.irecv(source=r, tag=TAG_REPORT)
                        for h, r in peers.items()}, 2 * timeout_s)
        problems.update({host: reports.get(host, []) for host in peers})
        return {h: sorted(set(p)) for h, p in problems.items() if p}
    mpi_comm.isend(me, dest=0, tag=TAG_HOST)
    got = poll({0: mpi_comm.irecv(source=0, tag=TAG_LEADERS)}, 2 * timeout_s)
    if not got:
        if on_unreachable_root is not None:
            on_unreachable_root(f"rank {mpi_comm.rank} on {me} heard nothing from rank 0 "
                                f"within {2 * timeout_s:.0f} s over MPI")
        return None
    leaders = got[0]
    if leaders.get(me) == mpi_comm.rank:
        unreached = probe_peers(mpi_comm, {h: r for h, r in leaders.items() if h != me},
                                timeout_s)
        mpi_comm.isend(unreached, dest=0, tag=TAG_REPORT)
    return None


def describe_unreached(problems: dict[str, list[str]]) -> list[str]:
    """One line per host with a problem: ``h2 cannot reach h3 over MPI within 20 s``."""
    return [f"{host} cannot reach {', '.join(peers)} over MPI within {REACH_TIMEOUT_S:.0f} s"
            for host, peers in sorted(problems.items())]


def probe_clock(mpi_comm: Any) -> float:
    """This rank's wall clock minus rank 0's, read right after a barrier (seconds)."""
    mpi_comm.Barrier()
    now = time.time()
    return now - mpi_comm.bcast(now, root=0)
