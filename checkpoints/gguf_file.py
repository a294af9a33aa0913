"""A GGUF file's metadata and tensors, read straight from the file.

    fields, tensors = read_gguf(path)     # {key: value}, {name: GGUFTensor}

What `gguf.GGUFReader` gives (each field's `contents()`: numbers and bools as Python values,
strings decoded, arrays as lists; each tensor's `tensor_type` and `data`, a read-only memory
map of the file in NumPy's order, block formats as rows of bytes), at a fraction of its cost:
the reader makes NumPy views of every part of every value, and Gemma 3's vocabulary of 262,144
strings took it 32 s (a conversion reads a file twice); here an array of numbers is one
`frombuffer` and a string one slice. `tests/test_gguf.py` checks the two agree on every value
type and tensor format.

Files of version 2 and 3 in little-endian byte order, as llama.cpp writes them; anything else
is refused with an error.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

STRING, ARRAY = 8, 9  # GGUF's value types beside the scalars below
# Each scalar value type: its NumPy dtype (little-endian), as arrays of it are read.
_SCALARS = {0: np.dtype("u1"), 1: np.dtype("i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
            4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
            10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8")}
# Tensor types whose data NumPy reads as numbers (the rest are blocks of bytes).
_NUMERIC = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
            GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
            GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
            GGMLQuantizationType.I64: np.int64}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the innermost dimension first
    data: np.ndarray  # NumPy's order (shape reversed); a block format's rows as bytes


class _Cursor:
    def __init__(self, data: np.memmap):
        self.data, self.view, self.at = data, memoryview(data), 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.view, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        text = bytes(self.view[self.at:self.at + n]).decode("utf-8")
        self.at += n
        return text

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind in _SCALARS:
            (value,) = np.frombuffer(self.data, _SCALARS[kind], 1, self.at).tolist()
            self.at += _SCALARS[kind].itemsize
            return value
        if kind == ARRAY:
            item, n = self.take("<I"), self.take("<Q")
            if item in _SCALARS:
                values = np.frombuffer(self.data, _SCALARS[item], n, self.at).tolist()
                self.at += n * _SCALARS[item].itemsize
                return values
            items: list[Any] = []
            for _ in range(n):  # strings; an array of arrays is flattened, as gguf's reader does
                value = self.value(item)
                items.extend(value) if item == ARRAY else items.append(value)
            return items
        raise ValueError(f"unknown value type {kind} at byte {self.at}")


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """The file's metadata, every key decoded (and `GGUF.version`, `GGUF.tensor_count`,
    `GGUF.kv_count`, as gguf's reader lists them), and its tensors by name. Raises ValueError
    (or struct.error, UnicodeDecodeError) on a file that is not one."""
    data = np.memmap(path, mode="r")
    cursor = _Cursor(data)
    if len(data) < 24 or cursor.take("<I") != GGUF_MAGIC:
        raise ValueError("not a GGUF file (no GGUF magic)")
    version = cursor.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (or a big-endian file): cadence reads versions 2 "
                         "and 3, little-endian")
    tensor_count, kv_count = cursor.take("<Q"), cursor.take("<Q")
    fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                              "GGUF.kv_count": kv_count}
    for _ in range(kv_count):
        key = cursor.string()
        if key in fields:
            raise ValueError(f"metadata key {key!r} appears twice")
        fields[key] = cursor.value(cursor.take("<I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        infos.append((name, tuple(dims), GGMLQuantizationType(cursor.take("<I")), cursor.take("<Q")))
    alignment = int(fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    start = -(-cursor.at // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, kind, offset in infos:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        count = int(np.prod(dims))
        shape = tuple(reversed(dims))
        block, size = GGML_QUANT_SIZES[kind]
        if kind in _NUMERIC:
            dtype, items = np.dtype(_NUMERIC[kind]), count
        else:
            dtype, items, shape = np.dtype(np.uint8), count * size // block, quant_shape_to_byte_shape(shape, kind)
        at = start + offset
        if at + items * dtype.itemsize > len(data):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        array = np.frombuffer(data, dtype, items, at).reshape(shape)
        tensors[name] = GGUFTensor(name, kind, dims, array)
    return fields, tensors
