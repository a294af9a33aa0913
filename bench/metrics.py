"""The mixed load's metrics, computed from client records (docs/architecture.md, "Metrics").

    summary = summarize(results, window=(10.0, 70.0), chat_classes={"chat"})

- Per class, over requests *sent* in the window [start, end): client TTFT (request sent ->
  first message with output text) p50/p90/p99; per-stream output rate (N - 1) / (t_last -
  t_first) for N > 1 with N from usage, median and p10; completion time (sent -> end of stream)
  p50/p99; counts of requests, errors, rejections (HTTP 429) and incomplete ones.
- Inter-token delay, across the chat classes' streams only: gaps between consecutive output
  messages whose later message arrived in the window, p50/p99/max. Exact when each message
  carried one token (or the server reported usage per message); otherwise a message with k
  tokens contributes k gaps of (gap / k): a chunk-normalized estimate, labelled as such. The
  measured message gaps are always reported beside it, and so are deliveries: messages that
  arrive within TOGETHER_S of the one before (k decode steps per dispatch send k tokens at
  once) count as one delivery, whose gaps and sizes say how the tokens really came.
- Aggregate output throughput: output tokens whose message arrived in the window, divided by
  the window's length (the stated interval).

Percentiles are numpy's linear interpolation. Everything here is a pure function of records,
so a saved run can be re-summarized. Client side: standard library and numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from cadence.bench.client import RequestResult

PERCENTILES = "numpy.percentile, linear interpolation"
Window = tuple[float, float]


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else None


def distribution(values: Sequence[float], qs: Iterable[float] = (50, 99), with_max: bool = False) -> dict:
    out: dict = {"n": len(values)}
    for q in qs:
        out[f"p{q:g}"] = percentile(values, q)
    if with_max:
        out["max"] = float(max(values)) if len(values) else None
    return out


def stream_rate(tokens: int | None, t_first: float, t_last: float) -> float | None:
    """(N - 1) / (t_last - t_first) tokens/s; None when N <= 1 or no time passed."""
    if tokens is None or tokens <= 1 or t_last <= t_first:
        return None
    return (tokens - 1) / (t_last - t_first)


def result_rate(r: RequestResult) -> float | None:
    if not r.message_times:
        return None
    n = r.output_tokens if r.output_tokens is not None else len(r.message_times)
    return stream_rate(n, r.message_times[0], r.message_times[-1])


def _in(t: float, window: Window) -> bool:
    return window[0] <= t < window[1]


def class_metrics(results: Sequence[RequestResult], name: str, window: Window) -> dict:
    population = [r for r in results if r.cls == name and _in(r.sent, window)]
    ok = [r for r in population if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    rates = [x for x in map(result_rate, ok) if x is not None]
    completion = [r.done - r.sent for r in ok]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    output = [r.output_tokens for r in ok if r.output_tokens is not None]
    approx = [r.approx_prompt_tokens for r in ok if r.prompt_tokens is not None]
    errors = [r for r in population if not r.ok and not r.rejected and not r.incomplete]
    return {
        "requests": len(population), "ok": len(ok), "errors": len(errors),
        "rejected": sum(r.rejected for r in population),
        "incomplete": sum(r.incomplete for r in population),
        "error_examples": sorted({r.error for r in errors if r.error})[:3],
        "ttft_s": distribution(ttft, (50, 90, 99)),
        "stream_rate_tok_s": distribution(rates, (50, 10)),
        "completion_s": distribution(completion, (50, 99)),
        "prompt_tokens_mean": float(np.mean(prompt)) if prompt else None,
        "output_tokens_mean": float(np.mean(output)) if output else None,
        "prompt_tokens_over_estimate": float(np.sum(prompt) / np.sum(approx)) if approx else None,
        "tokens_basis": sorted({r.tokens_basis for r in ok}),
    }


def message_gaps(r: RequestResult, window: Window) -> list[float]:
    t = r.message_times
    return [t[i] - t[i - 1] for i in range(1, len(t)) if _in(t[i], window)]


# Messages closer than this arrived together: one read of the socket, one delivery.
TOGETHER_S = 0.001


def deliveries(r: RequestResult, window: Window) -> tuple[list[float], list[int]]:
    """Gaps between deliveries whose first message arrived in the window (messages within
    TOGETHER_S of the previous one join its delivery), and each delivery's message count."""
    t = r.message_times
    starts = [0] + [i for i in range(1, len(t)) if t[i] - t[i - 1] >= TOGETHER_S]
    sizes = [b - a for a, b in zip(starts, starts[1:] + [len(t)])]
    gaps = [t[b] - t[a] for a, b in zip(starts, starts[1:]) if _in(t[b], window)]
    return gaps, [n for i, n in zip(starts, sizes) if _in(t[i], window)]


def token_gaps(r: RequestResult, window: Window) -> list[float]:
    """One gap per token after the first message; chunk-normalized unless exact one-per-message."""
    t, k = r.message_times, r.message_tokens()
    out: list[float] = []
    for i in range(1, len(t)):
        if _in(t[i], window) and k[i] > 0:
            out += [(t[i] - t[i - 1]) / k[i]] * k[i]
    return out


def chat_itl(results: Sequence[RequestResult], window: Window, chat_classes: set[str]) -> dict:
    streams = [r for r in results if r.cls in chat_classes and r.message_times]
    counted = all(r.tokens_exact for r in streams)
    exact = counted and all(all(k == 1 for k in r.message_tokens()) for r in streams)
    tokens = [g for r in streams for g in token_gaps(r, window)]
    messages = [g for r in streams for g in message_gaps(r, window)]
    both = [deliveries(r, window) for r in streams]
    gaps, sizes = [g for d in both for g in d[0]], [n for d in both for n in d[1]]
    return {
        "population": f"gaps between consecutive output messages of {sorted(chat_classes)} streams "
                      f"whose later message arrived in [{window[0]:g}, {window[1]:g}) s",
        "basis": "exact: one token per message" if exact else
                 "counted: a message of k tokens (usage per message) counts k gaps of gap/k" if counted else
                 "estimate: chunk-normalized (a k-token message counts k gaps of gap/k)",
        **distribution(tokens, (50, 99), with_max=True),
        "message_gaps_s": distribution(messages, (50, 99), with_max=True),
        "deliveries": {
            "together": f"messages within {TOGETHER_S * 1e3:g} ms of the previous one",
            "gaps_s": distribution(gaps, (50, 99), with_max=True),
            "messages_per_delivery_mean": float(np.mean(sizes)) if sizes else None,
            "messages_per_delivery_max": max(sizes) if sizes else None,
        },
    }


def throughput(results: Sequence[RequestResult], window: Window) -> dict:
    tokens, exact = 0, True
    for r in (r for r in results if r.message_times):
        counts = r.message_tokens()
        exact &= r.tokens_exact
        tokens += sum(k for t, k in zip(r.message_times, counts) if _in(t, window))
    interval = window[1] - window[0]
    finished = [r for r in results if r.ok and _in(r.done, window)]
    by_class = {}
    for r in finished:
        entry = by_class.setdefault(r.cls, {"finished": 0, "prompt_tokens": 0})
        entry["finished"] += 1
        entry["prompt_tokens"] += r.prompt_tokens or 0
    for entry in by_class.values():  # prompts served per second: a class's share of prefill
        entry["prompt_tokens_per_s"] = entry["prompt_tokens"] / interval
    return {
        "interval_s": [window[0], window[1]], "output_tokens": tokens,
        "tokens_per_s": tokens / interval,
        "basis": "exact" if exact else "estimate: some messages' token counts estimated",
        "requests_finished": len(finished),
        "by_class": by_class,  # requests that finished in the window, and their prompt tokens
    }


def summarize(results: Sequence[RequestResult], window: Window, chat_classes: set[str],
              class_names: Sequence[str] | None = None) -> dict:
    names = class_names or sorted({r.cls for r in results})
    return {
        "window_s": [window[0], window[1]],
        "percentiles": PERCENTILES,
        "chat_classes": sorted(chat_classes),
        "classes": {name: class_metrics(results, name, window) for name in names},
        "chat_inter_token_s": chat_itl(results, window, chat_classes),
        "throughput": throughput(results, window),
        "errors": sum(not r.ok and not r.rejected and not r.incomplete for r in results),
        "rejected": sum(r.rejected for r in results),
        "incomplete": sum(r.incomplete for r in results),
    }


# -- the server's side (cadence), joined to the client's records ---------------------------


def server_metrics(results: Sequence[RequestResult], window: Window, chat_classes: set[str],
                   iterations: Sequence[dict], samples: Sequence[dict]) -> dict:
    """Where the client's figures come from: queueing, server-side TTFT and inter-token gaps,
    which iterations the long chat gaps overlapped, and KV memory in use during the window."""
    joined = [r for r in results if r.server is not None and _in(r.sent, window)]
    out: dict = {"joined_requests": len(joined), "classes": {}}
    for name in sorted({r.cls for r in joined}):
        mine = [r.server for r in joined if r.cls == name]
        client_ttft = {r.id: r.ttft for r in joined if r.cls == name and r.ttft is not None}
        overhead = [client_ttft[r.id] - r.server["ttft_s"] for r in joined
                    if r.id in client_ttft and r.server["ttft_s"] is not None]
        out["classes"][name] = {
            "queue_s": distribution([s["queue_s"] for s in mine if s["queue_s"] is not None], (50, 99)),
            "server_ttft_s": distribution([s["ttft_s"] for s in mine if s["ttft_s"] is not None], (50, 99)),
            "client_minus_server_ttft_s": distribution(overhead, (50, 99)),
            "prefill_chunks_mean": float(np.mean([s["prefill_chunks"] for s in mine])) if mine else None,
        }
    server_gaps = []
    for r in results:
        if r.cls in chat_classes and r.server is not None:
            t = r.server["token_times"]
            server_gaps += [t[i] - t[i - 1] for i in range(1, len(t)) if _in(t[i], window)]
    out["chat_inter_token_server_s"] = distribution(server_gaps, (50, 99), with_max=True)
    out["stalls"] = explain_stalls(results, window, chat_classes, iterations)
    out["pools"] = pool_metrics(iterations, window)
    transfers = transfer_metrics(joined, window)
    if transfers:
        out["transfers"] = transfers
    kv = [s for s in samples if _in(s["t"], window)]
    out["kv"] = {
        "samples": len(kv),
        "usage_mean": float(np.mean([s["kv_usage"] for s in kv])) if kv else None,
        "usage_max": float(max(s["kv_usage"] for s in kv)) if kv else None,
        "bytes_mean": float(np.mean([s["kv_bytes"] for s in kv])) if kv and "kv_bytes" in kv[0] else None,
        "bytes_max": float(max(s["kv_bytes"] for s in kv)) if kv and "kv_bytes" in kv[0] else None,
    }
    paged = [s for s in kv if s.get("kv_pages") is not None]
    if paged:
        out["kv"].update({
            "pages_max": max(s["kv_pages"] for s in paged), "pages_total": paged[0]["kv_pages_total"],
            "page_utilization_mean": float(np.mean([s["kv_page_utilization"] for s in paged
                                                    if s["kv_pages"]] or [1.0])),
        })
    return out


def pool_metrics(iterations: Sequence[dict], window: Window) -> dict:
    """Per pool (one colocated; prefill and decode disaggregated): its iterations in the window
    and the fraction of the window they took (busy: a program ran or its result was awaited)."""
    length = window[1] - window[0]
    out = {}
    for pool in sorted({it.get("pool", "colocated") for it in iterations}):
        mine = [it for it in iterations if it.get("pool", "colocated") == pool and _in(it["start"], window)]
        out[pool] = {"iterations": len(mine),
                     "busy_fraction": sum(it["wall"] for it in mine) / length if length > 0 else None,
                     "transfers": sum(it.get("transfers", 0) for it in mine)}
    return out


def transfer_metrics(joined: Sequence[RequestResult], window: Window) -> dict:
    """Disaggregated serving, per request sent in the window: the KV moved and how long it took
    (ready on the prefill device -> landed on the decode device), how long it waited for the
    decode pool's room after its first token, and the first inter-token gap it sat in."""
    moved = [r.server for r in joined if r.server.get("transfer_end") is not None]
    if not moved:
        return {}
    times = [s["token_times"] for s in moved]
    return {
        "requests": len(moved),
        "transfer_s": distribution([s["transfer_end"] - s["transfer_start"] for s in moved], (50, 99)),
        "transfer_bytes": distribution([s["transfer_bytes"] for s in moved], (50, 99)),
        "decode_pool_wait_s": distribution(
            [max(0.0, s["transfer_start"] - s["first_token"]) for s in moved if s["first_token"] is not None],
            (50, 99)),
        "first_gap_s": distribution([t[1] - t[0] for t in times if len(t) > 1], (50, 99)),
    }


def device_view(iterations: Sequence[dict]) -> list[dict]:
    """cadence applies iteration i's results while iteration i + 1 runs, so i + 1's wall time is
    mostly the wait for i's device work: each row is i + 1's interval with i's contents. With
    two loops (disaggregated), an iteration is paired with the next of its own pool."""
    rows, last = [], {}
    for it in sorted(iterations, key=lambda it: it["index"]):
        pool = it.get("pool", "colocated")
        before = last.get(pool)
        if before is not None:
            rows.append({**it, "prefill_tokens": before["prefill_tokens"],
                         "prefill_chunks": before["prefill_chunks"], "decode_slots": before["decode_slots"]})
        last[pool] = it
    return rows


def explain_stalls(results: Sequence[RequestResult], window: Window, chat_classes: set[str],
                   iterations: Sequence[dict]) -> dict:
    """For chat message gaps at or above their p99: how many overlapped a server iteration that
    ran prompt prefill, and how much prefill those iterations carried (iterations on the client's
    clock, seen as `device_view` pairs them)."""
    iterations = device_view(iterations)
    gaps = [(r.message_times[i - 1], r.message_times[i]) for r in results if r.cls in chat_classes
            for i in range(1, len(r.message_times)) if _in(r.message_times[i], window)]
    if not gaps or not iterations:
        return {"gaps_examined": 0}
    threshold = percentile([b - a for a, b in gaps], 99)
    long_gaps = [(a, b) for a, b in gaps if b - a >= threshold]
    starts = np.asarray([it["start"] for it in iterations])
    ends = starts + np.asarray([it["wall"] for it in iterations])
    prefill = np.asarray([it["prefill_tokens"] for it in iterations])
    with_prefill, tokens = 0, []
    for a, b in long_gaps:
        overlap = (starts < b) & (ends > a)
        if (prefill[overlap] > 0).any():
            with_prefill += 1
            tokens.append(int(prefill[overlap].sum()))
    longest = int(np.argmax(ends - starts))
    return {
        "threshold_s": threshold, "gaps_examined": len(long_gaps),
        "overlapping_prefill": with_prefill, "fraction_overlapping_prefill": with_prefill / len(long_gaps),
        "prefill_tokens_in_overlapping_iterations_mean": float(np.mean(tokens)) if tokens else None,
        "longest_iteration_s": float(ends[longest] - starts[longest]),
        "longest_iteration_prefill_tokens": int(prefill[longest]),
        "longest_iteration_decode_slots": int(iterations[longest]["decode_slots"]),
    }
