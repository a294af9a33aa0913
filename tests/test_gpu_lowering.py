"""Every program of the GPU engine lowered for CUDA on the CPU, from shapes alone.

`engine.lowering.engine_programs` lists what an engine's warm-up compiles, over abstract
weights and pools; the first test holds that list to what `Engine.warmup` really runs (program,
order, argument shapes and dtypes), the others lower every program of the GPU configuration
(bfloat16, the Pallas kernels over the paged pool, every decode and prefill bucket, scoring,
structured output's split step, speculative decoding's verify step, page copy, history,
extract and insert) for `cuda`, with each kernel backend (Triton, Mosaic GPU), and check
that each calls the kernel it should, so the kernels were lowered, not the XLA loops
interpret mode emulates them with, and that every Triton module passes MLIR verification.
What this leaves to a GPU machine: Triton's compiler, ptxas and running the programs
(`bench/gpu_check.sh`).
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest

from cadence.engine import engine as engine_module
from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.engine.lowering import KERNELS, engine_programs, gpu_engine_config, lower_checked
from cadence.model.config import LLAMA3_8B, SMOLLM2_135M


def _signature(args):
    leaves, tree = jax.tree.flatten(args)
    return tree, [(tuple(a.shape), str(jnp.result_type(a))) for a in leaves]


@pytest.mark.parametrize("lora_slots", [0, 2], ids=["plain", "lora-bank"])
def test_engine_programs_are_what_warmup_compiles(tiny_config, tiny_params, monkeypatch, lora_slots):
    """The list is warm-up's own: every program it calls, in its order, with the same argument
    trees, shapes and dtypes (an "xla" engine, which has both decode programs; and one with a
    LoRA bank of free slots, every projection's, in its params and rows)."""
    calls = []
    real = engine_module.jit_programs

    def recording(*args, **kwargs):
        programs = real(*args, **kwargs)

        def wrap(field, fn):
            def lower(*a):  # warm-up lowers and compiles ahead of time: recorded, not compiled
                calls.append((field, _signature(a)))
                return types.SimpleNamespace(compile=lambda: None)

            return types.SimpleNamespace(lower=lower)

        return dataclasses.replace(programs, **{f.name: wrap(f.name, getattr(programs, f.name))
                                                for f in dataclasses.fields(programs)})

    monkeypatch.setattr(engine_module, "jit_programs", recording)
    config = EngineConfig(num_slots=3, max_seq_len=128, prefill_chunk=32, min_kv_bucket=32,
                          page_size=16, structured_output=True, speculative_tokens=3,
                          lora_slots=lora_slots, lora_rank=4 if lora_slots else 0)
    Engine(tiny_params, tiny_config, config).warmup()
    listed = [(p.field, _signature(p.args)) for p in engine_programs(tiny_config, config)]
    assert [f for f, _ in listed] == [f for f, _ in calls]
    for (field, want), (_, got) in zip(listed, calls):
        assert want == got, field
    assert {"decode", "decode_batched", "decode_forward", "decode_forward_batched",
            "decode_sample", "prefill_scored", "prefill_pooled", "verify"} <= {f for f, _ in calls}


def _lower_all(model_config, config, verified):
    """Lowers every program (each checked for exactly its kernels' calls); with Triton
    kernels, every Triton module built verifies (one per kernel call site at least)."""
    programs = engine_programs(model_config, config)
    for program in programs:
        lower_checked(program, "cuda")
    kernels = sum(p.field in KERNELS[config.attention] for p in programs)
    assert kernels  # programs that attend, each of which called its kernel
    if config.attention == "pallas":
        assert all(verified) and len(verified) >= kernels
    return programs


@pytest.mark.parametrize("layers, attention", [
    (2, "pallas"), pytest.param(2, "mosaic", marks=pytest.mark.slow),
    pytest.param(SMOLLM2_135M.num_layers, "pallas", marks=pytest.mark.slow),
    pytest.param(SMOLLM2_135M.num_layers, "mosaic", marks=pytest.mark.slow)],
    ids=["2-layers-pallas", "2-layers-mosaic", "30-layers-pallas", "30-layers-mosaic"])
def test_smollm2_gpu_engine_lowers_for_cuda(triton_verifications, layers, attention):
    """SmolLM2-135M's GPU engine (8 slots, 4k context): 44 programs, with either kernel
    backend (Triton; Mosaic GPU). The model's layers are unrolled, so each adds its kernel calls
    to every program: the default tier lowers the same shapes, buckets and kernels with 2 of
    the 30 layers and the default (Triton) kernels (~10 s on 2 CPU cores); the full tier the
    Mosaic GPU kernels too, and the whole model (~30 s). The other shapes and pools below are
    the full tier's."""
    config = gpu_engine_config(num_slots=8, attention=attention)
    model = dataclasses.replace(SMOLLM2_135M, num_layers=layers)
    programs = _lower_all(model, config, triton_verifications)
    assert len(programs) == 44
    names = {p.name for p in programs}
    assert {f"decode[batch={b},pages=64]" for b in config.decode_batch_buckets} <= names


@pytest.mark.slow
def test_a_lora_bank_lowers_for_cuda(triton_verifications):
    """SmolLM2's GPU engine (2 layers) with a bank of 4 LoRA slots of rank 16: every program,
    each projection's correction beside its matmul, lowers for CUDA."""
    config = gpu_engine_config(num_slots=8, lora_slots=4, lora_rank=16)
    model = dataclasses.replace(SMOLLM2_135M, num_layers=2)
    assert len(_lower_all(model, config, triton_verifications)) == 44


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_an_8_bit_pool_lowers_for_cuda_with_the_triton_kernels(triton_verifications, kv_dtype):
    """--kv_cache_dtype=fp8 on a GPU: every program of SmolLM2's engine (2 layers) over an 8-bit
    float pool lowers for CUDA, each Triton kernel widening its tiles to bfloat16."""
    config = gpu_engine_config(num_slots=8, kv_dtype=kv_dtype)
    model = dataclasses.replace(SMOLLM2_135M, num_layers=2)
    assert len(_lower_all(model, config, triton_verifications)) == 44


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["pallas", "mosaic"])
def test_llama3_8b_gpu_engine_lowers_for_cuda(triton_verifications, attention):
    """Llama-3-8B's GPU engine at 64 slots (every batch bucket 1..64): nothing allocated."""
    config = gpu_engine_config(attention=attention)
    programs = _lower_all(LLAMA3_8B, config, triton_verifications)
    assert len(programs) == (2 * len(config.prefill_buckets) + len(config.score_buckets)
                             + 3 * len(config.decode_batch_buckets) + len(config.verify_batch_buckets)
                             + 2 * len(config.page_buckets) + 3)  # (+ history, sampler, copy)


def test_gpu_check_records_a_part_that_times_out_and_runs_the_next(tmp_path, monkeypatch):
    """bench.gpu_check's driver: a part past its timeout is recorded as such in summary.json,
    and the parts after it still run."""
    import json

    from cadence.bench import gpu_check

    monkeypatch.setattr(gpu_check, "PARTS", {"env": 0.01, "kernels": 0.01})
    summary = gpu_check.drive(tmp_path, ["env", "kernels"])
    assert list(summary["parts"]) == ["env", "kernels"]
    assert all(p["exit"] == "timeout" and not p["ok"] for p in summary["parts"].values())
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["pallas", "mosaic"])
def test_qwen3_gpu_engine_lowers_for_cuda(triton_verifications, attention):
    """Qwen3-0.6B's shape (q/k norms; 16 query heads and 8 KV heads of 128 over a 1024-wide
    stream), 2 of its 28 layers: every program of the GPU engine lowers for CUDA, its kernels
    at head_dim 128 and a group of 2."""
    from cadence.bench.random_gguf import SHAPES

    config = gpu_engine_config(num_slots=8, attention=attention)
    model = dataclasses.replace(SHAPES["qwen3-0.6b"][1], num_layers=2)
    assert len(_lower_all(model, config, triton_verifications)) == 44


@pytest.mark.slow
def test_gemma3_gpu_engine_lowers_for_cuda(triton_verifications):
    """Gemma 3 270M's shape (4 query heads of 256 and one KV head over a 640-wide stream, a
    262k vocabulary), 6 of its 18 layers (five sliding over 512 positions, one global, as its
    pattern has them): every program of the GPU engine lowers for CUDA, the Triton kernels
    taking each layer's window."""
    from cadence.model.config import ModelConfig

    model = ModelConfig(name="gemma3-270m-6", vocab_size=262144, hidden_size=640, num_layers=6,
                        num_heads=4, num_kv_heads=1, head_dim=256, ffn_size=2048, rms_norm_eps=1e-6,
                        rope_theta=1e6, tie_embeddings=True, qk_norm=True, sliding_window=512,
                        sliding_layers=(0, 1, 2, 3, 4), rope_local_theta=1e4, hidden_act="gelu_tanh",
                        post_norms=True, embedding_multiplier=640 ** 0.5, max_context=32768)
    config = gpu_engine_config(num_slots=8)
    assert len(_lower_all(model, config, triton_verifications)) == 44
