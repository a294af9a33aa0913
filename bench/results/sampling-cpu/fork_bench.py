"""What n > 1 saves: one prompt's n choices as a group (one prefill, the others forking its KV)
against n separate requests with that prompt, on the engine and scheduler of `cadence-serve`.

    python bench/results/sampling-cpu/fork_bench.py --model=smollm2-135m --n=4 --prompt_tokens=1000 --choice_tokens=32

Both runs sample the same n sequences (choice i's seed is `parsing.choice_seed(seed, i)` in
both), so they produce the same tokens; the prefix cache is off, so the separate requests
compute the prompt n times, as a server without `n` would make a client do. Reports, per run:
prompt tokens prefilled, time to the last choice's first token, time to the end, and whether
the outputs agree. Prints one JSON line.
"""

from __future__ import annotations

import datetime
import json
import platform
import time

import jax
from absl import app, flags

from cadence.checkpoints.registry import load_model
from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.model import cpu_kernels
from cadence.model.host_sampling import RequestSampling
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams, RequestRecord
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from cadence.server.parsing import choice_seed

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model to serve.")
_N = flags.DEFINE_integer("n", 4, "Choices of the prompt.")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 1000, "Prompt length.")
_TOKENS = flags.DEFINE_integer("choice_tokens", 32, "Tokens per choice.")
_CHUNK = flags.DEFINE_integer("chunk", 256, "Prefill chunk (and token budget) per iteration.")


def run(engine: Engine, tokenizer, prompt: list[int], params: list[GenerationParams], group: bool) -> dict:
    sched = Scheduler(engine, tokenizer, SchedulerConfig(
        policy=PolicyConfig(name="chunked", token_budget=_CHUNK.value + engine.config.num_slots,
                            chunk=_CHUNK.value), prefix_caching=False))
    prefilled = []
    sched.iteration_listeners.append(lambda record: prefilled.append(record.prefill_tokens))
    sched.start()
    start = time.monotonic()
    if group:
        streams = sched.submit_group(prompt, params, [None] * len(params))
    else:
        streams = [sched.submit(prompt, p) for p in params]
    records = [[e for e in s if isinstance(e, RequestRecord)][0] for s in streams]
    end = time.monotonic()
    sched.stop(drain=True, timeout=60)
    return {"prefill_tokens": sum(prefilled), "last_first_token_s": max(r.first_token for r in records) - start,
            "seconds": end - start, "outputs": [s.request.output_ids for s in streams]}


def main(argv) -> None:
    del argv
    model = load_model(_MODEL.value)
    kernels = dict(attention="cpu", decode_matmul="cpu") if cpu_kernels.available() else {}
    engine = Engine(model.params, model.config, EngineConfig(
        num_slots=_N.value, max_seq_len=_PROMPT.value + _TOKENS.value + 64, prefill_chunk=_CHUNK.value,
        prefill_tokens=_CHUNK.value + _N.value, **kernels))
    engine.warmup()
    prompt = model.tokenizer.encode("The history of the Roman Empire spans many centuries. " * 200)[: _PROMPT.value]
    params = [GenerationParams(max_tokens=_TOKENS.value, ignore_eos=True,
                               sampling=RequestSampling(temperature=0.7, top_p=0.9, seed=choice_seed(7, i)))
              for i in range(_N.value)]
    run(engine, model.tokenizer, prompt[:64], params, True)  # first runs of the programs, untimed
    separate = run(engine, model.tokenizer, prompt, params, False)
    grouped = run(engine, model.tokenizer, prompt, params, True)
    report = {"model": _MODEL.value, "n": _N.value, "prompt_tokens": len(prompt), "max_tokens": _TOKENS.value,
              "same_outputs": separate.pop("outputs") == grouped.pop("outputs"),
              "separate": separate, "group": grouped, "kernels": bool(kernels),
              "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
              "jax_version": jax.__version__, "date": datetime.date.today().isoformat()}
    print(json.dumps(report))


if __name__ == "__main__":
    app.run(main)
