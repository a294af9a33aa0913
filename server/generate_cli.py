"""`cadence-generate`: run prompts through the engine and scheduler from the command line.

    cadence-generate --model=smollm2-135m --prompt="The capital of France is" --max_tokens=16
    cadence-generate --prompts_file=prompts.jsonl --chat --num_slots=8

One prompt streams its text to stdout as it is generated. A prompts file (one prompt per line,
or JSONL objects with "prompt" or "messages" and optional sampling fields, and response_format
or tools as the batch job takes them: the text is printed as written) runs every prompt
concurrently through the scheduler and prints each result as it finishes. A summary goes to
stderr: per-request TTFT and per-stream rate, aggregate throughput, and
`compilations_after_warmup`.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from absl import app, flags

from cadence.checkpoints.errors import CheckpointError
from cadence.scheduler.errors import Overloaded, SubmissionError
from cadence.scheduler.request import RequestRecord, TokenEvent
from cadence.scheduler.trace import write_chrome_trace
from cadence.server import client_json, entries, parsing, runtime

_PROMPT = flags.DEFINE_string("prompt", None, "A prompt.")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "File of prompts: one per line, or JSONL.")
_CHAT = flags.DEFINE_bool("chat", False, "Apply the model's chat template to each prompt.")
_ADAPTER = flags.DEFINE_string("adapter", None, "Run every prompt with this LoRA adapter (a --lora NAME).")
_TRACE = flags.DEFINE_string(
    "trace_file", None, "Write the scheduler timeline (iterations, request phases) as a Chrome trace."
)


def read_prompts(path: Path) -> list[dict]:
    """Prompts file entries as dicts with "prompt" or "messages" (+ optional sampling fields)."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = client_json.load_json(line)
            except SubmissionError as e:
                raise SubmissionError(f"{path}:{number}: {e}") from None
            if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
                raise SubmissionError(f'{path}:{number}: a JSON line needs "prompt" or "messages"')
            entries.append(obj)
        else:
            entries.append({"prompt": line})
    return entries


def rate(record: RequestRecord) -> float | None:
    """Per-stream output rate, (N - 1) / (t_last - t_first), for N > 1 tokens."""
    times = record.token_times
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def submit_when_queue_has_room(sched, ids, params):
    """Submits; while the scheduler's queue is full, waits for room instead of failing."""
    while True:
        try:
            return sched.submit(ids, params)
        except Overloaded:
            time.sleep(0.05)


def main(argv: list[str]) -> int:
    del argv
    if (_PROMPT.value is None) == (_PROMPTS_FILE.value is None):
        print("cadence-generate: error: pass exactly one of --prompt or --prompts_file", file=sys.stderr)
        return 2
    try:
        rt = runtime.build_from_flags()
        tok = rt.model.tokenizer
        prompts = (
            [{"prompt": _PROMPT.value}] if _PROMPT.value is not None
            else read_prompts(Path(_PROMPTS_FILE.value))
        )
        defaults = parsing.defaults_from_flags(rt.model.generation)
        grammars = rt.grammars()
        jobs = [entries.to_request(e, tok, defaults, chat=_CHAT.value, grammars=grammars,
                                   max_seq_len=rt.scheduler.max_seq_len)[:2] for e in prompts]
        if _ADAPTER.value is not None:
            jobs = [(ids, runtime.with_adapter(p, rt.adapters, _ADAPTER.value)) for ids, p in jobs]
    except (CheckpointError, SubmissionError, ValueError, OSError) as e:
        print(f"cadence-generate: error: {e}", file=sys.stderr)
        return 2

    sched = rt.scheduler
    iterations: list = []
    finished: list = []
    if _TRACE.value:
        sched.iteration_listeners.append(iterations.append)
        sched.listeners.append(finished.append)
    sched.start()
    single = len(jobs) == 1
    results: list[RequestRecord | None] = [None] * len(jobs)
    lock = threading.Lock()
    t0 = time.monotonic()

    def consume(i: int, stream) -> None:
        for event in stream:
            if isinstance(event, TokenEvent):
                if single:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            else:
                with lock:
                    results[i] = event
                    if not single:
                        print(json.dumps({"index": i, "text": event.text,
                                          "finish_reason": event.finish_reason}, ensure_ascii=False))
                        sys.stdout.flush()

    threads, rejected = [], 0
    for i, (ids, params) in enumerate(jobs):
        try:
            stream = submit_when_queue_has_room(sched, ids, params)
        except SubmissionError as e:
            print(f"cadence-generate: request {i} rejected: {e}", file=sys.stderr)
            rejected += 1
            continue
        t = threading.Thread(target=consume, args=(i, stream), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    sched.stop()
    if _TRACE.value:
        write_chrome_trace(_TRACE.value, iterations, finished)
        print(f"cadence-generate: wrote the iteration trace to {_TRACE.value}", file=sys.stderr)
    if single:
        print()

    total = 0
    for i, record in enumerate(results):
        if record is None:
            continue
        total += record.output_tokens
        r = rate(record)
        print(
            f"[{i}] prompt={record.prompt_tokens} output={record.output_tokens} "
            f"finish={record.finish_reason} ttft={record.ttft or 0:.3f}s "
            f"rate={'n/a' if r is None else f'{r:.1f} tok/s'}",
            file=sys.stderr,
        )
    print(
        f"aggregate throughput: {total / elapsed:.1f} tok/s ({total} tokens in {elapsed:.2f} s); "
        f"warm-up {rt.warmup_seconds:.1f} s; "
        f"compilations_after_warmup: {rt.scheduler.compilations_after_warmup}",
        file=sys.stderr,
    )
    sched = rt.scheduler
    if sched.spec_drafts:
        model = (f"; the draft model's: {sched.draft_model_drafted}, {sched.draft_model_accepted} accepted"
                 if sched.draft else "")
        print(f"speculative decoding: {sched.spec_drafted} draft tokens in {sched.spec_drafts} "
              f"drafts, {sched.spec_accepted} accepted{model}", file=sys.stderr)
    return 1 if rejected else 0


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
