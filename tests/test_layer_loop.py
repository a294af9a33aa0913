"""The layer loop (`model.layer_loop`): the decoder's layers as one `fori_loop` over weights and a
KV pool stacked over layers, against the same layers unrolled (the path every other backend
runs), kernel for kernel; and the engine and its page programs over a stacked pool."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.engine import programs
from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.model import cpu_kernels, layer_loop, llama
from cadence.model.paged_kv import PagedKVCache
from cadence.model.quant import quantize_grouped
from tests.conftest import random_params
from tests.tiny_models import (GEMMA3_TINY, GRANITE_TINY, QWEN3_TINY, QWEN_TINY, SMOLLM3_TINY, TINY, engine_greedy,
                               undo_embedding_boost)

needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                       reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
forward = jax.jit(llama.forward, static_argnames=("config", "attention"))


def _mixed_tree(params, config):
    """A decode tree whose layers differ in format, as a Q4_K_M file's do: q4 blocks but for
    layer 1's down projection (float32) and layer 0's v (q8, so no layer fuses q/k/v)."""
    _, packed = quantize_grouped(params, config, "q4")
    packed.pop(("layers_1", "mlp", "down", "kernel"))
    packed[("layers_0", "attn", "v", "kernel")] = quantize_grouped(params, config, "q8")[1][
        ("layers_0", "attn", "v", "kernel")]
    return cpu_kernels.decode_params(params, packed, config.num_layers)


def _run(params, config, cache):
    """A prefill of two rows (12 and 7 tokens), then a decode step of each: both logits and
    the pool."""
    rng = np.random.default_rng(3)
    table = jnp.asarray([[0, 2], [3, 1]], jnp.int32)
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, (2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    prefill, cache = forward(params, tokens, positions, jnp.asarray([12, 7], jnp.int32), cache,
                             table, config=config, attention="cpu")
    decode, cache = forward(params, tokens[:, :1], jnp.asarray([[12], [7]], jnp.int32),
                            jnp.ones(2, jnp.int32), cache, table, config=config, attention="cpu")
    return np.asarray(prefill), np.asarray(decode), cache


@needs_cpu_kernels
# Llama, Qwen2, Qwen3 and Gemma 3 in float32 pages, and 16-bit pages on the tiny model; SmolLM3,
# Granite and the other 16-bit cases in the full tier (the default tier reads a SmolLM3 and a
# Granite file through test_gguf).
@pytest.mark.parametrize("config, kv_dtype", [
    pytest.param(config, kv_dtype, id=f"{dtype_id}-{config_id}",
                 marks=[pytest.mark.slow] if (kv_dtype is jnp.bfloat16 and config is not TINY)
                 or config_id in ("smollm3-tiny", "granite-tiny") else [])
    for kv_dtype, dtype_id in ((jnp.float32, "float32"), (jnp.bfloat16, "bfloat16"))
    for config, config_id in ((TINY, "tiny"), (QWEN_TINY, "qwen-tiny"), (QWEN3_TINY, "qwen3-tiny"),
                              (SMOLLM3_TINY, "smollm3-tiny"), (GRANITE_TINY, "granite-tiny"),
                              (GEMMA3_TINY, "gemma3-tiny"))])
def test_the_loop_computes_what_the_unrolled_layers_compute(config, kv_dtype):
    """Prefill and decode logits, and every page written, equal the unrolled layers' to the
    bit, over layers of mixed formats (each layer's matrix read in its own), q/k/v biases and
    an untied head (qwen-tiny), an unrotated layer (smollm3-tiny), Granite's scalars, Gemma 3's
    sliding layers (each layer's window and rotation picked by the counter), 16-bit pages."""
    params = random_params(config)
    unrolled = _mixed_tree(params, config)
    assert unrolled["layers_0"]["mlp"]["down"]["kernel_blocked"].dtype == jnp.uint8
    assert unrolled["layers_1"]["mlp"]["down"]["kernel_blocked"].dtype == jnp.float32
    assert "qkv" not in unrolled["layers_1"]["attn"] and "gate_up" in unrolled["layers_1"]["mlp"]
    stacked = layer_loop.stack_layers(_mixed_tree(params, config), config.num_layers)
    more = ("q4",) * (config.num_layers - 2)
    assert stacked["layers"]["mlp"]["down"]["kernel_blocked"].formats == ("q4", "float32", *more)
    assert stacked["layers"]["attn"]["v"]["kernel_blocked"].formats == ("q8", "q4", *more)
    # What a step reads is the same bytes either way (but each stacked matrix's alignment).
    read, stacked_read = cpu_kernels.decode_bytes(unrolled), cpu_kernels.decode_bytes(stacked)
    assert read <= stacked_read < read + 64 * 7 * config.num_layers
    want = _run(unrolled, config, PagedKVCache.create(config, 4, 8, kv_dtype))
    got = _run(stacked, config, PagedKVCache.create(config, 4, 8, kv_dtype, stacked=True))
    # Bit for bit, but with Granite's residual scale and Gemma's norms after each branch: XLA may
    # fuse x + r * h (or the norm into the sum) in one program and not the other, roundings apart
    # (one of the pool's dtype, at most).
    ulp = 2.0 ** -7 if kv_dtype == jnp.bfloat16 else 1e-5
    exact = config.residual_multiplier == 1 and not config.post_norms
    same = (np.testing.assert_array_equal if exact else
            lambda a, b, err_msg: np.testing.assert_allclose(a, b, rtol=ulp, atol=3e-5, err_msg=err_msg))
    for name, a, b in zip(("prefill logits", "decode logits"), got, want):
        same(a, b, err_msg=name)
    for name, pool, layers in (("k", got[2].k, want[2].k), ("v", got[2].v, want[2].v)):
        same(np.asarray(pool, np.float32), np.asarray(jnp.stack(layers), np.float32), err_msg=name)


@needs_cpu_kernels
def test_a_loop_program_holds_one_layers_kernel_calls():
    """What the loop is for: the program's kernel calls (and XLA's kernels around them) are one
    layer's, not one per layer."""
    config = dataclasses.replace(TINY, num_layers=6)
    params = random_params(config)
    args = (jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32))

    def calls(tree, stacked):
        cache = PagedKVCache.create(config, 2, 8, stacked=stacked)
        text = forward.lower(tree, *args, cache, jnp.zeros((1, 1), jnp.int32), config=config,
                             attention="cpu").as_text()
        return text.count(cpu_kernels.LAYERED_MATMUL)

    unrolled = calls(cpu_kernels.decode_params(params, None, 6), False)
    looped = calls(layer_loop.stack_layers(cpu_kernels.decode_params(params, None, 6), 6), True)
    per_layer = (unrolled - 1) // 6  # the tied head is one more
    assert per_layer >= 4 and unrolled == 6 * per_layer + 1 and looped == per_layer + 1


@needs_cpu_kernels
def test_an_engine_runs_its_layers_as_a_loop_and_decodes_the_unrolled_engines_tokens():
    """Through an engine's own programs (packed prefill chunks at odd offsets, batched decode,
    scattered pages, a 16-bit pool): the loop's greedy tokens are the unrolled engine's."""
    params = undo_embedding_boost(random_params(QWEN_TINY))
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, QWEN_TINY.vocab_size, n)) for n in (5, 40, 19)]
    out = {}
    for loop in (True, False):
        engine = Engine(params, QWEN_TINY, EngineConfig(
            num_slots=4, max_seq_len=128, prefill_chunk=16, attention="cpu", decode_matmul="cpu",
            kv_dtype="bfloat16", layer_loop=loop))
        assert engine.stacked_layers == loop and engine.cache.stacked == loop
        out[loop] = engine_greedy(engine, prompts, [12, 9, 12], [16, 7])
    assert out[True] == out[False]
    assert len({t for row in out[True] for t in row}) > 5


@needs_cpu_kernels
def test_int8_blocks_keep_an_engine_unrolled(tiny_params, tiny_config):
    """int8 blocks (`model.quant`, a per-column scale) have no layered kernel: the engine says
    why and runs its layers unrolled, as before."""
    from cadence.model.quant import quantize

    engine = Engine(quantize(tiny_params, tiny_config), tiny_config, EngineConfig(
        num_slots=2, max_seq_len=64, prefill_chunk=16, attention="cpu", decode_matmul="cpu"))
    assert not engine.stacked_layers and not engine.cache.stacked
    tree = cpu_kernels.decode_params(quantize(tiny_params, tiny_config), None, tiny_config.num_layers)
    assert "int8 blocks" in layer_loop.unstackable(tree, tiny_config.num_layers)
    with pytest.raises(ValueError, match="int8 blocks"):
        layer_loop.stack_layers(tree, tiny_config.num_layers)


def test_page_programs_over_a_stacked_pool_equal_them_over_layers():
    """Copying pages (the prefix cache's copy on write), extracting them and inserting them (a
    disaggregated pair's hand-off) give a stacked pool what they give the pool as layers, and
    hand off the same arrays, so either kind of engine takes the other's pages."""
    rng = np.random.default_rng(0)
    layers = [jnp.asarray(rng.standard_normal((2, 6, 4, 8)), jnp.float32) for _ in range(3)]
    as_layers = PagedKVCache(k=tuple(layers), v=tuple(a + 1 for a in layers))
    as_stack = PagedKVCache(k=jnp.stack(as_layers.k), v=jnp.stack(as_layers.v))
    assert as_stack.stacked and as_stack.layer_shape == (2, 6, 4, 8) and as_stack.num_pages == 6
    assert as_stack.nbytes == as_layers.nbytes

    def same(a: PagedKVCache, b: PagedKVCache):
        np.testing.assert_array_equal(np.asarray(a.k), np.asarray(jnp.stack(b.k)))
        np.testing.assert_array_equal(np.asarray(a.v), np.asarray(jnp.stack(b.v)))

    sources, targets = jnp.asarray([1, 4, 0]), jnp.asarray([5, 2, 6])  # 6: past the pool
    same(programs._copy_program(as_stack, sources, targets),
         programs._copy_program(as_layers, sources, targets))
    last = jnp.arange(3, dtype=jnp.int32)
    ids = jnp.asarray([3, 0], jnp.int32)
    k, v, token = programs._extract_program(as_stack, last, ids, 1)
    k2, v2, token2 = programs._extract_program(as_layers, last, ids, 1)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(k2))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(v2))
    into = jnp.asarray([5, 1], jnp.int32)
    (a, _), (b, _) = (programs._insert_program(cache, last, k * 2, v * 3, into, 2, 9)
                      for cache in (as_stack, as_layers))
    same(a, b)


@needs_cpu_kernels
def test_a_stacked_matrix_is_read_at_a_layer_and_only_by_its_own_width():
    """A `Stacked` matrix outside the loop has no layer to read, and x must have its K rows:
    the kernel takes K from x, so a mismatch is refused rather than read out of place."""
    params = random_params(TINY)
    stacked = layer_loop.stack_layers(cpu_kernels.decode_params(params, None, 2), 2)
    down = stacked["layers"]["mlp"]["down"]["kernel_blocked"]
    x = jnp.ones((1, TINY.ffn_size), jnp.float32)
    with pytest.raises(ValueError, match="at a layer"):
        cpu_kernels.blocked_matmul(x, down, TINY.hidden_size)
    with pytest.raises(ValueError, match="input columns"):
        cpu_kernels.blocked_matmul(x[:, :64], down.at(jnp.int32(1)), TINY.hidden_size)
    want = np.asarray(x) @ np.asarray(params["layers_1"]["mlp"]["down"]["kernel"])
    got = cpu_kernels.blocked_matmul(x, down.at(jnp.int32(1)), TINY.hidden_size)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@needs_cpu_kernels
@pytest.mark.slow  # (several devices: the full tier)
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two CPU devices")
def test_two_engines_place_one_stacked_tree_without_copying_it(tiny_params, tiny_config):
    """A disaggregated pair on the CPU (`server.runtime`): the layers stacked once, on the host,
    and each engine places the same buffers, rather than each stacking a copy; both decode the
    tokens of an engine that stacked its own."""
    from cadence.engine.engine import cpu_weights

    config = EngineConfig(num_slots=2, max_seq_len=64, prefill_chunk=16, attention="cpu",
                          decode_matmul="cpu")
    tree, looped = cpu_weights(tiny_params, None, tiny_config, config)
    shared = layer_loop.host_views(tree)
    pair = [Engine(shared, tiny_config, config, device=device) for device in jax.devices()[:2]]
    data = [engine.params["layers"]["mlp"]["down"]["kernel_blocked"].data for engine in pair]
    assert looped and all(engine.stacked_layers for engine in pair)
    assert data[0].unsafe_buffer_pointer() == data[1].unsafe_buffer_pointer()
    prompts = [[7, 300, 41, 9], list(range(100, 130))]
    want = engine_greedy(Engine(tiny_params, tiny_config, config), prompts, [6, 6], [16])
    for engine in pair:
        assert engine_greedy(engine, prompts, [6, 6], [16]) == want
    with pytest.raises(ValueError, match="runs on the layer loop"):
        Engine(shared, tiny_config, dataclasses.replace(config, layer_loop=False))
