"""Each log interval names the rank the others waited for: ``hpcdl train`` at -n 4 with one
rank slowed once (``HPCDL_INJECT=2:SEQ:sleep=S`` before one of its gradient allreduces), under
a real mpiexec launched from this serial test. The log line is rank 0's, from two tiny
allreduces per interval (hpcdl/debug/stragglers.py)."""
import os
import shutil
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


def test_the_log_names_the_rank_the_others_waited_for(tmp_path, tiny_shards, tiny_recipe):
    cmd = ["mpiexec", "-n", "4", sys.executable, "-m", "hpcdl.cli.main", "train",
           "--recipe", tiny_recipe, "--data", tiny_shards, "--out", str(tmp_path / "run"),
           "--max-steps", "12", "--no-eval", "--checkpoint-every", "0", "batch.per_rank=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "200",
           "HPCDL_INJECT": "2:30:sleep=3"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "straggler (" in line]
    assert lines, out.stderr[-3000:]
    assert any("waited up to" in line and f"for rank 2 on {socket.gethostname()} " in line
               for line in lines), lines
