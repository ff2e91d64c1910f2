"""Reads a GGUF file (llama.cpp's model format, versions 2 and 3, little-endian) without copying its tensors.

Layout, every number little-endian:
  header        "GGUF" | u32 version | u64 tensor count | u64 metadata count
  metadata      per entry: string key | u32 value type | value
  tensor infos  per tensor: string name | u32 dims | u64 sizes[dims], fastest first | u32 ggml type | u64 offset
  padding       up to a multiple of `general.alignment` (32 by default)
  tensor data   each tensor at the data start + its offset
A string is u64 byte length | UTF-8 bytes; an array is u32 item type | u64 count | items (arrays may nest).

The header is parsed with `struct` in one pass: arrays of numbers are read with one `np.frombuffer` each, arrays of
strings in a tight loop (the 49k tokens and merges of a vocabulary take tens of milliseconds, where
`gguf.GGUFReader` builds numpy objects per string and takes seconds). Tensors are read-only views of a memory map of
the file. Anything malformed (truncation, a bad magic or version, an unknown type, an offset past the end, counts the
file cannot hold) raises ModelLoadError naming the file and what is wrong.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from jaxpage.errors import ModelLoadError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses tensors of more dimensions
MAX_ARRAY_NESTING = 8  # arrays of arrays of ...: deeper is refused (it would only exhaust the stack)

# Scalar value types: numpy dtype (for arrays) and struct format (for single values).
SCALAR_TYPES: dict[GGUFValueType, tuple[np.dtype, struct.Struct]] = {
    t: (np.dtype(dtype), struct.Struct(fmt))
    for t, dtype, fmt in (
        (GGUFValueType.UINT8, "<u1", "<B"),
        (GGUFValueType.INT8, "<i1", "<b"),
        (GGUFValueType.UINT16, "<u2", "<H"),
        (GGUFValueType.INT16, "<i2", "<h"),
        (GGUFValueType.UINT32, "<u4", "<I"),
        (GGUFValueType.INT32, "<i4", "<i"),
        (GGUFValueType.FLOAT32, "<f4", "<f"),
        (GGUFValueType.BOOL, "?", "<?"),
        (GGUFValueType.UINT64, "<u8", "<Q"),
        (GGUFValueType.INT64, "<i8", "<q"),
        (GGUFValueType.FLOAT64, "<f8", "<d"),
    )
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")

# The fewest bytes one item of a type takes, to refuse counts the rest of the file cannot hold before reading them.
_MIN_SIZE = {**{t: s.size for t, (_, s) in SCALAR_TYPES.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_MIN_METADATA_ENTRY = 8 + 4 + 1  # empty key, value type, the smallest value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # empty name, no dims, type, offset


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its info and its bytes, a read-only view of the file (nothing copied)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order, row length last (GGUF lists the sizes fastest first)
    offset: int  # of its data, from the start of the file
    data: np.ndarray  # [n_bytes] uint8

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file.

    metadata values: int, float, bool or str for scalars; a 1-D numpy array for an array of numbers or bools; a list
    of str for an array of strings; a list of such arrays for an array of arrays.
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[GGUFValueType, ...]]  # key -> (type,), (ARRAY, item type), (ARRAY, ARRAY, ...)
    tensors: dict[str, GGUFTensor]  # in file order
    alignment: int
    data_offset: int  # where tensor data starts


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parses the GGUF file at `path`; its tensors stay in the file, memory-mapped.

    Raises ModelLoadError naming the file and the fault for a missing, truncated, corrupt or unsupported file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER.size:
                start = f.read(4)
                if start != MAGIC[: len(start)]:
                    raise _not_gguf(path, start)
                raise ModelLoadError(f"{path}: not a valid GGUF file, truncated or damaged: only {size} bytes")
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the file ({e.strerror or e})") from None
    return _Parser(path, buffer).parse()


def _not_gguf(path: Path, start: bytes) -> ModelLoadError:
    return ModelLoadError(f"{path}: not a GGUF file (it starts with {bytes(start)!r}, not {MAGIC!r})")


class _Parser:
    """One pass over the header, metadata and tensor infos; `pos` is the next byte to read."""

    def __init__(self, path: Path, buffer: mmap.mmap):
        self.path = path
        self.buffer = buffer
        self.size = len(buffer)
        self.pos = 0
        self.where = "the header"  # what is being read, for error messages

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: not a valid GGUF file, truncated or damaged: {self.where}: {what}")

    def truncated(self) -> ModelLoadError:
        return self.fail(f"the file ends (at byte {self.size}) in the middle of it")

    def parse(self) -> GGUFFile:
        magic, version, tensor_count, kv_count = _HEADER.unpack_from(self.buffer, 0)
        if magic != MAGIC:
            raise _not_gguf(self.path, magic)
        if version & 0xFFFF == 0 and version:
            raise ModelLoadError(f"{self.path}: a big-endian GGUF file, which jaxpage does not read")
        if version not in SUPPORTED_VERSIONS:
            raise ModelLoadError(
                f"{self.path}: GGUF version {version} is not supported (jaxpage reads versions "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))})"
            )
        self.pos = _HEADER.size
        self.check_count(kv_count, _MIN_METADATA_ENTRY, "metadata entries")
        self.check_count(tensor_count, _MIN_TENSOR_INFO, "tensors")

        metadata: dict[str, Any] = {}
        value_types: dict[str, tuple[GGUFValueType, ...]] = {}
        for index in range(kv_count):
            self.where = f"metadata entry {index}"
            key = self.string()
            self.where = f"metadata {key}"
            if key in metadata:
                raise self.fail("the key appears twice")
            value_type = self.value_type(self.u32())
            metadata[key], value_types[key] = self.value(value_type, 0)

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in metadata and (
            value_types["general.alignment"] != (GGUFValueType.UINT32,) or alignment <= 0 or alignment & (alignment - 1)
        ):
            self.where = "metadata general.alignment"
            raise self.fail(f"{alignment!r} is not a power of two stored as uint32")

        infos = [self.tensor_info(index) for index in range(tensor_count)]
        data_offset = -(-self.pos // alignment) * alignment
        tensors: dict[str, GGUFTensor] = {}
        whole_file = np.frombuffer(self.buffer, np.uint8)
        for name, tensor_type, shape, offset in infos:
            self.where = f"tensor {name!r}"
            if name in tensors:
                raise self.fail("the name appears twice")
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            row = shape[-1] if shape else 1
            if row % block_size:
                raise self.fail(f"rows of {row} values do not split into {tensor_type.name} blocks of {block_size}")
            n_bytes = math.prod(shape) // block_size * type_size
            start = data_offset + offset
            if start + n_bytes > self.size:
                raise self.fail(
                    f"its data (bytes {start}..{start + n_bytes}) runs past the end of the file ({self.size} bytes)"
                )
            tensors[name] = GGUFTensor(name, tensor_type, shape, start, whole_file[start : start + n_bytes])
        return GGUFFile(self.path, version, metadata, value_types, tensors, alignment, data_offset)

    def check_count(self, count: int, min_size: int, what: str) -> None:
        """Refuses a count of items that the rest of the file cannot hold (a corrupt count, not a long loop)."""
        if count * min_size > self.size - self.pos:
            raise self.fail(f"{count} {what} cannot fit in the {self.size - self.pos} bytes left")

    def u32(self) -> int:
        try:
            (value,) = _U32.unpack_from(self.buffer, self.pos)
        except struct.error:
            raise self.truncated() from None
        self.pos += 4
        return value

    def u64(self) -> int:
        try:
            (value,) = _U64.unpack_from(self.buffer, self.pos)
        except struct.error:
            raise self.truncated() from None
        self.pos += 8
        return value

    def string(self) -> str:
        length = self.u64()
        if length > self.size - self.pos:
            raise self.truncated()
        raw = self.buffer[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"a string that is not UTF-8 ({e.reason} at byte {e.start})") from None

    def value_type(self, raw: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"unknown value type {raw}") from None

    def value(self, value_type: GGUFValueType, depth: int) -> tuple[Any, tuple[GGUFValueType, ...]]:
        """(value, its type path) of one value of `value_type` at `pos`."""
        if value_type == GGUFValueType.STRING:
            return self.string(), (value_type,)
        if value_type != GGUFValueType.ARRAY:
            layout = SCALAR_TYPES[value_type][1]
            try:
                (value,) = layout.unpack_from(self.buffer, self.pos)
            except struct.error:
                raise self.truncated() from None
            self.pos += layout.size
            return value, (value_type,)

        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"arrays nested more than {MAX_ARRAY_NESTING} deep")
        item_type = self.value_type(self.u32())
        count = self.u64()
        self.check_count(count, _MIN_SIZE[item_type], f"array items of type {item_type.name}")
        if item_type == GGUFValueType.STRING:
            return self.strings(count), (value_type, item_type)
        if item_type == GGUFValueType.ARRAY:
            items = [self.value(item_type, depth + 1) for _ in range(count)]
            # The type path of an array of arrays comes from its first item, as gguf.GGUFReader reports it.
            inner = items[0][1] if items else (GGUFValueType.ARRAY,)
            return [value for value, _ in items], (value_type, *inner)
        dtype = SCALAR_TYPES[item_type][0]
        values = np.frombuffer(self.buffer, dtype, count, self.pos).copy()
        self.pos += count * dtype.itemsize
        return values, (value_type, item_type)

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings at `pos`, in one tight loop (vocabularies hold 100k of them)."""
        buffer, pos, unpack = self.buffer, self.pos, _U64.unpack_from
        strings = [""] * count
        index = 0
        try:
            for index in range(count):
                (length,) = unpack(buffer, pos)
                pos += 8
                strings[index] = buffer[pos : pos + length].decode("utf-8")
                pos += length
        except struct.error:
            raise self.truncated() from None
        except UnicodeDecodeError as e:
            raise self.fail(f"string {index} is not UTF-8 ({e.reason} at byte {e.start})") from None
        if pos > self.size:  # the last string's bytes ran past the end (slicing stops there silently)
            raise self.truncated()
        self.pos = pos
        return strings

    def tensor_info(self, index: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        self.where = f"tensor info {index}"
        name = self.string()
        self.where = f"tensor info {index} ({name!r})"
        n_dims = self.u32()
        if n_dims > MAX_DIMS:
            raise self.fail(f"{n_dims} dimensions (GGUF tensors have at most {MAX_DIMS})")
        sizes = [self.u64() for _ in range(n_dims)]
        raw_type = self.u32()
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.fail(f"unknown tensor type {raw_type}") from None
        offset = self.u64()
        return name, tensor_type, tuple(reversed(sizes)), offset
