"""The server-side timeline as a Chrome trace (open it in Perfetto or chrome://tracing).

One track per pool shows its loop's iterations (their decode slots and prefill tokens in the
args): one track colocated, a prefill and a decode track disaggregated. One track per request
shows its phases: queued, prefill (admission to first token), the KV transfer when
disaggregated, decode.
A long prefill iteration and the chat decodes it delayed line up visually, which is the
picture the seed paints in words.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from cadence.scheduler.request import RequestRecord
from cadence.scheduler.scheduler import IterationRecord


def chrome_trace(iterations: Iterable[IterationRecord], requests: Iterable[RequestRecord]) -> dict:
    iterations, requests = list(iterations), list(requests)
    starts = [i.start for i in iterations] + [r.submitted for r in requests]
    origin = min(starts, default=0.0)
    us = lambda t: round((t - origin) * 1e6, 1)  # noqa: E731
    pools = list(dict.fromkeys(it.pool for it in iterations))
    events: list[dict] = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
         "args": {"name": "iterations" if pool == "colocated" else f"{pool} iterations"}}
        for tid, pool in enumerate(pools)
    ]
    for it in iterations:
        kind = "+".join(k for k, n in (("decode", it.decode_slots), ("prefill", it.prefill_tokens),
                                       ("transfer", it.transfers)) if n)
        events.append({
            "ph": "X", "pid": 1, "tid": pools.index(it.pool), "name": kind or "idle", "ts": us(it.start),
            "dur": round(it.wall * 1e6, 1),
            "args": {"index": it.index, "decode_slots": it.decode_slots, "decode_steps": it.decode_steps,
                     "prefill_tokens": it.prefill_tokens, "prefill_chunks": it.prefill_chunks,
                     "prefill_programs": it.prefill_programs},
        })
    for n, r in enumerate(requests, start=1):
        events.append({"ph": "M", "name": "thread_name", "pid": 2, "tid": n,
                       "args": {"name": f"{r.request_id} ({r.prompt_tokens} prompt tokens)"}})
        phases = [("queued", r.submitted, r.admitted), ("prefill", r.admitted, r.first_token),
                  ("transfer", r.transfer_start, r.transfer_end), ("decode", r.first_token, r.finished)]
        for name, begin, end in phases:
            if begin is not None and end is not None:
                events.append({"ph": "X", "pid": 2, "tid": n, "name": name, "ts": us(begin),
                               "dur": round((end - begin) * 1e6, 1),
                               "args": {"finish_reason": r.finish_reason,
                                        "output_tokens": r.output_tokens,
                                        "prefill_chunks": r.prefill_chunks}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, iterations: Iterable[IterationRecord],
                       requests: Iterable[RequestRecord]) -> None:
    Path(path).write_text(json.dumps(chrome_trace(iterations, requests)))
