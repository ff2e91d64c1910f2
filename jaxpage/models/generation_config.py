"""The model's generation config (`generation_config.json`), read as vLLM reads it (`--generation-config`).

Two things in it change what a request gets:
- `eos_token_id` (one id or a list): these end a sequence too, beside config.json's and the tokenizer's EOS (Gemma's
  `<end_of_turn>`, the extra EOS ids of instruct models' chat turns);
- its sampling fields (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens` as
  `max_tokens`): the defaults of requests that leave them unset (the Python API's `sampling_params=None`, an HTTP or
  batch body without the field).
The other fields (`do_sample`, `bos_token_id`, `pad_token_id`, `transformers_version`, ...) change nothing here and are
not read, as in vLLM. Overrides (`override_generation_config`) may set only the fields read; another is refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxpage.errors import ModelLoadError
from jaxpage.sampling_params import SamplingParams
from jaxpage.validation import describe, is_int

FILE = "generation_config.json"
# The fields read, by the name SamplingParams gives them.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
EOS_FIELD = "eos_token_id"
MODES = ("auto", "vllm")  # or a directory holding generation_config.json


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """What the generation config gives: EOS ids and requests' sampling defaults (by SamplingParams' names)."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: tuple[tuple[str, Any], ...] = ()
    source: str | None = None  # the file read, for logs

    @property
    def sampling_dict(self) -> dict[str, Any]:
        return dict(self.sampling)

    def sampling_params(self) -> SamplingParams:
        """SamplingParams of a request that sets nothing (the defaults taken, SamplingParams' own for the rest)."""
        return SamplingParams(**self.sampling_dict)


def generation_defaults(mode: str, model_path: Path | None, overrides: dict | None = None) -> GenerationDefaults:
    """The defaults of `mode` ("auto": the model's generation_config.json, if its directory holds one; "vllm": none;
    else a directory holding one), with `overrides` (generation config fields) set over them. ModelLoadError naming
    the file and field for a bad file; ValueError naming the field for a bad override."""
    fields, source = {}, None
    if mode == "auto":
        directory = model_path if model_path is not None and model_path.is_dir() else None
    elif mode == "vllm":
        directory = None
    else:
        directory = Path(mode).expanduser()
        if not (directory / FILE).is_file():
            raise ValueError(
                f"engine argument generation_config must be 'auto', 'vllm' or a directory holding {FILE}, got "
                f"{describe(mode)}"
            )
    if directory is not None and (directory / FILE).is_file():
        path = directory / FILE
        fields = {k: v for k, v in _read_object(path).items() if (k in SAMPLING_FIELDS or k == EOS_FIELD)}
        source = str(path)
        try:
            checked = _checked(fields)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
    else:
        checked = {}
    if overrides:
        unknown = sorted(str(k) for k in overrides if k not in SAMPLING_FIELDS and k != EOS_FIELD)
        if unknown:
            raise ValueError(
                f"engine argument override_generation_config has fields jaxpage does not read: {unknown} (it reads "
                f"{sorted([*SAMPLING_FIELDS, EOS_FIELD])})"
            )
        try:
            checked |= _checked(overrides)
        except ValueError as e:
            raise ValueError(f"engine argument override_generation_config: {e}") from None
        source = "override_generation_config" if source is None else f"{source} and override_generation_config"
    eos = checked.pop(EOS_FIELD, ())
    return GenerationDefaults(eos, tuple(sorted(checked.items())), source)


def _read_object(path: Path) -> dict:
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(fields, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {describe(fields)}")
    return fields


def _checked(fields: dict) -> dict:
    """{SamplingParams name: value, "eos_token_id": tuple of ids} of generation config fields (a null one is unset);
    ValueError naming the field."""
    checked: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None:
            continue
        if key == EOS_FIELD:
            ids = value if isinstance(value, list) else [value]
            if not ids or not all(is_int(i) and 0 <= i < 2**31 for i in ids):
                raise ValueError(f"{EOS_FIELD} must be a token id or a non-empty list of them, got {describe(value)}")
            checked[EOS_FIELD] = tuple(int(i) for i in ids)
            continue
        name = SAMPLING_FIELDS[key]
        try:
            SamplingParams(**{name: value, **({"max_tokens": None} if name != "max_tokens" else {})})
        except ValueError as e:  # SamplingParams' own check, in the file's name of the field
            raise ValueError(str(e).replace(f"SamplingParams.{name}", key)) from None
        checked[name] = value
    return checked
