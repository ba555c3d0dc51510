"""The package's layout, read from its source with ``ast`` (nothing is imported).

DESIGN.md: dependencies point one way, cli -> tools/conversion/data -> formats ->
transforms/sources -> errors/_system/units, with no import cycle, typing-only and
function-level imports included; no private name imported from another subpackage;
modules stay a readable size; no module shadows a standard one.

The import graph has one node per module (a package is its ``__init__``) and an edge
for every import in its source, whether or not it runs at import time:

- every ``import`` and ``from ... import`` statement anywhere in a module (function
  bodies included), relative ones resolved. ``if TYPE_CHECKING:`` bodies count too, in
  the cycle check and the layer rules alike: a type named across a loop is a loop in
  the design (two modules that each need the other's types), even if it never runs;
- ``importlib.import_module`` calls: with a literal name, that module; with a computed
  one (the format registry looks its modules up in a dict), every literal string in the
  module that names a module of the package;
- ``from P import name`` is an edge to ``P.name`` when that is a module, else to ``P``;
- importing ``P.Q.M`` also runs the ``__init__`` of ``P.Q``: an edge to ``P.Q.M`` implies
  one to ``P.Q``, except where ``P.Q`` is a package holding the importer (a package is
  always initialised before its submodules run, so that import finds it in ``sys.modules``
  and runs nothing). For the same reason no edge is implied to the top-level package, which
  holds every module; an explicit ``import dlstore`` or ``from dlstore import x`` is an edge
  to it like any other, and the top-level package sits above every layer.

Private names: a module's subpackage is the top-level one it lies in (``formats`` for
``dlstore.formats.shards.reader``), or the top-level package for the modules at its root
(``cli``, ``errors``, ``_system``). ``from X import _name`` and imports of a private module
(``X._mod``) are refused where X lies in another subpackage than the importer; the
ground-floor module ``_system`` is private as a module only (its public names are for
everyone). No module touches a private member (``obj._x``, ``getattr(obj, "_x")``) of an object of
another module: objects meet through public methods (a library's private member is used only where
``LIBRARY_PRIVATES`` says why).
"""

from __future__ import annotations

import ast
import builtins
import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dlstore"
MAX_LINES = 450

# importer (relative to the package)   -> what it must never import ("" is the top-level package,
# whose __init__ re-exports data and tools)
FORBIDDEN = {
    "sources": ("", "formats", "data", "tools", "conversion", "cli"),
    "transforms": ("", "formats", "data", "tools", "conversion", "cli"),
    "formats": ("", "data", "tools", "conversion", "cli"),
    "data": ("", "tools", "conversion", "cli"),
    "conversion": ("", "data", "tools", "cli"),
}
# The bottom layer imports nothing from the package but errors.
LEAVES = ("errors", "_system", "units", "processes")
LEAF_MAY_IMPORT = ("errors",)
# The ground floor: a private module whose public names every subpackage may import.
GROUND = ("_system",)
# A library's private members that dlstore uses, each with why (module:attribute -> reason). Objects of
# dlstore itself meet through public members only.
LIBRARY_PRIVATES = {
    "data.loaders.dataloader:_new_shared": "a worker's batch in shared memory, allocated as torch's "
                                           "default_collate allocates it (share_memory_() would copy it)",
    "formats.shards.reader:_mmap": "numpy's memmap keeps its mmap object there: the map the reader advises",
    "tools.throughput:_shutdown_workers": "a DataLoader iterator's workers stopped before the next trial",
    "tools.timeline:_ExperimentalConfig": "torch's profiler option that records every thread (no public name)",
    "data.profiling_ranges:_is_profiler_enabled": "torch's flag for fast checks that a profiler runs "
                                                  "(torch.autograd._profiler_enabled() is False in a "
                                                  "loader thread while one runs on the main thread)",
    "conversion.pool:_exit": "os._exit: the documented way to end a child process without running cleanup",
    "processes:_exit": "os._exit: the documented way to end a child process without running cleanup",
    "conversion.pool:_processes": "ProcessPoolExecutor's worker processes, to notice a dead one",
    "conversion.pool:_result_queue": "ProcessPoolExecutor's result pipe, closed to free a stuck manager thread",
    "conversion.pool:_writer": "ProcessPoolExecutor's result pipe, closed to free a stuck manager thread",
}
# Format names: only the registry and each format's own package branch on one (DESIGN.md, Seams);
# elsewhere the ``Format`` object answers (``formats.get_format(name).keeps_parts``, ...).
FORMAT_NAMES = ("shards", "lmdb", "hdf5")
FORMAT_NAME_HOMES = ("formats", "formats.shards", "formats.lmdb", "formats.hdf5")
# A constant equal to a format's name that names something else (module:constant -> what).
NOT_A_FORMAT = {
    "tools.bench.probes:lmdb": "the versions of the libraries dlstore uses, keyed by name (the lmdb library)",
}


# --- building the graph ---------------------------------------------------------------------

def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for the package in folder ``root`` (a package is its __init__)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_import_module_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _statement_names(package: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Absolute dotted names an import statement in ``package`` names (``from P import n``: ``P.n``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module
    return [f"{target}.{alias.name}" for alias in node.names]


def imported_names(module: str, path: Path, modules: set[str]) -> set[str]:
    """Absolute dotted names ``module`` (in file ``path``) imports; ``from P import n`` gives ``P.n``,
    which the caller cuts back to ``P`` where ``n`` is not a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package_of(module, path)
    names: set[str] = set()
    strings: set[str] = set()
    dynamic = False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(_statement_names(package, node))
        elif _is_import_module_call(node):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
            else:
                dynamic = True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    if dynamic:
        names.update(strings & modules)
    return names


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (see the module doc for the rules)."""
    modules = module_files(root)
    graph = {}
    for module, path in modules.items():
        edges = set()
        for name in imported_names(module, path, set(modules)):
            # `from P import n`: P.n if that is a module; `import P.Q.C`: the longest module prefix
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if not name:
                continue  # outside the package
            edges.add(name)
            own = set(_ancestors(module)) | {module}
            edges.update(p for p in _ancestors(name) if p not in own)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _under(name: str, package: str, sub: str) -> bool:
    """``name`` is ``package.sub`` or inside it; ``sub == ""`` is the top-level package alone."""
    if sub == "":
        return name == package
    prefix = f"{package}.{sub}"
    return name == prefix or name.startswith(prefix + ".")


def layer_violations(graph: dict[str, set[str]], package: str) -> list[str]:
    """``importer -> imported`` for each import against the layering (FORBIDDEN, LEAVES)."""
    found = []
    for module, edges in sorted(graph.items()):
        for target in sorted(edges):
            for layer, forbidden in FORBIDDEN.items():
                if _under(module, package, layer) and any(_under(target, package, f) for f in forbidden):
                    found.append(f"{module} -> {target}")
            for leaf in LEAVES:
                if _under(module, package, leaf) and not any(_under(target, package, ok) for ok in LEAF_MAY_IMPORT):
                    found.append(f"{module} -> {target}")
    return found


def shadowing_names(root: Path) -> list[str]:
    """Modules and packages named like a standard-library module or a builtin."""
    reserved = set(sys.stdlib_module_names) | set(dir(builtins))
    found = []
    for module in module_files(root):
        *_, last = module.split(".")
        if module != root.name and last in reserved:
            found.append(module)
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _subpackage(module: str, modules: dict[str, Path]) -> str:
    """The top-level subpackage holding ``module`` (``pkg.formats`` for ``pkg.formats.shards.reader``),
    or the package itself for the modules at its root."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    if len(parts) > 2 or (top in modules and modules[top].name == "__init__.py"):
        return top
    return parts[0]


def private_imports(root: Path) -> list[str]:
    """``importer: name`` for each private name or private module imported from another subpackage."""
    modules = module_files(root)
    found = []
    for module, path in modules.items():
        package = _package_of(module, path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _statement_names(package, node):
                target = name
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if not target or _subpackage(target, modules) == _subpackage(module, modules):
                    continue   # outside the package, or within one subpackage
                rest = name.split(".")[1:]
                if rest and rest[0] in GROUND:
                    rest = rest[1:]   # the ground floor's public names are for everyone
                if any(_is_private(part) for part in rest):
                    found.append(f"{module}: {name}")
    return sorted(found)


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines itself: functions, classes, module globals, and the members its
    classes set (``self._x = ...``) or define (``def _x``): what its own code may use on any object."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_private(node.name):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") \
                and _is_private(node.attr):
            own.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own.update(t.id for t in targets if isinstance(t, ast.Name) and _is_private(t.id))
    return own


def private_members(root: Path, allowed: dict[str, str] | None = None) -> list[str]:
    """``module:line: expression`` for each private member used on an object of another module
    (``obj._x``, or ``getattr(obj, "_x")`` and its kin), where ``_x`` is no name the module defines
    itself; ``allowed`` maps ``module:attr`` to why a library's private member is used there."""
    allowed = allowed or {}
    found = []
    for module, path in module_files(root).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                name = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "getattr", "hasattr", "setattr") and len(node.args) >= 2:
                arg = node.args[1]
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _is_private(arg.value)):
                    continue
                name = arg.value
            else:
                continue
            if name in own or f"{module.split('.', 1)[-1]}:{name}" in allowed:
                continue
            found.append((module, node.lineno, ast.unparse(node)))
    return [f"{module}:{line}: {text}" for module, line, text in sorted(found)]


def format_name_branches(root: Path, allowed: dict[str, str] | None = None) -> list[str]:
    """``module:line: expression`` for each comparison (``==``, ``!=``, ``in``, a ``match`` case) and each
    dict key on a format's name outside the registry and that format's package: a branch on the name
    (a message or help text that names a format is no branch). ``allowed``: ``module:name`` -> why."""
    allowed = allowed or {}
    found = []
    for module, path in module_files(root).items():
        where = module.partition(".")[2]
        if any(where == home or where.startswith(home + ".") and home != "formats" for home in FORMAT_NAME_HOMES):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.Dict):
                operands = [key for key in node.keys if key is not None]
            elif isinstance(node, ast.MatchValue):
                operands = [node.value]
            else:
                continue
            operands += [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts]
            names = {o.value for o in operands if isinstance(o, ast.Constant) and o.value in FORMAT_NAMES}
            if any(f"{where}:{name}" not in allowed for name in names):
                found.append((module, node.lineno, ast.unparse(node)))
    return [f"{module}:{line}: {text}" for module, line, text in sorted(found)]


def line_counts(root: Path) -> dict[str, int]:
    return {module: len(path.read_text().splitlines()) for module, path in module_files(root).items()}


# --- the package --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT)


def test_the_graph_sees_the_package(graph):
    # A sanity check that the parser finds what is known to be there.
    assert {"dlstore", "dlstore.errors", "dlstore.formats", "dlstore.formats.shards", "dlstore.cli"} <= set(graph)
    assert "dlstore.errors" in graph["dlstore.formats"]
    assert {"dlstore.formats.shards", "dlstore.formats.lmdb", "dlstore.formats.hdf5"} <= graph["dlstore.formats"]
    assert "dlstore.data" in graph["dlstore"]  # the lazy exports, named under TYPE_CHECKING
    # the resident back-end names the dataset it serves through a protocol below both
    assert "dlstore.data.gpu.steps" in graph["dlstore.data.loaders.resident"]
    assert "dlstore.data.gpu.resident" in graph["dlstore.data.gpu.steps"]
    assert "dlstore.data.gpu.dataset" not in graph["dlstore.data.loaders.resident"]


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lower_layers_never_import_higher_ones(graph):
    violations = layer_violations(graph, "dlstore")
    assert not violations, "imports against the layering (DESIGN.md):\n" + "\n".join(violations)


def test_no_private_name_is_imported_from_another_subpackage():
    found = private_imports(ROOT)
    assert not found, ("private names imported across subpackages (make the name public where it is an "
                       "API of its module, or move it where it belongs):\n" + "\n".join(found))


def test_objects_meet_through_public_members():
    found = private_members(ROOT, LIBRARY_PRIVATES)
    assert not found, ("private members of another module's objects used (make the member public, or pass "
                       "what is needed through a method, e.g. out=):\n" + "\n".join(found))
    files = module_files(ROOT)
    stale = [entry for entry in LIBRARY_PRIVATES
             if entry.split(":")[1] not in files[f"{ROOT.name}.{entry.split(':')[0]}"].read_text()]
    assert not stale, f"LIBRARY_PRIVATES lists uses that are gone: {stale}"


def test_no_module_outside_a_format_branches_on_its_name():
    found = format_name_branches(ROOT, NOT_A_FORMAT)
    assert not found, ("format names compared or used as keys outside the registry and the format's package "
                       "(ask the Format object, formats.get_format(name), instead):\n" + "\n".join(found))
    probes = module_files(ROOT)["dlstore.tools.bench.probes"].read_text()
    assert all(entry.split(":")[1] in probes for entry in NOT_A_FORMAT), "NOT_A_FORMAT lists uses that are gone"


def test_no_module_is_named_like_a_standard_module_or_builtin():
    assert shadowing_names(ROOT) == []


def test_modules_stay_a_readable_size():
    counts = line_counts(ROOT)
    largest = max(counts, key=counts.get)
    over = {m: n for m, n in counts.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them): {over}; largest: {largest} ({counts[largest]})"


# --- the checks themselves, on a small fake package ---------------------------------------

FAKE = {
    "__init__.py": "from .data import loader\n",
    "errors.py": "class E(Exception):\n    pass\n",
    "units.py": "from . import errors\n",
    "_system.py": "import os\n",
    "cli.py": "import pkg\nfrom pkg.tools import bench\n",
    "formats/__init__.py": (
        "import importlib\n"
        "_MODULES = {'a': 'pkg.formats.a'}\n"
        "def get(name):\n"
        "    return importlib.import_module(_MODULES[name])\n"),
    # A function-level import of a higher layer: a layer violation, and the cycle
    # formats.a -> data.loader -> formats.a.
    "formats/a.py": "from ..errors import E\n\ndef f():\n    from ..data import loader\n",
    "formats/json.py": "",  # shadows the standard library
    "data/__init__.py": "from . import loader\n",
    "data/loader.py": (
        "from typing import TYPE_CHECKING\n"
        "from ..formats import a\n"
        "if TYPE_CHECKING:\n"
        "    from ..tools import bench\n"  # typing only: still an edge, and a layer violation
        "else:\n"
        "    from .. import units\n"),
    "tools/__init__.py": "",
    "tools/bench/__init__.py": "",
    "tools/bench/run.py": "from ...formats import get\nimport pkg.data.loader\n",
    "tools/open.py": "x = 1\n" * 700,  # shadows a builtin, and too long
    # private names: of another subpackage (refused), of the ground floor (its public ones
    # allowed), of the importer's own subpackage (allowed)
    "formats/_common.py": "def helper():\n    pass\n",
    "formats/b/__init__.py": "from .._common import helper\nfrom ..a import _f\n",
    "tools/_own.py": "",
    "tools/verify.py": (
        "import pkg.formats._common\n"
        "from ..formats import _common, a\n"
        "from ..formats.a import _f, f\n"
        "from .._system import usable, _limit\n"
        "from . import _own\n"
        "from ._own import _x\n"),
    # format-name branches outside the registry and the format's package (reported), and messages (not)
    "cli/store.py": (
        "def f(fmt, m, n):\n"
        "    if fmt == 'hdf5' or m['format'] != 'lmdb':\n"
        "        return {'shards': 1}\n"
        "    if fmt in ('x', 'lmdb'):\n"
        "        raise ValueError(f'{fmt}: use a .h5 file or --format hdf5')\n"
        "    match n:\n"
        "        case 'shards':\n"
        "            return 'shards'\n"),
    "formats/c/__init__.py": "def f(fmt):\n    return fmt == 'hdf5'\n",
    # private members of another module's object (reported), and of this module's own class (not)
    "data/gpu/__init__.py": "",
    "data/gpu/loader.py": (
        "def f(ds):\n"
        "    ds.conversion(self._cache, cls._table)\n"
        "    ds._finish(1)\n"
        "    return getattr(ds, '_held', getattr(ds, 'data'))\n"
        "class Own:\n"
        "    def _step(self):\n"
        "        return self._n\n"
        "def g(own):\n"
        "    return own._step(), getattr(own, '_n')\n"),
}


@pytest.fixture
def fake(tmp_path):
    root = tmp_path / "pkg"
    for name, text in FAKE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_fake_package_graph(fake):
    graph = import_graph(fake)
    assert graph["pkg"] == {"pkg.data", "pkg.data.loader"}
    assert graph["pkg.units"] == {"pkg.errors"}
    assert graph["pkg._system"] == set()
    assert graph["pkg.cli"] == {"pkg", "pkg.tools", "pkg.tools.bench"}
    assert graph["pkg.formats"] == {"pkg.formats.a"}  # the registry's import_module
    # the function-level import, and data/__init__ run on the way to data.loader
    assert graph["pkg.formats.a"] == {"pkg.errors", "pkg.data", "pkg.data.loader"}
    # formats/__init__ runs before formats.a; both branches of TYPE_CHECKING count (tools/__init__
    # on the way to tools.bench); data/__init__ is the importer's own package: no edge
    assert graph["pkg.data.loader"] == {"pkg.formats", "pkg.formats.a", "pkg.units", "pkg.tools", "pkg.tools.bench"}
    assert graph["pkg.tools.bench.run"] == {"pkg.formats", "pkg.data", "pkg.data.loader"}


def test_fake_package_faults_are_all_reported(fake):
    graph = import_graph(fake)
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert all(b in graph[a] for a, b in itertools.pairwise(cycle))  # a real path through the graph
    assert {"pkg.formats.a", "pkg.data.loader"} <= set(cycle)
    assert layer_violations(graph, "pkg") == ["pkg.data.loader -> pkg.tools", "pkg.data.loader -> pkg.tools.bench",
                                              "pkg.formats.a -> pkg.data", "pkg.formats.a -> pkg.data.loader"]
    assert shadowing_names(fake) == ["pkg.formats.json", "pkg.tools.open"]
    assert line_counts(fake)["pkg.tools.open"] == 700


def test_fake_leaf_and_data_violations_are_reported(fake):
    (fake / "units.py").write_text("def f():\n    from .formats import a\n")
    (fake / "data" / "__init__.py").write_text("from ..conversion import job\n")
    (fake / "conversion").mkdir()
    (fake / "conversion" / "__init__.py").write_text("")
    (fake / "conversion" / "job.py").write_text("import pkg\n")
    graph = import_graph(fake)
    assert layer_violations(graph, "pkg") == [
        "pkg.conversion.job -> pkg",
        "pkg.data -> pkg.conversion",
        "pkg.data -> pkg.conversion.job",
        "pkg.data.loader -> pkg.tools",
        "pkg.data.loader -> pkg.tools.bench",
        "pkg.formats.a -> pkg.data",
        "pkg.formats.a -> pkg.data.loader",
        "pkg.units -> pkg.formats",
        "pkg.units -> pkg.formats.a",
    ]


def test_acyclic_fake_package_has_no_cycle(fake):
    (fake / "formats" / "a.py").write_text("from ..errors import E\n")
    assert find_cycle(import_graph(fake)) is None


def test_a_typing_only_loop_is_a_cycle(fake):
    (fake / "formats" / "a.py").write_text("from ..errors import E\n")
    (fake / "data" / "view.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loader import Loader\n")
    (fake / "data" / "loader.py").write_text("from .view import View\n")
    cycle = find_cycle(import_graph(fake))
    assert cycle is not None and set(cycle) == {"pkg.data.view", "pkg.data.loader"}


def test_fake_private_imports_are_reported(fake):
    assert private_imports(fake) == [
        "pkg.tools.verify: pkg._system._limit",
        "pkg.tools.verify: pkg.formats._common",
        "pkg.tools.verify: pkg.formats._common",
        "pkg.tools.verify: pkg.formats.a._f",
    ]


def test_fake_private_members_are_reported(fake):
    assert private_members(fake) == [
        "pkg.data.gpu.loader:3: ds._finish",
        "pkg.data.gpu.loader:4: getattr(ds, '_held', getattr(ds, 'data'))",
    ]


def test_fake_format_name_branches_are_reported(fake):
    (fake / "formats" / "__init__.py").write_text("_MODULES = {'hdf5': 'pkg.formats.c'}\n")   # the registry
    (fake / "formats" / "hdf5").mkdir()
    (fake / "formats" / "hdf5" / "__init__.py").write_text("def f(fmt):\n    return fmt == 'hdf5'\n")
    assert format_name_branches(fake) == [
        "pkg.cli.store:2: fmt == 'hdf5'",
        "pkg.cli.store:2: m['format'] != 'lmdb'",
        "pkg.cli.store:3: {'shards': 1}",
        "pkg.cli.store:4: fmt in ('x', 'lmdb')",
        "pkg.cli.store:7: 'shards'",
        "pkg.formats.c:2: fmt == 'hdf5'",
    ]
    assert format_name_branches(fake, {"cli.store:shards": "why"})[2:4] == [
        "pkg.cli.store:4: fmt in ('x', 'lmdb')", "pkg.formats.c:2: fmt == 'hdf5'"]
