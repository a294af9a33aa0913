"""Token-billing estimate from the usage a server reported, under a price table you give.

    prices = Prices(input_per_m=0.15, cached_input_per_m=0.075, output_per_m=0.60)
    estimate = bill(results, prices)        # per class and in total

Each request is billed once, from the last `usage` object of its stream (the final usage chunk;
where a server repeats cumulative usage on every chunk, the last one is the total, so per-chunk
usages are never added up). Input tokens are split into cached (`prompt_tokens_details.
cached_tokens`) and uncached, each at its own rate; output tokens (which include any reasoning
tokens the server reports inside `completion_tokens`) at the output rate.

What this is not: a bill. It covers the token-billing boundary only (no tools, retrieval,
storage, minimums, discounts), only requests whose usage arrived, and says nothing about the
hardware cost of serving them; GPU efficiency is not a price. Requests without usage (failed or
cut short) are counted and left out, since their charges are unknown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cadence.bench.client import RequestResult


@dataclasses.dataclass(frozen=True)
class Prices:
    """Prices per million tokens, in one currency. Cached input defaults to the input rate."""

    input_per_m: float
    output_per_m: float
    cached_input_per_m: float | None = None
    currency: str = "USD"

    def __post_init__(self) -> None:
        rates = (self.input_per_m, self.output_per_m, self.cached_input_per_m or 0.0)
        if any(r < 0 for r in rates):
            raise ValueError("prices must be >= 0")

    @property
    def cached_rate(self) -> float:
        return self.input_per_m if self.cached_input_per_m is None else self.cached_input_per_m


def _empty() -> dict:
    return {"requests": 0, "unbilled_requests": 0, "input_tokens": 0, "cached_input_tokens": 0,
            "output_tokens": 0, "input_cost": 0.0, "cached_input_cost": 0.0, "output_cost": 0.0}


def bill(results: Sequence[RequestResult], prices: Prices) -> dict:
    classes: dict[str, dict] = {}
    total = _empty()
    for r in results:
        row = classes.setdefault(r.cls, _empty())
        if r.usage is None:
            row["unbilled_requests"] += 1
            total["unbilled_requests"] += 1
            continue
        prompt = int(r.usage.get("prompt_tokens") or 0)
        cached = min(r.cached_tokens, prompt)
        output = int(r.usage.get("completion_tokens") or 0)
        for acc in (row, total):
            acc["requests"] += 1
            acc["input_tokens"] += prompt - cached
            acc["cached_input_tokens"] += cached
            acc["output_tokens"] += output
            acc["input_cost"] += (prompt - cached) * prices.input_per_m / 1e6
            acc["cached_input_cost"] += cached * prices.cached_rate / 1e6
            acc["output_cost"] += output * prices.output_per_m / 1e6
    for acc in (*classes.values(), total):
        acc["cost"] = acc["input_cost"] + acc["cached_input_cost"] + acc["output_cost"]
        acc["cost_per_request"] = acc["cost"] / acc["requests"] if acc["requests"] else None
    return {"prices_per_million": dataclasses.asdict(prices), "classes": classes, "total": total,
            "scope": "token charges only, from reported usage; not tools, storage or hardware cost"}


def format_bill(estimate: dict) -> str:
    cur = estimate["prices_per_million"]["currency"]
    out = [f"{'class':<10} {'reqs':>5} {'unbilled':>8} {'input':>10} {'cached':>9} {'output':>9} "
           f"{'input ' + cur:>11} {'cached ' + cur:>11} {'output ' + cur:>11} {'total ' + cur:>11} {'per req':>9}"]
    for name, c in [*estimate["classes"].items(), ("total", estimate["total"])]:
        per = "-" if c["cost_per_request"] is None else f"{c['cost_per_request']:.6f}"
        out.append(f"{name:<10} {c['requests']:>5} {c['unbilled_requests']:>8} {c['input_tokens']:>10} "
                   f"{c['cached_input_tokens']:>9} {c['output_tokens']:>9} {c['input_cost']:>11.6f} "
                   f"{c['cached_input_cost']:>11.6f} {c['output_cost']:>11.6f} {c['cost']:>11.6f} {per:>9}")
    out.append(f"({estimate['scope']})")
    return "\n".join(out)
