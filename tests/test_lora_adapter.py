"""LoRA adapters as Hugging Face PEFT saves them (jaxpage.models.lora_adapter), and the LoRARequest that names one.

Adapters are written by PEFT itself (tests/peft_adapters.py) over the tiny models: what jaxpage reads must give, for
every module and layer, PEFT's own lora_B(lora_A(x)) * scaling. Every refusal is built by editing such an adapter.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tiny_models import TINY_FAMILIES

from jaxpage.errors import ModelLoadError
from jaxpage.lora_request import LoRARequest
from jaxpage.models.hf_loader import read_hf_config
from jaxpage.models.lora_adapter import LORA_TARGETS, read_lora_adapter

FAMILIES = {f.name: f for f in TINY_FAMILIES}
GQA = FAMILIES["llama3-gqa-rope-scaling"]  # 4 heads, 2 KV heads
MQA_BIASES = FAMILIES["llama-mqa-biases"]  # 1 KV head, biases on every projection
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# ----- LoRARequest -----


def test_lora_request_keeps_vllms_fields_in_vllms_order():
    request = LoRARequest("sql", 1, "/adapters/sql")
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("sql", 1, "/adapters/sql")
    assert request == LoRARequest(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
    assert len({request, LoRARequest("sql", 1, "/adapters/sql")}) == 1  # frozen: hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.lora_int_id = 2
    normalized = LoRARequest("sql", np.int64(3), Path("/adapters/sql"))
    assert (type(normalized.lora_int_id), normalized.lora_path) == (int, "/adapters/sql")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("", 1, "/a"), r"LoRARequest.lora_name must be a non-empty string, got ''"),
        ((None, 1, "/a"), r"LoRARequest.lora_name must be a string, got None"),
        (("a", 0, "/a"), r"LoRARequest.lora_int_id must be an integer >= 1, got 0"),
        (("a", -3, "/a"), r"LoRARequest.lora_int_id must be an integer >= 1, got -3"),
        (("a", True, "/a"), r"LoRARequest.lora_int_id must be an integer >= 1, got True"),
        (("a", 1.0, "/a"), r"LoRARequest.lora_int_id must be an integer >= 1, got 1.0"),
        (("a", 1, ""), r"LoRARequest.lora_path must be a non-empty path, got ''"),
        (("a", 1, None), r"LoRARequest.lora_path must be a path \(str or os.PathLike\), got None"),
    ],
)
def test_lora_request_refuses_bad_fields(args, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(*args)


# ----- adapters PEFT wrote, read back -----


def write_adapter(tiny_model_dir, family, directory, **lora):
    """(the base model's config, PEFT's model) after PEFT wrote a random adapter of `family` into directory."""
    from peft_adapters import write_peft_adapter

    model_dir, hf_model = tiny_model_dir(family)
    return read_hf_config(model_dir), write_peft_adapter(hf_model, directory, **lora)


def peft_modules(peft_model, layer: int) -> dict:
    """module name -> PEFT's module of that name in the layer (a LoRA layer where adapted, a Linear elsewhere)."""
    block = peft_model.base_model.model.model.layers[layer]
    return {m: getattr(block.self_attn if m in ATTENTION else block.mlp, m) for m in LORA_TARGETS}


def assert_matches_peft(adapter, peft_model, num_layers: int):
    """For every module and layer, x @ a @ b is PEFT's lora_B(lora_A(x)) * scaling; zero where PEFT adapts nothing."""
    import torch

    adapted = set()
    for layer in range(num_layers):
        for module, peft_module in peft_modules(peft_model, layer).items():
            if not hasattr(peft_module, "lora_A"):  # not adapted here
                if module in adapter.weights:
                    assert not adapter.weights[module][0][layer].any() and not adapter.weights[module][1][layer].any()
                continue
            adapted.add(module)
            a, b = (w[layer] for w in adapter.weights[module])
            x = torch.randn(5, a.shape[0], generator=torch.Generator().manual_seed(layer))
            with torch.no_grad():
                lora_a, lora_b = peft_module.lora_A["default"], peft_module.lora_B["default"]
                expected = (lora_b(lora_a(x)) * peft_module.scaling["default"]).numpy()
            np.testing.assert_allclose(x.numpy() @ a @ b, expected, rtol=1e-5, atol=1e-6)
            assert np.abs(expected).max() > 0.1  # a real delta, not zeros
    assert set(adapter.weights) == adapted


CASES = {
    "gqa-all-7": (GQA, dict(target_modules=list(LORA_TARGETS), r=8, lora_alpha=16)),
    "mqa-biases-all-7": (MQA_BIASES, dict(target_modules=list(LORA_TARGETS), r=8, lora_alpha=16)),
    "gqa-attention-rslora": (GQA, dict(target_modules=ATTENTION, r=4, lora_alpha=8, use_rslora=True)),
    "mqa-biases-layer-1": (
        MQA_BIASES, dict(target_modules=list(LORA_TARGETS), r=8, lora_alpha=16, layers_to_transform=[1])
    ),
    "gqa-regex": (GQA, dict(target_modules=r".*\.layers\.[02]\.self_attn\.(q|v)_proj", r=2, lora_alpha=3)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_reads_what_peft_computes(tiny_model_dir, tmp_path, case):
    family, lora = CASES[case]
    config, peft_model = write_adapter(tiny_model_dir, family, tmp_path, **lora)
    adapter = read_lora_adapter(tmp_path, config, name="mine")
    r, alpha = lora["r"], lora["lora_alpha"]
    scaling = alpha / np.sqrt(r) if lora.get("use_rslora") else alpha / r
    assert (adapter.name, adapter.rank) == ("mine", r)
    assert adapter.scaling == pytest.approx(scaling, rel=1e-12)
    for module, (a, b) in adapter.weights.items():
        linear = peft_modules(peft_model, 0)[module]  # torch's Linear, or PEFT's LoRA layer around one
        assert a.dtype == b.dtype == np.float32
        assert a.shape == (config.num_layers, linear.in_features, r)
        assert b.shape == (config.num_layers, r, linear.out_features)
    assert_matches_peft(adapter, peft_model, config.num_layers)
    if case == "mqa-biases-layer-1":
        assert all(not a[[0, 2]].any() and not b[[0, 2]].any() for a, b in adapter.weights.values())
    if case == "gqa-regex":
        assert set(adapter.weights) == {"q_proj", "v_proj"}


def test_peft_adapter_changes_the_logits_and_leaves_the_base_model(tiny_model_dir, tmp_path):
    import torch

    _, hf_model = tiny_model_dir(GQA)
    before = {name: p.clone() for name, p in hf_model.state_dict().items()}
    _, peft_model = write_adapter(tiny_model_dir, GQA, tmp_path, target_modules=list(LORA_TARGETS), r=8, lora_alpha=16)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        base, adapted = hf_model(ids).logits, peft_model(ids).logits
    assert (adapted - base).abs().max() > 0.5
    assert all(torch.equal(before[name], p) for name, p in hf_model.state_dict().items())
    assert set(before) == set(hf_model.state_dict())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reads_half_precision_adapters(tiny_model_dir, tmp_path, dtype):
    import torch
    from safetensors import safe_open

    lora = dict(target_modules=list(LORA_TARGETS), r=8, lora_alpha=16)
    config, peft_model = write_adapter(tiny_model_dir, GQA, tmp_path / "half", dtype=getattr(torch, dtype), **lora)
    write_adapter(tiny_model_dir, GQA, tmp_path / "f32", **lora)  # the same seed: the same weights, unrounded
    with safe_open(str(tmp_path / "half" / "adapter_model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {getattr(torch, dtype)}
    half = read_lora_adapter(tmp_path / "half", config)
    full = read_lora_adapter(tmp_path / "f32", config)
    assert_matches_peft(half, peft_model, config.num_layers)  # the model holds the file's rounded values
    for module in LORA_TARGETS:
        for h, f in zip(half.weights[module], full.weights[module], strict=True):
            assert h.dtype == np.float32
            # half an ulp: 2^-8 of bfloat16's 8 bits, 2^-11 of float16's 11, and float16's subnormals' 2^-25
            rtol, atol = (2**-8, 0) if dtype == "bfloat16" else (2**-11, 2**-25)
            np.testing.assert_allclose(h, f, rtol=rtol, atol=atol)
            assert not np.array_equal(h, f)  # rounded indeed


def test_all_linear_is_every_target(written, tmp_path):
    directory, config = written
    expected = read_lora_adapter(directory, config)
    for shorthand in ("all-linear", "ALL-LINEAR"):
        edited = edit_json(directory, tmp_path / shorthand, target_modules=shorthand)
        adapter = read_lora_adapter(edited, config)
        assert set(adapter.weights) == set(LORA_TARGETS)
        for module in LORA_TARGETS:
            for x, y in zip(adapter.weights[module], expected.weights[module], strict=True):
                np.testing.assert_array_equal(x, y)


def test_attention_adapter_of_a_mixture_of_experts_model(tiny_model_dir, tmp_path):
    config, _ = write_adapter(tiny_model_dir, GQA, tmp_path, target_modules=ATTENTION, r=4, lora_alpha=4)
    adapter = read_lora_adapter(tmp_path, moe(config))
    assert set(adapter.weights) == set(ATTENTION)


# ----- refusals -----


@pytest.fixture(scope="module")
def written(tiny_model_dir, tmp_path_factory):
    """(directory, base config) of a rank-8 adapter of all seven projections, which the refusals edit."""
    directory = tmp_path_factory.mktemp("adapter")
    config, _ = write_adapter(tiny_model_dir, GQA, directory, target_modules=list(LORA_TARGETS), r=8, lora_alpha=16)
    return directory, config


def moe(config):
    return dataclasses.replace(config, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def edit_json(source: Path, directory: Path, **fields) -> Path:
    shutil.copytree(source, directory)
    path = directory / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))
    return directory


def edit_tensors(source: Path, directory: Path, edit) -> Path:
    shutil.copytree(source, directory)
    path = directory / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return directory


def test_refusals_name_the_adapter_and_its_path(written, tmp_path):
    directory, config = written
    edited = edit_json(directory, tmp_path / "dora", use_dora=True)
    with pytest.raises(ModelLoadError, match=rf"^LoRA adapter 'mine' \({re.escape(str(edited))}\): use_dora"):
        read_lora_adapter(edited, config, name="mine")
    with pytest.raises(ModelLoadError, match=r"^LoRA adapter 'dora' \("):  # the directory's name by default
        read_lora_adapter(edited, config)


A = "base_model.model.model.layers.{}.self_attn.q_proj.lora_A.weight"
JSON_REFUSALS = {
    "peft-type": (dict(peft_type="LOHA"), r"peft_type is 'LOHA'; jaxpage reads only LoRA adapters"),
    "dora": (dict(use_dora=True), r"use_dora is true: jaxpage does not support DoRA"),
    "modules-to-save": (dict(modules_to_save=["lm_head", "score"]), r"modules_to_save \['lm_head', 'score'\]: fully"),
    "bias": (dict(bias="lora_only"), r"bias 'lora_only': trained biases are not supported"),
    "rank-pattern": (dict(rank_pattern={"q_proj": 4}), r'rank_pattern is {"q_proj": 4}: jaxpage does not support a'),
    "alpha-pattern": (dict(alpha_pattern={"q_proj": 4}), r"alpha_pattern is .*: jaxpage does not support an alpha per"),
    "fan-in-fan-out": (dict(fan_in_fan_out=True), r"fan_in_fan_out is true: jaxpage does not support weights in"),
    "lora-bias": (dict(lora_bias=True), r"lora_bias is true: jaxpage does not support a bias on lora_B"),
    "phi3-fused-qkv": (dict(target_modules=["o_proj", "qkv_proj"]), r"target module 'qkv_proj' is not supported"),
    "phi3-fused-mlp": (dict(target_modules=["gate_up_proj"]), r"target module 'gate_up_proj' is not supported"),
    "embeddings": (dict(target_modules=["q_proj", "embed_tokens"]), r"target module 'embed_tokens' is not supported"),
    "lm-head": (dict(target_modules=["lm_head"]), r"target module 'lm_head' is not supported"),
    "targets-type": (dict(target_modules=7), r"target_modules must be a list of module names or a regular expression"),
    "bad-regex": (dict(target_modules="(q_proj"), r"not a valid regular expression"),
    "regex-matches-nothing": (dict(target_modules=r".*\.lm_head"), r"target_modules .* matches none of q_proj, k_proj"),
    "regex-with-layers": (dict(target_modules=".*", layers_to_transform=[0]), r"layers_to_transform cannot be used"),
    "layers-beyond": (dict(layers_to_transform=[1, 3, 7]), r"layers_to_transform names layers \[3, 7\]; the base"),
    "layers-pattern": (dict(layers_to_transform=[0], layers_pattern="h"), r"layers_pattern 'h'"),
    "r-zero": (dict(r=0), r"r must be an integer >= 1, got 0"),
    "r-float": (dict(r=8.0), r"r must be an integer >= 1, got 8.0"),
    "alpha": (dict(lora_alpha="16"), r"lora_alpha must be a number, got '16'"),
    "r-other-than-the-tensors": (
        dict(r=4), r"tensor '.*layers\.0\.self_attn\.q_proj\.lora_A\.weight' has shape \[8, 64\], expected \[4, 64\]"
    ),
    "tensors-of-untargeted-layers": (dict(layers_to_transform=[0, 2]), r"holds '[^']*\.layers\.1\.[^']*', a module"),
    "tensors-of-excluded-modules": (dict(exclude_modules=["k_proj"]), r"holds '.*\.k_proj\.lora_A\.weight', a module"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(JSON_REFUSALS))
def test_refuses_adapter_configs(written, tmp_path, case):
    directory, config = written
    fields, match = JSON_REFUSALS[case]
    with pytest.raises(ModelLoadError, match=match):
        read_lora_adapter(edit_json(directory, tmp_path / "adapter", **fields), config)


def test_refuses_missing_and_unreadable_files(written, tmp_path):
    directory, config = written
    with pytest.raises(ModelLoadError, match=r"\): no such directory"):
        read_lora_adapter(tmp_path / "nowhere", config)
    no_config = shutil.copytree(directory, tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no adapter_config.json; not a PEFT adapter directory"):
        read_lora_adapter(no_config, config)
    pickled = shutil.copytree(directory, tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(ModelLoadError, match=r"no adapter_model.safetensors \(adapter_model.bin are pickled PyTorch "
                       r"files, which jaxpage never unpickles\)"):  # fmt: skip
        read_lora_adapter(pickled, config)
    for text, match in (
        ("{not json", r"adapter_config.json is not readable JSON"),
        ("[1]", r"must hold a JSON object"),
    ):
        bad = shutil.copytree(directory, tmp_path / f"bad-{len(text)}")
        (bad / "adapter_config.json").write_text(text)
        with pytest.raises(ModelLoadError, match=match):
            read_lora_adapter(bad, config)
    truncated = shutil.copytree(directory, tmp_path / "truncated")
    path = truncated / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=rf"^LoRA adapter 'truncated' .*{re.escape(str(path))}: truncated"):
        read_lora_adapter(truncated, config)


TENSOR_REFUSALS = {
    "missing": (
        lambda t: t.pop("base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"),
        r"no tensor '.*layers\.2\.mlp\.down_proj\.lora_B\.weight' in adapter_model.safetensors, though "
        r"adapter_config.json targets down_proj of layer 2",
    ),
    "lm-head": (
        lambda t: t.update({"base_model.model.lm_head.lora_A.weight": np.zeros((8, 64), np.float32)}),
        r"unexpected tensor 'base_model.model.lm_head.lora_A.weight'",
    ),
    "adapter-name-kept": (
        lambda t: t.update({A.format(0).replace("lora_A.", "lora_A.default."): t.pop(A.format(0))}),
        r"unexpected tensor '.*q_proj\.lora_A\.default\.weight'",
    ),
    "wrong-parent": (
        lambda t: t.update({A.format(0).replace("self_attn", "mlp"): t.pop(A.format(0))}),
        r"unexpected tensor '.*layers\.0\.mlp\.q_proj\.lora_A\.weight'",
    ),
    "layer-beyond": (
        lambda t: t.update({A.format(3): t[A.format(0)]}),
        r"tensor '.*layers\.3\.self_attn\.q_proj\.lora_A\.weight' is of layer 3; the base model has 3 layers",
    ),
    "shape": (
        lambda t: t.update({A.format(1): t[A.format(1)][:, :32]}),
        r"tensor '.*layers\.1\.self_attn\.q_proj\.lora_A\.weight' has shape \[8, 32\], expected \[8, 64\]",
    ),
}


@pytest.mark.parametrize("case", list(TENSOR_REFUSALS))
def test_refuses_adapter_tensors(written, tmp_path, case):
    directory, config = written
    edit, match = TENSOR_REFUSALS[case]
    with pytest.raises(ModelLoadError, match=match):
        read_lora_adapter(edit_tensors(directory, tmp_path / "adapter", edit), config)


def test_refuses_an_adapter_of_another_base_model(written, tiny_model_path):
    directory, config = written
    other = read_hf_config(tiny_model_path(MQA_BIASES))  # one KV head where the adapter's model has two
    with pytest.raises(ModelLoadError, match=r"k_proj\.lora_B\.weight' has shape \[32, 8\], expected \[16, 8\]"):
        read_lora_adapter(directory, other)
    with pytest.raises(ModelLoadError, match=r"is of layer 2; the base model has 2 layers"):
        read_lora_adapter(directory, dataclasses.replace(config, num_layers=2))


def test_refuses_the_mlp_of_a_mixture_of_experts_model(written):
    directory, config = written
    with pytest.raises(
        ModelLoadError, match=r"targets the MLP's gate_proj, up_proj, down_proj of a mixture-of-experts"
    ):
        read_lora_adapter(directory, moe(config))


def test_refuses_ranks_above_max_lora_rank(written):
    directory, config = written
    assert read_lora_adapter(directory, config, max_rank=8).rank == 8
    with pytest.raises(ModelLoadError, match=r"rank 8 is larger than max_lora_rank 4"):
        read_lora_adapter(directory, config, max_rank=4)
