"""GPU benchmark of the Pallas attention kernels and the engine, in one run of a few minutes.

    python -m cadence.bench.gpu_bench --out=bench/results/gpu-h200/gpu_bench.json

A script for a machine with an NVIDIA GPU (see docs/gpu.md), never part of the test suite. In order,
each section written to the JSON file as soon as it is done (so a run cut short keeps what it had):

1. ceilings, measured here: a large device copy (GB/s, bytes read + written) and a large bf16
   matmul (TFLOP/s);
2. the kernel tests of tests/test_pallas.py, test_paged_attention.py and test_mosaic_paged.py
   compiled on the GPU (one pytest subprocess with CADENCE_PALLAS_INTERPRET=0 and float32
   matmuls at full precision);
3. both kernels against `xla_attention` and cuDNN (`jax.nn.dot_product_attention(...,
   implementation="cudnn")`, given its own [batch, seq, heads, dim] layout) at the Llama-3-8B
   (32/8/128) and SmolLM2 (9/3/64) head shapes: causal prefill of 4k and 8k tokens (TFLOP/s),
   decode at several batches and contexts (GB/s of K and V read); and, on the same K/V laid out
   in pages of `--page_size` tokens through a shuffled page table, the paged kernels, Triton's
   and Mosaic GPU's (`model.pallas_paged.pallas_paged_attention` and
   `model.mosaic_paged.mosaic_paged_attention`, prefill and decode) and the XLA paged decode
   (`model.paged_attention.xla_paged_attention`), each output's largest difference from the
   contiguous kernel's recorded with it;
4. the engine's own prefill and decode programs for the Llama-3-8B shape with random bf16
   weights and `attention="pallas"`: a 4k-token prefill (TFLOP/s against the matmul ceiling)
   and decode steps at 1-64 active slots (against the roofline (weights + live KV) / copy GB/s),
   with the host's dispatch time per step; a decode step split in two halves for structured
   output (forward, then sampling under token bitmasks) against the fused one; speculative
   decoding's verify step (4 drafts a row) against a decode step at 1, 8 and all slots;
5. the weight-only grouped matmul (`model.pallas_quant`, int8 and int4 in groups of 32) at
   decode's 1-32 rows over Llama-3-8B's MLP and SmolLM2's matrices, against XLA's bf16 matmul
   over the same weights dequantized: GB/s of the weights' bytes, and the largest difference.

Kernel times come from a chain of calls inside one jitted program (each call's input depends on
the previous output), so Python dispatch does not hide a 10-microsecond kernel.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cadence.bench import roofline
from cadence.bench.gpu_timing import (
    VERIFY_DRAFTS, measure_ceilings, roofline_point, time_decode, time_split_decode, time_verify,
)
from cadence.engine.config import DEFAULT_PAGE_SIZE
from cadence.model.arith import cdiv

_OUT = flags.DEFINE_string("out", None, "JSON results file (default: bench/results/gpu-<gpu>/gpu_bench-<date>.json).")
_DEADLINE = flags.DEFINE_float("deadline_s", 420.0, "Skip remaining measurements after this many seconds.")
_SKIP_TESTS = flags.DEFINE_bool("skip_tests", False, "Skip the compiled kernel tests.")
_SKIP_ENGINE = flags.DEFINE_bool("skip_engine", False, "Skip the Llama-3-8B engine section.")
_PREFILL_TOKENS = flags.DEFINE_list("prefill_tokens", ["4096", "8192"], "Prefill lengths for the kernels.")
_DECODE_BATCHES = flags.DEFINE_list("decode_batches", ["1", "8", "64"], "Decode batch sizes for the kernels.")
_DECODE_CONTEXTS = flags.DEFINE_list("decode_contexts", ["1024", "4096"], "Decode contexts for the kernels.")
_ENGINE_SLOTS = flags.DEFINE_list("engine_active", ["1", "8", "32", "64"], "Active slots for 8B decode.")
_TP_DEGREES = flags.DEFINE_list("tp", ["1", "2", "4", "8"], "Tensor-parallel degrees to time (those the machine has devices for).")
# Any size works on the GPU: the paged kernels load each key's row through the page table, so
# their tiles (block_k) are chosen as the contiguous kernels' are, and may span pages.
_PAGE_SIZE = flags.DEFINE_integer(
    "page_size", DEFAULT_PAGE_SIZE, "Tokens per page for the paged kernels (default: the engine's).",
    lower_bound=1)
_SWEEP = flags.DEFINE_bool("sweep", True, "Also time a few kernel tilings at the Llama-3-8B shape.")
_SMOKE = flags.DEFINE_bool(
    "smoke", False, "Tiny shapes on any backend (kernels interpreted off GPU): checks the script itself."
)

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # query heads, KV heads, head_dim
MULTI_STEP = 8  # decode steps per dispatch for the engine's multi-step points
START = time.monotonic()


def elapsed() -> float:
    return time.monotonic() - START


def over_deadline() -> bool:
    return elapsed() > _DEADLINE.value


def chained(attend, n: int):
    """A jitted program that calls `attend(q, *rest)` n times, each on q nudged by the previous
    output times a runtime zero, so XLA can neither drop nor merge the calls."""

    once = jax.jit(attend)  # lowered (and handed to Triton) once, called n times

    @jax.jit
    def run(zero, q, *rest):
        for _ in range(n):
            out = once(q, *rest)
            q = q + (out * zero).astype(q.dtype)
        return q

    return run


def kernel_seconds(attend, args, n: int) -> float:
    run = chained(attend, n)
    zero = jnp.zeros((), args[0].dtype)
    return roofline.timed(lambda: run(zero, *args), repeats=3) / n


# -- 1. ceilings -----------------------------------------------------------------------------

# -- 2. compiled kernel tests ------------------------------------------------------------------

KERNEL_TESTS = ("tests/test_pallas.py", "tests/test_paged_attention.py", "tests/test_mosaic_paged.py")
TESTS_TIMEOUT_S = 240  # three files of compiled kernel cases, in one process (one JAX start)


def run_kernel_tests() -> dict:
    env = dict(os.environ, CADENCE_PALLAS_INTERPRET="0", JAX_DEFAULT_MATMUL_PRECISION="highest")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
        tail, code = (done.stdout + done.stderr)[-4000:], done.returncode
    except subprocess.TimeoutExpired as e:
        tail, code = f"timed out after {TESTS_TIMEOUT_S} s: {str(e.stdout)[-2000:]}", -1
    print(tail)
    return {"passed": code == 0, "returncode": code, "seconds": time.monotonic() - start,
            "output_tail": tail}


# -- 3. kernels against XLA and cuDNN ---------------------------------------------------------

# Implementations that stop at each row's length, so a cache longer than the live context costs
# them nothing; the others read the whole cache by design.
FOLLOW_LENGTHS = ("pallas", "pallas_paged", "mosaic_paged", "xla_paged")
# xla_paged_attention's decode is a static loop per row: 16 chained copies at batch 64 are ~1000
# loops to compile, and a loop of page-sized steps runs far longer than a dispatch anyway.
CHAIN_AT_MOST = {"xla_paged": 2}


def attention_impls(decode: bool):
    """name -> (function, its layout): "ours" takes (q, k, v, positions) with our
    [batch, kv_heads, seq, d] cache, "paged" (q, k_pages, v_pages, page_table, positions) with
    that cache in shuffled pages, "bshd" cuDNN's (q, k, v, kv_lengths), [batch, seq, heads, d]."""
    from cadence.model.attention import xla_attention
    from cadence.model.mosaic_paged import mosaic_paged_attention
    from cadence.model.paged_attention import xla_paged_attention
    from cadence.model.pallas_decode import flash_decode
    from cadence.model.pallas_paged import pallas_paged_attention
    from cadence.model.pallas_prefill import flash_prefill

    pallas = flash_decode if decode else flash_prefill
    interpret = jax.default_backend() != "gpu"  # only with --smoke

    def cudnn(q, k_bshd, v_bshd, kv_lengths):
        if decode:
            return jax.nn.dot_product_attention(
                q, k_bshd, v_bshd, key_value_seq_lengths=kv_lengths, implementation="cudnn"
            )
        return jax.nn.dot_product_attention(q, k_bshd, v_bshd, is_causal=True, implementation="cudnn")

    impls = {
        "pallas": (functools.partial(pallas, interpret=interpret), "ours"),
        "xla": (xla_attention, "ours"),
        "cudnn": (cudnn, "bshd"),
        "pallas_paged": (functools.partial(pallas_paged_attention, interpret=interpret), "paged"),
        "mosaic_paged": (functools.partial(mosaic_paged_attention, interpret=interpret), "paged"),
    }
    if decode:  # a paged XLA prefill is the page gather then `xla_attention`: nothing new to time
        impls["xla_paged"] = (xla_paged_attention, "paged")
    return impls


def shuffled_pages(rng, k: jax.Array, v: jax.Array, page_size: int):
    """The cache k, v [batch, kv_heads, kv_len, d] as a paged pool, in its dtype, on the device:
    (k_pages, v_pages [kv_heads, num_pages, page_size, d], page_table [batch, max_pages] int32),
    every row's pages scattered through a random permutation of the pool, as an allocator that
    has run for a while leaves them. A last partial page is padded with zeros no query sees."""
    batch, kv_heads, kv_len, head_dim = k.shape
    max_pages = cdiv(kv_len, page_size)
    table = rng.permutation(batch * max_pages).astype(np.int32)  # (row, j) -> its pool page
    holder = jnp.asarray(np.argsort(table))  # pool page -> the (row, j) it holds

    def scatter(x):
        x = jnp.pad(x, ((0, 0), (0, 0), (0, max_pages * page_size - kv_len), (0, 0)))
        blocks = x.reshape(batch, kv_heads, max_pages, page_size, head_dim).transpose(1, 0, 2, 3, 4)
        return blocks.reshape(kv_heads, batch * max_pages, page_size, head_dim)[:, holder]

    return scatter(k), scatter(v), jnp.asarray(table.reshape(batch, max_pages))


def layout_args(layout: str, q, k, v, positions, paged, kv_lengths) -> tuple:
    """One implementation's arguments in its layout (see `attention_impls`)."""
    if layout == "paged":
        return (q, *paged, positions)
    if layout == "bshd":  # transposed here, outside the timing
        return (q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), kv_lengths)
    return (q, k, v, positions)


def time_impls(point: dict, impls: dict, args_of, n: int, figures) -> None:
    """Times each implementation over a chain of `n` calls (`args_of(layout)` its arguments) into
    `point[name]` (`figures(seconds)`, or the error), then the differences of the outputs."""
    outs = {}
    for name, (fn, layout) in impls.items():
        try:
            args = args_of(layout)
            seconds = kernel_seconds(fn, args, n=min(n, CHAIN_AT_MOST.get(name, n)))
            outs[name] = np.asarray(jax.jit(fn)(*args).astype(jnp.float32))
            point[name] = figures(seconds)
        except Exception as e:  # noqa: BLE001 - a missing cuDNN path is a result too
            point[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    record_differences(point, outs)


def bench_kernels(results: dict, write) -> None:
    rng = np.random.default_rng(0)
    for shape, (heads, kv_heads, head_dim) in SHAPES.items():
        for tokens in map(int, _PREFILL_TOKENS.value):
            if over_deadline():
                return
            q = jnp.asarray(rng.standard_normal((1, tokens, heads, head_dim)), jnp.bfloat16)
            k = jnp.asarray(rng.standard_normal((1, kv_heads, tokens, head_dim)), jnp.bfloat16)
            v = jnp.asarray(rng.standard_normal((1, kv_heads, tokens, head_dim)), jnp.bfloat16)
            positions = jnp.arange(tokens, dtype=jnp.int32)[None]
            flops = 4 * heads * head_dim * tokens * (tokens + 1) / 2  # causal pairs, 2 matmuls
            point = {"shape": shape, "tokens": tokens, "flop": flops, "page_size": _PAGE_SIZE.value}
            paged = shuffled_pages(rng, k, v, _PAGE_SIZE.value)
            time_impls(point, attention_impls(decode=False),
                       lambda layout: layout_args(layout, q, k, v, positions, paged, None), n=4,
                       figures=lambda s: {"ms": s * 1e3, "tflop_s": flops / s / 1e12})
            results["prefill"].append(point)
            print("prefill", json.dumps(point))
            write()
    for shape, (heads, kv_heads, head_dim) in SHAPES.items():
        for context in map(int, _DECODE_CONTEXTS.value):
            for batch in map(int, _DECODE_BATCHES.value):
                if over_deadline():
                    return
                bench_decode_point(results, rng, shape, heads, kv_heads, head_dim, batch, context, context)
                write()
    # Skipping: a cache twice the live context should cost the same as the live context alone.
    heads, kv_heads, head_dim = SHAPES["llama3-8b"]
    if not over_deadline():
        context = int(_DECODE_CONTEXTS.value[-1])
        batch = int(_DECODE_BATCHES.value[-1])
        bench_decode_point(results, rng, "llama3-8b", heads, kv_heads, head_dim, batch, context, 2 * context)
        write()


def record_differences(point: dict, outs: dict) -> None:
    """Largest |pallas - other| for each other implementation that produced an output (the
    paged ones included: the same keys through shuffled pages must give the same attention)."""
    for name in outs:
        if "pallas" in outs and name != "pallas":
            point[f"max_abs_diff_vs_{name}"] = float(np.max(np.abs(outs["pallas"] - outs[name])))


def bench_decode_point(results, rng, shape, heads, kv_heads, head_dim, batch, context, cache_len):
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((batch, kv_heads, cache_len, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((batch, kv_heads, cache_len, head_dim)), jnp.bfloat16)
    positions = jnp.full((batch, 1), context - 1, jnp.int32)
    kv_bytes = 2 * batch * kv_heads * context * head_dim * 2
    point = {"shape": shape, "batch": batch, "context": context, "cache_len": cache_len,
             "kv_bytes": kv_bytes, "page_size": _PAGE_SIZE.value}
    impls = {name: impl for name, impl in attention_impls(decode=True).items()
             if cache_len == context or name in FOLLOW_LENGTHS}
    paged = shuffled_pages(rng, k, v, _PAGE_SIZE.value)  # a page table as wide as the cache
    kv_lengths = jnp.full((batch,), context, jnp.int32)
    time_impls(point, impls, lambda layout: layout_args(layout, q, k, v, positions, paged, kv_lengths),
               n=16, figures=lambda s: {"us": s * 1e6, "gb_s": kv_bytes / s / 1e9})
    results["decode"].append(point)
    print("decode", json.dumps(point))


def sweep_tilings(results: dict, write) -> None:
    """A few tilings of each kernel at the Llama-3-8B shape, for choosing the defaults."""
    from cadence.model.pallas_decode import DecodeTiling, default_tiling, flash_decode
    from cadence.model.pallas_prefill import PrefillTiling, flash_prefill

    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(1)
    heads, kv_heads, head_dim = SHAPES["llama3-8b"]
    sweep = results["tiling_sweep"] = {"prefill": [], "decode": []}
    tokens = int(_PREFILL_TOKENS.value[0])
    q = jnp.asarray(rng.standard_normal((1, tokens, heads, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, kv_heads, tokens, head_dim)), jnp.bfloat16)
    args = (q, k, k, jnp.arange(tokens, dtype=jnp.int32)[None])
    flops = 4 * heads * head_dim * tokens * (tokens + 1) / 2
    for tiling in (PrefillTiling(32, 64, 8, 3), PrefillTiling(32, 128, 8, 2), PrefillTiling(32, 64, 4, 3),
                   PrefillTiling(16, 64, 4, 3), PrefillTiling(16, 128, 4, 2), PrefillTiling(64, 64, 8, 2)):
        if over_deadline():
            return
        point = {"tiling": vars(tiling), "tokens": tokens}
        try:
            fn = functools.partial(flash_prefill, tiling=tiling, interpret=interpret)
            seconds = kernel_seconds(fn, args, n=4)
            point.update(ms=seconds * 1e3, tflop_s=flops / seconds / 1e12)
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is a result too
            point["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        sweep["prefill"].append(point)
        print("sweep prefill", json.dumps(point))
    write()
    context = int(_DECODE_CONTEXTS.value[-1])
    for batch in sorted({1, int(_DECODE_BATCHES.value[-1])}):
        q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((batch, kv_heads, context, head_dim)), jnp.bfloat16)
        args = (q, k, k, jnp.full((batch, 1), context - 1, jnp.int32))
        kv_bytes = 2 * k.size * 2
        base = default_tiling(batch, kv_heads, context, head_dim)
        variants = [DecodeTiling(bk, splits, warps, stages)
                    for bk, stages in ((64, 3), (128, 2)) for warps in (4, 8)
                    for splits in (base.num_splits, 2 * base.num_splits)]
        for tiling in variants:
            if over_deadline():
                return
            point = {"tiling": vars(tiling), "batch": batch, "context": context}
            try:
                fn = functools.partial(flash_decode, tiling=tiling, interpret=interpret)
                seconds = kernel_seconds(fn, args, n=16)
                point.update(us=seconds * 1e6, gb_s=kv_bytes / seconds / 1e9)
            except Exception as e:  # noqa: BLE001
                point["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            sweep["decode"].append(point)
            print("sweep decode", json.dumps(point))
        write()


# -- 4. the engine at the Llama-3-8B shape ----------------------------------------------------

def bench_tensor_parallel(results: dict, write) -> None:
    """Prefill and decode of one engine over 1, 2, 4, ... of the machine's devices
    (`--tensor_parallel`), Llama-3-8B bf16 (the tiny model with --smoke): what the split
    buys and what its all-reduces cost. Needs more than one device."""
    from cadence.engine.config import EngineConfig, fixed_page_tables
    from cadence.engine.engine import Engine
    from cadence.engine.packing import PrefillChunk
    from cadence.engine.programs import sampling_rows
    from cadence.model.config import LLAMA3_8B, TINY
    from cadence.model.params import random_params
    from cadence.model.host_sampling import RequestSampling

    degrees = [n for n in map(int, _TP_DEGREES.value) if n <= jax.device_count()]
    if jax.device_count() < 2:
        results["tensor_parallel"] = {"skipped": f"one {jax.devices()[0].platform} device"}
        write()
        return
    cfg = TINY if _SMOKE.value else LLAMA3_8B
    prompt_len, context, slots = (32, 64, 4) if _SMOKE.value else (2048, 2048, 64)
    params = jax.tree.map(np.asarray, random_params(
        cfg, jax.random.key(0), jnp.bfloat16))
    prompt = np.random.default_rng(0).integers(100, cfg.vocab_size, prompt_len).tolist()
    points = results["tensor_parallel"] = []
    for n in degrees:
        if over_deadline():
            break
        engine = Engine(params, cfg, EngineConfig(
            num_slots=slots, max_seq_len=context + 32, prefill_chunk=prompt_len,
            attention="pallas", dtype="bfloat16"), devices=jax.devices()[:n])
        tables = fixed_page_tables(engine.config)
        rows = sampling_rows([RequestSampling()] * slots)
        chunk = [PrefillChunk(0, prompt, 0, True, tables[0])]
        engine.prefill(chunk, rows).block_until_ready()
        point = {"tp": n, "split": engine.tp.describe() if engine.tp else "one device",
                 "prefill_tokens": prompt_len,
                 "prefill_s": roofline.timed(lambda: engine.prefill(chunk, rows), repeats=3)}
        for active_n in (1, slots):
            step, dispatch, compiles = time_decode(engine, active_n, context, rows, tables)
            point[f"decode_{active_n}_ms"] = step * 1e3
            point[f"decode_{active_n}_compiles"] = compiles
        points.append(point)
        print("tensor parallel", json.dumps(point))
        del engine
        write()


def bench_engine(results: dict, ceilings: dict, write) -> None:
    from cadence.engine.config import EngineConfig, fixed_page_tables
    from cadence.engine.engine import Engine
    from cadence.engine.packing import PrefillChunk
    from cadence.engine.programs import sampling_rows
    from cadence.model.config import LLAMA3_8B, TINY
    from cadence.model.params import random_params
    from cadence.model.quant import quantize
    from cadence.model.host_sampling import RequestSampling, bitmask_words

    cfg = TINY if _SMOKE.value else LLAMA3_8B
    start = time.monotonic()
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    jax.block_until_ready(params)
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    slots = max(map(int, _ENGINE_SLOTS.value))
    prompt_len = 32 if _SMOKE.value else 4096
    contexts = (16, 64) if _SMOKE.value else (1024, 4096)
    config = EngineConfig(num_slots=slots, max_seq_len=max(prompt_len, *contexts) + 32,
                          prefill_chunk=prompt_len, attention="pallas", dtype="bfloat16",
                          decode_steps=MULTI_STEP, structured_output=True,
                          speculative_tokens=VERIFY_DRAFTS, speculative_batch=slots)
    engine = Engine(params, cfg, config)
    tables = fixed_page_tables(engine.config)  # each slot a run of pages, as if allocated
    int8 = quantize(params, cfg)
    del params
    info = {"weight_bytes": weight_bytes, "kv_cache_bytes": engine.kv_cache_bytes,
            "setup_s": time.monotonic() - start, "prefill": None, "decode": []}
    results["engine"] = info
    print(f"engine: weights {weight_bytes / 1e9:.1f} GB, KV cache {engine.kv_cache_bytes / 1e9:.1f} GB")

    prompt = np.random.default_rng(0).integers(100, cfg.vocab_size, prompt_len).tolist()
    start = time.monotonic()
    rows = sampling_rows([RequestSampling()] * slots)
    chunk = [PrefillChunk(0, prompt, 0, True, tables[0])]
    engine.prefill(chunk, rows).block_until_ready()
    compile_s = time.monotonic() - start
    seconds = roofline.timed(lambda: engine.prefill(chunk, rows), repeats=3)
    flops = roofline.prefill_cost(cfg, 0, prompt_len, 2)["flops"]
    info["prefill"] = {
        "tokens": prompt_len, "first_call_s": compile_s, "seconds": seconds,
        "tokens_per_s": prompt_len / seconds, "tflop_s": flops / seconds / 1e12,
        "fraction_of_matmul": flops / seconds / 1e12 / ceilings["bf16_matmul_tflop_s"],
    }
    print("engine prefill", json.dumps(info["prefill"]))
    write()
    info["host_tier"] = time_host_tier(engine, tables[0], prompt_len, info["prefill"]["seconds"])
    print("engine host tier", json.dumps(info["host_tier"]))
    write()

    kv_per_token = cfg.kv_bytes_per_token(2)
    for context in contexts:
        for active_n in map(int, _ENGINE_SLOTS.value):
            if over_deadline():
                return
            point = roofline_point(engine, active_n, context, rows, tables, weight_bytes,
                                   kv_per_token, ceilings)
            info["decode"].append(point)
            print("engine decode", json.dumps(point))
            write()
    # Several steps per dispatch, then int8 weights (`model.quant`), at the longer context.
    context, info["multistep"], info["int8"] = contexts[-1], [], {"weight_bytes": 0, "decode": []}
    for active_n in (1, slots):
        if over_deadline():
            return
        step, dispatch, compiles = time_decode(engine, active_n, context, rows, tables, k=MULTI_STEP)
        point = {"active": active_n, "context": context, "steps_per_dispatch": MULTI_STEP,
                 "step_ms": step * 1e3, "dispatch_ms": dispatch * 1e3, "compilations_while_timed": compiles}
        info["multistep"].append(point)
        print("engine decode multistep", json.dumps(point))
        write()
    # Structured output's split step: every token allowed, and half the vocabulary per row.
    info["split"] = []
    half = np.tile(np.int32(0x55555555), (slots, bitmask_words(cfg.vocab_size)))
    for active_n in (1, slots):
        if over_deadline():
            return
        step, same, compiles = time_split_decode(engine, active_n, context, rows, tables, half)
        fused = time_decode(engine, active_n, context, rows, tables)[0]
        point = {"active": active_n, "context": context, "split_step_ms": step * 1e3,
                 "fused_step_ms": fused * 1e3, "first_tokens_equal_fused": same,
                 "compilations_while_timed": compiles}
        info["split"].append(point)
        print("engine decode split", json.dumps(point))
        write()
    # Speculative decoding's verify step (each row's last token and VERIFY_DRAFTS drafts in one
    # pass) against a decode step: what a step that drafts costs.
    info["verify"] = []
    for active_n in sorted({1, min(8, slots), slots}):
        if over_deadline():
            return
        step, compiles = time_verify(engine, active_n, context, rows, tables)
        fused = time_decode(engine, active_n, context, rows, tables)[0]
        point = {"active": active_n, "context": context, "drafts": VERIFY_DRAFTS,
                 "verify_step_ms": step * 1e3, "decode_step_ms": fused * 1e3,
                 "ratio": step / fused, "compilations_while_timed": compiles}
        info["verify"].append(point)
        print("engine verify", json.dumps(point))
        write()
    engine = None  # its weights and pool go before the int8 engine's arrive
    q_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(int8))
    engine = Engine(int8, cfg, config)
    del int8
    info["int8"]["weight_bytes"] = q_bytes
    for active_n in (1, slots):
        if over_deadline():
            return
        point = roofline_point(engine, active_n, context, rows, tables, q_bytes, kv_per_token, ceilings)
        info["int8"]["decode"].append(point)
        print("engine decode int8", json.dumps(point))
        write()


def time_host_tier(engine, pages, tokens: int, prefill_s: float) -> dict:
    """The prefix cache's host tier on the prompt just prefilled: its pages out to host memory
    (`extract`, the copy, taken apart into pages) and back into the same pages (`insert` with
    no slot), against computing them (`prefill_s`)."""
    from cadence.engine.packing import bucket_for

    count = engine.config.pages_for(tokens)
    handle = engine.extract(list(pages[:count]), tokens, 0)
    handle.block_until_ready()
    start = time.monotonic()
    handle.to_host_async()
    host = handle.host_pages()
    out_s = time.monotonic() - start
    width = bucket_for(engine.config.page_buckets, count)
    back = type(handle).from_host_pages(host, engine.config.page_size, width)
    engine.insert(back, list(pages[:count]), None).block_until_ready()  # (compiles, the first time)
    start = time.monotonic()
    jax.block_until_ready(engine.insert(back, list(pages[:count]), None))
    jax.block_until_ready(engine.cache.arrays())
    in_s = time.monotonic() - start
    moved = sum(a.nbytes for page in host for a in page)
    return {"tokens": tokens, "bytes": moved, "out_ms": out_s * 1e3, "out_gb_s": moved / out_s / 1e9,
            "in_ms": in_s * 1e3, "in_gb_s": moved / in_s / 1e9, "prefill_ms": prefill_s * 1e3,
            "in_over_prefill": in_s / prefill_s}


# -- targets and main ----------------------------------------------------------------------

# The attention kernels the targets hold, by the tag their verdicts carry: the contiguous
# Triton kernels (no tag, the first run's names), and the paged ones of each backend.
KERNEL_TAGS = {"pallas": "", "pallas_paged": "_paged", "mosaic_paged": "_mosaic"}


def evaluate(results: dict) -> dict:
    c = results.get("ceilings") or {}
    verdict = {}
    for p in results["decode"]:
        if (p["shape"], p["batch"], p["context"], p["cache_len"]) == ("llama3-8b", 64, 4096, 4096):
            for name, tag in KERNEL_TAGS.items():
                gb = p.get(name, {}).get("gb_s")
                if gb and c:
                    verdict[f"decode_kernel{tag}_b64_4k_fraction_of_copy_bw"] = gb / c["copy_gb_s"]
    for p in results["prefill"]:
        for name, tag in KERNEL_TAGS.items():
            if p["shape"] == "llama3-8b" and "tflop_s" in p.get(name, {}) and "tflop_s" in p.get("cudnn", {}):
                verdict[f"prefill_kernel{tag}_{p['tokens']}_vs_cudnn"] = (
                    p[name]["tflop_s"] / p["cudnn"]["tflop_s"])
    e = results.get("engine") or {}
    if e.get("prefill"):
        verdict["engine_prefill_4k_fraction_of_matmul"] = e["prefill"]["fraction_of_matmul"]
    if e.get("decode"):
        verdict["engine_decode_worst_ratio_to_roofline"] = max(p["ratio_to_roofline"] for p in e["decode"])
        verdict["engine_decode_worst_host_fraction"] = max(p["host_fraction"] for p in e["decode"])
    targets = {"decode_kernel_b64_4k_fraction_of_copy_bw": (">=", 0.8),
               "prefill_kernel_4096_vs_cudnn": (">=", 1.0), "prefill_kernel_8192_vs_cudnn": (">=", 1.0),
               "engine_prefill_4k_fraction_of_matmul": (">=", 0.6),
               "engine_decode_worst_ratio_to_roofline": ("<=", 1.2),
               "engine_decode_worst_host_fraction": ("<=", 0.05)}

    def target(key):  # every kernel's verdict holds the contiguous Triton kernel's target
        for tag in filter(None, KERNEL_TAGS.values()):
            key = key.replace(f"kernel{tag}_", "kernel_")
        return targets[key]

    return {k: {"value": v, "target": f"{target(k)[0]} {target(k)[1]}",
                "met": v >= target(k)[1] if target(k)[0] == ">=" else v <= target(k)[1]}
            for k, v in verdict.items()}


# -- 5. the weight-only grouped matmul -----------------------------------------------------------

QUANT_SHAPES = {"llama3-8b-up": (4096, 14336), "llama3-8b-down": (14336, 4096), "smollm2-up": (576, 1536)}


def bench_quant_matmul(results: dict, write) -> None:
    """Each format's kernel time per call in a chain, its weight bytes over that time, beside
    XLA's bfloat16 matmul over the dequantized weights."""
    from cadence.model.pallas_quant import dequantize_gpu, grouped_matmul, pack_gpu
    from cadence.model.quant import quantize_group_matrix

    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    shapes = {"tiny": (64, 48)} if _SMOKE.value else QUANT_SHAPES
    results["quant_matmul"] = []
    for name, (k, n) in shapes.items():
        w = rng.standard_normal((k, n)).astype(np.float32) * 0.02
        for fmt in ("q8", "q4"):
            packed = pack_gpu(*quantize_group_matrix(w, fmt))
            dense = jnp.asarray(dequantize_gpu(packed), jnp.bfloat16)
            on_device = jax.tree.map(jnp.asarray, packed)
            weight_bytes = sum(a.nbytes for a in packed.values())
            for rows in ([2] if _SMOKE.value else [1, 8, 32]):
                if over_deadline():
                    return
                x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
                # Each call's output, summed, nudges the next call's input (`chained`).
                kernel = lambda x, w=on_device: grouped_matmul(  # noqa: E731
                    x, w, interpret=interpret).sum(keepdims=True).astype(x.dtype)
                xla = lambda x, d=dense: jnp.dot(  # noqa: E731
                    x, d, preferred_element_type=jnp.float32).sum(keepdims=True).astype(x.dtype)
                point = {"shape": name, "k": k, "n": n, "format": fmt, "rows": rows, "weight_bytes": weight_bytes}
                calls = 1 if _SMOKE.value else 20
                try:
                    point["kernel_s"] = kernel_seconds(kernel, [x], calls)
                    point["kernel_gb_s"] = weight_bytes / point["kernel_s"] / 1e9
                    point["xla_bf16_s"] = kernel_seconds(xla, [x], calls)
                    point["xla_bf16_gb_s"] = dense.nbytes / point["xla_bf16_s"] / 1e9
                    got = np.asarray(grouped_matmul(x, on_device, interpret=interpret))
                    want = np.asarray(jnp.dot(x, dense, preferred_element_type=jnp.float32))
                    point["max_abs_diff_vs_xla"] = float(np.max(np.abs(got - want)))
                except Exception as e:  # noqa: BLE001 - record it, keep the rest
                    point["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                results["quant_matmul"].append(point)
                print(json.dumps(point))
                write()


def main(argv) -> None:
    del argv
    device = jax.devices()[0]
    if _SMOKE.value:
        flags.FLAGS.prefill_tokens, flags.FLAGS.decode_contexts = ["48"], ["40"]
        flags.FLAGS.decode_batches, flags.FLAGS.engine_active = ["2"], ["1", "4"]
        if not flags.FLAGS["page_size"].present:  # pages per row: 3 (prefill), 3 with a partial last
            flags.FLAGS.page_size = 16
    elif device.platform != "gpu":
        raise SystemExit(f"bench.gpu_bench needs a GPU; JAX sees {device} (run it where docs/gpu.md says)")
    gpu = getattr(device, "device_kind", str(device))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = Path(_OUT.value or f"bench/results/gpu-{gpu.split()[-1].lower()}/gpu_bench-{date[:10]}.json")
    results = {"gpu": gpu, "jax_version": jax.__version__, "date": date,
               "prefill": [], "decode": [], "engine": None}

    def write() -> None:
        results["elapsed_s"] = elapsed()
        results["targets"] = evaluate(results)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))

    results["ceilings"] = ceilings = measure_ceilings(_SMOKE.value)
    print(f"{gpu}, JAX {jax.__version__}: copy {ceilings['copy_gb_s']:.0f} GB/s, read "
          f"{ceilings['read_gb_s']:.0f} GB/s, bf16 matmul {ceilings['bf16_matmul_tflop_s']:.0f} TFLOP/s")
    write()
    if not _SKIP_TESTS.value and not _SMOKE.value:
        results["kernel_tests"] = run_kernel_tests()
        write()
    bench_kernels(results, write)
    if _SWEEP.value and not over_deadline():
        sweep_tilings(results, write)
    if not _SKIP_ENGINE.value and not over_deadline():
        try:
            bench_engine(results, ceilings, write)
        except Exception as e:  # noqa: BLE001 - keep everything measured so far
            results["engine_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    if not over_deadline():
        try:
            bench_quant_matmul(results, write)
        except Exception as e:  # noqa: BLE001
            results["quant_matmul_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    if not over_deadline():
        try:
            bench_tensor_parallel(results, write)
        except Exception as e:  # noqa: BLE001
            results["tensor_parallel_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    write()
    print(json.dumps(results["targets"], indent=2))
    print(f"wrote {out} after {elapsed():.0f} s")


if __name__ == "__main__":
    app.run(main)
