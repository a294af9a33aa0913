"""llama.cpp's stateful samplers, Mirostat (1 and 2) and adaptive-p, on the device against slow
references written after llama.cpp's samplers (a sort, float64), their state carried from token
to token in the slot's history; then through the engine and the scheduler: a request on either
draws what the reference draws from the model's logits, token after token, alone or among
others, preempted and recomputed, served disaggregated or with drafts."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.engine.config import EngineConfig
from cadence.engine.reference import greedy_generate
from cadence.model import control, cpu_kernels
from cadence.model.host_sampling import RequestSampling, SamplingRows
from cadence.model.sampling import MIROSTAT_M, TokenHistory, choose
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.conftest import ONE_LONGEST, SAMPLING_ENGINE, compiled
from tests.fakes import needs_cpu_kernels, random_prompts, run_all
from tests.tiny_models import full_logits


def softmax(x: np.ndarray) -> np.ndarray:
    p = np.exp(x - x.max())
    return p / p.sum()


def llama_mirostat(logits: np.ndarray, s: RequestSampling, mu: float) -> dict[int, float]:
    """{token: probability} that llama-server's chain on Mirostat (its temperature, then
    mirostat or mirostat_v2) draws one row of `logits` from at bound `mu`, in float64: the
    candidates sorted, Mirostat 2 cutting at the first whose surprise passes mu, Mirostat 1
    keeping the k likeliest from its Zipf estimate over the 100 likeliest; at a temperature of
    0 the likeliest token alone."""
    if s.temperature <= 0:
        return {int(np.argmax(logits)): 1.0}
    x = logits.astype(np.float64) / s.temperature
    order = np.argsort(-x, kind="stable")
    x = x[order]
    p = softmax(x)
    if s.mirostat == 2:
        n = max(int(np.searchsorted(-np.log2(p), mu, side="right")), 1)
    else:
        m = min(MIROSTAT_M, len(x))
        t = np.log(np.arange(2, m + 1) / np.arange(1, m))
        s_hat = np.sum(t * np.log(p[: m - 1] / p[1:m])) / np.sum(t * t)
        e = s_hat - 1
        k = (e * 2**mu / (1 - float(len(x)) ** -e)) ** (1 / s_hat)
        n = max(int(min(k, len(x))), 1)
    return dict(zip(order[:n].tolist(), softmax(x[:n]).tolist()))


def llama_adaptive(logits: np.ndarray, s: RequestSampling, state) -> tuple[dict[int, float], dict[int, float]]:
    """({token: probability} that llama-server's chain ending in adaptive-p draws one row of
    `logits` from, {token: its probability before adaptive-p remade it}) in float64, the chain
    here top-k and the temperature: each candidate's logit remade from its probability's
    distance to the target adapted by `state` (the decayed sum of drawn probabilities, its
    weight); at a temperature of 0 the likeliest token alone."""
    if s.temperature <= 0:
        return {int(np.argmax(logits)): 1.0}, {int(np.argmax(logits)): 1.0}
    x = logits.astype(np.float64) / s.temperature
    order = np.argsort(-x, kind="stable")[: s.top_k or len(x)]
    p = softmax(x[order])
    target = min(max(s.adaptive_target, 0.0), 1.0)
    adapted = target if state[1] == 0 else min(max(2 * target - state[0] / state[1], 0.0), 1.0)
    d = np.abs(p - adapted) / 0.3
    q = softmax(5.0 - 10.0 * d * d / (1 + d))
    return dict(zip(order.tolist(), q.tolist())), dict(zip(order.tolist(), p.tolist()))


def moved(state, s: RequestSampling, p: float) -> tuple[float, float]:
    """llama.cpp's update of a stateful sampler after drawing a token at probability `p` (the
    probability before adaptive-p's remaking)."""
    if s.mirostat:
        return state[0] - s.mirostat_eta * (-math.log2(p) - s.mirostat_tau), state[1]
    return p + s.adaptive_decay * state[0], 1 + s.adaptive_decay * state[1]


def reference(logits: np.ndarray, s: RequestSampling, state) -> tuple[dict[int, float], dict[int, float]]:
    """(what the row draws from, each token's probability for the state's update)."""
    if s.mirostat:
        want = llama_mirostat(logits, s, state[0])
        return want, want
    return llama_adaptive(logits, s, state)


def assert_same(got: dict[int, float], want: dict[int, float], what):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:10])
    ids = sorted(want)
    np.testing.assert_allclose([got[t] for t in ids], [want[t] for t in ids], atol=2e-6, rtol=1e-4,
                               err_msg=str(what))


V2 = RequestSampling(temperature=1.0, seed=3, temperature_last=True, mirostat=2)
V1 = dataclasses.replace(V2, mirostat=1)
ADAPTIVE = RequestSampling(temperature=1.0, seed=4, temperature_last=True, adaptive_target=0.3)
ROWS = [  # (sampling, state)
    (V2, (2.0, 0.0)), (V2, (5.0, 0.0)), (dataclasses.replace(V2, temperature=0.7, seed=8), (8.0, 0.0)),
    (dataclasses.replace(V2, temperature=1.3, mirostat_tau=3.0, mirostat_eta=0.3), (11.0, 0.0)),
    (V2, (0.1, 0.0)),  # below every surprise: the likeliest token alone
    (V1, (3.0, 0.0)), (dataclasses.replace(V1, seed=5), (6.0, 0.0)),
    (dataclasses.replace(V1, temperature=0.8), (9.0, 0.0)),
    (dataclasses.replace(V1, temperature=0.0), (7.0, 0.0)),  # greedy: the likeliest, at probability 1
    # adaptive-p: at its first state (the target's), above and below it, over all and top-k
    (ADAPTIVE, ADAPTIVE.sampler_state), (dataclasses.replace(ADAPTIVE, top_k=40), (6.0, 10.0)),
    (dataclasses.replace(ADAPTIVE, adaptive_target=0.8, adaptive_decay=0.5, top_k=20, seed=9), (0.4, 2.0)),
    (dataclasses.replace(ADAPTIVE, adaptive_target=0.05, temperature=0.7, top_k=100), (1.5, 3.0)),
    (dataclasses.replace(ADAPTIVE, temperature=0.0), (3.0, 10.0)),  # greedy: the likeliest
]
PLAIN = [RequestSampling(temperature=0.9, top_k=30, seed=4), RequestSampling()]  # beside them


@pytest.fixture(scope="module")
def wide():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((len(ROWS) + len(PLAIN), 4096)) * 2.5).astype(np.float32)
    x[:, :6] += 6
    return x


def _choose(x, rows, states, step, k, form):
    """`choose` over rows whose slots hold these sampler states, in `form`: "cpu" (branches),
    "gpu" (every stage computed, `control.branch_free`) or "kernels" (the CPU kernels')."""
    n = len(rows)
    params = SamplingRows.of(rows).params()._replace(logprobs=np.ones(n, bool),
                                                     post_sampling=np.ones(n, bool))
    history = TokenHistory.create(n, x.shape[1], 8)
    history = history.replace(sampler=jnp.asarray(np.asarray(states, np.float32)))
    fn = lambda *args: choose(*args, k)  # noqa: E731
    if form == "kernels":
        fn = cpu_kernels.with_activations(fn, "float32")
    with control.branch_free() if form == "gpu" else contextlib.nullcontext():
        tokens, lp, state = jax.jit(fn)(jnp.asarray(x), params, history, jnp.arange(n), step)
    return np.asarray(tokens), lp, np.asarray(state)


@pytest.mark.parametrize("form", ["cpu", "gpu", pytest.param("kernels", marks=needs_cpu_kernels)])
def test_each_row_draws_from_what_llama_cpps_sampler_leaves_and_moves_its_state(wide, form):
    """Mirostat 1 and 2 at bounds low and high, adaptive-p at targets low and high and states
    on either side, temperatures below and above 1, greedy, beside rows on neither: each row
    draws from the tokens and probabilities llama.cpp's sampler leaves (its post-sampling
    logprobs are of them), and its state comes back moved by its token; the other rows' tokens
    are theirs alone and their state stays."""
    rows = [r for r, _ in ROWS] + PLAIN
    states = [state for _, state in ROWS] + [(7.5, 3.0)] * 2
    k, n = 12, len(rows)
    step = jnp.arange(n, dtype=jnp.int32) * 3
    tokens, lp, state = _choose(wide, rows, states, step, k, form)
    token_lp, ids, values = np.asarray(lp.token), np.asarray(lp.ids), np.asarray(lp.values)
    sizes = []
    for i, (row, before) in enumerate(ROWS):
        want, p = reference(wide[i], row, before)
        sizes.append(len(want))
        assert tokens[i] in want, (row, before)
        assert np.exp(token_lp[i]) == pytest.approx(want[tokens[i]], rel=1e-4, abs=2e-6)
        listed = np.isfinite(values[i])
        assert_same(dict(zip(ids[i][listed].tolist(), np.exp(values[i][listed]).tolist())),
                    dict(sorted(want.items(), key=lambda e: -e[1])[:k]), (row, before))
        np.testing.assert_allclose(state[i], moved(before, row, p[tokens[i]]), rtol=1e-5, atol=1e-5)
    assert sizes[4] == sizes[8] == sizes[13] == 1 and len(set(sizes)) > 6  # (they do cut)
    remade = [i for i, (r, _) in enumerate(ROWS) if r.adaptive_target >= 0 and r.temperature > 0]
    for i in remade:  # (adaptive-p moves the probabilities away from the chain's)
        want, p = reference(wide[i], ROWS[i][0], ROWS[i][1])
        assert max(abs(want[t] - p[t]) for t in want) > 0.01
    np.testing.assert_array_equal(state[len(ROWS):], [(7.5, 3.0)] * 2)
    alone, _, _ = _choose(wide[len(ROWS):], PLAIN, [(0.0, 0.0)] * 2, step[len(ROWS):], k, form)
    np.testing.assert_array_equal(tokens[len(ROWS):], alone)


def _run(x, row, state, steps):
    """`steps` tokens of one row over the same logits `x` [1, vocab], each step's state carried
    in the slot's history as the programs carry it: the tokens, the logprob of each under the
    distribution it was drawn from, and the history at the end."""
    params = SamplingRows.of([row]).params()._replace(logprobs=np.ones(1, bool), post_sampling=np.ones(1, bool))

    @jax.jit
    def run(history):
        def step(history, i):
            tokens, lp, state = choose(x, params, history, jnp.zeros(1, jnp.int32), i[None], 1)
            return history.count(jnp.zeros(1, jnp.int32), tokens, params, state), (tokens[0], lp.token[0])
        return jax.lax.scan(step, history, jnp.arange(steps, dtype=jnp.int32))

    history, (tokens, drawn) = run(TokenHistory.create(1, x.shape[1], 8).replace(
        sampler=jnp.asarray([state], jnp.float32)))
    return np.asarray(tokens), np.asarray(drawn), history


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_holds_the_average_surprise_near_tau(version):
    """What Mirostat is for: over many tokens from the same distribution, its bound settles
    where the tokens' surprise averages tau bits (6 here, from a start of 2 tau = 12), whereas
    plain sampling at that temperature averages the distribution's entropy, ~9 bits."""
    rng = np.random.default_rng(version)
    x = jnp.asarray((rng.standard_normal((1, 2048)) * 1.5).astype(np.float32))
    row = RequestSampling(temperature=1.0, seed=9, temperature_last=True, mirostat=version,
                          mirostat_tau=6.0, mirostat_eta=0.2)
    _, drawn, history = _run(x, row, row.sampler_state, 400)
    surprise = -drawn / math.log(2)  # (under what Mirostat kept, as it counts it)
    assert abs(float(np.mean(surprise[100:])) - 6.0) < 0.4
    p = softmax(np.asarray(x[0], np.float64))
    assert -np.sum(p * np.log2(p)) > 8.5
    assert float(history.sampler[0, 0]) < 12.0  # (it came down from where it started)


def test_adaptive_p_draws_tokens_as_likely_as_its_target():
    """What adaptive-p is for: over many tokens from the same distribution (30 tokens, each 0.9
    as likely as the one before), the probabilities of the tokens it draws average its target
    where the distribution holds tokens that likely (0.03 here, where plain sampling's average
    0.057), and a higher target draws likelier tokens; its average's weight settles at
    1 / (1 - decay), and the average itself at what it drew."""
    x = np.full((1, 512), -30.0, np.float32)
    x[0, :30] = np.log(0.9) * np.arange(30)
    p = softmax(x[0, :30].astype(np.float64))
    means = {}
    for target in (0.03, 0.15):
        row = RequestSampling(temperature=1.0, seed=2, temperature_last=True, top_k=30, adaptive_target=target)
        tokens, _, history = _run(jnp.asarray(x), row, row.sampler_state, 600)
        drawn = p[tokens]
        means[target] = float(np.mean(drawn[100:]))
        total, weight = np.asarray(history.sampler[0])
        assert weight == pytest.approx(10.0, rel=1e-3)
        assert total / weight == pytest.approx(float(np.mean(drawn[-40:])), abs=0.02)
    assert abs(means[0.03] - 0.03) < 0.005 and float(np.sum(p * p)) > 0.055
    assert means[0.15] > means[0.03] + 0.015


# -- through the engine and the scheduler -------------------------------------------------------


def cut_margin(logits: np.ndarray, s: RequestSampling, mu: float) -> float:
    """How far the reference's cut is from tipping: for Mirostat 2, the nearest token's
    surprise to the bound; for Mirostat 1, its k from the nearest integer (relative)."""
    x = np.sort(logits.astype(np.float64) / s.temperature)[::-1]
    p = softmax(x)
    if s.mirostat == 2:
        return float(np.min(np.abs(-np.log2(p) - mu)))
    m = min(MIROSTAT_M, len(x))
    t = np.log(np.arange(2, m + 1) / np.arange(1, m))
    s_hat = np.sum(t * np.log(p[: m - 1] / p[1:m])) / np.sum(t * t)
    k = ((s_hat - 1) * 2**mu / (1 - float(len(x)) ** (1 - s_hat))) ** (1 / s_hat)
    return abs(k - round(k)) / max(k, 1.0) if k < len(x) else math.inf


def walk_reference(params, config, prompt: list[int], output: list[int], s: RequestSampling):
    """Walks a request's `output` along the reference, token by token: at each position the
    distribution the reference leaves of the model's logits (one forward over the whole
    sequence) at the state carried so far, and the token the request's noise picks from it, as
    the device draws (Gumbel noise under the key of its seed and the token's position), which
    must be the request's. Returns the narrowest margin any choice was made by (a cut's or a
    draw's: the engine's logits may differ from the reference's by float rounding, far less)
    and how many tokens each step left."""
    logits = np.asarray(full_logits(params, config, np.asarray(prompt + output)))[len(prompt) - 1:]
    state, margin, sizes = s.sampler_state, math.inf, []
    for i, token in enumerate(output):
        want, p = reference(logits[i], s, state)
        ids = np.fromiter(want, np.int64)
        drawn = np.full(logits.shape[1], -np.inf, np.float32)
        drawn[ids] = np.log([want[t] for t in ids.tolist()])
        key = jax.random.fold_in(jax.random.key(s.seed), len(prompt) + i)
        scores = np.asarray(jax.random.gumbel(key, drawn.shape, jnp.float32)) + drawn
        assert int(np.argmax(scores)) == token, (s, i)
        best = np.sort(scores[ids])[-2:]
        cut = cut_margin(logits[i], s, state[0]) if s.mirostat else math.inf
        margin = min(margin, cut, best[1] - best[0] if len(ids) > 1 else math.inf)
        sizes.append(len(ids))
        state = moved(state, s, p[token])
    return margin, sizes


# The tiny model's logits are sharp (entropy near 0 bits at temperature 1); at 6 they hold ~5.
HOT = RequestSampling(temperature=6.0, seed=1, temperature_last=True, mirostat=2, mirostat_tau=4.0)
STATEFUL_ROWS = [HOT, dataclasses.replace(HOT, mirostat=1, seed=2),
                 dataclasses.replace(HOT, seed=3, mirostat_tau=6.0, mirostat_eta=0.3),
                 dataclasses.replace(HOT, mirostat=0, adaptive_target=0.3, top_k=20, seed=4),
                 dataclasses.replace(HOT, mirostat=0, adaptive_target=0.7, adaptive_decay=0.5, seed=5)]


def scheduler(engine, tokenizer, **config) -> Scheduler:
    return Scheduler(engine, tokenizer, SchedulerConfig(
        policy=PolicyConfig(name="chunked", token_budget=48, chunk=32), **config))


def _check(streams, subs, tiny_params, tiny_config):
    for (prompt, params), s in zip(subs, streams):
        out = s.request.output_ids
        assert len(out) == params.max_tokens
        if params.sampling.stateful:
            margin, sizes = walk_reference(tiny_params, tiny_config, prompt, out, params.sampling)
            # (the engine's logits and the reference's differ by float32 rounding: ~1e-6 here)
            assert margin > 1e-5, "a choice within rounding of tipping: the comparison says nothing"
            if params.sampling.mirostat:
                assert max(sizes) > 1 and min(sizes) < tiny_config.vocab_size  # (it cut, and drew)
        elif params.sampling.temperature == 0:
            assert out == greedy_generate(tiny_params, tiny_config, prompt, params.max_tokens,
                                          sampling=params.sampling)


@pytest.fixture(params=[1, pytest.param(4, marks=pytest.mark.slow)], ids=["1step", "4steps"])
def engine(request, shared_engine):
    return compiled(shared_engine(EngineConfig(**SAMPLING_ENGINE, decode_steps=request.param), "needed"),
                    "history")


def test_requests_on_stateful_samplers_draw_what_the_reference_draws(engine, tiny_params, tiny_config,
                                                                     tiny_tokenizer):
    """Mirostat 1 and 2 and adaptive-p requests beside greedy, penalized and plainly sampled
    ones, arriving at random, prompts longer than a chunk (their first token drawn after
    several): each draws, token after token, what the reference draws, its state carried in the
    slot's history."""
    rng = random.Random(4)
    prompts = random_prompts(rng, 9, tiny_config.vocab_size, 5, 90)
    rows = [*STATEFUL_ROWS, RequestSampling(), RequestSampling(repetition_penalty=1.5, penalty_window=8),
            RequestSampling(temperature=6.0, top_k=40, seed=5), dataclasses.replace(HOT, seed=7, mirostat=1)]
    subs = [(p, GenerationParams(max_tokens=24, ignore_eos=True, sampling=r)) for p, r in zip(prompts, rows)]
    before = engine.compilations_after_warmup
    streams = run_all(scheduler(engine, tiny_tokenizer), subs,
                      sorted(rng.randint(0, 8) for _ in subs))
    assert engine.compilations_after_warmup == before
    _check(streams, subs, tiny_params, tiny_config)


def test_a_preempted_request_keeps_its_state(tiny_params, tiny_config, tiny_tokenizer, shared_engine):
    """Over a pool that holds one longest sequence, requests on Mirostat and adaptive-p are
    preempted and recomputed (their prompts partly from the prefix cache): the state each had
    when it left its slot comes back with it, so each still draws what the reference draws."""
    e = compiled(shared_engine(EngineConfig(**ONE_LONGEST), "needed"), "history")
    rng = random.Random(9)
    shared = random_prompts(rng, 1, tiny_config.vocab_size, 64, 64)[0]
    prompts = [shared + p for p in random_prompts(rng, 6, tiny_config.vocab_size, 1, 40)]
    subs = [(p, GenerationParams(max_tokens=40, ignore_eos=True, sampling=dataclasses.replace(
        STATEFUL_ROWS[i % len(STATEFUL_ROWS)], seed=10 + i))) for i, p in enumerate(prompts)]
    sched = scheduler(e, tiny_tokenizer, prefix_caching=True)
    streams = run_all(sched, subs, [0, 6, 7, 8, 9, 10])
    assert sched.preemptions > 0 and any(s.request.preemptions for s in streams)
    _check(streams, subs, tiny_params, tiny_config)


def test_the_largest_values_are_a_sorts_without_sorting_the_row():
    """Mirostat 1's m likeliest, gathered from above its m-th largest key (`_largest`): the
    same as sorting, with ties at the cut ahead of a larger value, and a row holding fewer than
    m finite values (the rest -inf), in XLA's form and the CPU kernels'."""
    from cadence.model.sampling import _largest, _order_keys

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3000)).astype(np.float32)
    x[0, :300] = 5.0
    x[0, 1000] = 9.0
    x[1, 50:] = -np.inf
    x[2, ::2] = 1.0
    want = -np.sort(-x, axis=-1)[:, :100]
    for kernels in (False, True):
        fn = lambda v: _largest(v, _order_keys(v), 100)  # noqa: E731
        if kernels:
            if not cpu_kernels.available():
                continue
            fn = cpu_kernels.with_activations(fn, "float32")
        np.testing.assert_array_equal(np.asarray(jax.jit(fn)(jnp.asarray(x))), want)
