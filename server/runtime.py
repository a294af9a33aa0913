"""Building a serving stack from flags: model -> engine (warmed up) -> scheduler.

Shared by the front doors (`cadence-generate`, and later the HTTP server and the batch job) so
that each of them stays a thin layer. The absl flags defined here are the engine and scheduler
knobs every front door has, with the same names everywhere.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags, logging
from tqdm import tqdm

from checkpoints.registry import DEFAULT_MODEL, LoadedModel, cache_dir, load_model
from engine.engine import DEFAULT_PAGE_SIZE, Engine, EngineConfig
from model.paged_kv import pages_for_bytes
from scheduler.policy import POLICIES, PolicyConfig
from scheduler.scheduler import KV_RESERVATIONS, Scheduler, SchedulerConfig

MODEL_FLAG = flags.DEFINE_string("model", DEFAULT_MODEL, "Model name, GGUF file, HF folder or converted checkpoint.")
_NUM_SLOTS = flags.DEFINE_integer("num_slots", 8, "Most sequences in flight at once.", lower_bound=1)
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 4096, "Longest sequence: prompt + output.", lower_bound=16)
_PAGE_SIZE = flags.DEFINE_integer("page_size", DEFAULT_PAGE_SIZE, "Tokens per KV page.", lower_bound=1)
_KV_MEMORY = flags.DEFINE_string(
    "kv_cache_memory", None,
    "Bytes for the KV page pool (a count, or with a unit: 1440MiB, 1.5GiB). Default: on a GPU "
    "90% of what is free after the weights; elsewhere num_slots x max_seq_len tokens' worth.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 256, "Largest prefill chunk (tokens).", lower_bound=16)
_MAX_PREFILL_CHUNKS = flags.DEFINE_integer(
    "max_prefill_chunks", None,
    "Most prompt chunks one prefill program carries (default: num_slots). 1 runs each chunk as "
    "a program of its own, the baseline packing is measured against.", lower_bound=1)
_TOKEN_BUDGET = flags.DEFINE_integer(
    "token_budget", None, "Tokens per iteration, decode + prefill (default: prefill_chunk + num_slots)."
)
_POLICY = flags.DEFINE_enum("policy", "chunked", POLICIES, "Iteration policy.")
_KV_RESERVATION = flags.DEFINE_enum(
    "kv_reservation", "live", KV_RESERVATIONS,
    "live: a request holds the KV pages its tokens fill; max: max_seq_len tokens' worth from the "
    "start, like a contiguous slot (a baseline for benchmarks).")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "Waiting requests before refusing new ones.", lower_bound=1)
_ATTENTION = flags.DEFINE_enum(
    "attention", None, ["pallas", "xla", "reference"],
    "Attention implementation (default: pallas on GPU, xla on CPU; pallas on CPU runs "
    "interpreted; reference is the plain einsum oracle).",
)
_DTYPE = flags.DEFINE_enum(
    "dtype", None, ["float32", "bfloat16"], "Compute dtype (default: bfloat16 on GPU, float32 on CPU)."
)


@dataclasses.dataclass
class Runtime:
    model: LoadedModel
    engine: Engine
    scheduler: Scheduler
    warmup_seconds: float


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


def kv_pool_pages(model: LoadedModel, dtype: str, page_size: int) -> int | None:
    """Pages for --kv_cache_memory; on a GPU without it, 90% of the memory left after the
    weights; None (the engine's default: every slot at max_seq_len) otherwise."""
    if _KV_MEMORY.value is not None:
        budget = parse_size(_KV_MEMORY.value)
    elif jax.default_backend() == "gpu":
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        weight_bytes = sum(a.size for a in jax.tree.leaves(model.params)) * jnp.dtype(dtype).itemsize
        budget = int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0) - weight_bytes))
    else:
        return None
    pages = pages_for_bytes(model.config, budget, page_size, jnp.dtype(dtype))
    if pages < 1:
        raise ValueError(f"--kv_cache_memory={_KV_MEMORY.value} holds no page of {page_size} tokens")
    return pages


def engine_config_from_flags(model: LoadedModel | None = None) -> EngineConfig:
    """The engine the flags describe; with the model, the KV pool is sized by memory."""
    on_gpu = jax.default_backend() == "gpu"
    dtype = _DTYPE.value or ("bfloat16" if on_gpu else "float32")
    return EngineConfig(
        num_slots=_NUM_SLOTS.value,
        max_seq_len=_MAX_SEQ_LEN.value,
        prefill_chunk=_PREFILL_CHUNK.value,
        attention=_ATTENTION.value or ("pallas" if on_gpu else "xla"),
        dtype=dtype,
        page_size=_PAGE_SIZE.value,
        num_pages=None if model is None else kv_pool_pages(model, dtype, _PAGE_SIZE.value),
        max_prefill_chunks=_MAX_PREFILL_CHUNKS.value,
        # An iteration's prompt chunks, packed, fit one program even with every slot decoding.
        prefill_tokens=max(_PREFILL_CHUNK.value, token_budget() - _NUM_SLOTS.value),
    )


def token_budget() -> int:
    return _TOKEN_BUDGET.value or _PREFILL_CHUNK.value + _NUM_SLOTS.value


def scheduler_config_from_flags() -> SchedulerConfig:
    budget = token_budget()
    policy = PolicyConfig(
        name=_POLICY.value, token_budget=budget, chunk=_PREFILL_CHUNK.value
    )
    return SchedulerConfig(policy=policy, max_queue=_MAX_QUEUE.value,
                           kv_reservation=_KV_RESERVATION.value)


def warm_up(engine: Engine) -> float:
    """Compiles every program with a progress bar; returns the seconds it took."""
    start = time.monotonic()
    with tqdm(desc="warm-up (compiling)", unit="program", file=sys.stderr, leave=False) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        engine.warmup(progress)
    seconds = time.monotonic() - start
    logging.info("warm-up took %.1f s", seconds)
    print(f"cadence: warm-up compiled every program in {seconds:.1f} s", file=sys.stderr)
    return seconds


def build_from_flags(warm: bool = True) -> Runtime:
    """Loads the model and builds engine and scheduler; `warm=False` leaves warm-up to the
    caller (the server warms up while already answering /health with 503)."""
    enable_compilation_cache()
    model = load_model(MODEL_FLAG.value)
    engine_config = engine_config_from_flags(model)
    if engine_config.max_seq_len > model.config.max_context:
        raise ValueError(
            f"--max_seq_len={engine_config.max_seq_len} exceeds {model.name}'s context of "
            f"{model.config.max_context} tokens"
        )
    engine = Engine(model.params, model.config, engine_config)
    cfg = engine.config
    print(
        f"cadence: {model.name} on {jax.devices()[0].platform}, up to {cfg.num_slots} sequences of "
        f"up to {cfg.max_seq_len} tokens; KV pool {engine.num_pages} pages x {cfg.page_size} tokens "
        f"= {engine.num_pages * cfg.page_size} tokens, {engine.kv_cache_bytes / 2**20:.0f} MiB",
        file=sys.stderr,
    )
    print(f"cadence: {model.name}'s own sampling defaults, for requests that omit a field: "
          f"{model.generation.describe()}", file=sys.stderr)
    warm_seconds = warm_up(engine) if warm else 0.0
    scheduler = Scheduler(engine, model.tokenizer, scheduler_config_from_flags())
    return Runtime(model=model, engine=engine, scheduler=scheduler, warmup_seconds=warm_seconds)
