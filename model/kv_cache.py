"""The contiguous KV layout: fixed-shape slots, one key and one value array per layer.

The engine serves from pages (`model.paged_kv`); this is the layout it had before, kept as the
simple oracle the page pool's writes are tested against (`tests/test_paged_attention.py`).

    k[layer], v[layer]   [num_slots, num_kv_heads, max_len, head_dim]

A slot holds one sequence; position p of the sequence lives at index p of axis 2. Head-major
order makes each (slot, KV head) a contiguous [max_len, head_dim] matrix: attention reads it
without transposing, and a kernel tiles it along positions. Layers are separate
arrays (not one stacked array) so that a jitted program updates each in place when the cache is
donated, and never slices a big stacked buffer per layer.

Writes go through `write`, reads through `read`; both take the rows' slot indices, so the same
code serves a prefill chunk of one slot and a decode step over every slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from cadence.model.config import ModelConfig


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.k + self.v)

    @staticmethod
    def shape(config: ModelConfig, num_slots: int, max_len: int) -> tuple[int, int, int, int]:
        return (num_slots, config.num_kv_heads, max_len, config.head_dim)

    @classmethod
    def create(
        cls, config: ModelConfig, num_slots: int, max_len: int, dtype: jnp.dtype = jnp.float32
    ) -> KVCache:
        shape = cls.shape(config, num_slots, max_len)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))  # noqa: E731
        return cls(k=zeros(), v=zeros())

    @classmethod
    def abstract(
        cls, config: ModelConfig, num_slots: int, max_len: int, dtype: jnp.dtype = jnp.float32
    ) -> KVCache:
        spec = jax.ShapeDtypeStruct(cls.shape(config, num_slots, max_len), dtype)
        layers = tuple(spec for _ in range(config.num_layers))
        return cls(k=layers, v=layers)


def write(
    cache: jax.Array,
    new: jax.Array,
    slots: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
) -> jax.Array:
    """Writes `new` [rows, t, kv_heads, head_dim] at `positions` [rows, t] of `slots` [rows].

    Only the first `lengths[row]` tokens of a row are written; the rest (bucket padding, or an
    inactive decode row with length 0) are dropped, so they can never clobber live entries.
    """
    rows, t = positions.shape
    valid = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]
    # Out-of-range indices are dropped by the scatter: route invalid tokens there.
    pos = jnp.where(valid, positions, cache.shape[2])
    slot_idx = jnp.broadcast_to(slots[:, None], (rows, t))
    # Indices on axes 0 and 2 around a slice: the indexed view is [rows, t, kv_heads, head_dim].
    return cache.at[slot_idx, :, pos].set(new.astype(cache.dtype), mode="drop")


def read(cache: jax.Array, slots: jax.Array | None, kv_len: int) -> jax.Array:
    """The first `kv_len` positions of each row's slot: [rows, kv_heads, kv_len, head_dim].

    `slots=None` means the rows are the slots in order (a decode step over the whole cache),
    which is a plain slice instead of a gather.
    """
    if slots is None:
        return cache[:, :, :kv_len]
    size = (1, cache.shape[1], kv_len, cache.shape[3])
    rows = [
        jax.lax.dynamic_slice(cache, (slots[i], 0, 0, 0), size) for i in range(slots.shape[0])
    ]
    return jnp.concatenate(rows, axis=0)
