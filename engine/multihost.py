"""One engine over the devices of several processes (hosts): JAX's multi-controller model.

    host 0:  cadence-serve --tensor_parallel=2 --coordinator_address=10.0.0.1:1234 \
                 --num_processes=2 --process_id=0
    host 1:  the same command with --process_id=1

`jax.distributed.initialize` joins the processes; `jax.devices()` is then every process's
devices, a tensor-parallel mesh spans them, and each process holds (and restores from the
checkpoint) only its own shards. JAX requires every process to run the same programs in the
same order with the same host arguments. So process 0 runs the front door and the scheduler
as always, with its engine wrapped in a `Leader`: each engine call that runs a program
(prefill, decode, verify, recover, warmup) is first sent to the other processes, then run. They run
`follow`, which makes the same call on their own engine, in the order received. The plan is
the calls' host arguments (a few KB of NumPy per iteration), pickled over
`multiprocessing.connection` on the port after the coordinator's, with an authentication key
(`CADENCE_PLAN_KEY`, default "cadence": set one wherever the network is not private).

Only process 0 reads results: the sampled tokens are replicated, so each process holds a
whole copy, and the engine hands the scheduler its local one.

Limits: JAX has no recovery for a lost process. When a follower dies, the leader's next send
fails, or its next collective waits until jax.distributed's heartbeats give up; restart them
all. Moving KV between engines (disaggregation) is single-process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

import jax
import numpy as np
from absl import logging

from cadence.model.host_sampling import SAMPLER_STATE

# The calls that run programs on every process; everything else an engine answers locally.
BROADCAST = ("prefill", "decode", "decode_forward", "decode_sample", "verify", "set_history",
             "sampler_state", "copy_pages", "recover", "warmup")


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Joins this process to the others (before any JAX operation). On the CPU, collectives
    across processes go through gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id)


@contextlib.contextmanager
def stdout_to_stderr():
    """gloo announces its first connection on the C++ stdout, which is the front doors' output
    (`cadence-generate` prints the text there): send file descriptor 1 to stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def barrier(name: str) -> None:
    """Every process waits here for the others: the first collective, so gloo connects here."""
    from jax.experimental import multihost_utils

    with stdout_to_stderr():
        multihost_utils.sync_global_devices(name)


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (each process must call it)."""
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int32(value))))


def plan_address(coordinator_address: str) -> tuple[str, int]:
    """Where the leader sends the plan: the coordinator's host, the port after its own.
    Followers unpickle what arrives there, so off the loopback interface a key of one's own
    (`CADENCE_PLAN_KEY`) is required."""
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator_address must be host:port, got {coordinator_address!r}")
    if "CADENCE_PLAN_KEY" not in os.environ and host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError("serving over several hosts needs CADENCE_PLAN_KEY (the same secret in "
                         "every process's environment): the engine's plan is authenticated by it")
    return host, int(port) + 1


def _authkey() -> bytes:
    return os.environ.get("CADENCE_PLAN_KEY", "cadence").encode()


class Leader:
    """Process 0's engine: the same engine, whose program-running calls go to every follower
    first. Everything else (config, pages, counters) is the wrapped engine's."""

    def __init__(self, engine, address: tuple[str, int], followers: int):
        self.engine = engine
        self._lock = threading.Lock()  # a call's send and its run are one step, in one order
        with Listener(address, authkey=_authkey()) as listener:
            logging.info("waiting for %d follower(s) on %s:%d", followers, *address)
            self._followers: list[Connection] = [listener.accept() for _ in range(followers)]

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _send(self, name: str, *args) -> None:
        for conn in self._followers:
            conn.send((name, args))

    def _call(self, name: str, *args, local=()):
        with self._lock:
            self._send(name, *args)
            return getattr(self.engine, name)(*args, *local)

    def prefill(self, chunks, sampling, allowed=None):
        return self._call("prefill", list(chunks), sampling, allowed)

    def decode(self, positions, active, sampling, page_table, steps=1):
        return self._call("decode", positions, active, sampling, page_table, steps)

    def decode_forward(self, positions, active, sampling, page_table):
        self._call("decode_forward", positions, active, sampling, page_table)

    def decode_sample(self, allowed, drop=()):
        return self._call("decode_sample", allowed, list(drop))

    def verify(self, positions, active, sampling, page_table, drafts, draft_lens, allowed=None):
        return self._call("verify", positions, active, sampling, page_table, drafts, draft_lens,
                          allowed)

    def set_history(self, slot, prompt_ids, output_ids=(), window=0, dry_breakers=None,
                    sampler_state=(0.0,) * SAMPLER_STATE):
        self._call("set_history", slot, list(prompt_ids), list(output_ids), window,
                   None if dry_breakers is None else list(dry_breakers),
                   [float(v) for v in sampler_state])

    def sampler_state(self, slot):  # (a program over the global history: every process runs it)
        return self._call("sampler_state", slot)

    def copy_pages(self, sources, targets):
        self._call("copy_pages", list(sources), list(targets))

    def recover(self) -> None:
        self._call("recover")

    def warmup(self, progress=None) -> None:
        self._call("warmup", local=(progress,))

    def extract(self, *args):
        raise ValueError("moving KV between engines is not supported across processes")

    insert = receive = extract

    def close(self) -> None:
        """Tells the followers to stop (they also stop when the connection drops)."""
        for conn in self._followers:
            try:
                conn.send(("stop", ()))
                conn.close()
            except OSError:
                pass
        self._followers = []


def follow(engine, address: tuple[str, int], connect_timeout: float = 120.0) -> int:
    """A follower's whole life: connect to the leader, then make each call it sends on
    `engine`, in order, until it says stop or goes away. Returns the calls made."""
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            conn = Client(address, authkey=_authkey())
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no leader listening on {address[0]}:{address[1]} after "
                                   f"{connect_timeout:.0f} s; start process 0") from None
            time.sleep(0.2)
    calls = 0
    with conn:
        while True:
            try:
                name, args = conn.recv()
            except (EOFError, OSError):
                return calls
            if name == "stop":
                return calls
            if name not in BROADCAST:
                raise ValueError(f"the leader sent {name!r}, which is not an engine program")
            try:
                getattr(engine, name)(*args)
            except ValueError:
                # The engine refused the call before running anything: the leader's engine,
                # given the same arguments, refused it too, and its scheduler recovers.
                logging.exception("follower: the engine refused %s, as the leader's did", name)
            except Exception:
                # Failed here alone, perhaps: running on would leave the processes out of
                # step. Exit, so jax.distributed ends the others too.
                logging.exception("follower: %s failed; stopping this process", name)
                raise
            calls += 1
