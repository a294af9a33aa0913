"""Packed prefill (every chunk of an iteration in one program) and KV handles (a sequence's KV
taken out of one engine and put into another), on the tiny model with XLA on the CPU, against
one-chunk-at-a-time prefill and the reference generator."""

from __future__ import annotations

import dataclasses
import random

import jax
import numpy as np
import pytest

from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk, pack_chunks
from cadence.engine.programs import sampling_rows
from cadence.engine.reference import greedy_generate
from cadence.engine.results import KVHandle
from cadence.model import cpu_kernels
from cadence.model.host_sampling import RequestSampling
from cadence.scheduler.pages import PageAllocator
from tests.conftest import compiled

CONFIG = EngineConfig(num_slots=4, max_seq_len=160, prefill_chunk=96, min_prefill_bucket=16,
                      min_kv_bucket=64, page_size=16)


def greedy_rows(config: EngineConfig):
    return sampling_rows([RequestSampling()] * config.num_slots)


def test_chunks_are_laid_out_in_rows_of_one_chunk_each():
    s = 4
    chunks = [PrefillChunk(0, list(range(1, 6)), 0, True, [7]),
              PrefillChunk(1, list(range(10, 30)), 37, False, [2, 9, 4, 5]),
              PrefillChunk(1, [40, 41, 42], 57, True, [2, 9, 4, 5])]
    (pack,) = pack_chunks(chunks, block=16, token_buckets=(16, 32, 64), page_buckets=(4, 8),
                          page_size=16, num_slots=s)
    assert pack.shape == (64, 4) and pack.count == 3
    assert pack.lengths.tolist() == [5, 16, 4, 3]
    assert pack.positions[0, :6].tolist() == [0, 1, 2, 3, 4, -1]
    assert pack.positions[1].tolist() == list(range(37, 53))
    assert pack.positions[2, :5].tolist() == [53, 54, 55, 56, -1]
    assert pack.tokens[2, :4].tolist() == [26, 27, 28, 29]
    assert pack.positions[3, :4].tolist() == [57, 58, 59, -1]
    assert pack.tables[:, 0].tolist() == [7, 2, 2, 2] and pack.tables[1].tolist() == [2, 9, 4, 5]
    assert pack.logit_index.tolist()[:3] == [4, 35, 50]  # each chunk's last token, flat
    assert pack.steps.tolist()[:3] == [5, 57, 60]
    assert pack.write_slot.tolist() == [0, s, 1, s]  # only prompts' last chunks set a slot
    assert pack.sampling_slot.tolist() == [0, 1, 1, s]


def test_chunks_that_overflow_the_largest_bucket_go_in_order_into_more_programs():
    chunks = [PrefillChunk(i, [5] * n, 0, True, [i]) for i, n in enumerate([17, 20, 30])]
    packs = pack_chunks(chunks, block=16, token_buckets=(16, 32, 64), page_buckets=(4,),
                        page_size=16, num_slots=4)
    # 32 + 32 padded tokens fill 64; the third chunk needs a program of its own.
    assert [p.count for p in packs] == [2, 1] and [p.shape[0] for p in packs] == [64, 32]
    assert packs[1].sampling_slot[0] == 2


def _plans(rng: random.Random, vocab: int):
    """Prompts and the chunks that prefill them, in rounds of one chunk per prompt (as the
    chunked policy plans), with lengths that start chunks at odd offsets, end one exactly on a
    page boundary, and put a 1-token chunk in; the last round also carries two chunks of one
    prompt."""
    lengths = [37, 16, 90, 5]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    cuts = {0: [21, 16], 1: [16], 2: [1, 40, 31, 18], 3: [5]}  # 2: 1 + 40 + 31 + 18 = 90
    rounds, at = [], {i: 0 for i in cuts}
    for r in range(3):
        chunks = []
        for i, sizes in cuts.items():
            take = sizes[r:r + 1] if r < 2 else sizes[2:]  # round 2: what is left, maybe two
            for n in take:
                chunks.append((i, at[i], n))
                at[i] += n
        rounds.append(chunks)
    assert all(at[i] == len(prompts[i]) for i in cuts)
    return prompts, rounds


def _prefill(engine, prompts, rounds, tables, packed: bool):
    tokens = {}
    for chunks in rounds:
        calls = [chunks] if packed else [[c] for c in chunks]
        for call in calls:
            batch = [PrefillChunk(i, prompts[i][start:start + n], start, start + n == len(prompts[i]),
                                  tables[i]) for i, start, n in call]
            result = engine.prefill(batch, greedy_rows(engine.config))
            assert result.programs == 1
            for (i, start, n), token in zip(call, np.asarray(result)):
                tokens[(i, start)] = int(token)
    return tokens


@pytest.mark.parametrize("kernels", [pytest.param("xla", marks=pytest.mark.slow), "cpu"])
def test_packed_prefill_equals_one_chunk_at_a_time_and_the_reference(tiny_params, tiny_config, shared_engine,
                                                                     kernels):
    """On the CPU kernels too, whose matmuls compute a pack's positions up to its last token
    (`cpu_kernels.live_rows`): chunks of a few tokens alone, and several in a pack whose last
    row is partial."""
    if kernels == "cpu" and not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    config = CONFIG if kernels == "xla" else dataclasses.replace(CONFIG, attention="cpu", decode_matmul="cpu")
    rng = random.Random(11)
    prompts, rounds = _plans(rng, tiny_config.vocab_size)
    order = np.random.default_rng(3).permutation(config.pool_pages)
    tables = order[: config.num_slots * config.max_pages_per_seq].reshape(config.num_slots, -1)
    results = {}
    for packed in (False, True):
        e = shared_engine(config)  # as new each time: an empty pool
        tokens = _prefill(e, prompts, rounds, tables, packed)
        pool = [np.asarray(a) for a in e.cache.k + e.cache.v]
        outputs = [[] for _ in prompts]
        positions = np.asarray([len(p) for p in prompts], np.int32)
        for _ in range(6):
            at = positions + np.asarray([len(o) for o in outputs], np.int32)
            step = np.asarray(e.decode(at, np.ones(4, bool), greedy_rows(config), tables))[0]
            for i in range(4):
                outputs[i].append(int(step[i]))
        results[packed] = tokens, pool, outputs
    (alone, pool_alone, out_alone), (packed, pool_packed, out_packed) = results[False], results[True]
    assert packed == alone  # every chunk's sampled token, not only the prompts' last ones
    for a, b in zip(pool_alone, pool_packed):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for i, prompt in enumerate(prompts):
        want = greedy_generate(tiny_params, tiny_config, prompt, 7)
        last_start = max(s for (j, s) in packed if j == i)
        assert [packed[(i, last_start)]] + out_packed[i] == want
        assert out_alone[i] == out_packed[i]


def test_a_kv_handle_moves_a_sequence_to_another_engine(tiny_params, tiny_config, shared_engine):
    """Prefill and decode on engine A, extract, insert into engine B (a smaller pool, other
    pages, another slot), decode on B: the same tokens as decoding on A, which are the
    reference generator's. A handle that does not fit is refused and stays usable."""
    a = shared_engine(CONFIG)
    b = Engine(tiny_params, tiny_config, EngineConfig(**{**CONFIG.__dict__, "num_pages": 14}))
    rng = random.Random(12)
    prompt = [rng.randrange(3, tiny_config.vocab_size) for _ in range(48)]  # 3 pages exactly
    want = greedy_generate(tiny_params, tiny_config, prompt, 12)
    pages_a, slot_a = [9, 2, 30, 17, 5], 3
    table_a = np.zeros((4, CONFIG.max_pages_per_seq), np.int32)
    table_a[slot_a, :len(pages_a)] = pages_a
    first = a.prefill([PrefillChunk(slot_a, prompt, 0, True, pages_a)], greedy_rows(CONFIG))
    got_a, position = [int(np.asarray(first)[0])], len(prompt)

    def decode(engine, slot, table, steps):
        nonlocal position
        out = []
        for _ in range(steps):
            positions = np.zeros(4, np.int32)
            positions[slot] = position
            out.append(int(np.asarray(engine.decode(positions, np.arange(4) == slot,
                                                    greedy_rows(engine.config), table))[0, slot]))
            position += 1
        return out

    got_a += decode(a, slot_a, table_a, 3)  # 48 + 3 tokens of KV: the last page is partial
    handle = a.extract(pages_a, position, slot_a)
    assert isinstance(handle, KVHandle) and handle.length == 51 and handle.num_pages == 4
    itemsize = np.dtype(CONFIG.dtype).itemsize
    assert handle.nbytes == (2 * tiny_config.num_layers * tiny_config.num_kv_heads * 4 * 16
                             * tiny_config.head_dim * itemsize)
    saved = position
    rest_a = decode(a, slot_a, table_a, 8)

    allocator = PageAllocator(b.num_pages, CONFIG.page_size)
    hog = []
    assert allocator.grow(hog, 12 * 16) is not None  # 12 of 14 pages taken: 2 left
    pages_b: list[int] = []
    assert allocator.grow(pages_b, handle.length) is None and pages_b == []  # the pool is full
    with pytest.raises(ValueError, match="cannot hold"):
        b.insert(handle, [13, 12], slot=1)
    allocator.release(hog)
    assert allocator.grow(pages_b, handle.length) is not None
    slot_b = 1
    b.insert(handle.to(jax.devices()[0]), pages_b, slot_b)
    table_b = np.zeros((4, CONFIG.max_pages_per_seq), np.int32)
    table_b[slot_b, :len(pages_b)] = pages_b
    assert allocator.grow(pages_b, saved + 8) is not None  # room to decode on B
    table_b[slot_b, :len(pages_b)] = pages_b
    position = saved
    rest_b = decode(b, slot_b, table_b, 8)
    assert rest_b == rest_a
    assert got_a + rest_a == want
    with pytest.raises(ValueError, match="does not fit"):
        Engine(tiny_params, tiny_config, EngineConfig(**{**CONFIG.__dict__, "page_size": 8})).insert(
            handle, list(range(8)), 0)


def test_warm_engines_compile_nothing_to_pack_extract_or_insert(tiny_params, tiny_config):
    cfg = EngineConfig(num_slots=4, max_seq_len=64, prefill_chunk=32, min_prefill_bucket=16,
                       min_kv_bucket=32, page_size=16)
    e = Engine(tiny_params, tiny_config, cfg)
    e.warmup(warmup="needed")
    compiled(e, "transfer")  # extract and insert, with prefill what this test runs
    rng = random.Random(13)
    prompts = [[rng.randrange(3, tiny_config.vocab_size) for _ in range(n)] for n in (3, 32, 20, 9)]
    tables = np.arange(cfg.num_slots * cfg.max_pages_per_seq).reshape(cfg.num_slots, -1)
    before = e.compilations_after_warmup
    for size in (1, 2, 4):  # packs of every token bucket, one and several chunks
        chunks = [PrefillChunk(i, p, 0, True, tables[i]) for i, p in enumerate(prompts[:size])]
        np.asarray(e.prefill(chunks, greedy_rows(cfg)))
    for length in (1, 16, 17, 33, 64):  # every page-count bucket
        handle = e.extract(tables[0], length, 0)
        e.insert(handle, tables[1], 1)
    jax.block_until_ready(e.cache)
    assert e.compilations_after_warmup - before == 0
