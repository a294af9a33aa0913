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
  quantized in groups of 32 input rows (`pack_grouped`: GGUF's Q8_0 / Q4_0 / Q4_1 blocks as
  the file stores them, or `model.quant.quantize_grouped`), each group of a block is one record
  of float16 scales (and minimums) and int8 or 4-bit codes; the kernel widens the codes in
  registers, sums them against x and scales each group's sums once: the numbers of the float32
  kernel over the dequantized weights, summed in another order, from an eighth to a quarter of
  the bytes, with AVX-512 where the CPU has it. The layout is made once, when an engine
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

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC", "-w")
BLOCK = 16  # output columns per block of the blocked layout (cpu_kernels.cc's kBlock)
MATMUL, MATMUL_INT8 = "cadence_cpu_blocked_matmul", "cadence_cpu_blocked_matmul_int8"
GROUP = 32  # k-rows per group of the grouped formats (GGUF's block of 32 weights)
# The grouped formats, by the bytes of one group's record in a block (cpu_kernels.cc):
# q8: 16 float16 scales, then 32 k-rows of 16 int8; q4: 16 scales, 16 minimums, then 32 k-rows
# of 16 4-bit codes, two k-rows to a byte.
RECORD = {"q8": 2 * BLOCK + GROUP * BLOCK, "q4": 4 * BLOCK + GROUP * BLOCK // 2}
GROUPED = {"q8": "cadence_cpu_grouped_matmul_q8", "q4": "cadence_cpu_grouped_matmul_q4"}
ATTENTION = "cadence_cpu_paged_decode"


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
    for name in (MATMUL, MATMUL_INT8, *GROUPED.values(), ATTENTION):
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
    blocks = -(-n // BLOCK)
    w = xp.pad(w, ((0, 0), (0, blocks * BLOCK - n)))
    return w.reshape(k, blocks, BLOCK).transpose(1, 0, 2)


def unblock(blocked, n: int):
    """`block`'s inverse: the [K, n] matrix."""
    blocks, k, _ = blocked.shape
    return blocked.transpose(1, 0, 2).reshape(k, blocks * BLOCK)[:, :n]


def blocked_matmul(x: jax.Array, blocked: jax.Array, n: int, scale: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ W [K, n] in float32, W given as `block(W)`: float32, or int8 with `scale`
    [n], one per output column (`model.quant`), applied to the sums; or W's groups as
    `pack_grouped` lays them out (uint8 records, their scales inside)."""
    _require()
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((rows.shape[0], blocked.shape[0] * BLOCK), jnp.float32)
    if blocked.dtype == jnp.uint8:
        y = jax.ffi.ffi_call(GROUPED[grouped_format(blocked)], out)(rows, blocked)
    elif blocked.dtype == jnp.int8:
        if scale is None:
            raise ValueError("int8 blocks need their per-column scale")
        scale = jnp.pad(scale.astype(jnp.float32), (0, blocked.shape[0] * BLOCK - n))
        y = jax.ffi.ffi_call(MATMUL_INT8, out)(rows, blocked, scale)
    else:
        y = jax.ffi.ffi_call(MATMUL, out)(rows, blocked.astype(jnp.float32))
    return y[:, :n].reshape(*lead, n)


# -- grouped formats ----------------------------------------------------------------------------

def grouped_format(blocked) -> str:
    """"q8" or "q4": which grouped format a uint8 array of records holds (by its record size)."""
    for name, size in RECORD.items():
        if blocked.ndim == 3 and blocked.shape[-1] == size:
            return name
    raise ValueError(f"{blocked.dtype}{list(blocked.shape)} is not a grouped matrix; want "
                     f"[N / 16, K / 32, record] with a record of {sorted(RECORD.values())} bytes")


def pack_grouped(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None = None) -> np.ndarray:
    """A matrix W [K, N] quantized in groups of 32 k-rows, as the grouped kernels read it:
    uint8 [ceil(N / 16), K / 32, record]. q8: q int8 [K, N], W = q * scale; q4: q the 4-bit
    codes 0..15 [K, N] (any integer dtype), W = q * scale + minimum; `scale`, `minimum`
    [K / 32, N], stored as float16 (the values GGUF files hold). Columns past N are zero."""
    k, n = q.shape
    if k % GROUP or scale.shape != (k // GROUP, n) or (minimum is not None and minimum.shape != scale.shape):
        raise ValueError(f"q {list(q.shape)} needs K a multiple of {GROUP} and scales of shape "
                         f"[{k // GROUP}, {n}], got {list(scale.shape)}")
    blocks, groups = -(-n // BLOCK), k // GROUP
    pad = ((0, 0), (0, blocks * BLOCK - n))

    def per_group(a: np.ndarray) -> np.ndarray:  # [G, N] -> [blocks, G, 32 bytes]
        a = np.pad(np.asarray(a, np.float16), pad).reshape(groups, blocks, BLOCK)
        return a.transpose(1, 0, 2).copy().view(np.uint8)

    if minimum is None:
        rows = np.pad(np.asarray(q, np.int8), pad).reshape(groups, GROUP, blocks, BLOCK)
        rows = rows.transpose(2, 0, 1, 3).copy().view(np.uint8).reshape(blocks, groups, -1)
        return np.concatenate([per_group(scale), rows], axis=-1)
    codes = np.pad(np.asarray(q, np.uint8), pad)
    if codes.max(initial=0) > 15:
        raise ValueError("q4 codes must lie in 0..15")
    codes = codes.reshape(groups, GROUP // 2, 2, blocks, BLOCK)
    pairs = codes[:, :, 0] | (codes[:, :, 1] << 4)  # [G, 16, blocks, 16]
    pairs = pairs.transpose(2, 0, 1, 3).reshape(blocks, groups, -1)
    return np.concatenate([per_group(scale), per_group(minimum), pairs], axis=-1)


def unpack_grouped(blocked: np.ndarray, n: int) -> np.ndarray:
    """The float32 W [K, n] a `pack_grouped` array stands for (the slow path the kernels are
    checked against, and the weights prefill and the reference read)."""
    blocked = np.asarray(blocked)
    fmt = grouped_format(blocked)
    blocks, groups, _ = blocked.shape

    def per_group(at: int) -> np.ndarray:  # [blocks, G, 16] float32
        return blocked[..., at:at + 2 * BLOCK].copy().view(np.float16).astype(np.float32)

    scale = per_group(0)[:, :, None, :]  # [blocks, G, 1, 16]
    if fmt == "q8":
        q = blocked[..., 2 * BLOCK:].copy().view(np.int8).reshape(blocks, groups, GROUP, BLOCK)
        w = q.astype(np.float32) * scale
    else:
        pairs = blocked[..., 4 * BLOCK:].reshape(blocks, groups, GROUP // 2, 1, BLOCK)
        codes = np.concatenate([pairs & 15, pairs >> 4], axis=3).reshape(blocks, groups, GROUP, BLOCK)
        w = codes.astype(np.float32) * scale + per_group(2 * BLOCK)[:, :, None, :]
    return w.transpose(1, 2, 0, 3).reshape(groups * GROUP, blocks * BLOCK)[:, :n]


# Projections that read the same input, run as one kernel call in a decode tree: the fused
# matrix is the parts' blocks one after another, so each part starts on a block boundary.
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def decode_params(params: dict[str, Any], packed: dict[tuple[str, ...], Any] | None = None) -> dict[str, Any]:
    """The tree a decode program reads with the kernel: every `kernel` [in, out] replaced by
    `kernel_blocked`, and the embedding given `embedding_blocked` beside it (its transpose,
    blocked: the tied LM head); float32 or int8 as given (int8 keeps its `_scale` leaves).
    `packed`: matrices already in a grouped format (`pack_grouped`; GGUF's own blocks, from
    `checkpoints.gguf.load_packed`) by their path in `params`, which the kernel reads instead
    of blocking the float matrix (the embedding's entry is the tied head's; the lookup table
    stays as given). The projections of one input (`FUSED`: q/k/v, gate/up) become one matrix
    each, `qkv` and `gate_up`, read by `fused_matmul`: 4 matmul calls per layer instead of 7,
    and each longer to split over the threads (a decode step of SmolLM2-135M at 8 rows 1-3%
    faster, interleaved A/B on a 2-core EPYC). Everything else is the same array."""
    packed = packed or {}

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
            return jax.device_put(packed[path], _device_of(array))
        return block(array.T if path[-1] == "embedding" else array)

    def convert(node, path: tuple[str, ...]):
        if not isinstance(node, dict):
            return node
        node = {name: convert(child, path + (name,)) for name, child in node.items()}
        if "kernel" in node:
            node["kernel_blocked"] = matrix(path + ("kernel",), node.pop("kernel"))
        if "embedding" in node:
            node["embedding_blocked"] = matrix(path + ("embedding",), node["embedding"])
        for name, parts in FUSED.items():
            if fusible([node.get(p) for p in parts]):
                node[name] = fuse([node.pop(p) for p in parts])
        return node

    return convert(params, ())


def blocked_bytes(tree: dict[str, Any]) -> int:
    """Bytes of the kernel-layout matrices in a `decode_params` tree (its copy of the weights)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return sum(leaf.nbytes for path, leaf in leaves
               if str(getattr(path[-1], "key", "")).endswith("_blocked"))


def _device_of(array) -> jax.Device | None:
    """Where a leaf lies (None for NumPy: jax's default)."""
    devices = getattr(array, "devices", None)
    return next(iter(devices())) if devices else None


def fused_matmul(x: jax.Array, fused: dict[str, jax.Array], sizes: tuple[int, ...]) -> list[jax.Array]:
    """x @ each part of a fused matrix (`decode_params`' `qkv`, `gate_up`) whose parts have
    `sizes` output columns, in one kernel call; bias added where the tree has one."""
    columns = fused["kernel_blocked"].shape[0] * BLOCK
    if sum(_padded(n) for n in sizes) != columns:
        raise ValueError(f"parts of {sizes} columns do not make the fused matrix's {columns}")
    y = blocked_matmul(x, fused["kernel_blocked"], columns, fused.get("kernel_scale"))
    if "bias" in fused:
        y = y + fused["bias"]
    starts = np.cumsum([0] + [_padded(n) for n in sizes])
    return [y[..., start:start + n] for start, n in zip(starts, sizes)]


# -- paged decode attention ----------------------------------------------------------------------

def paged_decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                 q_positions: jax.Array) -> jax.Array:
    """`model.paged_attention`'s interface for one query per row (q [rows, 1, heads, d]):
    keys 0..q_positions[row, 0] of the row's pages; -1 gives zeros. float32."""
    _require()
    rows, q_len, heads, head_dim = q.shape
    if q_len != 1:
        raise ValueError(f"paged_decode takes one query per row, got {q_len}")
    out = jax.ffi.ffi_call(ATTENTION, jax.ShapeDtypeStruct((rows, heads, head_dim), jnp.float32))(
        q.reshape(rows, heads, head_dim).astype(jnp.float32), k_pages.astype(jnp.float32),
        v_pages.astype(jnp.float32), page_table.astype(jnp.int32), q_positions[:, 0].astype(jnp.int32))
    return out.reshape(rows, 1, heads, head_dim).astype(q.dtype)
