"""Handing freed C heap memory back to the kernel, where glibc holds it.

glibc keeps freed buffers of less than its mmap threshold in its heaps until `malloc_trim`
returns their free pages; elsewhere (another C library, another OS) these do nothing.
`server.memory` builds serving's memory handling on them; `model.layer_loop` gives back each
role's per-layer matrices as it stacks them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def glibc(name: str):
    """glibc's function `name`, or None under another C library."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


def release_free() -> bool:
    """Returns the C heap's free pages to the kernel (glibc's `malloc_trim(0)`); False where
    the C library has no such call."""
    trim = glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True
