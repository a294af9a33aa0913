"""Device state and the compiled programs: weights, the KV page pool, bucketed prefill, decode.

The engine owns everything that lives on the device. It implements `engine.api.EngineAPI`, the
whole of what the scheduler may use; its two programs:

    token = engine.prefill(slot, chunk_ids, start, sampling, final, pages)   # one prompt chunk
    tokens = engine.decode(positions, active, sampling_rows, page_table)     # the active slots, one step

Both return device arrays immediately (JAX dispatch is asynchronous) and have already started
copying them to the host; the scheduler reads them one step later, so the device never waits
for Python between steps. The token each slot decodes next never leaves the device: prefill
(final chunk) and decode write it into `last_tokens`, which the next decode reads.

KV lives in a pool of fixed-size pages (`model.paged_kv`) shared by every sequence; which pages a
sequence holds is the scheduler's business (`scheduler.pages`), passed in as page tables, so KV
memory follows the tokens that exist and `num_slots` (sequences in flight) no longer multiplies
`max_seq_len`. Shapes are fixed per program: prefill compiles once per (chunk bucket, page-table
bucket) and decode once per (batch bucket, page-table bucket), where the page bucket is the width
of the page table passed, which bounds what attention reads, and the batch bucket is the
smallest power of two holding the active slots: decode gathers their rows, runs only those, and
scatters the tokens back, so one stream on an idle engine pays for one row, not `num_slots` (vLLM
captures one CUDA graph per padded batch size for the same reason). Everything that varies per
request is an array argument. The pool and `last_tokens` are donated into every program, so
they are updated in place. `warmup()` compiles every program; afterwards `compilations_after_warmup` must stay 0.

Non-goals here: multi-device sharding, speculative decoding, prefix sharing.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from engine import compile_counter
from model.config import ModelConfig
from model.llama import forward
from model.paged_kv import PagedKVCache
from model.sampling import RequestSampling, SamplingParams, SamplingRows, sample


# Measured with SmolLM2-135M on the 2-core CPU: batched decode beat the per-slot loops at 128
# live tokens (8 slots 46-50 vs 64 ms/step; 1 slot 25 vs 31; 4 of 8 slots ~45 vs 60) and lost
# from ~300 on (8 slots: 73 vs 60 ms at 300, 117 vs 81 ms at 1000), so it serves up to here.
BATCHED_DECODE_MAX_KV = 256


def ladder(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from `low` below `high`, then `high` itself."""
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (high,)


# The measured default page sizes (tokens per page): on the 2-core CPU the per-page decode loop
# costs a step per page, so small pages are slow (16-token pages up to 2x at 1k tokens, 64 about
# 1.2x, 128 at or below the contiguous loop; `bench/results/paged_attention_cpu.txt`).
DEFAULT_PAGE_SIZE = 64


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 8  # most sequences in flight
    max_seq_len: int = 2048  # longest sequence, prompt + output
    prefill_chunk: int = 256  # the largest prefill program; longer prompts go in chunks
    min_prefill_bucket: int = 16
    min_kv_bucket: int = 256  # tokens: the narrowest page-table bucket covers this many
    attention: str = "xla"
    dtype: str = "float32"  # compute and KV dtype: float32 on CPU, bfloat16 on GPU
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None  # the pool; None: every slot can hold max_seq_len at once

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.prefill_chunk < 1 or self.prefill_chunk > self.max_seq_len:
            raise ValueError(
                f"prefill_chunk must be in [1, max_seq_len={self.max_seq_len}], got {self.prefill_chunk}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < self.max_pages_per_seq:
            raise ValueError(
                f"a KV pool of {self.num_pages} pages x {self.page_size} tokens cannot hold one "
                f"sequence of max_seq_len={self.max_seq_len}; give it more memory or lower "
                "max_seq_len")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def pool_pages(self) -> int:
        return self.num_slots * self.max_pages_per_seq if self.num_pages is None else self.num_pages

    @property
    def decode_batch_buckets(self) -> tuple[int, ...]:
        """Rows of the decode programs: powers of two below num_slots, then num_slots."""
        return ladder(1, self.num_slots)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        return ladder(min(self.min_prefill_bucket, self.prefill_chunk), self.prefill_chunk)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def page_buckets(self) -> tuple[int, ...]:
        """Page-table widths: powers of two from `min_kv_bucket` tokens' worth to the longest
        sequence's (prefill, and the batched decode program)."""
        low = min(self.pages_for(self.min_kv_bucket), self.max_pages_per_seq)
        return ladder(low, self.max_pages_per_seq)

    @property
    def decode_page_buckets(self) -> tuple[int, ...]:
        """Widths of the length-following decode program ("xla", "pallas"): it stops at each
        slot's own length, so it takes the whole table: one program. The reference has none."""
        return () if self.attention == "reference" else (self.max_pages_per_seq,)

    @property
    def batched_decode_page_buckets(self) -> tuple[int, ...]:
        """Widths of the batched (einsum) decode program: the reference's only decode path,
        and "xla"'s choice for short contexts of similar lengths, where the per-slot loops of
        the length-following program cost more than the padding they save."""
        if self.attention == "reference":
            return self.page_buckets
        if self.attention == "xla":
            most = self.pages_for(BATCHED_DECODE_MAX_KV)
            return tuple(p for p in self.page_buckets if p <= most)
        return ()


def bucket_for(buckets: Sequence[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def _prefill_program(
    params, cache, last_tokens, tokens, start, length, slot, page_table, sampling, final,
    *, config, attention, dtype,
):
    t = tokens.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    logits, cache = forward(
        params, tokens, positions, length, cache, page_table, config=config,
        logit_index=jnp.maximum(length - 1, 0), attention=attention, dtype=dtype,
    )
    token = sample(logits, sampling, start + length)  # step = the new token's position
    last_tokens = last_tokens.at[slot].set(jnp.where(final, token, last_tokens[slot]))
    return token, cache, last_tokens


def _decode_program(
    params, cache, last_tokens, slots, positions, page_table, sampling,
    *, config, attention, dtype,
):
    """One step over the rows of `slots` [batch] (a slot index, or num_slots for a padding
    row); positions, page_table and sampling are per row. Returns every slot's next token:
    the new one where a row decoded it, the last one elsewhere."""
    valid = slots < last_tokens.shape[0]
    inputs = jnp.take(last_tokens, slots, mode="clip")
    logits, cache = forward(
        params, inputs[:, None], positions[:, None], valid.astype(jnp.int32), cache,
        page_table, config=config, logit_index=jnp.zeros_like(positions),
        attention=attention, dtype=dtype,
    )
    tokens = sample(logits, sampling, positions + 1)
    last_tokens = last_tokens.at[slots].set(tokens, mode="drop")  # padding rows drop out
    return last_tokens, cache, last_tokens


def fixed_page_tables(config: EngineConfig, order: Sequence[int] | None = None) -> np.ndarray:
    """A page table [num_slots, max_pages_per_seq] giving every slot its own run of pages for
    its whole length, taken in `order` (default: 0, 1, 2, ...): the layout before paging, for
    benchmarks and tests that drive the engine without the scheduler's allocator. Needs a pool
    of at least num_slots x max_pages_per_seq pages (the default pool)."""
    count = config.num_slots * config.max_pages_per_seq
    if config.pool_pages < count:
        raise ValueError(f"fixed page tables need {count} pages; the pool has {config.pool_pages}")
    pages = np.arange(count) if order is None else np.asarray(order)[:count]
    return pages.reshape(config.num_slots, config.max_pages_per_seq).astype(np.int32)


def sampling_rows(rows: Sequence[RequestSampling]) -> SamplingParams:
    return SamplingRows.of(list(rows)).params()


_GREEDY_ROW = SamplingRows(1).params()  # what a padding row samples with (read only)


def _gather_rows(sampling: SamplingParams, pick: np.ndarray, live: np.ndarray) -> SamplingParams:
    """The sampling rows of the slots `pick`; padding rows (not `live`) are greedy, so they
    never send a step down the sampling path."""
    return jax.tree.map(lambda a, greedy: np.where(live, np.asarray(a)[pick], greedy).astype(greedy.dtype),
                        sampling, _GREEDY_ROW)


class Engine:
    def __init__(self, params, model_config: ModelConfig, config: EngineConfig = EngineConfig()):
        if config.max_seq_len > model_config.max_context:
            raise ValueError(
                f"max_seq_len {config.max_seq_len} exceeds the model's context of "
                f"{model_config.max_context} tokens"
            )
        compile_counter.install()
        self.model_config = model_config
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.params = jax.device_put(jax.tree.map(lambda a: jnp.asarray(a, dtype), params))
        self.cache: PagedKVCache | None = None
        self.last_tokens: jax.Array | None = None
        self.recover()  # allocates the page pool and the next-token buffer
        static = dict(config=model_config, attention=config.attention, dtype=dtype)
        donate = ("cache", "last_tokens")
        # Page-table widths are shapes: each bucket is its own program, compiled at warm-up.
        self._prefill = jax.jit(functools.partial(_prefill_program, **static), donate_argnames=donate)
        self._decode = jax.jit(functools.partial(_decode_program, **static), donate_argnames=donate)
        self._decode_batched = jax.jit(
            functools.partial(_decode_program, **{**static, "attention": "reference"}),
            donate_argnames=donate,
        )
        self._warm_compiles: int | None = None
        logging.info(
            "KV pool: %d pages x %d tokens (%d tokens), %.1f MiB", self.num_pages, config.page_size,
            self.num_pages * config.page_size, self.cache.nbytes / 2**20,
        )

    # -- the two programs -------------------------------------------------------------------

    def prefill(
        self, slot: int, chunk: Sequence[int], start: int, sampling: RequestSampling, final: bool,
        pages: Sequence[int],
    ) -> jax.Array:
        """Writes `chunk`'s KV at positions [start, start+len) of the sequence whose pages, in
        order, are `pages` (enough for start+len tokens); returns the sampled next token.

        With `final`, the token is the request's first output and becomes `slot`'s next
        decode input. The result is a device array of shape [1].
        """
        cfg = self.config
        n = len(chunk)
        if not 0 < n <= cfg.prefill_chunk:
            raise ValueError(f"a prefill chunk must hold 1..{cfg.prefill_chunk} tokens, got {n}")
        if start + n > cfg.max_seq_len:
            raise ValueError(f"chunk [{start}, {start + n}) overflows max_seq_len={cfg.max_seq_len}")
        if len(pages) < cfg.pages_for(start + n):
            raise ValueError(f"{len(pages)} pages cannot hold {start + n} tokens of {cfg.page_size}")
        t = bucket_for(cfg.prefill_buckets, n)
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :n] = chunk
        table = np.zeros((1, bucket_for(cfg.page_buckets, cfg.pages_for(start + n))), np.int32)
        used = min(len(pages), table.shape[1])
        table[0, :used] = pages[:used]
        token, self.cache, self.last_tokens = self._prefill(
            self.params, self.cache, self.last_tokens, tokens,
            np.asarray([start], np.int32), np.asarray([n], np.int32),
            np.asarray([slot], np.int32), table, sampling_rows([sampling]), np.asarray(final),
        )
        token.copy_to_host_async()
        return token

    def decode(
        self, positions: np.ndarray, active: np.ndarray, sampling: SamplingParams,
        page_table: np.ndarray,
    ) -> jax.Array:
        """One decode step over the active slots: slot s consumes its last token at
        `positions[s]` and samples the next, with its sequence's pages in `page_table[s]`
        ([num_slots, max_pages_per_seq] int32, enough for positions[s] + 1 tokens).
        Returns device tokens [num_slots]; an inactive slot's entry is its last token.

        Runs the smallest batch bucket holding the active slots: their rows are gathered here,
        on the host (a few hundred bytes), and padded with rows that write nothing."""
        cfg = self.config
        slots = np.flatnonzero(active)
        batch = bucket_for(cfg.decode_batch_buckets, max(len(slots), 1))
        rows = np.full(batch, cfg.num_slots, np.int32)  # padding: a slot index past the last
        rows[: len(slots)] = slots
        live = rows < cfg.num_slots
        pick = np.where(live, rows, 0)
        program, width = self._decode_plan(positions[slots] + 1)
        tables = np.where(live[:, None], page_table[pick, :width], 0).astype(np.int32)
        tokens, self.cache, self.last_tokens = program(
            self.params, self.cache, self.last_tokens, rows,
            np.where(live, positions[pick], 0).astype(np.int32), tables,
            _gather_rows(sampling, pick, live),
        )
        tokens.copy_to_host_async()
        return tokens

    def _decode_plan(self, lengths: np.ndarray):
        """The cheaper decode program for these live lengths, and its page-table width.

        The batched program reads every slot (active or not) up to the longest one's bucket;
        the length-following one reads each slot only up to its own length but pays a loop per
        slot. Up to BATCHED_DECODE_MAX_KV the padding is cheaper than the loops; beyond it,
        following lengths wins.
        """
        cfg = self.config
        longest = cfg.pages_for(int(lengths.max()) if lengths.size else 1)
        batched = cfg.batched_decode_page_buckets
        if batched and longest <= batched[-1]:
            return self._decode_batched, bucket_for(batched, longest)
        return self._decode, bucket_for(cfg.decode_page_buckets, longest)

    def recover(self) -> None:
        """After a failed call: a fresh page pool and next-token buffer, whatever the failure
        left behind (donated and deleted, half-written, or poisoned). Every sequence's KV is
        lost, so call it only with no request running; the scheduler does, after failing the
        requests that were."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.cache = self.last_tokens = None  # let the old buffers go before allocating
        self.cache = PagedKVCache.create(self.model_config, cfg.pool_pages, cfg.page_size, dtype)
        self.last_tokens = jnp.zeros((cfg.num_slots,), jnp.int32)

    # -- warm-up and accounting ---------------------------------------------------------------

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Compiles every program. Runs them with nothing to write, so no page changes (decode
        runs padding rows only, which write nothing and leave `last_tokens` as it was)."""
        cfg = self.config
        # A chunk bucket t serves lengths (previous bucket, t]; any page bucket holding more
        # than the previous chunk bucket can hold such a chunk at some start.
        prev = dict(zip(cfg.prefill_buckets, (0,) + cfg.prefill_buckets[:-1]))
        prefill_shapes = [(t, w) for t in cfg.prefill_buckets for w in cfg.page_buckets
                          if w * cfg.page_size > prev[t]]
        decode_shapes = [(self._decode_batched, w) for w in cfg.batched_decode_page_buckets]
        decode_shapes += [(self._decode, w) for w in cfg.decode_page_buckets]
        total = len(prefill_shapes) + len(decode_shapes) * len(cfg.decode_batch_buckets)
        greedy = sampling_rows([RequestSampling()])
        done = 0
        for t, width in prefill_shapes:
            token, self.cache, self.last_tokens = self._prefill(
                self.params, self.cache, self.last_tokens, np.zeros((1, t), np.int32),
                np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
                np.zeros((1, width), np.int32), greedy, np.asarray(False),
            )
            done += 1
            if progress:
                progress(done, total)
        for program, width in decode_shapes:
            for batch in cfg.decode_batch_buckets:
                tokens, self.cache, self.last_tokens = program(
                    self.params, self.cache, self.last_tokens,
                    np.full(batch, cfg.num_slots, np.int32), np.zeros(batch, np.int32),
                    np.zeros((batch, width), np.int32), sampling_rows([RequestSampling()] * batch),
                )
                done += 1
                if progress:
                    progress(done, total)
        jax.block_until_ready((token, tokens, self.cache))
        self._warm_compiles = compile_counter.count()

    @property
    def num_pages(self) -> int:
        return self.config.pool_pages

    @property
    def warmed_up(self) -> bool:
        return self._warm_compiles is not None

    @property
    def compilations_after_warmup(self) -> int:
        if self._warm_compiles is None:
            return 0
        return compile_counter.count() - self._warm_compiles

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes
