"""The package's layout, read from its source with ``ast`` (nothing is imported).

DESIGN.md: dependencies point one way, cli -> tools/conversion/data -> formats ->
transforms/sources -> errors/_system/units, with no import cycle, function-level
imports included; modules stay a readable size; no module shadows a standard one.

The import graph has one node per module (a package is its ``__init__``) and an edge
for every import that can execute:

- every ``import`` and ``from ... import`` statement anywhere in a module (function
  bodies included), relative ones resolved; ``if TYPE_CHECKING:`` bodies are left out,
  since they never run;
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
"""

from __future__ import annotations

import ast
import builtins
import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dlstore"
MAX_LINES = 600

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
LEAVES = ("errors", "_system", "units")
LEAF_MAY_IMPORT = ("errors",)


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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _executable_nodes(tree: ast.AST):
    """Every node that can run: all of them but the bodies of ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _is_import_module_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))


def imported_names(module: str, path: Path, modules: set[str]) -> set[str]:
    """Absolute dotted names ``module`` (in file ``path``) imports; ``from P import n`` gives ``P.n``,
    which the caller cuts back to ``P`` where ``n`` is not a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    strings: set[str] = set()
    dynamic = False
    for node in _executable_nodes(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names.update(f"{target}.{alias.name}" for alias in node.names)
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
    assert "dlstore.data.gpu.dataset" not in graph["dlstore.data.gpu.loader"]  # only under TYPE_CHECKING


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lower_layers_never_import_higher_ones(graph):
    violations = layer_violations(graph, "dlstore")
    assert not violations, "imports against the layering (DESIGN.md):\n" + "\n".join(violations)


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
        "    from ..tools import bench\n"  # never runs: neither an edge nor a violation
        "else:\n"
        "    from .. import units\n"),
    "tools/__init__.py": "",
    "tools/bench/__init__.py": "",
    "tools/bench/run.py": "from ...formats import get\nimport pkg.data.loader\n",
    "tools/open.py": "x = 1\n" * 700,  # shadows a builtin, and too long
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
    # formats/__init__ runs before formats.a; TYPE_CHECKING left out, its else branch kept;
    # data/__init__ is the importer's own package: no edge
    assert graph["pkg.data.loader"] == {"pkg.formats", "pkg.formats.a", "pkg.units"}
    assert graph["pkg.tools.bench.run"] == {"pkg.formats", "pkg.data", "pkg.data.loader"}


def test_fake_package_faults_are_all_reported(fake):
    graph = import_graph(fake)
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert all(b in graph[a] for a, b in itertools.pairwise(cycle))  # a real path through the graph
    assert {"pkg.formats.a", "pkg.data.loader"} <= set(cycle)
    assert layer_violations(graph, "pkg") == ["pkg.formats.a -> pkg.data", "pkg.formats.a -> pkg.data.loader"]
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
        "pkg.formats.a -> pkg.data",
        "pkg.formats.a -> pkg.data.loader",
        "pkg.units -> pkg.formats",
        "pkg.units -> pkg.formats.a",
    ]


def test_acyclic_fake_package_has_no_cycle(fake):
    (fake / "formats" / "a.py").write_text("from ..errors import E\n")
    assert find_cycle(import_graph(fake)) is None
