"""Weight-only quantization: int8 per output channel, and int8 or int4 in groups of 32.

    params = quantize(params, config)      # the float tree -> the int8 tree (`model.params`)
    floats = dequantize(params, config)    # what the int8 weights stand for, in float32
    floats, packed = quantize_grouped(params, config, "q4")   # grouped, for the CPU kernels

Grouped (`quantize_grouped`, GGUF's block formats' arithmetic): each column's 32 consecutive
input rows share a float16 scale; "q8" is symmetric (w ~= q * scale, q in [-127, 127], as Q8_0),
"q4" asymmetric with a float16 minimum (w ~= q * scale + min, q in [0, 15], as Q4_1). It gives
the matrices packed for `model.cpu_kernels`' grouped matmul, which decode reads, and the float
tree they stand for exactly, which prefill and the reference generator read.

A channel's scale is its largest magnitude / 127, so w ~= q * scale with q in [-127, 127]
(symmetric, round to nearest; an all-zero channel keeps scale 1). Activations stay in the
compute dtype: `model.llama`'s matmuls read the int8 kernel converted to it and scale the
output per channel, which is exact algebra (x @ (q * s) = (x @ q) * s), so the int8 model
computes the dequantized model's function up to float rounding, and `dequantize` gives the
reference generator the same model to check against. Norm scales and biases stay float.

The weights a decode step must read shrink to a quarter of float32 (a half of bfloat16), which
is the whole point on a memory-bound step, provided XLA fuses the int8 -> float conversion into
the matmul. XLA:CPU does not (`bench/results/int8-cpu/`: 4.5x slower than float32), so on
the CPU decode's matmuls run `model.cpu_kernels`, which widens the int8 blocks in registers
(2.3x faster than float32 for one sequence, level at eight:
`bench/results/decode-roofline-cpu/`); on a GPU `bench/gpu_bench.py`
measures XLA's fusion. Non-goals: activation quantization, calibration-based schemes (AWQ,
GPTQ), grouped weights on XLA's paths.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from cadence.model import block_layout
from cadence.model.config import ModelConfig
from cadence.model.params import MATRICES, build_tree, get, param_specs

QMAX = 127


def quantize_matrix(w, channel_axis: int):
    """(int8 q, float32 scale [channels]) with w ~= q * scale along `channel_axis` (2-D w).
    NumPy in, NumPy out (on the host); a jax array stays where it lies."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w = w.astype(xp.float32)
    other = 1 - channel_axis
    amax = xp.max(xp.abs(w), axis=other, keepdims=True)
    scale = xp.where(amax > 0, amax / QMAX, xp.float32(1.0)).astype(xp.float32)
    q = xp.clip(xp.round(w / scale), -QMAX, QMAX).astype(xp.int8)
    return q, xp.squeeze(scale, other)


def quantize(params: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """The int8 tree of a float params tree (NumPy or jax arrays, sharded or not: each result
    lies where its input did)."""
    done: dict[tuple[str, ...], Any] = {}
    for spec in param_specs(config):
        if spec.path[-1] in MATRICES:
            q, scale = quantize_matrix(get(params, spec.path), spec.channel_axis)
            done[spec.path] = q
            done[spec.path[:-1] + (spec.path[-1] + "_scale",)] = scale
        else:
            done[spec.path] = get(params, spec.path)
    return build_tree(param_specs(config, "int8"), lambda s: done[s.path])


def dequantize(params: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """The float32 tree an int8 tree stands for: q * scale per channel."""
    def leaf(spec):
        array = get(params, spec.path)
        if spec.path[-1] not in MATRICES:
            return array
        scale = get(params, spec.path[:-1] + (spec.path[-1] + "_scale",))
        return array.astype(jnp.float32) * jnp.expand_dims(scale.astype(jnp.float32),
                                                           1 - spec.channel_axis)

    return build_tree(param_specs(config), leaf)


GROUPED = ("q8", "q4")


def quantize_group_matrix(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q, scale, minimum) of a [K, N] matrix in groups of `block_layout.GROUP` rows per column
    (`fmt` "q8": q int8, minimum None; "q4": q codes 0..15 uint8), scales and minimums float16
    [K / 32, N], round to nearest: what `block_layout.pack_grouped` takes."""
    if fmt not in GROUPED:
        raise ValueError(f"grouped formats are {GROUPED}, got {fmt!r}")
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if k % block_layout.GROUP:
        raise ValueError(f"grouped weights need rows in multiples of {block_layout.GROUP}, got {k}")
    groups = w.reshape(k // block_layout.GROUP, block_layout.GROUP, n)

    def half(a: np.ndarray) -> np.ndarray:  # a nonzero float16 scale (all-equal groups: 1)
        a = a.astype(np.float16)
        return np.where((a > 0) & np.isfinite(a), a, np.float16(1))

    if fmt == "q8":
        scale = half(np.abs(groups).max(axis=1) / QMAX)
        q = np.clip(np.round(groups / scale[:, None].astype(np.float32)), -QMAX, QMAX)
        return q.reshape(k, n).astype(np.int8), scale, None
    minimum = groups.min(axis=1).astype(np.float16)
    scale = half((groups.max(axis=1) - minimum.astype(np.float32)) / 15)
    q = np.round((groups - minimum[:, None].astype(np.float32)) / scale[:, None].astype(np.float32))
    return np.clip(q, 0, 15).reshape(k, n).astype(np.uint8), scale, minimum


def quantize_grouped(params: dict[str, Any], config: ModelConfig, fmt: str):
    """(floats, packed): every matrix quantized in groups (`quantize_group_matrix`), the tied
    embedding (the LM head) in q8 whatever `fmt` is, as llama.cpp's 4-bit mixes keep theirs in
    8 bits (SmolLM2-135M's logits moved by 24% of their range with a 4-bit head, 3% without);
    `packed` maps each matrix's path to its `block_layout.pack_grouped` array (the embedding's
    entry is the head's, its transpose) and `floats` is the float32 tree of what they stand
    for, exactly (the embedding of an untied model stays as given: only a lookup reads it).
    NumPy in and out, on the host."""
    floats, packed = {}, {}
    for spec in param_specs(config):
        array = np.asarray(get(params, spec.path), np.float32)
        floats[spec.path] = array
        if spec.path[-1] not in MATRICES or (spec.path[-1] == "embedding" and not config.tie_embeddings):
            continue
        matrix = array.T if spec.path[-1] == "embedding" else array  # [in, out]
        blocks = block_layout.pack_grouped(*quantize_group_matrix(
            matrix, "q8" if spec.path[-1] == "embedding" else fmt))
        packed[spec.path] = blocks
        dequantized = block_layout.unpack_grouped(blocks, matrix.shape[1])
        floats[spec.path] = np.ascontiguousarray(dequantized.T if spec.path[-1] == "embedding" else dequantized)
    return build_tree(param_specs(config), lambda s: floats[s.path]), packed
