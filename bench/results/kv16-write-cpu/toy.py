"""One layer's KV write and prefill key-tile reads over a 16-bit pool on XLA:CPU, against the
CPU kernels: ms per call, and whether the compiled program holds the pool widened to float32.

    python bench/results/kv16-write-cpu/toy.py

A pool of 2 KV heads x 4096 pages x 64 tokens x 64 (64 MiB in bfloat16, a large one), 16 new
tokens written (a decode step of 16 rows), and 8 key tiles of 8 pages read in a loop (prefill).
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model import cpu_kernels, paged_kv

HEADS, PAGES, PAGE, D, ROWS = 2, 4096, 64, 64, 16
rng = np.random.default_rng(0)
table = rng.permutation(PAGES)[:ROWS * 4].reshape(ROWS, 4).astype(np.int32)
positions = np.full((ROWS, 1), 100, np.int32)
lengths = np.ones(ROWS, np.int32)
new = rng.standard_normal((ROWS, 1, HEADS, D)).astype(np.float32)
ids = jnp.asarray(rng.permutation(PAGES)[:64], jnp.int32)


def timed(fn, args, donate: bool, calls: int = 20) -> float:
    out = fn(*args)
    for _ in range(3 if donate else 1):
        out = fn(out, *args[1:]) if donate else fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(out, *args[1:]) if donate else fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def widened(fn, args) -> int:
    text = fn.lower(*args).compile().as_text()
    return text.count(f"f32[{HEADS},{PAGES},{PAGE},{D}]")


def read(pool, ids, take):
    def tile(j, acc):
        return acc + take(pool, jax.lax.dynamic_slice_in_dim(ids, j * 8, 8)).astype(jnp.float32).sum()
    return jax.lax.fori_loop(0, 8, tile, 0.0)


xla_take = functools.partial(jnp.take, axis=1, mode="clip")
for dtype in (jnp.float32, jnp.bfloat16):
    pool = jnp.zeros((HEADS, PAGES, PAGE, D), dtype)
    kernels = [False] + ([True] if dtype == jnp.bfloat16 else [])
    for kernel in kernels:
        fn = jax.jit(functools.partial(paged_kv.write, cpu_kernel=kernel), donate_argnums=(0,))
        args = (pool, new, table, positions, lengths)
        n = widened(fn, args)
        ms = timed(fn, (jnp.array(pool), *args[1:]), donate=True)
        print(f"write {jnp.dtype(dtype).name:8s} {'kernel' if kernel else 'scatter':8s}: {ms:8.3f} ms, "
              f"float32 pools in the program: {n}")
    for name, take in [("jnp.take", xla_take)] + ([("take_pages", cpu_kernels.take_pages)]
                                                   if dtype == jnp.bfloat16 else []):
        fn = jax.jit(functools.partial(read, take=take))
        print(f"read  {jnp.dtype(dtype).name:8s} {name:10s}: {timed(fn, (pool, ids), donate=False):8.3f} ms, "
              f"float32 pools in the program: {widened(fn, (pool, ids))}")
