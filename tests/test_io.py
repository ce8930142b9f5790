import os

import pytest

from hpcdl.io import atomic_write, atomic_write_text


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write_text(str(path), "old")
    atomic_write_text(str(path), "new")
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["a.txt"]


def test_failed_write_keeps_previous_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write_text(str(path), "old")

    def explode(f):
        f.write(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(str(path), explode)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.txt"]
