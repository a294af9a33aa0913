"""CPU decode attention over pages against the contiguous slots: which paged loop to keep.

    python bench/results/paged-attention-cpu/paged_attention_bench.py --out=bench/results/paged-attention-cpu/paged_attention.txt

Times one layer's decode attention (SmolLM2-135M's 9 query heads, 3 KV heads, head_dim 64,
float32) at 8 rows, each row at the same live context (128, 1000, 4000 tokens) and a mixed step
(seven chats at 128, one document at 4000), for:
- "contiguous": today's `model.attention._tiled_decode` on [8, 3, max_seq_len, 64] slots;
- "gather/ps": `paged_decode_gather`, 512-position tiles taken from their pages;
- "pages/ps": `paged_decode_pages`, one page per iteration;
- "kernel/ps": the CPU kernel, `model.cpu_kernels.paged_decode` (where it builds);
at page sizes 16, 64 and 128, with each row's pages shuffled across the pool (the same KV bytes
as the slots: 8 x max_seq_len tokens). The machine is shared and has 2 cores, so variants are
interleaved round by round (in a random order each round), and each figure is the median over
rounds of the mean of `--calls` calls; the best round is printed too. Every variant's output is checked against the contiguous one.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cadence.model.attention import _tiled_decode
from cadence.model.config import SMOLLM2_135M
from cadence.model import cpu_kernels
from cadence.model.paged_attention import paged_decode_gather, paged_decode_pages

_ROWS = flags.DEFINE_integer("rows", 8, "Decode rows (slots).")
_MAX_SEQ = flags.DEFINE_integer("max_seq_len", 4096, "Longest sequence (contiguous slot length).")
_PAGE_SIZES = flags.DEFINE_list("page_sizes", ["16", "64", "128"], "Page sizes to time.")
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Interleaved rounds; the median is reported.")
_CALLS = flags.DEFINE_integer("calls", 10, "Calls per variant per round.")
_OUT = flags.DEFINE_string("out", None, "Where to write the text results (and a JSON line).")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def paged_layout(rng, k, v, page_size: int):
    """The slots' KV [rows, kv_heads, max_len, d] scattered over a pool of shuffled pages:
    (k_pages, v_pages [kv_heads, num_pages, page_size, d], page_table [rows, max_pages])."""
    rows, heads, max_len, head_dim = k.shape
    max_pages = max_len // page_size
    table = rng.permutation(rows * max_pages).reshape(rows, max_pages).astype(np.int32)

    def scatter(x):
        pages = np.zeros((heads, rows * max_pages, page_size, head_dim), np.float32)
        blocks = x.reshape(rows, heads, max_pages, page_size, head_dim)
        pages[:, table] = blocks.transpose(1, 0, 2, 3, 4)
        return jnp.asarray(pages)

    return scatter(k), scatter(v), jnp.asarray(table)


def interleaved_times(fns: dict, rounds: int, calls: int, seed: int = 0) -> dict[str, list[float]]:
    """Per round, the mean seconds per call of each variant. Every variant runs once per round,
    in a fresh random order, so a burst of load from another process hits all of them alike."""
    order = np.random.default_rng(seed)
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name in order.permutation(list(fns)):
            start = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fns[name]())
            samples[name].append((time.perf_counter() - start) / calls)
    return samples


def figures(results: dict, stat) -> list[str]:
    """ms per call, then the ratio to contiguous, for each variant and context."""
    labels, names = list(results), list(next(iter(results.values())))
    lines = [f"{'variant':<14}" + "".join(f"{label:>10}" for label in labels)]
    for name in names:
        lines.append(f"{name:<14}" + "".join(
            f"{stat(results[label][name]) * 1e3:10.3f}" for label in labels
        ))
    lines.append("ratio to contiguous:")
    for name in names[1:]:
        lines.append(f"{name:<14}" + "".join(
            f"{stat(results[label][name]) / stat(results[label]['contiguous']):10.2f}"
            for label in labels
        ))
    return lines


def main(argv) -> None:
    del argv
    c = SMOLLM2_135M
    rows, max_len = _ROWS.value, _MAX_SEQ.value
    rng = np.random.default_rng(0)
    k = rng.standard_normal((rows, c.num_kv_heads, max_len, c.head_dim)).astype(np.float32)
    v = rng.standard_normal((rows, c.num_kv_heads, max_len, c.head_dim)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((rows, 1, c.num_heads, c.head_dim)), jnp.float32)
    contexts = {
        "128": [128] * rows, "1000": [1000] * rows, "4000": [4000] * rows,
        "mixed": [128] * (rows - 1) + [4000],
    }
    layouts = {int(ps): paged_layout(rng, k, v, int(ps)) for ps in _PAGE_SIZES.value}
    contiguous = jax.jit(_tiled_decode)
    gather, pages = jax.jit(paged_decode_gather), jax.jit(paged_decode_pages)
    kernel = jax.jit(cpu_kernels.paged_decode) if cpu_kernels.available() else None
    k, v = jnp.asarray(k), jnp.asarray(v)

    results = {}
    for label, lengths in contexts.items():
        pos = jnp.asarray(np.asarray(lengths, np.int32)[:, None] - 1)
        fns = {"contiguous": lambda pos=pos: contiguous(q, k, v, pos)}
        for ps, (kp, vp, table) in layouts.items():
            fns[f"gather/{ps}"] = lambda a=(q, kp, vp, table, pos): gather(*a)
            fns[f"pages/{ps}"] = lambda a=(q, kp, vp, table, pos): pages(*a)
            if kernel is not None:
                fns[f"kernel/{ps}"] = lambda a=(q, kp, vp, table, pos): kernel(*a)
        want = np.asarray(fns["contiguous"]())
        for name, fn in fns.items():  # compiles each, and checks the layouts agree
            np.testing.assert_allclose(np.asarray(fn()), want, atol=1e-4, rtol=1e-4, err_msg=name)
        results[label] = interleaved_times(fns, _ROUNDS.value, _CALLS.value)
        medians = {n: round(float(np.median(t)) * 1e3, 3) for n, t in results[label].items()}
        print(label, medians, flush=True)

    lines = [
        "Paged vs contiguous CPU decode attention, one layer, ms per call "
        f"({_ROUNDS.value} interleaved rounds x {_CALLS.value} calls)",
        f"command: python bench/results/paged-attention-cpu/paged_attention_bench.py {' '.join(sys.argv[1:])}".rstrip(),
        f"cpu: {cpu_model()} ({os.cpu_count()} cores); the machine was shared with another "
        "engineer's test runs, so rounds vary: the median is the figure, the best round a bound",
        f"jax {jax.__version__}, {datetime.datetime.now().isoformat(timespec='minutes')}",
        f"shape: {rows} rows, {c.num_heads} heads, {c.num_kv_heads} KV heads, head_dim "
        f"{c.head_dim}, float32, slots of {max_len} tokens / pools of the same bytes",
        "contiguous: model.attention._tiled_decode (512-position tiles of each slot)",
        "pages/ps: model.paged_attention.paged_decode_pages (one page per step; the default)",
        "gather/ps: model.paged_attention.paged_decode_gather (512-position tiles taken from pages)",
        "kernel/ps: model.cpu_kernels.paged_decode (the C++ kernel: each row's live pages read once)"
        if kernel is not None else f"kernel/ps: not run ({cpu_kernels.unavailable_reason()})",
        "columns: the live context of every row; mixed = 7 rows at 128 and one at 4000",
        "",
        "median over rounds:",
        *figures(results, np.median),
        "",
        "best round:",
        *figures(results, np.min),
    ]
    text = "\n".join(lines)
    print(text)
    if _OUT.value:
        record = {
            "median_ms": {c: {n: float(np.median(t)) * 1e3 for n, t in r.items()}
                          for c, r in results.items()},
            "best_ms": {c: {n: float(np.min(t)) * 1e3 for n, t in r.items()}
                        for c, r in results.items()},
        }
        Path(_OUT.value).write_text(text + "\n\n" + json.dumps(record) + "\n")


if __name__ == "__main__":
    app.run(main)
