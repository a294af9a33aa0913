"""The OpenAI-compatible HTTP front door: a thin Starlette layer over the scheduler.

    app = create_app(scheduler, tokenizer, model_name="smollm2-135m", warmup=engine.warmup)

Routes: POST /v1/completions, POST /v1/chat/completions (each streaming over Server-Sent Events
or not), GET /v1/models, GET /health (200 only once warm-up is done), GET /metrics (Prometheus),
GET /debug/timeline (the scheduler's iteration log and finished requests' timelines, read
incrementally by `bench/` to explain client-side figures).
All model and policy logic lives below this layer: the app tokenizes, submits, and relays
events. A client that disconnects cancels its request, which frees its KV slot at the next
iteration. On shutdown (uvicorn's SIGTERM handling) in-flight requests are drained first.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from absl import logging
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from checkpoints.tokenizer import Tokenizer, TokenizerError
from scheduler.errors import NotRunning, Overloaded, RequestTooLong, SubmissionError
from scheduler.request import RequestRecord, TokenEvent
from scheduler.scheduler import IterationRecord, RequestStream, Scheduler
from server import protocol
from server.metrics import Metrics
from server.protocol import APIError


class Timeline:
    """Rings of the scheduler's iteration records and finished requests' records, read
    incrementally by cursor (iteration index, request sequence number). Times are the server's
    time.monotonic(); the response carries `now` so a client can estimate the clock offset."""

    def __init__(self, scheduler: Scheduler, iterations: int = 20_000, requests: int = 2_048):
        # Readers poll about once a second, so the rings only bound memory (a request record
        # holds a timestamp per output token).
        self._lock = threading.Lock()
        self._iterations: collections.deque[IterationRecord] = collections.deque(maxlen=iterations)
        self._requests: collections.deque[tuple[int, RequestRecord]] = collections.deque(maxlen=requests)
        self._seq = 0
        scheduler.iteration_listeners.append(self._on_iteration)
        scheduler.listeners.append(self._on_request)

    def _on_iteration(self, record: IterationRecord) -> None:  # scheduler thread
        with self._lock:
            self._iterations.append(record)

    def _on_request(self, record: RequestRecord) -> None:  # scheduler thread
        with self._lock:
            self._seq += 1
            self._requests.append((self._seq, record))

    def since(self, iteration: int, request: int) -> dict:
        with self._lock:
            iterations = [r for r in self._iterations if r.index > iteration]
            requests = [(seq, r) for seq, r in self._requests if seq > request]
            seq = self._seq
        return {
            "iterations": [dataclasses.asdict(r) for r in iterations],
            "requests": [{**dataclasses.asdict(r, dict_factory=_without_text), "seq": s} for s, r in requests],
            "next_request": seq,
        }


def _without_text(items: list[tuple[str, object]]) -> dict:
    return {k: v for k, v in items if k != "text"}  # the client has the text already


class Server:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, model_name: str,
                 api_key: str | None = None, warmup: Callable[[], None] | None = None,
                 drain_timeout: float = 30.0):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = Metrics(scheduler, model_name)
        self.timeline = Timeline(scheduler)
        self.ready = threading.Event()
        self._warmup = warmup
        self.drain_timeout = drain_timeout
        self.created = int(time.time())

    # -- lifecycle ----------------------------------------------------------------------------

    @asynccontextmanager
    async def lifespan(self, app: Starlette):
        self.scheduler.start()
        warm = asyncio.get_running_loop().run_in_executor(None, self._warm)
        try:
            yield
        finally:
            self.ready.clear()
            await warm
            # Drain: whatever is queued or running finishes; nothing new is accepted.
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.scheduler.stop(drain=True, timeout=self.drain_timeout)
            )

    def _warm(self) -> None:
        if self._warmup is not None:
            self._warmup()
        self.ready.set()
        logging.info("cadence is ready")

    # -- plumbing -----------------------------------------------------------------------------

    def _check(self, request: Request) -> None:
        if self.api_key is not None:
            header = request.headers.get("authorization", "")
            if header != f"Bearer {self.api_key}":
                raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                               type="authentication_error", code="invalid_api_key")
        if not self.ready.is_set():
            raise APIError(503, "the server is warming up or shutting down; retry shortly",
                           type="service_unavailable", headers={"Retry-After": "5"})

    def _submit(self, parsed: protocol.ParsedRequest, request_id: str) -> RequestStream:
        try:
            if parsed.messages is not None:
                text = self.tokenizer.apply_chat_template(parsed.messages)
                ids = self.tokenizer.encode(text)
            elif parsed.prompt_text is not None:
                ids = self.tokenizer.encode(parsed.prompt_text)
            else:
                ids = parsed.prompt_ids
            return self.scheduler.submit(ids, parsed.params, request_id=request_id)
        except RequestTooLong as e:
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        except (SubmissionError, TokenizerError) as e:
            raise APIError(400, str(e)) from None
        except Overloaded as e:
            raise APIError(429, str(e), type="rate_limit_error", headers={"Retry-After": "1"}) from None
        except NotRunning as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    # -- routes -------------------------------------------------------------------------------

    async def generate(self, request: Request, chat: bool) -> Response:
        self._check(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        parsed = protocol.parse(body, chat)
        if parsed.model is not None and parsed.model != self.model_name:
            raise APIError(404, f"model '{parsed.model}' is not served here; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
        stream = self._submit(parsed, request_id)
        headers = {"X-Request-Id": request_id}
        if parsed.stream:
            frames = self._sse(stream, request_id, chat, parsed.include_usage)
            return StreamingResponse(frames, media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        record = await self._collect(request, stream)
        if record.finish_reason == "error":
            raise APIError(500, f"generation failed: {record.error}", type="server_error")
        return JSONResponse(protocol.full_response(request_id, self.model_name, chat, record),
                            headers=headers)

    async def _collect(self, request: Request, stream: RequestStream) -> RequestRecord:
        """Waits for the whole answer; a client that hangs up meanwhile cancels it."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            stream.cancel()

        watcher = asyncio.create_task(watch())
        try:
            async for _ in stream:
                pass
            return stream.record
        finally:
            watcher.cancel()

    async def _sse(self, stream: RequestStream, request_id: str, chat: bool,
                   include_usage: bool) -> AsyncIterator[str]:
        created, first, name = int(time.time()), True, self.model_name
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    if event.text or (chat and first):
                        yield _frame(protocol.chunk(request_id, name, chat, event.text, None, created, first))
                        first = False
                    continue
                if event.finish_reason == "error":
                    error = APIError(500, f"generation failed: {event.error}", type="server_error")
                    yield _frame(error.body())
                else:
                    reason = protocol.finish_reason(event)
                    yield _frame(protocol.chunk(request_id, name, chat, None if chat else "", reason, created))
                    if include_usage:
                        yield _frame(protocol.usage_chunk(request_id, name, chat, event, created))
                yield "data: [DONE]\n\n"
        finally:
            if stream.record is None:  # the client went away mid-stream
                stream.cancel()

    async def models(self, request: Request) -> Response:
        self._check(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "cadence",
             "max_model_len": self.scheduler.max_seq_len}]})

    async def health(self, request: Request) -> Response:
        if self.ready.is_set():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "warming up"}, status_code=503)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def timeline_endpoint(self, request: Request) -> Response:
        """GET /debug/timeline?since_iteration=I&since_request=R: records newer than the cursors."""
        self._check(request)
        try:
            iteration = int(request.query_params.get("since_iteration", -1))
            seq = int(request.query_params.get("since_request", 0))
        except ValueError:
            raise APIError(400, "since_iteration and since_request must be integers") from None
        sched = self.scheduler
        return JSONResponse({
            "clock": "time.monotonic", "now": time.monotonic(),
            "num_slots": sched.num_slots, "max_seq_len": sched.max_seq_len,
            "policy": dataclasses.asdict(sched.config.policy),
            "num_running": sched.num_running, "num_waiting": sched.num_waiting,
            "kv_cache_usage": sched.kv_usage, "kv_cache_bytes": sched.engine.kv_cache_bytes,
            **self.timeline.since(iteration, seq),
        })


def _frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(scheduler: Scheduler, tokenizer: Tokenizer, model_name: str, *,
               api_key: str | None = None, warmup: Callable[[], None] | None = None) -> Starlette:
    server = Server(scheduler, tokenizer, model_name, api_key=api_key, warmup=warmup)

    def route(path: str, handler, methods: list[str]) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            except Exception as e:  # never let one request's bug take the server down
                logging.exception("unhandled error on %s", path)
                error = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
                return JSONResponse(error.body(), status_code=500)

        return Route(path, endpoint, methods=methods)

    app = Starlette(
        routes=[
            route("/v1/completions", lambda r: server.generate(r, chat=False), ["POST"]),
            route("/v1/chat/completions", lambda r: server.generate(r, chat=True), ["POST"]),
            route("/v1/models", server.models, ["GET"]),
            route("/health", server.health, ["GET"]),
            route("/metrics", server.metrics_endpoint, ["GET"]),
            route("/debug/timeline", server.timeline_endpoint, ["GET"]),
        ],
        lifespan=server.lifespan,
    )
    app.state.server = server
    return app
