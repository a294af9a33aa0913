"""Building a serving stack from flags: model -> engine(s) (warmed up) -> scheduler.

Shared by the front doors (`cadence-serve`, `cadence-generate`, `cadence-batch`) so that each of
them stays a thin layer. It reads the engine and scheduler flags every front door has
(`server.flags`), the disaggregated mode's included: `--prefill_devices=0 --decode_devices=1`
builds a prefill engine and a decode engine on those JAX devices (each with its own weights and
KV pool) under one scheduler; on the CPU, `--num_cpu_devices=2` first makes two devices of it.
`--tensor_parallel=N` spans one engine over the first N devices instead (`model.sharding`), its
weights restored straight into their shards.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import logging
from tqdm import tqdm

from cadence.checkpoints import chat
from cadence.checkpoints.adapters import load_adapter
from cadence.checkpoints.registry import KNOWN_MODELS, LoadedModel, cache_dir, load_model, resolve
from cadence.checkpoints.store import AS_STORED
from cadence.engine import multihost
from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine, cpu_weights
from cadence.model import cpu_kernels, layer_loop
from cadence.model.config import ModelConfig
from cadence.model.lora import LoraAdapter
from cadence.model.paged_kv import bytes_per_token, pages_for_bytes
from cadence.model.params import MATRICES, cast_bytes, get, param_specs
from cadence.model.quant import quantize, quantize_grouped
from cadence.model.sharding import TensorParallel
from cadence.scheduler.grammar import GrammarCompiler
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.priority import SLO, PriorityClasses
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from cadence.scheduler.speculative import SpeculativeConfig
from cadence.server import memory
from cadence.server.flags import (ATTENTION, CHAT_TEMPLATE, CHAT_TEMPLATE_KWARGS, COORDINATOR,
                                  CPU_ACTIVATIONS, CPU_KERNELS, DECODE_DEVICES, DECODE_STEPS,
                                  DRAFT_MODEL, DRAFT_P_MIN, DTYPE, LORA, MAX_LORA_RANK, MAX_LORAS,
                                  GRAMMAR_TIMEOUT, HOST_KV_MEMORY, ITL_TARGET, KV_DTYPE, KV_DTYPE_ALIASES,
                                  KV_MEMORY, KV_RESERVATION, LAYER_LOOP, LOWER_SHARE, MAX_LOGPROBS,
                                  MAX_PREFILL_CHUNKS, MAX_QUEUE, MAX_SEQ_LEN, MODEL_FLAG,
                                  NUM_CPU_DEVICES, NUM_PROCESSES, NUM_SLOTS, NUM_SPECULATIVE_TOKENS,
                                  PAGE_SIZE, POLICY, PREFILL_CHUNK, PREFILL_DEVICES, PREFILL_SLOTS,
                                  PREFIX_CACHING, PRIORITY_CLASSES, PROCESS_ID, PROMPT_LOOKUP_MAX,
                                  PROMPT_LOOKUP_MIN, SLO_ITL, SLO_MARGIN, SLO_TTFT, SLOT_SAVE_PATH, SPECULATIVE,
                                  SPECULATIVE_MAX_BATCH, STRUCTURED_OUTPUT, TENSOR_PARALLEL,
                                  TOKEN_BUDGET, WARMUP, WARMUP_THREADS, WEIGHTS)


@dataclasses.dataclass
class Runtime:
    model: LoadedModel
    engines: tuple[Engine, ...]  # one, or the prefill engine and the decode engine
    scheduler: Scheduler
    warmup_seconds: float
    draft_engine: Engine | None = None  # --draft_model's
    adapters: tuple[LoraAdapter, ...] = ()  # --lora's, in the bank's order

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None) -> float:
        return warm_up(_with_draft(self.engines, self.draft_engine), progress)

    def grammars(self) -> GrammarCompiler | None:
        """A grammar compiler for the model (structured output), or None where it is off."""
        if not self.engines[-1].config.structured_output:
            return None
        return GrammarCompiler(self.model.tokenizer, self.engines[-1].vocab_size,
                               timeout=GRAMMAR_TIMEOUT.value)


def configure_devices() -> None:
    """--num_cpu_devices and the multi-host flags, which JAX takes only before its first
    operation."""
    if NUM_CPU_DEVICES.value is not None:
        try:
            jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES.value)
        except RuntimeError as e:
            raise ValueError(f"--num_cpu_devices could not be applied: {e}") from None
    if NUM_PROCESSES.value > 1:
        if not COORDINATOR.value:
            raise ValueError("--num_processes > 1 needs --coordinator_address (process 0's host:port)")
        if PROCESS_ID.value >= NUM_PROCESSES.value:
            raise ValueError(f"--process_id={PROCESS_ID.value} is not in [0, {NUM_PROCESSES.value})")
        multihost.plan_address(COORDINATOR.value)  # refuses a malformed address now
        multihost.initialize(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)


def multi_process() -> bool:
    return NUM_PROCESSES.value > 1


def pool_devices() -> tuple[jax.Device, jax.Device] | None:
    """The (prefill, decode) devices of --prefill_devices and --decode_devices; None when
    serving colocated. Refuses what cannot run, saying why."""
    given = (PREFILL_DEVICES.value, DECODE_DEVICES.value)
    if not any(given):
        return None
    if not all(given):
        raise ValueError("disaggregated serving needs both --prefill_devices and --decode_devices")
    devices = jax.devices()
    if len(devices) < 2:
        hint = (" On the CPU, --num_cpu_devices=2 makes two (sharing the same cores)."
                if devices[0].platform == "cpu" else "")
        raise ValueError(f"disaggregated serving needs two devices; this machine has one "
                         f"{devices[0].platform} device.{hint}")
    picked = []
    for name, value in zip(("prefill", "decode"), given):
        if len(value) != 1:
            raise ValueError(f"--{name}_devices takes one device index for now (a pool over "
                             f"several devices needs tensor parallelism), got {','.join(value)}")
        try:
            index = int(value[0])
        except ValueError:
            raise ValueError(f"--{name}_devices takes a device index, got {value[0]!r}") from None
        if not 0 <= index < len(devices):
            raise ValueError(f"--{name}_devices={index}: the devices are 0..{len(devices) - 1} "
                             f"({len(devices)} {devices[0].platform} devices)")
        picked.append(devices[index])
    if picked[0] == picked[1]:
        raise ValueError("--prefill_devices and --decode_devices must be different devices")
    return picked[0], picked[1]


def tensor_parallel_devices() -> list[jax.Device] | None:
    """The devices of --tensor_parallel (None for one); refuses what cannot run, saying why."""
    n = TENSOR_PARALLEL.value
    if multi_process() and n != jax.device_count():
        raise ValueError(f"over {NUM_PROCESSES.value} processes the engine spans every "
                         f"process's devices: pass --tensor_parallel={jax.device_count()}")
    if n == 1:
        return None
    if PREFILL_DEVICES.value or DECODE_DEVICES.value:
        raise ValueError("--tensor_parallel with disaggregated serving (--prefill_devices/"
                         "--decode_devices) is not supported yet: each pool runs on one device")
    devices = jax.devices()
    if len(devices) < n:
        hint = (f" On the CPU, --num_cpu_devices={n} makes {n} (sharing the same cores)."
                if devices[0].platform == "cpu" else "")
        raise ValueError(f"--tensor_parallel={n} needs {n} devices; this machine has "
                         f"{len(devices)} {devices[0].platform} device(s).{hint}")
    return devices[:n]


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache in the cadence cache folder: fast restarts."""
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """A byte count, or a number with a unit (`4MiB`, `1.5GiB`, `512KB`)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write bytes or a number with a unit "
                         f"({', '.join(u for u in ('KiB', 'MiB', 'GiB', 'KB', 'MB', 'GB'))})")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def kv_pool_pages(model: LoadedModel, dtype: str, page_size: int,
                  device: jax.Device | None = None, tp: TensorParallel | None = None,
                  reserve: int = 0) -> int | None:
    """Pages of --kv_cache_dtype for --kv_cache_memory; on a GPU without it, 90% of the memory
    left after the weights (in `dtype`) and `reserve` bytes (a draft model's) on `device`;
    None (the engine's default: every slot at max_seq_len) otherwise.
    With `tp` the budget is each device's: the weights are on the devices already (restored
    into their shards), and a device holds its KV heads' share of every page, or all of it
    where attention is replicated."""
    if KV_MEMORY.value is not None:
        budget = parse_size(KV_MEMORY.value)
    elif jax.default_backend() == "gpu":
        stats = (device or jax.local_devices()[0]).memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        on_host = 0 if tp is not None else cast_bytes(model.params, dtype)
        budget = int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0) - on_host - reserve))
    else:
        return None
    pages = pages_for_bytes(model.config if tp is None else tp.compute_config, budget, page_size,
                            jnp.dtype(kv_dtype()))
    if tp is not None and tp.heads_sharded:
        pages *= tp.size
    if pages < 1:
        raise ValueError(f"--kv_cache_memory={KV_MEMORY.value} holds no page of {page_size} tokens")
    return pages


def check_pool_fits(config: ModelConfig, pools: Sequence[EngineConfig], copies: int = 1,
                    free: int | None = None, sized: bool = False) -> None:
    """Refuses, before allocating them, KV pools in host memory that the machine cannot hold
    (`free`, default `memory.available()`, less a tenth for the programs and the request
    buffers): a pool is written zeros when it is made, so it would be resident at once, and the
    kernel would end the process mid-start, or the machine would swap. `pools`: each engine's
    configuration (a disaggregated pair's two); `copies`: how many times each is held (a
    tensor-parallel pool replicated over its devices); `sized`: --kv_cache_memory gave the size."""
    free = memory.available() if free is None else free
    dtype = jnp.dtype(pools[0].pool_dtype)
    per_token = bytes_per_token(config, dtype)
    tokens = sum(p.pool_pages * p.page_size for p in pools) * copies
    need = tokens * per_token
    if free is None or need <= 0.9 * free:
        return
    memory_flag = "lower --kv_cache_memory" if sized else "set --kv_cache_memory"
    halve = {4: ", or halve it with --kv_cache_dtype=bfloat16 (a quarter with fp8)",
             2: ", or halve it with --kv_cache_dtype=fp8"}.get(dtype.itemsize, "")
    raise ValueError(
        f"the KV pool needs {need / 2**30:.1f} GiB ({tokens} tokens of {dtype.name}, "
        f"{per_token / 2**10:.0f} KiB a token for {config.name}) and this machine has "
        f"{free / 2**30:.1f} GiB available: lower --num_slots or --max_seq_len, or "
        f"{memory_flag}{halve}")


def engine_config_from_flags(model: LoadedModel | None = None, device: jax.Device | None = None,
                             tp: TensorParallel | None = None, reserve: int = 0) -> EngineConfig:
    """The engine the flags describe; with the model, the KV pool is sized by memory (on
    `device`, default the first, or over `tp`'s devices; `reserve`: bytes it leaves there, a
    draft model's)."""
    on_gpu = jax.default_backend() == "gpu"
    dtype = compute_dtype()
    kernels = cpu_kernels_apply(dtype, tp)
    if CPU_ACTIVATIONS.value != "float32" and not kernels:
        raise ValueError(f"--cpu_activations={CPU_ACTIVATIONS.value} is the CPU kernels', which "
                         "run with --cpu_kernels on the CPU, in float32, on one device, where "
                         "they build (where they did not, a line above says why); drop it to "
                         "decode with XLA's paths")
    return EngineConfig(
        num_slots=NUM_SLOTS.value,
        max_seq_len=MAX_SEQ_LEN.value,
        prefill_chunk=PREFILL_CHUNK.value,
        attention=ATTENTION.value or ("pallas" if on_gpu else "cpu" if kernels else "xla"),
        decode_matmul="cpu" if kernels else "xla",
        cpu_activations=CPU_ACTIVATIONS.value,
        layer_loop=LAYER_LOOP.value,
        dtype=dtype,
        kv_dtype=kv_dtype(),
        page_size=PAGE_SIZE.value,
        num_pages=None if model is None else kv_pool_pages(model, dtype, PAGE_SIZE.value, device, tp, reserve),
        max_prefill_chunks=MAX_PREFILL_CHUNKS.value,
        decode_steps=DECODE_STEPS.value,
        max_logprobs=MAX_LOGPROBS.value,
        structured_output=STRUCTURED_OUTPUT.value,
        speculative_tokens=(NUM_SPECULATIVE_TOKENS.value or (3 if kernels else 4)
                            if speculative() != "off" else 0),
        speculative_batch=SPECULATIVE_MAX_BATCH.value or (8 if on_gpu else 1),
        # An iteration's prompt chunks, packed, fit one program even with every slot decoding.
        prefill_tokens=max(PREFILL_CHUNK.value, token_budget() - NUM_SLOTS.value),
    )


def speculative() -> str:
    """--speculative, or its default: draft with --draft_model, else ngram."""
    return SPECULATIVE.value or ("draft" if DRAFT_MODEL.value else "ngram")


def quantize_from_flags(model: LoadedModel, kernels: bool):
    """(model, packed): the weights --weights asks for. `packed` (path -> grouped matrix, or
    None) is what the CPU decode kernels read in place of blocking a float matrix: with auto,
    the checkpoint's own blocks; with int8 / int4, every matrix quantized in groups of 32
    (`model.quant.quantize_grouped`), the model's params then being what they stand for. Off
    the CPU kernels int8 is per output channel (`model.quant.quantize`), and int4 is refused."""
    weights = WEIGHTS.value
    if weights == "auto":
        return model, ({path: blocks for path, (blocks, _) in model.packed.items()} if kernels else None)
    if weights in GROUPED_WEIGHTS and kernels:
        floats, packed = quantize_grouped(model.params, model.config, GROUPED_WEIGHTS[weights])
        return dataclasses.replace(model, params=floats), packed
    if weights == "int4":
        raise ValueError("--weights=int4 runs on the CPU decode kernels (model/cpu_kernels.cc: one "
                         "device, float32, --cpu_kernels); elsewhere use int8 or float")
    if weights == "int8":
        return dataclasses.replace(model, params=quantize(model.params, model.config)), None
    return model, None


GROUPED_WEIGHTS = {"int8": "q8", "int4": "q4"}  # --weights: the grouped format on the CPU kernels


def describe_decode_weights(model: LoadedModel, packed) -> str:
    """What the CPU kernels read (and prefill dequantizes), for the start-up line: the checkpoint's own formats
    and how many matrices each, and what is blocked from float (dequantized, where the
    checkpoint stored it block-quantized in a format the kernels lack)."""
    matrices = [s.path for s in param_specs(model.config) if s.path[-1] in MATRICES
                and (s.path[-1] != "embedding" or model.config.tie_embeddings or s.path in (packed or {}))]
    activations = (", int8 activations against them (--cpu_activations=int8)"
                   if CPU_ACTIVATIONS.value == "int8" else "")
    if WEIGHTS.value in GROUPED_WEIGHTS:
        head = " (the tied LM head in int8)" if WEIGHTS.value == "int4" and model.config.tie_embeddings else ""
        return (f"{len(matrices)} matrices in {WEIGHTS.value}{head}, a float16 scale per 32 weights"
                + activations)
    own = collections.Counter(model.packed[p][1] for p in matrices if p in (packed or {}))
    own.update(get(model.params, p).dtype.name for p in matrices  # 16-bit floats, read as stored
               if p not in (packed or {}) and get(model.params, p).dtype.itemsize == 2)
    rest = len(matrices) - sum(own.values())
    parts = [f"{n} {'matrix' if n == 1 else 'matrices'} in the checkpoint's own {kind}"
             for kind, n in sorted(own.items())]
    if rest:
        parts.append(f"{rest} {'matrix' if rest == 1 else 'matrices'} blocked from float32"
                     + (" (--weights=auto reads a GGUF's Q8_0/Q4_x/Q5_x/Q2_K-Q6_K/IQ4_NL/IQ4_XS as they are)"
                        if WEIGHTS.value != "auto" and model.packed else ""))
    return ", ".join(parts) + (activations if any(p in (packed or {}) for p in matrices) else "")


def cpu_kernels_apply(dtype: str, tp: TensorParallel | None) -> bool:
    """Whether the engine decodes with the CPU kernels (`model.cpu_kernels`): --cpu_kernels, on
    the CPU, float32 compute, one device, and the kernels built here; a reason they do not
    apply is logged once."""
    if not CPU_KERNELS.value or jax.default_backend() != "cpu":
        return False
    why = ("--dtype is not float32" if dtype != "float32" else
           "tensor parallelism" if tp is not None else cpu_kernels.unavailable_reason())
    if why:
        _log_once(f"cadence: the CPU kernels do not apply ({why}); decoding with XLA's paths")
    return why is None


@functools.cache
def _log_once(message: str) -> None:
    print(message, file=sys.stderr)


def compute_dtype() -> str:
    return DTYPE.value or ("bfloat16" if jax.default_backend() == "gpu" else "float32")


def kv_dtype() -> str:
    """The KV pool's dtype: --kv_cache_dtype, or the compute dtype."""
    if KV_DTYPE.value == "auto":
        return compute_dtype()
    return KV_DTYPE_ALIASES.get(KV_DTYPE.value, KV_DTYPE.value)


def token_budget() -> int:
    return TOKEN_BUDGET.value or PREFILL_CHUNK.value + NUM_SLOTS.value


def host_kv_cache_bytes(free: int | None = None) -> int:
    """--host_kv_cache_memory in bytes, refused without the prefix cache, or beyond what this
    machine has available (`free`, default `memory.available()`): it would swap as it fills."""
    if (size := parse_size(HOST_KV_MEMORY.value)) and (not PREFIX_CACHING.value or multi_process()):
        raise ValueError("--host_kv_cache_memory keeps the prefix cache's evicted pages: it needs "
                         "the prefix cache on (no --noprefix_caching) and one process")
    if size and (free := memory.available() if free is None else free) is not None and size > free:
        raise ValueError(f"--host_kv_cache_memory={HOST_KV_MEMORY.value} is more than the "
                         f"{free / 2**30:.1f} GiB this machine has available")
    return size


def scheduler_config_from_flags(model_name: str, checkpoint: str = "") -> SchedulerConfig:
    budget = token_budget()
    policy = PolicyConfig(
        name=POLICY.value, token_budget=budget, chunk=PREFILL_CHUNK.value, lower_share=LOWER_SHARE.value
    )
    classes = PriorityClasses.parse(PRIORITY_CLASSES.value)
    slo = SLO.parse(SLO_TTFT.value, SLO_ITL.value, SLO_MARGIN.value)
    return SchedulerConfig(policy=policy, max_queue=MAX_QUEUE.value,
                           kv_reservation=KV_RESERVATION.value, prefix_caching=PREFIX_CACHING.value,
                           host_kv_cache_bytes=host_kv_cache_bytes(),
                           cache_namespace=f"{model_name}/{checkpoint}/{WEIGHTS.value}/{DTYPE.value}",
                           priority_classes=classes, slo=slo, itl_target=ITL_TARGET.value,
                           speculative=SpeculativeConfig(PROMPT_LOOKUP_MIN.value, PROMPT_LOOKUP_MAX.value,
                                                         DRAFT_P_MIN.value))


def _with_draft(engines: tuple[Engine, ...], draft: Engine | None) -> tuple[Engine, ...]:
    """What warm-up compiles for: the draft engine first, so that the engines the scheduler
    counts compilations on (`compilations_after_warmup`, process-wide) count from after its."""
    return ((draft,) if draft else ()) + engines


def warm_up(engines: Sequence[Engine], progress: Callable[[int, int, str], None] | None = None,
            warmup: str | None = None) -> float:
    """Compiles the programs of every engine that --warmup names, with a progress bar naming
    each as it is compiled, and `progress(done, total, name)` over all engines; returns the
    seconds it took."""
    warmup = warmup or WARMUP.value
    start = time.monotonic()
    # A multi-host engine's followers warm up whatever it sends them: everything. Moving pages
    # to and from the host (the prefix cache's host tier, slot files) is warm before it is needed.
    moves = ("transfer",) if parse_size(HOST_KV_MEMORY.value) or SLOT_SAVE_PATH.value else ()
    plans = [(e, "all" if isinstance(e, multihost.Leader) else warmup) for e in engines]
    groups = [tuple(g for g in e.program_groups("all") if g in e.program_groups(mode) or g in moves)
              for e, mode in plans]
    counts = [len(e.warm_programs(g)) for (e, _), g in zip(plans, groups)]
    total, offset = sum(counts), 0
    later = sorted({g for e, _ in plans for g in e.program_groups("all")} - {g for gs in groups for g in gs})
    print(f"cadence: warm-up compiles {total} programs (--warmup={warmup})"
          + (f"; on first use: {', '.join(later)}" if later else ""), file=sys.stderr)
    with tqdm(desc="warm-up (compiling)", total=total, unit="program", file=sys.stderr,
              leave=False) as bar:
        if progress is not None:
            progress(0, total, "")
        for (engine, mode), count, warm in zip(plans, counts, groups):
            role = "" if engine.config.role == "both" else f"{engine.config.role} engine: "

            def one(done: int, _total: int, name: str = "", base: int = offset) -> None:
                bar.set_postfix_str(f"{role}{name}", refresh=False)
                bar.update(base + done - bar.n)
                logging.info("compiled %s%s (%d/%d)", role, name, base + done, total)
                if progress is not None:
                    progress(base + done, total, f"{role}{name}")

            if isinstance(engine, Engine):
                engine.warmup(one, warmup=mode, workers=WARMUP_THREADS.value, groups=warm)
            else:
                engine.warmup(one)
            offset += count
    seconds = time.monotonic() - start
    logging.info("warm-up took %.1f s", seconds)
    memory.release_free()  # what the compiler freed
    held = memory.resident()
    print(f"cadence: warm-up compiled {total} programs in {seconds:.1f} s"
          + (f"; {held.describe()}" if held else ""), file=sys.stderr)
    return seconds


def _pool_configs(model: LoadedModel, engine_config: EngineConfig, pair, reserve: int = 0) -> list[EngineConfig]:
    """Each engine's configuration: the one engine's, or the disaggregated pair's (prefill,
    decode). Nothing decodes on the prefill engine, so its packs may take the whole token
    budget; the decode engine's pool is sized on its own device, leaving `reserve` bytes there
    (a draft model's)."""
    if pair is None:
        return [engine_config]
    prefill_config = dataclasses.replace(
        engine_config, role="prefill", num_slots=PREFILL_SLOTS.value or engine_config.num_slots,
        prefill_tokens=max(engine_config.prefill_chunk, token_budget()))
    decode_config = dataclasses.replace(engine_config_from_flags(model, pair[1], reserve=reserve), role="decode")
    return [prefill_config, decode_config]


def load_adapters(config: ModelConfig) -> tuple[LoraAdapter, ...]:
    """--lora's adapters for a base model of `config`, names distinct."""
    adapters = []
    for spec in LORA.value:
        name, _, path = spec.rpartition("=")
        adapters.append(load_adapter(Path(path).expanduser(), config, name or None))
        print(f"cadence: LoRA adapter {adapters[-1].name!r} (rank {adapters[-1].rank}, "
              f"{', '.join(sorted(adapters[-1].projections))}) from {path}", file=sys.stderr)
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora: adapter names must be distinct, got {names} (name them NAME=PATH)")
    return tuple(adapters)


def with_adapter(params, adapters: Sequence[LoraAdapter], name: str):
    """`params` (`GenerationParams`) run with the adapter of --lora named `name`; ValueError
    naming the loaded ones where none is."""
    names = [a.name for a in adapters]
    if name not in names:
        raise ValueError(f"no LoRA adapter {name!r} is loaded (--lora): {names or 'none'}")
    lora = ((names.index(name), 1.0),)
    return dataclasses.replace(params, sampling=dataclasses.replace(params.sampling, lora=lora))


def with_lora(config: EngineConfig, adapters: Sequence[LoraAdapter]) -> EngineConfig:
    """`config` with a bank for `adapters` and --max_loras's free slots (none: as it is)."""
    slots = max(MAX_LORAS.value, len(adapters))
    if not slots:
        return config
    rank = MAX_LORA_RANK.value or max([a.rank for a in adapters] + [16] * (slots > len(adapters)))
    return dataclasses.replace(config, lora_slots=slots, lora_rank=rank)


def _engines(model: LoadedModel, packed, configs: list[EngineConfig], pair, mesh_devices,
             tp: TensorParallel | None, adapters: Sequence[LoraAdapter] = ()) -> tuple[tuple[Engine, ...], str]:
    """The engine (or the disaggregated pair) of `configs` over the model's weights, and where
    it runs. One engine takes the packed blocks over (`cpu_kernels.HandedOver`: `packed` is
    emptied, so that each block goes once the engine has placed or copied it, as its layer loop
    stacks them); a pair shares them, or the layers stacked once from them."""
    if pair is None:
        where = jax.devices()[0].platform
        if tp is not None:
            where = f"{tp.size} {where} devices ({tp.describe()})"
        handed = cpu_kernels.HandedOver(packed) if packed else packed
        if packed:
            packed.clear()
        return (Engine(model.params, model.config, configs[0], devices=mesh_devices,
                       packed=handed, adapters=adapters),), where
    prefill_config, decode_config = configs
    params = model.params
    if prefill_config.decode_matmul == "cpu" and prefill_config.layer_loop:
        # Stacked once and read in place by both engines, which would each stack a copy.
        tree, looped = cpu_weights(params, cpu_kernels.HandedOver(packed or {}), model.config,
                                   prefill_config)
        if looped:
            params = layer_loop.host_views(tree)
            if packed:
                packed.clear()  # the stacked copies are the blocks now
    return ((Engine(params, model.config, prefill_config, device=pair[0], packed=packed,
                    adapters=adapters),
             Engine(params, model.config, decode_config, device=pair[1], packed=packed,
                    adapters=adapters)),
            f"{pair[0]} (prefill) and {pair[1]} (decode), disaggregated")


def chat_from_flags(model: LoadedModel) -> None:
    """--chat_template and --chat_template_kwargs, on the model's tokenizer: every door's
    chats (and /tokenize's, and the reasoning parser's view of the template) render with them."""
    tok = model.tokenizer
    if CHAT_TEMPLATE.value is not None:
        tok.chat_template = chat.template_of(CHAT_TEMPLATE.value)
        print(f"cadence: chats render with --chat_template's template, not {model.name}'s own",
              file=sys.stderr)
    if CHAT_TEMPLATE_KWARGS.value is not None:
        tok.chat_variables = chat.variables_of(CHAT_TEMPLATE_KWARGS.value)


def _load(spec: str, kernels: bool, shardings=None) -> LoadedModel:
    """A model's weights as its engine reads them: sharded, they land on the devices in the
    engine's dtype (no float32 copy left there); unquantized, they are restored in it (a GPU's
    bfloat16: a bf16 checkpoint is never widened). On the CPU kernels with --weights=auto, the
    file's block-quantized matrices are read as they are, never as float32, and its 16-bit
    floats stay 16-bit (the kernels widen them)."""
    as_computed = shardings is not None or (not kernels and WEIGHTS.value in ("auto", "float"))
    as_stored = kernels and WEIGHTS.value == "auto"
    with memory.loading():
        return load_model(spec, shardings=shardings,
                          dtype=compute_dtype() if as_computed else AS_STORED if as_stored else None,
                          skip_packed=as_stored)


def load_draft(target: LoadedModel, kernels: bool) -> LoadedModel:
    """--draft_model, loaded as the model is (`_load`); refused unless its tokenizer is the
    model's token for token."""
    draft = _load(DRAFT_MODEL.value, kernels)
    ours, theirs = target.tokenizer, draft.tokenizer
    differ = (ours.vocab_size if ours.vocab_size != theirs.vocab_size else
              next((i for i in range(ours.vocab_size) if ours.token_bytes(i) != theirs.token_bytes(i)), None))
    if differ is not None or draft.config.vocab_size != target.config.vocab_size:
        at = f" (token {differ} first)" if differ is not None else ""
        raise ValueError(f"the draft model {draft.name}'s vocabulary is not {target.name}'s{at}: "
                         "a draft model shares its model's tokenizer (--draft_model)")
    return draft


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft engine's configuration beside a decoding engine of `config`: its context and
    pages, a slot for each row a verify step runs (--speculative_max_batch at most), k - 1 decode
    steps a call (k: `config`'s speculative_tokens), and a KV pool of that many longest
    sequences."""
    k, rows = config.speculative_tokens, min(config.num_slots, config.speculative_batch)
    return dataclasses.replace(
        config, role="both", num_slots=rows, speculative_tokens=0, decode_steps=max(1, k - 1),
        max_logprobs=0, structured_output=False, num_pages=rows * config.max_pages_per_seq + 1)


def draft_device_bytes(draft: LoadedModel, config: EngineConfig) -> int:
    """The device memory the draft model's engine beside a decoding engine of `config` takes:
    its weights in the compute dtype (before any --quantization) and its KV pool. On a GPU the
    model's pool is sized to leave this much room (`kv_pool_pages`)."""
    cfg = draft_engine_config(config)
    pool = cfg.pool_pages * cfg.page_size * bytes_per_token(draft.config, jnp.dtype(cfg.pool_dtype))
    return cast_bytes(draft.params, cfg.dtype) + pool


def draft_engine_from_flags(draft: LoadedModel, config: EngineConfig, kernels: bool,
                            device: jax.Device | None = None) -> Engine:
    """The engine of `draft` (`load_draft`'s) beside a decoding engine of `config`
    (`draft_engine_config`), on `device` (the decoding one)."""
    if config.max_seq_len > draft.config.max_context:
        raise ValueError(f"--max_seq_len={config.max_seq_len} exceeds the draft model {draft.name}'s "
                         f"context of {draft.config.max_context} tokens")
    draft, packed = quantize_from_flags(draft, kernels)
    k, config = config.speculative_tokens, draft_engine_config(config)
    if jax.default_backend() == "cpu":
        check_pool_fits(draft.config, [config], sized=False)
    with memory.loading():
        engine = Engine(draft.params, draft.config, config, device=device,
                        packed=cpu_kernels.HandedOver(packed) if packed else packed)
    rows = config.num_slots
    print(f"cadence: drafts from {draft.name} (--draft_model), up to {k} tokens a "
          f"step while at most {rows} request{'s' if rows > 1 else ''} decode{'' if rows > 1 else 's'}; "
          f"its KV pool {engine.num_pages} pages, {engine.kv_cache_bytes / 2**20:.0f} MiB of "
          f"{config.pool_dtype}", file=sys.stderr)
    return engine


def build_from_flags(warm: bool = True) -> Runtime:
    """Loads the model and builds the engine(s) and the scheduler; `warm=False` leaves warm-up
    to the caller (the server warms up while already answering /health with 503)."""
    configure_devices()
    enable_compilation_cache()
    host_kv_cache_bytes()  # (refused before anything loads)
    pair = pool_devices()
    mesh_devices = tensor_parallel_devices()
    plan = functools.cache(lambda config: TensorParallel.plan(config, mesh_devices))
    if speculative() == "draft" and (mesh_devices or multi_process()):
        raise ValueError("--draft_model runs on one device: not with --tensor_parallel or "
                         "several processes")
    if multi_process():  # process 0 converts the model first; the others then find it done
        if jax.process_index() == 0:
            resolve(MODEL_FLAG.value)
        multihost.barrier("cadence: the model is converted")
    kernels = not mesh_devices and cpu_kernels_apply(compute_dtype(), None)
    model = _load(MODEL_FLAG.value, kernels, shardings=(
        (lambda config: plan(config).storage_shardings()) if mesh_devices else None))
    chat_from_flags(model)
    tp = plan(model.config) if mesh_devices else None
    model, packed = quantize_from_flags(model, kernels)
    weights_line = describe_decode_weights(model, packed) if kernels else ""
    # From here the engines hold the weights: one engine takes the blocks over.
    model = dataclasses.replace(model, packed={})
    # A draft model loads first: on a GPU the model's KV pool leaves room for it beside the
    # decoding engine.
    draft_model = load_draft(model, kernels) if speculative() == "draft" else None
    reserve = (draft_device_bytes(draft_model, engine_config_from_flags())
               if draft_model is not None and jax.default_backend() == "gpu" else 0)
    engine_config = engine_config_from_flags(model, pair[0] if pair else None, tp, 0 if pair else reserve)
    if multi_process() and engine_config.num_pages is not None and KV_MEMORY.value is None:
        # Each process sized the pool by its own free memory; every one must run the same
        # programs, so all take the smallest.
        engine_config = dataclasses.replace(engine_config, num_pages=multihost.agree_min(engine_config.num_pages))
    if engine_config.max_seq_len > model.config.max_context:
        raise ValueError(
            f"--max_seq_len={engine_config.max_seq_len} exceeds {model.name}'s context of "
            f"{model.config.max_context} tokens"
        )
    adapters = load_adapters(model.config)
    configs = [with_lora(c, adapters) for c in _pool_configs(model, engine_config, pair, reserve)]
    if jax.default_backend() == "cpu":  # the pools are host memory
        check_pool_fits(model.config if tp is None else tp.compute_config, configs,
                        copies=1 if tp is None or tp.heads_sharded else tp.size,
                        sized=KV_MEMORY.value is not None)
    with memory.loading():
        engines, where = _engines(model, packed, configs, pair, mesh_devices, tp, adapters)
    del packed
    for engine in engines:
        cfg = engine.config
        role = "" if cfg.role == "both" else f"{cfg.role} engine: "
        print(
            f"cadence: {role}{model.name} on {where if cfg.role == 'both' else engine.device}, up "
            f"to {cfg.num_slots} sequences of up to {cfg.max_seq_len} tokens; KV pool "
            f"{engine.num_pages} pages x {cfg.page_size} tokens = {engine.num_pages * cfg.page_size} "
            f"tokens, {engine.kv_cache_bytes / 2**20:.0f} MiB of {cfg.pool_dtype}"
            + (f"; {WEIGHTS.value} weights" if WEIGHTS.value in GROUPED_WEIGHTS else "")
            + (f"; weights in the CPU kernels' blocks, {weights_line} "
               f"({cpu_kernels.blocked_bytes(engine.params) / 2**20:.0f} MiB, the only copy)"
               if cfg.decode_matmul == "cpu" else ""),
            file=sys.stderr,
        )
    if pair is not None:
        print(f"cadence: serving {where}", file=sys.stderr)
    model = dataclasses.replace(model, params=None)  # the engines hold their own copies
    memory.release_free()  # the loader's and the host copies' freed buffers
    print(f"cadence: {model.name}'s own sampling defaults, for requests that omit a field: "
          f"{model.generation.describe()}", file=sys.stderr)
    if multi_process():
        address = multihost.plan_address(COORDINATOR.value)
        if jax.process_index() > 0:  # a follower: run process 0's plan until it stops
            print(f"cadence: process {jax.process_index()} follows process 0's plan from "
                  f"{address[0]}:{address[1]}", file=sys.stderr)
            calls = multihost.follow(engines[0], address)
            print(f"cadence: process {jax.process_index()} ran {calls} engine calls; stopping",
                  file=sys.stderr)
            sys.exit(0)
        print(f"cadence: process 0 of {jax.process_count()}, waiting for the others to follow "
              f"on {address[0]}:{address[1]}", file=sys.stderr)
        engines = (multihost.Leader(engines[0], address, jax.process_count() - 1),)
        # Before jax.distributed's own exit hook (registered earlier, so run later), which waits
        # for every process: the followers must first be told to stop.
        atexit.register(engines[0].close)
    draft = (None if draft_model is None else
             draft_engine_from_flags(draft_model, engines[-1].config, kernels, pair[1] if pair else None))
    warm_seconds = warm_up(_with_draft(engines, draft)) if warm else 0.0
    config = scheduler_config_from_flags(model.name, model.path.name)  # (a digest of its source)
    scheduler = Scheduler(engines[0], model.tokenizer, config, decode_engine=engines[1] if pair else None,
                          draft_engine=draft)
    host = config.host_kv_cache_bytes
    print(f"cadence: prefix caching {'on' if config.prefix_caching else 'off (--noprefix_caching)'}"
          + (f": prompts reuse cached KV to the token ({engines[0].config.page_size}-token pages "
             "by key, a partial page copied)" if config.prefix_caching else "")
          + (f"; evicted pages kept in up to {host / 2**20:.0f} MiB of host memory" if host else ""), file=sys.stderr)
    return Runtime(model=model, engines=engines, scheduler=scheduler, warmup_seconds=warm_seconds,
                   draft_engine=draft, adapters=adapters)


def served_names(model: str, given: list[str] | None) -> list[str]:
    """The names the server answers to: `given`, else `model`'s (a path's stem)."""
    if given:
        names = [n.strip() for n in given]
        if not all(names) or len(set(names)) != len(names):
            raise ValueError(f"--served_model_name={','.join(given)}: names must be non-empty and distinct")
        return names
    if model in KNOWN_MODELS:
        return [model]
    name = Path(model).expanduser().name
    return [name.removesuffix(".gguf") or model]
