"""Tool calling at the front doors: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`,
the prompt that shows a model its tools, and the grammar that makes it call one.

    tools = parse_tools(body)                        # None without tools; SubmissionError by field
    messages, shown = template_inputs(messages, tokenizer, tools)   # what the template renders
    style = call_style(tokenizer)                    # how the model's template writes calls
    spec = tools.grammar(style)                      # "required" / a named function: a Lark spec
    content, calls = style.parse(answer, tools.names)   # the answer's calls

A chat template that speaks of `tools` (Qwen2, Llama 3.1, Hermes...) renders them itself, from
OpenAI's shapes, as Hugging Face's transformers passes them; earlier assistant turns' calls go
in with their arguments as objects. A template that does not (SmolLM2's, or ChatML when the
model ships none) gets cadence's own rendering, in the Hermes style most small instruct models
have seen: a system section listing the tools inside <tools></tools>, each earlier call as a
<tool_call> block in its assistant turn, and each tool result as a user turn inside
<tool_response></tool_response>.

A Granite 3 template (one that speaks of `<|tool_call|>`) has the model answer with that token
and a JSON list of calls (`GRANITE`). A Mistral template (one that writes `[TOOL_CALLS]`) has
its own call format, in two versions
(`MISTRAL`, `MISTRAL_ARGS`), written with special tokens that the answer's text then shows
(`CallStyle.shown`), and call ids of 9 letters and digits, which it checks: ids a conversation
brings in another shape (OpenAI's `call_...`) are given one, the same for a call and its result.

`tool_choice` "auto" (the default with tools) leaves the model free and finds calls in what it
writes (`server.tool_call_parser`: both the Hermes style and Llama 3's JSON, or Mistral's); "required" and a named
function constrain its answer with a grammar over the call format the template implies (one or
more calls, or one with `parallel_tool_calls: false` or a named function), with each call's
arguments valid against that function's parameters; "none" renders the tools and parses nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Collection
from typing import Any

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.grammar import JSON_LAYOUT, Lark, closed_schema, map_schema
from cadence.server.client_json import TooDeep, load_json
from cadence.server.tool_call_parser import (ARGS, CALL_ID, TOOL_CALLS, ToolCall, ToolCallParser,
                                             parse_tool_calls)

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's function names
CHOICES = ("none", "auto", "required")
# The call formats `call_style` tells apart: Hermes' <tool_call> blocks, Llama 3's JSON,
# Mistral's list after [TOOL_CALLS] (7B v0.3, Nemo) and its [TOOL_CALLS]name[ARGS]{...} (v11+).
HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS = "hermes", "llama3_json", "mistral", "mistral_args"
GRANITE, GRANITE_TAG = "granite", "<|tool_call|>"  # Granite 3's: a JSON list after its tag
MISTRAL_ID = re.compile(r"[a-zA-Z0-9]{9}")  # the only call ids Mistral's templates take

# cadence's own tool section, for templates that render no tools themselves.
_TOOL_SECTION = """You may call these functions, each described by a JSON object on its own line:
<tools>
{tools}
</tools>
To call one, write its name and arguments as JSON in a block like this, one block per call:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments>}}}}
</tool_call>"""


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of its arguments object

    def openai(self) -> dict:
        """Its OpenAI shape, as chat templates (and cadence's tool section) show it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A request's tools and what it lets the model do with them."""

    tools: tuple[Tool, ...]
    choice: str  # "none", "auto", "required", or "function": the named one
    function: str | None = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    @property
    def parses_calls(self) -> bool:
        """Whether the answer's tool calls are returned as calls (not "none")."""
        return self.choice != "none"

    @property
    def forces_call(self) -> bool:
        """"required", or a named function: the answer is calls, which a grammar enforces."""
        return self.choice in ("required", "function")

    def grammar(self, style: CallStyle, answer: dict | None = None) -> Lark | None:
        """The grammar that enforces "required" or a named function's calls; with "auto" and a
        JSON `answer` (the schema of the request's response format), the calls or that JSON,
        as OpenAI lets a model answer a request with both. None otherwise."""
        if self.forces_call:
            tools = [t for t in self.tools if self.choice == "required" or t.name == self.function]
            many = self.parallel and self.choice == "required"
        elif self.choice == "auto" and answer is not None:
            tools, many = list(self.tools), self.parallel
        else:
            return None
        calls, rules = _calls(style, tools, many)
        if answer is not None and not self.forces_call:
            calls = f"({calls}) | %json {json.dumps({**answer, 'x-guidance': JSON_LAYOUT})}"
        return Lark(f"start: {calls}\n{rules}")


def _calls(style: CallStyle, tools: list[Tool], many: bool) -> tuple[str, str]:
    """The calls of `tools` in the model's `style` (`many`: one or more, else one): the
    expression a grammar's start takes, and the rules it names."""
    if style.name == MISTRAL_ARGS:  # the name outside the JSON: each tool's own arguments
        options = " | ".join(
            f'"{t.name}" {style.token(ARGS)} %json '
            + json.dumps({**closed_schema(t.parameters), "x-guidance": JSON_LAYOUT})
            for t in tools)
        return "call+" if many else "call", f"call: {style.token(TOOL_CALLS)} ({options})\n"
    key = "parameters" if style.name == LLAMA3_JSON else "arguments"
    # Each tool's parameters keep their own schema root: they sit under the call's $defs,
    # and their references into themselves ("#/$defs/Person", "#") are moved with them.
    roots = {f"tool_{i}": _rooted(closed_schema(t.parameters), f"#/$defs/tool_{i}")
             for i, t in enumerate(tools)}
    options = [{"type": "object", "properties": {"name": {"const": t.name},
                                                 key: {"$ref": f"#/$defs/{root}"}},
                "required": ["name", key], "additionalProperties": False}
               for t, root in zip(tools, roots)]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    call = f"%json {json.dumps({**schema, '$defs': roots, 'x-guidance': JSON_LAYOUT})}"
    if style.name == LLAMA3_JSON:  # Llama 3.1's format has one call per answer
        return "call", f"call: {call}\n"
    if style.name in (MISTRAL, GRANITE):  # a JSON list after the style's tag
        calls = 'call (", " call)*' if many else "call"
        tag = style.token(TOOL_CALLS if style.name == MISTRAL else GRANITE_TAG)
        return f'{tag} "[" {calls} "]"', f"call: {call}\n"
    return ('call ("\\n" call)*' if many else "call"), f'call: "<tool_call>\\n" {call} "\\n</tool_call>"\n'


def _rooted(schema: dict, at: str) -> dict:
    """`schema` moved to `at` inside a larger schema: each of its references to its own root
    ("#", "#/...") is rewritten to point where it now is."""

    def move(node: dict, keyword: str | None) -> None:
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = at + ref[1:]

    return map_schema(schema, move)


def parse_tools(body: dict) -> ToolRequest | None:
    """A chat body's `tools`, `tool_choice` and `parallel_tool_calls`, checked; None without
    tools. Every problem is a SubmissionError naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise SubmissionError('"parallel_tool_calls" must be true or false', "parallel_tool_calls")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise SubmissionError('"tools" must be an array of function tools', "tools")
        if choice not in (None, "none"):
            raise SubmissionError('"tool_choice" needs "tools"', "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise SubmissionError(f'"tools" must be an array of at most {MAX_TOOLS} function tools', "tools")
    parsed = tuple(_tool(i, tool) for i, tool in enumerate(tools))
    names = [t.name for t in parsed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SubmissionError(f"tools name {twice[0]!r} more than once", "tools")
    function = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        named = choice.get("function")
        if (choice.get("type") != "function" or not isinstance(named, dict)
                or not isinstance(named.get("name"), str)):
            raise SubmissionError('"tool_choice" must be "none", "auto", "required" or '
                                  '{"type": "function", "function": {"name": ...}}', "tool_choice")
        function, choice = named["name"], "function"
        if function not in names:
            raise SubmissionError(f'"tool_choice" names {function[:64]!r}, which is not among the '
                                  f"tools ({', '.join(names)})", "tool_choice")
    elif choice not in CHOICES:
        raise SubmissionError(f'"tool_choice" must be one of {", ".join(CHOICES)} or a named '
                              f"function, got {str(choice)[:40]!r}", "tool_choice")
    return ToolRequest(parsed, choice, function, True if parallel is None else parallel)


def _tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise SubmissionError(f'{where} must be {{"type": "function", "function": {{...}}}} '
                              "(cadence calls functions only)", "tools")
    function = tool["function"]
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise SubmissionError(f"{where}.function has unknown field(s) {', '.join(unknown)}", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SubmissionError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got "
                              f"{str(name)[:70]!r}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise SubmissionError(f"{where}.function.description must be a string", "tools")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise SubmissionError(f"{where}.function.strict must be true or false", "tools")
    # No parameters: a function of no arguments (OpenAI's reading), whose arguments are {}.
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, dict):
        raise SubmissionError(f"{where}.function.parameters must be a JSON schema object", "tools")
    return Tool(name, description, parameters)


def template_renders_tools(tokenizer: Tokenizer) -> bool:
    return "tools" in (tokenizer.chat_template or "")


@dataclasses.dataclass(frozen=True)
class CallStyle:
    """A call format (`call_style`), and the special tokens its calls are written with, by text
    and id: Mistral's, which the answer's text must show (`shown`) for its calls to be found."""

    name: str
    markers: tuple[tuple[str, int], ...] = ()

    @property
    def mistral(self) -> bool:
        return self.name in (MISTRAL, MISTRAL_ARGS)

    @property
    def shown(self) -> tuple[int, ...]:
        """The ids `GenerationParams.shown_specials` takes for an answer whose calls are parsed."""
        return tuple(sorted(i for _, i in self.markers))

    def token(self, text: str) -> str:
        """A marker as llguidance's Lark matches the token itself (`<[id]>`), or as text where
        the vocabulary spells it."""
        markers = dict(self.markers)
        return f"<[{markers[text]}]>" if text in markers else json.dumps(text)

    @property
    def _list_tag(self) -> str | None:
        return GRANITE_TAG if self.name == GRANITE else None

    def parser(self, names: Collection[str]) -> ToolCallParser:
        return ToolCallParser(names, mistral=self.mistral, list_tag=self._list_tag)

    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
        """A whole answer -> (content, calls) (`tool_call_parser.parse_tool_calls`)."""
        return parse_tool_calls(text, names, mistral=self.mistral, list_tag=self._list_tag)


def call_style(tokenizer: Tokenizer) -> CallStyle:
    """The call format the model's template teaches: Mistral's where it writes `[TOOL_CALLS]`
    (a special token of the vocabulary), with a name and `[ARGS]` where it writes that too;
    Granite's list after `<|tool_call|>` where it speaks of that;
    Llama 3's JSON ({"name", "parameters"}) where the template speaks of it; else Hermes'
    <tool_call> blocks (cadence's own too)."""
    template = tokenizer.chat_template or ""
    markers = tuple((text, i) for text in (TOOL_CALLS, ARGS, CALL_ID)
                    if text in template and (i := tokenizer.token_id(text)) is not None
                    and tokenizer.is_special(i))
    if markers and markers[0][0] == TOOL_CALLS:
        return CallStyle(MISTRAL_ARGS if ARGS in dict(markers) else MISTRAL, markers)
    if GRANITE_TAG in template:  # shown where it is a special token
        i = tokenizer.token_id(GRANITE_TAG)
        return CallStyle(GRANITE, ((GRANITE_TAG, i),) if i is not None and tokenizer.is_special(i) else ())
    if "<tool_call>" not in template and ("<|python_tag|>" in template or '"parameters"' in template):
        return CallStyle(LLAMA3_JSON)
    return CallStyle(HERMES)


def template_inputs(messages: list[dict], tokenizer: Tokenizer,
                    tools: ToolRequest | None) -> tuple[list[dict], list[dict] | None]:
    """The conversation (checked: `chat.validate_messages`, `parsing.chat_messages`) and
    tools to render with the model's template: for a template that
    renders tools, the messages with earlier calls' arguments as objects and the tools in
    OpenAI's shapes; for one that does not, the conversation rewritten in cadence's Hermes
    rendering (a tool section in the system turn, calls and results as text), and no tools."""
    if template_renders_tools(tokenizer):
        if call_style(tokenizer).mistral:
            messages = [_with_mistral_ids(m) for m in messages]
        return [_with_argument_objects(m) for m in messages], (
            [t.openai() for t in tools.tools] if tools else None)
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            blocks = [f"<tool_call>\n{json.dumps(_call_object(c), ensure_ascii=False)}\n</tool_call>"
                      for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append(m)
    if tools:
        section = _TOOL_SECTION.format(tools="\n".join(json.dumps(t.openai(), ensure_ascii=False)
                                                       for t in tools.tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None


def _arguments(call: dict) -> Any:
    """An earlier call's arguments as an object where they are JSON text (OpenAI sends a
    string; templates write an object), else as sent. Their JSON is held to the bounds of a
    request's (`client_json`): arguments nested too deeply are refused, never parsed to the
    end of the stack."""
    arguments = call["function"]["arguments"]
    try:
        return load_json(arguments)
    except TooDeep as e:
        raise SubmissionError(f'"messages": an earlier tool call\'s arguments: {e}', "messages") from None
    except SubmissionError:
        return arguments


def _call_object(call: dict) -> dict:
    return {"name": call["function"]["name"], "arguments": _arguments(call)}


def _with_argument_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def mistral_id(call_id: Any) -> Any:
    """A call id as a Mistral template takes it: 9 letters and digits as they are, any other
    string turned into 9 hex digits of its hash (the same for a call and its result's
    `tool_call_id`); what is not a string is left for the template to refuse."""
    if not isinstance(call_id, str) or MISTRAL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:9]


def _with_mistral_ids(message: dict) -> dict:
    if message.get("role") == "tool" and "tool_call_id" in message:
        return {**message, "tool_call_id": mistral_id(message["tool_call_id"])}
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "id": mistral_id(c["id"])} if "id" in c else c for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}
