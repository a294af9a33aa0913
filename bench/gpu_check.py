"""One prepared run on a GPU machine: the kernels compiled, greedy equality, and the timings.

    bench/gpu_check.sh                              # install, then everything below, < 10 min
    python -m cadence.bench.gpu_check               # the parts alone (cadence installed)
    python -m cadence.bench.gpu_check --dry_run     # on any machine: lower every program for CUDA

Each part runs as a subprocess of its own, with its own timeout, so one that fails, hangs or
crashes the process stops nothing else; its output goes to `<out_dir>/<part>.log`, what it
measured to `<out_dir>/<part>.json`, and the verdict of every part to `<out_dir>/summary.json`
(out_dir: `bench/results/gpu-<date>/` by default). The parts, in order:

- `env`: nvidia-smi, JAX's version and devices.
- `kernel_tests`: tests/test_pallas.py, test_paged_attention.py, test_mosaic_paged.py and
  test_pallas_quant.py compiled on the device (`CADENCE_PALLAS_INTERPRET=0`, float32 matmuls
  at full precision).
  (tests/test_gpu_lowering.py lowers every engine program for CUDA in CI, on any machine.)
- `greedy`: the engine (scheduler, chunked prefill, batched decode) with `attention="pallas"`
  in float32 gives the reference's greedy tokens (`engine.reference.greedy_generate`) on the
  default model, or, where it cannot be loaded (no network: the machine fetches nothing), on
  random weights of its shape.
- `engine_8b`, `engine_smollm2`: the GPU engine (bf16, Pallas kernels, paged KV) with random
  weights of Llama-3-8B's and SmolLM2-135M's shapes: one 4k-token prefill, and decode steps at
  1, 8 and 64 active slots at 1k context against the roofline (weights + live KV) / the copy
  bandwidth measured in the same process, with the compiles while timed (must be 0).
- `decode_probe`: the 8B step at 1 and 64 active slots, one step per dispatch and 8: whether
  a dispatch returns before its step is done (`model.control`).
- `kernels`: `bench.gpu_bench`'s kernel section (Pallas contiguous and paged, Triton and Mosaic
  GPU, against XLA and cuDNN's `jax.nn.dot_product_attention`, 4k prefill and decode at batch
  1/8/64 x 4k) and its grouped quantized matmul, under a deadline.

A part past its timeout is killed with every process it started, and prints its Python stack
first (`faulthandler`), so the log says where it was. The run ends with a digest of the
numbers (`digest`), which is what a lent machine's reply shows first.

`--rehearse` runs every part on any machine at the tiny model's shapes with interpreted kernels
(the kernel tests are only collected): it checks the script itself, so that a lent GPU's
minutes go to the GPU.

`--dry_run` runs none of that: it lowers every program of the GPU engine configuration
(`engine.lowering.gpu_engine_config`, 64 slots) for `cuda`, for both models, with the same
enumeration tests/test_gpu_lowering.py uses, and prints `lowered N programs` (N counts every
bucket of every program, once per kernel backend: Triton and Mosaic GPU) and each failure with
its error.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import json
import os
import signal
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
_KV_DTYPE = flags.DEFINE_string(
    "kv_dtype", None, "The engine parts' KV pool dtype (default: bfloat16, the compute dtype): "
    "float8_e4m3fn times decode over an 8-bit pool, in a call of its own.")
_REHEARSE = flags.DEFINE_bool(
    "rehearse", False, "Every part at the tiny model's shapes, kernels interpreted, on any machine.")

# Part -> timeout in seconds, in the order they run (what the targets rest on first). They
# sum to 530 s, leaving the install and a margin inside 10 min. On the first H200 run
# (bench/results/gpu-2026-12-04/) the kernel tests took 139 s from a cold compile cache and the
# 8B engine part 127 s, over a minute of it compiling the random weights as one program.
PARTS = {"env": 20, "kernel_tests": 150, "greedy": 60, "engine_8b": 120, "engine_smollm2": 50,
         "decode_probe": 60, "kernels": 70}
# The kernel backends of the dry run: the attention options with GPU kernels (Triton, Mosaic GPU).
KERNEL_BACKENDS = ("pallas", "mosaic")
# Lowering every program for CUDA (tests/test_gpu_lowering.py) runs in CI on any machine; a GPU's
# minutes go to what only it can run.
KERNEL_TESTS = ("tests/test_pallas.py", "tests/test_paged_attention.py", "tests/test_mosaic_paged.py",
                "tests/test_pallas_quant.py")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes the parts run at: a GPU's, or a rehearsal's (`--rehearse`)."""

    engine_models: dict  # part -> model preset
    greedy_model: str
    decode_active: tuple = (1, 8, 64)
    decode_context: int = 1024
    prefill_tokens: int = 4096


GPU = Sizes(engine_models={"engine_8b": "llama3-8b", "engine_smollm2": "smollm2-135m"},
            greedy_model="smollm2-135m")
REHEARSAL = Sizes(engine_models={"engine_8b": "tiny", "engine_smollm2": "tiny"}, greedy_model="tiny",
                  decode_active=(1, 2, 4), decode_context=40, prefill_tokens=48)


def sizes() -> Sizes:
    return REHEARSAL if _REHEARSE.value else GPU


def dry_run(models: list[str]) -> int:
    """Lowers every program of the GPU engine for CUDA; returns how many failed."""
    from cadence.engine.lowering import engine_programs, gpu_engine_config, lower_checked
    from cadence.model.config import PRESETS

    lowered, failed = 0, []
    for name in models:
        for backend in KERNEL_BACKENDS:
            start = time.monotonic()
            programs = engine_programs(PRESETS[name], gpu_engine_config(attention=backend))
            for program in programs:
                try:
                    lower_checked(program, "cuda")
                    lowered += 1
                except Exception as e:  # noqa: BLE001 - report every failure, lower the rest
                    failed.append(f"{name} {backend} {program.name}: {type(e).__name__}: {e}")
            print(f"{name}, {backend} kernels: {len(programs)} programs, "
                  f"{time.monotonic() - start:.0f} s", flush=True)
    for line in failed:
        print("FAILED", line)
    print(f"lowered {lowered} programs" + (f", {len(failed)} failed" if failed else ""))
    return len(failed)


# -- the parts, each run in a process of its own ------------------------------------------------

def part_env(out: Path) -> dict:
    import jax

    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        smi = f"nvidia-smi: {type(e).__name__}: {e}"
    print(smi)
    return {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
            "backend": jax.default_backend(), "python": sys.version.split()[0],
            "nvidia_smi": smi[-3000:]}


def part_kernel_tests(out: Path) -> dict:
    env = dict(os.environ, CADENCE_PALLAS_INTERPRET="0", JAX_DEFAULT_MATMUL_PRECISION="highest")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
           f"--junitxml={out / 'kernel_tests.xml'}", *KERNEL_TESTS,
           *(["--collect-only"] if _REHEARSE.value else [])]
    done = subprocess.run(cmd, env=env)
    return {"passed": done.returncode == 0, "returncode": done.returncode}


def _random_params(config, dtype):
    import jax
    import numpy as np

    from cadence.model.params import random_params

    return jax.tree.map(np.asarray, random_params(
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

        if _GREEDY_RANDOM.value or _REHEARSE.value:
            raise RuntimeError("--greedy_random or --rehearse")
        model = load_model("smollm2-135m")
        params, config, tokenizer, eos = model.params, model.config, model.tokenizer, model.tokenizer.eos_ids
        prompts = [tokenizer.encode("The capital of France is"),
                   tokenizer.encode("def fibonacci(n):\n    " * 6)]
        source = "smollm2-135m"
    except Exception as e:  # noqa: BLE001 - no network here: the same shape, random weights
        print(f"default model unavailable ({type(e).__name__}: {e}); random weights of its shape")
        config = PRESETS[_GREEDY_RANDOM.value or sizes().greedy_model]
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


def _engine_part(part: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cadence.bench import gpu_timing, roofline
    from cadence.engine.config import fixed_page_tables
    from cadence.engine.engine import Engine
    from cadence.engine.lowering import gpu_engine_config
    from cadence.engine.packing import PrefillChunk
    from cadence.engine.programs import sampling_rows
    from cadence.model.config import PRESETS
    from cadence.model.params import random_params
    from cadence.model.host_sampling import RequestSampling

    size = sizes()
    model = size.engine_models[part]
    cfg = PRESETS[model]
    ceilings = gpu_timing.measure_ceilings(smoke=_REHEARSE.value)
    print("ceilings", json.dumps(ceilings), flush=True)
    t0 = time.monotonic()
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    print(f"random params: {time.monotonic() - t0:.1f} s", flush=True)
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    slots = max(size.decode_active)
    engine = Engine(params, cfg, gpu_engine_config(num_slots=slots, max_seq_len=size.prefill_tokens + 32,
                                                   prefill_chunk=size.prefill_tokens,
                                                   kv_dtype=_KV_DTYPE.value))
    del params
    print(f"engine: {time.monotonic() - t0:.1f} s", flush=True)
    result = {"model": model, "kv_dtype": engine.config.pool_dtype, "ceilings": ceilings,
              "weight_bytes": weight_bytes,
              "kv_cache_bytes": engine.kv_cache_bytes, "decode": []}
    tables = fixed_page_tables(engine.config)
    rows = sampling_rows([RequestSampling()] * slots)
    prompt = np.random.default_rng(0).integers(100, cfg.vocab_size, size.prefill_tokens).tolist()
    chunk = [PrefillChunk(0, prompt, 0, True, tables[0])]
    start = time.monotonic()
    engine.prefill(chunk, rows).block_until_ready()
    first = time.monotonic() - start
    seconds = roofline.timed(lambda: engine.prefill(chunk, rows), repeats=3)
    result["prefill"] = {"tokens": size.prefill_tokens, "first_call_s": first, "ms": seconds * 1e3,
                         "tokens_per_s": size.prefill_tokens / seconds}
    print("prefill", json.dumps(result["prefill"]), flush=True)
    for active in size.decode_active:
        point = gpu_timing.roofline_point(engine, active, size.decode_context, rows, tables, weight_bytes,
                                         cfg.kv_bytes_per_token(jnp.dtype(engine.config.pool_dtype).itemsize),
                                         ceilings)
        point["tokens_per_s"] = active / (point["step_ms"] / 1e3)
        result["decode"].append(point)
        print("decode", json.dumps(point), flush=True)
    return result


def part_engine_smollm2(out: Path) -> dict:
    return _engine_part("engine_smollm2")


def part_engine_8b(out: Path) -> dict:
    return _engine_part("engine_8b")


def part_decode_probe(out: Path) -> dict:
    """Where a decode step's time goes: the 8B engine's step (the smollm2 one's in a rehearsal)
    at 1 and 64 active slots, one step per dispatch and 8, under this process's XLA_FLAGS. A
    dispatch that returns only once the step is done (host fraction ~1) waits on the device
    inside the program (a loop's or a branch's predicate read back); 8 steps per dispatch
    then cost the host once."""
    import jax
    import jax.numpy as jnp

    from cadence.bench import gpu_timing
    from cadence.engine.config import fixed_page_tables
    from cadence.engine.engine import Engine
    from cadence.engine.lowering import gpu_engine_config
    from cadence.engine.programs import sampling_rows
    from cadence.model.config import PRESETS
    from cadence.model.host_sampling import RequestSampling
    from cadence.model.params import random_params

    size = sizes()
    cfg = PRESETS[size.engine_models["engine_8b"]]
    slots, context, k = max(size.decode_active), size.decode_context, 8
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    engine = Engine(params, cfg, gpu_engine_config(num_slots=slots, max_seq_len=context + 2 * k,
                                                   prefill_chunk=16, decode_steps=k))
    del params
    tables = fixed_page_tables(engine.config)
    greedy = sampling_rows([RequestSampling()] * slots)
    # Off the CPU every sampling stage runs whatever the rows ask (`model.control.when`): a
    # batch sampling with top-k and top-p against an all-greedy one prices that.
    sampled = sampling_rows([RequestSampling(temperature=0.7, top_k=50, top_p=0.9, seed=1)] * slots)
    points = []
    for active, steps, rows in [(1, 1, greedy), (1, k, greedy), (slots, 1, greedy), (slots, k, greedy),
                                (slots, 1, sampled)]:
        step, dispatch, compiles = gpu_timing.time_decode(engine, active, context, rows, tables,
                                                         steps=10, k=steps)
        points.append({"active": active, "steps_per_dispatch": steps, "sampled": rows is sampled,
                       "step_ms": step * 1e3, "dispatch_ms": dispatch * 1e3,
                       "tokens_per_s": active / step, "compiles": compiles})
        print("probe", json.dumps(points[-1]), flush=True)
    return {"model": cfg.name, "xla_flags": os.environ.get("XLA_FLAGS", ""), "points": points}


def part_kernels(out: Path) -> dict:
    size = sizes()
    cmd = [sys.executable, "-m", "cadence.bench.gpu_bench", f"--out={out / 'gpu_bench.json'}",
           "--skip_tests", "--skip_engine", "--nosweep", f"--prefill_tokens={size.prefill_tokens}",
           "--decode_batches=" + ",".join(map(str, size.decode_active)), "--decode_contexts=4096",
           f"--deadline_s={PARTS['kernels'] - 20}", "--tp=1", *(["--smoke"] if _REHEARSE.value else [])]
    done = subprocess.run(cmd)
    return {"returncode": done.returncode, "results": "gpu_bench.json"}


def run_part(name: str, out: Path) -> None:
    """One part in this process: its result, or its error, into <out>/<name>.json."""
    start = time.monotonic()
    if PARTS.get(name, 0) > 10:  # a part that hangs prints where, just before the driver kills it
        faulthandler.dump_traceback_later(PARTS[name] - 5, exit=False)
    try:
        result = {"ok": True, **globals()[f"part_{name}"](out)}
    except Exception as e:  # noqa: BLE001 - the driver reads the error from the file
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    result["seconds"] = time.monotonic() - start
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))


def drive(out: Path, parts: list[str], rehearse: bool = False, kv_dtype: str | None = None) -> dict:
    """Every part in a subprocess of its own, each under its timeout (the engine parts over a
    pool of `kv_dtype`); returns the summary."""
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "parts": {}}
    for name in parts:
        start = time.monotonic()
        cmd = [sys.executable, "-m", "cadence.bench.gpu_check", f"--part={name}", f"--out_dir={out}",
               *(["--rehearse"] if rehearse else []), *([f"--kv_dtype={kv_dtype}"] if kv_dtype else [])]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(out / f"{name}.log", "w") as log:
            # A session of its own: a part past its timeout goes with every process it started
            # (a pytest still holding the GPU's memory would starve the parts after it).
            part = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                code = part.wait(timeout=PARTS[name])
            except subprocess.TimeoutExpired:
                os.killpg(part.pid, signal.SIGKILL)
                part.wait()
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


def _read(out: Path, name: str) -> dict:
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return {}


def digest(out: Path) -> list[str]:
    """The run's numbers in a few lines (what a lent machine's reply carries back first)."""
    lines = [f"{name}: FAILED ({part['exit']}) {part.get('error', '')}"[:400]
             for name, part in _read(out, "summary.json").get("parts", {}).items() if not part["ok"]]
    env = _read(out, "env.json")
    lines.append(f"JAX {env.get('jax')} on {env.get('devices')}")
    tests = out / "kernel_tests.log"
    if tests.exists():
        tail = [line for line in tests.read_text().splitlines() if line.strip()][-1:]
        lines.append(f"kernel tests: {tail[0] if tail else '?'}")
    greedy = _read(out, "greedy.json")
    if "equal" in greedy:
        lines.append(f"greedy ({greedy.get('weights')}): engine == reference: {greedy['equal']}")
    for part in ("engine_8b", "engine_smollm2"):
        e = _read(out, f"{part}.json")
        if e.get("prefill"):
            lines.append(f"{e['model']}: prefill {e['prefill']['tokens']} tokens {e['prefill']['ms']:.1f} ms "
                         f"(first call {e['prefill']['first_call_s']:.1f} s)")
        for d in e.get("decode", []):
            lines.append(f"{e['model']}: decode {d['active']:>2} active @ {d['context']}: "
                         f"{d['step_ms']:.2f} ms/step, {d['tokens_per_s']:.0f} tok/s, "
                         f"{d['ratio_to_roofline']:.2f}x roofline, host {d['host_fraction']:.2f}, "
                         f"compiles {d['compilations_while_timed']}")
        if e.get("ceilings"):
            c = e["ceilings"]
            lines.append(f"ceilings: copy {c['copy_gb_s']:.0f} GB/s, bf16 matmul {c['bf16_matmul_tflop_s']:.0f} TFLOP/s")
    probe = _read(out, "decode_probe.json")
    for d in probe.get("points", []):
        lines.append(f"probe {probe['model']} [{probe['xla_flags'][-60:]}]: {d['active']:>2} active, "
                     f"{'sampled' if d.get('sampled') else 'greedy'}, "
                     f"{d['steps_per_dispatch']} steps/dispatch: {d['step_ms']:.2f} ms/step, "
                     f"dispatch {d['dispatch_ms']:.2f} ms, {d['tokens_per_s']:.0f} tok/s")
    for name, target in _read(out, "gpu_bench.json").get("targets", {}).items():
        lines.append(f"{name}: {target['value']:.3g} (target {target['target']}, met {target['met']})")
    return lines


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
    drive(out, [p for p in PARTS if not _ONLY.value or p in _ONLY.value], rehearse=_REHEARSE.value,
          kv_dtype=_KV_DTYPE.value)
    print("\n".join(digest(out)))


if __name__ == "__main__":
    app.run(main)
