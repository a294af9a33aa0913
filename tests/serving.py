"""Serving in tests: the real server over a real scheduler on a loopback port, its metrics, and
the command-line front doors run as a user runs them.

    with serving(engine, tokenizer) as (base, scheduler): httpx.post(f"{base}/v1/completions", ...)
    gauge(base, "num_requests_running")
    cli(tiny_model_dir, "cadence.server.generate_cli", "--prompt=...")
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.reference import greedy_generate
from tests.conftest import loopback_server, tiny_app


ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


@contextlib.contextmanager
def serving(engine, tokenizer, **options):
    """`conftest.tiny_app` served over loopback once healthy: yields its base URL and its
    scheduler."""
    app, sched = tiny_app(engine, tokenizer, MODEL, **options)
    with loopback_server(app) as base:
        wait_healthy(base)
        yield base, sched


def wait_healthy(base: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{base}/health").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.02)


def gauge(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    line = next(l for l in text.splitlines() if l.startswith(f"cadence:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def cli(tiny_model_dir, module: str, *flags: str) -> subprocess.CompletedProcess:
    root, env = tiny_model_dir
    cmd = [sys.executable, "-m", module, f"--model={root / 'model'}", "--num_slots=2",
           "--max_seq_len=128", "--prefill_chunk=32", *flags]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def generate_gives_the_reference_text(tiny_model_dir, tiny_params, tiny_config, *flags: str) -> str:
    """Runs `cadence-generate` greedy with `flags`; checks its text is the reference's and
    nothing compiled after warm-up; returns its stderr."""
    result = cli(tiny_model_dir, "cadence.server.generate_cli", "--prompt=The capital of France is",
                 "--max_tokens=12", "--temperature=0", *flags)
    assert result.returncode == 0, result.stderr
    tok = Tokenizer.from_hf_dir(tiny_model_dir[0] / "model")
    ids = greedy_generate(tiny_params, tiny_config, tok.encode("The capital of France is"), 12, tok.eos_ids)
    assert result.stdout.rstrip("\n") == tok.decode(ids, skip_special=True)
    assert "compilations_after_warmup: 0" in result.stderr
    return result.stderr


def batch_job(tmp_path) -> tuple[dict[str, str], list[str]]:
    """Four greedy prompts of 3..24 words for `cadence-batch`, and the flags naming its files."""
    prompts = {f"r{i}": "word " * (3 + 7 * i) for i in range(4)}
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": k, "prompt": v, "max_tokens": 8, "temperature": 0}) + "\n"
                           for k, v in prompts.items()))
    return prompts, [f"--input={inp}", f"--output={tmp_path / 'out.jsonl'}"]


def assert_batch_is_the_reference(tmp_path, prompts, tiny_model_dir, tiny_params, tiny_config) -> None:
    tok = Tokenizer.from_hf_dir(tiny_model_dir[0] / "model")
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(prompts)
    for row in rows:
        ids = greedy_generate(tiny_params, tiny_config, tok.encode(prompts[row["id"]]), 8, tok.eos_ids)
        assert row["text"] == tok.decode(ids, skip_special=True), row["id"]
