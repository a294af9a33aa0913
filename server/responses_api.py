"""OpenAI's Responses API on cadence's chat path: POST /v1/responses and GET /v1/responses/{id}.

    api = ResponsesAPI(server)               # server: the app's `Server`
    routes = api.routes(route)               # create_app's route wrapper -> two Routes

A Responses request is translated into a chat-completions body and parsed by `protocol.parse`
exactly as a chat is, so every field it shares with chat is checked, defaulted and refused by
the same code (with the Responses name in the message: `max_output_tokens`, `text.format`,
`input`):

    instructions              -> a first "system" message (not carried by previous_response_id)
    input                     -> messages: a string is one user turn; message items (user,
                                 system, developer -> system, assistant; input_text/output_text
                                 parts) are turns, function_call items join one assistant turn's
                                 tool_calls, function_call_output items are "tool" turns
    max_output_tokens         -> max_tokens
    text.format               -> response_format (text, json_object, json_schema)
    tools (flat functions)    -> chat tools; tool_choice {"type": "function", "name"} -> named
    temperature, top_p, parallel_tool_calls, and cadence's own sampling fields (top_k, seed,
    stop, penalties, ignore_eos, ...) as chat takes them

The answer is run through `Server.submit` and split into output items token by token, by the
same code whether it is streamed or not: a thinking model's reasoning (where the server splits
it, `server.reasoning`) as a `reasoning` item of `reasoning_text` first, one `message` item of
`output_text` for the text, one `function_call` item per call (`ToolCallParser`). A `reasoning`
item in `input` (a client that keeps the conversation itself sends back what it was given)
becomes the next assistant turn's `reasoning_content`, which a template may show the model.
Streaming sends OpenAI's typed events (`event: <type>` + `data: <json>`, with increasing
`sequence_number`), which the SDK's `responses.stream` accumulator reads unchanged.

`store` (default true, as OpenAI's) keeps a response in memory, bounded (`ResponseStore`: the
most recent, in count and in characters); a stored response keeps its whole conversation
(earlier turns, input, output), which `previous_response_id` puts before the next request's
input. Fields that would change the answer and are not implemented (`background`, `truncation:
"auto"`, `include`, `prompt`, `conversation`, non-function tools, ...) are refused with a 400
naming them; harmless ones are accepted and ignored.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.request import RequestRecord, TokenEvent
from cadence.scheduler.stream import merged
from cadence.server import parsing, protocol
from cadence.server.answer_parts import AnswerParts
from cadence.server.api_error import APIError
from cadence.server.info_api import input_tokens
from cadence.server.reasoning import ReasoningParser
from cadence.server.tool_call_parser import ToolCallParser

if TYPE_CHECKING:
    from cadence.server.app import Server

STORE_RESPONSES = 1024  # stored responses kept, the most recent
STORE_CHARS = 64 * 2**20  # ... and their conversations' characters, all together

# Fields translated into the chat request, or answered here.
_FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                     "text", "tools", "tool_choice", "parallel_tool_calls", "stream",
                     "stream_options", "store", "previous_response_id"})
# cadence's own sampling fields, passed to the chat request as they are (max_tokens is
# max_output_tokens here).
_SAMPLING = frozenset(parsing.SAMPLING_FIELDS) - {"max_tokens"}
# Accepted (of these types) and ignored: they change nothing cadence does (`reasoning`: its effort
# and summary steer OpenAI's reasoning models; `metadata` is echoed).
_IGNORED: dict[str, type] = {"metadata": dict, "user": str, "prompt_cache_key": str,
                             "safety_identifier": str, "service_tier": str, "reasoning": dict,
                             "prompt_cache_retention": str}
# Would change the answer; accepted only at their neutral values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "background": (False,), "truncation": ("disabled",), "include": ([],), "prompt": (),
    "conversation": (), "max_tool_calls": (), "top_logprobs": (0,), "context_management": (),
}
_ALLOWED = _FIELDS | _SAMPLING | _IGNORED.keys() | _NEUTRAL.keys()
# A chat error's field, as the Responses request names it.
_PARAM = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
# An item's fields besides those checked by name: an earlier output's items and parts have these.
_PART_FIELDS = {"type": str, "text": str, "annotations": list, "logprobs": list}
_ITEM_FIELDS = {"type": str, "id": str, "status": str}
_MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")


def _error(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _renamed(e: APIError) -> APIError:
    """A chat parse's error in the Responses request's names."""
    e = e.renamed(_PARAM)
    e.message = e.message.replace("max_tokens", "max_output_tokens")  # (the context check's words)
    return e


# -- the request ------------------------------------------------------------------------------


def _text_parts(content: Any, where: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str | list[dict]:
    """A message's content: a string, or its text parts in chat's shape (chat joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _error(f"{where}.content must be a string or an array of text parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _error(f"{where}.content[{j}]: parts of type {str(kind)[:40]!r} are not supported "
                         f"(cadence serves text: {', '.join(kinds)} parts with a \"text\" string)",
                         "input")
        _check_keys(part, _PART_FIELDS, f"{where}.content[{j}]")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _check_keys(item: dict, allowed: dict[str, type], where: str) -> None:
    """No fields but `allowed`'s, each of its type (the required ones are checked by name)."""
    unknown = sorted(set(item) - allowed.keys())
    if unknown:
        raise _error(f"{where} has unknown field(s) {', '.join(unknown)}", "input")
    wrong = next((k for k, kind in allowed.items() if k in item and not isinstance(item[k], kind)), None)
    if wrong is not None:
        raise _error(f"{where}.{wrong} must be {parsing._TYPE_NAMES[allowed[wrong]]}", "input")


def input_messages(items: Any) -> list[dict]:
    """`input` as chat messages (see the module doc); anything else is a 400 naming it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _error('"input" must be a string or an array of input items', "input")
    messages: list[dict] = []
    thought: list[str] = []  # reasoning items' text, for the assistant turn they come before

    def assistant(message: dict) -> dict:
        if thought:
            message["reasoning_content"] = "\n".join(thought)
            thought.clear()
        return message

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _error(f"{where} must be an object (an input item)", "input")
        kind = item.get("type", "message" if "role" in item else None)
        assistant_turn = kind == "function_call" or (kind == "message" and item.get("role") == "assistant")
        if kind != "reasoning" and not assistant_turn:
            thought.clear()  # reasoning goes with the assistant turn right after it, or nowhere
        if kind == "reasoning":
            thought.append(_reasoning_text(item, where))
        elif kind == "message":
            _check_keys(item, {**_ITEM_FIELDS, "role": object, "content": object, "phase": str}, where)
            role = item.get("role")
            role = _MESSAGE_ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise _error(f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}, got "
                             f"{str(item.get('role'))[:40]!r}", "input")
            message = {"role": role, "content": _text_parts(item.get("content"), where)}
            messages.append(assistant(message) if role == "assistant" else message)
        elif kind == "function_call":
            _check_keys(item, {**_ITEM_FIELDS, "call_id": str, "name": str, "arguments": str}, where)
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _error(f'{where} (function_call) needs "call_id", "name" and "arguments" strings',
                             "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            # A turn's calls, and the text before them, are one assistant message.
            if i > 0 and messages and messages[-1]["role"] == "assistant" and not thought:
                messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", ()), call]
            else:
                messages.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind == "function_call_output":
            _check_keys(item, {**_ITEM_FIELDS, "call_id": str, "output": object}, where)
            if not isinstance(item.get("call_id"), str):
                raise _error(f'{where} (function_call_output) needs a "call_id" string', "input")
            output = _text_parts(item.get("output"), where, ("input_text",))
            if isinstance(output, list):
                output = "\n".join(part["text"] for part in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise _error(f"{where}: items of type {str(kind)[:40]!r} are not supported by cadence "
                         "(it takes message, reasoning, function_call and function_call_output "
                         "items)", "input")
    return messages


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its `reasoning_text` content, else its summary's text. Only
    what cadence wrote can come back (no encrypted content: cadence never makes any)."""
    _check_keys(item, {**_ITEM_FIELDS, "summary": object, "content": object, "encrypted_content": object},
                where)
    if item.get("encrypted_content") is not None:
        raise _error(f"{where}: encrypted reasoning is another server's; cadence cannot read it",
                     "input")
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise _error(f"{where}.{key} must be an array of parts", "input")
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get("text"), str):
                raise _error(f"{where}.{key}[{j}] must be a {kind} part with a \"text\" string", "input")
        if parts:
            return "".join(part["text"] for part in parts)
    return ""


def _chat_tools(tools: Any) -> Any:
    """Responses' flat function tools in chat's shape; other tool types are a 400."""
    if not isinstance(tools, list):
        return tools  # chat's check words the error
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind != "function":
            raise _error(f"tools[{i}]: tools of type {str(kind)[:40]!r} are not supported by "
                         "cadence (function tools only)", "tools")
        unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise _error(f"tools[{i}] has unknown field(s) {', '.join(unknown)}", "tools")
        out.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                      if k != "type" and v is not None}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or set(choice) != {"type", "name"}:
        raise _error('"tool_choice" must be "none", "auto", "required" or {"type": "function", '
                     '"name": ...} (cadence calls function tools only)', "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: Any) -> dict | None:
    """`text` ({"format": ..., "verbosity": ...}) as chat's response_format."""
    if text is None:
        return None
    if (not isinstance(text, dict) or set(text) - {"format", "verbosity"}
            or not isinstance(text.get("verbosity", ""), (str, type(None)))):
        raise _error('"text" must be an object with "format" (and "verbosity", a string)', "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _error('"text.format" must be an object', "text.format")
    if fmt.get("type") != "json_schema":
        return fmt  # text, json_object, or chat's error for anything else
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def chat_body(body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """A Responses body (of known fields: `_ALLOWED`; checked here for unsupported ones) as a
    chat body, and the conversation it continues with (history, then its input: what a stored
    response keeps)."""
    for name, neutral in _NEUTRAL.items():
        if body.get(name) is not None and not any(protocol._same(body[name], n) for n in neutral):
            raise _error(f'"{name}" is not supported by cadence (only its neutral value '
                         f"{', '.join(map(json.dumps, neutral)) or 'null'} is accepted)", name)
    for name, kind in _IGNORED.items():
        parsing.field(body, name, (kind,))
    if body.get("input") is None:
        raise _error('"input" is required: a string or an array of input items', "input")
    instructions = parsing.field(body, "instructions", (str,))
    conversation = history + input_messages(body["input"])
    system = [{"role": "system", "content": instructions}] if instructions is not None else []
    chat = {"messages": system + conversation, "model": body.get("model"),
            "max_tokens": body.get("max_output_tokens"),
            "response_format": _response_format(body.get("text")),
            "tools": _chat_tools(body.get("tools")),
            "tool_choice": _chat_tool_choice(body.get("tool_choice")),
            **{k: body[k] for k in ("temperature", "top_p", "parallel_tool_calls", *_SAMPLING) if k in body}}
    return {k: v for k, v in chat.items() if v is not None}, conversation


# -- the answer -------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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

    def finish(self, status: str) -> None:
        """Closes the open item; `status` is the answer's: "completed" or "incomplete"."""
        self.finish_parts()
        if not any(item["type"] != "reasoning" for item in self.output):
            # an empty answer (or one of abandoned calls, or all reasoning) is still a message
            self._content("", force=True)
        self._close(status)

    @property
    def output(self) -> list[dict]:
        return [item for i, item in enumerate(self.items) if i not in self._dropped]

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
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            self.items.append(item)
            self._emit("response.output_item.added", output_index=self._open, item=dict(item))
            self._emit("response.content_part.added", item_id=item["id"], output_index=self._open,
                       content_index=0, part=_part(""))
            self._text = []
        if text:
            self._text.append(text)
            self._emit("response.output_text.delta", item_id=self.items[self._open]["id"],
                       output_index=self._open, content_index=0, delta=text, logprobs=[])

    def on_reasoning(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self.items[self._open]["type"] != "reasoning":
            self._close("completed")
            self._open = len(self.items)
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "encrypted_content": None, "status": "in_progress"}
            self.items.append(item)
            self._emit("response.output_item.added", output_index=self._open, item=dict(item))
            self._emit("response.content_part.added", item_id=item["id"], output_index=self._open,
                       content_index=0, part=_reasoning_part(""))
            self._text = []
        self._text.append(text)
        self._emit("response.reasoning_text.delta", item_id=self.items[self._open]["id"],
                   output_index=self._open, content_index=0, delta=text)

    def on_call(self, entry: dict) -> None:
        fragment = entry["function"].get("arguments", "")
        if "id" in entry:  # a header: a new call
            self._close("completed")
            self._open = self._calls[entry["index"]] = len(self.items)
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
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
                       content_index=0, text=text, logprobs=[])
            item["content"] = [_part(text)]
            self._emit("response.content_part.done", item_id=item["id"], output_index=at,
                       content_index=0, part=_part(text))
        else:
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                       name=item["name"], arguments=item["arguments"])
        item["status"] = status
        self._emit("response.output_item.done", output_index=at, item=dict(item))


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


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


class ResponseStore:
    """The most recent stored responses, bounded in count and in their conversations' size;
    each is (the response object, its conversation as chat messages)."""

    def __init__(self, capacity: int = STORE_RESPONSES, chars: int = STORE_CHARS):
        self.capacity, self.chars = capacity, chars
        self._entries: collections.OrderedDict[str, tuple[dict, list[dict], int]] = collections.OrderedDict()
        self._size = 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(conversation)) + len(json.dumps(response))
        self._entries[response["id"]] = (response, conversation, size)
        self._size += size
        while self._entries and (len(self._entries) > self.capacity or self._size > self.chars):
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._size -= dropped

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0], entry[1]


class ResponsesAPI:
    def __init__(self, server: Server, store: ResponseStore | None = None):
        self.server = server
        self.store = store or ResponseStore()

    def routes(self, route: Callable[[str, Any, list[str]], Route]) -> list[Route]:
        # (llama-server's aliases without /v1 too)
        return [*(route(path, self.create, ["POST"]) for path in ("/v1/responses", "/responses")),
                *(route(path, self.input_tokens, ["POST"])
                  for path in ("/v1/responses/input_tokens", "/responses/input_tokens")),
                route("/v1/responses/{response_id}", self.retrieve, ["GET"])]

    async def retrieve(self, request: Request) -> Response:
        self.server._check(request)
        response_id = request.path_params["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id[:100]}' not found.",
                           param="response_id", code="not_found")
        return JSONResponse(stored[0])

    def _parsed(self, body: Any) -> tuple[protocol.ParsedRequest, list[dict]]:
        """A Responses body as the chat request that answers it (after the conversation its
        previous_response_id names), and that conversation; errors in the Responses' names."""
        try:
            protocol.known_fields(body, _ALLOWED)
            previous = parsing.field(body, "previous_response_id", (str,))
            parsing.field(body, "stream", (bool,))
            parsing.field(body, "store", (bool,))
            parsing.field(body, "stream_options", (dict,))
            history: list[dict] = []
            if previous is not None:
                stored = self.store.get(previous)
                if stored is None:
                    raise APIError(400, f"Previous response with id '{previous[:100]}' not found.",
                                   param="previous_response_id", code="previous_response_not_found")
                history = list(stored[1])
            chat, conversation = chat_body(body, history)
            parsed = protocol.parse(chat, True, self.server.defaults, self.server.config.max_n)
        except SubmissionError as e:
            raise APIError(400, str(e), param=e.param) from None
        except APIError as e:
            raise _renamed(e) from None
        self.server.models.check(parsed.model)
        return parsed, conversation

    async def input_tokens(self, request: Request) -> Response:
        """POST /v1/responses/input_tokens (OpenAI's): the prompt's tokens, as the response's
        usage would count them: {"object": "response.input_tokens", "input_tokens"}."""
        parsed, _ = self._parsed(await self.server.read_body(request))
        try:
            return JSONResponse(await input_tokens(self.server, parsed))
        except APIError as e:
            raise _renamed(e) from None

    async def create(self, request: Request) -> Response:
        server = self.server
        body = await server.read_body(request)
        parsed, conversation = self._parsed(body)
        stream = parsing.field(body, "stream", (bool,), False)  # (both checked by _parsed)
        store = parsing.field(body, "store", (bool,), True)
        request_id = protocol.request_id(request.headers, "resp")
        try:
            groups = await server.submit(parsed, request_id)
        except APIError as e:
            raise _renamed(e) from None
        run = _Run(self, body, parsed, conversation if store else None)
        headers = {"X-Request-Id": request_id}
        if stream:
            return StreamingResponse(run.events(groups[0][0]), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        output = run.output()  # token by token, as a stream builds it
        record = await output.collect(server, request, groups[0][0])
        return JSONResponse(run.finish(output, record), headers=headers)


class _Run:
    """One response being made: its settings echoed, its output, its storing."""

    def __init__(self, api: ResponsesAPI, body: dict, parsed: protocol.ParsedRequest,
                 conversation: list[dict] | None):
        self.api, self.parsed, self.conversation = api, parsed, conversation
        self.id = _new_id("resp")
        self.created = int(time.time())
        sampling = parsed.params.sampling
        text = body.get("text") or {}
        self.settings = {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "text": {"format": text.get("format") or {"type": "text"},
                     **({"verbosity": text["verbosity"]} if text.get("verbosity") else {})},
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store") is not False, "metadata": body.get("metadata") or {},
            "truncation": "disabled", "reasoning": body.get("reasoning"), "user": body.get("user"),
            "background": False, "service_tier": body.get("service_tier"),
            "prompt_cache_key": body.get("prompt_cache_key"),
            "safety_identifier": body.get("safety_identifier"),
        }

    def output(self) -> Output:
        return Output.of(self.parsed, self.api.server.call_style)

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created,
                "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
                "status": status, "model": self.api.server.models.answer(self.parsed.model),
                "output": output, "usage": usage, "error": error, "incomplete_details": incomplete, **self.settings}

    def finish(self, output: Output, record: RequestRecord) -> dict:
        """The finished response (stored if asked): "incomplete" when cut off by the limit."""
        status = "incomplete" if record.finish_reason == "length" else "completed"
        output.finish(status)
        response = self.response(status, output.output, _usage(record, output.reasoning_tokens))
        if self.conversation is not None:
            self.api.store.put(response, [*self.conversation, _assistant_turn(output)])
        return response

    async def events(self, stream) -> AsyncIterator[str]:
        seq = 0

        def frames(events: list[tuple[str, dict]]) -> str:
            nonlocal seq
            out = []
            for kind, fields in events:
                out.append(f"event: {kind}\ndata: "
                           f"{protocol._ENCODE({'type': kind, 'sequence_number': seq, **fields})}\n\n")
                seq += 1
            return "".join(out)

        output = self.output()
        start = self.response("in_progress", [])
        yield frames([("response.created", {"response": start}),
                      ("response.in_progress", {"response": start})])
        try:
            async for batch in merged([stream]):
                for _, event in batch:
                    if isinstance(event, TokenEvent):
                        output.feed(event.text)
                        continue
                    if event.finish_reason == "error":
                        message = f"generation failed: {event.error}"
                        error = {"code": "server_error", "message": message}
                        output.events.append(("error", {"code": "server_error", "message": message,
                                                        "param": None}))
                        output.events.append(("response.failed", {"response": self.response(
                            "failed", output.output, _usage(event, output.reasoning_tokens), error)}))
                    else:
                        response = self.finish(output, event)
                        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                        output.events.append((kind, {"response": response}))
                if output.events:
                    events, output.events = output.events, []
                    yield frames(events)
        finally:
            if stream.record is None:  # the client went away mid-stream
                stream.cancel()
