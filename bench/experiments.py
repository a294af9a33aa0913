"""Experiments built from single runs: one run, the policy comparison, the capacity search.

    report = single_run(spec, target, out_dir)
    table = compare(spec, [ServerConfig(policy="prefill-first"), ServerConfig(prefill_chunk=64)], ...)
    found = capacity(spec, {"chat_itl_p99": 0.25, "chat_ttft_p99": 2.0}, target_or_config, ...)

`compare` starts one cadence server per configuration (same model, slots and context; a
different policy or chunk size) and runs the same seeded workload against each. `capacity`
scales the workload's load (open-loop rates, closed-loop concurrencies) by a factor and bisects
for the largest factor whose run meets every SLO; a configured request ceiling is not capacity,
so every point is measured. Each run writes its JSON; plots and tables go beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from cadence.bench import plots
from cadence.bench.cadence_server import ServerConfig, spawned
from cadence.bench.client import Target
from cadence.bench.metrics import token_gaps
from cadence.bench.report import format_summary, load_results, machine, run_report, write_json
from cadence.bench.runner import run_workload
from cadence.bench.workload import WorkloadSpec


def single_run(spec: WorkloadSpec, target: Target, out: Path, config: dict | None = None,
               label: str = "run") -> dict:
    data = asyncio.run(run_workload(spec, target))
    report = run_report(data, config)
    write_json(out / f"{label}.json", report, compact=True)
    print(f"\n== {label} ==\n{format_summary(report['summary'])}", file=sys.stderr)
    return report


def _plots(reports: dict[str, dict], out: Path) -> list[Path]:
    gaps, results = {}, {}
    for label, report in reports.items():
        rs = load_results(report)
        chat = set(report["summary"]["chat_classes"])
        w = tuple(report["summary"]["window_s"])
        gaps[label] = [g for r in rs if r.cls in chat for g in token_gaps(r, w)]
        results[label] = [r for r in rs if w[0] <= r.sent < w[1]]
    written = [plots.itl_cdf(gaps, out / "itl_cdf.png"), plots.ttft_vs_prompt(results, out / "ttft_vs_prompt.png")]
    for label, report in reports.items():
        if report["server"].get("iterations_client_clock"):
            written.append(plots.timeline(report, out / f"timeline-{_safe(label)}.png",
                                          title=f"{label}: server iterations and the streams"))
    return written


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def comparison_row(label: str, summary: dict) -> dict:
    itl = summary["chat_inter_token_s"]
    classes = summary["classes"]

    def ttft(name: str, q: str = "p99"):
        return classes.get(name, {}).get("ttft_s", {}).get(q)

    server = summary.get("server", {})
    transfers = server.get("transfers", {})

    def stat(name: str, q: str):
        return transfers.get(name, {}).get(q)

    return {"config": label, "chat_itl_p50_s": itl["p50"], "chat_itl_p99_s": itl["p99"],
            "chat_itl_max_s": itl["max"], "chat_ttft_p99_s": ttft("chat"), "doc_ttft_p99_s": ttft("document"),
            "doc_ttft_p50_s": ttft("document", "p50"),
            "chat_rate_p50_tok_s": classes.get("chat", {}).get("stream_rate_tok_s", {}).get("p50"),
            "throughput_tok_s": summary["throughput"]["tokens_per_s"],
            # Documents: those sent in the window that finished, of all sent (the rest were
            # refused, failed, or never finished: starved), and prompt tokens served per second.
            "doc_done": classes.get("document", {}).get("ok"),
            "doc_sent": classes.get("document", {}).get("requests"),
            "doc_unfinished": classes.get("document", {}).get("incomplete"),
            "doc_prompt_tok_s": summary["throughput"].get("by_class", {}).get("document", {}).get(
                "prompt_tokens_per_s"),
            "errors": summary["errors"] + summary["rejected"] + summary["incomplete"],
            "itl_basis": itl["basis"],
            # per pool, and the KV handoff when disaggregated (None otherwise)
            "busy": {pool: v["busy_fraction"] for pool, v in server.get("pools", {}).items()},
            "chat_queue_p99_s": server.get("classes", {}).get("chat", {}).get("queue_s", {}).get("p99"),
            "doc_queue_p99_s": server.get("classes", {}).get("document", {}).get("queue_s", {}).get("p99"),
            "transfers": transfers.get("requests"),
            "transfer_p50_s": stat("transfer_s", "p50"), "transfer_p99_s": stat("transfer_s", "p99"),
            "transfer_bytes_p50": stat("transfer_bytes", "p50"),
            "transfer_bytes_p99": stat("transfer_bytes", "p99"),
            "decode_pool_wait_p50_s": stat("decode_pool_wait_s", "p50"),
            "decode_pool_wait_p99_s": stat("decode_pool_wait_s", "p99"),
            "first_gap_p99_s": stat("first_gap_s", "p99")}


def format_comparison(rows: Sequence[dict]) -> str:
    def f(x, d=3):
        return "-" if x is None else f"{x:.{d}f}"

    width = max([20] + [len(r["config"]) for r in rows])
    out = [f"{'config':<{width}} {'chat ITL p50':>12} {'chat ITL p99':>12} {'chat ITL max':>12} "
           f"{'chat TTFT p99':>13} {'doc TTFT p50':>12} {'doc TTFT p99':>12} {'tok/s':>7} {'err':>4} "
           f"{'docs done':>9} {'doc in tok/s':>12}"]
    for r in rows:
        done = "-" if not r.get("doc_sent") else f"{r['doc_done']}/{r['doc_sent']}"
        out.append(f"{r['config']:<{width}} {f(r['chat_itl_p50_s']):>12} {f(r['chat_itl_p99_s']):>12} "
                   f"{f(r['chat_itl_max_s']):>12} {f(r['chat_ttft_p99_s'], 2):>13} {f(r['doc_ttft_p50_s'], 2):>12} "
                   f"{f(r['doc_ttft_p99_s'], 2):>12} {f(r['throughput_tok_s'], 1):>7} {r['errors']:>4} "
                   f"{done:>9} {f(r.get('doc_prompt_tok_s'), 0):>12}")
    out.append("(seconds; ITL across chat streams in the window; throughput = output tokens in the window / "
               "its length; " + (rows[0]["itl_basis"] if rows else "") + "; docs done: documents sent in "
               "the window that finished, of those sent; doc in tok/s: prompt tokens of documents that "
               "finished in the window, per second)")
    if any(r.get("busy") for r in rows):
        out.append("")
        out.append(f"{'config':<{width}} {'busy (per pool)':>28} {'chat queue p99':>14} {'doc queue p99':>13} "
                   f"{'moved':>5} {'KV/request p50':>14} {'transfer p50':>12} {'p99':>8} "
                   f"{'decode wait p99':>15} {'1st gap p99':>11}")
        for r in rows:
            busy = " ".join(f"{pool} {v:.0%}" for pool, v in sorted((r.get("busy") or {}).items())
                            if v is not None)
            mib = None if r["transfer_bytes_p50"] is None else r["transfer_bytes_p50"] / 2**20
            ms = lambda x: "-" if x is None else f"{1e3 * x:.1f} ms"  # noqa: E731
            out.append(f"{r['config']:<{width}} {busy:>28} {f(r['chat_queue_p99_s'], 2):>14} "
                       f"{f(r['doc_queue_p99_s'], 2):>13} {r['transfers'] or '-':>5} "
                       f"{'-' if mib is None else f'{mib:.1f} MiB':>14} {ms(r['transfer_p50_s']):>12} "
                       f"{ms(r['transfer_p99_s']):>8} {f(r['decode_pool_wait_p99_s'], 3):>15} "
                       f"{f(r['first_gap_p99_s'], 3):>11}")
        out.append("(busy: the share of the window each pool's loop spent in iterations; queue: submission "
                   "to admission; transfer: KV ready on the prefill device to landed on the decode device; "
                   "decode wait: first token to the transfer's start, waiting for the decode pool's room; "
                   "1st gap: first to second token, server side)")
    return "\n".join(out)


def slo_verdicts(rows: Sequence[dict], summaries: dict[str, dict], slos: dict[str, float]) -> str:
    """Which configuration meets every target, and whether the colocated one already does (the
    seed's test: if it does, splitting phases is not warranted by this load)."""
    out = ["targets: " + ", ".join(f"{k} {'>=' if '_rate_' in k else '<='} {v:g}" for k, v in slos.items())]
    met = {}
    for r in rows:
        ok, details = check_slos(summaries[r["config"]], slos)
        met[r["config"]] = ok
        misses = [f"{k} {d['value']:.3g}" if d["value"] is not None else f"{k} -"
                  for k, d in details.items() if not d["ok"]]
        out.append(f"  {r['config']}: {'meets every target' if ok else 'misses ' + ', '.join(misses)}")
    colocated = [r["config"] for r in rows if not r.get("transfers") and "disaggregated" not in r["config"]]
    if colocated:
        if any(met[c] for c in colocated):
            out.append(f"the colocated baseline ({', '.join(c for c in colocated if met[c])}) already meets "
                       "the targets on this load: disaggregation is not warranted by it")
        else:
            split = [c for c in met if met[c] and c not in colocated]
            out.append("no colocated configuration meets the targets"
                       + (f"; {', '.join(split)} does" if split else "; neither does any other"))
    return "\n".join(out)


def compare(spec: WorkloadSpec, configs: Sequence[ServerConfig], target: Target, out: Path,
            health_timeout_s: float = 1200.0, slos: dict[str, float] | None = None,
            estimate: str | None = None) -> dict:
    """`target` gives the client settings; its base_url is replaced by each spawned server's.
    With `slos`, the report says which configurations meet them; `estimate` (text) is the
    paper-style transfer estimate printed beside the measurement."""
    reports: dict[str, dict] = {}
    for config in configs:
        with spawned(config, out / f"serve-{_safe(config.label)}.log", health_timeout_s) as base_url:
            t = dataclasses.replace(target, base_url=base_url, model=config.model)
            reports[config.label] = single_run(spec, t, out, {"server": dataclasses.asdict(config)},
                                               label=f"run-{_safe(config.label)}")
    rows = [comparison_row(label, r["summary"]) for label, r in reports.items()]
    table = format_comparison(rows)
    if slos:
        table += "\n\n" + slo_verdicts(rows, {k: r["summary"] for k, r in reports.items()}, slos)
    if estimate:
        table += "\n\nKV handoff, estimated from the model shape:\n" + estimate
    images = _plots(reports, out)
    result = {"workload": spec.describe(), "machine": machine(),
              "servers": [dataclasses.asdict(c) for c in configs], "table": rows, "slos": slos,
              "runs": {label: f"run-{_safe(label)}.json" for label in reports},
              "plots": [p.name for p in images]}
    write_json(out / "compare.json", result)
    (out / "compare.txt").write_text(table + "\n")
    print(f"\n{table}\nwrote {out}/compare.json, compare.txt, {', '.join(p.name for p in images)}", file=sys.stderr)
    return result


# -- capacity -------------------------------------------------------------------------------

_SLO = re.compile(r"^(?:(?P<cls>\w+?)_)?(?P<metric>itl|ttft|completion|rate)_(?P<stat>p\d+|max)$")


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, value = item.partition("=")
        key = key.strip()
        if not value or not (key == "error_rate" or _SLO.match(key)):
            raise ValueError(f"bad SLO {item!r}: use KEY=VALUE with KEY like chat_itl_p99, chat_ttft_p99, "
                             f"document_ttft_p99, chat_completion_p99, chat_rate_p10 (a minimum) or error_rate")
        slos[key] = float(value)
    return slos


def slo_value(summary: dict, key: str) -> float | None:
    if key == "error_rate":
        sent = sum(c["requests"] for c in summary["classes"].values())
        bad = summary["errors"] + summary["rejected"] + summary["incomplete"]
        return bad / sent if sent else None
    m = _SLO.match(key)
    metric, stat = m["metric"], m["stat"]
    if metric == "itl":
        return summary["chat_inter_token_s"].get(stat)
    field = {"ttft": "ttft_s", "completion": "completion_s", "rate": "stream_rate_tok_s"}[metric]
    return summary["classes"].get(m["cls"] or "chat", {}).get(field, {}).get(stat)


def check_slos(summary: dict, slos: dict[str, float]) -> tuple[bool, dict]:
    details = {}
    for key, limit in slos.items():
        value = slo_value(summary, key)
        minimum = "_rate_" in key
        ok = value is not None and (value >= limit if minimum else value <= limit)
        details[key] = {"value": value, "limit": limit, "kind": "min" if minimum else "max", "ok": ok}
    return all(d["ok"] for d in details.values()), details


def capacity(spec: WorkloadSpec, slos: dict[str, float], target: Target, out: Path,
             server: ServerConfig | None = None, low: float = 0.25, high: float = 4.0, steps: int = 4,
             health_timeout_s: float = 1200.0, only: str | None = None) -> dict:
    """Bisects the load factor in [low, high] (of every class, or of class `only` alone, e.g.
    the highest document rate that keeps the chat SLOs); with `server`, starts one cadence for
    all trials."""
    trials: list[dict] = []
    context = spawned(server, out / "serve-capacity.log", health_timeout_s) if server else contextlib.nullcontext(None)
    with context as base_url:
        t = dataclasses.replace(target, base_url=base_url) if base_url else target
        done: dict[str, dict] = {}

        def trial(factor: float) -> dict:
            scaled = spec.scaled(factor, only)
            key = repr(scaled.classes)
            if key not in done:  # concurrency rounding can map two factors to the same load
                label = f"capacity-x{factor:.3f}"
                report = single_run(scaled, t, out, {"capacity_factor": factor}, label=label)
                ok, details = check_slos(report["summary"], slos)
                kv = (report["summary"].get("server") or {}).get("kv", {})
                done[key] = {"factor": factor, "classes": [dataclasses.asdict(c) for c in scaled.classes],
                             "requests_per_s": sum(c["requests"] for c in report["summary"]["classes"].values())
                             / scaled.duration_s,
                             "ok": ok, "slos": details, "kv": kv, "file": f"{label}.json"}
                values = ", ".join(f"{k}={_g(d['value'])}" for k, d in details.items())
                print(f"  load x{factor:.3f}: {'meets' if ok else 'misses'} the SLOs ({values})", file=sys.stderr)
                trials.append(done[key])
            return done[key]

        best = None
        if (first := trial(low))["ok"]:
            best = first
            if (last := trial(high))["ok"]:
                best = last
            else:
                lo, hi = low, high
                for _ in range(steps):
                    mid = (lo * hi) ** 0.5  # geometric: load spans orders of magnitude
                    if (entry := trial(mid))["ok"]:
                        lo, best = mid, max(best, entry, key=lambda e: e["factor"])
                    else:
                        hi = mid
    if best is None:
        note = "no load tried met the SLOs, not even the lowest: lower --load_low"
    elif best["factor"] == high:
        note = "the highest load tried met the SLOs: capacity is at least this; raise --load_high"
    else:
        note = "bisection between a load that met the SLOs and one that did not"
    result = {"slos": slos, "low": low, "high": high, "steps": steps, "scaled_class": only,
              "capacity_factor": None if best is None else best["factor"], "capacity": best, "note": note,
              "trials": trials, "machine": machine(), "workload": spec.describe(),
              "server": dataclasses.asdict(server) if server else {"base_url": target.base_url}}
    write_json(out / "capacity.json", result)
    print(format_capacity(result), file=sys.stderr)
    return result


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def format_capacity(result: dict) -> str:
    lines = [f"{'factor':>8} {'req/s':>7}  {'meets':<6} SLO values"]
    for t in sorted(result["trials"], key=lambda t: t["factor"]):
        lines.append(f"{t['factor']:8.3f} {t['requests_per_s']:7.3f}  {str(t['ok']):<6} "
                     + ", ".join(f"{k}={_g(d['value'])} (<= {d['limit']:g})" if d["kind"] == "max" else
                                 f"{k}={_g(d['value'])} (>= {d['limit']:g})" for k, d in t["slos"].items()))
    at = result["capacity"]
    if at is None:
        lines.append("capacity: the SLOs were not met even at the lowest load tried")
        return "\n".join(lines)
    loads = ", ".join(f"{c['name']} " + (f"{c['rate']:.3g} req/s" if c["rate"] is not None else
                                          f"concurrency {c['concurrency']}") for c in at["classes"])
    lines.append(f"capacity: load x{at['factor']:.3f} ({loads}; {at['requests_per_s']:.3f} req/s sent) "
                 f"- {result['note']}")
    kv = at.get("kv") or {}
    if kv.get("bytes_max") is not None:
        lines.append(f"KV memory in use at that load: mean {kv['bytes_mean'] / 2**20:.1f} MiB, "
                     f"max {kv['bytes_max'] / 2**20:.1f} MiB ({kv['usage_max']:.0%} of the cache)")
        if kv.get("pages_max") is not None:
            lines.append(f"KV pages held at that load: max {kv['pages_max']} of {kv['pages_total']}, "
                         f"{kv['page_utilization_mean']:.0%} of their token slots holding real tokens")
    elif kv.get("usage_max") is not None:
        lines.append(f"KV cache in use at that load: mean {kv['usage_mean']:.0%}, max {kv['usage_max']:.0%}")
    return "\n".join(lines)


def replot(paths: Sequence[str], out: Path) -> list[Path]:
    import json

    reports = {}
    for p in paths:
        report = json.loads(Path(p).read_text())
        server = report["config"].get("server")
        label = f"{server['policy']}@{server['prefill_chunk']}" if server else Path(p).stem
        reports[label] = report
    return _plots(reports, out)
