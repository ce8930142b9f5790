"""`mpiexec -n 2 hpcdl train` end to end: a run stopped by SIGUSR1 exits 75 after a checkpoint,
and `--resume auto` ends with exactly the parameters of an uninterrupted run (--deterministic);
a signal after training leaves a completed run's exit code 0.

Serial test that launches its own mpiexec (never nested inside an MPI-launched rank)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from signal_at import SIGNAL_AT

from hpcdl.train.trainer import EXIT_STOPPED_BY_SIGNAL

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_shards, tiny_recipe):
    root = tmp_path_factory.mktemp("cli")
    (root / "shards").symlink_to(tiny_shards, target_is_directory=True)
    (root / "tiny.yaml").symlink_to(tiny_recipe)
    return root


def hpcdl_train(root, run, *extra, signal_at=None):
    """``signal_at=(RANK, WHEN)``: that rank raises SIGUSR1 then (tests/signal_at.py)."""
    hpcdl = [*SIGNAL_AT, *map(str, signal_at)] if signal_at else \
        [sys.executable, "-m", "hpcdl.cli.main"]
    cmd = ["mpiexec", "-n", "2", *hpcdl, "train",
           "--recipe", str(root / "tiny.yaml"), "--data", str(root / "shards"),
           "--out", str(root / run), "--deterministic", "--max-steps", "9", *extra]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "300"}
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    return proc


def finish(proc):
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def summary(root, run):
    return json.load(open(root / run / "summary.json"))


def test_signal_stop_then_resume_matches_uninterrupted_run(setup):
    root = setup
    # The reference and the interrupted run are independent: launch them together.
    reference = hpcdl_train(root, "ref", "--resume", "none")
    # Rank 1 alone is signalled after step 4's agreement: every rank stops at step 5.
    stopped = hpcdl_train(root, "run", signal_at=(1, "step=4"))
    code, out = finish(stopped)
    assert code == EXIT_STOPPED_BY_SIGNAL, out
    assert summary(root, "run")["stopped"] == "signal" and summary(root, "run")["steps"] == 5
    assert os.listdir(root / "run" / "checkpoints") == ["ckpt-000000005.pt"]

    code, out = finish(hpcdl_train(root, "run"))  # --resume auto is the default
    assert code == 0, out
    resumed = summary(root, "run")
    code, out = finish(reference)
    assert code == 0, out
    assert resumed["resumed_from"].endswith("ckpt-000000005.pt")
    assert resumed["steps"] == 9
    # training time of the whole run: this invocation's plus the stopped one's (checkpoint)
    assert resumed["train_s_total"] > resumed["train_s"] > 0
    assert resumed["params_sha256"] == summary(root, "ref")["params_sha256"]
    assert os.path.exists(root / "run" / "config.yaml")
    assert os.path.exists(root / "run" / "logs" / "rank-0001.log")


def test_signal_after_training_ends_the_run_as_completed(setup):
    # Rank 1 is signalled once training has returned: the run's last agreement is over, its
    # final checkpoint written, so nothing is left to requeue for; the rank neither dies of
    # the signal nor exits otherwise than the others, and says what came.
    code, out = finish(hpcdl_train(setup, "late", "--resume", "none", "--max-steps", "2",
                                   signal_at=(1, "after-train")))
    assert code == 0, out
    assert summary(setup, "late")["stopped"] == "max_steps"
    assert "signal SIGUSR1 after the run's last step (max_steps at step 2): nothing left to " \
           "checkpoint, exit 0" in (setup / "late" / "logs" / "rank-0001.log").read_text()


def test_ipex_asked_for_but_missing_says_how_to_get_it(setup):
    pytest.importorskip("mpi4py")
    try:
        import intel_extension_for_pytorch  # noqa: F401
        pytest.skip("IPEX is installed here")
    except ImportError:
        pass
    proc = subprocess.run([sys.executable, "-m", "hpcdl.cli.main", "train", "--recipe",
                           str(setup / "tiny.yaml"), "--data", str(setup / "shards"),
                           "--out", str(setup / "ipex"), "--ipex"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "intel_extension_for_pytorch is not importable" in proc.stderr
    assert "without --ipex" in proc.stderr


def test_recipe_error_exits_2_naming_the_key(setup):
    proc = subprocess.run([sys.executable, "-m", "hpcdl.cli.main", "train", "--recipe",
                           str(setup / "tiny.yaml"), "--data", str(setup / "shards"),
                           "--out", str(setup / "bad"), "batch.per_rnak=3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "batch.per_rnak" in proc.stderr and "tiny.yaml" in proc.stderr


def test_flipped_bytes_in_one_ranks_file_are_named_and_every_rank_takes_the_previous(setup):
    import torch

    root = setup
    code, out = finish(hpcdl_train(root, "flip", "--max-steps", "4", "--checkpoint-every", "2",
                                   "--resume", "none"))
    assert code == 0, out
    rank1 = root / "flip" / "checkpoints" / "ckpt-000000004.pt" / "rank-00001.pt"
    keys = torch.load(rank1, weights_only=True)["numpy"]["keys"].numpy().tobytes()
    data = bytearray(rank1.read_bytes())
    data[data.index(keys) + 100] ^= 0x04  # one bit of rank 1's numpy RNG state
    rank1.write_bytes(bytes(data))
    code, out = finish(hpcdl_train(root, "flip", "--max-steps", "5"))
    assert code == 0, out
    assert f"{rank1} is corrupt: sha256" in out  # found by rank 1, reported by rank 0
    assert summary(root, "flip")["resumed_from"].endswith("ckpt-000000002.pt")
