"""Split-K decode attention (flash-decoding): a Pallas kernel behind the `attend` interface.

    out = flash_decode(q, k, v, q_positions, window=None)
      q            [batch, 1, num_heads, head_dim]       one new token per row (slot)
      k, v         [batch, num_kv_heads, kv_len, head_dim]
      q_positions  [batch, 1] int32   row b sees keys 0..q_positions[b]; -1 = inactive row
      window       [] int32 or None   a sliding window: only the last `window` of those keys
      out          [batch, 1, num_heads, head_dim], zeros for an inactive row

Grid: (batch, KV head, split). The key axis is cut into `num_splits` equal ranges so that even
one long sequence spreads over the whole GPU. A program takes one KV head's whole group of query
heads (padded to 16 matmul rows) and walks its range in `block_k` tiles, but only up to its
row's length (and from its window's first key): a split that starts past the row's length, or
ends before its window, runs no iteration at all, and writes the neutral partial (max NEG,
sum 0, output 0). Partials are merged outside the kernel by a
log-sum-exp combine over the splits, which costs O(batch * heads * splits * head_dim).

The KV tensors are read in their cache layout (each (row, KV head) a contiguous
[kv_len, head_dim] matrix): no transpose or copy per step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from cadence.model.arith import cdiv
from cadence.model.pallas_common import (
    MIN_DOT, NEG, default_interpret, dot_nn, dot_nt, dot_precision, first_keys, load, next_pow2,
    score_scale, store, triton_call,
)


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    block_k: int  # keys per tile
    num_splits: int  # ranges the key axis is cut into (rounded so each is whole tiles)
    num_warps: int = 4
    num_stages: int = 3


def _multiprocessors() -> int:
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132)  # an H100/H200 has 132 SMs


def default_tiling(batch: int, num_kv_heads: int, kv_len: int, head_dim: int) -> DecodeTiling:
    """Enough programs for ~4 waves over the GPU (a short tail), each split >= 4 tiles long."""
    block_k = min(64 if head_dim >= 128 else 128, max(MIN_DOT, next_pow2(kv_len)))
    wanted = cdiv(4 * _multiprocessors(), batch * num_kv_heads)
    most = max(1, kv_len // (4 * block_k))
    return DecodeTiling(block_k=block_k, num_splits=max(1, min(wanted, most)))


def _kernel(len_ref, first_ref, q_ref, k_ref, v_ref, *refs, group, rows, block_k, split_len,
            precision):
    o_ref, m_ref, l_ref = refs[-3:]  # any refs before them are aliased initial partials
    head_dim = q_ref.shape[-1]
    scale = score_scale(head_dim)
    split = pl.program_id(2) * split_len
    start = jnp.maximum(split, first_ref[pl.program_id(0)])  # (a sliding window's first key)
    end = jnp.minimum(split + split_len, len_ref[pl.program_id(0)])
    num_tiles = lax.div(jnp.maximum(end - start, 0) + block_k - 1, block_k)

    g_ok = jnp.arange(rows) < group
    q_mask = jnp.broadcast_to(g_ok[:, None], (rows, head_dim))
    q = load(q_ref.at[pl.ds(0, rows), :], mask=q_mask, other=0)  # [rows, head_dim]

    def tile(j, carry):
        m, l, acc = carry
        k0 = start + j * block_k
        in_range = k0 + jnp.arange(block_k, dtype=jnp.int32) < end
        kv_mask = jnp.broadcast_to(in_range[:, None], (block_k, head_dim))
        # An 8-bit float pool's tiles widened (exactly) to the queries' dtype.
        k = load(k_ref.at[pl.ds(k0, block_k), :], mask=kv_mask, other=0.0).astype(q.dtype)
        v = load(v_ref.at[pl.ds(k0, block_k), :], mask=kv_mask, other=0.0).astype(q.dtype)
        s = jnp.where(in_range[None, :], dot_nt(q, k, precision) * scale, NEG)  # base 2
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite: every tile has a key in range
        p = jnp.exp2(s - m_new[:, None])
        alpha = jnp.exp2(m - m_new)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v, precision)
        return m_new, l, acc

    m, l, acc = lax.fori_loop(
        0,
        num_tiles,
        tile,
        (
            jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        ),
    )
    store(o_ref.at[pl.ds(0, rows), :], acc, mask=q_mask)
    store(m_ref.at[pl.ds(0, rows)], m, mask=g_ok)
    store(l_ref.at[pl.ds(0, rows)], l, mask=g_ok)


def split_partials(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    *,
    tiling: DecodeTiling | None = None,
    interpret: bool | None = None,
    partials: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    window=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel alone: per-split (unnormalised output, base-2 max, sum), shaped
    [batch, kv_heads, splits, group, head_dim], [..., group], [..., group], all float32.

    `partials`, when given, are buffers of those shapes that the kernel writes in place (tests
    pass NaN-filled ones so that a partial the kernel fails to write shows up).
    """
    kv_spec = pl.BlockSpec((None, None, k.shape[2], q.shape[-1]), lambda b, h, s: (b, h, 0, 0))
    return split_call(q, q_positions, k.shape[1], k.shape[2], [k, v], [kv_spec, kv_spec], _kernel,
                      name="cadence_flash_decode", tiling=tiling, interpret=interpret,
                      partials=partials, window=window)


def split_call(q, q_positions, num_kv_heads: int, kv_len: int, kv_args: list, kv_specs: list,
               kernel, *, name: str, tiling: DecodeTiling | None, interpret: bool | None,
               partials, window=None, **kernel_kw) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The split-K launch around a decode kernel body, whatever layout its keys and values
    come in (`kv_args` with their `kv_specs`: a contiguous cache, or page tables and pools):
    the grid, the per-row key ranges (a sliding `window`'s too), the GQA query groups, the
    partial outputs and their aliasing. `kv_len` is the most keys a row can have; `kernel_kw`
    go to the kernel."""
    batch, q_len, num_heads, head_dim = q.shape
    if q_len != 1:
        raise ValueError(f"decode attention takes one query per row, got q_len={q_len}")
    group = num_heads // num_kv_heads
    tiling = tiling or default_tiling(batch, num_kv_heads, kv_len, head_dim)
    interpret = default_interpret() if interpret is None else interpret
    split_len = cdiv(cdiv(kv_len, tiling.num_splits), tiling.block_k) * tiling.block_k
    splits = cdiv(kv_len, split_len)

    # Keys row b may see: 0..position, clipped to [0, kv_len] (-1 gives 0).
    lengths = jnp.clip(q_positions[:, 0].astype(jnp.int32) + 1, 0, kv_len)
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    shapes = (
        jax.ShapeDtypeStruct((batch, num_kv_heads, splits, group, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, splits, group), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, splits, group), jnp.float32),
    )
    out_specs = (
        pl.BlockSpec((None, None, None, group, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, group), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((None, None, None, group), lambda b, h, s: (b, h, s, 0)),
    )
    in_specs = [
        pl.BlockSpec((batch,), lambda b, h, s: (0,)),
        pl.BlockSpec((batch,), lambda b, h, s: (0,)),
        pl.BlockSpec((None, None, group, head_dim), lambda b, h, s: (b, h, 0, 0)),
        *kv_specs,
    ]
    args = [lengths, first_keys(q_positions[:, 0], window, kv_len), qg, *kv_args]
    aliases = {}
    if partials is not None:
        aliases = {len(args) + i: i for i in range(3)}
        args += [p.astype(jnp.float32) for p in partials]
        in_specs += list(out_specs)

    kernel = functools.partial(
        kernel, group=group, rows=max(MIN_DOT, next_pow2(group)), block_k=tiling.block_k,
        split_len=split_len, precision=dot_precision(q.dtype), **kernel_kw,
    )
    return triton_call(
        kernel,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        out_shape=shapes,
        grid=(batch, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases=aliases,
        interpret=interpret,
        name=name,
    )(*args)


def combine(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Log-sum-exp merge over the split axis (2): [batch, kv_heads, group, head_dim] float32.

    Empty splits carry (NEG, 0, 0) and weigh exp2(NEG - max) = 0; a row with no key at all has
    total weight 0 and gets zeros.
    """
    peak = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - peak)  # [b, h, s, g]
    total = jnp.sum(w * l, axis=2)
    out = jnp.sum(w[..., None] * acc, axis=2)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def flash_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    *,
    tiling: DecodeTiling | None = None,
    interpret: bool | None = None,
    partials: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    window=None,
) -> jax.Array:
    """Decode attention for one query per row (see the module docstring)."""
    acc, m, l = split_partials(
        q, k, v, q_positions, tiling=tiling, interpret=interpret, partials=partials, window=window
    )
    return combine(acc, m, l).reshape(q.shape).astype(q.dtype)
