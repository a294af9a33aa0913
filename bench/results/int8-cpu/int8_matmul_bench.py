"""Weight-only int8 matmuls on this backend: does XLA fuse the int8 -> float conversion?

    python bench/results/int8-cpu/int8_matmul_bench.py     # from a checkout's root, cadence installed

Times, at SmolLM2-135M's decode shapes, x [rows, in] f32 against a weight [in, out] held as
f32, or as int8 converted inside the program (`model.llama.Linear`'s form), or fed to the dot
as int8 with a float32 result type, and the conversion alone. Where the conversion is fused
into the matmul the int8 forms read a quarter of the bytes and win; where it is not, they pay
for writing and reading a float copy of the weight on every call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cadence.bench import roofline

def timed(fn, *args) -> float:
    return roofline.timed(lambda: fn(*args), 30)


SHAPES = [(1, 576, 1536), (8, 576, 1536), (8, 1536, 576), (1, 576, 49152)]  # MLP, MLP down, LM head


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0]}, JAX {jax.__version__}")
    print(f"{'rows x in x out':>18} {'f32':>9} {'int8->f32':>10} {'int8 dot':>9} {'convert':>9}  (ms, medians)")
    dims = (((1,), (0,)), ((), ()))
    for rows, i, o in SHAPES:
        x = jnp.asarray(rng.standard_normal((rows, i)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((i, o)), jnp.float32)
        q = jnp.asarray(rng.integers(-127, 128, (i, o)), jnp.int8)
        s = jnp.ones((o,), jnp.float32)
        f32 = timed(jax.jit(lambda x, w: x @ w), x, w) * 1e3
        converted = timed(jax.jit(lambda x, q, s: (x @ q.astype(jnp.float32)) * s), x, q, s) * 1e3
        mixed = timed(jax.jit(lambda x, q, s: jax.lax.dot_general(
            x, q, dims, preferred_element_type=jnp.float32) * s), x, q, s) * 1e3
        convert = timed(jax.jit(lambda q: q.astype(jnp.float32)), q) * 1e3
        print(f"{f'{rows} x {i} x {o}':>18} {f32:9.3f} {converted:10.3f} {mixed:9.3f} {convert:9.3f}")


if __name__ == "__main__":
    main()
