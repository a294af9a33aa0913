"""What an iteration costs: a model fitted to the iterations the loop has run, which sizes each
iteration's prefill to an inter-token target (`policy.PrefillLimit`).

    cost = IterationCost(block=16, buckets=(16, 32, 64, 128, 144))
    cost.dispatched(cost.work(plan), at)      # a plan's programs went out
    cost.ready(at)                            # the oldest plan's results came back
    cost.prefill_seconds(0.2, decoding)       # what prefill may take beside these decodes
    cost.prefill([(start, length), ...])      # what a plan's prefill chunks take

The loop is pipelined: an iteration dispatches its plan, then waits for the previous plan's
results. So the time a plan took is counted from when the device could start it (the previous
plan's results, or its own dispatch if that came later) to its own results. That is also the
gap between two tokens of a stream that decodes in it, the quantity an inter-token target
bounds.

The model is a line through five features of a plan:

    seconds = base + per_row x decode rows + per_key x decode rows' keys
              + per_token x prefill tokens (the packed programs' sizes)
              + per_pair x query-key pairs of the prefill chunks' attention

Prefill tokens are counted as the engine runs them: chunks padded to the pack block, packed
into a program of the next bucket's size (an 80-token plan runs a 128-token program, and costs
about what 128 tokens cost).

A chunk of n tokens from position s attends over s + n keys per token, so it has n (s + n)
pairs. That term makes a chunk deep in a long document cost more than the same chunk at its
start. (On 2 CPU cores, SmolLM2's iterations that carried a 128-token chunk of a 2-3k-token
document took up to 0.44 s, against 12 ms for a decode step: `bench/results/itl-target-cpu/`.)

Least squares over the last plans that ran one decode step and nothing speculative (`window`
of them with prefill and as many without, kept apart so that a quiet spell of decoding alone
never forgets what prefill costs), each coefficient kept >= 0: a feature whose coefficient
comes out negative is dropped and the rest refitted. Until `min_samples` plans, two of them
with prefill, have been seen there is no model.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from cadence.engine.packing import bucket_for
from cadence.model.arith import cdiv

KILO = 1024.0  # keys and pairs are counted in thousands, so that no feature dwarfs the others


@dataclasses.dataclass(frozen=True)
class Work:
    """The features of one plan (see the module docstring)."""

    decode_rows: int = 0
    decode_keys: int = 0  # the decode rows' contexts, summed
    prefill_tokens: int = 0  # the packed programs' tokens
    prefill_pairs: int = 0  # sum over chunks of length x (start + length)

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.decode_rows), self.decode_keys / KILO, float(self.prefill_tokens),
                self.prefill_pairs / KILO)


class IterationCost:
    """The fitted model. Not thread-safe: the scheduler calls it holding its state lock (from
    the admitting loop, and from the decode loop when a handoff fails the prefill pool)."""

    def __init__(self, block: int = 1, buckets: Sequence[int] | None = None, window: int = 128,
                 min_samples: int = 8):
        """`block`: the engine's pack block; `buckets`: its packed prefill programs' token
        sizes (None: a program of exactly the padded tokens)."""
        self.block, self.buckets, self.min_samples = block, tuple(buckets or ()), min_samples
        # The plans learned from, with and without prefill, each with the seconds it took.
        self._samples = {True: collections.deque(maxlen=window), False: collections.deque(maxlen=window)}
        self._flight: collections.deque[tuple[Work | None, float]] = collections.deque()
        self._last_ready: float | None = None
        self._coefficients: np.ndarray | None = None
        self._stale = False

    def program_tokens(self, chunks: Sequence[tuple[int, int]]) -> int:
        """Tokens of the packed programs that run `chunks` ((start, length) pairs)."""
        tokens = sum(cdiv(n, self.block) * self.block for _, n in chunks)
        if not self.buckets or not tokens:
            return tokens
        largest = self.buckets[-1]
        full, rest = divmod(tokens, largest)
        return full * largest + (bucket_for(self.buckets, rest) if rest else 0)

    def work(self, plan) -> Work:
        """A `policy.Plan`'s features."""
        chunks = [(c.start, c.length) for c in plan.prefill]
        return dataclasses.replace(_decoding(plan.decode), prefill_tokens=self.program_tokens(chunks),
                                   prefill_pairs=_pairs(chunks))

    def dispatched(self, work: Work | None, at: float) -> None:
        """A plan's programs went out at `at`. `work` None: a plan not to learn from (several
        decode steps, a verify step), whose results still take the device's time."""
        self._flight.append((work, at))

    def ready(self, at: float) -> None:
        """The oldest dispatched plan's results came back at `at`."""
        if not self._flight:
            return
        work, sent = self._flight.popleft()
        start = sent if self._last_ready is None else max(sent, self._last_ready)
        self._last_ready = at
        if work is not None:
            self._samples[work.prefill_tokens > 0].append((work, at - start))
            self._stale = True

    @property
    def timings(self) -> list[tuple[Work, float]]:
        """The plans learned from, each with the seconds it took: those with prefill, then
        those without, each oldest first."""
        return [*self._samples[True], *self._samples[False]]

    def forget_in_flight(self) -> None:
        """After a failed iteration: what was in flight will never come back."""
        self._flight.clear()
        self._last_ready = None

    def coefficients(self) -> np.ndarray | None:
        """(base, per_row, per_key, per_token, per_pair), or None while too little is seen."""
        if self._stale:
            self._stale = False
            self._coefficients = self._fit()
        return self._coefficients

    def _fit(self) -> np.ndarray | None:
        samples = self.timings
        if len(samples) < self.min_samples or len(self._samples[True]) < 2:
            return None
        x = np.array([w.features() for w, _ in samples])
        y = np.array([s for _, s in samples])
        kept = list(range(x.shape[1]))
        while kept:
            solution = np.linalg.lstsq(x[:, kept], y, rcond=None)[0]
            worst = int(np.argmin(solution))
            if solution[worst] >= 0:
                out = np.zeros(x.shape[1])
                out[kept] = solution
                return out
            del kept[worst]
        return None

    def predict(self, work: Work) -> float | None:
        c = self.coefficients()
        return None if c is None else float(np.dot(c, work.features()))

    def prefill(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds prefill chunks ((start, length) pairs) add to a plan (0 before a model
        exists)."""
        c = self.coefficients()
        if c is None:
            return 0.0
        return float(c[3] * self.program_tokens(chunks) + c[4] * _pairs(chunks) / KILO)

    def prefill_seconds(self, target: float, decoding: Iterable) -> float | None:
        """What the prefill of a plan that decodes `decoding` (requests) may take within
        `target` seconds: never below 0; None while there is no model."""
        rest = self.predict(_decoding(decoding))
        return None if rest is None else max(0.0, target - rest)


def _decoding(requests: Iterable) -> Work:
    """The features of decoding `requests` (each row's context: its prompt and output so far)."""
    rows = list(requests)
    return Work(len(rows), sum(r.prompt_len + r.dispatched for r in rows))


def _pairs(chunks: Sequence[tuple[int, int]]) -> int:
    """The query-key pairs of the chunks' causal attention, each token over every key before it
    and itself (as n (s + n), a little over)."""
    return sum(n * (s + n) for s, n in chunks)
