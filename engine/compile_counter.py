"""Counts XLA compilations in this process.

Every lowering of a jitted function to an XLA module — whether the executable then comes from
the persistent compilation cache or from the compiler — fires JAX's
`/jax/core/compile/jaxpr_to_mlir_module_duration` event. Counting those events catches any
retrace: a Python constant that changed, a shape that escaped its bucket, a stray `jnp` call on
the host. The engine reads the count at the end of warm-up and exposes the difference.

Programs an engine compiles on first use, after warm-up (`Engine.prepare`), compile inside
`on_demand()` on the thread doing it: they are counted apart (`on_demand_count`), so that the
difference stays 0 for the programs warm-up compiled.
"""

from __future__ import annotations

import contextlib
import threading

from jax import monitoring

_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_count = 0
_on_demand = 0
_installed = False
_local = threading.local()


def _listener(event: str, duration_secs: float, **kwargs) -> None:
    global _count, _on_demand
    if event == _EVENT:
        with _lock:
            _count += 1
            if getattr(_local, "on_demand", False):
                _on_demand += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def count() -> int:
    """Compilations since `install()` was first called."""
    with _lock:
        return _count


def on_demand_count() -> int:
    """Of `count()`, those made inside `on_demand()`."""
    with _lock:
        return _on_demand


@contextlib.contextmanager
def on_demand():
    """Compilations on this thread, inside the block, are on-demand ones."""
    before = getattr(_local, "on_demand", False)
    _local.on_demand = True
    try:
        yield
    finally:
        _local.on_demand = before
