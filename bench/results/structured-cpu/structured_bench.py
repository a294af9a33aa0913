"""Structured output's host-side costs on a model's tokenizer: compiling a grammar, and the
bitmask of each token.

    python bench/results/structured-cpu/structured_bench.py --model=smollm2-135m \
        --out=bench/results/structured-cpu/host.json

For each grammar (the served benchmark's schema, schemas of other shapes, a forced tool call
and the any-object format):
- compile: a cold compile on a fresh `GrammarCompiler` (what a request with a new schema waits
  for), median of `--repeats`; and a cached one (the same schema again);
- mask: the time to fill one token's bitmask (`Matcher.fill`, what the scheduler does per
  constrained row per decode step, while the device runs the step's forward pass), over a valid
  answer tokenized by the model's own tokenizer and fed token by token: median and p99.

The served cost (per-token time at 8 streams with and without a schema, and of free streams
beside constrained ones) is `decode_rate.py --constrained`; `bench/results/structured-cpu/run.sh`
runs both.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from cadence.checkpoints.registry import load_model
from cadence.model.host_sampling import bitmask_words
from cadence.scheduler.grammar import GrammarCompiler, JsonObject, JsonSchema, token_view
from cadence.server.tool_requests import HERMES, parse_tools

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Whose tokenizer the grammars are built on.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Cold compiles per grammar.", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results.")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 20}, "member": {"type": "boolean"},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "city", "member", "role"], "additionalProperties": False}
PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON,
                                                      "minItems": 30, "maxItems": 30}},
          "required": ["people"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "lines": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[a-z][0-9]$"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}, "minItems": 1}},
        "required": ["id", "lines"], "additionalProperties": False},
    "notes": {"type": ["string", "null"]}}, "required": ["order", "notes"], "additionalProperties": False}
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "null"]}
                                         for i in range(60)},
        "required": [f"field_{i}" for i in range(0, 60, 2)], "additionalProperties": False}
TOOLS = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}, {"type": "function", "function": {"name": "get_time"}}],
    "tool_choice": "required"}


def person(i: int) -> dict:
    return {"name": f"Person {i}", "age": 20 + i, "city": ["Paris", "Lyon", "Nice"][i % 3],
            "member": i % 2 == 0, "role": ["admin", "user", "guest"][i % 3]}


def cases() -> list[tuple[str, object, str]]:
    """(name, spec, a valid answer in the layout cadence's JSON grammar writes)."""
    out = [("people (served benchmark)", JsonSchema(PEOPLE), {"people": [person(i) for i in range(30)]}),
           ("person", JsonSchema(PERSON), person(7)),
           ("nested", JsonSchema(NESTED), {"order": {"id": 12, "lines": [{"sku": "a1", "qty": 2}]},
                                           "notes": None}),
           ("wide (60 fields)", JsonSchema(WIDE), {f"field_{i}": i for i in range(0, 60, 2)}),
           ("json_object", JsonObject(), {"a": [1, 2, {"b": "c"}], "d": None})]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    out.append(("forced tool call", parse_tools(TOOLS).grammar(HERMES), call))
    return [(name, spec, answer if isinstance(answer, str) else json.dumps(answer)) for name, spec, answer in out]


def main(argv) -> None:
    del argv
    model = load_model(_MODEL.value)
    tok, vocab = model.tokenizer, model.config.vocab_size
    start = time.perf_counter()
    token_view(tok, vocab)
    view_s = time.perf_counter() - start
    rows = []
    for name, spec, answer in cases():
        cold = []
        for _ in range(_REPEATS.value):
            compiler = GrammarCompiler(tok, vocab, timeout=60)
            grammar = compiler.compile(spec)
            cold.append(grammar.compile_seconds)
        start = time.perf_counter()
        compiler.compile(spec)
        cached = time.perf_counter() - start
        matcher, row = grammar.matcher(), np.zeros(bitmask_words(vocab), np.int32)
        fills = []
        ids = tok.encode(answer, add_bos=False)
        for token in ids:
            start = time.perf_counter()
            assert matcher.fill(row), matcher.error
            fills.append(time.perf_counter() - start)
            assert matcher.accept(token), (name, matcher.error)
        fills.sort()
        rows.append({"grammar": name, "compile_ms": 1e3 * statistics.median(cold),
                     "cached_ms": 1e3 * cached, "tokens": len(ids),
                     "mask_ms_median": 1e3 * statistics.median(fills),
                     "mask_ms_p99": 1e3 * fills[min(len(fills) - 1, int(0.99 * len(fills)))]})
        r = rows[-1]
        print(f"{name:28s} compile {r['compile_ms']:7.2f} ms (cached {r['cached_ms']:.3f} ms), "
              f"mask per token median {r['mask_ms_median']:.3f} ms, p99 {r['mask_ms_p99']:.3f} ms "
              f"over {r['tokens']} tokens", flush=True)
    results = {"model": _MODEL.value, "vocab_size": vocab, "token_view_s": view_s,
               "machine": platform.processor() or platform.machine(), "date": datetime.date.today().isoformat(),
               "grammars": rows}
    print(f"the tokenizer's view (once per model): {view_s * 1e3:.0f} ms")
    if _OUT.value:
        Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
        Path(_OUT.value).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    app.run(main)
