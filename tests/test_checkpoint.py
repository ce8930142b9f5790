"""Checkpoints: a directory of parts committed by one rename and checked by sha256, the
single-file format still read, corrupt files skipped, lines and temporaries, RNG restored."""
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
    return {"format": ckpt.LEGACY_FORMAT, "step": step, "epoch": 0, "batch_in_epoch": step,
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
    torch.save({"format": ckpt.LEGACY_FORMAT, "obj": Payload()}, path)
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


# -- the checkpoint directory: parts, manifest last, sha256 ----------------------------------
def write_directory(run, step, ranks=2, line="a", seq=None, model=None):
    """A checkpoint directory as the trainer writes one: model.pt, a file per rank, the
    manifest last, one rename."""
    model = model or torch.nn.Linear(3, 2)
    path = ckpt.checkpoint_path(run, step)
    tmp = ckpt.begin_write(path)
    files = {ckpt.SHARED: ckpt.write_part(tmp, ckpt.SHARED, {"model": model.state_dict()})}
    for r in range(ranks):
        files[ckpt.rank_file(r)] = ckpt.write_part(tmp, ckpt.rank_file(r),
                                                   {"rank": r, **ckpt.rng_state()})
    ckpt.commit(tmp, path, {"step": step, "epoch": 0, "batch_in_epoch": step,
                            "world_size": ranks, "line": line,
                            "seq": step if seq is None else seq, "files": files})
    return path, model


def flip_byte_inside(path, needle):
    """Flip one bit of the first occurrence of ``needle`` (a tensor's raw bytes) in ``path``."""
    data = bytearray(open(path, "rb").read())
    at = data.index(needle)
    data[at + len(needle) // 2] ^= 0x01
    open(path, "wb").write(data)


def test_a_checkpoint_directory_round_trips_and_leaves_no_temporary(tmp_path):
    path, model = write_directory(str(tmp_path), 7)
    assert sorted(os.listdir(path)) == ["manifest.json", "model.pt", "rank-00000.pt",
                                        "rank-00001.pt"]
    assert os.listdir(tmp_path / "checkpoints") == ["ckpt-000000007.pt"]
    state = ckpt.load_checkpoint(path)
    assert state["step"] == 7 and torch.equal(state["model"]["weight"], model.weight)
    ckpt.verify_checkpoint(path)  # every part against its sha256


def test_a_flipped_byte_inside_a_tensor_names_the_file_and_the_previous_checkpoint_is_used(
        tmp_path, caplog):
    run = str(tmp_path)
    write_directory(run, 10)
    newest, model = write_directory(run, 20, model=torch.nn.Linear(64, 8))
    torch.load(os.path.join(newest, "model.pt"), weights_only=True)  # loads fine...
    flip_byte_inside(os.path.join(newest, "model.pt"), model.weight.detach().numpy().tobytes())
    torch.load(os.path.join(newest, "model.pt"), weights_only=True)  # ...and still does
    with pytest.raises(ckpt.CheckpointError, match=r"ckpt-000000020\.pt/model\.pt is corrupt: "
                                                   r"sha256 .* \(flipped bytes\)"):
        ckpt.load_checkpoint(newest)
    path, state = ckpt.latest_valid_checkpoint(run)
    assert state["step"] == 10 and "ckpt-000000020.pt/model.pt is corrupt" in caplog.text


def test_a_flipped_byte_in_a_rank_file_or_the_manifest_is_caught(tmp_path):
    path, _ = write_directory(str(tmp_path), 3)
    manifest = ckpt.read_manifest(path)
    rank1 = os.path.join(path, "rank-00001.pt")
    keys = torch.load(rank1, weights_only=True)["numpy"]["keys"]
    flip_byte_inside(rank1, keys.numpy().tobytes())
    with pytest.raises(ckpt.CheckpointError, match=r"rank-00001\.pt is corrupt: sha256"):
        ckpt.read_part(path, "rank-00001.pt", manifest["files"]["rank-00001.pt"])
    text = open(os.path.join(path, "manifest.json")).read()
    open(os.path.join(path, "manifest.json"), "w").write(text.replace('"step": 3', '"step": 4'))
    with pytest.raises(ckpt.CheckpointError, match=r"manifest\.json is corrupt: its content "
                                                   r"does not match its sha256"):
        ckpt.read_manifest(path)


def test_a_write_killed_before_the_manifest_is_no_checkpoint_and_its_temporary_goes(tmp_path):
    run = str(tmp_path)
    write_directory(run, 2)
    killed = ckpt.begin_write(ckpt.checkpoint_path(run, 4))  # parts written, never committed
    ckpt.write_part(killed, ckpt.SHARED, {"model": {}})
    torn = tmp_path / "checkpoints" / ".ckpt-000000006.pt.x1y2z3.tmp"  # atomic_write's
    torn.write_bytes(b"half")
    keep = [tmp_path / "checkpoints" / name for name in ("notes.txt", ".ckpt-7.txt")]
    for other in keep:
        other.write_text("not a temporary of a checkpoint write")
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(run)] == ["ckpt-000000002.pt"]
    assert ckpt.latest_valid_checkpoint(run)[1]["step"] == 2
    removed = ckpt.remove_stale_temporaries(run)
    assert removed == [".ckpt-000000004.pt.tmp", ".ckpt-000000006.pt.x1y2z3.tmp"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [".ckpt-7.txt", "ckpt-000000002.pt",
                                                            "notes.txt"]


def test_pruning_keeps_the_current_lines_newest_by_write_order_not_the_highest_steps(tmp_path):
    run = str(tmp_path)
    for step, seq in ((100, 0), (200, 1)):  # an earlier line reached step 200
        write_directory(run, step, line="old", seq=seq)
    for step, seq in ((2, 2), (4, 3)):      # then a new line started from step 0
        write_directory(run, step, line="new", seq=seq)
    pruned = ckpt.prune_checkpoints(run, keep=1, line="new")
    ckpt.remove_pruned(pruned)
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(run)] == [
        "ckpt-000000004.pt", "ckpt-000000100.pt", "ckpt-000000200.pt"]
    assert ckpt.latest_valid_checkpoint(run)[1]["step"] == 4  # auto follows the new line
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.endswith(".tmp")]


def test_resume_auto_follows_the_line_started_last_even_before_its_first_checkpoint(tmp_path):
    run = str(tmp_path)
    write_directory(run, 8, line="old", seq=0)
    assert ckpt.current_line(run)["line"] == "old"
    line = ckpt.start_line(run, None)  # --resume none beside the old line
    assert ckpt.current_line(run) == {"line": line, "from": None}
    assert ckpt.latest_valid_checkpoint(run) is None  # not the abandoned line's step 8
    write_directory(run, 2, line=line, seq=1)
    ckpt.line_recorded(run)
    assert ckpt.latest_valid_checkpoint(run)[1]["step"] == 2
    assert not (tmp_path / "checkpoints" / ".line.json").exists()


def test_an_unreadable_part_is_a_transient_error_naming_the_file(tmp_path):
    path, _ = write_directory(str(tmp_path), 5)
    model = os.path.join(path, "model.pt")
    os.unlink(model)
    os.symlink("/proc/self/mem", model)  # reading its first page fails with EIO
    with pytest.raises(ckpt.CheckpointError, match=r"model\.pt: cannot read it "
                                                   r"\(Input/output error, errno 5\)") as info:
        ckpt.load_checkpoint(path)
    assert info.value.transient


def test_a_line_started_from_an_older_checkpoint_resumes_from_it_until_its_own_first(tmp_path):
    run = str(tmp_path)
    older, _ = write_directory(run, 4, line="old", seq=0)
    write_directory(run, 8, line="old", seq=1)
    ckpt.start_line(run, older)  # --resume PATH of step 4, killed before its next checkpoint
    assert [e.path for e in ckpt.resume_candidates(run)] == [older]
    assert ckpt.latest_valid_checkpoint(run)[1]["step"] == 4  # not the abandoned step 8
