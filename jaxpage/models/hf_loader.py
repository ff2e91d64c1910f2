"""Loads a Hugging Face model directory: `config.json` + `model.safetensors` or a sharded index."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxpage.config import ModelConfig, model_config_from_hf
from jaxpage.errors import ModelLoadError
from jaxpage.models.safetensors_header import (
    FLOAT_DTYPES,
    QUANTIZED_DTYPES,
    SafetensorsHeader,
    read_safetensors_header,
)
from jaxpage.models.weights import params_from_hf_tensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config_json(directory: Path) -> dict:
    """`directory`/config.json as a dict; ModelLoadError when it is missing or not a JSON object."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no config.json; not a Hugging Face model directory")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return hf


def read_hf_config(directory: Path, overrides: dict | None = None) -> ModelConfig:
    """The model's config from `directory`/config.json, `overrides` (the engine argument hf_overrides) set over its
    fields."""
    hf, path = read_config_json(directory), directory / "config.json"
    source = str(path) if not overrides else f"{path} with hf_overrides {sorted(overrides)}"
    return model_config_from_hf(hf | (overrides or {}), source=source)


def _weight_map(directory: Path, dtypes: tuple[str, ...]) -> tuple[dict[str, Path], Path]:
    """(tensor name -> the safetensors file that holds it, the file that lists the tensors)."""
    if (directory / INDEX_FILE).is_file():
        index_path = directory / INDEX_FILE
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({e!r})") from None
        return {name: directory / file for name, file in weight_map.items()}, index_path
    single = directory / SINGLE_FILE
    if not single.is_file():
        pickled = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" ({', '.join(pickled)} are pickled PyTorch files, which jaxpage never unpickles)" if pickled else ""
        raise ModelLoadError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}{hint}; save the model as safetensors")
    with open_safetensors(single, dtypes) as f:
        return {name: single for name in f.keys()}, single


def open_safetensors(path: Path, dtypes: tuple[str, ...] = FLOAT_DTYPES):
    """safetensors' numpy reader of `path`, once its header is checked (jaxpage.models.safetensors_header)."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    read_safetensors_header(path, dtypes)  # every field checked, named where wrong: safetensors' own message is generic
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as e:  # safetensors raises its own error type for malformed headers
        raise ModelLoadError(f"{path}: not a valid safetensors file ({e})") from None


class SafetensorsSource:
    """TensorSource over one or more safetensors files (memory-mapped, read on demand)."""

    def __init__(
        self, weight_map: dict[str, Path], listing: Path, stack: contextlib.ExitStack, dtypes: tuple[str, ...]
    ):
        self._weight_map = weight_map
        self._listing = listing  # the file that should list a missing tensor
        self._stack = stack
        self._dtypes = dtypes
        self._handles: dict[Path, object] = {}
        self._headers: dict[Path, SafetensorsHeader] = {}

    @classmethod
    def of_directory(cls, directory: Path, stack: contextlib.ExitStack, quantized: bool = False) -> SafetensorsSource:
        """The tensors of a Hugging Face directory's model.safetensors or sharded index, open while `stack` is;
        `quantized`: a pre-quantized checkpoint's, whose integer and FP8 tensors are read too."""
        dtypes = QUANTIZED_DTYPES if quantized else FLOAT_DTYPES
        return cls(*_weight_map(Path(directory), dtypes), stack, dtypes)

    def names(self) -> set[str]:
        return set(self._weight_map)

    def file_of(self, name: str) -> str:
        return str(self._weight_map.get(name, self._listing))

    def get(self, name: str) -> np.ndarray:
        path = self._weight_map[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(open_safetensors(path, self._dtypes))
            self._headers[path] = read_safetensors_header(path, self._dtypes)
        info = self._headers[path].tensors.get(name)
        if info is not None and info.dtype == "F8_E4M3":  # numpy has no FP8: read its bytes as ml_dtypes'
            start = self._headers[path].data_start + info.begin
            raw = np.fromfile(path, np.uint8, info.end - info.begin, offset=start)
            return raw.view(ml_dtypes.float8_e4m3fn).reshape(info.shape)
        return self._handles[path].get_tensor(name)


def load_hf_directory(
    directory: Path, dtype, quantization: str | None = None, overrides: dict | None = None
) -> tuple[ModelConfig, dict]:
    """(config, numpy parameter tree) from a Hugging Face model directory (quantization: see
    params_from_hf_tensors; overrides: see read_hf_config)."""
    # over a pre-quantized checkpoint, int8 applies to what it leaves in floats (the embedding, an LM head)
    config = dataclasses.replace(read_hf_config(directory, overrides), quantization=quantization)
    with contextlib.ExitStack() as stack:
        source = SafetensorsSource.of_directory(directory, stack, config.weight_quantization is not None)
        params = params_from_hf_tensors(config, source, dtype, quantization)
    return config, params
