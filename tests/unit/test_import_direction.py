"""Imports point one way: orchestrator -> workers -> parameter_server; tests import only tests/support.

Why a test and not a convention: a worker that imports the controller drags Ray-driver code (and its
import-time state) into every rank process, and a cycle between the layers makes each one impossible to
test or reason about alone. The check parses the source (no imports executed), so it also sees imports
made inside functions, which is where such shortcuts usually hide.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> the top-level packages its modules must never import, and why
FORBIDDEN = {
    "workers": ({"orchestrator"}, "workers run inside rank processes and must not depend on the driver side"),
    "parameter_server": (
        {"orchestrator", "workers"},
        "the parameter server is the bottom layer: it must not depend on the driver or the rank code",
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


def imported_names(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, at any nesting depth.

    ``importlib.import_module("x")`` with a literal name counts too: it is the same dependency spelled
    so that a plain grep would miss it.
    """
    module, is_package = _module_name(path, root), path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, _resolve(node, module, is_package)))
        elif _is_import_module_call(node):
            found.append((node.lineno, node.args[0].value))
    return found


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
