"""The CPU paged-decode attention kernel alone, over one layer's pool of each dtype: SmolLM2's
shape (9 query heads over 3 KV heads of 64), 8 rows each at 4,032 tokens of context in pages
of 64, the median of 50 calls after one.

    python bench/results/kv8-cpu/kernel.py > bench/results/kv8-cpu/kernel.txt
"""

import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model import cpu_kernels

KV_HEADS, HEADS, HEAD_DIM, PAGE, WIDTH, ROWS = 3, 9, 64, 64, 63, 8


def main() -> None:
    rng = np.random.default_rng(0)
    pages = ROWS * WIDTH
    table = np.arange(pages, dtype=np.int32).reshape(ROWS, WIDTH)
    positions = np.full((ROWS, 1), WIDTH * PAGE - 1, np.int32)
    q = rng.standard_normal((ROWS, 1, HEADS, HEAD_DIM)).astype(np.float32)
    keys, values = (rng.standard_normal((KV_HEADS, pages, PAGE, HEAD_DIM)).astype(np.float32) for _ in range(2))
    attend = jax.jit(cpu_kernels.paged_decode)
    print(f"{platform.processor() or platform.machine()}, {jax.devices()[0]}, JAX {jax.__version__}")
    print(f"one layer: {ROWS} rows x {WIDTH * PAGE} tokens, {KV_HEADS} KV heads of {HEAD_DIM}, {HEADS} query heads")
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2):
        k, v = jnp.asarray(keys, dtype), jnp.asarray(values, dtype)
        attend(q, k, v, table, positions).block_until_ready()
        times = []
        for _ in range(50):
            start = time.perf_counter()
            attend(q, k, v, table, positions).block_until_ready()
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        read = (k.nbytes + v.nbytes) / 2**20
        print(f"{jnp.dtype(dtype).name:14s} {ms:6.2f} ms   {read:6.1f} MiB of keys and values read, "
              f"{read / 1024 / (ms / 1e3):5.1f} GiB/s")


if __name__ == "__main__":
    main()
