"""The mixture-of-experts block (jaxpage.models.moe): routing against a numpy reference for each family's rule (ties
and unrouted experts included), both expert methods against the dense reference, one compilation per token count
whatever the routing, the shared expert, and parity with transformers' own Mixtral, Qwen2-MoE and Qwen3-MoE blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.models.moe import METHODS, MoEBlock, expert_method, loop_chunk_rows, moe_dense_reference, route

HIDDEN = 16
# Each family's routing rule: (name, normalize_topk). Qwen2-MoE's norm_topk_prob defaults to False, Qwen3-MoE
# checkpoints set it.
FAMILIES = [("mixtral", True), ("qwen2_moe", False), ("qwen3_moe", True)]


def route_reference(logits: np.ndarray, top_k: int, normalize_topk: bool) -> tuple[np.ndarray, np.ndarray]:
    """numpy routing: the top_k logits of each row, ties to the lowest expert index (a stable sort of the negated
    logits), weighted by the float64 softmax over all experts, renormalized over the chosen ones when asked."""
    logits = np.asarray(logits, np.float64)
    expert_ids = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    weights = np.take_along_axis(probs, expert_ids, axis=-1)
    if normalize_topk:
        weights /= weights.sum(axis=-1, keepdims=True)
    return weights, expert_ids


def random_params(block: MoEBlock, seed: int) -> dict:
    """Normal parameters of the block's tree, scaled by each kernel's fan-in (axis -2): the tree from jax.eval_shape
    of its init, which traces the block without compiling it."""
    shapes = jax.eval_shape(block.init, jax.random.key(0), jnp.zeros((1, HIDDEN)))["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(s.shape[-2]), s.dtype), shapes)


def outputs_of_every_method(block: MoEBlock):
    """One jitted function (params, x [..., D]) -> {method: the block's output by it, "dense": moe_dense_reference}:
    a single compilation per shape covers every method and the reference."""
    blocks = {method: block.clone(method=method) for method in METHODS}

    @jax.jit
    def outputs(params, x):
        out = {method: b.apply({"params": params}, x) for method, b in blocks.items()}
        flat = x.reshape(-1, x.shape[-1])
        out["dense"] = moe_dense_reference(params, flat, block.top_k, block.normalize_topk).reshape(x.shape)
        return out

    return outputs


def assert_methods_match_dense(out: dict) -> None:
    for method in METHODS:
        np.testing.assert_allclose(out[method], out["dense"], atol=1e-5, rtol=1e-5, err_msg=method)


@pytest.mark.parametrize("family,normalize_topk", FAMILIES)
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_route_matches_numpy_reference_with_ties(family, normalize_topk, top_k):
    rng = np.random.default_rng(top_k)
    logits = rng.integers(-2, 3, (64, 6)).astype(np.float32)  # five values over six experts: ties in every row
    logits[0] = 1.0  # all equal: experts 0..k-1
    logits[1] = [0, 3, 3, 0, 3, 3]  # a tie for first place: experts 1, 2, 4
    logits[2] = rng.standard_normal(6)  # no tie
    weights, expert_ids = route(jnp.asarray(logits), top_k, normalize_topk)
    expected_weights, expected_ids = route_reference(logits, top_k, normalize_topk)
    assert weights.dtype == jnp.float32 and expert_ids.dtype == jnp.int32
    np.testing.assert_array_equal(expert_ids, expected_ids)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(expert_ids[0], np.arange(top_k))
    np.testing.assert_array_equal(expert_ids[1], [1, 2, 4][:top_k])
    if normalize_topk:  # Mixtral's original form: the softmax over the chosen logits alone
        chosen = np.take_along_axis(logits, expected_ids, axis=-1).astype(np.float64)
        np.testing.assert_allclose(weights, np.exp(chosen) / np.exp(chosen).sum(-1, keepdims=True), rtol=1e-6)


def test_route_keeps_a_bfloat16_routers_ties_and_weighs_in_float32():
    logits = jnp.asarray([[1.0, 1.0078125, 1.0, -3.0]], jnp.bfloat16)  # 1 + 2^-7: the next bfloat16 after 1
    weights, expert_ids = route(logits, 2, False)
    np.testing.assert_array_equal(expert_ids, [[1, 0]])
    expected, _ = route_reference(np.asarray(logits, np.float32), 2, False)
    np.testing.assert_allclose(weights, expected, rtol=1e-6)
    assert weights.dtype == jnp.float32


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k",
    [
        (1, 8, 2),  # a single decode token: 6 experts receive nothing
        (7, 4, 4),  # every token to every expert
        (64, 2, 1),  # groups of ~32 rows: several chunks of the expert loop per expert
    ],
)
def test_block_matches_dense_reference(num_tokens, num_experts, top_k):
    block = MoEBlock(num_experts, top_k, 24, normalize_topk=top_k > 1)
    x = jax.random.normal(jax.random.key(1), (num_tokens, HIDDEN))
    assert_methods_match_dense(outputs_of_every_method(block)(random_params(block, num_tokens), x))


def test_int8_experts_match_the_dense_reference_of_their_dequantized_weights():
    """int8 weights (quantization="int8"): the experts' and the shared expert's kernels int8 with a scale per expert
    and output channel, the router and the shared expert's gate in floats; each method scales the right rows."""
    block = MoEBlock(4, 2, 24, normalize_topk=False, shared_expert_intermediate_size=20, quantized=True)
    x = jax.random.normal(jax.random.key(1), (33, HIDDEN))
    params = jax.jit(block.init)(jax.random.key(0), x)["params"]
    experts = params["experts"]
    assert {name: (p["kernel"].dtype, p["scale"].shape) for name, p in experts.items()} == {
        "gate_proj": (jnp.int8, (4, 24)),
        "up_proj": (jnp.int8, (4, 24)),
        "down_proj": (jnp.int8, (4, HIDDEN)),
    }
    assert params["shared_expert"]["down_proj"]["kernel"].dtype == jnp.int8
    assert params["router"]["kernel"].dtype == params["shared_expert_gate"]["kernel"].dtype == jnp.float32
    out = outputs_of_every_method(block)(params, x)
    assert np.abs(out["dense"]).max() > 0.1
    assert_methods_match_dense(out)


def test_one_compilation_per_token_count_whatever_the_routing():
    num_tokens, num_experts, top_k = 12, 4, 2
    block = MoEBlock(num_experts, top_k, 24, normalize_topk=True)
    params = random_params(block, 0)
    outputs = outputs_of_every_method(block)
    router = np.asarray(params["router"]["kernel"])
    spread = jax.random.normal(jax.random.key(1), (num_tokens, HIDDEN))
    padding = jnp.zeros((num_tokens, HIDDEN))  # equal logits: every row to experts 0 and 1, none to 2 and 3
    # Rows along expert 3's router column (less the others' mean): expert 3 first for every token.
    toward_3 = np.tile(router[:, 3] - router[:, :3].mean(axis=1), (num_tokens, 1)) * 10
    group_sizes = set()
    for x in (spread, padding, jnp.asarray(toward_3, jnp.float32)):
        _, expert_ids = route(x @ params["router"]["kernel"], top_k, True)
        group_sizes.add(tuple(np.bincount(np.asarray(expert_ids).ravel(), minlength=num_experts)))
        assert_methods_match_dense(outputs(params, x))
    assert len(group_sizes) == 3 and (num_tokens, num_tokens, 0, 0) in group_sizes
    assert outputs._cache_size() == 1


def test_shared_expert_adds_its_gated_mlp():
    routed_only = MoEBlock(4, 2, 24, normalize_topk=False)
    with_shared = MoEBlock(4, 2, 24, normalize_topk=False, shared_expert_intermediate_size=20)
    params = random_params(with_shared, 0)
    routed = {name: params[name] for name in ("router", "experts")}
    assert (
        jax.tree.map(jnp.shape, random_params(routed_only, 0))
        == jax.tree.map(jnp.shape, routed)
        == {
            "router": {"kernel": (HIDDEN, 4)},
            "experts": {
                "gate_proj": {"kernel": (4, HIDDEN, 24)},
                "up_proj": {"kernel": (4, HIDDEN, 24)},
                "down_proj": {"kernel": (4, 24, HIDDEN)},
            },
        }
    )
    assert jax.tree.map(jnp.shape, {name: params[name] for name in ("shared_expert", "shared_expert_gate")}) == {
        "shared_expert": {
            "gate_proj": {"kernel": (HIDDEN, 20)},
            "up_proj": {"kernel": (HIDDEN, 20)},
            "down_proj": {"kernel": (20, HIDDEN)},
        },
        "shared_expert_gate": {"kernel": (HIDDEN, 1)},
    }

    @jax.jit
    def shared_part(params, x):  # with the shared expert, less without it
        return with_shared.apply({"params": params}, x) - routed_only.apply({"params": routed}, x)

    x = jax.random.normal(jax.random.key(2), (2, 5, HIDDEN))  # any leading axes
    shared = params["shared_expert"]
    mlp = jax.nn.silu(x @ shared["gate_proj"]["kernel"]) * (x @ shared["up_proj"]["kernel"])
    gate = jax.nn.sigmoid(x @ params["shared_expert_gate"]["kernel"])
    np.testing.assert_allclose(shared_part(params, x), gate * (mlp @ shared["down_proj"]["kernel"]), atol=1e-5)


def test_method_choice_and_chunks():
    assert expert_method("cpu") == "expert_loop"
    assert expert_method("tpu") == expert_method("gpu") == "ragged_dot"
    assert [loop_chunk_rows(rows, 8) for rows in (2, 64, 256, 1024, 8192)] == [8, 8, 16, 64, 64]
    with pytest.raises(ValueError, match="method must be one of"):
        jax.eval_shape(MoEBlock(4, 2, 8, True, method="dense").init, jax.random.key(0), jnp.zeros((1, HIDDEN)))


# transformers' blocks: (family, its config's arguments besides hidden_size).
HF_BLOCKS = [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)),
    (
        "qwen2_moe",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            norm_topk_prob=False,
        ),
    ),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True)),
]


def hf_sparse_moe_block(family: str, config_args: dict):
    """transformers' float32 MoE block of `family` with random weights, and its config."""
    import torch
    from transformers.models.mixtral import configuration_mixtral, modeling_mixtral
    from transformers.models.qwen2_moe import configuration_qwen2_moe, modeling_qwen2_moe
    from transformers.models.qwen3_moe import configuration_qwen3_moe, modeling_qwen3_moe

    config_class, block_class = {
        "mixtral": (configuration_mixtral.MixtralConfig, modeling_mixtral.MixtralSparseMoeBlock),
        "qwen2_moe": (configuration_qwen2_moe.Qwen2MoeConfig, modeling_qwen2_moe.Qwen2MoeSparseMoeBlock),
        "qwen3_moe": (configuration_qwen3_moe.Qwen3MoeConfig, modeling_qwen3_moe.Qwen3MoeSparseMoeBlock),
    }[family]
    config = config_class(hidden_size=HIDDEN, experts_implementation="eager", **config_args)
    torch.manual_seed(0)
    block = block_class(config).eval()
    with torch.no_grad():
        for parameter in block.parameters():  # some are torch.empty
            parameter.normal_(std=0.3)
    return block, config


def params_from_hf(block) -> dict:
    """MoEBlock parameters from transformers' block: the fused experts.gate_up_proj [E, 2F, D] (gate rows first) and
    experts.down_proj [E, D, F] of transformers >= 5, and the [out, in] linears, transposed."""
    state = {name: tensor.detach().numpy() for name, tensor in block.state_dict().items()}
    shared = {f"shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")} | {"shared_expert_gate.weight"}
    expected = {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    assert set(state) in (expected, expected | shared), f"an expert layout this test does not know: {sorted(state)}"
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    intermediate = down.shape[-1]
    params = {
        "router": {"kernel": state["gate.weight"].T},
        "experts": {
            "gate_proj": {"kernel": gate_up[:, :intermediate].transpose(0, 2, 1)},
            "up_proj": {"kernel": gate_up[:, intermediate:].transpose(0, 2, 1)},
            "down_proj": {"kernel": down.transpose(0, 2, 1)},
        },
    }
    if "shared_expert_gate.weight" in state:
        projections = ("gate_proj", "up_proj", "down_proj")
        params["shared_expert"] = {p: {"kernel": state[f"shared_expert.{p}.weight"].T} for p in projections}
        params["shared_expert_gate"] = {"kernel": state["shared_expert_gate.weight"].T}
    return jax.tree.map(jnp.asarray, params)


@pytest.mark.parametrize("family,config_args", HF_BLOCKS, ids=[family for family, _ in HF_BLOCKS])
def test_matches_transformers_moe_block(family, config_args):
    import torch  # the test extras' CPU build: the reference only

    hf_block, config = hf_sparse_moe_block(family, config_args)
    block = MoEBlock(
        num_experts=config.num_experts,  # Mixtral's num_local_experts, by its attribute_map
        top_k=config.num_experts_per_tok,
        intermediate_size=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
        normalize_topk=getattr(config, "norm_topk_prob", True),  # Mixtral always renormalizes
        shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0),
    )
    params = params_from_hf(hf_block)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, random_params(block, 0))
    x = np.random.default_rng(3).standard_normal((2, 9, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        expected = hf_block(torch.from_numpy(x)).numpy()
    for name, out in outputs_of_every_method(block)(params, jnp.asarray(x)).items():
        np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5, err_msg=name)
