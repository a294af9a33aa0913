"""Served decode iterations per step, from saved `cadence-bench run` results.

    python -m cadence.bench.served_steps bench/results/multistep-cpu/k1-chat1/run.json ...

For each run: the server's decode-only iterations (from its timeline), grouped by decoding
slots and steps per dispatch, with the median wall time per iteration and per step; and what
the client saw: per-stream output rate, aggregate throughput, and gaps between deliveries
(tokens that arrived together are one delivery, `bench.metrics.deliveries`). A pure function of
the files, so the table can be rebuilt from the saved runs.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import numpy as np


def summarize_run(path: str) -> list[str]:
    run = json.loads(open(path).read())
    summary, server = run["summary"], run.get("server") or {}
    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for it in server.get("iterations") or []:
        if it["prefill_tokens"] == 0 and it["decode_slots"]:
            groups[(it["decode_slots"], it.get("decode_steps", 1))].append(it["wall"])
    lines = [path]
    for (slots, steps), walls in sorted(groups.items()):
        wall = float(np.median(walls))
        lines.append(f"  decode-only, {slots} slots x {steps} steps: {len(walls):4d} iterations, "
                     f"median {wall * 1e3:6.1f} ms ({wall / steps * 1e3:5.1f} ms per step)")
    chat = summary["classes"].get("chat", {})
    rate = chat.get("stream_rate_tok_s", {})
    itl = summary["chat_inter_token_s"]
    d = itl.get("deliveries") or {}
    gaps = d.get("gaps_s") or {}
    lines.append(f"  client: stream rate p50 {rate.get('p50') or 0:.1f} tok/s, aggregate "
                 f"{summary['throughput']['tokens_per_s']:.1f} tok/s; deliveries of "
                 f"{d.get('messages_per_delivery_mean') or 0:.2f} messages (max "
                 f"{d.get('messages_per_delivery_max')}), gaps p50 {(gaps.get('p50') or 0) * 1e3:.1f} ms "
                 f"p99 {(gaps.get('p99') or 0) * 1e3:.1f} ms max {(gaps.get('max') or 0) * 1e3:.1f} ms; "
                 f"TTFT p50 {(chat.get('ttft_s', {}).get('p50') or 0) * 1e3:.0f} ms "
                 f"p99 {(chat.get('ttft_s', {}).get('p99') or 0) * 1e3:.0f} ms")
    return lines


def main(paths: list[str]) -> None:
    for path in paths:
        print("\n".join(summarize_run(path)))


if __name__ == "__main__":
    main(sys.argv[1:])
