"""hpcdl report: plots and summary from a run directory's files alone (no MPI)."""
import json
import subprocess
import sys

from hpcdl.train.metrics import MetricsWriter, read_metrics, truncate_metrics, write_summary


def fake_run(run_dir):
    with MetricsWriter(str(run_dir / "metrics.jsonl")) as m:
        for step in range(1, 7):
            m.write({"kind": "train", "step": step, "epoch": 0, "loss": 2.0 / step, "lr": 0.1,
                     "images_per_s": 100.0, "step_s": 0.5, "data_wait_s": 0.1,
                     "comm_wait_s": 0.05})
        m.write({"kind": "eval", "step": 6, "epoch": 1, "loss": 0.5, "top1": 0.8,
                 "top5": 0.99, "samples": 10})
    write_summary(str(run_dir / "summary.json"),
                  {"name": "t", "stopped": "completed", "top1": 0.8, "top5": 0.99, "steps": 6,
                   "total_steps": 6, "epochs": 1, "global_batch": 8, "per_rank_batch": 4,
                   "ranks": 2, "accumulation": 1, "images_per_s": 100.0, "wall_s": 3.0,
                   "comm_wait_s": 0.3, "params_sha256": "ab" * 32})


def test_report_writes_four_plots_and_prints_the_summary(tmp_path):
    fake_run(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "hpcdl.cli.main", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "top-1 0.8000" in proc.stdout
    for name in ("loss", "accuracy", "lr", "throughput"):
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_on_a_directory_without_metrics_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpcdl.cli.main", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "metrics.jsonl" in proc.stderr


def test_torn_last_line_is_skipped_and_resume_truncates_later_steps(tmp_path):
    fake_run(tmp_path)
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"kind": "train", "step": 7, "lo')  # killed mid-write
    assert len(read_metrics(str(path))) == 7
    assert truncate_metrics(str(path), after_step=4) == 3
    assert [json.loads(line)["step"] for line in open(path)] == [1, 2, 3, 4]


def test_summary_shows_measured_top1_against_the_recipes_expected(tmp_path):
    from hpcdl.train.config import load_recipe, write_resolved_config
    from hpcdl.train.report import summarize_run

    fake_run(tmp_path)
    config = load_recipe("alexnet_bvlc_sgd_256")
    write_resolved_config(config, str(tmp_path))
    text = summarize_run(str(tmp_path))
    assert "expected  top-1 0.5710" in text and "measured 0.8000: +22.90 points" in text


def test_summary_without_expected_says_nothing_about_it(tmp_path):
    from hpcdl.train.report import summarize_run

    fake_run(tmp_path)
    (tmp_path / "config.yaml").write_text("name: t\n")
    assert "expected  top-1" not in summarize_run(str(tmp_path))
