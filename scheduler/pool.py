"""One engine's slots, KV pages and page table, as the scheduler keeps them.

    pool = Pool(engine, "colocated")          # or "prefill" / "decode": a disaggregated pair
    pool.take(r)                              # a free slot; r.pool is this pool
    pool.grow(r, tokens)                      # pages for `tokens` positions, all or nothing
    pool.release(r)                           # slot and pages back, the slot's rows reset
    pool.publish(r)                           # r's newly full pages join the prefix cache

Colocated serving has one pool that prefills and decodes. Disaggregated serving has two, each
over its own engine (its own device, weights and page pool): a request holds a slot and pages in
exactly one of them at a time, and moves from the prefill pool to the decode pool when its KV is
handed over (`Scheduler._start_transfers`). The admitting pool keeps the prefix cache
(`caching`): admission looks prompts up in it, and its requests publish their pages to it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cadence.engine.api import EngineAPI, SamplingRows
from cadence.scheduler.pages import PageAllocator
from cadence.scheduler.request import Request


class Pool:
    def __init__(self, engine: EngineAPI, name: str, caching: bool = False):
        cfg = engine.config
        self.engine = engine
        self.name = name
        self.num_slots = cfg.num_slots
        self.page_size = cfg.page_size
        self.pages = PageAllocator(engine.num_pages, cfg.page_size, caching)
        # Each slot's occupant's pages; free slots' rows point at page 0, which any step may
        # read (never write) without harm.
        self.tables = np.zeros((cfg.num_slots, cfg.max_pages_per_seq), np.int32)
        self.rows = SamplingRows(cfg.num_slots)  # each slot's occupant's sampling row
        self.free_slots = list(range(cfg.num_slots))[::-1]
        self.running: list[Request] = []  # holding a slot here, in slot-assignment order
        # Results dispatched on this engine, not yet applied: (requests, each with its token's
        # index), tokens.
        self.pending: list[tuple[list[tuple[Request, int]], Any]] = []
        self.applying: list[tuple[list[tuple[Request, int]], Any]] = []  # being read and applied
        # A decode step whose forward pass is dispatched and whose sampling waits for the
        # previous tokens (grammar bitmasks): its requests, each with its slot.
        self.split: list[tuple[Request, int]] | None = None
        self.busy_seconds = 0.0  # wall time of this pool's iterations that ran a program

    def take(self, r: Request) -> None:
        """Gives `r` a free slot (the caller checked there is one); its sampling row is set
        separately (`rows.set`), since a value that cannot be packed fails the request alone."""
        r.slot = self.free_slots.pop()
        r.pool = self
        self.running.append(r)

    def grow(self, r: Request, tokens: int) -> bool:
        """Pages so that `r` holds `tokens` positions; False (nothing changed) if too few are free."""
        new = self.pages.grow(r.pages, tokens)
        if new is None:
            return False
        if new:
            self.tables[r.slot, len(r.pages) - len(new) : len(r.pages)] = new
        return True

    def share(self, r: Request, hit: list[int], cached: bool = True) -> None:
        """Gives `r`, which holds no page yet, the pages `hit` as its first pages: cached ones,
        or (not `cached`) full pages of its group's first sequence (`PageAllocator.share`)."""
        assert not r.pages, "a prefix hit comes before any page of its own"
        self.pages.share(r.pages, hit, cached=cached)
        self.tables[r.slot, : len(hit)] = hit
        r.published = len(hit)

    def hold_copy(self, r: Request, page: int) -> None:
        """`r` (forked) will copy `page`, another sequence's, into its next page: held till then."""
        self.pages.share(r.fork_hold, [page], cached=False)
        r.fork_copy_at = len(r.pages)

    def release_copy(self, r: Request) -> None:
        self.pages.release(r.fork_hold)
        r.fork_copy_at = None

    def publish(self, r: Request) -> None:
        """Publishes each of `r`'s pages that is full of KV written for tokens the host knows,
        under the key of its prefix (`Request.written_tokens`)."""
        if not self.pages.caching or r.page_keys is None:
            return
        full = min(r.written_tokens() // self.page_size, len(r.pages))
        if full <= r.published:
            return
        keys = r.page_keys.upto(r.token_ids(full * self.page_size), full)
        for i in range(r.published, full):
            self.pages.publish(r.pages[i], keys[i])
        r.published = full

    def release(self, r: Request) -> None:
        """Frees its slot and its pages; the slot's row of the page table points at page 0."""
        self.running.remove(r)
        self.free_slots.append(r.slot)
        self.rows.clear(r.slot)
        self.tables[r.slot] = 0
        self.pages.release(r.pages)
        self.release_copy(r)
        r.published = 0
        r.pool = None  # r.slot keeps the number, for the record of where it ran
        r.landing = None  # KV on its way to this slot has nowhere to go now

    @property
    def idle(self) -> bool:
        return not (self.running or self.pending or self.applying)

    @property
    def kv_tokens(self) -> int:
        return sum(r.kv_tokens for r in self.running)
