"""The scheduler's front door: submissions and cancellations, from any thread.

    stream = scheduler.submit(prompt_ids, GenerationParams(max_tokens=64))
    streams = scheduler.submit_group(prompt_ids, [params] * n, [None] * n)   # OpenAI's `n`
    scheduler.cancel(stream.request)      # or stream.cancel()

`Submissions` is mixed into `Scheduler`. Each submission is checked here, on the caller's thread,
so the loop never sees one it could not serve: the scheduler is running and accepting, the
parameters pass the one validation every front door uses (`request.check_params`), the prompt
and max_tokens fit the context, and the queue and the latency targets have room
(`Overloaded` otherwise, counted in `rejections`). An accepted submission lands in the inbox, and
a cancellation in the cancels, both under the scheduler's `_lock`; the loop takes them at the
start of its next iteration, as it runs the calls `call_in_loop` queued.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

from cadence.model.host_sampling import row_bias
from cadence.scheduler.errors import EngineDead, NotRunning, Overloaded, RequestTooLong, SubmissionError
from cadence.scheduler.prefix_cache import PageKeys
from cadence.scheduler.priority import tokens_ahead
from cadence.scheduler.request import GenerationParams, Request, check_length, check_params, check_prompt
from cadence.scheduler.stream import RequestStream


class Submissions:
    """Submission and cancellation, for a `Scheduler` (its engines, queues, admission control
    and `_lock`)."""

    def call_in_loop(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs `fn` on a loop thread at the start of its next iteration, holding the
        state lock, where it may use the pool and call the engine (nothing is dispatched
        meanwhile); returns a future of what it returns or raises. Work on the KV outside
        any request: llama-server's slot files (`scheduler.slot_files`)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_running()
            self._tasks.append((fn, future))
            self._changed()
        return future

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams = GenerationParams(),
        request_id: str | None = None,
    ) -> RequestStream:
        return self.submit_group(prompt_ids, [params], [request_id])[0]

    def submit_group(self, prompt_ids: Sequence[int], params: Sequence[GenerationParams],
                     request_ids: Sequence[str | None]) -> list[RequestStream]:
        """Several sequences from one prompt (OpenAI's `n`), queued together or not at all.
        The first prefills the prompt; each other one, once that prefill is dispatched, takes
        the prompt's KV from it (`Pool.match_forks`): its full pages shared, the page holding the
        prompt's last token copied, and only that token computed again, to sample its own first
        token. If the first is gone from the pool by then, the others prefill as usual."""
        self._check_running()
        if len(params) > 1 and any(p.pooling is not None for p in params):
            raise SubmissionError("an embedding is one sequence; submit it alone", "n")
        streams = [self._stream(prompt_ids, p, i) for p, i in zip(params, request_ids, strict=True)]
        first = streams[0].request
        for stream in streams[1:]:
            stream.request.fork_parent = first
        with self._lock:
            self._check_running()  # again under the lock: stop() or a death may have come since
            # Requests not yet admitted; those that free slots will take at once do not queue.
            queued = len(self._waiting) + len(self._inbox) - len(self._prefill_pool.free_slots)
            if queued + len(streams) > self.config.max_queue:
                self.rejections["queue_full"] += 1
                raise Overloaded(
                    f"{self.config.max_queue} requests are already waiting; retry later"
                )
            if self.config.slo.active:
                rejection = self.admission.check(first.priority, tokens_ahead(first, self._backlog, self._inbox),
                                                 self._running_priorities)
                if rejection is not None:
                    self.rejections[rejection.reason] += 1
                    raise Overloaded(rejection.message, rejection.retry_after)
            self._inbox.extend(s.request for s in streams)
            self._changed()
        return streams

    def _stream(self, prompt_ids: Sequence[int], params: GenerationParams,
                request_id: str | None) -> RequestStream:
        self._check_params(params)
        n = len(prompt_ids)
        check_prompt(prompt_ids, self.engine.vocab_size)
        if params.pooling is not None:  # an embedding: its prompt alone must fit
            max_tokens = 0
            if n > self.embed_context:
                raise RequestTooLong(f"the text to embed ({n} tokens) exceeds the "
                                     f"{self.embed_context} tokens a sequence may hold; shorten it")
        else:
            max_tokens = check_length(n, params.max_tokens, self.context, self.max_seq_len)
        if params.min_tokens > max_tokens:  # (max_tokens given: `check_params` said so already)
            raise SubmissionError(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens "
                                  f"left in the context after the prompt", "min_tokens")
        priority = self.config.priority_classes.of(n) if params.priority is None else params.priority
        request = Request(
            prompt_ids, params, max_tokens, self.tokenizer,
            emit=lambda e: stream._push(e), request_id=request_id, priority=priority,
        )
        # (a mean-pooled embedding needs every position's hidden state: it computes them all;
        # a last-token one, as a generation, only its last)
        if self.config.prefix_caching and params.prompt_logprobs is None and params.pooling != "mean":
            versions = getattr(self.engine, "lora_versions", None)  # (an engine's bank's)
            lora = tuple((slot, scale, versions[slot] if versions else 0)
                         for slot, scale in params.sampling.lora)
            request.page_keys = PageKeys(self.page_size, self.config.cache_namespace.encode(),
                                         params.cache_salt, lora)
        if params.min_tokens:  # its row must hold its stop ids masked beside its biases
            try:
                row_bias(params.sampling.logit_bias, request.eos_ids)
            except ValueError as e:
                raise SubmissionError(f"min_tokens masks the request's {len(request.eos_ids)} stop "
                                      f"ids beside its logit_bias: {e}", "min_tokens") from None
        stream = RequestStream(request, self.cancel, self._outbox)
        return stream

    def _check_running(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"the engine is dead ({self.dead}); restart the server")
        if not self._accepting:
            raise NotRunning("the scheduler is shutting down and accepts no new requests")

    def _check_params(self, params: GenerationParams) -> None:
        """What the loop relies on, checked once here rather than on the scheduler thread
        (`scheduler.request.check_params`, which every front door calls too)."""
        decoders = [e for e in self.engines if e.config.role != "prefill"]
        check_params(params, self.engine.vocab_size, self.engine.config.max_logprobs,
                     structured=all(e.config.structured_output for e in decoders),
                     lora_slots=min(e.config.lora_slots for e in self.engines))

    def cancel(self, request: Request) -> None:
        with self._lock:
            request.cancelled = True
            self._cancels.append(request)
            self._changed()
