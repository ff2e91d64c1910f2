"""jaxpage.models.gguf_file: it reads what gguf.GGUFReader reads, and refuses damaged files with a clear ModelLoadError.

Files are written with gguf.GGUFWriter (or, where the writer refuses, e.g. empty arrays, by hand); damaged files are
made by patching bytes at offsets that gguf.GGUFReader reports for the intact file.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpage.errors import ModelLoadError
from jaxpage.models.gguf_dequant import SUPPORTED_TYPES, dequantize
from jaxpage.models.gguf_file import MAX_ARRAY_NESTING, GGUFFile, read_gguf

V = gguf.GGUFValueType
T = gguf.GGMLQuantizationType

SCALARS = {  # value type -> (numpy dtype, strategy of its values)
    V.UINT8: (np.uint8, st.integers(0, 2**8 - 1)),
    V.INT8: (np.int8, st.integers(-(2**7), 2**7 - 1)),
    V.UINT16: (np.uint16, st.integers(0, 2**16 - 1)),
    V.INT16: (np.int16, st.integers(-(2**15), 2**15 - 1)),
    V.UINT32: (np.uint32, st.integers(0, 2**32 - 1)),
    V.INT32: (np.int32, st.integers(-(2**31), 2**31 - 1)),
    V.UINT64: (np.uint64, st.integers(0, 2**64 - 1)),
    V.INT64: (np.int64, st.integers(-(2**63), 2**63 - 1)),
    V.FLOAT32: (np.float32, st.floats(width=32)),
    V.FLOAT64: (np.float64, st.floats()),
    V.BOOL: (np.bool_, st.booleans()),
}


def canonical(value):
    """A value with every float replaced by its hex spelling (so NaN equals NaN) and arrays made lists."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, value)


def flattened(value):
    """A (nested) array's leaves in order: how gguf.GGUFReader reports an array of arrays."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list) and value and isinstance(value[0], (list, np.ndarray)):
        return [leaf for item in value for leaf in flattened(item)]
    return value


def assert_agrees_with_gguf_reader(path: Path) -> GGUFFile:
    ours = read_gguf(path)
    reference = gguf.GGUFReader(path, "r")
    fields = {key: field for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert ours.version == reference.fields["GGUF.version"].contents()
    assert list(ours.metadata) == list(fields)  # the file's order
    for key, field in fields.items():
        types = tuple(field.types)
        # gguf.GGUFReader learns an array's item type from its first item: an empty array reports only ARRAY.
        assert ours.value_types[key][: len(types)] == types, key
        assert canonical(flattened(ours.metadata[key])) == canonical(field.contents()), key
    assert ours.alignment == reference.alignment and ours.data_offset == reference.data_offset
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for expected in reference.tensors:
        tensor = ours.tensors[expected.name]
        assert tensor.tensor_type == expected.tensor_type, tensor.name
        assert tensor.shape == tuple(reversed(expected.shape.tolist())), tensor.name
        assert tensor.n_elements == expected.n_elements, tensor.name
        assert tensor.offset == expected.data_offset and tensor.data.size == expected.n_bytes, tensor.name
        np.testing.assert_array_equal(tensor.data, np.asarray(expected.data).view(np.uint8).reshape(-1))
        assert not tensor.data.flags.writeable
    return ours


def write_gguf(path: Path, metadata: dict, tensors: dict | None = None, alignment: int | None = None) -> Path:
    """metadata: key -> (value type, value[, array item type]); tensors: name -> (array, raw ggml type or None)."""
    writer = gguf.GGUFWriter(str(path), arch=None)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value_type, value, *item_type) in metadata.items():
        writer.add_key_value(key, value, value_type, *item_type)
    for name, (array, raw_type) in (tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantized(qtype: T, rows: int, row_length: int, seed: int = 0) -> np.ndarray:
    """Random block bytes [rows, bytes per row] of a tensor of `qtype`, with finite float16 fields."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    values = np.random.default_rng(seed).normal(0.0, 0.5, (rows, row_length)).astype(np.float32)
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16):
        return gguf.quants.quantize(values, qtype).view(np.uint8)
    return np.random.default_rng(seed).integers(0, 112, (rows, row_length // block_size * type_size), dtype=np.uint8)


EVERY_KIND_OF_VALUE = {
    **{f"scalar.{t.name.lower()}": (t, 1 if t != V.BOOL else True) for t in SCALARS},
    "scalar.float32.third": (V.FLOAT32, 1 / 3),
    "scalar.uint64.max": (V.UINT64, 2**64 - 1),
    "scalar.int64.min": (V.INT64, -(2**63)),
    "string.ascii": (V.STRING, "hello"),
    "string.empty": (V.STRING, ""),
    "string.unicode": (V.STRING, "Grüße, 東京 🙂\n\x00tab\t"),
    "ключ.東京": (V.STRING, "a unicode key"),
    **{f"array.{t.name.lower()}": (V.ARRAY, [0, 1, 1], t) for t in SCALARS if t != V.BOOL},
    "array.bool": (V.ARRAY, [True, False, True], V.BOOL),
    "array.float32": (V.ARRAY, [0.5, -1.25, 1e30], V.FLOAT32),
    "array.strings": (V.ARRAY, ["a", "", "東京", "🙂 x"], V.STRING),
    "array.nested": (V.ARRAY, [[1, 2], [3], [4, 5, 6]]),
    "array.nested.strings": (V.ARRAY, [["a", "b"], ["c"]]),
    "array.deeply.nested": (V.ARRAY, [[[1.5]], [[2.5, 3.5]]]),
}


def every_kind_of_tensor() -> dict:
    rng = np.random.default_rng(0)
    return {
        "f32.1d": (rng.normal(size=7).astype(np.float32), None),
        "f32.2d": (rng.normal(size=(3, 5)).astype(np.float32), None),
        "f16.3d": (rng.normal(size=(2, 3, 4)).astype(np.float16), None),
        "f32.4d": (rng.normal(size=(2, 1, 3, 2)).astype(np.float32), None),
        **{f"{t.name}": (quantized(t, 3, 512), t) for t in sorted(SUPPORTED_TYPES - {T.F32, T.F16})},
    }


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_every_kind_of_value_and_tensor_agrees_with_gguf_reader(tmp_path, alignment):
    tensors = every_kind_of_tensor()
    path = write_gguf(tmp_path / "all.gguf", EVERY_KIND_OF_VALUE, tensors, alignment)
    ours = assert_agrees_with_gguf_reader(path)
    assert ours.metadata["array.nested"][1].tolist() == [3]
    assert ours.value_types["array.deeply.nested"] == (V.ARRAY, V.ARRAY, V.ARRAY, V.FLOAT32)
    assert ours.alignment == (alignment or 32) and all(t.offset % ours.alignment == 0 for t in ours.tensors.values())
    for name, tensor in ours.tensors.items():  # the bytes also dequantize as gguf's do
        want = gguf.quants.dequantize(tensors[name][0], tensor.tensor_type).astype(np.float32).reshape(tensor.shape)
        np.testing.assert_array_equal(dequantize(tensor.data, tensor.tensor_type, tensor.shape), want)


def test_a_file_without_tensors_or_metadata(tmp_path):
    ours = assert_agrees_with_gguf_reader(write_gguf(tmp_path / "empty.gguf", {}))
    assert ours.metadata == {} and ours.tensors == {}


def test_default_model_agrees_with_gguf_reader(smollm2_path):
    ours = assert_agrees_with_gguf_reader(smollm2_path)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152 and len(ours.tensors) == 272


# A value of every type, arrays of each, nested arrays: what hypothesis draws. Arrays are never empty here
# (gguf.GGUFWriter refuses to write them); test_empty_arrays covers those.
scalar_values = st.sampled_from(sorted(SCALARS)).flatmap(lambda t: SCALARS[t][1].map(lambda v: (t, v)))
string_values = st.text(max_size=12).map(lambda s: (V.STRING, s))
array_values = st.sampled_from([*sorted(SCALARS), V.STRING]).flatmap(
    lambda t: st.lists(SCALARS[t][1] if t in SCALARS else st.text(max_size=6), min_size=1, max_size=8).map(
        lambda items: (V.ARRAY, items, t)
    )
)
nested_values = st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=4), min_size=1, max_size=4)
metadata_values = st.one_of(scalar_values, string_values, array_values, nested_values.map(lambda v: (V.ARRAY, v)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata=st.dictionaries(st.text(min_size=1, max_size=10), metadata_values, max_size=8))
def test_random_metadata_agrees_with_gguf_reader(tmp_path, metadata):
    assert_agrees_with_gguf_reader(write_gguf(tmp_path / "random.gguf", metadata))


# ----- files written by hand -----


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def handwritten(entries: list[tuple[str, int, bytes]], version: int = 3) -> bytes:
    """A GGUF file's bytes: header and metadata entries (key, value type, encoded value), no tensors."""
    body = b"".join(gguf_string(key) + struct.pack("<I", value_type) + value for key, value_type, value in entries)
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(entries)) + body


def test_empty_arrays(tmp_path):
    path = tmp_path / "empty-arrays.gguf"
    path.write_bytes(
        handwritten(
            [
                ("numbers", V.ARRAY, struct.pack("<IQ", V.INT32, 0)),
                ("strings", V.ARRAY, struct.pack("<IQ", V.STRING, 0)),
                ("arrays", V.ARRAY, struct.pack("<IQ", V.ARRAY, 0)),
                ("array of an empty array", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) + struct.pack("<IQ", V.UINT8, 0)),
            ]
        )
    )
    ours = assert_agrees_with_gguf_reader(path)
    assert ours.metadata["numbers"].dtype == np.int32 and ours.metadata["numbers"].size == 0
    assert ours.metadata["strings"] == [] and ours.metadata["arrays"] == []
    assert ours.value_types["numbers"] == (V.ARRAY, V.INT32)
    assert [a.tolist() for a in ours.metadata["array of an empty array"]] == [[]]


def test_version_2_is_read(tmp_path):
    path = tmp_path / "v2.gguf"
    path.write_bytes(handwritten([("key", V.UINT32, struct.pack("<I", 7))], version=2))
    ours = assert_agrees_with_gguf_reader(path)
    assert ours.version == 2 and ours.metadata == {"key": 7}


# ----- damaged files: ModelLoadError naming the file and the fault -----


@pytest.fixture
def intact(tmp_path) -> tuple[Path, gguf.GGUFReader]:
    """A small valid file with metadata of each kind and two tensors, and gguf's reading of it (for offsets)."""
    metadata = {
        "general.architecture": (V.STRING, "llama"),
        "key.a": (V.UINT32, 5),
        "key.b": (V.UINT32, 6),
        "numbers": (V.ARRAY, [1, 2, 3], V.INT32),
        "strings": (V.ARRAY, ["one", "two", "三"], V.STRING),
        "nested": (V.ARRAY, [[1.0], [2.0, 3.0]]),
    }
    tensors = {"t.a": (quantized(T.Q8_0, 2, 64), T.Q8_0), "t.b": (np.ones((2, 3), np.float32), None)}
    path = write_gguf(tmp_path / "model.gguf", metadata, tensors)
    return path, gguf.GGUFReader(path, "r")


def key_offset(reader: gguf.GGUFReader, key: str) -> int:
    """Where the value type of metadata entry `key` is (after its length-prefixed key)."""
    return int(reader.fields[key].offset) + 8 + len(key.encode())


def tensor_info_offset(reader: gguf.GGUFReader, name: str) -> int:
    """Where the dimension count of tensor `name`'s info is (after its length-prefixed name)."""
    return int(next(t for t in reader.tensors if t.name == name).field.offset) + 8 + len(name.encode())


def patched(path: Path, offset: int, new: bytes) -> Path:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(new)] = new
    damaged = path.with_name("damaged.gguf")
    damaged.write_bytes(bytes(data))
    return damaged


def refused(path: Path, *phrases: str) -> str:
    with pytest.raises(ModelLoadError) as error:
        read_gguf(path)
    message = str(error.value)
    assert message.startswith(f"{path}: "), message
    for phrase in phrases:
        assert phrase in message, message
    return message


def test_every_truncation_is_refused(intact, tmp_path):
    path, reader = intact
    data = path.read_bytes()
    end_of_tensors = max(t.data_offset + t.n_bytes for t in reader.tensors)
    cut_file = tmp_path / "cut.gguf"
    for size in range(end_of_tensors):
        cut_file.write_bytes(data[:size])
        refused(cut_file, "truncated")
    for size in range(end_of_tensors, len(data) + 1):  # only the padding after the last tensor is missing
        cut_file.write_bytes(data[:size])
        assert list(read_gguf(cut_file).tensors) == ["t.a", "t.b"]


@pytest.mark.parametrize("last", ["string", "strings", "numbers", "nested"])
def test_every_truncation_of_metadata_is_refused(tmp_path, last):
    """Without tensors the metadata ends the file: a cut anywhere in its last value must still be noticed."""
    values = {
        "string": (V.STRING, gguf_string("東京 tail")),
        "strings": (V.ARRAY, struct.pack("<IQ", V.STRING, 2) + gguf_string("ab") + gguf_string("cdé")),
        "numbers": (V.ARRAY, struct.pack("<IQ", V.UINT16, 3) + struct.pack("<3H", 1, 2, 3)),
        "nested": (V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) + struct.pack("<IQ", V.INT8, 2) + b"\x01\x02"),
    }
    data = handwritten([("first", V.BOOL, b"\x01"), ("last", *values[last])])
    path = tmp_path / "cut.gguf"
    for size in range(len(data)):
        path.write_bytes(data[:size])
        refused(path, "truncated")
    path.write_bytes(data)
    assert_agrees_with_gguf_reader(path)


@pytest.mark.parametrize(
    ("offset", "new", "phrases"),
    [
        (0, b"GGML", ("not a GGUF file", "b'GGML'")),
        (4, struct.pack("<I", 1), ("GGUF version 1 is not supported",)),
        (4, struct.pack("<I", 4), ("GGUF version 4 is not supported",)),
        (4, struct.pack(">I", 3), ("big-endian",)),
        (8, struct.pack("<Q", 2**64 - 1), ("18446744073709551615 tensors cannot fit",)),
        (16, struct.pack("<Q", 2**63), ("9223372036854775808 metadata entries cannot fit",)),
        (16, struct.pack("<Q", 1000), ("1000 metadata entries cannot fit",)),
        (24, struct.pack("<Q", 2**64 - 1), ("metadata entry 0", "truncated")),  # the first key's length
    ],
)
def test_damaged_header(intact, offset, new, phrases):
    refused(patched(intact[0], offset, new), *phrases)


def test_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "hello.gguf").write_text("hello, world: no model in here")
    refused(tmp_path / "hello.gguf", "not a GGUF file", "b'hell'")
    (tmp_path / "tiny.gguf").write_bytes(b"hi")
    refused(tmp_path / "tiny.gguf", "not a GGUF file")


def test_missing_file_and_directory(tmp_path):
    refused(tmp_path / "absent.gguf", "cannot read the file")
    refused(tmp_path, "cannot read the file")


@pytest.mark.parametrize(
    ("key", "delta", "new", "phrases"),
    [
        ("key.a", 0, struct.pack("<I", 13), ("metadata key.a", "unknown value type 13")),
        ("numbers", 4, struct.pack("<I", 99), ("metadata numbers", "unknown value type 99")),
        ("numbers", 8, struct.pack("<Q", 2**62), ("metadata numbers", "4611686018427387904 array items", "cannot fit")),
        ("strings", 8, struct.pack("<Q", 2**64 - 1), ("metadata strings", "array items of type STRING cannot fit")),
        ("strings", 16, struct.pack("<Q", 2**40), ("metadata strings", "truncated")),  # the first string's length
        ("strings", 24, b"\xff", ("metadata strings", "string 0 is not UTF-8")),
        ("nested", 8, struct.pack("<Q", 2**60), ("metadata nested", "ARRAY cannot fit")),
        ("key.b", -1, b"a", ("metadata key.a", "the key appears twice")),  # key.b renamed key.a
        ("key.a", -1, b"\xff", ("metadata entry 1", "not UTF-8")),
    ],
)
def test_damaged_metadata(intact, key, delta, new, phrases):
    path, reader = intact
    refused(patched(path, key_offset(reader, key) + delta, new), *phrases)


@pytest.mark.parametrize(
    ("name", "delta", "new", "phrases"),
    [
        ("t.a", 0, struct.pack("<I", 5), ("tensor info 0 ('t.a')", "5 dimensions")),
        ("t.a", 4, struct.pack("<Q", 48), ("tensor 't.a'", "rows of 48 values do not split into Q8_0 blocks of 32")),
        ("t.a", 4 + 16, struct.pack("<I", 99), ("tensor info 0 ('t.a')", "unknown tensor type 99")),
        ("t.b", 4 + 16 + 4, struct.pack("<Q", 2**40), ("tensor 't.b'", "runs past the end of the file")),
        ("t.b", 4 + 8, struct.pack("<Q", 2**61), ("tensor 't.b'", "runs past the end of the file")),  # huge rows
        ("t.b", -1, b"a", ("tensor 't.a'", "the name appears twice")),  # t.b renamed t.a
    ],
)
def test_damaged_tensor_info(intact, name, delta, new, phrases):
    path, reader = intact
    refused(patched(path, tensor_info_offset(reader, name) + delta, new), *phrases)


@pytest.mark.parametrize(
    ("value_type", "value"), [(V.UINT32, struct.pack("<I", 48)), (V.UINT32, struct.pack("<I", 0)), (V.UINT64, b"")]
)
def test_bad_alignment(tmp_path, value_type, value):
    value = value or struct.pack("<Q", 64)
    path = tmp_path / "aligned.gguf"
    path.write_bytes(handwritten([("general.alignment", value_type, value)]))
    refused(path, "metadata general.alignment", "is not a power of two stored as uint32")


def test_arrays_nested_too_deep(tmp_path):
    value = struct.pack("<IQ", V.INT32, 0)
    for _ in range(MAX_ARRAY_NESTING):
        value = struct.pack("<IQ", V.ARRAY, 1) + value
    (tmp_path / "deep.gguf").write_bytes(handwritten([("deep", V.ARRAY, value)]))
    refused(tmp_path / "deep.gguf", "metadata deep", f"arrays nested more than {MAX_ARRAY_NESTING} deep")
    (tmp_path / "ok.gguf").write_bytes(handwritten([("deep", V.ARRAY, value[12:])]))
    assert_agrees_with_gguf_reader(tmp_path / "ok.gguf")
