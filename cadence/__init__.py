"""cadence: a JAX/XLA inference engine for Llama-family decoders under a mixed chat + document load.

The layers live in the repository's top-level folders, and this package holds a relative symlink
to each (`cadence/engine -> ../engine`, ...): `cadence.model`, `cadence.checkpoints`,
`cadence.engine`, `cadence.scheduler`, `cadence.server`, `cadence.bench`. Every `cadence.*`
import is then a path on disk, which static readers (pyright, an IDE's go-to-definition) follow;
a built wheel carries the files themselves. Imports point one way:
server -> scheduler -> engine -> model, and checkpoints -> model.

`python -m cadence.server.serve_cli` run from the root of any checkout serves that checkout's
code, installed or not (the working directory comes first on the path);
`cadence-bench compare` relies on it to serve an older revision beside this one.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("cadence")
except _metadata.PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"
