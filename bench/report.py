"""One run's JSON file and printed table, and a description of the machine it ran on.

    report = run_report(data)                 # config, machine, summary, records, server timeline
    write_json(path, report); print(format_summary(report["summary"]))

Client side: standard library, numpy and the other client modules only.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

from cadence.bench.client import RequestResult
from cadence.bench.metrics import server_metrics, summarize
from cadence.bench.runner import RunData


def machine() -> dict:
    """The machine the benchmark ran on (client side; a spawned cadence ran here too)."""
    info: dict = {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    versions = {}
    for package in ("jax", "jaxlib", "httpx", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    info["packages"] = versions
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            info["gpus"] = out.splitlines()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def run_report(data: RunData, config: dict | None = None) -> dict:
    summary = summarize(data.results, data.window, data.chat_classes(), [c.name for c in data.spec.classes])
    if data.server.get("kind") == "cadence-timeline":
        summary["server"] = server_metrics(data.results, data.window, data.chat_classes(),
                                           data.server.get("iterations_client_clock", []),
                                           data.server.get("samples", []))
    elif data.server.get("samples"):
        kv = [s["kv_usage"] for s in data.server["samples"] if data.window[0] <= s["t"] < data.window[1]]
        summary["server"] = {"kv": {"usage_mean": sum(kv) / len(kv) if kv else None,
                                    "usage_max": max(kv) if kv else None}}
    target = dataclasses.asdict(data.target)
    if target.get("api_key"):
        target["api_key"] = "<set>"
    return {
        "config": {"workload": data.spec.describe(), "target": target, **(config or {})},
        "machine": machine(),
        "wall_s": data.wall_s,
        "summary": summary,
        "records": [r.to_dict() for r in data.results],
        "server": data.server,
    }


def load_results(report: dict) -> list[RequestResult]:
    return [RequestResult.from_dict(d) for d in report["records"]]


def write_json(path: str | Path, obj: dict, compact: bool = False) -> Path:
    """Indented JSON; `compact` (run files, which hold every message's time) without spaces."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj, indent=1))
    return path


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_summary(summary: dict) -> str:
    w = summary["window_s"]
    lines = [f"{'class':<10} {'reqs':>5} {'ok':>4} {'err':>4} {'429':>4} {'inc':>4}  "
             f"{'TTFT p50/p90/p99 s':<20} {'rate p50/p10 tok/s':<19} {'done p50/p99 s':<15} in/out tok"]
    for name, c in summary["classes"].items():
        t, r, d = c["ttft_s"], c["stream_rate_tok_s"], c["completion_s"]
        lines.append(
            f"{name:<10} {c['requests']:>5} {c['ok']:>4} {c['errors']:>4} {c['rejected']:>4} {c['incomplete']:>4}  "
            f"{_f(t['p50'])}/{_f(t['p90'])}/{_f(t['p99']):<8} {_f(r['p50'], 1)}/{_f(r['p10'], 1):<12} "
            f"{_f(d['p50'], 1)}/{_f(d['p99'], 1):<9} {_f(c['prompt_tokens_mean'], 0)}/{_f(c['output_tokens_mean'], 0)}")
    itl = summary["chat_inter_token_s"]
    lines.append(f"chat inter-token delay ({itl['basis']}): p50 {_f(itl['p50'], 3)} s, p99 {_f(itl['p99'], 3)} s, "
                 f"max {_f(itl['max'], 3)} s (n={itl['n']})")
    together = itl.get("deliveries")
    if together and together["messages_per_delivery_max"] and together["messages_per_delivery_max"] > 1:
        g = together["gaps_s"]
        lines.append(f"  tokens arrived together ({together['together']}): "
                     f"{_f(together['messages_per_delivery_mean'], 2)} messages per delivery (max "
                     f"{together['messages_per_delivery_max']}); gaps between deliveries p50 "
                     f"{_f(g['p50'], 3)} s, p99 {_f(g['p99'], 3)} s, max {_f(g['max'], 3)} s")
    tp = summary["throughput"]
    lines.append(f"aggregate output throughput: {tp['tokens_per_s']:.1f} tok/s over [{w[0]:g}, {w[1]:g}) s "
                 f"({tp['output_tokens']} tokens, {tp['basis']})")
    server = summary.get("server")
    if server and "stalls" in server:
        s, kv = server["stalls"], server["kv"]
        for name, c in server["classes"].items():
            lines.append(f"server {name}: queue p99 {_f(c['queue_s']['p99'])} s, TTFT p50/p99 "
                         f"{_f(c['server_ttft_s']['p50'])}/{_f(c['server_ttft_s']['p99'])} s, "
                         f"client-server TTFT p50 {_f(c['client_minus_server_ttft_s']['p50'], 3)} s, "
                         f"prefill chunks mean {_f(c['prefill_chunks_mean'], 1)}")
        sg = server["chat_inter_token_server_s"]
        lines.append(f"server chat inter-token: p99 {_f(sg['p99'], 3)} s, max {_f(sg['max'], 3)} s")
        if s.get("gaps_examined"):
            lines.append(f"chat gaps >= p99 ({_f(s['threshold_s'], 3)} s): {s['overlapping_prefill']}/"
                         f"{s['gaps_examined']} overlapped a prefill iteration; longest iteration "
                         f"{_f(s['longest_iteration_s'], 3)} s ({s['longest_iteration_prefill_tokens']} prefill "
                         f"tokens, {s['longest_iteration_decode_slots']} decodes)")
        if kv.get("bytes_max") is not None:
            lines.append(f"KV in use: mean {kv['bytes_mean'] / 2**20:.1f} MiB, max {kv['bytes_max'] / 2**20:.1f} MiB "
                         f"({kv['usage_max']:.0%} of the cache)")
    return "\n".join(lines)
