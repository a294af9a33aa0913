"""How a chat's prompt ends (vLLM's `add_generation_prompt` and `continue_final_message`): a new
assistant turn, none, or the final assistant message continued (an answer begun for the model)."""

from __future__ import annotations

import httpx
import pytest

from cadence.checkpoints.chat import CONTINUE_MARK, continue_final
from cadence.checkpoints.errors import TokenizerError
from cadence.engine.reference import greedy_generate
from cadence.server import parsing
from tests.conftest import serve_tiny

BEGUN = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer) as base:
        yield base


def test_the_cut_is_where_the_final_text_ends():
    assert continue_final(f"<u>hi</u><a>It is{CONTINUE_MARK}</a>") == "<u>hi</u><a>It is"
    with pytest.raises(TokenizerError, match="cannot be continued"):
        continue_final("<a>[redacted]</a>")  # a template that rewrote the message
    with pytest.raises(TokenizerError, match="cannot be continued"):
        continue_final(f"<a>{CONTINUE_MARK}</a><b>{CONTINUE_MARK}</b>")


@pytest.mark.parametrize("begun", [">", "end", "<", "im_end", "assistant", "My favourite is "])
def test_text_the_template_also_writes_is_cut_after_the_message(tiny_tokenizer, begun):
    """A begun answer that the template's own text repeats after it ("end", "<"): the prompt
    still ends right after the message, its trailing space kept."""
    chat = [BEGUN[0], {"role": "assistant", "content": begun}]
    closed = parsing.render_chat(chat, tiny_tokenizer, end=parsing.ChatEnd(False, False))
    assert parsing.render_chat(chat, tiny_tokenizer, end=parsing.ChatEnd(False, True)) \
        == closed.removesuffix("<|im_end|>\n")


def test_the_prompt_ends_inside_the_final_message(tiny_tokenizer):
    full = parsing.render_chat(BEGUN, tiny_tokenizer, end=parsing.ChatEnd(False, False))
    begun = parsing.render_chat(BEGUN, tiny_tokenizer, end=parsing.ChatEnd(False, True))
    assert full.startswith(begun) and begun.endswith("My favourite is")
    assert full[len(begun):] == "<|im_end|>\n"
    turn = parsing.render_chat(BEGUN, tiny_tokenizer)
    assert turn == full + "<|im_start|>assistant\n"


def test_a_continued_answer_is_the_reference_continuation(url, tiny_tokenizer, tiny_params, tiny_config):
    ids = tiny_tokenizer.encode(parsing.render_chat(BEGUN, tiny_tokenizer, end=parsing.ChatEnd(False, True)))
    want = tiny_tokenizer.decode(greedy_generate(tiny_params, tiny_config, ids, 10, tiny_tokenizer.eos_ids),
                                 skip_special=True)
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": BEGUN, "continue_final_message": True, "max_tokens": 10, "temperature": 0}, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["choices"][0]["message"]["content"] == want
    tokens = httpx.post(f"{url}/tokenize", json={"messages": BEGUN, "continue_final_message": True},
                        timeout=60).json()["tokens"]
    assert tokens == ids
    # add_generation_prompt: false alone renders the conversation closed, without a new turn.
    closed = httpx.post(f"{url}/tokenize", json={"messages": BEGUN, "add_generation_prompt": False},
                        timeout=60).json()["tokens"]
    assert closed == tiny_tokenizer.encode(parsing.render_chat(BEGUN, tiny_tokenizer, end=parsing.ChatEnd(False)))
    assert closed != tokens


@pytest.mark.parametrize("body, param, fragment", [
    ({"messages": BEGUN, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "cannot go with"),
    ({"messages": BEGUN[:1], "continue_final_message": True}, "continue_final_message", "final assistant message"),
    ({"messages": [*BEGUN[:1], {"role": "assistant", "content": ""}], "continue_final_message": True},
     "continue_final_message", "with text"),
    ({"messages": BEGUN, "continue_final_message": 1}, "continue_final_message", "true or false"),
])
def test_contradictions_are_400(url, body, param, fragment):
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"]


def test_a_completion_has_no_chat_end(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "continue_final_message": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_sglang_routers_neutral_value_still_passes_on_completions(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                  "continue_final_message": False}, timeout=60)
    assert r.status_code == 200, r.text


def test_tokenize_takes_them_with_messages_only(url):
    r = httpx.post(f"{url}/tokenize", json={"prompt": "x", "continue_final_message": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_a_developer_turn_is_a_system_turn(tiny_tokenizer):
    """OpenAI's "developer" role (the instructions, as its newer models name them) renders as
    the template's system turn, not as a role the model never saw."""
    said = [{"role": "user", "content": "Hi"}]
    system = parsing.render_chat([{"role": "system", "content": "Be brief."}, *said], tiny_tokenizer)
    assert parsing.render_chat([{"role": "developer", "content": "Be brief."}, *said], tiny_tokenizer) == system
    assert "developer" not in system and "Be brief." in system
