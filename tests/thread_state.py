"""Waiting for a thread of this process to be asleep: its CPU clock has stopped, so
``/proc/self/task/TID/schedstat`` (which a running thread's current slice does not reach
yet) holds all it has run. For the tests of hpcdl.host.thread_cpu_s and the bench's counters."""
import time


def is_asleep(tid: int) -> bool:
    """Whether thread ``tid`` sleeps (state S of ``/proc/self/task/TID/stat``)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        # the name (field 2) may hold spaces: fields are counted after its ')'
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def wait_until_asleep(*tids: int) -> None:
    while not all(is_asleep(tid) for tid in tids):
        time.sleep(0.001)
