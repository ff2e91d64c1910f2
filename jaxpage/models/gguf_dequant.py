"""Dequantizes GGUF tensors to float32 with whole-tensor numpy operations, equal bit for bit to `gguf.quants`.

A quantized tensor is a sequence of blocks; each block holds `block_size` consecutive values of a row as packed
integers and float16 scales (layouts after llama.cpp's `dequantize_row_*` in ggml-quants.c, in each kernel's
comment). The kernels write a block's values along the first axis of `out` ([block_size, ...blocks]), so that every
numpy operation runs over many blocks at once with long inner loops, and the same kernel serves two layouts:

- `dequantize`: the tensor as stored, rows of values ([rows, row length]).
- `dequantize_transposed`: the 2-D transpose [row length, rows], which is how the model keeps a linear layer
  ([in, out]). A block's values then run down a column, and numpy's inner loops along a row go through the same
  value of many blocks: the fastest layout, and no separate transpose of the float values is needed.

Work goes in chunks of about CHUNK_VALUES values so that temporaries stay in cache.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
CHUNK_VALUES = 1 << 18


def _bytes(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bytes [start, stop) of every block, byte index first: [stop - start, ...] uint8 (a view)."""
    return np.moveaxis(blocks[..., start:stop], -1, 0)


def _f16(blocks: np.ndarray, offset: int, like: np.ndarray) -> np.ndarray:
    """The float16 field at byte `offset` of every block, as float32 laid out like `like` ([...])."""
    field = np.empty_like(like, dtype=np.float32)
    np.copyto(field, blocks[..., offset : offset + 2].view("<f2")[..., 0])
    return field


def _split(a: np.ndarray, *shape: int) -> np.ndarray:
    """`a` with its first axis split into `shape`: a view (splitting one axis never copies), so writes land in `a`."""
    view = a.reshape(*shape, *a.shape[1:])
    assert np.may_share_memory(view, a), "a split that copied"
    return view


def _nibbles(qs: np.ndarray, out: np.ndarray) -> None:
    """out[:k] = low nibbles of qs [k, ...], out[k:] = high nibbles (the values of 4-bit blocks, in order)."""
    k = qs.shape[0]
    packed = np.empty_like(out[:k], dtype=np.uint8)
    np.copyto(packed, qs)  # gathered into out's memory order once, so that both passes below run over matching layouts
    np.bitwise_and(packed, 15, out=out[:k])
    np.right_shift(packed, 4, out=out[k:])


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q8_0 (34 bytes, 32 values): f16 d | int8 qs[32];  y = qs * d
    np.multiply(_bytes(blocks, 2, 34).view(np.int8), _f16(blocks, 0, out[0]), out=out)


def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q4_0 (18 bytes, 32 values): f16 d | qs[16];  y[j] = (lo(qs[j]) - 8) * d, y[j + 16] = (hi(qs[j]) - 8) * d
    _nibbles(_bytes(blocks, 2, 18), out)
    np.subtract(out, 8, out=out)
    np.multiply(out, _f16(blocks, 0, out[0]), out=out)


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q4_1 (20 bytes, 32 values): f16 d | f16 m | qs[16];  y[j] = lo(qs[j]) * d + m, y[j + 16] = hi(...) * d + m
    _nibbles(_bytes(blocks, 4, 20), out)
    np.multiply(out, _f16(blocks, 0, out[0]), out=out)
    np.add(out, _f16(blocks, 2, out[0]), out=out)


def _five_bits(qh: np.ndarray, qs: np.ndarray, out: np.ndarray) -> None:
    """Q5_0/Q5_1 values: low nibbles as Q4_0, fifth bit j of value j from the 32-bit qh (little-endian)."""
    q = np.empty_like(out, dtype=np.uint8)
    _nibbles(qs, q)
    q |= np.unpackbits(qh, axis=0, bitorder="little") << 4
    np.copyto(out, q)


def _q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q5_0 (22 bytes, 32 values): f16 d | qh[4] | qs[16];  y = (q - 16) * d, q = nibble | fifth bit << 4
    _five_bits(_bytes(blocks, 2, 6), _bytes(blocks, 6, 22), out)
    np.subtract(out, 16, out=out)
    np.multiply(out, _f16(blocks, 0, out[0]), out=out)


def _q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q5_1 (24 bytes, 32 values): f16 d | f16 m | qh[4] | qs[16];  y = q * d + m
    _five_bits(_bytes(blocks, 4, 8), _bytes(blocks, 8, 24), out)
    np.multiply(out, _f16(blocks, 0, out[0]), out=out)
    np.add(out, _f16(blocks, 2, out[0]), out=out)


def _q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q2_K (84 bytes, 256 values): scales[16] | qs[64] | f16 d | f16 dmin. Value 128h + 32t + l (h < 2, t < 4,
    # l < 32) is q = (qs[32h + l] >> 2t) & 3; value i is d * (scales[i // 16] & 15) * q - dmin * (scales[i // 16] >> 4).
    scales, qs = _bytes(blocks, 0, 16), _split(_bytes(blocks, 16, 80), 2, 32)
    o = _split(out, 2, 4, 32)
    for t in range(4):
        np.bitwise_and(qs >> (2 * t), 3, out=o[:, t])
    o = _split(out, 16, 16)
    o *= (_f16(blocks, 80, out[0]) * (scales & 15))[:, None]
    o -= (_f16(blocks, 82, out[0]) * (scales >> 4))[:, None]


def _q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q3_K (110 bytes, 256 values): hmask[32] | qs[64] | scales[12] | f16 d. Value i = 128h + 32t + l has
    # low bits (qs[32h + l] >> 2t) & 3, minus 4 where bit i // 32 of hmask[l] is clear. 16 6-bit scales, each
    # minus 32: scale j has low bits (scales[j % 8] >> 4(j // 8)) & 15, high bits (scales[8 + j % 4] >> 2(j // 4)) & 3;
    # value i is d * scale[i // 16] * q.
    hmask, qs, packed = _bytes(blocks, 0, 32), _split(_bytes(blocks, 32, 96), 2, 32), _bytes(blocks, 96, 108)
    low = np.concatenate([packed[:8] & 15, packed[:8] >> 4])
    high = np.concatenate([(packed[8:] >> (2 * a)) & 3 for a in range(4)])
    scales = (low | (high << 4)).astype(np.float32) - 32
    q = np.empty_like(out, dtype=np.int8)
    qv = _split(q, 2, 4, 32)
    for t in range(4):
        np.bitwise_and(qs >> (2 * t), 3, out=qv[:, t], casting="unsafe")
    qv = _split(q, 8, 32)
    for u in range(8):
        qv[u] -= (((hmask >> u) & 1) ^ 1).astype(np.int8) << 2
    np.copyto(out, q)
    _split(out, 16, 16)[...] *= (_f16(blocks, 108, out[0]) * scales)[:, None]


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit scales and mins of a Q4_K/Q5_K block from its 12 packed bytes ([12, ...] -> two [8, ...])."""
    d, m, md = packed[0:4], packed[4:8], packed[8:12]
    scales = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 0x30)])
    mins = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 0x30)])
    return scales, mins


def _k_scale(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_K/Q5_K: value i = d * scale[i // 32] * q - dmin * min[i // 32], with q already in `out`."""
    scales, mins = _scale_min_k4(_bytes(blocks, 4, 16))
    o = _split(out, 8, 32)
    o *= (_f16(blocks, 0, out[0]) * scales)[:, None]
    o -= (_f16(blocks, 2, out[0]) * mins)[:, None]


def _q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q4_K (144 bytes, 256 values): f16 d | f16 dmin | scales[12] | qs[128]. Value 64g + 32h + l is
    # nibble h of qs[32g + l].
    qs, o = _split(_bytes(blocks, 16, 144), 4, 32), _split(out, 4, 2, 32)
    np.bitwise_and(qs, 15, out=o[:, 0])
    np.right_shift(qs, 4, out=o[:, 1])
    _k_scale(blocks, out)


def _q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q5_K (176 bytes, 256 values): f16 d | f16 dmin | scales[12] | qh[32] | qs[128]. As Q4_K, plus a fifth
    # bit for value 32u + l: bit u of qh[l].
    qh, qs = _bytes(blocks, 16, 48), _split(_bytes(blocks, 48, 176), 4, 32)
    q = np.empty_like(out, dtype=np.uint8)
    qv = _split(q, 4, 2, 32)
    np.bitwise_and(qs, 15, out=qv[:, 0])
    np.right_shift(qs, 4, out=qv[:, 1])
    qv = _split(q, 8, 32)
    for u in range(8):
        qv[u] |= ((qh >> u) & 1) << 4
    np.copyto(out, q)
    _k_scale(blocks, out)


def _q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # block_q6_K (210 bytes, 256 values): ql[128] | qh[64] | int8 scales[16] | f16 d. Value 128h + 64s + k has
    # low bits nibble s of ql[64h + k]; value 128h + 32t + l has high bits (qh[32h + l] >> 2t) & 3; value i is
    # d * scales[i // 16] * (q - 32).
    ql, qh = _split(_bytes(blocks, 0, 128), 2, 64), _split(_bytes(blocks, 128, 192), 2, 32)
    q = np.empty_like(out, dtype=np.uint8)
    qv = _split(q, 2, 2, 64)
    np.bitwise_and(ql, 15, out=qv[:, 0])
    np.right_shift(ql, 4, out=qv[:, 1])
    qv = _split(q, 2, 4, 32)
    for t in range(4):
        qv[:, t] |= ((qh >> (2 * t)) & 3) << 4
    np.subtract(q, 32, out=out, dtype=np.float32)
    scales = _bytes(blocks, 192, 208).view(np.int8)
    _split(out, 16, 16)[...] *= (_f16(blocks, 208, out[0]) * scales)[:, None]


KERNELS: dict[GGMLQuantizationType, Callable[[np.ndarray, np.ndarray], None]] = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED_TYPES = frozenset((*FLOAT_TYPES, *KERNELS))


def _floats(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """[n] float32 from the bytes of an F32 (a view, not a copy), F16 or BF16 tensor."""
    if qtype == T.F32:
        return data.view("<f4")
    if qtype == T.F16:
        return data.view("<f2").astype(np.float32)
    return (data.view("<u2").astype(np.uint32) << 16).view(np.float32)  # bf16: the top half of a float32


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values [shape] of a tensor's bytes (data: [n_bytes] uint8; shape: numpy order, row length last).

    An F32 tensor comes back as a view of `data`; every other type as a new array.
    """
    if qtype in FLOAT_TYPES:
        return _floats(data, qtype).reshape(shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(-1, type_size)
    values = np.empty((blocks.shape[0], block_size), np.float32)
    step = max(1, CHUNK_VALUES // block_size)
    for start in range(0, blocks.shape[0], step):
        KERNELS[qtype](blocks[start : start + step], values[start : start + step].T)
    return values.reshape(shape)


def dequantize_transposed(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int], row_order: np.ndarray | None = None
) -> np.ndarray:
    """The transpose [cols, rows] (C-contiguous float32) of a 2-D tensor [rows, cols] stored in `data`.

    row_order: [rows] int, optional: row i of the result's transpose is stored row row_order[i] (a permutation,
    applied to the bytes before dequantizing).
    """
    rows, cols = shape
    if qtype in FLOAT_TYPES:
        values = _floats(data, qtype).reshape(shape)
        return np.ascontiguousarray((values if row_order is None else values[row_order]).T)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    per_row = cols // block_size
    stored = data.reshape(rows, per_row, type_size)
    if row_order is not None:
        stored = stored[row_order]
    blocks = stored.transpose(1, 0, 2)  # [per_row, rows, type_size]
    transposed = np.empty((cols, rows), np.float32)
    out = transposed.reshape(per_row, block_size, rows).transpose(1, 0, 2)  # [block_size, per_row, rows]
    # Chunks of whole block columns (row segments of `transposed`, contiguous), of rows only when one is too long.
    row_step = min(rows, max(1, CHUNK_VALUES // block_size))
    column_step = max(1, CHUNK_VALUES // (block_size * row_step))
    for column in range(0, per_row, column_step):
        for row in range(0, rows, row_step):
            chunk = (slice(column, column + column_step), slice(row, row + row_step))
            KERNELS[qtype](blocks[chunk], out[(slice(None), *chunk)])
    return transposed
