"""`hpcdl bench loader --pace`: the step rate it reads from the raw step files, the threads it
derives, the layouts it runs, and a whole run on tiny shards (no timing is asserted)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.bench.pace import (
    layout_cpus,
    pace_ratios,
    rotated,
    step_rate,
)
from hpcdl.errors import BadInputError
from hpcdl.figures.tables import PACE_FILE, RESULTS, pace_cores_covered
from hpcdl.slurm.render import JobSpec
from hpcdl.train.config import DataConfig

ROOT = Path(__file__).resolve().parents[1]
STEP_DIR = ROOT / "docs" / "results" / "bf16-step-vs-plain-torch-2026-12-02"


def test_step_rate_is_the_files_batch_over_its_median_cpu_seconds():
    step = step_rate(str(STEP_DIR / "alexnet_bn-224px-b32.json"))
    raw = json.loads((STEP_DIR / "alexnet_bn-224px-b32.json").read_text())
    assert step["model"] == "alexnet_bn" and step["image_size"] == 224
    assert step["images_per_s_per_core"] == raw["batch"] / raw["variants"]["hpcdl_cl"][
        "median_cpu_s"]


def test_a_float32_step_file_is_refused(tmp_path):
    raw = json.loads((STEP_DIR / "resnet50-112px-b32.json").read_text())
    path = tmp_path / "fp32.json"
    path.write_text(json.dumps({**raw, "precision": "float32"}))
    with pytest.raises(BadInputError, match=r"fp32.json: precision 'float32'"):
        step_rate(str(path))


def test_a_file_that_is_not_a_step_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"bench": "loader", "results": []}))
    with pytest.raises(BadInputError, match=r"other.json: not a step file"):
        step_rate(str(path))


def test_decode_threads_feed_the_cores_left_to_compute():
    # at 45 img/s per core against 1,000 per decode thread, one thread and 22 compute cores
    # (990 img/s) fit in 23 cores, 23 compute cores (1,035 img/s) would not
    assert pace_cores_covered(1, 45.0, 1000.0) == 23
    assert pace_cores_covered(2, 45.0, 1000.0) == 46


def test_the_default_decode_threads_feed_a_skx_templates_rank_at_the_measured_rates():
    report = json.loads((ROOT / RESULTS / PACE_FILE).read_text())
    decode = report["ratios"]["decode_images_per_cpu_s_per_worker"]
    socket = JobSpec.__dataclass_fields__["cores_per_socket"].default
    for step in report["step_rates"]:
        covered = pace_cores_covered(DataConfig().workers, step["images_per_s_per_core"],
                                     decode)
        assert covered >= socket, (step["model"], covered)


def test_decode_threads_per_compute_core_is_step_over_decode():
    records = [{"kind": "decode", "workers": 1, "images_per_cpu_s": r} for r in (900, 1000, 1100)]
    ratios = pace_ratios(records, [{"model": "m", "images_per_s_per_core": 50.0}])
    assert ratios["decode_images_per_cpu_s_per_worker"] == 1000  # the median over repeats
    assert ratios["m_decode_threads_per_compute_core"] == pytest.approx(0.05)
    assert ratios["m_compute_cores_per_decode_thread"] == pytest.approx(20)


def test_the_sizing_needs_a_one_worker_decode_run():
    with pytest.raises(BadInputError, match="must include 1"):
        pace_ratios([{"kind": "decode", "workers": 2, "images_per_cpu_s": 1.0}], [])


def test_layouts_put_one_rank_on_each_core_or_decode_on_the_others():
    assert layout_cpus("shared", [0, 1, 2], 2) == [([0], []), ([1], []), ([2], [])]
    assert layout_cpus("reserved", [0, 1, 2], 2) == [([0], [1, 2])]
    with pytest.raises(BadInputError, match="reserved needs"):
        layout_cpus("reserved", [0, 1], 0)


def test_repeats_run_the_configurations_in_rotated_order():
    assert [rotated([0, 1, 2], r) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1],
                                                         [0, 1, 2]]


def test_a_pace_run_on_tiny_shards_writes_the_sizing_and_the_machine(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "pace.json"
    result = subprocess.run(
        [sys.executable, "-m", "hpcdl.cli.main", "bench", "loader", "--src",
         str(tmp_path / "tree"), "--shards", str(tmp_path / "shards"), "--generate", "100",
         "--num-shards", "2", "--batch", "8", "--image-size", "64",
         "--pace", str(STEP_DIR / "resnet50-112px-b32.json"), "--pace-workers", "1",
         "--pace-seconds", "0.05", "--note", "a test", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["bench"] == "loader-pace" and report["note"] == "a test"
    assert report["machine"]["cpu_capability"] and report["machine"]["cpu"]
    assert len(report["load_average"]["start"]) == 3
    paced = [r for r in report["results"] if r["kind"] == "paced"]
    cores = len(os.sched_getaffinity(0))
    assert [r["ranks"] for r in paced if r["layout"] == "shared"] == [cores]
    # paced ranks pull the step file's batch (32), whatever --batch the decode sweep used
    assert all(rank["steps"] >= 3 and rank["images"] == 32 * rank["steps"]
               for r in paced for rank in r["per_rank"])
    assert "resnet50_decode_threads_per_compute_core" in report["ratios"]


def test_a_bad_step_file_exits_2_in_one_line_before_writing_any_tree(tmp_path, capsys):
    from hpcdl.cli.main import main

    raw = json.loads((STEP_DIR / "resnet50-112px-b32.json").read_text())
    path = tmp_path / "fp32.json"
    path.write_text(json.dumps({**raw, "precision": "float32"}))
    code = main(["bench", "loader", "--src", str(tmp_path / "tree"), "--shards",
                 str(tmp_path / "shards"), "--generate", "10", "--pace", str(path)])
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "precision 'float32'" in err[0], err
    assert not (tmp_path / "tree").exists()
