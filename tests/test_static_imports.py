"""Every import in the layers and the tests resolves to a file for a static reader.

cadence's imports say `cadence.engine...` while the code sits in `engine/`; cadence/ holds a
relative symlink to each layer folder, so the import names a path on disk that pyright (and an
IDE's go-to-definition, and any import-graph tool) follows. This runs pyright with the project's
`[tool.pyright]` settings (pyproject.toml: import resolution only, no type checking) over the
layer folders and the tests, and asserts that it reports no import it could not resolve.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("model", "checkpoints", "engine", "scheduler", "server", "bench")
IMPORT_RULES = ("reportMissingImports", "reportMissingModuleSource")


def _pyright() -> list[str]:
    here = Path(sys.executable).parent / "pyright"
    if here.is_file():
        return [str(here)]
    found = shutil.which("pyright")
    if found is None:
        pytest.skip("pyright is not installed (it is in the dev extra: pip install -e '.[dev]')")
    return [found]


def test_every_layer_folder_is_linked_from_the_package():
    for layer in LAYERS:
        link = ROOT / "cadence" / layer
        assert link.is_symlink() and os.readlink(link) == f"../{layer}", f"cadence/{layer} -> ../{layer}"
        assert link.resolve() == (ROOT / layer).resolve()


# The full tier: pyright takes ~50 s on 2 cores. The default tier keeps the links it follows
# (the test above), and the tests import nearly every module of the layers, running its imports.
@pytest.mark.slow
def test_pyright_resolves_every_import():
    # --pythonpath: third-party imports resolve against the environment running the tests,
    # wherever its virtual environment lives.
    done = subprocess.run([*_pyright(), "--outputjson", "--pythonpath", sys.executable],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYRIGHT_PYTHON_IGNORE_WARNINGS="1"))
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright did not report (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    checked = report["summary"]["filesAnalyzed"]
    assert checked >= len(list((ROOT / "engine").glob("*.py"))), report["summary"]
    unresolved = [f"{Path(d['file']).relative_to(ROOT)}:{d['range']['start']['line'] + 1}: {d['message']}"
                  for d in report["generalDiagnostics"] if d.get("rule") in IMPORT_RULES]
    assert not unresolved, "imports a static reader cannot follow:\n" + "\n".join(unresolved)
