"""Seconds to convert a GGUF into cadence's cache (what a first start does), in a fresh cache.

    python bench/results/gemma3-cpu/convert_time.py gemma3.gguf

Run from a checkout (`PYTHONPATH` at it): prints the seconds `checkpoints.registry.resolve`
took, the metadata read included.
"""

import sys
import tempfile
import time
from pathlib import Path

from cadence.checkpoints import registry

start = time.perf_counter()
registry.resolve(str(Path(sys.argv[1]).resolve()), Path(tempfile.mkdtemp(prefix="convert-")))
print(f"converted in {time.perf_counter() - start:.1f} s")
