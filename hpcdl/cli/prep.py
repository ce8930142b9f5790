"""Prepare ImageNet for training: shard the tree, verify shards, stage them to local disk.

  mpiexec -n P hpcdl prep shard --src TREE --out DIR --shards 1024 [--resize 256] [--format jpeg]
  hpcdl prep verify DIR
  srun --ntasks-per-node=1 hpcdl prep stage --shards DIR --to /local/scratch/imagenet

See docs/data.md for the shard format, the validation-label formats and staging.

Exit codes, as every hpcdl command: 0 done, 2 bad input (a tree, directory or value that cannot
be used; one line naming it). ``verify`` answers like ``cmp``: 1 when it finds bad shards (the
answer, not an error), 2 when it cannot check (no readable manifest).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

from hpcdl.errors import EXIT_BAD_INPUT, BadInputError

COMMAND = "prep"
HELP = "shard an ImageNet tree into HDF5, verify shards, stage them to node-local disk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="prep", metavar="ACTION", required=True)
    shard = sub.add_parser("shard", help="TREE -> DIR/{train,val}-XXXXX-of-YYYYY.h5 + manifest "
                           "(run under mpiexec for parallelism; resumable)")
    shard.add_argument("--src", required=True, help="tree with train/<class>/* and val/")
    shard.add_argument("--out", required=True, help="shard directory to write")
    shard.add_argument("--shards", type=int, required=True, help="number of train shards")
    shard.add_argument("--val-shards", type=int, default=None,
                       help="number of val shards (default: in proportion to --shards)")
    shard.add_argument("--resize", type=int, default=256,
                       help="resize the short side down to this many pixels (0: keep)")
    shard.add_argument("--format", choices=("jpeg", "raw"), default="jpeg",
                       help="store re-encoded JPEG bytes (default) or decoded uint8 HxWx3")
    shard.add_argument("--seed", type=int, default=0, help="seed of the sample-to-shard shuffle")
    shard.add_argument("--val-labels", default=None,
                       help="LOC_val_solution.csv or ILSVRC2012_validation_ground_truth.txt for "
                       "a flat val/ folder (default: looked for in TREE)")
    shard.add_argument("--synsets", default=None,
                       help="for the devkit ground truth: line i = wnid of ILSVRC2012_ID i")
    shard.add_argument("--strict", action="store_true",
                       help="fail on any unreadable source file instead of skipping it")
    shard.add_argument("--no-progress", action="store_true", help="no progress bar")
    verify = sub.add_parser("verify", help="recompute checksums and counts; non-zero exit "
                            "naming each bad shard")
    verify.add_argument("dir", help="shard directory (with manifest.json)")
    stage = sub.add_parser("stage", help="copy the shards this node reads to local disk "
                           "(one rank per node)")
    stage.add_argument("--shards", required=True, help="shard directory on the shared file system")
    stage.add_argument("--to", required=True,
                       help="node-local directory; {node} in it is replaced by the node index "
                            "(pretend nodes on one machine, HPCDL_RANKS_PER_NODE)")
    stage.add_argument("--splits", default="train,val", help="comma-separated splits to stage")
    stage.add_argument("--all", action="store_true",
                       help="copy every shard (for rotate_shards, which reads all of them)")


def run_shard(args: argparse.Namespace, world: WatchedWorld | None = None) -> int:
    from mpi4py import MPI

    from hpcdl.data_prep.shard import shard_tree

    comm = world or MPI.COMM_WORLD
    start = time.perf_counter()
    try:
        manifest = shard_tree(args.src, args.out, args.shards, val_shards=args.val_shards,
                              resize=args.resize, image_format=args.format, seed=args.seed,
                              strict=args.strict, val_labels=args.val_labels,
                              synsets=args.synsets, comm=comm, progress=not args.no_progress)
    except BadInputError as exc:
        if exc.agreed:  # every rank raised it (--strict's gathered verdict): one line, exit 2
            if comm.rank == 0:
                print(f"hpcdl prep shard: {exc}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        return _fail_alone(comm, exc, EXIT_BAD_INPUT)
    except Exception as exc:  # noqa: BLE001 - report, then make sure no rank is left waiting
        # The tree, the labels, a directory that cannot be written: all input a person fixes
        # (exit 2); anything else is a bug (exit 1, with the traceback).
        bad_input = isinstance(exc, (OSError, ValueError, RuntimeError))
        code = _fail_alone(comm, exc, EXIT_BAD_INPUT if bad_input else 1)
        if not bad_input:
            raise
        return code
    seconds = time.perf_counter() - start
    if comm.rank == 0:
        total = sum(s["num_samples"] for s in manifest["splits"].values())
        for split, info in manifest["splits"].items():
            print(f"{split}: {info['num_samples']} images in {info['num_shards']} shards")
        for item in manifest["skipped"]:
            print(f"skipped {item['key']}: {item['reason']}")
        if manifest["skipped"]:
            print(f"skipped {len(manifest['skipped'])} source file(s) or label row(s), listed "
                  f"in {args.out}/manifest.json ('skipped'); --strict refuses them")
        for split, empty in manifest["empty_classes"].items():
            if empty:
                print(f"empty class folders in {split}: {', '.join(empty)}")
        print(f"sharded {total} images in {seconds:.1f} s on {comm.size} ranks "
              f"({total / max(seconds, 1e-9):.0f} img/s) -> {args.out}")
    return 0


def _fail_alone(comm, exc: BaseException, code: int) -> int:
    """Report an error this rank may have alone; with peers, end the job (they could be in
    the final allgather) after the grace that lets this rank's line reach the launcher.
    Finished shards stay valid and a rerun resumes from them."""
    print(f"hpcdl prep shard (rank {comm.rank}): {exc}", file=sys.stderr, flush=True)
    if comm.size > 1:
        from hpcdl.debug.faults import abort_after_output

        abort_after_output(comm, code)
    return code


def run_verify(args: argparse.Namespace) -> int:
    from hpcdl.data_prep.verify import read_manifest, verify_shards

    try:
        manifest = read_manifest(args.dir)
        problems = verify_shards(args.dir)
    except (OSError, ValueError) as exc:
        print(f"hpcdl prep verify: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for name, reason in problems.items():
        print(f"BAD {name}: {reason}")
    good = len(manifest["shards"]) - len(problems)
    print(f"{good}/{len(manifest['shards'])} shards OK in {args.dir}")
    return 1 if problems else 0


def run_stage(args: argparse.Namespace, world: WatchedWorld | None = None) -> int:
    from mpi4py import MPI

    from hpcdl.data_prep.stage import stage_node
    from hpcdl.topology import node_layout, node_path

    comm = world or MPI.COMM_WORLD
    # The communicator's node rule (HPCDL_RANKS_PER_NODE included), so node k stages exactly
    # what node k's loader reads; {node} in --to gives pretend nodes a directory each.
    node_index, num_nodes, local_rank, _ = node_layout(comm)
    local_dir = node_path(args.to, node_index)
    result, error = None, None
    if local_rank == 0:  # one copier per node even if launched with more ranks
        try:
            result = stage_node(args.shards, local_dir, node_index, num_nodes,
                                tuple(args.splits.split(",")), everything=args.all)
        except (OSError, ValueError) as exc:
            error = f"node {node_index} (rank {comm.rank}): {exc}"
    results = comm.gather((result, error), root=0)
    failed = comm.allreduce(1 if error else 0)
    if comm.rank == 0:
        for result, error in results:
            if error:
                print(f"hpcdl prep stage: {error}", file=sys.stderr)
            elif result:
                print(f"node {result['node_index']}/{result['num_nodes']}: copied "
                      f"{len(result['copied'])}, already present {len(result['present'])}, "
                      f"{result['bytes'] / 2**30:.2f} GiB in {result['local_dir']}")
    return EXIT_BAD_INPUT if failed else 0


class WatchedWorld:
    """COMM_WORLD for a prep phase, each pickled collective entered through the communicator's
    (watched) barrier. mpi4py holds the GIL inside a pickled collective (``bcast``,
    ``gather``, ``allgather``, ``allreduce`` of Python objects: measured, a thread of the
    waiting rank does not run), so a rank waiting there for a stuck peer would starve its own
    watchdog; ``MPI_Barrier`` releases the GIL, and the exchange after it finds every rank."""

    PICKLED = ("bcast", "gather", "allgather", "allreduce")

    def __init__(self, comm: Any) -> None:
        self._comm, self._world = comm, comm.mpi_comm

    def __getattr__(self, name: str) -> Any:
        collective = getattr(self._world, name)
        if name not in self.PICKLED:
            return collective

        def after_barrier(*args: Any, **kwargs: Any) -> Any:
            self._comm.barrier()
            return collective(*args, **kwargs)
        return after_barrier


@contextlib.contextmanager
def stall_watchdog() -> Iterator[WatchedWorld]:
    """``hpcdl train``'s stall watchdog over a sharding or staging phase (the default monitor
    of an ``mpi`` communicator): a rank that waits longer than ``HPCDL_STALL_ABORT_S`` (600 s)
    for a peer -- frozen, cut off, stuck in a read -- ends the job with a report naming it,
    instead of holding the allocation forever. Closed (collectively) only on the path where
    every rank returned; otherwise stopped locally."""
    import hpcdl.comm
    from hpcdl.debug import unwatch_collectives

    comm = hpcdl.comm.init("mpi", fail_fast=False)
    try:
        yield WatchedWorld(comm)
    except BaseException:
        unwatch_collectives(comm)
        raise
    comm.close()


def run(args: argparse.Namespace) -> int:
    if args.prep == "verify":  # one process, no peers to wait for
        return run_verify(args)
    with stall_watchdog() as world:
        return {"shard": run_shard, "stage": run_stage}[args.prep](args, world)
