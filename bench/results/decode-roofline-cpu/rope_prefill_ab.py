"""A 512-token prefill chunk of SmolLM2-135M (XLA attention, float32) with RoPE looked up in the
engine's table against computed in the program, interleaved, and the logits of both compared.

    .venv/bin/python bench/results/decode-roofline-cpu/rope_prefill_ab.py
"""
import time, numpy as np, jax, jax.numpy as jnp
from checkpoints.registry import load_model
from model.llama import forward, rope_table
from model.paged_kv import PagedKVCache
m = load_model("smollm2-135m"); cfg = m.config
params = jax.tree.map(jnp.asarray, m.params)
T, page = 512, 64
cache = PagedKVCache.create(cfg, T // page + 1, page)
tokens = jnp.asarray(np.random.default_rng(0).integers(100, cfg.vocab_size, (1, T)), jnp.int32)
positions = jnp.arange(T, dtype=jnp.int32)[None]
lengths = jnp.asarray([T], jnp.int32); table = jnp.arange(T // page, dtype=jnp.int32)[None]
idx = jnp.asarray([T - 1], jnp.int32)
tab = rope_table(cfg, 4096)
run = jax.jit(lambda p, c, r: forward(p, tokens, positions, lengths, c, table, config=cfg, logit_index=idx, attention="xla", rope_table=r)[0])
run0 = jax.jit(lambda p, c: forward(p, tokens, positions, lengths, c, table, config=cfg, logit_index=idx, attention="xla")[0])
a, b = run(params, cache, tab), run0(params, cache)
print("max |diff| of logits", float(jnp.max(jnp.abs(a - b))))
t = {"table": [], "computed": []}
for _ in range(8):
    s = time.perf_counter(); run(params, cache, tab).block_until_ready(); t["table"].append(time.perf_counter() - s)
    s = time.perf_counter(); run0(params, cache).block_until_ready(); t["computed"].append(time.perf_counter() - s)
print({k: round(float(np.median(v)) * 1e3) for k, v in t.items()}, "ms per 512-token prefill chunk")
