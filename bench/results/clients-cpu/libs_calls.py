"""instructor, langchain-openai and litellm against cadence-serve."""
import json
import sys
from importlib.metadata import version

from openai import OpenAI

from harness import BASE, MODEL, Person, call, section

PERSON_TEXT = "Alice is 31 and lives at 12 Oak Street, Paris. Record her."
PERSON_MSG = [{"role": "user", "content": PERSON_TEXT}]
MSG = [{"role": "user", "content": "Say hello in five words."}]


def only(*which):
    return len(sys.argv) < 2 or any(w in sys.argv[1:] for w in which)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def instructor_calls():
    import instructor
    C = "instructor " + version("instructor")
    section(C)
    raw = OpenAI(base_url=BASE + "/v1", api_key="none", timeout=180, max_retries=0)
    for mode in ("TOOLS", "JSON", "JSON_SCHEMA", "MD_JSON"):
        ic = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
        call(C, f"create Mode.{mode} (nested)", lambda: ic.chat.completions.create(
            model=MODEL, messages=PERSON_MSG, response_model=Person, max_tokens=200,
            max_retries=1))
    for mode in ("TOOLS", "JSON"):
        ic = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))

        def partial():
            last, n = None, 0
            for p in ic.chat.completions.create_partial(model=MODEL, messages=PERSON_MSG,
                                                        response_model=Person, max_tokens=200,
                                                        max_retries=1):
                last, n = p, n + 1
            expect(last is not None and last.name and last.address and last.address.city,
                   f"incomplete final partial: {last}")
            Person.model_validate(last.model_dump())
            return {"partials": n, "final": last.model_dump()}
        call(C, f"create_partial Mode.{mode} (stream)", partial)

    ic = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)

    def iterable():
        people = ic.chat.completions.create_iterable(
            model=MODEL, max_tokens=300, max_retries=1, response_model=Person,
            messages=[{"role": "user", "content": "Alice is 31, lives at 1 Oak St, Paris. Bob "
                                                  "is 40, lives at 2 Elm St, Rome."}])
        return [p.model_dump() for p in people]
    call(C, "create_iterable Mode.TOOLS", iterable)


def langchain_calls():
    from langchain_openai import ChatOpenAI
    C = "langchain-openai " + version("langchain-openai")
    section(C)
    llm = ChatOpenAI(model=MODEL, base_url=BASE + "/v1", api_key="none", max_tokens=32,
                     timeout=180, max_retries=0)
    call(C, "ChatOpenAI.invoke", lambda: llm.invoke("Say hello in five words.").content)

    def stream():
        parts = [c.content for c in llm.stream("Say hello in five words.")]
        expect(len(parts) > 1, "one chunk only")
        return {"chunks": len(parts), "text": "".join(parts)}
    call(C, "ChatOpenAI.stream", stream)

    def stream_usage():
        llm2 = ChatOpenAI(model=MODEL, base_url=BASE + "/v1", api_key="none", max_tokens=16,
                          stream_usage=True, max_retries=0)
        agg = None
        for c in llm2.stream("Say hi."):
            agg = c if agg is None else agg + c
        expect(agg.usage_metadata, "no usage_metadata")
        return agg.usage_metadata
    call(C, "ChatOpenAI.stream stream_usage=True", stream_usage)

    big = ChatOpenAI(model=MODEL, base_url=BASE + "/v1", api_key="none", max_tokens=200,
                     timeout=180, max_retries=0, temperature=0)
    for method in (None, "function_calling", "json_schema", "json_mode"):
        def structured(method=method):
            kw = {} if method is None else {"method": method}
            prompt = PERSON_TEXT + (" Answer in JSON with name, age, address{street, city}."
                                    if method == "json_mode" else "")
            r = big.with_structured_output(Person, **kw).invoke(prompt)
            expect(isinstance(r, Person), f"got {type(r).__name__}: {r}")
            return r
        call(C, f"with_structured_output method={method or 'default'}", structured)

    def structured_strict():
        r = big.with_structured_output(Person, method="json_schema", strict=True).invoke(
            PERSON_TEXT)
        expect(isinstance(r, Person), f"got {r}")
        return r
    call(C, "with_structured_output json_schema strict=True", structured_strict)

    def bind_tools():
        r = big.bind_tools([Person], tool_choice="Person").invoke(PERSON_TEXT)
        expect(r.tool_calls, f"no tool_calls: {r}")
        Person.model_validate(r.tool_calls[0]["args"])
        return r.tool_calls
    call(C, "bind_tools([Person], tool_choice=Person)", bind_tools)

    def bind_tools_auto():
        r = big.bind_tools([Person]).invoke(PERSON_TEXT)
        return {"tool_calls": r.tool_calls, "content": r.content}
    call(C, "bind_tools([Person]) auto", bind_tools_auto)

    def bind_tools_stream():
        agg = None
        for c in big.bind_tools([Person], tool_choice="any").stream(PERSON_TEXT):
            agg = c if agg is None else agg + c
        expect(agg.tool_calls, f"no tool_calls: {agg}")
        Person.model_validate(agg.tool_calls[0]["args"])
        return agg.tool_calls
    call(C, "bind_tools(tool_choice=any).stream", bind_tools_stream)


def litellm_calls():
    import litellm
    C = "litellm " + version("litellm")
    section(C)
    kw = dict(api_base=BASE + "/v1", api_key="none", timeout=180, num_retries=0)
    call(C, "completion openai/smollm2", lambda: litellm.completion(
        model="openai/" + MODEL, messages=MSG, max_tokens=32, **kw).choices[0].message.content)

    def stream():
        parts = []
        for ch in litellm.completion(model="openai/" + MODEL, messages=MSG, max_tokens=32,
                                     stream=True, **kw):
            parts.append(ch.choices[0].delta.content or "")
        expect(len(parts) > 1, "one chunk")
        return {"chunks": len(parts), "text": "".join(parts)}
    call(C, "completion stream=True", stream)

    def tc(model):
        def fn():
            r = litellm.text_completion(model=model, prompt=["One,", "Red,", "Monday,"],
                                        max_tokens=8, temperature=0, **kw)
            expect(len(r.choices) == 3, f"{len(r.choices)} choices")
            return [c.text for c in r.choices]
        return fn
    call(C, "text_completion openai/ prompt=[3]", tc("openai/" + MODEL))
    call(C, "text_completion text-completion-openai/ prompt=[3]",
         tc("text-completion-openai/" + MODEL))
    call(C, "text_completion single prompt", lambda: litellm.text_completion(
        model="text-completion-openai/" + MODEL, prompt="The capital of France is",
        max_tokens=8, **kw).choices[0].text)

    schema = {"type": "json_schema", "json_schema": {
        "name": "Person", "strict": True, "schema": {
            "type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer"},
                "address": {"type": "object", "properties": {
                    "street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"], "additionalProperties": False}},
            "required": ["name", "age", "address"], "additionalProperties": False}}}

    def rf(fmt):
        def fn():
            r = litellm.completion(model="openai/" + MODEL, messages=PERSON_MSG, max_tokens=200,
                                   response_format=fmt, **kw)
            return Person.model_validate_json(r.choices[0].message.content)
        return fn
    call(C, "completion response_format json_schema (dict)", rf(schema))
    call(C, "completion response_format=Person (pydantic)", rf(Person))

    def tools():
        r = litellm.completion(model="openai/" + MODEL, messages=PERSON_MSG, max_tokens=200,
                               tools=[{"type": "function", "function": {
                                   "name": "Person", "parameters": Person.model_json_schema()}}],
                               tool_choice="required", **kw)
        tcs = r.choices[0].message.tool_calls
        expect(tcs, "no tool_calls")
        Person.model_validate_json(tcs[0].function.arguments)
        return tcs[0].function.arguments
    call(C, "completion tools required (nested $defs)", tools)

    async def acomp():
        r = await litellm.acompletion(model="openai/" + MODEL, messages=MSG, max_tokens=16, **kw)
        return r.choices[0].message.content
    import asyncio
    call(C, "acompletion", lambda: asyncio.run(acomp()))


if __name__ == "__main__":
    if only("instructor"):
        instructor_calls()
    if only("langchain"):
        langchain_calls()
    if only("litellm"):
        litellm_calls()
