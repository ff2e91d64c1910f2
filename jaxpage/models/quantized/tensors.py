"""One quantized projection's tensors, whatever format wrote them, in torch layout: codes [out, in], a scale per block.

W[out, in] = (codes - zero) * scale, with scale and zero per block of `block` = (input rows, output columns) of the
WeightQuantization (jaxpage.config.weight_quantization), broadcast over [out, in]. The readers check every tensor's
shape and dtype against the projection and name the tensor when one is wrong; `parameters` turns the result into the
layer's parameters (jaxpage.models.quantized.dense): codes [in, out] as stored, act-order rows made contiguous.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from jaxpage.config.weight_quantization import WeightQuantization
from jaxpage.errors import ModelLoadError

# The codes' dtype in a checkpoint's parameters, and on the host as they load (int4 one to an int8 there:
# jaxpage.models.quantized.dense.code_dtype gives the device's)
CODE_DTYPES = {"int4": ml_dtypes.int4, "int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
HOST_CODE_DTYPES = CODE_DTYPES | {"int4": np.int8}


@dataclasses.dataclass
class QuantizedTensor:
    codes: np.ndarray  # [out, in]: int8 holding int4 or int8 values (signed), or float8_e4m3fn
    scale: np.ndarray  # float32 [out blocks, in blocks]
    zero: np.ndarray | None  # int8 [out blocks, in blocks] (signed, as codes), None when symmetric
    g_idx: np.ndarray | None = None  # int [in]: each input row's group (act order), None when rows // group
    input_scale: np.ndarray | None = None  # float32 []: the activations' static scale


def block_counts(scheme: WeightQuantization, out_features: int, in_features: int) -> tuple[int, int]:
    """(output blocks, input blocks) of a [out, in] weight: the shape of its scale in torch layout."""
    rows, cols = scheme.block
    return (1 if cols == 0 else -(-out_features // cols)), (1 if rows == 0 else -(-in_features // rows))


def check(name: str, array: np.ndarray, shape: tuple[int, ...], kinds: str, what: str) -> np.ndarray:
    """`array` (tensor `name`) of `shape` and a dtype of `kinds`: "i" integers, "f" floats (bfloat16 included), "8"
    float8_e4m3fn; else ModelLoadError."""
    if tuple(array.shape) != tuple(shape):
        raise ModelLoadError(f"{name}: {what} has shape {tuple(array.shape)}, expected {tuple(shape)}")
    kind = {np.dtype(ml_dtypes.bfloat16): "f", np.dtype(ml_dtypes.float8_e4m3fn): "8"}.get(
        array.dtype, array.dtype.kind
    )
    if kind not in kinds:
        names = {"i": "integers", "f": "floats", "8": "float8_e4m3fn"}
        raise ModelLoadError(f"{name}: {what} has dtype {array.dtype}, expected {' or '.join(names[k] for k in kinds)}")
    return array


def unpack_int32(packed: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Unsigned `bits`-bit values packed into int32 words along `axis`, the lowest bits first (or word slot i holding
    value order[i]: AWQ's interleave), as int32 with that axis 32 // bits times longer."""
    per_word = 32 // bits
    words = np.moveaxis(packed.astype(np.int64) & 0xFFFFFFFF, axis, -1)
    shifts = np.arange(per_word, dtype=np.int64) * bits
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)  # [..., words, slot]
    if order is not None:
        values = values[..., np.argsort(order)]
    values = values.reshape(*words.shape[:-1], words.shape[-1] * per_word)
    return np.moveaxis(values, -1, axis).astype(np.int32)


def signed(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes (offset by 2^(bits-1), as every format stores them) as signed int8."""
    return (values.astype(np.int32) - (1 << (bits - 1))).astype(np.int8)


def parameters(q: QuantizedTensor, scheme: WeightQuantization, name: str) -> dict[str, np.ndarray]:
    """The layer's parameters (jaxpage.models.quantized.dense.QuantizedDense) of one projection: qweight [in, out]
    (int8 holding int4 or int8 codes, or float8_e4m3fn; dense.with_device_codes gives them the device's dtype),
    qscale [in blocks, out blocks] float32, and qzero (int8, same shape) where asymmetric, qperm [in] int32 with act
    order (the input rows in group order: qweight's row r is input row qperm[r]), input_scale [] with static
    activations."""
    codes = q.codes
    if scheme.weight_dtype != "float8_e4m3fn":
        low, high = -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1
        if codes.size and (codes.min() < low or codes.max() > high):
            raise ModelLoadError(f"{name}: codes outside [{low}, {high}] for {scheme.bits}-bit weights")
    params = {"qweight": codes.T.astype(HOST_CODE_DTYPES[scheme.weight_dtype]), "qscale": q.scale.T.astype(np.float32)}
    if not scheme.symmetric:
        params["qzero"] = q.zero.T.astype(np.int8)
    if scheme.act_order:  # the input rows in group order, so that each group's rows are contiguous
        params["qperm"] = _group_order(q.g_idx, scheme.block[0], name)
        params["qweight"] = params["qweight"][params["qperm"]]
    elif q.g_idx is not None and not np.array_equal(q.g_idx, np.arange(len(q.g_idx)) // max(scheme.block[0], 1)):
        if scheme.block[0] != 0:
            raise ModelLoadError(f"{name}: g_idx is not input row // group size, and the checkpoint has no act order")
    if scheme.static_activations:
        params["input_scale"] = np.asarray(q.input_scale, np.float32).reshape(())
    return params


def _group_order(g_idx: np.ndarray | None, group: int, name: str) -> np.ndarray:
    """The input rows ordered by group (stable): rows of group g at g*group ... (g+1)*group - 1 of the permuted
    input, so the groups are contiguous. ModelLoadError unless every group but the last has `group` rows."""
    if g_idx is None:
        raise ModelLoadError(f"{name}: act order without g_idx")
    in_features = len(g_idx)
    groups = math.ceil(in_features / group)
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ModelLoadError(f"{name}: g_idx outside [0, {groups})")
    sizes = np.bincount(g_idx, minlength=groups)
    expected = np.full(groups, group)
    expected[-1] = in_features - group * (groups - 1)
    if not np.array_equal(sizes, expected):
        raise ModelLoadError(f"{name}: g_idx does not give each group {group} input rows")
    return np.argsort(g_idx, kind="stable").astype(np.int32)
