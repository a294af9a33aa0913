"""What the scheduler reports: live readings, and `SchedulerStats`, all of them at one moment.

    stats = scheduler.stats()          # one call: a frozen snapshot (what server/metrics.py reads)
    stats.kv_usage, stats.pools[0].running, stats.rejections["queue_full"]
    scheduler.num_running              # ... or one reading, live

`Readings` is mixed into `Scheduler`: each reading is computed from the scheduler's pools, queues
and counters when asked, never stored, so it is never stale. The readings are taken without the
state lock (a scrape never waits for an iteration), so one taken while an iteration runs may
be a step behind another; the per-priority backlog is the last iteration's.
"""

from __future__ import annotations

import collections
import dataclasses

from absl import logging


def notify(listeners: list, record) -> None:
    """Hands `record` to each observer (metrics, the server's timeline, traces); one that raises
    is logged, and serving goes on."""
    for listener in listeners:
        try:
            listener(record)
        except Exception:  # a broken metrics hook must not take serving down
            logging.exception("listener %r failed", listener)


@dataclasses.dataclass
class IterationRecord:
    """One iteration of a loop, as the iteration listeners receive it."""

    index: int
    start: float
    wall: float  # seconds from dispatch start to results applied
    decode_slots: int
    prefill_tokens: int
    prefill_chunks: int  # chunks dispatched
    prefill_programs: int = 0  # the packed programs that carried them (normally 1)
    pool: str = "colocated"  # whose loop ran it: "colocated", or "prefill" / "decode"
    transfers: int = 0  # KV handoffs to the decode pool this iteration started
    decode_steps: int = 1  # steps each of the decode_slots ran, in one dispatch
    drafted: int = 0  # speculative decoding: draft tokens verified, and those accepted
    accepted: int = 0


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """One engine's pool: "colocated", or "prefill" and "decode"."""

    name: str
    running: int  # requests holding a slot
    queue_length: int  # waiting for it: the queue (the admitting pool), the transfer backlog (decode)
    kv_pages_used: int
    kv_pages_total: int  # the null page included
    busy_seconds: float  # wall time of its iterations that ran a program


@dataclasses.dataclass(frozen=True)
class SlotStats:
    """One KV slot of a pool, and the request holding it, if any (llama-server's /slots)."""

    pool: str
    slot: int
    request_id: str | None = None  # None: the slot is free
    state: str = "idle"  # else the request's: "prefilling", "transferring" or "decoding"
    priority: int = 0
    prompt_tokens: int = 0
    prefilled: int = 0  # of those, whose KV it holds (taken from the cache, or computed)
    decoded: int = 0  # output tokens so far
    remaining: int = 0  # output tokens it may still take (its max_tokens)


@dataclasses.dataclass(frozen=True)
class DraftStats:
    """A draft model's (speculative decoding): its KV pool, and the tokens it drafted."""

    kv_pages_used: int  # held by rows' draft KV
    kv_pages_total: int  # the null page included
    draft_tokens: int  # its drafts that verify steps scored, and those accepted
    accepted_tokens: int
    caught_up_tokens: int  # tokens it prefilled to catch rows' draft KV up
    evicted_rows: int  # rows whose draft KV gave its pages to others


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    num_running: int  # requests holding a slot
    num_waiting: int  # queued for one (submitted since the last iteration included)
    waiting_by_priority: dict[int, int]
    kv_pages_used: int  # pages held by requests, all pools
    kv_pages_total: int  # pages in the pools, each null page included
    kv_pages_usable: int  # all but the null pages
    kv_pages_cached: int  # holding a reusable prefix, held or evictable
    kv_pages_evicted: int  # cached pages whose prefix was forgotten to make room, since the start
    kv_tokens: int  # positions whose KV the running requests hold
    page_size: int
    kv_cache_bytes: int
    preemptions: int  # for pages or for a better priority
    priority_preemptions: int  # of those, for a better priority
    prefix_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_hits: int  # of those, found cached
    forked_tokens: int  # prompt tokens later sequences of a group took from the first one's KV
    rejections: dict[str, int]  # submissions refused for load, by reason
    transfer_backlog: int  # disaggregated: prefilled, waiting for the decode pool's room
    transfers_in_flight: int  # ... and with KV on its way there
    kv_transfers: int
    kv_transfer_bytes: int
    prefill_programs: int  # packed prefill programs run, and the chunks they carried
    prefill_chunks: int
    spec_drafts: int  # speculative decoding: rows that drafted in a verify step, their draft
    spec_draft_tokens: int  # tokens, and the drafts accepted
    spec_accepted_tokens: int
    compilations_after_warmup: int
    compilations_on_demand: int
    pools: tuple[PoolStats, ...]
    draft: DraftStats | None = None  # the draft model's, where one drafts
    # The prefix cache's host tier: of `prefix_hits`, tokens copied back from it; what it holds.
    host_kv_hits: int = 0
    host_kv_pages: int = 0
    host_kv_bytes: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of the usable KV pages held by requests."""
        return self.kv_pages_used / self.kv_pages_usable

    @property
    def kv_page_utilization(self) -> float:
        """Of the token slots in held pages, the fraction holding a real token's KV."""
        held = self.kv_pages_used * self.page_size
        return self.kv_tokens / held if held else 1.0


class Readings:
    """The scheduler's readings, for a `Scheduler` (its pools, queues, handoff and counters)."""

    def stats(self) -> SchedulerStats:
        """Every reading at once."""
        used, total = self.kv_pages
        backlog = self.transfer_backlog
        pools = tuple(PoolStats(p.name, len(p.running), self.num_waiting if i == 0 else backlog,
                                p.pages.used_count, p.pages.num_pages, p.busy_seconds)
                      for i, p in enumerate(self.pools))
        return SchedulerStats(
            num_running=sum(p.running for p in pools), num_waiting=pools[0].queue_length,
            waiting_by_priority=self.waiting_by_priority(), kv_pages_used=used, kv_pages_total=total,
            kv_pages_usable=sum(p.pages.usable for p in self.pools),
            kv_pages_cached=self.kv_pages_cached, kv_pages_evicted=self.kv_pages_evicted,
            kv_tokens=self.kv_tokens, page_size=self.page_size, kv_cache_bytes=self.kv_cache_bytes,
            preemptions=self.preemptions, priority_preemptions=self.priority_preemptions,
            prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
            forked_tokens=self.forked_tokens, rejections=dict(self.rejections),
            transfer_backlog=backlog, transfers_in_flight=self.transfers_in_flight,
            kv_transfers=self.kv_transfers, kv_transfer_bytes=self.kv_transfer_bytes,
            prefill_programs=self.prefill_programs, prefill_chunks=self.prefill_chunks,
            spec_drafts=self.spec_drafts, spec_draft_tokens=self.spec_drafted,
            spec_accepted_tokens=self.spec_accepted,
            compilations_after_warmup=self.compilations_after_warmup,
            compilations_on_demand=self.compilations_on_demand, pools=pools, draft=self.draft_stats(),
            host_kv_hits=sum(p.host_hits for p in self.pools),
            host_kv_pages=sum(len(p.host) for p in self.pools if p.host is not None),
            host_kv_bytes=sum(p.host.bytes for p in self.pools if p.host is not None))

    def slots(self) -> list[SlotStats]:
        """Every pool's slots in order, each with the request holding it (read without the
        state lock: a request may have moved on by the time it is read)."""
        out = []
        for pool in self.pools:
            held = {r.slot: r for r in list(pool.running) if r.slot is not None}
            for slot in range(pool.num_slots):
                r = held.get(slot)
                if r is None:
                    out.append(SlotStats(pool.name, slot))
                    continue
                decoded = len(r.output_ids)
                out.append(SlotStats(pool.name, slot, r.id, r.state.value, r.priority, r.prompt_len,
                                     min(r.prefilled, r.prompt_len), decoded, max(0, r.max_tokens - decoded)))
        return out

    def draft_stats(self) -> DraftStats | None:
        """The draft model's readings (None without one)."""
        draft = self.draft
        if draft is None:
            return None
        return DraftStats(draft.pages.used_count, draft.pages.num_pages, self.draft_model_drafted,
                          self.draft_model_accepted, draft.caught_up, draft.evicted)

    @property
    def num_running(self) -> int:
        return sum(len(pool.running) for pool in self.pools)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._inbox)

    def waiting_by_priority(self) -> dict[int, int]:
        """Requests waiting per priority (as of the last iteration, and those submitted since)."""
        with self._lock:
            counts = collections.Counter({p: n for p, (n, _) in self._backlog.items() if n})
            counts.update(r.priority for r in self._inbox)
        return dict(counts)

    @property
    def transfer_backlog(self) -> int:
        """Prefilled requests waiting for the decode pool's room (0 unless disaggregated)."""
        return self._handoff.waiting

    @property
    def transfers_in_flight(self) -> int:
        """Requests whose KV is on its way to the decode pool."""
        return self._handoff.in_flight

    @property
    def kv_transfers(self) -> int:
        """KV handoffs started (disaggregated)."""
        return self._handoff.transfers

    @property
    def kv_transfer_bytes(self) -> int:
        """The bytes those handoffs moved."""
        return self._handoff.bytes

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache at admission."""
        return sum(p.prefix_queries for p in self.pools)

    @property
    def prefix_hits(self) -> int:
        """Of those, tokens whose KV the cache held."""
        return sum(p.prefix_hits for p in self.pools)

    @property
    def forked_tokens(self) -> int:
        """Prompt tokens later sequences of a group (n > 1) took from the first one's KV."""
        return sum(p.forked_tokens for p in self.pools)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV page pools' usable pages (all but each null page) held by requests."""
        return self.kv_pages[0] / sum(p.pages.usable for p in self.pools)

    @property
    def kv_pages(self) -> tuple[int, int]:
        """(pages held, pages in the pools, the null pages included)."""
        return (sum(p.pages.used_count for p in self.pools), sum(p.pages.num_pages for p in self.pools))

    @property
    def kv_pages_cached(self) -> int:
        """Pages holding a reusable prefix, held by requests or waiting to be evicted."""
        return sum(p.pages.cached_count for p in self.pools)

    @property
    def kv_pages_evicted(self) -> int:
        """Cached pages whose prefix was forgotten to make room, since the start."""
        return sum(p.pages.evictions for p in self.pools)

    @property
    def kv_tokens(self) -> int:
        """Positions whose KV the running requests hold."""
        return sum(p.kv_tokens for p in self.pools)

    @property
    def kv_page_utilization(self) -> float:
        """Of the token slots in held pages, the fraction holding a real token's KV."""
        held = self.kv_pages[0] * self.page_size
        return self.kv_tokens / held if held else 1.0

    @property
    def compilations_after_warmup(self) -> int:
        # The compile counter is the process's: what came after the last engine's warm-up is
        # the smallest of the engines' counts (an engine not yet warm says 0).
        return min(e.compilations_after_warmup for e in self.engines)

    @property
    def compilations_on_demand(self) -> int:
        """Compilations of programs warm-up left for their first use (`--warmup=needed`),
        counted apart from `compilations_after_warmup` (also process-wide)."""
        return max(getattr(e, "compilations_on_demand", 0) for e in self.engines)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(e.kv_cache_bytes for e in self.engines)
