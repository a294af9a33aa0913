"""On-device sampling: greedy, temperature, top-k, top-p, per-row parameters and seeds; and
llama.cpp's samplers (`RequestSampling.temperature_last` and its filters) against a slow
reference written after llama.cpp's sampler chain: a sort per filter, in its default order."""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.model import cpu_kernels
from cadence.model.host_sampling import RequestSampling, SamplingRows
from cadence.model import sampling as model_sampling
from cadence.model.sampling import XTC_STREAM, SamplingParams, argmax, gumbel_at, kept, sample
from tests.fakes import needs_cpu_kernels

VOCAB = 50


@pytest.fixture(scope="module")
def logits():
    return jax.random.normal(jax.random.key(3), (4, VOCAB)) * 2.0


sample_jit = jax.jit(sample)


def test_greedy_is_argmax(logits):
    got = sample_jit(logits, SamplingParams.greedy(4), jnp.zeros(4, jnp.int32))
    np.testing.assert_array_equal(got, np.argmax(logits, -1))


def test_per_row_parameters_mix_greedy_and_sampled(logits):
    params = SamplingParams.make([0.0, 1.0, 0.0, 1.0], [0, 1, 0, 0], [1.0, 1.0, 1.0, 1e-6], [1, 2, 3, 4])
    got = np.asarray(sample_jit(logits, params, jnp.arange(4, dtype=jnp.int32)))
    # Rows 0 and 2 are greedy; row 1 has top_k=1 and row 3 a vanishing top_p: both greedy too.
    np.testing.assert_array_equal(got, np.argmax(logits, -1))


def test_seed_and_step_make_draws_reproducible(logits):
    params = SamplingParams.make([1.0] * 4, [0] * 4, [1.0] * 4, [7, 7, 8, 8])
    step = jnp.asarray([5, 5, 5, 6], jnp.int32)
    a = np.asarray(sample_jit(logits, params, step))
    b = np.asarray(sample_jit(logits, params, step))
    np.testing.assert_array_equal(a, b)
    # The same seed and step on a row alone gives the same token as in the batch.
    alone = sample_jit(logits[2:3], SamplingParams.make([1.0], [0], [1.0], [8]), step[2:3])
    assert int(alone[0]) == a[2]


def test_empirical_distribution_follows_filters():
    logits = jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1] + [1e-9] * 4))[None].repeat(4000, 0)
    step = jnp.arange(4000, dtype=jnp.int32)

    def freqs(temperature, top_k, top_p):
        params = SamplingParams.make([temperature] * 4000, [top_k] * 4000, [top_p] * 4000, [11] * 4000)
        return np.bincount(np.asarray(sample_jit(logits, params, step)), minlength=8) / 4000

    np.testing.assert_allclose(freqs(1.0, 0, 1.0)[:4], [0.4, 0.3, 0.2, 0.1], atol=0.03)
    np.testing.assert_allclose(freqs(1.0, 2, 1.0)[:4], [4 / 7, 3 / 7, 0, 0], atol=0.03)
    # top_p=0.65: 0.4 then 0.3 (mass before it 0.4 < 0.65) stay, 0.2 (mass before 0.7) goes.
    np.testing.assert_allclose(freqs(1.0, 0, 0.65)[:4], [4 / 7, 3 / 7, 0, 0], atol=0.03)
    # Temperature 0.5 squares the odds: 16:9:4:1.
    np.testing.assert_allclose(freqs(0.5, 0, 1.0)[:4], np.array([16, 9, 4, 1]) / 30, atol=0.03)


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1},
    # values that fit a Python number but not the device arrays a batch packs them into
    {"top_k": 2**31}, {"seed": 2**32}, {"temperature": float("inf")}, {"temperature": float("nan")},
    {"top_p": float("nan")}, {"top_k": 1.5}, {"top_k": True}, {"temperature": "0.7"},
])
def test_bad_request_sampling_is_rejected(kwargs):
    with pytest.raises(ValueError):
        RequestSampling(**kwargs)


def test_the_widest_valid_values_pack_into_the_device_rows():
    edge = RequestSampling(temperature=1e30, top_k=2**31 - 1, top_p=1.0, seed=2**32 - 1)
    rows = SamplingRows.of([RequestSampling(), edge])
    assert rows.top_k[1] == 2**31 - 1 and rows.seed[1] == 2**32 - 1
    tokens = sample(jnp.zeros((2, 8)), rows.params(), jnp.zeros(2, jnp.int32))
    assert tokens.shape == (2,) and 0 <= int(tokens[1]) < 8


def kept_by_sorting(row: np.ndarray, sampling: RequestSampling) -> set[int]:
    """The slow reference of `kept`: sort the scaled logits, cut by rank, by min_p, and by the
    mass before each token in that order."""
    scaled = row.astype(np.float64) / (sampling.temperature or 1.0)
    order = np.argsort(-scaled, kind="stable")
    ranked = scaled[order]
    keep = np.ones(len(row), bool)
    if sampling.top_k:
        keep &= np.arange(len(row)) < sampling.top_k
    keep &= ranked >= ranked[0] + (np.log(sampling.min_p) if sampling.min_p else -np.inf)
    probs = np.where(keep, np.exp(ranked - ranked[0]), 0)
    probs /= probs.sum()
    keep &= np.cumsum(probs) - probs < sampling.top_p
    return set(order[keep].tolist())


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_cpu_kernels)])
def test_the_threshold_filters_keep_what_sorting_keeps(kernels):
    """`kept`'s thresholds against a sort, over rows of every filter alone and together, on a
    vocabulary the size of a real model's: XLA's bisections, and the CPU kernels' selections
    in the programs they serve."""
    rng = np.random.default_rng(5)
    rows = [RequestSampling(temperature=t, top_k=k, top_p=p, min_p=m, seed=1)
            for t, k, p, m in [(1.0, 0, 0.9, 0), (0.7, 50, 1.0, 0), (1.3, 0, 1.0, 0.05), (0.5, 40, 0.8, 0.01),
                               (1.0, 1, 1.0, 0), (2.0, 0, 0.5, 0), (1.0, 3000, 0.95, 0), (0.9, 0, 1e-6, 0)]]
    logits = (rng.normal(size=(len(rows), 49152)) * 3).astype(np.float32)
    fn = cpu_kernels.with_activations(kept, "float32") if kernels else kept
    _, keep, _ = jax.jit(fn)(logits, SamplingRows.of(rows).params(), jax.random.split(jax.random.key(0), len(rows)))
    keep = np.asarray(keep)
    for i, sampling in enumerate(rows):
        assert set(np.flatnonzero(keep[i]).tolist()) == kept_by_sorting(logits[i], sampling), sampling


@needs_cpu_kernels
@pytest.mark.parametrize("rows, n", [(1, 1), (3, 7), (8, 8), (2, 9), (8, 4099), (8, 151936)])
def test_the_cpu_kernels_argmax_is_jnp_argmax(rows, n):
    """In a program the CPU kernels serve, greedy tokens come from their argmax kernel: the
    first of equal maxima, the first NaN where a row has one, and -inf or +inf rows as
    jnp.argmax has them, at widths that are and are not multiples of 8."""
    rng = np.random.default_rng(rows * 100 + n)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[0, rng.integers(n, size=3)] = x[0].max() + 1  # a tie for the maximum, maybe at the tail
    if rows > 1:
        x[1, rng.integers(n)] = np.nan
        x[1, -1] = np.nan  # a NaN in the tail too: the first one wins
    if rows > 2:
        x[2] = -np.inf
        x[2, rng.integers(n, size=2)] = np.inf
    if rows > 3:
        x[3] = -np.inf
    programs = jax.jit(cpu_kernels.with_activations(argmax, "float32"))
    hlo = programs.lower(x).as_text()
    assert cpu_kernels.ARGMAX in hlo  # the kernel, not XLA's reduction
    np.testing.assert_array_equal(programs(x), jnp.argmax(x, axis=-1))


def test_argmax_outside_the_kernels_programs_is_xlas(logits):
    """Outside a program the CPU kernels serve (the GPU's, XLA's decode), argmax is XLA's."""
    assert cpu_kernels.ARGMAX not in jax.jit(argmax).lower(logits).as_text()
    np.testing.assert_array_equal(jax.jit(argmax)(logits), np.argmax(logits, -1))


def categorical(logits, params, step):
    """The slow reference of `sample`: jax.random.categorical over `kept`'s scaled logits, under
    each row's key (its seed and step); greedy rows their argmax."""
    rngs = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(params.seed, step)
    scaled, keep, hot = kept(logits, params, rngs)
    drawn = jax.vmap(jax.random.categorical)(rngs, jnp.where(keep, scaled, -jnp.inf))
    return jnp.where(hot, drawn, jnp.argmax(jnp.where(keep, logits, -jnp.inf), -1))


@needs_cpu_kernels
def test_a_draw_is_jax_random_categoricals_in_the_kernels_programs_too():
    """Sampled rows draw what jax.random.categorical draws from the filtered, scaled logits
    (the Gumbel-max trick, its noise), whether `argmax` is XLA's or the CPU kernels'."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, 1000)).astype(np.float32) * 3)
    params = SamplingParams.make([0.7, 1.0, 1.3, 0.5, 0.9, 1.0, 0.2, 2.0], [0, 40, 0, 5, 0, 0, 0, 100],
                                 [1.0, 0.9, 0.95, 1.0, 0.5, 1.0, 0.99, 1.0], list(range(8)))
    step = jnp.arange(8, dtype=jnp.int32) * 3

    want = jax.jit(categorical)(x, params, step)
    for fn in (sample, cpu_kernels.with_activations(sample, "float32")):
        np.testing.assert_array_equal(jax.jit(fn)(x, params, step), want)


@needs_cpu_kernels
def test_top_k_by_selection_keeps_what_the_bisection_keeps():
    """In the CPU kernels' programs top-k's threshold is the k-th largest key by selection:
    the same kept tokens as the bisection, ties at the k-th included, k of 1, of the whole
    vocabulary and beyond it (no filter), with and without top-p and min_p."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((6, 3000)).astype(np.float32)
    x[:, :40] = np.round(x[:, :40])  # ties across the top
    x[2, 100:200] = x[2].max() + 1  # more tokens tied for the lead than k keeps
    params = SamplingParams.make([0.7, 1.0, 1.3, 0.5, 0.9, 1.0], [1, 40, 10, 3000, 5000, 7],
                                 [1.0, 0.9, 1.0, 0.8, 1.0, 0.5], list(range(6)))
    params = params._replace(min_p=np.asarray([0.0, 0.0, 0.1, 0.0, 0.0, 0.05], np.float32))
    rngs = jax.random.split(jax.random.key(0), 6)
    want_scaled, want, _ = jax.jit(kept)(jnp.asarray(x), params, rngs)
    hlo = jax.jit(cpu_kernels.with_activations(kept, "float32")).lower(jnp.asarray(x), params, rngs).as_text()
    assert cpu_kernels.KTH_LARGEST in hlo
    got_scaled, got, _ = jax.jit(cpu_kernels.with_activations(kept, "float32"))(jnp.asarray(x), params, rngs)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_scaled, want_scaled)
    assert np.asarray(got).sum(axis=1)[2] == 100  # the tied lead kept whole


def mass_threshold_by_sorting(keys: np.ndarray, weights: np.ndarray, target: float) -> int:
    """The slow reference of top-p's threshold: the largest key t with sum(weights[keys >= t])
    >= target, from the distinct keys in descending order and their running mass, in float64."""
    if np.isnan(weights).any() or np.isnan(target):
        return 0
    if target <= 0:
        return 2**32 - 1
    positive = weights > 0
    distinct, group = np.unique(keys[positive], return_inverse=True)
    mass = np.cumsum(np.bincount(group, weights=weights[positive].astype(np.float64))[::-1])
    distinct = distinct[::-1]
    reached = np.flatnonzero(mass >= target)
    return int(distinct[reached[0]]) if len(reached) else 0


@needs_cpu_kernels
def test_top_p_by_selection_finds_the_thresholds_sorting_finds():
    """The CPU kernels' selection by mass against a sort: rows of distinct and of tied keys,
    weights of zero (tokens an earlier filter dropped), targets at a group's exact mass, at 0,
    past the row's mass and NaN, a NaN weight, rows of one token and of a real vocabulary's."""
    rng = np.random.default_rng(11)
    cases = []
    for n in (1, 5, 33, 100, 3000, 151936):
        keys = rng.integers(0, 2**32, size=n, dtype=np.uint32)
        weights = rng.exponential(size=n).astype(np.float32) ** 4
        cases.append((keys, weights, np.float32(weights.astype(np.float64).sum() * rng.uniform(0.05, 0.95))))
    keys = rng.integers(0, 40, size=5000).astype(np.uint32)  # many ties
    weights = (rng.integers(0, 4, size=5000) / 8).astype(np.float32)  # sums exact in float32
    top = np.unique(keys[weights > 0])[::-1]
    exact = np.float32(weights[keys >= top[2]].sum())  # a target at a group boundary's mass
    cases += [(keys, weights, exact), (keys, weights, np.float32(0.0)), (keys, weights, np.float32(-1.0)),
              (keys, weights, np.float32(1e9)), (keys, weights, np.float32(np.nan)),
              (keys, np.where(np.arange(5000) == 7, np.nan, weights).astype(np.float32), np.float32(1.0)),
              (keys, np.zeros(5000, np.float32), np.float32(0.5))]
    for keys, weights, target in cases:
        want = mass_threshold_by_sorting(keys, weights, float(target))
        got = jax.jit(cpu_kernels.mass_threshold)(keys[None], weights[None], np.asarray([target]))
        assert int(got[0]) == want, (len(keys), float(target))


@needs_cpu_kernels
def test_the_kernels_noise_is_within_its_bound_of_xlas_for_every_value():
    """jax.random.gumbel's noise is a function of the top 23 of 32 random bits: over all 2^23
    of them, the CPU kernels' noise (their own logs; AVX2's, and AVX-512's where the CPU has
    it) is within GUMBEL_ERROR of XLA's, the bound their candidates for a draw rest on."""
    bits = (np.arange(2**23, dtype=np.uint32) << 9) | 0x1FF  # the low bits play no part

    def xlas(bits):  # jax.random.uniform(minval=tiny, maxval=1)'s floats, then gumbel's
        floats = jax.lax.bitcast_convert_type((bits >> 9) | np.uint32(0x3F800000), jnp.float32) - 1.0
        tiny = jnp.float32(np.finfo(np.float32).tiny)
        return -jnp.log(-jnp.log(jax.lax.max(tiny, floats * (1 - tiny) + tiny)))

    want = np.asarray(jax.jit(xlas)(bits))
    for wide in (False, True) if cpu_kernels.has_avx512() else (False,):
        got = np.asarray(jax.jit(cpu_kernels.gumbel_of_bits, static_argnums=1)(bits, wide))
        assert np.abs(got - want).max() <= cpu_kernels.GUMBEL_ERROR / 4, wide
    # XLA's formula above is jax.random.gumbel's: the same noise from the same key.
    key = jax.random.key(5)
    np.testing.assert_array_equal(jax.jit(xlas)(jax.random.bits(key, (4096,), jnp.uint32)),
                                  jax.random.gumbel(key, (4096,)))


@pytest.mark.skipif(not model_sampling._default_threefry(), reason="JAX's default threefry keys only")
def test_noise_at_some_tokens_is_the_noise_of_the_whole_row():
    for seed in range(3):
        key = jax.random.fold_in(jax.random.key(seed), 7)
        indices = np.random.default_rng(seed).integers(0, 151936, 500).astype(np.int32)
        whole = np.asarray(jax.random.gumbel(key, (151936,)))
        np.testing.assert_array_equal(jax.jit(gumbel_at)(key, indices), whole[indices])


@needs_cpu_kernels
@pytest.mark.parametrize("vocab", [7, 5000, 151936])
def test_a_draw_from_the_kernels_candidates_is_categoricals(vocab):
    """In the CPU kernels' programs the noise is made by a kernel that names the few tokens that
    may win, and XLA's noise at those picks: jax.random.categorical's token, over filtered and
    unfiltered rows, ties for the lead, a greedy row; and a row with a NaN, one of -inf and one
    of more tokens tied at +inf than the kernel lists (which take XLA's noise over the whole
    row, in chunks), at widths that are and are not multiples of 8 or of the chunk."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((8, vocab)).astype(np.float32) * 2
    x[1, [0, vocab - 1]] = x[1].max() + 30  # two tokens tied for the lead, far ahead
    step = jnp.arange(8, dtype=jnp.int32)

    filtered = SamplingParams.make([0.7, 0.1, 1.0, 0.0, 1.3, 0.9, 1.0, 0.6], [50, 0, 0, 0, 1000, 20, 0, 0],
                                   [1.0, 0.9, 0.5, 1.0, 1.0, 0.95, 1.0, 0.8], list(range(8)))
    broken = x.copy()
    broken[5, vocab // 3:] = np.inf  # more tokens tied for the lead than the kernel lists
    broken[6, vocab // 2] = np.nan
    broken[7] = -np.inf
    fn = jax.jit(cpu_kernels.with_activations(sample, "float32"))
    assert cpu_kernels.GUMBEL_CANDIDATES in fn.lower(x, filtered, step).as_text()
    for logits in (x, broken):
        for seed in range(6):
            params = filtered._replace(seed=filtered.seed + 8 * seed)
            np.testing.assert_array_equal(fn(logits, params, step), jax.jit(categorical)(logits, params, step))


@needs_cpu_kernels
def test_a_draw_over_widely_spread_logits_is_categoricals():
    """The kernel scores only the blocks of tokens within the noise's span (21 nats) of the
    row's top: over rows spread far wider (most blocks skipped), a winner alone among hopeless
    tokens, tokens 4 nats behind that win most draws, logits of 1e30 (the margin grows with
    them), the draw is jax.random.categorical's, the rows' candidates listed by the kernel (a
    batch where one row takes XLA's draw takes it for all). A NaN far below the top is still
    found, and a row whose top is +inf skips nothing: those rows take XLA's draw."""
    rng = np.random.default_rng(17)
    x = (rng.standard_normal((6, 20000)) * 25).astype(np.float32)
    x[1] = -60.0
    x[1, 12345] = 0.0  # the only hopeful token
    x[1, 777] = -20.5  # just within the span
    x[2] = -100.0
    x[2, 0] = 0.0
    x[2, 16:16 * 301:16] = -4.0  # 300 blocks of one token each 4 nats behind: they win mostly
    x[3] = x[3] * 1e28  # a spread of ~1e30
    params = SamplingParams.make([1.0, 1.0, 1.0, 1.0, 2.0, 0.3], [0] * 6, [1.0] * 6, list(range(6)))
    step = jnp.arange(6, dtype=jnp.int32)
    fn = jax.jit(cpu_kernels.with_activations(sample, "float32"))
    keys = jnp.stack([jax.random.key_data(_row_key(s, t)) for s, t in zip(range(6), range(6))])
    scaled = x / np.asarray(params.temperature)[:, None]
    counts = jax.jit(cpu_kernels.gumbel_candidates, static_argnums=2)(keys, scaled, model_sampling.DRAW_WIDTH)[1]
    assert (np.asarray(counts) <= model_sampling.DRAW_WIDTH).all()  # the kernel's candidates decide
    drawn = []
    for seed in range(8):
        p = params._replace(seed=params.seed + 8 * seed)
        drawn.append(np.asarray(fn(x, p, step)))
        np.testing.assert_array_equal(drawn[-1], jax.jit(categorical)(x, p, step))
    assert sum(d[2] != 0 for d in drawn) >= 4  # row 2's draws fall on the tokens behind
    broken = x[:2].copy()
    broken[0, 5000] = np.nan
    broken[1, ::16] = np.inf  # +inf ties, more than the kernel lists
    for seed in range(4):
        p = SamplingParams.make([1.0, 1.0], [0, 0], [1.0, 1.0], [seed, seed + 8])
        np.testing.assert_array_equal(fn(broken, p, step[:2]), jax.jit(categorical)(broken, p, step[:2]))


def _row_key(seed: int, step: int):
    return jax.random.fold_in(jax.random.key(seed), step)


@needs_cpu_kernels
def test_the_kernels_candidates_over_ties_infinities_nan_and_tails():
    """`gumbel_candidates` on raw rows: tokens made to tie with the best (XLA's noise cancelled
    by the logit) are all listed, ascending; +inf scores tie with each other alone (16 listed,
    17 too many); a NaN or a row of -inf asks for XLA's draw; a winner in a tail that is not a
    multiple of 16 is found."""
    n, width = 1000, model_sampling.DRAW_WIDTH
    keys = [_row_key(7, i) for i in range(7)]
    noise = np.stack([np.asarray(jax.random.gumbel(k, (n,))) for k in keys])
    rows = np.full((7, n), -np.inf, np.float32)
    tied = [5, 300, 301, 998]
    rows[0, tied] = 10 - noise[0, tied]  # scores of 10, within rounding
    rows[0, 40] = 0.0  # far behind
    rows[1, [3, 500, 999]] = np.inf
    rows[1, 7] = 50.0
    rows[2, np.arange(17) * 50 + 1] = np.inf
    rows[3, 123] = np.nan
    rows[3, 200] = 1.0
    # rows[4]: only -inf
    rows[5, 995:] = 3.0 - noise[5, 995:]
    rows[5, 999] += 1.0  # the tail's last token wins
    rows[6, np.arange(16) * 60] = np.inf  # exactly `width` ties
    data = jnp.stack([jax.random.key_data(k) for k in keys])
    candidates, counts = jax.jit(cpu_kernels.gumbel_candidates, static_argnums=2)(data, rows, width)
    candidates, counts = np.asarray(candidates), np.asarray(counts)
    assert counts[0] == 4 and list(candidates[0, :4]) == tied
    assert counts[1] == 3 and list(candidates[1, :3]) == [3, 500, 999]
    assert counts[2] == width + 1
    assert counts[3] == width + 1 and counts[4] == width + 1
    assert counts[5] == 1 and candidates[5, 0] == 999
    assert counts[6] == width and list(candidates[6]) == list(np.arange(16) * 60)
    # and the draw over them, among candidates or over the whole row, is categorical's
    rngs, keep, sampled = jnp.stack(keys), ~np.isneginf(rows), jnp.ones(7, bool)
    drawn = jax.jit(cpu_kernels.with_activations(model_sampling._draw, "float32"))(rows, keep, rngs, sampled)
    want = jax.vmap(jax.random.categorical)(rngs, jnp.where(keep, rows, -jnp.inf))
    np.testing.assert_array_equal(drawn, want)


@needs_cpu_kernels
@pytest.mark.parametrize("ties", [3, 20])
def test_a_draw_over_infinite_logits_is_categoricals(ties):
    """A tiny temperature with min_p keeps exactly the tokens whose scaled logits overflow to
    +inf; categorical draws the first of them, the kernels' draw too, whether the kernel lists
    them all (3) or asks for XLA's noise over the row (20)."""
    x = np.zeros((2, 3000), np.float32)
    x[:, 500 + np.arange(ties) * 7] = 1e9  # / 1e-30: past float32's range
    params = SamplingParams.make([1e-30, 1e-30], [0, 0], [1.0, 0.9], [1, 2])
    params = params._replace(min_p=np.asarray([0.05, 0.05], np.float32))
    step = jnp.arange(2, dtype=jnp.int32)

    want = np.asarray(jax.jit(categorical)(x, params, step))
    assert list(want) == [500, 500]
    np.testing.assert_array_equal(jax.jit(cpu_kernels.with_activations(sample, "float32"))(x, params, step), want)


# -- llama.cpp's samplers ------------------------------------------------------------------------


def llama_chain(logits: np.ndarray, s: RequestSampling, coin: float) -> dict[int, float]:
    """{token: probability} that llama.cpp's default chain (top-n-sigma, top-k, typical, top-p,
    min_p, XTC, temperature) leaves one row of `logits` to draw from, in float64: its candidate
    list cut by each sampler in turn (top-n-sigma sends tokens to -inf and keeps them listed),
    `coin` XTC's draw. At a temperature of 0 the likeliest token left, alone."""
    ids = np.arange(len(logits))
    x = logits.astype(np.float64)

    def by_logit(ids, x):
        order = np.argsort(-x, kind="stable")
        return ids[order], x[order]

    def softmax(x):
        p = np.exp(x - x.max())
        return p / p.sum()

    if s.top_n_sigma > 0:
        finite = x[np.isfinite(x)]
        x = np.where(x < finite.max() - s.top_n_sigma * finite.std(), -np.inf, x)
    ids, x = by_logit(ids, x)
    if 0 < s.top_k < len(x):
        ids, x = ids[: s.top_k], x[: s.top_k]
    if s.typical_p < 1:
        p = softmax(x)
        entropy = -np.sum(p[p > 0] * np.log(p[p > 0]))
        order = np.argsort(np.abs(-np.log(p) - entropy), kind="stable")
        last = np.flatnonzero(np.cumsum(p[order]) > s.typical_p)[0] + 1
        ids, x = by_logit(ids[order[:last]], x[order[:last]])
    if s.top_p < 1:
        last = np.flatnonzero(np.cumsum(softmax(x)) >= s.top_p)[0] + 1
        ids, x = ids[:last], x[:last]
    if s.min_p > 0:
        keep = x >= x[0] + np.log(s.min_p)
        ids, x = ids[keep], x[keep]
    if s.xtc_probability > 0 and s.xtc_threshold <= 0.5 and len(x) >= 2 and coin <= s.xtc_probability:
        above = np.flatnonzero(softmax(x) >= s.xtc_threshold)
        if len(above) >= 2:
            ids, x = ids[above[-1]:], x[above[-1]:]
    temperature = s.temperature
    if s.dynatemp_range > 0 and len(x) > 1:
        p = softmax(x)
        entropy = -np.sum(p[p > 0] * np.log(p[p > 0]))
        low, high = max(0.0, s.temperature - s.dynatemp_range), s.temperature + s.dynatemp_range
        temperature = low + (high - low) * (entropy / np.log(len(x))) ** s.dynatemp_exponent
    elif s.dynatemp_range > 0:
        temperature = 1.0
    if temperature <= 0:
        return {int(ids[0]): 1.0}
    p = softmax(x / temperature)
    return {int(t): float(q) for t, q in zip(ids, p) if q > 0}


def distributions(fn, logits: np.ndarray, rows: list[RequestSampling], seed_step=0):
    """`kept`'s distribution per row, as {token: probability} (its likeliest kept token alone
    where it draws nothing), and each row's XTC coin."""
    params = SamplingRows.of(rows).params()
    rngs = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), seed_step))(jnp.asarray(params.seed))
    draw, keep, hot = jax.jit(fn)(jnp.asarray(logits), params, rngs)
    coins = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, XTC_STREAM)))(rngs)
    draw, keep, hot = np.asarray(draw, np.float64), np.asarray(keep), np.asarray(hot)
    out = []
    for i in range(len(rows)):
        if not hot[i]:
            out.append({int(np.argmax(np.where(keep[i], logits[i], -np.inf))): 1.0})
            continue
        x = np.where(keep[i], draw[i], -np.inf)
        p = np.exp(x - x.max())
        p /= p.sum()
        out.append({int(t): float(p[t]) for t in np.flatnonzero(p > 0)})
    return out, np.asarray(coins)


def assert_same(got: dict[int, float], want: dict[int, float], what):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:10])
    ids = sorted(want)
    np.testing.assert_allclose([got[t] for t in ids], [want[t] for t in ids], atol=2e-6, rtol=1e-4,
                               err_msg=str(what))


LLAMA = RequestSampling(temperature=0.8, seed=3, temperature_last=True)
ROWS = [
    dataclasses.replace(LLAMA, top_n_sigma=1.5),
    dataclasses.replace(LLAMA, typical_p=0.5),
    dataclasses.replace(LLAMA, typical_p=0.9, top_k=40),
    dataclasses.replace(LLAMA, xtc_probability=1.0, xtc_threshold=0.05, top_k=40),
    dataclasses.replace(LLAMA, xtc_probability=0.5, xtc_threshold=0.05, seed=11),
    dataclasses.replace(LLAMA, xtc_probability=1.0, xtc_threshold=0.6),  # above 0.5: off
    dataclasses.replace(LLAMA, dynatemp_range=0.5, top_k=40, top_p=0.95, min_p=0.05),
    dataclasses.replace(LLAMA, temperature=0.0, dynatemp_range=1.5, dynatemp_exponent=2.0, top_k=20),
    dataclasses.replace(LLAMA, temperature=1.3, top_k=40, top_p=0.9, min_p=0.1),  # temperature last
    dataclasses.replace(LLAMA, top_n_sigma=2.0, top_k=100, typical_p=0.8, top_p=0.9, min_p=0.02,
                        xtc_probability=1.0, xtc_threshold=0.02, dynatemp_range=0.3),
    dataclasses.replace(LLAMA, temperature=0.0, typical_p=0.3),  # greedy, the likeliest typical token
    dataclasses.replace(LLAMA, temperature=0.0, xtc_probability=1.0, xtc_threshold=0.01, top_k=10),
    dataclasses.replace(LLAMA, temperature=0.0, top_k=5, top_p=0.5),  # greedy: the argmax
]


@pytest.fixture(scope="module")
def wide():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((len(ROWS), 4096)) * 2.5).astype(np.float32)
    x[:, :6] += 6  # a few likely tokens, so that XTC and typical have something to cut
    return x


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_cpu_kernels)])
def test_each_row_draws_from_what_llama_cpps_chain_leaves(wide, kernels):
    """Every sampler alone and together, greedy rows of llama.cpp's order too: the same tokens
    kept and the same probabilities as llama.cpp's chain, XLA's bisections and the CPU
    kernels' selections alike."""
    fn = cpu_kernels.with_activations(kept, "float32") if kernels else kept
    got, coins = distributions(fn, wide, ROWS)
    for i, row in enumerate(ROWS):
        assert_same(got[i], llama_chain(wide[i], row, float(coins[i])), row)


def test_the_filters_do_cut(wide):
    """The cases above are not vacuous: each sampler changes what its row leaves."""
    got, _ = distributions(kept, wide, ROWS)
    plain = [llama_chain(wide[i], dataclasses.replace(LLAMA, top_k=r.top_k, temperature=r.temperature), 0.0)
             for i, r in enumerate(ROWS)]
    for i in (0, 1, 2, 3, 6, 7, 9, 10, 11):
        assert got[i] != pytest.approx(plain[i]), ROWS[i]
    assert got[5] == pytest.approx(plain[5])  # XTC above 0.5 is off
    greedy = int(np.argmax(wide[10]))
    assert greedy not in got[10]  # typical_p 0.3 left out the likeliest token
    assert list(got[12]) == [int(np.argmax(wide[12]))]


def test_temperature_last_moves_only_the_filters_that_read_the_temperature(wide):
    """top_p and min_p read the distribution before the temperature in llama.cpp's order and
    after it in vLLM's: the same settings keep different tokens; top-k keeps the same ones."""
    vllm = dataclasses.replace(ROWS[8], temperature_last=False)
    got, _ = distributions(kept, wide[[8, 8]], [ROWS[8], vllm])
    assert set(got[0]) != set(got[1])
    k_only = [dataclasses.replace(r, top_p=1.0, min_p=0.0) for r in (ROWS[8], vllm)]
    got, _ = distributions(kept, wide[[8, 8]], k_only)
    assert set(got[0]) == set(got[1])
    np.testing.assert_allclose([got[0][t] for t in sorted(got[0])], [got[1][t] for t in sorted(got[1])], rtol=1e-5)


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_cpu_kernels)])
def test_the_token_is_jax_random_categoricals_over_what_is_kept(wide, kernels):
    """`sample` over rows of both orders and every sampler draws what jax.random.categorical
    draws from `kept`'s logits under the row's key (greedy rows: the likeliest token kept),
    and a row draws the same alone as in the batch."""
    rows = [*ROWS, RequestSampling(temperature=0.7, top_p=0.9, seed=5), RequestSampling()]
    x = jnp.asarray(np.concatenate([wide, wide[:2]]))
    params = SamplingRows.of(rows).params()
    step = jnp.arange(len(rows), dtype=jnp.int32) * 7
    fn = cpu_kernels.with_activations(sample, "float32") if kernels else sample
    got = np.asarray(jax.jit(fn)(x, params, step))
    np.testing.assert_array_equal(got, jax.jit(categorical)(x, params, step))
    for i in (3, 9, 10):
        alone = jax.jit(fn)(x[i:i + 1], SamplingRows.of([rows[i]]).params(), step[i:i + 1])
        assert int(alone[0]) == got[i]


def test_xtc_cuts_as_often_as_its_probability_says():
    """Over many steps a row of xtc_probability 0.3 takes out its likeliest tokens about 30% of
    the time (its coin is the row's key, folded apart from the draw's noise)."""
    x = jnp.log(jnp.asarray([0.5, 0.3, 0.15, 0.05]))[None].repeat(2000, 0)
    row = dataclasses.replace(LLAMA, temperature=1.0, xtc_probability=0.3, xtc_threshold=0.2)
    params = SamplingRows.of([row] * 2000).params()
    tokens = np.asarray(jax.jit(sample)(x, params, jnp.arange(2000, dtype=jnp.int32)))
    # Cut: only 0.3 (the least likely above 0.2), 0.15 and 0.05 stay: token 0 never comes.
    # Not cut: token 0 comes half the time. So P(token 0) = 0.7 x 0.5.
    assert abs(np.mean(tokens == 0) - 0.35) < 0.04


# -- llama-server's post_sampling_probs -----------------------------------------------------------


@pytest.mark.parametrize("branch_free", [False, True], ids=["cpu-form", "gpu-form"])
def test_post_sampling_logprobs_are_of_what_each_row_drew_from(wide, branch_free):
    """A `post_sampling` row's logprobs are of the distribution it drew from: the token's and
    its likeliest alternatives' probabilities are llama.cpp's chain's (the alternatives past
    what the chain leaves at -inf; at a temperature of 0, the token alone at 1), with vLLM's
    order too; a row beside them without it keeps the raw distribution's. The same in the form
    a GPU's program takes (both sides of each branch computed)."""
    import contextlib

    from cadence.model import control
    from cadence.model.sampling import TokenHistory, choose

    vllm = RequestSampling(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, seed=4)
    rows = [dataclasses.replace(r, post_sampling=True) for r in (*ROWS, vllm)] + [ROWS[8]]
    x = np.concatenate([wide, wide[8:9], wide[8:9]])
    k = 12
    params = SamplingRows.of(rows).params()._replace(logprobs=np.ones(len(rows), bool))
    n = len(rows)
    step = jnp.arange(n, dtype=jnp.int32) * 5
    with control.branch_free() if branch_free else contextlib.nullcontext():
        tokens, lp, _ = jax.jit(lambda *args: choose(*args, k))(
            jnp.asarray(x), params, TokenHistory.create(n, x.shape[1], 8), jnp.arange(n), step)
    tokens, token_lp = np.asarray(tokens), np.asarray(lp.token)
    ids, values = np.asarray(lp.ids), np.asarray(lp.values)
    rngs = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(jnp.asarray(params.seed), step)
    coins = np.asarray(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, XTC_STREAM)))(rngs))
    for i, row in enumerate(rows[:-1]):
        if row.temperature_last:
            want = llama_chain(x[i], row, float(coins[i]))
        else:  # vLLM's order: the temperature, then min_p, top-k, top-p (sorting, in float64)
            z = x[i].astype(np.float64) / row.temperature
            order = np.argsort(-z, kind="stable")[: row.top_k]
            p = np.exp(z[order] - z[order].max())
            p /= p.sum()
            keep = p >= row.min_p * p[0]
            order, p = order[keep], p[keep] / p[keep].sum()
            last = np.flatnonzero(np.cumsum(p) >= row.top_p)[0] + 1
            want = dict(zip(order[:last].tolist(), (p[:last] / p[:last].sum()).tolist()))
        assert tokens[i] in want, row
        assert np.exp(token_lp[i]) == pytest.approx(want[tokens[i]], rel=1e-4, abs=2e-6), row
        listed = np.isfinite(values[i])
        assert listed.sum() == min(k, len(want)), row
        assert_same(dict(zip(ids[i][listed].tolist(), np.exp(values[i][listed]).tolist())),
                    dict(sorted(want.items(), key=lambda e: -e[1])[:k]), row)
    raw = jax.nn.log_softmax(jnp.asarray(x[-1]))
    assert token_lp[-1] == pytest.approx(float(raw[tokens[-1]]), abs=1e-5)
    np.testing.assert_allclose(values[-1], np.sort(np.asarray(raw))[::-1][:k], atol=1e-5)
