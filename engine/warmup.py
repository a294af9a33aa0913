"""Warm-up: compiling an engine's programs ahead of time, several at once.

    programs = engine.warm_programs(groups)     # [WarmProgram(group, name, fn, args), ...]
    compile_programs(programs, progress)        # each lowered here, compiled on a pool thread

`Engine.warmup` and `Engine.prepare` (a group compiled on first use) compile through here;
`spec` turns a device buffer into the abstract argument a program compiles for.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax


@dataclasses.dataclass(frozen=True)
class WarmProgram:
    """One program warm-up compiles: the jitted `fn` over `args` (device buffers as
    `jax.ShapeDtypeStruct`s with their shardings, host arguments as the engine passes them)."""

    group: str
    name: str  # the program and its bucket, e.g. "decode[batch=8,pages=64]"
    fn: Callable
    args: tuple


def spec(x):
    """`x` as a compile argument: a device array as its shape, dtype and sharding."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.aval.weak_type)
    return x


def compile_programs(programs: Sequence[WarmProgram],
                     progress: Callable[[int, int, str], None] | None = None,
                     workers: int | None = None) -> None:
    """Compiles `programs` ahead of time (`jit(...).lower(...).compile()`, which fills the
    jitted function's own cache, so its first call compiles nothing): each is traced and
    lowered on this thread, in order (that holds the GIL), and compiled on one of `workers`
    threads, which XLA's compiler runs without the GIL (default: one per two cores: on the
    2-core CPU, two at once compiled the default model's 30 programs no faster than one,
    `bench/results/startup-cpu`; with one, each is lowered and compiled on this thread).
    `progress(done, total, name)` after each (on the thread that compiled it)."""
    total, done, lock = len(programs), [0], threading.Lock()

    def finished(name: str, future: Future) -> None:
        if future.exception() is None and progress is not None:
            with lock:
                done[0] += 1
                progress(done[0], total, name)

    workers = workers or max(1, (os.cpu_count() or 1) // 2)
    if workers == 1:  # one after another, on this thread
        for i, p in enumerate(programs, 1):
            p.fn.lower(*p.args).compile()
            if progress is not None:
                progress(i, total, p.name)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="cadence-compile") as pool:
        futures = []
        for p in programs:
            future = pool.submit(p.fn.lower(*p.args).compile)
            future.add_done_callback(functools.partial(finished, p.name))
            futures.append(future)
        for future in futures:
            future.result()
