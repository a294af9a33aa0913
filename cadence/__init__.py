"""cadence: a JAX/XLA inference engine for Llama-family decoders under a mixed chat + document load.

The layers live in the repository's top-level folders and install as subpackages of this one
(`pyproject.toml` maps them): `cadence.model`, `cadence.checkpoints`, `cadence.engine`,
`cadence.scheduler`, `cadence.server`, `cadence.bench`. Imports point one way:
server -> scheduler -> engine -> model, and checkpoints -> model.

Imported from a source checkout (this file beside the layer folders), the checkout's own folders
are the subpackages, so `python -m cadence.server.serve_cli` run from the root of any checkout
serves that checkout's code, installed or not. `cadence-bench compare` relies on it to serve an
older revision beside this one. An installed wheel has no such folders, and this does nothing.
"""

from importlib import metadata as _metadata
from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "engine" / "engine.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's own __path__)

try:
    __version__ = _metadata.version("cadence")
except _metadata.PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"
