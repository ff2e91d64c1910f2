"""GGUF dequantization of every tensor type jaxpage promises, checked against independent references.

The references below follow llama.cpp's `dequantize_row_*` (ggml-quants.c) block by block and never call
the gguf package's dequantizer; the gguf package only writes the test file (and quantizes where it can).
The last tests compare jaxpage's dequantizer with gguf's, bit for bit, on every supported type.
"""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest

from jaxpage.errors import ModelLoadError
from jaxpage.models import gguf_dequant
from jaxpage.models.gguf_loader import (
    SUPPORTED_TENSOR_TYPES,
    GGUFSource,
    config_from_gguf,
    load_gguf,
    open_gguf,
    unpermute_rows,
)

T = gguf.GGMLQuantizationType
D, F, H, K, HD, V = 256, 512, 4, 2, 64, 64  # hidden, intermediate, heads, kv heads, head_dim, vocab


def _blocks(raw: np.ndarray, qtype: T) -> np.ndarray:
    """Raw tensor bytes -> [num_blocks, bytes per block]."""
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian f16 fields ([n, 2] bytes) -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def ref_q8_0(raw: np.ndarray) -> np.ndarray:
    # block_q8_0 (34 bytes, 32 values): f16 d | int8 qs[32];  y = qs * d
    b = _blocks(raw, T.Q8_0)
    return _f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)


def ref_q4_0(raw: np.ndarray) -> np.ndarray:
    # block_q4_0 (18 bytes, 32 values): f16 d | qs[16];  y[j] = (lo(qs[j]) - 8) * d, y[j + 16] = (hi(qs[j]) - 8) * d
    b = _blocks(raw, T.Q4_0)
    qs = b[:, 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    return (q - 8) * _f16(b[:, :2])


def ref_q4_1(raw: np.ndarray) -> np.ndarray:
    # block_q4_1 (20 bytes, 32 values): f16 d | f16 m | qs[16];  y[j] = lo(qs[j]) * d + m, y[j + 16] = hi(qs[j]) * d + m
    b = _blocks(raw, T.Q4_1)
    qs = b[:, 4:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    return q * _f16(b[:, :2]) + _f16(b[:, 2:4])


def ref_q4_k(raw: np.ndarray) -> np.ndarray:
    # block_q4_K (144 bytes, 256 values): f16 d | f16 dmin | scales[12] | qs[128].
    # 8 sub-blocks of 32 with 6-bit scale sc and min m (get_scale_min_k4); each 32 bytes of qs hold two
    # sub-blocks, low nibbles first: y = d * sc * q - dmin * m.
    b = _blocks(raw, T.Q4_K)
    d, dmin, s, qs = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16], b[:, 16:]
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = qs.reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    y = (d * sc.astype(np.float32))[:, :, None] * q - (dmin * m.astype(np.float32))[:, :, None]
    return y.reshape(-1, 256)


def ref_q6_k(raw: np.ndarray) -> np.ndarray:
    # block_q6_K (210 bytes, 256 values): ql[128] | qh[64] | int8 scales[16] | f16 d.
    # Two halves of 128 values (64 ql, 32 qh bytes each). In a half, value 32*k + l (k < 4, l < 32) has low
    # 4 bits from ql[l] (k=0) / ql[l+32] (k=1) / their high nibbles (k=2, 3) and high 2 bits from qh[l] >> 2k;
    # value i of the block is d * scales[i // 16] * (q - 32).
    b = _blocks(raw, T.Q6_K)
    ql, qh = b[:, :128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 1, 32)
    sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _f16(b[:, 208:210])
    lo = np.concatenate([ql & 0xF, ql >> 4], axis=2)  # [blocks, half, k, l]
    hi = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = ((lo | (hi << 4)).astype(np.float32) - 32).reshape(-1, 16, 16)
    return ((d * sc)[:, :, None] * q).reshape(-1, 256)


REFERENCES = {
    T.F32: lambda raw: raw.view(np.float32),
    T.F16: lambda raw: raw.view(np.float16).astype(np.float32),
    T.BF16: lambda raw: raw.view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32),
    T.Q8_0: ref_q8_0,
    T.Q4_0: ref_q4_0,
    T.Q4_1: ref_q4_1,
    T.Q4_K: ref_q4_k,
    T.Q6_K: ref_q6_k,
}

# Each promised type on at least one tensor. GGUF names, numpy-order float shapes [rows, cols].
TENSORS = {
    "token_embd.weight": (T.Q8_0, (V, D)),
    "output_norm.weight": (T.F32, (D,)),
    "blk.0.attn_norm.weight": (T.F32, (D,)),
    "blk.0.attn_q.weight": (T.Q4_K, (H * HD, D)),
    "blk.0.attn_k.weight": (T.Q6_K, (K * HD, D)),
    "blk.0.attn_v.weight": (T.Q4_0, (K * HD, D)),
    "blk.0.attn_output.weight": (T.Q4_1, (D, H * HD)),
    "blk.0.ffn_norm.weight": (T.F32, (D,)),
    "blk.0.ffn_gate.weight": (T.F16, (F, D)),
    "blk.0.ffn_up.weight": (T.BF16, (F, D)),
    "blk.0.ffn_down.weight": (T.F32, (D, F)),
}


def _f16_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n small finite f16 scales in [0.001, 0.05], as [n, 2] bytes."""
    return rng.uniform(0.001, 0.05, n).astype("<f2").view(np.uint8).reshape(n, 2)


def _encode(rng: np.random.Generator, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    """Raw bytes [rows, bytes per row] of a random tensor of `shape` in `qtype`."""
    if qtype in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1):
        return gguf.quants.quantize(rng.normal(0.0, 0.5, shape).astype(np.float32), qtype).view(np.uint8)
    # gguf cannot quantize the others: random block bytes, with the f16 scale fields kept small and finite.
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // block_size
    b = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
    if qtype == T.Q4_K:
        b[:, 0:2], b[:, 2:4] = _f16_bytes(rng, n), _f16_bytes(rng, n)  # d, dmin
    elif qtype == T.Q6_K:
        b[:, 208:210] = _f16_bytes(rng, n)  # d
    return b.reshape(*shape[:-1], -1)


def _write_model(path, tensors: dict) -> dict[str, np.ndarray]:
    """A tiny tied-embedding llama GGUF file with `tensors`; returns the raw bytes written for each."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(H)
    writer.add_head_count_kv(K)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(V)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    raw = {}
    for name, (qtype, shape) in tensors.items():
        raw[name] = _encode(rng, qtype, shape)
        # A uint8 array with raw_dtype: the writer takes its shape as bytes per row and derives the float shape.
        writer.add_tensor(name, raw[name], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return raw


def test_every_promised_type_dequantizes_exactly(tmp_path):
    path = tmp_path / "tiny.gguf"
    raw = _write_model(path, TENSORS)
    assert {qtype for qtype, _ in TENSORS.values()} == set(REFERENCES) <= SUPPORTED_TENSOR_TYPES
    reader = gguf.GGUFReader(path)
    assert {t.name: t.tensor_type for t in reader.tensors} == {name: qtype for name, (qtype, _) in TENSORS.items()}

    ref = {name: REFERENCES[qtype](raw[name]).reshape(shape) for name, (qtype, shape) in TENSORS.items()}
    for name, values in ref.items():
        assert np.isfinite(values).all(), name

    config, params = load_gguf(path, np.float32)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (D, H, K, HD)
    assert config.tie_word_embeddings and "lm_head" not in params

    layers = params["layers"]
    expected = {
        "token_embd.weight": (params["embed_tokens"]["embedding"], ref["token_embd.weight"]),
        "output_norm.weight": (params["norm"]["scale"], ref["output_norm.weight"]),
        "blk.0.attn_norm.weight": (layers["input_norm"]["scale"][0], ref["blk.0.attn_norm.weight"]),
        "blk.0.attn_q.weight": (
            layers["attn"]["q_proj"]["kernel"][0],
            unpermute_rows(ref["blk.0.attn_q.weight"], H).T.reshape(D, H, HD),
        ),
        "blk.0.attn_k.weight": (
            layers["attn"]["k_proj"]["kernel"][0],
            unpermute_rows(ref["blk.0.attn_k.weight"], K).T.reshape(D, K, HD),
        ),
        "blk.0.attn_v.weight": (layers["attn"]["v_proj"]["kernel"][0], ref["blk.0.attn_v.weight"].T.reshape(D, K, HD)),
        "blk.0.attn_output.weight": (
            layers["attn"]["o_proj"]["kernel"][0],
            ref["blk.0.attn_output.weight"].T.reshape(H, HD, D),
        ),
        "blk.0.ffn_norm.weight": (layers["post_attention_norm"]["scale"][0], ref["blk.0.ffn_norm.weight"]),
        "blk.0.ffn_gate.weight": (layers["mlp"]["gate_proj"]["kernel"][0], ref["blk.0.ffn_gate.weight"].T),
        "blk.0.ffn_up.weight": (layers["mlp"]["up_proj"]["kernel"][0], ref["blk.0.ffn_up.weight"].T),
        "blk.0.ffn_down.weight": (layers["mlp"]["down_proj"]["kernel"][0], ref["blk.0.ffn_down.weight"].T),
    }
    assert set(expected) == set(TENSORS)
    for name, (got, want) in expected.items():
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got, want, err_msg=f"{name} ({TENSORS[name][0].name})")


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.TQ1_0])
def test_unsupported_type_is_refused_by_name(tmp_path, qtype):
    assert qtype not in SUPPORTED_TENSOR_TYPES
    path = tmp_path / "unsupported.gguf"
    _write_model(path, {**TENSORS, "blk.0.attn_v.weight": (qtype, (K * HD, D))})
    with pytest.raises(ModelLoadError) as e:
        load_gguf(path, np.float32)
    assert "'blk.0.attn_v.weight'" in str(e.value) and qtype.name in str(e.value)


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)  # NaN payloads aside, every bit agrees (the sign of zero included)
    np.testing.assert_array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])


@pytest.mark.parametrize("chunk_values", [300, 4096, gguf_dequant.CHUNK_VALUES])  # ragged chunks, and the default
@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TENSOR_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_dequantize_equals_gguf_bit_for_bit(monkeypatch, qtype, chunk_values):
    """Random bytes (NaN and infinite scales too) in both layouts, with chunks that split the tensor unevenly."""
    monkeypatch.setattr(gguf_dequant, "CHUNK_VALUES", chunk_values)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 37, 3 * max(block_size, 256)
    rng = np.random.default_rng(qtype.value)
    data = rng.integers(0, 256, rows * cols // block_size * type_size, dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = gguf.quants.dequantize(data.reshape(rows, -1), qtype).astype(np.float32).reshape(rows, cols)
        got = gguf_dequant.dequantize(data, qtype, (rows, cols))
        order = rng.permutation(rows)
        transposed = gguf_dequant.dequantize_transposed(data, qtype, (rows, cols), order)
        flat = gguf_dequant.dequantize(data, qtype, (rows * cols,))
    _same_bits(got, want)
    _same_bits(flat, want.reshape(-1))
    assert transposed.flags.c_contiguous
    _same_bits(transposed.T, want[order])


def test_linear_weights_come_back_in_the_layout_the_model_keeps(tmp_path):
    """[out, in] weights are transposes of C-contiguous [in, out] arrays: the loader's own transpose copies nothing."""
    path = tmp_path / "tiny.gguf"
    _write_model(path, TENSORS)
    gguf_file = open_gguf(path)
    source = GGUFSource(gguf_file, config_from_gguf(gguf_file, path), path)
    q = source.get("model.layers.0.self_attn.q_proj.weight")
    assert q.shape == (H * HD, D) and q.T.flags.c_contiguous
    embedding = source.get("model.embed_tokens.weight")
    assert embedding.shape == (V, D) and embedding.flags.c_contiguous
