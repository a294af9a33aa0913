"""llama-server's own /completion (and /completions) on the tiny model: the reference's greedy
tokens, its shapes whole and streamed, n_probs against /v1/completions' logprobs, a grammar,
its penalties over the last repeat_last_n tokens, and what it refuses."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from cadence.engine.reference import greedy_generate
from cadence.model.host_sampling import RequestSampling
from cadence.server import llama_sampling
from tests.conftest import serve_tiny, tiny_app

PROMPT = "The capital of France is"


def test_slots_show_each_slot_and_the_request_holding_it(tiny_engine, tiny_tokenizer):
    """GET /slots (llama-server's): every slot, free or held; a held one names its request and
    has its state and its prompt, prefilled, decoded and remaining tokens as the scheduler has
    them, step by step; fail_on_no_slot=1 is a 503 only while every slot is held; with slots
    off there is no such route. (First in the module: the server the others share is not up,
    and this test steps its own scheduler of the same engine by hand.)"""
    from starlette.testclient import TestClient

    from cadence.scheduler.request import GenerationParams

    app, sched = tiny_app(tiny_engine, tiny_tokenizer)
    client = TestClient(app)  # (no lifespan: nothing steps the scheduler but this test)
    n = sched.num_slots
    long = sched.submit(list(range(3, 83)), GenerationParams(max_tokens=12, ignore_eos=True))
    short = sched.submit([5, 6, 7], GenerationParams(max_tokens=4, ignore_eos=True))
    seen = set()
    while not sched.idle():
        sched.step()
        slots = client.get("/slots").json()
        assert [s["id"] for s in slots] == list(range(n)) and {s["pool"] for s in slots} == {"colocated"}
        held = {s["id_task"]: s for s in slots if s["is_processing"]}
        assert all(s["id_task"] == -1 and s["state"] == "idle" for s in slots if not s["is_processing"])
        for stream in (long, short):
            r = stream.request
            if r.slot is None or r.finished:  # (a finished request keeps its slot's number)
                assert r.id not in held
                continue
            s = held[r.id]
            assert s["id"] == r.slot and s["n_ctx"] == sched.max_seq_len and s["state"] == r.state.value
            assert (s["n_prompt_tokens"], s["n_prompt_tokens_processed"]) == (r.prompt_len, min(r.prefilled, r.prompt_len))
            assert (s["next_token"]["n_decoded"], s["next_token"]["n_remain"]) == (
                len(r.output_ids), r.max_tokens - len(r.output_ids))
            seen.add((r.id, s["state"], 0 < s["n_prompt_tokens_processed"] < r.prompt_len))
    assert (long.request.id, "prefilling", True) in seen and (long.request.id, "decoding", False) in seen
    assert client.get("/slots?fail_on_no_slot=1").status_code == 200
    streams = [sched.submit([5, 6, 7], GenerationParams(max_tokens=32, ignore_eos=True)) for _ in range(n)]
    while any(s.request.state.value in ("waiting", "prefilling") for s in streams):
        sched.step()
    assert client.get("/slots?fail_on_no_slot=1").status_code == 503
    assert all(s["is_processing"] for s in client.get("/slots").json())
    while not sched.idle():
        sched.step()
    assert client.get("/slots?fail_on_no_slot=1").status_code == 200
    off, _ = tiny_app(tiny_engine, tiny_tokenizer, slots=False)
    assert TestClient(off).get("/slots").status_code == 404
    assert TestClient(off).get("/props").json()["endpoint_slots"] is False


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer) as base:
        yield base


def test_a_greedy_completion_is_the_references(url, tiny_tokenizer, tiny_params, tiny_config):
    ids = tiny_tokenizer.encode(PROMPT)
    want = greedy_generate(tiny_params, tiny_config, ids, 12, tiny_tokenizer.eos_ids)
    for path, prompt in (("/completion", PROMPT), ("/completions", ids)):
        r = httpx.post(f"{url}{path}", json={"prompt": prompt, "n_predict": 12, "temperature": 0,
                                            "return_tokens": True, "cache_prompt": True}, timeout=60).json()
        assert r["tokens"] == want and r["content"] == tiny_tokenizer.decode(want, skip_special=True)
        assert r["tokens_evaluated"] == len(ids) and r["tokens_predicted"] == len(want)
        assert r["stop"] is True and r["stop_type"] == ("limit" if len(want) == 12 else "eos")


def test_n_probs_are_the_openai_doors_logprobs(url):
    body = {"prompt": PROMPT, "temperature": 0}
    mine = httpx.post(f"{url}/completion", json={**body, "n_predict": 6, "n_probs": 3,
                                                 "return_tokens": True}, timeout=60).json()
    openai = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 6, "logprobs": 3,
                                                       "return_tokens_as_token_ids": True},
                        timeout=60).json()["choices"][0]["logprobs"]
    probs = mine["completion_probabilities"]
    assert [p["id"] for p in probs] == mine["tokens"]
    assert [f"token_id:{p['id']}" for p in probs] == openai["tokens"]
    assert [p["logprob"] for p in probs] == pytest.approx(openai["token_logprobs"], abs=1e-6)
    for p, top in zip(probs, openai["top_logprobs"]):
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]  # greedy
        assert {f"token_id:{t['id']}": t["logprob"] for t in p["top_logprobs"]} == pytest.approx(top, abs=1e-6)
        assert bytes(p["bytes"]).decode("utf-8", errors="replace") == p["token"]


def test_a_stream_spells_the_whole_answer(url):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 2, "return_tokens": True}
    whole = httpx.post(f"{url}/completion", json=body, timeout=60).json()
    with httpx.stream("POST", f"{url}/completion", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line]
    *steps, last = chunks
    assert "".join(c["content"] for c in steps) == whole["content"]
    assert [t for c in steps for t in c["tokens"]] == whole["tokens"]
    assert [p for c in steps for p in c["completion_probabilities"]] == whole["completion_probabilities"]
    assert last["stop"] is True and last["tokens_predicted"] == len(whole["tokens"])


def test_a_grammar_holds(url):
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": 30, "temperature": 1.0,
                                             "seed": 2, "grammar": 'root ::= "yes" | "no" | [0-9]{2}'},
                   timeout=60).json()
    assert re.fullmatch(r"yes|no|[0-9]{2}", r["content"]) and r["stop_type"] == "eos"


def test_penalties_count_over_the_last_repeat_last_n_tokens(url, tiny_tokenizer, tiny_params, tiny_config):
    """repeat_penalty, presence_penalty and frequency_penalty as llama-server counts them: over
    the last repeat_last_n tokens (64 when absent) of prompt and output, as the reference
    generator computes llama.cpp's; repeat_last_n 0 turns them off."""
    prompt = "the quick brown fox jumps over the lazy dog and the dog sleeps " * 8
    ids = tiny_tokenizer.encode(prompt)
    fields = {"repeat_penalty": 2.0, "presence_penalty": 2.0, "frequency_penalty": 2.0}
    body = {"prompt": prompt, "n_predict": 16, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    outputs = {}
    for window in (None, 6, 0, -1):
        extra = {} if window is None else {"repeat_last_n": window}
        outputs[window] = httpx.post(f"{url}/completion", json={**body, **fields, **extra},
                                     timeout=60).json()["tokens"]
        counted = {None: 64, -1: 2**31 - 1}.get(window, window)
        row = RequestSampling(repetition_penalty=2.0, presence_penalty=2.0, frequency_penalty=2.0,
                              penalty_window=counted) if counted else RequestSampling()
        assert outputs[window] == greedy_generate(tiny_params, tiny_config, ids, 16, sampling=row), window
    assert outputs[0] == greedy_generate(tiny_params, tiny_config, ids, 16)
    assert outputs[6] != outputs[None] != outputs[0]  # the window counts


def test_dry_greedy_is_the_references(url, tiny_tokenizer, tiny_params, tiny_config):
    """DRY over /completion, greedy: the reference generator's tokens with DRY as llama.cpp
    computes it, the breakers every token holding one of the characters; the tiny model, which
    repeats one token, is made to leave it; and leaving "dry" out of `samplers` turns it off."""
    from cadence.server.llama_sampling import DryBreakers

    ids = tiny_tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "return_tokens": True, "dry_multiplier": 3.0,
            "dry_allowed_length": 2, "dry_penalty_last_n": 32, "dry_sequence_breakers": ["a", "\n"]}
    got = httpx.post(f"{url}/completion", json=body, timeout=60).json()["tokens"]
    row = RequestSampling(dry_multiplier=3.0, dry_allowed_length=2, dry_window=32,
                          dry_breakers=DryBreakers(tiny_tokenizer).ids(("a", "\n")), temperature_last=True)
    assert row.dry_breakers and got == greedy_generate(tiny_params, tiny_config, ids, 16, sampling=row)
    plain = greedy_generate(tiny_params, tiny_config, ids, 16)
    assert got != plain
    off = httpx.post(f"{url}/completion", json={**body, "samplers": ["top_k", "temperature"]}, timeout=60)
    assert off.json()["tokens"] == plain
    # The token it repeats, " is", holds an "s": a breaker, it ends every repetition.
    broken = httpx.post(f"{url}/completion", json={**body, "dry_sequence_breakers": ["s"]}, timeout=60)
    assert broken.json()["tokens"] == plain


# What a client that sends all its settings sends with llama.cpp's other samplers off (as
# SillyTavern's llama.cpp source does).
SAMPLERS_OFF = {"typical_p": 1, "top_n_sigma": -1, "xtc_probability": 0, "xtc_threshold": 0.1,
                "dynatemp_range": 0, "dynatemp_exponent": 1, "dry_multiplier": 0, "dry_base": 1.75,
                "dry_allowed_length": 2, "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n"],
                "mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1, "tfs_z": 1, "min_keep": 0,
                "penalize_nl": False, "n_keep": 0, "n_discard": 0, "post_sampling_probs": False,
                "lora": [], "timings_per_token": False, "n_cmpl": 1, "adaptive_target": -1}


def test_llama_cpps_other_samplers_are_accepted_off(url):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "return_tokens": True}
    plain = httpx.post(f"{url}/completion", json=body, timeout=60).json()
    off = httpx.post(f"{url}/completion", json={**body, **SAMPLERS_OFF}, timeout=60)
    assert off.status_code == 200, off.text
    assert off.json()["tokens"] == plain["tokens"]


LLAMA_SAMPLERS_ON = {"prompt": PROMPT, "n_predict": 12, "temperature": 1.5, "top_k": 0, "top_p": 1,
                     "min_p": 0, "top_n_sigma": 3, "typical_p": 0.95, "xtc_probability": 0.5,
                     "xtc_threshold": 0.05, "dynatemp_range": 0.5, "seed": 7, "ignore_eos": True,
                     "return_tokens": True,
                     # (the tiny model puts all its mass on one token; these it makes a choice of)
                     "logit_bias": {str(i): 40 for i in range(10, 40)}}


def test_llama_cpps_samplers_run_each_request_its_own(url):
    """A seeded request with every llama.cpp sampler on gives the same tokens alone and batched
    with others (greedy, other seeds, vLLM's order over /v1/completions); `samplers` leaving
    some out turns those off, as their off values do."""
    from concurrent.futures import ThreadPoolExecutor

    def tokens(body, path="/completion"):
        r = httpx.post(f"{url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["tokens"] if path == "/completion" else r.json()["choices"][0]["text"]

    alone = tokens(LLAMA_SAMPLERS_ON)
    others = [({**LLAMA_SAMPLERS_ON, "seed": 8}, "/completion"), ({**LLAMA_SAMPLERS_ON, "temperature": 0}, "/completion"),
              ({"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 7}, "/v1/completions")]
    with ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(lambda a: tokens(*a), [(LLAMA_SAMPLERS_ON, "/completion"), *others]))
    assert batched[0] == alone
    assert len({tuple(tokens({**LLAMA_SAMPLERS_ON, "seed": seed})) for seed in range(4)}) > 1  # it does sample
    # Greedy, XTC at threshold 0 takes out every token but the least likely: another answer,
    # unless `samplers` leaves XTC out.
    greedy = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "return_tokens": True}
    plain = tokens(greedy)
    xtc = {**greedy, "xtc_probability": 1, "xtc_threshold": 0}
    assert tokens(xtc)[0] != plain[0]
    assert tokens({**xtc, "samplers": ["top_k", "top_p", "temperature"]}) == plain
    props = httpx.get(f"{url}/props", timeout=60).json()["default_generation_settings"]["params"]
    assert props["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]


def test_llama_cpps_samplers_parse_as_llama_server_reads_them():
    """/completion's rows are of llama.cpp's order with its samplers' off values mapped (1 or
    more, a negative n), and `samplers` leaving one out turns it off; /v1/completions' are vLLM's."""
    from cadence.server import llama_api, parsing, protocol

    def sampling(body):
        return llama_api.parse_completion({"prompt": "a", **body}, parsing.SamplingDefaults())[0].params.sampling

    on = sampling({"temperature": 0.7, "top_n_sigma": 1.5, "typical_p": 0.8, "xtc_probability": 0.4,
                   "xtc_threshold": 0.2, "dynatemp_range": 0.3, "dynatemp_exponent": 2, "top_k": 9})
    assert (on.temperature_last, on.top_n_sigma, on.typical_p, on.xtc_probability, on.xtc_threshold,
            on.dynatemp_range, on.dynatemp_exponent) == (True, 1.5, 0.8, 0.4, 0.2, 0.3, 2.0)
    off = sampling({"top_n_sigma": -1, "typical_p": 1.5, "dynatemp_range": -2})
    assert (off.top_n_sigma, off.typical_p, off.dynatemp_range) == (0.0, 1.0, 0.0)
    body = {"temperature": 0.7, "top_n_sigma": 1.5, "typical_p": 0.8, "xtc_probability": 0.4, "top_k": 9,
            "top_p": 0.9, "min_p": 0.1, "dynatemp_range": 0.3, "repeat_penalty": 1.2}
    left = sampling({**body, "samplers": ["top_k", "typical_p", "min_p"]})
    assert (left.top_k, left.typical_p, left.min_p) == (9, 0.8, 0.1)
    assert (left.top_n_sigma, left.top_p, left.xtc_probability, left.repetition_penalty) == (0.0, 1.0, 0.0, 1.0)
    assert (left.temperature, left.dynatemp_range) == (1.0, 0.0)  # no temperature sampler: drawn at 1
    assert sampling({**body, "samplers": []}).top_k == 0
    openai = protocol.parse({"prompt": "a", "temperature": 0.7}, chat=False)
    assert not openai.params.sampling.temperature_last


def test_mirostat_replaces_the_chain_as_in_llama_server(url):
    """`mirostat` 1 or 2 samples the request with logit_bias, the temperature and Mirostat
    alone (its settings reach the row; the other samplers and the penalties are off, so
    naming them changes nothing), the same over /completion and /v1/completions; another
    version, or a tau past its range, is refused by name."""
    from cadence.server import llama_api, parsing

    def sampling(body):
        return llama_api.parse_completion({"prompt": "a", **body}, parsing.SamplingDefaults())[0].params.sampling

    on = sampling({"mirostat": 2, "mirostat_tau": 3, "mirostat_eta": 0.2, "temperature": 6, "top_k": 9,
                   "top_p": 0.5, "min_p": 0.1, "typical_p": 0.5, "repeat_penalty": 1.3, "dry_multiplier": 1,
                   "xtc_probability": 1, "dynatemp_range": 2})
    assert (on.mirostat, on.mirostat_tau, on.mirostat_eta, on.temperature, on.temperature_last) == (2, 3.0, 0.2, 6.0, True)
    assert (on.top_k, on.top_p, on.min_p, on.typical_p, on.repetition_penalty, on.dry_multiplier,
            on.xtc_probability, on.dynatemp_range) == (0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0)
    assert (sampling({"mirostat": 1}).mirostat_tau, sampling({"mirostat": 1}).mirostat_eta) == (5.0, 0.1)

    def tokens(body, path="/completion"):
        r = httpx.post(f"{url}{path}", json={**body, "return_token_ids": True} if path != "/completion" else body,
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["tokens"] if path == "/completion" else r.json()["choices"][0]["token_ids"]

    # (the tiny model's logits are sharp: at temperature 6 they hold ~5 bits)
    body = {"prompt": PROMPT, "n_predict": 16, "temperature": 6, "seed": 3, "mirostat": 2, "mirostat_tau": 3,
            "return_tokens": True}
    got = tokens(body)
    assert tokens({**body, "top_k": 2, "repeat_penalty": 1.5, "samplers": ["top_k"]}) == got
    assert tokens({"prompt": PROMPT, "max_tokens": 16, "temperature": 6, "seed": 3, "mirostat": 2,
                   "mirostat_tau": 3}, "/v1/completions") == got
    assert tokens({**body, "mirostat_tau": 8}) != got  # (tau moves what it keeps)
    for wrong, param in (({"mirostat": 3}, "mirostat"), ({"mirostat": 1, "mirostat_tau": 61}, "mirostat_tau")):
        r = httpx.post(f"{url}/completion", json={**body, **wrong}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_adaptive_p_draws_where_samplers_name_it_as_in_llama_server(url):
    """`adaptive_target` alone changes nothing (llama-server's default chain leaves adaptive-p
    out); named last in `samplers`, it makes the draw, its settings reaching the row (a target
    above 1 is 1 and a decay past 0.99 is 0.99, as llama.cpp clamps them); named anywhere else
    it is refused."""
    from cadence.server import llama_api, parsing

    def sampling(body):
        return llama_api.parse_completion({"prompt": "a", **body}, parsing.SamplingDefaults())[0].params.sampling

    assert sampling({"adaptive_target": 0.3}).adaptive_target < 0
    on = sampling({"adaptive_target": 0.3, "adaptive_decay": 0.5, "samplers": ["top_k", "temperature", "adaptive_p"]})
    assert (on.adaptive_target, on.adaptive_decay, on.stateful) == (0.3, 0.5, True)
    clamped = sampling({"adaptive_target": 4, "adaptive_decay": 2, "samplers": ["adaptive_p"]})
    assert (clamped.adaptive_target, clamped.adaptive_decay) == (1.0, 0.99)
    assert not sampling({"adaptive_target": 0.3, "samplers": ["adaptive_p"], "mirostat": 2}).adaptive_target >= 0

    def tokens(body):
        r = httpx.post(f"{url}/completion", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    # (the tiny model's logits are sharp: at temperature 6 they hold ~5 bits)
    body = {"prompt": PROMPT, "n_predict": 16, "temperature": 6, "seed": 3, "return_tokens": True,
            "samplers": ["top_k", "temperature"], "top_k": 30}
    plain = tokens(body)
    assert tokens({**body, "adaptive_target": 0.05}) == plain
    adaptive = {**body, "adaptive_target": 0.05, "samplers": ["top_k", "temperature", "adaptive_p"]}
    assert tokens(adaptive) != plain
    assert tokens({**adaptive, "stream": False}) == tokens(adaptive)  # (seeded: the same again)
    r = httpx.post(f"{url}/completion", json={**adaptive, "samplers": ["adaptive_p", "temperature"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "samplers", r.text


def test_the_openai_doors_sample_as_llama_server_where_a_request_names_its_samplers(url):
    """llama-server's /v1 endpoints sample as its own do: a /v1/completions request naming
    llama.cpp's samplers gives /completion's tokens, seeded with every sampler on and greedy
    with DRY (whose breakers, the vocabulary's tokens, count there too: with "s" a breaker the
    tiny model's repetition is never penalized); a chat takes them, and the ones cadence does
    not run where they are off; on, or in another order, they are refused by name."""
    def openai(body, path="/v1/completions"):
        r = httpx.post(f"{url}{path}", json={**body, "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def llama(body):
        return httpx.post(f"{url}/completion", json=body, timeout=120).json()["tokens"]

    def as_openai(body):
        fields = {k: v for k, v in body.items() if k not in ("n_predict", "return_tokens")}
        return {**fields, "max_tokens": body["n_predict"]}

    assert openai(as_openai(LLAMA_SAMPLERS_ON)) == llama(LLAMA_SAMPLERS_ON)
    dry = {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "return_tokens": True, "dry_multiplier": 3.0,
           "dry_allowed_length": 2, "dry_penalty_last_n": 32}
    plain = llama({**dry, "dry_multiplier": 0})
    assert openai(as_openai(dry)) == llama(dry) != plain
    assert openai(as_openai({**dry, "dry_sequence_breakers": ["s"]})) == plain
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
    assert openai({**chat, **{k: v for k, v in SAMPLERS_OFF.items() if k in llama_sampling.FIELDS}},
                  "/v1/chat/completions") == openai(chat, "/v1/chat/completions")
    for body, param in (({"mirostat": -1}, "mirostat"), ({"samplers": ["temperature", "top_k"]}, "samplers"),
                        ({"dry_multiplier": 1, "dry_sequence_breakers": ["ab"]}, "dry_sequence_breakers")):
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_request_naming_llama_cpps_samplers_is_parsed_in_its_order():
    """On the OpenAI doors, naming one of llama.cpp's samplers (even one left off) asks for its
    order; vLLM's fields alone keep vLLM's."""
    from cadence.server import protocol

    def sampling(body, chat=True):
        base = {"messages": [{"role": "user", "content": "a"}]} if chat else {"prompt": "a"}
        return protocol.parse({**base, "temperature": 0.7, **body}, chat=chat).params.sampling

    on = sampling({"typical_p": 0.8, "top_n_sigma": 1.5, "samplers": ["top_n_sigma", "typ_p", "temperature"],
                   "top_k": 9})
    assert (on.temperature_last, on.typical_p, on.top_n_sigma, on.top_k) == (True, 0.8, 1.5, 0)
    assert sampling({"mirostat": 0}, chat=False).temperature_last
    assert not sampling({"top_k": 9, "min_p": 0.1, "repetition_penalty": 1.1}).temperature_last


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "a", "min_keep": 3}, "min_keep", "only 0 (off)"),
    ({"prompt": "a", "typical_p": 0}, "typical_p", "typical_p must be in (0, 1]"),
    ({"prompt": "a", "xtc_probability": 1.5}, "xtc_probability", "xtc_probability must be in [0, 1]"),
    ({"prompt": "a", "xtc_threshold": -0.1}, "xtc_threshold", "xtc_threshold must be in [0, 1]"),
    ({"prompt": "a", "dynatemp_exponent": -1}, "dynatemp_exponent", "must be >= 0"),
    ({"prompt": "a", "top_n_sigma": "x"}, "top_n_sigma", "must be a number"),
    ({"prompt": "a", "samplers": ["temperature", "top_k"]}, "samplers", "llama.cpp's default order"),
    ({"prompt": "a", "samplers": ["top_k", "top_k"]}, "samplers", "each once"),
    ({"prompt": "a", "dry_multiplier": -1}, "dry_multiplier", "dry_multiplier must be >= 0"),
    ({"prompt": "a", "dry_multiplier": 1, "dry_sequence_breakers": []}, "dry_sequence_breakers", "non-empty array"),
    ({"prompt": "a", "dry_multiplier": 1, "dry_sequence_breakers": ["\n\n"]}, "dry_sequence_breakers", "one-character"),
    ({"prompt": "a", "dry_penalty_last_n": -2}, "dry_penalty_last_n", "-1 (the whole sequence)"),
    ({"prompt": "a", "dry_allowed_length": -1}, "dry_allowed_length", "dry_allowed_length must be in"),
    ({"prompt": "a", "mirostat": 3}, "mirostat", "0 (off), 1 or 2"),
    ({"prompt": "a", "return_progress": [1]}, "return_progress", "true or false"),  # (not streamed: checked too)
    ({"prompt": "a", "mirostat": 2, "mirostat_tau": -1}, "mirostat_tau", "mirostat_tau must be in [0, 60]"),
    ({"prompt": "a", "mirostat": 1, "mirostat_eta": -0.5}, "mirostat_eta", "mirostat_eta must be >= 0"),
    ({"prompt": "a", "mirostat": 1.5}, "mirostat", "must be an integer"),
    ({"prompt": "a", "lora": [{"id": 0, "scale": 1}]}, "lora", "adapter 0 is not loaded"),
    ({"prompt": "a", "lora": [{"id": 0, "scale": 1}, {"id": 0, "scale": 2}]}, "lora", "names an adapter twice"),
    ({"prompt": "a", "lora": [{"id": -1, "scale": 1}]}, "lora", '{"id": adapter index >= 0'),
    ({"prompt": "a", "lora": [{"id": 0, "scale": 1e300}]}, "lora", "finite numbers"),
    ({"prompt": "a", "lora": [{"id": 0, "scale": 0}, {"id": 0, "scale": 1}]}, "lora", "names an adapter twice"),
    ({"prompt": "a", "dry_base": "x"}, "dry_base", "must be a number"),
    ({"prompt": ["a", 5]}, "prompt", "mixes token ids with other values"),
    ({}, "prompt", "must be a string, an array of token ids"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in"),
    ({"prompt": "a", "repeat_penalty": 0}, "repeat_penalty", "repeat_penalty must be in"),
    ({"prompt": "a", "repeat_last_n": -2}, "repeat_last_n", "-1 (the whole context)"),
    ({"prompt": "a", "repeat_last_n": 0, "frequency_penalty": 3}, "frequency_penalty", "must be in"),
    ({"prompt": "a", "samplers": [], "xtc_probability": 2}, "xtc_probability", "must be in [0, 1]"),
    ({"prompt": "a", "n_cmpl": 2, "n": 0}, "n", "must be >= 1"),
    ({"prompt": "a", "input_suffix": "b"}, "input_suffix", "unrecognized"),
    ({"prompt": "a", "n_probs": -1}, "n_probs", ">= 0"),
    ({"prompt": "a", "n_probs": 21}, "n_probs", "--max_logprobs"),
])
def test_what_it_refuses(url, body, param, fragment):
    r = httpx.post(f"{url}/completion", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"]


def test_n_predict_is_a_cap_at_the_end_of_the_context(url, tiny_tokenizer, tiny_config):
    """llama-server's n_predict past the context stops there ("limit"), where OpenAI's
    max_tokens is refused."""
    prompt = "word " * 100
    n = len(tiny_tokenizer.encode(prompt))
    room = tiny_config.max_context - n
    r = httpx.post(f"{url}/completion", json={"prompt": prompt, "n_predict": room + 40, "temperature": 0,
                                             "ignore_eos": True}, timeout=120).json()
    assert r["stop_type"] == "limit" and r["tokens_predicted"] == room
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": room + 40}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"


def test_props_tell_a_llama_server_client_the_context_slots_and_template(url, tiny_tokenizer):
    """GET /props (llama-server's web UI reads it): a slot's context, the slots, the chat
    template and tokens, the sampling defaults; POST is not served."""
    props = httpx.get(f"{url}/props", timeout=60).json()
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] >= 1
    assert props["chat_template"] == tiny_tokenizer.chat_template
    assert props["eos_token"] == tiny_tokenizer.eos_token and props["build_info"].startswith("cadence ")
    params = props["default_generation_settings"]["params"]
    assert params["n_predict"] == -1 and params["temperature"] >= 0
    assert not any(props["modalities"].values())
    assert httpx.post(f"{url}/props", json={}, timeout=60).status_code == 405
