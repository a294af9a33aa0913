"""The routes that describe the server rather than generate: models, tokenizer, health, load.

    InfoAPI(server).routes(route)   # in create_app, beside the generating routes

GET /v1/models and /v1/models/{id} (OpenAI's model cards, one per served name); POST /tokenize,
POST /detokenize and GET /tokenizer_info (vLLM's shapes, which lm-eval's remote tokenizer
reads, and llama-server's); POST /apply-template (llama-server's: a chat's prompt); GET
/health; POST /v1/chat/completions/input_tokens (llama-server's: a chat's prompt tokens, as
`input_tokens`, which the Responses and Messages APIs count with too); GET /metrics
(Prometheus); GET /server_info, /model_info and /get_load (what sglang-router asks a worker,
in SGLang's shapes); GET /debug/timeline (the scheduler's
iteration log and finished requests' timelines, read by `bench/`); GET /openapi.json. Each reads
the `Server`'s scheduler, tokenizer and state, and changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import cadence
from cadence.checkpoints.tokenizer import TokenizerError
from cadence.scheduler.errors import SubmissionError
from cadence.server import parsing, protocol
from cadence.server.api_error import APIError
from cadence.server.tool_requests import parse_tools

if TYPE_CHECKING:
    from cadence.server.app import Server

OPENAPI = Path(__file__).with_name("openapi.json")


# /tokenize's fields: vLLM's ("prompt" or "messages"), llama-server's ("content"), and the chat
# fields a rendered chat takes; /apply-template (llama-server's) takes a chat's alone.
_LLAMA_OPTIONS = frozenset({"add_special", "parse_special", "with_pieces"})  # with "content"
_VLLM_OPTIONS = frozenset({"add_special_tokens", "return_token_strs"})  # with "prompt" or "messages"
TEMPLATE_FIELDS = frozenset({"model", "messages", "tools", *parsing.CHAT_FIELDS})
TOKENIZE_FIELDS = TEMPLATE_FIELDS | _LLAMA_OPTIONS | _VLLM_OPTIONS | {"prompt", "content"}


def tokenize_request(body: Any, fields: frozenset[str] = TOKENIZE_FIELDS) -> dict:
    """/tokenize's body (or /apply-template's, of `fields`), checked: exactly one of "prompt"
    (vLLM's text), "messages" or "content" (llama-server's text), llama-server's options with
    its "content" alone and vLLM's without it; APIError 400 naming what is wrong."""
    try:
        protocol.known_fields(body, fields)
        given = [k for k in ("prompt", "messages", "content") if body.get(k) is not None]
        if len(given) != 1:
            allowed = [f'"{k}"' for k in ("prompt", "messages", "content") if k in fields]
            raise SubmissionError(f"send exactly one of {', '.join(allowed)}")
        llama = given == ["content"]
        other = next((k for k in sorted(_VLLM_OPTIONS if llama else _LLAMA_OPTIONS) if body.get(k) is not None), None)
        if other is not None:
            raise SubmissionError(f'"{other}" goes with ' + ('"prompt" or "messages" (vLLM\'s /tokenize)' if llama
                                                             else '"content" (llama-server\'s /tokenize)'), other)
        parsing.field(body, "model", (str,))
        for name in ("prompt", "content"):
            parsing.field(body, name, (str,))
        parsing.field(body, "messages", (list,))
        for name in ("add_special_tokens", "return_token_strs", "add_special", "parse_special", "with_pieces"):
            parsing.field(body, name, (bool,))
        parsing.check_chat_fields(body, body.get("messages") is not None)
        parsing.template_kwargs(body)
        parsing.request_template(body)
        parsing.chat_end(body)
        return {k: v for k, v in body.items() if v is not None}
    except SubmissionError as e:
        raise APIError(400, str(e), param=e.param) from None


def detokenize_request(body: Any, vocab_size: int) -> dict:
    """/detokenize's body (vLLM's shape): {"tokens": [ids in the vocabulary]}."""
    try:
        protocol.known_fields(body, ("model", "tokens"))
        parsing.field(body, "model", (str,))
        tokens = parsing.field(body, "tokens", (list,))
        if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                     for t in tokens):
            raise SubmissionError(f'"tokens" must be an array of token ids in [0, {vocab_size})', "tokens")
        return {k: v for k, v in body.items() if v is not None}
    except SubmissionError as e:
        raise APIError(400, str(e), param=e.param) from None


class InfoAPI:
    def __init__(self, server: Server):
        self.server = server

    def routes(self, route: Callable[[str, Any, list[str]], Route]) -> list[Route]:
        return [*(route(path, self.models, ["GET"]) for path in ("/v1/models", "/models")),
                *(route(path, self.count_chat, ["POST"])
                  for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens")),
                route("/v1/models/{model_id:path}", self.model, ["GET"]),
                route("/tokenize", self.tokenize, ["POST"]),
                route("/detokenize", self.detokenize, ["POST"]),
                route("/tokenizer_info", self.tokenizer_info, ["GET"]),
                route("/apply-template", self.apply_template, ["POST"]),
                *(route(path, self.health, ["GET"]) for path in ("/health", "/v1/health")),
                route("/ping", self.health, ["GET", "POST"]),  # vLLM's (SageMaker's) health probe
                route("/version", self.version, ["GET"]),
                route("/metrics", self.metrics_endpoint, ["GET"]),
                route("/server_info", self.server_info, ["GET"]),
                route("/model_info", self.model_info, ["GET"]),
                route("/get_load", self.load, ["GET"]),
                route("/debug/timeline", self.timeline_endpoint, ["GET"]),
                route("/openapi.json", self.openapi, ["GET"])]

    def _model_card(self, name: str) -> dict:
        """A served name's card; a LoRA adapter's names its base model as `parent` (vLLM's)."""
        card = {"id": name, "object": "model", "created": self.server.created, "owned_by": "cadence",
                "root": self.server.model_name, "max_model_len": self.server.scheduler.max_seq_len}
        if name in self.server.models.adapters:
            card.update(root=name, parent=self.server.model_name)
        return card

    async def models(self, request: Request) -> Response:
        self.server._check(request)
        return JSONResponse({"object": "list",
                             "data": [self._model_card(n) for n in self.server.models.every]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: one served name's card (an id may hold slashes)."""
        self.server._check(request)
        name = request.path_params["model_id"]
        self.server.models.check(name)
        return JSONResponse(self._model_card(name))

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize in vLLM's shape: a "prompt" (with `add_special_tokens`, default true:
        the BOS a completion's prompt gets) or chat "messages" (rendered as a chat request's
        prompt, with its `tools` and `chat_template_kwargs`) -> {"count", "max_model_len",
        "tokens", "token_strs"}; or in llama-server's: a "content" (`add_special`, default
        false; `parse_special`, default true: special tokens' text is their token) ->
        {"tokens"}, each {"id", "piece"} with `with_pieces` (a piece that is not whole UTF-8
        as its bytes)."""
        entry = await self._entry(request, TOKENIZE_FIELDS)
        tokenizer = self.server.tokenizer

        def run() -> list[int]:
            special = entry.get("parse_special", True)
            if "content" in entry:
                text, add_bos = entry["content"], None if entry.get("add_special", False) else False
            else:  # as a chat's or a completion's prompt is tokenized
                text = self._render(entry) if "messages" in entry else entry["prompt"]
                add_bos = parsing.add_bos(entry)
            # Refused unread where it cannot fit the context at any tokenization.
            return parsing.prompt_ids(text, tokenizer, self.server.scheduler.max_seq_len, add_bos,
                                      special=special)

        ids = await self._run(run)
        if "content" in entry:
            if not entry.get("with_pieces"):
                return JSONResponse({"tokens": ids})
            return JSONResponse({"tokens": [{"id": t, "piece": _piece(tokenizer.token_bytes(t))} for t in ids]})
        strs = ([tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
                if entry.get("return_token_strs") else None)
        return JSONResponse({"count": len(ids), "max_model_len": self.server.scheduler.max_seq_len,
                             "tokens": ids, "token_strs": strs})

    async def count_chat(self, request: Request) -> Response:
        """POST /v1/chat/completions/input_tokens (llama-server's): a chat request's prompt
        tokens, the request parsed and refused as the chat itself would be."""
        server = self.server
        body = await server.read_body(request)
        server.check_template(body)
        parsed = protocol.parse(body, True, server.defaults, server.config.max_n)
        server.models.check(parsed.model)
        return JSONResponse(await input_tokens(server, parsed))

    async def apply_template(self, request: Request) -> Response:
        """POST /apply-template (llama-server's): chat "messages" (and a chat's fields) ->
        {"prompt"}, the text a chat request with them would be prompted with."""
        entry = await self._entry(request, TEMPLATE_FIELDS)
        return JSONResponse({"prompt": await self._run(lambda: self._render(entry))})

    async def _entry(self, request: Request, fields: frozenset[str]) -> dict:
        body = await self.server.read_body(request)
        self.server.check_template(body)
        entry = tokenize_request(body, fields)
        self.server.models.check(entry.get("model"))
        return entry

    def _render(self, entry: dict) -> str:
        """A checked entry's chat, rendered as a chat request's prompt."""
        return parsing.render_chat(entry["messages"], self.server.tokenizer, parse_tools(entry),
                                   parsing.template_kwargs(entry), parsing.chat_end(entry),
                                   entry.get("chat_template"))

    @staticmethod
    async def _run(work: Callable[[], Any]) -> Any:
        """Rendering or tokenizing, on a worker thread (its cost grows with the text)."""
        try:
            return await asyncio.to_thread(work)
        except (SubmissionError, TokenizerError) as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None

    async def tokenizer_info(self, request: Request) -> Response:
        """GET /tokenizer_info in vLLM's shape: what a client needs to tokenize through this
        server (lm-eval's remote tokenizer reads it, then /tokenize and /detokenize)."""
        self.server._check(request)
        tok = self.server.tokenizer
        return JSONResponse({"tokenizer_class": "cadence", "eos_token": tok.eos_token,
                             "bos_token": tok.bos_token, "pad_token": None,
                             "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
                             "model_max_length": self.server.scheduler.max_seq_len,
                             "vocab_size": tok.vocab_size})

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize: {"tokens": [ids]} -> {"prompt": text} (vLLM's) and
        {"content": text} (llama-server's), the same text."""
        body = await self.server.read_body(request)
        entry = detokenize_request(body, self.server.tokenizer.vocab_size)
        self.server.models.check(entry.get("model"))
        text = self.server.tokenizer.decode(entry["tokens"])
        return JSONResponse({"prompt": text, "content": text})

    # -- what a router asks a worker ------------------------------------------------------------
    # sglang-router (the SGLang Model Gateway) reads /server_info and /model_info when it
    # registers a worker (the model's name, parallelism, capacity; answered before warm-up
    # ends, as they do not change) and /get_load to balance on load, in SGLang's shapes.

    async def server_info(self, request: Request) -> Response:
        self.server._authorize(request)
        sched = self.server.scheduler
        tp = sched.engine.tp
        return JSONResponse({
            "model_path": self.server.model_name, "served_model_name": self.server.model_name,
            "tp_size": tp.mesh.size if tp else 1, "dp_size": 1, "version": f"cadence {cadence.__version__}",
            "max_running_requests": sched.num_slots, "max_total_tokens": sched.kv_pages[1] * sched.page_size,
            "max_prefill_tokens": sched.config.policy.chunk, "context_length": sched.max_seq_len,
            "page_size": sched.page_size, "kv_cache_dtype": sched.engine.config.pool_dtype})

    async def model_info(self, request: Request) -> Response:
        self.server._authorize(request)
        return JSONResponse({"model_path": self.server.model_name, "tokenizer_path": self.server.model_name,
                             "is_generation": True, "model_type": "llama",
                             "architectures": ["LlamaForCausalLM"]})

    async def load(self, request: Request) -> Response:
        """One entry per data-parallel rank (cadence has one): requests held and waiting, and
        the tokens whose KV they hold."""
        self.server._authorize(request)
        sched = self.server.scheduler
        return JSONResponse([{"dp_rank": 0, "num_reqs": sched.num_running + sched.num_waiting,
                              "num_waiting_reqs": sched.num_waiting,
                              "num_tokens": sched.kv_tokens}])

    async def health(self, request: Request) -> Response:
        fatal = self.server.fatal
        if fatal is not None:
            return JSONResponse({"status": "dead", "error": fatal}, status_code=503)
        if self.server.ready.is_set():
            return JSONResponse({"status": "ok"})
        body: dict[str, Any] = {"status": "warming up"}
        if self.server.warm_progress is not None:  # how far the compiler is: a slow start, not a hang
            body["programs_done"], body["programs_total"] = self.server.warm_progress
        return JSONResponse(body, status_code=503)

    async def version(self, request: Request) -> Response:
        """GET /version (vLLM's): {"version"}, cadence's."""
        return JSONResponse({"version": cadence.__version__})

    async def metrics_endpoint(self, request: Request) -> Response:
        if self.server.config.protect_metrics:
            self.server._authorize(request)
        return Response(self.server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        return Response(OPENAPI.read_bytes(), media_type="application/json")

    async def timeline_endpoint(self, request: Request) -> Response:
        """GET /debug/timeline?since_iteration=I&since_request=R: records newer than the cursors."""
        self.server._authorize(request)
        try:
            iteration = int(request.query_params.get("since_iteration", -1))
            seq = int(request.query_params.get("since_request", 0))
        except ValueError:
            raise APIError(400, "since_iteration and since_request must be integers") from None
        sched = self.server.scheduler
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
            **self.server.timeline.since(iteration, seq),
        })


def _piece(data: bytes) -> str | list[int]:
    """A token's text as llama-server's /tokenize gives it: a string where its bytes are whole
    UTF-8, else the bytes."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def input_tokens(server: Server, parsed: protocol.ParsedRequest) -> dict:
    """A chat's prompt tokens, as its usage would count them, in the shape of OpenAI's and
    llama-server's count routes: {"object": "response.input_tokens", "input_tokens"}."""
    with protocol.submission_errors():
        ids, = await asyncio.to_thread(server._tokenize, parsed)
    return {"object": "response.input_tokens", "input_tokens": len(ids)}
