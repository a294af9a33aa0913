"""Device state and the compiled programs: weights, KV slots, bucketed prefill, decode.

The engine owns everything that lives on the device. It implements `engine.api.EngineAPI`, the
whole of what the scheduler may use; its two programs:

    token = engine.prefill(slot, chunk_ids, start, sampling, final)   # one chunk of one prompt
    tokens = engine.decode(positions, active, sampling_rows)          # one step for every slot

Both return device arrays immediately (JAX dispatch is asynchronous) and have already started
copying them to the host; the scheduler reads them one step later, so the device never waits
for Python between steps. The token each slot decodes next never leaves the device: prefill
(final chunk) and decode write it into `last_tokens`, which the next decode reads.

Shapes are fixed per program. Prefill compiles once per (chunk bucket, KV bucket) and decode
once per KV bucket, where a KV bucket bounds how much of each slot attention reads, so attention
cost follows the live context rather than `max_seq_len` (with the Pallas kernels decode has one
bucket, the whole slot: the kernel stops at each slot's length). Everything that varies per
request is an array argument. The cache and `last_tokens` are donated into every program, so they
are updated in place. `warmup()` compiles every program; afterwards `compilations_after_warmup`
must stay 0.

Non-goals here: paging (slots are contiguous), multi-device sharding, speculative decoding.
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
from model.kv_cache import KVCache
from model.llama import forward
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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 8
    max_seq_len: int = 2048
    prefill_chunk: int = 256  # the largest prefill program; longer prompts go in chunks
    min_prefill_bucket: int = 16
    min_kv_bucket: int = 256
    attention: str = "xla"
    dtype: str = "float32"  # compute and KV dtype: float32 on CPU, bfloat16 on GPU

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.prefill_chunk < 1 or self.prefill_chunk > self.max_seq_len:
            raise ValueError(
                f"prefill_chunk must be in [1, max_seq_len={self.max_seq_len}], got {self.prefill_chunk}"
            )

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        return ladder(min(self.min_prefill_bucket, self.prefill_chunk), self.prefill_chunk)

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        return ladder(min(self.min_kv_bucket, self.max_seq_len), self.max_seq_len)

    @property
    def decode_kv_buckets(self) -> tuple[int, ...]:
        """KV lengths of the length-following decode program ("xla", "pallas"): it stops at each
        slot's own length, and the whole cache is passed as is, while a bucket's slice would be
        copied every layer and step: one bucket. The reference has no such program."""
        return () if self.attention == "reference" else (self.max_seq_len,)

    @property
    def batched_decode_kv_buckets(self) -> tuple[int, ...]:
        """KV buckets of the batched (einsum) decode program: the reference's only decode path,
        and "xla"'s choice for short contexts of similar lengths, where the per-slot loops of
        the length-following program cost more than the padding they save."""
        if self.attention == "reference":
            return self.kv_buckets
        if self.attention == "xla":
            return tuple(kv for kv in self.kv_buckets if kv <= BATCHED_DECODE_MAX_KV)
        return ()


def bucket_for(buckets: Sequence[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def _prefill_program(
    params, cache, last_tokens, tokens, start, length, slot, sampling, final,
    *, config, kv_len, attention, dtype,
):
    t = tokens.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    logits, cache = forward(
        params, tokens, positions, length, cache, config=config, kv_len=kv_len, slots=slot,
        logit_index=jnp.maximum(length - 1, 0), attention=attention, dtype=dtype,
    )
    token = sample(logits, sampling, start + length)  # step = the new token's position
    last_tokens = last_tokens.at[slot].set(jnp.where(final, token, last_tokens[slot]))
    return token, cache, last_tokens


def _decode_program(
    params, cache, last_tokens, positions, active, sampling,
    *, config, kv_len, attention, dtype,
):
    logits, cache = forward(
        params, last_tokens[:, None], positions[:, None], active.astype(jnp.int32), cache,
        config=config, kv_len=kv_len, logit_index=jnp.zeros_like(positions),
        attention=attention, dtype=dtype,
    )
    tokens = sample(logits, sampling, positions + 1)
    return tokens, cache, jnp.where(active, tokens, last_tokens)


def sampling_rows(rows: Sequence[RequestSampling]) -> SamplingParams:
    return SamplingRows.of(list(rows)).params()


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
        self.cache: KVCache | None = None
        self.last_tokens: jax.Array | None = None
        self.recover()  # allocates the cache and the next-token buffer
        static = dict(config=model_config, attention=config.attention, dtype=dtype)
        donate = ("cache", "last_tokens")
        self._prefill = jax.jit(
            functools.partial(_prefill_program, **static),
            static_argnames=("kv_len",), donate_argnames=donate,
        )
        self._decode = jax.jit(
            functools.partial(_decode_program, **static),
            static_argnames=("kv_len",), donate_argnames=donate,
        )
        self._decode_batched = jax.jit(
            functools.partial(_decode_program, **{**static, "attention": "reference"}),
            static_argnames=("kv_len",), donate_argnames=donate,
        )
        self._warm_compiles: int | None = None
        logging.info(
            "KV cache: %d slots x %d tokens, %.1f MiB", config.num_slots, config.max_seq_len,
            self.cache.nbytes / 2**20,
        )

    # -- the two programs -------------------------------------------------------------------

    def prefill(
        self, slot: int, chunk: Sequence[int], start: int, sampling: RequestSampling, final: bool
    ) -> jax.Array:
        """Writes `chunk`'s KV at [start, start+len) of `slot`; returns the sampled next token.

        With `final`, the token is the request's first output and becomes the slot's next
        decode input. The result is a device array of shape [1].
        """
        n = len(chunk)
        if not 0 < n <= self.config.prefill_chunk:
            raise ValueError(f"a prefill chunk must hold 1..{self.config.prefill_chunk} tokens, got {n}")
        if start + n > self.config.max_seq_len:
            raise ValueError(f"chunk [{start}, {start + n}) overflows the slot of {self.config.max_seq_len}")
        t = bucket_for(self.config.prefill_buckets, n)
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :n] = chunk
        token, self.cache, self.last_tokens = self._prefill(
            self.params, self.cache, self.last_tokens, tokens,
            np.asarray([start], np.int32), np.asarray([n], np.int32),
            np.asarray([slot], np.int32), sampling_rows([sampling]), np.asarray(final),
            kv_len=bucket_for(self.config.kv_buckets, start + n),
        )
        token.copy_to_host_async()
        return token

    def decode(
        self, positions: np.ndarray, active: np.ndarray, sampling: SamplingParams
    ) -> jax.Array:
        """One decode step over all slots: active slot s consumes its last token at
        `positions[s]` and samples the next. Returns device tokens [num_slots]."""
        program, kv_len = self._decode_plan(positions[active] + 1)
        tokens, self.cache, self.last_tokens = program(
            self.params, self.cache, self.last_tokens,
            positions.astype(np.int32), active.astype(bool), sampling, kv_len=kv_len,
        )
        tokens.copy_to_host_async()
        return tokens

    def _decode_plan(self, lengths: np.ndarray):
        """The cheaper decode program for these live lengths, and its KV length.

        The batched program reads every slot (active or not) up to the longest one's bucket;
        the length-following one reads each slot only up to its own length but pays a loop per
        slot (about as much as reading a few hundred positions). Up to BATCHED_DECODE_MAX_KV
        the padding is cheaper than the loops; beyond it, following lengths wins.
        """
        cfg = self.config
        longest = int(lengths.max()) if lengths.size else 1
        batched = cfg.batched_decode_kv_buckets
        if batched and longest <= batched[-1]:
            return self._decode_batched, bucket_for(batched, longest)
        return self._decode, bucket_for(cfg.decode_kv_buckets, longest)

    def recover(self) -> None:
        """After a failed call: a fresh KV cache and next-token buffer, whatever the failure
        left behind (donated and deleted, half-written, or poisoned). Every slot's contents are
        lost, so call it only with no request running; the scheduler does, after failing the
        requests that were."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.cache = self.last_tokens = None  # let the old buffers go before allocating
        self.cache = KVCache.create(self.model_config, cfg.num_slots, cfg.max_seq_len, dtype)
        self.last_tokens = jnp.zeros((cfg.num_slots,), jnp.int32)

    # -- warm-up and accounting ---------------------------------------------------------------

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Compiles every program. Runs them with nothing to write, so no slot changes."""
        cfg = self.config
        # A chunk bucket t serves lengths (previous bucket, t]; any KV bucket above the
        # previous chunk bucket can hold such a chunk at some start.
        prev = dict(zip(cfg.prefill_buckets, (0,) + cfg.prefill_buckets[:-1]))
        prefill_shapes = [
            (t, kv) for t in cfg.prefill_buckets for kv in cfg.kv_buckets if kv > prev[t]
        ]
        decode_shapes = [(self._decode_batched, kv) for kv in cfg.batched_decode_kv_buckets]
        decode_shapes += [(self._decode, kv) for kv in cfg.decode_kv_buckets]
        total = len(prefill_shapes) + len(decode_shapes)
        greedy = sampling_rows([RequestSampling()])
        done = 0
        for t, kv in prefill_shapes:
            token, self.cache, self.last_tokens = self._prefill(
                self.params, self.cache, self.last_tokens, np.zeros((1, t), np.int32),
                np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
                greedy, np.asarray(False), kv_len=kv,
            )
            done += 1
            if progress:
                progress(done, total)
        rows = sampling_rows([RequestSampling()] * cfg.num_slots)
        for program, kv in decode_shapes:
            tokens, self.cache, self.last_tokens = program(
                self.params, self.cache, self.last_tokens, np.zeros(cfg.num_slots, np.int32),
                np.zeros(cfg.num_slots, bool), rows, kv_len=kv,
            )
            done += 1
            if progress:
                progress(done, total)
        jax.block_until_ready((token, tokens, self.cache))
        self._warm_compiles = compile_counter.count()

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
