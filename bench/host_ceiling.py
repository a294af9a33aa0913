"""The host ceiling: how many streamed messages per second cadence's host side delivers when the
engine costs nothing.

    python -m cadence.bench.host_ceiling --streams=64,256 --out=bench/results/host-ceiling-cpu/host_ceiling.json

A GPU runs an 8B model's decode step at batch 256 in ~10 ms: ~25,000 tokens/s that the host
must schedule, detokenize, frame as SSE and write to sockets. This bench measures how many of
them cadence's host side can carry at all. It starts the real server in a subprocess (uvicorn,
the Starlette app, the scheduler thread, detokenization, SSE framing) around `NullEngine`, an
engine whose prefill and decode return their tokens at once, and holds N closed-loop streams
against it from this process, on the same cores. Each stream asks /v1/completions for
`--output_tokens` tokens (ignore_eos) and starts again when it ends. Reported per N: messages/s
that arrived in the window, and the scheduler's iterations/s from the server's /metrics.

The client is deliberately cheap (raw asyncio sockets, counting `data: {` in the bytes, no
HTTP or JSON parsing), so that what saturates is the server: `bench.client`, which parses every
message, itself tops out near the server's rate on two cores.

The engine emits one fixed token whose text is a whole word, so every token is one message;
nothing here depends on the model's weights (only its tokenizer is loaded).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

_STREAMS = flags.DEFINE_list("streams", ["64", "256"], "Concurrent streams per point.")
_MAX_TOKENS = flags.DEFINE_integer("output_tokens", 256, "Output tokens per request.")
_WARMUP = flags.DEFINE_float("warmup", 3.0, "Seconds of load before the window.")
_DURATION = flags.DEFINE_float("duration", 10.0, "Window, seconds.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "The model whose tokenizer the server uses.")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results.")
_HTTP = flags.DEFINE_enum("http", "auto", ["auto", "h11", "httptools"],
                          "uvicorn's HTTP implementation in the server (auto: httptools when installed).")
_SERVE_PORT = flags.DEFINE_integer("serve_port", None, "Internal: run the server on this port.")
_SLOTS = flags.DEFINE_integer("serve_slots", 256, "Internal: the server's slots.")

WORD = " the"  # one token in any English BPE vocabulary


class NullEngine:
    """`engine.api.EngineAPI` at zero cost: every call returns `token` at once, on the host."""

    def __init__(self, config, vocab_size: int, token: int):
        self.config = config
        self.vocab_size = vocab_size
        self.num_pages = config.pool_pages
        self.compilations_after_warmup = 0
        self.kv_cache_bytes = 0
        self._all = np.full(config.num_slots, token, np.int32)
        from cadence.engine.results import PrefillTokens  # the server side only: the client needs no JAX

        self._tokens = PrefillTokens

    def prefill(self, chunks, sampling, allowed=None):
        return self._tokens([(self._all, len(chunks))])  # chunks <= num_slots: one program

    def decode(self, positions, active, sampling, page_table, steps=1):
        return np.broadcast_to(self._all, (steps, len(self._all)))

    def recover(self) -> None:
        pass


def serve(port: int) -> None:
    import uvicorn

    from cadence.checkpoints.registry import load_model
    from cadence.engine.config import EngineConfig
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
    from cadence.server.app import create_app

    model = load_model(_MODEL.value)
    token = model.tokenizer.encode(WORD)[0]  # the whole word in a real vocabulary; its text is never empty
    slots = _SLOTS.value
    engine = NullEngine(EngineConfig(num_slots=slots, max_seq_len=4096, prefill_chunk=256),
                        model.config.vocab_size, token)
    scheduler = Scheduler(engine, model.tokenizer, SchedulerConfig(
        policy=PolicyConfig(name="chunked", token_budget=256 + slots, chunk=256), max_queue=4 * slots))
    application = create_app(scheduler, model.tokenizer, "null")
    uvicorn.run(application, host="127.0.0.1", port=port, log_level="warning", http=_HTTP.value)


async def _stream(host: str, port: int, body: bytes, counts: list[tuple[float, int]]) -> None:
    """One streaming request over a fresh connection; appends (arrival time, messages) per
    read. Counts `data: {` (every message but the closing [DONE]) in the raw bytes."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    tail = b""
    try:
        while data := await reader.read(65536):
            joined = tail + data
            counts.append((time.perf_counter(), joined.count(b"data: {")))
            tail = joined[-6:]  # a marker split across reads is counted once, in the next
            if b"data: [DONE]" in joined:
                break
    finally:
        writer.close()


async def measure(host: str, port: int, streams: int) -> dict:
    body = json.dumps({"model": "null", "prompt": "Hello", "max_tokens": _MAX_TOKENS.value,
                       "stream": True, "ignore_eos": True}).encode()
    t0 = time.perf_counter()
    window = (t0 + _WARMUP.value, t0 + _WARMUP.value + _DURATION.value)
    counts: list[tuple[float, int]] = []
    requests, errors = 0, 0

    async def loop() -> None:
        nonlocal requests, errors
        while time.perf_counter() < window[1]:
            requests += 1
            try:
                await _stream(host, port, body, counts)
            except OSError:
                errors += 1

    tasks = [asyncio.create_task(loop()) for _ in range(streams)]
    await asyncio.sleep(window[0] - time.perf_counter())
    before = await _iterations(host, port)
    await asyncio.sleep(window[1] - time.perf_counter())
    iterations = await _iterations(host, port) - before
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    inside = sum(n for t, n in counts if window[0] <= t < window[1])
    seconds = window[1] - window[0]
    return {"streams": streams, "messages_per_s": inside / seconds,
            "iterations_per_s": iterations / seconds, "requests": requests, "errors": errors}


async def _iterations(host: str, port: int) -> float:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host.encode())
    text = (await reader.read()).decode()
    writer.close()
    for line in text.splitlines():
        if line.startswith("cadence:iteration_tokens_total_count{"):
            return float(line.split()[-1])
    raise RuntimeError("the server's /metrics has no cadence:iteration_tokens_total_count")


def main(argv) -> None:
    del argv
    if _SERVE_PORT.value:
        serve(_SERVE_PORT.value)
        return
    from cadence.bench.cadence_server import REPO, free_port, wait_healthy

    counts = [int(s) for s in _STREAMS.value]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cadence.bench.host_ceiling", f"--serve_port={port}",
                             f"--serve_slots={max(counts)}", f"--model={_MODEL.value}",
                             f"--http={_HTTP.value}"], cwd=REPO)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 300.0, log=None)
        points = []
        for n in counts:
            point = asyncio.run(measure("127.0.0.1", port, n))
            print(f"{n:4d} streams: {point['messages_per_s']:8.0f} messages/s, "
                  f"{point['iterations_per_s']:6.0f} iterations/s, {point['errors']} errors", flush=True)
            points.append(point)
    finally:
        proc.terminate()
        proc.wait(30)
    report = {"bench": "host_ceiling", "http": _HTTP.value, "output_tokens": _MAX_TOKENS.value, "window_s": _DURATION.value,
              "points": points, "platform": platform.platform(),
              "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "python": platform.python_version(), "date": datetime.date.today().isoformat()}
    if _OUT.value:
        Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
        Path(_OUT.value).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    app.run(main)
