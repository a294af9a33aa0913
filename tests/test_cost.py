"""The fitted cost of an iteration (`scheduler.cost`) and the prefill it sizes to an
inter-token target: the model alone, the policy's cap, and the scheduler over a fake device
whose programs take time."""

import numpy as np
import pytest

from cadence.scheduler.config import SchedulerConfig
from cadence.scheduler.cost import IterationCost, Work
from cadence.scheduler.policy import PolicyConfig, PrefillLimit, make_plan
from cadence.scheduler.priority import SLO
from cadence.scheduler.request import GenerationParams, Request, State
from tests.fakes import TOK, Decode, FakeEngine, Harness, Prefill, chunked, random_prompt

TRUE = (0.01, 0.003, 0.002, 0.001, 0.0005)  # base, per row, per 1k keys, per token, per 1k pairs


def _seconds(work: Work, c=TRUE) -> float:
    return float(np.dot(c, work.features()))


def _fed(works, c=TRUE, block=16) -> IterationCost:
    """A model fed plans run one after another, each taking what `c` says."""
    cost, t = IterationCost(block=block), 0.0
    for w in works:
        cost.dispatched(w, t)
        t += _seconds(w, c)
        cost.ready(t)
    return cost


def _random_works(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Work(int(rng.integers(0, 8)), int(rng.integers(0, 8000)), int(rng.integers(0, 9)) * 16,
                 int(rng.integers(0, 400_000))) for _ in range(n)]


def test_a_plan_is_timed_from_when_the_device_could_start_it():
    cost = IterationCost()
    a, b, c = Work(prefill_tokens=1), Work(prefill_tokens=2), Work(prefill_tokens=3)
    cost.dispatched(a, 0.0)
    cost.dispatched(b, 0.01)  # queued behind a: it starts when a's results are in
    cost.ready(0.30)
    cost.ready(0.45)
    cost.dispatched(None, 0.5)  # several decode steps: takes the device, is not learned from
    cost.ready(0.8)
    cost.dispatched(c, 1.0)  # the device was idle: from its own dispatch
    cost.ready(1.1)
    cost.ready(2.0)  # nothing in flight: ignored
    assert [(w, round(s, 6)) for w, s in cost.timings] == [(a, 0.3), (b, 0.15), (c, 0.1)]
    cost.dispatched(a, 3.0)
    cost.forget_in_flight()  # a failed iteration: its results never come
    cost.ready(3.5)
    assert len(cost.timings) == 3


def test_a_quiet_spell_of_decoding_alone_keeps_what_prefill_costs():
    """Plans with prefill and plans without are kept apart: many decode-only iterations after
    a document leave the model, and its prefill coefficients, standing."""
    works = _random_works(40)
    cost = _fed(works + [Work(decode_rows=4, decode_keys=1000)] * 600)
    np.testing.assert_allclose(cost.coefficients(), TRUE, rtol=1e-6)


def test_the_fit_recovers_the_line_and_keeps_every_coefficient_non_negative():
    works = _random_works(40)
    assert _fed(works[:7]).coefficients() is None  # too few plans yet
    assert _fed([Work(decode_rows=4)] * 20).coefficients() is None  # no prefill among them
    np.testing.assert_allclose(_fed(works).coefficients(), TRUE, rtol=1e-6)
    # Keys that seem to save time (noise correlated with them): dropped, the rest refitted.
    negative = (0.01, 0.003, -0.0005, 0.001, 0.0005)
    fitted = _fed(works, negative).coefficients()
    assert fitted[2] == 0 and (fitted >= 0).all()
    cost = _fed(works)
    assert cost.predict(Work(4, 2048, 64, 0)) == pytest.approx(0.01 + 0.012 + 0.004 + 0.064)
    # Chunks: their padded tokens and their attention's pairs.
    assert cost.prefill([(3000, 50), (0, 10)]) == pytest.approx(0.001 * 80 + 0.0005 * (50 * 3050 + 100) / 1024)


def test_prefill_is_counted_as_the_programs_that_run_it():
    cost = IterationCost(block=16, buckets=(16, 32, 64, 128, 144))
    assert cost.program_tokens([(0, 50), (0, 20)]) == 128  # 64 + 32 padded: a 128-token program
    assert cost.program_tokens([(0, 130)]) == 144
    assert cost.program_tokens([(0, 144), (0, 144), (0, 1)]) == 2 * 144 + 16  # three programs
    assert cost.program_tokens([]) == 0


def _request(tokens, state="PREFILLING", prefilled=0, priority=0, output=0):
    r = Request([5] * tokens, GenerationParams(), 16, TOK, emit=lambda e: None, priority=priority)
    r.state, r.prefilled, r.dispatched = State[state], prefilled, output
    return r


def test_prefill_seconds_are_what_the_decodes_leave_of_the_target():
    cost = _fed(_random_works(40))
    chats = [_request(100, "DECODING", 100, output=24) for _ in range(4)]
    decode = 0.01 + 4 * 0.003 + 0.002 * 4 * 124 / 1024
    assert cost.prefill_seconds(0.2, chats) == pytest.approx(0.2 - decode)
    assert cost.prefill_seconds(0.01, chats) == 0.0
    assert IterationCost().prefill_seconds(0.2, chats) is None


def _plan(running, limit, budget=256, chunk=256):
    config = PolicyConfig(token_budget=budget, chunk=chunk, pack_block=16, lower_share=0.25)
    plan = make_plan(running, [], 8 - len(running), config, limit=limit)
    return {r: sum(c.length for c in plan.prefill if c.request is r) for r in running if r.state is State.PREFILLING}


def test_a_target_for_everyone_caps_every_prompt_and_shrinks_chunks_deep_in_a_long_one():
    cost = _fed(_random_works(40))
    chat = _request(10, "DECODING", 10)
    start, deep = _request(3000), _request(3000, prefilled=2800)
    limit = PrefillLimit(None, 0.1, cost.prefill)
    alone = _plan([chat, start], limit)[start]
    # The most whole blocks within the 0.1 s: one more block would not fit.
    assert cost.prefill([(0, alone)]) <= 0.1 < cost.prefill([(0, alone + 16)])
    # Deep in the prompt its attention takes most of the share: fewer tokens than at its start.
    assert 0 < _plan([chat, deep], limit)[deep] < alone
    both = _plan([chat, start, deep], limit)
    assert cost.prefill([(0, both[start]), (2800, both[deep])]) <= 0.1
    # Past the target, still a block an iteration: prompts always move.
    assert _plan([chat, start], PrefillLimit(None, 0.0, cost.prefill)) == {start: 16}
    assert _plan([chat, start], None) == {start: 240}


def test_an_itl_limit_caps_the_worse_priorities_prefill_never_below_the_floor():
    per_token = lambda chunks: 0.001 * sum(n for _, n in chunks)  # noqa: E731
    chat = _request(10, "DECODING", 10)
    doc, other = _request(3000, priority=1), _request(3000, priority=2)
    assert _plan([chat, doc], None) == {doc: 255 // 16 * 16}
    assert _plan([chat, doc], PrefillLimit(0, 0.1, per_token)) == {doc: 96}
    floor = int(255 * 0.25) // 16 * 16  # 48: the cap never goes below the starvation floor
    assert _plan([chat, doc], PrefillLimit(0, 0.01, per_token)) == {doc: floor}
    assert _plan([chat, doc], PrefillLimit(1, 0.01, per_token)) == {doc: 240}  # not below the limit
    # Two classes below the limit share its seconds, the worse keeping its floor.
    assert _plan([chat, doc, other], PrefillLimit(0, 0.1, per_token)) == {doc: 96 - floor, other: floor}
    # Past the limit they share that floor, the worse taking its lower_share of it (a block).
    assert _plan([chat, doc, other], PrefillLimit(0, 0.0, per_token)) == {doc: floor - 16, other: 16}
    # Below a chat that prefills unlimited (its priority is the limit's), the floor is theirs.
    prompt = _request(200)
    assert _plan([chat, prompt, doc], PrefillLimit(0, 0.0, per_token)) == {prompt: 192, doc: floor}


def test_past_a_target_for_everyone_each_class_moves_a_block():
    """No priority inverted, and the overshoot bounded: a block for the best class prefilling,
    a block for those below it."""
    per_token = lambda chunks: 0.001 * sum(n for _, n in chunks)  # noqa: E731
    chat = _request(10, "DECODING", 10)
    doc, other = _request(3000), _request(3000, priority=1)
    assert _plan([chat, doc, other], PrefillLimit(None, 0.0, per_token)) == {doc: 16, other: 16}
    assert _plan([chat, doc], PrefillLimit(None, 0.0, per_token)) == {doc: 16}
    # Within the target the best leave the lower their reserve's seconds, as below a priority.
    assert _plan([chat, doc, other], PrefillLimit(None, 0.1, per_token)) == {doc: 48, other: 48}


def _device_seconds(chunks, rows):
    """The fake device's programs: 5 ms + 2 ms per decode row + 0.1 ms per prefill token
    + 0.1 ms per 1k attention pairs; `chunks` as (start, length) pairs."""
    return 0.005 + 0.002 * rows + sum(0.0001 * n + 0.0001 * n * (s + n) / 1024 for s, n in chunks)


def _served(target=None, slo=SLO(), doc_priority=0):
    """A chat decodes 30 tokens, a 3,000-token document prefilling from its 10th: the device's seconds
    for each iteration's programs while the chat decodes and the document prefills, and the
    document's tokens in each iteration after the chat is done."""
    rng = np.random.default_rng(10)
    engine = FakeEngine(num_slots=2, prefill_chunk=256, max_seq_len=4096, device_seconds=lambda chunks, rows: _device_seconds(
        [(c.start, len(c.tokens)) for c in chunks], rows))
    h = Harness(engine, chunked(budget=256, chunk=256, lower_share=0.1), itl_target=target, slo=slo)
    chat = h.submit(random_prompt(rng, 10), max_tokens=30, ignore_eos=True)
    for _ in range(10):
        h.step()
    doc = h.submit(random_prompt(rng, 3000), max_tokens=2, ignore_eos=True, priority=doc_priority)
    h.run()
    for c in h.clients:
        c.check(h.engine)
    decoding = set(h.decode_steps_of(chat))
    during, after = [], []
    for i, calls in enumerate(h.steps):
        chunks = [(c.start, c.length) for c in calls if isinstance(c, Prefill) and c.slot == doc.slot]
        if chunks and i in decoding:
            during.append(_device_seconds(chunks, sum(len(c.slots) for c in calls if isinstance(c, Decode))))
        elif chunks:
            after.append(sum(n for _, n in chunks))
    return during, after, h.sched.cost


@pytest.mark.parametrize("config", [dict(target=0.03), dict(slo=SLO(itl={0: 0.03}), doc_priority=1)],
                         ids=["itl_target", "a_priority's_slo_itl"])
def test_the_scheduler_keeps_iterations_within_the_target_on_a_device_that_takes_time(config):
    """With a 30 ms target (for everyone, or for the chat's priority above the document's),
    once the model has seen the first iterations, every iteration that decodes the chat and
    prefills the document takes the device at most the target (and a little host time the fit
    charges to it); uncapped, those iterations take longer. Once the chat is done, nothing
    caps the document."""
    during, after, cost = _served(**config)
    assert len(during) > 12 and after and max(after) == 256
    assert max(during[2:]) <= 0.03 + 0.002  # the model needs two plans with prefill
    uncapped, _, _ = _served()
    assert min(uncapped) > 0.03


def test_itl_target_must_be_positive():
    with pytest.raises(ValueError, match="itl_target"):
        SchedulerConfig(itl_target=0.0)
