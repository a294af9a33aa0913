"""The grouped CPU kernels over float32 activations and over int8 ones (--cpu_activations), on
Qwen2.5-0.5B's matrix shapes in each of its file's formats: ms per call, one call after another
in a jitted program's loop.

    python bench/results/int8-activations-cpu/kernels.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model import block_layout, cpu_kernels

rng = np.random.default_rng(0)


def random_matrix(fmt: str, k: int, n: int) -> np.ndarray:
    """A random [k, n] matrix in `fmt`'s records (codes and scales over their whole ranges)."""
    if fmt in ("q4k", "q5k", "q6k"):
        d = rng.uniform(1e-4, 2e-3, (k // 256, n)).astype(np.float16)
        if fmt == "q6k":
            return block_layout.pack_superblocks(fmt, rng.integers(-32, 32, (k, n)), d,
                                                rng.integers(-128, 128, (k // 16, n)), None, None)
        return block_layout.pack_superblocks(
            fmt, rng.integers(0, 16 if fmt == "q4k" else 32, (k, n)), d,
            rng.integers(0, 64, (k // 32, n)), rng.uniform(1e-4, 2e-3, (k // 256, n)).astype(np.float16),
            rng.integers(0, 64, (k // 32, n)))
    scale = rng.uniform(1e-3, 5e-2, (k // 32, n)).astype(np.float16)
    if fmt == "q8":
        return block_layout.pack_grouped(rng.integers(-127, 128, (k, n)).astype(np.int8), scale, fmt=fmt)
    return block_layout.pack_grouped(rng.integers(-16, 16, (k, n)).astype(np.int8), scale, fmt=fmt)


# (format, K, N): Qwen2.5-0.5B's gate/up (Q5_0, fused), down (Q4_K and Q6_K), tied head (Q8_0,
# a quarter of its 151,936 columns)
SHAPES = [("q5", 896, 2 * 4864), ("q4k", 4864, 896), ("q6k", 4864, 896), ("q8", 896, 151936 // 4)]
print("| format | K x N | rows | float32 ms | int8 ms | speed-up |")
print("| --- | --- | --- | --- | --- | --- |")
for fmt, k, n in SHAPES:
    blocked = jnp.asarray(random_matrix(fmt, k, n))
    for rows in (1, 4, 8):
        x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
        ms = {}
        for kind in cpu_kernels.ACTIVATIONS:
            with cpu_kernels.activations(kind):
                fn = jax.jit(lambda x, b: cpu_kernels.blocked_matmul(x, b, n))
                fn(x, blocked).block_until_ready()
            start = time.perf_counter()
            for _ in range(50):
                y = fn(x, blocked)
            y.block_until_ready()
            ms[kind] = (time.perf_counter() - start) / 50 * 1e3
        print(f"| {fmt} | {k} x {n} | {rows} | {ms['float32']:.3f} | {ms['int8']:.3f} | "
              f"{ms['float32'] / ms['int8']:.2f}x |")
