"""Embeddings: prompts prefilled in the pooling program (chunked, packed with each other and
beside requests that generate), their final hidden states pooled, against the reference's one
forward pass over the whole prompt; and the scheduler's handling of them (no token, no decode,
no prefix cache, preemption, batched generation unchanged beside them)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cadence.engine.config import EngineConfig
from cadence.engine.packing import PrefillChunk
from cadence.engine.reference import greedy_generate, sequence_logits
from cadence.model.host_sampling import SamplingRows
from cadence.scheduler.errors import RequestTooLong, SubmissionError
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.conftest import ONE_LONGEST, SAMPLING_ENGINE, compiled
from tests.fakes import random_prompts, run_all


@pytest.fixture
def engine(shared_engine):
    # The pooling programs compiled before the test: no embedding parks for them, so the
    # schedules below do not depend on how long compiling takes.
    return compiled(shared_engine(EngineConfig(**SAMPLING_ENGINE), "needed"), "pooling")


def scheduler(engine, tokenizer, **config) -> Scheduler:
    return Scheduler(engine, tokenizer, SchedulerConfig(
        policy=PolicyConfig(name="chunked", token_budget=48, chunk=32), **config))


def reference(params, config, prompt, pooling) -> np.ndarray:
    hidden = sequence_logits(params, config, prompt, hidden=True).astype(np.float64)
    return hidden.mean(axis=0) if pooling == "mean" else hidden[-1]


def embed(pooling: str) -> GenerationParams:
    return GenerationParams(pooling=pooling)


def test_pooled_prefill_equals_the_reference_chunked_and_packed(engine, tiny_params, tiny_config):
    """The engine alone: two prompts' chunks packed in one pooling program (the second split
    in three chunks over two calls), beside a chunk that samples; each chunk's sum and last
    hidden state equal the reference's over the whole prompt."""
    rng = random.Random(0)
    a, b, c = random_prompts(rng, 3, tiny_config.vocab_size, 20, 30)
    b = b + random_prompts(rng, 1, tiny_config.vocab_size, 40, 40)[0]
    pages = engine.config.pages_for(engine.config.max_seq_len)
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(3)]
    rows = SamplingRows(engine.config.num_slots).params()  # every slot greedy
    first = engine.prefill([PrefillChunk(0, a, 0, True, tables[0], pooled=True),
                            PrefillChunk(2, c, 0, True, tables[2]),
                            PrefillChunk(1, b[:32], 0, False, tables[1], pooled=True),
                            PrefillChunk(1, b[32:48], 32, False, tables[1], pooled=True)], rows)
    second = engine.prefill([PrefillChunk(1, b[48:], 48, True, tables[1], pooled=True)], rows)
    got, rest = first.pooled(), second.pooled()
    assert sorted(got) == [0, 2, 3] and sorted(rest) == [0]
    # one token, the sampling chunk's; the pooled chunks' entries are -1
    assert np.asarray(first).tolist() == [-1, greedy_generate(tiny_params, tiny_config, c, 1)[0], -1, -1]
    hidden_a = sequence_logits(tiny_params, tiny_config, a, hidden=True)
    hidden_b = sequence_logits(tiny_params, tiny_config, b, hidden=True)
    np.testing.assert_allclose(got[0][0], hidden_a.sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[0][1], hidden_a[-1], rtol=1e-4, atol=1e-5)
    parts = [got[2], got[3], rest[0]]
    for (total, last), (lo, hi) in zip(parts, [(0, 32), (32, 48), (48, len(b))]):
        np.testing.assert_allclose(total, hidden_b[lo:hi].sum(0), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(last, hidden_b[hi - 1], rtol=1e-4, atol=1e-5)


def test_embeddings_beside_generation_equal_the_reference(engine, tiny_params, tiny_config,
                                                          tiny_tokenizer):
    """Embeddings of both poolings, of prompts over several chunks, arriving among greedy
    requests: each equals the reference's pooling; the generated answers equal the reference
    generator's, as alone; an embedding emits no token and decodes nothing."""
    rng = random.Random(1)
    prompts = random_prompts(rng, 8, tiny_config.vocab_size, 3, 120)
    poolings = ["mean", None, "last", "mean", None, "last", "last", "mean"]
    subs = [(p, embed(k) if k else GenerationParams(max_tokens=10, ignore_eos=True))
            for p, k in zip(prompts, poolings)]
    before = engine.compilations_after_warmup
    streams = run_all(scheduler(engine, tiny_tokenizer), subs, [rng.randint(0, 4) for _ in subs])
    assert engine.compilations_after_warmup == before
    for prompt, pooling, s in zip(prompts, poolings, streams):
        record = s.record
        if pooling is None:
            assert record.embedding is None
            assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 10)
            continue
        assert record.finish_reason == "stop" and record.output_tokens == 0
        assert record.decode_steps == 0 and record.first_token is None
        assert record.prefill_chunks >= -(-len(prompt) // 32)
        assert record.embedding.shape == (tiny_config.hidden_size,)
        np.testing.assert_allclose(record.embedding, reference(tiny_params, tiny_config, prompt, pooling),
                                   rtol=1e-4, atol=1e-5)


def test_an_embedding_is_computed_whole_not_from_the_prefix_cache(engine, tiny_params, tiny_config,
                                                                   tiny_tokenizer):
    """A prompt the cache holds (a generation published it) is prefilled whole for its
    embedding, whose mean needs every position's hidden state."""
    prompt = random_prompts(random.Random(2), 1, tiny_config.vocab_size, 70, 70)[0]
    sched = scheduler(engine, tiny_tokenizer)
    run_all(sched, [(prompt, GenerationParams(max_tokens=2, ignore_eos=True))])
    (s,) = run_all(sched, [(prompt, embed("mean"))])
    assert s.record.cached_tokens == 0 and s.record.prefill_chunks == 3
    np.testing.assert_allclose(s.record.embedding, reference(tiny_params, tiny_config, prompt, "mean"),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length", [50, 65, 80])
def test_preempted_embeddings_start_over(shared_engine, tiny_params, tiny_config, tiny_tokenizer,
                                         length):
    """A pool that holds one longest sequence: two embeddings of priority 1 are mid-prefill when
    a generation of priority 0 arrives and preempts the second; both embeddings still equal the
    reference (the chunks it had taken before are not counted twice), and so does the answer."""
    engine = compiled(shared_engine(EngineConfig(**ONE_LONGEST), "needed"), "pooling")
    first, second, chat = random_prompts(random.Random(length), 3, tiny_config.vocab_size, 100, 100)
    second, chat = second[:length], chat[:64]
    subs = [(first, GenerationParams(pooling="last", priority=1)),
            (second, GenerationParams(pooling="mean", priority=1)),
            (chat, GenerationParams(max_tokens=30, ignore_eos=True, priority=0))]
    streams = run_all(scheduler(engine, tiny_tokenizer), subs)
    assert streams[0].record.preemptions == streams[2].record.preemptions == 0
    assert streams[1].record.preemptions > 0
    assert streams[2].request.output_ids == greedy_generate(tiny_params, tiny_config, chat, 30)
    for prompt, pooling, s in zip((first, second), ("last", "mean"), streams):
        np.testing.assert_allclose(s.record.embedding,
                                   reference(tiny_params, tiny_config, prompt, pooling),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("params, param", [
    (GenerationParams(pooling="max"), "pooling"),
    (GenerationParams(pooling="mean", max_tokens=4), "max_tokens"),
    (GenerationParams(pooling="last", logprobs=2), "logprobs"),
    (GenerationParams(pooling="last", stop=("x",)), "stop"),
])
def test_embedding_parameters_are_checked(engine, tiny_tokenizer, params, param):
    with pytest.raises(SubmissionError) as e:
        scheduler(engine, tiny_tokenizer).submit([5, 6, 7], params)
    assert e.value.param == param


def test_an_input_longer_than_the_context_is_refused(engine, tiny_tokenizer):
    sched = scheduler(engine, tiny_tokenizer)
    with pytest.raises(RequestTooLong, match="exceeds the 192-token context"):
        sched.submit([5] * 193, embed("mean"))
    sched.submit([5] * 192, embed("mean")).cancel()  # the whole context is fine: nothing follows
