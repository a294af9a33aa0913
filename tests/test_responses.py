"""OpenAI's Responses API (`server/responses_api.py`) over loopback HTTP on the tiny model,
driven by the official SDK: the same answer as the equivalent chat, typed stream events that
the SDK's accumulator reads, structured output, forced function calls, tool results in the
input, stored responses chained by previous_response_id, and 400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from openai.types.responses import Response, ResponseStreamEvent

from cadence.scheduler.request import TokenLogprob
from cadence.server.protocol import LogprobFormat
from cadence.server.reasoning import ReasoningParser
from cadence.server.responses_api import Output
from cadence.server.responses_request import LOGPROBS
from cadence.server.tool_requests import HERMES, CallStyle
from tests.conftest import serve_tiny

MODEL = "tiny"
TIMEOUT = httpx.Timeout(120.0, connect=5.0)
EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
# One integer property: cadence's tool section and the schema fit the tiny model's context.
TOOL = {"type": "function", "name": "pt", "strict": True,
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                       "additionalProperties": False}}


class Pt(pydantic.BaseModel):
    x: int


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer, MODEL) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def test_string_and_message_input_answer_as_the_equivalent_chat(client):
    """At temperature 0 a response is the chat completion of the same conversation: same
    prompt tokens, same text; cut off by max_output_tokens it is "incomplete"."""
    limits = dict(extra_body={"ignore_eos": True})
    answer = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=6,
                                     temperature=0, **limits)
    expected = chat(client, [{"role": "user", "content": "Hello there"}], max_tokens=6, **limits)
    raw = httpx.post(f"{client.base_url}responses", json={"model": MODEL, "input": "Hello there",
                                                          "max_output_tokens": 1}, timeout=TIMEOUT)
    Response.model_validate(raw.json(), strict=True)  # every field OpenAI's Response requires
    assert answer.id.startswith("resp_") and answer.object == "response" and answer.model == MODEL
    assert answer.output_text == expected.choices[0].message.content
    assert answer.usage.input_tokens == expected.usage.prompt_tokens
    assert answer.usage.output_tokens == 6 and answer.usage.total_tokens == answer.usage.input_tokens + 6
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    (message,) = answer.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert answer.max_output_tokens == 6 and answer.temperature == 0 and answer.truncation == "disabled"

    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                             {"type": "input_text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "Again"}]
    answer = client.responses.create(model=MODEL, instructions="You are terse.", input=items,
                                     max_output_tokens=5, temperature=0, **limits)
    expected = chat(client, [{"role": "system", "content": "You are terse."},
                             {"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi\nthere"},
                             {"role": "assistant", "content": "Hello."},
                             {"role": "user", "content": "Again"}], max_tokens=5, **limits)
    assert answer.output_text == expected.choices[0].message.content
    assert answer.usage.input_tokens == expected.usage.prompt_tokens
    assert answer.instructions == "You are terse."


def test_streamed_events_build_the_same_answer(client):
    kwargs = dict(model=MODEL, input="Tell me", max_output_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True}, store=False)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    for event in events:  # every field OpenAI's event types require, strictly
        EVENT.validate_python(event.model_dump(mode="json", exclude_unset=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    assert all(e.item_id == deltas[0].item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == "incomplete"
    assert final.usage.output_tokens == 6 and final.id == events[0].response.id


def test_logprobs_are_the_chats_and_go_with_their_text(client):
    """`include` "message.output_text.logprobs" with `top_logprobs`: the output_text's logprobs
    are the equivalent chat's, token for token, and spell its text; streamed, each text delta
    carries the logprobs of the tokens that wrote it. `top_logprobs` alone asks for them too;
    neither, for none."""
    limits = dict(extra_body={"ignore_eos": True}, store=False)
    kwargs = dict(model=MODEL, input="Hello there", max_output_tokens=6, temperature=0,
                  include=[LOGPROBS], top_logprobs=3, **limits)
    body = {"model": MODEL, "input": "Hello there", "max_output_tokens": 2, "include": [LOGPROBS]}
    raw = httpx.post(f"{client.base_url}responses", json=body, timeout=TIMEOUT)
    Response.model_validate(raw.json(), strict=True)  # every field OpenAI's Response requires
    answer = client.responses.create(**kwargs)
    expected = chat(client, [{"role": "user", "content": "Hello there"}], max_tokens=6, logprobs=True,
                    top_logprobs=3, extra_body={"ignore_eos": True})
    want = [e.model_dump() for e in expected.choices[0].logprobs.content]
    part = answer.output[0].content[0]
    assert [e.model_dump() for e in part.logprobs] == want and len(want) == 6
    assert all(len(e["top_logprobs"]) == 3 for e in want)
    assert "".join(e.token for e in part.logprobs) == part.text and answer.top_logprobs == 3

    events = list(client.responses.create(**kwargs, stream=True))
    for event in events:
        EVENT.validate_python(event.model_dump(mode="json", exclude_unset=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all("".join(lp.token for lp in e.logprobs) == e.delta for e in deltas)
    assert [lp.token for e in deltas for lp in e.logprobs] == [e["token"] for e in want]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [e.model_dump() for e in done.logprobs] == want
    assert events[-1].response.output[0].content[0].logprobs == part.logprobs

    alone = client.responses.create(**{**kwargs, "include": None, "top_logprobs": 2})
    assert [[t.token for t in e.top_logprobs] for e in alone.output[0].content[0].logprobs] == \
        [[t["token"] for t in e["top_logprobs"][:2]] for e in want]
    plain = client.responses.create(**{**kwargs, "include": None, "top_logprobs": None})
    assert plain.output_text == answer.output_text and plain.output[0].content[0].logprobs == []


def test_logprobs_leave_out_the_tokens_of_reasoning_and_calls(tiny_tokenizer):
    """A token whose text went to the reasoning (through the one that closed it) or to a call
    has no logprob in the message; one whose text the parser held back goes out with the text
    when it comes."""
    def fed(output: Output, texts: list[str]) -> Output:
        output.format = LogprobFormat(tiny_tokenizer, chat=True)
        for i, text in enumerate(texts):
            output.feed(text, [TokenLogprob(i + 1, -0.5, text, ())])
        output.finish("completed")
        return output

    def tokens(output: Output) -> list[list[str]]:
        return [[e["token"] for e in item["content"][0]["logprobs"]]
                for item in output.output if item["type"] == "message"]

    thought = fed(Output(None, ReasoningParser(False)), ["<think>", "hmm", "</think>", "\n\nHi", " there"])
    assert thought.reasoning == "hmm" and thought.text == "Hi there"
    assert tokens(thought) == [["\n\nHi", " there"]]
    both = fed(Output(None, ReasoningParser(False)), ["<think>", "hmm</think>Hi", " there"])
    assert both.text == "Hi there" and tokens(both) == [["hmm</think>Hi", " there"]]

    call = ['<tool_call>', '{"name": "pt", ', '"arguments": {"x": 1}}', '</tool_call>']
    called = fed(Output(CallStyle(HERMES).parser({"pt"})), ["Sure", ".", *call, " Done", "", "!"])
    assert [item["type"] for item in called.output] == ["message", "function_call", "message"]
    assert tokens(called) == [["Sure", "."], [" Done", "", "!"]]
    # a last token of no text (bytes of a character the answer ended inside) is the message's
    assert tokens(fed(Output(None), ["Hi", ""])) == [["Hi", ""]]


def test_json_schema_format_parses_and_streams(client):
    """`text_format` (text.format json_schema, strict) through the SDK's parse and its stream
    helper: the answer validates, and the helper's final response is the whole one."""
    kwargs = dict(model=MODEL, input="A point.", text_format=Pt, max_output_tokens=60, temperature=0)
    whole = client.responses.parse(**kwargs)
    assert whole.status == "completed", whole.output_text
    assert isinstance(whole.output_parsed, Pt)
    assert whole.text.format.type == "json_schema" and whole.text.format.name == "Pt"
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    assert final.output_text == whole.output_text and final.output_parsed == whole.output_parsed

    answer = client.responses.create(model=MODEL, input="Any JSON.", text={"format": {"type": "json_object"}},
                                     max_output_tokens=60, temperature=0)
    if answer.status == "completed":
        json.loads(answer.output_text)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_function_tool_returns_function_call_items(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "name": "pt"}
    kwargs = dict(model=MODEL, input="Go", tools=[TOOL], tool_choice=tool_choice,
                  parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    answer = client.responses.create(**kwargs)
    assert answer.status == "completed", answer.output
    (call,) = answer.output
    assert call.type == "function_call" and call.name == "pt" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    Pt.model_validate_json(call.arguments)
    assert answer.tools[0].name == "pt" and answer.parallel_tool_calls is False
    if choice == "required":
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_response()
        (streamed,) = final.output
        assert streamed.arguments == call.arguments and streamed.call_id != call.call_id
        assert streamed.parsed_arguments == json.loads(call.arguments)  # (strict: the SDK parses)
        kinds = [e.type for e in events]
        assert kinds[2] == "response.output_item.added" and "response.function_call_arguments.delta" in kinds
        assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]
        assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") \
            == call.arguments


def test_function_call_and_its_output_in_the_input_are_rendered(client, url):
    """A call and its result given back as input items are the chat's assistant tool_calls and
    tool turn: the same prompt, holding the result."""
    items = [{"role": "user", "content": "Where?"},
             {"type": "function_call", "call_id": "call_1", "name": "pt", "arguments": '{"x": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "RESULT-42"}]
    answer = client.responses.create(model=MODEL, input=items, max_output_tokens=2, temperature=0,
                                     store=False)  # (no tools: their section would fill the context)
    messages = [{"role": "user", "content": "Where?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "pt", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "RESULT-42"}]
    tokens = httpx.post(f"{url}/tokenize", json={"messages": messages, "return_token_strs": True}, timeout=TIMEOUT).json()
    assert "RESULT-42" in "".join(tokens["token_strs"])
    assert answer.usage.input_tokens == tokens["count"]


def test_previous_response_id_chains_stored_responses(client):
    first = client.responses.create(model=MODEL, input="One", max_output_tokens=3, temperature=0)
    second = client.responses.create(model=MODEL, input="Two", max_output_tokens=3, temperature=0,
                                     previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert refused.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="One", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_stored_responses_input_items_are_listed_and_it_can_be_deleted(client, url):
    """GET /v1/responses/{id}/input_items lists the request's own input, newest first unless
    asked, a page at a time; DELETE forgets the response, which nothing can name after."""
    given = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": "Hello.", "id": "msg_mine"}, {"role": "user", "content": "Again"}]
    first = client.responses.create(model=MODEL, input=given, max_output_tokens=2, temperature=0)
    newest = client.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].text) for i in newest.data] == [
        ("message", "user", "Again"), ("message", "assistant", "Hello."), ("message", "user", "Hi"),
        ("message", "developer", "Be brief.")]
    assert newest.data[1].id == "msg_mine" and newest.data[1].content[0].type == "output_text"
    assert all(i.id.startswith("msg_") and i.status == "completed" for i in newest.data)
    assert not newest.has_more and newest.first_id == newest.data[0].id
    pages = list(client.responses.input_items.list(first.id, order="asc", limit=3).iter_pages())
    assert [len(p.data) for p in pages] == [3, 1] and pages[0].has_more and not pages[1].has_more
    assert [i.id for p in pages for i in p.data] == [i.id for i in reversed(newest.data)]
    second = client.responses.create(model=MODEL, input="Two", max_output_tokens=2, previous_response_id=first.id)
    (only,) = client.responses.input_items.list(second.id).data
    assert (only.role, only.content[0].type, only.content[0].text) == ("user", "input_text", "Two")
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_nope", "after")):
        refused = httpx.get(f"{url}/v1/responses/{first.id}/input_items?{query}", timeout=TIMEOUT)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param

    deleted = httpx.delete(f"{url}/v1/responses/{first.id}", timeout=TIMEOUT)
    assert deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    for gone in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.input_items.list(first.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert client.responses.retrieve(second.id).id == second.id


def test_a_conversation_holds_the_turns_a_response_answers_after_and_adds_to(client, url):
    """The Conversations API: a conversation's items are the turns before a response's input
    (its answer is the chat's over them), and the response's input and output join them; items
    are listed, added, read and deleted; a conversation is read, updated and deleted. It cannot
    go with previous_response_id; an unknown one is a 404."""
    conv = client.conversations.create(items=[{"role": "user", "content": "My name is Ann."},
                                              {"role": "assistant", "content": "Hello Ann."}],
                                       metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    answer = client.responses.create(model=MODEL, input="What is my name?", conversation=conv.id,
                                     max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    expected = chat(client, [{"role": "user", "content": "My name is Ann."},
                             {"role": "assistant", "content": "Hello Ann."},
                             {"role": "user", "content": "What is my name?"}], max_tokens=4,
                    extra_body={"ignore_eos": True})
    assert answer.output_text == expected.choices[0].message.content and answer.conversation.id == conv.id
    assert answer.usage.input_tokens == expected.usage.prompt_tokens
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "My name is Ann."), ("assistant", "Hello Ann."), ("user", "What is my name?"),
        ("assistant", answer.output_text)]
    assert items[-1].id == answer.output[0].id
    added = client.conversations.items.create(conv.id, items=[{"role": "user", "content": "Thanks."}])
    assert [i.content[0].text for i in added.data] == ["Thanks."]
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).id == added.data[0].id
    client.conversations.items.delete(items[0].id, conversation_id=conv.id)
    assert len(client.conversations.items.list(conv.id).data) == 4
    assert client.conversations.update(conv.id, metadata={"topic": "other"}).metadata == {"topic": "other"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "other"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="x", conversation=conv.id, previous_response_id=answer.id)
    assert refused.value.body["param"] == "conversation"
    bad = httpx.post(f"{url}/v1/conversations", json={"items": [{"type": "item_reference", "id": "x"}]},
                     timeout=TIMEOUT)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "items"
    assert client.conversations.delete(conv.id).deleted
    for gone in (lambda: client.conversations.retrieve(conv.id),
                 lambda: client.responses.create(model=MODEL, input="x", conversation=conv.id)):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_the_conversation_store_keeps_the_most_recently_used_within_its_bounds():
    """Past its count or its characters, the least recently used conversations go first (never
    the last one left); items removed give their characters back."""
    from cadence.server.api_error import APIError
    from cadence.server.conversations_api import ConversationStore

    item = {"id": "msg_1", "type": "message", "role": "user", "content": "x" * 100}
    store = ConversationStore(capacity=2, chars=int(3.5 * len(json.dumps(item))))  # 3 items, not 4
    a, b = store.create([item], {}), store.create([item], {})
    store.get(a.id)  # (now b is the least recently used)
    c = store.create([item], {})
    with pytest.raises(APIError):
        store.get(b.id)
    store.extend(c, [dict(item, id="msg_2"), dict(item, id="msg_3")])  # 4 items in all: a goes
    with pytest.raises(APIError):
        store.get(a.id)
    assert store.get(c.id).items[-1]["id"] == "msg_3"
    store.remove(c, 0)
    d = store.create([item], {})  # fits beside c's three items
    assert store.get(c.id) is c and store.get(d.id) is d
    store.extend(c, [])  # c used last: d is the least recently used now
    store.create([item], {})
    with pytest.raises(APIError):
        store.get(d.id)
    assert store.get(c.id) is c


def test_truncation_auto_drops_the_oldest_turns_until_the_conversation_fits(client):
    """truncation "auto": a conversation past the context (512 tokens here) loses its oldest
    turns after the system message, whole turns, until it fits: the answer is the chat's over
    the turns kept. "disabled" refuses it; a last turn too long alone is refused either way."""
    turn = "tell me about the old house on the hill " * 6
    given = [{"role": "system", "content": "Be brief."}]
    for i in range(8):
        given += [{"role": "user", "content": f"{i}: {turn}"}, {"role": "assistant", "content": f"Reply {i}."}]
    given.append({"role": "user", "content": "And now?"})
    kwargs = dict(model=MODEL, input=given, max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**kwargs)
    assert refused.value.body["code"] == "context_length_exceeded"
    answer = client.responses.create(**kwargs, truncation="auto")
    assert answer.truncation == "auto" and answer.usage.input_tokens + 4 <= 512

    def fitting(k: int):  # the chat of the system message and the turns from the k-th on, if it fits
        try:
            return chat(client, [given[0], *given[2 * k + 1:]], max_tokens=4)
        except openai.BadRequestError:
            return None

    dropped, expected = next((k, r) for k in range(9) if (r := fitting(k)) is not None)
    assert dropped > 0 and answer.usage.input_tokens == expected.usage.prompt_tokens
    counted = {t: client.responses.input_tokens.count(model=MODEL, input=given, truncation=t,
                                                      extra_body={"max_output_tokens": 4}).input_tokens
               for t in ("auto", "disabled")}
    assert counted["auto"] == answer.usage.input_tokens < counted["disabled"]
    assert answer.output_text == expected.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**{**kwargs, "input": [{"role": "user", "content": turn * 20}]}, truncation="auto")


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "frobnicate": 1}, "frobnicate", "unrecognized"),
    ({}, "input", "required"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input", "encrypted"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input", "role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": "x", "background": True, "store": False}, "background", "stored"),
    ({"input": "x", "background": "yes"}, "background", "true or false"),
    ({"input": "x", "truncation": "middle"}, "truncation", "truncation"),
    ({"input": "x", "include": ["message.output_text.bytes"]}, "include", "unknown value"),
    ({"input": "x", "include": [{"logprobs": True}]}, "include", "unknown value"),
    ({"input": "x", "include": "message.output_text.logprobs"}, "include", "array"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"input": "x", "top_logprobs": -1}, "top_logprobs", "between 0 and 20"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format", "text.format"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice"),
    ({"input": "x", "previous_response_id": 5}, "previous_response_id", "previous_response_id"),
])
def test_bad_requests_are_400s_naming_the_field(url, body, param, words):
    response = httpx.post(f"{url}/v1/responses", json={"model": MODEL, **body}, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_harmless_fields_are_accepted(client):
    answer = client.responses.create(
        model=MODEL, input="x", max_output_tokens=1, metadata={"k": "v"}, user="u", store=False,
        prompt_cache_key="k", safety_identifier="s", reasoning={"effort": "low"}, truncation="disabled")
    assert answer.metadata == {"k": "v"} and answer.usage.output_tokens <= 1
