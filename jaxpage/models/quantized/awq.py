"""AWQ checkpoints (AutoAWQ's GEMM packing, `quant_method: awq`, `version: gemm`): one projection as a QuantizedTensor.

`qweight` int32 [in, out / 8]: 4-bit codes (unsigned) packed along the outputs, word slot i holding output column
AWQ_ORDER[i] of its eight; `qzeros` int32 [groups, out / 8], packed the same way; `scales` float16 [groups, out], groups
of `group_size` input rows. W = (q - zero) * scale.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpage.config.weight_quantization import WeightQuantization
from jaxpage.errors import ModelLoadError
from jaxpage.models.quantized.tensors import QuantizedTensor, block_counts, check, signed, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: the column each 4-bit slot of a word holds


def read(tensor: Callable[[str], np.ndarray], has: Callable[[str], bool], module: str, out_features: int,
         in_features: int, scheme: WeightQuantization) -> QuantizedTensor:  # fmt: skip
    if out_features % 8:
        raise ModelLoadError(f"{module}: {out_features} output features do not pack into AWQ's words of 8")
    groups = block_counts(scheme, out_features, in_features)[1]
    name = f"{module}.qweight"
    q = unpack_int32(check(name, tensor(name), (in_features, out_features // 8), "i", "qweight"), 4, 1, AWQ_ORDER)
    name = f"{module}.qzeros"
    z = unpack_int32(check(name, tensor(name), (groups, out_features // 8), "i", "qzeros"), 4, 1, AWQ_ORDER)
    name = f"{module}.scales"
    scale = check(name, tensor(name), (groups, out_features), "f", "scales")
    return QuantizedTensor(signed(q.T, 4), scale.T.astype(np.float32), signed(z.T, 4))
