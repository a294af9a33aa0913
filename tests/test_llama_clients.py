"""llama-server's clients on cadence's OpenAI endpoints (`server.llama_fields`): its web UI's
request as the UI sends it, the prompt's progress and the timings it reads, and llama-server's
other spellings; and the same progress and timings on its own /completion. The tiny model
behind a real server; its prefill chunk (32 tokens) splits a long prompt into several."""

from __future__ import annotations

import json

import httpx
import pytest

from cadence.server import protocol
from tests.conftest import serve_tiny

LONG = "The sea and the moon and the stars over the harbour at night, " * 5
CHAT = {"messages": [{"role": "user", "content": LONG}]}
# What llama.cpp's web UI sends with every message (tools/server/webui, services/chat.ts), its
# settings at their defaults.
WEB_UI = {"stream": True, "return_progress": True, "reasoning_format": "auto", "max_tokens": -1,
          "temperature": 0.8, "dynatemp_range": 0, "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95,
          "min_p": 0.05, "xtc_probability": 0, "xtc_threshold": 0.1, "typ_p": 1, "repeat_last_n": 64,
          "repeat_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0,
          "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
          "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                       "temperature"], "timings_per_token": False}


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer) as base:
        yield base


def chunks(url: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]


def text_of(frames: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in frames if c["choices"])


def check_progress(frames: list[dict], prompt_tokens: int) -> None:
    """The chunks before the first token's carry the prompt's progress: from what the cache
    gave, chunk by chunk, to the whole prompt; none after."""
    progress = [c["prompt_progress"] for c in frames if "prompt_progress" in c]
    first = next(i for i, c in enumerate(frames) if "prompt_progress" not in c)
    assert all("prompt_progress" not in c for c in frames[first:])
    assert len(progress) == first >= 3
    processed = [p["processed"] for p in progress]
    assert processed == sorted(processed) and len(set(processed)) == len(processed)
    assert processed[0] == progress[0]["cache"] and processed[-1] == prompt_tokens
    assert {(p["total"], p["cache"]) for p in progress} == {(prompt_tokens, progress[0]["cache"])}
    times = [p["time_ms"] for p in progress]
    assert times == sorted(times)


def test_the_web_uis_request_is_answered_with_its_progress_and_timings(url):
    """The web UI's message, streamed: the answer its sampling settings give (the same request in
    cadence's own spelling, seeded alike), after chunks of the prompt's progress, and the
    timings it shows in the last."""
    seeded = {**CHAT, "seed": 5, "max_tokens": 12}
    frames = chunks(url, "/v1/chat/completions", {**WEB_UI, **seeded, "stream_options": {"include_usage": True}})
    plain = {k: v for k, v in WEB_UI.items()
             if k not in ("return_progress", "reasoning_format", "typ_p", "timings_per_token", "max_tokens")}
    same = chunks(url, "/v1/chat/completions", {**plain, **seeded, "typical_p": 1})
    assert text_of(frames) == text_of(same) != ""
    *frames, usage = frames
    prompt_tokens = usage["usage"]["prompt_tokens"]
    check_progress(frames, prompt_tokens)
    timed = [c for c in frames if "timings" in c]
    assert timed == [frames[-1]] and frames[-1]["choices"][0]["finish_reason"] == "length"
    timings = timed[0]["timings"]
    assert timings["predicted_n"] == usage["usage"]["completion_tokens"] == 12
    assert timings["prompt_n"] + timings["cache_n"] == prompt_tokens
    assert timings["cache_n"] == usage["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
    assert not any("timings" in c or "prompt_progress" in c for c in same)  # asked for neither


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 10}),
], ids=["chat", "completions"])
def test_timings_per_token_rides_every_chunk(url, path, body):
    frames = chunks(url, path, {**body, "stream": True, "timings_per_token": True, "temperature": 0,
                                "ignore_eos": True})
    assert all("timings" in c for c in frames)
    counts = [c["timings"]["predicted_n"] for c in frames]
    assert counts == sorted(counts) and counts[-1] == 10 and len(set(counts)) >= 8
    whole = httpx.post(f"{url}{path}", json={**body, "timings_per_token": True, "temperature": 0,
                                             "ignore_eos": True}, timeout=60).json()
    assert whole["timings"]["predicted_n"] == 10
    assert "timings" not in httpx.post(f"{url}{path}", json=body, timeout=60).json()


def test_completions_stream_their_progress_too(url):
    frames = chunks(url, "/v1/completions", {"prompt": "Once: " + LONG, "max_tokens": 4, "stream": True,
                                             "return_progress": True, "stream_options": {"include_usage": True}})
    *frames, usage = frames
    check_progress(frames, usage["usage"]["prompt_tokens"])
    assert all(c["choices"][0]["text"] == "" for c in frames if "prompt_progress" in c)
    assert "timings" in frames[-1]


def test_llama_servers_own_completion_streams_progress_and_timings(url, tiny_tokenizer):
    body = {"prompt": "Twice: " + LONG, "n_predict": 6, "temperature": 0, "stream": True}
    frames = chunks(url, "/completion", {**body, "return_progress": True, "timings_per_token": True})
    n = len(tiny_tokenizer.encode(body["prompt"]))
    check_progress(frames, n)
    steps = [c for c in frames if "prompt_progress" not in c]
    assert all(c["content"] == "" and c["tokens"] == [] for c in frames if "prompt_progress" in c)
    assert [c["timings"]["predicted_n"] for c in steps[:-1]] == list(range(1, 7))
    plain = chunks(url, "/completion", body)
    assert [c["content"] for c in plain] == [c["content"] for c in steps]
    assert not any("timings" in c for c in plain[:-1]) and "timings" in plain[-1]


def test_llama_servers_spellings_of_cadences_fields(url):
    """n_predict (which wins over max_tokens), -1 for no limit, typ_p for typical_p, and the
    fields that change nothing here: each answer is the one in cadence's spelling."""
    def tokens(path, body):
        r = httpx.post(f"{url}{path}", json={**body, "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()["choices"][0]["finish_reason"]

    chat = {**CHAT, "temperature": 0.9, "seed": 11}
    assert tokens("/v1/chat/completions", {**chat, "n_predict": 5, "max_tokens": 9}) == tokens(
        "/v1/chat/completions", {**chat, "max_tokens": 5})
    assert tokens("/v1/chat/completions", {**chat, "max_tokens": 9, "typ_p": 0.6}) == tokens(
        "/v1/chat/completions", {**chat, "max_tokens": 9, "typical_p": 0.6})
    assert protocol.parse({**chat, "typ_p": 0.6}, chat=True).params.sampling.typical_p == 0.6
    ignored = {"cache_prompt": False, "id_slot": 3, "t_max_prompt_ms": 50, "sse_ping_interval": 1,
               "reasoning_control": True}
    assert tokens("/v1/chat/completions", {**chat, "max_tokens": 7, **ignored}) == tokens(
        "/v1/chat/completions", {**chat, "max_tokens": 7})
    # -1: up to the end of the context (a completion's default is 16 tokens)
    ids, reason = tokens("/v1/completions", {"prompt": LONG, "max_tokens": -1, "ignore_eos": True,
                                             "temperature": 0})
    prompt = httpx.post(f"{url}/tokenize", json={"content": LONG}).json()["tokens"]
    assert reason == "length" and len(prompt) + len(ids) == 512


def test_reasoning_format_is_separate_reasoning():
    def parsed(**fields):
        return protocol.parse({**CHAT, **fields}, chat=True)

    assert parsed(reasoning_format="none").separate_reasoning is False
    assert parsed(reasoning_format="deepseek").separate_reasoning is True
    assert parsed().separate_reasoning is True


@pytest.mark.parametrize("path, body, param, fragment", [
    ("/v1/chat/completions", {**CHAT, "reasoning_format": "deepseek-legacy"}, "reasoning_format", "must be one of"),
    ("/v1/chat/completions", {**CHAT, "reasoning_format": "none", "separate_reasoning": True},
     "reasoning_format", "disagree"),
    ("/v1/chat/completions", {**CHAT, "typ_p": 0.5, "typical_p": 0.5}, "typ_p", "give one"),
    ("/v1/chat/completions", {**CHAT, "return_progress": 1}, "return_progress", "true or false"),
    ("/v1/chat/completions", {**CHAT, "cache_prompt": "yes"}, "cache_prompt", "true or false"),
    ("/v1/chat/completions", {**CHAT, "n_predict": 0}, "max_tokens", ">= 1"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -2}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "a", "reasoning_format": "none"}, "reasoning_format", "unrecognized"),
    ("/v1/chat/completions", {**CHAT, "post_sampling_probs": True}, "post_sampling_probs", "unrecognized"),
    ("/v1/chat/completions", {**CHAT, "sse_ping_interval": 0.001}, "sse_ping_interval", "at least 0.01"),
    ("/completion", {"prompt": "a", "sse_ping_interval": 1e-9}, "sse_ping_interval", "at least 0.01"),
])
def test_what_they_refuse(url, path, body, param, fragment):
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"], r.text


def test_post_sampling_probs_are_of_what_each_token_was_drawn_from(url):
    """/completion's post_sampling_probs: each token's `prob` and its `top_probs` are the
    distribution its draw had: top_k 3 leaves at most 3 alternatives, summing to 1 with the
    token among them; greedy, the token alone at 1. Without it, the raw logprobs."""
    body = {"prompt": "Twice more: " + LONG, "n_predict": 8, "n_probs": 5, "seed": 3, "return_tokens": True}
    sampled = httpx.post(f"{url}/completion", json={**body, "temperature": 1.5, "top_k": 3,
                                                    "post_sampling_probs": True}, timeout=60).json()
    raw = httpx.post(f"{url}/completion", json={**body, "temperature": 1.5, "top_k": 3}, timeout=60).json()
    assert sampled["tokens"] == raw["tokens"]  # the same draws: only what is reported differs
    for entry, plain in zip(sampled["completion_probabilities"], raw["completion_probabilities"]):
        top = entry["top_probs"]
        assert 1 <= len(top) <= 3 and "logprob" not in entry and "top_logprobs" not in entry
        assert sum(t["prob"] for t in top) == pytest.approx(1, abs=1e-5)
        assert {t["id"]: t["prob"] for t in top}[entry["id"]] == pytest.approx(entry["prob"], abs=1e-6)
        assert len(plain["top_logprobs"]) == 5 and plain["logprob"] <= 0
    greedy = httpx.post(f"{url}/completion", json={**body, "temperature": 0, "post_sampling_probs": True},
                        timeout=60).json()
    for entry in greedy["completion_probabilities"]:
        assert entry["prob"] == 1.0 and [(t["id"], t["prob"]) for t in entry["top_probs"]] == [(entry["id"], 1.0)]



def test_n_cmpl_gives_the_openai_doors_choices(url):
    """/completion's n_cmpl (and its alias n): an array of answers by index, each the choice
    /v1/completions gives with n (the same seeds; llama.cpp's order named on both), whole and
    streamed; one completion answers an object, as before."""
    body = {"prompt": "Three ways: " + LONG, "temperature": 1.5, "top_k": 0, "top_p": 1, "min_p": 0,
            "typical_p": 0.95, "seed": 7, "ignore_eos": True,
            # (the tiny model puts all its mass on one token; these it makes a choice of)
            "logit_bias": {str(i): 40 for i in range(10, 40)}}
    mine = httpx.post(f"{url}/completion", json={**body, "n_predict": 6, "n_cmpl": 3, "return_tokens": True},
                      timeout=60).json()
    assert [a["index"] for a in mine] == [0, 1, 2]
    openai = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 6, "n": 3,
                                                       "return_token_ids": True}, timeout=60).json()
    choices = sorted(openai["choices"], key=lambda c: c["index"])
    assert [a["tokens"] for a in mine] == [c["token_ids"] for c in choices]
    assert len({tuple(a["tokens"]) for a in mine}) > 1  # (the choices differ)
    frames = chunks(url, "/completion", {**body, "n_predict": 6, "n": 3, "stream": True})
    for a in mine:
        own = [c for c in frames if c["index"] == a["index"]]
        assert "".join(c["content"] for c in own) == a["content"] and own[-1]["stop"] is True
    one = httpx.post(f"{url}/completion", json={**body, "n_predict": 6, "n_cmpl": 1}, timeout=60).json()
    assert one["index"] == 0 and one["content"] == mine[0]["content"]
    for many, param in ((0, "n_cmpl"), (9, "n_cmpl")):
        r = httpx.post(f"{url}/completion", json={**body, "n_cmpl": many}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_array_of_prompts_answers_each_prompt_times_n_cmpl(url):
    """/completion's `prompt` as an array (text, token ids, {"prompt_string": text}): an
    array of answers, each prompt's n_cmpl completions after the one before's, as llama-server
    orders them; each the answer its prompt alone gives (seeded, whole and streamed). Token ids
    mixed with text in one prompt, and multimodal data, are refused by name."""
    body = {"temperature": 1.5, "top_k": 0, "top_p": 1, "min_p": 0, "seed": 7, "ignore_eos": True,
            "n_predict": 5, "return_tokens": True, "logit_bias": {str(i): 40 for i in range(10, 40)}}
    ids = httpx.post(f"{url}/tokenize", json={"content": "Another: " + LONG}, timeout=60).json()["tokens"]
    prompts = ["Three ways: " + LONG, ids, {"prompt_string": "One more, " + LONG}]
    alone = [httpx.post(f"{url}/completion", json={**body, "prompt": p, "n_cmpl": 2}, timeout=60).json()
             for p in prompts]
    mine = httpx.post(f"{url}/completion", json={**body, "prompt": prompts, "n_cmpl": 2}, timeout=60).json()
    assert [a["index"] for a in mine] == list(range(6))
    assert [a["tokens"] for a in mine] == [a["tokens"] for pair in alone for a in pair]
    assert mine[2]["tokens_evaluated"] == len(ids)
    frames = chunks(url, "/completion", {**body, "prompt": prompts, "n_cmpl": 2, "stream": True})
    for a in mine:
        own = [c for c in frames if c["index"] == a["index"]]
        assert "".join(c["content"] for c in own) == a["content"] and own[-1]["stop"] is True
    single = httpx.post(f"{url}/completion", json={**body, "prompt": [prompts[0]]}, timeout=60).json()
    assert single["index"] == 0 and single["tokens"] == alone[0][0]["tokens"]  # (one: the object)
    for wrong in ([1, "a", 2], [{"prompt_string": "a", "multimodal_data": ["AA=="]}], []):
        r = httpx.post(f"{url}/completion", json={**body, "prompt": wrong}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_a_stream_waiting_behind_full_slots_is_kept_alive(url):
    """Queued behind four long answers, a stream sends keep-alive comments (`:`) at its
    sse_ping_interval until its first chunk; its chunks are the same answer as without them;
    0 turns them off."""
    import threading
    import time

    busy = {"prompt": "busy", "max_tokens": 300, "ignore_eos": True, "temperature": 0}

    def waiting(interval: float) -> str:
        holders = [threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                    kwargs={"json": busy, "timeout": 120}) for _ in range(4)]
        for t in holders:
            t.start()
        deadline = time.monotonic() + 60
        while sum(s["is_processing"] for s in httpx.get(f"{url}/slots").json()) < 4:
            assert time.monotonic() < deadline, "the four never held every slot"
            time.sleep(0.005)
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 4, "temperature": 0,
                                                           "stream": True, "sse_ping_interval": interval},
                       timeout=120)
        for t in holders:
            t.join()
        return r.text

    pinged, quiet = waiting(0.02), waiting(0)
    frames = pinged.split("\n\n")
    first = next(i for i, f in enumerate(frames) if f.startswith("data: "))
    assert first >= 3 and frames[:first] == [":"] * first
    def answer(raw: str) -> str:
        return text_of([json.loads(f[6:]) for f in raw.split("\n\n") if f.startswith("data: {")])

    assert answer(pinged) == answer(quiet) != "" and ":" not in quiet.split("\n\n")
