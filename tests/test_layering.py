"""The library's floors: every import points down (or stays on its floor), nothing imports its
command line, and no two modules import each other round any loop.

The floors, lowest first, as the code uses them (docs/architecture.md draws the same picture):

 0. ground: ``hpcdl`` (the package face, standard library only), ``hpcdl.errors``,
    ``hpcdl.io``, ``hpcdl.cpus`` (CPU lists, bf16 kernels, heap policy), ``hpcdl.mpi_library``,
    ``hpcdl.topology`` (which node a rank is on), ``hpcdl.results`` (the measured-results JSON
    that bench writes and plan reads), ``hpcdl.data.format`` (the shard format: data_prep
    writes it, the loader reads it), ``hpcdl.buckets`` (the fusion-bucket layout the reducer
    fills and the planner costs);
 1. ``data_prep``;  2. ``data``;  3. ``models``;
 4. ``debug``'s watch-and-fail core (logs, fail-fast, stall watchdog, collective monitor,
    timeline): below comm because ``hpcdl.comm.init`` installs fail-fast and the watchdog by
    default, and the watchdog must not depend on what it watches;
 5. ``comm``;  6. ``optim``;  7. ``train``;
 8. the tools that read every stage below: ``plan``, ``slurm`` (job rendering), and the
    doctor (``hpcdl.debug.doctor`` / ``hosts``: it inspects the MPI and oneCCL installation);
 9. ``bench`` (runs the trainer and the planner against their baselines);
10. ``cli``.

Besides the floors: ``comm`` imports nothing of ``data`` (the communicator speaks buffers) and
of ``debug`` only its package face (``hpcdl.debug``'s public names), never a debug module;
no module imports another module's private (``_name``) name.

Imports are read with ``ast`` from the source: module level and inside functions alike (a lazy
import is still a dependency), and ``importlib.import_module`` / ``__import__`` with a literal
name. Names computed at run time are not followed: the comm backends table and the command
discovery of hpcdl/cli/commands.py stay inside their own package, and ``hpcdl``'s lazy names
(PEP 562) are the one arrow up by design -- the package face loads the own-loop API from
hpcdl/train only when a user asks for it. The test needs nothing installed beyond the files.
"""
import ast
from pathlib import Path

import networkx as nx  # a dependency of torch
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: folders of the repository and the import names they install under (setup.py)
PACKAGES = {"hpcdl": "hpcdl", "data_prep": "hpcdl.data_prep", "slurm": "hpcdl.slurm"}

#: module or package -> floor (the module docstring); the longest matching prefix decides
FLOORS = {
    "hpcdl": 0, "hpcdl.errors": 0, "hpcdl.io": 0, "hpcdl.cpus": 0, "hpcdl.mpi_library": 0,
    "hpcdl.topology": 0, "hpcdl.results": 0, "hpcdl.data.format": 0, "hpcdl.recipes": 0,
    "hpcdl.buckets": 0,
    "hpcdl.data_prep": 1,
    "hpcdl.data": 2,
    "hpcdl.models": 3,
    "hpcdl.debug": 4,
    "hpcdl.comm": 5,
    "hpcdl.optim": 6,
    "hpcdl.train": 7,
    "hpcdl.plan": 8, "hpcdl.slurm": 8, "hpcdl.debug.doctor": 8, "hpcdl.debug.hosts": 8,
    "hpcdl.bench": 9,
    "hpcdl.cli": 10,
}


def floor(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in FLOORS:
            return FLOORS[".".join(parts[:end])]
    raise KeyError(module)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _absolute(base: str, level: int, package: str) -> str:
    """``from {'.' * level}{base} import ...`` seen from ``package``, made absolute."""
    if not level:
        return base
    anchor = package.split(".")[:len(package.split(".")) - level + 1]
    return ".".join(anchor + ([base] if base else []))


def _literal_import(node: ast.Call, package: str) -> list[str]:
    """The module(s) an ``importlib.import_module("...")`` / ``__import__("...")`` call with a
    literal name loads; [] for any other call."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return []
    target = node.args[0]
    if not (isinstance(target, ast.Constant) and isinstance(target.value, str)):
        return []
    module = target.value
    if name == "import_module" and module.startswith("."):
        level = len(module) - len(module.lstrip("."))
        module = _absolute(module.lstrip("."), level, package)
    found = [module]
    fromlist = next((k.value for k in node.keywords if k.arg == "fromlist"),
                    node.args[3] if len(node.args) > 3 else None)
    if name == "__import__" and isinstance(fromlist, (ast.List, ast.Tuple)):
        found += [f"{module}.{e.value}" for e in fromlist.elts if isinstance(e, ast.Constant)]
    return found


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every import of an hpcdl module in ``path`` (module
    ``name``): ``from X import y`` counts as X.y when that is a module, else (X, "y")."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, None) if sub in known else (base, alias.name))
        elif isinstance(node, ast.Call):
            found += [(module, None) for module in _literal_import(node, package)]
    return [(m, what) for m, what in found if m in known and m != name]


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The hpcdl modules ``path`` (module ``name``) imports."""
    return {module for module, _ in imports_of(name, path, known)}


def import_graph(root: Path = ROOT) -> nx.DiGraph:
    modules = module_files(root)
    known = set(modules)
    g = nx.DiGraph()
    g.add_nodes_from(known)
    for name, path in modules.items():
        for module, what in imports_of(name, path, known):
            g.add_edge(name, module)
            if what is not None and what.startswith("_") and not what.startswith("__"):
                g.edges[name, module].setdefault("private", []).append(what)
    return g


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return import_graph()


def test_the_import_graph_is_read_from_the_real_modules(graph):
    # guards the parser itself: these edges exist in the code (lazy and module-level)
    assert graph.has_edge("hpcdl.cli.train", "hpcdl.train.trainer")
    assert graph.has_edge("hpcdl.train.trainer", "hpcdl.train.checkpoint")
    assert graph.has_edge("hpcdl.data_prep.verify", "hpcdl.data.format")
    assert graph.has_edge("hpcdl.cli.bench", "hpcdl.cli.commands")
    assert graph.number_of_nodes() > 60


def test_imports_inside_functions_and_through_importlib_are_read(tmp_path):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "hpcdl" / "__init__.py").write_text("")
    for leaf in ("lazy", "by_name", "dunder", "relative", "stage"):
        (tmp_path / "hpcdl" / f"{leaf}.py").write_text("")
    (tmp_path / "hpcdl" / "user.py").write_text(
        "import importlib\n"
        "def f():\n"
        "    from hpcdl import lazy\n"
        "    importlib.import_module('hpcdl.by_name')\n"
        "    __import__('hpcdl', fromlist=['dunder'])\n"
        "    importlib.import_module('.relative', package='hpcdl')\n"
        "    importlib.import_module(f'hpcdl.{lazy}')  # computed: not a literal name\n")
    g = import_graph(tmp_path)
    assert set(g.successors("hpcdl.user")) == {
        "hpcdl", "hpcdl.lazy", "hpcdl.by_name", "hpcdl.dunder", "hpcdl.relative"}


def test_every_module_stands_on_a_floor(graph):
    assert [m for m in graph.nodes if not _has_floor(m)] == []


def _has_floor(module: str) -> bool:
    try:
        floor(module)
    except KeyError:
        return False
    return True


def test_every_import_points_down_a_floor_or_stays_on_it(graph):
    offenders = sorted(f"{source} (floor {floor(source)}) imports {target} "
                       f"(floor {floor(target)})" for source, target in graph.edges
                       if floor(target) > floor(source))
    assert offenders == [], "move the shared piece a floor down:\n" + "\n".join(offenders)


def test_no_library_module_imports_the_command_line(graph):
    offenders = sorted(f"{source} imports {target}" for source, target in graph.edges
                       if target.startswith("hpcdl.cli") and not source.startswith("hpcdl.cli"))
    assert offenders == [], "move the shared piece below hpcdl/cli:\n" + "\n".join(offenders)


def test_nothing_below_the_benches_imports_them(graph):
    # the planner reads bench results as JSON (hpcdl.results), never by importing a bench
    offenders = sorted(f"{source} imports {target}" for source, target in graph.edges
                       if target.startswith("hpcdl.bench")
                       and not source.startswith(("hpcdl.bench", "hpcdl.cli")))
    assert offenders == [], "\n".join(offenders)


def test_comm_imports_no_data_and_only_the_face_of_debug(graph):
    offenders = sorted(f"{source} imports {target}" for source, target in graph.edges
                       if source.startswith("hpcdl.comm")
                       and (target.startswith("hpcdl.data")
                            or target.startswith("hpcdl.debug.")))
    assert offenders == [], "\n".join(offenders)


def test_the_watchdog_does_not_depend_on_what_it_watches(graph):
    watch_core = nx.descendants(graph, "hpcdl.debug") | {"hpcdl.debug"}
    assert sorted(m for m in watch_core if m.startswith("hpcdl.comm")) == []


def test_debug_reaches_a_communicator_only_through_its_public_monitor_slot():
    # comm.monitor / comm.set_monitor, never the private attribute behind them
    offenders = sorted(f"{path.relative_to(ROOT)}:{node.lineno}"
                       for name, path in module_files().items() if not name.startswith("hpcdl.comm")
                       for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.Attribute) and node.attr == "_monitor")
    assert offenders == [], "\n".join(offenders)


def test_no_module_imports_another_modules_private_name(graph):
    offenders = sorted(f"{source} imports {', '.join(data['private'])} from {target}"
                       for source, target, data in graph.edges(data=True)
                       if "private" in data)
    assert offenders == [], "make the name public or move it:\n" + "\n".join(offenders)


def test_no_two_modules_import_each_other_round_any_loop(graph):
    cycles = list(nx.simple_cycles(graph))
    shown = sorted(" -> ".join([*c, c[0]]) for c in cycles)
    assert shown == [], "import cycles (put the shared piece a floor down):\n" + \
        "\n".join(shown)


def test_the_doctor_and_the_trainer_threads_share_a_floor_below_both(graph):
    assert graph.has_edge("hpcdl.debug.doctor", "hpcdl.cpus")
    assert graph.has_edge("hpcdl.train.threads", "hpcdl.cpus")
    assert not graph.has_edge("hpcdl.debug.doctor", "hpcdl.train.threads")
