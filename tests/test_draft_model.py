"""Speculative decoding with a draft model: its drafts against the reference generator's greedy
continuations (through catch-ups, rejections and evictions), and serving with it against
serving without."""

from __future__ import annotations

import dataclasses
import random

import jax
import numpy as np
import pytest

from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.engine.reference import greedy_generate
from cadence.engine.packing import PrefillChunk
from cadence.model.host_sampling import RequestSampling, SamplingRows
from cadence.scheduler.draft_model import DraftModel
from cadence.scheduler.policy import Plan, propose_drafts, speculates
from cadence.scheduler.request import GenerationParams, Request, State
from cadence.scheduler.speculative import Acceptance, Drafter, SpeculativeConfig
from cadence.server.metrics import Metrics
from tests.conftest import ONE_LONGEST, compiled
from tests.fakes import make_scheduler, run_all

K = 4
# The draft's engine: the target's slots and context, k - 1 decode steps a call, and a pool of
# `pages` pages.
def draft_config(pages: int = 2 * (192 // 16) + 1) -> EngineConfig:
    return EngineConfig(num_slots=4, max_seq_len=192, prefill_chunk=32, min_kv_bucket=192,
                        page_size=16, num_pages=pages, decode_steps=K - 1)


@pytest.fixture(scope="module")
def other_params(tiny_params, tiny_config):
    """The tiny model's weights, each moved by noise as large as itself: a draft model that is
    right sometimes."""
    rng = np.random.default_rng(11)
    return jax.tree.map(lambda w: (w + np.std(w) * rng.standard_normal(w.shape)).astype(w.dtype),
                        tiny_params)


def test_drafts_are_the_draft_models_greedy_continuation(tiny_params, tiny_config, shared_engine):
    """Rows of several lengths (one over several prefill chunks) draft k tokens; then each row's
    sequence moves on as verify steps move it (some or all drafts kept, a token of the
    target's own, plain decode steps, or a sequence cut back as after a preemption): every proposal is what the reference
    generator continues the row's sequence with, so the KV kept from the steps before was right."""
    drafts = DraftModel(shared_engine(draft_config()), K)
    fresh = shared_engine(draft_config(pages=2 * (192 // 16) + 2))  # (another engine)
    rng = random.Random(5)
    seqs = {"a": [5, 6, 7], "b": [rng.randrange(3, 500) for _ in range(70)], "c": [9]}
    for step in range(6):
        rooms = {key: rng.randint(1, K) for key in seqs}
        got = drafts.propose({key: (seqs[key], rooms[key]) for key in seqs})
        for key, seq in seqs.items():
            want = greedy_generate(tiny_params, tiny_config, seq, rooms[key])
            assert got[key] == want, (step, key)
            # The KV the row keeps is its tokens' own, as one prefill of them writes it.
            row = drafts._rows[key]
            np.testing.assert_allclose(_kv(drafts.engine, row.pages, len(row.written)),
                                       _kv(fresh, None, len(row.written), row.written), atol=2e-5)
            kept = rng.choice([len(want), rng.randint(0, len(want))])
            # The target's own token after them, and the tokens of some steps without drafts.
            seq += want[:kept] + [rng.randrange(3, 500) for _ in range(rng.choice([1, 1, 3]))]
        if step == 3:
            del seqs["c"][2:]  # recomputed from its third token
    assert drafts.caught_up < sum(len(s) for s in seqs.values()) + 6 * 3 * 2


def _kv(engine, pages, length, tokens=None) -> np.ndarray:
    """The keys and values of a sequence's first `length` tokens in `pages` of `engine`, or
    those `tokens` write prefilled into its first pages."""
    cfg = engine.config
    if tokens is not None:
        engine.recover()
        pages = list(range(1, 1 + cfg.pages_for(length)))
        engine.prefill([PrefillChunk(0, tokens[at:at + cfg.prefill_chunk], at,
                                     at + cfg.prefill_chunk >= length, pages)
                        for at in range(0, length, cfg.prefill_chunk)], SamplingRows(cfg.num_slots).params())
    handle = engine.extract(list(pages)[: cfg.pages_for(length)], length, 0)
    k, v = (np.asarray(a)[:, :, : cfg.pages_for(length)] for a in (handle.k, handle.v))
    layers, heads, _, _, dim = k.shape
    return np.stack([a.reshape(layers, heads, -1, dim)[:, :, :length] for a in (k, v)])


def test_a_short_pool_takes_back_the_least_recently_drafted_rows(tiny_params, tiny_config, shared_engine):
    """A pool of one longest sequence (12 pages) and three rows of 63-88 tokens: each step's
    rows take pages back from those that drafted least recently, which catch up from their
    first token when they draft again, and a row that does not fit even so drafts nothing.
    Every draft is still the reference generator's."""
    drafts = DraftModel(shared_engine(draft_config(pages=192 // 16 + 1)), K)
    rng = random.Random(2)
    seqs = [[rng.randrange(3, 500) for _ in range(rng.randint(60, 100))] for _ in range(3)]
    for i in [0, 1, 2, 0, 1]:
        got = drafts.propose({i: (seqs[i], K)})
        assert got[i] == greedy_generate(tiny_params, tiny_config, seqs[i], K)
    # Rows of 5, 6 and 6 pages: 2 took 0's, 0 took 1's, 1 took 2's, and each caught up whole.
    assert drafts.evicted == 3
    assert drafts.caught_up == sum(len(seqs[i]) for i in [0, 1, 2, 0, 1])
    # Together the three do not fit: the last drafts nothing, the others are kept.
    assert drafts.propose({i: (seqs[i], K) for i in range(3)}).keys() == {0, 1}
    assert drafts.propose({0: ([3] * 189, K)})  # the drafts' KV reaches max_seq_len
    assert drafts.propose({0: ([3] * 190, K)}) == {}  # past it


def test_a_failed_draft_engine_fails_no_request(tiny_config, shared_engine):
    """A draft engine that raises: the call drafts nothing, the engine recovers, and the next
    call drafts again from scratch."""
    engine = shared_engine(draft_config())
    drafts = DraftModel(engine, K)
    assert drafts.propose({"a": ([5, 6, 7], K)})
    prefill = engine.prefill
    engine.prefill = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("device lost"))
    try:
        assert drafts.propose({"a": ([5, 6, 7, 8], K)}) == {}
    finally:
        engine.prefill = prefill
    assert not drafts.failed and drafts._rows == {}
    assert len(drafts.propose({"a": ([5, 6, 7, 8], K)})["a"]) == K


def test_a_draft_model_must_match_its_target(tiny_params, tiny_config, shared_engine):
    target = shared_engine(EngineConfig(**ONE_LONGEST, speculative_tokens=K))
    with pytest.raises(ValueError, match="4 slots of 192 tokens"):  # 4 verify rows
        DraftModel.for_target(shared_engine(dataclasses.replace(draft_config(), num_slots=2)), target)
    with pytest.raises(ValueError, match="speculative_tokens > 0"):
        DraftModel.for_target(shared_engine(draft_config()), shared_engine(EngineConfig(**ONE_LONGEST)))
    with pytest.raises(ValueError, match="decode_steps is 1"):
        DraftModel(shared_engine(EngineConfig(**ONE_LONGEST)), K)
    assert DraftModel.for_target(shared_engine(draft_config()), target).k == K
    two = DraftModel(shared_engine(dataclasses.replace(draft_config(), num_slots=2)), K)
    assert two.propose({i: ([5 + i, 6], K) for i in range(3)}).keys() == {0, 1}  # a slot a row


@pytest.mark.parametrize("draft", [pytest.param("same", marks=pytest.mark.slow), "other"])
def test_serving_with_a_draft_model_equals_serving_without(tiny_params, tiny_config, tiny_tokenizer,
                                                         shared_engine, other_params, draft):
    """The tiny model served with a draft model and without, over a pool that holds one longest
    sequence (preemptions), greedy, seeded-sampled and penalized requests: the same tokens.
    A draft model with the target's own weights has every greedy draft accepted; one with other
    weights some rejected; nothing compiled after warm-up."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    kinds = [RequestSampling(), RequestSampling(temperature=0.8, seed=9),
             RequestSampling(temperature=1.0, seed=4, presence_penalty=1.5, frequency_penalty=0.5)]
    subs = [(p, GenerationParams(max_tokens=rng.randint(20, 60), ignore_eos=True,
                                 sampling=kinds[i % len(kinds)])) for i, p in enumerate(prompts)]
    arrivals = sorted(rng.randint(0, 30) for _ in subs)
    cfg = EngineConfig(**ONE_LONGEST, speculative_tokens=K, speculative_batch=4)
    target = compiled(shared_engine(cfg, "needed"), "history", "speculative")
    plain = make_scheduler(shared_engine(EngineConfig(**ONE_LONGEST), "needed"), tiny_tokenizer, chunk=32, budget=48)
    want = [s.request.output_ids for s in run_all(plain, subs, arrivals)]
    if draft == "same":
        draft_engine = shared_engine(draft_config(), "needed")
    else:
        draft_engine = Engine(other_params, tiny_config, draft_config())
        draft_engine.warmup(warmup="needed")
    before = target.compilations_after_warmup
    sched = make_scheduler(target, tiny_tokenizer, chunk=32, budget=48, draft_engine=draft_engine)
    streams = run_all(sched, subs, arrivals)
    assert target.compilations_after_warmup == before  # (read before the reference compiles)
    assert [s.request.output_ids for s in streams] == want
    for (prompt, params), out in zip(subs, want):
        if params.sampling.temperature == 0:
            assert out == greedy_generate(tiny_params, tiny_config, prompt, params.max_tokens)
    assert sched.preemptions > 0 and sched.spec_drafted > 0
    greedy = [s.request.drafter.model_acceptance for s in streams if s.request.params.sampling.temperature == 0]
    if draft == "same":
        assert all(a.accepted == a.proposed for a in greedy), [(a.proposed, a.accepted) for a in greedy]
        assert sum(a.proposed for a in greedy) > 0
    else:
        models = [s.request.drafter.model_acceptance for s in streams]
        assert 0 < sum(a.accepted for a in models) < sum(a.proposed for a in models)
    assert sched.kv_pages == (0, cfg.num_pages)


def test_the_flags_refuse_a_draft_model_of_another_vocabulary(tiny_model_dir, tiny_config, tiny_tokenizer,
                                                              monkeypatch):
    """--draft_model's tokenizer must be the model's token for token (one piece changed is
    refused, naming it); --speculative=draft needs --draft_model and --draft_model drafts only
    with it (or by default). On a GPU the model's KV pool leaves room for the draft model."""
    from absl import flags
    from absl.testing import flagsaver

    from cadence.checkpoints.registry import LoadedModel
    from cadence.checkpoints.tokenizer import Tokenizer
    from cadence.server import runtime
    from tests.conftest import tiny_tokenizer_fields

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    path = str(tiny_model_dir[0] / "model")
    fields = tiny_tokenizer_fields(tiny_config)
    old, fields["tokenizer.ggml.tokens"][511] = fields["tokenizer.ggml.tokens"][511], "<|not_the_same|>"
    fields["tokenizer.ggml.merges"] = [m for m in fields["tokenizer.ggml.merges"]  # none making it
                                       if old not in (*m.split(" "), m.replace(" ", ""))]
    target = LoadedModel("tiny", tiny_config, None, Tokenizer.from_gguf_fields(fields), tiny_model_dir[0])
    config = EngineConfig(**ONE_LONGEST, speculative_tokens=K)
    with flagsaver.flagsaver(draft_model=path):
        assert runtime.speculative() == "draft"
        with pytest.raises(ValueError, match=r"model's vocabulary is not tiny's \(token 511 first\)"):
            runtime.load_draft(target, kernels=False)
        draft = runtime.load_draft(dataclasses.replace(target, tokenizer=tiny_tokenizer), kernels=False)
        engine = runtime.draft_engine_from_flags(draft, config, kernels=False)
        assert (engine.config.num_slots, engine.config.decode_steps, engine.num_pages) == (4, K - 1, 4 * 12 + 1)
        # On a GPU, the model's pool sized by free memory leaves the draft model's weights (in
        # the compute dtype) and its pool.
        reserve = runtime.draft_device_bytes(draft, config)
        weights = sum(a.size for a in jax.tree.leaves(draft.params)) * 4
        assert reserve == weights + engine.kv_cache_bytes

        class Gpu:  # (what a GPU's jax.Device reports)
            def memory_stats(self):
                return {"bytes_limit": 2**30, "bytes_in_use": 2**28}

        with monkeypatch.context() as m:
            m.setattr(jax, "default_backend", lambda: "gpu")
            page = 16 * tiny_config.kv_bytes_per_token(np.dtype(runtime.kv_dtype()).itemsize)  # (bf16)
            alone = runtime.kv_pool_pages(target, "float32", 16, Gpu())
            beside = runtime.kv_pool_pages(target, "float32", 16, Gpu(), reserve=reserve)
        assert alone == int(0.9 * 3 * 2**28) // page
        assert abs((alone - beside) * page - 0.9 * reserve) <= page
    for bad in (dict(speculative="draft"), dict(speculative="ngram", draft_model=path)):
        with pytest.raises(flags.IllegalFlagValueError, match="give both, or neither"):
            with flagsaver.flagsaver(**bad):
                pass


def test_a_chats_next_turn_takes_over_the_last_turns_draft_kv(tiny_params, tiny_config, shared_engine):
    """A new row whose tokens start with a finished row's (a chat's next turn) catches up from
    where they part, in that row's pages; one that shares less than a page starts afresh, and a
    row drafting in the same call is never taken over."""
    drafts = DraftModel(shared_engine(draft_config()), K)
    rng = random.Random(8)
    turn = [rng.randrange(3, 500) for _ in range(40)]
    drafts.propose({"turn 1": (turn, K)})
    pages = list(drafts._rows["turn 1"].pages)
    following = turn + [rng.randrange(3, 500) for _ in range(10)]
    before = drafts.caught_up
    got = drafts.propose({"turn 2": (following, K)})
    assert got["turn 2"] == greedy_generate(tiny_params, tiny_config, following, K)
    assert drafts.caught_up - before == 10 and "turn 1" not in drafts._rows
    assert drafts._rows["turn 2"].pages[: len(pages)] == pages
    other = turn[:15] + [rng.randrange(3, 500) for _ in range(20)]  # 15 tokens shared: under a page
    drafts.propose({"other": (other, K)})
    assert "turn 2" in drafts._rows and drafts.caught_up - before == 10 + 35
    both = drafts.propose({"turn 2": (following, K), "again": (following + [7], K)})
    assert set(both) == {"turn 2", "again"} and "turn 2" in drafts._rows


def test_drafts_end_before_the_first_the_draft_model_was_unsure_of(tiny_params, tiny_config):
    """With p_min, a row's drafts are the reference generator's greedy continuation up to the
    first token whose probability there is under p_min; a row left with none is left out. (The
    tiny model with its embedding scaled by 0.3: probabilities of 0.13-0.96, top logits apart
    by 0.13 or more.)"""
    tiny_params = jax.tree_util.tree_map_with_path(
        lambda path, w: w * 0.3 if "embedding" in jax.tree_util.keystr(path) else w, tiny_params)
    engine = Engine(tiny_params, tiny_config, draft_config())
    rng = random.Random(6)
    seqs = {i: [rng.randrange(3, 500) for _ in range(rng.randint(3, 50))] for i in range(4)}
    sure = {}
    for i, seq in seqs.items():
        want, logits = greedy_generate(tiny_params, tiny_config, seq, K, return_logits=True)
        probs = [float(np.max(np.exp(z - z.max()) / np.exp(z - z.max()).sum())) for z in logits]
        sure[i] = want, probs
    cuts = set()
    for p_min in (0.2, 0.5, 0.9):
        engine.recover()
        got = DraftModel(engine, K, p_min=p_min).propose({i: (s, K) for i, s in seqs.items()})
        for i, (want, probs) in sure.items():
            assert all(abs(p - p_min) > 1e-4 for p in probs)  # no draft on the edge
            n = next((j for j, p in enumerate(probs) if p < p_min), K)
            assert got.get(i, []) == want[:n], (p_min, i, probs)
            cuts.add(n)
    assert cuts == {0, 1, K}, (cuts, sure)  # drafts cut after one, none kept, all kept


def test_a_draft_model_sure_of_nothing_costs_a_longer_pause_than_ngrams_finding_nothing():
    """A step in which the draft model ran and was sure of no token is a failure as drafts
    that fail are (PAUSE steps, doubled while it repeats); n-grams finding nothing cost nothing
    and sit out MISS_PAUSE."""
    def sat_out(a: Acceptance) -> int:
        steps = 0
        while not a.wants():
            steps += 1
        return steps

    drafter = Drafter()
    cheap, costly = drafter.acceptance, drafter.model_acceptance
    cheap.observe(0, 0)
    costly.observe(0, 0)
    assert (sat_out(cheap), sat_out(costly)) == (Acceptance.MISS_PAUSE, Acceptance.PAUSE)
    costly.observe(0, 0)
    assert sat_out(costly) == min(2 * Acceptance.PAUSE, Acceptance.MAX_PAUSE)


def test_a_row_drafts_its_own_ngrams_first_and_the_draft_model_where_they_find_nothing(
        tiny_params, tiny_config, tiny_tokenizer, shared_engine):
    """With a draft model, a row whose sequence repeats drafts its n-grams (the draft model is
    not asked for it), a row whose sequence offers nothing drafts the draft model's greedy
    continuation; each verify step's outcome goes to the record of the source that drafted; a
    row whose own drafts sit out (they failed) drafts from the draft model, and one whose draft
    model sits out as well does not draft."""
    model = DraftModel(shared_engine(draft_config()), K)
    engine_config = EngineConfig(**ONE_LONGEST, speculative_tokens=K, speculative_batch=4)

    def decoding(prompt: list[int]) -> Request:
        r = Request(prompt, GenerationParams(max_tokens=64), 64, tiny_tokenizer, lambda event: None)
        r.state = State.DECODING
        return r

    def step(plan: Plan) -> dict[Request, list[int]]:
        assert speculates(plan, plan.decode, engine_config, SpeculativeConfig(), model=True)
        return propose_drafts(plan, K, 192, 16, free_pages=100, model=model)

    rng = random.Random(3)
    repeats, fresh = decoding([5, 6, 7, 8, 9, 5, 6, 7]), decoding(rng.sample(range(10, 500), 30))
    plan = Plan(decode=[repeats, fresh])
    drafts = step(plan)
    assert drafts == {repeats: [8, 9, 5, 6],
                      fresh: greedy_generate(tiny_params, tiny_config, fresh.prompt_ids, K)}
    assert set(model._rows) == {fresh}  # the draft model ran for the fresh row alone
    repeats.drafter.observe(drafts[repeats], [8, 1, 2])
    fresh.drafter.observe(drafts[fresh], drafts[fresh] + [1])
    own, by_model = repeats.drafter.acceptance, fresh.drafter.model_acceptance
    assert (own.proposed, own.accepted, by_model.proposed, by_model.accepted) == (4, 1, K, K)
    assert repeats.drafter.model_acceptance.proposed == fresh.drafter.acceptance.proposed == 0
    assert fresh.drafter.acceptance.pause == Acceptance.MISS_PAUSE  # its n-grams found nothing

    for _ in range(2):  # the repeating row's n-grams keep failing: they sit out
        own.observe(4, 0)
    assert own.pause == Acceptance.PAUSE
    drafts = step(Plan(decode=[repeats]))
    assert drafts == {repeats: greedy_generate(tiny_params, tiny_config, repeats.prompt_ids, K)}
    repeats.drafter.observe(drafts[repeats], [0])
    assert (repeats.drafter.model_acceptance.proposed, own.proposed) == (K, 12)
    repeats.drafter.model_acceptance.observe(0, 0)  # the draft model now sits out too
    assert not speculates(Plan(decode=[repeats]), [repeats], engine_config, SpeculativeConfig(), model=True)


def test_a_serving_draft_model_and_ngrams_each_draft(tiny_params, tiny_config, tiny_tokenizer, shared_engine):
    """Served with a draft model (the target's own weights), prompts that repeat and prompts
    that do not: rows draft from their n-grams and from the draft model, each source's record
    counts its own, every draft of the draft model is accepted, and the output is the
    reference generator's. /metrics reports the draft model's share and its KV pool (a
    scheduler without one reports neither)."""
    rng = random.Random(12)
    block = [rng.randrange(3, 500) for _ in range(12)]
    prompts = [block * 4, [rng.randrange(3, 500) for _ in range(40)], block * 2 + [7, 8]]
    subs = [(p, GenerationParams(max_tokens=40, ignore_eos=True)) for p in prompts]
    cfg = EngineConfig(**ONE_LONGEST, speculative_tokens=K, speculative_batch=4)
    target = compiled(shared_engine(cfg, "needed"), "speculative")
    draft_engine = shared_engine(draft_config(), "needed")
    sched = make_scheduler(target, tiny_tokenizer, chunk=32, budget=48, draft_engine=draft_engine)
    streams = run_all(sched, subs)
    for (prompt, params), s in zip(subs, streams):
        assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, params.max_tokens)
    own = [s.request.drafter.acceptance for s in streams]
    by_model = [s.request.drafter.model_acceptance for s in streams]
    assert sum(a.proposed for a in own) > 0 and sum(a.proposed for a in by_model) > 0
    assert all(a.accepted == a.proposed for a in by_model)
    assert sched.spec_drafted == sum(a.proposed for a in own + by_model)
    stats = sched.stats().draft
    assert (stats.draft_tokens, stats.accepted_tokens) == (sum(a.proposed for a in by_model),) * 2
    assert stats.kv_pages_total == draft_engine.num_pages and 0 < stats.kv_pages_used < stats.kv_pages_total
    assert stats.caught_up_tokens == sched.draft.caught_up >= len(prompts[1])  # (its prompt, at least)
    scraped = Metrics(sched, "tiny").render().decode()
    for name, value in [("draft_model_draft_tokens_total", stats.draft_tokens),
                        ("draft_model_kv_pages_used", stats.kv_pages_used),
                        ("draft_model_caught_up_tokens_total", stats.caught_up_tokens)]:
        assert f'cadence:{name}{{model_name="tiny"}} {value:.1f}' in scraped
    plain = make_scheduler(target, tiny_tokenizer, chunk=32, budget=48)
    assert plain.stats().draft is None and "draft_model" not in Metrics(plain, "tiny").render().decode()
