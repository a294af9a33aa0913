"""The OpenAI-compatible HTTP front door: a thin Starlette layer over the scheduler.

    app = create_app(scheduler, tokenizer, model_name="smollm2-135m", warmup=engine.warmup)

Routes: POST /v1/completions and POST /v1/chat/completions (each streaming over Server-Sent
Events, `server/openai_stream.py`, or not) are here; POST /v1/responses and GET /v1/responses/{id} (OpenAI's Responses API,
on the chat path) are `server/responses_api.py`; llama-server's own POST /completion and /infill
are `server/llama_api.py`; the routes that describe the server rather than
generate (models, /tokenize and /detokenize, /health, /metrics, what sglang-router asks a worker,
/debug/timeline, /openapi.json) are `server/info_api.py`; POST /v1/embeddings and llama-server's
/embedding are `server/embeddings_api.py`. /health answers 200 only while the
engine is warm and alive.
All model and policy logic lives below this layer: the app reads the body (refusing one over
`max_body_bytes` with 413 before buffering it), parses it (`server/parsing.py`), tokenizes on a
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
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from contextlib import asynccontextmanager

from absl import logging
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cadence.checkpoints import fim
from cadence.checkpoints.generation import GenerationDefaults
from cadence.checkpoints.ranking import RankingHead
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.grammar import BadWords, Grammar, GrammarCompiler, GrammarError, TokenSet
from cadence.scheduler.request import RequestRecord, TokenEvent
from cadence.scheduler.scheduler import IterationRecord, RequestStream, Scheduler
from cadence.server import client_json, llama_fields, llama_sampling, parsing, protocol, reasoning
from cadence.server.api_error import APIError
from cadence.server.conversations_api import ConversationsAPI, ConversationStore
from cadence.server.embeddings_api import EmbeddingsAPI
from cadence.server.event_stream import event_stream
from cadence.server.llama_api import LlamaAPI, fill_ids
from cadence.server.lora_api import LoraAPI
from cadence.server.messages_api import MessagesAPI
from cadence.server.openai_stream import sse_frames
from cadence.server.info_api import InfoAPI
from cadence.server.metrics import Metrics
from cadence.server.served_models import ServedModels
from cadence.server.rerank_api import RerankAPI
from cadence.server.slots_api import SlotFilesAPI
from cadence.server.responses_api import ResponsesAPI
from cadence.server.tool_requests import call_style

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


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
    # The client has the text (and an embedding) already.
    return {k: v for k, v in items if k not in ("text", "embedding")}


async def read_capped(request: Request, limit: int) -> bytes:
    """A request's body, refused with 413 as soon as it exceeds `limit` bytes (never buffered
    past it)."""
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


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    max_n: int = protocol.DEFAULT_MAX_N  # most choices a request may ask for (n, best_of)
    protect_metrics: bool = False  # with an api_key, /metrics needs it too (/debug/timeline always does)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = 30.0  # seconds in-flight requests may take to finish on shutdown
    grammar_timeout: float = 10.0  # seconds a response format's grammar may take to compile
    reasoning_parser: str = "auto"  # `reasoning.PARSERS`: split chat answers' <think> blocks
    pooling: str = "last"  # how embeddings pool the hidden states (`scheduler.request.POOLINGS`)
    # A chat request may bring its own chat template (vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False
    # Origins a browser page may call the API from (CORS); () answers no cross-origin request,
    # ("*",) any. Preflights pass without the API key; every other request still needs it.
    allowed_origins: tuple[str, ...] = ()
    slots: bool = True  # GET /slots (llama-server's view of each slot)
    # A folder for llama-server's slot files (POST /slots/{id}?action=...); None: not served (501).
    slot_save_path: str | None = None
    # LoRA adapters' names, in the engine's bank order (`--lora`): a request's "model" may name
    # one, and its answer carries that name.
    lora_adapters: tuple[str, ...] = ()
    lora_slots: int = 0  # the bank's size (0: as many as lora_adapters)
    runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's)
    # Seconds a stream may stay silent before a keep-alive comment (`event_stream`); 0: never.
    sse_ping_interval: float = 30.0


class Server:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, model_name: str | Sequence[str],
                 config: ServerConfig = ServerConfig(), warmup: Callable[[], None] | None = None,
                 generation: GenerationDefaults = GenerationDefaults(),
                 on_fatal: Callable[[str], None] | None = None, ranking: RankingHead | None = None):
        self.scheduler = scheduler
        self.ranking = ranking  # a reranker's head (`server.rerank_api`), where the model has one
        self.tokenizer = tokenizer
        self.dry_breakers = llama_sampling.DryBreakers(tokenizer)
        self.models = ServedModels(model_name, config.lora_adapters, config.lora_slots or None)  # what "model" may name
        self.model_name = self.models.name  # the one answers carry
        self.config = config
        self.defaults = protocol.OPENAI_DEFAULTS.with_model(generation)
        self.metrics = Metrics(scheduler, self.model_name, self.models)
        self.timeline = Timeline(scheduler)
        self.ready = threading.Event()
        self.warmup_error: str | None = None
        self._warmup = warmup
        self._warm_thread: threading.Thread | None = None
        self.warm_progress: tuple[int, int] | None = None  # (programs compiled, of how many)
        self._on_fatal = on_fatal
        self.created = int(time.time())
        # Response formats' and forced tool calls' grammars (`scheduler.grammar`).
        self.grammars = GrammarCompiler(tokenizer, scheduler.engine.vocab_size,
                                        timeout=config.grammar_timeout)
        # Whether chat answers' reasoning is split out (`server.reasoning`).
        self.splits_reasoning = reasoning.parser_on(config.reasoning_parser, tokenizer.chat_template)
        self.call_style = call_style(tokenizer)  # how its template writes tool calls
        self.fim = fim.FimTokens.of(tokenizer)  # None: the model cannot fill in the middle
        if self.fim is not None:  # its plain-text tokenizer, built now rather than on a request
            tokenizer.encode("", special=False)

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
            self.grammars.close()  # queued compiles: nobody is left to serve them

    @property
    def warming(self) -> bool:
        return self._warm_thread is not None and self._warm_thread.is_alive()

    def _warm(self) -> None:
        try:
            if self._warmup is not None:
                # A warm-up that takes an argument reports its progress to it, for /health.
                if inspect.signature(self._warmup).parameters:
                    self._warmup(self._warmed)
                else:
                    self._warmup()
        except Exception as e:
            self.warmup_error = f"warm-up failed: {type(e).__name__}: {e}"
            logging.exception("cadence cannot serve: %s", self.warmup_error)
            if self._on_fatal is not None:
                self._on_fatal(self.warmup_error)
            return
        self.ready.set()
        logging.info("cadence is ready")

    def _warmed(self, done: int, total: int, name: str = "") -> None:
        self.warm_progress = (done, total)

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
        if scheme.lower() != "bearer":  # Anthropic's clients send theirs as x-api-key
            token = request.headers.get("x-api-key", "")
        # Constant-time comparison: response timing must not reveal how much of a key matched.
        if not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>' "
                                "or 'x-api-key: <key>')",
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

    def _tokenize(self, parsed: protocol.ParsedRequest) -> list[list[int]]:
        """On a worker thread (chat rendering and tokenizing cost time in the prompt's length):
        each prompt's tokens, a chat's one."""
        if parsed.messages is not None:
            text = parsing.render_chat(parsed.messages, self.tokenizer, parsed.tools,
                                       parsed.template_kwargs, parsed.chat_end, parsed.chat_template)
            parsed.chat_prompt = text
            if self.splits_reasoning and parsed.separate_reasoning:
                parsed.reasoning_inside = reasoning.opens_inside(text)
            texts: list[str | list[int]] = [text]
        else:
            texts = parsed.prompts
        if parsed.prediction:  # as the answer's text would be tokenized: no BOS, no specials
            parsed.prediction_ids = tuple(self.tokenizer.encode(parsed.prediction, add_bos=False,
                                                                special=False))
        if parsed.hole is not None:
            return [fill_ids(self.tokenizer, self.fim, self.scheduler.max_seq_len, text, parsed.hole)
                    for text in texts]
        return [parsing.prompt_ids(text, self.tokenizer, self.scheduler.max_seq_len, parsed.add_bos,
                                   keep=parsed.truncate)
                for text in texts]

    async def _prepare(self, parsed: protocol.ParsedRequest
                       ) -> tuple[list[list[int]], Grammar | TokenSet | BadWords | None]:
        """The prompts' tokens and the answer's grammar. The grammar compiles on the compiler's
        own threads while the prompts are tokenized; waiting for it holds no thread, so requests
        without grammars never queue behind a slow schema. A thinking model's grammar waits for
        the rendered prompt, which says where its reasoning stands (`reasoning.answer_spec`)."""
        wanted = parsing.grammar_request(parsed.response_format, parsed.tools, self.tokenizer,
                                          self.grammars)
        if parsed.token_rules is not None:  # vLLM's allowed_token_ids or bad_words: a constraint too
            def both():  # one worker thread: the rule (its words tokenized), then the prompts
                rule = parsing.token_constraint(parsed.token_rules, wanted, self.tokenizer,
                                                self.scheduler.engine.vocab_size)
                return self._tokenize(parsed), rule
            return await asyncio.to_thread(both)
        thinking = (wanted is not None and self.splits_reasoning and parsed.separate_reasoning
                    and parsed.messages is not None)
        compiling = (asyncio.ensure_future(self.grammars.compile_async(wanted.spec))
                     if wanted and not thinking else None)
        try:
            prompts = await asyncio.to_thread(self._tokenize, parsed)
            if thinking:
                spec = reasoning.answer_spec(wanted.spec, parsed.chat_prompt)
                compiling = asyncio.ensure_future(self.grammars.compile_async(spec))
            return prompts, (await compiling if compiling else None)
        except GrammarError as e:
            raise GrammarError(str(e), wanted.param) from None
        finally:
            if compiling is not None and not compiling.done():
                compiling.cancel()  # (the compile itself goes on, for whoever asks next)

    async def submit(self, parsed: protocol.ParsedRequest, request_id: str) -> list[list[RequestStream]]:
        """Each prompt's streams, one per sequence generated for it (n, or best_of). Prompt k's
        request id is the request's for k = 0, else `-p{k}` after it; choice i's is its
        prompt's, then `-i` for i > 0. A batch is submitted whole or not at all."""
        groups: list[list[RequestStream]] = []
        with protocol.submission_errors():
            prompts, grammar = await self._prepare(parsed)
            # DRY's breakers as token ids (the first set reads the vocabulary: off the loop)
            breakers = (await asyncio.to_thread(self.dry_breakers.ids, parsed.dry_breakers)
                        if parsed.params.sampling.dry_multiplier else ())
            shown = self.call_style.shown if parsed.parses_tool_calls else ()
            lora = parsed.params.sampling.lora or self.models.lora(parsed.model)  # llama's, or the model's
            self.models.check_lora(lora)
            params = [dataclasses.replace(p, grammar=grammar, shown_specials=shown,
                                          prediction=parsed.prediction_ids,
                                          sampling=dataclasses.replace(p.sampling, lora=lora,
                                                                       dry_breakers=breakers))
                      for p in parsed.choice_params()]
            try:
                for k, ids in enumerate(prompts):
                    base = request_id if k == 0 else f"{request_id}-p{k}"
                    names = [base] + [f"{base}-{i}" for i in range(1, len(params))]
                    capped = parsed.capped(params, len(ids), self.scheduler.max_seq_len)
                    groups.append(self.scheduler.submit_group(ids, capped, names))
                    self.models.track([s.request for s in groups[-1]], lora)
            except BaseException:
                for stream in (s for group in groups for s in group):
                    stream.cancel()
                raise
            return groups

    async def read_body(self, request: Request, optional: bool = False) -> Any:
        """A POST's JSON body, from a client this server may serve, or an APIError; `optional`:
        an empty body reads as None."""
        self._check(request)
        raw = await read_capped(request, self.config.max_body_bytes)
        if optional and not raw.strip():
            return None
        try:
            return client_json.load_json(raw)
        except SubmissionError as e:
            raise APIError(400, str(e)) from None

    def check_template(self, body: Any) -> None:
        """A request's own chat template (its body's field, before the template is parsed) is
        taken only where the server trusts them."""
        template = body.get("chat_template") if isinstance(body, dict) else None
        if template is not None and not self.config.trust_request_chat_template:
            raise APIError(400, '"chat_template" in a request needs a server started with '
                                "--trust_request_chat_template; this one renders chats with its own "
                                "template", param="chat_template")

    # -- routes -------------------------------------------------------------------------------

    async def generate(self, request: Request, chat: bool) -> Response:
        body = await self.read_body(request)
        if chat:
            self.check_template(body)
        parsed = protocol.parse(body, chat, self.defaults, self.config.max_n)
        self.models.check(parsed.model)
        request_id = protocol.request_id(request.headers, "chatcmpl" if chat else "cmpl")
        groups = await self.submit(parsed, request_id)
        headers = {"X-Request-Id": request_id}
        echoes = [protocol.Echo.of(self.tokenizer, g[0].request.prompt_ids) if parsed.echo else None
                  for g in groups]
        if parsed.stream:
            frames = sse_frames(self, parsed, groups, request_id, chat, echoes)
            return event_stream(frames, headers, self.ping(parsed.llama.ping))
        tools = parsed.tools if parsed.parses_tool_calls else None
        streams = [s for g in groups for s in g]
        # A thinking model's reasoning tokens, counted token by token (usage's details).
        thinkers = ([reasoning.ReasoningParser(parsed.reasoning_inside) for _ in streams]
                    if parsed.reasoning_inside is not None else None)
        records = await self.collect(request, streams, None if thinkers is None else (
            lambda i, event: thinkers[i].feed(event.text)))
        failed = next((r for r in records if r.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"generation failed: {failed.error}", type="server_error")
        if parsed.prompt_only:
            records = list(map(protocol.prompt_alone, records))
        per_prompt = len(groups[0])
        answers = []
        for k, echo in enumerate(echoes):
            generated = records[k * per_prompt:(k + 1) * per_prompt]
            answers.append(protocol.Answer(protocol.best(generated, parsed.n), generated, echo,
                                           groups[k][0].request.prompt_ids))
        answer = protocol.full_response(
            request_id, self.models.answer(parsed.model), chat, answers, self.tokenizer,
            logprobs=parsed.params.logprobs, tools=tools,
            tokens_as_ids=parsed.tokens_as_ids, reasoning_inside=parsed.reasoning_inside,
            reasoning_tokens=None if thinkers is None else sum(t.reasoning_pieces for t in thinkers),
            prompt_logprobs=parsed.prompt_logprobs, token_ids=parsed.token_ids)
        if parsed.llama.timings:  # llama-server's, of the first choice
            answer["timings"] = llama_fields.timings(records[0], records[0].output_tokens)
        return JSONResponse(answer, headers=headers)

    def ping(self, asked: float | None = None) -> float | None:
        """A stream's keep-alive interval (`event_stream`): the request's, else the server's."""
        return self.config.sse_ping_interval if asked is None else asked

    async def collect(self, request: Request, streams: list[RequestStream],
                      on_token: Callable[[int, TokenEvent], None] | None = None) -> list[RequestRecord]:
        """Waits for the whole answer (each token event to `on_token`, with its stream's index,
        where given); a client that hangs up meanwhile cancels it."""

        async def drain(index: int, stream: RequestStream) -> RequestRecord:
            async for event in stream:
                if on_token is not None and isinstance(event, TokenEvent):
                    on_token(index, event)
            return stream.record

        watcher = asyncio.create_task(protocol.cancel_on_disconnect(request, streams))
        try:
            return list(await asyncio.gather(*map(drain, range(len(streams)), streams)))
        finally:
            watcher.cancel()


def create_app(scheduler: Scheduler, tokenizer: Tokenizer, model_name: str | Sequence[str], *,
               config: ServerConfig = ServerConfig(), warmup: Callable[[], None] | None = None,
               generation: GenerationDefaults = GenerationDefaults(),
               on_fatal: Callable[[str], None] | None = None, ranking: RankingHead | None = None) -> Starlette:
    server = Server(scheduler, tokenizer, model_name, config, warmup=warmup, generation=generation,
                    on_fatal=on_fatal, ranking=ranking)

    def route(path: str, handler, methods: list[str],
              error_body: Callable[[APIError], dict] = APIError.body) -> Route:
        """`handler` at `path`, its errors answered in OpenAI's shape (or `error_body`'s)."""
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)
            except Exception as e:  # never let one request's bug take the server down
                logging.exception("unhandled error on %s", path)
                error = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
                return JSONResponse(error_body(error), status_code=500)

        return Route(path, endpoint, methods=methods)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's shape too.
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         code="not_found" if exc.status_code == 404 else "method_not_allowed")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    conversations = ConversationStore()  # (the Conversations API's, which responses read and add to)
    embeddings = EmbeddingsAPI(server)
    app = Starlette(
        exception_handlers={HTTPException: http_error},
        routes=[
            route("/v1/completions", lambda r: server.generate(r, chat=False), ["POST"]),
            # (llama-server serves chats at /chat/completions too, for a base URL without /v1)
            *(route(path, lambda r: server.generate(r, chat=True), ["POST"])
              for path in ("/v1/chat/completions", "/chat/completions")),
            *ResponsesAPI(server, conversations=conversations).routes(route),
            *ConversationsAPI(server, conversations).routes(route),
            *MessagesAPI(server).routes(route),
            *embeddings.routes(route),
            *RerankAPI(server, embeddings).routes(route),
            *LlamaAPI(server).routes(route),
            *(SlotFilesAPI(server).routes(route) if config.slots else []),
            *InfoAPI(server).routes(route),
            *(LoraAPI(server).routes(route) if config.runtime_lora else []),
        ],
        lifespan=server.lifespan,
        middleware=[Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                               allow_methods=["*"], allow_headers=["*"],
                               expose_headers=["X-Request-Id"])] if config.allowed_origins else [],
    )
    app.state.server = server
    return app
