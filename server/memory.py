"""The serving process's own memory: what it holds resident, and handing freed memory back.

Loading a model and compiling its programs leave megabytes freed but still held by the C
allocator: the tokenizer's and the checkpoint reader's buffers, XLA's compiler passes (on
Qwen2.5-0.5B, about 300 MiB of the process's resident memory after warm-up). glibc keeps such
memory in its heaps until `malloc_trim` returns their free pages to the kernel; cadence calls it
once the weights are placed and once warm-up is done, the two moments the most was freed.
Elsewhere (another C library, another OS) both functions do nothing and say so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools


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


def _kib(value: str) -> int:
    number, unit = value.split()
    assert unit == "kB", unit
    return int(number) * 1024


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_free() -> bool:
    """Returns the C heap's free pages to the kernel (glibc's `malloc_trim(0)`); False where
    the C library has no such call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
