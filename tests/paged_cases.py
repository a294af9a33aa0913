"""Random paged KV layouts for the attention tests, with the oracle they are checked against.

Each row's pages are shuffled across a pool with spare pages, the page-table entries past a
row's live pages hold garbage (-1, far past the pool, or another row's live page), and
everything no query may see (spare pages, the tail of a partial last page) is poison: NaN for
kernels whose masked loads must never read it, a large finite value for paths that read whole
pages or tiles but must mask them. `reference` checks the oracle, `paged_reference_attention`,
against `xla_attention` on the same keys laid out contiguously (built independently, in numpy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model.arith import cdiv
from cadence.model.attention import xla_attention
from cadence.model.paged_attention import paged_reference_attention

FINITE_POISON = 1e4
ATOL = 2e-5


def build(seed, rows, kv_heads, head_dim, page_size, max_pages, visible, poison):
    """A random paged layout: (k_pages, v_pages, page_table, k, v) where k, v are the same keys
    contiguous, [rows, kv_heads, max_pages * page_size, head_dim], zero past `visible[row]`."""
    rng = np.random.default_rng(seed)
    capacity = max_pages * page_size
    num_pages = rows * max_pages + 3  # spare pages nobody owns
    k = rng.standard_normal((rows, kv_heads, capacity, head_dim)).astype(np.float32)
    v = rng.standard_normal((rows, kv_heads, capacity, head_dim)).astype(np.float32)
    seen = np.arange(capacity)[None, :] < np.asarray(visible)[:, None]  # [rows, capacity]
    k, v = (np.where(seen[:, None, :, None], a, 0.0).astype(np.float32) for a in (k, v))

    table = rng.permutation(num_pages)[: rows * max_pages].reshape(rows, max_pages)
    pools = [np.full((kv_heads, num_pages, page_size, head_dim), poison, np.float32) for _ in "kv"]
    for r in range(rows):
        for j in range(cdiv(visible[r], page_size)):
            for pool, x in zip(pools, (k, v)):
                part = x[r, :, j * page_size:(j + 1) * page_size]
                ok = seen[r, j * page_size:(j + 1) * page_size]
                pool[:, table[r, j]] = np.where(ok[None, :, None], part, poison)
    live = np.arange(max_pages)[None, :] < cdiv(np.asarray(visible)[:, None], page_size)
    garbage = rng.choice([-1, num_pages + 7, int(table[0, 0])], size=table.shape)
    table = np.where(live, table, garbage).astype(np.int32)
    return (*map(jnp.asarray, pools), jnp.asarray(table), jnp.asarray(k), jnp.asarray(v))


def case(seed, rows, heads, kv_heads, head_dim, page_size, max_pages, starts, q_len, poison):
    """Queries at positions start..start+q_len-1 per row (start -1: an empty row)."""
    positions = np.asarray(
        [[s + t if s >= 0 else -1 for t in range(q_len)] for s in starts], np.int32
    )
    visible = [int(p.max()) + 1 for p in positions]
    pool = build(seed, rows, kv_heads, head_dim, page_size, max_pages, visible, poison)
    q = np.random.default_rng(seed + 1).standard_normal((rows, q_len, heads, head_dim))
    return jnp.asarray(q, jnp.float32), pool, jnp.asarray(positions)


def reference(q, pool, positions):
    """The oracle, checked on the way against the contiguous layout."""
    k_pages, v_pages, table, k, v = pool
    ref = np.asarray(jax.jit(paged_reference_attention)(q, k_pages, v_pages, table, positions))
    contiguous = np.asarray(jax.jit(xla_attention)(q, k, v, positions))
    np.testing.assert_allclose(ref, contiguous, atol=ATOL, rtol=ATOL)
    assert (ref[np.asarray(positions) < 0] == 0).all()
    return ref


def check(out, ref, positions):
    out = np.asarray(out)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "a path read poison: a page past a row's length, or garbage"
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=ATOL)
    assert (out[np.asarray(positions) < 0] == 0).all()


def poisoned_pair(seed, *shape_args):
    """The same case twice: NaN poison for a kernel, finite poison for the oracle."""
    q, pool, positions = case(seed, *shape_args, np.nan)
    _, clean, _ = case(seed, *shape_args, FINITE_POISON)
    return q, pool, positions, reference(q, clean, positions)
