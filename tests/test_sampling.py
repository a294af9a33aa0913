"""On-device sampling: greedy, temperature, top-k, top-p, per-row parameters and seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.model import cpu_kernels
from cadence.model.host_sampling import RequestSampling, SamplingRows
from cadence.model.sampling import SamplingParams, argmax, kept, sample
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


def test_the_threshold_filters_keep_what_sorting_keeps():
    """`kept`'s bisections against a sort, over rows of every filter alone and together, on a
    vocabulary the size of a real model's."""
    rng = np.random.default_rng(5)
    rows = [RequestSampling(temperature=t, top_k=k, top_p=p, min_p=m, seed=1)
            for t, k, p, m in [(1.0, 0, 0.9, 0), (0.7, 50, 1.0, 0), (1.3, 0, 1.0, 0.05), (0.5, 40, 0.8, 0.01),
                               (1.0, 1, 1.0, 0), (2.0, 0, 0.5, 0), (1.0, 3000, 0.95, 0), (0.9, 0, 1e-6, 0)]]
    logits = (rng.normal(size=(len(rows), 49152)) * 3).astype(np.float32)
    _, keep = jax.jit(kept)(logits, SamplingRows.of(rows).params())
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


@needs_cpu_kernels
def test_a_draw_is_jax_random_categoricals_in_the_kernels_programs_too():
    """Sampled rows draw what jax.random.categorical draws from the filtered, scaled logits
    (the Gumbel-max trick, its noise), whether `argmax` is XLA's or the CPU kernels'."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, 1000)).astype(np.float32) * 3)
    params = SamplingParams.make([0.7, 1.0, 1.3, 0.5, 0.9, 1.0, 0.2, 2.0], [0, 40, 0, 5, 0, 0, 0, 100],
                                 [1.0, 0.9, 0.95, 1.0, 0.5, 1.0, 0.99, 1.0], list(range(8)))
    step = jnp.arange(8, dtype=jnp.int32) * 3

    def categorical(logits, params, step):
        scaled, keep = kept(logits, params)
        rngs = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(params.seed, step)
        return jax.vmap(jax.random.categorical)(rngs, jnp.where(keep, scaled, -jnp.inf))

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
    want_scaled, want = jax.jit(kept)(jnp.asarray(x), params)
    hlo = jax.jit(cpu_kernels.with_activations(kept, "float32")).lower(jnp.asarray(x), params).as_text()
    assert cpu_kernels.KTH_LARGEST in hlo
    got_scaled, got = jax.jit(cpu_kernels.with_activations(kept, "float32"))(jnp.asarray(x), params)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_scaled, want_scaled)
    assert np.asarray(got).sum(axis=1)[2] == 100  # the tied lead kept whole
