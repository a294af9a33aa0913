"""`cadence-batch`: an offline, resumable batch job from a JSONL file of requests.

    cadence-batch --input=requests.jsonl --output=results.jsonl --num_slots=16 --max_tokens=256

Input, one JSON object a line (blank lines are skipped):
    {"id": "a1", "prompt": "Once upon a time"}
    {"id": 2, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7, "seed": 3}
    {"id": 3, "messages": [...], "response_format": {"type": "json_schema", "json_schema": {...}}}
    {"id": 4, "messages": [...], "tools": [{"type": "function", "function": {...}}], "tool_choice": "required"}
    {"id": 5, "input": "a text to embed"}
Ids are strings or integers, unique in the file. The optional sampling fields are those of
`server/parsing.py` (max_tokens, temperature, top_p, top_k, seed, the penalties, logit_bias,
stop, ignore_eos, stop_token_ids, include_stop_str_in_output, cache_salt, priority); absent
ones take the flags' defaults. A line's "model" may name one of --lora's adapters, which it then
runs with (the model's own name, or none, runs the model). So are OpenAI's
response_format (or vLLM's guided_* fields and llama-server's grammar, `server.guided`) and,
with messages, tools, tool_choice and parallel_tool_calls. A job with
--priority_classes or a priority per line runs its lower numbers first. Output, one JSON object a line, in the order requests finish:
    {"id", "text", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason",
     "stop_reason", "queue_time", "ttft", "total_time", "prefill_chunks", "decode_steps"}
("stop_reason": the stop string or stop token id that ended it, else null, as vLLM's),
and, where a line with tools was answered with calls, "tool_calls" (the chat API's shape, "text"
then being the rest of the answer) and finish_reason "tool_calls" (unless it was cut off:
"length"). A chat line (messages, which may carry "chat_template_kwargs") on a thinking model
(--reasoning_parser) has its reasoning as "reasoning_content" (null where it wrote none) and the
answer after it as "text". An input line (a string or token ids, and optionally "priority") is an
embedding, pooled as --pooling says: its result is {"id", "embedding" (unit length),
"prompt_tokens", "queue_time", "total_time", "prefill_chunks"}.
with times in seconds, measured by the scheduler from the moment it accepted the request.

A file in OpenAI's Batch API format instead ({"custom_id", "method", "url", "body"} lines) has
each body answered by cadence-serve's own endpoint, in process, and written as OpenAI's output
line (`server.openai_batch`); a file holds one format or the other.

Contract:
- Every request goes through the scheduler at full concurrency: all are submitted up front, and
  while the scheduler's queue is full the job waits for a completion and submits the rest then.
- Each result is appended, flushed and fsync'd as it finishes, so a crash loses nothing done.
  A rerun of the same command reads the output, skips the ids already there and runs the rest.
  A record counts only once its newline is on disk: anything after the last newline (a line
  torn by a kill mid-write) is truncated away on resume and that request is run again. A
  malformed line elsewhere in the output is not the job's to repair: it stops with status 2.
- Failures are reported on stderr as `INPUT:LINE: ...` and are NOT written to the output:
  malformed JSON, a missing or invalid id, a duplicate id (its first line runs, the later ones
  are reported), an invalid request (unknown field, wrong type, bad sampling value), one the
  scheduler refuses (prompt + max_tokens beyond the context) and one the engine failed. So the
  output holds only results, each id at most once, and a rerun retries exactly what failed.
  None of them stops the other requests. Exit status: 0 if every line succeeded, 1 if any line
  failed, 2 for a usage or setup error (missing flags, unloadable model, corrupt output file).
- A progress bar with throughput, and a summary on stderr: requests done / skipped (already in
  the output) / failed, tokens, aggregate output throughput and `compilations_after_warmup`;
  the same numbers as one JSON line prefixed `cadence-batch summary: `.

Non-goals: ordering the output like the input; noticing that an input line changed since the
id was done (ids are the identity); several jobs appending to one output file at once.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

from absl import app, flags
from tqdm import tqdm

from cadence.checkpoints.errors import CheckpointError
from cadence.scheduler.errors import NotRunning, Overloaded, SubmissionError
from cadence.scheduler.request import FinishReason, RequestRecord
from cadence.server import client_json, entries, openai_batch, parsing, reasoning, runtime
from cadence.server.app import ServerConfig
from cadence.server.openai_batch import Totals
from cadence.server.embeddings_api import normalized
from cadence.server.flags import GRAMMAR_TIMEOUT, MODEL_FLAG, REASONING_PARSER, pooling
from cadence.server.tool_requests import HERMES, CallStyle, ToolRequest, call_style

_INPUT = flags.DEFINE_string("input", None, "JSONL file of requests, each with a unique id.")
_OUTPUT = flags.DEFINE_string("output", None, "JSONL file results are appended to (resumable).")


class BatchError(Exception):
    """The job cannot start as asked; the message says what to fix."""


@dataclasses.dataclass
class Job:
    line: int  # 1-based line number in the input
    id: str | int
    entry: dict[str, Any]
    tools: ToolRequest | None = None  # a chat's tools, whose calls its answer is parsed for
    style: CallStyle = CallStyle(HERMES)  # how the model writes them
    reasoning_inside: bool | None = None  # a chat's reasoning split: `EntryRequest`'s
    openai: bool = False  # an OpenAI Batch API line (`server.openai_batch`); `id` its custom_id


def id_key(value: Any) -> str:
    """Identity of an id across input and output: "7" and 7 are different ids."""
    return json.dumps(value)


def parse_input(path: Path) -> tuple[list[Job], list[tuple[int, str]]]:
    """The input's valid, first-seen jobs, and (line, problem) for every other non-blank line."""
    jobs: list[Job] = []
    problems: list[tuple[int, str]] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            entry = client_json.load_json(raw)
        except SubmissionError as e:  # malformed, too deep, out-of-range numbers, bad text
            problems.append((number, f"malformed JSON ({e})"))
            continue
        if not isinstance(entry, dict):
            problems.append((number, f"expected a JSON object, got {type(entry).__name__}"))
            continue
        openai = openai_batch.is_batch_line(entry)
        if openai and (problem := openai_batch.line_problem(entry)):
            problems.append((number, problem))
            continue
        if not openai and "id" not in entry:
            problems.append((number, 'missing "id"; every line needs a unique string or integer id '
                                     '(or, in OpenAI\'s batch format, a "custom_id")'))
            continue
        name = "custom_id" if openai else "id"
        value = entry[name]
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
            problems.append((number, f'"id" must be a non-empty string or an integer, got {value!r}'))
            continue
        key = id_key(value)
        if key in first_line:
            problems.append((number, f"duplicate {name} {value!r} (first on line {first_line[key]}); skipped"))
            continue
        first_line[key] = number
        jobs.append(Job(number, value, entry, openai=openai))
    if len({job.openai for job in jobs}) > 1:
        raise BatchError(f"{path} mixes OpenAI batch lines (custom_id, url, body) with cadence's own "
                         "(id and the request's fields); put each kind in a file of its own")
    return jobs, problems


def load_done(path: Path) -> tuple[set[str], int]:
    """Ids already in the output, and how many torn bytes were truncated off its end."""
    if not path.exists():
        return set(), 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # records are newline-terminated; the rest is a torn write
    done = set()
    for number, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        try:
            result = json.loads(raw)
            done.add(id_key(result["custom_id"] if "custom_id" in result else result["id"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            raise BatchError(f"{path}:{number} is not a result record of this job; fix or delete "
                             "that line (or pass another --output), then rerun") from None
    torn = len(data) - end
    if torn:
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return done, torn


def result_json(job: Job, record: RequestRecord) -> dict[str, Any]:
    def seconds(value: float | None) -> float | None:
        return None if value is None else round(value, 6)

    if record.embedding is not None:  # an input line: its vector, at unit length
        return {"id": job.id, "embedding": normalized(record.embedding, 2).tolist(),
                "prompt_tokens": record.prompt_tokens, "queue_time": seconds(record.queue_time),
                "total_time": seconds(record.finished - record.submitted),
                "prefill_chunks": record.prefill_chunks}

    result = {
        "id": job.id,
        "text": record.text,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "completion_tokens": record.output_tokens,
        "finish_reason": record.finish_reason,
        "stop_reason": record.stop_reason,
        "queue_time": seconds(record.queue_time),
        "ttft": seconds(record.ttft),
        "total_time": seconds(record.finished - record.submitted),
        "prefill_chunks": record.prefill_chunks,
        "decode_steps": record.decode_steps,
    }
    if job.reasoning_inside is not None:  # a thinking model's reasoning, as the chat API splits it
        result["reasoning_content"], result["text"] = reasoning.split_reasoning(
            record.text, job.reasoning_inside)
    if job.tools is not None:  # the answer's calls, as the chat API returns them
        content, calls = job.style.parse(result["text"], job.tools.names)
        if calls:
            result.update(text=content or "", tool_calls=[c.message() for c in calls],
                          finish_reason="length" if record.finish_reason == "length" else "tool_calls")
    return result


def run_jobs(rt: runtime.Runtime, work: list[tuple[Job, list[int], Any]], output: Path,
             report) -> Totals:
    """Submits every job, waiting out a full queue, and appends each result as it finishes."""
    sched = rt.scheduler
    finished: queue.Queue[RequestRecord] = queue.Queue()
    sched.listeners.append(finished.put)  # called on the scheduler thread: only hand over
    jobs = {f"batch-line-{job.line}": job for job, _, _ in work}
    pending = collections.deque(work)
    totals, in_flight = Totals(), 0
    sched.start()
    start = time.monotonic()
    try:
        with open(output, "ab") as out, tqdm(total=len(work), unit="req", file=sys.stderr,
                                             desc="cadence-batch", dynamic_ncols=True) as bar:
            while pending or in_flight:
                while pending:
                    job, ids, params = pending[0]
                    try:
                        sched.submit(ids, params, request_id=f"batch-line-{job.line}")
                        in_flight += 1
                    except Overloaded as e:  # the queue is full, or an --slo_* target refuses it
                        if not in_flight:  # nothing to wait for: wait as the scheduler says
                            time.sleep(e.retry_after)
                        break  # submitted again after the next completion
                    except (SubmissionError, NotRunning) as e:  # NotRunning: the engine died
                        report(job.line, f"id {job.id!r} rejected: {e}")
                        totals.failed += 1
                        bar.update(1)
                    pending.popleft()
                if not in_flight:
                    continue
                records = [finished.get()]
                while not finished.empty():
                    records.append(finished.get_nowait())
                lines = []
                for record in records:
                    in_flight -= 1
                    job = jobs[record.request_id]
                    if record.finish_reason in (FinishReason.STOP.value, FinishReason.LENGTH.value):
                        lines.append(json.dumps(result_json(job, record), ensure_ascii=False) + "\n")
                        totals.done += 1
                        totals.prompt_tokens += record.prompt_tokens
                        totals.completion_tokens += record.output_tokens
                    else:
                        report(job.line, f"id {job.id!r} failed ({record.finish_reason}): "
                                         f"{record.error}; rerun to retry it")
                        totals.failed += 1
                out.write("".join(lines).encode("utf-8"))
                out.flush()
                os.fsync(out.fileno())  # a result on disk survives a kill or a power cut
                totals.seconds = time.monotonic() - start
                bar.update(len(records))
                bar.set_postfix_str(f"{totals.completion_tokens / max(totals.seconds, 1e-9):.1f} tok/s")
    except BaseException:  # Ctrl-C or a failed write: what is on disk is valid; abort the rest
        sched.stop(drain=False, timeout=10)
        raise
    sched.stop()
    return totals


def run_own_lines(rt: runtime.Runtime, todo: list[Job], output: Path, report) -> Totals:
    """cadence's own lines: each parsed as `entries.to_request` (an invalid one is reported and
    counted failed), then all through the scheduler (`run_jobs`)."""
    defaults = parsing.defaults_from_flags(rt.model.generation)
    splits = reasoning.parser_on(REASONING_PARSER.value, rt.model.tokenizer.chat_template)
    grammars = rt.grammars()
    served = runtime.served_names(MODEL_FLAG.value, None)
    work, invalid = [], 0
    for job in todo:
        try:
            entry = entries.to_request(job.entry, rt.model.tokenizer, defaults,
                                        extra_fields=("id", "model"), max_seq_len=rt.scheduler.max_seq_len,
                                        grammars=grammars, splits_reasoning=splits,
                                        pooling=pooling(rt.model.config))
            model = job.entry.get("model")
            if model is not None and model not in served:  # a --lora adapter's name
                entry = entry._replace(params=runtime.with_adapter(entry.params, rt.adapters, model))
        except (SubmissionError, CheckpointError, ValueError) as e:
            report(job.line, f"id {job.id!r} invalid: {e}")
            invalid += 1
            continue
        job.tools, job.reasoning_inside = entry.tools, entry.reasoning_inside
        job.style = call_style(rt.model.tokenizer)
        work.append((job, entry.ids, entry.params))
    totals = run_jobs(rt, work, output, report)
    totals.failed += invalid
    return totals


def run_openai_lines(rt: runtime.Runtime, todo: list[Job], output: Path, report) -> Totals:
    """OpenAI Batch API lines, through cadence-serve's endpoints in process (`server.openai_batch`);
    a line's request is the operator's, so its own chat_template is taken."""
    config = ServerConfig(grammar_timeout=GRAMMAR_TIMEOUT.value, reasoning_parser=REASONING_PARSER.value,
                          pooling=pooling(rt.model.config), trust_request_chat_template=True,
                          lora_adapters=tuple(a.name for a in rt.adapters))
    return openai_batch.run(rt, todo, output, report, config, runtime.served_names(MODEL_FLAG.value, None)[0])


def main(argv: list[str]) -> int:
    del argv
    if not _INPUT.value or not _OUTPUT.value:
        print("cadence-batch: error: pass --input and --output", file=sys.stderr)
        return 2
    source, output = Path(_INPUT.value), Path(_OUTPUT.value)

    def report(line: int, message: str) -> None:
        tqdm.write(f"cadence-batch: {source}:{line}: {message}", file=sys.stderr)

    try:
        if output.exists() and source.resolve() == output.resolve():
            raise BatchError("--input and --output are the same file")
        jobs, problems = parse_input(source)
        done, torn = load_done(output)
    except (BatchError, OSError) as e:
        print(f"cadence-batch: error: {e}", file=sys.stderr)
        return 2
    for line, message in problems:
        report(line, message)
    if torn:
        print(f"cadence-batch: {output}: truncated a torn final line ({torn} bytes); its request "
              "runs again", file=sys.stderr)
    todo = [job for job in jobs if id_key(job.id) not in done]
    totals, failed = Totals(), len(problems)
    compilations = None
    if todo:
        try:
            rt = runtime.build_from_flags()
        except (CheckpointError, ValueError, OSError) as e:
            print(f"cadence-batch: error: {e}", file=sys.stderr)
            return 2
        try:
            totals = (run_openai_lines if todo[0].openai else run_own_lines)(rt, todo, output, report)
        except KeyboardInterrupt:
            print("cadence-batch: interrupted; rerun the same command to resume", file=sys.stderr)
            return 130
        failed += totals.failed
        compilations = rt.scheduler.compilations_after_warmup
    summary = {
        "done": totals.done,
        "skipped": len(jobs) - len(todo),
        "failed": failed,
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "seconds": round(totals.seconds, 3),
        "output_tokens_per_s": round(totals.completion_tokens / totals.seconds, 1) if totals.seconds else None,
        "compilations_after_warmup": compilations,
    }
    print(
        f"cadence-batch: {summary['done']} done, {summary['skipped']} skipped (already in "
        f"{output}), {summary['failed']} failed; {totals.prompt_tokens} prompt + "
        f"{totals.completion_tokens} completion tokens in {totals.seconds:.2f} s "
        f"({summary['output_tokens_per_s'] or 0} tok/s); compilations_after_warmup: "
        f"{'n/a (nothing ran)' if compilations is None else compilations}",
        file=sys.stderr,
    )
    print(f"cadence-batch summary: {json.dumps(summary)}", file=sys.stderr)
    return 1 if failed else 0


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
