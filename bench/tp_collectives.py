"""What tensor parallelism costs in communication, counted from the compiled programs.

    python -m cadence.bench.tp_collectives --model=llama3-8b --tp=2,4,8 --batch=64 --chunk=512

For each TP degree this compiles the engine's own programs (`engine.programs.jit_programs`, the
ones `Engine(devices=...)` runs) on that many CPU devices from shapes alone (nothing the size of
the model is allocated): one decode step over `--batch` rows and one packed prefill of `--chunk`
tokens, bfloat16, "xla" attention (attention runs per device under `shard_map` and communicates
nothing, so the kernel does not change the count). It then reads every collective out of the
optimized HLO with the bytes of its result on one device. Collectives inside a `lax.cond` run
only on that branch's steps: sampling's one cond takes an all-greedy step or a sampling step, so
each program is reported for both.

XLA:CPU computes bfloat16 matmuls in float32, so the all-reduces after o and down carry float32
here; a GPU compile carries bfloat16, half these bytes (unmeasured until a multi-GPU machine).

Layers are identical, so it compiles the model at one and at two layers: the difference is one
layer's collectives, and the whole model is `fixed + layers x per layer`, exact for any depth
without compiling 32 layers. The bytes each device sends use the ring algorithms' volumes
(all-reduce 2 (n-1)/n x size, all-gather and reduce-scatter (n-1)/n x size), and the time is that
volume over a link's bandwidth (`bench.roofline.LINKS`), a lower bound: it leaves out latency,
which dominates the small decode messages.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections import Counter
from pathlib import Path

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "llama3-8b", "A preset of model.config.PRESETS.")
_TP = flags.DEFINE_list("tp", ["2", "4", "8"], "Tensor-parallel degrees.")
_BATCH = flags.DEFINE_integer("batch", 64, "Rows of the decode step.")
_CHUNK = flags.DEFINE_integer("chunk", 512, "Tokens of the prefill program.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1,
                "f64": 8, "s64": 8}
# `%name = shape op(` where shape is one array shape or a tuple of them; async pairs count once.
_LINE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


_BRANCH = re.compile(r"/cond/branch_(\d+)_fun")
# `model.sampling`'s `lax.cond`s: branch 0 when no row uses the stage (all greedy, no bias,
# penalties or logprobs), 1 otherwise; each runs on logits every device holds whole.
STEP_KINDS = {"greedy": "0", "sampling": "1"}


def collectives(hlo: str) -> dict[str, dict[str, dict[str, int]]]:
    """The collectives of an optimized HLO module by where they run: "always", or inside
    branch N of a `lax.cond` (only one branch runs per step): kind -> {count, result bytes}."""
    count, size = Counter(), Counter()
    for line in hlo.splitlines():
        match = _LINE.search(line)
        if not match:
            continue
        shape, op = match.group(1), match.group(2)
        branch = _BRANCH.search(line)
        where = branch.group(1) if branch else "always"
        count[where, op] += 1
        for dtype, dims in _SHAPE.findall(shape):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            size[where, op] += n * _DTYPE_BYTES.get(dtype, 4)
    out: dict[str, dict[str, dict[str, int]]] = {}
    for where, op in sorted(count):
        out.setdefault(where, {})[op] = {"count": count[where, op], "bytes": size[where, op]}
    return out


def step(found: dict[str, dict[str, dict[str, int]]], kind: str) -> dict[str, dict[str, int]]:
    """What one step of `kind` ("greedy" or "sampling") runs: always + its branch."""
    total: dict[str, dict[str, int]] = {}
    for where in ("always", STEP_KINDS[kind]):
        for op, v in found.get(where, {}).items():
            t = total.setdefault(op, {"count": 0, "bytes": 0})
            t["count"] += v["count"]
            t["bytes"] += v["bytes"]
    return total


def sent_bytes(found: dict[str, dict[str, int]], n: int) -> float:
    """Bytes one device sends for these collectives, with ring algorithms."""
    share = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
             "reduce-scatter": (n - 1), "all-to-all": (n - 1) / n, "collective-permute": 1.0}
    return sum(v["bytes"] * share[op] for op, v in found.items())


def compile_counts(config, n: int, batch: int, chunk: int) -> dict[str, dict]:
    """The collectives of one decode step and one prefill program at TP=n."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cadence.engine.config import EngineConfig
    from cadence.engine.packing import empty_pack, row_chunks
    from cadence.engine.programs import jit_programs, sampling_rows
    from cadence.model.llama import rope_table
    from cadence.model.paged_kv import PagedKVCache
    from cadence.model.params import abstract_params
    from cadence.model.host_sampling import RequestSampling, all_allowed
    from cadence.model.sampling import TokenHistory
    from cadence.model.sharding import POOL_AXES, TensorParallel

    tp = TensorParallel.plan(config, jax.devices()[:n])
    cc = tp.compute_config
    engine = EngineConfig(num_slots=batch, max_seq_len=1024, prefill_chunk=chunk, page_size=64,
                          num_pages=batch * 16, attention="xla", dtype="bfloat16")
    programs = jit_programs(cc, engine, tp)
    params = abstract_params(cc, jnp.bfloat16, shardings=tp.param_shardings())
    layer = jax.ShapeDtypeStruct((cc.num_kv_heads, engine.pool_pages, engine.page_size, cc.head_dim),
                                 jnp.bfloat16, sharding=tp.sharding(POOL_AXES))
    cache = PagedKVCache(k=(layer,) * cc.num_layers, v=(layer,) * cc.num_layers)
    last = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=tp.replicated)
    rope = jax.eval_shape(lambda: rope_table(cc, engine.max_seq_len))
    rope = jax.ShapeDtypeStruct(rope.shape, rope.dtype, sharding=tp.replicated)
    history = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=tp.replicated),
                           jax.eval_shape(lambda: TokenHistory.create(batch, cc.vocab_size, engine.max_seq_len)))
    width = engine.max_pages_per_seq
    decode = programs.decode.lower(
        params, rope, cache, last, history, np.arange(batch, dtype=np.int32), np.full(batch, 512, np.int32),
        np.zeros((batch, width), np.int32), sampling_rows([RequestSampling()] * batch),
        np.int32(1))
    pack = empty_pack(chunk, width, engine.pack_block, batch, engine.chunks_per_program)
    prefill = programs.prefill.lower(
        params, rope, cache, last, history, pack.tokens, pack.positions, pack.lengths, pack.tables,
        pack.logit_index, row_chunks(pack), pack.steps, pack.write_slot, pack.sampling_slot,
        sampling_rows([RequestSampling()] * len(pack.steps)), all_allowed(len(pack.steps), cc.vocab_size))
    return {name: collectives(lowered.compile().as_text())
            for name, lowered in (("decode", decode), ("prefill", prefill))}


def per_layer(config, n: int, batch: int, chunk: int) -> dict[str, dict]:
    """Each program's collectives per layer, and per step of the whole model (greedy and
    sampling), from compiles at one and two layers."""
    one = compile_counts(dataclasses.replace(config, num_layers=1), n, batch, chunk)
    two = compile_counts(dataclasses.replace(config, num_layers=2), n, batch, chunk)
    zero = {"count": 0, "bytes": 0}
    out = {}
    for program in one:
        a, b = step(one[program], "greedy"), step(two[program], "greedy")
        layer = {op: {k: b.get(op, zero)[k] - a.get(op, zero)[k] for k in zero} for op in set(a) | set(b)}
        out[program] = {"per_layer": layer}
        for kind in STEP_KINDS:
            first = step(one[program], kind)  # one layer: fixed + 1 x per layer
            ops = set(first) | set(layer)
            out[program][kind] = {op: {k: first.get(op, zero)[k] + (config.num_layers - 1)
                                       * layer.get(op, zero)[k] for k in zero} for op in ops}
    return out


def _listing(found: dict[str, dict[str, int]], sizes: bool = False) -> str:
    return ", ".join(f"{v['count']} {op}" + (f" ({v['bytes'] / 2**10:.0f} KiB)" if sizes else "")
                     for op, v in sorted(found.items()) if v["count"])


def report(config, results: dict[int, dict], batch: int, chunk: int) -> str:
    from cadence.bench.roofline import LINKS

    lines = [f"{config.name}: {config.num_layers} layers, {config.num_heads} heads / "
             f"{config.num_kv_heads} KV heads, bf16; decode step of {batch} rows, prefill of "
             f"{chunk} tokens; MiB one device sends per step (ring algorithms), and that over "
             "each link in microseconds", ""]
    links = " | ".join(f"{name} us" for name in LINKS)
    lines.append(f"| TP | program | step | collectives per layer | per step, whole model | MiB sent | {links} |")
    lines.append("| --- | --- | --- | --- | --- | --- |" + " --- |" * len(LINKS))
    for n, programs in results.items():
        for program, r in programs.items():
            for kind in STEP_KINDS:
                sent = sent_bytes(r[kind], n)
                times = " | ".join(f"{sent / (gbps * 1e9) * 1e6:.0f}" for gbps in LINKS.values())
                lines.append(f"| {n} | {program} | {kind} | {_listing(r['per_layer'], True)} | "
                             f"{_listing(r[kind])} | {sent / 2**20:.2f} | {times} |")
    return "\n".join(lines)


def main(argv) -> None:
    del argv
    degrees = [int(t) for t in _TP.value]
    import jax

    jax.config.update("jax_num_cpu_devices", max(degrees))
    from cadence.model.config import PRESETS

    config = PRESETS[_MODEL.value]
    results = {}
    for n in degrees:
        print(f"compiling TP={n} ...", file=sys.stderr)
        results[n] = per_layer(config, n, _BATCH.value, _CHUNK.value)
    text = report(config, results, _BATCH.value, _CHUNK.value)
    print(text)
    if _OUT.value:
        Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
        Path(_OUT.value).write_text(json.dumps(
            {"model": config.name, "batch": _BATCH.value, "chunk": _CHUNK.value,
             "jax": jax.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    app.run(main)
