"""The iteration loop: admission, planning, dispatch, and applying results one step behind.

    sched = Scheduler(engine, tokenizer, SchedulerConfig())
    sched.start()                                  # runs iterations on a background thread
    stream = sched.submit(prompt_ids, GenerationParams(max_tokens=64))
    async for event in stream: ...                 # TokenEvent..., then a RequestRecord
    # or, from plain threads: for event in stream: ...

    Scheduler(prefill_engine, tokenizer, config, decode_engine=decode_engine)   # disaggregated

Each iteration: take new submissions and cancellations, ask the policy for a plan, dispatch the
plan's prefill chunks and one decode step to the engine (asynchronous), then apply the results
of the *previous* iteration while the device works on this one. Tokens therefore reach clients
one iteration after they are computed, and the device is never idle waiting for Python.

A request with a grammar (structured output, `scheduler.grammar`) samples among the tokens its
grammar allows next: the host fills each such row's bitmask from the token before. A decode step
with such a row runs in two halves: the iteration dispatches the forward pass, applies the
previous iteration's tokens while it runs (which advances each grammar), fills the bitmasks,
then dispatches the sampling (`engine.decode_forward` / `decode_sample`).

When an iteration has nothing to do but decode and no decoding request could end sooner on the
host's word, it runs k steps in one dispatch (`policy.decode_steps`). A request that stops on EOS
or a stop string is discovered a dispatch late; the tokens dispatched after are discarded (a row
whose input is its EOS writes nothing). Requests that end on max_tokens never over-run, because
the host counts dispatched tokens.

Disaggregated (DistServe's design), two engines each have a pool and a loop thread of their own:
the prefill loop admits and prefills, and a prompt's KV moves to the decode pool when it has room
(`scheduler.handoff`), so a long prefill never holds up a decode step.

Faults stay where they belong. A request whose own host-side work fails (packing its sampling
row, turning its token into text, a token id outside the vocabulary) ends with an error alone.
An engine call that raises fails the requests that pool was running (their KV may be gone), the
engine rebuilds its device state, and everything else goes on. If that rebuild fails, or
anything else stops a loop, the scheduler is dead: every request it holds ends with an error,
`dead` says why, and `submit` raises `EngineDead`. The loops never die silently.

Priorities (`GenerationParams.priority`, or the class `SchedulerConfig.priority_classes` gives a
prompt's length) order the queue, preempt lower ones for slots or pages and share the prefill
budget (`scheduler.policy`); latency targets (`SchedulerConfig.slo`) refuse at submission what
would miss them and cap lower classes' prefill while a targeted class decodes
(`scheduler.priority`).

The scheduler talks to the engines only through `engine.api.EngineAPI`, so tests can drive it
with fake engines in milliseconds. Its front door (`submit`, `submit_group`, `cancel` and the
checks a submission passes) is `submission.Submissions`, its readings `stats.Readings`; what an
iteration sends to an engine (admission, the page reservation, the dispatches) is
`dispatch.Dispatch`, and how results land and requests end (`_apply`, `_finish`, a failed
engine's `_fail_pool`, `_die`) is `outcomes.Outcomes`. What the loop uses, module by module: `kv_manager` (each engine's slots and pages: prefix and fork
matching, `reserve`, the pool's pending results), `pages` and `prefix_cache` (the page
allocator, its null page and the cached prefixes), `policy` (the plan, the decode steps, whether
and what to draft), `speculative` (whether an engine can verify yet), `draft_model` (drafts
from a second model), `priority` (SLO
admission, the backlog), `handoff` (the disaggregated transfers), `request` (a request's state,
what each dispatch counts for it, and the one validation of its parameters), `results` (pending
results), `stream` (request streams and their delivery), `stats` (`IterationRecord`, and
`notify` for the listeners), `config` (`SchedulerConfig`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np
from absl import logging

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.engine.api import EngineAPI
from cadence.scheduler.config import KV_RESERVATIONS, SchedulerConfig  # noqa: F401 - importers' names
from cadence.scheduler.cost import IterationCost
from cadence.scheduler.dispatch import Dispatch
from cadence.scheduler.draft_model import DraftModel
from cadence.scheduler.handoff import Handoff, KVTransfer, check_pair  # noqa: F401 - importers' names
from cadence.scheduler.host_cache import HostCache
from cadence.scheduler.kv_manager import Pool
from cadence.scheduler.outcomes import Outcomes
from cadence.scheduler.policy import (
    Plan, decode_steps, make_plan, propose_drafts, speculates, wants_decode,
)
from cadence.scheduler.priority import AdmissionControl, backlog, prefill_limit
from cadence.scheduler.request import FinishReason, Request
from cadence.scheduler.results import Pending
from cadence.scheduler.speculative import verify_ready
from cadence.scheduler.stats import IterationRecord, Readings, notify
from cadence.scheduler.stream import Outbox, RequestStream  # noqa: F401 - importers' names
from cadence.scheduler.submission import Submissions


class Scheduler(Submissions, Dispatch, Outcomes, Readings):
    """The loops, and what they hold: see the module's docstring; its front door: `Submissions`;
    what an iteration sends to the engine: `Dispatch`; how results land and requests end:
    `Outcomes`; its readings: `Readings`."""

    def __init__(self, engine: EngineAPI, tokenizer: Tokenizer, config: SchedulerConfig = SchedulerConfig(),
                 decode_engine: EngineAPI | None = None, draft_engine: EngineAPI | None = None):
        """`engine` prefills and decodes; with `decode_engine`, `engine` only prefills and
        `decode_engine` decodes (disaggregated serving: two devices, two loops). With
        `draft_engine` (a smaller model of the same vocabulary), speculative decoding drafts
        from it (`scheduler.draft_model`) where a sequence's own n-grams find nothing."""
        if config.policy.chunk > engine.config.prefill_chunk:
            raise ValueError(
                f"policy chunk {config.policy.chunk} exceeds the engine's prefill_chunk "
                f"{engine.config.prefill_chunk}"
            )
        if decode_engine is not None:
            check_pair(engine, decode_engine)
        self.engine = engine  # the engine that prefills (and, colocated, decodes)
        self.tokenizer = tokenizer
        # The policy plans for the engine's packed prefill programs.
        config = dataclasses.replace(config, policy=dataclasses.replace(
            config.policy, pack_block=engine.config.pack_block,
            pack_tokens=engine.config.prefill_buckets[-1]))
        self.config = config
        reserve = engine.config.max_seq_len if config.kv_reservation == "max" else None
        host = HostCache(config.host_kv_cache_bytes) if config.host_kv_cache_bytes else None
        self._prefill_pool = Pool(engine, "colocated" if decode_engine is None else "prefill",
                                  caching=config.prefix_caching, reserve=reserve, host=host)
        self._decode_pool = (self._prefill_pool if decode_engine is None
                             else Pool(decode_engine, "decode", reserve=reserve))
        self.pools = tuple(dict.fromkeys((self._prefill_pool, self._decode_pool)))
        self.num_slots = self._decode_pool.num_slots  # sequences that decode at once
        self.draft = None if draft_engine is None else DraftModel.for_target(
            draft_engine, self._decode_pool.engine, config.speculative.draft_p_min)
        self.max_seq_len = engine.config.max_seq_len
        # The longest sequence a request may reach: the context, unless a pool is too small to
        # hold that beside its null page (a pool of exactly one longest sequence): a sequence
        # of L tokens holds the KV of L - 1.
        usable = min(p.pages.usable for p in self.pools)
        if reserve is not None and usable < engine.config.max_pages_per_seq:
            raise ValueError(f"kv_reservation='max' holds {engine.config.max_pages_per_seq} KV pages "
                             f"per request, but a pool has only {usable} beside its null page; "
                             f"give the engine more pages or a shorter max_seq_len")
        self.context = min(self.max_seq_len, usable * engine.config.page_size + 1)
        # The longest prompt an embedding may have: it writes the KV of every one of its tokens.
        self.embed_context = min(self.max_seq_len, usable * engine.config.page_size)
        self.page_size = engine.config.page_size
        self._lock = threading.Condition()  # submissions, cancellations and wake-ups
        self._changes = 0  # bumped (under _lock) whenever a loop may have new work
        # Request state, shared by the two loops when disaggregated (one loop: uncontended).
        # Held while planning, dispatching and applying, never while waiting for the device.
        self._state = threading.RLock()
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._tasks: list = []  # (fn, future): `call_in_loop`'s, run at the next iteration
        self._waiting: collections.deque[Request] = collections.deque()
        self.preemptions = 0
        self.priority_preemptions = 0  # of those, for a better priority's slot or pages (the rest: growth)
        self.spec_drafts = 0  # speculative decoding: rows that drafted, their draft tokens
        self.spec_drafted = 0  # and those accepted
        self.spec_accepted = 0
        self.draft_model_drafted = self.draft_model_accepted = 0  # of those, the draft model's
        self.prefill_programs = 0  # packed prefill programs run, and the chunks they carried
        self.prefill_chunks = 0
        # Submissions refused for load, by reason: "queue_full", "ttft_slo", "itl_slo".
        self.rejections: collections.Counter[str] = collections.Counter()
        self.admission = AdmissionControl(config.slo)
        # What the admitting pool's iterations cost, fitted as they run: sizes prefill to an
        # inter-token target (`--itl_target`, `--slo_itl`).
        self.cost = IterationCost(engine.config.pack_block, engine.config.prefill_buckets)
        # Per priority: (requests waiting, prompt tokens waiting or mid-prefill), as of the last
        # iteration (read by submitters and metrics, written by the admitting loop).
        self._backlog: dict[int, tuple[int, int]] = {}
        self._running_priorities: frozenset[int] = frozenset()
        self._outbox = Outbox(self._state)  # events for readers in event loops (`scheduler.stream`)
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._accepting = True
        self._iteration = 0
        self.dead: str | None = None  # why the engine could not go on; None while it can
        # Observers (metrics, the server's timeline, traces) subscribe here; the scheduler
        # itself keeps no history.
        self.listeners: list = []  # callables(RequestRecord) for finished requests
        self.iteration_listeners: list = []  # callables(IterationRecord), from the loop threads
        self.transfer_listeners: list = []  # callables(KVTransfer), from the transfer watcher
        # Disaggregated: the prefilled requests waiting for the decode pool, and those whose KV
        # is on its way there (`scheduler.handoff`).
        self._handoff = Handoff(
            self._prefill_pool, self._decode_pool, config.policy, self._fail_one, self._fail_pool,
            lambda t: notify(self.transfer_listeners, t), self._wake)

    @property
    def disaggregated(self) -> bool:
        return self._decode_pool is not self._prefill_pool

    @property
    def engines(self) -> tuple[EngineAPI, ...]:
        return tuple(pool.engine for pool in self.pools)

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the loop thread (disaggregated: a prefill loop and a decode loop)."""
        if self._threads:
            return
        if self.disaggregated:
            loops = [("cadence-prefill", self._iterate), ("cadence-decode", self._iterate_decode)]
        else:
            loops = [("cadence-scheduler", self._iterate)]
        self._threads = [threading.Thread(target=self._run, args=(iterate,), name=name, daemon=True)
                         for name, iterate in loops]
        for thread in self._threads:
            thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops accepting; with `drain`, finishes what is queued and running, else aborts it."""
        self._accepting = False
        with self._lock:
            if not drain:
                for r in [*self._waiting, *self._inbox, *(r for p in self.pools for r in p.running)]:
                    r.cancelled = True
                    self._cancels.append(r)
            self._stopping = True
            self._changed()
        self.join(timeout)
        if not self.alive:  # nothing more will move: let the transfer watcher end
            self._handoff.close(timeout)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    @property
    def alive(self) -> bool:
        """Whether a loop thread is running."""
        return any(thread.is_alive() for thread in self._threads)

    def idle(self) -> bool:
        return not (self._inbox or self._tasks or self._waiting or not self._handoff.idle
                    or any(not pool.idle for pool in self.pools))

    def _wake(self) -> None:
        with self._lock:
            self._changed()

    def _changed(self) -> None:
        """Wakes the loops: something may have given one of them work. Call under _lock."""
        self._changes += 1
        self._lock.notify_all()

    def _run(self, iterate) -> None:
        """A loop thread: iterates while there is work, waits for a change when there is none."""
        try:
            while self.dead is None:
                with self._lock:
                    seen = self._changes
                progressed = self._guarded(iterate)
                with self._lock:
                    if progressed:
                        self._changed()  # the other loop may have work now
                    elif self._stopping and self.idle() and not self._cancels:
                        return
                    else:
                        while self._changes == seen and self.dead is None:
                            self._lock.wait()
        except BaseException as e:  # a bug outside the guarded step: never die silently
            logging.exception("the scheduler loop failed")
            self._die(f"the scheduler loop failed: {type(e).__name__}: {e}")

    def step(self) -> None:
        """One iteration (of both loops, disaggregated) on the caller's thread. Public so tests
        can drive the scheduler synchronously."""
        self._guarded(self._iterate)
        if self.disaggregated:
            self._guarded(self._iterate_decode)

    def _guarded(self, iterate) -> bool:
        """Runs one iteration; an engine call that raised fails the requests of its pool, which
        rebuilds its device state, and the loop goes on. Returns whether anything ran."""
        pool = self._decode_pool if iterate == self._iterate_decode else self._prefill_pool
        try:
            return iterate()
        except Exception as e:
            logging.exception("%s iteration failed", pool.name)
            with self._state:
                message = f"{type(e).__name__}: {e}"
                # This iteration will not apply the results it took: they are dropped here.
                self._forget(pool.applying, message)
                pool.applying = []
                self._fail_pool(pool, message)
            return True
        finally:
            self._outbox.deliver()

    def _iterate(self) -> bool:
        """The admitting pool's iteration: admit and prefill, decode what is decoding here
        (colocated: everything; disaggregated: nothing, so prefill has the whole budget), and
        hand prompts that just finished to the decode pool if it has room (disaggregated)."""
        pool = self._prefill_pool
        with self._state:
            start = time.monotonic()
            self._take_inbox()
            pool.match_prefixes(self._waiting)
            pool.match_forks(self._waiting)
            plan = self._plan(pool)
            if verify_ready(pool.engine) and speculates(plan, pool.running, pool.engine.config,
                                                        self.config.speculative, pool.split, self._drafts_here(pool)):
                return self._speculate(pool, start)
            plan.steps = decode_steps(plan, pool.running, pool.engine.config.decode_steps,
                                      pool.pages.free_count, self.page_size)
            previous = pool.begin()
            self._admit(plan, pool, start)
            self._reserve(pool, plan)
            pool.unmask_rows()
            rows = pool.rows.params()  # every slot's sampling row, for both programs
            programs, chunks = self._dispatch_prefill(plan, pool, rows)
            self._dispatch_decode(plan, pool, rows)
            pool.publish_running()  # the prompt pages just dispatched are reusable at once
            transfers = self._handoff.start()  # a prompt just finished moves right behind it
        return self._finish_iteration(pool, previous, start, plan, programs, chunks, transfers)

    def _iterate_decode(self) -> bool:
        """Disaggregated: insert the KV that has landed, start moving what the freed room
        allows, then one decode step."""
        pool = self._decode_pool
        with self._state:
            start = time.monotonic()
            self._take_inbox()
            landed = self._handoff.insert_landed()
            transfers = self._handoff.start()
            plan = Plan(decode=[r for r in pool.running if wants_decode(r)])
            if verify_ready(pool.engine) and speculates(plan, pool.running, pool.engine.config,
                                                        self.config.speculative, pool.split, self._drafts_here(pool)):
                return self._speculate(pool, start, transfers + landed)
            plan.steps = decode_steps(plan, pool.running, pool.engine.config.decode_steps,
                                      pool.pages.free_count, self.page_size)
            previous = pool.begin()
            self._reserve(pool, plan)
            pool.unmask_rows()
            self._dispatch_decode(plan, pool, pool.rows.params())
        return self._finish_iteration(pool, previous, start, plan, 0, 0, transfers + landed)

    def _speculate(self, pool: Pool, start: float, handoffs: int = 0) -> bool:
        """A speculative decode iteration (`policy.speculates` chose it; called holding the
        state lock; returns as `_finish_iteration`). Drafts come from every token a request
        has, so the results still in flight are applied first (waiting for them outside the
        lock); then each row drafts (`policy.propose_drafts`), and one verify step scores them
        all and is applied before the next dispatch, which needs each row's true length. An
        iteration whose rows drafted nothing decodes as usual."""
        previous = pool.begin()
        self._state.release()
        try:
            values = [np.asarray(p.tokens) for p in previous]
        finally:
            self._state.acquire()
        timed = pool is self._prefill_pool
        if timed and previous:
            self.cost.ready(time.monotonic())
        self._apply(previous, values)
        pool.applying = []
        pool.publish_running()
        self._outbox.deliver()  # before drafting (a draft model's first catch-up: a whole prompt)
        plan = Plan(decode=[r for r in pool.running if wants_decode(r)])
        drafts = propose_drafts(plan, pool.engine.config.speculative_tokens, self.context,
                                self.page_size, pool.pages.free_count,
                                self.draft if self._drafts_here(pool) else None)
        if drafts:
            plan.steps = 1 + max(len(d) for d in drafts.values())
            plan.drafted = sum(len(d) for d in drafts.values())
        else:
            plan.steps = decode_steps(plan, pool.running, pool.engine.config.decode_steps,
                                      pool.pages.free_count, self.page_size)
        self._reserve(pool, plan)
        pool.unmask_rows()
        if drafts:
            self._dispatch_verify(plan, pool, drafts)
            if timed and pool.pending:  # its results are `current`, awaited below (if any went out)
                self.cost.dispatched(None, start)
        else:
            self._dispatch_decode(plan, pool, pool.rows.params())
        current = pool.begin() if drafts else []
        self._state.release()
        try:  # (the results applied above are progress, even if nothing runs now)
            return self._finish_iteration(pool, current, start, plan, 0, 0, handoffs) or bool(previous)
        finally:
            self._state.acquire()

    def _drafts_here(self, pool: Pool) -> bool:
        """Whether the draft model drafts for `pool`'s rows (it serves the decoding pool)."""
        return self.draft is not None and pool is self._decode_pool

    def _plan(self, pool: Pool) -> Plan:
        # A request with a result still in flight (disaggregated: preempted on the decode pool
        # while its last step runs) is admitted again only once that result is applied.
        waiting = [r for r in self._waiting
                   if not r.unapplied and not r.compiling and not r.awaits_parent]
        return make_plan(pool.running, waiting, len(pool.free_slots), self.config.policy,
                         pool.page_budget(),
                         prefill_limit(self.config.slo, self.config.itl_target, self.cost, pool.running))

    def _finish_iteration(self, pool: Pool, previous: list[Pending], start: float, plan: Plan,
                          programs: int, chunks: int, handoffs: int = 0) -> bool:
        """Waits for the previous iteration's results (outside the state lock: the other loop
        goes on meanwhile), applies them, and records the iteration if anything ran."""
        values = [np.asarray(p.tokens) for p in previous]  # waits only if still running
        with self._state:
            if pool is self._prefill_pool:
                self._timed(previous, pool, plan, start)
            accepted = self._apply(previous, values)
            pool.applying = []
            if pool.split is not None:  # a decode step whose sampling waited for these tokens
                self._sample_split(pool)
            pool.publish_running()  # pages filled by the tokens just accepted
            if plan.empty and not previous and not handoffs:
                return False
            wall = time.monotonic() - start
            pool.busy_seconds += wall
            record = IterationRecord(
                index=self._iteration,
                start=start,
                wall=wall,
                decode_slots=len(plan.decode),
                prefill_tokens=sum(c.length for c in plan.prefill),
                prefill_chunks=chunks,
                prefill_programs=programs,
                pool=pool.name,
                transfers=handoffs,
                decode_steps=1 if plan.drafted else plan.steps,
                drafted=plan.drafted,
                accepted=accepted,
            )
            self.spec_drafted += plan.drafted
            self._iteration += 1
            if pool is self._prefill_pool:  # what admission and the metrics read
                snapshot = backlog(self._waiting, pool.running)
                running = frozenset(r.priority for p in self.pools for r in p.running)
                with self._lock:
                    self._backlog, self._running_priorities = snapshot, running
        self.admission.observe(record.start, record.wall, record.prefill_tokens, record.decode_slots,
                               record.decode_steps)
        notify(self.iteration_listeners, record)
        return True

    def _timed(self, previous: list[Pending], pool: Pool, plan: Plan, start: float) -> None:
        """Tells the cost model that the previous plan's results are in, and what this
        iteration dispatched (a plan of one decode step and no drafts to learn from)."""
        if previous:
            self.cost.ready(time.monotonic())
        if pool.pending:
            plain = plan.steps == 1 and not plan.drafted
            self.cost.dispatched(self.cost.work(plan) if plain else None, start)

    def _take_inbox(self) -> None:
        with self._lock:
            taken = list(self._inbox)
            self._waiting.extend(taken)
            self._inbox.clear()
            cancels, self._cancels = self._cancels, []
            tasks, self._tasks = self._tasks, []
        now = time.monotonic()
        for r in cancels:
            if not r.finished:
                self._finish(r, FinishReason.ABORT, now)
        for fn, future in tasks:
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up waiting (a cancelled handler): not run
            try:
                result = fn()
            except Exception as e:  # the caller's to report
                future.set_exception(e)
            else:
                future.set_result(result)
        for r in taken:  # programs warm-up left for first use compile; r waits meanwhile
            r.prepare(self.engines, lambda _: self._wake())
        self._check_compiled(now)

    def _check_compiled(self, now: float) -> None:
        """Waiting requests whose programs finished compiling may be admitted; one whose
        programs failed to compile fails."""
        for r in [r for r in self._waiting if r.compiling]:
            if not all(f.done() for f in r.compiling):
                continue
            errors = [f.exception() for f in r.compiling if f.exception() is not None]
            r.compiling = []
            if errors:
                self._fail_one(r, f"its programs failed to compile: {type(errors[0]).__name__}: "
                                  f"{errors[0]}", now)

