"""Anthropic's Messages API (`server/messages_api.py`) over loopback HTTP on the tiny model,
driven by the official anthropic SDK: the same answer as the equivalent chat, stream events the
SDK's accumulator reads, stop sequences, prefill, forced tool calls and tool results, structured
output, token counting, and errors in Anthropic's shape naming the field."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from cadence.server.messages_api import Blocks
from cadence.server.tool_call_parser import ToolCallParser
from tests.conftest import serve_tiny

MODEL = "tiny"
TIMEOUT = httpx.Timeout(120.0, connect=5.0)
# One integer property: the tool section and the schema fit the tiny model's context.
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
          "additionalProperties": False}
TOOL = {"name": "pt", "description": "A point.", "input_schema": SCHEMA}
# Greedy, and answers that run to max_tokens. (The SDK no longer sends sampling settings;
# cadence takes `temperature`, `top_p` and `top_k` as older clients send them.)
GREEDY = {"extra_body": {"temperature": 0}}
LONG = {"extra_body": {"temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer, MODEL) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def openai_client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat(openai_client, messages, **kwargs):
    return openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_message_is_the_equivalent_chat(client, openai_client):
    """At temperature 0 a message is the chat completion of the same conversation (the system
    prompt a first system turn, text blocks joined as chat joins parts): the same text, the
    same prompt tokens (those read from the prefix cache counted apart, as Anthropic does)."""
    answer = client.messages.create(model=MODEL, max_tokens=6,
                                    messages=[{"role": "user", "content": "Hello there"}], **LONG)
    expected = chat(openai_client, [{"role": "user", "content": "Hello there"}], max_tokens=6, **LONG)
    assert answer.id.startswith("msg_") and answer.type == "message" and answer.role == "assistant"
    assert answer.model == MODEL and text_of(answer) == expected.choices[0].message.content
    assert answer.stop_reason == "max_tokens" and answer.stop_sequence is None
    usage = answer.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected.usage.prompt_tokens
    assert usage.output_tokens == 6 and usage.cache_creation_input_tokens == 0

    turns = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there", "cache_control": {"type": "ephemeral"}}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
             {"role": "user", "content": "Again"}]
    answer = client.messages.create(model=MODEL, max_tokens=5, messages=turns,
                                    system=[{"type": "text", "text": "You are terse."}], **LONG)
    expected = chat(openai_client, [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": "Hi\nthere"},
                                    {"role": "assistant", "content": "Hello."},
                                    {"role": "user", "content": "Again"}], max_tokens=5, **LONG)
    assert text_of(answer) == expected.choices[0].message.content
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == expected.usage.prompt_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=turns, system="You are terse.")
    assert counted.input_tokens == expected.usage.prompt_tokens
    # Consecutive turns of a role are one turn, as Anthropic combines them.
    split = [{"role": "user", "content": "Hi"}, {"role": "user", "content": [{"type": "text", "text": "there"}]},
             turns[1], {"role": "assistant", "content": ""}, turns[2]]
    assert client.messages.count_tokens(model=MODEL, messages=split, system="You are terse.") == counted


def test_the_prompt_read_from_the_prefix_cache_is_cache_read_input_tokens(client):
    ask = dict(model=MODEL, max_tokens=2, **GREEDY,
               messages=[{"role": "user", "content": "A question asked twice, long enough to fill a page."}])
    first, again = client.messages.create(**ask), client.messages.create(**ask)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    assert again.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens


def test_max_tokens_is_a_cap_the_context_lowers(client, openai_client):
    """Claude Code asks for 32000 tokens whatever the model: past the context's end (the tiny
    model's 512) the answer stops there, model_context_window_exceeded, where a chat's
    max_tokens would be refused."""
    ask = dict(model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": "Go on"}], **LONG)
    answer = client.messages.create(**ask, timeout=120)  # (the SDK wants a stream or a timeout)
    prompt = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert answer.stop_reason == "model_context_window_exceeded" and prompt + answer.usage.output_tokens == 512
    with client.messages.stream(**ask) as stream:
        assert stream.get_final_message().stop_reason == "model_context_window_exceeded"
    with pytest.raises(openai.BadRequestError):
        chat(openai_client, ask["messages"], max_tokens=32000)


def test_streamed_events_build_the_same_message(client):
    kwargs = dict(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Tell me"}], **LONG)
    whole = client.messages.create(**kwargs)
    events = list(client.messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.id.startswith("msg_") and events[0].message.content == []
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == text_of(whole) and len(deltas) > 1
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6
    with client.messages.stream(**kwargs) as stream:  # the SDK's accumulator
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(whole)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_a_stop_sequence_ends_the_answer_and_is_named(client, url):
    # The tiny model's greedy chat answer is new lines: with them biased out, it writes words.
    newline, = httpx.post(f"{url}/tokenize", json={"prompt": "\n", "add_special_tokens": False}).json()["tokens"]
    kwargs = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Count"}],
                  extra_body={"temperature": 0, "ignore_eos": True, "logit_bias": {str(newline): -100}})
    text = text_of(client.messages.create(**kwargs))
    stop = text[3:5]
    assert stop.strip() and text.index(stop) > 0, text
    answer = client.messages.create(**kwargs, stop_sequences=["never-written", stop])
    assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == stop
    assert text_of(answer) == text[:text.index(stop)]
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_a_final_assistant_turn_is_continued(client, openai_client):
    """Anthropic's prefill: the answer continues the last assistant turn, and holds only what
    follows it, as chat's continue_final_message does."""
    turns = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    answer = client.messages.create(model=MODEL, max_tokens=4, messages=turns, **LONG)
    expected = chat(openai_client, turns, max_tokens=4, extra_body={"ignore_eos": True,
                                                                    "continue_final_message": True})
    assert text_of(answer) == expected.choices[0].message.content
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == expected.usage.prompt_tokens


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "pt"}])
def test_a_forced_tool_gives_a_tool_use_block_whole_and_streamed(client, choice):
    kwargs = dict(model=MODEL, max_tokens=80, tools=[TOOL], tool_choice=choice,
                  messages=[{"role": "user", "content": "Go"}], **GREEDY)
    answer = client.messages.create(**kwargs)
    assert answer.stop_reason == "tool_use", answer.content
    (call,) = [block for block in answer.content if block.type == "tool_use"]
    assert call.name == "pt" and isinstance(call.input["x"], int) and call.id
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    (streamed,) = [block for block in final.content if block.type == "tool_use"]
    assert streamed.input == call.input and final.stop_reason == "tool_use"
    raw = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(e.delta.partial_json for e in raw)) == call.input


def test_tool_use_and_tool_result_blocks_are_the_chats_calls_and_results(client, url):
    """A call the assistant made and the user's result are chat's assistant tool_calls and tool
    turn: the same prompt (counted by count_tokens and by /tokenize), holding the result."""
    turns = [{"role": "user", "content": "Where?"},
             {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                               {"type": "tool_use", "id": "toolu_1", "name": "pt", "input": {"x": 1}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": [{"type": "text", "text": "RESULT-42"}]}]}]
    chat_turns = [{"role": "user", "content": "Where?"},
                  {"role": "assistant", "content": "Looking.", "tool_calls": [
                      {"id": "toolu_1", "type": "function", "function": {"name": "pt", "arguments": '{"x": 1}'}}]},
                  {"role": "tool", "tool_call_id": "toolu_1", "content": "RESULT-42"}]
    tokens = httpx.post(f"{url}/tokenize", json={"messages": chat_turns, "return_token_strs": True},
                        timeout=TIMEOUT).json()
    assert "RESULT-42" in "".join(tokens["token_strs"])
    assert client.messages.count_tokens(model=MODEL, messages=turns).input_tokens == tokens["count"]
    answer = client.messages.create(model=MODEL, max_tokens=2, messages=turns, **GREEDY)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == tokens["count"]


def test_an_output_format_constrains_the_text_to_its_schema(client):
    answer = client.messages.create(model=MODEL, max_tokens=60, **GREEDY,
                                    messages=[{"role": "user", "content": "A point."}],
                                    output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert answer.stop_reason == "end_turn", answer.content
    assert isinstance(json.loads(text_of(answer))["x"], int)


def test_the_key_goes_as_x_api_key_or_as_a_bearer_token(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer, MODEL, api_key="sekret") as base:
        ask = dict(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}])
        assert anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0).messages.create(**ask)
        assert anthropic.Anthropic(base_url=base, auth_token="sekret", max_retries=0).messages.create(**ask)
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(**ask)
        assert refused.value.body["error"]["type"] == "authentication_error"
        # (the OpenAI routes take the x-api-key too)
        assert httpx.get(f"{base}/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


@pytest.mark.parametrize("body, words", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": None}, "max_tokens"),
    ({"model": None}, "model"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "system"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]}, "redacted"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "pt", "input": {}}]}]}, "tool_result"),
    ({"system": [{"type": "text"}]}, "text"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tools": [{"name": "pt"}]}, "input_schema"),
    ({"tools": [{**TOOL, "cache_control": False}]}, "tools[0].cache_control"),
    ({"tools": [{**TOOL, "eager_input_streaming": "yes"}]}, "tools[0].eager_input_streaming"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "name"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}]}, "mcp_servers"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"temperature": -1}, "temperature"),
])
def test_bad_requests_are_400s_in_anthropics_shape(url, body, words):
    request = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **body}
    response = httpx.post(f"{url}/v1/messages", json={k: v for k, v in request.items() if v is not None},
                          timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_errors_reach_the_sdk_as_its_own(client):
    ask = dict(max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-sonnet-4-5", **ask)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, **ask, extra_body={"top_k": -5})
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [{"type": "document"}]}])


def test_harmless_fields_are_accepted(client):
    answer = client.messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}],
        metadata={"user_id": "u"}, service_tier="auto", thinking={"type": "disabled"},
        diagnostics={"previous_message_id": None}, speed="standard",
        tools=[{**TOOL, "cache_control": {"type": "ephemeral"}}], tool_choice={"type": "auto"},
        extra_body={"seed": 3, "min_p": 0.1, "temperature": 0.5, "top_p": 0.9, "top_k": 5},
        extra_headers={"anthropic-beta": "x"})
    assert answer.usage.output_tokens <= 1
    # Claude Code asks at /v1/messages?beta=true, with its beta headers.
    beta = httpx.post(f"{client.base_url}/v1/messages?beta=true", headers={"anthropic-beta": "x"}, timeout=TIMEOUT,
                      json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    assert beta.status_code == 200 and beta.json()["type"] == "message"


# -- the blocks, without a server ---------------------------------------------------------------

CALL = '<tool_call>\n{"name": "pt", "arguments": {"x": 7}}\n</tool_call>'


@pytest.mark.parametrize("text, want", [
    (f"Sure.{CALL}", [{"type": "text", "text": "Sure."},
                      {"type": "tool_use", "name": "pt", "input": {"x": 7}}]),
    ('Broken <tool_call>\n{"name": "pt", "arguments": {"x": 7',  # never closes: no call
     [{"type": "text", "text": 'Broken <tool_call>\n{"name": "pt", "arguments": {"x": 7'}]),
])
def test_a_tool_use_block_goes_out_once_the_call_stands(text, want):
    """Fed a character at a time or whole, the same blocks and events: a call's block only once
    it stands, so a candidate that turns out no call is sent once, as text."""
    results = []
    for pieces in (list(text), [text]):
        blocks = Blocks(ToolCallParser({"pt"}))
        for piece in pieces:
            blocks.feed(piece)
        blocks.finish()
        merged = []  # the stream's events put together
        for kind, fields in blocks.events:
            if kind == "content_block_start":
                merged.append({**fields["content_block"]})
            elif kind == "content_block_delta":
                delta = fields["delta"]
                key = "partial_json" if delta["type"] == "input_json_delta" else "text"
                merged[fields["index"]][key] = merged[fields["index"]].get(key, "") + delta[key]
        for block in merged:
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("partial_json"))
        assert merged == blocks.blocks
        results.append([{k: v for k, v in b.items() if k != "id"} for b in blocks.blocks])
    assert results[0] == results[1] == want
