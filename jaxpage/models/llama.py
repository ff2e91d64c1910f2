"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, and the mixtures of experts Mixtral, Qwen2-MoE and
Qwen3-MoE) as a functional Flax model.

Parameters are a plain pytree; `Llama(config, attention).apply({"params": params}, ...)` is pure and
jit-compiles. The decoder layers are scanned (`nn.scan`): every layer parameter has a leading
`num_layers` axis, and the model compiles one layer body whatever its depth (on a GPU, every layer: `layer_unroll`).

Parameter tree (D = hidden_size, H = num_heads, K = num_kv_heads, d = head_dim, F = intermediate_size,
L = num_layers, V = vocab_size); biases and q/k norms only where the config has them:

    embed_tokens/embedding                  [V, D]
    layers/input_norm/scale                 [L, D]
    layers/attn/{q,k,v}_proj/kernel         [L, D, H|K, d]   bias [L, H|K, d]
    layers/attn/{q,k}_norm/scale            [L, d]
    layers/attn/o_proj/kernel               [L, H, d, D]     bias [L, D]
    layers/post_attention_norm/scale        [L, D]
    layers/mlp/{gate,up}_proj/kernel        [L, D, F]        bias [L, F]
    layers/mlp/down_proj/kernel             [L, F, D]        bias [L, D]
    layers/mlp/...                          a mixture of experts instead (Mixtral, Qwen2-MoE, Qwen3-MoE): the
                                            MoEBlock tree of jaxpage.models.moe, each with the leading [L]
    norm/scale                              [D]
    lm_head/kernel                          [D, V]           (absent when embeddings are tied)
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpage.config import ModelConfig
from jaxpage.models.attention import Attention, DenseAttention, DenseBatch
from jaxpage.models.batch_invariant import invariant_dot_general, rowwise
from jaxpage.models.int8 import Int8DenseGeneral, Int8Embed, lm_head_method
from jaxpage.models.lora import LayerLoRA, LoRAInputs, add_lora, lora_of
from jaxpage.models.moe import MoEBlock, expert_method
from jaxpage.models.quantized.dense import QuantizedDense, is_quantized
from jaxpage.models.rope import apply_rope, rope_tables


def linear(
    config: ModelConfig, features, use_bias: bool, dtype, name: str, axis=-1, int8_method="dequantize", platform=None
):
    """A projection of the model: a pre-quantized checkpoint's (jaxpage.models.quantized.dense) on `platform`
    (default: jax's default backend), nn.DenseGeneral, or its int8 form for a quantized model (same parameter names),
    multiplied by `int8_method` (jaxpage.models.int8.int8_matmul)."""
    if is_quantized(config.weight_quantization, name):
        scheme = config.weight_quantization
        return QuantizedDense(features, scheme, axis, use_bias, dtype, platform, name=name)
    if config.quantization == "int8":
        return Int8DenseGeneral(features, axis, use_bias, dtype, int8_method, name=name)
    options = dict(dot_general=invariant_dot_general) if config.batch_invariant else {}
    return nn.DenseGeneral(features, axis, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name, **options)


class RMSNorm(nn.Module):
    """x / rms(x) * scale; with `offset` (Gemma: 1), * (offset + scale), computed in float32 as Gemma does."""

    eps: float
    dtype: jnp.dtype
    offset: float = 0.0
    batch_invariant: bool = False  # the mean of squares per row in fixed row tiles (jaxpage.models.batch_invariant)

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)

        def norm(x):
            x32 = x.astype(jnp.float32)
            normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
            if self.offset:
                return (normed * (self.offset + scale.astype(jnp.float32))).astype(x.dtype)
            return scale * normed.astype(x.dtype)  # cast before scaling, as transformers does

        # Batch-invariant: each row's in one shape, its sum and its rsqrt (jaxpage.models.batch_invariant.rowwise).
        return rowwise(norm, x) if self.batch_invariant else norm(x)


def rms_norm(config: ModelConfig, dtype, name: str | None = None) -> RMSNorm:
    return RMSNorm(config.rms_norm_eps, dtype, config.norm_weight_offset, config.batch_invariant, name=name)


def soft_cap(x, cap: float | None):
    """cap * tanh(x / cap) (Gemma's soft-capping of logits); x unchanged without a cap."""
    return x if cap is None else jnp.tanh(x / cap) * cap


class SelfAttention(nn.Module):
    config: ModelConfig
    attention: Attention
    dtype: jnp.dtype
    tp_axis: str | None = None
    platform: str | None = None  # the one compiled for (pre-quantized weights' products: jaxpage.models.quantized)

    @nn.compact
    def __call__(self, x, rope, batch, kv_cache, layer, lora: LayerLoRA = None, stacked: dict | None = None):
        """stacked: every layer's codes of the quantized projections, by name (Llama.stacked_codes), or None."""
        c = self.config

        def projection(heads, name):
            dense = linear(c, (heads, c.head_dim), c.qkv_bias, self.dtype, name, platform=self.platform)
            return add_lora(dense(x, **stacked_codes_of(stacked, name, layer)), x, *lora_of(lora, name))

        q = projection(c.num_heads, "q_proj")  # [..., H, d]
        k = projection(c.num_kv_heads, "k_proj")  # [..., K, d]
        v = projection(c.num_kv_heads, "v_proj")  # [..., K, d]
        if c.qk_norm:
            q = rms_norm(c, self.dtype, "q_norm")(q)
            k = rms_norm(c, self.dtype, "k_norm")(k)
        sliding = jnp.asarray(c.sliding_layers)[layer]  # this layer attends through the sliding window
        cos, sin = rope
        if c.rope_local_theta is not None:  # [2, ...]: the global layers' tables, the sliding layers' (Gemma 3)
            cos, sin = cos[sliding.astype(jnp.int32)], sin[sliding.astype(jnp.int32)]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = layer_attention(c, self.attention, sliding)(q, k, v, batch, kv_cache, layer)
        o_proj = linear(c, c.hidden_size, c.o_bias, self.dtype, "o_proj", axis=(-2, -1), platform=self.platform)
        out = add_lora(o_proj(out, **stacked_codes_of(stacked, "o_proj", layer)), out, *lora_of(lora, "o_proj"))
        return _all_reduce(out, self.tp_axis), kv_cache


def stacked_codes_of(stacked: dict | None, name: str, layer) -> dict:
    """The keyword arguments that give projection `name` every layer's codes and this layer's index (QuantizedDense's
    `stacked`): none where it has no codes there."""
    return {} if stacked is None or name not in stacked else {"stacked": (stacked[name], layer)}


def layer_attention(config: ModelConfig, attention: Attention, sliding: jax.Array) -> Attention:
    """The attention of a layer: through the sliding window where the config says so (`sliding`, traced: the layers
    are scanned; hybrids such as Gemma pick between two compiled attentions per layer with lax.cond, so each kernel
    keeps its window static and never reads outside it), soft-capped as the config says."""
    c = config

    def with_window(window: int | None) -> Attention:
        return dataclasses.replace(attention, sliding_window=window, soft_cap=c.attn_logit_softcapping)

    if not c.hybrid_attention:
        return with_window(c.sliding_window if c.sliding_layers[0] else None)
    local, full = with_window(c.sliding_window), with_window(None)

    def attend(q, k, v, batch, kv_cache, layer):
        # K/V stored once, outside the branches: a pool written inside both would be copied (XLA:GPU does).
        kv_cache = local.store(k, v, batch, kv_cache, layer)
        return jax.lax.cond(sliding, local.attend, full.attend, q, k, v, batch, kv_cache, layer), kv_cache

    return attend


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    tp_axis: str | None = None
    platform: str | None = None

    @nn.compact
    def __call__(self, x, lora: LayerLoRA = None, stacked: dict | None = None, layer=None):
        """stacked, layer: every layer's codes of the quantized projections (Llama.stacked_codes) and this layer's
        index, or None."""
        c = self.config

        def dense(features, name, x):
            dense = linear(c, features, c.mlp_bias, self.dtype, name, platform=self.platform)
            return add_lora(dense(x, **stacked_codes_of(stacked, name, layer)), x, *lora_of(lora, name))

        gate = dense(c.intermediate_size, "gate_proj", x)
        up = dense(c.intermediate_size, "up_proj", x)
        return _all_reduce(dense(c.hidden_size, "down_proj", activation(c)(gate) * up), self.tp_axis)


def activation(config: ModelConfig):
    """The MLP's gate activation: SiLU, or Gemma's GELU with the tanh approximation."""
    return nn.silu if config.hidden_act == "silu" else functools.partial(nn.gelu, approximate=True)


def _all_reduce(x, tp_axis: str | None):
    """The sum over the tensor-parallel shards of their partial results (none without tensor parallelism)."""
    return x if tp_axis is None else jax.lax.psum(x, tp_axis)


def feed_forward(
    config: ModelConfig, dtype, tp_axis: str | None, expert_method: str, platform: str | None = None
) -> nn.Module:
    """A layer's MLP: the dense one, or a mixture of experts (jaxpage.models.moe) computed by `expert_method`, whose
    tensor-parallel shards (a slice of every expert's features, or with expert parallelism a slice of the experts)
    are summed as the MLP's are."""
    c = config
    if not c.is_moe:
        return MLP(c, dtype, tp_axis, platform, name="mlp")
    expert_shards = c.expert_parallel_size if tp_axis is not None else 1  # the whole model (one device): every expert
    block = MoEBlock(
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.norm_topk_prob,
        c.shared_expert_intermediate_size,
        dtype,
        expert_method,
        c.quantization == "int8",
        tp_axis if expert_shards > 1 else None,
        expert_shards,
        name="mlp",
    )
    return lambda x, lora=None: _all_reduce(block(x), tp_axis)  # (adapters of the experts are refused when loaded)


class DecoderLayer(nn.Module):
    config: ModelConfig
    attention: Attention
    dtype: jnp.dtype
    tp_axis: str | None = None
    expert_method: str = "expert_loop"  # MoE models: jaxpage.models.moe.METHODS
    platform: str | None = None

    @nn.compact
    def __call__(self, carry, layer_inputs, rope, batch, lora_mask, stacked=None):
        """layer_inputs: (this layer's index, its slice of the LoRA slot weights or None); lora_mask: see
        jaxpage.models.lora.slot_mask (None without LoRA); stacked: Llama.stacked_codes."""
        x, kv_cache = carry
        layer, lora_weights = layer_inputs
        lora = None if lora_weights is None else (lora_weights, lora_mask, self.config.batch_invariant)
        c = self.config
        h, kv_cache = SelfAttention(c, self.attention, self.dtype, self.tp_axis, self.platform, name="attn")(
            rms_norm(c, self.dtype, "input_norm")(x), rope, batch, kv_cache, layer, lora, stacked and stacked["attn"]
        )
        if c.sandwich_norms:  # Gemma: the attention's and the MLP's outputs normed too
            h = rms_norm(c, self.dtype, "attn_output_norm")(h)
        x = x + h
        mlp = feed_forward(c, self.dtype, self.tp_axis, self.expert_method, self.platform)
        x_mlp = rms_norm(c, self.dtype, "post_attention_norm")(x)  # the norm before the MLP, by Llama's name
        h = mlp(x_mlp, lora) if stacked is None else mlp(x_mlp, lora, stacked["mlp"], layer)
        if c.sandwich_norms:
            h = rms_norm(c, self.dtype, "mlp_output_norm")(h)
        return (x + h, kv_cache), None


class Llama(nn.Module):
    """Decoder-only transformer. `__call__` gives final hidden states; `logits` applies the LM head.

    Shapes are generic over the token axes: `token_ids` and `positions` are int32 [...] ([batch, seq] on
    the dense path, [tokens] on the paged path) and the hidden states are [..., hidden_size].

    With `tp_axis` (tensor parallelism, see jaxpage.worker.parallel) it is one shard's model, run under shard_map over
    that mesh axis: `config` is the shard's (jaxpage.worker.parallel.shard_config), the partial results of the o and
    down projections and of the embedding are summed over the shards, and the logits are gathered whole.

    `platform` is the one the model is compiled for (None: jax's default backend): int8 weights' LM head is
    multiplied the way that platform does it fastest (jaxpage.models.int8.lm_head_method).
    """

    config: ModelConfig
    attention: Attention
    dtype: jnp.dtype = jnp.float32
    tp_axis: str | None = None
    platform: str | None = None

    def setup(self):
        c = self.config
        if c.quantization == "int8":
            self.embed_tokens = Int8Embed(c.vocab_size, c.hidden_size, self.dtype, lm_head_method(self.platform))
        else:
            self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        self.layers = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=c.num_layers,
            unroll=layer_unroll(c, self.platform),
        )(c, self.attention, self.dtype, self.tp_axis, expert_method(self.platform), self.platform)
        self.norm = rms_norm(c, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = linear(
                c,
                c.vocab_size,
                False,
                self.dtype,
                "lm_head",
                int8_method=lm_head_method(self.platform),
                platform=self.platform,
            )

    def __call__(self, token_ids, positions, batch, kv_cache=None, lora: LoRAInputs | None = None):
        """Returns (hidden [..., hidden_size] after the final norm, kv_cache after every layer). lora: the LoRA slot
        weights and each token's slot (jaxpage.models.lora)."""
        if self.tp_axis is None:
            x = self.embed_tokens(token_ids)
        else:  # this shard's rows of the vocabulary; zeros for the others' tokens
            local = token_ids - jax.lax.axis_index(self.tp_axis) * self.config.vocab_size
            here = (local >= 0) & (local < self.config.vocab_size)
            x = self.embed_tokens(jnp.where(here, local, 0)) * here[..., None].astype(self.dtype)
            x = jax.lax.psum(x, self.tp_axis)
        if self.config.embedding_multiplier is not None:  # Gemma: by sqrt(hidden_size), rounded to the dtype
            x = x * jnp.asarray(self.config.embedding_multiplier, self.dtype)
        rope = rope_tables(self.config, positions)
        if self.config.rope_local_theta is not None:  # Gemma 3's sliding layers' tables beside the global ones
            local = dataclasses.replace(
                self.config, rope_theta=self.config.rope_local_theta, rope_scaling=None, rope_freq_factors=None
            )
            rope = tuple(jnp.stack(tables) for tables in zip(rope, rope_tables(local, positions), strict=True))
        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        lora_weights, mask = (None, None) if lora is None else (lora.weights, lora.mask(self.dtype))
        stacked = self.stacked_codes()
        (x, kv_cache), _ = self.layers((x, kv_cache), (layer_ids, lora_weights), rope, batch, mask, stacked)
        return self.norm(x), kv_cache

    def stacked_codes(self) -> dict | None:
        """On a GPU, every layer's codes of the pre-quantized projections as stored ({"attn": {"q_proj": [layers, in,
        out], ...}, "mlp": {...}}), which the GPU kernel reads at each layer's index where they lie: given a layer's
        slice, XLA:GPU copies it first (28 MiB a step for an 8B int4 MLP weight). None elsewhere, and while the
        parameters are being made."""
        on_gpu = (self.platform or jax.default_backend()) == "gpu"
        if self.config.weight_quantization is None or not on_gpu or not self.has_variable("params", "layers"):
            return None
        layers = self.variables["params"]["layers"]
        return {
            block: {name: p["qweight"] for name, p in layers.get(block, {}).items() if "qweight" in p}
            for block in ("attn", "mlp")
        }

    def logits(self, hidden):
        """float32 logits [..., vocab_size] for hidden states [..., hidden_size]."""
        if self.config.tie_word_embeddings and self.config.batch_invariant:
            embedding = self.embed_tokens.embedding.astype(self.dtype)  # [V, D], contracted on D where it lies
            numbers = (((hidden.ndim - 1,), (1,)), ((), ()))
            logits = invariant_dot_general(hidden.astype(self.dtype), embedding, numbers).astype(jnp.float32)
        elif self.config.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden).astype(jnp.float32)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        if self.tp_axis is not None:  # each shard has its slice of the vocabulary
            logits = jax.lax.all_gather(logits, self.tp_axis, axis=logits.ndim - 1, tiled=True)
        return soft_cap(logits, self.config.final_logit_softcapping)


def layer_unroll(config: ModelConfig, platform: str | None = None) -> int:
    """How many layers one iteration of the scan over layers runs on `platform` (default: jax's default backend): all
    of them on a GPU, one elsewhere. XLA's GPU compiler copies each layer's slice of a stacked weight out of the
    scan's arrays before its matrix product (a device-to-device copy of every weight on every step: the Llama-3-8B
    shape's batch-1 decode step compiled with 880 MiB of temporaries, and ran at 22.7 ms on an H200 against 3.7 ms of
    weight reads); unrolled, the slices are static and the products read the weights where they lie (36 MiB of
    temporaries), for a longer compile. TPU's compiler reads the slices in place (unrolling there lengthens the
    compile and adds copies), and CPU's decode speed does not change (same-run A/B)."""
    return config.num_layers if (platform or jax.default_backend()) == "gpu" else 1


def build(
    config: ModelConfig, attention: Attention, dtype, tp_axis: str | None = None, platform: str | None = None
) -> Llama:
    return Llama(config, attention, jnp.dtype(dtype), tp_axis, platform)


def dense_model(config: ModelConfig, dtype, platform: str | None = None) -> Llama:
    """The model with cache-free causal attention (per padded row)."""
    return build(config, DenseAttention(sm_scale=config.attention_scale), dtype, platform=platform)


def param_shapes(config: ModelConfig, dtype, platform: str | None = None) -> dict:
    """The parameter pytree as jax.ShapeDtypeStruct leaves (as held on `platform`, default jax's default backend),
    without allocating anything."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype, platform))


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32, platform: str | None = None) -> dict:
    """Random parameters (Flax's default initializers); for tests and benchmarks without weights."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    batch = DenseBatch(positions=tokens, valid=jnp.ones((1, 1), bool))
    # Run the LM head too: linen creates a submodule's parameters only when it is called.
    model = dense_model(config, dtype, platform)
    return model.init(rng, tokens, tokens, batch, method=lambda m, *args: m.logits(m(*args)[0]))["params"]


def params_dtype(params: dict) -> jnp.dtype:
    """The dtype the model computes in: its float parameters' (int8 weights keep theirs apart)."""
    return params["norm"]["scale"].dtype


@functools.partial(jax.jit, static_argnames=("config",))
def _dense_logits(
    config: ModelConfig, params: dict, token_ids: jax.Array, valid: jax.Array, lora: LoRAInputs | None
) -> jax.Array:
    positions = jnp.maximum(jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1, 0)
    model = dense_model(config, params_dtype(params))
    variables = {"params": params}
    hidden, _ = model.apply(variables, token_ids, positions, DenseBatch(positions=positions, valid=valid), None, lora)
    return model.apply(variables, hidden, method=Llama.logits)


def forward(config: ModelConfig, params: dict, token_ids, attention_mask=None, lora: LoRAInputs | None = None):
    """Cache-free forward pass: float32 logits [batch, seq, vocab] for int token ids [batch, seq].

    `attention_mask` [batch, seq] (1 for tokens, 0 for padding, as in transformers) lets prompts of
    different lengths share a batch, padded on either side; positions count the real tokens of each row.
    Logits at padding positions are meaningless. `lora`: LoRA slot weights and each token's slot [batch, seq]
    (jaxpage.models.lora).
    """
    token_ids = jnp.asarray(token_ids, jnp.int32)
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be [batch, seq], got shape {token_ids.shape}")
    if attention_mask is None:
        valid = jnp.ones(token_ids.shape, bool)
    else:
        valid = jnp.asarray(attention_mask).astype(bool)
        if valid.shape != token_ids.shape:
            raise ValueError(f"attention_mask shape {valid.shape} differs from token_ids shape {token_ids.shape}")
    return _dense_logits(config, params, token_ids, valid, lora)
