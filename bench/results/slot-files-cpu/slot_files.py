"""llama-server's slot files on cadence: a long document's prompt computed, saved, and after a
restart restored instead of computed again.

    python bench/results/slot-files-cpu/slot_files.py --out=bench/results/slot-files-cpu/result.json

Starts `cadence-serve` (the default model, --slot_save_path in a temporary folder), sends a
~3000-token document prompt (from the mixed load's corpus) with max_tokens=1 (the time is its
time to first token), saves slot 0, stops the server and starts a new one; there, restores the
file, sends the same prompt again, then erases the slot and sends it once more (computed again,
the control). Reports each time, the file's size, and the cached tokens each answer reports.
Runs alone on the machine: the client is light, the server has the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from cadence.bench.workload import text_of

PORT = 8125
BASE = f"http://127.0.0.1:{PORT}"


def start(folder: str, log) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "cadence.server.serve_cli", f"--port={PORT}",
                               f"--slot_save_path={folder}"], stdout=log, stderr=log)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{BASE}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("the server did not start; see its log")
        time.sleep(1)


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=120)


def ask(prompt: str) -> dict:
    start = time.monotonic()
    answer = httpx.post(f"{BASE}/v1/completions", timeout=600, json={
        "model": "smollm2-135m", "prompt": prompt, "max_tokens": 1, "temperature": 0}).json()
    usage = answer["usage"]
    return {"seconds": time.monotonic() - start, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "text": answer["choices"][0]["text"]}


def action(name: str, body: dict | None = None) -> dict:
    start = time.monotonic()
    answer = httpx.post(f"{BASE}/slots/0?action={name}", json=body, timeout=600).json()
    return {**answer, "client_seconds": time.monotonic() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="slot_files.json")
    parser.add_argument("--tokens", type=int, default=3000)
    args = parser.parse_args()
    prompt = text_of(args.tokens, np.random.default_rng(0))
    result = {"cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name")), "?"), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as folder, open(Path(args.out).with_suffix(".log"), "w") as log:
        server = start(folder, log)
        try:
            result["cold"] = ask(prompt)
            result["save"] = action("save", {"filename": "doc.bin"})
        finally:
            stop(server)
        server = start(folder, log)  # a new process: nothing cached
        try:
            result["restore"] = action("restore", {"filename": "doc.bin"})
            result["restored"] = ask(prompt)
            result["erase"] = action("erase")
            result["recomputed"] = ask(prompt)
        finally:
            stop(server)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
