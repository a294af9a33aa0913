"""The Mosaic GPU paged attention kernels (`model.mosaic_paged`) against the XLA reference.

On the CPU they run in JAX's Mosaic GPU interpreter (`model.mosaic_interpret`), which simulates
shared memory, TMA copies, barriers and warpgroup matmuls, raises on a read out of bounds (a
page-table entry the kernel failed to clamp) and fills fresh memory with NaN (an output or a
split's partial the kernel failed to write). `CADENCE_PALLAS_INTERPRET=0` runs the same cases
compiled, on a Hopper GPU (`bench/gpu_check.py`'s kernel tests).

The layouts are `tests/paged_cases.py`'s: shuffled pages, garbage table entries past each
row's live pages, and a large finite poison wherever no query may look. These kernels copy
whole pages, so they do read the poison past a row's length in its last page: their masks must
keep it out (a poisoned value that leaks shows as an error of thousands). Inputs are bfloat16;
the reference computes in float32 over the same rounded values, and the tolerance is bf16's.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.model.config import TINY
from cadence.model.mosaic_paged import (
    MosaicTiling, check_supported, mosaic_paged_attention, mosaic_paged_decode,
    mosaic_paged_prefill,
)
from cadence.model.params import random_params
from tests.paged_cases import FINITE_POISON, case, reference
from tests.tiny_models import greedy_with_each, undo_embedding_boost

INTERPRET = os.environ.get("CADENCE_PALLAS_INTERPRET", "1") != "0"
TOLERANCE = 3e-2  # bfloat16 inputs and probabilities


def bf16_case(seed, rows, heads, kv_heads, head_dim, page_size, max_pages, starts, q_len):
    """A case in bfloat16 (queries, pools) with its float32 reference over the same values."""
    q, pool, positions = case(seed, rows, heads, kv_heads, head_dim, page_size, max_pages, starts,
                              q_len, FINITE_POISON)
    rounded = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in (q, *pool)]
    widened = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in rounded]
    ref = reference(widened[0], tuple(widened[1:]), positions)
    return rounded[0], rounded[1:4], positions, ref


def check_bf16(out, ref, positions):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "an unwritten output or partial (the interpreter's NaN)"
    np.testing.assert_allclose(out, ref, atol=TOLERANCE, rtol=TOLERANCE)
    assert (out[np.asarray(positions) < 0] == 0).all()


# (heads, kv_heads, head_dim, page_size, max_pages, visible keys per row (0: empty), tiling)
DECODE = [
    # GQA 3 padded to 4; 16-token pages, 4 to a tile; a table of 9 pages whose last tile
    # overhangs it; rows on page and tile boundaries and one past them, full, empty
    (6, 2, 64, 16, 9, [16, 17, 15, 0, 1, 144, 64, 65], MosaicTiling(64, 2)),
    # MHA; one 64-token page per tile, 3 splits: splits past short rows write neutral partials
    (2, 2, 64, 64, 3, [1, 64, 65, 192, 0], MosaicTiling(64, 3)),
    # GQA 8, one KV head, head_dim 128, 128-token pages (128-key tiles)
    (8, 1, 128, 128, 2, [129, 256, 0, 2], MosaicTiling(128, 1)),
]


# The first case of each in the default tier, the rest in the full tier.
@pytest.mark.parametrize("i", [0, *(pytest.param(i, marks=pytest.mark.slow) for i in range(1, len(DECODE)))])
def test_mosaic_paged_decode_matches_reference(i):
    heads, kv_heads, head_dim, page_size, max_pages, visible, tiling = DECODE[i]
    q, pages, positions, ref = bf16_case(
        50 + i, len(visible), heads, kv_heads, head_dim, page_size, max_pages,
        [n - 1 for n in visible], 1)
    out = mosaic_paged_decode(q, *pages, positions, tiling=tiling, interpret=INTERPRET)
    check_bf16(out, ref, positions)


# (heads, kv_heads, head_dim, page_size, max_pages, q_len, chunk starts per row (-1: empty))
PREFILL = [
    # GQA 3 (16 queries a block); a chunk from 0, one across a page boundary, one ending at
    # the table's end
    (6, 2, 64, 16, 8, 9, [0, 15, -1, 119]),
    # MHA (64 queries a block): a second block of 6 queries; chunks on and off page boundaries
    (2, 2, 64, 64, 3, 70, [0, 100]),
    # GQA 8 (8 queries a block), head_dim 128, 32-token pages (2 to a tile)
    (8, 1, 128, 32, 2, 20, [5, -1]),
]


@pytest.mark.parametrize("i", [0, *(pytest.param(i, marks=pytest.mark.slow) for i in range(1, len(PREFILL)))])
def test_mosaic_paged_prefill_matches_reference(i):
    heads, kv_heads, head_dim, page_size, max_pages, q_len, starts = PREFILL[i]
    q, pages, positions, ref = bf16_case(
        60 + i, len(starts), heads, kv_heads, head_dim, page_size, max_pages, starts, q_len)
    out = mosaic_paged_prefill(q, *pages, positions, interpret=INTERPRET)
    check_bf16(out, ref, positions)


@pytest.mark.slow
def test_mosaic_kernels_race_free_with_small_pages():
    """8-token pages (8 copies and barriers per tile, two tiles in flight) under the
    interpreter's race detector: no buffer is read before its copy's barrier, none written
    while read. Decode with several splits, then a prefill chunk."""
    if not INTERPRET:
        pytest.skip("the race detector is the interpreter's")
    from cadence.model import mosaic_interpret

    q, pages, positions, ref = bf16_case(70, 3, 4, 1, 64, 8, 24, [130, 7, 191], 1)
    with mosaic_interpret.detecting_races() as raced:
        out = mosaic_paged_decode(q, *pages, positions, tiling=MosaicTiling(64, 2), interpret=True)
        assert not raced()
    check_bf16(out, ref, positions)
    q, pages, positions, ref = bf16_case(71, 2, 4, 1, 64, 8, 24, [100, 0], 30)
    with mosaic_interpret.detecting_races() as raced:
        out = mosaic_paged_prefill(q, *pages, positions, interpret=True)
        assert not raced()
    check_bf16(out, ref, positions)


@pytest.mark.slow
def test_mosaic_paged_attention_dispatches_and_follows_the_default_tiling():
    """The entry point: decode for one query per row (default tiling), prefill otherwise."""
    for q_len, starts in ((1, [90, -1]), (5, [3, 60])):
        q, pages, positions, ref = bf16_case(80 + q_len, 2, 4, 2, 64, 32, 4, starts, q_len)
        check_bf16(mosaic_paged_attention(q, *pages, positions, interpret=INTERPRET), ref,
                   positions)


@pytest.mark.parametrize("change, message", [
    ({"dtype": jnp.float32}, "bfloat16 or float16"),
    ({"head_dim": 96}, "head_dim % 64"),
    ({"page_size": 48}, "pages of"),
    ({"heads": 130}, "GQA group"),
])
def test_mosaic_kernels_refuse_what_they_do_not_take(change, message):
    shape = {"dtype": jnp.bfloat16, "head_dim": 64, "page_size": 16, "heads": 4, **change}
    q = jax.ShapeDtypeStruct((2, 1, shape["heads"], shape["head_dim"]), shape["dtype"])
    pages = jax.ShapeDtypeStruct((1, 8, shape["page_size"], shape["head_dim"]), shape["dtype"])
    with pytest.raises(ValueError, match=message):
        check_supported(q, pages)


def test_mosaic_kernels_lower_for_cuda():
    """On the CPU the kernels lower for a CUDA GPU (Hopper) at the Llama-3-8B and SmolLM2
    shapes, decode and prefill, each to one Mosaic GPU call of its own name."""
    from cadence.engine.lowering import kernel_calls
    from cadence.model.control import compiled_kernels

    attend = jax.jit(functools.partial(mosaic_paged_attention, interpret=False))
    for heads, kv_heads, head_dim, page_size in [(32, 8, 128, 64), (9, 3, 64, 16)]:
        for rows, q_len, kernel in [(1, 512, "cadence_mosaic_prefill"),
                                    (64, 1, "cadence_mosaic_decode")]:
            q = jax.ShapeDtypeStruct((rows, q_len, heads, head_dim), jnp.bfloat16)
            pages = jax.ShapeDtypeStruct((kv_heads, 1024, page_size, head_dim), jnp.bfloat16)
            table = jax.ShapeDtypeStruct((rows, 4096 // page_size), jnp.int32)
            pos = jax.ShapeDtypeStruct((rows, q_len), jnp.int32)
            with compiled_kernels():
                traced = attend.trace(q, pages, pages, table, pos)
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            assert kernel_calls(text) == {kernel: 1}


@pytest.mark.slow
def test_engine_with_mosaic_attention_matches_pallas_token_for_token():
    """The engine's own prefill (packed chunks at odd offsets) and decode programs over
    shuffled pages, bfloat16, with the Mosaic GPU kernels against the Triton ones (both
    interpreted): the same greedy tokens, at a tiny shape the Mosaic kernels take (head_dim 64,
    16-token pages, 4 to a tile)."""
    model = dataclasses.replace(TINY, head_dim=64)
    params = undo_embedding_boost(random_params(model, jax.random.key(3), jnp.bfloat16))
    results = greedy_with_each(
        params, model, ("pallas", "mosaic"), (5, 70, 23), [6, 9, 4], [13, 32, 7], seed=7,
        num_slots=4, max_seq_len=128, prefill_chunk=32, min_prefill_bucket=16, min_kv_bucket=64,
        page_size=16, dtype="bfloat16")
    assert results["mosaic"] == results["pallas"]
