"""jaxpage's own checkpoint: an orbax checkpoint of the parameters beside the ModelConfig as JSON.

Layout of a checkpoint directory (written by `jaxpage convert SRC DST`):

    jaxpage_checkpoint.json   {"format_version": 1, "dtype": ..., "config": ModelConfig fields}
    params/                   orbax StandardCheckpointer checkpoint of the parameter tree
    tokenizer files           whatever `save_pretrained` of the source's tokenizer writes

Restoring reads each array straight into its target sharding: nothing passes through host numpy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError
from jaxpage.models.llama import param_shapes, params_dtype

MARKER_FILE = "jaxpage_checkpoint.json"
FORMAT_VERSION = 1


def is_checkpoint(directory: Path) -> bool:
    return (directory / MARKER_FILE).is_file()


def save_checkpoint(directory: Path, config: ModelConfig, params: dict) -> None:
    """Writes `params` and `config` under `directory` (which must not hold a checkpoint yet)."""
    directory = Path(directory).absolute()
    if (directory / "params").exists():
        raise FileExistsError(f"{directory / 'params'} already exists")
    directory.mkdir(parents=True, exist_ok=True)
    import orbax.checkpoint as ocp  # ~0.25 s to import: only when a checkpoint is written or read

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "params", params)
    checkpointer.wait_until_finished()
    marker = {
        "format_version": FORMAT_VERSION,
        "dtype": params_dtype(params).name,
        "config": json.loads(config.to_json()),
    }
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2))


def read_checkpoint_config(directory: Path) -> tuple[ModelConfig, str]:
    """(config, stored dtype name) of a checkpoint directory."""
    path = directory / MARKER_FILE
    try:
        marker = json.loads(path.read_text())
        if marker.get("format_version") != FORMAT_VERSION:
            raise ModelLoadError(f"{path}: format_version {marker.get('format_version')!r}, expected {FORMAT_VERSION}")
        return ModelConfig.from_json(json.dumps(marker["config"])), marker["dtype"]
    except ModelLoadError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise ModelLoadError(f"{path}: not a valid jaxpage checkpoint description ({e!r})") from None


def load_checkpoint(directory: Path, dtype, placement: Callable[[ModelConfig], Any]) -> tuple[ModelConfig, dict]:
    """(config, parameters on device) from a jaxpage checkpoint, cast to `dtype`, placed where `placement(config)`
    says (a Sharding, or a tree of them like the parameters'): each array is read straight into its shards."""
    directory = Path(directory).absolute()
    config, stored_dtype = read_checkpoint_config(directory)
    shapes = param_shapes(config, stored_dtype if dtype is None else dtype)
    where = placement(config)
    if isinstance(where, jax.sharding.Sharding):
        where = jax.tree.map(lambda _: where, shapes)
    abstract = jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), shapes, where)
    params_dir = directory / "params"
    if not params_dir.is_dir():
        raise ModelLoadError(f"{params_dir}: missing; the checkpoint is incomplete")
    import orbax.checkpoint as ocp

    try:
        params = ocp.StandardCheckpointer().restore(params_dir, abstract)
    except Exception as e:  # orbax/tensorstore raise assorted types for missing or damaged arrays
        raise ModelLoadError(f"{params_dir}: cannot restore the parameters ({type(e).__name__}: {e})") from None
    return config, params
