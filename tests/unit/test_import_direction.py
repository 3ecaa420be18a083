"""Imports point one way: orchestrator -> workers -> parameter_server; inside orchestrator/ and workers/ the
sub-packages are layered (``LAYERS``); no two modules import each other, even through others or inside a function;
tests import only tests/support.

Why a test and not a convention: a worker that imports the controller drags Ray-driver code (and its
import-time state) into every rank process, and a cycle between the layers makes each one impossible to
test or reason about alone. The check parses the source (no imports executed), so it also sees imports
made inside functions, which is where such shortcuts usually hide.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "workers", "parameter_server")

# package -> the top-level packages its modules must never import, and why
FORBIDDEN = {
    "workers": ({"orchestrator"}, "workers run inside rank processes and must not depend on the driver side"),
    "parameter_server": (
        {"orchestrator", "workers"},
        "the parameter server is the bottom layer: it must not depend on the driver or the rank code",
    ),
}

# Each package's sub-packages (a folder, or a module right under the package), lowest layer first. A module may
# import its own sub-package and the sub-packages of lower layers: never another of its own layer, never a higher
# one, never the package's own ``__init__`` (its front door, above every layer). docs/architecture.md ("Layer 1",
# "Layer 2") says what each layer is; test_the_docs_list_the_same_layers keeps the two the same.
LAYERS = {
    "orchestrator": (
        ("errors", "events", "records", "run_result", "units"),
        ("api",),
        ("checkpoints",),
        ("faults",),
        ("spec",),
        ("planning",),
        ("recovery",),
        ("observability",),
        ("runtime",),
        ("client",),
        ("cli",),
    ),
    "workers": (
        ("contract", "storage", "orphans", "group_sockets"),
        ("protocol",),
        ("model",),
        ("diagnostics", "spec", "offload"),
        ("optim", "state"),
        ("finetune",),
        ("parallel",),
        ("data",),
        ("evaluation",),
        ("step",),
        ("trainer",),
        ("loop",),
        ("rank_worker", "agent", "peak_memory_run"),
    ),
}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name an ``ImportFrom`` refers to (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


@dataclass(frozen=True)
class Import:
    """One import statement's target: ``names`` are what ``from x import a, b`` may mean (``x.a`` is a module, or
    ``a`` is a name in ``x``); ``typing`` when it sits under ``if TYPE_CHECKING:`` and so never runs."""

    line: int
    name: str
    names: tuple[str, ...] = ()
    typing: bool = False


def imports(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import in ``path``, at any nesting depth (inside functions, classes, ``if`` and ``try`` blocks).

    ``importlib.import_module("x")`` with a literal name counts too: it is the same dependency spelled
    so that a plain grep would miss it.
    """
    module, is_package = _module_name(path, root), path.name == "__init__.py"
    typing_nodes = set()
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_nodes |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
        typing = id(node) in typing_nodes
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name, typing=typing) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(Import(node.lineno, _resolve(node, module, is_package),
                                tuple(alias.name for alias in node.names), typing))
        elif _is_import_module_call(node):
            found.append(Import(node.lineno, node.args[0].value, typing=typing))
    return found


def imported_names(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, at any nesting depth."""
    return [(i.line, i.name) for i in imports(path, root)]


def _is_import_module_call(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name == "import_module" and isinstance(node.args[0].value, str)


def violations(package: str, root: Path = ROOT) -> list[str]:
    """One line per forbidden import: file:line, the importing module, what it imports and the rule it breaks."""
    banned, why = FORBIDDEN[package]
    out = []
    for path in sorted((root / package).rglob("*.py")):
        for line, name in imported_names(path, root):
            top = name.split(".")[0]
            if top in banned:
                where = f"{path.relative_to(root)}:{line}: {_module_name(path, root)} imports {name}"
                out.append(f"{where} (rule {package} -/-> {top}: {why})")
    return out


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_package_imports_point_one_way(package):
    assert (ROOT / package).is_dir()
    found = violations(package)
    assert not found, "import direction broken:\n" + "\n".join(found)


def test_no_test_imports_conftest():
    """conftest holds fixtures pytest injects; importing it runs it twice and hides where helpers live."""
    rule = "rule: tests never import conftest; shared helpers go in tests/support"
    found = [
        f"{path.relative_to(ROOT)}:{line}: imports {name} ({rule})"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line, name in imported_names(path)
        if "conftest" in name.split(".")
    ]
    assert not found, "\n".join(found)


def test_no_test_imports_another_test_module():
    """A helper living in a test module drags that module's tests into every importer; tests/support owns them."""
    rule = "rule: tests import helpers from tests/support, never from another test module"
    found = [
        f"{path.relative_to(ROOT)}:{line}: imports {name} ({rule})"
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        for line, name in imported_names(path)
        if name.split(".")[-1].startswith("test_") and name.startswith("tests.")
    ]
    assert not found, "\n".join(found)


def test_checker_sees_nested_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function and a relative one are both reported with their line."""
    pkg = tmp_path / "workers" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "workers" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import os\n\ndef f():\n    from orchestrator.runtime import controller\n")
    (pkg / "rel.py").write_text("from ..trainer import Trainer\n")
    assert imported_names(pkg / "mod.py", tmp_path) == [(1, "os"), (4, "orchestrator.runtime")]
    assert imported_names(pkg / "rel.py", tmp_path) == [(1, "workers.trainer")]
    (report,) = violations("workers", tmp_path)
    assert report.startswith("workers/sub/mod.py:4: workers.sub.mod imports orchestrator.runtime")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the three packages by its dotted name (a package by its ``__init__.py``)."""
    return {_module_name(path, root): path for package in PACKAGES if (root / package).is_dir()
            for path in sorted((root / package).rglob("*.py"))}


@functools.cache
def module_edges(root: Path = ROOT) -> dict[str, list[tuple[str, Import]]]:
    """module -> the modules of the three packages it imports, each with the import that does it.

    ``from x import a`` goes to ``x.a`` when that is a module, else to ``x``; ``import x.y`` to ``x.y``. The
    packages Python runs first on the way to a module (``x`` for ``x.y``) are not counted: every module would
    otherwise depend on its package's ``__init__``, which re-exports it. Parsed once per tree (read only).
    """
    known = modules(root)

    def target(name: str) -> str | None:
        parts = name.split(".")
        return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in known), None)

    edges = {}
    for module, path in known.items():
        out = []
        for imp in imports(path, root):
            heads = [f"{imp.name}.{n}" if f"{imp.name}.{n}" in known else imp.name for n in imp.names] or [imp.name]
            out += [(t, imp) for t in dict.fromkeys(map(target, heads)) if t and t != module]
        edges[module] = out
    return edges


def _subpackage(module: str) -> str | None:
    """``orchestrator.spec.checks.zero`` -> ``spec``; the package's own ``__init__`` -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_breaks(package: str, root: Path = ROOT, layers: dict = LAYERS) -> list[str]:
    """One line per import from a sub-package of ``package`` to one of its own layer or above (or to the package's
    ``__init__``, or to a sub-package no layer lists): file:line, who imports what, and both layers."""
    rank = {sub: i for i, layer in enumerate(layers[package]) for sub in layer}
    paths, out = modules(root), []
    for module, targets in module_edges(root).items():
        src = _subpackage(module)
        if module.split(".")[0] != package or src is None:
            continue
        for target, imp in targets:
            dst = _subpackage(target)
            if target.split(".")[0] != package or dst == src:
                continue
            if src not in rank or dst not in rank or rank[dst] >= rank[src]:
                where = f"{paths[module].relative_to(root)}:{imp.line}: {module} imports {target}"
                out.append(f"{where} ({_layer_of(src, rank)} may not import {_layer_of(dst, rank)})")
    return out


def _layer_of(sub: str | None, rank: dict[str, int]) -> str:
    if sub is None:
        return "the package's __init__"
    return f"{sub} (layer {rank[sub]})" if sub in rank else f"{sub} (in no layer of LAYERS)"


def import_cycles(root: Path = ROOT) -> list[list[tuple[str, Import]]]:
    """Each set of modules that import one another (Tarjan's strongly connected components over every import
    that runs, a function's included: only ``if TYPE_CHECKING:`` imports, which never run, are left out), as one
    cycle through it: [(module, the import that leads to the next one), ...]."""
    edges = {m: [(t, i) for t, i in out if not i.typing] for m, out in module_edges(root).items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt, _ in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while node not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(_one_cycle(min(component), component, edges))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _one_cycle(start: str, component: set[str], edges) -> list[tuple[str, Import]]:
    """A shortest path from ``start`` back to itself inside ``component`` (breadth first)."""
    paths, seen = [[(start, None)]], {start}
    while paths:
        path = paths.pop(0)
        for nxt, imp in edges[path[-1][0]]:
            if nxt in component:
                step = [*path[:-1], (path[-1][0], imp)]
                if nxt == start:
                    return step
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append([*step, (nxt, None)])
    raise AssertionError(f"no cycle through {start}")


def _describe(cycle: list[tuple[str, Import]]) -> str:
    """``a (line 3) -> b (line 9) -> a``: each module with the line of its import of the next."""
    return " -> ".join([*(f"{module} (line {imp.line})" for module, imp in cycle), cycle[0][0]])


@pytest.mark.parametrize("package", list(LAYERS))
def test_every_subpackage_is_in_one_layer(package):
    """A new folder or top-level module has to be placed in a layer (and the docs' table) before it can be used."""
    listed = [sub for layer in LAYERS[package] for sub in layer]
    present = {_subpackage(m) for m in modules() if m.split(".")[0] == package} - {None}
    assert sorted(present - set(listed)) == [], "sub-packages no layer lists: add each to LAYERS and the docs"
    assert sorted(set(listed) - present) == [], "LAYERS lists sub-packages that do not exist"
    assert len(listed) == len(set(listed))


@pytest.mark.parametrize("package", list(LAYERS))
def test_subpackages_import_only_lower_layers(package):
    """The layers are what keeps each sub-package testable and movable without the ones above it."""
    found = layer_breaks(package)
    assert not found, f"{len(found)} imports break the layers of {package}:\n" + "\n".join(found)


def test_no_import_cycles():
    """Not even through a function-level import: a cycle held open by a late import still ties both modules
    together (neither can be read, tested or moved alone), and its import order is a trap for the next change."""
    found = import_cycles()
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(map(_describe, found))


def test_the_docs_list_the_same_layers():
    """docs/architecture.md's table of each package's layers, highest first, names the same sub-packages."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    for package, layers in LAYERS.items():
        table = text[text.index(f"| `{package}/` layer |"):]
        rows = [line for line in table.split("\n\n")[0].splitlines()[2:]]
        listed = [tuple(re.findall(r"`(\w+)`", row.split("|")[1])) for row in rows]
        assert listed == list(reversed(layers)), f"docs/architecture.md's {package}/ layers differ from LAYERS"


def test_the_layer_and_cycle_checks_see_what_they_should(tmp_path):
    """The checkers themselves: an import one layer up, one to a sibling of the same layer, and a cycle closed by
    an import inside a function are each reported; an import under ``if TYPE_CHECKING:`` closes no cycle."""
    files = {
        "orchestrator/__init__.py": "",
        "orchestrator/low.py": "def f():\n    from orchestrator.high.mod import g\n",
        "orchestrator/side.py": "from orchestrator import low\n",
        "orchestrator/high/__init__.py": "",
        "orchestrator/high/mod.py": "from orchestrator.low import f\nfrom orchestrator.side import x\n",
        "orchestrator/high/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
        "orchestrator/high/b.py": "from orchestrator.high.a import y\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    breaks = layer_breaks("orchestrator", tmp_path, {"orchestrator": (("low", "side"), ("high",))})
    assert [b.split(" (")[0] for b in breaks] == [
        "orchestrator/low.py:2: orchestrator.low imports orchestrator.high.mod",
        "orchestrator/side.py:1: orchestrator.side imports orchestrator.low",
    ]
    (cycle,) = import_cycles(tmp_path)
    assert [(module, imp.line) for module, imp in cycle] == [("orchestrator.high.mod", 1), ("orchestrator.low", 2)]


# what runs without training a model: the CLI (`raymesh --help`, `status`, `plan`), the controller (in its own
# actor for a hosted run) and the Python client, and the job-file sections they share with the ranks
# (`workers.contract`). torch costs ~3 s of CPU to import on a 2-core machine.
TORCH_FREE = ["orchestrator.cli", "orchestrator.runtime.controller", "orchestrator.runtime.hosted",
              "orchestrator.client", "orchestrator.spec", "orchestrator.planning.estimate", "workers.data.prepare",
              "workers.contract.figures", "workers.contract.sections"]


def test_the_cli_controller_and_client_import_without_torch():
    """Each imports in a fresh interpreter without loading torch; the failure names the chain that pulled it in."""
    probe = ("import importlib, sys\n"
             "for name in sys.argv[1:]:\n"
             "    importlib.import_module(name)\n"
             "    assert 'torch' not in sys.modules, name\n")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", probe, *TORCH_FREE], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, _chain_to_torch(proc.stderr) + "\n" + proc.stderr[-2000:]


def _chain_to_torch(importtime: str) -> str:
    """``-X importtime``'s output read back: the modules from the first one importing torch up to the top."""
    rows = [line.split("|")[2] for line in importtime.splitlines()
            if line.startswith("import time:") and line.split("|")[0][12:].strip().isdigit()]
    start = next((i for i, n in enumerate(rows) if n.strip() == "torch"), None)
    if start is None:
        return "(no torch import seen)"
    depth, chain = len(rows[start]) - len(rows[start].lstrip()), ["torch"]
    for name in rows[start + 1:]:
        if len(name) - len(name.lstrip()) < depth:
            chain.append(name.strip())
            depth = len(name) - len(name.lstrip())
    return " <- ".join(chain)


def test_no_two_test_modules_share_a_name():
    """pytest imports test files by their base name (the test folders are not packages): two of one name in
    tests/unit and tests/integration stop the whole suite at collection."""
    names = [path.name for folder in ("unit", "integration") for path in (ROOT / "tests" / folder).glob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_no_file_holds_a_merge_conflict_marker():
    """A merge left unresolved in a docs table or a module reads as content: refuse it."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    marked = [name for name in tracked if name.endswith((".py", ".md", ".yaml", ".toml"))
              and any(line.startswith(("<<<<<<< ", ">>>>>>> ")) for line in (ROOT / name).read_text().splitlines())]
    assert marked == []
