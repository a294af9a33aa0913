"""Disaggregated serving in the scheduler, over two fake engines (milliseconds per test).

The prefill engine only prefills and the decode engine only decodes; a request's KV moves from
one to the other through `extract` and `insert` of the fakes, which copy the token ids a
sequence's pages hold, so a handoff that loses, shifts or mixes up a page changes the "model"'s
next token and `Client.check` (the sequential simulation) fails. The real engines on two CPU
devices are tested in test_disaggregated_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from cadence.scheduler.request import GenerationParams
from cadence.scheduler.scheduler import KVTransfer, Scheduler, SchedulerConfig
from tests.fakes import (
    TOK, FakeEngine, Harness, chunked, collect, expected, ids, prefill_first,
    random_prompt, run_random_load,
)


def pair(prefill: dict | None = None, decode: dict | None = None, **common) -> tuple[FakeEngine, FakeEngine]:
    """A prefill fake and a decode fake of the same "model" (`common`), each with its own pool."""
    return FakeEngine(**{**common, **(prefill or {})}), FakeEngine(**{**common, **(decode or {})})


def disaggregated(policy=None, prefill=None, decode=None, **common) -> Harness:
    p, d = pair(prefill, decode, **common)
    return Harness(p, policy, decode_engine=d)


def phases(h: Harness, never_landed: int | None = 0) -> None:
    """Each engine ran only its own phase, and every handoff went from one to the other (but
    `never_landed`, those that ended while their KV was on its way; None: any number)."""
    assert h.engine.decode_calls == 0 and h.decode_engine.prefill_calls == 0
    assert h.engine.inserts == 0 and h.decode_engine.extracts == 0
    assert h.engine.extracts == h.sched.kv_transfers
    if never_landed is None:
        assert h.decode_engine.inserts <= h.sched.kv_transfers
    else:
        assert h.decode_engine.inserts + never_landed == h.sched.kv_transfers


def all_pages_free(h: Harness) -> None:
    assert h.sched.kv_pages == (0, h.engine.num_pages + h.decode_engine.num_pages)
    for pool in h.sched.pools:
        assert not pool.tables.any() and not pool.running and sorted(pool.free_slots) == list(range(pool.num_slots))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", [chunked(budget=100, chunk=32), prefill_first(chunk=32)],
                         ids=["chunked", "prefill-first"])
def test_random_arrivals_match_the_sequential_model(policy, seed):
    """Random prompts, lengths, seeded sampling, EOS, cancellations and copies that land late:
    every client receives exactly the sequential model's output, as colocated serving gives."""
    rng = np.random.default_rng(seed)
    h = disaggregated(policy, num_slots=4, prefill_chunk=32, page_size=8, eos_one_in=30)
    h.decode_engine.landing_polls = seed  # copies that take 0, 1 or 2 iterations to land
    run_random_load(h, rng, sorted(int(a) for a in rng.integers(0, 80, size=30)), prompt_max=90,
                    tokens_max=60, cancel_p=0.02, max_steps=5000)
    for c in h.clients:
        c.check(h.engine)
    phases(h, never_landed=None)  # cancellations and first-token EOS may come mid-copy
    assert h.sched.kv_transfers > 20
    all_pages_free(h)


@pytest.mark.parametrize("length", [7, 8, 9, 15, 16, 17, 32])
def test_prompts_ending_on_and_beside_page_boundaries(length):
    h = disaggregated(chunked(budget=64, chunk=16), num_slots=2, page_size=8, prefill_chunk=16)
    c = h.submit(random_prompt(np.random.default_rng(length), length), max_tokens=20, ignore_eos=True)
    h.run()
    c.check(h.engine)
    phases(h)
    assert h.sched.kv_transfers == 1
    all_pages_free(h)


def test_one_token_requests_never_transfer():
    """A request whose first token is its last finishes on the prefill pool."""
    h = disaggregated(num_slots=2)
    clients = [h.submit(ids(f"one {i}"), max_tokens=1) for i in range(3)]
    h.run()
    for c in clients:
        c.check(h.engine)
    assert h.sched.kv_transfers == 0 and h.decode_engine.decode_calls == 0
    all_pages_free(h)


def test_the_first_token_streams_before_the_handoff_and_decode_follows_at_once():
    """The prefill's token reaches the client from the prefill pool; the KV moves in the same
    iteration as the last chunk, and the decode loop steps it as soon as that token is read
    (so its tokens are accepted in order): one token per step, none skipped or repeated."""
    h = disaggregated(num_slots=2, prefill_chunk=64)
    c = h.submit(random_prompt(np.random.default_rng(0), 50), max_tokens=6, ignore_eos=True)
    h.run()
    c.check(h.engine)
    steps = [step for step, _ in c.events]
    assert steps == list(range(steps[0], steps[0] + 6))
    r = c.record
    assert r.transfer_bytes == h.engine.extract([0] * 8, 50, 0).nbytes
    assert r.admitted < r.first_decode < r.token_times[1]  # dispatched before the first token was read


def test_a_full_decode_pool_back_pressures_without_loss():
    """A decode pool of two slots and pages for one longest sequence behind a prefill pool of
    four slots: prefilled requests wait in the backlog holding their prefill pages, admission
    stops when the prefill pool is full, and every request still gets exactly its output."""
    h = disaggregated(chunked(budget=64, chunk=32), max_seq_len=128, page_size=8, prefill_chunk=32,
                      prefill=dict(num_slots=4), decode=dict(num_slots=2, num_pages=16))
    rng = np.random.default_rng(5)
    clients = [h.submit(random_prompt(rng, int(rng.integers(20, 60))), max_tokens=int(rng.integers(20, 60)),
                        ignore_eos=True) for _ in range(12)]
    backlog, prefill_held = [], []
    h.run(until=lambda: (backlog.append(h.sched.transfer_backlog),
                         prefill_held.append(len(h.sched.pools[0].running)),
                         h.sched.idle() and all(c.record for c in clients))[-1])
    for c in clients:
        c.check(h.engine)
    assert max(backlog) >= 2  # prefilled requests did wait for the decode pool
    assert max(prefill_held) <= 4
    phases(h)
    all_pages_free(h)


def test_decode_pool_preemption_recomputes_through_the_prefill_pool():
    """The decode pool runs dry mid-decode: its newest request is preempted, prefilled again on
    the prefill pool (prompt + the output it already streamed), moved again, and resumes; no
    token is lost or repeated."""
    h = disaggregated(chunked(budget=64, chunk=32), max_seq_len=128, page_size=8, prefill_chunk=32,
                      num_slots=3, decode=dict(num_pages=16))
    h.decode_engine.landing_polls = 2
    rng = np.random.default_rng(9)
    clients = [h.submit(random_prompt(rng, 30), max_tokens=90, ignore_eos=True) for _ in range(3)]
    h.run()
    for c in clients:
        c.check(h.engine)
    assert h.sched.preemptions > 0
    assert h.sched.kv_transfers == 3 + h.sched.preemptions
    phases(h)
    all_pages_free(h)


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "backlog", "in flight", "moved", "decoding"])
def test_cancellation_before_during_and_after_the_transfer_frees_both_pools(stage):
    """Cancelled while queued, mid-prefill, prefilled and waiting for the decode pool, with its
    KV on the way (the copy takes a few iterations to land), in the iteration it landed, or
    decoding: its pages come back in both pools and the others are exact."""
    h = disaggregated(chunked(budget=40, chunk=16), max_seq_len=128, page_size=8, prefill_chunk=16,
                      prefill=dict(num_slots=3), decode=dict(num_slots=1))
    h.decode_engine.landing_polls = 3
    rng = np.random.default_rng(7)
    first = h.submit(random_prompt(rng, 20), max_tokens=60, ignore_eos=True)  # holds the decode slot
    second = h.submit(random_prompt(rng, 40), max_tokens=30, ignore_eos=True)  # waits in the backlog
    third = h.submit(random_prompt(rng, 10), max_tokens=5)
    fourth = h.submit(random_prompt(rng, 10), max_tokens=5)  # waits: three prefill slots
    target, state, pool = {"waiting": (fourth, "waiting", None), "prefilling": (second, "prefilling", "prefill"),
                           "backlog": (second, "transferring", "prefill"),
                           "in flight": (first, "transferring", "decode"),
                           "moved": (first, "decoding", "decode"), "decoding": (first, "decoding", "decode")}[stage]

    def reached() -> bool:
        r = target.stream.request
        return (r.state.value == state and (r.pool and r.pool.name) == pool
                and (stage != "decoding" or len(target.token_ids) > 3))

    h.run(until=reached, max_steps=500)
    target.stream.cancel()
    h.run()
    assert target.record.finish_reason == "abort"
    for c in (first, second, third, fourth):
        c.check(h.engine)
    phases(h, never_landed=int(stage == "in flight"))
    all_pages_free(h)


def test_a_failure_in_the_decode_pool_fails_only_its_requests():
    """The decode engine raises: the requests it holds end with the error, the decode engine is
    rebuilt, and the prompts still prefilling carry on to exact outputs."""
    h = disaggregated(chunked(budget=40, chunk=16), prefill_chunk=16, num_slots=2)
    h.decode_engine.fail_decode_call = 4
    rng = np.random.default_rng(3)
    decoding = h.submit(random_prompt(rng, 10), max_tokens=40, ignore_eos=True)
    h.run(until=lambda: len(decoding.token_ids) >= 2)
    document = h.submit(random_prompt(rng, 120), max_tokens=8, ignore_eos=True)
    h.run()
    assert decoding.record.finish_reason == "error" and "device lost in decode" in decoding.record.error
    document.check(h.engine)
    assert h.decode_engine.recoveries == 1 and h.engine.recoveries == 0
    all_pages_free(h)


def test_a_failure_in_the_prefill_pool_fails_only_its_requests():
    """The prefill engine raises: the prompt it was prefilling ends with the error, and the
    request already decoding on the other pool finishes exactly."""
    h = disaggregated(chunked(budget=40, chunk=16), prefill_chunk=16, num_slots=2)
    rng = np.random.default_rng(4)
    decoding = h.submit(random_prompt(rng, 10), max_tokens=30, ignore_eos=True)
    h.run(until=lambda: len(decoding.token_ids) >= 2)
    h.engine.fail_prefill_call = h.engine.prefill_calls + 2
    document = h.submit(random_prompt(rng, 120), max_tokens=8, ignore_eos=True)
    h.run()
    assert document.record.finish_reason == "error" and "device lost in prefill" in document.record.error
    decoding.check(h.engine)
    assert h.engine.recoveries == 1 and h.decode_engine.recoveries == 0
    after = h.submit(random_prompt(rng, 30), max_tokens=5)
    h.run()
    after.check(h.engine)
    all_pages_free(h)


def test_a_failed_insert_fails_the_decode_pool_and_nothing_else():
    h = disaggregated(num_slots=2)
    h.decode_engine.fail_insert_call = 2
    first = h.submit(ids("first one"), max_tokens=20, ignore_eos=True)
    h.run(until=lambda: len(first.token_ids) >= 3)
    second = h.submit(ids("second"), max_tokens=20, ignore_eos=True)
    h.run()
    for c in (first, second):
        assert c.record.finish_reason == "error" and "device lost in insert" in c.record.error
    assert h.decode_engine.recoveries == 1
    after = h.submit(ids("after"), max_tokens=6)
    h.run()
    after.check(h.engine)
    all_pages_free(h)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_failures_under_load_end_every_request_and_spare_the_other_pool(seed):
    """Random load over a decode pool that runs dry (preemptions), with extracts failing now
    and then (each fails the prefill pool's requests): every request ends, those that fail
    fail with the prefill pool's error, the rest are exact, and no request is left waiting
    for a result that will never come."""
    rng = np.random.default_rng(seed)
    h = disaggregated(chunked(budget=64, chunk=32), max_seq_len=128, page_size=8, prefill_chunk=32,
                      num_slots=3, decode=dict(num_pages=16))
    h.decode_engine.landing_polls = 1
    h.engine.fail_extract_calls = {5, 11, 12, 20}
    run_random_load(h, rng, sorted(int(a) for a in rng.integers(0, 60, size=20)), prompt_max=60,
                    tokens_max=60, cancel_p=0.0, max_steps=5000)
    for c in h.clients:
        assert c.record is not None
        if c.record.finish_reason == "error":
            assert "device lost in extract" in c.record.error
        else:
            c.check(h.engine)
    assert h.engine.recoveries >= 1 and h.decode_engine.recoveries == 0
    assert all(c.stream.request.unapplied == 0 for c in h.clients)
    assert h.sched.preemptions > 0
    all_pages_free(h)


def test_the_two_loops_serve_concurrent_clients():
    """Started: a prefill thread and a decode thread share the requests; many streams at once
    get exact outputs, every transfer is reported, and stop() drains both loops."""
    p, d = pair(num_slots=4, prefill_chunk=32, page_size=8, decode_delay=0.001)
    sched = Scheduler(p, TOK, SchedulerConfig(policy=chunked(budget=64, chunk=32)), decode_engine=d)
    landed: list[KVTransfer] = []
    sched.transfer_listeners.append(landed.append)
    sched.start()
    rng = np.random.default_rng(2)
    jobs = [(random_prompt(rng, int(rng.integers(5, 100))), int(rng.integers(2, 40))) for _ in range(16)]
    streams = [sched.submit(prompt, GenerationParams(max_tokens=n, ignore_eos=True)) for prompt, n in jobs]
    for (prompt, n), stream in zip(jobs, streams):
        tokens, record = collect(stream, timeout=30)
        assert (tokens, record.finish_reason) == expected(p, prompt, n, ignore_eos=True)
        assert record.transfer_end is None or record.transfer_start <= record.transfer_end
    sched.stop(drain=True, timeout=10)
    assert not sched.alive
    assert len(landed) == sched.kv_transfers == 16
    assert sum(t.bytes for t in landed) == sched.kv_transfer_bytes
    assert sched.kv_pages == (0, p.num_pages + d.num_pages)


def test_a_pair_must_agree_on_the_kv_layout():
    with pytest.raises(ValueError, match="page_size 16 vs 8"):
        Scheduler(FakeEngine(page_size=16), TOK, SchedulerConfig(policy=chunked(chunk=64)),
                  decode_engine=FakeEngine(page_size=8))
