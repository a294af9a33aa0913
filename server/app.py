"""The OpenAI-compatible HTTP front door: a thin Starlette layer over the scheduler.

    app = create_app(scheduler, tokenizer, model_name="smollm2-135m", warmup=engine.warmup)

Routes: POST /v1/completions, POST /v1/chat/completions (each streaming over Server-Sent Events
or not), GET /v1/models, GET /health (200 only while the engine is warm and alive), GET /metrics
(Prometheus, under cadence's names and the vLLM names routers read), GET /server_info,
GET /model_info and GET /get_load (what sglang-router asks a worker when it registers it and
when it balances load: see `Server.server_info`), GET /debug/timeline (the scheduler's iteration log and finished requests'
timelines, read incrementally by `bench/` to explain client-side figures), GET /openapi.json
(this API's description, `server/openapi.json`).
All model and policy logic lives below this layer: the app reads the body (refusing one over
`max_body_bytes` with 413 before buffering it), parses it (`server/requests.py`), tokenizes on a
worker thread so a long prompt never stalls the event loop, submits, and relays events. A client
that disconnects cancels its request, which frees its KV slot at the next iteration. On shutdown
(uvicorn's SIGTERM handling) in-flight requests are drained for up to `drain_timeout` seconds.

Failures are answered, never hung on: a warm-up that fails is logged and reported by /health
(and `on_fatal` is called, so `cadence-serve` exits); an engine that dies (`Scheduler.dead`)
makes every route answer 503 and /health 503 with the reason.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any
from contextlib import asynccontextmanager
from pathlib import Path

from absl import logging
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import cadence
from cadence.checkpoints.generation import GenerationDefaults
from cadence.checkpoints.tokenizer import Tokenizer, TokenizerError
from cadence.scheduler.errors import EngineDead, NotRunning, Overloaded, RequestTooLong, SubmissionError
from cadence.scheduler.grammar import Grammar, GrammarCompiler
from cadence.scheduler.request import RequestRecord, TokenEvent
from cadence.scheduler.scheduler import IterationRecord, RequestStream, Scheduler
from cadence.server import protocol, requests
from cadence.server.metrics import Metrics
from cadence.server.protocol import APIError
from cadence.server.tool_calls import ToolCallParser
from cadence.server.tools import ToolRequest

OPENAPI = Path(__file__).with_name("openapi.json")
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
MAX_REQUEST_ID = 256


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


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    max_n: int = protocol.DEFAULT_MAX_N  # most choices a request may ask for (n, best_of)
    protect_metrics: bool = False  # with an api_key, /metrics needs it too (/debug/timeline always does)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = 30.0  # seconds in-flight requests may take to finish on shutdown
    grammar_timeout: float = 10.0  # seconds a response format's grammar may take to compile


class Server:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, model_name: str,
                 config: ServerConfig = ServerConfig(), warmup: Callable[[], None] | None = None,
                 generation: GenerationDefaults = GenerationDefaults(),
                 on_fatal: Callable[[str], None] | None = None):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.config = config
        self.defaults = protocol.OPENAI_DEFAULTS.with_model(generation)
        self.metrics = Metrics(scheduler, model_name)
        self.timeline = Timeline(scheduler)
        self.ready = threading.Event()
        self.warmup_error: str | None = None
        self._warmup = warmup
        self._warm_thread: threading.Thread | None = None
        self._on_fatal = on_fatal
        self.created = int(time.time())
        # Response formats' and forced tool calls' grammars (`scheduler.grammar`).
        self.grammars = GrammarCompiler(tokenizer, scheduler.engine.vocab_size,
                                        timeout=config.grammar_timeout)

    # -- lifecycle ----------------------------------------------------------------------------

    @asynccontextmanager
    async def lifespan(self, app: Starlette):
        self.scheduler.start()
        # A daemon thread, not the loop's executor: a shutdown during warm-up must not wait
        # for compilation to finish (nothing can interrupt XLA's compiler).
        self._warm_thread = threading.Thread(target=self._warm, name="cadence-warmup", daemon=True)
        self._warm_thread.start()
        try:
            yield
        finally:
            self.ready.clear()
            if self.warming:
                logging.info("shutting down during warm-up; nothing was served")
                self.scheduler.stop(drain=False, timeout=1)
            else:
                # Drain: whatever is queued or running finishes; nothing new is accepted.
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.scheduler.stop(drain=True, timeout=self.config.drain_timeout))

    @property
    def warming(self) -> bool:
        return self._warm_thread is not None and self._warm_thread.is_alive()

    def _warm(self) -> None:
        try:
            if self._warmup is not None:
                self._warmup()
        except Exception as e:
            self.warmup_error = f"warm-up failed: {type(e).__name__}: {e}"
            logging.exception("cadence cannot serve: %s", self.warmup_error)
            if self._on_fatal is not None:
                self._on_fatal(self.warmup_error)
            return
        self.ready.set()
        logging.info("cadence is ready")

    @property
    def fatal(self) -> str | None:
        """Why this server can never serve again, or None."""
        if self.warmup_error is not None:
            return self.warmup_error
        if self.scheduler.dead is not None:
            return f"the engine is dead: {self.scheduler.dead}"
        return None

    # -- plumbing -----------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Constant-time comparison: response timing must not reveal how much of a key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.config.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    def _check(self, request: Request) -> None:
        self._authorize(request)
        fatal = self.fatal
        if fatal is not None:
            raise APIError(503, f"{fatal}; this server cannot serve until it is restarted",
                           type="service_unavailable", code="engine_dead")
        if not self.ready.is_set():
            raise APIError(503, "the server is warming up or shutting down; retry shortly",
                           type="service_unavailable", headers={"Retry-After": "5"})

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it exceeds the limit (never buffered)."""
        limit = self.config.max_body_bytes
        too_large = APIError(413, f"the request body exceeds {limit} bytes; send a shorter prompt",
                             code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise APIError(400, "invalid Content-Length")
            if int(declared) > limit:
                raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _prepare(self, parsed: protocol.ParsedRequest) -> tuple[list[int], Grammar | None]:
        """On a worker thread: chat rendering and tokenizing cost time in the prompt's length,
        and a grammar in its size (compiled on the compiler's threads, within its time limit)."""
        grammar = requests.grammar_of(parsed.response_format, parsed.tools, self.tokenizer,
                                      self.grammars)
        if parsed.prompt_ids is not None:
            return parsed.prompt_ids, grammar
        if parsed.messages is not None:
            text = requests.render_chat(parsed.messages, self.tokenizer, parsed.tools)
        else:
            text = parsed.prompt_text
        requests.check_prompt_size(text, self.tokenizer, self.scheduler.max_seq_len)
        return self.tokenizer.encode(text), grammar

    async def _submit(self, parsed: protocol.ParsedRequest, request_id: str) -> list[RequestStream]:
        """One stream per sequence generated (n, or best_of): choice i's request id is the
        request's, then `-i` for i > 0."""
        try:
            ids, grammar = await asyncio.to_thread(self._prepare, parsed)
            params = [dataclasses.replace(p, grammar=grammar) for p in parsed.choice_params()]
            names = [request_id] + [f"{request_id}-{i}" for i in range(1, len(params))]
            return self.scheduler.submit_group(ids, params, names)
        except RequestTooLong as e:
            raise APIError(400, str(e), param=e.param or "max_tokens", code="context_length_exceeded") from None
        except SubmissionError as e:
            raise APIError(400, str(e), param=e.param) from None
        except TokenizerError as e:
            raise APIError(400, str(e)) from None
        except Overloaded as e:
            raise APIError(429, str(e), type="rate_limit_error",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineDead as e:
            raise APIError(503, str(e), type="service_unavailable", code="engine_dead") from None
        except NotRunning as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    # -- routes -------------------------------------------------------------------------------

    async def generate(self, request: Request, chat: bool) -> Response:
        self._check(request)
        raw = await self._body(request)
        try:
            body = requests.load_json(raw)
        except SubmissionError as e:
            raise APIError(400, str(e)) from None
        parsed = protocol.parse(body, chat, self.defaults, self.config.max_n)
        if parsed.model is not None and parsed.model != self.model_name:
            raise APIError(404, f"model '{parsed.model}' is not served here; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
        if len(request_id) > MAX_REQUEST_ID:
            raise APIError(400, f"X-Request-Id is longer than {MAX_REQUEST_ID} characters")
        streams = await self._submit(parsed, request_id)
        headers = {"X-Request-Id": request_id}
        echo = protocol.Echo.of(self.tokenizer, streams[0].request.prompt_ids) if parsed.echo else None
        tools = parsed.tools if parsed.parses_tool_calls else None
        if parsed.stream:
            frames = self._sse(streams, request_id, chat, parsed.include_usage, echo, tools)
            return StreamingResponse(frames, media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        records = await self._collect(request, streams)
        failed = next((r for r in records if r.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"generation failed: {failed.error}", type="server_error")
        return JSONResponse(protocol.full_response(
            request_id, self.model_name, chat, protocol.best(records, parsed.n), self.tokenizer,
            logprobs=parsed.params.logprobs is not None, generated=records, echo=echo, tools=tools),
            headers=headers)

    async def _collect(self, request: Request, streams: list[RequestStream]) -> list[RequestRecord]:
        """Waits for the whole answer; a client that hangs up meanwhile cancels it."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for stream in streams:
                stream.cancel()

        async def drain(stream: RequestStream) -> RequestRecord:
            async for _ in stream:
                pass
            return stream.record

        watcher = asyncio.create_task(watch())
        try:
            return list(await asyncio.gather(*map(drain, streams)))
        finally:
            watcher.cancel()

    async def _sse(self, streams: list[RequestStream], request_id: str, chat: bool,
                   include_usage: bool, echo: protocol.Echo | None = None,
                   tools: ToolRequest | None = None) -> AsyncIterator[str]:
        """The streams' events as SSE frames, each choice's chunks under its index. Every event
        waiting when the loop gets to this request goes out in one write: when the loop runs
        behind the scheduler (many streams, a fast device), tokens are coalesced instead of
        each paying for a send. One choice failing ends the response with the error. With
        `echo` (completions), each choice's first chunk is the prompt. With `tools` (chat,
        calls parsed), each choice's text goes through its `ToolCallParser`: content as
        content, calls as `tool_calls` deltas, and "tool_calls" as the finish reason of an
        answer with calls that was not cut off."""
        created, name = int(time.time()), self.model_name
        first = [True] * len(streams)
        text_frames = [protocol.TextFrames(request_id, name, chat, created, i) for i in range(len(streams))]
        logprobs = [protocol.LogprobFormat(self.tokenizer, chat) for _ in streams]
        parsers = [ToolCallParser(tools.names) if tools else None for _ in streams]
        records: list[RequestRecord | None] = [None] * len(streams)
        try:
            async for batch in _merged(streams):
                frames = []
                for i, event in batch:
                    if echo is not None and first[i]:  # (the prompt's logprobs are the first choice's)
                        lp = (logprobs[i].prompt(echo, streams[0].request.prompt_logprobs)
                              if streams[i].request.logprobs is not None else None)
                        frames.append(protocol.frame(protocol.chunk(
                            request_id, name, chat, echo.text,
                            None, created, logprobs=lp, index=i)))
                        first[i] = False
                    if isinstance(event, TokenEvent):
                        text, calls = event.text, None
                        if parsers[i] is not None:
                            delta = parsers[i].feed(text)
                            text, calls = delta.content, delta.tool_calls
                        if (chat and first[i]) or event.logprobs is not None or calls:
                            # with logprobs, every token's chunk goes out, text or not
                            lp = None if event.logprobs is None else logprobs[i](event.logprobs)
                            frames.append(protocol.frame(protocol.chunk(
                                request_id, name, chat, text, None, created, first[i], lp, i, calls)))
                            first[i] = False
                        elif text:
                            frames.append(text_frames[i](text))
                        continue
                    records[i] = event
                    called = False
                    if parsers[i] is not None and event.finish_reason != "error":
                        delta = parsers[i].finish()  # what it held back, at the end
                        if delta.content or delta.tool_calls:
                            frames.append(protocol.frame(protocol.chunk(
                                request_id, name, chat, delta.content, None, created, first[i],
                                None, i, delta.tool_calls)))
                            first[i] = False
                        called = bool(parsers[i].calls)
                    reason = protocol.finish_reason(event, called)
                    if event.finish_reason == "error":
                        error = APIError(500, f"generation failed: {event.error}", type="server_error")
                        frames.append(protocol.frame(error.body()) + "data: [DONE]\n\n")
                        break
                    frames.append(protocol.frame(protocol.chunk(
                        request_id, name, chat, None if chat else "", reason, created, index=i)))
                    if all(r is not None for r in records):
                        if include_usage:
                            frames.append(protocol.frame(protocol.usage_chunk(
                                request_id, name, chat, records, created)))
                        frames.append("data: [DONE]\n\n")
                if frames:
                    yield "".join(frames)
                if any(r is not None and r.finish_reason == "error" for r in records):
                    break
        finally:
            for stream in streams:
                if stream.record is None:  # the client went away mid-stream, or a choice failed
                    stream.cancel()

    async def models(self, request: Request) -> Response:
        self._check(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "cadence",
             "max_model_len": self.scheduler.max_seq_len}]})

    # -- what a router asks a worker ------------------------------------------------------------
    # sglang-router (the SGLang Model Gateway) reads /server_info and /model_info when it
    # registers a worker (the model's name, parallelism, capacity; answered before warm-up
    # ends, as they do not change) and /get_load to balance on load, in SGLang's shapes.

    async def server_info(self, request: Request) -> Response:
        self._authorize(request)
        sched = self.scheduler
        tp = sched.engine.tp
        return JSONResponse({
            "model_path": self.model_name, "served_model_name": self.model_name,
            "tp_size": tp.mesh.size if tp else 1, "dp_size": 1, "version": f"cadence {cadence.__version__}",
            "max_running_requests": sched.num_slots, "max_total_tokens": sched.kv_pages[1] * sched.page_size,
            "max_prefill_tokens": sched.config.policy.chunk, "context_length": sched.max_seq_len})

    async def model_info(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"model_path": self.model_name, "tokenizer_path": self.model_name,
                             "is_generation": True, "model_type": "llama",
                             "architectures": ["LlamaForCausalLM"]})

    async def load(self, request: Request) -> Response:
        """One entry per data-parallel rank (cadence has one): requests held and waiting, and
        the tokens whose KV they hold."""
        self._authorize(request)
        sched = self.scheduler
        return JSONResponse([{"dp_rank": 0, "num_reqs": sched.num_running + sched.num_waiting,
                              "num_waiting_reqs": sched.num_waiting,
                              "num_tokens": sched.kv_tokens}])

    async def health(self, request: Request) -> Response:
        fatal = self.fatal
        if fatal is not None:
            return JSONResponse({"status": "dead", "error": fatal}, status_code=503)
        if self.ready.is_set():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "warming up"}, status_code=503)

    async def metrics_endpoint(self, request: Request) -> Response:
        if self.config.protect_metrics:
            self._authorize(request)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        return Response(OPENAPI.read_bytes(), media_type="application/json")

    async def timeline_endpoint(self, request: Request) -> Response:
        """GET /debug/timeline?since_iteration=I&since_request=R: records newer than the cursors."""
        self._authorize(request)
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
            "kv_cache_usage": sched.kv_usage, "kv_cache_bytes": sched.kv_cache_bytes,
            "kv_pages_used": sched.kv_pages[0], "kv_pages_total": sched.kv_pages[1],
            "kv_page_utilization": sched.kv_page_utilization, "num_preemptions": sched.preemptions,
            "disaggregated": sched.disaggregated, "kv_transfers": sched.kv_transfers,
            "kv_transfer_bytes": sched.kv_transfer_bytes, "transfer_backlog": sched.transfer_backlog,
            "pools": [{"name": p.name, "num_slots": p.num_slots, "running": len(p.running),
                       "kv_pages_used": p.pages.used_count, "kv_pages_total": p.pages.num_pages,
                       "busy_seconds": p.busy_seconds} for p in sched.pools],
            **self.timeline.since(iteration, seq),
        })


async def _merged(streams: list[RequestStream]) -> AsyncIterator[list[tuple[int, Any]]]:
    """The events of several streams as they come, each with its stream's index, until every
    one has its record. One stream is read directly (the common case pays for no task)."""
    if len(streams) == 1:
        while streams[0].record is None:
            yield [(0, e) for e in await streams[0].next_events()]
        return
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        while stream.record is None:
            arrived.put_nowait([(i, e) for e in await stream.next_events()])

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while not all(s.record is not None for s in streams) or not arrived.empty():
            yield await arrived.get()
    finally:
        for task in pumps:
            task.cancel()


def create_app(scheduler: Scheduler, tokenizer: Tokenizer, model_name: str, *,
               config: ServerConfig = ServerConfig(), warmup: Callable[[], None] | None = None,
               generation: GenerationDefaults = GenerationDefaults(),
               on_fatal: Callable[[str], None] | None = None) -> Starlette:
    server = Server(scheduler, tokenizer, model_name, config, warmup=warmup, generation=generation,
                    on_fatal=on_fatal)

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

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's shape too.
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         code="not_found" if exc.status_code == 404 else "method_not_allowed")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    app = Starlette(
        exception_handlers={HTTPException: http_error},
        routes=[
            route("/v1/completions", lambda r: server.generate(r, chat=False), ["POST"]),
            route("/v1/chat/completions", lambda r: server.generate(r, chat=True), ["POST"]),
            route("/v1/models", server.models, ["GET"]),
            route("/health", server.health, ["GET"]),
            route("/metrics", server.metrics_endpoint, ["GET"]),
            route("/server_info", server.server_info, ["GET"]),
            route("/model_info", server.model_info, ["GET"]),
            route("/get_load", server.load, ["GET"]),
            route("/debug/timeline", server.timeline_endpoint, ["GET"]),
            route("/openapi.json", server.openapi, ["GET"]),
        ],
        lifespan=server.lifespan,
    )
    app.state.server = server
    return app
