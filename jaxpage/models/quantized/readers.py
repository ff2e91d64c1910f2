"""One pre-quantized projection's parameters from its checkpoint tensors, by the checkpoint's format."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpage.config.weight_quantization import WeightQuantization
from jaxpage.errors import ModelLoadError
from jaxpage.models.quantized import awq, compressed_tensors, fp8_block, gptq
from jaxpage.models.quantized.tensors import parameters

READERS = {"compressed-tensors": compressed_tensors.read, "fp8": fp8_block.read, "awq": awq.read, "gptq": gptq.read}


def read_projection(
    scheme: WeightQuantization,
    tensor: Callable[[str], np.ndarray],
    has: Callable[[str], bool],
    module: str,
    shape: tuple[int, int],
    file_of: Callable[[str], str],
) -> dict[str, np.ndarray]:
    """The parameters of projection `module` (its full checkpoint name, "model.layers.0.self_attn.q_proj") of torch
    shape [out, in] (jaxpage.models.quantized.tensors.parameters). `tensor(name)` reads one tensor (ModelLoadError
    naming its file when it is missing); a tensor of the wrong shape or dtype is a ModelLoadError naming its file and
    the tensor."""
    out_features, in_features = shape
    try:
        quantized = READERS[scheme.method](tensor, has, module, out_features, in_features, scheme)
        return parameters(quantized, scheme, module)
    except ModelLoadError as e:
        message = str(e)
        if message.startswith(module):  # a reader's message names the tensor: say which file holds it
            name = message.split(":", 1)[0]
            raise ModelLoadError(f"{file_of(name)}: tensor {name!r}{message[len(name) :]}") from None
        raise
