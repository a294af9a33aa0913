"""logit_bias, presence/frequency/repetition penalties and min_p: the device's vectorized stages
against the reference's row-at-a-time NumPy (`engine.reference.adjusted_logits`), and the real
engine under the scheduler against the reference generator, through chunked prefill, several
steps per dispatch, the prefix cache and preemption."""

from __future__ import annotations

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.engine.config import EngineConfig
from cadence.engine.reference import adjusted_logits, dry_penalties, greedy_generate
from cadence.model.host_sampling import MAX_DRY_BREAKERS, SAMPLER_STATE, RequestSampling, SamplingRows, dry_matches
from cadence.model.sampling import SamplingParams, TokenHistory, adjust_logits, sample
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.conftest import ONE_LONGEST, SAMPLING_ENGINE
from tests.fakes import random_prompts, run_all

PENALIZED = [
    RequestSampling(repetition_penalty=1.8),
    RequestSampling(frequency_penalty=1.5),
    RequestSampling(presence_penalty=2.0, frequency_penalty=-0.5),
    RequestSampling(repetition_penalty=0.7, presence_penalty=0.5),
    # llama.cpp's: over the last n tokens of prompt and output
    RequestSampling(repetition_penalty=1.6, frequency_penalty=0.8, penalty_window=5),
    RequestSampling(presence_penalty=1.5, frequency_penalty=1.0, penalty_window=64),
    # llama.cpp's DRY: alone (token 3 a breaker), and beside a windowed penalty
    RequestSampling(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, dry_window=64, dry_breakers=(3,)),
    RequestSampling(dry_multiplier=2.0, dry_base=1.3, dry_allowed_length=1, dry_window=12, dry_breakers=(5, 9),
                    repetition_penalty=1.2, penalty_window=8),
]


def dry_args(row: RequestSampling, tokens: np.ndarray) -> tuple:
    """`TokenHistory.set_row`'s last arguments for a request over `tokens` (padded): its DRY
    breakers, padded; each position's repetition where it is on DRY (`dry_matches`); its
    sampler's state (none carries one here)."""
    breakers = np.full(MAX_DRY_BREAKERS, 2**31 - 1, np.int32)
    breakers[: len(row.dry_breakers)] = row.dry_breakers
    match = np.zeros(len(tokens), np.int32)
    n = int(np.sum(tokens != 2**31 - 1))
    if row.dry_multiplier:
        match[:n] = dry_matches(tokens[:n])
    return breakers, match, np.zeros(SAMPLER_STATE, np.float32)


@pytest.mark.parametrize("seed", range(4))
def test_dry_matches_are_each_positions_repetition_of_the_end(seed):
    """The Z-algorithm's repetitions against counting them position by position."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1 + seed, 60)  # from one token (all alike) to four
    got = dry_matches(tokens)
    for k in range(len(tokens) - 1):
        n = 0
        while n <= k and tokens[k - n] == tokens[-1 - n]:
            n += 1
        assert got[k] == n, (k, got[k], n)
    assert got[-1] == 0 and (seed or got[0] == 1)


def test_adjust_logits_equals_the_reference_row_by_row():
    """Random logits and histories; rows with every stage, one stage, and none (which must come
    out bit-identical): the device's stages equal the NumPy reference's."""
    vocab, slots = 64, 12
    rng = np.random.default_rng(0)
    rows = [RequestSampling(), *PENALIZED,
            RequestSampling(logit_bias=((3, 100.0), (7, -100.0), (63, 0.5)), repetition_penalty=1.3)]
    logits = rng.normal(size=(len(rows), vocab)).astype(np.float32) * 4
    sequences = [(list(rng.integers(0, vocab, rng.integers(1, 30))), list(rng.integers(0, vocab, rng.integers(0, 20))))
                 for _ in rows]
    # The DRY rows' sequences repeat themselves (the first's breaker, 3, cutting its repetitions
    # to the two tokens after it).
    sequences[-3] = ([3, 1, 2, 4, 3, 1, 2, 4], [3, 1, 2])
    sequences[-2] = ([1, 2, 1, 2, 1, 2, 7, 1, 2, 6, 1], [2, 1, 2])
    assert all(dry_penalties(row, sum(seq, [])) for row, seq in zip(rows[-3:-1], sequences[-3:-1]))
    slot_of = rng.permutation(slots)[: len(rows)]
    history = TokenHistory.create(slots, vocab, 50)
    for slot, row, (prompt, output) in zip(slot_of, rows, sequences):
        tokens = padded(prompt + output, 50)
        history = history.set_row(jnp.int32(slot), tokens, jnp.int32(len(prompt)),
                                  jnp.int32(row.penalty_window), *dry_args(row, tokens))
    got = np.asarray(jax.jit(adjust_logits)(logits, SamplingRows.of(rows).params(), history, slot_of))
    for i, (row, (prompt, output)) in enumerate(zip(rows, sequences)):
        np.testing.assert_allclose(got[i], adjusted_logits(logits[i], row, prompt, output), rtol=1e-6)
    np.testing.assert_array_equal(got[0], logits[0])
    assert not np.array_equal(got[1:], logits[1:])


def padded(tokens: list[int], n: int) -> np.ndarray:
    out = np.full(n, 2**31 - 1, np.int32)
    out[: len(tokens)] = tokens
    return out


@pytest.mark.parametrize("window, dry", [(0, False), (1, False), (4, False), (100, False), (0, True), (4, True)])
def test_counting_token_by_token_equals_writing_the_row_whole(window, dry):
    """A row set from its prompt and then counted on, token by token, equals the row set from
    the whole sequence: with a window, each token that falls out of it leaves its counts; on
    DRY, each position's repetition grows with the tokens that go on with it."""
    vocab, seq = 4 if dry else 16, 48  # (few tokens: many repetitions)
    rng = np.random.default_rng(window)
    row = RequestSampling(frequency_penalty=1.0, penalty_window=window, dry_multiplier=float(dry), dry_breakers=(2,))
    params = SamplingRows.of([row, RequestSampling()]).params()
    prompt, output = list(rng.integers(0, vocab, 9)), list(rng.integers(0, vocab, 30))
    count = jax.jit(TokenHistory.count)
    history = TokenHistory.create(2, vocab, seq).set_row(
        jnp.int32(0), padded(prompt, seq), jnp.int32(len(prompt)), jnp.int32(window),
        *dry_args(row, padded(prompt, seq)))
    for token in output:
        history = count(history, jnp.asarray([0, 1]), jnp.asarray([token, 3]), params)
    whole = TokenHistory.create(2, vocab, seq).set_row(
        jnp.int32(0), padded(prompt + output, seq), jnp.int32(len(prompt)), jnp.int32(window),
        *dry_args(row, padded(prompt + output, seq)))
    assert np.asarray(whole.match).max() >= 2 if dry else not np.asarray(whole.match).any()
    jax.tree.map(np.testing.assert_array_equal, history, whole)  # row 1 (plain) untouched
    recent = (prompt + output)[-window:] if window else output
    np.testing.assert_array_equal(np.asarray(history.counts)[0], np.bincount(recent, minlength=vocab))


def test_history_counts_only_penalized_rows():
    history = TokenHistory.create(3, 8, 4)
    params = SamplingRows.of([RequestSampling(), RequestSampling(frequency_penalty=1.0),
                              RequestSampling()]).params()
    history = history.count(jnp.asarray([0, 1, 3]), jnp.asarray([5, 5, 5]), params)  # 3: dropped
    history = history.count(jnp.asarray([0, 1, 3]), jnp.asarray([5, 6, 5]), params)
    np.testing.assert_array_equal(np.asarray(history.counts)[:, 5:7], [[0, 0], [1, 1], [0, 0]])


def test_min_p_keeps_tokens_within_its_share_of_the_likeliest():
    n = 4000
    logits = jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1] + [1e-9] * 4))[None].repeat(n, 0)
    rows = SamplingRows.of([RequestSampling(temperature=1.0, seed=11, min_p=0.6)] * n)
    got = np.asarray(jax.jit(sample)(logits, rows.params(), jnp.arange(n, dtype=jnp.int32)))
    # 0.6 x 0.4 = 0.24: 0.4 and 0.3 stay, renormalized.
    np.testing.assert_allclose(np.bincount(got, minlength=8)[:4] / n, [4 / 7, 3 / 7, 0, 0], atol=0.03)
    rows = SamplingRows.of([RequestSampling(temperature=1.0, seed=11, min_p=1.0)] * 8)
    assert (np.asarray(sample(logits[:8], rows.params(), jnp.arange(8, dtype=jnp.int32))) == 0).all()


@pytest.mark.parametrize("kwargs", [
    {"min_p": -0.1}, {"min_p": 1.5}, {"presence_penalty": 2.5}, {"frequency_penalty": -3},
    {"repetition_penalty": 0.0}, {"repetition_penalty": 2.5}, {"presence_penalty": float("nan")},
    {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)}, {"logit_bias": ((1, 1.0), (1, 2.0))},
    {"logit_bias": tuple((i, 1.0) for i in range(301))}, {"logit_bias": ((True, 1.0),)},
    {"logit_bias": ((1, float("inf")),)}, {"logit_bias": [(1, 1.0)]},
    {"penalty_window": -1}, {"penalty_window": 2**31}, {"penalty_window": 1.5}, {"penalty_window": True},
])
def test_bad_penalties_and_biases_are_refused(kwargs):
    with pytest.raises(ValueError):
        RequestSampling(**kwargs)


def test_make_keeps_every_other_stage_off():
    params = SamplingParams.make([0.5], [3], [0.9], [4])
    assert not bool(params.penalized[0]) and float(params.min_p[0]) == 0


# Several steps per dispatch: the full tier (test_multistep.py compares them with one step at a
# time, penalties and logprobs included, in the default one).
@pytest.fixture(params=[1, pytest.param(4, marks=pytest.mark.slow)], ids=["1step", "4steps"])
def engine(request, shared_engine):
    # The sampling tests' engine (test_logprobs.py's too); the history program compiles on first
    # use.
    return shared_engine(EngineConfig(**SAMPLING_ENGINE, decode_steps=request.param), "needed")


def scheduler(engine, tokenizer, **config) -> Scheduler:
    return Scheduler(engine, tokenizer, SchedulerConfig(
        policy=PolicyConfig(name="chunked", token_budget=48, chunk=32), **config))


def test_penalized_greedy_equals_the_reference_beside_plain_rows(engine, tiny_params, tiny_config, tiny_tokenizer):
    """Penalized requests (prompts longer than a chunk, so their first token samples after
    several chunks) batched with plain greedy ones: each equals the reference generator with
    its penalties, the plain ones equal plain greedy, and the penalties change outputs."""
    rng = random.Random(3)
    prompts = random_prompts(rng, 8, tiny_config.vocab_size, 5, 90)
    rows = [PENALIZED[i % len(PENALIZED)] if i % 2 else RequestSampling() for i in range(len(prompts))]
    subs = [(p, GenerationParams(max_tokens=24, ignore_eos=True, sampling=s)) for p, s in zip(prompts, rows)]
    before = engine.compilations_after_warmup  # the process's (the engine is shared)
    streams = run_all(scheduler(engine, tiny_tokenizer), subs, [rng.randint(0, 6) for _ in subs])
    assert engine.compilations_after_warmup == before  # (before the reference compiles)
    changed = 0
    for prompt, row, s in zip(prompts, rows, streams):
        assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 24, sampling=row)
        changed += s.request.output_ids != greedy_generate(tiny_params, tiny_config, prompt, 24)
    assert changed >= 1  # (the tiny model repeats itself little in 24 tokens)


def test_logit_bias_forces_and_bans_tokens(engine, tiny_params, tiny_config, tiny_tokenizer):
    prompt = [5, 9, 11, 40]
    plain = greedy_generate(tiny_params, tiny_config, prompt, 6)
    banned = RequestSampling(logit_bias=tuple((t, -100.0) for t in set(plain)))
    forced = RequestSampling(logit_bias=((77, 100.0),))
    a, b = run_all(scheduler(engine, tiny_tokenizer), [
        (prompt, GenerationParams(max_tokens=6, ignore_eos=True, sampling=banned)),
        (prompt, GenerationParams(max_tokens=6, ignore_eos=True, sampling=forced))])
    assert not set(a.request.output_ids) & set(plain)
    assert a.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 6, sampling=banned)
    assert b.request.output_ids == [77] * 6


def test_history_covers_cached_prefixes_and_preempted_outputs(tiny_params, tiny_config, tiny_tokenizer,
                                                              shared_engine):
    """The history is the sequence's, whatever prefill skipped: a prompt whose pages came from
    the prefix cache, and a request recomputed after a preemption, still equal the reference."""
    # A pool that holds one longest sequence and the null page: test_speculative.py serves over
    # the same engine. The history program compiles on first use.
    e = shared_engine(EngineConfig(**ONE_LONGEST), "needed")
    rng = random.Random(8)
    shared = random_prompts(rng, 1, tiny_config.vocab_size, 64, 64)[0]
    prompts = [shared + p for p in random_prompts(rng, 6, tiny_config.vocab_size, 1, 40)]
    rows = [PENALIZED[i % len(PENALIZED)] for i in range(len(prompts))]
    sched = scheduler(e, tiny_tokenizer, prefix_caching=True)
    subs = [(p, GenerationParams(max_tokens=40, ignore_eos=True, sampling=s)) for p, s in zip(prompts, rows)]
    streams = run_all(sched, subs, [0, 6, 7, 8, 9, 10])
    assert sched.preemptions > 0 and sched.prefix_hits > 0
    for prompt, row, s in zip(prompts, rows, streams):
        assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 40, sampling=row)


def test_the_api_serves_penalties_and_biases_as_the_reference_computes_them(
        tiny_engine, tiny_params, tiny_config, tiny_tokenizer):
    """The OpenAI fields reach the device as the reference takes them: chat and completions,
    streamed and not, beside a plain request that they must not change."""
    from tests.serving import serving

    import httpx

    prompt = "the quick brown fox jumps over the lazy dog " * 3
    ids = tiny_tokenizer.encode(prompt)
    fields = {"repetition_penalty": 1.5, "frequency_penalty": 0.75, "presence_penalty": 0.25,
              "logit_bias": {"17": 2.5, "40": -3}}
    row = RequestSampling(repetition_penalty=1.5, frequency_penalty=0.75, presence_penalty=0.25,
                          logit_bias=((17, 2.5), (40, -3.0)))
    want = greedy_generate(tiny_params, tiny_config, ids, 12, sampling=row)
    plain = greedy_generate(tiny_params, tiny_config, ids, 12)
    assert want != plain  # so that fields dropped on the way would show
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with serving(tiny_engine, tiny_tokenizer) as (base, _):
        got = httpx.post(f"{base}/v1/completions", json={**body, **fields}, timeout=60).json()
        untouched = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        streamed = httpx.post(f"{base}/v1/completions", json={**body, **fields, "stream": True}, timeout=60)
    assert got["choices"][0]["text"] == tiny_tokenizer.decode(want)
    assert untouched["choices"][0]["text"] == tiny_tokenizer.decode(plain)
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
                   if line.startswith("data: {"))
    assert text == tiny_tokenizer.decode(want)


def test_llama_servers_penalty_names_on_the_openai_doors_count_as_it_does(
        tiny_engine, tiny_params, tiny_config, tiny_tokenizer):
    """llama-server's own /v1 takes repeat_penalty and repeat_last_n, and counts all three
    penalties over the window: so do cadence's /v1 doors when a request names them (64 tokens
    when only repeat_penalty is given), as the reference computes llama.cpp's; vLLM's
    repetition_penalty beside them is a 400."""
    from tests.serving import serving

    import httpx

    prompt = "the quick brown fox jumps over the lazy dog and the dog sleeps " * 8
    ids = tiny_tokenizer.encode(prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "presence_penalty": 2.0, "frequency_penalty": 2.0}
    with serving(tiny_engine, tiny_tokenizer) as (base, _):
        def tokens(**extra):
            r = httpx.post(f"{base}/v1/completions", json={**body, **extra}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        windowed, default_window = tokens(repeat_penalty=2.0, repeat_last_n=6), tokens(repeat_penalty=2.0)
        openai = tokens()
        both = httpx.post(f"{base}/v1/completions", json={**body, "repeat_last_n": 6,
                                                          "repetition_penalty": 1.5}, timeout=60)
    penalties = dict(repetition_penalty=2.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert windowed == greedy_generate(tiny_params, tiny_config, ids, 16,
                                       sampling=RequestSampling(**penalties, penalty_window=6))
    assert default_window == greedy_generate(tiny_params, tiny_config, ids, 16,
                                             sampling=RequestSampling(**penalties, penalty_window=64))
    assert openai == greedy_generate(tiny_params, tiny_config, ids, 16, sampling=RequestSampling(
        presence_penalty=2.0, frequency_penalty=2.0))
    assert windowed != openai
    assert both.status_code == 400 and both.json()["error"]["param"] == "repetition_penalty"
