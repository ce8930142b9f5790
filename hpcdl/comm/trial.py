"""The backend and bucket layout a run uses, chosen by timing them on its own ranks at start.

A rule (hpcdl.topology.auto_backend_name: ``shm`` when a node holds several ranks, else
``mpi``) cannot know the interconnect, the MPI library's tuning or the model; a few allreduce
rounds of the run's own gradient buckets on the run's own communicator can. Each choice, with
its reason (docs/comm.md, "The start-up trial"):

- **What is timed is one step's communication, sampled**: the model's gradient buckets, laid
  out by the reducer's own rule (:func:`hpcdl.buckets.bucket_bounds`, in the wire dtype the
  candidate would send), allreduced in launch order on a thread whose waits yield, as the
  reducer's communication thread does -- the large buckets only up to
  :data:`~hpcdl.buckets.TRIAL_SAMPLE_MB` per round (the last bucket cut short; less on a link
  too slow for every candidate's rounds at that size to fit
  :data:`~hpcdl.buckets.TRIAL_FIT_SHARE` of the budget, :func:`fitted_sample_bytes`, the same
  size for every candidate), their time scaled by the bytes left out, and the first layers'
  bucket whole. A layout's score is the
  sum of its bucket times (what a step waits for when it is communication-bound) plus its
  last bucket's time (what nothing hides when backward covers the rest; the reason for the
  small last bucket, Li et al., VLDB 2020, §3.2.3), **plus the CPU its threads burn**: the
  rounds run beside backward's stand-in (matrix products on torch's intra-op threads, so
  they are timed under the contention a step has), and the CPU seconds of the threads the
  transport runs on (the rounds' own inside each call, and any it started,
  ``/proc/self/task``, read between calls; the timed rounds only) are scaled bucket by
  bucket as their times are and added -- one rank per socket computes on every
  core, so a progress engine polling beside backward costs the step compute even when its
  allreduce is as fast.
- **Agreed**: each score is the median over rounds of a rank's own, then the maximum over
  ranks (a collective is as slow as its slowest rank), in one allreduce; rank 0 picks the
  fastest (a later measurement must beat the earlier by :data:`TRIAL_MARGIN`, so noise
  does not flip a restart between equals; between equals, gloo, whose waits sleep in the
  kernel, replaces a transport that polls from Python: :func:`beats`) and broadcasts it, and
  every branch of the trial (stop, skip, exclude) follows values all ranks hold, so every
  rank opens the same backend.
- **Bounded**: coordinate descent instead of the full product -- first every candidate at
  the recipe's layout (the rule's candidate first), then the winner at the other bucket
  sizes (:data:`TRIAL_BUCKET_MB`), then the best of those without a first-layers bucket --
  and no measurement starts once the time spent plus the last measurement's would pass the
  budget, so a short budget still leaves the rule's candidate measured first.
- **A candidate that raises is excluded**, its reason agreed (the lowest failing rank's) and
  logged; if none can be timed, the rule decides.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from hpcdl.buckets import (
    LAST_BUCKET_BYTES,
    MIB,
    TRIAL_BUCKET_MB,
    TRIAL_FIT_SHARE,
    TRIAL_RUN_SHARE,
    TRIAL_SAMPLE_MB,
    bucket_bounds,
    bucket_bytes,
)
from hpcdl.comm.base import timed_allreduce_s, yield_waits_in_this_thread
from hpcdl.host import thread_cpu_s, thread_ids

__all__ = ["ComputeLoad", "LOAD_MATRIX", "Layout", "Measurement", "PROBE_BYTES", "PROBE_REPEATS",
           "POLLS_FROM_PYTHON", "TRIAL_MARGIN", "TRIAL_ROUNDS", "WAITS_IN_THE_KERNEL",
           "TrialResult", "beats", "bucket_numels", "choose",
           "fitted_sample_bytes", "layout_score", "round_cpu", "rule_result", "run_trial",
           "sampled_buckets", "transport_cpu_per_step", "trial_budget", "trial_candidates",
           "trial_layouts", "unavailable_backends"]

#: how much faster a later measurement must be to replace the best so far: the same
#: candidate's score moved by up to 4% between runs on the test cluster's shaped links, and
#: within the margin the earlier (the rule's pick, the recipe's layout) is kept -- unless a
#: transport that waits in the kernel ties with one that polls (:func:`beats`) -- so a restart
#: does not flip between equals. Not each measurement's own spread: three rounds on a shared
#: node estimate it too loosely, and a noisy first measurement then outlasted every later one
TRIAL_MARGIN = 0.05
#: transports whose waits test and sleep on a Python thread (hpcdl.comm.base.wait_yielding)
#: and those whose waits block in their own C++ threads; within the margin the second wins
#: (:func:`beats`). ``shm`` is in neither: within a node it has no equal to tie with.
POLLS_FROM_PYTHON = ("mpi", "ring")
WAITS_IN_THE_KERNEL = ("gloo",)
#: timed rounds per measurement, after one untimed round (the first call of a layout also
#: pays the mismatch check and first-touch page faults)
TRIAL_ROUNDS = 3
#: the compute load's matrix side: a product takes about a millisecond on one core, short
#: beside a round and long beside Python's loop around it
LOAD_MATRIX = 256
#: the world allreduce that probes the link's rate before the first candidate, to fit the
#: sample to the budget (large enough that its bytes, not its latency, set its time), and
#: how many times it is timed (the median of the slowest rank's)
PROBE_BYTES = MIB
PROBE_REPEATS = 3


@dataclass(frozen=True)
class Layout:
    """A bucket layout: the bucket cap and the first layers' bucket (0: none)."""

    bucket_mb: float
    first_bucket_mb: float

    @property
    def bucket_bytes(self) -> int:
        return bucket_bytes(self.bucket_mb)

    @property
    def last_bucket_bytes(self) -> int | None:
        """The reducer's ``last_bucket_bytes`` (its bucket is launched last)."""
        return bucket_bytes(self.first_bucket_mb) if self.first_bucket_mb else None


@dataclass
class Measurement:
    """One candidate at one layout: agreed score (seconds) over ``rounds`` timed rounds."""

    backend: str
    bucket_mb: float
    first_bucket_mb: float
    buckets: int
    rounds: int
    seconds: float
    #: the share of the layout's bytes each round reduced (sampled_buckets)
    timed_share: float = 1.0
    #: CPU seconds the transport's threads burn on one step's gradients
    #: (:func:`transport_cpu_per_step`; agreed: the largest over ranks); ``seconds``
    #: includes it (module docstring)
    transport_cpu_s: float = 0.0
    #: (median − fastest) ÷ median of a rank's round scores (agreed: the largest over ranks):
    #: how far the typical round fell from the best, for the reader of the record to judge
    #: a choice by (interference only ever slows a round)
    spread: float = 0.0

    @property
    def layout(self) -> Layout:
        return Layout(self.bucket_mb, self.first_bucket_mb)


@dataclass
class TrialResult:
    """What the trial chose and why; ``record()`` is summary.json's ``comm_trial``."""

    backend: str
    bucket_mb: float
    first_bucket_mb: float
    rule: str
    budget_s: float
    spent_s: float = 0.0
    planned: int = 0
    measurements: list[Measurement] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    fallback: str | None = None   # why the rule decided instead (None: the trial did)
    #: the large buckets' MiB each round reduced (fitted_sample_bytes; None: nothing timed)
    sample_mb: float | None = None
    #: after a resume: what the run resumed used (backend, bucket_mb, first_bucket_mb, steps)
    previous: dict[str, Any] | None = None

    @property
    def layout(self) -> Layout:
        return Layout(self.bucket_mb, self.first_bucket_mb)

    @property
    def rounds_run(self) -> int:
        return sum(m.rounds for m in self.measurements)

    def record(self) -> dict[str, Any]:
        return {"chosen": {"backend": self.backend, "bucket_mb": self.bucket_mb,
                           "first_bucket_mb": self.first_bucket_mb},
                "decided_by": "rule" if self.fallback else "trial",
                "fallback": self.fallback, "rule": self.rule,
                "budget_s": self.budget_s, "spent_s": round(self.spent_s, 4),
                "sample_mb": None if self.sample_mb is None else round(self.sample_mb, 3),
                "planned": self.planned, "rounds_run": self.rounds_run,
                "candidates": [asdict(m) for m in self.measurements],
                "excluded": dict(self.excluded), "previous": self.previous}

    def line(self) -> str:
        """The one line the run logs at start."""
        chosen = (f"comm: {self.backend}, buckets {self.bucket_mb:g} MiB, first bucket "
                  f"{self.first_bucket_mb:g} MiB")
        if self.fallback:
            return f"{chosen} (rule: {self.fallback})"
        times = ", ".join(f"{m.backend}@{m.bucket_mb:g}/{m.first_bucket_mb:g} "
                          f"{m.seconds * 1e3:.1f} ms" for m in self.measurements)
        out = "; ".join(f"{k}: {v}" for k, v in self.excluded.items())
        return (f"{chosen} (trial, {self.spent_s:.2f} s of {self.budget_s:g} s: {times}"
                f"{'; excluded ' + out if out else ''})")


# -- pure parts: what to try, how to score, what to pick ------------------------------------
def trial_budget(trial_s: float, run_s: float | None = None) -> float:
    """``comm.trial_s``, and at most :data:`TRIAL_RUN_SHARE` of the run when its length is
    known."""
    return trial_s if run_s is None else min(trial_s, TRIAL_RUN_SHARE * run_s)


def trial_candidates(names: Sequence[str], rule: str, unavailable: Mapping[str, str]
                     ) -> tuple[list[str], dict[str, str]]:
    """The backends to time (the rule's first, then ``names``' order) and those left out
    with the reason."""
    order = [rule] + [n for n in names if n != rule]
    return ([n for n in order if n not in unavailable],
            {n: unavailable[n] for n in order if n in unavailable})


def trial_layouts(bucket_mb: float, vary: bool) -> tuple[Layout, list[float]]:
    """The layout every candidate is timed at (the recipe's bucket, the 1 MiB first bucket)
    and, with ``vary``, the other bucket sizes the winner is timed at."""
    first = Layout(bucket_mb, LAST_BUCKET_BYTES / MIB)
    return first, [mb for mb in TRIAL_BUCKET_MB if mb != bucket_mb] if vary else []


def bucket_numels(numels: Sequence[int], element_size: int, layout: Layout) -> list[int]:
    """Elements of each bucket, in launch order, of trainable parameters of ``numels``
    elements (registration order) sent as ``element_size``-byte elements: the reducer's
    layout."""
    backward = list(reversed(numels))
    sizes = [n * element_size for n in backward]
    return [sum(backward[s:e]) for s, e in
            bucket_bounds(sizes, layout.bucket_bytes, layout.last_bucket_bytes)]


def sampled_buckets(buckets: Sequence[int], element_size: int,
                    sample_bytes: int = int(TRIAL_SAMPLE_MB * MIB)) -> tuple[list[int], float]:
    """Elements of each bucket a trial round reduces, and the factor that scales the large
    buckets' time to all of theirs: the large buckets in launch order up to ``sample_bytes``
    (the last one taken cut short), then the first layers' bucket (the last launched) whole."""
    if not buckets:
        return [], 1.0
    *large, last = buckets
    left, taken = sample_bytes // element_size, []
    for numel in large:
        if left <= 0:
            break
        taken.append(min(numel, left))
        left -= taken[-1]
    return taken + [last], (sum(large) / sum(taken) if taken else 1.0)


def fitted_sample_bytes(seconds_per_byte: float, first_bucket_bytes: int, candidates: int,
                        rounds: int, budget_s: float) -> int:
    """The large buckets' bytes a trial round reduces: :data:`TRIAL_SAMPLE_MB`, or less where
    ``candidates`` measurements of ``1 + rounds`` rounds of that many bytes plus the first
    layers' bucket would not fit :data:`TRIAL_FIT_SHARE` of ``budget_s`` on a link moving a
    byte in ``seconds_per_byte``; never below 1 MiB."""
    per_round_s = TRIAL_FIT_SHARE * budget_s / (max(1, candidates) * (1 + rounds))
    fitted = per_round_s / seconds_per_byte - first_bucket_bytes if seconds_per_byte > 0 \
        else float("inf")
    return int(min(TRIAL_SAMPLE_MB * MIB, max(MIB, fitted)))


def round_cpu(bucket_cpu_s: Sequence[float], scale: float = 1.0) -> float:
    """The CPU one step's gradients cost a transport, from one round's per-bucket CPU (the
    reducing thread's inside each call plus what the threads the transport started burnt
    during it): the large buckets' scaled by ``scale`` as their time is
    (:func:`layout_score`), the first layers' bucket, timed whole, once. Scaling the whole
    round's CPU by its share of the bytes instead would multiply the small bucket's and every
    call's fixed cost along with the sample's bytes (x50 for a 4 MiB sample of AlexNet's
    245 MB)."""
    if not bucket_cpu_s:
        return 0.0
    *large, last = bucket_cpu_s
    return scale * sum(large) + last


def transport_cpu_per_step(rounds_cpu_s: Sequence[float]) -> float:
    """CPU seconds a transport's threads spend on one step's gradients (a polling progress
    engine spins for as long as its bytes take): the timed rounds' :func:`round_cpu`,
    averaged; never a credit (a clock read that went backwards counts zero)."""
    return max(0.0, statistics.fmean(rounds_cpu_s)) if rounds_cpu_s else 0.0


def layout_score(bucket_seconds: Sequence[float], scale: float = 1.0) -> float:
    """A step's communication for one round of bucket times (module docstring), the large
    buckets' (all but the last) scaled by ``scale``."""
    if not bucket_seconds:
        return 0.0
    *large, last = bucket_seconds
    return scale * sum(large) + 2 * last


def beats(new: Measurement, best: Measurement, fastest: float | None = None) -> bool:
    """Whether ``new`` replaces ``best``: faster by more than :data:`TRIAL_MARGIN`; or, no
    measurement so far (``best``, and ``fastest``: the least seconds of any) faster than it
    by the margin, a transport whose waits sleep in the kernel (:data:`WAITS_IN_THE_KERNEL`)
    replacing one that polls from Python (:data:`POLLS_FROM_PYTHON`). The trial's rounds
    wait urgently; a step's waits sit beside backward, where every test-and-sleep of a
    polling transport is CPU taken from compute, so between equals the quiet one is the
    faster step (docs/comm.md, "The start-up trial")."""
    if new.seconds < best.seconds * (1.0 - TRIAL_MARGIN):
        return True
    floor = best.seconds if fastest is None else min(best.seconds, fastest)
    clearly_slower = floor < new.seconds * (1.0 - TRIAL_MARGIN)
    return (best.backend in POLLS_FROM_PYTHON and new.backend in WAITS_IN_THE_KERNEL
            and not clearly_slower)


def choose(measurements: Sequence[Measurement]) -> Measurement:
    """The earliest measurement that no later one beats (:func:`beats`, each judged against
    the fastest before it too): the rule's candidate at the recipe's layout unless another
    is clearly faster, or gloo ties with it."""
    best, fastest = measurements[0], measurements[0].seconds
    for m in measurements[1:]:
        fastest = min(fastest, m.seconds)
        if beats(m, best, fastest):
            best = m
    return best


def rule_result(rule: str, bucket_mb: float, budget_s: float, why: str,
                excluded: Mapping[str, str] | None = None) -> TrialResult:
    """The rule's choice at the recipe's layout, with why the trial did not decide."""
    return TrialResult(rule, bucket_mb, LAST_BUCKET_BYTES / MIB, rule, budget_s,
                       excluded=dict(excluded or {}), fallback=why)


# -- the collective part ----------------------------------------------------------------------
Opener = Callable[[str, Layout, str], Any]  # (backend, layout, wire dtype) -> Communicator


def run_trial(world: Any, numels: Sequence[int], candidates: Mapping[str, str], rule: str,
              bucket_mb: float, budget_s: float, open_candidate: Opener, *,
              vary_buckets: bool = True, excluded: Mapping[str, str] | None = None,
              rounds: int = TRIAL_ROUNDS, started: float | None = None) -> TrialResult:
    """Time ``candidates`` (name -> wire dtype, the rule's first) over ``world`` (mpi4py)
    on gradients of ``numels`` and return the agreed choice. ``started``: the
    ``time.perf_counter()`` the budget counts from (default now). Collective over
    ``world``."""
    first, sizes = trial_layouts(bucket_mb, vary_buckets)
    trial = _Trial(world, numels, candidates, open_candidate, rounds, started, first, budget_s)
    result = TrialResult(rule, bucket_mb, first.first_bucket_mb, rule, budget_s,
                         planned=len(candidates) + len(sizes) + (1 if vary_buckets else 0),
                         excluded=dict(excluded or {}), sample_mb=trial.sample_bytes / MIB)
    best = None
    try:
        for name in candidates:
            if not trial.within(budget_s, result):
                break
            best = trial.measure_and_keep_best(name, first, best, result)
        if best is not None:
            for layout in [Layout(mb, first.first_bucket_mb) for mb in sizes]:
                if trial.within(budget_s, result):
                    best = trial.measure_and_keep_best(best.backend, layout, best, result)
            if vary_buckets and trial.within(budget_s, result):
                best = trial.measure_and_keep_best(best.backend, Layout(best.bucket_mb, 0.0),
                                                   best, result)
    finally:
        trial.close()
    result.spent_s = trial.spent_s
    if not result.measurements:
        return rule_result(rule, bucket_mb, budget_s, "no candidate could be timed",
                           result.excluded)
    chosen = world.bcast(choose(result.measurements) if world.rank == 0 else None, root=0)
    result.backend, result.bucket_mb = chosen.backend, chosen.bucket_mb
    result.first_bucket_mb = chosen.first_bucket_mb
    return result


class _Trial:
    """The open candidate communicators (at most the best and the one being timed), the
    clock agreed by every rank, and one measurement's rounds."""

    def __init__(self, world: Any, numels: Sequence[int], candidates: Mapping[str, str],
                 open_candidate: Opener, rounds: int, started: float | None, first: Layout,
                 budget_s: float) -> None:
        self.world, self.numels, self.wire = world, list(numels), dict(candidates)
        self.open_candidate, self.rounds = open_candidate, rounds
        self.start = time.perf_counter() if started is None else started
        self.spent_s = 0.0       # agreed: the largest over ranks, after each measurement
        self.last_s = 0.0        # the last measurement's agreed duration
        self.open: dict[str, tuple[Any, torch.Tensor]] = {}
        self.seen: dict[str, list[list[int]]] = {}
        self.load = ComputeLoad()
        self.load.run_while(lambda: False)  # torch's intra-op pool starts before the count
        #: threads that are not the transport's: this rank's own (main, torch's pool, MPI's)
        self.not_transport = thread_ids()
        self.sample_bytes = self._fitted_sample(first, budget_s)

    def _fitted_sample(self, first: Layout, budget_s: float) -> int:
        """The sample fitted to what is left of the budget from a probe of the link over
        ``world`` and the time spent so far, both agreed (the slowest rank's), so every rank
        samples the same buckets."""
        probed: list[float] = []  # beside the load, as the rounds will run
        _on_yielding_thread(
            lambda: probed.append(timed_allreduce_s(self.world, PROBE_BYTES, PROBE_REPEATS)),
            beside=self.load.run_while)
        seconds = probed[0]
        spent = self.world.allreduce(time.perf_counter() - self.start, op=MPI.MAX)
        fp32 = torch.float32.itemsize  # the widest wire: a bf16 first bucket is smaller
        last = bucket_numels(self.numels, fp32, first)[-1:] or [0]
        return fitted_sample_bytes(seconds / PROBE_BYTES, fp32 * last[0], len(self.wire),
                                   self.rounds, budget_s - spent)

    def within(self, budget_s: float, result: TrialResult) -> bool:
        """Whether another measurement fits (the same answer on every rank: agreed times);
        until one candidate is measured, one always does."""
        return not result.measurements or self.spent_s + self.last_s <= budget_s

    def measure_and_keep_best(self, name: str, layout: Layout, best: Measurement | None,
                              result: TrialResult) -> Measurement | None:
        dtype = torch.bfloat16 if self.wire[name] == "bfloat16" else torch.float32
        buckets = bucket_numels(self.numels, dtype.itemsize, layout)
        if buckets in self.seen.get(name, []):
            return best  # the same buckets as a layout already timed on this backend
        self.seen.setdefault(name, []).append(buckets)
        began = time.perf_counter()
        seconds, timed_share, cpu_s, spread, error = self._time(name, layout, dtype, buckets)
        agreed, cpu_s, spread = self._agree(seconds if error is None else float("inf"), began,
                                            cpu_s, spread)
        reason = self._agreed_error(error)
        if reason is not None:
            result.excluded[name] = reason
            self._drop(name)
            return best
        m = Measurement(name, layout.bucket_mb, layout.first_bucket_mb, len(buckets),
                        self.rounds, agreed, timed_share, round(cpu_s, 4), round(spread, 4))
        result.measurements.append(m)
        fastest = min(x.seconds for x in result.measurements)
        if best is None or beats(m, best, fastest):
            if best is not None and best.backend != name:
                self._drop(best.backend)
            return m
        if name != best.backend:
            self._drop(name)
        return best

    def _time(self, name: str, layout: Layout, dtype: torch.dtype, buckets: list[int]
              ) -> tuple[float, float, float, float, BaseException | None]:
        """The median score over rounds with the CPU the transport burns per step, the share
        of the layout's elements a round reduced, that CPU, the rounds' spread, and what
        raised instead."""
        try:
            timed, scale = sampled_buckets(buckets, dtype.itemsize, self.sample_bytes)
            comm, buffer = self._communicator(name, layout, dtype, sum(timed))
            views = list(buffer[:sum(timed)].split(timed))
            scores: list[float] = []
            cpu: list[float] = []
            started = thread_ids() - self.not_transport  # what opening it started (gloo's)
            _on_yielding_thread(
                lambda: self._rounds(comm, views, scale, scores, cpu,
                                     lambda: thread_cpu_s(started)),
                beside=self.load.run_while)
            timed_share = sum(timed) / max(1, sum(buckets))
            cpu_s = transport_cpu_per_step(cpu)
            median = statistics.median(scores)
            spread = (median - min(scores)) / median if median > 0 else 0.0
            return median + cpu_s, timed_share, cpu_s, spread, None
        except Exception as exc:  # noqa: BLE001 - any failure excludes the candidate
            return 0.0, 0.0, 0.0, 0.0, exc

    def _communicator(self, name: str, layout: Layout, dtype: torch.dtype, numel: int):
        """The candidate's communicator, opened once, and a flat buffer of at least ``numel``
        elements that each layout's sampled buckets are slices of (shm: one window, reduced
        where it lies, as the reducer's buckets are). The buffer holds a sample, not the
        model: filling a 245 MB one took 0.1--0.5 s of a 3 s budget per candidate."""
        if name not in self.open:
            self.open[name] = (self.open_candidate(name, layout, self.wire[name]), None)
        comm, buffer = self.open[name]
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            # the same size on every rank (agreed sample, same layouts): shm's collective
            # window opens in step
            buffer = comm.empty(numel, dtype)
            buffer.fill_(1.0)
            self.open[name] = (comm, buffer)
        return comm, buffer

    def _rounds(self, comm: Any, views: list[torch.Tensor], scale: float,
                scores: list[float], rounds_cpu: list[float], others: Callable[[], float]
                ) -> None:
        """One untimed round, then the timed rounds: each one's score and :func:`round_cpu`
        of each call's CPU, this thread's inside it plus ``others()``' (the transport's own
        threads, read between calls: a call returns once they have moved its bytes). The
        barrier before a round and the untimed round's one-off costs (first touch,
        connections) are no step's, and scaled by the bytes the sample left out they would
        weigh as much as a step's transfers."""
        for r in range(1 + self.rounds):
            self.world.Barrier()  # every rank starts the round together
            times, cpu = [], []
            theirs = others()
            for view in views:
                c0, t0 = time.thread_time(), time.perf_counter()
                comm.allreduce_flat_(view, average=True)
                times.append(time.perf_counter() - t0)
                # one read between two calls: a thread still running when read shows up to a
                # scheduler tick late, in the next call's share instead of lost
                before, theirs = theirs, others()
                cpu.append(time.thread_time() - c0 + theirs - before)
            if r:
                scores.append(layout_score(times, scale))
                rounds_cpu.append(round_cpu(cpu, scale))

    def _agree(self, seconds: float, began: float, cpu_s: float, spread: float
               ) -> tuple[float, float, float]:
        """The largest score, transport CPU, spread, time spent and measurement time over
        ranks, in one allreduce."""
        now = time.perf_counter()
        values = np.array([seconds, cpu_s, spread, now - self.start, now - began],
                          dtype=np.float64)
        self.world.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
        self.spent_s, self.last_s = float(values[3]), float(values[4])
        return float(values[0]), float(values[1]), float(values[2])

    def _agreed_error(self, error: BaseException | None) -> str | None:
        """None when no rank failed, else the lowest failing rank's reason, on every rank."""
        size = self.world.size
        first = self.world.allreduce(self.world.rank if error else size, op=MPI.MIN)
        if first == size:
            return None
        text = f"rank {first}: {type(error).__name__}: {error}" if self.world.rank == first \
            else None
        return self.world.bcast(text, root=first)

    def _drop(self, name: str) -> None:
        comm, _ = self.open.pop(name, (None, None))
        if comm is not None:
            comm.close()

    def close(self) -> None:
        for name in list(self.open):
            self._drop(name)


class ComputeLoad:
    """Backward's stand-in beside the trial's rounds: square fp32 matrix products on torch's
    intra-op threads, for as long as the rounds run."""

    def __init__(self, size: int = LOAD_MATRIX) -> None:
        self.a = torch.rand(size, size)
        self.out = torch.empty_like(self.a)

    def run_while(self, busy: Callable[[], bool]) -> None:
        """Products while ``busy()`` (at least one)."""
        torch.mm(self.a, self.a, out=self.out)
        while busy():
            torch.mm(self.a, self.a, out=self.out)


def _on_yielding_thread(work: Callable[[], None],
                        beside: Callable[[Callable[[], bool]], None]) -> None:
    """Run ``work`` on a thread whose waits yield, as the reducer's communication thread
    does once the step waits for it (:data:`~hpcdl.comm.base.URGENT_WAIT_S` between tests:
    a round's time stands for communication a step waits for), and ``beside(still_running)``
    on this one meanwhile; re-raise what ``work`` raised."""
    raised: list[BaseException] = []

    def body() -> None:
        yield_waits_in_this_thread()
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            raised.append(exc)

    thread = threading.Thread(target=body, name="hpcdl-comm-trial", daemon=True)
    thread.start()
    beside(thread.is_alive)
    thread.join()
    if raised:
        raise raised[0]


def unavailable_backends(world: Any, most_ranks_on_a_node: int) -> dict[str, str]:
    """Backends that cannot run over ``world`` here, with the reason (the lowest rank's that
    lacks it): ``shm`` with one rank per node (it would be ``mpi`` plus a copy), ``ccl``
    where oneCCL is not found, ``gloo`` where torch has no gloo. Collective over ``world``."""
    mine = _local_unavailable(most_ranks_on_a_node)
    names = ("shm", "ccl", "gloo")
    first = np.array([world.rank if n in mine else world.size for n in names], dtype=np.int64)
    world.Allreduce(MPI.IN_PLACE, first, op=MPI.MIN)
    out = {}
    for name, rank in zip(names, first.tolist(), strict=True):
        if rank < world.size:
            reason = world.bcast(mine.get(name), root=rank)
            out[name] = reason if rank == 0 else f"rank {rank}: {reason}"
    return out


def _local_unavailable(most_ranks_on_a_node: int) -> dict[str, str]:
    out = {}
    if most_ranks_on_a_node <= 1:
        out["shm"] = "one rank per node: nothing to share memory with"
    from hpcdl.comm.ccl import missing_reason

    if (reason := missing_reason()) is not None:
        out["ccl"] = reason
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        out["gloo"] = f"torch {torch.__version__} was built without gloo"
    return out
