"""Checkpoints: atomic, weights_only-loadable, corrupt files skipped, RNG restored exactly."""
import os
import random

import numpy as np
import pytest
import torch

from hpcdl.train import checkpoint as ckpt


def make_state(step, model=None):
    model = model or torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"format": ckpt.CHECKPOINT_FORMAT, "step": step, "epoch": 0, "batch_in_epoch": step,
            "model": model.state_dict(), "optimizer": opt.state_dict(),
            "rng": [ckpt.rng_state(), ckpt.rng_state()], "world_size": 2}


def test_checkpoint_round_trips_with_weights_only(tmp_path):
    run = str(tmp_path)
    state = make_state(7)
    path = ckpt.checkpoint_path(run, 7)
    ckpt.save_checkpoint(path, state)
    loaded = ckpt.load_checkpoint(path)  # torch.load(weights_only=True) inside
    assert loaded["step"] == 7
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    momentum = loaded["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, state["optimizer"]["state"][0]["momentum_buffer"])


def test_no_temporary_file_is_left_behind(tmp_path):
    ckpt.save_checkpoint(ckpt.checkpoint_path(str(tmp_path), 1), make_state(1))
    assert os.listdir(tmp_path / "checkpoints") == ["ckpt-000000001.pt"]


def test_rng_state_restores_torch_numpy_and_python_streams():
    state = ckpt.rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    ckpt.set_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1])
    assert expected[2] == again[2]


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, caplog):
    run = str(tmp_path)
    ckpt.save_checkpoint(ckpt.checkpoint_path(run, 10), make_state(10))
    newest = ckpt.checkpoint_path(run, 20)
    ckpt.save_checkpoint(newest, make_state(20))
    with open(newest, "r+b") as f:  # a torn write: half a zip file
        f.truncate(os.path.getsize(newest) // 2)
    path, state = ckpt.latest_valid_checkpoint(run)
    assert path == ckpt.checkpoint_path(run, 10) and state["step"] == 10
    assert "ckpt-000000020.pt" in caplog.text


def test_foreign_file_gives_clear_error_naming_it(tmp_path):
    path = str(tmp_path / "other.pt")
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ckpt.CheckpointError, match=r"other\.pt is not an hpcdl checkpoint"):
        ckpt.load_checkpoint(path)


class Payload:
    """An arbitrary pickled object: loading it could run code, so weights_only refuses it."""


def test_pickled_object_is_refused(tmp_path):
    path = str(tmp_path / "evil.pt")
    torch.save({"format": ckpt.CHECKPOINT_FORMAT, "obj": Payload()}, path)
    with pytest.raises(ckpt.CheckpointError, match="evil.pt"):
        ckpt.load_checkpoint(path)


def test_garbage_file_gives_clear_error(tmp_path):
    path = tmp_path / "checkpoints" / "ckpt-000000003.pt"
    path.parent.mkdir()
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="ckpt-000000003.pt is corrupt"):
        ckpt.load_checkpoint(str(path))
    assert ckpt.latest_valid_checkpoint(str(tmp_path)) is None


def test_prune_keeps_the_newest(tmp_path):
    run = str(tmp_path)
    for step in (5, 10, 15, 20):
        ckpt.save_checkpoint(ckpt.checkpoint_path(run, step), make_state(step))
    ckpt.prune_checkpoints(run, keep=2)
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(run)] == [
        "ckpt-000000015.pt", "ckpt-000000020.pt"]


def test_steps_sort_numerically_not_by_name(tmp_path):
    run = str(tmp_path)
    for step in (999, 1000):
        ckpt.save_checkpoint(ckpt.checkpoint_path(run, step), make_state(step))
    assert ckpt.latest_valid_checkpoint(run)[1]["step"] == 1000


def test_elastic_resume_starts_every_rank_from_the_mean_bn_statistics():
    from types import SimpleNamespace

    import torch

    from hpcdl.train.trainer import Trainer

    model = torch.nn.BatchNorm1d(3)
    saved = [{"running_mean": torch.full((3,), float(r)), "running_var": torch.full((3,), 2.0 * r)}
             for r in range(4)]
    Trainer._load_mean_buffers(SimpleNamespace(model=model), saved)
    assert torch.equal(model.running_mean, torch.full((3,), 1.5))
    assert torch.equal(model.running_var, torch.full((3,), 3.0))
