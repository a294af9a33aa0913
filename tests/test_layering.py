"""The layers' import boundaries that can be checked by importing: the engine's contract with the
scheduler (`engine.api`), sampling's host side (`model.host_sampling`) and the integer
arithmetic every layer shares (`model.arith`) import no JAX, so a scheduler that imports only them
(and its fake-engine tests) never loads it.

Each check runs in a fresh interpreter: in this process, other tests have imported JAX already.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["cadence.engine.api", "cadence.model.host_sampling", "cadence.model.arith"])
def test_imports_no_jax(module):
    code = (f"import sys, {module}\n"
            "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
            "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
