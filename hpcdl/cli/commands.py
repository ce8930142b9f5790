"""How ``hpcdl`` finds its sub-commands, and ``hpcdl bench`` its benchmarks.

A command module defines ``COMMAND`` (its name), ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; :func:`command_modules` imports every such module of a package and
:func:`add_command_parsers` gives each its own sub-parser. Both ``hpcdl.cli.main`` and
``hpcdl.cli.bench`` import this module, so neither imports the other.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Sequence
from types import ModuleType

__all__ = ["add_command_parsers", "command_modules"]


def command_modules(package: ModuleType, skip: Sequence[str] = ()) -> list[ModuleType]:
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
