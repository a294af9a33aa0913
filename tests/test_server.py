"""The HTTP server over real loopback sockets, with the tiny model behind it."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import serve_tiny as serve

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def url(engine, tiny_tokenizer):
    with serve(engine, tiny_tokenizer) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("chat", [True, False])
def test_text_frames_equal_the_chunk_they_template(chat):
    from cadence.server.protocol import TextFrames, chunk, frame

    frames = TextFrames("cmpl-1", 'a "model"', chat, 1700000000)
    for text in ["Paris", " é\n\t\"\\", "\x00\u2028", "日本", "😀"]:
        assert frames(text) == frame(chunk("cmpl-1", 'a "model"', chat, text, None, 1700000000))


def sse_frames(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame
    return [f[len(b"data: "):] for f in frames[:-2]]


def running(url: str) -> float:
    return gauges(url, "cadence:num_requests_running")[0]


def test_completion_streaming_and_not_agree(client):
    full = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    parts = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=12,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True}))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert text == full.choices[0].text
    assert parts[-1].usage.completion_tokens == 12 and parts[-1].choices == []
    assert parts[-1].usage.total_tokens == full.usage.total_tokens
    assert parts[-2].choices[0].finish_reason == "length"


def test_chat_streaming_and_not_agree(client):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    # The same conversation a second time: all of it but the last token comes cached (its
    # whole 64-token pages by key, the rest copied from the first's last page).
    assert full.usage.prompt_tokens_details.cached_tokens in (0, chunks[-1].usage.prompt_tokens_details.cached_tokens)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_counts_each_choices_tokens_on_every_chunk(url, chat):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so
    far, so a client counts the tokens of a chunk whose text held several (multi-byte
    characters held back until whole) or none it shows; each choice counts its own."""
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0.8, "seed": 3, "n": 2, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": [{"role": "user", "content": "中文 emoji 🎉"}]} if chat else {"prompt": "中文 emoji 🎉"})
    route = "chat/completions" if chat else "completions"
    frames = [json.loads(f) for f in sse_frames(httpx.post(f"{url}/v1/{route}", json=body).content)]
    *chunks, total = frames
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 48
    prompt = total["usage"]["prompt_tokens"]
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        counts = [c["usage"]["completion_tokens"] for c in mine]
        assert all(c["usage"]["prompt_tokens"] == prompt for c in mine)
        assert all(c["usage"]["total_tokens"] == prompt + n for c, n in zip(mine, counts))
        assert counts == sorted(counts) and counts[-1] == 24 and len(set(counts)) > 12  # token by token
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
    # Without include_usage it asks for nothing (vLLM's rule).
    body["stream_options"] = {"continuous_usage_stats": True}
    frames = [json.loads(f) for f in sse_frames(httpx.post(f"{url}/v1/{route}", json=body).content)]
    assert not any("usage" in f for f in frames)


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_sse_framing_and_utf8_integrity(url, tiny_tokenizer):
    """Frames are exact `data: {json}\\n\\n`; concatenated text equals decoding all the ids at
    once, which a frame that split a multi-byte character would break (two U+FFFD)."""
    body = {"model": MODEL, "prompt": "中文 emoji 🎉", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stream": True}
    response = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "abc-1"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "abc-1"
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = [json.loads(f) for f in sse_frames(response.content)]
    assert all(f["id"] == "abc-1" for f in frames)
    streamed = "".join(f["choices"][0]["text"] for f in frames)
    full = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}).json()
    assert streamed == full["choices"][0]["text"]
    assert any(ord(c) > 127 for c in streamed), "the test needs multi-byte output to mean anything"


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    ({"prompt": 5}, 400, '"prompt"'),
    ({"prompt": "x", "max_tokens": "ten"}, 400, '"max_tokens" must be an integer'),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "n": 9}, 400, "--max_n"),
    ({"prompt": "x", "n": 0}, 400, "must be in [1, 8]"),
    ({"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "n": 2, "best_of": 3, "stream": True}, 400, "cannot be streamed"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "exceeds the context of 512"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt token ids must be integers in [0, "),
])
def test_errors_have_openai_shape_and_serving_continues(url, client, body, status, fragment):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{url}/v1/completions", **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and {"type", "param", "code"} <= error.keys()
    ok = client.completions.create(model=MODEL, prompt="still alive", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_bad_chat_messages_are_400(url):
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert response.status_code == 400 and "content" in response.json()["error"]["message"]


def test_api_key(engine, tiny_tokenizer):
    with serve(engine, tiny_tokenizer, api_key="sekret") as base:
        body = {"prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
        wrong = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_browser_pages_of_the_allowed_origins_may_call_the_api(engine, tiny_tokenizer):
    """CORS: a preflight from an allowed origin passes without the API key and names what the
    page may send; the request itself still needs the key, and its answer (an error too) is
    readable by the page; another origin gets no grant, and a server that allows none answers
    every origin without one."""
    page, other = "https://chat.example.com", "https://evil.example.com"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    body = {"prompt": "x", "max_tokens": 2}
    with serve(engine, tiny_tokenizer, api_key="sekret", allowed_origins=(page,)) as base:
        url = f"{base}/v1/completions"
        ok = httpx.options(url, headers={"Origin": page, **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == page
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-origin" not in httpx.options(url, headers={"Origin": other, **preflight}).headers
        unkeyed = httpx.post(url, json=body, headers={"Origin": page})
        assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == page
        keyed = httpx.post(url, json=body, headers={"Origin": page, "Authorization": "Bearer sekret"})
        assert keyed.status_code == 200 and "x-request-id" in keyed.headers["access-control-expose-headers"].lower()
    with serve(engine, tiny_tokenizer) as base:
        closed = httpx.post(f"{base}/v1/completions", json=body, headers={"Origin": page})
        assert closed.status_code == 200 and "access-control-allow-origin" not in closed.headers


def test_not_ready_is_503_until_warm(engine, tiny_tokenizer):
    release, reported = threading.Event(), threading.Event()

    def warmup(progress):  # a warm-up that reports its progress, as `runtime.warm_up` does
        progress(0, 3, "")
        progress(1, 3, "prefill[tokens=16,pages=8]")
        reported.set()
        release.wait(30)

    with serve(engine, tiny_tokenizer, warmup=warmup) as base:
        assert reported.wait(10)
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503
        assert health.json() == {"status": "warming up", "programs_done": 1, "programs_total": 3}
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and "Retry-After" in response.headers
        release.set()
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_full_queue_is_429_with_retry_after(engine, tiny_tokenizer):
    """4 slots and a queue of 1: of 12 simultaneous long requests, some are refused with 429
    and Retry-After, every accepted one completes in full, and serving goes on."""
    with serve(engine, tiny_tokenizer, max_queue=1) as base:
        body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(http.post(f"{base}/v1/completions", json=body)
                                              for _ in range(12)))

        responses = asyncio.run(burst())
        refused = [r for r in responses if r.status_code == 429]
        accepted = [r for r in responses if r.status_code == 200]
        assert refused and len(accepted) >= 5 and len(refused) + len(accepted) == 12
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert refused[0].json()["error"]["type"] == "rate_limit_error"
        assert all(r.json()["usage"]["completion_tokens"] == 400 for r in accepted)
        assert running(base) == 0
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_disconnect_mid_stream_frees_the_slot(url):
    body = {"prompt": "go on", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert running(url) == 1
    deadline = time.monotonic() + 10
    while running(url) > 0:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.02)
    finished = httpx.get(f"{url}/metrics").text
    assert 'cadence:request_success_total{finished_reason="abort",model_name="tiny"}' in finished


def test_32_concurrent_streams_on_4_slots(url):
    prompts = ["one", "two two", "three three three", "four"]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        return await asyncio.gather(*(one(prompts[i % 4]) for i in range(32)))

    texts = asyncio.run(main())
    sync = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for i, text in enumerate(texts):
        want = sync.completions.create(model=MODEL, prompt=prompts[i % 4], max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
        assert text == want.choices[0].text


def compilations(url: str) -> float:
    return gauges(url, "cadence:compilations_after_warmup")[0]


def test_metrics_expose_histograms_and_counters(url, client):
    # The engine is the test session's, warmed once; other tests compile programs of their own
    # in this process since, so what serving must not add is measured across these requests.
    before = compilations(url)
    client.completions.create(model=MODEL, prompt="measure me", max_tokens=4)
    client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0.8, seed=5,
                                   messages=[{"role": "user", "content": "and me " * 30}])
    assert compilations(url) == before
    text = httpx.get(f"{url}/metrics").text
    for name in ("cadence:time_to_first_token_seconds_bucket", "cadence:inter_token_latency_seconds_bucket",
                 "cadence:e2e_request_latency_seconds_count", "cadence:request_queue_time_seconds_sum",
                 "cadence:request_prefill_time_seconds_count", "cadence:request_decode_time_seconds_count",
                 "cadence:iteration_tokens_total_bucket", "cadence:prompt_tokens_total",
                 "cadence:generation_tokens_total", "cadence:kv_cache_usage_perc",
                 "cadence:num_requests_waiting", 'cadence:compilations_after_warmup{model_name="tiny"}',
                 "cadence:kv_pages_used", "cadence:kv_pages_total", "cadence:kv_page_utilization_perc",
                 "cadence:num_preemptions_total", "cadence:prefill_programs_total",
                 "cadence:prefix_cache_queries_total", "cadence:kv_pages_evicted_total",
                 "cadence:prompt_tokens_forked_total", 'vllm:prefix_cache_queries_total{model_name="tiny"}',
                 'vllm:prefix_cache_hits_total{model_name="tiny"}', 'vllm:gpu_cache_usage_perc{model_name="tiny"}',
                 "cadence:prefill_chunks_total", 'cadence:kv_transfer_backlog{model_name="tiny"} 0.0',
                 'cadence:pool_busy_seconds_total{model_name="tiny",pool="colocated"}',
                 'cadence:pool_queue_length{model_name="tiny",pool="colocated"}'):
        assert name in text, name
    value = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith(("cadence:prefill_programs_total", "cadence:prefill_chunks_total"))}
    assert value["cadence:prefill_chunks_total"] >= value["cadence:prefill_programs_total"] >= 2


def metric(url: str, name: str) -> float:
    line = next(line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_counters_agree(url, client, tiny_config):
    """The prefix cache over HTTP: a prompt sent again reuses all of it but the last token (its
    two whole 64-token pages by key, 21 tokens of the third copied; the last token is always
    computed), says so in `usage.prompt_tokens_details.cached_tokens`, streaming or not, and
    /metrics counts it. A different `cache_salt` shares nothing."""
    prompt = [(i * 7919) % (tiny_config.vocab_size - 3) + 3 for i in range(150)]
    before = {n: metric(url, n) for n in ("cadence:prefix_cache_queries_total", "cadence:prefix_cache_hits_total")}
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 149
    assert again.choices[0].text == first.choices[0].text
    parts = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert parts[-1].usage.prompt_tokens_details.cached_tokens == 149
    salted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                       extra_body={"cache_salt": "another tenant"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(url, "cadence:prefix_cache_queries_total") - before["cadence:prefix_cache_queries_total"] == 600
    assert metric(url, "cadence:prefix_cache_hits_total") - before["cadence:prefix_cache_hits_total"] == 2 * 149
    assert metric(url, "cadence:kv_pages_cached") >= 4
    bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and "cache_salt" in bad.text


def gauges(url: str, *names: str) -> list[float]:
    """The values of `names` (single-series gauges) from one scrape of /metrics."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return [float(next(l for l in lines if l.startswith(name + "{")).rsplit(" ", 1)[1]) for name in names]


def test_vllm_named_gauges_move_with_the_load(url):
    """The gauges routers read under vLLM's names say what cadence's own say, while a request
    runs and after it ends."""
    names = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
             "vllm:gpu_cache_usage_perc", "cadence:kv_cache_usage_perc")
    body = {"prompt": "keep going", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        running_now, usage, waiting, old_name, own = gauges(url, *names)
        assert running_now == 1 and 0 < usage <= 1 and waiting == 0
        assert usage == old_name == own
    deadline = time.monotonic() + 10
    while gauges(url, "vllm:num_requests_running") != [0.0]:
        assert time.monotonic() < deadline, "the request never left"
        time.sleep(0.02)
    assert gauges(url, "vllm:kv_cache_usage_perc") == [0.0]


def test_server_info_describes_the_kv_pool(url, engine):
    """SGLang's /server_info with the pool's page size and dtype (--kv_cache_dtype) beside its
    capacity in tokens."""
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    assert info["kv_cache_dtype"] == engine.config.pool_dtype == "float32"
    assert info["page_size"] == engine.config.page_size
    assert info["max_total_tokens"] == engine.num_pages * engine.config.page_size
