"""Priorities and SLO-aware admission, on the fake engine: who is admitted, preempted and
refused, that every output still equals its lone run, and the starvation bound."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cadence.model.host_sampling import RequestSampling
from cadence.scheduler.errors import Overloaded, SubmissionError
from cadence.scheduler.priority import SLO, AdmissionControl, PriorityClasses
from tests.fakes import FakeEngine, Harness, Prefill, all_pages_free, chunked, random_prompt


def _decoding(client) -> bool:
    return bool(client.events)


def _started(h: Harness, *clients) -> None:
    h.run(until=lambda: all(_decoding(c) for c in clients), max_steps=500)


# --- the order of admission ------------------------------------------------------------------


def test_a_better_priority_is_admitted_first_whatever_arrived_before_it():
    """Both slots busy (a document, protected as its class's only running request, and a
    chat); a document and then a chat wait. The chat takes the slot that frees first."""
    rng = np.random.default_rng(0)
    h = Harness(FakeEngine(num_slots=2), chunked(budget=128, chunk=64))
    doc = h.submit(random_prompt(rng, 100), max_tokens=60, ignore_eos=True, priority=1)
    chat = h.submit(random_prompt(rng, 10), max_tokens=5, ignore_eos=True, priority=0)
    _started(h, doc, chat)
    late_doc = h.submit(random_prompt(rng, 100), max_tokens=5, ignore_eos=True, priority=1)
    late_chat = h.submit(random_prompt(rng, 10), max_tokens=5, ignore_eos=True, priority=0)
    h.run()
    assert late_chat.first_token_step < late_doc.first_token_step
    assert h.sched.preemptions == 0  # the running document is its class's first: kept
    for c in h.clients:
        c.check(h.engine)


def test_a_class_with_nothing_running_gets_its_first_request_in():
    """Chats keep both slots busy and more keep coming; a document still gets the next slot
    that frees, since its class has nothing in flight."""
    rng = np.random.default_rng(1)
    h = Harness(FakeEngine(num_slots=2), chunked(budget=128, chunk=64))
    chats = [h.submit(random_prompt(rng, 10), max_tokens=20, ignore_eos=True) for _ in range(2)]
    _started(h, *chats)
    doc = h.submit(random_prompt(rng, 50), max_tokens=5, ignore_eos=True, priority=1)
    more = [h.submit(random_prompt(rng, 10), max_tokens=20, ignore_eos=True) for _ in range(4)]
    h.run()
    assert doc.record.admitted <= min(c.record.admitted for c in more)
    assert doc.record.preemptions == 0


# --- preemption for priority -----------------------------------------------------------------


def test_a_better_priority_preempts_the_newest_of_the_lowest_never_its_first():
    rng = np.random.default_rng(2)
    h = Harness(FakeEngine(num_slots=3), chunked(budget=128, chunk=64))
    docs = [h.submit(random_prompt(rng, 40), max_tokens=80, ignore_eos=True, priority=p)
            for p in (2, 1, 2)]  # the first of class 2, the only one of 1, the newest of 2
    _started(h, *docs)
    queries, hits = h.sched.prefix_queries, h.sched.prefix_hits
    chat = h.submit(random_prompt(rng, 10), max_tokens=8, ignore_eos=True)
    start = len(h.steps)
    h.run(until=lambda: _decoding(chat), max_steps=50)
    assert chat.first_token_step - start <= 3  # no waiting for a slot to free
    h.run()
    assert [d.record.preemptions for d in docs] == [0, 0, 1]
    assert chat.record.preemptions == 0
    # The victim's pages stayed cached: its recompute took all but its last page's worth.
    recomputed = h.sched.prefix_queries - queries - chat.record.prompt_tokens
    assert h.sched.prefix_hits - hits >= recomputed - h.engine.config.page_size
    for c in h.clients:
        c.check(h.engine)  # the preempted one resumed where it was: nothing lost or repeated
    all_pages_free(h)


def test_equal_or_worse_priorities_never_preempt():
    rng = np.random.default_rng(3)
    h = Harness(FakeEngine(num_slots=2), chunked(budget=128, chunk=64))
    running = [h.submit(random_prompt(rng, 10), max_tokens=30, ignore_eos=True, priority=1) for _ in range(2)]
    _started(h, *running)
    h.submit(random_prompt(rng, 10), max_tokens=5, ignore_eos=True, priority=1)
    h.submit(random_prompt(rng, 10), max_tokens=5, ignore_eos=True, priority=3)
    h.run()
    assert h.sched.preemptions == 0
    for c in h.clients:
        c.check(h.engine)


def test_a_better_priority_preempts_for_pages_and_the_victim_resumes_from_its_cached_pages():
    """Slots are free but pages are not: a chat preempts the newer of two documents for its
    pages, and the document resumes exactly where it was."""
    rng = np.random.default_rng(4)
    engine = FakeEngine(num_slots=4, max_seq_len=256, page_size=8, num_pages=32, prefill_chunk=64)
    h = Harness(engine, chunked(budget=128, chunk=64))
    # Each document holds 13-14 of the 32 pages; the chat's first chunk needs 8 of the 4 left.
    docs = [h.submit(random_prompt(rng, 100), max_tokens=10, ignore_eos=True, priority=1) for _ in range(2)]
    _started(h, *docs)
    chat = h.submit(random_prompt(rng, 90), max_tokens=8, ignore_eos=True)
    h.run()
    assert [d.record.preemptions for d in docs] == [0, 1]
    assert chat.record.preemptions == 0
    for c in h.clients:
        c.check(engine)
    all_pages_free(h)


# --- the prefill budget by class -------------------------------------------------------------


def test_lower_priorities_keep_their_share_of_the_prefill_budget():
    """A long chat prompt and a document prefill together: the chat goes first, yet in every
    iteration the document prefills at least lower_share of the budget."""
    rng = np.random.default_rng(5)
    h = Harness(FakeEngine(num_slots=2, prefill_chunk=64), chunked(budget=128, chunk=64, lower_share=0.25))
    doc = h.submit(random_prompt(rng, 600), max_tokens=2, ignore_eos=True, priority=1)
    chat = h.submit(random_prompt(rng, 600), max_tokens=2, ignore_eos=True, priority=0)
    h.run()
    doc_slot, chat_slot = doc.slot, chat.slot
    both = [calls for calls in h.steps
            if {c.slot for c in calls if isinstance(c, Prefill)} == {doc_slot, chat_slot}]
    assert len(both) >= 3
    policy = h.sched.config.policy
    budget = min(128, policy.pack_tokens)  # nothing decodes while both prefill
    floor = max(policy.pack_block, int(budget * 0.25) // policy.pack_block * policy.pack_block)
    for calls in both:
        doc_tokens = sum(c.length for c in calls if isinstance(c, Prefill) and c.slot == doc_slot)
        chunks = [c for c in calls if isinstance(c, Prefill) and c.slot == chat_slot]
        assert doc_tokens >= floor or calls[-1].final
        # The better priority gets the most, but for the rest of its prompt.
        assert sum(c.length for c in chunks) >= doc_tokens or chunks[-1].final
    assert chat.record.first_token < doc.record.first_token


# --- random load: exactness, pages, the starvation bound -------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_mixed_priorities_preempt_and_every_output_is_exact(seed):
    """Random arrivals of three priorities into few slots and a small page pool, seeded
    sampling, groups of two sequences (forks), EOS and cancellations: requests are preempted
    for priority and for pages, and every client still receives exactly its lone output;
    every page comes back."""
    rng = np.random.default_rng(seed)
    engine = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8, num_pages=48,
                        eos_one_in=40)
    h = Harness(engine, chunked(budget=100, chunk=32))
    for step in range(10_000):
        if step < 80 and rng.random() < 0.5:
            priority = int(rng.choice([0, 0, 1, 1, 2]))
            length = int(rng.integers(1, 30 if priority == 0 else 150))
            choices = [dict(max_tokens=int(rng.integers(1, 60)), priority=priority,
                            sampling=RequestSampling(temperature=float(rng.choice([0.0, 0.8])),
                                                     seed=int(rng.integers(0, 2**31))))
                       for _ in range(int(rng.choice([1, 1, 1, 2])))]  # sometimes n = 2: a fork
            h.submit_group(random_prompt(rng, length), choices)
        live = [c for c in h.clients if c.record is None]
        if live and rng.random() < 0.01:
            live[int(rng.integers(len(live)))].stream.cancel()
        if step >= 80 and h.sched.idle() and all(c.record for c in h.clients):
            break
        h.step()
        used, total = h.sched.kv_pages
        assert used <= total
    for c in h.clients:
        c.check(engine)
    assert 0 < h.sched.priority_preemptions <= h.sched.preemptions
    assert sum(c.record.preemptions for c in h.clients) == h.sched.preemptions
    all_pages_free(h)
    h.sched.pools[0].pages.check()


def test_documents_under_a_flood_of_chats_finish_within_the_stated_bound():
    """Chats arrive faster than the slots serve them for the whole test; documents queued at
    the start are still served in order, each within the bound the policy states: its class
    always has a request in flight that is never preempted for priority, decodes every
    iteration and prefills at least lower_share of the budget, so document k has finished by
    the sum over documents j <= k of (prefill_j / floor + max_tokens_j) iterations, plus the
    pipeline's few iterations each."""
    rng = np.random.default_rng(6)
    policy = chunked(budget=128, chunk=64, lower_share=0.25)
    h = Harness(FakeEngine(num_slots=3, prefill_chunk=64), policy)
    docs = [h.submit(random_prompt(rng, int(rng.integers(150, 300))), max_tokens=10, ignore_eos=True,
                     priority=1) for _ in range(4)]
    policy = h.sched.config.policy
    budget = min(128 - 3, policy.pack_tokens)  # at most 3 decoding
    floor = max(policy.pack_block, int(budget * 0.25) // policy.pack_block * policy.pack_block)
    for _ in range(400):
        while sum(1 for c in h.clients if c.record is None and c not in docs) < 6:  # a backlog of chats
            h.submit(random_prompt(rng, int(rng.integers(5, 40))), max_tokens=int(rng.integers(5, 30)),
                     ignore_eos=True)
        h.step()
    bound = 0
    for d in docs:
        assert d.record is not None, "a document starved"
        bound += math.ceil(d.record.prompt_tokens / floor) + d.record.output_tokens + 4
        assert d.record.decode_steps and _finished_step(h, d) <= bound
    assert [d.record.finished for d in docs] == sorted(d.record.finished for d in docs)
    assert sum(1 for c in h.clients if c.record and c not in docs) > 20  # chats flowed all along


def _finished_step(h: Harness, client) -> int:
    return client.events[-1][0]


def test_equal_priorities_behave_as_without_priorities():
    """Every request at one (non-zero) priority: the same engine calls, step for step, as the
    same load at the default priority."""
    def run(priority):
        rng = np.random.default_rng(7)
        h = Harness(FakeEngine(num_slots=3, prefill_chunk=32, max_seq_len=256, page_size=8, num_pages=40),
                    chunked(budget=100, chunk=32))
        for step in range(2000):
            if step < 40 and step % 3 == 0:
                h.submit(random_prompt(rng, int(rng.integers(1, 120))), max_tokens=int(rng.integers(1, 40)),
                         priority=priority)
            if step >= 40 and h.sched.idle():
                break
            h.step()
        return h.steps

    assert run(5) == run(None)


# --- classes ---------------------------------------------------------------------------------


def test_priority_classes_from_the_prompt_length():
    classes = PriorityClasses.parse("1024=1,8192=2")
    assert [classes.of(n) for n in (1, 1024, 1025, 8192, 8193)] == [0, 0, 1, 1, 2]
    assert PriorityClasses().of(10**6) == 0
    for bad in ("1024", "x=1", "1024=1.5", "1=1,1=2", "-5=1"):
        with pytest.raises(ValueError):
            PriorityClasses.parse(bad)


def test_a_request_without_priority_takes_its_class_and_one_with_keeps_its_own():
    rng = np.random.default_rng(8)
    h = Harness(FakeEngine(num_slots=2), chunked(budget=128, chunk=64),
                priority_classes=PriorityClasses.parse("50=3"))
    short = h.submit(random_prompt(rng, 20), max_tokens=2)
    long = h.submit(random_prompt(rng, 80), max_tokens=2)
    sent = h.submit(random_prompt(rng, 80), max_tokens=2, priority=-1)
    h.run()
    assert [c.record.priority for c in (short, long, sent)] == [0, 3, -1]


@pytest.mark.parametrize("bad", [1.5, True, "1", 2**31])
def test_a_bad_priority_is_refused(bad):
    h = Harness(FakeEngine(num_slots=1))
    with pytest.raises(SubmissionError, match="priority") as e:
        h.submit([1, 2, 3], max_tokens=1, priority=bad)
    assert e.value.param == "priority"


# --- SLO-aware admission ---------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _loaded(slo: SLO, clock: Clock, rate: float = 1000.0, iteration: float = 0.1) -> AdmissionControl:
    """An admission control that has seen 20 iterations prefilling `rate` tokens/s."""
    control = AdmissionControl(slo, clock)
    for _ in range(20):
        control.observe(clock.now, iteration, int(rate * iteration), 4, 1)
        clock.now += iteration
    return control


def test_admission_refuses_a_request_predicted_to_miss_its_ttft_target():
    clock = Clock()
    control = _loaded(SLO(ttft={0: 2.0, 1: 30.0}, margin=0.25), clock)
    assert control.prefill_rate() == pytest.approx(1000)
    # 2000 tokens ahead: 2 s + two iterations (0.2 s) = 2.2 s, within 2 s * 1.25: admitted.
    assert control.check(0, 2000) is None
    # 3000 ahead: 3.2 s predicted. Refused, to retry once the queue has shrunk by 1.2 s.
    rejection = control.check(0, 3000)
    assert rejection.reason == "ttft_slo" and rejection.retry_after == 2
    assert "3.2 s" in rejection.message
    assert control.check(1, 3000) is None  # its class's target is 30 s
    assert control.check(7, 10**9) is None  # no target: never refused for it


def test_admission_forgets_old_rates_and_admits_before_it_has_measured():
    clock = Clock()
    slo = SLO(ttft={0: 1.0}, window=10.0)
    assert AdmissionControl(slo, clock).check(0, 10**9) is None  # nothing measured: admit
    control = _loaded(slo, clock, rate=100.0)
    assert control.check(0, 1000) is not None
    clock.now += 60  # a minute later, faster iterations: the slow ones are outside the window
    for _ in range(5):
        control.observe(clock.now, 0.1, 1000, 4, 1)
        clock.now += 0.1
    assert control.prefill_rate() == pytest.approx(10_000)
    assert control.check(0, 1000) is None


def test_admission_refuses_while_decode_steps_miss_the_itl_target():
    clock = Clock()
    control = _loaded(SLO(itl={0: 0.05}, margin=0.2), clock, iteration=0.1)
    rejection = control.check(0, 1)
    assert rejection.reason == "itl_slo" and rejection.retry_after >= 1
    assert control.check(0, 1, frozenset({0})).reason == "itl_slo"
    # Worse priorities running: the policy caps their prefill for it; refusing it cannot help.
    assert control.check(0, 1, frozenset({0, 1})) is None
    # A worse one is refused while the better one it would slow is running, not otherwise.
    assert "priority 0" in control.check(1, 1, frozenset({0})).message
    assert control.check(1, 1, frozenset({1})) is None
    assert _loaded(SLO(itl={0: 0.2}), Clock(), iteration=0.1).check(0, 1) is None


def test_the_scheduler_refuses_what_its_admission_predicts_will_miss_and_counts_it():
    """Queued prompts make the prediction: the first requests fit the target, then one is
    refused with Overloaded and a Retry-After; a better class is still admitted."""
    rng = np.random.default_rng(9)
    clock = Clock()
    slo = SLO(ttft={1: 1.0}, margin=0.0)
    h = Harness(FakeEngine(num_slots=1), chunked(budget=128, chunk=64), slo=slo)
    h.sched.admission = _loaded(slo, clock, rate=200.0, iteration=0.05)  # 200 prompt tokens/s
    # Nothing stepped: the backlog is the inbox. 1 s - 2 iterations = 180 tokens fit.
    h.submit(random_prompt(rng, 100), max_tokens=1, priority=1)
    with pytest.raises(Overloaded) as e:
        h.submit(random_prompt(rng, 100), max_tokens=1, priority=1)
    assert e.value.retry_after == 1 and "first token" in str(e.value)
    h.submit(random_prompt(rng, 100), max_tokens=1, priority=0)  # no target for 0
    assert h.sched.rejections == {"ttft_slo": 1}
    h.run()
    assert len(h.clients) == 2 and all(c.record.finish_reason == "length" for c in h.clients)


def test_slo_targets_parse_and_refuse_nonsense():
    slo = SLO.parse(ttft="0=2,1=120", itl="0=0.25")
    assert slo.ttft == {0: 2.0, 1: 120.0} and slo.itl == {0: 0.25} and slo.active
    assert not SLO().active
    for ttft in ("0=0", "0=-1", "0=inf", "zero=1", "0"):
        with pytest.raises(ValueError):
            SLO.parse(ttft=ttft)


# --- through the server ----------------------------------------------------------------------


def test_the_server_takes_priority_refuses_with_429_and_counts_per_class(tiny_engine, tiny_tokenizer):
    """On the tiny model: `priority` on both endpoints; a class whose TTFT target cannot be met
    gets 429 with Retry-After once the server has measured its rates, another class is served;
    /metrics counts the refusal and labels latencies by priority; a bad priority is a 400."""
    import httpx

    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
    from cadence.server.app import create_app
    from tests.conftest import loopback_server

    sched = Scheduler(tiny_engine, tiny_tokenizer, SchedulerConfig(
        policy=chunked(budget=40, chunk=32), slo=SLO(ttft={0: 1e-6}, margin=0.0)))
    with loopback_server(create_app(sched, tiny_tokenizer, "tiny")) as base:
        def post(path, **body):
            return httpx.post(f"{base}/v1/{path}", json={"max_tokens": 3, **body}, timeout=60)

        assert post("completions", prompt="measure the rates", priority=1).status_code == 200
        refused = post("completions", prompt="too slow for a microsecond", priority=0)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "first token" in refused.json()["error"]["message"]
        chat = post("chat/completions", messages=[{"role": "user", "content": "hi"}], priority=1)
        assert chat.status_code == 200
        metrics = httpx.get(f"{base}/metrics").text
        assert 'cadence:requests_rejected_total{model_name="tiny",reason="ttft_slo"} 1.0' in metrics
        assert 'cadence:requests_rejected_total{model_name="tiny",reason="queue_full"} 0.0' in metrics
        assert 'cadence:time_to_first_token_seconds_count{model_name="tiny",priority="1"} 2.0' in metrics
        assert 'cadence:num_requests_waiting_by_priority{model_name="tiny",priority="0"} 0.0' in metrics
        for bad in ("high", 1.5, True, 2**31):
            response = post("completions", prompt="x", priority=bad)
            assert response.status_code == 400, bad
            assert response.json()["error"]["param"] == "priority"
