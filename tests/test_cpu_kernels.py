"""cadence's CPU kernels (`model.cpu_kernels`) against their XLA twins. The engine that decodes
with them is checked against the reference generator in `tests/test_engine.py` and, on the
default model, `tests/test_real_model.py`."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.engine.config import EngineConfig
from cadence.model import block_layout, cpu_kernels, paged_kv
from cadence.model.paged_attention import paged_reference_attention
from cadence.model.quant import quantize, quantize_grouped
from tests.fakes import needs_cpu_kernels


def test_the_kernels_build_where_they_can():
    """On an x86-64 CPU with AVX2 and FMA and a C++ compiler (this project's machines and CI),
    the kernels build and register; so every test below runs there."""
    if cpu_kernels._cpu_supports() is None and shutil.which("c++"):
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


def test_block_and_unblock_round_trip():
    w = np.arange(5 * 37, dtype=np.float32).reshape(5, 37)
    blocked = cpu_kernels.block(w)
    assert blocked.shape == (3, 5, 16)
    assert blocked[1, 2, 3] == w[2, 16 + 3] and blocked[2, 4, 4] == w[4, 36]
    assert np.all(blocked[2, :, 5:] == 0)  # columns past N are zero
    np.testing.assert_array_equal(cpu_kernels.unblock(blocked, 37), w)


@needs_cpu_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 17])
@pytest.mark.parametrize("k, n", [(64, 128), (576, 192), (33, 37), (8, 16)])
def test_blocked_matmul_matches_xla(rows, k, n):
    rng = np.random.default_rng(rows * 1000 + k + n)
    x = rng.standard_normal((rows, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    got = jax.jit(lambda x, b: cpu_kernels.blocked_matmul(x, b, n))(x, cpu_kernels.block(w))
    assert got.shape == (rows, n)
    np.testing.assert_allclose(np.asarray(got), x @ w, rtol=2e-5, atol=2e-5 * np.sqrt(k))


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows, k, n", [(1, 64, 128), (5, 576, 192), (8, 33, 37)])
def test_16_bit_blocks_equal_the_float32_kernel_over_them_widened(dtype, rows, k, n):
    """A checkpoint's bfloat16 / float16 matrix blocked as it is (half float32's bytes): each
    weight is widened as it is loaded, so the sums are the float32 kernel's over the widened
    weights, bit for bit."""
    rng = np.random.default_rng(rows + k + n)
    x = rng.standard_normal((rows, k), np.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    matmul = jax.jit(lambda x, b: cpu_kernels.blocked_matmul(x, b, n))
    got = matmul(x, cpu_kernels.block(w))
    want = matmul(x, cpu_kernels.block(w.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@needs_cpu_kernels
def test_blocked_matmul_keeps_leading_dimensions():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 48), np.float32)
    w = rng.standard_normal((48, 40), np.float32)
    got = cpu_kernels.blocked_matmul(jnp.asarray(x), jnp.asarray(cpu_kernels.block(w)), 40)
    np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-4)


def _pool(rng, kv_heads, pages, page_size, head_dim):
    return [rng.standard_normal((kv_heads, pages, page_size, head_dim), np.float32) for _ in "kv"]


@needs_cpu_kernels
@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size", [
    (9, 3, 64, 64),    # SmolLM2-135M
    (4, 4, 16, 16),    # no grouping
    (8, 1, 128, 16),   # one KV head for eight queries, head_dim 128
    (6, 2, 80, 24),    # head_dim not a multiple of 64, pages not a multiple of 8
    (4, 2, 8, 5),
])
def test_paged_decode_matches_the_reference(heads, kv_heads, head_dim, page_size):
    """Rows at every kind of position: none (-1), the first key, a page's last and first keys,
    deep in a long table; tables whose entries past the live pages are garbage (out of the
    pool, negative), and pages shared between rows."""
    rng = np.random.default_rng(heads * head_dim + page_size)
    pages, width = 40, 12
    k_pages, v_pages = _pool(rng, kv_heads, pages, page_size, head_dim)
    positions = np.array([-1, 0, page_size - 1, page_size, 3 * page_size + 2, width * page_size - 1],
                         np.int32)
    rows = len(positions)
    table = rng.integers(0, pages, (rows, width)).astype(np.int32)
    for r, p in enumerate(positions):
        table[r, max(p, 0) // page_size + 1:] = rng.choice([-7, pages + 3, 2**30])  # garbage
    table[2] = table[3]  # two rows reading the same pages
    q = rng.standard_normal((rows, 1, heads, head_dim), np.float32)
    want = paged_reference_attention(q, k_pages, v_pages, np.clip(table, 0, pages - 1), positions[:, None])
    got = jax.jit(cpu_kernels.paged_decode)(q, k_pages, v_pages, table, positions[:, None])
    assert got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    assert np.all(np.asarray(got)[0] == 0)  # position -1 sees nothing


NARROW_POOLS = [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", NARROW_POOLS)
@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size", [(9, 3, 64, 64), (8, 1, 128, 16)])
def test_paged_decode_over_narrow_pages_equals_them_widened(dtype, heads, kv_heads, head_dim, page_size):
    """A 16- or 8-bit pool (--kv_cache_dtype) is read as it is, each value widened as it is
    loaded: exactly the float32 kernel over the same values widened first (the widening is
    exact, the arithmetic the same)."""
    rng = np.random.default_rng(head_dim)
    pages, width = 30, 6
    k_pages, v_pages = (jnp.asarray(a, dtype) for a in _pool(rng, kv_heads, pages, page_size, head_dim))
    positions = np.array([[-1], [0], [page_size], [width * page_size - 1], [2 * page_size + 5]], np.int32)
    table = rng.permutation(pages)[:len(positions) * width].reshape(len(positions), width).astype(np.int32)
    q = rng.standard_normal((len(positions), 1, heads, head_dim), np.float32)
    got = jax.jit(cpu_kernels.paged_decode)(q, k_pages, v_pages, table, positions)
    want = jax.jit(cpu_kernels.paged_decode)(q, k_pages.astype(jnp.float32), v_pages.astype(jnp.float32),
                                             table, positions)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="reads pools of"):
        cpu_kernels.paged_decode(q, k_pages, v_pages.astype(jnp.float32), table, positions)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [*NARROW_POOLS, jnp.float32])
@pytest.mark.parametrize("donate", [True, False])
def test_writing_a_narrow_pool_in_place_equals_the_scatter(dtype, donate):
    """`paged_kv.write` through the CPU kernel (a pool written in place) gives the
    scatter's pool to the bit: prefill rows of several tokens and a decode row, padding past a
    row's length, a position past its table, an inactive row (position -1), two rows writing
    one page, values that round (float32 in, 16 or 8 bits stored), and values past an 8-bit
    float's range, saturated. Donated, the kernel writes the pool's own buffer; not donated, a
    copy of it."""
    rng = np.random.default_rng(5)
    kv_heads, pages, page_size, d = 2, 12, 8, 16
    pool = jnp.asarray(rng.standard_normal((kv_heads, pages, page_size, d)), dtype)
    table = np.array([[3, 7, 1], [3, 7, 1], [0, 5, 9], [11, 2, 4]], np.int32)  # rows 0, 1 share
    positions = np.array([[5, 6, 7, 8, 9], [20, 21, 22, 23, 24], [0, 1, 2, 3, 4],
                          [-1, -1, -1, -1, -1]], np.int32)
    lengths = np.array([5, 3, 4, 0], np.int32)  # row 1: past its table after 23
    new = rng.standard_normal((4, 5, kv_heads, d)).astype(np.float32)
    new[0, 1, 0, :3] = [1e5, -1e6, np.float32(3e38)]  # past float8_e4m3fn's 448, e5m2's 57344

    def write(cpu_kernel):
        fn = jax.jit(functools.partial(paged_kv.write, cpu_kernel=cpu_kernel),
                     donate_argnums=(0,) if donate else ())
        return np.asarray(fn(jnp.array(pool), new, table, positions, lengths))

    want = write(False)
    assert not np.array_equal(want, np.asarray(pool))
    np.testing.assert_array_equal(write(True), want)
    assert np.isfinite(want.astype(np.float32)).all()
    top = float(jnp.finfo(dtype).max)
    if top < 1e5:  # float16 and the 8-bit floats: saturated at the format's largest value
        assert want[0, 3, 6, :3].astype(np.float32).tolist() == [top, -top, top]


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [*NARROW_POOLS, jnp.float32])
def test_taking_pages_of_a_narrow_pool_equals_take_then_widen(dtype):
    """Prefill's key tiles of a pool (16- or 8-bit, or float32 in the layer loop): the pages
    named (ids past the pool clipped, as the gather's mode="clip"), widened to float32, to the
    bit."""
    rng = np.random.default_rng(6)
    pool = jnp.asarray(rng.standard_normal((3, 10, 4, 24)), dtype)
    ids = jnp.asarray([4, 0, 9, 4, -3, 17], jnp.int32)
    got = jax.jit(cpu_kernels.take_pages)(pool, ids)
    want = jnp.take(pool, ids, axis=1, mode="clip").astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="reads pools of"):
        cpu_kernels.take_pages(pool.astype(jnp.int8), ids)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_every_8_bit_float_widens_exactly(dtype):
    """Every finite value of an 8-bit float pool (subnormals, both zeros, the largest), as the
    kernels widen it, equals XLA's conversion to float32."""
    bits = np.arange(256, dtype=np.uint8)
    values = bits.view(jnp.dtype(dtype))
    finite = values[np.isfinite(values.astype(np.float32))]
    pool = jnp.asarray(np.resize(finite, 8 * 32).reshape(1, 8, 4, 8))
    got = jax.jit(cpu_kernels.take_pages)(pool, jnp.arange(8, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pool).astype(np.float32))
    # Attention reads them its own way (e4m3's exponent offset folded into query and output):
    # over keys and values of every value, the float32 kernel's answer over them widened.
    q = np.random.default_rng(1).standard_normal((2, 1, 2, 8)).astype(np.float32)
    table, positions = np.array([[0, 1, 2, 3], [7, 6, 5, 4]], np.int32), np.array([[15], [12]], np.int32)
    values = jnp.flip(pool, axis=1)
    narrow = jax.jit(cpu_kernels.paged_decode)(q, pool, values, table, positions)
    wide = jax.jit(cpu_kernels.paged_decode)(q, pool.astype(jnp.float32), values.astype(jnp.float32),
                                             table, positions)
    np.testing.assert_array_equal(np.asarray(narrow), np.asarray(wide))


@needs_cpu_kernels
def test_paged_decode_refuses_what_it_does_not_compute():
    rng = np.random.default_rng(0)
    k_pages, v_pages = _pool(rng, 2, 4, 8, 16)
    table, positions = np.zeros((1, 2), np.int32), np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="one query per row"):
        cpu_kernels.paged_decode(np.zeros((1, 2, 4, 16), np.float32), k_pages, v_pages, table, positions)
    with pytest.raises(Exception, match="multiple of kv_heads"):  # raised by the kernel itself
        jax.block_until_ready(cpu_kernels.paged_decode(
            np.zeros((1, 1, 3, 16), np.float32), k_pages, v_pages, table, positions))


def test_decode_params_block_every_matrix(tiny_params):
    tree = cpu_kernels.decode_params(tiny_params)
    leaves = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}
    assert not any(name.endswith("['kernel']") for name in leaves)
    attn, mlp = tiny_params["layers_0"]["attn"], tiny_params["layers_0"]["mlp"]
    np.testing.assert_array_equal(
        cpu_kernels.unblock(tree["layers_0"]["attn"]["o"]["kernel_blocked"], attn["o"]["kernel"].shape[1]),
        attn["o"]["kernel"])
    # q, k, v (and gate, up) are one matrix, the parts' blocks one after another
    assert set(tree["layers_0"]["attn"]) == {"qkv", "o"} and set(tree["layers_0"]["mlp"]) == {"gate_up", "down"}
    qkv = cpu_kernels.unblock(tree["layers_0"]["attn"]["qkv"]["kernel_blocked"],
                              tree["layers_0"]["attn"]["qkv"]["kernel_blocked"].shape[0] * 16)
    np.testing.assert_array_equal(qkv, np.concatenate([attn[p]["kernel"] for p in "qkv"], axis=1))
    gate_up = tree["layers_0"]["mlp"]["gate_up"]["kernel_blocked"]
    np.testing.assert_array_equal(cpu_kernels.unblock(gate_up, gate_up.shape[0] * 16),
                                  np.concatenate([mlp["gate"]["kernel"], mlp["up"]["kernel"]], axis=1))
    embedding = tiny_params["embed"]["embedding"]
    assert set(tree["embed"]) == {"embedding_blocked"}  # the head's blocks serve the lookup too
    np.testing.assert_array_equal(cpu_kernels.unblock(tree["embed"]["embedding_blocked"],
                                                      embedding.shape[0]), embedding.T)
    ids = np.array([[0, 17, 255], [3, 3, 128]], np.int32)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(cpu_kernels.take_columns)(tree["embed"]["embedding_blocked"], ids)),
        embedding[ids])


@needs_cpu_kernels
def test_an_untied_head_leaves_the_embedding_a_lookup_table():
    """With an lm_head of its own, the embedding gets no blocked copy: decode never reads it
    as a matrix (Qwen2.5-0.5B's would be 519 MiB of float32), and a decode step's logits on
    the kernels are XLA's."""
    from cadence.model.llama import forward
    from cadence.model.paged_kv import PagedKVCache
    from tests.conftest import random_params
    from tests.tiny_models import QWEN_TINY

    params = random_params(QWEN_TINY)
    tree = cpu_kernels.decode_params(params)
    assert set(tree["embed"]) == {"embedding"} and "kernel_blocked" in tree["lm_head"]
    rng = np.random.default_rng(4)
    cache = PagedKVCache.create(QWEN_TINY, 8, 8)
    cache = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), cache)
    step = jax.jit(forward, static_argnames=("config", "attention"))
    args = (np.array([[3], [77]], np.int32), np.array([[5], [20]], np.int32), np.ones(2, np.int32),
            cache, np.arange(6, dtype=np.int32).reshape(2, 3))
    got = step(tree, *args, config=QWEN_TINY, attention="cpu")[0]
    want = step(params, *args, config=QWEN_TINY, attention="xla")[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)


@needs_cpu_kernels
@pytest.mark.parametrize("int8", [False, True])
def test_fused_matmul_matches_each_projection(int8):
    """Parts whose widths are not multiples of 16 (each padded to its blocks), with biases and,
    over int8, per-column scales: each part equals its own projection."""
    from cadence.model.quant import quantize_matrix

    rng = np.random.default_rng(int8)
    widths = (40, 8, 24)
    x = rng.standard_normal((5, 48), np.float32)
    parts, want = {}, []
    for name, n in zip("qkv", widths):
        w, bias = rng.standard_normal((48, n), np.float32), rng.standard_normal(n).astype(np.float32)
        if int8:
            q, scale = quantize_matrix(w, 1)
            parts[name] = {"kernel": q, "kernel_scale": scale, "bias": bias}
            w = q.astype(np.float32) * scale
        else:
            parts[name] = {"kernel": w, "bias": bias}
        want.append(x @ w + bias)
    fused = cpu_kernels.decode_params({"attn": parts})["attn"]
    assert set(fused) == {"qkv"}
    got = jax.jit(lambda x, f: cpu_kernels.fused_matmul(x, f, widths))(x, fused["qkv"])
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="do not make"):
        cpu_kernels.fused_matmul(x, fused["qkv"], (40, 8, 8))


def test_projections_unlike_each_other_stay_apart():
    """Only alike projections fuse: a bias on one part alone, or another leaf, keeps them apart."""
    rng = np.random.default_rng(0)
    part = lambda: {"kernel": rng.standard_normal((8, 16), np.float32)}  # noqa: E731
    biased = {**part(), "bias": np.zeros(16, np.float32)}
    tree = cpu_kernels.decode_params({"mlp": {"gate": biased, "up": part()}})
    assert set(tree["mlp"]) == {"gate", "up"}
    assert "kernel_blocked" in tree["mlp"]["gate"] and "bias" in tree["mlp"]["gate"]
    tree = cpu_kernels.decode_params({"mlp": {"gate": part(), "up": part()}})
    assert set(tree["mlp"]) == {"gate_up"}


@needs_cpu_kernels
@pytest.mark.parametrize("rows", [1, 4, 7, 13])
def test_int8_blocked_matmul_matches_xla_on_the_dequantized_weights(rows):
    """int8 blocks widened in registers and scaled per column: x @ (q * scale), as XLA computes
    it over the dequantized matrix (widths that are not multiples of 16 pad the scale too)."""
    from cadence.model.quant import quantize_matrix

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96), np.float32)
    q, scale = quantize_matrix(rng.standard_normal((96, 40), np.float32), 1)
    got = cpu_kernels.blocked_matmul(jnp.asarray(x), jnp.asarray(cpu_kernels.block(q)), 40,
                                     jnp.asarray(scale))
    np.testing.assert_allclose(np.asarray(got), x @ (q.astype(np.float32) * scale), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="scale"):
        cpu_kernels.blocked_matmul(jnp.asarray(x), jnp.asarray(cpu_kernels.block(q)), 40)


def test_int8_decode_params_keep_their_scales(tiny_params, tiny_config):
    int8 = quantize(tiny_params, tiny_config)
    tree = cpu_kernels.decode_params(int8)
    down = tree["layers_0"]["mlp"]["down"]
    assert down["kernel_blocked"].dtype == np.int8
    assert down["kernel_scale"] is int8["layers_0"]["mlp"]["down"]["kernel_scale"]
    assert tree["layers_0"]["mlp"]["gate_up"]["kernel_blocked"].dtype == np.int8
    assert tree["embed"]["embedding_blocked"].dtype == np.int8


def test_engine_refuses_the_cpu_matmul_in_bfloat16(tiny_params, tiny_config):
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(decode_matmul="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(attention="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int8")
    with pytest.raises(ValueError, match="pallas kernels read a pool of the compute dtype"):
        EngineConfig(attention="pallas", dtype="bfloat16", kv_dtype="float16")
    with pytest.raises(ValueError, match="mosaic kernels read a pool of the compute dtype"):
        EngineConfig(attention="mosaic", dtype="bfloat16", kv_dtype="float8_e4m3fn")
    assert EngineConfig(attention="pallas", dtype="bfloat16", kv_dtype="float8_e4m3fn").pool_dtype == "float8_e4m3fn"
    assert EngineConfig(attention="cpu", kv_dtype="bfloat16").pool_dtype == "bfloat16"


@needs_cpu_kernels
def test_kernel_decode_logits_match_xla_decode(tiny_params, tiny_config):
    """One decode step's logits over the same pool, XLA against the kernels, with float, int8
    and grouped weights."""
    from cadence.model.llama import forward
    from cadence.model.paged_kv import PagedKVCache

    rng = np.random.default_rng(3)
    cache = PagedKVCache.create(tiny_config, 16, 8)
    cache = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), cache)
    tokens = rng.integers(0, tiny_config.vocab_size, (3, 1)).astype(np.int32)
    positions = np.array([[5], [17], [40]], np.int32)
    table = rng.permutation(16)[:6].reshape(1, 6).repeat(3, 0).astype(np.int32)
    lengths = np.ones(3, np.int32)

    def run(params, attention):
        logits, _ = jax.jit(forward, static_argnames=("config", "attention"))(
            params, tokens, positions, lengths, cache, table, config=tiny_config, attention=attention)
        return np.asarray(logits)

    for params in (tiny_params, quantize(tiny_params, tiny_config)):  # float and int8 weights
        want = run(params, "xla")
        got = run(cpu_kernels.decode_params(params), "cpu")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    for fmt in ("q8", "q4"):  # grouped: the kernels over the packed matrices, XLA over their floats
        floats, packed = quantize_grouped(tiny_params, tiny_config, fmt)
        want = run(floats, "xla")
        got = run(cpu_kernels.decode_params(floats, packed), "cpu")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
        assert not np.allclose(want, run(tiny_params, "xla"), rtol=1e-4, atol=1e-3)  # they differ


@needs_cpu_kernels
@pytest.mark.parametrize("kv_dtype, attention", [
    pytest.param("bfloat16", "cpu", marks=pytest.mark.slow),
    pytest.param("float16", "cpu", marks=pytest.mark.slow), ("float8_e4m3fn", "cpu"),
    pytest.param("float8_e5m2", "cpu", marks=pytest.mark.slow), ("float8_e4m3fn", "xla")])
def test_an_engine_over_a_narrow_pool_equals_the_reference_over_one(tiny_params, tiny_config,
                                                                    tiny_tokenizer, kv_dtype, attention):
    """--kv_cache_dtype: an engine whose pool holds 16- or 8-bit keys and values (the kernel
    reads them as they are, prefill's attention widens them; or XLA's attention) gives the
    greedy tokens of the reference generator over a cache of that dtype, from a pool of half
    or a quarter of the float32 one's bytes."""
    from cadence.engine.engine import Engine
    from cadence.engine.reference import greedy_generate
    from cadence.scheduler.request import GenerationParams
    from tests.fakes import make_scheduler, run_all

    config = EngineConfig(num_slots=2, max_seq_len=128, prefill_chunk=16, attention=attention,
                          decode_matmul="cpu", decode_steps=2, kv_dtype=kv_dtype)
    engine = Engine(tiny_params, tiny_config, config)
    narrow = 4 // jnp.dtype(kv_dtype).itemsize
    assert engine.kv_cache_bytes * narrow == config.pool_pages * config.page_size * tiny_config.kv_bytes_per_token(4)
    prompts = [[7, 300, 41, 9], list(range(100, 190))]
    streams = run_all(make_scheduler(engine, tiny_tokenizer, chunk=16, budget=18),
                      [(p, GenerationParams(max_tokens=16)) for p in prompts])
    for prompt, stream in zip(prompts, streams):
        want, logits = greedy_generate(tiny_params, tiny_config, prompt, 16, tiny_tokenizer.eos_ids,
                                       kv_dtype=kv_dtype, return_logits=True)
        assert stream.request.output_ids == want
    _, exact = greedy_generate(tiny_params, tiny_config, prompts[-1], 16, tiny_tokenizer.eos_ids,
                               return_logits=True)
    assert not np.array_equal(logits[-1], exact[-1])  # the rounding is there to see


# -- grouped (block-quantized) weights ------------------------------------------------------------

def _grouped(rng, fmt: str, k: int, n: int):
    """Random (q, scale, minimum) of a [k, n] matrix in `fmt`, scales of several magnitudes."""
    scale = rng.uniform(1e-3, 5e-2, (k // 32, n)).astype(np.float16)
    if fmt == "iq4nl":
        return rng.integers(0, 16, (k, n)).astype(np.uint8), scale / 16, None
    if fmt == "q8":
        return rng.integers(-127, 128, (k, n)).astype(np.int8), scale, None
    if fmt == "q5":
        return rng.integers(-16, 16, (k, n)).astype(np.int8), scale, None
    return (rng.integers(0, 32 if fmt == "q51" else 16, (k, n)).astype(np.uint8), scale,
            rng.uniform(-0.4, 0.1, (k // 32, n)).astype(np.float16))


def _reference(fmt: str, parts, codes=None):
    """The float32 W `parts` stand for (with `codes` in place of parts' q, where given)."""
    parts = parts if codes is None else (codes, *parts[1:])
    return (_superblocks_dequantized if fmt in SUPERBLOCKS else _dequantized)(*parts, fmt=fmt)


def _pack(fmt: str, parts):
    if fmt in SUPERBLOCKS:
        return block_layout.pack_superblocks(fmt, *parts)
    return block_layout.pack_grouped(*parts, fmt=fmt)


def _dequantized(q, scale, minimum, fmt=None):
    """W = q * scale (+ minimum) per group of 32 k-rows; iq4nl's q the table's values."""
    q = block_layout.IQ4_VALUES[q] if fmt == "iq4nl" else q
    w = q.astype(np.float32) * np.repeat(scale.astype(np.float32), 32, axis=0)
    return w if minimum is None else w + np.repeat(minimum.astype(np.float32), 32, axis=0)


SUPERBLOCKS = ("q4k", "q5k", "q6k", "iq4xs", "q3k", "q2k")
GROUPED = ("q8", "q4", "q5", "iq4nl", "q51")


def _superblocks(rng, fmt: str, k: int, n: int):
    """Random (q, d, sub_scale, dmin, sub_min) of a [k, n] matrix in a K-quant `fmt`, with the
    codes' and sub-block scales' whole ranges."""
    d = rng.uniform(1e-4, 2e-3, (k // 256, n)).astype(np.float16)
    if fmt == "iq4xs":
        return (rng.integers(0, 16, (k, n)), d, rng.integers(-32, 32, (k // 32, n)), None, None)
    if fmt == "q3k":
        return (rng.integers(-4, 4, (k, n)), d, rng.integers(-32, 32, (k // 16, n)), None, None)
    if fmt == "q2k":
        return (rng.integers(0, 4, (k, n)), d, rng.integers(0, 16, (k // 16, n)),
                rng.uniform(1e-4, 2e-3, (k // 256, n)).astype(np.float16), rng.integers(0, 16, (k // 16, n)))
    if fmt == "q6k":
        return (rng.integers(-32, 32, (k, n)), d, rng.integers(-128, 128, (k // 16, n)), None, None)
    return (rng.integers(0, 16 if fmt == "q4k" else 32, (k, n)), d, rng.integers(0, 64, (k // 32, n)),
            rng.uniform(1e-4, 2e-3, (k // 256, n)).astype(np.float16), rng.integers(0, 64, (k // 32, n)))


def _superblocks_dequantized(q, d, sub_scale, dmin, sub_min, fmt=None):
    """W = (d * sub_scale) * q - dmin * sub_min in float32, as GGUF's dequantizer orders it;
    iq4xs's q the table's values."""
    q = block_layout.IQ4_VALUES[q] if fmt == "iq4xs" else q
    sub = q.shape[0] // sub_scale.shape[0]
    per = lambda a, r: np.repeat(a.astype(np.float32), r, axis=0)  # noqa: E731
    scale = per(per(d, 256 // sub) * sub_scale.astype(np.float32), sub)
    w = scale * q.astype(np.float32)
    return w if dmin is None else w - per(per(dmin, 256 // sub) * sub_min.astype(np.float32), sub)


def test_grouped_layout_is_one_record_per_group_of_a_block():
    """A block's records: 16 float16 scales (q4: then 16 minimums), then the k-rows: q8's int8
    16 to a row, q4's two k-rows to a byte (the even row in the low nibble)."""
    rng = np.random.default_rng(0)
    for fmt, record in (("q8", 544), ("q4", 320)):
        q, scale, minimum = _grouped(rng, fmt, 64, 37)
        packed = block_layout.pack_grouped(q, scale, minimum)
        assert packed.dtype == np.uint8 and packed.shape == (3, 2, record)
        assert cpu_kernels.grouped_format(packed) == fmt
        group1_block2 = packed[2, 1]
        assert group1_block2[:32].view(np.float16)[4] == scale[1, 32 + 4]
        if fmt == "q8":
            assert group1_block2[32:].view(np.int8).reshape(32, 16)[7, 3] == q[32 + 7, 32 + 3]
        else:
            assert group1_block2[32:64].view(np.float16)[4] == minimum[1, 32 + 4]
            byte = group1_block2[64:].reshape(16, 16)[3, 2]
            assert (byte & 15, byte >> 4) == (q[32 + 6, 32 + 2], q[32 + 7, 32 + 2])
        assert not packed[2, :, :32].view(np.float16)[:, 5:].any()  # columns past N: zero scales
        np.testing.assert_array_equal(block_layout.unpack_grouped(packed, 37), _dequantized(q, scale, minimum))


def test_five_and_six_bit_layouts_split_codes_into_nibble_pairs_and_high_bits():
    """q5 (Q5_0) and the K-quants: the low 4 bits of two k-rows to a byte as q4, the high bits
    in a plane of 8 (q6k: 4) k-rows to a byte; the K-quants' records are super-blocks of 256
    k-rows with their d (dmin) and the sub-blocks' integer scales (minimums) a byte each. Each
    unpacks to the float32 values GGUF's dequantizer computes, columns past N zero."""
    rng = np.random.default_rng(3)
    q, scale, _ = _grouped(rng, "q5", 64, 37)
    packed = block_layout.pack_grouped(q, scale, fmt="q5")
    assert packed.shape == (3, 2, 352) and cpu_kernels.grouped_format(packed) == "q5"
    record, codes = packed[2, 1], q[32:, 32:].astype(np.int16) + 16
    assert record[:32].view(np.float16)[4] == scale[1, 32 + 4]
    assert (record[32:96].reshape(4, 16)[1, 2] >> 3) & 1 == codes[8 + 3, 2] >> 4
    byte = record[96:].reshape(16, 16)[3, 2]
    assert (byte & 15, byte >> 4) == (codes[6, 2] & 15, codes[7, 2] & 15)
    np.testing.assert_array_equal(block_layout.unpack_grouped(packed, 37),
                                  q.astype(np.float32) * np.repeat(scale.astype(np.float32), 32, axis=0))
    for fmt, record in (("q4k", 2368), ("q5k", 2880), ("q6k", 3360)):
        parts = _superblocks(rng, fmt, 512, 37)
        packed = block_layout.pack_superblocks(fmt, *parts)
        assert packed.dtype == np.uint8 and packed.shape == (3, 2, record)
        assert cpu_kernels.grouped_format(packed) == fmt
        q, d, sub_scale = parts[:3]
        rec = packed[2, 1]
        assert rec[:32].view(np.float16)[3] == d[1, 32 + 3]
        if fmt == "q6k":
            assert rec[32:288].view(np.int8).reshape(16, 16)[3, 3] == sub_scale[16 + 3, 32 + 3]
            assert (rec[288:1312].reshape(64, 16)[2, 3] >> 2) & 3 == (q[256 + 9, 32 + 3] + 32) >> 4
        else:
            assert rec[64:192].reshape(8, 16)[3, 3] == sub_scale[8 + 3, 32 + 3]
            assert rec[192:320].reshape(8, 16)[3, 3] == parts[4][8 + 3, 32 + 3]
        byte = rec[-2048:].reshape(128, 16)[10, 3]
        assert byte & 15 == q[256 + 20, 32 + 3] & 15 and byte >> 4 == q[256 + 21, 32 + 3] & 15
        unpacked = block_layout.unpack_grouped(packed, 37)
        np.testing.assert_array_equal(unpacked, _superblocks_dequantized(*parts))
        np.testing.assert_array_equal(block_layout.unpack_grouped(packed, 48)[:, 37:], 0)


def test_iq4_layouts_hold_table_indices_in_nibble_pairs():
    """IQ4_NL's records are q4's without the minimums, IQ4_XS's super-blocks q4k's with one
    int8 scale per 32 k-rows and no dmin or minimums; the 4-bit codes index IQ4_VALUES, and
    each unpacks to the float32 values GGUF's dequantizer computes."""
    rng = np.random.default_rng(4)
    parts = _grouped(rng, "iq4nl", 64, 37)
    packed = block_layout.pack_grouped(*parts, fmt="iq4nl")
    assert packed.shape == (3, 2, 288) and cpu_kernels.grouped_format(packed) == "iq4nl"
    q, scale, _ = parts
    assert packed[2, 1, :32].view(np.float16)[4] == scale[1, 32 + 4]
    byte = packed[2, 1, 32:].reshape(16, 16)[3, 2]
    assert (byte & 15, byte >> 4) == (q[32 + 6, 32 + 2], q[32 + 7, 32 + 2])
    np.testing.assert_array_equal(block_layout.unpack_grouped(packed, 37), _reference("iq4nl", parts))
    parts = _superblocks(rng, "iq4xs", 512, 37)
    packed = block_layout.pack_superblocks("iq4xs", *parts)
    assert packed.shape == (3, 2, 2208) and cpu_kernels.grouped_format(packed) == "iq4xs"
    q, d, sub_scale = parts[:3]
    rec = packed[2, 1]
    assert rec[:32].view(np.float16)[3] == d[1, 32 + 3]
    assert rec[32:160].view(np.int8).reshape(8, 16)[5, 3] == sub_scale[8 + 5, 32 + 3]
    byte = rec[160:].reshape(128, 16)[10, 3]
    assert (byte & 15, byte >> 4) == (q[256 + 20, 32 + 3], q[256 + 21, 32 + 3])
    np.testing.assert_array_equal(block_layout.unpack_grouped(packed, 37), _reference("iq4xs", parts))
    with pytest.raises(ValueError, match="-32..31"):
        block_layout.pack_superblocks("iq4xs", q, d, np.full_like(sub_scale, 32))


def test_grouped_packing_refuses_what_the_kernels_do_not_read():
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="multiple of 32"):
        block_layout.pack_grouped(np.zeros((48, 16), np.int8), np.ones((1, 16), np.float16))
    with pytest.raises(ValueError, match="0..15"):
        block_layout.pack_grouped(np.full((32, 16), 16, np.uint8), *_grouped(rng, "q4", 32, 16)[1:])
    with pytest.raises(ValueError, match="not a grouped matrix"):
        cpu_kernels.grouped_format(np.zeros((2, 2, 100), np.uint8))
    with pytest.raises(ValueError, match="-16..15"):
        block_layout.pack_grouped(np.full((32, 16), 16, np.int8), np.ones((1, 16), np.float16), fmt="q5")
    with pytest.raises(ValueError, match="multiple of 256"):
        block_layout.pack_superblocks("q4k", np.zeros((128, 16), np.uint8), *_superblocks(rng, "q4k", 256, 16)[1:])
    parts = list(_superblocks(rng, "q4k", 256, 16))
    parts[2][0, 0] = 64
    with pytest.raises(ValueError, match="0..63"):
        block_layout.pack_superblocks("q4k", *parts)


@needs_cpu_kernels
@pytest.mark.parametrize("fmt", GROUPED)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 16, 37])
@pytest.mark.parametrize("k, n", [(32, 5), (96, 37), (576, 192), (1536, 48)])
def test_grouped_matmul_matches_numpy_dequantize_then_matmul(fmt, rows, k, n):
    """The grouped kernels against NumPy's float64 matmul over the dequantized matrix: the
    same numbers, summed in another order (per group, scaled once), so within float32
    rounding of the sum."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    parts = _grouped(rng, fmt, k, n)
    x = rng.standard_normal((rows, k), np.float32)
    got = np.asarray(cpu_kernels.blocked_matmul(jnp.asarray(x), jnp.asarray(_pack(fmt, parts)), n))
    want = x.astype(np.float64) @ _reference(fmt, parts).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(want).max())


@needs_cpu_kernels
@pytest.mark.parametrize("fmt", SUPERBLOCKS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 16, 37])
@pytest.mark.parametrize("k, n", [(256, 5), (512, 37), (1536, 48)])
def test_superblock_matmul_matches_numpy_dequantize_then_matmul(fmt, rows, k, n):
    """The K-quant kernels (Q4_K, Q5_K, Q6_K's super-blocks) likewise: within float32 rounding
    of NumPy's float64 matmul over the dequantized matrix, at 1-37 rows (the tiles of 4, or 8
    with AVX-512, and the rest) and widths that are not multiples of 16."""
    rng = np.random.default_rng(rows * 1000 + k + n + len(fmt))
    parts = _superblocks(rng, fmt, k, n)
    x = rng.standard_normal((rows, k), np.float32)
    got = np.asarray(cpu_kernels.blocked_matmul(jnp.asarray(x), jnp.asarray(_pack(fmt, parts)), n))
    want = x.astype(np.float64) @ _reference(fmt, parts).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(want).max())


@needs_cpu_kernels
@pytest.mark.parametrize("kind", ["float", "int8", "q4", "q5k"])
@pytest.mark.parametrize("activations", cpu_kernels.ACTIVATIONS)
def test_live_rows_are_computed_and_the_padding_comes_out_zero(kind, activations):
    """Inside `live_rows(total, n)` (a packed prefill: n of its `total` tokens are real), a
    matmul over `total` rows computes the first n exactly as over all of them, to the bit (each
    row's sums are its own), and gives zeros for the rest; a matmul over other rows (the LM
    head's) computes them all. n may be 0, or past the rows (all computed)."""
    rng = np.random.default_rng(5)
    k, n = 512, 40
    x = rng.standard_normal((24, k), np.float32)
    if kind == "float":
        blocked, scale = cpu_kernels.block(rng.standard_normal((k, n), np.float32)), None
    elif kind == "int8":
        from cadence.model.quant import quantize_matrix

        q, scale = quantize_matrix(rng.standard_normal((k, n), np.float32), 1)
        blocked, scale = jnp.asarray(cpu_kernels.block(q)), jnp.asarray(scale)
    else:
        blocked = jnp.asarray(_pack(kind, (_superblocks if kind in SUPERBLOCKS else _grouped)(rng, kind, k, n)))
        scale = None

    def matmul(x, live, total):
        with cpu_kernels.activations(activations), cpu_kernels.live_rows(total, live):
            return cpu_kernels.blocked_matmul(x, blocked, n, scale)

    run = jax.jit(matmul, static_argnums=2)
    full = np.asarray(run(x, jnp.int32(24), 24))
    with cpu_kernels.activations(activations):
        assert full.any() and np.array_equal(full, cpu_kernels.blocked_matmul(x, blocked, n, scale))
    for live in (0, 1, 9, 17, 24, 30):
        got = np.asarray(run(x, jnp.int32(live), 24))
        np.testing.assert_array_equal(got[:live], full[:live])
        assert not got[live:].any()
    np.testing.assert_array_equal(np.asarray(run(x, jnp.int32(3), 16)), full)  # not the pack's rows


def _int8_rows(x: np.ndarray) -> np.ndarray:
    """x's rows as the int8-activation kernels see them: per 32 values, codes rint(x / d) with
    d = amax / 127, times d."""
    groups = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(groups).max(axis=-1, keepdims=True) / np.float32(127)
    codes = np.rint(np.where(d > 0, groups / np.where(d > 0, d, 1), 0))
    return (codes * d).reshape(x.shape)


@needs_cpu_kernels
@pytest.mark.parametrize("fmt", [*GROUPED, *SUPERBLOCKS])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13])
def test_int8_activations_match_their_integer_reference(fmt, rows):
    """--cpu_activations=int8: each group's sum over the codes is taken against x quantized
    per 32 values (`_int8_rows`), the minimums against x as it is: within float32 rounding of
    NumPy's float64 over those values, at 1-13 rows (tiles of 4 or 8 and the rest); and off the
    float32 kernel's numbers by the quantization (well under 2% here), not by more."""
    rng = np.random.default_rng(rows * 7 + len(fmt))
    k, n = 512, 37
    parts = _superblocks(rng, fmt, k, n) if fmt in SUPERBLOCKS else _grouped(rng, fmt, k, n)
    w = _reference(fmt, parts).astype(np.float64)
    # the minimums (the IQ4s have none; their code 0 is a value)
    w0 = 0 * w if fmt.startswith("iq4") else _reference(fmt, parts, np.zeros_like(parts[0])).astype(np.float64)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, 32:64] = 0  # a group of zeros: scale 0, codes 0
    blocked = jnp.asarray(_pack(fmt, parts))
    with cpu_kernels.activations("int8"):
        got = np.asarray(jax.jit(lambda x: cpu_kernels.blocked_matmul(x, blocked, n))(x))
    want = _int8_rows(x).astype(np.float64) @ (w - w0) + x.astype(np.float64) @ w0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(want).max())
    exact = x.astype(np.float64) @ w
    assert 0 < np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


def test_int8_activations_are_the_cpu_kernels_and_named():
    from cadence.engine.config import CPU_ACTIVATIONS

    assert CPU_ACTIVATIONS == cpu_kernels.ACTIVATIONS
    with pytest.raises(ValueError, match="cpu_activations must be one of"):
        EngineConfig(attention="cpu", decode_matmul="cpu", cpu_activations="int4")
    with pytest.raises(ValueError, match="the CPU kernels'"):
        EngineConfig(cpu_activations="int8")
    with pytest.raises(ValueError, match="activations must be one of"):
        with cpu_kernels.activations("bfloat16"):
            pass


def test_int8_activations_without_the_cpu_kernels_are_refused_not_dropped():
    """--cpu_activations=int8 where the CPU kernels do not run (--nocpu_kernels here) is an
    error at start-up that says why, not a server that quietly computes in float32."""
    from absl import flags
    from absl.testing import flagsaver

    from cadence.server import runtime

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    with flagsaver.flagsaver(cpu_activations="int8", cpu_kernels=False):
        with pytest.raises(ValueError, match="--cpu_activations=int8 is the CPU kernels'"):
            runtime.engine_config_from_flags()
    with flagsaver.flagsaver(cpu_activations="float32", cpu_kernels=False):
        assert runtime.engine_config_from_flags().cpu_activations == "float32"


@needs_cpu_kernels
def test_an_engine_over_int8_activations_decodes_the_float_engines_tokens(tiny_params, tiny_config,
                                                                           tiny_tokenizer):
    """An engine with --cpu_activations=int8 over Q4_0-packed weights: its programs are traced
    with the int8 kernels (its logits differ from the float32 engine's), and on the tiny
    model, whose greedy choices are clear-cut, it decodes the float32 engine's tokens."""
    from cadence.engine.engine import Engine
    from cadence.scheduler.request import GenerationParams
    from tests.fakes import make_scheduler, run_all

    floats, packed = quantize_grouped(tiny_params, tiny_config, "q4")
    prompts = [[7, 300, 41, 9], list(range(100, 150))]
    results = {}
    for kind in ("float32", "int8"):
        config = EngineConfig(num_slots=2, max_seq_len=128, prefill_chunk=16, attention="cpu",
                              decode_matmul="cpu", cpu_activations=kind)
        engine = Engine(floats, tiny_config, config, packed=dict(packed))
        streams = run_all(make_scheduler(engine, tiny_tokenizer, chunk=16, budget=18),
                          [(p, GenerationParams(max_tokens=12, logprobs=3)) for p in prompts])
        # The alternatives' logprobs (the chosen token's is 0.0 either way on this model).
        results[kind] = [(s.request.output_ids, [[v for _, v in lp.top[1:]] for lp in s.request.logprobs])
                         for s in streams]
    for (want_ids, want_lp), (got_ids, got_lp) in zip(results["float32"], results["int8"]):
        assert got_ids == want_ids
        assert got_lp != want_lp  # the int8 kernels ran
        # Off by the quantization of x: the alternatives (logprobs of -7 to -17) moved 1.8% on
        # average and 5.8% at most on a 2-core Intel Xeon (under 5% on an AMD EPYC).
        moved = np.abs(np.subtract(got_lp, want_lp)) / np.abs(want_lp)
        assert moved.mean() < 0.03 and moved.max() < 0.1, moved


@needs_cpu_kernels
@pytest.mark.parametrize("fmt", [*GROUPED, *SUPERBLOCKS])
def test_dequantize_gives_the_files_own_values(fmt):
    """Prefill's dequantizer, inside a program, gives every weight exactly: the NumPy
    dequantization's bits (GGUF's, `unpack_grouped`), whole ranges of codes and scales, a width
    that is not a multiple of 16."""
    rng = np.random.default_rng(len(fmt))
    k, n = (512, 37) if fmt in SUPERBLOCKS else (96, 37)
    parts = _superblocks(rng, fmt, k, n) if fmt in SUPERBLOCKS else _grouped(rng, fmt, k, n)
    blocked = _pack(fmt, parts)
    got = np.asarray(jax.jit(cpu_kernels.dequantize, static_argnums=1)(jnp.asarray(blocked), n))
    want = block_layout.unpack_grouped(blocked, n)
    assert got.shape == (k, n) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, _reference(fmt, parts))
    # a tied embedding's lookup: W's columns, from the blocks they fall in
    ids = np.array([[36, 0, 15], [16, 36, 1]], np.int32)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(cpu_kernels.take_columns)(jnp.asarray(blocked), ids)), want.T[ids])


@needs_cpu_kernels
@pytest.mark.parametrize("kind", ["float32", "int8", "q4", "q6k"])
def test_matmul_takes_the_gemm_over_many_rows_and_the_kernel_over_few(kind):
    """`matmul` over prefill's rows (from `gemm_rows()`) is XLA's dot over the dequantized matrix,
    the same bits the float tree's prefill computes; over fewer rows it is the kernel, within
    float32 rounding of it."""
    from cadence.model.quant import quantize_matrix

    rng = np.random.default_rng(7)
    k, n = 512, 40
    scale = None
    if kind == "float32":
        w = rng.standard_normal((k, n), np.float32)
        blocked = cpu_kernels.block(w)
    elif kind == "int8":
        q, scale = quantize_matrix(rng.standard_normal((k, n), np.float32), 1)
        blocked, w = cpu_kernels.block(q), q.astype(np.float32)
    else:
        parts = _superblocks(rng, kind, k, n) if kind in SUPERBLOCKS else _grouped(rng, kind, k, n)
        blocked = _pack(kind, parts)
        w = block_layout.unpack_grouped(blocked, n)
    run = jax.jit(cpu_kernels.matmul, static_argnums=2)
    gemm_rows = cpu_kernels.gemm_rows(grouped=kind not in ("float32", "int8"))
    for rows in (gemm_rows, gemm_rows - 1):
        x = rng.standard_normal((1, rows, k), np.float32)
        got = np.asarray(run(x, blocked, n, scale))
        want = np.asarray(jax.jit(lambda x, w: jnp.dot(x, w))(x, w))
        if scale is not None:
            want = want * scale
        assert got.shape == (1, rows, n)
        if rows >= gemm_rows:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


@needs_cpu_kernels
def test_prefill_over_blocks_holds_one_dequantized_matrix_at_a_time():
    """Prefill over the blocks dequantizes each matrix as its GEMM comes: the program's
    temporaries stay near one layer's float32 matrices, not every layer's (as XLA:CPU's
    concurrency-ordered scheduler held them, which cadence's import turns off)."""
    from cadence.engine.engine import Engine
    from cadence.model.config import TINY
    from tests.conftest import random_params

    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in os.environ["XLA_FLAGS"]
    deep = dataclasses.replace(TINY, name="tiny-deep", num_layers=8, hidden_size=256, ffn_size=1024,
                               head_dim=64)
    floats, packed = quantize_grouped(random_params(deep), deep, "q4")
    rows = cpu_kernels.gemm_rows()  # a chunk that takes the GEMM
    config = EngineConfig(num_slots=1, max_seq_len=2 * rows, prefill_chunk=rows, min_prefill_bucket=rows,
                          attention="cpu", decode_matmul="cpu")
    engine = Engine(floats, deep, config, packed=packed)
    program = engine.warm_programs(("prefill",))[0]
    temp = program.fn.trace(*program.args).lower().compile().memory_analysis().temp_size_in_bytes
    layer = sum(a.nbytes for a in jax.tree.leaves(floats["layers_0"]) if a.ndim == 2)
    assert temp < 2 * layer, (temp, layer)  # all 8 layers' would be 8 * layer


def test_decode_params_read_packed_matrices_in_place_of_blocking(tiny_params, tiny_config):
    """Packed matrices replace the blocking of theirs (fused alike: q/k/v, gate/up), the tied
    head is the packed embedding, which the lookup reads too (no float table left); the rest
    is blocked."""
    from cadence.model.quant import quantize_grouped

    _, packed = quantize_grouped(tiny_params, tiny_config, "q4")
    packed.pop(("layers_1", "mlp", "down", "kernel"))
    tree = cpu_kernels.decode_params(tiny_params, packed)
    layer = tree["layers_0"]
    assert layer["attn"]["qkv"]["kernel_blocked"].dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(layer["mlp"]["down"]["kernel_blocked"]),
                                  packed[("layers_0", "mlp", "down", "kernel")])
    assert tree["layers_1"]["mlp"]["down"]["kernel_blocked"].dtype == np.float32
    assert tree["embed"]["embedding_blocked"].dtype == np.uint8
    assert set(tree["embed"]) == {"embedding_blocked"}
    mixed = dict(packed)
    mixed[("layers_0", "attn", "v", "kernel")] = quantize_grouped(tiny_params, tiny_config, "q8")[1][
        ("layers_0", "attn", "v", "kernel")]
    tree = cpu_kernels.decode_params(tiny_params, mixed)  # q4 and q8 parts do not fuse
    assert {"q", "k", "v"} <= set(tree["layers_0"]["attn"])
    assert cpu_kernels.blocked_bytes(tree) > 0
    handed = cpu_kernels.HandedOver(mixed)  # taken out as placed, the same tree
    again = cpu_kernels.decode_params(tiny_params, handed)
    assert not handed and len(mixed) > 0
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(tree),
                                 jax.tree_util.tree_leaves_with_path(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@needs_cpu_kernels
@pytest.mark.slow  # (a build of the kernels without AVX-512: ~15 s)
def test_grouped_matmul_gives_the_same_bits_with_and_without_avx512(tmp_path):
    """The AVX-512 tiles (where the CPU has them: eight rows a pass, and VNNI's integer dot
    products over int8 activations) compute each column as the AVX2 ones do:
    CADENCE_CPU_AVX512=0 in a fresh process gives the same bits, over float32 and int8
    activations, at 1-13 rows (whole tiles of 4 and 8 and the rest)."""
    import subprocess
    import sys

    rng = np.random.default_rng(7)
    cases = {f"{fmt}-{rows}": (rng.standard_normal((rows, 512), np.float32),
                               _pack(fmt, (_superblocks if fmt in SUPERBLOCKS else _grouped)(rng, fmt, 512, 40)))
             for fmt in (*GROUPED, *SUPERBLOCKS) for rows in (1, 6, 8, 13)}
    np.savez(tmp_path / "cases.npz", **{f"{k}-{part}": a for k, (x, w) in cases.items()
                                        for part, a in (("x", x), ("w", w))})
    script = (
        "import sys, numpy as np, jax.numpy as jnp\n"
        "from cadence.model import cpu_kernels\n"
        "c = np.load(sys.argv[1])\n"
        "keys = sorted({k.rsplit('-', 1)[0] for k in c.files})\n"
        "out = {}\n"
        "for kind in cpu_kernels.ACTIVATIONS:\n"
        "    with cpu_kernels.activations(kind):\n"
        "        out.update({k + kind: np.asarray(cpu_kernels.blocked_matmul(jnp.asarray(c[k + '-x']), "
        "jnp.asarray(c[k + '-w']), 40)) for k in keys})\n"
        "np.savez(sys.argv[2], **out)\n")
    outs = []
    for env in ({}, {"CADENCE_CPU_AVX512": "0"}):
        out = tmp_path / f"out{len(outs)}.npz"
        subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.npz"), str(out)],
                       check=True, env={**os.environ, **env}, timeout=300)
        outs.append(np.load(out))
    assert len(outs[0].files) == 2 * len(cases)
    for key in outs[0].files:
        np.testing.assert_array_equal(outs[0][key], outs[1][key], err_msg=key)
