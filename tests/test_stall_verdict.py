"""The stall watchdog's verdict and its way out, in one process (hpcdl/debug/stall.py).

Under a real mpiexec: tests/test_stall_mpi.py. Here: the pure verdict ("rank gone" vs "slow
link" vs "not heard from") over heartbeat dicts, the rank that ends itself when MPI_Abort has
not ended it, its dump on disk, and the children it takes with it."""
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest

from hpcdl.debug.monitor import CollectiveMonitor
from hpcdl.debug.stall import (
    STALL_EXIT_CODE,
    StallThresholds,
    StallWatchdog,
    classify_peers,
    current_frames,
    kill_child_processes,
    read_heartbeats,
    stall_dump_path,
    stall_verdict,
    thresholds_from_env,
    utc_clock,
    write_heartbeat,
)

HOSTS = ["h1", "h1", "h2", "h3"]


def _beat(rank, seq, in_collective, beat, host=None):
    return {"rank": rank, "seq": seq, "name": "allreduce", "in_collective": in_collective,
            "since": beat - 1, "activity": "", "activity_since": beat - 1, "beat": beat,
            "host": host or HOSTS[rank], "pid": 100 + rank}


def test_a_peer_whose_heartbeat_stopped_is_gone_one_that_beats_is_alive():
    now = 1000.0
    beats = {0: _beat(0, 7, True, now), 1: _beat(1, 6, False, now - 50.0),
             2: _beat(2, 6, False, now - 1.0), 3: _beat(3, 7, True, now - 2.0)}
    kinds = classify_peers(0, 4, 7, beats, HOSTS, now, stale_s=10.0, since=now - 60.0)
    assert kinds == {"gone": [1], "unheard": [], "busy": [2], "waiting": [3]}


def test_a_peer_blocked_in_a_raw_mpi_call_waits_on_data_it_is_not_busy():
    """Measured on the test cluster: h2's link cut while rank 1 was in the trainer's raw loss
    allreduce and rank 0, past it, in the next gradient allreduce: rank 1 waits on data in
    flight (slow link), it is not "busy outside collectives"."""
    now = 1000.0
    beats = {0: _beat(0, 25, True, now), 1: {**_beat(1, 24, False, now - 1.0, host="h2"),
                                             "blocked_in": "MPI Allreduce at trainer.py:466"}}
    kinds = classify_peers(0, 2, 25, beats, ["h1", "h2"], now, stale_s=10.0, since=now - 10.0)
    assert kinds["waiting"] == [1] and kinds["busy"] == []
    line = stall_verdict(0, 2, 25, beats, ["h1", "h2"], now, stale_s=10.0, since=now - 10.0)
    assert line.startswith("slow link:") and "between hosts h1,h2" in line, line


def test_a_stale_heartbeat_from_before_the_wait_counts_from_when_the_wait_began():
    # Healthy ranks do not write: rank 1's last beat is from start-up, but collective #6
    # completed (so rank 1 answered) 8 s ago -- not yet silent for stale_s.
    now = 1000.0
    beats = {0: _beat(0, 7, True, now), 1: _beat(1, 3, False, now - 300.0)}
    assert classify_peers(0, 2, 7, beats, HOSTS, now, stale_s=10.0,
                          since=now - 8.0)["gone"] == []
    line = stall_verdict(0, 2, 7, beats, HOSTS, now, stale_s=10.0, since=now - 40.0)
    assert line.startswith(f"rank gone: rank 1 on h1 silent since {utc_clock(now - 40.0)} (40 s;")


def test_silence_counts_as_gone_only_where_the_heartbeat_would_be_visible():
    now = 1000.0
    beats = {0: _beat(0, 7, True, now)}  # only our own: h2 and h3 write elsewhere
    kinds = classify_peers(0, 4, 7, beats, HOSTS, now, stale_s=10.0, since=now - 60.0)
    assert kinds["gone"] == [1]            # on our host: it would have written here
    assert kinds["unheard"] == [2, 3]      # other hosts' directories: we cannot know
    early = classify_peers(0, 4, 7, beats, HOSTS, now, stale_s=10.0, since=now - 5.0)
    assert early["gone"] == [] and early["unheard"] == [1, 2, 3]  # not yet had time to write


def test_the_verdict_names_the_gone_rank_its_host_and_since_when():
    now = 1000.0
    beats = {0: _beat(0, 7, True, now), 1: _beat(1, 7, True, now - 1.0),
             2: _beat(2, 6, False, now - 40.0), 3: _beat(3, 7, True, now - 1.0)}
    line = stall_verdict(0, 4, 7, beats, HOSTS, now, stale_s=10.0, since=now - 45.0)
    assert line == (f"rank gone: rank 2 on h2 silent since {utc_clock(now - 40.0)} (40 s; "
                    f"frozen, killed or cut off)")
    assert "\n" not in line


def test_every_rank_alive_inside_the_collective_reads_as_a_slow_link_between_the_hosts():
    now = 1000.0
    beats = {r: _beat(r, 7, True, now - 1.0) for r in range(4)}
    line = stall_verdict(0, 4, 7, beats, HOSTS, now, stale_s=10.0, since=now - 45.0)
    assert line.startswith("slow link: every rank is alive and inside #7 since ")
    assert line.endswith("between hosts h1,h2,h3")


def test_a_peer_waiting_in_the_next_collective_is_cut_off_not_busy():
    # Seen on the test cluster (link down at start-up): rank 1's share of #1 was an eager send
    # that completed into the dead link, so rank 1 waits in #2 while rank 0 waits in #1.
    now = 1000.0
    beats = {0: _beat(0, 1, True, now), 1: _beat(1, 2, True, now - 1.0, host="h2")}
    kinds = classify_peers(0, 2, 1, beats, ["h1", "h2"], now, stale_s=10.0, since=now - 30.0)
    assert kinds["waiting"] == [1] and kinds["busy"] == []
    line = stall_verdict(0, 2, 1, beats, ["h1", "h2"], now, stale_s=10.0, since=now - 30.0)
    assert line.startswith("slow link: every rank is alive and inside collectives #1, #2 "), line
    # seen from rank 1: rank 0, alive in the earlier #1, waits for what rank 1 sent
    assert classify_peers(1, 2, 2, beats, ["h1", "h2"], now, stale_s=10.0,
                          since=now - 30.0)["waiting"] == [0]


def test_ranks_of_other_hosts_without_heartbeats_are_not_heard_from_since_our_wait_began():
    now = 1000.0
    beats = {0: _beat(0, 7, True, now), 1: _beat(1, 7, True, now)}
    line = stall_verdict(0, 4, 7, beats, HOSTS, now, stale_s=10.0, since=now - 30.0)
    assert line.startswith(f"not heard from since {utc_clock(now - 30.0)} (30 s): ranks 2 on h2, "
                           f"3 on h3 (no heartbeat here")


def test_exit_grace_comes_from_the_environment():
    env = {"HPCDL_STALL_WARN_S": "2", "HPCDL_STALL_ABORT_S": "6", "HPCDL_STALL_EXIT_GRACE_S": "1"}
    assert thresholds_from_env(environ=env) == StallThresholds(2.0, 6.0, 1.0)
    with pytest.raises(ValueError, match="HPCDL_STALL_EXIT_GRACE_S='later'"):
        thresholds_from_env(environ={"HPCDL_STALL_EXIT_GRACE_S": "later"})


def test_a_rank_whose_abort_reaches_no_one_dumps_its_state_and_ends_itself(tmp_path):
    monitor = CollectiveMonitor(rank=1, size=2)
    aborts, exits = [], []
    dog = StallWatchdog(monitor, StallThresholds(warn_s=1.0, abort_s=2.0, exit_grace_s=0.0),
                        str(tmp_path), "j", aborts.append, hosts=["h1", "h2"],
                        exit_process=exits.append)  # MPI_Abort that returns, like a cut-off one
    with monitor.watch("allreduce", {}):
        since = monitor.state[3]
        dog.tick(since + 2.5)
    assert exits == [STALL_EXIT_CODE]
    dump = open(stall_dump_path(str(tmp_path), 1)).read()
    first, second = dump.splitlines()[:2]
    assert first.startswith("stall: aborting the job (MPI_Abort 4) after 2.5 s > "
                            "HPCDL_STALL_ABORT_S=2 in #1 allreduce on rank 1 (")
    assert "not heard from since" in first and "rank 0 on h1" in first
    assert second.startswith("stall: MPI_Abort did not end rank 1 (") and \
        "the rank ends itself with exit 4" in second
    assert "in tick" in dump  # every thread's Python stack
    for _ in range(100):  # the abort runs on its own thread (it may block, or return)
        if aborts:
            break
        time.sleep(0.05)
    assert aborts == [STALL_EXIT_CODE]


def test_a_caller_supplied_abort_owns_the_end_and_is_called_once(tmp_path):
    monitor = CollectiveMonitor(rank=0, size=2)
    aborts = []
    dog = StallWatchdog(monitor, StallThresholds(warn_s=1.0, abort_s=2.0), str(tmp_path), "j",
                        aborts.append)
    with monitor.watch("barrier", {}):
        since = monitor.state[3]
        for dt in (2.5, 3.0, 3.5):
            dog.tick(since + dt)
    assert aborts == [STALL_EXIT_CODE]


def test_a_quiet_rank_keeps_its_heartbeat_fresh(tmp_path):
    monitor = CollectiveMonitor(rank=0, size=1)
    dog = StallWatchdog(monitor, StallThresholds(warn_s=40.0, abort_s=0), str(tmp_path), "j",
                        None)
    with monitor.watch("barrier", {}):
        since = monitor.state[3]
        dog.tick(since + dog.quiet_s)
        assert dog.wait_published(10)  # written on a thread of its own
        first = read_heartbeats(str(tmp_path), 1, "j")[0]["beat"]
        dog.tick(since + dog.quiet_s + dog.beat_s)
        assert dog.wait_published(10)
        second = read_heartbeats(str(tmp_path), 1, "j")[0]["beat"]
    assert second - first == pytest.approx(dog.beat_s)


def test_a_warned_collective_that_completes_is_reported_as_slow_not_dead(tmp_path, caplog):
    monitor = CollectiveMonitor(rank=0, size=2)
    dog = StallWatchdog(monitor, StallThresholds(warn_s=1.0, abort_s=0), str(tmp_path), "j",
                        None, hosts=["h1", "h2"])
    with caplog.at_level(logging.WARNING, logger="hpcdl"):
        with monitor.watch("allreduce", {}):
            since = monitor.state[3]
            write_heartbeat(str(tmp_path), {**_beat(1, 1, True, since + 1.4, host="h2"),
                                            "job": "j"})  # alive, waiting in #1 too
            dog.tick(since + 1.5)
        dog.tick(monitor.state[3] + 0.1)
    assert "verdict: slow link" in dog.reports[0]
    assert any("stall over: collective #1 allreduce completed after" in r.getMessage()
               and "(slow, not dead)" in r.getMessage() for r in caplog.records)


def _wait_until_in(thread: threading.Thread, function: str) -> None:
    """Until ``thread``'s newest frame is ``function``'s (it has reached the call it blocks
    in): the watchdog's first look must already see it there."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)
        if frame is not None and frame.f_code.co_name == function:
            time.sleep(0.05)  # from the function's first instruction into its blocking call
            return
        time.sleep(0.01)
    pytest.fail(f"{thread.name} never reached {function}")


def test_a_warned_raw_mpi_call_that_returns_is_reported_as_slow_not_dead(tmp_path, caplog):
    # Seen on the test cluster (a link down for 20 s): rank 0 waited in the trainer's raw
    # loss Allreduce, warned, and the call returned once the link was back.
    r, w = os.pipe()
    Barrier = os.read  # noqa: N806 - a C call under a blocking MPI name, as mpi4py's are
    worker = threading.Thread(target=lambda: Barrier(r, 1))  # blocks until released
    worker.start()
    _wait_until_in(worker, "<lambda>")
    monitor = CollectiveMonitor(rank=0, size=2)
    dog = StallWatchdog(monitor, StallThresholds(warn_s=1.0, abort_s=0), str(tmp_path), "j",
                        None, hosts=["h1", "h2"])
    dog._main_ident = worker.ident  # watch the worker as if it were the main thread
    with caplog.at_level(logging.WARNING, logger="hpcdl"):
        t0 = time.time()
        dog.tick(t0)
        dog.tick(t0 + 1.5)
        assert dog.reports and "in MPI Barrier at" in dog.reports[0]
        os.write(w, b"x")
        worker.join()
        os.close(r)
        os.close(w)
        dog.tick(t0 + 2.0)
    assert any("stall over: MPI Barrier at" in r.getMessage() and "completed after 2.0 s "
               "(slow, not dead)" in r.getMessage() for r in caplog.records)


def test_a_main_thread_waiting_on_a_thread_blocked_in_a_file_write_is_named_as_such(
        tmp_path, caplog):
    # Seen in CI on a hung run directory: rank 0's main thread waited in TensorBoard's
    # ``flush()`` (a queue join, no file call of its own) for the event writer's thread, which
    # was blocked in its write; the report named no call and the peer's abort came first.
    r, w = os.pipe()
    write = os.read  # a C call under a file-system name that blocks until released
    writer = threading.Thread(target=lambda: write(r, 1), name="event-writer")
    writer.start()
    waiter = threading.Thread(target=writer.join)  # the "main" thread: waits, calls no file
    waiter.start()
    _wait_until_in(writer, "<lambda>")
    _wait_until_in(waiter, "_wait_for_tstate_lock")
    monitor = CollectiveMonitor(rank=0, size=2)
    dog = StallWatchdog(monitor, StallThresholds(warn_s=1.0, abort_s=0), str(tmp_path), "j",
                        None, hosts=["h1", "h2"])
    dog._main_ident = waiter.ident
    with caplog.at_level(logging.WARNING, logger="hpcdl"):
        t0 = time.time()
        dog.tick(t0)
        dog.tick(t0 + 1.5)
        assert dog.reports and "in file system: write at" in dog.reports[0]
        assert "on thread 'event-writer' (the main thread waits for it)" in dog.reports[0]
        os.write(w, b"x")
        waiter.join()
        os.close(r)
        os.close(w)
        dog.tick(t0 + 2.0)
    assert any("stall over: file system: write at" in r.getMessage() for r in caplog.records)


def test_a_main_thread_in_a_file_call_its_frame_does_not_name_is_named_from_the_kernel(
        tmp_path):
    # Seen in CI on a hung run directory: rank 0 blocked at the end of a ``with open(...)``
    # (the implicit close); its frame named no call, so it never reported.
    from hpcdl.debug.stall import thread_syscall

    if thread_syscall(threading.get_native_id()) is None:
        pytest.skip("needs Linux x86_64's /proc/self/task/TID/syscall")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opener = open  # the frame names "opener": only the kernel says it is a file call
    reader = threading.Thread(target=lambda: opener(fifo, "rb").close())  # until a writer opens
    reader.start()
    _wait_until_in(reader, "<lambda>")
    monitor = CollectiveMonitor(rank=0, size=2)
    dog = StallWatchdog(monitor, StallThresholds(warn_s=1.0, abort_s=0), str(tmp_path), "j",
                        None, hosts=["h1", "h2"])
    dog._main_ident, dog._main_native_id = reader.ident, reader.native_id
    t0 = time.time()
    dog.tick(t0)
    dog.tick(t0 + 1.5)
    open(fifo, "wb").close()
    reader.join()
    assert dog.reports and "in file system: open" in dog.reports[0]


def test_the_rank_that_ends_itself_takes_its_children_along():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert child.pid in kill_child_processes()
        assert child.wait(timeout=30) == -9
    finally:
        if child.poll() is None:
            child.kill()


def test_heartbeat_records_are_json_a_person_can_read(tmp_path):
    monitor = CollectiveMonitor(rank=0, size=1)
    dog = StallWatchdog(monitor, StallThresholds(warn_s=5.0, abort_s=0), str(tmp_path), "j", None)
    dog.tick(monitor.state[3] + dog.quiet_s)
    assert dog.wait_published(10)  # written on a thread of its own
    record = json.load(open(os.path.join(tmp_path, "rank-0000.json")))
    assert {"host", "pid", "seq", "in_collective", "beat"} <= set(record)


def test_a_file_system_that_never_answers_does_not_hold_the_abort(tmp_path, monkeypatch):
    """Heartbeat writes and reads that never return (a hung file system, not an error): the
    watchdog still reports and aborts on time, saying why it knows less."""
    import hpcdl.debug.stall as stall

    hang = threading.Event()
    monkeypatch.setattr(stall, "write_heartbeat", lambda directory, record: hang.wait())
    monkeypatch.setattr(stall, "read_heartbeats", lambda *args: hang.wait() or {})
    monkeypatch.setattr(stall, "IO_WAIT_S", 0.2)
    aborts = []
    monitor = CollectiveMonitor(rank=0, size=2)
    dog = StallWatchdog(monitor, StallThresholds(warn_s=1.0, abort_s=2.0), str(tmp_path), "j",
                        aborts.append, hosts=["h1", "h2"])
    try:
        with monitor.watch("allreduce", {}):
            since = monitor.state[3]
            ticks = threading.Thread(target=lambda: [dog.tick(since + t) for t in (1.0, 2.5)],
                                     daemon=True)
            ticks.start()
            ticks.join(60)
        assert not ticks.is_alive(), "the watchdog blocked in the file system"
    finally:
        hang.set()
    assert aborts == [STALL_EXIT_CODE]
    assert "did not answer within 0.2 s" in dog.reports[0]


def test_a_rank_that_goes_quiet_every_step_writes_its_heartbeat_at_most_once_per_beat(
        tmp_path, monkeypatch):
    """Steps with a collective-free gap longer than quiet_s, one after another: the rank
    writes at most once per beat_s (was: once per such step, on every rank, in one
    directory)."""
    import hpcdl.debug.stall as stall

    writes = []
    monkeypatch.setattr(stall, "write_heartbeat", lambda directory, record: writes.append(1))
    monitor = CollectiveMonitor(rank=0, size=1)
    dog = StallWatchdog(monitor, StallThresholds(warn_s=60.0, abort_s=0), str(tmp_path), "j",
                        None)
    start = monitor.state[3]
    steps, gap_s = 30, dog.quiet_s + 0.5  # 30 steps, each quiet for longer than quiet_s
    for step in range(steps):
        t = start + step * gap_s
        monitor.state = (step + 1, "allreduce", {}, t, False)  # a collective just ended
        dog.tick(t + dog.quiet_s)
        dog.wait_published(10)
    span_s = steps * gap_s
    assert 1 <= len(writes) <= span_s / dog.beat_s + 1


FRAMES_UNDER_COLLECTION = """
import gc, threading, time
from hpcdl.debug.stall import current_frames

def leaf():
    x = 0
    for _ in range(1000):
        x += 1
    return x

def busy():  # inside a fresh leaf() frame at most looks: each look creates frame objects
    while True:
        leaf()

for _ in range(20):
    threading.Thread(target=busy, daemon=True).start()
time.sleep(0.2)
for _ in range(30):
    gc.collect()               # the young generation's count back to 0
    cycle = threading.local()  # garbage whose finalizer takes the thread-list lock
    cycle.me = cycle
    del cycle
    gc.set_threshold(10)       # a collection some 10 allocations in: amid the 20 frames
    current_frames()
    gc.set_threshold(700)
print("looked 30 times")
"""


class Held:
    """Something a thread's frame holds in a local (a step's tensor, in a run)."""


def test_the_watchdogs_look_at_the_threads_keeps_no_frame_alive_after_it():
    """The look puts no frame into a reference cycle: what a thread's frame held is freed as
    soon as that thread's function returns, without the cyclic collector. (It once kept the
    main thread's frames, and the step's gradients in them, alive until a collection.)"""
    ready, go, held = threading.Event(), threading.Event(), []

    def holder():
        local = Held()
        held.append(weakref.ref(local))
        ready.set()
        go.wait()

    def look():  # as the watchdog does: the frames in a local, then return
        frames = current_frames()
        return set(frames)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    ready.wait()
    gc.disable()
    try:
        seen = look()
        go.set()
        thread.join()
        assert held[0]() is None
    finally:
        go.set()
        gc.enable()
    assert thread.ident in seen and threading.get_ident() not in seen


def test_the_watchdogs_look_at_the_threads_survives_a_collection_inside_it():
    """The watchdog reads every thread's frame each poll; a garbage collection starting inside
    that read must not deadlock the rank (plain ``sys._current_frames()`` does, on 3.11)."""
    run = subprocess.run([sys.executable, "-c", FRAMES_UNDER_COLLECTION], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "looked 30 times" in run.stdout
