"""A fast reader for a GGUF file's metadata and tensor index; the tensor data stays in a memory map.

`gguf.GGUFReader` builds a numpy view per array element, so a large vocabulary (the default model's has 262,144
entries) costs it most of a start; this reader walks the bytes once, reading numeric arrays with one `np.frombuffer`
each. It returns what the converter needs — metadata as plain Python values (what `ReaderField.contents()` gives) and
each tensor's name, ggml type, shape and raw data (shaped as `ReaderTensor.data` is) — and the tests hold it equal to
`gguf.GGUFReader` on every file they use.
Quantisation formats and sizes still come from the `gguf` package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SCALARS = {  # GGUF value type → (struct format, numpy dtype)
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_PLAIN_TYPES = {  # ggml types stored as plain numpy items rather than quantised blocks
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    data: np.ndarray  # plain items, or the raw bytes of the quantised blocks, in numpy (row-major) order


class GgufFormatError(ValueError):
    pass


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: 262,144 of them), each decoded straight from the mapping."""
        buf, pos = self.buf, self.pos
        out: list[str] = []
        length, append = _U64.unpack_from, out.append
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind == _STRING:
                return self.strings(count)
            if item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind][1])
                items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return items.tolist()
            return [self.value(item_kind) for _ in range(count)]  # arrays of arrays
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0])
        raise GgufFormatError(f"unknown GGUF value type {kind}")


def read_gguf_file(path: str, writable: bool = False) -> tuple[dict[str, Any], list[GgufTensor]]:
    """(metadata, tensors) of a little-endian GGUF file (versions 2 and 3).

    `writable`: map the file copy-on-write (the data never changes on disk; a page is copied only if written), so
    torch can take the tensors' bytes as they are (it warns about read-only memory)."""
    mapped = np.memmap(path, dtype=np.uint8, mode="c" if writable else "r")
    cur = _Cursor(mapped.data)  # ndarray.data: a memoryview of the mapping, no copy
    if bytes(mapped[:4]) != MAGIC:
        raise GgufFormatError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise GgufFormatError(
            f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)"
        )
    n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    index = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        index.append((name, dims, GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")))
    alignment = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    return meta, [_tensor(mapped, start, *entry) for entry in index]


def _tensor(
    mapped: np.ndarray, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, offset: int
) -> GgufTensor:
    n_elems = int(np.prod(dims))
    np_dims = tuple(reversed(dims))
    if kind in _PLAIN_TYPES:
        dtype = np.dtype(_PLAIN_TYPES[kind])
        data = mapped[start + offset : start + offset + n_elems * dtype.itemsize].view(dtype).reshape(np_dims)
    else:
        block_size, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elems * type_size // block_size
        data = mapped[start + offset : start + offset + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, kind))
    return GgufTensor(name, kind, dims, data)
