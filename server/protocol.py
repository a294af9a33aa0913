"""The OpenAI wire format: request bodies into scheduler calls, responses into OpenAI's shapes.

Parsing goes through `server/requests.py`, the one parser of every front door, and is strict
where a silent guess would surprise a client: wrong types, out-of-range values and unknown
fields are refused with the parameter named (OpenAI, too, refuses an unrecognized argument).
Fields that would change the answer if honoured and that cadence does not implement
(`logit_bias`, penalties, `response_format`, tools, logprobs, `n` > 1, ...) are refused unless
they carry their neutral value; fields that change nothing here (`user`, `metadata`, ...) are
accepted and ignored. Sampling fields a request leaves out take the model's published defaults
(`SamplingDefaults.with_model`), else OpenAI's (temperature 1.0, top_p 1.0); completions default
to 16 tokens as OpenAI's do, chats to the end of the context.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.request import GenerationParams, RequestRecord
from cadence.server import requests


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# OpenAI's own defaults, for a model that publishes none.
OPENAI_DEFAULTS = requests.SamplingDefaults(max_tokens=None, temperature=1.0, top_p=1.0)
COMPLETION_MAX_TOKENS = 16

# Fields that change the answer, which cadence does not implement: refused unless neutral.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "min_p": (0,), "logprobs": (False, 0), "top_logprobs": (0,),
    "echo": (False,), "suffix": ("",), "best_of": (1,), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "modalities": (["text"],), "prediction": (),
    "audio": (), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
}
# Fields that change nothing cadence does: accepted and ignored.
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
_COMMON = frozenset({"model", "stream", "stream_options", "n", *requests.SAMPLING_FIELDS})
_ALLOWED = {
    False: _COMMON | {"prompt"},
    True: _COMMON | {"messages", "max_completion_tokens"},
}


@dataclasses.dataclass
class ParsedRequest:
    model: str | None
    prompt_text: str | None  # None when the prompt came as token ids or messages
    prompt_ids: list[int] | None
    messages: list[dict] | None  # content already joined into strings
    params: GenerationParams
    stream: bool
    include_usage: bool


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: `true` is not 1 and `false` is not 0, as they are in Python."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def parse(body: Any, chat: bool,
          defaults: requests.SamplingDefaults = OPENAI_DEFAULTS) -> ParsedRequest:
    """A request body (already `requests.load_json`'d) into a `ParsedRequest`, or `APIError` 400.

    `defaults` are the sampling defaults of the model served (`max_tokens` is the route's)."""
    try:
        return _parse(body, chat, defaults)
    except SubmissionError as e:
        raise APIError(400, str(e), param=e.param) from None


def _parse(body: Any, chat: bool, defaults: requests.SamplingDefaults) -> ParsedRequest:
    if not isinstance(body, dict):
        raise SubmissionError("the request body must be a JSON object")
    for name, neutral in _NEUTRAL.items():
        if body.get(name) is not None and not any(_same(body[name], n) for n in neutral):
            raise SubmissionError(f'"{name}" is not supported by cadence (only its neutral value '
                                  f"{', '.join(map(repr, neutral)) or 'null'} is accepted)", name)
    unknown = sorted(set(body) - _ALLOWED[chat] - _NEUTRAL.keys() - _IGNORED)
    if unknown:
        raise SubmissionError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    if requests.field(body, "n", (int,), 1) != 1:
        raise SubmissionError("only n=1 is supported", "n")
    model = requests.field(body, "model", (str,))
    prompt_text = prompt_ids = messages = None
    if chat:
        messages = requests.chat_messages(requests.field(body, "messages", (list,)))
        # max_completion_tokens is OpenAI's newer name; both are checked, max_tokens wins.
        params = requests.generation_params(body, dataclasses.replace(defaults, max_tokens=None),
                                            max_tokens_fields=("max_tokens", "max_completion_tokens"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = prompt
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise SubmissionError("batched prompts are not supported; send one prompt per request", "prompt")
        else:
            raise SubmissionError('"prompt" must be a string or an array of token ids', "prompt")
        params = requests.generation_params(
            body, dataclasses.replace(defaults, max_tokens=COMPLETION_MAX_TOKENS))
    stream = requests.field(body, "stream", (bool,), False)
    options = requests.field(body, "stream_options", (dict,), {})
    include_usage = requests.field(options, "include_usage", (bool,), False)
    return ParsedRequest(model, prompt_text, prompt_ids, messages, params, stream, include_usage)


def usage(record: RequestRecord) -> dict[str, Any]:
    return {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.output_tokens,
        "total_tokens": record.prompt_tokens + record.output_tokens,
        "prompt_tokens_details": {"cached_tokens": record.cached_tokens},
    }


def finish_reason(record: RequestRecord) -> str:
    # Aborted or failed requests never reach a client as a normal answer.
    return "length" if record.finish_reason == "length" else "stop"


def chunk(request_id: str, model: str, chat: bool, text: str | None, reason: str | None,
          created: int, first: bool = False) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": [choice]}


# json.dumps(..., ensure_ascii=False) builds an encoder per call; these are what it builds.
_ENCODE = json.JSONEncoder(ensure_ascii=False).encode
_ENCODE_STRING = json.encoder.encode_basestring  # a str's JSON, as _ENCODE gives it (C)


def frame(obj: dict) -> str:
    """One Server-Sent Event carrying `obj` as JSON."""
    return f"data: {_ENCODE(obj)}\n\n"


class TextFrames:
    """The SSE frames of one stream's text chunks, `frame(chunk(..., text, None, ...))` exactly:
    everything but the text is serialized once per stream, so a token costs one string escape
    (this runs for every token of every stream, on the event loop)."""

    _MARK = "\x00cadence text\x00"

    def __init__(self, request_id: str, model: str, chat: bool, created: int):
        whole = frame(chunk(request_id, model, chat, self._MARK, None, created))
        self._head, self._tail = whole.split(_ENCODE_STRING(self._MARK))

    def __call__(self, text: str) -> str:
        return self._head + _ENCODE_STRING(text) + self._tail


def usage_chunk(request_id: str, model: str, chat: bool, record: RequestRecord, created: int) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": [],
            "usage": usage(record)}


def full_response(request_id: str, model: str, chat: bool, record: RequestRecord) -> dict[str, Any]:
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": record.text},
                  "finish_reason": finish_reason(record), "logprobs": None}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": record.text, "finish_reason": finish_reason(record), "logprobs": None}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model,
            "choices": [choice], "usage": usage(record)}
