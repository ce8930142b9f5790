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


def test_written_file_gets_umask_permissions_not_mkstemp_0600(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(str(tmp_path / "summary.json"), "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o644


def test_reading_the_umask_never_changes_it(tmp_path, monkeypatch):
    # os.umask(0) then back, as before, left a window in which another thread's open() made
    # 0666 files; reading must not set the process mask at all where Linux shows it.
    if not any(line.startswith("Umask:") for line in open("/proc/self/status")):
        pytest.skip("this kernel's /proc/self/status has no Umask line")
    real_umask = os.umask
    old = real_umask(0o027)
    set_to = []
    monkeypatch.setattr(os, "umask", lambda mask: set_to.append(mask) or real_umask(mask))
    try:
        atomic_write_text(str(tmp_path / "summary.json"), "{}")
    finally:
        real_umask(old)
    assert set_to == []
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o640


def test_removing_what_a_command_created_keeps_a_sibling_run_and_their_parent(tmp_path):
    from hpcdl.io import remove_created_directories

    run = tmp_path / "a" / "b" / "run"
    run.mkdir(parents=True)
    (run / "rank-0000.log").write_text("rejected")
    sibling = tmp_path / "a" / "b" / "other"  # started meanwhile by another run
    sibling.mkdir()
    (sibling / "metrics.jsonl").write_text("{}")
    remove_created_directories(str(run), str(tmp_path / "a"))
    assert not run.exists()
    assert (sibling / "metrics.jsonl").read_text() == "{}"


def test_removing_what_a_command_created_removes_its_empty_parents_up_to_the_first_made(tmp_path):
    from hpcdl.io import remove_created_directories

    run = tmp_path / "a" / "b" / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("x")
    remove_created_directories(str(run), str(tmp_path / "a"))
    assert os.listdir(tmp_path) == []
