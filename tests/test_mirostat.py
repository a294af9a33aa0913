"""llama.cpp's Mirostat (1 and 2) on the device against a slow reference written after
llama.cpp's samplers (a sort, float64), its bound carried from token to token in the slot's
history; then through the engine and the scheduler: a request on Mirostat draws what the
reference draws from the model's logits, token after token, alone or among others, preempted
and recomputed, served disaggregated or with drafts."""

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


def moved(mu: float, s: RequestSampling, p: float) -> float:
    """llama.cpp's update of the bound after drawing a token at probability `p`."""
    return mu - s.mirostat_eta * (-math.log2(p) - s.mirostat_tau)


def assert_same(got: dict[int, float], want: dict[int, float], what):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:10])
    ids = sorted(want)
    np.testing.assert_allclose([got[t] for t in ids], [want[t] for t in ids], atol=2e-6, rtol=1e-4,
                               err_msg=str(what))


V2 = RequestSampling(temperature=1.0, seed=3, temperature_last=True, mirostat=2)
V1 = dataclasses.replace(V2, mirostat=1)
ROWS = [  # (sampling, mu)
    (V2, 2.0), (V2, 5.0), (dataclasses.replace(V2, temperature=0.7, seed=8), 8.0),
    (dataclasses.replace(V2, temperature=1.3, mirostat_tau=3.0, mirostat_eta=0.3), 11.0),
    (V2, 0.1),  # below every surprise: the likeliest token alone
    (V1, 3.0), (dataclasses.replace(V1, seed=5), 6.0), (dataclasses.replace(V1, temperature=0.8), 9.0),
    (dataclasses.replace(V1, temperature=0.0), 7.0),  # greedy: the likeliest, at probability 1
]
PLAIN = [RequestSampling(temperature=0.9, top_k=30, seed=4), RequestSampling()]  # beside them


@pytest.fixture(scope="module")
def wide():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((len(ROWS) + len(PLAIN), 4096)) * 2.5).astype(np.float32)
    x[:, :6] += 6
    return x


def _choose(x, rows, mus, step, k, form):
    """`choose` over rows whose slots hold these sampler states, in `form`: "cpu" (branches),
    "gpu" (every stage computed, `control.branch_free`) or "kernels" (the CPU kernels')."""
    n = len(rows)
    params = SamplingRows.of(rows).params()._replace(logprobs=np.ones(n, bool),
                                                     post_sampling=np.ones(n, bool))
    history = TokenHistory.create(n, x.shape[1], 8)
    history = history.replace(sampler=jnp.asarray(np.asarray(mus, np.float32)[:, None]))
    fn = lambda *args: choose(*args, k)  # noqa: E731
    if form == "kernels":
        fn = cpu_kernels.with_activations(fn, "float32")
    with control.branch_free() if form == "gpu" else contextlib.nullcontext():
        tokens, lp, state = jax.jit(fn)(jnp.asarray(x), params, history, jnp.arange(n), step)
    return np.asarray(tokens), lp, np.asarray(state)[:, 0]


@pytest.mark.parametrize("form", ["cpu", "gpu", pytest.param("kernels", marks=needs_cpu_kernels)])
def test_each_row_draws_from_what_llama_cpps_mirostat_keeps_and_moves_its_bound(wide, form):
    """Mirostat 1 and 2 at bounds low and high, temperatures below and above 1, greedy, beside
    rows off Mirostat: each Mirostat row draws from the tokens and probabilities llama.cpp's
    keeps (its post-sampling logprobs are of them), and its state comes back moved by its
    token's surprise; the other rows' tokens are theirs alone and their state stays."""
    rows = [r for r, _ in ROWS] + PLAIN
    mus = [mu for _, mu in ROWS] + [7.5, 7.5]
    k, n = 12, len(rows)
    step = jnp.arange(n, dtype=jnp.int32) * 3
    tokens, lp, state = _choose(wide, rows, mus, step, k, form)
    token_lp, ids, values = np.asarray(lp.token), np.asarray(lp.ids), np.asarray(lp.values)
    sizes = []
    for i, (row, mu) in enumerate(ROWS):
        want = llama_mirostat(wide[i], row, mu)
        sizes.append(len(want))
        assert tokens[i] in want, (row, mu)
        assert np.exp(token_lp[i]) == pytest.approx(want[tokens[i]], rel=1e-4, abs=2e-6)
        listed = np.isfinite(values[i])
        assert_same(dict(zip(ids[i][listed].tolist(), np.exp(values[i][listed]).tolist())),
                    dict(sorted(want.items(), key=lambda e: -e[1])[:k]), (row, mu))
        assert state[i] == pytest.approx(moved(mu, row, want[tokens[i]]), rel=1e-5, abs=1e-5)
    assert sizes[4] == sizes[8] == 1 and len(set(sizes)) > 4  # (they do cut)
    np.testing.assert_array_equal(state[len(ROWS):], 7.5)
    alone, _, _ = _choose(wide[len(ROWS):], PLAIN, [0.0, 0.0], step[len(ROWS):], k, form)
    np.testing.assert_array_equal(tokens[len(ROWS):], alone)


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_holds_the_average_surprise_near_tau(version):
    """What Mirostat is for: over many tokens from the same distribution, its bound settles
    where the tokens' surprise averages tau bits (6 here, from a start of 2 tau = 12), whereas
    plain sampling at that temperature averages the distribution's entropy, ~9 bits."""
    rng = np.random.default_rng(version)
    x = jnp.asarray((rng.standard_normal((1, 2048)) * 1.5).astype(np.float32))
    row = RequestSampling(temperature=1.0, seed=9, temperature_last=True, mirostat=version,
                          mirostat_tau=6.0, mirostat_eta=0.2)
    params = SamplingRows.of([row]).params()._replace(logprobs=np.ones(1, bool), post_sampling=np.ones(1, bool))

    @jax.jit
    def run(history):
        def step(history, i):
            tokens, lp, state = choose(x, params, history, jnp.zeros(1, jnp.int32), i[None], 1)
            return history.count(jnp.zeros(1, jnp.int32), tokens, params, state), -lp.token[0] / math.log(2)
        return jax.lax.scan(step, history, jnp.arange(400, dtype=jnp.int32))

    history = TokenHistory.create(1, x.shape[1], 8).replace(sampler=jnp.full((1, 1), 12.0))
    history, surprise = run(history)
    assert abs(float(np.mean(np.asarray(surprise)[100:])) - 6.0) < 0.4
    p = softmax(np.asarray(x[0], np.float64))
    assert -np.sum(p * np.log2(p)) > 8.5
    assert float(history.sampler[0, 0]) < 12.0  # (it came down from where it started)


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
    distribution `llama_mirostat` keeps of the model's logits (one forward over the whole
    sequence) at the bound carried so far, and the token the request's noise picks from it, as
    the device draws (Gumbel noise under the key of its seed and the token's position, over the
    kept logits scaled by the temperature), which must be the request's. Returns the narrowest
    margin any choice was made by (a cut's or a draw's: the engine's logits may differ from the
    reference's by float rounding, far less) and how many tokens each step kept."""
    logits = np.asarray(full_logits(params, config, np.asarray(prompt + output)))[len(prompt) - 1:]
    mu, margin, sizes = 2 * s.mirostat_tau, math.inf, []
    for i, token in enumerate(output):
        want = llama_mirostat(logits[i], s, mu)
        ids = np.fromiter(want, np.int64)
        scaled = np.full(logits.shape[1], -np.inf, np.float32)
        scaled[ids] = logits[i][ids] / np.float32(s.temperature)
        key = jax.random.fold_in(jax.random.key(s.seed), len(prompt) + i)
        scores = np.asarray(jax.random.gumbel(key, scaled.shape, jnp.float32)) + scaled
        assert int(np.argmax(scores)) == token, (s, i)
        best = np.sort(scores[ids])[-2:]
        margin = min(margin, cut_margin(logits[i], s, mu), best[1] - best[0] if len(ids) > 1 else math.inf)
        sizes.append(len(ids))
        mu = moved(mu, s, want[token])
    return margin, sizes


# The tiny model's logits are sharp (entropy near 0 bits at temperature 1); at 6 they hold ~5.
HOT = RequestSampling(temperature=6.0, seed=1, temperature_last=True, mirostat=2, mirostat_tau=4.0)
MIROSTAT_ROWS = [HOT, dataclasses.replace(HOT, mirostat=1, seed=2),
                 dataclasses.replace(HOT, seed=3, mirostat_tau=6.0, mirostat_eta=0.3)]


def scheduler(engine, tokenizer, **config) -> Scheduler:
    return Scheduler(engine, tokenizer, SchedulerConfig(
        policy=PolicyConfig(name="chunked", token_budget=48, chunk=32), **config))


def _check(streams, subs, tiny_params, tiny_config):
    for (prompt, params), s in zip(subs, streams):
        out = s.request.output_ids
        assert len(out) == params.max_tokens
        if params.sampling.mirostat:
            margin, sizes = walk_reference(tiny_params, tiny_config, prompt, out, params.sampling)
            # (the engine's logits and the reference's differ by float32 rounding: ~1e-6 here)
            assert margin > 1e-5, "a choice within rounding of tipping: the comparison says nothing"
            assert max(sizes) > 1 and min(sizes) < tiny_config.vocab_size  # (it cut, and drew)
        elif params.sampling.temperature == 0:
            assert out == greedy_generate(tiny_params, tiny_config, prompt, params.max_tokens,
                                          sampling=params.sampling)


@pytest.fixture(params=[1, pytest.param(4, marks=pytest.mark.slow)], ids=["1step", "4steps"])
def engine(request, shared_engine):
    return compiled(shared_engine(EngineConfig(**SAMPLING_ENGINE, decode_steps=request.param), "needed"),
                    "history")


def test_requests_on_mirostat_draw_what_the_reference_draws(engine, tiny_params, tiny_config, tiny_tokenizer):
    """Mirostat 1 and 2 requests beside greedy, penalized and plainly sampled ones, arriving at
    random, prompts longer than a chunk (their first token drawn after several): each draws,
    token after token, what the reference draws, its bound carried in the slot's history."""
    rng = random.Random(4)
    prompts = random_prompts(rng, 7, tiny_config.vocab_size, 5, 90)
    rows = [*MIROSTAT_ROWS, RequestSampling(), RequestSampling(repetition_penalty=1.5, penalty_window=8),
            RequestSampling(temperature=6.0, top_k=40, seed=5), dataclasses.replace(HOT, seed=7, mirostat=1)]
    subs = [(p, GenerationParams(max_tokens=24, ignore_eos=True, sampling=r)) for p, r in zip(prompts, rows)]
    before = engine.compilations_after_warmup
    streams = run_all(scheduler(engine, tiny_tokenizer), subs,
                      sorted(rng.randint(0, 8) for _ in subs))
    assert engine.compilations_after_warmup == before
    _check(streams, subs, tiny_params, tiny_config)


def test_a_preempted_request_keeps_its_bound(tiny_params, tiny_config, tiny_tokenizer, shared_engine):
    """Over a pool that holds one longest sequence, requests on Mirostat are preempted and
    recomputed (their prompts partly from the prefix cache): the bound each had when it left
    its slot comes back with it, so each still draws what the reference draws."""
    e = compiled(shared_engine(EngineConfig(**ONE_LONGEST), "needed"), "history")
    rng = random.Random(9)
    shared = random_prompts(rng, 1, tiny_config.vocab_size, 64, 64)[0]
    prompts = [shared + p for p in random_prompts(rng, 6, tiny_config.vocab_size, 1, 40)]
    subs = [(p, GenerationParams(max_tokens=40, ignore_eos=True, sampling=dataclasses.replace(
        MIROSTAT_ROWS[i % 3], seed=10 + i))) for i, p in enumerate(prompts)]
    sched = scheduler(e, tiny_tokenizer, prefix_caching=True)
    streams = run_all(sched, subs, [0, 6, 7, 8, 9, 10])
    assert sched.preemptions > 0 and any(s.request.preemptions for s in streams)
    _check(streams, subs, tiny_params, tiny_config)
