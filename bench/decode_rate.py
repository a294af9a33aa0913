"""Decode rate as a client sees it: one stream alone, then several at once, on any server.

    python -m cadence.bench.decode_rate --base_url=http://127.0.0.1:8000/v1 --concurrency=1,8 \
        --out=bench/results/weights-cpu/cadence-auto.json

Each round sends `concurrency` identical streaming chat requests at once (a short prompt,
`max_tokens` output with `ignore_eos`, temperature 0), `--rounds` times, one round after the
other. Per stream, the decode rate is (completion tokens - 1) / (last text - first text): the
time to first token is left out, so it is the rate of the decode steps. A round's aggregate
is every stream's tokens over the round's wall time (first token included). The prompt rate is
a stream's prompt tokens over its time to first token: with one stream, a long `--prompt_file`
and few `--max_tokens`, what prefill takes (turn the prefix cache off on the server, or every
round after the first finds the prompt cached: cadence's `--noprefix_caching`, llama-server's
`{"cache_prompt": false}`). Token counts are
the server's `usage`, never re-tokenized. Works against cadence and llama.cpp's llama-server
alike (`--extra_body='{"cache_prompt": false}'` keeps llama-server from reusing the prompt).

With `--prompt_file` the user message is a file's text (a document and a request about it, the
workload speculative decoding is for); where the server counts speculative decoding (vLLM's
`spec_decode_*` metrics), each setting also reports the drafts and the tokens a verify step
gave on average.

Structured output: `--constrained='{"response_format": ...}'` merges those fields into the first
`--constrained_streams` streams of each round (default: every one), which then end where their
grammar does or at max_tokens (ignore_eos cannot go with a grammar); the summary gives the
per-token time of constrained and free streams apart, so one run measures a schema's cost and
another what constrained streams cost the free ones beside them.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import logging

from absl import app, flags

_BASE_URL = flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "OpenAI-compatible base URL.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model name sent in requests.")
_CONCURRENCY = flags.DEFINE_list("concurrency", ["1", "8"], "Streams per round, one setting after another.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Rounds per concurrency.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 256, "Output tokens per stream.")
_PROMPT = flags.DEFINE_string("prompt", "Write a long story about a lighthouse keeper and the sea.",
                              "The user message.")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "A file whose text is the user message "
                                   "(instead of --prompt), e.g. a document and a request about it.")
_EXTRA_BODY = flags.DEFINE_string("extra_body", "{}", "JSON object merged into every request.")
_LABEL = flags.DEFINE_string("label", None, "Name of this server in the output.")
_CONSTRAINED = flags.DEFINE_string(
    "constrained", None, "JSON object merged into the constrained streams' requests (e.g. a "
    "response_format); they drop ignore_eos.")
_CONSTRAINED_STREAMS = flags.DEFINE_integer(
    "constrained_streams", None, "How many of each round's streams are constrained (default: all).",
    lower_bound=0)
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results.")


def one_stream(client: httpx.Client, body: dict, out: list, index: int) -> None:
    start = time.perf_counter()
    times, usage = [], None
    with client.stream("POST", f"{_BASE_URL.value.rstrip('/')}/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.read()[:500]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            message = json.loads(line[6:])
            usage = message.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in message.get("choices", [])):
                times.append(time.perf_counter())
    tokens = (usage or {}).get("completion_tokens")
    if not tokens or len(times) < 2:
        raise RuntimeError(f"stream {index} returned {len(times)} text messages and usage {usage}")
    out[index] = {"tokens": tokens, "prompt_tokens": usage.get("prompt_tokens"), "ttft_s": times[0] - start,
                  "decode_tok_s": (tokens - 1) / (times[-1] - times[0]), "end": times[-1]}


def bodies(body: dict, streams: int) -> list[dict]:
    """Each stream's request: the first `--constrained_streams` with the `--constrained` fields."""
    if not _CONSTRAINED.value:
        return [body] * streams
    constrained = {k: v for k, v in body.items() if k != "ignore_eos"} | json.loads(_CONSTRAINED.value)
    k = streams if _CONSTRAINED_STREAMS.value is None else min(_CONSTRAINED_STREAMS.value, streams)
    return [constrained] * k + [body] * (streams - k)


_SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                  "vllm:spec_decode_num_accepted_tokens_total")


def spec_counters(client: httpx.Client) -> dict[str, float]:
    """The server's speculative decoding counters (vLLM's names), {} where it has none."""
    root = _BASE_URL.value.rstrip("/").removesuffix("/v1")
    try:
        text = client.get(f"{root}/metrics").text
    except httpx.HTTPError:
        return {}
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(_SPEC_COUNTERS)}


def speculation(before: dict, after: dict) -> dict | None:
    """Drafts, draft tokens and accepted tokens between two readings, and the mean tokens a
    drafting row's verify step gave (1 + accepted per draft)."""
    if not after:
        return None
    delta = {name.split("num_")[1].removesuffix("_total"): after[name] - before.get(name, 0)
             for name in after}
    drafts = delta.get("drafts", 0)
    delta["tokens_per_verify"] = 1 + delta.get("accepted_tokens", 0) / drafts if drafts else None
    return delta


def run_round(client: httpx.Client, body: dict, streams: int) -> dict:
    out: list = [None] * streams
    start = time.perf_counter()
    sent = bodies(body, streams)
    threads = [threading.Thread(target=one_stream, args=(client, b, out, i)) for i, b in enumerate(sent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(o is None for o in out):
        raise RuntimeError("a stream failed (see above)")
    wall = max(o["end"] for o in out) - start
    return {"streams": streams, "aggregate_tok_s": sum(o["tokens"] for o in out) / wall,
            "per_stream_decode_tok_s": [o["decode_tok_s"] for o in out],
            "tokens": [o["tokens"] for o in out],
            "constrained": [b is not body for b in sent],
            "ttft_s": [o["ttft_s"] for o in out],
            "prompt_tokens": [o["prompt_tokens"] for o in out]}


def main(argv) -> None:
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    prompt = Path(_PROMPT_FILE.value).read_text() if _PROMPT_FILE.value else _PROMPT.value
    body = {"model": _MODEL.value, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": _MAX_TOKENS.value, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **json.loads(_EXTRA_BODY.value)}
    results = {"label": _LABEL.value, "base_url": _BASE_URL.value, "max_tokens": _MAX_TOKENS.value,
               "settings": []}
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        run_round(client, dict(body, max_tokens=8), 1)  # a first request: nothing cold in the rounds
        for streams in map(int, _CONCURRENCY.value):
            before = spec_counters(client)
            rounds = [run_round(client, body, streams) for _ in range(_ROUNDS.value)]
            drafting = speculation(before, spec_counters(client))
            per_stream = [r for rd in rounds for r in rd["per_stream_decode_tok_s"]]
            prompt_rates = [n / t for rd in rounds for n, t in zip(rd["prompt_tokens"], rd["ttft_s"]) if n]
            setting = {"streams": streams, "rounds": rounds,
                       "median_stream_decode_tok_s": statistics.median(per_stream),
                       "median_aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in rounds),
                       "median_stream_prompt_tok_s": statistics.median(prompt_rates) if prompt_rates else None,
                       "speculation": drafting}
            print(f"{_LABEL.value or _BASE_URL.value}: {streams} stream(s): per-stream decode "
                  f"{setting['median_stream_decode_tok_s']:.1f} tok/s (median of {len(per_stream)}), "
                  f"aggregate {setting['median_aggregate_tok_s']:.1f} tok/s (median of {len(rounds)} rounds)"
                  + (f", prompt {setting['median_stream_prompt_tok_s']:.0f} tok/s over "
                     f"{rounds[0]['prompt_tokens'][0]} prompt tokens" if prompt_rates else ""),
                  flush=True)
            if drafting and drafting["drafts"]:
                print(f"  speculation: {drafting['draft_tokens']:.0f} draft tokens in "
                      f"{drafting['drafts']:.0f} drafts, {drafting['accepted_tokens']:.0f} accepted: "
                      f"{drafting['tokens_per_verify']:.2f} tokens per verify step", flush=True)
            for kind, wanted in (("constrained", True), ("free", False)):
                rates = [rate for rd in rounds for rate, c in zip(rd["per_stream_decode_tok_s"],
                                                                  rd["constrained"]) if c == wanted]
                if rates:  # per-token time: the mean over streams of 1/rate
                    setting[f"{kind}_ms_per_token"] = 1e3 * statistics.mean(1 / r for r in rates)
                    print(f"  {kind}: {setting[f'{kind}_ms_per_token']:.2f} ms per token "
                          f"(mean of {len(rates)} streams)", flush=True)
            results["settings"].append(setting)
    if _OUT.value:
        Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
        Path(_OUT.value).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    app.run(main)
