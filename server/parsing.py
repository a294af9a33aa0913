"""Every front door's request parsing: from raw JSON to what the scheduler takes.

    entry = client_json.load_json(raw_bytes)              # strict JSON, bounded; SubmissionError
    params = generation_params(entry, defaults)           # the sampling and stop fields
    messages = chat_messages(entry["messages"])           # text parts joined into strings
    fmt, tools = structure(entry, chat)                   # response_format (or guided_*); tools
    wanted = grammar_request(fmt, tools, tokenizer, grammars)  # what the answer must follow

The HTTP server (`server/protocol.py`, OpenAI's wire format), `cadence-generate` and
`cadence-batch` (`server/entries.py`: an entry whole) all parse through here, so a field means the same thing at every door and a bad
value gets the same message. Nothing is coerced silently (`"8"` is not a max_tokens, `true` is
not a number); a field given as null is absent. Errors are `SubmissionError`s whose `param`
names the field.

Bad input is refused before it can cost anything: JSON past `server.client_json`'s bounds, and a
prompt with more UTF-8 bytes than the context could hold at the tokenizer's longest token
(`check_prompt_size`, before tokenizing).

Sampling defaults (`SamplingDefaults`): a field the entry leaves out takes the front door's
default, which is the model's own (`checkpoints.generation`) where the model publishes one.
The sampling-default flags of the command-line front doors are defined here, once.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, NamedTuple

from absl import flags

from cadence.checkpoints.chat import (CONTINUE_MARK, check_template, continue_final, reserved_variables,
                                      validate_messages)
from cadence.checkpoints.errors import CheckpointError
from cadence.checkpoints.generation import GenerationDefaults
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.api import RequestSampling
from cadence.model.arith import cdiv
from cadence.model.host_sampling import MAX_PENALTY_WINDOW, SEED_RANGE
from cadence.scheduler.errors import RequestTooLong, SubmissionError
from cadence.scheduler.request import MAX_STOP_LENGTH, GenerationParams, check_params
from cadence.scheduler.grammar import (GrammarCompiler, JsonObject, JsonSchema, Spec, BadWords, TokenSet,
                                      closed_schema)
from cadence.server import guided
from cadence.server.client_json import MAX_INT_DIGITS
from cadence.server.tool_requests import NAME, ToolRequest, call_style, parse_tools, template_inputs

_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Default most tokens to generate per prompt.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float(
    "temperature", None, "Default sampling temperature (0: greedy; default: the model's own, else 0).")
_TOP_P = flags.DEFINE_float("top_p", None, "Default nucleus sampling mass (default: the model's own, else 1).")
_TOP_K = flags.DEFINE_integer("top_k", None, "Default top-k (0: off; default: the model's own, else 0).")
_SEED = flags.DEFINE_integer("seed", 0, "Default sampling seed.")

PENALTY_FIELDS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", *PENALTY_FIELDS,
                   "logit_bias", "stop", "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
                   "cache_salt", "priority", "skip_special_tokens", "spaces_between_special_tokens")
MAX_CACHE_SALT = 256
# llama-server's penalties, by cadence's names; all three count over its last repeat_last_n tokens.
LLAMA_PENALTIES = {"repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty"}
LLAMA_PENALTY_FIELDS = ("repeat_last_n", *LLAMA_PENALTIES)
REPEAT_LAST_N = 64  # llama-server's default window


# -- fields -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for each field it leaves out."""

    max_tokens: int | None = 128  # None: up to the end of the context
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def with_model(self, model: GenerationDefaults) -> SamplingDefaults:
        """These defaults, with each value the model publishes in place of the door's own."""
        published = {k: getattr(model, k) for k in ("temperature", "top_p", "top_k")
                     if getattr(model, k) is not None}
        return dataclasses.replace(self, **published)


def defaults_from_flags(model: GenerationDefaults = GenerationDefaults()) -> SamplingDefaults:
    """The command-line doors' defaults: a flag given wins, then the model's own, then greedy."""
    base = SamplingDefaults(max_tokens=_MAX_TOKENS.value, seed=_SEED.value).with_model(model)
    given = {name: flag.value for name, flag in
             (("temperature", _TEMPERATURE), ("top_p", _TOP_P), ("top_k", _TOP_K))
             if flag.value is not None}
    return dataclasses.replace(base, **given)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               list: "an array", dict: "an object"}


def field(entry: dict, name: str, types: tuple[type, ...], default: Any = None) -> Any:
    """entry[name] if it has one of `types` (null or absent: `default`), else SubmissionError."""
    value = entry.get(name)
    if value is None:
        return default
    # bool is an int in Python, but `"top_k": true` is a mistake in the request, not a 1.
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        expected = "a number" if float in types else " or ".join(_TYPE_NAMES[t] for t in types)
        shown = repr(value) if isinstance(value, (int, float, bool)) else type(value).__name__
        raise SubmissionError(f'"{name}" must be {expected}, got {shown}', name)
    return value


def generation_params(entry: dict, defaults: SamplingDefaults, *,
                      max_tokens_fields: tuple[str, ...] = ("max_tokens",)) -> GenerationParams:
    """The sampling and stopping fields of an entry (`SAMPLING_FIELDS`). Each of
    `max_tokens_fields` (aliases) is checked; the first one present gives the limit."""
    max_tokens = defaults.max_tokens
    for name in reversed(max_tokens_fields):
        value = field(entry, name, (int,))
        if value is not None and value < 1:
            raise SubmissionError(f'"{name}" must be >= 1, got {value}', name)
        max_tokens = max_tokens if value is None else value
    top_k = field(entry, "top_k", (int,), defaults.top_k)
    top_p = float(field(entry, "top_p", (int, float), defaults.top_p))
    if top_p == 0.0:  # OpenAI's [0, 1]: the likeliest token alone (llama.cpp keeps one, too)
        top_k, top_p = 1, 1.0
    seed = field(entry, "seed", (int,), defaults.seed)  # OpenAI's int64 (or a uint64) ...
    if not -2**63 <= seed < 2**64:
        raise SubmissionError(f'"seed" must be a 64-bit integer, got {seed}', "seed")
    values = {
        "temperature": float(field(entry, "temperature", (int, float), defaults.temperature)),
        "top_k": 0 if top_k == -1 else top_k, "top_p": top_p,  # vLLM's -1 for top_k: no limit
        "seed": seed % SEED_RANGE,  # ... folded into the device's 32 bits
        **{name: float(field(entry, name, (int, float), default)) for name, default in
           zip(PENALTY_FIELDS, (0.0, 0.0, 0.0, 1.0))},
        "logit_bias": logit_bias(field(entry, "logit_bias", (dict,), {})),
    }
    try:
        sampling = RequestSampling(**values)
    except ValueError as e:  # RequestSampling's range checks, each naming its field
        name = next((k for k in values if str(e).startswith(k)), None)
        raise SubmissionError(str(e), name) from None
    stop = field(entry, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise SubmissionError('"stop" must be a non-empty string or an array of them', "stop")
    salt = field(entry, "cache_salt", (str,))
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT:
        raise SubmissionError(f'"cache_salt" must be a string of 1 to {MAX_CACHE_SALT} characters', "cache_salt")
    stop_ids = field(entry, "stop_token_ids", (list,), [])
    if not all(type(t) is int for t in stop_ids):
        raise SubmissionError('"stop_token_ids" must be an array of token ids', "stop_token_ids")
    params = GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=stop,
                              ignore_eos=field(entry, "ignore_eos", (bool,), False),
                              min_tokens=field(entry, "min_tokens", (int,), 0),
                              stop_token_ids=tuple(stop_ids),
                              include_stop=field(entry, "include_stop_str_in_output", (bool,), False),
                              cache_salt=salt, priority=field(entry, "priority", (int,)),
                              skip_special=field(entry, "skip_special_tokens", (bool,), True))
    # vLLM's spaces_between_special_tokens: its slow tokenizers' spelling, which its fast ones
    # (and cadence's byte-level detokenizer) do not change: checked, and nothing changes.
    field(entry, "spaces_between_special_tokens", (bool,))
    # The ranges (the priority's, the stop strings' bounds) are the scheduler layer's one
    # validation, the same for every door; what depends on the model it checks at submission.
    check_params(params)
    return params


def prediction(body: dict) -> str | None:
    """OpenAI's Predicted Outputs: `{"type": "content", "content": text or text parts}`, what
    the answer is expected to be, mostly (a file being edited): the text, or None."""
    prediction = field(body, "prediction", (dict,))
    if prediction is None:
        return None
    content = prediction.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if prediction.get("type") != "content" or not isinstance(content, str) or set(prediction) - {"type", "content"}:
        raise SubmissionError('"prediction" must be {"type": "content", "content": a string or an '
                              "array of text parts}", "prediction")
    return content


def llama_penalties(entry: dict, params: GenerationParams) -> GenerationParams:
    """`params` with llama-server's penalties, as its sampler counts them: `repeat_penalty`,
    `presence_penalty` and `frequency_penalty`, all three over the last `repeat_last_n` tokens
    (64 when absent; 0: no penalty; -1, or more than any sequence holds: all of it) of prompt
    and output (`RequestSampling.penalty_window`). Errors name the fields as llama-server does."""
    window = field(entry, "repeat_last_n", (int,), REPEAT_LAST_N)
    if window < -1:
        raise SubmissionError('"repeat_last_n" must be -1 (the whole context), 0 (no penalties) '
                              f"or a number of tokens, got {window}", "repeat_last_n")
    off = {ours: 1.0 if ours == "repetition_penalty" else 0.0 for ours in LLAMA_PENALTIES.values()}
    given = {ours: float(field(entry, theirs, (int, float), off[ours])) for theirs, ours in LLAMA_PENALTIES.items()}
    whole = window == -1 or window > MAX_PENALTY_WINDOW
    try:
        dataclasses.replace(params.sampling, **given)  # each in its range, on (a window) or off
        sampling = dataclasses.replace(params.sampling, **(given if window else off),
                                       penalty_window=MAX_PENALTY_WINDOW if whole else window)
    except ValueError as e:  # RequestSampling's range checks, named as the request named them
        ours = next(name for name in given if str(e).startswith(name))
        theirs = next(t for t, o in LLAMA_PENALTIES.items() if o == ours)
        raise SubmissionError(str(e).replace(ours, theirs, 1), theirs) from None
    return dataclasses.replace(params, sampling=sampling)


def response_format(entry: dict) -> Spec | None:
    """OpenAI's `response_format`: None for text, else the grammar spec of its JSON."""
    fmt = field(entry, "response_format", (dict,))
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "json_object" and fmt.get("schema") is not None:
        # {"type": "json_object", "schema": {...}}: a schema in the older style of several
        # OpenAI-compatible servers (Anyscale, Together), which instructor's JSON_SCHEMA mode sends.
        fmt = {"type": "json_schema", "json_schema": {"name": "schema", "schema": fmt["schema"]},
               **{k: v for k, v in fmt.items() if k not in ("type", "schema")}}
        kind = "json_schema"
    if (kind not in ("text", "json_object", "json_schema") or set(fmt) - {"type", "json_schema"}
            or (kind != "json_schema" and "json_schema" in fmt)):
        raise SubmissionError('"response_format" must be {"type": "text"}, {"type": "json_object"} '
                              'or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                              "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonObject()
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise SubmissionError('"response_format": "json_schema" needs a "json_schema" object', "response_format")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise SubmissionError(f'"response_format".json_schema has unknown field(s) {", ".join(unknown)}',
                              "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SubmissionError('"response_format".json_schema.name must be 1-64 letters, digits, _ or -',
                              "response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise SubmissionError('"response_format".json_schema.strict must be true or false', "response_format")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise SubmissionError('"response_format".json_schema.description must be a string', "response_format")
    schema = spec.get("schema", {})  # none: any JSON value
    if not isinstance(schema, dict):
        raise SubmissionError('"response_format".json_schema.schema must be a JSON schema object',
                              "response_format")
    return JsonSchema(closed_schema(schema))


STRUCTURE_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls", *guided.FIELDS)


class GrammarRequest(NamedTuple):
    """The grammar an answer must follow, before it is compiled, and the field it came from."""

    spec: Spec
    param: str  # "tools", "response_format", "guided_regex", ...: named by its errors


def structure(entry: dict, chat: bool) -> tuple[GrammarRequest | None, ToolRequest | None]:
    """An entry's format (`response_format`, or another server's spelling of a constraint:
    `server.guided`) and, for a chat, its tools (`server.tool_requests`): both may be given, as
    OpenAI takes them (`grammar_request` says what the answer follows)."""
    spec, other = response_format(entry), guided.constraint(entry)
    if spec is not None and other is not None:
        raise SubmissionError(f'"{other[1]}" cannot go with "response_format": a request takes '
                              "one constraint", other[1])
    fmt = GrammarRequest(spec, "response_format") if spec is not None else (
        GrammarRequest(*other) if other is not None else None)
    if not chat:
        given = [name for name in ("tools", "tool_choice") if entry.get(name) is not None]
        if given:
            raise SubmissionError(f'"{given[0]}" needs a chat ("messages")', given[0])
        return fmt, None
    return fmt, parse_tools(entry)


def grammar_request(fmt: GrammarRequest | None, tools: ToolRequest | None, tokenizer: Tokenizer,
                    grammars: GrammarCompiler | None) -> GrammarRequest | None:
    """What an answer must follow: a forced tool call's grammar (in the style of the model's
    template; the calls are the answer, so a format has no message to shape); with tools the
    model may call ("auto") and a JSON format, the calls or the format's JSON; else the
    format's; None if nothing. (Beside tools it may call, a format of another kind (a regex,
    a grammar) is the answer's alone.)"""
    answer = fmt.spec if fmt is not None and isinstance(fmt.spec, (JsonSchema, JsonObject)) else None
    if tools is not None and tools.forces_call:
        wanted = GrammarRequest(tools.grammar(call_style(tokenizer)), "tools")
    elif tools is not None and tools.choice == "auto" and answer is not None:
        schema = answer.schema if isinstance(answer, JsonSchema) else {"type": "object"}
        wanted = GrammarRequest(tools.grammar(call_style(tokenizer), schema), fmt.param)
    else:
        wanted = fmt
    if wanted is not None and grammars is None:
        raise SubmissionError("structured output is off here (--nostructured_output)", wanted.param)
    return wanted


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed` (n > 1): choice 0 keeps the seed,
    so it is the request with n=1; the others draw from a hash of (seed, index)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"cadence-choice:{seed}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def logit_bias(bias: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` object ({"token id": bias}, ids as decimal strings) as
    `RequestSampling` pairs; the ranges are RequestSampling's checks, the vocabulary the
    scheduler's."""
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= MAX_INT_DIGITS):
            raise SubmissionError(f'"logit_bias" keys must be token ids (decimal integers), got {key[:40]!r}',
                                  "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SubmissionError(f'"logit_bias" values must be numbers, got {type(value).__name__} '
                                  f"for token {key}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def chat_messages(messages: Any) -> list[dict]:
    """A conversation with every content a string: OpenAI's arrays of text parts
    (`[{"type": "text", "text": ...}]`) are joined with newlines, as vLLM does. Other parts
    (images, audio) are refused: cadence serves text models. An assistant turn may carry its
    `tool_calls` (its content then may be null: ""), and a "tool" turn answers one of them
    (`tool_call_id`); the legacy `function_call` is refused. OpenAI's "developer" role, its
    newer name for the instructions, is a "system" turn: the role templates know."""
    if not isinstance(messages, list) or not messages:
        raise SubmissionError('"messages" must be a non-empty array', "messages")
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            if message.get("function_call") is not None:
                raise SubmissionError(f'messages[{i}]["function_call"] is the legacy form; send '
                                      '"tool_calls"', "messages")
            if message.get("name") is not None and not isinstance(message["name"], str):
                raise SubmissionError(f'messages[{i}]["name"] must be a string', "messages")
            message = _tool_fields(i, message)
            if message.get("role") == "developer":
                message = {**message, "role": "system"}
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise SubmissionError(
                        f"messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", "
                        f"\"text\": ...}}; got {kind!r} (cadence serves text only)", "messages")
                texts.append(part["text"])
            message = {**message, "content": "\n".join(texts)}
        out.append(message)
    return out


def _tool_fields(i: int, message: dict) -> dict:
    """Checks a message's tool-calling fields; an assistant turn of calls alone gets content ""."""
    calls, answers = message.get("tool_calls"), message.get("tool_call_id")
    role = message.get("role")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise SubmissionError(f'messages[{i}]["tool_calls"] must be an array, on an assistant '
                                  "message", "messages")
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if (not isinstance(function, dict) or call.get("type", "function") != "function"
                    or not isinstance(call.get("id"), str) or not isinstance(function.get("name"), str)
                    or not isinstance(function.get("arguments"), str)):
                raise SubmissionError(
                    f'messages[{i}]["tool_calls"][{j}] must be {{"id": str, "type": "function", '
                    '"function": {"name": str, "arguments": str}}', "messages")
        if message.get("content") is None:
            message = {**message, "content": ""}
    if role == "tool" and not isinstance(answers, str):
        raise SubmissionError(f'messages[{i}] (role "tool") needs "tool_call_id", the id of the '
                              "call it answers", "messages")
    if answers is not None and role != "tool":
        raise SubmissionError(f'messages[{i}]["tool_call_id"] belongs on a "tool" message', "messages")
    return message


def template_kwargs(entry: dict) -> dict[str, Any] | None:
    """A chat's `chat_template_kwargs` (vLLM's, SGLang's, llama-server's): more variables for
    the chat template, e.g. Qwen3's {"enable_thinking": false}; not the template's own."""
    kwargs = field(entry, "chat_template_kwargs", (dict,))
    taken = reserved_variables(kwargs or {})
    if taken:
        raise SubmissionError(f'"chat_template_kwargs" may not set {", ".join(map(repr, taken))}: '
                              "the server sets them", "chat_template_kwargs")
    documents = field(entry, "documents", (list,))
    if documents is not None:  # vLLM's: the documents a retrieval-augmented template shows
        if not all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
            raise SubmissionError('"documents" must be an array of objects of strings (such as '
                                  '{"title": ..., "text": ...})', "documents")
        if "documents" in (kwargs or {}):
            raise SubmissionError('"documents" is given twice: as a field and in "chat_template_kwargs"',
                                  "documents")
        kwargs = {**(kwargs or {}), "documents": documents}
    return kwargs or None


# A chat's own fields (beside its tools), for the template.
CHAT_FIELDS = ("chat_template_kwargs", "documents", "add_generation_prompt", "continue_final_message",
               "chat_template")


def request_template(entry: dict) -> str | None:
    """A chat's own `chat_template` (vLLM's): the template's text, checked to parse. Whether
    the door takes one is its own business (the server: --trust_request_chat_template)."""
    text = field(entry, "chat_template", (str,))
    if text is None:
        return None
    try:
        return check_template(text)
    except CheckpointError as e:
        raise SubmissionError(f'"chat_template": {e}', "chat_template") from None


def check_chat_fields(entry: dict, chat: bool) -> None:
    """A chat's own fields (`CHAT_FIELDS`) need a chat: SubmissionError naming the first given
    to an entry that is not one."""
    given = [name for name in CHAT_FIELDS if entry.get(name) is not None]
    if given and not chat:
        raise SubmissionError(f'"{given[0]}" goes with "messages"', given[0])


class ChatEnd(NamedTuple):
    """How a rendered chat ends (vLLM's chat fields): with the template's generation prompt (a
    new assistant turn), or inside the final message, which the model continues."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False


def chat_end(entry: dict) -> ChatEnd:
    """A chat's `add_generation_prompt` (default: true, unless it continues its final message)
    and `continue_final_message` (default false); both true is a contradiction."""
    cont = field(entry, "continue_final_message", (bool,), False)
    gen = field(entry, "add_generation_prompt", (bool,), not cont)
    if cont and gen:
        raise SubmissionError('"continue_final_message" continues the final message; it cannot '
                              'go with "add_generation_prompt": true, which opens a new one',
                              "continue_final_message")
    return ChatEnd(gen, cont)


def render_chat(messages: Any, tokenizer: Tokenizer, tools: ToolRequest | None = None,
                variables: dict[str, Any] | None = None, end: ChatEnd = ChatEnd(),
                template: str | None = None) -> str:
    """The prompt of a conversation (and its tools, `server.tool_requests`), in the model's
    template (or `template`, a request's own), given `variables` (`template_kwargs`) besides,
    ending as `end` says."""
    if template is not None:
        tokenizer = tokenizer.with_chat_template(template)
    try:  # the chat module checks the conversation's shape and runs the template sandboxed
        conversation = validate_messages(chat_messages(messages))
        if end.continue_final_message:  # marked, to cut where its text ends
            final = conversation[-1]
            if final.get("role") != "assistant" or not final.get("content"):
                raise SubmissionError('"continue_final_message" needs a final assistant message '
                                      "with text to continue", "continue_final_message")
            conversation = [*conversation[:-1], {**final, "content": final["content"] + CONTINUE_MARK}]
        conversation, shown = template_inputs(conversation, tokenizer, tools)
        text = tokenizer.apply_chat_template(conversation, tools=shown, variables=variables,
                                             add_generation_prompt=end.add_generation_prompt)
        return continue_final(text) if end.continue_final_message else text
    except CheckpointError as e:
        raise SubmissionError(f'"messages": {e}', "messages") from None


def token_ids(value: Any) -> bool:
    """Whether `value` is a non-empty array of integers (token ids)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def prompt_ids(prompt: str | list[int], tokenizer: Tokenizer, max_seq_len: int | None,
               add_bos: bool | None = None, keep: int | None = None, special: bool = True) -> list[int]:
    """A prompt's token ids: ids as given, or a text tokenized (`add_bos`: the tokenizer's
    own choice where None, as a completion's prompt gets it; `special=False`: special tokens'
    text spelled as text), refused first where it cannot fit `max_seq_len` at any tokenization
    (`check_prompt_size`; None: not checked). `keep` (vLLM's truncate_prompt_tokens, as the
    request asked): only its last `keep` tokens, unchecked."""
    if keep is not None:
        return prompt_ids(prompt, tokenizer, None, add_bos, special=special)[-keep:]
    if not isinstance(prompt, str):
        return list(prompt)
    if max_seq_len is not None:
        check_prompt_size(prompt, tokenizer, max_seq_len)
    return tokenizer.encode(prompt, add_bos=add_bos, special=special)


def embedding_ids(text: str | list[int], tokenizer: Tokenizer, max_seq_len: int | None,
                  add_special: bool = True, keep: int | None = None) -> list[int]:
    """An embedding's input as `prompt_ids` tokenizes a prompt, a text ending with the model's
    EOS where its tokenizer adds one (`Tokenizer.with_eos`; `add_special` false: neither BOS
    nor EOS), before `keep` cuts it to its last tokens; ids are taken as given."""
    if not isinstance(text, str):
        return prompt_ids(text, tokenizer, max_seq_len, keep=keep)
    ids = prompt_ids(text, tokenizer, max_seq_len if keep is None else None, None if add_special else False)
    ids = tokenizer.with_eos(ids) if add_special else ids
    return ids if keep is None else ids[-keep:]


def add_bos(body: dict, fill: bool = False) -> bool | None:
    """vLLM's `add_special_tokens` as `prompt_ids` takes it: false, no BOS before the prompt
    (a chat's template writes its own); true or absent (None), the tokenizer's, never twice.
    Not with a fill-in-the-middle prompt (`fill`), whose layout places its own."""
    add = field(body, "add_special_tokens", (bool,))
    if add is not None and fill:
        raise SubmissionError('"add_special_tokens" cannot go with "suffix": the fill-in-the-middle '
                              "layout places its own special tokens", "add_special_tokens")
    return None if add is None or add else False


MAX_BAD_WORDS = 256  # each is looked for at every step, on the scheduler's thread (as long as
# a stop string at most, MAX_STOP_LENGTH characters)


class TokenRules(NamedTuple):
    """vLLM's rules over an answer's tokens, one of them a request: `allowed_token_ids` (the
    only tokens it may hold) or `bad_words` (texts it never ends with)."""

    allowed: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()


def token_rules(body: dict) -> TokenRules | None:
    """A request's `allowed_token_ids` or `bad_words`, checked (None: neither)."""
    ids = field(body, "allowed_token_ids", (list,))
    if ids is not None and not (ids and all(type(t) is int and t >= 0 for t in ids)):
        raise SubmissionError('"allowed_token_ids" must be a non-empty array of token ids', "allowed_token_ids")
    words = field(body, "bad_words", (list,), [])
    if len(words) > MAX_BAD_WORDS or not all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_LENGTH
                                             for w in words):
        raise SubmissionError(f'"bad_words" must be an array of at most {MAX_BAD_WORDS} strings, not blank, '
                              f"of at most {MAX_STOP_LENGTH} characters", "bad_words")
    if ids is not None and words:
        raise SubmissionError('"bad_words" cannot go with "allowed_token_ids" (a request takes one '
                              "constraint)", "bad_words")
    return None if ids is None and not words else TokenRules(ids and tuple(dict.fromkeys(ids)), tuple(words))


def token_constraint(rules: TokenRules, wanted: GrammarRequest | None, tokenizer: Tokenizer,
                     vocab_size: int) -> TokenSet | BadWords:
    """A request's token rules as its constraint (`scheduler.grammar.TokenSet` or `BadWords`):
    the only one it has; allowed ids in the model's vocabulary; bad words as token ids the way
    vLLM finds them (the word, and after a space where that spells it with another first token
    in as many tokens)."""
    param = "bad_words" if rules.allowed is None else "allowed_token_ids"
    if wanted is not None:
        raise SubmissionError(f'"{param}" cannot go with a response format, a guided field or tools '
                              "(a request takes one constraint)", param)
    if rules.allowed is None:
        words = []
        for word in rules.bad_words:
            plain, spaced = (tokenizer.encode(text, add_bos=False) for text in (word.lstrip(), " " + word.lstrip()))
            words += [tuple(plain)] + ([tuple(spaced)] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        return BadWords(tuple(dict.fromkeys(words)), vocab_size)
    outside = [t for t in rules.allowed if t >= vocab_size]
    if outside:
        raise SubmissionError(f'"allowed_token_ids" holds {outside[0]}, outside the model\'s vocabulary '
                              f"[0, {vocab_size})", "allowed_token_ids")
    return TokenSet(frozenset(rules.allowed), vocab_size)


def truncation(body: dict, fill: bool = False) -> int | None:
    """vLLM's `truncate_prompt_tokens`: keep each prompt's last k >= 1 tokens (None: all); not
    for a prompt that is the start of a fill-in-the-middle layout (`fill`)."""
    keep = field(body, "truncate_prompt_tokens", (int,))
    if keep is not None and keep < 1:
        raise SubmissionError(f'"truncate_prompt_tokens" must be >= 1, got {keep}', "truncate_prompt_tokens")
    if keep is not None and fill:
        raise SubmissionError('"truncate_prompt_tokens" cannot go with "suffix": the prompt\'s start '
                              "is the fill-in-the-middle layout's", "truncate_prompt_tokens")
    return keep


def check_prompt_size(text: str, tokenizer: Tokenizer, max_seq_len: int) -> None:
    """Refuses, without tokenizing, a text too long for the context at any tokenization."""
    size = len(text.encode("utf-8"))
    fewest = cdiv(size, tokenizer.max_token_bytes)
    if fewest > max_seq_len:
        raise RequestTooLong(
            f"the prompt is {size} bytes, at least {fewest} tokens, which exceeds the context of "
            f"{max_seq_len} tokens; shorten it", "prompt")
