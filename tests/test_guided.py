"""Constraints as vLLM and llama-server spell them (`server.guided`): guided_json, guided_regex,
guided_choice, guided_grammar, structured_outputs, grammar and json_schema, on the tiny model.
Each spelling of one constraint gives the answer `response_format` or another spelling gives,
every answer follows its constraint, and every misuse is a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from cadence.scheduler.grammar import Choice, GrammarCompiler
from cadence.server import entries
from tests.conftest import serve_tiny
from tests.structured_cases import SCHEMAS, schema_format

ASK = [{"role": "user", "content": "Is Paris in France?"}]
CHOICES = ["yes", "no", "it depends on the map"]
REGEX = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
GBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"'
LARK = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/ | "zz"'
DERIVES = re.compile(r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz))*\)")


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer) as base:
        yield base


def answers(url: str, body: dict, temperature: float = 0.0) -> list[str]:
    """The texts of a chat and a completion with `body`'s constraint (two choices sampled)."""
    common = {"max_tokens": 60, "temperature": temperature, "seed": 5, "n": 2 if temperature else 1, **body}
    chat = httpx.post(f"{url}/v1/chat/completions", json={**common, "messages": ASK}, timeout=120)
    text = httpx.post(f"{url}/v1/completions", json={**common, "prompt": "Answer:"}, timeout=120)
    assert chat.status_code == 200 and text.status_code == 200, (chat.text, text.text)
    return ([c["message"]["content"] for c in chat.json()["choices"]]
            + [c["text"] for c in text.json()["choices"]])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_kind_of_constraint_is_followed(url, temperature):
    for body, ok in [
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"guided_grammar": GBNF}, DERIVES.fullmatch),
        ({"grammar": LARK}, DERIVES.fullmatch),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
    ]:
        for text in answers(url, body, temperature):
            assert ok(text), (body, text)


@pytest.mark.parametrize("name", ["flat", "enum_and_array"])
def test_every_spelling_of_a_schema_gives_response_formats_answer(url, name):
    schema = SCHEMAS[name]
    want = answers(url, {"response_format": schema_format(name), "max_tokens": 200})
    for body in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                 {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
                 {"json_schema": schema}):
        got = answers(url, {**body, "max_tokens": 200})
        assert got == want, body
    for text in want:
        jsonschema.validate(json.loads(text), schema)


def test_gbnf_and_lark_of_one_language_answer_alike(url):
    assert answers(url, {"guided_grammar": GBNF}, 1.0) == answers(url, {"guided_grammar": LARK}, 1.0)


def test_a_streamed_choice_is_one_of_them(url):
    body = {"messages": ASK, "guided_choice": CHOICES, "stream": True, "temperature": 1.0, "seed": 3}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text in CHOICES and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_batch_line_takes_them_too(tiny_tokenizer):
    grammars = GrammarCompiler(tiny_tokenizer, tiny_tokenizer.vocab_size)
    try:
        entry = entries.to_request({"prompt": "x", "guided_choice": ["a", "b"]}, tiny_tokenizer,
                                   grammars=grammars)
        assert entry.params.grammar.spec == Choice(("a", "b"))
    finally:
        grammars.close()


@pytest.mark.parametrize("body, param, fragment", [
    ({"guided_choice": CHOICES, "guided_regex": "a"}, "guided_choice", "one constraint"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "response_format"),
    ({"grammar": GBNF, "structured_outputs": {"regex": "a"}}, "structured_outputs", "one constraint"),
    ({"guided_regex": "a(b"}, "guided_regex", "cannot"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "cannot be used"),
    ({"guided_choice": []}, "guided_choice", "non-empty strings"),
    ({"guided_choice": ["a", 3]}, "guided_choice", "non-empty strings"),
    ({"guided_json": "{not json"}, "guided_json", "JSON schema"),
    ({"json_schema": [1]}, "json_schema", "JSON schema"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "not supported"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown field"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "true or false"),
    ({"structured_outputs": {"choice": CHOICES, "json_object": True}}, "structured_outputs", "choice and json_object"),
    ({"guided_decoding_backend": 3}, "guided_decoding_backend", "string"),
])
def test_misuse_is_a_400_naming_the_field(url, body, param, fragment):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_the_backend_is_accepted_and_changes_nothing(url):
    plain = answers(url, {"guided_choice": CHOICES}, 1.0)
    assert answers(url, {"guided_choice": CHOICES, "guided_decoding_backend": "xgrammar"}, 1.0) == plain
