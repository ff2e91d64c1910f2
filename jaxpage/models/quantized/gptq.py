"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`): one projection as a QuantizedTensor.

`qweight` int32 [in * bits / 32, out]: codes (unsigned) packed along the inputs, lowest bits first; `qzeros` int32
[groups, out * bits / 32], packed along the outputs, each zero point less `stored_zero_offset` (1 in the original
"gptq" format); `scales` float16 [groups, out]; `g_idx` int32 [in], each input row's group (with desc_act a
permutation's, else row // group_size). W = (q - zero) * scale[g_idx].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpage.config.weight_quantization import WeightQuantization
from jaxpage.errors import ModelLoadError
from jaxpage.models.quantized.tensors import QuantizedTensor, block_counts, check, signed, unpack_int32


def read(tensor: Callable[[str], np.ndarray], has: Callable[[str], bool], module: str, out_features: int,
         in_features: int, scheme: WeightQuantization) -> QuantizedTensor:  # fmt: skip
    bits, per_word = scheme.bits, 32 // scheme.bits
    for features, what in ((in_features, "input"), (out_features, "output")):
        if features % per_word:
            raise ModelLoadError(f"{module}: {features} {what} features do not pack into GPTQ's words of {per_word}")
    groups = block_counts(scheme, out_features, in_features)[1]
    name = f"{module}.qweight"
    q = unpack_int32(check(name, tensor(name), (in_features // per_word, out_features), "i", "qweight"), bits, 0)
    name = f"{module}.qzeros"
    z = unpack_int32(check(name, tensor(name), (groups, out_features // per_word), "i", "qzeros"), bits, 1)
    z = z + scheme.stored_zero_offset
    if scheme.symmetric and np.any(z != 1 << (bits - 1)):
        raise ModelLoadError(f"{name}: a symmetric checkpoint's zero points must all be {1 << (bits - 1)}")
    name = f"{module}.scales"
    scale = check(name, tensor(name), (groups, out_features), "f", "scales")
    g_idx = None
    if has(f"{module}.g_idx"):
        g_idx = check(f"{module}.g_idx", tensor(f"{module}.g_idx"), (in_features,), "i", "g_idx").astype(np.int64)
    zero = None if scheme.symmetric else signed(z.T, bits)
    return QuantizedTensor(signed(q.T, bits), scale.T.astype(np.float32), zero, g_idx)
