"""The paged KV pool pytree: fixed-size pages shared by every sequence, one key and one value
array per layer, or one of each stacked over the layers.

    k[layer], v[layer]   [num_kv_heads, num_pages, page_size, head_dim]
    k, v stacked         [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    page_table           [rows, max_pages_per_seq] int32   (owned by the caller, not the pool)

A sequence owns a list of pages, in order, given by its row of a page table: position p of the
sequence lives at page `page_table[row, p // page_size]`, offset `p % page_size`. Pages need not
be contiguous or ordered in the pool; which pages a sequence owns is decided on the host (a page
allocator), never here. Entries of a page table past a sequence's live pages may hold any int32:
readers never use them for a visible key, and `write` never writes through them.

Head-major order, as in `model.kv_cache`: each (KV head, page) is a contiguous
[page_size, head_dim] matrix, so a kernel loads a page with one strided read and a KV head's
whole pool is one [num_pages, page_size, head_dim] block. Layers are separate arrays so that a
jitted program updates each in place when the pool is donated, except where a loop over layers
runs the model (`model.layer_loop`): its CPU kernels read and write a layer of the stacked
pool in place (`cpu_kernels.PoolLayer`), and XLA's would copy the layer out of the stack.

The pool is created zero-filled and only ever holds written (finite) values: the XLA readers
mask scores, not values, so they rely on every entry of every page they touch being finite.

Whole pages move by `copy_pages` (a partial prefix hit's copy, a fork's) and `insert_pages` (a
KV handoff), through the CPU kernels where they run, for the same reason as `write`.

A pool is float32, 16-bit or 8-bit floats (`--kv_cache_dtype`); `write` rounds keys and values
to it (`as_pool`), and readers widen them.

Non-goals: page allocation, prefix sharing / copy-on-write, pages quantized with scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from cadence.model import cpu_kernels
from cadence.model.config import ModelConfig


@struct.dataclass
class PagedKVCache:
    k: tuple[jax.Array, ...] | jax.Array  # per layer [num_kv_heads, num_pages, page_size,
    v: tuple[jax.Array, ...] | jax.Array  # head_dim], or those stacked over layers

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """[num_kv_heads, num_pages, page_size, head_dim]"""
        return tuple(self.k.shape[1:] if self.stacked else self.k[0].shape)

    @property
    def dtype(self) -> jnp.dtype:
        return self.k.dtype if self.stacked else self.k[0].dtype

    @property
    def num_pages(self) -> int:
        return self.layer_shape[1]

    @property
    def page_size(self) -> int:
        return self.layer_shape[2]

    def arrays(self) -> tuple[jax.Array, ...]:
        """Every array of the pool (keys first): one per layer, or the two stacks."""
        return (self.k, self.v) if self.stacked else self.k + self.v

    @property
    def tokens_capacity(self) -> int:
        """Tokens the whole pool holds (every sequence together)."""
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.arrays())

    @staticmethod
    def shape(config: ModelConfig, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        return (config.num_kv_heads, num_pages, page_size, config.head_dim)

    @classmethod
    def create(
        cls, config: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype = jnp.float32,
        device=None, stacked: bool = False,
    ) -> PagedKVCache:
        """A zero-filled pool (`stacked`: each of k and v one array over the layers); with
        `device`, allocated there (and committed to it)."""
        shape = cls.shape(config, num_pages, page_size)
        if stacked:
            layers = (config.num_layers, *shape)
            return cls(k=jnp.zeros(layers, dtype, device=device), v=jnp.zeros(layers, dtype, device=device))
        k = tuple(jnp.zeros(shape, dtype, device=device) for _ in range(config.num_layers))
        v = tuple(jnp.zeros(shape, dtype, device=device) for _ in range(config.num_layers))
        return cls(k=k, v=v)

    @classmethod
    def abstract(
        cls, config: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype = jnp.float32,
        stacked: bool = False,
    ) -> PagedKVCache:
        spec = jax.ShapeDtypeStruct(cls.shape(config, num_pages, page_size), dtype)
        if stacked:
            spec = jax.ShapeDtypeStruct((config.num_layers, *spec.shape), dtype)
            return cls(k=spec, v=spec)
        layers = tuple(spec for _ in range(config.num_layers))
        return cls(k=layers, v=layers)


def bytes_per_token(config: ModelConfig, dtype: jnp.dtype = jnp.float32) -> int:
    """Pool bytes one token occupies across all layers, keys and values."""
    return config.kv_bytes_per_token(jnp.dtype(dtype).itemsize)


def pages_for_bytes(
    config: ModelConfig, budget_bytes: int, page_size: int, dtype: jnp.dtype = jnp.float32
) -> int:
    """The most whole pages a pool of at most `budget_bytes` holds (sizing by memory)."""
    return int(budget_bytes) // (page_size * bytes_per_token(config, dtype))


def as_pool(values: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`values` rounded to a pool's `dtype`, narrower ones saturated at its largest value, so
    that the pool holds finite values only: float8_e4m3fn has no infinity (XLA's conversion
    gives NaN past 448), and float16's or float8_e5m2's infinity would make attention NaN."""
    dtype = jnp.dtype(dtype)
    if dtype != values.dtype and dtype.itemsize < 4:
        top = float(jnp.finfo(dtype).max)  # clipped in float32: a 16-bit bound could round up
        values = jnp.clip(values.astype(jnp.float32), -top, top)
    return values.astype(dtype)


def write(
    pages: jax.Array | cpu_kernels.PoolLayer,
    new: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    *,
    cpu_kernel: bool = False,
) -> jax.Array:
    """Writes `new` [rows, t, kv_heads, head_dim] at absolute `positions` [rows, t] of each row's
    sequence, through `page_table` [rows, max_pages_per_seq] int32, into one layer's `pages`
    [kv_heads, num_pages, page_size, head_dim].

    Only the first `lengths[row]` tokens of a row are written; the rest (bucket padding, or an
    inactive decode row with length 0) and any position past the page table's reach are dropped,
    so they can never clobber a page another sequence owns.

    `cpu_kernel`: where the CPU kernels run (attention "cpu"), the pool is written by
    `cpu_kernels.paged_write`, in place, to the same bits: XLA:CPU would widen a 16-bit pool
    layer to float32 and back around the scatter, on every layer of every step, and would copy
    a layer out of a stacked pool (`cpu_kernels.PoolLayer`, the layer loop's, which only the
    kernel writes).
    """
    rows, t = positions.shape
    num_pages, page_size = pages.shape[1], pages.shape[2]
    max_pages = page_table.shape[1]
    slot = positions // page_size  # [rows, t] index into the row's page table
    valid = (jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]) & (slot < max_pages)
    valid &= positions >= 0
    page = jnp.take_along_axis(page_table, jnp.clip(slot, 0, max_pages - 1), axis=1)
    # Out-of-range indices are dropped by the scatter: route invalid tokens there.
    page = jnp.where(valid, page, num_pages)
    new = as_pool(new, pages.dtype)
    if cpu_kernel or isinstance(pages, cpu_kernels.PoolLayer):
        return cpu_kernels.paged_write(pages, new, page, positions % page_size)
    # Indices on the adjacent axes 1 and 2: the indexed view is [kv_heads, rows, t, head_dim].
    values = new.transpose(2, 0, 1, 3)
    return pages.at[:, page, positions % page_size].set(values, mode="drop")


def put_pages(pages, new: jax.Array, ids: jax.Array, *, cpu_kernel: bool = False):
    """Writes whole pages into one layer's `pages` [kv_heads, num_pages, page_size, head_dim]
    (or a `cpu_kernels.PoolLayer`): `new` [kv_heads, n, page_size, head_dim] onto pages `ids`
    [n]; an id past the pool (padding) writes nothing. `cpu_kernel`: in place, by
    `cpu_kernels.paged_write` (a page's tokens as its rows), to the same bits as XLA's scatter,
    which on the CPU widens a 16-bit pool to float32 and back, whole: copying one page of
    Qwen3-0.6B's bfloat16 pool (8 x 4096 tokens) took 1.15 s for its keys and as long for its
    values, and takes 6 ms each in place (`bench/results/qwen3-cpu/copy_pages.txt`)."""
    new = as_pool(new, pages.dtype)
    if not (cpu_kernel or isinstance(pages, cpu_kernels.PoolLayer)):
        return pages.at[:, ids].set(new, mode="drop")
    _, n, page_size, _ = new.shape
    tokens = (n, page_size)
    return cpu_kernels.paged_write(pages, new.transpose(1, 2, 0, 3), jnp.broadcast_to(ids[:, None], tokens),
                                   jnp.broadcast_to(jnp.arange(page_size, dtype=jnp.int32), tokens))


def insert_pages(pool, new: jax.Array, ids: jax.Array, *, cpu_kernel: bool = False):
    """A pool's keys or values (a tuple of layers, or their stack) with `new` [layers, kv_heads,
    P, page_size, head_dim] written onto pages `ids` [P] of every layer (`put_pages`)."""
    return _every_layer(
        pool, lambda pages, i: put_pages(pages, new[i], ids, cpu_kernel=cpu_kernel),
        lambda stack: stack.at[:, :, ids].set(as_pool(new, stack.dtype), mode="drop"), cpu_kernel)


def copy_pages(pool, sources: jax.Array, targets: jax.Array, *, cpu_kernel: bool = False):
    """A pool's keys or values (a tuple of layers, or their stack) with pages `sources` [W]
    copied onto pages `targets` [W] in every layer; a target past the pool writes nothing."""
    def one(pages, _):
        if cpu_kernel:
            return put_pages(pages, cpu_kernels.take_pages(pages, sources), targets, cpu_kernel=True)
        return pages.at[:, targets].set(jnp.take(pages, sources, axis=1, mode="clip"), mode="drop")

    return _every_layer(pool, one, lambda stack: stack.at[:, :, targets].set(
        jnp.take(stack, sources, axis=2, mode="clip"), mode="drop"), cpu_kernel)


def _every_layer(pool, layer_update, stack_update, cpu_kernel: bool):
    """`layer_update(pages, i)` on each layer i of a pool's keys or values: a tuple's layers, or
    with the kernels a stack's, each a `cpu_kernels.PoolLayer` updated in place in a loop; XLA
    updates a stack whole (`stack_update`), the layer axis first."""
    if isinstance(pool, tuple):
        return tuple(layer_update(layer, i) for i, layer in enumerate(pool))
    if not cpu_kernel:
        return stack_update(pool)
    return jax.lax.fori_loop(
        0, pool.shape[0], lambda i, p: layer_update(cpu_kernels.PoolLayer(p, i), i).pool, pool)
