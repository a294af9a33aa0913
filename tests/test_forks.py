"""Several sequences from one prompt (OpenAI's `n`): the first prefills the prompt, the others
take its KV (full pages shared, the last token's page copied, the last token computed again),
on the fake engine, whose "model" reads every sequence's KV through its pages: an output equal to
its lone run means the sequence saw exactly its prompt."""

from __future__ import annotations

import random

import pytest

from cadence.model.host_sampling import RequestSampling
from tests.fakes import ALPHABET, FakeEngine, Harness, Prefill, chunked


def sampled(seed: int) -> dict:
    return dict(max_tokens=12, ignore_eos=True, sampling=RequestSampling(temperature=1.0, seed=seed))


def prefill_tokens(engine: FakeEngine) -> int:
    return sum(call.length for call in engine.log if isinstance(call, Prefill))


@pytest.mark.parametrize("length", [1, 15, 16, 17, 40, 100])
def test_a_group_prefills_its_prompt_once_and_each_sequence_equals_its_lone_run(length):
    """Prompts shorter than, one token past and exactly on a page (16), and over several chunks:
    one prefill of the prompt, one token more per later sequence, a copy of the last token's
    page where it is partial, and every sequence's tokens those of its seed alone."""
    engine = FakeEngine(num_slots=4, page_size=16, prefill_chunk=32)
    h = Harness(engine, chunked(budget=64, chunk=32), prefix_caching=False)
    prompt = [ALPHABET[i % len(ALPHABET)] for i in range(length)]
    clients = h.submit_group(prompt, [sampled(seed) for seed in (7, 8, 9, 10)])
    h.run()
    for c in clients:
        c.check(engine)
    assert len({tuple(c.token_ids) for c in clients}) > 1
    assert prefill_tokens(engine) == length + (3 if length > 1 else 3 * length)
    assert len(engine.copies) == (3 if (length - 1) % 16 else 0)
    assert h.sched.forked_tokens == 3 * (length - 1)
    assert [c.record.cached_tokens for c in clients] == [0] + [length - 1] * 3
    assert h.sched.kv_pages == (0, engine.num_pages)
    h.sched._prefill_pool.pages.check()


def test_more_sequences_than_slots_take_the_prompt_while_the_first_still_runs():
    """Six sequences over three slots: those that find the first still running fork from it;
    those admitted after it ended prefill the prompt (or take it from the prefix cache)."""
    for caching in (False, True):
        engine = FakeEngine(num_slots=3, page_size=8, prefill_chunk=32)
        h = Harness(engine, chunked(budget=64, chunk=32), prefix_caching=caching)
        prompt = [ALPHABET[i % len(ALPHABET)] for i in range(29)]
        params = [dict(sampled(seed), max_tokens=4 + 5 * (seed % 3)) for seed in range(6)]
        clients = h.submit_group(prompt, params)
        h.run()
        for c in clients:
            c.check(engine)
        assert h.sched.forked_tokens >= 2 * 28
        assert h.sched.kv_pages == (0, engine.num_pages)
        h.sched._prefill_pool.pages.check()


def test_groups_under_preemption_cancellation_and_a_small_pool():
    """Random groups and lone requests over a pool too small for them all: sequences are
    preempted (a forked one recomputes alone), some are cancelled; every one that finishes
    equals its lone run, and every page comes back."""
    rng = random.Random(11)
    engine = FakeEngine(num_slots=4, page_size=8, prefill_chunk=16, num_pages=24, max_seq_len=128)
    h = Harness(engine, chunked(budget=40, chunk=16), prefix_caching=True)
    groups = []
    for step in range(60):
        if step % 4 == 0:
            prompt = [rng.choice(ALPHABET) for _ in range(rng.randint(1, 50))]
            params = [dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.5,
                           sampling=RequestSampling(temperature=1.0, seed=rng.randrange(2**32)))
                      for _ in range(rng.randint(1, 4))]
            groups.append(h.submit_group(prompt, params))
        if step == 30:
            groups[2][0].stream.cancel()  # a group's first sequence, while others may wait on it
        h.step()
    h.run()
    assert h.sched.preemptions > 0 and h.sched.forked_tokens > 0
    for group in groups:
        for c in group:
            c.check(engine)
    assert h.sched.kv_pages == (0, engine.num_pages)
    h.sched._prefill_pool.pages.check()


# -- the real engine and the API --------------------------------------------------------------


def test_on_the_engine_each_choice_equals_its_request_alone(tiny_params, tiny_config, tiny_tokenizer,
                                                           shared_engine):
    """The tiny model: four sampled choices of a prompt over two chunks prefill it once (plus
    one token per later choice), and each equals the request with n=1 and that choice's seed
    (`parsing.choice_seed`); greedy choices equal the reference generator."""
    from cadence.engine.config import EngineConfig
    from cadence.engine.reference import greedy_generate
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.request import GenerationParams
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
    from cadence.server.parsing import choice_seed
    from tests.conftest import SAMPLING_ENGINE, compiled
    from tests.fakes import run_all

    # The sampling tests' engine, with the page copy compiled: a fork meeting it still
    # compiling prefills its choices apart (the same tokens, more prefill), which would move
    # the counts below with the machine's speed.
    engine = compiled(shared_engine(EngineConfig(**SAMPLING_ENGINE), "needed"), "copy")
    prompt = [3 + (i * 37) % 500 for i in range(45)]
    base = RequestSampling(temperature=100.0, seed=1234)
    params = [GenerationParams(max_tokens=16, ignore_eos=True,
                               sampling=RequestSampling(temperature=100.0, seed=choice_seed(base.seed, i)))
              for i in range(4)]

    def scheduler():
        return Scheduler(engine, tiny_tokenizer, SchedulerConfig(
            policy=PolicyConfig(name="chunked", token_budget=48, chunk=32)))

    sched, prefilled = scheduler(), []
    sched.iteration_listeners.append(lambda record: prefilled.append(record.prefill_tokens))
    sched.start()
    group = sched.submit_group(prompt, params, [None] * 4)
    outputs = [[t for e in s for t in getattr(e, "token_ids", [])] for s in group]
    sched.stop(drain=True, timeout=30)
    assert sum(prefilled) == len(prompt) + 3 and sched.forked_tokens == 3 * (len(prompt) - 1)
    alone = run_all(scheduler(), [(prompt, p) for p in params], [0, 3, 6, 9])
    assert outputs == [s.request.output_ids for s in alone]
    assert len({tuple(o) for o in outputs}) == 4
    greedy = GenerationParams(max_tokens=10, ignore_eos=True)
    pair = run_all(scheduler(), [(prompt, greedy)])  # (warm) then a greedy group
    sched = scheduler()
    sched.start()
    group = sched.submit_group(prompt, [greedy, greedy], [None, None])
    outputs = [[t for e in s for t in getattr(e, "token_ids", [])] for s in group]
    sched.stop(drain=True, timeout=30)
    want = greedy_generate(tiny_params, tiny_config, prompt, 10)
    assert outputs == [want, want] == [pair[0].request.output_ids] * 2


def test_the_api_returns_n_choices_streamed_and_whole(tiny_engine, tiny_tokenizer):
    """n=3 over HTTP: each choice's text equals the request with n=1 and that choice's seed,
    whole and streamed (chunks interleaved by index); usage counts the prompt once, and the
    repeat finds all of it but the last token cached;
    best_of=3, n=1 returns the likeliest of the three."""
    import json

    import httpx

    from cadence.server.parsing import choice_seed
    from tests.serving import gauge, serving

    body = {"model": "tiny", "prompt": "once upon a time there was", "max_tokens": 8,
            "temperature": 100.0, "seed": 99, "ignore_eos": True}
    with serving(tiny_engine, tiny_tokenizer) as (base, _):
        post = lambda b: httpx.post(f"{base}/v1/completions", json=b, timeout=60)  # noqa: E731
        whole = post({**body, "n": 3}).json()
        streamed = post({**body, "n": 3, "stream": True, "stream_options": {"include_usage": True}})
        alone = [post({**body, "seed": choice_seed(99, i)}).json() for i in range(3)]
        best = post({**body, "best_of": 3, "logprobs": 0}).json()
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 1.0, "seed": 5, "n": 2, "stream": True}).text
        forked = gauge(base, "prompt_tokens_forked_total")
    texts = [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])]
    assert texts == [a["choices"][0]["text"] for a in alone] and len(set(texts)) > 1
    assert whole["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert forked >= 2 * (whole["usage"]["prompt_tokens"] - 1)  # n=3's two later choices at least
    assert whole["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    joined = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
              for i in range(3)]
    usage = chunks[-1]["usage"]
    assert joined == texts and {**usage, "prompt_tokens_details": None} == {**whole["usage"], "prompt_tokens_details": None}
    # the same prompt again: the cache lends it every token but the last (computed for its logits)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert streamed.text.count("data: [DONE]") == 1 and streamed.text.endswith("data: [DONE]\n\n")
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]) == 3
    # best_of: the choice is one of the three, the one of highest cumulative logprob
    assert len(best["choices"]) == 1 and best["choices"][0]["text"] in texts
    assert best["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    chat_chunks = [json.loads(line[6:]) for line in chat.splitlines() if line.startswith("data: {")]
    roles = [c["choices"][0]["index"] for c in chat_chunks if c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
