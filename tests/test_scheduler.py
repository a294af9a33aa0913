"""Scheduler contract tests against a fake engine (`tests.fakes`): no JAX program runs, each
test takes ms.

Most tests drive the scheduler synchronously with `step()`; a few run its thread (`start()`),
from client threads and from asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time

import numpy as np
import pytest

from cadence.model.host_sampling import RequestSampling
from cadence.scheduler.errors import EngineDead, NotRunning, Overloaded, RequestTooLong, SubmissionError
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams, PromptProgress, RequestRecord, TokenEvent
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from cadence.scheduler.stream import interleaved
from tests.fakes import (
    EOS, TOK, Decode, FakeEngine, Harness, Prefill, all_pages_free, chunked, collect, expected, ids,
    prefill_first, random_prompt, run_random_load,
)


@pytest.fixture
def threaded():
    """Schedulers started in their thread; stopped (aborting) at teardown."""
    started: list[Scheduler] = []

    def make(engine: FakeEngine, policy: PolicyConfig | None = None) -> Scheduler:
        policy = policy or PolicyConfig(chunk=engine.config.prefill_chunk)
        sched = Scheduler(engine, TOK, SchedulerConfig(policy=policy))
        sched.start()
        started.append(sched)
        return sched

    yield make
    for sched in started:
        sched.stop(drain=False, timeout=5)
        assert not sched.alive


# --- 1, 2: chunked prefill vs prefill-first under a chat + document mix -----------------------


def _chat_then_document_then_chat(policy: PolicyConfig):
    """Chat A is decoding when a 600-token document arrives, and chat B right behind it."""
    h = Harness(FakeEngine(num_slots=4, prefill_chunk=64), policy)
    rng = np.random.default_rng(0)
    chat_a = h.submit(random_prompt(rng, 20), max_tokens=150)
    h.run(until=lambda: chat_a.events)
    doc = h.submit(random_prompt(rng, 600), max_tokens=5)
    chat_b = h.submit(random_prompt(rng, 12), max_tokens=30)
    h.run()
    for c in (chat_a, doc, chat_b):
        c.check(h.engine)
    doc_done = max(i for i, p in h.prefills(doc) if p.final)
    return h, chat_a, doc, chat_b, doc_done


def test_chunked_chat_gets_first_token_while_document_prefills():
    """Chunked, with a budget of one chunk: B (shortest first) gets its first token before the
    document's prefill completes, the document takes at most one chunk per iteration, and every
    decoding request advances in every iteration from its first token to its last."""
    policy = chunked(budget=64, chunk=64)
    h, chat_a, doc, chat_b, doc_done = _chat_then_document_then_chat(policy)
    assert chat_b.first_token_step < h.prefills(doc)[2][0] < doc_done
    doc_steps = [i for i, _ in h.prefills(doc)]
    assert len(doc_steps) == len(set(doc_steps)) >= math.ceil(600 / 64)
    assert all(p.length <= 64 for _, p in h.prefills(doc))
    for c in (chat_a, doc, chat_b):
        final = max(i for i, p in h.prefills(c) if p.final)
        # decode runs in consecutive iterations right after the final prefill chunk
        want = list(range(final + 1, final + c.stream.request.max_tokens))
        assert h.decode_steps_of(c) == want
    for calls in h.steps:  # the token budget covers decode and prefill together
        decodes = sum(len(c.slots) for c in calls if isinstance(c, Decode))
        assert decodes + sum(c.length for c in calls if isinstance(c, Prefill)) <= policy.token_budget


def test_chunked_chat_passes_documents_waiting_for_a_partial_prefill_turn():
    """With two long documents already prefilling (the cap) and a third waiting, a chat that
    arrives last is admitted at once and gets its first token before any document finishes
    prefilling; the third document waits for a turn."""
    h = Harness(FakeEngine(num_slots=4), chunked(budget=64, chunk=32, max_partial_prefills=2))
    rng = np.random.default_rng(7)
    docs = [h.submit(random_prompt(rng, 400), max_tokens=2) for _ in range(3)]
    h.step()
    chat = h.submit(ids("hi"), max_tokens=2)
    h.run(until=lambda: chat.token_ids)
    assert all(d.stream.request.prefilled < 400 for d in docs)
    assert docs[2].stream.request.prefilled == 0  # the third document is still waiting its turn
    h.run()
    for c in (*docs, chat):
        c.check(h.engine)


def test_prefill_first_stalls_chats_behind_the_document():
    """Prefill-first: the whole document is prefilled in one iteration that runs no decode, and
    chat B gets no token until that iteration is over; chat A's decoding stalls meanwhile."""
    h, chat_a, doc, chat_b, doc_done = _chat_then_document_then_chat(prefill_first(chunk=64))
    assert chat_b.first_token_step > doc_done
    assert {i for i, _ in h.prefills(doc)} == {doc_done}
    assert len(h.prefills(doc)) == math.ceil(600 / 64)
    for calls in h.steps:
        if any(isinstance(c, Prefill) for c in calls):
            assert not any(isinstance(c, Decode) for c in calls)
    assert doc_done not in h.decode_steps_of(chat_a)
    assert h.decode_steps_of(chat_a)[-1] > doc_done  # A was mid-stream when the doc came


def test_prompts_that_arrive_together_share_one_prefill_program():
    """Four chats and a document chunk planned in one iteration go to the engine in a single
    prefill call (one packed program), and every output is still the sequential model's."""
    h = Harness(FakeEngine(num_slots=8, prefill_chunk=256), chunked(budget=256, chunk=64))
    rng = np.random.default_rng(8)
    doc = h.submit(random_prompt(rng, 300), max_tokens=3)
    h.step()  # the document's first chunk, alone
    chats = [h.submit(random_prompt(rng, n), max_tokens=4) for n in (5, 17, 40, 33)]
    calls, programs = h.engine.prefill_calls, h.sched.prefill_programs
    h.step()
    assert h.engine.prefill_calls - calls == 1 and h.sched.prefill_programs - programs == 1
    packed = [c for c in h.steps[-1] if isinstance(c, Prefill)]
    assert sorted(c.length for c in packed) == [5, 17, 33, 40, 64]  # shortest first, then the doc
    h.run()
    assert h.sched.prefill_chunks == sum(len(h.prefills(c)) for c in (doc, *chats))
    for c in (doc, *chats):
        c.check(h.engine)


# --- 3: correctness against the sequential simulation -----------------------------------------


@pytest.mark.parametrize("policy", [chunked(), prefill_first()], ids=["chunked", "prefill-first"])
def test_single_request_matches_sequential_model(policy):
    """A lone request whose prompt spans several chunks produces exactly the simulated tokens."""
    h = Harness(FakeEngine(num_slots=2, prefill_chunk=64), policy)
    client = h.submit(random_prompt(np.random.default_rng(1), 150), max_tokens=40)
    h.run()
    client.check(h.engine)
    assert len(client.token_ids) == 40


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", [chunked(budget=100, chunk=32), prefill_first(chunk=32)],
                         ids=["chunked", "prefill-first"])
def test_random_arrivals_match_sequential_model(policy, seed):
    """Requests join and leave at random steps (random prompt lengths, max_tokens, sampling
    seeds, EOS from the model, cancellations mid-prefill or mid-decode); slots are reused many
    times; each output still equals its lone simulation."""
    rng = np.random.default_rng(seed)
    h = Harness(FakeEngine(num_slots=3, prefill_chunk=32, max_seq_len=256, eos_one_in=20), policy)
    arrivals = sorted(int(a) for a in rng.integers(0, 80, size=30))
    run_random_load(h, rng, arrivals, prompt_max=120, tokens_max=40, cancel_p=0.05, max_steps=10_000)
    assert all(c.record for c in h.clients)
    for c in h.clients:
        c.check(h.engine)
    reasons = {c.record.finish_reason for c in h.clients}
    assert reasons == {"stop", "length", "abort"}  # every ending was exercised
    assert {c.slot for c in h.clients} - {None} == {0, 1, 2}


# --- 3b: KV pages: preemption under a small pool, pages returned at every ending ------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("policy", [chunked(budget=100, chunk=32), prefill_first(chunk=32)],
                         ids=["chunked", "prefill-first"])
def test_a_pool_that_runs_dry_preempts_and_every_output_is_still_exact(policy, seed):
    """Four slots over a pool that holds one longest sequence (32 pages of 8): requests run out
    of pages mid-prefill and mid-decode, are preempted, recomputed and resumed, with seeded
    sampling, EOS and cancellations. Each client still receives exactly its lone output, no
    token lost or repeated, and every page comes back."""
    rng = np.random.default_rng(seed)
    engine = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8, num_pages=32,
                        eos_one_in=40)
    h = Harness(engine, policy)
    arrivals = sorted(int(a) for a in rng.integers(0, 60, size=24))

    def pages_within_the_pool():
        used, total = h.sched.kv_pages
        assert used <= total

    run_random_load(h, rng, arrivals, prompt_max=100, tokens_max=120, cancel_p=0.01, max_steps=20_000,
                    after_step=pages_within_the_pool)
    for c in h.clients:
        c.check(engine)
    assert h.sched.preemptions > 0
    assert sum(c.record.preemptions for c in h.clients) == h.sched.preemptions
    all_pages_free(h)


def test_a_lone_request_always_progresses_through_a_pool_of_exactly_one_sequence():
    # 8 pages of 16 hold one sequence of 128; the ninth is the null page.
    engine = FakeEngine(num_slots=2, max_seq_len=128, page_size=16, num_pages=9)
    h = Harness(engine, chunked(budget=64, chunk=64))
    rng = np.random.default_rng(4)
    clients = [h.submit(random_prompt(rng, 60), max_tokens=68, ignore_eos=True) for _ in range(2)]
    h.run()
    for c in clients:
        c.check(engine)
        assert c.record.output_tokens == 68
    assert h.sched.preemptions >= 1
    all_pages_free(h)


@pytest.mark.parametrize("length", [15, 16, 17, 31, 32, 33])
def test_prompts_ending_on_and_beside_page_boundaries(length):
    engine = FakeEngine(num_slots=2, page_size=16)
    h = Harness(engine, chunked(budget=64, chunk=16))
    c = h.submit(random_prompt(np.random.default_rng(length), length), max_tokens=20, ignore_eos=True)
    h.run()
    c.check(engine)
    all_pages_free(h)


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "preempted"])
def test_cancellation_at_every_stage_returns_every_page(stage):
    engine = FakeEngine(num_slots=2, max_seq_len=128, page_size=8, num_pages=16, prefill_chunk=16)
    h = Harness(engine, chunked(budget=20, chunk=16))
    rng = np.random.default_rng(7)
    first = h.submit(random_prompt(rng, 40), max_tokens=80, ignore_eos=True)
    second = h.submit(random_prompt(rng, 40), max_tokens=80, ignore_eos=True)
    third = h.submit(random_prompt(rng, 10), max_tokens=5)  # waits: two slots
    target = {"waiting": third, "prefilling": second, "decoding": first, "preempted": second}[stage]

    def reached() -> bool:
        r = target.stream.request
        if stage == "preempted":
            return r.preemptions > 0 and r.state.value == "waiting"
        return r.state.value == stage

    h.run(until=reached, max_steps=500)
    target.stream.cancel()
    h.run()
    assert target.record.finish_reason == "abort"
    for c in (first, second, third):
        c.check(engine)
    all_pages_free(h)


@pytest.mark.parametrize("reservation, most", [("max", 2), ("live", 8)])
def test_reserving_max_seq_len_is_the_contiguous_baseline(reservation, most):
    """Eight slots over a pool of two longest sequences: reserving max_seq_len per request
    (the contiguous layout) runs two at a time; reserving live tokens runs all eight short ones.
    (16 pages of 16 hold two sequences of 128; the seventeenth is the null page.)"""
    engine = FakeEngine(num_slots=8, max_seq_len=128, page_size=16, num_pages=17)
    h = Harness(engine, chunked(budget=256, chunk=64))
    h.sched = Scheduler(engine, TOK, SchedulerConfig(policy=chunked(budget=256, chunk=64),
                                                     kv_reservation=reservation))
    rng = np.random.default_rng(8)
    clients = [h.submit(random_prompt(rng, 20), max_tokens=10, ignore_eos=True) for _ in range(8)]
    h.run()
    for c in clients:
        c.check(engine)
    assert max(len(c.slots) for calls in h.steps for c in calls if isinstance(c, Decode)) == most
    assert h.sched.preemptions == 0


@pytest.mark.parametrize("reservation", ["max", "live"])
def test_requests_memory_cannot_hold_never_take_the_budget_from_those_it_can(reservation):
    """Two long prompts fill the pool; shorter ones keep arriving behind them. Admission counts
    pages, so the waiting chats never take the prefill budget from the long prompts that hold
    the memory (which would starve them forever), and everything finishes exactly."""
    engine = FakeEngine(num_slots=8, max_seq_len=256, page_size=16, num_pages=32)
    h = Harness(engine)
    h.sched = Scheduler(engine, TOK, SchedulerConfig(policy=chunked(budget=40, chunk=32),
                                                     kv_reservation=reservation))
    rng = np.random.default_rng(9)
    clients = [h.submit(random_prompt(rng, 230), max_tokens=20, ignore_eos=True) for _ in range(2)]
    h.step()
    clients += [h.submit(random_prompt(rng, 10), max_tokens=8, ignore_eos=True) for _ in range(10)]
    h.run(max_steps=2000)
    for c in clients:
        c.check(engine)
    all_pages_free(h)


# --- 4, 5: stop conditions -------------------------------------------------------------------


def test_max_tokens_gives_exactly_that_many():
    """max_tokens=7 yields exactly 7 token events and finish_reason "length"."""
    h = Harness(FakeEngine())
    client = h.submit(ids("count to seven"), max_tokens=7)
    h.run()
    assert [len(e.token_ids) for _, e in client.events] == [1] * 7
    assert client.record.finish_reason == "length"
    client.check(h.engine)


def test_no_max_tokens_runs_to_the_end_of_the_context():
    """Without max_tokens a request generates until its slot's context is full: "length"."""
    h = Harness(FakeEngine(max_seq_len=128))
    client = h.submit(random_prompt(np.random.default_rng(3), 100))
    h.run()
    assert len(client.token_ids) == 28 and client.record.finish_reason == "length"
    client.check(h.engine)


def test_eos_stops_and_is_not_in_the_text():
    """A scripted EOS ends the request with "stop"; nothing after it is emitted and the EOS
    contributes no text (even though one more decode step was already dispatched)."""
    prompt = ids("say hi")
    h = Harness(FakeEngine(script={tuple(prompt): ids("hi") + [EOS] + ids("more")}))
    client = h.submit(prompt, max_tokens=20)
    h.run()
    assert client.token_ids == ids("hi") + [EOS]
    assert client.record.finish_reason == "stop" and client.record.text == client.text == "hi"
    client.check(h.engine)


def test_ignore_eos_continues_past_eos():
    """With ignore_eos the scripted EOS is just a token: generation runs to max_tokens."""
    prompt = ids("say hi")
    h = Harness(FakeEngine(script={tuple(prompt): ids("hi") + [EOS] + ids("more")}))
    client = h.submit(prompt, max_tokens=10, ignore_eos=True)
    h.run()
    assert client.token_ids[:7] == ids("hi") + [EOS] + ids("more")
    assert len(client.token_ids) == 10 and client.record.finish_reason == "length"
    assert client.token_ids == expected(h.engine, prompt, 10, ignore_eos=True)[0]


def test_stop_string_spanning_two_tokens():
    """Stop "##" (two tokens): the text ends right before it, a lone "#" held back in case it
    started the stop string is released, "##" is never emitted, reason "stop", and the slot is
    freed so the queued request runs."""
    prompt = ids("go")
    h = Harness(FakeEngine(num_slots=1, script={tuple(prompt): ids("ab#c##def")}))
    client = h.submit(prompt, max_tokens=20, stop=("##",))
    queued = h.submit(ids("next one"), max_tokens=5)
    h.run()
    assert client.text == client.record.text == "ab#c"
    assert client.record.finish_reason == "stop"
    assert client.token_ids == ids("ab#c##")
    queued.check(h.engine)
    assert queued.first_token_step > client.events[-1][0]


# --- 6: cancellation -------------------------------------------------------------------------


def test_cancel_running_request_frees_its_slot_within_one_step():
    """Cancelling a decoding request ends it with "abort" on the next step, and the waiting
    request takes its slot in that same step."""
    h = Harness(FakeEngine(num_slots=1))
    running = h.submit(ids("a long answer please"), max_tokens=100)
    waiting = h.submit(ids("me next"), max_tokens=5)
    h.run(until=lambda: len(running.events) >= 3)
    assert h.sched.num_waiting == 1
    running.stream.cancel()
    h.step()
    assert running.record.finish_reason == "abort"
    assert running.record.output_tokens == len(running.events) < 100
    assert h.sched.num_waiting == 0 and h.sched.num_running == 1
    assert [type(c) for c in h.steps[-1]] == [Prefill]  # the waiting request, nothing else
    h.run()
    assert len(running.events) == running.record.output_tokens  # nothing after the abort
    assert running.token_ids == expected(h.engine, running.prompt, 100)[0][: len(running.events)]
    waiting.check(h.engine)


def test_cancel_waiting_request_removes_it_from_the_queue():
    """Cancelling a queued request ends it with "abort", never admitted nor prefilled."""
    h = Harness(FakeEngine(num_slots=1))
    running = h.submit(ids("first"), max_tokens=10)
    waiting = h.submit(ids("second"), max_tokens=10)
    h.step()
    waiting.stream.cancel()
    h.step()
    assert waiting.record.finish_reason == "abort" and waiting.record.output_tokens == 0
    assert waiting.record.admitted is None and waiting.events == []
    assert h.sched.num_waiting == 0
    h.run()
    assert waiting.stream.request.slot is None
    assert all(p.slot == running.slot for _, p in h.prefills(running))
    assert sum(isinstance(c, Prefill) for calls in h.steps for c in calls) == 1
    running.check(h.engine)


def test_cancel_mid_prefill_frees_the_slot_for_the_next_request():
    """A document cancelled halfway through its chunked prefill ends with "abort" and no tokens;
    the next request reuses its slot, over the document's stale KV, and is still correct."""
    h = Harness(FakeEngine(num_slots=1), chunked(budget=64, chunk=64))
    rng = np.random.default_rng(5)
    doc = h.submit(random_prompt(rng, 600), max_tokens=5)
    chat = h.submit(random_prompt(rng, 30), max_tokens=40)
    h.step()
    h.step()
    doc.stream.cancel()
    h.step()
    assert doc.record.finish_reason == "abort" and doc.events == []
    assert doc.record.prefill_chunks == 2
    h.run()
    assert chat.slot == doc.slot
    chat.check(h.engine)


# --- 7: more requests than slots ---------------------------------------------------------------


def test_requests_wait_for_free_slots():
    """2 slots, 5 requests: at most 2 run at once, the other 3 wait, all 5 complete correctly."""
    h = Harness(FakeEngine(num_slots=2))
    rng = np.random.default_rng(7)
    clients = [h.submit(random_prompt(rng, int(rng.integers(10, 100))),
                        max_tokens=int(rng.integers(5, 20))) for _ in range(5)]
    h.step()
    assert h.sched.num_running == 2 and h.sched.num_waiting == 3
    seen_running = []

    def done():
        seen_running.append(h.sched.num_running)
        return h.sched.idle() and all(c.record for c in clients)

    h.run(until=done)
    assert max(seen_running) == 2
    for calls in h.steps:
        assert {c.slot for c in calls if isinstance(c, Prefill)} <= {0, 1}
        assert all(len(c.slots) <= 2 for c in calls if isinstance(c, Decode))
    for c in clients:
        c.check(h.engine)


# --- 8: submission errors ------------------------------------------------------------------------


def _serves_a_normal_request(h: Harness) -> None:
    client = h.submit(ids("still alive?"), max_tokens=4)
    h.run()
    client.check(h.engine)


def test_empty_prompt_is_refused():
    """An empty prompt raises SubmissionError; the scheduler then serves normally."""
    h = Harness(FakeEngine())
    with pytest.raises(SubmissionError, match="empty"):
        h.submit([], max_tokens=4)
    _serves_a_normal_request(h)


def test_too_long_request_is_refused_with_the_numbers():
    """prompt + max_tokens over max_seq_len raises RequestTooLong naming all the numbers."""
    h = Harness(FakeEngine(max_seq_len=256))
    with pytest.raises(RequestTooLong) as err:
        h.submit(random_prompt(np.random.default_rng(0), 200), max_tokens=100)
    for number in ("200", "100", "300", "256"):
        assert number in str(err.value)
    with pytest.raises(RequestTooLong):  # a prompt filling the context leaves no room
        h.submit(random_prompt(np.random.default_rng(0), 256))
    _serves_a_normal_request(h)


def test_full_queue_is_refused_with_overloaded():
    """Requests that free slots will take at once never count as queued; beyond them, with
    max_queue=2, a third waiting request raises Overloaded; once the queue drains, requests
    are served again."""
    h = Harness(FakeEngine(num_slots=2), max_queue=2)
    streams = [h.submit(ids(f"r{i}"), max_tokens=3) for i in range(4)]  # 2 slots + 2 queued
    with pytest.raises(Overloaded):
        h.submit(ids("one too many"), max_tokens=3)
    h.run()
    for stream in streams:
        stream.check(h.engine)
    _serves_a_normal_request(h)


# --- 9: records ------------------------------------------------------------------------------------


def test_records_hold_the_timeline():
    """Each record has queue_time >= 0, ttft >= queue_time, ceil(prompt/chunk) prefill chunks,
    max_tokens - 1 decode steps (the first token comes from prefill), and its outputs; listeners
    get the same records."""
    h = Harness(FakeEngine(num_slots=5, prefill_chunk=512), chunked(budget=1024, chunk=64, max_partial_prefills=5))
    heard: list[RequestRecord] = []
    h.sched.listeners.append(heard.append)
    rng = np.random.default_rng(9)
    lengths = [1, 63, 64, 65, 200]
    clients = [h.submit(random_prompt(rng, n), max_tokens=6) for n in lengths]
    h.run()
    for c, n in zip(clients, lengths):
        r = c.record
        assert r.request_id == c.stream.id and r.prompt_tokens == n
        assert r.queue_time >= 0 and r.ttft >= r.queue_time
        assert r.submitted <= r.admitted <= r.first_token <= r.finished
        assert r.prefill_chunks == math.ceil(n / 64) == len(h.prefills(c))
        assert r.decode_steps == 5 == len(h.decode_steps_of(c))
        assert r.output_tokens == 6 and r.finish_reason == "length" and r.error is None
        c.check(h.engine)
    assert sorted(heard, key=lambda r: r.request_id) == sorted(
        (c.record for c in clients), key=lambda r: r.request_id)


def test_a_prompt_reports_its_progress_as_each_chunk_lands():
    """With `progress`, a prompt's events before its first token say how much of it is
    computed: what the cache gave at admission, then each chunk once its result is read (never
    before the step that dispatched it), the last with the first token; a request that did not
    ask gets tokens alone, though the two share every prefill."""
    h = Harness(FakeEngine(num_slots=2, prefill_chunk=64), chunked(budget=128, chunk=64))
    rng = np.random.default_rng(3)
    asked = h.submit(random_prompt(rng, 200), max_tokens=3, progress=True)
    beside = h.submit(random_prompt(rng, 150), max_tokens=3)
    h.run()
    for c in (asked, beside):
        c.check(h.engine)
    assert not beside.progress
    progress = asked.progress
    ends = [p.start + p.length for _, p in h.prefills(asked)]
    assert len(ends) >= 3 and [e.processed for _, _, e in progress] == [0, *ends]
    assert {(e.total, e.cache) for _, _, e in progress} == {(200, 0)}
    elapsed = [e.elapsed for _, _, e in progress]
    assert elapsed == sorted(elapsed) and elapsed[0] == 0
    assert {before for _, before, _ in progress} == {0}  # all of them before the first token
    chunks = {p.start + p.length: step for step, p in h.prefills(asked)}
    for step, _, e in progress[1:]:
        assert step > chunks[e.processed]  # read after the step that dispatched its chunk


def test_progress_counts_the_prefix_the_cache_gave():
    h = Harness(FakeEngine(num_slots=2, prefill_chunk=64), chunked(budget=128, chunk=64))
    prompt = random_prompt(np.random.default_rng(4), 150)
    h.submit(prompt, max_tokens=2)
    h.run()
    again = h.submit(prompt[:140] + [7, 8, 9], max_tokens=2, progress=True)
    h.run()
    progress = [e for _, _, e in again.progress]
    cached = again.record.cached_tokens
    assert cached >= 64 and progress[0].processed == cached
    assert {(e.total, e.cache) for e in progress} == {(143, cached)} and progress[-1].processed == 143


# --- 10, 11: the scheduler thread: engine failures, clients, stop ---------------------------------


def test_engine_failure_fails_in_flight_requests_and_keeps_serving(threaded):
    """An engine that raises in decode ends the in-flight request with "error" and the message;
    the scheduler thread survives and serves the next request correctly."""
    engine = FakeEngine()
    engine.fail_decode_call = 5
    sched = threaded(engine)
    prompt = ids("doomed")
    tokens, record = collect(sched.submit(prompt, GenerationParams(max_tokens=50)))
    assert record.finish_reason == "error" and "device lost in decode" in record.error
    assert 0 < len(tokens) < 50 and tokens == expected(engine, prompt, 50)[0][: len(tokens)]
    prompt = ids("survivor")
    tokens, record = collect(sched.submit(prompt, GenerationParams(max_tokens=12)))
    assert (tokens, record.finish_reason) == expected(engine, prompt, 12)


def test_a_poisoned_token_fails_its_own_request_only():
    """A decode result whose token for one slot is outside the vocabulary ends that request
    with an error naming the id; the requests decoding beside it in the same step are exact."""
    engine = FakeEngine(num_slots=3)
    engine.poison = {4: 1}  # the 4th decode call returns garbage for slot 1
    h = Harness(engine)
    clients = [h.submit(ids(f"neighbour {i}"), max_tokens=20) for i in range(3)]
    h.run()
    victim = next(c for c in clients if c.slot == 1)
    assert victim.record.finish_reason == "error" and "2147483647" in victim.record.error
    assert 0 < victim.record.output_tokens < 20
    for c in clients:
        if c is not victim:
            c.check(engine)
            assert c.record.finish_reason == "length"
    assert engine.recoveries == 0  # nothing was wrong with the device
    _serves_a_normal_request(h)


def test_a_row_that_cannot_be_packed_fails_its_own_request_only():
    """A sampling value that escaped validation (top_k past int32, the value that once failed
    every request in flight) fails its own request when it takes a slot; the others are exact."""
    h = Harness(FakeEngine(num_slots=3))
    bad = RequestSampling(temperature=0.7, top_k=5)
    object.__setattr__(bad, "top_k", 2**31)  # as if validation had a hole
    before = h.submit(ids("before"), max_tokens=12)
    h.step()
    victim = h.submit(ids("victim"), max_tokens=12, sampling=bad)
    after = h.submit(ids("after"), max_tokens=12)
    h.run()
    assert victim.record.finish_reason == "error" and "cannot be packed" in victim.record.error
    assert victim.record.output_tokens == 0
    before.check(h.engine)
    after.check(h.engine)


def test_every_failure_rebuilds_device_state(threaded):
    """recover() runs after every failed engine call, whatever the failure left behind."""
    engine = FakeEngine()
    engine.fail_decode_call = 3
    sched = threaded(engine)
    _, record = collect(sched.submit(ids("doomed"), GenerationParams(max_tokens=20)))
    assert record.finish_reason == "error" and engine.recoveries == 1
    prompt = ids("after the rebuild")
    tokens, record = collect(sched.submit(prompt, GenerationParams(max_tokens=10)))
    assert (tokens, record.finish_reason) == expected(engine, prompt, 10)


def test_failed_recovery_kills_the_engine_and_answers_everyone():
    """A decode fails and then recover() fails: the scheduler is dead. The running and the
    waiting requests all end with an error that says so, `dead` says why, the thread ends,
    and every later submit raises EngineDead instead of waiting forever."""
    engine = FakeEngine(num_slots=2, decode_delay=0.001)
    engine.fail_decode_call = 6
    engine.fail_recover = True
    sched = Scheduler(engine, TOK, SchedulerConfig(policy=chunked()))
    streams = [sched.submit(ids(f"request {i}"), GenerationParams(max_tokens=50)) for i in range(5)]
    sched.start()
    records = [collect(s)[1] for s in streams]
    sched.join(5)
    assert not sched.alive
    assert all(r.finish_reason == "error" for r in records)
    assert sum(r.error == "RuntimeError: device lost in decode" for r in records) == 2  # running
    assert sum(r.error.startswith("the engine is dead") for r in records) == 3  # waiting
    assert "device unreachable" in sched.dead
    with pytest.raises(EngineDead, match="device unreachable"):
        sched.submit(ids("hello?"))
    assert sched.num_running == 0 and sched.num_waiting == 0


def test_a_bug_outside_the_step_kills_the_loop_loudly():
    """Anything that escapes the guarded step (here the iteration itself is replaced by one
    that raises past `Exception`) marks the scheduler dead and answers the waiting request."""
    engine = FakeEngine()
    sched = Scheduler(engine, TOK, SchedulerConfig(policy=chunked()))

    class Escaped(BaseException):
        pass

    def broken_iteration():
        raise Escaped("the loop itself broke")

    sched._iterate = broken_iteration
    stream = sched.submit(ids("anyone there?"), GenerationParams(max_tokens=5))
    sched.start()
    _, record = collect(stream)
    sched.join(5)
    assert record.finish_reason == "error" and "the loop itself broke" in record.error
    assert "the loop itself broke" in sched.dead
    with pytest.raises(EngineDead):
        sched.submit(ids("hello?"))


@pytest.mark.parametrize("params, fragment", [
    (GenerationParams(stop=tuple(f"s{i}" for i in range(17))), "at most 16 stop strings"),
    (GenerationParams(stop=("x" * 257,)), "at most 256 characters"),
    (GenerationParams(stop=("",)), "non-empty"),
    (GenerationParams(max_tokens=0), "max_tokens"),
])
def test_submission_bounds_the_work_a_request_can_ask_for(params, fragment):
    h = Harness(FakeEngine())
    with pytest.raises(SubmissionError, match=fragment):
        h.sched.submit(ids("x"), params)
    _serves_a_normal_request(h)


def test_client_threads_share_the_running_scheduler(threaded):
    """Eight clients in their own threads, over four slots, each get their exact output."""
    engine = FakeEngine(num_slots=4)
    sched = threaded(engine)
    rng = np.random.default_rng(10)
    jobs = [(random_prompt(rng, int(rng.integers(1, 150))), int(rng.integers(1, 30)))
            for _ in range(8)]
    results: dict[int, tuple] = {}

    def client(i):
        prompt, n = jobs[i]
        results[i] = collect(sched.submit(prompt, GenerationParams(max_tokens=n)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for i, (prompt, n) in enumerate(jobs):
        tokens, record = results[i]
        assert (tokens, record.finish_reason) == expected(engine, prompt, n)


def test_async_for_over_streams(threaded):
    """Streams submitted inside an event loop are read with `async for`, concurrently. Debug
    mode makes asyncio refuse loop calls from the scheduler thread that are not thread-safe."""
    engine = FakeEngine(num_slots=2)
    sched = threaded(engine)
    prompts = [ids("async one"), ids("async two, longer"), ids("three")]

    async def read(prompt):
        events = [e async for e in sched.submit(prompt, GenerationParams(max_tokens=15))]
        assert isinstance(events[-1], RequestRecord)
        return [t for e in events[:-1] for t in e.token_ids], events[-1].finish_reason

    async def main():
        return await asyncio.wait_for(asyncio.gather(*map(read, prompts)), timeout=5)

    for prompt, got in zip(prompts, asyncio.run(main(), debug=True)):
        assert got == expected(engine, prompt, 15)


def test_a_reader_behind_takes_every_queued_event_at_once():
    """`next_events` hands a reader that fell behind everything queued, in order, the record
    last: the server writes them as one chunk. Driven synchronously inside a loop, so all of
    the request's events are queued before the first read."""
    engine = FakeEngine(num_slots=1)
    sched = Scheduler(engine, TOK, SchedulerConfig(policy=PolicyConfig(chunk=engine.config.prefill_chunk)))
    prompt = ids("behind")

    async def main():
        stream = sched.submit(prompt, GenerationParams(max_tokens=12))
        while not sched.idle():
            sched.step()
        await asyncio.sleep(0)  # the loop runs the scheduler's deliveries
        first, again = await stream.next_events(), await stream.next_events()
        return first, again, stream.record

    first, again, record = asyncio.run(main())
    assert isinstance(first[-1], RequestRecord) and first[-1] is record and again == []
    assert ([t for e in first[:-1] for t in e.token_ids], record.finish_reason) == expected(engine, prompt, 12)


def test_interleaved_sources_come_as_they_arrive_and_end_together():
    """`interleaved`: each source's items under its index as they come (a slow source does not
    hold a fast one back), until every source is done; a source's error is raised; leaving
    early closes every source still going."""
    closed: list[int] = []

    async def source(index: int, delays: list[float], fail: bool = False):
        try:
            for k, delay in enumerate(delays):
                await asyncio.sleep(delay)
                yield f"{index}.{k}"
            if fail:
                raise ValueError(f"source {index} failed")
        finally:
            closed.append(index)

    async def main():
        got = [x async for x in interleaved([source(0, [0.05, 0.05]), source(1, [0, 0, 0])])]
        with pytest.raises(ValueError, match="source 3 failed"):
            async for _ in interleaved([source(2, [1.0]), source(3, [0.0], fail=True)]):
                pass
        async with contextlib.aclosing(interleaved([source(4, [0.0, 5.0]), source(5, [5.0])])) as items:
            async for _ in items:
                break  # (the caller leaves: the rest are closed, not waited for)
        await asyncio.sleep(0.01)
        return got, sorted(closed)

    got, closed_in_time = asyncio.run(asyncio.wait_for(main(), timeout=5))
    assert got == [(1, "1.0"), (1, "1.1"), (1, "1.2"), (0, "0.0"), (0, "0.1")]
    assert closed_in_time == [0, 1, 2, 3, 4, 5]


def test_abandoned_async_stream_is_aborted_without_harm(threaded):
    """A client whose event loop closed mid-stream is aborted; the request beside it and the
    scheduler thread carry on."""
    engine = FakeEngine(num_slots=2, decode_delay=0.001)
    sched = threaded(engine)
    records: dict[str, RequestRecord] = {}
    sched.listeners.append(lambda r: records.__setitem__(r.request_id, r))
    prompt = ids("bystander")
    bystander = sched.submit(prompt, GenerationParams(max_tokens=100))

    async def read_one_event_and_leave():
        stream = sched.submit(ids("abandoned"), GenerationParams(max_tokens=500))
        async for _ in stream:
            return stream.id

    # asyncio.run closes the loop that the stream pushes to
    gone = asyncio.run(asyncio.wait_for(read_one_event_and_leave(), timeout=5))
    tokens, record = collect(bystander)
    assert (tokens, record.finish_reason) == expected(engine, prompt, 100)
    deadline = time.monotonic() + 5
    while gone not in records and time.monotonic() < deadline:
        time.sleep(0.005)
    assert records[gone].finish_reason == "abort" and records[gone].output_tokens < 500
    prompt = ids("next")
    tokens, record = collect(sched.submit(prompt, GenerationParams(max_tokens=8)))
    assert (tokens, record.finish_reason) == expected(engine, prompt, 8)


def test_stop_with_drain_finishes_everything():
    """stop(drain=True) returns after queued and running requests all finish normally; a submit
    afterwards raises NotRunning."""
    engine = FakeEngine(num_slots=2)
    sched = Scheduler(engine, TOK, SchedulerConfig(policy=chunked()))
    sched.start()
    rng = np.random.default_rng(11)
    jobs = [(random_prompt(rng, 40), 20) for _ in range(5)]
    streams = [sched.submit(p, GenerationParams(max_tokens=n)) for p, n in jobs]
    sched.stop(drain=True, timeout=5)
    assert not sched.alive
    for (prompt, n), stream in zip(jobs, streams):
        assert collect(stream, timeout=1)[0] == expected(engine, prompt, n)[0]
        assert stream.record.finish_reason == "length"
    with pytest.raises(NotRunning):
        sched.submit(ids("too late"))


def test_stop_without_drain_aborts_in_flight_work():
    """stop(drain=False) ends running and waiting requests with "abort" and returns promptly."""
    engine = FakeEngine(num_slots=1, max_seq_len=2048, decode_delay=0.001)
    sched = Scheduler(engine, TOK, SchedulerConfig(policy=chunked()))
    sched.start()
    running = sched.submit(ids("go on forever"), GenerationParams(max_tokens=1500))
    waiting = sched.submit(ids("never served"), GenerationParams(max_tokens=10))
    assert isinstance(running._queue.get(timeout=5), TokenEvent)  # the request is mid-stream
    sched.stop(drain=False, timeout=5)
    assert not sched.alive
    tokens, record = collect(running, timeout=1)
    assert record.finish_reason == "abort" and record.output_tokens < 1500
    assert collect(waiting, timeout=1) == ([], waiting.record)
    assert waiting.record.finish_reason == "abort"
    with pytest.raises(NotRunning):
        sched.submit(ids("too late"))
