"""Prefill over the CPU kernels' blocks against prefill over a float32 [in, out] tree, two
engines of one model in one process, alternating.

    python bench/results/prefill-blocks-cpu/ab_prefill.py [MODEL] [CHUNKS]

MODEL: a registry name or a GGUF path (default smollm2-135m); CHUNKS: prefill chunk lengths,
comma-separated (default 64,128,512). "float tree": decode_matmul="xla", whose prefill reads the
[in, out] float32 matrices, as every engine's prefill did before it read the blocks; "blocks":
decode_matmul="cpu" over the checkpoint's own blocks (`--weights=auto`), whose prefill takes
XLA's GEMM over each matrix dequantized in turn (`cpu_kernels.matmul`). Prints, per chunk
length, the median and least of 7 timed prefills of one chunk each (prompt tokens per second),
and the bytes of weights each engine holds."""

import sys
import time

import jax
import numpy as np

from cadence.checkpoints.registry import load_model
from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk
from cadence.model import cpu_kernels
from cadence.model.host_sampling import RequestSampling, SamplingRows

model = load_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")
lengths = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "64,128,512").split(",")]
packed = {p: b for p, (b, _) in model.packed.items()}
float_bytes = sum(a.nbytes for a in jax.tree.leaves(model.params))
rng = np.random.default_rng(0)
for n in lengths:
    config = EngineConfig(num_slots=1, max_seq_len=max(1024, n), prefill_chunk=n, min_prefill_bucket=n,
                          attention="cpu")
    engines = {"float tree": Engine(model.params, model.config, config),
               "blocks": Engine(model.params, model.config,
                                EngineConfig(**{**config.__dict__, "decode_matmul": "cpu"}), packed=packed)}
    rows = SamplingRows(1)
    rows.set(0, RequestSampling())
    tokens = rng.integers(0, model.config.vocab_size, n).tolist()
    table = fixed_page_tables(config)[0]
    times = {name: [] for name in engines}
    for rep in range(8):
        for name, e in engines.items():
            e.recover()
            t = time.perf_counter()
            np.asarray(e.prefill([PrefillChunk(0, tokens, 0, True, table)], rows.params()))
            if rep:  # the first is compiling
                times[name].append(time.perf_counter() - t)
    print(f"chunk {n}: " + ", ".join(f"{name} {n / np.median(v):.0f} tokens/s (best {n / np.min(v):.0f})"
                                     for name, v in times.items()), flush=True)
    del engines
blocked = cpu_kernels.decode_params(model.params, packed)
print(f"weights held: float tree {float_bytes / 2**20:.0f} MiB (+ decode's blocked copy "
      f"{cpu_kernels.blocked_bytes(blocked) / 2**20:.0f} MiB, before); blocks "
      f"{sum(a.nbytes for a in jax.tree.leaves(blocked)) / 2**20:.0f} MiB in all (after)")
