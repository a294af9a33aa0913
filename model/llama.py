"""The Llama-family decoder in Flax, as a pure function of (params, tokens, positions, KV cache).

    logits, cache = forward(params, tokens, positions, lengths, cache, config=..., kv_len=...)

    tokens, positions  [rows, t] int32   a row is one sequence's chunk (t = 1 for decode)
    lengths            [rows] int32      valid tokens per row; the rest is bucket padding
    slots              [rows] int32 or None (rows are the cache slots in order)
    kv_len             static int        keys [0, kv_len) of each slot are read
    logit_index        [rows] int32 or None: which in-chunk token's logits to return

Each layer writes the chunk's keys and values into the cache first, then attends over the slot,
so a whole prompt, a prefill chunk at any offset and a decode step are the same computation.
The engine jits this with fixed shapes and donates the cache; nothing in here is Python-side
state that varies per request.

The parameter tree (kernels are [in, out]; query/key weights in the rotate-half RoPE layout):
    embed/embedding [V, D]; layers_i/{attn_norm,mlp_norm}/scale [D];
    layers_i/attn/{q,k,v,o}/kernel (+ q,k,v bias when config.attention_bias);
    layers_i/mlp/{gate,up,down}/kernel; final_norm/scale [D]; lm_head/kernel [D, V] when untied.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import kv_cache
from model.attention import get_attention
from model.config import ModelConfig
from model.kv_cache import KVCache


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with Llama-3 scaling when configured."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / config.head_dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, blended)
    scaled = np.where(wavelen < high_wavelen, inv_freq, scaled)
    return scaled.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. x [rows, t, heads, head_dim], positions [rows, t]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [rows, t, head_dim/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


class Attention(nn.Module):
    config: ModelConfig
    attention: str
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, lengths, slots, k_cache, v_cache, kv_len):
        cfg = self.config
        rows, t, _ = x.shape
        dense = lambda n, bias, name: nn.Dense(n, use_bias=bias, dtype=self.dtype, name=name)  # noqa: E731
        q = dense(cfg.num_heads * cfg.head_dim, cfg.attention_bias, "q")(x)
        k = dense(cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias, "k")(x)
        v = dense(cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias, "v")(x)
        q = q.reshape(rows, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(rows, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(rows, t, cfg.num_kv_heads, cfg.head_dim)
        inv_freq = rope_frequencies(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)

        write_slots = jnp.arange(rows, dtype=jnp.int32) if slots is None else slots
        k_cache = kv_cache.write(k_cache, k, write_slots, positions, lengths)
        v_cache = kv_cache.write(v_cache, v, write_slots, positions, lengths)
        keys = kv_cache.read(k_cache, slots, kv_len)
        values = kv_cache.read(v_cache, slots, kv_len)
        with jax.named_scope("attention"):
            out = get_attention(self.attention)(q, keys, values, positions)
        out = dense(cfg.hidden_size, False, "o")(out.reshape(rows, t, -1))
        return out, k_cache, v_cache


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        f, d = self.config.ffn_size, self.config.hidden_size
        gate = nn.Dense(f, use_bias=False, dtype=self.dtype, name="gate")(x)
        up = nn.Dense(f, use_bias=False, dtype=self.dtype, name="up")(x)
        return nn.Dense(d, use_bias=False, dtype=self.dtype, name="down")(nn.silu(gate) * up)


class Block(nn.Module):
    config: ModelConfig
    attention: str
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, lengths, slots, k_cache, v_cache, kv_len):
        eps = self.config.rms_norm_eps
        h, k_cache, v_cache = Attention(self.config, self.attention, self.dtype, name="attn")(
            RMSNorm(eps, name="attn_norm")(x), positions, lengths, slots, k_cache, v_cache, kv_len
        )
        x = x + h
        x = x + MLP(self.config, self.dtype, name="mlp")(RMSNorm(eps, name="mlp_norm")(x))
        return x, k_cache, v_cache


class Llama(nn.Module):
    config: ModelConfig
    attention: str = "xla"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens, positions, lengths, cache: KVCache, slots, kv_len, logit_index):
        cfg = self.config
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, name="embed")
        x = embed(tokens)
        new_k, new_v = [], []
        for i in range(cfg.num_layers):
            with jax.named_scope(f"layer_{i}"):
                x, k, v = Block(cfg, self.attention, self.dtype, name=f"layers_{i}")(
                    x, positions, lengths, slots, cache.k[i], cache.v[i], kv_len
                )
            new_k.append(k)
            new_v.append(v)
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)[:, 0]  # [rows, D]
        x = RMSNorm(cfg.rms_norm_eps, name="final_norm")(x)
        with jax.named_scope("lm_head"):
            if cfg.tie_embeddings:
                logits = embed.attend(x)
            else:
                logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, name="lm_head")(x)
        return logits.astype(jnp.float32), KVCache(k=tuple(new_k), v=tuple(new_v))


def forward(
    params,
    tokens: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    cache: KVCache,
    *,
    config: ModelConfig,
    kv_len: int,
    slots: jax.Array | None = None,
    logit_index: jax.Array | None = None,
    attention: str = "xla",
    dtype: jnp.dtype = jnp.float32,
) -> tuple[jax.Array, KVCache]:
    """Runs the decoder; returns float32 logits ([rows, t, V], or [rows, V] with logit_index)."""
    if kv_len > cache.max_len:
        raise ValueError(f"kv_len {kv_len} exceeds the cache length {cache.max_len}")
    module = Llama(config, attention, dtype)
    return module.apply(
        {"params": params}, tokens, positions, lengths, cache, slots, kv_len, logit_index
    )


def init_params(config: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32):
    """Random parameters with the model's exact tree (for tests and benchmarks)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    cache = KVCache.create(config, 1, 1)
    variables = Llama(config).init(
        key, tokens, tokens, jnp.ones((1,), jnp.int32), cache, None, 1, None
    )
    return jax.tree.map(lambda a: a.astype(dtype), variables["params"])


def abstract_params(config: ModelConfig, dtype: jnp.dtype = jnp.float32):
    """Shapes and dtypes of the parameter tree, without allocating it."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))
