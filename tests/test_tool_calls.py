"""Tool-call parsing (server/tool_call_parser.py): Hermes, Llama 3 and Mistral calls, whole and
streamed, in any split."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.server.tool_call_parser import (ARGS, CALL_ID, CLOSE, OPEN, PYTHON_TAG, TOOL_CALLS, Delta,
                                             ToolCall, ToolCallParser, parse_tool_calls)

NAMES = {"get_weather", "get_time"}
WS = " \t\n\r"


def counter_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def stream(text: str, names=NAMES, cuts=(), mistral=False, list_tag=None) -> tuple[ToolCallParser, list[Delta]]:
    parser = ToolCallParser(names, new_id=counter_ids(), mistral=mistral, list_tag=list_tag)
    bounds = sorted(set(cuts) | {0, len(text)})
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    return parser, deltas + [parser.finish()]


def collect(deltas: list[Delta]) -> tuple[str, list[tuple[str, str, str]]]:
    """The content, and (id, name, arguments) per delta index, checking the deltas' shape:
    one entry per index in a delta, as OpenAI streams them (a header may carry arguments)."""
    content, calls = "", []
    for delta in deltas:
        content += delta.content
        indexes = [entry["index"] for entry in delta.tool_calls]
        assert len(indexes) == len(set(indexes))
        for entry in delta.tool_calls:
            if "id" in entry:
                assert entry == {"index": len(calls), "id": entry["id"], "type": "function",
                                 "function": {"name": entry["function"]["name"],
                                              "arguments": entry["function"]["arguments"]}}
                calls.append([entry["id"], entry["function"]["name"], entry["function"]["arguments"]])
            else:
                assert set(entry) == {"index", "function"}
                assert set(entry["function"]) == {"arguments"}
                assert entry["function"]["arguments"]
                calls[entry["index"]][2] += entry["function"]["arguments"]
    return content, [tuple(call) for call in calls]


def check(text: str, names=NAMES, extra_cuts=(), mistral=False, list_tag=None) -> tuple[str, list[ToolCall]]:
    """Parses `text` whole, one character at a time and in the given splits; they must agree.
    Returns the streamed content (unstripped) and the calls."""
    splits = [(), range(1, len(text)), *extra_cuts]
    results = []
    for cuts in splits:
        parser, deltas = stream(text, names, cuts, mistral, list_tag)
        content, streamed = collect(deltas)
        live = [call for i, call in enumerate(streamed) if i not in parser.abandoned]
        assert [(c.id, c.name, c.arguments) for c in parser.calls] == live
        for call in parser.calls:
            assert isinstance(json.loads(call.arguments), dict)
        results.append((content, [(c.name, c.arguments) for c in parser.calls], parser.abandoned))
    assert all(result == results[0] for result in results)
    whole_content, whole_calls = parse_tool_calls(text, names, mistral=mistral, list_tag=list_tag)
    assert whole_content == (results[0][0].strip() or None)
    assert [(c.name, c.arguments) for c in whole_calls] == results[0][1]
    return results[0][0], parser.calls


# Hermes / Qwen


def test_hermes_example():
    text = ('I\'ll check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
            '</tool_call>')
    content, calls = check(text)
    assert content == "I'll check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")]
    assert [c.id for c in calls] == ["call_" + "0" * 24, "call_" + "0" * 23 + "1"]


def test_content_before_between_and_after_calls():
    call = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    content, calls = check(f"Let me see.  {call}\n\nand also\n{call}\n  Done: 2 calls.\n")
    # The whitespace next to a call goes; the rest, the final newline included, stays.
    assert content == "Let me see.and alsoDone: 2 calls.\n"
    assert len(calls) == 2
    assert parse_tool_calls(f"A {call} B", NAMES)[0] == "AB"


def test_arguments_stream_as_they_arrive():
    parser = ToolCallParser(NAMES, new_id=lambda: "call_" + "a" * 24)
    delta = parser.feed('Sure.\n<tool_call>\n{"name": "get_weather", ')
    assert delta == Delta("Sure.")
    delta = parser.feed('"arguments": {"city": "Pa')
    assert delta.content == ""
    # One entry for index 0 (OpenAI's shape): the header with the arguments' first fragment.
    assert delta.tool_calls == [
        {"index": 0, "id": "call_" + "a" * 24, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]
    assert parser.calls == []
    # Nothing after the arguments' own closing brace is arguments.
    delta = parser.feed('ris"}}\n</tool_call>')
    assert delta.tool_calls == [{"index": 0, "function": {"arguments": 'ris"}'}}]
    assert parser.calls == [ToolCall("call_" + "a" * 24, "get_weather", '{"city": "Paris"}')]
    assert parser.feed("\n") == Delta() and parser.finish() == Delta()


def test_other_key_order_is_held_then_sent_whole():
    parser = ToolCallParser(NAMES)
    assert parser.feed('<tool_call>{"arguments": {"city": "Oslo"}, ') == Delta()
    delta = parser.feed('"name": "get_weather"}</tool_call>')
    assert [entry["function"] for entry in delta.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    content, calls = check('<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}'
                           '</tool_call>')
    assert content == "" and calls[0].arguments == '{"city": "Oslo"}'


def test_unknown_name_is_content_exactly():
    text = '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, {"get_weather"}) == (text, [])
    parser, deltas = stream(text, {"get_weather"}, range(len(text)))
    assert all(not delta.tool_calls for delta in deltas)
    # A real call after it is still found.
    content, calls = check(f"{text}\n<tool_call>{{\"name\": \"get_time\"}}</tool_call>")
    assert content == text and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]


@pytest.mark.parametrize("body", [
    '{"name": "get_weather", "arguments": "Paris"}',        # arguments not an object
    '{"name": "get_weather", "arguments": [1]}',
    '{"name": 3, "arguments": {}}',                         # name not a string
    '{"arguments": {"city": Paris}, "name": "get_weather"}',  # malformed, held
    '{"name": "get_weather", "arguments": {}} trailing',      # not followed by the object's end
    '[{"name": "get_weather", "arguments": {}}]',
    'not json at all',
    '',
])
def test_not_calls_are_content_exactly(body):
    text = f"Before <tool_call>{body}</tool_call> after"
    if body.endswith("trailing"):
        # The call stands (its header was out, its arguments parsed); the rest is content.
        content, calls = check(text)
        assert content == "Beforetrailing</tool_call> after" and len(calls) == 1
        return
    content, calls = check(text)
    assert content == text and calls == []


def test_malformed_arguments_after_the_header_abandon_the_call():
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'
    good = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    parser, deltas = stream(f"{bad}\n{good}")
    content, streamed = collect(deltas)
    assert content == bad
    assert parser.abandoned == [0]
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_time", "{}")]
    # The client saw the abandoned header at index 0; the next call takes index 1.
    assert [(name, args) for _, name, args in streamed] == [
        ("get_weather", '{"city": Paris}'), ("get_time", "{}")]
    check(f"{bad}\n{good}")


def test_unclosed_tag_at_finish():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": '
    assert parse_tool_calls(text, NAMES) == (text.strip(), [])
    parser, deltas = stream(text)
    assert collect(deltas)[0] == text and parser.abandoned == [0] and parser.calls == []
    for text in ["Hmm <tool_call>", "Hmm <tool_call>\n", "Hmm <tool_call>{", "Hmm <tool_",
                 '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"']:
        assert check(text) == (text, [])


def test_complete_json_without_its_ends_is_a_call():
    # No closing tag; a missing outer brace; cut off after the arguments.
    for text in ['<tool_call>{"name": "get_time", "arguments": {}}',
                 '<tool_call>{"name": "get_time", "arguments": {}\n</tool_call>Done',
                 '<tool_call>\n{"name": "get_time", "arguments": {}  ']:
        content, calls = check(text)
        assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
        assert content == ("Done" if "Done" in text else "")


def test_tricky_strings_in_arguments():
    args = ('{"q": "a } b { c ] [", "s": "say \\"hi\\" </tool_call> <tool_call>", '
            '"path": "C:\\\\dir\\\\", "n": [1, {"x": "}"}], "u": "\\u00e9\\ud83c\\udf27"}')
    text = f'Ok <tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call> bye'
    content, calls = check(text)
    assert content == "Okbye"
    assert calls[0].arguments == args
    assert json.loads(args)["s"] == 'say "hi" </tool_call> <tool_call>'


def test_unicode_is_kept_as_written():
    args = '{"city": "Zürich", "note": "東京 🌧", "esc": "\\u00fc"}'
    text = f'Voilà — 東京 🌧\n<tool_call>{{"name": "get_weather", "arguments": {args}}}{CLOSE}'
    content, calls = check(text)
    assert content == "Voilà — 東京 🌧" and calls[0].arguments == args


def test_content_is_held_only_while_it_may_start_a_call():
    parser = ToolCallParser(NAMES)
    assert parser.feed("Hello, wor") == Delta("Hello, wor")
    assert parser.feed("ld <tool") == Delta("ld")
    assert parser.feed("box> is") == Delta(" <toolbox> is")
    assert parser.feed(" a <") == Delta(" a")
    assert parser.feed("b>") == Delta(" <b>")
    assert parser.finish() == Delta()


def test_extra_keys_and_missing_arguments():
    content, calls = check('<tool_call>{"name": "get_time", "arguments": {}, "id": 7}</tool_call>')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    content, calls = check('<tool_call>{"name": "get_time"}</tool_call>')
    assert content == "" and calls[0].arguments == "{}"


# Llama 3


def test_llama_examples():
    content, calls = check('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')]
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, {"y": "}"}]}}'
    content, calls = check(text, {"a", "b"})
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("a", "{}"), ("b", '{"x": [1, {"y": "}"}]}')]


def test_llama_calls_then_text():
    text = ('\n {"name": "get_time", "arguments": {}}\n'
            '{"name": "get_time", "parameters": {"tz": 1}}\nIt is noon.')
    content, calls = check(text)
    assert content == "It is noon." and len(calls) == 2
    content, calls = check('{"name": "get_time", "parameters": {}}; and then')
    assert content == "; and then" and len(calls) == 1


def test_llama_3_2_style_with_a_type_key():
    text = '{"type": "function", "name": "get_weather", "parameters": {"city": "Rome"}}'
    content, calls = check(text)
    assert content == "" and calls[0].arguments == '{"city": "Rome"}'


@pytest.mark.parametrize("text", [
    'Use {"name": "x"} like this',
    'Use {"name": "get_time", "parameters": {}} like this',   # not at the start
    '{"answer": 42}',
    '  {"name": "x", "parameters": {}}',
    '{"name": "get_time", "parameters": {} oops',
    '<|python_tag|>print("hi")',
    '<|python_tag|>{"name": "nope"}',
    '<|python',
    '{',
    '   ',
])
def test_llama_not_calls_are_content_exactly(text):
    content, calls = check(text, NAMES | {"x"} if text.startswith("Use") else NAMES)
    if "oops" in text:  # the arguments parsed: the call stands, the rest is content
        assert content == "oops" and len(calls) == 1
    else:
        assert content == text and calls == []


def test_no_tools_means_no_calls():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    parser = ToolCallParser(())
    assert parser.feed(text) == Delta(text) and parser.finish() == Delta() and parser.calls == []
    assert parse_tool_calls(text, ()) == (text, [])


# Mistral


def test_mistral_list_of_calls():
    content, calls = check('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                           '{"name": "get_time", "arguments": {}}]', mistral=True)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'),
                                                      ("get_time", "{}")]


def test_mistral_calls_after_content_and_bare_objects():
    content, calls = check('Let me look. [TOOL_CALLS] {"name": "get_time", "arguments": {"z": [1]}}\n'
                           '{"name": "get_weather", "arguments": {}} done', mistral=True)
    assert content == "Let me look.done"
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"z": [1]}'), ("get_weather", "{}")]


def test_mistral_name_and_args_calls_stream_their_arguments():
    text = (f'{TOOL_CALLS}get_weather{ARGS}{{"city": "Paris", "days": [1, 2]}}'
            f'{TOOL_CALLS}get_time{CALL_ID}a1B2c3D4e{ARGS} {{}}')
    content, calls = check(text, mistral=True)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris", "days": [1, 2]}'),
                                                      ("get_time", "{}")]
    parser = ToolCallParser(NAMES, new_id=counter_ids(), mistral=True)
    assert parser.feed(f'{TOOL_CALLS}get_weather{ARGS}{{"city": "Pa').tool_calls == [
        {"index": 0, "id": "call_" + "0" * 24, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]
    assert parser.feed('ris"} ok').tool_calls == [{"index": 0, "function": {"arguments": 'ris"}'}}]


@pytest.mark.parametrize("text", [
    f'{TOOL_CALLS}[{{"name": "nope", "arguments": {{}}}}]',
    f'{TOOL_CALLS}nope{ARGS}{{"a": 1}} and more',
    f'{TOOL_CALLS}get_time{ARGS}"not an object"',
    f'{TOOL_CALLS}get_time [ARGS]{{}}',
    f'{TOOL_CALLS}"get_time"',
    f'{TOOL_CALLS}[]',
    f'{TOOL_CALLS}',
    f'{TOOL_CALLS}get_time{CALL_ID}',
    'plain text with a [TOOL bracket',
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',  # Hermes' is not Mistral's
    '{"name": "get_time", "arguments": {}}',  # nor is Llama's
])
def test_mistral_not_calls_are_content_exactly(text):
    content, calls = check(text, mistral=True)
    assert calls == [] and content == text


def test_a_mistral_list_that_ends_badly_keeps_what_is_not_syntax():
    content, calls = check(f'{TOOL_CALLS}[{{"name": "get_time", "arguments": {{}}}}, ] x', mistral=True)
    assert [c.name for c in calls] == ["get_time"] and content == ", ] x"
    content, calls = check(f'{TOOL_CALLS}[{{"name": "get_time", "arguments": {{}}}}; y', mistral=True)
    assert [c.name for c in calls] == ["get_time"] and content == "; y"


def test_granite_lists_after_its_tag():
    tag = "<|tool_call|>"
    text = f'Sure.{tag}[{{"arguments": {{"city": "Paris"}}, "name": "get_weather"}}, {{"name": "get_time"}}]'
    content, calls = check(text, list_tag=tag)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert all(c.id.startswith("call_") for c in parse_tool_calls(text, NAMES, list_tag=tag)[1])
    assert parse_tool_calls("[TOOL_CALLS][]", NAMES, list_tag=tag) == ("[TOOL_CALLS][]", [])


def test_mistral_calls_are_content_to_the_default_parser():
    text = f'{TOOL_CALLS}[{{"name": "get_time", "arguments": {{}}}}]'
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_mistral_broken_arguments_abandon_the_call_and_keep_the_text():
    text = f'{TOOL_CALLS}get_weather{ARGS}{{"city": ]'
    parser, deltas = stream(text, mistral=True)
    content, sent = collect(deltas)
    assert parser.calls == [] and parser.abandoned == [0] and sent[0][1] == "get_weather"
    assert content == text


def test_mistral_ids_are_nine_letters_and_digits():
    _, calls = parse_tool_calls(f"{TOOL_CALLS}get_time{ARGS}{{}}" * 3, NAMES, mistral=True)
    assert len(calls) == 3 and len({c.id for c in calls}) == 3
    assert all(re.fullmatch(r"[a-zA-Z0-9]{9}", c.id) for c in calls)


def test_ids_and_message_shape():
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time"}</tool_call>' * 3, NAMES)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)
    assert len({call.id for call in calls}) == 3
    assert calls[0].message() == {"id": calls[0].id, "type": "function",
                                  "function": {"name": "get_time", "arguments": "{}"}}


def test_finish_ends_the_parser():
    parser = ToolCallParser(NAMES)
    parser.feed("hi ")
    assert parser.finish() == Delta(" ")
    assert parser.finish() == Delta()
    with pytest.raises(RuntimeError):
        parser.feed("more")


# Generated answers in random splits

_WORDS = ["Sure", "a", " ", "\n", "\t", "<", ">", "{", "}", "[", "]", '"', ";", "tool", "_call",
          "é", "東京", "x y", PYTHON_TAG, OPEN]
content_text = st.lists(st.sampled_from(_WORDS), max_size=8).map("".join)
string_text = st.lists(st.sampled_from(["a", " ", '"', "\\", "{", "}", "[", "]", "<", ">", CLOSE,
                                        OPEN, "é", "🌧", "\n"]), max_size=5).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | string_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(string_text, inner, max_size=3),
    max_leaves=8)
ws = st.sampled_from(["", " ", "\n", "  ", "\n\t"])


@st.composite
def calls_json(draw, llama: bool):
    """(the call's JSON text as a model might write it, name, arguments' text, arguments)."""
    name = draw(st.sampled_from(sorted(NAMES)))
    args = draw(st.dictionaries(string_text, json_values, max_size=4))
    args_text = json.dumps(args, ensure_ascii=draw(st.booleans()),
                           indent=draw(st.sampled_from([None, 2])),
                           separators=draw(st.sampled_from([(", ", ": "), (",", ":")])))
    key = draw(st.sampled_from(["parameters", "arguments"])) if llama else "arguments"
    w = [draw(ws) for _ in range(8)]
    name_part = f'"name"{w[0]}:{w[1]}{json.dumps(name)}'
    args_part = f'"{key}"{w[2]}:{w[3]}{args_text}'
    if not args and draw(st.booleans()):
        parts, args_text = [name_part], "{}"
    else:
        parts = [name_part, args_part] if draw(st.booleans()) else [args_part, name_part]
    text = "{" + w[4] + f"{w[5]},{w[6]}".join(parts) + w[7] + "}"
    return text, name, args_text, args


@st.composite
def answers(draw):
    """(text, expected content as streamed, expected [(name, arguments' text, arguments)])."""
    if draw(st.booleans()):  # Hermes: content and calls interleaved
        n = draw(st.integers(0, 3))
        pieces = [draw(content_text) for _ in range(n + 1)]
        calls = [draw(calls_json(llama=False)) for _ in range(n)]
        text = pieces[0]
        for call, piece in zip(calls, pieces[1:]):
            close = draw(ws) + CLOSE if draw(st.integers(0, 9)) else ""
            text += OPEN + draw(ws) + call[0] + close + piece
        if n == 0:
            expected = pieces[0]
        else:
            expected = (pieces[0].rstrip(WS) + "".join(p.strip(WS) for p in pieces[1:-1])
                        + pieces[-1].lstrip(WS))
    else:  # Llama: calls at the start, then content
        calls = draw(st.lists(calls_json(llama=True), min_size=1, max_size=3))
        lead = draw(ws) + draw(st.sampled_from(["", PYTHON_TAG])) + draw(ws)
        seps = [draw(st.sampled_from(["", " ", "\n", ";", "; ", "\n;\n"])) for _ in calls]
        trailing = draw(content_text)
        text = lead + "".join(sep + call[0] for sep, call in zip(["", *seps], calls)) + trailing
        expected = trailing.lstrip(WS)
    return text, expected, [call[1:] for call in calls]


@st.composite
def mistral_answers(draw):
    """(text, expected content as streamed, expected calls), Mistral's way: content, then calls
    after [TOOL_CALLS] (a list, bare objects, or name[ARGS]arguments), then maybe more content."""
    pieces = [draw(mistral_text) for _ in range(3)]
    calls, text = [], pieces[0]
    for piece in pieces[1:]:
        batch = draw(st.lists(calls_json(llama=False), min_size=1, max_size=3))
        form = draw(st.sampled_from(["list", "bare", "args"]))
        if form == "args":
            text += "".join(TOOL_CALLS + name + draw(st.sampled_from(["", CALL_ID + "x1Y2z3W4v"]))
                            + ARGS + draw(ws) + args for _, name, args, _ in batch)
        else:
            sep = "," if form == "list" else ""
            objects = f"{sep}{draw(ws)}".join(call[0] for call in batch)
            text += TOOL_CALLS + draw(ws) + (f"[{draw(ws)}{objects}{draw(ws)}]" if form == "list" else objects)
        text += piece
        calls += batch
    expected = pieces[0].rstrip(WS) + pieces[1].strip(WS) + pieces[2].lstrip(WS)
    return text, expected, [call[1:] for call in calls]


mistral_text = st.lists(st.sampled_from(["Sure", " ", "\n", "[", "]", "{", "}", "TOOL", "ARGS",
                                         "é", OPEN, "x"]), max_size=6).map("".join).filter(
    lambda t: t.strip(WS)[:1] not in ("[", "]", "{", ",") and not t.rstrip(WS).endswith("["))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=mistral_answers(), data=st.data())
def test_generated_mistral_answers_in_random_splits(answer, data):
    text, expected_content, expected_calls = answer
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    content, calls = check(text, extra_cuts=[cuts], mistral=True)
    assert content == expected_content
    assert [(c.name, c.arguments) for c in calls] == [(n, a) for n, a, _ in expected_calls]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=answers(), data=st.data())
def test_generated_answers_in_random_splits(answer, data):
    text, expected_content, expected_calls = answer
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    content, calls = check(text, extra_cuts=[cuts])
    assert content == expected_content
    assert [(c.name, c.arguments) for c in calls] == [(n, a) for n, a, _ in expected_calls]
    assert [json.loads(c.arguments) for c in calls] == [args for _, _, args in expected_calls]
    parser, deltas = stream(text, cuts=cuts)
    assert parser.abandoned == []
    if not expected_calls:
        assert content == text
        assert parse_tool_calls(text, NAMES) == (text.strip() or None, [])
