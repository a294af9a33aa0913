"""Building a serving stack from flags: model -> engine (warmed up) -> scheduler.

Shared by the front doors (`cadence-generate`, and later the HTTP server and the batch job) so
that each of them stays a thin layer. The absl flags defined here are the engine and scheduler
knobs every front door has, with the same names everywhere.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
from absl import flags, logging
from tqdm import tqdm

from checkpoints.registry import DEFAULT_MODEL, LoadedModel, cache_dir, load_model
from engine.engine import Engine, EngineConfig
from scheduler.policy import POLICIES, PolicyConfig
from scheduler.scheduler import Scheduler, SchedulerConfig

MODEL_FLAG = flags.DEFINE_string("model", DEFAULT_MODEL, "Model name, GGUF file, HF folder or converted checkpoint.")
_NUM_SLOTS = flags.DEFINE_integer("num_slots", 8, "Concurrent sequences (KV cache slots).", lower_bound=1)
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 4096, "Tokens per slot: prompt + output.", lower_bound=16)
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 256, "Largest prefill chunk (tokens).", lower_bound=16)
_TOKEN_BUDGET = flags.DEFINE_integer(
    "token_budget", None, "Tokens per iteration, decode + prefill (default: prefill_chunk + num_slots)."
)
_POLICY = flags.DEFINE_enum("policy", "chunked", POLICIES, "Iteration policy.")
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


def engine_config_from_flags() -> EngineConfig:
    on_gpu = jax.default_backend() == "gpu"
    return EngineConfig(
        num_slots=_NUM_SLOTS.value,
        max_seq_len=_MAX_SEQ_LEN.value,
        prefill_chunk=_PREFILL_CHUNK.value,
        attention=_ATTENTION.value or ("pallas" if on_gpu else "xla"),
        dtype=_DTYPE.value or ("bfloat16" if on_gpu else "float32"),
    )


def scheduler_config_from_flags() -> SchedulerConfig:
    budget = _TOKEN_BUDGET.value or _PREFILL_CHUNK.value + _NUM_SLOTS.value
    policy = PolicyConfig(
        name=_POLICY.value, token_budget=budget, chunk=_PREFILL_CHUNK.value
    )
    return SchedulerConfig(policy=policy, max_queue=_MAX_QUEUE.value)


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
    engine_config = engine_config_from_flags()
    if engine_config.max_seq_len > model.config.max_context:
        raise ValueError(
            f"--max_seq_len={engine_config.max_seq_len} exceeds {model.name}'s context of "
            f"{model.config.max_context} tokens"
        )
    engine = Engine(model.params, model.config, engine_config)
    print(
        f"cadence: {model.name} on {jax.devices()[0].platform}, {engine_config.num_slots} slots x "
        f"{engine_config.max_seq_len} tokens, KV cache {engine.kv_cache_bytes / 2**20:.0f} MiB",
        file=sys.stderr,
    )
    print(f"cadence: {model.name}'s own sampling defaults, for requests that omit a field: "
          f"{model.generation.describe()}", file=sys.stderr)
    warm_seconds = warm_up(engine) if warm else 0.0
    scheduler = Scheduler(engine, model.tokenizer, scheduler_config_from_flags())
    return Runtime(model=model, engine=engine, scheduler=scheduler, warmup_seconds=warm_seconds)
