"""The layouts cadence's CPU kernels read weights in (`model.cpu_kernels`), made and undone
in NumPy: once where an engine places its weights, and as the slow paths the kernels are
checked against.

    blocked = block(w)                      # W [K, N] float -> [N / 16, K, 16]
    packed = pack_grouped(q, scale)         # GGUF's 32-weight blocks -> [N / 16, K / 32, record]
    packed = pack_superblocks("q4k", ...)   # its K-quants' (and IQ4_XS') 256-weight super-blocks
    w = unpack_grouped(packed, n)           # the float32 W, as GGUF's dequantizer gives it

Each block of 16 output columns is one contiguous run of bytes, so the kernel streams a block
once while rows accumulate in registers; `cpu_kernels.cc` describes each record's bytes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cadence.model.arith import cdiv

BLOCK = 16  # output columns per block of the blocked layout (cpu_kernels.cc's kBlock)
GROUP = 32  # k-rows per group of the 32-weight formats (GGUF's block of 32 weights)
# The grouped formats (cpu_kernels.cc's layouts): k-rows per record, k-rows per scale, and the
# bytes of one record of a block of 16 columns. q8, q4, q5: GGUF's Q8_0, Q4_0/Q4_1, Q5_0
# (a float16 scale per 32 weights, q4 a minimum too); q4k, q5k, q6k: its K-quants Q4_K, Q5_K,
# Q6_K (256-weight super-blocks of a float16 d (and dmin) and 6-bit or int8 sub-block scales);
# iq4nl, iq4xs: its IQ4_NL (as q4 without a minimum) and IQ4_XS (256-weight super-blocks of a
# float16 d and signed 6-bit sub-block scales), whose 4-bit codes index `IQ4_VALUES`; q51: its
# Q5_1 (q5's codes unsigned, with q4's minimum); q3k: its Q3_K (as q6k, the 3-bit codes a
# nibble each); q2k: its Q2_K (as q4k with 16-row sub-blocks, the 2-bit codes a nibble each).
FORMATS = {"q8": (32, 32, 544), "q4": (32, 32, 320), "q5": (32, 32, 352),
           "q4k": (256, 32, 2368), "q5k": (256, 32, 2880), "q6k": (256, 16, 3360),
           "iq4nl": (32, 32, 288), "iq4xs": (256, 32, 2208), "q51": (32, 32, 384),
           "q3k": (256, 16, 2336), "q2k": (256, 16, 2624)}
RECORD = {name: record for name, (_, _, record) in FORMATS.items()}
# llama.cpp's kvalues_iq4nl: the int8 value of each 4-bit IQ4 code.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


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
    W = q * scale + minimum; q5 (`fmt="q5"`, GGUF's Q5_0): q -16..15, W = q * scale; iq4nl
    (`fmt="iq4nl"`, GGUF's IQ4_NL): q the 4-bit codes 0..15, W = IQ4_VALUES[q] * scale; q51
    (`fmt="q51"`, GGUF's Q5_1, with `minimum`): q 0..31, W = q * scale + minimum.
    `scale`, `minimum` [K / 32, N], stored as float16 (the values GGUF files hold). Columns past
    N are zero."""
    fmt = fmt or ("q8" if minimum is None else "q4")
    k, n = q.shape
    if k % GROUP or scale.shape != (k // GROUP, n) or (minimum is not None and minimum.shape != scale.shape):
        raise ValueError(f"q {list(q.shape)} needs K a multiple of {GROUP} and scales of shape "
                         f"[{k // GROUP}, {n}], got {list(scale.shape)}")
    if (minimum is not None) != (fmt in ("q4", "q51")):
        raise ValueError(f"{fmt} takes {'a' if fmt in ('q4', 'q51') else 'no'} minimum")
    scales = _runs(np.asarray(scale, np.float16), 1)
    if fmt == "q8":
        return np.concatenate([scales, _runs(np.asarray(q, np.int8), GROUP)], axis=-1)
    if fmt == "q4":
        return np.concatenate([scales, _runs(np.asarray(minimum, np.float16), 1),
                               _pairs(_in_range(q, fmt, 0, 15).astype(np.uint8), GROUP)], axis=-1)
    if fmt == "iq4nl":
        return np.concatenate([scales, _pairs(_in_range(q, fmt, 0, 15).astype(np.uint8), GROUP)], axis=-1)
    if fmt not in ("q5", "q51"):
        raise ValueError(f"pack_grouped packs q8, q4, q5, iq4nl and q51, not {fmt!r} (see pack_superblocks)")
    lift = 16 if fmt == "q5" else 0  # Q5_0's codes are signed, stored lifted; Q5_1's are not
    codes = (_in_range(q, fmt, -lift, 31 - lift).astype(np.int16) + lift).astype(np.uint8)
    minimums = [_runs(np.asarray(minimum, np.float16), 1)] if fmt == "q51" else []
    return np.concatenate([scales, *minimums, _plane(codes >> 4, 1, GROUP), _pairs(codes & 15, GROUP)], axis=-1)


def _in_range(q: np.ndarray, fmt: str, low: int, high: int) -> np.ndarray:
    codes = np.asarray(q)
    if codes.min(initial=0) < low or codes.max(initial=0) > high:
        raise ValueError(f"{fmt} codes must lie in {low}..{high}")
    return codes


def pack_superblocks(fmt: str, q: np.ndarray, d: np.ndarray, sub_scale: np.ndarray,
                     dmin: np.ndarray | None = None, sub_min: np.ndarray | None = None) -> np.ndarray:
    """A matrix W [K, N] in one of GGUF's K-quants, as the grouped kernels read it: uint8
    [ceil(N / 16), K / 256, record]. Per super-block of 256 k-rows and column, a float16 `d`
    (and `dmin`) [K / 256, N]; per sub-block, an integer `sub_scale` (and `sub_min`):
    q4k / q5k: codes q 0..15 / 0..31 [K, N], sub-blocks of 32 k-rows with 6-bit scales and
    minimums [K / 32, N], W = (d * sub_scale) * q - (dmin * sub_min);
    q6k: codes q -32..31, sub-blocks of 16 k-rows with int8 scales [K / 16, N], no minimums,
    W = (d * sub_scale) * q; iq4xs: codes q 0..15, sub-blocks of 32 k-rows with scales
    -32..31 [K / 32, N], no minimums, W = (d * sub_scale) * IQ4_VALUES[q]; q3k: codes q
    -4..3, sub-blocks of 16 k-rows with scales -32..31 [K / 16, N], no minimums,
    W = (d * sub_scale) * q; q2k: codes q 0..3, sub-blocks of 16 k-rows with scales and
    minimums 0..15 [K / 16, N], W = (d * sub_scale) * q - (dmin * sub_min). The products are
    computed in float32, as GGUF's dequantizer does (and are exact). Columns past N are zero."""
    if fmt not in ("q4k", "q5k", "q6k", "iq4xs", "q3k", "q2k"):
        raise ValueError(f"pack_superblocks packs q4k, q5k, q6k, iq4xs, q3k and q2k, not {fmt!r}")
    rows, sub, _ = FORMATS[fmt]
    k, n = q.shape
    want = {"d": (d, (k // rows, n)), "sub_scale": (sub_scale, (k // sub, n))}
    if fmt in ("q4k", "q5k", "q2k"):
        want.update(dmin=(dmin, (k // rows, n)), sub_min=(sub_min, (k // sub, n)))
    elif dmin is not None or sub_min is not None:
        raise ValueError(f"{fmt} has no minimums")
    for name, (a, shape) in want.items():
        if k % rows or a is None or np.shape(a) != shape:
            raise ValueError(f"{fmt}: q {list(q.shape)} needs K a multiple of {rows} and {name} "
                             f"of shape {list(shape)}, got {None if a is None else list(np.shape(a))}")
    q = np.asarray(q)
    low, high = {"q4k": (0, 15), "q5k": (0, 31), "q6k": (-32, 31), "iq4xs": (0, 15), "q3k": (-4, 3),
                 "q2k": (0, 3)}[fmt]
    if q.min(initial=0) < low or q.max(initial=0) > high:
        raise ValueError(f"{fmt} codes must lie in {low}..{high}")
    low, high = {"q6k": (-128, 127), "iq4xs": (-32, 31), "q3k": (-32, 31), "q2k": (0, 15)}.get(fmt, (0, 63))
    for a in (sub_scale, sub_min):
        if a is not None and (np.min(a, initial=0) < low or np.max(a, initial=0) > high):
            raise ValueError(f"{fmt} sub-block scales and minimums must lie in {low}..{high}")
    ds = _runs(np.asarray(d, np.float16), 1)
    if fmt in ("iq4xs", "q3k"):
        codes = q.astype(np.int16) + (4 if fmt == "q3k" else 0)
        return np.concatenate([ds, _runs(np.asarray(sub_scale, np.int8), rows // sub),
                               _pairs(codes.astype(np.uint8), rows)], axis=-1)
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

    if fmt in ("q8", "q4", "q5", "iq4nl", "q51"):
        scale = per_sub(_unruns(blocked, 0, 1, np.float16))
        if fmt == "iq4nl":
            w = IQ4_VALUES[_unpairs(blocked, 2 * BLOCK, GROUP)].astype(f32) * scale
        elif fmt == "q8":
            w = _unruns(blocked, 2 * BLOCK, GROUP, np.int8).astype(f32) * scale
        elif fmt == "q4":
            w = _unpairs(blocked, 4 * BLOCK, GROUP).astype(f32) * scale + per_sub(
                _unruns(blocked, 2 * BLOCK, 1, np.float16))
        else:  # q5, q51: the plane of fifth bits (after q51's minimums), then the pairs
            at = (4 if fmt == "q51" else 2) * BLOCK
            codes = _unpairs(blocked, at + 4 * BLOCK, GROUP) | (_unplane(blocked, at, 1, GROUP) << 4)
            if fmt == "q51":
                w = codes.astype(f32) * scale + per_sub(_unruns(blocked, 2 * BLOCK, 1, np.float16))
            else:
                w = scale * (codes.astype(np.int8) - np.int8(16)).astype(f32)
        return w[:, :n]
    per_super = rows // sub
    d = np.repeat(_unruns(blocked, 0, 1, np.float16).astype(f32), per_super, axis=0)
    if fmt in ("iq4xs", "q3k"):
        scale = per_sub(d * _unruns(blocked, 2 * BLOCK, per_super, np.int8).astype(f32))
        codes = _unpairs(blocked, (2 + per_super) * BLOCK, rows)
        values = IQ4_VALUES[codes] if fmt == "iq4xs" else codes.astype(np.int8) - np.int8(4)
        return (scale * values.astype(f32))[:, :n]
    if fmt == "q6k":
        scale = per_sub(d * _unruns(blocked, 2 * BLOCK, per_super, np.int8).astype(f32))
        at = 18 * BLOCK
        codes = _unpairs(blocked, at + 64 * BLOCK, rows) | (_unplane(blocked, at, 2, rows) << 4)
        return (scale * (codes.astype(np.int8) - np.int8(32)).astype(f32))[:, :n]
    dmin = np.repeat(_unruns(blocked, 2 * BLOCK, 1, np.float16).astype(f32), per_super, axis=0)
    scale = per_sub(d * _unruns(blocked, 4 * BLOCK, per_super, np.uint8).astype(f32))
    minimum = per_sub(dmin * _unruns(blocked, (4 + per_super) * BLOCK, per_super, np.uint8).astype(f32))
    at = (4 + 2 * per_super) * BLOCK
    if fmt == "q5k":
        codes = _unpairs(blocked, at + 32 * BLOCK, rows) | (_unplane(blocked, at, 1, rows) << 4)
    else:
        codes = _unpairs(blocked, at, rows)
    return (scale * codes.astype(f32) - minimum)[:, :n]
