"""The job script frees the node-local disk on any exit but a requeue: staged shards (full
ImageNet is ~140 GB per node) must not outlive a failed job. Run under the stub launchers of
tests/test_slurm_render.py, whose srun runs the program it is given: ``rm -rf`` really runs."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_slurm_render import job, run_under_stubs  # noqa: F401 - job is a fixture

from hpcdl.slurm.render import CHECKPOINT_EXIT, render_job

FAIL_STAGE = """#!/bin/bash
# hpcdl, except that `prep stage` copies part of a shard into --to and fails (a full disk)
if [ "$1 $2" = "prep stage" ]; then
    while [ $# -gt 0 ] && [ "$1" != --to ]; do shift; done
    mkdir -p "$2" && echo partial > "$2/train-00000-of-00004.h5"
    exit 1
fi
exec "{stubs}/hpcdl" "$@"
"""


@pytest.fixture
def staged(tmp_path) -> Path:
    """What an earlier step of the job staged on this node."""
    local = tmp_path / "local" / "hpcdl-shards-4242"
    local.mkdir(parents=True)
    (local / "train-00000-of-00004.h5").write_bytes(b"shard")
    return local


def run_job(job, tmp_path, **env):  # noqa: F811 - the fixture, passed on
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(job).script)
    return run_under_stubs(script, tmp_path, HPCDL_DOCTOR="0", **env)


def removals(calls) -> list[list[str]]:
    return [c for c in calls if c[0] == "srun" and c[-3:-1] == ["rm", "-rf"]]


def test_failed_training_removes_the_staged_shards(job, tmp_path, staged):  # noqa: F811
    rc, calls = run_job(job, tmp_path, STUB_TRAIN_EXIT="3")
    assert rc == 3  # still the job's exit
    assert [c[-1] for c in removals(calls)] == [str(staged)]
    assert "--ntasks-per-node=1" in removals(calls)[0]  # once on every node
    assert not staged.exists()


def test_failed_staging_removes_its_partial_copy(job, tmp_path):  # noqa: F811
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    (wrap / "hpcdl").write_text(FAIL_STAGE.replace("{stubs}", str(tmp_path / "bin")))
    (wrap / "hpcdl").chmod(0o755)
    rc, calls = run_job(job, tmp_path, PATH=f"{wrap}:{tmp_path / 'bin'}:/usr/bin:/bin")
    local = tmp_path / "local" / "hpcdl-shards-4242"
    assert rc == 1
    assert not [c for c in calls if c[:2] == ["hpcdl", "train"]]
    assert [c[-1] for c in removals(calls)] == [str(local)]
    assert not local.exists() and (tmp_path / "local").is_dir()  # only the job's own folder


def test_a_successful_run_removes_them_too(job, tmp_path, staged):  # noqa: F811
    rc, _ = run_job(job, tmp_path)
    assert rc == 0 and not staged.exists()


def test_a_requeued_run_keeps_them_for_its_next_start(job, tmp_path, staged):  # noqa: F811
    rc, calls = run_job(job, tmp_path, STUB_TRAIN_EXIT=str(CHECKPOINT_EXIT))
    assert rc == 0 and ["scontrol", "requeue", "4242"] in calls
    assert removals(calls) == [] and staged.exists()


def test_keep_local_keeps_them_after_a_failure(job, tmp_path, staged):  # noqa: F811
    rc, calls = run_job(job, tmp_path, STUB_TRAIN_EXIT="3", HPCDL_KEEP_LOCAL="1")
    assert rc == 3 and removals(calls) == [] and staged.exists()


def test_nothing_is_removed_when_the_job_does_not_stage(job, tmp_path, staged):  # noqa: F811
    rc, calls = run_job(job, tmp_path, STUB_TRAIN_EXIT="3", HPCDL_STAGE="0")
    assert rc == 3 and removals(calls) == [] and staged.exists()
