"""llama-server's fields on cadence's OpenAI endpoints, and the timings and progress it answers
with, for the clients written against llama-server: its own web UI first, which sends every
request to /v1/chat/completions with these.

    body, extras = llama_fields.read(body, chat)   # llama-server's spellings as cadence's
    chunk["timings"] = timings_so_far(request, predicted_n, now)   # per token, where asked
    chunk["prompt_progress"] = progress(event)                     # a `PromptProgress`'s

What `read` takes (on /v1/chat/completions and /v1/completions; the same on llama-server's own
/completion, `server.llama_api`):
- `n_predict`, llama-server's name for max_tokens (it wins where both are given), and -1 for
  either: no limit, up to the end of the context (the web UI sends `max_tokens: -1`);
- `typ_p`: `typical_p` (the web UI's spelling, which llama-server itself does not read);
- `reasoning_format` (chat): "auto" or "deepseek" split a thinking model's reasoning out into
  `reasoning_content`, as cadence does by default; "none" leaves it in the content (SGLang's
  `separate_reasoning: false`); "deepseek-legacy" (both at once) is a 400;
- `return_progress` (streamed): before the first token, chunks whose `prompt_progress` says how
  much of the prompt is computed (`total`, `cache`, `processed`, `time_ms`), one as the prompt
  is admitted and one per prefill chunk (`GenerationParams.progress`);
- `timings_per_token`: llama-server's `timings` in every chunk. `timings` ride the last chunk
  (or the whole answer) of a request that names `timings_per_token` (either value) or asks for
  its progress, as they ride every llama-server answer; an OpenAI client naming neither gets
  OpenAI's shapes alone;
- `sse_ping_interval`: seconds of silence after which a stream sends a keep-alive comment
  (`server.event_stream`; 0 or less: none), over the server's `--sse_ping_interval`;
- `cache_prompt`, `id_slot`, `t_max_prompt_ms` and `reasoning_control` change nothing here (the
  prefix cache never changes an answer; a slot is the scheduler's to choose; no reasoning
  budget runs): checked for their type, and ignored.
"""

from __future__ import annotations

import dataclasses

from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.request import PromptProgress, Request, RequestRecord
from cadence.server import parsing

# What changes nothing here, on every door that takes it (llama-server's own too).
IGNORED: dict[str, tuple[type, ...]] = {
    "cache_prompt": (bool,), "id_slot": (int,), "t_max_prompt_ms": (int, float),
    "reasoning_control": (bool,)}
_STREAM = ("timings_per_token", "return_progress", "sse_ping_interval")
FIELDS = {False: frozenset({*IGNORED, *_STREAM, "n_predict", "typ_p"}) - {"reasoning_control"},
          True: frozenset({*IGNORED, *_STREAM, "n_predict", "typ_p", "reasoning_format"})}
_REASONING = {"auto": True, "deepseek": True, "none": False}
UNLIMITED = -1  # llama-server's max_tokens (n_predict) for "up to the end of the context"


@dataclasses.dataclass(frozen=True)
class Extras:
    """What a request asked of llama-server's answers: its prompt's progress (streamed), and
    `timings` in its last chunk or whole answer (`timings`), or in every chunk too (`each`)."""

    progress: bool = False
    timings: bool = False
    each: bool = False
    unlimited: bool = False  # max_tokens (or n_predict) -1: up to the end of the context
    ping: float | None = None  # sse_ping_interval (`server.event_stream`); None: the server's


def read(body: dict, chat: bool) -> tuple[dict, Extras]:
    """`body` with llama-server's spellings as cadence's, and what it asked of the answer (a
    body naming none of them is returned as it is). SubmissionError for a bad value."""
    limit = parsing.field(body, "n_predict", (int,), body.get("max_tokens"))
    unlimited = type(limit) is int and limit == UNLIMITED
    if not unlimited and not any(body.get(name) is not None for name in FIELDS[chat]):
        return body, Extras()
    check_ignored(body)
    out = {k: v for k, v in body.items() if k != "n_predict"}
    out["max_tokens"] = None if unlimited else limit  # (None: the door's default, then none)
    if body.get("typ_p") is not None:
        if body.get("typical_p") is not None:
            raise SubmissionError('"typ_p" is "typical_p" by another name: give one', "typ_p")
        out["typical_p"] = parsing.field(body, "typ_p", (int, float))
    style = parsing.field(body, "reasoning_format", (str,)) if chat else None
    if style is not None:
        if style not in _REASONING:
            raise SubmissionError(f'"reasoning_format" must be one of {", ".join(_REASONING)}, got '
                                  f'{style!r} (cadence does not keep the reasoning in both places)',
                                  "reasoning_format")
        separate = parsing.field(body, "separate_reasoning", (bool,))
        if separate is not None and separate != _REASONING[style]:
            raise SubmissionError(f'"reasoning_format": "{style}" and "separate_reasoning": '
                                  f"{str(separate).lower()} disagree", "reasoning_format")
        out["separate_reasoning"] = _REASONING[style]
    each, progress = (parsing.field(body, name, (bool,)) for name in _STREAM[:2])
    return out, Extras(progress=bool(progress), timings=each is not None or bool(progress),
                       each=bool(each), unlimited=unlimited, ping=ping_interval(body))


MIN_PING = 0.01  # seconds: a shorter interval would have a waiting stream send little but pings


def ping_interval(body: dict) -> float | None:
    """llama-server's `sse_ping_interval`: seconds of silence before a stream's keep-alive
    comment (0 or less: none; None: not given, the server's)."""
    value = parsing.field(body, "sse_ping_interval", (int, float))
    if value is not None and 0 < value < MIN_PING:
        raise SubmissionError(f'"sse_ping_interval" must be at least {MIN_PING} seconds (or 0 or less: '
                              f"no pings), got {value}", "sse_ping_interval")
    return None if value is None else float(value)


def check_ignored(body: dict, fields: dict[str, tuple[type, ...]] = IGNORED) -> None:
    """The fields that change nothing (`IGNORED`, or a door's `fields`), each checked for its
    type."""
    for name, kinds in fields.items():
        parsing.field(body, name, kinds)
    if (body.get("t_max_prompt_ms") or 0) < 0:
        raise SubmissionError(f'"t_max_prompt_ms" must be >= 0, got {body["t_max_prompt_ms"]}', "t_max_prompt_ms")


def _timings(start: float, first: float | None, end: float, prompt_tokens: int, cached: int,
             predicted_n: int) -> dict[str, float | int]:
    first = end if first is None else first
    prompt_n = prompt_tokens - cached
    prompt_ms, predicted_ms = (first - start) * 1e3, (end - first) * 1e3

    def rates(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (n * 1e3 / ms if ms > 0 else 0.0)

    prompt_per_token, prompt_per_second = rates(prompt_n, prompt_ms)
    predicted_per_token, predicted_per_second = rates(predicted_n, predicted_ms)
    return {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token,
            "predicted_per_second": predicted_per_second}


def timings(record: RequestRecord, predicted_n: int) -> dict[str, float | int]:
    """llama-server's `timings` of a finished request: the prompt's tokens computed (the cached
    ones not) and the time to the first token since admission; the `predicted_n` tokens of the
    answer and the time after the first."""
    start = record.admitted if record.admitted is not None else record.submitted
    return _timings(start, record.first_token, record.finished, record.prompt_tokens,
                    record.cached_tokens, predicted_n)


def timings_so_far(request: Request, predicted_n: int, now: float) -> dict[str, float | int]:
    """`timings` of a running request, its `predicted_n` tokens out at `now`."""
    start = request.admitted if request.admitted is not None else request.submitted
    return _timings(start, request.first_token, now, request.prompt_len, request.cached_tokens,
                    predicted_n)


def progress(event: PromptProgress) -> dict[str, int]:
    """llama-server's `prompt_progress`."""
    return {"total": event.total, "cache": event.cache, "processed": event.processed,
            "time_ms": int(event.elapsed * 1e3)}
