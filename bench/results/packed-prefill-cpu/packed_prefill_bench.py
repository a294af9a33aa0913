"""Short prompts arriving together: packed prefill against one program per chunk.

    python bench/results/packed-prefill-cpu/packed_prefill_bench.py --model=smollm2-135m --counts=4,8,16 --rounds=3 \
        --out=bench/results/packed-prefill-cpu/packed_prefill.json

N short prompts (seeded lengths in `--prompt_tokens`) are submitted at the same instant to the
real scheduler and engine (no HTTP), each asking for one token, and the scheduler steps until
every one has its first token. Two engines, identical but for `max_prefill_chunks`:
    packed   every chunk an iteration plans in one program (the default),
    alone    one program per chunk (max_prefill_chunks=1), as cadence ran before packing;
the scheduler plans the same chunks for both (the chunked policy's budget is one program's worth
of padded tokens). Reported per N, as medians over rounds (modes alternate within a round):
time to every first token (the last TTFT), median TTFT, prefill programs, iterations.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from cadence.checkpoints.registry import load_model
from cadence.engine import compile_counter
from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model to benchmark.")
_COUNTS = flags.DEFINE_list("counts", ["4", "8", "16"], "Prompts arriving together.")
_PROMPT = flags.DEFINE_list("prompt_tokens", ["16", "128"], "Prompt lengths: low,high (uniform).")
_CHUNK = flags.DEFINE_integer("chunk", 256, "The engine's prefill_chunk and the policy's chunk.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds; each runs both modes at every N.")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt seed.")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results.")

MODES = {"packed": None, "alone": 1}


def run_once(engine: Engine, tokenizer, prompts: list[list[int]]) -> dict:
    cfg = engine.config
    policy = PolicyConfig(name="chunked", token_budget=cfg.prefill_chunk + cfg.num_slots, chunk=cfg.prefill_chunk)
    sched = Scheduler(engine, tokenizer, SchedulerConfig(policy=policy))
    iterations = []
    sched.iteration_listeners.append(iterations.append)
    params = GenerationParams(max_tokens=1, ignore_eos=True)
    streams = [sched.submit(p, params) for p in prompts]
    while not sched.idle():
        sched.step()
    records = [list(s)[-1] for s in streams]
    ttft = sorted(r.first_token - r.submitted for r in records)
    return {"ttft_last_s": ttft[-1], "ttft_p50_s": float(np.median(ttft)),
            "prefill_programs": sched.prefill_programs, "prefill_chunks": sched.prefill_chunks,
            "iterations": len(iterations)}


def main(argv) -> None:
    del argv
    model = load_model(_MODEL.value)
    counts = [int(n) for n in _COUNTS.value]
    low, high = (int(x) for x in _PROMPT.value)
    rng = np.random.default_rng(_SEED.value)
    prompts = {n: [rng.integers(100, model.config.vocab_size, rng.integers(low, high + 1)).tolist()
                   for _ in range(n)] for n in counts}
    engines = {}
    for mode, max_chunks in MODES.items():
        start = time.monotonic()
        engine = Engine(model.params, model.config, EngineConfig(
            num_slots=max(counts), max_seq_len=512, prefill_chunk=_CHUNK.value,
            max_prefill_chunks=max_chunks))
        for n in counts:  # an untimed round compiles the programs these runs use (no full warm-up)
            run_once(engine, model.tokenizer, prompts[n])
        engines[mode] = engine
        print(f"{mode}: compiled in {time.monotonic() - start:.0f} s")
    compiled = compile_counter.count()
    runs = {mode: {n: [] for n in counts} for mode in MODES}
    for round_ in range(_ROUNDS.value):
        order = list(MODES) if round_ % 2 == 0 else list(MODES)[::-1]
        for n in counts:
            for mode in order:
                runs[mode][n].append(run_once(engines[mode], model.tokenizer, prompts[n]))
    assert compile_counter.count() == compiled, "a timed run compiled a program"
    table = []
    print(f"{'N':>3} {'tokens':>6} | {'mode':<6} {'every first token':>17} {'TTFT p50':>9} "
          f"{'programs':>8} {'iterations':>10}")
    for n in counts:
        tokens = sum(map(len, prompts[n]))
        row = {"prompts": n, "prompt_tokens": tokens}
        for mode in MODES:
            point = {key: float(np.median([r[key] for r in runs[mode][n]])) for key in runs[mode][n][0]}
            row[mode] = point
            print(f"{n:>3} {tokens:>6} | {mode:<6} {point['ttft_last_s']:>15.3f} s {point['ttft_p50_s']:>7.3f} s "
                  f"{point['prefill_programs']:>8.0f} {point['iterations']:>10.0f}")
        row["speedup_every_first_token"] = row["alone"]["ttft_last_s"] / row["packed"]["ttft_last_s"]
        print(f"{'':>10} packed reaches every first token {row['speedup_every_first_token']:.2f}x sooner")
        table.append(row)
    report = {
        "command": "python bench/results/packed-prefill-cpu/packed_prefill_bench.py " + " ".join(
            f"--{k}={v}" for k, v in (("model", _MODEL.value), ("counts", ",".join(_COUNTS.value)),
                                      ("prompt_tokens", ",".join(_PROMPT.value)), ("chunk", _CHUNK.value),
                                      ("rounds", _ROUNDS.value), ("seed", _SEED.value))),
        "model": _MODEL.value, "table": table, "runs": runs,
        "prompt_lengths": {n: list(map(len, p)) for n, p in prompts.items()},
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "device": str(jax.devices()[0]), "jax": jax.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if _OUT.value:
        Path(_OUT.value).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    app.run(main)
