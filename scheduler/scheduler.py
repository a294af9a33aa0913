"""The iteration loop: admission, planning, dispatch, and applying results one step behind.

    sched = Scheduler(engine, tokenizer, SchedulerConfig())
    sched.start()                                  # runs iterations on a background thread
    stream = sched.submit(prompt_ids, GenerationParams(max_tokens=64))
    async for event in stream: ...                 # TokenEvent..., then a RequestRecord
    # or, from plain threads: for event in stream: ...

Each iteration: take new submissions and cancellations, ask the policy for a plan, dispatch the
plan's prefill chunks and one decode step to the engine (asynchronous), then apply the results
of the *previous* iteration while the device works on this one. Tokens therefore reach clients
one iteration after they are computed, and the device is never idle waiting for Python.

A request that stops on EOS or a stop string is discovered a step late, so one extra decode step
may run for it; its token is discarded. Requests that end on max_tokens never over-run, because
the host counts dispatched tokens.

Faults stay where they belong. A request whose own host-side work fails (packing its sampling
row, turning its token into text, a token id outside the vocabulary) ends with an error alone.
An engine call that raises fails the requests that were running (their KV may be gone), the
engine rebuilds its device state, and waiting requests are served after. If that rebuild fails,
or anything else stops the loop, the scheduler is dead: every request it holds ends with an
error, `dead` says why, and `submit` raises `EngineDead`. The loop never dies silently.

The scheduler talks to the engine only through `engine.api.EngineAPI`, so tests can drive it
with a fake engine in milliseconds.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging

from checkpoints.tokenizer import Tokenizer
from engine.api import EngineAPI, PrefillChunk, RequestSampling, SamplingRows
from scheduler.errors import EngineDead, NotRunning, Overloaded, RequestTooLong, SubmissionError
from scheduler.pages import PageAllocator
from scheduler.policy import PageBudget, Plan, PolicyConfig, make_plan
from scheduler.request import (
    MAX_STOP_LENGTH, MAX_STOP_STRINGS, FinishReason, GenerationParams, Request, RequestRecord,
    State, TokenEvent,
)


KV_RESERVATIONS = ("live", "max")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    policy: PolicyConfig = PolicyConfig()
    max_queue: int = 256  # waiting requests beyond this are refused with Overloaded
    # "live": a request holds the pages its written tokens need, growing as it goes.
    # "max": it holds max_seq_len tokens' worth from its first chunk on, as a contiguous slot
    # does (vLLM's "Orca (Max)" baseline): the comparison point for benchmarks.
    kv_reservation: str = "live"

    def __post_init__(self) -> None:
        if self.kv_reservation not in KV_RESERVATIONS:
            raise ValueError(f"kv_reservation must be one of {KV_RESERVATIONS}, got {self.kv_reservation!r}")


@dataclasses.dataclass
class IterationRecord:
    index: int
    start: float
    wall: float  # seconds from dispatch start to results applied
    decode_slots: int
    prefill_tokens: int
    prefill_chunks: int  # chunks dispatched
    prefill_programs: int = 0  # the packed programs that carried them (normally 1)


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:  # the reader's event loop
    for stream, event in items:
        stream._queue.put_nowait(event)


class RequestStream:
    """Events of one request; iterate it with `async for` or a plain `for`.

    A stream made inside an event loop receives its events through that loop: the scheduler
    hands each loop all of an iteration's events in one call (`Scheduler._deliver`)."""

    def __init__(self, scheduler: Scheduler, request: Request):
        self._scheduler = scheduler
        self.request = request
        self.record: RequestRecord | None = None
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._queue: Any = asyncio.Queue() if self._loop else queue.Queue()

    @property
    def id(self) -> str:
        return self.request.id

    def _push(self, event: TokenEvent | RequestRecord) -> None:  # scheduler thread
        if self._loop is None:
            self._queue.put(event)
        else:  # delivered with the iteration's others, in one call into the reader's loop
            self._scheduler._outbox.setdefault(self._loop, []).append((self, event))

    def cancel(self) -> None:
        self._scheduler.cancel(self.request)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent | RequestRecord:
        if self.record is not None:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, RequestRecord):
            self.record = event
        return event

    async def next_events(self) -> list[TokenEvent | RequestRecord]:
        """Waits for the next event, then takes every other one already queued, in order
        (the record, if among them, is last). [] once the record has been taken."""
        if self.record is not None:
            return []
        events = [await self._queue.get()]
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        if isinstance(events[-1], RequestRecord):
            self.record = events[-1]
        return events

    def __iter__(self):
        while self.record is None:
            event = self._queue.get()
            if isinstance(event, RequestRecord):
                self.record = event
            yield event


class Scheduler:
    def __init__(self, engine: EngineAPI, tokenizer: Tokenizer, config: SchedulerConfig = SchedulerConfig()):
        if config.policy.chunk > engine.config.prefill_chunk:
            raise ValueError(
                f"policy chunk {config.policy.chunk} exceeds the engine's prefill_chunk "
                f"{engine.config.prefill_chunk}"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        # The policy plans for the engine's packed prefill programs.
        config = dataclasses.replace(config, policy=dataclasses.replace(
            config.policy, pack_block=engine.config.pack_block,
            pack_tokens=engine.config.prefill_buckets[-1]))
        self.config = config
        self.num_slots = engine.config.num_slots
        self.max_seq_len = engine.config.max_seq_len
        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []  # admitted, in slot-assignment order
        self._free_slots = list(range(self.num_slots))[::-1]
        self._rows = SamplingRows(self.num_slots)  # each slot's occupant's sampling row
        cfg = engine.config
        self.page_size = cfg.page_size
        self._pages = PageAllocator(engine.num_pages, cfg.page_size)
        # Each slot's occupant's pages; free slots' rows point at page 0, which any step may
        # read (never write) without harm.
        self._tables = np.zeros((self.num_slots, cfg.max_pages_per_seq), np.int32)
        self.preemptions = 0
        self.prefill_programs = 0  # packed prefill programs run, and the chunks they carried
        self.prefill_chunks = 0
        # Results dispatched, not yet applied: (requests, each with its token's index), tokens.
        self._pending: list[tuple[list[tuple[Request, int]], Any]] = []
        # Events for readers in event loops, per loop, until the iteration hands them over.
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._iteration = 0
        self.dead: str | None = None  # why the engine could not go on; None while it can
        # Observers (metrics, the server's timeline, traces) subscribe here; the scheduler
        # itself keeps no history.
        self.listeners: list = []  # callables(RequestRecord) for finished requests
        self.iteration_listeners: list = []  # callables(IterationRecord)

    # -- submission -------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams = GenerationParams(),
        request_id: str | None = None,
    ) -> RequestStream:
        self._check_running()
        self._check_params(params)
        n = len(prompt_ids)
        if n == 0:
            raise SubmissionError("the prompt is empty; send at least one token", "prompt")
        vocab = self.engine.vocab_size
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise SubmissionError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}",
                                  "prompt")
        room = self.max_seq_len - n
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if n + max_tokens > self.max_seq_len or room < 1:
            raise RequestTooLong(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the "
                f"context of {self.max_seq_len} tokens; shorten the prompt or lower max_tokens"
            )
        holder: dict[str, RequestStream] = {}
        request = Request(
            prompt_ids, params, max_tokens, self.tokenizer,
            emit=lambda e: holder["s"]._push(e), request_id=request_id,
        )
        stream = holder["s"] = RequestStream(self, request)
        with self._lock:
            self._check_running()  # again under the lock: stop() or a death may have come since
            # Requests not yet admitted; those that free slots will take at once do not queue.
            queued = len(self._waiting) + len(self._inbox) - len(self._free_slots)
            if queued >= self.config.max_queue:
                raise Overloaded(
                    f"{self.config.max_queue} requests are already waiting; retry later"
                )
            self._inbox.append(request)
            self._lock.notify()
        return stream

    def _check_running(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"the engine is dead ({self.dead}); restart the server")
        if not self._accepting:
            raise NotRunning("the scheduler is shutting down and accepts no new requests")

    @staticmethod
    def _check_params(params: GenerationParams) -> None:
        """What the loop relies on, checked once here rather than on the scheduler thread."""
        if not isinstance(params.sampling, RequestSampling):
            raise SubmissionError(f"sampling must be a RequestSampling, got {type(params.sampling).__name__}")
        if params.max_tokens is not None and (isinstance(params.max_tokens, bool)
                                              or not isinstance(params.max_tokens, int)
                                              or params.max_tokens < 1):
            raise SubmissionError(f"max_tokens must be an integer >= 1, got {params.max_tokens!r}",
                                  "max_tokens")
        # Stop strings are scanned on the scheduler thread for every token: bound the work.
        if len(params.stop) > MAX_STOP_STRINGS:
            raise SubmissionError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}",
                                  "stop")
        for stop in params.stop:
            if not isinstance(stop, str) or not stop or len(stop) > MAX_STOP_LENGTH:
                raise SubmissionError(
                    f"stop strings must be non-empty strings of at most {MAX_STOP_LENGTH} "
                    f"characters, got {str(stop)[:40]!r}{'...' if len(str(stop)) > 40 else ''}", "stop")

    def cancel(self, request: Request) -> None:
        with self._lock:
            request.cancelled = True
            self._cancels.append(request)
            self._lock.notify()

    # -- state for metrics ------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._inbox)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV page pool held by requests."""
        return self._pages.used_count / self._pages.num_pages

    @property
    def kv_pages(self) -> tuple[int, int]:
        """(pages held, pages in the pool)."""
        return self._pages.used_count, self._pages.num_pages

    @property
    def kv_page_utilization(self) -> float:
        """Of the token slots in held pages, the fraction holding a real token's KV."""
        held = self._pages.used_count * self.page_size
        return sum(r.kv_tokens for r in self._running) / held if held else 1.0

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cadence-scheduler", daemon=True)
            self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops accepting; with `drain`, finishes what is queued and running, else aborts it."""
        self._accepting = False
        with self._lock:
            if not drain:
                for r in list(self._waiting) + self._inbox + self._running:
                    r.cancelled = True
                    self._cancels.append(r)
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def idle(self) -> bool:
        return not (self._inbox or self._waiting or self._running or self._pending)

    def _run(self) -> None:
        try:
            while self.dead is None:
                with self._lock:
                    while self.idle() and not self._cancels and not self._stopping:
                        self._lock.wait()
                    if self._stopping and self.idle() and not self._cancels:
                        return
                try:
                    self.step()
                except Exception as e:  # an engine call failed: fail what ran, rebuild, go on
                    logging.exception("iteration failed")
                    self._fail_running(f"{type(e).__name__}: {e}")
        except BaseException as e:  # a bug outside the guarded step: never die silently
            logging.exception("the scheduler loop failed")
            self._die(f"the scheduler loop failed: {type(e).__name__}: {e}")

    def step(self) -> None:
        """One iteration. Public so tests can drive the scheduler synchronously."""
        try:
            self._iterate()
        finally:
            self._deliver()

    def _iterate(self) -> None:
        start = time.monotonic()
        self._take_inbox()
        budget = PageBudget(self._pages.free_count, self.page_size,
                            self.max_seq_len if self.config.kv_reservation == "max" else None)
        plan = make_plan(self._running, self._waiting, len(self._free_slots), self.config.policy, budget)
        previous, self._pending = self._pending, []
        programs, chunks = self.prefill_programs, self.prefill_chunks
        self._dispatch(plan)
        self._apply(previous)
        if not plan.empty or previous:
            record = IterationRecord(
                index=self._iteration,
                start=start,
                wall=time.monotonic() - start,
                decode_slots=len(plan.decode),
                prefill_tokens=sum(c.length for c in plan.prefill),
                prefill_chunks=self.prefill_chunks - chunks,
                prefill_programs=self.prefill_programs - programs,
            )
            self._iteration += 1
            self._notify(self.iteration_listeners, record)

    def _deliver(self) -> None:
        """Hands each event loop its readers' events in one thread-safe call, not one per token:
        with hundreds of streams, a wake-up of the loop per token is what the host pays most."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody will read these
                for stream in {id(stream): stream for stream, _ in items}.values():
                    if not stream.request.finished:
                        self.cancel(stream.request)

    def _take_inbox(self) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            cancels, self._cancels = self._cancels, []
        now = time.monotonic()
        for r in cancels:
            if r.finished:
                continue
            if r.state is State.WAITING:
                self._waiting.remove(r)
            self._finish(r, FinishReason.ABORT, now)

    def _dispatch(self, plan: Plan) -> None:
        now = time.monotonic()
        for r in plan.admit:
            self._waiting.remove(r)
            r.slot = self._free_slots.pop()
            r.state = State.PREFILLING
            r.admitted = r.admitted or now
            if r.preemptions:
                r.readmitted()
            self._running.append(r)
            try:
                self._rows.set(r.slot, r.params.sampling)
            except Exception as e:  # this request's values, this request's failure
                self._fail_one(r, f"its sampling parameters cannot be packed: {e}", now)
        self._reserve_pages(plan, now)
        rows = self._rows.params()  # every slot's sampling row, for both programs
        chunks, firsts = [], []
        for chunk in plan.prefill:
            r = chunk.request
            if r.finished or r.state is State.WAITING:
                continue  # failed, or preempted or sent back by the page reservation
            ids = r.prefill_ids[chunk.start : chunk.start + chunk.length]
            if chunk.final:
                firsts.append((r, len(chunks)))
            chunks.append(PrefillChunk(r.slot, ids, chunk.start, chunk.final, r.pages))
            r.prefilled += chunk.length
            r.kv_tokens += chunk.length
            r.prefill_chunks += 1
            if chunk.final:
                r.state = State.DECODING
                r.dispatched = r.prefill_len - r.prompt_len + 1  # the token prefill samples
        if chunks:
            # One call for every chunk: the engine packs them into one program (usually).
            tokens = self.engine.prefill(chunks, rows)
            self.prefill_programs += tokens.programs
            self.prefill_chunks += len(chunks)
            if firsts:
                self._pending.append((firsts, tokens))
        decode = [r for r in plan.decode if r.state is State.DECODING]
        if decode:
            positions = np.zeros(self.num_slots, np.int32)
            active = np.zeros(self.num_slots, bool)
            for r in decode:
                positions[r.slot] = r.prompt_len + r.dispatched - 1
                active[r.slot] = True
                r.dispatched += 1
                r.kv_tokens += 1
                r.decode_steps += 1
            # A copy: JAX may alias host buffers on the CPU, and the table changes next step.
            tokens = self.engine.decode(positions, active, rows, self._tables.copy())
            self._pending.append(([(r, r.slot) for r in decode], tokens))

    def _tokens_after(self, r: Request, plan_chunks: dict[Request, int], decoding: set[Request]) -> int:
        """Positions `r` needs pages for once this iteration's work for it is dispatched."""
        if r in decoding:
            return r.prompt_len + r.dispatched  # the step writes the KV of position +dispatched-1
        return plan_chunks.get(r, 0)

    def _reserve_pages(self, plan: Plan, now: float) -> None:
        """Gives every request the pages this iteration's work needs, before anything runs.

        Requests admitted earlier go first, oldest first; when the pool runs dry, the most
        recently admitted request is preempted (its pages freed, back to the head of the
        queue, recomputed later), which may be the one asking. A request admitted in this very
        plan that finds too few pages goes back to the queue instead: admission never
        preempts. The oldest running request can always grow (the pool holds one sequence of
        max_seq_len), so something always progresses.
        """
        ends: dict[Request, int] = {}
        for chunk in plan.prefill:
            ends[chunk.request] = max(ends.get(chunk.request, 0), chunk.start + chunk.length)
        decoding = {r for r in plan.decode if r.state is State.DECODING}
        admitted = set(plan.admit)
        for r in [r for r in self._running if r not in admitted]:
            if r not in ends and r not in decoding:
                continue
            while not r.finished and r.state is not State.WAITING and not self._grow(r, self._tokens_after(r, ends, decoding)):
                victim = next(v for v in reversed(self._running) if v not in admitted)
                self._preempt(victim, now)
        short = [r for r in plan.admit
                 if r.state is State.PREFILLING and not self._grow(r, ends.get(r, 0))]
        for r in reversed(short):  # back to the head of the queue, in their order
            self._send_back(r)

    def _grow(self, r: Request, tokens: int) -> bool:
        if self.config.kv_reservation == "max":
            tokens = self.max_seq_len
        new = self._pages.grow(r.pages, tokens)
        if new is None:
            return False
        if new:
            self._tables[r.slot, len(r.pages) - len(new) : len(r.pages)] = new
        return True

    def _release(self, r: Request) -> None:
        """Frees its slot and its pages; the slot's row of the page table points at page 0."""
        self._running.remove(r)
        self._free_slots.append(r.slot)
        self._rows.clear(r.slot)
        self._tables[r.slot] = 0
        self._pages.release(r.pages)

    def _preempt(self, r: Request, now: float) -> None:
        logging.info("preempting %s: the KV pool is full (%d pages)", r.id, self._pages.num_pages)
        self._release(r)
        r.preempted()
        self._waiting.appendleft(r)
        self.preemptions += 1

    def _send_back(self, r: Request) -> None:
        """An admission that found too few pages: back to the head of the queue as it was."""
        self._release(r)
        r.state = State.WAITING
        r.slot = None
        if not r.preemptions:
            r.admitted = None  # it never really started
        self._waiting.appendleft(r)

    def _apply(self, results: list[tuple[list[tuple[Request, int]], Any]]) -> None:
        """`results`: (requests with the index of each one's token, the engine's tokens)."""
        vocab = self.engine.vocab_size
        for pairs, array in results:
            values = np.asarray(array)  # waits only if the device is still on that step
            now = time.monotonic()
            for r, index in pairs:
                if r.finished:
                    continue  # a step dispatched before the request ended: discard
                token = int(values[index])
                if not 0 <= token < vocab:
                    self._fail_one(r, f"the engine returned token id {token}, outside the "
                                      f"vocabulary [0, {vocab})", now)
                    continue
                try:
                    reason = r.accept(token, now)
                except Exception as e:  # its detokenizer or stop strings: its failure alone
                    logging.exception("request %s failed while taking a token", r.id)
                    self._fail_one(r, f"{type(e).__name__}: {e}", now)
                    continue
                if reason is not None:
                    self._finish(r, reason, now)

    def _finish(self, r: Request, reason: FinishReason, now: float, error: str | None = None) -> None:
        if r in self._running:
            self._release(r)
        elif r in self._waiting:  # preempted, and its last step's result ended it
            self._waiting.remove(r)
        try:
            record = r.finish(reason, now, error)
        except Exception:  # its client cannot be told; the slot is free all the same
            logging.exception("request %s failed while finishing", r.id)
            return
        self._notify(self.listeners, record)

    def _fail_one(self, r: Request, message: str, now: float) -> None:
        logging.error("request %s failed: %s", r.id, message)
        self._finish(r, FinishReason.ERROR, now, message)

    @staticmethod
    def _notify(listeners: list, record) -> None:
        for listener in listeners:
            try:
                listener(record)
            except Exception:  # a broken metrics hook must not take serving down
                logging.exception("listener %r failed", listener)

    def _fail_running(self, message: str) -> None:
        """After a failed engine call: the running requests' KV may be lost, so they end with
        the error; the engine rebuilds its state; waiting requests are served after. If the
        rebuild fails too, the scheduler is dead."""
        now = time.monotonic()
        self._pending = []
        for r in list(self._running):
            self._finish(r, FinishReason.ERROR, now, message)
        self._deliver()
        try:
            self.engine.recover()
        except Exception as e:
            logging.exception("engine recovery failed")
            self._die(f"the engine could not recover from '{message}': {type(e).__name__}: {e}")

    def _die(self, reason: str) -> None:
        """The loop cannot go on: refuse new work and end every request held with the reason."""
        logging.error("cadence scheduler is dead: %s; every request it holds fails", reason)
        with self._lock:
            self.dead = reason
            self._accepting = False
            held = list(self._running) + list(self._waiting) + self._inbox
            self._inbox.clear()
            self._cancels.clear()
        self._waiting.clear()
        self._pending = []
        now = time.monotonic()
        for r in held:
            if not r.finished:
                self._finish(r, FinishReason.ERROR, now, f"the engine is dead: {reason}")
        self._deliver()
