"""Which checkpoint a resume takes, on one rank in this process (`hpcdl train` on the tiny
recipe): the line started last, never a checkpoint of an abandoned run; a checkpoint whose
bytes do not match its sha256 is named and skipped; an unreadable file system stops the run
instead of restarting it from step 0; the single-file format still resumes; temporaries a
kill left behind are removed at start."""
import json
import os
import shutil

import pytest
import torch

from hpcdl.cli.main import main
from hpcdl.errors import EXIT_BAD_INPUT
from hpcdl.train import checkpoint as ckpt

ONE_RANK = ["batch.per_rank=4"]  # the tiny recipe's global batch 4 on one rank


def train(capsys, recipe, data, out, *extra):
    code = main(["train", "--recipe", recipe, "--data", str(data), "--out", str(out),
                 "--no-eval", "--no-progress", "--deterministic", *extra, *ONE_RANK])
    return code, capsys.readouterr().err


def summary(out):
    return json.loads((out / "summary.json").read_text())


def names(out):
    return [os.path.basename(p) for p in ckpt.list_checkpoints(str(out))]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_shards, tiny_recipe):
    """A run with checkpoints at steps 2 and 4 (read-only: copy it)."""
    out = tmp_path_factory.mktemp("two") / "run"
    assert main(["train", "--recipe", tiny_recipe, "--data", tiny_shards, "--out", str(out),
                 "--no-eval", "--no-progress", "--deterministic", "--max-steps", "4",
                 "--checkpoint-every", "2", *ONE_RANK]) == 0
    return out


@pytest.fixture
def run(tmp_path, two_checkpoints):
    return shutil.copytree(two_checkpoints, tmp_path / "run")


def test_a_fresh_start_beside_an_older_run_keeps_its_checkpoint_and_auto_continues_it(
        capsys, run, tiny_shards, tiny_recipe):
    # Before: pruning kept the highest steps, so keep_checkpoints=1 deleted the step-2
    # checkpoint just written, and --resume auto went back to the abandoned run's step 4.
    code, err = train(capsys, tiny_recipe, tiny_shards, run, "--resume", "none",
                      "--max-steps", "2", "train.keep_checkpoints=1")
    assert code == 0, err
    assert names(run) == ["ckpt-000000002.pt", "ckpt-000000004.pt"]
    new_line = ckpt.read_manifest(str(run / "checkpoints" / "ckpt-000000002.pt"))["line"]
    assert ckpt.read_manifest(str(run / "checkpoints" / "ckpt-000000004.pt"))["line"] != new_line
    code, err = train(capsys, tiny_recipe, tiny_shards, run, "--max-steps", "3")
    assert code == 0, err
    assert summary(run)["resumed_from"].endswith("ckpt-000000002.pt")


def test_a_resume_from_an_older_path_starts_a_line_that_auto_then_follows(
        capsys, run, tiny_shards, tiny_recipe):
    older = run / "checkpoints" / "ckpt-000000002.pt"
    code, err = train(capsys, tiny_recipe, tiny_shards, run, "--resume", str(older),
                      "--max-steps", "3", "--checkpoint-every", "3")
    assert code == 0, err
    code, err = train(capsys, tiny_recipe, tiny_shards, run, "--max-steps", "5")
    assert code == 0, err
    assert summary(run)["resumed_from"].endswith("ckpt-000000003.pt")  # not the old step 4


def test_flipped_bytes_in_the_model_are_named_and_the_previous_checkpoint_resumes(
        capsys, run, tiny_shards, tiny_recipe):
    newest = run / "checkpoints" / "ckpt-000000004.pt"
    state = torch.load(newest / "model.pt", weights_only=True)
    weight = max(state["model"].values(), key=lambda t: t.numel() if t.is_floating_point()
                 else 0)
    data = bytearray((newest / "model.pt").read_bytes())
    at = data.index(weight.numpy().tobytes())
    data[at + 5] ^= 0x10  # one bit of one weight
    (newest / "model.pt").write_bytes(bytes(data))
    code, err = train(capsys, tiny_recipe, tiny_shards, run, "--max-steps", "5")
    assert code == 0, err
    assert f"{newest}/model.pt is corrupt: sha256" in err and "(flipped bytes)" in err
    assert summary(run)["resumed_from"].endswith("ckpt-000000002.pt")


def test_checkpoints_that_cannot_be_read_stop_the_run_naming_each_file(
        capsys, run, tiny_shards, tiny_recipe):
    for step in (2, 4):
        model = run / "checkpoints" / f"ckpt-{step:09d}.pt" / "model.pt"
        model.unlink()
        model.symlink_to("/proc/self/mem")  # a read there fails with EIO, as on a sick mount
    code, err = train(capsys, tiny_recipe, tiny_shards, run, "--max-steps", "5")
    assert code == EXIT_BAD_INPUT, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("hpcdl train: ")]
    for step in (2, 4):
        assert f"ckpt-{step:09d}.pt/model.pt: cannot read it (Input/output error" in line
    assert "does not start again from step 0" in line
    assert not (run / "summary.json").exists() or summary(run)["steps"] == 4  # no fresh start


def test_a_single_file_checkpoint_of_the_earlier_format_resumes_bit_identically(
        capsys, tmp_path, run, two_checkpoints, tiny_shards, tiny_recipe):
    for step in (2, 4):  # the run directory as the earlier version left it
        directory = run / "checkpoints" / f"ckpt-{step:09d}.pt"
        state = ckpt.load_checkpoint(str(directory))
        own = torch.load(directory / "rank-00000.pt", weights_only=True)
        legacy = {k: v for k, v in state.items() if k not in ("line", "seq", "time", "bn_mean")}
        legacy.update(format=ckpt.LEGACY_FORMAT, rng=[own])
        shutil.rmtree(directory)
        ckpt.save_checkpoint(str(directory), legacy)
    code, err = train(capsys, tiny_recipe, tiny_shards, run, "--max-steps", "6")
    assert code == 0, err
    from_legacy = summary(run)
    reference = shutil.copytree(two_checkpoints, tmp_path / "reference")
    code, err = train(capsys, tiny_recipe, tiny_shards, reference, "--max-steps", "6")
    assert code == 0, err
    assert from_legacy["resumed_from"].endswith("ckpt-000000004.pt")
    assert from_legacy["params_sha256"] == summary(reference)["params_sha256"]
    assert os.path.isdir(run / "checkpoints" / "ckpt-000000006.pt")  # written as a directory


def test_temporaries_a_kill_left_are_removed_at_start_and_nothing_else(
        capsys, run, tiny_shards, tiny_recipe):
    ckpts = run / "checkpoints"
    (ckpts / ".ckpt-000000006.pt.tmp").mkdir()  # a write killed before its rename
    (ckpts / ".ckpt-000000006.pt.tmp" / "model.pt").write_bytes(b"x" * 1000)
    (ckpts / ".ckpt-000000005.pt.k2j3h4.tmp").write_bytes(b"y" * 1000)  # a single-file one
    (ckpts / "README").write_text("mine")
    code, err = train(capsys, tiny_recipe, tiny_shards, run, "--max-steps", "5")
    assert code == 0, err
    assert sorted(os.listdir(ckpts)) == ["README", "ckpt-000000002.pt", "ckpt-000000004.pt",
                                         "ckpt-000000005.pt"]
