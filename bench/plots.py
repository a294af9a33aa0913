"""PNG plots (matplotlib, Agg backend) of benchmark runs.

    itl_cdf({"prefill-first": gaps, "chunked@64": gaps}, "itl_cdf.png")
    ttft_vs_prompt({"chunked@64": results}, "ttft_vs_prompt.png")
    timeline(report, "timeline.png")        # a run report with cadence's iteration log

- Inter-token delay CDF per policy, with the complementary CDF on log axes beside it, since the
  tail is where prefill stalls show.
- Client TTFT against prompt length (from usage), per class and policy.
- An iteration timeline: each server iteration as a bar as long as it ran and as tall as its
  wall time, coloured by whether the work it waited for (the previous iteration's, since results
  are read one step behind) carried prefill; under it, each request's message arrivals, so a
  stall in the streams lines up with the iteration that caused it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from cadence.bench.client import RequestResult  # noqa: E402
from cadence.bench.metrics import device_view  # noqa: E402


def itl_cdf(gaps: Mapping[str, Sequence[float]], path: str | Path, title: str = "") -> Path:
    fig, (ax, tail) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, values in gaps.items():
        x = np.sort(np.asarray(values, float))
        if not len(x):
            continue
        y = np.arange(1, len(x) + 1) / len(x)
        p99 = np.percentile(x, 99)
        ax.step(x, y, where="post", label=f"{label} (p99 {p99 * 1e3:.0f} ms, max {x[-1] * 1e3:.0f} ms)")
        tail.step(x, np.maximum(1 - y + 1 / len(x), 1e-6), where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("chat inter-token delay (s)")
    ax.set_ylabel("fraction of gaps <= x")
    ax.axhline(0.99, color="grey", lw=0.6, ls=":")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    tail.set_xscale("log")
    tail.set_yscale("log")
    tail.set_xlabel("chat inter-token delay (s)")
    tail.set_ylabel("fraction of gaps >= x")
    tail.axhline(0.01, color="grey", lw=0.6, ls=":")
    tail.grid(alpha=0.3, which="both")
    fig.suptitle(title or "Chat inter-token delay per policy")
    return _save(fig, path)


def ttft_vs_prompt(runs: Mapping[str, Sequence[RequestResult]], path: str | Path, title: str = "") -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    markers = {"chat": "o", "document": "s"}
    for i, (label, results) in enumerate(runs.items()):
        for cls in sorted({r.cls for r in results}):
            pts = [(r.prompt_tokens or r.approx_prompt_tokens, r.ttft) for r in results
                   if r.cls == cls and r.ok and r.ttft is not None]
            if pts:
                x, y = zip(*pts)
                ax.scatter(x, y, s=14, alpha=0.7, color=f"C{i}", marker=markers.get(cls, "^"),
                           label=f"{label}: {cls}")
    ax.set_xlabel("prompt tokens (usage)")
    ax.set_ylabel("client TTFT (s)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title or "Time to first token against prompt length")
    return _save(fig, path)


def timeline(report: Mapping, path: str | Path, span: tuple[float, float] | None = None,
             title: str = "") -> Path:
    """Iterations (client clock) and chat message arrivals over `span` (default: 25 s from
    shortly before the first document sent in the window, or the window's start)."""
    iterations = device_view(report["server"].get("iterations_client_clock") or [])
    results = [RequestResult.from_dict(d) for d in report["records"]]
    chat = set(report["summary"]["chat_classes"])
    window = report["summary"]["window_s"]
    if span is None:
        docs = sorted(r.sent for r in results if r.cls not in chat and r.sent >= window[0])
        begin = docs[0] - 2.0 if docs else window[0]
        span = (begin, min(begin + 25.0, max(window[1], begin + 1.0)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [1.3, 1]})
    shown = [it for it in iterations if it["start"] + it["wall"] >= span[0] and it["start"] <= span[1]]
    for kind, color, pick in (("prefill (+ decode)", "C1", lambda it: it["prefill_tokens"] > 0),
                              ("decode only", "C0", lambda it: it["prefill_tokens"] == 0)):
        rows = [it for it in shown if pick(it)]
        if rows:
            top.bar([it["start"] for it in rows], [it["wall"] * 1e3 for it in rows],
                    width=[it["wall"] for it in rows], align="edge", color=color, alpha=0.8,
                    edgecolor="none", label=kind)
    for it in shown:
        if it["prefill_tokens"] > 0 and it["wall"] > 0.05 * (span[1] - span[0]) / 25:
            top.annotate(str(it["prefill_tokens"]), (it["start"] + it["wall"] / 2, it["wall"] * 1e3),
                         ha="center", va="bottom", fontsize=6)
    top.set_ylabel("iteration wall (ms)")
    top.set_yscale("symlog", linthresh=10)
    top.legend(fontsize=8, loc="upper right")
    top.set_title(f"{title or 'Server iterations and the streams'}\nbar = one iteration (width = its duration), "
                  "coloured and numbered by the prefill tokens whose results it waited for "
                  "(results are read one step behind)", fontsize=9)
    row = 0
    for r in sorted(results, key=lambda r: r.sent):
        times = [t for t in r.message_times if span[0] <= t <= span[1]]
        in_span = r.sent <= span[1] and (r.done or r.sent) >= span[0]
        if not in_span:
            continue
        if r.cls in chat:
            bottom.plot(times, [row] * len(times), "|", color="C0", ms=5, mew=0.8)
        else:
            end = r.message_times[0] if r.message_times else (r.done or span[1])
            bottom.plot([r.sent, end], [row, row], color="C1", lw=3, solid_capstyle="butt")
            bottom.plot(times, [row] * len(times), "|", color="C1", ms=5, mew=0.8)
        row += 1
    bottom.set_ylabel("requests (chat ticks = messages;\ndocument bar = waiting for first token)", fontsize=8)
    bottom.set_xlabel("time since run start (s, client clock)")
    bottom.set_xlim(*span)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
