"""jaxpage.models.bert against Hugging Face transformers: tiny random BERT and XLM-RoBERTa models (base and sequence
classification), sequences of several lengths packed into one token axis, each compared with transformers' run of
that sequence alone."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpage.errors import ModelLoadError
from jaxpage.models.attention import PackedBatch
from jaxpage.models.bert import (
    Encoder,
    encoder_config_from_hf,
    init_encoder_params,
    is_encoder_architecture,
    load_encoder_params,
    read_encoder_config,
)

TINY = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
)
LENGTHS = (1, 5, 17)
# (transformers class, config class, extra config): every model the loader knows, with or without a head
MODELS = {
    "bert": ("BertModel", "BertConfig", {}),
    "xlm-roberta": ("XLMRobertaModel", "XLMRobertaConfig", {"pad_token_id": 1}),
    "bert-3-labels": ("BertForSequenceClassification", "BertConfig", {"num_labels": 3}),
    "bert-regression": ("BertForSequenceClassification", "BertConfig", {"num_labels": 1}),
    "xlm-roberta-3-labels": ("XLMRobertaForSequenceClassification", "XLMRobertaConfig", {"num_labels": 3}),
    "xlm-roberta-regression": ("XLMRobertaForSequenceClassification", "XLMRobertaConfig", {"num_labels": 1}),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (transformers model, the directory it is saved in), each built once, every weight random (LayerNorms
    included: a wrong scale or bias would not hide behind ones and zeros)."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    models = {}
    for name, (model_class, config_class, extra) in MODELS.items():
        config = getattr(transformers, config_class)(**TINY, **extra)
        model = getattr(transformers, model_class)(config).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.3)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory, safe_serialization=True)
        models[name] = (model, directory)
    return models


def sequences(seed: int, lengths=LENGTHS) -> list[np.ndarray]:
    """Random token ids, none of them a special token (XLM-RoBERTa's positions skip its padding id 1)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, TINY["vocab_size"], size=n, dtype=np.int32) for n in lengths]


def pack(seqs: list[np.ndarray], padding: int, token_types: list[np.ndarray] | None = None):
    """(token_ids, positions, segment_ids, token_type_ids, first_token_index) of `seqs` end to end, then `padding`
    tokens of segment -1 (arbitrary ids and positions: the model must ignore them)."""
    token_ids = np.concatenate([*seqs, np.full(padding, 7, np.int32)])
    positions = np.concatenate([np.arange(len(s), dtype=np.int32) for s in seqs] + [np.full(padding, 999, np.int32)])
    segments = np.concatenate([np.full(len(s), i, np.int32) for i, s in enumerate(seqs)] + [np.full(padding, -1)])
    types = np.zeros_like(token_ids) if token_types is None else np.concatenate([*token_types, np.zeros(padding)])
    first = np.cumsum([0] + [len(s) for s in seqs[:-1]]).astype(np.int32)
    return token_ids, positions, segments.astype(np.int32), types.astype(np.int32), first


def run_packed(directory, seqs, padding=3, token_types=None):
    """Each sequence's hidden states [n, D] and, with a head, logits [num_labels], from one packed forward."""
    config = read_encoder_config(directory)
    params = load_encoder_params(directory, config, np.float32)
    token_ids, positions, segments, types, first = pack(seqs, padding, token_types)
    hidden, logits = _forward(config, params, token_ids, positions, segments, types, first)
    bounds = np.cumsum([0] + [len(s) for s in seqs])
    hidden = [np.asarray(hidden[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return hidden, None if logits is None else np.asarray(logits)


@functools.partial(jax.jit, static_argnums=0)
def _forward(config, params, token_ids, positions, segment_ids, token_type_ids, first_token_index):
    model = Encoder(config, jnp.float32)
    batch = PackedBatch(positions=positions, segment_ids=segment_ids)
    hidden = model.apply({"params": params}, token_ids, positions, batch, token_type_ids)
    if config.head_kind is None:
        return hidden, None
    return hidden, model.apply({"params": params}, hidden, first_token_index, method=Encoder.classify)


def hf_run(model, seq, token_types=None):
    """transformers' output of one sequence alone: (last_hidden_state [n, D], logits [num_labels] or None)."""
    import torch

    kwargs = {} if token_types is None else {"token_type_ids": torch.tensor(token_types[None], dtype=torch.long)}
    with torch.no_grad():
        out = model(torch.tensor(seq[None], dtype=torch.long), output_hidden_states=True, **kwargs)
    logits = out.logits[0].numpy() if hasattr(out, "logits") else None
    return out.hidden_states[-1][0].numpy(), logits


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_sequences_match_transformers(hf_models, name):
    model, directory = hf_models[name]
    seqs = sequences(seed=1)
    hidden, logits = run_packed(directory, seqs)
    for i, seq in enumerate(seqs):
        want_hidden, want_logits = hf_run(model, seq)
        np.testing.assert_allclose(hidden[i], want_hidden, atol=1e-5, rtol=0, err_msg=f"sequence {i}")
        if want_logits is not None:
            np.testing.assert_allclose(logits[i], want_logits, atol=1e-5, rtol=0, err_msg=f"sequence {i}")
    assert (logits is None) == (name in ("bert", "xlm-roberta"))


def test_token_types_match_transformers(hf_models):
    """A BERT cross-encoder's pair: the second text's tokens of type 1."""
    model, directory = hf_models["bert-3-labels"]
    seqs = sequences(seed=2, lengths=(9, 4))
    types = [(np.arange(len(s)) >= len(s) // 2).astype(np.int32) for s in seqs]
    hidden, logits = run_packed(directory, seqs, token_types=types)
    for i, (seq, seq_types) in enumerate(zip(seqs, types, strict=True)):
        want_hidden, want_logits = hf_run(model, seq, seq_types)
        np.testing.assert_allclose(hidden[i], want_hidden, atol=1e-5, rtol=0)
        np.testing.assert_allclose(logits[i], want_logits, atol=1e-5, rtol=0)


def test_padding_and_order_do_not_change_results(hf_models):
    _, directory = hf_models["xlm-roberta-3-labels"]
    seqs = sequences(seed=3)
    hidden, logits = run_packed(directory, seqs, padding=0)
    order = [2, 0, 1]
    for padding in (1, 11):
        other_hidden, other_logits = run_packed(directory, [seqs[i] for i in order], padding=padding)
        for j, i in enumerate(order):
            np.testing.assert_allclose(other_hidden[j], hidden[i], atol=1e-6, rtol=0)
            np.testing.assert_allclose(other_logits[j], logits[i], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["bert", "xlm-roberta-3-labels"])
def test_loaded_tree_is_the_initialized_tree(hf_models, name):
    """Same paths, shapes and dtypes (the layout of the module docstring) from the checkpoint and from Flax's init."""
    directory = hf_models[name][1]
    config = read_encoder_config(directory)
    loaded = load_encoder_params(directory, config, np.float32)
    initialized = jax.eval_shape(functools.partial(init_encoder_params, config, jax.random.key(0)))
    shapes = jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), loaded)
    assert shapes == jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), initialized)
    assert loaded["layers"]["q_proj"]["kernel"].shape == (2, 32, 4, 8)


def test_config_fields(hf_models):
    bert = read_encoder_config(hf_models["bert-3-labels"][1])
    assert (bert.architecture, bert.head_kind, bert.num_labels, bert.position_offset) == ("bert", "bert", 3, 0)
    assert bert.id2label == ("LABEL_0", "LABEL_1", "LABEL_2") and bert.head_dim == 8
    xlmr = read_encoder_config(hf_models["xlm-roberta"][1])
    assert (xlmr.architecture, xlmr.head_kind, xlmr.num_labels, xlmr.position_offset) == ("xlm-roberta", None, 0, 2)
    assert xlmr.max_sequence_length == 62


def _hf_config(hf_models, name="bert") -> dict:
    return json.loads((hf_models[name][1] / "config.json").read_text())


@pytest.mark.parametrize(
    "field, value",
    [
        ("position_embedding_type", "relative_key"),
        ("hidden_act", "swish"),
        ("is_decoder", True),
        ("add_cross_attention", True),
        ("model_type", "gpt2"),
        ("architectures", ["BertForMaskedLM"]),
        ("problem_type", "ranking"),
        ("num_attention_heads", 5),
    ],
)
def test_refusals_name_the_field(hf_models, field, value):
    with pytest.raises(ModelLoadError, match=f"my/config.json: {field} "):
        encoder_config_from_hf(_hf_config(hf_models) | {field: value}, "my/config.json")


def test_roberta_model_type_reads_as_xlm_roberta(hf_models):
    hf = _hf_config(hf_models, "xlm-roberta") | {"model_type": "roberta", "architectures": ["RobertaModel"]}
    assert encoder_config_from_hf(hf, "x").architecture == "xlm-roberta"
    with pytest.raises(ModelLoadError, match="architectures"):
        encoder_config_from_hf(hf | {"architectures": ["BertModel"]}, "x")


def test_is_encoder_architecture(hf_models):
    assert is_encoder_architecture(_hf_config(hf_models, "bert-3-labels"))
    assert is_encoder_architecture({"model_type": "xlm-roberta"})
    assert not is_encoder_architecture({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert not is_encoder_architecture({"model_type": ["unhashable"]})


def test_missing_files_and_tensors(hf_models, tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        read_encoder_config(tmp_path)
    directory = hf_models["bert-3-labels"][1]
    config = read_encoder_config(directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["bert.encoder.layer.1.output.LayerNorm.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor 'bert.encoder.layer.1.output.LayerNorm.bias'"):
        load_encoder_params(tmp_path, config, np.float32)


def test_bare_names_and_old_layer_norm_names_load(hf_models, tmp_path):
    """A classifier saved without the `bert.` prefix, with LayerNorm's old gamma / beta names, loads the same tree."""
    directory = hf_models["bert-3-labels"][1]
    config = read_encoder_config(directory)
    tensors = load_file(directory / "model.safetensors")
    renamed = {
        name.removeprefix("bert.")
        .replace("LayerNorm.weight", "LayerNorm.gamma")
        .replace("LayerNorm.bias", "LayerNorm.beta"): t
        for name, t in tensors.items()
    }
    save_file(renamed, tmp_path / "model.safetensors")
    want = load_encoder_params(directory, config, np.float32)
    got = load_encoder_params(tmp_path, config, np.float32)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_sharded_checkpoint_loads(hf_models, tmp_path):
    model, directory = hf_models["xlm-roberta-regression"]
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    config = read_encoder_config(directory)
    want = load_encoder_params(directory, config, np.float32)
    jax.tree.map(np.testing.assert_array_equal, load_encoder_params(tmp_path, config, np.float32), want)
