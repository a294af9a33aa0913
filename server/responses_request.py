"""A Responses API request (OpenAI's POST /v1/responses) as the chat-completions body that
answers it, for `responses_api`:

    known_fields(body, ALLOWED)                     # (protocol's) unknown fields are a 400
    chat, conversation = chat_body(body, history)   # APIError or SubmissionError: a 400
    renamed(error)                                  # a chat parse's error in the Responses' names

The chat body is parsed by `protocol.parse` as any chat's is:

    instructions              -> a first "system" message (not carried by previous_response_id)
    input                     -> messages: a string is one user turn; message items (user,
                                 system, developer -> system, assistant; input_text/output_text
                                 parts) are turns, function_call items join one assistant turn's
                                 tool_calls, function_call_output items are "tool" turns
    max_output_tokens         -> max_tokens
    text.format               -> response_format (text, json_object, json_schema)
    tools (flat functions)    -> chat tools; tool_choice {"type": "function", "name"} -> named
    include "message.output_text.logprobs", top_logprobs
                              -> logprobs: true, top_logprobs (either asks for them)
    temperature, top_p, parallel_tool_calls, and cadence's own sampling fields (top_k, seed,
    stop, penalties, ignore_eos, ...) as chat takes them

A `reasoning` item in `input` (a client that keeps the conversation itself sends back what it
was given) becomes the next assistant turn's `reasoning_content`, which a template may show the
model. `background` is answered by `responses_api` (`responses_background`). Fields that would
change the answer and are not implemented (`prompt`, non-function tools, ...) are refused with a
400 naming them;
harmless ones are accepted and ignored (`include`'s other values: the hosted tools' results,
which never occur, and `reasoning.encrypted_content`, as reasoning is returned in the clear).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from cadence.server import parsing, protocol
from cadence.server.api_error import APIError

# Fields translated into the chat request, or answered here.
_FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                     "text", "tools", "tool_choice", "parallel_tool_calls", "stream",
                     "stream_options", "store", "previous_response_id", "include",
                     "top_logprobs", "conversation", "background"})
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
    "truncation": ("disabled", "auto"), "prompt": (),
    "max_tool_calls": (), "context_management": (),
}
# `include`'s values: the logprobs, and what cadence's output never holds (the hosted tools'
# results, input images, encrypted reasoning), accepted and ignored.
LOGPROBS = "message.output_text.logprobs"
_INCLUDE = frozenset({LOGPROBS, "reasoning.encrypted_content", "code_interpreter_call.outputs",
                      "computer_call_output.output.image_url", "file_search_call.results",
                      "message.input_image.image_url", "web_search_call.action.sources",
                      "web_search_call.results"})
MAX_TOP_LOGPROBS = 20  # OpenAI's bound (the server's --max_logprobs may be lower)
ALLOWED = _FIELDS | _SAMPLING | _IGNORED.keys() | _NEUTRAL.keys()
# A chat error's field, as the Responses request names it.
_PARAM = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
          "logprobs": "include"}
# An item's fields besides those checked by name: an earlier output's items and parts have these.
_PART_FIELDS = {"type": str, "text": str, "annotations": list, "logprobs": list}
_ITEM_FIELDS = {"type": str, "id": str, "status": str}
_MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")


def _error(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def renamed(e: APIError) -> APIError:
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


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(items: str | list[dict]) -> list[dict]:
    """`input` (as `input_messages` took it) as OpenAI lists a response's input items: each
    with an id (its own, else a new one) and a status, a message's content as parts."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    listed = []
    for item in items:
        kind = item.get("type", "message")
        entry = {**item, "type": kind, "id": item.get("id") or new_id(_ITEM_IDS[kind])}
        if kind == "message" and isinstance(item["content"], str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": item["content"]}]
        if kind != "reasoning":
            entry.setdefault("status", "completed")
        listed.append(entry)
    return listed


def truncated(messages: list[dict]) -> list[dict] | None:
    """A chat without its oldest turn (`truncation: "auto"`): after the system messages, the
    first message and what follows it up to the next user message, so what is left starts with
    a user turn; None where only the last user turn is left."""
    head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    after = next((i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"), None)
    return None if after is None else messages[:head] + messages[after:]


def page(items: list[dict], query: Mapping[str, str]) -> dict:
    """A list of items (a response's input, a conversation's) a page at a time, as OpenAI lists
    them: `order` desc by default, `limit` 1 to 100 (20), `after` and `before` an item id."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f'"order" must be asc or desc, got {order[:20]!r}', param="order")
    limit = query.get("limit", "20")
    if not (limit.isdigit() and 1 <= int(limit) <= 100):
        raise APIError(400, f'"limit" must be an integer from 1 to 100, got {limit[:20]!r}', param="limit")
    listed = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in listed]
    for name in ("after", "before"):
        if query.get(name) is not None and query[name] not in ids:
            raise APIError(400, f'"{name}" names no item of this list', param=name)
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    end = ids.index(query["before"]) if "before" in query else len(listed)
    shown = listed[start:end][:int(limit)]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": end - start > len(shown)}


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


def _logprobs(body: dict) -> dict:
    """The chat's logprob fields: asked for by `include`'s "message.output_text.logprobs" or a
    `top_logprobs` above 0 (its alternatives per token, 0 to 20)."""
    include = parsing.field(body, "include", (list,), [])
    for value in include:
        if not isinstance(value, str) or value not in _INCLUDE:
            raise _error(f'"include" has an unknown value {json.dumps(value)[:100]}; known: '
                         f"{', '.join(sorted(_INCLUDE))}", "include")
    k = parsing.field(body, "top_logprobs", (int,), 0)
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise _error(f'"top_logprobs" must be between 0 and {MAX_TOP_LOGPROBS}, got {k}', "top_logprobs")
    return {"logprobs": True, "top_logprobs": k} if LOGPROBS in include or k else {}


def chat_body(body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """A Responses body (of known fields: `ALLOWED`; checked here for unsupported ones) as a
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
            **_logprobs(body),
            **{k: body[k] for k in ("temperature", "top_p", "parallel_tool_calls", *_SAMPLING) if k in body}}
    return {k: v for k, v in chat.items() if v is not None}, conversation
