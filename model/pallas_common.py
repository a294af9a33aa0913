"""What the two Pallas attention kernels share: the lowering choice, masking constants, sizes.

Lowering: the kernels are Triton-style Pallas (`pl.pallas_call` over a grid, pointer-style
`load`/`store` with masks from `jax.experimental.pallas.triton`), pinned to the Triton backend
with its compiler params (the GPU default in JAX >= 0.10 is Mosaic GPU). The same kernels run on
the CPU with `interpret=True`, where the tests check them against the XLA reference, and the
tests also lower them for CUDA and verify the Triton module; compiling and timing them on a GPU
is `bench/gpu_bench.py`'s job. JAX 0.11 deprecates the Triton backend in favour of Mosaic GPU
(still present there); a Mosaic GPU port belongs behind the same `attend` interface.

Numerics: scores are kept in base 2 (the 1/sqrt(d) scale is multiplied by log2(e) once) so the
online softmax uses `exp2`. "Minus infinity" is a large finite number: `exp2(NEG - m)` underflows
to 0 and `NEG - NEG` is 0, so a row that has seen no key yet never produces NaN.

Sliding windows (Gemma 3's) reach both kernels as each query's first visible key
(`first_keys`), beside its position: zeros without a window, so the kernels are one code path.

Non-goals: paged KV here (`model.pallas_paged` views pages as these kernels' tiles),
soft-capping, backward passes.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cadence.model.control import compiled_kernels, default_interpret  # noqa: F401 - the kernels' names

NEG = -1e30  # finite minus-infinity for float32 scores (see the module docstring)
LOG2_E = 1.4426950408889634
MIN_DOT = 16  # Triton's tensor-core dot needs every matmul dimension >= 16


def first_keys(q_positions: jax.Array, window, kv_len: int) -> jax.Array:
    """Each query's first visible key: 0, or with a sliding `window` ([] int32) the window's
    first, max(0, position - window + 1) (clipped to kv_len)."""
    if window is None:
        return jnp.zeros(q_positions.shape, jnp.int32)
    return jnp.clip(q_positions.astype(jnp.int32) - window + 1, 0, kv_len)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def score_scale(head_dim: int) -> float:
    """1/sqrt(head_dim) in base 2: exp2(s * this) == exp(s / sqrt(head_dim))."""
    return LOG2_E / math.sqrt(head_dim)


def dot_precision(dtype) -> Any:
    """float32 inputs get full-precision dots (Triton would otherwise use TF32 on GPU)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dot_nt(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [m, d] @ b[n, d]^T in float32."""
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def dot_nn(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [m, k] @ b [k, n] in float32."""
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def load(ref, mask=None, other=None):
    return pltriton.load(ref, mask=mask, other=other)


def store(ref, value, mask=None):
    pltriton.store(ref, value, mask=mask)


def triton_call(kernel, *, num_warps: int, num_stages: int, **kwargs):
    """`pl.pallas_call` pinned to the Triton lowering (the GPU default is Mosaic GPU)."""
    if "backend" in inspect.signature(pl.pallas_call).parameters:
        kwargs["backend"] = "triton"  # newer JAX selects the lowering by name
    return pl.pallas_call(
        kernel,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        **kwargs,
    )
