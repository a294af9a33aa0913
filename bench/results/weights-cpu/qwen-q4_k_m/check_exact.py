"""Every matrix load_packed keeps of a GGUF unpacks to exactly load_gguf's float32 (gguf's
dequantizer): `python check_exact.py FILE.gguf` (run on the Q4_K_M file: 0 of 169 differ)."""

import collections
import sys

import numpy as np

from cadence.checkpoints.gguf import load_gguf, load_packed
from cadence.model import block_layout
from cadence.model import params as params_lib

config, floats, _ = load_gguf(sys.argv[1])
packed = load_packed(sys.argv[1], config)
print(dict(collections.Counter(kind for _, kind in packed.values())))
differ = []
for path, (blocks, kind) in packed.items():
    want = params_lib.get(floats, path)
    want = want.T if path[-1] == "embedding" else want
    if not np.array_equal(block_layout.unpack_grouped(blocks, want.shape[1]), want):
        differ.append(("/".join(path), kind))
print(f"{len(differ)} of {len(packed)} packed matrices differ from the dequantized floats: {differ}; "
      f"packed {sum(b.nbytes for b, _ in packed.values()) / 2**20:.0f} MiB")
