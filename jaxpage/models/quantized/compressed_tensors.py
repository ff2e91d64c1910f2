"""compressed-tensors' tensors (llm-compressor's checkpoints) of one projection, as a QuantizedTensor.

pack-quantized: `weight_packed` int32 [out, ceil(in * bits / 32)], the codes plus 2^(bits-1) packed densely, lowest
bits first; `weight_scale` [out, in groups] (or [out, 1] per channel); `weight_zero_point` int32 [ceil(out * bits /
32), in groups], packed the same way along the outputs, where asymmetric; `weight_shape` [out, in]; `weight_g_idx` [in]
with actorder "group". int-quantized / naive-quantized: `weight` int8 [out, in]. float-quantized: `weight` float8_e4m3
[out, in]. Scales per tensor are [1] or []; per block [ceil(out / rows), ceil(in / cols)]; static activations add
`input_scale` ([1] or []).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpage.config.weight_quantization import WeightQuantization
from jaxpage.errors import ModelLoadError
from jaxpage.models.quantized.tensors import QuantizedTensor, block_counts, check, signed, unpack_int32


def read(tensor: Callable[[str], np.ndarray], has: Callable[[str], bool], module: str, out_features: int,
         in_features: int, scheme: WeightQuantization) -> QuantizedTensor:  # fmt: skip
    """Projection `module`'s tensors (`tensor(name)` reads one, `has(name)` says whether the checkpoint holds it)."""
    bits = scheme.bits
    blocks = block_counts(scheme, out_features, in_features)
    if scheme.weight_dtype == "int4" or has(f"{module}.weight_packed"):
        name = f"{module}.weight_packed"
        packed = check(name, tensor(name), (out_features, -(-in_features * bits // 32)), "i", "the packed weight")
        if has(f"{module}.weight_shape"):
            shape = tensor(f"{module}.weight_shape").reshape(-1).tolist()
            if shape != [out_features, in_features]:
                raise ModelLoadError(f"{module}.weight_shape: {shape}, expected {[out_features, in_features]}")
        codes = signed(unpack_int32(packed, bits, axis=1)[:, :in_features], bits)
    else:
        name = f"{module}.weight"
        kinds = "8" if scheme.weight_dtype == "float8_e4m3fn" else "i"
        codes = check(name, tensor(name), (out_features, in_features), kinds, "the quantized weight")
    scale = _scale(tensor, f"{module}.weight_scale", blocks)
    zero = None
    if not scheme.symmetric:
        name = f"{module}.weight_zero_point"
        packed = check(name, tensor(name), (-(-blocks[0] * bits // 32), blocks[1]), "i", "the packed zero points")
        zero = signed(unpack_int32(packed, bits, axis=0)[: blocks[0]], bits)
    g_idx = tensor(f"{module}.weight_g_idx") if scheme.act_order else None
    if g_idx is not None:
        g_idx = check(f"{module}.weight_g_idx", g_idx, (in_features,), "i", "g_idx").astype(np.int64)
    input_scale = _scale(tensor, f"{module}.input_scale", (1, 1)) if scheme.static_activations else None
    return QuantizedTensor(codes, scale, zero, g_idx, input_scale)


def _scale(tensor: Callable[[str], np.ndarray], name: str, blocks: tuple[int, int]) -> np.ndarray:
    """A scale tensor of `blocks` (a per-tensor one may be [1] or [])."""
    value = tensor(name)
    if blocks == (1, 1) and value.size == 1:
        value = value.reshape(1, 1)
    return check(name, value, blocks, "f", "the scale").astype(np.float32)
