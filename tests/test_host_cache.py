"""The prefix cache's host tier: pages the device's cache evicts are copied to host memory and
back on a later hit. Its LRU bound, the scheduler bringing an evicted prompt back on the fake
engine (whose "model" reads every token through the page tables, so a page restored wrong or
into the wrong place changes the output), and the tiny model's engine giving the reference's
greedy tokens over a prefix that went to the host and came back."""

from __future__ import annotations

import numpy as np
import pytest

from cadence.scheduler.host_cache import HostCache
from tests.fakes import FakeEngine, Harness, Prefill, chunked, random_prompt

# --- the tier alone ---------------------------------------------------------------------------


class Copying:
    """A handle whose pages come to the host when asked (`KVHandle.host_pages`), or fail to."""

    def __init__(self, pages: list[np.ndarray], fails: bool = False):
        self.pages, self.fails, self.started = pages, fails, False

    def to_host_async(self) -> None:
        self.started = True

    def host_pages(self):
        if self.fails:
            raise RuntimeError("the program that extracted them failed")
        return [(p,) for p in self.pages]

    @classmethod
    def from_host_pages(cls, pages, page_size, width):
        return cls([p for p, in pages] + [np.zeros(page_size)] * (width - len(pages)))


def page(value: float, size: int = 4) -> np.ndarray:
    return np.full(size, value)  # 32 bytes


def test_a_saved_run_is_found_from_its_first_key_and_stacked_back():
    host = HostCache(capacity_bytes=1_000)
    handle = Copying([page(1), page(2), page(3)])
    host.save([b"a", b"b", b"c"], handle)
    assert handle.started and b"b" in host and len(host) == 0  # pending until looked up
    assert host.lookup([b"x", b"a"]) == []  # a run starts at the first key
    found = host.lookup([b"a", b"b", b"z", b"c"])
    assert [p.arrays[0][0] for p in found] == [1, 2] and host.bytes == 96 and host.saved == 3
    back = found[0].kind.from_host_pages([p.arrays for p in found], 4, 4)  # (as `Pool.write_pages` stacks them)
    assert [p[0] for p in back.pages] == [1, 2, 0, 0]


def test_the_tier_keeps_its_bytes_and_drops_the_page_used_longest_ago():
    host = HostCache(capacity_bytes=100)  # three pages of 32 bytes
    host.save([b"a", b"b", b"c"], Copying([page(1), page(2), page(3)]))
    host.lookup([b"a"])  # a is now the most recently used
    host.save([b"d"], Copying([page(4)]))
    assert host.lookup([b"b"]) == [] and host.dropped == 1  # b went, not a
    assert len(host.lookup([b"a"])) == 1 and len(host.lookup([b"c"])) == 1 and len(host.lookup([b"d"])) == 1
    assert host.bytes == 96 <= host.capacity
    host.save([b"e"], Copying([np.zeros(20)]))  # 160 bytes: larger than the whole tier
    assert host.lookup([b"e"]) == [] and host.bytes == 96 and host.dropped == 2


def test_a_copy_whose_program_failed_saves_nothing():
    host = HostCache(capacity_bytes=1_000)
    host.save([b"a"], Copying([page(1)], fails=True))
    host.save([b"b"], Copying([page(2)]))
    assert host.lookup([b"a"]) == [] and len(host.lookup([b"b"])) == 1
    assert host.dropped == 1 and host.saved == 1 and b"a" not in host


def test_a_tier_needs_room_and_the_prefix_cache():
    from cadence.scheduler.config import SchedulerConfig

    with pytest.raises(ValueError, match="positive size"):
        HostCache(0)
    with pytest.raises(ValueError, match="needs the prefix cache on"):
        SchedulerConfig(prefix_caching=False, host_kv_cache_bytes=1 << 20)


# --- the scheduler on the fake engine ---------------------------------------------------------


def evict_and_return(host_bytes: int, disaggregated: bool = False):
    """A 100-token prompt; then two others that need the whole pool (8-token pages, 16 usable),
    evicting its pages; then the first again. Returns the harness and the clients.
    `disaggregated`: that pool is a prefill engine's, beside a decode engine of its own."""
    rng = np.random.default_rng(3)
    engine = FakeEngine(num_slots=2, prefill_chunk=32, max_seq_len=128, page_size=8, num_pages=17)
    decode = FakeEngine(num_slots=2, prefill_chunk=32, max_seq_len=128, page_size=8) if disaggregated else None
    h = Harness(engine, chunked(budget=64, chunk=32), decode_engine=decode, host_kv_cache_bytes=host_bytes)
    engine.frozen = h.sched.pools[0].pages.published
    first = random_prompt(rng, 100)
    clients = []
    for prompt in (first, random_prompt(rng, 110), random_prompt(rng, 110), first):
        clients.append(h.submit(prompt, max_tokens=6, ignore_eos=True))
        h.run()
    return h, clients


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated"])
def test_an_evicted_prompt_comes_back_from_the_host_and_prefills_only_the_rest(disaggregated):
    """Colocated, or in a disaggregated pair's prefill pool (the pool that caches)."""
    h, clients = evict_and_return(host_bytes=10_000, disaggregated=disaggregated)
    for c in clients:
        c.check(h.engine)
    stats = h.sched.stats()
    pool = h.sched.pools[0]
    assert pool.pages.evictions > 0 and pool.host.saved > 0
    # Its 12 full pages before the last token: all on the host (the device kept none of them),
    # copied back in one insert, and its prefill starts after them.
    again = clients[-1]
    assert again.record.cached_tokens == stats.host_kv_hits == 96 and h.engine.inserts == 1
    # (the decode pool keeps no cache: nothing is saved from it)
    assert h.decode_engine.extracts == (0 if disaggregated else h.engine.extracts)
    starts = [call.start for step in h.steps[again.first_token_step - 3 :] for call in step
              if isinstance(call, Prefill) and call.slot == again.slot]
    assert min(starts) == 96
    assert stats.host_kv_pages == len(pool.host) > 0 and stats.host_kv_bytes == pool.host.bytes
    pool.pages.check()
    assert h.sched.kv_pages[0] == 0


def test_without_the_tier_the_evicted_prompt_is_computed_again():
    h, clients = evict_and_return(host_bytes=0)
    for c in clients:
        c.check(h.engine)
    assert clients[-1].record.cached_tokens == 0 and h.engine.extracts == h.engine.inserts == 0
    assert h.sched.pools[0].host is None and h.sched.stats().host_kv_hits == 0


def test_an_engine_failure_keeps_what_the_host_holds():
    """The device's KV is rebuilt after a failed call; the host's copies are not the device's,
    so a prompt they hold still comes back from them, and its output is right."""
    h, clients = evict_and_return(host_bytes=10_000)
    h.sched._fail_pool(h.sched.pools[0], "test: the device was lost")
    again = h.submit(clients[0].prompt, max_tokens=6, ignore_eos=True)
    h.run()
    again.check(h.engine)
    assert again.record.cached_tokens == 96 and h.engine.inserts == 2


# --- the tiny model's engine ------------------------------------------------------------------


def test_a_prefix_back_from_the_host_gives_the_reference_tokens(tiny_params, tiny_config, tiny_tokenizer,
                                                                shared_engine):
    """On an engine whose pool holds one longest sequence, a 150-token prompt's pages are
    evicted by the next prompt and copied out; asked again, its prefix comes back from the host
    into other pages, and its greedy reply equals the reference generator's, every token's
    logprob and its 8 likeliest alternatives' within 1e-4 of the reference's log-softmax (the
    tiny random model is so sure of its greedy tokens that their own logprobs barely depend on
    the context; the alternatives' do)."""
    import dataclasses
    import random

    from cadence.engine.config import EngineConfig
    from cadence.engine.reference import greedy_generate, log_softmax, sequence_logits
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.request import GenerationParams
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
    from tests.conftest import SAMPLING_ENGINE

    engine = shared_engine(dataclasses.replace(EngineConfig(**SAMPLING_ENGINE), num_pages=13), "needed")
    sched = Scheduler(engine, tiny_tokenizer, SchedulerConfig(policy=PolicyConfig(token_budget=48, chunk=32),
                                                              host_kv_cache_bytes=64 << 20))
    rng = random.Random(5)
    first = [rng.randrange(3, tiny_config.vocab_size) for _ in range(150)]
    other = [rng.randrange(3, tiny_config.vocab_size) for _ in range(150)]
    served = []
    for prompt in (first, other, first):
        stream = sched.submit(prompt, GenerationParams(max_tokens=10, ignore_eos=True, logprobs=8))
        while not sched.idle():
            sched.step()
        *_, record = list(stream)
        served.append((prompt, stream.request.output_ids, record, stream.request.logprobs))
    stats = sched.stats()
    assert stats.kv_pages_evicted > 0 and stats.host_kv_hits > 0
    # Its 9 full pages before the last token: the 2 the device kept (evicted tail first) and 7
    # from the host.
    assert served[2][2].cached_tokens == 144 and stats.host_kv_hits == 112
    for prompt, output, _, entries in served:
        assert output == greedy_generate(tiny_params, tiny_config, prompt, 10)
        reference = log_softmax(sequence_logits(tiny_params, tiny_config, prompt + output))
        for i, e in enumerate(entries):
            ids = [e.token_id, *(t for t, _ in e.top)]
            got = [e.logprob, *(v for _, v in e.top)]
            np.testing.assert_allclose(got, reference[len(prompt) - 1 + i, ids], atol=1e-4)
