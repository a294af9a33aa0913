"""Timing an engine's device programs and the device's own ceilings, on any backend: what
`bench.gpu_bench` (the full GPU benchmark) and `bench.gpu_check` (the prepared GPU run) measure
with. No flags: each function takes what it times.

    measure_ceilings()                      copy and read GB/s, bf16 matmul TFLOP/s
    time_decode(engine, active, context, sampling, tables, k=1)
                                            seconds per decode step, the host's dispatch time, compiles
    roofline_point(...)                     one decode point against (weights + live KV) / copy GB/s
    time_split_decode(...), time_verify(...)  structured output's two halves; speculative verify
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from cadence.bench import roofline

VERIFY_DRAFTS = 4


def measure_ceilings(smoke: bool = False) -> dict:
    """The device's copy and read bandwidth (a 4 GiB bf16 array; 2 MiB with `smoke`) and its
    bf16 matmul rate (8192^3; 256^3): the ceilings the rooflines divide by."""
    size = 2**20 if smoke else 2**31  # bf16 elements: 4 GiB
    copy_s, read_s = _memory_seconds(jnp.ones((size,), jnp.bfloat16))
    n = 256 if smoke else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(jnp.matmul)
    mm_s = roofline.timed(lambda: mm(a, b), repeats=10)
    return {
        "copy_gb_s": 2 * 2 * size / copy_s / 1e9,  # bytes read + written
        "read_gb_s": 2 * size / read_s / 1e9,
        "bf16_matmul_tflop_s": 2 * n**3 / mm_s / 1e12,
        "matmul_shape": [n, n, n],
    }


def _memory_seconds(x: jax.Array) -> tuple[float, float]:
    copy = jax.jit(lambda a: -a)
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return roofline.timed(lambda: copy(x), repeats=10), roofline.timed(lambda: read(x), repeats=10)


def time_decode(engine, active_n: int, context: int, rows, tables, steps: int = 20, k: int = 1):
    """Seconds per decode step of `active_n` slots at `context` in dispatches of `k` steps,
    the median host dispatch time, and the compiles while timed (after one untimed dispatch
    that compiles)."""
    from cadence.engine import compile_counter

    slots = engine.config.num_slots
    active = np.arange(slots) < active_n
    positions = np.where(active, context - 1, -1).astype(np.int32)
    engine.decode(positions, active, rows, tables, k).block_until_ready()  # compile / warm
    compiles = compile_counter.count()
    dispatch = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = engine.decode(positions, active, rows, tables, k)
        dispatch.append(time.perf_counter() - t0)
    tokens.block_until_ready()
    return ((time.perf_counter() - start) / (steps * k), float(np.median(dispatch)),
            compile_counter.count() - compiles)


def roofline_point(engine, active_n: int, context: int, rows, tables, weight_bytes: int,
                   kv_per_token: int, ceilings: dict) -> dict:
    """One timed decode point against its roofline: (weights + live KV) / copy bandwidth."""
    step, dispatch, compiles = time_decode(engine, active_n, context, rows, tables)
    roofline = (weight_bytes + active_n * context * kv_per_token) / (ceilings["copy_gb_s"] * 1e9)
    return {"active": active_n, "context": context, "step_ms": step * 1e3,
            "roofline_ms": roofline * 1e3, "ratio_to_roofline": step / roofline,
            "dispatch_ms": dispatch * 1e3, "host_fraction": dispatch / step,
            "compilations_while_timed": compiles}


def time_split_decode(engine, active_n: int, context: int, rows, tables, allowed, steps: int = 20):
    """`time_decode` for a decode step in two halves (structured output: `decode_forward`, then
    `decode_sample` with bitmasks `allowed`), and whether its first step's tokens equal the
    fused program's (greedy rows, every token allowed)."""
    from cadence.engine import compile_counter
    from cadence.model.host_sampling import all_allowed

    slots = engine.config.num_slots
    active = np.arange(slots) < active_n
    positions = np.where(active, context - 1, -1).astype(np.int32)
    inputs = jnp.array(engine.last_tokens, copy=True)
    fused = np.asarray(engine.decode(positions, active, rows, tables))
    engine.last_tokens = inputs  # the same step again, from the same input tokens
    engine.decode_forward(positions, active, rows, tables)  # compile / warm
    split = np.asarray(engine.decode_sample(all_allowed(slots, engine.vocab_size)))
    compiles = compile_counter.count()
    start = time.perf_counter()
    for _ in range(steps):
        engine.decode_forward(positions, active, rows, tables)
        tokens = engine.decode_sample(allowed)
    tokens.block_until_ready()
    return ((time.perf_counter() - start) / steps, bool((fused[0, active] == split[0, active]).all()),
            compile_counter.count() - compiles)


def time_verify(engine, active_n: int, context: int, rows, tables, steps: int = 20):
    """Seconds per verify step of `active_n` slots at `context`, each with VERIFY_DRAFTS
    drafts, and the compiles while timed (after one untimed step that compiles)."""
    from cadence.engine import compile_counter

    slots = engine.config.num_slots
    active = np.arange(slots) < active_n
    positions = np.where(active, context - 1 - VERIFY_DRAFTS, -1).astype(np.int32)
    drafts = np.full((slots, VERIFY_DRAFTS), 7, np.int32)
    lens = np.where(active, VERIFY_DRAFTS, 0).astype(np.int32)
    engine.verify(positions, active, rows, tables, drafts, lens).block_until_ready()
    compiles = compile_counter.count()
    start = time.perf_counter()
    for _ in range(steps):
        tokens = engine.verify(positions, active, rows, tables, drafts, lens)
    tokens.block_until_ready()
    return (time.perf_counter() - start) / steps, compile_counter.count() - compiles
