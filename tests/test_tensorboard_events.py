"""The run's metrics also as TensorBoard event files beside metrics.jsonl: written by rank 0
only, readable by TensorBoard's own reader, off (one log line) without the package, and
metrics.jsonl unchanged either way."""
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdl.train.metrics import MetricsWriter, read_metrics, truncate_metrics

ROOT = Path(__file__).resolve().parents[1]
TRAIN = {"kind": "train", "step": 10, "epoch": 0, "loss": 2.5, "lr": 0.1, "images_per_s": 80.0,
         "step_s": 0.4, "data_wait_s": 0.01, "comm_wait_s": 0.02, "time": 1_800_000_000.0}
EVAL = {"kind": "eval", "step": 10, "epoch": 1.0, "loss": 1.9, "top1": 0.41, "top5": 0.9,
        "samples": 1000, "time": 1_800_000_010.0}


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard would show for ``run_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[tuple[int, float]]] = {}
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return found


def test_each_numeric_field_of_a_record_is_a_scalar_at_its_step(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard package (hpcdl[tensorboard])")
    with MetricsWriter(str(tmp_path / "metrics.jsonl")) as writer:
        writer.write(TRAIN)
        writer.write(EVAL)
    got = scalars(tmp_path)
    assert got["train/loss"] == [(10, 2.5)]
    assert got["eval/top1"] == [(10, pytest.approx(0.41))]
    assert "train/time" not in got and "train/step" not in got
    assert read_metrics(str(tmp_path / "metrics.jsonl")) == [TRAIN, EVAL]


def test_a_resumed_run_purges_the_events_after_its_resume_step(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard package (hpcdl[tensorboard])")
    path = str(tmp_path / "metrics.jsonl")
    with MetricsWriter(path) as writer:
        for step, loss in ((10, 2.0), (20, 1.5), (30, 1.2)):
            writer.write({**TRAIN, "step": step, "loss": loss})
    truncate_metrics(path, 20)  # what a resume from step 20 does first
    # A resume is a later process: its event file's name (which starts with the second it was
    # made) sorts after the first session's. In one process within one second the names
    # differ only by a counter that TensorBoard sorts as text (``...9`` after ``...10``).
    next_second = int(time.time()) + 1
    while time.time() < next_second:
        time.sleep(next_second - time.time())
    with MetricsWriter(path) as writer:
        writer.write({**TRAIN, "step": 30, "loss": 1.1})
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    # TensorBoard's own loader applies the purge across the two sessions' files
    mux = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "tensorboard"))
    mux.Reload()
    (run,) = mux.Runs()
    assert [(e.step, e.value) for e in mux.Scalars(run, "train/loss")] == \
        [(10, 2.0), (20, 1.5), (30, pytest.approx(1.1))]


def test_without_the_package_event_files_are_off_and_one_line_says_so(tmp_path, monkeypatch,
                                                                       caplog):
    # the import as it fails where tensorboard is not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with caplog.at_level(logging.INFO, logger="hpcdl.train"):
        with MetricsWriter(str(tmp_path / "metrics.jsonl")) as writer:
            writer.write(TRAIN)
    lines = [r.getMessage() for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(lines) == 1 and "hpcdl[tensorboard]" in lines[0], lines
    assert not (tmp_path / "tensorboard").exists()
    assert read_metrics(str(tmp_path / "metrics.jsonl")) == [TRAIN]


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_only_rank_0_of_a_two_rank_run_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard package (hpcdl[tensorboard])")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "hpcdl.cli.main", "demo", "--out",
           str(out), "--max-steps", "4", "--no-progress", "train.log_every_steps=2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events  # one writer: rank 0's
    steps = [r["step"] for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] == "train"]
    assert [s for s, _ in scalars(out)["train/loss"]] == steps
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
