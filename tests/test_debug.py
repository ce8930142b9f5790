"""hpcdl.debug in one process: logging, timeline, fault formatting, stall report logic."""
import json
import logging
import os
import sys
import threading
import time

import pytest

from hpcdl.debug import Timeline, setup_rank_logging
from hpcdl.debug.faults import format_rank_traceback
from hpcdl.debug.monitor import CollectiveMonitor, InjectedFault, parse_injection
from hpcdl.debug.stall import (
    STALL_EXIT_CODE,
    StallThresholds,
    StallWatchdog,
    format_stall_report,
    not_arrived,
    read_heartbeats,
    thresholds_from_env,
    write_heartbeat,
)


@pytest.fixture(autouse=True)
def _reset_logging():
    yield
    setup_rank_logging(None, 0, 1, "warning")


def test_rank_log_lines_carry_rank_size_and_host(tmp_path):
    log = setup_rank_logging(str(tmp_path), 3, 8, "info")
    logging.getLogger("hpcdl.train").info("step 1 loss 6.9")
    log.debug("hidden at info level")
    text = (tmp_path / "logs" / "rank-0003.log").read_text()
    assert f"[rank 3/8 {os.uname().nodename}] INFO hpcdl.train: step 1 loss 6.9" in text
    assert "hidden" not in text


def test_hpcdl_debug_env_raises_verbosity(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCDL_DEBUG", "1")
    log = setup_rank_logging(str(tmp_path), 0, 1, "error")
    log.debug("visible in debug mode")
    assert "visible in debug mode" in (tmp_path / "logs" / "rank-0000.log").read_text()


def test_unknown_log_level_is_named():
    with pytest.raises(ValueError, match="'loud'"):
        setup_rank_logging(None, 0, 1, "loud")


def test_timeline_writes_complete_events_per_thread(tmp_path):
    path = tmp_path / "timeline.json"
    timeline = Timeline(str(path), rank=2)
    with timeline.span("forward", "compute"):
        pass

    def reduce_bucket():
        with timeline.span("allreduce bucket 0", "comm", bytes=64):
            pass

    worker = threading.Thread(target=reduce_bucket, name="hpcdl-comm")
    worker.start()
    worker.join()
    assert timeline.save() == str(tmp_path / "timeline.rank-0002.json")
    events = json.loads((tmp_path / "timeline.rank-0002.json").read_text())["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert spans["forward"]["pid"] == 2 and spans["forward"]["dur"] >= 0
    assert spans["forward"]["tid"] != spans["allreduce bucket 0"]["tid"]
    assert spans["allreduce bucket 0"]["args"] == {"bytes": 64}
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"MainThread", "hpcdl-comm"}


def test_disabled_timeline_records_and_writes_nothing(tmp_path):
    timeline = Timeline(None)
    with timeline.span("forward", "compute"):
        pass
    assert not timeline.enabled and timeline.events() == [] and timeline.save() is None


def test_timeline_bounds_memory_and_counts_drops(tmp_path):
    timeline = Timeline(str(tmp_path / "t.json"), max_events=3)
    for _ in range(5):
        timeline.complete("step", "train", time.perf_counter(), 0.001)
    timeline.save()
    trace = json.loads((tmp_path / "t.json").read_text())
    assert trace["otherData"]["dropped_events"] == 3  # 1 thread-name event + 2 spans kept


def test_traceback_lines_are_prefixed_with_the_rank():
    try:
        raise ValueError("bad shard 7")
    except ValueError:
        text = format_rank_traceback(5, 16, *sys.exc_info())
    lines = text.splitlines()
    assert all(line.startswith("[rank 5/16 ") for line in lines)
    assert "ValueError: bad shard 7" in lines[-1]


def test_thresholds_come_from_env_unless_given():
    env = {"HPCDL_STALL_WARN_S": "2", "HPCDL_STALL_ABORT_S": "6"}
    assert thresholds_from_env(environ=env) == StallThresholds(2.0, 6.0)
    assert thresholds_from_env(warn_s=1, environ=env) == StallThresholds(1.0, 6.0)
    assert thresholds_from_env(environ={}) == StallThresholds(60.0, 600.0)


def test_bad_thresholds_are_named():
    with pytest.raises(ValueError, match="HPCDL_STALL_WARN_S='soon'"):
        thresholds_from_env(environ={"HPCDL_STALL_WARN_S": "soon"})
    with pytest.raises(ValueError, match="below"):
        StallThresholds(warn_s=10, abort_s=5)


def _beat(rank, seq, in_collective, name="allreduce", activity=""):
    return {"rank": rank, "seq": seq, "name": name, "bucket": None, "in_collective": in_collective,
            "since": 100.0, "activity": activity, "activity_since": 101.0, "host": "n1", "pid": 7}


def test_stall_report_names_ranks_behind_and_what_they_did():
    beats = {0: _beat(0, 42, True), 1: _beat(1, 41, False, activity="data wait"),
             2: _beat(2, 42, True)}
    assert not_arrived(42, 4, beats) == [1, 3]
    report = format_stall_report(0, 4, 42, "allreduce", 61.0, beats, now=161.0)
    assert "2 of 4 rank(s) have not arrived: 1,3" in report
    assert "rank 1: last finished #41 allreduce 61.0 s ago; then: data wait (60.0 s ago)" in report
    assert "rank 3: no heartbeat" in report


def test_stall_report_spots_ranks_waiting_in_different_collectives():
    beats = {0: {**_beat(0, 4, True), "signature": "shapes=[(4,)]"},
             1: {**_beat(1, 4, True, name="signature check of allreduce"),
                 "signature": "shapes=[(5,)]"}}
    report = format_stall_report(0, 2, 4, "allreduce", 61.0, beats, now=161.0)
    assert "every rank has arrived but they are in DIFFERENT collectives at #4" in report
    assert "rank 0: allreduce(shapes=[(4,)])" in report
    assert "rank 1: signature check of allreduce(shapes=[(5,)])" in report


def test_heartbeats_of_an_earlier_job_are_ignored(tmp_path):
    write_heartbeat(str(tmp_path), {**_beat(0, 3, True), "job": "old"})
    write_heartbeat(str(tmp_path), {**_beat(1, 3, True), "job": "new"})
    assert list(read_heartbeats(str(tmp_path), 2, "new")) == [1]


def test_injection_spec_parses_and_rejects_garbage():
    assert parse_injection("1:5:raise") == (1, 5, "raise", 0.0)
    assert parse_injection("0:3:sleep=2.5") == (0, 3, "sleep", 2.5)
    assert parse_injection("") is None
    with pytest.raises(ValueError, match="RANK:SEQ"):
        parse_injection("1:explode")
    # a slow checkpoint write is the trainer's: no collective is touched, and it only sleeps
    assert parse_injection("0:checkpoint:sleep=8") is None
    assert parse_injection("0:checkpoint2:sleep=8") is None
    with pytest.raises(ValueError, match="RANK:checkpointN:sleep"):
        parse_injection("0:checkpoint:raise")


def test_a_slow_checkpoint_write_is_rehearsed_on_its_rank_only_before_the_rename(tmp_path):
    from hpcdl.debug.inject import injected_pause
    from hpcdl.train import checkpoint as ckpt

    assert injected_pause(0, "checkpoint", "0:checkpoint:sleep=2.5") == (1, 2.5)
    assert injected_pause(0, "checkpoint", "0:checkpoint2:sleep=6") == (2, 6.0)
    assert injected_pause(1, "checkpoint", "0:checkpoint:sleep=2.5") == (0, 0.0)
    assert injected_pause(0, "checkpoint", "0:3:sleep=2.5") == (0, 0.0)
    seen = []
    path = tmp_path / "ckpt-000000001.pt"
    real_sleep = ckpt.time.sleep
    try:
        ckpt.time.sleep = lambda s: seen.append((s, sorted(p.name for p in tmp_path.iterdir())))
        ckpt.save_checkpoint(str(path), {k: 0 for k in ckpt._REQUIRED}, pause_s=0.5)
    finally:
        ckpt.time.sleep = real_sleep
    ((slept, during),) = seen
    assert slept == 0.5 and during[0].startswith(".ckpt-000000001.pt.") and path.name not in during
    assert path.exists()


def test_monitor_records_each_collective_in_order():
    monitor = CollectiveMonitor(rank=0, size=1, record=True)
    for bucket in (0, 1):
        with monitor.watch("allreduce", {"bucket": bucket, "shapes": [(4,)], "dtype": "float32",
                                         "bytes": 16}):
            assert monitor.state[4] is True  # in a collective while it runs
    assert [(r["seq"], r["bucket"], r["bytes"]) for r in monitor.records] == [(1, 0, 16),
                                                                             (2, 1, 16)]
    assert monitor.state[:2] == (2, "allreduce") and monitor.state[4] is False


def test_injected_fault_raises_on_the_named_rank_and_collective():
    monitor = CollectiveMonitor(rank=1, size=2, injection="1:2:raise")
    with monitor.watch("barrier", {}):
        pass
    with pytest.raises(InjectedFault, match="rank 1 raises before collective #2 barrier"):
        with monitor.watch("barrier", {}):
            pass
    assert CollectiveMonitor(rank=0, size=2, injection="1:2:raise").injection is None


def test_watchdog_reports_a_collective_waiting_past_warn(tmp_path):
    monitor = CollectiveMonitor(rank=0, size=2)
    aborts = []
    dog = StallWatchdog(monitor, StallThresholds(warn_s=1.0, abort_s=3.0), str(tmp_path), "j",
                        aborts.append)
    write_heartbeat(str(tmp_path), {**_beat(1, 0, False, activity="loading checkpoint"),
                                    "job": "j"})
    with monitor.watch("barrier", {}):
        since = monitor.state[3]
        dog.tick(since + 1.5)
        dog.tick(since + 3.5)
    assert "rank 1: last finished #0" in dog.reports[0] and "loading checkpoint" in dog.reports[0]
    assert aborts == [STALL_EXIT_CODE]


def test_timeline_saved_while_unwinding_writes_this_ranks_file_without_gathering(tmp_path):
    class NoGather:  # a gather here would wait forever for ranks stuck in an allreduce
        def gather(self, *args, **kwargs):
            raise AssertionError("gathered while an exception was unwinding")

    timeline = Timeline(str(tmp_path / "t.json"), rank=1, mpi_comm=NoGather())
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("rank 1 died")
        finally:
            assert timeline.save() == str(tmp_path / "t.rank-0001.json")


STACK_DUMP_JOB = """
import os, signal, sys, time
from hpcdl.debug import install_stack_dump, setup_rank_logging
setup_rank_logging(sys.argv[1], 0, 1, "info")
install_stack_dump()
def waiting_for_a_collective():
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.2)
waiting_for_a_collective()
"""


def test_sigusr2_dumps_every_threads_stack_into_the_rank_log(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "-c", STACK_DUMP_JOB, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr  # the process keeps running after a dump
    log = (tmp_path / "logs" / "rank-0000.log").read_text()
    assert "most recent call first" in log and "waiting_for_a_collective" in log


def test_hpcdl_dump_makes_a_rank_dump_its_stacks_periodically(tmp_path):
    import subprocess

    job = STACK_DUMP_JOB.replace("os.kill(os.getpid(), signal.SIGUSR2)", "time.sleep(0.6)")
    env = {**os.environ, "HPCDL_DUMP": "1", "HPCDL_DUMP_EVERY_S": "0.2"}
    out = subprocess.run([sys.executable, "-c", job, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    log = (tmp_path / "logs" / "rank-0000.log").read_text()
    assert log.count("waiting_for_a_collective") >= 2


def test_a_world_level_call_on_a_one_rank_communicator_is_not_called_one_host_slow():
    """LTFB watches its exchange with the partner trainer on the trainer's own communicator:
    with one rank there, "every rank is alive ... one host" would be false; the verdict points
    at the call's name, which names the partner's ranks and hosts."""
    from hpcdl.debug.stall import stall_verdict

    verdict = stall_verdict(0, 1, 22, {}, ["h1"], now=100.0, stale_s=5.0, since=90.0)
    assert "outside this rank's communicator" in verdict and "one host" not in verdict
