"""Data-dependent control flow that never makes a GPU wait, and the form a program is traced in.

A `lax.cond` whose predicate is computed on the device, or a `lax.while_loop` whose exit is, is
cheap on a CPU: the branch not taken, or the steps not needed, cost nothing. On a GPU, XLA
copies each such predicate back to the host and decides there: the host waits for the device
to drain before it can launch anything after the branch, so a program with one in every
sampling stage returns only once the device is done (the first GPU run measured a Llama-3-8B
decode step at 2.2x its bandwidth roofline with the dispatch taking the whole step,
`bench/results/gpu-2026-12-04/`). So every such branch goes through here, and takes the form
of the platform it is traced for: a branch on the CPU; elsewhere both sides computed and the
result selected, or a loop of fixed trip count whose unneeded steps are masked off by the
caller.

The platform is JAX's default backend when the program is traced, as for the Pallas kernels'
interpret mode (`model.pallas_common`): one form is traced, not both (`lax.platform_dependent`
would trace each side twice, and tracing is most of what a warm start costs).

    when(pred, yes, no, *operands)   yes(*operands) if pred else no(*operands)
    loop(more, body, state, steps)   while more(state): state = body(state), at most `steps`

The Pallas kernels likewise take the form of the platform: compiled on a GPU, interpreted
elsewhere (the CPU tests), except inside `compiled_kernels()`, where they are compiled whatever
the default backend (`default_interpret`). `form()` is both choices at once.

Inside `branch_free()` the GPU's form is traced whatever the default backend: for lowering a
program for a GPU on a machine without one (`engine.lowering.lower`), and for the tests that
run the GPU's form on the CPU against the CPU's (it applies to what is traced inside it: build
and run the programs there; JAX keeps one trace per jitted function and arguments' shapes,
whichever form it took).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
import jax.numpy as jnp

_BRANCH_FREE = contextvars.ContextVar("cadence_branch_free", default=False)


@contextlib.contextmanager
def branch_free():
    """Traces `when` and `loop` in the form they take off the CPU, on any platform."""
    token = _BRANCH_FREE.set(True)
    try:
        yield
    finally:
        _BRANCH_FREE.reset(token)


def branches() -> bool:
    """Whether what is traced now takes the CPU's form (branches and early exits)."""
    return not _BRANCH_FREE.get() and jax.default_backend() == "cpu"


_COMPILED = contextvars.ContextVar("cadence_pallas_compiled", default=False)


def default_interpret() -> bool:
    """Compiled on a GPU, interpreted everywhere else (the CPU tests and CPU serving), except
    inside `compiled_kernels()`."""
    return not _COMPILED.get() and jax.default_backend() != "gpu"


@contextlib.contextmanager
def compiled_kernels():
    """Kernels traced inside it are compiled whatever the default backend: for lowering a
    program for a GPU on a machine without one (`jax.jit(f).trace(...).lower(
    lowering_platforms=("cuda",))`, as `engine.lowering` does), where the default would pick
    interpret mode and lower the XLA loops that emulate the kernel instead of the kernel."""
    token = _COMPILED.set(True)
    try:
        yield
    finally:
        _COMPILED.reset(token)


def form() -> tuple[bool, bool]:
    """The form what is traced now takes: (Pallas kernels interpreted, branches), a cache key
    for traces kept across programs (`model.llama`)."""
    return default_interpret(), branches()


def when(pred: jax.Array, yes: Callable, no: Callable, *operands):
    """`yes(*operands)` where the scalar `pred` holds, else `no(*operands)` (same pytrees)."""
    def select(*ops):
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), yes(*ops), no(*ops))

    if branches():
        return jax.lax.cond(pred, yes, no, *operands)
    return select(*operands)


def loop(more: Callable, body: Callable, state, steps: int):
    """`while more(state): state = body(state)`, run at most `steps` times (a static bound).
    Off the CPU it runs `body` exactly `steps` times: `body` must leave a state it is not
    needed for unchanged (a decode step whose rows have all ended writes nothing), since
    there is no early exit to skip it."""
    def fixed(state):
        if steps == 1:
            return body(state)
        return jax.lax.fori_loop(0, steps, lambda _, s: body(s), state)

    if branches():
        return jax.lax.while_loop(more, body, state)
    return fixed(state)
