"""Pre-quantized checkpoints (jaxpage.config.weight_quantization, jaxpage.models.quantized): compressed-tensors'
schemes written by compressed-tensors and compared with transformers' dequantized model; AWQ, GPTQ and block-wise FP8
written from their specifications (tests/quantized_checkpoints.py) and compared with the float model holding their
dequantized weights; the engine's greedy tokens; every malformed tensor or unsupported setting named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from quantized_checkpoints import (
    awq_checkpoint,
    compressed_tensors_checkpoint,
    fp8_block_checkpoint,
    gptq_checkpoint,
)
from safetensors.numpy import load_file, save_file
from tiny_models import TINY_FAMILIES

from jaxpage.config.weight_quantization import weight_quantization_from_hf
from jaxpage.errors import ModelLoadError
from jaxpage.models import load_model
from jaxpage.models.llama import forward
from jaxpage.models.quantized.dense import code_dtype, fp8_products

FAMILY = next(f for f in TINY_FAMILIES if f.name == "llama3-gqa-rope-scaling")
TOKENS = [1, 5, 9, 33, 70, 2, 14, 88, 40, 3, 61, 17]


@pytest.fixture(scope="module")
def float_model(tiny_model_path):
    return tiny_model_path(FAMILY)


def jaxpage_logits(directory: Path) -> np.ndarray:
    config, params = load_model(directory)
    return np.asarray(forward(config, params, np.array([TOKENS]))[0])


def transformers_logits(directory: Path, **kwargs) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float().numpy()


INT4_GROUPS = dict(num_bits=4, type="int", strategy="group", group_size=32)
COMPRESSED_TENSORS_SCHEMES = {
    "w4a16-symmetric": ("pack-quantized", INT4_GROUPS | dict(symmetric=True), None),
    "w4a16-zero-points": ("pack-quantized", INT4_GROUPS | dict(symmetric=False), None),
    "w8a16-channel": ("pack-quantized", dict(num_bits=8, type="int", strategy="channel", symmetric=True), None),
    "fp8-channel-weights-only": ("float-quantized", dict(num_bits=8, type="float", strategy="channel"), None),
    "w8a8-fp8-per-token": (  # llm-compressor's FP8_DYNAMIC; a CPU multiplies the activations as they are
        "float-quantized",
        dict(num_bits=8, type="float", strategy="channel", symmetric=True),
        dict(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True),
    ),
    "w8a8-int8-per-token": (
        "int-quantized",
        dict(num_bits=8, type="int", strategy="channel", symmetric=True),
        dict(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True),
    ),
    "w8a8-int8-static": (
        "int-quantized",
        dict(num_bits=8, type="int", strategy="channel", symmetric=True),
        dict(num_bits=8, type="int", strategy="tensor", dynamic=False, symmetric=True),
    ),
}


@pytest.mark.parametrize("scheme", COMPRESSED_TENSORS_SCHEMES)
def test_compressed_tensors_checkpoints_give_transformers_logits(float_model, tmp_path, scheme):
    from transformers import CompressedTensorsConfig

    fmt, weights, activations = COMPRESSED_TENSORS_SCHEMES[scheme]
    directory, own = compressed_tensors_checkpoint(float_model, tmp_path / scheme, fmt, weights, activations, TOKENS)
    got = jaxpage_logits(directory)
    # compressed-tensors' own forward, activations quantized as the scheme says (int8 by each token's absmax or by
    # the static input_scale, float8 likewise: jaxpage quantizes FP8 activations only where the chip multiplies FP8)
    # A token's absmax lands exactly half a step past the last int8 code, so which code it takes turns on the last
    # bit of that token's values, which differ by float rounding between any two implementations: logits agree to
    # those flips (test_activations_are_quantized_as_compressed_tensors_quantizes_them checks one product exactly).
    quantizes_activations = activations is not None and (activations["type"] == "int" or fp8_products())
    if quantizes_activations or activations is None:
        dynamic = activations is not None and activations["dynamic"]
        np.testing.assert_allclose(got, own, atol=(2e-2 if dynamic else 2e-4) * np.abs(own).max())
    if not quantizes_activations:  # transformers' dequantized model (which multiplies activations as they are)
        want = transformers_logits(directory, quantization_config=CompressedTensorsConfig(dequantize=True))
        np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max())
    # and the quantization is there: the float model's logits differ by more than the tolerance
    assert np.abs(jaxpage_logits(float_model) - got).max() > 1e-2


def test_a_quantized_lm_head_is_read_and_multiplied_quantized(float_model, tmp_path):
    """compressed-tensors' "Linear" target with nothing ignored quantizes the (untied) LM head too."""
    weights = INT4_GROUPS | dict(symmetric=True)
    directory, own = compressed_tensors_checkpoint(float_model, tmp_path, "pack-quantized", weights, None, TOKENS, ())
    config, params = load_model(directory)
    assert "lm_head" in config.weight_quantization.quantized and "qweight" in params["lm_head"]
    np.testing.assert_allclose(jaxpage_logits(directory), own, atol=2e-4 * np.abs(own).max())


@pytest.mark.parametrize(
    ("dtype", "strategy"),
    [("int8", "token"), ("int8", "tensor"), ("float8_e4m3fn", "token"), ("float8_e4m3fn", "tensor")],
)
def test_activations_are_quantized_as_compressed_tensors_quantizes_them(dtype, strategy):
    """One product of a W8A8 scheme (FP8 as on a chip with FP8 products) against compressed-tensors' quantize and
    dequantize of the same activations and weights, multiplied in float32."""
    import jax.numpy as jnp
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from jaxpage.config.weight_quantization import WeightQuantization
    from jaxpage.models.quantized.dense import quantized_matmul

    kind = "int" if dtype == "int8" else "float"
    args = QuantizationArgs(num_bits=8, type=kind, strategy=strategy, dynamic=strategy == "token", symmetric=True)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 96)) * np.exp(rng.standard_normal((16, 1)))).astype(np.float32)
    weight = rng.standard_normal((96, 40)).astype(np.float32)
    w_scale = np.abs(weight).max(axis=0, keepdims=True) / (127 if dtype == "int8" else 448)
    codes = (weight / w_scale).round() if dtype == "int8" else weight / w_scale
    codes = jnp.asarray(codes, jnp.int8 if dtype == "int8" else jnp.float8_e4m3fn)
    params = {"qweight": codes, "qscale": jnp.asarray(w_scale)}
    if strategy == "token":
        scale, zero = compute_dynamic_scales_and_zp(torch.tensor(x)[None], args, None)
    else:
        scale, zero = torch.tensor([np.abs(x).max() / 100]), torch.zeros(1)  # static: some values clipped
        params["input_scale"] = jnp.asarray(scale.numpy()[0])
    want = fake_quantize(torch.tensor(x)[None], scale, zero.to(torch.int8), args)[0].numpy()
    want = want @ (np.asarray(codes.astype(jnp.float32)) * w_scale)
    scheme = WeightQuantization(
        "compressed-tensors", dtype, (0, 1), activations=dtype, static_activations="input_scale" in params
    )
    got = np.asarray(quantized_matmul(jnp.asarray(x), params, scheme, platform="gpu"))  # a chip with FP8 products
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
@pytest.mark.parametrize(("block", "zeros"), [((32, 1), True), ((32, 1), False), ((32, 16), False)])
def test_a_product_in_blocks_is_the_dequantized_weight_s_on_every_platform_s_path(rows, platform, block, zeros):
    """100 inputs in groups of 32 (the last one 4 short), 48 outputs: the grouped product (TPU, CPU, GPU decode) and
    the dequantized weight's (GPU prefill) against numpy's product with the weight the codes stand for."""
    import jax.numpy as jnp

    from jaxpage.config.weight_quantization import WeightQuantization
    from jaxpage.models.quantized.dense import quantized_matmul

    rng = np.random.default_rng(rows)
    k, n = 100, 48
    blocks = (-(-k // block[0]), n // block[1])
    codes = rng.integers(-8, 8, (k, n))
    scale = rng.uniform(0.01, 0.1, blocks).astype(np.float32)
    zero = rng.integers(-8, 8, blocks) if zeros else np.zeros(blocks, np.int64)
    full = lambda a: np.repeat(np.repeat(a, block[0], 0), block[1], 1)[:k, :n]  # noqa: E731
    weight = (codes - full(zero)) * full(scale)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    params = {"qweight": jnp.asarray(codes, jnp.int8), "qscale": jnp.asarray(scale)}
    if zeros:
        params["qzero"] = jnp.asarray(zero, jnp.int8)
    scheme = WeightQuantization("gptq", "int4", block, symmetric=not zeros)
    got = np.asarray(quantized_matmul(jnp.asarray(x), params, scheme, platform))
    np.testing.assert_allclose(got, x @ weight, rtol=1e-5, atol=1e-5 * np.abs(x @ weight).max())


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(awq_checkpoint, id="awq"),
        pytest.param(gptq_checkpoint, id="gptq-4bit-symmetric"),
        pytest.param(lambda src, tmp: gptq_checkpoint(src, tmp, desc_act=True, sym=False), id="gptq-desc-act-zeros"),
        pytest.param(lambda src, tmp: gptq_checkpoint(src, tmp, bits=8, group=-1), id="gptq-8bit-channel"),
        pytest.param(lambda src, tmp: gptq_checkpoint(src, tmp, group=40, sym=False), id="gptq-groups-cut-the-inputs"),
        pytest.param(fp8_block_checkpoint, id="fp8-blocks"),
    ],
)
def test_checkpoints_from_the_format_specifications_equal_their_dequantized_float_model(float_model, tmp_path, write):
    quantized, reference = write(float_model, tmp_path)
    want = transformers_logits(reference)
    np.testing.assert_allclose(jaxpage_logits(quantized), want, atol=1e-4 * np.abs(want).max())


def test_fp8_block_checkpoints_give_transformers_own_dequantized_logits(float_model, tmp_path):
    from transformers import FineGrainedFP8Config

    quantized, _ = fp8_block_checkpoint(float_model, tmp_path)
    want = transformers_logits(quantized, quantization_config=FineGrainedFP8Config(dequantize=True))
    np.testing.assert_allclose(jaxpage_logits(quantized), want, atol=1e-4 * np.abs(want).max())


def test_packed_weights_stay_packed_on_the_device(float_model, tmp_path):
    quantized, _ = gptq_checkpoint(float_model, tmp_path)
    config, params = load_model(quantized)
    q_proj = params["layers"]["attn"]["q_proj"]
    # int4 codes are packed two to a byte where XLA packs them (TPU, GPU); jax holds them a byte each on a CPU
    assert q_proj["qweight"].dtype == code_dtype(config.weight_quantization) and "kernel" not in q_proj
    assert code_dtype(config.weight_quantization, "tpu") == jax.numpy.int4
    layers, d = config.num_layers, config.hidden_size
    assert q_proj["qweight"].shape == (layers, d, config.num_heads * config.head_dim)
    assert q_proj["qscale"].shape == (layers, d // 32, config.num_heads * config.head_dim)


# ----- what is refused, and how -----


def damaged(directory: Path, tmp_path: Path, name: str, value: np.ndarray) -> Path:
    copy = Path(shutil.copytree(directory, tmp_path / "damaged"))
    tensors = load_file(str(copy / "model.safetensors"))
    tensors[name] = value
    save_file(tensors, str(copy / "model.safetensors"))
    return copy


SCALES, QWEIGHT = "model.layers.1.self_attn.k_proj.scales", "model.layers.0.mlp.down_proj.qweight"


@pytest.mark.parametrize(
    ("write", "name", "bad", "message"),
    [
        (awq_checkpoint, SCALES, np.ones((3, 5), np.float16), rf"'{SCALES}': scales has shape \(3, 5\)"),
        (
            gptq_checkpoint,
            QWEIGHT,
            np.zeros((7, 64), np.int32),
            rf"'{QWEIGHT}': qweight has shape \(7, 64\), expected \(12, 64\)",
        ),
    ],
    ids=["a-scale-of-the-wrong-shape", "a-packed-weight-of-the-wrong-size"],
)
def test_a_malformed_tensor_is_refused_naming_its_file_and_name(float_model, tmp_path, write, name, bad, message):
    quantized, _ = write(float_model, tmp_path)
    with pytest.raises(ModelLoadError, match=rf"model.safetensors: tensor {message}"):
        load_model(damaged(quantized, tmp_path, name, bad))


def test_a_missing_zero_point_tensor_is_refused_naming_it(float_model, tmp_path):
    quantized, _ = awq_checkpoint(float_model, tmp_path)
    tensors = load_file(str(quantized / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.qzeros"]
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="tensor 'model.layers.2.mlp.up_proj.qzeros' is missing"):
        load_model(quantized)


def test_int8_over_a_quantized_checkpoint_quantizes_only_what_it_leaves_in_floats(float_model, tmp_path):
    """quantization="int8" over a GPTQ checkpoint: its codes as they are, the embedding and the float LM head in int8
    by rows, so the logits are those of the dequantized float model holding those int8 rows; dummy weights alike."""
    quantized, reference = gptq_checkpoint(float_model, tmp_path)
    tensors = load_file(str(reference / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            scale = np.abs(tensors[name]).max(axis=1, keepdims=True) / 127
            tensors[name] = (np.rint(tensors[name] / scale) * scale).astype(np.float32)
    save_file(tensors, str(reference / "model.safetensors"), metadata={"format": "pt"})
    want = transformers_logits(reference)
    for load_format in ("auto", "dummy"):
        config, params = load_model(quantized, quantization="int8", load_format=load_format)
        assert params["embed_tokens"]["embedding"].dtype == np.int8
        assert params["layers"]["attn"]["q_proj"]["qweight"].dtype == code_dtype(config.weight_quantization)
        if "lm_head" in params:
            assert params["lm_head"]["kernel"].dtype == np.int8
    config, params = load_model(quantized, quantization="int8")
    got = np.asarray(forward(config, params, np.array([TOKENS]))[0])
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max())


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128}
CT_GROUP = {"targets": ["Linear"], "format": "pack-quantized"}
CT_W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


def compressed_tensors(group: dict, **settings) -> dict:
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": CT_GROUP | group}} | settings


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (GPTQ | {"bits": 3}, "quantization_config.bits 3 is not supported"),
        (GPTQ | {"group_size": 0}, "quantization_config.group_size must be a positive integer or -1, got 0"),
        (GPTQ | {"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format 'marlin' is not supported"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "quantization_config.version 'gemv' is not supported"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "quantization_config.zero_point false"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quantization_config.weight_block_size must be"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
        ({"bits": 4}, "quantization_config {'bits': 4} is not supported"),
        (compressed_tensors({"weights": CT_W4 | {"num_bits": 2}}), "config_groups.group_0.weights.num_bits 2 is not"),
        (compressed_tensors({"weights": CT_W4 | {"type": "fp4"}}), "config_groups.group_0.weights.type 'fp4' is not"),
        (compressed_tensors({"weights": CT_W4, "format": "nvfp4-pack-quantized"}), "group_0.format 'nvfp4-pack"),
        (
            compressed_tensors(
                {
                    "weights": CT_W4,
                    "input_activations": {
                        "num_bits": 8,
                        "type": "int",
                        "strategy": "token",
                        "dynamic": True,
                        "symmetric": False,
                    },
                }
            ),
            "config_groups.group_0.input_activations.symmetric false is not supported",
        ),  # fmt: skip
        (
            compressed_tensors({"weights": CT_W4, "output_activations": {"num_bits": 8}}),
            "config_groups.group_0.output_activations is not supported",
        ),
        (
            compressed_tensors({"weights": CT_W4}, ignore=["model.layers.0.mlp.down_proj"]),
            "quantization_config.ignore leaves model.layers.0.mlp.down_proj in floats in one layer only",
        ),
        (compressed_tensors({"weights": CT_W4}, kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme is not supported"),
    ],
)
def test_unsupported_quantization_settings_are_refused_naming_the_field(settings, message):
    with pytest.raises(ModelLoadError) as error:
        weight_quantization_from_hf({"quantization_config": settings}, "config.json")
    assert str(error.value).startswith("config.json: ") and message in str(error.value), str(error.value)


def test_a_quantized_mixture_of_experts_is_refused_by_name(tiny_model_path, tmp_path):
    moe = next(f for f in TINY_FAMILIES if f.name.startswith("mixtral"))
    directory = Path(shutil.copytree(tiny_model_path(moe), tmp_path / "moe"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"quantization_config": GPTQ}))
    with pytest.raises(ModelLoadError, match="a quantized mixture of experts .mixtral. is not supported yet"):
        load_model(directory)


# ----- the engine, tensor parallelism, LoRA -----


def test_the_engine_s_greedy_tokens_are_the_dequantized_float_model_s_on_one_and_two_devices(float_model, tmp_path):
    """AWQ (groups of 16 input rows, zero points): the engine's tokens on one device and with the projections split
    over two (each shard its columns or input rows with their groups' scales and zero points) equal the float
    model's with the same weights."""
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.sampling_params import SamplingParams

    quantized, reference = awq_checkpoint(float_model, tmp_path, group=16)
    args = dict(skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4, page_size=4, num_pages=64)
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 90 + 2 for j in range(4 + 5 * i)]} for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def tokens(model, **extra):
        return [o.outputs[0].token_ids for o in LLM(str(model), **args, **extra).generate(prompts, greedy)]

    want = tokens(reference)
    assert tokens(quantized) == want
    split = LLM(str(quantized), **args, tensor_parallel_size=2)
    qweight = split.engine.runner.params["layers"]["mlp"]["down_proj"]["qweight"]
    assert {tuple(s.data.shape) for s in qweight.addressable_shards} == {(3, 96 // 2, 64)}  # split by input rows
    assert [o.outputs[0].token_ids for o in split.generate(prompts, greedy)] == want


def test_tensor_parallelism_refuses_groups_a_shard_would_cut(float_model, tmp_path):
    from jaxpage.entrypoints.llm import LLM

    quantized, _ = awq_checkpoint(float_model, tmp_path, group=32)  # intermediate size 96: 48 rows a shard
    with pytest.raises(ValueError, match="quantization blocks of 32 input rows .a shard has 48."):
        LLM(str(quantized), skip_tokenizer_init=True, max_model_len=64, num_pages=32, tensor_parallel_size=2)


def test_lora_adapters_apply_on_top_of_quantized_weights(float_model, tmp_path):
    """A PEFT adapter over GPTQ weights: PEFT's logits on the float model holding the dequantized weights."""
    from peft_adapters import write_peft_adapter
    from test_lora_model import ALL, slot_inputs

    from jaxpage.models.lora_adapter import read_lora_adapter

    quantized, reference = gptq_checkpoint(float_model, tmp_path, desc_act=True, sym=False)
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
    peft_model = write_peft_adapter(hf, tmp_path / "adapter", target_modules=ALL, r=8, lora_alpha=16, seed=1)
    config, params = load_model(quantized)
    lora = slot_inputs([read_lora_adapter(tmp_path / "adapter", config, name="a")], config, [[0] * len(TOKENS)])
    got = np.asarray(forward(config, params, [TOKENS], lora=lora))[0]
    with torch.no_grad():
        want = peft_model(torch.tensor([TOKENS])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
