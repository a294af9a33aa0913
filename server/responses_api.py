"""OpenAI's Responses API on cadence's chat path: POST /v1/responses, and GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items and POST /v1/responses/{id}/cancel for
stored and background responses.

    api = ResponsesAPI(server)               # server: the app's `Server`
    routes = api.routes(route)               # create_app's route wrapper -> its Routes

A Responses request is translated into a chat-completions body (`responses_request`) and parsed
by `protocol.parse` exactly as a chat is, so every field it shares with chat is checked,
defaulted and refused by the same code, with the Responses name in the message.

The answer is run through `Server.submit` and split into output items token by token, by the
same code whether it is streamed or not: a thinking model's reasoning (where the server splits
it, `server.reasoning`) as a `reasoning` item of `reasoning_text` first, one `message` item of
`output_text` for the text, one `function_call` item per call (`ToolCallParser`). Where asked,
an `output_text` carries the logprobs of the tokens that wrote it (in chat's shape), and so
does each of its text deltas; a token whose text went to reasoning or to a call has none.
Streaming sends OpenAI's typed events (`event: <type>` + `data: <json>`, with increasing
`sequence_number`), which the SDK's `responses.stream` accumulator reads unchanged.

With `truncation: "auto"`, a conversation too long for the context loses its oldest turns (after
its system messages) until it fits, or until only the last user turn is left (then the 400
stands); what is stored is the whole conversation.

`conversation` names a conversation of the Conversations API (`server/conversations_api.py`):
its items are the turns before the input, and the response's input and output join them.

`store` (default true, as OpenAI's) keeps a response in memory, bounded (`ResponseStore`: the
most recent, in count and in characters); a stored response keeps its whole conversation
(earlier turns, input, output), which `previous_response_id` puts before the next request's
input.

`background: true` makes the response apart from the connection (`responses_background`): it is
answered at once "queued", polled, streamed again from a sequence number, cancelled. A response
whose request was cancelled (its client gone, or a background one cancelled) ends "cancelled".
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cadence.scheduler.errors import RequestTooLong, SubmissionError
from cadence.scheduler.request import PromptProgress, RequestRecord, TokenEvent, TokenLogprob, check_length
from cadence.scheduler.stream import RequestStream, merged
from cadence.server import parsing, protocol
from cadence.server.answer_parts import AnswerParts
from cadence.server.conversations_api import Conversation, ConversationStore
from cadence.server.api_error import APIError
from cadence.server.bounded import Bounded
from cadence.server.event_stream import event_stream
from cadence.server.info_api import input_tokens
from cadence.server.reasoning import ReasoningParser
from cadence.server.responses_background import Background, frame, replay
from cadence.server.responses_request import (ALLOWED, chat_body, input_items, input_messages, new_id, page,
                                              renamed, truncated)
from cadence.server.tool_call_parser import ToolCall, ToolCallParser

if TYPE_CHECKING:
    from cadence.server.app import Server

STORE_RESPONSES = 1024  # stored responses kept, the most recent
STORE_CHARS = 64 * 2**20  # ... and their conversations' characters, all together

# -- the answer -------------------------------------------------------------------------------


class Output(AnswerParts):
    """An answer's output items, built from its text as it arrives (through the tool-call
    parser when the request parses calls), with the stream events that build them: one item
    open at a time (a message, or a call), closed when the next opens or at the end. Calls the
    parser abandons are closed "incomplete" and left out of the output."""

    def __init__(self, parser: ToolCallParser | None, thinker: ReasoningParser | None = None):
        super().__init__(parser, thinker)
        self.items: list[dict] = []  # by output_index
        self.events: list[tuple[str, dict]] = []
        self._open: int | None = None  # the output index of the open item
        self._text: list[str] = []  # the open message's text
        self._calls: dict[int, int] = {}  # the parser's call index -> output index
        self._dropped: set[int] = set()  # output indexes of abandoned calls
        # Logprobs, where the request asked (`format`: chat's shape of a step's TokenLogprobs):
        # the open message's, the step's being fed, and earlier steps' whose text was held back.
        self.format: protocol.LogprobFormat | None = None
        self._logprobs: list[dict] = []
        self._step: list[dict] = []
        self._pending: list[dict] = []
        self._in_call = False  # since a call's text, no answer text yet

    def feed(self, text: str, logprobs: list[TokenLogprob] | None = None) -> None:
        """A step's tokens' logprobs go out with the answer text they write, or with the next
        that comes (text held back by a parser, or a character split across tokens); a token
        whose text went to reasoning or to a call has none."""
        self._step = self.format(logprobs)["content"] if self.format and logprobs else []
        super().feed(text)
        thinker = self.thinker
        # reasoning's tokens (as usage counts them, through its close), or a call's (through its
        # close, until text comes) go nowhere
        reasoned = thinker is not None and thinker.reasoning_pieces == thinker.pieces
        self._pending = [] if reasoned or self._in_call else self._pending + self._step
        self._step = []

    def finish(self, status: str) -> None:
        """Closes the open item; `status` is the answer's: "completed" or "incomplete"."""
        self.finish_parts()
        if not any(item["type"] != "reasoning" for item in self.output):
            # an empty answer (or one of abandoned calls, or all reasoning) is still a message
            self._content("", force=True)
        if self._open is not None and self.items[self._open]["type"] == "message":
            self._logprobs += self._pending  # the last tokens, of no text
        self._close(status)

    @property
    def output(self) -> list[dict]:
        return [item for i, item in enumerate(self.items) if i not in self._dropped]

    def snapshot(self) -> list[dict]:
        """The output so far, as a response retrieved while it is made shows it: the open item
        with its text so far."""
        at = self._open
        if at is None or at in self._dropped or self.items[at]["type"] == "function_call":
            return [dict(item) for item in self.output]
        text = "".join(self._text)
        part = _part(text, self._logprobs) if self.items[at]["type"] == "message" else _reasoning_part(text)
        return [dict(item, content=[part]) if i == at else dict(item)
                for i, item in enumerate(self.items) if i not in self._dropped]

    @property
    def text(self) -> str:
        return "".join(part["text"] for item in self.output if item["type"] == "message"
                       for part in item["content"])

    @property
    def reasoning(self) -> str:
        return "".join(part["text"] for item in self.output if item["type"] == "reasoning"
                       for part in item["content"])

    def calls(self) -> list[dict]:
        return [item for item in self.output if item["type"] == "function_call"]

    def on_abandoned(self, index: int) -> None:
        at = self._calls.get(index)
        if at is not None and at not in self._dropped:
            self._dropped.add(at)
            if at == self._open:
                self._close("incomplete")

    def on_content(self, text: str) -> None:
        self._content(text)

    def _emit(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))

    def _content(self, text: str, force: bool = False) -> None:
        if not text and not force:
            return
        if self._open is None or self.items[self._open]["type"] != "message":
            self._close("completed")
            self._open = len(self.items)
            item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            self.items.append(item)
            self._emit("response.output_item.added", output_index=self._open, item=dict(item))
            self._emit("response.content_part.added", item_id=item["id"], output_index=self._open,
                       content_index=0, part=_part(""))
            self._text, self._logprobs = [], []
        if text:
            self._in_call = False
            logprobs, self._pending, self._step = self._pending + self._step, [], []
            self._text.append(text)
            self._logprobs += logprobs
            self._emit("response.output_text.delta", item_id=self.items[self._open]["id"],
                       output_index=self._open, content_index=0, delta=text, logprobs=logprobs)

    def on_reasoning(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self.items[self._open]["type"] != "reasoning":
            self._close("completed")
            self._open = len(self.items)
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "encrypted_content": None, "status": "in_progress"}
            self.items.append(item)
            self._emit("response.output_item.added", output_index=self._open, item=dict(item))
            self._emit("response.content_part.added", item_id=item["id"], output_index=self._open,
                       content_index=0, part=_reasoning_part(""))
            self._text = []
        self._text.append(text)
        self._emit("response.reasoning_text.delta", item_id=self.items[self._open]["id"],
                   output_index=self._open, content_index=0, delta=text)

    def on_call_done(self, call: ToolCall) -> None:
        self._pending, self._step, self._in_call = [], [], True

    def on_call(self, entry: dict) -> None:
        self._pending, self._step, self._in_call = [], [], True
        fragment = entry["function"].get("arguments", "")
        if "id" in entry:  # a header: a new call
            self._close("completed")
            self._open = self._calls[entry["index"]] = len(self.items)
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": entry["id"], "name": entry["function"]["name"], "arguments": ""}
            self.items.append(item)
            self._emit("response.output_item.added", output_index=self._open, item=dict(item))
        at = self._calls[entry["index"]]
        if fragment and at not in self._dropped:
            item = self.items[at]
            item["arguments"] += fragment
            self._emit("response.function_call_arguments.delta", item_id=item["id"],
                       output_index=at, delta=fragment)

    def _close(self, status: str) -> None:
        at, self._open = self._open, None
        if at is None:
            return
        item = self.items[at]
        if at in self._dropped:
            status = "incomplete"
        elif item["type"] == "reasoning":
            text = "".join(self._text)
            self._emit("response.reasoning_text.done", item_id=item["id"], output_index=at,
                       content_index=0, text=text)
            item["content"] = [_reasoning_part(text)]
            self._emit("response.content_part.done", item_id=item["id"], output_index=at,
                       content_index=0, part=_reasoning_part(text))
        elif item["type"] == "message":
            text = "".join(self._text)
            self._emit("response.output_text.done", item_id=item["id"], output_index=at,
                       content_index=0, text=text, logprobs=self._logprobs)
            item["content"] = [_part(text, self._logprobs)]
            self._emit("response.content_part.done", item_id=item["id"], output_index=at,
                       content_index=0, part=item["content"][0])
        else:
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                       name=item["name"], arguments=item["arguments"])
        item["status"] = status
        self._emit("response.output_item.done", output_index=at, item=dict(item))


def _part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _usage(record: RequestRecord, reasoning_tokens: int = 0) -> dict:
    usage = protocol.usage([[record]])
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"]}


def _assistant_turn(output: Output) -> dict:
    """The answer as the assistant message a later turn (previous_response_id) sees."""
    calls = [{"id": c["call_id"], "type": "function",
              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in output.calls()]
    message: dict[str, Any] = {"role": "assistant", "content": output.text}
    if calls:
        message["tool_calls"] = calls
    if output.reasoning:
        message["reasoning_content"] = output.reasoning
    return message


@dataclasses.dataclass
class Stored:
    response: dict
    conversation: list[dict]  # as chat messages, through the answer: what previous_response_id continues
    items: list[dict]  # the request's input items
    frames: list[str] | None = None  # a background response's stream events (None: not background)


class ResponseStore:
    """The most recently used stored responses, bounded in count and in their size."""

    def __init__(self, capacity: int = STORE_RESPONSES, chars: int = STORE_CHARS):
        self._kept: Bounded[Stored] = Bounded(capacity, chars)

    def put(self, stored: Stored) -> None:
        size = sum(len(json.dumps(part)) for part in (stored.response, stored.conversation, stored.items))
        self._kept.add(stored.response["id"], stored, size + sum(map(len, stored.frames or ())))

    def get(self, response_id: str) -> Stored | None:
        return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id) is not None


class ResponsesAPI:
    def __init__(self, server: Server, store: ResponseStore | None = None,
                 conversations: ConversationStore | None = None):
        self.server = server
        self.store = store or ResponseStore()
        self.conversations = conversations or ConversationStore()
        self.running: dict[str, Background] = {}  # background responses not yet finished, by id

    def routes(self, route: Callable[[str, Any, list[str]], Route]) -> list[Route]:
        # (llama-server's aliases without /v1 too)
        one = "/v1/responses/{response_id}"
        return [*(route(path, self.create, ["POST"]) for path in ("/v1/responses", "/responses")),
                *(route(path, self.input_tokens, ["POST"])
                  for path in ("/v1/responses/input_tokens", "/responses/input_tokens")),
                route(one, self.retrieve, ["GET"]), route(one, self.delete, ["DELETE"]),
                route(one + "/cancel", self.cancel, ["POST"]),
                route(one + "/input_items", self.input_items, ["GET"])]

    def _named(self, request: Request) -> tuple[str, Background | None, Stored | None]:
        """The response the path names: its id, and its background job while it runs, else
        what is stored of it; a 404 if neither."""
        self.server._check(request)
        response_id = request.path_params["response_id"]
        job = self.running.get(response_id)
        stored = None if job is not None else self.store.get(response_id)
        if job is None and stored is None:
            raise APIError(404, f"Response with id '{response_id[:100]}' not found.",
                           param="response_id", code="not_found")
        return response_id, job, stored

    async def retrieve(self, request: Request) -> Response:
        """GET /v1/responses/{id}: the response as it stands. With `stream=true`, a background
        response's events after `starting_after` (a sequence number; all without it), to its
        end. (`include` and `include_obfuscation` change nothing.)"""
        response_id, job, stored = self._named(request)
        query = request.query_params
        stream = query.get("stream", "false")
        if stream not in ("true", "false"):
            raise APIError(400, '"stream" must be true or false', param="stream")
        if stream == "false":
            return JSONResponse(job.response if job is not None else stored.response)
        try:
            after = int(query.get("starting_after", "-1"))
        except ValueError:
            raise APIError(400, '"starting_after" must be an integer (a sequence number)',
                           param="starting_after") from None
        if job is None and stored.frames is None:
            raise APIError(400, f"Response '{response_id[:100]}' was not made in the background: only "
                           "a background response's events are kept to stream again", param="stream")
        frames = job.frames_after(after) if job is not None else _once(replay(stored.frames, after))
        return event_stream(frames, {}, self.server.ping())

    async def cancel(self, request: Request) -> Response:
        """POST /v1/responses/{id}/cancel: stops a background response; the response as it
        ended. Again, or once finished, it is the response as it is; one not made in the
        background is a 400."""
        response_id, job, stored = self._named(request)
        if job is not None:
            return JSONResponse(await job.cancel())
        if stored.frames is None:
            raise APIError(400, f"Response '{response_id[:100]}' was not made in the background: "
                           "only a background response can be cancelled", param="response_id")
        return JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        """DELETE /v1/responses/{id}: forgets a stored response (a later previous_response_id
        naming it is a 400); a background one still running is cancelled."""
        response_id, job, _ = self._named(request)
        if job is not None:
            job.run.stored = False
            await job.cancel()
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        """GET /v1/responses/{id}/input_items: the items the response's request gave, a page
        at a time as OpenAI lists them (`order` desc by default, `limit` 1 to 100 (20), `after`
        and `before` an item id; `include` changes nothing)."""
        _, job, stored = self._named(request)
        return JSONResponse(page(job.run.items if job is not None else stored.items, request.query_params))

    def _conversation(self, body: dict) -> Conversation | None:
        """The conversation the request names (`conversation`: its id, or {"id"}), if any."""
        named = body.get("conversation")
        if isinstance(named, dict) and set(named) == {"id"}:
            named = named["id"]
        if named is None:
            return None
        if not isinstance(named, str):
            raise APIError(400, '"conversation" must be a conversation id or {"id": ...}', param="conversation")
        try:
            return self.conversations.get(named)
        except APIError as e:
            raise APIError(404, e.message, param="conversation", code="not_found") from None

    def _history(self, previous: str) -> list[dict]:
        """The conversation a stored response ended, for `previous_response_id`."""
        if previous in self.running:
            raise APIError(400, f"Previous response with id '{previous[:100]}' is still being made "
                           "in the background: wait for it to finish.", param="previous_response_id")
        stored = self.store.get(previous)
        if stored is None:
            raise APIError(400, f"Previous response with id '{previous[:100]}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        return list(stored.conversation)

    def _parsed(self, body: Any) -> tuple[protocol.ParsedRequest, list[dict], Conversation | None]:
        """A Responses body as the chat request that answers it (after the conversation its
        previous_response_id names), that conversation, and the Conversations API's conversation
        it names (`conversation`), if any; errors in the Responses' names."""
        try:
            protocol.known_fields(body, ALLOWED)
            previous = parsing.field(body, "previous_response_id", (str,))
            parsing.field(body, "stream", (bool,))
            store = parsing.field(body, "store", (bool,), True)
            if parsing.field(body, "background", (bool,), False) and not store:
                raise APIError(400, 'a background response is stored: "background": true cannot go '
                               'with "store": false', param="background")
            parsing.field(body, "stream_options", (dict,))
            history: list[dict] = []
            named = self._conversation(body)
            if named is not None and previous is not None:
                raise APIError(400, '"conversation" cannot go with "previous_response_id": each '
                               "names the turns before the input", param="conversation")
            if named is not None:
                history = input_messages(named.items)
            if previous is not None:
                history = self._history(previous)
            chat, conversation = chat_body(body, history)
            parsed = protocol.parse(chat, True, self.server.defaults, self.server.config.max_n)
        except SubmissionError as e:
            raise APIError(400, str(e), param=e.param) from None
        except APIError as e:
            raise renamed(e) from None
        self.server.models.check(parsed.model)
        if body.get("background"):  # its admission, as its prompt's progress: "in_progress"
            parsed = dataclasses.replace(parsed, params=dataclasses.replace(parsed.params, progress=True))
        return parsed, conversation, named
    async def input_tokens(self, request: Request) -> Response:
        """POST /v1/responses/input_tokens (OpenAI's): the prompt's tokens, as the response's
        usage would count them: {"object": "response.input_tokens", "input_tokens"} (with
        truncation "auto", of the turns that would be kept)."""
        body = await self.server.read_body(request)
        parsed, _, _ = self._parsed(body)
        scheduler = self.server.scheduler
        try:
            while True:
                counted = await input_tokens(self.server, parsed)
                try:
                    check_length(counted["input_tokens"], parsed.params.max_tokens, scheduler.context,
                                 scheduler.max_seq_len)
                    return JSONResponse(counted)
                except RequestTooLong:
                    shorter = truncated(parsed.messages) if body.get("truncation") == "auto" else None
                    if shorter is None:
                        return JSONResponse(counted)  # (what a response would refuse, counted)
                    parsed = dataclasses.replace(parsed, messages=shorter)
        except APIError as e:
            raise renamed(e) from None

    async def create(self, request: Request) -> Response:
        server = self.server
        body = await server.read_body(request)
        parsed, conversation, named = self._parsed(body)
        stream = parsing.field(body, "stream", (bool,), False)  # (both checked by _parsed)
        store = parsing.field(body, "store", (bool,), True)
        request_id = protocol.request_id(request.headers, "resp")
        while True:
            try:
                groups = await server.submit(parsed, request_id)
                break
            except APIError as e:
                shorter = (truncated(parsed.messages) if body.get("truncation") == "auto"
                           and e.code == "context_length_exceeded" else None)
                if shorter is None:
                    raise renamed(e) from None
                parsed = dataclasses.replace(parsed, messages=shorter)
        # (the conversation found at parse time: one deleted while the request was submitted
        # still gets its items, and the request is answered)
        run = _Run(self, body, parsed, conversation if store else None, named)
        headers = {"X-Request-Id": request_id}
        if run.background:
            job = self.running[run.id] = Background(run, groups[0][0], self._finished)
            if stream:
                return event_stream(job.frames_after(-1), headers, server.ping())
            return JSONResponse(job.response, headers=headers)
        if stream:
            return event_stream(run.events(groups[0][0]), headers, server.ping())
        output = run.output()  # token by token, as a stream builds it
        record = await output.collect(server, request, groups[0][0])
        return JSONResponse(run.finish(output, record), headers=headers)

    def _finished(self, job: Background) -> None:
        """A background response has ended: stored, with its events, unless deleted meanwhile."""
        del self.running[job.run.id]
        if job.run.stored and job.run.conversation is not None and job.run.finished is not None:
            self.store.put(job.run.as_stored(job.output, job.frames))


class _Run:
    """One response being made: its settings echoed, its output, its storing."""

    def __init__(self, api: ResponsesAPI, body: dict, parsed: protocol.ParsedRequest,
                 conversation: list[dict] | None, named: Conversation | None = None):
        self.api, self.parsed, self.conversation, self.named = api, parsed, conversation, named
        self.items = input_items(body["input"]) if conversation is not None or named else []
        self.id = new_id("resp")
        self.created = int(time.time())
        self.background = body.get("background") is True
        self.stored = True  # (false once deleted while made in the background)
        self.finished: dict | None = None  # the response as it ended
        sampling = parsed.params.sampling
        text = body.get("text") or {}
        self.settings = {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_logprobs": body.get("top_logprobs") or 0,
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "text": {"format": text.get("format") or {"type": "text"},
                     **({"verbosity": text["verbosity"]} if text.get("verbosity") else {})},
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store") is not False, "metadata": body.get("metadata") or {},
            "truncation": body.get("truncation") or "disabled", "reasoning": body.get("reasoning"),
            "user": body.get("user"),
            "background": self.background, "service_tier": body.get("service_tier"),
            "prompt_cache_key": body.get("prompt_cache_key"),
            "safety_identifier": body.get("safety_identifier"),
            "conversation": {"id": named.id} if named is not None else None,
        }

    def output(self) -> Output:
        output = Output.of(self.parsed, self.api.server.call_style)
        if self.parsed.params.logprobs is not None:
            output.format = protocol.LogprobFormat(self.api.server.tokenizer, chat=True)
        return output

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created,
                "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
                "status": status, "model": self.api.server.models.answer(self.parsed.model),
                "output": output, "usage": usage, "error": error, "incomplete_details": incomplete, **self.settings}

    def finish(self, output: Output, record: RequestRecord) -> dict:
        """The response as its request ended: "completed"; "incomplete" when cut off by the
        limit; "cancelled"; "failed" (its error said). Stored if asked (a background one once
        its events are all made), its input and output added to the conversation it names."""
        status = {"length": "incomplete", "abort": "cancelled", "error": "failed"}.get(record.finish_reason,
                                                                                       "completed")
        output.finish("completed" if status == "completed" else "incomplete")
        error = ({"code": "server_error", "message": f"generation failed: {record.error}"}
                 if status == "failed" else None)
        self.finished = self.response(status, output.output, _usage(record, output.reasoning_tokens), error)
        if self.conversation is not None and not self.background:
            self.api.store.put(self.as_stored(output))
        if self.named is not None:  # its input and output join the conversation named
            self.api.conversations.extend(self.named, [*self.items, *map(dict, output.output)])
        return self.finished

    def as_stored(self, output: Output, frames: list[str] | None = None) -> Stored:
        return Stored(self.finished, [*self.conversation, _assistant_turn(output)], self.items, frames)

    async def updates(self, stream: RequestStream, output: Output) -> AsyncIterator[list[tuple[str, dict]]]:
        """The response's stream events (type, fields), a list at a time as its tokens come;
        a background response's "queued" until its request is admitted (its first event)."""
        start = self.response("queued" if self.background else "in_progress", [])
        yield [("response.created", {"response": start}),
               ("response.queued" if self.background else "response.in_progress", {"response": start})]
        admitted = not self.background
        async for batch in merged([stream]):
            for _, event in batch:
                if not admitted and isinstance(event, PromptProgress | TokenEvent):
                    admitted = True
                    output.events.append(("response.in_progress", {"response": self.response("in_progress", [])}))
                if isinstance(event, PromptProgress):
                    continue
                if isinstance(event, TokenEvent):
                    output.feed(event.text, event.logprobs)
                    continue
                response = self.finish(output, event)
                if response["status"] == "failed":
                    output.events.append(("error", {**response["error"], "param": None}))
                if response["status"] != "cancelled":  # (no event says so: the stream ends)
                    output.events.append((f"response.{response['status']}", {"response": response}))
            if output.events:
                events, output.events = output.events, []
                yield events

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        """The response's stream, as a client reads it: its request cancelled if it goes away."""
        sequence_number = 0
        try:
            async for events in self.updates(stream, self.output()):
                yield "".join(frame(kind, fields, sequence_number + i) for i, (kind, fields) in enumerate(events))
                sequence_number += len(events)
        finally:
            if stream.record is None:  # the client went away mid-stream
                stream.cancel()


async def _once(frames: list[str]) -> AsyncIterator[str]:
    yield "".join(frames)
