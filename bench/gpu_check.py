"""One prepared run on a GPU machine: the kernels compiled, greedy equality, and the timings.

    bench/gpu_check.sh                              # install, then everything below, < 10 min
    python -m cadence.bench.gpu_check               # the parts alone (cadence installed)
    python -m cadence.bench.gpu_check --dry_run     # on any machine: lower every program for CUDA

Each part runs as a subprocess of its own, with its own timeout, so one that fails, hangs or
crashes the process stops nothing else; its output goes to `<out_dir>/<part>.log`, what it
measured to `<out_dir>/<part>.json`, and the verdict of every part to `<out_dir>/summary.json`
(out_dir: `bench/results/gpu-<date>/` by default). The parts, in order:

- `env`: nvidia-smi, JAX's version and devices.
- `kernel_tests`: tests/test_pallas.py, test_paged_attention.py and test_pallas_quant.py
  compiled on the device (`CADENCE_PALLAS_INTERPRET=0`, float32 matmuls at full precision),
  and tests/test_gpu_lowering.py (every engine program lowered for CUDA).
- `greedy`: the engine (scheduler, chunked prefill, batched decode) with `attention="pallas"`
  in float32 gives the reference's greedy tokens (`engine.reference.greedy_generate`) on the
  default model, or, where it cannot be loaded (no network: the machine fetches nothing), on
  random weights of its shape.
- `engine_smollm2`, `engine_8b`: the GPU engine (bf16, Pallas kernels, paged KV) with random
  weights of SmolLM2-135M's and Llama-3-8B's shapes: one 4k-token prefill, and decode steps at
  1, 8 and 64 active slots at 1k context against the roofline (weights + live KV) / the copy
  bandwidth measured in the same process, with the compiles while timed (must be 0).
- `kernels`: `bench.gpu_bench`'s kernel section (Pallas contiguous and paged against XLA and
  cuDNN's `jax.nn.dot_product_attention`, 4k prefill and decode at batch 1/8/64 x 4k) and its
  grouped quantized matmul, under a deadline.

`--dry_run` runs none of that: it lowers every program of the GPU engine configuration
(`engine.lowering.gpu_engine_config`, 64 slots) for `cuda`, for both models, with the same
enumeration tests/test_gpu_lowering.py uses, and prints `lowered N programs` (N counts every
bucket of every program, once per kernel backend: Triton, the only one so far) and each
failure with its error.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from absl import app, flags

_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where results go (default bench/results/gpu-<date>).")
_PART = flags.DEFINE_string("part", None, "Run this one part in this process (what the driver starts).")
_ONLY = flags.DEFINE_list("only", [], "Run only these parts (default: all).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Lower every GPU program for CUDA instead of running.")
_GREEDY_RANDOM = flags.DEFINE_string(
    "greedy_random", None, "greedy on random weights of this preset, not the default model's.")
_MODELS = flags.DEFINE_list("models", ["smollm2-135m", "llama3-8b"], "Models of the dry run.")

# Part -> timeout in seconds. They sum to 500 s, leaving the install and a margin inside 10 min.
PARTS = {"env": 30, "kernel_tests": 130, "greedy": 80, "engine_smollm2": 70, "engine_8b": 110,
         "kernels": 80}
KERNEL_TESTS = ("tests/test_pallas.py", "tests/test_paged_attention.py", "tests/test_pallas_quant.py",
                "tests/test_gpu_lowering.py")
DECODE_ACTIVE = (1, 8, 64)
DECODE_CONTEXT = 1024
PREFILL_TOKENS = 4096


def dry_run(models: list[str]) -> int:
    """Lowers every program of the GPU engine for CUDA; returns how many failed."""
    from cadence.engine.lowering import engine_programs, gpu_engine_config, lower_checked
    from cadence.model.config import PRESETS

    lowered, failed = 0, []
    for name in models:
        start = time.monotonic()
        programs = engine_programs(PRESETS[name], gpu_engine_config())
        for program in programs:
            try:
                lower_checked(program, "cuda")
                lowered += 1
            except Exception as e:  # noqa: BLE001 - report every failure, lower the rest
                failed.append(f"{name} {program.name}: {type(e).__name__}: {e}")
        print(f"{name}: {len(programs)} programs, {time.monotonic() - start:.0f} s", flush=True)
    for line in failed:
        print("FAILED", line)
    print(f"lowered {lowered} programs" + (f", {len(failed)} failed" if failed else ""))
    return len(failed)


# -- the parts, each run in a process of its own ------------------------------------------------

def part_env(out: Path) -> dict:
    import jax

    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
    print(smi.stdout)
    return {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
            "backend": jax.default_backend(), "python": sys.version.split()[0],
            "nvidia_smi": smi.stdout[-3000:]}


def part_kernel_tests(out: Path) -> dict:
    env = dict(os.environ, CADENCE_PALLAS_INTERPRET="0", JAX_DEFAULT_MATMUL_PRECISION="highest")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
           f"--junitxml={out / 'kernel_tests.xml'}", *KERNEL_TESTS]
    done = subprocess.run(cmd, env=env)
    return {"passed": done.returncode == 0, "returncode": done.returncode}


def _random_params(config, dtype):
    import jax
    import numpy as np

    from cadence.model.params import random_params

    return jax.tree.map(np.asarray, jax.jit(random_params, static_argnums=(0, 2))(
        config, jax.random.key(0), dtype))


def part_greedy(out: Path) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cadence.engine.config import EngineConfig
    from cadence.engine.engine import Engine
    from cadence.engine.reference import greedy_generate
    from cadence.model.config import PRESETS
    from cadence.scheduler.policy import PolicyConfig
    from cadence.scheduler.request import GenerationParams
    from cadence.scheduler.scheduler import Scheduler, SchedulerConfig

    jax.config.update("jax_default_matmul_precision", "highest")  # float32 as the reference's
    try:
        from cadence.checkpoints.registry import load_model

        if _GREEDY_RANDOM.value:
            raise RuntimeError("--greedy_random")
        model = load_model("smollm2-135m")
        params, config, tokenizer, eos = model.params, model.config, model.tokenizer, model.tokenizer.eos_ids
        prompts = [tokenizer.encode("The capital of France is"),
                   tokenizer.encode("def fibonacci(n):\n    " * 6)]
        source = "smollm2-135m"
    except Exception as e:  # noqa: BLE001 - no network here: the same shape, random weights
        print(f"default model unavailable ({type(e).__name__}: {e}); random weights of its shape")
        config = PRESETS[_GREEDY_RANDOM.value or "smollm2-135m"]
        params = _random_params(config, jnp.float32)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(100, config.vocab_size, n).tolist() for n in (5, 90)]
        tokenizer, eos, source = _id_tokenizer(config.vocab_size), (), f"random {config.name}-shaped weights"
    cases = [(p, greedy_generate(params, config, p, 12, eos)) for p in prompts]
    engine = Engine(params, config, EngineConfig(num_slots=2, max_seq_len=256, prefill_chunk=64,
                                                 attention="pallas"))
    sched = Scheduler(engine, tokenizer, SchedulerConfig(policy=PolicyConfig(token_budget=66, chunk=64)))
    streams = [sched.submit(p, GenerationParams(max_tokens=12)) for p, _ in cases]
    while not sched.idle():
        sched.step()
    got = [s.request.output_ids for s in streams]
    return {"weights": source, "equal": got == [w for _, w in cases],
            "engine": got, "reference": [w for _, w in cases]}


def _id_tokenizer(vocab: int):
    """A tokenizer of `vocab` pieces of one byte each and no EOS: the scheduler's streams need
    one; random weights have no text."""
    from cadence.checkpoints.tokenizer import Tokenizer

    return Tokenizer(pieces=[f"<{i}>" for i in range(vocab)], piece_bytes=[b"."] * vocab, added={},
                     special=set(), bos=None, eos=[], add_bos=False, chat_template=None, space_mode=0)


def _engine_part(model: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cadence.bench import gpu_bench, roofline
    from cadence.engine.config import fixed_page_tables
    from cadence.engine.engine import Engine
    from cadence.engine.lowering import gpu_engine_config
    from cadence.engine.packing import PrefillChunk
    from cadence.engine.programs import sampling_rows
    from cadence.model.config import PRESETS
    from cadence.model.params import random_params
    from cadence.model.host_sampling import RequestSampling

    cfg = PRESETS[model]
    ceilings = gpu_bench.measure_ceilings()
    print("ceilings", json.dumps(ceilings), flush=True)
    params = jax.jit(random_params, static_argnums=(0, 2))(cfg, jax.random.key(0), jnp.bfloat16)
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    slots = max(DECODE_ACTIVE)
    engine = Engine(params, cfg, gpu_engine_config(num_slots=slots, max_seq_len=PREFILL_TOKENS + 32,
                                                   prefill_chunk=PREFILL_TOKENS))
    del params
    result = {"model": model, "ceilings": ceilings, "weight_bytes": weight_bytes,
              "kv_cache_bytes": engine.kv_cache_bytes, "decode": []}
    tables = fixed_page_tables(engine.config)
    rows = sampling_rows([RequestSampling()] * slots)
    prompt = np.random.default_rng(0).integers(100, cfg.vocab_size, PREFILL_TOKENS).tolist()
    chunk = [PrefillChunk(0, prompt, 0, True, tables[0])]
    start = time.monotonic()
    engine.prefill(chunk, rows).block_until_ready()
    first = time.monotonic() - start
    seconds = roofline.timed(lambda: engine.prefill(chunk, rows), repeats=3)
    result["prefill"] = {"tokens": PREFILL_TOKENS, "first_call_s": first, "ms": seconds * 1e3,
                         "tokens_per_s": PREFILL_TOKENS / seconds}
    print("prefill", json.dumps(result["prefill"]), flush=True)
    for active in DECODE_ACTIVE:
        point = gpu_bench.roofline_point(engine, active, DECODE_CONTEXT, rows, tables, weight_bytes,
                                         cfg.kv_bytes_per_token(2), ceilings)
        point["tokens_per_s"] = active / (point["step_ms"] / 1e3)
        result["decode"].append(point)
        print("decode", json.dumps(point), flush=True)
    return result


def part_engine_smollm2(out: Path) -> dict:
    return _engine_part("smollm2-135m")


def part_engine_8b(out: Path) -> dict:
    return _engine_part("llama3-8b")


def part_kernels(out: Path) -> dict:
    cmd = [sys.executable, "-m", "cadence.bench.gpu_bench", f"--out={out / 'gpu_bench.json'}",
           "--skip_tests", "--skip_engine", "--nosweep", f"--prefill_tokens={PREFILL_TOKENS}",
           "--decode_batches=" + ",".join(map(str, DECODE_ACTIVE)), "--decode_contexts=4096",
           f"--deadline_s={PARTS['kernels'] - 20}", "--tp=1"]
    done = subprocess.run(cmd)
    return {"returncode": done.returncode, "results": "gpu_bench.json"}


def run_part(name: str, out: Path) -> None:
    """One part in this process: its result, or its error, into <out>/<name>.json."""
    start = time.monotonic()
    try:
        result = {"ok": True, **globals()[f"part_{name}"](out)}
    except Exception as e:  # noqa: BLE001 - the driver reads the error from the file
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    result["seconds"] = time.monotonic() - start
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))


def drive(out: Path, parts: list[str]) -> dict:
    """Every part in a subprocess of its own, each under its timeout; returns the summary."""
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "parts": {}}
    for name in parts:
        start = time.monotonic()
        cmd = [sys.executable, "-m", "cadence.bench.gpu_check", f"--part={name}", f"--out_dir={out}"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(out / f"{name}.log", "w") as log:
            try:
                code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      timeout=PARTS[name]).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        try:
            result = json.loads((out / f"{name}.json").read_text())
        except (OSError, ValueError):
            result = {"ok": False}
        ok = code == 0 and result.get("ok", False) and result.get("passed", True) \
            and result.get("equal", True) and result.get("returncode", 0) == 0
        summary["parts"][name] = {"ok": bool(ok), "exit": code, "seconds": round(time.monotonic() - start, 1),
                                  **({"error": result["error"]} if "error" in result else {})}
        print(f"{name}: {'ok' if ok else 'FAILED'} ({summary['parts'][name]['seconds']} s, exit {code})",
              flush=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv) -> None:
    del argv
    if _DRY_RUN.value:
        sys.exit(1 if dry_run(_MODELS.value) else 0)
    date = datetime.date.today().isoformat()
    out = Path(_OUT_DIR.value or f"bench/results/gpu-{date}")
    out.mkdir(parents=True, exist_ok=True)
    if _PART.value:
        run_part(_PART.value, out)
        return
    unknown = set(_ONLY.value) - set(PARTS)
    if unknown:
        raise app.UsageError(f"unknown parts {sorted(unknown)}; the parts: {list(PARTS)}")
    drive(out, [p for p in PARTS if not _ONLY.value or p in _ONLY.value])


if __name__ == "__main__":
    app.run(main)
