"""One engine's KV: its slots, its pages and page table, and what each request holds of them
(vLLM's KVCacheManager role).

    pool = Pool(engine, "colocated", caching=True)   # or "prefill" / "decode": a disaggregated pair
    pool.match_prefixes(waiting)          # each waiting prompt's cached prefix (its hit)
    pool.match_forks(waiting)             # ... or its group's first sequence's prompt pages
    pool.take(r); pool.take_prefix(r)     # admitted: a free slot, and the hit's pages shared
    reservation = pool.reserve(plan)      # the pages this iteration's work needs, before it runs
    pool.move_host_pages()                # evicted pages out to the host tier, host hits back
    pool.publish(r)                       # r's newly full pages join the prefix cache
    pool.publish(r, tail=True)            # ... and its partly written last one, as it ends
    pool.release(r)                       # slot and pages back, the slot's rows reset
    pool.expect(rows, tokens)             # a dispatch's result, to apply next iteration ...
    previous = pool.begin()               # ... when the next dispatch has gone out

Colocated serving has one pool that prefills and decodes. Disaggregated serving has two, each
over its own engine (its own device, weights and page pool): a request holds a slot and pages in
exactly one of them at a time, and moves from the prefill pool to the decode pool when its KV is
handed over (`scheduler.handoff`). The admitting pool keeps the prefix cache (`caching`):
admission looks prompts up in it, and its requests publish their pages to it.

`reserve` grows every request's pages to what the plan's chunks and decode steps will write.
Requests admitted earlier go first, by priority, oldest first among equals; when the pool runs
dry, the most recently admitted request of the lowest priority is preempted (its pages freed, to
be recomputed later), which may be the one asking. A request admitted in this very plan that
finds too few pages is sent back instead: admission preempts only what the plan said
(`Plan.preempt`). The `Reservation` says whom, for the scheduler to queue again. The first
request to grow can always grow (the pool holds one sequence of max_seq_len), so something
always progresses. With `reserve` tokens set (the "max" reservation, the contiguous baseline)
a request holds that many tokens' pages from its first chunk on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
from absl import logging

from cadence.engine.api import EngineAPI, SamplingRows
from cadence.engine.packing import bucket_for
from cadence.scheduler.host_cache import HostCache
from cadence.scheduler.pages import NULL_PAGE, PageAllocator, PageKeys
from cadence.scheduler.policy import PageBudget, Plan, decoded_end
from cadence.scheduler.request import Request, State
from cadence.scheduler.results import Pending, Row


@dataclasses.dataclass
class Reservation:
    """What `Pool.reserve` could not fit: the requests it preempted (in order) and those admitted
    in the plan it sent back (in plan order). Both hold nothing now and go back to the head of
    the queue."""

    preempted: list[Request] = dataclasses.field(default_factory=list)
    sent_back: list[Request] = dataclasses.field(default_factory=list)


class Pool:
    def __init__(self, engine: EngineAPI, name: str, caching: bool = False, reserve: int | None = None,
                 host: HostCache | None = None):
        cfg = engine.config
        self.engine = engine
        self.name = name
        self.reserve_tokens = reserve  # the "max" reservation: every request holds this many
        self.num_slots = cfg.num_slots
        self.page_size = cfg.page_size
        self.host = host  # the prefix cache's host tier, if any (only with `caching`)
        self.pages = PageAllocator(engine.num_pages, cfg.page_size, caching, keep_evicted=self.host is not None)
        # Each slot's occupant's pages; free slots' rows, and the entries past a sequence's
        # last page, point at the null page, which any step may read (never write) without harm.
        self.tables = np.full((cfg.num_slots, cfg.max_pages_per_seq), NULL_PAGE, np.int32)
        self.rows = SamplingRows(cfg.num_slots, cfg.lora_slots)  # each slot's occupant's sampling row
        self.free_slots = list(range(cfg.num_slots))[::-1]
        self.running: list[Request] = []  # holding a slot here, in slot-assignment order
        # Results dispatched on this engine, not yet applied (`scheduler.results`).
        self.pending: list[Pending] = []
        self.applying: list[Pending] = []  # being read and applied
        # A decode step whose forward pass is dispatched and whose sampling waits for the
        # previous tokens (grammar bitmasks): its requests, each with its slot.
        self.split: list[Row] | None = None
        self.busy_seconds = 0.0  # wall time of this pool's iterations that ran a program
        # Prefix caching: prompt tokens looked up at admission, and those found cached; prompt
        # tokens later sequences of a group (n > 1) took from the first one's KV.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.forked_tokens = 0
        self.host_hits = 0  # of the hits, tokens copied back from the host tier
        # Per slot, the tokens whose KV the sequence that let it go last wrote, with its page
        # keys (`scheduler.slot_files`: llama-server's slot save).
        self.last_sequences: dict[int, tuple[list[int], PageKeys]] = {}

    def take(self, r: Request) -> None:
        """Gives `r` a free slot (the caller checked there is one); its sampling row is set
        separately (`rows.set`), since a value that cannot be packed fails the request alone."""
        r.slot = self.free_slots.pop()
        r.pool = self
        self.running.append(r)

    def set_row(self, r: Request) -> None:
        """`r`'s sampling row in its slot: its parameters, its stop ids, and while its next
        token is one of its first `min_tokens`, its stop ids masked out. Raises (changing
        nothing) if its values cannot be packed."""
        masking = r.masks_stops()
        self.rows.set(r.slot, r.params.sampling, r.device_stops, r.params.logprobs is not None,
                      masked=r.eos_ids if masking else ())
        r.masking_stops = masking

    def history(self, r: Request) -> tuple | None:
        """`Engine.set_history`'s arguments after the slot, for `r` taking its slot (None: it
        reads no history): its sequence so far, its penalties' settings, and its stateful
        sampler's state, its first or the one it left its last slot with (`leave_slot`).
        Raises if that read failed (its engine's program did)."""
        sampling = r.params.sampling
        if not (sampling.penalized or sampling.stateful):
            return None
        state = sampling.sampler_state if r.sampler_left is None else np.asarray(r.sampler_left).tolist()
        return (r.prompt_ids, r.output_ids, *sampling.history_settings, state)

    def leave_slot(self, r: Request) -> None:
        """Before `r` leaves its slot to take another one later (preempted, or moved to the
        decode pool): a stateful sampler's state there, as every step dispatched so far
        leaves it (read when it takes the next slot, `history`)."""
        if r.params.sampling.stateful:
            r.sampler_left = self.engine.sampler_state(r.slot)

    def unmask_rows(self) -> None:
        """Before a dispatch: the rows of requests past their `min_tokens` sample freely."""
        for r in self.running:
            if r.masking_stops and not r.masks_stops():
                self.set_row(r)

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

    def hold_copy(self, r: Request, page: int, cached: bool) -> None:
        """`r` will copy `page`'s leading positions into its next page: held till then. A cached
        page (a partial match), or (not `cached`) its group's first sequence's."""
        self.pages.share(r.tail_hold, [page], cached=cached)
        r.tail_copy_at = len(r.pages)

    def release_copy(self, r: Request) -> None:
        self.pages.release(r.tail_hold)
        r.tail_copy_at = None

    def copy_tail_pages(self) -> None:
        """Each sequence whose first chunk runs this iteration (its pages are reserved by now)
        and whose prefix ends inside another page (a partial match, or a fork's page holding
        the prompt's last token) gets its copy of that page, in one engine call queued before
        the prefill that goes on from there; then the pages copied are let go. An engine call
        that raises is the caller's to handle (nothing was let go)."""
        copying = [r for r in self.running  # (one whose chunk waits for budget has no page yet)
                   if r.tail_copy_at is not None and len(r.pages) > r.tail_copy_at]
        if not copying:
            return
        self.engine.copy_pages([r.tail_hold[0] for r in copying], [r.pages[r.tail_copy_at] for r in copying])
        for r in copying:
            self.release_copy(r)

    def move_host_pages(self) -> None:
        """Right after the reservation, before any program that may write the pages it handed
        out: the full cached pages it evicted are copied out to the host tier (those the tier
        lacks), then the host pages each admitted request found are copied into the pages it
        now holds for them. A request first holds those pages from the reservation that grows
        it for its first chunk, which this follows at once: no page is published, and no
        program reads it, before its copy is dispatched. An engine call that raises is the
        caller's to handle."""
        if self.host is None:
            return
        cfg = self.engine.config
        evicted = [(page, key) for page, key in self.pages.take_evicted() if key not in self.host]
        width = cfg.max_pages_per_seq  # (a longer run goes out in several extracts)
        for i in range(0, len(evicted), width):
            group = evicted[i : i + width]
            length = min(len(group) * self.page_size, cfg.max_seq_len)
            self.host.save([key for _, key in group], self.engine.extract([p for p, _ in group], length, 0))
        for r in self.running:
            found, at = r.host_pages, r.host_at
            if not found or len(r.pages) < at + len(found):  # (its chunk waits: no pages yet)
                continue
            self.write_pages(found[0].kind, [p.arrays for p in found], r.pages[at : at + len(found)])
            self.host_hits += len(found) * self.page_size
            r.host_pages = []

    def write_pages(self, kind: type, arrays: list, targets: list[int]) -> None:
        """Writes pages' arrays (as handles of `kind` take them apart, `host_pages`) into pages
        `targets` of the pool, in one insert queued before the next program; no slot's next
        token is touched."""
        width = bucket_for(self.engine.config.page_buckets, len(arrays))
        self.engine.insert(kind.from_host_pages(arrays, self.page_size, width), targets, None)

    def publish(self, r: Request, tail: bool = False) -> None:
        """Publishes each of `r`'s pages that is full of KV written for tokens the host knows,
        under the key of its prefix (`Request.written_tokens`). With `tail` (it is letting its
        pages go: it ended, was preempted or moves to the decode pool), also the page after
        them, partly written, for partial matches."""
        if tail:  # what its slot held last (llama-server's slot files): nothing, unless below
            self.last_sequences.pop(r.slot, None)
        if not self.pages.caching or r.page_keys is None:
            return
        size = self.page_size
        written = min(r.written_tokens(), len(r.pages) * size)
        if r.host_pages:  # (pages whose copy from the host is not dispatched yet hold nothing)
            written = min(written, r.host_at * size)
        full = written // size
        if tail:
            self.last_sequences[r.slot] = (r.token_ids(written), r.page_keys)
        # (a page whose copy is not dispatched yet holds nothing of its own)
        partial = tail and written % size and r.tail_copy_at is None
        if full <= r.published and not partial:
            return
        tokens = r.token_ids(written)
        keys = r.page_keys.upto(tokens, full)
        for i in range(r.published, full):
            self.pages.publish(r.pages[i], keys[i], r.page_keys.parent(i), tokens[i * size : (i + 1) * size])
        r.published = max(r.published, full)
        if partial:
            self.pages.publish_tail(r.pages[full], r.page_keys.parent(full), tokens[full * size :])

    def release(self, r: Request) -> None:
        """Frees its slot and its pages; the slot's row of the page table points at the null page."""
        self.running.remove(r)
        self.free_slots.append(r.slot)
        self.rows.clear(r.slot)
        self.tables[r.slot] = NULL_PAGE
        self.pages.release(r.pages)
        self.release_copy(r)
        r.host_pages = []
        r.published = 0
        r.pool = None  # r.slot keeps the number, for the record of where it ran
        r.landing = None  # KV on its way to this slot has nowhere to go now

    def expect(self, rows: list[Row], tokens, drafts: list[list[int]] | None = None) -> None:
        """A dispatch's result (`tokens`) holding a token of each of `rows`, to apply next
        iteration (`results.Pending`; a verify step's with each row's `drafts`)."""
        for r, _ in rows:
            r.unapplied += 1
        self.pending.append(Pending(rows, tokens, drafts))

    def begin(self) -> list[Pending]:
        """The results of the previous iteration, to apply after this one's dispatch: they are
        `applying` until then."""
        self.applying, self.pending = self.pending, []
        return self.applying

    @property
    def idle(self) -> bool:
        return not (self.running or self.pending or self.applying)

    @property
    def kv_tokens(self) -> int:
        return sum(r.kv_tokens for r in self.running)

    def page_budget(self) -> PageBudget:
        """What the free pages allow the policy, per the reservation mode."""
        return PageBudget(self.pages.free_count, self.page_size, self.reserve_tokens,
                          releasable=lambda r: self.pages.releasable(r.pages + r.tail_hold))

    def grow_to(self, r: Request, tokens: int) -> bool:
        """`grow`, to `reserve_tokens` whatever `tokens` says when that is set."""
        return self.grow(r, self.reserve_tokens or tokens)

    def may_admit(self, r: Request) -> bool:
        """Whether the plan may admit `r` now: a slot is free, or a running request has a lower
        priority than `r`'s (it may be preempted for it)."""
        return bool(self.free_slots) or any(q.priority > r.priority for q in self.running)

    def match_prefixes(self, waiting: Iterable[Request]) -> None:
        """Looks every waiting request's prompt up in the prefix cache, before the plan: its
        leading whole pages by their keys (`Request.prefix`), then, after them, the cached page
        whose leading tokens agree longest with the prompt's next ones (`Request.tail`, copied
        into a page of its own when its first chunk runs); it starts prefilling where the
        agreement ends. A prompt's last token is always computed (its logits give the first
        output). Admission takes the hit (`take_prefix`): nothing leaves the cache in between
        (publishing only adds; an allocation, which evicts, comes after admission)."""
        if not self.pages.caching:
            return  # nothing is ever looked up: every waiting request's prefix stays empty
        size = self.page_size
        for r in waiting:
            r.prefix, r.prefix_evictable, r.tail, r.host_pages = [], 0, None, []
            if not self.may_admit(r) or r.unapplied or r.page_keys is None:
                r.prefilled = r.kv_tokens = 0
                continue
            if r.preemptions:  # it will recompute its output too (`readmitted`)
                r.prefill_ids = r.prompt_ids + r.output_ids
            last = r.prefill_len - 1
            keys = r.page_keys.upto(r.prefill_ids, last // size)
            r.prefix = self.pages.lookup(keys)
            r.prefix_evictable = self.pages.evictable_among(r.prefix)
            if self.host is not None and len(r.prefix) < len(keys):  # the pages after them, on the host
                r.host_pages = self.host.lookup(keys[len(r.prefix) :])
            start = (len(r.prefix) + len(r.host_pages)) * size
            r.tail, agreed = (None, 0) if r.host_pages else self.pages.longest(
                r.page_keys.parent(len(r.prefix)), r.prefill_ids[start : min(start + size, last)])
            # A partial match holds the lent page beside its own until the copy: one page more
            # than computing those positions, which a sequence as large as the pool never has.
            whole = self.pages.pages_for(self.reserve_tokens or r.prefill_len)
            if r.tail is not None and whole >= self.pages.usable:
                r.tail, agreed = None, 0
            if r.tail is not None:
                r.prefix_evictable += self.pages.evictable_among([r.tail])
            r.prefilled = r.kv_tokens = start + agreed

    def match_forks(self, waiting: Iterable[Request]) -> None:
        """After `match_prefixes`: each waiting later sequence of a group whose first one holds
        the prompt's KV in this pool takes that as its prefix: the full pages before the one
        holding the prompt's last token (shared), that page's other positions (copied into a
        page of its own when it dispatches, `tail`), and it computes the last token only."""
        size = self.page_size
        for r in waiting:
            parent = r.fork_parent
            if parent is None:
                continue
            r.forking = False
            if not (self.may_admit(r) and not r.unapplied and not r.preemptions
                    and parent.pool is self and not parent.finished
                    and parent.state in (State.DECODING, State.TRANSFERRING)):
                if not self.pages.caching:  # (else `match_prefixes` has just set them)
                    r.prefix, r.prefix_evictable, r.tail, r.prefilled, r.kv_tokens = [], 0, None, 0, 0
                continue
            full, partial = divmod(r.prompt_len - 1, size)
            r.prefix, r.prefix_evictable, r.host_pages = parent.pages[:full], 0, []
            r.forking, r.tail = True, parent.pages[full] if partial else None
            r.prefilled = r.kv_tokens = r.prompt_len - 1

    def take_prefix(self, r: Request) -> None:
        """`r`, just admitted (`take`, `Request.readmitted`), takes the prefix matched for it:
        cached pages, or its group's first sequence's prompt pages, and the page it copies the
        rest from; counted for the metrics."""
        hit, forked = r.prefilled, r.forking
        if r.prefix:
            self.share(r, r.prefix, cached=not forked)
        r.host_at = len(r.pages)  # its host pages (if any) go on from there, once it holds them
        if r.tail is not None:  # held until its copy is dispatched
            self.hold_copy(r, r.tail, cached=not forked)
        r.prefix, r.prefix_evictable, r.tail = [], 0, None  # (`forking` stays: `send_back`)
        if self.pages.caching and not forked:
            self.prefix_queries += r.prefill_len
            self.prefix_hits += hit
        if forked:
            self.forked_tokens += hit
        if not r.preemptions:
            r.cached_tokens = hit

    def publish_running(self) -> None:
        for r in self.running:
            self.publish(r)

    def reserve(self, plan: Plan) -> Reservation:
        """Gives every request of this pool the pages the plan's work for it needs, before
        anything runs, preempting or sending back what does not fit (the module's docstring)."""
        ends: dict[Request, int] = {}
        for chunk in plan.prefill:
            ends[chunk.request] = max(ends.get(chunk.request, 0), chunk.start + chunk.length)
        decoding = {r for r in plan.decode if r.state is State.DECODING}
        admitted = set(plan.admit)
        earlier = [r for r in self.running if r not in admitted]
        out = Reservation()
        for r in sorted(earlier, key=lambda r: r.priority):  # stable: oldest first among equals
            if r not in ends and r not in decoding:
                continue
            tokens = decoded_end(r, plan.steps) if r in decoding else ends.get(r, 0)
            while r.pool is self and not self.grow_to(r, tokens):
                victim = max((v for v in reversed(self.running)
                              if v not in admitted and not v.pooled_dispatched),
                             key=lambda v: v.priority)  # the first of the lowest: the newest
                self.preempt(victim)
                out.preempted.append(victim)
        out.sent_back = [r for r in plan.admit
                         if r.state is State.PREFILLING and not self.grow_to(r, ends.get(r, 0))]
        for r in reversed(out.sent_back):
            self.send_back(r)
        return out

    def preempt(self, r: Request, why: str | None = None) -> None:
        """Frees `r`'s slot and pages; it will recompute its KV when admitted again."""
        logging.info("preempting %s (priority %d): %s", r.id, r.priority,
                     why or f"the {self.name} KV pool is full ({self.pages.usable} pages)")
        self.publish(r, tail=True)  # what it computed stays cached: its recompute is mostly a hit
        self.leave_slot(r)
        self.release(r)
        r.preempted()

    def send_back(self, r: Request) -> None:
        """An admission that found too few pages: as it was before it, holding nothing."""
        if r.forking:  # it prefills nothing now: what its prefix counted counts next time
            self.forked_tokens -= r.prefilled
        elif self.pages.caching:
            self.prefix_queries -= r.prefill_len
            self.prefix_hits -= r.prefilled
        self.release(r)
        r.prefilled = r.kv_tokens = 0
        r.state = State.WAITING
        r.slot = None
        if not r.preemptions:
            r.admitted = None  # it never really started
