"""Splitting a reasoning model's thinking from its answer (server/reasoning.py): whole and
streamed in any split, the prompt deciding where the output starts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.server.reasoning import (CLOSE, OPEN, ReasoningParser, opens_inside, split_reasoning,
                                      template_thinks)


def streamed(text: str, inside: bool, cuts=()) -> tuple[str, str, list[tuple[str, str]]]:
    """The reasoning and answer `text` gives fed in pieces cut at `cuts`, and every split."""
    parser = ReasoningParser(inside)
    bounds = sorted(set(cuts) | {0, len(text)})
    splits = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    pairs = [(s.reasoning, s.content) for s in splits]
    return "".join(r for r, _ in pairs), "".join(c for _, c in pairs), pairs


def check(text: str, inside: bool) -> tuple[str | None, str]:
    """Whole, one character at a time, and at every single cut: the same split."""
    whole = split_reasoning(text, inside)
    for cuts in [(), range(1, len(text)), *([k] for k in range(1, len(text)))]:
        reasoning, content, _ = streamed(text, inside, cuts)
        assert (reasoning, content) == (whole[0] or "", whole[1]), (text, cuts)
    return whole


@pytest.mark.parametrize("text, inside, want", [
    # Qwen3 with thinking on: the model opens and closes the block, then answers.
    ("<think>\nLet me add.\n2 + 2 = 4.\n</think>\n\nIt is 4.", False, ("Let me add.\n2 + 2 = 4.", "It is 4.")),
    # DeepSeek-R1 / Qwen3-Thinking-2507: the prompt opened it; the output only closes it.
    ("Let me add.\n</think>\n\nIt is 4.", True, ("Let me add.", "It is 4.")),
    # Thinking off (the prompt closed an empty block), or a model that never thinks.
    ("It is 4.", False, (None, "It is 4.")),
    ("  Hello <think> is a tag", False, (None, "  Hello <think> is a tag")),
    # An empty block, and whitespace before the opening tag.
    (" \n<think>\n\n</think>\n\nHi", False, ("", "Hi")),
    # Cut off while thinking: all reasoning, its trailing newlines dropped.
    ("<think>\nstill thinking\n\n", False, ("still thinking", "")),
    ("partial </thi", True, ("partial </thi", "")),
    # Only the first </think> closes; later tags are answer text, as are newlines inside it.
    ("a</think>b</think>\n<think>c", True, ("a", "b</think>\n<think>c")),
    ("<think>x\n\ny</think>\n\n\nz\n\nw\n", False, ("x\n\ny", "z\n\nw\n")),
    # An output that stops inside the opening tag, or is only whitespace, is answer.
    ("<thi", False, (None, "<thi")),
    ("\n\n", False, (None, "\n\n")),
    ("", True, ("", "")),
])
def test_splits(text, inside, want):
    assert check(text, inside) == want


PIECES = ["<think>", "</think>", "<", "</", "think", ">", "\n", "\n\n", " ", "a", "b c", "<thin", "k>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.booleans(), st.data())
def test_any_split_gives_the_whole_split(pieces, inside, data):
    """However the text is cut, the concatenated reasoning and answer are the whole split's,
    and they are the text less its tags and the newlines around them."""
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=6))
    reasoning, content = split_reasoning(text, inside)
    assert streamed(text, inside, cuts)[:2] == (reasoning or "", content)
    # The contract, written plainly: tags and the newlines around them go, the rest stays.
    if reasoning is None:
        assert not inside and content == text
        return
    body = text if inside else text.lstrip(" \t\r\n").removeprefix(OPEN)
    head, closed, tail = body.partition(CLOSE)
    assert reasoning == head.strip("\n")
    assert content == (tail.lstrip("\n") if closed else "")


def test_text_goes_out_as_soon_as_it_is_decided():
    """Held back: a partial tag and newlines that may stand before `</think>`; nothing else."""
    text = "<think>\nstep one\n\nstep two\n</think>\n\nanswer"
    _, _, pairs = streamed(text, False, [3, 12, 16, 18, 27, 30, 37, 40])
    assert pairs == [("", ""),             # "<th": maybe the opening tag
                     ("step", ""),         # "ink>\nstep"
                     (" one", ""),
                     ("", ""),             # "\n\n": maybe the end of the reasoning
                     ("\n\nstep two", ""),  # "step two\n": they were not; the new "\n" may be
                     ("", ""),             # "</t"
                     ("", ""),             # "hink>\n\n": closed, its newlines dropped
                     ("", "ans"), ("", "wer"), ("", "")]


def test_the_prompt_says_where_the_output_starts():
    qwen3_on = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    qwen3_off = qwen3_on + "<think>\n\n</think>\n\n"
    r1 = "<｜User｜>Hi<｜Assistant｜><think>\n"
    history = "<think>\nold\n</think>\n\nold answer" + qwen3_on
    mentioned = "<|im_start|>user\nWhat does the <think> tag do?<|im_end|>\n<|im_start|>assistant\n"
    assert [opens_inside(p) for p in (qwen3_on, qwen3_off, r1, history, mentioned)] == [
        False, False, True, False, False]
    assert template_thinks("{{ '<think>' }}...{{ '</think>' }}") and not template_thinks("{{ x }}")
    assert not template_thinks(None)


# -- through the server: a scripted fake engine (its "model" writes what a test scripts) --------

# A Qwen3-like template: thinking on unless enable_thinking is false (then an empty block closes
# it in the prompt); `opened` renders DeepSeek-R1's kind, which opens the block for the model.
THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% if opened %}<think>\n{% endif %}")
ASK = [{"role": "user", "content": "Say hello."}]


def thinking_server(answers: dict[str, str], tools: list[dict] | None = None, **config):
    """The real server over a fake engine that answers each rendered prompt (by the template's
    variables: "on", "off", "opened"; with `tools`, as a request with them renders it) with its
    scripted text, then EOS."""
    import copy

    from cadence.server import parsing
    from cadence.server.tool_requests import parse_tools
    from tests.conftest import serve_tiny
    from tests.fakes import EOS, TOK, FakeEngine

    tokenizer = copy.copy(TOK)
    tokenizer.chat_template = THINKING_TEMPLATE
    variables = {"on": {}, "off": {"enable_thinking": False}, "opened": {"opened": True}}
    shown = parse_tools({"tools": tools}) if tools else None
    script = {tuple(tokenizer.encode(parsing.render_chat(ASK, tokenizer, shown, variables[k]))):
              tokenizer.encode(text, add_bos=False) + [EOS] for k, text in answers.items()}
    # The "on" prompt begins the others: the fake engine takes the first script that fits.
    script = dict(sorted(script.items(), key=lambda item: -len(item[0])))
    return serve_tiny(FakeEngine(num_slots=2, max_seq_len=1024, script=script), tokenizer, **config)


def ask(base: str, **body) -> tuple[dict, dict]:
    """A chat's whole answer's message, and its streamed deltas put together."""
    import json

    import httpx

    request = {"model": "tiny", "messages": ASK, "max_tokens": 64, "temperature": 0, **body}
    whole = httpx.post(f"{base}/v1/chat/completions", json=request, timeout=60).json()
    message = whole["choices"][0]["message"]
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60, json={
            **request, "stream": True, "stream_options": {"include_usage": True}}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    # Both count the tokens of the reasoning the same (where it is split).
    details = [u.get("completion_tokens_details") for u in (whole["usage"], chunks[-1]["usage"])]
    assert details[0] == details[1] and (details[0] is None) == ("reasoning_content" not in message)
    message["reasoning_tokens"] = None if details[0] is None else details[0]["reasoning_tokens"]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    streamed = {key: "".join(d.get(key) or "" for d in deltas) for key in ("reasoning_content", "content")}
    streamed["calls"] = [call for d in deltas for call in d.get("tool_calls") or []]
    return message, streamed


ANSWERS = {"on": "<think>\nThey want a greeting.\n</think>\n\nHello!",
           "off": "Hello, quickly.",
           "opened": "A greeting, then.\n\n</think>\n\nHello again!"}


def through_close(answer: str) -> int:
    """The scripted answer's tokens through the one that completes `</think>`."""
    from tests.fakes import TOK

    ids = TOK.encode(answer, add_bos=False)
    return next(i for i in range(len(ids)) if "</think>" in TOK.decode(ids[:i + 1])) + 1


def test_the_server_splits_reasoning_from_the_answer_whole_and_streamed():
    # (Two servers: the "opened" prompt is the "on" prompt and the start of its answer.)
    with thinking_server({k: ANSWERS[k] for k in ("on", "off")}) as base:
        on = ask(base)
        off = ask(base, chat_template_kwargs={"enable_thinking": False})
        kept = ask(base, separate_reasoning=False)
    with thinking_server({"opened": ANSWERS["opened"]}) as base:
        opened = ask(base, chat_template_kwargs={"opened": True})
    for (message, streamed), reasoning, content, kind in [
            (on, "They want a greeting.", "Hello!", "on"),
            (off, None, "Hello, quickly.", "off"),
            (opened, "A greeting, then.", "Hello again!", "opened")]:
        assert message["reasoning_content"] == reasoning and message["content"] == content
        # usage's reasoning tokens: every token through the one that closed the reasoning
        assert message["reasoning_tokens"] == (0 if reasoning is None else through_close(ANSWERS[kind]))
        assert streamed["reasoning_content"] == (reasoning or "") and streamed["content"] == content
    message, streamed = kept  # separate_reasoning: false: all of it is content
    assert "reasoning_content" not in message and message["content"] == ANSWERS["on"]
    assert message["reasoning_tokens"] is None
    assert streamed == {"reasoning_content": "", "content": ANSWERS["on"], "calls": []}


JSON_ANSWERS = {"on": '<think>\nKeys first.\n</think>\n\n{"greeting": "hi"}',
                "off": '{"greeting": "hello"}',
                "opened": 'An object, then.\n</think>\n\n{"greeting": "hey"}'}


@pytest.mark.parametrize("kind, reasoning, content", [
    ("on", "Keys first.", '{"greeting": "hi"}'),
    ("off", None, '{"greeting": "hello"}'),  # the prompt closed the reasoning: JSON from the start
    ("opened", "An object, then.", '{"greeting": "hey"}')])
def test_a_format_applies_to_the_answer_after_the_reasoning(kind, reasoning, content):
    """A thinking model asked for JSON thinks first, free, then answers in the format (the
    grammar waits for </think>); the answer is the content, and ends the request."""
    variables = {"on": {}, "off": {"enable_thinking": False}, "opened": {"opened": True}}[kind]
    with thinking_server({kind: JSON_ANSWERS[kind]}) as base:
        message, streamed = ask(base, chat_template_kwargs=variables, response_format={"type": "json_object"})
    assert message["reasoning_content"] == reasoning and message["content"] == content
    assert streamed["reasoning_content"] == (reasoning or "") and streamed["content"] == content


def test_reasoning_then_a_tool_call():
    """Qwen3 thinks, then calls: the reasoning is split out first, the call parsed from the rest."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    with thinking_server({"on": f"<think>\nI need the time.\n</think>\n\n{call}"}, tools) as base:
        message, streamed = ask(base, tools=tools, max_tokens=200)
    assert message["reasoning_content"] == streamed["reasoning_content"] == "I need the time."
    assert message["content"] is None and streamed["content"] == ""
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert [c["function"]["name"] for c in streamed["calls"] if "id" in c] == ["get_time"]


def test_no_parser_no_split_and_the_templates_own_variables_are_refused():
    import httpx

    with thinking_server({"on": ANSWERS["on"]}, reasoning_parser="none") as base:
        message, streamed = ask(base)
        assert "reasoning_content" not in message and message["content"] == ANSWERS["on"]
        assert streamed["content"] == ANSWERS["on"] and streamed["reasoning_content"] == ""
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": ASK, "chat_template_kwargs": {"messages": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
        tokens = httpx.post(f"{base}/tokenize", timeout=60, json={
            "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
        for bad in ({"prompt": "x", "chat_template_kwargs": {}}, {"messages": ASK, "chat_template_kwargs": 3},
                    {"messages": ASK, "chat_template_kwargs": {"tools": []}}):
            r = httpx.post(f"{base}/tokenize", timeout=60, json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", bad
    from tests.fakes import TOK
    assert TOK.decode(tokens).endswith("<think>\n\n</think>\n\n")


def test_a_batch_lines_reasoning_is_split_as_the_chat_api_splits_it():
    """cadence-batch's side: a chat line with chat_template_kwargs renders with them and knows
    where its output starts; its result carries reasoning_content and the answer as text."""
    import copy

    from cadence.scheduler.request import RequestRecord
    from cadence.server import entries
    from cadence.server.batch_cli import Job, result_json
    from tests.fakes import TOK

    tokenizer = copy.copy(TOK)
    tokenizer.chat_template = THINKING_TEMPLATE
    entry = {"id": 1, "messages": ASK, "chat_template_kwargs": {"opened": True}}
    request = entries.to_request(entry, tokenizer, extra_fields=("id",), splits_reasoning=True)
    assert request.reasoning_inside is True
    assert tokenizer.decode(request.ids).endswith("<|im_start|>assistant\n<think>\n")
    off = entries.to_request({**entry, "chat_template_kwargs": {"enable_thinking": False}}, tokenizer,
                             extra_fields=("id",), splits_reasoning=True)
    assert off.reasoning_inside is False
    assert entries.to_request(entry, tokenizer, extra_fields=("id",)).reasoning_inside is None
    # A format applies after the reasoning, which the prompt opened here.
    from cadence.scheduler.grammar import GrammarCompiler, JsonObject, Thinking

    shaped = entries.to_request({**entry, "response_format": {"type": "json_object"}}, tokenizer,
                                extra_fields=("id",), splits_reasoning=True,
                                grammars=GrammarCompiler(tokenizer, tokenizer.vocab_size))
    assert shaped.reasoning_inside is True and shaped.params.grammar.spec == Thinking(JsonObject(), opened=True)
    with pytest.raises(Exception, match="goes with"):
        entries.to_request({"prompt": "x", "chat_template_kwargs": {}}, tokenizer)

    record = RequestRecord(request_id="1", prompt_tokens=9, output_tokens=12, finish_reason="stop",
                           submitted=0.0, admitted=0.0, first_token=0.1, finished=0.2,
                           prefill_chunks=1, decode_steps=11, text=ANSWERS["opened"])
    job = Job(line=1, id=1, entry=entry, reasoning_inside=True)
    result = result_json(job, record)
    assert result["reasoning_content"] == "A greeting, then." and result["text"] == "Hello again!"
    assert "reasoning_content" not in result_json(Job(line=1, id=1, entry=entry), record)


def test_the_responses_api_gives_the_reasoning_as_an_item_whole_and_streamed():
    import json

    import httpx

    from cadence.server.responses_request import input_messages

    with thinking_server({"on": ANSWERS["on"]}) as base:
        body = {"model": "tiny", "input": "Say hello.", "max_output_tokens": 64, "temperature": 0}
        whole = httpx.post(f"{base}/v1/responses", json=body, timeout=60).json()
        with httpx.stream("POST", f"{base}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "They want a greeting."}]
    assert message["type"] == "message" and message["content"][0]["text"] == "Hello!"
    # Every token up to the one that closed the block (the fake writes the scripted ids).
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == through_close(ANSWERS["on"])
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "They want a greeting." and len(deltas) > 1
    done = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"] == reasoning["content"]
    for key in ("output_tokens", "output_tokens_details"):  # (the stream's prompt was cached)
        assert done["usage"][key] == whole["usage"][key]

    # A client that keeps the conversation sends the reasoning back: it is the next assistant
    # turn's reasoning_content (encrypted reasoning, another server's, is refused).
    call = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}
    messages = input_messages([{"role": "user", "content": "Say hello."}, reasoning, call])
    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content": "They want a greeting.",
                           "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"name": "get_time", "arguments": "{}"}}]}
    with pytest.raises(Exception, match="encrypted reasoning"):
        input_messages([{**reasoning, "encrypted_content": "xyz"}])
    # Reasoning that no assistant turn follows goes nowhere, not onto a later turn.
    later = input_messages([reasoning, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello"}])
    assert later == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    parts = [e["part"] for e in events if e["type"].startswith("response.content_part.")]
    assert parts[0] == {"type": "reasoning_text", "text": ""} and parts[1] == reasoning["content"][0]


def test_the_messages_api_gives_thinking_blocks_whole_and_streamed():
    """Anthropic's Messages API: the reasoning is a thinking block before the text, whole and
    streamed; `thinking` disabled renders the template with enable_thinking false; reasoning
    then a call is a thinking block, then a tool_use block."""
    import json

    import httpx

    def blocks(base: str, **body) -> tuple[dict, list[dict], list[dict]]:
        body = {"model": "tiny", "messages": ASK, "max_tokens": 200, "temperature": 0, **body}
        whole = httpx.post(f"{base}/v1/messages", json=body, timeout=60).json()
        with httpx.stream("POST", f"{base}/v1/messages", json={**body, "stream": True}, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        built = []  # the stream's blocks put together
        for event in events:
            if event["type"] == "content_block_start":
                built.append(dict(event["content_block"]))
            elif event["type"] == "content_block_delta":
                delta = event["delta"]
                key = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"], "partial_json")
                block = built[event["index"]]
                block[key] = block.get(key, "") + delta[key]
        return whole, built, events

    with thinking_server({"on": ANSWERS["on"], "off": ANSWERS["off"]}) as base:
        whole, built, events = blocks(base)
        assert whole["content"] == [{"type": "thinking", "thinking": "They want a greeting.", "signature": ""},
                                    {"type": "text", "text": "Hello!"}]
        assert built == whole["content"] and whole["stop_reason"] == "end_turn"
        assert len([e for e in events if e.get("delta", {}).get("type") == "thinking_delta"]) > 1
        off, _, _ = blocks(base, thinking={"type": "disabled"})
        assert off["content"] == [{"type": "text", "text": "Hello, quickly."}]
        on, _, _ = blocks(base, thinking={"type": "enabled", "budget_tokens": 1024})
        assert on["content"] == whole["content"]

    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with thinking_server({"on": f"<think>\nI need the time.\n</think>\n\n{call}"}, tools) as base:
        whole, built, _ = blocks(base, tools=[{"name": "get_time", "input_schema": {"type": "object"}}])
    thinking, use = whole["content"]
    assert thinking["thinking"] == "I need the time." and whole["stop_reason"] == "tool_use"
    assert use["type"] == "tool_use" and use["name"] == "get_time" and use["input"] == {}
    assert built[1]["partial_json"] == "{}" and built[0] == thinking
