"""Reranking: documents scored for a query by a reranker model (`checkpoints.ranking`), in the
shapes clients send:

    POST /v1/rerank {"query", "documents": [...], "top_n"?, "return_documents"?}
        (also /rerank, /reranking, /v1/reranking: llama-server's; /v2/rerank: Cohere's v2)
        -> {"id", "object": "list", "model", "usage", "results": [{"index", "relevance_score",
            "document": {"text"}}, ...]}, the best first (Jina's, Cohere's, vLLM's, llama-server's)
    POST /rerank {"query", "texts": [...], "return_text"?}
        -> [{"index", "score", "text"?}, ...], the best first (Hugging Face TEI's, as llama-server
           reads a request with "texts")
    POST /v1/score {"text_1": str | [str], "text_2": str | [str]}   (also /score: vLLM's)
        -> {"id", "object": "list", "created", "model", "data": [{"index", "object": "score",
            "score"}], "usage"}: one query against each document, or pairs one to one

Each (query, document) pair is laid out as the reranker's template says (`RankingHead.prompt`)
and prefilled as an embedding is (`EmbeddingsAPI.embed`: chunks sharing iterations with every
other request, a batch submitted as room frees). One query's pairs share the template's start
and the query: the first is prefilled alone, and the others take that prefix from the prefix
cache. Each pair's last token's final hidden state goes through the head. A document is a
string or {"text": string}. A model with no ranking head answers every route with a 400 saying
so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cadence.scheduler.errors import SubmissionError
from cadence.server import parsing, protocol
from cadence.server.api_error import APIError
from cadence.server.embeddings_api import MAX_INPUTS, EmbeddingRequest, EmbeddingsAPI

_RERANK = frozenset({"model", "query", "documents", "texts", "top_n", "return_documents",
                     "return_text", "priority"})
_SCORE = frozenset({"model", "text_1", "text_2", "priority"})


def _texts(value: Any, name: str, objects: bool = True) -> list[str]:
    """An array of 1 to MAX_INPUTS documents: strings (or, where `objects`, {"text": string})."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_INPUTS:
        raise SubmissionError(f'"{name}" must be an array of 1 to {MAX_INPUTS} documents', name)
    texts = []
    for i, doc in enumerate(value):
        if objects and isinstance(doc, dict) and set(doc) == {"text"}:
            doc = doc["text"]
        if not isinstance(doc, str):
            shape = ' or {"text": string}' if objects else ""
            raise SubmissionError(f'"{name}"[{i}] must be a string{shape}', name)
        texts.append(doc)
    return texts


def parse_rerank(body: Any) -> tuple[str, list[str], int, bool, bool]:
    """A rerank request: its query, documents, how many results (top_n: absent or 0, all), whether
    it is TEI's (`texts`), whether the documents' text goes back; or SubmissionError."""
    protocol.known_fields(body, _RERANK)
    query = parsing.field(body, "query", (str,))
    if query is None:
        raise SubmissionError('"query" is required: the text the documents are ranked for', "query")
    tei = body.get("texts") is not None
    if tei and body.get("documents") is not None:
        raise SubmissionError('send the documents in one of "documents" or "texts", not both', "texts")
    name = "texts" if tei else "documents"
    documents = _texts(body.get(name), name, objects=not tei)
    top_n = parsing.field(body, "top_n", (int,), 0)
    if top_n < 0:
        raise SubmissionError(f'"top_n" must be 0 (every document) or more, got {top_n}', "top_n")
    for flag in ("return_documents", "return_text"):
        parsing.field(body, flag, (bool,))
    back = parsing.field(body, "return_text" if tei else "return_documents", (bool,), not tei)
    return query, documents, top_n or len(documents), tei, back


def parse_score(body: Any) -> list[tuple[str, str]]:
    """vLLM's score request as (query, document) pairs: a string against each of an array, or two
    arrays one to one; or SubmissionError."""
    protocol.known_fields(body, _SCORE)
    sides = []
    for name in ("text_1", "text_2"):
        value = body.get(name)
        if value is None:
            raise SubmissionError(f'"{name}" is required', name)
        sides.append([value] if isinstance(value, str) else _texts(value, name, objects=False))
    first, second = sides
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise SubmissionError(f'"text_1" holds {len(first)} texts and "text_2" {len(second)}: give one '
                              "text_1 for every text_2, or as many of each", "text_1")
    return list(zip(first, second))


class RerankAPI:
    """The reranking routes, over a `server.app.Server` and its model's `RankingHead`."""

    def __init__(self, server, embeddings: EmbeddingsAPI):
        self.server, self.embeddings = server, embeddings

    def routes(self, route: Callable[[str, Any, list[str]], Route]) -> list[Route]:
        return [*(route(path, self.rerank, ["POST"])
                  for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking", "/v2/rerank")),
                *(route(path, self.score, ["POST"]) for path in ("/score", "/v1/score"))]

    async def rerank(self, request: Request) -> Response:
        body = await self._body(request)
        with protocol.submission_errors(prompt="documents"):
            query, documents, top_n, tei, back = parse_rerank(body)
        request_id = protocol.request_id(request.headers, "rerank")
        scores, tokens = await self._scores(request, body, [(query, d) for d in documents], request_id,
                                            "texts" if tei else "documents")
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        headers = {"X-Request-Id": request_id}
        if tei:
            return JSONResponse([{"index": i, "score": scores[i], **({"text": documents[i]} if back else {})}
                                 for i in order], headers=headers)
        return JSONResponse({
            "id": request_id, "object": "list", "model": self.server.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": [{"index": i, "relevance_score": scores[i],
                         **({"document": {"text": documents[i]}} if back else {})} for i in order],
        }, headers=headers)

    async def score(self, request: Request) -> Response:
        body = await self._body(request)
        with protocol.submission_errors(prompt="text_2"):
            pairs = parse_score(body)
        request_id = protocol.request_id(request.headers, "score")
        scores, tokens = await self._scores(request, body, pairs, request_id, "text_2")
        return JSONResponse({
            "id": request_id, "object": "list", "created": int(time.time()), "model": self.server.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }, headers={"X-Request-Id": request_id})

    async def _body(self, request: Request) -> dict:
        server = self.server
        body = await server.read_body(request)
        if server.ranking is None:
            raise APIError(400, f"{server.model_name} ranks nothing: it has no ranking head. Serve a "
                           "reranker (a GGUF of pooling type rank with a cls.output head, as llama.cpp "
                           "converts Qwen3-Reranker)", param="model")
        if isinstance(body, dict):
            with protocol.submission_errors():
                server.models.check_base(parsing.field(body, "model", (str,)))
        return body

    async def _scores(self, request: Request, body: dict, pairs: list[tuple[str, str]], request_id: str,
                      field: str) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens they took."""
        server, head = self.server, self.server.ranking
        with protocol.submission_errors():
            priority = parsing.field(body, "priority", (int,))
        prompts = await asyncio.to_thread(lambda: [head.prompt(server.tokenizer, q, d) for q, d in pairs])
        # One query's pairs share the template's start and the query: the first goes alone, so
        # that every other finds that prefix in the cache (where there is one) when admitted.
        split = len(prompts) > 1 and len({q for q, _ in pairs}) == 1 and server.scheduler.config.prefix_caching
        parts = [(prompts[:1], request_id), (prompts[1:], f"{request_id}-rest")] if split else [(prompts, request_id)]
        records = []
        for part, name in parts:
            if not part:  # (no documents: no request)
                continue
            embedding = EmbeddingRequest(None, part, -1.0, priority=priority, field=field)
            records += await self.embeddings.embed(request, embedding, name, pooling="last")
        return [head.score(r.embedding) for r in records], sum(r.prompt_tokens for r in records)
