"""What a fat tree adds to the planner's allreduce: the planner's own schedule, run in SimGrid.

The α-β formula of hpcdl.plan.model gives every message the whole link. ``hpcdl plan
--simulate`` replays the schedule the planner costs (the same buckets, algorithm and ranks per
node) as flows on a fat tree in SimGrid (Casanova et al., JPDC 2014): placement,
oversubscription and link sharing. The schedules are pure functions of bulk-synchronous steps
of (source node, destination node, bytes) messages; one driver actor sends each step's
messages host to host under CM02 with factors 1 (a lone message takes α + nβ, the formula's
own term); alike ring steps are simulated once and scaled; the step around the allreduce is
the planner's. SimGrid runs in a child process (one engine per process). The model, its
choices and their reasons, the fabric figures and the install: docs/planner.md, "--simulate".
"""
from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import json
import math
import os
import random
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hpcdl.buckets import MIB
from hpcdl.errors import BadInputError
from hpcdl.plan.machine import Machine
from hpcdl.plan.model import (
    Placement,
    Plan,
    PlanInputs,
    allreduce_s,
    exposed_comm_s,
    no_free_core,
    reduction_gamma,
)

#: SimGrid's numerical precision as configured here: event times are exact to within
#: SURF_PRECISION_S seconds (``surf/precision``), shared rates to within MAXMIN_PRECISION
#: relative (``maxmin/precision``). Tests derive their tolerance from these.
SURF_PRECISION_S = 1e-9
MAXMIN_PRECISION = 1e-9
PLACEMENTS = ("contiguous", "scattered", "random")
DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"
#: The fabric's figures: name -> (type, what it is). Each is ``{value, source}`` in the file.
FABRIC_FIGURES: dict[str, tuple[type, str]] = {
    "levels": (int, "1 (one switch) or 2 (leaf switches under a core)"),
    "nodes_per_leaf": (int, "nodes on one leaf switch"),
    "leaf_uplinks": (int, "links from a leaf to the core (nodes_per_leaf / leaf_uplinks is "
                          "the oversubscription)"),
    "machine_nodes": (int, "nodes on the whole fabric (scattered placement draws from them)"),
    "node_link_Bps": (float, "a node's link to its leaf, bytes/s per direction"),
    "uplink_Bps": (float, "a leaf-core link, bytes/s per direction"),
    "switch_latency_s": (float, "latency added per leaf-core link crossed"),
    "placement": (str, "contiguous, scattered, random, or a Slurm node list"),
}


class SimulationError(BadInputError, ValueError):
    """--simulate cannot run as asked: SimGrid missing, a bad fabric, placement or mode."""


# --------------------------------------------------------------------------- the fabric
@dataclass(frozen=True)
class Fabric:
    """A fat tree as SimGrid builds it (``NetZone.create_fatTree_zone``), plus the node
    loopback. ``levels`` 1: one switch holding ``nodes_per_leaf`` nodes."""

    levels: int
    nodes_per_leaf: int
    leaf_uplinks: int
    machine_nodes: int
    node_link_Bps: float
    uplink_Bps: float
    node_latency_s: float        # per node link: α/2, so two nodes of one leaf are α apart
    switch_latency_s: float      # per leaf-core link
    loopback_Bps: float          # ranks of one node: intra_node.bandwidth_Bps
    loopback_latency_s: float
    placement: str
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def oversubscription(self) -> float:
        return self.nodes_per_leaf / self.leaf_uplinks if self.levels == 2 else 1.0

    def leaves(self, nodes: int) -> int:
        """Leaf switches built: enough for the whole machine and for the job."""
        return max(1, math.ceil(max(nodes, self.machine_nodes) / self.nodes_per_leaf))

    def hosts(self, nodes: int) -> int:
        return self.leaves(nodes) * self.nodes_per_leaf if self.levels == 2 else max(
            nodes, self.machine_nodes)

    def describe(self, nodes: int) -> str:
        if self.levels == 1:
            return (f"one switch, {self.hosts(nodes)} nodes, node links "
                    f"{self.node_link_Bps / 1e9:.4g} GB/s")
        return (f"fat tree, {self.leaves(nodes)} leaves x {self.nodes_per_leaf} nodes, "
                f"{self.leaf_uplinks} uplinks each ({self.nodes_per_leaf}:{self.leaf_uplinks}"
                f" = {self.oversubscription:.3g}:1), node links "
                f"{self.node_link_Bps / 1e9:.4g} GB/s, uplinks {self.uplink_Bps / 1e9:.4g} GB/s,"
                f" +{self.switch_latency_s * 1e9:.0f} ns per core link")


def _fabric_value(path: str, key: str, raw: Any) -> Any:
    if key not in FABRIC_FIGURES:
        raise SimulationError(f"{path}: fabric.{key} is not a fabric figure (known: "
                              f"{sorted(FABRIC_FIGURES)})")
    kind, what = FABRIC_FIGURES[key]
    try:
        value = kind(float(raw)) if kind is int else kind(raw)
    except (TypeError, ValueError):
        raise SimulationError(f"{path}: fabric.{key} must be a {kind.__name__} ({what}), "
                              f"got {raw!r}") from None
    if kind is int and float(raw) != value:
        raise SimulationError(f"{path}: fabric.{key} must be a whole number, got {raw!r}")
    if kind is not str and not value >= 0:
        raise SimulationError(f"{path}: fabric.{key} must be >= 0, got {raw!r}")
    return value


def load_fabric(machine: Machine, overrides: Mapping[str, str] | None = None) -> Fabric:
    """The machine file's ``fabric:`` section with ``overrides`` (``--fabric-set``) on top;
    missing figures: one non-blocking switch at the machine's ``network`` figures."""
    path, block = machine.path, machine.fabric
    if block is not None and not isinstance(block, Mapping):
        raise SimulationError(f"{path}: fabric must be a mapping of {{value, source}} figures")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, leaf in (block or {}).items():
        if not isinstance(leaf, Mapping) or "value" not in leaf \
                or not str(leaf.get("source") or "").strip():
            raise SimulationError(f"{path}: fabric.{key} must be a mapping with 'value' and "
                                  f"'source', got {leaf!r}")
        values[key] = _fabric_value(path, key, leaf["value"])
        sources[key] = str(leaf["source"]).strip()
    for key, raw in (overrides or {}).items():
        values[key] = _fabric_value("--fabric-set", key, raw)
        sources[key] = "--fabric-set on the command line"
    return _fabric_from(values, sources, machine)


def _fabric_from(values: dict[str, Any], sources: dict[str, str], machine: Machine) -> Fabric:
    def take(key: str, default: Any, why: str) -> Any:
        if key not in values:
            sources[key] = why
        return values.get(key, default)

    levels = take("levels", 1, "default: one switch (the machine file has no fabric.levels)")
    if levels not in (1, 2):
        raise SimulationError(f"fabric.levels must be 1 (one switch) or 2 (leaves and a core),"
                              f" got {levels}")
    machine_nodes = take("machine_nodes", 0, "default: the job's nodes")
    npl = take("nodes_per_leaf", 0, "default: every node on the one switch")
    if levels == 2 and npl < 1:
        raise SimulationError("fabric.nodes_per_leaf must be >= 1 for a two-level fat tree")
    uplinks = take("leaf_uplinks", npl, "default: as many uplinks as nodes (non-blocking)")
    if levels == 2 and uplinks < 1:
        raise SimulationError("fabric.leaf_uplinks must be >= 1")
    node_bw = take("node_link_Bps", machine["network.bandwidth_Bps"],
                   "default: the machine's network.bandwidth_Bps")
    uplink_bw = take("uplink_Bps", node_bw, "default: as fabric.node_link_Bps")
    if node_bw <= 0 or uplink_bw <= 0:
        raise SimulationError("fabric link rates must be > 0 bytes/s")
    return Fabric(
        levels=levels, nodes_per_leaf=max(1, npl), leaf_uplinks=max(1, uplinks),
        machine_nodes=machine_nodes, node_link_Bps=node_bw, uplink_Bps=uplink_bw,
        node_latency_s=machine["network.latency_s"] / 2.0,
        switch_latency_s=take("switch_latency_s", 0.0, "default: none"),
        loopback_Bps=machine["intra_node.bandwidth_Bps"],
        loopback_latency_s=machine["intra_node.latency_s"],
        placement=take("placement", "contiguous", "default: ranks in node order"),
        sources=dict(sources))


# --------------------------------------------------------------------------- placement
def expand_nodelist(text: str) -> list[str]:
    """A Slurm node list (``c[001-004,010]``, ``a1,b[2-3]``) as names, in its order."""
    names: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        names.extend(_expand_one(item.strip()))
    if not names:
        raise SimulationError(f"--placement {text!r}: no node names in it")
    return names


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", item)
    if not m:
        return [item] if item else []
    head, ranges, tail = m.groups()
    out: list[str] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SimulationError(f"node list {item!r}: {part!r} is not N or N-M")
        hi = hi or lo
        if int(hi) < int(lo):
            raise SimulationError(f"node list {item!r}: range {part!r} runs backwards")
        width = len(lo)
        out.extend(head + str(i).zfill(width) + rest
                   for i in range(int(lo), int(hi) + 1) for rest in _expand_one(tail) or [""])
    return out


def node_positions(placement: str, nodes: int, fabric_nodes: int,
                   seed: int = 0) -> list[int]:
    """The fabric position (0-based host index, leaf = index // nodes_per_leaf) of each of
    the job's ``nodes`` nodes, in rank order, for a ``placement`` of docs/planner.md's
    "Placement" (a Slurm node list: each name's digits as a number counted from 1)."""
    if placement == "contiguous":
        return list(range(nodes))
    if placement in ("scattered", "random"):
        if nodes > fabric_nodes:
            raise SimulationError(f"{nodes} nodes do not fit the fabric's {fabric_nodes}")
        chosen = random.Random(f"{seed}:{nodes}").sample(range(fabric_nodes), nodes)
        return chosen if placement == "random" else sorted(chosen)
    names = expand_nodelist(placement)
    if len(names) < nodes:
        raise SimulationError(f"--placement {placement!r} names {len(names)} nodes; the job "
                              f"needs {nodes}")
    positions = []
    for name in names[:nodes]:
        digits = "".join(re.findall(r"\d", name))
        if not digits or int(digits) < 1:
            raise SimulationError(f"node {name!r} has no number >= 1 to place it on the fabric")
        positions.append(int(digits) - 1)
    if len(set(positions)) != len(positions):
        raise SimulationError(f"--placement {placement!r} names a node twice")
    if max(positions) >= fabric_nodes:
        raise SimulationError(f"node {names[positions.index(max(positions))]!r} is position "
                              f"{max(positions)} but the fabric has {fabric_nodes} nodes "
                              "(raise fabric.machine_nodes)")
    return positions


# --------------------------------------------------------------------------- the schedules
Message = tuple[int, int, float]     # (source node position, destination, bytes)


@dataclass(frozen=True)
class Phase:
    """``repeats`` bulk-synchronous steps, each sending ``messages`` and then reducing for
    ``reduce_s`` seconds (every step of a phase moves the same pattern)."""

    messages: tuple[Message, ...]
    repeats: int
    reduce_s: float = 0.0


def ring_phases(where: Sequence[int], n: float, gamma: float) -> list[Phase]:
    """Ring allreduce over the ranks in order (``where[r]``: rank r's node): p−1 reduce-scatter
    steps then p−1 allgather steps, each rank sending n/p bytes to the next."""
    p = len(where)
    if p <= 1 or n <= 0:
        return []
    chunk = n / p
    step = tuple((where[r], where[(r + 1) % p], chunk) for r in range(p))
    return [Phase(step, p - 1, chunk * gamma), Phase(step, p - 1)]


def rabenseifner_phases(where: Sequence[int], n: float, gamma: float) -> list[Phase]:
    """MPICH's reduce-scatter + allgather allreduce (recursive halving from distance 1, then
    doubling back); the r = p − 2^⌊log2 p⌋ extra ranks first send their n bytes to a
    neighbour (even rank 2i to 2i+1, i < r) and get the result back at the end."""
    p = len(where)
    if p <= 1 or n <= 0:
        return []
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2

    def real(newrank: int) -> int:
        return newrank * 2 + 1 if newrank < rem else newrank + rem

    phases = []
    fold = tuple((where[2 * i], where[2 * i + 1], n) for i in range(rem))
    if fold:
        phases.append(Phase(fold, 1, n * gamma))
    halvings, size, mask = [], n, 1
    while mask < p2:
        size /= 2
        pairs = tuple((where[real(i)], where[real(i ^ mask)], size) for i in range(p2))
        halvings.append(Phase(pairs, 1, size * gamma))
        mask <<= 1
    phases += halvings
    phases += [Phase(h.messages, 1) for h in reversed(halvings)]
    if fold:
        phases.append(Phase(tuple((b, a, s) for a, b, s in fold), 1))
    return phases


def hierarchical_phases(node_where: Sequence[int], q: int, n: float,
                        gamma: float) -> list[Phase]:
    """hpcdl.plan.model.hierarchical_allreduce_s as steps: a ring inside each node, q rings
    of n/q across the N nodes (sharing the node's link), the ring inside the node again."""
    big_n = len(node_where)
    if q * big_n <= 1 or n <= 0:
        return []
    phases = []
    if q > 1:
        intra = tuple((w, w, n / q) for w in node_where for _ in range(q))
        phases.append(Phase(intra, q - 1, n / q * gamma))
    if big_n > 1:
        chunk = n / (q * big_n)
        inter = tuple((node_where[k], node_where[(k + 1) % big_n], chunk)
                      for _ in range(q) for k in range(big_n))
        phases += [Phase(inter, big_n - 1, chunk * gamma), Phase(inter, big_n - 1)]
    if q > 1:
        phases.append(Phase(intra, q - 1))
    return phases


def allreduce_phases(algorithm: str, positions: Sequence[int], procs: int, procs_per_node: int,
                     n: float, gamma: float) -> list[Phase]:
    """The steps of one allreduce of ``n`` bytes: rank r on node r // procs_per_node, node k
    at fabric position ``positions[k]``."""
    where = [positions[r // procs_per_node] for r in range(procs)]
    flat = {"ring": ring_phases, "rabenseifner": rabenseifner_phases}
    if algorithm in flat:
        return flat[algorithm](where, n, gamma)
    if algorithm == "hierarchical":
        q = min(procs, procs_per_node)
        if procs % q:
            raise SimulationError(f"hierarchical allreduce: {procs} ranks are not whole nodes "
                                  f"of {q}; the simulation needs full nodes")
        return hierarchical_phases(list(positions[:procs // q]), q, n, gamma)
    raise SimulationError(f"unknown allreduce algorithm {algorithm!r}")


# --------------------------------------------------------------------------- SimGrid
def find_simgrid() -> str | None:
    """Where the SimGrid Python module is (an importable ``simgrid``, else Debian's
    ``python3-simgrid`` extension built for this Python's ABI), or None."""
    spec = importlib.util.find_spec("simgrid")
    if spec is not None and spec.origin:
        return spec.origin
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = os.path.join(DEBIAN_DIST_PACKAGES, f"simgrid{suffix}")
        if suffix != ".so" and os.path.isfile(candidate):
            return candidate
    return None


def missing_simgrid_message() -> str:
    others = sorted(glob.glob(os.path.join(DEBIAN_DIST_PACKAGES, "simgrid*.so")))
    found = f" (found {others[0]}, built for another Python)" if others else ""
    return ("--simulate needs SimGrid's Python module, which is not importable here"
            f"{found}: on Debian 12 / Python 3.11 `apt-get install python3-simgrid`; "
            "elsewhere `pip install simgrid` (a source build, see docs/planner.md)")


def _import_simgrid(origin: str) -> Any:
    """Import SimGrid from ``origin``, its start-up chatter on stderr discarded."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            if importlib.util.find_spec("simgrid") is not None:
                import simgrid
                return simgrid
            spec = importlib.util.spec_from_file_location("simgrid", origin)
            module = importlib.util.module_from_spec(spec)
            sys.modules["simgrid"] = module
            spec.loader.exec_module(module)
            return module
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _configure(sg: Any) -> None:
    """CM02, factors 1, no TCP window bound, no cross-traffic; precision as stated above.
    Option names changed in SimGrid 3.34 (precision/*); try the new, then the old."""
    settings = [("network/model", "CM02"), ("network/crosstraffic", "0"),
                ("network/latency-factor", "1"), ("network/bandwidth-factor", "1"),
                ("network/weight-S", "0"), ("network/TCP-gamma", "0"),
                (("precision/timing", "surf/precision"), str(SURF_PRECISION_S)),
                (("precision/work-amount", "maxmin/precision"), str(MAXMIN_PRECISION))]
    for keys, value in settings:
        names = keys if isinstance(keys, tuple) else (keys,)
        for i, name in enumerate(names):
            try:
                sg.Engine.set_config(f"{name}:{value}")
                break
            except Exception:  # noqa: BLE001 -- SimGrid raises IndexError or its own kinds
                if i == len(names) - 1:
                    raise


def _build_platform(sg: Any, engine: Any, fabric: dict[str, Any],
                    hosts_needed: int) -> list[Any]:
    """The fat tree (``NetZone.create_fatTree_zone``), each host with its loopback link;
    leaf-core links re-rated to the uplink figures. Returns the hosts by position."""
    hosts: dict[int, Any] = {}

    def set_netpoint(zone: Any, coords: Any, ident: int) -> tuple[Any, Any]:
        host = zone.create_host(f"node{ident}", 1e9).seal()
        hosts[ident] = host
        return host.netpoint, None

    def set_loopback(zone: Any, coords: Any, ident: int) -> Any:
        link = zone.create_link(f"loopback{ident}", fabric["loopback_Bps"])
        link.set_latency(fabric["loopback_latency_s"])
        link.set_sharing_policy(sg.Link.SharingPolicy.FATPIPE, None)
        return link.seal()

    root = sg.NetZone.create_full_zone("root")
    if fabric["levels"] == 1:
        params = sg.FatTreeParams(1, [hosts_needed], [1], [1])
    else:
        leaves = hosts_needed // fabric["nodes_per_leaf"]
        params = sg.FatTreeParams(2, [fabric["nodes_per_leaf"], leaves],
                                  [1, fabric["leaf_uplinks"]], [1, 1])
    zone = sg.NetZone.create_fatTree_zone(
        "fabric", root, params, sg.ClusterCallbacks(set_netpoint, set_loopback, None),
        fabric["node_link_Bps"], fabric["node_latency_s"], sg.Link.SharingPolicy.SPLITDUPLEX)
    zone.seal()
    root.seal()
    # SimGrid names fat-tree links link_from_<lower id>_<upper id>_<n>; hosts are ids
    # 0..hosts-1, so a link whose lower end is no host joins a leaf to the core.
    for link in engine.all_links:
        m = re.match(r"link_from_(\d+)_(\d+)_", link.name)
        if m and int(m.group(1)) >= hosts_needed:
            link.set_bandwidth(fabric["uplink_Bps"])
            link.set_latency(fabric["switch_latency_s"])
    return [hosts[i] for i in range(hosts_needed)]


def run_patterns(fabric: dict[str, Any], hosts_needed: int,
                 patterns: Sequence[tuple[Sequence[Message], int]]) -> list[float]:
    """In this process (once per process): build the platform and simulate each
    (messages, steps) pattern ``steps`` times in a row; return each pattern's mean step."""
    origin = find_simgrid()
    if origin is None:
        raise SimulationError(missing_simgrid_message())
    sg = _import_simgrid(origin)
    engine = sg.Engine(["hpcdl-plan-simulate", "--log=root.thres:critical"])
    _configure(sg)
    hosts = _build_platform(sg, engine, fabric, hosts_needed)
    seconds = [0.0] * len(patterns)

    def driver() -> None:
        for i, (messages, steps) in enumerate(patterns):
            start = sg.Engine.clock
            for _ in range(steps):
                comms = [sg.Comm.sendto_async(hosts[s], hosts[d], int(round(b)))
                         for s, d, b in messages]
                sg.Comm.wait_all(comms)
            seconds[i] = (sg.Engine.clock - start) / steps

    sg.Actor.create("driver", hosts[0], driver)
    engine.run()
    return seconds


def simulate_patterns(fabric: Fabric, hosts_needed: int,
                      patterns: Sequence[tuple[Sequence[Message], int]]) -> list[float]:
    """:func:`run_patterns` in a child process (SimGrid: one engine per process)."""
    if find_simgrid() is None:
        raise SimulationError(missing_simgrid_message())
    payload = json.dumps({"fabric": asdict(fabric), "hosts": hosts_needed,
                          "patterns": [[list(map(list, m)), s] for m, s in patterns]})
    proc = subprocess.run([sys.executable, "-m", "hpcdl.plan.simulate"], input=payload,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise SimulationError(f"SimGrid run failed (exit {proc.returncode}): {tail[0]}")
    return json.loads(proc.stdout)["seconds"]


# --------------------------------------------------------------------------- the step
@dataclass
class SimulatedRow:
    """One process count: the allreduce per distinct bucket and the step, formula vs
    SimGrid (seconds)."""

    procs: int
    nodes: int
    leaves_used: int
    buckets: list[dict[str, float]]          # {bytes, count, formula_s, simulated_s}
    comm_formula_s: float
    comm_simulated_s: float
    comm_exposed_formula_s: float
    comm_exposed_simulated_s: float
    iteration_formula_s: float
    iteration_simulated_s: float
    total_formula_s: float
    total_simulated_s: float

    @property
    def comm_ratio(self) -> float:
        return self.comm_simulated_s / self.comm_formula_s if self.comm_formula_s else 1.0

    @property
    def iteration_ratio(self) -> float:
        return self.iteration_simulated_s / self.iteration_formula_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "comm_ratio": self.comm_ratio,
                "iteration_ratio": self.iteration_ratio}


@dataclass
class Simulation:
    """``hpcdl plan --simulate``'s answer: the fabric, the placement and one row per process
    count (the main run first)."""

    fabric: Fabric
    fabric_text: str
    placement: str
    seed: int
    allreduce: str
    simulated_steps: int
    rows: list[SimulatedRow]
    main_procs: int = 0                    # the run asked for (its buckets are listed)
    simulated_messages: int = 0
    model: str = ("SimGrid CM02 fluid model, latency/bandwidth factors 1, TCP-gamma 0, "
                  "cross-traffic off; bulk-synchronous steps")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [r.to_dict() for r in self.rows]}


def _phases_seconds(phases: Sequence[Phase], pattern_s: Mapping[int, float]) -> float:
    return sum(ph.repeats * (pattern_s[id(ph.messages)] + ph.reduce_s) for ph in phases)


def _step_with_comm(p: Plan, inp: PlanInputs, machine: Machine, comm: float,
                    last_bucket: float) -> tuple[float, float]:
    """(exposed comm, iteration) of plan ``p`` with its allreduce replaced: the planner's
    overlap and data rules (hpcdl.plan.model.plan) on the simulated time."""
    overlap = inp.overlap and not no_free_core(machine, Placement(p.procs, inp.procs_per_node))
    exposed = exposed_comm_s(comm, last_bucket, p.compute_s, overlap)
    busy = p.compute_s + p.optimizer_s + exposed
    iteration = busy + p.compression_s + max(0.0, p.data_s - busy)
    return exposed, iteration


def simulate_plans(machine: Machine, inp: PlanInputs, plans: Sequence[Plan],
                   fabric: Fabric, placement: str | None = None, seed: int = 0,
                   simulated_steps: int = 2) -> Simulation:
    """Simulate the gradient allreduce of each plan (one per process count, same inputs
    otherwise; ``inp.procs`` is the run asked for) on ``fabric``; every bucket and process
    count in one SimGrid run."""
    if inp.relaxed:
        raise SimulationError("--simulate costs the synchronous gradient allreduce; local SGD "
                              "and compression are not simulated (drop --local-steps / "
                              "--compression-ratio / --powersgd-rank)")
    if simulated_steps < 1:
        raise SimulationError(f"simulated steps must be >= 1, got {simulated_steps}")
    placement = placement or fabric.placement
    if placement not in PLACEMENTS and not re.search(r"\d", placement):
        raise SimulationError(f"--placement {placement!r}: choose {', '.join(PLACEMENTS)} or "
                              "a Slurm node list like c[001-004,010]")
    max_nodes = max(p.nodes for p in plans)
    hosts_needed = fabric.hosts(max_nodes)
    fabric_nodes = max(fabric.machine_nodes, max_nodes)   # the leaf padding holds no node
    patterns: dict[int, tuple[Sequence[Message], int]] = {}
    work: list[tuple[Plan, list[tuple[float, int, float, list[Phase]]], list[int]]] = []
    for p in plans:
        place = Placement(p.procs, inp.procs_per_node)
        positions = node_positions(placement, place.nodes, fabric_nodes, seed)
        gamma = reduction_gamma(machine, place.local_size)
        buckets = p.bucket_bytes
        distinct = []
        for size in sorted(set(buckets), key=buckets.index):
            phases = allreduce_phases(inp.allreduce, positions, p.procs, inp.procs_per_node,
                                      size, gamma)
            for ph in phases:
                patterns.setdefault(id(ph.messages),
                                    (ph.messages, min(ph.repeats, simulated_steps)))
            distinct.append((size, buckets.count(size),
                             allreduce_s(inp.allreduce, machine, place, size), phases))
        work.append((p, distinct, positions))
    keys = list(patterns)
    seconds = simulate_patterns(fabric, hosts_needed, [patterns[k] for k in keys])
    pattern_s = dict(zip(keys, seconds, strict=True))
    rows = [_row(p, inp, machine, fabric, distinct, positions, pattern_s)
            for p, distinct, positions in work]
    return Simulation(fabric=fabric, fabric_text=fabric.describe(max_nodes), placement=placement,
                      seed=seed, allreduce=inp.allreduce, simulated_steps=simulated_steps,
                      rows=rows, main_procs=inp.procs,
                      simulated_messages=sum(len(m) * s for m, s in patterns.values()))


def _row(p: Plan, inp: PlanInputs, machine: Machine, fabric: Fabric,
         distinct: list[tuple[float, int, float, list[Phase]]], positions: list[int],
         pattern_s: Mapping[int, float]) -> SimulatedRow:
    buckets = [{"bytes": size, "count": count, "formula_s": formula,
                "simulated_s": _phases_seconds(phases, pattern_s)}
               for size, count, formula, phases in distinct]
    comm = sum(b["count"] * b["simulated_s"] for b in buckets)
    last = buckets[-1]["simulated_s"] if buckets else 0.0
    exposed, iteration = _step_with_comm(p, inp, machine, comm, last)
    iterations = p.iterations_per_epoch
    leaves = {pos // fabric.nodes_per_leaf for pos in positions} if fabric.levels == 2 else {0}
    return SimulatedRow(
        procs=p.procs, nodes=p.nodes, leaves_used=len(leaves),
        buckets=buckets, comm_formula_s=p.comm_s, comm_simulated_s=comm,
        comm_exposed_formula_s=p.comm_exposed_s, comm_exposed_simulated_s=exposed,
        iteration_formula_s=p.iteration_s, iteration_simulated_s=iteration,
        total_formula_s=p.total_s, total_simulated_s=inp.epochs * iterations * iteration)


def simulation_table(sim: Simulation) -> str:
    """The rows as a text table: allreduce and step, formula vs SimGrid."""
    head = (f"\nsimulated (SimGrid) on {sim.fabric_text}; placement {sim.placement}"
            f"{f' (seed {sim.seed})' if sim.placement in ('scattered', 'random') else ''}; "
            f"{sim.allreduce} allreduce; {sim.model}")
    cols = ("procs", "nodes", "leaves", "allreduce/step formula", "simulated", "ratio",
            "step formula", "step simulated", "ratio", "total min formula", "simulated")
    lines = [head]
    for r in sim.rows:
        for b in r.buckets if r.procs == sim.main_procs else ():
            ratio = b["simulated_s"] / b["formula_s"] if b["formula_s"] else 1.0
            lines.append(f"  {r.procs} ranks, {b['count']} bucket(s) of "
                         f"{b['bytes'] / MIB:.4g} MiB: formula {b['formula_s'] * 1e3:.2f} ms, "
                         f"simulated {b['simulated_s'] * 1e3:.2f} ms each ({ratio:.2f}x)")
    lines.append("  ".join(cols))
    for r in sim.rows:
        cells = (f"{r.procs:5d}", f"{r.nodes:5d}", f"{r.leaves_used:6d}",
                 f"{r.comm_formula_s * 1e3:19.2f} ms", f"{r.comm_simulated_s * 1e3:7.2f} ms",
                 f"{r.comm_ratio:5.2f}", f"{r.iteration_formula_s:10.3f} s",
                 f"{r.iteration_simulated_s:12.3f} s", f"{r.iteration_ratio:5.2f}",
                 f"{r.total_formula_s / 60:17.2f}", f"{r.total_simulated_s / 60:9.2f}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def simulate(machine: Machine, inp: PlanInputs, plans: Sequence[Plan],
             placement: str | None = None, fabric_overrides: Sequence[str] = (),
             seed: int = 0, simulated_steps: int = 2) -> Simulation:
    """``hpcdl plan --simulate``: the fabric from the machine file and ``KEY=VALUE``
    overrides, then :func:`simulate_plans`."""
    overrides = {}
    for item in fabric_overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SimulationError(f"--fabric-set wants KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value.strip()
    fabric = load_fabric(machine, overrides)
    return simulate_plans(machine, inp, plans, fabric, placement, seed, simulated_steps)


def _main() -> int:
    """Child process: JSON {fabric, hosts, patterns} on stdin, {seconds} on stdout."""
    job = json.load(sys.stdin)
    patterns = [([tuple(m) for m in messages], steps) for messages, steps in job["patterns"]]
    try:
        seconds = run_patterns(job["fabric"], job["hosts"], patterns)
    except SimulationError as exc:
        print(exc, file=sys.stderr)
        return 2
    json.dump({"seconds": seconds}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
