"""On-device sampling with per-row parameters.

    tokens = sample(logits, params)      logits [rows, vocab] float32 -> tokens [rows] int32

Every parameter is an array with one entry per row, so one compiled program serves any mix of
greedy and sampled requests:
    temperature  [rows] f32   0 means greedy (argmax)
    top_k        [rows] i32   0 means no top-k limit
    top_p        [rows] f32   1.0 means no nucleus limit
    seed         [rows] u32   with `step` [rows] i32 gives the row's key: fold_in(key(seed), step)
    stop_ids     [rows, MAX_STOP_TOKENS] i32   token ids that end the row's request (its EOS
                 ids; -1 pads), so a program of several decode steps stops a row on the device

A row's randomness depends only on its own seed and step (e.g. its position), never on which
other requests share the batch, so a seeded request is reproducible alone or batched.
When every row is greedy the sort-based path is skipped entirely (`lax.cond`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SamplingParams:
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    stop_ids: jax.Array

    @classmethod
    def greedy(cls, rows: int) -> SamplingParams:
        return cls.make([0.0] * rows, [0] * rows, [1.0] * rows, [0] * rows)

    @classmethod
    def make(cls, temperature, top_k, top_p, seed) -> SamplingParams:
        rows = len(temperature)
        return cls(
            temperature=jnp.asarray(temperature, jnp.float32),
            top_k=jnp.asarray(top_k, jnp.int32),
            top_p=jnp.asarray(top_p, jnp.float32),
            seed=jnp.asarray(seed, jnp.uint32),
            stop_ids=jnp.full((rows, MAX_STOP_TOKENS), -1, jnp.int32),
        )

    def stops(self, tokens: jax.Array) -> jax.Array:
        """[rows] bool: whether each row's token ends its request."""
        return jnp.any(tokens[:, None] == self.stop_ids, axis=-1)


# What the device arrays can hold: top_k is int32 and the seed uint32 (`SamplingParams`).
MAX_TOP_K = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
SEED_RANGE = 2**32
# Stop token ids a row carries to the device. A request with more EOS ids than this is still
# stopped by the host on every one of them; the device just runs its surplus steps.
MAX_STOP_TOKENS = 4


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """Host-side sampling settings of one request, validated when it is made.

    Every value must fit the per-row device arrays it is packed into; a value that does not
    (a non-finite temperature, a top_k past int32) is refused here, at the edge, so it can never
    reach a batch where it would fail the requests beside it.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or abs(value) > FLOAT32_MAX):
                raise ValueError(f"{name} must be a finite number that fits float32, got {value!r}")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < SEED_RANGE:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


class SamplingRows:
    """Per-slot sampling parameters on the host, in the dtypes the programs take."""

    def __init__(self, num_slots: int):
        self.temperature = np.zeros(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int32)
        self.top_p = np.ones(num_slots, np.float32)
        self.seed = np.zeros(num_slots, np.uint32)
        self.stop_ids = np.full((num_slots, MAX_STOP_TOKENS), -1, np.int32)

    @classmethod
    def of(cls, rows: list[RequestSampling]) -> SamplingRows:
        packed = cls(len(rows))
        for slot, row in enumerate(rows):
            packed.set(slot, row)
        return packed

    def set(self, slot: int, sampling: RequestSampling, stop_ids: Iterable[int] = ()) -> None:
        """Packs one row (and the MAX_STOP_TOKENS smallest of `stop_ids`); raises (and changes
        nothing) if a value does not fit its dtype."""
        values = (np.float32(sampling.temperature), np.int32(sampling.top_k),
                  np.float32(sampling.top_p), np.uint32(sampling.seed))
        stops = np.full(MAX_STOP_TOKENS, -1, np.int32)
        ids = sorted(stop_ids)[:MAX_STOP_TOKENS]
        stops[: len(ids)] = np.asarray(ids, np.int32)
        self.temperature[slot], self.top_k[slot], self.top_p[slot], self.seed[slot] = values
        self.stop_ids[slot] = stops

    def clear(self, slot: int) -> None:
        """Greedy again: a free slot must not make a step take the sampling path."""
        self.set(slot, RequestSampling())

    def params(self) -> SamplingParams:
        # Copies: JAX may alias host buffers on the CPU, and these arrays change next step.
        return SamplingParams(temperature=self.temperature.copy(), top_k=self.top_k.copy(),
                              top_p=self.top_p.copy(), seed=self.seed.copy(),
                              stop_ids=self.stop_ids.copy())


def _sample_filtered(logits: jax.Array, params: SamplingParams, step: jax.Array) -> jax.Array:
    rows, vocab = logits.shape
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    top_k = jnp.where(params.top_k > 0, params.top_k, vocab)
    keep = rank < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Nucleus: keep a token while the mass before it is below top_p (the first always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < params.top_p[:, None]
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(params.seed, step)
    choice = jax.vmap(jax.random.categorical)(keys, filtered)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    greedy = jnp.argmax(logits, axis=-1)
    return jnp.where(params.temperature > 0, sampled, greedy).astype(jnp.int32)


def sample(logits: jax.Array, params: SamplingParams, step: jax.Array) -> jax.Array:
    """Picks one token per row. `step` [rows] makes each draw distinct (use the position)."""
    greedy = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)  # noqa: E731
    return jax.lax.cond(
        jnp.any(params.temperature > 0),
        lambda: _sample_filtered(logits, params, step),
        greedy,
    )
