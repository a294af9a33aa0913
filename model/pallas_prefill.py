"""Chunked-prefill flash attention: a Pallas kernel behind the `attend` interface.

    out = flash_prefill(q, k, v, q_positions, window=None)
      q            [batch, q_len, num_heads, head_dim]
      k, v         [batch, num_kv_heads, kv_len, head_dim]   key j at absolute position j
      q_positions  [batch, q_len] int32   query t sees keys 0..q_positions[t]; -1 sees none
      window       [] int32 or None   a sliding window: only the last `window` of those keys
      out          [batch, q_len, num_heads, head_dim], zeros for a query that sees no key

Grid: (batch, KV head, query block). A program takes `block_q` queries together with all the
query heads of its KV head's group, as one [block_q * group, head_dim] matrix, so each K/V tile
is loaded once per group and never copied per query head. It walks the KV tiles with an online
softmax in float32, and only the tiles some query of the block can see: the loop stops at the
block's largest visible position (causal skip, and per-row lengths for free), and with a
sliding window starts at the tile holding the first key its earliest window takes. Tiles that
every query of the block sees completely run without masks; the few tiles on the diagonal, at
the end of the cache, at the windows' starts, or in front of a row with position -1 run masked.

Any q_len, kv_len, chunk start and group size work: the query block and the group are padded
to powers of two inside the kernel (masked loads and stores), never by the caller.
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
class PrefillTiling:
    block_q: int  # queries per program; the matmul has block_q * next_pow2(group) rows
    block_k: int  # keys per KV tile
    num_warps: int = 4
    num_stages: int = 3


def default_tiling(q_len: int, group: int, head_dim: int) -> PrefillTiling:
    """~128 matmul rows per program (fewer for short chunks), 64-key tiles."""
    gp = next_pow2(group)
    block_q = min(max(1, 128 // gp), next_pow2(q_len))
    block_q = max(block_q, cdiv(MIN_DOT, gp))
    rows = block_q * gp
    return PrefillTiling(
        block_q=block_q, block_k=64, num_warps=8 if rows * head_dim >= 128 * 128 else 4
    )


def _kernel(pos_ref, first_ref, q_ref, k_ref, v_ref, *refs, q_len, kv_len, group, block_q, block_k,
            precision):
    o_ref = refs[-1]  # refs[0] is the aliased initial output when one is given
    gp = next_pow2(group)
    rows, head_dim = block_q * gp, q_ref.shape[-1]
    scale = score_scale(head_dim)

    # Last query block first: the blocks that see the most keys start early, short ones fill
    # the tail.
    q0 = (pl.num_programs(2) - 1 - pl.program_id(2)) * block_q
    t_ok = q0 + jnp.arange(block_q, dtype=jnp.int32) < q_len
    pos = load(pos_ref.at[pl.ds(q0, block_q)], mask=t_ok, other=-1)  # [block_q]
    q_mask = jnp.broadcast_to(
        t_ok[:, None, None] & (jnp.arange(gp) < group)[None, :, None], (block_q, gp, head_dim)
    )
    q = load(q_ref.at[pl.ds(q0, block_q), pl.ds(0, gp), :], mask=q_mask, other=0)
    q = q.reshape(rows, head_dim)
    first = load(first_ref.at[pl.ds(q0, block_q)], mask=t_ok, other=kv_len)  # window starts
    row_pos = jnp.broadcast_to(pos[:, None], (block_q, gp)).reshape(rows)
    row_first = jnp.broadcast_to(first[:, None], (block_q, gp)).reshape(rows)

    # Keys [0, hi) are visible to some query of the block; [0, lo) to every one of them (but
    # for the windows: keys before `first` are not; from the last window's start on, all are).
    hi = jnp.clip(jnp.max(pos) + 1, 0, kv_len)
    lo = jnp.clip(jnp.min(jnp.where(t_ok, pos, kv_len)) + 1, 0, kv_len)
    n_all = lax.div(hi + block_k - 1, block_k)
    f_min = jnp.min(first)  # no query of the block sees a key before it
    n_start = jnp.minimum(lax.div(f_min, block_k), n_all)
    n_open = jnp.clip(lax.div(jnp.max(jnp.where(t_ok, first, 0)) + block_k - 1, block_k), n_start, n_all)
    n_full = jnp.clip(lax.div(lo, block_k), n_open, n_all)

    def tile(j, carry, masked: bool):
        m, l, acc = carry
        k0 = j * block_k
        if masked:
            key = k0 + jnp.arange(block_k, dtype=jnp.int32)
            in_reach = (key < hi) & (key >= f_min)  # keys no query of the block sees are never read
            kv_mask = jnp.broadcast_to(in_reach[:, None], (block_k, head_dim))
            k = load(k_ref.at[pl.ds(k0, block_k), :], mask=kv_mask, other=0.0)
            v = load(v_ref.at[pl.ds(k0, block_k), :], mask=kv_mask, other=0.0)
        else:
            k = load(k_ref.at[pl.ds(k0, block_k), :])
            v = load(v_ref.at[pl.ds(k0, block_k), :])
        k, v = k.astype(q.dtype), v.astype(q.dtype)  # an 8-bit float pool's, widened exactly
        s = dot_nt(q, k, precision) * scale  # [rows, block_k], base-2 logits
        if masked:
            visible = ((key[None, :] <= row_pos[:, None]) & (key[None, :] >= row_first[:, None])
                       & in_reach[None, :])
            s = jnp.where(visible, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if masked:  # a row with nothing visible yet has m_new == NEG: exp2(0) must not count
            p = jnp.where(visible, p, 0.0)
        alpha = jnp.exp2(m - m_new)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v, precision)
        return m_new, l, acc

    carry = (
        jnp.full((rows,), NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    carry = lax.fori_loop(n_start, n_open, functools.partial(tile, masked=True), carry)
    carry = lax.fori_loop(n_open, n_full, functools.partial(tile, masked=False), carry)
    _, l, acc = lax.fori_loop(n_full, n_all, functools.partial(tile, masked=True), carry)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # no visible key: zeros, not NaN
    out = out.reshape(block_q, gp, head_dim).astype(o_ref.dtype)
    store(o_ref.at[pl.ds(q0, block_q), pl.ds(0, gp), :], out, mask=q_mask)


def flash_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    *,
    tiling: PrefillTiling | None = None,
    interpret: bool | None = None,
    out: jax.Array | None = None,
    window=None,
) -> jax.Array:
    """Flash attention for a chunk of queries at arbitrary positions (see the module docstring).

    `out`, when given, is a buffer of the output's shape that the kernel writes in place (tests
    pass a NaN-filled one so that any element the kernel fails to write shows up).
    """
    kv_spec = pl.BlockSpec((None, None, k.shape[2], q.shape[-1]), lambda b, h, i: (b, h, 0, 0))
    return flash_call(q, q_positions, k.shape[1], k.shape[2], [k, v], [kv_spec, kv_spec], _kernel,
                      name="cadence_flash_prefill", tiling=tiling, interpret=interpret, out=out,
                      window=window)


def flash_call(q, q_positions, num_kv_heads: int, kv_len: int, kv_args: list, kv_specs: list,
               kernel, *, name: str, tiling: PrefillTiling | None, interpret: bool | None,
               out, window=None, **kernel_kw) -> jax.Array:
    """The launch around a prefill kernel body, whatever layout its keys and values come in
    (`kv_args` with their `kv_specs`: a contiguous cache, or page tables and pools): the grid
    over (rows, KV heads, query blocks), the GQA query groups, each query's first visible key
    (a sliding `window`'s), the in-place output. `kv_len` is the most keys a row can have;
    `kernel_kw` go to the kernel."""
    batch, q_len, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    tiling = tiling or default_tiling(q_len, group, head_dim)
    interpret = default_interpret() if interpret is None else interpret

    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)  # free: heads are h*group+g
    q_spec = pl.BlockSpec((None, q_len, None, group, head_dim), lambda b, h, i: (b, 0, h, 0, 0))
    pos_spec = pl.BlockSpec((None, q_len), lambda b, h, i: (b, 0))
    args = [q_positions.astype(jnp.int32), first_keys(q_positions, window, kv_len), qg, *kv_args]
    in_specs = [pos_spec, pos_spec, q_spec, *kv_specs]
    aliases = {}
    if out is not None:
        args.append(out.reshape(qg.shape).astype(q.dtype))
        in_specs.append(q_spec)
        aliases = {len(args) - 1: 0}

    kernel = functools.partial(
        kernel, q_len=q_len, kv_len=kv_len, group=group, block_q=tiling.block_q,
        block_k=tiling.block_k, precision=dot_precision(q.dtype), **kernel_kw,
    )
    result = triton_call(
        kernel,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        grid=(batch, num_kv_heads, pl.cdiv(q_len, tiling.block_q)),
        in_specs=in_specs,
        out_specs=q_spec,
        input_output_aliases=aliases,
        interpret=interpret,
        name=name,
    )(*args)
    return result.reshape(batch, q_len, num_heads, head_dim)
