"""HPCDL_INJECT is a rehearsal tool: a run it acts on says so on rank 0 at start, once."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpcdl.debug.inject import describe_injection

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,said", [
    ("1:5:raise", "rank 1 raises before its collective #5"),
    ("0:3:sleep=30", "rank 0 sleeps 30 s before its collective #3"),
    ("0:checkpoint2:sleep=4", "rank 0 pauses 4 s inside checkpoint write #2"),
    ("1:exit:sleep=8", "rank 1 sleeps 8 s before MPI_Finalize"),
])
def test_each_kind_of_injection_is_described_in_words(text, said):
    assert describe_injection(text) == said


SCRIPT = textwrap.dedent("""
    import hpcdl.comm
    from hpcdl.debug import watch_collectives
    comm = hpcdl.comm.init("mpi")
    watch_collectives(comm)  # a second monitor (as the trainer installs): still one warning
    comm.close()
""")


def test_a_communicator_with_hpcdl_inject_set_warns_once_naming_what_it_will_do(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HPCDL_INJECT": "3:7:raise"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "HPCDL_INJECT" in line]
    assert said == ["HPCDL_INJECT='3:7:raise' is set: rank 3 raises before its collective #7 "
                    "(a rehearsed fault, docs/debugging.md); unset HPCDL_INJECT unless this "
                    "run is a rehearsal"], out.stderr


def test_without_hpcdl_inject_nothing_is_said(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "HPCDL_INJECT"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HPCDL_INJECT" not in out.stderr
