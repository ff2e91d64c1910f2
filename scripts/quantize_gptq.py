"""GPTQ-calibrated pre-quantized checkpoints of a float model, for bench_quantization.py's NAME=PATH modes.

    python scripts/quantize_gptq.py --out DIR [--model FLOAT_HF_DIR] [--schemes w4a16-g128,fp8-channel] [--rtn]
        [--calibration generated|pydoc] [--samples 64] [--seq-len 512] [--damp 0.01]

Writes DIR/SCHEME for each scheme, a checkpoint as the formats' tools publish them:
  w4a16-gG     GPTQ format (quant_method "gptq"): 4-bit codes with a zero point and a float16 scale per output
               channel and group of G inputs (the last group shorter where G does not divide the inputs: SmolLM2's 576
               is 4.5 groups of 128, which compressed-tensors and vLLM's GPTQ refuse)
  fp8-channel  compressed-tensors "float-quantized": FP8 E4M3 weights, a float32 scale per output channel (its absmax
               over 448), activations left in floats
Every decoder projection is quantized; the embedding (and a tied LM head) stay in floats, as those tools leave them.
Calibration: GPTQ (Frantar et al., 2022) per projection, columns quantized in order with each one's rounding error
spread over the columns not yet quantized (without groups, the columns of the largest inputs first), weighted by the
inverse Hessian of the projection's inputs: X^T X over the float model's forward pass of --samples windows of
--seq-len tokens, text the model samples itself from a random first token ("generated", LLM-QAT's data-free
calibration) or Python's reference documentation ("pydoc", pydoc_data.topics); neither is the benchmark's text. --rtn
rounds each weight to nearest instead. On SmolLM2, GPTQ helps FP8 (perplexity +0.7% against +2.3% round to nearest)
and hurts 4-bit groups (README, "Pre-quantized checkpoints").
Without --model: the default model (SmolLM2-135M-Instruct), its GGUF read by transformers, written in float32 to
DIR/float first (the float32 mode of the benchmark reads the same weights from the GGUF).
Needs the test extras (torch, transformers); jaxpage itself never imports torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # the Hessian of the same input
FP8_MAX = 448.0


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model", type=Path, default=None, help="a float Hugging Face directory (default: SmolLM2)")
    parser.add_argument("--schemes", default="w4a16-g128,fp8-channel")
    parser.add_argument("--rtn", action="store_true", help="round to nearest, no calibration")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--calibration", choices=("generated", "pydoc"), default="generated")
    parser.add_argument("--damp", type=float, default=0.01, help="GPTQ's dampening, a share of the mean diagonal")
    return parser.parse_args()


def float_model(out: Path) -> Path:
    """The default model in float32 at out/float (transformers' dequantization of its GGUF)."""
    import torch
    import transformers

    from jaxpage.models.default_model import default_model_path

    gguf = default_model_path()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.config.quantization_config = None
    model.save_pretrained(out / "float")
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out / "float")
    config = json.loads((out / "float" / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "float" / "config.json").write_text(json.dumps(config, indent=2))
    return out / "float"


def generated(model, samples: int, seq_len: int, batch: int = 32):
    """The model's own text: each window sampled (temperature 1) from one random first token."""
    import torch

    torch.manual_seed(0)
    windows = []
    for start in range(0, samples, batch):
        first = torch.randint(0, model.config.vocab_size, (min(batch, samples - start), 1))
        out = model.generate(
            first,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_length=seq_len,
            min_length=seq_len,
            attention_mask=torch.ones_like(first),
        )
        windows.append(out)
    return torch.cat(windows)


def hessians(model, tokenizer, samples: int, seq_len: int, calibration: str) -> dict:
    """X^T X of each projection's input over the calibration windows, keyed by module name (one per shared input)."""
    import pydoc_data.topics

    import torch

    if calibration == "generated":
        windows = generated(model, samples, seq_len)
    else:
        text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
        windows = torch.tensor(tokenizer(text).input_ids)[: samples * seq_len].reshape(-1, seq_len)
    print(f"calibration: {windows.shape[0]} windows of {seq_len} tokens ({calibration})", file=sys.stderr)
    sums: dict = {}

    def hook(module, args, name):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        sums[name] = sums.get(name, 0) + x.T @ x

    handles = [
        module.register_forward_pre_hook(lambda m, args, name=name: hook(m, args, name))
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in PROJECTIONS and name.rsplit(".", 1)[-1] not in SHARED_INPUT
    ]
    with torch.no_grad():
        for window in windows:
            model(window[None])
    for handle in handles:
        handle.remove()
    return sums


class Int4Groups:
    """GPTQ's asymmetric quantizer: per output channel and group of `group` inputs, scale (max - min) / 15 over the
    group's weights and 0 (float16, as stored), zero point round(-min / scale) in [1, 15] (the GPTQ format stores it
    less 1)."""

    def __init__(self, n: int, k: int, group: int):
        self.group = group
        self.groups = -(-k // group)
        self.scale = np.zeros((n, self.groups), np.float32)
        self.zero = np.zeros((n, self.groups), np.int64)
        self.codes = np.zeros((n, k), np.int64)

    def fit(self, cols, start: int) -> None:
        import torch

        low, high = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-5).half().float()
        self.scale[:, start // self.group] = scale.numpy()
        self.zero[:, start // self.group] = torch.round(-low / scale).clamp(1, 15).numpy()

    def quantize(self, col, index: int):
        import torch

        scale = torch.from_numpy(self.scale[:, index // self.group])
        zero = torch.from_numpy(self.zero[:, index // self.group]).float()
        codes = torch.clamp(torch.round(col / scale) + zero, 0, 15)
        self.codes[:, index] = codes.numpy()
        return (codes - zero) * scale


class FP8Channel:
    """FP8 E4M3 codes with a float32 scale per output channel: its absmax over the largest code."""

    group = None  # fitted once, on the whole weight, before GPTQ

    def __init__(self, n: int, k: int):
        self.scale = np.zeros((n, 1), np.float32)
        self.codes = np.zeros((n, k), np.float32)

    def fit(self, cols, start: int) -> None:
        self.scale[:, 0] = (cols.abs().max(1).values.clamp(min=1e-12) / FP8_MAX).numpy()

    def quantize(self, col, index: int):
        import torch

        scale = torch.from_numpy(self.scale[:, 0])
        codes = (col / scale).to(torch.float8_e4m3fn).float()
        self.codes[:, index] = codes.numpy()
        return codes * scale


def gptq(weight, hessian, quantizer, block: int, damp: float) -> None:
    """Quantizes weight [out, in] column by column into `quantizer` (Frantar et al., 2022, Algorithm 1 with lazy
    batches of `block` columns); hessian None rounds to nearest."""
    import torch

    w = weight.clone().double()
    k = w.shape[1]
    if hessian is None:
        for start in range(0, k, quantizer.group) if quantizer.group else ():
            quantizer.fit(w[:, start : start + quantizer.group].float(), start)
        for i in range(k):
            quantizer.quantize(w[:, i].float(), i)
        return
    h = hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    # without groups, the columns in the order of their inputs' energy, largest first ("act order"): the columns
    # quantized last have the fewest left to take their error
    order = torch.arange(k) if quantizer.group else torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, errors, inv1 = w[:, i1:i2].clone(), torch.zeros_like(w[:, i1:i2]), inverse[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if quantizer.group and (i1 + i) % quantizer.group == 0:
                quantizer.fit(w1[:, i : i + quantizer.group].float(), i1 + i)
            q = quantizer.quantize(w1[:, i].float(), int(order[i1 + i])).double()
            error = (w1[:, i] - q) / inv1[i, i]
            w1[:, i:] -= error[:, None] * inv1[i, i:][None, :]
            errors[:, i] = error
        w[:, i2:] -= errors @ inverse[i1:i2, i2:]


def pack_int4(values: np.ndarray, axis: int) -> np.ndarray:
    """Unsigned 4-bit values packed eight to an int32 along `axis`, lowest bits first (GPTQ's packing)."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    words = np.zeros(v.shape[:-1], np.uint32)
    for i in range(8):
        words |= v[..., i] << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def scheme_tensors(scheme: str, module: str, weight, hessian, damp: float) -> dict:
    """The checkpoint's tensors of one projection quantized by `scheme`."""
    import torch

    n, k = weight.shape
    if scheme == "fp8-channel":
        quantizer = FP8Channel(n, k)
        quantizer.fit(weight, 0)
        gptq(weight, hessian, quantizer, 128, damp)
        codes = torch.from_numpy(quantizer.codes).to(torch.float8_e4m3fn)
        return {f"{module}.weight": codes, f"{module}.weight_scale": torch.from_numpy(quantizer.scale)}
    group = int(scheme.removeprefix("w4a16-g"))
    quantizer = Int4Groups(n, k, group)
    gptq(weight, hessian, quantizer, group, damp)
    tensors = {
        "qweight": pack_int4(quantizer.codes.T, 0),
        "qzeros": pack_int4(quantizer.zero.T - 1, 1),
        "scales": quantizer.scale.T.astype(np.float16),
        "g_idx": (np.arange(k) // group).astype(np.int32),
    }
    return {f"{module}.{name}": torch.from_numpy(np.ascontiguousarray(value)) for name, value in tensors.items()}


def quantization_config(scheme: str) -> dict:
    if scheme == "fp8-channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        }
    group = int(scheme.removeprefix("w4a16-g"))
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False}


def main() -> None:
    args = parse_args()
    import torch
    import transformers
    from safetensors.torch import save_file

    schemes = args.schemes.split(",")
    for scheme in schemes:
        if scheme != "fp8-channel" and not (scheme.startswith("w4a16-g") and scheme[7:].isdigit()):
            raise SystemExit(f"unknown scheme {scheme!r}: w4a16-gG (G inputs a group) or fp8-channel")
    source = args.model or float_model(args.out)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    sums = None if args.rtn else hessians(model, tokenizer, args.samples, args.seq_len, args.calibration)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for scheme in schemes:
        tensors = {}
        for name, tensor in state.items():
            module, _, leaf = name.rpartition(".")
            projection = module.rsplit(".", 1)[-1]
            if leaf != "weight" or projection not in PROJECTIONS:
                tensors[name] = tensor
                continue
            shared = module.replace(projection, SHARED_INPUT.get(projection, projection))
            hessian = None if sums is None else sums[shared]
            tensors |= scheme_tensors(scheme, module, tensor, hessian, args.damp)
        directory = args.out / scheme
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((Path(source) / "config.json").read_text())
        config["quantization_config"] = quantization_config(scheme)
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        for file in Path(source).iterdir():
            if file.name not in ("model.safetensors", "config.json"):
                shutil.copy(file, directory / file.name)
        print(f"{directory}: {'round to nearest' if sums is None else 'GPTQ'}", file=sys.stderr)


if __name__ == "__main__":
    main()
