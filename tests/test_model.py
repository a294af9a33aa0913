"""The decoder against an independent float64 NumPy forward, and the KV cache's consistency."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from cadence.model.config import TINY, RopeScaling
from cadence.model.paged_kv import PagedKVCache
from cadence.model.llama import rope_frequencies
from tests.conftest import random_params
from tests.tiny_models import GEMMA3_TINY, GRANITE_TINY, QWEN3_TINY, SMOLLM3_TINY, forward, full_logits


def numpy_forward(params: dict, config, tokens: np.ndarray) -> np.ndarray:
    """Full causal forward of one sequence in float64, written from the Llama equations."""
    p = {k: v for k, v in params.items()}
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    t = len(tokens)
    hd, h, kv = config.head_dim, config.num_heads, config.num_kv_heads
    tables = {False: ggml_yarn_rope(config, t) if _yarn(config) else _rope(config, t)}
    if config.rope_local_theta is not None:  # Gemma 3's sliding layers: their own base, unscaled
        ang = np.arange(t)[:, None] * config.rope_local_theta ** (-np.arange(0, hd, 2) / hd)
        tables[True] = np.cos(ang), np.sin(ang)

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.rms_norm_eps) * f64(scale)

    def rope(x, cos, sin):  # x [t, heads, hd]; rotate halves
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def act(g):  # SiLU, or Gemma's tanh-approximated GELU
        if config.hidden_act == "silu":
            return g / (1 + np.exp(-g))
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))

    def linear(x, layer):
        y = x @ f64(layer["kernel"])
        return y + f64(layer["bias"]) if "bias" in layer else y

    x = f64(p["embed"]["embedding"])[tokens] * config.embedding_multiplier  # (Granite's scalars:
    r = config.residual_multiplier                                          # 1 elsewhere)
    score = config.attention_multiplier or 1 / np.sqrt(hd)
    for i in range(config.num_layers):
        L = p[f"layers_{i}"]
        a = rms(x, L["attn_norm"]["scale"])
        q = linear(a, L["attn"]["q"]).reshape(t, h, hd)
        k = linear(a, L["attn"]["k"]).reshape(t, kv, hd)
        if config.qk_norm:  # Qwen3: each head normalized over its own dimensions, then rotated
            q, k = rms(q, L["attn"]["q_norm"]["scale"]), rms(k, L["attn"]["k_norm"]["scale"])
        if i not in config.no_rope_layers:  # SmolLM3's NoPE layers leave them as they are
            cos, sin = tables[config.rope_local_theta is not None and i in config.sliding_layers]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        v = linear(a, L["attn"]["v"]).reshape(t, kv, hd)
        seen = np.tril(np.ones((t, t), bool))
        if i in config.sliding_layers:  # the query's own position and the window - 1 before it
            seen &= np.subtract.outer(np.arange(t), np.arange(t)) < config.sliding_window
        out = np.zeros((t, h, hd))
        for head in range(h):
            g = head // (h // kv)
            s = q[:, head] @ k[:, g].T * score
            s = np.where(seen, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, g]
        o = out.reshape(t, h * hd) @ f64(L["attn"]["o"]["kernel"])
        x = x + r * (rms(o, L["attn_post_norm"]["scale"]) if config.post_norms else o)
        m = rms(x, L["mlp_norm"]["scale"])
        gate, up = m @ f64(L["mlp"]["gate"]["kernel"]), m @ f64(L["mlp"]["up"]["kernel"])
        o = (act(gate) * up) @ f64(L["mlp"]["down"]["kernel"])
        x = x + r * (rms(o, L["mlp_post_norm"]["scale"]) if config.post_norms else o)
    x = rms(x, p["final_norm"]["scale"])
    head = f64(p["embed"]["embedding"]).T if config.tie_embeddings else f64(p["lm_head"]["kernel"])
    logits = x @ head / config.logits_scaling
    cap = config.final_logit_softcapping
    return logits if cap is None else cap * np.tanh(logits / cap)


def _rope(config, t):
    ang = np.arange(t)[:, None] * np.float64(rope_frequencies(config))[None, :]  # [t, hd/2]
    return np.cos(ang), np.sin(ang)


def _yarn(config) -> bool:
    return config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn"


def ggml_yarn_rope(config, t):
    """cos and sin [t, hd/2] of YaRN as ggml's rope_yarn computes each pair's angle: the
    extrapolated (unscaled) angle mixed into the interpolated one by a ramp that is 1 below the
    corrected dimension range and 0 above it, and the magnitude 1 + 0.1 ln(1 / freq_scale)."""
    s, hd = config.rope_scaling, config.head_dim

    def corr_dim(n_rot):
        return hd * np.log(s.original_max_position / (n_rot * 2 * np.pi)) / (2 * np.log(config.rope_theta))

    low = max(0.0, np.floor(corr_dim(s.beta_fast)))
    high = min(hd - 1.0, np.ceil(corr_dim(s.beta_slow)))
    i0 = np.arange(0, hd, 2, dtype=np.float64)
    ramp_mix = 1 - np.clip((i0 / 2 - low) / max(0.001, high - low), 0, 1)
    theta_extrap = np.arange(t)[:, None] * config.rope_theta ** (-i0 / hd)
    theta_interp = theta_extrap / s.factor
    theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
    mscale = s.attention_factor or 1 + 0.1 * np.log(s.factor)
    return np.cos(theta) * mscale, np.sin(theta) * mscale


QWEN_LIKE = dataclasses.replace(TINY, name="tiny-qwen", attention_bias=True, tie_embeddings=False)
LLAMA3_LIKE = dataclasses.replace(
    TINY, name="tiny-llama3", rope_theta=500000.0, max_context=512,
    rope_scaling=RopeScaling(factor=8.0, original_max_position=64),
)
MHA = dataclasses.replace(TINY, name="tiny-mha", num_kv_heads=4)
# YaRN with its attention factor given (transformers' `attention_factor`), beside QWEN3_TINY's
# default one, and the ramp placed by non-default betas.
YARN_LIKE = dataclasses.replace(TINY, name="tiny-yarn", rope_scaling=RopeScaling(
    rope_type="yarn", factor=8.0, original_max_position=64, beta_fast=16.0, beta_slow=2.0,
    attention_factor=1.3))


@pytest.mark.parametrize("rope_lookup", [False, True], ids=["rope-computed", "rope-table"])
@pytest.mark.parametrize("config", [TINY, QWEN_LIKE, QWEN3_TINY, LLAMA3_LIKE, MHA, YARN_LIKE, SMOLLM3_TINY,
                                    GRANITE_TINY, GEMMA3_TINY],
                         ids=lambda c: c.name)
def test_logits_match_float64_numpy(config, rope_lookup):
    params = random_params(config, seed=1)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 37)
    ours = full_logits(params, config, tokens, rope_lookup)
    want = numpy_forward(params, config, tokens)
    np.testing.assert_allclose(ours, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("attention", [pytest.param("xla", marks=pytest.mark.slow), "reference"])
def test_prefill_then_decode_over_scattered_pages_matches_full_forward(tiny_config, tiny_params, attention):
    """A sequence on shuffled, non-contiguous pages that a "previous occupant" filled with
    garbage, prefilled in uneven chunks and then decoded beside two inactive rows, gives the
    whole forward's logits; nothing is written outside its pages."""
    cfg = tiny_config
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 40)
    want = full_logits(tiny_params, cfg, tokens)
    page_size, pages = 8, [9, 2, 5, 11, 0, 7]  # 48 tokens' worth, in a pool of 12
    cache = PagedKVCache.create(cfg, 12, page_size)
    cache = PagedKVCache(k=tuple(a.at[:, pages].set(7.0) for a in cache.k),
                         v=tuple(a.at[:, pages].set(-3.0) for a in cache.v))
    table = jnp.asarray([pages], jnp.int32)
    got = []
    # Prefill in uneven chunks, padded to a bucket of 16, then decode one token at a time.
    start = 0
    for chunk in (5, 11, 13):
        pad = np.zeros(16, np.int64)
        pad[:chunk] = tokens[start : start + chunk]
        logits, cache = forward(
            tiny_params,
            jnp.asarray(pad, jnp.int32)[None],
            jnp.arange(start, start + 16, dtype=jnp.int32)[None],
            jnp.asarray([chunk], jnp.int32),
            cache,
            table,
            config=cfg,
            attention=attention,
        )
        got.extend(np.asarray(logits[0, :chunk]))
        start += chunk
    others = [1, 3, 4, 6, 8, 10]  # pages the inactive rows' tables point at
    decode_table = jnp.asarray([others, pages, others[::-1]], jnp.int32)
    for pos in range(start, len(tokens)):
        # A decode step over three rows; only row 1 is active.
        toks = jnp.asarray([[0], [tokens[pos]], [0]], jnp.int32)
        positions = jnp.asarray([[0], [pos], [0]], jnp.int32)
        logits, cache = forward(
            tiny_params, toks, positions, jnp.asarray([0, 1, 0], jnp.int32), cache, decode_table,
            config=cfg, attention=attention,
        )
        got.append(np.asarray(logits[1, 0]))
    np.testing.assert_allclose(np.stack(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # Inactive rows wrote nothing: pages outside the sequence's are still zero.
    for layer in cache.k + cache.v:
        assert float(jnp.abs(layer[:, jnp.asarray(others)]).max()) == 0.0


def test_logit_index_selects_one_position(tiny_config, tiny_params):
    cfg = tiny_config
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 12)
    want = full_logits(tiny_params, cfg, tokens)
    logits, _ = forward(
        tiny_params,
        jnp.asarray(tokens, jnp.int32)[None],
        jnp.arange(12, dtype=jnp.int32)[None],
        jnp.asarray([9], jnp.int32),
        PagedKVCache.create(cfg, 1, 16),
        jnp.zeros((1, 1), jnp.int32),
        config=cfg,
        logit_index=jnp.asarray([8], jnp.int32),
    )
    np.testing.assert_allclose(np.asarray(logits[0]), want[8], rtol=1e-5, atol=1e-4)


def test_write_past_the_page_table_is_dropped(tiny_config, tiny_params):
    """A padded chunk near the end of a sequence's pages must not land on anyone's page."""
    cfg = tiny_config
    cache = PagedKVCache.create(cfg, 3, 10)  # the sequence holds pages 2 then 0: 20 tokens
    tokens = jnp.ones((1, 16), jnp.int32)
    _, cache = forward(
        tiny_params, tokens, jnp.arange(10, 26, dtype=jnp.int32)[None], jnp.asarray([13]),
        cache, jnp.asarray([[2, 0]], jnp.int32), config=cfg,
    )
    k = np.asarray(cache.k[0])  # [kv_heads, pages, page_size, head_dim]
    assert np.abs(k[:, 2]).max() == 0.0 and np.abs(k[:, 1]).max() == 0.0  # 0-9 unwritten; not ours
    assert np.abs(k[:, 0]).min() > 0.0  # positions 10-19


@pytest.mark.parametrize("chunk", [pytest.param(16, marks=pytest.mark.slow), 64, 150])
def test_chunked_prefill_logits_match_whole_prefill(tiny_config, tiny_params, chunk):
    """A 150-token prompt prefilled in chunks of 16, 64 or whole gives the whole forward's logits."""
    cfg = tiny_config
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, 150)
    want = full_logits(tiny_params, cfg, tokens)
    cache = PagedKVCache.create(cfg, 12, 16)
    table = jnp.asarray([np.random.default_rng(6).permutation(12)[:10]], jnp.int32)  # 160 tokens
    got = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        logits, cache = forward(
            tiny_params, jnp.asarray(piece, jnp.int32)[None],
            jnp.arange(start, start + len(piece), dtype=jnp.int32)[None],
            jnp.asarray([len(piece)], jnp.int32), cache, table, config=cfg,
        )
        got.append(np.asarray(logits[0]))
    got = np.concatenate(got)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kv_len, tile", [(64, 16), (70, 16), (40, 64)])
def test_tiled_decode_matches_the_reference_and_skips_unseen_tiles(kv_len, tile):
    """Per-row tiled decode equals the reference for rows of every length (empty, inside one
    tile, on tile edges, in an overlapping last tile); the cache past the tile holding a row's
    position is NaN, so reading a tile the row does not need would show."""
    from cadence.model.attention import _tiled_decode, xla_attention

    rng = np.random.default_rng(6)
    positions = np.asarray([-1, 0, tile - 1, tile, kv_len - 2, kv_len - 1])
    rows = len(positions)
    q = jnp.asarray(rng.standard_normal((rows, 1, 6, 16)), jnp.float32)
    k = rng.standard_normal((rows, 2, kv_len, 16)).astype(np.float32)
    v = rng.standard_normal((rows, 2, kv_len, 16)).astype(np.float32)
    want = xla_attention(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions)[:, None])
    for row, p in enumerate(positions):
        end = (p + tile) // tile * tile  # the end of the last tile the row needs
        k[row, :, end:] = np.nan
        v[row, :, end:] = np.nan
    got = _tiled_decode(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions)[:, None], tile=tile)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[0] == 0.0)
