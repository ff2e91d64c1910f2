"""Block-wise FP8 checkpoints (`quant_method: fp8`, `weight_block_size` [rows, cols]: DeepSeek-V3, Qwen3-*-FP8): one
projection as a QuantizedTensor. `weight` float8_e4m3 [out, in]; `weight_scale_inv` float32 [ceil(out / rows),
ceil(in / cols)], by which the codes are multiplied (the name says the inverse of the scale they were divided by)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpage.config.weight_quantization import WeightQuantization
from jaxpage.models.quantized.tensors import QuantizedTensor, block_counts, check


def read(tensor: Callable[[str], np.ndarray], has: Callable[[str], bool], module: str, out_features: int,
         in_features: int, scheme: WeightQuantization) -> QuantizedTensor:  # fmt: skip
    name = f"{module}.weight"
    codes = check(name, tensor(name), (out_features, in_features), "8", "the FP8 weight")
    name = f"{module}.weight_scale_inv"
    scale = check(name, tensor(name), block_counts(scheme, out_features, in_features), "f", "the block scales")
    return QuantizedTensor(codes, scale.astype(np.float32), None)
