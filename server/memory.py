"""The serving process's own memory: what it holds resident, and handing freed memory back.

Loading a model and compiling its programs leave megabytes freed but still held by the C
allocator: the tokenizer's and the checkpoint reader's buffers, XLA's compiler passes (on
Qwen2.5-0.5B, about 300 MiB of the process's resident memory after warm-up). glibc keeps such
memory in its heaps until `malloc_trim` returns their free pages to the kernel; cadence calls it
once the weights are placed and once warm-up is done, the two moments the most was freed, and
loads under `loading()`, which keeps the loader's large buffers out of the heap altogether.
Elsewhere (another C library, another OS) these do nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from cadence.model import host_memory
from cadence.model.host_memory import glibc


@dataclasses.dataclass(frozen=True)
class Resident:
    now: int   # bytes resident (VmRSS)
    peak: int  # the most ever resident (VmHWM)

    def describe(self) -> str:
        return f"{self.now / 2**20:.0f} MiB resident (peak {self.peak / 2**20:.0f} MiB)"


def resident() -> Resident | None:
    """This process's resident memory, from /proc (None where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return Resident(now=_kib(fields["VmRSS"]), peak=_kib(fields["VmHWM"]))
    except (OSError, KeyError, ValueError):
        return None


def available() -> int | None:
    """Bytes this process can still be given without swapping: /proc/meminfo's MemAvailable,
    or less where a cgroup (v2: a container's memory.max) leaves less; None where neither says."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        free = _kib(fields["MemAvailable"])
    except (OSError, KeyError, ValueError):
        free = None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return free


def _kib(value: str) -> int:
    number, unit = value.split()
    assert unit == "kB", unit
    return int(number) * 1024


# Once the weights are placed and once warm-up is done (the server's two moments).
release_free = host_memory.release_free

_M_MMAP_THRESHOLD = -3  # mallopt's parameter


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """While the weights load and an engine places them: every allocation of 1 MiB or more is
    a mapping of its own, unmapped when freed, so that a buffer the loader lets go of (a part
    of a fused matrix, a reader's buffer) is given back at once rather than left in a heap
    that the next, larger buffer does not fit. With the engine taking the blocks over
    (`cpu_kernels.HandedOver`), loading a Qwen2.5-3B-shaped Q4_K_M model into an engine peaked
    1.2 GB lower (`bench/results/resident-cpu`). Afterwards allocations up to 32 MiB (the most
    glibc's own adaptive threshold reaches) come from the heap, as a long-running process's do
    anyway: a program's temporaries are reused, not mapped anew on every run."""
    mallopt = glibc("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(_M_MMAP_THRESHOLD, 32 << 20)
