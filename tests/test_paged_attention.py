"""The paged KV pool and attention over it, on the CPU (Pallas kernels in interpret mode).

Every layout is random (`tests/paged_cases.py`): shuffled pages, garbage past each row's live
pages, and poison wherever no query may look: NaN for the Pallas kernels, whose masked loads
must never read it, and a large finite value for the XLA paths, which read whole tiles but must
mask them. Each path is checked against `paged_reference_attention`, and the reference against
`xla_attention` on the same keys laid out contiguously. Shapes are small because interpret mode
is slow.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.engine.packing import PrefillChunk, pack_chunks
from cadence.model import kv_cache, paged_kv
from cadence.model.arith import cdiv
from cadence.model.attention import xla_attention
from cadence.model.config import TINY
from cadence.model.paged_attention import (
    gather_pages, get_paged_attention, paged_decode_gather, paged_decode_pages,
    xla_paged_attention,
)
from cadence.model.pallas_decode import DecodeTiling
from cadence.model.pallas_paged import (
    paged_decode, paged_prefill, paged_split_partials, pallas_paged_attention,
)
from cadence.model.pallas_prefill import PrefillTiling
from cadence.model.paged_kv import PagedKVCache
from tests.fakes import needs_cpu_kernels
from tests.paged_cases import ATOL, FINITE_POISON, case, check, poisoned_pair, reference

INTERPRET = os.environ.get("CADENCE_PALLAS_INTERPRET", "1") != "0"


# (heads, kv_heads, head_dim, page_size, max_pages, decode: visible keys per row, 0 = empty)
DECODE = [
    # GQA 3; page size 8: exactly on boundaries (8, 16), off by one (7, 9, 17), full, empty
    (6, 2, 16, 8, 5, [8, 9, 7, 16, 17, 40, 0, 1]),
    # MHA; page size 16: one key, a page and one, a page less one, full
    (2, 2, 32, 16, 4, [1, 17, 15, 64, 0]),
    # GQA 4; page size 32, one KV head
    (4, 1, 16, 32, 3, [33, 96, 0, 31]),
]


@pytest.mark.parametrize("i", range(len(DECODE)))
def test_xla_decode_paths_match_reference(i):
    heads, kv_heads, head_dim, page_size, max_pages, visible = DECODE[i]
    q, pool, positions = case(
        i, len(visible), heads, kv_heads, head_dim, page_size, max_pages,
        [n - 1 for n in visible], 1, FINITE_POISON,
    )
    ref = reference(q, pool, positions)
    args = (q, *pool[:3], positions)
    # The serving entry point runs the page loop; check it through the entry point once.
    page_loop = xla_paged_attention if i == 0 else paged_decode_pages
    check(jax.jit(page_loop)(*args), ref, positions)
    # Two-page tiles: whole gathered tiles, then a 2-page and a 1-page tile for what is left.
    two_pages = functools.partial(paged_decode_gather, tile=2 * page_size)
    check(jax.jit(two_pages)(*args), ref, positions)
    if i == 0:  # the 512-position tile clipped to the table (5 pages): 4-, 2-, 1-page tails
        check(jax.jit(paged_decode_gather)(*args), ref, positions)


# (heads, kv_heads, head_dim, page_size, max_pages, q_len, chunk starts per row, -1 = empty)
PREFILL = [
    (6, 2, 16, 8, 6, 9, [0, 15, -1, 39]),  # GQA 3; a chunk ending on a page boundary (39+9=48)
    (2, 2, 16, 16, 3, 5, [11, 16, 0]),  # MHA; chunks starting on and off a page boundary
    (4, 1, 32, 32, 2, 7, [25, 32, -1]),  # GQA 4; a chunk across pages, one right after it
]


@pytest.mark.parametrize("i", range(len(PREFILL)))
def test_xla_prefill_chunks_match_contiguous(i):
    heads, kv_heads, head_dim, page_size, max_pages, q_len, starts = PREFILL[i]
    q, pool, positions = case(
        10 + i, len(starts), heads, kv_heads, head_dim, page_size, max_pages, starts, q_len,
        FINITE_POISON,
    )
    ref = reference(q, pool, positions)
    check(jax.jit(get_paged_attention("xla"))(q, *pool[:3], positions), ref, positions)


# DECODE cases with a tiling each: tiles of two pages, tiles inside a page, several splits
DECODE_TILINGS = [DecodeTiling(16, 2), DecodeTiling(16, 3), DecodeTiling(16, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(DECODE)))
def test_pallas_paged_decode_matches_reference(i):
    heads, kv_heads, head_dim, page_size, max_pages, visible = DECODE[i]
    q, pool, positions, ref = poisoned_pair(
        20 + i, len(visible), heads, kv_heads, head_dim, page_size, max_pages,
        [n - 1 for n in visible], 1,
    )
    args = (q, *pool[:3], positions)
    tiling = DECODE_TILINGS[i]
    shapes = jax.eval_shape(functools.partial(paged_split_partials, tiling=tiling), *args)
    poison = tuple(jnp.full(s.shape, jnp.nan, s.dtype) for s in shapes)
    out = paged_decode(*args, tiling=tiling, interpret=INTERPRET, partials=poison)
    check(out, ref, positions)


PREFILL_TILINGS = [PrefillTiling(4, 16), PrefillTiling(8, 16), PrefillTiling(4, 16)]


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_pallas_paged_kernels_widen_an_8_bit_pool(dtype):
    """--kv_cache_dtype=float8_* on the Pallas kernels: decode and a prefill chunk over an 8-bit
    float pool (NaN poison where no query may look: every 8-bit NaN the pool could hold) equal
    the same kernels over that pool widened to the queries' dtype first, to the bit."""
    for i, (q_len, positions_of) in enumerate([(1, lambda n: n - 1), (5, lambda n: max(n - 5, 0))]):
        heads, kv_heads, head_dim, page_size, max_pages, visible = DECODE[0]
        q, pool, positions, _ = poisoned_pair(
            40 + i, len(visible), heads, kv_heads, head_dim, page_size, max_pages,
            [positions_of(n) for n in visible], q_len)
        narrow = (pool[0].astype(dtype), pool[1].astype(dtype), pool[2])
        wide = (narrow[0].astype(q.dtype), narrow[1].astype(q.dtype), pool[2])
        if q_len == 1:
            run = functools.partial(paged_decode, tiling=DECODE_TILINGS[0], interpret=INTERPRET)
        else:
            run = functools.partial(paged_prefill, tiling=PREFILL_TILINGS[0], interpret=INTERPRET)
        got, want = run(q, *narrow, positions), run(q, *wide, positions)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.isfinite(np.asarray(got)).all()


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(PREFILL)))
def test_pallas_paged_prefill_matches_reference(i):
    heads, kv_heads, head_dim, page_size, max_pages, q_len, starts = PREFILL[i]
    q, pool, positions, ref = poisoned_pair(
        30 + i, len(starts), heads, kv_heads, head_dim, page_size, max_pages, starts, q_len
    )
    poison = jnp.full(q.shape, jnp.nan, q.dtype)
    out = paged_prefill(
        q, *pool[:3], positions, tiling=PREFILL_TILINGS[i], interpret=INTERPRET, out=poison
    )
    check(out, ref, positions)


@pytest.mark.slow
def test_pallas_paged_prefill_over_packed_chunks_matches_each_chunk_alone():
    """A pack (`engine.packing`) of chunks of mixed lengths at mixed offsets, two of them of one
    sequence, one ending on a page boundary, one of a single token: every row of the packed
    kernel's output equals its chunk's attention computed alone over its sequence laid out
    contiguously, and padding queries get zeros. Pages nobody owns hold NaN."""
    heads, kv_heads, head_dim, page_size, block = 6, 2, 16, 8, 8
    ends = [29, 16, 45]  # sequence lengths in KV (every chunk's keys already written)
    chunks_at = [(0, 17, 12), (1, 0, 16), (2, 3, 1), (2, 30, 15)]  # (sequence, start, length)
    rng = np.random.default_rng(9)
    max_pages = 6
    num_pages = len(ends) * max_pages + 2
    tables = rng.permutation(num_pages)[: len(ends) * max_pages].reshape(len(ends), max_pages)
    k_seq = [rng.standard_normal((1, kv_heads, n, head_dim)).astype(np.float32) for n in ends]
    v_seq = [rng.standard_normal((1, kv_heads, n, head_dim)).astype(np.float32) for n in ends]
    pools = [np.full((kv_heads, num_pages, page_size, head_dim), np.nan, np.float32) for _ in "kv"]
    for seq, n in enumerate(ends):
        for p in range(n):
            pools[0][:, tables[seq, p // page_size], p % page_size] = k_seq[seq][0, :, p]
            pools[1][:, tables[seq, p // page_size], p % page_size] = v_seq[seq][0, :, p]
    chunks = [PrefillChunk(seq, [1] * n, start, False, tables[seq].tolist())
              for seq, start, n in chunks_at]
    (pack,) = pack_chunks(chunks, block=block, token_buckets=(32, 64), page_buckets=(max_pages,),
                          page_size=page_size, num_slots=4)
    rows = pack.tokens.shape[0]
    q = jnp.asarray(rng.standard_normal((rows, block, heads, head_dim)), jnp.float32)
    positions = jnp.asarray(pack.positions)
    out = np.asarray(paged_prefill(q, *map(jnp.asarray, pools), jnp.asarray(pack.tables), positions,
                                   tiling=PrefillTiling(4, 16), interpret=INTERPRET))
    assert np.isfinite(out).all()
    flat_q, flat_out = np.asarray(q).reshape(-1, heads, head_dim), out.reshape(-1, heads, head_dim)
    flat_pos = pack.positions.reshape(-1)
    row = 0
    for (seq, start, n), c in zip(chunks_at, chunks):
        at = row * block
        alone = xla_attention(jnp.asarray(flat_q[at:at + n][None]), jnp.asarray(k_seq[seq]),
                              jnp.asarray(v_seq[seq]), jnp.asarray(flat_pos[at:at + n][None]))
        np.testing.assert_allclose(flat_out[at:at + n], np.asarray(alone)[0], atol=ATOL, rtol=ATOL)
        row += cdiv(n, block)
    assert (flat_out[flat_pos < 0] == 0).all()


@pytest.mark.slow
def test_pallas_paged_attention_dispatches_on_query_length():
    """Decode for one query per row, prefill otherwise, default tilings, bfloat16 in and out."""
    for q_len, starts in ((1, [20, -1]), (6, [3, 17])):
        q, pool, positions, ref = poisoned_pair(40 + q_len, 2, 4, 2, 16, 8, 4, starts, q_len)
        bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
        out = pallas_paged_attention(bf(q), *map(bf, pool[:2]), pool[2], positions)
        assert out.dtype == jnp.bfloat16
        out = np.asarray(out.astype(jnp.float32))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, atol=3e-2, rtol=3e-2)


def test_paged_kernels_lower_to_triton_for_gpu(triton_verifications):
    """As in test_pallas: on the CPU the paged kernels still lower for a CUDA GPU, and the
    Triton modules verify, at the Llama-3-8B and SmolLM2 shapes in bfloat16."""
    verified = triton_verifications
    attend = jax.jit(functools.partial(pallas_paged_attention, interpret=False))
    for heads, kv_heads, head_dim in [(32, 8, 128), (9, 3, 64)]:
        for batch, q_len in [(1, 512), (64, 1)]:
            q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
            pages = jax.ShapeDtypeStruct((kv_heads, 4096, 16, head_dim), jnp.bfloat16)
            table = jax.ShapeDtypeStruct((batch, 256), jnp.int32)
            pos = jax.ShapeDtypeStruct((batch, q_len), jnp.int32)
            attend.trace(q, pages, pages, table, pos).lower(lowering_platforms=("cuda",))
    assert all(verified) and (len(verified) == 4 or not INTERPRET)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("computed", [jnp.float32, jnp.bfloat16])
def test_values_past_a_narrow_pool_saturate(dtype, computed):
    """Keys and values past a narrow pool's range are stored as its largest value, from float32
    or bfloat16 activations alike (a float16 bound rounded to bfloat16 would be 65536: inf)."""
    top = float(jnp.finfo(dtype).max)
    values = jnp.asarray([7e4, -1e9, 1.5, 3e38], computed)
    got = np.asarray(paged_kv.as_pool(values, dtype)).astype(np.float32)
    assert got.tolist() == [top, -top, float(jnp.asarray(1.5, dtype)), top]


def test_pool_shapes_and_sizes():
    pool = paged_kv.PagedKVCache.create(TINY, num_pages=10, page_size=8)
    spec = paged_kv.PagedKVCache.abstract(TINY, num_pages=10, page_size=8)
    assert len(pool.k) == len(pool.v) == TINY.num_layers
    assert pool.k[0].shape == spec.k[0].shape == (TINY.num_kv_heads, 10, 8, TINY.head_dim)
    assert (pool.num_pages, pool.page_size, pool.tokens_capacity) == (10, 8, 80)
    per_token = paged_kv.bytes_per_token(TINY, jnp.float32)
    assert per_token == 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4
    assert pool.nbytes == 80 * per_token
    assert paged_kv.pages_for_bytes(TINY, pool.nbytes + 8 * per_token - 1, 8) == 10


def test_write_through_page_tables_equals_contiguous_write():
    """A prefill chunk with bucket padding, a chunk across page boundaries, an inactive row, and
    then a decode step: read back through the page tables, the pool equals a contiguous cache
    written with `kv_cache.write`, and no page outside the tables is touched."""
    rng = np.random.default_rng(7)
    kv_heads, head_dim, page_size, max_pages, rows = 2, 4, 8, 4, 3
    num_pages = rows * max_pages + 2
    table = jnp.asarray(rng.permutation(num_pages)[: rows * max_pages].reshape(rows, max_pages))
    pages = jnp.zeros((kv_heads, num_pages, page_size, head_dim), jnp.float32)
    slots = jnp.zeros((rows, kv_heads, max_pages * page_size, head_dim), jnp.float32)
    write = jax.jit(paged_kv.write)
    steps = [  # (positions [rows, t], lengths [rows])
        (np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]), [3, 5, 0]),
        (np.array([[3], [10], [0]]), [1, 1, 0]),
        (np.array([[15, 16, 17], [31, 32, 33], [8, 9, 10]]), [3, 3, 2]),  # 32, 33: past reach
    ]
    for positions, lengths in steps:
        new = jnp.asarray(rng.standard_normal((rows, positions.shape[1], kv_heads, head_dim)))
        positions, lengths = jnp.asarray(positions, jnp.int32), jnp.asarray(lengths, jnp.int32)
        pages = write(pages, new, table, positions, lengths)
        slots = kv_cache.write(slots, new, jnp.arange(rows), positions, lengths)
    np.testing.assert_array_equal(np.asarray(gather_pages(pages, table)), np.asarray(slots))
    spare = np.setdiff1d(np.arange(num_pages), np.asarray(table))
    assert spare.size == 2 and (np.asarray(pages)[:, spare] == 0).all()
    assert np.count_nonzero(np.asarray(slots)[2]) > 0  # the third row's last write landed
    # A negative position (an inactive row's placeholder) is dropped even inside the length,
    # where a contiguous write would wrap it to the slot's end.
    new = jnp.ones((rows, 1, kv_heads, head_dim))
    after = write(pages, new, table, jnp.full((rows, 1), -1, jnp.int32), jnp.ones(rows, jnp.int32))
    np.testing.assert_array_equal(np.asarray(after), np.asarray(pages))


@needs_cpu_kernels
@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "stacked"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernels_copy_and_insert_pages_as_xla_does(dtype, stacked):
    """Whole-page copies (a partial prefix hit, a fork) and inserts (a KV handoff) written in
    place by the CPU kernels: the same bits as XLA's scatter, in every layer, padding (a target
    past the pool) writing nothing."""
    config = dataclasses.replace(TINY, num_layers=3)
    rng = np.random.default_rng(0)
    shape = (config.num_layers, *PagedKVCache.shape(config, 9, 4))
    pool = jnp.asarray(rng.standard_normal(shape), dtype)
    as_pool = (lambda a: a) if stacked else (lambda a: tuple(a))
    sources, targets = jnp.asarray([2, 5, 5, 0], jnp.int32), jnp.asarray([7, 1, 9, 9], jnp.int32)
    new = jnp.asarray(rng.standard_normal((config.num_layers, shape[1], 2, 4, shape[-1])), jnp.float32)
    ids = jnp.asarray([3, 9], jnp.int32)
    for op, args in ((paged_kv.copy_pages, (sources, targets)), (paged_kv.insert_pages, (new, ids))):
        run = jax.jit(lambda p, *a, kernel: op(p, *a, cpu_kernel=kernel), static_argnames="kernel")
        got = np.asarray(jnp.stack(run(as_pool(pool), *args, kernel=True)), np.float32)
        want = np.asarray(jnp.stack(run(as_pool(pool), *args, kernel=False)), np.float32)
        np.testing.assert_array_equal(got, want, err_msg=op.__name__)
        changed = np.flatnonzero((got != np.asarray(pool, np.float32)).any(axis=(0, 1, 3, 4)))
        assert list(changed) == ([1, 7] if op is paged_kv.copy_pages else [3]), op.__name__
