"""Check the launch layout: run it under the job's own launcher.

    mpiexec -n 4 hpcdl doctor --staging /local/scratch
    srun hpcdl doctor --json doctor.json

Every rank reports its host, node, local rank, CPU affinity (cores and sockets), threads, OMP/KMP/
MKL settings, MPI library, mpi4py build, torch/IPEX/oneCCL, HDF5 locking and staging space; rank
0 prints one table and a warning with the fix for each problem (oversubscribed cores, ranks
sharing cores, a rank spanning sockets, HDF5 locking on a parallel file system, mpi4py linked to
a different MPI than the launcher). Exit status 1 on errors (and on warnings with --strict).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

COMMAND = "doctor"
HELP = "check ranks, binding, threads, MPI build and file systems under the job's launcher"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--staging", default=os.environ.get("TMPDIR") or tempfile.gettempdir(),
                        metavar="DIR", help="staging directory to check (default $TMPDIR or /tmp)")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="shard directory to check for file-system type and HDF5 locking")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write the per-rank records and findings as JSON ('-' or no "
                             "value: stdout instead of the table)")
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    parser.add_argument("--mpi-flavor", action="store_true",
                        help="print which MPI mpi4py loads (mpich, impi, openmpi, mvapich, "
                             "cray-mpich or unknown) and exit, without starting MPI: the job "
                             "scripts ask this to choose their launcher")


def run(args: argparse.Namespace) -> int:
    if args.mpi_flavor:
        from hpcdl.mpi_library import loaded_library

        print(loaded_library(initialize=False).flavor)
        return 0
    from mpi4py import MPI  # MPI_Init: bounded by hpcdl.cli.main (HPCDL_STARTUP_TIMEOUT_S)

    return check_world(MPI.COMM_WORLD, args)


def check_world(world, args: argparse.Namespace) -> int:
    """The doctor over ``world`` (collective): every rank's findings to rank 0, which prints
    them; every rank returns the exit code."""
    from hpcdl.debug.doctor import (
        collect_rank_info,
        diagnose,
        exit_code,
        format_report,
        hosts_reach_each_other,
        report_json,
    )
    from hpcdl.debug.hosts import probe_clock
    from hpcdl.results import write_json

    if not hosts_reach_each_other(world):
        world.Abort(1)
    # A missing --staging on some node is a finding (an error naming the host), not an early
    # exit: a rank that returned here would leave the others waiting in the gather.
    info = collect_rank_info(world, args.staging, args.data)
    info["clock_offset_s"] = probe_clock(world)
    ranks = world.gather(info, root=0)
    code = 0
    if world.rank == 0:
        findings = diagnose(ranks)
        code = exit_code(findings, args.strict)
        if args.json == "-":
            print(json.dumps(report_json(ranks, findings), indent=2))
        else:
            print(format_report(ranks, findings))
            if args.json:
                write_json(args.json, report_json(ranks, findings))
    return world.bcast(code, root=0)
