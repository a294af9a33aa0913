"""cadence's CPU kernels (`model.cpu_kernels`) against their XLA twins. The engine that decodes
with them is checked against the reference generator in `tests/test_engine.py` and, on the
default model, `tests/test_real_model.py`."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.engine.engine import EngineConfig
from cadence.model import cpu_kernels
from cadence.model.paged_attention import paged_reference_attention
from cadence.model.quant import quantize
from tests.test_engine import needs_cpu_kernels


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
    assert tree["embed"]["embedding"] is embedding  # the lookup table is shared, not copied
    np.testing.assert_array_equal(cpu_kernels.unblock(tree["embed"]["embedding_blocked"],
                                                      embedding.shape[0]), embedding.T)


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


@needs_cpu_kernels
def test_kernel_decode_logits_match_xla_decode(tiny_params, tiny_config):
    """One decode step's logits over the same pool, XLA against the kernels, with float and
    int8 weights."""
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
