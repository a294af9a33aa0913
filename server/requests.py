"""From a JSON request entry to what the scheduler takes: prompt token ids + `GenerationParams`.

    defaults = defaults_from_flags()               # --max_tokens, --temperature, ... (CLI only)
    ids, params = to_request({"prompt": "Hi", "max_tokens": 8}, tokenizer, defaults)
    ids, params = to_request({"messages": [{"role": "user", "content": "Hi"}]}, tok, defaults)

An entry has exactly one of "prompt" (a string) or "messages" (a chat, rendered with the
model's chat template), and optionally the sampling fields in `SAMPLING_FIELDS`. Fields absent
from the entry take the defaults. Anything else that is wrong (unknown keys, wrong types, values
out of range, a chat the template refuses) raises `SubmissionError` with a message that names
the field; nothing is coerced silently (`"8"` is not a max_tokens, `true` is not a number).
Length checks against the context are the scheduler's (`submit` raises `RequestTooLong`).

The sampling-default flags are defined here, once, for the command-line front doors
(`cadence-generate`, `cadence-batch`); the functions take explicit arguments and never read them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import flags

from checkpoints.errors import CheckpointError
from checkpoints.tokenizer import Tokenizer
from model.sampling import RequestSampling
from scheduler.errors import SubmissionError
from scheduler.request import GenerationParams

_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Default most tokens to generate per prompt.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Default sampling temperature (0: greedy).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Default nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Default top-k (0: off).")
_SEED = flags.DEFINE_integer("seed", 0, "Default sampling seed.")

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def defaults_from_flags() -> SamplingDefaults:
    return SamplingDefaults(
        max_tokens=_MAX_TOKENS.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
        top_k=_TOP_K.value, seed=_SEED.value,
    )


def to_request(
    entry: dict[str, Any],
    tokenizer: Tokenizer,
    defaults: SamplingDefaults = SamplingDefaults(),
    *,
    chat: bool = False,
    extra_fields: tuple[str, ...] = (),
) -> tuple[list[int], GenerationParams]:
    """Tokenized prompt and generation parameters of one entry; `SubmissionError` if invalid.

    `chat` wraps a plain "prompt" as one user message. `extra_fields` are keys the caller
    handles itself (such as a batch job's "id") and that are therefore not unknown here.
    """
    if not isinstance(entry, dict):
        raise SubmissionError(f"a request must be a JSON object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - {"prompt", "messages", *SAMPLING_FIELDS, *extra_fields})
    if unknown:
        allowed = ", ".join(("prompt", "messages", *SAMPLING_FIELDS, *extra_fields))
        raise SubmissionError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {allowed}")
    if ("prompt" in entry) == ("messages" in entry):
        raise SubmissionError('a request needs exactly one of "prompt" or "messages"')
    if "messages" in entry:
        text = _render_chat(entry["messages"], tokenizer)
    else:
        text = entry["prompt"]
        if not isinstance(text, str):
            raise SubmissionError(f'"prompt" must be a string, got {type(text).__name__}')
        if chat:
            text = _render_chat([{"role": "user", "content": text}], tokenizer)

    def number(name: str, kind: type, default):
        value = entry.get(name, default)
        # bool is an int in Python, but `"top_k": true` is a mistake in the request, not a 1.
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
        if not ok:
            raise SubmissionError(f'"{name}" must be {"a number" if kind is float else "an integer"}, '
                                  f"got {value!r}")
        return kind(value)

    try:
        sampling = RequestSampling(
            temperature=number("temperature", float, defaults.temperature),
            top_k=number("top_k", int, defaults.top_k),
            top_p=number("top_p", float, defaults.top_p),
            seed=number("seed", int, defaults.seed),
        )
    except ValueError as e:  # RequestSampling's range checks
        raise SubmissionError(str(e)) from None
    max_tokens = number("max_tokens", int, defaults.max_tokens)
    if max_tokens < 1:
        raise SubmissionError(f'"max_tokens" must be >= 1, got {max_tokens}')
    stop = entry.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise SubmissionError(f'"stop" must be a non-empty string or a list of them, got {stop!r}')
    ignore_eos = entry.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise SubmissionError(f'"ignore_eos" must be true or false, got {ignore_eos!r}')
    params = GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=tuple(stop),
                              ignore_eos=ignore_eos)
    return tokenizer.encode(text), params


def _render_chat(messages: Any, tokenizer: Tokenizer) -> str:
    try:  # the chat module checks the conversation's shape and runs the template sandboxed
        return tokenizer.apply_chat_template(messages)
    except CheckpointError as e:
        raise SubmissionError(f'"messages": {e}') from None
