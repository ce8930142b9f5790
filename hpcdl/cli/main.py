"""The one `hpcdl` command.

Each sub-command is a module of this package that defines ``COMMAND`` (its name), ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; this file only finds and dispatches them,
so adding a command is adding one file. Modules keep heavy imports (torch, mpi4py) inside
``run`` so that ``hpcdl --help`` stays fast and works without MPI.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

import hpcdl
import hpcdl.cli


def _command_modules(package: ModuleType, skip: Sequence[str] = ()) -> list[ModuleType]:
    """Import every module of ``package`` that declares a ``COMMAND``, sorted by name."""
    modules = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_") or info.name in skip:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if hasattr(module, "COMMAND"):
            modules.append(module)
    return sorted(modules, key=lambda m: m.COMMAND)


def add_command_parsers(
    subparsers: argparse._SubParsersAction, modules: Sequence[ModuleType]
) -> None:
    """Give each command module its own sub-parser, remembering the module to dispatch to."""
    for module in modules:
        parser = subparsers.add_parser(
            module.COMMAND,
            help=module.HELP,
            description=(module.__doc__ or module.HELP).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(parser)
        parser.set_defaults(_run=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcdl",
        description="Large-batch ImageNet training on CPU clusters with MPI.",
    )
    parser.add_argument("--version", action="version", version=f"hpcdl {hpcdl.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_command_parsers(subparsers, _command_modules(hpcdl.cli, skip=("main",)))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
