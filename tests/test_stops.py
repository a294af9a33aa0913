"""A request's own stops (vLLM's `stop_token_ids` and `include_stop_str_in_output`) and the
`stop_reason` that names what ended an answer, on the tiny model against the reference."""

from __future__ import annotations

import json

import httpx
import pytest

from cadence.engine.reference import greedy_generate
from tests.conftest import serve_tiny

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer) as base:
        yield base


@pytest.fixture(scope="module")
def greedy(tiny_params, tiny_config, tiny_tokenizer):
    """The reference's greedy answer to PROMPT, 16 tokens past any EOS."""
    return greedy_generate(tiny_params, tiny_config, tiny_tokenizer.encode(PROMPT), 16, frozenset())


def complete(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                                  "ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_stop_token_id_ends_the_answer(url, tiny_tokenizer):
    """Sampled (a seeded request draws the same tokens wherever it stops): the answer with a
    stop id is the free answer up to and with that token, whose text is left out unless
    asked for (vLLM's rule)."""
    sampled = {"temperature": 8.0, "seed": 3, "logprobs": 0, "return_tokens_as_token_ids": True}
    free = [int(t[len("token_id:"):]) for t in complete(url, **sampled)["choices"][0]["logprobs"]["tokens"]]
    k = next(i for i, t in enumerate(free) if i >= 2 and not tiny_tokenizer.is_special(t) and t not in free[:i])
    unused = next(t for t in range(3, 512) if t not in free[:k + 1])  # a second id, never written
    r = complete(url, stop_token_ids=[unused, free[k]], **sampled)
    choice = r["choices"][0]
    assert [int(t[len("token_id:"):]) for t in choice["logprobs"]["tokens"]] == free[:k + 1]
    assert choice["text"] == tiny_tokenizer.decode(free[:k])  # the stop id's text is left out
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == free[k]
    kept = complete(url, stop_token_ids=[free[k]], include_stop_str_in_output=True, **sampled)
    assert kept["choices"][0]["text"] == tiny_tokenizer.decode(free[:k + 1])  # unless asked for
    with httpx.stream("POST", f"{url}/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stop_token_ids": [free[k]],
            "include_stop_str_in_output": True, "stream": True, **sampled}, timeout=60) as s:
        chunks = [json.loads(l[6:]) for l in s.iter_lines() if l.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == kept["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["stop_reason"] == free[k]


def test_a_special_stop_token_is_not_shown(url, tiny_tokenizer):
    special = tiny_tokenizer.token_id("<|im_start|>")
    assert tiny_tokenizer.is_special(special) and special not in tiny_tokenizer.eos_ids
    # Biased to come first, it ends the answer at once, and shows nothing, even when asked.
    r = complete(url, stop_token_ids=[special], logit_bias={str(special): 100},
                 include_stop_str_in_output=True)
    choice = r["choices"][0]
    assert choice["text"] == "" and choice["stop_reason"] == special
    assert r["usage"]["completion_tokens"] == 1


def test_the_stop_string_can_stay(url, tiny_tokenizer, greedy):
    full = tiny_tokenizer.decode(greedy)
    word = full[5:8]
    cut = full.index(word)
    assert word.strip() and cut > 0
    without = complete(url, stop=[word])["choices"][0]
    kept = complete(url, stop=[word], include_stop_str_in_output=True)["choices"][0]
    assert without["text"] == full[:cut] and kept["text"] == full[:cut + len(word)]
    assert without["stop_reason"] == kept["stop_reason"] == word


@pytest.mark.parametrize("ids, fragment", [([512], "[0, 512)"), (["5"], "token ids"),
                                            (list(range(17)), "at most 16"), ([True], "token ids")])
def test_bad_stop_token_ids_are_400(url, ids, fragment):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "stop_token_ids": ids}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    assert fragment in r.json()["error"]["message"]
