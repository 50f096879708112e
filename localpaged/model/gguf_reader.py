"""A fast GGUF header reader: the file memory-mapped with numpy, scalar metadata read at
open, arrays (the tokenizer's tokens, scores, merges, token types) only located until asked.

The `gguf` package's `GGUFReader` builds a numpy view per element of every metadata array,
seconds to a minute for a 49k-token vocabulary; this reader walks only the lengths of string
arrays and reads numeric arrays with one `np.frombuffer`. Its `tensors` have the fields of the
`gguf` package's `ReaderTensor`s (their `tensor_type` an int enum equal to the package's), and
it does without the package (a tenth of a second to import, at every load).

Layout (GGUF v2/v3, little-endian): magic `GGUF`, u32 version, u64 tensor count, u64
metadata count; metadata entries (string key, u32 value type, value); tensor infos (string
name, u32 dims, u64 per dim, u32 GGML type, u64 offset); padding to `general.alignment`
(default 32); the tensor data. A string is a u64 length and its UTF-8 bytes; an array a u32
element type, a u64 count and the elements.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localpaged.model.ggml_type_ids import TYPE_SIZES, GGMLType

# GGUF value type -> numpy dtype of the fixed-size ones (8: string, 9: array).
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_PLAIN = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.F64: np.float64,
          GGMLType.I8: np.int8, GGMLType.I16: np.int16, GGMLType.I32: np.int32,
          GGMLType.I64: np.int64}


class GGUFFormatError(ValueError):
    """The bytes do not form a GGUF file (truncated, corrupt, or an unsupported version)."""


class UnknownGGMLType(GGUFFormatError):
    """A tensor's GGML type number is not one this package knows (a type newer than it)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: the fields of the `gguf` package's `ReaderTensor`."""

    name: str
    tensor_type: GGMLType
    shape: np.ndarray  # GGUF order (innermost dimension first), uint64
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a view of the mapping: the array itself for plain types, else bytes


@dataclass
class Field:
    """One metadata entry: a scalar read at open, or an array located at open and read on
    `contents()` (strings decoded, numbers as Python values)."""

    name: str
    value_type: int
    value: Any = None
    item_type: int = -1
    count: int = 0
    offset: int = 0
    _buf: np.ndarray | None = None

    def contents(self) -> Any:
        if self.value_type != _ARRAY:
            return self.value
        if self.item_type == _STRING:
            return self.strings()
        return self.array().tolist()

    def array(self) -> np.ndarray:
        """A numeric array's values (a view of the file: read-only)."""
        if self.item_type not in _SCALARS or self._buf is None:
            raise TypeError(f"{self.name} is not a numeric array")
        dtype = np.dtype(_SCALARS[self.item_type])
        values = np.frombuffer(self._buf, dtype, self.count, self.offset)
        return values.astype(bool) if self.item_type == _BOOL else values

    def strings(self) -> list[str]:
        """A string array's values."""
        buf = self._buf
        if self.item_type != _STRING or buf is None:
            raise TypeError(f"{self.name} is not a string array")
        raw = buf.data
        out, at = [], self.offset
        for _ in range(self.count):
            n = int.from_bytes(raw[at:at + 8], "little")
            out.append(bytes(raw[at + 8:at + 8 + n]).decode("utf-8"))
            at += 8 + n
        return out

    def __len__(self) -> int:
        return self.count if self.value_type == _ARRAY else 1


_U64 = struct.Struct("<Q")


class _Cursor:
    """Reads little-endian values from a byte buffer, refusing to run past its end."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.at, self.size = buf, 0, buf.size

    def take(self, n: int) -> int:
        start = self.at
        if n < 0 or start + n > self.size:
            raise GGUFFormatError(f"needs bytes up to {start + n} but the file has {self.size}")
        self.at = start + n
        return start

    def scalar(self, kind: int) -> Any:
        dtype = np.dtype(_SCALARS[kind])
        value = np.frombuffer(self.buf, dtype, 1, self.take(dtype.itemsize))[0].item()
        return bool(value) if kind == _BOOL else value

    def u32(self) -> int:
        return int(self.scalar(4))

    def u64(self) -> int:
        return int(self.scalar(10))

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at byte {start} is not UTF-8 ({exc})") from None

    def skip_strings(self, count: int) -> None:
        # one loop over locals: a vocabulary's 100k strings through take() cost 0.1 s a load
        raw, at, size, length = self.buf.data, self.at, self.size, _U64.unpack_from
        for _ in range(count):
            if at + 8 > size:  # no room for the length: reported as take(8) would
                at += 8
                break
            at += 8 + length(raw, at)[0]
        if at > size:
            raise GGUFFormatError(f"needs bytes up to {at} but the file has {size}")
        self.at = at

    def field(self, name: str) -> Field:
        kind = self.u32()
        if kind == _STRING:
            return Field(name, kind, self.string())
        if kind in _SCALARS:
            return Field(name, kind, self.scalar(kind))
        if kind != _ARRAY:
            raise GGUFFormatError(f"metadata {name} has unknown value type {kind}")
        item, count = self.u32(), self.u64()
        field = Field(name, kind, item_type=item, count=count, offset=self.at, _buf=self.buf)
        if item == _STRING:
            self.skip_strings(count)
        elif item in _SCALARS:
            self.take(count * np.dtype(_SCALARS[item]).itemsize)
        else:  # nested arrays: no model file the loader reads has them
            raise GGUFFormatError(f"metadata {name} is an array of type {item}, not supported")
        return field


class FastGGUFReader:
    """`fields` (name -> `Field`) and `tensors` (`GGUFTensor`s, data as views of the
    read-only mapping) of a GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(self.data)
        if bytes(self.data[cur.take(4):4]) != b"GGUF":
            raise GGUFFormatError("bad magic")
        self.version = cur.u32()
        if self.version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_fields = cur.u64(), cur.u64()
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            name = cur.string()
            self.fields[name] = cur.field(name)
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        align_field = self.fields.get("general.alignment")
        align = int(align_field.value) if align_field is not None else 32
        if align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"general.alignment {align} is not a power of two")
        self.data_offset = -(-cur.at // align) * align
        self.tensors = self._tensors(infos)

    def release(self, view: np.ndarray) -> None:
        """Drop the pages under `view` (a tensor's data) from this process's memory: they stay
        in the OS's page cache, and a later read of `view` maps them again (MADV_DONTNEED on
        a read-only file mapping loses nothing). Does nothing where mmap cannot say so."""
        mm = getattr(self.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = view.__array_interface__["data"][0] - self.data.__array_interface__["data"][0]
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(start + view.nbytes, self.data.size)
        if 0 <= first < end:
            mm.madvise(mmap.MADV_DONTNEED, first, end - first)

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, list[int], int, int]:
        name = cur.string()
        n_dims = cur.u32()
        if n_dims > 8:
            raise GGUFFormatError(f"tensor {name} has {n_dims} dimensions")
        dims = [cur.u64() for _ in range(n_dims)]
        return name, dims, cur.u32(), cur.u64()

    def _tensors(self, infos: list[tuple[str, list[int], int, int]]) -> list[GGUFTensor]:
        tensors, seen = [], set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise GGUFFormatError(f"tensor {name} appears twice")
            seen.add(name)
            try:
                kind = GGMLType(raw_type)
            except ValueError:
                raise UnknownGGMLType(f"tensor {name} has GGML type {raw_type}, unknown to this "
                                      "localpaged") from None
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, size = TYPE_SIZES[kind]
            n_bytes = n_elems * size // block
            start = self.data_offset + offset
            if start + n_bytes > self.data.size:
                raise GGUFFormatError(f"tensor {name} needs bytes up to {start + n_bytes} but "
                                      f"the file has {self.data.size}")
            shape = tuple(reversed(dims))
            if kind in _PLAIN:
                data = np.frombuffer(self.data, _PLAIN[kind], n_elems, start).reshape(shape)
            else:
                data = self.data[start:start + n_bytes].reshape(*shape[:-1], -1)
            tensors.append(GGUFTensor(name=name, tensor_type=kind,
                                      shape=np.array(dims, dtype=np.uint64), n_elements=n_elems,
                                      n_bytes=n_bytes, data_offset=start, data=data))
        return tensors
