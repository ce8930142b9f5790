"""Machine descriptions for the planner: one YAML file per machine, every figure with its source.

A figure is a ``{value: ..., source: "..."}`` leaf in a section: the REQUIRED_FIGURES, the
per-class ``compute`` fractions (or the older single ``node.sustained_fraction``), the optional
sections ``--calibrate`` writes, ``cpu`` and ``measured`` (never read). The rate sections at
the top level are float32's; ``rates.bfloat16`` holds the same sections measured in bf16, and a
Machine costs one precision's. The schema and the search path (:func:`machine_search_path`,
first match wins): docs/planner.md, "Machine files".
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from hpcdl.env import env_text
from hpcdl.plan.layers import LINEAR_WEIGHTS, OP_CLASSES, OPTIMIZER

PACKAGE_MACHINES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "machines")

# Every figure the cost model reads, by section. A file missing one is rejected by name.
REQUIRED_FIGURES: dict[str, tuple[str, ...]] = {
    "node": ("sockets", "cores_per_socket", "frequency_hz", "flops_per_cycle_per_core",
             "memory_bandwidth_Bps", "core_stream_Bps", "ranks_per_node"),
    "network": ("latency_s", "bandwidth_Bps"),
    "intra_node": ("latency_s", "bandwidth_Bps"),
    "data": ("decode_images_per_s_per_core", "loader_cores_per_node"),
}
# The per-class compute figures (hpcdl.plan.layers.OP_CLASSES) plus the per-layer overhead.
COMPUTE_FIGURES: tuple[str, ...] = (*OP_CLASSES, "layer_overhead_s")
# Optional compute fractions: a file without one moves that traffic at the core stream rate.
OPTIONAL_FRACTIONS: tuple[str, ...] = (LINEAR_WEIGHTS, OPTIMIZER)
# The optional measured thread scaling: the thread count T and every class's speedup at T.
THREAD_FIGURES: tuple[str, ...] = ("threads", *OP_CLASSES)
#: The compute precision of the top-level rate sections (every file written before rates were
#: keyed by precision, and the spec files); other precisions' are under ``rates.PRECISION``.
BASE_PRECISION = "float32"
#: The sections a precision's rates fill (the rest of a file is the same in every precision).
RATE_SECTIONS = ("compute", "rate_curves", "thread_scaling", "contention")
#: What ``rates`` may be keyed by (``train.precision``'s dtypes).
KEYED_PRECISIONS = ("bfloat16",)


class MachineError(ValueError):
    """A machine file is missing, malformed, or a figure lacks its value or source."""


def user_machines_dir() -> str:
    """Where ``--calibrate`` writes by default: the user's config dir, writable on a cluster."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "hpcdl", "machines")


def machine_search_path(machines_dir: str | None = None) -> list[str]:
    """Directories searched for ``NAME.yaml``, most specific first."""
    dirs = [machines_dir, env_text("HPCDL_MACHINES_DIR"), user_machines_dir(),
            PACKAGE_MACHINES_DIR]
    return [d for d in dirs if d]


def list_machines(machines_dir: str | None = None) -> list[str]:
    names = set()
    for directory in machine_search_path(machines_dir):
        if os.path.isdir(directory):
            names.update(f[:-5] for f in os.listdir(directory) if f.endswith(".yaml"))
    return sorted(names)


def find_machine_file(name: str, machines_dir: str | None = None) -> str:
    """The path of machine ``name`` (a name on the search path, or a path to a YAML file)."""
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        if not os.path.isfile(name):
            raise MachineError(f"machine file {name!r} does not exist")
        return name
    for directory in machine_search_path(machines_dir):
        path = os.path.join(directory, f"{name}.yaml")
        if os.path.isfile(path):
            return path
    raise MachineError(
        f"unknown machine {name!r}; known: {list_machines(machines_dir)} "
        f"(searched {machine_search_path(machines_dir)}; measure this one with "
        f"`hpcdl plan --calibrate`)")


@dataclass(frozen=True)
class Figure:
    """One number of a machine and where it comes from."""

    value: float
    source: str


def _figure(path: str, key: str, leaf: Any) -> Figure:
    if not isinstance(leaf, Mapping) or "value" not in leaf or "source" not in leaf:
        raise MachineError(
            f"{path}: {key} must be a mapping with 'value' and 'source', got {leaf!r}")
    value, source = leaf["value"], leaf["source"]
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads exponent forms like 1.4e9 as strings: accept them as numbers.
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise MachineError(f"{path}: {key}.value must be a positive number, got {value!r}")
    if not isinstance(source, str) or not source.strip():
        raise MachineError(f"{path}: {key}.source must say where the figure comes from")
    return Figure(float(value), source.strip())


@dataclass(frozen=True)
class Machine:
    """A node type and its network, as the cost model (hpcdl.plan.model) reads it."""

    name: str
    description: str
    path: str
    figures: dict[str, Figure]          # "section.key" -> Figure
    cpu: Mapping[str, Any] = field(default_factory=dict)   # the CPU the figures describe
    # class -> ((x, fraction), ...) sorted by x (``rate_curves``), x on the class's axis
    curves: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # class -> what its curve is over: "gemm_rows" (a convolution's rows per call) or "work"
    curve_axes: Mapping[str, str] = field(default_factory=dict)
    calibrated: bool = False            # measured by --calibrate: rates of cpu, not a spec
    fabric: Any = None                  # the ``fabric`` section as read (hpcdl.plan.simulate)
    precision: str = BASE_PRECISION     # the compute dtype whose rates ``figures`` holds
    precisions: tuple[str, ...] = (BASE_PRECISION,)   # every dtype the file has rates for

    def __getitem__(self, dotted: str) -> float:
        return self.figures[dotted].value

    @property
    def cores_per_node(self) -> float:
        return self["node.sockets"] * self["node.cores_per_socket"]

    @property
    def peak_flops_per_node(self) -> float:
        """Peak fp32 FLOP/s of a node: cores × clock × FLOP/cycle/core (FMA counts as 2)."""
        return (self.cores_per_node * self["node.frequency_hz"]
                * self["node.flops_per_cycle_per_core"])

    @property
    def sustained_flops_per_node(self) -> float:
        """Legacy files without ``compute``: peak × the one stated sustained fraction."""
        return self.peak_flops_per_node * self["node.sustained_fraction"]

    @property
    def has_class_rates(self) -> bool:
        """True when the file has the per-operator-class ``compute`` section."""
        return "compute.conv_3x3" in self.figures

    @property
    def has_thread_scaling(self) -> bool:
        return "thread_scaling.threads" in self.figures

    def threads_per_rank(self, procs_per_node: int) -> float:
        """Cores of one rank: the node's over its ranks, at least one (``hpcdl bench train``
        and the trainer give each rank ``cores // ranks`` threads)."""
        return max(1.0, self.cores_per_node / procs_per_node)

    def core_share(self, procs_per_node: int) -> float:
        """Ranks time-sharing one core (1 unless more ranks than cores)."""
        return max(1.0, procs_per_node / self.cores_per_node)

    def optional_fraction(self, key: str) -> float:
        """An optional ``compute`` fraction (``linear_weights``, ``optimizer``), or 1 where the
        file predates it: that traffic then moves at the core stream rate."""
        figure = self.figures.get(f"compute.{key}")
        return figure.value if figure else 1.0

    def class_fraction(self, op_class: str, work: float, rows: float = 0.0) -> float:
        """The fraction of peak (or stream) of ``op_class`` for a call of ``work`` FLOPs (or
        bytes) and ``rows`` GEMM rows: interpolated on its ``rate_curves`` curve (over rows or
        work), else its one ``compute`` figure (also for a rows curve and no rows counted)."""
        from hpcdl.plan.class_rates import ROWS_AXIS, interpolate_rate

        if op_class in self.curves:
            if self.curve_axes.get(op_class) != ROWS_AXIS:
                return interpolate_rate(self.curves[op_class], work)
            if rows > 0:
                return interpolate_rate(self.curves[op_class], rows)
        if op_class in OPTIONAL_FRACTIONS:
            return self.optional_fraction(op_class)
        return self[f"compute.{op_class}"]

    def contention_factor(self, op_class: str, procs_per_node: int) -> float:
        """A rank's rate of ``op_class`` among ``procs_per_node`` ranks of its node ÷ its rate
        alone: the share ``(busy cores − its threads) ÷ (ranks − 1)`` (at most 1) of the factor
        measured with ``contention.ranks`` single-threaded processes (its own threads'
        contention is in its thread speedup; ranks beyond the cores add none). 1 without the
        section or the class (a spec file: its fractions are of a full node already)."""
        key = f"contention.{op_class}"
        if procs_per_node < 2 or key not in self.figures:
            return 1.0
        cal = self["contention.ranks"]
        threads = self.threads_per_rank(procs_per_node)
        busy = min(procs_per_node * threads, self.cores_per_node)
        if cal <= 1:
            return 1.0
        share = min(1.0, max(0.0, (busy - threads) / (cal - 1.0)))
        return 1.0 + (self[key] - 1.0) * share

    def thread_speedup(self, op_class: str, threads: float) -> float:
        """Rate of ``op_class`` on ``threads`` threads of one rank ÷ its one-thread rate: the
        measured speedup s at the calibrated T threads, linear from 1 at one thread, the
        efficiency s/T kept beyond T; ``threads`` (linear) without ``thread_scaling`` or this
        class in it."""
        if threads <= 1:
            return 1.0
        if f"thread_scaling.{op_class}" not in self.figures:
            return float(threads)
        cal = self["thread_scaling.threads"]
        speedup = self[f"thread_scaling.{op_class}"]
        if cal <= 1:
            return float(threads)
        if threads <= cal:
            return 1.0 + (speedup - 1.0) * (threads - 1.0) / (cal - 1.0)
        return speedup * threads / cal

    @property
    def ranks_per_node(self) -> int:
        return int(self["node.ranks_per_node"])


def rate_precisions(doc: Mapping[str, Any], path: str) -> tuple[str, ...]:
    """The compute dtypes ``doc`` holds rates for: float32 where the top level has them (or
    the legacy sustained fraction), then each key of ``rates``."""
    block = doc.get("rates") or {}
    if not isinstance(block, Mapping) or any(k not in KEYED_PRECISIONS for k in block):
        raise MachineError(f"{path}: rates must map a precision ({list(KEYED_PRECISIONS)}) to "
                           f"its sections {list(RATE_SECTIONS)}, got {block!r}")
    base = "compute" in doc or "sustained_fraction" in (doc.get("node") or {})
    return (*((BASE_PRECISION,) if base else ()), *block)


def rate_block(doc: Mapping[str, Any], path: str, precision: str) -> Mapping[str, Any]:
    """The mapping holding ``precision``'s rate sections: the file itself for float32,
    ``rates.PRECISION`` for another; a file without them is an error saying how to get them."""
    held = rate_precisions(doc, path)
    if precision not in held:
        raise MachineError(
            f"{path} has no {precision} rates (it holds {', '.join(held) or 'none'}): measure "
            f"them on the machine it describes with `hpcdl plan --calibrate --precision "
            f"{precision}`, or plan another precision with --precision")
    block = doc if precision == BASE_PRECISION else doc["rates"][precision]
    if not isinstance(block, Mapping):
        raise MachineError(f"{path}: rates.{precision} must be a mapping of "
                           f"{list(RATE_SECTIONS)}")
    return block


def parse_machine(doc: Any, path: str, precision: str = BASE_PRECISION) -> Machine:
    """Validate a loaded machine document: every required figure present with value + source,
    and every precision's rates (the returned Machine costs ``precision``'s)."""
    if not isinstance(doc, Mapping):
        raise MachineError(f"{path}: a machine file is a mapping, got {type(doc).__name__}")
    precisions = rate_precisions(doc, path)
    for other in precisions:   # a malformed rate set is an error whichever is planned
        if other != precision:
            _rate_figures(rate_block(doc, path, other), _where(path, other), legacy={})
    figures: dict[str, Figure] = {}
    for section, keys in REQUIRED_FIGURES.items():
        block = doc.get(section)
        if not isinstance(block, Mapping):
            raise MachineError(f"{path}: missing section {section!r} (needs {list(keys)})")
        for key in keys:
            if key not in block:
                raise MachineError(f"{path}: missing figure {section}.{key}")
        for key, leaf in block.items():
            figures[f"{section}.{key}"] = _figure(path, f"{section}.{key}", leaf)
    block = rate_block(doc, path, precision) if precisions else doc
    rates, curves, curve_axes = _rate_figures(block, _where(path, precision), figures)
    figures.update(rates)
    cpu = doc.get("cpu") or {}
    if not isinstance(cpu, Mapping):
        raise MachineError(f"{path}: cpu must be a mapping (model_name, capability, flags), "
                           f"got {cpu!r}")
    name = doc.get("name") or os.path.splitext(os.path.basename(path))[0]
    return Machine(name=str(name), description=str(doc.get("description", "")), path=path,
                   figures=figures, cpu=dict(cpu), calibrated=bool(doc.get("calibrated", False)),
                   curves=curves, curve_axes=curve_axes, fabric=doc.get("fabric"),
                   precision=precision, precisions=precisions)


def _where(path: str, precision: str) -> str:
    """How errors name a precision's rates: the file, then ``rates.PRECISION`` where keyed."""
    return path if precision == BASE_PRECISION else f"{path}: rates.{precision}"


def _rate_figures(block: Mapping[str, Any], where: str, legacy: Mapping[str, Figure]
                  ) -> tuple[dict[str, Figure], dict, dict]:
    """One precision's rate sections (RATE_SECTIONS) read from ``block``: the figures, the
    curves and their axes. ``legacy``: the node figures, whose ``sustained_fraction`` stands
    in for a missing ``compute`` (files written before per-class costing)."""
    figures = _optional_section(block, where, "compute", COMPUTE_FIGURES,
                                "state each figure with its source")
    figures.update(_optional_section(block, where, "thread_scaling", THREAD_FIGURES,
                                     "delete the section to assume linear scaling"))
    if "compute.conv_3x3" not in figures and "node.sustained_fraction" not in legacy:
        raise MachineError(f"{where}: missing section 'compute' (needs "
                           f"{list(COMPUTE_FIGURES)}); measure it with `hpcdl plan --calibrate`")
    figures.update(_optional_section(block, where, "contention", ("ranks",),
                                     "delete the section to assume none"))
    curves, curve_axes = _curves(block.get("rate_curves"), where)
    return figures, curves, curve_axes


def _curves(block: Any, path: str) -> tuple[dict[str, tuple[tuple[float, float], ...]],
                                            dict[str, str]]:
    """The optional ``rate_curves`` section: per class, positive ``[x, fraction]`` points in
    increasing x, with a source and the ``axis`` x is on (``work``, the default of files
    written before axes existed, or ``gemm_rows``). Returns the curves and their axes."""
    from hpcdl.plan.class_rates import ROWS_AXIS, WORK_AXIS

    if block is None:
        return {}, {}
    if not isinstance(block, Mapping):
        raise MachineError(f"{path}: rate_curves must map a class to {{points, source}}")
    curves, axes = {}, {}
    for op_class, curve in block.items():
        where = f"{path}: rate_curves.{op_class}"
        if op_class not in (*OP_CLASSES, LINEAR_WEIGHTS):
            raise MachineError(f"{where}: unknown class (known: {list(OP_CLASSES)}, "
                               f"{LINEAR_WEIGHTS})")
        if not isinstance(curve, Mapping) or not str(curve.get("source") or "").strip():
            raise MachineError(f"{where} must be a mapping with 'points' and a 'source'")
        try:
            points = tuple((float(w), float(f)) for w, f in curve.get("points") or ())
        except (TypeError, ValueError) as exc:
            raise MachineError(f"{where}.points must be [work, fraction] pairs: {exc}") from exc
        if not points or any(w <= 0 or f <= 0 for w, f in points) \
                or any(b[0] <= a[0] for a, b in zip(points, points[1:], strict=False)):
            raise MachineError(f"{where}.points must be positive [x, fraction] pairs in "
                               f"increasing x, got {curve.get('points')!r}")
        axis = str(curve.get("axis", WORK_AXIS))
        if axis not in (WORK_AXIS, ROWS_AXIS):
            raise MachineError(f"{where}.axis must be {WORK_AXIS!r} or {ROWS_AXIS!r}, "
                               f"got {axis!r}")
        curves[op_class], axes[op_class] = points, axis
    return curves, axes


def _optional_section(doc: Mapping[str, Any], path: str, section: str, keys: Sequence[str],
                      otherwise: str) -> dict[str, Figure]:
    """An optional section of figures: absent, or every one of ``keys`` (an error naming the
    missing ones and ``otherwise``, what the user can do instead of recalibrating)."""
    block = doc.get(section)
    if block is None:
        return {}
    if not isinstance(block, Mapping):
        raise MachineError(f"{path}: {section} must be a mapping of figures {keys}")
    missing = [k for k in keys if k not in block]
    if missing:
        raise MachineError(f"{path}: {section} is missing {missing} (recalibrate with "
                           f"`hpcdl plan --calibrate`, or {otherwise})")
    return {f"{section}.{k}": _figure(path, f"{section}.{k}", v) for k, v in block.items()}


def planned_precision(doc: Mapping[str, Any], requested: str) -> str:
    """``train.precision`` resolved for the CPU a machine file describes, as a run there
    resolves it (hpcdl.train.config.resolve_precision): ``auto`` is bf16 where that CPU's
    recorded flags and torch capability make bf16 native (hpcdl.cpus.bf16_native), float32
    for a file that records neither (its CPU is unknown)."""
    from hpcdl.cpus import bf16_native
    from hpcdl.train.config import resolve_precision

    cpu = doc.get("cpu") if isinstance(doc.get("cpu"), Mapping) else {}
    native = bf16_native(set(cpu.get("flags") or ()), str(cpu.get("capability") or ""))
    return resolve_precision(requested, native)


def load_machine(name: str, machines_dir: str | None = None,
                 precision: str = BASE_PRECISION) -> Machine:
    """Machine ``name`` from the search path (:func:`machine_search_path`), validated, costing
    ``precision``'s rates (``auto``: :func:`planned_precision`)."""
    path = find_machine_file(name, machines_dir)
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise MachineError(f"{path}: not valid YAML: {exc}") from exc
    if precision == "auto" and isinstance(doc, Mapping):
        precision = planned_precision(doc, precision)
    return parse_machine(doc, path, precision)
