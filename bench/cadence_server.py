"""Starting `cadence-serve` as a subprocess for an experiment, on a free loopback port.

    with spawned(ServerConfig(policy="prefill-first", prefill_chunk=256), log="serve.log") as base_url:
        ...  # base_url = "http://127.0.0.1:PORT/v1", answering once /health says 200

The server runs `python -m server.serve_cli` with this interpreter from the repository root, its
stdout and stderr go to the log file, and it is stopped with SIGTERM (it drains, then exits) or
killed if it will not. Startup failures raise with the log's tail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str = "smollm2-135m"
    num_slots: int = 8
    max_seq_len: int = 4096
    prefill_chunk: int = 256
    policy: str = "chunked"
    token_budget: int | None = None
    extra_flags: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.policy}@{self.prefill_chunk}"

    def argv(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "server.serve_cli", f"--model={self.model}", f"--port={port}",
                "--host=127.0.0.1", f"--num_slots={self.num_slots}", f"--max_seq_len={self.max_seq_len}",
                f"--prefill_chunk={self.prefill_chunk}", f"--policy={self.policy}"]
        if self.token_budget:
            argv.append(f"--token_budget={self.token_budget}")
        return argv + list(self.extra_flags)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").replace("\r", "\n").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def spawned(config: ServerConfig, log: str | Path, health_timeout_s: float = 1200.0) -> Iterator[str]:
    port = free_port()
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(config.argv(port), cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{port}"
    try:
        start = time.monotonic()
        print(f"  starting cadence-serve ({config.label}) on port {port}; log {log}", file=sys.stderr)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"cadence-serve exited with status {proc.returncode} before it was "
                                   f"ready; its log ({log}) ends with:\n{_tail(log)}")
            try:
                if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - start > health_timeout_s:
                raise RuntimeError(f"cadence-serve was not ready after {health_timeout_s:.0f} s; "
                                   f"log tail:\n{_tail(log)}")
            time.sleep(1.0)
        print(f"  ready after {time.monotonic() - start:.0f} s", file=sys.stderr)
        yield f"{root}/v1"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
