"""One builder per measured table of the docs: read the raw JSON under ``docs/results/``,
return the Markdown table. Each declares its sources (the files it reads, linked from the
block's marker) and how its ratios are computed (printed under the table).

Rounding is the only liberty a builder takes; every number in a table is a field of a raw
file or an arithmetic of fields stated in ``how``.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = "docs/results"
SAME_RUN = ("ratios between modes of one run are computed per run, then the median "
            "[min–max] over runs")
SEPARATE_RUNS = "quantities from separate runs are compared as the ratio of their medians"


@dataclass(frozen=True)
class Table:
    sources: tuple[str, ...]
    how: str
    build: Callable[[Path], str]


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
    return f"{f(statistics.median(values), nd)} [{f(min(values), nd)}–{f(max(values), nd)}]"


# ---- allreduce -------------------------------------------------------------------------

ALLREDUCE_FILES = {2: ("allreduce-p2-2026-12-01.json", "allreduce-sites-np2-quiet-2026-12-01.json"),
                   4: ("allreduce-p4-2026-12-01.json", "allreduce-sites-np4-quiet-2026-12-01.json")}
SIZES = (1_000_000, 16_000_000, 100_000_000)
SITE_NAMES = {"impi": "Intel MPI 2021.13", "ompi": "Open MPI 5", "mpich": "MPICH 5.0.2"}


def _busbw(records: Sequence[Mapping[str, Any]], backend: str, tuning: str | None = None
           ) -> dict[int, float]:
    return {r["bytes"]: r["busbw_GBps"] for r in records
            if r["backend"] == backend and r.get("tuning") == tuning}


def _best_tuning(records: Sequence[Mapping[str, Any]], backend: str) -> str:
    """The site MPI's tuning with the highest busbw at 100 MB (the bench's own pick)."""
    at_100 = [r for r in records if r["backend"] == backend and r["bytes"] == SIZES[-1]]
    return max(at_100, key=lambda r: r["busbw_GBps"])["tuning"]


def allreduce_busbw(root: Path) -> str:
    rows: dict[str, list[str]] = {}
    labels = {"default": "hpcdl `default` (= `shm`)",
              "shm": "hpcdl `shm` (same backend, measured again)", "ring": "hpcdl `ring`",
              "mpi": "MPICH `MPI_Allreduce` (mpi4py, this env)", "gloo": "gloo"}
    tunings: dict[str, list[str]] = {}
    for p in (2, 4):
        own = load(root, ALLREDUCE_FILES[p][0])["results"]
        sites = load(root, ALLREDUCE_FILES[p][1])["results"]
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


RATIO_ROWS = (("default_vs_mpi_busbw_100MB", "≥ 3"), ("default_vs_gloo_busbw_100MB", "≥ 5"),
              ("ring_vs_mpi_busbw_16MB", "≥ 0.9"), ("default_vs_impi_busbw_100MB", "—"),
              ("default_vs_ompi_busbw_100MB", "—"), ("default_vs_mpich_busbw_100MB", "—"),
              ("default_vs_memcpy_100MB", "share of one core's `copy_` rate kept"))


def allreduce_ratios(root: Path) -> str:
    rows = []
    for name, goal in RATIO_ROWS:
        cells = []
        for p in (2, 4):
            own = load(root, ALLREDUCE_FILES[p][0])["ratios"].get(name)
            site = load(root, ALLREDUCE_FILES[p][1])["ratios"][name]
            cells.append(f(site) if own is None else f"{f(own)} ({f(site)})")
        rows.append([f"`{name}`", *cells, goal])
    return md(["ratio", "P = 2: backends run (site run)", "P = 4: backends run (site run)",
               "goal"], rows, right=1)


# ---- training step ---------------------------------------------------------------------

STEP_DIR = "shard-update-quiet-2026-12-01"
STEP_MODELS = (("alexnet_bn-224-b32-np2", "AlexNet-BN 224 px, 32", 1.10),
               ("resnet50-112-b16-np2", "ResNet-50 112 px, 16", 1.05))


def _step_runs(root: Path, prefix: str) -> list[dict[str, float]]:
    """images/s per rank of each mode, one dict per run."""
    runs = []
    for path in sorted((root / RESULTS / STEP_DIR).glob(f"{prefix}-run*.json")):
        report = json.loads(path.read_text())
        runs.append({r["mode"]: r["images_per_s_per_rank"] for r in report["results"]})
    return runs


def training_step(root: Path) -> str:
    rows = []
    for prefix, label, goal in STEP_MODELS:
        runs = _step_runs(root, prefix)

        def med(mode: str, runs: list[dict[str, float]] = runs) -> str:
            return f(statistics.median(r[mode] for r in runs))

        def ratio(a: str, b: str, runs: list[dict[str, float]] = runs) -> list[float]:
            return [r[a] / r[b] for r in runs]

        ddp_ceiling = ratio("ddp_gloo", "no_comm")
        rows.append([f"{label} ({len(runs)} runs)", med("ours_allreduce"), med("no_comm"),
                     med("ddp_gloo"), spread(ratio("ours_allreduce", "no_comm")),
                     spread(ratio("ours_allreduce", "ddp_gloo")), spread(ddp_ceiling),
                     f"{goal:.2f}× → {f(goal * statistics.median(ddp_ceiling), 3)}",
                     spread(ratio("ours", "ours_allreduce"))])
    header = ["model, per-rank batch, 2 ranks", "default step img/s", "no_comm", "ddp_gloo",
              "default ÷ no_comm", "default ÷ ddp_gloo", "ddp_gloo ÷ no_comm",
              "DDP goal needs (÷ ceiling)", "sharded ÷ default"]
    return md(header, rows)


BUCKET_DIR = "bucket-size-alexnet-2026-12-01"


def bucket_size(root: Path) -> str:
    rows = []
    for mb in (6, 25, 160):
        paths = sorted((root / RESULTS / BUCKET_DIR).glob(f"b{mb}-*.json"))
        reports = [json.loads(p.read_text()) for p in paths]
        ratios = [r["ratios"]["vs_no_comm"] for r in reports]
        rates = [r["ratios"]["images_per_s_per_rank"] for r in reports]
        rows.append([f"{mb} MB", " / ".join(f(x) for x in rates),
                     " / ".join(f(x, 3) for x in ratios)])
    return md(["bucket", "img/s per rank, run 1 / 2", "÷ no_comm, run 1 / 2"], rows)


# ---- loader, optimizer, bf16 -----------------------------------------------------------

LOADER_FILE = "loader-fair-baselines-2026-12-01.json"
LOADER_SIDES = (("imagefolder_pillow", "torchvision ImageFolder way, full 500×375 JPEGs"),
                ("imagefolder_pillow_resized", "the same pre-resized JPEGs as files"),
                ("webdataset_pil_resized", "the same JPEGs in WebDataset tar shards"),
                ("hdf5_sharded", "hpcdl: `ShardedImageNet` + `normalize`"),
                ("simplejpeg_decode_only", "decoding alone: the floor"))


def loader(root: Path) -> str:
    report = load(root, LOADER_FILE)
    rate = {r["name"]: r["images_per_s_per_core"] for r in report["results"]}
    rows = [[f"`{name}` ({what})", f"{rate[name]:,.0f}"] for name, what in LOADER_SIDES]
    table = md(["side", "img/s per core"], rows)
    ratios = ", ".join(f"`{k}` {f(v)}" for k, v in report["ratios"].items())
    return f"{table}\n\n{ratios}"


OPTIM_FILE = "optim-lars-resnet50-2026-12-02.json"


def optim_step(root: Path) -> str:
    report = load(root, OPTIM_FILE)
    ms = {r["optimizer"]: r["median_ms"] for r in report["results"]}
    ratio = report["ratios"]["lars_vs_sgd_step_time"]
    return md(["SGD foreach", "LARS", "`lars_vs_sgd_step_time`", "goal"],
              [[f"{f(ms['sgd_foreach'], 1)} ms", f"{f(ms['lars'], 1)} ms", f"**{f(ratio)}**",
                "≤ 1.5: " + ("met" if ratio <= 1.5 else "not met")]], right=0)


BF16_SPEED_DIR = "bf16-speed-2026-12-01"


def _bf16_runs(root: Path, precision: str) -> list[dict[str, float]]:
    out = []
    for path in sorted((root / RESULTS / BF16_SPEED_DIR).glob(f"resnet50-{precision}-*.json")):
        record = json.loads(path.read_text())["results"][0]
        out.append({"step": record["step_time_s"], "cpu": record["cpu_s_per_step"]})
    return out


def bf16_speed(root: Path) -> str:
    fp32, bf16 = _bf16_runs(root, "fp32"), _bf16_runs(root, "bf16")
    rows = [[f"{name} {' / '.join(str(i + 1) for i in range(len(runs)))}",
             " / ".join(f(r["step"]) for r in runs), " / ".join(f(r["cpu"]) for r in runs)]
            for name, runs in (("fp32", fp32), ("bf16", bf16))]
    cpu = statistics.median(r["cpu"] for r in bf16) / statistics.median(r["cpu"] for r in fp32)
    rows.append(["bf16 ÷ fp32 (ratio of medians)", "—", f"**{f(cpu, 3)}** (≈ {f(1 / cpu, 1)}×)"])
    return md(["run", "step (s, wall, loaded)", "CPU s per step"], rows, right=9)


BF16_ACC_DIR = "bf16-convergence-2026-12-01"


def bf16_accuracy(root: Path) -> str:
    rows, fp32, bf16 = [], [], []
    for path in sorted((root / RESULTS / BF16_ACC_DIR).glob("seed*.json")):
        top1 = {r["run"]: r["top1"] * 100 for r in json.loads(path.read_text())["results"]}
        fp32.append(top1["lars"])
        bf16.append(top1["lars_bf16"])
        rows.append([path.stem.removeprefix("seed"), f(top1["lars"]), f(top1["lars_bf16"]),
                     signed(top1["lars_bf16"] - top1["lars"])])
    diff = statistics.mean(bf16) - statistics.mean(fp32)
    rows.append(["mean", f(statistics.mean(fp32)), f(statistics.mean(bf16)),
                 f"**{signed(diff)}** (goal ≥ −0.3: {'met' if diff >= -0.3 else 'not met'})"])
    return md(["seed", "fp32 top-1", "bf16 (emulated) top-1", "bf16 − fp32"], rows, right=0)


# ---- convergence -----------------------------------------------------------------------

SAME_DECAY = "convergence-study-same-decay-2026-12-01.json"
OTHER_DECAY = "convergence-study-extended.json"


def _by_batch(report: Mapping[str, Any], optimizer: str) -> dict[int, Mapping[str, Any]]:
    return {r["global_batch"]: r for r in report["results"] if r["optimizer"] == optimizer}


def _final(r: Mapping[str, Any]) -> str:
    pct = {k: r[k] * 100 for k in ("top1_mean", "top1_std", "top1_min", "top1_max")}
    edge = ", edge" if r.get("at_edge") else ""
    tuned = f"; {r['tuned_lrs']}" if "tuned_lrs" in r else ""
    return (f"{f(pct['top1_mean'])} ± {f(pct['top1_std'])} [{f(pct['top1_min'])}–"
            f"{f(pct['top1_max'])}] ({r['lr']:.3g}{edge}{tuned})")


def convergence(root: Path) -> str:
    same = load(root, SAME_DECAY)
    lars, sgd = _by_batch(same, "lars"), _by_batch(same, "sgd")
    other = _by_batch(load(root, OTHER_DECAY), "sgd")
    rows = []
    for batch in sorted(lars):
        a, b, c = (lars[batch]["top1_mean"] * 100, sgd[batch]["top1_mean"] * 100,
                   other[batch]["top1_mean"] * 100)
        rows.append([f"{batch:,}", _final(lars[batch]), _final(sgd[batch]), f"**{signed(a - b)}**",
                     f"{f(c)} ({other[batch]['lr']:.3g})",
                     f"{f(sgd[batch]['holdout_top1'] * 100)} / "
                     f"{f(other[batch]['holdout_top1'] * 100)}",
                     signed(a - max(b, c))])
    header = ["batch", "LARS", "SGD, same decay policy", "LARS − SGD",
              "SGD decaying BN and biases too", "SGD holdout: same / other policy",
              "LARS − SGD's better final"]
    return md(header, rows)


# ---- relaxed consistency ---------------------------------------------------------------

RELAXED_FILES = {"seeds": "relaxed-seeds-2026-12-01.json",
                 "hier": "relaxed-hierarchical-seeds-2026-12-01.json",
                 "r4a": "relaxed-r4-seeds01-2026-12-01.json",
                 "r4b": "relaxed-r4-seed2-2026-12-01.json"}
RELAXED_ROWS = (("sync", "seeds", "`sync` (hpcdl)"),
                ("hierarchical", "hier", "`hierarchical` H = 8, 2 × 2"),
                ("powersgd", "seeds", "`powersgd` r = 2 (hpcdl)"),
                ("ddp_powersgd", "seeds", "`ddp_powersgd` r = 2 (PyTorch)"),
                ("powersgd", "r4", "`powersgd` r = 4 (hpcdl)"),
                ("ddp_powersgd", "r4", "`ddp_powersgd` r = 4 (PyTorch)"),
                ("ddp_sync", "seeds", "`ddp_sync` (PyTorch's own loop)"))


def _relaxed_records(root: Path, key: str) -> list[Mapping[str, Any]]:
    if key == "r4":
        return [*load(root, RELAXED_FILES["r4a"])["results"],
                *load(root, RELAXED_FILES["r4b"])["results"]]
    return load(root, RELAXED_FILES[key])["results"]


def relaxed_call_site(root: Path) -> str:
    sync_top1 = [r["top1"] * 100 for r in _relaxed_records(root, "seeds")
                 if r["run"] == "sync" and r["seed"] != "mean"]
    sync_bytes = 37_353_888
    rows = []
    for run, key, label in RELAXED_ROWS:
        seeds = sorted((r for r in _relaxed_records(root, key)
                        if r["run"] == run and r["seed"] != "mean"), key=lambda r: r["seed"])
        top1 = [r["top1"] * 100 for r in seeds]
        world, node = seeds[0]["bytes_per_rank"], seeds[0]["bytes_node_per_rank"]
        delta = statistics.mean(top1) - statistics.mean(sync_top1)
        across = sync_bytes / world
        rows.append([label, ", ".join(f(t) for t in top1),
                     f"{f(statistics.mean(top1))} ± {f(statistics.stdev(top1))}",
                     "—" if run == "sync" else signed(delta),
                     f"{world / 1e6:.1f}" + (f" + {node / 1e6:.1f}" if node else ""),
                     f"{f(across)}×" + (f" ({f(sync_bytes / (world + node))}× counting both)"
                                         if node else "")])
    header = ["run", "top-1 seeds 0, 1, 2 (%)", "mean ± sd", "Δ vs `sync` (points)",
              "MB per rank at the call site: across nodes (+ inside a node)",
              "sync's 37.4 MB ÷ this"]
    return md(header, rows, right=3)


NETWORK_DIR = "relaxed-network-bytes-2026-12-01"


def relaxed_network(root: Path) -> str:
    base = root / RESULTS / NETWORK_DIR
    tx = {}
    for line in (base / "eth0-bytes.jsonl").read_text().splitlines():
        row = json.loads(line)
        tx[row["run"]] = (row["h1"]["tx"], row["h2"]["tx"])
    rows = []
    for run in ("sync", "hierarchical", "ddp_sync"):
        top1 = json.loads((base / f"relaxed-{run}.json").read_text())["results"][0]["top1"] * 100
        h1, h2 = tx[run]
        s1, s2 = tx["sync"]
        rows.append([f"`{run}`", f"{h1 / 1e6:.1f} / {h2 / 1e6:.1f}",
                     f"{f(s1 / h1)} / {f(s2 / h2)}", f(sum(tx['sync']) / (h1 + h2)),
                     f"{f(tx['ddp_sync'][0] / h1)} / {f(tx['ddp_sync'][1] / h2)}",
                     f(sum(tx['ddp_sync']) / (h1 + h2)), f(top1)])
    header = ["run (2 hosts × 2 ranks)", "MB out of h1 / h2", "sync ÷ this, per host h1 / h2",
              "in total", "ddp_sync ÷ this, per host", "in total", "top-1 (seed 0)"]
    return md(header, rows)


# ---- planner, demo ---------------------------------------------------------------------

WINDOWS = ("plan-gemm-rows-2026-12-01/window2/plan-validate-quiet-2026-12-01.json",
           "plan-gemm-rows-2026-12-01/window1/plan-validate-quiet-2026-12-01.json")
HELD_OUT = "plan-held-out-2026-12-01/plan-validate-2026-12-01.json"
MODEL_NAMES = {"alexnet_bn": "AlexNet-BN", "resnet50": "ResNet-50",
               "alexnet_bvlc": "Caffe's AlexNet (LRN, grouped conv)"}


def _ratio(ratio: float) -> str:
    """Two decimals, three when outside 0.85–1.15 (so 1.153 does not read as 1.15), ✗ then."""
    return f(ratio) if 0.85 <= ratio <= 1.15 else f"{f(ratio, 3)} ✗"


def planner_windows(root: Path) -> str:
    w2, w1 = (load(root, p)["results"] for p in WINDOWS)
    rows = []
    for a, b in zip(w2, w1, strict=True):
        r2 = a["predicted_step_s"] / a["measured_step_s"]
        r1 = b["predicted_step_s"] / b["measured_step_s"]
        rows.append([f"{MODEL_NAMES[a['model']]} {a['image_size']} px", a["ranks"],
                     f"{a['predicted_step_s']:.3f} / {a['measured_step_s']:.3f} s",
                     _ratio(r2), _ratio(r1)])
    inside = [sum(0.85 <= r["predicted_step_s"] / r["measured_step_s"] <= 1.15 for r in w)
              for w in (w2, w1)]
    table = md(["workload", "np", "window 2: predicted / measured step", "ratio",
                "window 1: ratio"], rows)
    return (f"{table}\n\nInside 0.85–1.15: window 2 {inside[0]} of {len(w2)}, "
            f"window 1 {inside[1]} of {len(w1)}.")


def planner_held_out(root: Path) -> str:
    records = load(root, HELD_OUT)["results"]
    rows: dict[str, list[str]] = {}
    for r in records:
        ratio = r["predicted_step_s"] / r["measured_step_s"]
        label = f"{MODEL_NAMES[r['model']]} {r['image_size']} px: predicted / measured"
        rows.setdefault(label, []).append(
            f"{r['predicted_step_s']:.3f} / {r['measured_step_s']:.3f} s = {_ratio(ratio)}")
    inside = sum(0.85 <= r["predicted_step_s"] / r["measured_step_s"] <= 1.15 for r in records)
    table = md(["workload", "np 1", "np 2", "np 4"], [[k, *v] for k, v in rows.items()])
    return f"{table}\n\nInside 0.85–1.15: {inside} of {len(records)}."


DEMO_SEEDS = "demo-seed-spread-2026-12-01.json"
DEMO_TIME = "demo-time-2026-12-02.json"


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


TABLES: dict[str, Table] = {
    "allreduce-busbw": Table(
        tuple(f"{RESULTS}/{n}" for p in (2, 4) for n in ALLREDUCE_FILES[p]),
        "busbw as each JSON records it (nccl-tests definition, median of 7 timed calls, "
        "slowest rank); a site MPI's 'best' is its tuning with the highest busbw at 100 MB "
        "in that run, all three sizes from that tuning.", allreduce_busbw),
    "allreduce-ratios": Table(
        tuple(f"{RESULTS}/{n}" for p in (2, 4) for n in ALLREDUCE_FILES[p]),
        "each ratio is the bench's own, hpcdl's busbw over the baseline's in the same run; "
        "the site run's value in brackets.", allreduce_ratios),
    "training-step": Table(
        (f"{RESULTS}/{STEP_DIR}/",),
        f"img/s per rank: median over runs; {SAME_RUN}; the DDP goal's need is goal × the "
        "median of ddp_gloo ÷ no_comm.", training_step),
    "bucket-size": Table(
        (f"{RESULTS}/{BUCKET_DIR}/",),
        "÷ no_comm is each run's own ratio (both modes in one run); runs listed, not "
        "summarised (two per size).", bucket_size),
    "loader": Table((f"{RESULTS}/{LOADER_FILE}",),
                    "images per CPU-second of the process; ratios are the bench's own, "
                    "within the one run.", loader),
    "optim-step": Table((f"{RESULTS}/{OPTIM_FILE}",),
                        "median step of each optimizer in one run; the ratio is the bench's "
                        "own (LARS ÷ SGD).", optim_step),
    "bf16-speed": Table((f"{RESULTS}/{BF16_SPEED_DIR}/",),
                        f"fp32 and bf16 ran as separate runs: {SEPARATE_RUNS} (median CPU s "
                        "per step).", bf16_speed),
    "bf16-accuracy": Table((f"{RESULTS}/{BF16_ACC_DIR}/",),
                           "top-1 of each seed's two runs; the mean row is the mean over "
                           "seeds of each, then their difference.", bf16_accuracy),
    "convergence": Table(
        (f"{RESULTS}/{SAME_DECAY}", f"{RESULTS}/{OTHER_DECAY}"),
        "test top-1 mean ± sd [min–max] over 3 seeds (chosen lr; lrs tuned); differences "
        "of means; 'better final' is the higher of the two SGD policies' test means; "
        "holdout is the tuning score of the chosen lr (one run on the holdout split).",
        convergence),
    "relaxed-call-site": Table(
        tuple(f"{RESULTS}/{n}" for n in RELAXED_FILES.values()),
        "top-1 mean and sample sd over seeds, Δ against sync's mean; bytes each rank passed "
        "to allreduce at the call site, sync's over this run's.", relaxed_call_site),
    "relaxed-network": Table(
        (f"{RESULTS}/{NETWORK_DIR}/",),
        "bytes each host's eth0 sent over the run; per host = each host's sync (or ddp_sync) "
        "bytes over its own bytes in this run; in total = both hosts summed on each side.",
        relaxed_network),
    "planner-windows": Table(tuple(f"{RESULTS}/{p}" for p in WINDOWS),
                             "ratio = predicted ÷ median measured step of the repeats.",
                             planner_windows),
    "planner-held-out": Table((f"{RESULTS}/{HELD_OUT}",),
                              "ratio = predicted ÷ median measured step of the repeats.",
                              planner_held_out),
    "demo": Table((f"{RESULTS}/{DEMO_SEEDS}", f"{RESULTS}/{DEMO_TIME}"),
                  "top-1 on the 1,000 held-out images at the last epoch; wall = the timed "
                  "run's summary.json.", demo),
}
