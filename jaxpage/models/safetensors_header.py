"""Reads a safetensors file's header and checks every field of it before safetensors' own reader sees the file.

Layout: u64 little-endian header length N | N bytes of UTF-8 JSON | the data section. The header is a JSON object:
an optional "__metadata__" of strings, and per tensor {"dtype": "F32", "shape": [rows, cols], "data_offsets": [begin,
end]}, offsets in bytes from the start of the data section, the tensors back to back covering it exactly.

safetensors refuses a malformed header with one generic message, and its numpy reader fails with numpy's own error on
a dtype numpy lacks (FP8); here each fault is a ModelLoadError naming the file, the tensor and the field. Dtypes other
than the floats jaxpage reads are refused by name: integer tensors are a quantized checkpoint's weights, which read as
floats would give wrong logits; a checkpoint whose config.json declares its quantization (jaxpage.config.
weight_quantization) has its integer and FP8 tensors read (QUANTIZED_DTYPES).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from jaxpage.errors import ModelLoadError
from jaxpage.validation import describe, is_int

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
METADATA_KEY = "__metadata__"
# Every dtype safetensors knows, by its bits per element.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}  # fmt: skip
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # what jaxpage reads: each converts exactly to the model's dtype
SMALL_FLOAT_DTYPES = tuple(d for d in DTYPE_BITS if d[:2] in ("F8", "F6", "F4"))  # FP8 / FP6 / FP4 checkpoints
# What a pre-quantized checkpoint (jaxpage.config.weight_quantization) holds besides floats: packed or int8 codes,
# shapes and group indices, FP8 weights
QUANTIZED_DTYPES = (*FLOAT_DTYPES, "I8", "U8", "I16", "I32", "I64", "F8_E4M3")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str  # one of FLOAT_DTYPES
    shape: tuple[int, ...]
    begin: int  # its bytes, from the start of the data section
    end: int


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]  # in the header's order
    data_start: int  # where the data section starts in the file: 8 + the header's length


def read_safetensors_header(path: Path, dtypes: tuple[str, ...] = FLOAT_DTYPES) -> SafetensorsHeader:
    """The header of the safetensors file at `path`, every field checked: ModelLoadError naming the file, the tensor
    and the field for a header that is not a JSON object of tensors, a dtype safetensors does not know or jaxpage
    does not read (`dtypes`: FLOAT_DTYPES, or QUANTIZED_DTYPES for a pre-quantized checkpoint), a shape that is not
    a list of non-negative integers, data_offsets that are not two integers 0 <= begin <= end spanning exactly
    shape's elements of dtype, tensors that overlap or leave bytes of the data section to none, and a file truncated
    inside its header or its data."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelLoadError(
                    f"{path}: not a safetensors file: {size} bytes, less than its 8-byte header length"
                )
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES:
                raise ModelLoadError(
                    f"{path}: not a valid safetensors file: its header length {header_len} is over safetensors' "
                    f"limit of {MAX_HEADER_BYTES} bytes"
                )
            if 8 + header_len > size:
                raise ModelLoadError(f"{path}: truncated inside its header ({header_len} bytes, the file has {size})")
            raw = f.read(header_len)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the file ({e.strerror or e})") from None
    header = _parse_json(path, raw)
    data_len = size - 8 - header_len
    metadata = _metadata(path, header.get(METADATA_KEY))
    tensors = {
        name: _tensor_info(path, name, info, data_len, size - data_len, dtypes)
        for name, info in header.items()
        if name != METADATA_KEY
    }
    _check_coverage(path, tensors, data_len)
    return SafetensorsHeader(metadata, tensors, 8 + header_len)


def _quoted(name: str) -> str:
    """A tensor's name quoted for a message (cut if a hostile file makes it huge)."""
    return describe(name, 200)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _parse_json(path: Path, raw: bytes) -> dict:
    def invalid(problem: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: not a valid safetensors file: its header {problem}")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"is not UTF-8 ({e.reason} at byte {8 + e.start})") from None
    try:
        header = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except _DuplicateKey as e:
        raise invalid(f"has the key {describe(e.args[0])} twice") from None
    except json.JSONDecodeError as e:
        raise invalid(f"is not JSON ({e.msg} at character {e.pos})") from None
    except ValueError as e:  # NaN or Infinity, which Python's json reads and safetensors' does not
        raise invalid(f"is not JSON ({e})") from None
    except RecursionError:
        raise invalid("nests arrays or objects too deep") from None
    if not isinstance(header, dict):
        raise ModelLoadError(
            f"{path}: the header must be a JSON object of tensors ({{name: {{dtype, shape, data_offsets}}}}), "
            f"got {describe(header)}"
        )
    return header


def _metadata(path: Path, metadata) -> dict[str, str]:
    """__metadata__: absent (or null), else an object of strings."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise ModelLoadError(f"{path}: {METADATA_KEY} must be an object of strings, got {describe(metadata)}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise ModelLoadError(f"{path}: {METADATA_KEY}[{key!r}] must be a string, got {describe(value)}")
    return dict(metadata)


def _unreadable(dtype: str) -> str:
    """Why jaxpage refuses a tensor of `dtype` (not one of FLOAT_DTYPES)."""
    reads = f"jaxpage reads float tensors ({', '.join(FLOAT_DTYPES)})"
    if dtype in SMALL_FLOAT_DTYPES:
        return (
            f"{reads}; {dtype} tensors are the weights of a pre-quantized (FP8/FP6/FP4) checkpoint, which jaxpage "
            "does not load: use the model's unquantized weights (quantization='int8' quantizes them as they load)"
        )
    if dtype in ("C64", "BOOL"):
        return f"{reads}; a {dtype} tensor is no weight of a model jaxpage runs"
    return (
        f"{reads}; {dtype} tensors are the weights of a quantized checkpoint (GPTQ, AWQ, compressed-tensors, "
        "bitsandbytes, ...), which jaxpage does not load (read as floats they would give wrong logits): use the "
        "model's unquantized weights (quantization='int8' quantizes them as they load)"
    )


def _tensor_info(path: Path, name: str, info, data_len: int, data_start: int, dtypes: tuple[str, ...]) -> TensorInfo:
    """One tensor's entry, checked: dtype, shape, then data_offsets against both and the data section's length."""
    where = f"{path}: tensor {_quoted(name)}"
    if not isinstance(info, dict):
        raise ModelLoadError(f"{where} must be an object {{dtype, shape, data_offsets}}, got {describe(info)}")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in info:
            raise ModelLoadError(f"{where}: required field {field!r} is missing")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ModelLoadError(
            f"{where}: dtype must be a safetensors dtype ({', '.join(DTYPE_BITS)}), got {describe(dtype)}"
        )
    if dtype not in dtypes:
        raise ModelLoadError(f"{where} has dtype {dtype}, which jaxpage does not read: {_unreadable(dtype)}")
    if not isinstance(shape, list) or not all(is_int(n) and 0 <= n < 2**64 for n in shape):  # safetensors' u64
        raise ModelLoadError(f"{where}: shape must be a list of non-negative integers, got {describe(shape)}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(n) for n in offsets):
        raise ModelLoadError(f"{where}: data_offsets must be two integers [begin, end], got {describe(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise ModelLoadError(
            f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {describe(offsets)}"
        )
    if end > data_len:
        raise ModelLoadError(
            f"{path}: truncated: tensor {_quoted(name)} ends at byte {data_start + end}, the file has "
            f"{data_start + data_len}"
        )
    n_bytes = math.prod(shape) * DTYPE_BITS[dtype] // 8
    if end - begin != n_bytes:
        raise ModelLoadError(
            f"{where}: data_offsets must span {n_bytes} bytes (shape {shape} of {dtype}), got {describe(offsets)} "
            f"({end - begin} bytes)"
        )
    return TensorInfo(dtype, tuple(shape), begin, end)


def _check_coverage(path: Path, tensors: dict[str, TensorInfo], data_len: int) -> None:
    """The tensors lie back to back over the whole data section, as safetensors requires: no overlap, no gap, no
    bytes after the last."""
    covered, previous = 0, None
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin < covered:
            raise ModelLoadError(
                f"{path}: tensors {_quoted(previous)} and {_quoted(name)} overlap (data_offsets "
                f"{[tensors[previous].begin, covered]} and {[info.begin, info.end]})"
            )
        if info.begin > covered:
            raise ModelLoadError(
                f"{path}: bytes {covered}..{info.begin} of the data section belong to no tensor (before tensor "
                f"{_quoted(name)}); a safetensors file holds its tensors back to back"
            )
        covered, previous = info.end, name
    if covered != data_len:
        raise ModelLoadError(
            f"{path}: the last {data_len - covered} bytes of the file belong to no tensor (the tensors end at byte "
            f"{covered} of its {data_len}-byte data section)"
        )
