"""The planner's cost model: one synchronous data-parallel SGD iteration, term by term.

    iteration = compute + optimizer + comm_exposed + data_exposed       (seconds)

compute: a roofline per operator of the layer table (Williams, Waterman & Patterson, CACM
2009); optimizer: the LARS update (You et al., ICPP 2018, Alg. 1), memory-bound; comm: one
α-β-γ allreduce per fusion bucket (Thakur, Rabenseifner & Gropp, IJHPCA 2005; Patarasuk &
Yuan 2009), every bucket but the last hidden behind backward; data: decoding beyond the step.
Local SGD, compression and their synchronous warm-up change the comm term. Every formula and
the assumptions behind it: docs/planner.md, "The model of one iteration".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hpcdl.buckets import LAST_BUCKET_BYTES, bucket_bounds, bucket_bytes
from hpcdl.plan.layers import (
    COMPUTE_CLASSES,
    LINEAR_WEIGHT_PASSES,
    LINEAR_WEIGHTS,
    OPTIMIZER,
    OPTIMIZER_BYTES_PER_PARAMETER,
    Layer,
    layer_table,
)
from hpcdl.plan.machine import Machine
from hpcdl.plan.workload import Workload
from hpcdl.train.config import CommConfig

IMAGENET_TRAIN_IMAGES = 1_281_167
BACKWARD_SHARE = 2.0 / 3.0   # backward = 2 of the 3 forward-equivalents of a training step
BYTES_TOUCHED_PER_REDUCED_BYTE = 3.0   # a += b reads a and b and writes a


# --------------------------------------------------------------------------- allreduce models
def ring_allreduce_s(p: int, n: float, alpha: float, beta: float, gamma: float) -> float:
    """Ring allreduce (reduce-scatter + allgather, p−1 steps each) of ``n`` bytes on ``p`` ranks:
    2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ  (Patarasuk & Yuan 2009; Thakur et al. 2005 §4)."""
    if p <= 1 or n <= 0:
        return 0.0
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma


def rabenseifner_allreduce_s(p: int, n: float, alpha: float, beta: float,
                             gamma: float) -> float:
    """Rabenseifner: recursive-halving reduce-scatter + recursive-doubling allgather,
    2·log2(p)·α + 2(p−1)/p·nβ + (p−1)/p·nγ for p a power of two (Thakur et al. 2005, §4.4);
    other p fold the extra ranks in and out first (MPICH): + 2α + 2nβ + nγ."""
    if p <= 1 or n <= 0:
        return 0.0
    p2 = 1 << (p.bit_length() - 1)
    t = 2 * math.log2(p2) * alpha + 2 * (p2 - 1) / p2 * n * beta + (p2 - 1) / p2 * n * gamma
    if p2 != p:
        t += 2 * alpha + 2 * n * beta + n * gamma
    return t


def hierarchical_allreduce_s(nodes: int, local_size: int, n: float,
                             alpha: float, beta: float,
                             alpha_intra: float, beta_intra: float, gamma: float) -> float:
    """Two-level allreduce: reduce-scatter among the q = ``local_size`` ranks of a node
    (α_i, β_i), a ring allreduce of each n/q slice across the N nodes (the q flows share the
    NIC), an allgather inside the node (the formula: docs/planner.md's allreduce table)."""
    q, big_n = max(1, local_size), max(1, nodes)
    if q * big_n <= 1 or n <= 0:
        return 0.0
    intra_rs = (q - 1) * alpha_intra + (q - 1) / q * n * (beta_intra + gamma)
    inter = (2 * (big_n - 1) * alpha + 2 * (big_n - 1) / big_n * n * beta
             + (big_n - 1) / big_n * (n / q) * gamma)
    intra_ag = (q - 1) * alpha_intra + (q - 1) / q * n * beta_intra
    return intra_rs + inter + intra_ag


ALLREDUCE_ALGORITHMS = ("ring", "rabenseifner", "hierarchical")


@dataclass(frozen=True)
class Placement:
    """How ``procs`` ranks sit on nodes."""

    procs: int
    procs_per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.procs / self.procs_per_node)

    @property
    def local_size(self) -> int:
        """Ranks that share a node (the last node may hold fewer; the model uses full nodes)."""
        return min(self.procs, self.procs_per_node)


def reduction_gamma(machine: Machine, local_size: int) -> float:
    """γ, seconds per byte reduced: a rank streams 3 bytes per byte summed, at one core's
    memory bandwidth or its share of the node's, whichever is lower."""
    per_rank_bw = min(machine["node.core_stream_Bps"],
                      machine["node.memory_bandwidth_Bps"] / max(1, local_size))
    return BYTES_TOUCHED_PER_REDUCED_BYTE / per_rank_bw


def allreduce_s(algorithm: str, machine: Machine, placement: Placement, n: float) -> float:
    """Seconds for one allreduce of ``n`` bytes with ``algorithm`` on ``placement``."""
    p, q, nodes = placement.procs, placement.local_size, placement.nodes
    gamma = reduction_gamma(machine, q)
    a_net, b_net = machine["network.latency_s"], 1.0 / machine["network.bandwidth_Bps"]
    a_shm, b_shm = machine["intra_node.latency_s"], 1.0 / machine["intra_node.bandwidth_Bps"]
    # A flat algorithm over several nodes is paced by its inter-node hops: with ranks placed
    # node by node, each ring step moves one chunk per node across the network.
    alpha, beta = (a_net, b_net) if nodes > 1 else (a_shm, b_shm)
    if algorithm == "ring":
        return ring_allreduce_s(p, n, alpha, beta, gamma)
    if algorithm == "rabenseifner":
        return rabenseifner_allreduce_s(p, n, alpha, beta, gamma)
    if algorithm == "hierarchical":
        return hierarchical_allreduce_s(nodes, q, n, a_net, b_net, a_shm, b_shm, gamma)
    raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose one of "
                     f"{ALLREDUCE_ALGORITHMS}")


def gradient_buckets(work: Workload, bytes_per_element: float, bucket_mb: float) -> list[float]:
    """Bytes of each fusion bucket of ``work``'s gradients at ``bytes_per_element``, in launch
    order: the reducer's own rule (:func:`hpcdl.buckets.bucket_bounds`)."""
    elements = work.parameter_elements or (work.parameters,)
    sizes = [n * bytes_per_element for n in reversed(elements)]
    return [sum(sizes[start:end]) for start, end in
            bucket_bounds(sizes, bucket_bytes(bucket_mb), LAST_BUCKET_BYTES)]


# --------------------------------------------------------------------------- one iteration
@dataclass(frozen=True)
class PlanInputs:
    """Everything a prediction depends on besides the machine and the model's cost."""

    global_batch: int
    procs: int
    procs_per_node: int
    epochs: float = 90
    dataset_size: int = IMAGENET_TRAIN_IMAGES
    allreduce: str = "ring"
    bucket_mb: float = CommConfig.bucket_mb   # MiB, as the recipe's comm.bucket_mb
    wire_bytes: int = 4              # bytes per gradient element on the wire (4 fp32, 2 bf16)
    overlap: bool = True
    loader_cores_per_node: float | None = None   # None: the machine file's figure
    synthetic_data: bool = False     # True: no decoding (hpcdl bench train --synthetic)
    local_steps: int = 1             # H: local SGD averages the model every H steps
    hierarchical_local: bool = False  # local SGD: gradients averaged inside the node each step
    compression_ratio: float = 1.0   # dense gradient bytes / bytes sent (PowerSGD)
    sync_warmup_steps: int = 0       # synchronous iterations before local SGD / compression

    @property
    def relaxed(self) -> bool:
        """Whether iterations after the warm-up differ from synchronous ones."""
        return self.local_steps > 1 or self.compression_ratio > 1


#: PowerSGD's passes over each gradient element per step (hpcdl/comm/powersgd.py): read the
#: gradient and the error (M = G + E, written), read M for P = MQ and again for Q = MᵀP̂,
#: write P̂Qᵀ, read M and it and write E = M − P̂Qᵀ: 8 passes of 4 bytes.
COMPRESSION_BYTES_PER_PARAMETER = 32.0


@dataclass
class Plan:
    """A prediction: the per-iteration breakdown, then epoch, total and efficiency."""

    machine: str
    model: str
    image_size: int
    procs: int
    nodes: int
    procs_per_node: int
    global_batch: int
    batch_per_rank: float
    allreduce: str
    compute_s: float
    optimizer_s: float
    comm_s: float
    comm_hidden_s: float
    comm_exposed_s: float
    data_s: float
    data_exposed_s: float
    iteration_s: float
    iterations_per_epoch: int
    epoch_s: float
    total_s: float
    images_per_s: float
    images_per_s_per_rank: float
    scaling_efficiency: float
    required_images_per_s_per_node: float
    decode_images_per_s_per_node: float
    gradient_bytes: float
    buckets: int
    bucket_bytes: list[float]        # each fusion bucket, in launch order (gradient_buckets)
    dominant: str
    notes: list[str] = field(default_factory=list)
    local_steps: int = 1
    compression_ratio: float = 1.0
    model_average_s: float = 0.0     # per iteration: the model average's allreduce / H
    compression_s: float = 0.0       # per iteration: the compressor's own memory passes
    sync_warmup_steps: int = 0       # synchronous iterations first (costed apart)
    warmup_s: float = 0.0            # their total seconds (part of total_s)
    compute_by_class: dict[str, float] = field(default_factory=dict)   # seconds per class
    precision: str = "float32"       # the compute dtype whose rates were costed (the machine's)

    def per_iteration(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in (
            "compute_s", "optimizer_s", "compression_s", "comm_s", "comm_hidden_s",
            "comm_exposed_s", "data_s", "data_exposed_s", "iteration_s")}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rank_memory_Bps(machine: Machine, procs_per_node: int) -> float:
    """Stream bandwidth of one rank: its cores' rate, capped by its share of the node's."""
    return pass_rate_Bps(machine, 1.0, machine.threads_per_rank(procs_per_node), procs_per_node)


def rank_cores(machine: Machine, op_class: str, procs_per_node: int) -> float:
    """One rank's cores for ``op_class``, in one-core rates: its threads' measured speedup
    (Machine.thread_speedup) × its measured contention among the node's ranks
    (Machine.contention_factor) ÷ the ranks time-sharing its core (Machine.core_share)."""
    return (machine.thread_speedup(op_class, machine.threads_per_rank(procs_per_node))
            * machine.contention_factor(op_class, procs_per_node)
            / machine.core_share(procs_per_node))


def pass_rate_Bps(machine: Machine, fraction: float, cores: float,
                  procs_per_node: int) -> float:
    """Bytes/s of a memory-bound pass on one rank: ``fraction`` of one core's stream ×
    ``cores``, capped by the rank's share of the node's bandwidth (a roofline: scaling the
    *capped* stream by the fraction would count the contention twice)."""
    return min(fraction * machine["node.core_stream_Bps"] * cores,
               machine["node.memory_bandwidth_Bps"] / procs_per_node)


def memory_pass_s(machine: Machine, op_class: str, nbytes: float, procs_per_node: int) -> float:
    """Seconds of a memory-bound pass of ``op_class`` moving ``nbytes`` (nominal) on one rank:
    its fraction (Machine.class_fraction) at the rank's cores for the class, capped by the
    rank's share of the node (:func:`pass_rate_Bps`)."""
    fraction = machine.class_fraction(op_class, nbytes)
    cores = rank_cores(machine, op_class, procs_per_node)
    return nbytes / pass_rate_Bps(machine, fraction, cores, procs_per_node)


def optimizer_s(machine: Machine, work: Workload, procs_per_node: int) -> float:
    """The LARS update of every parameter: a memory pass of its nominal bytes at the
    ``compute.optimizer`` fraction (1 where the file has none)."""
    return memory_pass_s(machine, OPTIMIZER, OPTIMIZER_BYTES_PER_PARAMETER * work.parameters,
                         procs_per_node)


def layer_s(machine: Machine, layer: Layer, batch_per_rank: float, procs_per_node: int) -> float:
    """One operator's forward + backward seconds on one rank: its work at the class's
    one-core rate × the rank's cores for the class (:func:`rank_cores`), plus the overhead."""
    overhead = machine["compute.layer_overhead_s"] * machine.core_share(procs_per_node)
    if layer.op_class in COMPUTE_CLASSES:
        work = batch_per_rank * layer.train_flops
        fraction = machine.class_fraction(layer.op_class, work, batch_per_rank * layer.pixels)
        core_peak = machine.peak_flops_per_node / machine.cores_per_node
        t = work / (fraction * core_peak * rank_cores(machine, layer.op_class, procs_per_node))
        if layer.op_class == "linear":   # small batch: the weights stream from memory
            t = max(t, linear_weights_s(machine, layer, procs_per_node))
        return overhead + t
    return overhead + memory_pass_s(machine, layer.op_class,
                                    batch_per_rank * layer.memory_bytes(), procs_per_node)


def linear_weights_s(machine: Machine, layer: Layer, procs_per_node: int) -> float:
    """The weight-traffic floor of a linear layer (hpcdl.plan.layers.LINEAR_WEIGHTS) at the
    ``compute.linear_weights`` fraction (1 where the file has none)."""
    return memory_pass_s(machine, LINEAR_WEIGHTS, LINEAR_WEIGHT_PASSES * layer.param_bytes,
                         procs_per_node)


def compute_by_class(machine: Machine, work: Workload, batch_per_rank: float,
                     procs_per_node: int) -> dict[str, float]:
    """Seconds per operator class of one rank's forward + backward."""
    if not (machine.has_class_rates and work.layers):
        # sustained FLOP/s of one rank: the node's, shared by the ranks placed on it
        rank_flops = machine.sustained_flops_per_node / procs_per_node
        legacy = batch_per_rank * work.train_flops_per_image / rank_flops
        return {"all (sustained fraction)": legacy}
    seconds: dict[str, float] = {}
    for layer in work.layers:
        seconds[layer.op_class] = (seconds.get(layer.op_class, 0.0)
                                   + layer_s(machine, layer, batch_per_rank, procs_per_node))
    return seconds


def with_layer_table(machine: Machine, work: Workload) -> Workload:
    """``work`` with its layer table when the machine costs compute per class (counted once
    per model and size, then cached: hpcdl.plan.layers.layer_table)."""
    if not machine.has_class_rates or work.layers:
        return work
    try:
        return replace(work, layers=layer_table(work.model, work.image_size))
    except ValueError as exc:
        raise ValueError(f"{work.model}: the per-class compute term needs the layer table, "
                         f"and it cannot be counted: {exc}") from exc


def compute_s(machine: Machine, work: Workload, batch_per_rank: float,
              procs_per_node: int) -> float:
    return sum(compute_by_class(machine, work, batch_per_rank, procs_per_node).values())


def no_free_core(machine: Machine, place: Placement) -> bool:
    """One node whose ranks leave no core free: the shared-memory copies and sums run on the
    cores that compute, so no communication hides behind backward."""
    return place.nodes == 1 and place.local_size >= machine.cores_per_node


def exposed_comm_s(comm_total: float, last_bucket: float, compute: float,
                   overlap: bool) -> float:
    """Communication left on the critical path after hiding behind backward."""
    if not overlap:
        return comm_total
    hidden = min(comm_total - last_bucket, BACKWARD_SHARE * compute)
    return comm_total - max(0.0, hidden)


def _check(machine: Machine, inp: PlanInputs) -> None:
    if inp.procs < 1:
        raise ValueError(f"--procs must be >= 1, got {inp.procs}")
    if inp.procs_per_node < 1:
        raise ValueError(f"--procs-per-node must be >= 1, got {inp.procs_per_node}")
    if inp.global_batch < inp.procs:
        raise ValueError(f"global batch {inp.global_batch} is smaller than {inp.procs} ranks: "
                         "every rank needs at least one image")
    if inp.dataset_size < inp.global_batch:
        raise ValueError(f"dataset of {inp.dataset_size} images holds no full batch of "
                         f"{inp.global_batch}")
    if inp.local_steps < 1:
        raise ValueError(f"--local-steps must be >= 1, got {inp.local_steps}")
    if inp.compression_ratio < 1:
        raise ValueError(f"--compression-ratio must be >= 1 (dense bytes / sent bytes), got "
                         f"{inp.compression_ratio}")
    if inp.sync_warmup_steps < 0:
        raise ValueError(f"--sync-warmup-steps must be >= 0, got {inp.sync_warmup_steps}")
    if inp.hierarchical_local and inp.local_steps == 1:
        raise ValueError("hierarchical local SGD needs --local-steps H > 1")
    if inp.allreduce not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {inp.allreduce!r}; choose one of "
                         f"{ALLREDUCE_ALGORITHMS}")


def plan(machine: Machine, work: Workload, inp: PlanInputs) -> Plan:
    """Predict one configuration (the model: docs/planner.md)."""
    _check(machine, inp)
    place = Placement(inp.procs, inp.procs_per_node)
    notes: list[str] = []
    b = inp.global_batch / inp.procs
    if inp.global_batch % inp.procs:
        notes.append(f"global batch {inp.global_batch} is not a multiple of {inp.procs} ranks; "
                     f"costed at the mean {b:.3g} images per rank")
    if place.local_size > machine.cores_per_node:
        notes.append(f"{place.local_size} ranks per node share {machine.cores_per_node:g} cores: "
                     "compute per rank slows proportionally")

    work = with_layer_table(machine, work)
    threads = machine.threads_per_rank(inp.procs_per_node)
    if (machine.calibrated and machine.has_class_rates and not machine.has_thread_scaling
            and threads > 1):
        notes.append(f"{machine.path} has no measured thread scaling: a rank's "
                     f"{threads:g} threads are costed as "
                     "that many cores (linear; recalibrate with `hpcdl plan --calibrate`)")
    if not machine.has_class_rates:
        notes.append(f"{machine.path} has no per-class compute rates: compute costed with one "
                     "sustained fraction (recalibrate with `hpcdl plan --calibrate`)")
    by_class = compute_by_class(machine, work, b, inp.procs_per_node)
    compute = sum(by_class.values())
    optimizer = optimizer_s(machine, work, inp.procs_per_node)
    compression = (COMPRESSION_BYTES_PER_PARAMETER * work.parameters
                   / rank_memory_Bps(machine, inp.procs_per_node)
                   if inp.compression_ratio > 1 else 0.0)

    buckets = gradient_buckets(work, inp.wire_bytes / inp.compression_ratio, inp.bucket_mb)
    grad_bytes = sum(buckets)
    local = inp.local_steps > 1
    # Local SGD: gradients cross no network (hierarchical: one node's allreduce); the model
    # average is costed separately below.
    grad_place = Placement(place.local_size, place.local_size) if local else place
    bucket_times = [allreduce_s(inp.allreduce, machine, grad_place, n) for n in buckets]
    if local and not inp.hierarchical_local:
        bucket_times = []
    comm = sum(bucket_times)
    shared_cores = no_free_core(machine, place)
    overlap = inp.overlap and not shared_cores and inp.compression_ratio == 1
    if inp.overlap and shared_cores and comm > 0:
        notes.append("no free core on the node and shared-memory transport: communication "
                     "is not hidden behind backward")
    comm_exposed = exposed_comm_s(comm, bucket_times[-1] if bucket_times else 0.0, compute,
                                  overlap)
    model_average = 0.0
    if local:
        fp32_model = [allreduce_s(inp.allreduce, machine, place, n)
                      for n in gradient_buckets(work, 4.0, inp.bucket_mb)]
        model_average = sum(fp32_model) / inp.local_steps
        comm += model_average
        comm_exposed += model_average  # after the optimizer step: nothing left to hide behind

    node_images = b * place.local_size
    loader_cores = (inp.loader_cores_per_node if inp.loader_cores_per_node is not None
                    else machine["data.loader_cores_per_node"])
    decode_rate = machine["data.decode_images_per_s_per_core"] * loader_cores
    data = 0.0 if inp.synthetic_data else node_images / decode_rate
    data_exposed = max(0.0, data - (compute + optimizer + comm_exposed))

    iteration = compute + optimizer + compression + comm_exposed + data_exposed
    iterations = inp.dataset_size // inp.global_batch
    epoch = iterations * iteration
    total = inp.epochs * epoch
    warmup_steps = min(inp.sync_warmup_steps, inp.epochs * iterations) if inp.relaxed else 0
    warmup = 0.0
    if warmup_steps:
        synchronous = plan(machine, work, replace(inp, local_steps=1, hierarchical_local=False,
                                                  compression_ratio=1.0, sync_warmup_steps=0))
        warmup = warmup_steps * synchronous.iteration_s
        total += warmup - warmup_steps * iteration
        notes.append(f"the first {warmup_steps:g} iterations are synchronous "
                     f"({synchronous.iteration_s:.3g} s each): {warmup:.3g} s of the total")
    images_per_s = inp.global_batch / iteration
    # Baseline: one rank alone at the machine's usual placement, same per-rank batch, no
    # communication and no data stall; efficiency = delivered / (p × baseline).
    base_rate = b / (compute_s(machine, work, b, machine.ranks_per_node)
                     + optimizer_s(machine, work, machine.ranks_per_node))
    efficiency = images_per_s / (inp.procs * base_rate)
    terms = {"compute": compute, "optimizer": optimizer + compression,
             "communication": comm_exposed,
             "data loading": data_exposed}
    return Plan(
        machine=machine.name, model=work.model, image_size=work.image_size,
        procs=inp.procs, nodes=place.nodes, procs_per_node=inp.procs_per_node,
        global_batch=inp.global_batch, batch_per_rank=b, allreduce=inp.allreduce,
        compute_s=compute, optimizer_s=optimizer, comm_s=comm, comm_hidden_s=comm - comm_exposed,
        comm_exposed_s=comm_exposed, data_s=data, data_exposed_s=data_exposed,
        iteration_s=iteration, iterations_per_epoch=iterations, epoch_s=epoch,
        total_s=total, images_per_s=images_per_s,
        images_per_s_per_rank=images_per_s / inp.procs, scaling_efficiency=efficiency,
        required_images_per_s_per_node=node_images / iteration,
        decode_images_per_s_per_node=decode_rate, gradient_bytes=float(grad_bytes),
        buckets=len(buckets), bucket_bytes=buckets,
        dominant=max(terms, key=terms.__getitem__), notes=notes,
        local_steps=inp.local_steps, compression_ratio=inp.compression_ratio,
        model_average_s=model_average, compute_by_class=by_class, compression_s=compression,
        sync_warmup_steps=int(warmup_steps), warmup_s=warmup, precision=machine.precision)


def default_sweep(procs: int, global_batch: int) -> list[int]:
    """Powers of two up to twice ``procs`` (and ``procs`` itself), each ≤ the global batch."""
    counts = {procs}
    p = 1
    while p <= 2 * procs and p <= global_batch:
        counts.add(p)
        p *= 2
    return sorted(c for c in counts if c <= global_batch)


def sweep(machine: Machine, work: Workload, inp: PlanInputs, procs_list: list[int]) -> list[Plan]:
    """The same run at each process count (global batch fixed: strong scaling of the step)."""
    return [plan(machine, work, replace(inp, procs=p)) for p in procs_list]
