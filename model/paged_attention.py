"""Attention over a paged KV pool: the interface of `model.attention`, with KV read through
page tables.

    attend(q, k_pages, v_pages, page_table, q_positions) -> out
      q            [rows, q_len, num_heads, head_dim]
      k_pages      [num_kv_heads, num_pages, page_size, head_dim]   one layer's pool
      page_table   [rows, max_pages] int32   position p: page page_table[row, p // page_size]
      q_positions  [rows, q_len] int32   query t sees keys 0..q_positions[t] of its own sequence;
                                         -1 sees none and gets zeros
      window       (keyword, optional) a sliding window, [] int32: query t sees only keys after
                                         q_positions[t] - window (Gemma 3's sliding layers)
      out          [rows, q_len, num_heads, head_dim]

The semantic is exactly `model.attention`'s on the row's sequence laid out contiguously
(GQA by num_heads a multiple of num_kv_heads, causal by positions). Page-table entries past a
row's visible pages may be anything; the XLA paths clamp them into the pool and mask what they
read by position, so they rely on the pool holding finite values (it is created zero-filled).

- `paged_reference_attention` ("reference"): gathers each row's pages into a contiguous tile and
  runs `xla_attention`: the oracle.
- `xla_paged_attention` ("xla", the CPU default): for prefill rows `paged_prefill_tiled` (flash
  attention in XLA loops over query tiles of one chunk each, and over each tile's own pages)
  and, for decode, a per-row loop whose cost
  follows the row's own length, reading pages in place. Two loops, one function:
    "pages" (`paged_decode_pages`, the default): one page per iteration, a dynamic index of the
      pool, unmasked but for the row's last page;
    "gather" (`paged_decode_gather`): whole 512-position tiles, each a `take` of its pages, then
      at most one tile per power-of-two page count for the rest.
  Measured (`python -m cadence.bench.paged_attention_bench --rounds=40 --calls=8`, 2-core AMD EPYC
  shared with other test runs, JAX 0.10.2,
  bench/results/paged-attention-cpu/paged_attention.txt): one layer
  of SmolLM2-135M (9 heads, 3 KV heads, head_dim 64, f32), 8 rows, median ms per call, and the
  ratio to the contiguous `_tiled_decode` over 4096-token slots:
      context per row     128          1000         4000         7 x 128 + 1 x 4000
      contiguous          1.40         2.60         11.6         2.29
      pages,  page 128    0.55 (0.39)  2.60 (1.00)  9.48 (0.82)  1.49 (0.65)
      gather, page 128    0.58 (0.41)  3.01 (1.16)  12.4 (1.07)  1.62 (0.71)
      pages,  page 64     0.59 (0.42)  3.09 (1.19)  10.9 (0.94)  1.67 (0.73)
      gather, page 64     0.66 (0.47)  3.47 (1.34)  13.6 (1.17)  1.78 (0.78)
      pages,  page 16     0.76 (0.54)  5.22 (2.01)  19.1 (1.64)  2.93 (1.28)
      gather, page 16     0.73 (0.52)  5.46 (2.10)  18.6 (1.60)  2.50 (1.09)
  The page loop wins at pages of 64 and 128; the gather is kept because it is close there and
  ties at 16, where both lose: XLA:CPU pays per loop step and per gathered page, so small
  pages cost the CPU up to 2x. At 128-key pages paging costs nothing at 1k keys and is faster
  at short and mixed contexts, because it reads only live pages where the contiguous loop reads
  whole 512-position tiles. (A concatenation of dynamic page slices instead of `take` was
  measured too during development: no better.)
- `cpu_paged_attention` ("cpu", the CPU default where `model.cpu_kernels` builds): decode by the
  C++ kernel, which reads each row's live pages once with no loop steps, prefill as "xla".
- `model.pallas_paged.pallas_paged_attention` ("pallas"): the GPU kernels (Triton), the GPU
  default.
- `model.mosaic_paged.mosaic_paged_attention` ("mosaic"): the same attention as Mosaic GPU
  kernels (Hopper's TMA and warpgroup matmuls), 16-bit only, chosen by name until a GPU has
  timed both.
- "xla_rows", "cpu_rows", "pallas_rows", "mosaic_rows" (`query_rows`): the decode path of
  each, a query per row: a few queries of one sequence at once (speculative decoding's verify
  step).

Sliding windows are masks: the pages before a window stay where they are (the pool holds the
whole sequence for the full-attention layers anyway). The decode loops and the prefill tiles
start at the window's first page, so a sliding layer reads only the pages it sees, as do the
Pallas kernels (`model.pallas_common.first_keys`); the Mosaic GPU ones do not take windows yet.

Non-goals: page allocation (host side), writes (`model.paged_kv.write`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from cadence.model import cpu_kernels
from cadence.model.arith import cdiv
from cadence.model.attention import DECODE_TILE, _batched_matmul, visible_keys, xla_attention


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Each row's pages, in order, as a contiguous cache:
    [kv_heads, num_pages, page_size, d] x [rows, max_pages]
    -> [rows, kv_heads, max_pages * page_size, d].
    """
    heads, _, page_size, head_dim = pages.shape
    rows, max_pages = page_table.shape
    tiles = jnp.take(pages, page_table, axis=1, mode="clip")  # [kv_heads, rows, max_pages, ps, d]
    return tiles.transpose(1, 0, 2, 3, 4).reshape(rows, heads, max_pages * page_size, head_dim)


def paged_reference_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
    q_positions: jax.Array, window=None,
) -> jax.Array:
    """The oracle: every row's whole page table gathered, then the contiguous reference, over
    keys and values widened to the queries' dtype (a 16-bit pool under float32 compute)."""
    k = gather_pages(k_pages, page_table).astype(q.dtype)
    v = gather_pages(v_pages, page_table).astype(q.dtype)
    return xla_attention(q, k, v, q_positions, window)


def _online_step(carry, qr, kt, vt, valid):
    """One tile of an online softmax in float32 (as `model.attention._tiled_decode`):
    qr [kv_heads, group, d] (pre-scaled), kt, vt [kv_heads, n, d], valid [n] or None (all)."""
    peak, total, acc = carry  # [kv_heads, group], [kv_heads, group], [kv_heads, group, d]
    scores = _batched_matmul(qr, kt.astype(jnp.float32), 2, 2)  # [kv_heads, group, n]
    if valid is not None:
        scores = jnp.where(valid, scores, -jnp.inf)
    new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
    weights = jnp.exp(scores - new_peak[..., None])
    if valid is not None:
        weights = jnp.where(valid, weights, 0.0)
    correction = jnp.exp(peak - new_peak)
    total = total * correction + jnp.sum(weights, axis=-1)
    acc = acc * correction[..., None] + _batched_matmul(weights, vt.astype(jnp.float32), 2, 1)
    return new_peak, total, acc


def _paged_decode(q, k_pages, v_pages, page_table, q_positions, *, tile_pages: int, window=None):
    """Decode over pages, one static loop per row (as `_tiled_decode`), reading only the row's
    live pages: first a loop over the whole tiles of `tile_pages` pages below the row's length,
    unmasked, then the pages left (fewer than a tile, or a tile's worth whose last page is
    partial) in at most one tile of each power-of-two page count, masked by position: 1000 keys
    in 128-key pages and 512-key tiles run a whole tile and one 4-page tile, as many steps as
    the contiguous loop, reading less than a page past the row's last key. A tile of n > 1
    pages is a `take` of them from the pool; one page is a dynamic index. Position -1 runs none.
    """
    rows, _, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group = num_heads // num_kv_heads
    tile_pages = max(1, min(tile_pages, max_pages))
    tile = tile_pages * page_size
    scale = 1.0 / jnp.sqrt(jnp.float32(head_dim))

    def read(pages, table, first, n):  # n pages of the row from table index `first`
        if n == 1:
            # dynamic_index clamps a garbage entry into the pool, as take's mode="clip" does.
            return jax.lax.dynamic_index_in_dim(pages, table[first], axis=1, keepdims=False)
        ids = jax.lax.dynamic_slice(table, (first,), (n,))  # first + n <= max_pages: no clamp
        tiles = jnp.take(pages, ids, axis=1, mode="clip")  # [kv_heads, n, page_size, d]
        return tiles.reshape(num_kv_heads, n * page_size, head_dim)

    outputs = []
    for row in range(rows):  # static: one small loop per row
        qr = q[row, 0].reshape(num_kv_heads, group, head_dim).astype(jnp.float32) * scale
        position = q_positions[row, 0]
        table = page_table[row]  # [max_pages]
        live = jnp.clip(position + 1, 0, max_pages * page_size)  # keys 0..position

        def whole_tile(i, carry, qr=qr, table=table, position=position):
            first = i * tile_pages
            kt = read(k_pages, table, first, tile_pages)
            vt = read(v_pages, table, first, tile_pages)
            key_pos = first * page_size + jnp.arange(tile, dtype=jnp.int32)
            valid = None if window is None else visible_keys(key_pos, position, window)
            return _online_step(carry, qr, kt, vt, valid)

        def part_tile(carry, first, n, qr=qr, table=table, position=position):
            kt, vt = read(k_pages, table, first, n), read(v_pages, table, first, n)
            key_pos = first * page_size + jnp.arange(n * page_size, dtype=jnp.int32)
            return _online_step(carry, qr, kt, vt, visible_keys(key_pos, position, window))

        carry = (
            jnp.full((num_kv_heads, group), -1e30, jnp.float32),
            jnp.zeros((num_kv_heads, group), jnp.float32),
            jnp.zeros((num_kv_heads, group, head_dim), jnp.float32),
        )
        whole = live // tile
        start = 0 if window is None else jnp.clip(position - window + 1, 0, None) // tile
        carry = jax.lax.fori_loop(jnp.minimum(start, whole), whole, whole_tile, carry)
        first = whole * tile_pages
        left = cdiv(live, page_size) - first  # 0..tile_pages pages
        n = 1 << (tile_pages.bit_length() - 1)  # the largest power of two <= tile_pages
        while n:  # static: one optional tile per bit of `left`
            taken = (left & n) > 0
            carry = jax.lax.cond(
                taken, functools.partial(part_tile, first=first, n=n), lambda c: c, carry
            )
            first = first + jnp.where(taken, n, 0)
            n //= 2
        _, total, acc = carry
        outputs.append(acc / jnp.where(total > 0, total, 1.0)[..., None])
    out = jnp.stack(outputs).reshape(rows, 1, num_heads, head_dim)
    return out.astype(q.dtype)


def paged_decode_gather(q, k_pages, v_pages, page_table, q_positions, tile: int = DECODE_TILE,
                        window=None):
    """CPU decode: tiles of `tile` positions gathered from their pages (q_len == 1)."""
    tile_pages = max(1, tile // k_pages.shape[2])
    return _paged_decode(q, k_pages, v_pages, page_table, q_positions, tile_pages=tile_pages,
                         window=window)


def paged_decode_pages(q, k_pages, v_pages, page_table, q_positions, window=None):
    """CPU decode: one page read in place per iteration (q_len == 1)."""
    return _paged_decode(q, k_pages, v_pages, page_table, q_positions, tile_pages=1, window=window)


PREFILL_TILE_ROWS = 8  # rows of a packed prefill per query tile on the CPU: 128 queries at 16
PREFILL_KEY_TILE = 512  # keys per step of a query tile's loop


def _take_pages(pages: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(pages, ids, axis=1, mode="clip")


def paged_prefill_tiled(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
    q_positions: jax.Array, *, tile_rows: int = PREFILL_TILE_ROWS, key_tile: int = PREFILL_KEY_TILE,
    take: Callable[[jax.Array, jax.Array], jax.Array] = _take_pages, window=None,
) -> jax.Array:
    """CPU prefill over rows that may be a packed prefill's: flash attention in XLA loops.

    Consecutive rows of one chunk (same page table, positions running on) are grouped into
    query tiles of up to `tile_rows` rows, found here from the tables and positions; a loop
    over the tiles attends each tile's queries together (one GEMM of tile_rows x q_len x group
    rows per KV head), and an inner loop walks the tile's sequence's pages in tiles of
    `key_tile` keys only up to the tile's last visible position, with an online softmax in
    float32. So a packed chat beside a 3k-token document reads its own few pages, not the
    document's width, and a long chunk's queries share each key read: XLA:CPU runs small-row
    GEMMs at half speed, and a 16-query row alone was 1.6x slower than the chunk it came from.
    Tiles are visited in order and each writes `tile_rows` rows of the output, of which the
    rows past its own are rewritten by the tiles that own them. `take(pages, ids)` reads a key
    tile's pages (`cpu_kernels.take_pages` where the CPU kernels run). With a `window`, a query
    tile's key loop starts at the tile holding the first key its earliest query sees."""
    rows, q_len, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    tile_rows = min(tile_rows, rows)
    tile_pages = max(1, min(key_tile // page_size, page_table.shape[1]))
    width = cdiv(page_table.shape[1], tile_pages) * tile_pages
    table = jnp.pad(page_table, ((0, tile_rows), (0, width - page_table.shape[1])))
    scale = 1.0 / jnp.sqrt(jnp.float32(head_dim))

    # Tiles: a row starts one where a chunk starts (another sequence, or positions that do not
    # continue the previous row's) and every tile_rows rows into a chunk; empty rows join none.
    first_pos, last_pos = q_positions[:, 0], jnp.max(q_positions, axis=1)
    live = first_pos >= 0
    index = jnp.arange(rows, dtype=jnp.int32)
    same_seq = jnp.concatenate([jnp.zeros(1, bool), jnp.all(page_table[1:] == page_table[:-1], axis=1)])
    runs_on = jnp.concatenate([jnp.zeros(1, bool), first_pos[1:] == last_pos[:-1] + 1])
    chunk_start = live & ~(same_seq & runs_on)
    chunk_first = jax.lax.cummax(jnp.where(chunk_start, index, 0))
    starts_tile = live & (chunk_start | ((index - chunk_first) % tile_rows == 0))
    tile_of = jnp.cumsum(starts_tile) - 1  # each row's tile (meaningful for live rows)
    (tile_first,) = jnp.nonzero(starts_tile, size=rows, fill_value=0)
    num_tiles = jnp.sum(starts_tile)

    pad = lambda a, value: jnp.concatenate(  # noqa: E731 - tile_rows rows past the end
        [a, jnp.full((tile_rows, *a.shape[1:]), value, a.dtype)])
    q_all, pos_all, tile_all = pad(q, 0), pad(q_positions, -1), pad(tile_of, -1)

    def tile_body(i, out):
        r0 = tile_first[i]
        mine = jax.lax.dynamic_slice_in_dim(tile_all, r0, tile_rows) == i  # [tile_rows]
        pos = jnp.where(mine[:, None], jax.lax.dynamic_slice_in_dim(pos_all, r0, tile_rows), -1)
        qt = jax.lax.dynamic_slice_in_dim(q_all, r0, tile_rows)  # [tile_rows, q_len, H, d]
        queries = tile_rows * q_len
        qg = qt.reshape(queries, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
        qg = qg.reshape(num_kv_heads, group * queries, head_dim).astype(jnp.float32) * scale
        qpos = jnp.broadcast_to(pos.reshape(1, queries), (group, queries)).reshape(-1)
        pages = table[r0]

        def key_body(j, carry):
            ids = jax.lax.dynamic_slice_in_dim(pages, j * tile_pages, tile_pages)
            kt = take(k_pages, ids).reshape(num_kv_heads, -1, head_dim)
            vt = take(v_pages, ids).reshape(num_kv_heads, -1, head_dim)
            key_pos = j * tile_pages * page_size + jnp.arange(tile_pages * page_size, dtype=jnp.int32)
            return _online_step(carry, qg, kt, vt, visible_keys(key_pos[None, :], qpos[:, None], window))

        carry = (jnp.full((num_kv_heads, group * queries), -1e30, jnp.float32),
                 jnp.zeros((num_kv_heads, group * queries), jnp.float32),
                 jnp.zeros((num_kv_heads, group * queries, head_dim), jnp.float32))
        steps = (jnp.max(pos) + tile_pages * page_size) // (tile_pages * page_size)
        start = 0
        if window is not None:  # the tile holding the first key the earliest query sees
            earliest = jnp.min(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max))
            start = jnp.minimum(jnp.clip(earliest - window + 1, 0, None) // (tile_pages * page_size), steps)
        _, total, acc = jax.lax.fori_loop(start, steps, key_body, carry)
        res = acc / jnp.where(total > 0, total, 1.0)[..., None]  # no visible key: zeros
        res = res.reshape(num_kv_heads, group, tile_rows, q_len, head_dim).transpose(2, 3, 0, 1, 4)
        res = res.reshape(tile_rows, q_len, num_heads, head_dim).astype(out.dtype)
        kept = jax.lax.dynamic_slice_in_dim(out, r0, tile_rows)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None, None, None], res, kept), r0, 0)

    out = jax.lax.fori_loop(0, num_tiles, tile_body, jnp.zeros_like(q_all))
    return out[:rows]


def xla_paged_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
    q_positions: jax.Array, window=None,
) -> jax.Array:
    """The XLA serving path: gathered pages for chunks, a length-following loop for decode."""
    if q.shape[1] == 1:
        return paged_decode_pages(q, k_pages, v_pages, page_table, q_positions, window)
    return paged_prefill_tiled(q, k_pages, v_pages, page_table, q_positions, window=window)


def cpu_paged_attention(q, k_pages, v_pages, page_table, q_positions, window=None):
    """The CPU kernels' path: decode by `model.cpu_kernels.paged_decode` (the row's live pages
    read once, no loop steps), prefill by the XLA tiles above, whose key tiles
    `cpu_kernels.take_pages` reads (widening a 16-bit pool's as it reads them, and reading a
    layer of a stacked pool in place)."""
    if q.shape[1] == 1:
        return cpu_kernels.paged_decode(q, k_pages, v_pages, page_table, q_positions, window)
    return paged_prefill_tiled(q, k_pages, v_pages, page_table, q_positions,
                               take=cpu_kernels.take_pages, window=window)


def pallas_paged_attention(q, k_pages, v_pages, page_table, q_positions, *, interpret=None,
                           window=None):
    """`model.pallas_paged.pallas_paged_attention`, imported lazily (keeps Pallas off the
    XLA-only import path)."""
    from cadence.model import pallas_paged

    return pallas_paged.pallas_paged_attention(
        q, k_pages, v_pages, page_table, q_positions, interpret=interpret, window=window
    )


def mosaic_paged_attention(q, k_pages, v_pages, page_table, q_positions, *, interpret=None,
                           window=None):
    """`model.mosaic_paged.mosaic_paged_attention`, imported lazily (as the Pallas one)."""
    from cadence.model import mosaic_paged

    if window is not None:
        raise NotImplementedError("the Mosaic GPU kernels do not take sliding windows yet; a "
                                  "model with sliding-window layers runs --attention=pallas")

    return mosaic_paged.mosaic_paged_attention(
        q, k_pages, v_pages, page_table, q_positions, interpret=interpret
    )


def query_rows(attend: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """`attend` with every query of a row run as a row of its own (q_len 1, the row's page
    table and the query's position): its decode path for a few queries per row, as speculative
    decoding's verify step scores (the last token and its drafts, whose KV is written before
    attention reads it). Exact, as each query sees keys up to its own position either way; on
    the CPU a handful of queries per row ran ~3x slower through the prefill tiles."""
    def attend_rows(q, k_pages, v_pages, page_table, q_positions, **window):
        rows, q_len, num_heads, head_dim = q.shape
        out = attend(q.reshape(rows * q_len, 1, num_heads, head_dim), k_pages, v_pages,
                     jnp.repeat(page_table, q_len, axis=0), q_positions.reshape(rows * q_len, 1),
                     **window)
        return out.reshape(rows, q_len, num_heads, head_dim)

    return attend_rows


PAGED_IMPLEMENTATIONS: dict[str, Callable[..., jax.Array]] = {
    "xla": xla_paged_attention,
    "reference": paged_reference_attention,
    "pallas": pallas_paged_attention,
    "mosaic": mosaic_paged_attention,
    "cpu": cpu_paged_attention,
}
# Each decode path over queries as rows (`query_rows`): "xla_rows", "pallas_rows", ...
PAGED_IMPLEMENTATIONS.update({f"{name}_rows": query_rows(PAGED_IMPLEMENTATIONS[name])
                              for name in ("xla", "pallas", "mosaic", "cpu")})


def writes_in_place(name: str) -> bool:
    """Whether attention `name` is the CPU kernels', whose pool the kernels write in place
    (`model.paged_kv.write`'s and `put_pages`' `cpu_kernel`)."""
    return name in ("cpu", "cpu_rows")


def get_paged_attention(name: str) -> Callable[..., jax.Array]:
    try:
        return PAGED_IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention implementation {name!r}; choose one of "
            f"{sorted(PAGED_IMPLEMENTATIONS)}"
        ) from None
