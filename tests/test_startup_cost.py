"""What a rank exchanges once at start-up -- the communicator, its compute threads, the stall
watchdog's host list, the trainer's start, ``hpcdl doctor``, LTFB's start -- stays under the
bound docs/scaling.md gives each: the same at 2 and 8 ranks where it must not grow, at most
its stated bytes per rank where it is O(P) by nature. Every MPI call is counted under a real
``mpiexec`` by the bench's forwarding communicator (benchmarks/startup_cost.py); the bounds
are the bench's own table (``BY_NATURE``: the call sites that are O(P) by nature, with their
bytes per rank; every other call site must not grow), so the docs, the bench and this test
state one bound."""
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import startup_cost  # noqa: E402

SMALL, LARGE = 2, 8
#: pickled small integers differ by a byte or two with their value (a rank, a count)
SLACK_B = 16

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    *measured, _ = startup_cost.measure([SMALL, LARGE], str(tmp_path_factory.mktemp("start")))
    return measured


def _site_bytes(run: dict, phase: str, site: str) -> int:
    """The most any rank sent or received at ``site`` in ``phase`` (0 where it made no call)."""
    return max(max(r[phase]["sites"].get(site, {}).get(q, 0) for q in ("sent", "received"))
               for r in run["per_rank"])


def _sites(runs: list[dict], phase: str) -> list[str]:
    return sorted({s for run in runs for r in run["per_rank"] for s in r[phase]["sites"]})


@pytest.mark.parametrize("phase", startup_cost.PHASES)
def test_what_a_rank_exchanges_to_start_does_not_grow_with_the_rank_count(runs, phase):
    # every call site but those O(P) by nature: a new allgather at start-up fails here
    for site in _sites(runs, phase):
        if site in startup_cost.BY_NATURE:
            continue
        small, large = (_site_bytes(r, phase, site) for r in runs)
        assert abs(large - small) <= SLACK_B, \
            f"{phase}: {site}: {small} B at P = {SMALL}, {large} B at P = {LARGE}"


@pytest.mark.parametrize("phase", startup_cost.PHASES)
def test_what_grows_with_the_rank_count_stays_under_its_bound(runs, phase):
    for site in _sites(runs, phase):
        per_rank = startup_cost.BY_NATURE.get(site)
        if per_rank is None:
            continue
        small, large = (_site_bytes(r, phase, site) for r in runs)
        assert large - small <= per_rank * (LARGE - SMALL), \
            f"{phase}: {site}: {small} B at P = {SMALL}, {large} B at P = {LARGE}: more " \
            f"than {per_rank} B a rank"
