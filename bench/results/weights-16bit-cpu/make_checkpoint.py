"""A Hugging Face checkpoint of random bfloat16 weights in SmolLM2-1.7B's shape (1.7B
parameters, 3.4 GB), with the default model's tokenizer files (the same vocabulary).

    python make_checkpoint.py <out folder> <folder holding tokenizer.json>
"""
import dataclasses
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from cadence.checkpoints.hf import save_hf
from cadence.model.config import SMOLLM2_135M
from cadence.model.params import random_params

SHAPE = dataclasses.replace(SMOLLM2_135M, name="smollm2-1.7b-shape", hidden_size=2048, num_layers=24,
                            num_heads=32, num_kv_heads=32, head_dim=64, ffn_size=8192)

out, tokenizer = Path(sys.argv[1]), Path(sys.argv[2])
params = random_params(SHAPE, jax.random.key(0), jnp.bfloat16)
save_hf(out, SHAPE, jax.tree.map(lambda a: jax.device_get(a), params), dtype="bfloat16")
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tokenizer / name, out / name)
print(f"wrote {out}: {sum(a.size for a in jax.tree.leaves(params)) / 1e9:.2f}B parameters")
