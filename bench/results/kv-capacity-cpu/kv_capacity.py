"""KV capacity at equal memory: contiguous slots (max_seq_len reserved per request) vs pages.

    python bench/results/kv-capacity-cpu/kv_capacity.py --kv_cache_memory=1440MiB --num_slots=32 --max_seq_len=4096 \
        --out=bench/results/kv-capacity-cpu/kv_capacity.json

The engine flags are every front door's (`server/flags.py`): --model, --num_slots,
--max_seq_len, --kv_cache_memory, --page_size, --prefill_chunk, --dtype, --attention.

One engine (one KV pool of the given bytes, warmed up once) serves the same burst of the
seed's mixed load twice, in process: chats and long documents submitted together, greedy, with
fixed output lengths (ignore_eos), so both runs do the same work. The runs differ only in
how the scheduler reserves KV:
- `max`: every request holds max_seq_len tokens' worth of pages from its first chunk on, which
  is what a contiguous slot costs (vLLM's "Orca (Max)"); the pool then holds pool/max_seq_len
  sequences, as today's 8 slots x 4096 tokens did;
- `live`: a request holds the pages its written tokens fill, growing a page at a time, with
  preemption (recompute) if the pool runs dry.

Reported per run: concurrent sequences (peak and mean over iterations), KV pages held and the
fraction of held token slots holding a real token (page utilization), preemptions, aggregate
output throughput over the run, and per class TTFT and inter-token gaps, all from the
scheduler's own records (server side, no HTTP). A burst is not an open-loop arrival process:
it measures how much concurrency the memory allows, not latency under a steady load.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from cadence.bench.workload import ClassSpec, WorkloadSpec
from cadence.checkpoints.registry import load_model
from cadence.engine.engine import Engine
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams, RequestRecord
from cadence.scheduler.scheduler import IterationRecord, Scheduler, SchedulerConfig
from cadence.server import runtime
from cadence.server.flags import MODEL_FLAG

_CHATS = flags.DEFINE_integer("chats", 28, "Chat requests in the burst.")
_DOCS = flags.DEFINE_integer("documents", 4, "Document requests in the burst.")
_RESERVATIONS = flags.DEFINE_list("reservations", ["max", "live"], "Runs, in order.")
_OUT = flags.DEFINE_string("out", None, "JSON results file.")


def burst(tokenizer, chats: int, documents: int) -> list[tuple[str, list[int], int]]:
    spec = WorkloadSpec(classes=(ClassSpec.chat(concurrency=1),
                                 ClassSpec.document(concurrency=1, prompt_tokens=(2000, 3500))), seed=0)
    out = []
    for name, count in (("chat", chats), ("document", documents)):
        for _, request in zip(range(count), spec.requests(name)):
            text = tokenizer.apply_chat_template([{"role": "user", "content": request.prompt}])
            out.append((name, tokenizer.encode(text), request.max_tokens))
    return out


def percentile(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def run(engine: Engine, tokenizer, requests, reservation: str) -> dict:
    cfg = engine.config
    policy = PolicyConfig(token_budget=cfg.prefill_chunk + cfg.num_slots, chunk=cfg.prefill_chunk)
    sched = Scheduler(engine, tokenizer, SchedulerConfig(policy=policy, max_queue=len(requests),
                                                         kv_reservation=reservation))
    samples: list[tuple[int, int, float]] = []  # per iteration: running, pages held, utilization
    records: list[RequestRecord] = []
    done = threading.Event()

    def on_iteration(record: IterationRecord) -> None:  # scheduler thread: state is consistent
        samples.append((sched.num_running, sched.kv_pages[0], sched.kv_page_utilization))

    def on_request(record: RequestRecord) -> None:
        records.append(record)
        if len(records) == len(requests):
            done.set()

    sched.iteration_listeners.append(on_iteration)
    sched.listeners.append(on_request)
    sched.start()
    start = time.monotonic()
    classes = {}
    for i, (name, ids, max_tokens) in enumerate(requests):
        stream = sched.submit(ids, GenerationParams(max_tokens=max_tokens, ignore_eos=True),
                              request_id=f"{name}-{i}")
        classes[stream.id] = name
    done.wait()
    wall = time.monotonic() - start
    sched.stop()
    running = [s[0] for s in samples]
    held = [s[1] for s in samples if s[1]]
    util = [s[2] for s in samples if s[1]]
    result = {
        "reservation": reservation, "wall_s": wall,
        "finished": sorted({r.finish_reason for r in records}),
        "concurrent_peak": max(running), "concurrent_mean": float(np.mean(running)),
        "pages_held_peak": max(held), "pages_total": engine.num_pages,
        "kv_bytes_held_peak": max(held) * engine.kv_cache_bytes // engine.num_pages,
        "page_utilization_mean": float(np.mean(util)), "page_utilization_min": float(np.min(util)),
        "preemptions": sched.preemptions,
        "output_tokens": sum(r.output_tokens for r in records),
        "output_tokens_per_s": sum(r.output_tokens for r in records) / wall,
        "iterations": len(samples),
    }
    for name in ("chat", "document"):
        mine = [r for r in records if classes[r.request_id] == name]
        gaps = [b - a for r in mine for a, b in zip(r.token_times, r.token_times[1:])]
        result[name] = {
            "requests": len(mine),
            "ttft_p50_s": percentile([r.ttft for r in mine], 50),
            "ttft_p99_s": percentile([r.ttft for r in mine], 99),
            "itl_p99_s": percentile(gaps, 99), "itl_max_s": max(gaps) if gaps else None,
        }
    return result


def table(results: list[dict]) -> str:
    head = ("reservation | concurrent peak / mean | pages held peak / pool | page utilization "
            "mean (min) | preemptions | output tok/s | chat TTFT p99 | chat ITL p99 / max | doc TTFT p50")
    rows = [head, " | ".join("---" for _ in head.split(" | "))]
    for r in results:
        c, d = r["chat"], r["document"]
        rows.append(f"{r['reservation']} | {r['concurrent_peak']} / {r['concurrent_mean']:.1f} | "
                    f"{r['pages_held_peak']} / {r['pages_total']} | {r['page_utilization_mean']:.1%} "
                    f"({r['page_utilization_min']:.1%}) | {r['preemptions']} | "
                    f"{r['output_tokens_per_s']:.1f} | {c['ttft_p99_s']:.2f} s | "
                    f"{c['itl_p99_s']:.2f} / {c['itl_max_s']:.2f} s | {d['ttft_p50_s']:.2f} s")
    return "\n".join(rows)


def main(argv) -> None:
    del argv
    model = load_model(MODEL_FLAG.value)
    config = runtime.engine_config_from_flags(model)
    engine = Engine(model.params, model.config, config)
    pages = engine.num_pages
    print(f"KV pool: {pages} pages x {config.page_size} tokens = {pages * config.page_size} tokens, "
          f"{engine.kv_cache_bytes / 2**20:.0f} MiB; {config.num_slots} slots", file=sys.stderr)
    start = time.monotonic()
    engine.warmup()
    print(f"warm-up {time.monotonic() - start:.0f} s", file=sys.stderr)
    requests = burst(model.tokenizer, _CHATS.value, _DOCS.value)
    results = []
    for reservation in _RESERVATIONS.value:
        results.append(run(engine, model.tokenizer, requests, reservation))
        print(json.dumps(results[-1]), file=sys.stderr)
    print(table(results))
    report = {
        "command": " ".join(sys.argv), "model": MODEL_FLAG.value, "engine": {
            "num_slots": config.num_slots, "max_seq_len": config.max_seq_len,
            "page_size": config.page_size, "num_pages": pages, "kv_cache_bytes": engine.kv_cache_bytes},
        "requests": {"chat": _CHATS.value, "document": _DOCS.value,
                     "prompt_tokens": sum(len(ids) for _, ids, _ in requests)},
        "compilations_after_warmup": engine.compilations_after_warmup,
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "jax_version": jax.__version__, "date": datetime.date.today().isoformat(), "runs": results,
    }
    if _OUT.value:
        Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
        Path(_OUT.value).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    app.run(main)
