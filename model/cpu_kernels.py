"""cadence's CPU kernels for the decode step (`model/cpu_kernels.cc`), as XLA custom calls.

    if cpu_kernels.available():
        tree = cpu_kernels.decode_params(params)     # once: matrices blocked for the kernel
        tree = cpu_kernels.decode_params(params, packed)  # or some already packed in groups
        y = cpu_kernels.blocked_matmul(x, blocked, n)  # x [..., K] @ W [K, n]
        q, k, v = cpu_kernels.fused_matmul(x, tree[...]["qkv"], (nq, nk, nv))  # one call
        out = cpu_kernels.paged_decode(q, k_pages, v_pages, page_table, q_positions)

Why they exist. A decode step must read every weight and every live KV entry once, so its floor
is those bytes over the memory bandwidth. XLA:CPU misses it twice
(`bench/results/small-gemm-cpu/small_gemm.txt`, `bench/results/kernels-cpu/`): its GEMM packs
the weight matrix anew on every call, so 2-16
rows read the weights at a third of the bandwidth a single row gets; and the paged decode
attention, an XLA loop with a step per page, spends most of its time in loop steps rather than
in reading the pages. The kernels read each byte once, in memory order:
- `blocked_matmul` takes the weights stored blocked, [N / 16, K, 16] (`block`): each run of 16
  output columns is contiguous, so a block streams once while up to four rows accumulate in
  registers, and no packing happens at run time. Over int8 weights (`model.quant`) it widens
  each block in registers and scales the sums per column, so it reads a quarter of the bytes
  (XLA:CPU materializes the conversion instead: `bench/results/int8-cpu/`). Over weights
  quantized in groups of input rows, as GGUF's blocks store them (`pack_grouped`: Q8_0, Q4_0,
  Q4_1 and Q5_0, 32 rows to a float16 scale, or `model.quant.quantize_grouped`;
  `pack_superblocks`: the K-quants Q4_K, Q5_K and Q6_K, super-blocks of 256 rows with a
  float16 scale and integer sub-block scales), each group or super-block of a block is one
  record of scales (and minimums) and 4- to 8-bit codes; the kernel widens the codes in
  registers, sums them against x and scales each group's sums once: the numbers of the float32
  kernel over the dequantized weights (`unpack_grouped` gives them exactly as GGUF's
  dequantizer does), summed in another order, from an eighth to a quarter of the bytes, with
  AVX-512 where the CPU has it. The layout is made once, when an engine
  places its weights; prefill's large GEMMs stay on XLA over the [K, N] weights, where XLA is
  compute-bound and fast (and slower over the blocked layout), so an engine that uses the
  kernel holds each matrix twice.
- `paged_decode` is `model.paged_attention`'s interface for one query token per row: per (row,
  KV head), the row's pages up to its position, online softmax in float32.

They compute in float32, and each is checked against its XLA twin or NumPy
(`tests/test_cpu_kernels.py`); the engine that runs them against the reference generator. Their
work is split between the calling thread and workers of their own, which spin between the
~150 kernel calls of a decode step rather than sleep (`cpu_kernels.cc`'s `Workers`).

Building: the first use compiles `cpu_kernels.cc` with the system's C++ compiler (`$CXX`, else
`c++`) against the XLA FFI headers jaxlib ships, into `$CADENCE_CACHE/kernels/` under a name
that hashes the source, the flags and the jaxlib version (a few seconds, once), loads it with
ctypes and registers its handlers with `jax.ffi`. Where that cannot work (not x86-64 with
AVX2, FMA and F16C, no compiler, `CADENCE_CPU_KERNELS=0`), `available()` is False,
`unavailable_reason()` says why, and the front doors use XLA's paths.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cadence.model.arith import cdiv

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC", "-w")
BLOCK = 16  # output columns per block of the blocked layout (cpu_kernels.cc's kBlock)
# The blocked matmul by the weights' dtype: float32, or a checkpoint's own bfloat16 / float16,
# widened as they are loaded.
MATMUL = {"float32": "cadence_cpu_blocked_matmul", "bfloat16": "cadence_cpu_blocked_matmul_bf16",
          "float16": "cadence_cpu_blocked_matmul_f16"}
MATMUL_INT8 = "cadence_cpu_blocked_matmul_int8"
GROUP = 32  # k-rows per group of the 32-weight formats (GGUF's block of 32 weights)
# The grouped formats (cpu_kernels.cc's layouts): k-rows per record, k-rows per scale, and the
# bytes of one record of a block of 16 columns. q8, q4, q5: GGUF's Q8_0, Q4_0/Q4_1, Q5_0
# (a float16 scale per 32 weights, q4 a minimum too); q4k, q5k, q6k: its K-quants Q4_K, Q5_K,
# Q6_K (256-weight super-blocks of a float16 d (and dmin) and 6-bit or int8 sub-block scales).
FORMATS = {"q8": (32, 32, 544), "q4": (32, 32, 320), "q5": (32, 32, 352),
           "q4k": (256, 32, 2368), "q5k": (256, 32, 2880), "q6k": (256, 16, 3360)}
RECORD = {name: record for name, (_, _, record) in FORMATS.items()}
GROUPED = {name: f"cadence_cpu_grouped_matmul_{name}" for name in FORMATS}
# The same over int8 activations (`activations("int8")`): x quantized per 32 k-rows.
GROUPED_Q8X = {name: f"cadence_cpu_grouped_matmul_{name}_q8x" for name in FORMATS}
DEQUANTIZE = {name: f"cadence_cpu_dequantize_{name}" for name in FORMATS}
# From this many rows, `matmul` runs XLA's GEMM over the matrix dequantized for the call rather
# than the kernel (which reads the blocks once per 4 rows, at its instructions' pace): prefill's
# chunks and a scoring program's every-token logits take the GEMM, decode, verify and a
# prefill's few logit rows the kernel (`bench/results/prefill-blocks-cpu/`).
GEMM_ROWS = 64
# Paged decode attention, by the pool's dtype: float32, or 16-bit pages widened as they are read.
ATTENTION = {"float32": "cadence_cpu_paged_decode", "bfloat16": "cadence_cpu_paged_decode_bf16",
             "float16": "cadence_cpu_paged_decode_f16"}
PAGED_WRITE_16 = "cadence_cpu_paged_write_16"
TAKE_PAGES = {"bfloat16": "cadence_cpu_take_pages_bf16", "float16": "cadence_cpu_take_pages_f16"}


class KernelsUnavailable(RuntimeError):
    """The CPU kernels cannot run here; the message says why."""


def _cache_root() -> Path:
    """`checkpoints.registry.cache_dir()`'s folder (model/ does not import checkpoints/)."""
    return Path(os.environ.get("CADENCE_CACHE") or Path.home() / ".cache" / "cadence") / "kernels"


def _cpu_supports() -> str | None:
    """Why this CPU cannot run the kernels, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are x86-64 (AVX2 + FMA); this machine is {platform.machine()}"
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo")
                      if line.startswith("flags")), [])
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX2 and FMA"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise KernelsUnavailable("no C++ compiler (set $CXX, or install g++)")
    include = jax.ffi.include_dir()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()
                            + jax.__version__.encode() + compiler.encode()).hexdigest()[:16]
    target = _cache_root() / f"cadence_cpu_kernels-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: processes racing to build both succeed.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(built)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelsUnavailable(f"{compiler} failed to build {SOURCE.name}:\n{result.stderr[-2000:]}")
        os.replace(built, target)
    return target


@functools.cache
def _load() -> str | None:
    """Builds, loads and registers the kernels once per process; the reason they are
    unavailable, or None."""
    if os.environ.get("CADENCE_CPU_KERNELS", "1") == "0":
        return "CADENCE_CPU_KERNELS=0"
    reason = _cpu_supports()
    if reason:
        return reason
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
    except (KernelsUnavailable, OSError) as e:
        return str(e)
    for name in (*MATMUL.values(), MATMUL_INT8, *GROUPED.values(), *GROUPED_Q8X.values(),
                 *DEQUANTIZE.values(),
                 *ATTENTION.values(), PAGED_WRITE_16, *TAKE_PAGES.values()):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, name)), platform="cpu")
    return None


def unavailable_reason() -> str | None:
    """None where the kernels run; else why not (building them on the first call)."""
    return _load()


def available() -> bool:
    return _load() is None


def _require() -> None:
    reason = _load()
    if reason:
        raise KernelsUnavailable(f"cadence's CPU kernels are unavailable: {reason}")


# -- the blocked matmul --------------------------------------------------------------------------

def block(w):
    """A [K, N] matrix in the kernel's layout [ceil(N / 16), K, 16] (columns past N are zero).
    NumPy in, NumPy out; a jax array stays where it lies."""
    xp = np if isinstance(w, np.ndarray) else jnp
    k, n = w.shape
    blocks = cdiv(n, BLOCK)
    w = xp.pad(w, ((0, 0), (0, blocks * BLOCK - n)))
    return w.reshape(k, blocks, BLOCK).transpose(1, 0, 2)


def unblock(blocked, n: int):
    """`block`'s inverse: the [K, n] matrix."""
    blocks, k, _ = blocked.shape
    return blocked.transpose(1, 0, 2).reshape(k, blocks * BLOCK)[:, :n]


ACTIVATIONS = ("float32", "int8")
_ACTIVATIONS = contextvars.ContextVar("cadence_cpu_activations", default="float32")


@contextlib.contextmanager
def activations(kind: str):
    """Grouped (GGUF-block) matmuls traced inside it take their activations as `kind`:
    "float32" (the default: the file's own weights against x as it is, the reference's numbers
    summed in another order) or "int8" (x quantized per 32 k-rows, amax / 127, and each group's
    sum an integer dot product, as llama.cpp computes over its quantized weights: faster where
    decode is bound by the kernel's instructions, and no longer the reference's numbers)."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {kind!r}")
    token = _ACTIVATIONS.set(kind)
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def with_activations(fn, kind: str):
    """`fn` traced inside `activations(kind)`, with its signature (so that a jit of it still
    finds its static and donated arguments by name)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with activations(kind):
            return fn(*args, **kwargs)

    return traced


def blocked_matmul(x: jax.Array, blocked: jax.Array, n: int, scale: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ W [K, n] in float32, W given as `block(W)`: float32, bfloat16 or float16
    (widened as read), or int8 with `scale` [n], one per output column (`model.quant`),
    applied to the sums; or W's groups as `pack_grouped` lays them out (uint8 records, their
    scales inside)."""
    _require()
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((rows.shape[0], blocked.shape[0] * BLOCK), jnp.float32)
    if blocked.dtype == jnp.uint8:
        targets = GROUPED_Q8X if _ACTIVATIONS.get() == "int8" else GROUPED
        y = jax.ffi.ffi_call(targets[grouped_format(blocked)], out)(rows, blocked)
    elif blocked.dtype == jnp.int8:
        if scale is None:
            raise ValueError("int8 blocks need their per-column scale")
        scale = jnp.pad(scale.astype(jnp.float32), (0, blocked.shape[0] * BLOCK - n))
        y = jax.ffi.ffi_call(MATMUL_INT8, out)(rows, blocked, scale)
    elif blocked.dtype.name in MATMUL:
        y = jax.ffi.ffi_call(MATMUL[blocked.dtype.name], out)(rows, blocked)
    else:
        y = jax.ffi.ffi_call(MATMUL["float32"], out)(rows, blocked.astype(jnp.float32))
    return y[:, :n].reshape(*lead, n)


def dequantize(blocked: jax.Array, n: int) -> jax.Array:
    """The float32 W [K, n] of a blocked matrix, inside a program: grouped records dequantized
    by the kernel library (`unpack_grouped`'s values, exactly), float32 blocks re-laid, int8
    blocks widened (their per-column scale is the caller's to apply, after the product, as
    `model.llama.Linear` applies it)."""
    if blocked.dtype == jnp.uint8:
        _require()
        fmt = grouped_format(blocked)
        out = jax.ShapeDtypeStruct((blocked.shape[1] * FORMATS[fmt][0], blocked.shape[0] * BLOCK),
                                   jnp.float32)
        return jax.ffi.ffi_call(DEQUANTIZE[fmt], out)(blocked)[:, :n]
    return unblock(blocked, n).astype(jnp.float32)


def take_columns(blocked: jax.Array, ids: jax.Array) -> jax.Array:
    """Columns `ids` of the matrix W [K, N] a blocked array stands for, as rows [*ids.shape, K]
    in float32 (int8 blocks: their codes; the caller scales them): a tied model's embedding
    lookup from its LM head's blocks, so no lookup table is kept beside them. It dequantizes
    the block of 16 columns each id falls in and keeps its column (`dequantize`'s values)."""
    flat = ids.reshape(-1)
    blocks = jnp.take(blocked, flat // BLOCK, axis=0)
    w = dequantize(blocks, blocks.shape[0] * BLOCK)  # [K, ids * 16]
    k = w.shape[0]
    w = w.reshape(k, flat.shape[0], BLOCK)
    columns = jnp.take_along_axis(w, (flat % BLOCK)[None, :, None], axis=2)[..., 0]  # [K, ids]
    return columns.T.reshape(*ids.shape, k)


def _takes_gemm(x: jax.Array) -> bool:
    """Whether `matmul` gives x's rows to XLA's GEMM (from `GEMM_ROWS`) rather than the kernel."""
    return int(np.prod(x.shape[:-1])) >= GEMM_ROWS


def matmul(x: jax.Array, blocked: jax.Array, n: int, scale: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ W [K, n] for W blocked, whatever the rows: the kernel (`blocked_matmul`)
    below `GEMM_ROWS` rows, else XLA's GEMM over W dequantized for this call (`dequantize`: a
    [K, n] float32 temporary, one matrix at a time, not a second copy of the weights). The
    same numbers either way, summed in another order."""
    if not _takes_gemm(x):
        return blocked_matmul(x, blocked, n, scale)
    if blocked.dtype == jnp.int8 and scale is None:
        raise ValueError("int8 blocks need their per-column scale")
    x = x.astype(jnp.float32)
    # One matrix's temporary at a time, as XLA:CPU orders a program for memory (cadence's
    # default: `cadence/__init__.py`); ordered for concurrency it holds every layer's at once.
    y = jax.lax.dot_general(x, dequantize(blocked, n), (((x.ndim - 1,), (0,)), ((), ())))
    return y * scale.astype(jnp.float32) if blocked.dtype == jnp.int8 else y


# -- grouped formats ----------------------------------------------------------------------------

def grouped_format(blocked) -> str:
    """Which grouped format (`FORMATS`) a uint8 array of records holds (by its record size)."""
    for name, size in RECORD.items():
        if blocked.ndim == 3 and blocked.shape[-1] == size:
            return name
    raise ValueError(f"{blocked.dtype}{list(blocked.shape)} is not a grouped matrix; want "
                     f"[N / 16, K / 32 or K / 256, record] with a record of "
                     f"{sorted(RECORD.values())} bytes")


# The layout's pieces: each takes a per-k-row (or per-group) array [rows, N] and gives, per
# block of 16 columns and record of `per_record` of its rows, those rows' 16-column runs
# one after another as bytes: [blocks, records, bytes].

def _runs(a: np.ndarray, per_record: int) -> np.ndarray:
    rows, n = a.shape
    blocks = cdiv(n, BLOCK)
    a = np.pad(a, ((0, 0), (0, blocks * BLOCK - n))).reshape(rows // per_record, per_record, blocks, BLOCK)
    return a.transpose(2, 0, 1, 3).copy().view(np.uint8).reshape(blocks, rows // per_record, -1)


def _pairs(codes: np.ndarray, per_record: int) -> np.ndarray:
    """4-bit codes [K, N], two k-rows to a byte (the even one in the low nibble)."""
    codes = codes.astype(np.uint8)
    return _runs(codes[0::2] | (codes[1::2] << 4), per_record // 2)


def _plane(bits: np.ndarray, width: int, per_record: int) -> np.ndarray:
    """`width`-bit values [K, N], 8 / width consecutive k-rows to a byte, the first lowest."""
    per_byte = 8 // width
    bits = bits.astype(np.uint8)
    byte = sum(bits[j::per_byte] << (j * width) for j in range(per_byte)).astype(np.uint8)
    return _runs(byte, per_record // per_byte)


def _unruns(packed: np.ndarray, at: int, count: int, dtype) -> np.ndarray:
    """`_runs`' inverse for the `count` runs at byte `at` of each record: [records * count,
    blocks * 16] of `dtype`."""
    blocks, records, _ = packed.shape
    size = count * BLOCK * np.dtype(dtype).itemsize
    a = packed[..., at:at + size].copy().view(dtype).reshape(blocks, records, count, BLOCK)
    return a.transpose(1, 2, 0, 3).reshape(records * count, blocks * BLOCK)


def _unpairs(packed: np.ndarray, at: int, per_record: int) -> np.ndarray:
    pairs = _unruns(packed, at, per_record // 2, np.uint8)
    return np.stack([pairs & 15, pairs >> 4], axis=1).reshape(-1, pairs.shape[1])


def _unplane(packed: np.ndarray, at: int, width: int, per_record: int) -> np.ndarray:
    per_byte = 8 // width
    byte = _unruns(packed, at, per_record // per_byte, np.uint8)
    mask = (1 << width) - 1
    return np.stack([(byte >> (j * width)) & mask for j in range(per_byte)], axis=1).reshape(-1, byte.shape[1])


def pack_grouped(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None = None,
                 fmt: str | None = None) -> np.ndarray:
    """A matrix W [K, N] quantized in groups of 32 k-rows, as the grouped kernels read it:
    uint8 [ceil(N / 16), K / 32, record]. q8 (the default without `minimum`): q int8 [K, N],
    W = q * scale; q4 (with `minimum`): q the 4-bit codes 0..15 [K, N] (any integer dtype),
    W = q * scale + minimum; q5 (`fmt="q5"`, GGUF's Q5_0): q -16..15, W = q * scale.
    `scale`, `minimum` [K / 32, N], stored as float16 (the values GGUF files hold). Columns past
    N are zero."""
    fmt = fmt or ("q8" if minimum is None else "q4")
    k, n = q.shape
    if k % GROUP or scale.shape != (k // GROUP, n) or (minimum is not None and minimum.shape != scale.shape):
        raise ValueError(f"q {list(q.shape)} needs K a multiple of {GROUP} and scales of shape "
                         f"[{k // GROUP}, {n}], got {list(scale.shape)}")
    if (minimum is not None) != (fmt == "q4"):
        raise ValueError(f"{fmt} takes {'a' if fmt == 'q4' else 'no'} minimum")
    scales = _runs(np.asarray(scale, np.float16), 1)
    if fmt == "q8":
        return np.concatenate([scales, _runs(np.asarray(q, np.int8), GROUP)], axis=-1)
    if fmt == "q4":
        codes = np.asarray(q, np.uint8)
        if codes.max(initial=0) > 15:
            raise ValueError("q4 codes must lie in 0..15")
        return np.concatenate([scales, _runs(np.asarray(minimum, np.float16), 1),
                               _pairs(codes, GROUP)], axis=-1)
    if fmt != "q5":
        raise ValueError(f"pack_grouped packs q8, q4 and q5, not {fmt!r} (see pack_superblocks)")
    q = np.asarray(q)
    if q.min(initial=0) < -16 or q.max(initial=0) > 15:
        raise ValueError("q5 codes must lie in -16..15")
    codes = (q.astype(np.int16) + 16).astype(np.uint8)
    return np.concatenate([scales, _plane(codes >> 4, 1, GROUP), _pairs(codes & 15, GROUP)], axis=-1)


def pack_superblocks(fmt: str, q: np.ndarray, d: np.ndarray, sub_scale: np.ndarray,
                     dmin: np.ndarray | None = None, sub_min: np.ndarray | None = None) -> np.ndarray:
    """A matrix W [K, N] in one of GGUF's K-quants, as the grouped kernels read it: uint8
    [ceil(N / 16), K / 256, record]. Per super-block of 256 k-rows and column, a float16 `d`
    (and `dmin`) [K / 256, N]; per sub-block, an integer `sub_scale` (and `sub_min`):
    q4k / q5k: codes q 0..15 / 0..31 [K, N], sub-blocks of 32 k-rows with 6-bit scales and
    minimums [K / 32, N], W = (d * sub_scale) * q - (dmin * sub_min);
    q6k: codes q -32..31, sub-blocks of 16 k-rows with int8 scales [K / 16, N], no minimums,
    W = (d * sub_scale) * q. The products are computed in float32, as GGUF's dequantizer does
    (and are exact). Columns past N are zero."""
    if fmt not in ("q4k", "q5k", "q6k"):
        raise ValueError(f"pack_superblocks packs q4k, q5k and q6k, not {fmt!r}")
    rows, sub, _ = FORMATS[fmt]
    k, n = q.shape
    want = {"d": (d, (k // rows, n)), "sub_scale": (sub_scale, (k // sub, n))}
    if fmt != "q6k":
        want.update(dmin=(dmin, (k // rows, n)), sub_min=(sub_min, (k // sub, n)))
    elif dmin is not None or sub_min is not None:
        raise ValueError("q6k has no minimums")
    for name, (a, shape) in want.items():
        if k % rows or a is None or np.shape(a) != shape:
            raise ValueError(f"{fmt}: q {list(q.shape)} needs K a multiple of {rows} and {name} "
                             f"of shape {list(shape)}, got {None if a is None else list(np.shape(a))}")
    q = np.asarray(q)
    low, high = {"q4k": (0, 15), "q5k": (0, 31), "q6k": (-32, 31)}[fmt]
    if q.min(initial=0) < low or q.max(initial=0) > high:
        raise ValueError(f"{fmt} codes must lie in {low}..{high}")
    low, high = (-128, 127) if fmt == "q6k" else (0, 63)
    for a in (sub_scale, sub_min):
        if a is not None and (np.min(a, initial=0) < low or np.max(a, initial=0) > high):
            raise ValueError(f"{fmt} sub-block scales and minimums must lie in {low}..{high}")
    ds = _runs(np.asarray(d, np.float16), 1)
    if fmt == "q6k":
        codes = (q.astype(np.int16) + 32).astype(np.uint8)
        return np.concatenate([ds, _runs(np.asarray(sub_scale, np.int8), rows // sub),
                               _plane(codes >> 4, 2, rows), _pairs(codes & 15, rows)], axis=-1)
    codes = q.astype(np.uint8)
    parts = [ds, _runs(np.asarray(dmin, np.float16), 1), _runs(np.asarray(sub_scale, np.uint8), rows // sub),
             _runs(np.asarray(sub_min, np.uint8), rows // sub)]
    if fmt == "q5k":
        parts.append(_plane(codes >> 4, 1, rows))
    return np.concatenate(parts + [_pairs(codes & 15, rows)], axis=-1)


def unpack_grouped(blocked: np.ndarray, n: int) -> np.ndarray:
    """The float32 W [K, n] a `pack_grouped` or `pack_superblocks` array stands for, computed
    as GGUF's dequantizer computes it (the slow path the kernels are checked against, and the
    weights prefill and the reference read)."""
    blocked = np.asarray(blocked)
    fmt = grouped_format(blocked)
    rows, sub, _ = FORMATS[fmt]
    f32 = np.float32

    def per_sub(a: np.ndarray) -> np.ndarray:  # one value per sub-block -> per k-row
        return np.repeat(a.astype(f32), sub, axis=0)

    if fmt in ("q8", "q4", "q5"):
        scale = per_sub(_unruns(blocked, 0, 1, np.float16))
        if fmt == "q8":
            w = _unruns(blocked, 2 * BLOCK, GROUP, np.int8).astype(f32) * scale
        elif fmt == "q4":
            w = _unpairs(blocked, 4 * BLOCK, GROUP).astype(f32) * scale + per_sub(
                _unruns(blocked, 2 * BLOCK, 1, np.float16))
        else:
            codes = _unpairs(blocked, 6 * BLOCK, GROUP) | (_unplane(blocked, 2 * BLOCK, 1, GROUP) << 4)
            w = scale * (codes.astype(np.int8) - np.int8(16)).astype(f32)
        return w[:, :n]
    per_super = rows // sub
    d = np.repeat(_unruns(blocked, 0, 1, np.float16).astype(f32), per_super, axis=0)
    if fmt == "q6k":
        scale = per_sub(d * _unruns(blocked, 2 * BLOCK, per_super, np.int8).astype(f32))
        at = 18 * BLOCK
        codes = _unpairs(blocked, at + 64 * BLOCK, rows) | (_unplane(blocked, at, 2, rows) << 4)
        return (scale * (codes.astype(np.int8) - np.int8(32)).astype(f32))[:, :n]
    dmin = np.repeat(_unruns(blocked, 2 * BLOCK, 1, np.float16).astype(f32), per_super, axis=0)
    scale = per_sub(d * _unruns(blocked, 4 * BLOCK, per_super, np.uint8).astype(f32))
    minimum = per_sub(dmin * _unruns(blocked, 12 * BLOCK, per_super, np.uint8).astype(f32))
    at = 20 * BLOCK
    if fmt == "q5k":
        codes = _unpairs(blocked, at + 32 * BLOCK, rows) | (_unplane(blocked, at, 1, rows) << 4)
    else:
        codes = _unpairs(blocked, at, rows)
    return (scale * codes.astype(f32) - minimum)[:, :n]


# Projections that read the same input, run as one kernel call in a decode tree: the fused
# matrix is the parts' blocks one after another, so each part starts on a block boundary.
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def _padded(n: int) -> int:
    return cdiv(n, BLOCK) * BLOCK


class HandedOver(dict):
    """Packed matrices given to one engine for good (`Engine(packed=HandedOver(...))`): it takes
    each out as it places it, so that where the caller keeps no other reference, the parts of
    a fused q/k/v or gate/up matrix (a new buffer) go as soon as it is made, rather than all
    of them outliving the engine's construction."""


def decode_params(params: dict[str, Any], packed: dict[tuple[str, ...], Any] | None = None) -> dict[str, Any]:
    """The tree an engine's programs read with the kernel: every `kernel` [in, out] replaced by
    `kernel_blocked`, and where the head is tied (no `lm_head` in the tree) the embedding
    replaced by `embedding_blocked`, its transpose blocked: the LM head, whose columns the
    lookup reads (`take_columns`); an untied model's head is lm_head's own matrix, and its
    embedding stays a lookup table, unless `packed` holds it (then the lookup reads those
    blocks). Float32 or int8 as given (int8 keeps its `_scale` leaves).
    `packed`: matrices already in a grouped format (`pack_grouped`; GGUF's own blocks, from
    `checkpoints.gguf.load_packed`) by their path in `params`, which the kernel reads instead
    of blocking the float matrix (the embedding's entry is the embedding transposed, as a
    tied head's is). The projections of one input (`FUSED`: q/k/v, gate/up) become one matrix
    each, `qkv` and `gate_up`, read by `fused_matmul`: 4 matmul calls per layer instead of 7,
    and each longer to split over the threads (a decode step of SmolLM2-135M at 8 rows 1-3%
    faster, interleaved A/B on a 2-core EPYC). Everything else is the same array. A
    `HandedOver` `packed` is emptied as its matrices are placed."""
    packed = packed if packed is not None else {}
    take = packed.pop if isinstance(packed, HandedOver) else packed.__getitem__
    tied = "lm_head" not in params

    def fusible(parts: list[Any]) -> bool:
        """Projections alike: blocked matrices of one dtype and layout, with the same
        per-column leaves."""
        if not all(isinstance(p, dict) and "kernel_blocked" in p for p in parts):
            return False
        leaves = set(parts[0])
        return (leaves <= {"kernel_blocked", "kernel_scale", "bias"}
                and all(set(p) == leaves for p in parts)
                and len({(p["kernel_blocked"].dtype, p["kernel_blocked"].shape[1:]) for p in parts}) == 1)

    def fuse(parts: list[dict[str, Any]]) -> dict[str, Any]:
        fused = {"kernel_blocked": jnp.concatenate([p["kernel_blocked"] for p in parts])}
        for leaf in ("kernel_scale", "bias"):  # per column: padded to each part's blocks
            if leaf in parts[0]:
                fused[leaf] = jnp.concatenate([
                    jnp.pad(p[leaf], (0, _padded(p[leaf].shape[0]) - p[leaf].shape[0]))
                    for p in parts])
        return fused

    def matrix(path: tuple[str, ...], array):
        if path in packed:
            return jax.device_put(take(path), _device_of(array))
        return block(array.T if path[-1] == "embedding" else array)

    def convert(node, path: tuple[str, ...]):
        if not isinstance(node, dict):
            return node
        node = {name: convert(child, path + (name,)) for name, child in node.items()}
        if "kernel" in node:
            node["kernel_blocked"] = matrix(path + ("kernel",), node.pop("kernel"))
        if "embedding" in node and (tied or path + ("embedding",) in packed):
            # the head's blocks (or an untied table's own) serve the lookup (`take_columns`)
            node["embedding_blocked"] = matrix(path + ("embedding",), node.pop("embedding"))
        for name, parts in FUSED.items():
            if fusible([node.get(p) for p in parts]):
                node[name] = fuse([node.pop(p) for p in parts])
        return node

    return convert(params, ())


def is_blocked(path) -> bool:
    """Whether a `decode_params` leaf's key path (`jax.tree_util`'s) names a kernel-layout
    matrix (`kernel_blocked`, `embedding_blocked`), which keeps its own dtype."""
    return str(getattr(path[-1], "key", "")).endswith("_blocked")


def blocked_bytes(tree: dict[str, Any]) -> int:
    """Bytes of the kernel-layout matrices in a `decode_params` tree (its copy of the weights)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return sum(leaf.nbytes for path, leaf in leaves if is_blocked(path))


def _device_of(array) -> jax.Device | None:
    """Where a leaf lies (None for NumPy: jax's default)."""
    devices = getattr(array, "devices", None)
    return next(iter(devices())) if devices else None


def fused_matmul(x: jax.Array, fused: dict[str, jax.Array], sizes: tuple[int, ...]) -> list[jax.Array]:
    """x @ each part of a fused matrix (`decode_params`' `qkv`, `gate_up`) whose parts have
    `sizes` output columns, in one kernel call; bias added where the tree has one."""
    blocked, scale, bias = fused["kernel_blocked"], fused.get("kernel_scale"), fused.get("bias")
    columns = blocked.shape[0] * BLOCK
    if sum(_padded(n) for n in sizes) != columns:
        raise ValueError(f"parts of {sizes} columns do not make the fused matrix's {columns}")
    starts = np.cumsum([0] + [_padded(n) for n in sizes])
    if not _takes_gemm(x):  # one kernel call
        y = blocked_matmul(x, blocked, columns, scale)
        parts = [y[..., start:start + n] for start, n in zip(starts, sizes)]
    else:  # a GEMM a part, each over its own blocks, as the unfused matrices would run
        parts = [matmul(x, blocked[start // BLOCK:(start + _padded(n)) // BLOCK], n,
                        None if scale is None else scale[start:start + n])
                 for start, n in zip(starts, sizes)]
    if bias is not None:
        parts = [y + bias[start:start + n] for y, start, n in zip(parts, starts, sizes)]
    return parts


# -- paged decode attention ----------------------------------------------------------------------

def paged_decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                 q_positions: jax.Array) -> jax.Array:
    """`model.paged_attention`'s interface for one query per row (q [rows, 1, heads, d]):
    keys 0..q_positions[row, 0] of the row's pages; -1 gives zeros. Computed in float32 over
    pools of float32, bfloat16 or float16 (widened as read, exactly)."""
    _require()
    rows, q_len, heads, head_dim = q.shape
    if q_len != 1:
        raise ValueError(f"paged_decode takes one query per row, got {q_len}")
    if k_pages.dtype.name not in ATTENTION or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"paged_decode reads pools of {', '.join(ATTENTION)}, got "
                         f"{k_pages.dtype} and {v_pages.dtype}")
    out_shape = jax.ShapeDtypeStruct((rows, heads, head_dim), jnp.float32)
    out = jax.ffi.ffi_call(ATTENTION[k_pages.dtype.name], out_shape)(
        q.reshape(rows, heads, head_dim).astype(jnp.float32), k_pages, v_pages,
        page_table.astype(jnp.int32), q_positions[:, 0].astype(jnp.int32))
    return out.reshape(rows, 1, heads, head_dim).astype(q.dtype)


def paged_write(pages: jax.Array, values: jax.Array, page: jax.Array, slot: jax.Array) -> jax.Array:
    """A 16-bit pool (bfloat16 or float16, [kv_heads, num_pages, page_size, d]) with `values`
    [rows, t, kv_heads, d] written in place at each token's `page` and `slot` [rows, t]; a
    token whose page is outside the pool is dropped. What `model.paged_kv.write`'s scatter
    does, bit for bit (the values are rounded to the pool's dtype first, as there), without
    XLA:CPU's float32 round trip of the whole pool around a 16-bit scatter: on Qwen2.5-0.5B's
    bfloat16 pool that round trip made decode 3x slower than over a float32 pool
    (`bench/results/kv16-write-cpu/`)."""
    _require()
    if pages.dtype.itemsize != 2:
        raise ValueError(f"paged_write writes 16-bit pools, got {pages.dtype}")
    return jax.ffi.ffi_call(PAGED_WRITE_16, jax.ShapeDtypeStruct(pages.shape, pages.dtype),
                            input_output_aliases={0: 0})(
        pages, values.astype(pages.dtype), page.astype(jnp.int32), slot.astype(jnp.int32))


def take_pages(pages: jax.Array, ids: jax.Array) -> jax.Array:
    """Pages `ids` [n] (clipped into the pool) of a 16-bit pool [kv_heads, num_pages, page_size,
    d], widened to float32: `jnp.take(pages, ids, axis=1, mode="clip").astype(float32)`, to
    the bit (the widening is exact), without XLA:CPU widening the whole pool layer before its
    16-bit gather (which it hoists out of prefill's loop over key tiles, once per layer)."""
    _require()
    if pages.dtype.name not in TAKE_PAGES:
        raise ValueError(f"take_pages reads pools of {', '.join(TAKE_PAGES)}, got {pages.dtype}")
    kv_heads, _, page_size, d = pages.shape
    out = jax.ShapeDtypeStruct((kv_heads, ids.shape[0], page_size, d), jnp.float32)
    return jax.ffi.ffi_call(TAKE_PAGES[pages.dtype.name], out)(pages, ids.astype(jnp.int32))
