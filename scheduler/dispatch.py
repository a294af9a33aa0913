"""What one iteration sends to an engine: admission, the page reservation, and the dispatches.

`Dispatch` is mixed into `Scheduler` (its queue, pools and counters). Given the policy's plan
(`policy.Plan`), `_admit` gives each admitted request a slot, its cached prefix and its sampling
row; `_reserve` finds the pages the plan needs (`kv_manager.Pool.reserve`), sending back to the
queue what did not fit, and moves pages to and from the prefix cache's host tier; then
`_dispatch_prefill` packs every chunk into one engine call and `_dispatch_decode` runs the
decoding rows' steps, or the first half of a split step when a grammar constrains a row (`_sample_split` dispatches its sampling once the bitmasks are
filled). `_dispatch_verify` is the speculative step. Each dispatch counts what it sent on the
requests (`Request.prefill_dispatched`, `decode_dispatched`) and leaves its results pending on
the pool (`Pool.expect`), applied next iteration (`outcomes`). Every method here runs under the
scheduler's state lock.
"""

from __future__ import annotations

import time

import numpy as np
from absl import logging

from cadence.engine.api import PrefillChunk
from cadence.model.host_sampling import all_allowed
from cadence.scheduler.kv_manager import Pool
from cadence.scheduler.policy import Plan
from cadence.scheduler.request import Request, State
from cadence.scheduler.results import Pooled, Progress, Row, Scores


class Dispatch:
    """Admission, reservation and dispatch, for a `Scheduler`."""

    def _admit(self, plan: Plan, pool: Pool, now: float) -> None:
        for r in plan.preempt:  # lower priorities making room for those admitted
            self._preempt(r, "a request of a better priority needs its slot or pages")
            self.priority_preemptions += 1
        for r in plan.admit:
            self._waiting.remove(r)
            pool.take(r)
            r.state = State.PREFILLING
            r.admitted = r.admitted or now
            if r.preemptions:
                r.readmitted()
            pool.take_prefix(r)
            r.progressed(r.prefilled, now)  # (what the cache gave it)
            try:
                pool.set_row(r)
            except Exception as e:  # this request's values, this request's failure
                self._fail_one(r, f"its sampling parameters cannot be packed: {e}", now)
                continue
            try:
                history = pool.history(r)
            except Exception as e:  # the program its state was read by failed
                self._fail_one(r, f"its sampler's state was lost: {e}", now)
                continue
            if history is not None:  # its slot's history, before its prefill samples
                try:
                    pool.engine.set_history(r.slot, *history)
                except Exception as e:  # the history buffer went into a failed program
                    logging.exception("setting %s's token history failed", r.id)
                    self._fail_pool(pool, f"{type(e).__name__}: {e}")
                    return

    def _reserve(self, pool: Pool, plan: Plan) -> None:
        """The pages this iteration's work needs (`Pool.reserve`); what did not fit goes back
        to the head of the queue: each request preempted as it was, then those sent back, ahead
        of them and in their order."""
        reservation = pool.reserve(plan)
        for r in reservation.preempted:
            self._waiting.appendleft(r)
            self.preemptions += 1
        for r in reversed(reservation.sent_back):
            self._waiting.appendleft(r)
        try:  # before anything writes the pages just handed out
            pool.move_host_pages()
        except Exception as e:
            logging.exception("moving KV pages between the device and the host tier failed")
            self._fail_pool(pool, f"{type(e).__name__}: {e}")

    def _preempt(self, r: Request, why: str) -> None:
        r.pool.preempt(r, why)
        self._waiting.appendleft(r)
        self.preemptions += 1

    def _dispatch_prefill(self, plan: Plan, pool: Pool, rows) -> tuple[int, int]:
        """Returns (programs, chunks) dispatched."""
        try:  # the pages prefixes end inside, copied before the prefill goes on from there
            pool.copy_tail_pages()
        except Exception as e:
            logging.exception("copying prefixes' last pages failed")
            self._fail_pool(pool, f"{type(e).__name__}: {e}")
        chunks, firsts, scored, pooled, progress = [], [], [], [], []
        allowed = None  # the token bitmasks of the slots whose first token a grammar constrains
        for chunk in plan.prefill:
            r = chunk.request
            if r.finished or r.state is State.WAITING:
                continue  # failed, or preempted or sent back by the page reservation
            if chunk.final and r.matcher is not None:
                if allowed is None:
                    allowed = all_allowed(pool.num_slots, pool.engine.vocab_size)
                if not r.matcher.fill(allowed[r.slot]):
                    self._fail_one(r, f"its grammar allows no token: {r.matcher.error}", time.monotonic())
                    continue
            start, end = chunk.start, chunk.start + chunk.length
            ids = r.prefill_ids[start:end]
            targets = None
            if r.prompt_logprobs is not None and None in r.prompt_logprobs[start + 1 : end + 1]:
                # each position's next prompt token (none after the prompt's last)
                targets = r.prompt_ids[start + 1 : end + 1] + [-1] * max(0, end + 1 - r.prompt_len)
                scored.append(Row(r, Scores(len(chunks), start)))
            embeds = r.params.pooling is not None
            if embeds:  # its hidden states, not a token (nor a decode after its last chunk)
                pooled.append(Row(r, Pooled(len(chunks), chunk.final)))
            elif chunk.final:
                firsts.append(Row(r, len(chunks)))
            elif r.params.progress:  # (a final chunk's progress goes with its first token)
                progress.append(Row(r, Progress(end)))
            chunks.append(PrefillChunk(r.slot, ids, start, chunk.final, r.pages, targets, embeds))
            r.prefill_dispatched(chunk.length, chunk.final)
            if chunk.final:
                r.state = State.DECODING
                if self.disaggregated and r.dispatched < r.max_tokens:
                    self._handoff.queue(r)  # its decode steps run on the decode pool
        if not chunks:
            return 0, 0
        # One call for every chunk: the engine packs them into one program (usually). Its
        # result is awaited next iteration even without a final chunk among them, so the
        # device never queues more than one pack ahead of what the host has seen.
        tokens = pool.engine.prefill(chunks, rows, allowed)
        self.prefill_programs += tokens.programs
        self.prefill_chunks += len(chunks)
        # a prompt's scores before its first token
        pool.expect(scored + pooled + progress + firsts, tokens)
        return tokens.programs, len(chunks)

    def _dispatch_decode(self, plan: Plan, pool: Pool, rows) -> None:
        decode = [r for r in plan.decode if r.state is State.DECODING and r.pool is pool]
        if not decode:
            return
        now = time.monotonic()
        positions = np.zeros(pool.num_slots, np.int32)
        active = np.zeros(pool.num_slots, bool)
        for r in decode:
            positions[r.slot] = r.decode_dispatched(plan.steps, plan.steps, now)
            active[r.slot] = True
        # A copy: JAX may alias host buffers on the CPU, and the table changes next step.
        if any(r.matcher is not None for r in decode):  # sampled once the bitmasks are filled
            pool.engine.decode_forward(positions, active, rows, pool.tables.copy())
            pool.split = [Row(r, r.slot) for r in decode]
            return
        tokens = pool.engine.decode(positions, active, rows, pool.tables.copy(), plan.steps)
        pool.expect([Row(r, r.slot) for r in decode], tokens)

    def _sample_split(self, pool: Pool) -> None:
        """The second half of a split decode step, once the tokens before it are applied: each
        constrained row's bitmask from its grammar, then the sampling. A request that ended
        meanwhile takes no token, and one whose grammar allows none fails alone."""
        decode, pool.split = pool.split, None
        allowed = all_allowed(pool.num_slots, pool.engine.vocab_size)
        drop, kept = [], []
        for r, slot in decode:
            if r.finished or r.pool is not pool:
                drop.append(slot)
            elif r.matcher is not None and not r.matcher.fill(allowed[slot]):
                self._fail_one(r, f"its grammar allows no token: {r.matcher.error}", time.monotonic())
                drop.append(slot)
            else:
                kept.append(Row(r, slot))
        tokens = pool.engine.decode_sample(allowed, drop)
        pool.expect(kept, tokens)

    def _dispatch_verify(self, plan: Plan, pool: Pool, drafts: dict[Request, list[int]]) -> None:
        """The verify step over the plan's rows, those without drafts scoring their one token,
        those under a grammar among what it allows at each position (`Matcher.draft_masks`:
        the drafts before it taken; one whose grammar allows nothing fails alone). Each row is
        counted as dispatching all its drafts and one token more; applying the result takes
        back what it did not emit (`_apply`)."""
        cfg = pool.engine.config
        k = cfg.speculative_tokens
        allowed = None  # each position's bitmask, [slots, k + 1, words], where a grammar constrains
        now = time.monotonic()
        for r in plan.decode:
            if r.matcher is None or r.state is not State.DECODING or r.pool is not pool:
                continue
            if allowed is None:
                allowed = all_allowed((pool.num_slots, k + 1), pool.engine.vocab_size)
            if not r.matcher.draft_masks(drafts.get(r, []), allowed[r.slot]):
                self._fail_one(r, f"its grammar allows no token: {r.matcher.error}", now)
        decode = [r for r in plan.decode if r.state is State.DECODING and r.pool is pool]
        if not decode:
            return
        positions = np.zeros(pool.num_slots, np.int32)
        active = np.zeros(pool.num_slots, bool)
        tokens = np.zeros((pool.num_slots, k), np.int32)
        lens = np.zeros(pool.num_slots, np.int32)
        for r in decode:
            d = drafts.get(r, [])
            positions[r.slot] = r.decode_dispatched(len(d) + 1, 1, now)
            active[r.slot] = True
            tokens[r.slot, : len(d)], lens[r.slot] = d, len(d)
        result = pool.engine.verify(positions, active, pool.rows.params(), pool.tables.copy(),
                                    tokens, lens, allowed)
        self.spec_drafts += sum(1 for r in decode if r in drafts)
        pool.expect([Row(r, r.slot) for r in decode], result, [drafts.get(r, []) for r in decode])
