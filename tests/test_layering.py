"""The layers' boundaries, read from the source: no import runs up the layers (`LAYERS`), no
modules import each other in a circle, no test module imports another, and no file or class
outgrows its room. And those that can be checked by importing: the engine's contract with the
scheduler (`engine.api`), sampling's host side (`model.host_sampling`) and the integer
arithmetic every layer shares (`model.arith`) import no JAX, so a scheduler that imports only them
(and its fake-engine tests) never loads it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("module", ["cadence.engine.api", "cadence.model.host_sampling", "cadence.model.arith"])
def test_imports_no_jax(module):
    code = (f"import sys, {module}\n"
            "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
            "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# -- the import graph, read from the source (no import runs) -------------------------------

ROOT = Path(__file__).resolve().parent.parent
# Each layer may import the layers before it, never one after (docs/architecture.md).
LAYERS = ("model", "checkpoints", "engine", "scheduler", "server", "bench")


def _modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            if "results" in path.relative_to(ROOT).parts:  # result folders' own scripts
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(("cadence", *parts)).removesuffix(".__init__")] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The cadence modules `path` imports anywhere (functions too, not under TYPE_CHECKING)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cadence"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("cadence."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in modules}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_no_import_runs_up_the_layers(graph):
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                if LAYERS.index(b.split(".")[1]) > LAYERS.index(a.split(".")[1]))
    assert not up, up


def test_no_import_circle(graph):
    """No modules import each other in a loop, counting imports inside functions (a deferred
    import is still a circle a reader must untie)."""
    circles, done = [], set()

    def walk(name: str, path: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                walk(target, path + [target])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            walk(name, [name])
    assert not circles, circles


def test_tests_import_helpers_not_other_tests():
    """Shared test code lives in helper modules (`tests/fakes.py`, `tests/serving.py`, ...),
    so running or reading one test file never depends on another."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.test_"):
                found.append(f"{path.name}: from {node.module}")
    assert not found, found


MAX_FILE_LINES, MAX_CLASS_LINES = 700, 400


def test_no_file_or_class_outgrows_its_room():
    """A file over 700 lines, or a class over 400, is doing several jobs: split it along its
    seams (as `Scheduler` is into `submission`, `dispatch`, `outcomes` and `stats`)."""
    too_big = []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_big.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_big.append(f"{path.relative_to(ROOT)}: class {node.name}, "
                               f"{node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big
