"""PoolerConfig: how a pooling model turns its hidden states into one vector per input, read from the model's
sentence-transformers files where it has them, else vLLM's defaults.

sentence-transformers describes a model as a pipeline of modules (`modules.json`): the Transformer, then Pooling
(`1_Pooling/config.json`: which tokens' states and how: the [CLS] token's, the mean, the max, the last token's), then
optionally Normalize (unit length). `sentence_bert_config.json` gives the inputs' longest length, and
`config_sentence_transformers.json` named prompts (instructions put before an input) and a default one. Modules that
would change an embedding and that jaxpage does not run (a Dense projection, a word-embedding bag, ...) are refused by
name when the model loads, never skipped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxpage.errors import ModelLoadError

POOLING_TYPES = ("CLS", "MEAN", "MAX", "LAST")
# sentence-transformers' pooling modes (1_Pooling/config.json's `pooling_mode`, or before its version 6 one
# `pooling_mode_*: true`) as jaxpage's pooling types; its other modes are refused by name
SENTENCE_TRANSFORMERS_MODES = {"cls": "CLS", "mean": "MEAN", "max": "MAX", "lasttoken": "LAST"}
LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# modules.json's types by their class name (the module paths moved between sentence-transformers' versions)
MODULE_KINDS = ("Transformer", "Pooling", "Normalize")
# transformers' model_max_length when a tokenizer has none
UNSET_MODEL_MAX_LENGTH = 10**12


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """pooling_type: one of POOLING_TYPES; normalize: whether embeddings are made unit length by default (a request's
    PoolingParams.normalize overrides it); max_seq_length: the longest input the model was trained on (None: its
    position embeddings' limit); prompts: sentence-transformers' named prompts, default_prompt_name the one used when a
    caller names none (None: no prompt); matryoshka_dimensions: the sizes an embedding may be cut to (None: any
    size up to the whole, as vLLM allows only where the model says it is a Matryoshka model: see `dimensions_allowed`);
    is_matryoshka: the model was trained so that its embeddings' first dimensions stand alone."""

    pooling_type: str
    normalize: bool
    max_seq_length: int | None = None
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "defaults"  # where it was read from, for messages

    def __post_init__(self):
        assert self.pooling_type in POOLING_TYPES, self.pooling_type

    def check_dimensions(self, dimensions: int, hidden_size: int) -> None:
        """ValueError unless an embedding of this model may be cut to `dimensions` (PoolingParams.dimensions)."""
        if not self.is_matryoshka:
            raise ValueError(
                f"dimensions: this model's embeddings cannot be shortened (it declares no Matryoshka dimensions in "
                f"its config.json: is_matryoshka / matryoshka_dimensions); leave dimensions out, got {dimensions}"
            )
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ValueError(f"dimensions must be one of {list(allowed)} for this model, got {dimensions}")
        if not 1 <= dimensions <= hidden_size:
            raise ValueError(f"dimensions must be in [1, {hidden_size}] (the model's embedding size), got {dimensions}")


def default_pooler_config(is_encoder: bool, hf: dict) -> PoolerConfig:
    """vLLM's defaults for a model without sentence-transformers files: an encoder's [CLS] token, a decoder's last
    token, normalized; Matryoshka dimensions as the model's config.json declares them."""
    return PoolerConfig("CLS" if is_encoder else "LAST", True, **_matryoshka(hf, "config.json"))


def read_pooler_config(directory: Path, is_encoder: bool, hf: dict) -> PoolerConfig:
    """The PoolerConfig of a model directory: its sentence-transformers files where it has modules.json, else
    default_pooler_config. hf: the model's config.json. ModelLoadError names the file and field of anything refused."""
    modules_path = directory / "modules.json"
    if not modules_path.is_file():
        return default_pooler_config(is_encoder, hf)
    modules = _read_json(modules_path, list)
    pooling_type, normalize, seen = None, False, []
    for position, module in enumerate(modules):
        kind = module.get("type") if isinstance(module, dict) else None
        where = f"{modules_path}: module {position} ({module.get('path', '') if isinstance(module, dict) else ''!r})"
        if not isinstance(kind, str):
            raise ModelLoadError(f"{where}: expected an object with a 'type'")
        name = kind.rpartition(".")[2] if kind.startswith("sentence_transformers.") else None
        if name in MODULE_KINDS and list(MODULE_KINDS[: len(seen) + 1]) == [*seen, name]:  # in this order
            seen.append(name)
            if name == "Pooling":
                pooling_type = _pooling_type(directory / str(module.get("path", "")) / "config.json")
            normalize = name == "Normalize"
        else:
            raise ModelLoadError(
                f"{where}: module type {kind!r} is not supported here; jaxpage runs a Transformer, then Pooling, "
                "then optionally Normalize"
            )
    if pooling_type is None:
        raise ModelLoadError(f"{modules_path}: no Pooling module after the Transformer")
    return PoolerConfig(
        pooling_type,
        normalize,
        _max_seq_length(directory),
        **_prompts(directory / "config_sentence_transformers.json"),
        **_matryoshka(hf, "config.json"),
        source=str(modules_path),
    )


def _pooling_type(path: Path) -> str:
    config = _read_json(path, dict)
    modes = config.get("pooling_mode")
    if modes is None:  # before sentence-transformers 6
        modes = [mode for key, mode in LEGACY_MODE_KEYS.items() if config.get(key) is True]
    modes = [modes] if isinstance(modes, str) else modes
    if not isinstance(modes, list) or len(modes) != 1:
        raise ModelLoadError(
            f"{path}: expected exactly one pooling mode, got {modes!r} (concatenated poolings are not supported)"
        )
    if modes[0] not in SENTENCE_TRANSFORMERS_MODES:
        raise ModelLoadError(
            f"{path}: pooling mode {modes[0]!r} is not supported (supported: {', '.join(SENTENCE_TRANSFORMERS_MODES)})"
        )
    if config.get("include_prompt", True) is not True:
        raise ModelLoadError(f"{path}: include_prompt false (pooling without the prompt's tokens) is not supported")
    return SENTENCE_TRANSFORMERS_MODES[modes[0]]


def _max_seq_length(directory: Path) -> int | None:
    """The longest input the sentence-transformers model takes: sentence_bert_config.json's max_seq_length, or (where
    sentence-transformers 6 keeps it) the tokenizer's model_max_length; None when neither says."""
    path = directory / "sentence_bert_config.json"
    config = _read_json(path, dict) if path.is_file() else {}
    if config.get("do_lower_case"):
        raise ModelLoadError(f"{path}: do_lower_case (lower-casing inputs before the tokenizer) is not supported")
    length = config.get("max_seq_length")
    tokenizer_config = directory / "tokenizer_config.json"
    if length is None and tokenizer_config.is_file():
        path, length = tokenizer_config, _read_json(tokenizer_config, dict).get("model_max_length")
        if isinstance(length, int | float) and length >= UNSET_MODEL_MAX_LENGTH:
            return None
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
        raise ModelLoadError(f"{path}: max_seq_length must be a positive integer, got {length!r}")
    return length


def _prompts(path: Path) -> dict:
    if not path.is_file():
        return {}
    config = _read_json(path, dict)
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ModelLoadError(f"{path}: prompts must be an object of names to texts")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ModelLoadError(f"{path}: default_prompt_name {default!r} is not one of its prompts {sorted(prompts)}")
    if config.get("similarity_fn_name") not in (None, "cosine", "dot"):
        raise ModelLoadError(f"{path}: similarity_fn_name {config['similarity_fn_name']!r} is not supported")
    return dict(prompts=tuple(prompts.items()), default_prompt_name=default)


def _matryoshka(hf: dict, where: str) -> dict:
    dimensions = hf.get("matryoshka_dimensions")
    if dimensions is not None and (
        not isinstance(dimensions, list) or not all(isinstance(d, int) and d > 0 for d in dimensions)
    ):
        raise ModelLoadError(f"{where}: matryoshka_dimensions must be a list of positive integers, got {dimensions!r}")
    is_matryoshka = bool(hf.get("is_matryoshka")) or dimensions is not None
    return dict(is_matryoshka=is_matryoshka, matryoshka_dimensions=None if dimensions is None else tuple(dimensions))


def _read_json(path: Path, kind: type):
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, kind):
        raise ModelLoadError(f"{path}: expected a JSON {'object' if kind is dict else 'array'}")
    return value
