"""Several decode steps per dispatch: the engine's k-step program against k single steps, its
stop on the device, and the scheduler's choice of k against the sequential model."""

from __future__ import annotations

import numpy as np
import pytest

from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk
from cadence.model.host_sampling import RequestSampling, SamplingRows
from tests.serving import generate_gives_the_reference_text
from tests.fakes import (
    EOS, FakeEngine, Harness, chunked, prefill_first, run_random_load,
)

MULTI = EngineConfig(num_slots=4, max_seq_len=256, prefill_chunk=64, min_kv_bucket=64,
                     decode_steps=6)
PROMPTS = {0: [5, 6, 7, 8, 9], 2: list(range(30, 70)), 3: [11, 12]}  # slot 1 stays idle


def prefilled(shared_engine, rows: SamplingRows) -> tuple[Engine, np.ndarray, np.ndarray]:
    """An engine with PROMPTS prefilled, as new but for its programs (one shared engine, its
    pool emptied: each call hands back the same one); its page tables, and each slot's first
    position."""
    e = shared_engine(MULTI)
    tables = fixed_page_tables(MULTI)
    positions = np.zeros(MULTI.num_slots, np.int32)
    e.prefill([PrefillChunk(s, p, 0, True, tables[s]) for s, p in PROMPTS.items()], rows.params())
    for s, p in PROMPTS.items():
        positions[s] = len(p)
    return e, tables, positions


def pool(e: Engine) -> list[np.ndarray]:
    return [np.asarray(a) for a in e.cache.k + e.cache.v]


@pytest.mark.parametrize("temperature", [0.0, 20.0], ids=["greedy", "sampled"])
def test_steps_in_one_dispatch_equal_the_same_steps_one_at_a_time(shared_engine, temperature):
    """Tokens, logprobs and KV; beside a plain row, one with penalties (counting the tokens of
    the steps before it in the same dispatch) and logprobs, and one with a logit_bias."""
    rows = SamplingRows(MULTI.num_slots)
    rows.set(0, RequestSampling(temperature=temperature, seed=1))
    rows.set(2, RequestSampling(temperature=temperature, seed=3, presence_penalty=1.0,
                                frequency_penalty=0.5, repetition_penalty=1.3), logprobs=True)
    rows.set(3, RequestSampling(temperature=temperature, seed=4, logit_bias=((11, 2.0), (40, -3.0))),
             logprobs=True)
    active = np.isin(np.arange(MULTI.num_slots), list(PROMPTS))
    single, tables, positions = prefilled(shared_engine, rows)
    steps = [single.decode(positions + i, active, rows.params(), tables) for i in range(5)]
    one_at_a_time = np.stack([np.asarray(step)[0] for step in steps])
    lp_single = [step.logprobs() for step in steps]
    pool_single = pool(single)
    multi, _, _ = prefilled(shared_engine, rows)
    result = multi.decode(positions, active, rows.params(), tables, steps=5)
    together, lp = np.asarray(result), result.logprobs()
    assert together.shape == (5, MULTI.num_slots)
    np.testing.assert_array_equal(together, one_at_a_time)
    for i, step in enumerate(lp_single):
        for a, b in zip(lp, step):
            np.testing.assert_array_equal(a[i][[2, 3]], b[0][[2, 3]])
    for a, b in zip(pool(multi), pool_single):
        np.testing.assert_array_equal(a, b)
    if temperature:  # (the tiny model's logits are steep: greedy, or cool, repeats its input)
        assert len(set(together[:, 0].tolist())) > 1  # tokens that move, not one repeated


def test_a_row_ends_on_the_device_at_its_stop_id(shared_engine):
    """Slot 0 stops at a token it samples mid-dispatch: it writes no KV after it and reports
    the stop token from then on; the others run every step. A dispatch in which every row
    comes in stopped runs no step at all. (Sampled: the tiny model's greedy choice repeats.)"""
    rows = SamplingRows(MULTI.num_slots)
    for s in PROMPTS:
        rows.set(s, RequestSampling(temperature=20.0, seed=s + 7))
    free, tables, positions = prefilled(shared_engine, rows)
    active = np.isin(np.arange(MULTI.num_slots), list(PROMPTS))
    unstopped = np.asarray(free.decode(positions, active, rows.params(), tables, steps=6))
    run = unstopped[:, 0].tolist()
    stop_at = next(i for i in range(1, 6) if run[i] not in run[:i])  # its first sight of this id
    rows.set(0, RequestSampling(temperature=20.0, seed=7), stop_ids=[run[stop_at]])
    e, _, _ = prefilled(shared_engine, rows)
    before = pool(e)
    out = np.asarray(e.decode(positions, active, rows.params(), tables, steps=6))
    assert out[:, 0].tolist() == run[: stop_at + 1] + [run[stop_at]] * (5 - stop_at)
    np.testing.assert_array_equal(out[:, 2:], unstopped[:, 2:])
    after = pool(e)
    page, size = tables[0], MULTI.page_size
    written = {int(positions[0]) + i for i in range(stop_at + 1)}  # it consumed up to its stop
    for p in range(int(positions[0]), int(positions[0]) + 6):
        changed = [not np.array_equal(a[:, page[p // size], p % size], b[:, page[p // size], p % size])
                   for a, b in zip(before, after)]
        assert any(changed) == (p in written), p
    only_zero = np.arange(MULTI.num_slots) == 0
    held = pool(e)
    again = np.asarray(e.decode(positions + 6, only_zero, rows.params(), tables, steps=3))
    assert again[:, 0].tolist() == [run[stop_at]] * 3
    for a, b in zip(held, pool(e)):
        np.testing.assert_array_equal(a, b)


def test_a_dispatch_refuses_steps_it_cannot_run(shared_engine):
    rows = SamplingRows(MULTI.num_slots)
    e, tables, positions = prefilled(shared_engine, rows)
    active = np.arange(MULTI.num_slots) == 0
    with pytest.raises(ValueError, match=r"runs 1..6 steps \(decode_steps\), got 7"):
        e.decode(positions, active, rows.params(), tables, steps=7)
    with pytest.raises(ValueError, match="overflow max_seq_len=256"):
        e.decode(np.full(MULTI.num_slots, 252, np.int32), active, rows.params(), tables, steps=5)
    with pytest.raises(ValueError, match="decode_steps must be >= 1"):
        EngineConfig(decode_steps=0)


# --- the scheduler's k ---------------------------------------------------------------------


def steps_of(h: Harness) -> list[int]:
    return [c.steps for calls in h.steps for c in calls if hasattr(c, "steps")]


def test_several_steps_run_only_while_nothing_else_could():
    """One request alone decodes in dispatches of up to 4 steps, never past its max_tokens; a
    second one's prompt brings single steps back until it too is only decoding."""
    h = Harness(FakeEngine(num_slots=2, decode_steps=4))
    a = h.submit(list(range(10, 20)), max_tokens=15, ignore_eos=True)
    h.step(), h.step()  # its prompt, then its first dispatch of decode steps
    b = h.submit(list(range(40, 60)), max_tokens=10, ignore_eos=True)
    h.run()
    a.check(h.engine), b.check(h.engine)
    decodes = [(c.slots, c.steps) for calls in h.steps for c in calls if hasattr(c, "steps")]
    # a alone (14 to go): 4; beside b's prompt: 1; both (9 to go each): 4, 4; their last: 1
    assert decodes == [((0,), 4), ((0,), 1), ((0, 1), 4), ((0, 1), 4), ((0, 1), 1)]
    for calls in h.steps:  # a prompt in the iteration: one step
        if any(not hasattr(c, "steps") for c in calls):
            assert all(c.steps == 1 for c in calls if hasattr(c, "steps"))
    # a block's tokens reach the client in the same iteration
    per_step = {}
    for step, event in a.events:
        per_step[step] = per_step.get(step, 0) + len(event.token_ids)
    assert max(per_step.values()) == 4


def test_stop_strings_keep_single_steps():
    h = Harness(FakeEngine(num_slots=2, decode_steps=4))
    c = h.submit(list(range(10, 20)), max_tokens=12, ignore_eos=True, stop=("qqqq",))
    h.run()
    c.check(h.engine)
    assert set(steps_of(h)) == {1}


def test_eos_inside_a_dispatch_ends_the_request_there():
    """The script makes the third output EOS, in the middle of a 4-step dispatch: the device
    stops the row (the fake reports garbage after), the host never reads past it."""
    prompt = (3, 4, 5, 6)
    engine = FakeEngine(num_slots=2, decode_steps=4, script={prompt: [70, 71, EOS, 72, 73]})
    h = Harness(engine)
    c = h.submit(list(prompt), max_tokens=20)
    h.run()
    c.check(engine)
    assert c.record.finish_reason == "stop" and c.token_ids == [70, 71, EOS]
    assert steps_of(h)[0] == 4


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", [chunked(budget=100, chunk=32), prefill_first(chunk=32)],
                         ids=["chunked", "prefill-first"])
def test_random_arrivals_with_several_steps_match_sequential_model(policy, seed):
    """Random arrivals, seeded sampling, EOS and cancellations with up to 5 steps per
    dispatch, over a pool that holds one longest sequence, so requests are preempted too:
    each output still equals its lone simulation, and every page comes back."""
    rng = np.random.default_rng(seed)
    engine = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8, num_pages=32,
                        eos_one_in=40, decode_steps=5)
    h = Harness(engine, policy)
    arrivals = sorted(int(a) for a in rng.integers(0, 60, size=24))
    run_random_load(h, rng, arrivals, prompt_max=100, tokens_max=120, cancel_p=0.01, max_steps=20_000)
    for c in h.clients:
        c.check(h.engine)
    assert {c.record.finish_reason for c in h.clients} >= {"stop", "length"}
    assert max(steps_of(h)) == 5 and 1 in steps_of(h)
    assert h.sched.preemptions > 0
    assert h.sched.kv_pages == (0, engine.num_pages)


@pytest.mark.slow
def test_cadence_generate_with_several_steps_gives_the_reference_text(tiny_model_dir, tiny_params,
                                                                       tiny_config):
    generate_gives_the_reference_text(tiny_model_dir, tiny_params, tiny_config, "--decode_steps=4")
