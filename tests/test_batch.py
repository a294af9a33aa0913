"""`cadence-batch` end to end: the real CLI in a subprocess, the real engine on the tiny model.

The tiny model is written once as a converted checkpoint folder and passed as `--model`; every
run uses the same small engine flags and one CADENCE_CACHE, so after the first run the XLA
programs come from the persistent compilation cache and a run takes a few seconds.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cadence.checkpoints.ranking import FILE as RANKING_FILE
from cadence.checkpoints.ranking import RankingHead
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.reference import greedy_generate, sequence_logits
from cadence.model.arith import cdiv
from cadence.server.batch_cli import BatchError, load_done

ROOT = Path(__file__).resolve().parent.parent
# A token budget that covers every slot's chunk at once: no prompt is ever split by budget
# contention, so a prompt takes exactly ceil(len / 32) chunks (asserted below). With the
# default budget (chunk + slots) several short prompts admitted together share it, and
# whether one is split then depends on arrival timing.
# Speculative decoding (on by default) verifies up to DRAFTS tokens a step while one request
# decodes alone; whether it does depends on timing, so a request's step count has bounds only.
DRAFTS = 3
ENGINE_FLAGS = ["--num_slots=4", "--max_seq_len=256", "--prefill_chunk=32", "--token_budget=160",
                f"--num_speculative_tokens={DRAFTS}"]
FIELDS = {"id", "text", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason",
          "stop_reason", "queue_time", "ttft", "total_time", "prefill_chunks", "decode_steps"}


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    return tiny_model_dir


def command(setup, inp: Path, out: Path, *flags: str) -> list[str]:
    root, _ = setup
    return [sys.executable, "-m", "cadence.server.batch_cli", f"--input={inp}", f"--output={out}",
            f"--model={root / 'model'}", *ENGINE_FLAGS, *flags]


def run_batch(setup, inp: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(setup, inp, out, *flags), cwd=ROOT, env=setup[1],
                          capture_output=True, text=True, timeout=120)


def write_jsonl(path: Path, entries) -> Path:
    path.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    return path


def read_results(path: Path) -> list[dict]:
    data = path.read_text()
    assert data == "" or data.endswith("\n")
    return [json.loads(line) for line in data.splitlines()]


def summary(stderr: str) -> dict:
    line = [s for s in stderr.splitlines() if s.startswith("cadence-batch summary: ")][-1]
    return json.loads(line.removeprefix("cadence-batch summary: "))


def test_batch_run_matches_the_reference(setup, tmp_path, tiny_config, tiny_params):
    root, _ = setup
    words = "the cat sat on the mat and then it ran to the house".split()
    entries = [{"id": f"p{i}", "prompt": " ".join(words[: 2 + i]), "max_tokens": 8 + i,
                "ignore_eos": True} for i in range(8)]
    entries += [
        {"id": 100, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12},
        {"id": "s", "prompt": "the house", "temperature": 0.8, "top_k": 20, "top_p": 0.9,
         "seed": 7, "max_tokens": 10, "ignore_eos": True},
        {"id": "long", "prompt": " ".join(words * 6), "max_tokens": 5, "ignore_eos": True},
        {"id": "stop", "prompt": "the cat", "stop": ["zzz"], "max_tokens": 6},
    ]
    inp, out = write_jsonl(tmp_path / "in.jsonl", entries), tmp_path / "out.jsonl"
    # A queue of 2 makes the job wait for completions and resubmit: nothing may be dropped.
    result = run_batch(setup, inp, out, "--max_queue=2")
    assert result.returncode == 0, result.stderr
    results = read_results(out)
    assert sorted(map(json.dumps, (r["id"] for r in results))) == sorted(json.dumps(e["id"]) for e in entries)
    stats = summary(result.stderr)
    assert stats["done"] == len(entries) and stats["failed"] == 0 and stats["skipped"] == 0
    assert stats["compilations_after_warmup"] == 0
    assert stats["completion_tokens"] == sum(r["completion_tokens"] for r in results)

    tok = Tokenizer.from_hf_dir(root / "model")  # the tokenizer the CLI loaded
    by_id = {r["id"]: r for r in results}
    for r in results:
        assert set(r) == FIELDS
        assert 0 <= r["cached_tokens"] < r["prompt_tokens"]
        assert r["finish_reason"] in ("stop", "length")
        assert r["stop_reason"] is None  # no stop string or stop id of these lines is written
        assert 0 <= r["queue_time"] <= r["ttft"] <= r["total_time"]
        assert r["prefill_chunks"] == cdiv(r["prompt_tokens"], 32)
        # The first token comes from prefill; a step emits 1 to 1 + DRAFTS more (an EOS that
        # stops the request is not counted in completion_tokens, but took its step).
        after_prefill = r["completion_tokens"] - 1
        assert cdiv(after_prefill, 1 + DRAFTS) <= r["decode_steps"] <= after_prefill + 1
    for e in entries[:8]:
        assert by_id[e["id"]]["completion_tokens"] == e["max_tokens"]
    assert by_id["long"]["prefill_chunks"] > 1
    for key in ("p1", "p6", "long"):
        entry = next(e for e in entries if e["id"] == key)
        ids = tok.encode(entry["prompt"])
        assert by_id[key]["prompt_tokens"] == len(ids)
        expected = greedy_generate(tiny_params, tiny_config, ids, entry["max_tokens"])
        assert by_id[key]["text"] == tok.decode(expected, skip_special=True)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_has_every_id_once(setup, tmp_path):
    n = 64
    entries = [{"id": f"r{i}", "prompt": f"the cat {i}", "max_tokens": 160, "ignore_eos": True}
               for i in range(n)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", entries), tmp_path / "out.jsonl"
    proc = subprocess.Popen(command(setup, inp, out, "--max_queue=8"), cwd=ROOT, env=setup[1],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "no results before exit"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    before = out.read_bytes().count(b"\n")
    assert 2 <= before < n, "the job finished before it could be killed mid-run"

    result = run_batch(setup, inp, out, "--max_queue=8")
    assert result.returncode == 0, result.stderr
    ids = collections.Counter(r["id"] for r in read_results(out))
    assert ids == collections.Counter(e["id"] for e in entries)
    stats = summary(result.stderr)
    assert stats["skipped"] == before and stats["done"] == n - before


@pytest.mark.slow
def test_torn_final_line_is_truncated_and_redone(setup, tmp_path):
    entries = [{"id": f"t{i}", "prompt": f"the mat {i}", "max_tokens": 4} for i in range(5)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", entries), tmp_path / "out.jsonl"
    done = [{"id": "t0", "text": "kept"}, {"id": "t3", "text": "kept"}]
    out.write_text("".join(json.dumps(r) + "\n" for r in done) + '{"id": "t1", "text": "to')
    result = run_batch(setup, inp, out)
    assert result.returncode == 0, result.stderr
    assert "torn final line" in result.stderr
    results = read_results(out)
    assert results[:2] == done  # records already there are never rewritten
    assert sorted(r["id"] for r in results) == [e["id"] for e in entries]
    stats = summary(result.stderr)
    assert stats["skipped"] == 2 and stats["done"] == 3


@pytest.mark.slow
def test_bad_lines_are_reported_and_do_not_stop_the_others(setup, tmp_path):
    good = {"id": "a", "prompt": "the cat", "max_tokens": 3}
    lines = [
        good,                                                        # 1
        '{"id": "b", "prompt": ',                                    # 2 malformed JSON
        {"id": "c", "prompt": "the mat", "max_tokens": 3},           # 3
        {"prompt": "no id here"},                                    # 4 missing id
        {"id": "a", "prompt": "a duplicate of line 1"},              # 5 duplicate id
        {"id": "d", "prompt": "the house " * 100, "max_tokens": 10}, # 6 too long for 256
        {"id": "e", "prompt": "x", "temperature": -1},               # 7 bad sampling value
        {"id": "f", "prompt": "x", "max_token": 3},                  # 8 unknown field
        "[1, 2]",                                                    # 9 not an object
        "",                                                          # 10 blank: ignored
        {"id": "g", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},  # 11
        '{"id": "h", "prompt": "x", "seed": ' + "9" * 5000 + "}",    # 12 a 5000-digit integer
        '{"id": "i", "prompt": "x", "x": ' + "[" * 50_000 + "]" * 50_000 + "}",  # 13 deep nesting
        '{"id": "j", "prompt": "lone \\ud800 surrogate"}',          # 14 not Unicode text
        '{"id": "k", "prompt": "x", "temperature": 1e999}',          # 15 not finite
        {"id": "l", "prompt": "x", "top_k": 2**31},                  # 16 past int32
        {"id": "m", "prompt": "x", "stop": ["s"] * 17},              # 17 too many stop strings
        {"id": "n", "prompt": "word " * 200_000},                    # 18 cannot fit, untokenized
        {"id": "o", "prompt": "x", "model": "sql"},                  # 19 no such adapter
    ]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    result = run_batch(setup, inp, out)
    assert result.returncode == 1
    expected = {2: "malformed JSON", 4: 'missing "id"', 5: "duplicate id 'a' (first on line 1)",
                6: "exceeds the context of 256 tokens", 7: "temperature must be >= 0",
                8: "unknown field(s) 'max_token'", 9: "expected a JSON object",
                12: "5000 digits", 13: "nested too deeply", 14: "unpaired surrogate",
                15: "out of range", 16: "top_k must be in", 17: "at most 16 stop strings",
                18: "exceeds the context of 256 tokens", 19: "no LoRA adapter 'sql' is loaded"}
    reported = [s for s in result.stderr.splitlines() if s.startswith(f"cadence-batch: {inp}:")]
    assert {int(s.split(":")[2]) for s in reported} == set(expected), reported
    for number, text in expected.items():
        assert any(s.startswith(f"cadence-batch: {inp}:{number}: ") and text in s
                   for s in reported), (number, reported)
    results = read_results(out)
    assert sorted(r["id"] for r in results) == ["a", "c", "g"]
    assert next(r for r in results if r["id"] == "a")["prompt_tokens"] < 10  # line 1, not 5
    assert summary(result.stderr)["failed"] == len(expected)

    # Failures are not written, so a rerun skips the successes and retries only the failures.
    again = run_batch(setup, inp, out)
    assert again.returncode == 1
    stats = summary(again.stderr)
    assert stats["skipped"] == 3 and stats["done"] == 0 and stats["failed"] == len(expected)
    assert len(read_results(out)) == 3


# The full tier (~10 s, a job of its own): the default tier runs the job (the reference's text,
# usage, resubmission) and serves the same structure fields, parsed by the same server modules,
# over HTTP (test_structured.py).
@pytest.mark.slow
def test_response_formats_and_tool_calls(setup, tmp_path):
    """The chat API's structure fields, line by line: a schema's answer validates, a forced
    call comes back as tool_calls, and a line whose grammar cannot be built is reported."""
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "f"}}
    chat = [{"role": "user", "content": "hi"}]
    lines = [
        {"id": "schema", "prompt": "x", "max_tokens": 60, "temperature": 0.8,
         "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
        {"id": "call", "messages": chat, "max_tokens": 60, "tools": [tool], "tool_choice": "required",
         "parallel_tool_calls": False},
        {"id": "bad", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "string", "pattern": "(["}}}},
        {"id": "no-chat", "prompt": "x", "tools": [tool]},
    ]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    result = run_batch(setup, inp, out, "--max_seq_len=512")
    assert result.returncode == 1
    reported = [s for s in result.stderr.splitlines() if s.startswith(f"cadence-batch: {inp}:")]
    assert len(reported) == 2 and "unclosed" in reported[0] and "needs a chat" in reported[1], reported
    results = {r["id"]: r for r in read_results(out)}
    assert set(results) == {"schema", "call"}
    jsonschema.validate(json.loads(results["schema"]["text"]), schema)
    call = results["call"]
    assert call["finish_reason"] == "tool_calls" and call["text"] == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in call["tool_calls"]][0] == ("f", {})


@pytest.mark.slow  # (chat templates: test_chat_templates; the batch job: the default tier's others)
def test_chat_template_flags_replace_the_models_template(setup, tmp_path, tiny_config, tiny_params):
    """--chat_template (a file) renders every chat instead of the model's template, with
    --chat_template_kwargs' variables beneath a line's own chat_template_kwargs; a line's own
    chat_template (the job's file is the operator's: trusted) renders that line."""
    root, _ = setup
    template = tmp_path / "chat.jinja"
    template.write_text("{{ greeting }}:{% for m in messages %} <{{ m['role'] }}> {{ m['content'] }}"
                        "{% endfor %}{% if add_generation_prompt %} <assistant>{% endif %}")
    chat = [{"role": "user", "content": "the cat sat"}]
    lines = [{"id": "server's", "messages": chat, "max_tokens": 6, "ignore_eos": True},
             {"id": "own", "messages": chat, "max_tokens": 6, "ignore_eos": True,
              "chat_template_kwargs": {"greeting": "yo"}},
             {"id": "line's template", "messages": chat, "max_tokens": 6, "ignore_eos": True,
              "chat_template": "[{{ greeting }}]{% for m in messages %} <{{ m['role'] }}> {{ m['content'] }}"
                               "{% endfor %} <assistant>"}]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    result = run_batch(setup, inp, out, f"--chat_template={template}",
                       '--chat_template_kwargs={"greeting": "hi there"}')
    assert result.returncode == 0, result.stderr
    tok = Tokenizer.from_hf_dir(root / "model")
    results = {r["id"]: r for r in read_results(out)}
    for key, text in (("server's", "hi there: <user> the cat sat <assistant>"),
                      ("own", "yo: <user> the cat sat <assistant>"),
                      ("line's template", "[hi there] <user> the cat sat <assistant>")):
        ids = tok.encode(text)
        assert results[key]["prompt_tokens"] == len(ids)
        assert results[key]["text"] == tok.decode(greedy_generate(tiny_params, tiny_config, ids, 6),
                                                  skip_special=True)


def test_load_done_refuses_a_corrupt_middle_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(BatchError, match=r"out.jsonl:2 is not a result record"):
        load_done(out)
    assert out.read_text() == '{"id": 1}\nnot json\n{"id": 2}\n'  # untouched
    out.write_text('{"id": 1}\n{"id": "1"}\n{"id": 2')
    assert load_done(out) == ({"1", '"1"'}, len('{"id": 2'))
    assert out.read_text() == '{"id": 1}\n{"id": "1"}\n'
    assert load_done(tmp_path / "missing.jsonl") == (set(), 0)


@pytest.mark.slow  # (embeddings: test_embeddings)
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_input_lines_are_embeddings(setup, tmp_path, tiny_config, tiny_params, pooling):
    """An input line (text or token ids) beside a prompt line: its result is the vector at unit
    length, the reference's pooled hidden states (--pooling); a line mixing input with
    generation fields is refused by name, and does not stop the others."""
    root, _ = setup
    tok = Tokenizer.from_hf_dir(root / "model")  # the tokenizer the CLI loaded
    ids = [5, 9, 40, 7, 300, 12] * 9
    entries = [{"id": "t", "input": "the cat sat on the mat"}, {"id": "i", "input": ids, "priority": 1},
               {"id": "p", "prompt": "the house", "max_tokens": 4, "ignore_eos": True},
               {"id": "bad", "input": "the mat", "max_tokens": 3}]
    out = tmp_path / "out.jsonl"
    done = run_batch(setup, write_jsonl(tmp_path / "in.jsonl", entries), out, f"--pooling={pooling}")
    assert done.returncode == 1, done.stderr  # the bad line
    assert "id 'bad' invalid" in done.stderr and "'max_tokens'" in done.stderr
    results = {r["id"]: r for r in read_results(out)}
    assert sorted(results) == ["i", "p", "t"] and FIELDS <= set(results["p"])
    for key, prompt in (("t", tok.encode("the cat sat on the mat")), ("i", ids)):
        r = results[key]
        assert set(r) == {"id", "embedding", "prompt_tokens", "queue_time", "total_time", "prefill_chunks"}
        assert r["prompt_tokens"] == len(prompt)
        hidden = sequence_logits(tiny_params, tiny_config, prompt, hidden=True).astype(np.float64)
        want = hidden.mean(0) if pooling == "mean" else hidden[-1]
        np.testing.assert_allclose(r["embedding"], want / np.linalg.norm(want), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_openai_batch_lines_are_answered_by_the_endpoints(setup, tmp_path, tiny_config, tiny_params):
    """OpenAI's Batch API format: each body answered as its endpoint answers it (the greedy
    tokens, logprobs, prompt_logprobs, embeddings), in OpenAI's output line; a body the endpoint
    refuses and a broken envelope are reported and left out, the rest run; a rerun skips the
    custom_ids done, and a file mixing both formats is refused whole."""
    root, _ = setup
    tok = Tokenizer.from_hf_dir(root / "model")
    chat = [{"role": "user", "content": "hello there"}]

    def line(custom_id, url, **body):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "gpt-4o-mini", **body}}

    entries = [
        line("chat", "/v1/chat/completions", messages=chat, max_tokens=6, temperature=0, logprobs=True,
             top_logprobs=2),
        line("text", "/v1/completions", prompt="the cat sat", max_tokens=5, temperature=0, ignore_eos=True,
             prompt_logprobs=1, n=2),
        line("vector", "/v1/embeddings", input="the mat"),
        line("response", "/v1/responses", input="hello there", max_output_tokens=6, temperature=0),
        line("refused", "/v1/completions", prompt="the cat", max_tokens=0),
        {"custom_id": "nowhere", "method": "POST", "url": "/v1/images", "body": {}},
        {"custom_id": "streamed", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}},
        line("chat", "/v1/completions", prompt="the cat"),  # a custom_id already taken
    ]
    # Choices that outnumber 4 slots and a queue of 1: the scheduler turns some away (429s),
    # which wait and go again.
    more = [line(f"more-{i}", "/v1/completions", prompt=f"the cat {i}", max_tokens=3, n=2) for i in range(8)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", entries + more), tmp_path / "out.jsonl"
    result = run_batch(setup, inp, out, "--max_queue=1")
    assert result.returncode == 1, result.stderr
    assert "custom_id 'refused' failed (400)" in result.stderr and "max_tokens" in result.stderr
    assert ':6: "url" must be one of' in result.stderr and ":7: \"stream\": true" in result.stderr
    assert ":8: duplicate custom_id 'chat' (first on line 1)" in result.stderr
    records = {r["custom_id"]: r for r in read_results(out)}
    assert sorted(records) == sorted(["chat", "text", "vector", "response", *(m["custom_id"] for m in more)])
    for r in records.values():
        assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
        assert r["id"].startswith("batch_req_") and r["response"]["status_code"] == 200
    answer = records["chat"]["response"]["body"]
    assert answer["object"] == "chat.completion" and records["chat"]["response"]["request_id"] == answer["id"]
    ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
    want = greedy_generate(tiny_params, tiny_config, ids, 6)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert len(answer["choices"][0]["logprobs"]["content"]) == answer["usage"]["completion_tokens"]
    assert answer["choices"][0]["message"]["content"] == tok.decode(want[:answer["usage"]["completion_tokens"]],
                                                                     skip_special=True)
    text = records["text"]["response"]["body"]
    prompt = tok.encode("the cat sat")
    assert [c["text"] for c in text["choices"]] == [tok.decode(greedy_generate(
        tiny_params, tiny_config, prompt, 5), skip_special=True)] * 2
    scored = text["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None and str(prompt[1]) in scored[1]
    vector = records["vector"]["response"]["body"]["data"][0]["embedding"]
    assert len(vector) == tiny_config.hidden_size
    response = records["response"]["response"]["body"]  # the Responses API's answer to the same chat
    assert response["object"] == "response" and response["usage"]["input_tokens"] == len(ids)
    assert response["output"][-1]["content"][0]["text"] == answer["choices"][0]["message"]["content"]

    again = run_batch(setup, inp, out)
    assert summary(again.stderr)["skipped"] == len(records) and len(read_results(out)) == len(records)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [entries[0], {"id": 1, "prompt": "the cat"}])
    refused = run_batch(setup, mixed, tmp_path / "mixed-out.jsonl")
    assert refused.returncode == 2 and "mixes OpenAI batch lines" in refused.stderr


@pytest.mark.slow
def test_a_rerankers_batch_lines_are_scored(setup, tmp_path, tiny_config, tiny_params):
    """vLLM's run_batch lines for a reranker (/v1/rerank, /v1/score): the converted checkpoint's
    head (`ranking.npz`) scores each pair as the reference's last hidden state through it."""
    root, env = setup
    model = tmp_path / "reranker"
    shutil.copytree(root / "model", model)
    rows = np.asarray(tiny_params["embed"]["embedding"], np.float32)[[5, 9]]
    head = RankingHead(rows, None, softmax=True, template="<|im_start|>{query}\n{document}<|im_end|>")
    (model / RANKING_FILE).write_bytes(head.file_bytes())
    docs = ["the cat sat", "a mat"]
    entries = [{"custom_id": "ranked", "method": "POST", "url": "/v1/rerank",
                "body": {"query": "cats", "documents": docs}},
               {"custom_id": "scored", "method": "POST", "url": "/v1/score",
                "body": {"text_1": "cats", "text_2": docs}}]
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "cadence.server.batch_cli", f"--input={write_jsonl(tmp_path / 'in.jsonl', entries)}",
            f"--output={out}", f"--model={model}", *ENGINE_FLAGS]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tok = Tokenizer.from_hf_dir(model)
    want = []
    for doc in docs:
        hidden = sequence_logits(tiny_params, tiny_config, head.prompt(tok, "cats", doc), hidden=True)[-1]
        logits = rows.astype(np.float64) @ hidden.astype(np.float64)
        want.append(float(np.exp(logits[0]) / np.exp(logits).sum()))
    records = {r["custom_id"]: r["response"]["body"] for r in read_results(out)}
    ranked = {r["index"]: r["relevance_score"] for r in records["ranked"]["results"]}
    assert [ranked[0], ranked[1]] == pytest.approx(want, abs=2e-5)
    assert [d["score"] for d in records["scored"]["data"]] == pytest.approx(want, abs=2e-5)
