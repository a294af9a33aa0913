"""The real engine (tiny model, XLA on CPU) under the scheduler, against the reference generator."""

from __future__ import annotations

import random
import threading
import time

import jax
import numpy as np
import pytest

from cadence.engine import compile_counter
from cadence.engine.config import EngineConfig, ladder
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk, bucket_for
from cadence.engine.programs import sampling_rows
from cadence.engine.reference import greedy_generate
from cadence.model.arith import cdiv
from cadence.model.host_sampling import RequestSampling
from cadence.scheduler.request import GenerationParams
from tests.conftest import SMALL_ENGINE
from tests.fakes import make_scheduler, needs_cpu_kernels, random_prompts, run_all

def GREEDY_ROWS(engine):  # noqa: N802 - reads as the constant it is per engine
    return sampling_rows([RequestSampling()] * engine.config.num_slots)


@pytest.fixture
def engine(shared_engine):
    # test_bitmask.py's engine too (structured output changes no program a plain request runs);
    # what these tests run beyond prefill and decode compiles on first use.
    return shared_engine(EngineConfig(**SMALL_ENGINE), "needed")


def test_buckets_cover_every_length():
    assert ladder(16, 64) == (16, 32, 64) and ladder(16, 100) == (16, 32, 64, 100)
    assert bucket_for((16, 32, 64), 17) == 32 and bucket_for((16, 32, 64), 64) == 64
    with pytest.raises(ValueError):
        bucket_for((16, 32), 33)


def test_engine_matches_reference_token_for_token(engine, tiny_params, tiny_config, tiny_tokenizer):
    """Greedy outputs of many prompts, served together, equal the reference generator's."""
    rng = random.Random(0)
    prompts = random_prompts(rng, 10, tiny_config.vocab_size)
    max_tokens = [rng.randint(1, 40) for _ in prompts]
    params = [GenerationParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    streams = run_all(make_scheduler(engine, tiny_tokenizer), list(zip(prompts, params)))
    for prompt, m, s in zip(prompts, max_tokens, streams):
        assert s.record.finish_reason == "length" and s.record.output_tokens == m
        assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, m)


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_size_does_not_change_greedy_tokens(engine, tiny_params, tiny_config, tiny_tokenizer, chunk):
    prompt = random_prompts(random.Random(1), 1, tiny_config.vocab_size, 180, 180)[0]
    sched = make_scheduler(engine, tiny_tokenizer, chunk=chunk, budget=chunk + 4)
    (s,) = run_all(sched, [(prompt, GenerationParams(max_tokens=20, ignore_eos=True))])
    assert s.record.prefill_chunks == cdiv(180, chunk)
    assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 20)


def test_batch_invariance_with_random_arrivals(engine, tiny_config, tiny_tokenizer):
    """A request's output is the same alone and among others joining and leaving at random."""
    rng = random.Random(2)
    target = random_prompts(rng, 1, tiny_config.vocab_size, 90, 90)[0]
    sampled = GenerationParams(max_tokens=30, ignore_eos=True,
                               sampling=RequestSampling(temperature=0.8, top_k=50, top_p=0.9, seed=5))
    alone = run_all(make_scheduler(engine, tiny_tokenizer), [(target, sampled)])[0].record
    others = random_prompts(rng, 9, tiny_config.vocab_size)
    subs = [(p, GenerationParams(max_tokens=rng.randint(1, 30), ignore_eos=True)) for p in others]
    subs.insert(4, (target, sampled))
    arrivals = sorted(rng.randint(0, 25) for _ in subs)
    crowded = run_all(make_scheduler(engine, tiny_tokenizer), subs, arrivals)[4].record
    assert crowded.text == alone.text and crowded.output_tokens == 30


@pytest.mark.parametrize("policy", ["chunked", "prefill-first"])
def test_no_compilations_after_warmup(engine, tiny_config, tiny_tokenizer, policy):
    rng = random.Random(3)
    prompts = random_prompts(rng, 12, tiny_config.vocab_size, 1, 200)
    subs = []
    for p in prompts:
        sampling = RequestSampling(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([0, 5]),
                                   top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(100))
        subs.append((p, GenerationParams(max_tokens=rng.randint(1, 256 - len(p)), sampling=sampling)))
    # The counter is process-wide (other tests compile the reference generator): count the delta.
    before = engine.compilations_after_warmup
    run_all(make_scheduler(engine, tiny_tokenizer, policy), subs, sorted(rng.randint(0, 30) for _ in subs))
    assert engine.compilations_after_warmup - before == 0


def test_decode_takes_the_cheaper_program(engine):
    """Short contexts (up to the batched buckets): the batched program at the longest slot's
    bucket, whatever the mix."""
    # Pages of 64 tokens: page-table widths (1, 2, 4).
    assert engine._decode_plan(np.asarray([60, 50, 64, 40])) == (True, 1)
    assert engine._decode_plan(np.asarray([20, 30, 20, 250])) == (True, 4)
    assert engine._decode_plan(np.asarray([100])) == (True, 2)


def test_decode_past_the_batched_buckets_follows_lengths(tiny_params, tiny_config):
    e = Engine(tiny_params, tiny_config, EngineConfig(num_slots=4, max_seq_len=512, prefill_chunk=32))
    assert e.config.batched_decode_page_buckets == (4,)  # 256 tokens in pages of 64
    assert e._decode_plan(np.asarray([400, 400, 400, 400])) == (False, 8)
    assert e._decode_plan(np.asarray([20, 20, 20, 300])) == (False, 8)  # one long sequence
    assert e._decode_plan(np.asarray([200, 200, 200, 200])) == (True, 4)
    reference = Engine(tiny_params, tiny_config, EngineConfig(
        num_slots=4, max_seq_len=512, prefill_chunk=32, attention="reference"))
    assert reference._decode_plan(np.asarray([400, 10])) == (True, 8)


def test_cache_is_donated_and_updated_in_place(engine):
    before = engine.cache
    engine.prefill([PrefillChunk(0, [5, 6, 7], 0, False, [3])], GREEDY_ROWS(engine))
    assert before.k[0].is_deleted() and not engine.cache.k[0].is_deleted()
    cfg = engine.config
    compiled = engine._decode.lower(
        engine.params, engine.rope, engine.cache, engine.last_tokens, engine.history,
        np.arange(cfg.num_slots, dtype=np.int32),
        np.zeros(cfg.num_slots, np.int32), np.zeros((cfg.num_slots, cfg.max_pages_per_seq), np.int32),
        sampling_rows([RequestSampling()] * cfg.num_slots), np.int32(1),
    ).compile()
    stats = compiled.memory_analysis()
    # Every cache buffer (and the token history) is aliased input->output, so the program
    # holds one copy, not two.
    history = engine.history.counts.nbytes + engine.history.prompt.nbytes
    assert stats.alias_size_in_bytes >= engine.kv_cache_bytes + history
    assert stats.temp_size_in_bytes < engine.kv_cache_bytes


def test_pool_bytes_are_readable_while_a_program_holds_the_pool(engine):
    """`/metrics` and `/debug/timeline` read the pool's size on the HTTP thread, which can meet
    the engine between a program's donation of the pool and the return of the new one."""
    expected = engine.kv_cache_bytes
    donated = engine.cache
    engine.prefill([PrefillChunk(0, [5, 6, 7], 0, False, [3])], GREEDY_ROWS(engine))
    assert donated.k[0].is_deleted()
    engine.cache, live = donated, engine.cache  # as another thread sees it mid-call
    try:
        assert engine.kv_cache_bytes == expected == live.nbytes
    finally:
        engine.cache = live


def test_warmup_compiles_every_program(tiny_params, tiny_config):
    cfg = EngineConfig(num_slots=2, max_seq_len=128, prefill_chunk=32, min_kv_bucket=64)
    e = Engine(tiny_params, tiny_config, cfg)
    before = compile_counter.count()
    e.warmup()
    programs = [p.name.split("[")[0] for p in e.warm_programs()]
    # Each once at most (fewer where another engine's identical program, a plain function over
    # the same shapes, was lowered already in this process).
    assert compile_counter.count() - before <= len(programs)
    # One width per token bucket: the XLA prefill walks each tile's own pages, whatever the width.
    assert cfg.prefill_page_buckets == (cfg.max_pages_per_seq,)
    assert programs.count("prefill") == len(cfg.prefill_buckets)
    batches = len(cfg.decode_batch_buckets)
    assert cfg.decode_batch_buckets == (1, 2)
    assert programs.count("decode") == len(cfg.decode_page_buckets) * batches == 2  # one width: it skips pages itself
    assert programs.count("decode_batched") == len(cfg.batched_decode_page_buckets) * batches == len(cfg.page_buckets) * 2
    assert programs.count("prefill_pooled") == len(cfg.prefill_buckets)
    assert {"prefill_scored", "extract", "insert", "history", "copy"} <= set(programs)
    jax.block_until_ready(e.cache)


def test_needed_warmup_compiles_the_rest_on_first_use_once(tiny_params, tiny_config):
    """warmup="needed" compiles prefill and decode; a group left out compiles once, on the
    engine's own thread (`prepare`), or when a call needs it; neither counts as a compilation
    after warm-up, and nothing compiles a second time."""
    # Shapes of its own: a program another engine of this process lowered would not lower again.
    cfg = EngineConfig(num_slots=3, max_seq_len=96, prefill_chunk=32, min_kv_bucket=32,
                       page_size=32, structured_output=True)
    e = Engine(tiny_params, tiny_config, cfg)
    assert e.program_groups("needed") == ("prefill", "decode", "copy")
    assert e.program_groups("all") == ("prefill", "scoring", "pooling", "decode", "structured",
                                       "transfer", "history", "copy")
    e.warmup(warmup="needed")
    assert e.ready("copy") and not e.ready("history") and not e.ready("transfer")
    first = e.prepare(["history"])
    assert e.prepare(["history"]) is first  # one compile, whoever asks
    first.result(timeout=60)
    assert e.ready("history") and e.prepare(["history"]) is None
    history = len(e.warm_programs(["history"]))  # (writing a slot's, and reading its sampler's)
    assert e.compilations_on_demand == history == 2 and e.compilations_after_warmup == 0
    e.set_history(0, [5, 6])
    jax.block_until_ready(e.extract([1], 5, 0).k)  # compiled on the call, synchronously
    transfer = history + len(e.warm_programs(["transfer"]))
    assert e.ready("transfer") and e.compilations_on_demand == transfer
    assert e.compilations_after_warmup == 0
    e.set_history(1, [7])
    assert e.compilations_on_demand == transfer and e.compilations_after_warmup == 0


def test_a_request_waits_for_its_programs_while_others_run(tiny_params, tiny_config, tiny_tokenizer):
    """With warmup="needed", a penalized request parks while its program compiles on the
    engine's thread; a plain request submitted with it runs to the end meanwhile; then the
    penalized one runs, and nothing counts as a compilation after warm-up."""
    cfg = EngineConfig(num_slots=3, max_seq_len=96, prefill_chunk=32, min_kv_bucket=32, page_size=32)
    e = Engine(tiny_params, tiny_config, cfg)
    e.warmup(warmup="needed")
    gate, compile_group = threading.Event(), e._compile_group

    def slow(group, programs):
        assert gate.wait(60)
        compile_group(group, programs)

    e._compile_group = slow
    sched = make_scheduler(e, tiny_tokenizer, chunk=32, budget=48)
    penalized = sched.submit([5, 6, 7], GenerationParams(max_tokens=4, sampling=RequestSampling(
        presence_penalty=0.5)))
    plain = sched.submit([8, 9], GenerationParams(max_tokens=4))
    for _ in range(50):
        sched.step()
        if plain.request.finished:
            break
    assert plain.request.finished and len(plain.request.output_ids) == 4
    assert not penalized.request.output_ids and sched.num_waiting == 1
    gate.set()
    deadline = time.monotonic() + 60
    while not sched.idle():
        assert time.monotonic() < deadline
        sched.step()
        time.sleep(0.01)
    assert len(penalized.request.output_ids) == 4
    assert e.compilations_after_warmup == 0 and sched.compilations_on_demand >= 0 and e.ready("history")


@pytest.mark.parametrize("contexts", [[9, 40, 120], [9, 300, 120]], ids=["batched", "length-following"])
def test_decode_runs_only_the_active_rows(tiny_params, tiny_config, shared_engine, contexts):
    """A step decodes the smallest batch bucket holding the active slots. Which slots and how
    many decode together changes no token; an idle slot keeps its next token and the padding
    rows write nothing into the pool."""
    cfg = EngineConfig(num_slots=5, max_seq_len=320, prefill_chunk=64, min_kv_bucket=64, page_size=16)
    assert cfg.decode_batch_buckets == (1, 2, 4, 5)
    e = shared_engine(cfg)  # both cases' (an empty pool each)
    rng = random.Random(6)
    prompts = {slot: random_prompts(rng, 1, tiny_config.vocab_size, n, n)[0]
               for slot, n in zip((0, 2, 4), contexts)}
    tables = np.arange(cfg.pool_pages, dtype=np.int32)[::-1].reshape(cfg.num_slots, -1).copy()
    positions = np.zeros(cfg.num_slots, np.int32)
    for slot, prompt in prompts.items():
        for start in range(0, len(prompt), 64):
            e.prefill([PrefillChunk(slot, prompt[start:start + 64], start, start + 64 >= len(prompt),
                                    tables[slot])], GREEDY_ROWS(e))
        positions[slot] = len(prompt)
    rows = sampling_rows([RequestSampling()] * cfg.num_slots)
    expected = {slot: greedy_generate(tiny_params, tiny_config, p, 3)[1:] for slot, p in prompts.items()}
    schedule = [(0, 2, 4), (2,), (0, 4)]  # three rows in a bucket of 4, one alone, two together
    got = {slot: [] for slot in prompts}
    for active_slots in schedule:
        active = np.isin(np.arange(cfg.num_slots), active_slots)
        before = np.asarray(e.last_tokens)
        pool = [np.asarray(a) for a in e.cache.k + e.cache.v]
        tokens = np.asarray(e.decode(positions, active, rows, tables))[0]
        after = [np.asarray(a) for a in e.cache.k + e.cache.v]
        assert np.array_equal(tokens[~active], before[~active])
        written = {int(tables[s, positions[s] // cfg.page_size]) for s in active_slots}
        for old, new in zip(pool, after):  # only each active row's current page changed
            changed = {int(p) for p in np.flatnonzero((old != new).any(axis=(0, 2, 3)))}
            assert changed <= written
        for s in active_slots:
            got[s].append(int(tokens[s]))
            positions[s] += 1
    assert got == expected  # every slot decoded twice, in different company each time


def test_recover_rebuilds_a_cache_lost_to_a_failed_call(tiny_params, tiny_config):
    e = Engine(tiny_params, tiny_config, EngineConfig(num_slots=2, max_seq_len=64, prefill_chunk=16,
                                                       min_kv_bucket=64))
    e.prefill([PrefillChunk(0, [1, 2, 3], 0, True, [0])], GREEDY_ROWS(e))
    for a in e.cache.k:  # what a program failing after donation leaves behind
        a.delete()
    e.recover()
    token = e.prefill([PrefillChunk(0, [1, 2, 3], 0, True, [1])], GREEDY_ROWS(e))
    assert int(np.asarray(token)[0]) == greedy_generate(tiny_params, tiny_config, [1, 2, 3], 1)[0]


def test_length_following_decode_matches_reference(tiny_params, tiny_config, tiny_tokenizer):
    """Contexts past the batched buckets (a long prompt beside a short one) decode through the
    per-slot loops; the tokens still equal the reference generator's, with nothing compiled."""
    e = Engine(tiny_params, tiny_config, EngineConfig(num_slots=2, max_seq_len=512, prefill_chunk=64))
    e.warmup(warmup="needed")  # plain greedy requests: prefill and decode
    rng = random.Random(4)
    prompts = [random_prompts(rng, 1, tiny_config.vocab_size, 300, 300)[0], [5, 6, 7]]
    params = GenerationParams(max_tokens=24, ignore_eos=True)
    assert not e._decode_plan(np.asarray([301, 4]))[0]  # the path under test
    streams = run_all(make_scheduler(e, tiny_tokenizer), [(p, params) for p in prompts])
    assert e.compilations_after_warmup == 0
    for prompt, s in zip(prompts, streams):
        assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 24)


CPU_KERNELS = dict(attention="cpu", decode_matmul="cpu")


# The default tier: a page size that does not divide the chunk, on XLA and on the CPU kernels.
# Pages of 16 are the full tier's (test_speculative.py serves the same pool of 16-token pages,
# preempting, against the reference: on the CPU kernels in the default tier, on XLA too in the
# full).
@pytest.mark.parametrize("page_size, kernels", [
    pytest.param(16, {}, marks=pytest.mark.slow), (24, {}),
    pytest.param(16, CPU_KERNELS, marks=[needs_cpu_kernels, pytest.mark.slow]),
    pytest.param(24, dict(CPU_KERNELS, decode_steps=4), marks=needs_cpu_kernels),
], ids=["xla-16", "xla-24", "cpu_kernels-16", "cpu_kernels-24-4steps"])
def test_a_pool_that_runs_dry_preempts_and_tokens_still_equal_the_reference(
        tiny_params, tiny_config, tiny_tokenizer, page_size, kernels):
    """Four slots over a pool that holds exactly one longest sequence (and the null page, which
    no sequence holds): requests are preempted
    and recomputed, pages are reused in scattered orders, and every greedy output still equals
    the reference generator's, with nothing compiled after warm-up. Page sizes that divide
    the chunk and that do not; XLA's decode, and the CPU kernels' (`model.cpu_kernels`), one
    and four steps per dispatch."""
    cfg = EngineConfig(num_slots=4, max_seq_len=192, prefill_chunk=32, min_kv_bucket=64,
                       page_size=page_size, num_pages=cdiv(192, page_size) + 1, **kernels)
    e = Engine(tiny_params, tiny_config, cfg)
    e.warmup(warmup="needed")  # plain greedy requests: prefill and decode
    rng = random.Random(5)
    prompts = random_prompts(rng, 8, tiny_config.vocab_size, 1, 100)
    max_tokens = [rng.randint(20, 90) for _ in prompts]
    sched = make_scheduler(e, tiny_tokenizer, chunk=32, budget=48)
    subs = [(p, GenerationParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, max_tokens)]
    streams = run_all(sched, subs, sorted(rng.randint(0, 20) for _ in subs))
    assert sched.preemptions > 0 and e.compilations_after_warmup == 0
    assert sched.kv_pages == (0, cfg.num_pages)
    for prompt, m, s in zip(prompts, max_tokens, streams):
        assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, m)
