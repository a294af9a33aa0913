"""cadence-batch's OpenAI Batch API lines, answered by cadence-serve's own endpoints in process.

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

This is the input format of OpenAI's Batch API (and of vLLM's `run_batch`, whose rerank and score
lines a reranker answers here too). Each line's `body`
is posted to the same Starlette app `cadence-serve` runs, over an in-process transport (no
socket), so the answer is exactly the endpoint's: every field the API takes (logprobs,
`prompt_logprobs`, `n`, tools, `response_format`, ...) and every check on them. The result is
OpenAI's batch output line:

    {"id": "batch_req_<hex>", "custom_id": "r1", "error": null,
     "response": {"status_code": 200, "request_id": <the answer's id>, "body": {...}}}

Contract, beside cadence-batch's own (resumable, one record per `custom_id`, failures on
stderr and not in the output, so a rerun retries exactly them):
- `url` is one of `URLS`, `method` POST; `custom_id` a non-empty string. `body` is the
  endpoint's request, without `stream` (a batch answers whole); its `model` is not checked,
  as the job serves the one model it loaded (answers name that model).
- Defaults are the API's (a completion's 16 tokens, the model's sampling settings), not the
  job's sampling flags, which apply to cadence's own lines.
- Requests go in as the scheduler can queue them; one it turns away as full (a 429) waits the
  time it says and goes again, so a large file never fails for being large.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from cadence.server.app import ServerConfig, create_app
from cadence.server.runtime import Runtime

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/rerank",
        "/v1/score")


@dataclasses.dataclass
class Totals:
    """A cadence-batch run's counts, either kind of line."""

    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


_KEYS = {"custom_id", "method", "url", "body"}


def is_batch_line(entry: dict[str, Any]) -> bool:
    """Whether an input line is in OpenAI's format (it names a `custom_id`)."""
    return "custom_id" in entry


def line_problem(entry: dict[str, Any]) -> str | None:
    """What is wrong with an OpenAI batch line's envelope, or None (its body is the endpoint's
    to check)."""
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        return f"an OpenAI batch line takes only {', '.join(sorted(_KEYS))}; got {', '.join(map(repr, unknown))}"
    value = entry["custom_id"]
    if not isinstance(value, str) or not value:
        return f'"custom_id" must be a non-empty string, got {value!r}'
    if entry.get("method", "POST") != "POST":
        return f'"method" must be "POST", got {entry.get("method")!r}'
    if entry.get("url") not in URLS:
        return f'"url" must be one of {", ".join(URLS)}; got {entry.get("url")!r}'
    body = entry.get("body")
    if not isinstance(body, dict):
        return f'"body" must be an object (the request {entry["url"]} takes), got {type(body).__name__}'
    if body.get("stream"):
        return '"stream": true has no meaning in a batch; its answer is written whole'
    return None


def record(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "error": None,
            "response": {"status_code": status, "request_id": body.get("id"), "body": body}}


def run(rt: Runtime, jobs: Sequence[Any], output: Path, report: Callable[[int, str], None],
        config: ServerConfig, model_name: str) -> Totals:
    """Answers every job (`.line`, `.id`, `.entry`), appending each record as it finishes."""
    app = create_app(rt.scheduler, rt.model.tokenizer, model_name, config=config,
                     generation=rt.model.generation, ranking=rt.model.ranking)
    start = time.monotonic()
    totals = asyncio.run(_run(app, jobs, output, report))
    totals.seconds = time.monotonic() - start
    return totals


async def _run(app, jobs, output: Path, report) -> Totals:
    sched = app.state.server.scheduler
    gate = asyncio.Semaphore(sched.num_slots + sched.config.max_queue)
    totals = Totals()
    async with app.router.lifespan_context(app):
        await asyncio.to_thread(app.state.server.ready.wait)  # the runtime is warm already
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cadence-batch",
                                     timeout=None) as client:
            with open(output, "ab") as out, tqdm(total=len(jobs), unit="req", file=sys.stderr,
                                                 desc="cadence-batch", dynamic_ncols=True) as bar:

                async def one(job) -> None:
                    body = {k: v for k, v in job.entry["body"].items() if k != "model"}
                    async with gate:
                        while True:
                            response = await client.post(job.entry["url"], json=body)
                            if response.status_code != 429:
                                break
                            await asyncio.sleep(float(response.headers.get("retry-after", 1)))
                    answer = response.json()
                    if response.status_code == 200:
                        line = json.dumps(record(job.id, 200, answer), ensure_ascii=False) + "\n"
                        out.write(line.encode("utf-8"))
                        out.flush()
                        os.fsync(out.fileno())  # a result on disk survives a kill
                        usage = answer.get("usage") or {}  # (a response's names its counts so)
                        totals.done += 1
                        totals.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
                        totals.completion_tokens += usage.get("completion_tokens",
                                                              usage.get("output_tokens", 0))
                    else:
                        error = answer.get("error", {}).get("message", response.text)
                        report(job.line, f"custom_id {job.id!r} failed ({response.status_code}): {error}")
                        totals.failed += 1
                    bar.update(1)

                await asyncio.gather(*(one(job) for job in jobs))
    return totals
