"""What copying a page of KV costs on the CPU: XLA's scatter against the kernels' in-place write.

    python bench/results/qwen3-cpu/copy_pages.py > bench/results/qwen3-cpu/copy_pages.txt

One of the pool's two arrays (keys, or values) in Qwen3-0.6B's shape as the layer loop stacks
it, [28 layers, 8 KV heads, 512 pages, 64 tokens, 128] (1.8 GiB in bfloat16; with the values,
the 8 x 4096 tokens of `cadence-serve`'s default pool): one page copied
onto another in every layer (a partial prefix hit's copy; the other seven rows padding), the
pool donated, as the engine's copy program runs it (`model.paged_kv.copy_pages`). XLA:CPU
widens a 16-bit operand of a scatter to float32 and back, whole.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model import paged_kv

LAYERS, HEADS, PAGES, PAGE, DIM = 28, 8, 512, 64, 128

for dtype in (jnp.bfloat16, jnp.float32):
    for kernel in (False, True):
        pool = jnp.zeros((LAYERS, HEADS, PAGES, PAGE, DIM), dtype)
        copy = jax.jit(functools.partial(paged_kv.copy_pages, cpu_kernel=kernel), donate_argnums=0)
        sources, targets = np.zeros(8, np.int32), np.full(8, PAGES, np.int32)
        sources[0], targets[0] = 3, 7
        pool = copy(pool, sources, targets).block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            pool = copy(pool, sources, targets).block_until_ready()
            times.append((time.perf_counter() - start) * 1e3)
        print(f"{jnp.dtype(dtype).name:8s} {'kernels' if kernel else 'XLA':7s} "
              f"{pool.nbytes / 2**30:.1f} GiB: {' '.join(f'{t:.1f}' for t in times)} ms")
        del pool
