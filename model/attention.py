"""Attention: one interface, implementations behind it.

Every attention call in cadence — a whole prompt, one prefill chunk, a decode step over all
slots — has the same shape of problem: queries at known absolute positions attend causally to a
slot's cached keys and values, which already include the keys of the queries themselves.

    attend(q, k, v, q_positions) -> out
      q            [batch, q_len, num_heads, head_dim]
      k, v         [batch, num_kv_heads, kv_len, head_dim]   key j sits at absolute position j
      q_positions  [batch, q_len] int32                        query t may see keys 0..q_positions[t]
      out          [batch, q_len, num_heads, head_dim]

Grouped-query attention is expressed by num_heads being a multiple of num_kv_heads: query head h
reads KV head h // group_size. Keys beyond a query's position — stale entries left by a previous
occupant of the slot, or padding of a bucketed chunk — are masked, so per-sequence lengths come
for free from the positions.

`xla_attention` is the reference ("reference"): plain einsums with a float32 softmax, the oracle
that faster paths are tested against. The CPU default, "xla", uses it for prefill chunks and a
per-row tiled loop for decode, so a decode step over chats and one long document reads each
slot only up to its own length. With the head-major KV layout each
(row, KV head) pair is a contiguous [kv_len, head_dim] matrix, so both einsums are batched
matmuls that need no transpose of K or V (on XLA:CPU a decode step's attention took half the
time it took with a position-major layout).

`pallas_attention` is the GPU default: the Pallas kernels of `model.pallas_prefill` (a chunk of
queries, flash attention) and `model.pallas_decode` (one query per row, split-K), compiled on a
GPU and run in interpret mode elsewhere. They bound their KV loops by each row's positions, so
tiles past a row's length are never read.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol

import jax
import jax.numpy as jnp


class AttentionFn(Protocol):
    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array
    ) -> jax.Array: ...


def _batched_matmul(a: jax.Array, b: jax.Array, contract_a: int, contract_b: int) -> jax.Array:
    """a @ b over a shared leading batch axis, contracting the given axes, in float32."""
    dims = (((contract_a,), (contract_b,)), ((0,), (0,)))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def visible_keys(key_pos: jax.Array, q_pos: jax.Array, window=None) -> jax.Array:
    """Which keys a query sees: those at or before its position, and with a sliding `window`
    (a [] int32, traced or not; None: none) only the last `window` of them, its own included."""
    visible = key_pos <= q_pos
    return visible if window is None else visible & (key_pos > q_pos - window)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                  window=None) -> jax.Array:
    """The reference; `window`: a sliding window (`visible_keys`)."""
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # Rows of one (sequence, KV head) are its group's queries: [batch*kv_heads, group*q_len, d].
    # Each matmul then has a single batch dimension and K/V in their cache layout, which
    # XLA:CPU runs as plain GEMMs (2-3x faster than the 5-D einsum it replaces).
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    qg = qg.reshape(batch * num_kv_heads, group * q_len, head_dim)
    keys = k.reshape(batch * num_kv_heads, kv_len, head_dim)
    values = v.reshape(batch * num_kv_heads, kv_len, head_dim)
    scores = _batched_matmul(qg, keys, 2, 2) * (1.0 / jnp.sqrt(jnp.float32(head_dim)))
    key_pos = jnp.arange(kv_len, dtype=jnp.int32)
    visible = visible_keys(key_pos[None, None, :], q_positions[:, :, None], window)  # [batch, q_len, kv_len]
    visible = jnp.broadcast_to(
        visible[:, None, None], (batch, num_kv_heads, group, q_len, kv_len)
    ).reshape(scores.shape)
    scores = jnp.where(visible, scores, -jnp.inf)
    # Softmax by hand: normalise the [rows, d] output instead of the [rows, kv_len] weights.
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(visible, jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = _batched_matmul(weights.astype(v.dtype), values, 2, 1)
    # A query with no visible key (an inactive decode row) has total 0: give it zeros, not NaN.
    out = out / jnp.where(total > 0, total, 1.0)
    out = out.reshape(batch, num_kv_heads, group, q_len, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    *,
    interpret: bool | None = None,
) -> jax.Array:
    """The Pallas kernels: decode (split-K) for one query per row, flash prefill otherwise.

    `interpret=None` compiles the kernels on a GPU and interprets them anywhere else.
    """
    from cadence.model import pallas_common  # keeps Pallas off the XLA-only import path

    if interpret is None:
        interpret = pallas_common.default_interpret()
    return _pallas_attention(q, k, v, q_positions, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _pallas_attention(q, k, v, q_positions, *, interpret: bool) -> jax.Array:
    # A jit of its own: every layer calls the same traced function, so a program lowers (and
    # hands Triton) each kernel once, not once per layer.
    from cadence.model import pallas_decode, pallas_prefill

    if q.shape[1] == 1:
        return pallas_decode.flash_decode(q, k, v, q_positions, interpret=interpret)
    return pallas_prefill.flash_prefill(q, k, v, q_positions, interpret=interpret)


DECODE_TILE = 512  # measured on the 2-core CPU: 256 and 1024 were both slower


def xla_tiled_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array
) -> jax.Array:
    """The XLA serving path: the reference for chunks, per-row tiled loops for decode."""
    if q.shape[1] == 1:
        return _tiled_decode(q, k, v, q_positions)
    return xla_attention(q, k, v, q_positions)


def _tiled_decode(q, k, v, q_positions, tile: int = DECODE_TILE):
    """Decode attention whose cost follows each row's own length.

    A batched einsum over the slots must read every slot up to the longest one; with one long
    document among chats that is most of the work. Here each row runs its own loop over
    `tile`-position tiles of its cache, stopping after the tile holding its position (an
    inactive row, position -1, runs none), with an online softmax in float32. `k`, `v` may be
    the whole cache: tiles past a row's position are never read.
    """
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    tile = min(tile, kv_len)
    scale = 1.0 / jnp.sqrt(jnp.float32(head_dim))
    outputs = []
    for row in range(batch):  # static: one small loop per slot
        qr = q[row, 0].reshape(num_kv_heads, group, head_dim).astype(jnp.float32) * scale
        position = q_positions[row, 0]

        def body(i, carry, row=row, qr=qr, position=position):
            peak, total, acc = carry  # [kv_heads, group], [kv_heads, group], [.., head_dim]
            start = jnp.minimum(i * tile, kv_len - tile)  # the last tile may overlap its neighbour
            size = (1, num_kv_heads, tile, head_dim)
            kt = jax.lax.dynamic_slice(k, (row, 0, start, 0), size)[0].astype(jnp.float32)
            vt = jax.lax.dynamic_slice(v, (row, 0, start, 0), size)[0].astype(jnp.float32)
            scores = _batched_matmul(qr, kt, 2, 2)  # [kv_heads, group, tile]
            key_pos = start + jnp.arange(tile, dtype=jnp.int32)
            valid = (key_pos >= i * tile) & (key_pos <= position)  # skip overlap and the future
            scores = jnp.where(valid, scores, -jnp.inf)
            new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
            weights = jnp.where(valid, jnp.exp(scores - new_peak[..., None]), 0.0)
            correction = jnp.exp(peak - new_peak)
            total = total * correction + jnp.sum(weights, axis=-1)
            acc = acc * correction[..., None] + _batched_matmul(weights, vt, 2, 1)
            return new_peak, total, acc

        init = (
            jnp.full((num_kv_heads, group), -1e30, jnp.float32),
            jnp.zeros((num_kv_heads, group), jnp.float32),
            jnp.zeros((num_kv_heads, group, head_dim), jnp.float32),
        )
        tiles = (position + tile) // tile  # tiles covering [0, position]; 0 when position is -1
        _, total, acc = jax.lax.fori_loop(0, tiles, body, init)
        outputs.append(acc / jnp.where(total > 0, total, 1.0)[..., None])
    out = jnp.stack(outputs).reshape(batch, 1, num_heads, head_dim)
    return out.astype(q.dtype)


IMPLEMENTATIONS: dict[str, Callable[..., jax.Array]] = {
    "xla": xla_tiled_attention,
    "reference": xla_attention,
    "pallas": pallas_attention,
}


def get_attention(name: str) -> AttentionFn:
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention implementation {name!r}; choose one of {sorted(IMPLEMENTATIONS)}"
        ) from None
