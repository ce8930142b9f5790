"""Benchmarks: each compares hpcdl against the baseline a user would otherwise pick,
measured in the same run, prints a table and writes one JSON convention (``--json FILE``).

Benchmark modules live in ``hpcdl/bench/`` and follow the command-module protocol of
``hpcdl.cli.commands`` (``COMMAND``, ``HELP``, ``add_arguments``, ``run``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import hpcdl.bench
from hpcdl.cli.commands import add_command_parsers, command_modules

COMMAND = "bench"
HELP = "measure hpcdl against the baseline a user would otherwise pick"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    add_command_parsers(subparsers, command_modules(hpcdl.bench))
    report = subparsers.add_parser(
        "report", help="regenerate the docs' measured tables from docs/results/",
        description="Rewrite every generated block (<!-- generated: NAME ... -->) of README.md "
                    "and docs/ from the raw JSON in docs/results/, printing how each block's "
                    "ratios are computed.")
    report.add_argument("--docs", action="store_true", required=True,
                        help="regenerate the docs' blocks (the only report so far)")
    report.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a block differs from its raw files")
    report.add_argument("--root", default=".", help="the repository root (default: here)")
    report.set_defaults(_run=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Regenerate (or ``--check``) every generated block; print each block's rule."""
    from hpcdl.figures import blocks, doc_files, regenerate, render

    root = Path(args.root).resolve()
    docs = doc_files(root)
    for path in docs:
        for block in blocks(path):
            print(f"{path.relative_to(root)}: {block.name}: {render(block.name, root, path)[1]}")
    differ = regenerate(root, docs, write=not args.check)
    verb = "differ from their raw files" if args.check else "rewritten"
    print(f"{len(differ)} block(s) {verb}" + "".join(f"\n  {d}" for d in differ))
    return 1 if args.check and differ else 0


def run(args: argparse.Namespace) -> int:  # pragma: no cover - dispatch goes to the bench
    raise SystemExit("hpcdl bench: name a benchmark (hpcdl bench --help)")
