"""Faults across hosts on the test cluster: every one ends or heals the job, names its cause,
leaves no rank behind and loses nothing (docs/debugging.md, "Faults and what the job does").

`hpcdl train` on the demo recipe scaled to tiny data, MPICH's mpiexec across h1..h3 (one rank per
host), stall limits short (warn 2 s, abort 10 s, exit grace 2 s: the abort limit leaves room for
a loaded 2-core machine, where a healthy collective can wait seconds). The faults are real: a
host's eth0 set down, every process of a host SIGSTOPped or SIGKILLed, a rank SIGKILLed, a
link shaped to 1 mbit/s, a full file system under the run directory, a Slurm node set DOWN.

"No rank left behind" is read from every host's process table once the launcher has exited:
no `hpcdl` process may remain (a zombie has ended and counts as gone). MPICH's
`hydra_pmi_proxy` on a cut-off host is the launcher's, not hpcdl's: it is recorded, not
killed by a rank (a rank killing its parent would hide the launcher's own failure), and the
test ends it once the host is back.

No timing assertions: the bound a job promises is its stall limits, which the stall line
states; the tests assert that the job ended (a generous subprocess timeout) and read that line.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cluster_hosts import (
    REPO,
    SCRIPT,
    job_field,
    launcher_env,
    make_the_hosts_again,
    on_controller,
    slurm_missing,
)
from test_slurm_across_hosts import DEMO_RECIPE, OVERRIDES, render, shards, wait_until

from hpcdl.debug.stall import STALL_EXIT_CODE

__all__ = ["shards"]  # a module fixture, used by name

STALL = {"HPCDL_STALL_WARN_S": "2", "HPCDL_STALL_ABORT_S": "10", "HPCDL_STALL_EXIT_GRACE_S": "2"}
#: 40 epochs of 7 steps; a checkpoint every 5 steps. Long enough that a fault applied after step
#: 8 lands inside training on a quiet machine too (a step there takes ~25 ms: 42 steps were over
#: before the link went down, and the job then hung in MPI_Finalize, outside any watchdog).
STEPS = 7 * 40
RUN_OVERRIDES = (*[o for o in OVERRIDES if not o.startswith("epochs=")], "epochs=40")
TRAIN = f"--deterministic --no-eval --no-progress --checkpoint-every 5 {' '.join(RUN_OVERRIDES)}"
#: processes every host keeps: the namespace holder, Slurm's daemons
PERMANENT = ("sleep infinity", "slurmd", "slurmctld")


class Job:
    """`hpcdl train` (or ``program``) as ranks of mpiexec across ``hosts``, in the background;
    ``metrics``: where its steps are counted (default OUT/metrics.jsonl)."""

    def __init__(self, cluster, hosts: list[str], out: Path, env: dict[str, str] | None = None,
                 per_host: int = 1, args: str = "", program: str | None = None,
                 metrics: Path | None = None) -> None:
        self.cluster, self.hosts, self.out = cluster, hosts, out
        self.metrics = metrics or out / "metrics.jsonl"
        self.log_path = out.parent / f"{out.name}.launcher.log"
        program = program or (f"hpcdl train --recipe {DEMO_RECIPE} --data {cluster.shards} "
                              f"--out {out} {TRAIN} {args}")
        line = f"{cluster.launch_command('mpich', hosts, per_host)} {program}"
        environ = cluster.env({**launcher_env("mpich"), **STALL, **(env or {})})
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [str(SCRIPT), "exec", hosts[0], "bash", "-c", f"cd {REPO} && exec {line}"],
                stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True)

    def steps(self) -> int:
        metrics = self.metrics
        return metrics.read_text().count('"step"') if metrics.exists() else 0

    def wait_for_step(self, step: int, limit: float = 300) -> None:
        wait_until(lambda: self.steps() >= step or self.process.poll() is not None,
                   f"step {step}", limit)
        assert self.process.poll() is None, f"the job ended before step {step}:\n{self.output()}"

    def wait_in_first_collective(self, limit: float = 300) -> None:
        """Start-up: rank 0 waits in its first collective (its heartbeat says so), no step yet."""
        beat = self.out / "logs" / "heartbeat" / "rank-0000.json"

        def waiting() -> bool:
            try:
                record = json.loads(beat.read_text())
            except (OSError, ValueError):
                return False
            return bool(record.get("in_collective"))
        wait_until(lambda: waiting() or self.process.poll() is not None,
                   "rank 0 in its first collective", limit)
        assert self.process.poll() is None, self.output()
        assert self.steps() == 0

    def wait_in_checkpoint_write(self, written: int, limit: float = 300) -> None:
        """Rank 0 is inside the checkpoint write after ``written`` complete ones
        (``HPCDL_INJECT=0:checkpointN:sleep=S``, N = written + 1, holds it there): its
        temporary file exists, the checkpoint's name does not yet. (An earlier write's
        temporary, seen in passing on a loaded machine, is not the held one.)"""
        ckpts = self.out / "checkpoints"
        wait_until(lambda: (len(list(ckpts.glob("ckpt-*.pt"))) >= written
                            and any(ckpts.glob(".ckpt-*.tmp")))
                   or self.process.poll() is not None,
                   "rank 0 inside a checkpoint write", limit)
        assert self.process.poll() is None, self.output()
        (self.writing,) = [p.name.split(".")[1] for p in ckpts.glob(".ckpt-*.tmp")]

    def fault(self) -> None:
        self.fault_at = time.monotonic()

    def wait(self, timeout: float = 240) -> int:
        try:
            rc = self.process.wait(timeout=timeout)
            if getattr(self, "fault_at", None) is not None:  # for the docs' table, not asserted
                print(f"\n[{self.out.parent.name}] launcher exit {rc} "
                      f"{time.monotonic() - self.fault_at:.1f} s after the fault")
            return rc
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(f"the launcher did not end within {timeout} s:\n"
                                 f"{self.output()}") from None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rank_log(self, rank: int) -> str:
        path = self.out / "logs" / f"rank-{rank:04d}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def dump(self, rank: int) -> str:
        path = self.out / "logs" / "heartbeat" / f"rank-{rank:04d}.stall.txt"
        return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module", autouse=True)
def hosts_made_again_afterwards(cluster):
    """The next module starts on fresh hosts."""
    yield
    make_the_hosts_again(cluster)


@pytest.fixture(scope="module")
def slurm_on_fresh_hosts(cluster):
    """Slurm on hosts made again after the faults before it (skipped, like every Slurm test,
    where Slurm is not installed: before making anything)."""
    missing = slurm_missing()
    if missing:
        pytest.skip(missing)
    make_the_hosts_again(cluster)
    cluster.script("slurm", "up", timeout=120)
    return cluster


@pytest.fixture(scope="module")
def hosts(cluster, shards):
    cluster.shards = shards
    return cluster


def processes(cluster, host: str) -> list[tuple[int, str, str]]:
    """(pid, state, command line) of every live process on ``host`` but the permanent ones."""
    found = []
    # (cluster.sh pids exits 1 when its last /proc entry is not the host's: the list stands)
    for pid in cluster.script("pids", host, check=False).split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or any(p in command for p in PERMANENT):
            continue
        found.append((int(pid), state, command))
    return found


def is_rank(command: str) -> bool:
    """A rank is a Python process (the cluster's own paths contain "hpcdl" too)."""
    return "python" in os.path.basename(command.split()[0]) if command else False


def ranks_left(cluster) -> dict[str, list]:
    return {h: [p for p in processes(cluster, h) if is_rank(p[2])] for h in cluster.hosts}


def assert_no_rank_left(cluster, limit: float = 60) -> dict[str, list]:
    """Every host's `hpcdl` processes gone; returns what else of the launcher remains."""
    try:
        wait_until(lambda: not any(ranks_left(cluster).values()), "every rank to end", limit)
    except AssertionError:
        raise AssertionError(f"ranks left behind: {ranks_left(cluster)}") from None
    return {h: processes(cluster, h) for h in cluster.hosts}


def end_leftovers(cluster, host: str) -> None:
    """The test's clean-up: thaw ``host`` and kill what a fault left of the launcher there."""
    for pid, _, _ in processes(cluster, host):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def signal_host(cluster, host: str, sig: signal.Signals) -> list[str]:
    """``sig`` to every process on ``host`` but the namespace holder (the host itself stays, for
    the next tests); their command lines."""
    hit = []
    for pid, _, command in processes(cluster, host):
        try:
            os.kill(pid, sig)
            hit.append(command)
        except ProcessLookupError:
            pass
    return hit


#: How each phase is reached: start-up holds rank 1 before its first collective (rank 0 waits
#: in it); a checkpoint write holds rank 0 inside its second checkpoint write (step 7, the
#: first epoch's end), after the data and before the rename, while rank 1 waits for it.
PHASE_ENV = {"training": {}, "start-up": {"HPCDL_INJECT": "1:1:sleep=4"},
             "checkpoint": {"HPCDL_INJECT": "0:checkpoint2:sleep=6"}}


def reach(job: Job, phase: str) -> None:
    if phase == "training":
        job.wait_for_step(8)
    elif phase == "start-up":
        job.wait_in_first_collective()
    else:
        job.wait_in_checkpoint_write(written=1)  # checkpoint2 is held


def checkpoint_after_the_fault(out: Path, job: Job, phase: str, write_completed: bool
                               ) -> int | None:
    """The step of the newest complete checkpoint once the job has ended (None at start-up,
    where none may exist). A fault during a checkpoint write leaves the one being written when
    rank 0's own write could complete (``write_completed``), else the one before it: the
    half-written file never took a checkpoint's name."""
    ckpts = out / "checkpoints"
    if phase == "start-up":
        assert not ckpts.exists() or not list(ckpts.iterdir())
        return None
    step = last_checkpoint(out)
    assert step >= 5, step
    if phase == "checkpoint" and write_completed:
        assert f"ckpt-{step:09d}" == job.writing, (step, job.writing)
    elif phase == "checkpoint":
        assert not (ckpts / f"{job.writing}.pt").exists()
        assert f"ckpt-{step:09d}" < job.writing
    return step


def stall_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if "stall: aborting the job (MPI_Abort 4)" in ln]
    assert lines, text[-4000:]
    print(f"\n{lines[0]}")
    return lines[0]


def last_checkpoint(run_dir: Path) -> int:
    """The newest complete checkpoint's step (it loads: the checksum and the tensors)."""
    from hpcdl.train.checkpoint import latest_valid_checkpoint

    found = latest_valid_checkpoint(str(run_dir))
    assert found is not None, list((run_dir / "checkpoints").iterdir())
    return int(found[1]["step"])


def resume_to_the_end(cluster, hosts: list[str], run_dir: Path, after: int) -> dict:
    """`--resume auto` on ``hosts`` (elastic: another rank count, the same global batch)."""
    done = cluster.mpirun("mpich", hosts, 1,
                          f"hpcdl train --recipe {DEMO_RECIPE} --data {cluster.shards} "
                          f"--out {run_dir} --resume auto {TRAIN}",
                          env=STALL, check=False, timeout=400)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    assert re.search(rf"resumed from \S+ckpt-0*{after}\.pt at step {after}\b", text), text[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["ranks"]) == (STEPS, len(hosts)), summary
    return summary


# -- 1. a host's link goes down ---------------------------------------------------------------
@pytest.mark.parametrize("phase", ["training", "start-up", "checkpoint"])
def test_a_host_whose_link_goes_down_ends_the_job_and_its_cut_off_rank_ends_itself(hosts, phase):
    """h2's eth0 down: rank 0 (h1) aborts after the abort limit, naming both hosts and since
    when (the shared directory still carries rank 1's heartbeats: it is alive and waiting, so
    the verdict is "slow link ... or not at all"); rank 1, cut off, aborts too, its MPI_Abort
    reaches no one, and it ends itself after the grace. No rank is left on any host; the last
    checkpoint loads and `--resume auto` on h1 alone continues to the same final step count.
    During a checkpoint write, the write itself is rank 0's alone: it completes, and it is the
    one the resume loads."""
    out = hosts.workdir("link-down") / "run"
    job = Job(hosts, ["h1", "h2"], out, PHASE_ENV[phase])
    try:
        reach(job, phase)
        hosts.script("link", "h2", "down")
        job.fault()
        rc = job.wait()
        text = job.output()
        assert rc != 0, text[-4000:]
        # rank 0's own log too: its stderr's last line can be lost to its MPI_Abort
        line = stall_line(text + "\n" + job.rank_log(0))
        assert "on rank 0 (h1)" in line and re.search(r"since \d\d:\d\d:\d\d UTC", line), line
        assert "h2" in line, line
        left = assert_no_rank_left(hosts)
        # the cut-off side: its own line and dump (its stderr went nowhere: the link is down)
        dump = job.dump(1)
        assert "on rank 1 (h2)" in dump, dump[:3000] or job.rank_log(1)[-3000:]
        assert "MPI_Abort did not end rank 1 (h2) within HPCDL_STALL_EXIT_GRACE_S=2 s" in dump
        assert "the rank ends itself with exit 4" in job.rank_log(1)
        print(f"after the launcher exited, beside the holders: {left}")
    finally:
        hosts.script("link", "h2", "up")
        end_leftovers(hosts, "h2")
    # during a checkpoint write, rank 0's own write completes: the resume loads that one
    step = checkpoint_after_the_fault(out, job, phase, write_completed=True)
    if step is not None:
        resume_to_the_end(hosts, ["h1"], out, step)


def test_a_link_that_comes_back_after_20_s_is_slow_not_dead(hosts):
    """h2's eth0 down for 20 s with an abort limit of 120 s: the stall report warns (slow
    link), then "stall over" once the link is back, and the job trains to the end, exit 0."""
    out = hosts.workdir("link-flap") / "run"
    # 100 epochs (700 steps, ~18 s quiet): the link must go down while the ranks still train.
    # The limit outlasts TCP's retransmission backoff, not just the outage: a retry doubles
    # its wait each time, so the first one after the link is back can come tens of seconds
    # later (once, under three test workers on 2 cores, none came within 40 s of it at a
    # 60 s limit).
    job = Job(hosts, ["h1", "h2"], out, {"HPCDL_STALL_ABORT_S": "120"}, args="epochs=100")
    try:
        job.wait_for_step(8)
        hosts.script("link", "h2", "down")
        print(f"\nlink down at {time.strftime('%H:%M:%S')} step {job.steps()}")
        time.sleep(20)
    finally:
        hosts.script("link", "h2", "up")
        print(f"link up at {time.strftime('%H:%M:%S')} step {job.steps()}")
    # the rest of the 700 steps: ~18 s on a quiet machine; the 1,400 of an earlier version
    # were seen taking over 300 s on the shared 2-core machine under load (the job healthy)
    rc = job.wait(timeout=900)
    text = job.output()
    assert rc == 0, text[-4000:]
    # The warning's verdict is on the line after it (the first pass at this test searched one
    # line, found nothing and was skipped as "no stall"; the stall was there). Which verdict
    # depends on where each rank was waiting when the link went: "slow link" when both were
    # inside one collective.
    stalls = [ln for ln in text.splitlines() if "stall" in ln or "verdict:" in ln]
    assert re.search(r"slow link|alive but not arrived|not heard from", "\n".join(stalls)), \
        stalls or text[-4000:]
    print("\n".join(stalls))
    # each rank that warned says so: in a watched collective, or in a raw MPI call
    over = re.compile(r"stall over: (collective #\d+|MPI) .+ completed after \d+\.\d s "
                      r"\(slow, not dead\)")
    assert over.search(text) or over.search(job.rank_log(1)), stalls
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["stopped"]) == (7 * 100, "completed"), summary
    assert_no_rank_left(hosts)


def test_a_link_cut_while_the_ranks_finalize_ends_them_within_the_abort_limit(hosts):
    """The work done (summary.json written), rank 1 held before MPI_Finalize
    (``HPCDL_INJECT=1:exit:sleep=8``) while h2's link goes down: MPI_Finalize cannot complete on
    either side, and nothing watches it but the SIGALRM each rank arms once its command is
    done (HPCDL_STALL_ABORT_S, at least 60 s). Both ranks end (killed by signal 14), the launcher
    exits non-zero, nothing is left on any host, and the run's record says it completed."""
    out = hosts.workdir("link-down-exit") / "run"
    job = Job(hosts, ["h1", "h2"], out, {"HPCDL_INJECT": "1:exit:sleep=8"})
    try:
        wait_until(lambda: "before MPI_Finalize" in job.rank_log(1)
                   or job.process.poll() is not None, "rank 1 at MPI_Finalize", 300)
        assert job.process.poll() is None, job.output()[-4000:]
        hosts.script("link", "h2", "down")
        job.fault()
        wait_until(lambda: not any(ranks_left(hosts).values()), "every rank to end", 150)
        print(f"\nevery rank ended {time.monotonic() - job.fault_at:.1f} s after the fault")
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["steps"], summary["stopped"]) == (STEPS, "completed"), summary
    finally:
        hosts.script("link", "h2", "up")
    rc = job.wait()
    assert rc != 0, job.output()[-4000:]
    print(job.output()[-1500:])
    assert_no_rank_left(hosts)
    end_leftovers(hosts, "h2")


# -- 1b. every entry point, its host's link cut -----------------------------------------------
def entry_program(cluster, entry: str, out: Path) -> tuple[str, Path, dict[str, str]]:
    """(program, where its rank-0 progress is read, env) of each entry point; progress is a
    metrics file where the entry point writes one, else rank 0's heartbeat."""
    beats = out / "heartbeat"
    if entry == "demo":  # preparing Fashion-MNIST takes rank 0 longer than the short limit
        return (f"hpcdl demo --out {out} --no-progress", out / "metrics.jsonl",
                {"HPCDL_STALL_ABORT_S": "40"})
    if entry == "ltfb":
        return (f"hpcdl train --recipe {DEMO_RECIPE} --data {cluster.shards} --out {out} "
                f"--algorithm ltfb --trainers 2 --tournament-interval 2 {TRAIN}",
                out / "trainer-00" / "metrics.jsonl", {})
    if entry == "bench":
        return ("hpcdl bench allreduce --backends mpi --only-listed --sizes 16777216 "
                "--repeats 5000 --warmup 1", beats, {"HPCDL_HEARTBEAT_DIR": str(beats)})
    return (f"python3 {REPO / 'tests' / 'cluster' / 'programs' / 'own_loop.py'}", beats,
            {"HPCDL_HEARTBEAT_DIR": str(beats)})


@pytest.mark.parametrize("entry", ["demo", "ltfb", "bench", "own-loop"])
def test_every_entry_point_ends_a_job_whose_host_is_cut_off(hosts, entry):
    """`hpcdl demo`, LTFB (trainers on different hosts: only the tournaments cross hosts), `hpcdl
    bench allreduce` and a user's own loop on `hpcdl.comm.init`, each with h2's link taken down
    mid-run: the default stall watchdog ends each job (exit 4) with rank 0's line naming h2,
    rank 1 ends itself (its dump says so; under LTFB it is rank 0 of trainer 1, in that
    trainer's directory), and no rank is left on any host. The demo runs with a 40 s abort
    limit: preparing Fashion-MNIST keeps rank 0 away from collectives longer than 10 s."""
    out = hosts.workdir(f"entry-{entry}") / "run"
    out.mkdir(parents=True)
    program, progress, env = entry_program(hosts, entry, out)
    job = Job(hosts, ["h1", "h2"], out, env, program=program,
              metrics=progress if progress.suffix == ".jsonl" else None)
    try:
        if progress.suffix == ".jsonl":
            job.wait_for_step(6, limit=600)
        else:  # these write no metrics (and no heartbeat while busy): 10 s after both ranks
            # started, well inside their loops (the bench: 5,000 allreduces of 16 MiB)
            wait_until(lambda: all(ranks_left(hosts)[h] for h in ("h1", "h2"))
                       or job.process.poll() is not None, "both ranks", 300)
            time.sleep(10)
            assert job.process.poll() is None, job.output()[-4000:]
        hosts.script("link", "h2", "down")
        job.fault()
        rc = job.wait()
        # rank 0's line, from its output or (when MPI_Abort cut that short) its log and dump
        text = "\n".join([job.output(), *(p.read_text(errors="replace") for p in
                                          (*out.rglob("rank-*.log"), *out.rglob("*.stall.txt")))])
        assert rc == STALL_EXIT_CODE, text[-4000:]
        line = stall_line("\n".join(ln for ln in text.splitlines() if "(h1)" in ln))
        assert "on rank 0 (h1)" in line and "h2" in line, line
        assert_no_rank_left(hosts)
        dumps = [p.read_text(errors="replace") for p in out.rglob("rank-*.stall.txt")]
        assert any(re.search(r"MPI_Abort did not end rank \d \(h2\)", d) for d in dumps), dumps
    finally:
        hosts.script("link", "h2", "up")
        end_leftovers(hosts, "h2")


# -- 2. a host freezes ------------------------------------------------------------------------
@pytest.mark.parametrize("phase", ["training", "start-up", "checkpoint"])
def test_a_frozen_host_ends_the_job_naming_it_rank_gone(hosts, phase):
    """Every process on h2 SIGSTOPped (rank, launcher proxy, holder): rank 0's heartbeat
    reader sees rank 1's heartbeat stop, aborts after the abort limit with "rank gone: rank 1
    on h2 silent since T". Once h2 thaws, nothing of the job is left, and `--resume auto` on
    both hosts (the fault repaired) continues to the same final step count."""
    out = hosts.workdir("freeze") / "run"
    job = Job(hosts, ["h1", "h2"], out, PHASE_ENV[phase])
    try:
        reach(job, phase)
        frozen = signal_host(hosts, "h2", signal.SIGSTOP)
        job.fault()
        assert any(is_rank(c) for c in frozen), frozen
        # rank 0 ends (its own abort), whatever the launcher does about a frozen host
        wait_until(lambda: "stall: aborting the job" in job.rank_log(0), "rank 0's abort", 120)
        line = stall_line(job.rank_log(0))
        assert re.search(r"rank gone: rank 1 on h2 silent since \d\d:\d\d:\d\d UTC", line), line
        assert "HPCDL_STALL_ABORT_S=10 " in line
        wait_until(lambda: not ranks_left(hosts)["h1"], "rank 0 to end", 60)
        launcher_ended_while_frozen = job.process.poll() is not None
        signal_host(hosts, "h2", signal.SIGCONT)
        rc = job.wait()
        assert rc != 0, job.output()[-4000:]
        assert_no_rank_left(hosts)
        print(f"launcher ended while h2 was frozen: {launcher_ended_while_frozen}")
    finally:
        end_leftovers(hosts, "h2")
    step = checkpoint_after_the_fault(out, job, phase, write_completed=True)
    if step is not None:
        resume_to_the_end(hosts, ["h1", "h2"], out, step)


# -- 3. a rank killed, a host's whole process tree killed ----------------------------------
@pytest.mark.parametrize("what, phase", [("rank", "training"), ("host", "training"),
                                         ("rank", "start-up"), ("rank", "checkpoint"),
                                         ("host", "checkpoint")])
def test_a_killed_rank_or_host_ends_the_job_naming_it(hosts, what, phase):
    """SIGKILL of rank 1 on h2 (or of every process on h2: the launcher proxy as well): MPICH's
    launcher ends the job at once, exit non-zero, naming the host and pid when its proxy saw
    the rank die (with the proxy gone, MPICH names no one: a finding, docs/debugging.md); no
    rank is left anywhere and the last checkpoint loads. During a checkpoint write the launcher
    kills rank 0 in the middle of it: that file never takes a checkpoint's name, and `--resume
    auto` on both hosts loads the one before."""
    out = hosts.workdir(f"kill-{what}-{phase}") / "run"
    job = Job(hosts, ["h1", "h2"], out, PHASE_ENV[phase])
    try:
        reach(job, phase)
        if what == "rank":
            victims = [pid for pid, _, cmd in processes(hosts, "h2") if is_rank(cmd)]
            assert victims
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
        else:
            # every process but the namespace holder (the host itself stays for later tests)
            assert any("hydra_pmi_proxy" in c for c in signal_host(hosts, "h2", signal.SIGKILL))
        job.fault()
        rc = job.wait()
        text = job.output()
        assert rc != 0, text[-4000:]
        if what == "rank":  # MPICH names the host; with the proxy gone it names no one
            assert "RUNNING AT h2" in text and "EXIT CODE: 9" in text, text[-4000:]
        else:
            assert "[mpiexec@h1]" in text and "assert (!closed) failed" in text, text[-4000:]
        assert_no_rank_left(hosts)
        print(text[-1500:])
    finally:
        end_leftovers(hosts, "h2")
    # the launcher kills rank 0 in the middle of its write: the checkpoint before it loads
    step = checkpoint_after_the_fault(out, job, phase, write_completed=False)
    if phase == "checkpoint":
        resume_to_the_end(hosts, ["h1", "h2"], out, step)


# -- 4. a link degraded to a trickle ----------------------------------------------------------
@pytest.mark.parametrize("phase", ["training", "start-up", "checkpoint"])
def test_a_link_shaped_to_a_trickle_is_slow_not_dead_and_the_report_says_slow_link(hosts, phase):
    """h2's link shaped to 1 mbit/s (tbf) for 12 s, abort limit 60 s: a gradient allreduce
    (~350 kB) then takes seconds, past the warn limit; in training the report's verdict is
    "slow link" (every rank alive and inside the collective), "stall over" follows, and the job
    trains to the end, exit 0. At start-up and during a checkpoint write (where rank 1 waits
    for rank 0's write, and says so) no verdict may say "rank gone"."""
    out = hosts.workdir(f"trickle-{phase}") / "run"
    job = Job(hosts, ["h1", "h2"], out, {"HPCDL_STALL_ABORT_S": "60", **PHASE_ENV[phase]})
    try:
        reach(job, phase)
        hosts.script("shape", "h2", "1mbit")
        time.sleep(12)
    finally:
        hosts.script("shape", "h2", "off")
    rc = job.wait(timeout=300)
    text = job.output()
    assert rc == 0, text[-4000:]
    stalls = [ln for ln in text.splitlines() if "stall" in ln or "verdict:" in ln]
    print("\n" + "\n".join(stalls))
    if phase == "training":
        assert any("verdict: slow link" in ln for ln in stalls), stalls or text[-4000:]
    assert not any("rank gone" in ln for ln in stalls), stalls
    assert "stall: aborting" not in text, text[-4000:]
    assert "stall over:" in text + job.rank_log(1), stalls or text[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["stopped"]) == (STEPS, "completed"), summary
    assert_no_rank_left(hosts)


# -- 5. the run directory's file system fills up during a checkpoint -----------------------
def test_a_full_file_system_during_a_checkpoint_names_the_file_and_keeps_the_previous_one(hosts):
    """A 20 MB tmpfs under the run directory, filled (but 128 kB) once the first checkpoint is
    there: the next checkpoint write fails with ENOSPC; every rank exits 2 with rank 0's line
    naming the file and the errno; the previous checkpoint is intact, and once space is freed
    `--resume auto` trains to the end. The tmpfs is h1's own (a mount made in the root namespace
    after the hosts were made does not reach their private mount namespaces), so this job runs
    two ranks on h1."""
    base = hosts.workdir("full")
    out = base / "run"

    def on_h1(command: str) -> str:
        return hosts.run("h1", command, check=True).stdout

    on_h1(f"mount -t tmpfs -o size=20m tmpfs {base}")
    try:
        job = Job(hosts, ["h1"], out, per_host=2)
        ckpts = out / "checkpoints"
        wait_until(lambda: "ckpt-" in hosts.run("h1", f"ls {ckpts} 2>/dev/null").stdout
                   or job.process.poll() is not None, "the first checkpoint", 300)
        # the job keeps writing meanwhile: measure and fill again until fallocate fits
        on_h1(f"for i in 1 2 3 4 5 6 7 8; do fallocate -l $(( $(df --output=avail -B1 {base} "
              f"| tail -1) - 131072 )) {base}/filler && break; sleep 0.2; done")
        job.fault()
        rc = job.wait()
        text = job.output()
        assert rc == 2, text[-4000:]
        lines = [ln for ln in text.splitlines() if "could not write checkpoint" in ln]
        assert lines, text[-4000:]
        print(f"\n{lines[0]}")
        # both ranks write into the full tmpfs; whether the other one failed too depends on
        # where its write stood, and the line then counts it
        failed = re.search(r"checkpoint (\S+/ckpt-0*(\d+)\.pt): \[Errno 28\] No space left on "
                           r"device(?: \(and \d+ other rank\(s\)\))?; the previous checkpoint "
                           r"\S+/ckpt-0*(\d+)\.pt is intact", lines[0])
        assert failed, lines[0]
        kept = int(failed.group(3))
        listing = on_h1(f"ls {ckpts}")
        assert failed.group(1).rsplit("/", 1)[1] not in listing  # no half-written file
        assert not [n for n in listing.split() if not n.endswith(".pt")], listing
        assert_no_rank_left(hosts)
        on_h1(f"rm {base}/filler")
        done = hosts.mpirun("mpich", ["h1"], 1,
                            f"hpcdl train --recipe {DEMO_RECIPE} --data {hosts.shards} "
                            f"--out {out} --resume auto {TRAIN}", env=STALL, check=False,
                            timeout=400)
        resumed = done.stdout + done.stderr
        assert done.returncode == 0, resumed[-4000:]
        assert re.search(rf"resumed from \S+ckpt-0*{kept}\.pt at step {kept}\b", resumed)
        summary = json.loads(on_h1(f"cat {out}/summary.json"))
        assert (summary["steps"], summary["ranks"]) == (STEPS, 1), summary
    finally:
        hosts.run("h1", f"umount {base}")


# -- 6. under Slurm, a node set DOWN mid-job ------------------------------------------------
def test_a_node_set_down_under_slurm_requeues_the_job_which_resumes_on_the_other_hosts(
        slurm_on_fresh_hosts, shards):
    """sbatch -N 2 (h1, h2) of the rendered template; at step 8 h2 is set DOWN (`scontrol
    update nodename=h2 state=down`): Slurm kills the job's steps and requeues it (JobRequeue=1,
    a node failure), it starts again on two idle hosts by itself, the job body's `--resume auto`
    continues from the last checkpoint to the uninterrupted step count, and the job ends
    COMPLETED with exit code 0. Nobody touches the job in between."""
    slurm = slurm_on_fresh_hosts
    run_dir = slurm.workdir("run") / "node-down"
    script = render(slurm, shards, run_dir, "2", "epochs=6", "train.checkpoint_every_steps=5")
    job = on_controller(slurm, f"HPCDL_DOCTOR=0 sbatch --parsable {script}"
                        ).stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"

    def state() -> str:
        return job_field(slurm, job, "JobState")

    try:
        wait_until(lambda: metrics.exists() and metrics.read_text().count('"step"') >= 8,
                   "step 8", 300)
        on_controller(slurm, "scontrol update nodename=h2 state=down reason=fault-test")
        wait_until(lambda: not ranks_left(slurm)["h2"], "h2's rank to be killed", 120)
        wait_until(lambda: state() in ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL",
                                       "TIMEOUT"), "the end", 400)
    finally:
        on_controller(slurm, "scontrol update nodename=h2 state=resume", check=False)
    log = next((run_dir / "logs").glob("slurm-*.out")).read_text()
    print("\n" + "\n".join(ln for ln in log.splitlines() if "restart" in ln or "exit" in ln))
    assert state() == "COMPLETED" and job_field(slurm, job, "ExitCode") == "0:0", log[-4000:]
    assert int(job_field(slurm, job, "Restarts")) >= 1, log[-4000:]
    starts = re.findall(r"restart (\d) on (\S+): (\d) node", log)
    # The requeued job starts by itself once Slurm's requeue delay (the test cluster's
    # AuthInfo cred_expire, 30 s) is over, on any
    # 2 idle hosts: h2 too, since it re-registered (ReturnToService=2 returns a DOWN node).
    assert starts[0] == ("0", "h[1-2]", "2") and starts[-1][0] != "0", starts
    assert starts[-1][2] == "2", starts
    assert re.search(r"resumed from \S+ckpt-\d+\.pt at step [1-9]", log), log[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["stopped"]) == (7 * 6, "completed"), summary  # epochs=6
