"""Workloads that send the same prefix again: multi-turn conversations and shared-prefix groups.

    spec = ConversationSpec(conversations=4, turns=5, system_tokens=600)
    results, wall = asyncio.run(run_conversations(spec, target))
    print(format_table(prefix_table(results, wall)))

Multi-turn: `conversations` closed loops run at once, each sending `turns` chat requests in
order. Turn t sends the system prompt, every earlier user message with the reply the server gave
to it, and a new user message, as a chat client does. Every conversation has the same system
prompt, so a cache shared by all requests can reuse it from the first turn on.

Shared prefix (the shape of SGLang's "generated-shared-prefix" benchmark): `groups` long
prefixes (a system prompt each), `prompts_per_group` different questions after each, all sent
in a shuffled order with `concurrency` in flight.

The table reports, per turn (or per workload): requests, client TTFT p50 and p90, the prompt
tokens the server reported, the part it says it did not compute (`cached_tokens`, or llama.cpp's
`timings.cache_n`), what it computed, and the wall time of the whole run. The text comes from
the same corpus as the mixed load (`bench.workload`).

Client side: imports only the standard library, numpy, httpx and the other client modules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from cadence.bench.client import RequestResult, Target, stream_into
from cadence.bench.metrics import percentile
from cadence.bench.report import _f
from cadence.bench.workload import RequestSpec, approx_tokens, text_of

SYSTEM_HEAD = "You are a helpful assistant for programmers. Use this reference when you answer:\n\n"


@dataclasses.dataclass(frozen=True)
class ConversationSpec:
    conversations: int = 4
    turns: int = 5
    system_tokens: int = 600  # approximate (`approx_tokens`)
    user_tokens: tuple[int, int] = (40, 120)
    max_tokens: int = 32  # each reply
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class SharedPrefixSpec:
    groups: int = 4
    prompts_per_group: int = 8
    prefix_tokens: int = 1000
    question_tokens: tuple[int, int] = (20, 60)
    max_tokens: int = 32
    concurrency: int = 4
    seed: int = 0


def _user(rng: np.random.Generator, tokens: tuple[int, int]) -> str:
    n = int(rng.integers(tokens[0], tokens[1] + 1))
    return "Question about this passage:\n\n" + text_of(n, rng)


async def run_conversations(spec: ConversationSpec, target: Target) -> tuple[list[RequestResult], float]:
    """Every conversation to its last turn (or its first failed one); returns the requests'
    results, each of class "turn-T", and the run's wall time."""
    rng = np.random.default_rng([spec.seed, 0])
    system = SYSTEM_HEAD + text_of(spec.system_tokens, rng)
    users = [[_user(np.random.default_rng([spec.seed, 1, c, t]), spec.user_tokens) for t in range(spec.turns)]
             for c in range(spec.conversations)]
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def conversation(c: int, http) -> None:
        history: list[tuple[str, str]] = [("system", system)]
        for t in range(spec.turns):
            history.append(("user", users[c][t]))
            request = RequestSpec(f"conv{c}-turn{t}", f"turn-{t + 1}", users[c][t],
                                  sum(approx_tokens(text) for _, text in history), spec.max_tokens,
                                  messages=tuple(history))
            result = RequestResult.start(request, t0)
            results.append(await stream_into(result, http, target, request, t0))
            if not result.ok:
                return
            history.append(("assistant", "".join(result.message_texts)))

    async with target.http() as http:
        await asyncio.gather(*(conversation(c, http) for c in range(spec.conversations)))
    return results, time.perf_counter() - t0


async def run_shared_prefix(spec: SharedPrefixSpec, target: Target) -> tuple[list[RequestResult], float]:
    """Every group's prompts, shuffled, `concurrency` at a time; class "group"."""
    rng = np.random.default_rng([spec.seed, 2])
    prefixes = [SYSTEM_HEAD + text_of(spec.prefix_tokens, rng) for _ in range(spec.groups)]
    requests = [RequestSpec(f"group{g}-q{q}", "shared-prefix", "", 0, spec.max_tokens,
                            messages=(("system", prefixes[g]), ("user", _user(rng, spec.question_tokens))))
                for g in range(spec.groups) for q in range(spec.prompts_per_group)]
    order = list(rng.permutation(len(requests)))
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def worker(http) -> None:
        while order:
            request = requests[order.pop(0)]
            result = RequestResult.start(request, t0)
            results.append(await stream_into(result, http, target, request, t0))

    async with target.http() as http:
        await asyncio.gather(*(worker(http) for _ in range(spec.concurrency)))
    return results, time.perf_counter() - t0


def _row(name: str, results: list[RequestResult]) -> dict:
    ok = [r for r in results if r.ok and r.usage]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(min(r.cached_tokens, r.prompt_tokens or 0) for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {"class": name, "requests": len(results), "failed": len(results) - len(ok),
            "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
            "cached_share": cached / prompt if prompt else None,
            "output_tokens": sum(r.output_tokens or 0 for r in ok)}


def prefix_table(results: list[RequestResult], wall_s: float) -> dict:
    """Rows per class (turn), then the first turn, the later turns and all together."""
    classes = sorted({r.cls for r in results}, key=lambda c: (len(c), c))
    rows = [_row(c, [r for r in results if r.cls == c]) for c in classes]
    if len(classes) > 1:
        rows.append(_row("later turns", [r for r in results if r.cls != classes[0]]))
    rows.append(_row("all", results))
    return {"rows": rows, "wall_s": wall_s}


def format_table(table: dict) -> str:
    out = [f"{'class':<12} {'reqs':>5} {'fail':>4} {'TTFT p50':>9} {'TTFT p90':>9} {'prompt':>8} "
           f"{'cached':>8} {'computed':>8} {'share':>6}"]
    for r in table["rows"]:
        out.append(f"{r['class']:<12} {r['requests']:>5} {r['failed']:>4} {_f(r['ttft_p50']):>9} "
                   f"{_f(r['ttft_p90']):>9} {r['prompt_tokens']:>8} {r['cached_tokens']:>8} "
                   f"{r['computed_tokens']:>8} {_f(r['cached_share']):>6}")
    out.append(f"wall time: {table['wall_s']:.1f} s")
    return "\n".join(out)
