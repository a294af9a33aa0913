"""Results dispatched on an engine and not yet applied, as the scheduler keeps them (typed).

Each dispatch (a packed prefill, a decode step, the sampling half of a split step, a verify
step) leaves one
`Pending` on its pool: the engine's result, whose tokens the host reads an iteration later,
and a `Row` for each request it holds a token of: the request and the column of its token
(its slot for decode, its chunk's index for prefill), or, for a scored prefill chunk, `Scores`
(the chunk's prompt logprobs), for an embedding's chunk, `Pooled` (its hidden states), and for
a chunk whose request follows its prompt's progress, `Progress`. `Pending.read` turns the tokens
as read into arrays by step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from cadence.scheduler.request import Request


@dataclasses.dataclass(frozen=True)
class Pooled:
    """In a prefill result's rows: an embedding's chunk `chunk` (its index in the call), the
    prompt's last when `final`: its hidden states summed, and its last one."""

    chunk: int
    final: bool


@dataclasses.dataclass(frozen=True)
class Scores:
    """In a prefill result's rows: the prompt logprobs of the chunk `chunk` (its index in the
    call), which starts at position `start`."""

    chunk: int
    start: int


@dataclasses.dataclass(frozen=True)
class Progress:
    """In a prefill result's rows: a chunk (not the prompt's last) of a request that asked for
    its progress (`Request.progressed`), which leaves `processed` of its prompt computed."""

    processed: int


class Row(NamedTuple):
    request: Request
    index: int | Scores | Pooled | Progress  # the column of its token in the result, or what else it takes


@dataclasses.dataclass(frozen=True)
class Pending:
    rows: list[Row]
    tokens: Any  # the engine's result (`engine.api`: PrefillTokens, DecodeTokens)
    # A verify step's (speculative decoding): each row's drafts, in `rows`' order; its result
    # says how many tokens each row emitted (`DecodeTokens.emitted`).
    drafts: list[list[int]] | None = None

    def read(self, values: np.ndarray) -> tuple[np.ndarray, tuple | None]:
        """The tokens as read (`values`: [n] for prefill, a token per chunk, or [steps, n] for
        decode) as [steps, n], and (token logprob, top ids, top logprobs) laid out alike when
        one of the rows' requests asked for logprobs (read from the device only then)."""
        steps = np.atleast_2d(values)
        if not any(r.logprobs is not None for r, _ in self.rows):
            return steps, None
        token, ids, top = self.tokens.logprobs()
        return steps, (np.atleast_2d(token), ids.reshape(steps.shape + ids.shape[-1:]),
                       top.reshape(steps.shape + top.shape[-1:]))
