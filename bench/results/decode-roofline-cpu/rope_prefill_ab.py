"""A 512-token prefill chunk of SmolLM2-135M (XLA attention, float32) with RoPE's cos and sin
looked up in the engine's table, against computed in the program: both timed interleaved in one
process, and their logits compared.

    .venv/bin/python bench/results/decode-roofline-cpu/rope_prefill_ab.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from cadence.checkpoints.registry import load_model
from cadence.model.llama import forward, rope_table
from cadence.model.paged_kv import PagedKVCache

TOKENS, PAGE, ROUNDS = 512, 64, 8


def main() -> None:
    model = load_model("smollm2-135m")
    config = model.config
    params = jax.tree.map(jnp.asarray, model.params)
    cache = PagedKVCache.create(config, TOKENS // PAGE + 1, PAGE)
    tokens = np.random.default_rng(0).integers(100, config.vocab_size, (1, TOKENS)).astype(np.int32)
    positions = np.arange(TOKENS, dtype=np.int32)[None]
    lengths = np.array([TOKENS], np.int32)
    pages = np.arange(TOKENS // PAGE, dtype=np.int32)[None]
    last = np.array([TOKENS - 1], np.int32)
    table = rope_table(config, 4096)

    @jax.jit
    def chunk(params, cache, table, tokens, positions, lengths, pages, last):
        # every input an argument: positions known when compiling would let XLA fold the cos
        # and sin into constants
        logits, _ = forward(params, tokens, positions, lengths, cache, pages, config=config,
                            logit_index=last, attention="xla", rope_table=table)
        return logits

    inputs = (tokens, positions, lengths, pages, last)
    runs = {"table": lambda: chunk(params, cache, table, *inputs),
            "computed": lambda: chunk(params, cache, None, *inputs)}
    diff = jnp.max(jnp.abs(runs["table"]() - runs["computed"]()))
    print("max |diff| of logits", float(diff))
    times = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            start = time.perf_counter()
            run().block_until_ready()
            times[name].append(time.perf_counter() - start)
    print({name: round(float(np.median(t)) * 1e3) for name, t in times.items()},
          "ms per 512-token prefill chunk")


if __name__ == "__main__":
    main()
