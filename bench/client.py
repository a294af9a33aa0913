"""A streaming client for any OpenAI-compatible endpoint, recording what a client can observe.

    target = Target(base_url="http://127.0.0.1:8000/v1", model="smollm2-135m")
    result = RequestResult.start(spec, t0)          # spec: a workload.RequestSpec
    async with target.http() as http:
        await stream_into(result, http, target, spec, t0)

Each request goes to `/v1/chat/completions` (or `/v1/completions`) with `stream: true`,
`stream_options.include_usage` and vLLM's `continuous_usage_stats`. For every Server-Sent Event that carries output text it records
the arrival time (time.perf_counter(), seconds from the run's t0) and the text. Token counts
come from the last `usage` object the server sends (the final usage chunk, or the last of the
cumulative per-chunk usages some servers send); usage is never summed and never re-derived by
tokenizing. The number of tokens in each message is known exactly when the server reports
cumulative usage per message or when there is one message per output token; otherwise it is
estimated (`tokens_basis` says which), and every figure built on it is labelled an estimate.

Non-goals: retries (a refused or failed request is a data point), non-streaming requests.
Imports only the standard library and httpx: it must work against any server, not only cadence.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import httpx

from cadence.bench.workload import RequestSpec, approx_tokens


@dataclasses.dataclass(frozen=True)
class Target:
    base_url: str  # ends in /v1, as for the openai client
    model: str
    api_key: str | None = None
    endpoint: str = "chat"  # "chat": /chat/completions; "completions": /completions
    ignore_eos: bool = True  # a vLLM/cadence extension: exact output lengths; hosted APIs reject it
    temperature: float = 0.0
    timeout_s: float = 900.0
    # Server-specific fields added to every request, e.g. {"cache_prompt": false} for
    # llama.cpp's llama-server, so that neither server reuses a prompt's KV.
    extra_body: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")

    @property
    def root(self) -> str:
        """The server root (health, metrics, cadence's timeline): base_url without /v1."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200),
            headers=self.headers(),
        )

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": spec.max_tokens, "temperature": self.temperature,
            # continuous_usage_stats (vLLM's, and cadence's): usage on every chunk, so each
            # message's tokens are counted, not estimated; other servers ignore it.
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.endpoint == "chat":
            turns = spec.messages or (("user", spec.prompt),)
            body["messages"] = [{"role": role, "content": content} for role, content in turns]
        else:
            body["prompt"] = spec.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


@dataclasses.dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds from the run's t0."""

    id: str
    cls: str
    approx_prompt_tokens: int
    max_tokens: int
    sent: float
    scheduled: float | None = None  # open loop: the planned arrival time
    status: int | None = None
    error: str | None = None
    rejected: bool = False  # refused for load (HTTP 429)
    incomplete: bool = False  # still running when the run ended; cancelled
    message_times: list[float] = dataclasses.field(default_factory=list)  # messages with output text
    message_texts: list[str] = dataclasses.field(default_factory=list)
    message_usage: list[int | None] = dataclasses.field(default_factory=list)  # cumulative, if sent
    usage: dict | None = None  # the last usage object received
    timings: dict | None = None  # llama.cpp's llama-server: its last `timings` object
    finish_reason: str | None = None
    done: float | None = None
    server: dict | None = None  # cadence's own record of this request, joined after the run

    @classmethod
    def start(cls, spec: RequestSpec, t0: float, scheduled: float | None = None) -> RequestResult:
        return cls(spec.id, spec.cls, spec.approx_prompt_tokens, spec.max_tokens,
                   time.perf_counter() - t0, scheduled)

    @classmethod
    def from_dict(cls, d: dict) -> RequestResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(ok=self.ok, output_tokens=self.output_tokens, prompt_tokens=self.prompt_tokens,
                 tokens_basis=self.tokens_basis, message_tokens=self.message_tokens())
        return d

    # -- derived ------------------------------------------------------------------------------

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and not self.incomplete and self.done is not None

    @property
    def ttft(self) -> float | None:
        return self.message_times[0] - self.sent if self.message_times else None

    @property
    def prompt_tokens(self) -> int | None:
        return None if self.usage is None else self.usage.get("prompt_tokens")

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the server says it did not compute: OpenAI's `prompt_tokens_details.
        cached_tokens`, else llama.cpp's `timings.cache_n`."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            return int(details["cached_tokens"])
        return int((self.timings or {}).get("cache_n") or 0)

    @property
    def output_tokens(self) -> int | None:
        """Output tokens from usage; None when the server sent no usage."""
        return None if self.usage is None else self.usage.get("completion_tokens")

    @property
    def tokens_basis(self) -> str:
        n = len(self.message_times)
        if self.output_tokens is None:
            return "no-usage: one token per message assumed (estimate)"
        if n and all(u is not None for u in self.message_usage):
            return "exact: cumulative usage per message"
        if self.output_tokens == n:
            return "exact: one token per message"
        return "estimate: tokens spread over messages by text length"

    @property
    def tokens_exact(self) -> bool:
        return self.tokens_basis.startswith("exact")

    def message_tokens(self) -> list[int]:
        """Tokens carried by each message: exact when `tokens_exact`, else an estimate."""
        n = len(self.message_times)
        basis = self.tokens_basis
        if basis.startswith("exact: cumulative"):
            counts, previous = [], 0
            for u in self.message_usage:
                counts.append(max(0, u - previous))
                previous = u
            return counts
        if basis.startswith(("exact: one", "no-usage")) or n == 0:
            return [1] * n
        return _spread(self.output_tokens, [approx_tokens(t) for t in self.message_texts])


def _spread(total: int, weights: list[int]) -> list[int]:
    """`total` split over messages in proportion to `weights`, each at least one when possible
    (largest remainders), summing to `total` exactly."""
    n = len(weights)
    if total <= n:
        return [1] * total + [0] * (n - total)
    extra = total - n
    shares = [extra * w / sum(weights) for w in weights]
    counts = [1 + int(s) for s in shares]
    order = sorted(range(n), key=lambda i: int(shares[i]) - shares[i])
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


async def stream_into(result: RequestResult, http: httpx.AsyncClient, target: Target,
                      spec: RequestSpec, t0: float) -> RequestResult:
    """Sends one streaming request and fills `result` as messages arrive. Never raises for
    HTTP or protocol errors (they are recorded); cancellation propagates."""
    headers = {"X-Request-Id": spec.id}
    try:
        async with http.stream("POST", target.url, json=target.body(spec), headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                result.rejected = response.status_code == 429
                result.error = f"HTTP {response.status_code}: {_error_message(response.content)}"
                result.done = time.perf_counter() - t0
                return result
            data: list[str] = []
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].lstrip(" "))
                    continue
                if line or not data:
                    continue  # comments, event names, keep-alives
                payload, data = "\n".join(data), []
                if payload.strip() == "[DONE]":
                    break
                _on_message(result, json.loads(payload), time.perf_counter() - t0)
            if data and data[-1].strip() not in ("", "[DONE]"):  # a last event without its blank line
                _on_message(result, json.loads("\n".join(data)), time.perf_counter() - t0)
            result.done = time.perf_counter() - t0
            if not result.message_times and result.usage is None and result.error is None:
                result.error = "the stream ended without output or usage"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        result.done = time.perf_counter() - t0
    return result


def _on_message(result: RequestResult, message: dict, now: float) -> None:
    if "error" in message:
        error = message["error"]
        result.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return
    usage = message.get("usage")
    if usage:
        result.usage = usage  # the latest wins: cumulative usages are never summed
    if message.get("timings"):
        result.timings = message["timings"]
    for choice in message.get("choices") or []:
        if "delta" in choice:
            delta = choice.get("delta") or {}
            text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text = choice.get("text") or ""
        if text:
            result.message_times.append(now)
            result.message_texts.append(text)
            result.message_usage.append(usage.get("completion_tokens") if usage else None)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


def _error_message(content: bytes) -> str:
    try:
        body = json.loads(content)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return content[:200].decode(errors="replace")
