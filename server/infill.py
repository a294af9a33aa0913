"""POST /infill: llama-server's fill-in-the-middle endpoint, for code editors' completion.

    {"input_prefix": "def add(a, b):\\n    ", "input_suffix": "\\n\\nprint(add(1, 2))\\n",
     "input_extra": [{"filename": "util.py", "text": "..."}], "prompt": "", "n_predict": 64}

The model writes what goes between `input_prefix` (then `prompt`, the start of the middle) and
`input_suffix`, with the repository's other files (`input_extra`) as context, in the layout of
`checkpoints.fim`, which is llama-server's, so the same request gives the same prompt tokens on
both. The answer is in llama-server's own (not OpenAI's) shape: `content`, `stop_type`
("eos", "word" or "limit"), `tokens_predicted`, `tokens_evaluated`, `timings`, ...; streamed,
each chunk is a `data:` line with its `content` and `"stop": false`, and the last has
`"stop": true` with the totals (no `[DONE]`, as there).

Sampling fields are cadence's, as on /v1/completions (`temperature`, `top_k`, `top_p`, `min_p`,
`seed`, `stop`, `ignore_eos`), with llama-server's `n_predict` (-1 or absent: up to the end of
the context) for `max_tokens`. llama-server's `cache_prompt` is accepted (cadence's prefix cache
never changes an answer); fields cadence does not do (its `samplers` order, its windowed
penalties, time limits) are refused by name rather than ignored. Unlike llama-server, a prefix or
suffix too long for its batch is not cut: a prompt past the context is refused, as every prompt is.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cadence.checkpoints import fim
from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.request import RequestRecord, TokenEvent
from cadence.scheduler.scheduler import RequestStream
from cadence.server import parsing, protocol
from cadence.server.protocol import APIError

_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos")
_ALLOWED = frozenset({"input_prefix", "input_suffix", "input_extra", "prompt", "model", "stream",
                      "n_predict", "max_tokens", "cache_prompt", "return_tokens", *_SAMPLING})


def parse(body: Any, defaults: parsing.SamplingDefaults) -> protocol.ParsedRequest:
    """/infill's body into a completion of its prefix with a `fim.Hole`, or SubmissionError."""
    protocol._known(body, _ALLOWED)
    prefix = parsing.field(body, "input_prefix", (str,))
    suffix = parsing.field(body, "input_suffix", (str,))
    for name, value in (("input_prefix", prefix), ("input_suffix", suffix)):
        if value is None:
            raise SubmissionError(f'"{name}" is required (a string, may be empty)', name)
    extra = []
    for chunk in parsing.field(body, "input_extra", (list,), []):
        if (not isinstance(chunk, dict) or set(chunk) - {"text", "filename"}
                or not isinstance(chunk.get("text"), str)
                or not isinstance(chunk.get("filename", ""), str)):
            raise SubmissionError('"input_extra" must be an array of {"text": string, '
                                  '"filename": string (optional)}', "input_extra")
        extra.append(fim.ExtraFile(chunk["text"], chunk.get("filename", "tmp")))
    parsing.field(body, "cache_prompt", (bool,))
    limit = parsing.field(body, "n_predict", (int,))
    if limit is not None and limit < -1:
        raise SubmissionError(f'"n_predict" must be -1 (no limit) or more, got {limit}', "n_predict")
    if limit == 0:
        raise SubmissionError('"n_predict" must be -1 (no limit) or at least 1, got 0', "n_predict")
    given = parsing.field(body, "max_tokens", (int,))  # llama-server's alias; n_predict wins
    if given is not None and given < 1:
        raise SubmissionError(f'"max_tokens" must be >= 1, got {given}', "max_tokens")
    entry = {name: body.get(name) for name in _SAMPLING}
    entry["max_tokens"] = given if limit is None else (None if limit == -1 else limit)
    if entry["seed"] == -1:  # llama-server's "any seed": the server's default
        entry["seed"] = None
    params = parsing.generation_params(entry, dataclasses.replace(defaults, max_tokens=None))
    return protocol.ParsedRequest(
        model=parsing.field(body, "model", (str,)), prompts=[prefix], messages=None,
        params=params, stream=parsing.field(body, "stream", (bool,), False), include_usage=False,
        hole=fim.Hole(suffix, parsing.field(body, "prompt", (str,), ""), tuple(extra)))


class InfillAPI:
    def __init__(self, server: Any):  # server.app.Server
        self.server = server

    def routes(self, route: Callable[[str, Any, list[str]], Route]) -> list[Route]:
        return [route("/infill", self.infill, ["POST"])]

    async def infill(self, request: Request) -> Response:
        server = self.server
        body = await server.read_body(request)
        try:
            parsed = parse(body, server.defaults)
            with_ids = parsing.field(body, "return_tokens", (bool,), False)
        except SubmissionError as e:
            raise APIError(400, str(e), param=e.param) from None
        server.check_model(parsed.model)
        request_id = server.request_id(request, "infill")
        stream, = (await server.submit(parsed, request_id))[0]
        headers = {"X-Request-Id": request_id}
        if parsed.stream:
            return StreamingResponse(self._chunks(stream), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        record, = await server.collect(request, [stream])
        if record.finish_reason == "error":
            raise APIError(500, f"generation failed: {record.error}", type="server_error")
        content = self.final(stream, record, with_ids)
        return JSONResponse(content, headers=headers)

    def final(self, stream: RequestStream, record: RequestRecord, with_ids: bool,
              content: str | None = None) -> dict[str, Any]:
        """The whole answer, or a stream's last chunk (`content` ""), in llama-server's shape."""
        ids = stream.request.output_ids
        text = record.text if content is None else content
        return {"index": 0, "content": text, "tokens": list(ids) if with_ids else [],
                "id_slot": -1, "stop": True, "model": self.server.model_name,
                "tokens_predicted": record.output_tokens, "tokens_evaluated": record.prompt_tokens,
                "has_new_line": "\n" in record.text, "truncated": False,
                "stop_type": stop_type(record), "stopping_word": record.stop_reason if isinstance(record.stop_reason, str) else "",
                "tokens_cached": record.prompt_tokens + record.output_tokens,
                "timings": timings(record)}

    async def _chunks(self, stream: RequestStream) -> AsyncIterator[str]:
        """A chunk per step (its text may be empty, held back for a stop string, as there),
        then the totals. Token ids go in every chunk, as llama-server sends them."""
        predicted, evaluated = 0, len(stream.request.prompt_ids)
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    predicted += len(event.token_ids)
                    yield _frame({"index": 0, "content": event.text, "tokens": event.token_ids,
                                  "stop": False, "id_slot": -1, "tokens_predicted": predicted,
                                  "tokens_evaluated": evaluated})
                elif event.finish_reason == "error":
                    yield _frame(APIError(500, f"generation failed: {event.error}",
                                          type="server_error").body())
                else:
                    yield _frame(self.final(stream, event, with_ids=False, content=""))
        finally:
            if stream.record is None:  # the client went away mid-stream
                stream.cancel()


def _frame(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stop_type(record: RequestRecord) -> str:
    """llama-server's reason: "limit" (n_predict or the context), "word" (a stop string), or
    "eos" (the model ended, or its grammar did)."""
    if record.finish_reason == "length":
        return "limit"
    return "word" if isinstance(record.stop_reason, str) else "eos"


def timings(record: RequestRecord) -> dict[str, float | int]:
    """llama-server's `timings`: the prompt's tokens computed (the cached ones not) and the
    time to the first token since admission; the tokens generated and the time after it."""
    start = record.admitted if record.admitted is not None else record.submitted
    first = record.first_token if record.first_token is not None else record.finished
    prompt_n = record.prompt_tokens - record.cached_tokens
    prompt_ms, predicted_ms = (first - start) * 1e3, (record.finished - first) * 1e3
    predicted_n = record.output_tokens

    def rates(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (n * 1e3 / ms if ms > 0 else 0.0)

    prompt_per_token, prompt_per_second = rates(prompt_n, prompt_ms)
    predicted_per_token, predicted_per_second = rates(predicted_n, predicted_ms)
    return {"cache_n": record.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token,
            "predicted_per_second": predicted_per_second}
