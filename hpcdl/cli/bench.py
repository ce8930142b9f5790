"""Benchmarks: each compares hpcdl against the baseline a user would otherwise pick,
measured in the same run, prints a table and writes one JSON convention (``--json FILE``).

Benchmark modules live in ``hpcdl/bench/`` and follow the command-module protocol of
``hpcdl.cli.commands`` (``COMMAND``, ``HELP``, ``add_arguments``, ``run``).
"""
from __future__ import annotations

import argparse

import hpcdl.bench
from hpcdl.cli.commands import add_command_parsers, command_modules

COMMAND = "bench"
HELP = "measure hpcdl against the baseline a user would otherwise pick"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    add_command_parsers(subparsers, command_modules(hpcdl.bench))


def run(args: argparse.Namespace) -> int:  # pragma: no cover - dispatch goes to the bench
    raise SystemExit("hpcdl bench: name a benchmark (hpcdl bench --help)")
