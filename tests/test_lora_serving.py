"""LoRA adapters over HTTP: a request names an adapter as its model (vLLM's) or mixes them with
llama-server's `lora`, requests on different adapters and none decode together and each answer
is the reference's on its own merged weights; the prefix cache never hands one adapter's KV to
another; the names the API lists and refuses; `--lora` through the command line."""

from __future__ import annotations

import concurrent.futures

import httpx
import jax
import numpy as np
import pytest

from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.engine.reference import greedy_generate
from cadence.model import lora
from tests.serving import cli, gauge, serving
from tests.tiny_models import random_adapter, undo_embedding_boost, write_peft_adapter

ADAPTERS = ("every", "some")


@pytest.fixture(scope="module")
def served(tiny_config, tiny_params, tiny_tokenizer):
    """The real app over an engine with two adapters in its bank (the CPU kernels, layer loop),
    its base URL, scheduler, weights and adapters."""
    params = jax.tree.map(np.asarray, undo_embedding_boost(tiny_params))  # no copy loops
    adapters = [random_adapter(tiny_config, "every", 4, lora.PROJECTIONS, 1),
                random_adapter(tiny_config, "some", 2, ("q", "v", "down"), 2)]
    engine = Engine(params, tiny_config, EngineConfig(
        num_slots=4, max_seq_len=256, prefill_chunk=32, min_kv_bucket=256, attention="cpu",
        decode_matmul="cpu", lora_slots=2, lora_rank=4), adapters=adapters)
    engine.warmup(warmup="needed")
    with serving(engine, tiny_tokenizer, lora_adapters=ADAPTERS) as (base, sched):
        yield base, sched, params, adapters


def reference(params, config, adapters, pairs, ids, n):
    return greedy_generate(lora.merged_params(params, config, [(adapters[i], s) for i, s in pairs]),
                           config, ids, n)


def test_requests_on_different_adapters_decode_together_each_as_its_merged_weights(served, tiny_config,
                                                                                 tiny_tokenizer):
    base, sched, params, adapters = served
    prompt = "the quick brown fox jumps over the lazy dog and runs"
    ids = tiny_tokenizer.encode(prompt)
    n = 12
    # (how the request asks, the adapters it runs with)
    asks = [({"model": "tiny"}, ()), ({"model": "every"}, ((0, 1.0),)), ({"model": "some"}, ((1, 1.0),)),
            ({"lora": [{"id": 0, "scale": 0.5}, {"id": 1, "scale": -1.0}]}, ((0, 0.5), (1, -1.0)))]
    want = [reference(params, tiny_config, adapters, pairs, ids, n) for _, pairs in asks]
    compiles = sched.engine.compilations_after_warmup  # (process-wide: after the reference's)

    def ask(fields):
        if "lora" in fields:  # llama-server's /completion
            r = httpx.post(f"{base}/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0,
                                                      "ignore_eos": True, "return_tokens": True, **fields},
                           timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["tokens"], r.json()["model"]
        r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                      "ignore_eos": True, "return_token_ids": True, **fields},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()["model"]

    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(ask, [fields for fields, _ in asks]))
    assert sched.engine.compilations_after_warmup == compiles  # the mix compiled nothing
    for (fields, pairs), expected, (tokens, model) in zip(asks, want, answers):
        assert tokens == expected, fields
        assert model == fields.get("model", "tiny")  # an adapter's answer carries its name
        assert (tokens != want[0]) == bool(pairs)  # each adapter changed the answer


def test_the_prefix_cache_keeps_each_adapters_kv_to_itself(served, tiny_config, tiny_tokenizer):
    base, _, params, adapters = served
    prompt = "a long shared system prompt that fills several pages of the cache " * 3
    ids = tiny_tokenizer.encode(prompt)
    answers = []
    for model in ("every", "tiny", "every", "some"):
        hits = gauge(base, "prefix_cache_hits_total")
        r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True,
                                                      "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        answers.append((model, r.json()["choices"][0]["token_ids"], gauge(base, "prefix_cache_hits_total") - hits))
    pairs = {"tiny": (), "every": ((0, 1.0),), "some": ((1, 1.0),)}
    for model, tokens, _ in answers:
        assert tokens == reference(params, tiny_config, adapters, pairs[model], ids, 6), model
    # Only the second request on "every" found its pages; the base model's and "some"'s found
    # none of another adapter's.
    assert [hit > 0 for _, _, hit in answers] == [False, False, True, False]


def test_llama_servers_global_mix_runs_where_a_request_gives_none(served, tiny_config, tiny_tokenizer):
    """POST /lora-adapters sets the mix a request on the model itself runs with (each answer
    its merged weights' reference), GET shows it, a request's own `lora` or adapter name still
    wins, an empty mix is the model again; an adapter not loaded is refused."""
    base, _, params, adapters = served
    prompt = "the quick brown fox"
    ids = tiny_tokenizer.encode(prompt)

    def tokens(**fields):
        r = httpx.post(f"{base}/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0,
                                                  "ignore_eos": True, "return_tokens": True, **fields}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def set_mix(entries):
        r = httpx.post(f"{base}/lora-adapters", json=entries, timeout=30)
        assert r.status_code == 200 and r.json() == {"success": True}, r.text

    assert httpx.get(f"{base}/lora-adapters").json() == [{"id": 0, "path": "every", "scale": 0.0},
                                                         {"id": 1, "path": "some", "scale": 0.0}]
    try:
        set_mix([{"id": 1, "scale": 0.5}])
        assert httpx.get(f"{base}/lora-adapters").json()[1] == {"id": 1, "path": "some", "scale": 0.5}
        assert tokens() == reference(params, tiny_config, adapters, ((1, 0.5),), ids, 8)
        chat = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True, "return_token_ids": True}, timeout=120)
        assert chat.json()["choices"][0]["token_ids"] == tokens()
        own = [{"id": 0, "scale": 1.0}]
        assert tokens(lora=own) == reference(params, tiny_config, adapters, ((0, 1.0),), ids, 8)
        refused = httpx.post(f"{base}/lora-adapters", json=[{"id": 5, "scale": 1}], timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora"
        assert httpx.post(f"{base}/lora-adapters", json={"id": 0}, timeout=30).status_code == 400
        null = httpx.post(f"{base}/lora-adapters", content=b"null", timeout=30,
                          headers={"Content-Type": "application/json"})
        assert null.status_code == 400 and null.json()["error"]["param"] == "lora"  # (not "no mix")
    finally:
        set_mix([])
    assert tokens() == reference(params, tiny_config, adapters, (), ids, 8)


def test_the_api_lists_the_adapters_and_refuses_what_they_cannot_do(served):
    base = served[0]
    cards = {c["id"]: c for c in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]}
    assert set(cards) == {"tiny", *ADAPTERS}
    assert cards["every"]["parent"] == "tiny" and "parent" not in cards["tiny"]
    assert httpx.get(f"{base}/v1/models/some", timeout=30).json()["parent"] == "tiny"
    missing = httpx.post(f"{base}/v1/completions", json={"model": "other", "prompt": "a"}, timeout=30)
    assert missing.status_code == 404 and "'every', 'some'" in missing.json()["error"]["message"]
    embedded = httpx.post(f"{base}/v1/embeddings", json={"model": "every", "input": "a"}, timeout=30)
    assert embedded.status_code == 400 and "LoRA adapter" in embedded.json()["error"]["message"]
    beyond = httpx.post(f"{base}/completion", json={"prompt": "a", "lora": [{"id": 2, "scale": 1}]},
                        timeout=30)
    assert beyond.status_code == 400 and "adapter 2 is not loaded" in beyond.json()["error"]["message"]


@pytest.mark.slow
def test_a_batch_line_names_its_adapter_as_its_model(tmp_path, tiny_model_dir, tiny_config, tiny_params,
                                                     tiny_tokenizer):
    import json

    adapter = random_adapter(tiny_config, "sql", 4, lora.PROJECTIONS, 3, spread=0.6)
    write_peft_adapter(tmp_path / "sql", tiny_config, adapter, alpha=8)
    lines = [{"id": "base", "prompt": "hello world", "max_tokens": 8, "temperature": 0},
             {"id": "sql", "prompt": "hello world", "max_tokens": 8, "temperature": 0, "model": "sql"},
             {"id": "named", "prompt": "hello world", "max_tokens": 8, "temperature": 0, "model": "model"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = cli(tiny_model_dir, "cadence.server.batch_cli", f"--lora=sql={tmp_path / 'sql'}",
              f"--input={tmp_path / 'in.jsonl'}", f"--output={tmp_path / 'out.jsonl'}")
    assert run.returncode == 0, run.stderr
    texts = {r["id"]: r["text"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    ids = tiny_tokenizer.encode("hello world")
    params = jax.tree.map(np.asarray, tiny_params)
    base = tiny_tokenizer.decode(greedy_generate(params, tiny_config, ids, 8))
    tuned = tiny_tokenizer.decode(greedy_generate(lora.merged_params(params, tiny_config, [(adapter, 1.0)]),
                                                  tiny_config, ids, 8))
    assert texts == {"base": base, "sql": tuned, "named": base} and tuned != base


@pytest.mark.slow
def test_generate_runs_a_peft_adapter_from_the_command_line(tmp_path, tiny_model_dir, tiny_config,
                                                            tiny_params, tiny_tokenizer):
    adapter = random_adapter(tiny_config, "sql", 4, lora.PROJECTIONS, 3, spread=0.6)
    write_peft_adapter(tmp_path / "sql", tiny_config, adapter, alpha=8)
    prompt = "hello world"
    run = cli(tiny_model_dir, "cadence.server.generate_cli", f"--lora=sql={tmp_path / 'sql'}",
              "--adapter=sql", f"--prompt={prompt}", "--max_tokens=8", "--temperature=0")
    assert run.returncode == 0, run.stderr
    assert "LoRA adapter 'sql' (rank 4" in run.stderr
    ids = tiny_tokenizer.encode(prompt)
    params = jax.tree.map(np.asarray, tiny_params)
    want = greedy_generate(lora.merged_params(params, tiny_config, [(adapter, 1.0)]), tiny_config, ids, 8)
    assert want != greedy_generate(params, tiny_config, ids, 8)
    assert run.stdout.strip() == tiny_tokenizer.decode(want).strip()


def lora_info(base: str) -> tuple[str, str]:
    """/metrics' vllm:lora_requests_info: (waiting_lora_adapters, running_lora_adapters)."""
    import re

    line = next(l for l in httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
                if l.startswith("vllm:lora_requests_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert labels["max_lora"] == "2"
    return labels["waiting_lora_adapters"], labels["running_lora_adapters"]


@pytest.fixture(scope="module")
def runtime(tiny_config, tiny_params, tiny_tokenizer, tmp_path_factory):
    """A server whose bank has a free slot beside "every", loading and unloading adapters
    while it serves (--runtime_lora); PEFT folders of two more adapters to load."""
    params = jax.tree.map(np.asarray, undo_embedding_boost(tiny_params))
    every = random_adapter(tiny_config, "every", 4, lora.PROJECTIONS, 1)
    more = {name: random_adapter(tiny_config, name, r, projs, seed) for name, r, projs, seed in
            (("some", 2, ("q", "v", "down"), 2), ("other", 4, ("k", "o", "up"), 5))}
    root = tmp_path_factory.mktemp("adapters")
    for name, adapter in more.items():
        write_peft_adapter(root / name, tiny_config, adapter, alpha=4)
    engine = Engine(params, tiny_config, EngineConfig(
        num_slots=2, max_seq_len=512, prefill_chunk=32, min_kv_bucket=256, attention="cpu",
        decode_matmul="cpu", lora_slots=2, lora_rank=4), adapters=[every])
    engine.warmup(warmup="needed")
    with serving(engine, tiny_tokenizer, lora_adapters=("every",), lora_slots=2, runtime_lora=True) as (base, sched):
        yield base, sched, params, {"every": every, **more}, root


@pytest.mark.slow  # an engine and server of its own
def test_adapters_load_and_unload_while_serving(runtime, tiny_config, tiny_tokenizer):
    base, sched, params, adapters, root = runtime
    prompt = "a prompt long enough to fill a page of the prefix cache, and then some more words"
    ids = tiny_tokenizer.encode(prompt)
    want = {name: greedy_generate(lora.merged_params(params, tiny_config, [(a, 1.0)]), tiny_config, ids, 6)
            for name, a in adapters.items()}
    compiles = sched.engine.compilations_after_warmup  # (after the reference's compiles)

    def complete(model):
        r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True,
                                                      "return_token_ids": True}, timeout=120)
        return r.status_code, (r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.json())

    def post(route, **body):
        return httpx.post(f"{base}/v1/{route}_lora_adapter", json=body, timeout=120)

    assert complete("some")[0] == 404
    loaded = post("load", lora_name="some", lora_path=str(root / "some"))
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert complete("some") == (200, want["some"]) and complete("every") == (200, want["every"])
    assert "some" in {c["id"] for c in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]}
    full = post("load", lora_name="other", lora_path=str(root / "other"))
    assert full.status_code == 400 and "slots is taken" in full.json()["error"]["message"]
    taken = post("load", lora_name="every", lora_path=str(root / "other"))
    assert taken.status_code == 400 and "taken" in taken.json()["error"]["message"]
    # In use: while a request on "some" waits behind two long ones (both slots), an unload is
    # a 409; once it is done, the unload goes through.
    long = {"prompt": prompt, "max_tokens": 450, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        ahead = [pool.submit(httpx.post, f"{base}/v1/completions", json=long, timeout=120) for _ in range(2)]
        while gauge(base, "num_requests_running") < 2:
            pass
        behind = pool.submit(httpx.post, f"{base}/v1/completions", json={**long, "model": "some"}, timeout=120)
        while gauge(base, "num_requests_waiting") < 1:
            pass
        busy = post("unload", lora_name="some")
        assert busy.status_code == 409 and "in use by 1" in busy.json()["error"]["message"]
        waiting, running = lora_info(base)
        assert "some" in waiting + running  # (queued still, or just admitted)
        assert all(f.result().status_code == 200 for f in [*ahead, behind])
    assert lora_info(base) == ("", "")
    # In llama-server's global mix, an adapter unloaded leaves it: the model's requests go on.
    assert httpx.post(f"{base}/lora-adapters", json=[{"id": 1, "scale": 1}], timeout=30).status_code == 200
    assert post("unload", lora_name="some").status_code == 200
    assert complete("some")[0] == 404
    assert httpx.get(f"{base}/lora-adapters", timeout=30).json() == [{"id": 0, "path": "every", "scale": 0.0}]
    assert complete("tiny")[0] == 200
    unknown = httpx.post(f"{base}/completion", json={"prompt": "a", "lora": [{"id": 1, "scale": 1}]}, timeout=30)
    assert unknown.status_code == 400 and "adapter 1 is not loaded" in unknown.json()["error"]["message"]
    # The freed slot takes another adapter; the prompt's pages "some" left in the cache are not
    # its (the slot's version moved on): its answer is its own.
    assert post("load", lora_name="other", lora_path=str(root / "other")).status_code == 200
    assert complete("other") == (200, want["other"])
    assert sched.engine.compilations_after_warmup == compiles  # loading compiled nothing
    assert post("unload", lora_name="missing").status_code == 404
    assert post("unload", lora_name="other").status_code == 200
    bad = post("load", lora_name="bad", lora_path=str(root / "nowhere"))
    assert bad.status_code == 400 and "not a PEFT folder" in bad.json()["error"]["message"]
