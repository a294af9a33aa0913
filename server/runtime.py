"""Building a serving stack from flags: model -> engine(s) (warmed up) -> scheduler.

Shared by the front doors (`cadence-serve`, `cadence-generate`, `cadence-batch`) so that each of
them stays a thin layer. The absl flags defined here are the engine and scheduler knobs every
front door has, with the same names everywhere, the disaggregated mode's included:
`--prefill_devices=0 --decode_devices=1` builds a prefill engine and a decode engine on those
JAX devices (each with its own weights and KV pool) under one scheduler; on the CPU,
`--num_cpu_devices=2` first makes two devices of it. `--tensor_parallel=N` spans one engine over
the first N devices instead (`model.sharding`), its weights restored straight into their shards.
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

import jax
import jax.numpy as jnp
from absl import flags, logging
from tqdm import tqdm

from cadence.checkpoints.registry import DEFAULT_MODEL, LoadedModel, cache_dir, load_model, resolve
from cadence.engine import multihost
from cadence.engine.config import DEFAULT_PAGE_SIZE, WARMUPS, EngineConfig
from cadence.engine.engine import Engine
from cadence.model import cpu_kernels
from cadence.model.paged_kv import pages_for_bytes
from cadence.model.params import MATRICES, cast_bytes, param_specs
from cadence.model.quant import quantize, quantize_grouped
from cadence.model.sharding import TensorParallel
from cadence.scheduler.grammar import GrammarCompiler
from cadence.scheduler.policy import POLICIES, PolicyConfig
from cadence.scheduler.priority import SLO, PriorityClasses
from cadence.scheduler.scheduler import KV_RESERVATIONS, Scheduler, SchedulerConfig

MODEL_FLAG = flags.DEFINE_string("model", DEFAULT_MODEL, "Model name, GGUF file, HF folder or converted checkpoint.")
_NUM_SLOTS = flags.DEFINE_integer("num_slots", 8, "Most sequences in flight at once.", lower_bound=1)
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 4096, "Longest sequence: prompt + output.", lower_bound=16)
_PAGE_SIZE = flags.DEFINE_integer("page_size", DEFAULT_PAGE_SIZE, "Tokens per KV page.", lower_bound=1)
_KV_MEMORY = flags.DEFINE_string(
    "kv_cache_memory", None,
    "Bytes for the KV page pool (a count, or with a unit: 1440MiB, 1.5GiB); with "
    "--tensor_parallel, per device. Default: on a GPU 90% of what is free after the weights; "
    "elsewhere num_slots x max_seq_len tokens' worth.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 256, "Largest prefill chunk (tokens).", lower_bound=16)
_MAX_PREFILL_CHUNKS = flags.DEFINE_integer(
    "max_prefill_chunks", None,
    "Most prompt chunks one prefill program carries (default: num_slots). 1 runs each chunk as "
    "a program of its own, the baseline packing is measured against.", lower_bound=1)
_TOKEN_BUDGET = flags.DEFINE_integer(
    "token_budget", None, "Tokens per iteration, decode + prefill (default: prefill_chunk + num_slots)."
)
_POLICY = flags.DEFINE_enum("policy", "chunked", POLICIES, "Iteration policy.")
_DECODE_STEPS = flags.DEFINE_integer(
    "decode_steps", 1,
    "Most decode steps one dispatch runs when an iteration has only decoding to do (every "
    "request with that many tokens to go and no stop strings): less host work per token, "
    "tokens reach clients k at a time.", lower_bound=1)
_MAX_LOGPROBS = flags.DEFINE_integer(
    "max_logprobs", 20,
    "Most alternatives per token a request may ask for (top_logprobs; logprobs on completions); "
    "more is a 400. The programs compute this many, in steps where some request asks.",
    lower_bound=0)
_KV_RESERVATION = flags.DEFINE_enum(
    "kv_reservation", "live", KV_RESERVATIONS,
    "live: a request holds the KV pages its tokens fill; max: max_seq_len tokens' worth from the "
    "start, like a contiguous slot (a baseline for benchmarks).")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "Waiting requests before refusing new ones.", lower_bound=1)
_PRIORITY_CLASSES = flags.DEFINE_string(
    "priority_classes", "",
    "The priority of a request that sends none, by prompt length: TOKENS=PRIORITY[,...], e.g. "
    "1024=1 (prompts of more than 1024 tokens get priority 1, below the default 0; lower runs "
    "first and may preempt higher numbers).")
_LOWER_SHARE = flags.DEFINE_float(
    "lower_share", 0.25,
    "With several priorities prefilling, the least fraction of the prefill budget the lower ones "
    "get (they are slowed, never starved).", lower_bound=0.0, upper_bound=1.0)
_SLO_TTFT = flags.DEFINE_string(
    "slo_ttft", "",
    "Time-to-first-token targets per priority, PRIORITY=SECONDS[,...], e.g. 0=2,1=120: a request "
    "predicted to miss its target (by more than --slo_margin) is refused at once with 429 and "
    "Retry-After.")
_SLO_ITL = flags.DEFINE_string(
    "slo_itl", "",
    "Inter-token targets per priority, PRIORITY=SECONDS[,...]: while decode steps take longer "
    "(by more than --slo_margin), new requests of that priority are refused with 429.")
_SLO_MARGIN = flags.DEFINE_float(
    "slo_margin", 0.25, "How far past a target a prediction must be to refuse (a fraction).",
    lower_bound=0.0)


def _parses(parse):
    def check(value: str) -> bool:
        try:
            parse(value)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True
    return check


flags.register_validator("priority_classes", _parses(PriorityClasses.parse))
flags.register_validator("slo_ttft", _parses(lambda v: SLO.parse(ttft=v)))
flags.register_validator("slo_itl", _parses(lambda v: SLO.parse(itl=v)))
WARMUP = flags.DEFINE_enum(
    "warmup", "needed", WARMUPS,
    "Which programs warm-up compiles before /health says ok. needed: those every request runs "
    "(prefill and decode); the programs only some requests run (echo and prompt logprobs, "
    "response formats and forced tool calls, penalties, n > 1) compile on first use, on a "
    "thread of their own, while the request that needs them waits (others do not). all: every "
    "program first, so no request ever waits for a compile (benchmarks, steady latency).")
_WARMUP_THREADS = flags.DEFINE_integer(
    "warmup_threads", None,
    "Programs compiled at once during warm-up (default: one per two cores).",
    lower_bound=1)
_STRUCTURED_OUTPUT = flags.DEFINE_bool(
    "structured_output", True,
    "Serve response_format and forced tool calls: compiles the two halves of a decode step that "
    "a grammar's bitmask goes between (more programs to warm up); --nostructured_output refuses "
    "those requests with a 400.")
GRAMMAR_TIMEOUT = flags.DEFINE_float(
    "grammar_timeout", 10.0,
    "Seconds a response format's or a tool choice's grammar may take to compile (on threads of "
    "its own, never delaying other requests); longer is a 400.", lower_bound=0.001)
_PREFIX_CACHING = flags.DEFINE_bool(
    "prefix_caching", True,
    "Reuse the KV of prompt prefixes computed before (automatic prefix caching: a full page's KV "
    "is found by the hash of its tokens and everything before them); --noprefix_caching "
    "computes every prompt from scratch.")
_ATTENTION = flags.DEFINE_enum(
    "attention", None, ["pallas", "cpu", "xla", "reference"],
    "Attention implementation (default: pallas on GPU; on CPU, cpu where --cpu_kernels applies, "
    "else xla; pallas on CPU runs interpreted; reference is the plain einsum oracle).",
)
_CPU_KERNELS = flags.DEFINE_bool(
    "cpu_kernels", True,
    "On the CPU, decode with cadence's C++ kernels (model/cpu_kernels.cc, built once with the "
    "system's compiler): paged attention, and the matmuls over a blocked copy of the weights "
    "(float32, int8, or a GGUF's own blocks: --weights). float32 compute on one device; false: "
    "XLA's paths.")
_WEIGHTS = flags.DEFINE_enum(
    "weights", "auto", ("auto", "float", "int8", "int4"),
    "auto: where decode runs on the CPU kernels, the matrices a GGUF checkpoint stores "
    "block-quantized (Q8_0, Q4_0, Q4_1, Q5_0, and the K-quants Q4_K, Q5_K, Q6_K) are read as "
    "they are, everything else as float; "
    "float: every matrix in --dtype (a GGUF's blocks dequantized); int8, int4: every matrix "
    "quantized when loaded, weight-only (activations and the KV cache stay in --dtype): on the "
    "CPU kernels in groups of 32 weights with a float16 scale (int4 also a minimum, as GGUF's "
    "Q8_0 and Q4_1; int4 keeps a tied LM head in int8), decode reading them and prefill what "
    "they stand for; elsewhere int8 has a scale per output channel, and int4 is refused.")
_DTYPE = flags.DEFINE_enum(
    "dtype", None, ["float32", "bfloat16"], "Compute dtype (default: bfloat16 on GPU, float32 on CPU)."
)
_NUM_CPU_DEVICES = flags.DEFINE_integer(
    "num_cpu_devices", None,
    "On the CPU, how many JAX devices to make of it (jax_num_cpu_devices), e.g. 2 for "
    "--prefill_devices=0 --decode_devices=1. They share the same cores and memory bandwidth: "
    "the disaggregated mode can be checked and its protocol's cost measured, not its isolation.",
    lower_bound=1)
_PREFILL_DEVICES = flags.DEFINE_list(
    "prefill_devices", None,
    "Disaggregated serving (with --decode_devices): the JAX device index of the prefill engine, "
    "which admits and prefills prompts and hands their KV on.")
_DECODE_DEVICES = flags.DEFINE_list(
    "decode_devices", None,
    "Disaggregated serving (with --prefill_devices): the JAX device index of the decode engine.")
_TENSOR_PARALLEL = flags.DEFINE_integer(
    "tensor_parallel", 1,
    "Devices one engine spans (tensor parallelism over the first N JAX devices): heads, the "
    "MLP and the vocabulary are split where they divide, the KV pool by KV head. On the CPU, "
    "--num_cpu_devices=N makes N devices (which check the protocol, not the speed).",
    lower_bound=1)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "Multi-host (with --num_processes and --process_id): process 0's host:port, where "
    "jax.distributed's coordinator listens; the engine's plan goes over the next port. Every "
    "process runs the same command; process 0 serves, the others follow it.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", 1, "Multi-host: how many processes (hosts) one engine spans.", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "Multi-host: this process's index.", lower_bound=0)
_PREFILL_SLOTS = flags.DEFINE_integer(
    "prefill_slots", None,
    "Disaggregated: sequences the prefill engine holds at once, prefilling or waiting for the "
    "decode engine (the transfer backlog's bound; default num_slots).", lower_bound=1)


@dataclasses.dataclass
class Runtime:
    model: LoadedModel
    engines: tuple[Engine, ...]  # one, or the prefill engine and the decode engine
    scheduler: Scheduler
    warmup_seconds: float

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None) -> float:
        return warm_up(self.engines, progress)

    def grammars(self) -> GrammarCompiler | None:
        """A grammar compiler for the model (structured output), or None where it is off."""
        if not self.engines[-1].config.structured_output:
            return None
        return GrammarCompiler(self.model.tokenizer, self.engines[-1].vocab_size,
                               timeout=GRAMMAR_TIMEOUT.value)


def configure_devices() -> None:
    """--num_cpu_devices and the multi-host flags, which JAX takes only before its first
    operation."""
    if _NUM_CPU_DEVICES.value is not None:
        try:
            jax.config.update("jax_num_cpu_devices", _NUM_CPU_DEVICES.value)
        except RuntimeError as e:
            raise ValueError(f"--num_cpu_devices could not be applied: {e}") from None
    if _NUM_PROCESSES.value > 1:
        if not _COORDINATOR.value:
            raise ValueError("--num_processes > 1 needs --coordinator_address (process 0's host:port)")
        if _PROCESS_ID.value >= _NUM_PROCESSES.value:
            raise ValueError(f"--process_id={_PROCESS_ID.value} is not in [0, {_NUM_PROCESSES.value})")
        multihost.plan_address(_COORDINATOR.value)  # refuses a malformed address now
        multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)


def multi_process() -> bool:
    return _NUM_PROCESSES.value > 1


def pool_devices() -> tuple[jax.Device, jax.Device] | None:
    """The (prefill, decode) devices of --prefill_devices and --decode_devices; None when
    serving colocated. Refuses what cannot run, saying why."""
    given = (_PREFILL_DEVICES.value, _DECODE_DEVICES.value)
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
    n = _TENSOR_PARALLEL.value
    if multi_process() and n != jax.device_count():
        raise ValueError(f"over {_NUM_PROCESSES.value} processes the engine spans every "
                         f"process's devices: pass --tensor_parallel={jax.device_count()}")
    if n == 1:
        return None
    if _PREFILL_DEVICES.value or _DECODE_DEVICES.value:
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
                  device: jax.Device | None = None, tp: TensorParallel | None = None) -> int | None:
    """Pages for --kv_cache_memory; on a GPU without it, 90% of the memory left after the
    weights on `device`; None (the engine's default: every slot at max_seq_len) otherwise.
    With `tp` the budget is each device's: the weights are on the devices already (restored
    into their shards), and a device holds its KV heads' share of every page, or all of it
    where attention is replicated."""
    if _KV_MEMORY.value is not None:
        budget = parse_size(_KV_MEMORY.value)
    elif jax.default_backend() == "gpu":
        stats = (device or jax.local_devices()[0]).memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        on_host = 0 if tp is not None else cast_bytes(model.params, dtype)
        budget = int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0) - on_host))
    else:
        return None
    pages = pages_for_bytes(model.config if tp is None else tp.compute_config, budget, page_size,
                            jnp.dtype(dtype))
    if tp is not None and tp.heads_sharded:
        pages *= tp.size
    if pages < 1:
        raise ValueError(f"--kv_cache_memory={_KV_MEMORY.value} holds no page of {page_size} tokens")
    return pages


def engine_config_from_flags(model: LoadedModel | None = None, device: jax.Device | None = None,
                             tp: TensorParallel | None = None) -> EngineConfig:
    """The engine the flags describe; with the model, the KV pool is sized by memory (on
    `device`, default the first, or over `tp`'s devices)."""
    on_gpu = jax.default_backend() == "gpu"
    dtype = compute_dtype()
    kernels = cpu_kernels_apply(dtype, tp)
    return EngineConfig(
        num_slots=_NUM_SLOTS.value,
        max_seq_len=_MAX_SEQ_LEN.value,
        prefill_chunk=_PREFILL_CHUNK.value,
        attention=_ATTENTION.value or ("pallas" if on_gpu else "cpu" if kernels else "xla"),
        decode_matmul="cpu" if kernels else "xla",
        dtype=dtype,
        page_size=_PAGE_SIZE.value,
        num_pages=None if model is None else kv_pool_pages(model, dtype, _PAGE_SIZE.value, device, tp),
        max_prefill_chunks=_MAX_PREFILL_CHUNKS.value,
        decode_steps=_DECODE_STEPS.value,
        max_logprobs=_MAX_LOGPROBS.value,
        structured_output=_STRUCTURED_OUTPUT.value,
        # An iteration's prompt chunks, packed, fit one program even with every slot decoding.
        prefill_tokens=max(_PREFILL_CHUNK.value, token_budget() - _NUM_SLOTS.value),
    )


def quantize_from_flags(model: LoadedModel, kernels: bool):
    """(model, packed): the weights --weights asks for. `packed` (path -> grouped matrix, or
    None) is what the CPU decode kernels read in place of blocking a float matrix: with auto,
    the checkpoint's own blocks; with int8 / int4, every matrix quantized in groups of 32
    (`model.quant.quantize_grouped`), the model's params then being what they stand for. Off
    the CPU kernels int8 is per output channel (`model.quant.quantize`), and int4 is refused."""
    weights = _WEIGHTS.value
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
    """What the CPU decode kernels read, for the start-up line: the checkpoint's own formats
    and how many matrices each, and what is blocked from float (dequantized, where the
    checkpoint stored it block-quantized in a format the kernels lack)."""
    matrices = [s.path for s in param_specs(model.config) if s.path[-1] in MATRICES
                and (s.path[-1] != "embedding" or model.config.tie_embeddings)]
    if _WEIGHTS.value in GROUPED_WEIGHTS:
        head = " (the tied LM head in int8)" if _WEIGHTS.value == "int4" and model.config.tie_embeddings else ""
        return f"{len(matrices)} matrices in {_WEIGHTS.value}{head}, a float16 scale per 32 weights"
    own = collections.Counter(model.packed[p][1] for p in matrices if p in (packed or {}))
    rest = len(matrices) - sum(own.values())
    parts = [f"{n} {'matrix' if n == 1 else 'matrices'} in the checkpoint's own {kind}"
             for kind, n in sorted(own.items())]
    if rest:
        parts.append(f"{rest} {'matrix' if rest == 1 else 'matrices'} blocked from float32"
                     + (" (--weights=auto reads a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q5_K/Q6_K as they are)"
                        if _WEIGHTS.value != "auto" and model.packed else ""))
    return ", ".join(parts)


def cpu_kernels_apply(dtype: str, tp: TensorParallel | None) -> bool:
    """Whether the engine decodes with the CPU kernels (`model.cpu_kernels`): --cpu_kernels, on
    the CPU, float32 compute, one device, and the kernels built here; a reason they do not
    apply is logged once."""
    if not _CPU_KERNELS.value or jax.default_backend() != "cpu":
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
    return _DTYPE.value or ("bfloat16" if jax.default_backend() == "gpu" else "float32")


def token_budget() -> int:
    return _TOKEN_BUDGET.value or _PREFILL_CHUNK.value + _NUM_SLOTS.value


def scheduler_config_from_flags(model_name: str) -> SchedulerConfig:
    budget = token_budget()
    policy = PolicyConfig(
        name=_POLICY.value, token_budget=budget, chunk=_PREFILL_CHUNK.value, lower_share=_LOWER_SHARE.value
    )
    classes = PriorityClasses.parse(_PRIORITY_CLASSES.value)
    slo = SLO.parse(_SLO_TTFT.value, _SLO_ITL.value, _SLO_MARGIN.value)
    return SchedulerConfig(policy=policy, max_queue=_MAX_QUEUE.value,
                           kv_reservation=_KV_RESERVATION.value, prefix_caching=_PREFIX_CACHING.value,
                           cache_namespace=f"{model_name}/{_WEIGHTS.value}/{_DTYPE.value}",
                           priority_classes=classes, slo=slo)


def warm_up(engines: Sequence[Engine], progress: Callable[[int, int, str], None] | None = None,
            warmup: str | None = None) -> float:
    """Compiles the programs of every engine that --warmup names, with a progress bar naming
    each as it is compiled, and `progress(done, total, name)` over all engines; returns the
    seconds it took."""
    warmup = warmup or WARMUP.value
    start = time.monotonic()
    # A multi-host engine's followers warm up whatever it sends them: everything.
    plans = [(e, "all" if isinstance(e, multihost.Leader) else warmup) for e in engines]
    counts = [len(e.warm_programs(e.program_groups(mode))) for e, mode in plans]
    total, offset = sum(counts), 0
    later = sorted({g for e, _ in plans for g in e.program_groups("all")}
                   - {g for e, mode in plans for g in e.program_groups(mode)})
    print(f"cadence: warm-up compiles {total} programs (--warmup={warmup})"
          + (f"; on first use: {', '.join(later)}" if later else ""), file=sys.stderr)
    with tqdm(desc="warm-up (compiling)", total=total, unit="program", file=sys.stderr,
              leave=False) as bar:
        if progress is not None:
            progress(0, total, "")
        for (engine, mode), count in zip(plans, counts):
            role = "" if engine.config.role == "both" else f"{engine.config.role} engine: "

            def one(done: int, _total: int, name: str = "", base: int = offset) -> None:
                bar.set_postfix_str(f"{role}{name}", refresh=False)
                bar.update(base + done - bar.n)
                logging.info("compiled %s%s (%d/%d)", role, name, base + done, total)
                if progress is not None:
                    progress(base + done, total, f"{role}{name}")

            if isinstance(engine, Engine):
                engine.warmup(one, warmup=mode, workers=_WARMUP_THREADS.value)
            else:
                engine.warmup(one)
            offset += count
    seconds = time.monotonic() - start
    logging.info("warm-up took %.1f s", seconds)
    print(f"cadence: warm-up compiled {total} programs in {seconds:.1f} s", file=sys.stderr)
    return seconds


def build_from_flags(warm: bool = True) -> Runtime:
    """Loads the model and builds the engine(s) and the scheduler; `warm=False` leaves warm-up
    to the caller (the server warms up while already answering /health with 503)."""
    configure_devices()
    enable_compilation_cache()
    pair = pool_devices()
    mesh_devices = tensor_parallel_devices()
    plan = functools.cache(lambda config: TensorParallel.plan(config, mesh_devices))
    if multi_process():  # process 0 converts the model first; the others then find it done
        if jax.process_index() == 0:
            resolve(MODEL_FLAG.value)
        multihost.barrier("cadence: the model is converted")
    # Sharded, the weights land on the devices in the engine's dtype (no float32 copy left there).
    model = load_model(MODEL_FLAG.value, shardings=(
        (lambda config: plan(config).storage_shardings()) if mesh_devices else None),
        dtype=compute_dtype() if mesh_devices else None)
    tp = plan(model.config) if mesh_devices else None
    model, packed = quantize_from_flags(model, cpu_kernels_apply(compute_dtype(), tp))
    engine_config = engine_config_from_flags(model, pair[0] if pair else None, tp)
    if multi_process() and engine_config.num_pages is not None and _KV_MEMORY.value is None:
        # Each process sized the pool by its own free memory; every one must run the same
        # programs, so all take the smallest.
        engine_config = dataclasses.replace(engine_config, num_pages=multihost.agree_min(engine_config.num_pages))
    if engine_config.max_seq_len > model.config.max_context:
        raise ValueError(
            f"--max_seq_len={engine_config.max_seq_len} exceeds {model.name}'s context of "
            f"{model.config.max_context} tokens"
        )
    if pair is None:
        engines = (Engine(model.params, model.config, engine_config, devices=mesh_devices,
                          packed=packed),)
        where = jax.devices()[0].platform
        if tp is not None:
            where = f"{tp.size} {where} devices ({tp.describe()})"
    else:
        # Nothing decodes on the prefill engine, so its packs may take the whole token budget.
        prefill_config = dataclasses.replace(
            engine_config, role="prefill", num_slots=_PREFILL_SLOTS.value or engine_config.num_slots,
            prefill_tokens=max(engine_config.prefill_chunk, token_budget()))
        decode_config = dataclasses.replace(
            engine_config_from_flags(model, pair[1]), role="decode")
        engines = (Engine(model.params, model.config, prefill_config, device=pair[0]),
                   Engine(model.params, model.config, decode_config, device=pair[1], packed=packed))
        where = f"{pair[0]} (prefill) and {pair[1]} (decode), disaggregated"
    for engine in engines:
        cfg = engine.config
        role = "" if cfg.role == "both" else f"{cfg.role} engine: "
        print(
            f"cadence: {role}{model.name} on {where if cfg.role == 'both' else engine.device}, up "
            f"to {cfg.num_slots} sequences of up to {cfg.max_seq_len} tokens; KV pool "
            f"{engine.num_pages} pages x {cfg.page_size} tokens = {engine.num_pages * cfg.page_size} "
            f"tokens, {engine.kv_cache_bytes / 2**20:.0f} MiB"
            + (f"; {_WEIGHTS.value} weights" if _WEIGHTS.value in GROUPED_WEIGHTS else "")
            + (f"; decode on the CPU kernels, over {describe_decode_weights(model, packed)} "
               f"(+{cpu_kernels.blocked_bytes(engine.decode_params) / 2**20:.0f} MiB)"
               if cfg.decode_matmul == "cpu" and cfg.role != "prefill" else ""),
            file=sys.stderr,
        )
    if pair is not None:
        print(f"cadence: serving {where}", file=sys.stderr)
    model = dataclasses.replace(model, params=None)  # the engines hold their own copies
    print(f"cadence: {model.name}'s own sampling defaults, for requests that omit a field: "
          f"{model.generation.describe()}", file=sys.stderr)
    if multi_process():
        address = multihost.plan_address(_COORDINATOR.value)
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
    warm_seconds = warm_up(engines) if warm else 0.0
    config = scheduler_config_from_flags(model.name)
    scheduler = Scheduler(engines[0], model.tokenizer, config, decode_engine=engines[1] if pair else None)
    print(f"cadence: prefix caching {'on' if config.prefix_caching else 'off (--noprefix_caching)'}"
          + (f": prompts reuse the KV of cached {engines[0].config.page_size}-token pages"
             if config.prefix_caching else ""), file=sys.stderr)
    return Runtime(model=model, engines=engines, scheduler=scheduler, warmup_seconds=warm_seconds)
