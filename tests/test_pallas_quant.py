"""The Pallas weight-only grouped matmul (`model.pallas_quant`) against NumPy's dequantize-then-
matmul, in interpret mode, and its lowering for a CUDA GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.model.pallas_quant import dequantize_gpu, grouped_matmul, pack_gpu
from cadence.model.quant import quantize_group_matrix


def _weights(rng, fmt: str, k: int, n: int):
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    return pack_gpu(*quantize_group_matrix(w, fmt))


def test_the_gpu_layout_stands_for_the_grouped_matrix():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 24)).astype(np.float32)
    for fmt in ("q8", "q4"):
        q, scale, minimum = quantize_group_matrix(w, fmt)
        want = q.astype(np.float32) * np.repeat(scale.astype(np.float32), 32, axis=0)
        if minimum is not None:
            want += np.repeat(minimum.astype(np.float32), 32, axis=0)
        packed = pack_gpu(q, scale, minimum)
        np.testing.assert_array_equal(dequantize_gpu(packed), want)
        if fmt == "q4":
            assert packed["q"].shape == (32, 24)
            assert packed["q"][16 + 3, 5] == q[32 + 3, 5] | (q[32 + 16 + 3, 5] << 4)


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("m, k, n", [(1, 32, 16), (5, 96, 40), (16, 64, 200)])
def test_grouped_matmul_matches_dequantize_then_matmul(fmt, m, k, n):
    rng = np.random.default_rng(m + k + n)
    w = _weights(rng, fmt, k, n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = np.asarray(grouped_matmul(jnp.asarray(x), jax.tree.map(jnp.asarray, w), interpret=True))
    want = x.astype(np.float64) @ dequantize_gpu(w).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # bfloat16 activations (the GPU's): the weights are widened to bfloat16 as well
    got = np.asarray(grouped_matmul(jnp.asarray(x, jnp.bfloat16), jax.tree.map(jnp.asarray, w), interpret=True))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_grouped_matmul_refuses_mismatched_shapes():
    w = jax.tree.map(jnp.asarray, _weights(np.random.default_rng(1), "q4", 64, 16))
    with pytest.raises(ValueError, match="does not match"):
        grouped_matmul(jnp.zeros((2, 96)), w, interpret=True)


def test_grouped_matmul_lowers_to_triton_for_gpu(triton_verifications):
    """SmolLM2's and Llama-3-8B's decode shapes (8 rows) in bfloat16 build a Triton module that
    passes MLIR verification."""
    matmul = jax.jit(lambda x, w: grouped_matmul(x, w, interpret=False))
    for k, n in [(576, 1536), (4096, 14336)]:
        for fmt in ("q8", "q4"):
            w = {"q": jax.ShapeDtypeStruct((k // 2 if fmt == "q4" else k, n), jnp.uint8 if fmt == "q4" else jnp.int8),
                 "scale": jax.ShapeDtypeStruct((k // 32, n), jnp.float32)}
            if fmt == "q4":
                w["minimum"] = w["scale"]
            matmul.trace(jax.ShapeDtypeStruct((8, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",))
    assert triton_verifications and all(triton_verifications)
