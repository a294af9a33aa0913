"""Token bitmasks on the device (structured output's half in the engine): the mask stage
against NumPy, and the split decode step (forward, then sampling with a bitmask) against the
fused one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk
from cadence.engine.programs import sampling_rows
from cadence.model.host_sampling import ALL_ALLOWED, RequestSampling, all_allowed, bitmask_words
from cadence.model.sampling import SamplingParams, TokenHistory, apply_bitmask, choose
from tests.conftest import SMALL_ENGINE, compiled

VOCAB = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary


def bitmask_of(allowed_ids: list[list[int]], vocab: int = VOCAB) -> np.ndarray:
    """[rows, words] int32 bitmasks allowing exactly these ids per row (None: every id)."""
    mask = np.zeros((len(allowed_ids), bitmask_words(vocab)), np.uint32)
    for row, ids in enumerate(allowed_ids):
        if ids is None:
            mask[row] = 0xFFFFFFFF
        for i in ids or ():
            mask[row, i // 32] |= np.uint32(1 << (i % 32))
    return mask.view(np.int32)


def numpy_masked(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
    return np.where(bits == 1, logits, -np.inf)


def test_bitmask_forbids_exactly_the_cleared_bits():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, VOCAB)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, (5, bitmask_words(VOCAB)), dtype=np.int64).astype(np.int32)
    mask[2] = ALL_ALLOWED  # an unconstrained row beside constrained ones
    mask[3] = bitmask_of([[31, 32, 63, 99]])[0]  # bits at the words' edges, sign bit included
    got = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, numpy_masked(logits, mask))
    np.testing.assert_array_equal(got[2], logits[2])
    assert np.flatnonzero(np.isfinite(got[3])).tolist() == [31, 32, 63, 99]


def test_unconstrained_rows_choose_as_without_a_mask():
    """All-ones masks change nothing: tokens and logprobs bit-identical, greedy and sampled."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((4, VOCAB)).astype(np.float32) * 3)
    params = SamplingParams.make([0.0, 0.9, 1.3, 0.0], [0, 20, 0, 0], [1.0, 0.8, 1.0, 1.0], [0, 7, 9, 0])
    history = TokenHistory.create(4, VOCAB, 8)
    slots, step = jnp.arange(4), jnp.full(4, 5)
    plain = choose(logits, params, history, slots, step, 3)
    masked = choose(logits, params, history, slots, step, 3, jnp.asarray(all_allowed(4, VOCAB)))
    jax.tree.map(np.testing.assert_array_equal, plain, masked)


def test_constrained_rows_draw_only_allowed_tokens():
    rng = np.random.default_rng(2)
    rows = 64
    logits = jnp.asarray(rng.standard_normal((rows, VOCAB)).astype(np.float32) * 4)
    allowed_ids = [sorted(rng.choice(VOCAB, rng.integers(1, 6), replace=False).tolist()) for _ in range(rows)]
    mask = jnp.asarray(bitmask_of(allowed_ids))
    temperature = [0.0 if i % 4 == 0 else 1.5 for i in range(rows)]
    params = SamplingParams.make(temperature, [0] * rows, [1.0] * rows, list(range(rows)))
    tokens, _, _ = choose(logits, params, TokenHistory.create(rows, VOCAB, 8), jnp.arange(rows),
                       jnp.zeros(rows, jnp.int32), 0, mask)
    for row, token in enumerate(np.asarray(tokens).tolist()):
        assert token in allowed_ids[row]
        if temperature[row] == 0:  # greedy: the likeliest allowed token
            assert token == max(allowed_ids[row], key=lambda i: float(logits[row, i]))


CONFIG = EngineConfig(**SMALL_ENGINE)
PROMPTS = {0: [5, 9, 11, 40, 2, 77], 1: [8, 8, 3], 3: list(range(20, 80))}
SAMPLED = RequestSampling(temperature=0.9, top_k=40, seed=3)


@pytest.fixture
def fresh(shared_engine):
    """`fresh()`: the engine of CONFIG, warm, as new (an empty pool, no step pending): one
    engine, handed back again for each run a test compares (test_engine.py's too; the split
    step compiles on first use)."""
    return lambda: shared_engine(CONFIG, "needed")


def start(engine, rows, allowed=None) -> tuple[np.ndarray, np.ndarray]:
    tables = fixed_page_tables(engine.config)
    first = engine.prefill([PrefillChunk(s, p, 0, True, tables[s]) for s, p in PROMPTS.items()],
                           rows, allowed)
    positions = np.zeros(CONFIG.num_slots, np.int32)
    for s, p in PROMPTS.items():
        positions[s] = len(p)
    return np.asarray(first), positions


def test_split_decode_equals_the_fused_step(fresh, tiny_config):
    """forward + sample (every token allowed) gives the fused program's tokens and logprobs,
    greedy and sampled rows together, step after step; and compiles nothing after warm-up."""
    specs = [RequestSampling(), SAMPLED, RequestSampling(), RequestSampling(temperature=1.2, seed=8)]
    rows = sampling_rows(specs)
    rows = rows._replace(logprobs=np.asarray([True, True, False, False]))
    tables = fixed_page_tables(CONFIG)
    active = np.zeros(CONFIG.num_slots, bool)
    active[list(PROMPTS)] = True
    everything = all_allowed(CONFIG.num_slots, tiny_config.vocab_size)
    compiled(fresh(), "structured")

    def run(split: bool):
        engine = fresh()
        before = engine.compilations_after_warmup
        first, positions = start(engine, rows)
        out = [first]
        for _ in range(12):
            if split:
                engine.decode_forward(positions, active, rows, tables)
                step = engine.decode_sample(everything)
            else:
                step = engine.decode(positions, active, rows, tables)
            out.append((np.asarray(step), step.logprobs()))
            positions = positions + active
        assert engine.compilations_after_warmup == before
        return out

    fused, split = run(False), run(True)
    np.testing.assert_array_equal(fused[0], split[0])
    for (a, a_lp), (b, b_lp) in zip(fused[1:], split[1:]):
        np.testing.assert_array_equal(a, b)
        jax.tree.map(np.testing.assert_array_equal, a_lp, b_lp)


def test_bitmasks_constrain_prefill_and_decode(fresh, tiny_config):
    engine = fresh()
    vocab = tiny_config.vocab_size
    rows = sampling_rows([SAMPLED] * CONFIG.num_slots)
    tables = fixed_page_tables(CONFIG)
    active = np.zeros(CONFIG.num_slots, bool)
    active[list(PROMPTS)] = True
    choices = {0: [7], 1: [10, 11, 12], 3: None}  # slot 3 unconstrained
    ids = [choices.get(s, None) for s in range(CONFIG.num_slots)]
    allowed = bitmask_of(ids, vocab)
    first, positions = start(engine, rows, allowed)
    assert first[0] == 7 and first[1] in (10, 11, 12)
    for step in range(6):
        ids = [[(step * 13 + s) % vocab, 99] if s != 3 else None for s in range(CONFIG.num_slots)]
        engine.decode_forward(positions, active, rows, tables)
        tokens = np.asarray(engine.decode_sample(bitmask_of(ids, vocab)))[0]
        for s in (0, 1):
            assert tokens[s] in ids[s]
        positions = positions + active


def test_a_dropped_row_takes_no_token(fresh, tiny_config):
    """decode_sample's `drop`: a slot whose request ended while the forward ran keeps its last
    token; the others sample as ever."""
    rows = sampling_rows([RequestSampling()] * CONFIG.num_slots)
    tables = fixed_page_tables(CONFIG)
    active = np.zeros(CONFIG.num_slots, bool)
    active[list(PROMPTS)] = True
    everything = all_allowed(CONFIG.num_slots, tiny_config.vocab_size)

    def step(drop):
        engine = fresh()
        first, positions = start(engine, rows)
        engine.decode_forward(positions, active, rows, tables)
        return first, np.asarray(engine.decode_sample(everything, drop=drop))[0]

    first, kept = step([1])
    _, full = step([])
    assert kept[1] == first[1] and kept[0] == full[0] and kept[3] == full[3]


def test_the_halves_come_in_order(fresh, tiny_params, tiny_config):
    engine = fresh()
    rows = sampling_rows([RequestSampling()] * CONFIG.num_slots)
    tables = fixed_page_tables(CONFIG)
    active = np.asarray([True, False, False, False])
    positions = np.asarray([len(PROMPTS[0]), 0, 0, 0], np.int32)
    with pytest.raises(ValueError, match="without a decode_forward"):
        engine.decode_sample(all_allowed(CONFIG.num_slots, tiny_config.vocab_size))
    engine.decode_forward(positions, active, rows, tables)
    with pytest.raises(ValueError, match="decode_forward twice"):
        engine.decode_forward(positions, active, rows, tables)
    with pytest.raises(ValueError, match="still to run"):
        engine.decode(positions, active, rows, tables)
    with pytest.raises(ValueError, match="int32"):
        engine.decode_sample(np.zeros((CONFIG.num_slots, 3), np.int32))
    plain = Engine(tiny_params, tiny_config, EngineConfig(num_slots=2, max_seq_len=64, prefill_chunk=16))
    with pytest.raises(ValueError, match="structured_output"):
        plain.decode_forward(positions[:2], active[:2], sampling_rows([RequestSampling()] * 2),
                             np.zeros((2, 1), np.int32))
