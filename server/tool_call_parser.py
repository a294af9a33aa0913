"""Tool calls in a chat model's generated text: split it into content and OpenAI tool calls.

    parser = ToolCallParser({"get_weather", "get_time"})
    delta = parser.feed(piece)     # for each piece of text as it is generated: Delta(content,
                                   # tool_calls), OpenAI's `delta.content` / `delta.tool_calls`
    delta = parser.finish()        # at the end: whatever was held back
    parser.calls                   # [ToolCall(id, name, arguments), ...] found so far

    content, calls = parse_tool_calls(text, names)   # a whole text, by the same code

Two families of formats are recognized. The default parser reads two ways of writing a call:

- Hermes / Qwen, anywhere in the text: `<tool_call>` JSON `</tool_call>`, any number of them.
- Llama 3 JSON: the answer, after whitespace and an optional `<|python_tag|>`, starts with a
  JSON object; more may follow it, separated by whitespace or `;`. A `{` anywhere else is content.

`ToolCallParser(names, mistral=True)` reads Mistral's instead, where calls follow its
`[TOOL_CALLS]` token (the answer's text must show it: `GenerationParams.shown_specials`),
anywhere in the text, any number of times:

- a JSON list of call objects (Mistral 7B v0.3, Nemo): `[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]`; bare objects without the list's brackets are read too;
- a name and its arguments object (Mistral Small 3.2, Magistral, Devstral, Ministral 3):
  `[TOOL_CALLS]get_weather[ARGS]{...}`, with an optional `[CALL_ID]` and id before `[ARGS]`
  (dropped: cadence gives each call its own id). The arguments stream from their `{`.

A Mistral call's id is 9 letters and digits, the only kind Mistral's templates accept back.
`ToolCallParser(names, list_tag="<|tool_call|>")` reads the same lists after another tag
(Granite 3's), with OpenAI's ids.

The JSON is `{"name": <tool>, "arguments": {...}}` ("parameters" is accepted for "arguments",
other keys are ignored, missing arguments mean `{}`). It is a call only if it parses as an object,
its name is one of `names` and its arguments are an object. `ToolCall.arguments` is the arguments
object's text exactly as the model wrote it.

Contract:
- Nothing the model wrote is lost or duplicated as content: text that is not a call comes out as
  content, unchanged and in order, with two exceptions. Whitespace (space, tab, CR, LF) directly
  before or after a call is dropped (before the first, between calls, after the last), and so is
  the syntax of calls: the tags, a leading `<|python_tag|>`, the `;` between two Llama calls.
- The concatenated content and the calls do not depend on how the text is cut into pieces (one
  character at a time, at random, whole): every decision waits until the text decides it.
  `parse_tool_calls` is one feed and a finish, so whole and streamed parsing cannot disagree.
- Content goes out as soon as it cannot be part of a call. Held back: a trailing prefix of
  `<tool_call>`, trailing whitespace (it may turn out to stand right before a call), and at the
  start of the answer whitespace, `<|python_tag|>` and a `{` object until it is decided.
- A call whose JSON starts `{"name": <one of names>, "arguments": {` streams: its header goes
  out at the arguments' `{` (not as soon as the name is complete: by then the arguments are known
  to be an object), then the arguments' text in fragments as it arrives, ending exactly at their
  closing brace; a delta carries one entry per call index (a header and the fragments that came
  with it are one entry) (a small scanner tracks strings, escapes and nesting). Any other candidate (keys
  in another order, other keys first, an unknown name) is held until its object closes; then it
  is a header and its whole arguments in one fragment, or it is content. A candidate that turns
  out not to be a call is content up to its opening (`<tool_call>`, `<|python_tag|>`) and the
  rest is scanned again as text, so a real call written after a broken one is still found. In a
  Hermes candidate a `</tool_call>` outside any string ends the object where it stands.
- Once a header is out the call is committed: it stands if and only if its arguments object
  closes and parses. What comes after the arguments does not undo it: a missing outer `}` or
  `</tool_call>`, or finish() arriving first, still leave the call; text after the arguments that
  is not the object's proper end is content. If the arguments never close (finish() mid-way) or
  do not parse, the call is abandoned: its whole text becomes content, it is not in `calls`, and
  its delta index is listed in `abandoned`. A client already holds its header and part of its
  arguments (the one case where text goes out twice); the next call takes the next index, so
  `index` counts headers sent, which equals the position in `calls` unless one was abandoned.

Non-goals: other formats (pythonic calls, XML-style parameters);
checking arguments against the tools' JSON schemas; tool_choice; reasoning text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Collection

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral's special tokens

_WS = " \t\n\r"  # JSON's whitespace, also what is dropped around calls
_PAIRS = {"{": "}", "[": "]"}
_DECODER = json.JSONDecoder()
# The head of a call whose arguments can stream: everything up to the arguments' opening brace.
_HEAD = re.compile(r'\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")[ \t\n\r]*,'
                   r'[ \t\n\r]*"(arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*\{')

# The parser's modes: what the start of its buffer may be.
_START = "start"      # the answer's beginning: a Llama call may start
_TEXT = "text"        # content, in which a `<tool_call>` (`[TOOL_CALLS]`) may start
_OPENING = "opening"  # just after `<tool_call>` or `[TOOL_CALLS]`: whitespace, then the object
_SCAN = "scan"        # inside a candidate's JSON object
_CLOSING = "closing"  # after a Hermes call: whitespace and its `</tool_call>`
_NEXT = "next"        # after a Llama call or a Mistral list's: separators, then maybe another
_NAME = "name"        # a Mistral call's name, up to its `[ARGS]`

# What a call's JSON object is part of: Hermes' tags, a Llama answer's start, a Mistral list,
# or (ARGS_ONLY) no object at all: the object scanned is a Mistral call's arguments themselves.
_HERMES, _LLAMA, _LIST, _ARGS_ONLY = "hermes", "llama", "list", "args_only"
_NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def new_mistral_call_id() -> str:
    """Nine letters and digits: Mistral's templates refuse any other id in a conversation."""
    return uuid.uuid4().hex[:9]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object's JSON text as the model wrote it

    def message(self) -> dict:
        """OpenAI's non-streamed `message.tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class Delta:
    content: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclasses.dataclass
class _Candidate:
    """A JSON object that may be a call, with what is needed to undo it if it is not."""

    kind: str            # _HERMES, _LLAMA, _LIST or _ARGS_ONLY
    keep: str            # text before the object that is plain content if this is not a call
    again: str = ""      # text before the object that is scanned again if this is not a call
    drop_ws: bool = False  # whether `again` starts right after a call
    json: str = ""       # the object's text consumed so far
    stack: list[str] = dataclasses.field(default_factory=list)
    in_string: bool = False
    escaped: bool = False
    head_seen: bool = False
    # object: undecided; args: committed, in the arguments; tail: the arguments parsed, the
    # object's `}` expected; extra: keys after the arguments.
    phase: str = "object"
    index: int | None = None
    call_id: str = ""
    name: str = ""
    args_start: int = 0
    args_end: int = 0
    sent: int = 0        # how far into `json` the arguments have been streamed


class ToolCallParser:
    """Splits one answer, fed piece by piece, into content and tool calls (see the module doc)."""

    def __init__(self, names: Collection[str], new_id: Callable[[], str] | None = None, *,
                 mistral: bool = False, list_tag: str | None = None):
        self.names = frozenset(names)
        self.calls: list[ToolCall] = []
        self.abandoned: list[int] = []  # indexes of headers sent for calls that did not complete
        self._new_id = new_id or (new_mistral_call_id if mistral else new_call_id)
        self._mistral = mistral or list_tag is not None  # calls in lists after a tag
        # the tag a call starts with in text
        self._open = list_tag or (TOOL_CALLS if mistral else OPEN)
        self._mode = _TEXT if mistral else _START
        self._buf = ""          # text not yet consumed by the current mode
        self._drop_ws = False   # whether `_buf` starts right after a call
        self._cand: _Candidate | None = None
        self._headers = 0
        self._content: list[str] = []
        self._deltas: list[dict] = []
        self._finished = False
        self._modes = {_START: self._start, _TEXT: self._text, _OPENING: self._opening,
                       _SCAN: self._scan, _CLOSING: self._closing, _NEXT: self._next,
                       _NAME: self._name}

    def feed(self, text: str) -> Delta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not self.names:  # nothing can be a call: spare the holding back
            return Delta(text)
        self._buf += text
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> Delta:
        if self._finished:
            return Delta()
        self._finished = True
        while self._step(final=True):
            pass
        return self._take()

    # One step of the current mode: True if it changed something another step may build on,
    # False if it waits for more text (or, when final, has emitted everything).
    def _step(self, final: bool) -> bool:
        return self._modes[self._mode](final)

    def _start(self, final: bool) -> bool:
        buf = self._buf
        i = _skip(buf, 0, _WS)
        rest = buf[i:]
        if rest.startswith(PYTHON_TAG):
            tag_end = i + len(PYTHON_TAG)
            j = _skip(buf, tag_end, _WS)
        elif not rest or PYTHON_TAG.startswith(rest):
            if not final:
                return False
            self._mode = _TEXT
            return True
        else:
            tag_end, j = 0, i
        if j == len(buf) and not final:
            return False
        if j < len(buf) and buf[j] == "{":
            self._cand = _Candidate(_LLAMA, keep=buf[:tag_end], again=buf[tag_end:j])
            self._buf, self._mode = buf[j:], _SCAN
        else:
            self._mode = _TEXT
        return True

    def _text(self, final: bool) -> bool:
        buf = self._buf
        if self._drop_ws:
            buf = buf.lstrip(_WS)
            if not buf:
                self._buf = ""
                return False
            self._drop_ws = False
        tag = self._open
        at = buf.find(tag)
        if at >= 0:
            body = buf[:at].rstrip(_WS)
            self._emit(body)
            # The whitespace before the tag goes with the candidate: dropped if it is a call.
            self._cand = _Candidate(_LIST if self._mistral else _HERMES, keep=buf[len(body):at + len(tag)])
            self._buf = buf[at + len(tag):]
            self._mode = _OPENING
            return True
        if final:
            self._emit(buf)
            self._buf = ""
            return False
        body = buf[:len(buf) - _partial_suffix(buf, tag)].rstrip(_WS)
        self._emit(body)
        self._buf = buf[len(body):]
        return False

    def _opening(self, final: bool) -> bool:
        """After the opening tag: whitespace, then the call object's `{`; after Mistral's
        `[TOOL_CALLS]`, also a list's `[` before it, or a call's name instead."""
        buf, cand = self._buf, self._cand
        j = k = _skip(buf, 0, _WS)
        if self._mistral and buf[j:j + 1] == "[":
            k = _skip(buf, j + 1, _WS)
        if k == len(buf) and not final:
            return False
        if buf[k:k + 1] == "{":
            cand.again = buf[:k]
            self._buf, self._mode = buf[k:], _SCAN
        elif self._mistral and k == j and buf[j:j + 1] and buf[j] in _NAME_CHARS:
            cand.again = buf[:j]
            self._buf, self._mode = buf[j:], _NAME
        else:
            self._fail(cand)
        return True

    def _closing(self, final: bool) -> bool:
        buf = self._buf
        j = _skip(buf, 0, _WS)
        if buf.startswith(CLOSE, j):
            self._buf = buf[j + len(CLOSE):]
        elif not final and CLOSE.startswith(buf[j:]):
            return False
        self._mode, self._drop_ws = _TEXT, True
        return True

    def _next(self, final: bool) -> bool:
        """After a Llama call, or one in a Mistral list: separators (`;`, or `,`) and another
        call, or (Mistral's) the list's `]`."""
        buf = self._buf
        j = _skip(buf, 0, _WS + ("," if self._mistral else ";"))
        if j == len(buf) and not final:
            return False
        if buf[j:j + 1] == "{":
            kind = _LIST if self._mistral else _LLAMA
            self._cand = _Candidate(kind, keep="", again=buf[:j], drop_ws=True)
            self._buf, self._mode = buf[j:], _SCAN
        else:
            if self._mistral and buf[j:j + 1] == "]" and "," not in buf[:j]:
                self._buf = buf[j + 1:]  # the list's end is syntax
            # A separator not followed by another call is content; the whitespace before it is not.
            self._mode, self._drop_ws = _TEXT, True
        return True

    def _name(self, final: bool) -> bool:
        """`name[ARGS]{`, or `name[CALL_ID]id[ARGS]{`: a call whose arguments follow; its
        header goes out at their `{` if the name is a tool's."""
        buf, cand = self._buf, self._cand
        i = _skip(buf, 0, _NAME_CHARS)
        j = i
        if buf.startswith(CALL_ID, i):
            j = _skip(buf, i + len(CALL_ID), _NAME_CHARS)
        elif CALL_ID.startswith(buf[i:]) and not final:
            return False  # (an empty rest too: the name may go on)
        k = _skip(buf, j + len(ARGS), _WS) if buf.startswith(ARGS, j) else None
        if k is None or k == len(buf):
            if not final and (k is not None or ARGS.startswith(buf[j:])):
                return False
            self._fail(cand)
            return True
        name = buf[:i]
        if buf[k] != "{" or name not in self.names:
            self._fail(cand)
            return True
        cand.kind, cand.again = _ARGS_ONLY, cand.again + buf[:k]
        cand.head_seen, cand.phase = True, "args"
        self._header(cand, name)
        self._buf, self._mode = buf[k:], _SCAN
        return True

    def _scan(self, final: bool) -> bool:
        cand, buf = self._cand, self._buf
        end = None  # "closed": the object's `}`; "broken": it cannot go on as JSON
        i, n = 0, len(buf)
        while i < n:
            c = buf[i]
            i += 1
            if cand.in_string:
                if cand.escaped:
                    cand.escaped = False
                elif c == "\\":
                    cand.escaped = True
                elif c == '"':
                    cand.in_string = False
                continue
            if cand.phase == "tail":
                if c in _WS:
                    continue
                if c == "}":
                    cand.stack.pop()
                    end = "closed"
                elif c == ",":
                    cand.phase = "extra"
                    continue
                else:
                    i -= 1  # not the object's: left for the mode after the call
                    end = "broken"
                break
            if c == '"':
                cand.in_string = True
            elif c in "{[":
                cand.stack.append(c)
                if len(cand.stack) == 2 and not cand.head_seen:
                    cand.head_seen = True
                    self._commit(cand, cand.json + buf[:i])
            elif c in "}]":
                if not cand.stack or _PAIRS[cand.stack.pop()] != c:
                    end = "broken"
                    break
                # The arguments close where the stack is back at the call object (or empty:
                # Mistral's [ARGS] scans the arguments alone).
                if cand.phase == "args" and len(cand.stack) == (0 if cand.kind == _ARGS_ONLY else 1):
                    cand.args_end = len(cand.json) + i
                    args = (cand.json + buf[:i])[cand.args_start:]
                    if _is_object(args):
                        # Committed: the call stands whatever follows its arguments.
                        cand.phase = "tail"
                        self.calls.append(ToolCall(cand.call_id, cand.name, args))
                        if not cand.stack:  # Mistral's [ARGS]: the call ends with them
                            end = "closed"
                            break
                    else:
                        end = "broken"
                        break
                elif not cand.stack:
                    end = "closed"
                    break
            elif c == ">" and cand.kind == _HERMES and \
                    (cand.json[-len(CLOSE):] + buf[max(0, i - len(CLOSE)):i]).endswith(CLOSE):
                # A closing tag outside any string: this object is not going to close.
                end = "broken"
                break
        cand.json += buf[:i]
        self._buf = buf[i:]
        if cand.index is not None:
            stop = cand.args_end or len(cand.json)
            if stop > cand.sent:
                self._deltas.append({"index": cand.index,
                                     "function": {"arguments": cand.json[cand.sent:stop]}})
                cand.sent = stop
        if end is None:
            if not final:
                return False
            end = "broken"
        if cand.phase == "object":
            parts = _call_parts(cand.json) if end == "closed" else None
            if parts is None or parts[0] not in self.names:
                self._fail(cand)
                return True
            self._header(cand, parts[0])
            self._deltas.append({"index": cand.index, "function": {"arguments": parts[1]}})
            self.calls.append(ToolCall(cand.call_id, cand.name, parts[1]))
            self._after(cand, "")
        elif cand.phase == "args":
            self._fail(cand)
        else:
            args = cand.json[cand.args_start:cand.args_end]
            whole = end == "closed" and (cand.kind == _ARGS_ONLY
                                         or _call_parts(cand.json) == (cand.name, args))
            # The call stands either way; what follows its arguments is only syntax if the
            # object ended properly.
            self._after(cand, "" if whole else cand.json[cand.args_end:])
        return True

    def _commit(self, cand: _Candidate, head: str) -> None:
        """At the object's first nested opening: stream the arguments if the name came first."""
        m = _HEAD.fullmatch(head)
        if m is None:
            return
        try:
            name = json.loads(m[1])
        except ValueError:
            return
        if name not in self.names:
            return
        self._header(cand, name)
        cand.phase = "args"
        cand.args_start = cand.sent = len(head) - 1

    def _header(self, cand: _Candidate, name: str) -> None:
        cand.index, cand.call_id, cand.name = self._headers, self._new_id(), name
        self._headers += 1
        self._deltas.append({"index": cand.index, "id": cand.call_id, "type": "function",
                             "function": {"name": name, "arguments": ""}})

    def _after(self, cand: _Candidate, leftover: str) -> None:
        self._cand = None
        self._buf = leftover + self._buf
        self._mode = {_HERMES: _CLOSING, _LLAMA: _NEXT, _LIST: _NEXT}.get(cand.kind, _TEXT)
        self._drop_ws = self._mode == _TEXT

    def _fail(self, cand: _Candidate) -> None:
        """Not a call: the candidate's text is content. Everything after its opening (`<tool_call>`,
        `<|python_tag|>`, `[TOOL_CALLS]`) is scanned again, as text: it may hold a real call."""
        if cand.index is not None:
            self.abandoned.append(cand.index)
        self._emit(cand.keep)
        self._buf = cand.again + cand.json + self._buf
        self._cand = None
        self._mode, self._drop_ws = _TEXT, cand.drop_ws

    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _take(self) -> Delta:
        delta = Delta("".join(self._content), _one_per_index(self._deltas))
        self._content, self._deltas = [], []
        return delta


def _one_per_index(deltas: list[dict]) -> list[dict]:
    """One `tool_calls` entry per index, as OpenAI sends them: a call's header and the
    fragments of its arguments that came out of the same feed go in one entry, its arguments
    the fragments joined (clients that stream partial arguments read only one entry an index)."""
    merged: dict[int, dict] = {}
    for entry in deltas:
        index = entry["index"]
        if index not in merged:
            merged[index] = {**entry, "function": dict(entry["function"])}
        else:
            function = merged[index]["function"]
            function["arguments"] = function.get("arguments", "") + entry["function"]["arguments"]
    return list(merged.values())


def parse_tool_calls(text: str, names: Collection[str], *, mistral: bool = False,
                     list_tag: str | None = None) -> tuple[str | None, list[ToolCall]]:
    """A whole text -> (content, calls). Content is the text outside the calls, stripped of
    leading and trailing whitespace, None if empty. It is one feed and a finish, so streaming
    and whole parsing cannot disagree."""
    parser = ToolCallParser(names, mistral=mistral, list_tag=list_tag)
    content = parser.feed(text).content + parser.finish().content
    return content.strip() or None, list(parser.calls)


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _members(text: str) -> list[tuple[str, str, object]] | None:
    """A JSON object's members as (key, the value's text, the value), or None if `text` is not
    exactly one JSON object. Walked member by member so each value's original text is kept."""
    try:
        i = _skip(text, 0, _WS)
        if text[i:i + 1] != "{":
            return None
        i = _skip(text, i + 1, _WS)
        members: list[tuple[str, str, object]] = []
        if text[i:i + 1] == "}":
            i += 1
        else:
            while True:
                if text[i:i + 1] != '"':
                    return None
                key, i = _DECODER.raw_decode(text, i)
                i = _skip(text, i, _WS)
                if text[i:i + 1] != ":":
                    return None
                start = i = _skip(text, i + 1, _WS)
                value, i = _DECODER.raw_decode(text, i)
                members.append((key, text[start:i], value))
                i = _skip(text, i, _WS)
                if text[i:i + 1] == ",":
                    i = _skip(text, i + 1, _WS)
                elif text[i:i + 1] == "}":
                    i += 1
                    break
                else:
                    return None
    except (ValueError, RecursionError):
        return None
    return members if _skip(text, i, _WS) == len(text) else None


def _call_parts(text: str) -> tuple[str, str] | None:
    """(name, arguments' text) if `text` is a call's JSON object, whatever its name."""
    members = _members(text)
    if members is None:
        return None
    found = {key: (raw, value) for key, raw, value in members}  # the last repeat wins, as in json
    name = found.get("name")
    if name is None or not isinstance(name[1], str):
        return None
    args = found.get("arguments", found.get("parameters"))
    if args is None:
        return name[1], "{}"
    if not isinstance(args[1], dict):
        return None
    return name[1], args[0]
