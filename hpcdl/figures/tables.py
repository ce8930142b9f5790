"""One builder per measured table of the docs: read the raw JSON under ``docs/results/``,
return the Markdown table. Each declares its sources (the files it reads, linked from the
block's marker) and how its ratios are computed (printed under the table).

Rounding is the only liberty a builder takes; every number in a table is a field of a raw
file or an arithmetic of fields stated in ``how``.
"""
from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpcdl.figures.growth import NOISE_BYTES
from hpcdl.results import PLAN_BAND, in_band

RESULTS = "docs/results"
SAME_RUN = ("ratios between modes of one run are computed per run, then the median "
            "[min–max] over runs")
SEPARATE_RUNS = "quantities from separate runs are compared as the ratio of their medians"


@dataclass(frozen=True)
class Table:
    sources: tuple[str, ...]
    how: str
    build: Callable[[Path], str]


TABLES: dict[str, Table] = {}


def table(name: str, *sources: str, how: str) -> Callable[[Callable], Callable]:
    """Register the builder of block ``name``: its raw files under ``docs/results/`` (a folder
    ends with ``/``) and how its ratios are computed."""
    def register(build: Callable[[Path], str]) -> Callable[[Path], str]:
        TABLES[name] = Table(tuple(f"{RESULTS}/{s}" for s in sources), how, build)
        return build
    return register


def load(root: Path, name: str) -> Any:
    return json.loads((root / RESULTS / name).read_text())


def md(header: Sequence[str], rows: Sequence[Sequence[Any]], right: int = 1) -> str:
    """A Markdown table; columns from index ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def f(x: float, nd: int = 2) -> str:
    """Fixed decimals, true minus sign (docs' convention)."""
    return f"{x:.{nd}f}".replace("-", "−")


def signed(x: float, nd: int = 2) -> str:
    return ("+" if x > 0 else "") + f(x, nd)


def spread(values: Sequence[float], nd: int = 3) -> str:
    """``median [min–max]``: the docs' form for a ratio repeated over runs."""
    return f"{f(statistics.median(values), nd)} [{_minmax(values, nd)}]"


def _minmax(values: Sequence[float], nd: int = 1) -> str:
    return f"{f(min(values), nd)}–{f(max(values), nd)}"


def _met(met: bool) -> str:
    return "met" if met else "not met"


def load_each(root: Path, pattern: str) -> list[tuple[Path, Any]]:
    """Every raw file matching ``pattern`` under the results directory, in name order, with
    its parsed JSON."""
    return [(p, json.loads(p.read_text())) for p in sorted((root / RESULTS).glob(pattern))]


def load_reports(root: Path, pattern: str) -> list[Any]:
    """The parsed JSON of every raw file matching ``pattern``, in name order."""
    return [report for _, report in load_each(root, pattern)]


# ---- allreduce -------------------------------------------------------------------------

ALLREDUCE_FILES = {2: ("allreduce-p2-2026-12-01.json", "allreduce-sites-np2-quiet-2026-12-01.json"),
                   4: ("allreduce-p4-2026-12-01.json", "allreduce-sites-np4-quiet-2026-12-01.json")}
SIZES = (1_000_000, 16_000_000, 100_000_000)
SITE_NAMES = {"impi": "Intel MPI 2021.13", "ompi": "Open MPI 5", "mpich": "MPICH 5.0.2"}
ALLREDUCE_SOURCES = tuple(name for p in (2, 4) for name in ALLREDUCE_FILES[p])


def _busbw(records: Sequence[Mapping[str, Any]], backend: str, tuning: str | None = None
           ) -> dict[int, float]:
    return {r["bytes"]: r["busbw_GBps"] for r in records
            if r["backend"] == backend and r.get("tuning") == tuning}


def _best_tuning(records: Sequence[Mapping[str, Any]], backend: str) -> str:
    """The site MPI's tuning with the highest busbw at 100 MB (the bench's own pick)."""
    at_100 = [r for r in records if r["backend"] == backend and r["bytes"] == SIZES[-1]]
    return max(at_100, key=lambda r: r["busbw_GBps"])["tuning"]


@table("allreduce-busbw", *ALLREDUCE_SOURCES,
       how="busbw as each JSON records it (nccl-tests definition, median of 7 timed calls, "
           "slowest rank); a site MPI's 'best' is its tuning with the highest busbw at 100 MB in "
           "that run, all three sizes from that tuning.")
def allreduce_busbw(root: Path) -> str:
    rows: dict[str, list[str]] = {}
    labels = {"default": "hpcdl `default` (= `shm`)",
              "shm": "hpcdl `shm` (same backend, measured again)", "ring": "hpcdl `ring`",
              "mpi": "MPICH `MPI_Allreduce` (mpi4py, this env)", "gloo": "gloo"}
    tunings: dict[str, list[str]] = {}
    for p in (2, 4):
        own, sites = (load(root, name)["results"] for name in ALLREDUCE_FILES[p])
        for backend, label in labels.items():
            bw = _busbw(own, backend)
            rows.setdefault(label, []).extend(f(bw[s]) for s in SIZES)
        for site in SITE_NAMES:
            best = _best_tuning(sites, site)
            tunings.setdefault(site, []).append(best.split()[-1].split("=")[-1])
            bw = _busbw(sites, site, best)
            rows.setdefault(site, []).extend(f(bw[s]) for s in SIZES)
    for site, name in SITE_NAMES.items():
        rows[f"{name}, best (P=2 / P=4: `{'` / `'.join(tunings[site])}`)"] = rows.pop(site)
    header = ["backend", "P=2: 1 MB", "16 MB", "100 MB", "P=4: 1 MB", "16 MB", "100 MB"]
    return md(header, [[label, *cells] for label, cells in rows.items()])


ALLREDUCE_GOALS = {"default_vs_mpi_busbw_100MB": 3.0, "default_vs_gloo_busbw_100MB": 5.0,
                   "ring_vs_mpi_busbw_16MB": 0.9}
SITE_RATIOS = ("default_vs_impi_busbw_100MB", "default_vs_ompi_busbw_100MB",
               "default_vs_mpich_busbw_100MB")
RATIO_ROWS = (*((name, f"≥ {goal:g}") for name, goal in ALLREDUCE_GOALS.items()),
              *((name, "—") for name in SITE_RATIOS),
              ("default_vs_memcpy_100MB", "share of one core's `copy_` rate kept"))


def allreduce_ratio_values(root: Path) -> dict[str, dict[int, tuple[float | None, float]]]:
    """Each bench ratio at P = 2 and 4: (backends run's value or None, site run's value)."""
    ratios = {p: [load(root, name)["ratios"] for name in ALLREDUCE_FILES[p]] for p in (2, 4)}
    return {name: {p: (own.get(name), site[name]) for p, (own, site) in ratios.items()}
            for name, _ in RATIO_ROWS}


@table("allreduce-ratios", *ALLREDUCE_SOURCES,
       how="each ratio is the bench's own, hpcdl's busbw over the baseline's in the same run; "
           "the site run's value in brackets.")
def allreduce_ratios(root: Path) -> str:
    values = allreduce_ratio_values(root)
    rows = []
    for name, goal in RATIO_ROWS:
        cells = [f(site) if own is None else f"{f(own)} ({f(site)})"
                 for own, site in (values[name][p] for p in (2, 4))]
        rows.append([f"`{name}`", *cells, goal])
    return md(["ratio", "P = 2: backends run (site run)", "P = 4: backends run (site run)",
               "goal"], rows, right=1)


CCL_FILE = "allreduce-ccl-2026-12-01.json"
CCL_RATIOS = ("ccl_vs_mpi_busbw_100MB", "ccl_best_vs_mpi_busbw_100MB",
              "ccl_vs_default_busbw_100MB", "ccl_best_vs_default_busbw_100MB")


def _gbps(x: float) -> str:
    """Two decimals, three below 0.1 GB/s (where two would hide the order of magnitude)."""
    return f(x) if x >= 0.1 else f(x, 3)


@table("allreduce-ccl", CCL_FILE,
       how="busbw as the JSON records it (one run, p = 2); a `ccl` row is named by the settings "
           "that differ from the first `ccl` tuning; ratios are the bench's own.")
def allreduce_ccl(root: Path) -> str:
    report = load(root, CCL_FILE)
    records = report["results"]
    base = next(r["tuning"] for r in records if r["backend"] == "ccl").split()
    labels = {"default": "`default` (= `shm`)", "mpi": "MPICH `MPI_Allreduce`"}
    cells: dict[str, dict[int, list[str]]] = {label: {} for label in labels.values()}
    for r in records:
        if r["backend"] in labels:
            label = labels[r["backend"]]
        elif r["backend"] in ("ccl", "ccl-tuned"):
            changed = [t for t in r["tuning"].split() if t not in base]
            label = ("`ccl`, " + ", ".join(f"`{t}`" for t in changed) if changed else
                     "`ccl`, oneCCL defaults + hpcdl's one-host `CCL_ATL_SHM=1` (run twice)")
        else:
            continue
        cells.setdefault(label, {}).setdefault(r["bytes"], []).append(_gbps(r["busbw_GBps"]))
    rows = [[label, *(" / ".join(by[size]) for size in SIZES)] for label, by in cells.items()]
    ratios = ", ".join(f"`{k}` {f(report['ratios'][k])}" for k in CCL_RATIOS)
    return f"{md(['row', '1 MB', '16 MB', '100 MB'], rows)}\n\n{ratios}"


# ---- training step ---------------------------------------------------------------------

STEP_DIR = "shard-update-quiet-2026-12-01"
#: (file prefix, label, DDP goal: default ÷ ddp_gloo, ceiling goal: default ÷ no_comm)
STEP_MODELS = (("alexnet_bn-224-b32-np2", "AlexNet-BN 224 px, 32", 1.10, 0.95),
               ("resnet50-112-b16-np2", "ResNet-50 112 px, 16", 1.05, 0.97))


@dataclass(frozen=True)
class StepFigures:
    label: str
    runs: int
    median_rate: dict[str, float]  # images/s per rank, median over runs
    ratios: dict[str, list[float]]  # per run: "a/b" -> a's rate ÷ b's
    ddp_goal: float
    ceiling_goal: float
    flops_fraction: list[float]  # per run: the step's training FLOP rate ÷ a 2048² matmul's


STEP_RATIOS = (("ours_allreduce", "no_comm"), ("ours_allreduce", "ddp_gloo"),
               ("ddp_gloo", "no_comm"), ("ours", "ours_allreduce"))


def step_figures(root: Path) -> list[StepFigures]:
    out = []
    for prefix, label, ddp_goal, ceiling_goal in STEP_MODELS:
        reports = load_reports(root, f"{STEP_DIR}/{prefix}-run*.json")
        # images/s per rank of each mode, one dict per run
        runs = [{r["mode"]: r["images_per_s_per_rank"] for r in report["results"]}
                for report in reports]
        out.append(StepFigures(
            label, len(runs), {m: statistics.median(r[m] for r in runs) for m in runs[0]},
            {f"{a}/{b}": [r[a] / r[b] for r in runs] for a, b in STEP_RATIOS},
            ddp_goal, ceiling_goal, [r["ratios"]["flops_fraction_of_matmul"] for r in reports]))
    return out


def ddp_need(s: StepFigures) -> float:
    """The share of the ceiling the default step needs to be ``ddp_goal`` × DDP's rate."""
    return s.ddp_goal * statistics.median(s.ratios["ddp_gloo/no_comm"])


@table("training-step", f"{STEP_DIR}/",
       how=f"img/s per rank: median over runs; {SAME_RUN}; the DDP goal's need is goal × the "
           "median of ddp_gloo ÷ no_comm.")
def training_step(root: Path) -> str:
    rows = [[f"{s.label} ({s.runs} runs)",
             *(f(s.median_rate[mode]) for mode in ("ours_allreduce", "no_comm", "ddp_gloo")),
             *(spread(s.ratios[f"{a}/{b}"]) for a, b in STEP_RATIOS[:3]),
             f"{s.ddp_goal:.2f}× → {f(ddp_need(s), 3)}",
             spread(s.ratios["ours/ours_allreduce"]), _minmax(s.flops_fraction, 2)]
            for s in step_figures(root)]
    header = ["model, per-rank batch, 2 ranks", "default step img/s", "no_comm", "ddp_gloo",
              "default ÷ no_comm", "default ÷ ddp_gloo", "ddp_gloo ÷ no_comm",
              "DDP goal needs (÷ ceiling)", "sharded ÷ default",
              "FLOP rate ÷ 2048² matmul, min–max"]
    return md(header, rows)


BUCKET_DIR = "bucket-size-alexnet-2026-12-01"


@table("bucket-size", f"{BUCKET_DIR}/",
       how="÷ no_comm is each run's own ratio (both modes in one run); runs listed, not "
           "summarised (two per size).")
def bucket_size(root: Path) -> str:
    rows = []
    for mb in (6, 25, 160):
        ratios = [r["ratios"] for r in load_reports(root, f"{BUCKET_DIR}/b{mb}-*.json")]
        rows.append([f"{mb} MB", " / ".join(f(r["images_per_s_per_rank"]) for r in ratios),
                     " / ".join(f(r["vs_no_comm"], 3) for r in ratios)])
    return md(["bucket", "img/s per rank, run 1 / 2", "÷ no_comm, run 1 / 2"], rows)


ACROSS_DIR = "step-across-hosts-gloo-bf16-wire-2026-12-07"
ACROSS_RATES = ("2Gbit", "250Mbit")   # tc's spelling, as each JSON records it
ACROSS_MODES = (("no_comm", "`no_comm` (ceiling)"), ("ours", "`ours` (fp32, {backend})"),
                ("ours@gloo", "`ours@gloo` (fp32)"), ("ddp_gloo", "`ddp_gloo` (fp32)"),
                ("ours_bf16", "`ours_bf16` (bf16 on the wire, {backend})"),
                ("ddp_gloo_fp16", "`ddp_gloo_fp16` (DDP's `fp16_compress_hook`)"))
#: Each of hpcdl's modes against DDP with as many bits on the wire (DDP on CPU has no bf16 hook).
SAME_WIRE_DDP = {"ours": "ddp_gloo", "ours@gloo": "ddp_gloo", "ours_bf16": "ddp_gloo_fp16"}
ACROSS_GOAL = 1.0  # ours ÷ DDP+gloo with as many bits on the wire


def _link_rate(report: Mapping[str, Any]) -> str:
    shaping = next(iter(report["machine"].get("link_shaping", {}).values()), "") or ""
    return shaping.split(" rate ")[1].split()[0] if " rate " in shaping else "unshaped"


def across_runs(root: Path, rate: str) -> list[Mapping[str, Any]]:
    """The runs at ``rate`` (by each JSON's recorded tbf rate), in file order."""
    return [r for r in load_reports(root, f"{ACROSS_DIR}/step-*.json") if _link_rate(r) == rate]


def _rate_over(by_mode: Mapping[str, Mapping[str, Any]], mode: str, other: str) -> float:
    return by_mode[mode]["images_per_s_per_rank"] / by_mode[other]["images_per_s_per_rank"]


def across_figures(root: Path, rate: str) -> dict[str, dict[str, list[Any]]]:
    """Per mode, one value per run at ``rate``: its backend, step s, ÷ ddp_gloo, ÷ DDP with as
    many bits on the wire, ÷ no_comm (images/s ratios), eth0 MB per step, wait after backward
    s, CPU s per step and CPU s added over no_comm."""
    out: dict[str, dict[str, list[Any]]] = {m: {} for m, _ in ACROSS_MODES}
    for report in across_runs(root, rate):
        by_mode = {r["mode"]: r for r in report["results"]}
        ceiling = by_mode["no_comm"]
        rate_over = functools.partial(_rate_over, by_mode)
        for mode, _ in ACROSS_MODES:
            r = by_mode[mode]
            for key, value in (
                    ("backend", r["backend"]), ("step", r["step_time_s"]),
                    ("vs_ddp", rate_over(mode, "ddp_gloo")),
                    ("vs_same_wire", rate_over(mode, SAME_WIRE_DDP.get(mode, mode))),
                    ("vs_ceiling", rate_over(mode, "no_comm")),
                    ("mb", r["nic_tx_MB_per_step"]), ("wait", r["comm_wait_s"]),
                    ("cpu", r["cpu_s_per_step"]),
                    ("cpu_added", r["cpu_s_per_step"] - ceiling["cpu_s_per_step"])):
                out[mode].setdefault(key, []).append(value)
    return out


def _across_row(rate: str, mode: str, label: str, v: Mapping[str, list[Any]]) -> list[str]:
    mb = statistics.median(v["mb"])
    return [rate.lower(), label.format(backend="/".join(sorted(set(v["backend"])))),
            _minmax(v["step"]),
            "1" if mode == "ddp_gloo" else spread(v["vs_ddp"]),
            f"**{spread(v['vs_same_wire'])}**" if mode in SAME_WIRE_DDP else "",
            "1" if mode == "no_comm" else spread(v["vs_ceiling"]),
            f(mb, 1) if mb >= 1 else f(mb, 4),
            "—" if None in v["wait"] else "0" if max(v["wait"]) == 0 else _minmax(v["wait"]),
            f"0 ({_minmax(v['cpu'], 2)} s of CPU)" if mode == "no_comm"
            else spread(v["cpu_added"], 2)]


@table("step-across-hosts", f"{ACROSS_DIR}/",
       how="each link rate's runs (by the tbf rate each JSON records); step s is each run's "
           f"mean step, min–max over runs; {SAME_RUN} (÷ DDP are images/s ratios, against DDP "
           "in fp32 and against DDP with as many bits on the wire: fp32, or its fp16 hook for "
           "bf16; CPU added is the mode's CPU s per step minus no_comm's); eth0 MB is the "
           "median over runs.")
def step_across_hosts(root: Path) -> str:
    rows = []
    for rate in ACROSS_RATES:
        figures = across_figures(root, rate)
        rows += [_across_row(rate, mode, label, figures[mode]) for mode, label in ACROSS_MODES]
        runs = across_runs(root, rate)
        absent = sorted({m for r in runs for m in r.get("absent_modes", {})})
        rows += [[rate.lower(), m, f"absent in {sum(m in r.get('absent_modes', {}) for r in runs)}"
                  f" of {len(runs)} runs (each JSON's `absent_modes`)", "", "", "", "", "", ""]
                 for m in absent]
    header = ["link", "mode", "step s, min–max", "÷ DDP fp32",
              f"÷ DDP, same wire width (goal ≥ {ACROSS_GOAL:g})", "÷ ceiling",
              "eth0 MB sent per step (median)", "waits after backward s", "CPU s added per step"]
    return md(header, rows)


# ---- loader, optimizer, bf16 -----------------------------------------------------------

LOADER_FILE = "loader-fair-baselines-2026-12-01.json"
LOADER_GOAL = 1.5  # hdf5 ÷ each fair baseline (the same pre-resized JPEG bytes)
LOADER_SIDES = (("imagefolder_pillow", "torchvision ImageFolder way, full 500×375 JPEGs"),
                ("imagefolder_pillow_resized", "the same pre-resized JPEGs as files"),
                ("webdataset_pil_resized", "the same JPEGs in WebDataset tar shards"),
                ("hdf5_sharded", "hpcdl: `ShardedImageNet` + `normalize`"),
                ("simplejpeg_decode_only", "decoding alone: the floor"))


@table("loader", LOADER_FILE,
       how="images per CPU-second of the process; ratios are the bench's own, within the one "
           "run.")
def loader(root: Path) -> str:
    report = load(root, LOADER_FILE)
    rate = {r["name"]: r["images_per_s_per_core"] for r in report["results"]}
    rows = [[f"`{name}` ({what})", f"{rate[name]:,.0f}"] for name, what in LOADER_SIDES]
    table = md(["side", "img/s per core"], rows)
    ratios = ", ".join(f"`{k}` {f(v)}" for k, v in report["ratios"].items())
    return f"{table}\n\n{ratios}"


PACE_FILE = "loader-pace-bf16-2026-12-02.json"
PACE_THREADS = (1, 2)  # decode threads per rank whose reach the table gives


def pace_cores_covered(threads: int, step_per_core: float, decode_per_thread: float) -> int:
    """Cores of the largest rank that ``threads`` decode threads keep fed when each takes a
    core from compute: the largest C with (C − threads) × step ≤ threads × decode."""
    return math.floor(threads * (step_per_core + decode_per_thread) / step_per_core)


def _pace_sizing(report: Mapping[str, Any]) -> str:
    decode = report["ratios"]["decode_images_per_cpu_s_per_worker"]
    rows = []
    for step in report["step_rates"]:
        s, model = step["images_per_s_per_core"], step["model"]
        need = report["ratios"][f"{model}_decode_threads_per_compute_core"]
        rows.append([f"{model}, {step['image_size']} px, batch {step['batch']} "
                     f"([step file](results/{Path(step['source']).relative_to(RESULTS)}))",
                     f(s, 1), f"{decode:,.0f}", f"**{f(need, 3)}**", f"{1 / need:.0f}",
                     *(str(pace_cores_covered(w, s, decode)) for w in PACE_THREADS)])
    return md(["bf16 step (`variants.hpcdl_cl`)", "step img/s per core",
               "decode img/s per thread", "decode threads per compute core",
               "compute cores one decode thread feeds",
               *(f"largest rank (cores) {w} decode thread{'s' * (w > 1)} "
                 f"feed{'s' * (w == 1)}" for w in PACE_THREADS)], rows)


def _pace_waits(report: Mapping[str, Any]) -> str:
    runs: dict[tuple[str, str, int], list[Mapping[str, Any]]] = {}
    for r in report["results"]:
        if r["kind"] == "paced":
            runs.setdefault((r["model"], r["layout"], r["workers"]), []).append(r)
    rows = [[model, layout, str(workers),
             spread([100 * r["data_wait_fraction"] for r in rs], 1),
             spread([r["cpu_vs_step"] for r in rs], 3),
             spread([r["delivered_vs_step"] for r in rs], 2)]
            for (model, layout, workers), rs in runs.items()]
    return md(["model", "layout", "decode threads per rank", "data wait, % of wall",
               "img per core-second (compute + decode) ÷ step", "delivered img/s ÷ step (wall)"],
              rows, right=2)


@table("loader-pace", PACE_FILE,
       how="decode img/s per thread: the median over repeats of images per CPU-second with one "
           "worker thread; step img/s per core: the step file's batch ÷ its median CPU s per "
           "step; decode threads per compute core = step ÷ decode; the largest rank w threads "
           "feed = floor(w × (step + decode) ÷ step) cores, each thread taking one; each "
           "paced cell is the median [min–max] over repeats of that run's ratio.")
def loader_pace(root: Path) -> str:
    report = load(root, PACE_FILE)
    load_avg = report["load_average"]
    return (f"{_pace_sizing(report)}\n\n{_pace_waits(report)}\n\n"
            f"Machine: {report['machine']['cpu']}, torch capability "
            f"`{report['machine']['cpu_capability']}`, {report['machine']['cores']} cores; load "
            f"average {f(load_avg['start'][0], 1)} at the start, {f(load_avg['end'][0], 1)} at "
            f"the end. Note: {report['note']}.")


OPTIM_FILE = "optim-lars-resnet50-2026-12-02.json"
OPTIM_GOAL = 1.5  # LARS's step ÷ SGD's


@table("optim-step", OPTIM_FILE,
       how="median step of each optimizer in one run; the ratio is the bench's own (LARS ÷ SGD).")
def optim_step(root: Path) -> str:
    report = load(root, OPTIM_FILE)
    ms = {r["optimizer"]: r for r in report["results"]}
    ratio = report["ratios"]["lars_vs_sgd_step_time"]
    return md(["SGD foreach, median [min–max]", "LARS", "`lars_vs_sgd_step_time`", "goal"],
              [[*(f"{f(ms[o]['median_ms'], 1)} [{_minmax([ms[o]['min_ms'], ms[o]['max_ms']])}] ms"
                  for o in ("sgd_foreach", "lars")), f"**{f(ratio)}**",
                f"≤ {OPTIM_GOAL:g}: " + _met(ratio <= OPTIM_GOAL)]], right=0)


#: The current runs (quiet, AVX512-BF16): performance.md's table and the summary's figures
BF16_SPEED_DIR = "step-fp32-bf16-vs-torch-quiet-avx512bf16-2026-12-02"
#: Each block's runs: the current, and the loaded AMX runs kept in the bf16 notebook
BF16_SPEED_TABLES = {"bf16-speed": BF16_SPEED_DIR,
                     "bf16-speed-amx-loaded": "step-fp32-bf16-vs-torch-2026-12-02"}
#: (file prefix, label) of each model the fp32/bf16 runs measured
BF16_SPEED_MODELS = (("resnet50-112px-b32", "ResNet-50, 112 px"),
                     ("alexnet_bn-224px-b32", "AlexNet-BN, 224 px"))


def _dtype_runs(root: Path, prefix: str, directory: str = BF16_SPEED_DIR
                ) -> dict[tuple[str, str], list[Mapping[str, Any]]]:
    """The runs of one model, by (precision, layout): ``{prefix}-*.json`` (the layout
    ``auto`` picks) and ``layout-{prefix}-*.json`` (the other one)."""
    runs: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for pattern in (f"{prefix}-*.json", f"layout-{prefix}-*.json"):
        for report in load_reports(root, f"{directory}/{pattern}"):
            ours = _record_of(report, "no_comm")
            runs.setdefault((ours["precision"], ours["memory_format"]), []).append(report)
    return runs


def _record_of(report: Mapping[str, Any], mode: str) -> Mapping[str, Any]:
    return next(r for r in report["results"] if r["mode"] == mode)


def _auto_layout(report: Mapping[str, Any]) -> str:
    """The layout ``train.channels_last: auto`` gives this run's dtype and threads."""
    from hpcdl.cpus import memory_format_name

    ours = _record_of(report, "no_comm")
    return memory_format_name("auto", ours["threads"], ours["precision"])


def _auto_runs(root: Path, prefix: str, precision: str,
               directory: str = BF16_SPEED_DIR) -> list[Mapping[str, Any]]:
    return next(reports for (p, layout), reports
                in _dtype_runs(root, prefix, directory).items()
                if p == precision and layout == _auto_layout(reports[0]))


def _median_of(reports: Sequence[Mapping[str, Any]], mode: str, key: str) -> float:
    return statistics.median(_record_of(r, mode)[key] for r in reports)


def bf16_speedup(root: Path, prefix: str, directory: str = BF16_SPEED_DIR) -> float:
    """hpcdl's bf16 step over its fp32 step per CPU second (the median of fp32's CPU s per
    step over bf16's), each in the layout ``auto`` picks: separate runs, and CPU seconds,
    as load differs between runs."""
    return (_median_of(_auto_runs(root, prefix, "float32", directory), "no_comm", "cpu_s_per_step")
            / _median_of(_auto_runs(root, prefix, "bfloat16", directory), "no_comm",
                         "cpu_s_per_step"))


def bf16_vs_torch(root: Path, prefix: str) -> tuple[list[float], float]:
    """(hpcdl's bf16 step over plain torch's, each run's own; the median of hpcdl's FLOP
    fraction of the bf16 matmul peak per CPU second), in the layout ``auto`` picks."""
    runs = _auto_runs(root, prefix, "bfloat16")
    return ([_record_of(r, "no_comm")["vs_torch"] for r in runs],
            _median_of(runs, "no_comm", "cpu_flops_fraction_of_matmul"))


def _dtype_row(label: str, reports: Sequence[Mapping[str, Any]]) -> list[str]:
    first = _record_of(reports[0], "no_comm")
    layout = first["memory_format"]

    def both(key: str) -> str:
        return f"{f(_median_of(reports, 'no_comm', key))} / {f(_median_of(reports, 'torch', key))}"

    conv = statistics.median(r["compute_breakdown"]["convolution_share"] for r in reports)
    peak = statistics.median(r["ratios"]["matmul_gflops_per_cpu_s_per_rank"] for r in reports)
    loads = [r["machine"]["load_average"][when][0] for r in reports for when in ("before", "after")]
    return [label, "bf16" if first["precision"] == "bfloat16" else "fp32",
            f"{layout} (auto)" if layout == _auto_layout(reports[0]) else layout,
            *(f(_median_of(reports, m, "images_per_s_per_rank"), 1) for m in ("no_comm", "torch")),
            f"**{spread([_record_of(r, 'no_comm')['vs_torch'] for r in reports], 2)}**",
            both("cpu_flops_fraction_of_matmul"), both("flops_fraction_of_matmul"),
            f"{f(100 * conv, 0)}%", f(peak, 0), _minmax(loads)]


BF16_SPEED_HOW = (
    "each cell is the median over a row's runs; hpcdl ÷ torch is each run's own "
    "(`vs_torch`), median [min–max]; a FLOP fraction is training FLOPs (6 × forward "
    "multiply-adds per image) over an n×n matmul's of the step's dtype on the same "
    "threads, per CPU second of the process (`cpu_flops_fraction_of_matmul`: less moved "
    "by time-slicing on shared cores, though not by cache sharing) and per wall second "
    "(`flops_fraction_of_matmul`); conv. share is `compute_breakdown.convolution_share` "
    f"(hpcdl's profiled step); bf16 ÷ fp32: {SEPARATE_RUNS} (hpcdl's CPU s per step, "
    "the layout auto picks).")


def bf16_speed_of(root: Path, directory: str) -> str:
    """One CPU's table: each model's fp32 and bf16 rows beside plain torch's, its machine
    line above."""
    rows, counts, machine = [], set(), None
    for prefix, label in BF16_SPEED_MODELS:
        runs = _dtype_runs(root, prefix, directory)
        for key in sorted(runs, key=lambda k: (k[0] != "float32",
                                               k[1] != _auto_layout(runs[k][0]))):
            rows.append(_dtype_row(label, runs[key]))
            counts.add(len(runs[key]))
            machine = runs[key][0]["machine"]
    speedups = " / ".join(f"**{f(bf16_speedup(root, prefix, directory))}×**"
                          for prefix, _ in BF16_SPEED_MODELS)
    cpu = (f"Machine: `lscpu` \"{machine['cpu']}\", {machine['cores']} cores, torch capability "
           f"`{machine['cpu_capability']}`, native bf16 {machine['bf16_native']}; 1 rank × "
           f"{machine['threads_per_rank']} threads; runs per row: "
           f"{'–'.join(map(str, sorted(counts)))}. hpcdl = `no_comm` (the Trainer's step), "
           "torch = plain torch's, in turns. hpcdl's bf16 ÷ fp32 per CPU s, in the layout auto "
           f"picks: {speedups} ({' / '.join(label for _, label in BF16_SPEED_MODELS)}).")
    table_ = md(["model", "dtype", "layout", "hpcdl img/s", "torch img/s", "hpcdl ÷ torch",
                 "FLOP fraction per CPU s, hpcdl / torch", "per wall s", "conv. share",
                 "matmul GFLOP per CPU s", "load (1 min)"], rows, right=3)
    return f"{cpu}\n\n{table_}"


for _name, _directory in BF16_SPEED_TABLES.items():
    table(_name, f"{_directory}/", how=BF16_SPEED_HOW)(
        functools.partial(bf16_speed_of, directory=_directory))


#: The accuracy cells, each with how its CPU computed bf16 (emulated: rounded fp32 kernels).
BF16_ACC_DIRS = {"bf16-convergence-2026-12-01": "emulated",
                 "bf16-convergence-native-2026-12-02": "native"}


def _bf16_seeds(root: Path, directory: str) -> dict[str, tuple[float, float]]:
    """Per seed: (fp32 top-1 %, bf16 top-1 %)."""
    out = {}
    for path, report in load_each(root, f"{directory}/seed*.json"):
        top1 = {r["run"]: r["top1"] * 100 for r in report["results"]}
        out[path.stem.removeprefix("seed")] = (top1["lars"], top1["lars_bf16"])
    return out


def bf16_accuracy_diff(root: Path, directory: str) -> float:
    """Mean over seeds of bf16's top-1 minus the mean of fp32's, in points."""
    seeds = _bf16_seeds(root, directory).values()
    return statistics.mean(b for _, b in seeds) - statistics.mean(a for a, _ in seeds)


BF16_GOAL = -0.3


def _bf16_cpu(root: Path, directory: str) -> str:
    machine = next(r for _, r in load_each(root, f"{directory}/seed*.json"))["machine"]
    return f"{BF16_ACC_DIRS[directory]}: \"{machine['cpu']}\", `{machine['cpu_capability']}`"


@table("bf16-accuracy", *(f"{d}/" for d in BF16_ACC_DIRS),
       how="top-1 of each seed's two runs; with several seeds, the mean row is the mean over "
           "that CPU's seeds of each, then their difference (the goal's reading).")
def bf16_accuracy(root: Path) -> str:
    rows = []
    for directory in BF16_ACC_DIRS:
        seeds, cpu = _bf16_seeds(root, directory), _bf16_cpu(root, directory)
        diff = bf16_accuracy_diff(root, directory)
        verdict = f"**{signed(diff)}** (goal ≥ {f(BF16_GOAL, 1)}: {_met(diff >= BF16_GOAL)})"
        rows += [[cpu, seed, f(a), f(b), verdict if len(seeds) == 1 else signed(b - a)]
                 for seed, (a, b) in seeds.items()]
        if len(seeds) > 1:
            rows.append([cpu, "mean", f(statistics.mean(a for a, _ in seeds.values())),
                         f(statistics.mean(b for _, b in seeds.values())), verdict])
    return md(["bf16 (CPU)", "seed", "fp32 top-1", "bf16 top-1", "bf16 − fp32"], rows, right=1)


# ---- convergence -----------------------------------------------------------------------

SAME_DECAY = "convergence-study-same-decay-2026-12-01.json"
OTHER_DECAY = "convergence-study-extended.json"


def _by_batch(report: Mapping[str, Any], optimizer: str) -> dict[int, Mapping[str, Any]]:
    return {r["global_batch"]: r for r in report["results"] if r["optimizer"] == optimizer}


def _final(r: Mapping[str, Any]) -> str:
    mean, sd, lo, hi = (f(r[k] * 100) for k in ("top1_mean", "top1_std", "top1_min", "top1_max"))
    edge = ", edge" if r.get("at_edge") else ""
    tuned = f"; {r['tuned_lrs']}" if "tuned_lrs" in r else ""
    return f"{mean} ± {sd} [{lo}–{hi}] ({r['lr']:.3g}{edge}{tuned})"


@dataclass(frozen=True)
class ConvergenceRow:
    batch: int
    lars: Mapping[str, Any]
    sgd: Mapping[str, Any]  # same decay policy as LARS
    other: Mapping[str, Any]  # SGD decaying BN and biases too

    @property
    def lead(self) -> float:
        """LARS's test mean minus same-policy SGD's, in points."""
        return (self.lars["top1_mean"] - self.sgd["top1_mean"]) * 100

    @property
    def lead_over_better(self) -> float:
        """LARS's test mean minus the better of the two SGD policies' means, in points."""
        best = max(self.sgd["top1_mean"], self.other["top1_mean"])
        return (self.lars["top1_mean"] - best) * 100


def convergence_rows(root: Path) -> list[ConvergenceRow]:
    same = load(root, SAME_DECAY)
    lars, sgd = _by_batch(same, "lars"), _by_batch(same, "sgd")
    other = _by_batch(load(root, OTHER_DECAY), "sgd")
    return [ConvergenceRow(b, lars[b], sgd[b], other[b]) for b in sorted(lars)]


@table("convergence", SAME_DECAY, OTHER_DECAY,
       how="test top-1 mean ± sd [min–max] over 3 seeds (chosen lr; lrs tuned); differences of "
           "means; 'better final' is the higher of the two SGD policies' test means; holdout is "
           "the tuning score of the chosen lr (one run on the holdout split).")
def convergence(root: Path) -> str:
    rows = [[f"{r.batch:,}", _final(r.lars), _final(r.sgd), f"**{signed(r.lead)}**",
             f"{f(r.other['top1_mean'] * 100)} ({r.other['lr']:.3g})",
             f"{f(r.sgd['holdout_top1'] * 100)} / {f(r.other['holdout_top1'] * 100)}",
             signed(r.lead_over_better)] for r in convergence_rows(root)]
    header = ["batch", "LARS", "SGD, same decay policy", "LARS − SGD",
              "SGD decaying BN and biases too", "SGD holdout: same / other policy",
              "LARS − SGD's better final"]
    return md(header, rows)


# ---- relaxed consistency ---------------------------------------------------------------

#: the raw files of each set of runs (r = 4's seeds were run in two goes)
RELAXED_FILES = {"seeds": ("relaxed-seeds-2026-12-01.json",),
                 "hier": ("relaxed-hierarchical-seeds-2026-12-01.json",),
                 "r4": ("relaxed-r4-seeds01-2026-12-01.json", "relaxed-r4-seed2-2026-12-01.json")}
RELAXED_ROWS = (("sync", "seeds", "`sync` (hpcdl)"),
                ("hierarchical", "hier", "`hierarchical` H = 8, 2 × 2"),
                ("powersgd", "seeds", "`powersgd` r = 2 (hpcdl)"),
                ("ddp_powersgd", "seeds", "`ddp_powersgd` r = 2 (PyTorch)"),
                ("powersgd", "r4", "`powersgd` r = 4 (hpcdl)"),
                ("ddp_powersgd", "r4", "`ddp_powersgd` r = 4 (PyTorch)"),
                ("ddp_sync", "seeds", "`ddp_sync` (PyTorch's own loop)"))


def _relaxed_seeds(root: Path, key: str, run: str) -> list[Mapping[str, Any]]:
    """The per-seed records of ``run`` in the files of ``key``, by seed (not the mean row)."""
    return sorted((r for name in RELAXED_FILES[key] for r in load(root, name)["results"]
                   if r["run"] == run and r["seed"] != "mean"), key=lambda r: r["seed"])


@dataclass(frozen=True)
class RelaxedRow:
    label: str
    run: str
    top1: list[float]  # % per seed 0, 1, 2
    delta: float  # mean top-1 minus sync's mean, points
    world_bytes: int  # per rank at the call site, across nodes
    node_bytes: int  # per rank at the call site, inside a node


def relaxed_rows(root: Path) -> list[RelaxedRow]:
    sync_top1 = [r["top1"] * 100 for r in _relaxed_seeds(root, "seeds", "sync")]
    rows = []
    for run, key, label in RELAXED_ROWS:
        seeds = _relaxed_seeds(root, key, run)
        top1 = [r["top1"] * 100 for r in seeds]
        rows.append(RelaxedRow(label, run, top1,
                               statistics.mean(top1) - statistics.mean(sync_top1),
                               seeds[0]["bytes_per_rank"], seeds[0]["bytes_node_per_rank"]))
    return rows


@table("relaxed-call-site", *(name for names in RELAXED_FILES.values() for name in names),
       how="top-1 mean and sample sd over seeds, Δ against sync's mean; bytes each rank passed "
           "to allreduce at the call site, sync's over this run's.")
def relaxed_call_site(root: Path) -> str:
    found = relaxed_rows(root)
    sync_bytes = next(r.world_bytes for r in found if r.run == "sync")
    rows = []
    for r in found:
        world, node = r.world_bytes, r.node_bytes
        rows.append([r.label, ", ".join(f(t) for t in r.top1),
                     f"{f(statistics.mean(r.top1))} ± {f(statistics.stdev(r.top1))}",
                     "—" if r.run == "sync" else signed(r.delta),
                     f"{world / 1e6:.1f}" + (f" + {node / 1e6:.1f}" if node else ""),
                     f"{f(sync_bytes / world)}×" + (
                         f" ({f(sync_bytes / (world + node))}× counting both)" if node else "")])
    header = ["run", "top-1 seeds 0, 1, 2 (%)", "mean ± sd", "Δ vs `sync` (points)",
              "MB per rank at the call site: across nodes (+ inside a node)",
              f"sync's {sync_bytes / 1e6:.1f} MB ÷ this"]
    return md(header, rows, right=3)


NETWORK_DIR = "relaxed-network-bytes-2026-12-01"
NETWORK_RUNS = ("sync", "hierarchical", "ddp_sync")


@dataclass(frozen=True)
class NetworkRow:
    run: str
    tx: tuple[int, int]  # bytes h1's and h2's eth0 sent over the run
    top1: float  # %, seed 0
    vs: dict[str, tuple[float, float, float]]  # "sync"/"ddp_sync" -> (h1, h2, total) ratios


def relaxed_network_rows(root: Path) -> list[NetworkRow]:
    lines = (root / RESULTS / NETWORK_DIR / "eth0-bytes.jsonl").read_text().splitlines()
    tx = {row["run"]: (row["h1"]["tx"], row["h2"]["tx"]) for row in map(json.loads, lines)}
    rows = []
    for run in NETWORK_RUNS:
        top1 = load(root, f"{NETWORK_DIR}/relaxed-{run}.json")["results"][0]["top1"] * 100
        h1, h2 = tx[run]
        vs = {ref: (tx[ref][0] / h1, tx[ref][1] / h2, sum(tx[ref]) / (h1 + h2))
              for ref in ("sync", "ddp_sync")}
        rows.append(NetworkRow(run, (h1, h2), top1, vs))
    return rows


@table("relaxed-network", f"{NETWORK_DIR}/",
       how="bytes each host's eth0 sent over the run; per host = each host's sync (or ddp_sync) "
           "bytes over its own bytes in this run; in total = both hosts summed on each side.")
def relaxed_network(root: Path) -> str:
    rows = [[f"`{r.run}`", f"{r.tx[0] / 1e6:.1f} / {r.tx[1] / 1e6:.1f}",
             *(cell for h1, h2, total in (r.vs["sync"], r.vs["ddp_sync"])
               for cell in (f"{f(h1)} / {f(h2)}", f(total))), f(r.top1)]
            for r in relaxed_network_rows(root)]
    header = ["run (2 hosts × 2 ranks)", "MB out of h1 / h2", "sync ÷ this, per host h1 / h2",
              "in total", "ddp_sync ÷ this, per host", "in total", "top-1 (seed 0)"]
    return md(header, rows)


# ---- planner, demo ---------------------------------------------------------------------

WINDOWS = ("plan-gemm-rows-2026-12-01/window2/plan-validate-quiet-2026-12-01.json",
           "plan-gemm-rows-2026-12-01/window1/plan-validate-quiet-2026-12-01.json")
HELD_OUT = "plan-held-out-2026-12-01/plan-validate-2026-12-01.json"
MODEL_NAMES = {"alexnet_bn": "AlexNet-BN", "resnet50": "ResNet-50",
               "alexnet_bvlc": "Caffe's AlexNet (LRN, grouped conv)"}


def plan_ratio(record: Mapping[str, Any]) -> float:
    return record["predicted_step_s"] / record["measured_step_s"]


def worst(ratios: Sequence[float]) -> float:
    """The ratio farthest from 1 (in the sense of the band: over 1 counts as much as under)."""
    return max(ratios, key=lambda r: max(r, 1 / r))


def _ratio(ratio: float) -> str:
    """Two decimals, three when outside the band (so 1.153 does not read as 1.15), ✗ then."""
    return f(ratio) if in_band(ratio) else f"{f(ratio, 3)} ✗"


BAND = f"{f(PLAN_BAND[0])}–{f(PLAN_BAND[1])}"


@table("planner-windows", *WINDOWS,
       how="ratio = predicted ÷ median measured step of the repeats; spread = (slowest − fastest "
           "repeat) ÷ their median, the JSON's `spread`.")
def planner_windows(root: Path) -> str:
    w2, w1 = (load(root, p)["results"] for p in WINDOWS)
    rows = [[f"{MODEL_NAMES[a['model']]} {a['image_size']} px", a["ranks"],
             f"{a['predicted_step_s']:.3f} / {a['measured_step_s']:.3f} s",
             _ratio(plan_ratio(a)), _ratio(plan_ratio(b)), f"{a['spread']:.0%} / {b['spread']:.0%}"]
            for a, b in zip(w2, w1, strict=True)]
    inside = [sum(in_band(plan_ratio(r)) for r in w) for w in (w2, w1)]
    widest = [max(r["spread"] for r in w) for w in (w2, w1)]
    table = md(["workload", "np", "window 2: predicted / measured step", "ratio",
                "window 1: ratio", "repeats' spread, window 2 / 1"], rows)
    return (f"{table}\n\nInside {BAND}: window 2 {inside[0]} of {len(w2)}, "
            f"window 1 {inside[1]} of {len(w1)}. Repeats' spread up to {widest[0]:.0%} "
            f"(window 2) and {widest[1]:.0%} (window 1).")


@table("planner-held-out", HELD_OUT,
       how="ratio = predicted ÷ median measured step of the repeats.")
def planner_held_out(root: Path) -> str:
    return held_out_table(load(root, HELD_OUT)["results"])


def held_out_table(records: Sequence[Mapping[str, Any]]) -> str:
    """Predicted / measured step and their ratio, a workload a row, an np a column."""
    rows: dict[str, list[str]] = {}
    for r in records:
        label = f"{MODEL_NAMES[r['model']]} {r['image_size']} px: predicted / measured"
        rows.setdefault(label, []).append(
            f"{r['predicted_step_s']:.3f} / {r['measured_step_s']:.3f} s = {_ratio(plan_ratio(r))}")
    inside = sum(in_band(plan_ratio(r)) for r in records)
    ranks = sorted({r["ranks"] for r in records})
    table = md(["workload", *(f"np {n}" for n in ranks)], [[k, *v] for k, v in rows.items()])
    return f"{table}\n\nInside {BAND}: {inside} of {len(records)}."


#: Every quiet bf16 attempt on the same CPU, oldest first (a calibration and a validation
#: each), with its name in the table
QUIET_BF16_ATTEMPTS = {
    "plan-held-out-bf16-quiet-2026-12-02/plan-validate-2026-12-02.json": "2026-12-02",
    "plan-held-out-bf16-2026-12-03/attempt1/plan-validate-2026-12-03.json": "2026-12-03, 1st",
    "plan-held-out-bf16-2026-12-03/attempt2/plan-validate-2026-12-03.json": "2026-12-03, 2nd"}
_LATEST_BF16 = list(QUIET_BF16_ATTEMPTS)[-1]
#: The bf16 held-out runs: (validation JSON, its calibration), loaded and the latest quiet one
HELD_OUT_BF16 = {
    "planner-held-out-bf16": ("plan-held-out-bf16-2026-12-02/plan-validate-2026-12-02.json",
                              "plan-held-out-bf16-2026-12-02/plan-calibrate-2026-12-02.yaml"),
    "planner-held-out-bf16-quiet": (
        _LATEST_BF16,
        _LATEST_BF16.replace("plan-validate-", "plan-calibrate-").replace(".json", ".yaml"))}
HELD_OUT_BF16_HOW = (
    "ratio = predicted (the calibration's bfloat16 rates) ÷ median measured step of the "
    "repeats, `hpcdl bench train --precision bfloat16` (float32 gradients on the wire, as its "
    "`ours` mode sends); CPU seconds: the median run's `measured_cpu_s` less "
    "`measured_comm_thread_cpu_s`, ÷ `threads_per_rank` (a proxy for the step on cores of its "
    "own, not the validated figure).")


def planner_held_out_bf16_of(root: Path, validation: str, calibration_file: str) -> str:
    """A bf16 validation's held-out rows and CPU-second rows, with its CPU and its loads."""
    report = load(root, validation)
    m = report["machine"]
    load_avg = m["load_average"]
    calibration = yaml.safe_load((root / RESULTS / calibration_file).read_text())["measured"]
    where = (f"Computing in {report['precision']} on {m['cpu_model_name']} (torch "
             f"{m['cpu_capability']}; {', '.join(f for f in m['cpu_flags'] if 'bf16' in f)}), "
             f"{m['cores']} cores; load average {calibration['load_average_before']:.1f} → "
             f"{calibration['load_average_after']:.1f} over the calibration, "
             f"{load_avg['before'][0]:.1f} → {load_avg['after'][0]:.1f} over the validation.")
    return (f"{held_out_table(report['results'])} {where}\n\n"
            f"{cpu_time_table(report['results'])}")


for _name, (_validation, _calibration) in HELD_OUT_BF16.items():
    table(_name, _validation, _calibration, how=HELD_OUT_BF16_HOW)(
        functools.partial(planner_held_out_bf16_of, validation=_validation,
                          calibration_file=_calibration))


@table("planner-held-out-bf16-attempts", *QUIET_BF16_ATTEMPTS,
       how="each attempt calibrates anew, then predicts and measures the same four rows; "
           "ratio = predicted ÷ median measured step of the repeats.")
def planner_held_out_bf16_attempts(root: Path) -> str:
    """Each quiet bf16 attempt's ratios side by side: how far the band holds from one
    calibration to the next."""
    reports = {name: load(root, p) for p, name in QUIET_BF16_ATTEMPTS.items()}
    by_row = {name: {(x["model"], x["image_size"], x["ranks"]): x for x in r["results"]}
              for name, r in reports.items()}
    keys = list(next(iter(by_row.values())))
    if any(set(rows) != set(keys) for rows in by_row.values()):
        raise ValueError(f"the bf16 attempts {list(QUIET_BF16_ATTEMPTS)} do not hold the same "
                         "workloads")
    labels = [f"{MODEL_NAMES[model]} {size} px, np {ranks}" for model, size, ranks in keys]
    rows = [[name, *(_ratio(plan_ratio(by_row[name][k])) for k in keys),
             f"{sum(in_band(plan_ratio(x)) for x in r['results'])} of {len(r['results'])}",
             f"{r['machine']['load_average']['before'][0]:.1f} → "
             f"{r['machine']['load_average']['after'][0]:.1f}"]
            for name, r in reports.items()]
    return md(["attempt", *labels, f"inside {BAND}", "load average over the validation"],
              rows)


def compute_cpu_s(record: Mapping[str, Any]) -> float:
    """A rank's CPU seconds per step outside its communication thread, per torch thread:
    the step's compute as the rank's own cores ran it, whatever else shared them."""
    return ((record["measured_cpu_s"] - (record.get("measured_comm_thread_cpu_s") or 0.0))
            / record["threads_per_rank"])


def cpu_time_table(records: Sequence[Mapping[str, Any]]) -> str:
    """The same rows against the ranks' CPU time (:func:`compute_cpu_s`): on a busy machine
    the wall clock also counts other processes' turns on the cores."""
    rows = [[f"{MODEL_NAMES[r['model']]} {r['image_size']} px", r["ranks"],
             f"{r['measured_step_s']:.3f} s", f"{compute_cpu_s(r):.3f} s",
             f"{r['predicted_step_s'] / compute_cpu_s(r):.2f}"] for r in records]
    return md(["workload", "np", "measured step (wall)", "CPU s per step per thread, "
               "without the communication thread", "predicted ÷ that"], rows)


PAPERS_DIR = "plan-spec-machines-2026-12-01"
#: (raw file, run, ranks' hardware, published minutes: You et al., "ImageNet Training in
#: Minutes", ICPP 2018; the published figures, not measured here)
PAPERS = (("alexnet_bn_32k-skx.json", "AlexNet-BN 32K", "2,048 × Xeon 8160", 11),
          ("resnet50_32k-knl.json", "ResNet-50 32K", "2,048 × Xeon Phi 7250", 20))


@dataclass(frozen=True)
class PaperPlan:
    run: str
    hardware: str
    report: Mapping[str, Any]
    published_min: float

    @property
    def minutes(self) -> float:
        return self.report["total_s"] / 60

    @property
    def steps(self) -> int:
        i = self.report["inputs"]
        return round(i["epochs"] * i["dataset_size"] / i["global_batch"])

    @property
    def bound(self) -> tuple[str, float]:
        """The dominant term and its share of the iteration."""
        it = self.report["per_iteration"]
        key = "comm_exposed_s" if self.report["dominant"] == "communication" else "compute_s"
        return self.report["dominant"], it[key] / it["iteration_s"]


def paper_plans(root: Path) -> list[PaperPlan]:
    return [PaperPlan(run, hw, load(root, f"{PAPERS_DIR}/{name}"), published)
            for name, run, hw, published in PAPERS]


MEMORY_CLASSES = ("batch_norm", "relu", "add", "pool", "dropout", "lrn")


def _largest_classes(by_class: Mapping[str, float], n: int = 4) -> str:
    """The ``n`` largest dense classes in ms, then the memory-bound passes summed."""
    dense = sorted(((k, v) for k, v in by_class.items() if k not in MEMORY_CLASSES),
                   key=lambda kv: -kv[1])[:n]
    memory = sum(v for k, v in by_class.items() if k in MEMORY_CLASSES)
    return ", ".join(f"{k} {v * 1000:.1f}" for k, v in dense) + \
        f", memory passes {memory * 1000:.1f}"


@table("planner-papers", *(f"{PAPERS_DIR}/{name}" for name, *_ in PAPERS),
       how="per-iteration terms and the total as each plan's JSON records them; steps = epochs × "
           "dataset ÷ global batch; 'bound by' is the dominant term's share of the iteration "
           "(exposed allreduce, or compute); published minutes are the paper's.")
def planner_papers(root: Path) -> str:
    rows = []
    for p in paper_plans(root):
        it = {k: v * 1000 for k, v in p.report["per_iteration"].items()}
        dominant, share = p.bound
        rows.append([f"{p.run}, {p.report['inputs']['epochs']:.4g} epochs ({p.steps:,} steps), "
                     f"{p.hardware}",
                     f"{it['compute_s']:.1f} ms ({_largest_classes(p.report['compute_by_class'])})",
                     f"{it['optimizer_s']:.1f} ms",
                     f"{it['comm_s']:.1f} / {it['comm_hidden_s']:.1f} / "
                     f"{it['comm_exposed_s']:.1f} ms", f"{it['iteration_s']:.1f} ms",
                     f"**{p.minutes:.1f} min**", f"{p.published_min:g} min",
                     f"{dominant} ({share:.0%} of the iteration)"])
    return md(["run", "compute (largest classes, ms)", "LARS", "allreduce total / hidden / exposed",
               "iteration", "predicted", "published", "bound by"], rows, right=2)


RELAXED_PLANS = (("alexnet_bn_32k", "AlexNet-BN 32K"), ("resnet50_32k", "ResNet-50 32K"))
RELAXED_POLICIES = (("sync", "sync"), ("local", "local SGD, H = 8"),
                    ("hier", "hierarchical, H = 8"), ("psgd2", "PowerSGD r = 2"),
                    ("psgd4", "PowerSGD r = 4"))


def plan_minutes(root: Path, stem: str) -> float:
    """The predicted training time of plan ``PAPERS_DIR/stem.json``, in minutes."""
    return load(root, f"{PAPERS_DIR}/{stem}.json")["total_s"] / 60


@table("planner-relaxed",
       *(f"{PAPERS_DIR}/relaxed-{stem}-skx-{key}.json"
         for stem, _ in RELAXED_PLANS for key, _ in RELAXED_POLICIES),
       how="each cell is one plan's `total_s` ÷ 60 (the command in each JSON; warm-up steps "
           "synchronous).")
def planner_relaxed(root: Path) -> str:
    rows = [[f"{label}, 2,048 ranks on `skx`",
             *(f"{plan_minutes(root, f'relaxed-{stem}-skx-{key}'):.1f}"
               for key, _ in RELAXED_POLICIES)] for stem, label in RELAXED_PLANS]
    return md(["planned minutes", *(name for _, name in RELAXED_POLICIES)], rows)


#: (file suffix, column): each plan re-run with one figure of the spec file changed (scaled
#: in a copy under --machines-dir) or one option; benchmarks/plan_papers.sh runs them all
SENSITIVITY = (("", "as shipped"), ("-dense08", "dense fractions × 0.8"),
               ("-dense125", "× 1.25"), ("-mem08", "memory passes × 0.8"), ("-mem125", "× 1.25"),
               ("-nooverhead", "no per-layer overhead"), ("-noov", "overlap off"),
               ("-rab", "`rabenseifner`"), ("-hier", "`hierarchical`"))
SENSITIVITY_SUFFIXES = tuple(suffix for suffix, _ in SENSITIVITY)
#: per plan, the variants run (the file suffixes of SENSITIVITY it has): ResNet-50's plan
#: has no overlap-off or hierarchical run
SENSITIVITY_PLANS = (("alexnet_bn_32k-skx", "AlexNet-BN 32K on `skx`", SENSITIVITY_SUFFIXES),
                     ("resnet50_32k-knl", "ResNet-50 32K on `knl`",
                      tuple(s for s in SENSITIVITY_SUFFIXES if s not in ("-noov", "-hier"))))


@table("planner-sensitivity",
       *(f"{PAPERS_DIR}/{stem}{suffix}.json"
         for stem, _, runs in SENSITIVITY_PLANS for suffix in runs),
       how="each cell is one plan's `total_s` ÷ 60; '—' where no such plan was run.")
def planner_sensitivity(root: Path) -> str:
    rows = [[label, *(f"{plan_minutes(root, stem + s):.2f}" if s in runs else "—"
                      for s, _ in SENSITIVITY)] for stem, label, runs in SENSITIVITY_PLANS]
    return md(["planned minutes, 2,048 ranks", *(name for _, name in SENSITIVITY)], rows)


SIMULATE_DIR = "plan-simulate-2026-12-01"
#: (file stem, label, the paper's minutes) of the papers' two runs on Stampede2's fat tree
SIMULATED_RUNS = (("alexnet-bn-skx", "AlexNet-BN, 1,024 SKX × 2 ranks", 11),
                  ("resnet50-knl", "ResNet-50, 2,048 KNL", 20))
#: per run, the (allreduce, placement, fabric) cells simulated at 2,048 ranks: the ring's
#: five for both, the other algorithms for AlexNet-BN
RING_CELLS = tuple(("ring", placement, fabric) for placement, fabric in (
    ("contiguous", "28to20"), ("contiguous", "nonblocking"), ("scattered", "28to20"),
    ("random", "28to20"), ("random", "nonblocking")))
SIMULATED_CELLS = {
    "alexnet-bn-skx": (*RING_CELLS, ("hierarchical", "contiguous", "28to20"),
                       ("hierarchical", "random", "28to20"),
                       ("rabenseifner", "contiguous", "28to20"),
                       ("rabenseifner", "contiguous", "nonblocking"),
                       ("rabenseifner", "scattered", "28to20"),
                       ("rabenseifner", "scattered", "nonblocking"),
                       ("rabenseifner", "random", "28to20")),
    "resnet50-knl": RING_CELLS}
FABRICS = {"28to20": "28:20", "nonblocking": "non-blocking"}


def _simulated_file(stem: str, allreduce: str, placement: str, fabric: str) -> str:
    algorithm = "" if allreduce == "ring" else f"{allreduce}-"
    return f"{SIMULATE_DIR}/{stem}-{algorithm}{placement}-{fabric}.json"


def _simulated_rows(root: Path, stem: str, cell: tuple[str, str, str]) -> dict[int, Any]:
    """The simulation's rows of one file, by rank count."""
    report = load(root, _simulated_file(stem, *cell))
    return {r["procs"]: r for r in report["simulation"]["rows"]}


@table("simulate-papers",
       *(_simulated_file(stem, *c)
         for stem, *_ in SIMULATED_RUNS for c in SIMULATED_CELLS[stem]),
       how="the 2,048-rank row of each simulation's JSON (`simulation.rows`): the formula's "
           "figure, then SimGrid's, and their ratio (`comm_ratio`, `iteration_ratio`).")
def simulate_papers(root: Path) -> str:
    rows = []
    for stem, label, paper in SIMULATED_RUNS:
        for i, cell in enumerate(SIMULATED_CELLS[stem]):
            r = _simulated_rows(root, stem, cell)[2048]
            allreduce, placement, fabric = cell
            name = label if i == 0 else "" if allreduce == SIMULATED_CELLS[stem][i - 1][0] \
                else f"— {allreduce}"
            rows.append([name, placement, FABRICS[fabric],
                         f"{r['comm_formula_s'] * 1000:.0f} → {r['comm_simulated_s'] * 1000:.0f} "
                         f"ms ({f(r['comm_ratio'])}×)",
                         f"{f(r['iteration_formula_s'], 3)} → {f(r['iteration_simulated_s'], 3)} "
                         f"s ({f(r['iteration_ratio'])}×)",
                         f"{r['total_formula_s'] / 60:.1f} → {r['total_simulated_s'] / 60:.1f} min",
                         f"{paper} min" if i == 0 else ""])
    return md(["run (2,048 ranks)", "placement", "fabric", "allreduce/step formula → simulated",
               "step formula → simulated", "training time formula → simulated", "paper"],
              rows, right=3)


SCALING_CELLS = (("ring", "contiguous", "28to20"), ("ring", "random", "28to20"),
                 ("ring", "random", "nonblocking"))


@table("simulate-scaling",
       *(_simulated_file(stem, *c) for stem, *_ in SIMULATED_RUNS for c in SCALING_CELLS),
       how="every row of each simulation's sweep (`simulation.rows`); 'random nb' is random "
           "placement on the non-blocking tree.")
def simulate_scaling(root: Path) -> str:
    rows = []
    for stem, label, _ in SIMULATED_RUNS:
        by_cell = [_simulated_rows(root, stem, c) for c in SCALING_CELLS]
        for i, procs in enumerate(sorted(by_cell[0])):
            cells = [c[procs] for c in by_cell]
            rows.append([label if i == 0 else "", f"{procs:,}",
                         f"{cells[0]['comm_formula_s'] * 1000:.0f}",
                         *(f"{c['comm_simulated_s'] * 1000:.0f}" for c in cells),
                         f"{cells[0]['total_formula_s'] / 60:.1f}",
                         *(f"{c['total_simulated_s'] / 60:.1f}" for c in cells)])
    return md(["run", "ranks", "allreduce ms: formula", "contiguous", "random", "random nb",
               "time min: formula", "contiguous", "random", "random nb"], rows, right=1)


PLAN_NETWORK = "plan-network-2026-12-01/predicted-vs-measured-cal2gbit.json"
PLAN_NETWORK_BACKENDS = (("ring", "hpcdl's `ring` backend vs the ring cost"),
                         ("mpi", "MPICH's `MPI_Allreduce` vs the Rabenseifner cost"))


def plan_network_held_out(root: Path) -> dict[str, list[Mapping[str, Any]]]:
    """Per backend, the rows the 2gbit calibration did not see (3 hosts, or 1gbit)."""
    rows = load(root, PLAN_NETWORK)["rows"]
    return {b: [r for r in rows if r["backend"] == b and not r["calibration_layout"]]
            for b, _ in PLAN_NETWORK_BACKENDS}


def _span(rows: Sequence[Mapping[str, Any]]) -> str:
    ratios = [r["predicted_over_measured"] for r in rows]
    return _minmax(ratios, 2) if ratios else "—"


@table("planner-network", PLAN_NETWORK,
       how="predicted ÷ measured allreduce time of each row (both runs), the network calibrated "
           "at 2gbit on 2 hosts; held out = every row at 3 hosts or at 1gbit; cells are min–max "
           "over the held-out rows of that layout.")
def planner_network(root: Path) -> str:
    held = plan_network_held_out(root)
    own = [r for r in load(root, PLAN_NETWORK)["rows"] if r["calibration_layout"]]
    cells = [(rate, h, mb) for rate, h in (("1gbit", 2), ("1gbit", 3), ("2gbit", 3))
             for mb in (25_000_000, 244_000_000)]
    out = []
    for backend, label in PLAN_NETWORK_BACKENDS:
        rows = held[backend]
        inside = sum(in_band(r["predicted_over_measured"]) for r in rows)
        at = {c: [r for r in rows if (r["rate"], r["hosts"], r["bytes"]) == c] for c in cells}
        out.append([label, f"**{inside} of {len(rows)}**", *(_span(at[c]) for c in cells),
                    _span([r for r in own if r["backend"] == backend])])
    header = ["predicted ÷ measured allreduce", f"held-out rows in {BAND}",
              *(f"{rate}, {h} hosts, {mb // 1_000_000} MB" for rate, h, mb in cells),
              "calibration's own layout (2 hosts, 2gbit)"]
    return md(header, out)


DEMO_SEEDS = "demo-seed-spread-2026-12-01.json"
DEMO_TIME = "demo-time-2026-12-02.json"


@table("demo", DEMO_SEEDS, DEMO_TIME,
       how="top-1 on the 1,000 held-out images at the last epoch; wall = the timed run's "
           "summary.json.")
def demo(root: Path) -> str:
    seeds = [r for r in load(root, DEMO_SEEDS)["full_demo_seeds"] if r["epochs"] == 25.0]
    timed = load(root, DEMO_TIME)
    rows = [[f"seed {r['seed']}, 25 epochs (shared machine, wall time not quoted)",
             f(r["top1"] * 100, 1), "—"] for r in seeds]
    rows.append([f"seed {timed['seed']}, {timed['epochs']:g} epochs, timed "
                 f"({timed['machine']['cpu']}, {timed['machine']['cpu_capability']}, "
                 f"1-minute load {timed['load_average_before']} at the start, "
                 f"{timed['load_average_after'].split(',')[0]} at the end)",
                 f(timed["top1"] * 100, 1), f"{timed['wall_s']:.0f} s"])
    return md(["run (`mpiexec -n 2 hpcdl demo`, 2 ranks)", "top-1 %", "wall"], rows)


# ---- the summary at the top of performance.md -----------------------------------------
# Every figure below is taken from the section builders' own functions above: a summary
# cell cannot say what its section's table does not.

RELAXED_BYTES_GOAL = 4.0  # × fewer network bytes than sync
RELAXED_ACCURACY_GOAL = -0.5  # points against sync


def _summary_allreduce(root: Path) -> list[str]:
    v = allreduce_ratio_values(root)

    def runs(name: str, p: tuple[int, ...] = (2, 4)) -> list[float]:
        return [x for q in p for x in v[name][q] if x is not None]

    mpi, gloo = runs("default_vs_mpi_busbw_100MB"), "default_vs_gloo_busbw_100MB"
    sites = [x for name in SITE_RATIOS for x in runs(name)]
    g_mpi, g_gloo = ALLREDUCE_GOALS["default_vs_mpi_busbw_100MB"], ALLREDUCE_GOALS[gloo]
    met = {p: sum(x >= g_gloo for x in runs(gloo, (p,))) for p in (2, 4)}
    mpi_met = sum(x >= g_mpi for x in mpi)
    return [f"at 100 MB, hpcdl's `shm` is {_minmax(mpi, 2)}× MPICH, {_minmax(sites, 2)}× the "
            f"best tuning of Intel MPI / Open MPI / MPICH, {_minmax(runs(gloo), 2)}× gloo (each "
            "run's own ratio)",
            f"≥ {g_mpi:g}× MPICH, ≥ {g_gloo:g}× gloo",
            f"MPICH met in {mpi_met} of {len(mpi)} runs; gloo met in {met[2]} of "
            f"{len(runs(gloo, (2,)))} runs at P = 2, {met[4]} of {len(runs(gloo, (4,)))} at P = 4"]


def _summary_step(root: Path) -> list[str]:
    figs = step_figures(root)
    ceiling = [statistics.median(s.ratios["ours_allreduce/no_comm"]) for s in figs]
    ddp = [statistics.median(s.ratios["ours_allreduce/ddp_gloo"]) for s in figs]
    names = " / ".join(s.label.split(" ")[0] for s in figs)
    ceiling_met = all(c >= s.ceiling_goal for c, s in zip(ceiling, figs, strict=True))
    ddp_met = [d >= s.ddp_goal for d, s in zip(ddp, figs, strict=True)]
    spans = " and ".join(_minmax(s.ratios["ours_allreduce/no_comm"], 3) for s in figs)
    return [f"{' / '.join(f(c, 3) for c in ceiling)} of the no-comm ceiling, "
            f"{' / '.join(f(d, 3) for d in ddp)}× DDP+gloo ({names}, 2 ranks, one host; "
            f"medians of {' / '.join(str(s.runs) for s in figs)} runs)",
            f"ceiling ≥ {' / '.join(f(s.ceiling_goal) for s in figs)}; DDP ≥ "
            f"{' / '.join(f(s.ddp_goal) for s in figs)}×",
            f"ceiling {_met(ceiling_met)} on the medians (runs {spans}); "
            f"DDP {'met' if all(ddp_met) else 'not met' if not any(ddp_met) else 'met on one'}"]


def _summary_across(root: Path) -> list[str]:
    medians = {rate: {m: statistics.median(v["vs_same_wire"])
                      for m, v in across_figures(root, rate).items() if m in SAME_WIRE_DDP}
               for rate in ACROSS_RATES}
    return ["2 hosts × 1 rank, AlexNet-BN; ÷ DDP+gloo with as many bits on the wire, median: "
            + "; ".join(f"{rate.lower()}: fp32 {f(m['ours'])}× ({f(m['ours@gloo'])}× on gloo), "
                        f"bf16 {f(m['ours_bf16'])}× DDP fp16" for rate, m in medians.items()),
            f"≥ {ACROSS_GOAL:g}× at each rate, fp32 and 16-bit",
            "; ".join(f"{rate.lower()}: fp32 {_met(m['ours'] >= ACROSS_GOAL)}, 16-bit "
                      f"{_met(m['ours_bf16'] >= ACROSS_GOAL)}" for rate, m in medians.items())]


def _summary_loader(root: Path) -> list[str]:
    r = load(root, LOADER_FILE)["ratios"]
    a, b = r["hdf5_vs_imagefolder_resized"], r["hdf5_vs_webdataset"]
    return [f"{f(a)}× ImageFolder and {f(b)}× WebDataset on the same JPEGs, per core",
            f"≥ {LOADER_GOAL:g}×", _met(min(a, b) >= LOADER_GOAL)]


def _summary_optim(root: Path) -> list[str]:
    ratio = load(root, OPTIM_FILE)["ratios"]["lars_vs_sgd_step_time"]
    return [f"{f(ratio)}× SGD's foreach step (ResNet-50), **on a loaded machine**",
            f"≤ {OPTIM_GOAL:g}×",
            _met(ratio <= OPTIM_GOAL) + " under load; no quiet raw file"]


def _summary_bf16(root: Path) -> list[str]:
    emulated, native = BF16_ACC_DIRS
    diff, native_diff = bf16_accuracy_diff(root, emulated), bf16_accuracy_diff(root, native)
    (resnet, _), (alexnet, _) = BF16_SPEED_MODELS
    vs_torch, fraction = bf16_vs_torch(root, resnet)
    return [f"bf16 LARS − fp32: {signed(diff)} points emulated (mean of "
            f"{len(_bf16_seeds(root, emulated))} seeds), {signed(native_diff)} native "
            f"({len(_bf16_seeds(root, native))} seeds); bf16 ÷ fp32 CPU s per step, quiet: "
            f"{f(bf16_speedup(root, resnet))}× / {f(bf16_speedup(root, alexnet))}× "
            f"(ResNet-50 / AlexNet-BN, AVX512-BF16); ResNet-50 bf16, "
            f"same run: {spread(vs_torch, 2)}× plain "
            f"torch, {f(fraction)} of the bf16 matmul peak per CPU s",
            f"≥ {f(BF16_GOAL, 1)} points; ≥ 1× plain torch",
            f"accuracy {_met(min(diff, native_diff) >= BF16_GOAL)}; "
            f"vs torch {_against_one(vs_torch)}"]


def _against_one(ratios: Sequence[float]) -> str:
    """A same-run ratio's goal of ≥ 1 read on its runs: met on the median, undecided when 1
    lies inside the runs' min–max (the noise of a shared machine), else not met."""
    if statistics.median(ratios) >= 1.0:
        return "met on the median"
    if min(ratios) <= 1.0 <= max(ratios):
        return "undecided: 1× lies inside the runs' spread (shared machine)"
    return "not met"


def _summary_convergence(root: Path) -> list[str]:
    rows = convergence_rows(root)
    top = max(rows, key=lambda r: r.lead)
    large = [r for r in rows if r.batch >= 1536]
    return [f"LARS − SGD: {' / '.join(signed(r.lead) for r in rows)} points at batch "
            f"{rows[0].batch:,} … {rows[-1].batch:,} (same decay policy, every optimum "
            f"bracketed); {' / '.join(signed(r.lead_over_better) for r in large)} at "
            f"{' / '.join(f'{r.batch:,}' for r in large)} against SGD's better final",
            "LARS holds accuracy at large batch",
            f"direction shown; {signed(top.lead)} at {top.batch:,} may be inflated (one SGD "
            "cell); η not bracketed"]


def _summary_relaxed(root: Path) -> list[str]:
    hier = next(r for r in relaxed_rows(root) if r.run == "hierarchical")
    net = {r.run: r for r in relaxed_network_rows(root)}
    h1, h2, total = net["hierarchical"].vs["sync"]
    ddp_total = net["hierarchical"].vs["ddp_sync"][2]
    across = net["hierarchical"].top1 - net["sync"].top1
    hosts_met = sum(x >= RELAXED_BYTES_GOAL for x in (h1, h2))
    return [f"hierarchical local SGD {signed(hier.delta)} points vs sync ({len(hier.top1)} "
            f"seeds, one node); on the network (eth0, 2 hosts × 2 ranks) {f(h1)}× / {f(h2)}× "
            f"fewer bytes than hpcdl's sync per host ({f(total)}× in total), {f(ddp_total)}× "
            "fewer than DDP in total",
            f"≥ {RELAXED_BYTES_GOAL:g}× fewer network bytes at ≤ {f(-RELAXED_ACCURACY_GOAL, 1)} "
            "points",
            f"bytes: met on {hosts_met} of 2 hosts, "
            f"{_met(total >= RELAXED_BYTES_GOAL)} in total; accuracy: "
            f"{_met(hier.delta >= RELAXED_ACCURACY_GOAL)} on one node ({len(hier.top1)} seeds), "
            f"{signed(across)} across hosts (one seed)"]


def _summary_planner(root: Path) -> list[str]:
    held = [plan_ratio(r) for r in load(root, HELD_OUT)["results"]]
    windows = [[plan_ratio(r) for r in load(root, p)["results"]] for p in WINDOWS]
    papers = paper_plans(root)
    ring = plan_network_held_out(root)["ring"]
    ring_in = sum(in_band(r["predicted_over_measured"]) for r in ring)
    inside = sum(map(in_band, held))
    return [f"**held out: {inside} of {len(held)} rows in {BAND}** (worst {f(worst(held))}; "
            f"AVX512, its own calibration); in-sample "
            f"{' / '.join(f'{sum(map(in_band, w))} of {len(w)}' for w in windows)}; papers: "
            + ", ".join(f"{p.minutes:.1f} min ({p.published_min:g} published)" for p in papers),
            f"{BAND} held out",
            f"compute: {inside} of {len(held)}; network (across hosts): hpcdl's ring "
            f"{ring_in} of {len(ring)} held-out rows in {BAND}"]


SUMMARY = (("Allreduce", "allreduce", _summary_allreduce),
           ("Training step", "training-step", _summary_step),
           ("Training step across hosts", "training-step-across-hosts", _summary_across),
           ("Loader", "loader", _summary_loader),
           ("LARS step", "lars-optimizer-step", _summary_optim),
           ("bf16", "bf16", _summary_bf16),
           ("Convergence", "convergence-accuracy-against-batch", _summary_convergence),
           ("Relaxed consistency", "relaxed-consistency", _summary_relaxed),
           ("Planner", "planner", _summary_planner))


def summary(root: Path) -> str:
    rows = [[f"[{topic}](#{anchor})", *row(root)] for topic, anchor, row in SUMMARY]
    rows.append(["[LTFB](#ltfb)", "no current figure (the 2026-11-29 run has no raw file)", "—",
                 "not measured since"])
    return md(["topic", "current figure", "goal", "status"], rows, right=9)


DEMO_GOAL = (85.0, 300.0)  # top-1 %, wall s: README's "≥ 85% in under 5 minutes on 2 cores"


@table("demo-headline", DEMO_TIME,
       how="top-1 and wall time as the timed run's record holds them.")
def demo_headline(root: Path) -> str:
    """README's one sentence on the demo's time, from the timed run's record."""
    timed = load(root, DEMO_TIME)
    top1, wall = timed["top1"] * 100, timed["wall_s"]
    met = top1 >= DEMO_GOAL[0] and wall < DEMO_GOAL[1]
    return (f"One timed run reached {f(top1, 1)}% in {wall:.0f} s on a "
            f"{timed['machine']['cores']}-core {timed['machine']['cpu']} "
            f"({timed['machine']['cpu_capability']}) shared with other jobs (goal "
            f"{_met(met)}; all runs: "
            "[docs/performance.md](docs/performance.md#the-demo)).")


# ---- checkpoint cost at scale ----------------------------------------------------------

CKPT_FILE = "checkpoint-cost-p32-2026-12-02.json"
CKPT_P = 2048  # the rank count of the bench's extrapolation (its summary's ``at_2048``)
CKPT_MODELS = (("resnet50", "ResNet-50"), ("alexnet_bn", "AlexNet-BN"))
RESUME_TESTS = ("`tests/test_resume_reads.py::test_what_a_rank_reads_at_resume_does_not_grow_"
                "with_the_rank_count`, `...::test_only_rank_0_reads_the_model_the_others_their_"
                "own_file`")


def _size(x: float) -> str:
    """Bytes in the unit that keeps three figures: B, KB, MB, GB, TB (powers of 1000)."""
    for unit, scale, nd in (("TB", 1e12, 2), ("GB", 1e9, 1), ("MB", 1e6, 1), ("KB", 1e3, 0)):
        if x >= scale:
            return f"{x / scale:,.{nd}f} {unit}"
    return f"{x:,.0f} B"


def _measured(values: Sequence[float], unit: str) -> str:
    """One value per measured P: exact bytes (``B``), or KB with ``unit``'s decimals."""
    if unit == "B":
        return " / ".join(f"{v:,}" for v in values)
    nd = int(unit[2:])
    return " / ".join(f"{v / 1e3:.{nd}f}" for v in values) + " KB"


def _growth(slope: float, why: str = "") -> str:
    return "none" if slope == 0 else f"+{slope:,.0f} B/P" + (f" ({why})" if why else "")


def _ckpt_row(rows: Mapping[str, Any], key: str, side: str, unit: str, why: str = ""
              ) -> list[str]:
    """measured at each P, growth (the bench's fit), at 2,048 for each model: of rank 0
    (``rank0``), the largest other rank (``other``) or all ranks (``total``)."""
    row = rows[key]
    measured = row["other_max" if side == "other" else side]
    growth = ("linear in P: rank 0 + (P − 1) × the others" if side == "total"
              else _growth(row["fit_" + side][1], why))
    at = [row["at_2048"][m][side] for m, _ in CKPT_MODELS]
    cells = [f"{a:,.0f}" for a in at] if key.endswith(".messages") else [_size(a) for a in at]
    return [_measured(measured, unit), growth, *cells]


def _calls(report: Mapping[str, Any], phase: str) -> str:
    return ", ".join(f"`{c}`" for c in report["runs"][0]["per_rank"][0][phase]["calls"])


def _files_beyond_p(summary: Mapping[str, Any]) -> int:
    """Files of a checkpoint directory beyond one a rank; the same at every measured P."""
    files = summary["files"]
    extra = {n - p for p, n in zip(files["P"], files["files_in_checkpoint"], strict=True)}
    if len(extra) != 1:
        raise ValueError(f"files_in_checkpoint {files['files_in_checkpoint']} is not P + a "
                         f"constant at P = {files['P']}")
    return extra.pop()


def checkpoint_cost_rows(report: Mapping[str, Any]) -> list[list[str]]:
    s = report["summary"]
    rows, models = s["rows"], s["models"]
    r50 = CKPT_MODELS[0][0]
    written = rows["write.wchar"]["at_2048"][r50]
    # before per-rank files, each rank read everything a checkpoint writes (all ranks' state
    # and the model) and rank 0 gathered the others' state: the same bytes, measured here
    before_read, before_gather = written["total"], written["total"] - written["rank0"]
    extra = _files_beyond_p(s)
    files = s["files"]
    return [
        ["write: bytes written, rank ≠ 0",
         *_ckpt_row(rows, "write.wchar", "other", "B", "torch's zip padding, 64-byte steps"),
         "its own rank file: RNG states + its BN statistics + its policy state (local SGD: its "
         "model and momentum; PowerSGD: its error buffers)",
         "`tests/test_resume_reads.py::test_what_a_rank_writes_does_not_grow_with_the_rank_"
         "count`"],
        ["write: bytes written, rank 0",
         *_ckpt_row(rows, "write.wchar", "rank0", "B", "manifest records"),
         "`model.pt` + its rank file + a manifest of ≤ 130 B a rank",
         "same test (file sizes), `tests/test_checkpoint.py`"],
        ["write: bytes written in all", *_ckpt_row(rows, "write.wchar", "total", "KB0"),
         "`model.pt` + P rank files (before: the same, but all through rank 0's memory)", "—"],
        ["write: bytes read, rank 0",
         *_ckpt_row(rows, "write.rchar", "rank0", "KB1", "pruning reads the line's manifests"),
         "`keep` manifests", "—"],
        ["write: files, per rank / in all",
         f"per rank 1 (rank 0: {extra + 1}); in all "
         f"{' / '.join(map(str, files['files_in_checkpoint']))} and one directory",
         f"P + {extra} in all",
         *[f"{CKPT_P + extra:,} files"] * len(CKPT_MODELS), "one file a rank",
         "`test_what_a_rank_writes_...` (the listing)"],
        [f"write: MPI calls per rank ({_calls(report, 'write')}; + one `Barrier` when a "
         "checkpoint is pruned)", *_ckpt_row(rows, "write.messages", "other", "B"),
         "constant", "the counts in the JSON"],
        ["write: MPI payload, rank ≠ 0",
         *_ckpt_row(rows, "write.message_bytes", "other", "B"),
         "8 B × BN floats (the float64 allreduce) + the records", "—"],
        ["write: MPI payload, rank 0",
         *_ckpt_row(rows, "write.message_bytes", "rank0", "B", "the gather of file records"),
         f"8 B × BN floats + 130 B a rank (before: every other rank's state, "
         f"{_size(before_gather)} for ResNet-50; with local SGD ≈ P × `model.pt`: "
         f"{_size(CKPT_P * models[r50]['model_pt'])})", "—"],
        ["resume: bytes read, rank ≠ 0", *_ckpt_row(rows, "resume.rchar", "other", "B",
                                                    "torch's zip padding, 64-byte steps"),
         "its own rank file + 1/8", RESUME_TESTS],
        ["resume: bytes read, rank 0",
         *_ckpt_row(rows, "resume.rchar", "rank0", "B", "the manifest, read for the line "
                    "index, the check and the line decision"),
         "`model.pt` + its rank file + 3 × 130 B a rank",
         "same tests (P = 2 vs 8, slack 3 × 130 B a rank)"],
        ["resume: bytes read in all (file system)",
         *_ckpt_row(rows, "resume.rchar", "total", "KB0"),
         f"`model.pt` once + P rank files (before: P × everything written = "
         f"{_size(CKPT_P * before_read)} for ResNet-50, {_size(before_read)} a rank)",
         "—"],
        [f"resume: MPI calls per rank ({_calls(report, 'resume')}; again per checkpoint "
         "skipped)", *_ckpt_row(rows, "resume.messages", "other", "B"), "constant",
         "the counts in the JSON"],
        ["resume: MPI payload, rank ≠ 0 (≈ `model.pt`)",
         *_ckpt_row(rows, "resume.message_bytes", "other", "B"),
         f"`model.pt` (the broadcast); {CKPT_P:,} × that crosses the network, as any model "
         "broadcast does", "—"],
        ["resume: layout probe before the trainer, rank 0 (reads the manifest; one "
         f"{_calls(report, 'resume_layout')} of "
         f"{rows['resume_layout.message_bytes']['fit_rank0'][0]:,.0f} B)",
         *_ckpt_row(rows, "resume_layout.rchar", "rank0", "KB1", "the manifest"),
         "2 × 130 B a rank", "—"],
        ["resume: layout probe, rank ≠ 0",
         *_ckpt_row(rows, "resume_layout.rchar", "other", "B"), "constant", "—"],
    ]


@table("checkpoint-cost", CKPT_FILE,
       how="bytes are `/proc/self/io` (`rchar`, `wchar`) before and after, on every rank; rank ≠ "
           "0 is the largest of the other ranks at each P; growth is the bench's least-squares "
           f"fit a + b·P over the measured P (a fitted change under {NOISE_BYTES} bytes over that "
           "range counts as none); at 2,048 is the bench's extrapolation: the fit at P = 2,048 "
           "with the tiny model's `model.pt` and BN statistics replaced by the full model's; in "
           "all = rank 0 + (P − 1) × the others; 'before' figures are what the gathered design "
           "moved: every rank's state through rank 0 (in all minus rank 0's write) and "
           "everything written read by every rank.")
def checkpoint_cost(root: Path) -> str:
    report = load(root, CKPT_FILE)
    s, m = report["summary"], report["machine"]
    ps = s["rows"]["write.wchar"]["P"]
    tiny, models = s["tiny"], s["models"]
    sized = "; ".join(
        f"{label}: {models[key]['parameters']:,} parameters, {models[key]['float_buffers']:,} "
        f"BN floats: `model.pt` {_size(models[key]['model_pt'])}, a rank file's BN statistics "
        f"{_size(models[key]['rank_buffers'])}" for key, label in CKPT_MODELS)
    run = (f"`{report['command']}` ({report['measured']}, P = {', '.join(map(str, ps))}): "
           f"the tiny model's `model.pt` {tiny['model_pt']:,} bytes, a rank file "
           f"{tiny['rank_file']:,} bytes. Machine: {m['cores']}-core {m['cpu']}, torch "
           f"{m['torch']}, `get_cpu_capability()` {m['capability']}, load average "
           f"{m['load_1_5_15'].split()[0]} at the end. At {CKPT_P:,} ranks the model-sized "
           f"terms are the full model's (float32, counted on the meta device): {sized}.")
    header = ["what", f"per rank, measured P = {' / '.join(map(str, ps))}", "growth (fit)",
              *(f"at {CKPT_P:,}: {label}" for _, label in CKPT_MODELS), "bound", "held by"]
    rows = checkpoint_cost_rows(report)
    return f"{run}\n\n{md(header, rows, right=9)}\n\n{_ckpt_growth_line(s['rows'])}"


def _ckpt_growth_line(rows: Mapping[str, Any]) -> str:
    """The fits' summary: what grows with P on rank 0 and on the others."""
    byte_rows = {k: r for k, r in rows.items() if not k.endswith(".messages")}
    root = [r["fit_rank0"][1] for r in byte_rows.values() if r["fit_rank0"][1]]
    other = [r["fit_other"][1] for r in byte_rows.values() if r["fit_other"][1]]
    line = (f"Rank 0's view (the manifest, the gather of file records, the line index) grows "
            f"by {min(root):,.0f}–{max(root):,.0f} bytes a rank, "
            f"{_size(max(root) * CKPT_P)} at most at {CKPT_P:,} ranks")
    if other:
        line += (f"; the other ranks' fits grow by at most {max(other):,.0f} bytes a rank "
                 f"({_size(max(other) * CKPT_P)} at {CKPT_P:,}): rank files of one P differ "
                 "by torch's 64-byte zip padding steps, and the largest of more ranks lands on "
                 "a higher step, not a record a rank")
    return line + "."


# ---- start-up exchanges at scale --------------------------------------------------------

STARTUP_FILE = "startup-cost-2026-12-02.json"
STARTUP_ROWS = (("comm_init", "`hpcdl.comm.init` (auto: `shm`), rank ≠ 0"),
                ("threads", "compute threads (`configure_threads`), rank ≠ 0"),
                ("watchdog", "stall watchdog in the run directory, rank ≠ 0"),
                ("trainer", "trainer start (loaders, model broadcast, replica check), rank ≠ 0"),
                ("doctor", "`hpcdl doctor`, rank ≠ 0"), ("doctor_rank0", "`hpcdl doctor`, rank 0"),
                ("ltfb", "LTFB start (2 trainers), rank ≠ 0"))


def _tests(tests: Sequence[str]) -> str:
    """``file::a``, ``...::b``: tests of one file, the file named once."""
    return ", ".join(f"`{t}`" if i == 0 else f"`...::{t.split('::')[1]}`"
                     for i, t in enumerate(tests))


@table("startup-cost", STARTUP_FILE,
       how="bytes are the payload of every MPI call the library made (the pickled object, or the "
           "buffer) as a counting communicator saw it on every rank; rank ≠ 0 is the largest of "
           "the other ranks at each P; growth is the bench's least-squares fit a + b·P (a fitted "
           f"change under {NOISE_BYTES} bytes over the measured range counts as none); at 2,048 "
           "is the fit there, with the trainer's model broadcast swapped for the full model's "
           "(host names are this machine's: the bound allows 64 characters).")
def startup_cost(root: Path) -> str:
    """Bytes each rank receives in each start-up phase, with its calls, fit, 2,048-rank value,
    bound and test: the bench's rows and its own table of bounds."""
    report = load(root, STARTUP_FILE)
    s = report["summary"]
    ps = s["rows"]["comm_init.received"]["P"]
    rows = []
    for phase, label in STARTUP_ROWS:
        side, bound, tests = s["bounds"][phase]
        key = phase.removesuffix("_rank0")
        calls = s["rows"][f"{key}.messages"]["rank0" if side == "rank0" else "other_max"]
        lo, hi = min(calls), max(calls)
        rows.append([f"{label}: bytes received ({lo if lo == hi else f'{lo}–{hi}'} MPI calls)",
                     *_ckpt_row(s["rows"], f"{key}.received", side, "B"), bound, _tests(tests)])
    header = ["what", f"per rank, measured P = {' / '.join(map(str, ps))}", "growth (fit)",
              *(f"at {CKPT_P:,}: {label}" for _, label in CKPT_MODELS), "bound", "held by"]
    m = report["machine"]
    run = (f"`{report['command']}` ({report['measured']}, P = {', '.join(map(str, ps))}, "
           f"{report['runs'][0]['ranks_per_node']} ranks a node). Machine: {m['cores']}-core "
           f"{m['cpu']}, load average {m['load_1_5_15'].split()[0]} at the end.")
    return f"{run}\n\n{md(header, rows, right=9)}"


#: the summary reads what these blocks show, so it names their raw files as its own
SUMMARY_OF = ("allreduce-ratios", "training-step", "step-across-hosts", "loader", "optim-step",
              "bf16-speed", "bf16-accuracy", "convergence", "relaxed-call-site",
              "relaxed-network", "planner-windows", "planner-held-out", "planner-papers",
              "planner-network")
TABLES["summary"] = Table(
    tuple(dict.fromkeys(src for name in SUMMARY_OF for src in TABLES[name].sources)),
    "each figure is its section's table's, computed by the same function (ranges are min–max "
    "over the runs that table lists; 'met' compares with the goal beside it).", summary)
