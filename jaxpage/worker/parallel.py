"""Several devices: a JAX mesh with axes ("data", "model"), and how parameters and the KV pool are split over it.

Data parallelism (axis "data") gives each replica its own range of the pool's pages and the whole model (see
jaxpage.engine.replica and jaxpage.worker.executor.Executor.execute). Tensor parallelism splits the model as Megatron
does, over the axis "model" (TP shards):
    q/k/v projections and gate/up      by output columns (heads, intermediate features)
    o and down projections             by input rows (heads, intermediate features)
    embedding and LM head              by vocabulary
    norms, and o/down biases           replicated
    KV pool                            by KV heads
    LoRA slots (params["lora"])        as their projection: B by output for q/k/v/gate/up, A by input for o/down

Each shard runs the model on its slice under `jax.shard_map` (jaxpage.models.llama with `tp_axis`): two
all-reduces per layer (after the o and down projections), one for the embedding, and an all-gather of the
logits, so that sampling sees the full vocabulary. Attention needs no communication: a shard holds the query heads
and the KV heads they read.

When there are fewer KV heads than shards (kv_heads < tensor_parallel_size, which must divide it), each KV head is
copied at load time to the tensor_parallel_size / kv_heads shards whose query heads read it: the model then has
tensor_parallel_size KV heads (`with_replicated_kv_heads`), one per shard, and the pool and its budget hold the
copies. Nothing is repeated at run time.

Parameters are placed shard by shard while they load (`placement` gives load_model's `sharding`): no device ever
holds the whole model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpage.config import ModelConfig
from jaxpage.mesh_axes import DATA_AXIS, POOL_SPEC, SCALE_SPEC, TP_AXIS  # noqa: F401 (re-exported)

MESH_AXES = ("data", "model")
REPLICAS = P(DATA_AXIS)  # the spec of arrays stacked over the data-parallel replicas: one each

# The sharded axis of each parameter that is split (see jaxpage.models.llama for the tree); the rest is replicated.
_SPLIT_AXIS = {
    ("embed_tokens", "embedding"): 0,  # [V, D]
    ("layers", "attn", "q_proj", "kernel"): 2,  # [L, D, H, d]
    ("layers", "attn", "k_proj", "kernel"): 2,
    ("layers", "attn", "v_proj", "kernel"): 2,
    ("layers", "attn", "q_proj", "bias"): 1,  # [L, H, d]
    ("layers", "attn", "k_proj", "bias"): 1,
    ("layers", "attn", "v_proj", "bias"): 1,
    ("layers", "attn", "o_proj", "kernel"): 1,  # [L, H, d, D]
    ("layers", "mlp", "gate_proj", "kernel"): 2,  # [L, D, F]
    ("layers", "mlp", "up_proj", "kernel"): 2,
    ("layers", "mlp", "gate_proj", "bias"): 1,  # [L, F]
    ("layers", "mlp", "up_proj", "bias"): 1,
    ("layers", "mlp", "down_proj", "kernel"): 1,  # [L, F, D]
    ("lm_head", "kernel"): 1,  # [D, V]
    # int8 weights' scales (jaxpage.models.int8), one per output channel: split with their channels; the o and down
    # projections' ([L, D]) are replicated, applied to each shard's partial sum before the all-reduce.
    ("embed_tokens", "scale"): 0,  # [V]
    ("layers", "attn", "q_proj", "scale"): 1,  # [L, H, d]
    ("layers", "attn", "k_proj", "scale"): 1,
    ("layers", "attn", "v_proj", "scale"): 1,
    ("layers", "mlp", "gate_proj", "scale"): 1,  # [L, F]
    ("layers", "mlp", "up_proj", "scale"): 1,
    ("lm_head", "scale"): 0,  # [V]
    # Mixtures of experts (jaxpage.models.moe): every expert split by its features as the MLP is; router and the
    # shared expert's gate replicated.
    ("layers", "mlp", "experts", "gate_proj", "kernel"): 3,  # [L, E, D, F]
    ("layers", "mlp", "experts", "up_proj", "kernel"): 3,
    ("layers", "mlp", "experts", "down_proj", "kernel"): 2,  # [L, E, F, D]
    ("layers", "mlp", "experts", "gate_proj", "scale"): 2,  # [L, E, F]
    ("layers", "mlp", "experts", "up_proj", "scale"): 2,
    ("layers", "mlp", "shared_expert", "gate_proj", "kernel"): 2,  # [L, D, S]
    ("layers", "mlp", "shared_expert", "up_proj", "kernel"): 2,
    ("layers", "mlp", "shared_expert", "down_proj", "kernel"): 1,  # [L, S, D]
    ("layers", "mlp", "shared_expert", "gate_proj", "scale"): 1,  # [L, S]
    ("layers", "mlp", "shared_expert", "up_proj", "scale"): 1,
}
# Pre-quantized checkpoints' projections (jaxpage.models.quantized.dense: qweight [L, in, out] with the input and output
# axes flattened, qscale and qzero [L, in blocks, out blocks]): column-parallel ones split by output, row-parallel ones
# by input, each with its blocks' scales and zero points; an axis of one block (per-channel scales of a row-parallel
# projection, per-tensor ones) is replicated. act order's permutation (qperm) is replicated.
_COLUMN_PARALLEL = (
    ("attn", "q_proj"),
    ("attn", "k_proj"),
    ("attn", "v_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
)
_QUANTIZED_PARTS = ("qweight", "qscale", "qzero")
_SPLIT_AXIS |= {("layers", *m, part): 2 for m in _COLUMN_PARALLEL for part in _QUANTIZED_PARTS}
_SPLIT_AXIS |= {
    ("layers", *m, part): 1 for m in (("attn", "o_proj"), ("mlp", "down_proj")) for part in _QUANTIZED_PARTS
}
_SPLIT_AXIS |= {("lm_head", part): 1 for part in _QUANTIZED_PARTS}
# LoRA adapters' slots (jaxpage.models.lora: "a" [L, S, in, r], "b" [L, S, r, out]): a column-parallel projection's B
# split by its output features, a row-parallel one's A by its input features (each shard's partial product is summed
# with the base projection's by its all-reduce); the other factor replicated.
_SPLIT_AXIS |= {("lora", m, "b"): 3 for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
_SPLIT_AXIS |= {("lora", m, "a"): 2 for m in ("o_proj", "down_proj")}
# Expert parallelism instead splits the routed experts whole, by expert (axis 1 of [L, E, ...]), scales included.
_EXPERT_PARALLEL_AXIS = {
    ("layers", "mlp", "experts", projection, part): 1
    for projection in ("gate_proj", "up_proj", "down_proj")
    for part in ("kernel", "scale")
}
# Biases added after an all-reduce: every shard holds them, and only shard 0 adds them (see local_params).
_ROW_PARALLEL_BIASES = (("layers", "attn", "o_proj", "bias"), ("layers", "mlp", "down_proj", "bias"))
# The K/V projections, and their head axis.
_KV_PROJECTIONS = {
    ("layers", "attn", n, p): _SPLIT_AXIS[("layers", "attn", n, p)]
    for n in ("k_proj", "v_proj")
    for p in ("kernel", "bias", "scale")
}


def lora_shardings(mesh: Mesh, slots: dict) -> dict:
    """Where the LoRA slots' arrays (`slots`: {module: {"a", "b"}}, of arrays or shapes, for the model as run, its
    KV heads copied) live on `mesh`: split as their projections (see _SPLIT_AXIS)."""
    return param_shardings(mesh, None, {"lora": slots})["lora"]


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1, devices: list | None = None) -> Mesh:
    """The mesh ("data", "model") of shape (data_parallel_size, tensor_parallel_size) over the first devices;
    ValueError when there are fewer."""
    devices = jax.devices() if devices is None else devices
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp * dp > len(devices):
        layout = f"tensor_parallel_size {tp}" + (f" x data_parallel_size {dp}" if dp > 1 else "")
        raise ValueError(
            f"engine argument {layout} needs {tp * dp} devices, but {len(devices)} {devices[0].platform} device(s) "
            "are visible"
        )
    return Mesh(np.array(devices[: tp * dp]).reshape(dp, tp), MESH_AXES)


def check_divisible(config: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """ValueError naming the model's size that tensor_parallel_size `tp` does not divide."""
    sizes = [
        ("attention heads", config.num_heads),
        ("vocabulary size", config.vocab_size),
        ("intermediate size", config.intermediate_size),
    ]
    if config.is_moe:
        sizes.append(
            ("number of experts", config.num_experts)
            if expert_parallel
            else ("experts' intermediate size", config.moe_intermediate_size)
        )
        sizes.append(("shared expert's intermediate size", config.shared_expert_intermediate_size))
    problems = [f"{name} {value}" for name, value in sizes if value % tp]
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"KV heads {kv} (which must divide it or be divisible by it)")
    if config.weight_quantization is not None and tp > 1:
        problems += _quantized_problems(config, tp)
    if problems:
        raise ValueError(f"engine argument tensor_parallel_size {tp} does not divide the model's {', '.join(problems)}")


def _quantized_problems(config: ModelConfig, tp: int) -> list[str]:
    """What keeps a pre-quantized checkpoint's projections from splitting over `tp` shards with their blocks."""
    scheme, c = config.weight_quantization, config
    rows, cols = scheme.block
    problems = []
    if c.num_kv_heads < tp:
        problems.append(f"KV heads {c.num_kv_heads} (quantized K/V projections are split by head, not copied)")
    if scheme.act_order:
        problems.append(
            "act-order groups (desc_act: the o and down projections' input rows are permuted across shards)"
        )
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for what, features in (("columns", (qd, kd, c.intermediate_size)), ("input rows", (qd, c.intermediate_size))):
        block = cols if what == "columns" else rows
        shards = [n // tp for n in features if block > 1 and (n // tp) % block]
        if shards:
            problems.append(f"quantization blocks of {block} {what} (a shard has {shards[0]})")
    return problems


def with_replicated_kv_heads(config: ModelConfig, tp: int) -> ModelConfig:
    """The model as tensor parallelism runs it: with tp KV heads when it has fewer (each copied to the shards that
    read it), else unchanged."""
    if config.num_kv_heads >= tp:
        return config
    return dataclasses.replace(config, num_kv_heads=tp)


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """What one shard of `config` (already with_replicated_kv_heads) holds: its heads, features and vocabulary, and
    its share of each expert's features (without expert parallelism: with it, the model picks its experts by
    config.expert_parallel_size)."""
    expert_parallel = config.expert_parallel_size > 1
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp,
        num_kv_heads=config.num_kv_heads // tp,
        intermediate_size=config.intermediate_size // tp,
        vocab_size=config.vocab_size // tp,
        moe_intermediate_size=config.moe_intermediate_size if expert_parallel else config.moe_intermediate_size // tp,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // tp,
    )


def splits_experts(config: ModelConfig, tp: int, expert_parallel: bool) -> bool:
    """Whether `expert_parallel` splits the model's experts whole: a mixture of experts on more than one shard."""
    return expert_parallel and config.is_moe and tp > 1


def with_expert_parallel(config: ModelConfig, tp: int, expert_parallel: bool) -> ModelConfig:
    """The model as it runs: its routed experts split over the tp shards when splits_experts, else unchanged."""
    if not splits_experts(config, tp, expert_parallel):
        return config
    return dataclasses.replace(config, expert_parallel_size=tp)


def _path(key_path) -> tuple[str, ...]:
    return tuple(str(k.key) for k in key_path)


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], split: bool = True, expert_parallel: bool = False) -> P:
    """The PartitionSpec of the parameter at `path` of `shape`: split over "model" on its _SPLIT_AXIS (an axis of
    length 1, a scale over a whole axis, replicated)."""
    axis = (
        _EXPERT_PARALLEL_AXIS.get(path) if expert_parallel and path in _EXPERT_PARALLEL_AXIS else _SPLIT_AXIS.get(path)
    )
    if axis is None or not split or shape[axis] == 1:
        return P()
    return P(*(TP_AXIS if i == axis else None for i in range(len(shape))))


def param_specs(params, expert_parallel: bool = False) -> dict:
    """The PartitionSpec of every parameter (a tree like `params`, of arrays or shapes); `expert_parallel`: the
    routed experts split by expert (a model run with expert_parallel_size > 1)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: param_spec(_path(kp), x.shape, expert_parallel=expert_parallel), params
    )


def param_shardings(mesh: Mesh, config: ModelConfig | None, shapes, expert_parallel: bool = False) -> dict:
    """Where each parameter of the model as stored (`shapes`: its tree of shapes) goes as it loads: split over
    "model" as Megatron does (the routed experts by expert with `expert_parallel`), but K/V projections with fewer
    heads than shards replicated (replicate_kv_heads then makes a copy per shard). config None: the model as run
    (its KV heads already copied, every K/V projection split)."""
    tp = mesh.shape[TP_AXIS]
    split_kv = config is None or config.num_kv_heads % tp == 0

    def sharding(kp, x):
        path = _path(kp)
        split = split_kv or path not in _KV_PROJECTIONS
        return NamedSharding(mesh, param_spec(path, x.shape, split, expert_parallel))

    return jax.tree_util.tree_map_with_path(sharding, shapes)


def replicate_kv_heads(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """`params` of `config` as loaded, with each KV head copied to the shards that read it when there are fewer KV
    heads than shards (see with_replicated_kv_heads); K/V projections then split by head like the rest."""
    tp = mesh.shape[TP_AXIS]
    copies = tp // config.num_kv_heads if config.num_kv_heads < tp else 1
    if copies == 1:
        return params

    def copy(kp, x):
        path = _path(kp)
        if path not in _KV_PROJECTIONS:
            return x
        axis = _KV_PROJECTIONS[path]
        target = NamedSharding(mesh, param_spec(path, x.shape))
        return jax.jit(lambda a: jnp.repeat(a, copies, axis=axis), out_shardings=target)(x)

    return jax.tree_util.tree_map_with_path(copy, params)


def placement(mesh: Mesh, expert_parallel: bool = False):
    """load_model's `sharding` for tensor parallelism over `mesh` (and expert parallelism, for a mixture of experts):
    checks that the model divides, then gives each parameter's sharding as it is stored (param_shardings)."""
    from jaxpage.models.llama import param_shapes

    def shardings(config: ModelConfig) -> dict:
        split_experts = splits_experts(config, mesh.shape[TP_AXIS], expert_parallel)
        check_divisible(config, mesh.shape[TP_AXIS], split_experts)
        return param_shardings(mesh, config, param_shapes(config, jnp.float32), split_experts)

    return shardings


def as_run(
    config: ModelConfig, params: dict, mesh: Mesh | None, expert_parallel: bool = False
) -> tuple[ModelConfig, dict]:
    """The model as the engine runs it on `mesh` (None: one device, unchanged): with its KV heads copied where
    there are fewer than shards (with_replicated_kv_heads, replicate_kv_heads), its experts split by expert with
    `expert_parallel` (with_expert_parallel; placed so by placement(mesh, expert_parallel))."""
    if mesh is None:
        return config, params
    tp = mesh.shape[TP_AXIS]
    run_config = with_expert_parallel(with_replicated_kv_heads(config, tp), tp, expert_parallel)
    return run_config, replicate_kv_heads(params, config, mesh)


def local_params(params: dict) -> dict:
    """Inside shard_map: one shard's parameters as its model uses them (biases added after an all-reduce count on
    shard 0 only)."""
    first = jax.lax.axis_index(TP_AXIS) == 0

    def local(kp, x):
        return jnp.where(first, x, jnp.zeros_like(x)) if _path(kp) in _ROW_PARALLEL_BIASES else x

    return jax.tree_util.tree_map_with_path(local, params)


def device_bytes(tree) -> dict:
    """Bytes each device holds of the arrays in `tree`: {device: bytes}."""
    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def on_shards(fn, mesh: Mesh, param_specs: dict, in_specs: tuple, out_specs, gather: bool = False):
    """fn (whose first argument is the parameters) as each device of `mesh` runs it: its shard of the parameters
    (param_specs), the pool and the arrays as `in_specs` say, under shard_map. Arrays stacked over the data-parallel
    replicas (spec REPLICAS) reach fn as the device's replica's (and its results under REPLICAS are stacked back).
    gather (for results out_specs REPLICAS): every replica's results on every device, so that each process can
    read them all."""

    def unstack(tree):
        return jax.tree.map(lambda x: x[0], tree)

    def on_shard(params, *args):
        args = [unstack(a) if spec == REPLICAS else a for a, spec in zip(args, in_specs, strict=True)]
        out = fn(local_params(params) if mesh.shape[TP_AXIS] > 1 else params, *args)
        if out_specs == REPLICAS:
            out = jax.tree.map(lambda x: x[None], out)
            return jax.tree.map(lambda x: lax.all_gather(x, DATA_AXIS, tiled=True), out) if gather else out
        return tuple(
            jax.tree.map(lambda x: x[None], o) if spec == REPLICAS else o
            for o, spec in zip(out, out_specs, strict=True)
        )

    specs = (param_specs, *in_specs)
    # check_vma off: the attention loops carry values that vary over the shards from initial values that do
    # not, which its check refuses; what the programs return whole (P()) is the same on every shard by
    # construction (after an all-reduce or all-gather), as the tests that compare with one device show.
    outs = P() if gather else out_specs
    return jax.shard_map(on_shard, mesh=mesh, in_specs=specs, out_specs=outs, check_vma=False)
