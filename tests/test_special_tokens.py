"""vLLM's fields over a prompt's and an answer's special tokens, on the tiny model:
`skip_special_tokens`, `spaces_between_special_tokens`, `add_special_tokens`, and a chat's
`documents` for a retrieval-augmented template."""

from __future__ import annotations

import json

import httpx
import pytest

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.reference import greedy_generate
from tests.conftest import serve_tiny, tiny_tokenizer_fields

PROMPT = "The capital of France is"
IM_START = 1  # the tiny vocabulary's <|im_start|>: a control token, neither BOS-only nor an end
# The tiny template with the documents first, as Granite's and Command R's templates show them,
# and a prompt that does not begin with the BOS (<|im_start|>).
TEMPLATE = ("{% for d in documents or [] %}<doc>{{ d.title }}: {{ d.text }}</doc>\n{% endfor %}"
            "Conversation:\n{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_config) -> Tokenizer:
    """The tiny tokenizer asking for its BOS (<|im_start|>) before every prompt, with TEMPLATE."""
    return Tokenizer.from_gguf_fields({**tiny_tokenizer_fields(tiny_config), "tokenizer.ggml.add_bos_token": True,
                                       "tokenizer.chat_template": TEMPLATE})


@pytest.fixture(scope="module")
def url(tiny_engine, tokenizer):
    with serve_tiny(tiny_engine, tokenizer) as base:
        yield base


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_text(url: str, body: dict) -> str:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_skip_special_tokens_false_shows_the_special_tokens_written(url, tokenizer):
    """A control token the answer writes (forced by a bias) is left out of its text, as vLLM
    leaves it, unless `skip_special_tokens` is false: then it is spelled, whole and streamed,
    and a stop string can end the answer inside it. `spaces_between_special_tokens` is taken
    and changes nothing."""
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {str(IM_START): 100},
            "return_token_ids": True}
    skipped = post(url, "/v1/completions", body)["choices"][0]
    assert skipped["token_ids"] == [IM_START] * 3 and skipped["text"] == ""
    shown = {**body, "skip_special_tokens": False}
    assert post(url, "/v1/completions", shown)["choices"][0]["text"] == "<|im_start|>" * 3
    assert streamed_text(url, shown) == "<|im_start|>" * 3
    spaced = post(url, "/v1/completions", {**shown, "spaces_between_special_tokens": False})
    assert spaced["choices"][0]["text"] == "<|im_start|>" * 3
    stopped = post(url, "/v1/completions", {**shown, "stop": ["start|><|im"]})["choices"][0]
    assert (stopped["text"], stopped["finish_reason"]) == ("<|im_", "stop")
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2, "temperature": 0, "skip_special_tokens": False,
                                               "logit_bias": {str(IM_START): 100}})
    assert chat["choices"][0]["message"]["content"] == "<|im_start|>" * 2


def test_add_special_tokens_false_leaves_the_bos_out(url, tokenizer, tiny_params, tiny_config):
    """The tokenizer asks for a BOS: a completion's prompt gets it, unless `add_special_tokens`
    is false (vLLM's): the prompt is counted without it, and the answer is the reference's
    continuation of the prompt without it. True changes nothing (a BOS is never added twice).
    Beside a suffix, whose layout places its own, it is refused by name."""
    def usage_and_ids(**fields):
        out = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                            "return_token_ids": True, **fields})
        return out["usage"]["prompt_tokens"], out["choices"][0]["token_ids"]

    plain = tokenizer.encode(PROMPT, add_bos=False)
    assert tokenizer.encode(PROMPT) == [tokenizer.bos_id, *plain]
    assert usage_and_ids() == usage_and_ids(add_special_tokens=True)
    assert usage_and_ids()[0] == len(plain) + 1
    count, ids = usage_and_ids(add_special_tokens=False)
    assert count == len(plain)
    assert ids == greedy_generate(tiny_params, tiny_config, plain, 6, frozenset())
    messages = [{"role": "user", "content": "hi"}]
    for add in (True, False):  # a chat's prompt too, as /tokenize counts it
        chat = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "add_special_tokens": add})
        count = post(url, "/tokenize", {"messages": messages, "add_special_tokens": add})["count"]
        assert chat["usage"]["prompt_tokens"] == count == len(tokenizer.encode(
            tokenizer.apply_chat_template(messages), add_bos=None if add else False))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "suffix": "b", "add_special_tokens": False},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"


def test_documents_reach_the_chat_template(url, tokenizer):
    """A chat's `documents` (vLLM's) are the template's `documents`, in the prompt a chat is
    answered from; given twice, or not as objects of strings, they are refused by name."""
    messages = [{"role": "user", "content": "What is the capital?"}]
    docs = [{"title": "France", "text": "Paris is its capital."}, {"title": "Spain", "text": "Madrid."}]
    prompt = tokenizer.apply_chat_template(messages, variables={"documents": docs})
    assert prompt.startswith("<doc>France: Paris is its capital.</doc>\n<doc>Spain: Madrid.</doc>\n")
    applied = post(url, "/apply-template", {"messages": messages, "documents": docs})
    assert applied["prompt"] == prompt
    tokens = post(url, "/tokenize", {"messages": messages, "documents": docs})
    chat = post(url, "/v1/chat/completions", {"messages": messages, "documents": docs, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == tokens["count"] == len(tokenizer.encode(prompt))
    for body in ({"documents": [{"title": 1}]}, {"documents": docs, "chat_template_kwargs": {"documents": []}}):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **body},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
