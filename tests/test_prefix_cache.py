"""Automatic prefix caching: the allocator's reference counts and eviction order, and the
scheduler reusing cached pages on the fake engine, whose "model" reads every token through the
page tables, so a page holding another sequence's KV changes the output.

A cache that serves wrong KV is the worst bug the engine can have. The random-load test checks
every output against the sequential model, the allocator's invariants after every step, that no
write ever lands in a published page, and that every reference is returned; one test corrupts
the cache on purpose and shows the harness catches it.
"""

from __future__ import annotations

from itertools import takewhile

import numpy as np
import pytest

from cadence.scheduler.pages import PageAllocator, PageKeys
from tests.fakes import (
    ALPHABET, FakeEngine, Harness, chunked, expected, prefill_first, random_prompt, run_random_load,
)


def keys(tokens, page_size=4, salt=None):
    return PageKeys(page_size, b"test", salt).upto(tokens, len(tokens) // page_size)


# --- the allocator (each pool has one page more than the test uses: page 0, the null page) ---


def test_page_keys_name_the_whole_prefix():
    a = keys(list(range(12)))
    assert a == keys(list(range(12))) and len(set(a)) == 3
    changed = keys([99] + list(range(1, 12)))  # the first page differs: so do all after it
    assert all(x != y for x, y in zip(a, changed))
    assert keys(list(range(12)))[:2] == keys(list(range(8)) + [7, 7, 7, 7])[:2]
    assert keys(list(range(12)), salt="tenant-a") != a != keys(list(range(12)), salt="tenant-b")
    assert PageKeys(4, b"other model").upto(list(range(12)), 3) != a


def test_a_published_page_is_shared_and_stays_cached_after_release():
    pages = PageAllocator(num_pages=5, page_size=4, caching=True)
    a: list[int] = []
    pages.grow(a, 8)
    k = keys(list(range(8)))
    assert pages.publish(a[0], k[0]) and pages.publish(a[1], k[1])
    assert not pages.publish(a[1], k[1])  # published already
    b: list[int] = []
    pages.share(b, pages.lookup(k))
    assert b == a and pages.refcount(a[0]) == 2
    pages.release(a)
    assert pages.refcount(b[0]) == 1 and pages.used_count == 2
    pages.release(b)
    assert pages.used_count == 0 and pages.free_count == 4 and pages.cached_count == 2
    assert pages.lookup(k) == [1, 2] and pages.evictable_among([1, 2]) == 2
    pages.check()


def test_a_second_page_with_a_published_key_is_not_cached():
    pages = PageAllocator(num_pages=5, page_size=4, caching=True)
    a, b = [], []
    pages.grow(a, 4), pages.grow(b, 4)
    k = keys([1, 2, 3, 4])
    assert pages.publish(a[0], k[0]) and not pages.publish(b[0], k[0])
    pages.release(b)
    assert pages.cached_count == 1 and pages.lookup(k) == a
    pages.check()


def test_allocation_takes_keyless_pages_first_then_evicts_the_oldest_release_tail_first():
    pages = PageAllocator(num_pages=7, page_size=2, caching=True)
    first, second = [], []
    pages.grow(first, 4), pages.grow(second, 4)  # pages 1, 2 and 3, 4
    k1, k2 = keys([1, 2, 3, 4], 2), keys([5, 6, 7, 8], 2)
    for seq, k in ((first, k1), (second, k2)):
        for page, key in zip(seq, k):
            pages.publish(page, key)
    pages.release(first)  # queued for eviction: 2 (its tail), then 1
    pages.release(second)  # then 4, then 3
    taken: list[int] = []
    assert pages.grow(taken, 4) == [5, 6]  # the key-less ones first
    assert pages.evictions == 0 and pages.cached_count == 4
    assert pages.grow(taken, 10) == [2, 1, 4]
    assert pages.evictions == 3 and pages.lookup(k1) == [] and pages.lookup(k2) == [3]  # its head
    assert pages.cached_count == 1 and pages.evictable_among([3]) == 1
    pages.check()


def test_a_hit_takes_a_page_off_the_eviction_queue():
    pages = PageAllocator(num_pages=3, page_size=2, caching=True)
    seq: list[int] = []
    pages.grow(seq, 4)
    k = keys([1, 2, 3, 4], 2)
    pages.publish(seq[0], k[0]), pages.publish(seq[1], k[1])
    pages.release(seq)
    again: list[int] = []
    pages.share(again, pages.lookup(k[:1]))
    other: list[int] = []
    assert pages.grow(other, 2) == [2]  # the page the hit holds is not evicted
    assert pages.grow(other, 4) is None
    pages.check()


def test_clear_cache_forgets_every_prefix():
    pages = PageAllocator(num_pages=4, page_size=2, caching=True)
    held, gone = [], []
    pages.grow(held, 2), pages.grow(gone, 2)
    pages.publish(held[0], b"held"), pages.publish(gone[0], b"gone")
    pages.release(gone)
    pages.clear_cache()
    assert pages.cached_count == 0 and pages.lookup([b"held"]) == pages.lookup([b"gone"]) == []
    pages.release(held)
    assert pages.free_count == 3
    pages.check()


def test_without_caching_nothing_is_published():
    pages = PageAllocator(num_pages=3, page_size=2)
    seq: list[int] = []
    pages.grow(seq, 2)
    assert not pages.publish(seq[0], b"k") and pages.lookup([b"k"]) == []


def test_a_partial_match_finds_the_page_agreeing_longest_under_its_parent():
    pages = PageAllocator(num_pages=8, page_size=4, caching=True)
    seq: list[int] = []
    pages.grow(seq, 16)
    root = PageKeys(4, b"test").root
    k = keys([1, 2, 3, 4, 5, 6, 7, 8])
    assert pages.publish(seq[0], k[0], root, [1, 2, 3, 4])
    assert pages.publish(seq[1], k[1], k[0], [5, 6, 7, 8])
    assert pages.publish_tail(seq[2], root, [1, 2, 9])  # a partial page: three positions
    assert pages.longest(root, [1, 2, 3, 9]) == (seq[0], 3)
    assert pages.longest(root, [1, 2, 9, 9]) == (seq[2], 3)
    assert pages.longest(root, [1, 7]) in ((seq[0], 1), (seq[2], 1))
    assert pages.longest(root, [2, 1]) == (None, 0) and pages.longest(root, []) == (None, 0)
    assert pages.longest(k[0], [5, 6]) == (seq[1], 2)
    assert pages.longest(k[1], [5, 6]) == (None, 0)  # the same tokens after another prefix
    # a tail that a cached page already begins with adds nothing
    assert not pages.publish_tail(seq[3], root, [1, 2, 3])
    assert pages.cached_count == 3
    first = seq[0]
    pages.release(seq)  # parked: the tail first in the eviction queue, its unpublished page freed
    other: list[int] = []
    assert len(pages.grow(other, 20)) == 5  # four key-less pages, then the tail evicted
    assert pages.evictions == 1 and pages.longest(root, [1, 2, 9]) == (first, 2)
    pages.check()
    pages.clear_cache()
    assert pages.longest(root, [1, 2, 3]) == (None, 0)
    pages.check()


def test_random_traffic_keeps_every_count_exact():
    """Growth, sharing, publishing (whole pages and partial ones) and release at random: after
    every operation each page is in exactly one state, its count is the number of sequences
    holding it, a lookup only ever returns pages published under those keys, and a partial
    match is the longest agreement among the cached pages under its parent (by brute force)."""
    rng = np.random.default_rng(0)
    pages = PageAllocator(num_pages=25, page_size=2, caching=True)
    root = PageKeys(2, b"test").root
    stems = [[int(t) for t in rng.integers(0, 5, 16)] for _ in range(3)]
    seqs: dict[int, tuple[list[int], list[int]]] = {}  # id -> (pages, tokens)
    placed: dict[int, tuple[bytes, list[int]]] = {}  # cached page -> (parent, its tokens)
    tails = matched = 0
    for step in range(4000):
        sid = int(rng.integers(0, 10))
        if sid in seqs and rng.random() < 0.3:
            held, tokens = seqs.pop(sid)
            full = len(tokens) // 2
            if len(tokens) % 2 and pages.refcount(held[full]) == 1:  # its own last page, partial
                parent = keys(tokens, 2)[full - 1] if full else root
                if pages.publish_tail(held[full], parent, tokens[2 * full :]):
                    placed[held[full]] = (parent, tokens[2 * full :])
                    tails += 1
            pages.release(held)
        elif sid not in seqs:
            tokens = stems[int(rng.integers(3))][: int(rng.integers(1, 17))]
            if rng.random() < 0.3:  # a different last token
                tokens = tokens[:-1] + [int(rng.integers(0, 5))]
            held: list[int] = []
            full = len(tokens) // 2
            hit = pages.lookup(keys(tokens, 2)[: full])
            for page, key in zip(hit, keys(tokens, 2)):
                assert pages.published(page) and pages.cache._key[page] == key
            parent = keys(tokens, 2)[len(hit) - 1] if hit else root
            query = tokens[2 * len(hit) : 2 * len(hit) + 2]
            page, agreed = pages.longest(parent, query)
            candidates = [p for p, (under, _) in placed.items() if under == parent and pages.published(p)]
            best = max([sum(1 for _ in takewhile(lambda ab: ab[0] == ab[1], zip(query, placed[p][1])))
                        for p in candidates], default=0)
            assert agreed == best and (page is None) == (best == 0)
            if page is not None:
                assert placed[page][1][:agreed] == query[:agreed]
                matched += 1
            pages.share(held, hit)
            if pages.grow(held, len(tokens)) is None:
                pages.release(held)
                continue
            seqs[sid] = (held, tokens)
        else:
            held, tokens = seqs[sid]
            for i, (page, key) in enumerate(zip(held, keys(tokens, 2))):
                parent = keys(tokens, 2)[i - 1] if i else root
                if pages.publish(page, key, parent, tokens[2 * i : 2 * i + 2]):
                    placed[page] = (parent, tokens[2 * i : 2 * i + 2])
        placed = {p: v for p, v in placed.items() if pages.published(p)}  # evicted ones go
        pages.check()
        counts = np.zeros(25, int)
        for held, _ in seqs.values():
            for page in held:
                counts[page] += 1
        assert [pages.refcount(p) for p in range(25)] == counts.tolist()
    for held, _ in seqs.values():
        pages.release(held)
    assert pages.used_count == 0 and tails > 0 and matched > 0
    pages.check()


# --- the scheduler on the fake engine ---------------------------------------------------------


def prefills_since(h: Harness, step: int, client) -> list[tuple[int, int]]:
    """(start, length) of the chunks prefilled in `client`'s slot from step `step` on."""
    return [(p.start, p.length) for i, p in h.prefills(client) if i >= step]


def cached_harness(engine: FakeEngine, policy=None, **config) -> Harness:
    h = Harness(engine, policy, **config)
    allocator = h.sched.pools[0].pages
    engine.frozen = allocator.published
    return h


@pytest.mark.parametrize("length", [64, 70, 9])
def test_a_repeated_prompt_prefills_only_its_last_token(length):
    """Its whole pages by key, and the page holding its last token copied from the first's
    (for every position but the last, whose logits give the first output)."""
    engine = FakeEngine(num_slots=2, page_size=16)
    h = cached_harness(engine, chunked(budget=128, chunk=64))
    prompt = random_prompt(np.random.default_rng(0), length)
    first = h.submit(prompt, max_tokens=5, ignore_eos=True)
    h.run()
    step, copies = len(h.steps), len(engine.copies)
    second = h.submit(prompt, max_tokens=5, ignore_eos=True)
    h.run()
    assert prefills_since(h, step, second) == [(length - 1, 1)]
    assert (first.record.cached_tokens, second.record.cached_tokens) == (0, length - 1)
    assert (h.sched.prefix_queries, h.sched.prefix_hits) == (2 * length, length - 1)
    assert len(engine.copies) == copies + 1
    for c in (first, second):
        c.check(engine)
    assert first.token_ids == second.token_ids


@pytest.mark.parametrize("shared", [1, 16, 40, 47, 48, 63, 79])
def test_a_hit_covers_every_token_before_the_first_difference(shared):
    """Two prompts that agree on their first `shared` tokens: the second reuses every full page
    inside the shared run by key and the rest of the run from the page after them (a copy),
    and its output is its own, not the first's."""
    rng = np.random.default_rng(shared)
    engine = FakeEngine(num_slots=2, page_size=16)
    h = cached_harness(engine, chunked(budget=128, chunk=64))
    a = random_prompt(rng, 80)
    b = a[:shared] + [t for t in random_prompt(rng, 80 - shared)]
    b[shared] = ALPHABET[(ALPHABET.index(a[shared]) + 1) % len(ALPHABET)]  # they differ right here
    first = h.submit(a, max_tokens=8, ignore_eos=True)
    h.run()
    step = len(h.steps)
    second = h.submit(b, max_tokens=8, ignore_eos=True)
    h.run()
    assert second.record.cached_tokens == shared
    assert prefills_since(h, step, second)[0][0] == shared
    for c in (first, second):
        c.check(engine)


def test_a_prompt_as_large_as_the_pool_computes_rather_than_hold_a_page_to_copy():
    """A partial match holds the page it copies beside its own pages: a prompt that needs every
    page of the pool cannot, so it takes its whole pages and computes the rest (it would else
    wait forever for a page that only its own admission could free)."""
    engine = FakeEngine(num_slots=1, max_seq_len=64, page_size=16)  # 3 pages beside the null page
    h = cached_harness(engine, chunked(budget=64, chunk=64))
    prompt = random_prompt(np.random.default_rng(11), 48)
    first = h.submit(prompt, max_tokens=1, ignore_eos=True)
    h.run()
    other = prompt[:-1] + [ALPHABET[(ALPHABET.index(prompt[-1]) + 1) % len(ALPHABET)]]
    second = h.submit(other, max_tokens=1, ignore_eos=True)
    h.run()
    assert second.record.finish_reason == "length" and second.record.cached_tokens == 32
    for c in (first, second):
        c.check(engine)


def test_a_corrupted_cache_shows_in_the_output():
    """The harness catches wrong KV: with two cached pages' keys swapped, a prompt that hits
    them reads the other page's tokens, and its output is no longer the model's."""
    engine = FakeEngine(num_slots=2, page_size=16)
    h = Harness(engine, chunked(budget=128, chunk=64))
    prompt = random_prompt(np.random.default_rng(1), 60)
    h.submit(prompt, max_tokens=4, ignore_eos=True)
    h.run()
    allocator = h.sched.pools[0].pages
    hit = allocator.lookup(h.clients[0].stream.request.page_keys.keys[:3])
    assert len(hit) == 3
    cache = allocator.cache
    k0, k1 = cache._key[hit[0]], cache._key[hit[1]]
    cache._key[hit[0]], cache._key[hit[1]] = k1, k0
    cache._page[k0], cache._page[k1] = hit[1], hit[0]
    again = h.submit(prompt, max_tokens=4, ignore_eos=True)
    h.run()
    assert again.record.cached_tokens == 59  # three whole pages, and 11 of the fourth
    want, _ = expected(engine, prompt, 4, ignore_eos=True)
    assert again.token_ids != want


def test_the_next_turn_reuses_the_pages_the_reply_filled():
    """A conversation's second prompt is the first, the reply and a new message: the pages the
    reply's decode steps filled are cached too, and so is its last page, partly filled, to the
    token (a reply's last token, never written, is not)."""
    engine = FakeEngine(num_slots=2, page_size=8)
    h = cached_harness(engine, chunked(budget=64, chunk=32))
    rng = np.random.default_rng(2)
    turn1 = random_prompt(rng, 21)
    first = h.submit(turn1, max_tokens=30, ignore_eos=True)
    h.run()
    turn2 = turn1 + first.token_ids + random_prompt(rng, 9)
    second = h.submit(turn2, max_tokens=6, ignore_eos=True)
    h.run()
    # 21 + 30 tokens: the KV of 50 of them was written (the last output was never an input).
    assert second.record.cached_tokens == 50
    for c in (first, second):
        c.check(engine)


def test_an_eos_ended_reply_publishes_only_the_positions_its_kv_filled():
    """A row that samples EOS writes no KV for it: a reply ending on EOS at a page's last
    position leaves that page unpublished as a full page, and a next prompt that goes on past
    the EOS reuses its positions up to the EOS, not the EOS's."""
    engine = FakeEngine(num_slots=1, page_size=4)
    prompt = random_prompt(np.random.default_rng(3), 6)
    want, _ = expected(engine, prompt, 2, ignore_eos=True)
    engine.script = {tuple(prompt): [want[0], 258]}  # the second output is EOS, at position 7
    h = cached_harness(engine, chunked(budget=16, chunk=16))
    c = h.submit(prompt, max_tokens=10)
    h.run()
    assert c.token_ids == [want[0], 258] and c.record.finish_reason == "stop"
    cache = h.sched.pools[0].pages.cache
    assert cache.cached_count == 2 and len(cache._key) == 1  # positions 0-3 whole; 4-6 partial
    after = h.submit(prompt + [want[0], 258] + random_prompt(np.random.default_rng(4), 3), max_tokens=3,
                     ignore_eos=True)
    h.run()
    assert after.record.cached_tokens == 7
    after.check(engine)


def test_salted_requests_share_pages_only_with_the_same_salt():
    engine = FakeEngine(num_slots=2, page_size=16)
    h = cached_harness(engine, chunked(budget=128, chunk=64))
    prompt = random_prompt(np.random.default_rng(4), 70)
    runs = []
    for salt in ("a", "b", "a", None, None):
        runs.append(h.submit(prompt, max_tokens=3, ignore_eos=True, cache_salt=salt))
        h.run()
    assert [c.record.cached_tokens for c in runs] == [0, 0, 69, 0, 69]
    for c in runs:
        c.check(engine)


def test_with_caching_off_nothing_is_reused():
    engine = FakeEngine(num_slots=2, page_size=16)
    h = cached_harness(engine, chunked(budget=128, chunk=64), prefix_caching=False)
    prompt = random_prompt(np.random.default_rng(5), 70)
    for _ in range(2):
        h.submit(prompt, max_tokens=3, ignore_eos=True)
        h.run()
    assert [c.record.cached_tokens for c in h.clients] == [0, 0]
    assert h.sched.kv_pages_cached == 0 and h.sched.prefix_queries == 0


def test_an_engine_failure_forgets_the_cache():
    """recover() rebuilds the KV pool: a prompt cached before the failure is computed afresh."""
    engine = FakeEngine(num_slots=2, page_size=16)
    h = cached_harness(engine, chunked(budget=128, chunk=64))
    prompt = random_prompt(np.random.default_rng(6), 70)
    h.submit(prompt, max_tokens=3, ignore_eos=True)
    h.run()
    assert h.sched.kv_pages_cached == 5  # four whole pages and the last, partly written
    engine.fail_decode_call = engine.decode_calls + 2
    failed = h.submit(random_prompt(np.random.default_rng(7), 20), max_tokens=20, ignore_eos=True)
    h.run()
    assert failed.record.finish_reason == "error" and engine.recoveries == 1
    again = h.submit(prompt, max_tokens=3, ignore_eos=True)
    h.run()
    assert again.record.cached_tokens == 0
    again.check(engine)


def test_the_disaggregated_prefill_pool_caches():
    prefill = FakeEngine(num_slots=2, page_size=16)
    decode = FakeEngine(num_slots=2, page_size=16)
    h = Harness(prefill, chunked(budget=128, chunk=64), decode_engine=decode)
    prefill.frozen = h.sched.pools[0].pages.published
    prompt = random_prompt(np.random.default_rng(8), 70)
    runs = []
    for _ in range(2):
        runs.append(h.submit(prompt, max_tokens=6, ignore_eos=True))
        h.run()
    assert [c.record.cached_tokens for c in runs] == [0, 69]
    assert runs[0].token_ids == runs[1].token_ids == expected(prefill, prompt, 6, True)[0]


def shared_prefix_load(h: Harness, rng, arrivals: list[int], after_step) -> None:
    """`run_random_load` with prompts built from three long shared stems (system prompts), cut
    at random lengths and followed by random tails; some resubmit an earlier request's prompt
    and output (a next turn); greedy and seeded sampling, EOS, cancellations."""
    stems = [random_prompt(rng, 90) for _ in range(3)]

    def prompt(rng) -> list[int]:
        done = [c for c in h.clients if c.record and c.record.finish_reason != "abort"]
        if done and rng.random() < 0.3:
            prev = done[int(rng.integers(len(done)))]
            ids = prev.prompt + [t for t in prev.token_ids if t != 258] + random_prompt(rng, 5)
        else:
            stem = stems[int(rng.integers(3))]
            ids = stem[: int(rng.integers(1, 91))] + random_prompt(rng, int(rng.integers(0, 30)))
        return ids[:200]

    run_random_load(h, rng, arrivals, prompt_max=200, tokens_max=50, cancel_p=0.02, max_steps=20_000,
                    after_step=after_step, prompt=prompt)


@pytest.mark.parametrize("host", [0, 2_000], ids=["device", "host-tier"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", [chunked(budget=100, chunk=32), prefill_first(chunk=32)],
                         ids=["chunked", "prefill-first"])
def test_shared_prefixes_under_a_small_pool_equal_the_uncached_outputs(policy, seed, host):
    """Random arrivals sharing long prefixes over a pool too small for the working set: pages
    are hit, evicted, and preempted requests come back mostly from the cache (and, with a host
    tier of 2,000 bytes, 31 of the fake's pages of 8 int64 ids, evicted pages come back from the host). Every
    output equals the sequential model's, the allocator is consistent after every step, no
    write lands in a published page, and every reference is returned at the end."""
    rng = np.random.default_rng(seed)
    engine = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8, num_pages=32,
                        eos_one_in=40)
    h = cached_harness(engine, policy, host_kv_cache_bytes=host)
    allocator = h.sched.pools[0].pages
    hits = []

    def after_step():
        allocator.check()
        counts = np.zeros(allocator.num_pages, int)
        for r in h.sched.pools[0].running:
            for page in r.pages + r.tail_hold:  # (a page lent for a partial match, till copied)
                counts[page] += 1
        assert [allocator.refcount(p) for p in range(allocator.num_pages)] == counts.tolist()
        hits.append(h.sched.prefix_hits)

    shared_prefix_load(h, rng, sorted(int(a) for a in rng.integers(0, 150, size=40)), after_step)
    for c in h.clients:
        c.check(engine)
    assert h.sched.prefix_hits > 0 and allocator.evictions > 0 and h.sched.preemptions > 0
    fresh = [c for c in h.clients if not c.record.preemptions]
    assert sum(c.record.cached_tokens for c in h.clients) <= h.sched.prefix_hits
    assert any(c.record.cached_tokens % 8 for c in fresh)  # partial matches, copied
    assert h.sched.kv_pages[0] == 0 and allocator.used_count == 0
    assert not h.sched.pools[0].tables.any()
    host_hits = h.sched.stats().host_kv_hits
    assert (host_hits > 0 and engine.inserts > 0) if host else host_hits == engine.inserts == 0


def test_cached_tokens_add_up_to_the_hit_counter():
    """Without preemption, the usage every request reports sums to the scheduler's counter,
    and the queries are every prompt token admitted."""
    rng = np.random.default_rng(9)
    engine = FakeEngine(num_slots=4, prefill_chunk=32, page_size=8)
    h = cached_harness(engine, chunked(budget=100, chunk=32))
    shared_prefix_load(h, rng, sorted(int(a) for a in rng.integers(0, 60, size=20)), lambda: None)
    assert h.sched.preemptions == 0 and h.sched.prefix_hits > 0
    assert sum(c.record.cached_tokens for c in h.clients) == h.sched.prefix_hits
    admitted = [c for c in h.clients if c.record.admitted is not None]
    assert sum(len(c.prompt) for c in admitted) == h.sched.prefix_queries
    for c in h.clients:
        c.check(engine)


# --- the real engine --------------------------------------------------------------------------


def test_multi_turn_conversations_on_the_engine_equal_the_reference(tiny_params, tiny_config, tiny_tokenizer,
                                                                   shared_engine):
    """Three conversations of three turns share a system prompt; each turn re-sends the history
    with the replies. Served together on the tiny model's engine with the cache on, every greedy
    reply equals the reference generator's over the whole prompt, later turns reuse pages the
    earlier ones computed (prompt and reply), and the usage adds up to the hit counter."""
    import random

    from cadence.engine.config import EngineConfig
    from cadence.engine.reference import greedy_generate
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.request import GenerationParams
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
    from tests.conftest import SAMPLING_ENGINE

    # The sampling tests' engine (4 slots of 192 tokens in pages of 16): conversations of up to
    # ~110 tokens. Its compile counter is the process's (the engine is shared).
    engine = shared_engine(EngineConfig(**SAMPLING_ENGINE), "needed")
    before = engine.compilations_after_warmup
    sched = Scheduler(engine, tiny_tokenizer, SchedulerConfig(policy=PolicyConfig(token_budget=48, chunk=32)))
    rng = random.Random(0)
    system = [rng.randrange(3, tiny_config.vocab_size) for _ in range(40)]
    histories = [list(system) for _ in range(3)]
    records, served = [], []
    for turn in range(3):
        prompts = [h + [rng.randrange(3, tiny_config.vocab_size) for _ in range(rng.randint(3, 12))]
                   for h in histories]
        streams = [sched.submit(p, GenerationParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        while not sched.idle():
            sched.step()
        for i, (prompt, stream) in enumerate(zip(prompts, streams)):
            *_, record = list(stream)
            histories[i] = prompt + stream.request.output_ids
            records.append(record)
            served.append((prompt, stream.request.output_ids))
    assert engine.compilations_after_warmup == before  # before the reference compiles its own
    for prompt, output in served:
        assert output == greedy_generate(tiny_params, tiny_config, prompt, 12)
    assert sum(r.cached_tokens for r in records) == sched.prefix_hits > 0
    later = [r.cached_tokens for r in records[3:]]
    assert all(c >= 32 for c in later)  # at least the system prompt's two full pages
    # A later turn also reuses its own previous turn's pages past the system prompt.
    assert max(later) > 40
    assert sched.kv_pages[0] == 0
