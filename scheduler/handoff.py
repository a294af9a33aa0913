"""The disaggregated handoff: prefilled requests' KV moved from the prefill pool to the decode pool.

    handoff = Handoff(prefill_pool, decode_pool, ...)
    handoff.queue(r)            # r's prompt is dispatched whole: it waits for the decode pool
    handoff.start()             # the prefill loop: start moving what the decode pool has room for
    handoff.insert_landed()     # the decode loop: insert the KV that has landed; it decodes next

Disaggregated (DistServe's design), two engines on their own devices each have a pool
(`scheduler.kv_manager.Pool`) and a loop thread of their own, so a long prefill never holds up a
decode step. A prompt's last chunk samples its first token, which streams from the prefill loop,
and the request joins the transfer backlog holding its prefill pages. Whenever the decode pool
has a free slot and pages for it (by priority, oldest first), its KV is extracted, copied to the
decode device (`engine.receive`, asynchronous) and inserted there, and its prefill slot and pages
are freed; decoding continues on the decode loop. The backlog is bounded by the prefill pool's
slots: when it is full, admission waits. A watcher thread observes each copy land, for the
metrics (`KVTransfer`), and wakes the loops. A request whose decode pool runs dry is preempted
there and recomputed through the prefill pool.

Colocated, the two pools are one and nothing ever queues here.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Optional

from absl import logging

from cadence.engine.api import EngineAPI
from cadence.scheduler.kv_manager import Pool
from cadence.scheduler.policy import PolicyConfig, running_cost
from cadence.scheduler.request import Request, State


@dataclasses.dataclass(frozen=True)
class KVTransfer:
    """One request's KV handed from the prefill pool to the decode pool (times: monotonic)."""

    request_id: str
    bytes: int  # live pages moved
    tokens: int  # positions of KV they hold
    start: float  # the KV was ready on the prefill device (its last chunk and the extract ran)
    end: float  # ... and had landed on the decode device


def check_pair(prefill: EngineAPI, decode: EngineAPI) -> None:
    """Two engines that can serve one model disaggregated: the same vocabulary, context and KV
    page layout (a handle from one fits the other), each in its role."""
    p, d = prefill.config, decode.config
    if p.role not in ("both", "prefill") or d.role not in ("both", "decode"):
        raise ValueError(f"a disaggregated pair needs a prefill engine and a decode engine, got "
                         f"roles {p.role!r} and {d.role!r}")
    if (prefill.vocab_size, p.max_seq_len, p.page_size) != (decode.vocab_size, d.max_seq_len, d.page_size):
        raise ValueError(
            f"the prefill and decode engines differ: vocabulary {prefill.vocab_size} vs "
            f"{decode.vocab_size}, max_seq_len {p.max_seq_len} vs {d.max_seq_len}, page_size "
            f"{p.page_size} vs {d.page_size}")


class Handoff:
    """The transfer backlog (prefilled, waiting for the decode pool's room), the requests whose
    KV is on its way, and the watcher thread that sees each copy land. Its methods run under
    the scheduler's state lock; a failure is reported through `fail_one` (that request's alone)
    or `fail_pool` (an engine call failed: every request of that pool)."""

    def __init__(self, source: Pool, target: Pool, policy: PolicyConfig,
                 fail_one: Callable[[Request, str, float], None],
                 fail_pool: Callable[[Pool, str], None],
                 landed: Callable[[KVTransfer], None], wake: Callable[[], None]):
        self.source, self.target = source, target  # the prefill pool and the decode pool
        self._policy = policy
        self._fail_one, self._fail_pool = fail_one, fail_pool
        self._landed, self._wake = landed, wake
        self.backlog: collections.deque[Request] = collections.deque()  # oldest first
        self.moving: list[Request] = []
        self._landing: queue.Queue = queue.Queue()  # transfers in flight, for the watcher
        self._watcher: threading.Thread | None = None
        self._watcher_lock = threading.Lock()  # starting a watcher against one ending
        self.transfers = 0  # KV handoffs started, and the bytes they moved
        self.bytes = 0

    def queue(self, r: Request) -> None:
        """`r`'s last prompt chunk is dispatched: its decode steps run on the decode pool."""
        r.state = State.TRANSFERRING
        self.backlog.append(r)

    @property
    def waiting(self) -> int:
        """Prefilled requests waiting for the decode pool's room (0 unless disaggregated)."""
        return sum(1 for r in self.backlog if r.state is State.TRANSFERRING and r.pool is self.source)

    @property
    def in_flight(self) -> int:
        """Requests whose KV is on its way to the decode pool."""
        return sum(1 for r in self.moving if r.state is State.TRANSFERRING)

    @property
    def idle(self) -> bool:
        return not (self.backlog or self.moving)

    def clear(self) -> None:
        self.backlog.clear()
        self.moving.clear()

    def start(self) -> int:
        """Starts moving prefilled requests to the decode pool, by priority and oldest first
        among equals, while it has a free slot and pages for the request's next step beside
        what its running requests' next steps need. A move takes the decode slot and pages,
        extracts the KV on the prefill engine (queued right behind the prompt's last chunk) and
        starts its copy to the decode device, all asynchronous, and frees the prefill slot and
        pages; the decode loop inserts the KV once it has landed (`insert_landed`), so a decode
        step never waits for the prefill device. Returns how many started."""
        started = 0
        source, target = self.source, self.target
        while self.backlog:
            r = min(self.backlog, key=lambda q: q.priority)  # the first of the best
            if r.state is not State.TRANSFERRING or r.pool is not source:  # ended meanwhile
                self.backlog.remove(r)
                continue
            tokens = target.reserve_tokens or r.kv_tokens + 1
            budget = target.page_budget()
            free = budget.free - running_cost(target.running, self._policy, budget)
            if not target.free_slots or target.pages.pages_for(tokens) > free:
                break  # the decode pool is full: r waits, holding its prefill pages
            self.backlog.remove(r)
            try:
                handle = source.engine.extract(r.pages, r.kv_tokens, r.slot)
                source.leave_slot(r)
            except Exception as e:
                logging.exception("extracting %s's KV failed", r.id)
                self._fail_pool(source, f"{type(e).__name__}: {e}")
                return started
            source.publish(r, tail=True)  # the prompt's last page, for partial matches
            source.release(r)
            target.take(r)
            target.grow(r, tokens)  # cannot fail: the pages were counted above
            try:
                r.landing = target.engine.receive(handle)
            except Exception as e:  # a copy that cannot even start: this request's failure
                logging.exception("moving %s's KV failed", r.id)
                self._fail_one(r, f"its KV could not be moved: {type(e).__name__}: {e}", time.monotonic())
                continue
            started += 1
            self.transfers += 1
            self.bytes += handle.nbytes
            r.transfer_bytes += handle.nbytes
            self.moving.append(r)
            self._watch(r, handle, r.landing)
        return started

    def insert_landed(self) -> int:
        """Inserts into the decode pool the KV of every moving request whose copy has landed;
        they decode from the next step. Returns how many."""
        pool, inserted = self.target, 0
        for r in list(self.moving):
            if r.state is not State.TRANSFERRING or r.pool is not pool:  # ended or preempted
                self.moving.remove(r)
                continue
            if r.transfer_error is not None:
                self.moving.remove(r)
                self._fail_one(r, f"its KV transfer failed: {r.transfer_error}", time.monotonic())
                continue
            # Decode only once its first token (read by the prefill loop, normally before the
            # copy lands) is taken, so its tokens are accepted in order.
            if r.unapplied or not r.landing.is_ready():
                continue
            self.moving.remove(r)
            try:
                pool.set_row(r)
            except Exception as e:
                self._fail_one(r, f"its sampling parameters cannot be packed: {e}", time.monotonic())
                continue
            try:
                history = pool.history(r)  # prompt and first token, on this engine too
            except Exception as e:  # the program its state was read by failed
                self._fail_one(r, f"its sampler's state was lost: {e}", time.monotonic())
                continue
            try:
                pool.engine.insert(r.landing, r.pages, r.slot)
                if history is not None:
                    pool.engine.set_history(r.slot, *history)
            except Exception as e:
                logging.exception("inserting %s's KV failed", r.id)
                self._fail_pool(pool, f"{type(e).__name__}: {e}")
                return inserted
            r.landing = None
            r.state = State.DECODING
            inserted += 1
        return inserted

    # A watcher with nothing to watch for this long ends (the next transfer starts another), so
    # an idle or abandoned scheduler's thread holds none of its engines' memory.
    WATCHER_IDLE_S = 2.0

    def _watch(self, r: Request, handle, landed) -> None:
        """Hands a started transfer to the watcher thread, which times it as it lands and
        wakes the decode loop."""
        with self._watcher_lock:
            self._landing.put((r, handle, landed))
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_transfers, name="cadence-transfers",
                                                 daemon=True)
                self._watcher.start()

    def _next_landing(self):
        """The next transfer to watch; None when told to end (`end`) or idle, with nothing
        queued behind: the watcher then ends, and the next `_watch` starts another."""
        while True:
            try:
                item = self._landing.get(timeout=self.WATCHER_IDLE_S)
            except queue.Empty:
                item = None
            if item is not None:
                return item
            with self._watcher_lock:
                if self._landing.empty():
                    self._watcher = None
                    return None

    def _watch_transfers(self) -> None:
        while (item := self._next_landing()) is not None:
            r, handle, landed = item
            try:
                handle.block_until_ready()  # the last chunk and the extract have run
                start = time.monotonic()
                landed.block_until_ready()  # the copy has landed on the decode device
                end = time.monotonic()
            except Exception as e:  # the request fails alone, on the decode loop
                logging.exception("KV transfer of %s failed", r.id)
                r.transfer_error = f"{type(e).__name__}: {e}"
            else:
                r.transfer_start, r.transfer_end = start, end
                self._landed(KVTransfer(r.id, handle.nbytes, handle.length, start, end))
            self._wake()
            # Hold no device array while waiting for the next: a daemon thread that still
            # references one when the interpreter exits aborts the process.
            del r, handle, landed, item

    def end(self) -> Optional[threading.Thread]:
        """Lets the watcher thread, if one runs, end once it has seen what it holds land
        (nothing more will move); returns it."""
        with self._watcher_lock:
            watcher = self._watcher
            if watcher is not None:
                self._landing.put(None)
        return watcher

    def close(self, timeout: float | None = None) -> None:
        """`end`, and waits for the watcher."""
        watcher = self.end()
        if watcher is not None:
            watcher.join(timeout)
