"""Structured output and tool calls over HTTP: response_format and forced tool calls with the
tiny model (every answer parses and validates, streamed or not, greedy or sampled), tool calls
that a model writes on its own (a scripted fake model), and every bad input a 400."""

from __future__ import annotations

import copy
import json
import re

import httpx
import jsonschema
import pytest

from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.server import entries, parsing
from cadence.server.tool_requests import (GRANITE, HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, call_style,
                                          parse_tools)
from tests.fakes import EOS, TOK, FakeEngine, byte_tokenizer
from tests.conftest import serve_tiny as serve
from tests.structured_cases import SCHEMAS, TOOLS, assembled, check_calls, schema_format

MODEL = "tiny"


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve(tiny_engine, tiny_tokenizer) as base:
        yield base


@pytest.fixture(scope="module")
def fake_url():
    """The fake engine (`tests.fakes`) behind the real server: a "model" that picks
    among the tokens each bitmask allows by a hash of the sequence, with a context long enough
    for a prompt that lists tools (the tiny model's 512 tokens are not, with its tokenizer)."""
    with serve(FakeEngine(num_slots=4, max_seq_len=2048, page_size=16), TOK) as base:
        yield base


def post(url: str, body: dict, chat: bool = True) -> httpx.Response:
    path = "chat/completions" if chat else "completions"
    return httpx.post(f"{url}/v1/{path}", json={"model": MODEL, **body}, timeout=120)


def stream(url: str, body: dict, chat: bool = True) -> list[dict]:
    """The chunks of a streamed answer (the [DONE] checked)."""
    path = "chat/completions" if chat else "completions"
    with httpx.stream("POST", f"{url}/v1/{path}", json={"model": MODEL, "stream": True, **body},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_answer_validates_against_its_schema(url, name, temperature):
    """Chat and completions, whole and streamed, two choices when sampled: all parse and
    validate, and end where the JSON ends."""
    n = 2 if temperature else 1
    body = {"response_format": schema_format(name), "max_tokens": 300, "temperature": temperature,
            "seed": 11, "n": n}
    whole = post(url, {**body, "messages": ASK}).json()
    texts = [c["message"]["content"] for c in whole["choices"]]
    texts += [c["text"] for c in post(url, {**body, "prompt": "Data:"}, chat=False).json()["choices"]]
    streamed = assembled(stream(url, {**body, "messages": ASK}))
    assert len(streamed) == n and all(e["finish"] == "stop" for e in streamed.values())
    texts += [e["content"] for e in streamed.values()]
    assert all(c["finish_reason"] == "stop" for c in whole["choices"])
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    if not temperature:  # greedy: the stream is the whole answer, chunk by chunk
        assert streamed[0]["content"] == texts[0]


def test_json_object_starts_an_object_and_free_requests_are_untouched(url):
    """json_object: the answer is an object (the random model may not close it in time);
    the same request without a format answers as it always did."""
    free = post(url, {"messages": ASK, "max_tokens": 12, "temperature": 0}).json()
    constrained = post(url, {"messages": ASK, "max_tokens": 12, "temperature": 0,
                             "response_format": {"type": "json_object"}}).json()
    assert constrained["choices"][0]["message"]["content"].startswith("{")
    again = post(url, {"messages": ASK, "max_tokens": 12, "temperature": 0,
                       "response_format": {"type": "text"}}).json()
    assert again["choices"][0]["message"] == free["choices"][0]["message"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_required_and_named_tool_choices_always_call(fake_url, temperature):
    url = fake_url
    base = {"messages": ASK, "tools": TOOLS, "max_tokens": 400, "temperature": temperature, "seed": 3}
    for extra, names, most in [({"tool_choice": "required"}, {"get_weather", "get_time"}, None),
                               ({"tool_choice": "required", "parallel_tool_calls": False},
                                {"get_weather", "get_time"}, 1),
                               ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                                {"get_weather"}, 1)]:
        answer = post(url, {**base, **extra}).json()["choices"][0]
        assert answer["finish_reason"] == "tool_calls", answer
        calls = answer["message"]["tool_calls"]
        check_calls(calls, names)
        assert most is None or len(calls) == most
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
        streamed = assembled(stream(url, {**base, **extra}))[0]
        assert streamed["finish"] == "tool_calls"
        check_calls(list(streamed["calls"].values()), names)
        if not temperature:  # the same calls, streamed in pieces
            assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_a_format_beside_tools_takes_the_calls_or_the_formats_json(fake_url):
    """A JSON response format beside tools the model may call ("auto"): an answer is calls of
    the tools or the format's JSON, as OpenAI takes the two together (the Agents SDK's
    output_type beside tools, instructor's Responses modes); beside a forced choice, calls."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "Place", "schema": schema, "strict": True}}
    kinds = set()
    for i in range(10):
        body = {"messages": [{"role": "user", "content": f"Where is place {i}?"}], "tools": TOOLS,
                "response_format": fmt, "max_tokens": 400}
        choice = post(fake_url, body).json()["choices"][0]
        if choice["message"].get("tool_calls"):
            assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
            check_calls(choice["message"]["tool_calls"], {"get_weather", "get_time"})
            kinds.add("calls")
        else:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            kinds.add("json")
    assert kinds == {"calls", "json"}
    for forced in ("required", {"type": "function", "function": {"name": "get_time"}}):
        choice = post(fake_url, {**body, "tool_choice": forced}).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        check_calls(choice["message"]["tool_calls"], {"get_weather", "get_time"})


def test_tool_choice_none_returns_text(fake_url):
    url = fake_url
    answer = post(url, {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8}).json()
    choice = answer["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] in ("stop", "length")


def test_a_conversation_with_calls_and_results_renders(fake_url, tiny_tokenizer):
    url = fake_url
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    prompt = parsing.render_chat(messages, tiny_tokenizer, parse_tools({"tools": TOOLS}))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt.split("<tools>")[1].split("</tools>")[0]
    answer = post(url, {"messages": messages, "tools": TOOLS, "max_tokens": 6})
    assert answer.status_code == 200


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(["}}}}, "response_format", "unclosed"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     "response_format", "nowhere"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "name"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools", "more than once"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}},
     "tool_choice", "send_email"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "required"}, "tool_choice", "needs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}}}],
      "tool_choice": "required"}, "tools", "unclosed"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]},
     "messages", "tool_calls"),
])
def test_bad_structure_is_a_400_naming_the_field(url, body, param, fragment):
    response = post(url, {"messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert post(url, {"messages": ASK, "max_tokens": 2}).status_code == 200


def test_tools_are_for_chats(url):
    response = post(url, {"prompt": "x", "tools": TOOLS}, chat=False)
    assert response.status_code == 400 and "tools" in response.json()["error"]["message"]


def test_a_slow_grammar_is_refused_and_others_are_served(tiny_engine, tiny_tokenizer):
    with serve(tiny_engine, tiny_tokenizer, grammar_timeout=1e-6) as base:
        slow = post(base, {"messages": ASK, "response_format": schema_format("nested")})
        assert slow.status_code == 400 and "longer than" in slow.json()["error"]["message"]
        assert post(base, {"messages": ASK, "max_tokens": 3}).status_code == 200


def test_an_engine_without_structured_output_refuses_formats(tiny_params, tiny_config, tiny_tokenizer):
    engine = Engine(tiny_params, tiny_config, EngineConfig(num_slots=2, max_seq_len=128, prefill_chunk=32))
    with serve(engine, tiny_tokenizer) as base:
        response = post(base, {"messages": ASK, "response_format": {"type": "json_object"}})
        assert response.status_code == 400 and "--structured_output" in response.json()["error"]["message"]


# -- calls a model writes on its own (tool_choice auto) -----------------------------------------

WRITTEN = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
    "text": "It is sunny {mostly} in <b>Paris</b>.",
}


@pytest.mark.parametrize("style", sorted(WRITTEN))
def test_calls_a_model_writes_come_back_as_tool_calls(style):
    """A fake model scripted to write each style: "auto" returns its calls (content beside
    them), whole and streamed alike; text that is no call stays text."""
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 400}
    prompt = TOK.encode(parsing.render_chat(ASK, TOK, parse_tools(body)))
    engine = FakeEngine(num_slots=2, max_seq_len=2048, script={tuple(prompt): TOK.encode(WRITTEN[style]) + [EOS]})
    with serve(engine, TOK) as base:
        whole = post(base, body).json()["choices"][0]
        streamed = assembled(stream(base, body))[0]
    if style == "text":
        assert whole["message"]["content"] == WRITTEN["text"] and whole["finish_reason"] == "stop"
        assert streamed["content"] == WRITTEN["text"] and not streamed["calls"]
        return
    expected = [("get_weather", {"city": "Paris", "unit": "c"})] + ([("get_time", {})] if style == "hermes" else [])
    calls = whole["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert whole["finish_reason"] == streamed["finish"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == expected
    content = "Let me look." if style == "hermes" else None
    assert whole["message"]["content"] == content and streamed["content"] == (content or "")


@pytest.mark.parametrize("messages", [
    [-1], [{"role": "tool", "tool_call_id": "c"}], [{"role": "assistant", "content": 3}],
    [{"role": "tool", "tool_call_id": "c", "content": None}],
])
def test_malformed_conversations_with_tools_are_400(fake_url, messages):
    """Found by the fuzz: a conversation is checked before tools rewrite it."""
    response = post(fake_url, {"messages": messages, "tools": TOOLS, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text


# A template of the kind Qwen2's is (it renders tools, and calls as <tool_call> blocks), and one
# of the kind Llama 3.1's is (tools in its own words, calls as JSON with "parameters").
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
LLAMA_TEMPLATE = (
    "{%- if tools %}Answer with {\"name\": ..., \"parameters\": ...} or <|python_tag|>."
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endif %}"
    "{%- for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")


def with_template(template: str):
    tokenizer = copy.copy(TOK)
    tokenizer.chat_template = template
    return tokenizer


def test_a_template_that_knows_tools_renders_them_itself():
    tokenizer = with_template(HERMES_TEMPLATE)
    assert call_style(tokenizer).name == HERMES
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]}]
    prompt = parsing.render_chat(messages, tokenizer, parse_tools({"tools": TOOLS}))
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt  # as OpenAI sent it, by the template
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>' in prompt
    assert "<tools>" not in prompt  # cadence's own section stays out


def test_a_llama_style_template_gets_its_call_format_forced_and_parsed():
    """Where the template teaches Llama 3's JSON, a forced call is written that way (one call,
    "parameters"), and comes back as a call, whole and streamed."""
    tokenizer = with_template(LLAMA_TEMPLATE)
    assert call_style(tokenizer).name == LLAMA3_JSON
    with serve(FakeEngine(num_slots=2, max_seq_len=2048, page_size=16), tokenizer) as base:
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300}
        choice = post(base, body).json()["choices"][0]
        streamed = assembled(stream(base, body))[0]
    assert choice["finish_reason"] == streamed["finish"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1 and choice["message"]["content"] is None
    check_calls(calls, {"get_weather", "get_time"})
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (calls[0]["function"]["name"], calls[0]["function"]["arguments"])]


# Mistral's formats: templates of the kinds Mistral 7B v0.3 / Nemo's (a JSON list after
# [TOOL_CALLS]) and Small 3.2's are ([TOOL_CALLS]name[ARGS]{...}), over a vocabulary that has
# their special tokens. Both check call ids as Mistral's do: 9 characters, or an exception.
MISTRAL_TOK = byte_tokenizer(("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                              "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]"))
_NINE = '{%- if x | length != 9 %}{{ raise_exception("Tool call IDs should be 9 characters") }}{% endif %}'
_MISTRAL_HEAD = (
    "{{- bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'tool' %}{% set x = m.tool_call_id %}" + _NINE +
    "[TOOL_RESULTS]{{ m.tool_call_id }}: {{ m.content }}[/TOOL_RESULTS]"
    "{%- elif m.tool_calls %}")
MISTRAL_TEMPLATES = {
    "mistral": _MISTRAL_HEAD + (
        "[TOOL_CALLS][{% for c in m.tool_calls %}{% set x = c.id %}" + _NINE +
        '{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}, '
        '"id": "{{ c.id }}"}{{ ", " if not loop.last }}{% endfor %}]{{ eos_token }}'
        "{%- else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"),
    "mistral_args": _MISTRAL_HEAD + (
        "{%- for c in m.tool_calls %}{% set x = c.id %}" + _NINE +
        "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}"
        "{%- endfor %}{{ eos_token }}{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"),
}
WRITTEN_BY_MISTRAL = {
    "mistral": 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
               '{"name": "get_time", "arguments": {}}]',
    "mistral_args": 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}'
                    '[TOOL_CALLS]get_time[CALL_ID]abc123XYZ[ARGS]{}',
}


def mistral_tokenizer(style: str):
    tokenizer = copy.copy(MISTRAL_TOK)
    tokenizer.chat_template = MISTRAL_TEMPLATES[style]
    return tokenizer


def mistral_engine(**kw) -> FakeEngine:
    return FakeEngine(num_slots=2, max_seq_len=2048, page_size=16, vocab_size=MISTRAL_TOK.vocab_size, **kw)


@pytest.mark.parametrize("style", [MISTRAL, MISTRAL_ARGS])
def test_mistral_templates_are_told_apart_by_their_tokens(style):
    found = call_style(mistral_tokenizer(style))
    assert found.name == style and found.mistral
    markers = ["[TOOL_CALLS]"] + (["[ARGS]", "[CALL_ID]"] if style == MISTRAL_ARGS else [])
    assert found.shown == tuple(sorted(MISTRAL_TOK.token_id(m) for m in markers))
    # The same template over a vocabulary without the tokens is no Mistral model's.
    assert call_style(with_template(MISTRAL_TEMPLATES[style])).name == HERMES
    # The batch job's and CLI's requests show them too, where the calls are parsed.
    for choice, shown in [("auto", found.shown), ("none", ())]:
        entry = entries.to_request({"messages": ASK, "tools": TOOLS, "tool_choice": choice},
                                   mistral_tokenizer(style))
        assert entry.params.shown_specials == shown


@pytest.mark.parametrize("style", [MISTRAL, MISTRAL_ARGS])
def test_calls_a_mistral_model_writes_come_back_as_tool_calls(style):
    """[TOOL_CALLS] and [ARGS] are special tokens, which an answer's text skips; with tools its
    text shows them to the parser, and the calls come back (with 9-character ids), whole and
    streamed. Without tools the same answer is plain text without them."""
    tokenizer = mistral_tokenizer(style)
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 400}
    script = {}
    for tools in (True, False):
        prompt = tokenizer.encode(parsing.render_chat(ASK, tokenizer, parse_tools(body) if tools else None))
        script[tuple(prompt)] = tokenizer.encode(WRITTEN_BY_MISTRAL[style]) + [EOS]
    with serve(mistral_engine(script=script), tokenizer) as base:
        whole = post(base, body).json()["choices"][0]
        streamed = assembled(stream(base, body))[0]
        plain = post(base, {k: v for k, v in body.items() if k != "tools"}).json()["choices"][0]
    expected = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]
    calls = whole["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert all(re.fullmatch(r"[a-zA-Z0-9]{9}", c["id"]) for c in calls)
    assert whole["finish_reason"] == streamed["finish"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == expected
    assert whole["message"]["content"] == streamed["content"] == "Checking."
    assert "[TOOL_CALLS]" not in plain["message"]["content"] and "tool_calls" not in plain["message"]
    assert plain["message"]["content"].startswith("Checking.")


@pytest.mark.parametrize("style", [MISTRAL, MISTRAL_ARGS])
def test_forced_mistral_calls_are_written_with_its_tokens(style):
    """"required" and a named function: the grammar writes the calls as the template does,
    special tokens and all, and they come back as calls with ids the template takes back: the
    next turn, with each call's result, renders."""
    tokenizer = mistral_tokenizer(style)
    with serve(mistral_engine(), tokenizer) as base:
        for extra, names, most in [({"tool_choice": "required"}, {"get_weather", "get_time"}, None),
                                   ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                                    {"get_time"}, 1)]:
            body = {"messages": ASK, "tools": TOOLS, "max_tokens": 400, **extra}
            choice = post(base, body).json()["choices"][0]
            streamed = assembled(stream(base, body))[0]
            assert choice["finish_reason"] == streamed["finish"] == "tool_calls", choice
            calls = choice["message"]["tool_calls"]
            check_calls(calls, names)
            assert most is None or len(calls) == most
            assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in calls]
            results = [{"role": "tool", "tool_call_id": c["id"], "content": "22 C"} for c in calls]
            turn = ASK + [choice["message"]] + results
            prompt = parsing.render_chat(turn, tokenizer, parse_tools({"tools": TOOLS}))
            assert all(f"[TOOL_RESULTS]{c['id']}: 22 C" in prompt for c in calls)


def test_other_servers_call_ids_are_given_mistral_ones_consistently():
    """A conversation whose ids a Mistral template would refuse (OpenAI's `call_...`) renders,
    each call and its result under the same 9-character id; ids it takes are kept."""
    tokenizer = mistral_tokenizer(MISTRAL)
    calls = [{"id": "call_Xy12abcdefghijklmnop", "type": "function",
              "function": {"name": "get_time", "arguments": "{}"}},
             {"id": "k3Lm9Pq2R", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                  {"role": "tool", "tool_call_id": calls[0]["id"], "content": "noon"},
                  {"role": "tool", "tool_call_id": "k3Lm9Pq2R", "content": "rain"}]
    prompt = parsing.render_chat(turn, tokenizer, parse_tools({"tools": TOOLS}))
    first = re.search(r'"name": "get_time", "arguments": \{\}, "id": "([a-zA-Z0-9]{9})"', prompt)[1]
    assert first != "call_Xy12" and f"[TOOL_RESULTS]{first}: noon" in prompt
    assert '"id": "k3Lm9Pq2R"' in prompt and "[TOOL_RESULTS]k3Lm9Pq2R: rain" in prompt
    # The same conversation with ids the template cannot take is a 400, not a 500.
    short = [{**turn[1], "tool_calls": [{**calls[0], "id": 7}]}]
    with serve(mistral_engine(), tokenizer) as base:
        response = post(base, {"messages": ASK + short, "tools": TOOLS, "max_tokens": 2})
    assert response.status_code == 400, response.text


# Granite 3's: the tools shown in a role of their own, calls as a JSON list after <|tool_call|>.
GRANITE_TEMPLATE = (
    "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>"
    "{% endif %}{%- for m in messages %}<|start_of_role|>{{ m.role }}<|end_of_role|>{{ m.content }}"
    "<|end_of_text|>{% endfor %}<|start_of_role|>assistant<|end_of_role|>"
    "{#- respond with <|tool_call|> and a JSON list of calls #}")


def test_granite_calls_are_a_list_after_its_tag():
    """A Granite template's calls: the special <|tool_call|> token shown to the parser, then a
    list; written by the model (arguments first) or forced by the grammar, they come back."""
    tok = copy.copy(byte_tokenizer(("<|tool_call|>",)))
    tok.chat_template = GRANITE_TEMPLATE
    style = call_style(tok)
    assert style.name == GRANITE and style.shown == (tok.token_id("<|tool_call|>"),)
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 400}
    prompt = tok.encode(parsing.render_chat(ASK, tok, parse_tools(body)))
    written = '<|tool_call|>[{"arguments": {"city": "Oslo"}, "name": "get_weather"}]'
    engine = FakeEngine(num_slots=2, max_seq_len=2048, page_size=16, vocab_size=tok.vocab_size,
                        script={tuple(prompt): tok.encode(written) + [EOS]})
    with serve(engine, tok) as base:
        choice = post(base, body).json()["choices"][0]
        forced = post(base, {**body, "messages": [{"role": "user", "content": "x"}],
                             "tool_choice": "required"}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == [("get_weather", {"city": "Oslo"})]
    assert forced["finish_reason"] == "tool_calls"
    check_calls(forced["message"]["tool_calls"], {"get_weather", "get_time"})
