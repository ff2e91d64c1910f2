"""Hostile model files (issue 55): a safetensors header, config.json, adapter_config.json, tokenizer_config.json or GGUF
metadata holding junk ends in a ModelLoadError that names the file (and the tensor or field), never in another
exception; a checkpoint jaxpage cannot read exactly (pre-quantized: compressed-tensors, FP8, GPTQ, ...) is refused by
name, never loaded as floats.

Each fuzz test starts from a small valid file and replaces a part of it with a value drawn from a strategy of JSON
values (or typed GGUF values, or raw bytes); the file must then load or be refused with a ModelLoadError. Draft models
load through the same load_model, so they are covered by the base model's tests.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from tiny_models import TINY_FAMILIES, tiny_config

from jaxpage.config import ModelConfig
from jaxpage.config.model import SUPPORTED_ARCHITECTURES
from jaxpage.errors import ModelLoadError
from jaxpage.models import load_model
from jaxpage.models.gguf_file import read_gguf
from jaxpage.models.gguf_loader import GGUF_ARCHITECTURES, config_from_gguf
from jaxpage.models.hf_loader import open_safetensors, read_hf_config
from jaxpage.models.lora_adapter import LoRAAdapter, read_lora_adapter
from jaxpage.models.safetensors_header import DTYPE_BITS, read_safetensors_header
from jaxpage.tokenizers.tokenizer import load_tokenizer

FAMILY = TINY_FAMILIES[0]  # Llama: 3 layers, hidden 64, 4 heads of 16, vocab 96
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"
V = gguf.GGUFValueType
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Any JSON value, small; and the numbers a hostile file would try: past int64, past float64, NaN, infinities.
EXTREMES = st.sampled_from([10**400, -(10**400), 2**31, 2**63, 2**64, float("nan"), float("inf"), -float("inf"), -0.0])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5) | EXTREMES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def assert_names(error: pytest.ExceptionInfo, prefix: str) -> None:
    assert error.type is ModelLoadError
    assert str(error.value).startswith(prefix), (prefix, str(error.value))


@pytest.fixture
def model_dir(tiny_model_path, tmp_path):
    """A private copy of the tiny Llama's directory, for a test to damage."""
    return Path(shutil.copytree(tiny_model_path(FAMILY), tmp_path / "model"))


# ----- safetensors headers -----

DATA = np.arange(6, dtype=np.float32).tobytes() + np.arange(4, dtype=np.float16).tobytes()  # a's 24 bytes, b's 8


def valid_header() -> dict:
    return {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F16", "shape": [4], "data_offsets": [24, 32]},
    }


def safetensors_bytes(header, data: bytes = DATA) -> bytes:
    """A safetensors file: the 8-byte header length, the header (a JSON value, or its bytes as given), the data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def assert_refused_or_read(path: Path) -> None:
    """The file is refused with a ModelLoadError naming it, or safetensors reads every tensor of it: what the header
    check passes, safetensors' reader takes."""
    try:
        header = read_safetensors_header(path)
    except ModelLoadError as e:
        assert str(e).startswith(f"{path}: "), str(e)
        return
    with safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == set(header.tensors)
        for name, info in header.tensors.items():
            assert f.get_tensor(name).shape == info.shape
    with open_safetensors(path) as f:
        assert set(f.keys()) == set(header.tensors)


def test_a_valid_header_is_read(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(safetensors_bytes(valid_header()))
    header = read_safetensors_header(path)
    assert header.metadata == {"format": "pt"} and list(header.tensors) == ["a", "b"]
    assert (header.tensors["a"].shape, header.tensors["b"].begin) == ((2, 3), 24)
    save_file({"w": np.ones((3, 5), np.float32), "e": np.zeros((0, 4), np.float16)}, str(path))  # safetensors' own
    assert {name: t.shape for name, t in read_safetensors_header(path).tensors.items()} == {"w": (3, 5), "e": (0, 4)}


ENTRY_VALUES = (
    JSON
    | st.sampled_from([*DTYPE_BITS, "f32", "F128", "", "F32 "])
    | st.lists(st.integers(-3, 40), max_size=4)
    | st.lists(st.integers(0, 2**70), min_size=2, max_size=2)
)


@FUZZ
@given(
    tensor=st.sampled_from(["a", "b"]), field=st.sampled_from(["dtype", "shape", "data_offsets"]), value=ENTRY_VALUES
)
def test_fuzz_a_tensor_field(tmp_path, tensor, field, value):
    header = valid_header()
    header[tensor][field] = value
    path = tmp_path / "x.safetensors"
    path.write_bytes(safetensors_bytes(header))
    assert_refused_or_read(path)


@FUZZ
@given(key=st.sampled_from(["a", "b", "__metadata__", "c"]), value=JSON | ENTRY_VALUES)
def test_fuzz_a_header_entry(tmp_path, key, value):
    header = valid_header() | {key: value}
    path = tmp_path / "x.safetensors"
    path.write_bytes(safetensors_bytes(header))
    assert_refused_or_read(path)


@FUZZ
@given(header=JSON, data=st.binary(max_size=40))
def test_fuzz_the_whole_header(tmp_path, header, data):
    path = tmp_path / "x.safetensors"
    path.write_bytes(safetensors_bytes(header, data))
    assert_refused_or_read(path)


@FUZZ
@given(data=st.data())
def test_fuzz_the_bytes(tmp_path, data):
    """Bytes overwritten anywhere (the length prefix, the header's JSON, the data), or the file cut short."""
    raw = bytearray(safetensors_bytes(valid_header()))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        new = data.draw(st.binary(min_size=1, max_size=4), label="bytes")
        raw[at : at + len(new)] = new
    cut = data.draw(st.none() | st.integers(0, len(raw)), label="cut")
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(raw[:cut]))
    assert_refused_or_read(path)


@FUZZ
@given(length=st.integers(0, 2**64 - 1))
def test_fuzz_the_header_length(tmp_path, length):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", length) + safetensors_bytes(valid_header())[8:])
    assert_refused_or_read(path)


def edited(**changes) -> dict:
    """valid_header() with tensor a's fields changed."""
    header = valid_header()
    header["a"] = header["a"] | changes
    return header


HEADER_FAULTS = {
    "empty": (b"", r"not a safetensors file: 0 bytes, less than its 8-byte header length"),
    "three-bytes": (b"abc", r"not a safetensors file: 3 bytes"),
    "absurd-length": (struct.pack("<Q", 2**63) + b"{}", r"its header length 9223372036854775808 is over safetensors'"),
    "length-past-end": (
        struct.pack("<Q", 1000) + b"{}",
        r"truncated inside its header \(1000 bytes, the file has 10\)",
    ),
    "not-utf8": (safetensors_bytes(b'{"\xff": 1}'), r"not a valid safetensors file: its header is not UTF-8"),
    "not-json": (safetensors_bytes(b"{not json"), r"not a valid safetensors file: its header is not JSON"),
    "nan": (safetensors_bytes(b'{"a": NaN}'), r"its header is not JSON \(NaN is not JSON\)"),
    "nested-deep": (safetensors_bytes(b"[" * 5000 + b"]" * 5000), r"its header nests arrays or objects too deep"),
    "duplicate": (
        safetensors_bytes(json.dumps(valid_header())[:-1].encode() + b', "a": {}}'),
        r"its header has the key 'a' twice",
    ),
    "string": (safetensors_bytes("weights"), r"the header must be a JSON object of tensors .*, got 'weights'"),
    "metadata-list": (safetensors_bytes(valid_header() | {"__metadata__": [1]}), r"__metadata__ must be an object"),
    "metadata-value": (
        safetensors_bytes(valid_header() | {"__metadata__": {"format": 1}}),
        r"__metadata__\['format'\] must be a string, got 1",
    ),
    "entry-list": (safetensors_bytes(valid_header() | {"a": [0, 24]}), r"tensor 'a' must be an object \{dtype, shape"),
    "no-dtype": (safetensors_bytes({"a": {"shape": [2, 3], "data_offsets": [0, 24]}}), r"'a': required field 'dtype'"),
    "dtype-unknown": (safetensors_bytes(edited(dtype="F128")), r"tensor 'a': dtype must be a safetensors dtype \(BOOL"),
    "dtype-lowercase": (safetensors_bytes(edited(dtype="f32")), r"tensor 'a': dtype must be a safetensors dtype"),
    "dtype-number": (safetensors_bytes(edited(dtype=32)), r"tensor 'a': dtype must be a safetensors dtype .*, got 32"),
    "shape-negative": (safetensors_bytes(edited(shape=[-2, 3])), r"'a': shape must be a list of non-negative integers"),
    "shape-float": (safetensors_bytes(edited(shape=[2.0, 3])), r"'a': shape must be a list of non-negative integers"),
    "shape-string": (safetensors_bytes(edited(shape="2x3")), r"'a': shape must be a list of non-negative integers"),
    "shape-huge": (safetensors_bytes(edited(shape=[0, 2**64])), r"'a': shape must be a list of non-negative integers"),
    "begin-after-end": (
        safetensors_bytes(edited(data_offsets=[24, 0])),
        r"tensor 'a': data_offsets must be \[begin, end\] with 0 <= begin <= end, got \[24, 0\]",
    ),
    "begin-negative": (safetensors_bytes(edited(data_offsets=[-8, 24])), r"with 0 <= begin <= end, got \[-8, 24\]"),
    "past-the-end": (
        safetensors_bytes(edited(data_offsets=[0, 10**20])),
        r"truncated: tensor 'a' ends at byte \d+, the file has \d+",
    ),
    "size": (
        safetensors_bytes(edited(shape=[2, 2])),
        r"tensor 'a': data_offsets must span 16 bytes \(shape \[2, 2\] of F32\), got \[0, 24\] \(24 bytes\)",
    ),
    "overlap": (
        safetensors_bytes(edited(shape=[2, 4], data_offsets=[0, 32]) | {"b": valid_header()["b"]}),
        r"tensors 'a' and 'b' overlap \(data_offsets \[0, 32\] and \[24, 32\]\)",
    ),
    "gap": (
        safetensors_bytes({"b": valid_header()["b"]}),
        r"bytes 0\.\.24 of the data section belong to no tensor \(before tensor 'b'\)",
    ),
    "trailing": (
        safetensors_bytes(valid_header(), DATA + b"junk"),
        r"the last 4 bytes of the file belong to no tensor",
    ),
}


@pytest.mark.parametrize("case", list(HEADER_FAULTS))
def test_header_faults_are_named(tmp_path, case):
    raw, message = HEADER_FAULTS[case]
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    with pytest.raises(ModelLoadError, match=message) as error:
        read_safetensors_header(path)
    assert_names(error, f"{path}: ")


def rewrite_model(directory: Path, dtypes: dict[str, tuple[str, np.ndarray]]) -> Path:
    """The directory's model.safetensors written again by hand, the tensors of `dtypes` as (dtype, raw array)."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    header, chunks, offset = {}, [], 0
    for name, tensor in tensors.items():
        dtype, array = dtypes.get(name, ("F32", tensor))
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    path.write_bytes(safetensors_bytes(header, b"".join(chunks)))
    return path


def test_issue_case_a_header_that_is_a_json_list(model_dir):
    path = model_dir / "model.safetensors"
    path.write_bytes(safetensors_bytes([{"dtype": "F32"}], b""))
    with pytest.raises(ModelLoadError) as error:
        load_model(model_dir)
    assert_names(
        error, f"{path}: the header must be a JSON object of tensors ({{name: {{dtype, shape, data_offsets}}}})"
    )


@pytest.mark.parametrize("offsets", [[0], [0, "24"], [0.0, 24], [True, 24], "0:24", [0, 24, 24], None, {"begin": 0}])
def test_issue_case_data_offsets_that_are_not_two_integers(model_dir, offsets):
    path = model_dir / "model.safetensors"
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    header[Q_PROJ]["data_offsets"] = offsets
    path.write_bytes(safetensors_bytes(header, bytes(raw[8 + header_len :])))
    with pytest.raises(ModelLoadError) as error:
        load_model(model_dir)
    assert_names(error, f"{path}: tensor '{Q_PROJ}': data_offsets must be two integers [begin, end], got ")


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "F8_E8M0"])
def test_fp8_weights_are_refused_by_name(model_dir, dtype):
    """numpy has no float8 types: safetensors' reader failed with numpy's "no attribute 'float8_e4m3fn'"."""
    q = load_file(str(model_dir / "model.safetensors"))[Q_PROJ]
    path = rewrite_model(model_dir, {Q_PROJ: (dtype, np.zeros(q.shape, np.uint8))})
    with pytest.raises(ModelLoadError) as error:
        load_model(model_dir)
    assert_names(
        error, f"{path}: tensor '{Q_PROJ}' has dtype {dtype}, which jaxpage does not read: jaxpage reads float"
    )
    assert "(F32, F16, BF16, F64)" in str(error.value) and "pre-quantized (FP8/FP6/FP4)" in str(error.value)


@pytest.mark.parametrize(("dtype", "numpy_dtype"), [("I8", np.int8), ("U8", np.uint8), ("I32", np.int32)])
def test_integer_weights_are_refused_not_cast_to_floats(model_dir, dtype, numpy_dtype):
    """params_from_hf_tensors would cast an int8 weight to floats without a word: a quantized checkpoint's weights
    read as values, its scales ignored."""
    q = load_file(str(model_dir / "model.safetensors"))[Q_PROJ]
    path = rewrite_model(model_dir, {Q_PROJ: (dtype, np.ones(q.shape, numpy_dtype))})
    with pytest.raises(ModelLoadError) as error:
        load_model(model_dir)
    assert_names(error, f"{path}: tensor '{Q_PROJ}' has dtype {dtype}, which jaxpage does not read")
    assert "weights of a quantized checkpoint" in str(error.value)


def write_config(directory: Path, **changes) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return path


W8A8 = {  # what llm-compressor writes for a W8A8 (int8 weights and activations) checkpoint, abridged
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def test_the_int8_tensors_of_a_checkpoint_that_declares_no_quantization_are_refused(model_dir):
    """A W8A8 checkpoint's int8 weights read as floats would give wrong logits: with its quantization_config taken
    away (hf_overrides), the int8 tensor itself is refused; with it, the float weights it says are int8 are named."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    q = tensors[Q_PROJ]
    tensors[Q_PROJ] = np.clip(np.round(q / np.abs(q).max(axis=1, keepdims=True) * 127), -127, 127).astype(np.int8)
    save_file(tensors, str(model_dir / "model.safetensors"))
    write_config(model_dir, quantization_config=W8A8)
    with pytest.raises(ModelLoadError) as error:
        load_model(model_dir, hf_overrides={"quantization_config": None})
    assert_names(error, f"{model_dir / 'model.safetensors'}: tensor '{Q_PROJ}' has dtype I8")
    with pytest.raises(ModelLoadError) as error:
        load_model(model_dir)
    first = "model.layers.0.self_attn.q_proj.weight"
    assert_names(error, f"{model_dir / 'model.safetensors'}: tensor '{first}': the quantized weight has dtype float32")


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        (dict(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}), "'bitsandbytes'"),
        (dict(quantization_config={"bits": 4}), "quantization_config {'bits': 4}"),
        (dict(compression_config={"quant_method": "sparseml"}), "compression_config with quant_method 'sparseml'"),
        (dict(quantization_config={"quant_method": "gptq", "bits": 2}), "quantization_config.bits 2"),
    ],
)
def test_quantization_configs_are_refused(model_dir, changes, what):
    path = write_config(model_dir, **changes)
    with pytest.raises(ModelLoadError) as error:
        read_hf_config(model_dir)
    assert_names(error, f"{path}: ")
    assert what in str(error.value) and "is not supported" in str(error.value)


def test_a_quantization_config_that_is_no_object_is_refused(model_dir):
    path = write_config(model_dir, quantization_config=[1])
    with pytest.raises(ModelLoadError, match=r"quantization_config must be an object, got \[1\]"):
        read_hf_config(model_dir)
    assert path.is_file()


# ----- config.json -----

CONFIG_FIELDS = [
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "hidden_act", "hidden_activation", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "qkv_bias", "eos_token_id", "bos_token_id", "sliding_window", "use_sliding_window", "layer_types",
    "sliding_window_pattern", "torch_dtype", "dtype", "quantization_config", "num_experts", "num_local_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "partial_rotary_factor", "original_max_position_embeddings",
    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq",
    "use_bidirectional_attention",
]  # fmt: skip
ROPE_KEYS = [
    "rope_type", "type", "factor", "rope_theta", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings", "short_factor", "long_factor", "attention_factor", "partial_rotary_factor",
    "full_attention", "sliding_attention",
]  # fmt: skip
ROPE_VALUES = JSON | st.sampled_from(["default", "linear", "llama3", "longrope", "su", "yarn"])
CONFIG_VALUES = (
    JSON
    | st.dictionaries(
        st.sampled_from(ROPE_KEYS), ROPE_VALUES | st.dictionaries(st.sampled_from(ROPE_KEYS), ROPE_VALUES)
    )
    | st.lists(st.sampled_from(["full_attention", "sliding_attention", 1, None, ["x"]]), max_size=4)
    | st.lists(st.integers(-2, 2**40), max_size=3)
    | st.sampled_from([*SUPPORTED_ARCHITECTURES, "gpt2", "silu", "gelu_pytorch_tanh"])
)
# The tiny Llama's config.json with each family's required fields: any supported model_type is a valid config.
MOE_FIELDS = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@FUZZ
@given(
    arch=st.sampled_from(SUPPORTED_ARCHITECTURES),
    changes=st.dictionaries(st.sampled_from(CONFIG_FIELDS), CONFIG_VALUES, min_size=1, max_size=3),
)
def test_fuzz_config_json(tmp_path, arch, changes):
    config = tiny_config(FAMILY) | MOE_FIELDS | {"model_type": arch} | changes
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    try:
        assert isinstance(read_hf_config(tmp_path), ModelConfig)
    except ModelLoadError as e:
        assert str(e).startswith(f"{path}: "), str(e)
        assert "inconsistent model config" not in str(e), str(e)  # the catch-all: each field is named instead


BAD_CONFIG_FIELDS = [
    (dict(eos_token_id="2"), "eos_token_id must be a token id (an integer in [0, 2147483647]), got '2'"),
    (dict(eos_token_id=2.0), "eos_token_id must be a token id (an integer in [0, 2147483647]), got 2.0"),
    (dict(eos_token_id=[2, "x"]), "eos_token_id[1] must be a token id (an integer in [0, 2147483647]), got 'x'"),
    (dict(eos_token_id=float("inf")), "eos_token_id must be a token id (an integer in [0, 2147483647]), got inf"),
    (dict(eos_token_id={"id": 2}), "eos_token_id must be a token id (an integer in [0, 2147483647]), got {'id': 2}"),
    (dict(eos_token_id=-1), "eos_token_id must be a token id (an integer in [0, 2147483647]), got -1"),
    (dict(bos_token_id=[1]), "bos_token_id must be a token id (an integer in [0, 2147483647]), got [1]"),
    (dict(bos_token_id=2**40), "bos_token_id must be a token id (an integer in [0, 2147483647]), got 1099511627776"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(attention_bias=1), "attention_bias must be true or false, got 1"),
    (dict(mlp_bias=[]), "mlp_bias must be true or false, got []"),
    (dict(use_sliding_window="no"), "use_sliding_window must be true or false, got 'no'"),
    (dict(model_type=["llama"]), "model_type ['llama'] is not supported"),
    (dict(rope_scaling={"rope_type": ["linear"]}), "RoPE type ['linear'] is not supported"),
    (dict(model_type="gemma2", layer_types=[[1]] * 3), "layer_types must be a list of 3 of 'full_attention', "),
    (dict(model_type="qwen2_moe", qkv_bias="yes", **MOE_FIELDS), "qkv_bias must be true or false, got 'yes'"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_CONFIG_FIELDS, ids=[m.split(" ")[0] for _, m in BAD_CONFIG_FIELDS])
def test_hostile_config_fields_are_named(model_dir, changes, message):
    path = write_config(model_dir, **changes)
    with pytest.raises(ModelLoadError) as error:
        read_hf_config(model_dir)
    assert_names(error, f"{path}: {message}")


def test_a_config_of_valid_flags_and_token_ids_is_read(model_dir):
    write_config(model_dir, eos_token_id=[2, 7], bos_token_id=1, tie_word_embeddings=None, attention_bias=None)
    config = read_hf_config(model_dir)
    assert (config.eos_token_ids, config.bos_token_id, config.tie_word_embeddings) == ((2, 7), 1, False)


# ----- adapter_config.json and adapter_model.safetensors -----

ADAPTER_SETTINGS = {
    "peft_type": "LORA",
    "r": 2,
    "lora_alpha": 4,
    "target_modules": ["q_proj", "v_proj"],
    "bias": "none",
}


def write_adapter(directory: Path, tensors: dict | None = None, **settings) -> Path:
    """A LoRA adapter of the tiny Llama as PEFT saves one, written by hand: q_proj and v_proj of its 3 layers, r 2."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(ADAPTER_SETTINGS | settings))
    if tensors is None:
        rng = np.random.default_rng(0)
        tensors = {}
        for layer in range(3):
            for module, out in (("q_proj", 64), ("v_proj", 64)):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((2, 64)).astype(np.float32)
                tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((out, 2)).astype(np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def base_config(tiny_model_path) -> ModelConfig:
    return read_hf_config(tiny_model_path(FAMILY))


def test_the_hand_written_adapter_is_read(tmp_path, base_config):
    adapter = read_lora_adapter(write_adapter(tmp_path / "adapter"), base_config)
    assert (adapter.rank, adapter.scaling, sorted(adapter.weights)) == (2, 2.0, ["q_proj", "v_proj"])


ADAPTER_FIELDS = [
    "peft_type", "r", "lora_alpha", "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
    "use_rslora", "bias", "use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out",
    "lora_bias", "layer_replication", "target_parameters", "trainable_token_indices", "task_type",
]  # fmt: skip
ADAPTER_VALUES = (
    JSON
    | st.sampled_from(["LORA", "all-linear", ".*", "(", "a{99999999999}", "(" * 3000 + ")" * 3000, r".*\.q_proj"])
    | st.lists(st.sampled_from(["q_proj", "v_proj", "lm_head", "", 1, None]), max_size=3)
    | st.lists(st.integers(-1, 4), max_size=3)
    | st.integers(-2, 2**70)
)


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(ADAPTER_FIELDS), ADAPTER_VALUES, min_size=1, max_size=3))
def test_fuzz_adapter_config_json(tmp_path, base_config, changes):
    directory = tmp_path / "adapter"
    if not directory.exists():
        write_adapter(directory)
    (directory / "adapter_config.json").write_text(json.dumps(ADAPTER_SETTINGS | changes))
    try:
        assert isinstance(read_lora_adapter(directory, base_config), LoRAAdapter)
    except ModelLoadError as e:
        assert str(e).startswith(f"LoRA adapter 'adapter' ({directory}): "), str(e)


@FUZZ
@given(data=st.data())
def test_fuzz_adapter_model_safetensors(tmp_path, base_config, data):
    directory = write_adapter(tmp_path / "adapter")
    path = directory / "adapter_model.safetensors"
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    at = data.draw(st.integers(0, 8 + header_len + 16), label="at")  # the header mostly, and some of the data
    new = data.draw(st.binary(min_size=1, max_size=4), label="bytes")
    raw[at : at + len(new)] = new
    path.write_bytes(bytes(raw))
    try:
        read_lora_adapter(directory, base_config)
    except ModelLoadError as e:
        assert str(e).startswith(f"LoRA adapter 'adapter' ({directory}): "), str(e)


def test_an_adapter_of_int8_tensors_is_refused_by_name(tmp_path, base_config):
    tensors = {
        f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_{factor}.weight": np.ones(shape, np.int8)
        for layer in range(3)
        for factor, shape in (("A", (2, 64)), ("B", (64, 2)))
    }
    directory = write_adapter(tmp_path / "adapter", tensors, target_modules=["q_proj"])
    with pytest.raises(ModelLoadError) as error:
        read_lora_adapter(directory, base_config)
    assert_names(error, f"LoRA adapter 'adapter' ({directory}): {directory / 'adapter_model.safetensors'}: tensor ")
    assert "has dtype I8, which jaxpage does not read" in str(error.value)


def test_an_adapter_header_that_is_a_json_list_is_refused(tmp_path, base_config):
    """The server's /v1/load_lora_adapter answered 500 on it (an AttributeError out of the loader)."""
    directory = write_adapter(tmp_path / "adapter")
    (directory / "adapter_model.safetensors").write_bytes(safetensors_bytes([1, 2], b""))
    with pytest.raises(ModelLoadError, match=r"the header must be a JSON object of tensors") as error:
        read_lora_adapter(directory, base_config)
    assert_names(error, f"LoRA adapter 'adapter' ({directory}): {directory / 'adapter_model.safetensors'}: ")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(r=10**30), "r must be at most 2147483647, got 1000000000000000000000000000000"),
        (dict(r=2**31 - 1), "tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape"),
        (dict(lora_alpha=10**400), "lora_alpha must be a number, got 1000000000"),
        (dict(lora_alpha=float("nan")), "lora_alpha must be a number, got nan"),
        (dict(use_rslora="true"), "use_rslora must be true or false, got 'true'"),
        (dict(exclude_modules=5), "exclude_modules must be a list of module names or a regular expression, got 5"),
        (dict(target_modules="a{99999999999}"), "target_modules or exclude_modules is not a valid regular expression"),
        (dict(target_modules="(" * 3000 + ")" * 3000), "target_modules or exclude_modules is not a valid regular"),
        (dict(bias=["all"]), "bias ['all']: trained biases are not supported"),
    ],
)
def test_hostile_adapter_fields_are_named(tmp_path, base_config, changes, message):
    directory = write_adapter(tmp_path / "adapter", **changes)
    with pytest.raises(ModelLoadError) as error:
        read_lora_adapter(directory, base_config)
    assert_names(error, f"LoRA adapter 'adapter' ({directory}): {message}")


def test_deeply_nested_adapter_config_is_refused(tmp_path, base_config):
    directory = write_adapter(tmp_path / "adapter")
    (directory / "adapter_config.json").write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ModelLoadError, match=r"adapter_config.json is not readable JSON \(RecursionError") as error:
        read_lora_adapter(directory, base_config)
    assert_names(error, f"LoRA adapter 'adapter' ({directory}): ")


# ----- tokenizer_config.json -----


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny word-level tokenizer saved by transformers: tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "hello": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = tmp_path_factory.mktemp("tokenizer")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(directory))
    return directory


TOKENIZER_FIELDS = [
    "model_max_length", "added_tokens_decoder", "chat_template", "eos_token", "bos_token", "unk_token", "pad_token",
    "tokenizer_class", "additional_special_tokens", "extra_special_tokens", "padding_side", "truncation_side",
    "clean_up_tokenization_spaces", "auto_map", "model_input_names", "add_bos_token",
]  # fmt: skip
TOKENIZER_VALUES = (
    JSON
    | st.dictionaries(st.sampled_from(["0", "1", "7", "x"]), JSON | st.fixed_dictionaries({"content": JSON}))
    | st.fixed_dictionaries({"content": JSON, "special": JSON})
    | st.sampled_from(["<s>", "</s>", "left", "PreTrainedTokenizerFast", "LlamaTokenizer", "NoSuchTokenizer"])
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(TOKENIZER_FIELDS), TOKENIZER_VALUES, min_size=1, max_size=2))
def test_fuzz_tokenizer_config_json(tokenizer_dir, tmp_path, changes):
    directory = tmp_path / "tokenizer"
    if not directory.exists():
        shutil.copytree(tokenizer_dir, directory)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | changes))
    try:
        load_tokenizer(str(directory))
    except ModelLoadError as e:
        assert str(e).startswith(f"{directory}: cannot load a tokenizer ("), str(e)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        (dict(added_tokens_decoder={"abc": {"content": "a"}}), "ValueError: "),
        (dict(added_tokens_decoder=[1, 2]), "AttributeError: "),
        (dict(eos_token={"junk": 1}), "TypeError: "),
        (dict(tokenizer_class=5), "AttributeError: "),
        # These load, then every encode (or chat) would fail: refused at load too.
        (dict(model_max_length="x"), "it cannot encode text: TypeError: "),
        (dict(chat_template=5), "chat_template must be a Jinja template, got 5"),
    ],
)
def test_hostile_tokenizer_config_is_named(tokenizer_dir, tmp_path, changes, problem):
    directory = Path(shutil.copytree(tokenizer_dir, tmp_path / "tokenizer"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | changes))
    with pytest.raises(ModelLoadError) as error:
        load_tokenizer(str(directory))
    assert_names(error, f"{directory}: cannot load a tokenizer ({problem}")


# ----- GGUF metadata -----

GGUF_METADATA = {  # a tiny Llama's (keys after the architecture's name), as (value type, value)
    "block_count": (V.UINT32, 1),
    "context_length": (V.UINT32, 64),
    "embedding_length": (V.UINT32, 8),
    "feed_forward_length": (V.UINT32, 16),
    "attention.head_count": (V.UINT32, 2),
    "attention.layer_norm_rms_epsilon": (V.FLOAT32, 1e-5),
    "vocab_size": (V.UINT32, 4),
}
GGUF_KEYS = [
    *GGUF_METADATA, "attention.head_count_kv", "attention.key_length", "rope.freq_base", "rope.scaling.type",
    "rope.scaling.factor", "rope.dimension_count", "attention.sliding_window", "attention.sliding_window_pattern",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
    "expert_weights_norm", "attn_logit_softcapping", "final_logit_softcapping",
    "rope.scaling.original_context_length", "rope.scaling.attn_factor",
]  # fmt: skip
GLOBAL_GGUF_KEYS = [
    "general.architecture", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.tokens",
]  # fmt: skip
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)  # what UTF-8 can hold
SCALAR_VALUES = (
    st.tuples(st.just(V.UINT32), st.integers(0, 2**32 - 1))
    | st.tuples(st.just(V.INT32), st.integers(-(2**31), 2**31 - 1))
    | st.tuples(st.just(V.UINT64), st.integers(0, 2**64 - 1))
    | st.tuples(st.just(V.INT64), st.integers(-(2**63), 2**63 - 1))
    | st.tuples(st.just(V.FLOAT32), st.floats(width=32))
    | st.tuples(st.just(V.FLOAT64), st.floats())
    | st.tuples(st.just(V.BOOL), st.booleans())
    | st.tuples(st.just(V.STRING), TEXT | st.sampled_from([*GGUF_ARCHITECTURES, "linear", "yarn", "none"]))
)
GGUF_VALUES = (
    SCALAR_VALUES
    | st.tuples(st.just(V.ARRAY), st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4), st.just(V.UINT32))
    | st.tuples(st.just(V.ARRAY), st.lists(st.booleans(), min_size=1, max_size=4), st.just(V.BOOL))
    | st.tuples(st.just(V.ARRAY), st.lists(st.floats(width=32), min_size=1, max_size=4), st.just(V.FLOAT32))
    | st.tuples(st.just(V.ARRAY), st.lists(TEXT, min_size=1, max_size=4), st.just(V.STRING))
    | st.tuples(st.just(V.ARRAY), st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=2), min_size=1, max_size=2))
)


def write_gguf(path: Path, arch: str, metadata: dict) -> Path:
    """A GGUF file of `arch` with `metadata` (full keys -> (value type, value[, item type])) and one tensor."""
    writer = gguf.GGUFWriter(str(path), arch=None)
    for key, (value_type, value, *item_type) in ({"general.architecture": (V.STRING, arch)} | metadata).items():
        writer.add_key_value(key, value, value_type, *item_type)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@FUZZ
@given(
    arch=st.sampled_from(list(GGUF_ARCHITECTURES)),
    changes=st.dictionaries(st.sampled_from(GGUF_KEYS), GGUF_VALUES, min_size=1, max_size=3),
    global_changes=st.dictionaries(st.sampled_from(GLOBAL_GGUF_KEYS), GGUF_VALUES, max_size=1),
)
def test_fuzz_gguf_metadata(tmp_path, arch, changes, global_changes):
    metadata = {f"{arch}.{key}": value for key, value in (GGUF_METADATA | changes).items()} | global_changes
    path = write_gguf(tmp_path / "m.gguf", arch, metadata)
    with pytest.raises(ModelLoadError) as error:  # it holds no layers: refused at the latest for a missing tensor
        load_model(path)
    assert_names(error, f"{path}: ")


GGUF_TOKENIZER = {
    "tokenizer.ggml.model": (V.STRING, "gpt2"),
    "tokenizer.ggml.tokens": (V.ARRAY, ["a", "b", "ab", "<eos>"], V.STRING),
    "tokenizer.ggml.token_type": (V.ARRAY, [1, 1, 1, 3], V.INT32),
    "tokenizer.ggml.merges": (V.ARRAY, ["a b"], V.STRING),
    "tokenizer.ggml.eos_token_id": (V.UINT32, 3),
}
GGUF_TOKENIZER_KEYS = [
    *GGUF_TOKENIZER, "tokenizer.ggml.pre", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
]  # fmt: skip


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(GGUF_TOKENIZER_KEYS), GGUF_VALUES, min_size=1, max_size=2))
def test_fuzz_gguf_tokenizer_metadata(tmp_path, monkeypatch, changes):
    monkeypatch.setenv("JAXPAGE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", "llama", GGUF_TOKENIZER | changes)
    try:
        load_tokenizer(path)
    except ModelLoadError as e:
        assert str(e).startswith(f"{path}: "), str(e)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_bytes(tmp_path, data):
    """Bytes of the header, metadata and tensor infos overwritten."""
    intact = tmp_path / "intact.gguf"
    if not intact.exists():
        write_gguf(intact, "llama", {f"llama.{key}": value for key, value in GGUF_METADATA.items()})
    raw = bytearray(intact.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 4 * 8 * 4 - 1), label="at")  # not in the tensor's data
    new = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
    raw[at : at + len(new)] = new
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError) as error:
        load_model(path)
    assert_names(error, f"{path}: ")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("general.architecture", (V.ARRAY, ["llama"], V.STRING), "GGUF architecture ['llama'] is not supported"),
        ("llama.rope.scaling.type", (V.ARRAY, [1, 2], V.UINT32), "metadata llama.rope.scaling.type must be a string"),
        ("tokenizer.ggml.eos_token_id", (V.FLOAT32, float("nan")), "metadata tokenizer.ggml.eos_token_id must be a"),
        ("tokenizer.ggml.eos_token_id", (V.FLOAT64, float("inf")), "metadata tokenizer.ggml.eos_token_id must be a"),
        ("tokenizer.ggml.bos_token_id", (V.INT32, -1), "metadata tokenizer.ggml.bos_token_id must be a token id"),
        ("llama.vocab_size", (V.ARRAY, [4], V.UINT32), "metadata llama.vocab_size is array([4], dtype=uint32), not a"),
        ("llama.block_count", (V.STRING, "x" * 500), "metadata llama.block_count is 'xxxxxx"),
    ],
)
def test_hostile_gguf_metadata_is_named(tmp_path, key, value, message):
    metadata = {f"llama.{k}": v for k, v in GGUF_METADATA.items()} | {key: value}
    path = write_gguf(tmp_path / "m.gguf", "llama", metadata)
    with pytest.raises(ModelLoadError) as error:
        load_model(path)
    assert_names(error, f"{path}: {message}")
    assert len(str(error.value)) < 400  # a long value is quoted cut short


def test_gguf_token_list_that_is_no_list(tmp_path):
    metadata = {f"llama.{k}": v for k, v in GGUF_METADATA.items() if k != "vocab_size"}
    path = write_gguf(tmp_path / "m.gguf", "llama", metadata | {"tokenizer.ggml.tokens": (V.UINT32, 4)})
    with pytest.raises(ModelLoadError) as error:
        load_model(path)
    assert_names(error, f"{path}: metadata tokenizer.ggml.tokens must be an array of strings, got 4")


def test_gguf_sliding_window_pattern_of_bools_gives_layer_types(tmp_path):
    """llama.cpp's per-layer pattern (True: a sliding layer) is an array of bools, which the reader returns as a numpy
    array; any other array is refused by name."""
    metadata = {f"gemma3.{k}": v for k, v in GGUF_METADATA.items()} | {
        "gemma3.block_count": (V.UINT32, 3),
        "gemma3.attention.sliding_window": (V.UINT32, 4),
        "gemma3.attention.sliding_window_pattern": (V.ARRAY, [True, True, False], V.BOOL),
    }
    path = write_gguf(tmp_path / "m.gguf", "gemma3", metadata)
    config = config_from_gguf(read_gguf(path), path)
    assert config.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    metadata["gemma3.attention.sliding_window_pattern"] = (V.ARRAY, [1, 1, 0], V.UINT32)
    path = write_gguf(tmp_path / "m.gguf", "gemma3", metadata)
    with pytest.raises(ModelLoadError) as error:
        config_from_gguf(read_gguf(path), path)
    assert_names(error, f"{path}: metadata gemma3.attention.sliding_window_pattern must be a period or an array of ")
