"""vLLM's rules over an answer's tokens on the tiny model. `allowed_token_ids`: the answer holds
only those tokens, greedy it is the model's likeliest among them at every step (the
reference's logits), sampled and streamed it is the same whole, batched or alone; the answer's
end is the tokens' business, not the constraint's. `bad_words`: the answer never ends with one,
greedy it is the likeliest token the words leave at each step. And what is refused."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from cadence.engine.reference import sequence_logits
from tests.conftest import serve_tiny

PROMPT = "The capital of France is"
ALLOWED = [74, 75, 100, 101, 300]  # (not the token the tiny model repeats unconstrained)


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer) as base:
        yield base


def complete(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "return_token_ids": True,
                                                 "allowed_token_ids": ALLOWED, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_greedy_is_the_likeliest_allowed_token_at_every_step(url, tiny_tokenizer, tiny_params, tiny_config):
    prompt = tiny_tokenizer.encode(PROMPT)
    free = complete(url, temperature=0, allowed_token_ids=None)["token_ids"]
    assert not set(free) & set(ALLOWED)  # unconstrained, the model writes none of them
    answer = complete(url, temperature=0)
    assert answer["finish_reason"] == "length"
    logits = sequence_logits(tiny_params, tiny_config, prompt + answer["token_ids"])[len(prompt) - 1:]
    assert answer["token_ids"] == [ALLOWED[int(np.argmax(row[ALLOWED]))] for row in logits[:-1]]


def test_sampled_the_answer_is_the_same_alone_batched_and_streamed(url):
    """Seeded, at a temperature that spreads the draw over the set, every token is allowed; the
    answer is the same alone, beside other requests and streamed; min_tokens and ignore_eos go
    with it (they are refused beside a grammar, which decides where an answer ends)."""
    body = {"temperature": 20, "seed": 3, "ignore_eos": True, "min_tokens": 2, "max_tokens": 12}
    alone = complete(url, **body)["token_ids"]
    assert set(alone) <= set(ALLOWED) and len(set(alone)) > 1
    with ThreadPoolExecutor(3) as pool:
        batched = list(pool.map(lambda b: complete(url, **b)["token_ids"],
                                [body, {**body, "seed": 4}, {"temperature": 0, "allowed_token_ids": None}]))
    assert batched[0] == alone and set(batched[1]) <= set(ALLOWED)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPT, "stream": True, "return_token_ids": True, "allowed_token_ids": ALLOWED, **body}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []] == alone


def test_an_allowed_end_of_sequence_token_ends_the_answer(url, tiny_tokenizer):
    """Only the end-of-sequence token allowed: the answer ends at once, as the model's EOS ends
    it ("stop"). (Allowed only other tokens, it runs to its length: the greedy test.)"""
    eos = min(tiny_tokenizer.eos_ids)
    answer = complete(url, temperature=0, allowed_token_ids=[eos])
    assert answer["finish_reason"] == "stop" and answer["text"] == ""


@pytest.mark.parametrize("body, fragment", [
    ({"allowed_token_ids": []}, "non-empty array"),
    ({"allowed_token_ids": [1, "a"]}, "non-empty array"),
    ({"allowed_token_ids": [1, -2]}, "non-empty array"),
    ({"allowed_token_ids": [1, 10**6]}, "outside the model's vocabulary"),
    ({"allowed_token_ids": [1], "response_format": {"type": "json_object"}}, "one constraint"),
])
def test_what_it_refuses(url, body, fragment):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    assert fragment in r.json()["error"]["message"]


def masks_of(tiny_tokenizer, words, answer) -> list[set[int]]:
    """The tokens each step of `answer` may not be, as the server's constraint for `words` has it."""
    from cadence.server.parsing import TokenRules, token_constraint

    bad = token_constraint(TokenRules(bad_words=tuple(words)), None, tiny_tokenizer, 512)
    masks = []
    for i in range(len(answer)):
        matcher, row = bad.matcher(), np.zeros(16, np.int32)
        assert all(matcher.accept(t) for t in answer[:i])
        matcher.fill(row)
        masks.append(set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little") == 0)))
    return masks


IS = 464  # the tiny vocabulary's " is", which the tiny model repeats


@pytest.mark.parametrize("words, pairs", [([" is"], [(IS,)]), (["is is"], [(IS, IS)])])
def test_greedy_never_ends_with_a_bad_word(url, tiny_tokenizer, tiny_params, tiny_config, words, pairs):
    """The tiny model repeats " is" (one token): as a bad word it never comes; as the two-token
    "is is" it never comes twice in a row. Each token is the likeliest the words leave (the
    reference's logits); the chat door takes them too."""
    prompt = tiny_tokenizer.encode(PROMPT)
    assert complete(url, temperature=0, allowed_token_ids=None)["token_ids"] == [IS] * 8
    answer = complete(url, temperature=0, allowed_token_ids=None, bad_words=words)["token_ids"]
    n = len(pairs[0])
    assert not any(tuple(answer[i:i + n]) in pairs for i in range(len(answer)))
    assert IS in answer or n == 1
    masks = masks_of(tiny_tokenizer, words, answer)
    logits = sequence_logits(tiny_params, tiny_config, prompt + answer)[len(prompt) - 1:]
    assert answer == [int(np.argmax(np.where(np.isin(np.arange(len(row)), list(mask)), -np.inf, row)))
                      for row, mask in zip(logits, masks)]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                      "max_tokens": 4, "temperature": 0, "bad_words": words}, timeout=60)
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("body, param, fragment", [
    ({"bad_words": ["ok", " "]}, "bad_words", "not blank"),
    ({"bad_words": ["x"] * 257}, "bad_words", "at most 256"),
    ({"bad_words": ["x" * 257]}, "bad_words", "at most 256 characters"),
    ({"bad_words": ["x"], "allowed_token_ids": [1]}, "bad_words", "one constraint"),
    ({"bad_words": ["x"], "response_format": {"type": "json_object"}}, "bad_words", "one constraint"),
])
def test_bad_words_it_refuses(url, body, param, fragment):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert fragment in r.json()["error"]["message"]


def test_speculative_decoding_sees_the_same_set():
    """A verify step's drafts are cut at the first token outside the set, and every position's
    mask is the set, as sampling without drafts would have it (bits in llguidance's layout)."""
    from cadence.scheduler.grammar import TokenSet

    tokens = TokenSet(frozenset({3, 40, 63}), 64)
    matcher = tokens.matcher()
    assert matcher.allows([3, 40, 5, 3]) == 2 and matcher.allows([]) == 0
    rows = np.zeros((3, 2), np.int32)
    assert matcher.draft_masks([3, 40], rows)
    bits = np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little")
    assert [set(np.flatnonzero(row)) for row in bits] == [{3, 40, 63}] * 3
    assert matcher.accept(63) and not matcher.accept(4) and not matcher.done


def test_bad_words_draft_as_they_sample():
    """Drafts are cut where a bad word would be completed, and each verify position's mask is
    the one sampling after the drafts before it would see."""
    from cadence.scheduler.grammar import BadWords

    matcher = BadWords(((7,), (3, 4, 5)), 64).matcher()
    assert matcher.allows([3, 4, 6, 3, 4, 5]) == 5 and matcher.allows([7]) == 0
    rows = np.zeros((4, 2), np.int32)
    assert matcher.draft_masks([3, 4, 9], rows)
    masked = [set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little") == 0)) for row in rows]
    assert masked == [{7}, {7}, {7, 5}, {7}]
    assert matcher.accept(3) and matcher.accept(4) and not matcher.accept(5) and not matcher.done
    for before in range(12):  # a longer answer, whose start the matcher lets go: its end still counts
        matcher = BadWords(((7,), (3, 4, 5)), 64).matcher()
        assert all(matcher.accept(t) for t in [1] * before + [3, 4]) and not matcher.accept(5)
