"""How a request's results land: its tokens taken, its end, and the failures that end it.

`Outcomes` is mixed into `Scheduler` (its queue, listeners, pools and `_lock`). Every path by
which a request ends runs through `_finish`: it publishes the request's pages to the prefix
cache (unless an engine failed under them), frees its slot, and tells the listeners. `_apply`
takes an iteration's results one step behind the device (`results.Pending`); a token outside
the vocabulary, or a detokenizer or stop string that raises, fails that request alone
(`_fail_one`). An engine call that raised fails the requests of its pool and rebuilds that
engine (`_fail_pool`); when the rebuild fails too, the scheduler is dead (`_die`). Every method
here runs under the scheduler's state lock.
"""

from __future__ import annotations

import time

import numpy as np
from absl import logging

from cadence.scheduler.errors import EngineDead
from cadence.scheduler.kv_manager import Pool
from cadence.scheduler.request import FinishReason, Request, State
from cadence.scheduler.results import Pending, Pooled, Progress, Scores
from cadence.scheduler.stats import notify


class Outcomes:
    """Applying results and ending requests, for a `Scheduler`."""

    def _apply(self, results: list[Pending], arrays: list[np.ndarray]) -> int:
        """`results` and their tokens as read: each request's tokens, a row per step, taken in
        order until the request ends (`Pending.read`); of a verify step, the tokens each row
        emitted, its counts of dispatched tokens and KV cut to them before any is taken (its
        pages publish only verified KV). Returns the drafts accepted."""
        vocab = self.engine.vocab_size
        accepted = 0
        for result, values in zip(results, arrays):
            now = time.monotonic()
            steps, logprobs = result.read(values)
            emitted = None if result.drafts is None else result.tokens.emitted()
            pooled = None
            for i, (r, index) in enumerate(result.rows):
                r.unapplied -= 1
                if isinstance(index, Scores):
                    r.take_scores(result.tokens.scores()[index.chunk], index.start)
                    continue
                if isinstance(index, Progress):
                    if r.state is not State.WAITING and index.processed <= r.prefilled:
                        r.progressed(index.processed, now)  # (not since preempted)
                    continue
                if isinstance(index, Pooled):  # an embedding's chunk; its last one ends it
                    pooled = pooled or result.tokens.pooled()
                    if r.take_pooled(*pooled[index.chunk], index.final):
                        self._finish(r, FinishReason.STOP, now)
                    continue
                column = steps[:, index].tolist()
                if emitted is not None:  # a verify step: its row's tokens, and its true length
                    drafts, column = result.drafts[i], column[: emitted[index]]
                    r.not_emitted(len(drafts) + 1 - len(column))
                    if drafts and not r.finished:
                        kept = r.drafter.observe(drafts, column)
                        accepted += kept
                        if r.drafter.from_model:
                            self.draft_model_drafted += len(drafts)
                            self.draft_model_accepted += kept
                for step, token in enumerate(column):
                    if r.finished:
                        break  # a step dispatched before the request ended: discard
                    logprob = None
                    if logprobs is not None and r.logprobs is not None:
                        logprob = tuple(a[step, index] for a in logprobs)
                    self._take(r, token, vocab, now, logprob)
        self.spec_accepted += accepted
        return accepted

    def _take(self, r: Request, token: int, vocab: int, now: float, logprob=None) -> None:
        """One of `r`'s tokens (and its logprobs, if it asked): accepted and streamed, or the
        reason it ends."""
        if not 0 <= token < vocab:
            self._fail_one(r, f"the engine returned token id {token}, outside the vocabulary "
                              f"[0, {vocab})", now)
            return
        try:
            reason = r.accept(token, now, logprob)
        except Exception as e:  # its detokenizer or stop strings: its failure alone
            logging.exception("request %s failed while taking a token", r.id)
            self._fail_one(r, f"{type(e).__name__}: {e}", now)
            return
        if reason is not None:
            self._finish(r, reason, now)

    def _finish(self, r: Request, reason: FinishReason, now: float, error: str | None = None) -> None:
        if r.pool is not None:
            if reason is not FinishReason.ERROR:  # a failed engine's KV is not to be trusted
                r.pool.publish(r, tail=True)
            r.pool.release(r)
        elif r in self._waiting:  # waiting, or preempted and its last step's result ended it
            self._waiting.remove(r)
        try:
            record = r.finish(reason, now, error)
        except Exception:  # its client cannot be told; the slot is free all the same
            logging.exception("request %s failed while finishing", r.id)
            return
        notify(self.listeners, record)

    def _fail_one(self, r: Request, message: str, now: float) -> None:
        logging.error("request %s failed: %s", r.id, message)
        self._finish(r, FinishReason.ERROR, now, message)

    def _forget(self, results: list[Pending], message: str) -> None:
        """Dispatched results that will never be applied. A request that was waiting for one
        and still runs (disaggregated: moved on to the decode pool before its first token was
        read) has lost that token and fails; a waiting one recomputes it when admitted again."""
        now = time.monotonic()
        for result in results:
            for r, _ in result.rows:
                r.unapplied -= 1
                if not r.finished and r.state is not State.WAITING:
                    self._fail_one(r, message, now)

    def _fail_pool(self, pool: Pool, message: str) -> None:
        """After a failed engine call: the pool's requests' KV may be lost, so they end with
        the error; its engine rebuilds its state; everything else goes on. If the rebuild
        fails too, the scheduler is dead. Under the state lock, from either loop."""
        now = time.monotonic()
        # Results not yet taken by an iteration are dropped; those an iteration is reading
        # (`applying`) it still applies, to requests that are finished by then.
        self._forget(pool.pending, message)
        pool.pending, pool.split = [], None  # (a split step's sampling will not run)
        if pool is self._prefill_pool:
            self.cost.forget_in_flight()
        for r in list(pool.running):
            self._finish(r, FinishReason.ERROR, now, message)
        pool.pages.clear_cache()  # recover() rebuilds the KV: no cached page holds its prefix now
        try:
            pool.engine.recover()
        except Exception as e:
            logging.exception("engine recovery failed")
            self._die(f"the engine could not recover from '{message}': {type(e).__name__}: {e}")

    def _die(self, reason: str) -> None:
        """The loop cannot go on: refuse new work and end every request held with the reason."""
        logging.error("cadence scheduler is dead: %s; every request it holds fails", reason)
        with self._state:
            with self._lock:
                self.dead = reason
                self._accepting = False
                held = [*(r for p in self.pools for r in p.running), *self._waiting, *self._inbox]
                self._inbox.clear()
                self._cancels.clear()
                tasks, self._tasks = self._tasks, []
                self._changed()
            for _, future in tasks:
                future.set_exception(EngineDead(f"the engine is dead: {reason}"))
            self._waiting.clear()
            self._handoff.clear()
            for pool in self.pools:
                pool.pending, pool.applying, pool.split = [], [], None
            now = time.monotonic()
            for r in held:
                if not r.finished:
                    self._finish(r, FinishReason.ERROR, now, f"the engine is dead: {reason}")
        self._outbox.deliver()
        self._handoff.end()
