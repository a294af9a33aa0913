"""One process: load_model on a checkpoint (converting it first where the cache lacks it), and
print the seconds, the peak resident memory above the process's start, and the converted
folder's bytes. python measure.py <checkpoint> [dtype]; with AS_SERVED=1 in the environment,
inside `memory.loading()` and with `memory.release_free()` after, as cadence-serve loads."""
import contextlib
import json
import os
import subprocess
import sys
import time

import cadence  # noqa: F401 (XLA's flags first)
import jax.numpy as jnp

from cadence.checkpoints.registry import load_model
from cadence.server import memory


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


jnp.zeros(1).block_until_ready()
start, base = time.monotonic(), status("VmRSS")
with memory.loading() if os.environ.get("AS_SERVED") else contextlib.nullcontext():
    model = load_model(sys.argv[1], dtype=sys.argv[2] if len(sys.argv) > 2 else None)
if os.environ.get("AS_SERVED"):
    memory.release_free()
seconds = time.monotonic() - start
size = int(subprocess.run(["du", "-sb", str(model.path)], capture_output=True, text=True).stdout.split()[0])
dtypes = sorted({str(a.dtype) for a in __import__("jax").tree.leaves(model.params)})
print(json.dumps({"seconds": round(seconds, 1), "peak_MiB": round((status("VmHWM") - base) / 2**20),
                  "held_MiB": round((status("VmRSS") - base) / 2**20),
                  "converted_MiB": round(size / 2**20), "params_dtypes": dtypes}))
