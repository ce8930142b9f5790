"""Calibrating the per-class rates of hpcdl.plan.model: time representative layers, fit rates.

Each operator class (hpcdl.plan.layers) is timed on representative layers of its own, forward
+ backward, the median of a few repeats (:func:`median_time`); its rate is Σ work ÷ Σ (time −
per-layer overhead), the work counted by the code that costs a model (:func:`count_layers`),
so calibration and prediction agree on what a FLOP or a byte is. No model's step is timed, so
a prediction of one stays held out. Why representative layers and not the bench's profiled
breakdown, and what each sample is: docs/planner.md, "--calibrate".
"""
from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hpcdl.plan.layers import (
    COMPUTE_CLASSES,
    LINEAR_WEIGHT_PASSES,
    LINEAR_WEIGHTS,
    OP_CLASSES,
    OPTIMIZER,
    OPTIMIZER_BYTES_PER_PARAMETER,
    Layer,
    count_layers,
)

# (class, builder name, constructor arguments, input shape (C, H, W) or (features,),
#  input needs a gradient). Shapes are the kinds found in ResNet-50 and AlexNet at 112-224 px
# but none is copied from the validation models' layers one for one. Memory-bound samples
# include one of 25 MB at batch 8, beyond the caches, as a model's early activations are.
REPRESENTATIVE: tuple[tuple[str, str, tuple, tuple, bool], ...] = (
    ("conv_large", "conv", (3, 64, 7, 2, 3, 1), (3, 112, 112), False),
    ("conv_large", "conv", (32, 96, 5, 1, 2, 1), (32, 28, 28), True),
    ("conv_1x1", "conv", (256, 64, 1, 1, 0, 1), (256, 28, 28), True),
    ("conv_1x1", "conv", (128, 512, 1, 1, 0, 1), (128, 14, 14), True),
    ("conv_1x1", "conv", (1024, 256, 1, 1, 0, 1), (1024, 7, 7), True),
    ("conv_3x3", "conv", (64, 64, 3, 1, 1, 1), (64, 28, 28), True),
    ("conv_3x3", "conv", (128, 128, 3, 1, 1, 1), (128, 14, 14), True),
    ("conv_3x3", "conv", (256, 256, 3, 1, 1, 1), (256, 7, 7), True),
    # Larger GEMMs run nearer the peak: one sample per class at 224 px-like sizes, so that
    # RATE_CURVE_CLASSES' curves span both regimes.
    ("conv_1x1", "conv", (96, 384, 1, 1, 0, 1), (96, 40, 40), True),
    ("conv_3x3", "conv", (96, 96, 3, 1, 1, 1), (96, 40, 40), True),
    # And at 4x4 positions (128 GEMM rows at batch 8), where a convolution runs furthest
    # below its FLOP rate: the last stage of a 112 px ResNet.
    ("conv_1x1", "conv", (768, 192, 1, 1, 0, 1), (768, 4, 4), True),
    ("conv_3x3", "conv", (320, 320, 3, 1, 1, 1), (320, 4, 4), True),
    ("conv_grouped", "conv", (96, 128, 5, 1, 2, 2), (96, 14, 14), True),
    ("conv_grouped", "conv", (192, 192, 3, 1, 1, 2), (192, 13, 13), True),
    ("conv_grouped", "conv", (128, 256, 3, 1, 1, 2), (128, 28, 28), True),
    ("linear", "linear", (1024, 1024), (1024,), True),
    ("linear", "linear", (2048, 512), (2048,), True),
    ("batch_norm", "batch_norm", (128,), (128, 28, 28), True),
    ("batch_norm", "batch_norm", (256,), (256, 56, 56), True),
    ("relu", "relu", (), (128, 28, 28), True),
    ("relu", "relu", (), (256, 56, 56), True),
    ("add", "add", (), (128, 28, 28), True),
    ("add", "add", (), (256, 56, 56), True),
    ("pool", "max_pool", (3, 2), (64, 56, 56), True),
    ("pool", "avg_pool", (), (512, 7, 7), True),
    ("dropout", "dropout", (0.5,), (64, 28, 28), True),
    ("dropout", "dropout", (0.5,), (4096,), True),
    ("lrn", "lrn", (5,), (64, 27, 27), True),
    ("lrn", "lrn", (5,), (192, 13, 13), True),
    # The weight traffic of a linear layer at `batch` rows (hpcdl.plan.layers.LINEAR_WEIGHTS):
    # weights of 134 and 100 MB, beyond the caches and glibc's 32 MiB mmap ceiling as
    # AlexNet's fc6/fc7 are (none of their shapes).
    ("linear_weights", "linear", (4096, 8192), (4096,), True),
    ("linear_weights", "linear", (8192, 3072), (8192,), True),
)
# Classes whose rate is kept as a curve (rate_curves): the convolutions, whose efficiency
# grows with their GEMMs, and the passes whose samples differ only in size (in-cache against
# beyond-cache tensors). Not pool (a max and an average pooling kernel), dropout, lrn or linear
# (samples of one size each).
RATE_CURVE_CLASSES = ("conv_large", "conv_1x1", "conv_3x3", "conv_grouped", "batch_norm",
                      "relu", "add", LINEAR_WEIGHTS)
# A convolution's curve is over the GEMM rows of one call (batch x output positions), the
# others' over the work of one call (bytes); docs/planner.md says why.
ROWS_AXIS, WORK_AXIS = "gemm_rows", "work"
ROWS_CURVE_CLASSES = tuple(c for c in COMPUTE_CLASSES if c != "linear")   # the convolutions


def curve_axis(op_class: str) -> str:
    """What a class's rate curve is over: ROWS_AXIS for a convolution, else WORK_AXIS."""
    return ROWS_AXIS if op_class in ROWS_CURVE_CLASSES else WORK_AXIS


# Calls discarded before timing a layer: a new shape's first calls grow the (retained) heap
# and fault its pages in; a step in a running job does not.
LAYER_WARMUP = 3
# Linear layers are timed at this many rows (images) so that they measure the matmul rate,
# not the weight traffic that the model adds as a separate floor at small batch.
LINEAR_ROWS = 128


@dataclass(frozen=True)
class Sample:
    """One representative layer: its class, its work (FLOPs or bytes), measured seconds and,
    for a convolution, the GEMM rows of the call (batch × output positions)."""

    op_class: str
    work: float
    seconds: float
    rows: float = 0.0

    def curve_x(self) -> float:
        """Where the sample sits on its class's curve (:func:`curve_axis`)."""
        return self.rows if curve_axis(self.op_class) == ROWS_AXIS else self.work


def build(kind: str, args: tuple) -> Any:
    """A representative module of ``kind`` built from ``args``."""
    if kind == "conv":
        cin, cout, k, stride, pad, groups = args
        return nn.Conv2d(cin, cout, k, stride=stride, padding=pad, groups=groups, bias=False)
    makers: dict[str, Callable[[], Any]] = {
        "add": AddLearnt, "linear": lambda: nn.Linear(*args),
        "batch_norm": lambda: nn.BatchNorm2d(*args),
        "relu": lambda: nn.ReLU(), "max_pool": lambda: nn.MaxPool2d(*args),
        "avg_pool": lambda: nn.AdaptiveAvgPool2d(1), "dropout": lambda: nn.Dropout(*args),
        "lrn": lambda: nn.LocalResponseNorm(*args)}
    return makers[kind]()


class AddLearnt(nn.Module):
    """``x + w``: a residual sum whose both operands need a gradient (``w`` made on first use,
    shaped like one input and of its dtype: a bf16 network adds two bf16 activations)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "other"):
            self.other = nn.Parameter(torch.zeros(1, *x.shape[1:], dtype=x.dtype))
        return x + self.other.expand_as(x)


def layer_work(layer: Layer, rows: int, op_class: str | None = None) -> float:
    """What the planner charges a layer for ``rows`` images as ``op_class`` (default its own):
    FLOPs, bytes moved, or for LINEAR_WEIGHTS its weight traffic, which is per step."""
    if op_class == LINEAR_WEIGHTS:
        return LINEAR_WEIGHT_PASSES * layer.param_bytes
    if layer.op_class in COMPUTE_CLASSES:
        return rows * layer.train_flops
    return rows * layer.memory_bytes()


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """``threads`` torch intra-op threads inside, the caller's count again after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def call_times(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (which pay
    oneDNN's primitive creation and the allocator's first touch)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """The median of :func:`call_times` (at least one call).

    The median, not the minimum: on a busy machine the minimum of a few calls is the one that
    ran alone, a rate the step being predicted does not see."""
    return statistics.median(call_times(fn, max(1, repeats), warmup))


def compute_context(precision: str) -> contextlib.AbstractContextManager:
    """The forward's dtype context of a training step in ``precision``: the trainer's bf16
    autocast (float32 master weights cast to bf16 at each GEMM), or nothing for float32."""
    if precision == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def activation_dtype(precision: str, input_grad: bool) -> torch.dtype:
    """The dtype of a layer's input inside a step in ``precision``: bf16 between layers under
    autocast; the first layer (no input gradient) reads the float32 normalised images."""
    return torch.bfloat16 if precision == "bfloat16" and input_grad else torch.float32


def time_layer(module: Any, shape: Sequence[int], rows: int, input_grad: bool,
               repeats: int, precision: str = "float32") -> float:
    """Median forward + backward of ``module`` on ``rows`` inputs of ``shape``, in the calling
    thread's torch thread count, computing in ``precision`` as the trainer does (forward under
    :func:`compute_context`, backward outside it). The backward is ``torch.autograd.grad`` with
    a gradient made once: ``out.backward`` would accumulate into ``.grad`` from the second call
    on, and a ``ones_like`` inside the timed call would write the output again, passes a
    model's step never makes."""
    x = torch.randn(rows, *shape, dtype=activation_dtype(precision, input_grad),
                    requires_grad=input_grad)
    module.train()
    inputs = ([x] if input_grad else []) + [p for p in module.parameters() if p.requires_grad]
    with compute_context(precision):
        grad_out = torch.ones_like(module(x))

    def once() -> None:
        with compute_context(precision):
            out = module(x)
        if inputs:
            torch.autograd.grad(out, inputs, grad_out)

    return median_time(once, repeats, warmup=LAYER_WARMUP)


def overhead_s(repeats: int = 21, precision: str = "float32") -> float:
    """Per-layer dispatch + autograd cost: forward + backward of a one-element ReLU."""
    return time_layer(nn.ReLU(), (1,), 1, True, repeats, precision)


def measure_samples(batch: int, repeats: int, threads: int = 1,
                    log: Callable[[str], None] = print,
                    before_each: Callable[[], Any] = lambda: None,
                    layers: Sequence[tuple] = REPRESENTATIVE,
                    optimizer: bool = True, precision: str = "float32") -> list[Sample]:
    """Time every layer of ``layers`` (and the optimizer) with ``threads`` torch threads in
    ``precision`` (:func:`time_layer`) and count its work (``before_each`` is called before
    each is timed: co-running ranks' barrier). The work is counted as for float32 in every
    precision, as the planner counts a model's: a bf16 rate is nominal FLOPs or bytes per
    second of the bf16 step."""
    torch.manual_seed(0)
    samples = []
    with torch_threads(threads):
        for op_class, kind, args, shape, input_grad in layers:
            before_each()
            module = build(kind, args)
            rows = LINEAR_ROWS if op_class == "linear" else batch
            layer_class = "linear" if op_class == LINEAR_WEIGHTS else op_class
            counted = [layer for layer in count_layers(module, 0, shape, input_grad)
                       if layer.op_class == layer_class]
            if not counted:
                raise RuntimeError(f"representative {kind}{args} was not classed {layer_class}")
            seconds = time_layer(module, shape, rows, input_grad, repeats, precision)
            samples.append(Sample(op_class, sum(layer_work(la, rows, op_class)
                                                for la in counted), seconds,
                                  rows=rows * sum(la.pixels for la in counted)))
            log(f"  {op_class:<15}{kind}{args} on {rows} x {shape}, {threads} thread(s), "
                f"{precision}: {seconds * 1e3:.2f} ms")
        if optimizer:
            before_each()
            samples.append(optimizer_sample(repeats, threads))
            log(f"  {OPTIMIZER:<15}LARS step over {len(OPTIMIZER_SHAPES)} tensors, "
                f"{threads} thread(s): {samples[-1].seconds * 1e3:.2f} ms")
    return samples


# The optimizer sample's parameters: shapes of conv and fc weights and a few vectors, 25.2 M
# parameters (101 MB, beyond the caches) in 8 tensors; no model's own.
OPTIMIZER_SHAPES = ((3072, 4096), (2048, 2048), (512, 512, 3, 3), (256, 1024, 1, 1),
                    (2048, 1000), (4096,), (1000,), (512,))


def optimizer_sample(repeats: int, threads: int = 1) -> Sample:
    """One step of hpcdl's LARS (weight decay, momentum, the trust ratio of every tensor) over
    OPTIMIZER_SHAPES with ``threads`` torch threads: its nominal bytes
    (OPTIMIZER_BYTES_PER_PARAMETER per parameter) and median seconds."""
    from hpcdl.optim.lars import LARS

    with torch_threads(threads):
        params = [nn.Parameter(torch.randn(shape)) for shape in OPTIMIZER_SHAPES]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = LARS(params, lr=0.1, momentum=0.9, weight_decay=5e-4)
        seconds = median_time(optimizer.step, repeats, warmup=LAYER_WARMUP)
    count = sum(p.numel() for p in params)
    return Sample(OPTIMIZER, OPTIMIZER_BYTES_PER_PARAMETER * count, seconds)


def _corun_worker(batch: int, repeats: int, barrier: Any, results: Any,
                  layers: Sequence[tuple], optimizer: bool, precision: str) -> None:
    """One of :func:`corun_samples`' ranks: every layer timed at the same moment as the
    others' (a barrier before each), one thread, the bench's allocator policy."""
    from hpcdl.cpus import retain_freed_memory

    retain_freed_memory()
    samples = measure_samples(batch, repeats, threads=1, log=lambda _line: None,
                              before_each=barrier.wait, layers=layers, optimizer=optimizer,
                              precision=precision)
    results.put(samples)


def corun_samples(batch: int, repeats: int, ranks: int,
                  layers: Sequence[tuple] = REPRESENTATIVE, optimizer: bool = True,
                  precision: str = "float32") -> list[Sample]:
    """The representative layers timed in ``ranks`` single-threaded processes at once (each
    layer started together): what a rank's rate is when every core of the node computes, as
    ``mpiexec -n cores`` runs (shared caches and memory; :func:`contention`)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    workers = [ctx.Process(target=_corun_worker,
                           args=(batch, repeats, barrier, results, tuple(layers), optimizer,
                                 precision))
               for _ in range(ranks)]
    for w in workers:
        w.start()
    try:
        gathered = [results.get(timeout=1800) for _ in workers]
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.terminate()
    return [sample for per_rank in gathered for sample in per_rank]


def contention(rates_alone: Mapping[str, float],
               rates_corun: Mapping[str, float]) -> dict[str, float]:
    """Per class: one rank's rate while every core runs a rank ÷ its rate alone, in (0.1, 1]:
    the node's shared caches and memory, which a rank alone does not meet (without it,
    predicted ÷ measured falls as ranks are added to a node)."""
    return {c: min(1.0, max(0.1, rates_corun[c] / rates_alone[c]))
            for c in rates_alone if c in rates_corun}


def fit_rates(samples: Sequence[Sample], overhead: float) -> dict[str, float]:
    """Per class: Σ work ÷ Σ (seconds − overhead) -- FLOP/s or bytes/s of one core.

    Time below the overhead is floored at a tenth of the sample's time, so one noisy small
    layer cannot make a rate infinite or negative."""
    work: dict[str, float] = {}
    busy: dict[str, float] = {}
    for s in samples:
        if s.work <= 0 or s.seconds <= 0:
            raise ValueError(f"calibration sample of {s.op_class} has work {s.work} and "
                             f"time {s.seconds}: both must be > 0")
        work[s.op_class] = work.get(s.op_class, 0.0) + s.work
        busy[s.op_class] = busy.get(s.op_class, 0.0) + max(s.seconds - overhead,
                                                            0.1 * s.seconds)
    missing = [c for c in OP_CLASSES if c not in work]
    if missing:
        raise ValueError(f"calibration has no samples of {missing}")
    return {c: work[c] / busy[c] for c in work}   # OP_CLASSES and any optional ones sampled


def rate_curves(samples: Sequence[Sample], overhead: float,
                classes: Sequence[str] = RATE_CURVE_CLASSES) -> dict[str, list[list[float]]]:
    """Per class of ``classes``: ``[x, rate]`` points sorted by x, the sample's place on its
    class's axis (:func:`curve_axis`: GEMM rows of a convolution, else work of one call);
    samples at equal x merged as :func:`fit_rates` merges a class (Σ work ÷ Σ busy time)."""
    merged: dict[str, dict[float, list[float]]] = {}
    for s in samples:
        if s.op_class in classes and s.curve_x() > 0:
            point = merged.setdefault(s.op_class, {}).setdefault(s.curve_x(), [0.0, 0.0])
            point[0] += s.work
            point[1] += max(s.seconds - overhead, 0.1 * s.seconds)
    return {c: [[x, total / busy] for x, (total, busy) in sorted(points.items())]
            for c, points in merged.items()}


def interpolate_rate(points: Sequence[Sequence[float]], x: float) -> float:
    """The rate at ``x`` on a curve of ``[x, rate]`` points: linear in log-log between
    neighbours, the end point's rate outside them (no extrapolation)."""
    if x <= points[0][0]:
        return float(points[0][1])
    for (x0, r0), (x1, r1) in itertools.pairwise(points):
        if x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return float(math.exp(math.log(r0) + t * math.log(r1 / r0)))
    return float(points[-1][1])


def class_fractions(rates: Mapping[str, float], core_peak_flops: float,
                    core_stream_Bps: float) -> dict[str, float]:
    """Rates as the machine file holds them: compute classes over one core's peak, memory
    classes over one core's stream rate."""
    return {c: r / (core_peak_flops if c in COMPUTE_CLASSES else core_stream_Bps)
            for c, r in rates.items()}


def thread_speedups(rates_1: Mapping[str, float], rates_t: Mapping[str, float],
                    threads: float | None = None) -> dict[str, float]:
    """Per class: the rate of one rank on T = ``threads`` threads over its rate on one thread,
    floored at a tenth (below that the timing measured the scheduler) and capped at T (a
    super-linear speedup measured the one-thread pass paying the heap's first growth)."""
    cap = float(threads) if threads else math.inf
    return {c: min(cap, max(0.1, rates_t[c] / rates_1[c])) for c in rates_1 if c in rates_t}
