"""Sliding-window attention (Gemma 3's sliding layers) on every CPU path, against NumPy.

A query at position p of a layer with window w sees keys p - w + 1 .. p. Each paged path (the
oracle, the XLA decode loops, the XLA prefill tiles, the CPU kernel, and each as a query per
row) is checked against attention written out in float64 NumPy over exactly those keys. Pages
wholly before a decode query's window hold NaN: the decode loops and the CPU kernel start at the
window's first page and must never read them (the prefill tiles read whole key tiles, masked,
so their layouts hold finite values there).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.model import cpu_kernels
from cadence.model.arith import cdiv
from cadence.model.paged_attention import (
    get_paged_attention, paged_decode_gather, paged_decode_pages, paged_prefill_tiled,
)
from cadence.model.pallas_decode import DecodeTiling
from cadence.model.pallas_paged import paged_decode, paged_prefill, pallas_paged_attention
from cadence.model.pallas_prefill import PrefillTiling
from tests.fakes import needs_cpu_kernels
from tests.paged_cases import FINITE_POISON, case

ATOL = 2e-5
INTERPRET = os.environ.get("CADENCE_PALLAS_INTERPRET", "1") != "0"


def windowed(q, k, v, positions, window) -> np.ndarray:
    """float64 attention of each query over keys (positions - window, position], from the
    contiguous keys `case` built ([rows, kv_heads, capacity, d])."""
    q, k, v, positions = (np.asarray(a, np.float64) for a in (q, k, v, positions))
    rows, q_len, heads, d = q.shape
    group = heads // k.shape[1]
    out = np.zeros_like(q)
    for r in range(rows):
        for t in range(q_len):
            p = int(positions[r, t])
            if p < 0:
                continue
            keys = np.arange(max(0, p - window + 1), p + 1)
            for h in range(heads):
                s = k[r, h // group, keys] @ q[r, t, h] / np.sqrt(d)
                w = np.exp(s - s.max())
                out[r, t, h] = (w / w.sum()) @ v[r, h // group, keys]
    return out


def poison_before_windows(pool, positions, window, page_size):
    """The layout with NaN in every page that lies wholly before its row's decode window."""
    k_pages, v_pages, table, k, v = pool
    k_pages, v_pages = np.array(k_pages), np.array(v_pages)
    for r, p in enumerate(np.asarray(positions)[:, 0]):
        for j in range(max(0, int(p) - window + 1) // page_size):
            k_pages[:, table[r, j]] = np.nan
            v_pages[:, table[r, j]] = np.nan
    return jnp.asarray(k_pages), jnp.asarray(v_pages), table, k, v


# (heads, kv_heads, head_dim, page_size, max_pages, visible keys per row (0: an empty row))
DECODE = [(6, 2, 16, 8, 6, [8, 9, 7, 17, 40, 0, 1, 33]), (4, 1, 16, 16, 4, [64, 17, 16, 5])]
WINDOWS = [1, 7, 8, 9, 16, 1 << 30]  # a key alone, around a page (8) and a tile, all of them


def decode_paths():
    paths = {"pages": paged_decode_pages,
             "gather two pages": lambda *a, **w: paged_decode_gather(*a, tile=16, **w),
             "xla_rows": get_paged_attention("xla_rows"), "reference": get_paged_attention("reference")}
    if cpu_kernels.available():
        paths.update(cpu=cpu_kernels.paged_decode, cpu_rows=get_paged_attention("cpu_rows"))
    return paths


@pytest.mark.parametrize("i", range(len(DECODE)))
def test_decode_paths_see_only_the_window(i):
    heads, kv_heads, head_dim, page_size, max_pages, visible = DECODE[i]
    q, pool, positions = case(40 + i, len(visible), heads, kv_heads, head_dim, page_size,
                              max_pages, [n - 1 for n in visible], 1, FINITE_POISON)
    for name, attend in decode_paths().items():
        attend = jax.jit(attend)  # the window traced, as the layer loop passes it
        for window in WINDOWS:
            want = windowed(q, pool[3], pool[4], positions, window)
            layout = (pool if name in ("reference", "gather two pages")
                      else poison_before_windows(pool, positions, window, page_size))
            got = np.asarray(attend(q, *layout[:3], positions, window=jnp.int32(window)))
            assert np.isfinite(got).all(), f"{name} read a page before the window {window}"
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=ATOL, err_msg=f"{name} {window}")


# (heads, kv_heads, head_dim, page_size, max_pages, q_len, chunk starts per row (-1: empty))
PREFILL = [(6, 2, 16, 8, 8, 9, [0, 15, -1, 39]), (4, 1, 16, 16, 4, 7, [25, 40, 0])]


@pytest.mark.parametrize("i", range(len(PREFILL)))
def test_prefill_tiles_see_only_the_window(i):
    heads, kv_heads, head_dim, page_size, max_pages, q_len, starts = PREFILL[i]
    q, pool, positions = case(50 + i, len(starts), heads, kv_heads, head_dim, page_size,
                              max_pages, starts, q_len, FINITE_POISON)
    for name, attend in (("xla", get_paged_attention("xla")),
                         ("one-page key tiles", functools.partial(paged_prefill_tiled,
                                                                   key_tile=page_size, tile_rows=2)),
                         ("reference", get_paged_attention("reference"))):
        attend = jax.jit(attend)
        for window in (1, 5, 8, 17, 1 << 30):
            want = windowed(q, pool[3], pool[4], positions, window)
            got = np.asarray(attend(q, *pool[:3], positions, window=jnp.int32(window)))
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=ATOL, err_msg=f"{name} {window}")


@needs_cpu_kernels
def test_the_kernel_takes_no_window_as_every_key():
    heads, kv_heads, head_dim, page_size, max_pages, visible = DECODE[1]
    q, pool, positions = case(61, len(visible), heads, kv_heads, head_dim, page_size, max_pages,
                              [n - 1 for n in visible], 1, FINITE_POISON)
    whole = jax.jit(cpu_kernels.paged_decode)(q, *pool[:3], positions)
    np.testing.assert_allclose(np.asarray(whole), windowed(q, pool[3], pool[4], positions, 1 << 30),
                               atol=ATOL, rtol=ATOL)
    assert cdiv(max(visible), page_size) <= max_pages


def test_the_pallas_kernels_see_only_the_window():
    """The Triton-style kernels, interpreted: decode splits that start at the window's first
    key (a split wholly before it runs no tile; pages before it hold NaN and are never read),
    and prefill blocks whose key loop starts at the tile of their earliest window, masked
    there and unmasked where every query's window covers the tile."""
    heads, kv_heads, head_dim, page_size, max_pages, visible = DECODE[0]
    q, pool, positions = case(63, len(visible), heads, kv_heads, head_dim, page_size, max_pages,
                              [n - 1 for n in visible], 1, FINITE_POISON)
    decode = jax.jit(functools.partial(paged_decode, tiling=DecodeTiling(16, 2), interpret=INTERPRET))
    for window in (1, 9, 1 << 30):
        layout = poison_before_windows(pool, positions, window, page_size)
        got = np.asarray(decode(q, *layout[:3], positions, window=jnp.int32(window)))
        assert np.isfinite(got).all(), f"read a page before the window {window}"
        np.testing.assert_allclose(got, windowed(q, pool[3], pool[4], positions, window),
                                   atol=ATOL, rtol=ATOL, err_msg=f"decode {window}")
    heads, kv_heads, head_dim, page_size, max_pages, q_len, starts = PREFILL[0]
    q, pool, positions = case(64, len(starts), heads, kv_heads, head_dim, page_size, max_pages,
                              starts, q_len, FINITE_POISON)
    prefill = jax.jit(functools.partial(paged_prefill, tiling=PrefillTiling(4, 16), interpret=INTERPRET))
    for window in (5, 17, 40):  # inside a key tile, across one, most of the sequence
        got = np.asarray(prefill(q, *pool[:3], positions, window=jnp.int32(window)))
        np.testing.assert_allclose(got, windowed(q, pool[3], pool[4], positions, window),
                                   atol=ATOL, rtol=ATOL, err_msg=f"prefill {window}")


def test_the_pallas_kernels_lower_for_cuda_with_a_window(triton_verifications):
    """With a traced window, as a sliding layer passes it, both paged kernels still lower for a
    CUDA GPU and their Triton modules verify (Gemma 3 270M's heads: 4 of 256, one KV head)."""
    attend = jax.jit(functools.partial(pallas_paged_attention, interpret=False))
    for batch, q_len in [(1, 512), (64, 1)]:
        q = jax.ShapeDtypeStruct((batch, q_len, 4, 256), jnp.bfloat16)
        pages = jax.ShapeDtypeStruct((1, 1024, 16, 256), jnp.bfloat16)
        table = jax.ShapeDtypeStruct((batch, 64), jnp.int32)
        pos = jax.ShapeDtypeStruct((batch, q_len), jnp.int32)
        attend.trace(q, pages, pages, table, pos, window=jax.ShapeDtypeStruct((), jnp.int32)).lower(
            lowering_platforms=("cuda",))
    assert all(triton_verifications) and (len(triton_verifications) == 2 or not INTERPRET)


def test_the_mosaic_kernels_refuse_a_window():
    q, pool, positions = case(62, 1, 2, 1, 16, 8, 2, [3], 1, FINITE_POISON)
    with pytest.raises(NotImplementedError, match="sliding windows"):
        get_paged_attention("mosaic")(q, *pool[:3], positions, window=4)
