"""Running cadence's Mosaic GPU kernels on the CPU: JAX's Mosaic GPU interpreter, and the one
thing cadence's kernels use that the JAX 0.10 interpreter lacks.

The interpreter (`InterpretGPUParams`, passed as a kernel's `interpret=`) runs a Mosaic GPU
kernel's jaxpr on the host: GMEM and SMEM buffers, TMA copies, barriers (with their phases) and
the warpgroup matmul are simulated by callbacks, with an optional happens-before race detector,
reads out of bounds raising, and fresh memory filled with NaN. The tests run the kernels there
against the XLA reference; the same kernel code lowers to a `mosaic_gpu` custom call for CUDA.

What it lacks: a `wgmma` operand read through a transposed view of SMEM
(`plgpu.transpose_ref(k_smem, (1, 0))`), which is how an attention kernel multiplies queries by
keys stored row per key, as a Hopper tensor core reads them. `support_transposed_operands`
replaces the interpreter's wgmma callback by one that reads each operand's window as before
and then applies a trailing transpose, leaving every other case as it was. Layout casts
(`plgpu.layout_cast`) have no CPU rule either; the kernels skip them when interpreted
(`model.mosaic_paged.in_layout`): a layout says how a value sits in registers, not what it is.

This reaches into JAX internals; it is written for the pinned JAX minor version (0.10) and
fails loudly on import if they move.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import numpy as np
from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax._src.state.types import TransposeTransform


def _window(memory, key_array, transforms, thread: int, info) -> np.ndarray:
    """An operand's value as a wgmma reads it: its window of the buffer, then a trailing
    transpose if the view ends in one."""
    transforms = tuple(transforms or ())
    permutation = None
    if transforms and isinstance(transforms[-1], TransposeTransform):
        transforms, permutation = transforms[:-1], tuple(transforms[-1].permutation)
    indexers = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(transforms))
    value, _, _ = memory.get_buffer_content(
        gpu_callbacks.HostAllocationKey.from_array(key_array),
        interpret_utils.to_range(indexers), thread, logging_info=info)
    return value if permutation is None else np.transpose(value, permutation)


def _wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array,
           acc_transforms, acc_dtype, a_allocation_key_as_array, a_transforms,
           b_allocation_key_as_array, b_transforms, source_info=None):
    """acc += a @ b, each operand read through its view (the interpreter's callback's
    signature)."""
    memory = gpu_callbacks._get_shared_memory()
    thread = memory.get_global_thread_id(int(device_id), int(thread_id))
    info = interpret_utils.GPULoggingInfo(
        device_id=int(device_id), grid_point_coords=tuple(int(x) for x in grid_point_coords),
        thread_id=int(thread_id), source_info=source_info)
    a = _window(memory, a_allocation_key_as_array, a_transforms, thread, info)
    b = _window(memory, b_allocation_key_as_array, b_transforms, thread, info)
    acc_key = gpu_callbacks.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc_range = interpret_utils.to_range(
        jax.tree.map(int, gpu_callbacks._remove_noop_transforms(acc_transforms)))
    acc, _, _ = memory.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
    memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype),
                                thread, logging_info=info)
    return token


@functools.cache
def support_transposed_operands() -> None:
    """Installs `_wgmma` as the interpreter's wgmma callback (once per process; the
    interpreter looks the callback up when it traces a kernel)."""
    gpu_callbacks.wgmma = _wgmma


_DETECT_RACES = contextvars.ContextVar("cadence_mosaic_detect_races", default=False)


def interpret_params() -> InterpretGPUParams:
    """The interpreter's parameters for a kernel traced now (reads out of bounds raise, fresh
    memory is NaN; the race detector on inside `detecting_races`), with transposed operands
    supported."""
    support_transposed_operands()
    return InterpretGPUParams(detect_races=_DETECT_RACES.get())


@contextlib.contextmanager
def detecting_races():
    """Kernels traced inside it run under the interpreter's happens-before race detector (a
    TMA copy read before its barrier was waited on, two threads writing one buffer); yields a
    function that says whether the last kernel interpreted saw a race."""
    token = _DETECT_RACES.set(True)
    try:
        yield lambda: bool(gpu_callbacks.get_races().races_found)
    finally:
        _DETECT_RACES.reset(token)


def reset() -> None:
    """The interpreter's state after a kernel raised (its documented requirement before the
    next interpreted kernel in the process)."""
    gpu_callbacks.reset_gpu_interpret_mode_state()
