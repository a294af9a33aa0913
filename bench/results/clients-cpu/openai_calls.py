"""The official openai SDK against cadence-serve: the calls a user makes."""
import json
import sys
import urllib.error
import urllib.request

import openai
from openai import OpenAI

from harness import BASE, MODEL, Person, call, section

C = "openai " + openai.__version__
client = OpenAI(base_url=BASE + "/v1", api_key="none", timeout=180, max_retries=0)
MSG = [{"role": "user", "content": "Say hello in five words."}]
PERSON_MSG = [{"role": "user", "content": "Alice is 31 and lives at 12 Oak Street, Paris. "
                                          "Record her."}]


def only(*which):
    return len(sys.argv) < 2 or any(w in sys.argv[1:] for w in which)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def check_chat(r):
    expect(r.choices and r.choices[0].message.content is not None, "no content")
    return {"content": r.choices[0].message.content, "usage": r.usage.model_dump()}


def stream_chat():
    parts, usage, chunks = [], None, 0
    with client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=32, stream=True,
                                        stream_options={"include_usage": True}) as s:
        for ch in s:
            chunks += 1
            if ch.usage:
                usage = ch.usage
            for c in ch.choices:
                if c.delta.content:
                    parts.append(c.delta.content)
    expect(usage is not None, "no usage chunk")
    return {"chunks": chunks, "text": "".join(parts), "usage": usage.model_dump()}


def check_n(r):
    expect(len(r.choices) == 2 and sorted(c.index for c in r.choices) == [0, 1], "n=2 choices")
    return [c.message.content for c in r.choices]


def check_logprobs(r):
    lp = r.choices[0].logprobs.content
    expect(lp and len(lp[0].top_logprobs) == 3, "top_logprobs")
    return [(t.token, round(t.logprob, 3), [a.token for a in t.top_logprobs]) for t in lp[:4]]


def check_tool(forced):
    def check(r):
        m = r.choices[0].message
        if forced:
            expect(m.tool_calls, "no tool_calls although forced")
        if m.tool_calls:
            tc = m.tool_calls[0]
            Person.model_validate_json(tc.function.arguments)
            expect(r.choices[0].finish_reason == "tool_calls", f"finish_reason "
                   f"{r.choices[0].finish_reason}")
            return {"name": tc.function.name, "arguments": tc.function.arguments}
        return {"content": m.content}
    return check


def stream_tool():
    """Streamed forced tool call: at most one tool_calls entry per index per chunk; reassemble."""
    args, name, dup = {}, {}, 0
    with client.chat.completions.create(
            model=MODEL, messages=PERSON_MSG, max_tokens=200, stream=True,
            tools=[openai.pydantic_function_tool(Person)], tool_choice="required") as s:
        for ch in s:
            for c in ch.choices:
                idx = [tc.index for tc in (c.delta.tool_calls or [])]
                dup += len(idx) - len(set(idx))
                for tc in c.delta.tool_calls or []:
                    if tc.function and tc.function.name:
                        name[tc.index] = tc.function.name
                    if tc.function and tc.function.arguments:
                        args[tc.index] = args.get(tc.index, "") + tc.function.arguments
    expect(dup == 0, f"{dup} duplicate tool_calls indexes within a chunk")
    expect(args, "no streamed arguments")
    Person.model_validate_json(args[0])
    return {"name": name, "arguments": args}


def parse(beta):
    def fn():
        comp = client.beta.chat.completions if beta else client.chat.completions
        r = comp.parse(model=MODEL, messages=PERSON_MSG, max_tokens=200, response_format=Person)
        expect(r.choices[0].message.parsed is not None, "parsed is None")
        return r.choices[0].message.parsed
    return fn


def parse_tools():
    r = client.chat.completions.parse(model=MODEL, messages=PERSON_MSG, max_tokens=200,
                                      tools=[openai.pydantic_function_tool(Person)],
                                      tool_choice="required")
    tc = r.choices[0].message.tool_calls[0]
    expect(isinstance(tc.function.parsed_arguments, Person), "parsed_arguments")
    return tc.function.parsed_arguments


def parse_stream():
    with client.chat.completions.stream(model=MODEL, messages=PERSON_MSG, max_tokens=200,
                                        response_format=Person) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    expect(final.choices[0].message.parsed is not None, "parsed is None")
    return final.choices[0].message.parsed


def retrieve_missing():
    try:
        client.models.retrieve("no-such-model")
    except openai.NotFoundError as e:
        return f"404 as expected: {e}"
    raise AssertionError("no 404 for an unknown model id")


def check_batch(n, logprobs):
    def check(r):
        expect(len(r.choices) == 3 * n, f"{len(r.choices)} choices, want {3 * n}")
        expect([c.index for c in r.choices] == list(range(3 * n)), "indexes not ordered")
        if logprobs:
            expect(all(c.logprobs and c.logprobs.tokens for c in r.choices), "no logprobs")
        return {"texts": [c.text for c in r.choices], "usage": r.usage.model_dump()}
    return check


def batch_stream():
    seen = {}
    s = client.completions.create(model=MODEL, prompt=["One,", "Red,", "Monday,"], max_tokens=8,
                                  stream=True, temperature=0)
    for ch in s:
        for c in ch.choices:
            seen[c.index] = seen.get(c.index, "") + c.text
    expect(sorted(seen) == [0, 1, 2], f"indexes {sorted(seen)}")
    return seen


def check_echo(r):
    lp = r.choices[0].logprobs
    expect(lp.token_logprobs[0] is None and len(lp.tokens) >= 3, "echo logprobs")
    return {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs}


def _raw(method, path, body=None):
    """(status, text) of a plain HTTP call (stdlib: openai 3.x no longer brings httpx)."""
    req = urllib.request.Request(BASE + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def http(method, path, body=None):
    def fn():
        status, text = _raw(method, path, body)
        if status >= 400:
            raise RuntimeError(f"HTTP {status}: {text}")
        return json.loads(text)
    return fn


def responses_probe():
    return _raw("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 8})


def responses_calls():
    status, text = responses_probe()
    print(f"probe POST /v1/responses -> {status} {text[:300]}", flush=True)
    if status == 404:
        call(C, "responses (probe)", lambda: (_ for _ in ()).throw(
            RuntimeError(f"POST /v1/responses 404: {text[:300]} (not built yet)")))
        return

    def check_resp(r):
        expect(r.status == "completed" or r.status == "incomplete", f"status {r.status}")
        return {"status": r.status, "output_text": r.output_text, "usage": r.usage.model_dump()}

    call(C, "responses.create (string input)", lambda: client.responses.create(
        model=MODEL, input="Say hello in five words.", max_output_tokens=32), check_resp)
    call(C, "responses.create (messages, instructions)", lambda: client.responses.create(
        model=MODEL, instructions="You answer briefly.",
        input=[{"role": "user", "content": "What is the capital of France?"}],
        max_output_tokens=32, temperature=0, top_p=1), check_resp)

    def resp_schema():
        r = client.responses.create(
            model=MODEL, input=PERSON_MSG, max_output_tokens=200,
            text={"format": {"type": "json_schema", "name": "Person", "strict": True,
                             "schema": openai.lib._pydantic.to_strict_json_schema(Person)}})
        return Person.model_validate_json(r.output_text)
    call(C, "responses.create text.format json_schema", resp_schema)

    def resp_parse():
        r = client.responses.parse(model=MODEL, input=PERSON_MSG, max_output_tokens=200,
                                   text_format=Person)
        expect(isinstance(r.output_parsed, Person), "output_parsed")
        return r.output_parsed
    call(C, "responses.parse text_format=Person", resp_parse)

    tool = {"type": "function", "name": "Person", "description": "Record a person",
            "strict": True, "parameters": openai.lib._pydantic.to_strict_json_schema(Person)}

    def resp_tools():
        r = client.responses.create(model=MODEL, input=PERSON_MSG, max_output_tokens=200,
                                    tools=[tool], tool_choice="required")
        calls = [o for o in r.output if o.type == "function_call"]
        expect(calls, f"no function_call in output: {r.output}")
        Person.model_validate_json(calls[0].arguments)
        return {"name": calls[0].name, "arguments": calls[0].arguments}
    call(C, "responses.create tools required", resp_tools)

    def resp_stream():
        types, text = [], []
        with client.responses.stream(model=MODEL, input="Say hello in five words.",
                                     max_output_tokens=32) as s:
            for ev in s:
                types.append(ev.type)
                if ev.type == "response.output_text.delta":
                    text.append(ev.delta)
            final = s.get_final_response()
        expect("response.completed" in types, f"no response.completed: {set(types)}")
        return {"events": sorted(set(types)), "text": "".join(text),
                "final": final.output_text}
    call(C, "responses.stream", resp_stream)

    def resp_stream_tool():
        """Each function_call item's argument deltas (by output_index), checked against the
        .done event's arguments and the final response's item."""
        types, args, done = [], {}, {}
        with client.responses.stream(model=MODEL, input=PERSON_MSG, max_output_tokens=200,
                                     tools=[tool], tool_choice="required") as s:
            for ev in s:
                types.append(ev.type)
                if ev.type == "response.function_call_arguments.delta":
                    args[ev.output_index] = args.get(ev.output_index, "") + ev.delta
                if ev.type == "response.function_call_arguments.done":
                    done[ev.output_index] = ev.arguments
            final = s.get_final_response()
        expect(args and args == done, f"deltas {args} != done {done}")
        calls = [o.arguments for o in final.output if o.type == "function_call"]
        expect(calls == [args[k] for k in sorted(args)], "final output differs from deltas")
        for a in calls:
            Person.model_validate_json(a)
        return {"events": sorted(set(types)), "arguments": args}
    call(C, "responses.stream tools required", resp_stream_tool)

    def resp_create_stream_true():
        types = [ev.type for ev in client.responses.create(
            model=MODEL, input="Say hi.", max_output_tokens=16, stream=True)]
        expect(types[0] == "response.created"
               and types[-1] in ("response.completed", "response.incomplete"), types)
        return types
    call(C, "responses.create stream=True", resp_create_stream_true)


def main():
    section(C)
    if only("chat"):
        call(C, "chat.completions.create", lambda: client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=32), check_chat)
        call(C, "chat (alias smollm2-135m)", lambda: client.chat.completions.create(
            model="smollm2-135m", messages=MSG, max_tokens=8), check_chat)
        call(C, "chat stream + include_usage", stream_chat)
        call(C, "chat n=2", lambda: client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=16, n=2, temperature=0.8), check_n)
        call(C, "chat logprobs top_logprobs=3", lambda: client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=8, logprobs=True, top_logprobs=3),
            check_logprobs)
        call(C, "chat newer ignored fields", lambda: client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=8, prompt_cache_key="k1",
            safety_identifier="u1", verbosity="low", reasoning_effort="low", store=False,
            metadata={"a": "b"}, user="u"), check_chat)
    if only("tools"):
        tools = [openai.pydantic_function_tool(Person)]
        call(C, "tools auto (pydantic_function_tool nested)",
             lambda: client.chat.completions.create(model=MODEL, messages=PERSON_MSG,
                                                    max_tokens=200, tools=tools,
                                                    tool_choice="auto"), check_tool(False))
        call(C, "tools required (nested)", lambda: client.chat.completions.create(
            model=MODEL, messages=PERSON_MSG, max_tokens=200, tools=tools,
            tool_choice="required"), check_tool(True))
        call(C, "tools named (nested)", lambda: client.chat.completions.create(
            model=MODEL, messages=PERSON_MSG, max_tokens=200, tools=tools,
            tool_choice={"type": "function", "function": {"name": "Person"}}),
            check_tool(True))
        call(C, "tools required streamed (one entry/index)", stream_tool)
    if only("parse"):
        call(C, "beta.chat.completions.parse", parse(True))
        call(C, "chat.completions.parse", parse(False))
        call(C, "chat.completions.parse tools", parse_tools)
        call(C, "chat.completions.stream response_format", parse_stream)
    if only("models"):
        call(C, "models.list", lambda: [m.id for m in client.models.list()])
        call(C, "models.retrieve smollm2", lambda: client.models.retrieve("smollm2"))
        call(C, "models.retrieve smollm2-135m", lambda: client.models.retrieve("smollm2-135m"))
        call(C, "models.retrieve unknown -> 404", retrieve_missing)
    if only("completions"):
        call(C, "completions.create", lambda: client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8),
            lambda r: r.choices[0].text)
        call(C, "completions prompt=[3 strings]", lambda: client.completions.create(
            model=MODEL, prompt=["One,", "Red,", "Monday,"], max_tokens=8, temperature=0),
            check_batch(1, False))
        call(C, "completions prompt=[3] n=2 logprobs=2", lambda: client.completions.create(
            model=MODEL, prompt=["One,", "Red,", "Monday,"], max_tokens=4, n=2, logprobs=2,
            temperature=0.8), check_batch(2, True))
        call(C, "completions prompt=[token ids x3]", lambda: client.completions.create(
            model=MODEL, prompt=[[504, 3458], [42, 43, 44], [1, 2]], max_tokens=4,
            temperature=0), check_batch(1, False))
        call(C, "completions batched stream", batch_stream)
        call(C, "completions echo+logprobs max_tokens=1", lambda: client.completions.create(
            model=MODEL, prompt="The capital of France is Paris", max_tokens=1, echo=True,
            logprobs=1, temperature=0), check_echo)
    if only("tokenize"):
        call(C + " (raw HTTP)", "POST /tokenize prompt", http("POST", "/tokenize",
                                                          {"model": MODEL, "prompt": "Hello world",
                                                           "return_token_strs": True}))
        call(C + " (raw HTTP)", "POST /tokenize messages", http("POST", "/tokenize",
                                                            {"model": MODEL, "messages": MSG}))
        call(C + " (raw HTTP)", "POST /detokenize", http("POST", "/detokenize",
                                                     {"model": MODEL, "tokens": [19556, 905]}))
    if only("responses"):
        responses_calls()


if __name__ == "__main__":
    main()
