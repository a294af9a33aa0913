"""Disaggregated serving with the real engines, on two of the test session's four CPU devices.

The prefill engine runs on device 1 and the decode engine on device 2, each with its own
weights and KV pool; every request's KV moves between them through `extract`, `jax.device_put`
and `insert`. The outputs must equal colocated serving's and the reference generator's token for
token, and warm engines must compile nothing while serving.
"""

from __future__ import annotations

import json

import httpx
import jax
import numpy as np
import pytest

from cadence.engine import compile_counter
from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.engine.reference import greedy_generate
from cadence.model.arith import cdiv
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from cadence.server.app import create_app
from tests.conftest import loopback_server
from tests.serving import assert_batch_is_the_reference, batch_job, cli, generate_gives_the_reference_text

pytestmark = pytest.mark.slow  # the full tier: disaggregated engines on two devices

CONFIG = EngineConfig(num_slots=3, max_seq_len=128, prefill_chunk=32, page_size=16, min_kv_bucket=64)
POLICY = SchedulerConfig(policy=PolicyConfig(token_budget=64, chunk=32))


def engines(params, config):
    """The prefill engine on device 1 and the decode engine on device 2, warmed up, and a
    colocated one on device 0 to compare with (not warmed: it compiles what it runs)."""
    devices = jax.devices()
    pair = [Engine(params, config, dataclasses_replace(CONFIG, role="prefill"), device=devices[1]),
            Engine(params, config, dataclasses_replace(CONFIG, role="decode"), device=devices[2])]
    for engine in pair:
        engine.warmup()
    return [*pair, Engine(params, config, CONFIG, device=devices[0])]


def dataclasses_replace(config: EngineConfig, **changes) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


def run(sched: Scheduler, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sched.start()
    streams = [sched.submit(p, GenerationParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    outputs = [[t for e in s for t in getattr(e, "token_ids", [])] for s in streams]
    sched.stop(drain=True, timeout=30)
    return outputs


@pytest.fixture(scope="module")
def pair(tiny_params, tiny_config):
    return engines(tiny_params, tiny_config)


def test_disaggregated_equals_colocated_and_the_reference(pair, tiny_params, tiny_config, tiny_tokenizer):
    """Prompts ending exactly on a page boundary (16, 32, 48 tokens), beside one and mid-page,
    five of them over three decode slots (so some wait in the backlog): the same greedy tokens
    disaggregated, colocated and from the reference, and no compile in either pool."""
    prefill, decode, colocated = pair
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, tiny_config.vocab_size, n)] for n in (16, 32, 48, 17, 5)]
    disaggregated = Scheduler(prefill, tiny_tokenizer, POLICY, decode_engine=decode)
    before = compile_counter.count()  # the process's: other tests compile their own programs
    got = run(disaggregated, prompts, 12)
    assert compile_counter.count() == before
    want = run(Scheduler(colocated, tiny_tokenizer, POLICY), prompts, 12)
    for prompt, a, b in zip(prompts, got, want):
        assert a == b == greedy_generate(tiny_params, tiny_config, prompt, 12, frozenset())
    assert disaggregated.kv_transfers == len(prompts)
    # Live pages only: 2 (K, V) x layers x kv_heads x head_dim x 4 bytes per token, whole pages.
    per_page = 2 * tiny_config.num_layers * tiny_config.num_kv_heads * tiny_config.head_dim * 4 * 16
    assert disaggregated.kv_transfer_bytes == per_page * sum(cdiv(n, 16) for n in (16, 32, 48, 17, 5))
    assert disaggregated.kv_pages == (0, prefill.num_pages + decode.num_pages)


def test_a_request_on_mirostat_keeps_its_bound_across_the_handoff(pair, tiny_tokenizer):
    """The prefill engine draws a Mirostat request's first token and moves its bound; the
    decode engine goes on from that bound (read out with the KV, written into its history):
    the same tokens as colocated, beside greedy and penalized requests."""
    import dataclasses

    from cadence.model.host_sampling import RequestSampling

    prefill, decode, colocated = pair
    rng = np.random.default_rng(2)
    # (the tiny model's logits are sharp: at temperature 10 they hold ~8 bits)
    rows = [RequestSampling(temperature=10.0, seed=s, temperature_last=True, mirostat=m, mirostat_tau=5.0,
                            mirostat_eta=1.0)  # (eta 1: the first token moves the bound far)
            for s, m in ((1, 2), (2, 1), (3, 2))] + [RequestSampling(), RequestSampling(repetition_penalty=1.4)]
    subs = [([int(t) for t in rng.integers(3, 500, n)], GenerationParams(max_tokens=20, ignore_eos=True, sampling=r))
            for n, r in zip((16, 40, 7, 33, 20), rows)]

    def served(sched):
        sched.start()
        streams = [sched.submit(p, params) for p, params in subs]
        outputs = [[t for e in s for t in getattr(e, "token_ids", [])] for s in streams]
        sched.stop(drain=True, timeout=30)
        return outputs

    got = served(Scheduler(prefill, tiny_tokenizer, POLICY, decode_engine=decode))
    assert got == served(Scheduler(colocated, tiny_tokenizer, POLICY))
    plain = [dataclasses.replace(r, mirostat=0) for r in rows[:3]]
    subs[:3] = [(p, GenerationParams(max_tokens=20, ignore_eos=True, sampling=r)) for (p, _), r in zip(subs, plain)]
    assert served(Scheduler(colocated, tiny_tokenizer, POLICY))[:3] != got[:3]  # (Mirostat cut)


def test_an_8_bit_pool_is_handed_over_as_it_is(tiny_params, tiny_config, tiny_tokenizer):
    """--kv_cache_dtype=fp8 disaggregated: the pages handed over are 8-bit (a quarter of a
    float32 pool's bytes), and the tokens are the reference generator's over an 8-bit cache."""
    devices = jax.devices()
    config = dataclasses_replace(CONFIG, kv_dtype="float8_e4m3fn")
    prefill = Engine(tiny_params, tiny_config, dataclasses_replace(config, role="prefill"), device=devices[1])
    decode = Engine(tiny_params, tiny_config, dataclasses_replace(config, role="decode"), device=devices[2])
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, tiny_config.vocab_size, n)] for n in (16, 40, 7)]
    sched = Scheduler(prefill, tiny_tokenizer, POLICY, decode_engine=decode)
    got = run(sched, prompts, 12)
    for prompt, tokens in zip(prompts, got):
        assert tokens == greedy_generate(tiny_params, tiny_config, prompt, 12, frozenset(),
                                         kv_dtype="float8_e4m3fn")
    per_page = 2 * tiny_config.num_layers * tiny_config.num_kv_heads * tiny_config.head_dim * 16
    assert sched.kv_transfer_bytes == per_page * sum(cdiv(n, 16) for n in (16, 40, 7))


def test_embeddings_stay_on_the_prefill_pool(pair, tiny_params, tiny_config, tiny_tokenizer):
    """Embeddings beside generations, disaggregated: each is prefilled and pooled on the
    prefill engine and never handed off; the vectors are the reference's, the answers too."""
    from cadence.engine.reference import sequence_logits

    prefill, decode, _ = pair
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, tiny_config.vocab_size, n)] for n in (40, 70, 9, 33)]
    sched = Scheduler(prefill, tiny_tokenizer, POLICY, decode_engine=decode)
    sched.start()
    streams = [sched.submit(p, GenerationParams(pooling="mean") if i % 2 else
                            GenerationParams(max_tokens=6, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in streams:
        list(s)
    sched.stop(drain=True, timeout=30)
    assert sched.kv_transfers == 2
    for i, (prompt, s) in enumerate(zip(prompts, streams)):
        if i % 2:
            hidden = sequence_logits(tiny_params, tiny_config, prompt, hidden=True)
            np.testing.assert_allclose(s.record.embedding, hidden.mean(0), rtol=1e-4, atol=1e-5)
            assert s.record.transfer_start is None
        else:
            assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 6, frozenset())


def test_each_engine_of_a_pair_runs_its_own_phase_only(pair):
    prefill, decode, _ = pair
    with pytest.raises(ValueError, match="runs prefill only"):
        prefill.decode(np.zeros(3, np.int32), np.ones(3, bool), None, np.zeros((3, 8), np.int32))
    with pytest.raises(ValueError, match="runs decode only"):
        decode.prefill([], None)


def test_the_server_streams_disaggregated_and_reports_the_transfers(pair, tiny_tokenizer, tiny_params, tiny_config):
    prefill, decode, _ = pair
    sched = Scheduler(prefill, tiny_tokenizer, POLICY, decode_engine=decode)
    app = create_app(sched, tiny_tokenizer, "tiny")
    prompt = "a prompt long enough to need two chunks of prefill " * 2
    before = compile_counter.count()
    with loopback_server(app) as base:
        r = httpx.post(f"{base}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True}, timeout=60)
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                       if line.startswith("data: {"))
        metrics = httpx.get(f"{base}/metrics").text
        timeline = httpx.get(f"{base}/debug/timeline").json()
    assert compile_counter.count() == before
    ids = greedy_generate(tiny_params, tiny_config, tiny_tokenizer.encode(prompt), 10, frozenset())
    assert text == tiny_tokenizer.decode(ids)
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("cadence:")}
    assert values['cadence:kv_transfer_seconds_count{model_name="tiny"}'] == 1
    assert values['cadence:kv_transfer_bytes_total{model_name="tiny"}'] > 0
    for pool in ("prefill", "decode"):
        assert values[f'cadence:pool_busy_seconds_total{{model_name="tiny",pool="{pool}"}}'] > 0
        assert f'cadence:pool_queue_length{{model_name="tiny",pool="{pool}"}}' in values
    assert timeline["disaggregated"] and [p["name"] for p in timeline["pools"]] == ["prefill", "decode"]
    record = timeline["requests"][-1]
    assert record["first_token"] <= record["transfer_end"] or record["transfer_start"] <= record["transfer_end"]
    assert record["admitted"] < record["first_decode"] < record["finished"]
    assert {i["pool"] for i in timeline["iterations"]} == {"prefill", "decode"}


DISAGGREGATED = ["--num_cpu_devices=2", "--prefill_devices=0", "--decode_devices=1"]


def test_cadence_generate_disaggregated_gives_the_reference_text(tiny_model_dir, tiny_params, tiny_config):
    stderr = generate_gives_the_reference_text(tiny_model_dir, tiny_params, tiny_config, *DISAGGREGATED)
    assert "cpu:0 (prefill) and cpu:1 (decode), disaggregated" in stderr


def test_cadence_batch_disaggregated_gives_the_reference_text(tiny_model_dir, tiny_params, tiny_config, tmp_path):
    prompts, files = batch_job(tmp_path)
    result = cli(tiny_model_dir, "cadence.server.batch_cli", *files, *DISAGGREGATED)
    assert result.returncode == 0, result.stderr
    assert_batch_is_the_reference(tmp_path, prompts, tiny_model_dir, tiny_params, tiny_config)


@pytest.mark.parametrize("flags, message", [
    (["--prefill_devices=0", "--decode_devices=1"], "needs two devices; this machine has one cpu device. "
                                                    "On the CPU, --num_cpu_devices=2"),
    (["--num_cpu_devices=2", "--prefill_devices=0"], "needs both --prefill_devices and --decode_devices"),
    (["--num_cpu_devices=2", "--prefill_devices=1", "--decode_devices=1"], "must be different devices"),
    (["--num_cpu_devices=2", "--prefill_devices=0", "--decode_devices=2"], "the devices are 0..1"),
    (["--num_cpu_devices=3", "--prefill_devices=0,1", "--decode_devices=2"], "one device index for now"),
])
def test_a_mode_that_cannot_run_is_refused_with_the_reason(tiny_model_dir, flags, message):
    result = cli(tiny_model_dir, "cadence.server.generate_cli", "--prompt=x", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_lora_requests_handed_over_decode_with_their_adapters(tiny_params, tiny_config, tiny_tokenizer):
    """Both engines hold the LoRA bank: a request's adapter shapes its prompt's KV on the
    prefill device and its tokens on the decode device, mixed with base-model requests."""
    from cadence.model import lora
    from cadence.model.host_sampling import RequestSampling
    from tests.tiny_models import random_adapter, undo_embedding_boost

    params = jax.tree.map(np.asarray, undo_embedding_boost(tiny_params))
    adapters = [random_adapter(tiny_config, "a", 4, lora.PROJECTIONS, 1)]
    config = dataclasses_replace(CONFIG, lora_slots=1, lora_rank=4)
    devices = jax.devices()
    prefill, decode = (Engine(params, tiny_config, dataclasses_replace(config, role=role), device=devices[i],
                              adapters=adapters) for i, role in ((1, "prefill"), (2, "decode")))
    sched = Scheduler(prefill, tiny_tokenizer, POLICY, decode_engine=decode)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, tiny_config.vocab_size, n)] for n in (20, 37, 9)]
    scales = [((0, 1.0),), (), ((0, 0.5),)]
    sched.start()
    streams = [sched.submit(p, GenerationParams(max_tokens=8, ignore_eos=True, sampling=RequestSampling(lora=s)))
               for p, s in zip(prompts, scales)]
    got = [[t for e in stream for t in getattr(e, "token_ids", [])] for stream in streams]
    sched.stop(drain=True, timeout=30)
    for prompt, pairs, tokens in zip(prompts, scales, got):
        merged = lora.merged_params(params, tiny_config, [(adapters[i], s) for i, s in pairs])
        assert tokens == greedy_generate(merged, tiny_config, prompt, 8, frozenset())
    assert sched.kv_transfers == len(prompts)
