"""Per-rank cost of what a job exchanges once at start-up -- the communicator's creation, the
compute threads, the stall watchdog's host list, the trainer's start, ``hpcdl doctor`` and
LTFB's start -- measured at several rank counts and extrapolated to 2,048 ranks
(docs/scaling.md).

    python3 benchmarks/startup_cost.py --ranks 2 4 8 16 32 \\
        --json docs/results/startup-cost-2026-12-02.json

For each P it launches ``mpiexec -n P`` of this script in worker mode, with
``HPCDL_RANKS_PER_NODE=2`` (two ranks a node, as the skx template runs, so the multi-node paths
run on one host). Every MPI call the library makes is counted on every rank by a forwarding
subclass of mpi4py's ``Intracomm`` handed in as the world: each call forwards to mpi4py and
records its name, its caller (``module:function``) and its payload -- the pickled object of
the lower-case calls (sent: this rank's; received: what the call returned to it), the buffer of
the upper-case ones; communicators made from it (``Dup``, ``Split``, ``Split_type``,
``Create``) are counted the same way. MPI's own traffic inside a call (the allgather of
``MPI_Comm_split``, the process manager's) is not counted.

Then, per phase and quantity, a least-squares fit ``a + b*P`` (hpcdl/figures/growth.py) for
rank 0 and for the largest other rank, and the value at 2,048 ranks; the trainer's start also
broadcasts the model, whose bytes are swapped for ResNet-50's and AlexNet-BN's there.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

from checkpoint_cost import TARGET_P, model_terms, write_report

from hpcdl.figures.growth import fit

MODELS = ("resnet50", "alexnet_bn")
RANKS_PER_NODE = 2
LOWER = ("bcast", "gather", "scatter", "allgather", "allreduce", "alltoall", "reduce", "scan",
         "exscan", "isend", "send", "irecv", "recv")
UPPER = ("Bcast", "Allreduce", "Allgather", "Allgatherv", "Gather", "Gatherv", "Scatter",
         "Scatterv", "Reduce", "Reduce_scatter_block", "Alltoall", "Exscan", "Scan", "Iallreduce",
         "Ibcast", "Iallgatherv", "Send", "Recv", "Isend", "Irecv", "Sendrecv")
EMPTY = ("Barrier", "Ibarrier")
MADE = ("Dup", "Split", "Split_type", "Create", "Create_group")
PHASES = ("comm_init", "threads", "watchdog", "trainer", "doctor", "ltfb")
#: The most a hostname record of an allgather can cost, pickled: a host name (at most 64
#: characters, HOST_NAME_MAX) and pickle's framing.
HOST_RECORD_B = 128
#: The call sites whose bytes are O(P) by nature, with the most each may cost per rank of P
#: (on the rank that pays most). Every other call site at start-up must not grow with P.
BY_NATURE = {
    "hpcdl/debug/monitor.py:watch_collectives (allgather)": HOST_RECORD_B,  # every rank's host
    "hpcdl/train/ltfb.py:LTFB.__init__ (allgather)": HOST_RECORD_B,  # every rank's host
    # the ranks of one machine (their CPU lists); on this one host that is every rank
    "hpcdl/train/threads.py:configure_threads (allgather)": 64,
    "hpcdl/debug/doctor.py:collect_rank_info (allgather)": 64,
    "hpcdl/cli/doctor.py:check_world (gather)": 2048,  # rank 0: every rank's findings
    "hpcdl/debug/hosts.py:reach_problems (isend)": 32,  # rank 0 answers every rank once
}
#: Each phase's row in docs/scaling.md: the rank it is about, its bound, the test holding it.
TEST = "tests/test_startup_cost.py::"
SAME = TEST + "test_what_a_rank_exchanges_to_start_does_not_grow_with_the_rank_count"
BOUNDED = TEST + "test_what_grows_with_the_rank_count_stays_under_its_bound"
BOTH = (SAME, BOUNDED)
BOUNDS = {
    "comm_init": ("other", f"≤ {HOST_RECORD_B} B × P, once (every rank's host, so a stall "
                  "report names hosts from memory) + constant: the node split, one allreduce "
                  "of the node sizes (was: every rank's node size)", BOTH),
    "threads": ("other", "≤ 64 B × the ranks of one machine (their CPU lists; here every rank "
                "shares the one machine, so it shows as P)", (BOUNDED,)),
    "watchdog": ("other", "none: reuses the hosts `hpcdl.comm.init` gathered (was: gathered "
                 "again)", (SAME,)),
    "trainer": ("other", "the model (its broadcast) + constant: loaders agreed by one flag, "
                "replicas checked against rank 0's hash, signature checks by one allreduce "
                "(was: every rank's flag, hash and signature to every rank)", (SAME,)),
    "doctor": ("other", "≤ 64 B × the ranks of one machine (CPU lists) + constant (was: the "
               "host list from rank 0 and every rank's node leader)", BOTH),
    "doctor_rank0": ("rank0", "≤ 2 KB × P, once (every rank's findings: the doctor's table)",
                     (BOUNDED,)),
    "ltfb": ("other", f"its trainer's start + ≤ {HOST_RECORD_B} B × P, once (every rank's "
             "host, for stall messages naming a partner trainer's hosts)", BOTH),
}


def _pickled(obj) -> int:
    return len(pickle.dumps(obj, protocol=5))


def _nbytes(spec) -> int:
    """Bytes of an mpi4py buffer specification ([buf, type], [buf, counts, type], buf)."""
    if isinstance(spec, (list, tuple)):
        spec = spec[0] if spec else None
    try:
        return memoryview(spec).nbytes
    except TypeError:  # MPI.IN_PLACE, None
        return 0


def _lower_payload(name: str, args: tuple, kw: dict, result, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of a pickled call on this rank."""
    obj = args[0] if args else kw.get("obj", kw.get("sendobj"))
    root = kw.get("root", args[1] if len(args) > 1 and name in ("bcast", "gather", "scatter")
                  else 0)
    if name == "bcast":
        return (_pickled(obj), 0) if rank == root else (0, _pickled(result))
    if name == "gather":
        return _pickled(obj), (sum(map(_pickled, result)) if result is not None else 0)
    if name == "scatter":
        return (sum(map(_pickled, obj)) if rank == root else 0), _pickled(result)
    if name in ("allgather", "alltoall"):
        return _pickled(obj), sum(map(_pickled, result))
    if name in ("isend", "send"):
        return _pickled(obj), 0
    if name in ("irecv", "recv"):
        return 0, (0 if name == "irecv" else _pickled(result))
    return _pickled(obj), _pickled(result)  # allreduce, reduce, scan, exscan


def _site() -> str:
    """The library function that made the call: the first frame outside this file."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    short = path[path.rfind("/hpcdl/") + 1:] if "/hpcdl/" in path else os.path.basename(path)
    return f"{short}:{frame.f_code.co_qualname}"


def counting_world():
    """COMM_WORLD as an instance of a counting subclass of ``MPI.Intracomm``: a real
    communicator (mpi4py and the MPI library accept it anywhere), every call forwarded."""
    from mpi4py import MPI

    calls: list[tuple[str, str, int, int]] = []
    rank = MPI.COMM_WORLD.Get_rank()

    class CountingIntracomm(MPI.Intracomm):
        pass

    def lower(name):
        def counted(self, *args, **kw):
            result = getattr(MPI.Intracomm, name)(self, *args, **kw)
            calls.append((name, _site(), *_lower_payload(name, args, kw, result,
                                                         self.Get_rank())))
            return result
        return counted

    def upper(name):
        def counted(self, *args, **kw):
            result = getattr(MPI.Intracomm, name)(self, *args, **kw)
            sent = _nbytes(args[0]) if args else 0
            received = _nbytes(args[1]) if len(args) > 1 else sent
            calls.append((name, _site(), sent, received))
            return result
        return counted

    def empty(name):
        def counted(self, *args, **kw):
            calls.append((name, _site(), 0, 0))
            return getattr(MPI.Intracomm, name)(self, *args, **kw)
        return counted

    def made(name):
        def counted(self, *args, **kw):
            calls.append((name, _site(), 0, 0))
            comm = getattr(MPI.Intracomm, name)(self, *args, **kw)
            return comm if comm == MPI.COMM_NULL else CountingIntracomm(comm)
        return counted

    for names, wrap in ((LOWER, lower), (UPPER, upper), (EMPTY, empty), (MADE, made)):
        for name in names:
            setattr(CountingIntracomm, name, wrap(name))
    del rank
    return CountingIntracomm(MPI.COMM_WORLD), calls


def measured(calls: list, fn):
    calls.clear()
    out = fn()
    sites: dict[str, dict[str, int]] = {}
    for name, site, sent, received in calls:
        s = sites.setdefault(f"{site} ({name})", {"messages": 0, "sent": 0, "received": 0})
        s["messages"] += 1
        s["sent"] += sent
        s["received"] += received
    return out, {"messages": len(calls), "sent": sum(c[2] for c in calls),
                 "received": sum(c[3] for c in calls), "sites": sites}


def _config(global_batch: int):
    from hpcdl.train.config import config_from_dict

    return config_from_dict({
        "name": "tiny", "model": {"name": "resnet_small", "num_classes": 3, "width": 4,
                                  "layers": [1, 1, 1]},
        "data": {"image_size": 16, "workers": 1}, "batch": {"global": global_batch,
                                                            "per_rank": 1},
        "epochs": 1, "optimizer": {"name": "lars", "momentum": 0.9},
        "schedule": {"name": "poly", "base_lr": 0.1}, "train": {"seed": 1},
        # the rule: a recipe's auto adds the start-up trial, whose rounds of the model's
        # gradient buckets are bounded by comm.trial_s, not by P (docs/comm.md)
        "comm": {"backend": "rule"}})


def worker(shards: str, run_dir: str, out: str) -> None:
    import hpcdl.comm
    from hpcdl.cli.doctor import check_world
    from hpcdl.debug import watch_collectives
    from hpcdl.debug.stall import heartbeat_path
    from hpcdl.train.ltfb import LTFB, LTFBOptions
    from hpcdl.train.threads import configure_threads
    from hpcdl.train.trainer import Trainer, TrainOptions

    world, calls = counting_world()
    size, rank = world.Get_size(), world.Get_rank()
    records: dict[str, dict] = {}
    comm, records["comm_init"] = measured(calls, lambda: hpcdl.comm.init("auto", world))
    _, records["threads"] = measured(calls, lambda: configure_threads(world))
    _, records["watchdog"] = measured(calls, lambda: watch_collectives(comm, run_dir))
    options = TrainOptions(max_steps=1, evaluate=False, progress=False)

    def start_trainer():
        trainer = Trainer(_config(size), shards, run_dir, comm, options=options)
        trainer.resume("none")
        trainer.check_replicas()  # train()'s first act
        return trainer
    trainer, records["trainer"] = measured(calls, start_trainer)
    trainer.close()
    beat = heartbeat_path(os.path.join(run_dir, "logs", "heartbeat"), rank)
    comm.close()
    doctor_args = argparse.Namespace(staging=run_dir, data=None, json=None, strict=False)
    with contextlib.redirect_stdout(io.StringIO()):
        _, records["doctor"] = measured(calls, lambda: check_world(world, doctor_args))
    ltfb_dir = run_dir + "-ltfb"

    def start_ltfb():
        return LTFB(_config(size // 2), shards, ltfb_dir, world, LTFBOptions(trainers=2),
                    options)
    ltfb, records["ltfb"] = measured(calls, start_ltfb)
    ltfb.close()
    records["heartbeat_dir"] = os.path.dirname(beat)
    gathered = MPI_world().gather(records, root=0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ranks": size, "ranks_per_node": RANKS_PER_NODE, "per_rank": gathered},
                      f)


def MPI_world():  # noqa: N802 - the uncounted world, for the bench's own gather
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _tiny_model_bytes() -> int:
    from hpcdl.models import create_model

    model = create_model("resnet_small", num_classes=3, width=4, layers=[1, 1, 1])
    return 4 * (sum(p.numel() for p in model.parameters())
                + sum(b.numel() for b in model.buffers() if b.is_floating_point()))


def summarize(runs: list[dict]) -> dict:
    """Per phase and quantity: rank 0 and the largest other rank at each P, the fit, the value
    at 2,048 ranks (the trainer's model broadcast swapped for each full model's), and per
    call site the fit of what the largest other rank received."""
    ps = [r["ranks"] for r in runs]
    full = {m: model_terms(m) for m in MODELS}
    tiny = _tiny_model_bytes()
    rows = {}
    for phase in PHASES:
        for quantity in ("messages", "sent", "received"):
            root = [r["per_rank"][0][phase][quantity] for r in runs]
            other = [max(x[phase][quantity] for x in r["per_rank"][1:]) for r in runs]
            total = [sum(x[phase][quantity] for x in r["per_rank"]) for r in runs]
            row = {"P": ps, "rank0": root, "other_max": other, "total": total,
                   "fit_rank0": fit(ps, root), "fit_other": fit(ps, other)}
            row["at_2048"] = {}
            for m, terms in full.items():
                # the start's model broadcast: parameters and float buffers (float32)
                grow = terms["model_pt"] - 4 * terms["parameters"] - tiny \
                    if phase in ("trainer", "ltfb") and quantity != "messages" else 0
                a0, b0 = row["fit_rank0"]
                a1, b1 = row["fit_other"]
                r0 = a0 + b0 * TARGET_P + (grow if quantity == "sent" else 0)
                r1 = a1 + b1 * TARGET_P + (grow if quantity == "received" else 0)
                row["at_2048"][m] = {"rank0": r0, "other": r1,
                                     "total": r0 + r1 * (TARGET_P - 1)}
            rows[f"{phase}.{quantity}"] = row
    sites = {}
    for phase in PHASES:
        names = sorted({s for r in runs for x in r["per_rank"] for s in x[phase]["sites"]})
        for site in names:
            other = [max(x[phase]["sites"].get(site, {}).get("received", 0)
                         for x in r["per_rank"][1:]) for r in runs]
            root = [r["per_rank"][0][phase]["sites"].get(site, {}).get("sent", 0)
                    + r["per_rank"][0][phase]["sites"].get(site, {}).get("received", 0)
                    for r in runs]
            sites[f"{phase}: {site}"] = {"received_other": other, "fit_other": fit(ps, other),
                                         "rank0_sent_received": root,
                                         "fit_rank0": fit(ps, root)}
    return {"rows": rows, "sites": sites, "models": full, "tiny_model_bytes": tiny,
            "bounds": BOUNDS, "host_record_b": HOST_RECORD_B}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--json", required=False)
    parser.add_argument("--worker", nargs=3, metavar=("SHARDS", "RUN_DIR", "OUT"))
    parser.add_argument("--summarize", metavar="JSON",
                        help="recompute the summary (fits, bounds) of a raw file's runs")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.summarize:
        with open(args.summarize) as f:
            report = json.load(f)
        report["summary"] = summarize(report["runs"])
        with open(args.summarize, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
        return
    runs = measure(args.ranks)
    started = runs.pop()
    report = write_report(os.path.basename(__file__), args.ranks, started, runs,
                          summarize(runs), args.json)
    for key, row in report["summary"]["rows"].items():
        print(f"{key:22s} rank0 {row['rank0']} other {row['other_max']} "
              f"fit0 {row['fit_rank0'][1]:+.1f}/P fit1 {row['fit_other'][1]:+.1f}/P")


def measure(ranks: list[int], tmp: str | None = None) -> list:
    """One worker run per P; the list's last item is when the runs began."""
    from hpcdl.data_prep.shard import shard_tree
    from hpcdl.data_prep.synthetic import make_imagenet_tree

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(dir=tmp) as tmp:
        make_imagenet_tree(os.path.join(tmp, "tree"), num_classes=3,
                           train_per_class=max(ranks) * 2, val_per_class=2, size=(24, 20))
        shard_tree(os.path.join(tmp, "tree"), os.path.join(tmp, "shards"),
                   shards=max(ranks), resize=20)
        runs = []
        for p in ranks:
            out = os.path.join(tmp, f"p{p}.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "900",
                   "HPCDL_RANKS_PER_NODE": str(RANKS_PER_NODE)}
            subprocess.run(["mpiexec", "-n", str(p), sys.executable, os.path.abspath(__file__),
                            "--worker", os.path.join(tmp, "shards"),
                            os.path.join(tmp, f"run{p}"), out], env=env, check=True)
            with open(out) as f:
                runs.append(json.load(f))
    return [*runs, started]


if __name__ == "__main__":
    main()
