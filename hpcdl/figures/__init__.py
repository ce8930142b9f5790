"""The docs' measured tables, generated from the raw JSON in ``docs/results/``.

A generated block in a Markdown file reads::

    <!-- generated: NAME from docs/results/FILE.json, ... -->
    ...the table and how its ratios are computed...
    <!-- end generated -->

``hpcdl bench report --docs`` rewrites every block from its raw files (the opening marker
too, so the sources it names are the ones read); ``--check`` only compares and fails when a
block differs, which is what tests/test_docs_figures.py asserts. A figure edited by hand is
therefore a failing test, and a figure has exactly one place it comes from: the builder named
``NAME`` in :mod:`hpcdl.figures.tables`.

Ratios are computed one way everywhere (stated under each table and printed by the command):
two modes measured in the same run give one ratio per run, reported as the median
[min–max] over runs; quantities from separate runs are compared as the ratio of their
medians; bytes across hosts are compared per host (each host against itself), the total
given beside them. A block that quotes other blocks' figures (performance.md's summary,
README's demo line) computes them with those blocks' own functions, never again.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hpcdl.errors import BadInputError

OPEN = re.compile(r"^<!-- generated: (?P<name>[\w-]+)(?: from [^>]*)? -->$")
CLOSE = "<!-- end generated -->"


@dataclass(frozen=True)
class Block:
    """One generated block of a Markdown file: lines ``start`` (opening marker) to ``end``
    (closing marker), both 0-based and inclusive."""

    path: Path
    name: str
    start: int
    end: int


def blocks(path: Path) -> Iterator[Block]:
    """Every generated block of ``path``; an opening marker without its close is bad input."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = OPEN.match(lines[i].strip())
        if match:
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j].strip() == CLOSE or OPEN.match(lines[j].strip())), None)
            if end is None or lines[end].strip() != CLOSE:
                raise BadInputError(
                    f"{path}:{i + 1}: generated block {match['name']!r} has no "
                    f"'{CLOSE}' line before the next block: add it after the block")
            yield Block(path, match["name"], i, end)
            i = end
        i += 1


def render(name: str, root: Path, doc: Path) -> tuple[str, str]:
    """The block ``name`` of the Markdown file ``doc`` as it should read (markers and a
    link to each raw file included) and how its ratios are computed, from ``root``'s raw
    files."""
    from hpcdl.figures.tables import TABLES

    if name not in TABLES:
        raise BadInputError(f"generated block {name!r} has no builder; known: "
                            f"{', '.join(sorted(TABLES))}")
    table = TABLES[name]
    try:
        body = table.build(root)
    except (OSError, KeyError, ValueError, StopIteration) as exc:
        raise BadInputError(f"{doc}: block {name!r} cannot be built from "
                            f"{', '.join(table.sources)}: {type(exc).__name__}: {exc}") from exc
    sources = ", ".join(table.sources)
    links = ", ".join(
        f"[{Path(s).name}]({os.path.relpath(root / s, doc.parent)}{'/' if s.endswith('/') else ''})"
        for s in table.sources)
    text = (f"<!-- generated: {name} from {sources} -->\n{body.rstrip()}\n\n"
            f"How: {table.how} Raw: {links}.\n{CLOSE}")
    return text, table.how


def regenerate(root: Path, docs: list[Path], write: bool) -> list[str]:
    """Regenerate every block in ``docs``; write the files back when ``write``. Returns one
    line per block that differed (``path: NAME``), empty when the docs match their data."""
    differ = []
    for path in docs:
        lines = path.read_text().splitlines()
        found = list(blocks(path))
        for block in reversed(found):
            text, _ = render(block.name, root, path)
            if lines[block.start:block.end + 1] != text.splitlines():
                differ.append(f"{path.relative_to(root)}: {block.name}")
                lines[block.start:block.end + 1] = text.splitlines()
        if write and found:
            from hpcdl.io import atomic_write_text

            atomic_write_text(str(path), "\n".join(lines) + "\n")
    return sorted(differ)


def doc_files(root: Path) -> list[Path]:
    """The Markdown files that may hold generated blocks: README.md and docs/ (with results/)."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
