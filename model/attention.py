"""Attention: one interface, implementations behind it.

Every attention call in cadence — a whole prompt, one prefill chunk, a decode step over all
slots — has the same shape of problem: queries at known absolute positions attend causally to a
slot's cached keys and values, which already include the keys of the queries themselves.

    attend(q, k, v, q_positions) -> out
      q            [batch, q_len, num_heads, head_dim]
      k, v         [batch, kv_len, num_kv_heads, head_dim]   key j sits at absolute position j
      q_positions  [batch, q_len] int32                        query t may see keys 0..q_positions[t]
      out          [batch, q_len, num_heads, head_dim]

Grouped-query attention is expressed by num_heads being a multiple of num_kv_heads: query head h
reads KV head h // group_size. Keys beyond a query's position — stale entries left by a previous
occupant of the slot, or padding of a bucketed chunk — are masked, so per-sequence lengths come
for free from the positions.

`xla_attention` is the reference: plain einsums with a float32 softmax. It is the CPU default
and the oracle that faster kernels are tested against.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp


class AttentionFn(Protocol):
    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array
    ) -> jax.Array: ...


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array) -> jax.Array:
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # Split query heads into [kv_head, group] so each KV head is read once for its group.
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(head_dim)))
    key_pos = jnp.arange(kv_len, dtype=jnp.int32)
    visible = key_pos[None, None, :] <= q_positions[:, :, None]  # [batch, q_len, kv_len]
    scores = jnp.where(visible[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A query with no visible key (an inactive decode row at position -1) would give NaN; zero it.
    probs = jnp.where(visible[:, None, None, :, :], probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


IMPLEMENTATIONS: dict[str, Callable[..., jax.Array]] = {"xla": xla_attention}


def get_attention(name: str) -> AttentionFn:
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention implementation {name!r}; choose one of {sorted(IMPLEMENTATIONS)}"
        ) from None
