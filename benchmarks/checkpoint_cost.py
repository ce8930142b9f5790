"""Per-rank cost of a checkpoint write and a resume, measured at several rank counts and
extrapolated to 2,048 ranks for ResNet-50 and AlexNet-BN (docs/scaling.md).

    python3 benchmarks/checkpoint_cost.py --ranks 2 4 8 16 \
        --json docs/results/checkpoint-cost-2026-12-02.json

For each P it launches ``mpiexec -n P`` (oversubscribed is fine: nothing here is timed) of
this script in worker mode: the tiny model (resnet_small, width 4) on tiny synthetic shards,
one training step, then the run's final checkpoint write and a resume by a new trainer, each
measured on every rank:

- bytes read and written: ``/proc/self/io`` (``rchar``/``wchar``: bytes passed to read() and
  write(), page cache or not; ``syscr``/``syscw``: the calls), before and after;
- MPI messages: every call the trainer makes on its ``mpi_comm`` (counted by a forwarding
  wrapper; payload bytes: the pickled object of the lower-case calls, the buffer of the
  upper-case ones);
- files: the checkpoint directory's entries.

Then, per quantity, a least-squares fit ``a + b*P`` over the measured P for rank 0 and for
the other ranks (the largest of them), and the value at 2,048 ranks for ResNet-50 and
AlexNet-BN: the model-sized terms (``model.pt``: parameters, momentum and BN means; a rank
file's BN statistics) are replaced by the real model's, counted on the meta device; the rest
(RNG states, manifest records, pickling) is the fit, evaluated at P = 2,048.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time

from hpcdl.figures.growth import fit

MODELS = ("resnet50", "alexnet_bn")
TARGET_P = 2048
IO_FIELDS = ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes")


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f) if k in IO_FIELDS}


class CountingComm:
    """Forwards to an mpi4py communicator, counting each call and its payload bytes."""

    COUNTED = ("bcast", "gather", "scatter", "allgather", "Bcast", "Allreduce", "Barrier")

    def __init__(self, inner) -> None:
        self._inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self.COUNTED:
            return attr

        def counted(*args, **kw):
            result = attr(*args, **kw)
            self.calls.append((name, self._payload(name, args, result)))
            return result
        return counted

    def _payload(self, name: str, args: tuple, result) -> int:
        if name in ("Bcast", "Allreduce"):
            buf = args[0][0] if isinstance(args[0], list) else args[0]
            return memoryview(buf).nbytes
        if name == "Barrier":
            return 0
        if name == "gather" and result is not None:  # the root: what it received
            return sum(len(pickle.dumps(x, protocol=5)) for x in result)
        return len(pickle.dumps(result if name != "gather" else args[0], protocol=5))


def measured(comm: CountingComm, fn):
    comm.calls.clear()
    before = io_counters()
    out = fn()
    after = io_counters()
    return out, {"io": {k: after[k] - before[k] for k in IO_FIELDS},
                 "messages": len(comm.calls), "message_bytes": sum(b for _, b in comm.calls),
                 "calls": [name for name, _ in comm.calls]}


def worker(shards: str, run_dir: str, out: str) -> None:
    import hpcdl.comm
    from hpcdl.train import checkpoint as ckpt
    from hpcdl.train.config import config_from_dict
    from hpcdl.train.trainer import Trainer, TrainOptions

    comm = hpcdl.comm.init("mpi")
    counting = CountingComm(comm.mpi_comm)
    comm.mpi_comm = counting
    config = config_from_dict({
        "name": "tiny", "model": {"name": "resnet_small", "num_classes": 3, "width": 4,
                                  "layers": [1, 1, 1]},
        "data": {"image_size": 16, "workers": 1}, "batch": {"global": comm.size,
                                                            "per_rank": 1},
        "epochs": 1, "optimizer": {"name": "lars", "momentum": 0.9},
        "schedule": {"name": "poly", "base_lr": 0.1}, "train": {"seed": 1},
        "comm": {"backend": "mpi"}})
    options = TrainOptions(max_steps=1, evaluate=False, progress=False)
    trainer = Trainer(config, shards, run_dir, comm, options=options)
    trainer.resume("none")
    records = {}
    save = trainer.save_checkpoint

    def measured_save():
        path, records["write"] = measured(counting, save)
        return path
    trainer.save_checkpoint = measured_save
    trainer.train()
    trainer.close()
    layout, records["resume_layout"] = measured(
        counting, lambda: ckpt.resume_layout("auto", run_dir, counting))
    again = Trainer(config, shards, run_dir, comm, options=options, resume_layout=layout)
    _, records["resume"] = measured(counting, lambda: again.resume("auto"))
    again.close()
    gathered = comm.mpi_comm._inner.gather(records, root=0)
    if comm.rank == 0:
        path = ckpt.checkpoint_path(run_dir, 1)
        manifest = ckpt.read_manifest(path)
        with open(out, "w") as f:
            json.dump({"ranks": comm.size, "per_rank": gathered,
                       "files_in_checkpoint": len(os.listdir(path)),
                       "file_bytes": {n: r["bytes"] for n, r in manifest["files"].items()},
                       "manifest_bytes": os.path.getsize(os.path.join(path, ckpt.MANIFEST))},
                      f)
    comm.close()


def model_terms(name: str) -> dict[str, int]:
    """Bytes of ``model.pt``'s tensors (parameters, LARS momentum, BN means) and of one rank
    file's BN statistics, for a full-size model (float32, counted on the meta device)."""
    import torch

    from hpcdl.models import create_model

    with torch.device("meta"):
        model = create_model(name)
    params = sum(p.numel() for p in model.parameters())
    float_buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    return {"parameters": params, "float_buffers": float_buffers,
            "model_pt": 4 * (2 * params + float_buffers), "rank_buffers": 4 * float_buffers}


def summarize(runs: list[dict]) -> dict:
    """Per phase and quantity: rank 0 and the largest other rank at each P, the fit, and the
    value at 2,048 ranks for each full-size model."""
    ps = [r["ranks"] for r in runs]
    tiny = runs[0]
    tiny_model = tiny["file_bytes"]["model.pt"]
    tiny_rank = tiny["file_bytes"]["rank-00001.pt"]
    tiny_buffers = 4 * _tiny_float_buffers()
    models = {m: model_terms(m) for m in MODELS}
    rows = {}
    for phase in ("write", "resume", "resume_layout"):
        for quantity in ("rchar", "wchar", "messages", "message_bytes"):
            def value(rec, q=quantity, ph=phase):
                return rec[ph]["io"][q] if q in IO_FIELDS else rec[ph][q]
            root = [value(r["per_rank"][0]) for r in runs]
            other = [max(value(x) for x in r["per_rank"][1:]) for r in runs]
            total = [sum(value(x) for x in r["per_rank"]) for r in runs]
            row = {"P": ps, "rank0": root, "other_max": other, "total": total,
                   "fit_rank0": fit(ps, root), "fit_other": fit(ps, other)}
            row["at_2048"] = {m: _extrapolate(phase, quantity, row, t, tiny_model, tiny_rank,
                                              tiny_buffers) for m, t in models.items()}
            rows[f"{phase}.{quantity}"] = row
    files = {"P": ps, "files_in_checkpoint": [r["files_in_checkpoint"] for r in runs],
             "per_rank_written": "rank 0: model.pt, its rank file, manifest.json; others: 1"}
    return {"rows": rows, "files": files, "models": models,
            "tiny": {"model_pt": tiny_model, "rank_file": tiny_rank,
                     "manifest": [r["manifest_bytes"] for r in runs]}}


def _tiny_float_buffers() -> int:
    from hpcdl.models import create_model

    model = create_model("resnet_small", num_classes=3, width=4, layers=[1, 1, 1])
    return sum(b.numel() for b in model.buffers() if b.is_floating_point())


def _extrapolate(phase: str, quantity: str, row: dict, model: dict, tiny_model: int,
                 tiny_rank: int, tiny_buffers: int) -> dict[str, float]:
    """The fit at 2,048 ranks with the tiny model's sized terms swapped for ``model``'s:
    ``model.pt`` where rank 0 reads or writes it (and in the resume's broadcast), the BN
    statistics in each rank file (and in the write's float64 BN allreduce)."""
    grow_rank = model["rank_buffers"] - tiny_buffers
    grow_model = model["model_pt"] - tiny_model
    a0, b0 = row["fit_rank0"]
    a1, b1 = row["fit_other"]
    root, other = a0 + b0 * TARGET_P, a1 + b1 * TARGET_P
    if (phase, quantity) in (("write", "wchar"), ("resume", "rchar")):
        root, other = root + grow_model + grow_rank, other + grow_rank
    elif (phase, quantity) == ("resume", "message_bytes"):
        root, other = root + grow_model, other + grow_model
    elif (phase, quantity) == ("write", "message_bytes"):
        root, other = root + 2 * grow_rank, other + 2 * grow_rank  # float64 BN allreduce
    return {"rank0": root, "other": other, "total": root + other * (TARGET_P - 1)}


def machine() -> dict[str, str]:
    import torch

    from hpcdl.cpus import cpu_capability, cpu_model_name

    load = os.getloadavg()
    return {"cpu": cpu_model_name(fallback=""), "cores": str(os.cpu_count()),
            "torch": torch.__version__, "capability": cpu_capability(),
            "python": platform.python_version(), "load_1_5_15": " ".join(f"{x:.1f}" for x in load),
            "note": "shared development VM (2 cores, other agents' jobs running): the bytes "
                    "and message counts do not depend on load; nothing here is timed"}


def write_report(script: str, ranks: list[int], started: str, runs: list[dict],
                 summary: dict, path: str | None) -> dict:
    """The raw file's record: the command, when, the machine, every run and the summary;
    written to ``path`` when given."""
    report = {"command": f"python3 benchmarks/{script} --ranks " + " ".join(map(str, ranks)),
              "measured": started, "machine": machine(), "runs": runs, "summary": summary}
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--json", required=False)
    parser.add_argument("--worker", nargs=3, metavar=("SHARDS", "RUN_DIR", "OUT"))
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    from hpcdl.data_prep.shard import shard_tree
    from hpcdl.data_prep.synthetic import make_imagenet_tree

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        make_imagenet_tree(os.path.join(tmp, "tree"), num_classes=3, train_per_class=16,
                           val_per_class=2, size=(24, 20))
        shard_tree(os.path.join(tmp, "tree"), os.path.join(tmp, "shards"), shards=2, resize=20)
        runs = []
        for p in args.ranks:
            out = os.path.join(tmp, f"p{p}.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "600"}
            subprocess.run(["mpiexec", "-n", str(p), sys.executable, os.path.abspath(__file__),
                            "--worker", os.path.join(tmp, "shards"),
                            os.path.join(tmp, f"run{p}"), out], env=env, check=True)
            with open(out) as f:
                runs.append(json.load(f))
    report = write_report(os.path.basename(__file__), args.ranks, started, runs,
                          summarize(runs), args.json)
    for key, row in report["summary"]["rows"].items():
        print(f"{key:30s} rank0 {row['rank0']} other {row['other_max']} "
              f"fit0 {row['fit_rank0'][1]:+.1f}/P fit1 {row['fit_other'][1]:+.1f}/P "
              f"2048 R50 {row['at_2048']['resnet50']['rank0']:.3g}/"
              f"{row['at_2048']['resnet50']['other']:.3g}")


if __name__ == "__main__":
    main()
