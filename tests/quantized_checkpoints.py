"""Tiny pre-quantized checkpoints for the tests of jaxpage.models.quantized, written from the formats' specifications
in numpy (AWQ, GPTQ, block-wise FP8) or by compressed-tensors itself (compressed_tensors_checkpoint, which imports
torch), each beside its reference: the same model with the dequantized weights in float32, which transformers and
jaxpage load as any float checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_groups(w: np.ndarray, bits: int, groups: np.ndarray, n_groups: int, symmetric: bool, min_zero: int = 0):
    """Round-to-nearest of w [out, in] with a scale (and zero point, at least min_zero) per output row and input group
    (`groups`[in]: each input's group): (unsigned codes [out, in], scale [out, groups] float16-exact, unsigned zero
    [out, groups])."""
    top = (1 << bits) - 1
    scale = np.zeros((w.shape[0], n_groups), np.float32)
    zero = np.zeros((w.shape[0], n_groups), np.int64)
    for g in range(n_groups):
        cols = w[:, groups == g]
        if symmetric:
            scale[:, g] = np.abs(cols).max(axis=1) / ((top + 1) // 2 - 1 + 0.5)
            zero[:, g] = (top + 1) // 2
        else:
            low, high = np.minimum(cols.min(axis=1), 0), np.maximum(cols.max(axis=1), 0)
            scale[:, g] = (high - low) / top
            zero[:, g] = np.clip(np.rint(-low / np.maximum(scale[:, g], 1e-8)), min_zero, top)
    scale = np.maximum(scale, 1e-4).astype(np.float16).astype(np.float32)
    codes = np.clip(np.rint(w / scale[:, groups]) + zero[:, groups], 0, top).astype(np.int64)
    return codes, scale, zero


def pack(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Unsigned values packed into int32 words along `axis`, lowest bits first (word slot i: value order[i])."""
    per_word = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per_word)
    if order is not None:
        v = v[..., list(order)]
    words = np.zeros(v.shape[:-1], np.uint32)
    for i in range(per_word):
        words |= v[..., i] << np.uint32(bits * i)
    return np.moveaxis(words.view(np.int32), -1, axis)


def _rewrite(src: Path, quantized: Path, reference: Path, hf_quant: dict, projection_tensors) -> tuple[Path, Path]:
    """Writes `quantized` (src's model with each projection's tensors from projection_tensors(name, weight) ->
    (tensors, dequantized weight)) and `reference` (src's with the dequantized weights)."""
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    out, ref = {}, dict(tensors)
    for name, value in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split("layers.", 1)[-1].split(".", 1)[-1] in PROJECTIONS:
            parts, dequantized = projection_tensors(module, value)
            out |= {key: np.ascontiguousarray(part) for key, part in parts.items()}  # save_file ignores strides
            ref[name] = dequantized.astype(np.float32)
        else:
            out[name] = value
    for directory, weights, extra in ((quantized, out, {"quantization_config": hf_quant}), (reference, ref, {})):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config | extra, indent=2))
        for file in src.iterdir():
            if file.name not in ("model.safetensors", "config.json"):
                shutil.copy(file, directory / file.name)
    return quantized, reference


def awq_checkpoint(src: Path, tmp: Path, group: int = 32) -> tuple[Path, Path]:
    """AutoAWQ's GEMM checkpoint of the float model at `src` (4-bit, zero points), and its dequantized reference."""

    def tensors(module, w):
        groups = np.arange(w.shape[1]) // group
        codes, scale, zero = quantize_groups(w, 4, groups, groups.max() + 1, symmetric=False)
        parts = {
            f"{module}.qweight": pack(codes.T, 4, 1, AWQ_ORDER),
            f"{module}.qzeros": pack(zero.T, 4, 1, AWQ_ORDER),
            f"{module}.scales": scale.T.astype(np.float16),
        }
        return parts, (codes - zero[:, groups]) * scale[:, groups]

    settings = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _rewrite(src, tmp / "awq", tmp / "awq-reference", settings, tensors)


def gptq_checkpoint(
    src: Path, tmp: Path, bits: int = 4, group: int = 32, desc_act: bool = False, sym: bool = True
) -> tuple[Path, Path]:
    """A GPTQ checkpoint (the original "gptq" format: zero points stored less 1) of the float model at `src`, with
    desc_act's g_idx a random permutation's groups, and its dequantized reference."""
    rng = np.random.default_rng(7)

    def tensors(module, w):
        k = w.shape[1]
        order = rng.permutation(k) if desc_act else np.arange(k)
        groups = np.empty(k, np.int64)
        groups[order] = np.arange(k) // group if group > 0 else 0  # group_size -1: one group, per output channel
        n_groups = -(-k // group) if group > 0 else 1
        # the original format stores zero - 1, so a zero point of 0 would wrap: GPTQ's writers avoid it as well
        codes, scale, zero = quantize_groups(w, bits, groups, n_groups, symmetric=sym, min_zero=1)
        parts = {
            f"{module}.qweight": pack(codes.T, bits, 0),
            f"{module}.qzeros": pack(zero.T - 1, bits, 1),
            f"{module}.scales": scale.T.astype(np.float16),
            f"{module}.g_idx": groups.astype(np.int32),
        }
        return parts, (codes - zero[:, groups]) * scale[:, groups]

    settings = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym}
    return _rewrite(src, tmp / "gptq", tmp / "gptq-reference", settings, tensors)


def fp8_block_checkpoint(src: Path, tmp: Path, block: tuple[int, int] = (32, 32)) -> tuple[Path, Path]:
    """A block-wise FP8 checkpoint (quant_method fp8, weight_block_size [out rows, in cols]) and its reference."""
    rows, cols = block

    def tensors(module, w):
        n, k = w.shape
        gn, gk = -(-n // rows), -(-k // cols)
        padded = np.zeros((gn * rows, gk * cols), np.float32)
        padded[:n, :k] = w
        top = np.abs(padded.reshape(gn, rows, gk, cols)).max(axis=(1, 3))
        scale = np.maximum(top, 1e-6) / 448.0
        full = np.repeat(np.repeat(scale, rows, 0), cols, 1)[:n, :k]
        codes = (w / full).astype(ml_dtypes.float8_e4m3fn)
        parts = {f"{module}.weight": codes, f"{module}.weight_scale_inv": scale.astype(np.float32)}
        return parts, codes.astype(np.float32) * full

    settings = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    return _rewrite(src, tmp / "fp8", tmp / "fp8-reference", settings, tensors)


def compressed_tensors_checkpoint(src: Path, directory: Path, fmt: str, weights: dict, input_activations=None,
                                  tokens=(1, 2, 3), ignore=("lm_head",)) -> tuple[Path, np.ndarray]:  # fmt: skip
    """compressed-tensors' own checkpoint of the float model at `src`: its quantization config applied to
    transformers' model, each weight's scale and zero point from its min and max (round to nearest), compressed in
    `fmt` and saved by save_pretrained; static activation scales from the absmax of a forward pass's inputs. Returns
    the directory and compressed-tensors' own logits for `tokens` (its quantized forward: the weights, and the
    activations where the scheme quantizes them, quantized and dequantized)."""
    import torch
    import transformers
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    activations = None if input_activations is None else QuantizationArgs(**input_activations)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights), input_activations=activations)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    quantized = [module for module in model.modules() if hasattr(module, "weight_scale")]
    for module in quantized:  # calibrate on the float model
        module.quantization_enabled = False
    absmax: dict[str, float] = {}
    hooks = [
        module.register_forward_pre_hook(lambda m, args, name=name: absmax.__setitem__(name, args[0].abs().max()))
        for name, module in model.named_modules()
        if hasattr(module, "weight_scale")
    ]
    with torch.no_grad():
        model(torch.arange(1, 17)[None] % model.config.vocab_size)
    for hook in hooks:
        hook.remove()
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        args = module.quantization_scheme.weights
        w = module.weight.data
        if args.strategy == "group":  # the last group shorter where group_size does not divide the inputs
            chunks = torch.split(w, args.group_size, dim=1)
            low = torch.stack([c.amin(1) for c in chunks], 1)
            high = torch.stack([c.amax(1) for c in chunks], 1)
        elif args.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            low, high = w.min(), w.max()
        scale, zero = calculate_qparams(low, high, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                module.weight_zero_point.shape
            )
        if hasattr(module, "input_scale"):
            top = 127.0 if module.quantization_scheme.input_activations.type == "int" else 448.0
            module.input_scale.data = (
                (absmax[name] / top).reshape(module.input_scale.shape).to(module.input_scale.dtype)
            )
    for module in quantized:
        module.quantization_enabled = True
    with torch.no_grad():  # compressed-tensors' own forward: weights and activations quantized and dequantized
        logits = model(torch.tensor([tokens])).logits[0].float().numpy()
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(directory))
    compressor.update_config(str(directory))
    return directory, logits
