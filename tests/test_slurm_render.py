"""`hpcdl slurm render`: the checks that stop a bad job before the queue, the quoting that
keeps user strings inert, and the job script's control flow run under stub launchers."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.slurm.render import (
    CHECKPOINT_EXIT,
    OPENMPI_LAUNCHER,
    JobSpec,
    RenderError,
    activation_bytes_per_image,
    parse_time,
    render,
    render_job,
)
from hpcdl.train.config import DataConfig

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPE = """\
name: tiny
model: {name: resnet_small, num_classes: 10}
data: {image_size: 32}
batch: {global: 64}
epochs: 1
optimizer: {name: lars}
schedule: {name: poly, base_lr: 0.1}
"""
# Every shell metacharacter a name or path could smuggle in, and a Slurm filename pattern.
EVIL = "x $(touch PWNED1) `touch PWNED2`; touch PWNED3 && 'q' \"d\" \\ %j ${HOME} *"
EVIL_DIR = EVIL.replace("%", "").replace("\\", "")  # refused in --out (Slurm interprets them)


def make_data(directory: Path, train_shards: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"splits": {"train": {"num_shards": train_shards, "num_samples": 100}},
                "shards": []}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


@pytest.fixture
def job(tmp_path) -> JobSpec:
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    data = make_data(tmp_path / "shards", train_shards=4)
    return JobSpec(arch="generic", nodes=1, recipe=str(recipe), data=str(data),
                   time="01:00:00", ranks_per_node=2, out=str(tmp_path / "run"))


def with_(spec: JobSpec, **changes) -> JobSpec:
    return JobSpec(**{**spec.__dict__, **changes})


# ---- validation --------------------------------------------------------------------------

def test_valid_job_renders_with_its_layout(job):
    rendered = render_job(job)
    assert (rendered.ranks, rendered.per_rank_batch, rendered.warnings) == (2, 32, [])
    assert "#SBATCH --ntasks-per-node=2" in rendered.script
    assert "{{" not in rendered.script


@pytest.mark.parametrize("arch", ["skx", "knl", "generic"])
def test_every_template_renders_to_valid_bash(job, arch, tmp_path):
    spec = with_(job, arch=arch, ranks_per_node=None if arch != "generic" else 2,
                 time="1-00:00:00")
    script = tmp_path / f"{arch}.sbatch"
    script.write_text(render_job(spec).script)
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_global_batch_not_divisible_by_ranks_is_an_error(job):
    with pytest.raises(RenderError, match=r"batch.global=64 is not divisible by 3 ranks"):
        render_job(with_(job, ranks_per_node=3))


def test_per_rank_batch_under_eight_warns(job):
    rendered = render_job(with_(job, overrides=["batch.global=8"], ranks_per_node=2))
    assert any("per-rank batch 4" in w and "under 8" in w for w in rendered.warnings)


def test_per_rank_batch_over_memory_warns(job, tmp_path):
    recipe = REPO / "recipes" / "resnet50_lars_32k.yaml"
    rendered = render_job(with_(job, arch="skx", ranks_per_node=None, recipe=str(recipe),
                                overrides=["batch.per_rank=null"], time="12:00:00"))
    # 32768 images over 2 ranks: 16384 per rank, far beyond 96 GB per socket.
    assert rendered.per_rank_batch == 16384
    assert any("per-rank batch 16384 needs" in w and "192 GB/node" in w
               for w in rendered.warnings)


def test_resnet50_activation_estimate_is_of_the_measured_order():
    per_image, params = activation_bytes_per_image({"name": "resnet50"}, 224)
    assert 20e6 < params < 30e6            # 25.6 M parameters
    assert 200e6 < per_image < 300e6       # ~256 MB/image (slurm/render.py docstring)


def test_models_with_batchnorm1d_can_be_estimated():
    per_image, _ = activation_bytes_per_image({"name": "alexnet_bn"}, 224)
    assert 5e6 < per_image < 20e6


def test_missing_recipe_is_an_error_naming_it(job, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(RenderError, match="nope.yaml"):
        render_job(with_(job, recipe=missing))


def test_unknown_override_key_is_an_error_naming_it(job):
    with pytest.raises(RenderError, match="batch.per_rnak"):
        render_job(with_(job, overrides=["batch.per_rnak=8"]))


def test_fewer_shards_than_nodes_is_an_error(job, tmp_path):
    data = make_data(tmp_path / "two", train_shards=2)
    with pytest.raises(RenderError, match=r"2 train shards for --nodes 4"):
        render_job(with_(job, data=str(data), nodes=4, ranks_per_node=1))


def test_uneven_shards_warn(job):
    rendered = render_job(with_(job, nodes=3, ranks_per_node=1, overrides=["batch.global=48"]))
    assert any("4 train shards over 3 nodes" in w for w in rendered.warnings)


def test_data_without_manifest_is_an_error(job, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RenderError, match="no manifest.json"):
        render_job(with_(job, data=str(tmp_path / "empty")))


def test_time_limit_without_room_before_the_signal_is_an_error(job):
    with pytest.raises(RenderError, match=r"--time 00:05:00 \(300 s\)"):
        render_job(with_(job, time="00:05:00", signal_seconds=300))


def test_signal_too_late_for_a_checkpoint_is_an_error(job):
    with pytest.raises(RenderError, match="--signal-seconds 30 is too short"):
        render_job(with_(job, signal_seconds=30))


def test_fixed_layout_templates_refuse_another_rank_count(job):
    with pytest.raises(RenderError, match="--ranks-per-node 4: the skx template runs 2"):
        render_job(with_(job, arch="skx", ranks_per_node=4))


@pytest.mark.parametrize("name", ["job\nrm -rf ~", "tab\there", "cr\r"])
def test_control_characters_are_refused(job, name):
    with pytest.raises(RenderError, match="--job-name .* control character"):
        render_job(with_(job, job_name=name))


@pytest.mark.parametrize("text,seconds", [("90", 5400), ("10:30", 630), ("02:00:00", 7200),
                                          ("1-00", 86400), ("1-02:03", 93780),
                                          ("2-00:00:05", 172805)])
def test_slurm_time_formats(text, seconds):
    assert parse_time(text) == seconds


def test_bad_time_is_an_error_naming_it():
    with pytest.raises(RenderError, match="'2h'"):
        parse_time("2h")


def test_placeholder_without_value_is_an_error():
    with pytest.raises(RenderError, match="NOPE"):
        render("a {{NOPE}} b", {})


def test_checkpoint_exit_code_is_the_trainers():
    from hpcdl.train.trainer import EXIT_STOPPED_BY_SIGNAL

    assert CHECKPOINT_EXIT == EXIT_STOPPED_BY_SIGNAL


# ---- decode threads get cores of their own (docs/data.md, "Decode threads per compute core")

def test_skx_gives_the_recipes_decode_threads_cores_beside_the_compute_threads(job):
    workers = DataConfig().workers  # the tiny recipe leaves data.workers at its default
    rendered = render_job(with_(job, arch="skx", ranks_per_node=None, cores_per_socket=24))
    assert (rendered.compute_threads, rendered.decode_workers) == (24 - workers, workers)
    assert "#SBATCH --cpus-per-task=24" in rendered.script
    assert f"THREADS_PER_RANK={24 - workers}" in rendered.script
    assert f"DECODE_WORKERS={workers}" in rendered.script


def test_the_workers_override_moves_cores_between_decode_and_compute(job):
    spec = with_(job, arch="skx", ranks_per_node=None, overrides=["data.workers=1"])
    assert render_job(spec).compute_threads == 23


def test_knl_leaves_decode_cores_beside_the_os_cores(job):
    rendered = render_job(with_(job, arch="knl", ranks_per_node=None,
                                overrides=["data.workers=4"]))
    assert rendered.compute_threads == 68 - 4 - 4
    assert "THREADS_PER_RANK=60" in rendered.script
    assert "#SBATCH --cpus-per-task=68" in rendered.script


def test_a_socket_without_room_for_compute_and_decode_threads_is_an_error(job):
    with pytest.raises(RenderError, match=r"data.workers=4: a skx node cannot hold 2 rank\(s\) "
                                          r"x \(1 compute thread \+ 4 decode threads\) on 4 "):
        render_job(with_(job, arch="skx", ranks_per_node=None, cores_per_socket=4,
                         overrides=["data.workers=4"]))


def test_negative_workers_are_an_error_naming_the_key(job):
    with pytest.raises(RenderError, match=r"data.workers=-1"):
        render_job(with_(job, overrides=["data.workers=-1"]))


def test_cli_refuses_a_node_too_small_for_its_decode_threads_in_one_line(job):
    result = subprocess.run(
        [sys.executable, "-m", "hpcdl.cli.main", "slurm", "render", "--arch", "skx",
         "--nodes", "1", "--cores-per-socket", "3", "--recipe", job.recipe, "--data", job.data,
         "--out", job.out, "data.workers=3"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "data.workers=3" in result.stderr


def hwloc_stub(tmp_path: Path, sockets: int, cores: int) -> None:
    """A `hwloc-calc` answering the generic template's two questions about the node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "hwloc-calc"
    stub.write_text(f"#!/bin/sh\ncase $2 in package) echo {sockets};; core) echo {cores};; "
                    f"esac\n")
    stub.chmod(0o755)


def test_generic_takes_decode_cores_from_each_ranks_share(job, tmp_path):
    hwloc_stub(tmp_path, sockets=1, cores=16)
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(with_(job, overrides=["data.workers=3"])).script)  # 2 ranks
    threads = tmp_path / "threads"
    rc, calls = run_under_stubs(script, tmp_path, HPCDL_DOCTOR="0", HPCDL_STAGE="0",
                                STUB_THREADS=str(threads))
    assert rc == 0
    assert "--cpus-per-task=8" in train_launch(calls)  # 16 cores / 2 ranks
    assert threads.read_text().split() == ["5"]         # 8 - 3 decode threads


def test_generic_share_too_small_keeps_one_compute_thread(job, tmp_path):
    hwloc_stub(tmp_path, sockets=1, cores=2)
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(job).script)
    threads = tmp_path / "threads"
    rc, calls = run_under_stubs(script, tmp_path, HPCDL_DOCTOR="0", HPCDL_STAGE="0",
                                STUB_THREADS=str(threads))
    assert rc == 0
    assert "--cpus-per-task=1" in train_launch(calls)
    assert threads.read_text().split() == ["1"]


def test_cli_error_exits_nonzero_and_names_the_value(job):
    result = subprocess.run(
        [sys.executable, "-m", "hpcdl.cli.main", "slurm", "render", "--arch", "generic",
         "--nodes", "1", "--ranks-per-node", "3", "--recipe", job.recipe, "--data", job.data,
         "--out", job.out], capture_output=True, text=True)
    assert result.returncode == 2  # bad input, as every command
    assert "batch.global=64" in result.stderr and "3 ranks" in result.stderr
    assert result.stdout == ""


# ---- quoting and the script's control flow, under stub launchers ---------------------------

STUB = """#!{python}
import json, os, signal, sys, time
name = os.path.basename(sys.argv[0])
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps([name] + sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if name in ("srun", "numactl"):
    # run the program after the options, as the real launcher would
    while args and args[0].startswith("-"):
        args.pop(0)
    os.execvp(args[0], args)
if name == "hpcdl" and args[:2] == ["prep", "stage"] and os.environ.get("STUB_USR1") == "stage":
    os.kill(os.getppid(), signal.SIGUSR1)  # the time limit while staging
if name == "hpcdl" and args[:1] == ["train"]:
    if os.environ.get("STUB_THREADS"):  # the compute threads the template gave the ranks
        with open(os.environ["STUB_THREADS"], "a") as threads:
            threads.write(os.environ.get("OMP_NUM_THREADS", "unset") + "\\n")
    if os.environ.get("STUB_USR1") == "train":  # checkpoint when the job script forwards USR1
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit({exit}))
        os.kill(os.getppid(), signal.SIGUSR1)
        time.sleep(30)
        sys.exit(1)
    sys.exit(int(os.environ.get("STUB_TRAIN_EXIT", "0")))
"""


def stub_calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def run_under_stubs(script: Path, tmp_path: Path, **env: str) -> tuple[int, list[list[str]]]:
    """Execute the rendered script with srun, numactl, scontrol, scancel and hpcdl replaced
    by stubs that log their arguments (srun and numactl then run the program they were given)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("srun", "numactl", "scontrol", "scancel", "hpcdl"):
        stub = bin_dir / name
        stub.write_text(STUB.format(python=sys.executable, exit=CHECKPOINT_EXIT))
        stub.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_LOG": str(log),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1",
                "HPCDL_LOCAL_DIR": str(tmp_path / "local"), **env}
    result = subprocess.run(["bash", str(script)], cwd=work, env=full_env, capture_output=True,
                            text=True, timeout=60)
    return result.returncode, stub_calls(log) if log.exists() else []


def pwned_files(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("PWNED*")]


@pytest.fixture
def evil_job(tmp_path) -> JobSpec:
    """Every user string of the job carries EVIL; the recipe and data really exist there."""
    home = tmp_path / EVIL_DIR
    home.mkdir()
    (home / "recipe.yaml").write_text(TINY_RECIPE)
    data = make_data(home / "shards", train_shards=4)
    setup = home / "setup.sh"
    setup.write_text("")
    return JobSpec(arch="generic", nodes=1, recipe=str(home / "recipe.yaml"), data=str(data),
                   time="01:00:00", ranks_per_node=2, job_name=EVIL, out=str(home / "run"),
                   partition=EVIL, account=EVIL, setup=str(setup), local_dir=str(home),
                   overrides=[f"name={EVIL}"], train_args=[f"--log-level={EVIL}"])


def test_sbatch_lines_hold_user_strings_as_single_words(evil_job):
    script = render_job(evil_job).script
    options = dict(line[len("#SBATCH "):].split("=", 1) for line in script.splitlines()
                   if line.startswith("#SBATCH --") and "=" in line)
    # sbatch splits an #SBATCH line the way the shell splits words (checked on a real
    # cluster in tests/test_slurm_jobs.py); each value must come back whole.
    for key in ("--job-name", "--partition", "--account"):
        assert shlex.split(options[key]) == [EVIL]
    output, = shlex.split(options["--output"].split("#")[0])
    assert output == os.path.join(evil_job.out, "logs") + "/slurm-%j.out"


@pytest.mark.parametrize("char", ["%", "\\"])
def test_run_dir_with_slurm_pattern_characters_is_refused(job, tmp_path, char):
    with pytest.raises(RenderError, match="--out .* contains"):
        render_job(with_(job, out=str(tmp_path / f"run{char}x")))


def test_evil_strings_run_nothing_and_arrive_intact(evil_job, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(evil_job).script)
    subprocess.run(["bash", "-n", str(script)], check=True)
    rc, calls = run_under_stubs(script, tmp_path, HPCDL_LOCAL_DIR="")  # the rendered one
    assert rc == 0
    assert pwned_files(tmp_path) == []          # no $(...), `...` or ; ran
    train = next(c for c in calls if c[:2] == ["hpcdl", "train"])
    assert train[train.index("--recipe") + 1] == evil_job.recipe
    assert train[train.index("--out") + 1] == evil_job.out
    assert train[-2:] == [f"--log-level={EVIL}", f"name={EVIL}"]
    stage = next(c for c in calls if c[:3] == ["hpcdl", "prep", "stage"])
    assert stage[stage.index("--shards") + 1] == evil_job.data
    assert stage[stage.index("--to") + 1] == os.path.join(evil_job.local_dir, "hpcdl-shards-4242")


def test_checkpoint_exit_requeues_the_job(job, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(job).script)
    rc, calls = run_under_stubs(script, tmp_path, STUB_TRAIN_EXIT=str(CHECKPOINT_EXIT))
    assert rc == 0
    assert ["scontrol", "requeue", "4242"] in calls


def test_time_limit_signal_is_forwarded_to_training_then_requeues(job, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(job).script)
    rc, calls = run_under_stubs(script, tmp_path, STUB_USR1="train", HPCDL_DOCTOR="0")
    assert rc == 0
    assert calls[-1] == ["scontrol", "requeue", "4242"]


def test_time_limit_signal_while_staging_requeues_without_training(job, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(job).script)
    rc, calls = run_under_stubs(script, tmp_path, STUB_USR1="stage", HPCDL_DOCTOR="0")
    assert rc == 0
    assert ["scontrol", "requeue", "4242"] in calls
    assert not [c for c in calls if c[:2] == ["hpcdl", "train"]]


def test_failed_training_is_the_jobs_exit_and_no_requeue(job, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(job).script)
    rc, calls = run_under_stubs(script, tmp_path, STUB_TRAIN_EXIT="3")
    assert rc == 3
    assert not [c for c in calls if c[0] == "scontrol"]


def test_launch_order_is_doctor_stage_train_cleanup(job, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(job).script)
    rc, calls = run_under_stubs(script, tmp_path)
    # --help and --mpi-flavor are questions the script asks, not steps it launches
    programs = [c[1:3] for c in calls if c[0] == "hpcdl" and "--help" not in c
                and "--mpi-flavor" not in c]
    assert rc == 0
    assert programs == [["doctor", "--data"], ["prep", "stage"], ["train", "--recipe"]]
    srun = [c for c in calls if c[0] == "srun"]
    assert "--ntasks-per-node=1" in srun[1] and "--ntasks-per-node=2" in srun[2]
    assert srun[-1][-3:] == ["rm", "-rf", str(tmp_path / "local" / "hpcdl-shards-4242")]


def test_knl_flat_mode_prefers_mcdram(job, tmp_path):
    spec = with_(job, arch="knl", ranks_per_node=None, knl_memory_mode="flat")
    script = tmp_path / "knl.sbatch"
    script.write_text(render_job(spec).script)
    rc, calls = run_under_stubs(script, tmp_path, HPCDL_DOCTOR="0")
    assert rc == 0
    train_srun = next(c for c in calls if c[0] == "srun" and "train" in c)
    assert train_srun[train_srun.index("numactl"):][:2] == ["numactl", "--preferred=1"]
    assert "--cpus-per-task=68" in train_srun and "--ntasks-per-node=1" in train_srun


def test_setup_file_is_sourced(evil_job, tmp_path):
    Path(evil_job.setup).write_text('touch "$HOME/setup-was-sourced"\n')
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(evil_job).script)
    rc, _ = run_under_stubs(script, tmp_path, HPCDL_DOCTOR="0")
    assert rc == 0 and (tmp_path / "setup-was-sourced").exists()


# ---- the launcher follows the MPI (docs/mpi.md) ---------------------------------------------

def train_launch(calls: list[list[str]]) -> list[str]:
    return next(c for c in calls if "train" in c and c[0] != "hpcdl")


@pytest.mark.parametrize("mpi, launcher", [("mpich", "--mpi=pmi2"), ("impi", "--mpi=pmi2"),
                                           ("openmpi", f"--mpi={OPENMPI_LAUNCHER[5:]}")])
def test_each_mpi_gets_its_launcher(job, tmp_path, mpi, launcher):
    if OPENMPI_LAUNCHER == "mpirun" and mpi == "openmpi":
        launcher = "mpirun"
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(with_(job, mpi=mpi)).script)
    (tmp_path / "lib64").mkdir()  # Slurm's PMI-2 library beside the (stub) srun's prefix
    (tmp_path / "lib64" / "libpmi2.so").write_text("")
    rc, calls = run_under_stubs(script, tmp_path, HPCDL_DOCTOR="0", HPCDL_STAGE="0")
    assert rc == 0
    assert launcher in train_launch(calls)
    assert not [c for c in calls if "--mpi-flavor" in c]  # told, so not asked


def test_auto_asks_mpi4py_at_run_time_and_submit_time_overrides(job, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_job(job).script)  # --mpi auto --launcher auto
    (tmp_path / "asked").mkdir()
    rc, calls = run_under_stubs(script, tmp_path / "asked", HPCDL_DOCTOR="0", HPCDL_STAGE="0")
    assert rc == 0 and ["hpcdl", "doctor", "--mpi-flavor"] in calls
    assert "--mpi=pmi2" in train_launch(calls)  # the stub names no MPI: PMI-2, the common one
    (tmp_path / "told").mkdir()
    rc, calls = run_under_stubs(script, tmp_path / "told", HPCDL_DOCTOR="0", HPCDL_STAGE="0",
                                HPCDL_MPI="openmpi", HPCDL_LAUNCHER="srun-pmix")
    assert rc == 0 and "--mpi=pmix" in train_launch(calls)


def test_unknown_mpi_is_refused_naming_the_choices(job):
    with pytest.raises(RenderError, match=r"--mpi 'lam': choose one of .*impi"):
        render_job(with_(job, mpi="lam"))
