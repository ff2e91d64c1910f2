"""A vLLM user's model flags beside the Hub's: --tokenizer, --chat-template, --hf-overrides, --trust-remote-code
(refused), several --served-model-name, and `jaxpage serve MODEL`."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
from tiny_models import TINY_FAMILIES

from jaxpage.config import EngineConfig
from jaxpage.engine.llm_engine import engine_tokenizer
from jaxpage.entrypoints.cli import _parser, main
from jaxpage.entrypoints.served_models import ModelNotFound, ServedModels
from jaxpage.errors import ModelLoadError
from jaxpage.models import load_model
from jaxpage.models.orbax_checkpoint import save_checkpoint
from jaxpage.tokenizers.chat_template import read_chat_template
from jaxpage.tokenizers.tokenizer import load_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def test_trust_remote_code_is_refused_by_name():
    with pytest.raises(ValueError, match="trust_remote_code: jaxpage runs no code from a model repo"):
        EngineConfig(trust_remote_code=True)
    with pytest.raises(TypeError, match="trust_remote_code must be True or False"):
        EngineConfig(trust_remote_code="yes")


def test_hf_overrides_set_config_fields(tiny_model_path, tmp_path):
    directory = tiny_model_path(TINY_FAMILIES[0])
    config = EngineConfig(model=str(directory), hf_overrides='{"max_position_embeddings": 64}')  # the CLI's JSON
    assert config.hf_overrides == {"max_position_embeddings": 64}
    loaded, params = load_model(directory, hf_overrides=config.hf_overrides)
    assert loaded.max_position_embeddings == 64
    with pytest.raises(ModelLoadError, match=r"config.json with hf_overrides \['num_attention_heads'\]: .*positive"):
        load_model(directory, hf_overrides={"num_attention_heads": 0})
    save_checkpoint(tmp_path / "ckpt", loaded, params)
    with pytest.raises(ModelLoadError, match="a jaxpage checkpoint's config is fixed"):
        load_model(tmp_path / "ckpt", hf_overrides={"max_position_embeddings": 32})
    with pytest.raises(TypeError, match="hf_overrides must be a JSON object"):
        EngineConfig(hf_overrides="[1]")


def test_chat_template_from_a_file_or_the_text_itself(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE.replace("\n", "\\n")) == TEMPLATE  # a shell's escaped newline, as vLLM reads it
    with pytest.raises(ValueError, match="chat_template 'no/such.jinja' is no readable file"):
        read_chat_template("no/such.jinja")
    with pytest.raises(ValueError, match="chat_template is no Jinja template: line 1"):
        read_chat_template("{% for m in messages %}")


def test_tokenizer_flag_and_chat_template_reach_the_engine_s_tokenizer(tiny_model_path, full_vocab_dir, tmp_path):
    # A model directory without a tokenizer, and a tokenizer's own directory (no config.json) named by --tokenizer.
    tokenizer_dir = tmp_path / "tokenizer"
    load_tokenizer(full_vocab_dir).save_pretrained(str(tokenizer_dir))
    (tokenizer_dir / "config.json").unlink(missing_ok=True)
    model = tiny_model_path(TINY_FAMILIES[0])
    config = EngineConfig(model=str(model), tokenizer=str(tokenizer_dir), chat_template=TEMPLATE)
    tokenizer = engine_tokenizer(config)
    assert tokenizer.chat_template == TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<user>hi\n<assistant>"
    with pytest.raises(ModelLoadError, match="revision 'v1'"):  # a local tokenizer has no revisions
        engine_tokenizer(EngineConfig(model=str(model), tokenizer=str(tokenizer_dir), tokenizer_revision="v1"))


def test_a_tokenizer_directory_is_not_a_model(full_vocab_dir, tmp_path):
    shutil.copytree(full_vocab_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    assert load_tokenizer(tmp_path / "m").vocab_size == 49152


def test_several_served_model_names():
    engine = SimpleNamespace(input_processor=SimpleNamespace(lora_adapters=SimpleNamespace(enabled=False)))
    served = ServedModels(["main", "alias"], engine)
    assert served.lora_request("alias") is None and served.lora_request("main") is None
    assert (served.name_of(None, "alias"), served.name_of(None, None), served.name_of(None, "x")) == (
        "alias",
        "main",
        "main",
    )
    assert [card["id"] for card in served.cards(128)] == ["main", "alias"]
    with pytest.raises(ModelNotFound, match="this server has 'main', 'alias'"):
        served.lora_request("other")
    args = _parser().parse_args(["serve", "org/name", "--served-model-name", "a", "b"])
    assert (args.model_tag, args.served_model_name) == ("org/name", ["a", "b"])


def test_serve_takes_the_model_once(capsys):
    assert main(["serve", "org/a", "--model", "org/b"]) == 2
    assert "the model is given twice: org/a and --model org/b" in capsys.readouterr().err
