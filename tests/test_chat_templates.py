"""A request's own chat template (vLLM's `chat_template`): rendered in place of the model's
where the server trusts them (--trust_request_chat_template), a 400 where it does not."""

from __future__ import annotations

import httpx
import pytest

from cadence.checkpoints.chat import render_chat
from cadence.engine.reference import greedy_generate
from tests.conftest import serve_tiny

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHAT = [{"role": "user", "content": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def trusting(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer, trust_request_chat_template=True) as base:
        yield base


@pytest.fixture(scope="module")
def wary(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer) as base:
        yield base


def test_a_trusting_server_renders_the_requests_template(trusting, tiny_tokenizer, tiny_params, tiny_config):
    text = render_chat(TEMPLATE, CHAT)
    assert text == "<user> the cat sat on the mat <assistant>"
    ids = tiny_tokenizer.encode(text)
    want = greedy_generate(tiny_params, tiny_config, ids, 8, tiny_tokenizer.eos_ids)
    r = httpx.post(f"{trusting}/v1/chat/completions", json={
        "messages": CHAT, "chat_template": TEMPLATE, "max_tokens": 8, "temperature": 0}, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["choices"][0]["message"]["content"] == tiny_tokenizer.decode(want, skip_special=True)
    tokens = httpx.post(f"{trusting}/tokenize", json={"messages": CHAT, "chat_template": TEMPLATE},
                        timeout=60).json()["tokens"]
    assert tokens == ids
    # The server's own template still serves everyone else.
    plain = httpx.post(f"{trusting}/tokenize", json={"messages": CHAT}, timeout=60).json()["tokens"]
    assert plain == tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(CHAT)) != ids


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{% for %}"}, "does not parse"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": 3}, "string"),
    ("/tokenize", {"prompt": "x", "chat_template": TEMPLATE}, 'goes with "messages"'),
    ("/v1/completions", {"prompt": "x", "chat_template": TEMPLATE}, "unrecognized"),
])
def test_bad_templates_are_400(trusting, path, body, fragment):
    r = httpx.post(f"{trusting}{path}", json={**body, "max_tokens": 2}
                   if path != "/tokenize" else body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template" and fragment in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("template", [TEMPLATE, "{% for %}"], ids=["template", "unparsed"])
def test_a_server_that_does_not_trust_them_refuses(wary, path, template):
    """Refused before the template is even parsed."""
    r = httpx.post(f"{wary}{path}", json={"messages": CHAT, "chat_template": template}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust_request_chat_template" in r.json()["error"]["message"]
