"""Speculative decoding's host side: draft tokens from the sequence itself, and when to ask.

    drafts = NgramDrafts(min_n=2, max_n=4)
    drafts.extend(prompt_ids)                  # then every accepted token, as it is accepted
    proposal = drafts.propose(k=4)             # up to k tokens, [] when nothing matches

Prompt lookup (n-gram drafting): answers that quote or edit a document repeat spans of it, so
the tokens that followed the sequence's latest n tokens the last time those n tokens occurred
are a good guess of what comes next, and cost nothing to find. `NgramDrafts` keeps an index
from every `min_n`-gram of the sequence (prompt and output) to where it occurred, updated in
O(1) per token; a proposal looks up the sequence's last `min_n` tokens, extends each of the
most recent `max_candidates` matches backwards up to `max_n` tokens, and copies what followed the longest
(the most recent among equals). Work per proposal is bounded by `max_candidates` x `max_n`
comparisons, whatever the sequence's length.

The engine then scores the row's last token and the k drafts in one pass (`Engine.verify`),
samples its own token at every position with the request's sampler, and keeps drafts while
they equal its samples: the output is the one decoding without drafts gives, token for token
(samples are keyed by position, so this holds for seeded sampling as well as greedy).

A request may also bring a prediction of its answer (OpenAI's Predicted Outputs: a file to be
edited, as it was): its own `NgramDrafts`, searched for the sequence's end first (`propose`'s
`tail`), so an answer that follows the prediction drafts from it even where its prompt does
not hold the text. The drafts it gave and how many were accepted are counted for the usage.

`Acceptance` is the per-request record the policy reads: speculation pays only while drafts
are accepted, so a request whose recent drafts were mostly rejected stops drafting for a while
and tries again later; one whose sequence offered nothing to draft sits out a few steps (a
step that drafts is one the host waits for, so drafting nothing costs the overlap of host and
device work for nothing), and longer each time in a row. `Drafter` is one request's n-grams
and a record for each source of its drafts (its own, and a draft model's where the server has
one), as the scheduler keeps it (`Request.drafter`); `SpeculativeConfig` the n-gram sizes
every request's uses.
`verify_ready` says whether an engine's verify program can run yet.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable

MAX_CANDIDATES = 8  # most recent occurrences of the key n-gram examined per proposal


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt lookup's n-gram sizes (vLLM's `prompt_lookup_min` / `prompt_lookup_max`), and a
    draft model's least probability for a draft (llama.cpp's --draft-p-min:
    `draft_model.DraftModel`'s `p_min`). How many tokens a step drafts, and for how many rows at
    most, are the engine's (`EngineConfig.speculative_tokens`, `speculative_batch`): with
    speculative_tokens 0 nothing drafts."""

    min_n: int = 2
    max_n: int = 4
    draft_p_min: float = 0.75

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {self.min_n} and {self.max_n}")
        if not 0.0 <= self.draft_p_min < 1.0:
            raise ValueError(f"draft_p_min is a probability in [0, 1), got {self.draft_p_min}")


def verify_ready(engine) -> bool:
    """Whether `engine` (an `engine.api.EngineAPI`) can run a verify step now. One whose verify
    program warm-up left for first use starts compiling it (on the engine's own thread,
    `CompilesOnDemand`) and decodes plainly until it is ready."""
    if not engine.config.speculative_tokens:
        return False
    ready = getattr(engine, "ready", None)  # (test doubles compile nothing)
    if ready is None or ready("speculative"):
        return True
    engine.prepare(["speculative"])
    return False


class NgramDrafts:
    """Prompt-lookup drafts over one sequence (its prompt, then its output as accepted)."""

    def __init__(self, min_n: int = 2, max_n: int = 4, max_candidates: int = MAX_CANDIDATES):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n, self.max_candidates = min_n, max_n, max_candidates
        self.tokens: list[int] = []
        self._where: dict[tuple[int, ...], list[int]] = {}  # min_n-gram -> its start positions

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            start = len(self.tokens) - self.min_n
            if start >= 0:
                key = tuple(self.tokens[start:])
                self._where.setdefault(key, []).append(start)

    def truncate(self, length: int) -> None:
        """Forgets the tokens past `length` (a preempted request's output, recomputed)."""
        while len(self.tokens) > length:
            start = len(self.tokens) - self.min_n
            if start >= 0:
                key = tuple(self.tokens[start:])
                starts = self._where[key]
                starts.pop()
                if not starts:
                    del self._where[key]
            self.tokens.pop()

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match (min_n..max_n tokens) of
        the sequence's end; [] when its last min_n tokens never occurred before."""
        return self.lookup(k)[0]

    def lookup(self, k: int, tail: list[int] | None = None,
               after: int | None = None) -> tuple[list[int], int]:
        """`propose`'s drafts and where they start in this sequence. With `tail` (another
        sequence: the answer so far), its end is matched here instead. Candidates are the most
        recent matches, or with `after` the first from that position on (a prediction is
        read in order; the most recent where none is that far on)."""
        seq, n = self.tokens, self.min_n
        tail = seq if tail is None else tail
        if k <= 0 or len(tail) <= n:
            return [], 0
        starts = self._where.get(tuple(tail[-n:]))
        if not starts:
            return [], 0
        first = len(starts) if after is None else bisect.bisect_left(starts, after)
        if first < len(starts):  # from `after` on, nearest first
            candidates = starts[first:first + self.max_candidates]
        else:  # the most recent first
            candidates = starts[:-self.max_candidates - 2:-1]
        best, best_len = -1, 0
        end = len(tail)
        for start in candidates:
            if start + n >= len(seq):
                continue  # nothing follows it (the sequence's own end, where tail is the sequence)
            length = n
            while (length < self.max_n and start - (length - n) - 1 >= 0
                   and seq[start - (length - n) - 1] == tail[end - length - 1]):
                length += 1
            if length > best_len:
                best, best_len = start, length
            if length == self.max_n:
                break  # the nearest (or most recent) of the longest possible
        if best < 0:
            return [], 0
        follow = best + n
        return seq[follow : follow + k], follow


@dataclasses.dataclass
class Acceptance:
    """One request's recent drafting record: an exponential average of the fraction of its
    drafts accepted, and how many steps it sits out. A step that found nothing to draft, or
    after which the average fell too low, is a failure: the request sits out MISS_PAUSE or PAUSE
    steps, doubled for every failure in a row since drafts last paid, up to MAX_PAUSE. Free text
    then costs a drafting step (one that waits for the host) every MAX_PAUSE steps or so, while
    a quote that starts mid-answer waits at most that long to be drafted. A draft model's
    record misses with `miss_pause` PAUSE: its finding nothing (sure of no token) cost its
    work, as drafts that fail do."""

    DECAY = 0.5
    LOW = 0.25  # below this, drafting costs more than it saves
    PAUSE = 16  # steps to sit out once drafts fail
    MISS_PAUSE = 4  # ... once the sequence had nothing to draft
    MAX_PAUSE = 32

    miss_pause: int = MISS_PAUSE
    rate: float = 1.0  # optimistic: a new request drafts
    pause: int = 0
    failures: int = 0  # in a row
    proposed: int = 0  # totals, for its record
    accepted: int = 0

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            self._fail(self.miss_pause)
            return
        self.proposed += proposed
        self.accepted += accepted
        self.rate = self.DECAY * self.rate + (1 - self.DECAY) * accepted / proposed
        if self.rate < self.LOW:
            self._fail(self.PAUSE)
        elif accepted:
            self.failures = 0

    def _fail(self, pause: int) -> None:
        self.failures += 1
        self.pause = max(self.pause, min(pause << (self.failures - 1), self.MAX_PAUSE))

    def wants(self) -> bool:
        """Whether to draft this step (counts down a pause)."""
        if self.pause > 0:
            self.pause -= 1
            if self.pause == 0:
                self.rate = self.LOW * 2  # a fresh chance, not a fresh record
            return False
        return True


class Drafter:
    """One request's drafting: an n-gram index over its prompt and output (and one over its
    `prediction`, if it has one), and an acceptance record for each source of its drafts: its
    own (the prediction and the n-grams, free to look up) and, where the server has one, the
    draft model's (`draft_model.DraftModel`, whose misses cost its work). Each step, a source
    whose record wants drafts may draft (`wants`). The request's own drafts come first
    (`propose`: the prediction's where the answer's end matches there, else the sequence's),
    the draft model's only where those found nothing (`drafted_by_model`); a verify step's
    outcome goes to the record of the source that drafted (`observe`)."""

    def __init__(self, config: SpeculativeConfig = SpeculativeConfig(), prediction: list[int] = ()):
        self.ngrams = NgramDrafts(config.min_n, config.max_n)
        self.acceptance = Acceptance()  # its own drafts'
        self.model_acceptance = Acceptance(miss_pause=Acceptance.PAUSE)  # the draft model's
        self.own = self.by_model = False  # which sources may draft this step (`wants`)
        self._record = self.acceptance  # where the next verify step's outcome goes
        self.prediction: NgramDrafts | None = None
        if prediction:
            self.prediction = NgramDrafts(config.min_n, config.max_n)
            self.prediction.extend(prediction)
        self.predicted_at: int | None = None  # where the last proposal began in the prediction
        self.cursor = 0  # how far the answer has followed the prediction (where to look next)
        self.prediction_accepted = self.prediction_rejected = 0  # its drafts, verified

    def wants(self, model: bool = False) -> bool:
        """Whether to draft this step: from the request's own sequence, or (with `model`: the
        server has a draft model) from the draft model. Counts the step in each record."""
        self.own = self.acceptance.wants()
        self.by_model = model and self.model_acceptance.wants()
        return self.drafting

    @property
    def drafting(self) -> bool:
        """Whether some source may draft this step (as `wants` last said)."""
        return self.own or self.by_model

    def propose(self, prompt_ids: list[int], output_ids: list[int], k: int) -> list[int]:
        """Up to `k` drafts of its own: the prediction's, where the answer follows it, else
        the sequence's n-grams'."""
        seen = len(self.ngrams)
        if seen < len(prompt_ids):
            self.ngrams.extend(prompt_ids[seen:])
            seen = len(prompt_ids)
        self.ngrams.extend(output_ids[seen - len(prompt_ids):])
        drafts, at = self.prediction.lookup(k, self.ngrams.tokens, self.cursor) if self.prediction else ([], 0)
        self.predicted_at = at if drafts else None
        self._record = self.acceptance
        return drafts or self.ngrams.propose(k)

    def drafted_by_model(self) -> None:
        """This step's drafts are the draft model's."""
        self._record, self.predicted_at = self.model_acceptance, None

    @property
    def from_model(self) -> bool:
        """Whether the last drafts were the draft model's."""
        return self._record is self.model_acceptance

    def observe(self, drafts: list[int], tokens: list[int]) -> int:
        """The tokens a verify step gave for `drafts`: how many drafts they accepted (their
        common start), recorded."""
        accepted = 0
        while accepted < min(len(drafts), len(tokens)) and drafts[accepted] == tokens[accepted]:
            accepted += 1
        self._record.observe(len(drafts), accepted)
        if self.predicted_at is not None:
            self.prediction_accepted += accepted
            self.prediction_rejected += len(drafts) - accepted
            self.cursor = max(self.cursor, self.predicted_at + accepted - self.prediction.max_n)
        return accepted
