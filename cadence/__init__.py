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

import os as _os
from importlib import metadata as _metadata

# XLA:CPU's default scheduler orders a program for concurrency at any cost in memory: it
# dequantized every matrix of a prefill over the CPU kernels' blocks at once (416 MiB of
# temporaries for SmolLM2, fresh memory page-faulted in on every run, where ordered for memory
# it needs 5 MiB) and prefill ran at 0.54-0.84x the float32 tree's prompt rate; ordered for
# memory, at 0.96-1.09x (`bench/results/prefill-blocks-cpu/`). XLA reads its flags once, when
# JAX's backend starts, which importing cadence precedes in every front door; a user's own
# XLA_FLAGS naming the flag win.
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
if _SCHEDULER_FLAG not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = f"{_os.environ.get('XLA_FLAGS', '')} {_SCHEDULER_FLAG}=false".strip()

try:
    __version__ = _metadata.version("cadence")
except _metadata.PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"
