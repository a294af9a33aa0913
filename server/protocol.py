"""The OpenAI wire format: parsing request bodies into scheduler calls, and shaping responses.

Parsing is strict where a silent guess would surprise a client: wrong types, unsupported
options (n > 1, logprobs, echo, best_of) and out-of-range values raise `APIError` with the
offending parameter named, which the app returns in OpenAI's error shape. Defaults follow the
OpenAI API (temperature 1.0, top_p 1.0, completions max_tokens 16); chat requests without a
max_tokens may generate up to the end of the context.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from model.sampling import RequestSampling
from scheduler.request import GenerationParams, RequestRecord


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


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object"}


def _field(body: dict, name: str, types: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python, but a JSON true is never a valid number.
    wrong_bool = isinstance(value, bool) and bool not in types
    if wrong_bool or not isinstance(value, types):
        expected = "a number" if float in types else " or ".join(_TYPE_NAMES[t] for t in types)
        raise APIError(400, f"'{name}' must be {expected}, got {type(value).__name__}", param=name)
    return value


@dataclasses.dataclass
class ParsedRequest:
    model: str | None
    prompt_text: str | None  # None when the prompt came as token ids
    prompt_ids: list[int] | None
    messages: list[dict] | None
    params: GenerationParams
    stream: bool
    include_usage: bool


def parse(body: Any, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for unsupported in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions"):
        if body.get(unsupported) not in (None, False, 0, []):
            raise APIError(400, f"'{unsupported}' is not supported by cadence", param=unsupported)
    n = _field(body, "n", (int,), 1)
    if n != 1 or _field(body, "best_of", (int,), 1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    model = _field(body, "model", (str,))
    prompt_text = prompt_ids = messages = None
    if chat:
        messages = _field(body, "messages", (list,))
        if not messages:
            raise APIError(400, "'messages' must be a non-empty array", param="messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = prompt
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise APIError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
        else:
            raise APIError(400, "'prompt' must be a string or an array of token ids", param="prompt")
    max_tokens = _field(body, "max_completion_tokens", (int,)) if chat else None
    max_tokens = _field(body, "max_tokens", (int,), max_tokens if chat else 16)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise APIError(400, "'stop' must be a string or an array of strings", param="stop")
    if any(not s for s in stop):
        raise APIError(400, "'stop' strings must be non-empty", param="stop")
    top_k = _field(body, "top_k", (int,), 0)
    try:
        sampling = RequestSampling(
            temperature=float(_field(body, "temperature", (int, float), 1.0)),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "no limit" as -1
            top_p=float(_field(body, "top_p", (int, float), 1.0)),
            seed=_field(body, "seed", (int,), 0),
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), {})
    include_usage = bool(options.get("include_usage", False))
    params = GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=stop,
                              ignore_eos=_field(body, "ignore_eos", (bool,), False))
    return ParsedRequest(model, prompt_text, prompt_ids, messages, params, stream, include_usage)


def usage(record: RequestRecord) -> dict[str, Any]:
    return {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.output_tokens,
        "total_tokens": record.prompt_tokens + record.output_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
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
