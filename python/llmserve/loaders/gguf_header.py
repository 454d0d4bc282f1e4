"""A GGUF file's metadata and tensor index, read in one pass of `struct` over the header.

Why not `gguf.GGUFReader` alone: it builds a numpy view for every element of every array
(SmolLM2's 49k tokens and 48k merges are ~250k views), which took 2-4 s of each start here;
this reads the same values in ~0.1 s. The tensors' bytes stay a read-only memmap of the
file, shaped exactly as GGUFReader shapes them, and the type tables are the `gguf`
package's. Files this reader does not take (big-endian, version 1) go to GGUFReader, whose
results have the same form. tests/unit/test_loaders.py checks both give the same values.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64
key-value count; each key-value is a string key, a u32 value type and the value (an array is
a u32 element type, a u64 count and the elements; a string is a u64 byte length and UTF-8
bytes); each tensor is a string name, u32 dimension count, u64 dimensions (innermost first),
u32 ggml type and u64 offset into the data section, which starts at the next multiple of
`general.alignment` (default 32) after the index.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain elements (the rest are blocks, read as bytes)
_PLAIN_TENSORS = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4",
                  "I64": "<i8"}


class Unsupported(Exception):
    """A valid GGUF file this reader leaves to GGUFReader."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor, with the attributes of GGUFReader's ReaderTensor that the loader reads."""

    name: str
    tensor_type: Any         # gguf.GGMLQuantizationType
    shape: np.ndarray        # dims, innermost first (uint64)
    data: np.ndarray         # read-only view of the file: elements, or [..., bytes] for blocks


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("string runs past the end of the file")
        s = str(self.buf[self.pos:end], "utf-8")
        self.pos = end
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise ValueError("array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos = end
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.take(fmt)


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorEntry]]:
    """(metadata key -> value as GGUFReader's `contents()` gives it, tensors in file order).
    Raises Unsupported for files GGUFReader should read, ValueError for malformed ones."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mm = np.memmap(path, mode="r")
    buf = memoryview(mm)
    cur = _Cursor(buf)
    try:
        if cur.take("<I") != 0x46554747:            # "GGUF" read little-endian
            raise ValueError("not a GGUF file (bad magic)")
        version = cur.take("<I")
        if version not in (2, 3):
            raise Unsupported(f"GGUF version {version}")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.take("<I"))
        index = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            index.append((name, dims, cur.take("<I"), cur.take("<Q")))
    except struct.error as e:
        raise ValueError(f"truncated GGUF header: {e}") from e
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors, seen = [], set()
    for name, dims, raw_type, offset in index:
        if name in seen:
            raise ValueError(f"duplicated tensor {name!r}")
        seen.add(name)
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            import gguf

            raise ValueError(f"tensor {name!r} has GGML type {raw_type}, which the installed gguf package "
                             f"({getattr(gguf, '__version__', '?')}) does not know: the file is newer than it, "
                             "or damaged") from None
        n_elems = int(np.prod(dims, dtype=np.int64))
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        np_dims = tuple(reversed(dims))
        plain = _PLAIN_TENSORS.get(ggml_type.name)
        if plain is not None:
            dtype, count = np.dtype(plain), n_elems
        else:
            dtype, count = np.dtype(np.uint8), n_elems * type_size // block
            np_dims = quant_shape_to_byte_shape(np_dims, ggml_type)
        begin = start + offset
        if begin + count * dtype.itemsize > len(mm):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(mm, dtype=dtype, count=count, offset=begin).reshape(np_dims)
        tensors.append(TensorEntry(name, ggml_type, np.array(dims, dtype=np.uint64), data))
    return meta, tensors


def read_gguf(path: Path) -> tuple[dict[str, Any], list]:
    """`read_header`, or GGUFReader's fields and tensors for the files it leaves out."""
    try:
        return read_header(path)
    except Unsupported:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        return {k: f.contents() for k, f in reader.fields.items()}, list(reader.tensors)
