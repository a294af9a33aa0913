"""LoRA adapters (`model.lora`): the bank's correction equals the adapters merged into the
weights, per row of a mixed batch, through the model, the engine's programs on every path (XLA,
the CPU kernels' decode tree with its layer loop), and its validation."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.bench.random_gguf import write_gguf_adapter
from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.engine.programs import sampling_rows
from cadence.engine.reference import greedy_generate
from cadence.model import lora
from cadence.model.host_sampling import RequestSampling, SamplingRows
from cadence.model.llama import forward
from cadence.model.paged_kv import PagedKVCache
from tests.tiny_models import (engine_greedy, peft_tensors, random_adapter, undo_embedding_boost,
                               write_peft_adapter)


@pytest.fixture(scope="module")
def adapters(tiny_config):
    return [random_adapter(tiny_config, "every", 4, lora.PROJECTIONS, 1),
            random_adapter(tiny_config, "some", 2, ("q", "v", "down"), 2)]


# Each row's adapters, as (bank slot, scale) pairs: one adapter, a mix at llama-server's
# scales, none.
ROWS = [((0, 1.0),), ((0, 0.25), (1, -0.5)), ()]


def test_forward_with_the_bank_equals_the_merged_weights_row_by_row(tiny_config, tiny_params, adapters):
    cfg = tiny_config
    params = jax.tree.map(np.asarray, tiny_params)
    banked = lora.with_bank(params, lora.bank_arrays(cfg, adapters, 3, 4), cfg.num_layers)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 8)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (3, 8))

    def run(p, scales=None):
        cache = PagedKVCache.create(cfg, 4, 16)
        return forward(p, tokens, positions, jnp.full((3,), 8, jnp.int32), cache,
                       jnp.arange(3, dtype=jnp.int32)[:, None], config=cfg, attention="reference",
                       adapters=scales)[0]

    scales = jnp.asarray(SamplingRows.of([RequestSampling(lora=r) for r in ROWS], 3).lora)
    got = run(banked, scales)
    base = run(params)
    for row, pairs in enumerate(ROWS):
        merged = lora.merged_params(params, cfg, [(adapters[i], s) for i, s in pairs])
        want = run(merged)[row]
        np.testing.assert_allclose(got[row], want, atol=1e-4, rtol=1e-4)
        if pairs:  # the adapter moved the logits: the comparison means something
            assert float(jnp.abs(want - base[row]).max()) > 0.1
    # A bank with no scales (or none of its slots used) is the base model.
    np.testing.assert_array_equal(run(banked), base)


ENGINES = {
    "cpu-kernels": dict(attention="cpu", decode_matmul="cpu"),  # decode tree, layer loop
    "xla": dict(attention="xla"),
}


# XLA's path in the full tier (the default tier runs the model's XLA path above, and the engine
# on the CPU kernels that serve on the CPU).
@pytest.mark.parametrize("path", ["cpu-kernels", pytest.param("xla", marks=pytest.mark.slow)])
def test_engine_rows_on_different_adapters_equal_the_reference_on_merged_weights(
        path, tiny_config, tiny_params, adapters):
    cfg = tiny_config
    params = jax.tree.map(np.asarray, undo_embedding_boost(tiny_params))  # no copy loops
    engine = Engine(params, cfg, EngineConfig(num_slots=4, max_seq_len=128, prefill_chunk=32,
                                                   min_kv_bucket=64, lora_slots=3, lora_rank=4,
                                                   **ENGINES[path]),
                    adapters=adapters)
    if path == "cpu-kernels":
        assert engine.stacked_layers
    # The first prompt ends alone, a chunk of two rows in a pack with room for a padding chunk.
    rows_equal_the_merged_reference(engine, params, cfg, adapters, (75, 9, 14), seed=5, n=8,
                                    changed=True)


def rows_equal_the_merged_reference(engine, params, cfg, adapters, lengths, *, seed, n, changed=False):
    """Random prompts of `lengths`, one on each of `ROWS`' mixes, greedy through `engine`
    (`engine_greedy`: prefilled in chunks, decoded together): each row's `n` tokens are the
    reference generator's over its merged weights (`changed`: and not the base model's, where
    it runs an adapter)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(k)] for k in lengths]
    rows = sampling_rows([RequestSampling(lora=r) for r in ROWS] + [RequestSampling()], 3)
    got = engine_greedy(engine, prompts, [n] * len(prompts), [5, 32, 7], rows)
    for prompt, pairs, tokens in zip(prompts, ROWS, got):
        merged = lora.merged_params(params, cfg, [(adapters[i], s) for i, s in pairs])
        assert tokens == greedy_generate(merged, cfg, prompt, n)
        if changed and pairs:
            assert tokens != greedy_generate(params, cfg, prompt, n)


def test_bank_and_rows_refuse_what_they_cannot_hold(tiny_config, tiny_params, adapters):
    cfg = tiny_config
    with pytest.raises(ValueError, match="rank 4; the bank holds rank 2"):
        lora.bank_arrays(cfg, adapters, 2, 2)
    with pytest.raises(ValueError, match="2 adapters for a bank of 1"):
        lora.bank_arrays(cfg, adapters, 1, 4)
    a, b = adapters[1].weights[(0, "q")]
    wrong = lora.LoraAdapter("wrong", 2, {(0, "q"): (a[:-1], b)})
    with pytest.raises(ValueError, match="needs"):
        wrong.check(cfg)
    with pytest.raises(ValueError, match="no projection 'embed'"):
        lora.LoraAdapter("wrong", 2, {(0, "embed"): (a, b)}).check(cfg)
    rows = SamplingRows(2, 3)
    with pytest.raises(ValueError, match="past the engine's 3 adapter slots"):
        rows.set(0, RequestSampling(lora=((3, 1.0),)))
    for bad in (((0, float("nan")),), ((0, 1.0), (0, 2.0)), ((-1, 1.0),), ((0,),)):
        with pytest.raises(ValueError, match="lora"):
            RequestSampling(lora=bad)
    with pytest.raises(ValueError, match="LoRA adapters for an engine without a bank"):
        Engine(tiny_params, cfg, EngineConfig(num_slots=2, max_seq_len=64, prefill_chunk=16),
               adapters=adapters)
    with pytest.raises(ValueError, match="both 0"):
        EngineConfig(lora_slots=2)
    # A full bank holds only the projections its adapters change: another is refused whole.
    full = Engine(tiny_params, cfg, EngineConfig(num_slots=2, max_seq_len=64, prefill_chunk=16,
                                                 lora_slots=1, lora_rank=4), adapters=adapters[1:])
    before = jax.tree.map(np.asarray, full.params)
    with pytest.raises(ValueError, match="changes gate, k, o, up, which the bank does not hold"):
        full.set_adapter(0, adapters[0])
    with pytest.raises(ValueError, match="slot 1 is outside the bank's 1"):
        full.set_adapter(1, adapters[1])
    assert full.lora_versions == [0]
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, full.params), before)


def test_a_peft_folder_loads_as_the_adapter_it_holds(tmp_path, tiny_config, adapters):
    from cadence.checkpoints.adapters import load_adapter

    for adapter, alpha in zip(adapters, (8, 3)):
        write_peft_adapter(tmp_path / adapter.name, tiny_config, adapter, alpha)
        loaded = load_adapter(tmp_path / adapter.name, tiny_config)
        assert (loaded.name, loaded.rank, set(loaded.weights)) == (adapter.name, adapter.rank,
                                                                   set(adapter.weights))
        for key, (a, b) in adapter.weights.items():
            np.testing.assert_allclose(loaded.weights[key][0], a, rtol=1e-6)
            np.testing.assert_allclose(loaded.weights[key][1], b, rtol=1e-5)
    # rsLoRA scales by alpha / sqrt(r), not alpha / r; alpha_pattern gives a module its own
    # alpha. (The file holds b / (8 / 4), as written for alpha 8 at rank 4.)
    adapter = adapters[0]
    write_peft_adapter(tmp_path / "rs", tiny_config, adapter, 8, use_rslora=True,
                       alpha_pattern={"layers.1.mlp.down_proj": 2})
    loaded = load_adapter(tmp_path / "rs", tiny_config, name="rs")
    for (layer, proj), (_, b) in adapter.weights.items():
        alpha = 2 if (layer, proj) == (1, "down") else 8
        np.testing.assert_allclose(loaded.weights[(layer, proj)][1], b / 2 * alpha / 2, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_adapter_loads_with_its_rope_rows_restored(tmp_path, tiny_config, adapters, arch):
    from cadence.checkpoints.adapters import load_adapter

    adapter = adapters[0]
    write_gguf_adapter(tmp_path / "a.gguf", tiny_config, adapter, 16, arch)
    loaded = load_adapter(tmp_path / "a.gguf", tiny_config)
    assert (loaded.name, loaded.rank) == ("a", 4)
    for key, (a, b) in adapter.weights.items():
        np.testing.assert_allclose(loaded.weights[key][0], a, rtol=1e-6)
        np.testing.assert_allclose(loaded.weights[key][1], b, rtol=1e-5)


def test_adapters_cadence_cannot_serve_are_refused_by_name(tmp_path, tiny_config, adapters):
    import json

    import safetensors.numpy

    from cadence.checkpoints.adapters import load_adapter
    from cadence.checkpoints.errors import CheckpointError

    adapter = adapters[1]
    cases = {"dora": ({"use_dora": True}, None, "DoRA"),
             "saved": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
             "bias": ({"bias": "lora_only"}, None, "trained biases"),
             "embedding": ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((2, 512), np.float32)},
                           "adapts no projection"),
             "half": ({}, "drop_b", "lora_A alone")}
    for name, (settings, extra, message) in cases.items():
        folder = tmp_path / name
        write_peft_adapter(folder, tiny_config, adapter, 4, **settings)
        tensors = peft_tensors(tiny_config, adapter, 4)
        if extra == "drop_b":
            del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
        elif extra:
            tensors |= extra
        safetensors.numpy.save_file(tensors, str(folder / "adapter_model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            load_adapter(folder, tiny_config)
    # A rank that does not fit the base model's shapes: its matrices name the projection.
    wrong = dict(peft_tensors(tiny_config, adapter, 4))
    wrong["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = np.zeros((2, 63), np.float32)
    write_peft_adapter(tmp_path / "shape", tiny_config, adapter, 4)
    safetensors.numpy.save_file(wrong, str(tmp_path / "shape" / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="does not fit tiny: adapter 'shape': layer 0's q"):
        load_adapter(tmp_path / "shape", tiny_config)
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    (tmp_path / "pickle" / "adapter_model.bin").write_bytes(b"\x80")
    with pytest.raises(CheckpointError, match="adapter_model.bin is a pickle"):
        load_adapter(tmp_path / "pickle", tiny_config)
    with pytest.raises(CheckpointError, match="not a PEFT folder"):
        load_adapter(tmp_path / "missing", tiny_config)
    import gguf

    model = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")  # a model's file, no adapter keys
    model.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), np.float32))
    model.write_header_to_file()
    model.write_kv_data_to_file()
    model.write_tensors_to_file()
    model.close()
    with pytest.raises(CheckpointError, match="a GGUF model, not a LoRA adapter"):
        load_adapter(tmp_path / "model.gguf", tiny_config)


def test_a_verify_step_scores_each_rows_drafts_with_its_adapters(tiny_config, tiny_params, adapters):
    """Speculative decoding's verify program: drafts that are each row's own continuation on
    its merged weights are all accepted, and the tokens it emits are that continuation."""
    from cadence.engine.config import fixed_page_tables
    from cadence.engine.packing import PrefillChunk

    cfg = tiny_config
    params = jax.tree.map(np.asarray, undo_embedding_boost(tiny_params))
    engine = Engine(params, cfg, EngineConfig(num_slots=4, max_seq_len=128, prefill_chunk=32,
                                              min_kv_bucket=64, attention="cpu", decode_matmul="cpu",
                                              speculative_tokens=3, lora_slots=3, lora_rank=4),
                    adapters=adapters)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (11, 20, 7)]
    rows = sampling_rows([RequestSampling(lora=r) for r in ROWS] + [RequestSampling()], 3)
    tables = fixed_page_tables(engine.config)
    first = np.asarray(engine.prefill([PrefillChunk(s, p, 0, True, tables[s]) for s, p in enumerate(prompts)],
                                      rows))
    want = [greedy_generate(lora.merged_params(params, cfg, [(adapters[i], s) for i, s in pairs]), cfg, p, 5)
            for p, pairs in zip(prompts, ROWS)]
    assert first.tolist() == [w[0] for w in want]
    drafts = np.zeros((4, 3), np.int32)
    for s, w in enumerate(want):
        drafts[s] = w[1:4]
    positions = np.asarray([len(p) for p in prompts] + [0], np.int32)
    active = np.asarray([True, True, True, False])
    result = engine.verify(positions, active, rows, tables, drafts, np.asarray([3, 3, 3, 0], np.int32))
    assert result.emitted()[:3].tolist() == [4, 4, 4]
    assert np.asarray(result)[:, :3].T.tolist() == [w[1:5] for w in want]


@pytest.mark.slow  # several CPU devices
@pytest.mark.parametrize("devices", [2, 4])  # 4: each KV head on two devices, the k/v b's heads repeated
def test_tensor_parallel_rows_on_adapters_equal_the_reference(devices, tiny_config, tiny_params, adapters):
    cfg = tiny_config
    params = jax.tree.map(np.asarray, undo_embedding_boost(tiny_params))
    engine = Engine(params, cfg, EngineConfig(num_slots=4, max_seq_len=128, prefill_chunk=32,
                                              min_kv_bucket=64, lora_slots=3, lora_rank=4),
                    devices=jax.devices()[:devices], adapters=adapters)
    assert engine.tp.kv_repeat == devices // 2
    rows_equal_the_merged_reference(engine, params, cfg, adapters, (30, 9, 14), seed=11, n=6)
