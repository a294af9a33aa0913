"""Shared fixtures: tiny random-weight models, built once per session; a loopback server."""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time

import jax

# Four host devices, as `--num_cpu_devices=4` makes them, for the tests of serving over several
# (disaggregated pools). JAX takes this only before its first operation. Everything else runs
# on device 0, as it would with one.
jax.config.update("jax_num_cpu_devices", 4)

import os  # noqa: E402
from pathlib import Path  # noqa: E402

# XLA's persistent compilation cache, kept between runs: most of a test's time on the tiny
# models is compiling programs, which are the same from one run to the next. The CLIs that tests
# start as subprocesses share it (`tiny_model_dir`'s environment). CADENCE_TEST_CACHE moves it.
TEST_CACHE = Path(os.environ.get("CADENCE_TEST_CACHE") or Path.home() / ".cache" / "cadence" / "tests")
jax.config.update("jax_compilation_cache_dir", str(TEST_CACHE / "xla"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cadence.model.config import TINY, ModelConfig  # noqa: E402
from cadence.model import params as model_params  # noqa: E402


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml's addopts): a worker per core this process may run on, at most
    4, as each holds its own engines and their compiled programs."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random weights as float32 NumPy arrays, scaled so greedy choices are clear-cut.

    Norm scales are perturbed away from 1 so a loader that drops them is caught, and the
    embedding is scaled up so logits have gaps much larger than float32 noise.
    """
    params = model_params.random_params(config, jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def perturb(path, leaf):
        leaf = np.asarray(leaf, np.float32)
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return (1.0 + 0.1 * rng.standard_normal(leaf.shape)).astype(np.float32)
        if "embedding" in name:
            return leaf * 8.0
        if "bias" in name:
            return (0.1 * rng.standard_normal(leaf.shape)).astype(np.float32)
        return leaf

    return jax.tree_util.tree_map_with_path(perturb, params)


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_params(tiny_config) -> dict:
    return random_params(tiny_config)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_config):
    """A byte-level BPE trained on a small corpus, padded with reserved control tokens to
    exactly the tiny model's vocabulary, so any sampled id has a meaning."""
    from cadence.checkpoints.tokenizer import Tokenizer

    return Tokenizer.from_gguf_fields(tiny_tokenizer_fields(tiny_config))


def tiny_tokenizer_fields(config: ModelConfig) -> dict:
    """`tiny_tokenizer` as a GGUF file's tokenizer.* keys."""
    from tests.trained_tokenizers import gguf_fields, trained_bpe

    fields = gguf_fields(trained_bpe(), "smollm")
    tokens = list(fields["tokenizer.ggml.tokens"])[: config.vocab_size]
    types = list(fields["tokenizer.ggml.token_type"])[: config.vocab_size]
    while len(tokens) < config.vocab_size:
        tokens.append(f"<|reserved_{len(tokens)}|>")
        types.append(3)
    kept = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"] if "".join(m.split(" ")) in kept]
    fields.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                   "tokenizer.ggml.merges": merges})
    return fields


def tokenizer_keys(fields: dict):
    """A GGUF writer's `metadata` callback adding a tokenizer's keys (`tiny_tokenizer_fields`)."""
    def add(w):
        w.add_tokenizer_model(fields["tokenizer.ggml.model"])
        w.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
        w.add_token_list(fields["tokenizer.ggml.tokens"])
        w.add_token_types(fields["tokenizer.ggml.token_type"])
        w.add_token_merges(fields["tokenizer.ggml.merges"])
        w.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
        w.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
        w.add_add_bos_token(fields["tokenizer.ggml.add_bos_token"])
        w.add_chat_template(fields["tokenizer.chat_template"])
    return add


# Qwen2.5-Coder's infill tokens, and where `fim_tokenizer` puts them (index from the end).
FIM_ROLES = {"<|fim_prefix|>": -1, "<|fim_suffix|>": -2, "<|fim_middle|>": -3, "<|repo_name|>": -4,
             "<|file_sep|>": -5}


def fim_tokenizer_of(config: ModelConfig, roles: dict[str, int] = FIM_ROLES, **more):
    """The tiny tokenizer with its last pieces (the last merges learned) made control tokens
    of infill texts (`roles`: text -> index from the end); `more`: GGUF keys besides
    (`tokenizer.ggml.` left out)."""
    from cadence.checkpoints.tokenizer import Tokenizer

    fields = tiny_tokenizer_fields(config)
    tokens, types = list(fields["tokenizer.ggml.tokens"]), list(fields["tokenizer.ggml.token_type"])
    gone = set()
    for text, at in roles.items():
        gone.add(tokens[at])
        tokens[at], types[at] = text, 3
    merges = [m for m in fields["tokenizer.ggml.merges"] if m.replace(" ", "") not in gone]
    return Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.tokens": tokens,
                                       "tokenizer.ggml.token_type": types,
                                       "tokenizer.ggml.merges": merges,
                                       **{f"tokenizer.ggml.{k}": v for k, v in more.items()}})


@pytest.fixture(scope="session")
def fim_tokenizer(tiny_config):
    """`tiny_tokenizer` that can fill in the middle: Qwen2.5-Coder's five infill tokens."""
    return fim_tokenizer_of(tiny_config)


@pytest.fixture(scope="session")
def sp_dir(tmp_path_factory) -> Path:
    """A SentencePiece tokenizer's HF folder, trained once a session (`trained_tokenizers`)."""
    from tests.trained_tokenizers import train_spm

    return train_spm(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def spm(sp_dir):
    from cadence.checkpoints.tokenizer import Tokenizer

    return Tokenizer.from_hf_dir(sp_dir)


# The serving tests' engine: long slots, so that a request told to run long (500 tokens)
# outlives any client-side race; short chunks, so that prompts span several.
SERVING_ENGINE = dict(num_slots=4, max_seq_len=512, prefill_chunk=32, min_kv_bucket=256,
                      structured_output=True)


# The engines the session keeps between modules (tiny_engine's, shared_engine's), by key; let
# go, with every compiled program, when the process's memory maps grow (`memory_maps_stay_bounded`).
_KEPT: dict = {}


@pytest.fixture(scope="module")
def tiny_engine(tiny_params, tiny_config):
    """The tiny model's engine, warmed up once (again only after the session let its programs
    go) for every test that serves over HTTP."""
    from cadence.engine.config import EngineConfig
    from cadence.engine.engine import Engine

    engine = _KEPT.get("tiny")
    if engine is None:
        engine = _KEPT["tiny"] = Engine(tiny_params, tiny_config, EngineConfig(**SERVING_ENGINE))
        engine.warmup()
    return engine


@pytest.fixture(scope="session")
def shared_engine(tiny_params, tiny_config):
    """`shared_engine(config, warmup=None)`: the tiny model's engine of `config`, one per
    configuration and warm-up in the session, handed to each test as a new one would be (an
    empty pool, no step pending: `recover()`) but with the programs earlier tests ran already
    traced, lowered and compiled. Engines do not share jitted programs, and doing that again is
    most of what building one costs a test. `warmup`: None, or `Engine.warmup`'s choice, run
    once, when the engine is built. Its compile counters are the process's: a test counts
    `compilations_after_warmup` from where it starts.

    At most `SHARED_ENGINES` are kept, the least recently used let go first, and all of them
    when the session lets its compiled programs go (`memory_maps_stay_bounded`)."""
    from cadence.engine.engine import Engine

    def get(config, warmup: str | None = None):
        key = ("shared", config, warmup)
        engine = _KEPT.pop(key, None)
        if engine is not None:
            _KEPT[key] = engine  # the most recently used
            engine.recover()
            return engine
        shared = [k for k in _KEPT if k[0] == "shared"]
        for old in shared[: max(0, len(shared) + 1 - SHARED_ENGINES)]:
            del _KEPT[old]
        gc.collect()  # their programs' code goes now, not at some later collection
        engine = _KEPT[key] = Engine(tiny_params, tiny_config, config)
        if warmup is not None:
            engine.warmup(warmup=warmup)
        return engine

    return get


SHARED_ENGINES = 4


def compiled(engine, *groups: str):
    """Compiles the programs of `groups` that `engine` has not compiled yet (`Engine.prepare`),
    and waits for them: an engine warmed up with warmup="needed" then holds what a test runs
    beyond prefill and decode, and no request parks for it. Returns the engine."""
    future = engine.prepare(groups)
    if future is not None:
        future.result()
    return engine


# The engine test_engine.py's tests share with test_bitmask.py's: 4 slots of 256 tokens, prefill
# chunks of 64 in buckets from 16, structured output's split step.
SMALL_ENGINE = dict(num_slots=4, max_seq_len=256, prefill_chunk=64, min_prefill_bucket=16, min_kv_bucket=64,
                    structured_output=True)

# The engine the sampling tests share (logprobs, penalties, n > 1): 4 slots of 192 tokens in
# pages of 16, chunks of 32, and up to 8 logprobs a token; one page-table width (the tests of
# the widths are test_engine.py's), so its warm-up compiles 8 programs instead of 14.
SAMPLING_ENGINE = dict(num_slots=4, max_seq_len=192, prefill_chunk=32, min_kv_bucket=192, page_size=16,
                       max_logprobs=8)


# The served engines of test_speculative.py and test_penalties.py: 4 slots over a pool that holds
# one longest sequence of 192 tokens (and the null page), in pages of 16, so requests are
# preempted and recomputed.
ONE_LONGEST = dict(num_slots=4, max_seq_len=192, prefill_chunk=32, min_kv_bucket=192, page_size=16,
                   num_pages=192 // 16 + 1, structured_output=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_config, tiny_params, tiny_tokenizer):
    """The tiny model as a converted checkpoint at ROOT/model, for the CLIs' `--model`, and an
    environment whose CADENCE_CACHE (XLA's compilation cache and the built CPU kernels) is
    shared by every run, and kept for the next test session."""
    from cadence.checkpoints.store import save_converted

    root = tmp_path_factory.mktemp("tiny-model")
    tiny_tokenizer.save(root / "tok")
    files = {p.name: p.read_bytes() for p in (root / "tok").iterdir() if p.is_file()}
    save_converted(root / "model", tiny_config, tiny_params, files)
    return root, dict(os.environ, CADENCE_CACHE=str(TEST_CACHE / "cli"))


@pytest.fixture
def triton_verifications(monkeypatch) -> list:
    """Every Triton module Pallas lowers during the test is MLIR-verified; the list collects
    each verification's result (True when it passed). Skips where JAX has no Triton lowering."""
    lowering = pytest.importorskip("jax._src.pallas.triton.lowering")
    verified: list = []
    original = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = original(*args, **kwargs)
        with result.module.context:
            verified.append(result.module.operation.verify())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return verified


@contextlib.contextmanager
def serve_tiny(engine, tokenizer, model="tiny", **options):
    """Serves a tiny-model engine through the real app over loopback (`tiny_app`); yields the
    base URL."""
    app, _ = tiny_app(engine, tokenizer, model, **options)
    with loopback_server(app) as base:
        yield base


def tiny_app(engine, tokenizer, model="tiny", *, warmup=None, max_queue=64, generation=None, ranking=None,
             **config):
    """The real app over a scheduler of `engine` (prefill chunks of 32, a budget of 40 tokens an
    iteration), and that scheduler. `model`: its served name(s); `generation`: the model's
    sampling defaults; `ranking`: a reranker's head; `config`: `ServerConfig`'s fields."""
    from cadence.checkpoints.generation import GenerationDefaults
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
    from cadence.server.app import ServerConfig, create_app

    sched = Scheduler(engine, tokenizer, SchedulerConfig(
        policy=PolicyConfig(token_budget=40, chunk=32), max_queue=max_queue))
    app = create_app(sched, tokenizer, model, config=ServerConfig(**config), warmup=warmup,
                     generation=generation or GenerationDefaults(), ranking=ranking)
    return app, sched


@contextlib.contextmanager
def loopback_server(app):
    """Runs an ASGI app under a real uvicorn server on a free loopback port, in a thread;
    yields its base URL ("http://127.0.0.1:PORT") and shuts it down (draining) afterwards."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


# XLA:CPU maps each compiled program's code into ~350 memory areas (a few per kernel), and the
# kernel allows a process 65530 (`vm.max_map_count`): past that the next compile crashes the
# process (a session that kept every program it compiled reached it at ~3/4 of the tier).
RELEASE_MAPS = 30_000  # after a module holding more, the session lets its programs go
MAX_MAPS = 50_000


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.fixture(scope="module", autouse=True)
def memory_maps_stay_bounded():
    """After each test module: past `RELEASE_MAPS` memory maps, every kept engine and every
    compiled program (jax.clear_caches: the reference's, the kernels', each engine's) is let
    go, to be compiled again (mostly from the persistent cache) by whichever test next needs
    it; then the process must be under `MAX_MAPS`, or the module that left programs alive is
    named, rather than a crash somewhere later."""
    yield
    if not Path("/proc/self/maps").exists():
        return
    maps = _maps()
    if maps > RELEASE_MAPS:
        _KEPT.clear()
        jax.clear_caches()
        gc.collect()
        maps = _maps()
    if os.environ.get("CADENCE_MAPS_LOG"):
        with open(os.environ["CADENCE_MAPS_LOG"], "a") as log:
            log.write(f"{maps}\n")
    assert maps <= MAX_MAPS, (
        f"the test process holds {maps} memory maps after this module (the kernel allows "
        f"65530): engines or compiled programs outlive their tests")
