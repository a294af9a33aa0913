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
  quantized in groups of input rows, as GGUF's blocks store them (`pack_grouped`: Q8_0, Q4_x,
  Q5_x and IQ4_NL, 32 rows to a float16 scale, or `model.quant.quantize_grouped`;
  `pack_superblocks`: the K-quants Q2_K to Q6_K and IQ4_XS, super-blocks of 256 rows
  with a float16 scale and integer sub-block scales), each group or super-block of a block is one
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

Building: the first use compiles `cpu_kernels.cc` (with the parts it includes, `csrc/*.h`) with
the system's C++ compiler (`$CXX`, else `c++`) against the XLA FFI headers jaxlib ships, into
`$CADENCE_CACHE/kernels/` under a name that hashes the sources, the flags and the jaxlib
version (a few seconds, once), loads it with
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
from flax import struct

from cadence.model.arith import cdiv
from cadence.model.block_layout import BLOCK, FORMATS, block, grouped_format, unblock

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
SOURCES = (SOURCE, *sorted((SOURCE.parent / "csrc").glob("*.h")))  # the parts it includes
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC", "-w")
MATMUL_INT8 = "cadence_cpu_blocked_matmul_int8"
# Every matrix the matmul and the dequantizer read but int8 blocks: float blocks (float32, or a
# checkpoint's own bfloat16 / float16, widened as read) or grouped records, by their code in
# cpu_kernels.cc (`Format`). One handler each reads any of them, in a buffer of one matrix or of
# every layer's (`Stacked`), dispatching on the format.
FORMAT_CODES = {name: code for code, name in enumerate(("float32", "bfloat16", "float16", *FORMATS))}
LAYERED_MATMUL = "cadence_cpu_layered_matmul"  # over int8 activations too (`activations`)
LAYERED_DEQUANTIZE = "cadence_cpu_layered_dequantize"
# From this many rows, `matmul` runs XLA's GEMM over the matrix dequantized for the call rather
# than the kernel (which reads the blocks once per 4 rows, at its instructions' pace): prefill's
# chunks and a scoring program's every-token logits take the GEMM, decode, verify and a
# prefill's few logit rows the kernel (`bench/results/prefill-blocks-cpu/`). With AVX-512 the
# kernel reads them once per 8 rows, and with VNNI sums int8 activations four products an
# instruction: on an AVX-512 Xeon it stays ahead of dequantizing for the GEMM through 64 rows
# over float32 activations and 512 over int8 (`gemm_rows`; bench/results/prefill-blocks-cpu/
# chunks.txt: prefill of 64 tokens 1.1-1.3x, int8 1.6-2.0x; 512 int8 1.03-1.10x).
GEMM_ROWS = 64
GEMM_ROWS_AVX512 = {"float32": 128, "int8": 1024}
# Paged decode attention and pages taken, by the pool's dtype: float32, or 16- and 8-bit pages
# widened as they are read.
_POOL_DTYPES = {"float32": "", "bfloat16": "_bf16", "float16": "_f16", "float8_e4m3fn": "_f8e4m3",
                "float8_e5m2": "_f8e5m2"}
ATTENTION = {dtype: f"cadence_cpu_paged_decode{suffix}" for dtype, suffix in _POOL_DTYPES.items()}
PAGED_WRITE = "cadence_cpu_paged_write"
TAKE_PAGES = {dtype: f"cadence_cpu_take_pages{suffix}" for dtype, suffix in _POOL_DTYPES.items()}
ARGMAX = "cadence_cpu_argmax"
KTH_LARGEST = "cadence_cpu_kth_largest"
MASS_THRESHOLD = "cadence_cpu_mass_threshold"
GUMBEL_CANDIDATES = "cadence_cpu_gumbel_candidates"
GUMBEL_OF_BITS = "cadence_cpu_gumbel_of_bits"
# A bound on how far the kernels' Gumbel noise may be from XLA's (their logs differ in the last
# bits: under 1e-6 over every one of the 2^23 values, which tests/test_sampling.py holds to a
# quarter of this). A draw's candidates are the tokens within twice it of the best score.
GUMBEL_ERROR = 1e-5


class KernelsUnavailable(RuntimeError):
    """The CPU kernels cannot run here; the message says why."""


def _cache_root() -> Path:
    """`checkpoints.registry.cache_dir()`'s folder (model/ does not import checkpoints/)."""
    return Path(os.environ.get("CADENCE_CACHE") or Path.home() / ".cache" / "cadence") / "kernels"


@functools.cache
def _cpu_flags() -> list[str] | None:
    """/proc/cpuinfo's flags, or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    except OSError:
        return None


def _cpu_supports() -> str | None:
    """Why this CPU cannot run the kernels, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are x86-64 (AVX2 + FMA); this machine is {platform.machine()}"
    flags = _cpu_flags()
    if flags is None:
        return "cannot read /proc/cpuinfo to check for AVX2 and FMA"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


@functools.cache
def has_avx512() -> bool:
    """Whether the kernels take AVX-512 here (csrc/isa.h's `use_avx512`, which also reads
    CADENCE_CPU_AVX512 once)."""
    return ("avx512f" in (_cpu_flags() or []) and os.environ.get("CADENCE_CPU_AVX512") != "0"
            and available())


def has_vnni() -> bool:
    """Whether the int8 activations' tiles take AVX-512 VNNI here (csrc/int8_activations.h)."""
    return has_avx512() and all(f in (_cpu_flags() or []) for f in ("avx512bw", "avx512_vnni", "avx512vbmi"))


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise KernelsUnavailable("no C++ compiler (set $CXX, or install g++)")
    include = jax.ffi.include_dir()
    sources = b"".join(path.read_bytes() for path in SOURCES)
    digest = hashlib.sha256(sources + " ".join(FLAGS).encode() + jax.__version__.encode()
                            + compiler.encode()).hexdigest()[:16]
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
    for name in (MATMUL_INT8, LAYERED_MATMUL, LAYERED_DEQUANTIZE, *ATTENTION.values(),
                 PAGED_WRITE, *TAKE_PAGES.values(), ARGMAX, KTH_LARGEST, MASS_THRESHOLD,
                 GUMBEL_CANDIDATES, GUMBEL_OF_BITS):
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


_LIVE_ROWS = contextvars.ContextVar("cadence_cpu_live_rows", default=None)


@contextlib.contextmanager
def live_rows(total: int, rows: jax.Array):
    """Blocked matmuls traced inside it over `total` rows (a packed prefill's positions) compute
    the leading `rows` ([] int32, a value of the program; no token lies past them), zeros after.
    Over other rows (the LM head's at C logit rows) all; so does XLA's GEMM (`gemm_rows()`)."""
    token = _LIVE_ROWS.set((total, rows))
    try:
        yield
    finally:
        _LIVE_ROWS.reset(token)


_SERVING = contextvars.ContextVar("cadence_cpu_kernels_serving", default=False)


def with_activations(fn, kind: str):
    """`fn` traced inside `activations(kind)`, and as a program the kernels serve (`argmax`
    takes the kernel), with its signature (so that a jit of it still finds its static and
    donated arguments by name)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        token = _SERVING.set(True)
        try:
            with activations(kind):
                return fn(*args, **kwargs)
        finally:
            _SERVING.reset(token)

    return traced


@struct.dataclass
class Stacked:
    """One role's matrices of every layer (a layer's q/k/v, its down projection...) in one
    buffer, and the layer a call reads: the layer loop's weights (`model.layer_loop`). Each
    matrix keeps its own format (a Q4_K_M file's down projections are Q4_K in some layers and
    Q6_K in others) and lies at its byte offset; the kernels find the layer's at run time, so
    the loop over layers is one program body. `layer` is None in the engine's tree and the
    loop's counter inside the loop (`at`)."""

    data: jax.Array  # uint8 [bytes]: the layers' matrices, one after another
    formats: tuple[str, ...] = struct.field(pytree_node=False)  # each layer's (`FORMAT_CODES`)
    offsets: tuple[int, ...] = struct.field(pytree_node=False)  # each layer's first byte
    k: int = struct.field(pytree_node=False)  # input rows
    blocks: int = struct.field(pytree_node=False)  # blocks of 16 output columns
    layer: jax.Array | None = None  # int32 []

    def at(self, layer: jax.Array) -> Stacked:
        return self.replace(layer=layer)


def matrix_format(blocked) -> str | None:
    """A blocked matrix's entry in `FORMAT_CODES` (None for int8 blocks and other dtypes)."""
    if blocked.dtype == jnp.uint8:
        return grouped_format(blocked)
    return blocked.dtype.name if blocked.dtype.name in FORMAT_CODES else None


def blocked_k(blocked) -> int:
    """The input rows K of a blocked matrix (`block`'s, `pack_grouped`'s) or of a `Stacked`."""
    if isinstance(blocked, Stacked):
        return blocked.k
    return blocked.shape[1] * (FORMATS[grouped_format(blocked)][0] if blocked.dtype == jnp.uint8 else 1)


def _as_stacked(blocked) -> Stacked:
    """One matrix as a stack of one (its layer 0), for the layered handlers."""
    if isinstance(blocked, Stacked):
        if blocked.layer is None:
            raise ValueError("a Stacked matrix is read at a layer: Stacked.at(layer)")
        return blocked
    return Stacked(blocked, (matrix_format(blocked),), (0,), blocked_k(blocked), blocked.shape[0],
                   jnp.int32(0))


def _layered_attributes(stacked: Stacked) -> dict[str, np.ndarray]:
    return {"formats": np.array([FORMAT_CODES[f] for f in stacked.formats], np.int32),
            "offsets": np.array(stacked.offsets, np.int64)}


def blocked_matmul(x: jax.Array, blocked, n: int, scale: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ W [K, n] in float32, W given as `block(W)`: float32, bfloat16 or float16
    (widened as read), or int8 with `scale` [n], one per output column (`model.quant`),
    applied to the sums; or W's groups as `pack_grouped` lays them out (uint8 records, their
    scales inside); or a layer of a `Stacked`."""
    _require()
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    blocks = blocked.blocks if isinstance(blocked, Stacked) else blocked.shape[0]
    out = jax.ShapeDtypeStruct((rows.shape[0], blocks * BLOCK), jnp.float32)
    total, live = _LIVE_ROWS.get() or (rows.shape[0], rows.shape[0])  # `live_rows`'s, or all
    live = jnp.asarray(live if total == rows.shape[0] else rows.shape[0], jnp.int32).reshape(())
    if not isinstance(blocked, Stacked) and blocked.dtype == jnp.int8:
        if scale is None:
            raise ValueError("int8 blocks need their per-column scale")
        scale = jnp.pad(scale.astype(jnp.float32), (0, blocks * BLOCK - n))
        y = jax.ffi.ffi_call(MATMUL_INT8, out)(rows, live, blocked, scale)
    else:
        if not isinstance(blocked, Stacked) and matrix_format(blocked) is None:
            blocked = blocked.astype(jnp.float32)
        stacked = _as_stacked(blocked)
        if rows.shape[1] != stacked.k:  # the kernel reads K from x: a mismatch would misread W
            raise ValueError(f"x has {rows.shape[1]} input columns; the matrix has {stacked.k} rows")
        y = jax.ffi.ffi_call(LAYERED_MATMUL, out)(
            rows, live, stacked.layer, stacked.data, **_layered_attributes(stacked),
            int8=_ACTIVATIONS.get() == "int8")
    return y[:, :n].reshape(*lead, n)


def dequantize(blocked, n: int, first: int = 0) -> jax.Array:
    """The float32 W [K, n] of a blocked matrix (or of a layer of a `Stacked`), from its block
    `first` (a part of a fused matrix), inside a program: grouped records dequantized by the
    kernel library (`unpack_grouped`'s values, exactly), float blocks re-laid, int8 blocks
    widened (their per-column scale is the caller's to apply, after the product, as
    `model.llama.Linear` applies it)."""
    count = cdiv(n, BLOCK)
    if not isinstance(blocked, Stacked) and matrix_format(blocked) is None:
        return unblock(blocked[first:first + count], n).astype(jnp.float32)
    _require()
    stacked = _as_stacked(blocked)
    out = jax.ShapeDtypeStruct((stacked.k, count * BLOCK), jnp.float32)
    return jax.ffi.ffi_call(LAYERED_DEQUANTIZE, out)(
        stacked.layer, stacked.data, **_layered_attributes(stacked), first=np.int64(first))[:, :n]


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


def gemm_rows(grouped: bool = True) -> int:
    """From how many rows `matmul` takes XLA's GEMM, for a matrix in GGUF's groups (whose tiles
    have AVX-512 forms) or not (float or per-channel int8 blocks: AVX2's alone), and the
    activations traced for: the AVX-512 thresholds where the tiles they were measured with run."""
    if not (grouped and has_avx512()):
        return GEMM_ROWS
    if _ACTIVATIONS.get() == "int8":
        return GEMM_ROWS_AVX512["int8"] if has_vnni() else GEMM_ROWS
    return GEMM_ROWS_AVX512["float32"]


def _takes_gemm(x: jax.Array, blocked) -> bool:
    """Whether `matmul` gives x's rows to XLA's GEMM (from `gemm_rows()`) rather than the kernel."""
    grouped = isinstance(blocked, Stacked) or blocked.dtype == jnp.uint8
    return int(np.prod(x.shape[:-1])) >= gemm_rows(grouped)


def matmul(x: jax.Array, blocked, n: int, scale: jax.Array | None = None, first: int = 0) -> jax.Array:
    """x [..., K] @ W [K, n] for W blocked, whatever the rows: the kernel (`blocked_matmul`)
    below `gemm_rows()` rows, else XLA's GEMM over W dequantized for this call (`dequantize`: a
    [K, n] float32 temporary, one matrix at a time, not a second copy of the weights). The
    same numbers either way, summed in another order. `first`: the GEMM's W starts at that
    block (a part of a fused matrix, `fused_matmul`); the kernel reads from the first."""
    int8 = not isinstance(blocked, Stacked) and blocked.dtype == jnp.int8
    if not _takes_gemm(x, blocked):
        assert first == 0, "the kernel reads a matrix from its first block"
        return blocked_matmul(x, blocked, n, scale)
    if int8 and scale is None:
        raise ValueError("int8 blocks need their per-column scale")
    x = x.astype(jnp.float32)
    # One matrix's temporary at a time, as XLA:CPU orders a program for memory (cadence's
    # default: `cadence/__init__.py`); ordered for concurrency it holds every layer's at once.
    y = jax.lax.dot_general(x, dequantize(blocked, n, first), (((x.ndim - 1,), (0,)), ((), ())))
    return y * scale.astype(jnp.float32) if int8 else y


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


def decode_params(params: dict[str, Any], packed: dict[tuple[str, ...], Any] | None = None,
                  num_layers: int | None = None) -> dict[str, Any]:
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
    `HandedOver` `packed` is emptied as its matrices are placed. `num_layers`: the tree's
    layers stay alike (for `model.layer_loop`): projections are fused only where they can be in
    every layer (a Q4_K_M file's v is Q6_K in some layers, beside a Q4_K q and k)."""
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
        return node

    def nodes(node, path=()):  # every dict of the tree, by path
        if isinstance(node, dict):
            yield path, node
            for name, child in node.items():
                yield from nodes(child, path + (name,))

    tree = convert(params, ())
    every = [(path, node, name) for path, node in nodes(tree) for name in FUSED]
    if num_layers is not None:  # a layer's node fuses where each layer's twin can
        def twins(path):
            if not path or not path[0].startswith("layers_"):
                return [path]
            return [(f"layers_{i}",) + path[1:] for i in range(num_layers)]

        fusible_at = {(path, name) for path, node, name in every
                      if fusible([node.get(p) for p in FUSED[name]])}
        every = [(path, node, name) for path, node, name in every
                 if all((twin, name) in fusible_at for twin in twins(path))]
    for path, node, name in every:
        if fusible([node.get(p) for p in FUSED[name]]):
            node[name] = fuse([node.pop(p) for p in FUSED[name]])
    return tree


def is_blocked(path) -> bool:
    """Whether a `decode_params` leaf's key path (`jax.tree_util`'s) names a kernel-layout
    matrix (`kernel_blocked`, `embedding_blocked`, or a `Stacked` one's bytes), which keeps its
    own dtype."""
    if getattr(path[-1], "name", None) == "data":  # a Stacked matrix's bytes
        path = path[:-1]
    return str(getattr(path[-1], "key", "")).endswith("_blocked")


def matrix_formats(tree: dict[str, Any]) -> list[str]:
    """The format of every kernel-layout matrix of a decode tree (`FORMAT_CODES`' names, or
    "int8"), a `Stacked` one's once per layer."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda a: isinstance(a, Stacked))[0]
    return [f for path, leaf in leaves if is_blocked(path)
            for f in (leaf.formats if isinstance(leaf, Stacked) else [matrix_format(leaf) or leaf.dtype.name])]


def blocked_bytes(tree: dict[str, Any]) -> int:
    """Bytes of the kernel-layout matrices in a `decode_params` tree (its copy of the weights)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return sum(leaf.nbytes for path, leaf in leaves if is_blocked(path))


def decode_bytes(tree: dict[str, Any]) -> int:
    """Bytes of a decode tree that a decode step reads: its kernel-layout matrices and its
    vectors (norm scales, biases; under a stacked tree's `layers`, a row per layer), not a
    lookup table, of which a step reads a row per token."""
    def read(path, a) -> bool:
        stacked_row = a.ndim == 2 and str(getattr(path[0], "key", "")) == "layers"
        return is_blocked(path) or a.ndim == 1 or stacked_row

    return sum(a.nbytes for path, a in jax.tree_util.tree_flatten_with_path(tree)[0] if read(path, a))


def _device_of(array) -> jax.Device | None:
    """Where a leaf lies (None for NumPy: jax's default)."""
    devices = getattr(array, "devices", None)
    return next(iter(devices())) if devices else None


def fused_matmul(x: jax.Array, fused: dict[str, jax.Array], sizes: tuple[int, ...]) -> list[jax.Array]:
    """x @ each part of a fused matrix (`decode_params`' `qkv`, `gate_up`) whose parts have
    `sizes` output columns, in one kernel call; bias added where the tree has one."""
    blocked, scale, bias = fused["kernel_blocked"], fused.get("kernel_scale"), fused.get("bias")
    columns = (blocked.blocks if isinstance(blocked, Stacked) else blocked.shape[0]) * BLOCK
    if sum(_padded(n) for n in sizes) != columns:
        raise ValueError(f"parts of {sizes} columns do not make the fused matrix's {columns}")
    starts = np.cumsum([0] + [_padded(n) for n in sizes])
    if not _takes_gemm(x, blocked):  # one kernel call
        y = blocked_matmul(x, blocked, columns, scale)
        parts = [y[..., start:start + n] for start, n in zip(starts, sizes)]
    else:  # a GEMM a part, each over its own blocks, as the unfused matrices would run
        parts = [matmul(x, blocked, n, None if scale is None else scale[start:start + n],
                        first=start // BLOCK)
                 for start, n in zip(starts, sizes)]
    if bias is not None:
        parts = [y + bias[start:start + n] for y, start, n in zip(parts, starts, sizes)]
    return parts


# -- paged decode attention ----------------------------------------------------------------------

@struct.dataclass
class PoolLayer:
    """A layer of a pool stacked over layers [layers, kv_heads, num_pages, page_size, d]: what
    the layer loop's attention reads and writes (`model.layer_loop`). `shape` and `dtype` are
    the layer's, as a single layer's pool gives them."""

    pool: jax.Array
    layer: jax.Array  # int32 []

    @property
    def shape(self) -> tuple[int, ...]:
        return self.pool.shape[1:]

    @property
    def dtype(self):
        return self.pool.dtype


def _pool_layer(pages) -> tuple[jax.Array, jax.Array]:
    """The kernels' operands for a pool's layer: the stack and the layer in it, or a single
    layer's pool [kv_heads, num_pages, page_size, d] and 0."""
    if isinstance(pages, PoolLayer):
        return pages.pool, pages.layer
    return pages, jnp.int32(0)


def paged_decode(q: jax.Array, k_pages, v_pages, page_table: jax.Array,
                 q_positions: jax.Array, window=None) -> jax.Array:
    """`model.paged_attention`'s decode (q [rows, 1, heads, d]): keys 0..q_positions[row, 0], the
    last `window` if given (-1: zeros), in float32 over pools (`PoolLayer`s) of `ATTENTION`'s."""
    _require()
    rows, q_len, heads, head_dim = q.shape
    if q_len != 1:
        raise ValueError(f"paged_decode takes one query per row, got {q_len}")
    if k_pages.dtype.name not in ATTENTION or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"paged_decode reads pools of {', '.join(ATTENTION)}, got "
                         f"{k_pages.dtype} and {v_pages.dtype}")
    (k_pool, layer), (v_pool, _) = _pool_layer(k_pages), _pool_layer(v_pages)
    out_shape = jax.ShapeDtypeStruct((rows, heads, head_dim), jnp.float32)
    out = jax.ffi.ffi_call(ATTENTION[k_pages.dtype.name], out_shape)(
        q.reshape(rows, heads, head_dim).astype(jnp.float32), layer, k_pool, v_pool,
        page_table.astype(jnp.int32), q_positions[:, 0].astype(jnp.int32),
        jnp.asarray(0 if window is None else window, jnp.int32))
    return out.reshape(rows, 1, heads, head_dim).astype(q.dtype)


def paged_write(pages, values: jax.Array, page: jax.Array, slot: jax.Array):
    """A pool ([kv_heads, num_pages, page_size, d], or a `PoolLayer`) of 32, 16 or 8 bits with
    `values` [rows, t, kv_heads, d] (in its dtype) written in place at each token's `page` and
    `slot` [rows, t]; a token whose page is outside the pool is dropped. What `paged_kv.write`'s
    scatter does, bit for bit, without XLA:CPU's float32 round trip of the whole pool around a
    16-bit scatter: on Qwen2.5-0.5B's bfloat16 pool that round trip made decode 3x slower than
    over a float32 pool (`bench/results/kv16-write-cpu/`); and within the layer loop, on the
    layer of the stacked pool, in place."""
    _require()
    if pages.dtype.itemsize not in (1, 2, 4):
        raise ValueError(f"paged_write writes 8-, 16- and 32-bit pools, got {pages.dtype}")
    pool, layer = _pool_layer(pages)
    pool = jax.ffi.ffi_call(PAGED_WRITE, jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={1: 0})(
        layer, pool, values.astype(pool.dtype), page.astype(jnp.int32), slot.astype(jnp.int32))
    return pages.replace(pool=pool) if isinstance(pages, PoolLayer) else pool


def take_pages(pages, ids: jax.Array) -> jax.Array:
    """Pages `ids` [n] (clipped into the pool) of a pool [kv_heads, num_pages, page_size, d]
    (or a `PoolLayer`), in float32: `jnp.take(pages, ids, axis=1, mode="clip").astype(float32)`,
    to the bit (the widening of 16-bit pools is exact), without XLA:CPU widening the whole pool
    layer before a 16-bit gather (which it hoists out of prefill's loop over key tiles, once
    per layer), and without slicing a layer out of a stacked pool."""
    _require()
    if pages.dtype.name not in TAKE_PAGES:
        raise ValueError(f"take_pages reads pools of {', '.join(TAKE_PAGES)}, got {pages.dtype}")
    kv_heads, _, page_size, d = pages.shape
    pool, layer = _pool_layer(pages)
    out = jax.ShapeDtypeStruct((kv_heads, ids.shape[0], page_size, d), jnp.float32)
    return jax.ffi.ffi_call(TAKE_PAGES[pages.dtype.name], out)(layer, pool, ids.astype(jnp.int32))


def serving() -> bool:
    """Whether what is traced now is a program the kernels serve (`with_activations`) and they
    run here: sampling then takes `argmax`, its thresholds and the kept tokens from them."""
    return _SERVING.get() and available()


def argmax(logits: jax.Array) -> jax.Array:
    """Each row's likeliest token, int32: `jnp.argmax(logits, axis=-1)` (the first of equal
    maxima; the first NaN where a row has one), by the kernel in a program the kernels serve
    (`serving()`) over float32 [rows, n] logits, else by XLA."""
    if serving() and logits.ndim == 2 and logits.dtype == jnp.float32:
        return jax.ffi.ffi_call(ARGMAX, jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))(logits)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def kth_largest(keys: jax.Array, k: jax.Array) -> jax.Array:
    """Each row's k-th largest of `keys` uint32 [rows, n], k [rows] clipped into [1, n]."""
    _require()
    return jax.ffi.ffi_call(KTH_LARGEST, jax.ShapeDtypeStruct(keys.shape[:1], jnp.uint32))(
        keys.astype(jnp.uint32), k.astype(jnp.int32))


def mass_threshold(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the largest key t with sum(weights[keys >= t]) >= target: keys uint32 and
    weights float32 [rows, n], target [rows]; the sums in double (`csrc/sampling.h`)."""
    _require()
    return jax.ffi.ffi_call(MASS_THRESHOLD, jax.ShapeDtypeStruct(keys.shape[:1], jnp.uint32))(
        keys.astype(jnp.uint32), weights.astype(jnp.float32), target.astype(jnp.float32))


def gumbel_candidates(keys: jax.Array, scores: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """The tokens that may win each row's draw: (candidates int32 [rows, width], ascending, 0
    past the row's count; counts int32 [rows]) for the rows' threefry keys uint32 [rows, 2]
    (`jax.random.key_data`) and scores float32 [rows, n] (the kept scaled logits, -inf
    elsewhere): every j whose score plus jax.random.gumbel(key, (n,))[j] may be the row's
    largest, by the kernels' own noise (within GUMBEL_ERROR of XLA's). A count of width + 1
    says the row has more, or scores NaN or only -inf."""
    _require()
    rows = scores.shape[0]
    out = (jax.ShapeDtypeStruct((rows, width), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32))
    return jax.ffi.ffi_call(GUMBEL_CANDIDATES, out)(keys.astype(jnp.uint32), scores.astype(jnp.float32),
                                                     error=np.float32(GUMBEL_ERROR))


def gumbel_of_bits(bits: jax.Array, wide: bool) -> jax.Array:
    """The kernels' Gumbel noise of random bits uint32 [16 k], AVX-512's where `wide` (which
    needs a CPU with it), else AVX2's: for its test against XLA's."""
    _require()
    return jax.ffi.ffi_call(GUMBEL_OF_BITS, jax.ShapeDtypeStruct(bits.shape, jnp.float32))(bits, wide=wide)
