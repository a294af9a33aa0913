"""Packing an iteration's prefill chunks into fixed-shape programs (host side, NumPy only).

    packs = pack_chunks(chunks, config)     # usually one Pack: every chunk in one program

The chunks the policy plans for one iteration (several requests' prompts, each at its own
offset) run as one program, so four short chats that arrive together read the weights once,
not four times. The chunks' tokens are laid along one axis, each chunk starting at a multiple
of the block size `B` (the smallest prefill bucket); the axis is then viewed as rows of `B`
tokens, [T / B, B], so every row belongs to exactly one chunk and carries that chunk's page
table. To the decoder a pack is a batch of rows like any other:

    tokens, positions   [rows, B]   a chunk's tokens at their absolute positions; -1 is padding
    lengths             [rows]      valid tokens per row (a chunk's last row may be partial)
    tables              [rows, W]   the row's sequence's pages (W: the pack's page bucket)

so the matmuls run over all T tokens together, KV writes go through each row's own table, and
attention stays causal within each chunk and over its own sequence's earlier pages (the Pallas
prefill kernel's grid is rows x KV heads x query blocks; the XLA path regroups a chunk's rows
into query tiles and walks their own pages, `model.paged_attention.paged_prefill_tiled`).
Padding costs at most B - 1 tokens per chunk. Two chunks of one sequence may share a pack: each
layer writes every row's KV before any row attends, so the later chunk sees the earlier one.

Per chunk (C = min(rows, max_chunks) entries, padded; max_chunks defaults to num_slots): `logit_index` (the flat index of its last
token), `steps` (the sampled token's position, the key of seeded sampling), `sampling_slot` (the
slot whose sampling row it uses) and `write_slot` (its slot when it is the prompt's last chunk,
so the sampled token becomes that slot's next decode input; `num_slots`, dropped, otherwise).

Chunks go into packs in order; a new pack starts only when the next chunk would overflow the
largest token bucket or the chunk capacity, which the scheduler's budgets normally prevent.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

from cadence.model.arith import cdiv


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """One chunk of one sequence's prompt: write `tokens` at positions [start, start+len) of
    the sequence whose pages, in order, are `pages` (enough for start+len tokens). With
    `final`, the sampled token is the request's first output and `slot`'s next decode input."""

    slot: int
    tokens: Sequence[int]
    start: int
    final: bool
    pages: Sequence[int]
    # Prompt logprobs (echo): the token after each position (-1 where none is known, as after
    # a prompt's last token); such a chunk runs in the scoring program, which gives each
    # position's logprob of its target and the alternatives (`PrefillTokens.scores`).
    targets: Sequence[int] | None = None
    # An embedding's chunk (`scheduler` pooling): it runs in the pooling program, which samples
    # nothing and gives the chunk's final hidden states summed, and its last one
    # (`PrefillTokens.pooled`).
    pooled: bool = False


@dataclasses.dataclass
class Pack:
    tokens: np.ndarray  # [rows, B] int32
    positions: np.ndarray  # [rows, B] int32, -1 for padding
    lengths: np.ndarray  # [rows] int32
    tables: np.ndarray  # [rows, W] int32
    logit_index: np.ndarray  # [C] int32
    steps: np.ndarray  # [C] int32
    sampling_slot: np.ndarray  # [C] int32, num_slots for padding
    write_slot: np.ndarray  # [C] int32, num_slots: writes nothing
    count: int  # real chunks (the first `count` of C)

    @property
    def shape(self) -> tuple[int, int]:
        """(tokens, page-table width): the program this pack runs."""
        return self.tokens.size, self.tables.shape[1]


def row_chunks(pack: Pack) -> np.ndarray:
    """[rows] int32: the index of the chunk each row of `pack` holds (its chunk count for the
    bucket's empty rows). A chunk's rows run up to the row of its last token (`logit_index`)."""
    block = pack.tokens.shape[1]
    last_rows = pack.logit_index[: pack.count] // block
    return np.searchsorted(last_rows, np.arange(len(pack.lengths))).astype(np.int32)


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """The smallest of the sorted `buckets` that holds `n`."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def padded(length: int, block: int) -> int:
    return cdiv(length, block) * block


def empty_pack(tokens: int, width: int, block: int, num_slots: int,
               max_chunks: int | None = None) -> Pack:
    """A pack of `tokens` tokens and page-table width `width` holding nothing (writes nothing,
    changes no slot): what warm-up runs, and what `pack_chunks` fills in."""
    rows = tokens // block
    chunks = min(rows, max_chunks or num_slots)
    return Pack(
        tokens=np.zeros((rows, block), np.int32),
        positions=np.full((rows, block), -1, np.int32),
        lengths=np.zeros(rows, np.int32),
        tables=np.zeros((rows, width), np.int32),
        logit_index=np.zeros(chunks, np.int32),
        steps=np.zeros(chunks, np.int32),
        sampling_slot=np.full(chunks, num_slots, np.int32),
        write_slot=np.full(chunks, num_slots, np.int32),
        count=0,
    )


def pack_chunks(
    chunks: Sequence[PrefillChunk], *, block: int, token_buckets: Sequence[int],
    page_buckets: Sequence[int], page_size: int, num_slots: int, max_chunks: int | None = None,
) -> list[Pack]:
    """Packs `chunks` (in order) into as few programs as the largest token bucket and
    `max_chunks` (default num_slots) chunks per program allow."""
    max_chunks = max_chunks or num_slots
    groups: list[list[PrefillChunk]] = [[]]
    used = 0
    for c in chunks:
        need = padded(len(c.tokens), block)
        group = groups[-1]
        if group and (used + need > token_buckets[-1] or len(group) == max_chunks):
            groups.append([])
            used = 0
        groups[-1].append(c)
        used += need
    return [_pack(g, block, token_buckets, page_buckets, page_size, num_slots, max_chunks)
            for g in groups if g]


def _pack(chunks, block, token_buckets, page_buckets, page_size, num_slots, max_chunks) -> Pack:
    total = sum(padded(len(c.tokens), block) for c in chunks)
    reach = max(cdiv(c.start + len(c.tokens), page_size) for c in chunks)
    pack = empty_pack(bucket_for(token_buckets, total), bucket_for(page_buckets, reach), block,
                      num_slots, max_chunks)
    flat_tokens, flat_positions = pack.tokens.reshape(-1), pack.positions.reshape(-1)
    row = 0
    for i, c in enumerate(chunks):
        n = len(c.tokens)
        at = row * block
        flat_tokens[at : at + n] = c.tokens
        flat_positions[at : at + n] = np.arange(c.start, c.start + n)
        rows = cdiv(n, block)
        pack.lengths[row : row + rows] = np.minimum(block, n - block * np.arange(rows))
        used = min(len(c.pages), pack.tables.shape[1])
        pack.tables[row : row + rows, :used] = np.asarray(c.pages[:used], np.int32)
        pack.logit_index[i] = at + n - 1
        pack.steps[i] = c.start + n
        pack.sampling_slot[i] = c.slot
        if c.final:
            pack.write_slot[i] = c.slot
        row += rows
    pack.count = len(chunks)
    return pack
