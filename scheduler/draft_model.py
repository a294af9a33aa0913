"""Speculative decoding's drafts from a second, smaller model of the same vocabulary (vLLM's
draft model, llama.cpp's --model-draft).

    drafts = DraftModel(draft_engine, k=4, p_min=0.75)
    proposals = drafts.propose({key: (tokens, room)})   # {key: up to `room` tokens}

`tokens` is a decoding row's sequence as the target has it (prompt, then output; its last
token is the one the target's next step consumes), `room` how many drafts it may take (at most
k). The draft model runs ahead of the target greedily, on its own engine (`engine.api.
EngineAPI`: its own weights, KV pool and programs; a slot for each row of a call): a row's KV is
first caught up with the tokens of its sequence the draft model has not seen, one prefill
whose sampled token is the first draft (the whole prompt the first time; after a verify step,
the one or two tokens it added past the drafts already written), then the other drafts are
decoded, k - 1 steps in one call. Every drafting row goes in the same two calls. The target's
verify step keeps only the drafts its own sampling agrees with, so the draft model changes how
many tokens a step yields, never which. With `p_min` (llama.cpp's --draft-p-min), a row's
drafts end before the first the draft model gave less than that probability: where it is
unsure (free prose), the verify step scores fewer guesses, and a row left with none decodes
plainly and sits out a few steps (`speculative.Acceptance`), as one whose n-grams found nothing.

A row's draft KV lives in pages this class allocates from the draft engine's pool
(`scheduler.pages.PageAllocator`, no prefix cache) and keeps across steps, so the catch-up
stays short; what they hold is recorded as the tokens written there, and a step rewrites from
the first that differs from the row's sequence (a rejected draft, a preempted and recomputed
request). When the pool runs short, the rows that drafted least recently give their pages
back (they catch up from their first token if they draft again), so finished requests need
no notice: their pages go first. A row whose sequence does not fit even then drafts nothing. A
row new here takes over the KV of the one it agrees with longest (at least a page) among those
not drafting in the call: a chat's next turn resumes from the last one's, as the model's own
prefix cache lets it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
from absl import logging

from cadence.engine.api import EngineAPI, PrefillChunk, SamplingRows
from cadence.scheduler.pages import NULL_PAGE, PageAllocator


@dataclasses.dataclass
class _Row:
    pages: list[int] = dataclasses.field(default_factory=list)
    written: list[int] = dataclasses.field(default_factory=list)  # tokens whose KV the pages hold


class DraftModel:
    """A draft model's engine and the KV it holds for each drafting row (keyed by whatever the
    caller names rows with: the scheduler's requests)."""

    def __init__(self, engine: EngineAPI, k: int, p_min: float = 0.0):
        cfg = engine.config
        if k < 1:
            raise ValueError(f"a draft model drafts at least 1 token a step, got k={k}")
        if k > 1 and cfg.decode_steps < k - 1:
            raise ValueError(f"the draft engine decodes {k - 1} steps a call for k={k} drafts; its "
                             f"decode_steps is {cfg.decode_steps}")
        if not 0.0 <= p_min < 1.0:
            raise ValueError(f"p_min is a probability in [0, 1), got {p_min}")
        self.engine, self.k, self.p_min = engine, k, p_min
        self.pages = PageAllocator(engine.num_pages, cfg.page_size)
        self._rows: collections.OrderedDict[Hashable, _Row] = collections.OrderedDict()  # LRU first
        greedy = SamplingRows(cfg.num_slots)
        greedy.logprobs[:] = p_min > 0  # each draft's probability, to cut the drafts at p_min
        self._greedy = greedy.params()
        self.caught_up = 0  # tokens prefilled to catch rows up, since the start (for its record)
        self.evicted = 0  # rows whose pages were taken back for others
        self.failed = False  # its engine failed and did not recover: it drafts no more

    @classmethod
    def for_target(cls, engine: EngineAPI, target: EngineAPI, p_min: float = 0.0) -> DraftModel:
        """A draft model for `target`'s verify steps (k = its speculative_tokens): the same
        vocabulary, a context as long, a slot for every row a verify step runs."""
        t, d = target.config, engine.config
        if not t.speculative_tokens:
            raise ValueError("a draft model drafts for a verify program: the target engine needs "
                             "speculative_tokens > 0")
        if engine.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {engine.vocab_size} tokens, the "
                             f"target's {target.vocab_size}: a draft model shares its target's")
        rows = min(t.num_slots, t.speculative_batch)
        if d.num_slots < rows or d.max_seq_len < t.max_seq_len:
            raise ValueError(f"the draft engine needs {rows} slots of {t.max_seq_len} tokens (the "
                             f"target's verify rows and context), got {d.num_slots} of {d.max_seq_len}")
        return cls(engine, t.speculative_tokens, p_min)

    def propose(self, rows: Mapping[Hashable, tuple[Sequence[int], int]]) -> dict[Hashable, list[int]]:
        """Up to `room` greedy drafts for each row `key: (tokens, room)`; a row whose KV does
        not fit the draft pool, with no room, or past the engine's slots is left out. Waits for
        the drafts.

        A failed draft engine fails no request: its call's rows draft nothing (they decode
        plainly), the engine recovers and every row's draft KV is forgotten; if it cannot
        recover, nothing drafts from then on. Either is logged."""
        if self.failed:
            return {}
        try:
            return self._propose(rows)
        except Exception as error:  # noqa: BLE001 - the target's requests go on without drafts
            logging.exception("cadence: the draft model failed (%s); recovering it", error)
            self.forget()
            try:
                self.engine.recover()
            except Exception:  # noqa: BLE001
                logging.exception("cadence: the draft model did not recover; drafting stops")
                self.failed = True
            return {}

    def _propose(self, rows: Mapping[Hashable, tuple[Sequence[int], int]]) -> dict[Hashable, list[int]]:
        cfg = self.engine.config
        placed: dict[Hashable, tuple[int, list[int], int, int]] = {}  # key: (slot, tokens, room, from)
        for key, (tokens, room) in rows.items():
            tokens = list(tokens)
            if room <= 0 or not tokens or len(tokens) + self.k - 1 > cfg.max_seq_len:
                continue  # (a decode call writes k - 1 drafts' KV for every row)
            if len(placed) == cfg.num_slots:
                break
            row = self._rows.pop(key, None) or self._take_over(tokens, rows) or _Row()
            self._rows[key] = row  # the most recently drafted
            start = _common_start(row.written, tokens, len(tokens) - 1)  # the last is always fed
            del row.written[start:]
            # Pages for the sequence, and the k - 1 drafts decoded after it.
            if not self._grow(row, len(tokens) + self.k - 1, keep=rows):
                self.pages.release(row.pages)
                del self._rows[key], row.written[:]
                continue
            placed[key] = (len(placed), tokens, min(room, self.k), start)
        if not placed:
            return {}
        chunks = []
        for key, (slot, tokens, _, start) in placed.items():  # a long catch-up in chunks, one call
            pages = self._rows[key].pages
            for at in range(start, len(tokens), cfg.prefill_chunk):
                end = min(at + cfg.prefill_chunk, len(tokens))
                chunks.append(PrefillChunk(slot, tokens[at:end], at, end == len(tokens), pages))
            self.caught_up += len(tokens) - start
        # The decode call follows on the device (each row's first draft is its slot's next
        # input there), so the host reads both calls' tokens once, after both.
        first = self.engine.prefill(chunks, self._greedy)
        steps = max(room for _, _, room, _ in placed.values()) - 1
        after = None
        if steps:
            positions = np.zeros(cfg.num_slots, np.int32)
            active = np.zeros(cfg.num_slots, bool)
            table = np.full((cfg.num_slots, cfg.max_pages_per_seq), NULL_PAGE, np.int32)
            for key, (slot, tokens, _, _) in placed.items():
                positions[slot], active[slot] = len(tokens), True
                pages = self._rows[key].pages
                table[slot, : len(pages)] = pages
            after = self.engine.decode(positions, active, self._greedy, table, steps)
        # Each row's drafts in order, [1 + steps], and their logprobs (with p_min), read once.
        finals = [i for i, c in enumerate(chunks) if c.final]
        slots = [slot for slot, _, _, _ in placed.values()]
        tokens_read = np.asarray(first)[finals][:, None]
        sure = first.logprobs().token[finals][:, None] if self.p_min else None
        if after is not None:
            tokens_read = np.concatenate([tokens_read, np.asarray(after)[:, slots].T], axis=1)
            if self.p_min:
                sure = np.concatenate([sure, after.logprobs().token[:, slots].T], axis=1)
        unsure = sure < np.log(self.p_min) if self.p_min else None  # every row's, at once
        drafts = {}
        for i, (key, (_, tokens, room, _)) in enumerate(placed.items()):
            row = tokens_read[i].tolist()
            # The KV written: the sequence, and every draft decoded from (all but the last).
            self._rows[key].written = tokens + row[:steps]
            if unsure is not None:  # up to the first the draft model was not sure enough of
                cut = np.flatnonzero(unsure[i, :room])
                room = int(cut[0]) if cut.size else room
            if room:
                drafts[key] = row[:room]
        return drafts

    def _take_over(self, tokens: list[int], keep: Mapping) -> _Row | None:
        """For a row new here: the KV of another (none of `keep`) that agrees with its tokens
        longest, if over at least a page, which it takes over (the next turn of a chat takes the
        last one's, which is done and drafts no more)."""
        best, length = None, self.engine.config.page_size - 1
        for key, row in self._rows.items():
            if key not in keep:
                n = _common_start(row.written, tokens, len(tokens) - 1)
                if n > length:
                    best, length = key, n
        return None if best is None else self._rows.pop(best)

    def _grow(self, row: _Row, tokens: int, keep: Mapping) -> bool:
        """Pages for `tokens` tokens of `row`, taking back the least recently drafted rows'
        (none of `keep`) while the pool is short."""
        while self.pages.grow(row.pages, tokens) is None:
            victim = next((key for key in self._rows if key not in keep), None)
            if victim is None:
                return False
            self.pages.release(self._rows.pop(victim).pages)
            self.evicted += 1
        return True

    def forget(self) -> None:
        """Drops every row's draft KV (after the draft engine recovered from a failure)."""
        for row in self._rows.values():
            self.pages.release(row.pages)
        self._rows.clear()


def _common_start(written: Sequence[int], tokens: Sequence[int], limit: int) -> int:
    """How many leading tokens `written` and `tokens` share, at most `limit`."""
    n = min(len(written), limit)
    if written[:n] == tokens[:n]:
        return n
    return next(i for i in range(n) if written[i] != tokens[i])
