"""Starting `cadence-serve` as a subprocess for an experiment, on a free loopback port.

    with spawned(ServerConfig(policy="prefill-first", prefill_chunk=256), log="serve.log") as base_url:
        ...  # base_url = "http://127.0.0.1:PORT/v1", answering once /health says 200

The server runs `python -m cadence.server.serve_cli` with this interpreter from the repository root (or
from `ServerConfig.repo`, another checkout, to compare revisions on the same load), its
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
    repo: str | None = None  # a cadence checkout to serve from (another revision); None: this one
    name: str | None = None  # the label in tables; None: POLICY@CHUNK

    @property
    def label(self) -> str:
        return self.name or f"{self.policy}@{self.prefill_chunk}"

    def argv(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "cadence.server.serve_cli", f"--model={self.model}", f"--port={port}",
                "--host=127.0.0.1", f"--num_slots={self.num_slots}", f"--max_seq_len={self.max_seq_len}",
                f"--prefill_chunk={self.prefill_chunk}", f"--policy={self.policy}"]
        if self.token_budget:
            argv.append(f"--token_budget={self.token_budget}")
        if self.repo is None:
            # The bench names the model in its requests as it names it here (a path included);
            # other revisions (`repo`) served that name before --served_model_name existed.
            argv.append(f"--served_model_name={self.model}")
        return argv + list(self.extra_flags)


# `disaggregated@CHUNK`: the prefill engine on device 0, the decode engine on device 1 (on the
# CPU, --num_cpu_devices=2 makes them; on a GPU machine that flag changes nothing).
DISAGGREGATED_FLAGS = ("--num_cpu_devices=2", "--prefill_devices=0", "--decode_devices=1")


def parse_config(item: str, base: ServerConfig) -> ServerConfig:
    """One `cadence-bench compare --configs` entry over `base` (model, slots, context): POLICY@CHUNK,
    then any number of :FLAG=VALUE (passed to cadence-serve as --FLAG=VALUE) or :repo=PATH (serve
    from another checkout), e.g. `chunked@128:kv_reservation=max` or `chunked@128:repo=../old`;
    `disaggregated@128` is `chunked@128` over a prefill device and a decode device."""
    head, *options = item.split(":")
    policy, _, chunk = head.partition("@")
    if policy not in ("chunked", "prefill-first", "disaggregated") or not chunk.isdigit():
        raise ValueError(f"--configs entries are POLICY@CHUNK[:FLAG=VALUE...] (POLICY chunked, "
                         f"prefill-first, or disaggregated: chunked with a prefill and a decode "
                         f"device), got {item!r}")
    extra, repo = [], None
    if policy == "disaggregated":  # on the CPU, two host devices of the same cores
        policy, extra = "chunked", list(DISAGGREGATED_FLAGS)
    for option in options:
        key, eq, value = option.partition("=")
        if not (eq and key and value):
            raise ValueError(f"--configs option {option!r} in {item!r} is not FLAG=VALUE")
        if key == "repo":
            if not (Path(value) / "server" / "serve_cli.py").is_file():
                raise ValueError(f"--configs repo={value} is not a cadence checkout (no server/serve_cli.py)")
            repo = str(Path(value).resolve())
        else:
            extra.append(f"--{key}={value}")
    return dataclasses.replace(base, policy=policy, prefill_chunk=int(chunk), extra_flags=tuple(extra),
                               repo=repo, name=item if options or extra else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").replace("\r", "\n").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(proc: subprocess.Popen, root: str, timeout_s: float, log: Path | None) -> float:
    """Waits until `root`/health answers 200; returns the seconds it took. Raises, with the
    log's tail, if the process exits first or the time runs out."""
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready"
                               + (f"; its log ({log}) ends with:\n{log_tail(log)}" if log else ""))
        try:
            if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s"
                               + (f"; log tail:\n{log_tail(log)}" if log else ""))
        time.sleep(1.0)


def stop(proc: subprocess.Popen | None, timeout_s: float = 60) -> None:
    """SIGTERM (a cadence-serve drains, then exits), and SIGKILL if it has not after `timeout_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serving(command: list[str], port: int, env: dict | None = None,
            health_timeout_s: float = 900.0) -> Iterator[str]:
    """Any server `command` starts (a llama-server, a cadence-serve) listening on `port`, once
    its /health answers 200, its output discarded; stopped when the block ends. Yields its root
    URL."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, root, health_timeout_s, None)
        yield root
    finally:
        stop(proc)


@contextlib.contextmanager
def spawned(config: ServerConfig, log: str | Path, health_timeout_s: float = 1200.0) -> Iterator[str]:
    port = free_port()
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(config.argv(port), cwd=config.repo or REPO, stdout=out, stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{port}"
    try:
        print(f"  starting cadence-serve ({config.label}) on port {port}; log {log}", file=sys.stderr)
        print(f"  ready after {wait_healthy(proc, root, health_timeout_s, log):.0f} s", file=sys.stderr)
        yield f"{root}/v1"
    finally:
        stop(proc)
