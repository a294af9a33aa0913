"""What real OpenAI clients send, over loopback HTTP on the tiny model: the official SDK's tools
built from nested Pydantic models, streamed calls as instructor reassembles them, strict schemas,
batched completions prompts (lm-eval, LiteLLM), served model names, /tokenize and /detokenize,
the newer fields clients add, and the failures a fault-injection run found (self-referring
schemas, deep tool-call arguments, slow compiles beside plain requests, unbounded labels)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest

import cadence
from cadence.scheduler.grammar import JSON_SAFE_INTEGER, GrammarCompiler, JsonSchema, closed_schema
from cadence.server.tool_call_parser import parse_tool_calls
from cadence.server.tool_requests import HERMES, CallStyle, parse_tools
from tests.conftest import SERVING_ENGINE, serve_tiny

NAMES = ("tiny", "tiny-alias")
TIMEOUT = httpx.Timeout(120.0, connect=5.0)


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer, NAMES) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def long_client(tiny_params, tiny_config, tiny_tokenizer):
    """A server whose context holds cadence's tool section and a Pydantic tool's schema in the
    tiny tokenizer's many short tokens."""
    from cadence.engine.config import EngineConfig
    from cadence.engine.engine import Engine

    config = dataclasses.replace(tiny_config, max_context=1024)  # (RoPE: the weights are the same)
    engine = Engine(tiny_params, config, EngineConfig(**{**SERVING_ENGINE, "max_seq_len": 1024,
                                                         "num_slots": 2, "prefill_chunk": 256}))
    engine.warmup()
    with serve_tiny(engine, tiny_tokenizer, NAMES) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def chat(url: str, **body) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "Who is on the team?"}])
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)


class Person(pydantic.BaseModel):
    name: str
    age: int


class Team(pydantic.BaseModel):
    lead: Person
    members: list[Person]


class Pt(pydantic.BaseModel):  # small enough for the tiny model's context, with the tool section
    x: int


class Ln(pydantic.BaseModel):
    a: Pt
    b: list[Pt]


# -- tools and schemas ------------------------------------------------------------------------


@pytest.mark.slow  # its server's warm-up; test_forced_calls_of_nested_models_walk_to_valid_arguments is the fast check
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_of_nested_pydantic_models_is_called_validly(long_client, choice):
    """`pydantic_function_tool` puts the nested model under `$defs` and refers to it by
    `#/$defs/Pt`: forced calls compile and their arguments validate as the model."""
    tool = openai.pydantic_function_tool(Ln)
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "Ln"}}
    finished = 0
    for seed in range(4):
        answer = long_client.chat.completions.create(
            model=NAMES[0], messages=[{"role": "user", "content": "A line."}], tools=[tool],
            tool_choice=tool_choice, temperature=1.0, seed=seed, max_tokens=300)
        choice_ = answer.choices[0]
        if choice_.finish_reason == "length":
            continue  # a random model may ramble inside a string; what it wrote so far was valid
        finished += 1
        assert choice_.message.tool_calls
        for call in choice_.message.tool_calls:  # ("required" allows several)
            assert call.function.name == "Ln"
            Ln.model_validate_json(call.function.arguments)
    assert finished


def test_forced_calls_of_nested_models_walk_to_valid_arguments(tiny_tokenizer):
    """The grammar of a forced call to several nested-model tools, walked at random: every
    complete walk is one call whose arguments validate as its tool's model."""
    tools = parse_tools({"tools": [openai.pydantic_function_tool(Team), openai.pydantic_function_tool(Ln)],
                         "tool_choice": "required", "parallel_tool_calls": False})
    compiler = GrammarCompiler(tiny_tokenizer, tiny_tokenizer.vocab_size)
    grammar = compiler.compile(tools.grammar(CallStyle(HERMES)))
    rng = np.random.default_rng(0)
    row = np.zeros((tiny_tokenizer.vocab_size + 31) // 32, np.int32)
    complete = 0
    for _ in range(20):
        matcher, ids = grammar.matcher(), []
        while not matcher.done and len(ids) < 400:
            assert matcher.fill(row)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            allowed = allowed[allowed < tiny_tokenizer.vocab_size]
            eos = [t for t in allowed if t in tiny_tokenizer.eos_ids]
            token = int(eos[0] if eos and rng.random() < 0.5 else rng.choice(allowed))
            if token in tiny_tokenizer.eos_ids:
                break
            assert matcher.accept(token)
            ids.append(token)
        if len(ids) >= 400:
            continue
        complete += 1
        _, calls = parse_tool_calls(tiny_tokenizer.decode(ids), tools.names)
        (call,) = calls
        {"Team": Team, "Ln": Ln}[call.name].model_validate_json(call.arguments)
    assert complete >= 5
    compiler.close()


@pytest.mark.slow
def test_a_tool_schema_referring_to_itself_keeps_its_root(long_client):
    """A recursive tool schema ("#" is the parameters' root) still means the parameters."""
    tree = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 3},
                                             "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
            "required": ["label", "kids"]}
    tool = {"type": "function", "function": {"name": "tree", "parameters": tree}}
    answer = long_client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": "A tree."}], tools=[tool],
        tool_choice="required", temperature=0, max_tokens=120)
    if answer.choices[0].finish_reason != "length":
        arguments = json.loads(answer.choices[0].message.tool_calls[0].function.arguments)
        jsonschema.validate(arguments, closed_schema(tree))


@pytest.mark.slow
def test_streamed_calls_carry_one_entry_per_index_and_reassemble(long_client):
    """instructor's partial streaming reads one `tool_calls` entry per index per chunk and
    joins the arguments: what it joins is the non-streamed answer's arguments."""
    tool = openai.pydantic_function_tool(Pt)
    kwargs = dict(model=NAMES[0], messages=[{"role": "user", "content": "A point."}], tools=[tool],
                  tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
    whole = long_client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    arguments, ids = {}, {}
    for chunk in long_client.chat.completions.create(**kwargs, stream=True):
        entries = chunk.choices[0].delta.tool_calls or [] if chunk.choices else []
        indexes = [e.index for e in entries]
        assert len(indexes) == len(set(indexes)), entries
        for e in entries:
            if e.id:
                ids[e.index] = e.id
            arguments[e.index] = arguments.get(e.index, "") + (e.function.arguments or "")
    assert list(arguments) == [0] and arguments[0] == whole.function.arguments
    Pt.model_validate_json(arguments[0])


def test_undeclared_keys_and_endless_integers_are_not_allowed():
    """`closed_schema`: objects that name their properties allow no others, unless the schema
    says otherwise; integers without bounds are bounded to JSON's exact integers."""
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "bag": {"type": "object", "additionalProperties": {"type": "integer"}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}}]},
        "both": {"allOf": [{"properties": {"x": {"type": "string"}}}, {"properties": {"y": {"type": "string"}}}]}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["n"] == {"type": "integer", "minimum": -JSON_SAFE_INTEGER, "maximum": JSON_SAFE_INTEGER}
    assert closed["properties"]["bag"]["additionalProperties"] == {
        "type": "integer", "minimum": -JSON_SAFE_INTEGER, "maximum": JSON_SAFE_INTEGER}
    assert closed["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["properties"]["either"]["anyOf"][0]["properties"]["a"]["maximum"] == 5
    assert all("additionalProperties" not in branch for branch in closed["properties"]["both"]["allOf"])
    assert schema["properties"]["n"] == {"type": "integer"}  # the client's schema is not changed


def test_a_closed_schema_grammar_refuses_other_keys_and_long_integers(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, tiny_tokenizer.vocab_size)
    grammar = compiler.compile(JsonSchema(closed_schema(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})))

    def accepts(text: str) -> bool:
        matcher = grammar.matcher()
        row = np.zeros((tiny_tokenizer.vocab_size + 31) // 32, np.int32)
        for token in tiny_tokenizer.encode(text, add_bos=False):
            matcher.fill(row)
            if not (row[token // 32] >> (token % 32)) & 1 or not matcher.accept(token):
                return False
        return True

    assert accepts('{"n": 12}') and accepts('{"n": -9007199254740991}')
    assert not accepts('{"n": 12, "m"') and not accepts('{"n": 9007199254740992')
    assert not accepts('{"n": 1234567890123456789')
    compiler.close()


def test_a_strict_response_format_answer_has_only_its_keys(url):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"]}
    for seed in range(3):
        response = chat(url, temperature=1.0, seed=seed, max_tokens=80, response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            assert set(value) == {"city", "population"} and abs(value["population"]) <= JSON_SAFE_INTEGER


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                     "$ref": "#/$defs/a"}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_allows_nothing_is_a_400_before_any_token(url, schema, stream):
    response = chat(url, stream=stream, response_format={
        "type": "json_schema", "json_schema": {"name": "loop", "schema": schema}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and "allows no output" in error["message"]


def test_deeply_nested_arguments_in_an_earlier_call_are_a_400(url):
    deep = "[" * 5000 + "]" * 5000
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    response = chat(url, messages=messages, tools=tools, max_tokens=2)
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.json()["error"]["message"]
    # Arguments that are not JSON at all are passed through as text, as before.
    messages[1]["tool_calls"][0]["function"]["arguments"] = "not json"
    assert chat(url, messages=messages, tools=tools, max_tokens=2).status_code == 200


def _slow_schema(i: int) -> dict:
    """A schema that takes llguidance a while to compile (distinct per i: no cache hit)."""
    return {"type": "object", "properties": {
        f"k{k}": {"anyOf": [{"type": "string", "pattern": f"^a{i}x{j}[a-z]{{2,9}}y{k}$"} for j in range(40)]}
        for k in range(120)}}


def test_plain_requests_do_not_wait_behind_slow_compiles(url):
    """Twelve slow schemas compiling (two at a time) hold no thread a plain request needs: the
    plain chat sent after them is answered before most of them."""

    async def run() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            async def send(name: str, body: dict) -> None:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
                response = await http.post(f"{url}/v1/chat/completions", json=body)
                assert response.status_code in (200, 400), response.text
                finished.append(name)

            slow = [asyncio.create_task(send(f"schema{i}", {"response_format": {
                "type": "json_schema", "json_schema": {"name": "s", "schema": _slow_schema(i)}}}))
                for i in range(12)]
            await asyncio.sleep(0.3)  # they are all waiting on the compiler by now
            await send("plain", {"temperature": 0})
            await asyncio.gather(*slow)
        return finished

    finished = asyncio.run(run())
    assert finished.index("plain") < 6, finished


def test_priority_labels_are_bounded(url):
    before = len(httpx.get(f"{url}/metrics").text)
    for priority in range(100, 140):
        response = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT,
                              json={"prompt": "x", "max_tokens": 1, "priority": priority})
        assert response.status_code == 200, response.text
    text = httpx.get(f"{url}/metrics").text
    assert 'priority="other"' in text and 'priority="120"' not in text
    assert len(text) < before + 40_000  # one more label's series, not forty


# -- batched prompts --------------------------------------------------------------------------


def completion(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_batch_of_prompts_answers_each_in_order(url, tiny_tokenizer):
    """Strings and token-id arrays in one `prompt`; n=2 and logprobs: choice k*n + j is prompt
    k's choice j, equal to the prompt sent alone; usage adds up."""
    ids = tiny_tokenizer.encode("token ids too")
    prompts = ["The first prompt", ids, "And a third, longer than the others are"]
    body = dict(max_tokens=6, temperature=0.8, seed=7, n=2, logprobs=2, ignore_eos=True)
    batch = completion(url, prompt=prompts, **body)
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    alone = [completion(url, prompt=p, **body) for p in prompts]
    for k, single in enumerate(alone):
        for j in range(2):
            got, want = batch["choices"][k * 2 + j], single["choices"][j]
            assert got["text"] == want["text"]
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            np.testing.assert_allclose(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"], atol=1e-5)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(a["usage"][key] for a in alone)


def test_a_streamed_batch_with_echo_indexes_its_chunks(url):
    prompts = ["Echo me", "and me as well"]
    body = dict(prompt=prompts, max_tokens=5, temperature=0, echo=True, ignore_eos=True)
    whole = completion(url, **body)
    texts: dict[int, str] = {}
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=TIMEOUT,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                (choice,) = chunk["choices"]
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            else:
                usage = chunk["usage"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert [texts[k].startswith(p) for k, p in enumerate(prompts)] == [True, True]
    # the same prompts again: the prefix cache may lend them KV, and says so in the details
    assert {**usage, "prompt_tokens_details": None} == {**whole["usage"], "prompt_tokens_details": None}


def test_a_batch_the_sdk_sends(client):
    answer = client.completions.create(model=NAMES[1], prompt=["one", "two", "three"], max_tokens=3,
                                       temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2] and answer.model == NAMES[0]


@pytest.mark.parametrize("prompt, fragment", [
    ([], "must be a string"), ([[]], "must be a string"), (["a", 3], "must be a string"),
    (["x"] * 257, "at most 256"), ([[1, 2], [99999]], "[0, 512)"),
])
def test_bad_batches_are_refused_whole(url, prompt, fragment):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]
    assert httpx.get(f"{url}/get_load").json()[0]["num_reqs"] == 0  # nothing was left running


# -- names, routes and fields -----------------------------------------------------------------


def test_served_names_and_the_model_route(url, client):
    listed = [m.id for m in client.models.list()]
    assert listed == list(NAMES)
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    missing = httpx.get(f"{url}/v1/models/org/other-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for name in NAMES:
        assert chat(url, model=name, max_tokens=2).json()["model"] == NAMES[0]
    assert chat(url, model="gpt-4o", max_tokens=2).status_code == 404


def test_tokenize_and_detokenize(url, tiny_tokenizer):
    text = "Round trip, please."
    out = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert out["tokens"] == tiny_tokenizer.encode(text) and out["count"] == len(out["tokens"])
    assert "".join(out["token_strs"]) == tiny_tokenizer.decode(out["tokens"]) and out["max_model_len"] == 512
    bare = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tiny_tokenizer.encode(text, add_bos=False)
    back = httpx.post(f"{url}/detokenize", json={"tokens": out["tokens"], "model": NAMES[0]}).json()
    assert back["prompt"] == back["content"] == tiny_tokenizer.decode(out["tokens"])
    # A chat's tokens are the ones a chat request prefills.
    messages = [{"role": "user", "content": "Count my tokens."}]
    counted = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["count"]
    assert chat(url, messages=messages, max_tokens=1).json()["usage"]["prompt_tokens"] == counted
    for route, body, fragment in [("tokenize", {"prompt": "a", "messages": messages}, "exactly one"),
                                  ("tokenize", {"prompt": 5}, "must be a string"),
                                  ("tokenize", {"prompt": "a", "extra": 1}, "unrecognized"),
                                  ("tokenize", {"prompt": "x" * 100_000}, "exceeds the context of 512"),
                                  ("tokenize", {"messages": [{"role": "user", "content": "x" * 100_000}]},
                                   "exceeds the context of 512"),
                                  ("detokenize", {"tokens": [-1]}, "token ids"),
                                  ("detokenize", {"tokens": [1], "model": "other"}, "not served")]:
        response = httpx.post(f"{url}/{route}", json=body)
        assert response.status_code in (400, 404) and fragment in response.json()["error"]["message"], response.text


def test_llama_servers_tokenize_detokenize_and_apply_template(url, tiny_tokenizer):
    """llama-server's shapes: "content" without the BOS unless `add_special`, special tokens'
    text as their token unless `parse_special` is false, `with_pieces` (a piece that is not
    whole UTF-8 as its bytes); /detokenize's "content"; /apply-template, a chat's prompt."""
    def tokenize(**body):
        response = httpx.post(f"{url}/tokenize", json=body)
        assert response.status_code == 200, response.text
        assert set(response.json()) == {"tokens"}
        return response.json()["tokens"]

    text = "Round trip, please. 語"
    assert tokenize(content=text) == tiny_tokenizer.encode(text, add_bos=False)
    assert tokenize(content=text, add_special=True) == tiny_tokenizer.encode(text)
    eos = tiny_tokenizer.eos_token
    assert tokenize(content=eos) == tiny_tokenizer.encode(eos, add_bos=False) and len(tokenize(content=eos)) == 1
    spelled = tokenize(content=eos, parse_special=False)
    assert spelled == tiny_tokenizer.encode(eos, add_bos=False, special=False) and len(spelled) > 1
    pieces = tokenize(content=text, with_pieces=True)
    assert [p["id"] for p in pieces] == tokenize(content=text)
    raw = [bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces]
    assert b"".join(raw) == text.encode() and any(isinstance(p["piece"], list) for p in pieces)
    assert all(isinstance(p["piece"], list) or p["piece"].encode() == tiny_tokenizer.token_bytes(p["id"])
               for p in pieces)
    back = httpx.post(f"{url}/detokenize", json={"tokens": tokenize(content=text)}).json()
    assert back == {"content": text, "prompt": text}

    messages = [{"role": "user", "content": "Count my tokens."}]
    prompt = httpx.post(f"{url}/apply-template", json={"messages": messages}).json()["prompt"]
    assert tokenize(content=prompt, add_special=True) == \
        httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    for route, body, param in [("tokenize", {"content": "a", "add_special_tokens": True}, "add_special_tokens"),
                               ("tokenize", {"prompt": "a", "with_pieces": True}, "with_pieces"),
                               ("tokenize", {"content": "a", "prompt": "a"}, None),
                               ("tokenize", {"content": "a", "parse_special": 1}, "parse_special"),
                               ("apply-template", {"prompt": "a"}, "prompt"),
                               ("apply-template", {}, None)]:
        response = httpx.post(f"{url}/{route}", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_llama_servers_routes_without_v1_and_its_token_counts(url, client, tiny_tokenizer):
    """llama-server's other spellings, for a client given a base URL without /v1: a chat at
    /chat/completions is /v1/chat/completions' answer, /models and /v1/health answer (and
    vLLM's /ping and /version); and its
    count routes (/v1/chat/completions/input_tokens, OpenAI's /v1/responses/input_tokens, which
    the openai SDK calls) count the prompt as the request's usage does, refusing what it would."""
    messages = [{"role": "user", "content": "Count my tokens."}]
    body = {"model": NAMES[0], "messages": messages, "max_tokens": 4, "temperature": 0}
    at_v1 = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    bare = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
    assert bare["choices"][0]["message"] == at_v1["choices"][0]["message"]
    assert httpx.get(f"{url}/models").json() == httpx.get(f"{url}/v1/models").json()
    assert httpx.get(f"{url}/v1/health").status_code == 200
    assert httpx.get(f"{url}/ping").json() == httpx.post(f"{url}/ping").json() == {"status": "ok"}
    assert httpx.get(f"{url}/version").json() == {"version": cadence.__version__}  # (vLLM's two)
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        counted = httpx.post(f"{url}{path}", json=body, timeout=60).json()
        assert counted == {"object": "response.input_tokens", "input_tokens": at_v1["usage"]["prompt_tokens"]}
    response = client.responses.create(model=NAMES[0], instructions="Be brief.", input="Count my tokens.",
                                       max_output_tokens=2)
    counted = client.responses.input_tokens.count(model=NAMES[0], instructions="Be brief.",
                                                  input="Count my tokens.")
    assert counted.object == "response.input_tokens" and counted.input_tokens == response.usage.input_tokens
    assert httpx.post(f"{url}/responses/input_tokens", json={"input": "Count my tokens.", "instructions": "Be brief."},
                      timeout=60).json()["input_tokens"] == response.usage.input_tokens
    for path, wrong, param in (("/v1/chat/completions/input_tokens", {"messages": messages, "top_k": "x"}, "top_k"),
                               ("/v1/responses/input_tokens", {"input": "x", "max_output_tokens": 0},
                                "max_output_tokens")):
        r = httpx.post(f"{url}{path}", json=wrong, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenizer_info_is_what_a_remote_tokenizer_needs(url, tiny_tokenizer):
    """lm-eval's remote tokenizer: /tokenizer_info's eos_token, encoded through /tokenize
    without special tokens, is the end-of-sequence id."""
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == tiny_tokenizer.eos_token and info["model_max_length"] == 512
    ids = httpx.post(f"{url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert ids["tokens"][0] in tiny_tokenizer.eos_ids


def test_a_json_object_format_with_a_schema_is_that_schema(url):
    """The older {"type": "json_object", "schema": ...} (instructor's JSON_SCHEMA mode) means
    json_schema with that schema."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    answers = []
    for fmt in ({"type": "json_object", "schema": schema},
                {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}):
        response = chat(url, temperature=0, max_tokens=20, response_format=fmt)
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"]["content"])
    value = json.loads(answers[0])
    assert answers[0] == answers[1] and set(value) == {"n"} and 0 <= value["n"] <= 9


def test_newer_harmless_fields_are_accepted_and_change_nothing(url):
    base = dict(max_tokens=6, temperature=0, ignore_eos=True)
    plain = chat(url, **base).json()["choices"][0]["message"]
    extra = chat(url, **base, prompt_cache_key="k", safety_identifier="u1", verbosity="low",
                 reasoning_effort="low", store=False, metadata={"a": "b"})
    assert extra.status_code == 200, extra.text
    assert extra.json()["choices"][0]["message"] == plain
    refused = chat(url, **base, web_search_options={})
    assert refused.status_code == 400 and re.search("unrecognized", refused.text)
