"""The engine's contract with the scheduler: everything the host side may call, in one place.

    engine.config.num_slots, .max_seq_len, .prefill_chunk, .page_size, .max_pages_per_seq
    engine.num_pages                                    pages in the KV pool
    engine.vocab_size                                   token ids are in [0, vocab_size)
    tokens = engine.prefill(chunks, rows.params(), allowed)
                                                        `PrefillTokens`: np.asarray(tokens)[i]
                                                        is chunk i's token; .programs: how many
                                                        programs ran (normally one); `allowed`:
                                                        each slot's token bitmask, [num_slots,
                                                        ceil(vocab / 32)] int32 (None: all)
    tokens = engine.decode(positions, active, rows.params(), page_table, steps)
                                                        `DecodeTokens`: np.asarray(tokens) is
                                                        [steps, num_slots], each slot's next token
                                                        after each step (an inactive slot's entry:
                                                        its last token); 1 <= steps <=
                                                        engine.config.decode_steps. A row stops
                                                        at one of its `stop_ids` (its EOS): the
                                                        scheduler reads no token of it after that
    engine.decode_forward(positions, active, rows.params(), page_table)
    tokens = engine.decode_sample(allowed, drop)        one decode step in two halves (with
                                                        engine.config.structured_output): the
                                                        forward pass, then, once the host has
                                                        filled the rows' bitmasks from the step
                                                        before's tokens, the sampling: as
                                                        decode(..., steps=1) returns; the slots
                                                        in `drop` take no token. Nothing else
                                                        runs on the engine in between
    tokens = engine.verify(positions, active, rows.params(), page_table, drafts, draft_lens)
                                                        speculative decoding (with
                                                        engine.config.speculative_tokens = k > 0,
                                                        at most speculative_batch slots): each
                                                        slot's last token and its first
                                                        draft_lens[s] of drafts[s] ([num_slots, k])
                                                        scored at once; np.asarray(tokens) is
                                                        [k + 1, num_slots], tokens.emitted() how
                                                        many of each column are the tokens decode
                                                        would give (1 .. draft_lens + 1)
    handle = engine.extract(pages, length, slot)        `KVHandle`: a sequence's KV + next token
    landed = engine.receive(handle)                     starts copying it onto this engine's
                                                        device; landed.is_ready() once there
    engine.insert(handle, pages, slot)                  into free pages, of this or another engine;
                                                        returns the handle as copied to its device
                                                        (slot None: the pages only, a cached
                                                        prefix back from the host)
    handle.to_host_async(); handle.host_pages()         a handle's pages on the host, one (k, v)
    type(handle).from_host_pages(pages, size, width)    each, and back in a handle to insert
    engine.config.role                                  "both", or "prefill"/"decode" (one phase
                                                        of a disaggregated pair: the other raises)
    engine.copy_pages(sources, targets)                 page KV onto other pages (a forked
                                                        sequence's copy of a partial page)
    engine.set_history(slot, prompt_ids, output_ids, window, dry_breakers, sampler_state)
                                                        the slot's token history (what penalties
                                                        read, over the request's penalty_window,
                                                        and a stateful sampler's): call it when a
                                                        penalized or stateful request takes a
                                                        slot, before its next program
    state = engine.sampler_state(slot)                  the slot's sampler state after every
                                                        program so far, read (np.asarray) when
                                                        its request takes another slot
    tokens.logprobs()                                   of a prefill or decode result: `HostLogprobs`
                                                        shaped like its tokens (and [..., k] for
                                                        the max_logprobs alternatives), real for
                                                        the rows whose sampling asked
    tokens.scores()                                     of a prefill result: {chunk index:
                                                        `HostScores`} for the chunks with
                                                        `targets` (prompt logprobs, echo): each
                                                        target's logprob, rank, alternatives
    tokens.pooled()                                     of a prefill result: {chunk index: (sum,
                                                        last)} for the chunks marked `pooled`
                                                        (embeddings, which sample no token): the
                                                        sum of the chunk's final hidden states
                                                        and its last position's, [D] float32

KV lives in pages of the engine's pool; the scheduler decides which pages each sequence holds
(`scheduler.pages`) and passes them: a `PrefillChunk`'s `pages` is its sequence's page ids in
position order (all of an iteration's chunks go in one `prefill` call, which packs them),
`page_table` is [num_slots, max_pages_per_seq] int32 with every active slot's pages (enough for
the positions its steps write) and any valid page id elsewhere (inactive rows write nothing).
    engine.recover()                                    after a failed call: fresh device state
    engine.compilations_after_warmup, engine.kv_cache_bytes              for metrics

An engine may also compile programs on first use (`CompilesOnDemand`; the scheduler asks with
`getattr`, and an engine without these compiles nothing on demand, as its test doubles do):
    future = engine.prepare(groups)                     starts compiling the program groups
                                                        (`engine.config.GROUPS`) a request needs
                                                        that warm-up left out; None: nothing to
                                                        wait for, else a Future done when they are
    engine.ready(group)                                 whether a group's programs are compiled
    engine.compilations_on_demand                       for metrics

`prefill` and `decode` return at once (JAX dispatch is asynchronous); the scheduler reads the
arrays one iteration later with `np.asarray`. Any exception from `prefill`, `decode` or reading
their results means the device state may be lost: the scheduler fails the requests that were
running and calls `recover()`, which must rebuild the KV cache and the next-token buffer
whatever happened. If `recover()` itself raises, the engine is dead (`EngineDead`).

`RequestSampling` (one request's settings, validated when made), `SamplingRows` (the per-slot
rows) and `SamplingParams` (the rows as a call takes them, `SamplingRows.params()`) are the
sampling types of this boundary; the scheduler packs a
request's row once, when it takes a slot, so a value that cannot be packed fails that request
alone and never a step shared with others.

`engine.engine.Engine` implements this contract on the device; the scheduler's tests drive a
NumPy fake of it. This module imports no JAX, directly or through what it imports
(`tests/test_layering.py`), so neither does a scheduler that imports only it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from cadence.engine.config import EngineConfig
from cadence.engine.packing import PrefillChunk
from cadence.engine.results import DecodeTokens, KVHandle, PrefillTokens
from cadence.model.host_sampling import RequestSampling, SamplingParams, SamplingRows

__all__ = ["CompilesOnDemand", "DecodeTokens", "EngineAPI", "EngineConfig", "KVHandle", "PrefillChunk",
           "PrefillTokens", "RequestSampling", "SamplingParams", "SamplingRows"]


class EngineAPI(Protocol):
    config: EngineConfig

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_pages(self) -> int: ...

    def prefill(self, chunks: list[PrefillChunk], sampling: SamplingParams,
                allowed: np.ndarray | None = None) -> PrefillTokens: ...

    def decode(self, positions: np.ndarray, active: np.ndarray, sampling: SamplingParams,
               page_table: np.ndarray, steps: int = 1) -> DecodeTokens | np.ndarray: ...

    def decode_forward(self, positions: np.ndarray, active: np.ndarray, sampling: SamplingParams,
                       page_table: np.ndarray) -> None: ...

    def decode_sample(self, allowed: np.ndarray, drop: Sequence[int] = ()) -> DecodeTokens | np.ndarray: ...

    def verify(self, positions: np.ndarray, active: np.ndarray, sampling: SamplingParams,
               page_table: np.ndarray, drafts: np.ndarray, draft_lens: np.ndarray,
               allowed: np.ndarray | None = None) -> DecodeTokens: ...

    def extract(self, pages: list[int], length: int, slot: int) -> KVHandle: ...

    def receive(self, handle: KVHandle) -> KVHandle: ...

    def insert(self, handle: KVHandle, pages: list[int], slot: int | None) -> KVHandle: ...

    def copy_pages(self, sources: Sequence[int], targets: Sequence[int]) -> None: ...

    def set_history(self, slot: int, prompt_ids: Sequence[int], output_ids: Sequence[int] = (),
                    window: int = 0, dry_breakers: Sequence[int] | None = None,
                    sampler_state: Sequence[float] = ...) -> None: ...

    def sampler_state(self, slot: int) -> Any: ...

    def recover(self) -> None: ...

    @property
    def compilations_after_warmup(self) -> int: ...

    @property
    def kv_cache_bytes(self) -> int: ...


class CompilesOnDemand(Protocol):
    """What an engine that compiles some programs on first use adds (`engine.engine.Engine`);
    the scheduler looks for it with `getattr`."""

    def prepare(self, groups: Sequence[str]) -> Future | None: ...

    def ready(self, group: str) -> bool: ...

    @property
    def compilations_on_demand(self) -> int: ...
