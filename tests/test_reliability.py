"""One bad request or one fault never hurts anyone else: bad inputs and chaos, over loopback.

Every bad-input class is sent while neighbour streams run, and the neighbours must finish with
exactly the text they get alone. Faults are injected by wrapping the real tiny-model engine
(`FaultyEngine` delegates every call to it and breaks the one it is told to): an engine call
that raises once, a recovery that raises, a poisoned result. A disconnect storm resets dozens of
streams at once. SIGTERM and warm-up failures are in `test_serve_cli.py` and here at app level.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest

from cadence.checkpoints.generation import GenerationDefaults
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from cadence.server.app import create_app
from tests.conftest import loopback_server
from tests.serving import gauge, serving

MODEL = "tiny"
TIMEOUT = httpx.Timeout(60.0, connect=5.0)


class FaultyEngine:
    """The real engine, with one fault armed at a time (the engine contract, `engine/api.py`)."""

    def __init__(self, engine):
        self.engine = engine
        self.config = engine.config
        self.fail_decode_at: int | None = None  # raise on this decode call (1-based)
        self.poison_decode_at: int | None = None  # this decode call returns a garbage token
        self.unreadable_decode_at: int | None = None  # this call's result raises when read
        self.fail_decode_when = None  # a condition: the first decode call that meets it raises
        self.fail_recover = False
        self.decode_calls = 0
        self.recoveries = 0

    vocab_size = property(lambda self: self.engine.vocab_size)
    num_pages = property(lambda self: self.engine.num_pages)
    compilations_after_warmup = property(lambda self: self.engine.compilations_after_warmup)
    kv_cache_bytes = property(lambda self: self.engine.kv_cache_bytes)

    def prefill(self, *args):
        return self.engine.prefill(*args)

    def copy_pages(self, *args):
        return self.engine.copy_pages(*args)

    def decode(self, positions, active, sampling, page_table, steps=1):
        self.decode_calls += 1
        if self.decode_calls == self.fail_decode_at or (self.fail_decode_when and self.fail_decode_when()):
            self.fail_decode_when = None
            raise RuntimeError("injected: the device fell over")
        tokens = self.engine.decode(positions, active, sampling, page_table, steps)
        if self.decode_calls == self.poison_decode_at:
            tokens = np.asarray(tokens).copy()
            tokens[:, int(np.flatnonzero(active)[0])] = -7
        if self.decode_calls == self.unreadable_decode_at:
            return Unreadable()
        return tokens

    def recover(self):
        if self.fail_recover:
            raise RuntimeError("injected: the device cannot be rebuilt")
        self.recoveries += 1
        self.engine.recover()


class Unreadable:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("injected: the result never arrived")


def greedy(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def stream_text(base: str, body: dict, started: threading.Event | None = None
                ) -> tuple[str, list[dict]]:
    """A streamed completion's text and its frames (asserting it ends with [DONE]); `started`
    is set when the first bytes arrive."""
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                      timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        chunks = []
        for chunk in response.iter_bytes():
            chunks.append(chunk)
            if started is not None:
                started.set()
        raw = b"".join(chunks)
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    frames = [json.loads(f[len(b"data: "):]) for f in raw.split(b"\n\n")[:-2]]
    return "".join(f["choices"][0]["text"] for f in frames if f.get("choices")), frames


class Neighbours:
    """Streams running in threads while a test does something nasty beside them."""

    PROMPTS = ["a neighbour", "another neighbour, longer than the first", "third"]

    def __init__(self, base: str, max_tokens: int = 120):
        self.base, self.max_tokens = base, max_tokens
        self.results: dict[int, tuple[str, list[dict]] | BaseException] = {}
        self.started = [threading.Event() for _ in self.PROMPTS]
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(len(self.PROMPTS))]

    def _run(self, i: int) -> None:
        try:
            self.results[i] = stream_text(self.base, greedy(self.PROMPTS[i], self.max_tokens),
                                          self.started[i])
        except BaseException as e:  # reported by check()
            self.results[i] = e
            self.started[i].set()

    def __enter__(self) -> Neighbours:
        for t in self.threads:
            t.start()
        for started in self.started:  # all streaming before the nasty part
            assert started.wait(30), "a neighbour never started"
        return self

    def __exit__(self, *exc) -> None:
        for t in self.threads:
            t.join(120)

    def check(self) -> None:
        """Each neighbour got exactly what it gets alone, in full."""
        for i, prompt in enumerate(self.PROMPTS):
            result = self.results[i]
            assert not isinstance(result, BaseException), result
            alone = httpx.post(f"{self.base}/v1/completions", json=greedy(prompt, self.max_tokens),
                               timeout=TIMEOUT).json()
            assert alone["usage"]["completion_tokens"] == self.max_tokens
            assert result[0] == alone["choices"][0]["text"]
            assert result[1][-1]["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def server(tiny_engine, tiny_tokenizer):
    with serving(tiny_engine, tiny_tokenizer, max_body_bytes=2**20) as (base, _):
        yield base


def _deep(n: int) -> bytes:
    return b'{"prompt": "x", "metadata": ' + b"[" * n + b"]" * n + b"}"


def _chunked(data: bytes):
    for i in range(0, len(data), 65536):
        yield data[i:i + 65536]


# (name, route, body (dict: JSON; bytes: raw), status, fragment of the error message)
BAD_INPUTS = [
    ("top_k past int32", "completions", {"prompt": "x", "top_k": 2**31, "temperature": 0.5}, 400, "top_k"),
    ("seed past uint64", "completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("seed below int64", "chat", {"messages": [{"role": "user", "content": "x"}], "seed": -2**63 - 1}, 400, "seed"),
    ("1e999", "completions", b'{"prompt": "x", "temperature": 1e999}', 400, "out of range"),
    ("400-digit float", "completions", b'{"prompt": "x", "top_p": 1' + b"0" * 400 + b'.5}', 400, "out of range"),
    ("NaN literal", "completions", b'{"prompt": "x", "temperature": NaN}', 400, "NaN is not valid JSON"),
    ("Infinity literal", "chat", b'{"messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}', 400, "Infinity"),
    ("5000-digit integer", "completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, "digits"),
    ("deep nesting", "completions", _deep(100_000), 400, "nested too deeply"),
    ("moderate nesting", "completions", _deep(40), 400, "nested too deeply"),
    ("lone surrogate in a prompt", "completions", b'{"prompt": "abc \\ud800 def"}', 400, "surrogate"),
    ("lone surrogate in a message", "chat", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "surrogate"),
    ("not UTF-8", "completions", b'{"prompt": "\xff\xfe"}', 400, "not"),
    ("not an object", "chat", b"[1, 2, 3]", 400, "JSON object"),
    ("17 stop strings", "completions", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "at most 16 stop"),
    ("a huge stop string", "completions", {"prompt": "x", "stop": "y" * 100_000}, 400, "at most 256 characters"),
    ("thousands of stop strings", "completions", {"prompt": "x", "stop": ["z"] * 5000}, 400, "at most 16 stop"),
    ("body over the limit", "completions", {"prompt": "x" * (2**20 + 10)}, 413, "exceeds 1048576 bytes"),
    ("chunked body over the limit", "chunked", {"prompt": "x" * (3 * 2**20)}, 413, "exceeds 1048576 bytes"),
    ("a prompt that cannot fit", "completions", {"prompt": "word " * 150_000}, 400, "exceeds the context of 512"),
    ("a huge messages array", "chat", {"messages": [{"role": "user", "content": "hi"}] * 20_000}, 400, "exceeds the context of 512"),
    ("a logit_bias id past the vocabulary", "completions", {"prompt": "x", "logit_bias": {"512": 1}}, 400, "outside the model's vocabulary"),
    ("a logit_bias key that is no id", "completions", {"prompt": "x", "logit_bias": {"-5": 1}}, 400, "token ids"),
    ("a logit_bias value past 100", "chat", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, 400, "[-100, 100]"),
    ("a logit_bias value that is text", "completions", {"prompt": "x", "logit_bias": {"5": "1"}}, 400, "must be numbers"),
    ("301 logit_bias entries", "completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "at most 300"),
    ("presence_penalty past 2", "chat", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, 400, "presence_penalty must be in"),
    ("a repetition_penalty of 0", "completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty must be in"),
    ("min_p past 1", "completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p must be in"),
    ("a schema llguidance cannot compile", "chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "a(b"}}}}, 400, "unclosed"),
    ("an unsatisfiable schema", "completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}}, 400, "Unsatisfiable"),
    ("a response_format of another type", "chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("a tool_choice naming no tool", "chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "not among the tools"),
    ("a tool that is no function", "chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "code_interpreter"}]}, 400, "function"),
    ("the legacy functions", "chat", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400, "not supported"),
    ("an unknown field", "completions", {"prompt": "x", "temprature": 0.5}, 400, "unrecognized request argument"),
    ("an image part", "chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "text part"),
    ("0 is not false", "completions", {"prompt": "x", "echo": 0}, 400, "must be true or false"),
    ("a suffix on a model that cannot fill in the middle", "completions", {"prompt": "x", "suffix": "y"}, 400, "cannot fill in the middle"),
    ("SGLang's no_stop_trim, not neutral", "completions", {"prompt": "x", "no_stop_trim": True}, 400, "no_stop_trim"),
    ("skip_special_tokens must be a boolean", "chat", {"messages": [{"role": "user", "content": "x"}], "skip_special_tokens": 0}, 400, "skip_special_tokens"),
    ("SGLang's return_hidden_states, not neutral", "completions", {"prompt": "x", "return_hidden_states": True}, 400, "return_hidden_states"),
    ("true is not an n", "completions", {"prompt": "x", "best_of": True}, 400, "must be an integer"),
    ("n past --max_n", "chat", {"messages": [{"role": "user", "content": "x"}], "n": 100}, 400, "--max_n"),
    ("a bad max_completion_tokens beside a good max_tokens", "chat",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ("a message name that is not a string", "chat", {"messages": [{"role": "user", "content": "x", "name": {}}]}, 400, "name"),
    ("a temperature past float32", "completions", {"prompt": "x", "temperature": 1e300}, 400, "float32"),
    ("a request id too long", "long-id", {"prompt": "x", "max_tokens": 2}, 400, "X-Request-Id"),
    ("a schema that is only itself", "chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#"}}}}, 400, "allows no output"),
    ("a streamed $ref loop", "chat", {"messages": [{"role": "user", "content": "x"}], "stream": True, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}}, 400, "allows no output"),
    ("deep arguments of an earlier call", "chat", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}, {"role": "tool", "tool_call_id": "c", "content": "1"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "nested too deeply"),
    ("a batch with one prompt too long", "completions", {"prompt": ["fine", "word " * 150_000], "max_tokens": 2}, 400, "exceeds the context of 512"),
    ("a batch of 300 prompts", "completions", {"prompt": ["x"] * 300}, 400, "at most 256"),
]


def send(base: str, route: str, body) -> httpx.Response:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if route == "long-id":
        headers["X-Request-Id"] = "r" * 1000
    content = _chunked(data) if route == "chunked" else data
    return httpx.post(f"{base}{path}", content=content, headers=headers, timeout=TIMEOUT)


def test_every_bad_input_gets_a_clear_4xx_and_no_neighbour_notices(server):
    with Neighbours(server) as neighbours:
        for name, route, body, status, fragment in BAD_INPUTS:
            start = time.monotonic()
            response = send(server, route, body)
            assert response.status_code == status, (name, response.text[:300])
            error = response.json()["error"]
            assert fragment in error["message"], (name, error)
            assert {"message", "type", "param", "code"} <= error.keys(), name
            assert time.monotonic() - start < 10, f"{name} took {time.monotonic() - start:.1f} s"
    neighbours.check()


def test_edge_values_and_neutral_fields_are_served(server):
    """The widest valid values and the neutral values of unsupported fields are accepted, and
    a field cadence does not know given as null (not given, as OpenAI reads it)."""
    edges = [
        {"prompt": "x", "max_tokens": 3, "top_k": 2**31 - 1, "seed": 2**32 - 1, "temperature": 1.5},
        {"prompt": "x", "max_tokens": 3, "top_k": -1, "presence_penalty": 0, "logit_bias": {},
         "user": "someone", "logprobs": None, "echo": False, "web_search_options": None},
        {"prompt": "x", "max_tokens": 3, "presence_penalty": -2, "frequency_penalty": 2,
         "repetition_penalty": 2, "min_p": 1, "temperature": 1, "logit_bias": {"0": -100, "511": 100}},
    ]
    for body in edges:
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3


def test_openais_seed_and_top_p_ranges_are_served(server):
    """OpenAI's int64 seeds fold into the device's 32 bits (a seed 2**32 apart from another is
    its answer); top_p 0 keeps the likeliest token alone (the greedy answer)."""
    def text(**body) -> str:
        response = httpx.post(f"{server}/v1/completions", json={
            "prompt": "the house", "max_tokens": 8, "temperature": 20.0, "ignore_eos": True, **body},
            timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    assert text(seed=7 + 2**32) == text(seed=7) == text(seed=7 - 2**32)
    assert text(seed=-1) == text(seed=2**32 - 1) and text(seed=2**63 - 1) == text(seed=2**32 - 1)
    assert text(seed=7) != text(seed=8)  # (so the seeds above were told apart)
    assert text(top_p=0, seed=1) == text(temperature=0) == text(top_p=0, seed=2)


def test_the_fields_sglang_router_adds_are_accepted_and_change_nothing(server):
    """sglang-router rewrites every request it forwards with SGLang's own fields at their
    defaults (as captured from sglang-router 0.3.2): the answer is the one without them."""
    added = {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
             "return_hidden_states": False}
    chat_added = {**added, "continue_final_message": False, "separate_reasoning": True,
                  "stream_reasoning": True, "logprobs": False}
    for route, body, extra in [
            ("completions", {"prompt": "routed", "max_tokens": 6, "temperature": 0}, {**added, "echo": False}),
            ("chat", {"messages": [{"role": "user", "content": "routed"}], "max_completion_tokens": 6,
                      "temperature": 0}, chat_added)]:
        plain, routed = send(server, route, body), send(server, route, {**body, **extra})
        assert routed.status_code == 200, routed.text
        key = "text" if route == "completions" else "message"
        assert routed.json()["choices"][0][key] == plain.json()["choices"][0][key]


def test_chat_content_as_text_parts_is_the_joined_string(server):
    def chat(content) -> dict:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        return response.json()

    parts = chat([{"type": "text", "text": "Say"}, {"type": "text", "text": "something."}])
    joined = chat("Say\nsomething.")
    assert parts["choices"][0]["message"] == joined["choices"][0]["message"]
    # The same tokens: the second request finds all but the last in the prefix cache.
    cached = joined["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert cached == joined["usage"]["prompt_tokens"] - 1
    del parts["usage"]["prompt_tokens_details"]
    assert parts["usage"] == joined["usage"]


def test_unknown_routes_and_methods_answer_in_openai_shape(server):
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/health", 405)]:
        response = httpx.request(method, f"{server}{path}")
        assert response.status_code == status
        assert response.json()["error"]["message"].startswith(f"{method} {path}")


def test_openapi_description_is_served(server):
    spec = httpx.get(f"{server}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/health",
            "/metrics", "/debug/timeline", "/server_info", "/model_info", "/get_load", "/tokenize",
            "/detokenize", "/tokenizer_info"} <= spec["paths"].keys()


def test_omitted_sampling_fields_take_the_models_defaults(tiny_engine, tiny_tokenizer):
    """A model publishing temperature 0 makes a request without one greedy: its text equals
    the explicitly greedy request's."""
    with serving(tiny_engine, tiny_tokenizer, generation=GenerationDefaults(temperature=0.0)) as (base, _):
        body = {"prompt": "defaults", "max_tokens": 24, "ignore_eos": True}
        implicit = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()
        explicit = httpx.post(f"{base}/v1/completions", json={**body, "temperature": 0},
                              timeout=TIMEOUT).json()
        assert implicit["choices"][0]["text"] == explicit["choices"][0]["text"]


# -- chaos ---------------------------------------------------------------------------------------


def test_an_engine_call_that_raises_once_fails_in_flight_requests_then_serving_resumes(
        tiny_engine, tiny_tokenizer):
    faulty = FaultyEngine(tiny_engine)
    with serving(faulty, tiny_tokenizer) as (base, _):
        faulty.fail_decode_at = faulty.decode_calls + 10
        _, frames = stream_text(base, greedy("in flight when it breaks", 200))
        assert "injected: the device fell over" in frames[-1]["error"]["message"]
        assert frames[-1]["error"]["type"] == "server_error"
        assert faulty.recoveries == 1
        assert httpx.get(f"{base}/health").status_code == 200
        with Neighbours(base) as neighbours:
            pass
        neighbours.check()


def test_an_unreadable_result_fails_in_flight_requests_then_serving_resumes(tiny_engine, tiny_tokenizer):
    faulty = FaultyEngine(tiny_engine)
    with serving(faulty, tiny_tokenizer) as (base, _):
        faulty.unreadable_decode_at = faulty.decode_calls + 5
        response = httpx.post(f"{base}/v1/completions", json=greedy("unlucky", 100), timeout=TIMEOUT)
        assert response.status_code == 500
        assert "the result never arrived" in response.json()["error"]["message"]
        ok = httpx.post(f"{base}/v1/completions", json=greedy("lucky", 5), timeout=TIMEOUT)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5


def test_a_poisoned_token_fails_its_own_stream_only(tiny_engine, tiny_tokenizer):
    faulty = FaultyEngine(tiny_engine)
    with serving(faulty, tiny_tokenizer) as (base, sched):
        with Neighbours(base, max_tokens=60) as neighbours:
            faulty.poison_decode_at = faulty.decode_calls + 3
        victims = [i for i, r in neighbours.results.items() if "error" in r[1][-1]]
        assert len(victims) == 1, neighbours.results
        assert "token id -7" in neighbours.results[victims[0]][1][-1]["error"]["message"]
        assert faulty.recoveries == 0
        for i, (text, frames) in neighbours.results.items():
            if i not in victims:
                alone = httpx.post(f"{base}/v1/completions", json=greedy(Neighbours.PROMPTS[i], 60),
                                   timeout=TIMEOUT).json()
                assert text == alone["choices"][0]["text"]


def test_a_recovery_that_fails_marks_the_engine_dead_and_everyone_hears_it(tiny_engine, tiny_tokenizer):
    faulty = FaultyEngine(tiny_engine)
    with serving(faulty, tiny_tokenizer, max_queue=64) as (base, sched):
        # The device falls over once all eight are in (4 running, 4 waiting), however slowly
        # the client's posts arrive: a request after the death would get 503 instead.
        faulty.fail_decode_when = lambda: sched.num_running + sched.num_waiting >= 8
        faulty.fail_recover = True

        async def many():
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                return await asyncio.gather(*(
                    http.post(f"{base}/v1/completions", json=greedy(f"doomed {i}", 400))
                    for i in range(8)))

        responses = asyncio.run(many())
        assert [r.status_code for r in responses] == [500] * 8
        messages = [r.json()["error"]["message"] for r in responses]
        assert all("fell over" in m or "engine is dead" in m for m in messages), messages
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert "cannot be rebuilt" in health.json()["error"]
        for method, path, body in [("POST", "/v1/completions", greedy("hello?", 2)),
                                   ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                                   ("GET", "/v1/models", None)]:
            response = httpx.request(method, f"{base}{path}", json=body, timeout=TIMEOUT)
            assert response.status_code == 503, (path, response.text)
            assert response.json()["error"]["code"] == "engine_dead"
        assert sched.num_running == 0 and sched.num_waiting == 0
    tiny_engine.recover()  # the shared engine itself is fine; leave it as the next test expects


def test_a_disconnect_storm_leaves_nothing_behind(tiny_engine, tiny_tokenizer):
    """Forty streams on four slots (four running, the rest waiting), all reset at once: the
    running and waiting gauges return to 0 within a moment and the next request is served."""
    with serving(tiny_engine, tiny_tokenizer, max_queue=64) as (base, sched):

        async def storm():
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                async def one(i: int) -> None:
                    body = {**greedy(f"storm {i}", 400), "stream": True}
                    async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        if i < 4:
                            await anext(r.aiter_bytes())  # a running one, mid-stream
                tasks = [asyncio.create_task(one(i)) for i in range(40)]
                await asyncio.sleep(1.0)
                for t in tasks:
                    t.cancel()  # closes every connection abruptly
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(storm())
        deadline = time.monotonic() + 5
        while gauge(base, "num_requests_running") or gauge(base, "num_requests_waiting"):
            assert time.monotonic() < deadline, "slots or queue entries were left behind"
            time.sleep(0.02)
        ok = httpx.post(f"{base}/v1/completions", json=greedy("after the storm", 5), timeout=TIMEOUT)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5


# -- lifecycle and security ------------------------------------------------------------------------


def test_a_failed_warm_up_is_logged_reported_and_fatal(tiny_engine, tiny_tokenizer, caplog):
    fatal: list[str] = []

    def broken_warmup():
        raise RuntimeError("no device memory for the programs")

    sched = Scheduler(tiny_engine, tiny_tokenizer, SchedulerConfig(policy=PolicyConfig(chunk=32)))
    app = create_app(sched, tiny_tokenizer, MODEL, warmup=broken_warmup, on_fatal=fatal.append)
    with loopback_server(app) as base:
        deadline = time.monotonic() + 10
        while not fatal:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "no device memory" in health.json()["error"]
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    assert "no device memory" in fatal[0]
    assert any("warm-up failed" in r.getMessage() for r in caplog.records)


def test_api_key_scheme_is_case_insensitive_and_metrics_can_be_protected(tiny_engine, tiny_tokenizer):
    with serving(tiny_engine, tiny_tokenizer, api_key="sekret", protect_metrics=True) as (base, _):
        body = greedy("x", 2)
        for header in ("", "Bearer", "Bearer sekre", "Bearer sekret2", "Basic sekret"):
            response = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": header})
            assert response.status_code == 401, header
        for header in ("Bearer sekret", "bearer sekret", "BEARER  sekret"):
            response = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": header})
            assert response.status_code == 200, header
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{base}/debug/timeline").status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200  # orchestrators probe without a key
