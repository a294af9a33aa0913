"""OpenAI's Conversations API: a conversation's items kept on the server, which a Responses
request names (`conversation`) to answer after them and to add its input and output to.

    conversations = ConversationStore()
    routes = ConversationsAPI(server, conversations).routes(route)

    POST   /v1/conversations                        {items?, metadata?} -> the conversation
    GET    /v1/conversations/{id}                   the conversation ({"id", "object", "created_at", "metadata"})
    POST   /v1/conversations/{id}                   {metadata}: replaces its metadata
    DELETE /v1/conversations/{id}                   {"id", "object": "conversation.deleted", "deleted": true}
    GET    /v1/conversations/{id}/items             its items, a page at a time (`responses_request.page`)
    POST   /v1/conversations/{id}/items             {items}: appended; the list of those added
    GET    /v1/conversations/{id}/items/{item_id}   one item
    DELETE /v1/conversations/{id}/items/{item_id}   removes it; the conversation

Items are the Responses API's input items, checked as a request's `input` is
(`responses_request.input_messages`: messages, function calls and their outputs, reasoning) and
kept with ids and statuses (`input_items`). The store is in memory and bounded, as stored
responses are: the least recently used conversations go first.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cadence.server import parsing, protocol
from cadence.server.api_error import APIError
from cadence.server.bounded import Bounded
from cadence.server.responses_request import input_items, input_messages, new_id, page

if TYPE_CHECKING:
    from cadence.server.app import Server

STORE_CONVERSATIONS = 1024  # conversations kept, the most recently used
STORE_CHARS = 64 * 2**20  # ... and their items' characters, all together
MAX_ITEMS = 20  # items one request may create (OpenAI's bound)
MAX_METADATA = 16  # metadata keys (OpenAI's bound)


@dataclasses.dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict]

    def object(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}


class ConversationStore:
    """The most recently used conversations, bounded in count and in their items' size."""

    def __init__(self, capacity: int = STORE_CONVERSATIONS, chars: int = STORE_CHARS):
        self._kept: Bounded[Conversation] = Bounded(capacity, chars)

    def create(self, items: list[dict], metadata: dict[str, str]) -> Conversation:
        conversation = Conversation(new_id("conv"), int(time.time()), metadata, [])
        self._kept.add(conversation.id, conversation, 0)
        self.extend(conversation, items)
        return conversation

    def get(self, conversation_id: str) -> Conversation:
        """The conversation, else a 404."""
        conversation = self._kept.get(conversation_id)
        if conversation is None:
            raise APIError(404, f"Conversation with id '{conversation_id[:100]}' not found.",
                           param="conversation_id", code="not_found")
        return conversation

    def extend(self, conversation: Conversation, items: list[dict]) -> None:
        """Adds items to a conversation, now the most recently used; past the bounds the least
        recently used go (this one last). One deleted meanwhile still gets them."""
        conversation.items += items
        self._kept.grow(conversation.id, sum(map(_chars, items)))

    def remove(self, conversation: Conversation, at: int) -> None:
        self._kept.grow(conversation.id, -_chars(conversation.items.pop(at)))

    def delete(self, conversation_id: str) -> None:
        self._kept.pop(self.get(conversation_id).id)


def _chars(item: dict) -> int:
    return len(json.dumps(item))


def checked_items(items: Any) -> list[dict]:
    """Items as a request gives them, checked as a Responses `input` is, with ids."""
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        raise APIError(400, f'"items" must be an array of at most {MAX_ITEMS} input items', param="items")
    try:
        input_messages(items)
    except APIError as e:
        raise APIError(400, f"items: {e.message}", param="items") from None
    return input_items(items)


def _metadata(body: dict) -> dict[str, str]:
    metadata = body.get("metadata") or {}
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise APIError(400, f'"metadata" must be an object of at most {MAX_METADATA} string values',
                       param="metadata")
    return metadata


class ConversationsAPI:
    def __init__(self, server: Server, store: ConversationStore):
        self.server, self.store = server, store

    def routes(self, route: Callable[[str, Any, list[str]], Route]) -> list[Route]:
        one, items = "/v1/conversations/{conversation_id}", "/v1/conversations/{conversation_id}/items"
        return [route("/v1/conversations", self.create, ["POST"]),
                route(one, self.retrieve, ["GET"]), route(one, self.update, ["POST"]),
                route(one, self.delete, ["DELETE"]),
                route(items, self.list_items, ["GET"]), route(items, self.add_items, ["POST"]),
                route(items + "/{item_id}", self.item, ["GET"]),
                route(items + "/{item_id}", self.delete_item, ["DELETE"])]

    async def _body(self, request: Request, allowed: dict[str, type]) -> dict:
        """The request's body, of `allowed`'s fields, each of its type (else a 400)."""
        body = await self.server.read_body(request)
        with protocol.submission_errors():
            protocol.known_fields(body, allowed)
            for name, kind in allowed.items():
                parsing.field(body, name, (kind,))
        return body

    def _conversation(self, request: Request) -> Conversation:
        self.server._check(request)
        return self.store.get(request.path_params["conversation_id"])

    def _item(self, request: Request) -> tuple[Conversation, int]:
        conversation = self._conversation(request)
        item_id = request.path_params["item_id"]
        at = next((i for i, item in enumerate(conversation.items) if item["id"] == item_id), None)
        if at is None:
            raise APIError(404, f"Item with id '{item_id[:100]}' not found.", param="item_id",
                           code="not_found")
        return conversation, at

    async def create(self, request: Request) -> Response:
        body = await self._body(request, {"items": list, "metadata": dict, "safety_identifier": str})
        items = checked_items(body.get("items") or [])
        return JSONResponse(self.store.create(items, _metadata(body)).object())

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(self._conversation(request).object())

    async def update(self, request: Request) -> Response:
        conversation = self._conversation(request)
        conversation.metadata = _metadata(await self._body(request, {"metadata": dict}))
        return JSONResponse(conversation.object())

    async def delete(self, request: Request) -> Response:
        conversation = self._conversation(request)
        self.store.delete(conversation.id)
        return JSONResponse({"id": conversation.id, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: Request) -> Response:
        return JSONResponse(page(self._conversation(request).items, request.query_params))

    async def add_items(self, request: Request) -> Response:
        conversation = self._conversation(request)
        items = checked_items((await self._body(request, {"items": list})).get("items"))
        self.store.extend(conversation, items)
        return JSONResponse(page(items, {"order": "asc", "limit": str(MAX_ITEMS)}))  # (all of them)

    async def item(self, request: Request) -> Response:
        conversation, at = self._item(request)
        return JSONResponse(conversation.items[at])

    async def delete_item(self, request: Request) -> Response:
        conversation, at = self._item(request)
        self.store.remove(conversation, at)
        return JSONResponse(conversation.object())
