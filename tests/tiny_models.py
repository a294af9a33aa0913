"""Tiny model shapes beside `model.config.TINY`, the one-page forward the tests compare
against, and greedy decoding driven through an engine's own programs.

    logits = full_logits(params, config, tokens)   # [len(tokens), vocab], one program
    tokens = engine_greedy(engine, prompts, max_new, chunk_sizes)
    adapter = random_adapter(config, "sql", 4, lora.PROJECTIONS, seed=1)   # LoRA, and on disk:
    write_peft_adapter(folder, config, adapter, alpha=8)
"""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np

from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk
from cadence.engine.programs import sampling_rows
from cadence.model import llama, lora
from cadence.model.config import TINY, RopeScaling
from cadence.model.host_sampling import RequestSampling
from cadence.model.llama import rope_table
from cadence.model.paged_kv import PagedKVCache


# The decoder jitted, as the engine's programs run it. Op by op, every operation compiles again
# for each new shape, and the persistent cache keeps none of them (each is under its 0.1 s floor).
forward = jax.jit(llama.forward, static_argnames=("config", "attention"))


def full_logits(params, config, tokens: np.ndarray, rope_lookup: bool = False) -> np.ndarray:
    """The whole sequence in one forward over one page that holds it all; with `rope_lookup`,
    the rotations looked up in a `rope_table`, as the engine's programs do."""
    t = len(tokens)
    logits, _ = forward(
        params,
        jnp.asarray(tokens, jnp.int32)[None],
        jnp.arange(t, dtype=jnp.int32)[None],
        jnp.asarray([t], jnp.int32),
        PagedKVCache.create(config, 1, t),
        jnp.zeros((1, 1), jnp.int32),
        config=config,
        attention="reference",
        rope_table=rope_table(config, t + 5) if rope_lookup else None,
    )
    return np.asarray(logits[0])


# Qwen2-style: q/k/v biases and an untied lm_head; also one KV head and Llama-3 RoPE scaling.
QWEN_TINY = dataclasses.replace(
    TINY, name="qwen-tiny", attention_bias=True, tie_embeddings=False, num_kv_heads=1,
    rope_theta=1e6, rms_norm_eps=1e-6, rope_scaling=RopeScaling(factor=4.0))


# Qwen3-style: per-head q/k norms, no biases, and (as Qwen3-0.6B) heads wider than the residual
# stream over their count: 4 heads of 32 over a 64-wide stream. YaRN stretches its 128 original
# positions to TINY's 512, as Qwen3's own recipe stretches 32k to 128k: the ramp spans pairs 0-4
# of 16, so some pairs keep their frequency, some blend, most are divided.
QWEN3_TINY = dataclasses.replace(
    TINY, name="qwen3-tiny", qk_norm=True, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6,
    rope_scaling=RopeScaling(rope_type="yarn", factor=4.0, original_max_position=128))


# SmolLM3-style: Llama with every fourth layer unrotated (NoPE), as its GGUF architecture
# implies: 4 layers, the last without RoPE.
SMOLLM3_TINY = dataclasses.replace(TINY, name="smollm3-tiny", num_layers=4, no_rope_layers=(3,))

# Granite-style: Llama with its four scalars (Granite 3.3 2B's, but for the attention's, which is
# 1/128 there over heads of 64 and here over TINY's heads of 16).
GRANITE_TINY = dataclasses.replace(TINY, name="granite-tiny", embedding_multiplier=12.0,
                                   residual_multiplier=0.22, attention_multiplier=0.03125,
                                   logits_scaling=8.0)

# Gemma 3-style: sliding-window layers (a window of 5 positions, in 3 of 4 layers) rotated with a
# base of their own, the global layer's RoPE scaled linearly (as Gemma 3 4B's), GELU, norms
# after each branch, scaled embeddings and query/key norms, a query scale of its own (the 27B's
# kind) and soft-capped logits (which Gemma 3's config allows, and Gemma 2 has).
GEMMA3_TINY = dataclasses.replace(
    TINY, name="gemma3-tiny", num_layers=4, qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e6,
    rope_freq_factors=(8.0,) * 8, sliding_window=5,
    sliding_layers=(0, 1, 2), rope_local_theta=10000.0, hidden_act="gelu_tanh", post_norms=True,
    embedding_multiplier=8.0, attention_multiplier=0.125, final_logit_softcapping=30.0)


def undo_embedding_boost(params):
    """`random_params` scales the embedding up 8x so greedy choices are clear-cut; with tied
    embeddings that makes the tiny model copy its input token whatever attention returns (an
    attention that drops the last key gave the same greedy tokens), so this test scales it back."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x / 8.0 if "embedding" in jax.tree_util.keystr(path) else x, params
    )


def engine_greedy(engine, prompts, max_new, chunk_sizes, rows=None):
    """Prefills the prompts in chunks of the given sizes (so chunks start at odd offsets), one
    chunk of each prompt per packed program, then decodes every slot together; the last slot
    stays empty. Each slot's pages are scattered over the pool in a shuffled order. `rows`:
    the slots' sampling rows (default greedy, no adapters)."""
    order = np.random.default_rng(0).permutation(engine.config.pool_pages)
    tables = fixed_page_tables(engine.config, order)
    out = [[] for _ in prompts]
    slots = engine.config.num_slots
    if rows is None:
        rows = sampling_rows([RequestSampling()] * slots, engine.config.lora_slots)
    starts, i = [0] * len(prompts), 0
    while any(start < len(p) for start, p in zip(starts, prompts)):
        chunks = []  # one chunk of every prompt still prefilling, packed into one program
        for slot, prompt in enumerate(prompts):
            if starts[slot] < len(prompt):
                n = min(chunk_sizes[(i + slot) % len(chunk_sizes)], len(prompt) - starts[slot])
                chunks.append(PrefillChunk(slot, prompt[starts[slot]:starts[slot] + n], starts[slot],
                                           starts[slot] + n == len(prompt), tables[slot]))
                starts[slot] += n
        tokens = np.asarray(engine.prefill(chunks, rows))
        for c, token in zip(chunks, tokens):
            if c.final:
                out[c.slot].append(int(token))
        i += 1
    for _ in range(max(max_new) - 1):
        live = [s < len(prompts) and len(out[s]) < max_new[s] for s in range(slots)]
        positions = [len(prompts[s]) + len(out[s]) - 1 if live[s] else 0 for s in range(slots)]
        tokens = np.asarray(engine.decode(np.asarray(positions, np.int32), np.asarray(live), rows,
                                          tables))[0]
        for s in range(len(prompts)):
            if live[s]:
                out[s].append(int(tokens[s]))
    return out


def greedy_with_each(params, model, attentions, prompt_lengths, max_new, chunk_sizes, *,
                     seed: int, **config) -> dict:
    """`engine_greedy` over random prompts of the given lengths, with an engine of `config`
    per attention implementation: name -> each prompt's tokens (checked not to be a degenerate
    copy loop, which any attention would produce alike)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, model.vocab_size) for _ in range(n)] for n in prompt_lengths]
    results = {}
    for attention in attentions:
        engine = Engine(params, model, EngineConfig(attention=attention, **config))
        results[attention] = engine_greedy(engine, prompts, max_new, chunk_sizes)
        assert len({t for row in results[attention] for t in row}) > 5
    return results


def random_adapter(config, name, rank, projections, seed, spread=0.3) -> lora.LoraAdapter:
    """A LoRA adapter of random matrices for `projections` of every layer, large enough to
    change the tiny model's greedy tokens."""
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(config.num_layers):
        for proj in projections:
            n_in, n_out = lora.projection_shape(config, proj)
            weights[(layer, proj)] = (rng.normal(0, spread, (n_in, rank)).astype(np.float32),
                                      rng.normal(0, spread, (rank, n_out)).astype(np.float32))
    return lora.LoraAdapter(name, rank, weights)


def peft_tensors(config, adapter: lora.LoraAdapter, alpha: float) -> dict[str, np.ndarray]:
    """`adapter` as PEFT names its tensors (lora_A [r, in], lora_B [out, r] without the alpha /
    r that `LoraAdapter` folds into b)."""
    from cadence.model.params import param_specs

    names = {(int(s.path[0].removeprefix("layers_")), s.path[2]): s.hf_name.removesuffix(".weight")
             for s in param_specs(config) if len(s.path) == 4 and s.path[3] == "kernel"}
    out = {}
    for key, (a, b) in adapter.weights.items():
        module = f"base_model.model.{names[key]}"
        out[f"{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
        out[f"{module}.lora_B.weight"] = np.ascontiguousarray(b.T / (alpha / a.shape[1]))
    return out


def write_peft_adapter(folder, config, adapter: lora.LoraAdapter, alpha: float, **settings) -> None:
    """`adapter` as a PEFT folder: adapter_config.json (`settings` over the defaults) and
    adapter_model.safetensors."""
    import json
    from pathlib import Path

    import safetensors.numpy

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({f"{p}_proj" for p in adapter.projections})
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": adapter.rank, "lora_alpha": alpha, "target_modules": targets,
         "bias": "none", "use_dora": False, "use_rslora": False, "modules_to_save": None,
         **settings}))
    safetensors.numpy.save_file(peft_tensors(config, adapter, alpha),
                                str(folder / "adapter_model.safetensors"))
