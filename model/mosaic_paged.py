"""Paged attention as Mosaic GPU kernels (Hopper: TMA copies, warpgroup matmuls), beside the
Triton-style kernels of `model.pallas_paged`, behind the same interface:

    out = mosaic_paged_attention(q, k_pages, v_pages, page_table, q_positions)
      q            [rows, q_len, num_heads, head_dim]      bfloat16 or float16
      k_pages      [num_kv_heads, num_pages, page_size, head_dim]   one layer's pool
      page_table   [rows, max_pages] int32   position p: page page_table[row, p // page_size]
      q_positions  [rows, q_len] int32   query t sees keys 0..q_positions[t]; -1 sees none
      out          [rows, q_len, num_heads, head_dim], zeros for a query that sees no key

One kernel body serves both phases. A program is one warpgroup (128 threads) that owns 64
matmul rows: the query heads of one KV head's group (padded to a power of two) times as many
queries as fit, and walks a range of that row's keys in tiles of `block_k` keys (64, or one
page where pages are larger), each tile whole pages that the tensor-memory accelerator (TMA)
copies from the pool into shared memory, page by page through the page table: a tile ahead,
double-buffered, while the current one is multiplied. Scores are one warpgroup matmul
(queries [64, head_dim] against the tile's keys read transposed), the online softmax runs in
registers in float32 and base 2, and the probabilities go back to shared memory in the input
dtype for the second matmul against the values.

- decode (q_len 1): grid (rows, KV heads, splits). The keys a row can reach are cut into
  `num_splits` ranges (flash-decoding), so a single long sequence still spreads over the GPU; a
  split past the row's length copies nothing and writes the neutral partial. Each program
  writes its float32 partial output, max and sum, merged by `pallas_decode.combine`.
- prefill (any q_len): grid (rows, KV heads, query blocks), causal: a block stops after the
  tile holding its last visible key, and writes its normalised output.

The caller's side (`_queries_in`, `_positions_in`) lays queries out as [rows, KV heads, blocks,
64, head_dim] and hands the kernel, per block, each matmul row's position and the block's key
bound; page-table entries past a row's live pages may hold anything: their indices and page
numbers are clamped into the table and pool before a copy, and their keys masked by position
(so the pool must hold finite values, as it does: it is created zero-filled).

Limits (checked, with a clear error): 16-bit queries and pools, head_dim a multiple of 64 (one
128-byte swizzled row of 16-bit values per 64 columns), pages of 8 to 256 tokens that tile
`block_k` evenly, a GQA group of at most 64 query heads.

Status: interpreted on the CPU in the tests (`model.mosaic_interpret`) against the XLA
reference and lowered for CUDA; not yet compiled or timed on a GPU, so the Triton kernels stay
the GPU default ("pallas") and these are selected by name ("mosaic"). Not done yet: warp
specialisation (a producer warpgroup issuing copies, two consumer warpgroups), unmasked tiles
below the diagonal, quantized pages.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from cadence.model.arith import cdiv
from cadence.model.control import default_interpret
from cadence.model.pallas_common import NEG, next_pow2, score_scale
from cadence.model.pallas_decode import _multiprocessors, combine

ROWS = 64  # a warpgroup matmul's M: the query rows one program owns
ALIGN = 32  # int32s: a warpgroup's copies move whole multiples of 128 bytes
_WGMMA = plgpu.Layout.WGMMA


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    block_k: int  # keys per tile: whole pages, at least 64
    num_splits: int = 1  # decode: ranges the keys a row can reach are cut into


def check_supported(q: jax.Array, k_pages: jax.Array) -> None:
    """Raises ValueError for a shape or dtype the kernels do not take (see the docstring)."""
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"the Mosaic GPU kernels take bfloat16 or float16, got {q.dtype}")
    if k_pages.dtype != q.dtype:
        raise ValueError(f"queries are {q.dtype} but the KV pool is {k_pages.dtype}")
    if head_dim % 64:
        raise ValueError(f"the Mosaic GPU kernels need head_dim % 64 == 0, got {head_dim}")
    if page_size % 8 or page_size > 256 or default_block_k(page_size) % page_size:
        raise ValueError(f"the Mosaic GPU kernels take pages of 8, 16, 32 or 64 tokens, or a "
                         f"multiple of 8 up to 256, got {page_size}")
    if next_pow2(q.shape[2] // num_kv_heads) > ROWS:
        raise ValueError(f"a GQA group of {q.shape[2] // num_kv_heads} query heads is more "
                         f"than the {ROWS} rows of a program")


def default_block_k(page_size: int) -> int:
    """64 keys per tile, or one page where pages are larger (a tile is whole pages)."""
    return max(64, page_size)


def default_decode_tiling(rows: int, num_kv_heads: int, capacity: int,
                          page_size: int) -> MosaicTiling:
    """As `pallas_decode.default_tiling`: ~4 waves of programs, each split >= 4 tiles."""
    block_k = default_block_k(page_size)
    wanted = cdiv(4 * _multiprocessors(), rows * num_kv_heads)
    most = max(1, capacity // (4 * block_k))
    return MosaicTiling(block_k=block_k, num_splits=max(1, min(wanted, most)))


def in_layout(x: jax.Array, layout, interpret: bool) -> jax.Array:
    """`x` in a register layout; interpreted, values have no layout (no CPU rule exists)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _kernel(table_ref, pos_ref, q_ref, k_ref, v_ref, *refs, decode: bool, page_size: int,
            block_k: int, split_len: int, interpret: bool):
    """One program: 64 query rows against one range of its row's keys (module docstring)."""
    *outs, table_s, pos_s, q_s, k_s, v_s, p_s, o_s, ml_s, bars, k_bars, v_bars = refs
    row, head, part = (lax.axis_index(name) for name in ("row", "head", "part"))
    block = 0 if decode else part  # decode: one block of queries, `part` is the split
    max_pages = table_ref.shape[1]  # padded: entries past the row's real table are 0
    num_pages, head_dim = k_ref.shape[1], k_ref.shape[-1]
    pages_per_tile = block_k // page_size

    plgpu.copy_gmem_to_smem(table_ref.at[row], table_s, bars.at[0])
    plgpu.copy_gmem_to_smem(pos_ref.at[row, block], pos_s, bars.at[1])
    plgpu.copy_gmem_to_smem(q_ref.at[row, head, block], q_s, bars.at[2])
    plgpu.barrier_wait(bars.at[1])
    start = part * split_len if decode else 0
    end = jnp.minimum(start + split_len, pos_s[ROWS]) if decode else pos_s[ROWS]
    num_tiles = lax.div(jnp.maximum(end - start, 0) + block_k - 1, block_k)
    plgpu.barrier_wait(bars.at[0])

    def fetch(j, slot):
        """Issue the copies of tile j's pages into buffer `slot`."""
        first = lax.div(start + j * block_k, page_size)
        for i in range(pages_per_tile):
            index = jnp.minimum(first + i, max_pages - 1)  # a last tile may overhang the table
            page = jnp.clip(table_s[index], 0, num_pages - 1)
            rows = pl.ds(i * page_size, page_size)
            barrier = slot * pages_per_tile + i
            plgpu.copy_gmem_to_smem(k_ref.at[head, page], k_s.at[slot, rows], k_bars.at[barrier])
            plgpu.copy_gmem_to_smem(v_ref.at[head, page], v_s.at[slot, rows], v_bars.at[barrier])

    def wait(barriers, slot):
        for i in range(pages_per_tile):
            plgpu.barrier_wait(barriers.at[slot * pages_per_tile + i])

    pl.when(num_tiles > 0)(lambda: fetch(0, 0))
    row_pos = in_layout(pos_s[pl.ds(0, ROWS)], _WGMMA.reduce(1), interpret)
    row_pos = lax.broadcast_in_dim(row_pos, (ROWS, block_k), [0])
    scale = score_scale(head_dim)
    plgpu.barrier_wait(bars.at[2])

    def tile(j, carry):
        m, l, acc = carry
        slot = lax.rem(j, 2)
        pl.when(j + 1 < num_tiles)(lambda: fetch(j + 1, 1 - slot))
        wait(k_bars, slot)

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, q_s, plgpu.transpose_ref(k_s.at[slot], (1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((ROWS, block_k), jnp.float32)) * scale
        key = in_layout(lax.broadcasted_iota(jnp.int32, (ROWS, block_k), 1), _WGMMA, interpret)
        key = key + (start + j * block_k)
        visible = (key <= row_pos) & (key < end)
        s = jnp.where(visible, s, NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        # A row that has seen no key yet has m_new == NEG: its exp2(0) must not count.
        p = jnp.where(visible, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        alpha = jnp.exp2(m - m_new)
        p_s[...] = p.astype(p_s.dtype)
        plgpu.commit_smem()
        wait(v_bars, slot)

        def weighted(acc_ref):
            plgpu.wgmma(acc_ref, p_s, v_s.at[slot])
            return acc_ref[...]

        pv = pl.run_scoped(weighted, plgpu.ACC((ROWS, head_dim), jnp.float32))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
        return m_new, l * alpha + p.sum(axis=1), acc

    m, l, acc = lax.fori_loop(0, num_tiles, tile, (
        in_layout(jnp.full((ROWS,), NEG, jnp.float32), _WGMMA.reduce(1), interpret),
        in_layout(jnp.full((ROWS,), 0.0, jnp.float32), _WGMMA.reduce(1), interpret),
        in_layout(jnp.full((ROWS, head_dim), 0.0, jnp.float32), _WGMMA, interpret),
    ))
    if decode:
        o_ref, ml_ref = outs
        o_s[...] = acc
        ml_s[0] = m
        ml_s[1] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[pl.ds(0, o_ref.shape[3])], o_ref.at[row, head, part])
        plgpu.copy_smem_to_gmem(ml_s, ml_ref.at[row, head, part])
    else:
        (o_ref,) = outs
        # A query with no visible key has l == 0: zeros, not NaN.
        l = jnp.where(l > 0, l, 1.0)
        o_s[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref.at[row, head, block])
    plgpu.wait_smem_to_gmem(0)


def _launch(table, positions, queries, k_pages, v_pages, out_type, *, decode: bool,
            parts: int, block_k: int, split_len: int, interpret: bool, name: str):
    """The kernel over grid (rows, KV heads, parts) with its shared-memory buffers."""
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    dtype = queries.dtype
    pages_per_tile = block_k // page_size
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM(table.shape[1:], jnp.int32),
        plgpu.SMEM(positions.shape[2:], jnp.int32),
        plgpu.SMEM((ROWS, head_dim), dtype, transforms=swizzled),
        plgpu.SMEM((2, block_k, head_dim), dtype, transforms=swizzled),
        plgpu.SMEM((2, block_k, head_dim), dtype, transforms=swizzled),
        plgpu.SMEM((ROWS, block_k), dtype, transforms=swizzled),
        plgpu.SMEM((ROWS, head_dim), jnp.float32 if decode else dtype),
        plgpu.SMEM((2, ROWS), jnp.float32),
        plgpu.Barrier(num_barriers=3),
        plgpu.Barrier(num_barriers=2 * pages_per_tile),
        plgpu.Barrier(num_barriers=2 * pages_per_tile),
    ]
    if interpret:
        from cadence.model import mosaic_interpret  # JAX internals, for the CPU only

        run_as = mosaic_interpret.interpret_params()
    else:
        run_as = None
    kernel = functools.partial(_kernel, decode=decode, page_size=page_size, block_k=block_k,
                               split_len=split_len, interpret=interpret)
    return plgpu.kernel(
        kernel, out_type=out_type, grid=(queries.shape[0], num_kv_heads, parts),
        grid_names=("row", "head", "part"), scratch_types=scratch, interpret=run_as,
        kernel_name=name,
    )(table, positions, queries, k_pages, v_pages)


def _table_in(page_table: jax.Array) -> jax.Array:
    """The page table [rows, max_pages rounded up to ALIGN] int32, zero-padded."""
    pad = cdiv(page_table.shape[1], ALIGN) * ALIGN - page_table.shape[1]
    return jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, pad)))


def _positions_in(positions: jax.Array, bound: jax.Array) -> jax.Array:
    """[rows, blocks, ROWS + ALIGN] int32: each matmul row's query position, then the block's
    key bound (keys below it are the only ones any of its queries may see), then padding."""
    pad = jnp.zeros(positions.shape[:2] + (ALIGN - 1,), jnp.int32)
    return jnp.concatenate([positions.astype(jnp.int32), bound[..., None], pad], axis=-1)


def _queries_in(q: jax.Array, num_kv_heads: int) -> tuple[jax.Array, int, int]:
    """q [rows, q_len, heads, head_dim] as [rows, KV heads, blocks, ROWS, head_dim]: each
    block `block_q` queries times the group padded to `gp` heads. Returns it, block_q, gp."""
    rows, q_len, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    gp = next_pow2(group)
    block_q = ROWS // gp
    blocks = cdiv(q_len, block_q)
    qg = q.reshape(rows, q_len, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, blocks * block_q - q_len), (0, 0), (0, gp - group), (0, 0)))
    qg = qg.reshape(rows, blocks, block_q, num_kv_heads, gp, head_dim).transpose(0, 3, 1, 2, 4, 5)
    return qg.reshape(rows, num_kv_heads, blocks, ROWS, head_dim), block_q, gp


def mosaic_paged_prefill(q, k_pages, v_pages, page_table, q_positions, *,
                         block_k: int | None = None, interpret: bool | None = None):
    """Causal attention over pages for a chunk of queries at any positions."""
    check_supported(q, k_pages)
    interpret = default_interpret() if interpret is None else interpret
    rows, q_len, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    capacity = page_table.shape[1] * page_size
    queries, block_q, gp = _queries_in(q, num_kv_heads)
    blocks = queries.shape[2]
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, blocks * block_q - q_len)),
                  constant_values=-1).reshape(rows, blocks, block_q)
    bound = jnp.clip(jnp.max(pos, axis=-1) + 1, 0, capacity)
    positions = _positions_in(jnp.repeat(pos, gp, axis=-1), bound)
    out = _launch(
        _table_in(page_table), positions, queries, k_pages, v_pages,
        jax.ShapeDtypeStruct(queries.shape, q.dtype), decode=False, parts=blocks,
        block_k=block_k or default_block_k(page_size), split_len=capacity,
        interpret=interpret, name="cadence_mosaic_prefill")
    out = out.reshape(rows, num_kv_heads, blocks, block_q, gp, head_dim)
    out = out.transpose(0, 2, 3, 1, 4, 5).reshape(rows, blocks * block_q, num_kv_heads, gp,
                                                  head_dim)
    group = num_heads // num_kv_heads
    return out[:, :q_len, :, :group].reshape(rows, q_len, num_heads, head_dim)


def mosaic_paged_decode(q, k_pages, v_pages, page_table, q_positions, *,
                        tiling: MosaicTiling | None = None, interpret: bool | None = None):
    """Split-K attention over pages for one query per row."""
    check_supported(q, k_pages)
    interpret = default_interpret() if interpret is None else interpret
    rows, q_len, num_heads, head_dim = q.shape
    if q_len != 1:
        raise ValueError(f"decode attention takes one query per row, got q_len={q_len}")
    num_kv_heads, _, page_size, _ = k_pages.shape
    capacity = page_table.shape[1] * page_size
    tiling = tiling or default_decode_tiling(rows, num_kv_heads, capacity, page_size)
    split_len = cdiv(cdiv(capacity, tiling.num_splits), tiling.block_k) * tiling.block_k
    splits = cdiv(capacity, split_len)
    group = num_heads // num_kv_heads
    gp = next_pow2(group)
    queries = q.reshape(rows, num_kv_heads, 1, group, head_dim)
    queries = jnp.pad(queries, ((0, 0), (0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    pos = q_positions.astype(jnp.int32).reshape(rows, 1, 1)
    bound = jnp.clip(pos[..., 0] + 1, 0, capacity)
    positions = _positions_in(jnp.broadcast_to(pos, (rows, 1, ROWS)), bound)
    acc, ml = _launch(
        _table_in(page_table), positions, queries, k_pages, v_pages,
        (jax.ShapeDtypeStruct((rows, num_kv_heads, splits, gp, head_dim), jnp.float32),
         jax.ShapeDtypeStruct((rows, num_kv_heads, splits, 2, ROWS), jnp.float32)),
        decode=True, parts=splits, block_k=tiling.block_k, split_len=split_len,
        interpret=interpret, name="cadence_mosaic_decode")
    out = combine(acc, ml[..., 0, :gp], ml[..., 1, :gp])[:, :, :group]
    return out.reshape(rows, 1, num_heads, head_dim).astype(q.dtype)


def mosaic_paged_attention(q, k_pages, v_pages, page_table, q_positions, *,
                           interpret: bool | None = None):
    """Decode for one query per row, prefill otherwise (as `pallas_paged_attention`)."""
    if interpret is None:
        interpret = default_interpret()
    return _mosaic_paged_attention(q, k_pages, v_pages, page_table, q_positions,
                                   interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _mosaic_paged_attention(q, k_pages, v_pages, page_table, q_positions, *, interpret: bool):
    # A jit of its own, as `pallas_paged`: every layer calls one traced function.
    if q.shape[1] == 1:
        return mosaic_paged_decode(q, k_pages, v_pages, page_table, q_positions,
                                   interpret=interpret)
    return mosaic_paged_prefill(q, k_pages, v_pages, page_table, q_positions,
                                interpret=interpret)
