"""`cadence-generate` end to end: the real CLI in a subprocess over the tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.reference import greedy_generate

ROOT = Path(__file__).resolve().parent.parent
ENGINE_FLAGS = ["--num_slots=4", "--max_seq_len=256", "--prefill_chunk=32"]


def generate(tiny_model_dir, *flags: str) -> subprocess.CompletedProcess:
    root, env = tiny_model_dir
    cmd = [sys.executable, "-m", "cadence.server.generate_cli", f"--model={root / 'model'}", *ENGINE_FLAGS, *flags]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("host", [False, True], ids=["device-cache", "host-tier"])
def test_one_prompt_streams_the_reference_text(tiny_model_dir, tiny_params, tiny_config, host):
    """With the prefix cache's host tier too, whose page moves warm-up then compiles."""
    root, _ = tiny_model_dir
    result = generate(tiny_model_dir, "--prompt=The capital of France is", "--max_tokens=12",
                      "--temperature=0", *(["--host_kv_cache_memory=16MiB"] if host else []))
    assert result.returncode == 0, result.stderr
    tok = Tokenizer.from_hf_dir(root / "model")
    ids = greedy_generate(tiny_params, tiny_config, tok.encode("The capital of France is"), 12, tok.eos_ids)
    assert result.stdout.rstrip("\n") == tok.decode(ids, skip_special=True)
    assert "compilations_after_warmup: 0" in result.stderr and "ttft=" in result.stderr
    later = re.search(r"warm-up compiles \d+ programs .*; on first use: (.*)", result.stderr).group(1)
    assert ("transfer" in later) is not host
    assert ("evicted pages kept in up to 16 MiB of host memory" in result.stderr) is host


def test_mixed_prompts_file_compiles_nothing_after_warmup_and_writes_a_trace(tiny_model_dir, tmp_path):
    long_text = " ".join(f"word{i}" for i in range(12))  # ~80 tokens: several 32-token chunks
    lines = ["hello there", json.dumps({"prompt": long_text, "max_tokens": 20}),
             json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.8, "seed": 3}),
             "short again"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    trace = tmp_path / "trace.json"
    result = generate(tiny_model_dir, f"--prompts_file={prompts}", "--max_tokens=16", f"--trace_file={trace}")
    assert result.returncode == 0, result.stderr
    outputs = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(o["index"] for o in outputs) == [0, 1, 2, 3]
    assert "compilations_after_warmup: 0" in result.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    iterations = [e for e in events if e.get("pid") == 1 and e["ph"] == "X"]
    assert sum(e["args"]["prefill_chunks"] for e in iterations) >= 4 + 2  # the long prompt is chunked
    assert any(e["args"]["decode_slots"] > 1 for e in iterations)  # continuous batching happened
    phases = {e["name"] for e in events if e.get("pid") == 2 and e["ph"] == "X"}
    assert phases == {"queued", "prefill", "decode"}


@pytest.mark.slow
def test_bad_arguments_get_one_line_errors(tiny_model_dir, tmp_path):
    result = generate(tiny_model_dir)
    assert result.returncode == 2 and "exactly one of --prompt or --prompts_file" in result.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{not json\n')
    result = generate(tiny_model_dir, f"--prompts_file={bad}")
    assert result.returncode == 2 and "bad.jsonl:2" in result.stderr
    for flag, why in ((f"--chat_template={tmp_path / 'none.jinja'}", "is not a file, a Jinja template"),
                      ("--chat_template={% if %}", "does not parse"),
                      ("--chat_template_kwargs={\"tools\": 1}", "may not set 'tools'")):
        result = generate(tiny_model_dir, "--prompt=x", flag)
        assert result.returncode != 0 and why in result.stderr and "loaded" not in result.stderr, flag


@pytest.mark.slow
def test_a_prompt_too_long_is_reported_not_dropped(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("fine\n" + " ".join(f"word{i}" for i in range(200)) + "\n")
    result = generate(tiny_model_dir, f"--prompts_file={prompts}", "--max_tokens=4")
    assert result.returncode == 1
    assert "request 1 rejected" in result.stderr and "exceeds the context of 256" in result.stderr
    assert [json.loads(line)["index"] for line in result.stdout.splitlines()] == [0]


def test_a_kv_pool_larger_than_the_machine_is_refused_before_it_is_made(tiny_model_dir):
    """A pool the host cannot hold is a one-line error naming its size and what to change,
    not a process the kernel kills mid-start (or a machine that swaps)."""
    import dataclasses

    from cadence.engine.config import EngineConfig
    from cadence.model.config import SMOLLM2_135M
    from cadence.server.runtime import check_pool_fits

    result = generate(tiny_model_dir, "--prompt=hi", "--kv_cache_memory=4096GiB")
    assert result.returncode == 2 and "the KV pool needs 4096.0 GiB" in result.stderr, result.stderr[-2000:]
    assert "lower --num_slots or --max_seq_len, or lower --kv_cache_memory" in result.stderr
    # SmolLM2's default pool, 8 x 4096 float32 tokens at 45 KiB each: 1.4 GiB, which must fit
    # in 90% of what is free.
    config = EngineConfig(num_slots=8, max_seq_len=4096)
    check_pool_fits(SMOLLM2_135M, [config], free=int(1.6 * 2**30))
    with pytest.raises(ValueError, match=r"needs 1\.4 GiB \(32768 tokens .* 45 KiB a token .* 1\.5 GiB "
                                         r"available.*bfloat16"):
        check_pool_fits(SMOLLM2_135M, [config], free=int(1.5 * 2**30))
    # Disaggregated, each engine's own pool (a prefill engine of 2 slots); replicated, each copy.
    prefill = dataclasses.replace(config, num_slots=2)
    with pytest.raises(ValueError, match=r"needs 1\.8 GiB \(40960 tokens"):
        check_pool_fits(SMOLLM2_135M, [prefill, config], free=int(1.9 * 2**30))
    with pytest.raises(ValueError, match=r"needs 2\.8 GiB \(65536 tokens"):
        check_pool_fits(SMOLLM2_135M, [config], copies=2, free=3 * 2**30)


def test_a_host_tier_larger_than_the_machine_is_refused():
    """--host_kv_cache_memory takes a size with a unit, and refuses one the machine has not
    available (the tier fills as pages are evicted, so it would swap long after the start), or
    one beside --noprefix_caching."""
    from absl import flags
    from absl.testing import flagsaver

    from cadence.server.runtime import host_kv_cache_bytes

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    with flagsaver.flagsaver(host_kv_cache_memory="1.5GiB"):
        assert host_kv_cache_bytes(free=2 * 2**30) == 3 * 2**29
        with pytest.raises(ValueError, match=r"--host_kv_cache_memory=1.5GiB is more than the 1.0 GiB"):
            host_kv_cache_bytes(free=2**30)
    with flagsaver.flagsaver(host_kv_cache_memory="0", prefix_caching=False):
        assert host_kv_cache_bytes(free=0) == 0
    with flagsaver.flagsaver(host_kv_cache_memory="1MiB", prefix_caching=False):
        with pytest.raises(ValueError, match="needs the prefix cache on"):
            host_kv_cache_bytes()
    with flagsaver.flagsaver(host_kv_cache_memory="lots"):
        with pytest.raises(ValueError, match="is not a size"):
            host_kv_cache_bytes()
    # The keys of cached pages (and so the pages the tier and slot files keep) name the
    # converted checkpoint too: another file under the same model name shares none of them.
    from cadence.server.runtime import scheduler_config_from_flags

    assert len({scheduler_config_from_flags("m", c).cache_namespace for c in ("1a2b", "3c4d")}) == 2


@pytest.mark.slow  # (a draft model served: test_draft_model)
def test_a_draft_model_drafts_and_the_text_is_still_the_reference(tiny_model_dir, tiny_params, tiny_config):
    """--draft_model with the model's own weights: every greedy draft is accepted, the text is
    the reference generator's, and the draft engine compiled nothing after warm-up either."""
    root, _ = tiny_model_dir
    result = generate(tiny_model_dir, "--prompt=The capital of France is", "--max_tokens=40",
                      "--temperature=0", f"--draft_model={root / 'model'}", "--num_speculative_tokens=3")
    assert result.returncode == 0, result.stderr
    tok = Tokenizer.from_hf_dir(root / "model")
    ids = greedy_generate(tiny_params, tiny_config, tok.encode("The capital of France is"), 40, tok.eos_ids)
    assert result.stdout.rstrip("\n") == tok.decode(ids, skip_special=True)
    assert re.search(r"drafts from \S+model \(--draft_model\), up to 3 tokens a step while at most 1 "
                     r"request decodes; its KV pool 5 pages", result.stderr)
    counts = re.search(r"(\d+) draft tokens in \d+ drafts, (\d+) accepted; the draft model's: (\d+), (\d+) "
                       r"accepted", result.stderr).groups()
    drafted, accepted, by_model, model_accepted = map(int, counts)
    assert drafted == accepted >= by_model == model_accepted > 0
    assert "compilations_after_warmup: 0" in result.stderr
