"""LoRA in the model (jaxpage.models.lora): the logits of a model with adapters in its slots are transformers + PEFT's
for each token's adapter, whatever adapters the other tokens of the batch use; tokens without one get the base
model's."""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import hf_logits
from peft_adapters import write_peft_adapter
from tiny_models import TINY_FAMILIES

from jaxpage.models import forward, load_model
from jaxpage.models.lora import LoRAInputs, adapter_slot, lora_modules, stack_slots
from jaxpage.models.lora_adapter import read_lora_adapter

FAMILIES = {f.name: f for f in TINY_FAMILIES}
PROMPT = [5, 9, 13, 2, 40, 9, 9, 31, 77, 3, 64, 12]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Each target module alone and together, ranks 4 to 16, alpha / r and rsLoRA's alpha / sqrt(r), some layers only.
ADAPTERS = {
    "all-r8": dict(target_modules=ALL, r=8, lora_alpha=16),
    "attention-r4-rslora": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], r=4, lora_alpha=8,
                                use_rslora=True),
    "mlp-r16-layer1": dict(target_modules=["gate_proj", "up_proj", "down_proj"], r=16, lora_alpha=4,
                           layers_to_transform=[1]),
    **{f"{m}-r2": dict(target_modules=[m], r=2, lora_alpha=2) for m in ALL},
}  # fmt: skip
MAX_RANK = 16


def slot_inputs(adapters: list, config, slots) -> LoRAInputs:
    weights = stack_slots(
        [a and adapter_slot(a, config, MAX_RANK, np.float32) for a in adapters], config, MAX_RANK, np.float32
    )
    return LoRAInputs(weights, np.asarray(slots, np.int32))


@pytest.fixture(scope="module")
def llama(tiny_model_dir, tmp_path_factory):
    """(config, params, transformers' model, {adapter name: (PEFT's model, jaxpage's LoRAAdapter)})."""
    directory, hf = tiny_model_dir(FAMILIES["llama3-gqa-rope-scaling"])
    config, params = load_model(directory)
    adapters = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        path = tmp_path_factory.mktemp(name)
        peft_model = write_peft_adapter(hf, path, seed=i, **kwargs)
        adapters[name] = (peft_model, read_lora_adapter(path, config, name=name))
    return config, params, hf, adapters


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_gives_peft_s_logits(llama, name):
    config, params, hf, adapters = llama
    peft_model, adapter = adapters[name]
    want = hf_logits(peft_model, PROMPT)
    lora = slot_inputs([None, adapter], config, [[1] * len(PROMPT)])  # slot 0 empty: the adapter in slot 1
    got = np.asarray(forward(config, params, [PROMPT], lora=lora))[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert np.abs(want - hf_logits(hf, PROMPT)).max() > 1e-2  # the adapter changes the logits


def test_a_batch_mixing_adapters_and_the_base_gives_each_its_own_logits(llama):
    config, params, hf, adapters = llama
    chosen = ["all-r8", "attention-r4-rslora", "mlp-r16-layer1"]
    lora_adapters = [adapters[name][1] for name in chosen]
    rows = [2, -1, 0, 1, 2]  # slot per row; -1: the base model
    lora = slot_inputs(lora_adapters, config, [[s] * len(PROMPT) for s in rows])
    got = np.asarray(forward(config, params, [PROMPT] * len(rows), lora=lora))
    for row, slot in enumerate(rows):
        model = hf if slot < 0 else adapters[chosen[slot]][0]
        np.testing.assert_allclose(got[row], hf_logits(model, PROMPT), atol=1e-4, rtol=1e-4)


def test_no_slot_is_exactly_the_base_model(llama):
    config, params, _, adapters = llama
    lora = slot_inputs([adapters["all-r8"][1]], config, [[-1] * len(PROMPT)])
    np.testing.assert_array_equal(forward(config, params, [PROMPT], lora=lora), forward(config, params, [PROMPT]))


@pytest.mark.parametrize("family", ["qwen2-qkv-bias", "qwen3-moe-norm-topk"])
def test_other_families_give_peft_s_logits(tiny_model_dir, tmp_path, family):
    """Biased projections (Qwen2), and a mixture of experts (Qwen3-MoE), whose adapters target the attention."""
    directory, hf = tiny_model_dir(FAMILIES[family])
    config, params = load_model(directory)
    targets = [m for m in ALL if m in lora_modules(config)]
    peft_model = write_peft_adapter(hf, tmp_path, target_modules=targets, r=8, lora_alpha=16, seed=3)
    lora = slot_inputs([read_lora_adapter(tmp_path, config, name="a")], config, [[0] * len(PROMPT)])
    got = np.asarray(forward(config, params, [PROMPT], lora=lora))[0]
    np.testing.assert_allclose(got, hf_logits(peft_model, PROMPT), atol=1e-4, rtol=1e-4)


def test_int8_base_weights_take_adapters_in_the_compute_dtype(llama, tiny_model_dir):
    """An int8 model's adapters stay in its compute dtype: the logits are its float twin's with the same adapters."""
    from test_int8 import dequantized

    config, _, _, adapters = llama
    int8_config, int8_params = load_model(tiny_model_dir(FAMILIES["llama3-gqa-rope-scaling"])[0], quantization="int8")
    rows = [0, -1]
    lora = slot_inputs([adapters["all-r8"][1]], config, [[s] * len(PROMPT) for s in rows])
    got = forward(int8_config, int8_params, [PROMPT] * 2, lora=lora)
    twin_config, twin_params = dequantized(int8_config, int8_params)
    want = forward(twin_config, twin_params, [PROMPT] * 2, lora=lora)
    # The int8 product rounds differently from its float twin's: test_int8's tolerance for the same comparison.
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
