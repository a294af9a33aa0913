"""Speculative decoding: the n-gram drafts against a brute-force search, acceptance, and the
engine's verify program against plain decoding."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.packing import PrefillChunk
from cadence.engine.reference import greedy_generate
from cadence.model import cpu_kernels
from cadence.model.host_sampling import RequestSampling, SamplingRows
from cadence.scheduler.speculative import Acceptance, Drafter, NgramDrafts, SpeculativeConfig
from cadence.scheduler.grammar import GrammarCompiler, JsonSchema, Regex, TokenSet
from cadence.scheduler.request import GenerationParams
from cadence.server.metrics import Metrics
from tests.conftest import ONE_LONGEST, compiled
from tests.fakes import (
    ALPHABET, TOK, FakeEngine, Harness, chunked, ids, make_scheduler, prefill_first, run_all,
    run_random_load,
)


def brute_force(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix (min_n..max_n
    tokens) of `seq`."""
    end = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if n >= end:
            continue
        suffix = seq[end - n:]
        for start in range(end - n - 1, -1, -1):
            if seq[start:start + n] == suffix:
                return seq[start + n: min(start + n + k, end)]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_ngram_drafts_equal_a_brute_force_search(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        drafts = NgramDrafts(min_n, max_n, max_candidates=10**6)
        drafts.extend(seq[: len(seq) // 2])
        drafts.extend(seq[len(seq) // 2:])  # in two parts, as a prompt then its output
        k = rng.randrange(1, 6)
        assert drafts.propose(k) == brute_force(seq, min_n, max_n, k), (seq, k)


def test_truncate_forgets_as_if_never_seen():
    rng = random.Random(7)
    for _ in range(100):
        seq = [rng.randrange(4) for _ in range(30)]
        cut = rng.randrange(0, 30)
        drafts = NgramDrafts(2, 4)
        drafts.extend(seq)
        drafts.truncate(cut)
        fresh = NgramDrafts(2, 4)
        fresh.extend(seq[:cut])
        assert drafts.tokens == fresh.tokens and drafts._where == fresh._where


def test_quoted_text_is_drafted_whole():
    document = list(range(100, 160))
    drafts = NgramDrafts(2, 4)
    drafts.extend(document + [1, 2, 3] + document[10:13])  # the answer starts quoting
    assert drafts.propose(5) == document[13:18]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafts(3, 2)
    with pytest.raises(ValueError):
        NgramDrafts(0, 2)


def test_acceptance_pauses_a_request_whose_drafts_fail_then_retries():
    a = Acceptance()
    a.observe(4, 4)
    assert a.wants()
    for _ in range(3):
        a.observe(4, 0)
    assert a.rate < Acceptance.LOW
    sat_out = 0
    while not a.wants():
        sat_out += 1
    assert sat_out == Acceptance.PAUSE
    assert (a.proposed, a.accepted) == (16, 4)


# -- the engine's verify program against plain decoding ------------------------------------------

SPEC = EngineConfig(num_slots=4, max_seq_len=128, prefill_chunk=64, min_kv_bucket=64, page_size=16,
                    speculative_tokens=4, speculative_batch=4)
PROMPTS = {0: [5, 6, 7, 8, 9], 2: list(range(30, 70)), 3: [11, 12]}  # slot 1 stays idle
ACTIVE = np.isin(np.arange(SPEC.num_slots), list(PROMPTS))


def _prefilled(shared_engine, config, rows):
    e = shared_engine(config)  # as new: an empty pool
    tables = fixed_page_tables(config)
    e.prefill([PrefillChunk(s, p, 0, True, tables[s]) for s, p in PROMPTS.items()], rows.params())
    positions = np.zeros(config.num_slots, np.int32)
    for s, p in PROMPTS.items():
        positions[s] = len(p)
    return e, tables, positions


def _rows(temperature, logprobs=0):
    rows = SamplingRows(SPEC.num_slots)
    for s in PROMPTS:
        rows.set(s, RequestSampling(temperature=temperature, seed=s + 1), logprobs=logprobs > 0)
    return rows


def _plain(shared_engine, config, rows, n):
    """n tokens per slot by plain decoding, and each step's logprobs."""
    e, tables, positions = _prefilled(shared_engine, config, rows)
    first = np.asarray(e.last_tokens)
    steps = [e.decode(positions + i, ACTIVE, rows.params(), tables) for i in range(n)]
    tokens = np.concatenate([first[None]] + [np.asarray(s) for s in steps])  # [n + 1, slots]
    return tokens, [s.logprobs() for s in steps]


# Each slot's drafts, step after step: right ones (all accepted), a wrong one at an index (the
# drafts before it accepted, the target's token emitted there), none, and runs past the end.
def _drafts(truth: list[int], emitted: int, plan: str, k: int) -> list[int]:
    ahead = truth[emitted + 1: emitted + 1 + k]
    if plan == "right":
        return ahead
    if plan == "none":
        return []
    if plan.startswith("wrong@"):
        at = int(plan[6:])
        return [t if i != at else (t + 1) % 50 for i, t in enumerate(ahead)]
    return ahead[: int(plan)]  # "2": two right drafts


@pytest.mark.parametrize("temperature,logprobs", [(0.0, 0), (20.0, 3)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kernels", [pytest.param("xla", marks=pytest.mark.slow), "reference", "cpu"])
def test_verify_gives_what_plain_decoding_gives(shared_engine, temperature, logprobs, kernels):
    """Verify steps with drafts right, wrong at each index, short and absent, interleaved with
    plain decode steps: every slot's tokens (and logprobs) are plain decoding's, token for
    token, and each step emits what its drafts earned; the KV verify wrote is what decode
    reads after (the decode steps after a verify continue the same sequence)."""
    if kernels == "cpu" and not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    config = dataclasses.replace(SPEC, attention=kernels,
                                 decode_matmul="cpu" if kernels == "cpu" else "xla")
    rows = _rows(temperature, logprobs)
    n = 30
    truth, truth_lp = _plain(shared_engine, config, rows, n)
    e, tables, positions = _prefilled(shared_engine, config, rows)
    plans = {0: ["right", "wrong@0", "2", None, "wrong@3", "none", "right"],  # None: plain decode
             2: ["wrong@1", "right", "none", None, "wrong@2", "1", "none"],
             3: ["none", "wrong@3", "right", None, "right", "wrong@0", "3"]}
    got = {s: [] for s in PROMPTS}  # tokens after the prompt's first, per slot
    lps = {s: [] for s in PROMPTS}
    for step in range(7):
        drafts = np.zeros((config.num_slots, config.speculative_tokens), np.int32)
        lens = np.zeros(config.num_slots, np.int32)
        if plans[0][step] is None:
            result = e.decode(positions, ACTIVE, rows.params(), tables)
            emitted = np.where(ACTIVE, 1, 0)
        else:
            want = {}
            for s in PROMPTS:
                d = _drafts(truth[:, s].tolist(), len(got[s]), plans[s][step], config.speculative_tokens)
                d = d[: max(0, n - 1 - len(got[s]))]  # never past the plain run's tokens
                drafts[s, : len(d)], lens[s] = d, len(d)
                ahead = truth[len(got[s]) + 1:, s].tolist()
                want[s] = next((i for i, t in enumerate(d) if t != ahead[i]), len(d)) + 1
            result = e.verify(positions, ACTIVE, rows.params(), tables, drafts, lens)
            emitted = result.emitted()
            assert emitted[1] == 0
            for s in PROMPTS:
                assert emitted[s] == want[s], (s, step, plans[s][step])
        tokens, lp = np.asarray(result), result.logprobs()
        for s in PROMPTS:
            got[s] += tokens[: emitted[s], s].tolist()
            lps[s] += [(lp.token[i, s], lp.ids[i, s].tolist()) for i in range(emitted[s])]
        positions = positions + emitted.astype(np.int32)
    for s in PROMPTS:
        m = len(got[s])
        assert m >= 10 and got[s] == truth[1: m + 1, s].tolist(), s
        if logprobs:
            want_lp = [(truth_lp[i].token[0, s], truth_lp[i].ids[0, s].tolist()) for i in range(m)]
            for (a, ids), (b, want_ids) in zip(lps[s], want_lp):
                assert ids == want_ids
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    if temperature:  # tokens that move, not one repeated (the tiny model's greedy repeats)
        assert len(set(got[2])) > 1


def test_verify_stops_at_a_stop_id_inside_the_drafts(shared_engine):
    """A row whose accepted tokens reach its stop id ends there: it emits the stop token and
    nothing after, though the drafts after it were right."""
    rows = _rows(20.0)
    truth, _ = _plain(shared_engine, SPEC, rows, 6)
    stop = int(truth[3, 2])  # slot 2's third token after its first
    first_at = truth[1:, 2].tolist().index(stop) + 1
    rows.set(2, RequestSampling(temperature=20.0, seed=3), stop_ids=(stop,))
    e, tables, positions = _prefilled(shared_engine, SPEC, rows)
    drafts = np.zeros((SPEC.num_slots, 4), np.int32)
    drafts[2] = truth[1:5, 2]  # all right
    lens = np.where(np.arange(SPEC.num_slots) == 2, 4, 0).astype(np.int32)
    result = e.verify(positions, ACTIVE, rows.params(), tables, drafts, lens)
    assert result.emitted()[2] == first_at
    assert np.asarray(result)[first_at - 1, 2] == stop


def test_verify_refuses_what_it_cannot_run(shared_engine):
    e, tables, positions = _prefilled(shared_engine, SPEC, _rows(0.0))
    rows = _rows(0.0).params()
    ok = np.zeros((4, 4), np.int32), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="draft_lens must be in"):
        e.verify(positions, ACTIVE, rows, tables, ok[0], np.full(4, 5, np.int32))
    with pytest.raises(ValueError, match=r"drafts are int32 \[4, 4\]"):
        e.verify(positions, ACTIVE, rows, tables, np.zeros((4, 3), np.int32), ok[1])
    with pytest.raises(ValueError, match="draft tokens must be in"):
        e.verify(positions, ACTIVE, rows, tables, np.full((4, 4), -1, np.int32), ok[1])
    with pytest.raises(ValueError, match="overflow max_seq_len=128"):
        e.verify(np.full(4, 124, np.int32), ACTIVE, rows, tables, *ok[:1], np.full(4, 4, np.int32))
    plain = shared_engine(dataclasses.replace(SPEC, speculative_tokens=0))
    with pytest.raises(ValueError, match="without speculative_tokens"):
        plain.verify(positions, ACTIVE, rows, tables, *ok)
    assert "speculative" not in plain.program_groups()


def test_verify_compiles_at_warmup_and_never_after(tiny_params, tiny_config):
    """Warm-up compiles one verify program per batch bucket ("needed" too: a compile on first
    use would take a core from the first requests); verify steps of every batch size and draft
    count after it compile nothing. Warmed up here with what every request runs, not every
    group ("all" compiles each group `program_groups` names: test_engine.py)."""
    config = dataclasses.replace(SPEC, speculative_batch=2)
    assert config.verify_batch_buckets == (1, 2)
    e = Engine(tiny_params, tiny_config, config)
    assert "speculative" in e.program_groups("needed")
    names = [p.name for p in e.warm_programs(["speculative"])]
    assert names == ["verify[batch=1,pages=8,k=4]", "verify[batch=2,pages=8,k=4]"]
    e.warmup(warmup="needed")
    compiled(e, "speculative")
    tables = fixed_page_tables(config)
    rows = _rows(0.0).params()
    e.prefill([PrefillChunk(s, p, 0, True, tables[s]) for s, p in PROMPTS.items()], rows)
    positions = np.array([5, 0, 40, 2], np.int32)
    for slots, lens in [([0], [0, 0, 0, 0]), ([0, 2], [4, 0, 1, 0]), ([3], [0, 0, 0, 3])]:
        active = np.isin(np.arange(4), slots)
        drafts = np.full((4, 4), 7, np.int32)
        np.asarray(e.verify(positions, active, rows, tables, drafts, np.array(lens, np.int32)))
    with pytest.raises(ValueError, match="up to 2 slots"):
        e.verify(positions, ACTIVE, rows, tables, drafts, np.zeros(4, np.int32))
    assert e.compilations_after_warmup == 0


# -- the scheduler's speculative iterations, over the fake engine -----------------------------------


def _quoting_prompt(rng):
    """A prompt over a few letters: bigrams repeat, so drafts are found (and often right, as
    the quoting model copies what followed before)."""
    return [int(t) for t in rng.choice(ALPHABET[:6], int(rng.integers(4, 60)))]


def _speculative_stats(*engines):
    verified = [v for e in engines for v in e.verified]
    drafted = [(d, n) for _, d, n in verified if d]
    return len(verified), sum(d for d, _ in drafted), sum(n - 1 for _, n in drafted)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", [chunked(budget=100, chunk=32), prefill_first(chunk=32)],
                         ids=["chunked", "prefill-first"])
def test_speculative_random_load_matches_the_sequential_model(policy, seed):
    """Random arrivals of quoting prompts, greedy and seeded sampling, EOS, cancellations and a
    pool that holds one longest sequence (preemptions, prefix-cache hits), decoding with drafts
    of up to 4 tokens: every output equals its lone simulation without drafts, token for token;
    verify steps ran, accepted drafts and rejected some; every page comes back."""
    rng = np.random.default_rng(seed)
    engine = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8, num_pages=33,
                        eos_one_in=60, speculative_tokens=4, quoting=True)
    h = Harness(engine, policy)
    engine.frozen = h.sched.pools[0].pages.published  # verify never writes a published page
    arrivals = sorted(int(a) for a in rng.integers(0, 60, size=24))
    run_random_load(h, rng, arrivals, prompt_max=60, tokens_max=120, cancel_p=0.01,
                    max_steps=20_000, prompt=_quoting_prompt)
    for c in h.clients:
        c.check(h.engine)
    steps, drafted, accepted = _speculative_stats(engine)
    assert steps > 0 and 0 < accepted < drafted
    assert h.sched.spec_drafted == drafted and h.sched.spec_accepted == accepted
    assert h.sched.preemptions > 0
    assert h.sched.kv_pages == (0, engine.num_pages)


def test_speculation_with_stop_strings_groups_and_prefix_hits():
    """Stop strings (found in text, past tokens the verify step accepted), n > 1 groups (forked
    prompts) and a prompt the cache holds: outputs equal speculation off, stop strings cut
    where they would."""
    def run(k):
        engine = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8,
                            speculative_tokens=k, quoting=True)
        h = Harness(engine, prefill_first(chunk=32))
        prompt = ids("abcabdabcabd" * 3)
        h.submit(prompt, max_tokens=60, stop=["AX7r"])
        h.run()
        h.submit(prompt, max_tokens=60)  # a prefix hit, after the first finished
        h.submit_group(ids("xyzxyzxy"), [dict(max_tokens=40, sampling=RequestSampling(
            temperature=0.8, seed=s)) for s in (1, 2, 3)])
        h.run()
        return [(c.token_ids, c.record.finish_reason) for c in h.clients], engine

    plain, _ = run(0)
    spec, engine = run(4)
    assert spec == plain
    assert plain[0][1] == "stop" and plain[1][1] == "length"
    _, drafted, accepted = _speculative_stats(engine)
    assert accepted > 0


def test_speculation_disaggregated_matches_the_sequential_model():
    """Disaggregated, the decode engine verifies drafts: outputs equal the lone simulation."""
    rng = np.random.default_rng(5)
    prefill = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8, quoting=True)
    decode = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8,
                        speculative_tokens=3, quoting=True)
    h = Harness(prefill, chunked(budget=64, chunk=32), decode_engine=decode)
    arrivals = sorted(int(a) for a in rng.integers(0, 30, size=10))
    run_random_load(h, rng, arrivals, prompt_max=60, tokens_max=80, cancel_p=0.0, max_steps=20_000,
                    prompt=_quoting_prompt)
    for c in h.clients:
        c.check(decode)
    assert prefill.verify_calls == 0 and _speculative_stats(decode)[2] > 0


def test_speculation_only_at_small_batch():
    """Above speculative_batch decoding rows the iteration decodes plainly."""
    engine = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8,
                        speculative_tokens=4, speculative_batch=2, quoting=True)
    h = Harness(engine, prefill_first(chunk=32))
    for _ in range(3):
        h.submit(ids("abababababab"), max_tokens=30)
    h.run()
    assert engine.verify_calls == 0  # three rows decoding together throughout
    h.submit(ids("abababababab"), max_tokens=30)
    h.run()
    assert engine.verify_calls > 0
    for c in h.clients:
        c.check(engine)


def test_grammar_rows_draft_what_their_grammar_allows_and_equal_speculation_off():
    """Requests under a grammar draft too: the drafts their grammar does not allow are cut
    before the verify step, which samples each position among what the grammar allows after
    the drafts before it. Outputs equal speculation off, token for token, greedy and sampled,
    beside an unconstrained row; a grammar that ends stops its request as it would."""
    compiler = GrammarCompiler(TOK, TOK.vocab_size)
    specs = [(Regex("(abc|ab)+"), RequestSampling()),
             (Regex("[abc]{8,40}d"), RequestSampling(temperature=0.9, seed=3)),
             (Regex("(ab){6}"), RequestSampling())]

    def run(k):
        engine = FakeEngine(num_slots=4, prefill_chunk=32, max_seq_len=256, page_size=8,
                            speculative_tokens=k, quoting=True)
        h = Harness(engine, prefill_first(chunk=32))
        for spec, sampling in specs:
            h.submit(ids("abcabcababcab"), max_tokens=40, sampling=sampling, grammar=compiler.compile(spec))
        h.submit(ids("abcabcababcab"), max_tokens=40)
        h.run()
        return [(c.token_ids, c.record.finish_reason) for c in h.clients], engine

    plain, _ = run(0)
    spec, engine = run(4)
    assert spec == plain
    assert TOK.decode(plain[2][0]) == "ab" * 6 and plain[2][1] == "stop"
    constrained = [v for v in engine.verified if v[0] < 3 and v[1]]  # (slot, drafts, emitted)
    assert constrained and any(n > 1 for _, _, n in constrained)
    assert any(n <= d for _, d, n in constrained)  # and some drafts rejected


def test_drafter_sits_out_after_finding_nothing():
    d = Drafter()
    assert d.propose([1, 2, 3], [], 4) == []
    d.acceptance.observe(0, 0)
    assert [d.acceptance.wants() for _ in range(Acceptance.MISS_PAUSE + 1)] == [False] * Acceptance.MISS_PAUSE + [True]
    assert d.propose([1, 2, 3], [1, 2], 4) == [3, 1, 2]
    assert d.observe([3, 1, 2], [3, 1, 7]) == 2


# -- the scheduler over the real engine -------------------------------------------------------------


@pytest.mark.parametrize("kernels", [pytest.param("xla", marks=pytest.mark.slow), "cpu"])
def test_speculative_serving_equals_plain_serving_on_the_engine(tiny_params, tiny_config,
                                                                tiny_tokenizer, shared_engine, kernels):
    """The tiny model served with drafts of up to 4 tokens and without, over a pool that holds
    one longest sequence (preemptions, recomputes, prefix-cache hits from shared prompt
    starts): greedy outputs (plain, and penalized over a window) equal the reference generator's,
    seeded-sampled, penalized and Mirostat ones equal serving without drafts; drafts were
    accepted; nothing compiled after warm-up."""
    if kernels == "cpu" and not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [shared[: rng.randint(1, 40)] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))]
               for _ in range(8)]
    kinds = [RequestSampling(), RequestSampling(temperature=20.0, seed=9),
             RequestSampling(temperature=1.0, seed=4, presence_penalty=1.5, frequency_penalty=0.5),
             RequestSampling(repetition_penalty=1.5, frequency_penalty=0.5, penalty_window=6),
             # Mirostat: its bound moves with each token a verify step accepts, and no further
             RequestSampling(temperature=6.0, seed=6, temperature_last=True, mirostat=2, mirostat_tau=4.0)]
    subs = [(p, GenerationParams(max_tokens=rng.randint(20, 80), ignore_eos=True,
                                 sampling=kinds[i % len(kinds)])) for i, p in enumerate(prompts)]
    arrivals = sorted(rng.randint(0, 30) for _ in subs)
    outputs = {}
    for k in (0, 4):
        cfg = EngineConfig(**ONE_LONGEST, speculative_tokens=k, attention=kernels,
                           decode_matmul="cpu" if kernels == "cpu" else "xla")
        # Warmed up with what these requests run (the penalized ones' history, the drafts'
        # verify), before they start; the counters are the process's (the engine is shared).
        e = compiled(shared_engine(cfg, "needed"), "history", *["speculative"] * (k > 0))
        before = e.compilations_after_warmup
        sched = make_scheduler(e, tiny_tokenizer, chunk=32, budget=48)
        outputs[k] = [s.request.output_ids for s in run_all(sched, subs, arrivals)]
        assert e.compilations_after_warmup == before
        assert sched.kv_pages == (0, cfg.num_pages)
    assert sched.spec_accepted > 0 and sched.preemptions > 0
    assert outputs[4] == outputs[0]
    for (prompt, params), out in zip(subs, outputs[4]):
        if params.sampling.temperature == 0:  # (penalties over a window of 6 on two of them)
            assert out == greedy_generate(tiny_params, tiny_config, prompt, params.max_tokens,
                                          sampling=params.sampling)


def test_structured_output_with_drafts_equals_it_without_on_the_engine(tiny_config, tiny_tokenizer,
                                                                         shared_engine):
    """The tiny model under grammars (a regex, a JSON schema) and a token set (allowed_token_ids),
    greedy and sampled, beside an unconstrained row, over a pool that holds one longest sequence
    (preemptions), with drafts of up to 4 tokens and without: the same tokens; drafts of
    constrained rows were verified and accepted; nothing compiled after warm-up."""
    compiler = GrammarCompiler(tiny_tokenizer, tiny_config.vocab_size)
    grammars = [compiler.compile(Regex("(ab|abc|a b ){12,30}")), compiler.compile(Regex("[a-c ]{4,50}\\.")),
                compiler.compile(JsonSchema({"type": "object", "required": ["k"], "properties": {
                    "k": {"type": "string", "minLength": 24, "maxLength": 30}}}))]
    prompt = tiny_tokenizer.encode("ab abc ab abc a b ab abc")
    grammars.append(TokenSet(frozenset(prompt), tiny_config.vocab_size))  # vLLM's allowed_token_ids
    subs = [(prompt, GenerationParams(max_tokens=48, grammar=g, sampling=s)) for g, s in
            zip(grammars, [RequestSampling(), RequestSampling(temperature=1.5, seed=2), RequestSampling(),
                           RequestSampling()])]
    subs.append((prompt, GenerationParams(max_tokens=48, ignore_eos=True)))
    outputs = {}
    for k in (0, 4):
        cfg = EngineConfig(**ONE_LONGEST, speculative_tokens=k)
        e = compiled(shared_engine(cfg, "needed"), "structured", *["speculative"] * (k > 0))
        before = e.compilations_after_warmup
        sched = make_scheduler(e, tiny_tokenizer, chunk=32, budget=48)
        streams = run_all(sched, subs)
        outputs[k] = [(s.request.output_ids, s.record.finish_reason) for s in streams]
        assert e.compilations_after_warmup == before
        accepted = [s.request.drafter.acceptance.accepted if s.request.drafter else 0 for s in streams]
    assert outputs[4] == outputs[0]
    assert all(accepted[:4])  # each constrained row's drafts were accepted
    assert set(outputs[0][3][0]) <= set(prompt)


@pytest.mark.slow
def test_sampled_tokens_are_distributed_as_without_drafts(tiny_tokenizer, shared_engine):
    """A chi-square test on a tiny vocabulary: requests sampled hot among the 2 likeliest
    tokens (the sequence then repeats its n-grams, so drafts come often and half their tokens
    are right), with drafts and without, each request under its own seed (different ones in
    the two runs, so the samples are independent): at every output position the tokens'
    distribution is the same (p > 0.001, per position), and drafts were accepted. The per-seed
    equality of the tests above is the stronger claim; this one is what a client sees of it."""
    from scipy.stats import chi2_contingency

    prompt = [5, 6, 7, 8] * 6
    n, length = 160, 10
    tokens, accepted = {}, 0
    for k, first_seed in ((0, 1000), (4, 5000)):
        cfg = EngineConfig(num_slots=4, max_seq_len=64, prefill_chunk=32, min_kv_bucket=64,
                           page_size=16, speculative_tokens=k)
        e = compiled(shared_engine(cfg, "needed"), *["speculative"] * (k > 0))
        sched = make_scheduler(e, tiny_tokenizer, chunk=32, budget=48)
        subs = [(prompt, GenerationParams(max_tokens=length, ignore_eos=True, sampling=RequestSampling(
            temperature=20.0, top_k=2, seed=first_seed + i))) for i in range(n)]
        tokens[k] = np.array([s.request.output_ids for s in run_all(sched, subs, list(range(n)))])
        accepted = sched.spec_accepted
    assert accepted > 0
    for position in range(1, length):
        seen = sorted(set(tokens[0][:, position]) | set(tokens[4][:, position]))
        table = np.array([[np.sum(tokens[k][:, position] == t) for t in seen] for k in (0, 4)])
        common = table.sum(axis=0) >= 10  # rare tokens pooled, so every expected count is >= 5
        table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
        table = table[:, table.sum(axis=0) > 0]
        if table.shape[1] > 1:
            assert chi2_contingency(table).pvalue > 1e-3, (position, table)


def test_served_with_drafts_over_http_the_text_is_the_reference_and_metrics_count(
        tiny_params, tiny_config, tiny_tokenizer, shared_engine):
    """The app over a speculative engine: a completion's text is the reference generator's,
    streamed or not, and /metrics counts drafts and accepted tokens under vLLM's names."""
    import httpx
    import openai

    from tests.conftest import SERVING_ENGINE, serve_tiny

    prompt = [7, 8, 9, 10] * 6
    want = tiny_tokenizer.decode(greedy_generate(tiny_params, tiny_config, prompt, 40))
    # The drafts' verify compiled before the first request.
    e = compiled(shared_engine(EngineConfig(**SERVING_ENGINE, speculative_tokens=4), "needed"), "speculative")
    before = e.compilations_after_warmup  # the process's (the engine is shared)
    with serve_tiny(e, tiny_tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        args = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                    extra_body={"ignore_eos": True})
        assert client.completions.create(**args).choices[0].text == want
        streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
        assert streamed == want
        text = httpx.get(f"{url}/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:spec_decode")}
    drafted = values["vllm:spec_decode_num_draft_tokens_total"]
    assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= drafted
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert e.compilations_after_warmup == before


def test_flags_turn_speculation_on_and_check_the_ngram_sizes():
    from absl import flags
    from absl.testing import flagsaver

    from cadence.server import runtime

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    assert runtime.engine_config_from_flags().speculative_tokens > 0  # on by default
    with flagsaver.flagsaver(speculative="off"):
        assert runtime.engine_config_from_flags().speculative_tokens == 0
    with flagsaver.flagsaver(speculative="ngram", num_speculative_tokens=3, speculative_max_batch=2,
                             prompt_lookup_min=1, prompt_lookup_max=5):
        engine = runtime.engine_config_from_flags()
        assert (engine.speculative_tokens, engine.speculative_batch) == (3, 2)
        assert runtime.scheduler_config_from_flags("m").speculative == SpeculativeConfig(1, 5)
    with pytest.raises(flags.IllegalFlagValueError, match="prompt_lookup_min must be at most"):
        with flagsaver.flagsaver(prompt_lookup_min=6, prompt_lookup_max=5):
            pass


@pytest.mark.parametrize("name", [pytest.param("xla_rows", marks=pytest.mark.slow), "cpu_rows"])
def test_query_rows_attention_equals_the_reference(name):
    """A few queries per row run as rows of their own: the reference attention's output, with
    GQA, rows of different lengths and a query at -1 (zeros)."""
    if name == "cpu_rows" and not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    import jax.numpy as jnp

    from cadence.model.paged_attention import get_paged_attention, paged_reference_attention

    rng = np.random.default_rng(0)
    pages, size, kv_heads, heads, d = 12, 8, 2, 4, 16
    k_pages = jnp.asarray(rng.standard_normal((kv_heads, pages, size, d)), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal((kv_heads, pages, size, d)), jnp.float32)
    table = jnp.asarray([[3, 7, 1, 0], [5, 2, 9, 11], [4, 6, 8, 10]], jnp.int32)
    positions = jnp.asarray([[5, 6, 7, 8], [20, 21, -1, -1], [0, 1, 2, 3]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 4, heads, d)), jnp.float32)
    want = paged_reference_attention(q, k_pages, v_pages, table, positions)
    got = get_paged_attention(name)(q, k_pages, v_pages, table, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert not np.asarray(got)[1, 2:].any()


def test_acceptance_backs_off_while_drafting_fails_and_recovers_when_it_pays():
    a = Acceptance()
    pauses = []
    for _ in range(5):
        a.observe(0, 0)
        pauses.append(a.pause)
        while not a.wants():
            pass
    assert pauses == [4, 8, 16, 32, 32]
    a.observe(3, 3)  # drafts paid: the next miss pauses briefly again
    a.observe(0, 0)
    assert a.pause == Acceptance.MISS_PAUSE


@pytest.mark.slow  # (programs compiled on first use, off the loop: test_engine)
def test_a_verify_program_left_to_first_use_compiles_off_the_loop(tiny_params, tiny_config,
                                                                  tiny_tokenizer):
    """With a warm-up that leaves verify out (prefill and decode alone), the first iteration
    that could draft starts the verify program's compile on the engine's thread and decodes
    plainly; once it is ready, steps draft. The output is the reference's throughout, and
    nothing compiles after warm-up but that group."""
    prompt = [7, 8, 9, 10] * 6
    want = greedy_generate(tiny_params, tiny_config, prompt, 200)
    config = dataclasses.replace(SPEC, max_seq_len=256)
    e = Engine(tiny_params, tiny_config, config)
    e.warmup(groups=("prefill", "decode"))
    sched = make_scheduler(e, tiny_tokenizer, chunk=32, budget=48)
    stream = sched.submit(prompt, GenerationParams(max_tokens=200, ignore_eos=True))
    sched.step()
    sched.step()  # the first token is applied: the request decodes, and could draft
    assert sched.spec_drafts == 0
    compiling = e.prepare(["speculative"])
    assert compiling is not None  # started by the loop; the same future here
    compiling.result()
    while not sched.idle():
        sched.step()
    assert stream.request.output_ids == want
    assert sched.spec_drafts > 0 and sched.spec_accepted > 0
    assert e.compilations_after_warmup == 0
    assert e.compilations_on_demand == len(config.verify_batch_buckets)
    scraped = Metrics(sched, "tiny").render().decode()  # what /metrics reports of them
    assert f'cadence:compilations_on_demand{{model_name="tiny"}} {e.compilations_on_demand:.1f}' in scraped
    assert 'cadence:compilations_after_warmup{model_name="tiny"} 0.0' in scraped


def test_a_prediction_drafts_what_the_prompt_does_not_hold():
    """A prediction's own index is searched for the answer's end first: its continuation is
    drafted where the prompt holds none, the sequence's own lookup where the prediction has
    nothing, and the drafts it gave are counted as accepted or rejected."""
    prediction = [50, 51, 52, 53, 54, 55, 56, 57]
    drafter = Drafter(SpeculativeConfig(2, 4), prediction)
    assert drafter.propose([1, 2, 3], [50, 51], 3) == [52, 53, 54] and drafter.predicted_at == 2
    assert drafter.observe([52, 53, 54], [52, 53, 99]) == 2
    assert (drafter.prediction_accepted, drafter.prediction_rejected) == (2, 1)
    # Off the prediction: the sequence's own lookup (its prompt's "2 3" was followed by 4, 9),
    # whose drafts are not the prediction's to count.
    assert drafter.propose([1, 2, 3], [50, 51, 52, 53, 2, 3, 4, 9, 2, 3], 2) == [4, 9]
    assert drafter.predicted_at is None
    drafter.observe([4, 9], [4, 7])
    assert (drafter.prediction_accepted, drafter.prediction_rejected) == (2, 1)
    assert Drafter(SpeculativeConfig(2, 4)).propose([1, 2, 3], [50, 51], 3) == []
    # A prediction is read in order: of two equal matches, the one after what was followed.
    drafter = Drafter(SpeculativeConfig(2, 4), [1, 2, 7, 7, 1, 2, 8, 8])
    assert drafter.propose([0], [1, 2], 2) == [7, 7]  # its start, not its most recent match
    drafter.observe([7, 7], [7, 7])
    assert drafter.propose([0], [1, 2, 7, 7, 1, 2], 2) == [8, 8]


def test_a_predicted_answer_is_the_same_answer_in_fewer_steps(tiny_params, tiny_config, tiny_tokenizer,
                                                              shared_engine):
    """OpenAI's Predicted Outputs over a speculative engine: with the answer itself as the
    prediction, or a wrong one, the answer is the one without (the reference's), and usage
    counts the prediction's drafts the model wrote and those it did not; a right prediction
    takes fewer decode steps."""
    import httpx

    from tests.conftest import SERVING_ENGINE, serve_tiny

    e = compiled(shared_engine(EngineConfig(**SERVING_ENGINE, speculative_tokens=4), "needed"), "speculative")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "a b c d e f"}], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True}
    with serve_tiny(e, tiny_tokenizer) as url:
        def ask(**extra) -> dict:
            r = httpx.post(f"{url}/v1/chat/completions", json={**chat, **extra}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        plain = ask(return_token_ids=True)
        answer = plain["choices"][0]["message"]["content"]
        right = ask(prediction={"type": "content", "content": [{"type": "text", "text": answer}]})
        wrong = ask(prediction={"type": "content", "content": "zz " * 30})
        bad = httpx.post(f"{url}/v1/chat/completions", json={**chat, "prediction": {"type": "x"}}, timeout=60)
    ids = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(chat["messages"]))
    assert plain["choices"][0]["token_ids"] == greedy_generate(tiny_params, tiny_config, ids, 40)
    assert right["choices"][0]["message"]["content"] == wrong["choices"][0]["message"]["content"] == answer
    details = right["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 20 and details["rejected_prediction_tokens"] <= 8
    assert wrong["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    assert "completion_tokens_details" not in plain["usage"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction"
