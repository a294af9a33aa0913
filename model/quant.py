"""Weight-only int8: every matrix stored as int8 with a float scale per output channel.

    params = quantize(params, config)      # the float tree -> the int8 tree (`model.params`)
    floats = dequantize(params, config)    # what the int8 weights stand for, in float32

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
measures XLA's fusion. Non-goals: activation quantization, int4, per-group scales,
calibration-based schemes.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

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
