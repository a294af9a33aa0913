"""Every program an engine compiles, from shapes alone, and lowering them for another platform.

    programs = engine_programs(LLAMA3_8B, gpu_engine_config())  # [Program(name, fn, args), ...]
    for p in programs:
        text = lower(p, "cuda").as_text()                          # StableHLO for a CUDA GPU

`engine_programs` lists what `Engine.warmup` compiles — the same jitted programs
(`engine.programs.jit_programs`), once per bucket, with the arguments warm-up passes — but with
the weights, the page pool, the token history and every other device buffer as
`jax.ShapeDtypeStruct`s, so nothing the size of the model or the pool is allocated: an 8B engine
of 64 slots lowers on a laptop. `tests/test_gpu_lowering.py` checks that the list is exactly what
warm-up runs (program by program, argument shapes and dtypes included), so the two cannot drift.

`lower` traces a program with `pallas_common.compiled_kernels()` (and, off the CPU,
`control.branch_free()`) and lowers it for `platform`:
on a machine without a GPU, `attention="pallas"` then lowers to the Triton kernels as custom
calls, and `attention="mosaic"` to Mosaic GPU ones (`kernel_calls` names both), not to the XLA
loops interpret mode emulates them with. This checks Pallas -> Triton IR or Mosaic GPU's
module and XLA's GPU lowering of everything else; it does not run Triton's compiler, Mosaic
GPU's passes to PTX or ptxas, which only a GPU machine does (`bench/gpu_check.sh`).

Non-goals: tensor parallelism (`bench.tp_collectives` lowers those programs), the CPU kernels
(decode_matmul="cpu" reads a blocked copy of the weights made from real arrays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections import Counter
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cadence.engine.config import EngineConfig
from cadence.engine.packing import empty_pack, row_chunks
from cadence.engine.programs import Programs, jit_programs, sampling_rows
from cadence.model import control, lora, pallas_common
from cadence.model.config import ModelConfig
from cadence.model.llama import rope_table
from cadence.model.paged_kv import PagedKVCache
from cadence.model.params import abstract_params
from cadence.model.host_sampling import MAX_DRY_BREAKERS, SAMPLER_STATE, RequestSampling, all_allowed
from cadence.model.sampling import TokenHistory


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of an engine: `fn` (the `Programs` field `field`) over `args`."""

    name: str  # field and bucket, e.g. "decode[batch=8,pages=64]"
    field: str
    fn: Callable
    args: tuple
    kernels: frozenset[str] = frozenset()  # the kernels it must call once lowered (`KERNELS`)


# The kernel each program of an engine with kernel attention calls, by backend: "pallas" (Triton)
# and "mosaic" (Mosaic GPU). The batched decode programs run the reference einsum attention, and
# the rest no attention.
_ATTENDS = {"prefill": "prefill", "prefill_scored": "prefill", "prefill_pooled": "prefill",
            "decode": "decode", "decode_forward": "decode", "verify": "decode"}
KERNELS = {
    "pallas": {field: f"cadence_paged_{phase}" for field, phase in _ATTENDS.items()},
    "mosaic": {field: f"cadence_mosaic_{phase}" for field, phase in _ATTENDS.items()},
}


def gpu_engine_config(num_slots: int = 64, max_seq_len: int = 4096, prefill_chunk: int = 512,
                      **overrides) -> EngineConfig:
    """The engine `cadence-serve` builds on a GPU (bfloat16, the Pallas kernels over the paged
    pool: Triton's, or `attention="mosaic"` for Mosaic GPU's), with structured output's split
    step and speculative decoding's verify step on: every program a GPU deployment compiles."""
    overrides = {"speculative_tokens": 4, "attention": "pallas", **overrides}
    return EngineConfig(num_slots=num_slots, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                        dtype="bfloat16", structured_output=True, **overrides)


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


def engine_programs(model_config: ModelConfig, config: EngineConfig, *, weights: str = "float",
                    programs: Programs | None = None) -> list[Program]:
    """What `Engine(params, model_config, config).warmup()` compiles (one device), in warm-up's
    order, over abstract device buffers: params of `weights` ("float", or "int8": `model.quant`'s
    per-channel matrices) in the engine's dtype. `programs`: the jitted programs to list (default:
    `jit_programs` of this configuration, fresh)."""
    if config.decode_matmul != "xla":
        raise ValueError("the CPU decode kernels read a blocked copy of real weights; list an "
                         "engine with decode_matmul='xla'")
    cfg, mc = config, model_config
    dtype = jnp.dtype(cfg.dtype)
    p = programs or jit_programs(mc, cfg)
    params = abstract_params(mc, dtype, weights=weights)
    if cfg.lora_slots:  # a bank with room for adapters: every projection's
        params = lora.with_bank(params, lora.abstract_bank(mc, cfg.lora_slots, cfg.lora_rank, dtype),
                                mc.num_layers)
    rope = jax.eval_shape(lambda: rope_table(mc, cfg.max_seq_len))
    pool_dtype = jnp.dtype(cfg.pool_dtype)
    layer = jax.ShapeDtypeStruct(PagedKVCache.shape(mc, cfg.pool_pages, cfg.page_size), pool_dtype)
    cache = PagedKVCache(k=(layer,) * mc.num_layers, v=(layer,) * mc.num_layers)
    last = jax.ShapeDtypeStruct((cfg.num_slots,), jnp.int32)
    history = jax.eval_shape(lambda: TokenHistory.create(cfg.num_slots, mc.vocab_size, cfg.max_seq_len))
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    out: list[Program] = []

    def add(name, field, *args):
        kernel = KERNELS.get(cfg.attention, {}).get(field)
        kernels = {kernel} if kernel else ()
        out.append(Program(name, field, getattr(p, field), _abstract(args), frozenset(kernels)))

    def rows(n):
        return sampling_rows([RequestSampling()] * n, cfg.lora_slots)

    if cfg.role != "decode":
        shapes = [(t, w, "prefill") for t in cfg.prefill_buckets for w in cfg.prefill_page_buckets]
        shapes += [(t, w, "prefill_scored") for t in cfg.score_buckets for w in cfg.prefill_page_buckets]
        for t, width, field in shapes:
            pack = empty_pack(t, width, cfg.pack_block, cfg.num_slots, cfg.chunks_per_program)
            n = len(pack.steps)
            scored = (np.full(t, -1, np.int32),) if field == "prefill_scored" else ()
            add(f"{field}[tokens={t},pages={width}]", field, params, rope, cache, last, history,
                pack.tokens, pack.positions, pack.lengths, pack.tables, pack.logit_index,
                row_chunks(pack), pack.steps, pack.write_slot, pack.sampling_slot, rows(n),
                all_allowed(n, mc.vocab_size), *scored)
        for t, width in ((t, w) for t in cfg.prefill_buckets for w in cfg.prefill_page_buckets):
            pack = empty_pack(t, width, cfg.pack_block, cfg.num_slots, cfg.chunks_per_program)
            add(f"prefill_pooled[tokens={t},pages={width}]", "prefill_pooled", params, rope, cache,
                pack.tokens, pack.positions, pack.lengths, pack.tables, pack.logit_index,
                row_chunks(pack))
    decode = []
    if cfg.role != "prefill":
        decode = [("decode_batched", "decode_forward_batched", w) for w in cfg.batched_decode_page_buckets]
        decode += [("decode", "decode_forward", w) for w in cfg.decode_page_buckets]
    for field, _, width in decode:
        for batch in cfg.decode_batch_buckets:
            add(f"{field}[batch={batch},pages={width}]", field, params, rope, cache, last, history,
                np.full(batch, cfg.num_slots, np.int32), np.zeros(batch, np.int32),
                np.zeros((batch, width), np.int32), rows(batch), i32)
    if cfg.structured_output and decode:
        for batch in cfg.decode_batch_buckets:
            slots, zeros = np.full(batch, cfg.num_slots, np.int32), np.zeros(batch, np.int32)
            for _, field, width in decode:
                add(f"{field}[batch={batch},pages={width}]", field, params, rope, cache, last,
                    slots, zeros, np.zeros((batch, width), np.int32), rows(batch))
            logits = jax.ShapeDtypeStruct((batch, mc.vocab_size), jnp.float32)
            add(f"decode_sample[batch={batch}]", "decode_sample", logits, last, history, slots,
                zeros, rows(batch), all_allowed(batch, mc.vocab_size))
    if cfg.speculative_tokens and cfg.role != "prefill":
        k = cfg.speculative_tokens
        for width in cfg.verify_page_buckets:
            for batch in cfg.verify_batch_buckets:
                add(f"verify[batch={batch},pages={width},k={k}]", "verify", params, rope, cache,
                    last, history, np.full(batch, cfg.num_slots, np.int32), np.zeros(batch, np.int32),
                    np.zeros((batch, width), np.int32), rows(batch), np.zeros((batch, k), np.int32),
                    np.zeros(batch, np.int32),
                    all_allowed((batch, k + 1), mc.vocab_size))
    handle = jax.ShapeDtypeStruct  # a KVHandle's arrays: [layers, kv_heads, P, page_size, d]
    for width in cfg.page_buckets:
        kv = handle((mc.num_layers, mc.num_kv_heads, width, cfg.page_size, mc.head_dim), pool_dtype)
        add(f"extract[pages={width}]", "extract", cache, last, np.zeros(width, np.int32), i32)
        add(f"insert[pages={width}]", "insert", cache, last, kv, kv, np.zeros(width, np.int32),
            i32, i32)
    add("history", "history", history, i32, np.zeros(cfg.max_seq_len, np.int32), i32, i32,
        np.zeros(MAX_DRY_BREAKERS, np.int32),
        np.zeros(cfg.max_seq_len, np.int32), np.zeros(SAMPLER_STATE, np.float32))
    add("sampler", "sampler", history, i32)
    add("copy", "copy", cache, np.zeros(cfg.num_slots, np.int32), np.zeros(cfg.num_slots, np.int32))
    return out


def lower(program: Program, platform: str = "cuda") -> jax.stages.Lowered:
    """`program` traced with the Pallas kernels compiled (not interpreted), its control flow
    in `platform`'s form (`model.control`), and lowered for `platform`."""
    free = control.branch_free() if platform != "cpu" else contextlib.nullcontext()
    with pallas_common.compiled_kernels(), free:
        traced = program.fn.trace(*program.args)
    return traced.lower(lowering_platforms=(platform,))


# `stablehlo.custom_call @__gpu$xla.gpu.triton(...) {... name = "cadence_paged_decode" ...}`
_TRITON_CALL = re.compile(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?\bname = "([^"]+)"')
# `stablehlo.custom_call @mosaic_gpu_v2(...) {... module = "ML\EFR...cadence_mosaic_decode_mosaic_gpu\00..."}`:
# the kernel's function in the serialized module is its name and `_mosaic_gpu` (the dialect's,
# `stable_mosaic_gpu`, is not a kernel).
_MOSAIC_CALL = re.compile(
    r"custom_call @mosaic_gpu\w*\(.*?\\00(?!stable_mosaic_gpu\\00)([A-Za-z_]\w*)_mosaic_gpu\\00")


def kernel_calls(stablehlo: str) -> Counter:
    """The Triton and Mosaic GPU kernels a lowered module calls: kernel name -> how many call
    sites."""
    return Counter(_TRITON_CALL.findall(stablehlo) + _MOSAIC_CALL.findall(stablehlo))


# A fori_loop's condition: its counter against a constant bound, and nothing else.
_COUNTED_LOOP = re.compile(r"cond \{\s*(%\S+) = stablehlo\.constant dense<-?\d+> : tensor<i32>\s*"
                           r"%\S+ = stablehlo\.compare\s+LT, %\S+, \1, SIGNED[^\n]*\n\s*"
                           r"stablehlo\.return %\S+ : tensor<i1>\s*\} do")


def _branches(stablehlo: str, start: int) -> int:
    """How many branches the `stablehlo.case` at `start` has: its regions, `{...}` at depth 0
    between the operand list and the closing parenthesis."""
    i = stablehlo.index(") (", start) + 3  # past `"stablehlo.case"(%index)`, at the regions
    depth, regions = 0, 0
    while True:
        c = stablehlo[i]
        if c == "{":
            regions += depth == 0
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == ")" and depth == 0:
            return regions
        i += 1


def _constant(stablehlo: str, name: str, before: int) -> bool:
    """Whether value `name`, as last defined before `before`, is a constant (the platform
    index `lax.platform_dependent` selects its branch by, once lowered for one platform)."""
    defined = stablehlo.rfind(f"{name} = ", 0, before)
    return defined >= 0 and stablehlo.startswith("stablehlo.constant", defined + len(name) + 3)


def host_waits(stablehlo: str) -> list[str]:
    """The control flow in a lowered module that a GPU decides on the host, after reading a
    value back from the device (`model.control`): each conditional of more than one branch on
    a computed index (`lax.platform_dependent` leaves ones on a constant, and one-branch ones,
    which XLA resolves when it compiles), and each
    loop whose exit is not a counter against a constant (a fori_loop's known trip count)."""
    waits = [f"if at {m.start()}" for m in re.finditer(r"stablehlo\.if\b", stablehlo)]
    waits += [f"case of {n} branches at {m.start()}"
              for m in re.finditer(r'"stablehlo\.case"\((%[^)]+)\)', stablehlo)
              if (n := _branches(stablehlo, m.start())) > 1 and not _constant(stablehlo, m.group(1), m.start())]
    loops = [m.start() for m in re.finditer(r"stablehlo\.while\b", stablehlo)]
    counted = {stablehlo.rfind("stablehlo.while", 0, m.start()) for m in _COUNTED_LOOP.finditer(stablehlo)}
    return waits + [f"while at {at}" for at in loops if at not in counted]


def lower_checked(program: Program, platform: str = "cuda") -> Counter:
    """`lower`, then its kernel calls, which must be exactly `program.kernels` (a "pallas" or
    "mosaic" engine that fell back to XLA attention, or to interpret mode, fails here), and, for a
    GPU, no control flow that waits on the device (`host_waits`)."""
    text = lower(program, platform).as_text()
    calls = kernel_calls(text)
    if set(calls) != program.kernels:
        raise AssertionError(f"{program.name} calls kernels {sorted(calls)}, expected "
                             f"{sorted(program.kernels)}")
    if platform != "cpu" and (waits := host_waits(text)):
        raise AssertionError(f"{program.name} waits on the device, on the host: {waits[:5]}")
    return calls
