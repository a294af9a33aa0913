"""Anthropic's Messages API on cadence's chat path: POST /v1/messages and
POST /v1/messages/count_tokens, for the clients written against it (the anthropic SDK, Claude
Code, LangChain's ChatAnthropic), as vLLM and llama-server serve it.

    api = MessagesAPI(server)                # server: the app's `Server`
    routes = api.routes(route)               # create_app's route wrapper -> two Routes

A Messages request is translated into a chat-completions body and parsed by `protocol.parse`
exactly as a chat is, so every field it shares with chat is checked, defaulted and refused by
the same code (errors name the Messages fields: `stop_sequences`, `output_config.format`):

    system                    -> a first "system" message (a string or text blocks)
    messages                  -> chat turns: text blocks are the content; an assistant's
                                 tool_use blocks its tool_calls (input as the arguments' JSON),
                                 its thinking blocks its reasoning_content; a user's tool_result
                                 blocks "tool" turns, before its text
    a final assistant turn    -> continue_final_message: the answer continues it (prefill)
    max_tokens (required; a cap), temperature, top_p, top_k, stop_sequences -> chat's fields
    tools (custom), tool_choice (auto, any, tool, none; disable_parallel_tool_use)
    thinking                  -> chat_template_kwargs.enable_thinking (enabled: true,
                                 disabled: false; absent: the model's template decides)
    output_config.format      -> response_format (a JSON schema)
    and cadence's own sampling fields (seed, min_p, penalties, ...) as chat takes them

The answer is split token by token (`answer_parts.AnswerParts`) into content blocks: a thinking
model's reasoning as `thinking`, the text as `text`, each call as `tool_use`; streamed, as
Anthropic's events (message_start, content_block_start/delta/stop, message_delta,
message_stop), which the SDK's stream accumulator reads unchanged. A call's block goes out once
the call stands (its arguments closed and parsed), whole: its text is never sent twice, even
for a candidate that turns out to be no call. `max_tokens` is a cap: past the context's end the
answer stops there. `stop_reason`: max_tokens when cut off by it (model_context_window_exceeded
by the context), tool_use for an answer with calls, stop_sequence (and which) for a stop
string, else end_turn. Usage
counts the prompt's tokens served from the prefix cache as cache_read_input_tokens, the rest as
input_tokens (Anthropic's split). Errors come in Anthropic's shape. Clients send their key as
`x-api-key` or as a bearer token; either is checked. Fields that would change the answer and are
not implemented (images, documents, server tools, MCP servers, containers) are a 400 naming
them; `cache_control`, `metadata` and the like are accepted and change nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.request import RequestRecord, TokenEvent
from cadence.scheduler.stream import merged
from cadence.server import parsing, protocol
from cadence.server.answer_parts import AnswerParts
from cadence.server.api_error import APIError
from cadence.server.event_stream import event_stream
from cadence.server.info_api import input_tokens
from cadence.server.reasoning import ReasoningParser
from cadence.server.tool_call_parser import ToolCall, ToolCallParser

if TYPE_CHECKING:
    from cadence.server.app import Server

# Fields translated into the chat request.
_FIELDS = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "stream",
                     "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking",
                     "output_config", "chat_template_kwargs"})
# cadence's own sampling fields, passed to the chat request as they are (the Messages API
# names max_tokens, temperature, top_p and top_k the same; stop is stop_sequences here).
_SAMPLING = frozenset(parsing.SAMPLING_FIELDS) - {"stop"}
# Accepted (of these types) and ignored: they change nothing cadence does (`cache_control`:
# the prefix cache keeps every prompt's pages without being asked; `speed` and `service_tier`
# choose among Anthropic's capacity; `diagnostics` asks why its prompt cache missed).
_IGNORED: dict[str, type] = {"metadata": dict, "cache_control": dict, "service_tier": str,
                             "speed": str, "inference_geo": str, "diagnostics": dict,
                             "user_profile_id": str, "workspace_id": str}
# Would change the answer; accepted only when absent or null.
_NEUTRAL = ("container", "mcp_servers", "context_management")
_ALLOWED = _FIELDS | _SAMPLING | _IGNORED.keys() | set(_NEUTRAL)
_COUNT_ALLOWED = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking",
                            "output_config", "chat_template_kwargs", *_IGNORED, *_NEUTRAL})
# A chat error's field, as the Messages request names it.
_PARAM = {"stop": "stop_sequences", "response_format": "output_config.format"}
# Blocks' fields that change nothing here: `cache_control` (the prefix cache is automatic),
# `citations` (cadence cites nothing).
_BLOCK_EXTRAS = {"cache_control": (dict, type(None)), "citations": (list, type(None))}
# A tool's, likewise (`eager_input_streaming`: cadence streams a call's input as it comes anyway).
_TOOL_EXTRAS = {"cache_control": (dict, type(None)), "eager_input_streaming": (bool, type(None))}
# Anthropic's error types by status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def _error(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(e: APIError) -> dict:
    """An error in Anthropic's shape."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


# -- the request ------------------------------------------------------------------------------


def _block(block: Any, where: str, kinds: dict[str, tuple[str, ...]], fields: dict[str, Any]) -> dict:
    """A content block of one of `kinds` (its type -> the fields it needs), with only `fields`
    (each of its type) and the extras every block may carry."""
    param = where.partition("[")[0]  # "system" or "messages"
    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
    if not isinstance(kind, str) or kind not in kinds:
        raise _error(f"{where}: blocks of type {str(kind)[:40]!r} are not supported by cadence "
                     f"(it takes {', '.join(kinds)} blocks here)", param)
    allowed = {"type": str, **fields, **_BLOCK_EXTRAS}
    unknown = sorted(set(block) - allowed.keys())
    if unknown:
        raise _error(f"{where} has unknown field(s) {', '.join(unknown)}", param)
    wrong = next((name for name, of in allowed.items() if name in block and not isinstance(block[name], of)), None)
    if wrong is not None:
        raise _error(f"{where}.{wrong} has the wrong type", param)
    missing = [name for name in kinds[kind] if name not in block]
    if missing:
        raise _error(f"{where} (a {kind} block) needs {', '.join(map(repr, missing))}", param)
    return block


def _texts(content: Any, where: str) -> list[dict]:
    """A string, or text blocks, as chat's text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _error(f"{where} must be a string or an array of text blocks", where.partition("[")[0])
    parts = []
    for j, block in enumerate(content):
        block = _block(block, f"{where}[{j}]", {"text": ("text",)}, {"text": str})
        parts.append({"type": "text", "text": block["text"]})
    return parts


def _user_turns(content: Any, where: str) -> list[dict]:
    """A user message: its tool results as "tool" turns, then its text as one user turn."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _error(f"{where}.content must be a string or an array of content blocks", "messages")
    turns: list[dict] = []
    text: list[dict] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        block = _block(block, at, {"text": ("text",), "tool_result": ("tool_use_id",)},
                       {"text": str, "tool_use_id": str, "content": (str, list), "is_error": bool})
        if block["type"] == "text":
            text.append({"type": "text", "text": block["text"]})
            continue
        result = block.get("content", "")
        if isinstance(result, list):  # (text blocks: chat joins them as it joins a turn's parts)
            result = _texts(result, f"{at}.content")
        turns.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
    if text or not turns:
        turns.append({"role": "user", "content": text})
    return turns


def _assistant_turn(content: Any, where: str) -> dict:
    """An assistant message: its text, its tool_use blocks as calls, its thinking as reasoning."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _error(f"{where}.content must be a string or an array of content blocks", "messages")
    text, calls, thought = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "redacted_thinking":
            raise _error(f"{at}: redacted thinking is another server's; cadence cannot read it",
                         "messages")
        block = _block(block, at, {"text": ("text",), "tool_use": ("id", "name", "input"),
                                   "thinking": ("thinking",)},
                       {"text": str, "id": str, "name": str, "input": dict, "thinking": str,
                        "signature": str})
        if block["type"] == "text":
            text.append({"type": "text", "text": block["text"]})
        elif block["type"] == "thinking":
            thought.append(block["thinking"])
        else:
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    if thought:
        turn["reasoning_content"] = "\n".join(thought)
    return turn


def _add(turns: list[dict], turn: dict) -> None:
    """Appends a turn; a user or assistant turn right after one of its role joins it, as
    Anthropic combines consecutive turns of a role (a template may refuse two in a row)."""
    last = turns[-1] if turns else None
    if last is None or last["role"] != turn["role"] or turn["role"] == "tool":
        turns.append(turn)
        return
    parts = [[{"type": "text", "text": c}] if isinstance(c, str) else c for c in (last["content"], turn["content"])]
    last["content"] = [part for part in parts[0] + parts[1] if part["text"]]  # (joined as a turn's blocks)
    if turn.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", ()), *turn["tool_calls"]]
    if turn.get("reasoning_content"):
        last["reasoning_content"] = "\n".join(filter(None, (last.get("reasoning_content"), turn["reasoning_content"])))


def chat_messages(system: Any, messages: Any) -> tuple[list[dict], bool]:
    """`system` and `messages` as chat messages, and whether the last is an assistant turn the
    answer continues (Anthropic's prefill)."""
    turns = [] if system is None else [{"role": "system", "content": _texts(system, "system")}]
    if not isinstance(messages, list) or not messages:
        raise _error('"messages" must be a non-empty array of messages', "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _error(f"{where} must be an object with a role and content", "messages")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise _error(f"{where} has unknown field(s) {', '.join(unknown)}", "messages")
        if "content" not in message:
            raise _error(f'{where} needs "content"', "messages")
        role = message.get("role")
        if role == "user":
            for turn in _user_turns(message["content"], where):
                _add(turns, turn)
        elif role == "assistant":
            _add(turns, _assistant_turn(message["content"], where))
        else:
            raise _error(f"{where}.role must be \"user\" or \"assistant\", got {str(role)[:40]!r} "
                         '(the system prompt is the top-level "system")', "messages")
    continues = messages[-1].get("role") == "assistant"
    if continues and turns[-1].get("tool_calls"):
        raise _error("the last message is an assistant turn with tool_use blocks: its "
                     "tool_result blocks go in a user message after it", "messages")
    return turns, continues


def _chat_tools(tools: Any) -> Any:
    """Custom tools in chat's shape; Anthropic's server tools are a 400."""
    if not isinstance(tools, list):
        return tools  # chat's check words the error
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _error(f"tools[{i}] must be an object", "tools")
        if tool.get("type") not in (None, "custom"):
            raise _error(f"tools[{i}]: tools of type {str(tool.get('type'))[:40]!r} are Anthropic's "
                         "server tools; cadence calls custom tools only", "tools")
        unknown = sorted(set(tool) - {"type", "name", "description", "input_schema", "strict", *_TOOL_EXTRAS})
        if unknown:
            raise _error(f"tools[{i}] has unknown field(s) {', '.join(unknown)}", "tools")
        wrong = next((name for name, of in _TOOL_EXTRAS.items() if not isinstance(tool.get(name), of)), None)
        if wrong is not None:
            raise _error(f"tools[{i}].{wrong} has the wrong type", "tools")
        if "input_schema" not in tool:
            raise _error(f'tools[{i}] needs "input_schema"', "tools")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        function.update({k: tool[k] for k in ("description", "strict") if tool.get(k) is not None})
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """`tool_choice` as chat's, and its `disable_parallel_tool_use` as parallel_tool_calls."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _error('"tool_choice" must be {"type": "auto"}, {"type": "any"}, {"type": "tool", '
                     '"name": ...} or {"type": "none"}', "tool_choice")
    unknown = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if unknown or (choice["type"] == "tool") != ("name" in choice):
        raise _error(f'"tool_choice" of type {choice["type"]!r} has the wrong fields (a "name" '
                     'goes with type "tool" only, and "disable_parallel_tool_use")', "tool_choice")
    single = parsing.field(choice, "disable_parallel_tool_use", (bool,))
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(choice["type"])
    if chat is None:
        chat = {"type": "function", "function": {"name": choice["name"]}}
    return chat, None if single is None else not single


def _thinking(thinking: Any) -> bool | None:
    """`thinking` as the template's enable_thinking (None: as the template decides)."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive") or set(thinking) - {"type", "budget_tokens", "display"}:
        raise _error('"thinking" must be {"type": "enabled", "budget_tokens": N}, {"type": '
                     '"adaptive"} or {"type": "disabled"}', "thinking")
    parsing.field(thinking, "budget_tokens", (int,))
    return kind != "disabled"


def _response_format(config: Any) -> dict | None:
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise _error('"output_config" must be an object with "format" (and "effort")', "output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or set(fmt) != {"type", "schema"}:
        raise _error('"output_config.format" must be {"type": "json_schema", "schema": {...}}',
                     "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_body(body: dict, allowed: frozenset[str] = _ALLOWED) -> dict:
    """A Messages body (of `allowed` fields; those not implemented are refused here) as a chat
    body."""
    protocol.known_fields(body, allowed)
    if body.get("model") is None:
        raise _error('"model" is required: the served model\'s name (GET /v1/models)', "model")
    for name in _NEUTRAL:
        if body.get(name) not in (None, [], {}):
            raise _error(f'"{name}" is not supported by cadence', name)
    for name, kind in _IGNORED.items():
        parsing.field(body, name, (kind,))
    messages, continues = chat_messages(body.get("system"), body.get("messages"))
    tool_choice, parallel = _tool_choice(body.get("tool_choice"))
    kwargs = parsing.field(body, "chat_template_kwargs", (dict,))
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        kwargs = {"enable_thinking": thinking, **(kwargs or {})}
    chat = {"messages": messages, "model": body.get("model"),
            "stop": parsing.field(body, "stop_sequences", (list,)),
            "tools": _chat_tools(body.get("tools")), "tool_choice": tool_choice,
            "parallel_tool_calls": parallel,
            "response_format": _response_format(body.get("output_config")),
            "chat_template_kwargs": kwargs,
            "continue_final_message": continues or None,
            **{k: body[k] for k in _SAMPLING if k in body}}
    return {k: v for k, v in chat.items() if v is not None}


# -- the answer -------------------------------------------------------------------------------


class Blocks(AnswerParts):
    """An answer's content blocks, built from its text as it arrives, with the stream events
    that build them: one text or thinking block open at a time, closed when the next opens or
    at the end; a call's tool_use block whole, once the call stands."""

    def __init__(self, parser: ToolCallParser | None, thinker: ReasoningParser | None = None):
        super().__init__(parser, thinker)
        self.blocks: list[dict] = []
        self.events: list[tuple[str, dict]] = []
        self._open: int | None = None  # the index of the open text or thinking block

    @property
    def calls(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.blocks)

    def finish(self) -> None:
        self.finish_parts()
        self._close()

    def _emit(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))

    def _delta(self, kind: str, key: str, delta: str, text: str) -> None:
        if not text:
            return
        if self._open is None or self.blocks[self._open]["type"] != kind:
            self._close()
            self._open = len(self.blocks)
            block = {"type": kind, key: "", **({"signature": ""} if kind == "thinking" else {})}
            self.blocks.append(block)
            self._emit("content_block_start", index=self._open, content_block=dict(block))
        self.blocks[self._open][key] += text
        self._emit("content_block_delta", index=self._open, delta={"type": delta, key: text})

    def on_reasoning(self, text: str) -> None:
        self._delta("thinking", "thinking", "thinking_delta", text)

    def on_content(self, text: str) -> None:
        self._delta("text", "text", "text_delta", text)

    def on_call_done(self, call: ToolCall) -> None:
        self._close()
        at = len(self.blocks)
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        self._emit("content_block_start", index=at, content_block=dict(block))
        self._emit("content_block_delta", index=at,
                   delta={"type": "input_json_delta", "partial_json": call.arguments})
        self._emit("content_block_stop", index=at)
        self.blocks.append({**block, "input": json.loads(call.arguments)})

    def _close(self) -> None:
        at, self._open = self._open, None
        if at is not None:
            self._emit("content_block_stop", index=at)


def _stop(record: RequestRecord, calls: bool, limit: int | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer whose max_tokens was `limit`."""
    if record.finish_reason == "length":
        reached = limit is not None and record.output_tokens >= limit
        return "max_tokens" if reached else "model_context_window_exceeded", None
    if calls:
        return "tool_use", None
    if isinstance(record.stop_reason, str):
        return "stop_sequence", record.stop_reason
    return "end_turn", None


def _usage(record: RequestRecord) -> dict:
    cached = record.cached_tokens
    return {"input_tokens": record.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": record.output_tokens}


def _new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class MessagesAPI:
    def __init__(self, server: Server):
        self.server = server

    def routes(self, route: Callable[[str, Any, list[str]], Route]) -> list[Route]:
        return [route("/v1/messages", self._answered(self.create), ["POST"], error_body),
                route("/v1/messages/count_tokens", self._answered(self.count_tokens), ["POST"],
                      error_body)]

    @staticmethod
    def _answered(handler):
        """The handler, its errors in the Messages request's names."""
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except SubmissionError as e:
                raise APIError(400, str(e), param=e.param).renamed(_PARAM) from None
            except APIError as e:
                raise e.renamed(_PARAM) from None
        return endpoint

    def _parsed(self, body: Any, allowed: frozenset[str]) -> protocol.ParsedRequest:
        server = self.server
        parsed = protocol.parse(chat_body(body, allowed), True, server.defaults, server.config.max_n)
        server.models.check(parsed.model)
        # max_tokens is a cap, as llama-server's n_predict is: Claude Code asks for 32000
        # whatever the model's context, and an answer that reaches the context's end stops there.
        parsed.limit_is_cap = True
        return parsed

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens, as the Messages request would count them: {"input_tokens"}."""
        body = await self.server.read_body(request)
        parsed = self._parsed(body, _COUNT_ALLOWED)
        counted = await input_tokens(self.server, parsed)
        return JSONResponse({"input_tokens": counted["input_tokens"]})

    async def create(self, request: Request) -> Response:
        server = self.server
        body = await server.read_body(request)
        if isinstance(body, dict) and body.get("max_tokens") is None:
            raise _error('"max_tokens" is required: the most tokens the answer may have', "max_tokens")
        parsed = self._parsed(body, _ALLOWED)
        stream = parsing.field(body, "stream", (bool,), False)
        request_id = protocol.request_id(request.headers, "msg")
        groups = await server.submit(parsed, request_id)
        run = _Run(self, parsed)
        headers = {"X-Request-Id": request_id, "request-id": request_id}
        if stream:
            return event_stream(run.events(groups[0][0]), headers, server.ping())
        blocks = run.blocks()  # token by token, as a stream builds them
        record = await blocks.collect(server, request, groups[0][0])
        blocks.finish()
        return JSONResponse(run.message(blocks.blocks, record, blocks.calls), headers=headers)


class _Run:
    """One message being made."""

    def __init__(self, api: MessagesAPI, parsed: protocol.ParsedRequest):
        self.api, self.parsed = api, parsed
        self.id = _new_id()
        self.limit = parsed.params.max_tokens  # the request's, before the context capped it

    def blocks(self) -> Blocks:
        return Blocks.of(self.parsed, self.api.server.call_style)

    def message(self, content: list[dict], record: RequestRecord | None, calls: bool = False) -> dict:
        reason, sequence = (None, None) if record is None else _stop(record, calls, self.limit)
        usage = _usage(record) if record is not None else {
            "input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
            "output_tokens": 0}
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.api.server.models.answer(self.parsed.model), "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    async def events(self, stream) -> AsyncIterator[str]:
        def frames(events: list[tuple[str, dict]]) -> str:
            return "".join(f"event: {kind}\ndata: {protocol._ENCODE({'type': kind, **fields})}\n\n"
                           for kind, fields in events)

        blocks = self.blocks()
        start = self.message([], None)
        start["usage"]["input_tokens"] = stream.request.prompt_len
        yield frames([("message_start", {"message": start}), ("ping", {})])
        try:
            async for batch in merged([stream]):
                for _, event in batch:
                    if isinstance(event, TokenEvent):
                        blocks.feed(event.text)
                        continue
                    if event.finish_reason == "error":
                        error = APIError(500, f"generation failed: {event.error}", type="server_error")
                        blocks.events.append(("error", {"error": error_body(error)["error"]}))
                        continue
                    blocks.finish()
                    reason, sequence = _stop(event, blocks.calls, self.limit)
                    blocks.events.append(("message_delta", {
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": _usage(event)}))
                    blocks.events.append(("message_stop", {}))
                if blocks.events:
                    events, blocks.events = blocks.events, []
                    yield frames(events)
        finally:
            if stream.record is None:  # the client went away mid-stream
                stream.cancel()
