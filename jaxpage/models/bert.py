"""BERT and XLM-RoBERTa (encoder-only transformers) over packed sequences as a functional Flax model, with their
Hugging Face config and safetensors loading.

`Encoder(config).apply({"params": params}, token_ids, positions, batch)` gives the last layer's hidden states of
sequences laid end to end in one [tokens] axis (jaxpage.models.attention.PackedBatch), each token attending to every
token of its own sequence; `Encoder.classify` applies a *ForSequenceClassification head to each sequence's first
token. The layers are post-LN and scanned (`nn.scan`): every layer parameter has a leading `num_layers` axis.

Parameter tree (D = hidden_size, H = num_heads, d = head_dim, F = intermediate_size, L = num_layers,
V = vocab_size, P = max_position_embeddings, Y = type_vocab_size, N = num_labels); `head` only with a head_kind:

    word_embeddings/embedding           [V, D]
    position_embeddings/embedding       [P, D]
    token_type_embeddings/embedding     [Y, D]
    embedding_norm/{scale,bias}         [D]
    layers/{q,k,v}_proj/kernel          [L, D, H, d]   bias [L, H, d]
    layers/o_proj/kernel                [L, H, d, D]   bias [L, D]
    layers/attn_norm/{scale,bias}       [L, D]
    layers/up_proj/kernel               [L, D, F]      bias [L, F]
    layers/down_proj/kernel             [L, F, D]      bias [L, D]
    layers/mlp_norm/{scale,bias}        [L, D]
    head/dense/kernel                   [D, D]         bias [D]   (BERT's pooler.dense, RoBERTa's classifier.dense)
    head/out_proj/kernel                [D, N]         bias [N]   (BERT's classifier, RoBERTa's classifier.out_proj)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.errors import ModelLoadError
from jaxpage.models.attention import PackedAttention, PackedBatch, scores_per_pass
from jaxpage.models.hf_loader import SafetensorsSource, read_config_json
from jaxpage.models.llama import layer_unroll

ACTIVATIONS = {  # Hugging Face's hidden_act names
    "gelu": functools.partial(nn.gelu, approximate=False),
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
    "relu": nn.relu,
}
MODEL_TYPES = {"bert": "bert", "xlm-roberta": "xlm-roberta", "roberta": "xlm-roberta"}  # model_type -> architecture
ARCHITECTURES = {  # -> (architecture, head_kind)
    "BertModel": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert"),
    "XLMRobertaModel": ("xlm-roberta", None),
    "XLMRobertaForSequenceClassification": ("xlm-roberta", "roberta"),
    "RobertaModel": ("xlm-roberta", None),
    "RobertaForSequenceClassification": ("xlm-roberta", "roberta"),
}
SIZE_FIELDS = {  # HF's config field -> (EncoderConfig's, default: None for required)
    "vocab_size": ("vocab_size", None),
    "hidden_size": ("hidden_size", None),
    "num_hidden_layers": ("num_layers", None),
    "num_attention_heads": ("num_heads", None),
    "intermediate_size": ("intermediate_size", None),
    "max_position_embeddings": ("max_position_embeddings", None),
    "type_vocab_size": ("type_vocab_size", 2),
}
PROBLEM_TYPES = (None, "single_label_classification", "regression", "multi_label_classification")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """The shape and options of a BERT or XLM-RoBERTa model (see encoder_config_from_hf)."""

    architecture: str  # "bert" or "xlm-roberta"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str  # a key of ACTIVATIONS
    position_offset: int  # added to each token's position in its sequence: 0 (BERT), pad_token_id + 1 (XLM-RoBERTa)
    head_kind: str | None = None  # None (hidden states only), "bert" or "roberta" (a sequence classification head)
    num_labels: int = 0
    id2label: tuple[str, ...] = ()
    problem_type: str | None = None  # HF's: how a caller turns logits into scores (softmax, sigmoid, as they are)

    def __post_init__(self):
        assert self.architecture in ("bert", "xlm-roberta"), self.architecture
        assert self.hidden_act in ACTIVATIONS, self.hidden_act
        assert self.hidden_size % self.num_heads == 0, (self.hidden_size, self.num_heads)
        assert self.head_kind in (None, "bert", "roberta"), self.head_kind
        assert (self.num_labels > 0) == (self.head_kind is not None) and len(self.id2label) == self.num_labels

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_sequence_length(self) -> int:
        """The most tokens one sequence may have: positions past the position embeddings have none."""
        return self.max_position_embeddings - self.position_offset


def is_encoder_architecture(hf: dict) -> bool:
    """Whether a config.json dict names one of the encoders of this module (by model_type or architecture), so that
    encoder_config_from_hf, not the decoder's config, reads it (and refuses what it does not run)."""
    if not isinstance(hf, dict):
        return False
    architectures = hf.get("architectures")
    named = isinstance(architectures, list) and any(a in ARCHITECTURES for a in architectures if isinstance(a, str))
    return named or hf.get("model_type") in tuple(MODEL_TYPES)


def encoder_config_from_hf(hf: dict, source: str) -> EncoderConfig:
    """The EncoderConfig of a Hugging Face config.json dict; ModelLoadError naming `source` and the field for what
    this model does not run (an unknown model type or architecture, relative positions, a decoder, cross-attention,
    an unknown activation)."""

    def refuse(field: str, why: str):
        raise ModelLoadError(f"{source}: {field} {hf.get(field)!r} {why}")

    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        refuse("model_type", f"is not an encoder jaxpage runs ({', '.join(MODEL_TYPES)})")
    base = "BertModel" if MODEL_TYPES[model_type] == "bert" else "XLMRobertaModel"
    architectures = hf.get("architectures") or [base]
    name = architectures[0] if isinstance(architectures, list) and len(architectures) == 1 else None
    if not isinstance(name, str) or name not in ARCHITECTURES:
        refuse("architectures", f"is not one of {', '.join(ARCHITECTURES)}")
    architecture, head_kind = ARCHITECTURES[name]
    if architecture != MODEL_TYPES[model_type]:
        refuse("architectures", f"does not match model_type {model_type!r}")
    if hf.get("position_embedding_type", "absolute") not in ("absolute", None):
        refuse("position_embedding_type", "is not supported (only absolute position embeddings)")
    for field in ("is_decoder", "add_cross_attention"):
        if hf.get(field):
            refuse(field, "is not supported (jaxpage runs these models as bidirectional encoders)")
    if hf.get("hidden_act", "gelu") not in tuple(ACTIVATIONS):  # a tuple: an unhashable value is not in it
        refuse("hidden_act", f"is not one of {', '.join(ACTIVATIONS)}")
    if hf.get("problem_type") not in PROBLEM_TYPES:
        refuse("problem_type", f"is not one of {', '.join(map(repr, PROBLEM_TYPES))}")
    sizes = {ours: _positive_int(hf, theirs, source, default) for theirs, (ours, default) in SIZE_FIELDS.items()}
    if sizes["hidden_size"] % sizes["num_heads"]:
        refuse("num_attention_heads", f"does not divide hidden_size {sizes['hidden_size']}")
    eps = hf.get("layer_norm_eps", 1e-12)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        refuse("layer_norm_eps", "is not a positive number")
    offset = 0 if architecture == "bert" else _positive_int(hf, "pad_token_id", source, 1, minimum=0) + 1
    if offset >= sizes["max_position_embeddings"]:
        refuse("max_position_embeddings", f"leaves no positions after the offset {offset} (pad_token_id + 1)")
    labels = () if head_kind is None else _labels(hf, source)
    return EncoderConfig(
        architecture=architecture,
        **sizes,
        layer_norm_eps=float(eps),
        hidden_act=hf.get("hidden_act", "gelu"),
        position_offset=offset,
        head_kind=head_kind,
        num_labels=len(labels),
        id2label=labels,
        problem_type=hf.get("problem_type"),
    )


def _positive_int(hf: dict, field: str, source: str, default: int | None, minimum: int = 1) -> int:
    value = hf.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"{source}: {field} {value!r} is not an integer >= {minimum}")
    return value


def _labels(hf: dict, source: str) -> tuple[str, ...]:
    """The label names of a classifier, by index: id2label's, else LABEL_i for num_labels (default 2) as HF's."""
    id2label = hf.get("id2label")
    if id2label is None:
        return tuple(f"LABEL_{i}" for i in range(_positive_int(hf, "num_labels", source, 2)))
    try:
        by_index = {int(key): str(name) for key, name in id2label.items()}
    except (AttributeError, TypeError, ValueError):
        by_index = {}
    if not by_index or sorted(by_index) != list(range(len(by_index))):
        raise ModelLoadError(f"{source}: id2label {id2label!r} does not name the labels 0, 1, ... once each")
    return tuple(by_index[i] for i in range(len(by_index)))


def read_encoder_config(directory: Path) -> EncoderConfig:
    """The EncoderConfig of the model in `directory` (its config.json)."""
    return encoder_config_from_hf(read_config_json(directory), str(Path(directory) / "config.json"))


def _dense(features, dtype, name: str, axis=-1) -> nn.DenseGeneral:
    return nn.DenseGeneral(features, axis=axis, dtype=dtype, param_dtype=dtype, name=name)


def _layer_norm(config: EncoderConfig, dtype, name: str) -> nn.LayerNorm:
    # use_fast_variance off: E[(x - mean)^2], as torch computes it, not E[x^2] - mean^2
    return nn.LayerNorm(config.layer_norm_eps, dtype=dtype, param_dtype=dtype, use_fast_variance=False, name=name)


class EncoderLayer(nn.Module):
    """Post-LN: x = norm(x + attention(x)); x = norm(x + mlp(x))."""

    config: EncoderConfig
    dtype: jnp.dtype
    scores_per_pass: int | None = None  # PackedAttention's

    @nn.compact
    def __call__(self, x, batch: PackedBatch):  # x [T, D]
        c = self.config
        q, k, v = (_dense((c.num_heads, c.head_dim), self.dtype, name)(x) for name in ("q_proj", "k_proj", "v_proj"))
        attention = PackedAttention(1 / math.sqrt(c.head_dim), causal=False, scores_per_pass=self.scores_per_pass)
        out = attention.attend(q, k, v, batch, None, 0)
        x = _layer_norm(c, self.dtype, "attn_norm")(x + _dense(c.hidden_size, self.dtype, "o_proj", (-2, -1))(out))
        h = ACTIVATIONS[c.hidden_act](_dense(c.intermediate_size, self.dtype, "up_proj")(x))
        return _layer_norm(c, self.dtype, "mlp_norm")(x + _dense(c.hidden_size, self.dtype, "down_proj")(h)), None


class ClassificationHead(nn.Module):
    """out_proj(tanh(dense(x))): BERT's pooler and classifier, and RoBERTa's classifier, are the same arithmetic."""

    num_labels: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):  # x [S, D]
        x = jnp.tanh(_dense(x.shape[-1], self.dtype, "dense")(x))
        return _dense(self.num_labels, self.dtype, "out_proj")(x)


class Encoder(nn.Module):
    """BERT / XLM-RoBERTa over packed sequences. `__call__` gives the last layer's hidden states (HF's
    last_hidden_state); `classify` applies the sequence classification head. `platform`: the one it is compiled for
    (None: jax's default backend), whose compiler decides how the scanned layers unroll
    (jaxpage.models.llama.layer_unroll: every layer on a GPU, so that the products read the weights in place) and how
    many rows attend at once (jaxpage.models.attention.scores_per_pass)."""

    config: EncoderConfig
    dtype: jnp.dtype = jnp.float32
    platform: str | None = None

    def setup(self):
        c = self.config
        embed = functools.partial(nn.Embed, features=c.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        self.word_embeddings = embed(c.vocab_size)
        self.position_embeddings = embed(c.max_position_embeddings)
        self.token_type_embeddings = embed(c.type_vocab_size)
        self.embedding_norm = _layer_norm(c, self.dtype, None)
        self.layers = nn.scan(
            EncoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast,),
            length=c.num_layers,
            unroll=layer_unroll(c, self.platform),
        )(c, self.dtype, scores_per_pass(self.platform))
        if c.head_kind is not None:
            self.head = ClassificationHead(c.num_labels, self.dtype)

    def __call__(
        self,
        token_ids,  # [T] int32
        positions,  # [T] int32, each token's position in its own sequence (0-based)
        batch: PackedBatch,
        token_type_ids=None,  # [T] int32 (None: all 0; BERT cross-encoders give the second text type 1)
    ):
        """hidden [T, hidden_size]; meaningless on padding. A sequence has at most config.max_sequence_length
        tokens (past that its positions have no embedding)."""
        token_type_ids = jnp.zeros_like(token_ids) if token_type_ids is None else token_type_ids
        # Padding looks up row 0 whatever it holds: an out-of-range lookup is NaN, which would reach the other
        # tokens through the attention's 0 * v.
        real = batch.segment_ids >= 0
        token_ids, positions, token_type_ids = (jnp.where(real, a, 0) for a in (token_ids, positions, token_type_ids))
        x = self.word_embeddings(token_ids) + self.token_type_embeddings(token_type_ids)
        x = self.embedding_norm(x + self.position_embeddings(positions + self.config.position_offset))
        x, _ = self.layers(x, batch)
        return x

    def classify(
        self,
        hidden,  # [T, hidden_size], from __call__
        first_token_index,  # [S] int32, the packed index of each sequence's first token ([CLS] / <s>)
    ):
        """float32 logits [S, num_labels] of the classification head (the config's head_kind)."""
        if self.config.head_kind is None:
            raise ValueError("this encoder has no classification head (config.head_kind is None)")
        return self.head(hidden[first_token_index]).astype(jnp.float32)


def init_encoder_params(config: EncoderConfig, rng: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters (Flax's default initializers); for tests and benchmarks without weights."""
    tokens = jnp.zeros((1,), jnp.int32)
    batch = PackedBatch(positions=tokens, segment_ids=tokens)

    def run(model: Encoder, *args):  # the head too: linen creates a submodule's parameters when it is called
        hidden = model(*args)
        return hidden if config.head_kind is None else model.classify(hidden, tokens)

    return Encoder(config, jnp.dtype(dtype)).init(rng, tokens, tokens, batch, method=run)["params"]


LAYER_MODULES = {  # jaxpage's module under layers/ -> HF's under encoder.layer.{i}.
    "q_proj": "attention.self.query",
    "k_proj": "attention.self.key",
    "v_proj": "attention.self.value",
    "o_proj": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "up_proj": "intermediate.dense",
    "down_proj": "output.dense",
    "mlp_norm": "output.LayerNorm",
}


def _hf_modules(c: EncoderConfig, prefix: str) -> dict[tuple[str, ...], str]:
    """jaxpage's module path -> HF's module name (`{i}` standing for the layer index under layers/)."""
    modules = {(f"{k}_embeddings",): f"{prefix}embeddings.{k}_embeddings" for k in ("word", "position", "token_type")}
    modules[("embedding_norm",)] = f"{prefix}embeddings.LayerNorm"
    modules |= {("layers", ours): f"{prefix}encoder.layer.{{i}}.{theirs}" for ours, theirs in LAYER_MODULES.items()}
    if c.head_kind == "bert":
        modules |= {("head", "dense"): f"{prefix}pooler.dense", ("head", "out_proj"): "classifier"}
    elif c.head_kind == "roberta":
        modules |= {("head", "dense"): "classifier.dense", ("head", "out_proj"): "classifier.out_proj"}
    return modules


def _torch_layout(leaf: str, shape: tuple[int, ...], in_axes: int) -> tuple[tuple[int, ...], Callable]:
    """(the torch shape of jaxpage's parameter `leaf` of `shape` whose first `in_axes` axes a kernel contracts,
    torch -> jaxpage)."""
    if leaf == "kernel":  # Linear weight [out, in] -> [*in axes, *out axes]
        return (math.prod(shape[in_axes:]), math.prod(shape[:in_axes])), lambda w: w.T.reshape(shape)
    if leaf == "embedding":
        return shape, lambda w: w
    return (math.prod(shape),), lambda w: w.reshape(shape)  # bias, LayerNorm scale


def load_encoder_params(directory: Path, config: EncoderConfig, dtype) -> dict:
    """The parameter tree (numpy arrays of `dtype`) from `directory`'s model.safetensors or sharded index, under
    HF's names with or without the `bert.` / `roberta.` prefix (LayerNorm's old gamma / beta names too). Tensors the
    model does not use (position_ids buffers, a base model's pooler) are not read. ModelLoadError names the file and
    the tensor when one is missing or has the wrong shape."""
    c, dtype = config, np.dtype(dtype)
    shapes = jax.eval_shape(functools.partial(init_encoder_params, c, jax.random.key(0)))
    with contextlib.ExitStack() as stack:
        source = SafetensorsSource.of_directory(directory, stack)
        names = source.names()
        base = "bert." if c.architecture == "bert" else "roberta."
        prefix = base if base + "embeddings.word_embeddings.weight" in names else ""

        def load(name: str, shape: tuple[int, ...], convert: Callable) -> np.ndarray:
            old = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
            found = next((n for n in (name, old) if n in names), None)
            if found is None:
                raise ModelLoadError(f"{source.file_of(name)}: tensor {name!r} is missing")
            try:
                tensor = source.get(found)
            except ModelLoadError:
                raise
            except Exception as e:  # a truncated or corrupt file surfaces here
                raise ModelLoadError(f"{source.file_of(found)}: cannot read tensor {found!r} ({e})") from None
            if tuple(tensor.shape) != shape:
                raise ModelLoadError(
                    f"{source.file_of(found)}: tensor {found!r} has shape {tensor.shape}, expected {shape}"
                )
            return np.ascontiguousarray(convert(tensor).astype(dtype))

        params: dict = {}
        for path, hf_module in _hf_modules(c, prefix).items():
            layered = path[0] == "layers"
            node, wanted = params, shapes
            for key in path:
                node, wanted = node.setdefault(key, {}), wanted[key]
            for leaf, struct in wanted.items():
                torch_shape, convert = _torch_layout(
                    leaf, struct.shape[1 if layered else 0 :], 2 if path[-1] == "o_proj" else 1
                )
                hf_name = f"{hf_module}.{'bias' if leaf == 'bias' else 'weight'}"
                tensors = [
                    load(hf_name.format(i=i), torch_shape, convert) for i in range(c.num_layers if layered else 1)
                ]
                node[leaf] = np.stack(tensors) if layered else tensors[0]
        return params
