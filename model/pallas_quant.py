"""Weight-only grouped matmul for a GPU decode step: a Pallas kernel over int8 or int4 weights.

    w = pack_gpu(q, scale, minimum)             # once: GGUF-style groups of 32 input rows
    y = grouped_matmul(x, w)                    # x [M, K] (bf16 or f32) @ W [K, N] -> f32

A decode step reads every weight once, so on a GPU as on the CPU its time is the weights'
bytes; int8 halves bfloat16's and int4 quarters them. The format is the CPU kernels' arithmetic
(`model.cpu_kernels`, GGUF's Q8_0 / Q4_1): per column, each group of 32 input rows has a scale
(q8: W = q * scale) or a scale and a minimum (q4: W = q * scale + min, q in 0..15). The layout
is the GPU's own, a dict of arrays (`pack_gpu`):
    q      q8: int8 [K, N];  q4: uint8 [K / 2, N], group g's byte j holding row 32 g + j in its
           low nibble and row 32 g + 16 + j in its high one (GGUF's nibble order)
    scale  float32 [K / 32, N];  minimum (q4) float32 [K / 32, N]
Grid: one program per `block_n` output columns; each walks K a group at a time, widens the
group's codes to the activations' dtype in registers, scales them and accumulates x @ W in
float32 with tensor-core dots (q4's two half-groups are two 16-deep dots, so the nibbles are
never interleaved). Rows are padded to 16, Triton's smallest dot.

Checked in interpret mode against NumPy dequantize-then-matmul (`tests/test_pallas_quant.py`),
its Triton module verified for CUDA; `bench/gpu_bench.py` times it against XLA's bf16 matmul
when a GPU is lent. Non-goals: wiring it into the engine's decode program on the GPU (the
engine's GPU decode still reads bf16 or per-channel int8 through XLA), prefill (compute-bound:
dequantize once per chunk instead), activation quantization.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from cadence.model.pallas_common import MIN_DOT, default_interpret, dot_nn, dot_precision, load, store, triton_call

GROUP = 32
HALF = GROUP // 2


def pack_gpu(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The kernel's arrays for W [K, N] given as `model.quant.quantize_group_matrix` gives it:
    q int8 (q8) or codes 0..15 (q4) [K, N], scale and minimum [K / 32, N]."""
    k, n = q.shape
    if k % GROUP or scale.shape != (k // GROUP, n):
        raise ValueError(f"q {list(q.shape)} needs K a multiple of {GROUP} and scales [{k // GROUP}, {n}]")
    out = {"scale": np.asarray(scale, np.float32)}
    if minimum is None:
        out["q"] = np.asarray(q, np.int8)
        return out
    codes = np.asarray(q, np.uint8).reshape(k // GROUP, 2, HALF, n)
    out["q"] = (codes[:, 0] | (codes[:, 1] << 4)).reshape(k // 2, n)
    out["minimum"] = np.asarray(minimum, np.float32)
    return out


def dequantize_gpu(w: dict[str, np.ndarray]) -> np.ndarray:
    """The float32 W [K, N] `pack_gpu`'s arrays stand for (the slow path the kernel is checked
    against)."""
    scale = np.repeat(np.asarray(w["scale"], np.float32), GROUP, axis=0)
    if "minimum" not in w:
        return np.asarray(w["q"]).astype(np.float32) * scale
    packed = np.asarray(w["q"]).reshape(-1, HALF, w["q"].shape[-1])
    codes = np.stack([packed & 15, packed >> 4], axis=1).reshape(-1, packed.shape[-1])
    return codes.astype(np.float32) * scale + np.repeat(np.asarray(w["minimum"], np.float32), GROUP, axis=0)


def _kernel(x_ref, q_ref, scale_ref, *refs, groups: int, rows: int, block_n: int, q4: bool, precision):
    o_ref = refs[-1]
    min_ref = refs[0] if q4 else None
    dtype = x_ref.dtype

    def group(g, acc):
        s = load(scale_ref.at[pl.ds(g, 1), :])  # [1, block_n]
        if q4:
            m = load(min_ref.at[pl.ds(g, 1), :])
            packed = load(q_ref.at[pl.ds(g * HALF, HALF), :]).astype(jnp.int32)  # [16, block_n]
            for part, codes in enumerate((packed & 15, packed >> 4)):
                w = (codes.astype(jnp.float32) * s + m).astype(dtype)
                x = load(x_ref.at[:, pl.ds(g * GROUP + part * HALF, HALF)])  # [rows, 16]
                acc = acc + dot_nn(x, w, precision)
            return acc
        w = (load(q_ref.at[pl.ds(g * GROUP, GROUP), :]).astype(jnp.float32) * s).astype(dtype)
        return acc + dot_nn(load(x_ref.at[:, pl.ds(g * GROUP, GROUP)]), w, precision)

    acc = lax.fori_loop(0, groups, group, jnp.zeros((rows, block_n), jnp.float32))
    store(o_ref, acc)


@functools.partial(jax.jit, static_argnames=("block_n", "interpret"))
def grouped_matmul(x: jax.Array, w: dict[str, jax.Array], *, block_n: int = 64,
                   interpret: bool | None = None) -> jax.Array:
    """x [M, K] @ W [K, N] in float32, W as `pack_gpu` gives it (q8 without "minimum", q4
    with); the weights are widened to x's dtype (bfloat16 on a GPU) inside the kernel."""
    interpret = default_interpret() if interpret is None else interpret
    m, k = x.shape
    q4 = "minimum" in w
    n = w["q"].shape[1]
    if k % GROUP or w["scale"].shape != (k // GROUP, n) or w["q"].shape[0] != (k // 2 if q4 else k):
        raise ValueError(f"x [{m}, {k}] does not match the packed weights {jax.tree.map(jnp.shape, w)}")
    rows = max(MIN_DOT, 1 << max(0, (m - 1).bit_length()))
    block_n = min(block_n, max(MIN_DOT, 1 << max(0, (n - 1).bit_length())))
    cols = pl.cdiv(n, block_n) * block_n
    pad = lambda a: jnp.pad(a, ((0, 0), (0, cols - n)))  # noqa: E731
    args = [jnp.pad(x, ((0, rows - m), (0, 0))), pad(w["q"]), pad(w["scale"])]
    if q4:
        args.append(pad(w["minimum"]))
    column = lambda height: pl.BlockSpec((height, block_n), lambda j: (0, j))  # noqa: E731
    specs = [pl.BlockSpec((rows, k), lambda j: (0, 0)), column(w["q"].shape[0]), column(k // GROUP)]
    if q4:
        specs.append(column(k // GROUP))
    out = triton_call(
        functools.partial(_kernel, groups=k // GROUP, rows=rows, block_n=block_n, q4=q4,
                          precision=dot_precision(x.dtype)),
        num_warps=4, num_stages=2,
        grid=(cols // block_n,),
        in_specs=specs,
        out_specs=pl.BlockSpec((rows, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
        interpret=interpret,
        name="cadence_grouped_matmul",
    )(*args)
    return out[:m, :n]
