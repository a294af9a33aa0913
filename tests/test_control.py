"""The GPU's form of the programs' data-dependent control flow (`model.control`: every stage
computed and selected, loops of a fixed trip count) against the CPU's (branches, early exit):
the same tokens, logprobs and KV, traced on the CPU inside `branch_free()`; and the check that
finds control flow a GPU would decide on the host (`engine.lowering.host_waits`)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.engine.config import EngineConfig, fixed_page_tables
from cadence.engine.engine import Engine
from cadence.engine.lowering import Program, engine_programs, host_waits, lower
from cadence.engine.packing import PrefillChunk
from cadence.model import control
from cadence.model.host_sampling import ALL_ALLOWED, SAMPLER_STATE, RequestSampling, SamplingRows, bitmask_words, dry_matches
from cadence.model.sampling import TokenHistory, choose


def _lowered(fn, platform: str, *args) -> str:
    """`fn` lowered for `platform` as `engine.lowering.lower` lowers an engine's programs."""
    return lower(Program(fn.__name__, "", jax.jit(fn), args), platform).as_text()


def _functions():
    """Fresh functions each call: JAX keeps one trace per function, whatever form it took."""
    double = lambda x: x * 2  # noqa: E731
    same = lambda x: x  # noqa: E731
    return {
        "branch": lambda x: jax.lax.cond(jnp.any(x > 3), double, same, x),
        "open loop": lambda x: jax.lax.while_loop(lambda x: jnp.sum(x) < 100, double, x),
        "counted loop": lambda x: jax.lax.fori_loop(0, 5, lambda _, x: double(x), x),
        "when": lambda x: control.when(jnp.any(x > 3), double, same, x),
        # (its body leaves a state past the exit as it is, as `control.loop` asks)
        "loop": lambda x: control.loop(lambda x: jnp.sum(x) < 100,
                                       lambda x: jnp.where(jnp.sum(x) < 100, x * 2, x), x, 5),
    }


def test_host_waits_finds_what_a_gpu_decides_on_the_host():
    x = jnp.arange(8.0)
    fns = _functions()
    waits = {name: len(host_waits(_lowered(fn, "cuda", x))) for name, fn in fns.items()}
    assert waits == {"branch": 1, "open loop": 1, "counted loop": 0, "when": 0, "loop": 0}
    # model.control's on a CPU: the branch and the early exit; inside branch_free(), neither.
    fns = _functions()
    assert [len(host_waits(_lowered(fns[n], "cpu", x))) for n in ("when", "loop")] == [1, 1]
    with control.branch_free():
        free = _functions()
        assert [len(host_waits(_lowered(free[n], "cpu", x))) for n in ("when", "loop")] == [0, 0]
        free_values = [jax.jit(free[n])(x) for n in ("when", "loop")]
    for name, value in zip(("when", "loop"), free_values):  # either form computes the same
        np.testing.assert_array_equal(value, jax.jit(fns[name])(x))


VOCAB = 300

# Batches in which each stage is used by some rows, and by none.
BATCHES = {
    "greedy": [RequestSampling()] * 4,
    "mixed": [RequestSampling(),
              RequestSampling(temperature=0.8, top_k=20, seed=1),
              RequestSampling(temperature=1.3, top_p=0.7, min_p=0.05, seed=2),
              RequestSampling(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.3,
                              repetition_penalty=1.2, logit_bias=((7, 5.0), (9, -3.0)), seed=3)],
    "penalized greedy": [RequestSampling(repetition_penalty=1.5), RequestSampling(),
                         RequestSampling(logit_bias=((1, 9.0),)), RequestSampling()],
    # llama.cpp's order and samplers, DRY among them, greedy and drawn
    "llama": [RequestSampling(temperature_last=True, typical_p=0.5, dry_multiplier=0.8, dry_allowed_length=1),
              RequestSampling(temperature=0.9, temperature_last=True, top_n_sigma=1.0, xtc_probability=1.0,
                              xtc_threshold=0.05, dynatemp_range=0.4, seed=4),
              RequestSampling(temperature=0.7, top_p=0.9, seed=5), RequestSampling()],
    # Mirostat 1 and 2 and adaptive-p (their state the history's), beside a row on neither
    "stateful": [RequestSampling(temperature=1.2, temperature_last=True, mirostat=2, seed=6),
                 RequestSampling(temperature=0.8, temperature_last=True, mirostat=1, mirostat_tau=3.0, seed=7),
                 RequestSampling(temperature=0.9, temperature_last=True, top_k=30, adaptive_target=0.2, seed=8),
                 RequestSampling()],
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("constrained", [False, True], ids=["free", "bitmask"])
def test_choose_branch_free_equals_branches(batch, constrained):
    rng = np.random.default_rng(len(batch) + constrained)
    rows = SamplingRows.of(BATCHES[batch])
    for i, sampling in enumerate(BATCHES[batch]):
        rows.set(i, sampling, logprobs=i % 2 == 0)
    params = rows.params()
    n = len(BATCHES[batch])
    logits = jnp.asarray(rng.normal(0, 3, (n, VOCAB)), jnp.float32)
    history = TokenHistory(counts=jnp.asarray(rng.integers(0, 3, (n, VOCAB)), jnp.int32),
                           prompt=jnp.asarray(rng.random((n, VOCAB)) < 0.1),
                           tokens=(tokens := jnp.asarray(rng.integers(0, 4, (n, 16)), jnp.int32)),
                           length=jnp.full(n, 16, jnp.int32), breaker=jnp.zeros((n, VOCAB), bool),
                           match=jnp.asarray(np.stack([dry_matches(t) for t in np.asarray(tokens)])),
                           sampler=jnp.asarray(rng.uniform(2, 12, (n, SAMPLER_STATE)), jnp.float32))
    allowed = np.full((n, bitmask_words(VOCAB)), ALL_ALLOWED, np.int32)
    if constrained:
        allowed[1] = rng.integers(-2**31, 2**31 - 1, allowed.shape[1], dtype=np.int64).astype(np.int32)
    slots, step = jnp.arange(n, dtype=jnp.int32), jnp.full(n, 11, jnp.int32)

    def run():
        return jax.jit(choose, static_argnums=5)(logits, params, history, slots, step, 3,
                                                 jnp.asarray(allowed))

    tokens, logprobs, state = run()
    with control.branch_free():
        free_tokens, free_logprobs, free_state = run()
    np.testing.assert_array_equal(free_tokens, tokens)
    np.testing.assert_array_equal(free_state, state)
    for a, b in zip(jax.tree.leaves(free_logprobs), jax.tree.leaves(logprobs)):
        np.testing.assert_array_equal(a, b)


# "reference" attention: no control flow of its own ("xla"'s page walk has some, and a GPU
# engine runs the Pallas kernels), so the decode programs' is the sampler's and the step loop's.
MULTI = EngineConfig(num_slots=4, max_seq_len=128, prefill_chunk=32, min_kv_bucket=32, page_size=16,
                     decode_steps=4, attention="reference")
PROMPTS = {0: [5, 6, 7, 8, 9], 2: list(range(30, 60)), 3: [11, 12]}  # slot 1 stays idle


def _run(params, config, rows: SamplingRows, calls) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A fresh engine: PROMPTS prefilled, then a decode dispatch of each (steps, stops) in
    `calls`; each dispatch's tokens, and the KV pool after."""
    e = Engine(params, config, MULTI)
    tables = fixed_page_tables(MULTI)
    e.prefill([PrefillChunk(s, p, 0, True, tables[s]) for s, p in PROMPTS.items()], rows.params())
    positions = np.zeros(MULTI.num_slots, np.int32)
    for s, p in PROMPTS.items():
        positions[s] = len(p)
    active = np.isin(np.arange(MULTI.num_slots), list(PROMPTS))
    outs = []
    for steps, stops in calls:
        for slot, ids in stops.items():  # "last": the slot's last token, so it comes in stopped
            ids = [int(outs[-1][-1, slot])] if ids == "last" else ids
            rows.set(slot, RequestSampling(temperature=20.0, seed=slot + 7), stop_ids=ids)
        outs.append(np.asarray(e.decode(positions, active, rows.params(), tables, steps=steps)))
        positions = positions + steps
    return outs, [np.asarray(a) for a in e.cache.k + e.cache.v]


def test_engine_branch_free_decode_equals_branches(tiny_params, tiny_config):
    """The decode program's GPU form runs max_steps every dispatch, the steps past `steps` or
    past every row's stop writing nothing: the same tokens and KV as the CPU's early exit,
    with a row stopping mid-dispatch, a dispatch shorter than max_steps, and one in which
    every row comes in stopped. (Sampled hot: the tiny model's greedy choice repeats.)"""
    def rows():
        r = SamplingRows(MULTI.num_slots)
        for s in PROMPTS:
            r.set(s, RequestSampling(temperature=20.0, seed=s + 7))
        return r

    first, _ = _run(tiny_params, tiny_config, rows(), [(4, {})])
    run = first[0][:, 0].tolist()
    at = next(i for i in range(1, 4) if run[i] not in run[:i])  # slot 0 ends at its first sight of it
    calls = [(4, {0: [run[at]]}), (2, {}), (3, {2: "last", 3: "last"})]
    outs, pool = _run(tiny_params, tiny_config, rows(), calls)
    with control.branch_free():
        free_outs, free_pool = _run(tiny_params, tiny_config, rows(), calls)
        ran = [p for p in engine_programs(tiny_config, MULTI)
               if p.field in ("prefill", "decode", "decode_batched")]
        free = [host_waits(lower(p, "cpu").as_text()) for p in ran]
    assert free and all(waits == [] for waits in free)  # the form it ran
    # (programs of their own: JAX keeps one trace per function, whichever form it took)
    decode = next(p for p in engine_programs(tiny_config, MULTI) if p.field.startswith("decode"))
    assert host_waits(lower(decode, "cpu").as_text())  # and the CPU's, which branches
    for a, b in zip(free_outs, outs):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(free_pool, pool):
        np.testing.assert_array_equal(a, b)
    assert outs[0][at:, 0].tolist() == [run[at]] * (4 - at)  # slot 0 stopped mid-dispatch
    assert (outs[2] == outs[1][-1]).all()  # every row came in stopped: nothing ran
