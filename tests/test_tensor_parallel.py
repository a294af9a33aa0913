"""Tensor parallelism on the test session's four CPU devices: the plan's rules, logits and
greedy tokens equal to one device's at TP = 2 and 4 (heads that split, KV heads repeated over
more devices than there are, attention replicated where heads do not split), the restore into
shards, and the front doors' flag."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from cadence.checkpoints.store import load_converted, save_converted
from cadence.engine import compile_counter
from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.engine.reference import greedy_generate
from cadence.model.config import LLAMA3_8B, SMOLLM2_135M, TINY
from cadence.model.llama import forward
from cadence.model.paged_kv import PagedKVCache
from cadence.model.params import EMBED, FFN, HEADS, KV_HEADS, VOCAB, param_specs
from cadence.model.quant import quantize
from cadence.model.sharding import TensorParallel
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.conftest import random_params
from tests.serving import cli, generate_gives_the_reference_text
from tests.tiny_models import GEMMA3_TINY, QWEN3_TINY

pytestmark = pytest.mark.slow  # the full tier: tensor parallelism over several CPU devices

# Six query heads over three KV heads, and a vocabulary of 510: at TP=2 and 4 the heads do not
# split (attention replicated), and at 4 neither does the vocabulary.
SIX = dataclasses.replace(TINY, name="six-heads", num_heads=6, num_kv_heads=3, ffn_size=96,
                          vocab_size=510)
ENGINE = EngineConfig(num_slots=3, max_seq_len=128, prefill_chunk=32, page_size=16, min_kv_bucket=64)
POLICY = SchedulerConfig(policy=PolicyConfig(token_budget=64, chunk=32))


def plan(config, n):
    return TensorParallel.plan(config, jax.devices()[:n])


@pytest.mark.parametrize("config, n, split, repeat, note", [
    (TINY, 2, {VOCAB, HEADS, KV_HEADS, FFN}, 1, None),
    (TINY, 4, {VOCAB, HEADS, KV_HEADS, FFN}, 2, "2 KV heads over 4 devices"),
    (SIX, 2, {VOCAB, FFN}, 1, "attention is replicated: 6 query heads and 3 KV heads"),
    (SIX, 4, {FFN}, 1, "the vocabulary (510) does not split over 4 devices"),
    (SMOLLM2_135M, 2, {VOCAB, FFN}, 1, "9 query heads"),
    (SMOLLM2_135M, 3, {VOCAB, HEADS, KV_HEADS, FFN}, 1, None),
    (LLAMA3_8B, 4, {VOCAB, HEADS, KV_HEADS, FFN}, 1, None),
], ids=lambda v: getattr(v, "name", None))
def test_the_plan_splits_what_divides_and_says_why_not(config, n, split, repeat, note):
    tp = plan(config, n)
    assert {a for a, m in tp.rules.items() if m} == split and tp.rules[EMBED] is None
    assert tp.kv_repeat == repeat
    assert tp.compute_config.num_kv_heads == config.num_kv_heads * repeat
    assert (note is None) == (not tp.notes) and (note is None or any(note in m for m in tp.notes))
    assert tp.pool_sharding.spec == (P("tp", None, None, None) if HEADS in split else P(None, None, None, None))


def single_and_sharded(config, n, attention="xla", weights="float"):
    """Logits and the pool after a two-row prefill at a page offset, then one decode step of
    both rows, on one device and over `n` (pools compared in the stored KV-head order)."""
    params = random_params(config)
    if weights == "int8":
        params = quantize(params, config)
    tokens = np.arange(1, 33, dtype=np.int32).reshape(2, 16)
    positions = np.stack([np.arange(16), np.arange(16) + 16]).astype(np.int32)
    table = np.array([[0, 1], [2, 3]], np.int32)
    results = []
    for tp in (plan(config, 1), plan(config, n)):
        cc = tp.compute_config
        run = jax.jit(functools.partial(forward, config=cc, attention=attention, mesh=tp.attention_mesh))
        cache = PagedKVCache.create(cc, 4, 16, device=tp.pool_sharding)
        p = tp.place(params, jnp.float32)
        chunk, cache = run(p, tokens, positions, np.array([16, 16], np.int32), cache, table)
        step, cache = run(p, tokens[:, :1] + 7, positions[:, -1:] + 1, np.array([1, 1], np.int32),
                          cache, table)
        assert all(layer.sharding.is_equivalent_to(tp.pool_sharding, 4) for layer in cache.k + cache.v)
        kv = [np.asarray(layer)[:: tp.kv_repeat] for layer in cache.k + cache.v]
        results.append((np.asarray(chunk), np.asarray(step), kv))
    return results


@pytest.mark.parametrize("config, n", [(TINY, 2), (TINY, 4), (SIX, 2), (SIX, 4), (QWEN3_TINY, 2),
                                       (GEMMA3_TINY, 2)],
                         ids=["tiny-tp2", "tiny-tp4-kv-repeated", "six-tp2-replicated", "six-tp4",
                              "qwen3-tp2", "gemma3-tp2-sliding"])
def test_sharded_logits_and_kv_equal_one_devices(config, n):
    (chunk1, step1, kv1), (chunk, step, kv) = single_and_sharded(config, n)
    # Logits reach ~50 here, and a sharded sum adds in another order: float32 rounding of the
    # large terms (~50 x 1e-7 per add) bounds what a small logit may differ by.
    np.testing.assert_allclose(chunk, chunk1, rtol=1e-5, atol=5e-5)
    np.testing.assert_allclose(step, step1, rtol=1e-5, atol=5e-5)
    for a, b in zip(kv, kv1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [2, 4], ids=["tp2", "tp4-kv-repeated"])
def test_int8_weights_shard_as_float_ones_do(n):
    """Scales split with their channels (and repeat with their KV heads): sharded int8 logits
    equal one device's."""
    (chunk1, step1, kv1), (chunk, step, kv) = single_and_sharded(TINY, n, weights="int8")
    np.testing.assert_allclose(chunk, chunk1, rtol=1e-5, atol=5e-5)
    np.testing.assert_allclose(step, step1, rtol=1e-5, atol=5e-5)
    for a, b in zip(kv, kv1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_pallas_kernels_run_per_shard_under_shard_map():
    """The Pallas paged kernels (interpreted on the CPU) over each device's own heads."""
    (chunk1, step1, _), (chunk, step, _) = single_and_sharded(TINY, 2, attention="pallas")
    np.testing.assert_allclose(chunk, chunk1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step, step1, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def warm_engine():
    """Warmed-up engines over the first n devices, built once per (config, n) for the module."""
    engines = {}

    def get(config, n):
        if (config, n) not in engines:
            engines[config, n] = Engine(random_params(config), config, ENGINE, devices=jax.devices()[:n])
            engines[config, n].warmup()
        return engines[config, n]

    yield get
    engines.clear()


def serve(engine, tokenizer, prompts, max_tokens):
    sched = Scheduler(engine, tokenizer, POLICY)
    streams = [sched.submit(p, GenerationParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    while not sched.idle():
        sched.step()
    return [s.request.output_ids for s in streams]


@pytest.mark.parametrize("config, n", [(TINY, 2), (TINY, 4)], ids=["tp2", "tp4-kv-repeated"])
def test_a_sharded_engine_serves_the_references_tokens_without_compiling(config, n, tiny_tokenizer,
                                                                       warm_engine):
    """Chunked prompts (one spans three chunks) over three slots, five requests (so slots and
    pages are reused): the reference generator's greedy tokens, no compile after warm-up, and
    the donated pool still sharded as planned."""
    params = random_params(config)
    engine = warm_engine(config, n)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, config.vocab_size, k)] for k in (16, 70, 5, 33, 1)]
    before = compile_counter.count()  # the process's: other tests compile their own programs
    got = serve(engine, tiny_tokenizer, prompts, 10)
    assert compile_counter.count() == before
    assert all(layer.sharding.is_equivalent_to(engine.tp.pool_sharding, 4) for layer in engine.cache.k)
    for prompt, tokens in zip(prompts, got):
        assert tokens == greedy_generate(params, config, prompt, 10, frozenset()), len(prompt)


def test_the_pool_counts_the_bytes_every_device_holds(tiny_params, tiny_config):
    """Split by KV head, the pool's bytes are one copy's; replicated, one per device."""
    split = Engine(tiny_params, tiny_config, ENGINE, devices=jax.devices()[:2])
    replicated = Engine(random_params(SIX), SIX, ENGINE, devices=jax.devices()[:2])
    assert split.kv_cache_bytes == split.cache.nbytes
    assert replicated.kv_cache_bytes == 2 * replicated.cache.nbytes


def test_kv_moves_in_and_out_of_a_sharded_pool(tiny_params, tiny_config):
    """A sequence's KV extracted from a TP=2 engine (sharded by KV head) and inserted into other
    pages of a single-device engine decodes exactly as it would have in place; taken to the host
    page by page (the prefix cache's host tier) and put back into other pages of the sharded
    pool, with no slot's next token touched, it decodes the same there."""
    from cadence.engine.packing import PrefillChunk
    from cadence.engine.programs import sampling_rows
    from cadence.model.host_sampling import RequestSampling

    sharded = Engine(tiny_params, tiny_config, ENGINE, devices=jax.devices()[:2])
    single = Engine(tiny_params, tiny_config, ENGINE, device=jax.devices()[3])
    prompt = list(range(5, 25))
    rows = sampling_rows([RequestSampling()] * ENGINE.num_slots)
    first = int(np.asarray(sharded.prefill([PrefillChunk(slot=0, tokens=prompt, start=0, final=True, pages=[0, 1])], rows))[0])
    handle = sharded.extract([0, 1], len(prompt), 0)
    assert handle.k.sharding == sharded.tp.handle_sharding
    single.insert(single.receive(handle), [5, 2], 1)
    table = np.zeros((ENGINE.num_slots, ENGINE.max_pages_per_seq), np.int32)
    table[1, :2] = [5, 2]
    positions = np.array([0, len(prompt), 0], np.int32)
    token = np.asarray(single.decode(positions, np.array([False, True, False]), rows, table))[0, 1]
    want = greedy_generate(tiny_params, tiny_config, prompt, 2, frozenset())
    assert [first, int(token)] == want
    pages = handle.host_pages()
    assert len(pages) == 2 and pages[0][0].shape == (tiny_config.num_layers, tiny_config.num_kv_heads, 16,
                                                     tiny_config.head_dim)
    sharded.insert(type(handle).from_host_pages(pages, 16, 2), [7, 8], None)
    back = sharded.extract([7, 8], len(prompt), 0)
    for got, sent in ((back.k, handle.k), (back.v, handle.v)):
        np.testing.assert_array_equal(np.asarray(got)[:, :, :2], np.asarray(sent)[:, :, :2])
    table[0, :2], table[1, :2] = [7, 8], 0
    positions = np.array([len(prompt), 0, 0], np.int32)  # slot 0's next input: still `first`
    token = np.asarray(sharded.decode(positions, np.array([True, False, False]), rows, table))[0, 0]
    assert int(token) == want[1]


@pytest.mark.parametrize("n", [2, 4])
def test_a_converted_checkpoint_restores_straight_into_its_shards(tmp_path, tiny_params, tiny_config, n):
    save_converted(tmp_path / "m", tiny_config, tiny_params)
    tp = plan(tiny_config, n)
    config, params = load_converted(tmp_path / "m", lambda c: plan(c, n).storage_shardings())
    assert config == tiny_config
    for spec in param_specs(config):
        leaf = params
        for key in spec.path:
            leaf = leaf[key]
        # k/v weights are restored whole where the plan repeats their heads (TP=4: 2 KV heads).
        repeated = tp.kv_repeat > 1 and KV_HEADS in spec.axes
        assert leaf.sharding == (tp.replicated if repeated else tp.sharding(spec.axes)), spec.key
        if any(tp.sharding(spec.axes).spec) and not repeated:
            assert leaf.addressable_shards[0].data.size == leaf.size // n, spec.key
        want = tiny_params
        for key in spec.path:
            want = want[key]
        np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=spec.key)


def test_cadence_generate_tensor_parallel_gives_the_reference_text(tiny_model_dir, tiny_params, tiny_config):
    stderr = generate_gives_the_reference_text(tiny_model_dir, tiny_params, tiny_config,
                                               "--num_cpu_devices=2", "--tensor_parallel=2")
    assert "on 2 cpu devices (tensor parallel over 2 devices: split vocab, heads, kv_heads, ffn)" in stderr


@pytest.mark.parametrize("flags, message", [
    (["--num_cpu_devices=2", "--tensor_parallel=3"], "--tensor_parallel=3 needs 3 devices; this "
                                                     "machine has 2 cpu device(s). On the CPU, --num_cpu_devices=3"),
    (["--num_cpu_devices=3", "--tensor_parallel=2", "--prefill_devices=0", "--decode_devices=2"],
     "--tensor_parallel with disaggregated serving"),
    (["--num_processes=2"], "--num_processes > 1 needs --coordinator_address"),
    (["--num_processes=2", "--process_id=2", "--coordinator_address=127.0.0.1:1"],
     "--process_id=2 is not in [0, 2)"),
    (["--num_processes=2", "--coordinator_address=nowhere"], "must be host:port"),
    (["--num_processes=2", "--coordinator_address=10.0.0.1:1234"], "needs CADENCE_PLAN_KEY"),
])
def test_a_tensor_parallel_mode_that_cannot_run_is_refused(tiny_model_dir, flags, message):
    result = cli(tiny_model_dir, "cadence.server.generate_cli", "--prompt=x", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_server_app_runs_unchanged_over_a_sharded_engine(tiny_params, tiny_config, tiny_tokenizer,
                                                            warm_engine):
    """The OpenAI endpoint, streaming, over a TP=2 engine: the reference's text."""
    import httpx

    from cadence.server.app import create_app
    from tests.conftest import loopback_server

    engine = warm_engine(tiny_config, 2)
    sched = Scheduler(engine, tiny_tokenizer, POLICY)
    prompt = "a prompt long enough to need two chunks of prefill " * 2
    before = compile_counter.count()  # the process's: other tests compile their own programs
    with loopback_server(create_app(sched, tiny_tokenizer, "tiny")) as base:
        r = httpx.post(f"{base}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True}, timeout=60)
    assert compile_counter.count() == before
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                   if line.startswith("data: {"))
    ids = greedy_generate(tiny_params, tiny_config, tiny_tokenizer.encode(prompt), 10, frozenset())
    assert text == tiny_tokenizer.decode(ids)
