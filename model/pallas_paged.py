"""Pallas GPU attention over a paged KV pool: split-K decode and chunked-prefill flash attention.

    out = paged_decode(q, k_pages, v_pages, page_table, q_positions)        q_len == 1
    out = paged_prefill(q, k_pages, v_pages, page_table, q_positions)       any q_len
      q            [rows, q_len, num_heads, head_dim]
      k_pages      [num_kv_heads, num_pages, page_size, head_dim]   one layer's pool
      page_table   [rows, max_pages] int32   position p: page page_table[row, p // page_size]
      q_positions  [rows, q_len] int32   query t sees keys 0..q_positions[t]; -1 sees none
      out          [rows, q_len, num_heads, head_dim], zeros for a query that sees no key

The same kernels as `model.pallas_decode` and `model.pallas_prefill`, not copies of them: their
kernel bodies run unchanged (same grids, tilings, online softmax, masks, log-sum-exp combine),
handed `PagedRows` views instead of the [kv_len, head_dim] refs of a contiguous slot. Those
bodies read K/V only as `load(ref.at[pl.ds(start, block_k), :], mask)`, a tile of `block_k`
consecutive positions; a `PagedRows` answers that indexing Triton style: it loads the tile's
page-table entries (one int32 per key, a few cached bytes), turns them into row offsets of the
KV head's pool viewed as [num_pages * page_size, head_dim], and hands back a gather view that
the kernel's own masked load reads. So a tile may span several small pages (page size 8 with
16-key tiles) or part of a big one, and the tile size stays a matmul choice, not a memory-layout
one. The page table row is a small input block read inside the kernel, like scalar prefetch on
TPU. (If the contiguous kernels ever index K/V another way, `PagedRows` refuses it loudly.)

Grids and GQA are theirs: decode runs (rows, KV heads, splits) programs, each one KV head's
group of query heads (padded to 16 matmul rows) over one range of the row's positions, split-K
over the page table's reach, merged by `pallas_decode.combine`; prefill runs (rows, KV heads,
query blocks) programs, causal, stopping at the block's last visible key.

Keys past a row's visible range are masked in the loads themselves: pages past a row's length
are never read, and page-table entries past its live pages may hold anything (they are masked
too, and clamped into the pool in case a compiled masked load still forms the address).

Non-goals: the deprecated `jax.experimental.pallas.ops.gpu.paged_attention` (learned from, not
imported: it vmaps one sequence per call and needs page counts divisible by the splits), a
Mosaic GPU port, quantized pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from cadence.model import pallas_decode, pallas_prefill
from cadence.model.pallas_common import default_interpret, load
from cadence.model.pallas_decode import DecodeTiling, combine
from cadence.model.pallas_prefill import PrefillTiling


class PagedRows:
    """One KV head's pool [num_pages * page_size, head_dim] seen through one row's page table
    [max_pages] as that row's contiguous [max_pages * page_size, head_dim] cache, for the
    indexing the contiguous kernels use: `view.at[pl.ds(start, n), :]`."""

    def __init__(self, pool_ref, table_ref, page_size: int):
        self.pool_ref, self.table_ref, self.page_size = pool_ref, table_ref, page_size

    @property
    def at(self) -> PagedRows:
        return self

    def __getitem__(self, index):
        positions, columns = index
        if not isinstance(positions, pl.Slice) or positions.stride != 1 or columns != slice(None):
            raise NotImplementedError(f"PagedRows reads tiles [pl.ds(start, n), :], got {index}")
        page_size, (pool_rows, head_dim) = self.page_size, self.pool_ref.shape
        key = positions.start + jnp.arange(positions.size, dtype=jnp.int32)  # absolute positions
        # Keys past the table's reach (a last tile overhanging it) read no entry; entries past
        # the row's live pages hold anything and are clamped into the pool: the kernel's own
        # mask then keeps the load from reading them.
        in_table = key < self.table_ref.shape[0] * page_size
        page = load(self.table_ref.at[lax.div(key, page_size)], mask=in_table, other=0)
        row = jnp.clip(page * page_size, 0, pool_rows - page_size) + lax.rem(key, page_size)
        return self.pool_ref.at[row[:, None], jnp.arange(head_dim, dtype=jnp.int32)[None, :]]


def _decode_kernel(len_ref, first_ref, q_ref, table_ref, k_ref, v_ref, *refs, page_size, **kwargs):
    k, v = (PagedRows(ref, table_ref, page_size) for ref in (k_ref, v_ref))
    pallas_decode._kernel(len_ref, first_ref, q_ref, k, v, *refs, **kwargs)


def _prefill_kernel(pos_ref, first_ref, q_ref, table_ref, k_ref, v_ref, *refs, page_size, **kwargs):
    k, v = (PagedRows(ref, table_ref, page_size) for ref in (k_ref, v_ref))
    pallas_prefill._kernel(pos_ref, first_ref, q_ref, k, v, *refs, **kwargs)


def _paged_operands(page_table, k_pages, v_pages):
    """The page table and both pools as pallas_call operands with their BlockSpecs, for a grid
    whose first two axes are (row, KV head): a program gets its row's [max_pages] table and its
    KV head's pools, each viewed (for free) as [num_pages * page_size, head_dim]."""
    heads, num_pages, page_size, head_dim = k_pages.shape
    pools = [p.reshape(heads, num_pages * page_size, head_dim) for p in (k_pages, v_pages)]
    pool_spec = pl.BlockSpec((None, num_pages * page_size, head_dim), lambda b, h, _: (h, 0, 0))
    table_spec = pl.BlockSpec((None, page_table.shape[1]), lambda b, h, _: (b, 0))
    return [page_table.astype(jnp.int32), *pools], [table_spec, pool_spec, pool_spec]


def paged_split_partials(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    *,
    tiling: DecodeTiling | None = None,
    interpret: bool | None = None,
    partials: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    window=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decode kernel alone: per-split (unnormalised output, base-2 max, sum), shaped
    [rows, kv_heads, splits, group, head_dim], [..., group], [..., group], all float32, as
    `pallas_decode.split_partials` returns them (`partials`: buffers written in place)."""
    num_kv_heads, _, page_size, _ = k_pages.shape
    capacity = page_table.shape[1] * page_size  # the longest sequence a page table reaches
    paged_args, paged_specs = _paged_operands(page_table, k_pages, v_pages)
    return pallas_decode.split_call(
        q, q_positions, num_kv_heads, capacity, paged_args, paged_specs, _decode_kernel,
        name="cadence_paged_decode", tiling=tiling, interpret=interpret, partials=partials,
        window=window, page_size=page_size)


def paged_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    *,
    tiling: DecodeTiling | None = None,
    interpret: bool | None = None,
    partials: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    window=None,
) -> jax.Array:
    """Decode attention over pages for one query per row (see the module docstring)."""
    acc, m, l = paged_split_partials(
        q, k_pages, v_pages, page_table, q_positions, tiling=tiling, interpret=interpret,
        partials=partials, window=window,
    )
    return combine(acc, m, l).reshape(q.shape).astype(q.dtype)


def paged_prefill(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    *,
    tiling: PrefillTiling | None = None,
    interpret: bool | None = None,
    out: jax.Array | None = None,
    window=None,
) -> jax.Array:
    """Flash attention over pages for a chunk of queries at any positions (see the module
    docstring); `out`, when given, is a buffer of the output's shape written in place."""
    num_kv_heads, _, page_size, _ = k_pages.shape
    paged_args, paged_specs = _paged_operands(page_table, k_pages, v_pages)
    return pallas_prefill.flash_call(
        q, q_positions, num_kv_heads, page_table.shape[1] * page_size, paged_args, paged_specs,
        _prefill_kernel, name="cadence_paged_prefill", tiling=tiling, interpret=interpret,
        out=out, window=window, page_size=page_size)


def pallas_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    *,
    interpret: bool | None = None,
    window=None,
) -> jax.Array:
    """The GPU default: paged decode for one query per row, paged prefill otherwise; `window`:
    a sliding window ([] int32), each query seeing only its last `window` keys."""
    if interpret is None:
        interpret = default_interpret()
    return _pallas_paged_attention(
        q, k_pages, v_pages, page_table, q_positions, window, interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=("interpret",))
def _pallas_paged_attention(q, k_pages, v_pages, page_table, q_positions, window, *, interpret: bool):
    # A jit of its own, as in model.attention: every layer calls the same traced function, so a
    # program lowers each kernel once, not once per layer.
    attend = paged_decode if q.shape[1] == 1 else paged_prefill
    return attend(q, k_pages, v_pages, page_table, q_positions, interpret=interpret, window=window)
