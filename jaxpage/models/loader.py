"""`load_model(source)`: one entry point for every weight format jaxpage reads."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError
from jaxpage.models import default_model, gguf_loader, hf_loader, orbax_checkpoint
from jaxpage.models.llama import init_params
from jaxpage.models.quantized.dense import with_device_codes
from jaxpage.sources import DEFAULT_DOWNLOAD, HubDownload, resolve_model

GGUF_MAGIC = b"GGUF"


def default_dtype() -> jnp.dtype:
    """float32 on CPU (XLA's CPU bf16 matmuls are slow), bfloat16 on GPU and TPU."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def resolve_source(
    source: str | os.PathLike | None, download: HubDownload = DEFAULT_DOWNLOAD, weights: bool = True
) -> Path:
    """The local path of a model source: None means the default model (fetched on first use); a path that does not
    exist is taken as a Hugging Face Hub id and downloaded (jaxpage.sources), at `download`'s revision and place
    (without `weights`: only its configs and tokenizer)."""
    if source is None:
        if download.revision is not None:
            raise ModelLoadError(f"revision {download.revision!r}: the default model has no revisions")
        return default_model.default_model_path()
    return resolve_model(source, download, weights)


def source_format(path: Path) -> str:
    """'gguf', 'orbax' or 'hf' for a local path; ModelLoadError when it is none of these."""
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == GGUF_MAGIC:
                return "gguf"
        raise ModelLoadError(f"{path}: not a GGUF file (a model file must be .gguf; otherwise pass a directory)")
    if orbax_checkpoint.is_checkpoint(path):
        return "orbax"
    if (path / "config.json").is_file():
        return "hf"
    ggufs = sorted(path.glob("*.gguf"))
    hint = f" (it holds {ggufs[0].name}: pass that file)" if ggufs else ""
    raise ModelLoadError(f"{path}: neither a Hugging Face model directory nor a jaxpage checkpoint{hint}")


def load_model(
    source: str | os.PathLike | None = None,
    dtype=None,
    sharding: jax.sharding.Sharding | Callable[[ModelConfig], Any] | None = None,
    load_format: str = "auto",
    quantization: str | None = None,
    download: HubDownload = DEFAULT_DOWNLOAD,
    hf_overrides: dict | None = None,
) -> tuple[ModelConfig, dict]:
    """Loads (config, params) from a model source.

    source:   a Hugging Face directory (config.json + safetensors), a .gguf file, a checkpoint written
              by `jaxpage convert`, a Hugging Face Hub id (org/name, org/name:Q4_K_M, org/name/file.gguf: see
              jaxpage.sources), or None for the default model (SmolLM2-135M-Instruct).
    dtype:    parameter dtype; default float32 on CPU, bfloat16 on GPU/TPU.
    sharding: where the parameters live: a Sharding, or a function of the config that gives a tree of them (one per
              parameter: each device receives only its shards, see jaxpage.worker.parallel); default the first device.
    load_format: "auto" reads the weights; "dummy" reads only the config of a Hugging Face directory and makes
              random parameters on the device (vLLM's name: benchmarks of model shapes without their weights).
    quantization: None (the weights as they are) or "int8": every projection and the embedding in int8 with a
              float32 scale per output channel, quantized tensor by tensor as they load (jaxpage.models.int8); over a
              pre-quantized checkpoint (FP8, AWQ, GPTQ, compressed-tensors) only what it leaves in floats: the
              embedding, an LM head, ignored projections. A jaxpage checkpoint keeps the quantization it was written
              with.
    download: a Hub id's revision and download folder.
    hf_overrides: Hugging Face config fields set over the model's (config.json's, or those a GGUF file's metadata
              gives); refused for a jaxpage checkpoint, whose config is fixed.
    Raises ModelLoadError with the file (and tensor) at fault.
    """
    path = resolve_source(source, download, weights=load_format != "dummy")
    dtype = jnp.dtype(dtype) if dtype is not None else default_dtype()
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placement = sharding if callable(sharding) else (lambda config: sharding)
    fmt = source_format(path)
    if load_format == "dummy":
        if fmt != "hf":
            raise ModelLoadError(f"{path}: load_format='dummy' needs a Hugging Face model directory (config.json)")
        config = dataclasses.replace(hf_loader.read_hf_config(path, hf_overrides), quantization=quantization)
        init = jax.jit(init_params, static_argnums=(0, 2), out_shardings=placement(config))
        return config, init(config, jax.random.key(0), dtype)
    if fmt == "orbax":
        if hf_overrides:
            raise ModelLoadError(
                f"{path}: a jaxpage checkpoint's config is fixed when it is written; hf_overrides apply to Hugging "
                "Face directories and GGUF files"
            )
        config, params = orbax_checkpoint.load_checkpoint(path, dtype, placement)
        if quantization not in (None, config.quantization):
            raise ModelLoadError(
                f"{path}: a checkpoint of {config.quantization or 'unquantized'} weights; to serve it as "
                f"{quantization}, convert its source with `jaxpage convert --quantization {quantization}`"
            )
        return config, params
    if fmt == "gguf":
        config, params = gguf_loader.load_gguf(path, dtype, quantization, hf_overrides)
    else:
        config, params = hf_loader.load_hf_directory(path, dtype, quantization, hf_overrides)
    return config, jax.device_put(with_device_codes(params, config.weight_quantization), placement(config))
