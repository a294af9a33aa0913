"""An engine's calls on its device state besides the steps: a slot's KV pages and token history.

    engine.copy_pages(sources, targets)         # a sequence's own copy of a cached page
    engine.set_history(slot, prompt, output, window)   # penalties: what a slot has seen so far
    state = engine.sampler_state(slot)          # Mirostat's or adaptive-p's, as the slot is left
    handle = engine.extract(pages, length, slot)      # disaggregated: a sequence's KV out,
    landed = other.receive(handle)                    # onto the other engine's device,
    other.insert(landed, pages, slot)                 # and into its pool
    engine.recover()                            # after a failed call: fresh device state

`KVOps` is mixed into `engine.engine.Engine` (its config, pool, next-token and history buffers,
and jitted programs). Each call checks its slots and pages, makes sure its program is compiled
(`_ensure`: a group warm-up left out compiles on first use), and returns at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from cadence.engine.packing import bucket_for
from cadence.engine.results import KVHandle
from cadence.model.host_sampling import MAX_DRY_BREAKERS, NO_TOKEN, SAMPLER_STATE, dry_matches
from cadence.model.paged_kv import PagedKVCache
from cadence.model.sampling import TokenHistory


class KVOps:
    """Page copies, token histories, KV moves and recovery, for an `Engine`."""

    def copy_pages(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copies the KV of pages `sources` onto pages `targets` (pairwise, at most num_slots
        pairs a call): how a sequence whose cached prefix ends inside a page (a partial match,
        or a later sequence of a group, n > 1) gets its own copy of that page. Returns at once."""
        cfg = self.config
        if len(sources) != len(targets) or len(sources) > cfg.num_slots:
            raise ValueError(f"copy_pages takes up to {cfg.num_slots} (source, target) pairs, got "
                             f"{len(sources)} sources and {len(targets)} targets")
        for page in (*sources, *targets):
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is not in the pool [0, {self.num_pages})")
        src = np.zeros(cfg.num_slots, np.int32)
        dst = np.full(cfg.num_slots, self.num_pages, np.int32)  # padding: past the pool
        src[: len(sources)], dst[: len(targets)] = sources, targets
        self._ensure("copy")
        self.cache = self._copy(self.cache, src, dst)

    def set_history(self, slot: int, prompt_ids: Sequence[int], output_ids: Sequence[int] = (),
                    window: int = 0, dry_breakers: Sequence[int] | None = None,
                    sampler_state: Sequence[float] = (0.0,) * SAMPLER_STATE) -> None:
        """Makes `slot`'s token history (what presence, frequency and repetition penalties
        and DRY read) that of a sequence with this prompt and output so far, for a request with
        this `penalty_window` (0: none) and, on DRY, these `dry_breakers` (None: not on DRY),
        whose stateful sampler (Mirostat, adaptive-p) is at `sampler_state`; the programs count every token
        the slot samples after. Call it when a penalized or stateful request takes a slot,
        before its next prefill or decode. Returns at once."""
        cfg = self.config
        if not 0 <= slot < cfg.num_slots:
            raise ValueError(f"slot {slot} is not in [0, {cfg.num_slots})")
        n = len(prompt_ids) + len(output_ids)
        if n > cfg.max_seq_len:
            raise ValueError(f"a history of {n} tokens overflows max_seq_len={cfg.max_seq_len}")
        tokens = np.full(cfg.max_seq_len, NO_TOKEN, np.int32)
        tokens[:n] = np.asarray([*prompt_ids, *output_ids], np.int32)
        self._ensure("history")
        breakers = np.full(MAX_DRY_BREAKERS, NO_TOKEN, np.int32)
        breakers[: len(dry_breakers or ())] = np.asarray(dry_breakers or (), np.int32)
        match = np.zeros(cfg.max_seq_len, np.int32)
        if dry_breakers is not None:
            match[:n] = dry_matches(tokens[:n])
        state = np.asarray(sampler_state, np.float32)
        if state.shape != (SAMPLER_STATE,):
            raise ValueError(f"a sampler state holds {SAMPLER_STATE} values, got {state.shape}")
        self.history = self._history(self.history, np.int32(slot), tokens, np.int32(len(prompt_ids)),
                                     np.int32(min(window, 2**31 - 1)), breakers, match, state)

    def sampler_state(self, slot: int):
        """`slot`'s sampler state ([SAMPLER_STATE] float32, `TokenHistory.sampler`) after every program
        dispatched so far, as a device array the host reads when it needs it (`np.asarray`):
        a request leaving the slot (preempted, or handed to a decode engine) keeps its state
        this way for the slot it takes next (`set_history`). Returns at once."""
        if not 0 <= slot < self.config.num_slots:
            raise ValueError(f"slot {slot} is not in [0, {self.config.num_slots})")
        self._ensure("history")
        return self._sampler(self.history, np.int32(slot))

    def _check(self, slot: int, pages: Sequence[int], needed: int) -> None:
        """A call's slot and pages: the slot exists, and `pages` holds `needed` pages."""
        if not 0 <= slot < self.config.num_slots:
            raise ValueError(f"slot {slot} is not in [0, {self.config.num_slots})")
        if len(pages) < needed:
            raise ValueError(f"{len(pages)} pages cannot hold {needed} pages of "
                             f"{self.config.page_size} tokens")

    def extract(self, pages: Sequence[int], length: int, slot: int) -> KVHandle:
        """The KV of the sequence at positions [0, length), held in `pages` (in order), and
        `slot`'s next decode input, as a `KVHandle`. The pages are left as they were: freeing
        them is the caller's business. Returns at once (the copy runs on the device)."""
        cfg = self.config
        if not 0 < length <= cfg.max_seq_len:
            raise ValueError(f"a sequence holds 1..{cfg.max_seq_len} tokens of KV, got {length}")
        count = cfg.pages_for(length)
        self._check(slot, pages, count)
        ids = np.zeros(bucket_for(cfg.page_buckets, count), np.int32)
        ids[:count] = pages[:count]
        self._ensure("transfer")
        k, v, token = self._extract(self.cache, self.last_tokens, ids, np.int32(slot))
        return KVHandle(k=k, v=v, next_token=token, length=length, page_size=cfg.page_size)

    def receive(self, handle: KVHandle) -> KVHandle:
        """Starts copying `handle` onto this engine's device and returns the copy at once; it
        is ready (`is_ready`) when the copy has landed, and `insert` then waits for nothing."""
        return self._place(handle)

    def _place(self, handle: KVHandle) -> KVHandle:
        return handle.to(self._handle_at, self._token_at)

    def insert(self, handle: KVHandle, pages: Sequence[int], slot: int | None) -> KVHandle:
        """Writes `handle`'s KV into `pages` of this engine's pool (free pages the caller
        allocated, at least `handle.num_pages`) and makes its next token `slot`'s next decode
        input: decoding then continues exactly where the engine it came from left off. With
        `slot` None the pages alone are written (a cached prefix brought back from the host).
        The handle stays valid (nothing of it is donated), so a failed insert loses nothing.
        Returns the handle as copied onto this engine's device (the same one if it was there):
        it is ready when the transfer is done. Returns at once."""
        cfg, mc = self.config, self.compute_config
        want = (mc.num_layers, mc.num_kv_heads, handle.k.shape[2], cfg.page_size, mc.head_dim)
        if handle.page_size != cfg.page_size or handle.k.shape != want:
            raise ValueError(
                f"a KV handle of shape {handle.k.shape} (pages of {handle.page_size} tokens) does "
                f"not fit this engine's pool ({mc.num_layers} layers x {mc.num_kv_heads} KV heads "
                f"x pages of {cfg.page_size} x head_dim {mc.head_dim})")
        if handle.length > cfg.max_seq_len:
            raise ValueError(f"the handle holds {handle.length} tokens; max_seq_len is {cfg.max_seq_len}")
        self._check(cfg.num_slots - 1 if slot is None else slot, pages, handle.num_pages)
        ids = np.full(handle.k.shape[2], self.num_pages, np.int32)  # padding: past the pool
        ids[: handle.num_pages] = pages[: handle.num_pages]
        here = self._place(handle)
        self._ensure("transfer")
        # (no slot: the token goes to an index past the slots, which writes nothing)
        self.cache, self.last_tokens = self._insert(
            self.cache, self.last_tokens, here.k, here.v, ids,
            np.int32(cfg.num_slots if slot is None else slot), here.next_token)
        return here

    def recover(self) -> None:
        """After a failed call: a fresh page pool and next-token buffer, whatever the failure
        left behind (donated and deleted, half-written, or poisoned). Every sequence's KV is
        lost, so call it only with no request running; the scheduler does, after failing the
        requests that were."""
        cfg = self.config
        self.cache = self.last_tokens = self.history = None  # let the old buffers go first
        self._pending = None  # a split decode step's logits went with them
        self.cache = PagedKVCache.create(self.compute_config, cfg.pool_pages, cfg.page_size,
                                         jnp.dtype(cfg.pool_dtype), device=self._pool_at,
                                         stacked=self.stacked_layers)
        self.last_tokens = jnp.zeros((cfg.num_slots,), jnp.int32, device=self._token_at)
        self.history = TokenHistory.create(cfg.num_slots, self.model_config.vocab_size,
                                           cfg.max_seq_len, device=self._token_at)
        # Counted here, once: a metrics reader on another thread may otherwise meet the pool
        # between a program's donation of it and the return of its successor.
        self._kv_cache_bytes = sum(shard.data.nbytes for layer in self.cache.arrays()
                                   for shard in layer.addressable_shards)
