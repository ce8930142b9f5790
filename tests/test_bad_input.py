"""The bad-input matrix of docs/debugging.md, one test per case: ``hpcdl train`` (and ``hpcdl
plan``, ``hpcdl prep``) given bad input prints one line ``hpcdl CMD: what is wrong ... what to
do``, exits 2, shows no traceback, leaves what was already written in place, and leaves no
directory it created.

Single-rank cases call the command in this process (MPI as a singleton: no launcher start-up
per case); the cases where ranks matter launch a real ``mpiexec -n 2`` from this serial test
(never nested inside an MPI-launched pytest). tests/mpi/test_bad_input.py checks that ranks
that see different things still take one decision."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import pytest

from hpcdl.cli.main import main
from hpcdl.errors import EXIT_BAD_INPUT
from hpcdl.train.checkpoint import (
    CheckpointMismatchError,
    check_compatible,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
)

needs_mpiexec = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
ONE_RANK = ["batch.per_rank=4"]  # the tiny recipe's global batch 4 on one rank
FIRST_CHECKPOINT = "ckpt-000000002.pt"


def train(capsys, recipe, data, out, *extra, overrides=ONE_RANK):
    """``hpcdl train`` in this process: (exit code, stderr)."""
    code = main(["train", "--recipe", recipe, "--data", str(data), "--out", str(out),
                 "--no-eval", "--no-progress", *extra, *overrides])
    return code, capsys.readouterr().err


def assert_one_line(code, err, *needles):
    lines = [line for line in err.splitlines() if line.startswith("hpcdl train: ")]
    assert code == EXIT_BAD_INPUT, err
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def shards(tmp_path, tiny_shards):
    """A copy of the tiny shards this test may damage."""
    return shutil.copytree(tiny_shards, tmp_path / "shards")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_shards, tiny_recipe):
    """A one-rank run stopped at step 2 with its checkpoint (read-only: copy it to resume)."""
    out = tmp_path_factory.mktemp("first") / "run"
    code = main(["train", "--recipe", tiny_recipe, "--data", tiny_shards, "--out", str(out),
                 "--no-eval", "--no-progress", "--max-steps", "2", "--checkpoint-every", "2",
                 *ONE_RANK])
    assert code == 0
    assert [os.path.basename(p) for p in list_checkpoints(str(out))] == [FIRST_CHECKPOINT]
    return out


@pytest.fixture
def resumable(tmp_path, first_run):
    return shutil.copytree(first_run, tmp_path / "run")


# -- --data ------------------------------------------------------------------------------------
def test_missing_data_directory(capsys, tmp_path, tiny_recipe):
    code, err = train(capsys, tiny_recipe, tmp_path / "nowhere", tmp_path / "out")
    assert_one_line(code, err, f"--data {tmp_path / 'nowhere'}: no such directory",
                    "hpcdl prep shard")


def test_empty_data_directory(capsys, tmp_path, tiny_recipe):
    (tmp_path / "empty").mkdir()
    code, err = train(capsys, tiny_recipe, tmp_path / "empty", tmp_path / "out")
    assert_one_line(code, err, "the directory is empty", "hpcdl prep shard")


# -- the manifest ------------------------------------------------------------------------------
def test_corrupt_manifest_is_named_as_the_manifest_not_the_recipe(capsys, tmp_path, shards,
                                                                  tiny_recipe):
    (shards / "manifest.json").write_text('{"format_version": 1, "shards": [')
    code, err = train(capsys, tiny_recipe, shards, tmp_path / "out")
    line = assert_one_line(code, err, f"manifest {shards / 'manifest.json'} is unreadable or "
                                      f"corrupt", "re-shard")
    assert tiny_recipe not in line


def test_too_new_manifest_says_to_upgrade(capsys, tmp_path, shards, tiny_recipe):
    manifest = json.loads((shards / "manifest.json").read_text())
    (shards / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    code, err = train(capsys, tiny_recipe, shards, tmp_path / "out")
    assert_one_line(code, err, "shard format 99, this hpcdl reads format 1", "upgrade hpcdl")


# -- shards ------------------------------------------------------------------------------------
def test_truncated_shard_is_caught_at_open_by_its_size(capsys, tmp_path, shards, tiny_recipe):
    shard = shards / "train-00001-of-00002.h5"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    code, err = train(capsys, tiny_recipe, shards, tmp_path / "out")
    assert_one_line(code, err, f"shard {shard}: {size // 2} bytes, the manifest records "
                               f"{size}", f"hpcdl prep verify {shards}")
    assert not (tmp_path / "out" / "checkpoints").exists()  # stopped before training


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_bit_flipped_shard_is_caught_by_verify_shards(capsys, tmp_path, shards, tiny_recipe):
    shard = shards / "train-00000-of-00002.h5"
    flip_byte(shard, shard.stat().st_size // 2)  # same size: only the checksum can tell
    code, err = train(capsys, tiny_recipe, shards, tmp_path / "out", "--verify-shards")
    assert_one_line(code, err, f"shard {shard}: sha256", "differs from the manifest",
                    f"hpcdl prep verify {shards}")


def test_shard_unreadable_when_read_is_named_not_a_bare_hdf5_error(shards):
    from hpcdl.data import ShardedImageNet
    from hpcdl.data.format import ShardError

    shard = shards / "train-00000-of-00002.h5"
    flip_byte(shard, 0)  # the HDF5 signature: the size check passes, opening fails
    loader = ShardedImageNet(str(shards), batch_size=2, image_size=16, workers=1)
    with pytest.raises(ShardError, match=f"shard {shard} is unreadable.*hpcdl prep verify"):
        next(iter(loader))
    loader.close()


# -- labels and samples against the model -----------------------------------------------------
def test_manifest_of_another_class_count_than_the_recipe_stops_before_step_1(capsys, tmp_path,
                                                                             shards,
                                                                             tiny_recipe):
    code, err = train(capsys, tiny_recipe, shards, tmp_path / "out",
                      overrides=[*ONE_RANK, "model.num_classes=5"])
    assert_one_line(code, err, f"manifest {shards / 'manifest.json'} has 3 classes",
                    "model.num_classes is 5")
    assert not (tmp_path / "out").exists()  # stopped before training: nothing left


def set_label(shard, row, label):
    """Rewrite one stored label in place: the file keeps its size (the open-time check
    passes), only --verify-shards' sha256 would tell."""
    size = os.path.getsize(shard)
    with h5py.File(shard, "r+") as f:
        f["labels"][row] = label
    assert os.path.getsize(shard) == size


@pytest.mark.parametrize("label", [-100, 3])  # the loss's ignore index; the class count
def test_a_label_outside_the_classes_is_named_with_its_shard_and_sample(shards, label):
    from hpcdl.data import ShardedImageNet
    from hpcdl.data.format import ShardError

    shard = shards / "train-00001-of-00002.h5"
    set_label(shard, 2, label)
    loader = ShardedImageNet(str(shards), batch_size=2, image_size=16, workers=1)
    with pytest.raises(ShardError, match=rf"shard {shard}: label {label} of sample 2 is outside "
                                         rf"0\.\.2 \(the manifest's 3 classes"):
        for _ in loader:
            pass
    loader.close()


def test_a_sample_that_does_not_decode_is_named_with_its_shard_and_index(shards):
    from hpcdl.data import ShardedImageNet
    from hpcdl.data.format import ShardError

    shard = shards / "train-00000-of-00002.h5"
    with h5py.File(shard, "r") as f:
        stored = f["images"][4].tobytes()
    data = shard.read_bytes()
    assert data.count(stored) == 1
    at = data.index(stored)
    shard.write_bytes(data[:at] + bytes(16) + data[at + 16:])  # same size, JPEG header gone
    loader = ShardedImageNet(str(shards), batch_size=2, image_size=16, workers=1)
    with pytest.raises(ShardError, match=rf"shard {shard}: sample 4 does not decode "
                                         rf"\(ValueError: .*hpcdl prep verify"):
        for _ in loader:
            pass
    loader.close()


# -- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("override, differs", [
    ("model.width=8", "model.width=4 (this run: 8)"),
    ("name=another", "recipe 'tiny' (this run: 'another')"),
])
def test_checkpoint_of_another_model_or_recipe_is_refused(capsys, resumable, tiny_shards,
                                                          tiny_recipe, override, differs):
    code, err = train(capsys, tiny_recipe, tiny_shards, resumable, "--max-steps", "4",
                      overrides=[*ONE_RANK, override])
    line = assert_one_line(code, err, f"checkpoint {resumable / 'checkpoints' / FIRST_CHECKPOINT}"
                           , "is from another run", differs, "--resume none")
    assert "global batch" not in line
    assert load_checkpoint(str(resumable / "checkpoints" / FIRST_CHECKPOINT))["step"] == 2


def test_checkpoint_of_another_global_batch_is_refused(capsys, resumable, tiny_shards,
                                                       tiny_recipe):
    code, err = train(capsys, tiny_recipe, tiny_shards, resumable, "--max-steps", "4",
                      overrides=["batch.global=8", "batch.per_rank=8"])
    assert_one_line(code, err, "global batch 4 (this run: 8)", "--resume none")


def test_resume_none_starts_fresh_beside_a_foreign_checkpoint(capsys, resumable, tiny_shards,
                                                              tiny_recipe):
    code, err = train(capsys, tiny_recipe, tiny_shards, resumable, "--max-steps", "1",
                      "--resume", "none", overrides=[*ONE_RANK, "model.width=8"])
    assert code == 0, err


def test_another_rank_count_is_compatible_but_not_another_model():
    import torch

    state = {"recipe": "r", "global_batch": 64, "world_size": 8,
             "model_config": {"name": "m", "width": 4}, "model": {"w": torch.zeros(2, 3)}}
    check_compatible(state, "c.pt", recipe="r", global_batch=64,
                     model_config={"name": "m", "width": 4}, model_state={"w": torch.ones(2, 3)})
    older = {k: v for k, v in state.items() if k != "model_config"}  # predates model_config
    with pytest.raises(CheckpointMismatchError, match=r"1 of another shape \(w \(2, 3\) vs "
                                                      r"\(3, 3\)\)"):
        check_compatible(older, "c.pt", recipe="r", global_batch=64, model_config=None,
                         model_state={"w": torch.ones(3, 3)})


# -- names, accelerators, the run directory ------------------------------------------------------
def test_unknown_model(capsys, tmp_path, tiny_shards, tiny_recipe):
    code, err = train(capsys, tiny_recipe, tiny_shards, tmp_path / "out",
                      overrides=[*ONE_RANK, "model.name=resnet_nope"])
    assert_one_line(code, err, tiny_recipe, "model.name='resnet_nope' is not a known model",
                    "known:")


def test_unknown_backend(capsys, tmp_path, tiny_shards, tiny_recipe):
    code, err = train(capsys, tiny_recipe, tiny_shards, tmp_path / "out", "--backend", "nccl")
    assert_one_line(code, err, "unknown comm backend 'nccl'", "choose auto or one of")


def test_ccl_backend_without_oneccl_says_how_to_get_it(capsys, monkeypatch, tmp_path,
                                                       tiny_shards, tiny_recipe):
    import hpcdl.comm.ccl

    monkeypatch.setattr(hpcdl.comm.ccl, "_library", None)  # as in a process without oneCCL
    monkeypatch.setenv("CCL_ROOT", str(tmp_path / "no-oneccl"))
    code, err = train(capsys, tiny_recipe, tiny_shards, tmp_path / "out", "--backend", "ccl")
    assert_one_line(code, err, "libccl.so.2", f"CCL_ROOT={tmp_path / 'no-oneccl'}",
                    "tests/ccl_env.sh")


def test_ipex_without_ipex_says_how_to_get_it(capsys, tmp_path, tiny_shards, tiny_recipe):
    if _importable("intel_extension_for_pytorch"):
        pytest.skip("IPEX is installed here")
    code, err = train(capsys, tiny_recipe, tiny_shards, tmp_path / "out", "--ipex")
    assert_one_line(code, err, "--ipex: intel_extension_for_pytorch is not importable",
                    "without --ipex")


def _importable(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_unwritable_out(capsys, tmp_path, tiny_shards, tiny_recipe):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # (permissions would not stop root; this does)
    code, err = train(capsys, tiny_recipe, tiny_shards, blocker / "run")
    assert_one_line(code, err, f"--out {blocker / 'run'}: cannot write there",
                    "choose a directory you can write")
    assert blocker.read_text() == "not a directory"


def test_debug_log_level_adds_the_traceback(capsys, tmp_path, tiny_recipe):
    code, err = train(capsys, tiny_recipe, tmp_path / "nowhere", tmp_path / "out",
                      "--log-level", "debug")
    assert code == EXIT_BAD_INPUT
    assert "Traceback" in err and "ManifestMissingError" in err


# -- several ranks -----------------------------------------------------------------------------
def mpiexec_train(recipe, data, out, *extra, ranks=2, script=None, timeout=240, env=None):
    entry = [script] if script else ["-m", "hpcdl.cli.main"]
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, *entry, "train", "--recipe", recipe,
           "--data", str(data), "--out", str(out), "--no-eval", "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": str(timeout), **(env or {})}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@needs_mpiexec
def test_every_rank_stops_on_bad_input_and_rank_0_prints_one_line(tmp_path, shards,
                                                                  tiny_recipe):
    (shards / "manifest.json").write_text("garbage")
    code, out = finish(mpiexec_train(tiny_recipe, shards, tmp_path / "out"))
    assert_one_line(code, out, "manifest", "is unreadable or corrupt")
    assert "MPI_Abort" not in out and "BAD TERMINATION" not in out  # a clean exit, every rank


@needs_mpiexec
def test_a_class_count_mismatch_is_agreed_and_every_rank_exits_2_cleanly(tmp_path, shards,
                                                                        tiny_recipe):
    code, out = finish(mpiexec_train(tiny_recipe, shards, tmp_path / "out",
                                     "model.num_classes=1000"))
    assert_one_line(code, out, f"manifest {shards / 'manifest.json'} has 3 classes",
                    "model.num_classes is 1000")
    assert "MPI_Abort" not in out and "BAD TERMINATION" not in out  # agreed: no abort


@needs_mpiexec
def test_a_shard_unreadable_mid_run_aborts_the_job_with_exit_2_naming_it(tmp_path, shards,
                                                                         tiny_recipe):
    shard = shards / "train-00000-of-00002.h5"
    flip_byte(shard, 0)  # passes the size check at open; the first read of it fails
    code, out = finish(mpiexec_train(tiny_recipe, shards, tmp_path / "out", "--max-steps", "4"))
    lines = [line for line in out.splitlines() if line.startswith("hpcdl train: rank ")]
    assert code == EXIT_BAD_INPUT, out
    assert lines and all(f"shard {shard} is unreadable" in line for line in lines), out
    assert "hpcdl prep verify" in lines[0] and "Traceback" not in out


@needs_mpiexec
def test_ltfb_resume_of_another_global_batch_is_refused_on_every_rank(tmp_path, first_run,
                                                                      tiny_shards, tiny_recipe):
    run = tmp_path / "ltfb"
    for trainer in ("trainer-00", "trainer-01"):  # both trainers hold a step-2 checkpoint
        shutil.copytree(first_run / "checkpoints", run / trainer / "checkpoints")
    code, out = finish(mpiexec_train(tiny_recipe, tiny_shards, run, "--algorithm", "ltfb",
                                     "--trainers", "2", "--max-steps", "4",
                                     "batch.global=2", "batch.per_rank=2"))
    assert_one_line(code, out, "LTFB resume from step 2", "global batch 4 (this run: 2)",
                    "--resume none")


#: ``hpcdl train`` with a file-size limit (``ulimit -f``) on rank 0, the checkpoint writer,
#: set once MPI is up (MPI's own shared-memory files must not meet it).
SIZE_LIMITED = """
import os, resource, sys
from mpi4py import MPI
from hpcdl.cli.main import main

if MPI.COMM_WORLD.rank == 0:
    limit = int(os.environ["FILE_SIZE_LIMIT"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.exit(main(sys.argv[1:]))
"""


@needs_mpiexec
def test_disk_full_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, resumable,
                                                                    tiny_shards, tiny_recipe):
    script = tmp_path / "size_limited.py"
    script.write_text(SIZE_LIMITED)
    size = sum(f.stat().st_size for f in (resumable / "checkpoints" / FIRST_CHECKPOINT).iterdir())
    # Every file may grow to half a checkpoint: logs and metrics fit, the next checkpoint not.
    code, out = finish(mpiexec_train(tiny_recipe, tiny_shards, resumable, "--max-steps", "4",
                                     "--checkpoint-every", "2", script=str(script),
                                     env={"FILE_SIZE_LIMIT": str(size // 2)}))
    line = assert_one_line(code, out, "rank 0 could not write checkpoint",
                           "ckpt-000000004.pt: [Errno 27] File too large",
                           f"the previous checkpoint {resumable / 'checkpoints' / FIRST_CHECKPOINT}"
                           f" is intact", "--resume auto")
    assert "rank 1" not in line
    assert sorted(os.listdir(resumable / "checkpoints")) == [FIRST_CHECKPOINT]  # no temp file
    assert load_checkpoint(str(resumable / "checkpoints" / FIRST_CHECKPOINT))["step"] == 2


#: ``hpcdl train``, with rank 0 pausing inside the write of the step-4 checkpoint (the bytes
#: are in the temporary file, not yet renamed) so that the test can kill a rank right then.
SLOW_WRITER = """
import os, sys, time
from mpi4py import MPI
import hpcdl.train.checkpoint as ckpt
from hpcdl.cli.main import main

real_atomic_write = ckpt.atomic_write
marker = os.environ["WRITING_MARKER"]
with open(f"{marker}.pid{MPI.COMM_WORLD.rank}", "w") as f:
    f.write(str(os.getpid()))

def atomic_write(path, write):
    def write_then_pause(f):
        write(f)
        if "ckpt-000000004.pt" in path:  # its manifest, the last part written
            f.flush()
            open(marker, "w").close()
            time.sleep(120)
    real_atomic_write(path, write_then_pause)

ckpt.atomic_write = atomic_write
sys.exit(main(sys.argv[1:]))
"""


@needs_mpiexec
def test_rank_killed_while_rank_0_writes_a_checkpoint_leaves_the_previous_one(
        capsys, tmp_path, resumable, tiny_shards, tiny_recipe):
    script = tmp_path / "slow_writer.py"
    script.write_text(SLOW_WRITER)
    marker = tmp_path / "writing"
    proc = mpiexec_train(tiny_recipe, tiny_shards, resumable, "--max-steps", "6",
                         "--checkpoint-every", "2", script=str(script),
                         env={"WRITING_MARKER": str(marker)})
    deadline = time.monotonic() + 180
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), finish(proc)[1]
    os.kill(int((tmp_path / "writing.pid1").read_text()), signal.SIGKILL)
    code, out = finish(proc)
    assert code != 0, out
    # the half-written step 4 never took a checkpoint's name; step 2 is what resume finds
    assert [os.path.basename(p) for p in list_checkpoints(str(resumable))] == [FIRST_CHECKPOINT]
    path, state = latest_valid_checkpoint(str(resumable))
    assert state["step"] == 2
    code, err = train(capsys, tiny_recipe, tiny_shards, resumable, "--max-steps", "3")
    assert code == 0, err
    assert json.loads((resumable / "summary.json").read_text())["resumed_from"] == path


def test_a_diverging_run_ends_with_the_non_finite_exit_code_naming_the_step(
        capsys, tmp_path, tiny_shards, tiny_recipe):
    """Not bad input but its neighbour: lr 1e30 overflows the weights, and ``hpcdl train``
    returns EXIT_NONFINITE_LOSS with the step in the log, not a traceback."""
    from hpcdl.train.trainer import EXIT_NONFINITE_LOSS

    code, err = train(capsys, tiny_recipe, tiny_shards, tmp_path / "run", "--max-steps", "6",
                      overrides=[*ONE_RANK, "schedule.base_lr=1e30",
                                 "schedule.warmup_epochs=0"])
    assert code == EXIT_NONFINITE_LOSS, err
    assert "non-finite" in err.lower() and "at step" in err and "Traceback" not in err, err


# -- a rejected command leaves no directory it created ----------------------------------------
@pytest.mark.parametrize("case", ["no data", "unknown model", "corrupt manifest"])
def test_rejected_train_removes_the_out_directory_it_created(capsys, tmp_path, shards,
                                                             tiny_recipe, case):
    data, overrides = shards, ONE_RANK
    if case == "no data":
        data = tmp_path / "nowhere"
    elif case == "unknown model":
        overrides = [*ONE_RANK, "model.name=resnet_nope"]
    else:
        (shards / "manifest.json").write_text("garbage")
    out = tmp_path / "new-parent" / "run"
    code, err = train(capsys, tiny_recipe, data, out, overrides=overrides)
    assert_one_line(code, err)
    assert not (tmp_path / "new-parent").exists()  # the parent it made too


def test_rejected_train_keeps_a_sibling_run_started_in_the_parent_it_made(
        capsys, tmp_path, tiny_recipe, monkeypatch):
    import hpcdl.train.config

    parent, sibling = tmp_path / "new-parent", tmp_path / "new-parent" / "other-run"
    real_load = hpcdl.train.config.load_recipe

    def sibling_starts_meanwhile(*args, **kwargs):  # after this command saw new-parent missing
        sibling.mkdir(parents=True)
        (sibling / "metrics.jsonl").write_text("{}")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(hpcdl.train.config, "load_recipe", sibling_starts_meanwhile)
    code, err = train(capsys, tiny_recipe, tmp_path / "nowhere", parent / "run")
    assert_one_line(code, err)
    assert not (parent / "run").exists()
    assert (sibling / "metrics.jsonl").read_text() == "{}"


def test_rejected_train_keeps_an_out_directory_that_existed(capsys, tmp_path, tiny_recipe):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = train(capsys, tiny_recipe, tmp_path / "nowhere", out)
    assert_one_line(code, err)
    assert (out / "notes.txt").read_text() == "mine"


# -- hpcdl plan and hpcdl prep: the same one line and exit 2 ------------------------------------
def command_line(capsys, command, *argv):
    """(exit code, the one ``hpcdl COMMAND`` line on stderr) of ``hpcdl COMMAND ARGV``."""
    code = main([command.split()[0], *command.split()[1:], *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"hpcdl {command}")]
    assert code == EXIT_BAD_INPUT, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_plan_with_an_unknown_recipe_exits_2_naming_it(capsys):
    line = command_line(capsys, "plan", "--recipe", "no_such_recipe")
    assert "no_such_recipe" in line and "shipped:" in line


def test_plan_with_a_bad_recipe_key_exits_2_naming_the_file(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\noptimizer: {name: lars}\nschedule: {name: poly}\n"
                      "model: {name: alexnet_bn}\nbatch: {global: 32768}\nepochs: 100\n"
                      "comm: {algorithm: telepathy}\n")
    line = command_line(capsys, "plan", "--recipe", str(recipe))
    assert str(recipe) in line and "telepathy" in line


def test_plan_on_an_unknown_machine_exits_2_naming_it(capsys):
    assert "unknown machine 'bluegene'" in command_line(capsys, "plan", "--machine", "bluegene")


def test_prep_shard_of_a_missing_tree_exits_2_and_creates_nothing(capsys, tmp_path):
    out = tmp_path / "new-parent" / "shards"
    line = command_line(capsys, "prep shard", "--src", str(tmp_path / "no-tree"), "--out",
                        str(out), "--shards", "2", "--no-progress")
    assert str(tmp_path / "no-tree") in line
    assert not (tmp_path / "new-parent").exists()


def test_prep_verify_without_a_manifest_exits_2(capsys, tmp_path):
    assert str(tmp_path) in command_line(capsys, "prep verify", str(tmp_path))


def test_prep_stage_of_missing_shards_exits_2(capsys, tmp_path):
    line = command_line(capsys, "prep stage", "--shards", str(tmp_path / "none"), "--to",
                        str(tmp_path / "local"))
    assert str(tmp_path / "none") in line


@pytest.mark.parametrize("argv, named", [
    (["bench", "allreduce", "--repeats", "3"], "--repeats 3"),
    (["bench", "relaxed", "--runs", "nope"], "'nope'"),
    (["bench", "convergence", "--study", "--grid", "0,1"], "--grid"),
])
def test_a_bench_given_bad_arguments_exits_2_with_one_line_naming_them(capsys, argv, named):
    """Every command's bad input is exit 2 and one line (the benches once exited 1)."""
    assert main(argv) == EXIT_BAD_INPUT
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("hpcdl bench:")]
    assert len(lines) == 1 and named in lines[0], lines


@pytest.mark.parametrize("argv, named", [
    (["bench", "allreduce", "--sizes", "1M,lots"], "'LOTS'"),
    (["bench", "allreduce", "--sizes", "0"], "'0' is under one fp32 element"),
    (["bench", "optim", "--model", "resnet_nope"], "--model 'resnet_nope'"),
    (["bench", "convergence", "--model", "resnet_nope"], "--model 'resnet_nope'"),
    (["bench", "loader", "--src", "/nonexistent-tree", "--shards", "/nonexistent-shards"],
     "--src /nonexistent-tree: no train/ folder"),
])
def test_a_bench_given_a_bad_value_exits_2_before_any_work(capsys, argv, named):
    """These exited 1 with a traceback (a size, a model, a tree), some after preparing data."""
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("hpcdl bench:")]
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in err, err


def test_a_bench_given_a_missing_fashion_mnist_source_exits_2_naming_it(capsys, tmp_path):
    code = main(["bench", "convergence", "--source", str(tmp_path / "no-idx"), "--out",
                 str(tmp_path / "out"), "--runs", "baseline", "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err
    lines = [ln for ln in err.splitlines() if ln.startswith("hpcdl bench:")]
    assert len(lines) == 1 and str(tmp_path / "no-idx") in lines[0], err


def slurm_render(data, *extra):
    return ["--arch", "generic", "--nodes", "2", "--recipe", "resnet50_lars_8k", "--data",
            str(data), *extra]


def test_slurm_render_of_an_impossible_job_exits_2(capsys, tiny_shards):
    line = command_line(capsys, "slurm render", *slurm_render(tiny_shards, "--nodes", "0"))
    assert "--nodes 0" in line


def test_slurm_render_to_an_unwritable_output_exits_2_naming_it(capsys, tmp_path,
                                                               tiny_shards):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = command_line(capsys, "slurm render", *slurm_render(
        tiny_shards, "--out", str(tmp_path / "run"), "--output", str(blocker / "job.sbatch")))
    assert f"--output: cannot write {blocker / 'job.sbatch'}" in line


@pytest.mark.parametrize("case", ["batch", "directory", "machine file"])
def test_plan_calibrate_with_bad_input_exits_2_before_measuring(capsys, tmp_path, case):
    machines = tmp_path / "machines"
    argv = ["--calibrate", "--quick", "--machines-dir", str(machines)]
    if case == "batch":
        argv += ["--batch-per-rank", "0"]
        named = "--batch-per-rank 0"
    elif case == "directory":
        machines.write_text("not a directory")
        named = f"cannot write {machines}"
    else:
        machines.mkdir()
        (machines / "local.yaml").write_text("- just\n- a list\n")
        named = f"{machines / 'local.yaml'} is not a machine file"
    assert named in command_line(capsys, "plan", *argv)
