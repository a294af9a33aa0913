"""Hugging Face safetensors loading and the converted-checkpoint store, on tiny random models."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from cadence.checkpoints.errors import CheckpointError
from cadence.checkpoints.hf import load_hf_config, load_hf_params, save_hf
from tests.conftest import random_params
from tests.fakes import needs_cpu_kernels
from tests.tiny_models import GEMMA3_TINY, GRANITE_TINY, QWEN3_TINY, QWEN_TINY, SMOLLM3_TINY
from cadence.checkpoints.store import (
    is_converted, load_converted, load_tokenizer_files, save_converted,
)
from cadence.bench.random_gguf import SHAPES
from cadence.model.config import LLAMA3_8B, SMOLLM2_135M, TINY, ModelConfig, RopeScaling


@pytest.fixture(params=[TINY, QWEN_TINY, QWEN3_TINY, SMOLLM3_TINY, GRANITE_TINY], ids=lambda c: c.name)
def model(request):
    return request.param, random_params(request.param)


def assert_trees_equal(a, b):
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b):
        assert np.asarray(y).dtype == np.float32, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def test_hf_round_trip(tmp_path, model):
    config, params = model
    save_hf(tmp_path, config, params)
    loaded_config = load_hf_config(tmp_path)
    assert loaded_config == config
    assert_trees_equal(params, load_hf_params(tmp_path, loaded_config))


def test_hf_bf16_and_sharded(tmp_path, model):
    config, params = model
    save_hf(tmp_path, config, params, dtype="bfloat16", max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    loaded = load_hf_params(tmp_path, load_hf_config(tmp_path))
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    assert_trees_equal(rounded, loaded)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_checkpoint_is_converted_in_16_bits(tmp_path, model, dtype, tiny_tokenizer):
    """An F16 / BF16 checkpoint's conversion stores its tensors as they are, restores them as
    float32 by default, exactly their values widened, and in 16 bits straight where asked (a
    GPU's dtype: half the host memory of a float32 restore)."""
    import orbax.checkpoint as ocp

    from cadence.checkpoints import registry

    config, params = model
    save_hf(tmp_path / "hf", config, params, dtype=dtype)
    tiny_tokenizer.save(tmp_path / "hf")
    folder = registry.resolve(str(tmp_path / "hf"), tmp_path / "cache")
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(folder / "params").item_metadata.tree
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(stored)} == {dtype}
    rounded = jax.tree.map(lambda x: x.astype(dtype).astype(np.float32), params)
    assert_trees_equal(rounded, load_converted(folder)[1])
    narrow = load_converted(folder, dtype=dtype)[1]
    for a, b in zip(jax.tree.leaves(narrow), jax.tree.leaves(rounded)):
        assert a.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(a, np.float32), b)


@needs_cpu_kernels
@pytest.mark.parametrize("config", [pytest.param(TINY, marks=pytest.mark.slow), QWEN_TINY,
                                    pytest.param(QWEN3_TINY, marks=pytest.mark.slow)],
                         ids=["tied", "untied", "qwen3"])
def test_the_cpu_kernels_read_a_bf16_checkpoint_as_stored(tmp_path, tiny_tokenizer, config):
    """Restored as stored (as `cadence-serve` on the CPU kernels does), a BF16 checkpoint's
    matrices reach the kernels in bfloat16, half float32's bytes, an untied embedding table
    stays bfloat16 too (a lookup widens the rows it takes), and the engine gives the
    reference's greedy tokens over the same weights widened to float32."""
    from cadence.checkpoints import registry
    from cadence.checkpoints.store import AS_STORED
    from cadence.engine.config import EngineConfig
    from cadence.engine.engine import Engine
    from cadence.engine.reference import greedy_generate
    from cadence.model import cpu_kernels
    from cadence.scheduler.request import GenerationParams
    from tests.fakes import make_scheduler, run_all

    save_hf(tmp_path / "hf", config, random_params(config, seed=3), dtype="bfloat16")
    tiny_tokenizer.save(tmp_path / "hf")
    model = registry.load_model(str(tmp_path / "hf"), tmp_path / "cache", dtype=AS_STORED)
    widened = registry.load_model(str(tmp_path / "hf"), tmp_path / "cache").params
    engine = Engine(model.params, config, EngineConfig(num_slots=2, max_seq_len=128, prefill_chunk=64,
                                                       attention="cpu", decode_matmul="cpu"))
    bf16 = np.dtype(ml_dtypes.bfloat16)
    formats = cpu_kernels.matrix_formats(engine.params)
    assert len(formats) >= 4 * config.num_layers and set(formats) == {"bfloat16"}
    table = engine.params["embed"].get("embedding")  # tied: the head's blocks hold it
    assert (table is None) == config.tie_embeddings and (table is None or table.dtype == bf16)
    prompts = [list(range(5, 90)), [7, 300, 41, 9]]  # prefill over the GEMM, then the kernel
    streams = run_all(make_scheduler(engine, tiny_tokenizer, chunk=64, budget=66),
                      [(p, GenerationParams(max_tokens=12)) for p in prompts])
    for prompt, stream in zip(prompts, streams):
        assert stream.request.output_ids == greedy_generate(widened, config, prompt, 12, tiny_tokenizer.eos_ids)
    assert cpu_kernels.blocked_bytes(engine.params) * 2 == cpu_kernels.blocked_bytes(
        cpu_kernels.decode_params(widened))


def test_untied_config_without_lm_head_loads_tied(tmp_path):
    save_hf(tmp_path, TINY, random_params(TINY))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(tie_word_embeddings=False, model_type="mistral", architectures=None,
               sliding_window=None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(tmp_path).tie_embeddings


def _rewrite_tensors(folder, edit):
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    edit(tensors)
    safetensors.numpy.save_file(tensors, folder / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    save_hf(tmp_path, QWEN_TINY, random_params(QWEN_TINY))
    _rewrite_tensors(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError,
                       match=r"missing \[model\.layers\.1\.self_attn\.k_proj\.bias\]"):
        load_hf_params(tmp_path, QWEN_TINY)


def test_a_truncated_file_is_a_clear_error(tmp_path):
    save_hf(tmp_path, TINY, random_params(TINY))
    file = tmp_path / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a whole safetensors file .*download it again"):
        load_hf_params(tmp_path, TINY)


def test_unexpected_tensor_is_named(tmp_path):
    save_hf(tmp_path, TINY, random_params(TINY))
    _rewrite_tensors(tmp_path, lambda t: t.update(extra=np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected \[extra\]"):
        load_hf_params(tmp_path, TINY)


def test_wrong_shape_is_named(tmp_path):
    save_hf(tmp_path, TINY, random_params(TINY))
    _rewrite_tensors(tmp_path, lambda t: t.update(
        {"model.layers.0.mlp.up_proj.weight": np.zeros((64, 64), np.float32)}))
    with pytest.raises(CheckpointError,
                       match=r"model\.layers\.0\.mlp\.up_proj\.weight F32\[64, 64\]"):
        load_hf_params(tmp_path, TINY)


@pytest.mark.parametrize("edit, match", [
    ({"model_type": "gpt2"},
     "model_type 'gpt2' is not supported; cadence loads gemma3_text, granite, llama, mistral"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 128},
     "sliding_window 128"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, "truncate false"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -4.0}}, "factor must be finite and positive"),
    ({"rope_scaling": {"rope_type": "linear"}}, "linear RoPE scaling without a factor"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": True},
     "attention_bias/mlp_bias on a qwen3 model"),
    ({"model_type": "qwen3_moe"}, "model_type 'qwen3_moe' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1]},
     "a 0 or 1 for each of the 2 layers"),
    ({"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 128}, "sliding_window 128"),
])
def test_unsupported_config_is_refused(tmp_path, edit, match):
    save_hf(tmp_path, TINY, random_params(TINY))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=match):
        load_hf_config(tmp_path)


def test_smollm3_rotates_all_but_every_fourth_layer_unless_told_which(tmp_path):
    """SmolLM3's config.json: `no_rope_layers` flags each layer (1: rotated); without it,
    every `no_rope_layer_interval`-th layer (4 by default) is unrotated, as transformers reads it."""
    config = dataclasses.replace(SMOLLM3_TINY, num_layers=8, no_rope_layers=())
    save_hf(tmp_path, config, random_params(config))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(model_type="smollm3", architectures=["SmolLM3ForCausalLM"])
    for extra, unrotated in [({}, (3, 7)), ({"no_rope_layer_interval": 3}, (2, 5)),
                             ({"no_rope_layers": [1, 0, 1, 1, 1, 1, 1, 0]}, (1, 7))]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, **extra}))
        assert load_hf_config(tmp_path).no_rope_layers == unrotated
    with pytest.raises(ValueError, match="must be layers of the model's 4"):
        dataclasses.replace(SMOLLM3_TINY, no_rope_layers=(4,))


def test_gemma3_round_trips_with_its_norms_stored_less_one(tmp_path):
    """Gemma3ForCausalLM's config.json and safetensors: its norms hold their scale less 1 (as
    transformers' Gemma3RMSNorm multiplies by 1 + weight), its sliding layers come from
    `layer_types`, or without it from `sliding_window_pattern` (6 by default), and its query
    scale from query_pre_attn_scalar."""
    import safetensors.numpy

    params = random_params(GEMMA3_TINY)
    save_hf(tmp_path, GEMMA3_TINY, params)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "gemma3_text" and raw["query_pre_attn_scalar"] == 64.0
    assert raw["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    stored = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(stored["model.layers.1.pre_feedforward_layernorm.weight"],
                                  params["layers_1"]["mlp_norm"]["scale"] - 1)
    np.testing.assert_array_equal(stored["model.layers.1.post_attention_layernorm.weight"],
                                  params["layers_1"]["attn_post_norm"]["scale"] - 1)
    assert load_hf_config(tmp_path) == GEMMA3_TINY
    assert_trees_equal(params, load_hf_params(tmp_path, GEMMA3_TINY))
    del raw["layer_types"]
    for extra, sliding in [({}, (0, 1, 2, 3)), ({"sliding_window_pattern": 2}, (0, 2))]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, **extra}))
        assert load_hf_config(tmp_path).sliding_layers == sliding
    for edit, match in [({"attn_logit_softcapping": 50.0}, "soft-capping"),
                        ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
                        ({"layer_types": ["sliding_attention"]}, "each of the 4 layers")]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, **edit}))
        with pytest.raises(CheckpointError, match=match):
            load_hf_config(tmp_path)


def test_mistral_long_window_is_accepted(tmp_path):
    save_hf(tmp_path, TINY, random_params(TINY))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=512)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(tmp_path) == TINY


def test_rope_freq_factors_are_checked_kept_in_json_and_not_exported(tmp_path):
    """Per-frequency RoPE factors (a GGUF's rope_freqs): a list (as JSON gives it) becomes a
    hashable tuple, the count must match head_dim, and HF's config.json has no form for them."""
    config = dataclasses.replace(TINY, rope_freq_factors=[1.0] * 7 + [8.0])
    assert config.rope_freq_factors == (1.0,) * 7 + (8.0,)
    back = ModelConfig.from_json(config.to_json())
    assert back == config and hash(back) == hash(config)
    with pytest.raises(ValueError, match="has 7 factors; head_dim 16 rotates 8 pairs"):
        dataclasses.replace(TINY, rope_freq_factors=(1.0,) * 7)
    with pytest.raises(ValueError, match="finite and positive"):
        dataclasses.replace(TINY, rope_freq_factors=(1.0,) * 7 + (-2.0,))
    with pytest.raises(CheckpointError, match="no Hugging Face config.json form"):
        save_hf(tmp_path, config, random_params(TINY))
    assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.parametrize("rope, want, context", [
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
     RopeScaling(rope_type="yarn", factor=4.0, original_max_position=1024), 4096),
    ({"rope_type": "yarn", "original_max_position_embeddings": 256},  # no factor: 1024 / 256
     RopeScaling(rope_type="yarn", factor=4.0, original_max_position=256), 1024),
    ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 16,
      "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek's pair: a factor of 1
     RopeScaling(rope_type="yarn", factor=40.0, original_max_position=64, beta_fast=16.0,
                 beta_slow=2.0, attention_factor=1.0), 2560),
    ({"rope_type": "linear", "factor": 2.0}, None, 1024),
], ids=["qwen-recipe", "factor-from-positions", "mscale-pair", "linear"])
def test_rope_scaling_is_read_as_transformers_computes_it_and_exported(tmp_path, rope, want, context):
    """config.json's YaRN and linear scaling: YaRN's factor defaults to max_position_embeddings
    over the original, its attention factor to DeepSeek's mscale ratio where both are given;
    the context stretches to original x factor (as vLLM serves it); linear becomes per-frequency
    factors. Exported and read again, the same config."""
    save_hf(tmp_path / "a", TINY, random_params(TINY))
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    raw.update(rope_scaling=rope, max_position_embeddings=1024)
    (tmp_path / "a" / "config.json").write_text(json.dumps(raw))
    config = load_hf_config(tmp_path / "a")
    assert config.rope_scaling == want and config.max_context == context
    assert config.rope_freq_factors == (None if want else (2.0,) * 8)
    save_hf(tmp_path / "b", config, random_params(config))
    assert load_hf_config(tmp_path / "b") == config
    assert ModelConfig.from_json(config.to_json()) == config


def test_converted_round_trip(tmp_path, model):
    config, params = model
    tokenizer = {"tokenizer.json": b'{"model": "\xc3\xa9"}', "tokenizer.model": bytes(range(256))}
    folder = tmp_path / "converted"
    save_converted(folder, config, params, tokenizer, source="hf:test/tiny")
    assert is_converted(folder)
    assert not list(tmp_path.glob(".converted.*"))  # no temporary folder left behind
    loaded_config, loaded = load_converted(folder)
    assert loaded_config == config
    assert_trees_equal(params, loaded)
    assert load_tokenizer_files(folder) == tokenizer
    assert json.loads((folder / "cadence.json").read_text())["source"] == "hf:test/tiny"

    save_converted(folder, config, random_params(config, seed=1))  # replaces the old one
    assert_trees_equal(random_params(config, seed=1), load_converted(folder)[1])
    assert load_tokenizer_files(folder) == {}


def test_incomplete_or_foreign_folder_is_refused(tmp_path):
    folder = tmp_path / "converted"
    save_converted(folder, TINY, random_params(TINY))
    marker = json.loads((folder / "cadence.json").read_text())

    (folder / "cadence.json").write_text(json.dumps({**marker, "format_version": 99}))
    assert not is_converted(folder)
    with pytest.raises(CheckpointError, match="format 99"):
        load_converted(folder)

    (folder / "cadence.json").unlink()
    assert not is_converted(folder)
    with pytest.raises(CheckpointError, match="no cadence.json"):
        load_converted(folder)
    assert not is_converted(tmp_path / "absent")


def test_converted_params_must_match_config(tmp_path):
    folder = tmp_path / "converted"
    save_converted(folder, TINY, random_params(TINY))
    (folder / "config.json").write_text(dataclasses.replace(TINY, ffn_size=96).to_json())
    with pytest.raises(CheckpointError, match=r"layers_0/mlp/up/kernel float32\[64, 128\]"):
        load_converted(folder)
    with pytest.raises(CheckpointError,
                       match=r"missing \[layers_0/attn/k/bias, layers_0/attn/q/bias"):
        save_converted(tmp_path / "other", QWEN_TINY, random_params(TINY))


SMOLLM2_JSON = {  # the fields of HuggingFaceTB/SmolLM2-135M's config.json that matter
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
    "max_position_embeddings": 8192, "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 49152}
LLAMA31_8B_JSON = {  # Llama-3.1-8B's: Llama-3 RoPE scaling, no head_dim, untied
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256}

QWEN3_06B_JSON = {  # Qwen3-0.6B's: q/k norms, head_dim 128 over a 1024-wide stream, no window
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("raw, want", [
    (SMOLLM2_JSON, SMOLLM2_135M),
    (LLAMA31_8B_JSON, dataclasses.replace(LLAMA3_8B, max_context=131072)),
    (QWEN3_06B_JSON, dataclasses.replace(SHAPES["qwen3-0.6b"][1], name="qwen3-0.6b")),
], ids=["smollm2", "llama3.1", "qwen3-0.6b"])
def test_real_configs(tmp_path, raw, want):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(tmp_path, name=want.name) == want


@pytest.mark.parametrize("config", [TINY, QWEN_TINY, QWEN3_TINY], ids=lambda c: c.name)
def test_params_tree_is_the_models(config):
    """The one description (`model.params`) is the tree the Flax modules build."""
    from cadence.model import llama, params

    def flat(tree):
        return {jax.tree_util.keystr(path): (leaf.shape, np.dtype(leaf.dtype))
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    assert flat(params.abstract_params(config)) == flat(llama.module_tree(config))
    assert flat(params.random_params(config, jax.random.key(0))) == flat(llama.module_tree(config))
