"""Client JSON, read strictly and within bounds: the one parser of every text a client sends
as JSON (a request body, a batch job's line, an earlier tool call's arguments).

    value = load_json(raw)   # SubmissionError: malformed, too deep, out of range, bad text

Nothing is coerced and nothing can exhaust the parser: JSON nested deeper than `MAX_JSON_DEPTH`,
integers longer than `MAX_INT_DIGITS` digits, non-finite numbers (`1e999`, `NaN`) and strings
that are not valid Unicode text (a lone surrogate) are refused with a message that says which.
"""

from __future__ import annotations

import json
import math
from typing import Any

from cadence.scheduler.errors import SubmissionError

MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 40  # a uint32 seed has 10; nothing cadence takes needs more


class TooDeep(SubmissionError):
    """JSON nested deeper than `MAX_JSON_DEPTH`."""

    def __init__(self):
        super().__init__(f"the JSON is nested too deeply (at most {MAX_JSON_DEPTH} levels)")


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits is out of range (at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]}{'...' if len(text) > 20 else ''} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_json(raw: bytes | str) -> Any:
    """Parses one JSON document strictly; `SubmissionError` says what is wrong with it."""
    try:
        value = json.loads(raw, parse_int=_bounded_int, parse_float=_finite_float,
                           parse_constant=_no_constant)
    except RecursionError:
        raise TooDeep() from None
    except UnicodeDecodeError as e:
        raise SubmissionError(f"the body is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:  # json.JSONDecodeError, and the parse hooks' errors
        raise SubmissionError(f"the body is not valid JSON: {e}") from None
    check_json_value(value)
    return value


def check_json_value(value: Any) -> None:
    """Depth and text checks over a parsed document, iteratively (no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            check_text(node)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise TooDeep()
        if isinstance(node, dict):
            for key, item in node.items():
                check_text(key)
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in node)


def check_text(text: str, param: str | None = None) -> str:
    """`text` if it is valid Unicode text; a lone surrogate (JSON "\\ud800") cannot be encoded,
    tokenized or echoed back, so it is refused here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SubmissionError(f"text contains an unpaired surrogate (U+{ord(text[e.start]):04X} at "
                              f"index {e.start}); send valid Unicode", param) from None
    return text
