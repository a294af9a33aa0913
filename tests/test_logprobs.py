"""Logprobs, computed on the device in the prefill and decode programs, against the reference's
log-softmax over one forward pass of the whole sequence; and their OpenAI shapes over HTTP."""

from __future__ import annotations

import json
import random

import httpx
import numpy as np
import pytest

from cadence.engine.config import EngineConfig
from cadence.engine.reference import greedy_generate, log_softmax, sequence_logits
from cadence.model.host_sampling import RequestSampling
from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.conftest import SAMPLING_ENGINE
from tests.fakes import random_prompts, run_all
from tests.serving import serving

# Several steps per dispatch: the full tier (test_multistep.py compares them with one step at a
# time, penalties and logprobs included, in the default one).
@pytest.fixture(params=[1, pytest.param(4, marks=pytest.mark.slow)], ids=["1step", "4steps"])
def engine(request, shared_engine):
    # The sampling tests' engine (test_penalties.py's too); the scoring prefill compiles on the
    # first echo.
    return shared_engine(EngineConfig(**SAMPLING_ENGINE, decode_steps=request.param), "needed")


def scheduler(engine, tokenizer) -> Scheduler:
    return Scheduler(engine, tokenizer, SchedulerConfig(
        policy=PolicyConfig(name="chunked", token_budget=48, chunk=32)))


def check_against_reference(params, config, prompt, request, k):
    """Every output token's logprob, and its top k, equal the reference's log-softmax at that
    position (within 1e-4); top ids equal where the values are not tied."""
    entries = request.logprobs
    assert [e.token_id for e in entries] == request.output_ids
    reference = log_softmax(sequence_logits(params, config, prompt + request.output_ids))
    for i, e in enumerate(entries):
        row = reference[len(prompt) - 1 + i]
        assert e.logprob == pytest.approx(row[e.token_id], abs=1e-4)
        assert len(e.top) == k
        ids, values = [t for t, _ in e.top], np.asarray([v for _, v in e.top])
        np.testing.assert_allclose(values, row[ids], atol=1e-4)
        ranked = np.argsort(-row, kind="stable")
        ordered = row[ranked]
        np.testing.assert_allclose(values, ordered[:k], atol=1e-4)
        for j in range(k):  # an id whose value is apart from its neighbours' has one place
            if (j == 0 or ordered[j - 1] - ordered[j] > 1e-4) and ordered[j] - ordered[j + 1] > 1e-4:
                assert ids[j] == ranked[j]


def test_logprobs_equal_the_reference_greedy_and_sampled(engine, tiny_params, tiny_config, tiny_tokenizer):
    """Greedy and sampled requests with 0, 3 and 8 alternatives (8: the engine's max_logprobs),
    beside requests without logprobs, prompts over several chunks: the first token's logprobs
    come from the prefill program, the rest from decode."""
    rng = random.Random(4)
    prompts = random_prompts(rng, 7, tiny_config.vocab_size, 3, 80)
    ks = [0, 3, None, 8, 3, None, 1]
    samplings = [RequestSampling(temperature=0.9 * (i % 2), seed=i, top_k=50 * (i % 3))
                 for i in range(len(prompts))]
    subs = [(p, GenerationParams(max_tokens=14, ignore_eos=True, sampling=s, logprobs=k))
            for p, s, k in zip(prompts, samplings, ks)]
    # The process's count (the engine is shared, and other tests compile their own programs).
    before = engine.compilations_after_warmup
    streams = run_all(scheduler(engine, tiny_tokenizer), subs, [rng.randint(0, 5) for _ in subs])
    assert engine.compilations_after_warmup == before
    for prompt, sampling, k, s in zip(prompts, samplings, ks, streams):
        if k is None:
            assert s.request.logprobs is None and s.record.logprobs is None
            continue
        if sampling.temperature == 0:
            assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 14)
        check_against_reference(tiny_params, tiny_config, prompt, s.request, k)
        text = "".join(e.text for e in s.record.logprobs)
        assert text == tiny_tokenizer.decode(s.request.output_ids)


def test_logprobs_are_the_raw_distribution_whatever_the_penalties(engine, tiny_params, tiny_config, tiny_tokenizer):
    prompt = [7, 8, 9, 10, 11, 12]
    sampling = RequestSampling(repetition_penalty=1.7, logit_bias=((99, 5.0),))
    (s,) = run_all(scheduler(engine, tiny_tokenizer),
                   [(prompt, GenerationParams(max_tokens=8, ignore_eos=True, sampling=sampling, logprobs=2))])
    assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 8, sampling=sampling)
    check_against_reference(tiny_params, tiny_config, prompt, s.request, 2)


def test_more_logprobs_than_the_engine_computes_are_refused(engine, tiny_tokenizer):
    sched = scheduler(engine, tiny_tokenizer)
    with pytest.raises(SubmissionError, match="at most 8 logprobs"):
        sched.submit([1, 2, 3], GenerationParams(max_tokens=2, logprobs=9))


def lines(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_openai_shapes_streamed_and_whole(tiny_engine, tiny_tokenizer, tiny_params, tiny_config):
    """Completions' {tokens, token_logprobs, top_logprobs, text_offset} and chat's
    content[{token, logprob, bytes, top_logprobs}], streamed chunk by chunk and whole, with the
    same values, spelling the text exactly."""
    prompt = "the quick brown fox jumps over"
    ids = tiny_tokenizer.encode(prompt)
    want = greedy_generate(tiny_params, tiny_config, ids, 10)
    reference = log_softmax(sequence_logits(tiny_params, tiny_config, ids + want))[len(ids) - 1:]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 3}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    with serving(tiny_engine, tiny_tokenizer) as (base, _):
        whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        streamed = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=60)
        chat_whole = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).json()
        chat_streamed = httpx.post(f"{base}/v1/chat/completions", json={**chat, "stream": True}, timeout=60)
        plain = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": None}, timeout=60).json()
        by_id = httpx.post(f"{base}/v1/completions", json={**body, "return_tokens_as_token_ids": True},
                           timeout=60).json()["choices"][0]["logprobs"]
        chat_by_id = httpx.post(f"{base}/v1/chat/completions", json={
            **chat, "stream": True, "return_tokens_as_token_ids": True}, timeout=60)
        for bad, fragment in [({"top_logprobs": 21}, "at most 20 logprobs"),
                              ({"logprobs": False, "top_logprobs": 2}, "needs"),
                              ({"top_logprobs": -1}, ">= 0"), ({"logprobs": 1}, "true or false")]:
            r = httpx.post(f"{base}/v1/chat/completions", json={**chat, **bad}, timeout=60)
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], (bad, r.text)
        r = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 21}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert plain["choices"][0]["logprobs"] is None
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] == tiny_tokenizer.decode(want)
    np.testing.assert_allclose(lp["token_logprobs"], [reference[i, t] for i, t in enumerate(want)], atol=1e-4)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(want))]
    assert all(len(top) <= 3 for top in lp["top_logprobs"])
    parts = [c["choices"][0] for c in lines(streamed) if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum((p["logprobs"]["tokens"] for p in parts), []) == lp["tokens"]
    assert sum((p["logprobs"]["text_offset"] for p in parts), []) == lp["text_offset"]
    np.testing.assert_allclose(sum((p["logprobs"]["token_logprobs"] for p in parts), []),
                               lp["token_logprobs"], atol=1e-6)

    # By id (vLLM's return_tokens_as_token_ids): the same entries, each token named by its id.
    assert by_id["tokens"] == [f"token_id:{t}" for t in want]
    assert by_id["text_offset"] == lp["text_offset"] and by_id["token_logprobs"] == lp["token_logprobs"]
    for i, top in enumerate(by_id["top_logprobs"]):
        assert len(top) == 3
        np.testing.assert_allclose([v for v in top.values()],
                                   [reference[i, int(k.removeprefix("token_id:"))] for k in top], atol=1e-4)
    by_id_content = sum((c["choices"][0]["logprobs"]["content"] for c in lines(chat_by_id)
                         if c["choices"] and c["choices"][0].get("logprobs")), [])
    ids_of = [int(c["token"].removeprefix("token_id:")) for c in by_id_content]
    assert tiny_tokenizer.decode(ids_of) == chat_whole["choices"][0]["message"]["content"]
    assert all(a["token"].startswith("token_id:") for c in by_id_content for a in c["top_logprobs"])

    content = chat_whole["choices"][0]["logprobs"]["content"]
    text = chat_whole["choices"][0]["message"]["content"]
    assert "".join(c["token"] for c in content) == text
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8", errors="replace").strip() == text.strip()
    assert all(len(c["top_logprobs"]) == 2 and {"token", "logprob", "bytes"} <= c["top_logprobs"][0].keys()
               for c in content)
    assert all(c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6 for c in content)  # greedy
    streamed_content = sum((c["choices"][0]["logprobs"]["content"] for c in lines(chat_streamed)
                            if c["choices"] and c["choices"][0].get("logprobs")), [])
    assert [c["token"] for c in streamed_content] == [c["token"] for c in content]
    np.testing.assert_allclose([c["logprob"] for c in streamed_content], [c["logprob"] for c in content],
                               atol=1e-6)


def test_prompt_logprobs_equal_the_reference_forward_pass(engine, tiny_params, tiny_config, tiny_tokenizer):
    """echo's prompt logprobs: a prompt over three chunks, scored chunk by chunk in the scoring
    program beside a plain request packed as usual; every prompt token's logprob (the first
    has none) and alternatives equal the reference's forward pass, and the outputs are still
    the reference generator's."""
    rng = random.Random(9)
    prompt, other = random_prompts(rng, 2, tiny_config.vocab_size, 70, 80)
    subs = [(prompt, GenerationParams(max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=4)),
            (other, GenerationParams(max_tokens=6, ignore_eos=True))]
    # The process's count, less the programs compiled on first use (the scoring ones, warmed
    # "needed"): other tests compile their own programs.
    before = engine.compilations_after_warmup
    scored, plain = run_all(scheduler(engine, tiny_tokenizer), subs)
    assert engine.compilations_after_warmup == before
    assert scored.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 6)
    assert plain.request.output_ids == greedy_generate(tiny_params, tiny_config, other, 6)
    entries = scored.record.prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    reference = log_softmax(sequence_logits(tiny_params, tiny_config, prompt))
    for p in range(1, len(prompt)):
        e = entries[p]
        assert e.token_id == prompt[p]
        assert e.logprob == pytest.approx(reference[p - 1, prompt[p]], abs=1e-4)
        np.testing.assert_allclose([v for _, v in e.top], np.sort(reference[p - 1])[::-1][:4], atol=1e-4)
        # Its rank counts the ids at least as likely, itself included (within the tolerance).
        row, value = reference[p - 1], reference[p - 1, prompt[p]]
        assert 1 + np.sum(row > value + 1e-4) <= e.rank <= np.sum(row >= value - 1e-4)
    check_against_reference(tiny_params, tiny_config, prompt, scored.request, 4)


def test_echo_over_http(tiny_engine, tiny_tokenizer, tiny_params, tiny_config):
    prompt = "a b c the cat sat on the mat"
    ids = tiny_tokenizer.encode(prompt)
    want = greedy_generate(tiny_params, tiny_config, ids, 5)
    reference = log_softmax(sequence_logits(tiny_params, tiny_config, ids + want))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "echo": True}
    with serving(tiny_engine, tiny_tokenizer) as (base, _):
        bare = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        whole = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 2}, timeout=60).json()
        streamed = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 2, "stream": True}, timeout=60)
        two = httpx.post(f"{base}/v1/completions", json={**body, "n": 2, "logprobs": 1}, timeout=60).json()
        r = httpx.post(f"{base}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "echo": True}, timeout=60)
        assert r.status_code == 400  # chat has no echo
    text = tiny_tokenizer.decode(ids) + tiny_tokenizer.decode(want)
    assert bare["choices"][0]["text"] == text and bare["choices"][0]["logprobs"] is None
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == text == "".join(lp["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    everything = ids + want
    np.testing.assert_allclose(lp["token_logprobs"][1:], [reference[p - 1, everything[p]] for p in range(1, len(everything))],
                               atol=1e-4)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(everything))]
    chunks = [json.loads(line[6:])["choices"][0] for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["text"] for c in chunks) == text
    assert sum((c["logprobs"]["tokens"] for c in chunks if c["logprobs"]), []) == lp["tokens"]
    assert all(c["text"] == text and c["logprobs"]["token_logprobs"][0] is None for c in two["choices"])
    assert two["usage"]["prompt_tokens"] == len(ids)


def test_max_tokens_0_with_echo_scores_the_prompt_alone(tiny_engine, tiny_tokenizer, tiny_params, tiny_config):
    """OpenAI's prompt scoring: max_tokens 0 with echo answers the prompt and its logprobs,
    nothing generated (usage 0, finish "length"), whole or streamed, one or several prompts
    and choices; max_tokens 0 without echo is a 400."""
    prompt = "a b c the cat sat on the mat"
    ids = tiny_tokenizer.encode(prompt)
    reference = log_softmax(sequence_logits(tiny_params, tiny_config, ids))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2,
            "temperature": 1.0}
    with serving(tiny_engine, tiny_tokenizer) as (base, _):
        post = lambda b: httpx.post(f"{base}/v1/completions", json=b, timeout=60)  # noqa: E731
        whole = post(body).json()
        many = post({**body, "prompt": [prompt, ids[:5]], "n": 2}).json()
        streamed = post({**body, "stream": True, "stream_options": {"include_usage": True}})
        refused = post({**body, "echo": False})
        floated = post({**body, "max_tokens": 0.0})
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == tiny_tokenizer.decode(ids) == "".join(lp["tokens"])
    assert choice["finish_reason"] == "length" and len(lp["tokens"]) == len(ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:], [reference[p - 1, ids[p]] for p in range(1, len(ids))],
                               atol=1e-4)
    usage = whole["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (len(ids), 0, len(ids))
    assert [c["text"] for c in many["choices"]] == [choice["text"]] * 2 + [tiny_tokenizer.decode(ids[:5])] * 2
    assert many["usage"]["completion_tokens"] == 0
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts == [choice["text"], ""] and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == lp["tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert floated.status_code == 400 and "integer" in floated.json()["error"]["message"]


def test_prompt_logprobs_over_http(tiny_engine, tiny_tokenizer, tiny_params, tiny_config):
    """vLLM's prompt_logprobs: each prompt token's logprob, rank and k alternatives by id, in
    every choice of a completion and once in a chat's response; beside echo's logprobs of
    another k, each keeps its own; streaming, -1 and more than --max_logprobs are 400s."""
    prompt = "a b c the cat sat on the mat"
    ids = tiny_tokenizer.encode(prompt)
    reference = log_softmax(sequence_logits(tiny_params, tiny_config, ids))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 3}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
    with serving(tiny_engine, tiny_tokenizer) as (base, _):
        post = lambda path, b: httpx.post(f"{base}{path}", json=b, timeout=60)  # noqa: E731
        two = post("/v1/completions", {**body, "n": 2, "temperature": 1.0, "seed": 1}).json()
        echoed = post("/v1/completions", {**body, "echo": True, "logprobs": 1}).json()
        chatted = post("/v1/chat/completions", chat).json()
        refused = {name: post("/v1/completions", {**body, **change}) for name, change in (
            ("stream", {"stream": True}), ("all", {"prompt_logprobs": -1}),
            ("negative", {"prompt_logprobs": -2}), ("many", {"prompt_logprobs": 21}))}
    ranked = two["choices"][0]["prompt_logprobs"]
    assert [c["prompt_logprobs"] for c in two["choices"]] == [ranked, ranked]
    assert ranked[0] is None and len(ranked) == len(ids)
    for p in range(1, len(ids)):
        row, entries = reference[p - 1], ranked[p]
        own = entries[str(ids[p])]
        assert list(entries)[0] == str(ids[p])  # its own first, then the 3 likeliest
        assert own["logprob"] == pytest.approx(row[ids[p]], abs=1e-4)
        assert 1 + np.sum(row > row[ids[p]] + 1e-4) <= own["rank"] <= np.sum(row >= row[ids[p]] - 1e-4)
        top = np.argsort(-row)[:3]
        assert {int(t) for t in entries} == {ids[p], *map(int, top)}
        for rank, t in enumerate(top, 1):
            e = entries[str(t)]
            assert e["logprob"] == pytest.approx(row[t], abs=1e-4)
            assert e["decoded_token"] == tiny_tokenizer.token_bytes(int(t)).decode("utf-8", errors="replace")
            assert e["rank"] == rank
    choice = echoed["choices"][0]
    assert choice["prompt_logprobs"] == ranked
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # echo's own k
    assert "prompt_logprobs" not in chatted["choices"][0]
    chat_ranked = chatted["prompt_logprobs"]
    assert chat_ranked[0] is None and len(chat_ranked) == chatted["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["decoded_token"]
               == tiny_tokenizer.token_bytes(int(next(iter(e)))).decode("utf-8", errors="replace")
               for e in chat_ranked[1:])
    for name, r in refused.items():
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", name


def test_return_token_ids_gives_the_prompts_and_each_choices_ids(tiny_engine, tiny_tokenizer,
                                                                 tiny_params, tiny_config):
    """vLLM's return_token_ids: completions' choices carry their prompt's ids and their own, a
    chat's response its prompt's once; streamed, the prompt's go in the first chunk (each
    choice's, for completions) and each chunk carries its tokens, which add up to the whole
    answer's; the generated ids are the reference's, end of sequence included."""
    prompt = "the quick brown fox jumps over"
    ids = tiny_tokenizer.encode(prompt)
    want = greedy_generate(tiny_params, tiny_config, ids, 10, tiny_tokenizer.eos_ids)
    messages = [{"role": "user", "content": prompt}]
    chat_ids = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages))
    body = {"model": "tiny", "prompt": [prompt, "over the lazy"], "max_tokens": 10, "temperature": 0,
            "return_token_ids": True}
    chat = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0,
            "return_token_ids": True, "n": 2}
    with serving(tiny_engine, tiny_tokenizer) as (base, _):
        whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        streamed = lines(httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=60))
        chat_whole = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).json()
        chat_streamed = lines(httpx.post(f"{base}/v1/chat/completions", json={**chat, "stream": True},
                                         timeout=60))
        plain = httpx.post(f"{base}/v1/completions", json={**body, "return_token_ids": False}, timeout=60)
        bad = httpx.post(f"{base}/v1/completions", json={**body, "return_token_ids": 1}, timeout=60)
    first = whole["choices"][0]
    assert first["prompt_token_ids"] == ids and first["token_ids"] == want
    assert whole["choices"][1]["prompt_token_ids"] == tiny_tokenizer.encode("over the lazy")
    assert tiny_tokenizer.decode(first["token_ids"], skip_special=True) == first["text"]
    for index, choice in enumerate(whole["choices"]):
        chunks = [c["choices"][0] for c in streamed if c["choices"] and c["choices"][0]["index"] == index]
        assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        assert [t for c in chunks for t in c.get("token_ids", [])] == choice["token_ids"]
    assert chat_whole["prompt_token_ids"] == chat_ids
    assert all(c["token_ids"] and "prompt_token_ids" not in c for c in chat_whole["choices"])
    assert chat_streamed[0]["prompt_token_ids"] == chat_ids
    assert all("prompt_token_ids" not in c for c in chat_streamed[1:])
    for choice in chat_whole["choices"]:
        i = choice["index"]
        assert [t for c in chat_streamed for ch in c["choices"] if ch["index"] == i
                for t in ch.get("token_ids", [])] == choice["token_ids"]
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain.json()["choices"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_token_ids"


def test_truncate_prompt_tokens_keeps_each_prompts_last_tokens(tiny_engine, tiny_tokenizer,
                                                               tiny_params, tiny_config):
    """vLLM's truncate_prompt_tokens: a completion's (and a chat's rendered) prompt cut to its
    last k tokens, as the request asked, answered as that prompt alone would be; a prompt past
    the context is then served, where without it it is a 400; 0 and with a suffix, a 400."""
    long_text = "the quick brown fox jumps over the lazy dog " * 200  # past the 512-token context
    ids = tiny_tokenizer.encode(long_text)
    assert len(ids) > tiny_config.max_context
    body = {"model": "tiny", "prompt": long_text, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there, how are you"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "truncate_prompt_tokens": 4}
    with serving(tiny_engine, tiny_tokenizer) as (base, _):
        cut = httpx.post(f"{base}/v1/completions", json={**body, "truncate_prompt_tokens": 100}, timeout=60)
        whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        chatted = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).json()
        bad = [httpx.post(f"{base}/v1/completions", json={**body, **extra}, timeout=60)
               for extra in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": 5, "suffix": "x"})]
    choice = cut.json()["choices"][0]
    assert cut.status_code == 200 and choice["prompt_token_ids"] == ids[-100:]
    assert cut.json()["usage"]["prompt_tokens"] == 100
    assert choice["token_ids"] == greedy_generate(tiny_params, tiny_config, ids[-100:], 6)
    assert whole.status_code == 400 and whole.json()["error"]["code"] == "context_length_exceeded"
    rendered = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(chat["messages"]))
    assert chatted["prompt_token_ids"] == rendered[-4:]
    assert chatted["choices"][0]["token_ids"] == greedy_generate(tiny_params, tiny_config, rendered[-4:], 6)
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens" for r in bad)
