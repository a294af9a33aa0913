"""vLLM's `min_tokens`: the first min_tokens tokens are never one that ends the answer (its stop
ids are masked out of the sampling row) and no stop string ends it before then; on the fake
engine (every dispatch path, against the sequential simulation) and on the tiny model against
the reference."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from cadence.engine.reference import greedy_generate
from cadence.model.host_sampling import RequestSampling
from tests.conftest import serve_tiny
from tests.fakes import EOS, TOK, Decode, FakeEngine, Harness, chunked, random_prompt

PROMPT = "The capital of France is"


@pytest.mark.parametrize("engine", [dict(), dict(decode_steps=4), dict(speculative_tokens=3, quoting=True)],
                         ids=["one_step", "four_steps", "speculative"])
def test_no_stop_id_before_min_tokens_and_free_after_on_every_dispatch_path(engine):
    """The fake model ends half its answers at once (EOS one token in two): each answer is the
    sequential simulation's with EOS masked for its first min_tokens (`Client.check`), so a
    mask lifted early, or kept past its boundary inside a multi-step or verify dispatch,
    changes it. No dispatch of several steps spans a boundary."""
    rng = np.random.default_rng(4)
    h = Harness(FakeEngine(num_slots=4, eos_one_in=2, **engine), chunked(budget=64, chunk=32))
    clients = [h.submit(random_prompt(rng, int(rng.integers(5, 40))), max_tokens=40, min_tokens=m)
               for m in (0, 1, 5, 9, 17, 30)]
    h.run()
    for c in clients:
        c.check(h.engine)
        m = c.params.min_tokens
        assert len(c.token_ids) >= m and EOS not in c.token_ids[:m]
    assert sum(c.record.finish_reason == "stop" for c in clients) >= 4  # EOS after the minimum
    for c in clients:  # its dispatches: from its first token's step to its last's (one behind)
        first_step, last_step = c.events[0][0] - 1, c.events[-1][0] - 1
        for calls in h.steps[first_step : last_step + 1]:
            for call in calls:
                if isinstance(call, Decode) and c.slot in call.slots:
                    first = call.positions[call.slots.index(c.slot)] - len(c.prompt) + 1
                    assert not first < c.params.min_tokens < first + call.steps


def test_a_verify_step_drafts_no_further_than_the_mask_reaches():
    """Speculative decoding samples every position of a verify step with the row as it is: a
    row masking its stop ids drafts only up to its min_tokens, so that no position past it is
    sampled masked. Prompts that repeat, on a model that quotes, draft often."""
    rng = np.random.default_rng(6)
    rows = 0
    for m in range(2, 40):
        h = Harness(FakeEngine(num_slots=1, eos_one_in=5, speculative_tokens=3, quoting=True), chunked())
        prompt = random_prompt(rng, 6) * 4
        c = h.submit(prompt, max_tokens=48, min_tokens=m)
        h.run()
        c.check(h.engine)
        for _, position, drafts in h.engine.verify_rows:
            first = position - len(prompt) + 1  # the index of the first token the step samples
            assert not first < m < first + drafts + 1
            rows += 1
    assert rows >= 30  # speculation ran


def test_stop_strings_wait_for_min_tokens():
    """Stop strings are looked for in the text from the min_tokens-th token on: one in the
    text before does not end the answer, the first one after does."""
    rng = np.random.default_rng(5)
    prompt = random_prompt(rng, 12)
    h = Harness(FakeEngine(num_slots=2), chunked())
    free = h.submit(prompt, max_tokens=30, ignore_eos=True)
    h.run()
    text = TOK.decode(free.token_ids)
    after = len(TOK.decode(free.token_ids[:9]))  # where the 10th token's text begins
    stop = next(c for c in text[:4] if c in text[after:])  # early, and again after the 10th
    early = h.submit(prompt, max_tokens=30, ignore_eos=True, stop=(stop,))
    late = h.submit(prompt, max_tokens=30, ignore_eos=True, stop=(stop,), min_tokens=10)
    h.run()
    assert early.record.output_tokens < 6 and early.text == text[: text.find(stop)]
    assert late.record.output_tokens >= 10
    assert late.text == text[: text.find(stop, after)] and late.record.finish_reason == "stop"


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer) as base:
        yield base


def test_min_tokens_on_the_tiny_model_is_the_reference_with_its_stop_id_masked(
        url, tiny_params, tiny_config, tiny_tokenizer):
    """A stop id the free answer writes at token k: with min_tokens past k the engine's answer
    is the reference's with that id biased out for min_tokens tokens, then free (stopping at
    it)."""
    prompt = tiny_tokenizer.encode(PROMPT)
    free = greedy_generate(tiny_params, tiny_config, prompt, 16, frozenset())
    k = next(i for i in range(16) if free[i] not in free[:i] and not tiny_tokenizer.is_special(free[i]))
    stop, m = free[k], k + 3
    head = greedy_generate(tiny_params, tiny_config, prompt, m, frozenset(),
                           sampling=RequestSampling(logit_bias=((stop, -100.0),)))
    want = head + greedy_generate(tiny_params, tiny_config, prompt + head, 16 - m, frozenset({stop}))
    r = httpx.post(f"{url}/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "min_tokens": m,
        "stop_token_ids": [stop], "logprobs": 0, "return_tokens_as_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    got = [int(t[len("token_id:"):]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    assert got == want and stop not in got[:m] and got[:k] == free[:k]


def test_a_masked_row_samples_through_every_filter(url, tiny_tokenizer):
    """Sampled through top_k, top_p, min_p and penalties, with the model's end-of-sequence ids
    biased up so far that a free answer ends at once: masked (a bias of -inf over the
    request's own), they never come before min_tokens, every token drawn is a real one, and
    right after the mask lifts the answer ends."""
    stops = sorted(tiny_tokenizer.eos_ids)
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.5, "top_k": 50, "top_p": 0.9,
            "min_p": 0.01, "presence_penalty": 0.5, "repetition_penalty": 1.2, "logprobs": 0,
            "return_tokens_as_token_ids": True, "logit_bias": {str(t): 100 for t in stops}}
    for seed in range(4):
        def answer(**more):
            r = httpx.post(f"{url}/v1/completions", json={**body, "seed": seed, **more}, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
            return [int(t[len("token_id:"):]) for t in choice["logprobs"]["tokens"]], choice["finish_reason"]

        free, reason = answer()
        assert len(free) <= 2 and reason == "stop"  # without min_tokens it ends at once
        got, reason = answer(min_tokens=12)
        assert not set(got[:12]) & set(stops) and all(0 <= t < tiny_tokenizer.vocab_size for t in got)
        assert len(got) <= 14 and reason == "stop"


@pytest.mark.parametrize("body, fragment", [
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"min_tokens": True}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens (9) exceeds max_tokens (8)"),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens cannot go with a grammar"),
])
def test_min_tokens_that_cannot_be_served_are_refused(url, body, fragment):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "min_tokens" or "min_tokens" not in fragment
