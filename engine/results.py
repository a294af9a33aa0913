"""What the engine's calls return: handles and results the host reads one step later.

    handle = engine.extract(pages, length, slot)   # `KVHandle`: a sequence's KV + next token
    tokens = engine.prefill(...)                   # `PrefillTokens`: each chunk's token
    tokens = engine.decode(...)                    # `DecodeTokens`: [steps, num_slots]
    np.asarray(tokens); tokens.logprobs()          # waits for the program; `HostLogprobs`

They hold device arrays (JAX's) until read, but this module imports JAX only inside the methods
that move or wait for them, so the engine's contract (`engine.api`) and the scheduler, which
only read them through NumPy, import no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from cadence.model.arith import cdiv

if TYPE_CHECKING:
    import jax

    from cadence.model.sampling import Logprobs


@dataclasses.dataclass(frozen=True)
class KVHandle:
    """One sequence's KV outside any engine: what `Engine.extract` returns and `Engine.insert`
    takes, on this engine, another one, or another device (`to`). Plain arrays and metadata:

        k, v        [layers, kv_heads, P, page_size, head_dim]  the sequence's pages in order;
                    P is a page-count bucket, pages past `num_pages` are padding
        next_token  [] int32   the token its next decode step consumes (sampled, not yet in KV)
        length      tokens of KV the pages hold (positions 0..length-1)
    """

    k: jax.Array
    v: jax.Array
    next_token: jax.Array
    length: int
    page_size: int

    @property
    def num_pages(self) -> int:
        return cdiv(self.length, self.page_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the live pages (what a transfer must move; the bucket's padding excluded)."""
        layers, heads, _, page_size, head_dim = self.k.shape
        return 2 * layers * heads * self.num_pages * page_size * head_dim * self.k.dtype.itemsize

    def to(self, device, token_device=None) -> KVHandle:
        """The same handle with its arrays on `device` (or a sharding of the pages, with the
        next token on `token_device`): `jax.device_put`, so the copy is asynchronous and
        overlaps whatever runs meanwhile."""
        import jax

        k, v = jax.device_put((self.k, self.v), device)
        token = jax.device_put(self.next_token, token_device or device)
        return dataclasses.replace(self, k=k, v=v, next_token=token)

    def block_until_ready(self) -> KVHandle:
        import jax

        jax.block_until_ready((self.k, self.v, self.next_token))
        return self

    def is_ready(self) -> bool:
        """Whether its arrays are computed (or copied) already; never waits."""
        return all(a.is_ready() for a in (self.k, self.v, self.next_token))

    def to_host_async(self) -> None:
        """Starts copying its pages to host memory (`host_pages` then waits for less)."""
        for a in (self.k, self.v):
            a.copy_to_host_async()

    def host_pages(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Its live pages on the host, each (k, v) [layers, kv_heads, page_size, head_dim], owning
        their memory (the bucket's array is not kept alive by them). Waits for the arrays."""
        k, v = np.asarray(self.k), np.asarray(self.v)
        return [(k[:, :, i].copy(), v[:, :, i].copy()) for i in range(self.num_pages)]

    @classmethod
    def from_host_pages(cls, pages: list[tuple[np.ndarray, np.ndarray]], page_size: int,
                        width: int) -> KVHandle:
        """A handle of `pages` (as `host_pages` gives them), stacked in order and padded to
        `width` pages (a page-count bucket), for `Engine.insert` with no slot."""
        k = np.zeros((*pages[0][0].shape[:2], width, *pages[0][0].shape[2:]), pages[0][0].dtype)
        v = np.zeros_like(k)
        for i, (page_k, page_v) in enumerate(pages):
            k[:, :, i], v[:, :, i] = page_k, page_v
        return cls(k=k, v=v, next_token=np.int32(0), length=len(pages) * page_size, page_size=page_size)


class HostLogprobs(NamedTuple):
    """`Logprobs` as read to the host: token [...], ids and values [..., max_logprobs]."""

    token: np.ndarray
    ids: np.ndarray
    values: np.ndarray


class HostScores(NamedTuple):
    """A scored chunk's ranked `Logprobs` as read to the host: token and rank [n], ids and
    values [n, max_logprobs]."""

    token: np.ndarray
    ids: np.ndarray
    values: np.ndarray
    rank: np.ndarray


def _read_logprobs(logprobs: Logprobs, rows: slice) -> HostLogprobs:
    return HostLogprobs(*(np.asarray(a)[rows] for a in (logprobs.token, logprobs.ids, logprobs.values)))


def _read_scores(logprobs: Logprobs, rows: slice) -> HostScores:
    return HostScores(*_read_logprobs(logprobs, rows), np.asarray(logprobs.rank)[rows])


class PrefillTokens:
    """What `Engine.prefill` returns: each chunk's sampled token, on the device until read.
    `np.asarray(result)` waits for the programs and gives [len(chunks)] int32 (-1 for a pooled
    chunk);
    `result.logprobs()` the chunks' `HostLogprobs` (zeros unless a chunk's row asked);
    `result.scores()` each scored chunk's (`PrefillChunk.targets`) by its index, position by
    position (`HostScores`); `result.pooled()` each pooled chunk's
    (`PrefillChunk.pooled`, which samples no token) by its index: the sum of its positions'
    final hidden states and its last position's, [D] float32 each."""

    def __init__(self, parts: list[tuple[jax.Array, int]], logprobs: list[Logprobs] = (),
                 order: list[int] | None = None, scores: dict[int, tuple[Logprobs, int]] | None = None,
                 pooled: dict[int, tuple[tuple[jax.Array, jax.Array], int]] | None = None):
        self._parts = parts  # (a program's tokens [C], how many of them are real chunks)
        self._logprobs = list(logprobs)  # each program's
        self._order = order  # the chunk index of each token the programs give, in their order
        self._scores = scores or {}
        self._pooled = pooled or {}  # chunk index: (its program's (sums, lasts), its row there)

    def _in_order(self, a: np.ndarray) -> np.ndarray:
        """Per chunk of the call: a pooled chunk's entry (it samples no token) is -1."""
        if self._order is None:
            return a
        out = np.full((len(self),) + a.shape[1:], -1, a.dtype)
        out[np.asarray(self._order, np.int64)] = a
        return out

    def scores(self) -> dict[int, HostScores]:
        return {i: _read_scores(lp, slice(0, n)) for i, (lp, n) in self._scores.items()}

    def pooled(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        return {i: (np.asarray(sums)[row], np.asarray(lasts)[row])
                for i, ((sums, lasts), row) in self._pooled.items()}

    @property
    def programs(self) -> int:
        return len(self._parts) + len({id(p) for p, _ in self._pooled.values()})

    def __len__(self) -> int:
        return sum(n for _, n in self._parts) + len(self._pooled)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self._pooled:  # read as the tokens are: the programs have run once this returns
            self.block_until_ready()
        tokens = [np.asarray(a)[:n] for a, n in self._parts]
        out = self._in_order(np.concatenate(tokens) if tokens else np.zeros(0, np.int32))
        return out if dtype is None else out.astype(dtype)

    def block_until_ready(self) -> PrefillTokens:
        import jax

        jax.block_until_ready(([a for a, _ in self._parts], [p for p, _ in self._pooled.values()]))
        return self

    def logprobs(self) -> HostLogprobs:
        parts = [_read_logprobs(lp, slice(0, n)) for lp, (_, n) in zip(self._logprobs, self._parts)]
        return HostLogprobs(*(self._in_order(np.concatenate(a)) for a in zip(*parts)))


class DecodeTokens:
    """What `Engine.decode` returns: every slot's token after each step, on the device until
    read. `np.asarray(result)` waits for the program and gives [steps, num_slots] int32.
    `Engine.verify`'s also says how many tokens each slot emitted (`emitted()`, [num_slots]):
    the first that many entries of its column."""

    def __init__(self, tokens: jax.Array, steps: int, logprobs: Logprobs | None = None,
                 emitted: jax.Array | None = None):
        self._tokens = tokens  # [decode_steps, num_slots]: the program's whole buffer
        self.steps = steps
        self._logprobs = logprobs
        self._emitted = emitted

    def emitted(self) -> np.ndarray:
        """[num_slots] int32: each slot's tokens this call gave (a verify step's; a decode
        call's are `steps` for every slot it ran, up to a stop id)."""
        if self._emitted is None:
            raise ValueError("a decode call's result: every row ran its steps")
        return np.asarray(self._emitted)

    def logprobs(self) -> HostLogprobs:
        """[steps, num_slots] (and [..., max_logprobs]): each step's, per slot."""
        return _read_logprobs(self._logprobs, slice(0, self.steps))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.asarray(self._tokens)[: self.steps]
        return out if dtype is None else out.astype(dtype)

    def block_until_ready(self) -> DecodeTokens:
        self._tokens.block_until_ready()
        return self

