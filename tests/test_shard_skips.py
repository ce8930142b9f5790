"""`hpcdl prep shard` on the source files it cannot use: an unreadable file, a decoder that
raises something other than OSError, a malformed LOC_val_solution.csv. Without --strict each is
skipped, counted and named; with --strict the run names it and exits 2, writing no manifest."""
from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import sys

import pytest

from hpcdl.cli.main import main
from hpcdl.data_prep.shard import SkipSample, decode_rgb, shard_tree
from hpcdl.data_prep.synthetic import make_imagenet_tree
from hpcdl.errors import EXIT_BAD_INPUT

FIRST_TRAIN = "train/n01440764/n01440764_0.JPEG"


@pytest.fixture
def tree(tmp_path):
    """A small tree with a flat val/ labelled by LOC_val_solution.csv, free to damage."""
    return make_imagenet_tree(str(tmp_path / "tree"), num_classes=2, train_per_class=3,
                              val_per_class=2, size=(24, 20), val_layout="flat")


def prep_shard(capsys, tree, out, *extra):
    """``hpcdl prep shard`` in this process: (exit code, stdout, stderr)."""
    code = main(["prep", "shard", "--src", tree.root, "--out", str(out), "--shards", "1",
                 "--no-progress", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code, err, out_dir, *needles):
    lines = [line for line in err.splitlines() if line.startswith("hpcdl prep shard")]
    assert code == EXIT_BAD_INPUT, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (out_dir / "manifest.json").exists()


# -- a file that cannot be read ----------------------------------------------------------------
def make_eio(tree) -> str:
    """A source file whose read fails with EIO: a link to /proc/self/mem (a regular file whose
    offset 0 is never mapped), which works even as root, unlike a mode-000 file."""
    if not os.path.exists("/proc/self/mem"):
        pytest.skip("needs /proc/self/mem (Linux) to make a file whose read fails with EIO")
    path = os.path.join(tree.root, FIRST_TRAIN)
    os.unlink(path)
    os.symlink("/proc/self/mem", path)
    return FIRST_TRAIN


def test_a_file_that_fails_with_eio_is_skipped_counted_and_named(capsys, tree, tmp_path):
    key = make_eio(tree)
    code, out, err = prep_shard(capsys, tree, tmp_path / "shards")
    assert code == 0, err
    assert f"skipped {key}: unreadable (Input/output error)" in out
    assert "skipped 1 source file(s)" in out


def test_strict_names_a_file_that_fails_with_eio_and_exits_2(capsys, tree, tmp_path):
    key = make_eio(tree)
    code, _, err = prep_shard(capsys, tree, tmp_path / "shards", "--strict")
    assert_refused(code, err, tmp_path / "shards", key, "unreadable (Input/output error)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file: needs a normal user")
def test_a_file_without_read_permission_is_skipped(tree, tmp_path):
    os.chmod(os.path.join(tree.root, FIRST_TRAIN), 0)
    manifest = shard_tree(tree.root, str(tmp_path / "shards"), shards=1)
    assert {s["key"]: s["reason"] for s in manifest["skipped"]} == {
        FIRST_TRAIN: "unreadable (Permission denied)"}


# -- decoders that raise outside OSError ---------------------------------------------------------
DECODER_ERRORS = [EOFError("no more images"), struct.error("unpack requires a buffer of 4 bytes"),
                  IndexError("list index out of range"), KeyError("tile")]


@pytest.mark.parametrize("error", DECODER_ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("phase", ["open", "load"])
def test_any_exception_of_a_pillow_plugin_makes_the_file_a_skip(monkeypatch, error, phase):
    """Pillow's plugins raise what their parsers meet on crafted bytes (EOFError from a GIF's
    seek, struct.error from a short header, ...): each is the file's fault."""
    from PIL import Image, ImageFile

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(Image, "open", fail) if phase == "open" else \
        monkeypatch.setattr(ImageFile.ImageFile, "load", fail)
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6)).save(buffer, "PNG")
    with pytest.raises(SkipSample, match=f"corrupt .*{type(error).__name__}"):
        decode_rgb(buffer.getvalue(), 256)


def test_a_decoder_error_mid_tree_is_a_skip_not_an_abort(monkeypatch, tree, tmp_path):
    from PIL import Image

    bad = open(os.path.join(tree.root, FIRST_TRAIN), "rb").read()
    real_open = Image.open

    def open_(fp, *args, **kwargs):
        if fp.getvalue() == bad:
            raise struct.error("unpack requires a buffer of 4 bytes")
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", open_)
    manifest = shard_tree(tree.root, str(tmp_path / "shards"), shards=1)
    assert [s["key"] for s in manifest["skipped"]] == [FIRST_TRAIN]
    assert manifest["splits"]["train"]["num_samples"] == 5


# -- LOC_val_solution.csv ------------------------------------------------------------------------
def rewrite_csv(tree, edit) -> str:
    path = os.path.join(tree.root, "LOC_val_solution.csv")
    lines = open(path, encoding="utf-8").read().splitlines()
    with open(path, "wb") as f:
        f.write("\n".join(edit(lines)).encode("utf-8", "surrogateescape") + b"\n")
    return path


def no_class_and_no_id(lines):
    """Row 2 (line 3) keeps its image id but loses its class; a row without an id is added."""
    image_id = lines[2].split(",")[0]
    return [*lines[:2], f"{image_id},", *lines[3:], ",n01440764 1 1 2 2"]


def test_malformed_label_rows_skip_their_images_and_are_named(capsys, tree, tmp_path):
    path = rewrite_csv(tree, no_class_and_no_id)
    code, out, err = prep_shard(capsys, tree, tmp_path / "shards")
    assert code == 0, err
    assert f"skipped val/ILSVRC2012_val_00000002.JPEG: {path} line 3: no class" in out
    assert f"skipped {path} line 6: {path} line 6: no image id" in out
    assert "skipped 2 source file(s) or label row(s)" in out
    assert "val: 3 images" in out


def test_strict_names_the_malformed_label_rows_and_exits_2(capsys, tree, tmp_path):
    path = rewrite_csv(tree, no_class_and_no_id)
    code, _, err = prep_shard(capsys, tree, tmp_path / "shards", "--strict")
    assert_refused(code, err, tmp_path / "shards", "--strict", f"{path} line 3: no class",
                   f"{path} line 6: no image id")


@pytest.mark.parametrize("damage, why", [
    (lambda lines: [lines[0], "ILSVRC2012_val_00000001,\udcff\udcfe", *lines[2:]],
     "not a readable CSV file ('utf-8' codec can't decode"),
    (lambda lines: [*lines, 'ILSVRC2012_val_00000009,"n01440764 1 1 2 2'],
     "not a readable CSV file (unexpected end of data)"),
    (lambda lines: ["Image,Label", *lines[1:]], "expected the header"),
])
def test_a_labels_file_that_is_not_the_csv_exits_2_naming_it(capsys, tree, tmp_path, damage,
                                                             why):
    path = rewrite_csv(tree, damage)
    code, _, err = prep_shard(capsys, tree, tmp_path / "shards")
    assert_refused(code, err, tmp_path / "shards", path, why)


def test_a_devkit_ground_truth_line_that_is_no_id_exits_2_naming_file_and_line(capsys, tree,
                                                                              tmp_path):
    os.unlink(os.path.join(tree.root, "LOC_val_solution.csv"))
    path = os.path.join(tree.root, "ILSVRC2012_validation_ground_truth.txt")
    with open(path, "w") as f:
        f.write("1\n2\nn01440764\n1\n")
    code, _, err = prep_shard(capsys, tree, tmp_path / "shards")
    assert_refused(code, err, tmp_path / "shards", f"{path} line 3: 'n01440764' is not an "
                                                   f"ILSVRC2012_ID")


# -- several ranks: a verdict every rank reached ends cleanly; one rank's error ends the job ------
needs_mpiexec = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


def mpiexec_prep_shard(tree, out, *extra, ranks=2):
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "hpcdl.cli.main", "prep", "shard",
           "--src", tree.root, "--out", str(out), "--shards", "2", "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "120"}
    result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=180)
    return result.returncode, result.stdout


@needs_mpiexec
def test_strict_under_two_ranks_is_one_line_and_exit_2_without_an_abort(tree, tmp_path):
    key = make_eio(tree)
    code, out = mpiexec_prep_shard(tree, tmp_path / "shards", "--strict")
    assert_refused(code, out, tmp_path / "shards", key, "unreadable (Input/output error)")
    assert "MPI_Abort" not in out and "BAD TERMINATION" not in out  # every rank agreed


@needs_mpiexec
def test_one_ranks_own_error_ends_the_job_and_its_line_gets_out(tree, tmp_path):
    out_dir = tmp_path / "shards"
    (out_dir / "train-00001-of-00002.h5").mkdir(parents=True)  # rank 1's shard: cannot rename
    code, out = mpiexec_prep_shard(tree, out_dir)
    lines = [line for line in out.splitlines() if line.startswith("hpcdl prep shard (rank 1): ")]
    assert code == EXIT_BAD_INPUT, out
    assert len(lines) == 1 and "train-00001-of-00002.h5" in lines[0], out
    assert not (out_dir / "manifest.json").exists()


@needs_mpiexec
def test_a_bad_labels_file_under_two_ranks_is_one_line_and_exit_2_without_an_abort(tree,
                                                                                   tmp_path):
    path = rewrite_csv(tree, lambda lines: ["Image,Label", *lines[1:]])
    code, out = mpiexec_prep_shard(tree, tmp_path / "shards")
    assert_refused(code, out, tmp_path / "shards", path, "expected the header")
    assert "MPI_Abort" not in out and "BAD TERMINATION" not in out  # every rank agreed
