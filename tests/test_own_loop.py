"""examples/own_loop.py as a user runs it: `mpiexec -n 2 python examples/own_loop.py`, end to
end (its numerics against a single-process reference: tests/mpi/test_own_loop.py).

Serial test; it launches its own mpiexec."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_loop.py"


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_example_trains_on_two_ranks_and_writes_its_model(tmp_path):
    out = tmp_path / "run"
    cmd = ["mpiexec", "-n", "2", sys.executable, str(EXAMPLE), "--steps", "30",
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "240"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0/2" in proc.stderr and "top-1" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["steps"] == 30
    # 30 LARS steps of batch 128: loss 2.30 -> ~1.0 and ~60% top-1 when written; chance is 10%.
    assert summary["last_loss"] < 0.75 * summary["first_loss"], summary
    assert summary["top1"] > 0.3, summary
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["fc.weight"].shape == (10, 32 * 7 * 7)
    assert (out / "logs" / "rank-0001.log").exists()
