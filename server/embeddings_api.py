"""Embeddings: POST /v1/embeddings (OpenAI's and vLLM's shape) and llama-server's POST /embedding.

    POST /v1/embeddings {"input": ["a text", "another"], "encoding_format": "float"}
    POST /embedding     {"content": "a text", "embd_normalize": 2}

Each input is prefilled as a request that generates nothing (`GenerationParams.pooling`): its
chunks share iterations with everyone else's prefill and decode, under the same policy and
priorities, and the final hidden states (the output of the model's last norm) are pooled as
the server's `--pooling` says: "last", the last token's (vLLM's default for a decoder, and what
embedding models of this family are trained for), or "mean", over every token. The vector is
then normalized: by default to unit length (OpenAI's; vLLM's `normalize`, llama-server's
`embd_normalize`, which also takes its other norms, `normalized`).

Inputs are strings, arrays of token ids, or a batch of either; strings are tokenized as a
completion's prompt is (the model's BOS first, where it takes one). A batch larger than the
queue has room for is submitted as room frees: at most twice the engine's slots of its inputs
wait or run at a time (enough to keep every slot busy, while the queue keeps room for other
clients), and only when none of its own is left in flight does a full queue refuse it (429). vLLM's
`truncate_prompt_tokens` keeps each input's last k tokens; without it, an input past the
context is refused, as every prompt is. OpenAI's `dimensions` is accepted only as the model's
hidden size (no Matryoshka truncation), `user` is accepted and changes nothing.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cadence.scheduler.errors import Overloaded, SubmissionError
from cadence.scheduler.request import GenerationParams, RequestRecord
from cadence.scheduler.stream import RequestStream
from cadence.server import parsing, protocol
from cadence.server.api_error import APIError

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit)
_OPENAI = frozenset({"model", "input", "encoding_format", "dimensions", "user", "normalize",
                     "truncate_prompt_tokens", "priority", "add_special_tokens"})
_LLAMA = frozenset({"model", "content", "input", "embd_normalize"})


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: list[str | list[int]]
    norm: float  # llama-server's embd_normalize: -1 none, 0 max-abs to int16, 1 taxicab, 2 euclidean, p
    base64: bool = False
    truncate: int | None = None  # keep each input's last this many tokens
    priority: int | None = None
    add_special: bool = True  # strings get the model's BOS, where it takes one
    field: str = "input"  # the request's field that held the inputs (what a 400 names)


def _inputs(value: Any, name: str) -> list[str | list[int]]:
    inputs = protocol.prompts_of(value, name, MAX_INPUTS)
    if any(v == "" for v in inputs):
        raise SubmissionError(f'"{name}" holds an empty string, which has nothing to embed', name)
    return inputs


def parse_openai(body: Any, hidden_size: int) -> EmbeddingRequest:
    """/v1/embeddings' body, or SubmissionError."""
    protocol.known_fields(body, _OPENAI)
    fmt = parsing.field(body, "encoding_format", (str,), "float")
    if fmt not in ("float", "base64"):
        raise SubmissionError(f'"encoding_format" must be "float" or "base64", got {fmt!r}',
                              "encoding_format")
    dimensions = parsing.field(body, "dimensions", (int,))
    if dimensions is not None and dimensions != hidden_size:
        raise SubmissionError(f'"dimensions" must be the model\'s {hidden_size}: cadence does not '
                              f"shorten embeddings (got {dimensions})", "dimensions")
    parsing.field(body, "user", (str,))
    truncate = parsing.truncation(body)
    normalize = parsing.field(body, "normalize", (bool,), True)
    return EmbeddingRequest(parsing.field(body, "model", (str,)), _inputs(body.get("input"), "input"),
                            2.0 if normalize else -1.0, fmt == "base64", truncate,
                            parsing.field(body, "priority", (int,)),
                            parsing.field(body, "add_special_tokens", (bool,), True))


def parse_llama(body: Any) -> EmbeddingRequest:
    """/embedding's body (llama-server's: `content`, or `input`), or SubmissionError."""
    protocol.known_fields(body, _LLAMA)
    if "content" in body and "input" in body:
        raise SubmissionError('send the inputs in one of "content" or "input", not both', "input")
    name = "content" if body.get("content") is not None else "input"
    norm = parsing.field(body, "embd_normalize", (int,), 2)
    if norm < -1:
        raise SubmissionError(f'"embd_normalize" must be -1 (none), 0 (max absolute, to int16), 1 '
                              f"(taxicab), 2 (euclidean) or more (a p-norm), got {norm}",
                              "embd_normalize")
    return EmbeddingRequest(parsing.field(body, "model", (str,)), _inputs(body.get(name), name),
                            float(norm), field=name)


def normalized(vector: np.ndarray, norm: float) -> np.ndarray:
    """llama.cpp's `common_embd_normalize`: -1 leaves it, 0 scales its largest magnitude to
    32760 (int16's range), 1 and 2 divide by the taxicab and euclidean norms, p > 2 by the
    p-norm. A zero vector stays zero. In float64, returned as float32."""
    x = np.asarray(vector, np.float64)
    if norm < 0:
        return x.astype(np.float32)
    if norm == 0:
        scale = np.abs(x).max() / 32760.0
    elif norm == 2:
        scale = np.sqrt(np.sum(x * x))
    else:  # the largest magnitude taken out first: a large p neither overflows nor underflows to 0
        top = np.abs(x).max()
        scale = top * np.sum((np.abs(x) / top) ** norm) ** (1.0 / norm) if top > 0 else 0.0
    return (x / scale if scale > 0 else x).astype(np.float32)


def encoded(vector: np.ndarray, as_base64: bool) -> list[float] | str:
    """OpenAI's encodings: a list of floats, or base64 of the little-endian float32 bytes (what
    the openai SDK asks for by default, and decodes)."""
    if as_base64:
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()


class EmbeddingsAPI:
    """The embedding routes, over a `server.app.Server` (its scheduler, tokenizer, checks)."""

    def __init__(self, server):
        self.server = server

    def routes(self, route: Callable[[str, Any, list[str]], Route]) -> list[Route]:
        return [route("/v1/embeddings", self.openai, ["POST"]),
                *(route(path, self.llama, ["POST"]) for path in ("/embedding", "/embeddings"))]

    async def openai(self, request: Request) -> Response:
        server = self.server
        body = await server.read_body(request)
        with protocol.submission_errors(prompt="input"):
            parsed = parse_openai(body, server.scheduler.engine.model_config.hidden_size)
        server.models.check_base(parsed.model)
        request_id = protocol.request_id(request.headers, "embd")
        records = await self.embed(request, parsed, request_id)
        tokens = sum(r.prompt_tokens for r in records)
        return JSONResponse({
            "id": request_id, "object": "list", "created": int(time.time()),
            "model": server.model_name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encoded(normalized(r.embedding, parsed.norm), parsed.base64)}
                     for i, r in enumerate(records)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }, headers={"X-Request-Id": request_id})

    async def llama(self, request: Request) -> Response:
        """llama-server's shape: one entry per input, its pooled vector inside a list (where
        llama-server, pooling nothing, would list one vector per token)."""
        server = self.server
        body = await server.read_body(request)
        with protocol.submission_errors(prompt="content"):
            parsed = parse_llama(body)
        server.models.check_base(parsed.model)
        request_id = protocol.request_id(request.headers, "embd")
        records = await self.embed(request, parsed, request_id)
        return JSONResponse([{"index": i, "embedding": [normalized(r.embedding, parsed.norm).tolist()]}
                             for i, r in enumerate(records)], headers={"X-Request-Id": request_id})

    def _tokenize(self, parsed: EmbeddingRequest) -> list[list[int]]:
        """On a worker thread: each input's token ids (cut to their last `truncate`)."""
        server = self.server
        return [parsing.embedding_ids(text, server.tokenizer, server.scheduler.max_seq_len,
                                      parsed.add_special, keep=parsed.truncate)
                for text in parsed.inputs]

    async def embed(self, request: Request, parsed: EmbeddingRequest, request_id: str,
                    pooling: str | None = None) -> list[RequestRecord]:
        """Every input's finished record, in order. Input k's request id is the request's for
        k = 0, else `-{k}` after it. At most `window` of its inputs are submitted at a time
        (twice the engine's slots: enough to keep every slot busy, while the queue keeps room
        for other clients), and a full queue is waited out while its own inputs run. `pooling`:
        how the hidden states are pooled, if not as the server's `--pooling` says. A failed
        input fails the whole request (500), a cancelled one (the server shutting down) gives a
        503, and a client that hangs up cancels what is running and stops the rest."""
        scheduler = self.server.scheduler
        params = GenerationParams(pooling=pooling or self.server.config.pooling, priority=parsed.priority)
        window = 2 * scheduler.engine.config.num_slots
        streams: list[RequestStream] = []
        running: dict[asyncio.Future, int] = {}
        records: list[RequestRecord | None] = [None] * len(parsed.inputs)

        async def finish_one() -> None:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                records[running.pop(future)] = future.result()

        async def drain(stream: RequestStream) -> RequestRecord:
            async for _ in stream:
                pass
            return stream.record

        def ended() -> bool:  # nothing more to submit: the client left, or an input failed
            return watcher.done() or any(r is not None and r.finish_reason != "stop" for r in records)

        watcher = asyncio.create_task(protocol.cancel_on_disconnect(request, streams))
        try:
            with protocol.submission_errors(prompt=parsed.field, length=parsed.field):
                prompts = await asyncio.to_thread(self._tokenize, parsed)
                for k, ids in enumerate(prompts):
                    while len(running) >= window:
                        await finish_one()
                    if ended():
                        break
                    while True:
                        try:
                            stream = scheduler.submit(ids, params, request_id if k == 0 else f"{request_id}-{k}")
                            break
                        except Overloaded:
                            if not running:  # none of its own to make room: the queue is others'
                                raise
                            await finish_one()
                    streams.append(stream)
                    running[asyncio.ensure_future(drain(stream))] = k
            while running:
                await finish_one()
        finally:
            watcher.cancel()
            for stream in streams:
                if stream.record is None:  # a failure, or the client went away
                    stream.cancel()
            for future in running:
                future.cancel()
        failed = next((r for r in records if r is not None and r.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"embedding failed: {failed.error}", type="server_error")
        if any(r is None or r.finish_reason != "stop" for r in records):
            raise APIError(503, "the embedding was cancelled: the server is shutting down, or the "
                                "client went away", type="service_unavailable")
        return records
