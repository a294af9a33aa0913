"""The two servers' vectors of the same texts, side by side: cosine similarity per text."""

import json
import sys
from pathlib import Path

import numpy as np

a, b = (Path(p) for p in sys.argv[1:3])
va, vb = np.load(a / "vectors.npy"), np.load(b / "vectors.npy")
cos = np.sum(va * vb, axis=1) / (np.linalg.norm(va, axis=1) * np.linalg.norm(vb, axis=1))
ra, rb = (json.loads((p / "result.json").read_text()) for p in (a, b))
print(f"cosine similarity of {len(cos)} texts' vectors: min {cos.min():.6f}, mean {cos.mean():.6f}")
print(f"tokens of the fixed texts: {ra['fixed_tokens']} / {rb['fixed_tokens']}")
for name, r in ((a.name, ra), (b.name, rb)):
    t = r["alone"]
    print(f"{name}: {t['docs']} docs, {t['tokens']} tokens in {t['seconds']} s: "
          f"{t['tokens_per_s']} tokens/s, {t['docs_per_s']} docs/s")
