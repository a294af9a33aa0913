"""`cadence-serve` as a user runs it: a subprocess over the tiny model, stopped with SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def start(tiny_model_dir, log: Path, *flags: str, env: dict | None = None
          ) -> tuple[subprocess.Popen, str]:
    """Starts cadence-serve on a free port, its stderr to `log`."""
    root, base_env = tiny_model_dir
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "cadence.server.serve_cli", f"--model={root / 'model'}", f"--port={port}",
           *flags]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**base_env, **(env or {})},
                                stdout=subprocess.DEVNULL, stderr=err)
    return proc, f"http://127.0.0.1:{port}"


def health(base: str, proc: subprocess.Popen, timeout: float = 120) -> httpx.Response:
    """The first /health answer once the server listens."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"cadence-serve exited with {proc.returncode}"
        assert time.monotonic() < deadline, "cadence-serve never listened"
        try:
            return httpx.get(f"{base}/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)


def test_sigterm_mid_stream_drains_it_and_the_key_comes_from_the_environment(tiny_model_dir, tmp_path):
    proc, base = start(tiny_model_dir, tmp_path / "serve.log", "--num_slots=2", "--max_seq_len=512",
                       "--prefill_chunk=32", "--drain_timeout=30", env={"CADENCE_API_KEY": "from-env"})
    try:
        deadline = time.monotonic() + 180
        while health(base, proc).status_code != 200:
            assert time.monotonic() < deadline, "never warm"
            time.sleep(0.1)
        body = {"prompt": "drain me", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "bearer from-env"}) as response:
            assert response.status_code == 200
            chunks = response.iter_bytes()
            received = [next(chunks)]
            proc.send_signal(signal.SIGTERM)  # mid-stream
            received.extend(chunks)
        raw = b"".join(received)
        assert raw.endswith(b"data: [DONE]\n\n")
        usage = json.loads(raw.split(b"\n\n")[-3][len(b"data: "):])["usage"]
        assert usage["completion_tokens"] == 300  # drained in full, not cut off
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_sigterm_during_warm_up_exits_at_once(tiny_model_dir, tmp_path):
    # A cache of its own: nothing compiled before, so warm-up is still running when we stop it.
    log = tmp_path / "serve.log"
    proc, base = start(tiny_model_dir, log, "--max_seq_len=512", "--prefill_chunk=512", "--num_slots=3",
                       "--drain_timeout=60", env={"CADENCE_CACHE": str(tmp_path / "cache")})
    try:
        first = health(base, proc, timeout=300)
        body = first.json()  # with how far the compiler is, once it has started
        assert first.status_code == 503 and body["status"] == "warming up"
        assert set(body) <= {"status", "programs_done", "programs_total"}
        assert body.get("programs_done", 0) <= body.get("programs_total", 0)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - stopped < 10, "waited for compilation to finish"
        assert "stopped during warm-up" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads(tiny_model_dir, tmp_path):
    """Another process listens on the port: cadence-serve says so and exits 2 at once, without
    loading the model (it used to load and warm up, then abort in uvicorn's exit)."""
    root, env = tiny_model_dir
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "cadence.server.serve_cli",
                                 f"--model={root / 'model'}", f"--port={port}"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cadence-serve: error: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "loaded" not in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 60


@pytest.mark.slow  # two processes started for a flag check
@pytest.mark.parametrize("flags, message", [
    (["--runtime_lora"], "give --max_loras more than --lora's 0"),
    (["--runtime_lora", "--max_loras=2", "--num_processes=2", "--process_id=0"],
     "the others of --num_processes would not follow"),
])
def test_runtime_lora_that_cannot_work_is_a_one_line_error(tiny_model_dir, flags, message):
    root, env = tiny_model_dir
    result = subprocess.run([sys.executable, "-m", "cadence.server.serve_cli", f"--model={root / 'model'}",
                             "--port=0", *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "cadence-serve: error: --runtime_lora" in result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
