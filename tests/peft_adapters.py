"""LoRA adapters written by Hugging Face PEFT itself, for the tests that read them (tests/test_lora_adapter.py) and
compare jaxpage's LoRA forward pass with PEFT's. Importing it imports torch and peft: only those tests import it."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model


def write_peft_adapter(
    hf_model,
    directory,
    *,
    target_modules,
    r: int,
    lora_alpha: float,
    use_rslora: bool = False,
    layers_to_transform=None,
    seed: int = 0,
    dtype=None,
):
    """Wraps a copy of transformers' `hf_model` (left as it is: the fixtures share it) in a random LoRA adapter, saves
    the adapter to `directory` (adapter_config.json + adapter_model.safetensors) and returns the PEFT model, in eval
    mode.

    The adapter's A and B are both random (init_lora_weights=False; PEFT's default leaves B zero), drawn from `seed`,
    so it changes the logits. dtype (torch.bfloat16, torch.float16): the file's dtype; the returned model holds the
    same rounded values in float32, so its logits are what a float32 engine computes from the file.
    """
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        use_rslora=use_rslora,
        layers_to_transform=layers_to_transform,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # the caller's random state stays as it was
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft 0.21
        torch.manual_seed(seed)
        model = get_peft_model(copy.deepcopy(hf_model), config)
    lora_weights = [p for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]
    model_dtype = lora_weights[0].dtype
    with torch.no_grad():
        for p in lora_weights:
            p.data = p.data.to(dtype or model_dtype)
        model.save_pretrained(str(Path(directory)))  # safetensors, PEFT's default
        for p in lora_weights:
            p.data = p.data.to(model_dtype)
    return model.eval()
