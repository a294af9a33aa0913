"""Tiny model shapes beside `model.config.TINY`, and the one-page forward the tests compare
against.

    logits = full_logits(params, config, tokens)   # [len(tokens), vocab], one program
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model import llama
from cadence.model.config import TINY, RopeScaling
from cadence.model.llama import rope_table
from cadence.model.paged_kv import PagedKVCache


# The decoder jitted, as the engine's programs run it. Op by op, every operation compiles again
# for each new shape, and the persistent cache keeps none of them (each is under its 0.1 s floor).
forward = jax.jit(llama.forward, static_argnames=("config", "attention"))


def full_logits(params, config, tokens: np.ndarray, rope_lookup: bool = False) -> np.ndarray:
    """The whole sequence in one forward over one page that holds it all; with `rope_lookup`,
    the rotations looked up in a `rope_table`, as the engine's programs do."""
    t = len(tokens)
    logits, _ = forward(
        params,
        jnp.asarray(tokens, jnp.int32)[None],
        jnp.arange(t, dtype=jnp.int32)[None],
        jnp.asarray([t], jnp.int32),
        PagedKVCache.create(config, 1, t),
        jnp.zeros((1, 1), jnp.int32),
        config=config,
        attention="reference",
        rope_table=rope_table(config, t + 5) if rope_lookup else None,
    )
    return np.asarray(logits[0])


# Qwen2-style: q/k/v biases and an untied lm_head; also one KV head and Llama-3 RoPE scaling.
QWEN_TINY = dataclasses.replace(
    TINY, name="qwen-tiny", attention_bias=True, tie_embeddings=False, num_kv_heads=1,
    rope_theta=1e6, rms_norm_eps=1e-6, rope_scaling=RopeScaling(factor=4.0))
